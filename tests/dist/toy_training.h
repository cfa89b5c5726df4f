// The toy model's training (toy_model.h) shared by the data-parallel tests: the global batches, the
// unsharded AdamW with global-norm clipping, and kSteps of single-process training on the whole batch.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "dist/toy_model.h"
#include "flashlm/ddp.h"
#include "flashlm/model.h"
#include "optim/optimizer.h"

namespace toy {

inline constexpr int64_t kGlobalRows = 8;  // divisible by every world size (1, 2, 4) times grad_accum 2
inline constexpr int kSteps = 5;
inline constexpr double kLr = 1e-2;

inline flashlm::AdamWConfig toy_adamw() {
  flashlm::AdamWConfig c;
  c.max_grad_norm = 0.5;  // small enough to clip some steps
  return c;
}

// Step s's global batch, the same on every rank.
inline void global_batch(int64_t step, std::vector<int32_t>& tokens, std::vector<int32_t>& targets) {
  std::mt19937 rng(uint32_t(100 + step));
  std::uniform_int_distribution<int32_t> token(0, int32_t(V - 1));
  tokens.resize(kGlobalRows);
  targets.resize(kGlobalRows);
  for (int64_t i = 0; i < kGlobalRows; ++i) tokens[size_t(i)] = token(rng), targets[size_t(i)] = token(rng);
}

// Unsharded AdamW over the trainable parameters, with global-norm clipping: the single-process optimizer.
struct ToyAdamW {
  std::vector<float> m, v;
  int64_t steps = 0;

  void step(Model& model, const flashlm::AdamWConfig& c, double lr) {
    if (m.empty()) m.assign(model.w.size(), 0.0f), v.assign(model.w.size(), 0.0f);
    const std::vector<flashlm::DdpRange> ranges = model.params.trainable_ranges();
    double ss = 0;
    for (const flashlm::DdpRange& r : ranges) ss += flashlm::cpu::sum_squares(model.g.data() + r.offset, r.count);
    const double norm = std::sqrt(ss);
    ++steps;
    for (const flashlm::DdpRange& r : ranges) {
      float* g = model.g.data() + r.offset;
      if (norm > c.max_grad_norm) {
        for (int64_t i = 0; i < r.count; ++i) g[i] *= flashlm::cpu::clip_scale(norm, c.max_grad_norm);
      }
      flashlm::cpu::adamw_step(model.w.data() + r.offset, g, m.data() + r.offset, v.data() + r.offset, r.count, lr, c.beta1,
                      c.beta2, c.eps, c.weight_decay, steps);
    }
  }
};

// kSteps of full-batch training in this process alone, from rank 0's initial weights.
inline std::vector<float> train_single_process() {
  Model model(1);
  ToyAdamW adam;
  std::vector<int32_t> x, y;
  for (int64_t s = 0; s < kSteps; ++s) {
    global_batch(s, x, y);
    std::fill(model.g.begin(), model.g.end(), 0.0f);
    model.forward_backward(x, y);
    adam.step(model, toy_adamw(), kLr);
  }
  return model.w;
}

}  // namespace toy
