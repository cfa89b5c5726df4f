// FLASHLM_HOST_DEVICE: a function that both the host code and the CUDA kernels call, so that the CPU tests check
// the very arithmetic the kernels run (__host__ __device__ under nvcc, nothing for the C++ compiler).
#pragma once

#if defined(__CUDACC__)
#define FLASHLM_HOST_DEVICE __host__ __device__
#else
#define FLASHLM_HOST_DEVICE
#endif
