// AdamW on CUDA (optim/optimizer.h): the header's operations in its order, each rounded once (no fused
// multiply-adds, hence the __f*_rn intrinsics). fp32 masters: one element per thread, or four with 16-byte
// accesses where every array is aligned; pure bf16 and bf16 moments: a pack of eight per thread (16-byte
// accesses of each array) where every array is aligned, else one by one.
#include "core/cuda/kernels.cuh"
#include "core/cuda_check.h"
#include "optim/optimizer.h"

namespace flashlm::gpu {

namespace {

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
                 int64_t first, int64_t n, AdamWScalars fixed, const AdamWScalars* __restrict__ live,
                 D* __restrict__ copy) {
  const AdamWScalars a = live ? *live : fixed;
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

// Elements [4q, 4q + 4) of the low-precision copy, as one 8-byte store (16 bytes for fp32): four 2-byte
// stores per thread would leave every warp's store instruction writing partial 32-byte sectors. The host
// checks that `copy` is aligned to four elements before it picks adamw_kernel_x4.
template <class D>
__device__ __forceinline__ void store_four(D* __restrict__ copy, int64_t q, float4 wq) {
  if constexpr (std::is_same_v<D, float>) {
    reinterpret_cast<float4*>(copy)[q] = wq;
  } else {
    const D four[4] = {from_f32<D>(wq.x), from_f32<D>(wq.y), from_f32<D>(wq.z), from_f32<D>(wq.w)};
    uint2 bits;
    memcpy(&bits, four, sizeof bits);
    reinterpret_cast<uint2*>(copy)[q] = bits;
  }
}

// Elements [0, 4·n4), four per thread with 16-byte loads and stores (the step is memory bound: 30 bytes
// per parameter with a low-precision copy). Same arithmetic per element as adamw_kernel.
template <class D>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel_x4(float4* __restrict__ w, const float4* __restrict__ grad, float4* __restrict__ m,
                    float4* __restrict__ v, int64_t n4, AdamWScalars fixed, const AdamWScalars* __restrict__ live,
                    D* __restrict__ copy) {
  const AdamWScalars a = live ? *live : fixed;
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
    if (copy) store_four(copy, q, wq);
  }
}

// Pure bf16: every value widened to fp32, stepped by adamw_element, rounded back to bf16 (nearest even).
__global__ void __launch_bounds__(kThreads)
    adamw_bf16_kernel(__nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ grad,
                      __nv_bfloat16* __restrict__ m, __nv_bfloat16* __restrict__ v, int64_t n, int64_t packs,
                      AdamWScalars fixed, const AdamWScalars* __restrict__ live) {
  const AdamWScalars a = live ? *live : fixed;
  for_each_pack(n, packs, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    Vec<__nv_bfloat16, W> wv = load<W>(w + i), mv = load<W>(m + i), vv = load<W>(v + i);
    const Vec<__nv_bfloat16, W> gv = load<W>(grad + i);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      float wk = f32(wv[k]), mk = f32(mv[k]), vk = f32(vv[k]);
      adamw_element(wk, f32(gv[k]), mk, vk, a);
      wv[k] = from_f32<__nv_bfloat16>(wk);
      mv[k] = from_f32<__nv_bfloat16>(mk);
      vv[k] = from_f32<__nv_bfloat16>(vk);
    }
    store(w + i, wv);
    store(m + i, mv);
    store(v + i, vv);
  });
}

// bf16 moments with fp32 masters: m and v widened, stepped by adamw_element with the fp32 w and g, rounded
// back to nearest even, or (Stochastic) by bf16_bits_stochastic with the 16-bit halves of
// counter_draw(rounding_key, first_index + i) — the CPU's draw, so the same bits.
template <class D, bool Stochastic>
__global__ void __launch_bounds__(kThreads)
    adamw_bf16_moments_kernel(float* __restrict__ w, const float* __restrict__ grad, __nv_bfloat16* __restrict__ m,
                              __nv_bfloat16* __restrict__ v, int64_t n, int64_t packs, int64_t first_index,
                              AdamWScalars fixed, const AdamWScalars* __restrict__ live, D* __restrict__ copy) {
  const AdamWScalars a = live ? *live : fixed;
  for_each_pack(n, packs, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    Vec<float, W> wv = load<W>(w + i);
    const Vec<float, W> gv = load<W>(grad + i);
    Vec<__nv_bfloat16, W> mv = load<W>(m + i), vv = load<W>(v + i);
    Vec<D, W> cv;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      float mk = f32(mv[k]), vk = f32(vv[k]);
      adamw_element(wv[k], gv[k], mk, vk, a);
      if constexpr (Stochastic) {
        const uint64_t r = counter_draw(a.rounding_key, uint64_t(first_index + i + k));
        mv[k] = __ushort_as_bfloat16(bf16_bits_stochastic(__float_as_uint(mk), uint32_t(r)));
        vv[k] = __ushort_as_bfloat16(bf16_bits_stochastic(__float_as_uint(vk), uint32_t(r >> 16)));
      } else {
        mv[k] = from_f32<__nv_bfloat16>(mk);
        vv[k] = from_f32<__nv_bfloat16>(vk);
      }
      cv[k] = from_f32<D>(wv[k]);
    }
    store(w + i, wv);
    store(m + i, mv);
    store(v + i, vv);
    if (copy) store(copy + i, cv);
  });
}

template <class T>
void launch_adamw_bf16_moments(float* param, const float* grad, bf16_t* m, bf16_t* v, int64_t n,
                               const AdamWScalars& fixed, const AdamWScalars* live, bool stochastic,
                               int64_t first_index, T* param_copy, cudaStream_t s) {
  FLASHLM_CHECK(param && grad && m && v, "adamw_step_bf16_moments: param, grad, m and v must not be null");
  FLASHLM_CHECK(first_index >= 0, "adamw_step_bf16_moments: first_index = {}, expected >= 0", first_index);
  const int64_t packs = pack_count(n, param, grad, m, v, param_copy);
  using D = std::remove_pointer_t<decltype(dev(param_copy))>;
  const auto kernel = stochastic ? adamw_bf16_moments_kernel<D, true> : adamw_bf16_moments_kernel<D, false>;
  kernel<<<packed_blocks(n, packs), kThreads, 0, s>>>(param, grad, dev(m), dev(v), n, packs, first_index, fixed, live,
                                                     dev(param_copy));
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_bf16_moments_kernel");
}

// The launches of adamw_step and adamw_step_live: the scalars `fixed`, or those at `live` (device memory,
// read when the kernel runs) when it is not null.
template <class T>
void launch_adamw(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWScalars& fixed,
                  const AdamWScalars* live, T* param_copy, cudaStream_t s) {
  const bool copy_aligned = reinterpret_cast<uintptr_t>(param_copy) % (4 * sizeof(T)) == 0;  // four elements
  const bool vector = aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v) && copy_aligned;
  const int64_t n4 = vector ? n / 4 : 0;
  if (n4 > 0) {
    adamw_kernel_x4<<<elementwise_blocks(n4), kThreads, 0, s>>>(
        reinterpret_cast<float4*>(param), reinterpret_cast<const float4*>(grad), reinterpret_cast<float4*>(m),
        reinterpret_cast<float4*>(v), n4, fixed, live, dev(param_copy));
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_kernel_x4");
  }
  if (4 * n4 < n) {
    adamw_kernel<<<elementwise_blocks(n - 4 * n4), kThreads, 0, s>>>(param, grad, m, v, 4 * n4, n, fixed, live,
                                                                     dev(param_copy));
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_kernel");
  }
}

void launch_adamw_bf16(bf16_t* param, const bf16_t* grad, bf16_t* m, bf16_t* v, int64_t n, const AdamWScalars& fixed,
                       const AdamWScalars* live, cudaStream_t s) {
  FLASHLM_CHECK(param && grad && m && v, "adamw_step_bf16: param, grad, m and v must not be null");
  const int64_t packs = pack_count(n, param, grad, m, v);
  adamw_bf16_kernel<<<packed_blocks(n, packs), kThreads, 0, s>>>(dev(param), dev(grad), dev(m), dev(v), n, packs, fixed,
                                                                 live);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_bf16_kernel");
}

}  // namespace

template <class T>
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, T* param_copy, void* stream, float grad_scale) {
  check_count("adamw_step", "n", n);
  FLASHLM_CHECK(step >= 1, "adamw_step: step = {}, expected >= 1 (1-based)", step);
  if (n == 0) return;
  const AdamWScalars a = adamw_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  launch_adamw(param, grad, m, v, n, a, nullptr, param_copy, as_stream(stream));
}

template <class T>
void adamw_step_live(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWScalars* scalars,
                     T* param_copy, void* stream) {
  check_count("adamw_step_live", "n", n);
  FLASHLM_CHECK(scalars != nullptr, "adamw_step_live: scalars is null");
  if (n == 0) return;
  launch_adamw(param, grad, m, v, n, AdamWScalars{}, scalars, param_copy, as_stream(stream));
}

void adamw_step_bf16(bf16_t* param, const bf16_t* grad, bf16_t* m, bf16_t* v, int64_t n, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step, void* stream, float grad_scale) {
  check_count("adamw_step_bf16", "n", n);
  FLASHLM_CHECK(step >= 1, "adamw_step_bf16: step = {}, expected >= 1 (1-based)", step);
  if (n == 0) return;
  const AdamWScalars a = adamw_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  launch_adamw_bf16(param, grad, m, v, n, a, nullptr, as_stream(stream));
}

void adamw_step_bf16_live(bf16_t* param, const bf16_t* grad, bf16_t* m, bf16_t* v, int64_t n,
                          const AdamWScalars* scalars, void* stream) {
  check_count("adamw_step_bf16_live", "n", n);
  FLASHLM_CHECK(scalars != nullptr, "adamw_step_bf16_live: scalars is null");
  if (n == 0) return;
  launch_adamw_bf16(param, grad, m, v, n, AdamWScalars{}, scalars, as_stream(stream));
}

template <class T>
void adamw_step_bf16_moments(float* param, const float* grad, bf16_t* m, bf16_t* v, int64_t n, double lr,
                             double beta1, double beta2, double eps, double weight_decay, int64_t step,
                             MomentRounding rounding, int64_t first_index, T* param_copy, void* stream,
                             float grad_scale) {
  check_count("adamw_step_bf16_moments", "n", n);
  FLASHLM_CHECK(step >= 1, "adamw_step_bf16_moments: step = {}, expected >= 1 (1-based)", step);
  if (n == 0) return;
  AdamWScalars a = adamw_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  a.rounding_key = moment_rounding_key(rounding.seed, step);
  launch_adamw_bf16_moments(param, grad, m, v, n, a, nullptr, rounding.stochastic, first_index, param_copy,
                            as_stream(stream));
}

template <class T>
void adamw_step_bf16_moments_live(float* param, const float* grad, bf16_t* m, bf16_t* v, int64_t n,
                                  const AdamWScalars* scalars, bool stochastic, int64_t first_index, T* param_copy,
                                  void* stream) {
  check_count("adamw_step_bf16_moments_live", "n", n);
  FLASHLM_CHECK(scalars != nullptr, "adamw_step_bf16_moments_live: scalars is null");
  if (n == 0) return;
  launch_adamw_bf16_moments(param, grad, m, v, n, AdamWScalars{}, scalars, stochastic, first_index, param_copy,
                            as_stream(stream));
}

#define FLASHLM_ADAMW_INSTANTIATE(T)                                                                             \
  template void adamw_step<T>(float*, const float*, float*, float*, int64_t, double, double, double, double, double, \
                              int64_t, T*, void*, float);                                                           \
  template void adamw_step_live<T>(float*, const float*, float*, float*, int64_t, const AdamWScalars*, T*, void*); \
  template void adamw_step_bf16_moments<T>(float*, const float*, bf16_t*, bf16_t*, int64_t, double, double, double, \
                                           double, double, int64_t, MomentRounding, int64_t, T*, void*, float);     \
  template void adamw_step_bf16_moments_live<T>(float*, const float*, bf16_t*, bf16_t*, int64_t,                   \
                                                const AdamWScalars*, bool, int64_t, T*, void*);

FLASHLM_ADAMW_INSTANTIATE(float)
FLASHLM_ADAMW_INSTANTIATE(bf16_t)
FLASHLM_ADAMW_INSTANTIATE(fp16_t)

#undef FLASHLM_ADAMW_INSTANTIATE

}  // namespace flashlm::gpu
