#include "flashlm/memory.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <cstdlib>
#include <fstream>
#include <new>
#include <string>

#include "core/check.h"
#include "core/cuda_runtime.h"

namespace flashlm {

namespace {

struct Counters {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
};
Counters g_counters[2];  // indexed by Device

Counters& counters(Device d) { return g_counters[static_cast<int>(d)]; }

struct Timeline {
  std::atomic<bool> recording{false};
  std::mutex mutex;  // allocations also happen inside OpenMP regions
  std::chrono::steady_clock::time_point start;
  std::string phase;
  std::vector<MemoryEvent> events;
};
Timeline g_timeline;

void record(Device d, int64_t delta, int64_t current, const std::string& tag) {
  if (!g_timeline.recording.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_timeline.mutex);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - g_timeline.start).count();
  g_timeline.events.push_back({ms, delta, current, tag, g_timeline.phase, d});
}

void count_alloc(Device d, int64_t bytes, const std::string& tag) {
  Counters& c = counters(d);
  const int64_t now = c.current.fetch_add(bytes) + bytes;
  int64_t peak = c.peak.load();
  while (now > peak && !c.peak.compare_exchange_weak(peak, now)) {
  }
  record(d, bytes, now, tag);
}

// Bytes the kernel says can still be allocated without swapping (MemAvailable). Asking Linux for more
// than this does not fail at malloc time: the process is killed later when the pages are touched.
int64_t host_bytes_available() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return INT64_MAX;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) { b /= 1024; ++u; }
  return fmt::format("{:.1f} {}", b, units[u]);
}

// Host blocks released by allocate_reused Buffers, for the next allocate_reused they fit. Bounded in bytes so
// that a one-off large call does not keep its workspace for the rest of the process: a block that would take
// the cache over the bound is freed at once.
constexpr size_t kCachedHostBytes = size_t{256} << 20;

struct CachedBlock {
  void* data;
  size_t capacity;  // what aligned_alloc was given
};

struct HostBlockCache {
  std::mutex mutex;  // workspaces are taken and released inside OpenMP regions too
  std::vector<CachedBlock> blocks;
  size_t bytes = 0;
};

// Never destroyed: a Buffer released during static destruction (after a destroyed cache) must still find it.
HostBlockCache& host_block_cache() {
  static auto* cache = new HostBlockCache;
  return *cache;
}

size_t host_capacity(size_t bytes) { return (bytes + 63) / 64 * 64; }

void* host_alloc_or_throw(size_t bytes, std::string_view tag) {
  constexpr size_t kLargeRequest = size_t{256} << 20;
  if (bytes >= kLargeRequest && static_cast<int64_t>(bytes) > host_bytes_available()) {
    throw OutOfMemory(fmt::format("out of host memory: {} for '{}' but {} available", human_bytes(double(bytes)), tag,
                                  human_bytes(double(host_bytes_available()))));
  }
  void* data = std::aligned_alloc(64, host_capacity(bytes));
  if (!data) throw OutOfMemory(fmt::format("out of host memory: {} for '{}'", human_bytes(double(bytes)), tag));
  return data;
}

// The smallest cached block of at least `capacity` bytes, taken out of the cache ({nullptr, 0} if none).
CachedBlock take_cached_block(size_t capacity) {
  HostBlockCache& cache = host_block_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  auto best = cache.blocks.end();
  for (auto it = cache.blocks.begin(); it != cache.blocks.end(); ++it) {
    if (it->capacity >= capacity && (best == cache.blocks.end() || it->capacity < best->capacity)) best = it;
  }
  if (best == cache.blocks.end()) return {nullptr, 0};
  const CachedBlock block = *best;
  cache.bytes -= block.capacity;
  cache.blocks.erase(best);
  return block;
}

void cache_or_free_block(void* data, size_t capacity) {
  HostBlockCache& cache = host_block_cache();
  {
    std::lock_guard<std::mutex> lock(cache.mutex);
    if (cache.bytes + capacity <= kCachedHostBytes) {
      cache.blocks.push_back({data, capacity});
      cache.bytes += capacity;
      return;
    }
  }
  std::free(data);
}

}  // namespace

void release_cached_host_memory() {
  HostBlockCache& cache = host_block_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  for (const CachedBlock& b : cache.blocks) std::free(b.data);
  cache.blocks.clear();
  cache.bytes = 0;
}

std::string_view device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

Device parse_device(std::string_view name) {
  if (name == "cpu") return Device::cpu;
  if (name == "cuda" || name == "gpu") return Device::cuda;
  fail_argument("unknown device '{}': expected cpu or cuda", name);
}

void memory_timeline_start() {
  std::lock_guard<std::mutex> lock(g_timeline.mutex);
  g_timeline.events.clear();
  g_timeline.start = std::chrono::steady_clock::now();
  g_timeline.recording = true;
}

std::vector<MemoryEvent> memory_timeline_stop() {
  std::lock_guard<std::mutex> lock(g_timeline.mutex);
  g_timeline.recording = false;
  return std::move(g_timeline.events);
}

void memory_set_phase(std::string_view phase) {
  {
    std::lock_guard<std::mutex> lock(g_timeline.mutex);
    if (g_timeline.phase == phase) return;
    g_timeline.phase = std::string(phase);
  }
  // A zero-byte event marks where the phase starts, also when the phase allocates nothing.
  for (Device d : {Device::cpu, Device::cuda}) {
    if (memory_stats(d).current_bytes > 0) record(d, 0, memory_stats(d).current_bytes, "phase start");
  }
}

MemoryStats memory_stats(Device d) { return {counters(d).current.load(), counters(d).peak.load()}; }

void memory_reset_peak(Device d) { counters(d).peak.store(counters(d).current.load()); }

Buffer Buffer::allocate(size_t bytes, Device device, std::string_view tag) {
  Buffer b;
  b.device_ = device;
  b.bytes_ = bytes;
  b.tag_ = std::string(tag);
  if (bytes == 0) return b;
  if (device == Device::cpu) {
    b.data_ = host_alloc_or_throw(bytes, tag);
  } else {
    b.data_ = cuda_malloc_or_throw(bytes, tag);
  }
  count_alloc(device, static_cast<int64_t>(bytes), b.tag_);
  return b;
}

Buffer Buffer::allocate_reused(size_t bytes, std::string_view tag) {
  Buffer b;
  b.bytes_ = bytes;
  b.tag_ = std::string(tag);
  b.reused_ = true;
  if (bytes == 0) return b;
  const CachedBlock cached = take_cached_block(host_capacity(bytes));
  b.data_ = cached.data ? cached.data : host_alloc_or_throw(bytes, tag);
  b.capacity_ = cached.data ? cached.capacity : host_capacity(bytes);
  count_alloc(Device::cpu, static_cast<int64_t>(bytes), b.tag_);
  return b;
}

Buffer Buffer::allocate_on_stream(size_t bytes, std::string_view tag, void* stream) {
  Buffer b;
  b.device_ = Device::cuda;
  b.bytes_ = bytes;
  b.stream_ = stream;
  b.stream_ordered_ = true;
  b.tag_ = std::string(tag);
  if (bytes == 0) return b;
  b.data_ = cuda_malloc_async_or_throw(bytes, tag, stream);
  count_alloc(Device::cuda, static_cast<int64_t>(bytes), b.tag_);
  return b;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    bytes_ = o.bytes_;
    device_ = o.device_;
    stream_ = o.stream_;
    stream_ordered_ = o.stream_ordered_;
    reused_ = o.reused_;
    capacity_ = o.capacity_;
    tag_ = std::move(o.tag_);
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void Buffer::release() {
  if (!data_) return;
  if (reused_) {
    cache_or_free_block(data_, capacity_);
  } else if (device_ == Device::cpu) {
    std::free(data_);
  } else if (stream_ordered_) {
    cuda_free_async_noexcept(data_, stream_);
  } else {
    cuda_free_noexcept(data_);
  }
  const int64_t now = counters(device_).current.fetch_sub(static_cast<int64_t>(bytes_)) - static_cast<int64_t>(bytes_);
  record(device_, -static_cast<int64_t>(bytes_), now, tag_);
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace flashlm
