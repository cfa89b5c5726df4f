// Uniform random token ids (or targets) in [0, vocab) for the model tests, reproducible per seed.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

inline std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, int32_t(vocab - 1));
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = dist(rng);
  return t;
}
