// Named time ranges, as NVTX ranges for Nsight Systems and as a built-in timer that prints the table of
// `nsys stats --report nvtx_sum` (for machines without nsys).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "flashlm/memory.h"

namespace flashlm {

struct RangeStats {
  std::string name;
  int64_t instances = 0;
  double total_ns = 0, avg_ns = 0, med_ns = 0, min_ns = 0, max_ns = 0, stddev_ns = 0;
};

// Process-wide recorder. Disabled by default: a disabled range costs one branch (plus the NVTX push/pop,
// which is a no-op unless a tool is attached). Ranges nest. Timing:
//   - enable(true): each range is timed from push to pop on the host clock (the CPU's work itself);
//   - enable(true, cuda_stream) (CUDA builds): each range is timed by two CUDA events recorded on that
//     stream at push and pop, i.e. the GPU time of the work queued inside the range, without synchronising
//     anything while the ranges run; the events are read when the profiler is disabled or summarised.
//     Pass the stream the timed work runs on (a model's stream); nullptr is the legacy default stream.
// One timed instance of a range on the host's steady clock (ns since its epoch, as
// std::chrono::steady_clock counts). A GPU range is placed on that clock through an origin event recorded,
// and waited for, when GPU timing was enabled: its start is the origin's host time plus the GPU time
// between the two events.
struct RangeInstance {
  std::string name;
  int64_t start_ns = 0, duration_ns = 0;
  int depth = 0;  // how many ranges were open around it
  bool on_gpu = false;
};

class RangeProfiler {
 public:
  static constexpr size_t kMaxInstances = size_t{1} << 20;  // kept for instances(); later ones only counted
  static RangeProfiler& instance();
  void enable(bool on);
  void enable(bool on, void* cuda_stream);
  bool enabled() const { return enabled_; }
  void reset();
  void push(std::string_view name);
  void pop();
  std::vector<RangeStats> summary();  // sorted by total time, largest first
  // The table `nsys stats --report nvtx_sum` prints: Time (%), Total Time (ns), Instances, Avg (ns),
  // Med (ns), Min (ns), Max (ns), StdDev (ns), Style, Range. Time (%) is relative to the sum over ranges.
  std::string nvtx_sum_table();
  // Every instance since reset(), in the order they closed (the first kMaxInstances; dropped_instances()
  // counts the others): what write_chrome_trace draws.
  const std::vector<RangeInstance>& instances();
  int64_t dropped_instances() const { return dropped_instances_; }

 private:
  struct Open {
    std::string name;
    int64_t start_ns;
    void* start_event;  // cudaEvent_t when timing on the GPU
  };
  struct Pending {  // a GPU range whose events have not been read yet
    std::string name;
    void *start_event, *end_event;
    int depth;
  };
  void add_sample(const std::string& name, double ns);
  void add_instance(RangeInstance instance);
  void read_pending();  // waits for the recorded events and turns them into samples
  void* take_event();
  bool enabled_ = false;
  bool on_gpu_ = false;
  void* stream_ = nullptr;
  std::vector<Open> open_;
  std::vector<Pending> pending_;
  std::vector<void*> free_events_;
  std::vector<std::pair<std::string, std::vector<double>>> samples_;  // per range name, in first-seen order
  std::vector<RangeInstance> instances_;
  int64_t dropped_instances_ = 0;
  void* origin_event_ = nullptr;  // GPU timing: recorded at enable, at host time origin_ns_
  int64_t origin_ns_ = 0;
};

// Chrome's trace-event JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing open: each range a
// complete event (ph "X", microseconds) on a "host" or "GPU stream" track, nested by time, and each device's
// tracked memory a counter track (ph "C", bytes in use after each allocation or release).
// memory_origin_ns: the steady-clock time at which memory_timeline_start() was called, to put both on one
// clock. Times are shifted so that the earliest event is at 0.
std::string chrome_trace_json(const std::vector<RangeInstance>& ranges, const std::vector<MemoryEvent>& memory,
                              int64_t memory_origin_ns);

// The statistics of named samples (ns) and the table nsys's stats reports print for them, sorted by total
// time: "Time (%)  Total Time (ns)  Instances  Avg (ns)  Med (ns)  Min (ns)  Max (ns)  StdDev (ns)", then
// `style` (when not empty: nvtx_sum's Style column) and the name under `name_header`.
std::vector<RangeStats> summarize_samples(const std::vector<std::pair<std::string, std::vector<double>>>& samples);
std::string format_stats_table(const std::vector<RangeStats>& stats, std::string_view style,
                               std::string_view name_header);

// Per-kernel GPU time from CUPTI's activity records (concurrent-kernel kind), as `nsys stats --report
// cuda_gpu_kern_sum` prints it — for machines without nsys. libcupti (in the CUDA toolkit) is loaded with
// dlopen when start() is first called ($FLASHLM_CUPTI_LIBRARY, else libcupti.so.<CUDA major>, else
// libcupti.so), so libflashlm does not depend on it. Kernels are named as demangled by the C++ runtime.
class KernelProfiler {
 public:
  static KernelProfiler& instance();
  // Starts recording kernel activity in this process; a flashlm::Error says why when CUPTI cannot be used
  // (not a CUDA build, library not found, CUPTI error).
  void start();
  // Stops recording; waits for every record of the kernels launched so far (synchronises the device).
  void stop();
  void reset();
  std::vector<RangeStats> summary() const;  // per kernel name, sorted by total time
  std::string kern_sum_table() const;        // the cuda_gpu_kern_sum layout
  // Called from CUPTI's buffer callback.
  void add(std::string name, double ns);
  void count_dropped(int64_t records);
  int64_t dropped() const;  // records CUPTI could not deliver since reset()

 private:
  std::vector<std::pair<std::string, std::vector<double>>> samples_;
  int64_t dropped_ = 0;
  bool running_ = false;
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
