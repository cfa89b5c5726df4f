// FlashAttention forward for Hopper (sm_90a): TMA loads into an mbarrier ring, wgmma on tensor cores,
// warp specialisation, persistent blocks.
//
// One block per SM, three warpgroups, walking the tiles of 128 query rows in the order TileSchedule gives.
// Warpgroup 0 is the producer: one thread loads each tile's Q once the consumers have released the last
// one, and streams K and V blocks through a ring of kStages shared-memory slots with TMA, each slot guarded
// by a "full" mbarrier (the copy engine completes it) and an "empty" one (every consumer thread arrives
// once it has read the slot); the ring runs on from one tile into the next. Warpgroups 1 and 2 are
// consumers, each owning 64 query rows of the tile: S = Q·Kᵀ by wgmma with both operands in shared memory,
// the online softmax in registers on S's accumulators (exp2 with the scale folded in), P converted to 16
// bits in registers and O += P·V by wgmma with A from registers and V read N-major from its slot. They take
// turns issuing GEMMs (ping-pong on named barriers), and each issues S of block n with P·V of block n - 1
// so that its softmax of n runs under that GEMM. The producer gives up registers (setmaxnreg) so that the
// consumers can hold S, P and O. Rows past the ends of Q and K are zero-filled by TMA; key columns at or
// past seq_k and above the causal diagonal are masked in S. Each warpgroup writes its normalised O rows
// into a shared-memory stage and one of its threads stores them with TMA (which clips rows past seq_q);
// at head dim 64, where the exponentials are the bottleneck, 1 in 8 of them runs on the FMA pipe.
#include <algorithm>
#include <cstdint>
#include <optional>

#include "attention/backends.h"
#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper/hopper.h"
#include "attention/cuda/hopper/schedule_sm90.cuh"
#include "attention/cuda/hopper/sm90.cuh"
#include "attention/cuda/hopper/softmax_sm90.cuh"
#include "attention/cuda/hopper/tma.h"
#include "core/cuda_check.h"

namespace flashlm {
namespace flash_cuda {
namespace {

template <int D>
struct Sm90FwdTraits {
  static constexpr int kBlockM = 128;  // two consumer warpgroups of 64 rows
  // Keys per block: at head dim 256 the O accumulators take 128 registers a thread and Q alone 64 KB of
  // shared memory, so key blocks are 80 (40 S registers; two stages of K and V fit in the remaining 160 KB).
  static constexpr int kBlockN = D == 256 ? 80 : 128;
  static constexpr int kStages = 2;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = (1 + kConsumers) * sm90::kWarpgroupThreads;
  static constexpr int kConsumerThreads = kConsumers * sm90::kWarpgroupThreads;
  // 128 · (24 + 2 · 240) = 64512 of the SM's 65536 registers.
  static constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
  static constexpr uint32_t kQBytes = kBlockM * D * 2, kKVBytes = kBlockN * D * 2;
  static constexpr int kPanels = D / sm90::kPanelCols;
  // O leaves through a shared-memory stage and TMA stores, except at head dim 256, where the stage does not
  // fit beside Q and the K/V ring (64 + 160 KB) and the threads store O directly.
  static constexpr bool kStagedO = D != 256;
  // At head dim 64 the softmax's exponentials take as long as the two GEMMs of a key block: 1 in 8 of them
  // (every 8th group of 8 key columns) runs on the FMA pipe instead of the SFU (exp2_on_fma_pipe).
  static constexpr int kPolyEvery = D == 64 ? 8 : 0;
  // Independent chains for each row's running max and sum (4; at 256 the 10 column groups of a key block
  // of 80 keep one).
  static constexpr int kRowChains = D == 256 ? 1 : 4;
};

// O's staging tile for the TMA store: each consumer warpgroup's 64 rows as D / 64 panels of 64 rows in
// sm90.cuh's swizzled layout (one store box each). Absent (one element) where O is stored directly.
template <int D>
struct Sm90FwdOStage {
  alignas(1024) uint16_t rows[Sm90FwdTraits<D>::kStagedO ? Sm90FwdTraits<D>::kConsumers * 64 * D : 1];
};

template <int D>
struct Sm90FwdShared {
  using Tr = Sm90FwdTraits<D>;
  alignas(1024) uint16_t q[Tr::kBlockM * D];
  alignas(1024) uint16_t k[Tr::kStages][Tr::kBlockN * D];
  alignas(1024) uint16_t v[Tr::kStages][Tr::kBlockN * D];
  Sm90FwdOStage<D> o;
  sm90::Mbarrier q_full, q_empty, k_full[Tr::kStages], k_empty[Tr::kStages], v_full[Tr::kStages], v_empty[Tr::kStages];
};

template <int D>
constexpr size_t sm90_fwd_smem_bytes() {
  return sizeof(Sm90FwdShared<D>) + 1024;  // + room to align the dynamic shared-memory base to 1024
}

// tm_o (boxes of 64 rows) is read only where Tr::kStagedO; the others get any valid map.
template <class T, int D>
__global__ void __launch_bounds__(Sm90FwdTraits<D>::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                          const FlashParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tr = Sm90FwdTraits<D>;
  using Ring = sm90::RingSlot<Tr::kStages>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  constexpr bool kStaged = Tr::kStagedO;
  extern __shared__ unsigned char smem_raw[];
  auto& s = *reinterpret_cast<Sm90FwdShared<D>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const TileSchedule schedule(p, kBlockM);
  // Key blocks query tile m sees (none: the tile is written as zeros without loading anything).
  auto key_blocks = [&](int m0) {
    const int last_row = min(m0 + kBlockM, p.seq_q) - 1;
    const int n_end = p.causal ? max(0, min(p.seq_k, last_row + p.causal_offset + 1)) : p.seq_k;
    return (n_end + kBlockN - 1) / kBlockN;
  };
  const int warpgroup = threadIdx.x / sm90::kWarpgroupThreads;

  if (threadIdx.x == 0) {
    s.q_full.init(1);
    s.q_empty.init(Tr::kConsumerThreads);
#pragma unroll
    for (int st = 0; st < Tr::kStages; ++st) {
      s.k_full[st].init(1);
      s.v_full[st].init(1);
      s.k_empty[st].init(Tr::kConsumerThreads);
      s.v_empty[st].init(Tr::kConsumerThreads);
    }
    sm90::Mbarrier::fence_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- Producer: one thread issues every copy. Q of a tile is loaded once the consumers have released
    // the previous tile's (q_empty), and the K/V ring runs on across tiles, so the next tile's first loads
    // overlap the current tile's last GEMMs and epilogue.
    sm90::registers_decrease<Tr::kProducerRegisters>();
    if (threadIdx.x != 0) return;
    sm90::tma_prefetch_descriptor(&tm_q);
    sm90::tma_prefetch_descriptor(&tm_k);
    sm90::tma_prefetch_descriptor(&tm_v);
    if constexpr (kStaged) sm90::tma_prefetch_descriptor(&tm_o);
    int q_uses = 0, kv_uses = 0;
    for (int item = blockIdx.x; item < schedule.items; item += gridDim.x) {
      const int h = schedule.head(item, p), b = schedule.batch(item, p), hk = h / p.group;
      for (int half = 0; half < 2; ++half) {
        const int m_tile = schedule.m_tile(item, half);
        if (m_tile < 0) break;
        const int m0 = m_tile * kBlockM, n_blocks = key_blocks(m0);
        if (n_blocks == 0) continue;
        s.q_empty.wait((q_uses++ & 1) ^ 1);
        s.q_full.arrive_expect_tx(Tr::kQBytes);
#pragma unroll
        for (int panel = 0; panel < Tr::kPanels; ++panel) {
          sm90::tma_load_4d(s.q + panel * kBlockM * sm90::kPanelCols, &tm_q, s.q_full, panel * sm90::kPanelCols, m0,
                            h, b);
        }
        for (int nb = 0; nb < n_blocks; ++nb) {
          const Ring slot{kv_uses++};
          const int st = slot.stage();
          s.k_empty[st].wait(slot.parity() ^ 1);
          s.k_full[st].arrive_expect_tx(Tr::kKVBytes);
#pragma unroll
          for (int panel = 0; panel < Tr::kPanels; ++panel) {
            sm90::tma_load_4d(s.k[st] + panel * kBlockN * sm90::kPanelCols, &tm_k, s.k_full[st],
                              panel * sm90::kPanelCols, nb * kBlockN, hk, b);
          }
          s.v_empty[st].wait(slot.parity() ^ 1);
          s.v_full[st].arrive_expect_tx(Tr::kKVBytes);
#pragma unroll
          for (int panel = 0; panel < Tr::kPanels; ++panel) {
            sm90::tma_load_4d(s.v[st] + panel * kBlockN * sm90::kPanelCols, &tm_v, s.v_full[st],
                              panel * sm90::kPanelCols, nb * kBlockN, hk, b);
          }
        }
      }
    }
    return;
  }

  // ---- Consumers: warpgroup wg owns query rows [m0 + 64·wg, m0 + 64·wg + 64) of each tile.
  sm90::registers_increase<Tr::kConsumerRegisters>();
  using GemmS = sm90::WgmmaM64<T, kBlockN>;
  using GemmO = sm90::WgmmaM64<T, D>;
  const int wg = warpgroup - 1;
  const int ctid = threadIdx.x % sm90::kWarpgroupThreads, warp = ctid / 32, lane = ctid % 32, g = lane / 4, t = lane % 4;

  // Ping-pong: the two consumer warpgroups take turns to issue their GEMMs, so that one's softmax runs
  // while the other's GEMMs occupy the tensor cores. Warpgroup w waits for its turn on barrier
  // kWarpgroupTurn0 + w and, having issued, hands the turn to the other. In each tile warpgroup 1 hands
  // warpgroup 0 the first turn and skips its last hand-over (nobody would wait for it).
  constexpr uint32_t kTurnThreads = 2 * sm90::kWarpgroupThreads;
  const auto my_turn = static_cast<sm90::NamedBarrier>(static_cast<uint32_t>(sm90::NamedBarrier::kWarpgroupTurn0) + wg);
  const auto other_turn =
      static_cast<sm90::NamedBarrier>(static_cast<uint32_t>(sm90::NamedBarrier::kWarpgroupTurn0) + (wg ^ 1));

  float o[D / 2];
  float sacc[kBlockN / 2];
  uint32_t pa[kBlockN / 16][4];  // P of the previous key block as wgmma A fragments
  WgmmaRowSoftmax<kBlockN, Tr::kPolyEvery, Tr::kRowChains> softmax;
  int q_uses = 0, kv_uses = 0;

  for (int item = blockIdx.x; item < schedule.items; item += gridDim.x) {
    const int h = schedule.head(item, p), b = schedule.batch(item, p);
    for (int half = 0; half < 2; ++half) {
      const int m_tile = schedule.m_tile(item, half);
      if (m_tile < 0) break;
      const int m0 = m_tile * kBlockM, n_blocks = key_blocks(m0);
      const int wg_row0 = m0 + 64 * wg;
      const int row0 = wg_row0 + 16 * warp + g;  // this thread's rows: row0 and row0 + 8
#pragma unroll
      for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
      softmax.reset();

      int turns_left = n_blocks + 1;  // issue points: S of block 0, (S of nb, P·V of nb - 1), the last P·V
      auto wait_turn = [&] { sm90::named_barrier_sync(my_turn, kTurnThreads); };
      auto pass_turn = [&] {
        if (--turns_left > 0 || wg == 0) sm90::named_barrier_arrive(other_turn, kTurnThreads);
      };
      auto issue_s = [&](int st) {
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          GemmS::template ss<0>(sacc, sm90::k_major_descriptor(s.q, kBlockM, 64 * wg, kk),
                                sm90::k_major_descriptor(s.k[st], kBlockN, 0, kk), kk > 0);
        }
        sm90::wgmma_commit();
      };
      auto issue_pv = [&](int st) {
        sm90::fence_accumulators(o);
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          GemmO::template rs<1>(o, pa[kk], sm90::mn_major_descriptor(s.v[st], kBlockN, kk), 1);
        }
        sm90::wgmma_commit();
      };
      // P as wgmma A fragments: keys [16·kk, 16·kk + 16) are S's column blocks 2·kk and 2·kk + 1.
      auto pack_p = [&] {
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
#pragma unroll
          for (int e = 0; e < 4; ++e) pa[kk][e] = MmaOp<T>::pack(sacc[8 * kk + 2 * e], sacc[8 * kk + 2 * e + 1]);
        }
      };

      if (n_blocks > 0) {
        if (wg == 1) sm90::named_barrier_arrive(other_turn, kTurnThreads);
        s.q_full.wait(q_uses++ & 1);
        // Block 0: S, softmax, P (O is still 0: no rescale).
        const Ring first{kv_uses};
        s.k_full[first.stage()].wait(first.parity());
        wait_turn();
        issue_s(first.stage());
        pass_turn();
        sm90::wgmma_wait<0>();
        sm90::fence_accumulators(sacc);
        s.k_empty[first.stage()].arrive();
        if (n_blocks == 1) s.q_empty.arrive();  // the tile's last read of Q is done
        float alpha[2];
        softmax.update(sacc, p, 0, wg_row0, row0, t, alpha);
        pack_p();
        // Block nb: S of nb and P·V of nb - 1 are issued together; the softmax of nb runs while P·V does.
        for (int nb = 1; nb < n_blocks; ++nb) {
          const Ring slot{kv_uses + nb}, prev{kv_uses + nb - 1};
          s.k_full[slot.stage()].wait(slot.parity());
          s.v_full[prev.stage()].wait(prev.parity());
          wait_turn();
          issue_s(slot.stage());
          issue_pv(prev.stage());
          pass_turn();
          sm90::wgmma_wait<1>();  // S done, P·V may still run
          sm90::fence_accumulators(sacc);
          s.k_empty[slot.stage()].arrive();
          if (nb == n_blocks - 1) s.q_empty.arrive();
          softmax.update(sacc, p, nb * kBlockN, wg_row0, row0, t, alpha);
          sm90::wgmma_wait<0>();
          sm90::fence_accumulators(o);
          s.v_empty[prev.stage()].arrive();
          softmax.rescale(o, alpha);
          pack_p();
        }
        const Ring last{kv_uses + n_blocks - 1};
        s.v_full[last.stage()].wait(last.parity());
        wait_turn();
        issue_pv(last.stage());
        pass_turn();
        sm90::wgmma_wait<0>();
        sm90::fence_accumulators(o);
        s.v_empty[last.stage()].arrive();
        kv_uses += n_blocks;
      }

      // Normalise and write O and logsumexp for the rows that exist. Rows that saw no key have l = 0:
      // O = 0, logsumexp -inf.
      float inv[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(softmax.row_sum[r]);
        inv[r] = l != 0.f ? 1.f / l : 0.f;  // NaN l: a NaN reached the row (SPEC §2)
        const int row = row0 + 8 * r;
        if (t == 0 && row < p.seq_q) {
          p.lse[b * p.lse_b + h * p.lse_h + row * p.lse_s] = l != 0.f ? softmax.row_max[r] * p.scale + logf(l) : -INFINITY;
        }
      }
      if constexpr (kStaged) {
        // Through shared memory: the warpgroup's 64 rows into its staging panels (32-bit stores, one bank
        // each across the warp: the swizzle spreads the 8 rows of a store over 8 chunks), then one thread
        // stores the panels with TMA, which skips rows past seq_q. The previous tile's store must have read
        // the panels before they are written again.
        const auto epilogue = static_cast<sm90::NamedBarrier>(static_cast<uint32_t>(sm90::NamedBarrier::kEpilogue0) + wg);
        uint16_t* stage = s.o.rows + wg * 64 * D;
        if (ctid == 0) sm90::bulk_wait_read<0>();
        sm90::named_barrier_sync(epilogue, sm90::kWarpgroupThreads);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = 16 * warp + g + 8 * r;
#pragma unroll
          for (int j = 0; j < D / 8; ++j) {
            *reinterpret_cast<uint32_t*>(reinterpret_cast<unsigned char*>(stage) +
                                         sm90::swizzled_offset(64, row, 8 * j + 2 * t)) =
                MmaOp<T>::pack(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
          }
        }
        sm90::fence_proxy_async_shared();
        sm90::named_barrier_sync(epilogue, sm90::kWarpgroupThreads);
        if (ctid == 0) {
#pragma unroll
          for (int panel = 0; panel < Tr::kPanels; ++panel) {
            sm90::tma_store_4d(&tm_o, stage + panel * 64 * sm90::kPanelCols, panel * sm90::kPanelCols, wg_row0, h, b);
          }
          sm90::bulk_commit();
        }
      } else {
        T* o_head = static_cast<T*>(p.o) + b * p.o_st.b + h * p.o_st.h;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = row0 + 8 * r;
          if (row >= p.seq_q) continue;
          T* out = o_head + row * p.o_st.s + 2 * t;
#pragma unroll
          for (int j = 0; j < D / 8; ++j) {
            store_pair(out + 8 * j, o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
          }
        }
      }
    }
  }
  // The shared memory the last TMA stores read must outlive them.
  if (kStaged && ctid == 0) sm90::bulk_wait<0>();
#endif
}

// TileSchedule's item count, on the host.
int64_t sm90_work_items(int64_t seq_q, int64_t heads_q, int64_t batch) {
  return TileSchedule::count(seq_q, heads_q, batch, Sm90FwdTraits<128>::kBlockM);
}

// One block per multiprocessor (or per work item, where there are fewer): see TileSchedule.
template <class T, int D>
void launch_forward_sm90(const FlashParams& f, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& v,
                         const CUtensorMap& o, int sm_count, cudaStream_t stream) {
  using Tr = Sm90FwdTraits<D>;
  auto kernel = flash_fwd_sm90_kernel<T, D>;
  constexpr int kSmem = static_cast<int>(sm90_fwd_smem_bytes<D>());
  FLASHLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                     "flash_fwd_sm90_kernel: shared-memory opt-in");
  const int64_t items = sm90_work_items(f.seq_q, f.heads_q, f.batch);
  kernel<<<static_cast<unsigned>(std::min<int64_t>(items, sm_count)), Tr::kThreads, kSmem, stream>>>(q, k, v, o, f);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_fwd_sm90_kernel launch");
}

struct Sm90ForwardPlan {
  CUtensorMap q, k, v;
  CUtensorMap o;  // head dims 64 and 128 (TMA stores); at 256, and where no O is given, unused
  int sm_count;
};

// The tensor maps for `p`, or nothing where this kernel does not cover the problem.
std::optional<Sm90ForwardPlan> plan_forward_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                                 const TensorView& v, const TensorView* o) {
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return std::nullopt;
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return std::nullopt;
  if (p.batch == 0 || p.seq_q == 0 || p.seq_k == 0 || p.heads_q == 0) return std::nullopt;
  // The kernel counts work items in 32-bit integers.
  if (sm90_work_items(p.seq_q, p.heads_q, p.batch) > INT32_MAX) return std::nullopt;
  const int sm_count = sm90_multiprocessors();
  if (sm_count == 0) return std::nullopt;
  const int key_rows = p.head_dim == 64    ? Sm90FwdTraits<64>::kBlockN
                       : p.head_dim == 128 ? Sm90FwdTraits<128>::kBlockN
                                           : Sm90FwdTraits<256>::kBlockN;
  static_assert(Sm90FwdTraits<64>::kBlockM == Sm90FwdTraits<128>::kBlockM &&
                Sm90FwdTraits<128>::kBlockM == Sm90FwdTraits<256>::kBlockM);
  auto tq = sm90::rows_tensor_map(q, Sm90FwdTraits<128>::kBlockM);
  auto tk = sm90::rows_tensor_map(k, key_rows), tv = sm90::rows_tensor_map(v, key_rows);
  if (!tq || !tk || !tv) return std::nullopt;
  // O in boxes of one consumer warpgroup's 64 rows. Validation leaves only views TMA can describe (16-byte
  // strides and base), so a failure here is a limit of the map (2^40-byte strides): the fallback takes it.
  if (o == nullptr || p.head_dim == 256) return Sm90ForwardPlan{*tq, *tk, *tv, *tq, sm_count};
  const auto to = sm90::rows_tensor_map(*o, 64);
  if (!to) return std::nullopt;
  return Sm90ForwardPlan{*tq, *tk, *tv, *to, sm_count};
}

}  // namespace

// The multiprocessor count of the current device if it runs the Hopper kernels (compute capability 9.0
// exactly: sm_90a code runs on nothing else; and a loadable image of them), else 0. Asked once per device.
int sm90_multiprocessors() {
  static int cached[64] = {};  // 0 unknown, -1 no, else the count
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) {
    cudaGetLastError();
    return 0;
  }
  if (cached[device] == 0) {
    int major = 0, minor = 0, sms = 0;
    cudaFuncAttributes attr{};
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
                    major == 9 && minor == 0 && sms > 0 &&
                    cudaFuncGetAttributes(&attr, flash_fwd_sm90_kernel<__nv_bfloat16, 128>) == cudaSuccess &&
                    attr.binaryVersion == 90;
    cudaGetLastError();  // a failed query must not surface at the next launch check
    cached[device] = ok ? sms : -1;
  }
  return std::max(cached[device], 0);
}

}  // namespace flash_cuda

bool flash_forward_sm90_covers(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                               const TensorView& v) {
  return flash_cuda::plan_forward_sm90(p, q, k, v, nullptr).has_value();
}

bool flash_attention_forward_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& o, const TensorView& lse, void* stream) {
  const auto plan = flash_cuda::plan_forward_sm90(p, q, k, v, &o);
  if (!plan) return false;
  const auto f = flash_cuda::make_params(p, q, k, v, o, lse);
  const auto s = static_cast<cudaStream_t>(stream);
  using flash_cuda::launch_forward_sm90;
  auto launch = [&]<class T>(T) {
    if (p.head_dim == 64) launch_forward_sm90<T, 64>(f, plan->q, plan->k, plan->v, plan->o, plan->sm_count, s);
    else if (p.head_dim == 128) launch_forward_sm90<T, 128>(f, plan->q, plan->k, plan->v, plan->o, plan->sm_count, s);
    else launch_forward_sm90<T, 256>(f, plan->q, plan->k, plan->v, plan->o, plan->sm_count, s);
  };
  if (p.dtype == DType::bf16) launch(__nv_bfloat16{});
  else launch(__half{});
  return true;
}

}  // namespace flashlm
