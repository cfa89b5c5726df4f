// FLASHLM_CUDA_CHECK(call, "what"): turn a failed CUDA runtime call (or a failed kernel launch, with
// cudaGetLastError()) into flashlm::CudaError naming what failed and where. For .cu and .cpp files alike.
#pragma once
#include <cuda_runtime.h>

#include "core/check.h"

namespace flashlm {
// Throws flashlm::CudaError: "<what> failed: <CUDA's message> (<error name>) at <file>:<line>".
[[noreturn]] void throw_cuda_error(cudaError_t err, std::string_view what, const char* file, int line);
}  // namespace flashlm

#define FLASHLM_CUDA_CHECK(call, what)                                                     \
  do {                                                                                    \
    const cudaError_t flashlm_err_ = (call);                                              \
    if (flashlm_err_ != cudaSuccess) ::flashlm::throw_cuda_error(flashlm_err_, (what), __FILE__, __LINE__); \
  } while (0)
