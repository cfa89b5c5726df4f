// SwiGLU on CUDA (model/cuda/ops.h), forward and backward: elementwise, grid-stride loops over the whole
// packs, then over the elements past them.
#include "core/cuda/kernels.cuh"
#include "core/cuda_check.h"
#include "model/cuda/ops.h"

namespace flashlm::gpu {

namespace {

__device__ __forceinline__ float sigmoid(float u) { return 1.0f / (1.0f + expf(-u)); }

template <class D>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(const D* __restrict__ u, const D* __restrict__ g, D* __restrict__ s, int64_t n,
                          int64_t packs) {
  for_each_pack(n, packs, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    const Vec<D, W> uv = load<W>(u + i), gv = load<W>(g + i);
    Vec<D, W> sv;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float ui = f32(uv[k]);
      sv[k] = from_f32<D>(ui * sigmoid(ui) * f32(gv[k]));
    }
    store(s + i, sv);
  });
}

template <class D>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const D* __restrict__ ds, const D* __restrict__ u, const D* __restrict__ g,
                           D* __restrict__ du, D* __restrict__ dg, int64_t n, int64_t packs) {
  for_each_pack(n, packs, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    const Vec<D, W> dsv = load<W>(ds + i), uv = load<W>(u + i), gv = load<W>(g + i);
    Vec<D, W> duv, dgv;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float ui = f32(uv[k]), gi = f32(gv[k]), dsi = f32(dsv[k]);
      const float sg = sigmoid(ui);
      const float silu = ui * sg;
      duv[k] = from_f32<D>(dsi * gi * sg * (1.0f + ui * (1.0f - sg)));  // d silu / du = σ(u)(1 + u(1 - σ(u)))
      dgv[k] = from_f32<D>(dsi * silu);
    }
    store(du + i, duv);
    store(dg + i, dgv);
  });
}

}  // namespace

template <class T>
void swiglu_forward(const T* u, const T* g, T* s, int64_t n, void* stream) {
  check_count("swiglu_forward", "n", n);
  if (n == 0) return;
  const int64_t packs = pack_count(n, u, g, s);
  swiglu_forward_kernel<<<packed_blocks(n, packs), kThreads, 0, as_stream(stream)>>>(dev(u), dev(g), dev(s), n,
                                                                                      packs);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "swiglu_forward_kernel");
}

template <class T>
void swiglu_backward(const T* ds, const T* u, const T* g, T* du, T* dg, int64_t n, void* stream) {
  check_count("swiglu_backward", "n", n);
  if (n == 0) return;
  const int64_t packs = pack_count(n, ds, u, g, du, dg);
  swiglu_backward_kernel<<<packed_blocks(n, packs), kThreads, 0, as_stream(stream)>>>(dev(ds), dev(u), dev(g),
                                                                                       dev(du), dev(dg), n, packs);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "swiglu_backward_kernel");
}

#define FLASHLM_SWIGLU_INSTANTIATE(T) \
  template void swiglu_forward<T>(const T*, const T*, T*, int64_t, void*); \
  template void swiglu_backward<T>(const T*, const T*, const T*, T*, T*, int64_t, void*);

FLASHLM_SWIGLU_INSTANTIATE(float)
FLASHLM_SWIGLU_INSTANTIATE(bf16_t)
FLASHLM_SWIGLU_INSTANTIATE(fp16_t)

#undef FLASHLM_SWIGLU_INSTANTIATE

}  // namespace flashlm::gpu
