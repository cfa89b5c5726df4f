// How flash_attention_with_kvcache's CUDA split kernel (attention/cuda/decode.cu) divides one sequence's keys
// among its splits: shared by the kernel and the CPU tests of the arithmetic (test_attention_decode.cpp), which
// run where there is no GPU.
//
// Keys are read in tiles of kDecodeTileKeys keys that start at multiples of kDecodeTileKeys (so a 16-key group
// of a tile never crosses a page, whose size is a multiple of 16). The keys any query of the sequence sees,
// [lo, hi), are cut into num_splits runs of whole tiles counted from lo rounded down to a tile; split s reads
// the tiles from `begin` and keeps the keys [first, end) of them: every key of [lo, hi) in exactly one split,
// trailing splits possibly empty (tiles = 0).
#pragma once
#include <cstdint>

#include "core/host_device.h"

namespace flashlm {

constexpr int kDecodeTileKeys = 64;
// At most this many splits: the combine reads every split of a row, and more add no parallelism.
constexpr int64_t kDecodeMaxSplits = 128;
// A split takes at least this many keys (two tiles), so that its block amortises its start and its merge.
constexpr int64_t kDecodeMinKeysPerSplit = 2 * kDecodeTileKeys;

struct DecodeSplitRange {
  int begin;  // first key of the first tile (a multiple of kDecodeTileKeys)
  int first;  // keys [first, end) of the tiles belong to this split
  int end;
  int tiles;  // tiles read: [begin + i · kDecodeTileKeys, + kDecodeTileKeys) for i < tiles
};

// 0 <= lo <= hi: the sequence's visible keys; 1 <= num_splits; 0 <= split < num_splits. In 64 bits where a
// product or sum may pass the int32 range for a cache near it.
FLASHLM_HOST_DEVICE inline DecodeSplitRange decode_split_range(int lo, int hi, int num_splits, int split) {
  constexpr int64_t n = kDecodeTileKeys;
  const int64_t lo_tile = lo / n * n;
  const int64_t span = static_cast<int64_t>(hi) - lo_tile;
  const int64_t per_split = ((span + num_splits - 1) / num_splits + n - 1) / n * n;
  const int64_t begin = lo_tile + static_cast<int64_t>(split) * per_split;
  const int64_t first_unclamped = begin > lo ? begin : lo;
  const int64_t first = first_unclamped < hi ? first_unclamped : hi;
  const int64_t end = begin + per_split < hi ? begin + per_split : hi;
  DecodeSplitRange r{0, 0, 0, 0};
  if (first < end) {  // then begin < end <= hi fits an int
    r.begin = static_cast<int>(begin);
    r.first = static_cast<int>(first);
    r.end = static_cast<int>(end);
    r.tiles = static_cast<int>((end - begin + n - 1) / n);
  }
  return r;
}

}  // namespace flashlm
