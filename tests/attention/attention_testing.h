// Test helpers shared by the CPU and GPU attention tests: tensors in every layout, the fp64 oracle
// and error metrics.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "flashlm/attention.h"

namespace flashlm::testing {

enum class Layout { bshd, bhsd, sliced };

inline std::string layout_name(Layout l) {
  return l == Layout::bshd ? "bshd" : l == Layout::bhsd ? "bhsd" : "sliced";
}

// A [B, N, H, D] view over owned storage laid out as asked: BSHD contiguous, BHSD contiguous (seen
// through a permutation) or a slice of a larger BSHD buffer (padded rows and head_dim).
struct LaidOut {
  Tensor storage;
  TensorView view;
};

inline LaidOut make_laid_out(Layout layout, int64_t B, int64_t N, int64_t H, int64_t D, DType dtype) {
  LaidOut t;
  switch (layout) {
    case Layout::bshd:
      t.storage = Tensor::empty({B, N, H, D}, dtype);
      t.view = t.storage.view();
      break;
    case Layout::bhsd:
      t.storage = Tensor::empty({B, H, N, D}, dtype);
      t.view = t.storage.view().permute({0, 2, 1, 3});
      break;
    case Layout::sliced:
      t.storage = Tensor::empty({B, N + 3, H, D + 8}, dtype);
      t.view = t.storage.view().slice(1, 2, 2 + N).slice(3, 0, D);
      break;
  }
  return t;
}

// Contiguous fp64 copy of any view.
inline Tensor to_f64(const TensorView& v) {
  Tensor t = Tensor::empty(std::span<const int64_t>(v.sizes.data(), static_cast<size_t>(v.ndim)), DType::f64);
  copy_into(t, v);
  return t;
}

// max |a - b| over two views of the same shape (NaN counts as infinite error).
inline double max_abs_diff(const TensorView& a, const TensorView& b) {
  Tensor x = to_f64(a), y = to_f64(b);
  double m = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double d = std::fabs(x.view().ptr<double>()[i] - y.view().ptr<double>()[i]);
    m = std::isnan(d) ? INFINITY : std::max(m, d);
  }
  return m;
}

inline double max_abs(const TensorView& a) {
  Tensor x = to_f64(a);
  double m = 0;
  for (int64_t i = 0; i < x.numel(); ++i) m = std::max(m, std::fabs(x.view().ptr<double>()[i]));
  return m;
}

inline bool all_finite_or_neg_inf(const TensorView& a) {
  Tensor x = to_f64(a);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double v = x.view().ptr<double>()[i];
    if (std::isnan(v) || v == INFINITY) return false;
  }
  return true;
}

}  // namespace flashlm::testing
