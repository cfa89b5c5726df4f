// The amax of a tensor as its producer writes it (FP8 training's current scaling, model/fp8.h): each thread
// keeps the largest |value| it stored, as the bits of a non-negative float (ordered as the magnitudes, NaN
// above infinity), and the block adds it to the tensor's amax with one atomicMax. The float at the pointer
// must be zero before the producer runs (the host wrappers clear it); afterwards it holds the bits
// fp8_amax would compute over the stored tensor. Device code only.
#pragma once
#include <cstdint>

#include "core/cuda/kernels.cuh"
#include "core/cuda_check.h"

namespace flashlm::gpu {

// |x| as ordered bits.
__device__ __forceinline__ uint32_t magnitude_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

__device__ __forceinline__ uint32_t warp_max_bits(uint32_t best) {
  for (int offset = 16; offset > 0; offset /= 2) best = max(best, __shfl_xor_sync(0xffffffffu, best, offset));
  return best;
}

// The block's largest `best` into *amax_bits (one atomic); every thread of the block calls it, once.
template <int THREADS>
__device__ __forceinline__ void block_amax_to(uint32_t* amax_bits, uint32_t best) {
  __shared__ uint32_t warp_best[THREADS / 32];
  best = warp_max_bits(best);
  if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < THREADS / 32; ++w) best = max(best, warp_best[w]);
    atomicMax(amax_bits, best);
  }
}

// Host: zero an amax output before its producer's kernel (queued on the producer's stream).
inline void clear_amax(float* amax, cudaStream_t stream) {
  FLASHLM_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream), "cudaMemsetAsync (an amax output)");
}

}  // namespace flashlm::gpu
