#include <cuda_runtime.h>
#include <fmt/format.h>

#include "core/check.h"
#include "core/cuda_runtime.h"

namespace flashlm {

void* cuda_malloc_or_throw(size_t bytes, std::string_view tag) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear the sticky-free error so later calls are not blamed for it
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    throw OutOfMemory(fmt::format("out of GPU memory: {:.1f} MiB for '{}' with {:.1f} MiB free", bytes / 1048576.0,
                                  tag, free_bytes / 1048576.0));
  }
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

}  // namespace flashlm
