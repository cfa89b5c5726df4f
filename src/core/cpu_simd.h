// Vectorisable building blocks of the CPU kernels (the attention's softmax tiles, the LM's cross-entropy):
// an fp32 exponential and row reductions that fold their vector lanes as a tree.
#pragma once
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX512F__)
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps(), which -Wmaybe-uninitialized (or, inlined into
// a lambda, -Wuninitialized) reports at every inlined use; the diagnostic state at the header's own lines is
// what counts.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

// The namespace of the CPU kernels' inline helpers: each per-ISA copy of the kernels defines its own (src/CMakeLists.txt);
// other code gets the build's.
#ifndef FLASHLM_CPU_KERNELS_NS
#define FLASHLM_CPU_KERNELS_NS cpu_build
#endif

namespace flashlm {
inline namespace FLASHLM_CPU_KERNELS_NS {  // one copy per instruction set (attention/flash_cpu.cpp)

// The pieces of the fp32 exponentials below: exp(v) = 2^k · e^r with k = round(v · log2 e), r = v - k ln2.
namespace exp_fp32_detail {
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-6f;
// Adding 1.5 * 2^23 rounds t to an integer k and leaves k in the low mantissa bits of the sum (for |k| < 2^22):
// 2^k is built from those bits, with no float-to-int conversion (undefined for NaN, and two more vector
// operations per element to guard it). A NaN stays NaN through every step.
constexpr float kRound = 12582912.0f;
constexpr int32_t kRoundBits = 0x4B400000;  // std::bit_cast<int32_t>(kRound)

// e^r · 2^k for kr = k + kRound, k in [-126, 127].
#pragma omp declare simd notinbranch
inline float scaled_exp(float r, float kr) {
  // Taylor terms to r^7 (below fp32's rounding on |r| <= ln2/2), evaluated in pairs (Estrin's scheme): the
  // dependency chain is four operations deep instead of Horner's eight, which bound the softmax's throughput.
  const float r2 = r * r;
  const float c01 = 1.0f + r, c23 = 0.5f + r * (1.0f / 6), c45 = 1.0f / 24 + r * (1.0f / 120);
  const float c67 = 1.0f / 720 + r * (1.0f / 5040);
  const float q = c01 + r2 * (c23 + r2 * (c45 + r2 * c67));
  return q * std::bit_cast<float>((std::bit_cast<int32_t>(kr) - kRoundBits + 127) << 23);
}
}  // namespace exp_fp32_detail

// exp(v) in fp32 by a polynomial that the compiler vectorises inside `#pragma omp simd` loops (std::exp is a
// scalar libm call: it was most of the CPU attention's time, and half of the tiny LM's CPU step in the
// cross-entropy). Relative error ~2e-7 (a few ulp; 1e-6 within 0.4 of the overflow threshold); exp(-inf) = 0,
// NaN stays NaN, underflow below e^-87.3 gives 0 (std::exp would give a denormal), overflow inf.
#pragma omp declare simd notinbranch
inline float exp_fp32(float v) {
  using namespace exp_fp32_detail;
  float t = v * kLog2e;
  t = t < -126.0f ? -126.0f : (t > 127.0f ? 127.0f : t);  // a normal 2^k; max/min that keep a NaN t
  const float kr = t + kRound;
  const float k = kr - kRound;
  const float y = scaled_exp((v - k * kLn2Hi) - k * kLn2Lo, kr);  // |r| <= ln2/2 inside the clamp
  return v < -87.3f ? 0.0f : (v > 88.7f ? std::numeric_limits<float>::infinity() : y);
}

// exp_fp32 for v <= 0 (and NaN, which stays NaN): the softmax's exp(s - max). Without the overflow guard it is
// half the vector operations of exp_fp32 (whose clamps the compiler turns into masks and blends on every step),
// with the same accuracy. Wrong above v = 88.3 (the exponent overflows): never call it on anything but a score
// minus a maximum that is at least that score.
#pragma omp declare simd notinbranch
inline float exp_fp32_nonpositive(float v) {
  using namespace exp_fp32_detail;
  const float x = v < -87.3f ? -87.3f : v;  // keeps 2^k normal; NaN stays
  const float kr = x * kLog2e + kRound;
  const float k = kr - kRound;
  const float y = scaled_exp((x - k * kLn2Hi) - k * kLn2Lo, kr);
  return v < -87.3f ? 0.0f : y;
}

#if defined(__AVX512F__)
// exp_fp32_nonpositive on 16 lanes, for the AVX-512 copy of the kernels: the same reduction to r in
// [-ln2/2, ln2/2], with k = round(x · log2 e) by the rounding constant inside one FMA (vrndscaleps is two
// uops, both on port 0), a degree-6 polynomial fitted to e^r (relative error 2e-9 before rounding; Lawson's
// weighted least squares, not Taylor's degree 7) in Horner's form, and 2^k applied by vscalefps: 13 vector
// operations instead of the 16 uops of the Taylor/Estrin version, which made the softmax rows of a tile
// faster (docs/perf.md, CPU). Agrees with exp_fp32_nonpositive within their error, not bitwise.
inline __m512 exp_fp32_nonpositive_x16(__m512 v) {
  using namespace exp_fp32_detail;
  const __m512 floor = _mm512_set1_ps(-87.3f);
  const __m512 x = _mm512_max_ps(floor, v);  // vmaxps returns its second operand where either is NaN: NaN stays
  const __mmask16 normal = _mm512_cmp_ps_mask(v, floor, _CMP_NLT_UQ);  // v ≥ -87.3 or NaN; the rest gives 0
  const __m512 kr = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(kRound));  // k + kRound, k integral
  const __m512 k = _mm512_sub_ps(kr, _mm512_set1_ps(kRound));
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), x));
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(1.3836845755577087e-3f), r, _mm512_set1_ps(8.374815806746483e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.166822507977486e-2f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.16666419804096222f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.49999991059303284f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(normal, q, k);
}
#endif

// Reductions over a row keep kLanes partial results, one per vector lane, and fold them as a tree at the end:
// `#pragma omp simd reduction` folds its lanes one after another in scalar adds, a dependency chain that
// cost as much as the row's products when the softmax reduced every 64-wide tile row twice.
inline constexpr int64_t kLanes = 16;

// How many of a row's n elements whole kLanes-wide steps cover (0 for n <= 0): the bound of a reduction's
// vector loop, its scalar tail running from there, so that the compiler sees the tail run fewer than kLanes
// times. (With `i + kLanes <= n` and a tail from wherever i stopped, GCC 12 warned that the tail's iteration
// 2^62 - 1 invokes undefined behaviour wherever n was a compile-time multiple of kLanes, the tail never
// running at all: a false positive, as no n makes the tail run kLanes times or more.)
inline constexpr int64_t whole_lanes(int64_t n) { return n <= 0 ? 0 : n - n % kLanes; }

// The folds' combining steps, for scalars and for GCC/Clang vector types alike.
struct LaneSum {
  template <class V> V operator()(V a, V b) const { return a + b; }
};
struct LaneMax {  // NaN-dropping where a NaN is in `a` only: callers track NaN themselves
  template <class V> V operator()(V a, V b) const { return a > b ? a : b; }
};
struct LaneOr {
  template <class V> V operator()(V a, V b) const { return a | b; }
};

// The fold runs on GCC/Clang vector types (`combine` takes and returns them: LaneSum, LaneMax, LaneOr),
// halving the vector with a shuffle at each step, so that the lanes stay in registers: folding the array
// element by element went through the stack (stores of the whole vector, loads of its halves), a visible share
// of the forward's softmax (docs/perf.md, CPU).
template <class A, class Combine>
inline A fold_lanes(const A (&lanes)[kLanes], Combine combine) {
  typedef A V16 __attribute__((vector_size(16 * sizeof(A))));
  static_assert(kLanes == 16, "the shuffles below halve 16 lanes");
  V16 v16;
  std::memcpy(&v16, lanes, sizeof v16);
  const auto v8 = combine(__builtin_shufflevector(v16, v16, 0, 1, 2, 3, 4, 5, 6, 7),
                          __builtin_shufflevector(v16, v16, 8, 9, 10, 11, 12, 13, 14, 15));
  const auto v4 = combine(__builtin_shufflevector(v8, v8, 0, 1, 2, 3), __builtin_shufflevector(v8, v8, 4, 5, 6, 7));
  const auto v2 = combine(__builtin_shufflevector(v4, v4, 0, 1), __builtin_shufflevector(v4, v4, 2, 3));
  const A a = v2[0], b = v2[1];
  return combine(a, b);
}

// The largest of x[0..n), NaN if any is, -inf for n = 0; vectorised (a max_propagating_nan fold is not).
template <class A>
inline A row_max(const A* x, int64_t n) {
  A lanes[kLanes];
  int nan_lanes[kLanes] = {};
  for (A& l : lanes) l = -std::numeric_limits<A>::infinity();
  const int64_t whole = whole_lanes(n);
  for (int64_t i = 0; i < whole; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) {
      lanes[j] = x[i + j] > lanes[j] ? x[i + j] : lanes[j];
      nan_lanes[j] |= x[i + j] != x[i + j];
    }
  }
  for (int64_t i = whole; i < n; ++i) {
    lanes[0] = x[i] > lanes[0] ? x[i] : lanes[0];
    nan_lanes[0] |= x[i] != x[i];
  }
  if (fold_lanes(nan_lanes, LaneOr{})) return std::numeric_limits<A>::quiet_NaN();
  return fold_lanes(lanes, LaneMax{});
}

// The largest of the numbers among x[0..n): NaNs are skipped (-inf if there is no other element), for callers
// whose NaNs reach the result another way (the forward's softmax: through its row sum). Half the work of row_max.
template <class A>
inline A row_max_skipping_nan(const A* x, int64_t n);

#if defined(__AVX512F__)
// fp32 on AVX-512: four vectors of partial maxima, so that a 128-wide row is a chain two deep instead of eight (the
// chains and the fold after them were the latency that bound the forward's softmax rows).
template <>
inline float row_max_skipping_nan(const float* x, int64_t n) {
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = none, m1 = none, m2 = none, m3 = none;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {  // vmaxps returns its second operand (the partial maximum) where x is NaN
    m0 = _mm512_max_ps(_mm512_loadu_ps(x + i), m0);
    m1 = _mm512_max_ps(_mm512_loadu_ps(x + i + 16), m1);
    m2 = _mm512_max_ps(_mm512_loadu_ps(x + i + 32), m2);
    m3 = _mm512_max_ps(_mm512_loadu_ps(x + i + 48), m3);
  }
  for (; i + 16 <= n; i += 16) m0 = _mm512_max_ps(_mm512_loadu_ps(x + i), m0);
  float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}
#endif

template <class A>
inline A row_max_skipping_nan(const A* x, int64_t n) {
  A lanes[kLanes];
  for (A& l : lanes) l = -std::numeric_limits<A>::infinity();
  const int64_t whole = whole_lanes(n);
  for (int64_t i = 0; i < whole; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] = x[i + j] > lanes[j] ? x[i + j] : lanes[j];
  }
  for (int64_t i = whole; i < n; ++i) lanes[0] = x[i] > lanes[0] ? x[i] : lanes[0];
  return fold_lanes(lanes, LaneMax{});
}

}  // namespace FLASHLM_CPU_KERNELS_NS
}  // namespace flashlm
