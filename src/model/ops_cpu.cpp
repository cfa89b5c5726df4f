#include "model/ops_cpu.h"

#include "core/cpu_simd.h"
#include "model/blas_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace flashlm::cpu {

void linear_forward(const float* x, const float* w, float* y, int64_t n, int64_t in, int64_t out) {
  sgemm(false, true, n, out, in, 1.0f, x, in, w, in, 0.0f, y, out);
}

void linear_backward(const float* dy, const float* x, const float* w, float* dx, float* dw, int64_t n, int64_t in,
                     int64_t out, bool accumulate_dx) {
  if (dx) sgemm(false, false, n, in, out, 1.0f, dy, out, w, in, accumulate_dx ? 1.0f : 0.0f, dx, in);
  if (dw) sgemm(true, false, out, in, n, 1.0f, dy, out, x, in, 1.0f, dw, in);
}

void rmsnorm_forward(const float* x, const float* g, float* y, float* rstd, int64_t n, int64_t d, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * d;
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += double(xr[j]) * xr[j];
    const float s = float(1.0 / std::sqrt(ss / double(d) + eps));
    rstd[r] = s;
    for (int64_t j = 0; j < d; ++j) y[r * d + j] = xr[j] * s * g[j];
  }
}

void rmsnorm_backward(const float* dy, const float* x, const float* g, const float* rstd, float* dx, float* dg,
                      int64_t n, int64_t d) {
  // y_j = x_j s g_j with s = (mean(x²) + eps)^(-1/2):  dx_j = s g_j dy_j - x_j s³ (Σ_k dy_k g_k x_k) / d.
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * d;
    const float* dyr = dy + r * d;
    const float s = rstd[r];
    double dot = 0;
    for (int64_t j = 0; j < d; ++j) dot += double(dyr[j]) * g[j] * xr[j];
    const float c = float(dot) * s * s * s / float(d);
    for (int64_t j = 0; j < d; ++j) dx[r * d + j] += s * g[j] * dyr[j] - xr[j] * c;
  }
  // dg sums over rows: parallel over columns so that no two threads write one element.
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < d; ++j) {
    double acc = 0;
    for (int64_t r = 0; r < n; ++r) acc += double(dy[r * d + j]) * x[r * d + j] * rstd[r];
    dg[j] += float(acc);
  }
}

void rope_tables(float* cos, float* sin, int64_t context, int64_t head_dim, double theta) {
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < context; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = double(t) * std::pow(theta, -2.0 * double(i) / double(head_dim));
      cos[t * half + i] = float(std::cos(angle));
      sin[t * half + i] = float(std::sin(angle));
    }
  }
}

namespace {

// Rotates each interleaved pair by +angle (sign = 1) or -angle (sign = -1).
void rotate(float* x, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
            int64_t head_dim, float sign) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        float* xr = x + ((b * seq + t) * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float c = cos[t * half + i], s = sign * sin[t * half + i];
          const float x0 = xr[2 * i], x1 = xr[2 * i + 1];
          xr[2 * i] = x0 * c - x1 * s;
          xr[2 * i + 1] = x0 * s + x1 * c;
        }
      }
    }
  }
}

float sigmoid(float u) { return 1.0f / (1.0f + std::exp(-u)); }

}  // namespace

void rope_forward(float* x, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
                  int64_t head_dim) {
  rotate(x, cos, sin, batch, seq, heads, head_dim, 1.0f);
}

void rope_backward(float* dx, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
                   int64_t head_dim) {
  rotate(dx, cos, sin, batch, seq, heads, head_dim, -1.0f);  // a rotation's transpose is its inverse
}

void swiglu_forward(const float* u, const float* g, float* s, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) s[i] = u[i] * sigmoid(u[i]) * g[i];
}

void swiglu_backward(const float* ds, const float* u, const float* g, float* du, float* dg, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float sg = sigmoid(u[i]);
    const float silu = u[i] * sg;
    du[i] = ds[i] * g[i] * sg * (1.0f + u[i] * (1.0f - sg));  // d silu / du = σ(u)(1 + u(1 - σ(u)))
    dg[i] = ds[i] * silu;
  }
}

// The exponentials in fp32 (exp_fp32, vectorised; a few ulp) and the sum in fp64 lanes: libm's scalar exp
// in fp64 was half of the tiny model's step, and fp32 terms summed in fp64 keep the loss well inside the
// 1e-5 that the tests hold it to against PyTorch.
double row_log_sum_exp(const float* z, int64_t vocab) {
  const float m = row_max(z, vocab);
  // Chunks of exponentials in fp32 first, then their sum in fp64 lanes: in one loop the widening kept
  // GCC from vectorising either.
  constexpr int64_t kChunk = 256, kWide = 8;
  float e[kChunk];
  double lanes[kWide] = {};
  for (int64_t j0 = 0; j0 < vocab; j0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - j0);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) e[j] = exp_fp32(z[j0 + j] - m);
    int64_t j = 0;
    for (; j + kWide <= n; j += kWide) {
#pragma omp simd
      for (int64_t k = 0; k < kWide; ++k) lanes[k] += double(e[j + k]);
    }
    for (; j < n; ++j) lanes[0] += double(e[j]);
  }
  double sum = 0;
  for (double l : lanes) sum += l;
  return std::log(sum) + m;
}

void row_softmax_gradient(float* z, int32_t target, int64_t vocab, double log_sum_exp, float scale) {
#pragma omp simd
  for (int64_t j = 0; j < vocab; ++j) z[j] = exp_fp32(float(double(z[j]) - log_sum_exp)) * scale;
  z[target] -= scale;
}

// The rows' losses are summed in row order after the parallel loop: an OpenMP reduction combines the threads'
// partial sums in the order they finish, so the loss moved in its last bits from run to run and with the
// thread count (FsdpSharded.RankZeroEvaluatesAfterGatherParameters compares two losses bit for bit). The
// fused LM head (lm_head.cpp) sums its rows the same way.
double cross_entropy_forward(const float* logits, const int32_t* targets, int64_t n, int64_t vocab) {
  std::vector<double> row_loss(size_t(std::max<int64_t>(n, 0)));
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* z = logits + r * vocab;
    row_loss[size_t(r)] = row_log_sum_exp(z, vocab) - double(z[targets[r]]);
  }
  double total = 0;
  for (const double l : row_loss) total += l;
  return total / double(n);
}

void cross_entropy_backward(float* logits, const int32_t* targets, int64_t n, int64_t vocab) {
  const float inv_n = 1.0f / float(n);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    float* z = logits + r * vocab;
    row_softmax_gradient(z, targets[r], vocab, row_log_sum_exp(z, vocab), inv_n);
  }
}

void embedding_forward(const float* table, const int32_t* tokens, float* x, int64_t n, int64_t d) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) std::copy(table + int64_t(tokens[r]) * d, table + int64_t(tokens[r] + 1) * d, x + r * d);
}

void embedding_backward(const float* dx, const int32_t* tokens, float* dtable, int64_t n, int64_t d) {
  // Rows that share a token add into one row of dtable: parallel over columns, serial over rows.
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < d; ++j) {
    for (int64_t r = 0; r < n; ++r) dtable[int64_t(tokens[r]) * d + j] += dx[r * d + j];
  }
}

}  // namespace flashlm::cpu
