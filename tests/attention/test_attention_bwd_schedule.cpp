// The backward's work (attention/cuda/backward_tiles.h, the mma.sync and Hopper kernels' one count) and the Hopper
// persistent order (attention/cuda/hopper/bwd_schedule_sm90.h) on the CPU: the
// same functions the kernel runs, so that CI checks them where there is no GPU. The query tiles of a key block
// against a brute force over every (query, key) pair; the order against a stable sort of the tiles by their
// work. (The persistent kernel's blocks take positions from an atomic counter: every position below the
// tile count exactly once, whatever the timing.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "attention/cuda/hopper/bwd_schedule_sm90.h"

using namespace flashlm;

namespace {

// Whether query i sees key j under `m` (FlashParams' rules, written out the slow way).
bool visible(const BackwardMask& m, int i, int j) {
  if (j >= m.seq_k) return false;
  const int diag = i + m.causal_offset;
  if (m.masked) {
    return (m.window_right < 0 || j <= diag + m.window_right) && (m.window_left < 0 || j >= diag - m.window_left);
  }
  return !m.causal || j <= diag;
}

// Masks over ragged lengths: none, top-left and bottom-right causal (unmasked kernel), and the band kernel's
// windows: causal with a left window, two-sided without causal (the work rises, then falls), one side only,
// no window (soft-capping alone).
std::vector<BackwardMask> masks() {
  std::vector<BackwardMask> out;
  for (auto [nq, nk] : {std::pair{1, 1}, {17, 130}, {1000, 1000}, {300, 2100}, {2100, 300}, {1531, 2100}, {4096, 4096}}) {
    const int bottom_right = nk - nq;
    out.push_back({nq, nk, false, false, 0, -1, -1});
    out.push_back({nq, nk, true, false, 0, -1, -1});
    out.push_back({nq, nk, true, false, bottom_right, -1, -1});
    out.push_back({nq, nk, true, true, 0, 256, 0});
    out.push_back({nq, nk, true, true, bottom_right, 700, 0});
    out.push_back({nq, nk, false, true, 0, 300, 500});
    out.push_back({nq, nk, false, true, bottom_right, 64, 64});
    out.push_back({nq, nk, false, true, 0, 1000, -1});
    out.push_back({nq, nk, false, true, 0, -1, 200});
    out.push_back({nq, nk, false, true, 0, -1, -1});
  }
  return out;
}

}  // namespace

// backward_query_tiles: the first tile of the span holds a query that sees the block, and so does the last
// where the mask is a band; the unmasked kernel runs to the end of the queries (every later query sees the
// block too); a tile outside the span sees none of the block's keys.
TEST(HopperBackwardSchedule, QueryTilesOfAKeyBlockAreTheOnesThatSeeIt) {
  for (const BackwardMask& m : masks()) {
    for (auto [block_m, block_n] : {std::pair{64, 128}, {128, 128}}) {
      for (int n0 = 0; n0 < m.seq_k; n0 += block_n) {
        const QueryTileSpan span = backward_query_tiles(m, n0, block_m, block_n);
        std::vector<bool> sees((m.seq_q + block_m - 1) / block_m, false);
        for (int i = 0; i < m.seq_q; ++i) {
          for (int j = n0; j < std::min(n0 + block_n, m.seq_k); ++j) sees[i / block_m] = sees[i / block_m] || visible(m, i, j);
        }
        const int first = static_cast<int>(std::find(sees.begin(), sees.end(), true) - sees.begin());
        const int last = static_cast<int>(sees.rend() - std::find(sees.rbegin(), sees.rend(), true)) - 1;
        SCOPED_TRACE(::testing::Message() << "nq " << m.seq_q << " nk " << m.seq_k << " causal " << m.causal
                                          << " masked " << m.masked << " offset " << m.causal_offset << " window ("
                                          << m.window_left << ", " << m.window_right << ") block_m " << block_m
                                          << " n0 " << n0);
        if (first == static_cast<int>(sees.size())) {
          EXPECT_EQ(span.count, 0);
          continue;
        }
        EXPECT_EQ(span.first, first);
        EXPECT_EQ(span.first + span.count - 1, m.masked ? last : static_cast<int>(sees.size()) - 1);
        for (int tile = 0; tile < static_cast<int>(sees.size()); ++tile) {
          if (tile < span.first || tile >= span.first + span.count) {
            EXPECT_FALSE(sees[tile]) << "tile " << tile;
          }
        }
      }
    }
  }
}

// Every (key block, key head, batch) exactly once; within a section of pairs the work never rises along the
// order and each key block's pairs are consecutive; sections are whole pairs, each at most `section` of them;
// the order is that of a stable sort by descending work wherever the work rises and falls (some masks here
// have split > 0, where the merge of the two runs is what is tested).
TEST(HopperBackwardSchedule, OrderCoversEveryTileOnceHeaviestFirstWithinEachSection) {
  int splits = 0;
  for (const BackwardMask& m : masks()) {
    for (auto [heads_k, batch] : {std::pair{1, 1}, {2, 3}, {8, 1}, {5, 2}}) {
      for (int64_t pair_bytes : {int64_t{0}, kBackwardSectionBytes, kBackwardSectionBytes / 3, kBackwardSectionBytes * 4}) {
        const BackwardSchedule s = make_backward_schedule(m, 64, 128, heads_k, batch, pair_bytes);
        SCOPED_TRACE(::testing::Message() << "nq " << m.seq_q << " nk " << m.seq_k << " causal " << m.causal
                                          << " masked " << m.masked << " window (" << m.window_left << ", "
                                          << m.window_right << ") heads_k " << heads_k << " batch " << batch
                                          << " section " << s.section << " split " << s.split);
        ASSERT_EQ(s.tiles, s.key_blocks * heads_k * batch);
        ASSERT_GE(s.section, 1);
        ASSERT_LE(s.section, s.pairs);
        splits += s.split > 0;
        // The key block order alone: a permutation, by descending work, as a stable sort gives.
        std::vector<int> order(s.key_blocks), sorted(s.key_blocks);
        for (int k = 0; k < s.key_blocks; ++k) order[k] = s.key_block(k);
        for (int k = 0; k < s.key_blocks; ++k) sorted[k] = k;
        std::stable_sort(sorted.begin(), sorted.end(), [&](int a, int b) { return s.steps(a) > s.steps(b); });
        std::vector<int> seen = order;
        std::sort(seen.begin(), seen.end());
        for (int k = 0; k < s.key_blocks; ++k) ASSERT_EQ(seen[k], k) << "the key block order is not a permutation";
        for (int k = 0; k < s.key_blocks; ++k) EXPECT_EQ(s.steps(order[k]), s.steps(sorted[k])) << "position " << k;
        // The tiles.
        std::set<std::tuple<int, int, int>> tiles;
        int prev_section = -1, prev_steps = 0;
        for (int t = 0; t < s.tiles; ++t) {
          const BackwardTile tile = s.tile(t);
          ASSERT_GE(tile.n_block, 0);
          ASSERT_LT(tile.n_block, s.key_blocks);
          ASSERT_GE(tile.hk, 0);
          ASSERT_LT(tile.hk, heads_k);
          ASSERT_GE(tile.b, 0);
          ASSERT_LT(tile.b, batch);
          EXPECT_TRUE(tiles.insert({tile.n_block, tile.hk, tile.b}).second) << "tile " << t << " repeats";
          const int pair = tile.b * heads_k + tile.hk, section = pair / s.section;
          EXPECT_GE(section, prev_section) << "position " << t << " goes back to an earlier section";
          if (section == prev_section) {
            EXPECT_LE(s.steps(tile.n_block), prev_steps) << "position " << t;
          }
          prev_section = section;
          prev_steps = s.steps(tile.n_block);
        }
        EXPECT_EQ(static_cast<int>(tiles.size()), s.tiles);
      }
    }
  }
  EXPECT_GT(splits, 0) << "no mask here makes the work rise: the merge is untested";
}

// A small order written out: top-left causal, 4 key blocks of 128 over 512 queries in tiles of 64 (8, 6, 4
// and 2 query tiles), 2 key heads, batch 1, one section: the heaviest key block's two heads first.
TEST(HopperBackwardSchedule, CausalOrderStartsWithTheFirstKeyBlockOfEveryHead) {
  const BackwardMask m{512, 512, true, false, 0, -1, -1};
  const BackwardSchedule s = make_backward_schedule(m, 64, 128, 2, 1, 0);
  ASSERT_EQ(s.tiles, 8);
  const std::tuple<int, int, int> want[] = {{0, 0, 0}, {0, 1, 0}, {1, 0, 0}, {1, 1, 0},
                                            {2, 0, 0}, {2, 1, 0}, {3, 0, 0}, {3, 1, 0}};
  for (int t = 0; t < 8; ++t) {
    const BackwardTile tile = s.tile(t);
    EXPECT_EQ(std::make_tuple(tile.n_block, tile.hk, tile.b), want[t]) << "position " << t;
  }
  EXPECT_EQ(s.steps(0), 8);
  EXPECT_EQ(s.steps(3), 2);
  // Two-sided window without causal: the middle key blocks see the most query tiles and come first.
  const BackwardMask band{1024, 1024, false, true, 0, 256, 256};
  const BackwardSchedule w = make_backward_schedule(band, 64, 128, 1, 1, 0);
  EXPECT_GT(w.split, 0);
  EXPECT_GT(w.steps(w.key_block(0)), w.steps(0));
}
