// FlashAttention backward for Hopper (sm_90a): the dK/dV kernel with dQ added atomically, on wgmma and TMA.
// The preprocess (Delta = rowsum(dO∘O), lse·log2e), the fp32 dQ accumulator and its conversion are the
// 16-bit backward's shared host code (run_flash_backward, cuda/flash_bwd.cu), which launches this kernel
// in place of the mma.sync one for the Hopper family.
//
// A block per (128-key block, key head, batch) tile (FLASHLM_SM90_BWD_SCHEDULE=grid), or a persistent grid
// whose blocks take tiles one after another from a counter over bwd_schedule_sm90.h's order, heaviest first
// (=persistent); three warpgroups.
// Warpgroup 0 is the producer: one thread loads each tile's K and V once (kv_full; in the persistent launch
// not before every consumer thread has released the last tile's, kv_empty), then streams the steps' tiles
// through a ring of kStages slots
// with TMA: a step is one query tile of one query head of the GQA group (Q, dO and their rows of
// lse·log2e and Delta, by a bulk copy), each slot guarded by a "full" mbarrier (the copy engine completes
// it) and an "empty" one (every consumer thread arrives once it has read the slot). Warpgroups 1 and 2 are
// consumers, each owning 64 of the block's keys, and compute per step, with the keys as the rows of every
// product so that dK and dV stay in registers:
//   Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ          wgmma, both operands K-major in shared memory
//   Pᵀ = exp2(Sᵀ·scale·log2e − lse2)    in registers (lse2 of the column's query)
//   dSᵀ = Pᵀ ∘ (dPᵀ − Delta)
//   dV += Pᵀ·dO, dK += dSᵀ·Q            wgmma, A from registers (Pᵀ, dSᵀ as 16-bit fragments), B N-major
//   dQ += dS·K                          dSᵀ stored to shared memory (both warpgroups' halves), read
//                                       M-major as A; each warpgroup takes half of dQ's tile (its columns
//                                       at d128, its query rows at d64). Each warp's 16 rows of it are one
//                                       contiguous 4 KB run of the accumulator (DqAccumLayout): the warp
//                                       stores them to shared memory and one lane adds them to global
//                                       memory with a bulk reduce-add (the copy engine, not 32 atomics a
//                                       thread).
// Every barrier is set up once per block and its phases run on from tile to tile: the ring's by the running
// step count, the dSᵀ double buffer's alternation too (so the dQ barrier's one-step bound holds across a tile
// boundary), K/V's (kv_full, kv_empty) one phase per tile. dK and dV go from registers to global memory, so a
// tile's epilogue shares no shared memory with the next tile's steps.
// Why a persistent launch: with causal masking the grid launch's blocks differ in cost (a key block's query
// tiles), and the hardware takes them in its own order, so the last wave can hold a heavy one; longest first,
// the tail is a few light tiles, and K/V's load overlaps the previous tile's epilogue. Non-causal tiles are
// equal, so only the per-tile prologue can move. The model's predictions and the measurements beside them:
// docs/perf.md, "A persistent backward".
// Rows past the ends of Q and K are zero-filled by TMA, query rows past seq_q have lse2 = +inf (P = 0), and
// keys at or past seq_k or above the causal diagonal are masked in Sᵀ; a key block no query sees writes
// zeros without loading anything. A sliding window or soft-capping (and a sink) take a masked
// instantiation, ALiBi a third one (flash_bwd_sm90_kernel's kMasked, kAlibi), so that the plain kernel
// carries none of their work.
// Q, K, V and O share one head dim here, 64 or 128. Head dim 256 and the forward's (192, 128) pair would hold
// a warpgroup's dK and dV (64 keys x the whole head dims) in 256 and 160 fp32 registers a thread before Sᵀ,
// dPᵀ and their fragments, past the 240 a consumer thread has: flash_bwd_wide_sm90.cu's kernel runs them,
// splitting those columns between the warpgroups (sm90_wide_backward, hopper.h).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <string_view>

#include "attention/backends.h"
#include "attention/capabilities.h"
#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper/bwd_schedule_sm90.h"
#include "attention/cuda/hopper/hopper.h"
#include "attention/cuda/hopper/sm90.cuh"
#include "attention/cuda/hopper/tma.h"
#include "core/check.h"
#include "core/cuda_check.h"
#include "core/env.h"
#include "flashlm/memory.h"

namespace flashlm {
namespace flash_cuda {
namespace {

template <int D>
struct Sm90BwdTraits {
  static constexpr int kBlockN = 128;                 // keys per block: 64 per consumer warpgroup
  static constexpr int kBlockM = D == 64 ? 128 : 64;  // queries per step (at d128 the registers allow 64)
  static constexpr int kStages = 2;
  static constexpr int kThreads = 3 * sm90::kWarpgroupThreads;
  static constexpr int kConsumerThreads = 2 * sm90::kWarpgroupThreads;
  static constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
  static constexpr uint32_t kTileBytes = kBlockM * D * 2;  // one Q or dO tile
  static constexpr uint32_t kRowBytes = kBlockM * 4;       // one tile's lse2 or Delta
  static constexpr uint32_t kStepBytes = 2 * kTileBytes + 2 * kRowBytes;
  static constexpr uint32_t kKVBytes = 2 * kBlockN * D * 2;
  static constexpr int kPanels = D / sm90::kPanelCols;
  static constexpr int kDqWarpFloats = 16 * 64;
  static_assert(kBlockM <= kRowPad, "the per-row arrays are padded to kRowPad rows");
  static_assert(kBlockM % sm90::kPanelCols == 0, "dSᵀ tiles are whole panels of queries");
};

template <int D>
struct Sm90BwdShared {
  using Tr = Sm90BwdTraits<D>;
  alignas(1024) uint16_t k[Tr::kBlockN * D];
  alignas(1024) uint16_t v[Tr::kBlockN * D];
  alignas(1024) uint16_t q[Tr::kStages][Tr::kBlockM * D];
  alignas(1024) uint16_t dout[Tr::kStages][Tr::kBlockM * D];
  // dSᵀ (keys x queries) of the last two steps: a warpgroup may store step i + 1's while the other still
  // reads step i's in its dQ product; the barrier before dQ keeps them at most one step apart.
  alignas(1024) uint16_t ds[2][Tr::kBlockN * Tr::kBlockM];
  // Each consumer warp's part of a step's dQ (16 rows x 64 columns, in DqAccumLayout's lane-major order) on its way to
  // the accumulator by a bulk reduce-add.
  alignas(128) float dq[Tr::kConsumerThreads / 32][Tr::kDqWarpFloats];
  alignas(16) float lse2[Tr::kStages][Tr::kBlockM];
  alignas(16) float delta[Tr::kStages][Tr::kBlockM];
  // kv_full: K and V of the block's current tile have landed; kv_empty: every consumer thread is done with
  // them (the persistent launch's next tile may load its own).
  sm90::Mbarrier kv_full, kv_empty, step_full[Tr::kStages], step_empty[Tr::kStages];
  BackwardTile tile;  // persistent launch: the tile whose K and V kv_full announces (key block -1: none)
};

template <int D>
constexpr size_t sm90_bwd_smem_bytes() {
  return sizeof(Sm90BwdShared<D>) + 1024;  // + room to align the dynamic shared-memory base to 1024
}
static_assert(sm90_bwd_smem_bytes<64>() <= 227 * 1024 && sm90_bwd_smem_bytes<128>() <= 227 * 1024,
              "an sm_90 block has at most 227 KB of shared memory");

// kMasked: the sliding-window / soft-capping instantiation (FlashParams::masked): query tiles outside the
// band skipped, Sᵀ soft-capped (dSᵀ times the cap's slope), tiles crossing the band's edge masked. kAlibi
// (with kMasked): the ALiBi instantiation, which adds the bias to the capped Sᵀ before the mask (the cap's
// slope taken without it, as in the mma.sync backward). A sink needs nothing here (the forward's lse holds
// it, so P = exp(S - lse) is already its softmax; its gradient is run_flash_backward's): a problem with a sink
// and no ALiBi takes the masked instantiation.
// kPersistent: the persistent launch, whose blocks take positions of `schedule` from *tile_counter (zeroed
// before the launch); without it a block runs the tile of its blockIdx and neither is used (an instantiation
// of its own, so that the grid launch carries none of the loop's registers: the producer thread has 24).
template <class T, int D, bool kMasked, bool kAlibi, bool kPersistent>
__global__ void __launch_bounds__(Sm90BwdTraits<D>::kThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                          const FlashParams p, const BackwardSchedule schedule, int* tile_counter) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tr = Sm90BwdTraits<D>;
  using Ring = sm90::RingSlot<Tr::kStages>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  extern __shared__ unsigned char smem_raw[];
  auto& s = sm90::aligned_shared<Sm90BwdShared<D>>(smem_raw);
  // Each tile's steps from this instantiation's mask (not the schedule's copy): producer and consumers count
  // them alike whatever order the schedule gives. A step is (head_in_group, m_idx), in that order.
  const BackwardMask mask{p.seq_q, p.seq_k, p.causal, kMasked, p.causal_offset, p.window_left, p.window_right};
  // The grid launch's one tile, from blockIdx.
  auto grid_tile = [] {
    return BackwardTile{static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
  };
  const int warpgroup = sm90::warpgroup_index();

  // The barriers live for the whole block: their phases run on from tile to tile (RingSlot over the running
  // step count; kv_full and kv_empty one phase per tile), so they are set up once.
  if (threadIdx.x == 0) {
    s.kv_full.init(1);
    s.kv_empty.init(Tr::kConsumerThreads);
#pragma unroll
    for (int st = 0; st < Tr::kStages; ++st) {
      s.step_full[st].init(1);
      s.step_empty[st].init(Tr::kConsumerThreads);
    }
    sm90::Mbarrier::fence_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- Producer.
    sm90::registers_decrease<Tr::kProducerRegisters>();
    if (threadIdx.x != 0) return;
    sm90::tma_prefetch_descriptor(&tm_q);
    sm90::tma_prefetch_descriptor(&tm_do);
    int step_base = 0;  // steps of this block's earlier tiles: the ring's running count
    for (int visit = 0;; ++visit) {
      // The block's next tile: the grid launch's one, or the next position of the order (taken while the
      // consumers still run the last tile's final steps, whose loads are all issued).
      // Each waits until the consumers are done with the last tile's K and V (and its coordinates); a fresh
      // barrier's "previous" phase lets the first tile through.
      BackwardTile tile;
      if constexpr (kPersistent) {
        int position = atomicAdd(tile_counter, 1);
        if (position >= schedule.tiles) position = -1;
        if (position >= 0) tile = schedule.tile(position);
        s.kv_empty.wait((visit & 1) ^ 1);
        // Handed over with kv_full's phase (the arrival releases it, the consumers' wait acquires it), as
        // coordinates, so that the consumers need none of the schedule's arithmetic; a key block of -1 tells
        // them that there is no other tile.
        s.tile = position < 0 ? BackwardTile{-1, 0, 0} : tile;
        if (position < 0) {
          s.kv_full.arrive();
          break;
        }
      } else {
        if (visit > 0) break;
        tile = grid_tile();
        s.kv_empty.wait(1);
      }
      const int n0 = tile.n_block * kBlockN;
      const QueryTileSpan range = backward_query_tiles(mask, n0, kBlockM, kBlockN);
      const int steps = range.count * p.group;
      // K and V overwrite the last tile's (its dQ products read K up to its last step). A tile of no steps
      // loads nothing but still completes one phase of each barrier, so that both sides count phases by tiles.
      if (steps == 0) {
        s.kv_full.arrive();
        continue;
      }
      s.kv_full.arrive_expect_tx(Tr::kKVBytes);
#pragma unroll
      for (int panel = 0; panel < Tr::kPanels; ++panel) {
        sm90::tma_load_4d(s.k + panel * kBlockN * sm90::kPanelCols, &tm_k, s.kv_full, panel * sm90::kPanelCols, n0,
                          tile.hk, tile.b);
        sm90::tma_load_4d(s.v + panel * kBlockN * sm90::kPanelCols, &tm_v, s.kv_full, panel * sm90::kPanelCols, n0,
                          tile.hk, tile.b);
      }
      // The producer thread has kProducerRegisters: (key head, batch) and the step's query head and tile are
      // worked out again at each step rather than carried.
      for (int step = 0; step < steps; ++step) {
        const Ring slot{step_base + step};
        const int st = slot.stage();
        const int b = tile.b, h = tile.hk * p.group + step / range.count;
        const int m0 = (range.first + step % range.count) * kBlockM;
        s.step_empty[st].wait(slot.parity() ^ 1);
        s.step_full[st].arrive_expect_tx(Tr::kStepBytes);
#pragma unroll
        for (int panel = 0; panel < Tr::kPanels; ++panel) {
          sm90::tma_load_4d(s.q[st] + panel * kBlockM * sm90::kPanelCols, &tm_q, s.step_full[st],
                            panel * sm90::kPanelCols, m0, h, b);
          sm90::tma_load_4d(s.dout[st] + panel * kBlockM * sm90::kPanelCols, &tm_do, s.step_full[st],
                            panel * sm90::kPanelCols, m0, h, b);
        }
        const int64_t row_base = (int64_t(b) * p.heads_q + h) * p.seq_q_padded + m0;  // padded: in bounds
        sm90::bulk_load(s.lse2[st], p.lse_log2 + row_base, Tr::kRowBytes, s.step_full[st]);
        sm90::bulk_load(s.delta[st], p.delta + row_base, Tr::kRowBytes, s.step_full[st]);
      }
      step_base += steps;
    }
    return;
  }

  // ---- Consumers: warpgroup wg owns keys [n0 + 64·wg, n0 + 64·wg + 64).
  sm90::registers_increase<Tr::kConsumerRegisters>();
  using GemmS = sm90::WgmmaM64<T, kBlockM>;  // Sᵀ, dPᵀ: 64 keys x kBlockM queries
  using GemmKV = sm90::WgmmaM64<T, D>;       // dV, dK: 64 keys x D
  using GemmQ = sm90::WgmmaM64<T, 64>;       // this warpgroup's half of dQ: 64 queries x 64 columns
  const int wg = warpgroup - 1;
  const int ctid = threadIdx.x % sm90::kWarpgroupThreads, warp = ctid / 32, lane = ctid % 32, g = lane / 4, t = lane % 4;
  const int key0 = 64 * wg;  // within the block
  // The half of dQ's tile this warpgroup computes: at d128 all 64 query rows and columns [64·wg, +64);
  // at d64 query rows [64·wg, +64) and all 64 columns. As panels of the dSᵀ tile (A) and of K (B).
  constexpr bool kSplitColumns = D == 128;
  const int dq_query_panel = kSplitColumns ? 0 : wg, dq_col_panel = kSplitColumns ? wg : 0;

  // The current tile's coordinates, read where they are used rather than carried across the step loop: the
  // persistent launch's loop state costs consumer registers, which dK and dV fill (s.tile changes only once
  // every consumer thread has arrived on kv_empty; the grid launch's come from blockIdx, as they always did).
  auto tile_now = [&] {
    if constexpr (kPersistent) return s.tile;
    else return grid_tile();
  };
  int step_base = 0;  // steps of this block's earlier tiles, as the producer counts them
  for (int visit = 0;; ++visit) {
    // The tile's K and V (persistent: and its coordinates) are in shared memory. The grid launch's block has
    // one tile: it must not wait for a second phase, which nobody completes.
    BackwardTile tile;
    if constexpr (kPersistent) {
      s.kv_full.wait(visit & 1);
      tile = s.tile;
      if (tile.n_block < 0) break;
    } else {
      if (visit > 0) break;
      s.kv_full.wait(0);
      tile = grid_tile();
    }
    const QueryTileSpan range = backward_query_tiles(mask, tile.n_block * kBlockN, kBlockM, kBlockN);
    const int steps = range.count * p.group;

    float dv[D / 2], dk[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dv[i] = dk[i] = 0.f;

    int head_in_group = 0, m_idx = 0;
    for (int step = 0; step < steps; ++step) {
      const Ring slot{step_base + step};
      const int st = slot.stage();
      const BackwardTile cur = tile_now();
      const int n0 = cur.n_block * kBlockN;
      const int key_row = n0 + key0 + 16 * warp + g;  // this thread's keys: key_row and key_row + 8
      const int head_row = cur.b * p.heads_q + cur.hk * p.group + head_in_group;  // (b, h) of the step
      const int m0 = (range.first + m_idx) * kBlockM;
      if (++m_idx == range.count) {
        m_idx = 0;
        ++head_in_group;
      }
      s.step_full[st].wait(slot.parity());

      float sacc[kBlockM / 2], dpacc[kBlockM / 2];
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        GemmS::template ss<0>(sacc, sm90::k_major_descriptor(s.k, kBlockN, key0, kk),
                              sm90::k_major_descriptor(s.q[st], kBlockM, 0, kk), kk > 0);
      }
      sm90::wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        GemmS::template ss<0>(dpacc, sm90::k_major_descriptor(s.v, kBlockN, key0, kk),
                              sm90::k_major_descriptor(s.dout[st], kBlockM, 0, kk), kk > 0);
      }
      sm90::wgmma_commit();

      // Pᵀ while dPᵀ runs. Accumulator i: key key_row + 8·((i / 2) % 2), query m0 + 8·(i / 4) + 2t + i % 2.
      sm90::wgmma_wait<1>();
      sm90::fence_accumulators(sacc);
      // Soft-capped (masked kernel): the cap, the mask and Pᵀ wait for dPᵀ, each element's slope being read
      // from its capped score (capping here, with dPᵀ's registers in flight, spilled at head dim 64). ALiBi
      // (kAlibi, a slope other than 0) takes the same late path, the bias added to the capped score.
      static_assert(kMasked || !kAlibi, "ALiBi takes the masked instantiation");
      bool capped = false, late = false, in_band = true;
      float slope_raw = 0.f;  // a constant 0 outside kAlibi
      if constexpr (kMasked) {
        capped = p.softcap > 0;
        if constexpr (kAlibi) slope_raw = alibi_slope_raw(p, head_row / p.heads_q, head_row % p.heads_q);
        late = capped || slope_raw != 0.f;
        in_band = tile_in_band(p, m0, m0 + kBlockM - 1, n0 + key0, n0 + key0 + 63);
        if (!late && !in_band) {
#pragma unroll
          for (int i = 0; i < kBlockM / 2; ++i) {
            const int key = key_row + 8 * ((i / 2) % 2), query = m0 + 8 * (i / 4) + 2 * t + (i % 2);
            sacc[i] = key_in_band(p, query, key) ? sacc[i] : -INFINITY;
          }
        }
      } else {
        if (scores_need_mask(p, m0, n0 + key0, 64)) {
#pragma unroll
          for (int i = 0; i < kBlockM / 2; ++i) {
            const int key = key_row + 8 * ((i / 2) % 2), query = m0 + 8 * (i / 4) + 2 * t + (i % 2);
            sacc[i] = key >= p.seq_k || (p.causal && key > query + p.causal_offset) ? -INFINITY : sacc[i];
          }
        }
      }
      const float* lse2 = s.lse2[st];
      const float* delta = s.delta[st];
      if (!late) {
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * j + 2 * t);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            sacc[4 * j + e] = fast_exp2(fmaf(sacc[4 * j + e], p.scale_log2, e % 2 ? -l2.y : -l2.x));
          }
        }
        sm90::keep_above_wgmma_wait(sacc[kBlockM / 2 - 1], -p.scale_log2);  // Pᵀ (>= 0) under dPᵀ
      }
      // dSᵀ = Pᵀ ∘ (dPᵀ − Delta), as 16-bit A fragments beside Pᵀ's, and stored to shared memory for dQ.
      sm90::wgmma_wait<0>();
      sm90::fence_accumulators(dpacc);
      uint32_t pa[kBlockM / 16][4], dsa[kBlockM / 16][4];
      uint16_t* ds_tile = s.ds[(step_base + step) & 1];  // running: the alternation spans tiles
      // The cap, the bias, the mask, Pᵀ, then dSᵀ = Pᵀ ∘ (dPᵀ − Delta) ∘ (1 − tanh²), from the capped Sᵀ.
      if (late) {
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * j + 2 * t);
          const float2 dl = *reinterpret_cast<const float2*>(delta + 8 * j + 2 * t);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = 4 * j + e;
            const int key = key_row + 8 * ((i / 2) % 2), query = m0 + 8 * (i / 4) + 2 * t + (i % 2);
            float x = sacc[i];
            if (!kAlibi || capped) x = softcap_score(p, x);  // outside kAlibi, late means capped
            if constexpr (kAlibi) x += alibi_bias_raw(p, slope_raw, query, key);
            if (!in_band && !key_in_band(p, query, key)) x = -INFINITY;
            const float pr = fast_exp2(fmaf(x, p.scale_log2, e % 2 ? -l2.y : -l2.x));
            float ds = pr * (dpacc[4 * j + e] - (e % 2 ? dl.y : dl.x));
            if (!kAlibi || capped) ds *= softcap_slope_biased(p, x, slope_raw, query, key);
            dpacc[4 * j + e] = ds;
            sacc[4 * j + e] = pr;
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          const float2 dl = *reinterpret_cast<const float2*>(delta + 8 * j + 2 * t);
#pragma unroll
          for (int e = 0; e < 4; ++e) dpacc[4 * j + e] = sacc[4 * j + e] * (dpacc[4 * j + e] - (e % 2 ? dl.y : dl.x));
        }
      }
      // Fragment e of k-step kk is the 8 x 8 matrix of key rows key0 + 16·warp + 8·(e % 2) + [0, 8) and queries
      // 16·kk + 8·(e / 2) + [0, 8): one stmatrix stores a k-step's four, lane l addressing row l % 8 of
      // fragment l / 8 (a matrix row is one 16-byte chunk of the swizzled tile).
      const int ds_row = key0 + 16 * warp + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          pa[kk][e] = MmaOp<T>::pack(sacc[8 * kk + 2 * e], sacc[8 * kk + 2 * e + 1]);
          dsa[kk][e] = MmaOp<T>::pack(dpacc[8 * kk + 2 * e], dpacc[8 * kk + 2 * e + 1]);
        }
        sm90::stmatrix_x4(sm90::smem_u32(ds_tile) + sm90::swizzled_offset(kBlockN, ds_row, 16 * kk + 8 * (lane / 16)),
                          dsa[kk][0], dsa[kk][1], dsa[kk][2], dsa[kk][3]);
      }
      sm90::fence_proxy_async_shared();  // dSᵀ is read by wgmma (the async proxy) after the barrier below

      // dV += Pᵀ·dO, dK += dSᵀ·Q.
      sm90::fence_accumulators(dv);
      sm90::fence_accumulators(dk);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        GemmKV::template rs<1>(dv, pa[kk], sm90::mn_major_descriptor(s.dout[st], kBlockM, kk), 1);
      }
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        GemmKV::template rs<1>(dk, dsa[kk], sm90::mn_major_descriptor(s.q[st], kBlockM, kk), 1);
      }
      sm90::wgmma_commit();

      // This warpgroup's half of dQ = dS·K, once both halves of dSᵀ are stored.
      sm90::named_barrier_sync(sm90::NamedBarrier::kBackwardDsReady, Tr::kConsumerThreads);
      float dq[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) dq[i] = 0.f;
      sm90::fence_accumulators(dq);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        GemmQ::template ss<1, 1>(dq, sm90::mn_major_descriptor(ds_tile + dq_query_panel * kBlockN * sm90::kPanelCols,
                                                               kBlockN, kk),
                                 sm90::mn_major_descriptor(s.k + dq_col_panel * kBlockN * sm90::kPanelCols, kBlockN, kk),
                                 1);
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_accumulators(dv);
      sm90::fence_accumulators(dk);
      sm90::fence_accumulators(dq);
      // The register fragments were read by the asynchronous dV/dK products: keep them live until here.
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(pa[kk][e]), "+r"(dsa[kk][e])::"memory");
      }
      s.step_empty[st].arrive();  // Q, dO, lse2 and Delta of this slot are no longer read

      // The accumulator is in fragment order (DqAccumLayout, lane-major): warp `warp` holds rows 16·warp +
      // [0, 16) of this warpgroup's half, its 8 n8 tiles consecutive blocks of 128 floats (both at d128, where
      // the half is 64 of the 128 columns, and at d64, where it is all of them), element (lane, e) at lane·4 + e.
      static_assert(8 * DqAccumLayout<D>::kBlockFloats == Tr::kDqWarpFloats);
      float* dq_stage = s.dq[warpgroup * 4 - 4 + warp];
      if (lane == 0) sm90::bulk_wait_read<0>();  // the last step's reduce has read this warp's buffer
      __syncwarp();
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // DqOrder::lane_major: element (lane, e) of n8 tile j at j·128 + lane·4 + e
        reinterpret_cast<float4*>(dq_stage + j * DqAccumLayout<D>::kBlockFloats)[lane] =
            make_float4(dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
      }
      sm90::fence_proxy_async_shared();
      __syncwarp();
      if (lane == 0) {
        float* dst = p.dq_accum + int64_t(head_row) * p.seq_q_padded * D +
                     DqAccumLayout<D>::block(m0 + 64 * dq_query_panel + 16 * warp, 64 * dq_col_panel);
        sm90::bulk_reduce_add_f32(dst, dq_stage, Tr::kDqWarpFloats * 4);
        sm90::bulk_commit();
      }
    }
    const BackwardTile done = tile_now();  // before the arrival lets the producer write the next tile's
    s.kv_empty.arrive();  // every wgmma of the tile has completed: K and V are no longer read
    step_base += steps;
    const int b = done.b, hk = done.hk;
    const int key_row = done.n_block * kBlockN + key0 + 16 * warp + g;

    // dK carries the softmax scale (S = scale·QKᵀ; dk_scale with descales); keys past seq_k are not written.
    // Accumulator i: key key_row + 8·((i / 2) % 2), column 8·(i / 4) + 2t + i % 2.
    T* dk_head = static_cast<T*>(p.dk) + b * p.dk_st.b + hk * p.dk_st.h;
    T* dv_head = static_cast<T*>(p.dv) + b * p.dv_st.b + hk * p.dv_st.h;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = key_row + 8 * r;
      if (key >= p.seq_k) continue;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const int col = 8 * j + 2 * t;
        store_pair(dk_head + key * p.dk_st.s + col, dk[4 * j + 2 * r] * p.dk_scale,
                   dk[4 * j + 2 * r + 1] * p.dk_scale);
        store_pair(dv_head + key * p.dv_st.s + col, dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
      }
    }
  }
  if (lane == 0) sm90::bulk_wait<0>();  // every reduce complete (and its shared memory read) before exit
#endif
}

// Blocks of flash_bwd_sm90_kernel one SM holds at once, asked once: the instantiations share the shared
// memory, the thread count and __launch_bounds__(kThreads, 1), so the plain persistent one answers for all.
template <class T, int D>
int sm90_backward_blocks_per_sm() {
  static const int blocks = [] {
    constexpr auto kernel = flash_bwd_sm90_kernel<T, D, false, false, true>;
    FLASHLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(sm90_bwd_smem_bytes<D>())),
                       "flash_bwd_sm90_kernel: shared-memory opt-in");
    int n = 0;
    FLASHLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel,
                                                                     Sm90BwdTraits<D>::kThreads,
                                                                     sm90_bwd_smem_bytes<D>()),
                       "flash_bwd_sm90_kernel: occupancy");
    FLASHLM_CHECK(n > 0, "flash_bwd_sm90_kernel: no block fits an SM");
    return n;
  }();
  return blocks;
}

// The instantiation for f's variants: ALiBi, else the band's (window, soft-capping, sink), else the plain one.
template <class T, int D, bool kPersistent>
auto backward_kernel(const FlashParams& f) {
  return f.alibi_slopes != nullptr ? flash_bwd_sm90_kernel<T, D, true, true, kPersistent>
         : f.masked                ? flash_bwd_sm90_kernel<T, D, true, false, kPersistent>
                                   : flash_bwd_sm90_kernel<T, D, false, false, kPersistent>;
}

template <class T, int D>
void launch(const FlashParams& f, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& v,
            const CUtensorMap& dout, Sm90BackwardSchedule schedule, cudaStream_t stream) {
  using Tr = Sm90BwdTraits<D>;
  constexpr int kSmem = static_cast<int>(sm90_bwd_smem_bytes<D>());
  auto allow_smem = [](auto kernel) {
    FLASHLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                       "flash_bwd_sm90_kernel: shared-memory opt-in");
    return kernel;
  };
  const int key_blocks = (f.seq_k + Tr::kBlockN - 1) / Tr::kBlockN;
  const int64_t tiles = int64_t{key_blocks} * f.heads_k * f.batch;
  // Positions are ints, and the counter passes the tile count by up to a grid: a launch with more tiles
  // (2^30: a billion keys a head) keeps the grid launch.
  if (schedule == Sm90BackwardSchedule::persistent && tiles <= INT32_MAX / 2) {
    auto kernel = allow_smem(backward_kernel<T, D, true>(f));
    // Q, dO (two T) and the fp32 dQ accumulator of the pair's query heads, padded rows (what the schedule's
    // L2 sections hold).
    const int64_t pair_bytes = int64_t{f.group} * f.seq_q_padded * D * (2 * int64_t{sizeof(T)} + 4);
    const bool masked = f.alibi_slopes != nullptr || f.masked;  // the instantiation's kMasked
    const BackwardMask mask{f.seq_q, f.seq_k, f.causal, masked, f.causal_offset, f.window_left, f.window_right};
    const BackwardSchedule order = make_backward_schedule(mask, Tr::kBlockM, Tr::kBlockN, f.heads_k, f.batch,
                                                          pair_bytes);
    const int64_t resident = int64_t{sm90_multiprocessors()} * sm90_backward_blocks_per_sm<T, D>();
    const int blocks = static_cast<int>(std::min(tiles, resident));
    // The positions handed out so far; freed on the stream after the kernel.
    Buffer counter = Buffer::allocate_on_stream(sizeof(int), "flash backward tile counter", stream);
    FLASHLM_CUDA_CHECK(cudaMemsetAsync(counter.data(), 0, sizeof(int), stream), "flash backward tile counter clear");
    kernel<<<blocks, Tr::kThreads, kSmem, stream>>>(q, k, v, dout, f, order, static_cast<int*>(counter.data()));
  } else {
    auto kernel = allow_smem(backward_kernel<T, D, false>(f));
    const dim3 grid(key_blocks, f.heads_k, f.batch);
    kernel<<<grid, Tr::kThreads, kSmem, stream>>>(q, k, v, dout, f, BackwardSchedule{}, nullptr);
  }
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_bwd_sm90_kernel launch");
}

struct Sm90BackwardMaps {
  CUtensorMap q, k, v, dout;
};

// Calls fn(std::integral_constant<int, D>{}) for the problem's head dim, from the capability table's list.
template <class Fn>
bool with_backward_head_dim(int64_t head_dim, Fn&& fn) {
  // The wide head dims are flash_bwd_wide_sm90.cu's.
  if (sm90_wide_backward(head_dim, head_dim)) return false;
  return with_head_dim<kHopperBackwardHeadDims>(head_dim, [&](auto dim) {
    // The head groups of run_flash_backward are sized by the mma.sync kernel's key tile.
    constexpr int D = decltype(dim)::value;
    if constexpr (!sm90_wide_backward(D, D)) {
      static_assert(Sm90BwdTraits<D>::kBlockN == mma_sync_backward_block_n(D));
      fn(dim);
    }
  });
}

std::optional<Sm90BackwardMaps> plan_backward_sm90(const AttentionProblem& p, const TensorView& q,
                                                   const TensorView& k, const TensorView& v, const TensorView& dout) {
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return std::nullopt;
  // One head dim for Q, K, V and their gradients: the pairs are the wide kernel's.
  if (p.value_dim() != p.head_dim) return std::nullopt;
  int block_m = 0, block_n = 0;
  const bool compiled = with_backward_head_dim(p.head_dim, [&](auto dim) {
    block_m = Sm90BwdTraits<dim.value>::kBlockM;
    block_n = Sm90BwdTraits<dim.value>::kBlockN;
  });
  if (!compiled) return std::nullopt;
  if (p.batch == 0 || p.seq_q == 0 || p.seq_k == 0 || p.heads_q == 0) return std::nullopt;
  if (p.batch > 65535 || p.heads_k > 65535) return std::nullopt;  // grid y and z
  if (sm90_multiprocessors() == 0) return std::nullopt;
  auto tq = sm90::rows_tensor_map(q, block_m), tdo = sm90::rows_tensor_map(dout, block_m);
  auto tk = sm90::rows_tensor_map(k, block_n), tv = sm90::rows_tensor_map(v, block_n);
  if (!tq || !tk || !tv || !tdo) return std::nullopt;
  return Sm90BackwardMaps{*tq, *tk, *tv, *tdo};
}

// The dK/dV part of one head group of run_flash_backward (BackwardDkdvLauncher).
void launch_backward_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& dout, const FlashParams& f, cudaStream_t stream) {
  // A group's views are the covered views' slices of heads: the same strides, a 16-byte aligned start.
  const auto maps = plan_backward_sm90(p, q, k, v, dout);
  FLASHLM_CHECK(maps.has_value(), "attention_backward: the Hopper backward declined a part of a problem it covered");
  const Sm90BackwardSchedule schedule = sm90_backward_schedule_for(sm90_backward_schedule(), p.head_dim);
  auto run = [&]<class T>(T) {
    with_backward_head_dim(p.head_dim, [&](auto dim) {
      launch<T, dim.value>(f, maps->q, maps->k, maps->v, maps->dout, schedule, stream);
    });
  };
  if (p.dtype == DType::bf16) run(__nv_bfloat16{});
  else run(__half{});
}

}  // namespace

Sm90BackwardSchedule sm90_backward_schedule() {
  const std::string_view value = env_choice(kSm90BackwardSchedule);
  if (value == "grid") return Sm90BackwardSchedule::grid;
  if (value == "persistent") return Sm90BackwardSchedule::persistent;
  return Sm90BackwardSchedule::automatic;
}

Sm90BackwardSchedule sm90_backward_schedule_for(Sm90BackwardSchedule requested, int64_t head_dim) {
  if (requested != Sm90BackwardSchedule::automatic) return requested;
  return head_dim == 64 ? Sm90BackwardSchedule::persistent : Sm90BackwardSchedule::grid;
}

}  // namespace flash_cuda

bool flash_backward_sm90_covers(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                const TensorView& v, const TensorView& dout) {
  if (flash_cuda::sm90_wide_backward(p.head_dim, p.value_dim())) {
    return flash_cuda::wide_backward_sm90_covers(p, q, k, v, dout);
  }
  return flash_cuda::plan_backward_sm90(p, q, k, v, dout).has_value();
}

void flash_attention_backward_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& o, const TensorView& lse,
                                   const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                   const TensorView& dv, void* stream) {
  // flash_kernel_family checked flash_backward_sm90_covers; each head group's launch checks its part.
  const flash_cuda::BackwardDkdvLauncher dkdv = flash_cuda::sm90_wide_backward(p.head_dim, p.value_dim())
                                                    ? flash_cuda::launch_wide_backward_sm90
                                                    : flash_cuda::launch_backward_sm90;
  flash_cuda::run_flash_backward(p, q, k, v, o, lse, dout, dq, dk, dv, false, dkdv, stream);
}

}  // namespace flashlm
