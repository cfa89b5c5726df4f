#include "flashlm/device.h"

#include <omp.h>

#include "core/check.h"
#include "core/cuda_runtime.h"

namespace flashlm {

bool cuda_built() {
#ifdef FLASHLM_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() { return cuda_device_count_or_zero(); }

int cpu_threads() { return omp_get_max_threads(); }

void set_cpu_threads(int n) {
  FLASHLM_CHECK(n >= 1 && n <= kMaxCpuThreads, "set_cpu_threads: n = {}, expected 1..{}", n, kMaxCpuThreads);
  omp_set_num_threads(n);
}

#ifndef FLASHLM_WITH_CUDA
void* cuda_malloc_or_throw(size_t, std::string_view tag) {
  fail("cannot allocate '{}' on cuda: flashlm was built without CUDA", tag);
}
void cuda_free_noexcept(void*) {}
void* cuda_malloc_async_or_throw(size_t, std::string_view tag, void*) {
  fail("cannot allocate '{}' on cuda: flashlm was built without CUDA", tag);
}
void cuda_free_async_noexcept(void*, void*) {}
int cuda_device_count_or_zero() { return 0; }
int cuda_current_device() { return -1; }
int cuda_pointer_device(const void*) { return -1; }
int64_t cuda_free_memory_bytes() { return -1; }
int64_t cuda_shared_memory_per_block_optin() { return -1; }
void cuda_release_pooled_memory() {}
std::string cuda_device_description() { return "no CUDA (built without it)"; }
void cuda_copy(void*, const void*, size_t) { fail("cuda_copy: flashlm was built without CUDA"); }
void cuda_copy_async(void*, const void*, size_t, void*) { fail("cuda_copy_async: flashlm was built without CUDA"); }
void cuda_memset_async(void*, int, size_t, void*) { fail("cuda_memset_async: flashlm was built without CUDA"); }
void cuda_synchronize() {}
void cuda_stream_synchronize(void*) {}
std::vector<double> cuda_time_each_ms(const std::function<void()>&, int, const std::function<void()>&) {
  fail("cuda_time_each_ms: flashlm was built without CUDA");
}
#endif

}  // namespace flashlm
