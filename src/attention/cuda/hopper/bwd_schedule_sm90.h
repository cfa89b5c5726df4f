// The work of the Hopper backward's dK/dV kernel (flash_bwd_sm90.cu) and the order of its persistent launch:
// host and device code (FLASHLM_HOST_DEVICE), so that the CPU tests (test_attention_capabilities.cpp) check
// the very arithmetic the kernel runs, where there is no GPU.
//
// A tile is one (128-key block, key head, batch): the keys of one block of the kernel, which visits the
// query tiles of backward_query_tiles for each query head of the key head's group. Two launches run them:
//   grid        one block per tile, grid (key blocks, key heads, batch): the hardware hands out blocks in that
//               order as SMs free up.
//   persistent  min(tiles, SMs × blocks per SM) blocks; each block's producer thread takes the next position
//               of BackwardSchedule's order from a counter in global memory (atomicAdd) whenever its consumers
//               are about to finish a tile, so that the SMs that free up first take the next tile, as the
//               hardware does for the grid launch, but in the order below and without a block's prologue
//               (barrier set-up, descriptor prefetch, an empty pipeline) per tile.
// BackwardSchedule's order: the (key head, batch) pairs are cut into sections whose query-side tensors (Q, dO
// and the fp32 dQ accumulator of the pair's query heads) fit a share of L2 together; within a section, key
// blocks by descending work (longest-processing-time first: the last tiles to start are the lightest, so
// the SMs finish together), and within one key block the section's pairs one after another. Blocks running
// at one time thus share a few heads' Q and dO in L2 and add into different heads' dQ rows (the grid launch
// runs a head's key blocks side by side, whose dQ reduce-adds meet on the same rows unless a causal mask
// staggers them).
// Why taken from a counter, not a static walk (block i taking positions i, i + G, ...): the work falls
// along each section and rises again at the next, and a static walk over that saw-tooth gives some blocks
// the heavy starts of several sections. On a model of 132 SMs and the step counts, a static walk was 1.5
// to 1.9 times the grid launch's time at 4×16×4096×128, 32k and 64/8-head 16k causal; taken from the
// counter, 0.92, 1.00 and 1.00 of it.
#pragma once
#include <cstdint>

#include "attention/cuda/backward_tiles.h"
#include "core/host_device.h"

namespace flashlm {

// One unit of the kernel's work.
struct BackwardTile {
  int n_block, hk, b;
};

// The persistent launch's order (the file comment says why it is this one).
struct BackwardSchedule {
  BackwardMask mask;
  int block_m, block_n;
  int key_blocks;  // key blocks per (key head, batch)
  int heads_k;
  int pairs;       // (key head, batch) pairs: heads_k · batch, the key head the faster
  int section;     // pairs per L2 section (the last may have fewer)
  int split;       // the work is non-decreasing over key blocks [0, split] and non-increasing from there
  int tiles;       // key_blocks · pairs

  FLASHLM_HOST_DEVICE int steps(int n_block) const {
    return backward_query_tiles(mask, n_block * block_n, block_m, block_n).count;
  }

  // The key block at position k of the descending-work order: the merge of blocks split, split - 1, ..., 0
  // (run A, non-increasing work) with split + 1, ..., key_blocks - 1 (run B, non-increasing), A first on
  // ties. A binary search for how many of the first k positions come from A: log2(key_blocks) steps.
  FLASHLM_HOST_DEVICE int key_block(int k) const {
    if (split == 0) return k;  // the work never rises: block order is already descending
    const int na = split + 1, nb = key_blocks - na;
    int lo = k - nb > 0 ? k - nb : 0, hi = k < na ? k : na;
    while (lo < hi) {
      const int a = (lo + hi) / 2, b = k - a;
      // A's a-th (block split - a) comes before B's (b - 1)-th (block split + b): more than a come from A.
      if (steps(split - a) >= steps(split + b)) lo = a + 1;
      else hi = a;
    }
    const int a = lo, b = k - a;
    if (b >= nb || (a < na && steps(split - a) >= steps(split + 1 + b))) return split - a;
    return split + 1 + b;
  }

  // The tile at position t (0 <= t < tiles) of the order.
  FLASHLM_HOST_DEVICE BackwardTile tile(int t) const {
    const int per_section = section * key_blocks;
    const int s = t / per_section, local = t - s * per_section;
    const int in_section = pairs - s * section < section ? pairs - s * section : section;
    const int pair = s * section + local % in_section;
    return {key_block(local / in_section), pair % heads_k, pair / heads_k};
  }
};

// Each section's query-side tensors together within this many bytes: a third of an H100's or H200's 50 MB
// L2, the rest left to K and V, dK/dV's writes and what the copy engine has in flight.
constexpr int64_t kBackwardSectionBytes = int64_t{16} << 20;

// The schedule of a launch over heads_k key heads and `batch`, `pair_bytes` the bytes of Q, dO and the dQ
// accumulator of one (key head, batch) pair's query heads. The split is the first block of the most work
// where the work rises to it and falls after it (as every band does: its two edges move right with the key
// block); anything else gets split 0, block order, which is still every tile exactly once. The caller keeps
// key blocks × heads_k × batch within an int (flash_bwd_sm90.cu takes the grid launch above 2^30 tiles).
inline BackwardSchedule make_backward_schedule(const BackwardMask& mask, int block_m, int block_n, int heads_k,
                                               int batch, int64_t pair_bytes) {
  BackwardSchedule s{};
  s.mask = mask;
  s.block_m = block_m;
  s.block_n = block_n;
  s.key_blocks = (mask.seq_k + block_n - 1) / block_n;
  s.heads_k = heads_k;
  s.pairs = heads_k * batch;
  s.tiles = s.key_blocks * s.pairs;
  const int64_t fit = pair_bytes > 0 ? kBackwardSectionBytes / pair_bytes : s.pairs;
  s.section = fit < 1 ? 1 : (fit > s.pairs ? s.pairs : static_cast<int>(fit));
  int peak = 0;
  for (int n = 1; n < s.key_blocks; ++n) {
    if (s.steps(n) > s.steps(peak)) peak = n;
  }
  bool unimodal = true;
  for (int n = 1; n < s.key_blocks; ++n) {
    const int before = s.steps(n - 1), now = s.steps(n);
    unimodal = unimodal && (n <= peak ? now >= before : now <= before);
  }
  s.split = unimodal ? peak : 0;
  return s;
}

}  // namespace flashlm
