// Programmatic dependent launch (compute capability 9.0 and later). A kernel launched as the programmatic
// dependent of the kernel before it on its stream may be placed on the GPU once every block of that kernel has
// started (or said so with allow_dependent_launch), and it waits for that kernel to finish — its writes
// visible — at wait_for_prerequisite_grids(). So only the dependent's launch and block placement move earlier,
// off the gap between two short kernels; what it reads and writes is ordered as on a plain stream, provided it
// calls wait_for_prerequisite_grids() before its first global access. Stream capture keeps the relation as a
// programmatic edge of the graph. Where the device or FLASHLM_PROGRAMMATIC_LAUNCH=0 rules it out, the launch is
// a plain one and both device calls are no-ops. For .cu files only.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <utility>

#include "core/check.h"
#include "core/cuda_check.h"
#include "core/env.h"

namespace flashlm::gpu {

// Before the first global read or write of a kernel launched with launch_programmatic.
__device__ __forceinline__ void wait_for_prerequisite_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// In a kernel whose successor may be a programmatic dependent: let it be placed now rather than when this grid
// ends. Safe anywhere, since the dependent still waits for this grid to finish before touching memory.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Whether launches on the current device are programmatic: compute capability 9.0 or later, and
// FLASHLM_PROGRAMMATIC_LAUNCH not 0 (read once; for measuring the plain launch beside it). Asked once per device.
inline bool programmatic_launch_enabled() {
  static const bool allowed = env_choice(kProgrammaticLaunch) == "1";
  if (!allowed) return false;
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices] = {};  // 0 unknown, 1 no, 2 yes
  int device = 0;
  FLASHLM_CUDA_CHECK(cudaGetDevice(&device), "programmatic launch: current device");
  if (device >= 0 && device < kCachedDevices) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known > 0) return known == 2;
  }
  int major = 0;
  FLASHLM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                     "programmatic launch: compute capability");
  if (device >= 0 && device < kCachedDevices) cache[device].store(major >= 9 ? 2 : 1, std::memory_order_relaxed);
  return major >= 9;
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...) as the programmatic dependent of the stream's previous
// kernel where programmatic_launch_enabled(). `what` names the launch in the error.
template <class... Params, class... Args>
void launch_programmatic(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                         cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid, config.blockDim = block, config.dynamicSmemBytes = shared_bytes, config.stream = stream;
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  if (programmatic_launch_enabled()) config.attrs = &dependent, config.numAttrs = 1;
  FLASHLM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), what);
}

}  // namespace flashlm::gpu
