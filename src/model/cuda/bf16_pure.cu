// Pure-bf16 kernels: see bf16_pure.h.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/cuda_check.h"
#include "model/cuda/bf16_pure.h"

namespace flashlm::gpu {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

unsigned blocks_for(int64_t n) { return unsigned(std::min((n + kThreads - 1) / kThreads, kMaxBlocks)); }

struct Scalars {
  float alpha, b1, one_minus_b1, b2, one_minus_b2, eps, decay, grad_scale;
};

__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ __nv_bfloat16 narrow(float x) { return __float2bfloat16_rn(x); }

// One element: gpu::adamw_step's arithmetic on the widened values, each operation rounded once (no fused
// multiply-adds), the results rounded to bf16.
__device__ __forceinline__ void adamw_element(__nv_bfloat16& w, __nv_bfloat16 grad, __nv_bfloat16& m,
                                              __nv_bfloat16& v, const Scalars& a) {
  float g = widen(grad);
  if (a.grad_scale != 1.0f) g = __fmul_rn(g, a.grad_scale);
  const float mn = __fadd_rn(__fmul_rn(a.b1, widen(m)), __fmul_rn(a.one_minus_b1, g));
  const float vn = __fadd_rn(__fmul_rn(a.b2, widen(v)), __fmul_rn(__fmul_rn(a.one_minus_b2, g), g));
  float wn = __fsub_rn(widen(w), __fdiv_rn(__fmul_rn(a.alpha, mn), __fadd_rn(__fsqrt_rn(vn), a.eps)));
  wn = __fsub_rn(wn, __fmul_rn(a.decay, wn));
  w = narrow(wn);
  m = narrow(mn);
  v = narrow(vn);
}

// Eight values per thread (16-byte loads and stores of each array) when `packed` (every array 16-byte
// aligned), then the rest one by one.
__global__ void __launch_bounds__(kThreads)
    adamw_bf16_kernel(__nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ grad,
                      __nv_bfloat16* __restrict__ m, __nv_bfloat16* __restrict__ v, int64_t n, Scalars a,
                      bool packed) {
  const int64_t packs = packed ? n / 8 : 0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t p = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; p < packs; p += stride) {
    uint4 wq = reinterpret_cast<const uint4*>(w)[p], mq = reinterpret_cast<const uint4*>(m)[p];
    uint4 vq = reinterpret_cast<const uint4*>(v)[p];
    const uint4 gq = reinterpret_cast<const uint4*>(grad)[p];
    auto* wp = reinterpret_cast<__nv_bfloat16*>(&wq);
    auto* mp = reinterpret_cast<__nv_bfloat16*>(&mq);
    auto* vp = reinterpret_cast<__nv_bfloat16*>(&vq);
    const auto* gp = reinterpret_cast<const __nv_bfloat16*>(&gq);
#pragma unroll
    for (int k = 0; k < 8; ++k) adamw_element(wp[k], gp[k], mp[k], vp[k], a);
    reinterpret_cast<uint4*>(w)[p] = wq;
    reinterpret_cast<uint4*>(m)[p] = mq;
    reinterpret_cast<uint4*>(v)[p] = vq;
  }
  for (int64_t i = 8 * packs + int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    adamw_element(w[i], grad[i], m[i], v[i], a);
  }
}

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

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void adamw_step_bf16(bf16_t* param, const bf16_t* grad, bf16_t* m, bf16_t* v, int64_t n, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step, void* stream, float grad_scale) {
  FLASHLM_CHECK(n >= 0, "adamw_step_bf16: n = {}, expected >= 0", n);
  FLASHLM_CHECK(step >= 1, "adamw_step_bf16: step = {}, expected >= 1 (1-based)", step);
  FLASHLM_CHECK(n == 0 || (param && grad && m && v), "adamw_step_bf16: null array");
  if (n == 0) return;
  const double t = double(step);
  const float alpha = float(lr * std::sqrt(1.0 - std::pow(beta2, t)) / (1.0 - std::pow(beta1, t)));
  const float b1 = float(beta1), b2 = float(beta2);
  const Scalars a{alpha, b1, 1 - b1, b2, 1 - b2, float(eps), float(lr * weight_decay), grad_scale};
  auto* w = reinterpret_cast<__nv_bfloat16*>(param);
  auto* g = reinterpret_cast<const __nv_bfloat16*>(grad);
  auto* mm = reinterpret_cast<__nv_bfloat16*>(m);
  auto* vv = reinterpret_cast<__nv_bfloat16*>(v);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool packed = aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v);
  adamw_bf16_kernel<<<blocks_for(packed ? std::max<int64_t>(n / 8, 1) : n), kThreads, 0, s>>>(w, g, mm, vv, n, a,
                                                                                             packed);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_bf16_kernel");
}

void embedding_forward_bf16(const bf16_t* table, const int32_t* tokens, bf16_t* x, int64_t n, int64_t d,
                            int64_t vocab, void* stream) {
  FLASHLM_CHECK(n >= 0 && d >= 1 && vocab >= 1, "embedding_forward_bf16: n = {}, d = {}, vocab = {}", n, d, vocab);
  if (n == 0) return;
  embedding_bf16_kernel<<<blocks_for(n * d), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const __nv_bfloat16*>(table), tokens, reinterpret_cast<__nv_bfloat16*>(x), n, d, vocab);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "embedding_bf16_kernel");
}

}  // namespace flashlm::gpu
