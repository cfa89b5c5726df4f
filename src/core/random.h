// Counter-based randomness: a value depends only on (key, counter), so streams need no saved state
// beyond their position (reproducible fills, resumable data order). constexpr, so that CUDA kernels call the
// same functions (--expt-relaxed-constexpr) and draw the host's bits.
#pragma once
#include <cstdint>

namespace flashlm {

// splitmix64's finaliser: a bijective 64-bit mix.
constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The counter-th draw of the stream `key`.
constexpr uint64_t counter_draw(uint64_t key, uint64_t counter) { return splitmix64(key ^ splitmix64(counter)); }

}  // namespace flashlm
