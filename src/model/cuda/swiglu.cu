// SwiGLU on CUDA (model/cuda/ops.h), forward and backward: elementwise, grid-stride loops over the whole
// packs, then over the elements past them. AMAX: also the outputs' amax for FP8 training (model/cuda/amax.cuh).
#include "core/cuda/kernels.cuh"
#include "core/cuda/programmatic_launch.cuh"
#include "core/cuda_check.h"
#include "model/cuda/amax.cuh"
#include "model/cuda/ops.h"

namespace flashlm::gpu {

namespace {

__device__ __forceinline__ float sigmoid(float u) { return 1.0f / (1.0f + expf(-u)); }

template <bool AMAX, class D>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(const D* __restrict__ u, const D* __restrict__ g, D* __restrict__ s, int64_t n,
                          int64_t packs, uint32_t* __restrict__ s_amax) {
  allow_dependent_launch();  // FP8 training casts the result next (programmatically)
  uint32_t best = 0;
  for_each_pack(n, packs, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    const Vec<D, W> uv = load<W>(u + i), gv = load<W>(g + i);
    Vec<D, W> sv;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float ui = f32(uv[k]);
      sv[k] = from_f32<D>(ui * sigmoid(ui) * f32(gv[k]));
      if constexpr (AMAX) best = max(best, magnitude_bits(f32(sv[k])));
    }
    store(s + i, sv);
  });
  if constexpr (AMAX) block_amax_to<kThreads>(s_amax, best);
}

template <bool AMAX, class D>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const D* __restrict__ ds, const D* __restrict__ u, const D* __restrict__ g,
                           D* __restrict__ du, D* __restrict__ dg, int64_t n, int64_t packs,
                           uint32_t* __restrict__ du_amax, uint32_t* __restrict__ dg_amax) {
  allow_dependent_launch();  // FP8 training casts the result next (programmatically)
  uint32_t best_du = 0, best_dg = 0;
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
      if constexpr (AMAX) {
        best_du = max(best_du, magnitude_bits(f32(duv[k])));
        best_dg = max(best_dg, magnitude_bits(f32(dgv[k])));
      }
    }
    store(du + i, duv);
    store(dg + i, dgv);
  });
  if constexpr (AMAX) {
    block_amax_to<kThreads>(du_amax, best_du);
    __syncthreads();  // block_amax_to's shared array is reused
    block_amax_to<kThreads>(dg_amax, best_dg);
  }
}

}  // namespace

template <class T>
void swiglu_forward(const T* u, const T* g, T* s, int64_t n, void* stream, float* s_amax) {
  check_count("swiglu_forward", "n", n);
  const cudaStream_t st = as_stream(stream);
  if (s_amax) clear_amax(s_amax, st);
  if (n == 0) return;
  const int64_t packs = pack_count(n, u, g, s);
  const unsigned blocks = packed_blocks(n, packs);
  if (s_amax) {
    swiglu_forward_kernel<true><<<blocks, kThreads, 0, st>>>(dev(u), dev(g), dev(s), n, packs,
                                                             reinterpret_cast<uint32_t*>(s_amax));
  } else {
    swiglu_forward_kernel<false><<<blocks, kThreads, 0, st>>>(dev(u), dev(g), dev(s), n, packs, nullptr);
  }
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "swiglu_forward_kernel");
}

template <class T>
void swiglu_backward(const T* ds, const T* u, const T* g, T* du, T* dg, int64_t n, void* stream, float* du_amax,
                     float* dg_amax) {
  check_count("swiglu_backward", "n", n);
  FLASHLM_CHECK(!du_amax == !dg_amax, "swiglu_backward: du_amax and dg_amax must both be given or both null");
  const cudaStream_t st = as_stream(stream);
  if (du_amax) clear_amax(du_amax, st), clear_amax(dg_amax, st);
  if (n == 0) return;
  const int64_t packs = pack_count(n, ds, u, g, du, dg);
  const unsigned blocks = packed_blocks(n, packs);
  if (du_amax) {
    swiglu_backward_kernel<true><<<blocks, kThreads, 0, st>>>(dev(ds), dev(u), dev(g), dev(du), dev(dg), n, packs,
                                                              reinterpret_cast<uint32_t*>(du_amax),
                                                              reinterpret_cast<uint32_t*>(dg_amax));
  } else {
    swiglu_backward_kernel<false><<<blocks, kThreads, 0, st>>>(dev(ds), dev(u), dev(g), dev(du), dev(dg), n, packs,
                                                               nullptr, nullptr);
  }
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "swiglu_backward_kernel");
}

#define FLASHLM_SWIGLU_INSTANTIATE(T) \
  template void swiglu_forward<T>(const T*, const T*, T*, int64_t, void*, float*); \
  template void swiglu_backward<T>(const T*, const T*, const T*, T*, T*, int64_t, void*, float*, float*);

FLASHLM_SWIGLU_INSTANTIATE(float)
FLASHLM_SWIGLU_INSTANTIATE(bf16_t)
FLASHLM_SWIGLU_INSTANTIATE(fp16_t)

#undef FLASHLM_SWIGLU_INSTANTIATE

}  // namespace flashlm::gpu
