// Online softmax statistics on the GPU: a running max m and sum l of exp(x - m), merged across threads in a
// fixed order. One home for the unfused attention's softmax rows (attention/cuda/naive.cu) and the LM's
// cross-entropy rows (model/cuda/cross_entropy.cu).
#pragma once
#include <cuda_runtime.h>

#include <cmath>

namespace flashlm {

// max(a, b), NaN if either is (fmaxf returns the other argument): a NaN score must make its softmax row
// NaN, as in PyTorch, instead of vanishing from the running max. One instruction on sm_80+.
__device__ __forceinline__ float max_propagating_nan(float a, float b) {
#if __CUDA_ARCH__ >= 800
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
#else
  return (a > b || a != a) ? a : b;
#endif
}

// Merges two (running max m, sum l of exp(x - m)) statistics into (m, l); (-inf, 0) is empty.
__device__ __forceinline__ void merge_stats(float& m, float& l, float m2, float l2) {
  const float mx = max_propagating_nan(m, m2);
  if (mx == -INFINITY) return;  // both empty: exp(-inf - -inf) would be NaN
  l = l * expf(m - mx) + l2 * expf(m2 - mx);
  m = mx;
}

// Every thread of a kThreads-thread block passes its own (m, l) and gets the block's: butterfly within each
// warp, then the warps' results merged in warp order (the same bits on every run).
template <int kThreads>
__device__ __forceinline__ void block_merge_stats(float& m, float& l) {
  constexpr int kWarps = kThreads / 32;
  for (int offset = 16; offset > 0; offset /= 2) {
    merge_stats(m, l, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, l, offset));
  }
  __shared__ float warp_m[kWarps], warp_l[kWarps];
  if (threadIdx.x % 32 == 0) {
    warp_m[threadIdx.x / 32] = m;
    warp_l[threadIdx.x / 32] = l;
  }
  __syncthreads();
  m = -INFINITY;
  l = 0.f;
  for (int w = 0; w < kWarps; ++w) merge_stats(m, l, warp_m[w], warp_l[w]);
}

}  // namespace flashlm
