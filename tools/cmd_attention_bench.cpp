// flashlm attention-bench: attention forward and backward timed over a grid of shapes (run_attention_bench).
#include "cli_common.h"
#include "flashlm/attention.h"
#include "flashlm/device.h"

namespace {

struct AttentionBenchArgs {
  flashlm::AttentionBenchConfig cfg;
  std::string impl = "naive,flash", dtype = "fp32", d = "64", seq = "1024,2048,4096", batch = "1", heads = "1";
  std::string causal = "0", align = "top-left", device, grid, window;
  int threads = 0;
  int64_t kv_heads = 0;
  bool forward_only = false;
  ReportOptions report;
  CLI::Option* grid_option = nullptr;
};

int run(AttentionBenchArgs& a) {
  using namespace flashlm;
  AttentionBenchConfig& cfg = a.cfg;
  cfg.impls = parse_list<AttentionImpl>("--impl", a.impl, [](const std::string& s) { return parse_attention_impl(s); });
  cfg.dtypes = parse_list<DType>("--dtype", a.dtype, [](const std::string& s) { return parse_dtype(s); });
  if (a.grid_option->count() > 0) {
    cfg.shapes = attention_named_grid(a.grid);
  } else {
    cfg.shapes = attention_shape_grid(parse_list<int64_t>("--d", a.d, positive_up_to(kMaxHeadDim)),
                                      parse_list<int64_t>("--seq", a.seq, positive_up_to(kMaxSeq)),
                                      parse_list<int64_t>("--batch", a.batch, positive_up_to(kMaxBatch)),
                                      parse_list<int64_t>("--heads", a.heads, positive_up_to(kMaxHeads)),
                                      parse_list<bool>("--causal", a.causal, parse_bool));
  }
  for (AttentionShape& shape : cfg.shapes) {
    if (a.kv_heads != 0 && shape.heads % a.kv_heads != 0) {
      throw InvalidArgument(fmt::format("--kv-heads: {} does not divide the head count {}", a.kv_heads, shape.heads));
    }
    shape.kv_heads = a.kv_heads;
  }
  cfg.align = parse_causal_align(a.align);
  if (!a.window.empty()) {
    // L,R: flash-attn's window_size, -1 leaving a side unbounded.
    const auto sides = parse_list<int64_t>("--window", a.window, [](const std::string& x) {
      size_t used = 0;
      const int64_t w = std::stoll(x, &used);
      if (used != x.size() || w < -1 || w > kMaxSeq) {
        throw InvalidArgument(fmt::format("'{}' is not -1 or a number of keys from 0 to {}", x, kMaxSeq));
      }
      return w;
    });
    if (sides.size() != 2) throw InvalidArgument(fmt::format("--window: expected L,R (two numbers), got '{}'", a.window));
    cfg.window_left = sides[0];
    cfg.window_right = sides[1];
  }
  cfg.device = device_or_default(a.device);
  report_format(a.report);  // a bad --format is refused before the sweep
  require_usable_device(cfg.device);
  if (a.threads > 0) set_cpu_threads(a.threads);
  cfg.backward = !a.forward_only;
  if (!a.report.quiet) cfg.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };

  const auto records = run_attention_bench(cfg);
  emit_report([&](ReportFormat f) { return format_attention_bench(records, f, cfg); }, a.report);
  return 0;
}

}  // namespace

Command add_attention_bench_command(CLI::App& app) {
  auto a = std::make_shared<AttentionBenchArgs>();
  CLI::App* cmd = app.add_subcommand("attention-bench", "Time attention forward and backward over a grid of shapes");
  cmd->add_option("--impl", a->impl, "Implementations, comma list of naive,flash")->capture_default_str();
  cmd->add_option("--dtype", a->dtype,
                  "Element types, comma list of fp32,fp64,fp16,bf16,fp8 (fp8: e4m3 inputs, bf16 output, forward only, "
                  "sm_90 GPUs)")
      ->capture_default_str();
  auto* d = cmd->add_option("--d", a->d, "Head dimensions, comma list")->capture_default_str();
  auto* seq = cmd->add_option("--seq", a->seq, "Sequence lengths (queries = keys), comma list")->capture_default_str();
  auto* batch = cmd->add_option("--batch", a->batch, "Batch sizes, comma list")->capture_default_str();
  auto* heads = cmd->add_option("--heads", a->heads, "Head counts, comma list")->capture_default_str();
  auto* causal = cmd->add_flag("--causal{1}", a->causal,
                               "Causal mask: bare --causal means causal only; --causal=0,1 runs both")
                     ->capture_default_str();
  a->grid_option = cmd->add_option("--grid", a->grid,
                                   "A named set of shapes instead of --d/--seq/--batch/--heads/--causal: 'fa' (16k "
                                   "tokens per batch, heads*d = 2048, d 64,128, seq 512..16384, causal and not) or "
                                   "'seed' (batch 8, one head, d 16..128, seq 256..32768, causal)")
                       ->excludes(d)
                       ->excludes(seq)
                       ->excludes(batch)
                       ->excludes(heads)
                       ->excludes(causal);
  cmd->add_option("--kv-heads", a->kv_heads,
                  "Key/value heads for GQA/MQA, dividing every head count (default: the head count)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--deterministic", a->cfg.deterministic,
                "Backward without atomics, bit-reproducible (CUDA: a separate dQ pass instead of fp32 atomics in "
                "the dK/dV kernel)");
  cmd->add_option("--causal-align", a->align, "top-left (PyTorch is_causal) or bottom-right")->capture_default_str();
  cmd->add_option("--window", a->window,
                  "Sliding window L,R (flash-attn's window_size: query i sees keys i-L..i+R, -1 unbounded; causal makes "
                  "R 0); TFLOP/s then count the visible pairs");
  cmd->add_option("--softcap", a->cfg.softcap, "Soft-capping of the scores, softcap * tanh(s / softcap) (0: off)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e30));
  cmd->add_option("--device", a->device, "cpu or cuda (default: cuda if a GPU is visible)");
  cmd->add_option("--warmup", a->cfg.warmup, "Untimed runs before timing")
      ->capture_default_str()
      ->check(in_range(0, kMaxReps));
  cmd->add_option("--reps", a->cfg.reps, "Timed runs; the median is reported")
      ->capture_default_str()
      ->check(in_range(1, kMaxReps));
  add_threads_option(cmd, a->threads);
  cmd->add_option("--cpu-max-flops", a->cfg.cpu_max_flops,
                  "On the CPU, skip (status 'skipped') a row whose runs would compute more FLOPs than this")
      ->capture_default_str()
      ->check(in_range(1.0, 1e30));
  cmd->add_flag("--forward-only", a->forward_only, "Skip the backward pass");
  add_report_options(cmd, a->report);
  return {cmd, [a] { return run(*a); }};
}
