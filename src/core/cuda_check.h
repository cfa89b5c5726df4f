// FLASHLM_CUDA_CHECK(call, "what"): turn a failed CUDA runtime call (or a failed kernel launch, with
// cudaGetLastError()) into flashlm::Error naming what failed and where. For .cu and .cpp files alike.
#pragma once
#include <cuda_runtime.h>

#include "core/check.h"

#define FLASHLM_CUDA_CHECK(call, what)                                                                   \
  do {                                                                                                  \
    const cudaError_t flashlm_err_ = (call);                                                            \
    if (flashlm_err_ != cudaSuccess) {                                                                  \
      ::flashlm::fail("{} failed: {} ({}) at {}:{}", (what), cudaGetErrorString(flashlm_err_),          \
                      cudaGetErrorName(flashlm_err_), __FILE__, __LINE__);                              \
    }                                                                                                   \
  } while (0)
