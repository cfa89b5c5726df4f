// Two-pass reductions over a device array in a fixed order (the same bits on every run and every GPU):
// 8192-element chunks reduced by one block each into partials, then one block over the partials. Op gives
// the accumulator type and the value each element contributes. Used by gpu::squared_norm
// (optim/cuda/grad_norm.cu) and gpu::count_nonfinite (core/cuda/array_ops.cu). For .cu files only.
#pragma once
#include "core/cuda/kernels.cuh"
#include "core/cuda_check.h"
#include "flashlm/memory.h"

namespace flashlm::gpu {

constexpr int kReduceThreads = 256;
constexpr int64_t kReduceChunk = 8192;  // elements per block of a reduction's first pass

// partial[b] = Σ op(x[i]) over chunk b = [b·kReduceChunk, +kReduceChunk).
template <class Op, class D>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_chunks_kernel(const D* __restrict__ x, int64_t n, typename Op::Acc* __restrict__ partial) {
  using Acc = typename Op::Acc;
  const int64_t begin = int64_t{blockIdx.x} * kReduceChunk;
  const int64_t end = min(n, begin + kReduceChunk);
  Acc acc = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kReduceThreads) acc += Op{}(x[i]);
  acc = block_sum<kReduceThreads>(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__device__ __forceinline__ void store_total(double* out, double total) { *out = total; }
__device__ __forceinline__ void store_total(int* out, long long total) {
  *out = total > INT_MAX ? INT_MAX : int(total);
}

// One block: *out = Σ partial[0, count) (thread t sums t, t + 256, ... in order, then the block sum).
template <class Acc, class Out>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_partials_kernel(const Acc* __restrict__ partial, int64_t count, Out* __restrict__ out) {
  Acc acc = 0;
  for (int64_t i = threadIdx.x; i < count; i += kReduceThreads) acc += partial[i];
  acc = block_sum<kReduceThreads>(acc);
  if (threadIdx.x == 0) store_total(out, acc);
}

// *out = Σ Op(x[i]) over [0, n) (0 for n = 0). [scratch: ceil(n / 8192) accumulators]
template <class Op, class D, class Out>
void reduce(const D* x, int64_t n, Out* out, cudaStream_t stream, const char* what) {
  using Acc = typename Op::Acc;
  if (n == 0) {
    FLASHLM_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(Out), stream), what);
    return;
  }
  const int64_t chunks = ceil_div(n, kReduceChunk);
  FLASHLM_CHECK(chunks <= INT_MAX, "{}: n = {} is too large", what, n);
  Buffer scratch = Buffer::allocate_on_stream(size_t(chunks) * sizeof(Acc), what, stream);
  Acc* partial = static_cast<Acc*>(scratch.data());
  reduce_chunks_kernel<Op><<<unsigned(chunks), kReduceThreads, 0, stream>>>(x, n, partial);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), what);
  reduce_partials_kernel<<<1, kReduceThreads, 0, stream>>>(partial, chunks, out);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), what);
}

}  // namespace flashlm::gpu
