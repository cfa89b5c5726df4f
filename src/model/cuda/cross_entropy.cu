// Cross-entropy on CUDA (model/cuda/ops.h), forward and backward: one 256-thread block per row, online
// (max, sum of exp) per thread, merged by warp shuffles and then across warps in a fixed order.
#include "core/cuda/kernels.cuh"
#include "core/cuda_check.h"
#include "core/softmax_stats.cuh"
#include "model/cuda/ops.h"

namespace flashlm::gpu {

namespace {

constexpr int kCeThreads = 256;  // threads per row

// Max and sum of exp(z - max) over one row of `vocab` logits; every thread of the block gets the same
// values. NaN logits make the sum NaN.
template <class D>
__device__ __forceinline__ void row_stats(const D* __restrict__ z, int64_t vocab, float& m_out, float& l_out) {
  float m = -INFINITY, l = 0.f;
  for (int64_t j = threadIdx.x; j < vocab; j += kCeThreads) {
    const float v = f32(z[j]);
    if (v > m) {
      l = l * expf(m - v) + 1.f;
      m = v;
    } else if (v != -INFINITY) {  // a NaN lands here and poisons l
      l += expf(v - m);
    }
  }
  block_merge_stats<kCeThreads>(m, l);
  m_out = m;
  l_out = l;
}

template <class D>
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_forward_kernel(const D* __restrict__ logits, const int32_t* __restrict__ targets,
                                 float* __restrict__ row_loss, int64_t vocab) {
  const int64_t row = blockIdx.x;
  const D* z = logits + row * vocab;
  float m, l;
  row_stats(z, vocab, m, l);
  if (threadIdx.x == 0) {
    const int32_t t = targets[row];
    row_loss[row] = t >= 0 && t < vocab ? (m + logf(l)) - f32(z[t]) : __int_as_float(0x7fc00000);
  }
}

template <class D>
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_backward_kernel(D* __restrict__ logits, const int32_t* __restrict__ targets, int64_t vocab,
                                  float scale, float* __restrict__ row_loss) {
  const int64_t row = blockIdx.x;
  D* z = logits + row * vocab;
  const int32_t t = targets[row];
  const bool valid = t >= 0 && t < vocab;
  // The target's logit for the loss, read before row_stats' __syncthreads (after it the row is overwritten).
  const float target_logit = row_loss && threadIdx.x == 0 && valid ? f32(z[t]) : 0.f;
  float m, l;
  row_stats(z, vocab, m, l);  // ends with a __syncthreads: every read of the row precedes every write
  const float lse = m + logf(l);
  // The forward kernel's loss, bit for bit (the same statistics, the same expression).
  if (row_loss && threadIdx.x == 0) row_loss[row] = valid ? lse - target_logit : __int_as_float(0x7fc00000);
  for (int64_t j = threadIdx.x; j < vocab; j += kCeThreads) {
    float g = expf(f32(z[j]) - lse) * scale;
    if (j == t) g -= scale;
    z[j] = from_f32<D>(valid ? g : __int_as_float(0x7fc00000));
  }
}

}  // namespace

template <class T>
void cross_entropy_forward(const T* logits, const int32_t* targets, float* row_loss, int64_t n, int64_t vocab,
                           void* stream) {
  check_count("cross_entropy_forward", "n", n);
  check_width("cross_entropy_forward", "vocab", vocab);
  FLASHLM_CHECK(n <= INT_MAX, "cross_entropy_forward: n = {} is too large", n);
  if (n == 0) return;
  cross_entropy_forward_kernel<<<unsigned(n), kCeThreads, 0, as_stream(stream)>>>(dev(logits), targets, row_loss,
                                                                                   vocab);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "cross_entropy_forward_kernel");
}

template <class T>
void cross_entropy_backward(T* logits, const int32_t* targets, int64_t n, int64_t vocab, float scale, void* stream,
                            float* row_loss) {
  check_count("cross_entropy_backward", "n", n);
  check_width("cross_entropy_backward", "vocab", vocab);
  FLASHLM_CHECK(n <= INT_MAX, "cross_entropy_backward: n = {} is too large", n);
  if (n == 0) return;
  cross_entropy_backward_kernel<<<unsigned(n), kCeThreads, 0, as_stream(stream)>>>(dev(logits), targets, vocab,
                                                                                    scale, row_loss);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "cross_entropy_backward_kernel");
}

#define FLASHLM_CROSS_ENTROPY_INSTANTIATE(T) \
  template void cross_entropy_forward<T>(const T*, const int32_t*, float*, int64_t, int64_t, void*); \
  template void cross_entropy_backward<T>(T*, const int32_t*, int64_t, int64_t, float, void*, float*);

FLASHLM_CROSS_ENTROPY_INSTANTIATE(float)
FLASHLM_CROSS_ENTROPY_INSTANTIATE(bf16_t)
FLASHLM_CROSS_ENTROPY_INSTANTIATE(fp16_t)

#undef FLASHLM_CROSS_ENTROPY_INSTANTIATE

}  // namespace flashlm::gpu
