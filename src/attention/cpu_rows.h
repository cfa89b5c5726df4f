// Row loads and stores between any element type and the CPU kernels' accumulation type.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/cpu_simd.h"
#include "flashlm/dtype.h"

namespace flashlm {
inline namespace FLASHLM_CPU_KERNELS_NS {  // one copy per instruction set (attention/flash_cpu.cpp)

template <class A, class T>
inline void load_row(const T* src, A* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = convert<A>(src[i]);
}

template <class T, class A>
inline void store_row(const A* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = convert<T>(src[i]);
}

template <class A>
inline A dot(const A* a, const A* b, int64_t n) {
  A s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// max(a, b), NaN if either is: a NaN score must reach the row's softmax (as in PyTorch's SDPA) instead
// of being dropped by std::max/fmax, which return the other argument.
template <class A>
inline A max_propagating_nan(A a, A b) {
  return (a > b || a != a) ? a : b;
}

// y += alpha * x
template <class A>
inline void axpy(A alpha, const A* x, A* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// exp(v) for v <= 0 (or NaN) in the accumulation type: the forward's exp(score - running max) and the rescale
// exp(old max - new max). exp_fp32_nonpositive for fp32 (vectorisable, a few ulp), std::exp for fp64, the
// exact path the gradient checks rely on.
inline float exp_nonpositive(float v) { return exp_fp32_nonpositive(v); }
inline double exp_nonpositive(double v) { return std::exp(v); }

// x[i] = exp(x[i] - shift) over an array: the backward's P = exp(S - lse), which is at most 1 (lse is the
// log of a sum that includes exp(S)); in fp32 the argument is clamped to 0, which only drops the rounding
// of a recomputed S above lse (and keeps an inconsistent lse from overflowing), and exp_fp32_nonpositive
// needs no overflow guard. NaN stays NaN.
#if defined(__AVX512F__)
// The AVX-512 copy's: whole vectors through exp_fp32_nonpositive_x16, the tail as above.
inline void exp_shifted(float* x, int64_t n, float shift) {
  const __m512 s = _mm512_set1_ps(shift), zero = _mm512_setzero_ps();
  static_assert(kLanes == 16, "one zmm of floats per step");
  const int64_t whole = whole_lanes(n);
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 v = _mm512_sub_ps(_mm512_loadu_ps(x + i), s);
    _mm512_storeu_ps(x + i, exp_fp32_nonpositive_x16(_mm512_min_ps(zero, v)));  // vminps returns v where it is NaN
  }
  for (int64_t i = whole; i < n; ++i) {
    const float v = x[i] - shift;
    x[i] = exp_fp32_nonpositive(v > 0.0f ? 0.0f : v);
  }
}
#else
inline void exp_shifted(float* x, int64_t n, float shift) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] - shift;
    x[i] = exp_fp32_nonpositive(v > 0.0f ? 0.0f : v);
  }
}
#endif

inline void exp_shifted(double* x, int64_t n, double shift) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

// exp_shifted, returning the sum of the results (the forward's softmax denominator for the tile row), for a shift
// at least every x[i] (the row's running maximum): one pass, each result added to its lane's partial sum
// while it is still in a register.
template <class A>
inline A exp_shifted_sum(A* x, int64_t n, A shift);

#if defined(__AVX512F__)
// fp32 on AVX-512: four vectors of partial sums (a 128-wide row is a chain two deep, not eight), whole vectors
// through exp_fp32_nonpositive_x16; the tail one by one.
template <>
inline float exp_shifted_sum(float* x, int64_t n, float shift) {
  const __m512 s = _mm512_set1_ps(shift);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  auto exp_at = [&](int64_t i) {
    const __m512 e = exp_fp32_nonpositive_x16(_mm512_sub_ps(_mm512_loadu_ps(x + i), s));
    _mm512_storeu_ps(x + i, e);
    return e;
  };
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    s0 = _mm512_add_ps(s0, exp_at(i));
    s1 = _mm512_add_ps(s1, exp_at(i + 16));
    s2 = _mm512_add_ps(s2, exp_at(i + 32));
    s3 = _mm512_add_ps(s3, exp_at(i + 48));
  }
  for (; i + 16 <= n; i += 16) s0 = _mm512_add_ps(s0, exp_at(i));
  float tail = 0;
  for (; i < n; ++i) {
    x[i] = exp_nonpositive(x[i] - shift);
    tail += x[i];
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3))) + tail;
}
#endif

template <class A>
inline A exp_shifted_sum(A* x, int64_t n, A shift) {
  A lanes[kLanes] = {};
  const int64_t whole = whole_lanes(n);
  for (int64_t i = 0; i < whole; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) {
      const A e = exp_nonpositive(x[i + j] - shift);
      x[i + j] = e;
      lanes[j] += e;
    }
  }
  A tail = 0;  // not lanes[0]: a scalar store into the array before the fold's vector load stalls its forwarding
  for (int64_t i = whole; i < n; ++i) {
    x[i] = exp_nonpositive(x[i] - shift);
    tail += x[i];
  }
  return fold_lanes(lanes, LaneSum{}) + tail;
}

// Whether every element of an n-element array is finite: a tile product may then run over masked entries
// (their zero weights contribute exact zeros) instead of only the visible ones.
template <class A>
inline bool all_finite(const A* x, int64_t n) {
  A zero = 0;  // x · 0 is ±0 for finite x and NaN for inf or NaN; a sum vectorises where a branch would not
#pragma omp simd reduction(+ : zero)
  for (int64_t i = 0; i < n; ++i) zero += x[i] * A(0);
  return zero == A(0);
}

}  // namespace FLASHLM_CPU_KERNELS_NS
}  // namespace flashlm
