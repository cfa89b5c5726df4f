// Rotary position embedding on CUDA (model/cuda/ops.h), forward and backward (the inverse rotation): one
// thread per 4 interleaved pairs (one pack) when head_dim % 8 == 0, else per pair.
#include "core/cuda/kernels.cuh"
#include "core/cuda_check.h"
#include "model/cuda/ops.h"

namespace flashlm::gpu {

namespace {

constexpr int kRopePairs = kPack / 2;  // pairs per thread on the packed path

// RoPE: one thread per PAIRS consecutive interleaved pairs of a row (kRopePairs, a pack of x and 16 bytes
// of each table, when half % kRopePairs == 0 and x, cos and sin are 16-byte aligned; else 1); rotation by
// +angle (sign 1) or -angle (sign -1).

template <int PAIRS, class D>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(D* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin, int64_t rows,
                int64_t seq, int64_t heads, int64_t token_stride, int half, float sign) {
  const int groups = half / PAIRS;  // per row
  FLASHLM_GRID_STRIDE(p, rows * groups) {
    const int i = int(p % groups) * PAIRS;
    const int64_t row = p / groups;  // (b, t, h) row of head_dim = 2 half values
    const int64_t token = row / heads;
    const int64_t t = token % seq;
    D* xp = x + token * token_stride + (row % heads) * (2 * int64_t{half}) + 2 * i;
    Vec<D, 2 * PAIRS> xv = load<2 * PAIRS>(xp);
    const Vec<float, PAIRS> cv = load<PAIRS>(cos + t * half + i), sv = load<PAIRS>(sin + t * half + i);
#pragma unroll
    for (int k = 0; k < PAIRS; ++k) {
      const float c = cv[k], s = sign * sv[k];
      const float x0 = f32(xv[2 * k]), x1 = f32(xv[2 * k + 1]);
      xv[2 * k] = from_f32<D>(x0 * c - x1 * s);
      xv[2 * k + 1] = from_f32<D>(x0 * s + x1 * c);
    }
    store(xp, xv);
  }
}

template <class T>
void rope(const char* fn, T* x, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
          int64_t head_dim, int64_t token_stride, float sign, void* stream) {
  check_count(fn, "batch", batch);
  check_count(fn, "seq", seq);
  check_count(fn, "heads", heads);
  FLASHLM_CHECK(head_dim >= 2 && head_dim % 2 == 0 && head_dim <= INT_MAX,
                "{}: head_dim = {}, expected an even number >= 2", fn, head_dim);
  const int64_t rows = batch * seq * heads;
  if (rows == 0) return;
  const int64_t half = head_dim / 2;
  if (token_stride == 0) token_stride = heads * head_dim;
  FLASHLM_CHECK(token_stride >= heads * head_dim, "{}: token_stride = {}, expected 0 or at least heads x head_dim = {}",
                fn, token_stride, heads * head_dim);
  const cudaStream_t s = as_stream(stream);
  const bool packed_rows = token_stride % kPack == 0;  // every row's start stays 16-byte aligned
  if (half % kRopePairs == 0 && packed_rows && aligned16(x) && aligned16(cos) && aligned16(sin)) {
    rope_kernel<kRopePairs><<<elementwise_blocks(rows * half / kRopePairs), kThreads, 0, s>>>(
        dev(x), cos, sin, rows, seq, heads, token_stride, int(half), sign);
  } else {
    rope_kernel<1><<<elementwise_blocks(rows * half), kThreads, 0, s>>>(dev(x), cos, sin, rows, seq, heads,
                                                                         token_stride, int(half), sign);
  }
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "rope_kernel");
}

}  // namespace

template <class T>
void rope_forward(T* x, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
                  int64_t head_dim, void* stream, int64_t token_stride) {
  rope("rope_forward", x, cos, sin, batch, seq, heads, head_dim, token_stride, 1.0f, stream);
}

template <class T>
void rope_backward(T* dx, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
                   int64_t head_dim, void* stream, int64_t token_stride) {
  rope("rope_backward", dx, cos, sin, batch, seq, heads, head_dim, token_stride, -1.0f, stream);  // the inverse
}

#define FLASHLM_ROPE_INSTANTIATE(T) \
  template void rope_forward<T>(T*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, void*, int64_t); \
  template void rope_backward<T>(T*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, void*, int64_t);

FLASHLM_ROPE_INSTANTIATE(float)
FLASHLM_ROPE_INSTANTIATE(bf16_t)
FLASHLM_ROPE_INSTANTIATE(fp16_t)

#undef FLASHLM_ROPE_INSTANTIATE

}  // namespace flashlm::gpu
