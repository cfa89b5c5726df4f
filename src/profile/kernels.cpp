// KernelProfiler: per-kernel GPU time from CUPTI's activity API, loaded at run time (see profile.h).
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "core/check.h"
#include "flashlm/profile.h"

#ifdef FLASHLM_WITH_CUDA
#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include "core/cuda_check.h"
#endif

namespace flashlm {

namespace {

std::mutex& samples_mutex() {  // CUPTI delivers buffers on its own thread
  static std::mutex m;
  return m;
}

#ifdef FLASHLM_WITH_CUDA

// The CUPTI entry points we use, resolved from the library opened at run time.
struct Cupti {
  void* handle = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
  decltype(&cuptiActivityGetNumDroppedRecords) dropped_records = nullptr;
  std::string path;
};

template <class F>
F symbol(void* handle, const char* name, const std::string& path) {
  void* f = dlsym(handle, name);
  FLASHLM_CHECK(f != nullptr, "kernel profiler: {} has no symbol {}", path, name);
  return reinterpret_cast<F>(f);
}

Cupti& cupti() {
  static Cupti c = [] {
    Cupti r;
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("FLASHLM_CUPTI_LIBRARY"); env && *env) candidates.emplace_back(env);
    candidates.push_back(fmt::format("libcupti.so.{}", CUDART_VERSION / 1000));
    candidates.emplace_back("libcupti.so");
    std::string tried;
    for (const auto& name : candidates) {
      r.handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (r.handle) {
        r.path = name;
        break;
      }
      tried += fmt::format("\n  {}: {}", name, dlerror());
    }
    FLASHLM_CHECK(r.handle != nullptr,
                  "kernel profiler: CUPTI (libcupti, in the CUDA toolkit) could not be loaded; put its directory on "
                  "LD_LIBRARY_PATH or set FLASHLM_CUPTI_LIBRARY:{}",
                  tried);
    r.enable = symbol<decltype(r.enable)>(r.handle, "cuptiActivityEnable", r.path);
    r.disable = symbol<decltype(r.disable)>(r.handle, "cuptiActivityDisable", r.path);
    r.register_callbacks = symbol<decltype(r.register_callbacks)>(r.handle, "cuptiActivityRegisterCallbacks", r.path);
    r.flush_all = symbol<decltype(r.flush_all)>(r.handle, "cuptiActivityFlushAll", r.path);
    r.next_record = symbol<decltype(r.next_record)>(r.handle, "cuptiActivityGetNextRecord", r.path);
    r.result_string = symbol<decltype(r.result_string)>(r.handle, "cuptiGetResultString", r.path);
    r.dropped_records =
        symbol<decltype(r.dropped_records)>(r.handle, "cuptiActivityGetNumDroppedRecords", r.path);
    return r;
  }();
  return c;
}

void check_cupti(CUptiResult status, const char* call) {
  if (status == CUPTI_SUCCESS) return;
  const char* text = nullptr;
  if (cupti().result_string) cupti().result_string(status, &text);
  fail("kernel profiler: {} failed: {} ({})", call, text ? text : "unknown CUPTI error", int(status));
}

std::string demangle(const char* name) {
  if (name == nullptr) return "<unnamed kernel>";
  int status = 0;
  char* plain = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && plain ? plain : name;
  std::free(plain);
  return out;
}

constexpr size_t kBufferBytes = size_t{8} << 20;
constexpr size_t kRecordAlign = 8;  // CUPTI's activity buffers must be 8-byte aligned

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kRecordAlign, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  // Runs on CUPTI's thread: nothing may throw out of it (an exception would end the process); a failure
  // to record costs the summary a record, which the dropped count below makes visible.
  CUpti_Activity* record = nullptr;
  while (valid > 0 && cupti().next_record(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      try {
        KernelProfiler::instance().add(demangle(k->name), double(k->end - k->start));
      } catch (...) {
        KernelProfiler::instance().count_dropped(1);
      }
    }
  }
  size_t dropped = 0;
  if (cupti().dropped_records && cupti().dropped_records(nullptr, 0, &dropped) == CUPTI_SUCCESS && dropped > 0) {
    KernelProfiler::instance().count_dropped(int64_t(dropped));
  }
  std::free(buffer);
}

#endif  // FLASHLM_WITH_CUDA

}  // namespace

KernelProfiler& KernelProfiler::instance() {
  static KernelProfiler profiler;
  return profiler;
}

void KernelProfiler::start() {
#ifdef FLASHLM_WITH_CUDA
  if (running_) return;
  Cupti& c = cupti();
  static std::once_flag registered;
  std::call_once(registered, [&] { check_cupti(c.register_callbacks(buffer_requested, buffer_completed),
                                               "cuptiActivityRegisterCallbacks"); });
  check_cupti(c.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable(CONCURRENT_KERNEL)");
  running_ = true;
#else
  fail("kernel profiler: flashlm was built without CUDA");
#endif
}

void KernelProfiler::stop() {
#ifdef FLASHLM_WITH_CUDA
  if (!running_) return;
  FLASHLM_CUDA_CHECK(cudaDeviceSynchronize(), "cudaDeviceSynchronize (kernel profiler)");
  Cupti& c = cupti();
  check_cupti(c.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityDisable(CONCURRENT_KERNEL)");
  check_cupti(c.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  running_ = false;
#endif
}

void KernelProfiler::reset() {
  const std::lock_guard lock(samples_mutex());
  samples_.clear();
  dropped_ = 0;
}

void KernelProfiler::count_dropped(int64_t records) {
  const std::lock_guard lock(samples_mutex());
  dropped_ += records;
}

int64_t KernelProfiler::dropped() const {
  const std::lock_guard lock(samples_mutex());
  return dropped_;
}

void KernelProfiler::add(std::string name, double ns) {
  const std::lock_guard lock(samples_mutex());
  auto it = std::find_if(samples_.begin(), samples_.end(), [&](const auto& s) { return s.first == name; });
  if (it == samples_.end()) {
    samples_.emplace_back(std::move(name), std::vector<double>{});
    it = samples_.end() - 1;
  }
  it->second.push_back(ns);
}

std::vector<RangeStats> KernelProfiler::summary() const {
  const std::lock_guard lock(samples_mutex());
  return summarize_samples(samples_);
}

std::string KernelProfiler::kern_sum_table() const {
  std::string table = format_stats_table(summary(), "", "Name");
  if (const int64_t n = dropped(); n > 0) {
    table += fmt::format(" ({} kernel records dropped by CUPTI: the totals above are incomplete)\n", n);
  }
  return table;
}

}  // namespace flashlm
