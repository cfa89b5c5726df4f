// The decoder tests' model (test_decoder.cpp, test_paged_decoder.cpp): ragged sizes and parameters that make
// every one of them matter.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "flashlm/model.h"

// Vocab 61 and context 23 (with pages of 16: two, the last partly filled), four heads of 8.
inline flashlm::ModelConfig ragged_decoder_config() {
  flashlm::ModelConfig c = flashlm::ModelConfig::named("tiny", 23, 61);
  c.d_model = 32;
  c.heads = 4;
  c.d_ff = 48;
  c.layers = 2;
  return c;
}

// The standard initialisation with the weights scaled by `weight_scale` (above 1: the logits spread and
// attention is far from uniform) and the norm gains drawn from [0.5, 1.5].
inline std::vector<float> decoder_test_parameters(const flashlm::ModelConfig& c, uint64_t seed, float weight_scale) {
  const auto layout = flashlm::parameter_layout(c);
  std::vector<float> p(size_t(c.parameter_count()));
  flashlm::init_parameters_host(layout, p.data(), seed);
  std::mt19937 rng{static_cast<unsigned>(seed)};
  std::uniform_real_distribution<float> gain(0.5f, 1.5f);
  for (const auto& info : layout) {
    for (int64_t i = 0; i < info.numel(); ++i) {
      float& x = p[size_t(info.offset + i)];
      x = info.shape.size() == 1 ? gain(rng) : x * weight_scale;
    }
  }
  return p;
}
