// attention-bench: forward and backward time, TFLOP/s and peak extra memory over a grid of shapes.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <vector>

#include "bench/report.h"
#include "core/check.h"
#include "flashlm/device.h"

namespace flashlm {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median wall time of `reps` calls after `warmup` untimed ones. CPU calls are synchronous.
template <class Fn>
double median_ms(int warmup, int reps, Fn&& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(ms);
}

constexpr double kMiB = 1024.0 * 1024.0;

void measure_row(const AttentionBenchConfig& cfg, AttentionBenchRecord& rec, AttentionImpl impl, DType dtype) {
  const Device dev = cfg.device;
  FLASHLM_CHECK(dev == Device::cpu, "attention-bench: --device cuda needs a CUDA build");
  // Inputs first; everything allocated after `base` is the pass's extra memory (outputs, gradients and
  // workspace), the same convention as the PyTorch peers' torch.cuda.max_memory_allocated().
  Tensor q = Tensor::empty({rec.batch, rec.seq_q, rec.heads, rec.head_dim}, dtype, dev, "q");
  Tensor k = Tensor::empty({rec.batch, rec.seq_k, rec.heads, rec.head_dim}, dtype, dev, "k");
  Tensor v = Tensor::empty({rec.batch, rec.seq_k, rec.heads, rec.head_dim}, dtype, dev, "v");
  Tensor dout = Tensor::empty({rec.batch, rec.seq_q, rec.heads, rec.head_dim}, dtype, dev, "dout");
  fill_normal(q, 1);
  fill_normal(k, 2);
  fill_normal(v, 3);
  fill_normal(dout, 4);

  AttentionOptions opt;
  opt.impl = impl;
  opt.causal = rec.causal;
  opt.align = cfg.align;

  const int64_t base = memory_stats(dev).current_bytes;
  memory_reset_peak(dev);
  Tensor o = Tensor::empty({rec.batch, rec.seq_q, rec.heads, rec.head_dim}, dtype, dev, "o");
  Tensor lse = Tensor::empty({rec.batch, rec.heads, rec.seq_q}, DType::f32, dev, "lse");
  attention_forward(q, k, v, o, lse, opt);
  rec.peak_fwd_mib = double(memory_stats(dev).peak_bytes - base) / kMiB;

  const double flops = attention_forward_flops(rec.batch, rec.heads, rec.seq_q, rec.seq_k, rec.head_dim, rec.causal);
  rec.fwd_ms = median_ms(cfg.warmup, cfg.reps, [&] { attention_forward(q, k, v, o, lse, opt); });
  rec.fwd_tflops = flops / *rec.fwd_ms / 1e9;
  if (!cfg.backward) return;

  memory_reset_peak(dev);
  Tensor dq = Tensor::empty({rec.batch, rec.seq_q, rec.heads, rec.head_dim}, dtype, dev, "dq");
  Tensor dk = Tensor::empty({rec.batch, rec.seq_k, rec.heads, rec.head_dim}, dtype, dev, "dk");
  Tensor dv = Tensor::empty({rec.batch, rec.seq_k, rec.heads, rec.head_dim}, dtype, dev, "dv");
  attention_backward(q, k, v, o, lse, dout, dq, dk, dv, opt);
  rec.peak_bwd_mib = double(memory_stats(dev).peak_bytes - base) / kMiB;
  rec.bwd_ms = median_ms(cfg.warmup, cfg.reps, [&] { attention_backward(q, k, v, o, lse, dout, dq, dk, dv, opt); });
  rec.bwd_tflops = 2.5 * flops / *rec.bwd_ms / 1e9;
}

std::string opt_ms(const std::optional<double>& x) { return x ? fmt::format("{:.3f}", *x) : "-"; }

}  // namespace

std::vector<AttentionBenchRecord> run_attention_bench(const AttentionBenchConfig& cfg) {
  FLASHLM_CHECK(cfg.reps >= 1, "attention-bench: reps must be at least 1, got {}", cfg.reps);
  FLASHLM_CHECK(cfg.warmup >= 0, "attention-bench: warmup must be >= 0, got {}", cfg.warmup);
  std::vector<AttentionBenchRecord> records;
  for (AttentionImpl impl : cfg.impls)
    for (DType dtype : cfg.dtypes)
      for (int64_t d : cfg.head_dims)
        for (int64_t n : cfg.seqs)
          for (int64_t b : cfg.batches)
            for (int64_t h : cfg.heads)
              for (bool causal : cfg.causal) {
                AttentionBenchRecord rec;
                rec.impl = std::string(attention_impl_name(impl));
                rec.dtype = std::string(dtype_name(dtype));
                rec.device = std::string(device_name(cfg.device));
                rec.batch = b;
                rec.heads = h;
                rec.seq_q = rec.seq_k = n;
                rec.head_dim = d;
                rec.causal = causal;
                try {
                  measure_row(cfg, rec, impl, dtype);
                } catch (const OutOfMemory& e) {
                  rec.status = "oom";
                  rec.message = e.what();
                } catch (const std::bad_alloc&) {
                  rec.status = "oom";
                  rec.message = "std::bad_alloc";
                } catch (const Error& e) {
                  rec.status = "error";
                  rec.message = e.what();
                }
                if (cfg.progress) {
                  cfg.progress(fmt::format("[{}/{}] {} {} b={} h={} n={} d={} causal={}: fwd {} ms, bwd {} ms, {}",
                                           records.size() + 1,
                                           cfg.impls.size() * cfg.dtypes.size() * cfg.head_dims.size() *
                                               cfg.seqs.size() * cfg.batches.size() * cfg.heads.size() *
                                               cfg.causal.size(),
                                           rec.impl, rec.dtype, b, h, n, d, int(causal), opt_ms(rec.fwd_ms),
                                           opt_ms(rec.bwd_ms), rec.status));
                }
                records.push_back(std::move(rec));
              }
  return records;
}

std::string format_attention_bench(const std::vector<AttentionBenchRecord>& records, ReportFormat format,
                                   const AttentionBenchConfig& cfg) {
  std::vector<nlohmann::json> rows;
  for (const auto& r : records) {
    auto opt = [](const std::optional<double>& x) { return x ? nlohmann::json(*x) : nlohmann::json(); };
    nlohmann::json j = {{"impl", r.impl},       {"device", r.device},       {"batch", r.batch},
                        {"heads", r.heads},     {"seq_q", r.seq_q},         {"seq_k", r.seq_k},
                        {"head_dim", r.head_dim}, {"causal", r.causal},     {"dtype", r.dtype},
                        {"fwd_ms", opt(r.fwd_ms)}, {"bwd_ms", opt(r.bwd_ms)}, {"fwd_tflops", opt(r.fwd_tflops)},
                        {"bwd_tflops", opt(r.bwd_tflops)}, {"peak_fwd_mib", opt(r.peak_fwd_mib)},
                        {"peak_bwd_mib", opt(r.peak_bwd_mib)}, {"status", r.status}};
    if (!r.message.empty()) j["message"] = r.message;
    rows.push_back(std::move(j));
  }
  const std::vector<ReportColumn> columns = {
      {"impl", "impl"},           {"dtype", "dtype"},          {"batch", "batch"},
      {"heads", "heads"},         {"seq_q", "seq"},            {"head_dim", "d"},
      {"causal", "causal"},       {"fwd_ms", "fwd ms", 3},     {"bwd_ms", "bwd ms", 3},
      {"fwd_tflops", "fwd TFLOP/s", 3}, {"bwd_tflops", "bwd TFLOP/s", 3}, {"peak_fwd_mib", "peak fwd MiB", 1},
      {"peak_bwd_mib", "peak bwd MiB", 1}, {"status", "status"}};
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  const nlohmann::json meta = {{"tool", "flashlm attention-bench"},
                               {"device", describe_device(cfg.device)},
                               {"threads", cfg.device == Device::cpu ? cpu_threads() : 0},
                               {"date", date},
                               {"warmup", cfg.warmup},
                               {"reps", cfg.reps},
                               {"causal_align", cfg.align == CausalAlign::top_left ? "top-left" : "bottom-right"}};
  return render_report(rows, columns, format, meta);
}

}  // namespace flashlm
