// Rendering of benchmark records (one JSON object per row) as markdown, CSV or JSON — shared by every
// benchmark command so that all of them speak the same three formats.
#pragma once
#include <nlohmann/json.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "flashlm/bench.h"
#include "flashlm/device.h"

namespace flashlm {

struct ReportColumn {
  std::string key;     // field of the record
  std::string header;  // markdown header
  int decimals = 2;    // for floating-point values
};

std::string render_report(const std::vector<nlohmann::json>& records, const std::vector<ReportColumn>& columns,
                          ReportFormat format, const nlohmann::json& meta);

// Mean, sample standard deviation and median of timings (at least one).
struct Moments {
  double mean = 0, stddev = 0, median = 0;
};
Moments moments(std::vector<double> samples);

// Milliseconds of wall time since `t0`.
inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Median time of `reps` calls of fn after `warmup` untimed ones: wall time on the CPU (the calls are
// synchronous there), CUDA events around each call on the GPU.
double median_call_ms(Device device, int warmup, int reps, const std::function<void()>& fn);
// The median device time of fn on the GPU with the L2 cache flushed before each repetition: a read of
// kL2FlushBytes queued first, so that fn's operands come from HBM, and the GPU stays busy while the host
// prepares fn's launches (the host's share of a short call is not counted). A read, not Triton do_bench's
// memset: a memset leaves the L2 full of dirty lines, and writing them back would be charged to fn.
inline constexpr size_t kL2FlushBytes = size_t{256} << 20;
double median_cold_l2_ms(int reps, const std::function<void()>& fn);

std::string utc_date();  // "2026-11-30", for the reports' meta

// Runs one row of a sweep: an OutOfMemory or std::bad_alloc marks the row "oom", another flashlm::Error
// "error", each with its message (mark(status, message)), and the sweep goes on to the next row.
void run_row(const std::function<void()>& row,
             const std::function<void(const std::string& status, const std::string& message)>& mark);

}  // namespace flashlm
