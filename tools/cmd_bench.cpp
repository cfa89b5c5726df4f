// flashlm bench: the LM's forward, forward+backward and train step timed over sizes, contexts, precisions
// and attention implementations (run_lm_bench), with the profiling tables and traces it can record.
#include <chrono>

#include <nlohmann/json.hpp>

#include "cli_common.h"
#include "flashlm/device.h"
#include "flashlm/memory.h"
#include "flashlm/profile.h"

namespace {

struct BenchArgs {
  flashlm::LmBenchConfig cfg;
  std::string model = "small", context = "512", precision = "fp32", attention = "flash", pass = "fwd,fwd-bwd,step";
  std::string device, memory_timeline, trace;
  int threads = 0;
  ReportOptions report;
  CLI::Option *context_option = nullptr, *vocab_option = nullptr;
  ConditionalModelOptions model_options;
};

// The allocation timeline as JSON: {"events": [{"t_ms", "delta_bytes", "current_bytes", "tag", "phase",
// "device"}, ...]}.
void write_memory_timeline(const std::vector<flashlm::MemoryEvent>& events, const std::string& path) {
  nlohmann::json doc;
  doc["tool"] = "flashlm memory timeline";
  doc["events"] = nlohmann::json::array();
  for (const auto& e : events) {
    doc["events"].push_back({{"t_ms", e.time_ms}, {"delta_bytes", e.delta_bytes}, {"current_bytes", e.current_bytes},
                             {"tag", e.tag}, {"phase", e.phase}, {"device", flashlm::device_name(e.device)}});
  }
  write_output(doc.dump(1) + "\n", path);
}

int run(BenchArgs& a) {
  using namespace flashlm;
  LmBenchConfig& cfg = a.cfg;
  cfg.models = split_list(a.model);
  for (const auto& m : cfg.models) ModelConfig::named(m);  // an unknown size is a usage error
  cfg.contexts = parse_list<int64_t>("--context", a.context, positive_up_to(kMaxContext));
  if (!cfg.model_config_file.empty()) {
    std::vector<std::string> keys;
    const ModelConfig file = ModelConfig::from_json_file(cfg.model_config_file, &keys);  // so is a bad description
    // A list of contexts given is the sweep; vocab 0 (not given) is the file's already (run_lm_bench).
    if (cfg.contexts.size() == 1) {
      cfg.contexts = {model_config_value("context", keys, file.context, a.context_option, cfg.contexts.front())};
    }
    if (cfg.vocab > 0) cfg.vocab = model_config_value("vocab", keys, file.vocab, a.vocab_option, cfg.vocab);
  }
  cfg.precisions = split_list(a.precision);
  bool any_fp8 = false;
  for (const auto& p : cfg.precisions) {
    DType dtype;
    bool pure, fp8;
    parse_precision(p, dtype, pure, fp8);
    any_fp8 = any_fp8 || fp8;
  }
  cfg.attention = parse_list<AttentionImpl>("--attention", a.attention,
                                            [](const std::string& s) { return parse_attention_impl(s); });
  cfg.passes = split_list(a.pass);
  cfg.device = device_or_default(a.device);
  refuse_unused_model_options(a.model_options, cfg.options, cfg.device, any_fp8);
  for (const auto& p : cfg.precisions) {  // --grad-dtype bf16 applies to every precision of the sweep, or is refused
    ModelOptions o = cfg.options;
    DType dtype;
    parse_precision(p, dtype, o.bf16_pure, o.fp8);
    o.check_grad_dtype(dtype, cfg.device);
  }
  report_format(a.report);  // a bad --format is refused before the runs
  require_usable_device(cfg.device);
  if (a.threads > 0) set_cpu_threads(a.threads);
  if (!a.report.quiet) cfg.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
  cfg.trace_ranges = !a.trace.empty();
  const bool timeline = !a.memory_timeline.empty() || !a.trace.empty();
  // The trace puts the timeline on the ranges' steady clock from here (microseconds before its own start).
  const int64_t timeline_origin_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                         std::chrono::steady_clock::now().time_since_epoch())
                                         .count();
  if (timeline) memory_timeline_start();
  const auto records = run_lm_bench(cfg);
  if (timeline) {
    const std::vector<MemoryEvent> events = memory_timeline_stop();
    if (!a.memory_timeline.empty()) write_memory_timeline(events, a.memory_timeline);
    if (!a.trace.empty()) {
      std::vector<RangeInstance> ranges;
      for (const auto& r : records) ranges.insert(ranges.end(), r.ranges.begin(), r.ranges.end());
      write_output(chrome_trace_json(ranges, events, timeline_origin_ns), a.trace);
    }
  }
  emit_report([&](ReportFormat f) { return format_lm_bench(records, f, cfg); }, a.report);
  for (const auto& r : records) {
    if (!r.range_table.empty()) {
      fmt::print("\n** NVTX range summary (nvtx_sum): {} ctx {} {} {}, {} timed '{}' steps\n{}", r.model, r.context,
                 r.precision, r.attention, cfg.steps, r.pass, r.range_table);
    }
    if (!r.kernel_table.empty()) {
      fmt::print("\n** CUDA GPU kernel summary (cuda_gpu_kern_sum): {} ctx {} {} {}, {} timed '{}' steps\n{}", r.model,
                 r.context, r.precision, r.attention, cfg.steps, r.pass, r.kernel_table);
    }
  }
  return 0;
}

}  // namespace

Command add_bench_command(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  flashlm::LmBenchConfig& cfg = a->cfg;
  CLI::App* cmd = app.add_subcommand("bench", "Time the LM's forward, forward+backward and full train step");
  cmd->add_option("--model", a->model, "Sizes, comma list of tiny,small,medium,large,xl,2.7B,cs336-8b")
      ->capture_default_str();
  cmd->add_option("--model-config", cfg.model_config_file,
                  "A JSON model description instead of --model ({\"base\": SIZE, \"d_model\": ..., \"d_ff\", "
                  "\"layers\", \"heads\", \"vocab\", \"context\", \"rope_theta\", \"norm_eps\"}); its vocab and "
                  "context hold unless --vocab or --context is given");
  a->context_option = cmd->add_option("--context", a->context, "Context lengths, comma list")->capture_default_str();
  cmd->add_option("--batch", cfg.batch, "Sequences per step")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, kMaxBatch));
  a->vocab_option = cmd->add_option("--vocab", cfg.vocab,
                                    "Vocabulary size (default: the size's own: 151936 for cs336-8b, else 10000)")
                        ->check(in_range(int64_t{2}, kMaxVocab));
  cmd->add_option("--precision", a->precision,
                  "Comma list of fp32, bf16 (fp32 masters), fp16, bf16-pure (parameters, gradients and AdamW moments "
                  "in bf16), fp8 (bf16 with the blocks' linear layers as FP8 GEMMs, tensorwise scaled), bf16-pure-fp8 (the "
                  "same GEMMs over bf16-pure)")
      ->capture_default_str();
  a->model_options =
      add_model_options(cmd, cfg.options,
                        {.cuda_graph = true, .overlap_grad_norm = true, .fp8 = true, .grad_dtype = true});
  cmd->add_option("--attention", a->attention, "Comma list of flash,naive")->capture_default_str();
  cmd->add_option("--pass", a->pass, "Comma list of fwd,fwd-bwd,step")->capture_default_str();
  cmd->add_option("--warmup", cfg.warmup, "Untimed steps first")->capture_default_str()->check(in_range(0, kMaxReps));
  cmd->add_option("--steps", cfg.steps, "Timed steps")->capture_default_str()->check(in_range(1, kMaxReps));
  cmd->add_option("--device", a->device, "cpu or cuda (default: cuda if a GPU is visible)");
  add_threads_option(cmd, a->threads);
  cmd->add_flag("--profile-ranges", cfg.profile_ranges,
                "After the table, the nvtx_sum table (nsys stats format) of each configuration's timed steps");
  cmd->add_flag("--profile-kernels", cfg.profile_kernels,
                "After the table, the cuda_gpu_kern_sum table (nsys stats format, from CUPTI) of each "
                "configuration's timed steps (--device cuda)");
  cmd->add_option("--memory-timeline", a->memory_timeline,
                  "Write every allocation and release (time, bytes, tag, phase) as JSON; draw it with "
                  "scripts/plot_memory_timeline.py");
  cmd->add_option("--trace", a->trace,
                  "Write the timed steps' ranges (as --profile-ranges times them) and the memory in use over the run "
                  "as a Chrome trace (JSON trace events) that ui.perfetto.dev and chrome://tracing open");
  cmd->add_option("--gemm-autotune", cfg.gemm_autotune,
                  "Time up to this many of cuBLASLt's candidate algorithms for each GEMM shape at its first call and "
                  "keep the fastest (the choices are printed unless --quiet); 0: the heuristic's first choice "
                  "(--device cuda)")
      ->capture_default_str()
      ->check(CLI::Range(0, 64));
  add_report_options(cmd, a->report);
  return {cmd, [a] { return run(*a); }};
}
