// The persistent tile schedule of the Hopper forward kernels (flash_fwd_sm90.cu, flash_fwd_fp8_sm90.cu):
// one block per multiprocessor, block i taking work items i, i + gridDim.x, ... An item is a pair of query
// tiles of one (head, batch), the heaviest and the lightest left under a causal mask (tiles m and M - 1 - m),
// so that items cost about the same and a static schedule stays balanced; consecutive items stay within a
// head, so the blocks running at one time share its keys and values in L2.
#pragma once
#include <cstdint>

#include "attention/cuda/flash_common.cuh"

namespace flashlm::flash_cuda {

struct TileSchedule {
  int m_tiles, pairs_per_head, items;
  __device__ TileSchedule(const FlashParams& p, int block_m)
      : m_tiles((p.seq_q + block_m - 1) / block_m), pairs_per_head((m_tiles + 1) / 2),
        items(pairs_per_head * p.heads_q * p.batch) {}
  // The item count, on the host (the launch's grid; the kernels count items in 32-bit integers).
  static int64_t count(int64_t seq_q, int64_t heads_q, int64_t batch, int block_m) {
    const int64_t m_tiles = (seq_q + block_m - 1) / block_m;
    return (m_tiles + 1) / 2 * heads_q * batch;
  }
  // Query tile `half` (0 the heavier, 1 the lighter; -1 where the pair is one tile) of item `item`.
  __device__ int m_tile(int item, int half) const {
    const int pair = item % pairs_per_head;
    if (half == 0) return m_tiles - 1 - pair;
    return pair == m_tiles - 1 - pair ? -1 : pair;
  }
  __device__ int head(int item, const FlashParams& p) const { return (item / pairs_per_head) % p.heads_q; }
  __device__ int batch(int item, const FlashParams& p) const { return (item / pairs_per_head) / p.heads_q; }
};

}  // namespace flashlm::flash_cuda
