// Token ids for the model tests: uniform random ones (or targets) in [0, vocab), reproducible per seed, and the
// GPU model tests' fixed batches.
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

// A batch of n tokens and targets in [0, vocab), a fixed pattern per seed (the GPU model tests' batches).
struct Batch {
  std::vector<int32_t> tokens, targets;
};

inline Batch make_batch(int64_t n, int64_t vocab, int seed) {
  Batch b;
  for (int64_t i = 0; i < n; ++i) {
    b.tokens.push_back(int32_t((i * 37 + seed * 11) % vocab));
    b.targets.push_back(int32_t((i * 53 + seed * 7 + 1) % vocab));
  }
  return b;
}
