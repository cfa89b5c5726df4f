// Building blocks of the memory-bound kernels (the LM's layers in src/model/cuda/, the optimizer's in
// src/optim/cuda/, the array utilities in core/cuda/array_ops.cu): fp32 arithmetic on T ∈ {float,
// __nv_bfloat16, __half} storage, moved in packs of 8 elements, as 16-byte accesses (one for a 2-byte type,
// two for fp32), wherever the host finds every pointer 16-byte aligned and the shape splits into whole
// packs, and element by element otherwise (tails, odd widths, misaligned views). The arithmetic per element
// and every summation order are the same on both paths, so they give the same bits. For .cu files only.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/check.h"
#include "flashlm/dtype.h"

namespace flashlm::gpu {

static_assert(sizeof(bf16_t) == sizeof(__nv_bfloat16) && sizeof(fp16_t) == sizeof(__half));

// ---------------------------------------------------------------------------------------------------
// Element types: the host-side types of the headers (flashlm/dtype.h) and their CUDA twins (same bits).

template <class T>
struct DeviceType {
  using type = T;
};
template <>
struct DeviceType<bf16_t> {
  using type = __nv_bfloat16;
};
template <>
struct DeviceType<fp16_t> {
  using type = __half;
};

template <class T>
auto dev(T* p) {
  using U = typename DeviceType<std::remove_const_t<T>>::type;
  using D = std::conditional_t<std::is_const_v<T>, const U, U>;
  return reinterpret_cast<D*>(p);
}

__device__ __forceinline__ float f32(float x) { return x; }
__device__ __forceinline__ float f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float f32(__half x) { return __half2float(x); }

template <class D>
__device__ __forceinline__ D from_f32(float x) {
  if constexpr (std::is_same_v<D, __half>) return __float2half_rn(x);
  else if constexpr (std::is_same_v<D, __nv_bfloat16>) return __float2bfloat16_rn(x);
  else return x;
}

inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// ---------------------------------------------------------------------------------------------------
// Launch shapes of the elementwise kernels.

constexpr int kThreads = 256;                     // elementwise kernels
constexpr int64_t kMaxBlocks = int64_t{1} << 16;  // elementwise grids are capped; the loops stride over the rest
constexpr int kPack = 8;                          // elements per packed access (16 bytes of a 2-byte type)

inline unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::min((n + kThreads - 1) / kThreads, kMaxBlocks));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// for (i over [0, n)) with a grid-stride loop.
#define FLASHLM_GRID_STRIDE(i, n)                                              \
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x,             \
               i##_step = int64_t{gridDim.x} * blockDim.x;                     \
       i < (n); i += i##_step)

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// How many whole packs of n elements for_each_pack may take as 16-byte accesses: n / kPack when every
// pointer is 16-byte aligned, else none.
template <class... P>
int64_t pack_count(int64_t n, const P*... p) {
  return (aligned16(p) && ...) ? n / kPack : 0;
}

// Blocks for for_each_pack: one thread per pack or per element past the packs, whichever is more.
inline unsigned packed_blocks(int64_t n, int64_t packs) {
  return elementwise_blocks(std::max(packs, n - packs * kPack));
}

// ---------------------------------------------------------------------------------------------------
// Packed accesses: N consecutive elements in registers. load and store move them as 16-byte words when
// N·sizeof(D) is a multiple of 16 (p must then be 16-byte aligned; the host checks before it picks a
// packed path) and element by element otherwise.

template <class D, int N>
struct Vec {
  D v[N];
  __device__ D& operator[](int k) { return v[k]; }
  __device__ const D& operator[](int k) const { return v[k]; }
};

template <int N, class D>
__device__ __forceinline__ Vec<D, N> load(const D* p) {
  Vec<D, N> r;
  if constexpr (N * sizeof(D) % 16 == 0) {
#pragma unroll
    for (int w = 0; w < int(N * sizeof(D) / 16); ++w) {
      const uint4 bits = reinterpret_cast<const uint4*>(p)[w];
      memcpy(&r.v[w * (16 / sizeof(D))], &bits, 16);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) r.v[k] = p[k];
  }
  return r;
}

template <int N, class D>
__device__ __forceinline__ void store(D* p, const Vec<D, N>& r) {
  if constexpr (N * sizeof(D) % 16 == 0) {
#pragma unroll
    for (int w = 0; w < int(N * sizeof(D) / 16); ++w) {
      uint4 bits;
      memcpy(&bits, &r.v[w * (16 / sizeof(D))], 16);
      reinterpret_cast<uint4*>(p)[w] = bits;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = r.v[k];
  }
}

template <int W>
using Width = std::integral_constant<int, W>;

// Elements [0, n) of an elementwise kernel: body(Width<kPack>{}, i) for each of the first `packs` whole
// packs [i, i + kPack), then body(Width<1>{}, i) for each element past them; grid-stride loops. The body
// is written once for both widths, so both do the same arithmetic per element.
template <class Body>
__device__ __forceinline__ void for_each_pack(int64_t n, int64_t packs, Body body) {
  FLASHLM_GRID_STRIDE(q, packs) body(Width<kPack>{}, q * kPack);
  const int64_t first = packs * kPack;
#pragma unroll 1  // under kPack elements, or a misaligned call: unrolling would only cost registers
  FLASHLM_GRID_STRIDE(i, n - first) body(Width<1>{}, first + i);
}

// ---------------------------------------------------------------------------------------------------
// Reductions inside a warp or a block, in a fixed order.

template <class A>
__device__ __forceinline__ A warp_sum(A x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;  // every lane holds the same bits (each butterfly step adds the same two values)
}

// Sum over the block's THREADS threads; every thread gets the total. Call once per kernel.
template <int THREADS, class A>
__device__ __forceinline__ A block_sum(A x) {
  constexpr int kWarps = THREADS / 32;
  __shared__ A warp_part[kWarps];
  x = warp_sum(x);
  if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = x;
  __syncthreads();
  A total = warp_part[0];
  for (int w = 1; w < kWarps; ++w) total += warp_part[w];
  return total;
}

// ---------------------------------------------------------------------------------------------------
// Host-side checks of the entry points' sizes.

inline void check_count(const char* fn, const char* name, int64_t v) {
  FLASHLM_CHECK(v >= 0, "{}: {} = {}, expected >= 0", fn, name, v);
}

inline void check_width(const char* fn, const char* name, int64_t v) {
  FLASHLM_CHECK(v >= 1 && v <= INT_MAX, "{}: {} = {} outside [1, {}]", fn, name, v, INT_MAX);
}

}  // namespace flashlm::gpu
