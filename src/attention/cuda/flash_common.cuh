// The vocabulary of every CUDA attention kernel (flash_fwd.cu, flash_bwd.cu, flash_f32.cu, naive.cu):
// element types, row strides, cp.async and the tile loader, and for the tensor-core kernels the
// mma.sync / ldmatrix wrappers, the shared-memory swizzle, the score masking and the parameter block.
// Fragment layouts are those of PTX's mma.m16n8k16 (row.col):
//   A 16x16: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16x8:  b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C 16x8:  c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1)          with g = lane / 4, t = lane % 4.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <numbers>

#include "attention/problem.h"
#include "core/softmax_stats.cuh"

namespace flashlm::flash_cuda {

// Scores and logsumexps are multiplied by log2(e) so that exp becomes one exp2.
constexpr float kLog2e = std::numbers::log2e_v<float>;

// Strides, in elements, of a [batch, seq, heads, head_dim] view (head_dim stride is 1): the one unit in
// which every kernel here receives strides (byte offsets are computed where a kernel needs them).
struct RowStrides {
  int64_t b, s, h;
};

inline RowStrides row_strides(const TensorView& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

struct FlashParams {
  const void *q, *k, *v;
  void* o;
  float* lse;  // [batch, heads_q, seq_q] with lse_strides
  RowStrides q_st, k_st, v_st, o_st;
  int64_t lse_b, lse_h, lse_s;
  int batch, seq_q, seq_k, heads_q, heads_k, group;
  // The softmax scale of the scores the kernels compute from the stored q and k, and scale·log2(e) for exp2. For
  // inputs stored with descales (AttentionProblem::q_descale.., the FP8 paths) it carries q_descale·k_descale,
  // so that scale·(q·k) is the score of the dequantised values (make_params).
  float scale, scale_log2;
  bool causal;
  int causal_offset;  // key j visible to query i iff j <= i + causal_offset

  // The band of the masked kernels (masked = AttentionProblem::windowed() or softcap > 0; the other kernels
  // read none of this): key j visible to query i iff i + causal_offset - window_left <= j <=
  // i + causal_offset + window_right, -1 leaving a side unbounded; window_right is 0 under causal
  // (AttentionProblem::right_bound), so the band holds the causal mask too. A side at least seq_q + seq_k
  // bounds nothing and is stored as -1 (so that no bound overflows an int).
  bool masked;
  int window_left, window_right;
  // Soft-capping (masked kernels, softcap > 0): a raw score x = q·k becomes softcap_out · tanh(x · softcap_in)
  // with softcap_in = scale / softcap and softcap_out = softcap / scale, so that scale times it is
  // softcap · tanh(scale·x / softcap) and everything downstream of the scores is unchanged.
  float softcap, softcap_in, softcap_out;
  // ALiBi (masked kernels; null without it): the slope of (b, h) is alibi_slopes[b · alibi_b + h · alibi_h]
  // (AttentionProblem::alibi_slope), a device pointer; alibi_slope_raw turns it into raw-score units.
  const float* alibi_slopes;
  int64_t alibi_b, alibi_h;
  // Attention sinks (masked kernels; null without them): the logit of query head h is sink[h · sink_stride], a
  // device pointer, -inf for no sink. The backward adds the sink's gradient into dsink[h · dsink_stride]
  // (null: not asked for).
  const float* sink;
  int64_t sink_stride;
  float* dsink;
  int64_t dsink_stride;

  // Backward only.
  const void* dout;
  void *dq, *dk, *dv;
  RowStrides do_st, dq_st, dk_st, dv_st;
  float* delta;      // [batch, heads_q, seq_q_padded]: rowsum(dO∘O)
  float* lse_log2;   // same shape: lse·log2(e), +inf for rows that see no key or lie past seq_q
  float* dq_accum;   // [batch, heads_q, seq_q_padded, head_dim] fp32, for the atomic dQ path
  int seq_q_padded;
  // What the fp32 dQ and dK accumulators (dS·K, dSᵀ·Q of the stored values) are multiplied by as they are
  // written, and what Delta is multiplied by as the preprocess writes it: scale, scale and 1 for 16-bit
  // inputs. With descales (the FP8 backward runs these kernels on the stored e4m3 values, converted exactly to
  // bf16) v's goes into Delta and both factors, and q's and k's into the factor of the other's gradient: dP of
  // the stored v is dP/v_descale, so Delta/v_descale gives dS/v_descale, and dL/dq = scale·dS·k_deq =
  // scale·k_descale·v_descale·(dS/v_descale)·k, and so for dk. One fp32 multiply each, where the 16-bit
  // kernels already multiply by the scale: no extra rounding of the gradients. The sink's gradient reads
  // Delta: no problem with descales has sinks (the fp8 row of the capability table has none).
  float dq_scale, dk_scale, delta_scale;
};

// Whether problem `p` takes the masked kernels (FlashParams::masked): a sliding window beyond the causal
// mask, soft-capping, ALiBi or attention sinks (the last two in the mma.sync kernels' masked instantiation and
// in the Hopper kernels' own ALiBi / sink instantiations, which flash_kernel_family takes only where
// hopper_alibi_sink_route() holds: capabilities.h).
inline bool uses_masked_kernels(const AttentionProblem& p) {
  return p.windowed() || p.softcap > 0 || p.alibi || p.sink;
}

FlashParams make_params(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& o, const TensorView& lse);

// The 16-bit flash backward's host code (cuda/flash_bwd.cu), which every family of it shares: the
// preprocess (Delta, lse·log2e), the fp32 dQ accumulator and its bound by groups of key/value heads, and the
// conversion of dQ (or, `deterministic`, the separate dQ pass). `dkdv` launches the dK/dV part of one group
// (and adds dS·K into f.dq_accum, unscaled, in DqAccumLayout's lane-major order, from f.delta and
// f.lse_log2), or is null for the mma.sync kernel. A family that brings its own dK/dV kernel keeps the mma.sync kernel's key tile
// (mma_sync_backward_block_n; for a head dim pair, the one of the larger head dim), by which the groups are
// sized. A pair (head_dim_v != head_dim) needs such a kernel: mma.sync runs pairs on padded copies.
using BackwardDkdvLauncher = void (*)(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& dout, const FlashParams& f,
                                      cudaStream_t stream);
void run_flash_backward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& o, const TensorView& lse, const TensorView& dout, const TensorView& dq,
                        const TensorView& dk, const TensorView& dv, bool deterministic, BackwardDkdvLauncher dkdv,
                        void* stream);
// The mma.sync backward's keys per dK/dV block at head dim D.
constexpr int mma_sync_backward_block_n(int d) { return d <= 128 ? 128 : 64; }

// The backward's per-row arrays (Delta, lse·log2e, the dQ accumulator) are padded to a multiple of this
// many rows, a multiple of every backward kernel's query tile, so that a tile never reads past them.
constexpr int kRowPad = 128;

// The atomic backward's fp32 dQ accumulator of one (batch, head), [seq_q_padded, D] floats, stored in the
// order of the mma.sync C fragments (also a warp's part of a wgmma accumulator, hopper/sm90.cuh) rather
// than row-major: the 16 x 8 tile at (row0, col0) (row0 a multiple of 16, col0 of 8) is 128 consecutive
// floats holding element e of lane (lane = 4g + t holds rows g, g + 8 and columns 2t, 2t + 1; e = 2·(row ≥ 8)
// + column parity). Within the tile, two orders (DqOrder): the mma.sync kernel's atomics keep (lane, e) at
// e·32 + lane, so that each atomic instruction of a warp covers one 128-byte line (row-major, it touched 8
// rows); the Hopper kernels, which stage a warp's rows in shared memory and add them with one bulk reduce,
// keep it at lane·4 + e, one 16-byte shared store per tile and thread instead of four.
enum class DqOrder { fragment_major, lane_major };
template <int D>
struct DqAccumLayout {
  static constexpr int kBlockFloats = 16 * 8;
  __host__ __device__ static constexpr int64_t block(int row0, int col0) {
    return (int64_t(row0 / 16) * (D / 8) + col0 / 8) * kBlockFloats;
  }
};

template <class T> struct MmaOp;
template <> struct MmaOp<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <> struct MmaOp<__half> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Returns x unchanged, but opaque to the optimiser: inside a loop it stops values derived from a
// loop-invariant x from being hoisted out of the loop and kept live (or spilled) across it.
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte asynchronous copy; src_bytes = 0 writes zeros (rows past the end of a sequence).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Waits for all of this thread's copies, and is a compiler barrier for memory: a __syncthreads() must
// still follow before other threads read them.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Shared-memory tile of ROWS x D 16-bit elements, stored row-major with the 16-byte chunks of each row
// permuted (XOR swizzle) so that the 8 row addresses of one ldmatrix hit 8 different bank groups.
template <int D>
struct Swizzle {
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  __device__ __forceinline__ static int offset(int row, int chunk) {
    if constexpr (kChunks >= 8) {
      return row * D + ((chunk ^ (row & 7)) << 3);
    } else {
      constexpr int kRowsPerLine = 8 / kChunks;  // rows sharing one 128-byte line
      return row * D + ((chunk ^ ((row / kRowsPerLine) & (kChunks - 1))) << 3);
    }
  }
};

// The same swizzle for D >= 64 written as byte offsets for ldmatrix addressing. A lane reading row r
// (r & 7 = x) at chunk 2·kk + b (b in {0, 1}) lands on chunk (2·kk + b) ^ x = 2·kk ^ (b ^ x), so its byte
// offset is lane_offset(r, b) ^ (32·kk): the row part (a multiple of 2·D bytes) has no bits in the chunk
// field, and adding whole rows (multiples of 8, so x is unchanged) never touches the chunk field either.
template <int D>
struct XorSwizzle {
  // Valid only where Swizzle<D> is the row-XOR form (D / 8 >= 8 chunks per row).
  __device__ __forceinline__ static uint32_t lane_offset(int row, int b) {
    return static_cast<uint32_t>(row * (2 * D) + ((b ^ (row & 7)) << 4));
  }
  // Byte offset of chunk pair kk at `rows` (a multiple of 8) rows further down.
  __device__ __forceinline__ static uint32_t at(uint32_t lane_off, int rows, int kk) {
    return (lane_off ^ static_cast<uint32_t>(32 * kk)) + static_cast<uint32_t>(rows * (2 * D));
  }
};

// Copies rows [row0, row0 + ROWS) of one head of a [batch, seq, heads, D] tensor into a shared-memory
// tile laid out by `Layout` (Layout::offset(row, chunk): the element offset of 16-byte chunk `chunk` of
// tile row `row`; Swizzle<D> for the 16-bit kernels); rows at or past `rows_valid` are zero-filled. All
// THREADS threads of the block take part (tid in [0, THREADS)). Where the tile divides evenly among the
// threads the copy is fully unrolled with incremental addresses, so a caller's main loop keeps no
// per-copy addresses live (they were spilled).
template <int ROWS, int D, int THREADS, class Layout = Swizzle<D>, class T>
__device__ __forceinline__ void load_tile_async(T* tile, const T* head_base, int64_t row_stride, int row0,
                                                int rows_valid, int tid) {
  constexpr int kElems = 16 / sizeof(T);  // elements per 16-byte chunk
  constexpr int kChunks = D / kElems;
  constexpr int kTotal = ROWS * kChunks;
  if constexpr (THREADS % kChunks == 0 && kTotal % THREADS == 0) {
    // Thread tid copies chunk column tid % kChunks of rows r0 + i·kRowStep: one source pointer that
    // steps by whole rows, one shared address plus constants, one bound to compare against.
    constexpr int kRowStep = THREADS / kChunks, kIters = kTotal / THREADS;
    const int r0 = tid / kChunks, ch = tid % kChunks;
    const int rows_left = rows_valid - row0 - r0;  // rows r0 + i·kRowStep with i·kRowStep < rows_left exist
    const T* src = head_base + (row0 + r0) * row_stride + ch * kElems;
    const int64_t step = kRowStep * row_stride;
    const uint32_t dst = smem_addr(tile);
    if (row0 + ROWS <= rows_valid) {  // block-uniform: every row exists (all but the last tile), no bound checks
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        cp_async_16(dst + sizeof(T) * Layout::offset(r0 + i * kRowStep, ch), src + i * step, 16);
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const bool valid = i * kRowStep < rows_left;
      cp_async_16(dst + sizeof(T) * Layout::offset(r0 + i * kRowStep, ch), valid ? src + i * step : head_base,
                  valid ? 16 : 0);
    }
  } else {
    for (int c = tid; c < kTotal; c += THREADS) {
      const int r = c / kChunks, ch = c % kChunks;
      const bool valid = row0 + r < rows_valid;
      const T* src = valid ? head_base + (row0 + r) * row_stride + ch * kElems : head_base;
      cp_async_16(smem_addr(tile + Layout::offset(r, ch)), src, valid ? 16 : 0);
    }
  }
}

// Whether a tile of scores with first query row `row0` (the earliest row any of its fragments holds)
// and keys [col0, col0 + cols) has a key past the end or above the causal diagonal: only such tiles take
// mask_scores, a warp-uniform branch (folded into the exponentials, masking cost every tile ~100 compare
// and select instructions).
__device__ __forceinline__ bool scores_need_mask(const FlashParams& p, int row0, int col0, int cols) {
  return col0 + cols > p.seq_k || (p.causal && col0 + cols - 1 > row0 + p.causal_offset);
}

// ---- The masked kernels' band (sliding window and causal together, FlashParams::window_*).

// Whether key `col` is visible to query `row`: inside the band and before the end of the keys.
__device__ __forceinline__ bool key_in_band(const FlashParams& p, int row, int col) {
  const int diag = row + p.causal_offset;
  return col < p.seq_k && (p.window_right < 0 || col <= diag + p.window_right) &&
         (p.window_left < 0 || col >= diag - p.window_left);
}

// Whether every pair of query rows [row_first, row_last] and keys [col_first, col_last] is visible, so that
// the tile needs no element-wise mask (the band's edges are monotone in the row: the first row bounds the
// right edge, the last row the left one).
__device__ __forceinline__ bool tile_in_band(const FlashParams& p, int row_first, int row_last, int col_first,
                                             int col_last) {
  return col_last < p.seq_k && (p.window_right < 0 || col_last <= row_first + p.causal_offset + p.window_right) &&
         (p.window_left < 0 || col_first >= row_last + p.causal_offset - p.window_left);
}

// A half-open range of tile indices; empty where end <= first.
struct TileRange {
  int first, end;
  __device__ __forceinline__ int count() const { return end > first ? end - first : 0; }
};

// The key tiles of block_n keys that some query of rows [row_first, row_last] sees (every other key tile is
// skipped, never loaded).
__device__ __forceinline__ TileRange band_key_tiles(const FlashParams& p, int row_first, int row_last, int block_n) {
  const int begin = p.window_left < 0 ? 0 : max(0, row_first + p.causal_offset - p.window_left);
  const int end = p.window_right < 0 ? p.seq_k : max(0, min(p.seq_k, row_last + p.causal_offset + p.window_right + 1));
  if (end <= begin) return {0, 0};
  return {begin / block_n, (end + block_n - 1) / block_n};
}

// The key tiles query rows [row_first, row_last] visit: the band's in the masked kernels (window, softcap),
// otherwise every tile up to the causal diagonal (causal) or to seq_k.
template <bool kMasked>
__device__ __forceinline__ TileRange visited_key_tiles(const FlashParams& p, int row_first, int row_last, int block_n) {
  if constexpr (kMasked) {
    return band_key_tiles(p, row_first, row_last, block_n);
  } else {
    const int n_end = p.causal ? max(0, min(p.seq_k, row_last + p.causal_offset + 1)) : p.seq_k;
    return {0, (n_end + block_n - 1) / block_n};
  }
}

// Soft-capping of a raw score (FlashParams::softcap_in/out), and the capped score's derivative by the raw
// one, 1 - tanh², from the capped score x' (x' · softcap_in is the tanh; a masked -inf gives 0, never NaN).
__device__ __forceinline__ float softcap_score(const FlashParams& p, float x) {
  return p.softcap_out * tanhf(x * p.softcap_in);
}
__device__ __forceinline__ float softcap_slope(const FlashParams& p, float x_capped) {
  const float th = fmaxf(x_capped * p.softcap_in, -1.f);
  return fmaf(-th, th, 1.f);
}


// ALiBi in the units of the raw scores x = q·k the kernels hold (the softmax scale is applied later): the
// slope of (b, h) divided by the scale, 0 without ALiBi; and the bias of (query row, key col) in those units,
// -slope_raw · |row + causal_offset - col| (AttentionProblem::alibi_bias), so that scale times it is the
// reference's bias.
__device__ __forceinline__ float alibi_slope_raw(const FlashParams& p, int b, int h) {
  return p.alibi_slopes == nullptr ? 0.f : p.alibi_slopes[b * p.alibi_b + h * p.alibi_h] / p.scale;
}
__device__ __forceinline__ float alibi_bias_raw(const FlashParams& p, float slope_raw, int row, int col) {
  return -slope_raw * fabsf(static_cast<float>(row + p.causal_offset - col));
}

// The sink logit of query head h (-inf: none; FlashParams::sink).
__device__ __forceinline__ float sink_logit(const FlashParams& p, int h) {
  return p.sink == nullptr ? -INFINITY : p.sink[h * p.sink_stride];
}

// Whether query `row` sees any key (AttentionProblem::sees_keys, from the band's sides).
__device__ __forceinline__ bool row_sees_keys(const FlashParams& p, int row) {
  const int diag = row + p.causal_offset;
  const int first = p.window_left < 0 ? 0 : max(0, diag - p.window_left);
  const int end = p.window_right < 0 ? p.seq_k : min(p.seq_k, diag + p.window_right + 1);
  return first < end;
}

// The cap's slope at a score x as cap_and_mask_scores left it (capped, plus the ALiBi bias of slope_raw at
// (row, col), which the cap's derivative must not see).
__device__ __forceinline__ float softcap_slope_biased(const FlashParams& p, float x, float slope_raw, int row,
                                                      int col) {
  return softcap_slope(p, slope_raw != 0.f ? x - alibi_bias_raw(p, slope_raw, row, col) : x);
}

// The masked kernels' treatment of a tile of scores held as kM 16-row x kN 8-key C fragments (rows row0 +
// 16·mt + .., keys col0 + 8·nt + ..): soft-capped where p.softcap > 0, plus the ALiBi bias of `slope_raw`
// (alibi_slope_raw; 0 without ALiBi), then set to -inf outside the band unless the caller found the whole
// tile inside it (`in_band`, a warp-uniform test).
template <int kM, int kN>
__device__ __forceinline__ void cap_and_mask_scores(float (&s)[kM][kN][4], const FlashParams& p, bool in_band,
                                                    int row0, int col0, int g, int t, float slope_raw) {
  if (p.softcap > 0) {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
      for (int nt = 0; nt < kN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = softcap_score(p, s[mt][nt][e]);
  }
  if (slope_raw != 0.f) {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
      for (int nt = 0; nt < kN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row0 + mt * 16 + g + (e / 2) * 8;
          const int col = col0 + nt * 8 + 2 * t + (e % 2);
          s[mt][nt][e] += alibi_bias_raw(p, slope_raw, row, col);
        }
  }
  if (in_band) return;
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + mt * 16 + g + (e / 2) * 8;
        const int col = col0 + nt * 8 + 2 * t + (e % 2);
        s[mt][nt][e] = key_in_band(p, row, col) ? s[mt][nt][e] : -INFINITY;
      }
}

// Sets to -inf the scores this lane holds (kM 16-row x kN 8-key C fragments, rows row0 + 16·mt + ..,
// keys col0 + 8·nt + ..) whose key lies past seq_k or above the causal diagonal; exp2(-inf) = 0 then
// gives them P = 0.
template <int kM, int kN>
__device__ __forceinline__ void mask_scores(float (&s)[kM][kN][4], const FlashParams& p, int row0, int col0, int g,
                                            int t) {
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + mt * 16 + g + (e / 2) * 8;
        const int col = col0 + nt * 8 + 2 * t + (e % 2);
        // An unconditional store of a select: a conditional store through the reference stayed a branch.
        s[mt][nt][e] = col >= p.seq_k || (p.causal && col > row + p.causal_offset) ? -INFINITY : s[mt][nt][e];
      }
}

// 2^x as one SFU instruction (ex2.approx.ftz). exp2f without fast-math compiles to the subnormal-safe
// form, which wraps the same instruction in a compare and two multiplies (docs/perf.md, "Kernel tuning
// notes"). Results below 2^-126 flush to 0, far below what fp32 accumulation of P keeps; exp2(-inf) = 0
// as the masking relies on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x for x <= 0 (the softmax's exponents) on the FMA and integer pipes instead of the SFU, so that a kernel
// bound by SFU throughput (the Hopper forward at head dim 64) can move a share of its exponentials off it.
// x = j + f with j = round(x) (adding and subtracting 1.5 * 2^23 rounds to an integer) and f in [-0.5, 0.5];
// 2^f by a degree-3 polynomial (coefficients fitted here by a Remez exchange on the relative error: at most
// 7.5e-5 in fp32, a fiftieth of a bf16 rounding of P) times 2^j, built in the exponent field from the
// shifter's low bits. x is first clamped at -127 by a NaN-keeping max: 2^-127 then has exponent field 0,
// i.e. the factor is +0, so -inf and anything under -126.5 give exactly 0 (as the masking and fully
// masked rows need; fast_exp2 flushes below 2^-126 too), and NaN stays NaN through the polynomial. Eight
// FMA-pipe instructions and one integer one against one SFU instruction: worth it only for the share of
// the exponentials the SFU cannot keep up with.
__device__ __forceinline__ float exp2_on_fma_pipe(float x) {
  constexpr float kShifter = 12582912.f;  // 1.5 * 2^23: j lands in the low mantissa bits
  float xc;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(xc) : "f"(x), "f"(-127.f));
  const float shifted = __fadd_rn(xc, kShifter);  // the _rn forms are never folded into xc
  const float f = __fsub_rn(xc, __fsub_rn(shifted, kShifter));
  const float p = fmaf(fmaf(fmaf(0.0551716685f, f, 0.242611125f), f, 0.693260968f), f, 0.999928057f);
  // (j + 127) << 23: the shifter's bits are 0x4B400000 + j, whose bits above the ninth vanish in the shift.
  const float two_to_j = __int_as_float((__float_as_int(shifted) << 23) + (127 << 23));
  return p * two_to_j;
}

__device__ __forceinline__ float quad_max(float x) {
  x = max_propagating_nan(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return max_propagating_nan(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

template <class T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

// Stores two adjacent fp32 values as one 32-bit pair of T.
template <class T>
__device__ __forceinline__ void store_pair(T* dst, float a, float b) {
  *reinterpret_cast<uint32_t*>(dst) = MmaOp<T>::pack(a, b);
}

}  // namespace flashlm::flash_cuda
