// AdamW on CUDA (optim/optimizer.h): cpu::adamw_step's operations in its order, each rounded once (no fused
// multiply-adds), one element per thread, or four with 16-byte accesses where every array is aligned.
#include <cmath>

#include "core/cuda/kernels.cuh"
#include "core/cuda_check.h"
#include "optim/optimizer.h"

namespace flashlm::gpu {

namespace {

struct AdamWScalars {
  float alpha, b1, one_minus_b1, b2, one_minus_b2, eps, decay, grad_scale;
};

// One element. grad_scale: the clipping factor, applied here instead of by a pass of its own over the
// gradients (the same single rounding as scale_inplace's g * s).
__device__ __forceinline__ void adamw_element(float& w, float grad, float& m, float& v, const AdamWScalars& a) {
  const float g = a.grad_scale == 1.0f ? grad : __fmul_rn(grad, a.grad_scale);
  const float mi = __fadd_rn(__fmul_rn(a.b1, m), __fmul_rn(a.one_minus_b1, g));
  const float vi = __fadd_rn(__fmul_rn(a.b2, v), __fmul_rn(__fmul_rn(a.one_minus_b2, g), g));
  float wi = __fsub_rn(w, __fdiv_rn(__fmul_rn(a.alpha, mi), __fadd_rn(__fsqrt_rn(vi), a.eps)));
  wi = __fsub_rn(wi, __fmul_rn(a.decay, wi));
  m = mi;
  v = vi;
  w = wi;
}

// Elements [first, n), one per thread.
template <class D>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* __restrict__ w, const float* __restrict__ grad, float* __restrict__ m, float* __restrict__ v,
                 int64_t first, int64_t n, AdamWScalars a, D* __restrict__ copy) {
  FLASHLM_GRID_STRIDE(j, n - first) {
    const int64_t i = first + j;
    float wi = w[i], mi = m[i], vi = v[i];
    adamw_element(wi, grad[i], mi, vi, a);
    m[i] = mi;
    v[i] = vi;
    w[i] = wi;
    if (copy) copy[i] = from_f32<D>(wi);
  }
}

// Elements [0, 4·n4), four per thread with 16-byte loads and stores (the step is memory bound: 30 bytes
// per parameter with a low-precision copy). Same arithmetic per element as adamw_kernel.
template <class D>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel_x4(float4* __restrict__ w, const float4* __restrict__ grad, float4* __restrict__ m,
                    float4* __restrict__ v, int64_t n4, AdamWScalars a, D* __restrict__ copy) {
  FLASHLM_GRID_STRIDE(q, n4) {
    float4 wq = w[q], mq = m[q], vq = v[q];
    const float4 gq = grad[q];
    adamw_element(wq.x, gq.x, mq.x, vq.x, a);
    adamw_element(wq.y, gq.y, mq.y, vq.y, a);
    adamw_element(wq.z, gq.z, mq.z, vq.z, a);
    adamw_element(wq.w, gq.w, mq.w, vq.w, a);
    w[q] = wq;
    m[q] = mq;
    v[q] = vq;
    if (copy) {
      D* c = copy + 4 * q;
      c[0] = from_f32<D>(wq.x);
      c[1] = from_f32<D>(wq.y);
      c[2] = from_f32<D>(wq.z);
      c[3] = from_f32<D>(wq.w);
    }
  }
}

}  // namespace

template <class T>
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, T* param_copy, void* stream, float grad_scale) {
  check_count("adamw_step", "n", n);
  FLASHLM_CHECK(step >= 1, "adamw_step: step = {}, expected >= 1 (1-based)", step);
  if (n == 0) return;
  // cpu::adamw_step's scalars, computed the same way.
  const double t = double(step);
  const float alpha = float(lr * std::sqrt(1.0 - std::pow(beta2, t)) / (1.0 - std::pow(beta1, t)));
  const float b1 = float(beta1), b2 = float(beta2), e = float(eps), decay = float(lr * weight_decay);
  const AdamWScalars a{alpha, b1, 1 - b1, b2, 1 - b2, e, decay, grad_scale};
  const cudaStream_t s = as_stream(stream);
  const bool vector = aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v);
  const int64_t n4 = vector ? n / 4 : 0;
  if (n4 > 0) {
    adamw_kernel_x4<<<elementwise_blocks(n4), kThreads, 0, s>>>(
        reinterpret_cast<float4*>(param), reinterpret_cast<const float4*>(grad), reinterpret_cast<float4*>(m),
        reinterpret_cast<float4*>(v), n4, a, dev(param_copy));
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_kernel_x4");
  }
  if (4 * n4 < n) {
    adamw_kernel<<<elementwise_blocks(n - 4 * n4), kThreads, 0, s>>>(param, grad, m, v, 4 * n4, n, a, dev(param_copy));
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_kernel");
  }
}

#define FLASHLM_ADAMW_INSTANTIATE(T)                                                                             \
  template void adamw_step<T>(float*, const float*, float*, float*, int64_t, double, double, double, double, double, \
                              int64_t, T*, void*, float);

FLASHLM_ADAMW_INSTANTIATE(float)
FLASHLM_ADAMW_INSTANTIATE(bf16_t)
FLASHLM_ADAMW_INSTANTIATE(fp16_t)

#undef FLASHLM_ADAMW_INSTANTIATE

}  // namespace flashlm::gpu
