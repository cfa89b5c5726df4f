// One allocator for every buffer flashlm owns, host or device: it counts current and peak bytes per
// device so that benchmarks can report the extra memory of each pass, and it turns an allocation that
// cannot succeed into flashlm::OutOfMemory instead of a crash.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace flashlm {

enum class Device : uint8_t { cpu, cuda };
std::string_view device_name(Device d);
Device parse_device(std::string_view name);  // "cpu" or "cuda"

struct MemoryStats {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
};
MemoryStats memory_stats(Device d);
void memory_reset_peak(Device d);  // peak := current

// The allocation timeline: while recording, every tracked allocation and release is logged with its time,
// size, tag (which tensor or op) and the current phase (set by the code being profiled).
struct MemoryEvent {
  double time_ms = 0;          // since memory_timeline_start()
  int64_t delta_bytes = 0;     // + allocation, - release
  int64_t current_bytes = 0;   // on that device, after the event
  std::string tag, phase;
  Device device = Device::cpu;
};
void memory_timeline_start();                    // clears the log and starts recording
std::vector<MemoryEvent> memory_timeline_stop();  // stops and returns the log
void memory_set_phase(std::string_view phase);    // e.g. "forward", "backward", "optimizer"

// Move-only owner of one tracked allocation (64-byte aligned on the host).
class Buffer {
 public:
  Buffer() = default;
  static Buffer allocate(size_t bytes, Device device, std::string_view tag);
  // Stream-ordered CUDA allocation (cudaMallocAsync): usable by work queued on `stream` and freed on it,
  // without synchronising. For per-call kernel workspaces.
  static Buffer allocate_on_stream(size_t bytes, std::string_view tag, void* stream);
  // A host workspace of one call (the CPU attention's packed tiles): on release its block goes to a small
  // process-wide cache instead of back to the C library, and the next allocate_reused it fits takes it. glibc
  // returns large freed blocks to the kernel, so a call repeated at the same size faulted its workspace's pages
  // in again every time (thousands of page faults, a visible share of a CPU attention forward; docs/perf.md). Counted
  // like allocate while in use; cached blocks count as free. Contents on return are unspecified, as with malloc.
  static Buffer allocate_reused(size_t bytes, std::string_view tag);
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { release(); }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_ = Device::cpu;
  void* stream_ = nullptr;  // set for stream-ordered allocations
  bool stream_ordered_ = false;
  bool reused_ = false;     // from allocate_reused: released into the host block cache
  size_t capacity_ = 0;     // allocate_reused: the block's size, at least bytes_ (a cached block may be larger)
  std::string tag_;         // for the allocation timeline
};

// Frees the host blocks allocate_reused keeps cached (at most kCachedHostBytes, memory.cpp) between calls.
void release_cached_host_memory();

}  // namespace flashlm
