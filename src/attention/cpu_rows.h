// Row loads and stores between any element type and the CPU kernels' accumulation type.
#pragma once
#include <cstdint>

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

// y += alpha * x
template <class A>
inline void axpy(A alpha, const A* x, A* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace flashlm
