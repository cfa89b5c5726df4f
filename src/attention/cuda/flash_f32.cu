// FlashAttention-2 for fp32 inputs on CUDA cores: plain FFMA, fp32 throughout, the algorithm and
// semantics of flash_cpu.cpp.
//
// Every kernel works on shared-memory tiles whose head_dim rows are padded by 4 floats, so the 16 rows a
// half-warp reads at once fall in different banks. The threads of a block form 16 columns × (rows / R):
// a thread owns R consecutive rows of a tile and the columns tx, tx + 16, ... of the score tile, so the 16
// threads sharing a row are one half-warp and reduce with shuffles. Products with the head dimension
// (P·V, dS·K, Pᵀ·dO, dSᵀ·Q) give the thread the same R rows and D/16 columns of the result in registers.
//
// Forward: one block per (batch, query head, query tile). K and V tiles stream through shared memory by
// cp.async: the V tile loads while the scores are computed, the next K tile while P·V runs.
//
// Backward (deterministic, no atomics), as flash_cpu.cpp: Delta = rowsum(dO ∘ O); one block per (batch,
// key head, key tile) accumulates dK and dV over every query head of its GQA group; one block per (batch,
// query head, query tile) accumulates dQ. Both recompute P = exp(S - lse) from the forward's lse.
//
// The tile sizes keep every kernel under 99 KB of shared memory, the opt-in limit of sm_86 and sm_89, so
// one instantiation per head dim serves every architecture flashlm builds for.
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numbers>
#include <string>
#include <type_traits>

#include "attention/backends.h"
#include "attention/capabilities.h"
#include "attention/cuda/flash_common.cuh"
#include "core/check.h"
#include "core/cuda_check.h"
#include "core/softmax_stats.cuh"
#include "flashlm/memory.h"

namespace flashlm {

namespace {

constexpr int kTX = 16;   // threads along a tile row: one half-warp
constexpr int kPad = 4;   // floats of padding after each head_dim row in shared memory
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLn2 = std::numbers::ln2_v<float>;

using flash_cuda::cp_async_wait_all;
using flash_cuda::kLog2e;
using flash_cuda::load_tile_async;
using flash_cuda::row_strides;
using flash_cuda::RowStrides;

struct Shape {
  int batch, seq_q, seq_k, heads_q, heads_k, group;
  bool causal;
  long long causal_offset;
  float scale;
  float scale_log2;  // scale · log2(e): scores go straight into exp2f

  // AttentionProblem::visible_keys: query i sees keys [0, visible_keys(i)).
  __device__ int visible_keys(int i) const {
    if (!causal) return seq_k;
    const long long n = i + causal_offset + 1;
    return n < 0 ? 0 : (n > seq_k ? seq_k : static_cast<int>(n));
  }
  // AttentionProblem::first_query_seeing, capped at seq_q.
  __device__ int first_query_seeing(int j) const {
    if (!causal) return 0;
    const long long i = j - causal_offset;
    return i < 0 ? 0 : (i > seq_q ? seq_q : static_cast<int>(i));
  }
};

struct ForwardArgs {
  Shape shape;
  const float *q, *k, *v;
  float *o, *lse;
  RowStrides qs, ks, vs, os, ls;
};

struct DeltaArgs {
  const float *o, *dout;
  float* delta;
  RowStrides os, dos;
  long long rows;  // batch · heads_q · seq_q
  int seq_q, heads_q, head_dim;
};

struct BackwardArgs {
  Shape shape;
  const float *q, *k, *v, *dout, *lse, *delta;
  float *dq, *dk, *dv;
  RowStrides qs, ks, vs, dos, ls, dqs, dks, dvs;
};

// ---------------------------------------------------------------------------------------------------
// Device building blocks

// The shared-memory layout of a tile for load_tile_async: rows of D floats, each followed by kPad floats.
template <int D>
struct PaddedRows {
  __device__ __forceinline__ static int offset(int row, int chunk) { return row * (D + kPad) + chunk * 4; }
};

// Starts copying rows [0, rows) of a ROWS × D tile (row r at src + r·row_stride) into shared memory
// rows of D + kPad floats and zero-fills rows [rows, ROWS): rows past the end of a sequence then add
// exact zeros to every product instead of stale values.
template <int D, int ROWS, int NT>
__device__ __forceinline__ void load_padded_tile_async(float* dst, const float* src, int64_t row_stride, int rows) {
  static_assert(NT % (D / 4) == 0 && ROWS * (D / 4) % NT == 0, "every thread copies whole passes");
  load_tile_async<ROWS, D, NT, PaddedRows<D>>(dst, src, row_stride, 0, rows, static_cast<int>(threadIdx.x));
}

// The 16 threads of a row are lanes 0-15 or 16-31 of a warp.
__device__ __forceinline__ float row_max(float x) {
#pragma unroll
  for (int o = kTX / 2; o > 0; o /= 2) x = max_propagating_nan(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
  for (int o = kTX / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// acc[i][j] += A[a0 + i] · B[b0 + 16 j] over D: A and B are shared-memory tiles of (D + kPad)-float rows.
// A's rows are common to a half-warp (broadcast); B's 16 rows per step are in distinct banks.
template <int D, int R, int C, int UNROLL>
__device__ __forceinline__ void accumulate_dots(const float* A, int a0, const float* B, int b0,
                                                float (&acc)[R][C]) {
  constexpr int kLd = D + kPad;
#pragma unroll UNROLL
  for (int d = 0; d < D; d += 4) {
    float4 a[R], b[C];
#pragma unroll
    for (int i = 0; i < R; ++i) a[i] = *reinterpret_cast<const float4*>(A + (a0 + i) * kLd + d);
#pragma unroll
    for (int j = 0; j < C; ++j) b[j] = *reinterpret_cast<const float4*>(B + (b0 + kTX * j) * kLd + d);
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
      for (int j = 0; j < C; ++j) {
        acc[i][j] = fmaf(a[i].x, b[j].x, acc[i][j]);
        acc[i][j] = fmaf(a[i].y, b[j].y, acc[i][j]);
        acc[i][j] = fmaf(a[i].z, b[j].z, acc[i][j]);
        acc[i][j] = fmaf(a[i].w, b[j].w, acc[i][j]);
      }
    }
  }
}

// Floats per vector access along head_dim. A thread's D/16 columns of a head_dim row are
// tx·VEC + 16·VEC·jj + x (jj < D/(16·VEC), x < VEC), kept in acc[jj·VEC + x]: a half-warp then reads and
// writes 16·VEC consecutive floats at a time.
constexpr int vec_width(int d) { return d / kTX < 4 ? d / kTX : 4; }

template <int VEC>
__device__ __forceinline__ void load_vec(const float* src, float (&v)[VEC]) {
  if constexpr (VEC == 4) {
    const float4 t = *reinterpret_cast<const float4*>(src);
    v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
  } else if constexpr (VEC == 2) {
    const float2 t = *reinterpret_cast<const float2*>(src);
    v[0] = t.x, v[1] = t.y;
  } else {
    v[0] = *src;
  }
}

// acc[i][·] += Σ_{k < K} P[p0 + i][k] · V[k][this thread's columns]: P has rows of PLD floats, V rows of
// D + kPad floats (V's row k is read by the whole warp at once, so reads are contiguous).
template <int D, int R, int K, int PLD, int UNROLL>
__device__ __forceinline__ void accumulate_rows(const float* P, int p0, const float* V, int tx,
                                                float (&acc)[R][D / kTX]) {
  constexpr int kLd = D + kPad, VEC = vec_width(D), NV = D / kTX / VEC;
#pragma unroll UNROLL
  for (int k = 0; k < K; k += 4) {
    float p[R][4];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float4 t = *reinterpret_cast<const float4*>(P + (p0 + i) * PLD + k);
      p[i][0] = t.x, p[i][1] = t.y, p[i][2] = t.z, p[i][3] = t.w;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float* row = V + (k + e) * kLd + tx * VEC;
#pragma unroll
      for (int jj = 0; jj < NV; ++jj) {
        float v[VEC];
        load_vec<VEC>(row + jj * kTX * VEC, v);
#pragma unroll
        for (int i = 0; i < R; ++i) {
#pragma unroll
          for (int x = 0; x < VEC; ++x) acc[i][jj * VEC + x] = fmaf(p[i][e], v[x], acc[i][jj * VEC + x]);
        }
      }
    }
  }
}

// Writes a thread's D/16 columns of one global head_dim row, times factor.
template <int D>
__device__ __forceinline__ void store_row(float* dst, int tx, const float (&acc)[D / kTX], float factor) {
  constexpr int VEC = vec_width(D);
#pragma unroll
  for (int jj = 0; jj < D / kTX / VEC; ++jj) {
    float* p = dst + tx * VEC + jj * kTX * VEC;
    const float* a = acc + jj * VEC;
    if constexpr (VEC == 4) {
      *reinterpret_cast<float4*>(p) = make_float4(a[0] * factor, a[1] * factor, a[2] * factor, a[3] * factor);
    } else if constexpr (VEC == 2) {
      *reinterpret_cast<float2*>(p) = make_float2(a[0] * factor, a[1] * factor);
    } else {
      *p = a[0] * factor;
    }
  }
}

// Row stride of a score tile with `cols` columns whose rows are split R per thread: the two row groups of
// a warp are R rows apart, and R · (cols + 16/R) ≡ 16 (mod 32) puts them 16 banks apart.
template <int R, int COLS>
constexpr int score_ld() {
  static_assert(R * COLS % 32 == 0, "the padding below assumes R·cols is a multiple of 32 banks");
  return COLS + 16 / R;
}

// Blocks per SM the register budget must admit (128 registers a thread at 256 threads, 168 at 128): about
// as many as the 32-87 KB of shared memory of these kernels admits on sm_90.
constexpr int min_blocks(int threads) { return threads >= 256 ? 2 : 3; }

// ---------------------------------------------------------------------------------------------------
// Forward

// BQ queries per block and R per thread; key tiles of BK.
template <int D_, int BQ_, int BK_, int R_, int DOT_UNROLL, int ROW_UNROLL>
struct ForwardTiles {
  static constexpr int D = D_, BQ = BQ_, BK = BK_, R = R_;
  static constexpr int kThreads = BQ / R * kTX;
  static constexpr int kMinBlocks = min_blocks(kThreads);
  static constexpr int kDotUnroll = DOT_UNROLL, kRowUnroll = ROW_UNROLL;
  static constexpr int kLd = D + kPad;
  static constexpr int kPld = score_ld<R, BK>();
  static constexpr size_t kSmem = sizeof(float) * (size_t{BQ + 2 * BK} * kLd + size_t{BQ} * kPld);
};

template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocks) forward_kernel(const ForwardArgs a) {
  constexpr int D = T::D, BQ = T::BQ, BK = T::BK, R = T::R, NT = T::kThreads;
  constexpr int C = BK / kTX, CD = D / kTX;
  extern __shared__ float4 smem_vec[];
  float* Qs = reinterpret_cast<float*>(smem_vec);
  float* Ks = Qs + BQ * T::kLd;
  float* Vs = Ks + BK * T::kLd;
  float* Ps = Vs + BK * T::kLd;

  const Shape& s = a.shape;
  const int heads = s.batch * s.heads_q;
  const int q_tiles = (s.seq_q + BQ - 1) / BQ;
  const int bh = static_cast<int>(blockIdx.x) % heads;
  // Blocks start roughly in launch order, and under a causal mask the last query tiles see the most
  // keys: launch them first so that the short ones fill the tail.
  const int i0 = (q_tiles - 1 - static_cast<int>(blockIdx.x) / heads) * BQ;
  const int b = bh / s.heads_q, h = bh % s.heads_q, hk = h / s.group;
  const int rows = min(BQ, s.seq_q - i0);
  const int tx = static_cast<int>(threadIdx.x) % kTX, r0 = static_cast<int>(threadIdx.x) / kTX * R;

  const float* q = a.q + b * a.qs.b + i0 * a.qs.s + h * a.qs.h;
  const float* k = a.k + b * a.ks.b + hk * a.ks.h;
  const float* v = a.v + b * a.vs.b + hk * a.vs.h;

  const int key_end = s.visible_keys(i0 + rows - 1);  // the tile's last query sees the most keys
  const int n_tiles = (key_end + BK - 1) / BK;
  const int unmasked_end = s.visible_keys(i0);  // every query of the tile sees the keys before this

  float acc[R][CD] = {};
  float m[R], l[R];  // running max (log2 domain) and this thread's part of the running sum
#pragma unroll
  for (int i = 0; i < R; ++i) m[i] = kNegInf, l[i] = 0.f;

  if (n_tiles > 0) {
    load_padded_tile_async<D, BQ, NT>(Qs, q, a.qs.s, rows);
    load_padded_tile_async<D, BK, NT>(Ks, k, a.ks.s, min(BK, s.seq_k));
  }
  for (int t = 0; t < n_tiles; ++t) {
    const int j0 = t * BK;
    cp_async_wait_all();
    __syncthreads();  // K tile t is in place; nobody reads the previous V tile or P any more
    load_padded_tile_async<D, BK, NT>(Vs, v + j0 * a.vs.s, a.vs.s, min(BK, s.seq_k - j0));

    float sc[R][C] = {};
    accumulate_dots<D, R, C, T::kDotUnroll>(Qs, r0, Ks, tx, sc);
    const bool masked_tile = j0 + BK > unmasked_end;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int visible = masked_tile ? s.visible_keys(i0 + r0 + i) : s.seq_k;
      float mx = m[i];
#pragma unroll
      for (int j = 0; j < C; ++j) {
        sc[i][j] = j0 + tx + kTX * j >= visible ? kNegInf : sc[i][j] * s.scale_log2;
        mx = max_propagating_nan(mx, sc[i][j]);
      }
      mx = row_max(mx);
      // A row that has seen no key yet keeps m = -inf; subtracting 0 then keeps every exp2f at 0, not NaN.
      const float m_ref = mx == kNegInf ? 0.f : mx;
      const float alpha = exp2f(m[i] - m_ref);
      m[i] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < C; ++j) {
        const float p = exp2f(sc[i][j] - m_ref);
        sum += p;
        Ps[(r0 + i) * T::kPld + tx + kTX * j] = p;
      }
      l[i] = l[i] * alpha + sum;
#pragma unroll
      for (int c = 0; c < CD; ++c) acc[i][c] *= alpha;
    }
    cp_async_wait_all();
    __syncthreads();  // V tile t and P are in place; nobody reads K tile t any more
    if (t + 1 < n_tiles) {
      load_padded_tile_async<D, BK, NT>(Ks, k + (j0 + BK) * a.ks.s, a.ks.s, min(BK, s.seq_k - j0 - BK));
    }
    accumulate_rows<D, R, BK, T::kPld, T::kRowUnroll>(Ps, r0, Vs, tx, acc);
  }

#pragma unroll
  for (int i = 0; i < R; ++i) {
    const float sum = row_sum(l[i]);
    const int r = r0 + i;
    if (r < rows) {
      // sum = 0: no key seen; NaN: a NaN reached the row (O and lse NaN, as in the fp16/bf16 kernel).
      store_row<D>(a.o + b * a.os.b + (i0 + r) * a.os.s + h * a.os.h, tx, acc[i], sum != 0.f ? 1.f / sum : 0.f);
      if (tx == 0) {
        a.lse[b * a.ls.b + h * a.ls.h + (i0 + r) * a.ls.s] = sum != 0.f ? m[i] * kLn2 + logf(sum) : kNegInf;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Backward

// Delta_i = rowsum(dO_i ∘ O_i): one warp per query row.
constexpr int kDeltaWarps = 8;

__global__ void __launch_bounds__(kDeltaWarps * 32) delta_kernel(const DeltaArgs a) {
  const long long row = static_cast<long long>(blockIdx.x) * kDeltaWarps + threadIdx.x / 32;
  if (row >= a.rows) return;  // the whole warp leaves together
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const long long i = row % a.seq_q, bh = row / a.seq_q;
  const long long b = bh / a.heads_q, h = bh % a.heads_q;
  const float* o = a.o + b * a.os.b + i * a.os.s + h * a.os.h;
  const float* dout = a.dout + b * a.dos.b + i * a.dos.s + h * a.dos.h;
  float sum = 0.f;
  for (int c = lane * 4; c < a.head_dim; c += 32 * 4) {
    const float4 x = *reinterpret_cast<const float4*>(o + c), y = *reinterpret_cast<const float4*>(dout + c);
    sum += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) a.delta[row] = sum;
}

// dK/dV: BK keys per block and R per thread; query tiles of BQ. Score tiles are kept transposed (keys ×
// queries) so that Pᵀ·dO and dSᵀ·Q read them row by row.
template <int D_, int BQ_, int BK_, int R_, int DOT_UNROLL, int ROW_UNROLL>
struct KeyTiles {
  static constexpr int D = D_, BQ = BQ_, BK = BK_, R = R_;
  static constexpr int kThreads = BK / R * kTX;
  static constexpr int kMinBlocks = min_blocks(kThreads);
  static constexpr int kDotUnroll = DOT_UNROLL, kRowUnroll = ROW_UNROLL;
  static constexpr int kLd = D + kPad;
  static constexpr int kTld = score_ld<R, BQ>();
  static constexpr size_t kSmem =
      sizeof(float) * (size_t{2 * BK + 2 * BQ} * kLd + size_t{2 * BK} * kTld + size_t{2 * BQ});
};

template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocks) dkdv_kernel(const BackwardArgs a) {
  constexpr int D = T::D, BQ = T::BQ, BK = T::BK, R = T::R, NT = T::kThreads;
  constexpr int C = BQ / kTX, CD = D / kTX;
  static_assert(NT >= BQ, "one thread per query row loads lse and Delta");
  extern __shared__ float4 smem_vec[];
  float* Ks = reinterpret_cast<float*>(smem_vec);
  float* Vs = Ks + BK * T::kLd;
  float* Qs = Vs + BK * T::kLd;
  float* dOs = Qs + BQ * T::kLd;
  float* Pt = dOs + BQ * T::kLd;  // Pᵀ: keys × queries
  float* dSt = Pt + BK * T::kTld;
  float* lse_s = dSt + BK * T::kTld;  // log2 domain, -inf for queries that see nothing
  float* delta_s = lse_s + BQ;

  const Shape& s = a.shape;
  const int kv_heads = s.batch * s.heads_k;
  const int bhk = static_cast<int>(blockIdx.x) % kv_heads;
  // Under a causal mask the first key tiles are seen by the most queries: launch them first.
  const int j0 = static_cast<int>(blockIdx.x) / kv_heads * BK;
  const int b = bhk / s.heads_k, hk = bhk % s.heads_k;
  const int cols = min(BK, s.seq_k - j0);
  const int tx = static_cast<int>(threadIdx.x) % kTX, c0 = static_cast<int>(threadIdx.x) / kTX * R;
  const int first_q = s.first_query_seeing(j0);  // earlier queries see none of the tile's keys

  float dk[R][CD] = {}, dv[R][CD] = {};
  if (s.group > 0 && first_q < s.seq_q) {
    load_padded_tile_async<D, BK, NT>(Ks, a.k + b * a.ks.b + j0 * a.ks.s + hk * a.ks.h, a.ks.s, cols);
    load_padded_tile_async<D, BK, NT>(Vs, a.v + b * a.vs.b + j0 * a.vs.s + hk * a.vs.h, a.vs.s, cols);
  }
  for (int h = hk * s.group; h < (hk + 1) * s.group; ++h) {
    const float* q = a.q + b * a.qs.b + h * a.qs.h;
    const float* dout = a.dout + b * a.dos.b + h * a.dos.h;
    const float* lse = a.lse + b * a.ls.b + h * a.ls.h;
    const float* delta = a.delta + (static_cast<long long>(b) * s.heads_q + h) * s.seq_q;
    for (int i0 = first_q; i0 < s.seq_q; i0 += BQ) {
      const int rows = min(BQ, s.seq_q - i0);
      __syncthreads();  // nobody reads the previous query tile, P or dS any more
      load_padded_tile_async<D, BQ, NT>(Qs, q + i0 * a.qs.s, a.qs.s, rows);
      load_padded_tile_async<D, BQ, NT>(dOs, dout + i0 * a.dos.s, a.dos.s, rows);
      if (threadIdx.x < BQ) {
        const int r = static_cast<int>(threadIdx.x);
        // Rows past the end act as queries that see nothing, so their P and dS are 0.
        lse_s[r] = r < rows ? lse[(i0 + r) * a.ls.s] * kLog2e : kNegInf;
        delta_s[r] = r < rows ? delta[i0 + r] : 0.f;
      }
      cp_async_wait_all();
      __syncthreads();  // Q, dO, lse and Delta of the tile (and K, V the first time) are in place

      float st[R][C] = {}, dpt[R][C] = {};
      accumulate_dots<D, R, C, T::kDotUnroll>(Ks, c0, Qs, tx, st);    // Sᵀ
      accumulate_dots<D, R, C, T::kDotUnroll>(Vs, c0, dOs, tx, dpt);  // (dO Vᵀ)ᵀ
      const bool masked_tile = j0 + BK > s.visible_keys(i0);
#pragma unroll
      for (int j = 0; j < C; ++j) {
        const int r = tx + kTX * j;
        const float lse2 = lse_s[r], dlt = delta_s[r];
        const int visible = masked_tile ? s.visible_keys(i0 + r) : s.seq_k;
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const int c = c0 + i;
          const float p = lse2 == kNegInf || j0 + c >= visible ? 0.f : exp2f(st[i][j] * s.scale_log2 - lse2);
          Pt[c * T::kTld + r] = p;
          dSt[c * T::kTld + r] = p * (dpt[i][j] - dlt);
        }
      }
      __syncthreads();  // Pᵀ and dSᵀ are in place
      accumulate_rows<D, R, BQ, T::kTld, T::kRowUnroll>(Pt, c0, dOs, tx, dv);
      accumulate_rows<D, R, BQ, T::kTld, T::kRowUnroll>(dSt, c0, Qs, tx, dk);
    }
  }

#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int c = c0 + i;
    if (c < cols) {
      store_row<D>(a.dk + b * a.dks.b + (j0 + c) * a.dks.s + hk * a.dks.h, tx, dk[i], s.scale);
      store_row<D>(a.dv + b * a.dvs.b + (j0 + c) * a.dvs.s + hk * a.dvs.h, tx, dv[i], 1.f);
    }
  }
}

// dQ: BQ queries per block and R per thread; key tiles of BK.
template <int D_, int BQ_, int BK_, int R_, int DOT_UNROLL, int ROW_UNROLL>
struct QueryTiles {
  static constexpr int D = D_, BQ = BQ_, BK = BK_, R = R_;
  static constexpr int kThreads = BQ / R * kTX;
  static constexpr int kMinBlocks = min_blocks(kThreads);
  static constexpr int kDotUnroll = DOT_UNROLL, kRowUnroll = ROW_UNROLL;
  static constexpr int kLd = D + kPad;
  static constexpr int kSld = score_ld<R, BK>();
  static constexpr size_t kSmem = sizeof(float) * (size_t{2 * BQ + 2 * BK} * kLd + size_t{BQ} * kSld);
};

template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocks) dq_kernel(const BackwardArgs a) {
  constexpr int D = T::D, BQ = T::BQ, BK = T::BK, R = T::R, NT = T::kThreads;
  constexpr int C = BK / kTX, CD = D / kTX;
  extern __shared__ float4 smem_vec[];
  float* Qs = reinterpret_cast<float*>(smem_vec);
  float* dOs = Qs + BQ * T::kLd;
  float* Ks = dOs + BQ * T::kLd;
  float* Vs = Ks + BK * T::kLd;
  float* dSs = Vs + BK * T::kLd;

  const Shape& s = a.shape;
  const int heads = s.batch * s.heads_q;
  const int q_tiles = (s.seq_q + BQ - 1) / BQ;
  const int bh = static_cast<int>(blockIdx.x) % heads;
  const int i0 = (q_tiles - 1 - static_cast<int>(blockIdx.x) / heads) * BQ;  // longest tiles first, as forward
  const int b = bh / s.heads_q, h = bh % s.heads_q, hk = h / s.group;
  const int rows = min(BQ, s.seq_q - i0);
  const int tx = static_cast<int>(threadIdx.x) % kTX, r0 = static_cast<int>(threadIdx.x) / kTX * R;

  const float* k = a.k + b * a.ks.b + hk * a.ks.h;
  const float* v = a.v + b * a.vs.b + hk * a.vs.h;

  const int key_end = s.visible_keys(i0 + rows - 1);
  const int n_tiles = (key_end + BK - 1) / BK;
  const int unmasked_end = s.visible_keys(i0);
  float lse2[R], dlt[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = r0 + i;
    // Rows past the end act as queries that see nothing, so their dS is 0.
    lse2[i] = r < rows ? a.lse[b * a.ls.b + h * a.ls.h + (i0 + r) * a.ls.s] * kLog2e : kNegInf;
    dlt[i] = r < rows ? a.delta[(static_cast<long long>(b) * s.heads_q + h) * s.seq_q + i0 + r] : 0.f;
  }

  float dq[R][CD] = {};
  if (n_tiles > 0) {
    load_padded_tile_async<D, BQ, NT>(Qs, a.q + b * a.qs.b + i0 * a.qs.s + h * a.qs.h, a.qs.s, rows);
    load_padded_tile_async<D, BQ, NT>(dOs, a.dout + b * a.dos.b + i0 * a.dos.s + h * a.dos.h, a.dos.s, rows);
    load_padded_tile_async<D, BK, NT>(Ks, k, a.ks.s, min(BK, s.seq_k));
    load_padded_tile_async<D, BK, NT>(Vs, v, a.vs.s, min(BK, s.seq_k));
  }
  for (int t = 0; t < n_tiles; ++t) {
    const int j0 = t * BK;
    cp_async_wait_all();
    __syncthreads();  // K and V tile t are in place

    float sc[R][C] = {}, dp[R][C] = {};
    accumulate_dots<D, R, C, T::kDotUnroll>(Qs, r0, Ks, tx, sc);
    accumulate_dots<D, R, C, T::kDotUnroll>(dOs, r0, Vs, tx, dp);
    const bool masked_tile = j0 + BK > unmasked_end;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int visible = masked_tile ? s.visible_keys(i0 + r0 + i) : s.seq_k;
#pragma unroll
      for (int j = 0; j < C; ++j) {
        const int c = tx + kTX * j;
        const bool hidden = lse2[i] == kNegInf || j0 + c >= visible;
        const float p = hidden ? 0.f : exp2f(sc[i][j] * s.scale_log2 - lse2[i]);
        dSs[(r0 + i) * T::kSld + c] = p * (dp[i][j] - dlt[i]);
      }
    }
    __syncthreads();  // dS is in place; nobody reads V tile t any more
    if (t + 1 < n_tiles) {
      load_padded_tile_async<D, BK, NT>(Vs, v + (j0 + BK) * a.vs.s, a.vs.s, min(BK, s.seq_k - j0 - BK));
    }
    accumulate_rows<D, R, BK, T::kSld, T::kRowUnroll>(dSs, r0, Ks, tx, dq);
    __syncthreads();  // nobody reads K tile t or dS any more
    if (t + 1 < n_tiles) {
      load_padded_tile_async<D, BK, NT>(Ks, k + (j0 + BK) * a.ks.s, a.ks.s, min(BK, s.seq_k - j0 - BK));
    }
  }

#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = r0 + i;
    if (r < rows) store_row<D>(a.dq + b * a.dqs.b + (i0 + r) * a.dqs.s + h * a.dqs.h, tx, dq[i], s.scale);
  }
}

// ---------------------------------------------------------------------------------------------------
// Host side

// Tiles per head dim: <head dim, query tile, key tile, rows per thread, unroll of the loop over head_dim in
// accumulate_dots, unroll of the loop over tile columns in accumulate_rows>. Larger head dims take smaller
// tiles, as the shared tiles grow with D and the per-thread accumulators with D/16. Unrolling by 4 and 2
// was the fastest of the unrolls tried (docs/perf.md); dQ at D = 16 unrolls less because ptxas
// spills there otherwise.
template <int D>
struct Config;
template <>
struct Config<16> {
  using Forward = ForwardTiles<16, 64, 64, 4, 4, 2>;
  using Keys = KeyTiles<16, 64, 64, 4, 4, 2>;
  using Queries = QueryTiles<16, 64, 64, 4, 2, 2>;
};
template <>
struct Config<32> {
  using Forward = ForwardTiles<32, 64, 64, 4, 4, 2>;
  using Keys = KeyTiles<32, 64, 64, 4, 4, 2>;
  using Queries = QueryTiles<32, 64, 64, 4, 4, 2>;
};
template <>
struct Config<64> {
  using Forward = ForwardTiles<64, 64, 64, 4, 4, 2>;
  using Keys = KeyTiles<64, 32, 64, 4, 4, 2>;
  using Queries = QueryTiles<64, 64, 64, 4, 4, 2>;
};
template <>
struct Config<128> {
  using Forward = ForwardTiles<128, 64, 32, 4, 4, 2>;
  using Keys = KeyTiles<128, 32, 32, 4, 4, 2>;
  using Queries = QueryTiles<128, 32, 32, 4, 4, 2>;
};
template <>
struct Config<256> {
  using Forward = ForwardTiles<256, 32, 16, 4, 4, 2>;
  using Keys = KeyTiles<256, 16, 16, 2, 4, 2>;
  using Queries = QueryTiles<256, 16, 16, 2, 4, 2>;
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A [B, H, S] logsumexp view's strides in the (b, s, h) slots.
RowStrides lse_strides_of(const TensorView& lse) { return {lse.stride(0), lse.stride(2), lse.stride(1)}; }

Shape shape_of(const AttentionProblem& p) {
  constexpr int64_t kMax = INT_MAX / 2;  // tile arithmetic on sequence positions stays in 32 bits
  FLASHLM_CHECK(p.seq_q <= kMax && p.seq_k <= kMax && p.batch * p.heads_q <= kMax,
                "flash_f32: seq_q {}, seq_k {} or batch·heads {} exceed the kernels' 32-bit indexing", p.seq_q,
                p.seq_k, p.batch * p.heads_q);
  Shape s{};
  s.batch = static_cast<int>(p.batch);
  s.seq_q = static_cast<int>(p.seq_q);
  s.seq_k = static_cast<int>(p.seq_k);
  s.heads_q = static_cast<int>(p.heads_q);
  s.heads_k = static_cast<int>(p.heads_k);
  s.group = static_cast<int>(p.group());
  s.causal = p.causal;
  s.causal_offset = p.causal_offset;
  s.scale = static_cast<float>(p.scale);
  s.scale_log2 = static_cast<float>(p.scale * std::numbers::log2e);
  return s;
}

template <class Args>
void launch(void (*kernel)(Args), int64_t blocks, int threads, size_t smem, cudaStream_t stream, const Args& args,
            const char* what) {
  if (blocks == 0) return;
  FLASHLM_CHECK(blocks <= INT_MAX, "{}: {} thread blocks exceed the grid limit", what, blocks);
  if (smem > 48 * 1024) {
    FLASHLM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
        std::string(what) + ": raising the dynamic shared memory limit to " + std::to_string(smem) + " bytes");
  }
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(args);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), what);
}

template <class Fn>
void dispatch_head_dim(int64_t head_dim, Fn&& fn) {
  FLASHLM_CHECK(with_head_dim<kF32HeadDims>(head_dim, fn),
                "flash_f32: head_dim {} has no kernel (the capability table lists it)", head_dim);
}

}  // namespace

void flash_attention_forward_cuda_f32(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& o, const TensorView& lse, void* stream) {
  const ForwardArgs a{shape_of(p),    q.ptr<const float>(), k.ptr<const float>(), v.ptr<const float>(),
                      o.ptr<float>(), lse.ptr<float>(),     row_strides(q),       row_strides(k),
                      row_strides(v), row_strides(o),       lse_strides_of(lse)};
  dispatch_head_dim(p.head_dim, [&](auto d) {
    using T = typename Config<decltype(d)::value>::Forward;
    launch(forward_kernel<T>, ceil_div(p.seq_q, T::BQ) * p.batch * p.heads_q, T::kThreads, T::kSmem,
           static_cast<cudaStream_t>(stream), a, "flash_f32: forward_kernel");
  });
}

void flash_attention_backward_cuda_f32(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                       const TensorView& v, const TensorView& o, const TensorView& lse,
                                       const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                       const TensorView& dv, void* stream) {
  const auto cu_stream = static_cast<cudaStream_t>(stream);
  const Shape shape = shape_of(p);
  const int64_t rows = p.batch * p.heads_q * p.seq_q;
  // Stream-ordered: freed on the same stream after the kernels that read it, without a host sync.
  Buffer delta = Buffer::allocate_on_stream(static_cast<size_t>(rows) * sizeof(float), "flash f32 Delta", stream);
  const DeltaArgs da{o.ptr<const float>(), dout.ptr<const float>(), static_cast<float*>(delta.data()),
                     row_strides(o),       row_strides(dout),       rows,
                     shape.seq_q,          shape.heads_q,           static_cast<int>(p.head_dim)};
  launch(delta_kernel, ceil_div(rows, kDeltaWarps), kDeltaWarps * 32, 0, cu_stream, da, "flash_f32: delta_kernel");

  const BackwardArgs a{shape,
                       q.ptr<const float>(),
                       k.ptr<const float>(),
                       v.ptr<const float>(),
                       dout.ptr<const float>(),
                       lse.ptr<const float>(),
                       static_cast<const float*>(delta.data()),
                       dq.ptr<float>(),
                       dk.ptr<float>(),
                       dv.ptr<float>(),
                       row_strides(q),
                       row_strides(k),
                       row_strides(v),
                       row_strides(dout),
                       lse_strides_of(lse),
                       row_strides(dq),
                       row_strides(dk),
                       row_strides(dv)};
  dispatch_head_dim(p.head_dim, [&](auto d) {
    using K = typename Config<decltype(d)::value>::Keys;
    using Q = typename Config<decltype(d)::value>::Queries;
    launch(dkdv_kernel<K>, ceil_div(p.seq_k, K::BK) * p.batch * p.heads_k, K::kThreads, K::kSmem, cu_stream, a,
           "flash_f32: dkdv_kernel");
    launch(dq_kernel<Q>, ceil_div(p.seq_q, Q::BQ) * p.batch * p.heads_q, Q::kThreads, Q::kSmem, cu_stream, a,
           "flash_f32: dq_kernel");
  });
}

}  // namespace flashlm
