// The residual stream's addition on CUDA (model/cuda/ops.h): elementwise, in fp32, rounded to T.
#include "core/cuda/kernels.cuh"
#include "core/cuda_check.h"
#include "model/cuda/ops.h"

namespace flashlm::gpu {

namespace {

template <class D>
__global__ void __launch_bounds__(kThreads)
    add_kernel(D* __restrict__ y, const D* __restrict__ x, int64_t n, int64_t packs) {
  for_each_pack(n, packs, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    Vec<D, W> yv = load<W>(y + i);
    const Vec<D, W> xv = load<W>(x + i);
#pragma unroll
    for (int k = 0; k < W; ++k) yv[k] = from_f32<D>(f32(yv[k]) + f32(xv[k]));
    store(y + i, yv);
  });
}

}  // namespace

template <class T>
void add_inplace(T* y, const T* x, int64_t n, void* stream) {
  check_count("add_inplace", "n", n);
  if (n == 0) return;
  const int64_t packs = pack_count(n, y, x);
  add_kernel<<<packed_blocks(n, packs), kThreads, 0, as_stream(stream)>>>(dev(y), dev(x), n, packs);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "add_kernel");
}

#define FLASHLM_RESIDUAL_INSTANTIATE(T) \
  template void add_inplace<T>(T*, const T*, int64_t, void*);

FLASHLM_RESIDUAL_INSTANTIATE(float)
FLASHLM_RESIDUAL_INSTANTIATE(bf16_t)
FLASHLM_RESIDUAL_INSTANTIATE(fp16_t)

#undef FLASHLM_RESIDUAL_INSTANTIATE

}  // namespace flashlm::gpu
