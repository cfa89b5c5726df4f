#include <cuda_runtime.h>
#include <fmt/format.h>

#include "core/check.h"
#include "core/cuda_check.h"
#include "core/cuda_runtime.h"

namespace flashlm {

namespace {

[[noreturn]] void throw_out_of_memory(size_t bytes, std::string_view tag) {
  cudaGetLastError();  // clear the error so that later calls are not blamed for it
  size_t free_bytes = 0, total = 0;
  cudaMemGetInfo(&free_bytes, &total);
  throw OutOfMemory(fmt::format("out of GPU memory: {:.1f} MiB for '{}' with {:.1f} MiB free", bytes / 1048576.0, tag,
                                free_bytes / 1048576.0));
}

// Keep freed stream-ordered memory in the device's pool instead of returning it to the driver at every
// synchronisation: per-call workspaces then cost no driver round trip.
void keep_pool_memory(int device) {
  static bool done[64] = {};
  if (device < 0 || device >= 64 || done[device]) return;
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
    uint64_t threshold = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
  }
  done[device] = true;
}

}  // namespace

void throw_cuda_error(cudaError_t err, std::string_view what, const char* file, int line) {
  throw CudaError(fmt::format("{} failed: {} ({}) at {}:{}", what, cudaGetErrorString(err), cudaGetErrorName(err), file,
                              line));
}

void* cuda_malloc_async_or_throw(size_t bytes, std::string_view tag, void* stream) {
  keep_pool_memory(cuda_current_device());
  void* p = nullptr;
  const cudaError_t err = cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream));
  if (err == cudaErrorMemoryAllocation) throw_out_of_memory(bytes, tag);
  FLASHLM_CHECK(err == cudaSuccess, "cudaMallocAsync of {} bytes for '{}' failed: {}", bytes, tag,
                cudaGetErrorString(err));
  return p;
}

void cuda_free_async_noexcept(void* p, void* stream) { cudaFreeAsync(p, static_cast<cudaStream_t>(stream)); }

void* cuda_malloc_or_throw(size_t bytes, std::string_view tag) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) throw_out_of_memory(bytes, tag);
  FLASHLM_CHECK(err == cudaSuccess, "cudaMalloc of {} bytes for '{}' failed: {}", bytes, tag, cudaGetErrorString(err));
  return p;
}

void cuda_free_noexcept(void* p) { cudaFree(p); }

int cuda_device_count_or_zero() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

int cuda_current_device() {
  int d = -1;
  return cudaGetDevice(&d) == cudaSuccess ? d : -1;
}

int64_t cuda_free_memory_bytes() {
  size_t free_bytes = 0, total = 0;
  if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return int64_t(free_bytes);
}

int64_t cuda_shared_memory_per_block_optin() {
  const int device = cuda_current_device();
  int bytes = 0;
  if (device < 0 || cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return bytes;
}

void cuda_release_pooled_memory() {
  const int device = cuda_current_device();
  cudaMemPool_t pool;
  if (device < 0 || cudaDeviceSynchronize() != cudaSuccess || cudaDeviceGetDefaultMemPool(&pool, device) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  cudaMemPoolTrimTo(pool, 0);
}

int cuda_pointer_device(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged ? attr.device : -1;
}

std::string cuda_device_description() {
  const int device = cuda_current_device();
  cudaDeviceProp prop{};
  if (device < 0 || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return "no CUDA device";
  }
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  return fmt::format("{} (sm_{}{}, {} SMs, {:.0f} GiB), CUDA runtime {}.{}, driver API {}.{}", prop.name, prop.major,
                     prop.minor, prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0, runtime / 1000,
                     runtime % 1000 / 10, driver / 1000, driver % 1000 / 10);
}

void cuda_memset_async(void* dst, int value, size_t bytes, void* stream) {
  FLASHLM_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(stream)), "cudaMemsetAsync");
}

void cuda_copy_async(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return;
  FLASHLM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)),
                     "cudaMemcpyAsync");
}

void cuda_copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;  // empty tensors may have no allocation
  FLASHLM_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
}

void cuda_synchronize() { FLASHLM_CUDA_CHECK(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

void cuda_stream_synchronize(void* stream) {
  FLASHLM_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

std::vector<double> cuda_time_each_ms(const std::function<void()>& fn, int reps,
                                      const std::function<void()>& before) {
  cudaEvent_t start, stop;
  FLASHLM_CUDA_CHECK(cudaEventCreate(&start), "cudaEventCreate");
  FLASHLM_CUDA_CHECK(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    if (before) before();
    cudaEventRecord(start);
    fn();
    cudaEventRecord(stop);
    FLASHLM_CUDA_CHECK(cudaEventSynchronize(stop), "timed region");
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms;
}

}  // namespace flashlm
