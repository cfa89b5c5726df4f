// flashlm: the command-line tool. Each subcommand parses its arguments, calls the library and prints.
// Exit codes: 0 success, 2 usage error (bad arguments), 1 runtime error.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "flashlm/bench.h"
#include "flashlm/blas.h"
#include "flashlm/ddp.h"
#include "flashlm/device.h"
#include "flashlm/dist.h"
#include "flashlm/error.h"
#include "flashlm/train.h"
#include "cli_options.h"
#include "text_commands.h"

namespace {

// Thrown for arguments that parse but make no sense: reported as a usage error (exit 2).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  if (out.empty()) throw UsageError(fmt::format("empty list '{}'", s));
  return out;
}

// Parses "a,b,c" with `parse` for each item; a bad item is a usage error naming the option.
template <class T, class Parse>
std::vector<T> parse_list(const std::string& option, const std::string& s, Parse&& parse) {
  std::vector<T> out;
  for (const auto& item : split_list(s)) {
    try {
      out.push_back(parse(item));
    } catch (const std::exception& e) {
      throw UsageError(fmt::format("{}: {}", option, e.what()));
    }
  }
  return out;
}

// Upper bounds of the sizes the commands take. Generous (far past what fits in memory) yet far from
// int64's end, so that a product of a few of them cannot overflow before the library checks it.
constexpr int64_t kMaxBatch = int64_t{1} << 20;
constexpr int64_t kMaxSeq = int64_t{1} << 24;      // attention-bench sequence lengths
constexpr int64_t kMaxContext = flashlm::ModelConfig::kMaxContext;  // LM contexts
constexpr int64_t kMaxHeadDim = 4096;
constexpr int64_t kMaxHeads = int64_t{1} << 16;
constexpr int64_t kMaxWidth = int64_t{1} << 20;        // d_model, d_ff
constexpr int64_t kMaxVocab = (int64_t{1} << 31) - 1;  // token ids are int32
constexpr int64_t kMaxSteps = int64_t{1} << 40;
constexpr int kMaxReps = 1'000'000;
constexpr double kMaxBucketMb = 1e6;

// A positive integer (T = int64_t) or number (T = double) up to max: the whole string.
template <class T>
T parse_positive(const std::string& s, T max) {
  size_t used = 0;
  T v = 0;
  try {
    if constexpr (std::is_integral_v<T>) v = std::stoll(s, &used);
    else v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || !(v > 0)) {
    throw std::invalid_argument(
        fmt::format("'{}' is not a positive {}", s, std::is_integral_v<T> ? "integer" : "number"));
  }
  if (!(v <= max)) throw std::invalid_argument(fmt::format("'{}' is above the largest accepted, {}", s, max));
  return v;
}

bool parse_bool(const std::string& s) {
  if (s == "1" || s == "true" || s == "yes") return true;
  if (s == "0" || s == "false" || s == "no") return false;
  throw std::invalid_argument(fmt::format("'{}' is not 0 or 1", s));
}

void write_output(const std::string& text, const std::string& path) {
  if (path.empty() || path == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return;
  }
  std::ofstream f(path);
  if (!f) throw flashlm::Error(fmt::format("cannot open '{}' for writing", path));
  f << text;
  if (!f) throw flashlm::Error(fmt::format("failed writing '{}'", path));
}

// --device cuda without a CUDA build or without a visible GPU is a usage error, said the same way by
// every command.
void require_usable_device(flashlm::Device device) {
  if (device == flashlm::Device::cuda && flashlm::cuda_device_count() == 0) {
    throw UsageError(flashlm::cuda_built() ? "--device cuda: no CUDA device is visible"
                                           : "--device cuda: flashlm was built without CUDA");
  }
}

// --format, --out and --quiet, the same for every benchmark command.
void add_report_options(CLI::App* cmd, std::string& format, std::string& out, bool& quiet) {
  cmd->add_option("--format", format, "md, csv or json")->capture_default_str();
  cmd->add_option("--out", out, "Write the report here (stdout then shows the markdown table)");
  cmd->add_flag("--quiet", quiet, "No progress lines on stderr");
}

// The report in `format` to --out, with the markdown table on stdout; or the report on stdout.
template <class Render>
void emit_report(Render&& render, flashlm::ReportFormat format, const std::string& out) {
  if (!out.empty()) {
    write_output(render(format), out);
    write_output(render(flashlm::ReportFormat::md), "");
  } else {
    write_output(render(format), "");
  }
}

// --collective-timeout-s, the same for every command that runs under mpirun. Unset (-1): the
// communicator's default ($FLASHLM_DIST_TIMEOUT_S, else 600 s).
void add_collective_timeout_option(CLI::App* cmd, double& seconds) {
  constexpr double kWeek = 7 * 86400.0;
  cmd->add_option("--collective-timeout-s", seconds,
                  "End the job with an error when a collective waits longer than this for the other ranks (a rank "
                  "stalled or died); 0: never; default $FLASHLM_DIST_TIMEOUT_S, else 600")
      ->check(in_range(0.0, kWeek));
}

// Runs fn(comm) on every rank of the job (a world of one without mpirun), with the collective timeout
// `timeout_s` (< 0: the communicator's default). A failure on one rank ends the whole job (MPI_Abort)
// instead of leaving its peers waiting in a collective; MPI is finalized on success, and when every rank
// found the same usage error together (ranks started with different settings: exit 2 on every rank).
template <class Fn>
int run_on_every_rank(double timeout_s, Fn&& fn) {
  int status = 0;
  {
    flashlm::Communicator comm;  // MPI_Init
    if (timeout_s >= 0) comm.set_timeout(timeout_s);
    try {
      fn(comm);
    } catch (const flashlm::SettingsMismatch& e) {
      fmt::print(stderr, "error: {}\n", e.what());
      status = 2;
    } catch (const std::exception& e) {
      if (comm.world_size() > 1) {
        fmt::print(stderr, "error: rank {}: {}\n", comm.rank(), e.what());
        std::fflush(stderr);
        flashlm::Communicator::abort(1);
      }
      throw;
    }
  }
  flashlm::Communicator::finalize();
  return status;
}

// Whether a launcher started this process as one of several ranks (mpirun, srun), before MPI is started.
bool launched_with_peers() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    const char* v = std::getenv(var);
    if (v && std::atoi(v) > 1) return true;
  }
  return false;
}

// torchrun (and torch.distributed.launch) start N copies with RANK / WORLD_SIZE / LOCAL_RANK and no MPI:
// each copy would run alone, N identical runs writing the same files. Refused before anything runs.
void refuse_torchrun() {
  const char* world = std::getenv("WORLD_SIZE");
  const bool torch_launcher = std::getenv("TORCHELASTIC_RUN_ID") || (std::getenv("LOCAL_RANK") && world && std::atoi(world) > 1);
  if (torch_launcher && !launched_with_peers()) {
    throw UsageError(fmt::format("launched by torchrun (WORLD_SIZE={}, RANK={}): flashlm's ranks come from MPI; run "
                                 "'mpirun -np {} flashlm ...' instead (each torchrun copy would train alone)",
                                 world ? world : "?", std::getenv("RANK") ? std::getenv("RANK") : "?",
                                 world ? world : "N"));
  }
}

// --device: cpu or cuda; left out, cuda when a GPU is visible (every command that runs on either).
flashlm::Device device_or_default(const std::string& device) {
  using namespace flashlm;
  return device.empty() ? (cuda_device_count() > 0 ? Device::cuda : Device::cpu) : parse_device(device);
}

// --device as above; --precision default: bf16 on cuda, fp32 on the CPU. The CPU runs fp32 only; a device
// that cannot be used is a usage error.
void resolve_device_and_precision(const std::string& device, const std::string& precision, flashlm::Device& dev,
                                  flashlm::DType& dtype, bool* bf16_pure = nullptr) {
  using namespace flashlm;
  bool pure = false;
  try {
    dev = device_or_default(device);
    dtype = dev == Device::cuda ? DType::bf16 : DType::f32;
    if (!precision.empty()) parse_precision(precision, dtype, pure);
  } catch (const flashlm::Error& e) {
    throw UsageError(e.what());
  }
  if (pure && !bf16_pure) throw UsageError("--precision bf16-pure: this command takes fp32, bf16 or fp16");
  if (bf16_pure) *bf16_pure = pure;
  require_usable_device(dev);
  if (dev == Device::cpu && (dtype != DType::f32 || pure)) {
    throw UsageError(fmt::format("--precision {}: the CPU engine runs fp32", precision_name(dtype, pure)));
  }
}

// --recompute: none, blocks, blocks:K, selective or auto (a usage error otherwise).
flashlm::RecomputePlan parse_recompute_option(const std::string& text) {
  try {
    return flashlm::RecomputePlan::parse(text);
  } catch (const flashlm::Error& e) {
    throw UsageError(e.what());
  }
}

// --optimizer-state fp32|bf16|bf16-sr for the commands that run AdamW (ModelOptions::optimizer_state).
void add_optimizer_state_option(CLI::App* cmd, std::string& value) {
  cmd->add_option("--optimizer-state", value,
                  "The AdamW moments beside fp32 master weights: fp32; bf16 (widened to fp32 for the update, rounded "
                  "back to nearest: 22 instead of 30 bytes per parameter per step with bf16 weights); bf16-sr "
                  "(rounded back stochastically, seeded by the run). Not with bf16-pure, ZeRO-1 or FSDP")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16", "bf16-sr"}));
}

// The value of --optimizer-state (its choices checked by CLI11); a usage error beside bf16-pure, whose moments
// are bf16 already (the model's own check, ModelOptions::check_optimizer_state, would fail later, as exit 1).
flashlm::OptimizerState parse_optimizer_state_option(const std::string& value, bool bf16_pure) {
  const flashlm::OptimizerState state = flashlm::parse_optimizer_state(value);
  if (bf16_pure && state != flashlm::OptimizerState::fp32) {
    throw UsageError("--optimizer-state: bf16-pure keeps its moments in bf16 already; it is for fp32 master weights");
  }
  return state;
}

// --cuda-graph on|off for the commands that run train steps (ModelOptions::cuda_graph).
void add_cuda_graph_option(CLI::App* cmd, std::string& value) {
  cmd->add_option("--cuda-graph", value,
                  "cuda: on: each train step is one CUDA graph, captured after a warm-up step and replayed (eager "
                  "where it cannot be: fp16, data parallelism, --profile-ranges); off: every step eager")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
}

// The options every LM command shares: the recomputation plan and the LM head's chunk.
void add_model_memory_options(CLI::App* cmd, std::string& recompute, int64_t& head_chunk, bool& atomic_backward) {
  cmd->add_flag("--atomic-attention-backward", atomic_backward,
                "cuda: the attention backward's dQ by fp32 atomics (faster at long contexts) instead of the "
                "deterministic separate pass; steps are then no longer bit-reproducible");
  cmd->add_option("--recompute", recompute,
                  "Activation recomputation: none, blocks[:K] (keep every K-th block's input, recompute the rest in "
                  "the backward), selective (keep attention output and logsumexp, recompute the rest) or auto (the "
                  "fastest plan that fits the free memory)")
      ->capture_default_str();
  cmd->add_option("--head-chunk", head_chunk,
                  "Tokens per chunk of the LM head + cross-entropy (0: about 1 GiB of logits at a time)")
      ->capture_default_str()
      ->check(in_range(int64_t{0}, int64_t{1} << 30));
}

// --reduce-dtype (a comma list), --nccl-max-ctas and --gemm-sm-reserve. All concern NCCL on GPUs: a 16-bit
// gradient all-reduce, a CTA limit or an SM reserve asked for on the CPU (MPI reduces fp32) is a usage error.
std::vector<flashlm::DType> parse_reduce_dtypes(const std::string& list, flashlm::Device device, int nccl_max_ctas,
                                                int gemm_sm_reserve) {
  using namespace flashlm;
  const auto dtypes =
      parse_list<DType>("--reduce-dtype", list, [](const std::string& s) { return parse_reduce_dtype(s); });
  if (device == Device::cpu) {
    for (DType t : dtypes) {
      if (t != DType::f32) {
        throw UsageError(fmt::format("--reduce-dtype {}: {} gradient reduction needs --device cuda (NCCL); MPI "
                                     "reduces fp32 on the CPU",
                                     dtype_name(t), dtype_name(t)));
      }
    }
    if (nccl_max_ctas > 0) throw UsageError("--nccl-max-ctas: needs --device cuda (NCCL)");
    if (gemm_sm_reserve >= 0) throw UsageError("--gemm-sm-reserve: needs --device cuda (cuBLASLt beside NCCL)");
  }
  return dtypes;
}

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

struct AttentionBenchArgs {
  std::string impl = "naive,flash", dtype = "fp32", d = "64", seq = "1024,2048,4096", batch = "1", heads = "1";
  std::string causal = "0", align = "top-left", device, format = "md", out, grid;
  int warmup = 1, reps = 3, threads = 0;
  int64_t kv_heads = 0;
  double cpu_max_flops = flashlm::AttentionBenchConfig{}.cpu_max_flops;
  bool forward_only = false, quiet = false, deterministic = false;
};

void add_attention_bench(CLI::App& app, AttentionBenchArgs& a) {
  CLI::App* cmd = app.add_subcommand("attention-bench", "Time attention forward and backward over a grid of shapes");
  cmd->add_option("--impl", a.impl, "Implementations, comma list of naive,flash")->capture_default_str();
  cmd->add_option("--dtype", a.dtype, "Element types, comma list of fp32,fp64,fp16,bf16,fp8 (fp8: e4m3 inputs, "
                                      "bf16 output, forward only, sm_90 GPUs)")->capture_default_str();
  auto* d = cmd->add_option("--d", a.d, "Head dimensions, comma list")->capture_default_str();
  auto* seq = cmd->add_option("--seq", a.seq, "Sequence lengths (queries = keys), comma list")->capture_default_str();
  auto* batch = cmd->add_option("--batch", a.batch, "Batch sizes, comma list")->capture_default_str();
  auto* heads = cmd->add_option("--heads", a.heads, "Head counts, comma list")->capture_default_str();
  auto* causal = cmd->add_flag("--causal{1}", a.causal,
                               "Causal mask: bare --causal means causal only; --causal=0,1 runs both")
                     ->capture_default_str();
  cmd->add_option("--grid", a.grid,
                  "A named set of shapes instead of --d/--seq/--batch/--heads/--causal: 'fa' (16k tokens per batch, "
                  "heads*d = 2048, d 64,128, seq 512..16384, causal and not) or 'seed' (batch 8, one head, "
                  "d 16..128, seq 256..32768, causal)")
      ->excludes(d)
      ->excludes(seq)
      ->excludes(batch)
      ->excludes(heads)
      ->excludes(causal);
  cmd->add_option("--kv-heads", a.kv_heads,
                  "Key/value heads for GQA/MQA, dividing every head count (default: the head count)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--deterministic", a.deterministic,
                "Backward without atomics, bit-reproducible (CUDA: a separate dQ pass instead of fp32 atomics in "
                "the dK/dV kernel)");
  cmd->add_option("--causal-align", a.align, "top-left (PyTorch is_causal) or bottom-right")->capture_default_str();
  cmd->add_option("--device", a.device, "cpu or cuda (default: cuda if a GPU is visible)");
  cmd->add_option("--warmup", a.warmup, "Untimed runs before timing")
      ->capture_default_str()
      ->check(in_range(0, kMaxReps));
  cmd->add_option("--reps", a.reps, "Timed runs; the median is reported")
      ->capture_default_str()
      ->check(in_range(1, kMaxReps));
  add_threads_option(cmd, a.threads);
  cmd->add_option("--cpu-max-flops", a.cpu_max_flops,
                  "On the CPU, skip (status 'skipped') a row whose runs would compute more FLOPs than this")
      ->capture_default_str()
      ->check(in_range(1.0, 1e30));
  cmd->add_flag("--forward-only", a.forward_only, "Skip the backward pass");
  add_report_options(cmd, a.format, a.out, a.quiet);
}

// A positive integer up to max, for a comma-list option.
auto positive_up_to(int64_t max) {
  return [max](const std::string& s) { return parse_positive<int64_t>(s, max); };
}

int run_attention_bench_command(const AttentionBenchArgs& a, bool grid_given) {
  using namespace flashlm;
  AttentionBenchConfig cfg;
  ReportFormat format;
  try {
    cfg.impls = parse_list<AttentionImpl>("--impl", a.impl, [](const std::string& s) { return parse_attention_impl(s); });
    cfg.dtypes = parse_list<DType>("--dtype", a.dtype, [](const std::string& s) { return parse_dtype(s); });
    if (grid_given) {
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
        throw UsageError(fmt::format("--kv-heads: {} does not divide the head count {}", a.kv_heads, shape.heads));
      }
      shape.kv_heads = a.kv_heads;
    }
    cfg.align = parse_causal_align(a.align);
    cfg.device = device_or_default(a.device);
    format = parse_report_format(a.format);
  } catch (const flashlm::Error& e) {
    throw UsageError(e.what());
  }
  require_usable_device(cfg.device);
  if (a.threads > 0) set_cpu_threads(a.threads);
  cfg.deterministic = a.deterministic;
  cfg.cpu_max_flops = a.cpu_max_flops;
  cfg.warmup = a.warmup;
  cfg.reps = a.reps;
  cfg.backward = !a.forward_only;
  if (!a.quiet) cfg.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };

  const auto records = run_attention_bench(cfg);
  emit_report([&](flashlm::ReportFormat f) { return format_attention_bench(records, f, cfg); }, format, a.out);
  return 0;
}

struct BenchArgs {
  std::string model = "small", context = "512", precision = "fp32", attention = "flash", pass = "fwd,fwd-bwd,step";
  std::string device, format = "md", out, memory_timeline, trace, model_config, recompute = "none";
  int64_t batch = 4, vocab = 0, head_chunk = 0;
  int warmup = 5, steps = 10, threads = 0, gemm_autotune = 0;
  bool profile_ranges = false, profile_kernels = false, quiet = false, atomic_backward = false;
  bool overlap_grad_norm = false;
  std::string cuda_graph = "on";
  std::string optimizer_state = "fp32";
};

void add_bench(CLI::App& app, BenchArgs& a) {
  CLI::App* cmd = app.add_subcommand("bench", "Time the LM's forward, forward+backward and full train step");
  cmd->add_option("--model", a.model, "Sizes, comma list of tiny,small,medium,large,xl,2.7B,cs336-8b")
      ->capture_default_str();
  cmd->add_option("--model-config", a.model_config,
                  "A JSON model description instead of --model ({\"base\": SIZE, \"d_model\": ..., \"d_ff\", "
                  "\"layers\", \"heads\", \"vocab\", \"rope_theta\", \"norm_eps\"}); --context still applies");
  cmd->add_option("--context", a.context, "Context lengths, comma list")->capture_default_str();
  cmd->add_option("--batch", a.batch, "Sequences per step")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, kMaxBatch));
  cmd->add_option("--vocab", a.vocab, "Vocabulary size (default: the size's own: 151936 for cs336-8b, else 10000)")
      ->check(in_range(int64_t{2}, kMaxVocab));
  cmd->add_option("--precision", a.precision,
                  "Comma list of fp32, bf16 (fp32 masters), fp16, bf16-pure (parameters, gradients and AdamW moments "
                  "in bf16)")
      ->capture_default_str();
  add_model_memory_options(cmd, a.recompute, a.head_chunk, a.atomic_backward);
  add_optimizer_state_option(cmd, a.optimizer_state);
  cmd->add_option("--attention", a.attention, "Comma list of flash,naive")->capture_default_str();
  cmd->add_option("--pass", a.pass, "Comma list of fwd,fwd-bwd,step")->capture_default_str();
  cmd->add_option("--warmup", a.warmup, "Untimed steps first")->capture_default_str()->check(in_range(0, kMaxReps));
  cmd->add_option("--steps", a.steps, "Timed steps")->capture_default_str()->check(in_range(1, kMaxReps));
  cmd->add_option("--device", a.device, "cpu or cuda (default: cuda if a GPU is visible)");
  add_threads_option(cmd, a.threads);
  cmd->add_flag("--profile-ranges", a.profile_ranges,
                "After the table, the nvtx_sum table (nsys stats format) of each configuration's timed steps");
  cmd->add_flag("--profile-kernels", a.profile_kernels,
                "After the table, the cuda_gpu_kern_sum table (nsys stats format, from CUPTI) of each "
                "configuration's timed steps (--device cuda)");
  cmd->add_option("--memory-timeline", a.memory_timeline,
                  "Write every allocation and release (time, bytes, tag, phase) as JSON; draw it with "
                  "scripts/plot_memory_timeline.py");
  cmd->add_option("--trace", a.trace,
                  "Write the timed steps' ranges (as --profile-ranges times them) and the memory in use over the run "
                  "as a Chrome trace (JSON trace events) that ui.perfetto.dev and chrome://tracing open");
  cmd->add_option("--gemm-autotune", a.gemm_autotune,
                  "Time up to this many of cuBLASLt's candidate algorithms for each GEMM shape at its first call and "
                  "keep the fastest (the choices are printed unless --quiet); 0: the heuristic's first choice "
                  "(--device cuda)")
      ->capture_default_str()
      ->check(CLI::Range(0, 64));
  cmd->add_flag("--overlap-grad-norm", a.overlap_grad_norm,
                "Each gradient's share of the gradient norm on a stream beside the backward as it is finalised, "
                "instead of one pass over every gradient after the backward (--device cuda)");
  add_cuda_graph_option(cmd, a.cuda_graph);
  add_report_options(cmd, a.format, a.out, a.quiet);
}

int run_bench_command(const BenchArgs& a) {
  using namespace flashlm;
  LmBenchConfig cfg;
  ReportFormat format;
  try {
    cfg.models = split_list(a.model);
    for (const auto& m : cfg.models) ModelConfig::named(m);  // an unknown size is a usage error
    cfg.model_config_file = a.model_config;
    if (!a.model_config.empty()) ModelConfig::from_json_file(a.model_config);  // so is a bad description
    cfg.contexts = parse_list<int64_t>("--context", a.context, positive_up_to(kMaxContext));
    cfg.precisions = split_list(a.precision);
    for (const auto& p : cfg.precisions) {
      DType dtype;
      bool pure;
      parse_precision(p, dtype, pure);
    }
    cfg.recompute = RecomputePlan::parse(a.recompute);
    cfg.head_chunk = a.head_chunk;
    cfg.deterministic = !a.atomic_backward;
    cfg.attention = parse_list<AttentionImpl>("--attention", a.attention,
                                              [](const std::string& s) { return parse_attention_impl(s); });
    cfg.passes = split_list(a.pass);
    for (const auto& p : cfg.passes) {
      if (p != "fwd" && p != "fwd-bwd" && p != "step") throw UsageError(fmt::format("--pass: unknown pass '{}'", p));
    }
    cfg.device = device_or_default(a.device);
    format = parse_report_format(a.format);
  } catch (const flashlm::Error& e) {
    throw UsageError(e.what());
  }
  require_usable_device(cfg.device);
  cfg.batch = a.batch;
  cfg.vocab = a.vocab;
  cfg.warmup = a.warmup;
  cfg.steps = a.steps;
  cfg.profile_ranges = a.profile_ranges;
  cfg.profile_kernels = a.profile_kernels;
  if (cfg.profile_kernels && cfg.device != Device::cuda) throw UsageError("--profile-kernels needs --device cuda");
  cfg.gemm_autotune = a.gemm_autotune;
  cfg.overlap_grad_norm = a.overlap_grad_norm;
  cfg.cuda_graph = a.cuda_graph == "on";
  cfg.optimizer_state = parse_optimizer_state(a.optimizer_state);
  if (cfg.gemm_autotune > 0 && cfg.device != Device::cuda) throw UsageError("--gemm-autotune needs --device cuda");
  if (a.threads > 0) set_cpu_threads(a.threads);
  if (!a.quiet) cfg.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
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
  emit_report([&](flashlm::ReportFormat f) { return format_lm_bench(records, f, cfg); }, format, a.out);
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

struct TrainArgs {
  std::string model = "tiny", data = "synthetic", val_data, checkpoint, device, attention = "flash", precision;
  std::string init, metrics_log;
  std::string model_config, recompute = "none";
  int64_t d_model = 0, d_ff = 0, layers = 0, heads = 0, vocab = 256, context = 64, head_chunk = 0;
  bool atomic_backward = false;
  int64_t batch = 16, steps = 200, warmup = 20, cosine_steps = 0, eval_every = 50, eval_batches = 8, log_every = 10;
  int64_t checkpoint_every = 0;
  int threads = 0;
  double lr = 3e-3, lr_min = 3e-4, weight_decay = 0.1, clip = 1.0, beta1 = 0.9, beta2 = 0.95;
  double loss_scale_init = 0;
  uint64_t seed = 1234;
  bool resume = false, sharded_checkpoint = false;
  std::string cuda_graph = "on";
  std::string optimizer_state = "fp32";
  std::string ddp, reduce_dtype = "fp32";
  double bucket_mb = 25;
  int64_t grad_accum = 1;
  int zero = 0, nccl_max_ctas = 0, gemm_sm_reserve = -1, fsdp_prefetch = 1;
  double collective_timeout_s = -1;
};

// --reduce-dtype and --nccl-max-ctas, the same for train and ddp-bench (a comma list there).
void add_gradient_sync_options(CLI::App* cmd, std::string& reduce_dtype, int& nccl_max_ctas, int& gemm_sm_reserve,
                               const char* dtype_help) {
  cmd->add_option("--reduce-dtype", reduce_dtype,
                  fmt::format("{}: fp32, or on cuda bf16 or fp16, which halve the bytes NCCL moves (each bucket's fp32 "
                              "gradients rounded to 16 bits, averaged by NCCL in that type, widened back)",
                              dtype_help))
      ->capture_default_str();
  cmd->add_option("--nccl-max-ctas", nccl_max_ctas,
                  "The most CTAs (one SM each) an NCCL collective may use (ncclConfig_t maxCTAs), leaving SMs to the "
                  "backward the all-reduces overlap; default: NCCL's choice; NCCL_MAX_CTAS in the environment "
                  "overrides it")
      ->check(in_range(1, 4096));
  cmd->add_option("--gemm-sm-reserve", gemm_sm_reserve,
                  "SMs the backward's cuBLASLt GEMMs leave to the all-reduces they overlap (cuBLASLt's SM count target; "
                  "async and bucketed on cuda); default: --nccl-max-ctas if given, else 0")
      ->check(CLI::Range(0, 4096));
}

void add_train(CLI::App& app, TrainArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "train", "Train the Transformer LM on token files or synthetic data; data-parallel under mpirun");
  cmd->add_option("--model", a.model,
                  "Size: tiny, small, medium, large, xl, 2.7B, cs336-8b (overridden by the options below)")
      ->capture_default_str();
  cmd->add_option("--model-config", a.model_config,
                  "A JSON model description instead of --model (keys base, vocab, d_model, d_ff, layers, heads, "
                  "rope_theta, norm_eps; the options below override it)");
  cmd->add_option("--d-model", a.d_model, "Model width")->check(in_range(int64_t{1}, kMaxWidth));
  cmd->add_option("--d-ff", a.d_ff, "Feed-forward width")->check(in_range(int64_t{1}, kMaxWidth));
  cmd->add_option("--layers", a.layers, "Transformer blocks")
      ->check(in_range(int64_t{1}, flashlm::ModelConfig::kMaxLayers));
  cmd->add_option("--heads", a.heads, "Attention heads")->check(in_range(int64_t{1}, kMaxHeads));
  cmd->add_option("--vocab", a.vocab, "Vocabulary size")->capture_default_str()->check(in_range(int64_t{2}, kMaxVocab));
  cmd->add_option("--context", a.context, "Tokens per sequence")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, kMaxContext));
  cmd->add_option("--batch", a.batch, "Sequences per step")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, kMaxBatch));
  cmd->add_option("--steps", a.steps, "Optimizer steps")->capture_default_str()->check(in_range(int64_t{1}, kMaxSteps));
  cmd->add_option("--data", a.data, "'synthetic' or a token file (.bin: nanoGPT uint16 or llm.c headered)")
      ->capture_default_str();
  cmd->add_option("--val-data", a.val_data, "Validation token file (default: the last 10% of --data)");
  // Learning rates, decay and clip: finite, and where the update stays an AdamW step.
  cmd->add_option("--lr", a.lr, "Peak learning rate")->capture_default_str()->check(in_range(0.0, 10.0));
  cmd->add_option("--lr-min", a.lr_min, "Final learning rate of the cosine schedule")
      ->capture_default_str()
      ->check(in_range(0.0, 10.0));
  const auto steps = in_range(int64_t{0}, kMaxSteps);
  cmd->add_option("--warmup", a.warmup, "Linear warm-up steps")->capture_default_str()->check(steps);
  cmd->add_option("--cosine-steps", a.cosine_steps, "Step where the cosine reaches --lr-min (default: --steps)")
      ->check(steps);
  cmd->add_option("--weight-decay", a.weight_decay, "AdamW decoupled weight decay")
      ->capture_default_str()
      ->check(in_range(0.0, 1.0));
  cmd->add_option("--beta1", a.beta1, "AdamW beta1")
      ->capture_default_str()
      ->check(in_range(0.0, std::nextafter(1.0, 0.0)));
  cmd->add_option("--beta2", a.beta2, "AdamW beta2")
      ->capture_default_str()
      ->check(in_range(0.0, std::nextafter(1.0, 0.0)));
  cmd->add_option("--loss-scale-init", a.loss_scale_init,
                  "fp16: the dynamic loss scale to start from (default 65536), as GradScaler's init_scale")
      ->check(in_range(1.0, 4294967296.0));
  cmd->add_option("--clip", a.clip, "Global gradient-norm clip (0: none)")
      ->capture_default_str()
      ->check(in_range(0.0, 1e9));
  cmd->add_option("--eval-every", a.eval_every, "Validation every N steps (0: only at the end)")
      ->capture_default_str()
      ->check(steps);
  cmd->add_option("--eval-batches", a.eval_batches, "Batches per validation")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, int64_t{kMaxReps}));
  cmd->add_option("--log-every", a.log_every, "Progress line every N steps")->capture_default_str()->check(steps);
  cmd->add_option("--checkpoint", a.checkpoint, "Checkpoint file (written atomically)");
  cmd->add_option("--checkpoint-every", a.checkpoint_every, "Checkpoint every N steps (0: at the end)")->check(steps);
  cmd->add_flag("--resume", a.resume, "Continue from --checkpoint, bit-exactly");
  cmd->add_option("--init", a.init,
                  "Start from these weights (.safetensors: flashlm export's, or PyTorch's with the CS336 names)");
  cmd->add_option("--log", a.metrics_log, "Write metrics as JSON lines (one per step and per evaluation)");
  cmd->add_flag("--sharded-checkpoint", a.sharded_checkpoint,
                "--ddp fsdp: every rank writes and resumes from its own shard, CHECKPOINT.rank<R>-of-<N>, nothing "
                "gathered (resume at the same world size)");
  cmd->add_option("--seed", a.seed, "Seed of weights, data order and synthetic data")
      ->capture_default_str()
      ->check(in_range(uint64_t{0}, uint64_t{INT64_MAX}));
  cmd->add_option("--attention", a.attention, "flash or naive")->capture_default_str();
  cmd->add_option("--device", a.device, "cpu or cuda (default: cuda if a GPU is visible)");
  cmd->add_option("--precision", a.precision,
                  "fp32, bf16 (fp32 masters), fp16 or bf16-pure (parameters, gradients and AdamW moments in bf16) "
                  "(default: bf16 on cuda, fp32 on cpu)");
  add_model_memory_options(cmd, a.recompute, a.head_chunk, a.atomic_backward);
  add_optimizer_state_option(cmd, a.optimizer_state);
  add_cuda_graph_option(cmd, a.cuda_graph);
  add_threads_option(cmd, a.threads);
  cmd->add_option("--ddp", a.ddp,
                  "Data parallelism under mpirun (each rank its --batch sequences): per-param, flat, async, "
                  "bucketed (the default when launched with several ranks) or fsdp (ZeRO-3: weights, gradients and "
                  "AdamW state sharded, each model part gathered when it is read)");
  cmd->add_option("--fsdp-prefetch", a.fsdp_prefetch, "--ddp fsdp: model parts ahead whose gather starts early")
      ->capture_default_str()
      ->check(CLI::Range(0, 2));
  cmd->add_option("--bucket-mb", a.bucket_mb, "Bucket size of --ddp bucketed, MB of fp32 gradients")
      ->capture_default_str()
      ->check(in_range(1e-6, kMaxBucketMb));
  cmd->add_option("--grad-accum", a.grad_accum, "Micro-batches per optimizer step, gradients synchronised on the last")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, int64_t{kMaxReps}));
  cmd->add_option("--zero", a.zero, "1: ZeRO-1, the AdamW moments sharded across ranks")
      ->capture_default_str()
      ->check(CLI::Range(0, 1));
  add_gradient_sync_options(cmd, a.reduce_dtype, a.nccl_max_ctas, a.gemm_sm_reserve, "Element type of the DDP gradient all-reduce");
  add_collective_timeout_option(cmd, a.collective_timeout_s);
}

int run_train_command(const TrainArgs& a) {
  using namespace flashlm;
  TrainConfig cfg;
  resolve_device_and_precision(a.device, a.precision, cfg.device, cfg.precision, &cfg.bf16_pure);
  cfg.recompute = parse_recompute_option(a.recompute);
  cfg.optimizer_state = parse_optimizer_state_option(a.optimizer_state, cfg.bf16_pure);
  cfg.head_chunk = a.head_chunk;
  cfg.deterministic = !a.atomic_backward;
  cfg.cuda_graph = a.cuda_graph == "on";
  try {
    if (a.model_config.empty()) {
      cfg.model = ModelConfig::named(a.model, a.context, a.vocab);
    } else {
      cfg.model = ModelConfig::from_json_file(a.model_config);
      cfg.model.context = a.context;
      cfg.model.vocab = a.vocab;
    }
    cfg.attention = parse_attention_impl(a.attention);
    if (!a.ddp.empty()) cfg.ddp.variant = parse_ddp_variant(a.ddp);
  } catch (const flashlm::Error& e) {
    throw UsageError(e.what());
  }
  if (a.sharded_checkpoint && (cfg.ddp.variant != DdpVariant::fsdp || a.ddp.empty() || a.checkpoint.empty())) {
    throw UsageError("--sharded-checkpoint: sharded checkpoints are FSDP's, they need --ddp fsdp and --checkpoint");
  }
  const std::vector<DType> reduce = parse_reduce_dtypes(a.reduce_dtype, cfg.device, a.nccl_max_ctas, a.gemm_sm_reserve);
  if (reduce.size() != 1) throw UsageError(fmt::format("--reduce-dtype {}: train takes one type", a.reduce_dtype));
  cfg.ddp.reduce_dtype = reduce.front();
  cfg.ddp.gemm_sm_reserve = a.gemm_sm_reserve;
  cfg.ddp.bucket_mb = a.bucket_mb;
  cfg.ddp.grad_accum = a.grad_accum;
  cfg.ddp.fsdp_prefetch = a.fsdp_prefetch;
  cfg.zero1 = a.zero == 1;
  if (cfg.optimizer_state != OptimizerState::fp32 && (cfg.zero1 || (!a.ddp.empty() && cfg.ddp.variant == DdpVariant::fsdp))) {
    throw UsageError(fmt::format("--optimizer-state {}: ZeRO-1 and FSDP shard fp32 moments; bf16 moments are the "
                                 "model's own AdamW's (one process, or --ddp per-param/flat/async/bucketed)",
                                 a.optimizer_state));
  }
  const bool data_parallel = !a.ddp.empty() || cfg.zero1 || a.grad_accum > 1 || cfg.ddp.reduce_dtype != DType::f32 ||
                             a.nccl_max_ctas > 0 || a.gemm_sm_reserve >= 0 || launched_with_peers();
  if (a.d_model) cfg.model.d_model = a.d_model;
  if (a.d_ff) cfg.model.d_ff = a.d_ff;
  if (a.layers) cfg.model.layers = a.layers;
  if (a.heads) cfg.model.heads = a.heads;
  try {
    cfg.model.validate();
  } catch (const flashlm::Error& e) {
    throw UsageError(e.what());
  }
  cfg.batch = a.batch;
  cfg.seq = a.context;
  cfg.steps = a.steps;
  cfg.train_data = a.data;
  cfg.val_data = a.val_data;
  cfg.optimizer.lr_max = a.lr;
  cfg.optimizer.lr_min = a.lr_min;
  cfg.optimizer.warmup_steps = a.warmup;
  cfg.optimizer.cosine_steps = a.cosine_steps > 0 ? a.cosine_steps : a.steps;
  cfg.optimizer.weight_decay = a.weight_decay;
  cfg.optimizer.beta1 = a.beta1;
  cfg.optimizer.beta2 = a.beta2;
  cfg.optimizer.max_grad_norm = a.clip;
  if (a.loss_scale_init > 0 && cfg.precision != DType::f16) throw UsageError("--loss-scale-init needs --precision fp16");
  cfg.loss_scale_init = a.loss_scale_init;
  cfg.eval_every = a.eval_every;
  cfg.eval_batches = a.eval_batches;
  cfg.log_every = a.log_every;
  cfg.checkpoint = a.checkpoint;
  cfg.checkpoint_every = a.checkpoint_every;
  cfg.sharded_checkpoint = a.sharded_checkpoint;
  cfg.resume = a.resume;
  cfg.init = a.init;
  cfg.metrics_log = a.metrics_log;
  cfg.seed = a.seed;
  if (a.threads > 0) set_cpu_threads(a.threads);
  cfg.progress = [](const std::string& line) { fmt::print("{}\n", line), std::fflush(stdout); };
  const auto run = [&cfg] {
    const TrainResult r = train(cfg);  // under data parallelism, rank 0 alone evaluates and reports
    if (!r.val_loss.empty()) fmt::print("final val loss {:.4f}\n", r.val_loss.back().second);
  };
  if (!data_parallel) {
    run();
    return 0;
  }
  return run_on_every_rank(a.collective_timeout_s, [&](Communicator& comm) {
    comm.set_nccl_max_ctas(a.nccl_max_ctas);
    cfg.comm = &comm;
    run();
  });
}

struct AllReduceBenchArgs {
  std::string sizes = "1MB,10MB,100MB,1GB", dtype = "fp32", device, format = "md", out;
  int warmup = 5, iters = 20;
  double collective_timeout_s = -1;
  bool quiet = false;
};

void add_allreduce_bench(CLI::App& app, AllReduceBenchArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "allreduce-bench",
      "Time all-reduce across the ranks of a job (mpirun -np N flashlm allreduce-bench): MPI on CPU buffers, NCCL "
      "on GPUs; algbw and busbw as nccl-tests");
  cmd->add_option("--sizes", a.sizes,
                  "Bytes per rank, comma list; KB, MB, GB are powers of 1000, KiB, MiB, GiB powers of 1024")
      ->capture_default_str();
  cmd->add_option("--dtype", a.dtype, "Comma list: fp32, fp64 on cpu; fp32, bf16, fp16, fp64 on cuda")
      ->capture_default_str();
  cmd->add_option("--device", a.device,
                  "cpu (MPI) or cuda (NCCL, one GPU per rank); default: cuda if a GPU is visible and NCCL was built");
  cmd->add_option("--warmup", a.warmup, "Untimed all-reduces per size")
      ->capture_default_str()
      ->check(in_range(0, kMaxReps));
  cmd->add_option("--iters", a.iters, "Timed all-reduces per size")
      ->capture_default_str()
      ->check(in_range(1, kMaxReps));
  add_collective_timeout_option(cmd, a.collective_timeout_s);
  add_report_options(cmd, a.format, a.out, a.quiet);
}

int run_allreduce_bench_command(const AllReduceBenchArgs& a) {
  using namespace flashlm;
  AllReduceBenchConfig cfg;
  ReportFormat format;
  try {
    cfg.sizes = parse_list<int64_t>("--sizes", a.sizes, [](const std::string& s) { return parse_byte_size(s); });
    cfg.dtypes = parse_list<DType>("--dtype", a.dtype, [](const std::string& s) { return parse_dtype(s); });
    // Default: the GPUs when there are any and NCCL was built, else the CPU (MPI).
    cfg.device = a.device.empty() && !Communicator::nccl_built() ? Device::cpu : device_or_default(a.device);
    format = parse_report_format(a.format);
  } catch (const flashlm::Error& e) {
    throw UsageError(e.what());
  }
  for (DType t : cfg.dtypes) {
    if (cfg.device == Device::cpu && t != DType::f32 && t != DType::f64) {
      throw UsageError(fmt::format("--dtype {}: needs --device cuda (MPI on the CPU carries fp32 and fp64)",
                                   dtype_name(t)));
    }
  }
  if (cfg.device == Device::cuda && !Communicator::nccl_built()) {
    throw UsageError(cuda_built() ? "--device cuda: flashlm was built without NCCL"
                                  : "--device cuda: flashlm was built without CUDA");
  }
  require_usable_device(cfg.device);
  cfg.warmup = a.warmup;
  cfg.iters = a.iters;

  return run_on_every_rank(a.collective_timeout_s, [&](Communicator& comm) {
    if (!a.quiet && comm.is_root()) {
      cfg.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
      fmt::print(stderr, "allreduce-bench: {} rank(s), {} on this node, {}\n", comm.world_size(), comm.local_size(),
                 cfg.device == Device::cuda ? "NCCL on GPUs" : "MPI on CPU buffers");
    }
    const auto records = run_allreduce_bench(comm, cfg);
    if (comm.is_root()) {
      emit_report([&](ReportFormat f) { return format_allreduce_bench(records, f, cfg, comm); }, format, a.out);
    }
  });
}

struct DdpBenchArgs {
  std::string model = "xl", ddp = "per-param,flat,async,bucketed", bucket_mb = "1,10,100,1000", zero = "0";
  std::string reduce_dtype = "fp32", device, precision, format = "md", out, recompute = "none";
  std::string optimizer_state = "fp32";
  int64_t context = 512, batch = 4, vocab = 0, head_chunk = 0;
  int warmup = 3, steps = 10, threads = 0, nccl_max_ctas = 0, gemm_sm_reserve = -1, fsdp_prefetch = 1;
  double collective_timeout_s = -1;
  bool quiet = false, atomic_backward = false;
};

void add_ddp_bench(CLI::App& app, DdpBenchArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "ddp-bench",
      "Time the LM's train step data-parallel across the ranks of a job (mpirun -np N flashlm ddp-bench) for "
      "every DDP variant, bucket size and gradient reduction type, against the step without communication");
  cmd->add_option("--model", a.model, "Size: tiny, small, medium, large, xl, 2.7B, cs336-8b")->capture_default_str();
  cmd->add_option("--context", a.context, "Tokens per sequence")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, kMaxContext));
  cmd->add_option("--batch", a.batch, "Sequences per rank")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, kMaxBatch));
  cmd->add_option("--vocab", a.vocab, "Vocabulary size (default: the size's own: 151936 for cs336-8b, else 10000)")
      ->check(in_range(int64_t{2}, kMaxVocab));
  cmd->add_option("--ddp", a.ddp, "DDP variants, comma list of per-param,flat,async,bucketed,fsdp")
      ->capture_default_str();
  cmd->add_option("--fsdp-prefetch", a.fsdp_prefetch, "fsdp: model parts ahead whose gather starts early")
      ->capture_default_str()
      ->check(CLI::Range(0, 2));
  cmd->add_option("--bucket-mb", a.bucket_mb, "Bucket sizes of the bucketed variant, MB, comma list")
      ->capture_default_str();
  cmd->add_option("--zero", a.zero, "ZeRO-1 off and/or on: comma list of 0,1")->capture_default_str();
  add_gradient_sync_options(cmd, a.reduce_dtype, a.nccl_max_ctas, a.gemm_sm_reserve,
                            "Element types of the gradient all-reduce, comma list (a row each)");
  cmd->add_option("--device", a.device, "cpu or cuda (default: cuda if a GPU is visible)");
  cmd->add_option("--precision", a.precision,
                  "fp32, bf16 (fp32 masters), fp16 or bf16-pure (bf16 parameters, gradients and moments: the fsdp "
                  "rows; DDP and ZeRO-1 refuse it) (default: bf16 on cuda, fp32 on cpu)");
  add_model_memory_options(cmd, a.recompute, a.head_chunk, a.atomic_backward);
  add_optimizer_state_option(cmd, a.optimizer_state);
  cmd->add_option("--warmup", a.warmup, "Untimed steps first")->capture_default_str()->check(in_range(0, kMaxReps));
  cmd->add_option("--steps", a.steps, "Timed steps")->capture_default_str()->check(in_range(1, kMaxReps));
  add_threads_option(cmd, a.threads);
  add_collective_timeout_option(cmd, a.collective_timeout_s);
  add_report_options(cmd, a.format, a.out, a.quiet);
}

int run_ddp_bench_command(const DdpBenchArgs& a) {
  using namespace flashlm;
  DdpBenchConfig cfg;
  ReportFormat format;
  resolve_device_and_precision(a.device, a.precision, cfg.device, cfg.precision, &cfg.bf16_pure);
  cfg.recompute = parse_recompute_option(a.recompute);
  cfg.optimizer_state = parse_optimizer_state_option(a.optimizer_state, cfg.bf16_pure);
  cfg.head_chunk = a.head_chunk;
  cfg.deterministic = !a.atomic_backward;
  try {
    ModelConfig::named(a.model);  // an unknown size is a usage error
    cfg.variants = parse_list<DdpVariant>("--ddp", a.ddp, [](const std::string& s) { return parse_ddp_variant(s); });
    cfg.bucket_mb = parse_list<double>("--bucket-mb", a.bucket_mb,
                                       [](const std::string& s) { return parse_positive<double>(s, kMaxBucketMb); });
    cfg.zero1 = parse_list<bool>("--zero", a.zero, parse_bool);
    format = parse_report_format(a.format);
  } catch (const flashlm::Error& e) {
    throw UsageError(e.what());
  }
  cfg.reduce_dtypes = parse_reduce_dtypes(a.reduce_dtype, cfg.device, a.nccl_max_ctas, a.gemm_sm_reserve);
  cfg.nccl_max_ctas = a.nccl_max_ctas;
  cfg.gemm_sm_reserve = a.gemm_sm_reserve;
  cfg.fsdp_prefetch = a.fsdp_prefetch;
  if (cfg.device == Device::cuda && !Communicator::nccl_built()) {
    throw UsageError("--device cuda: flashlm was built without NCCL");
  }
  cfg.model = a.model;
  cfg.context = a.context;
  cfg.batch = a.batch;
  cfg.vocab = a.vocab;
  cfg.warmup = a.warmup;
  cfg.steps = a.steps;
  if (a.threads > 0) set_cpu_threads(a.threads);
  return run_on_every_rank(a.collective_timeout_s, [&](Communicator& comm) {
    if (!a.quiet && comm.is_root()) {
      cfg.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
      fmt::print(stderr, "ddp-bench: {} rank(s), {} ctx {} x {} sequences per rank, {} on {}, recompute {}\n",
                 comm.world_size(), cfg.model, cfg.context, cfg.batch, precision_name(cfg.precision, cfg.bf16_pure),
                 device_name(cfg.device), cfg.recompute.name());
    }
    const auto records = run_ddp_bench(comm, cfg);
    if (comm.is_root()) {
      emit_report([&](ReportFormat f) { return format_ddp_bench(records, f, cfg, comm); }, format, a.out);
    }
  });
}

void add_info(CLI::App& app) {
  app.add_subcommand("info", "Print the build and the devices flashlm sees")->callback([] {
    fmt::print("flashlm {}\n", FLASHLM_VERSION);
    fmt::print("cpu:  {}, {} OpenMP threads\n", flashlm::describe_device(flashlm::Device::cpu), flashlm::cpu_threads());
    fmt::print("cpu attention kernels: {}\n", flashlm::cpu_attention_kernels());
    fmt::print("blas: {}\n", flashlm::blas_description());
    if (!flashlm::cuda_built()) fmt::print("cuda: not built (nvcc was not found at configure time)\n");
    else if (flashlm::cuda_device_count() == 0) fmt::print("cuda: built, no device visible\n");
    else fmt::print("cuda: {} device(s); current: {}\n", flashlm::cuda_device_count(),
                    flashlm::describe_device(flashlm::Device::cuda));
  });
}

}  // namespace

int main(int argc, char** argv) {
  flashlm::restart_with_cpu_settings(argv);
  CLI::App app{"flashlm: FlashAttention-2, a Transformer LM and data-parallel training, with the tools to measure them"};
  app.require_subcommand(1);
  app.set_version_flag("--version", FLASHLM_VERSION);
  AttentionBenchArgs bench_args;
  add_attention_bench(app, bench_args);
  TrainArgs train_args;
  add_train(app, train_args);
  BenchArgs lm_bench_args;
  add_bench(app, lm_bench_args);
  AllReduceBenchArgs allreduce_args;
  add_allreduce_bench(app, allreduce_args);
  DdpBenchArgs ddp_bench_args;
  add_ddp_bench(app, ddp_bench_args);
  add_info(app);
  TextCommandArgs text_args;
  add_text_commands(app, text_args);

  flashlm::set_report_command_line(argc, argv);
  try {
    refuse_torchrun();
    app.parse(argc, argv);
    if (app.got_subcommand("attention-bench")) {
      return run_attention_bench_command(bench_args, app.get_subcommand("attention-bench")->count("--grid") > 0);
    }
    if (app.got_subcommand("train")) return run_train_command(train_args);
    if (app.got_subcommand("bench")) return run_bench_command(lm_bench_args);
    if (app.got_subcommand("allreduce-bench")) return run_allreduce_bench_command(allreduce_args);
    if (app.got_subcommand("ddp-bench")) return run_ddp_bench_command(ddp_bench_args);
    if (const int rc = run_text_command(app, text_args); rc >= 0) return rc;
    return 0;
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "error: {}\nRun with --help for usage.\n", e.what());
    return 2;
  } catch (const UsageError& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
