// FlashAttention-2 on the CPU.
//
// Forward: one task per (batch, query head, tile of kForwardBlockQ queries). The task keeps its query tile, a
// running row maximum m, a running sum l and an unnormalised output accumulator, and streams key/value
// tiles of kForwardBlockK keys through them (online softmax). Key tiles that the causal mask or the sliding window
// hides completely are never visited (in the backward too); on the diagonal each block of kGemmRows queries
// multiplies only the keys up to the last it sees.
//
// Every query tile reads its head's whole K and V (and every key tile of the backward its head's whole Q
// and dO), so the tensors a task streams are packed once per call before the tasks run (PackedHeads):
// converted to the accumulation type, K (and V for the backward) also transposed, tile by tile, with a
// finiteness flag per tile; for the forward, K transposed and V in column panels of the micro-kernel's width.
// Without it each of the Nq / 64 query tiles converted and transposed every key tile again: at seq 4096 the
// forward ran 0.6x torch's CPU SDPA against 1.0x at 512 (docs/perf.md).
// Extra memory: those packed copies (O(seq · head_dim) per head, the size of the inputs) and a few tiles
// per thread.
//
// Backward (deterministic, no atomics): Delta_i = rowsum(dO_i ∘ O_i) first; then one task per (batch, query
// head) recomputes P = exp(S - lse) once per (key tile, query tile) pair and accumulates dK and dV for the
// key tile and dQ for the query tile from it: five tile products per pair (an earlier schedule, a dK/dV
// pass and a dQ pass that each recomputed S and dP, needed seven). The task's dQ (Nq × D) lives in its
// thread's scratch; with GQA the per-query-head dK and dV are summed over the group afterwards (O(N) memory:
// partials of Q's size).
//
// Every tile product goes through a register-blocked GEMM on packed tiles (fp32 accumulation for fp16, bf16 and fp32
// inputs; fp64 stays fp64). Products whose outputs are per (query, key) pair (S = Q Kᵀ, dP = dO Vᵀ) run over
// the whole tile and the masked entries are overwritten. Products that sum over keys or queries (P V, dS K,
// Pᵀ dO, dSᵀ Q) multiply masked entries' zero weights by real inputs: that is exact while the summed tile is
// finite, and where it is not (a NaN or inf in a row some query must not see) the tile pair falls back to
// sums over the visible pairs only, so non-finite inputs reach exactly the rows that see them (SPEC §2).
//
// This file is compiled once per instruction set (src/CMakeLists.txt: baseline x86-64, x86-64-v3 = AVX2 + FMA,
// x86-64-v4 = AVX-512; or the build machine's -march=native beside baseline), each copy in its own namespace
// FLASHLM_CPU_KERNELS_NS; attention/cpu_isa.cpp picks one at run time by what the CPU supports. Everything
// a copy calls must be its own: the helpers of cpu_rows.h and cpu_simd.h sit in an inline namespace of the
// same name, and errors are raised through non-inline functions (checked_size), so that the linker, which
// keeps one copy of each inline function of a given name, never hands an AVX-512 copy to the baseline path.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "attention/cpu_gemm.h"
#include "attention/cpu_rows.h"
#include "attention/problem.h"
#include "core/check.h"
#include "flashlm/memory.h"

namespace flashlm::FLASHLM_CPU_KERNELS_NS {

namespace {

constexpr int64_t kBlockQ = 64;  // the backward's tiles (128-key tiles there gained nothing: docs/perf.md, CPU)
constexpr int64_t kBlockK = 64;
// The forward's tiles: 256 queries × 512 keys, torch's CPU flash attention's split for sequences of 768 and more.
// Against 128 × 128 the per-row softmax bookkeeping (row max fold, rescale of the accumulator row, running sums)
// and P V's accumulator loads and stores come a quarter as often, which pays at long sequences and costs nothing
// at short ones (docs/perf.md, CPU). S (512 KiB) and the accumulator (256 KiB at d128) live in the 2 MiB L2
// either way; a 512-key V panel (64 KiB) no longer fits L1, which turned out not to matter.
// The forward keeps S, P and the output accumulator per query; the backward also dS.
constexpr int64_t kForwardBlockQ = 256;
constexpr int64_t kForwardBlockK = 512;

// Per-thread scratch: one tracked allocation carved into named tiles.
template <class A>
class Scratch {
 public:
  Scratch(int64_t elements, std::string_view tag)
      : buffer_(Buffer::allocate_reused(static_cast<size_t>(elements) * sizeof(A), tag)) {}
  std::span<A> take(int64_t n) {
    std::span<A> s(static_cast<A*>(buffer_.data()) + used_, static_cast<size_t>(n));
    used_ += n;
    return s;
  }

 private:
  Buffer buffer_;
  int64_t used_ = 0;
};

template <class A>
constexpr A kNegInf = -std::numeric_limits<A>::infinity();

// One tensor's rows for every (batch, head), converted to the accumulation type A and cut into tiles of
// `tile` rows: as stored (tile × D, row-major; a ragged last tile's missing rows are zero) and/or transposed
// (D × tile), as the products need them, plus whether every element of a tile is finite (all_finite).
template <class A>
class PackedHeads {
 public:
  // *_panels: in column panels of kGemmCols (BLayout::panels): rows_panels the tile × D rows, D padded with zeros
  // to whole panels; transposed_panels the D × tile transpose (tile a multiple of kGemmCols).
  enum Layouts { rows_only = 1, transposed_only = 2, rows_and_transposed = 3, rows_panels = 5, transposed_panels = 6 };

  // The tiles for `heads` heads of `seq` rows of head_dim D, allocated; fill() writes them.
  static PackedHeads allocate(int64_t batch, int64_t heads, int64_t seq, int64_t D, int64_t tile, Layouts layouts,
                              std::string_view tag) {
    PackedHeads out;
    out.heads_ = heads;
    out.seq_ = seq;
    out.D_ = D;
    out.tile_ = tile;
    out.tiles_ = (seq + tile - 1) / tile;
    out.layouts_ = layouts;
    out.padded_D_ = (layouts & in_panels) ? (D + kGemmCols - 1) / kGemmCols * kGemmCols : D;
    out.tile_elements_ = tile * out.padded_D_;
    // Only one of the two layouts in panels (rows_panels or transposed_panels), so one stride.
    out.panel_stride_ = (layouts & rows_only) ? tile * kGemmCols : D * kGemmCols;
    out.tiles_all_ = batch * heads * out.tiles_;
    const auto bytes = checked_size({out.tiles_all_, tile, out.padded_D_, int64_t(sizeof(A))}, tag);
    if (layouts & rows_only) out.rows_ = Buffer::allocate_reused(bytes, tag);
    if (layouts & transposed_only) out.transposed_ = Buffer::allocate_reused(bytes, tag);
    // One flag per tile, every one written by fill(). A Buffer (allocated out of line), not a std::vector:
    // a std template instantiated here is a weak symbol compiled for this copy's instruction set, which
    // the linker may hand to the baseline copy (attention.cpu_kernel_objects checks).
    out.finite_ = Buffer::allocate_reused(size_t(out.tiles_all_), tag);
    return out;
  }

  // Converts t's rows (the tensor allocate() was sized for) into the tiles. Called by every thread of a parallel
  // region it is an orphaned `omp for`: each thread packs its share and does not wait for the others, so the
  // caller puts a barrier before the tiles are read; called outside one, it packs every tile.
  template <class T>
  void fill(const TensorView& t) {
    const bool panels = layouts_ & in_panels;
    std::vector<A> row(static_cast<size_t>(padded_D_));  // zeros past D
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < tiles_all_; ++i) {
      const int64_t bh = i / tiles_, s0 = (i % tiles_) * tile_, n = std::min(tile_, seq_ - s0);
      A* r = (layouts_ & rows_only) ? tile_at(rows_, i) : nullptr;
      A* tr = (layouts_ & transposed_only) ? tile_at(transposed_, i) : nullptr;
      bool finite = true;
      for (int64_t s = 0; s < tile_; ++s) {
        if (s < n) {
          load_row(attention_row<const T>(t, bh / heads_, s0 + s, bh % heads_), row.data(), D_);
          finite = finite && all_finite(row.data(), D_);
        } else {
          std::fill(row.begin(), row.end(), A(0));
        }
        if (r && panels) {
          for (int64_t d0 = 0; d0 < padded_D_; d0 += kGemmCols) {
            std::copy_n(row.begin() + d0, kGemmCols, r + d0 * tile_ + s * kGemmCols);
          }
        } else if (r) {
          std::copy_n(row.begin(), D_, r + s * D_);
        }
        if (tr && panels) {
          A* column = tr + s / kGemmCols * (D_ * kGemmCols) + s % kGemmCols;
          for (int64_t d = 0; d < D_; ++d) column[d * kGemmCols] = row[size_t(d)];
        } else if (tr) {
          for (int64_t d = 0; d < D_; ++d) tr[d * tile_ + s] = row[size_t(d)];
        }
      }
      static_cast<uint8_t*>(finite_.data())[i] = finite;
    }
  }

  // Tile `t` (rows [t · tile, (t + 1) · tile)) of head `bh` = b · heads + h. Packed in panels, consecutive panels
  // are panel_stride() apart.
  const A* rows(int64_t bh, int64_t t) const { return tile_at(rows_, bh * tiles_ + t); }
  const A* transposed(int64_t bh, int64_t t) const { return tile_at(transposed_, bh * tiles_ + t); }
  int64_t panel_stride() const { return panel_stride_; }
  bool finite(int64_t bh, int64_t t) const {
    return static_cast<const uint8_t*>(finite_.data())[bh * tiles_ + t] != 0;
  }

 private:
  A* tile_at(const Buffer& b, int64_t i) const { return static_cast<A*>(b.data()) + i * tile_elements_; }

  static constexpr int in_panels = 4;
  int64_t heads_ = 0, seq_ = 0, D_ = 0, tile_ = 0, tiles_ = 0, tiles_all_ = 0, padded_D_ = 0, tile_elements_ = 0,
          panel_stride_ = 0;
  Layouts layouts_ = rows_only;
  Buffer rows_, transposed_, finite_;
};

// The query tile's rows in panels (ALayout::panels), its last panel padded to kGemmRows rows.
constexpr int64_t kForwardPanelRows = panel_padded(kForwardBlockQ);

// Loads rows [s0, s0 + rows) of head h into kGemmRows-row panels (ALayout::panels); the padding rows of the last
// panel are zero.
template <class T, class A>
void load_panels(const TensorView& t, int64_t b, int64_t h, int64_t s0, int64_t rows, int64_t D, A* dst) {
  for (int64_t r = 0; r < panel_padded(rows); ++r) {
    A* panel_row = dst + panel_row_offset(r, D);  // element d at panel_row[d · kGemmRows]
    if (r < rows) {
      const T* src = attention_row<const T>(t, b, s0 + r, h);
      for (int64_t d = 0; d < D; ++d) panel_row[d * kGemmRows] = convert<A>(src[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) panel_row[d * kGemmRows] = A(0);
    }
  }
}

template <class A>
A load_lse(const TensorView& lse, int64_t b, int64_t h, int64_t i) {
  return lse.dtype == DType::f64 ? static_cast<A>(lse_at<double>(lse, b, h, i))
                                 : static_cast<A>(lse_at<float>(lse, b, h, i));
}

// Columns [begin, end) of the key tile at j0 (cols wide) that query i sees (the causal mask and the sliding
// window; empty where it sees none of them). Only those take part in any product: NaN or inf in a key, value
// or dO row reaches exactly the rows that see it (SPEC §2), and 0 · NaN from a masked key never does.
struct Cols {
  int64_t begin, end;
  int64_t size() const { return end - begin; }
};
inline Cols visible_cols(const AttentionProblem& p, int64_t i, int64_t j0, int64_t cols) {
  const int64_t end = std::clamp<int64_t>(p.visible_keys(i) - j0, 0, cols);
  return {std::min(end, std::clamp<int64_t>(p.first_visible_key(i) - j0, 0, cols)), end};
}

// In the backward: none for a row that saw no key (lse = -inf), whose gradients are zero whatever dO holds.
template <class A>
Cols contributing_cols(const AttentionProblem& p, A lse, int64_t i, int64_t j0, int64_t cols) {
  return lse == kNegInf<A> ? Cols{0, 0} : visible_cols(p, i, j0, cols);
}

// The ALiBi bias of (query i, key j) in the accumulation type (AttentionProblem::alibi_bias's rule, in A).
template <class A>
inline A alibi_bias(const AttentionProblem& p, A slope, int64_t i, int64_t j) {
  const int64_t d = i + p.causal_offset - j;
  return -slope * static_cast<A>(d < 0 ? -d : d);
}

// Whether some query of rows [i0, i0 + rows) does not see every key of the tile [j0, j0 + cols): a tile on the
// causal diagonal or a window's edge, whose products run per block of kGemmRows queries over the keys that block
// may see. The bounds grow with the query, so the first query has the lowest end and the last the highest begin.
inline bool tile_partly_masked(const AttentionProblem& p, int64_t i0, int64_t rows, int64_t j0, int64_t cols) {
  return visible_cols(p, i0, j0, cols).end < cols || visible_cols(p, i0 + rows - 1, j0, cols).begin > 0;
}

// f(r0, block_rows, seen) for each block of kGemmRows queries [r0, r0 + block_rows) of the tile's rows that may
// see a key of it, seen: the keys [0, seen) of the tile its last (most-seeing) query sees. (Columns left of a
// window are not skipped within the block: their weights are zero.)
template <class F>
void for_each_query_block(const AttentionProblem& p, int64_t i0, int64_t rows, int64_t j0, int64_t cols, F f) {
  for (int64_t r0 = 0; r0 < rows; r0 += kGemmRows) {
    const int64_t block_rows = std::min(kGemmRows, rows - r0);
    const int64_t seen = visible_cols(p, i0 + r0 + block_rows - 1, j0, cols).end;
    if (seen > visible_cols(p, i0 + r0, j0, cols).begin) f(r0, block_rows, seen);
  }
}

// S[r][c] = scale · Q[r]·K[c] (soft-capped: softcap · tanh(S / softcap); plus the ALiBi bias of `slope`, 0
// without) for the visible (query, key) pairs of the tile, -inf for masked ones. KT is the
// key tile transposed (head_dim × width); S is rows × width. On the causal diagonal each block of kGemmRows
// queries computes only the key columns its last query sees (rounded up to whole kGemmCols blocks within the
// zero-padded width), which skips 3/8 of the products of a square diagonal tile.
// Q: the query tile as stored (ALayout::rows) or in panels (Q + r0 · D is the panel of rows r0.. either way).
// KT in BLayout::panels (kKLayout): ldk = D · kGemmCols, the distance between panels; else ldk = width.
template <ALayout kQLayout, BLayout kKLayout, class A>
void tile_scores(const AttentionProblem& p, const A* Q, const A* KT, int64_t ldk, int64_t width, int64_t i0,
                 int64_t rows, int64_t j0, int64_t cols, A slope, A* S) {
  const int64_t D = p.head_dim;
  const A scale = static_cast<A>(p.scale);
  if (!tile_partly_masked(p, i0, rows, j0, cols)) {
    tile_gemm<kQLayout, 0, kKLayout>(rows, cols, D, scale, Q, D, KT, ldk, A(0), S, width);
  } else {
    for_each_query_block(p, i0, rows, j0, cols, [&](int64_t r0, int64_t block_rows, int64_t seen) {
      const int64_t n = std::min(width, (seen + kGemmCols - 1) / kGemmCols * kGemmCols);
      tile_gemm<kQLayout, 0, kKLayout>(block_rows, n, D, scale, Q + r0 * D, D, KT, ldk, A(0), S + r0 * width, width);
    });
  }
  const A cap = static_cast<A>(p.softcap);
  for (int64_t r = 0; r < rows; ++r) {
    A* s = S + r * width;
    const Cols visible = visible_cols(p, i0 + r, j0, cols);
    std::fill(s, s + visible.begin, kNegInf<A>);
    std::fill(s + visible.end, s + cols, kNegInf<A>);
    if (cap > 0) {
      for (int64_t c = visible.begin; c < visible.end; ++c) s[c] = cap * std::tanh(s[c] / cap);
    }
    if (slope != 0) {
      for (int64_t c = visible.begin; c < visible.end; ++c) s[c] += alibi_bias<A>(p, slope, i0 + r, j0 + c);
    }
  }
}

template <class T, class A>
void forward_task(const AttentionProblem& p, const TensorView& q, const PackedHeads<A>& k, const PackedHeads<A>& v,
                  const TensorView& o, const TensorView& lse, int64_t b, int64_t h, int64_t i0, A* Q, A* S, A* acc,
                  A* m, A* l) {
  const int64_t D = p.head_dim, Dv = p.value_dim(), bhk = b * p.heads_k + h / p.group();
  const int64_t rows = std::min(kForwardBlockQ, p.seq_q - i0);
  const A slope = static_cast<A>(p.alibi_slope(b, h)), sink = static_cast<A>(p.sink_logit(h));
  load_panels<T>(q, b, h, i0, rows, D, Q);
  std::fill(acc, acc + rows * Dv, A(0));
  // The sink starts every row's online softmax as a first "key" of weight exp(sink - m) and no value: m = sink,
  // l = 1 (no sink, -inf: m = -inf, l = 0, as before any key). A row that sees no key keeps them: o = 0, lse = sink.
  std::fill(m, m + rows, sink);
  std::fill(l, l + rows, sink == kNegInf<A> ? A(0) : A(1));

  // The key tiles that some query of the tile sees: from the first query's first key to the last query's end.
  const int64_t key_end = p.visible_keys(i0 + rows - 1);
  for (int64_t j0 = p.first_visible_key(i0) / kForwardBlockK * kForwardBlockK; j0 < key_end; j0 += kForwardBlockK) {
    const int64_t cols = std::min(kForwardBlockK, key_end - j0);
    const A *KT = k.transposed(bhk, j0 / kForwardBlockK), *V = v.rows(bhk, j0 / kForwardBlockK);
    const bool v_finite = v.finite(bhk, j0 / kForwardBlockK);
    tile_scores<ALayout::panels, BLayout::panels>(p, Q, KT, k.panel_stride(), kForwardBlockK, i0, rows, j0, cols,
                                                  slope, S);
    // S becomes P = exp(S - m_new) over the visible columns, 0 elsewhere (and in rows with nothing visible).
    for (int64_t r = 0; r < rows; ++r) {
      A* s = S + r * kForwardBlockK;
      const Cols visible = visible_cols(p, i0 + r, j0, cols);
      A* sv = s + visible.begin;
      // A NaN score is skipped here and reaches the output through exp(NaN - m_new) in the row sum l and in P
      // (O and lse become NaN, as with any NaN the row sees); a NaN m from an earlier tile stays NaN.
      A m_new = max_propagating_nan(m[r], row_max_skipping_nan(sv, visible.size()));
      if (m_new == kNegInf<A>) {
        if (std::none_of(sv, sv + visible.size(), [](A x) { return x != x; })) {  // nothing visible yet: acc, m, l stay
          std::fill(s, s + cols, A(0));
          continue;
        }
        m_new = std::numeric_limits<A>::quiet_NaN();  // only NaNs and -inf: the row's output is NaN
      }
      const A alpha = exp_nonpositive(m[r] - m_new);  // exp(-inf) = 0 on the first visible tile
      A* a = acc + r * Dv;
      if (alpha != A(1)) {
        for (int64_t d = 0; d < Dv; ++d) a[d] *= alpha;
      }
      const A sum = exp_shifted_sum(sv, visible.size(), m_new);
      std::fill(s, sv, A(0));
      std::fill(s + visible.end, s + cols, A(0));
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
    }
    const int64_t ldv = v.panel_stride();  // V in panels of kGemmCols of its D columns
    if (v_finite && !tile_partly_masked(p, i0, rows, j0, cols)) {
      tile_gemm<ALayout::rows, kForwardBlockK, BLayout::panels>(rows, Dv, cols, A(1), S, kForwardBlockK, V, ldv, A(1),
                                                                acc, Dv);  // acc += P V
    } else if (v_finite) {  // on the causal diagonal or a window's edge: each block of queries sums over its keys
      for_each_query_block(p, i0, rows, j0, cols, [&](int64_t r0, int64_t block_rows, int64_t seen) {
        tile_gemm<ALayout::rows, kForwardBlockK, BLayout::panels>(block_rows, Dv, seen, A(1), S + r0 * kForwardBlockK,
                                                                  kForwardBlockK, V, ldv, A(1), acc + r0 * Dv, Dv);
      });
    } else {  // only the visible pairs, one value element at a time (V[c][d] in panel d / kGemmCols)
      for (int64_t r = 0; r < rows; ++r) {
        A* a = acc + r * Dv;
        const Cols visible = visible_cols(p, i0 + r, j0, cols);
        for (int64_t c = visible.begin; c < visible.end; ++c) {
          const A weight = S[r * kForwardBlockK + c];
          for (int64_t d = 0; d < Dv; ++d) a[d] += weight * V[d / kGemmCols * ldv + c * kGemmCols + d % kGemmCols];
        }
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    A* a = acc + r * Dv;
    // l = 0: the row saw no key and has no sink (O = 0, lse = -inf); l NaN: a NaN reached it, and O and lse are NaN.
    const A inv = l[r] != 0 ? A(1) / l[r] : A(0);
    for (int64_t d = 0; d < Dv; ++d) a[d] *= inv;
    store_row(a, attention_row<T>(o, b, i0 + r, h), Dv);
    const A lse_r = l[r] != 0 ? m[r] + std::log(l[r]) : kNegInf<A>;
    if (lse.dtype == DType::f64) lse_at<double>(lse, b, h, i0 + r) = static_cast<double>(lse_r);
    else lse_at<float>(lse, b, h, i0 + r) = static_cast<float>(lse_r);
  }
}

template <class T, class A>
void forward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
             const TensorView& o, const TensorView& lse) {
  const int64_t D = p.head_dim, Dv = p.value_dim();
  static_assert(kForwardBlockK % kGemmCols == 0, "the packed K tile's panels must cover its keys");
  auto K = PackedHeads<A>::allocate(p.batch, p.heads_k, p.seq_k, D, kForwardBlockK, PackedHeads<A>::transposed_panels,
                                    "flash forward packed K");
  auto V = PackedHeads<A>::allocate(p.batch, p.heads_k, p.seq_k, Dv, kForwardBlockK, PackedHeads<A>::rows_panels,
                                    "flash forward packed V");
  const int64_t q_tiles = (p.seq_q + kForwardBlockQ - 1) / kForwardBlockQ;
  const int64_t tasks = p.batch * p.heads_q * q_tiles;
  // The packing and the tasks in one parallel region, one barrier between them: every region's start and end
  // synchronises the threads, and where they share the cores with other processes each synchronisation can
  // wait out a scheduler tick (three regions made the forward several times slower on a loaded machine;
  // docs/perf.md, CPU).
#pragma omp parallel
  {
    K.template fill<T>(k);
    V.template fill<T>(v);
#pragma omp barrier
    Scratch<A> w(kForwardPanelRows * D + kForwardBlockQ * Dv + kForwardBlockQ * kForwardBlockK + kForwardBlockQ * 2,
                 "flash forward tiles");
    A *Q = w.take(kForwardPanelRows * D).data(), *acc = w.take(kForwardBlockQ * Dv).data();
    A *S = w.take(kForwardBlockQ * kForwardBlockK).data(), *m = w.take(kForwardBlockQ).data();
    A* l = w.take(kForwardBlockQ).data();
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < tasks; ++t) {
      // Head by head (the head's K and V stay in cache from one task to the next; tile-major order was slower:
      // docs/perf.md, CPU), each head's last query tile first: under a causal mask
      // it sees the most keys, so the short tiles come last and even out the threads' ends.
      const int64_t tile = q_tiles - 1 - t % q_tiles, bh = t / q_tiles;
      forward_task<T, A>(p, q, K, V, o, lse, bh / p.heads_q, bh % p.heads_q, tile * kForwardBlockQ, Q, S, acc, m, l);
    }
  }
}

// The tiles the backward recomputes for one (query tile, key tile) pair: P = exp(S - lse) into S, and
// dS = P ∘ (dO Vᵀ - Delta) into dS, the gradient of the score before soft-capping: times
// d(c · tanh(x / c))/dx = 1 - (C / c)² with C the capped score (S less the ALiBi bias of `slope`). KT and VT: the
// key and value tiles transposed (VT head_dim_v × the tile; dO rows of head_dim_v).
template <class A>
void tile_probs_and_dscores(const AttentionProblem& p, const A* Q, const A* KT, const A* VT, const A* dO,
                            const A* lse, const A* delta, int64_t i0, int64_t rows, int64_t j0, int64_t cols, A slope,
                            A* S, A* dS) {
  const int64_t Dv = p.value_dim();
  tile_scores<ALayout::rows, BLayout::rows>(p, Q, KT, kBlockK, kBlockK, i0, rows, j0, cols, slope, S);
  tile_gemm(rows, cols, Dv, A(1), dO, Dv, VT, kBlockK, A(0), dS, kBlockK);  // dP = dO Vᵀ, masked entries dropped below
  const A cap = static_cast<A>(p.softcap);
  for (int64_t r = 0; r < rows; ++r) {
    A* s = S + r * kBlockK;
    A* ds = dS + r * kBlockK;
    const Cols visible = contributing_cols(p, lse[r], i0 + r, j0, cols);
    if (cap > 0) {
      for (int64_t c = visible.begin; c < visible.end; ++c) {
        const A t = (slope != 0 ? s[c] - alibi_bias<A>(p, slope, i0 + r, j0 + c) : s[c]) / cap, v = s[c] - lse[r];
        s[c] = exp_nonpositive(v > A(0) ? A(0) : v);
        ds[c] = s[c] * (ds[c] - delta[r]) * (A(1) - t * t);
      }
    } else {
      exp_shifted(s + visible.begin, visible.size(), lse[r]);
      for (int64_t c = visible.begin; c < visible.end; ++c) ds[c] = s[c] * (ds[c] - delta[r]);
    }
    for (int64_t c = 0; c < visible.begin; ++c) s[c] = ds[c] = A(0);
    for (int64_t c = visible.end; c < cols; ++c) s[c] = ds[c] = A(0);
  }
}

template <class T, class A>
void backward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& o, const TensorView& lse, const TensorView& dout, const TensorView& dq,
              const TensorView& dk, const TensorView& dv) {
  const int64_t D = p.head_dim, Dv = p.value_dim(), Nq = p.seq_q, Nk = p.seq_k;
  const A scale = static_cast<A>(p.scale);

  // Delta_i = rowsum(dO_i ∘ O_i): one number per query row, O(seq) memory.
  Buffer delta_buffer =
      Buffer::allocate_reused(static_cast<size_t>(p.batch * p.heads_q * Nq) * sizeof(A), "flash backward Delta");
  A* delta_all = static_cast<A*>(delta_buffer.data());
  auto delta_of = [&](int64_t b, int64_t h) { return delta_all + (b * p.heads_q + h) * Nq; };

  const int64_t q_tiles = (Nq + kBlockQ - 1) / kBlockQ;
  const int64_t k_tiles = (Nk + kBlockK - 1) / kBlockK;
  using Packed = PackedHeads<A>;
  auto Qp = Packed::allocate(p.batch, p.heads_q, Nq, D, kBlockQ, Packed::rows_only, "flash backward packed Q");
  auto dOp = Packed::allocate(p.batch, p.heads_q, Nq, Dv, kBlockQ, Packed::rows_only, "flash backward packed dO");
  auto Kp = Packed::allocate(p.batch, p.heads_k, Nk, D, kBlockK, Packed::rows_and_transposed,
                             "flash backward packed K");
  auto Vp = Packed::allocate(p.batch, p.heads_k, Nk, Dv, kBlockK, Packed::transposed_only, "flash backward packed V");

  // dQ, dK and dV in one pass: one task per (batch, query head) walks its key tiles and, for each, the query
  // tiles that see them. P and dS are computed once per tile pair and feed all three gradients (five tile
  // products: S, dP, Pᵀ dO, dSᵀ Q, dS K). The task holds its head's whole dQ (Nq × D, a thread's scratch) and
  // finishes a key tile's dK and dV before the next. With GQA each query head's dK and dV go to a per-head
  // partial, summed over the group in head order afterwards: deterministic, no atomics.
  const bool grouped = p.group() > 1;
  Buffer partial_buffer;
  A* partial = nullptr;  // [batch, heads_q, Nk · (D + Dv)] when grouped: each head's dK (Nk × D), then its dV (Nk × Dv)
  const int64_t partial_head = Nk * (D + Dv);
  if (grouped) {
    partial_buffer = Buffer::allocate_reused(checked_size({p.batch, p.heads_q, Nk, D + Dv, int64_t(sizeof(A))},
                                                           "flash backward dK/dV partials"),
                                             "flash backward dK/dV partials");
    partial = static_cast<A*>(partial_buffer.data());
  }
  // The sink's gradient per (batch, query head), summed over the batch in order afterwards (deterministic).
  Buffer dsink_buffer;
  A* dsink = nullptr;
  if (p.dlearnable_sink != nullptr) {
    dsink_buffer = Buffer::allocate_reused(checked_size({p.batch, p.heads_q, int64_t(sizeof(A))}, "flash backward dsink"),
                                           "flash backward dsink");
    dsink = static_cast<A*>(dsink_buffer.data());
  }
  // Delta, the packing and the tasks in one parallel region, one barrier before the tasks (as in the forward:
  // six regions before, each a synchronisation of the threads).
#pragma omp parallel
  {
    {
      Scratch<A> rows(2 * Dv, "flash backward Delta rows");
      A *orow = rows.take(Dv).data(), *dorow = rows.take(Dv).data();
#pragma omp for schedule(static) nowait
      for (int64_t row = 0; row < p.batch * p.heads_q * Nq; ++row) {
        const int64_t i = row % Nq, bh = row / Nq;
        load_row(attention_row<const T>(o, bh / p.heads_q, i, bh % p.heads_q), orow, Dv);
        load_row(attention_row<const T>(dout, bh / p.heads_q, i, bh % p.heads_q), dorow, Dv);
        delta_all[row] = dot(orow, dorow, Dv);
      }
    }
    Qp.template fill<T>(q);
    dOp.template fill<T>(dout);
    Kp.template fill<T>(k);
    Vp.template fill<T>(v);
#pragma omp barrier
    Scratch<A> w(q_tiles * kBlockQ * (D + 1) + kBlockK * (D + Dv) + kBlockQ * kBlockK * 2, "flash backward tiles");
    A* dQ = w.take(q_tiles * kBlockQ * D).data();
    A* lse_rows = w.take(q_tiles * kBlockQ).data();
    A *dK = w.take(kBlockK * D).data(), *dV = w.take(kBlockK * Dv).data();
    A *S = w.take(kBlockQ * kBlockK).data(), *dS = w.take(kBlockQ * kBlockK).data();
#pragma omp for schedule(dynamic)
    for (int64_t bh = 0; bh < p.batch * p.heads_q; ++bh) {
      const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / p.group(), bhk = b * p.heads_k + hk;
      const A* delta = delta_of(b, h);
      const A slope = static_cast<A>(p.alibi_slope(b, h));
      for (int64_t i = 0; i < Nq; ++i) lse_rows[i] = load_lse<A>(lse, b, h, i);
      if (dsink != nullptr) {
        // dsink = -Σ_i P_sink,i · Delta_i, P_sink,i = exp(sink - lse_i), over the rows that see a key (a row that
        // sees none has O = 0: its Delta is 0 whatever dO holds).
        const A sink = static_cast<A>(p.sink_logit(h));
        A sum = 0;
        for (int64_t i = 0; i < Nq; ++i) {
          if (p.sees_keys(i)) sum -= std::exp(sink - lse_rows[i]) * delta[i];
        }
        dsink[bh] = sum;
      }
      std::fill(dQ, dQ + Nq * D, A(0));
      for (int64_t kt = 0; kt < k_tiles; ++kt) {
        const int64_t j0 = kt * kBlockK, cols = std::min(kBlockK, Nk - j0);
        const A *K = Kp.rows(bhk, kt), *KT = Kp.transposed(bhk, kt), *VT = Vp.transposed(bhk, kt);
        const bool k_finite = Kp.finite(bhk, kt);
        std::fill(dK, dK + cols * D, A(0));
        std::fill(dV, dV + cols * Dv, A(0));
        // The query tiles that see a key of this tile: the window's right side bounds the first, its left the last.
        const int64_t query_end = p.last_query_seeing(j0 + cols - 1);
        for (int64_t i0 = p.first_query_seeing(j0) / kBlockQ * kBlockQ; i0 < query_end; i0 += kBlockQ) {
          const int64_t rows = std::min(kBlockQ, Nq - i0), qt = i0 / kBlockQ;
          const A *Q = Qp.rows(bh, qt), *dO = dOp.rows(bh, qt), *lse_tile = lse_rows + i0;
          tile_probs_and_dscores(p, Q, KT, VT, dO, lse_tile, delta + i0, i0, rows, j0, cols, slope, S, dS);
          if (Qp.finite(bh, qt) && dOp.finite(bh, qt)) {
            tile_gemm<ALayout::transposed, kBlockK>(cols, Dv, rows, A(1), S, kBlockK, dO, Dv, A(1), dV, Dv);  // dV += Pᵀ dO
            tile_gemm<ALayout::transposed, kBlockK>(cols, D, rows, scale, dS, kBlockK, Q, D, A(1), dK, D);  // dK += scale dSᵀ Q
          } else {
            for (int64_t r = 0; r < rows; ++r) {
              const Cols seen = contributing_cols(p, lse_tile[r], i0 + r, j0, cols);
              for (int64_t c = seen.begin; c < seen.end; ++c) {
                axpy(S[r * kBlockK + c], dO + r * Dv, dV + c * Dv, Dv);
                axpy(scale * dS[r * kBlockK + c], Q + r * D, dK + c * D, D);
              }
            }
          }
          if (k_finite) {
            tile_gemm<ALayout::rows, kBlockK>(rows, D, cols, scale, dS, kBlockK, K, D, A(1), dQ + i0 * D, D);  // dQ += scale dS K
          } else {
            for (int64_t r = 0; r < rows; ++r) {
              const Cols seen = contributing_cols(p, lse_tile[r], i0 + r, j0, cols);
              for (int64_t c = seen.begin; c < seen.end; ++c) {
                axpy(scale * dS[r * kBlockK + c], K + c * D, dQ + (i0 + r) * D, D);
              }
            }
          }
        }
        if (grouped) {
          A* dst = partial + bh * partial_head;
          std::copy(dK, dK + cols * D, dst + j0 * D);
          std::copy(dV, dV + cols * Dv, dst + Nk * D + j0 * Dv);
        } else {
          for (int64_t c = 0; c < cols; ++c) {
            store_row(dK + c * D, attention_row<T>(dk, b, j0 + c, hk), D);
            store_row(dV + c * Dv, attention_row<T>(dv, b, j0 + c, hk), Dv);
          }
        }
      }
      for (int64_t i = 0; i < Nq; ++i) store_row(dQ + i * D, attention_row<T>(dq, b, i, h), D);
    }
  }

  // GQA: dK and dV of a key head are the sums of its query heads' partials, in head order.
  if (grouped) {
#pragma omp parallel
    {
      Scratch<A> w(D + Dv, "flash backward dK/dV rows");
      A *dk_row = w.take(D).data(), *dv_row = w.take(Dv).data();
#pragma omp for schedule(static)
      for (int64_t row = 0; row < p.batch * p.heads_k * Nk; ++row) {
        const int64_t j = row % Nk, bhk = row / Nk, b = bhk / p.heads_k, hk = bhk % p.heads_k;
        std::fill(dk_row, dk_row + D, A(0));
        std::fill(dv_row, dv_row + Dv, A(0));
        for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
          const A* src = partial + (b * p.heads_q + h) * partial_head;
          axpy(A(1), src + j * D, dk_row, D);
          axpy(A(1), src + Nk * D + j * Dv, dv_row, Dv);
        }
        store_row(dk_row, attention_row<T>(dk, b, j, hk), D);
        store_row(dv_row, attention_row<T>(dv, b, j, hk), Dv);
      }
    }
  }
  if (dsink != nullptr) {
    for (int64_t h = 0; h < p.heads_q; ++h) {
      A sum = 0;
      for (int64_t b = 0; b < p.batch; ++b) sum += dsink[b * p.heads_q + h];
      p.dlearnable_sink[h * p.dsink_stride] += static_cast<float>(sum);
    }
  }
}

// fp64 inputs accumulate in fp64 (for gradient checks); every other dtype in fp32.
template <class T>
using Accum = std::conditional_t<std::is_same_v<T, double>, double, float>;

}  // namespace

void flash_forward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& o, const TensorView& lse) {
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    forward<T, Accum<T>>(p, q, k, v, o, lse);
  });
}

void flash_backward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& o, const TensorView& lse, const TensorView& dout, const TensorView& dq,
                    const TensorView& dk, const TensorView& dv) {
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    backward<T, Accum<T>>(p, q, k, v, o, lse, dout, dq, dk, dv);
  });
}

}  // namespace flashlm::FLASHLM_CPU_KERNELS_NS
