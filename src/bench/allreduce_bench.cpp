// allreduce-bench: time of an in-place all-reduce (sum) per message size across the ranks of a job,
// through MPI (CPU buffers) or NCCL (GPU buffers), reported with nccl-tests' bandwidths.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <span>
#include <vector>

#include "bench/report.h"
#include "core/check.h"
#include "flashlm/dist.h"

#ifdef FLASHLM_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace flashlm {

int64_t parse_byte_size(std::string_view text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  std::string unit;
  for (char c : text.substr(digits)) unit += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (!unit.empty() && unit.back() == 'b') unit.pop_back();
  int64_t mult = 0;
  if (unit.empty()) mult = 1;
  else if (unit == "k") mult = 1000;
  else if (unit == "m") mult = 1000 * 1000;
  else if (unit == "g") mult = 1000 * 1000 * 1000;
  else if (unit == "ki") mult = int64_t{1} << 10;
  else if (unit == "mi") mult = int64_t{1} << 20;
  else if (unit == "gi") mult = int64_t{1} << 30;
  int64_t value = 0;
  bool ok = digits > 0 && digits <= 12 && mult > 0;
  for (size_t i = 0; ok && i < digits; ++i) value = value * 10 + (text[i] - '0');
  ok = ok && value > 0 && value <= (int64_t{1} << 50) / mult;
  if (!ok) {
    fail_argument("'{}' is not a size in bytes: expected a positive integer with an optional unit KB, MB, GB "
                  "(powers of 1000) or KiB, MiB, GiB (powers of 1024), e.g. 1MB or 64KiB",
                  text);
  }
  return value * mult;
}

std::string format_byte_size(int64_t bytes) {
  struct Unit {
    int64_t size;
    const char* name;
  };
  for (const Unit u : {Unit{1000000000, "GB"}, Unit{int64_t{1} << 30, "GiB"}, Unit{1000000, "MB"},
                       Unit{int64_t{1} << 20, "MiB"}, Unit{1000, "KB"}, Unit{1024, "KiB"}}) {
    if (bytes >= u.size && bytes % u.size == 0) return fmt::format("{} {}", bytes / u.size, u.name);
  }
  return fmt::format("{} B", bytes);
}

namespace {

// The rank's buffer, zeroed (sums of zeros stay zeros: no overflow, no subnormals, whatever the
// number of iterations and ranks).
Tensor zeroed_buffer(int64_t elements, DType dtype, Device device) {
  Tensor t = Tensor::empty({elements}, dtype, device, "allreduce-bench buffer");
  if (device == Device::cpu) {
    std::memset(t.data(), 0, t.bytes());
  } else {
#ifdef FLASHLM_WITH_CUDA
    FLASHLM_CUDA_CHECK(cudaMemset(t.data(), 0, t.bytes()), "cudaMemset");
    FLASHLM_CUDA_CHECK(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
  }
  return t;
}

void measure(Communicator& comm, const AllReduceBenchConfig& cfg, AllReduceBenchRecord& rec, DType dtype) {
  // Allocation may fail on some ranks only: decide together whether this size runs.
  Tensor buf;
  std::string error;
  double code = 0;  // 0 ok, 1 oom, 2 error
  try {
    buf = zeroed_buffer(rec.elements, dtype, cfg.device);
  } catch (const OutOfMemory& e) {
    error = e.what(), code = 1;
  } catch (const std::bad_alloc&) {
    error = "std::bad_alloc", code = 1;
  } catch (const Error& e) {
    error = e.what(), code = 2;
  }
  comm.all_reduce(std::span<double>(&code, 1), ReduceOp::max);
  if (const std::string first = comm.first_error(error); !first.empty()) {
    rec.status = code == 1 ? "oom" : "error";
    rec.message = first;
    return;
  }

  const auto run_one = [&] {
    comm.all_reduce(buf, ReduceOp::sum);
    if (cfg.device == Device::cuda) comm.synchronize();
  };
  for (int i = 0; i < cfg.warmup; ++i) run_one();
  std::vector<double> ms(static_cast<size_t>(cfg.iters));
  for (double& t : ms) {
    comm.barrier();  // start together; the barrier is not timed
    const auto t0 = std::chrono::steady_clock::now();
    run_one();
    t = ms_since(t0);
  }
  // An iteration lasts until its slowest rank is done (nccl-tests reports the maximum over ranks).
  comm.all_reduce(std::span<double>(ms), ReduceOp::max);
  const Moments stats = moments(ms);
  rec.median_ms = stats.median;
  rec.mean_ms = stats.mean;
  rec.min_ms = *std::min_element(ms.begin(), ms.end());
  // nccl-tests' definitions (doc/PERFORMANCE.md of github.com/NVIDIA/nccl-tests): algbw = bytes / time;
  // busbw = algbw * 2(n-1)/n for all-reduce, the bandwidth each link carries in a ring all-reduce (each
  // rank sends and receives 2(n-1)/n of the buffer), comparable with the hardware's peak. The time is
  // the median over iterations here (nccl-tests uses the mean of a batch of iterations).
  const int n = rec.world_size;
  rec.algbw_gbps = static_cast<double>(rec.bytes) / (*rec.median_ms * 1e-3) / 1e9;
  rec.busbw_gbps = *rec.algbw_gbps * 2.0 * (n - 1) / n;
}

}  // namespace

void AllReduceBenchConfig::validate() const {
  FLASHLM_CHECK_ARG(iters >= 1, "allreduce-bench: iters must be at least 1, got {}", iters);
  FLASHLM_CHECK_ARG(warmup >= 0, "allreduce-bench: warmup must be >= 0, got {}", warmup);
  for (DType t : dtypes) {
    FLASHLM_CHECK_ARG(device == Device::cuda || t == DType::f32 || t == DType::f64,
                      "allreduce-bench: dtype {} needs --device cuda (MPI on the CPU carries fp32 and fp64)",
                      dtype_name(t));
  }
  for (int64_t s : sizes) FLASHLM_CHECK_ARG(s > 0, "allreduce-bench: size {} bytes, expected > 0", s);
}

std::vector<AllReduceBenchRecord> run_allreduce_bench(Communicator& comm, const AllReduceBenchConfig& cfg) {
  cfg.validate();
  // Every rank must run the same sweep, or the collectives would pair up wrongly.
  comm.agree(static_cast<int64_t>(cfg.sizes.size()), "the number of sizes");
  for (int64_t s : cfg.sizes) comm.agree(s, "the message sizes");
  comm.agree(static_cast<int64_t>(cfg.dtypes.size()), "the number of dtypes");
  for (DType t : cfg.dtypes) comm.agree(static_cast<int64_t>(t), "the dtypes");
  comm.agree(cfg.warmup, "the warm-up iterations");
  comm.agree(cfg.iters, "the timed iterations");
  comm.agree(static_cast<int64_t>(cfg.device), "the device");
  if (cfg.device == Device::cuda) comm.setup_cuda();

  std::vector<AllReduceBenchRecord> records;
  const size_t total = cfg.sizes.size() * cfg.dtypes.size();
  for (DType dtype : cfg.dtypes) {
    for (int64_t size : cfg.sizes) {
      AllReduceBenchRecord rec;
      rec.backend = cfg.device == Device::cuda ? "nccl" : "mpi";
      rec.dtype = std::string(dtype_name(dtype));
      rec.device = std::string(device_name(cfg.device));
      rec.world_size = comm.world_size();
      rec.size = format_byte_size(size);
      rec.elements = size / static_cast<int64_t>(dtype_size(dtype));
      rec.bytes = rec.elements * static_cast<int64_t>(dtype_size(dtype));
      if (rec.elements == 0) {
        rec.status = "error";
        rec.message = fmt::format("{} bytes is less than one {} element", size, rec.dtype);
      } else {
        measure(comm, cfg, rec, dtype);
      }
      if (cfg.progress && comm.is_root()) {
        const std::string result =
            rec.status == "ok" ? fmt::format("median {:.3f} ms, algbw {:.2f} GB/s, busbw {:.2f} GB/s", *rec.median_ms,
                                             *rec.algbw_gbps, *rec.busbw_gbps)
                               : rec.status + " (" + rec.message + ")";
        cfg.progress(fmt::format("[{}/{}] all-reduce {} {} x {} ranks ({}): {}", records.size() + 1, total, rec.size,
                                 rec.dtype, rec.world_size, rec.backend, result));
      }
      records.push_back(std::move(rec));
    }
  }
  return records;
}

std::string format_allreduce_bench(const std::vector<AllReduceBenchRecord>& records, ReportFormat format,
                                   const AllReduceBenchConfig& cfg, const Communicator& comm) {
  std::vector<nlohmann::json> rows;
  for (const auto& r : records) {
    auto opt = [](const std::optional<double>& x) { return x ? nlohmann::json(*x) : nlohmann::json(); };
    nlohmann::json j = {{"op", "all_reduce"},         {"backend", r.backend},         {"device", r.device},
                        {"world_size", r.world_size}, {"dtype", r.dtype},             {"size", r.size},
                        {"bytes", r.bytes},           {"elements", r.elements},       {"median_ms", opt(r.median_ms)},
                        {"mean_ms", opt(r.mean_ms)},  {"min_ms", opt(r.min_ms)},      {"algbw_gbps", opt(r.algbw_gbps)},
                        {"busbw_gbps", opt(r.busbw_gbps)}, {"status", r.status}};
    if (!r.message.empty()) j["message"] = r.message;
    rows.push_back(std::move(j));
  }
  const std::vector<ReportColumn> columns = {
      {"backend", "backend"},         {"world_size", "ranks"},           {"dtype", "dtype"},
      {"size", "size"},               {"bytes", "bytes"},                {"median_ms", "median ms", 3},
      {"mean_ms", "mean ms", 3},      {"algbw_gbps", "algbw GB/s", 2},   {"busbw_gbps", "busbw GB/s", 2},
      {"status", "status"}};
  const nlohmann::json meta = {
      {"tool", "flashlm allreduce-bench"},
      {"device", describe_device(cfg.device)},
      {"world_size", comm.world_size()},
      {"ranks_per_node", comm.local_size()},
      {"date", utc_date()},
      {"warmup", cfg.warmup},
      {"iters", cfg.iters},
      {"in_place", true},
      {"timing", "per iteration the slowest rank's time; median and mean over iterations"},
      {"bandwidth", "algbw = bytes / median time; busbw = algbw * 2(n-1)/n (nccl-tests); GB = 1e9 bytes"}};
  return render_report(rows, columns, format, meta);
}

}  // namespace flashlm
