// The fused LM head + cross-entropy on the CPU (model/lm_head.h), and the argument checks both devices share.
#include "model/lm_head.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/check.h"
#include "model/ops_cpu.h"

namespace flashlm {

void check_lm_head_arguments(const char* fn, const void* h, const void* w, const int32_t* targets, int64_t n,
                             int64_t d, int64_t vocab, int64_t chunk, const void* dh, const float* dw,
                             const void* workspace) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  FLASHLM_CHECK(n >= 0, "{}: n = {}, expected >= 0", fn, n);
  FLASHLM_CHECK(d >= 1 && d <= std::numeric_limits<int>::max(), "{}: d = {}, expected in [1, 2^31)", fn, d);
  FLASHLM_CHECK(vocab >= 1 && vocab <= std::numeric_limits<int>::max(), "{}: vocab = {}, expected in [1, 2^31)", fn,
                vocab);
  FLASHLM_CHECK(chunk >= 1 && chunk <= std::numeric_limits<int>::max(), "{}: chunk = {}, expected in [1, 2^31)", fn,
                chunk);
  FLASHLM_CHECK(n <= kMax / d, "{}: n x d = {} x {} overflows", fn, n, d);
  FLASHLM_CHECK((dh == nullptr) == (dw == nullptr), "{}: dh and dw must both be given (gradients) or both be null",
                fn);
  if (n == 0) return;
  FLASHLM_CHECK(h && w && targets && workspace, "{}: h, w, targets and workspace must not be null", fn);
}

namespace cpu {

double lm_head_loss_forward_backward(const float* h, const float* w, const int32_t* targets, int64_t n, int64_t d,
                                     int64_t vocab, int64_t chunk, float grad_scale, float* dh, float* dw,
                                     float* workspace) {
  const char* fn = "cpu::lm_head_loss_forward_backward";
  check_lm_head_arguments(fn, h, w, targets, n, d, vocab, chunk, dh, dw, workspace);
  for (int64_t r = 0; r < n; ++r) {
    FLASHLM_CHECK(targets[r] >= 0 && targets[r] < vocab, "{}: targets[{}] = {}, expected in [0, {})", fn, r,
                  targets[r], vocab);
  }
  std::vector<double> row_loss(size_t(std::min(chunk, n)));
  double total = 0;
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t rows = std::min(chunk, n - r0);
    linear_forward(h + r0 * d, w, workspace, rows, d, vocab);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* z = workspace + r * vocab;
      const int32_t t = targets[r0 + r];
      const double lse = row_log_sum_exp(z, vocab);
      row_loss[size_t(r)] = lse - double(z[t]);
      if (dh) row_softmax_gradient(z, t, vocab, lse, grad_scale);
    }
    for (int64_t r = 0; r < rows; ++r) total += row_loss[size_t(r)];  // in row order, whatever the thread count
    if (dh) linear_backward(workspace, h + r0 * d, w, dh + r0 * d, dw, rows, d, vocab, /*accumulate_dx=*/false);
  }
  return n == 0 ? 0.0 : total / double(n);
}

}  // namespace cpu

}  // namespace flashlm
