// attention-bench --decode: flash_attention_with_kvcache over a paged KV cache, time and bandwidth.
#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "bench/report.h"
#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/device.h"
#include "flashlm/memory.h"

namespace flashlm {

namespace {

double kv_bytes(const DecodeBenchRecord& r, DType dtype) {
  return 2.0 * double(r.batch) * double(r.cache_len) * double(r.kv_heads) * double(r.head_dim) *
         double(dtype_size(dtype));
}

// An int32 array where the tensors are (a device copy for cuda).
Buffer index_array(const std::vector<int32_t>& host, Device device, const char* tag) {
  const size_t bytes = std::max<size_t>(1, host.size()) * sizeof(int32_t);
  Buffer b = Buffer::allocate(bytes, device, tag);
  if (device == Device::cuda) cuda_copy(b.data(), host.data(), host.size() * sizeof(int32_t));
  else std::copy(host.begin(), host.end(), static_cast<int32_t*>(b.data()));
  return b;
}

// Random values in the first pages, copied over the rest: a 34 GB cache filled element by element through the
// host would take minutes, and the bandwidth does not depend on the values.
void fill_pages(const Tensor& cache, uint64_t seed) {
  const int64_t pages = cache.view().size(0);
  if (pages == 0) return;
  const int64_t seeded = std::min<int64_t>(pages, 64);
  fill_normal(cache.view().slice(0, 0, seeded), seed);
  const size_t page_bytes = static_cast<size_t>(cache.numel() / pages) * dtype_size(cache.view().dtype);
  auto* base = static_cast<char*>(cache.data());
  for (int64_t done = seeded; done < pages;) {
    const int64_t n = std::min(done, pages - done);
    const size_t bytes = static_cast<size_t>(n) * page_bytes;
    if (cache.view().device == Device::cuda) cuda_copy(base + static_cast<size_t>(done) * page_bytes, base, bytes);
    else std::copy(base, base + bytes, base + static_cast<size_t>(done) * page_bytes);
    done += n;
  }
}

void measure_row(const DecodeBenchConfig& cfg, DecodeBenchRecord& rec) {
  const Device dev = cfg.device;
  const int64_t pages_per_seq = rec.cache_len / rec.page_size;
  const int64_t num_pages = checked_mul(rec.batch, pages_per_seq, "attention-bench --decode: pages");
  Tensor q = Tensor::empty({rec.batch, rec.nq, rec.heads, rec.head_dim}, cfg.dtype, dev, "q");
  Tensor o = Tensor::empty({rec.batch, rec.nq, rec.heads, rec.head_dim}, cfg.dtype, dev, "o");
  Tensor lse = Tensor::empty({rec.batch, rec.heads, rec.nq}, DType::f32, dev, "lse");
  Tensor k_cache = Tensor::empty({num_pages, rec.page_size, rec.kv_heads, rec.head_dim}, cfg.dtype, dev, "k_cache");
  Tensor v_cache = Tensor::empty({num_pages, rec.page_size, rec.kv_heads, rec.head_dim}, cfg.dtype, dev, "v_cache");
  fill_normal(q, 1);
  fill_pages(k_cache, 2);
  fill_pages(v_cache, 3);
  // The pages in a shuffled order, as an allocator that has run a while hands them out.
  std::vector<int32_t> table(static_cast<size_t>(num_pages));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(7));
  // Every sequence holds the whole cache (no append): the call reads all of K and V.
  const std::vector<int32_t> lens(static_cast<size_t>(rec.batch), static_cast<int32_t>(rec.cache_len));
  const Buffer table_buf = index_array(table, dev, "attention-bench --decode: block table");
  const Buffer lens_buf = index_array(lens, dev, "attention-bench --decode: cache_seqlens");
  KvCacheIndex ix;
  ix.cache_seqlens = static_cast<const int32_t*>(lens_buf.data());
  ix.block_table = static_cast<const int32_t*>(table_buf.data());
  ix.max_pages = pages_per_seq;
  AttentionOptions opt;
  opt.causal = cfg.causal;
  const auto call = [&] { flash_attention_with_kvcache(q, k_cache, v_cache, ix, {}, {}, o, lse, opt); };
  rec.call_ms = median_call_ms(dev, cfg.warmup, cfg.reps, call);
  rec.ms = dev == Device::cuda ? median_cold_l2_ms(cfg.reps, call) : rec.call_ms;
  rec.gbps = kv_bytes(rec, cfg.dtype) / *rec.ms / 1e6;
  rec.peak_pct = 100.0 * *rec.gbps / cfg.peak_gbps;
}

std::string opt_ms(const std::optional<double>& x) { return x ? fmt::format("{:.4f}", *x) : "-"; }

}  // namespace

std::vector<DecodeBenchRecord> run_decode_bench(const DecodeBenchConfig& cfg) {
  FLASHLM_CHECK(cfg.reps >= 1, "attention-bench --decode: reps must be at least 1, got {}", cfg.reps);
  FLASHLM_CHECK(cfg.warmup >= 0, "attention-bench --decode: warmup must be >= 0, got {}", cfg.warmup);
  FLASHLM_CHECK(cfg.peak_gbps > 0, "attention-bench --decode: peak bandwidth must be > 0, got {}", cfg.peak_gbps);
  // What would fail every row is refused before the sweep, as a usage error, rather than recorded row by row.
  constexpr const char* kFn = "attention-bench --decode";
  FLASHLM_CHECK_ARG(cfg.dtype != DType::f8e4m3, "{}: dtype fp8_e4m3 has no KV-cache decoding (--dtype)", kFn);
  FLASHLM_CHECK_ARG(cfg.page_size >= 16 && cfg.page_size <= 256 && cfg.page_size % 16 == 0,
                    "{}: page size {} (--page-size): expected a multiple of 16 in [16, 256]", kFn, cfg.page_size);
  FLASHLM_CHECK_ARG(cfg.heads >= 1 && cfg.kv_heads >= 1 && cfg.heads % cfg.kv_heads == 0,
                    "{}: {} kv heads (--kv-heads) do not divide {} heads", kFn, cfg.kv_heads, cfg.heads);
  FLASHLM_CHECK_ARG(cfg.nq >= 1, "{}: nq (--nq) must be at least 1, got {}", kFn, cfg.nq);
  for (int64_t cache : cfg.cache_lens) {
    FLASHLM_CHECK_ARG(cache >= 1 && cache % cfg.page_size == 0,
                      "{}: cache length {} (--cache) is not a positive multiple of the page size {}", kFn, cache,
                      cfg.page_size);
  }
  std::vector<DecodeBenchRecord> records;
  const size_t total = cfg.batches.size() * cfg.cache_lens.size();
  for (int64_t batch : cfg.batches)
    for (int64_t cache : cfg.cache_lens) {
      DecodeBenchRecord rec;
      rec.dtype = std::string(dtype_name(cfg.dtype));
      rec.device = std::string(device_name(cfg.device));
      rec.batch = batch, rec.cache_len = cache, rec.heads = cfg.heads, rec.kv_heads = cfg.kv_heads;
      rec.head_dim = cfg.head_dim, rec.page_size = cfg.page_size, rec.nq = cfg.nq;
      const auto mark = [&rec](const std::string& status, const std::string& message) {
        rec.status = status, rec.message = message;
      };
      run_row(
          [&] {
            if (cfg.device == Device::cpu && kv_bytes(rec, cfg.dtype) > cfg.cpu_max_bytes) {
              mark("skipped", fmt::format("{:.3g} bytes of K and V on the CPU, above {:.3g}", kv_bytes(rec, cfg.dtype),
                                          cfg.cpu_max_bytes));
            } else {
              measure_row(cfg, rec);
            }
          },
          mark);
      if (cfg.progress) {
        cfg.progress(fmt::format("[{}/{}] decode {} b={} cache={} h={}/{} d={} page={} nq={}: {} ms, {}{}",
                                 records.size() + 1, total, rec.dtype, rec.batch, rec.cache_len, rec.heads,
                                 rec.kv_heads, rec.head_dim, rec.page_size, rec.nq, opt_ms(rec.ms), rec.status,
                                 rec.message.empty() ? "" : " (" + rec.message + ")"));
      }
      records.push_back(std::move(rec));
    }
  return records;
}

std::string format_decode_bench(const std::vector<DecodeBenchRecord>& records, ReportFormat format,
                                const DecodeBenchConfig& cfg) {
  std::vector<nlohmann::json> rows;
  for (const auto& r : records) {
    auto opt = [](const std::optional<double>& x) { return x ? nlohmann::json(*x) : nlohmann::json(); };
    nlohmann::json j = {{"impl", "flash-decode"}, {"device", r.device},     {"dtype", r.dtype},
                        {"batch", r.batch},       {"cache_len", r.cache_len}, {"heads", r.heads},
                        {"kv_heads", r.kv_heads}, {"head_dim", r.head_dim}, {"page_size", r.page_size},
                        {"nq", r.nq},             {"causal", cfg.causal},   {"ms", opt(r.ms)},
                        {"call_ms", opt(r.call_ms)}, {"gbps", opt(r.gbps)},    {"peak_pct", opt(r.peak_pct)}, {"status", r.status}};
    if (!r.message.empty()) j["message"] = r.message;
    rows.push_back(std::move(j));
  }
  const std::vector<ReportColumn> columns = {
      {"dtype", "dtype"},       {"batch", "batch"},     {"cache_len", "cache"}, {"heads", "heads"},
      {"kv_heads", "kv heads"}, {"head_dim", "d"},      {"page_size", "page"},  {"nq", "nq"},
      {"ms", "ms", 4},          {"call_ms", "call ms", 4}, {"gbps", "GB/s", 0},    {"peak_pct", "% of peak", 1}, {"status", "status"}};
  const nlohmann::json meta = {{"tool", "flashlm attention-bench --decode"},
                               {"device", describe_device(cfg.device)},
                               {"threads", cfg.device == Device::cpu ? cpu_threads() : 0},
                               {"date", utc_date()},
                               {"warmup", cfg.warmup},
                               {"reps", cfg.reps},
                               {"peak_gbps", cfg.peak_gbps},
                               {"bytes", "K and V read: 2 * batch * cache * kv_heads * head_dim * element size"},
                               {"timing", "ms: device time, L2 flushed before each call (the host's share hidden); "
                                          "call_ms: each call alone, host included"}};
  return render_report(rows, columns, format, meta);
}

}  // namespace flashlm
