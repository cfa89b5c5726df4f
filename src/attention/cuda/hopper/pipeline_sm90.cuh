// The warp-specialised pipeline shared by the Hopper forward kernels (flash_fwd_sm90.cu for fp16/bf16,
// flash_fwd_fp8_sm90.cu for e4m3): one block per SM walking TileSchedule's query-tile pairs, a producer
// warpgroup whose one thread streams Q and the K/V blocks through an mbarrier ring with TMA, and two or
// three consumer warpgroups of 64 query rows each that take turns issuing their GEMMs, issuing S of key
// block n with P·V of block n - 1 so that the softmax of n runs under that GEMM. flash_fwd_sm90.cu's file comment describes
// the pipeline; this file holds its control flow once, and each kernel supplies what differs through a
// "kernel" type (a struct holding its shared memory and tensor maps) with:
//   constants  kBlockM (64 · kConsumers), kBlockN, kStages, kConsumers, kThreads, kConsumerThreads, kProducerRegisters,
//              kConsumerRegisters, kOValues (O accumulators a thread holds), kQBytes, kKBytes, kVBytes;
//   types      Softmax (a WgmmaRowSoftmax), PFragments (P of a key block as wgmma A fragments);
//   barriers() the ForwardBarriers<kStages> in its shared memory;
//   producer   prefetch_descriptors(), load_q(m0, h, b), load_k(stage, n0, hk, b), load_v(stage, n0, hk, b):
//              the TMA copies of one tile or slot, completing on the barrier the pipeline armed;
//   consumer   start_tile(softmax, p, b, h) (after the softmax's reset, before the tile's first key block: what
//              the kernel keeps per tile, the FP8 kernel's descales); gemm_s(sacc, stage, wg), gemm_pv(o, pa,
//              stage): the wgmma instructions of one GEMM (the pipeline fences and commits around them);
//              pack_p(pa, sacc); o_scale() (what O is multiplied by besides 1 / rowsum); store_o(o, inv, p, tile)
//              (the normalised rows out); consumer_exit(ctid).
#pragma once
#include <cstdint>

#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper/schedule_sm90.cuh"
#include "attention/cuda/hopper/sm90.cuh"

namespace flashlm::flash_cuda {

// Q's tile and the K/V ring's slots, each a "full" barrier (completed by the copy engine) and an "empty"
// one (every consumer thread arrives once it has read the tile or slot).
template <int kStages>
struct ForwardBarriers {
  sm90::Mbarrier q_full, q_empty, k_full[kStages], k_empty[kStages], v_full[kStages], v_empty[kStages];

  // By one thread, before any use; followed by a block-wide barrier.
  __device__ __forceinline__ void init(uint32_t consumer_threads) {
    q_full.init(1);
    q_empty.init(consumer_threads);
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      k_full[st].init(1);
      v_full[st].init(1);
      k_empty[st].init(consumer_threads);
      v_empty[st].init(consumer_threads);
    }
    sm90::Mbarrier::fence_init();
  }
};

// The forward kernels' shared memory: sm90::aligned_shared's struct, forward_smem_bytes its size with the room
// for the rounding.
template <class Shared>
constexpr size_t forward_smem_bytes() {
  return sizeof(Shared) + 1024;
}

// The rows of one query tile that a consumer thread works on, for the epilogue.
struct ForwardTileRows {
  int b, h;
  int wg, wg_row0;  // the consumer warpgroup and its first query row
  int row0;         // this thread's rows: row0 and row0 + 8
  int ctid, warp, g, t;  // thread in the warpgroup, its warp, and its lane as 4g + t
};

// Key blocks [first, first + count) query tile [m0, m0 + kBlockM) sees (none: the tile is written as zeros
// without loading anything). The masked kernels (Softmax::kMasked) take the band's blocks, the others the
// causal bound alone.
struct ForwardKeyBlocks {
  int first, count;
};
template <int kBlockM, int kBlockN, bool kMasked>
__device__ __forceinline__ ForwardKeyBlocks forward_key_blocks(const FlashParams& p, int m0) {
  const int last_row = min(m0 + kBlockM, p.seq_q) - 1;
  const TileRange tiles = visited_key_tiles<kMasked>(p, m0, last_row, kBlockN);
  return {tiles.first, tiles.count()};
}

// ---- Producer: one thread issues every copy. Q of a tile is loaded once the consumers have released the
// previous tile's (q_empty), and the K/V ring runs on across tiles, so the next tile's first loads overlap
// the current tile's last GEMMs and epilogue.
template <class Kernel>
__device__ __forceinline__ void forward_producer(Kernel& kernel, const FlashParams& p, const TileSchedule& schedule) {
  using Ring = sm90::RingSlot<Kernel::kStages>;
  auto& bar = kernel.barriers();
  kernel.prefetch_descriptors();
  int q_uses = 0, kv_uses = 0;
  for (int item = blockIdx.x; item < schedule.items; item += gridDim.x) {
    const int h = schedule.head(item, p), b = schedule.batch(item, p), hk = h / p.group;
    for (int half = 0; half < 2; ++half) {
      const int m_tile = schedule.m_tile(item, half);
      if (m_tile < 0) break;
      const int m0 = m_tile * Kernel::kBlockM;
      const ForwardKeyBlocks blocks =
          forward_key_blocks<Kernel::kBlockM, Kernel::kBlockN, Kernel::Softmax::kMasked>(p, m0);
      const int n_blocks = blocks.count;
      if (n_blocks == 0) continue;
      bar.q_empty.wait((q_uses++ & 1) ^ 1);
      bar.q_full.arrive_expect_tx(Kernel::kQBytes);
      kernel.load_q(m0, h, b);
      for (int nb = 0; nb < n_blocks; ++nb) {
        const Ring slot{kv_uses++};
        const int st = slot.stage();
        bar.k_empty[st].wait(slot.parity() ^ 1);
        bar.k_full[st].arrive_expect_tx(Kernel::kKBytes);
        kernel.load_k(st, (blocks.first + nb) * Kernel::kBlockN, hk, b);
        bar.v_empty[st].wait(slot.parity() ^ 1);
        bar.v_full[st].arrive_expect_tx(Kernel::kVBytes);
        kernel.load_v(st, (blocks.first + nb) * Kernel::kBlockN, hk, b);
      }
    }
  }
}

// ---- Consumers: warpgroup wg (0 to kConsumers - 1) owns query rows [m0 + 64·wg, m0 + 64·wg + 64) of each
// tile.
template <class Kernel>
__device__ __forceinline__ void forward_consumer(Kernel& kernel, const FlashParams& p, const TileSchedule& schedule,
                                                 int wg) {
  using Ring = sm90::RingSlot<Kernel::kStages>;
  constexpr int kBlockM = Kernel::kBlockM, kBlockN = Kernel::kBlockN;
  auto& bar = kernel.barriers();
  const int ctid = threadIdx.x % sm90::kWarpgroupThreads, warp = ctid / 32, lane = ctid % 32;
  const int g = lane / 4, t = lane % 4;

  // Ping-pong: the consumer warpgroups take turns, in a ring, to issue their GEMMs, so that one's softmax
  // runs while the others' GEMMs occupy the tensor cores. Warpgroup w waits for its turn on barrier
  // kWarpgroupTurn0 + w (its own 128 threads and the previous warpgroup's) and, having issued, hands the
  // turn to the next. In each tile the last warpgroup hands warpgroup 0 the first turn and skips its own
  // last hand-over (nobody would wait for it).
  static_assert(Kernel::kConsumers == 2 || Kernel::kConsumers == 3, "named barriers exist for 3 warpgroups");
  static_assert(kBlockM == 64 * Kernel::kConsumers);
  constexpr int kLast = Kernel::kConsumers - 1;
  constexpr uint32_t kTurnThreads = 2 * sm90::kWarpgroupThreads;
  const auto my_turn = static_cast<sm90::NamedBarrier>(static_cast<uint32_t>(sm90::NamedBarrier::kWarpgroupTurn0) + wg);
  const auto next_turn = static_cast<sm90::NamedBarrier>(static_cast<uint32_t>(sm90::NamedBarrier::kWarpgroupTurn0) +
                                                         (wg == kLast ? 0 : wg + 1));

  float o[Kernel::kOValues];
  float sacc[kBlockN / 2];
  typename Kernel::PFragments pa;  // P of the previous key block
  typename Kernel::Softmax softmax;
  int q_uses = 0, kv_uses = 0;

  for (int item = blockIdx.x; item < schedule.items; item += gridDim.x) {
    const int h = schedule.head(item, p), b = schedule.batch(item, p);
    for (int half = 0; half < 2; ++half) {
      const int m_tile = schedule.m_tile(item, half);
      if (m_tile < 0) break;
      const int m0 = m_tile * kBlockM;
      const ForwardKeyBlocks blocks = forward_key_blocks<kBlockM, kBlockN, Kernel::Softmax::kMasked>(p, m0);
      const int n_blocks = blocks.count, n_first = blocks.first * kBlockN;  // n_first: the first block's key
      const int wg_row0 = m0 + 64 * wg;
      const int row0 = wg_row0 + 16 * warp + g;  // this thread's rows: row0 and row0 + 8
#pragma unroll
      for (int i = 0; i < Kernel::kOValues; ++i) o[i] = 0.f;
      softmax.reset(p, b, h, t);
      kernel.start_tile(softmax, p, b, h);

      int turns_left = n_blocks + 1;  // issue points: S of block 0, (S of nb, P·V of nb - 1), the last P·V
      auto wait_turn = [&] { sm90::named_barrier_sync(my_turn, kTurnThreads); };
      auto pass_turn = [&] {
        if (--turns_left > 0 || wg != kLast) sm90::named_barrier_arrive(next_turn, kTurnThreads);
      };
      auto issue_s = [&](int st) {
        sm90::wgmma_fence();
        kernel.gemm_s(sacc, st, wg);
        sm90::wgmma_commit();
      };
      auto issue_pv = [&](int st) {
        sm90::fence_accumulators(o);
        sm90::wgmma_fence();
        kernel.gemm_pv(o, pa, st);
        sm90::wgmma_commit();
      };

      if (n_blocks > 0) {
        if (wg == kLast) sm90::named_barrier_arrive(next_turn, kTurnThreads);
        bar.q_full.wait(q_uses++ & 1);
        // Block 0: S, softmax, P (O is still 0: no rescale).
        const Ring first{kv_uses};
        bar.k_full[first.stage()].wait(first.parity());
        wait_turn();
        issue_s(first.stage());
        pass_turn();
        sm90::wgmma_wait<0>();
        sm90::fence_accumulators(sacc);
        bar.k_empty[first.stage()].arrive();
        if (n_blocks == 1) bar.q_empty.arrive();  // the tile's last read of Q is done
        float alpha[2];
        softmax.update(sacc, p, n_first, wg_row0, row0, t, alpha);
        kernel.pack_p(pa, sacc);
        // Block nb: S of nb and P·V of nb - 1 are issued together; the softmax of nb runs while P·V does.
        for (int nb = 1; nb < n_blocks; ++nb) {
          const Ring slot{kv_uses + nb}, prev{kv_uses + nb - 1};
          bar.k_full[slot.stage()].wait(slot.parity());
          bar.v_full[prev.stage()].wait(prev.parity());
          wait_turn();
          issue_s(slot.stage());
          issue_pv(prev.stage());
          pass_turn();
          sm90::wgmma_wait<1>();  // S done, P·V may still run
          sm90::fence_accumulators(sacc);
          bar.k_empty[slot.stage()].arrive();
          if (nb == n_blocks - 1) bar.q_empty.arrive();
          softmax.update(sacc, p, n_first + nb * kBlockN, wg_row0, row0, t, alpha);
          sm90::wgmma_wait<0>();
          sm90::fence_accumulators(o);
          bar.v_empty[prev.stage()].arrive();
          softmax.rescale(o, alpha);
          kernel.pack_p(pa, sacc);
        }
        const Ring last{kv_uses + n_blocks - 1};
        bar.v_full[last.stage()].wait(last.parity());
        wait_turn();
        issue_pv(last.stage());
        pass_turn();
        sm90::wgmma_wait<0>();
        sm90::fence_accumulators(o);
        bar.v_empty[last.stage()].arrive();
        kv_uses += n_blocks;
      }

      // Normalise and write O and logsumexp for the rows that exist. Rows that saw no key have l = 0:
      // O = 0, logsumexp -inf.
      float inv[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(softmax.row_sum[r]);
        inv[r] = l != 0.f ? kernel.o_scale() / l : 0.f;  // NaN l: a NaN reached the row (SPEC §2)
        const int row = row0 + 8 * r;
        // One fused multiply-add, written out: left to the compiler, whether the product and the sum fuse depends
        // on where the product is scheduled (a tile scale in a register moved it, and the lse's last bit).
        if (t == 0 && row < p.seq_q) {
          p.lse[b * p.lse_b + h * p.lse_h + row * p.lse_s] =
              l != 0.f ? fmaf(softmax.row_max[r], softmax.score_scale(p), logf(l)) : -INFINITY;
        }
      }
      kernel.store_o(o, inv, p, ForwardTileRows{b, h, wg, wg_row0, row0, ctid, warp, g, t});
    }
  }
  kernel.consumer_exit(ctid);
}

// The kernel body: barrier set-up, then warpgroup 0 produces (with few registers, setmaxnreg, so that the
// consumers can hold S, P and O) and the others consume.
template <class Kernel>
__device__ __forceinline__ void run_forward_pipeline(Kernel& kernel, const FlashParams& p) {
  const TileSchedule schedule(p, Kernel::kBlockM);
  const int warpgroup = threadIdx.x / sm90::kWarpgroupThreads;
  if (threadIdx.x == 0) kernel.barriers().init(Kernel::kConsumerThreads);
  __syncthreads();
  if (warpgroup == 0) {
    sm90::registers_decrease<Kernel::kProducerRegisters>();
    if (threadIdx.x != 0) return;
    forward_producer(kernel, p, schedule);
    return;
  }
  sm90::registers_increase<Kernel::kConsumerRegisters>();
  forward_consumer(kernel, p, schedule, warpgroup - 1);
}

// O's rows written straight from the accumulators (no shared-memory stage), as pairs of OutT, skipping
// rows past seq_q; inv[r] is row r's normalisation.
template <class OutT, int kOValues>
__device__ __forceinline__ void store_o_rows_direct(const float (&o)[kOValues], const float (&inv)[2],
                                                    const FlashParams& p, const ForwardTileRows& tile) {
  OutT* o_head = static_cast<OutT*>(p.o) + tile.b * p.o_st.b + tile.h * p.o_st.h;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = tile.row0 + 8 * r;
    if (row >= p.seq_q) continue;
    OutT* out = o_head + row * p.o_st.s + 2 * tile.t;
#pragma unroll
    for (int j = 0; j < kOValues / 4; ++j) {
      store_pair(out + 8 * j, o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
    }
  }
}

}  // namespace flashlm::flash_cuda
