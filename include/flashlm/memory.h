// One allocator for every buffer flashlm owns, host or device: it counts current and peak bytes per
// device so that benchmarks can report the extra memory of each pass, and it turns an allocation that
// cannot succeed into flashlm::OutOfMemory instead of a crash.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

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

// Move-only owner of one tracked allocation (64-byte aligned on the host).
class Buffer {
 public:
  Buffer() = default;
  static Buffer allocate(size_t bytes, Device device, std::string_view tag);
  // Stream-ordered CUDA allocation (cudaMallocAsync): usable by work queued on `stream` and freed on it,
  // without synchronising. For per-call kernel workspaces.
  static Buffer allocate_on_stream(size_t bytes, std::string_view tag, void* stream);
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
};

}  // namespace flashlm
