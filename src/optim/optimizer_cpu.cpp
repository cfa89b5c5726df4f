// The optimizer arithmetic on the CPU (optim/optimizer.h).
#include <cmath>

#include "optim/optimizer.h"

namespace flashlm::cpu {

double sum_squares(const float* x, int64_t n) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  return ss;
}

void adamw_step(float* w, const float* g, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step) {
  const double t = double(step);
  const float alpha = float(lr * std::sqrt(1.0 - std::pow(beta2, t)) / (1.0 - std::pow(beta1, t)));
  const float b1 = float(beta1), b2 = float(beta2), e = float(eps), decay = float(lr * weight_decay);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    w[i] -= alpha * m[i] / (std::sqrt(v[i]) + e);
    w[i] -= decay * w[i];
  }
}

}  // namespace flashlm::cpu
