// Benchmarks as library functions: the CLI parses arguments and prints, these measure.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "flashlm/attention.h"
#include "flashlm/ddp.h"
#include "flashlm/model.h"
#include "flashlm/profile.h"

namespace flashlm {

enum class ReportFormat : uint8_t { md, csv, json };
ReportFormat parse_report_format(std::string_view name);  // "md" | "csv" | "json"
// The command line every JSON report records (with flashlm's version, the git commit it was built from, and
// the time): the CLI sets it from main's arguments.
void set_report_command_line(int argc, const char* const* argv);

struct AttentionShape {
  int64_t batch = 1, heads = 1, seq = 1024, head_dim = 64;
  bool causal = false;
  int64_t kv_heads = 0;  // key/value heads (GQA/MQA: divides heads); 0 means heads
};

// Every combination of the lists, in the order head_dim, seq, batch, heads, causal.
std::vector<AttentionShape> attention_shape_grid(const std::vector<int64_t>& head_dims, const std::vector<int64_t>& seqs,
                                                 const std::vector<int64_t>& batches, const std::vector<int64_t>& heads,
                                                 const std::vector<bool>& causal);
// Named grids: "fa" (FlashAttention papers: 16k tokens per batch, heads·head_dim = 2048, d 64 and 128,
// seq 512..16384, causal and not) and "seed" (batch 8, one head, d 16..128, seq 256..32768, causal).
std::vector<AttentionShape> attention_named_grid(std::string_view name);

struct AttentionBenchConfig {
  std::vector<AttentionImpl> impls{AttentionImpl::flash};
  std::vector<DType> dtypes{DType::f32};
  std::vector<AttentionShape> shapes{AttentionShape{}};
  CausalAlign align = CausalAlign::top_left;
  bool deterministic = false;  // AttentionOptions::deterministic
  // AttentionOptions::window_size_left/right and softcap, for every row. With a window, TFLOP/s count the
  // (query, key) pairs the band leaves visible (4 · B · H · D per pair forward) instead of the papers' square
  // or half square.
  int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  // v's (and o's) head dim for every row (AttentionOptions' head_dim_v: DeepSeek's 192 / 128); 0: each row's
  // head_dim. TFLOP/s then count Q·K at head_dim and P·V at head_dim_v.
  int64_t head_dim_v = 0;
  Device device = Device::cpu;
  int warmup = 1;
  int reps = 3;
  bool backward = true;
  // CUDA: after each pass is timed, `reps` more calls of it under CUPTI, summarised per kernel (the
  // cuda_gpu_kern_sum table) into the record: where a pass's time goes (its kernels, copies, conversions).
  bool profile_kernels = false;
  // On the CPU a row whose passes (warm-up and timed, forward and backward) would compute more than this
  // many FLOPs is not run but recorded as "skipped", with its count: 1e14 is hours at the CPU attention's
  // rates (docs/perf.md, CPU).
  double cpu_max_flops = 1e14;
  std::function<void(const std::string&)> progress;  // one line per finished row (for stderr)
};

struct AttentionBenchRecord {
  std::string impl, dtype, device;
  int64_t batch = 0, heads = 0, kv_heads = 0, seq_q = 0, seq_k = 0, head_dim = 0, head_dim_v = 0;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // the config's
  double softcap = 0;
  std::optional<double> fwd_ms, bwd_ms, fwd_tflops, bwd_tflops, peak_fwd_mib, peak_bwd_mib;
  std::string status = "ok";  // ok | oom | error | skipped
  std::string message;        // why, when status is not ok
  std::string fwd_kernel_table, bwd_kernel_table;  // cuda_gpu_kern_sum of `reps` calls (profile_kernels)
};

// Runs impl × dtype × shape. A row that runs out of memory or fails records its status and the sweep
// goes on.
std::vector<AttentionBenchRecord> run_attention_bench(const AttentionBenchConfig& config);

// md (a table), csv, or json ({"meta": {...}, "records": [...]}, the schema shared/bench/compare.py reads).
std::string format_attention_bench(const std::vector<AttentionBenchRecord>& records, ReportFormat format,
                                   const AttentionBenchConfig& config);

// `flashlm attention-bench --decode`: flash_attention_with_kvcache over a paged cache (pages shuffled through
// the block table, no append), batch × cache length, reported as time, the bandwidth of the K and V bytes
// read (2 · batch · cache · kv_heads · head_dim · element size / time) and that as a share of `peak_gbps`
// (4800 GB/s: the H200's HBM3e).
struct DecodeBenchConfig {
  std::vector<int64_t> batches{1, 16, 64};
  std::vector<int64_t> cache_lens{4096, 16384, 65536, 131072};
  int64_t heads = 32, kv_heads = 8, head_dim = 128, page_size = 256, nq = 1;
  bool causal = true;
  DType dtype = DType::bf16;
  Device device = Device::cpu;
  int warmup = 5;
  int reps = 20;
  double peak_gbps = 4800;
  // On the CPU a row whose K and V are larger than this many bytes is recorded as "skipped".
  double cpu_max_bytes = 4e9;
  std::function<void(const std::string&)> progress;
};

struct DecodeBenchRecord {
  std::string dtype, device;
  int64_t batch = 0, cache_len = 0, heads = 0, kv_heads = 0, head_dim = 0, page_size = 0, nq = 0;
  // ms: the call's time on the device, K and V not in L2 (on a GPU an L2 flush is queued before each
  // repetition, which also hides the host's share of the call); gbps and peak_pct from it. call_ms: one call
  // timed alone, the host's checks and launches included (what an eager caller that waits for each call sees).
  std::optional<double> ms, call_ms, gbps, peak_pct;
  std::string status = "ok";  // ok | oom | error | skipped
  std::string message;
};

// A configuration that every row would fail (an fp8 dtype, a page size the paged cache cannot have, a cache length
// that is not a multiple of it, kv heads that do not divide the heads) is an InvalidArgument before any row runs.
std::vector<DecodeBenchRecord> run_decode_bench(const DecodeBenchConfig& config);
std::string format_decode_bench(const std::vector<DecodeBenchRecord>& records, ReportFormat format,
                                const DecodeBenchConfig& config);

// `flashlm bench`: end-to-end LM timing per pass ("fwd", "fwd-bwd", "step") over model sizes, contexts,
// precisions and attention implementations.
struct LmBenchConfig {
  std::vector<std::string> models{"small"};  // size names (ModelConfig::named)
  // Instead of `models`: one model from a JSON description (ModelConfig::from_json_file); its context is
  // replaced by each of `contexts`.
  std::string model_config_file;
  std::vector<int64_t> contexts{512};
  int64_t batch = 4;
  int64_t vocab = 0;  // 0: each size's own (151936 for cs336-8b, 10000 for the others)
  std::vector<std::string> precisions{"fp32"};  // fp32, bf16, fp16, bf16-pure (parse_precision)
  std::vector<AttentionImpl> attention{AttentionImpl::flash};
  // Every configuration's model (its attention and bf16_pure come from `attention` and `precisions`):
  // recompute automatic is resolved per configuration against the free memory; optimizer_state applies to
  // the precisions with fp32 masters; cuda_graph to the "step" pass (LanguageModel::train_step).
  ModelOptions options;
  std::vector<std::string> passes{"fwd", "fwd-bwd", "step"};
  int warmup = 5, steps = 10;
  Device device = Device::cpu;
  bool profile_ranges = false;   // print the nvtx_sum table of each configuration's timed steps
  bool trace_ranges = false;     // keep every range instance of the timed steps (LmBenchRecord::ranges)
  bool profile_kernels = false;  // print the cuda_gpu_kern_sum table (CUPTI) of each configuration's timed steps
  int gemm_autotune = 0;  // set_gemm_autotune (model/cuda/gemm.h): time this many cuBLASLt candidates per GEMM shape
  std::function<void(const std::string&)> progress;
};

struct LmBenchRecord {
  std::string model, precision, attention, pass, device;
  std::string recompute;  // the plan that ran (auto resolved)
  int64_t context = 0, batch = 0;
  // mfu: SPEC's count (train_flops_per_token); mfu_useful: with the causal attention products halved.
  std::optional<double> mean_ms, std_ms, median_ms, tokens_per_s, mfu, mfu_useful, peak_mib;
  std::optional<double> plan_mib;  // the memory plan's total, beside the measured peak
  std::string cuda_graph;     // the "step" pass: LanguageModel::cuda_graph_status after the timed steps
  std::string status = "ok";  // ok | oom | unsupported | error
  std::string message;
  std::string range_table;   // nvtx_sum table of the timed steps (profile_ranges)
  std::string kernel_table;  // cuda_gpu_kern_sum table of the timed steps (profile_kernels)
  std::vector<RangeInstance> ranges;  // every range of the timed steps (trace_ranges), for chrome_trace_json
};

std::vector<LmBenchRecord> run_lm_bench(const LmBenchConfig& config);
std::string format_lm_bench(const std::vector<LmBenchRecord>& records, ReportFormat format, const LmBenchConfig& config);

// Model FLOPs per token of a train step as SPEC §2 counts them: 6·(non-embedding parameters) +
// 12·layers·context·d_model; MFU divides the achieved rate by the 989 TFLOP/s dense bf16 peak of H100/H200.
double train_flops_per_token(const ModelConfig& config, int64_t context);
// The same with the attention term halved (6·layers·context·d_model): the products a causal kernel skips
// are not counted. The CS336 leaderboard's comparisons use it.
double useful_train_flops_per_token(const ModelConfig& config, int64_t context);
constexpr double kHopperBf16PeakFlops = 989e12;

// A one-line description of the machine, for reports: CPU model and threads, or the GPU's name.
std::string describe_device(Device device);

// `flashlm allreduce-bench`: in-place all-reduce (sum) of one buffer per rank over message sizes, through
// MPI (CPU buffers) or NCCL (GPU buffers), with nccl-tests' algorithm and bus bandwidths.
class Communicator;

// "1048576", "64KB", "1MB", "1GB" (decimal: powers of 1000, as nccl-tests and the seed's 1MB..1GB
// sweep count) or "64KiB", "1MiB", "1GiB" (powers of 1024); the unit is case-insensitive and the B
// optional ("4k", "1m"). Throws flashlm::Error for anything else or for zero.
int64_t parse_byte_size(std::string_view text);
std::string format_byte_size(int64_t bytes);  // "1 MB", "64 KiB", "1000 B"

struct AllReduceBenchConfig {
  std::vector<int64_t> sizes{1000000, 10000000, 100000000, 1000000000};  // bytes per rank
  std::vector<DType> dtypes{DType::f32};  // CPU: fp32, fp64; CUDA: fp32, fp64, fp16, bf16
  Device device = Device::cpu;
  int warmup = 5, iters = 20;
  std::function<void(const std::string&)> progress;  // rank 0 only
  // flashlm::InvalidArgument naming the first bad field; run_allreduce_bench calls it, a launcher may call it
  // before starting the ranks.
  void validate() const;
};

struct AllReduceBenchRecord {
  std::string backend, dtype, device, size;
  int world_size = 1;
  int64_t bytes = 0, elements = 0;
  // Per iteration the slowest rank's time (as nccl-tests), then median / mean / min over iterations.
  std::optional<double> median_ms, mean_ms, min_ms, algbw_gbps, busbw_gbps;
  std::string status = "ok";  // ok | oom | error (the same on every rank)
  std::string message;
};

// Collective: every rank calls it with the same config. A size that some rank cannot allocate is `oom`
// on every rank and the sweep goes on; a failed collective throws.
std::vector<AllReduceBenchRecord> run_allreduce_bench(Communicator& comm, const AllReduceBenchConfig& config);
std::string format_allreduce_bench(const std::vector<AllReduceBenchRecord>& records, ReportFormat format,
                                   const AllReduceBenchConfig& config, const Communicator& comm);

// `flashlm ddp-bench`: the LM's train step data-parallel across the ranks of a job, for every DDP variant
// (and bucket size, gradient reduction type, and with or without ZeRO-1), against the same step without
// communication measured in the same run (the one-GPU number that scaling efficiency divides by).
struct DdpBenchConfig {
  std::string model = "xl";
  int64_t context = 512, batch = 4, vocab = 10000;  // batch: sequences per rank
  Device device = Device::cpu;
  DType precision = DType::f32;
  std::vector<DdpVariant> variants{DdpVariant::per_param, DdpVariant::flat, DdpVariant::async, DdpVariant::bucketed};
  std::vector<double> bucket_mb{1, 10, 100, 1000};  // bucketed only
  std::vector<DType> reduce_dtypes{DType::f32};     // DdpOptions::reduce_dtype; 16-bit ones need CUDA
  std::vector<bool> zero1{false};
  int nccl_max_ctas = 0;     // Communicator::set_nccl_max_ctas; 0: NCCL's choice
  int gemm_sm_reserve = -1;  // DdpOptions::gemm_sm_reserve; -1: automatic
  int fsdp_prefetch = 1;     // DdpOptions::fsdp_prefetch of the fsdp rows
  // How every row's model is built: pure bf16 (the fsdp rows train it; DDP and ZeRO-1 refuse it, an "error"
  // row), the recomputation plan (automatic: resolved per row against the free memory, as `flashlm train`
  // does), the moments beside fp32 masters (not bf16 under ZeRO-1 or FSDP: their rows are "error" rows naming
  // why), the LM head's chunk and the attention backward's determinism. The attention is flash; the sharding
  // fields are set per row.
  ModelOptions options;
  int warmup = 3, steps = 10;
  std::function<void(const std::string&)> progress;  // rank 0 only
};

struct DdpBenchRecord {
  std::string variant;  // "none": the step without communication (world 1); otherwise a DDP variant
  std::optional<double> bucket_mb;
  std::string reduce_dtype;  // element type of the all-reduce ("fp32", "bf16", "fp16"); empty for "none"
  std::string gradient_sync;  // DdpModel::gradient_sync(): "all-reduce" or "reduce-scatter"; empty for "none"
  bool zero1 = false;
  int world_size = 1;
  int64_t buckets = 0;  // DDP buckets: all-reduces (or reduce-scatters) per step
  // Per step the slowest rank's time, then mean and median over steps; the communication not hidden by
  // the backward (DdpStats::exposed_ms), mean over steps of the slowest rank.
  std::optional<double> mean_ms, median_ms, exposed_comm_ms;
  // tokens/s of the whole job; scaling efficiency = tokens/s / (world size · tokens/s of "none").
  std::optional<double> tokens_per_s, scaling_efficiency;
  std::optional<double> optimizer_state_mib;  // AdamW moments per rank
  std::optional<double> staging_mib;          // DataParallel::staging_bytes() per rank
  // DdpModel::memory() per rank: parameters and gradients kept current, FSDP's peak of gathered parts; and
  // the peak of every tracked allocation on the device over the timed steps (the largest rank's).
  std::optional<double> parameters_mib, gradients_mib, gathered_mib, peak_mib;
  std::string recompute;                      // the plan the row's model ran (auto resolved)
  // ok | oom | error (the same on every rank) | "not timed": the step without communication, whose memory
  // plan does not fit (the message names the shortfall; the FSDP rows still run, without a scaling efficiency)
  std::string status = "ok";
  std::string message;
};

// Collective: every rank calls it with the same config.
std::vector<DdpBenchRecord> run_ddp_bench(Communicator& comm, const DdpBenchConfig& config);
std::string format_ddp_bench(const std::vector<DdpBenchRecord>& records, ReportFormat format,
                             const DdpBenchConfig& config, const Communicator& comm);

}  // namespace flashlm
