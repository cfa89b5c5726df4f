// attention-bench: forward and backward time, TFLOP/s and peak extra memory over a grid of shapes.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "bench/report.h"
#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/device.h"
#include "flashlm/profile.h"

namespace flashlm {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// The forward FLOPs of a row: as the FlashAttention papers count them, or with a sliding window 4 · B · H · D
// per (query, key) pair the band leaves visible (flashlm/attention.h's band: causal makes the right side 0).
// With a head_dim_v of its own, D is the mean of the two: 2 · head_dim for Q·K and 2 · head_dim_v for P·V.
double forward_flops(const AttentionBenchConfig& cfg, const AttentionBenchRecord& rec) {
  const double dims = static_cast<double>(rec.head_dim + rec.head_dim_v) / static_cast<double>(2 * rec.head_dim);
  const int64_t right = rec.causal ? 0 : rec.window_right;  // -1: unbounded
  if (rec.window_left < 0 && (rec.causal || right < 0)) {  // no window beyond the causal mask
    return dims * attention_forward_flops(rec.batch, rec.heads, rec.seq_q, rec.seq_k, rec.head_dim, rec.causal);
  }
  const int64_t offset = cfg.align == CausalAlign::bottom_right ? rec.seq_k - rec.seq_q : 0;
  double pairs = 0;
  for (int64_t i = 0; i < rec.seq_q; ++i) {
    const int64_t lo = rec.window_left < 0 ? 0 : std::clamp<int64_t>(i + offset - rec.window_left, 0, rec.seq_k);
    const int64_t hi = right < 0 ? rec.seq_k : std::clamp<int64_t>(i + offset + right + 1, 0, rec.seq_k);
    pairs += static_cast<double>(std::max<int64_t>(0, hi - lo));
  }
  return dims * 4.0 * static_cast<double>(rec.batch * rec.heads * rec.head_dim) * pairs;
}

// Backward FLOPs over forward FLOPs: Q·Kᵀ again, dQ and dK at head_dim, dO·Vᵀ and Pᵀ·dO at head_dim_v, against
// the forward's one product at each: 2.5 (the papers') where the two are equal.
double backward_ratio(const AttentionBenchRecord& rec) {
  return static_cast<double>(3 * rec.head_dim + 2 * rec.head_dim_v) / static_cast<double>(rec.head_dim + rec.head_dim_v);
}

// The FLOPs every pass of a row computes (warm-up and timed runs).
double row_flops(const AttentionBenchConfig& cfg, const AttentionBenchRecord& rec) {
  return forward_flops(cfg, rec) * (cfg.backward ? 1.0 + backward_ratio(rec) : 1.0) * (1 + cfg.warmup + cfg.reps);
}

// The cuda_gpu_kern_sum table of `calls` more calls of fn, recorded apart from the timed ones (CUPTI's
// activity records cost the timed calls nothing then).
std::string kernel_summary(int calls, const std::function<void()>& fn) {
  KernelProfiler& kernels = KernelProfiler::instance();
  kernels.reset();
  kernels.start();
  for (int i = 0; i < calls; ++i) fn();
  kernels.stop();  // synchronises
  return kernels.kern_sum_table();
}

void measure_row(const AttentionBenchConfig& cfg, AttentionBenchRecord& rec, AttentionImpl impl, DType dtype) {
  const Device dev = cfg.device;
  // Inputs first; everything allocated after `base` is the pass's extra memory (outputs, gradients and
  // workspace), the same convention as the PyTorch peers' torch.cuda.max_memory_allocated().
  Tensor q = Tensor::empty({rec.batch, rec.seq_q, rec.heads, rec.head_dim}, dtype, dev, "q");
  Tensor k = Tensor::empty({rec.batch, rec.seq_k, rec.kv_heads, rec.head_dim}, dtype, dev, "k");
  Tensor v = Tensor::empty({rec.batch, rec.seq_k, rec.kv_heads, rec.head_dim_v}, dtype, dev, "v");
  // fp8_e4m3 inputs write a bf16 o, and their backward takes a bf16 dO and writes bf16 gradients (its fast case).
  const bool fp8 = dtype == DType::f8e4m3;
  const DType out_dtype = fp8 ? DType::bf16 : dtype;
  Tensor dout = Tensor::empty({rec.batch, rec.seq_q, rec.heads, rec.head_dim_v}, out_dtype, dev, "dout");
  fill_normal(q, 1);
  fill_normal(k, 2);
  fill_normal(v, 3);
  fill_normal(dout, 4);

  AttentionOptions opt;
  opt.impl = impl;
  opt.causal = rec.causal;
  opt.align = cfg.align;
  opt.deterministic = cfg.deterministic;
  opt.window_size_left = cfg.window_left;
  opt.window_size_right = cfg.window_right;
  opt.softcap = cfg.softcap;

  const int64_t base = memory_stats(dev).current_bytes;
  memory_reset_peak(dev);
  Tensor o = Tensor::empty({rec.batch, rec.seq_q, rec.heads, rec.head_dim_v}, out_dtype, dev, "o");
  Tensor lse = Tensor::empty({rec.batch, rec.heads, rec.seq_q}, DType::f32, dev, "lse");
  attention_forward(q, k, v, o, lse, opt);
  if (dev == Device::cuda) cuda_synchronize();
  rec.peak_fwd_mib = double(memory_stats(dev).peak_bytes - base) / kMiB;

  const double flops = forward_flops(cfg, rec);
  const auto forward = [&] { attention_forward(q, k, v, o, lse, opt); };
  rec.fwd_ms = median_call_ms(dev, cfg.warmup, cfg.reps, forward);
  rec.fwd_tflops = flops / *rec.fwd_ms / 1e9;
  if (cfg.profile_kernels) rec.fwd_kernel_table = kernel_summary(cfg.reps, forward);
  if (!cfg.backward) return;

  memory_reset_peak(dev);
  Tensor dq = Tensor::empty({rec.batch, rec.seq_q, rec.heads, rec.head_dim}, out_dtype, dev, "dq");
  Tensor dk = Tensor::empty({rec.batch, rec.seq_k, rec.kv_heads, rec.head_dim}, out_dtype, dev, "dk");
  Tensor dv = Tensor::empty({rec.batch, rec.seq_k, rec.kv_heads, rec.head_dim_v}, out_dtype, dev, "dv");
  attention_backward(q, k, v, o, lse, dout, dq, dk, dv, opt);
  if (dev == Device::cuda) cuda_synchronize();
  rec.peak_bwd_mib = double(memory_stats(dev).peak_bytes - base) / kMiB;
  const auto backward = [&] { attention_backward(q, k, v, o, lse, dout, dq, dk, dv, opt); };
  rec.bwd_ms = median_call_ms(dev, cfg.warmup, cfg.reps, backward);
  rec.bwd_tflops = backward_ratio(rec) * flops / *rec.bwd_ms / 1e9;
  if (cfg.profile_kernels) rec.bwd_kernel_table = kernel_summary(cfg.reps, backward);
}

std::string opt_ms(const std::optional<double>& x) { return x ? fmt::format("{:.3f}", *x) : "-"; }

}  // namespace

std::vector<AttentionBenchRecord> run_attention_bench(const AttentionBenchConfig& cfg) {
  FLASHLM_CHECK(cfg.reps >= 1, "attention-bench: reps must be at least 1, got {}", cfg.reps);
  FLASHLM_CHECK(cfg.warmup >= 0, "attention-bench: warmup must be >= 0, got {}", cfg.warmup);
  FLASHLM_CHECK_ARG(!cfg.profile_kernels || cfg.device == Device::cuda,
                    "attention-bench: the kernel summary (CUPTI, --profile-kernels) needs --device cuda");
  if (cfg.profile_kernels) {  // fail before the sweep when CUPTI cannot be used
    KernelProfiler::instance().start();
    KernelProfiler::instance().stop();
  }
  std::vector<AttentionBenchRecord> records;
  const size_t total = cfg.impls.size() * cfg.dtypes.size() * cfg.shapes.size();
  for (const AttentionShape& shape : cfg.shapes)
    for (DType dtype : cfg.dtypes)
      for (AttentionImpl impl : cfg.impls) {
        AttentionBenchRecord rec;
        rec.impl = std::string(attention_impl_name(impl));
        rec.dtype = std::string(dtype_name(dtype));
        rec.device = std::string(device_name(cfg.device));
        rec.batch = shape.batch;
        rec.heads = shape.heads;
        rec.kv_heads = shape.kv_heads > 0 ? shape.kv_heads : shape.heads;
        rec.seq_q = rec.seq_k = shape.seq;
        rec.head_dim = shape.head_dim;
        rec.head_dim_v = cfg.head_dim_v > 0 ? cfg.head_dim_v : shape.head_dim;
        rec.causal = shape.causal;
        rec.window_left = cfg.window_left;
        rec.window_right = cfg.window_right;
        rec.softcap = cfg.softcap;
        const auto mark = [&rec](const std::string& status, const std::string& message) {
          rec.status = status, rec.message = message;
        };
        run_row(
            [&] {
              if (cfg.device == Device::cpu && !(row_flops(cfg, rec) <= cfg.cpu_max_flops)) {
                mark("skipped", fmt::format("{:.2g} FLOPs on the CPU, above the limit of {:.2g} (--cpu-max-flops)",
                                            row_flops(cfg, rec), cfg.cpu_max_flops));
              } else {
                measure_row(cfg, rec, impl, dtype);
              }
            },
            mark);
        if (cfg.progress) {
          cfg.progress(fmt::format("[{}/{}] {} {} b={} h={}/{} n={} d={} causal={}: fwd {} ms, bwd {} ms, {}{}",
                                   records.size() + 1, total, rec.impl, rec.dtype, rec.batch, rec.heads, rec.kv_heads,
                                   rec.seq_q,
                                   rec.head_dim, int(rec.causal), opt_ms(rec.fwd_ms), opt_ms(rec.bwd_ms), rec.status,
                                   rec.message.empty() ? "" : " (" + rec.message + ")"));
        }
        records.push_back(std::move(rec));
      }
  return records;
}

std::vector<AttentionShape> attention_shape_grid(const std::vector<int64_t>& head_dims, const std::vector<int64_t>& seqs,
                                                 const std::vector<int64_t>& batches, const std::vector<int64_t>& heads,
                                                 const std::vector<bool>& causal) {
  std::vector<AttentionShape> shapes;
  for (int64_t d : head_dims)
    for (int64_t n : seqs)
      for (int64_t b : batches)
        for (int64_t h : heads)
          for (bool c : causal) shapes.push_back({b, h, n, d, c});
  return shapes;
}

std::vector<AttentionShape> attention_named_grid(std::string_view name) {
  std::vector<AttentionShape> shapes;
  if (name == "fa") {
    for (int64_t d : {64, 128})
      for (int64_t n : {512, 1024, 2048, 4096, 8192, 16384})
        for (bool c : {false, true}) shapes.push_back({std::max<int64_t>(1, 16384 / n), 2048 / d, n, d, c});
  } else if (name == "seed") {
    for (int64_t d : {16, 32, 64, 128})
      for (int64_t n : {256, 1024, 4096, 8192, 16384, 32768}) shapes.push_back({8, 1, n, d, true});
  } else {
    fail_argument("unknown grid '{}': expected fa or seed", name);
  }
  return shapes;
}

std::string format_attention_bench(const std::vector<AttentionBenchRecord>& records, ReportFormat format,
                                   const AttentionBenchConfig& cfg) {
  std::vector<nlohmann::json> rows;
  for (const auto& r : records) {
    auto opt = [](const std::optional<double>& x) { return x ? nlohmann::json(*x) : nlohmann::json(); };
    nlohmann::json j = {{"impl", r.impl},       {"device", r.device},       {"batch", r.batch},
                        {"heads", r.heads},     {"kv_heads", r.kv_heads},   {"seq_q", r.seq_q},
                        {"seq_k", r.seq_k},
                        {"head_dim", r.head_dim}, {"head_dim_v", r.head_dim_v}, {"causal", r.causal},
                        {"dtype", r.dtype},
                        {"window_left", r.window_left}, {"window_right", r.window_right}, {"softcap", r.softcap},
                        {"fwd_ms", opt(r.fwd_ms)}, {"bwd_ms", opt(r.bwd_ms)}, {"fwd_tflops", opt(r.fwd_tflops)},
                        {"bwd_tflops", opt(r.bwd_tflops)}, {"peak_fwd_mib", opt(r.peak_fwd_mib)},
                        {"peak_bwd_mib", opt(r.peak_bwd_mib)}, {"status", r.status}};
    if (!r.message.empty()) j["message"] = r.message;
    if (!r.fwd_kernel_table.empty()) j["fwd_kernel_table"] = r.fwd_kernel_table;
    if (!r.bwd_kernel_table.empty()) j["bwd_kernel_table"] = r.bwd_kernel_table;
    rows.push_back(std::move(j));
  }
  const std::vector<ReportColumn> columns = {
      {"impl", "impl"},           {"dtype", "dtype"},          {"batch", "batch"},
      {"heads", "heads"},         {"seq_q", "seq"},            {"head_dim", "d"},          {"head_dim_v", "d_v"},
      {"kv_heads", "kv heads"},   {"causal", "causal"},       {"window_left", "window left"},
      {"window_right", "window right"}, {"softcap", "softcap", 1}, {"fwd_ms", "fwd ms", 3},     {"bwd_ms", "bwd ms", 3},
      {"fwd_tflops", "fwd TFLOP/s", 3}, {"bwd_tflops", "bwd TFLOP/s", 3}, {"peak_fwd_mib", "peak fwd MiB", 1},
      {"peak_bwd_mib", "peak bwd MiB", 1}, {"status", "status"}};
  const nlohmann::json meta = {{"tool", "flashlm attention-bench"},
                               {"device", describe_device(cfg.device)},
                               {"threads", cfg.device == Device::cpu ? cpu_threads() : 0},
                               {"date", utc_date()},
                               {"warmup", cfg.warmup},
                               {"reps", cfg.reps},
                               {"causal_align", cfg.align == CausalAlign::top_left ? "top-left" : "bottom-right"},
                               {"flash_dq", cfg.deterministic ? "separate pass (deterministic)" : "fp32 atomics in the dK/dV kernel"}};
  return render_report(rows, columns, format, meta);
}

}  // namespace flashlm
