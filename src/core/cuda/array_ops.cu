// Casts, scaling, the non-finite count, memset (core/array_ops.h): grid-stride loops over the whole packs,
// then over the elements past them (core/cuda/kernels.cuh); the count is a two-pass reduction
// (core/cuda/reduce.cuh).
#include "core/array_ops.h"
#include "core/cuda/kernels.cuh"
#include "core/cuda/reduce.cuh"
#include "core/cuda_check.h"

namespace flashlm::gpu {

namespace {

struct NonfiniteOp {
  using Acc = long long;
  template <class D>
  __device__ long long operator()(D x) const {
    return isfinite(f32(x)) ? 0 : 1;
  }
};

__global__ void __launch_bounds__(kThreads) scale_kernel(float* __restrict__ x, int64_t n, int64_t packs, float s) {
  for_each_pack(n, packs, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    Vec<float, W> xv = load<W>(x + i);
#pragma unroll
    for (int k = 0; k < W; ++k) xv[k] *= s;
    store(x + i, xv);
  });
}

// One of S and D is float: rounds fp32 to D (cast_from_f32) or widens S to fp32 (cast_to_f32, exact).
template <class S, class D>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const S* __restrict__ src, D* __restrict__ dst, int64_t n, int64_t packs) {
  for_each_pack(n, packs, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    const Vec<S, W> sv = load<W>(src + i);
    Vec<D, W> dv;
#pragma unroll
    for (int k = 0; k < W; ++k) dv[k] = from_f32<D>(f32(sv[k]));
    store(dst + i, dv);
  });
}

}  // namespace

template <class T>
void count_nonfinite(const T* x, int64_t n, int* out, void* stream) {
  check_count("count_nonfinite", "n", n);
  reduce<NonfiniteOp>(dev(x), n, out, as_stream(stream), "count_nonfinite");
}

void scale_inplace(float* x, int64_t n, float s, void* stream) {
  check_count("scale_inplace", "n", n);
  if (n == 0) return;
  const int64_t packs = pack_count(n, x);
  scale_kernel<<<packed_blocks(n, packs), kThreads, 0, as_stream(stream)>>>(x, n, packs, s);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "scale_kernel");
}

template <class T>
void cast_from_f32(const float* src, T* dst, int64_t n, void* stream) {
  check_count("cast_from_f32", "n", n);
  if (n == 0) return;
  const int64_t packs = pack_count(n, src, dst);
  cast_kernel<<<packed_blocks(n, packs), kThreads, 0, as_stream(stream)>>>(src, dev(dst), n, packs);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "cast_from_f32: cast_kernel");
}

template <class T>
void cast_to_f32(const T* src, float* dst, int64_t n, void* stream) {
  check_count("cast_to_f32", "n", n);
  if (n == 0) return;
  const int64_t packs = pack_count(n, src, dst);
  cast_kernel<<<packed_blocks(n, packs), kThreads, 0, as_stream(stream)>>>(dev(src), dst, n, packs);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "cast_to_f32: cast_kernel");
}

void memset_async(void* dst, int value, size_t bytes, void* stream) {
  if (bytes == 0) return;
  FLASHLM_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, as_stream(stream)), "memset_async: cudaMemsetAsync");
}

void stream_synchronize(void* stream) {
  FLASHLM_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)), "stream_synchronize: cudaStreamSynchronize");
}

#define FLASHLM_ARRAY_OPS_INSTANTIATE(T)                            \
  template void count_nonfinite<T>(const T*, int64_t, int*, void*); \
  template void cast_from_f32<T>(const float*, T*, int64_t, void*); \
  template void cast_to_f32<T>(const T*, float*, int64_t, void*);

FLASHLM_ARRAY_OPS_INSTANTIATE(float)
FLASHLM_ARRAY_OPS_INSTANTIATE(bf16_t)
FLASHLM_ARRAY_OPS_INSTANTIATE(fp16_t)

#undef FLASHLM_ARRAY_OPS_INSTANTIATE

}  // namespace flashlm::gpu
