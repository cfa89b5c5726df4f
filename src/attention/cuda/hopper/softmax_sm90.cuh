// The online softmax of the Hopper forward kernels, over one warpgroup's wgmma accumulator of S (64 query
// rows by kBlockN keys), shared by the 16-bit kernel (flash_fwd_sm90.cu) and the FP8 one
// (flash_fwd_fp8_sm90.cu). Device code only; the accumulator layout is sm90.cuh's: thread (warp w of the
// warpgroup, lane 4g + t) holds rows 16w + g and 16w + g + 8, element i at row 8·((i / 2) % 2) past the
// first, column 8·(i / 4) + 2t + i % 2.
#pragma once
#include <cmath>

#include "attention/cuda/flash_common.cuh"

namespace flashlm::flash_cuda {

// WgmmaRowSoftmax's ALiBi slope (kAlibiSink) of the tile's (batch, head) in raw-score units (0: none), as a
// base that is empty for the other kernels: an unused member still moved their register allocation.
template <bool kAlibiSink>
struct AlibiSlope {
  float slope_raw;
};
template <>
struct AlibiSlope<false> {};

// WgmmaRowSoftmax's score scale, the factor of a raw score q·k in S (scale) and in exp2 (scale_log2): the
// problem's, p.scale and p.scale_log2 read from the kernel parameters (kTileScale false: an empty base, the 16-bit
// kernels'), or the tile's own, which the kernel sets before each tile's first key block (kTileScale: the FP8
// kernel's, whose per-head descales make scale·q_descale·k_descale a factor of the tile's batch and key head).
template <bool kTileScale>
struct ScoreScale {
  float scale, scale_log2;
  __device__ __forceinline__ float score_scale(const FlashParams&) const { return scale; }
  __device__ __forceinline__ float score_scale_log2(const FlashParams&) const { return scale_log2; }
};
template <>
struct ScoreScale<false> {
  __device__ __forceinline__ static float score_scale(const FlashParams& p) { return p.scale; }
  __device__ __forceinline__ static float score_scale_log2(const FlashParams& p) { return p.scale_log2; }
};

// The running max and sum of a thread's two rows. The scale is folded into exp2 (score_scale_log2: p.scale_log2,
// which for FP8's per-tensor descales also carries them, or the tile's, kTileScale), so row_max stays in S's
// units. With kPolyEvery > 0, every kPolyEvery-th group of 8 key columns takes its exponentials on the FMA pipe
// (exp2_on_fma_pipe) instead of the SFU: for a kernel whose SFU is the bottleneck (the 16-bit forward at head
// dim 64). kChains independent partial maxima and sums per row (combined at the end) instead of one dependent
// chain of kBlockN / 8 max and add instructions each: the chain's latency, not its instruction count, is what a
// warpgroup waits for (ncu's "wait" stall, docs/perf.md). The sum's rounding order changes with it.
// kMasked: the sliding-window / soft-capping kernels' softmax (FlashParams::masked): scores soft-capped where
// p.softcap > 0, then masked by the band (key_in_band) where the block crosses its edge. kAlibiSink (masked
// only): the ALiBi / attention-sink kernels' softmax, the masked one plus, as in the mma.sync forward
// (flash_fwd.cu), the ALiBi bias added to the capped scores before the mask, and the sink starting each row.
// kTileScale: the score scale is the tile's (ScoreScale), not the problem's (the sink, 16-bit only, reads p's).
template <int kBlockN, int kPolyEvery = 0, int kChains = 1, bool kMaskedBand = false, bool kAlibiSinkRows = false,
          bool kTileScale = false>
struct WgmmaRowSoftmax : AlibiSlope<kAlibiSinkRows>, ScoreScale<kTileScale> {
  static_assert((kBlockN / 8) % kChains == 0, "the key block's 8-column groups split evenly over the chains");
  static_assert(kMaskedBand || !kAlibiSinkRows, "ALiBi and sinks take the masked kernels");
  static constexpr bool kMasked = kMaskedBand;
  static constexpr bool kAlibiSink = kAlibiSinkRows;
  float row_max[2], row_sum[2];

  // The state before the first key block of a tile of query head h, batch b (t: the lane's column in its quad).
  // With a sink (kAlibiSink, a logit other than -inf) the row starts as if the sink were a first key of weight
  // exp(sink - m) and no value: m = sink (in raw-score units, as row_max is kept) and l = 1, held by lane t = 0
  // alone (each lane's row_sum is its part of the quad's sum). A row that sees no key keeps it: O = 0 and
  // lse = sink. Without: m = -inf, l = 0.
  __device__ __forceinline__ void reset([[maybe_unused]] const FlashParams& p, [[maybe_unused]] int b,
                                        [[maybe_unused]] int h, [[maybe_unused]] int t) {
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
    if constexpr (kAlibiSink) {
      const float sink = sink_logit(p, h);
      if (sink != -INFINITY) {
        row_max[0] = row_max[1] = sink / p.scale;
        row_sum[0] = row_sum[1] = t == 0 ? 1.f : 0.f;
      }
      this->slope_raw = alibi_slope_raw(p, b, h);
    }
  }

  // S of the key block starting at key n0 becomes P in place: keys at or past p.seq_k and above the
  // causal diagonal are masked first (only where the block reaches them: `first_row` is the warpgroup's
  // first query row, `row0` this thread's first), then the running max and sum are updated. alpha[r] is
  // the factor by which row r's O accumulator must be rescaled (rescale() below).
  __device__ __forceinline__ void update(float (&s)[kBlockN / 2], const FlashParams& p, int n0, int first_row,
                                         int row0, int t, float (&alpha)[2]) {
    if constexpr (kMasked) {
      if (p.softcap > 0) {
#pragma unroll
        for (int i = 0; i < kBlockN / 2; ++i) s[i] = softcap_score(p, s[i]);
      }
      if constexpr (kAlibiSink) {
        if (this->slope_raw != 0.f) {
#pragma unroll
          for (int i = 0; i < kBlockN / 2; ++i) {
            const int row = row0 + 8 * ((i / 2) % 2);
            const int col = n0 + 8 * (i / 4) + 2 * t + (i % 2);
            s[i] += alibi_bias_raw(p, this->slope_raw, row, col);
          }
        }
      }
      // The warpgroup's 64 rows: a warpgroup-uniform test.
      if (!tile_in_band(p, first_row, first_row + 63, n0, n0 + kBlockN - 1)) {
#pragma unroll
        for (int i = 0; i < kBlockN / 2; ++i) {
          const int row = row0 + 8 * ((i / 2) % 2);
          const int col = n0 + 8 * (i / 4) + 2 * t + (i % 2);
          s[i] = key_in_band(p, row, col) ? s[i] : -INFINITY;
        }
      }
    } else {
      const bool needs_mask = n0 + kBlockN > p.seq_k || (p.causal && n0 + kBlockN - 1 > first_row + p.causal_offset);
      if (needs_mask) {
#pragma unroll
        for (int i = 0; i < kBlockN / 2; ++i) {
          const int row = row0 + 8 * ((i / 2) % 2);
          const int col = n0 + 8 * (i / 4) + 2 * t + (i % 2);
          if (col >= p.seq_k || (p.causal && col > row + p.causal_offset)) s[i] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mxs[kChains];
#pragma unroll
      for (int c = 0; c < kChains; ++c) mxs[c] = c == 0 ? row_max[r] : -INFINITY;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        mxs[j % kChains] =
            max_propagating_nan(mxs[j % kChains], max_propagating_nan(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
      }
      float mx = mxs[0];
#pragma unroll
      for (int c = 1; c < kChains; ++c) mx = max_propagating_nan(mx, mxs[c]);
      mx = quad_max(mx);
      // All masked so far: P = 0, no NaN.
      const float m_scaled = mx == -INFINITY ? 0.f : mx * this->score_scale_log2(p);
      alpha[r] = fast_exp2(row_max[r] * this->score_scale_log2(p) - m_scaled);
      row_max[r] = mx;
      float sums[kChains];
#pragma unroll
      for (int c = 0; c < kChains; ++c) sums[c] = 0.f;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const float x0 = fmaf(s[4 * j + 2 * r], this->score_scale_log2(p), -m_scaled);
        const float x1 = fmaf(s[4 * j + 2 * r + 1], this->score_scale_log2(p), -m_scaled);
        if (kPolyEvery > 0 && j % (kPolyEvery > 0 ? kPolyEvery : 1) == kPolyEvery - 1) {
          s[4 * j + 2 * r] = exp2_on_fma_pipe(x0);
          s[4 * j + 2 * r + 1] = exp2_on_fma_pipe(x1);
        } else {
          s[4 * j + 2 * r] = fast_exp2(x0);
          s[4 * j + 2 * r + 1] = fast_exp2(x1);
        }
        sums[j % kChains] += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
      }
      float sum = sums[0];
#pragma unroll
      for (int c = 1; c < kChains; ++c) sum += sums[c];
      row_sum[r] = row_sum[r] * alpha[r] + sum;
    }
  }

  // O's accumulator (same layout, kN / 2 columns) times alpha per row. (Skipping it where no row max of
  // the warp moved, a warp-uniform vote, was slower: docs/perf.md, "what did not work".)
  template <int kN>
  __device__ __forceinline__ static void rescale(float (&o)[kN], const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < kN / 4; ++j) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        o[4 * j + 2 * r] *= alpha[r];
        o[4 * j + 2 * r + 1] *= alpha[r];
      }
    }
  }
};

}  // namespace flashlm::flash_cuda
