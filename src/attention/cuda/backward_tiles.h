// The query tiles a backward key block visits, host and device code (FLASHLM_HOST_DEVICE): the one home of that
// arithmetic for the mma.sync dK/dV kernel (flash_bwd.cu) and the Hopper one with its persistent order
// (hopper/bwd_schedule_sm90.h), so that the CPU tests (test_attention_bwd_schedule.cpp) check what both kernels run.
#pragma once

#include "core/host_device.h"

namespace flashlm {

// A half-open range of query tiles, [first, first + count).
struct QueryTileSpan {
  int first, count;
};

// The query tiles of block_m rows in which some query sees a key of [key_first, key_last] under the band of
// the masked kernels (FlashParams::window_*: key j visible to query i iff i + causal_offset - window_left <=
// j <= i + causal_offset + window_right, -1 leaving a side unbounded).
FLASHLM_HOST_DEVICE inline QueryTileSpan band_query_tile_span(int seq_q, int seq_k, int causal_offset, int window_left,
                                                              int window_right, int key_first, int key_last,
                                                              int block_m) {
  if (key_first >= seq_k) return {0, 0};
  const int lo = key_first - causal_offset - window_right;
  const int hi = key_last - causal_offset + window_left + 1;
  const int begin = window_right < 0 ? 0 : (lo > 0 ? lo : 0);
  const int end = window_left < 0 ? seq_q : (hi < 0 ? 0 : (hi < seq_q ? hi : seq_q));
  if (end <= begin) return {0, 0};
  return {begin / block_m, (end + block_m - 1) / block_m - begin / block_m};
}

// The mask as the backward kernels see it (FlashParams' fields of these names); `masked` is the kernel's
// instantiation: the band's (window, soft-capping, ALiBi, sink), else the causal bound alone.
struct BackwardMask {
  int seq_q, seq_k;
  bool causal, masked;
  int causal_offset, window_left, window_right;
};

// The query tiles (of block_m rows) the key block of keys [n0, n0 + block_n) visits: from the first that sees
// one of its keys to the end of the queries (masked: to the band's last); none for a block past seq_k.
FLASHLM_HOST_DEVICE inline QueryTileSpan backward_query_tiles(const BackwardMask& m, int n0, int block_m, int block_n) {
  if (m.masked) {
    const int key_last = (n0 + block_n < m.seq_k ? n0 + block_n : m.seq_k) - 1;
    return band_query_tile_span(m.seq_q, m.seq_k, m.causal_offset, m.window_left, m.window_right, n0, key_last,
                                block_m);
  }
  if (n0 >= m.seq_k) return {0, 0};
  const int diag = n0 - m.causal_offset;
  const int first = m.causal ? (diag > 0 ? diag : 0) / block_m : 0;
  const int count = m.seq_q > first * block_m ? (m.seq_q - first * block_m + block_m - 1) / block_m : 0;
  return {first, count};
}

}  // namespace flashlm
