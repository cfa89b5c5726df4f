// The optimizer arithmetic on the CPU (optim/optimizer.h).
#include "optim/optimizer.h"

#include <bit>

#include "core/check.h"

namespace flashlm::cpu {

namespace {

// One element, in the header's order (the CPU build does not contract a * b + c into a fused multiply-add:
// ISO C++ mode, -ffp-contract=off).
inline void adamw_element(float& w, float g, float& m, float& v, const AdamWScalars& a) {
  if (a.grad_scale != 1.0f) g *= a.grad_scale;
  m = a.b1 * m + a.one_minus_b1 * g;
  v = a.b2 * v + a.one_minus_b2 * g * g;
  w -= a.alpha * m / (std::sqrt(v) + a.eps);
  w -= a.decay * w;
}

void check_step(const char* fn, int64_t n, int64_t step) {
  FLASHLM_CHECK(n >= 0, "{}: n = {}, expected >= 0", fn, n);
  FLASHLM_CHECK(step >= 1, "{}: step = {}, expected >= 1 (1-based)", fn, step);
}

}  // namespace

double sum_squares(const float* x, int64_t n) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  return ss;
}

double sum_squares(const bf16_t* x, int64_t n) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = float(x[i]);
    ss += v * v;
  }
  return ss;
}

void adamw_step(float* w, const float* g, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step) {
  check_step("cpu::adamw_step", n, step);
  const AdamWScalars a = adamw_scalars(lr, beta1, beta2, eps, weight_decay, step);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) adamw_element(w[i], g[i], m[i], v[i], a);
}

void adamw_step_bf16(bf16_t* w, const bf16_t* g, bf16_t* m, bf16_t* v, int64_t n, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step, float grad_scale) {
  check_step("cpu::adamw_step_bf16", n, step);
  const AdamWScalars a = adamw_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float wi = float(w[i]), mi = float(m[i]), vi = float(v[i]);
    adamw_element(wi, float(g[i]), mi, vi, a);
    w[i] = bf16_t(wi);
    m[i] = bf16_t(mi);
    v[i] = bf16_t(vi);
  }
}

void adamw_step_bf16_moments(float* w, const float* g, bf16_t* m, bf16_t* v, int64_t n, double lr, double beta1,
                             double beta2, double eps, double weight_decay, int64_t step, MomentRounding rounding,
                             int64_t first_index) {
  check_step("cpu::adamw_step_bf16_moments", n, step);
  FLASHLM_CHECK(first_index >= 0, "cpu::adamw_step_bf16_moments: first_index = {}, expected >= 0", first_index);
  const AdamWScalars a = adamw_scalars(lr, beta1, beta2, eps, weight_decay, step);
  const uint64_t key = moment_rounding_key(rounding.seed, step);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float mi = float(m[i]), vi = float(v[i]);
    adamw_element(w[i], g[i], mi, vi, a);
    if (rounding.stochastic) {
      const uint64_t r = counter_draw(key, uint64_t(first_index + i));
      m[i].bits = bf16_bits_stochastic(std::bit_cast<uint32_t>(mi), uint32_t(r));
      v[i].bits = bf16_bits_stochastic(std::bit_cast<uint32_t>(vi), uint32_t(r >> 16));
    } else {
      m[i] = bf16_t(mi);
      v[i] = bf16_t(vi);
    }
  }
}

}  // namespace flashlm::cpu
