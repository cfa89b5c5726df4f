// FlashAttention backward for Hopper (sm_90a) at wide heads: the dK/dV kernel with dQ added by bulk
// reduce-add, on wgmma and TMA, for head dim 256 and the (192, 128) pair (head_dim for q and k, head_dim_v for v
// and o). flash_bwd_sm90.cu's kernel (head dims 64 and 128) gives each consumer warpgroup 64 keys and the whole
// head dim of dK and dV in registers: at d256 that is 256 fp32 a thread, at (192, 128) 160 beside Sᵀ and dPᵀ,
// past the 240 a consumer has. Here the two consumer warpgroups split the head dims instead, as
// FlashAttention-3's hdim-256 backward does (its AtomLayoutNdKV = 2), and Pᵀ and dSᵀ go through shared memory
// so that both can take them as the A operand:
//   a block per (64-key block, key head, batch); a step is one 64-query tile of one query head of the GQA
//   group (as in flash_bwd_sm90.cu, grid launch only);
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ     each warpgroup the 64 keys x its 32 queries (m64n32 wgmma, both operands
//                               K-major); Pᵀ and dSᵀ in registers, stored as 16-bit to shared memory;
//   bar.sync of the 256 consumer threads (both halves of Pᵀ and dSᵀ stored);
//   dV += Pᵀ·dO, dK += dSᵀ·Q    SS wgmma, A = Pᵀ / dSᵀ (K-major tiles of keys x queries), B N-major; each
//                               warpgroup a share of dV's and of dK's columns (kDv0/kDvCols, kDk0/kDkCols);
//   dQ += dS·K                  SS wgmma, A = dSᵀ read M-major, B = K N-major; each warpgroup a share of
//                               dQ's columns, in 64-column chunks whose warps' 16 x 64 parts (4 KB runs of
//                               DqAccumLayout) go to the fp32 accumulator by bulk reduce-add, the chunk after
//                               the first running on the tensor cores meanwhile.
// Every share is whole 64-column panels of the swizzled tiles (an N-major operand starts at a panel: a start
// inside one would cross the 128-byte rows of the swizzle atom). At d256 each warpgroup takes 128 columns of
// dK, dV and dQ: dK and dV 64 + 64 fp32 a thread, dQ two chunks of 32. At (192, 128) the five panels of dK
// and dV cannot split evenly: warpgroup 0 takes dK's first two panels and dV's first, warpgroup 1 dK's third
// and dV's second, and dQ's three panels go one to warpgroup 0 and two to warpgroup 1, so that both issue
// 256 columns' worth of dK/dV/dQ products a step.
// Shared memory (227 KB at most): K and V (64 rows each), two stages of Q with its rows of lse·log2e, dO with
// its rows of Delta (one stage at d256, two at (192, 128)), Pᵀ and dSᵀ double-buffered (a warpgroup may store
// step i + 1's while the other still reads step i's; the barrier keeps them at most one step apart), and each
// consumer warp's 16 x 64 fp32 dQ chunk: at d256 32 + 32 + 64 + 32 + 16 + 16 + 32 KB and the rows and barriers,
// 225 KB (226 with the alignment slack); at (192, 128) 186 KB.
// Q and dO have rings of their own, each slot guarded by a "full" mbarrier (the copy engine completes it)
// and an "empty" one (every consumer thread arrives once the step's dV/dK products, its last reads, are done),
// so that Q's second stage lets the next step's Sᵀ start while dO's one stage is still being refilled.
// Masking is flash_bwd_sm90.cu's: rows past the ends are zero-filled by TMA, query rows past seq_q have
// lse2 = +inf, keys past seq_k or above the causal diagonal are masked in Sᵀ; the masked instantiation takes a
// sliding window, soft-capping and sinks, the ALiBi one the bias.
#include <algorithm>
#include <cstdint>
#include <optional>

#include "attention/backends.h"
#include "attention/capabilities.h"
#include "attention/cuda/backward_tiles.h"
#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper/hopper.h"
#include "attention/cuda/hopper/sm90.cuh"
#include "attention/cuda/hopper/tma.h"
#include "core/check.h"
#include "core/cuda_check.h"

namespace flashlm {
namespace flash_cuda {
namespace {

// A warpgroup's columns of one of the split products: [first, first + count), whole 64-column panels.
struct ColumnShare {
  int first, count;
};
// Warpgroup wg's share of `cols` columns: half the panels each, the odd one to warpgroup 0 (`odd_to_first`) or 1.
constexpr ColumnShare column_share(int cols, int wg, bool odd_to_first) {
  const int panels = cols / sm90::kPanelCols;
  const int first_panels = odd_to_first ? (panels + 1) / 2 : panels / 2;
  const int split = first_panels * sm90::kPanelCols;
  return wg == 0 ? ColumnShare{0, split} : ColumnShare{split, cols - split};
}

template <int D, int Dv>
struct Sm90WideBwdTraits {
  static constexpr int kBlockN = 64;  // keys per block
  static constexpr int kBlockM = 64;  // queries per step
  static constexpr int kQStages = 2;
  static constexpr int kDoStages = D + Dv > 384 ? 1 : 2;  // d256: one (shared memory)
  static constexpr int kThreads = 3 * sm90::kWarpgroupThreads;
  static constexpr int kConsumerThreads = 2 * sm90::kWarpgroupThreads;
  static constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
  static constexpr uint32_t kRowBytes = kBlockM * 4;  // one tile's lse2 or Delta
  static constexpr uint32_t kQStepBytes = kBlockM * D * 2 + kRowBytes;
  static constexpr uint32_t kDoStepBytes = kBlockM * Dv * 2 + kRowBytes;
  static constexpr uint32_t kKVBytes = kBlockN * (D + Dv) * 2;
  static constexpr int kDqChunkFloats = 16 * sm90::kPanelCols;  // a warp's 16 rows x 64 columns of dQ
  // dK and dQ over D, dV over Dv; the odd panel of dK to warpgroup 0, of dQ to warpgroup 1 (see the file comment).
  static constexpr ColumnShare dk_share(int wg) { return column_share(D, wg, true); }
  static constexpr ColumnShare dv_share(int wg) { return column_share(Dv, wg, true); }
  static constexpr ColumnShare dq_share(int wg) { return column_share(D, wg, false); }
  static_assert(D % sm90::kPanelCols == 0 && Dv % sm90::kPanelCols == 0, "head dims are whole panels");
  static_assert(kBlockM <= kRowPad, "the per-row arrays are padded to kRowPad rows");
  static_assert(kBlockM == sm90::kPanelCols && kBlockN == sm90::kPanelCols,
                "Pᵀ and dSᵀ are one panel of queries; dQ's A operand (dSᵀ read M-major) one of keys");
};

template <int D, int Dv>
struct Sm90WideBwdShared {
  using Tr = Sm90WideBwdTraits<D, Dv>;
  alignas(1024) uint16_t k[Tr::kBlockN * D];
  alignas(1024) uint16_t v[Tr::kBlockN * Dv];
  alignas(1024) uint16_t q[Tr::kQStages][Tr::kBlockM * D];
  alignas(1024) uint16_t dout[Tr::kDoStages][Tr::kBlockM * Dv];
  // Pᵀ and dSᵀ (keys x queries, one swizzled panel each) of the last two steps.
  alignas(1024) uint16_t pt[2][Tr::kBlockN * Tr::kBlockM];
  alignas(1024) uint16_t dst[2][Tr::kBlockN * Tr::kBlockM];
  // Each consumer warp's 16 x 64 chunk of a step's dQ (DqAccumLayout order) on its way to the accumulator.
  alignas(128) float dq[Tr::kConsumerThreads / 32][Tr::kDqChunkFloats];
  alignas(16) float lse2[Tr::kQStages][Tr::kBlockM];
  alignas(16) float delta[Tr::kDoStages][Tr::kBlockM];
  sm90::Mbarrier kv_full, q_full[Tr::kQStages], q_empty[Tr::kQStages], do_full[Tr::kDoStages],
      do_empty[Tr::kDoStages];
};

template <int D, int Dv>
constexpr size_t sm90_wide_bwd_smem_bytes() {
  return sizeof(Sm90WideBwdShared<D, Dv>) + 1024;  // + room to align the dynamic shared-memory base to 1024
}
static_assert(sm90_wide_bwd_smem_bytes<256, 256>() <= 227 * 1024 && sm90_wide_bwd_smem_bytes<192, 128>() <= 227 * 1024,
              "an sm_90 block has at most 227 KB of shared memory");

// One consumer warpgroup's work (kWg: 0 or 1, a template argument because its column shares set wgmma's N).
template <class T, int D, int Dv, bool kMasked, bool kAlibi, int kWg>
__device__ __forceinline__ void wide_backward_consumer(Sm90WideBwdShared<D, Dv>& s, const FlashParams& p,
                                                       const BackwardMask& mask) {
  using Tr = Sm90WideBwdTraits<D, Dv>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  constexpr ColumnShare kDk = Tr::dk_share(kWg), kDv = Tr::dv_share(kWg), kDq = Tr::dq_share(kWg);
  constexpr int kDqChunks = kDq.count / sm90::kPanelCols;
  static_assert(kDqChunks == 1 || kDqChunks == 2, "dQ's share is one or two chunks");
  using GemmS = sm90::WgmmaM64<T, 32>;  // Sᵀ, dPᵀ: 64 keys x this warpgroup's 32 queries
  using GemmDk = sm90::WgmmaM64<T, kDk.count>;
  using GemmDv = sm90::WgmmaM64<T, kDv.count>;
  using GemmQ = sm90::WgmmaM64<T, sm90::kPanelCols>;  // one 64-column chunk of dQ: 64 queries
  const int ctid = threadIdx.x % sm90::kWarpgroupThreads, warp = ctid / 32, lane = ctid % 32, g = lane / 4,
            t = lane % 4;
  const int q_local0 = 32 * kWg;  // this warpgroup's queries within the step's tile

  s.kv_full.wait(0);
  const int b = blockIdx.z, hk = blockIdx.y, n0 = blockIdx.x * kBlockN;
  const int key_row = n0 + 16 * warp + g;  // this thread's keys: key_row and key_row + 8
  const QueryTileSpan range = backward_query_tiles(mask, n0, kBlockM, kBlockN);
  const int steps = range.count * p.group;

  float dk[kDk.count / 2], dv[kDv.count / 2];
#pragma unroll
  for (int i = 0; i < kDk.count / 2; ++i) dk[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kDv.count / 2; ++i) dv[i] = 0.f;

  int head_in_group = 0, m_idx = 0;
  for (int step = 0; step < steps; ++step) {
    const sm90::RingSlot<Tr::kQStages> qslot{step};
    const sm90::RingSlot<Tr::kDoStages> doslot{step};
    const int qs = qslot.stage(), ds = doslot.stage();
    const int head_row = b * p.heads_q + hk * p.group + head_in_group;  // (b, h) of the step
    const int m0 = (range.first + m_idx) * kBlockM;
    if (++m_idx == range.count) {
      m_idx = 0;
      ++head_in_group;
    }
    const int q0 = m0 + q_local0;  // this warpgroup's first query

    // Sᵀ and dPᵀ: A = K or V (all 64 keys), B = this warpgroup's 32 rows of Q or dO, both K-major.
    float sacc[16], dpacc[16];
    s.q_full[qs].wait(qslot.parity());
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      GemmS::template ss<0>(sacc, sm90::k_major_descriptor(s.k, kBlockN, 0, kk),
                            sm90::k_major_descriptor(s.q[qs], kBlockM, q_local0, kk), kk > 0);
    }
    sm90::wgmma_commit();
    s.do_full[ds].wait(doslot.parity());
    // dPᵀ's accumulators are dead from the last step: the fence ptxas would otherwise inject (after the wait's
    // loop, where it serialised the ALiBi instantiation's wgmma).
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Dv / 16; ++kk) {
      GemmS::template ss<0>(dpacc, sm90::k_major_descriptor(s.v, kBlockN, 0, kk),
                            sm90::k_major_descriptor(s.dout[ds], kBlockM, q_local0, kk), kk > 0);
    }
    sm90::wgmma_commit();

    // Pᵀ while dPᵀ runs. Accumulator i: key key_row + 8·((i / 2) % 2), query q0 + 8·(i / 4) + 2t + i % 2.
    sm90::wgmma_wait<1>();
    sm90::fence_accumulators(sacc);
    static_assert(kMasked || !kAlibi, "ALiBi takes the masked instantiation");
    bool capped = false, late = false, in_band = true;
    float slope_raw = 0.f;  // a constant 0 outside kAlibi
    if constexpr (kMasked) {
      capped = p.softcap > 0;
      if constexpr (kAlibi) slope_raw = alibi_slope_raw(p, head_row / p.heads_q, head_row % p.heads_q);
      late = capped || slope_raw != 0.f;
      in_band = tile_in_band(p, q0, q0 + 31, n0, n0 + kBlockN - 1);
      if (!late && !in_band) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int key = key_row + 8 * ((i / 2) % 2), query = q0 + 8 * (i / 4) + 2 * t + (i % 2);
          sacc[i] = key_in_band(p, query, key) ? sacc[i] : -INFINITY;
        }
      }
    } else {
      if (scores_need_mask(p, q0, n0, kBlockN)) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int key = key_row + 8 * ((i / 2) % 2), query = q0 + 8 * (i / 4) + 2 * t + (i % 2);
          sacc[i] = key >= p.seq_k || (p.causal && key > query + p.causal_offset) ? -INFINITY : sacc[i];
        }
      }
    }
    const float* lse2 = s.lse2[qs] + q_local0;
    const float* delta = s.delta[ds] + q_local0;
    if (!late) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * j + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sacc[4 * j + e] = fast_exp2(fmaf(sacc[4 * j + e], p.scale_log2, e % 2 ? -l2.y : -l2.x));
        }
      }
    }
    // dSᵀ = Pᵀ ∘ (dPᵀ − Delta) (∘ the cap's slope), from the capped Sᵀ on the late path.
    sm90::wgmma_wait<0>();
    sm90::fence_accumulators(dpacc);
    if (late) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * j + 2 * t);
        const float2 dl = *reinterpret_cast<const float2*>(delta + 8 * j + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * j + e;
          const int key = key_row + 8 * ((i / 2) % 2), query = q0 + 8 * j + 2 * t + (i % 2);
          float x = sacc[i];
          if (!kAlibi || capped) x = softcap_score(p, x);  // outside kAlibi, late means capped
          if constexpr (kAlibi) x += alibi_bias_raw(p, slope_raw, query, key);
          if (!in_band && !key_in_band(p, query, key)) x = -INFINITY;
          const float pr = fast_exp2(fmaf(x, p.scale_log2, e % 2 ? -l2.y : -l2.x));
          float dsv = pr * (dpacc[i] - (e % 2 ? dl.y : dl.x));
          if (!kAlibi || capped) dsv *= softcap_slope_biased(p, x, slope_raw, query, key);
          dpacc[i] = dsv;
          sacc[i] = pr;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 dl = *reinterpret_cast<const float2*>(delta + 8 * j + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) dpacc[4 * j + e] = sacc[4 * j + e] * (dpacc[4 * j + e] - (e % 2 ? dl.y : dl.x));
      }
    }
    // Pᵀ and dSᵀ to shared memory as 16-bit pairs: accumulators (i, i + 1), i even, are key key_row + 8·((i / 2)
    // % 2) and queries q_local0 + 8·(i / 4) + 2t, +1 of the tile, so the pairs at i = 8·kk + 2·m are the 8 x 8
    // matrix m of the warp's 16 keys x queries q_local0 + 16·kk + [0, 16) in stmatrix's order (m % 2: the
    // upper 8 keys, m / 2: the upper 8 queries): one stmatrix per 16 columns, lane l addressing row l % 8 of
    // matrix l / 8.
    const uint32_t pt_tile = sm90::smem_u32(s.pt[step & 1]), ds_tile = sm90::smem_u32(s.dst[step & 1]);
    const int st_row = 16 * warp + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const uint32_t offset = sm90::swizzled_offset(kBlockN, st_row, q_local0 + 16 * kk + 8 * (lane / 16));
      const float* p8 = sacc + 8 * kk;
      const float* d8 = dpacc + 8 * kk;
      sm90::stmatrix_x4(pt_tile + offset, MmaOp<T>::pack(p8[0], p8[1]), MmaOp<T>::pack(p8[2], p8[3]),
                        MmaOp<T>::pack(p8[4], p8[5]), MmaOp<T>::pack(p8[6], p8[7]));
      sm90::stmatrix_x4(ds_tile + offset, MmaOp<T>::pack(d8[0], d8[1]), MmaOp<T>::pack(d8[2], d8[3]),
                        MmaOp<T>::pack(d8[4], d8[5]), MmaOp<T>::pack(d8[6], d8[7]));
    }
    sm90::fence_proxy_async_shared();  // read by wgmma (the async proxy) after the barrier below
    sm90::named_barrier_sync(sm90::NamedBarrier::kBackwardDsReady, Tr::kConsumerThreads);

    // dV += Pᵀ·dO and dK += dSᵀ·Q over the step's 64 queries, this warpgroup's columns.
    sm90::fence_accumulators(dv);
    sm90::fence_accumulators(dk);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      GemmDv::template ss<1>(dv, sm90::k_major_descriptor(s.pt[step & 1], kBlockN, 0, kk),
                             sm90::mn_major_descriptor(s.dout[ds] + (kDv.first / sm90::kPanelCols) * kBlockM *
                                                                        sm90::kPanelCols,
                                                       kBlockM, kk),
                             1);
    }
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      GemmDk::template ss<1>(dk, sm90::k_major_descriptor(s.dst[step & 1], kBlockN, 0, kk),
                             sm90::mn_major_descriptor(s.q[qs] + (kDk.first / sm90::kPanelCols) * kBlockM *
                                                                     sm90::kPanelCols,
                                                       kBlockM, kk),
                             1);
    }
    sm90::wgmma_commit();
    // dQ = dS·K, chunk by chunk of this warpgroup's columns: A = dSᵀ read M-major (keys as the reduction).
    float dq[kDqChunks][32];
#pragma unroll
    for (int c = 0; c < kDqChunks; ++c) {
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        GemmQ::template ss<1, 1>(dq[c], sm90::mn_major_descriptor(s.dst[step & 1], kBlockN, kk),
                                 sm90::mn_major_descriptor(s.k + (kDq.first / sm90::kPanelCols + c) * kBlockN *
                                                                     sm90::kPanelCols,
                                                           kBlockN, kk),
                                 kk > 0);
      }
      sm90::wgmma_commit();
    }
    // The dV/dK group is the oldest: done once at most kDqChunks groups are pending.
    sm90::wgmma_wait<kDqChunks>();
    sm90::fence_accumulators(dv);
    sm90::fence_accumulators(dk);
    s.q_empty[qs].arrive();  // Q, lse2 of this slot are no longer read
    s.do_empty[ds].arrive();  // nor dO, Delta

    // Each warp's 16 rows of a chunk are one contiguous 4 KB run of the accumulator (DqAccumLayout): its 8
    // n8 tiles consecutive blocks of 128 floats, element (lane, e) at e·32 + lane.
    float* dq_stage = s.dq[kWg * 4 + warp];
    float* dq_rows = p.dq_accum + int64_t(head_row) * p.seq_q_padded * D;
#pragma unroll
    for (int c = 0; c < kDqChunks; ++c) {
      if (c == 0 && kDqChunks == 2) sm90::wgmma_wait<1>();
      else sm90::wgmma_wait<0>();
      sm90::fence_accumulators(dq[c]);
      if (lane == 0) sm90::bulk_wait_read<0>();  // the last reduce has read this warp's buffer
      __syncwarp();
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // DqOrder::lane_major: element (lane, e) of n8 tile j at j·128 + lane·4 + e
        reinterpret_cast<float4*>(dq_stage + j * DqAccumLayout<D>::kBlockFloats)[lane] =
            make_float4(dq[c][4 * j], dq[c][4 * j + 1], dq[c][4 * j + 2], dq[c][4 * j + 3]);
      }
      sm90::fence_proxy_async_shared();
      __syncwarp();
      if (lane == 0) {
        float* dst = dq_rows + DqAccumLayout<D>::block(m0 + 16 * warp, kDq.first + c * sm90::kPanelCols);
        sm90::bulk_reduce_add_f32(dst, dq_stage, Tr::kDqChunkFloats * 4);
        sm90::bulk_commit();
      }
    }
  }

  // dK carries the softmax scale (S = scale·QKᵀ; dk_scale with descales); keys past seq_k are not written.
  // Accumulator i: key key_row + 8·((i / 2) % 2), column first + 8·(i / 4) + 2t + i % 2.
  T* dk_head = static_cast<T*>(p.dk) + b * p.dk_st.b + hk * p.dk_st.h;
  T* dv_head = static_cast<T*>(p.dv) + b * p.dv_st.b + hk * p.dv_st.h;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key_row + 8 * r;
    if (key >= p.seq_k) continue;
#pragma unroll
    for (int j = 0; j < kDk.count / 8; ++j) {
      const int col = kDk.first + 8 * j + 2 * t;
      store_pair(dk_head + key * p.dk_st.s + col, dk[4 * j + 2 * r] * p.dk_scale, dk[4 * j + 2 * r + 1] * p.dk_scale);
    }
#pragma unroll
    for (int j = 0; j < kDv.count / 8; ++j) {
      const int col = kDv.first + 8 * j + 2 * t;
      store_pair(dv_head + key * p.dv_st.s + col, dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
    }
  }
  if (lane == 0) sm90::bulk_wait<0>();  // every reduce complete (and its shared memory read) before exit
}

// kMasked: the sliding-window / soft-capping / sink instantiation (FlashParams::masked); kAlibi (with
// kMasked) the ALiBi one, as in flash_bwd_sm90.cu. One block per tile, grid (key blocks, key heads, batch).
template <class T, int D, int Dv, bool kMasked, bool kAlibi>
__global__ void __launch_bounds__(Sm90WideBwdTraits<D, Dv>::kThreads, 1)
    flash_bwd_wide_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                               const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                               const FlashParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tr = Sm90WideBwdTraits<D, Dv>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  extern __shared__ unsigned char smem_raw[];
  auto& s = sm90::aligned_shared<Sm90WideBwdShared<D, Dv>>(smem_raw);
  const BackwardMask mask{p.seq_q, p.seq_k, p.causal, kMasked, p.causal_offset, p.window_left, p.window_right};
  const int warpgroup = sm90::warpgroup_index();

  if (threadIdx.x == 0) {
    s.kv_full.init(1);
#pragma unroll
    for (int st = 0; st < Tr::kQStages; ++st) {
      s.q_full[st].init(1);
      s.q_empty[st].init(Tr::kConsumerThreads);
    }
#pragma unroll
    for (int st = 0; st < Tr::kDoStages; ++st) {
      s.do_full[st].init(1);
      s.do_empty[st].init(Tr::kConsumerThreads);
    }
    sm90::Mbarrier::fence_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- Producer: one thread loads K and V once, then each step's Q (with lse2) and dO (with Delta) into
    // their rings, in step order; a slot is refilled once every consumer thread has released it.
    sm90::registers_decrease<Tr::kProducerRegisters>();
    if (threadIdx.x != 0) return;
    sm90::tma_prefetch_descriptor(&tm_q);
    sm90::tma_prefetch_descriptor(&tm_do);
    const int b = blockIdx.z, hk = blockIdx.y, n0 = blockIdx.x * kBlockN;
    const QueryTileSpan range = backward_query_tiles(mask, n0, kBlockM, kBlockN);
    const int steps = range.count * p.group;
    if (steps == 0) {  // nothing loaded; the consumers write zeros
      s.kv_full.arrive();
      return;
    }
    s.kv_full.arrive_expect_tx(Tr::kKVBytes);
#pragma unroll
    for (int panel = 0; panel < D / sm90::kPanelCols; ++panel) {
      sm90::tma_load_4d(s.k + panel * kBlockN * sm90::kPanelCols, &tm_k, s.kv_full, panel * sm90::kPanelCols, n0, hk,
                        b);
    }
#pragma unroll
    for (int panel = 0; panel < Dv / sm90::kPanelCols; ++panel) {
      sm90::tma_load_4d(s.v + panel * kBlockN * sm90::kPanelCols, &tm_v, s.kv_full, panel * sm90::kPanelCols, n0, hk,
                        b);
    }
    for (int step = 0; step < steps; ++step) {
      const int h = hk * p.group + step / range.count;
      const int m0 = (range.first + step % range.count) * kBlockM;
      const int64_t row_base = (int64_t(b) * p.heads_q + h) * p.seq_q_padded + m0;  // padded: in bounds
      const sm90::RingSlot<Tr::kQStages> qslot{step};
      const int qs = qslot.stage();
      s.q_empty[qs].wait(qslot.parity() ^ 1);
      s.q_full[qs].arrive_expect_tx(Tr::kQStepBytes);
#pragma unroll
      for (int panel = 0; panel < D / sm90::kPanelCols; ++panel) {
        sm90::tma_load_4d(s.q[qs] + panel * kBlockM * sm90::kPanelCols, &tm_q, s.q_full[qs], panel * sm90::kPanelCols,
                          m0, h, b);
      }
      sm90::bulk_load(s.lse2[qs], p.lse_log2 + row_base, Tr::kRowBytes, s.q_full[qs]);
      const sm90::RingSlot<Tr::kDoStages> doslot{step};
      const int ds = doslot.stage();
      s.do_empty[ds].wait(doslot.parity() ^ 1);
      s.do_full[ds].arrive_expect_tx(Tr::kDoStepBytes);
#pragma unroll
      for (int panel = 0; panel < Dv / sm90::kPanelCols; ++panel) {
        sm90::tma_load_4d(s.dout[ds] + panel * kBlockM * sm90::kPanelCols, &tm_do, s.do_full[ds],
                          panel * sm90::kPanelCols, m0, h, b);
      }
      sm90::bulk_load(s.delta[ds], p.delta + row_base, Tr::kRowBytes, s.do_full[ds]);
    }
    return;
  }

  // ---- Consumers.
  sm90::registers_increase<Tr::kConsumerRegisters>();
  if (warpgroup == 1) wide_backward_consumer<T, D, Dv, kMasked, kAlibi, 0>(s, p, mask);
  else wide_backward_consumer<T, D, Dv, kMasked, kAlibi, 1>(s, p, mask);
#endif
}

// The instantiation for f's variants: ALiBi, else the band's (window, soft-capping, sink), else the plain one.
template <class T, int D, int Dv>
auto wide_backward_kernel(const FlashParams& f) {
  return f.alibi_slopes != nullptr ? flash_bwd_wide_sm90_kernel<T, D, Dv, true, true>
         : f.masked                ? flash_bwd_wide_sm90_kernel<T, D, Dv, true, false>
                                   : flash_bwd_wide_sm90_kernel<T, D, Dv, false, false>;
}

template <class T, int D, int Dv>
void launch_wide(const FlashParams& f, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& v,
                 const CUtensorMap& dout, cudaStream_t stream) {
  using Tr = Sm90WideBwdTraits<D, Dv>;
  constexpr int kSmem = static_cast<int>(sm90_wide_bwd_smem_bytes<D, Dv>());
  auto kernel = wide_backward_kernel<T, D, Dv>(f);
  FLASHLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                     "flash_bwd_wide_sm90_kernel: shared-memory opt-in");
  const dim3 grid((f.seq_k + Tr::kBlockN - 1) / Tr::kBlockN, f.heads_k, f.batch);
  kernel<<<grid, Tr::kThreads, kSmem, stream>>>(q, k, v, dout, f);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_bwd_wide_sm90_kernel launch");
}

// Calls fn(D, Dv as integral constants) for the problem's head dims: the capability table's wide Hopper
// backward head dims (one head dim) or pairs.
template <class Fn>
bool with_wide_head_dims(int64_t head_dim, int64_t head_dim_v, Fn&& fn) {
  auto checked = [&](auto dim, auto dim_v) {
    // The head groups of run_flash_backward are sized by the mma.sync kernel's key tile.
    static_assert(Sm90WideBwdTraits<dim.value, dim_v.value>::kBlockN ==
                  mma_sync_backward_block_n(std::max(dim.value, dim_v.value)));
    fn(dim, dim_v);
  };
  if (head_dim != head_dim_v) return with_head_dim_pair<kHopperBackwardHeadDimPairs>(head_dim, head_dim_v, checked);
  return with_head_dim<kHopperBackwardHeadDims>(head_dim, [&](auto dim) {
    if constexpr (sm90_wide_backward(dim.value, dim.value)) checked(dim, dim);
  }) && sm90_wide_backward(head_dim, head_dim);
}

struct Sm90WideBackwardMaps {
  CUtensorMap q, k, v, dout;
};

std::optional<Sm90WideBackwardMaps> plan_wide_backward_sm90(const AttentionProblem& p, const TensorView& q,
                                                            const TensorView& k, const TensorView& v,
                                                            const TensorView& dout) {
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return std::nullopt;
  if (!sm90_wide_backward(p.head_dim, p.value_dim())) return std::nullopt;
  if (!with_wide_head_dims(p.head_dim, p.value_dim(), [](auto, auto) {})) return std::nullopt;
  if (p.batch == 0 || p.seq_q == 0 || p.seq_k == 0 || p.heads_q == 0) return std::nullopt;
  if (p.batch > 65535 || p.heads_k > 65535) return std::nullopt;  // grid y and z
  if (sm90_multiprocessors() == 0) return std::nullopt;
  constexpr int kRows = 64;  // kBlockM = kBlockN at every wide instantiation
  auto tq = sm90::rows_tensor_map(q, kRows), tdo = sm90::rows_tensor_map(dout, kRows);
  auto tk = sm90::rows_tensor_map(k, kRows), tv = sm90::rows_tensor_map(v, kRows);
  if (!tq || !tk || !tv || !tdo) return std::nullopt;
  return Sm90WideBackwardMaps{*tq, *tk, *tv, *tdo};
}

}  // namespace

bool wide_backward_sm90_covers(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& dout) {
  return plan_wide_backward_sm90(p, q, k, v, dout).has_value();
}

void launch_wide_backward_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& dout, const FlashParams& f,
                               cudaStream_t stream) {
  // A group's views are the covered views' slices of heads: the same strides, a 16-byte aligned start.
  const auto maps = plan_wide_backward_sm90(p, q, k, v, dout);
  sm90_backward_schedule();  // FLASHLM_SM90_BWD_SCHEDULE is checked here too, though this kernel has one launch
  FLASHLM_CHECK(maps.has_value(), "attention_backward: the Hopper backward declined a part of a problem it covered");
  auto run = [&]<class T>(T) {
    with_wide_head_dims(p.head_dim, p.value_dim(), [&](auto dim, auto dim_v) {
      launch_wide<T, dim.value, dim_v.value>(f, maps->q, maps->k, maps->v, maps->dout, stream);
    });
  };
  if (p.dtype == DType::bf16) run(__nv_bfloat16{});
  else run(__half{});
}

}  // namespace flash_cuda
}  // namespace flashlm
