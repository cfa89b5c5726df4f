// Named time ranges, as NVTX ranges for Nsight Systems and as a built-in timer that prints the table of
// `nsys stats --report nvtx_sum` (for machines without nsys).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace flashlm {

struct RangeStats {
  std::string name;
  int64_t instances = 0;
  double total_ns = 0, avg_ns = 0, med_ns = 0, min_ns = 0, max_ns = 0, stddev_ns = 0;
};

// Process-wide recorder. Disabled by default: a disabled range costs one branch (plus the NVTX push/pop,
// which is a no-op unless a tool is attached). Ranges nest; each is timed from push to pop on the host
// clock — on the CPU that is the work itself; GPU work must be synchronised by the code being timed.
class RangeProfiler {
 public:
  static RangeProfiler& instance();
  void enable(bool on);
  bool enabled() const { return enabled_; }
  void reset();
  void push(std::string_view name);
  void pop();
  std::vector<RangeStats> summary() const;  // sorted by total time, largest first
  // The table `nsys stats --report nvtx_sum` prints: Time (%), Total Time (ns), Instances, Avg (ns),
  // Med (ns), Min (ns), Max (ns), StdDev (ns), Style, Range. Time (%) is relative to the sum over ranges.
  std::string nvtx_sum_table() const;

 private:
  struct Open {
    std::string name;
    int64_t start_ns;
  };
  bool enabled_ = false;
  std::vector<Open> open_;
  std::vector<std::pair<std::string, std::vector<double>>> samples_;  // per range name, in first-seen order
};

// RAII range: `ScopedRange r("forward");`
class ScopedRange {
 public:
  explicit ScopedRange(std::string_view name);
  ~ScopedRange();
  ScopedRange(const ScopedRange&) = delete;
  ScopedRange& operator=(const ScopedRange&) = delete;
};

}  // namespace flashlm
