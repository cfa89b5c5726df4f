// The LM's layer kernels on CUDA (declarations and conventions in ops_cuda.h). Memory-bound kernels, fp32
// arithmetic on T ∈ {float, __nv_bfloat16, __half} storage. They move data in packs of 8 elements, as
// 16-byte accesses (one for a 2-byte type, two for fp32), wherever the host finds every pointer 16-byte
// aligned and the shape splits into whole packs, and element by element otherwise (tails, odd widths,
// misaligned views); the arithmetic per element and every summation order are the same on both paths,
// so they give the same bits. Shapes:
//   - RMSNorm: one warp per row, 8 rows per 256-thread block (lanes stride over the row, so any d works);
//     with d % 8 == 0 the rows are read in packs, and the row sums still add each lane's elements in the
//     lane-strided order (through a shared-memory stage, see the RMSNorm section); the gain gradient is
//     summed in two deterministic passes: chunks of 64 rows (more past 64 Ki rows, at most 1024 chunks;
//     one thread per column, rows in order) into a scratch [chunks, d], then 8 interleaved chunk sums per
//     column added in a fixed order.
//   - RoPE: one thread per 4 interleaved pairs (one pack) when head_dim % 8 == 0, else per pair.
//   - cross-entropy: one 256-thread block per row, online (max, sum of exp) per thread, merged by warp
//     shuffles and then across warps in a fixed order.
//   - embedding backward: (token, row) pairs radix-sorted (stable, so the rows of one token stay in
//     increasing order); the first sorted position of each token adds that token's rows into its table
//     row, one thread per column, exactly as the CPU loop does. No two blocks write one table row.
//   - squared norm / non-finite count: 8192-element chunks reduced by one block each, then one block
//     over the chunk partials.
//   - everything elementwise: grid-stride loops over the whole packs, then over the elements past them.
#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/check.h"
#include "core/cuda_check.h"
#include "core/softmax_stats.cuh"
#include "flashlm/memory.h"
#include "model/ops_cuda.h"

namespace flashlm::gpu {

namespace {

static_assert(sizeof(bf16_t) == sizeof(__nv_bfloat16) && sizeof(fp16_t) == sizeof(__half));

// ---------------------------------------------------------------------------------------------------
// Element types: the host-side types of ops_cuda.h and their CUDA twins (same bits).

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

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// ---------------------------------------------------------------------------------------------------
// Launch shapes.

constexpr int kThreads = 256;                     // elementwise kernels
constexpr int64_t kMaxBlocks = int64_t{1} << 16;  // elementwise grids are capped; the loops stride over the rest
constexpr int kPack = 8;                          // elements per packed access (16 bytes of a 2-byte type)
constexpr int kRopePairs = kPack / 2;             // RoPE: pairs per thread on the packed path
constexpr int kNormRows = 8;                      // RMSNorm: rows (warps) per block
constexpr int kNormThreads = 32 * kNormRows;
constexpr int kStageWords = 128;                  // RMSNorm: 16-byte words of a row span staged per warp (2 KiB)
constexpr int64_t kGainRows = 64;                 // RMSNorm gain gradient: rows per partial sum (at least)
constexpr int64_t kGainMaxChunks = 1024;          // and at most this many partial sums (bounds the scratch)
constexpr int kGainThreads = 256;                 // columns per block of the partial sums
constexpr int kColumnThreads = 256;               // chunk-sum kernel: 32 columns x 8 chunk lanes
constexpr int kCeThreads = 256;                   // cross-entropy: threads per row
constexpr int kEmbThreads = 256;                  // embedding backward: columns per block
constexpr int kEmbPositions = 16;                 // embedding backward: sorted positions per block
constexpr int kReduceThreads = 256;
constexpr int64_t kReduceChunk = 8192;            // elements per block of a reduction's first pass
constexpr int64_t kMaxGridY = 65535;

unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::min((n + kThreads - 1) / kThreads, kMaxBlocks));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// for (i over [0, n)) with a grid-stride loop.
#define FLASHLM_GRID_STRIDE(i, n)                                              \
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x,             \
               i##_step = int64_t{gridDim.x} * blockDim.x;                     \
       i < (n); i += i##_step)

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// How many whole packs of n elements for_each_pack may take as 16-byte accesses: n / kPack when every
// pointer is 16-byte aligned, else none.
template <class... P>
int64_t pack_count(int64_t n, const P*... p) {
  return (aligned16(p) && ...) ? n / kPack : 0;
}

// Blocks for for_each_pack: one thread per pack or per element past the packs, whichever is more.
unsigned packed_blocks(int64_t n, int64_t packs) { return elementwise_blocks(std::max(packs, n - packs * kPack)); }

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
// RMSNorm, one warp per row. PACKED (the host's choice: d % kPack == 0 and every pointer 16-byte aligned)
// only changes how the row is read. A row sum keeps the plain lane-strided order either way (lane l adds
// elements l, l + 32, l + 64, ... in turn, then warp_sum): the packed path copies the row, one span of at
// most 2 KiB at a time, into the warp's shared-memory stage with coalesced 16-byte loads, and each lane
// then reads its strided elements back from the stage. The elementwise writes have no order to keep:
// lane l takes the packs [8l + 256m, +8).

template <class D>
constexpr int kStageElements = kStageWords * 16 / int(sizeof(D));  // elements per staged span

// Copies elements [begin, begin + count) of each of the A rows (count · sizeof(D) a multiple of 16, at
// most 2 KiB; rows + begin 16-byte aligned) into this warp's stage[a], all loads issued before the first
// store, and waits until the whole warp has written them.
template <int A, class D>
__device__ __forceinline__ void stage_span(const D* const (&rows)[A], int begin, int count,
                                           uint4 (*stage)[kStageWords]) {
  constexpr int kPerLane = kStageWords / 32;
  const int lane = threadIdx.x % 32, words = count * int(sizeof(D)) / 16;
  uint4 w[A][kPerLane];
#pragma unroll
  for (int a = 0; a < A; ++a) {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      if (lane + 32 * k < words) w[a][k] = reinterpret_cast<const uint4*>(rows[a] + begin)[lane + 32 * k];
    }
  }
#pragma unroll
  for (int a = 0; a < A; ++a) {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      if (lane + 32 * k < words) stage[a][lane + 32 * k] = w[a][k];
    }
  }
  __syncwarp();
}

template <bool PACKED, class D>
__global__ void __launch_bounds__(kNormThreads)
    rmsnorm_forward_kernel(const D* __restrict__ x, const float* __restrict__ gain, D* __restrict__ y,
                           float* __restrict__ rstd, int64_t n, int d, float eps) {
  const int64_t row = int64_t{blockIdx.x} * kNormRows + threadIdx.x / 32;
  if (row >= n) return;  // the whole warp leaves together
  const int lane = threadIdx.x % 32;
  const D* xr = x + row * d;
  float ss = 0.f;
  const auto add_square = [&](D xj) {
    const float v = f32(xj);
    ss += v * v;
  };
  if constexpr (PACKED) {
    __shared__ uint4 stage[kNormRows][1][kStageWords];
    uint4 (*own)[kStageWords] = stage[threadIdx.x / 32];
    const D* xs = reinterpret_cast<const D*>(own[0]);
    for (int begin = 0; begin < d; begin += kStageElements<D>) {
      const int count = min(d - begin, kStageElements<D>);
      stage_span({xr}, begin, count, own);
      for (int j = lane; j < count; j += 32) add_square(xs[j]);
      __syncwarp();  // the next span overwrites the stage
    }
  } else {
    for (int j = lane; j < d; j += 32) add_square(xr[j]);
  }
  ss = warp_sum(ss);
  const float s = 1.0f / sqrtf(ss / float(d) + eps);
  if (lane == 0) rstd[row] = s;
  D* yr = y + row * d;
  constexpr int W = PACKED ? kPack : 1;
  for (int j = W * lane; j < d; j += 32 * W) {
    const Vec<D, W> xv = load<W>(xr + j);
    const Vec<float, W> gv = load<W>(gain + j);
    Vec<D, W> yv;
#pragma unroll
    for (int k = 0; k < W; ++k) yv[k] = from_f32<D>(f32(xv[k]) * s * gv[k]);
    store(yr + j, yv);
  }
}

// dx_j += s g_j dy_j - x_j s³ (Σ_k dy_k g_k x_k) / d, one warp per row.
template <bool PACKED, class D>
__global__ void __launch_bounds__(kNormThreads)
    rmsnorm_backward_dx_kernel(const D* __restrict__ dy, const D* __restrict__ x, const float* __restrict__ gain,
                               const float* __restrict__ rstd, D* __restrict__ dx, int64_t n, int d) {
  const int64_t row = int64_t{blockIdx.x} * kNormRows + threadIdx.x / 32;
  if (row >= n) return;
  const int lane = threadIdx.x % 32;
  const D* dyr = dy + row * d;
  const D* xr = x + row * d;
  D* dxr = dx + row * d;
  float dot = 0.f;
  const auto add_product = [&](int j, D dyj, D xj) { dot += f32(dyj) * gain[j] * f32(xj); };
  if constexpr (PACKED) {
    __shared__ uint4 stage[kNormRows][2][kStageWords];
    uint4 (*own)[kStageWords] = stage[threadIdx.x / 32];
    const D* dys = reinterpret_cast<const D*>(own[0]);
    const D* xs = reinterpret_cast<const D*>(own[1]);
    for (int begin = 0; begin < d; begin += kStageElements<D>) {
      const int count = min(d - begin, kStageElements<D>);
      stage_span({dyr, xr}, begin, count, own);
      for (int j = lane; j < count; j += 32) add_product(begin + j, dys[j], xs[j]);
      __syncwarp();  // the next span overwrites the stage
    }
  } else {
    for (int j = lane; j < d; j += 32) add_product(j, dyr[j], xr[j]);
  }
  dot = warp_sum(dot);
  const float s = rstd[row];
  const float c = dot * s * s * s / float(d);
  constexpr int W = PACKED ? kPack : 1;
  for (int j = W * lane; j < d; j += 32 * W) {
    Vec<D, W> dxv = load<W>(dxr + j);
    const Vec<D, W> dyv = load<W>(dyr + j), xv = load<W>(xr + j);
    const Vec<float, W> gv = load<W>(gain + j);
#pragma unroll
    for (int k = 0; k < W; ++k) dxv[k] = from_f32<D>(f32(dxv[k]) + (s * gv[k] * f32(dyv[k]) - f32(xv[k]) * c));
    store(dxr + j, dxv);
  }
}

// partial[c, j] = Σ over the rows r of chunk c (chunk_rows rows, in order) of dy[r, j] x[r, j] rstd[r].
// Grid: (ceil(d / kGainThreads), chunks).
template <class D>
__global__ void __launch_bounds__(kGainThreads)
    rmsnorm_gain_partials_kernel(const D* __restrict__ dy, const D* __restrict__ x, const float* __restrict__ rstd,
                                 float* __restrict__ partial, int64_t n, int d, int64_t chunk_rows) {
  const int j = int(blockIdx.x) * kGainThreads + int(threadIdx.x);
  if (j >= d) return;
  const int64_t c = blockIdx.y;
  const int64_t r0 = c * chunk_rows, r1 = min(n, r0 + chunk_rows);
  float acc = 0.f;
  for (int64_t r = r0; r < r1; ++r) acc += f32(dy[r * d + j]) * f32(x[r * d + j]) * rstd[r];
  partial[c * d + j] = acc;
}

// out[j] += Σ_c partial[c, j]: chunk lane t (of 8) sums chunks t, t + 8, ... in order, then lane 0 adds
// the 8 lane sums in order. Grid: ceil(d / 32).
__global__ void __launch_bounds__(kColumnThreads)
    add_column_sums_kernel(const float* __restrict__ partial, int64_t chunks, int d, float* __restrict__ out) {
  constexpr int kLanes = kColumnThreads / 32;
  __shared__ float lane_sum[kLanes][33];
  const int tx = int(threadIdx.x) % 32, ty = int(threadIdx.x) / 32;
  const int j = int(blockIdx.x) * 32 + tx;
  float acc = 0.f;
  if (j < d) {
    for (int64_t c = ty; c < chunks; c += kLanes) acc += partial[c * d + j];
  }
  lane_sum[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && j < d) {
    float total = lane_sum[0][tx];
    for (int t = 1; t < kLanes; ++t) total += lane_sum[t][tx];
    out[j] += total;
  }
}

// ---------------------------------------------------------------------------------------------------
// RoPE: one thread per PAIRS consecutive interleaved pairs of a row (kRopePairs, a pack of x and 16 bytes
// of each table, when half % kRopePairs == 0 and x, cos and sin are 16-byte aligned; else 1); rotation by
// +angle (sign 1) or -angle (sign -1).

template <int PAIRS, class D>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(D* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin, int64_t rows,
                int64_t seq, int64_t heads, int half, float sign) {
  const int groups = half / PAIRS;  // per row
  FLASHLM_GRID_STRIDE(p, rows * groups) {
    const int i = int(p % groups) * PAIRS;
    const int64_t row = p / groups;  // (b, t, h) row of head_dim = 2 half values
    const int64_t t = (row / heads) % seq;
    D* xp = x + row * (2 * int64_t{half}) + 2 * i;
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

// ---------------------------------------------------------------------------------------------------
// SwiGLU.

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

// ---------------------------------------------------------------------------------------------------
// Cross-entropy: one block per row.

// Max and sum of exp(z - max) over one row of `vocab` logits; every thread of the block gets the same
// values. NaN logits make the sum NaN.
template <class D>
__device__ __forceinline__ void row_stats(const D* __restrict__ z, int64_t vocab, float& m_out, float& l_out) {
  float m = -INFINITY, l = 0.f;
  for (int64_t j = threadIdx.x; j < vocab; j += kCeThreads) {
    const float v = f32(z[j]);
    if (v > m) {
      l = l * expf(m - v) + 1.f;
      m = v;
    } else if (v != -INFINITY) {  // a NaN lands here and poisons l
      l += expf(v - m);
    }
  }
  block_merge_stats<kCeThreads>(m, l);
  m_out = m;
  l_out = l;
}

template <class D>
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_forward_kernel(const D* __restrict__ logits, const int32_t* __restrict__ targets,
                                 float* __restrict__ row_loss, int64_t vocab) {
  const int64_t row = blockIdx.x;
  const D* z = logits + row * vocab;
  float m, l;
  row_stats(z, vocab, m, l);
  if (threadIdx.x == 0) {
    const int32_t t = targets[row];
    row_loss[row] = t >= 0 && t < vocab ? (m + logf(l)) - f32(z[t]) : __int_as_float(0x7fc00000);
  }
}

template <class D>
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_backward_kernel(D* __restrict__ logits, const int32_t* __restrict__ targets, int64_t vocab,
                                  float scale) {
  const int64_t row = blockIdx.x;
  D* z = logits + row * vocab;
  float m, l;
  row_stats(z, vocab, m, l);  // ends with a __syncthreads: every read of the row precedes every write
  const float lse = m + logf(l);
  const int32_t t = targets[row];
  const bool valid = t >= 0 && t < vocab;
  for (int64_t j = threadIdx.x; j < vocab; j += kCeThreads) {
    float g = expf(f32(z[j]) - lse) * scale;
    if (j == t) g -= scale;
    z[j] = from_f32<D>(valid ? g : __int_as_float(0x7fc00000));
  }
}

// ---------------------------------------------------------------------------------------------------
// Embedding.

// Packs only when d % kPack == 0, so that no pack straddles two rows.
template <class D>
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(const float* __restrict__ table, const int32_t* __restrict__ tokens, D* __restrict__ x,
                             int64_t n, int64_t d, int64_t vocab, int64_t packs) {
  for_each_pack(n * d, packs, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    const int64_t r = i / d, j = i - r * d;
    const int32_t tok = tokens[r];
    Vec<D, W> xv;
    if (tok >= 0 && tok < vocab) {
      const Vec<float, W> tv = load<W>(table + int64_t{tok} * d + j);
#pragma unroll
      for (int k = 0; k < W; ++k) xv[k] = from_f32<D>(tv[k]);
    } else {
#pragma unroll
      for (int k = 0; k < W; ++k) xv[k] = from_f32<D>(__int_as_float(0x7fc00000));
    }
    store(x + i, xv);
  });
}

// Sort keys: the token, or `vocab` (sorted after every valid token) for a token outside [0, vocab);
// values: the row.
__global__ void __launch_bounds__(kThreads)
    embedding_keys_kernel(const int32_t* __restrict__ tokens, int64_t n, int64_t vocab, uint32_t* __restrict__ keys,
                          int32_t* __restrict__ rows) {
  FLASHLM_GRID_STRIDE(i, n) {
    const int32_t tok = tokens[i];
    keys[i] = tok >= 0 && tok < vocab ? uint32_t(tok) : uint32_t(vocab);
    rows[i] = int32_t(i);
  }
}

// Block (x, y) visits sorted positions [x·kEmbPositions, +kEmbPositions) for columns
// [y·kEmbThreads, +kEmbThreads). A position that starts a run of equal keys owns that token: it adds
// the run's rows (increasing row order, the radix sort being stable) into the token's table row.
template <class D>
__global__ void __launch_bounds__(kEmbThreads)
    embedding_backward_kernel(const D* __restrict__ dx, const uint32_t* __restrict__ keys,
                              const int32_t* __restrict__ rows, float* __restrict__ dtable, int64_t n, int64_t d,
                              int64_t vocab) {
  const int64_t j = int64_t{blockIdx.y} * kEmbThreads + threadIdx.x;
  if (j >= d) return;
  const int64_t p0 = int64_t{blockIdx.x} * kEmbPositions;
  const int64_t p1 = min(n, p0 + kEmbPositions);
  for (int64_t p = p0; p < p1; ++p) {
    const uint32_t key = keys[p];
    if (key >= vocab) break;  // the invalid-token key sorts last: all that follows is invalid too
    if (p > 0 && keys[p - 1] == key) continue;
    // End of the run: the first position in (p, n) whose key is larger (binary search, keys sorted).
    int64_t lo = p + 1, hi = n;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (keys[mid] == key) lo = mid + 1;
      else hi = mid;
    }
    float* out = dtable + int64_t{key} * d + j;
    float acc = *out;
#pragma unroll 4
    for (int64_t q = p; q < lo; ++q) acc += f32(dx[int64_t{rows[q]} * d + j]);
    *out = acc;
  }
}

// ---------------------------------------------------------------------------------------------------
// AdamW: CpuModel::adamw_step's operations in its order, each rounded once (no fused multiply-adds).

struct AdamWScalars {
  float alpha, b1, one_minus_b1, b2, one_minus_b2, eps, decay, grad_scale;
};

// One element. grad_scale: the clipping factor, applied here instead of by a pass of its own over the
// gradients (the same single rounding as scale_inplace's g * s).
__device__ __forceinline__ void adamw_element(float& w, float grad, float& m, float& v, const AdamWScalars& a) {
  const float g = a.grad_scale == 1.0f ? grad : __fmul_rn(grad, a.grad_scale);
  const float mi = __fadd_rn(__fmul_rn(a.b1, m), __fmul_rn(a.one_minus_b1, g));
  const float vi = __fadd_rn(__fmul_rn(a.b2, v), __fmul_rn(__fmul_rn(a.one_minus_b2, g), g));
  float wi = __fsub_rn(w, __fdiv_rn(__fmul_rn(a.alpha, mi), __fadd_rn(__fsqrt_rn(vi), a.eps)));
  wi = __fsub_rn(wi, __fmul_rn(a.decay, wi));
  m = mi;
  v = vi;
  w = wi;
}

// Elements [first, n), one per thread.
template <class D>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* __restrict__ w, const float* __restrict__ grad, float* __restrict__ m, float* __restrict__ v,
                 int64_t first, int64_t n, AdamWScalars a, D* __restrict__ copy) {
  FLASHLM_GRID_STRIDE(j, n - first) {
    const int64_t i = first + j;
    float wi = w[i], mi = m[i], vi = v[i];
    adamw_element(wi, grad[i], mi, vi, a);
    m[i] = mi;
    v[i] = vi;
    w[i] = wi;
    if (copy) copy[i] = from_f32<D>(wi);
  }
}

// Elements [0, 4·n4), four per thread with 16-byte loads and stores (the step is memory bound: 30 bytes
// per parameter with a low-precision copy). Same arithmetic per element as adamw_kernel.
template <class D>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel_x4(float4* __restrict__ w, const float4* __restrict__ grad, float4* __restrict__ m,
                    float4* __restrict__ v, int64_t n4, AdamWScalars a, D* __restrict__ copy) {
  FLASHLM_GRID_STRIDE(q, n4) {
    float4 wq = w[q], mq = m[q], vq = v[q];
    const float4 gq = grad[q];
    adamw_element(wq.x, gq.x, mq.x, vq.x, a);
    adamw_element(wq.y, gq.y, mq.y, vq.y, a);
    adamw_element(wq.z, gq.z, mq.z, vq.z, a);
    adamw_element(wq.w, gq.w, mq.w, vq.w, a);
    w[q] = wq;
    m[q] = mq;
    v[q] = vq;
    if (copy) {
      D* c = copy + 4 * q;
      c[0] = from_f32<D>(wq.x);
      c[1] = from_f32<D>(wq.y);
      c[2] = from_f32<D>(wq.z);
      c[3] = from_f32<D>(wq.w);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Two-pass reductions.

struct SquareOp {
  using Acc = double;
  template <class D>
  __device__ double operator()(D x) const {
    const double v = f32(x);
    return v * v;
  }
};

struct NonfiniteOp {
  using Acc = long long;
  template <class D>
  __device__ long long operator()(D x) const {
    return isfinite(f32(x)) ? 0 : 1;
  }
};

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

// ---------------------------------------------------------------------------------------------------
// Elementwise utilities.

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

// ---------------------------------------------------------------------------------------------------
// Host-side checks.

void check_count(const char* fn, const char* name, int64_t v) {
  FLASHLM_CHECK(v >= 0, "{}: {} = {}, expected >= 0", fn, name, v);
}

void check_width(const char* fn, const char* name, int64_t v) {
  FLASHLM_CHECK(v >= 1 && v <= INT_MAX, "{}: {} = {} outside [1, {}]", fn, name, v, INT_MAX);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Host entry points.

template <class T>
void rmsnorm_forward(const T* x, const float* gain, T* y, float* rstd, int64_t n, int64_t d, float eps, void* stream) {
  check_count("rmsnorm_forward", "n", n);
  check_width("rmsnorm_forward", "d", d);
  if (n == 0) return;
  const int64_t blocks = ceil_div(n, kNormRows);
  FLASHLM_CHECK(blocks <= INT_MAX, "rmsnorm_forward: n = {} is too large", n);
  const cudaStream_t s = as_stream(stream);
  if (d % kPack == 0 && aligned16(x) && aligned16(gain) && aligned16(y)) {
    rmsnorm_forward_kernel<true><<<unsigned(blocks), kNormThreads, 0, s>>>(dev(x), gain, dev(y), rstd, n, int(d), eps);
  } else {
    rmsnorm_forward_kernel<false><<<unsigned(blocks), kNormThreads, 0, s>>>(dev(x), gain, dev(y), rstd, n, int(d), eps);
  }
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "rmsnorm_forward_kernel");
}

template <class T>
void rmsnorm_backward(const T* dy, const T* x, const float* gain, const float* rstd, T* dx, float* dgain, int64_t n,
                      int64_t d, void* stream) {
  check_count("rmsnorm_backward", "n", n);
  check_width("rmsnorm_backward", "d", d);
  if (n == 0) return;
  const int64_t blocks = ceil_div(n, kNormRows);
  FLASHLM_CHECK(blocks <= INT_MAX, "rmsnorm_backward: n = {} is too large", n);
  const cudaStream_t s = as_stream(stream);

  // dgain first (it reads dy, x and rstd only): chunks of rows fixed by n alone (64 rows, more when n
  // exceeds 64 Ki rows so that there are at most 1024 chunks), then the chunks summed in a fixed order.
  const int64_t chunk_rows = std::max(kGainRows, ceil_div(n, kGainMaxChunks));
  const int64_t chunks = ceil_div(n, chunk_rows);  // <= kGainMaxChunks
  Buffer scratch = Buffer::allocate_on_stream(size_t(chunks) * size_t(d) * sizeof(float),
                                              "rmsnorm_backward gain partials", stream);
  float* partial = static_cast<float*>(scratch.data());
  const dim3 partial_grid(unsigned(ceil_div(d, kGainThreads)), unsigned(chunks));
  rmsnorm_gain_partials_kernel<<<partial_grid, kGainThreads, 0, s>>>(dev(dy), dev(x), rstd, partial, n, int(d),
                                                                      chunk_rows);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "rmsnorm_gain_partials_kernel");
  add_column_sums_kernel<<<unsigned(ceil_div(d, 32)), kColumnThreads, 0, s>>>(partial, chunks, int(d), dgain);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "add_column_sums_kernel");

  if (d % kPack == 0 && aligned16(dy) && aligned16(x) && aligned16(gain) && aligned16(dx)) {
    rmsnorm_backward_dx_kernel<true><<<unsigned(blocks), kNormThreads, 0, s>>>(dev(dy), dev(x), gain, rstd, dev(dx),
                                                                               n, int(d));
  } else {
    rmsnorm_backward_dx_kernel<false><<<unsigned(blocks), kNormThreads, 0, s>>>(dev(dy), dev(x), gain, rstd, dev(dx),
                                                                                n, int(d));
  }
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "rmsnorm_backward_dx_kernel");
}

namespace {

template <class T>
void rope(const char* fn, T* x, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
          int64_t head_dim, float sign, void* stream) {
  check_count(fn, "batch", batch);
  check_count(fn, "seq", seq);
  check_count(fn, "heads", heads);
  FLASHLM_CHECK(head_dim >= 2 && head_dim % 2 == 0 && head_dim <= INT_MAX,
                "{}: head_dim = {}, expected an even number >= 2", fn, head_dim);
  const int64_t rows = batch * seq * heads;
  if (rows == 0) return;
  const int64_t half = head_dim / 2;
  const cudaStream_t s = as_stream(stream);
  if (half % kRopePairs == 0 && aligned16(x) && aligned16(cos) && aligned16(sin)) {
    rope_kernel<kRopePairs><<<elementwise_blocks(rows * half / kRopePairs), kThreads, 0, s>>>(dev(x), cos, sin, rows,
                                                                                              seq, heads, int(half),
                                                                                              sign);
  } else {
    rope_kernel<1><<<elementwise_blocks(rows * half), kThreads, 0, s>>>(dev(x), cos, sin, rows, seq, heads, int(half),
                                                                         sign);
  }
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "rope_kernel");
}

}  // namespace

template <class T>
void rope_forward(T* x, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
                  int64_t head_dim, void* stream) {
  rope("rope_forward", x, cos, sin, batch, seq, heads, head_dim, 1.0f, stream);
}

template <class T>
void rope_backward(T* dx, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
                   int64_t head_dim, void* stream) {
  rope("rope_backward", dx, cos, sin, batch, seq, heads, head_dim, -1.0f, stream);  // the transpose = inverse
}

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

template <class T>
void cross_entropy_forward(const T* logits, const int32_t* targets, float* row_loss, int64_t n, int64_t vocab,
                           void* stream) {
  check_count("cross_entropy_forward", "n", n);
  check_width("cross_entropy_forward", "vocab", vocab);
  FLASHLM_CHECK(n <= INT_MAX, "cross_entropy_forward: n = {} is too large", n);
  if (n == 0) return;
  cross_entropy_forward_kernel<<<unsigned(n), kCeThreads, 0, as_stream(stream)>>>(dev(logits), targets, row_loss,
                                                                                   vocab);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "cross_entropy_forward_kernel");
}

template <class T>
void cross_entropy_backward(T* logits, const int32_t* targets, int64_t n, int64_t vocab, float scale, void* stream) {
  check_count("cross_entropy_backward", "n", n);
  check_width("cross_entropy_backward", "vocab", vocab);
  FLASHLM_CHECK(n <= INT_MAX, "cross_entropy_backward: n = {} is too large", n);
  if (n == 0) return;
  cross_entropy_backward_kernel<<<unsigned(n), kCeThreads, 0, as_stream(stream)>>>(dev(logits), targets, vocab,
                                                                                    scale);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "cross_entropy_backward_kernel");
}

template <class T>
void embedding_forward(const float* table, const int32_t* tokens, T* x, int64_t n, int64_t d, int64_t vocab,
                       void* stream) {
  check_count("embedding_forward", "n", n);
  check_width("embedding_forward", "d", d);
  check_width("embedding_forward", "vocab", vocab);
  if (n == 0) return;
  const int64_t packs = d % kPack == 0 ? pack_count(n * d, table, x) : 0;
  embedding_forward_kernel<<<packed_blocks(n * d, packs), kThreads, 0, as_stream(stream)>>>(table, tokens, dev(x), n,
                                                                                             d, vocab, packs);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "embedding_forward_kernel");
}

template <class T>
void embedding_backward(const T* dx, const int32_t* tokens, float* dtable, int64_t n, int64_t d, int64_t vocab,
                        void* stream) {
  check_count("embedding_backward", "n", n);
  check_width("embedding_backward", "d", d);
  check_width("embedding_backward", "vocab", vocab);
  FLASHLM_CHECK(n <= INT_MAX, "embedding_backward: n = {} is too large", n);
  FLASHLM_CHECK(ceil_div(d, kEmbThreads) <= kMaxGridY, "embedding_backward: d = {} is too large", d);
  if (n == 0) return;
  const cudaStream_t s = as_stream(stream);

  // Workspace: keys and rows before and after the sort, then the radix sort's own storage.
  const int end_bit = std::bit_width(uint32_t(vocab));  // every key (at most vocab) fits in end_bit bits
  size_t sort_bytes = 0;
  FLASHLM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr),
                                                     static_cast<uint32_t*>(nullptr),
                                                     static_cast<const int32_t*>(nullptr),
                                                     static_cast<int32_t*>(nullptr), int(n), 0, end_bit, s),
                     "embedding_backward: radix sort size query");
  const size_t array_bytes = (size_t(n) * 4 + 255) / 256 * 256;
  Buffer scratch = Buffer::allocate_on_stream(4 * array_bytes + sort_bytes, "embedding_backward sort", stream);
  char* base = static_cast<char*>(scratch.data());
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(base);
  uint32_t* keys = reinterpret_cast<uint32_t*>(base + array_bytes);
  int32_t* rows_in = reinterpret_cast<int32_t*>(base + 2 * array_bytes);
  int32_t* rows = reinterpret_cast<int32_t*>(base + 3 * array_bytes);
  void* sort_storage = base + 4 * array_bytes;

  embedding_keys_kernel<<<elementwise_blocks(n), kThreads, 0, s>>>(tokens, n, vocab, keys_in, rows_in);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "embedding_keys_kernel");
  FLASHLM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_storage, sort_bytes, keys_in, keys, rows_in, rows, int(n),
                                                     0, end_bit, s),
                     "embedding_backward: radix sort");
  const dim3 grid(unsigned(ceil_div(n, kEmbPositions)), unsigned(ceil_div(d, kEmbThreads)));
  embedding_backward_kernel<<<grid, kEmbThreads, 0, s>>>(dev(dx), keys, rows, dtable, n, d, vocab);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "embedding_backward_kernel");
}

template <class T>
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, T* param_copy, void* stream, float grad_scale) {
  check_count("adamw_step", "n", n);
  FLASHLM_CHECK(step >= 1, "adamw_step: step = {}, expected >= 1 (1-based)", step);
  if (n == 0) return;
  // CpuModel::adamw_step's scalars, computed the same way.
  const double t = double(step);
  const float alpha = float(lr * std::sqrt(1.0 - std::pow(beta2, t)) / (1.0 - std::pow(beta1, t)));
  const float b1 = float(beta1), b2 = float(beta2), e = float(eps), decay = float(lr * weight_decay);
  const AdamWScalars a{alpha, b1, 1 - b1, b2, 1 - b2, e, decay, grad_scale};
  const cudaStream_t s = as_stream(stream);
  const bool vector = aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v);
  const int64_t n4 = vector ? n / 4 : 0;
  if (n4 > 0) {
    adamw_kernel_x4<<<elementwise_blocks(n4), kThreads, 0, s>>>(
        reinterpret_cast<float4*>(param), reinterpret_cast<const float4*>(grad), reinterpret_cast<float4*>(m),
        reinterpret_cast<float4*>(v), n4, a, dev(param_copy));
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_kernel_x4");
  }
  if (4 * n4 < n) {
    adamw_kernel<<<elementwise_blocks(n - 4 * n4), kThreads, 0, s>>>(param, grad, m, v, 4 * n4, n, a, dev(param_copy));
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_kernel");
  }
}

void squared_norm(const float* x, int64_t n, double* out, void* stream) {
  check_count("squared_norm", "n", n);
  reduce<SquareOp>(x, n, out, as_stream(stream), "squared_norm");
}

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

template <class T>
void add_inplace(T* y, const T* x, int64_t n, void* stream) {
  check_count("add_inplace", "n", n);
  if (n == 0) return;
  const int64_t packs = pack_count(n, y, x);
  add_kernel<<<packed_blocks(n, packs), kThreads, 0, as_stream(stream)>>>(dev(y), dev(x), n, packs);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "add_kernel");
}

void memset_async(void* dst, int value, size_t bytes, void* stream) {
  if (bytes == 0) return;
  FLASHLM_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, as_stream(stream)), "memset_async: cudaMemsetAsync");
}

void stream_synchronize(void* stream) {
  FLASHLM_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)), "stream_synchronize: cudaStreamSynchronize");
}

// ---------------------------------------------------------------------------------------------------
// Instantiations for the three activation types.

#define FLASHLM_OPS_CUDA_INSTANTIATE(T)                                                                              \
  template void rmsnorm_forward<T>(const T*, const float*, T*, float*, int64_t, int64_t, float, void*);             \
  template void rmsnorm_backward<T>(const T*, const T*, const float*, const float*, T*, float*, int64_t, int64_t,    \
                                    void*);                                                                          \
  template void rope_forward<T>(T*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, void*);          \
  template void rope_backward<T>(T*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, void*);         \
  template void swiglu_forward<T>(const T*, const T*, T*, int64_t, void*);                                           \
  template void swiglu_backward<T>(const T*, const T*, const T*, T*, T*, int64_t, void*);                            \
  template void cross_entropy_forward<T>(const T*, const int32_t*, float*, int64_t, int64_t, void*);                 \
  template void cross_entropy_backward<T>(T*, const int32_t*, int64_t, int64_t, float, void*);                       \
  template void embedding_forward<T>(const float*, const int32_t*, T*, int64_t, int64_t, int64_t, void*);            \
  template void embedding_backward<T>(const T*, const int32_t*, float*, int64_t, int64_t, int64_t, void*);           \
  template void adamw_step<T>(float*, const float*, float*, float*, int64_t, double, double, double, double, double, \
                              int64_t, T*, void*, float);                                                            \
  template void count_nonfinite<T>(const T*, int64_t, int*, void*);                                                  \
  template void cast_from_f32<T>(const float*, T*, int64_t, void*);                                                  \
  template void cast_to_f32<T>(const T*, float*, int64_t, void*);                                                    \
  template void add_inplace<T>(T*, const T*, int64_t, void*);

FLASHLM_OPS_CUDA_INSTANTIATE(float)
FLASHLM_OPS_CUDA_INSTANTIATE(bf16_t)
FLASHLM_OPS_CUDA_INSTANTIATE(fp16_t)

#undef FLASHLM_OPS_CUDA_INSTANTIATE

}  // namespace flashlm::gpu
