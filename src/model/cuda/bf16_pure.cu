// The bf16 embedding lookup: see bf16_pure.h.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "core/check.h"
#include "core/cuda_check.h"
#include "model/cuda/bf16_pure.h"

namespace flashlm::gpu {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

unsigned blocks_for(int64_t n) { return unsigned(std::min((n + kThreads - 1) / kThreads, kMaxBlocks)); }

__global__ void __launch_bounds__(kThreads)
    embedding_bf16_kernel(const __nv_bfloat16* __restrict__ table, const int32_t* __restrict__ tokens,
                          __nv_bfloat16* __restrict__ x, int64_t n, int64_t d, int64_t vocab) {
  const int64_t total = n * d;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / d, j = i - r * d;
    const int32_t tok = tokens[r];
    x[i] = tok >= 0 && tok < vocab ? table[int64_t{tok} * d + j] : __float2bfloat16_rn(__int_as_float(0x7fc00000));
  }
}

}  // namespace

void embedding_forward_bf16(const bf16_t* table, const int32_t* tokens, bf16_t* x, int64_t n, int64_t d,
                            int64_t vocab, void* stream) {
  FLASHLM_CHECK(n >= 0 && d >= 1 && vocab >= 1, "embedding_forward_bf16: n = {}, d = {}, vocab = {}", n, d, vocab);
  if (n == 0) return;
  embedding_bf16_kernel<<<blocks_for(n * d), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const __nv_bfloat16*>(table), tokens, reinterpret_cast<__nv_bfloat16*>(x), n, d, vocab);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "embedding_bf16_kernel");
}

}  // namespace flashlm::gpu
