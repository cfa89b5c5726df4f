// Benchmarks as library functions: the CLI parses arguments and prints, these measure.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "flashlm/attention.h"

namespace flashlm {

enum class ReportFormat : uint8_t { md, csv, json };
ReportFormat parse_report_format(std::string_view name);  // "md" | "csv" | "json"

struct AttentionShape {
  int64_t batch = 1, heads = 1, seq = 1024, head_dim = 64;
  bool causal = false;
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
  bool deterministic = false;  // the backward's deterministic dQ mode (CUDA)
  Device device = Device::cpu;
  int warmup = 1;
  int reps = 3;
  bool backward = true;
  std::function<void(const std::string&)> progress;  // one line per finished row (for stderr)
};

struct AttentionBenchRecord {
  std::string impl, dtype, device;
  int64_t batch = 0, heads = 0, seq_q = 0, seq_k = 0, head_dim = 0;
  bool causal = false;
  std::optional<double> fwd_ms, bwd_ms, fwd_tflops, bwd_tflops, peak_fwd_mib, peak_bwd_mib;
  std::string status = "ok";  // ok | oom | error
  std::string message;        // why, when status is not ok
};

// Runs impl × dtype × shape. A row that runs out of memory or fails records its status and the sweep
// goes on.
std::vector<AttentionBenchRecord> run_attention_bench(const AttentionBenchConfig& config);

// md (a table), csv, or json ({"meta": {...}, "records": [...]}, the schema shared/bench/compare.py reads).
std::string format_attention_bench(const std::vector<AttentionBenchRecord>& records, ReportFormat format,
                                   const AttentionBenchConfig& config);

// A one-line description of the machine, for reports: CPU model and threads, or the GPU's name.
std::string describe_device(Device device);

}  // namespace flashlm
