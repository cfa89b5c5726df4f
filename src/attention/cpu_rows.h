// Row loads and stores between any element type and the CPU kernels' accumulation type.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "flashlm/dtype.h"

namespace flashlm {

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

// The largest of x[0..n), NaN if any is, -inf for n = 0; vectorised (a max_propagating_nan fold is not).
template <class A>
inline A row_max(const A* x, int64_t n) {
  A largest = -std::numeric_limits<A>::infinity();
  int any_nan = 0;
#pragma omp simd reduction(max : largest) reduction(| : any_nan)
  for (int64_t i = 0; i < n; ++i) {
    largest = x[i] > largest ? x[i] : largest;
    any_nan |= x[i] != x[i];
  }
  return any_nan ? std::numeric_limits<A>::quiet_NaN() : largest;
}

// y += alpha * x
template <class A>
inline void axpy(A alpha, const A* x, A* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// x[i] = exp(x[i] - shift) over an array, for the softmax tiles. fp32 takes a polynomial that the compiler
// vectorises (std::exp is a scalar libm call and was most of the CPU kernel's time); fp64 keeps std::exp,
// the exact path the gradient checks rely on. Relative error of the fp32 form ~2e-7 (a few ulp); exp(-inf)
// = 0, NaN stays NaN, underflow below e^-87.3 gives 0 (std::exp would give a denormal), overflow inf.
inline void exp_shifted(float* x, int64_t n, float shift) {
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] - shift;
    float t = v * kLog2e;
    t = t != t ? 0.0f : (t < -126.0f ? -126.0f : (t > 127.0f ? 127.0f : t));  // keeps the int conversion defined
    const float k = (t + kRound) - kRound;
    const float r = (v - k * kLn2Hi) - k * kLn2Lo;  // |r| <= ln2/2
    float q = 1.0f / 5040;  // Taylor terms to r^7: below fp32's rounding on |r| <= ln2/2
    q = q * r + 1.0f / 720;
    q = q * r + 1.0f / 120;
    q = q * r + 1.0f / 24;
    q = q * r + 1.0f / 6;
    q = q * r + 0.5f;
    q = q * r + 1.0f;
    q = q * r + 1.0f;
    const float y = q * std::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
    x[i] = v != v ? v : (v < -87.3f ? 0.0f : (v > 88.7f ? std::numeric_limits<float>::infinity() : y));
  }
}

inline void exp_shifted(double* x, int64_t n, double shift) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - shift);
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

}  // namespace flashlm
