// The CPU attention's tile products: a register-blocked GEMM on small row-major or packed tiles.
// Compiled into each instruction-set copy of attention/flash_cpu.cpp (its inline namespace, as cpu_rows.h), and
// into dev/cpu_tile_gemm_bench.cpp, which times these products alone.
#pragma once
#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>

#include "core/cpu_simd.h"  // the intrinsics headers where the target has them

namespace flashlm {
inline namespace FLASHLM_CPU_KERNELS_NS {  // one copy per instruction set (attention/flash_cpu.cpp)

// The block is sized to the vector registers of the build's target: 16 accumulators of 16 floats where
// AVX-512 gives 32 registers, 12 of 8 (AVX2) or of 4 (SSE2) where there are 16 (enough independent FMA chains
// to hide latency; 4 × 16 on AVX2, 8 accumulators, was slower). Taller or wider blocks (12 × 32, 14 × 32, 4 × 64,
// 6 × 64 on AVX-512) were no faster. At 8 × 32 in intrinsics (gemm_block_avx512) the forward's tile products run
// near the core's FMA peak, alone and in place (dev/cpu_tile_gemm_bench; the figures are in docs/perf.md, CPU).
#if defined(__AVX512F__)
constexpr int64_t kGemmRows = 8;
constexpr int64_t kGemmCols = 32;
#elif defined(__AVX__)
constexpr int64_t kGemmRows = 6;  // 12 of the 16 ymm registers
constexpr int64_t kGemmCols = 16;
#else
constexpr int64_t kGemmRows = 6;  // 12 of the 16 xmm registers
constexpr int64_t kGemmCols = 8;
#endif

// How a tile product's A operand is stored (op(A) is m × k):
//   rows:       A row-major (m × k, row stride lda);
//   transposed: Aᵀ row-major (k × m, row stride lda) — free here, the kernel broadcasts single elements of A;
//   panels:     panels of kGemmRows rows one after another, each k × kGemmRows (a panel's column p holds its rows'
//               elements p side by side; the last panel zero-padded; lda unused). The micro-kernel's
//               broadcasts then read one cache line per p at offsets fixed at compile time, whatever k is:
//               with a runtime row stride (rows, lda = head_dim) the kernel kept the eight row offsets on the
//               stack, and the S product ran further from the FMA peak (docs/perf.md, CPU).
// kLda: lda known at compile time (0: the runtime lda), for the same reason (P V's A is the S tile, 128 wide).
enum class ALayout { rows, transposed, panels };

// How a tile product's B operand (k × n) is stored:
//   rows:   row-major, row stride ldb;
//   panels: column panels of kGemmCols one after another (n a multiple of kGemmCols), each k × kGemmCols
//           row-major, ldb elements from one panel to the next. A block of the micro-kernel then reads one
//           contiguous panel, which stays in L1 while tile_gemm runs every block of rows over it. Row-major
//           with a 512-byte row stride (the forward's 128-key K tiles of then), a block's 32 columns of 128 rows fall in
//           16 of the 48 KiB L1's 64 sets, 12 KiB of ways for 16 KiB (arithmetic: this VM exposes no cache
//           counters); the panels made the d128 forwards at middle lengths faster (docs/perf.md, CPU).
enum class BLayout { rows, panels };

// The row stride a block kernel steps A by: within a panel kGemmRows, else kLda or the runtime lda.
template <ALayout kLayout, int64_t kLda>
constexpr int64_t a_stride(int64_t lda) {
  return kLayout == ALayout::panels ? kGemmRows : kLda != 0 ? kLda : lda;
}

// Element (r, p) of op(A) for a block kernel's A pointer (in panels: the block's own panel).
constexpr int64_t a_offset(ALayout layout, int64_t ld, int64_t r, int64_t p) {
  return layout == ALayout::rows ? r * ld + p : p * ld + r;
}

// Rows padded to whole panels, and where row r's element 0 sits in a panels layout of k columns.
constexpr int64_t panel_padded(int64_t rows) { return (rows + kGemmRows - 1) / kGemmRows * kGemmRows; }
constexpr int64_t panel_row_offset(int64_t r, int64_t k) { return r / kGemmRows * kGemmRows * k + r % kGemmRows; }

// One kRows × kGemmCols block of C, k ≥ 1: the accumulators are locals of this function, so that they live in
// registers from the first product on, and start from the first product rather than from zeros (zero-initialised,
// they were also cleared in memory by a `rep stos` for the k = 0 path, which showed in the tile products' profile).
#if defined(__AVX512F__)
// gemm_block for fp32 on AVX-512, in intrinsics: two zmm of B per k step, each A element broadcast once and
// multiplied into both. The same products in the same order as the portable loops below; what differs is the
// code around them: from those loops GCC kept acc in an array on the stack (stored after the first product
// and again after the last, reloaded for the stores) and stepped k one product at a time; here acc is
// registers only and k is unrolled by 4 (one pointer step and branch per 64 FMAs instead of 16).
template <int64_t kRows, ALayout kLayout, int64_t kLda>
inline void gemm_block_avx512(int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                              float beta, float* c, int64_t ldc) {
  static_assert(kGemmCols == 32, "two zmm of 16 floats per row");
  const int64_t ld = a_stride<kLayout, kLda>(lda);
  __m512 lo[kRows], hi[kRows];
  {
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 ar = _mm512_set1_ps(a[a_offset(kLayout, ld, r, 0)]);
      lo[r] = _mm512_mul_ps(ar, b0);
      hi[r] = _mm512_mul_ps(ar, b1);
    }
  }
#pragma GCC unroll 4
  for (int64_t p = 1; p < k; ++p) {
    const __m512 b0 = _mm512_loadu_ps(b + p * ldb), b1 = _mm512_loadu_ps(b + p * ldb + 16);
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 ar = _mm512_set1_ps(a[a_offset(kLayout, ld, r, p)]);
      lo[r] = _mm512_fmadd_ps(ar, b0, lo[r]);
      hi[r] = _mm512_fmadd_ps(ar, b1, hi[r]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
  if (beta == 0.0f) {
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(c + r * ldc, _mm512_mul_ps(va, lo[r]));
      _mm512_storeu_ps(c + r * ldc + 16, _mm512_mul_ps(va, hi[r]));
    }
  } else {
    const __m512 vb = _mm512_set1_ps(beta);
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(c + r * ldc, _mm512_fmadd_ps(va, lo[r], _mm512_mul_ps(vb, _mm512_loadu_ps(c + r * ldc))));
      _mm512_storeu_ps(c + r * ldc + 16,
                       _mm512_fmadd_ps(va, hi[r], _mm512_mul_ps(vb, _mm512_loadu_ps(c + r * ldc + 16))));
    }
  }
}
#endif

template <int64_t kRows, ALayout kLayout, int64_t kLda, class A>
inline void gemm_block(int64_t k, A alpha, const A* a, int64_t lda, const A* b, int64_t ldb, A beta, A* c,
                       int64_t ldc) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<A, float>) {
    return gemm_block_avx512<kRows, kLayout, kLda>(k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
#endif
  const int64_t ld = a_stride<kLayout, kLda>(lda);
  A acc[kRows][kGemmCols];
#pragma GCC unroll 16
  for (int64_t r = 0; r < kRows; ++r) {
    const A ar = a[a_offset(kLayout, ld, r, 0)];
#pragma omp simd
    for (int64_t j = 0; j < kGemmCols; ++j) acc[r][j] = ar * b[j];
  }
  for (int64_t p = 1; p < k; ++p) {
    const A* brow = b + p * ldb;
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRows; ++r) {
      const A ar = a[a_offset(kLayout, ld, r, p)];
#pragma omp simd
      for (int64_t j = 0; j < kGemmCols; ++j) acc[r][j] += ar * brow[j];
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    A* crow = c + r * ldc;
    if (beta == A(0)) {
#pragma omp simd
      for (int64_t j = 0; j < kGemmCols; ++j) crow[j] = alpha * acc[r][j];
    } else {
#pragma omp simd
      for (int64_t j = 0; j < kGemmCols; ++j) crow[j] = alpha * acc[r][j] + beta * crow[j];
    }
  }
}

// The block heights tile_gemm uses: kGemmRows, then each next power of two below, down to 1 (the rows left
// over below a full block take the tallest that fits).
constexpr int64_t next_gemm_rows(int64_t rows) { return std::bit_floor(uint64_t(rows - 1)); }

// gemm_block for a runtime height `rows` from that sequence.
template <int64_t kRows, ALayout kLayout, int64_t kLda, class A>
void gemm_block_rows(int64_t rows, int64_t k, A alpha, const A* a, int64_t lda, const A* b, int64_t ldb, A beta, A* c,
                     int64_t ldc) {
  if constexpr (kRows >= 1) {
    if (rows == kRows) return gemm_block<kRows, kLayout, kLda>(k, alpha, a, lda, b, ldb, beta, c, ldc);
    gemm_block_rows<next_gemm_rows(kRows), kLayout, kLda>(rows, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

// A block at the ragged right edge (cols < kGemmCols; or k = 0), by plain loops; out of line, so that its
// accumulator array (zeroed in memory) stays out of the full blocks' loop.
template <ALayout kLayout, class A>
[[gnu::noinline]] void gemm_edge_block(int64_t rows, int64_t cols, int64_t k, A alpha, const A* a, int64_t ld,
                                       const A* b, int64_t ldb, A beta, A* c, int64_t ldc) {
  A acc[kGemmRows][kGemmCols] = {};
  for (int64_t p = 0; p < k; ++p) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < cols; ++j) acc[r][j] += a[a_offset(kLayout, ld, r, p)] * b[p * ldb + j];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    A* crow = c + r * ldc;
    for (int64_t j = 0; j < cols; ++j) crow[j] = beta == A(0) ? alpha * acc[r][j] : alpha * acc[r][j] + beta * crow[j];
  }
}

// C = alpha · op(A) · B + beta · C on row-major tiles (op(A) m×k stored as kLayout says; B k×n; beta = 0 never
// reads C). Blocks of kGemmRows × kGemmCols outputs stay in registers while k runs; the compiler vectorises the
// columns for the target it builds for (no -march=native needed). A hand-kept kernel rather than BLAS: OpenBLAS
// 0.3.21 falls back to its SSE3 kernels on CPUs it cannot identify (this project's 2-core machines among them),
// much slower on the forward's tiles, and even on its AVX-512 kernels (forced) it runs them slower than this
// one: it packs both operands in every call (dev/cpu_tile_gemm_bench; the figures are in docs/perf.md, CPU).
template <ALayout kLayout = ALayout::rows, int64_t kLda = 0, BLayout kBLayout = BLayout::rows, class A>
void tile_gemm(int64_t m, int64_t n, int64_t k, A alpha, const A* a, int64_t lda, const A* b, int64_t ldb, A beta,
               A* c, int64_t ldc) {
  auto block = [&](int64_t i0, int64_t rows, int64_t j0) {
    const A* a_block = kLayout == ALayout::rows         ? a + i0 * (kLda != 0 ? kLda : lda)
                       : kLayout == ALayout::transposed ? a + i0
                                                        : a + panel_row_offset(i0, k);
    const int64_t cols = std::min(kGemmCols, n - j0);
    const A* b_block = kBLayout == BLayout::panels ? b + j0 / kGemmCols * ldb : b + j0;
    const int64_t b_stride = kBLayout == BLayout::panels ? kGemmCols : ldb;
    if (cols == kGemmCols && k > 0) {
      gemm_block_rows<kGemmRows, kLayout, kLda>(rows, k, alpha, a_block, lda, b_block, b_stride, beta,
                                                c + i0 * ldc + j0, ldc);
    } else {
      gemm_edge_block<kLayout>(rows, cols, k, alpha, a_block, a_stride<kLayout, kLda>(lda), b_block, b_stride, beta,
                               c + i0 * ldc + j0, ldc);
    }
  };
  auto block_rows = [&](int64_t i0) {
    int64_t rows = kGemmRows;
    while (rows > m - i0) rows = next_gemm_rows(rows);
    return rows;
  };
  if constexpr (kBLayout == BLayout::panels) {
    // One panel of B (k × kGemmCols contiguous: 16 KiB for K at d128) stays in L1 while every block of rows passes
    // over it; A, read once per panel, streams instead. (V's panels of 512 keys, 64 KiB, are read from L2.)
    for (int64_t j0 = 0; j0 < n; j0 += kGemmCols) {
      for (int64_t i0 = 0, rows = 0; i0 < m; i0 += rows) block(i0, rows = block_rows(i0), j0);
    }
  } else {
    for (int64_t i0 = 0, rows = 0; i0 < m; i0 += rows) {
      rows = block_rows(i0);
      for (int64_t j0 = 0; j0 < n; j0 += kGemmCols) block(i0, rows, j0);
    }
  }
}

}  // namespace FLASHLM_CPU_KERNELS_NS
}  // namespace flashlm
