// Rotary position embedding on CUDA (model/cuda/ops.h), forward and backward (the inverse rotation): one
// thread per 4 interleaved pairs (one pack) when head_dim % 8 == 0, else per pair. The backward's amax for FP8
// training (model/cuda/amax.cuh) covers the rotated heads and the heads after them that it only reads.
#include "core/cuda/kernels.cuh"
#include "core/cuda_check.h"
#include "model/cuda/amax.cuh"
#include "model/cuda/ops.h"

namespace flashlm::gpu {

namespace {

constexpr int kRopePairs = kPack / 2;  // pairs per thread on the packed path

// RoPE: one thread per PAIRS consecutive interleaved pairs of a row (kRopePairs, a pack of x and 16 bytes
// of each table, when half % kRopePairs == 0 and x, cos and sin are 16-byte aligned; else 1); rotation by
// +angle (sign 1) or -angle (sign -1). Each token's heads [0, rotated) are rotated; with AMAX the kernel also
// reads heads [rotated, heads) without writing them, and adds the largest |value| of every head it covers, as
// stored, to *amax_bits (one atomic per block).

template <int PAIRS, bool AMAX, class D>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(D* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin, int64_t rows,
                int64_t seq, int64_t heads, int64_t rotated, int64_t token_stride, int half, float sign,
                uint32_t* __restrict__ amax_bits) {
  const int groups = half / PAIRS;  // per row
  uint32_t best = 0;
  FLASHLM_GRID_STRIDE(p, rows * groups) {
    const int i = int(p % groups) * PAIRS;
    const int64_t row = p / groups;  // (b, t, h) row of head_dim = 2 half values
    const int64_t token = row / heads, head = row % heads;
    const int64_t t = token % seq;
    D* xp = x + token * token_stride + head * (2 * int64_t{half}) + 2 * i;
    Vec<D, 2 * PAIRS> xv = load<2 * PAIRS>(xp);
    if (!AMAX || head < rotated) {
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
    if constexpr (AMAX) {
#pragma unroll
      for (int k = 0; k < 2 * PAIRS; ++k) best = max(best, magnitude_bits(f32(xv[k])));
    }
  }
  if constexpr (AMAX) block_amax_to<kThreads>(amax_bits, best);
}

// amax (null: none) covers amax_heads heads of each token (0: heads), the first `heads` of them rotated.
template <class T>
void rope(const char* fn, T* x, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
          int64_t head_dim, int64_t token_stride, float sign, void* stream, float* amax = nullptr,
          int64_t amax_heads = 0) {
  check_count(fn, "batch", batch);
  check_count(fn, "seq", seq);
  check_count(fn, "heads", heads);
  FLASHLM_CHECK(head_dim >= 2 && head_dim % 2 == 0 && head_dim <= INT_MAX,
                "{}: head_dim = {}, expected an even number >= 2", fn, head_dim);
  if (amax_heads == 0) amax_heads = heads;
  FLASHLM_CHECK(amax_heads >= heads, "{}: amax_heads = {}, expected 0 or at least heads = {}", fn, amax_heads, heads);
  if (token_stride == 0) token_stride = heads * head_dim;
  FLASHLM_CHECK(token_stride >= heads * head_dim, "{}: token_stride = {}, expected 0 or at least heads x head_dim = {}",
                fn, token_stride, heads * head_dim);
  FLASHLM_CHECK(!amax || token_stride >= amax_heads * head_dim,
                "{}: token_stride = {}, expected at least amax_heads x head_dim = {} (the heads the amax covers)", fn,
                token_stride, amax_heads * head_dim);
  const cudaStream_t s = as_stream(stream);
  if (amax) clear_amax(amax, s);
  const int64_t read = amax ? amax_heads : heads;  // heads per token the kernel reads
  const int64_t rows = batch * seq * read;
  if (rows == 0) return;
  const int64_t half = head_dim / 2;
  const bool packed_rows = token_stride % kPack == 0;  // every row's start stays 16-byte aligned
  const auto launch = [&](auto pairs, auto with_amax) {
    constexpr int P = decltype(pairs)::value;
    rope_kernel<P, decltype(with_amax)::value><<<elementwise_blocks(rows * half / P), kThreads, 0, s>>>(
        dev(x), cos, sin, rows, seq, read, heads, token_stride, int(half), sign, reinterpret_cast<uint32_t*>(amax));
  };
  const bool packed = half % kRopePairs == 0 && packed_rows && aligned16(x) && aligned16(cos) && aligned16(sin);
  const auto launch_width = [&](auto with_amax) {
    if (packed) {
      launch(std::integral_constant<int, kRopePairs>{}, with_amax);
    } else {
      launch(std::integral_constant<int, 1>{}, with_amax);
    }
  };
  if (amax) {
    launch_width(std::true_type{});
  } else {
    launch_width(std::false_type{});
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
                   int64_t head_dim, void* stream, int64_t token_stride, float* amax, int64_t amax_heads) {
  rope("rope_backward", dx, cos, sin, batch, seq, heads, head_dim, token_stride, -1.0f, stream, amax,
       amax_heads);  // the inverse
}

#define FLASHLM_ROPE_INSTANTIATE(T) \
  template void rope_forward<T>(T*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, void*, int64_t); \
  template void rope_backward<T>(T*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, void*, int64_t, \
                                 float*, int64_t);

FLASHLM_ROPE_INSTANTIATE(float)
FLASHLM_ROPE_INSTANTIATE(bf16_t)
FLASHLM_ROPE_INSTANTIATE(fp16_t)

#undef FLASHLM_ROPE_INSTANTIATE

}  // namespace flashlm::gpu
