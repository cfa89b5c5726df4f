// A toy model for the data-parallel tests, small enough to train in microseconds and shaped to exercise what
// DDP must get right: a frozen parameter, a tied one, and gradients that become ready one layer at a time.
//
//   x = E[token]          token embedding E [V, D], tied to the output projection ("head")
//   y = F x               F [D, D], frozen: no gradient, never updated
//   h = tanh(W1 y)        W1 [H, D]
//   z = W2 h + x          W2 [D, H], a residual
//   logits = E z          the head: E again, so E's gradient has two contributions
//
// CPU fp32, mean cross-entropy over the rows; forward_backward() accumulates the gradients and reports each
// parameter ready through `hook` as soon as its gradient is final (the head first, the embedding last).
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "flashlm/ddp.h"

namespace toy {

constexpr int64_t V = 16, D = 8, H = 12;
enum Param : int64_t { kEmbed = 0, kFrozen = 1, kFc1 = 2, kFc2 = 3, kHead = 4 };

struct Model {
  flashlm::DdpParameters params;
  std::vector<float> w, g;  // flat parameters and gradients
  flashlm::GradientReadyHook hook;

  explicit Model(uint64_t seed) {
    auto& L = params.layout;
    L.push_back({"embed.weight", 0, {V, D}});
    L.push_back({"frozen.weight", V * D, {D, D}});
    L.push_back({"fc1.weight", V * D + D * D, {H, D}});
    L.push_back({"fc2.weight", V * D + D * D + H * D, {D, H}});
    L.push_back({"head.weight", 0, {V, D}});  // E itself
    params.trainable = {true, false, true, true, true};
    params.tied_to = {-1, -1, -1, -1, kEmbed};
    w.assign(size_t(params.flat_size()), 0.0f);
    g.assign(w.size(), 0.0f);
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& x : w) x = 0.4f * normal(rng);
    float* f = at(kFrozen);
    for (int64_t i = 0; i < D; ++i) f[i * D + i] += 1.0f;  // near the identity
  }

  float* at(Param p) { return w.data() + params.layout[size_t(p)].offset; }
  float* grad(Param p) { return g.data() + params.layout[size_t(p)].offset; }
  void ready(Param p) {
    if (hook) hook(p, p);
  }

  // Mean cross-entropy of the rows (token -> target); gradients added to g.
  double forward_backward(std::span<const int32_t> tokens, std::span<const int32_t> targets) {
    const auto n = int64_t(tokens.size());
    const float *E = at(kEmbed), *F = at(kFrozen), *W1 = at(kFc1), *W2 = at(kFc2);
    std::vector<float> x(size_t(n * D)), y(x.size()), h(size_t(n * H)), z(x.size()), p(size_t(n * V));
    double loss = 0;
    for (int64_t i = 0; i < n; ++i) {
      float *xi = &x[size_t(i * D)], *yi = &y[size_t(i * D)], *hi = &h[size_t(i * H)], *zi = &z[size_t(i * D)];
      for (int64_t k = 0; k < D; ++k) xi[k] = E[tokens[size_t(i)] * D + k];
      for (int64_t a = 0; a < D; ++a) {
        yi[a] = 0;
        for (int64_t k = 0; k < D; ++k) yi[a] += F[a * D + k] * xi[k];
      }
      for (int64_t j = 0; j < H; ++j) {
        float s = 0;
        for (int64_t k = 0; k < D; ++k) s += W1[j * D + k] * yi[k];
        hi[j] = std::tanh(s);
      }
      for (int64_t a = 0; a < D; ++a) {
        zi[a] = xi[a];
        for (int64_t j = 0; j < H; ++j) zi[a] += W2[a * H + j] * hi[j];
      }
      float* pi = &p[size_t(i * V)];
      float mx = -1e30f;
      for (int64_t v = 0; v < V; ++v) {
        pi[v] = 0;
        for (int64_t k = 0; k < D; ++k) pi[v] += E[v * D + k] * zi[k];
        mx = std::max(mx, pi[v]);
      }
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(double(pi[v] - mx));
      loss += std::log(sum) + mx - pi[targets[size_t(i)]];
      for (int64_t v = 0; v < V; ++v) pi[v] = float(std::exp(double(pi[v] - mx)) / sum);  // softmax
    }
    // Backward, one layer at a time for all rows.
    std::vector<float> dz(x.size()), da(h.size());
    float* gE = grad(kEmbed);
    for (int64_t i = 0; i < n; ++i) {
      float* pi = &p[size_t(i * V)];
      pi[targets[size_t(i)]] -= 1.0f;
      for (int64_t v = 0; v < V; ++v) pi[v] /= float(n);  // d loss / d logits
      for (int64_t v = 0; v < V; ++v) {
        for (int64_t k = 0; k < D; ++k) {
          gE[v * D + k] += pi[v] * z[size_t(i * D + k)];
          dz[size_t(i * D + k)] += pi[v] * E[v * D + k];
        }
      }
    }
    ready(kHead);  // its half of E's gradient: E is not final yet
    float* gW2 = grad(kFc2);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t a = 0; a < D; ++a) {
        for (int64_t j = 0; j < H; ++j) {
          gW2[a * H + j] += dz[size_t(i * D + a)] * h[size_t(i * H + j)];
          da[size_t(i * H + j)] += dz[size_t(i * D + a)] * W2[a * H + j];
        }
      }
    }
    ready(kFc2);
    float* gW1 = grad(kFc1);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < H; ++j) {
        const float hj = h[size_t(i * H + j)];
        const float daj = da[size_t(i * H + j)] * (1 - hj * hj);
        for (int64_t k = 0; k < D; ++k) gW1[j * D + k] += daj * y[size_t(i * D + k)];
      }
    }
    ready(kFc1);
    for (int64_t i = 0; i < n; ++i) {
      std::vector<float> dy(size_t(D), 0.0f);
      for (int64_t j = 0; j < H; ++j) {
        const float hj = h[size_t(i * H + j)];
        const float daj = da[size_t(i * H + j)] * (1 - hj * hj);
        for (int64_t k = 0; k < D; ++k) dy[size_t(k)] += daj * W1[j * D + k];
      }
      for (int64_t k = 0; k < D; ++k) {
        float s = dz[size_t(i * D + k)];  // through the residual
        for (int64_t a = 0; a < D; ++a) s += F[a * D + k] * dy[size_t(a)];
        gE[tokens[size_t(i)] * D + k] += s;
      }
    }
    ready(kEmbed);  // both contributions are in: E is final
    return loss / double(n);
  }
};

}  // namespace toy
