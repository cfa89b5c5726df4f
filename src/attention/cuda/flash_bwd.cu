// FlashAttention-2 backward on tensor cores (mma.sync m16n8k16, fp16/bf16, fp32 accumulation).
//
//  1. preprocess: Delta_i = rowsum(dO_i ∘ O_i) and lse_i·log2(e) per query row, into padded fp32
//     arrays (rows past seq_q get lse = +inf, so that their P = exp2(S - lse) is exactly 0).
//  2. dK/dV kernel, one block per (key tile, key head, batch) that keeps dK and dV in registers while
//     it walks every query tile of every query head in the GQA group. Per query tile it computes S and
//     dP, writes P and dS to shared memory, and reads them back transposed (ldmatrix.trans) as the A
//     operands of dV += Pᵀ dO and dK += dSᵀ Q. Each phase has its own warp layout (BwdTraits) chosen
//     so that every shared-memory fragment feeds two or more MMAs: with one 16-row tile per warp the
//     kernel is bound by shared-memory bandwidth.
//  3. dQ, one of two ways:
//     - atomic (default): the dK/dV kernel multiplies the dS it wrote to shared memory by K and adds the
//       block's dQ contribution to an fp32 buffer with atomics, laid out in mma-fragment order so that
//       each warp-wide atomic covers one 128-byte line; a last kernel scales and converts it. The faster
//       of the two (docs/perf.md); the buffer is bounded by running long problems over groups of heads.
//     - separate pass (AttentionOptions::deterministic): a kernel per (query tile, head, batch)
//       recomputes P and dS over the visible key tiles and accumulates dQ += dS K in registers.
//       Bit-reproducible, no atomics, no fp32 buffer, at the cost of computing S and dP twice.
#include <algorithm>
#include "attention/backends.h"
#include "attention/capabilities.h"
#include "attention/cuda/backward_tiles.h"
#include "attention/cuda/flash_common.cuh"
#include "core/cuda_check.h"
#include "core/cuda_runtime.h"

namespace flashlm {
namespace flash_cuda {
namespace {

template <int D>
struct BwdTraits {
  // One block per kBlockN keys, 8 warps. Each of the three phases of a step lays the warps out on its own
  // output so that every fragment read from shared memory feeds at least two MMAs:
  //   A: S = Q Kᵀ and dP = dO Vᵀ (kBlockM x kBlockN): 2 warps along queries x 4 along keys.
  //   B: dV += Pᵀ dO and dK += dSᵀ Q (kBlockN x D): kBWarpsN along keys x kBWarpsD along head_dim (32
  //      keys per warp from d32 up), with Pᵀ and dSᵀ read transposed from the P and dS tiles phase A
  //      wrote to shared memory.
  //   C: dQ += dS K (kBlockM x D), atomic path only: kCRowGroups of kCMTiles 16-row tiles along queries x
  //      kCWarpsD along head_dim, so that each K fragment feeds kCMTiles MMAs.
  // Head dim 256 takes 64-key tiles, which keep dK and dV at 64 floats each per thread as at d128, and
  // 32-row query tiles, so that two stages of Q and dO beside K, V, P and dS (136.5 KiB) fit sm_80's
  // 163 KiB; with 64-row tiles it would be 209 KiB, sm_90 only (docs/perf.md, "The mma.sync backward at
  // head dim 256").
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = mma_sync_backward_block_n(D);
  // d32, d64: 128 x 128 tiles (docs/perf.md, tuning notes).
  static constexpr int kBlockM = D <= 64 ? 128 : D <= 128 ? 64 : 32;
  static constexpr int kAMTiles = kBlockM / 32;  // 16-row tiles per warp in phase A
  static constexpr int kAKeys = kBlockN / 4;     // keys per warp in phase A
  static constexpr int kBWarpsD = D == 16 ? 1 : kWarps / (kBlockN / 32);
  static constexpr int kBWarpsN = kWarps / kBWarpsD;
  static constexpr int kBMTiles = kBlockN / kBWarpsN / 16;  // 16-key tiles per warp in phase B
  static constexpr int kBCols = D / kBWarpsD;
  static constexpr int kCMTiles = D >= 32 ? 2 : 1;
  static constexpr int kCRowGroups = kBlockM / (16 * kCMTiles);
  static constexpr int kCWarpsD = kWarps / kCRowGroups;
  static constexpr int kCCols = D / kCWarpsD;
  static_assert(kBCols % 16 == 0 && kCCols % 16 == 0, "warp column slices must be whole pairs of n8 tiles");
  static_assert(kAMTiles >= 1 && kAKeys % 16 == 0 && kBMTiles >= 1 && kCRowGroups >= 1, "tiles must cover the warps");
  // sK, sV; two stages of sQ and sdO; sP and sdS; two stages of lse and Delta (fp32).
  static constexpr size_t kSmemBytes =
      size_t(2 * kBlockN * D + 4 * kBlockM * D + 2 * kBlockM * kBlockN) * 2 + 4 * kBlockM * sizeof(float);
};

// dQ pass: each warp owns kMTiles x 16 query rows, as in the forward, so that every K and V fragment read
// from shared memory feeds kMTiles MMAs (with one 16-row tile per warp it was bound by shared-memory
// traffic: docs/perf.md, "Kernel tuning notes").
// At d128 the key tiles are 32 wide so that S and dP (2 x 32 floats per row tile) fit beside the
// 128-float dQ accumulator; at d256 each warp owns one 16-row tile, whose dQ accumulator alone is 128
// floats (two would be 256, all of a thread's registers).
template <int D>
struct DqTraits {
  static constexpr int kWarps = 4;
  static constexpr int kMTiles = D <= 128 ? 2 : 1;
  static constexpr int kBlockM = 16 * kMTiles * kWarps;
  static constexpr int kBlockN = D <= 64 ? 64 : 32;
  static constexpr int kThreads = 32 * kWarps;
  static_assert(kBlockM <= kRowPad, "per-row arrays are padded to kRowPad rows");
  static constexpr size_t kSmemBytes = size_t(2 * kBlockM * D + 4 * kBlockN * D) * 2;  // Q, dO, 2 stages K, V
};

template <class T, int D>
__global__ void flash_bwd_preprocess_kernel(const FlashParams p) {
  // D/8 threads per row, each reading 8 elements of O and dO with one 16-byte load.
  constexpr int kThreadsPerRow = D / 8;
  constexpr int kRowsPerBlock = 256 / kThreadsPerRow;
  const int h = blockIdx.y, b = blockIdx.z;
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / kThreadsPerRow;
  const int part = threadIdx.x % kThreadsPerRow;
  float dot = 0.f;
  if (row < p.seq_q) {
    const uint4 o8 = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + b * p.o_st.b + row * p.o_st.s +
                                                      h * p.o_st.h + part * 8);
    const uint4 d8 = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + b * p.do_st.b +
                                                      row * p.do_st.s + h * p.do_st.h + part * 8);
    const T* o = reinterpret_cast<const T*>(&o8);
    const T* d = reinterpret_cast<const T*>(&d8);
#pragma unroll
    for (int i = 0; i < 8; ++i) dot += to_float(o[i]) * to_float(d[i]);
  }
#pragma unroll
  for (int off = kThreadsPerRow / 2; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
  if (part == 0 && row < p.seq_q_padded) {
    const int64_t i = (int64_t(b) * p.heads_q + h) * p.seq_q_padded + row;
    float lse2 = INFINITY;
    if (row < p.seq_q) {
      const float lse = p.lse[b * p.lse_b + h * p.lse_h + row * p.lse_s];
      lse2 = lse == -INFINITY ? INFINITY : lse * kLog2e;  // a row that saw no key: P = 0 everywhere
    }
    p.delta[i] = dot * p.delta_scale;
    p.lse_log2[i] = lse2;
  }
}

// The sink's gradient (FlashParams::dsink), from the preprocess's Delta and lse·log2e: dsink_h = -Σ over the
// batch and the rows that see a key of exp(sink_h - lse_i) · Delta_i (the CPU paths' rule; the sink has no
// value, so its dP is 0). One block per query head, each thread summing a fixed set of rows and the block
// reducing in a fixed order: the same bits on every run, in the atomic and the deterministic mode alike. It
// adds into dsink (attention.cpp clears it first; a varlen call runs one backward per run of sequences).
constexpr int kSinkGradThreads = 256;
__global__ void __launch_bounds__(kSinkGradThreads) flash_bwd_sink_grad_kernel(const FlashParams p) {
  const int h = blockIdx.x;
  const float sink2 = sink_logit(p, h) * kLog2e;
  float sum = 0.f;
  for (int b = 0; b < p.batch; ++b) {
    const int64_t base = (int64_t(b) * p.heads_q + h) * p.seq_q_padded;
    for (int row = threadIdx.x; row < p.seq_q; row += kSinkGradThreads) {
      if (row_sees_keys(p, row)) sum -= exp2f(sink2 - p.lse_log2[base + row]) * p.delta[base + row];
    }
  }
  __shared__ float partial[kSinkGradThreads];
  partial[threadIdx.x] = sum;
  __syncthreads();
#pragma unroll
  for (int half = kSinkGradThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) p.dsink[h * p.dsink_stride] += partial[0];
}

// kMasked: the sliding-window / soft-capping / ALiBi / sink instantiation (FlashParams::masked), as in the
// forward: query tiles outside the band skipped, scores soft-capped and biased (and dS multiplied by the cap's
// slope, taken at the score without its bias), tiles crossing the band's edge masked element-wise. The sink
// needs nothing here: the forward's lse holds it, so P = exp(S - lse) is already its softmax.
template <class T, int D, bool kAtomicDq, bool kMasked>
__global__ void __launch_bounds__(BwdTraits<D>::kThreads, 1) flash_bwd_dkdv_kernel(const FlashParams p) {
  using Tr = BwdTraits<D>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kThreads = Tr::kThreads;
  using Mma = MmaOp<T>;
  using SwzP = Swizzle<kBlockN>;  // the [kBlockM][kBlockN] P and dS tiles
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlockN * D;
  T* sQ = sV + kBlockN * D;       // 2 stages
  T* sdO = sQ + 2 * kBlockM * D;  // 2 stages
  T* sP = sdO + 2 * kBlockM * D;
  T* sdS = sP + kBlockM * kBlockN;
  float* sLse = reinterpret_cast<float*>(sdS + kBlockM * kBlockN);  // 2 stages
  float* sDelta = sLse + 2 * kBlockM;                                // 2 stages

  const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int n0 = n_block * kBlockN;

  const T* k_head = static_cast<const T*>(p.k) + b * p.k_st.b + hk * p.k_st.h;
  const T* v_head = static_cast<const T*>(p.v) + b * p.v_st.b + hk * p.v_st.h;
  load_tile_async<kBlockN, D, kThreads>(sK, k_head, p.k_st.s, n0, p.seq_k, tid);
  load_tile_async<kBlockN, D, kThreads>(sV, v_head, p.v_st.s, n0, p.seq_k, tid);

  // Query tiles that can see this key tile: from the first query seeing key n0 to the end, for every
  // query head of the GQA group.
  // (The masked kernel: the band's query tiles only.) The Hopper backward counts its steps by the same function.
  const BackwardMask mask{p.seq_q, p.seq_k, p.causal, kMasked, p.causal_offset, p.window_left, p.window_right};
  const QueryTileSpan tiles = backward_query_tiles(mask, n0, kBlockM, kBlockN);
  const int m_first = tiles.first, m_blocks = tiles.count;
  const int steps = m_blocks * p.group;

  // Step (head_in_group, m_idx): query tile m_first + m_idx of query head hk·group + head_in_group. The
  // loop below walks them in order with counters (an integer division per step costs ~20 instructions).
  auto load_step = [&](int head_in_group, int m_idx, int stage) {
    const int h = hk * p.group + head_in_group;
    const int m0 = (m_first + m_idx) * kBlockM;
    const T* q_head = static_cast<const T*>(p.q) + b * p.q_st.b + h * p.q_st.h;
    const T* do_head = static_cast<const T*>(p.dout) + b * p.do_st.b + h * p.do_st.h;
    // The per-thread chunk offsets are recomputed from the thread index on every call rather than kept
    // live (spilled) across the step loop.
    const int tid_s = static_cast<int>(opaque(threadIdx.x));
    load_tile_async<kBlockM, D, kThreads>(sQ + stage * kBlockM * D, q_head, p.q_st.s, m0, p.seq_q, tid_s);
    load_tile_async<kBlockM, D, kThreads>(sdO + stage * kBlockM * D, do_head, p.do_st.s, m0, p.seq_q, tid_s);
    const int64_t row_base = (int64_t(b) * p.heads_q + h) * p.seq_q_padded + m0;  // padded: always in bounds
    static_assert(kBlockM / 4 <= kThreads, "one 16-byte lse/Delta chunk per thread at most");
    if (tid < kBlockM / 4) {  // a plain branch: the strided loop it replaces was kept as an unbounded loop
      cp_async_16(smem_addr(sLse + stage * kBlockM + 4 * tid), p.lse_log2 + row_base + 4 * tid, 16);
      cp_async_16(smem_addr(sDelta + stage * kBlockM + 4 * tid), p.delta + row_base + 4 * tid, 16);
    }
  };
  if (steps > 0) load_step(0, 0, 0);
  cp_async_commit();

  // Phase A layout: rows a_row0 + [0, 16·kAMTiles), keys a_key0 + [0, kAKeys).
  const int a_row0 = (warp % 2) * 16 * Tr::kAMTiles, a_key0 = (warp / 2) * Tr::kAKeys;
  // Phase B layout: keys b_key0 + [0, 16·kBMTiles), head_dim columns b_col0 + [0, kBCols).
  const int b_key0 = (warp % Tr::kBWarpsN) * 16 * Tr::kBMTiles, b_col0 = (warp / Tr::kBWarpsN) * Tr::kBCols;
  // Phase C layout: rows c_row0 + [0, 16·kCMTiles), columns c_col0 + [0, kCCols).
  const int c_row0 = (warp % Tr::kCRowGroups) * 16 * Tr::kCMTiles, c_col0 = (warp / Tr::kCRowGroups) * Tr::kCCols;

  // Fragment addressing. Every ldmatrix address is this lane's byte offset for chunk pair 0 (XorSwizzle)
  // XOR a constant plus a constant, so a handful of lane offsets are recomputed per step from `lane`
  // (opaque() keeps the compiler from hoisting one precomputed address per fragment out of the step loop
  // and spilling them). Head dims below 64 keep the generic Swizzle<D>::offset form for Q, dO, K, V;
  // the P and dS tiles are kBlockN (64 or 128) wide, always the row-XOR form.
  constexpr bool kXor = D >= 64;
  using Xs = XorSwizzle<D>;
  using XsP = XorSwizzle<kBlockN>;
  static_assert(kBlockN / 8 >= 8, "P/dS tiles must use the row-XOR swizzle");
  const uint32_t sK_addr = smem_addr(sK), sV_addr = smem_addr(sV), sQ_addr = smem_addr(sQ),
                 sdO_addr = smem_addr(sdO), sP_addr = smem_addr(sP), sdS_addr = smem_addr(sdS);
  // Rows (within a 16-row group) and chunk parities read by the three ldmatrix operand shapes:
  //   A operand (non-trans):  row lane % 16,                     chunk 2·pair + lane / 16
  //   B operand (non-trans):  row lane % 8 + (lane / 16)·8,       chunk 2·pair + (lane / 8) % 2
  //   B operand (trans):      row lane % 8 + ((lane / 8) % 2)·8,  chunk 2·pair + lane / 16
  auto a_row = [&] { return lane % 16; };
  auto a_b = [&] { return lane / 16; };
  auto bn_row = [&] { return (lane % 8) + (lane / 16) * 8; };
  auto bn_b = [&] { return (lane / 8) % 2; };
  auto bt_row = [&] { return (lane % 8) + ((lane / 8) % 2) * 8; };
  auto bt_b = [&] { return lane / 16; };

  float dk[Tr::kBMTiles][Tr::kBCols / 8][4] = {};
  float dv[Tr::kBMTiles][Tr::kBCols / 8][4] = {};

  int cur_head = 0, cur_m = 0;  // this step's (head_in_group, m_idx)
  for (int step = 0; step < steps; ++step) {
    const int stage = step & 1;
    const bool wrap = cur_m + 1 == m_blocks;
    const int next_head = wrap ? cur_head + 1 : cur_head, next_m = wrap ? 0 : cur_m + 1;
    cp_async_wait<0>();
    __syncthreads();  // this step's tiles are visible; all warps are done with the previous step's tiles
    if (step + 1 < steps) load_step(next_head, next_m, stage ^ 1);
    cp_async_commit();
    const int h = hk * p.group + cur_head;
    const int m0 = (m_first + cur_m) * kBlockM;
    [[maybe_unused]] const float slope_raw = kMasked ? alibi_slope_raw(p, b, h) : 0.f;
    cur_head = next_head;
    cur_m = next_m;
    const T* q_tile = sQ + stage * kBlockM * D;
    const T* do_tile = sdO + stage * kBlockM * D;
    const float* lse2 = sLse + stage * kBlockM;
    const float* delta = sDelta + stage * kBlockM;

    const uint32_t q_addr = sQ_addr + stage * (kBlockM * D * 2), do_addr = sdO_addr + stage * (kBlockM * D * 2);

    {  // Phase A: S and dP, then P and dS into shared memory.
      const uint32_t qa_off = opaque(kXor ? Xs::lane_offset(a_row0 + a_row(), a_b()) : 0u);
      const uint32_t kb_off = opaque(kXor ? Xs::lane_offset(a_key0 + bn_row(), bn_b()) : 0u);
      float s[Tr::kAMTiles][Tr::kAKeys / 8][4] = {};
      float dp[Tr::kAMTiles][Tr::kAKeys / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t aq[Tr::kAMTiles][4], ado[Tr::kAMTiles][4];
#pragma unroll
        for (int mt = 0; mt < Tr::kAMTiles; ++mt) {
          if constexpr (kXor) {
            ldmatrix_x4(aq[mt], q_addr + Xs::at(qa_off, mt * 16, kk));
            ldmatrix_x4(ado[mt], do_addr + Xs::at(qa_off, mt * 16, kk));
          } else {
            const int row = a_row0 + mt * 16 + (lane % 16), chunk = 2 * kk + lane / 16;
            ldmatrix_x4(aq[mt], smem_addr(q_tile + Swizzle<D>::offset(row, chunk)));
            ldmatrix_x4(ado[mt], smem_addr(do_tile + Swizzle<D>::offset(row, chunk)));
          }
        }
#pragma unroll
        for (int np = 0; np < Tr::kAKeys / 16; ++np) {
          uint32_t bk[4], bv[4];
          if constexpr (kXor) {
            ldmatrix_x4(bk, sK_addr + Xs::at(kb_off, np * 16, kk));
            ldmatrix_x4(bv, sV_addr + Xs::at(kb_off, np * 16, kk));
          } else {
            const int key = a_key0 + np * 16 + (lane % 8) + (lane / 16) * 8, chunk = 2 * kk + (lane / 8) % 2;
            ldmatrix_x4(bk, smem_addr(sK + Swizzle<D>::offset(key, chunk)));
            ldmatrix_x4(bv, smem_addr(sV + Swizzle<D>::offset(key, chunk)));
          }
#pragma unroll
          for (int mt = 0; mt < Tr::kAMTiles; ++mt) {
            Mma::run(s[mt][2 * np], aq[mt], bk);
            Mma::run(s[mt][2 * np + 1], aq[mt], bk + 2);
            Mma::run(dp[mt][2 * np], ado[mt], bv);
            Mma::run(dp[mt][2 * np + 1], ado[mt], bv + 2);
          }
        }
      }
      // Block-uniform: the test is on the whole key tile and the block's first query row (all its rows).
      if constexpr (kMasked) {
        cap_and_mask_scores(s, p, tile_in_band(p, m0, m0 + kBlockM - 1, n0, n0 + kBlockN - 1), m0 + a_row0,
                            n0 + a_key0, g, t, slope_raw);
      } else {
        if (scores_need_mask(p, m0, n0, kBlockN)) mask_scores(s, p, m0 + a_row0, n0 + a_key0, g, t);
      }
#pragma unroll
      for (int mt = 0; mt < Tr::kAMTiles; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = a_row0 + mt * 16 + g + 8 * r;  // within the tile
          const float l2 = lse2[row], dl = delta[row];
#pragma unroll
          for (int nt = 0; nt < Tr::kAKeys / 8; ++nt) {
            const int key = a_key0 + nt * 8 + 2 * t;  // within the tile; this thread holds key and key + 1
            float pr[2], ds[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              pr[e] = fast_exp2(fmaf(s[mt][nt][2 * r + e], p.scale_log2, -l2));  // rows past seq_q: lse = +inf, P = 0
              ds[e] = pr[e] * (dp[mt][nt][2 * r + e] - dl);
              if constexpr (kMasked) {
                if (p.softcap > 0) {
                  ds[e] *= softcap_slope_biased(p, s[mt][nt][2 * r + e], slope_raw, m0 + row, n0 + key + e);
                }
              }
            }
            store_pair(sP + SwzP::offset(row, key / 8) + key % 8, pr[0], pr[1]);
            store_pair(sdS + SwzP::offset(row, key / 8) + key % 8, ds[0], ds[1]);
          }
        }
      }
    }
    __syncthreads();  // P and dS complete

    // Phase B: dV += Pᵀ dO, dK += dSᵀ Q, the transposes done by ldmatrix.trans. Not unrolled over kk:
    // hoisting the next fragments would spill the dK/dV accumulators at d128.
    // P/dS fragment: query rows kk·16 + bn_row, key chunk pair b_key0 / 16 + mt (b_key0 is a multiple of 16).
    // dO/Q fragment: query rows kk·16 + bt_row, head_dim chunk pair b_col0 / 16 + dt.
    const uint32_t pb_off = opaque(XsP::lane_offset(bn_row(), bn_b()));
    const uint32_t qb_off = opaque(kXor ? Xs::lane_offset(bt_row(), bt_b()) : 0u);
#pragma unroll 1
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      uint32_t ap[Tr::kBMTiles][4], ads[Tr::kBMTiles][4];
#pragma unroll
      for (int mt = 0; mt < Tr::kBMTiles; ++mt) {
        ldmatrix_x4_trans(ap[mt], sP_addr + XsP::at(pb_off, kk * 16, b_key0 / 16 + mt));
        ldmatrix_x4_trans(ads[mt], sdS_addr + XsP::at(pb_off, kk * 16, b_key0 / 16 + mt));
      }
#pragma unroll
      for (int dt = 0; dt < Tr::kBCols / 16; ++dt) {
        uint32_t bdo[4], bq[4];
        if constexpr (kXor) {
          ldmatrix_x4_trans(bdo, do_addr + Xs::at(qb_off, kk * 16, b_col0 / 16 + dt));
          ldmatrix_x4_trans(bq, q_addr + Xs::at(qb_off, kk * 16, b_col0 / 16 + dt));
        } else {
          const int qrow = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, chunk = b_col0 / 8 + 2 * dt + lane / 16;
          ldmatrix_x4_trans(bdo, smem_addr(do_tile + Swizzle<D>::offset(qrow, chunk)));
          ldmatrix_x4_trans(bq, smem_addr(q_tile + Swizzle<D>::offset(qrow, chunk)));
        }
#pragma unroll
        for (int mt = 0; mt < Tr::kBMTiles; ++mt) {
          Mma::run(dv[mt][2 * dt], ap[mt], bdo);
          Mma::run(dv[mt][2 * dt + 1], ap[mt], bdo + 2);
          Mma::run(dk[mt][2 * dt], ads[mt], bq);
          Mma::run(dk[mt][2 * dt + 1], ads[mt], bq + 2);
        }
      }
    }

    if constexpr (kAtomicDq) {
      // Phase C: this key tile's contribution dS K to dQ, added to the fp32 accumulator atomically.
      constexpr int kCM = Tr::kCMTiles;
      float dq[kCM][Tr::kCCols / 8][4] = {};
      // dS fragment: rows c_row0 + mt·16 + a_row, key chunk pair kk; K fragment: key rows kk·16 + bt_row,
      // head_dim chunk pair c_col0 / 16 + ct.
      const uint32_t sc_off = opaque(XsP::lane_offset(c_row0 + a_row(), a_b()));
      const uint32_t kc_off = opaque(kXor ? Xs::lane_offset(bt_row(), bt_b()) : 0u);
#pragma unroll 2
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t a[kCM][4];
#pragma unroll
        for (int mt = 0; mt < kCM; ++mt) ldmatrix_x4(a[mt], sdS_addr + XsP::at(sc_off, mt * 16, kk));
#pragma unroll
        for (int ct = 0; ct < Tr::kCCols / 16; ++ct) {
          uint32_t bk[4];
          if constexpr (kXor)
            ldmatrix_x4_trans(bk, sK_addr + Xs::at(kc_off, kk * 16, c_col0 / 16 + ct));
          else
            ldmatrix_x4_trans(bk, smem_addr(sK + Swizzle<D>::offset(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8,
                                                                    c_col0 / 8 + 2 * ct + lane / 16)));
#pragma unroll
          for (int mt = 0; mt < kCM; ++mt) {
            Mma::run(dq[mt][2 * ct], a[mt], bk);
            Mma::run(dq[mt][2 * ct + 1], a[mt], bk + 2);
          }
        }
      }
      // The accumulator is kept in fragment order (DqAccumLayout, DqOrder::fragment_major): for each (ct, e)
      // the warp's 32 lanes add to 32 consecutive floats, one 128-byte line per atomic instruction.
      float* dq_head = p.dq_accum + (int64_t(b) * p.heads_q + h) * p.seq_q_padded * D + lane;
#pragma unroll
      for (int mt = 0; mt < kCM; ++mt) {
        float* dq_frag = dq_head + DqAccumLayout<D>::block(m0 + c_row0 + mt * 16, c_col0);
#pragma unroll
        for (int ct = 0; ct < Tr::kCCols / 8; ++ct) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            atomicAdd(dq_frag + ct * DqAccumLayout<D>::kBlockFloats + e * 32, dq[mt][ct][e]);  // scaled in convert
          }
        }
      }
    }
  }

  cp_async_wait<0>();  // a key tile no query sees (steps = 0) still copied K and V: let them land before exit

  // dK carries the softmax scale (S = scale·QKᵀ; dk_scale with descales); keys past seq_k are not written.
  T* dk_head = static_cast<T*>(p.dk) + b * p.dk_st.b + hk * p.dk_st.h;
  T* dv_head = static_cast<T*>(p.dv) + b * p.dv_st.b + hk * p.dv_st.h;
#pragma unroll
  for (int mt = 0; mt < Tr::kBMTiles; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = n0 + b_key0 + mt * 16 + g + 8 * r;
      if (key >= p.seq_k) continue;
#pragma unroll
      for (int dt = 0; dt < Tr::kBCols / 8; ++dt) {
        const int col = b_col0 + dt * 8 + 2 * t;
        store_pair(dk_head + key * p.dk_st.s + col, dk[mt][dt][2 * r] * p.dk_scale,
                   dk[mt][dt][2 * r + 1] * p.dk_scale);
        store_pair(dv_head + key * p.dv_st.s + col, dv[mt][dt][2 * r], dv[mt][dt][2 * r + 1]);
      }
    }
  }
}

template <class T, int D, bool kMasked>
__global__ void __launch_bounds__(DqTraits<D>::kThreads) flash_bwd_dq_kernel(const FlashParams p) {
  using Tr = DqTraits<D>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kThreads = Tr::kThreads, kM = Tr::kMTiles;
  using Mma = MmaOp<T>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kBlockM * D;
  T* sK = sdO + kBlockM * D;    // 2 stages
  T* sV = sK + 2 * kBlockN * D;  // 2 stages

  const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest tiles first under a causal mask
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int m0 = m_block * kBlockM;
  const int warp_tile0 = warp * 16 * kM;  // this warp's first row within the block
  const int warp_row0 = m0 + warp_tile0;

  const T* q_head = static_cast<const T*>(p.q) + b * p.q_st.b + h * p.q_st.h;
  const T* do_head = static_cast<const T*>(p.dout) + b * p.do_st.b + h * p.do_st.h;
  const T* k_head = static_cast<const T*>(p.k) + b * p.k_st.b + hk * p.k_st.h;
  const T* v_head = static_cast<const T*>(p.v) + b * p.v_st.b + hk * p.v_st.h;

  const int last_row = min(m0 + kBlockM, p.seq_q) - 1;
  // Key tiles [nb_first, n_blocks) are visited; tile nb lives in stage nb & 1.
  const TileRange tiles = visited_key_tiles<kMasked>(p, m0, last_row, kBlockN);
  const int nb_first = tiles.first, n_blocks = tiles.first + tiles.count();

  load_tile_async<kBlockM, D, kThreads>(sQ, q_head, p.q_st.s, m0, p.seq_q, tid);
  load_tile_async<kBlockM, D, kThreads>(sdO, do_head, p.do_st.s, m0, p.seq_q, tid);
  if (n_blocks > nb_first) {
    const int first_stage = nb_first & 1;
    load_tile_async<kBlockN, D, kThreads>(sK + first_stage * kBlockN * D, k_head, p.k_st.s, nb_first * kBlockN,
                                          p.seq_k, tid);
    load_tile_async<kBlockN, D, kThreads>(sV + first_stage * kBlockN * D, v_head, p.v_st.s, nb_first * kBlockN,
                                          p.seq_k, tid);
  }
  cp_async_commit();

  const int64_t row_base = (int64_t(b) * p.heads_q + h) * p.seq_q_padded;  // padded: every row exists
  float lse2[kM][2], delta[kM][2];
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      lse2[mt][r] = p.lse_log2[row_base + warp_row0 + mt * 16 + g + 8 * r];
      delta[mt][r] = p.delta[row_base + warp_row0 + mt * 16 + g + 8 * r];
    }

  constexpr bool kXor = D >= 64;  // XorSwizzle addressing (row-XOR form of Swizzle<D>)
  using Xs = XorSwizzle<D>;
  const uint32_t q_addr = smem_addr(sQ), do_addr = smem_addr(sdO);
  float dq[kM][D / 8][4] = {};
  for (int nb = nb_first; nb < n_blocks; ++nb) {
    const int stage = nb & 1;
    cp_async_wait<0>();
    __syncthreads();
    if (nb + 1 < n_blocks) {
      load_tile_async<kBlockN, D, kThreads>(sK + (stage ^ 1) * kBlockN * D, k_head, p.k_st.s, (nb + 1) * kBlockN,
                                            p.seq_k, tid);
      load_tile_async<kBlockN, D, kThreads>(sV + (stage ^ 1) * kBlockN * D, v_head, p.v_st.s, (nb + 1) * kBlockN,
                                            p.seq_k, tid);
    }
    cp_async_commit();
    const T* k_tile = sK + stage * kBlockN * D;
    const T* v_tile = sV + stage * kBlockN * D;
    // Fragment addresses as lane offsets XOR/plus constants (XorSwizzle), recomputed per key tile from
    // `lane` (opaque) rather than one precomputed address per fragment kept live across the loop (spilled).
    const uint32_t k_addr = smem_addr(k_tile), v_addr = smem_addr(v_tile);
    const uint32_t qa_off = opaque(kXor ? Xs::lane_offset(warp_tile0 + (lane % 16), lane / 16) : 0u);
    const uint32_t kb_off = opaque(kXor ? Xs::lane_offset((lane % 8) + (lane / 16) * 8, (lane / 8) % 2) : 0u);

    // S = Q Kᵀ and dP = dO Vᵀ for this warp's rows; each K and V fragment serves all kM row tiles.
    float s[kM][kBlockN / 8][4] = {};
    float dp[kM][kBlockN / 8][4] = {};
#pragma unroll 4
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t aq[kM][4], ado[kM][4];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) {
        if constexpr (kXor) {
          ldmatrix_x4(aq[mt], q_addr + Xs::at(qa_off, mt * 16, kk));
          ldmatrix_x4(ado[mt], do_addr + Xs::at(qa_off, mt * 16, kk));
        } else {
          const int off = Swizzle<D>::offset(warp_tile0 + mt * 16 + (lane % 16), 2 * kk + lane / 16);
          ldmatrix_x4(aq[mt], smem_addr(sQ + off));
          ldmatrix_x4(ado[mt], smem_addr(sdO + off));
        }
      }
#pragma unroll
      for (int nt = 0; nt < kBlockN / 16; ++nt) {
        uint32_t bk[4], bv[4];
        if constexpr (kXor) {
          ldmatrix_x4(bk, k_addr + Xs::at(kb_off, nt * 16, kk));
          ldmatrix_x4(bv, v_addr + Xs::at(kb_off, nt * 16, kk));
        } else {
          const int key = nt * 16 + (lane % 8) + (lane / 16) * 8, chunk = 2 * kk + (lane / 8) % 2;
          ldmatrix_x4(bk, smem_addr(k_tile + Swizzle<D>::offset(key, chunk)));
          ldmatrix_x4(bv, smem_addr(v_tile + Swizzle<D>::offset(key, chunk)));
        }
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          Mma::run(s[mt][2 * nt], aq[mt], bk);
          Mma::run(s[mt][2 * nt + 1], aq[mt], bk + 2);
          Mma::run(dp[mt][2 * nt], ado[mt], bv);
          Mma::run(dp[mt][2 * nt + 1], ado[mt], bv + 2);
        }
      }
    }

    const int n0 = nb * kBlockN;
    // The ALiBi slope is read where it is used (an L1 hit): kept in a register across the key loop it made
    // this kernel spill at head dims 32 and 64.
    if constexpr (kMasked) {
      cap_and_mask_scores(s, p, tile_in_band(p, warp_row0, warp_row0 + 16 * kM - 1, n0, n0 + kBlockN - 1), warp_row0,
                          n0, g, t, alibi_slope_raw(p, b, h));
    } else {
      if (scores_need_mask(p, warp_row0, n0, kBlockN)) mask_scores(s, p, warp_row0, n0, g, t);
    }
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pr = fast_exp2(fmaf(s[mt][nt][e], p.scale_log2, -lse2[mt][e / 2]));
          dp[mt][nt][e] = pr * (dp[mt][nt][e] - delta[mt][e / 2]);  // dS
          if constexpr (kMasked) {
            if (p.softcap > 0) {
              dp[mt][nt][e] *= softcap_slope_biased(p, s[mt][nt][e], alibi_slope_raw(p, b, h),
                                                    warp_row0 + mt * 16 + g + 8 * (e / 2),
                                                    n0 + nt * 8 + 2 * t + (e % 2));
            }
          }
        }

    // dQ += dS K; each K fragment serves all kM row tiles.
    const uint32_t kt_off = opaque(kXor ? Xs::lane_offset((lane % 8) + ((lane / 8) % 2) * 8, lane / 16) : 0u);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[kM][4];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) {
        a[mt][0] = Mma::pack(dp[mt][2 * kk][0], dp[mt][2 * kk][1]);
        a[mt][1] = Mma::pack(dp[mt][2 * kk][2], dp[mt][2 * kk][3]);
        a[mt][2] = Mma::pack(dp[mt][2 * kk + 1][0], dp[mt][2 * kk + 1][1]);
        a[mt][3] = Mma::pack(dp[mt][2 * kk + 1][2], dp[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt) {
        uint32_t bk[4];
        if constexpr (kXor)
          ldmatrix_x4_trans(bk, k_addr + Xs::at(kt_off, kk * 16, dt));
        else
          ldmatrix_x4_trans(bk, smem_addr(k_tile + Swizzle<D>::offset(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8,
                                                                      2 * dt + lane / 16)));
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          Mma::run(dq[mt][2 * dt], a[mt], bk);
          Mma::run(dq[mt][2 * dt + 1], a[mt], bk + 2);
        }
      }
    }
  }

  cp_async_wait<0>();  // rows that see no key (n_blocks = 0) still copied Q and dO: let them land before exit
  T* dq_head = static_cast<T*>(p.dq) + b * p.dq_st.b + h * p.dq_st.h;
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + mt * 16 + g + 8 * r;
      if (row >= p.seq_q) continue;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        store_pair(dq_head + row * p.dq_st.s + dt * 8 + 2 * t, dq[mt][dt][2 * r] * p.dq_scale,
                   dq[mt][dt][2 * r + 1] * p.dq_scale);
      }
    }
}

// dq (strided, T) = dq_scale · dq_accum (padded fp32, DqAccumLayout in `kOrder`), 8 elements per thread.
template <class T, int D, DqOrder kOrder>
__global__ void flash_bwd_dq_convert_kernel(const FlashParams p) {
  const int h = blockIdx.y, b = blockIdx.z;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  const int row = idx / (D / 8), part = idx % (D / 8);
  if (row >= p.seq_q) return;
  // Row `row`, columns part·8 .. part·8 + 7 of the tile at (row - r, part·8), r = row % 16: column 2t + c is
  // lane 4·(r % 8) + t's element e = 2·(r / 8) + c.
  const int r = row % 16;
  const float* tile =
      p.dq_accum + (int64_t(b) * p.heads_q + h) * p.seq_q_padded * D + DqAccumLayout<D>::block(row, part * 8);
  float even[4], odd[4];  // columns 0, 2, 4, 6 and 1, 3, 5, 7
  if constexpr (kOrder == DqOrder::fragment_major) {
    // The 4 floats at e = 2·(r / 8), lanes 4·(r % 8) + 0..3, then the 4 at e + 1.
    const float* src = tile + (r / 8) * 64 + (r % 8) * 4;
    const float4 e0 = *reinterpret_cast<const float4*>(src), e1 = *reinterpret_cast<const float4*>(src + 32);
    even[0] = e0.x, even[1] = e0.y, even[2] = e0.z, even[3] = e0.w;
    odd[0] = e1.x, odd[1] = e1.y, odd[2] = e1.z, odd[3] = e1.w;
  } else {
    // Lane 4·(r % 8) + t's pair at e = 2·(r / 8), + 1: 16 bytes apart from one t to the next.
    const float* src = tile + (r % 8) * 16 + (r / 8) * 2;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const float2 v = *reinterpret_cast<const float2*>(src + 4 * t);
      even[t] = v.x, odd[t] = v.y;
    }
  }
  const float c = p.dq_scale;  // the accumulator holds dS·K without the scale (one multiply here, not per atomic)
  uint4 out;
  out.x = MmaOp<T>::pack(even[0] * c, odd[0] * c);
  out.y = MmaOp<T>::pack(even[1] * c, odd[1] * c);
  out.z = MmaOp<T>::pack(even[2] * c, odd[2] * c);
  out.w = MmaOp<T>::pack(even[3] * c, odd[3] * c);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + b * p.dq_st.b + row * p.dq_st.s + h * p.dq_st.h + part * 8) = out;
}

template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes, const char* name) {
  FLASHLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), name);
}

// The most dynamic shared memory one block of the backward asks for at head dim D: the dK/dV kernel's,
// or the dQ pass's where the deterministic mode runs it.
template <int D>
constexpr size_t backward_smem_bytes(bool deterministic) {
  return deterministic ? std::max(BwdTraits<D>::kSmemBytes, DqTraits<D>::kSmemBytes) : BwdTraits<D>::kSmemBytes;
}

// Delta = rowsum(dO∘O) over Dv columns and lse·log2e (and the sink's gradient), before any dK/dV kernel.
template <class T, int Dv>
void launch_preprocess(const FlashParams& f, cudaStream_t stream) {
  constexpr int rows_per_block = 256 / (Dv / 8);
  const dim3 grid((f.seq_q_padded + rows_per_block - 1) / rows_per_block, f.heads_q, f.batch);
  flash_bwd_preprocess_kernel<T, Dv><<<grid, 256, 0, stream>>>(f);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_bwd_preprocess_kernel launch");
  if (f.dsink != nullptr) {
    flash_bwd_sink_grad_kernel<<<f.heads_q, kSinkGradThreads, 0, stream>>>(f);
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_bwd_sink_grad_kernel launch");
  }
}

// dq (T) from the fp32 accumulator the atomic dK/dV kernels added into, over D columns.
template <class T, int D>
void launch_dq_convert(const FlashParams& f, DqOrder order, cudaStream_t stream) {
  const dim3 grid((f.seq_q * (D / 8) + 255) / 256, f.heads_q, f.batch);
  if (order == DqOrder::lane_major) {
    flash_bwd_dq_convert_kernel<T, D, DqOrder::lane_major><<<grid, 256, 0, stream>>>(f);
  } else {
    flash_bwd_dq_convert_kernel<T, D, DqOrder::fragment_major><<<grid, 256, 0, stream>>>(f);
  }
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_bwd_dq_convert_kernel launch");
}

// The views a family's own dK/dV kernel builds its launch from (run_flash_backward, flash_common.cuh).
struct DkdvPart {
  BackwardDkdvLauncher launch;
  const AttentionProblem& p;
  const TensorView &q, &k, &v, &dout;
};

template <class T, int D>
void launch_backward(const FlashParams& f, bool deterministic, const DkdvPart* part, cudaStream_t stream) {
  // Checked before anything is queued: a device granting less than the kernels need (sm_86 and sm_89 at
  // head dims 128 and 256) gets an Error naming the head dim rather than a failed launch.
  const size_t needed = backward_smem_bytes<D>(deterministic);
  const int64_t granted = cuda_shared_memory_per_block_optin();
  FLASHLM_CHECK(granted >= 0 && needed <= static_cast<size_t>(granted),
                "flash_attention_backward_cuda: head_dim {} needs {} bytes of shared memory per block, this GPU "
                "grants {} (sm_80 and sm_90 grant enough; AttentionImpl::naive has no such limit)",
                D, needed, granted);
  // An empty side launches nothing over it (a grid of 0 blocks is a launch error): with no queries the
  // dK/dV kernel alone writes zeros, with no keys the dQ pass (or the cleared accumulator) does.
  if (f.seq_q > 0) launch_preprocess<T, D>(f, stream);
  if (part != nullptr) {
    part->launch(part->p, part->q, part->k, part->v, part->dout, f, stream);
  } else if (f.seq_k > 0) {
    using Tr = BwdTraits<D>;
    auto kernel = flash_bwd_dkdv_kernel<T, D, true, false>;
    if (deterministic) {
      kernel = f.masked ? flash_bwd_dkdv_kernel<T, D, false, true> : flash_bwd_dkdv_kernel<T, D, false, false>;
    } else if (f.masked) {
      kernel = flash_bwd_dkdv_kernel<T, D, true, true>;
    }
    allow_smem(kernel, Tr::kSmemBytes, "flash_bwd_dkdv_kernel: shared-memory opt-in");
    const dim3 grid((f.seq_k + Tr::kBlockN - 1) / Tr::kBlockN, f.heads_k, f.batch);
    kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(f);
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_bwd_dkdv_kernel launch");
  }
  if (f.seq_q == 0) return;
  if (deterministic) {
    using Tr = DqTraits<D>;
    auto kernel = f.masked ? flash_bwd_dq_kernel<T, D, true> : flash_bwd_dq_kernel<T, D, false>;
    allow_smem(kernel, Tr::kSmemBytes, "flash_bwd_dq_kernel: shared-memory opt-in");
    const dim3 grid((f.seq_q + Tr::kBlockM - 1) / Tr::kBlockM, f.heads_q, f.batch);
    kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(f);
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_bwd_dq_kernel launch");
  } else {
    // A family's own dK/dV kernel (the Hopper backward) stages dQ lane-major; mma.sync's atomics do not.
    launch_dq_convert<T, D>(f, part != nullptr ? DqOrder::lane_major : DqOrder::fragment_major, stream);
  }
}

// A head dim pair (Dv for v, o, dout and dv, D for q, k, dq and dk): a dK/dV kernel of another family's
// (the Hopper backward's pairs; mma.sync runs pairs padded), with Delta = rowsum(dO∘O) over Dv columns and
// the dQ accumulator and its conversion over D.
template <class T, int D, int Dv>
void launch_backward_pair(const FlashParams& f, const DkdvPart& part, cudaStream_t stream) {
  if (f.seq_q > 0) launch_preprocess<T, Dv>(f, stream);
  part.launch(part.p, part.q, part.k, part.v, part.dout, f, stream);
  if (f.seq_q == 0) return;
  launch_dq_convert<T, D>(f, DqOrder::lane_major, stream);
}

template <class T>
void dispatch_head_dim(int64_t d, int64_t dv, const FlashParams& f, bool deterministic, const DkdvPart* part,
                       cudaStream_t stream) {
  if (dv != d) {
    FLASHLM_CHECK(part != nullptr && !deterministic,
                  "flash_attention_backward_cuda: head_dim {} with head_dim_v {} runs padded on the mma.sync kernels",
                  d, dv);
    const bool launched = with_head_dim_pair<kHopperBackwardHeadDimPairs>(
        d, dv, [&](auto dim, auto dim_v) { launch_backward_pair<T, dim.value, dim_v.value>(f, *part, stream); });
    FLASHLM_CHECK(launched,
                  "flash_attention_backward_cuda: head_dim {} with head_dim_v {} has no kernel (the capability table "
                  "lists it)",
                  d, dv);
    return;
  }
  const bool launched = with_head_dim<kMmaSyncBackwardHeadDims>(
      d, [&](auto dim) { launch_backward<T, decltype(dim)::value>(f, deterministic, part, stream); });
  FLASHLM_CHECK(launched, "flash_attention_backward_cuda: head_dim {} has no kernel (the capability table lists it)",
                d);
}

}  // namespace
}  // namespace flash_cuda

size_t mma_sync_backward_smem_bytes(int64_t head_dim, bool deterministic) {
  size_t bytes = 0;
  const bool compiled = with_head_dim<kMmaSyncBackwardHeadDims>(
      head_dim, [&](auto dim) { bytes = flash_cuda::backward_smem_bytes<decltype(dim)::value>(deterministic); });
  FLASHLM_CHECK(compiled, "mma_sync_backward_smem_bytes: head_dim {} has no mma.sync backward kernel", head_dim);
  return bytes;
}

namespace {

// The atomic mode's fp32 dQ accumulator is 4·B·Hq·Nq·D bytes, a quarter of the bf16 inputs, outputs and
// gradients together. Above kAccumulatorChunkAbove, the backward runs over groups of key/value heads (with
// their query heads) so that each group's accumulator is at most kAccumulatorChunkBytes: peak memory stays
// near inputs + outputs + gradients at long sequences, while typical shapes run in one launch. A group is
// never smaller than kMinWavesPerLaunch waves of the dK/dV kernel's blocks (one per kBlockN keys, key head
// and batch: 128 keys, 64 at head dim 256, in every dK/dV kernel (flash_common.cuh)): launches run one
// after another, and one that under-fills the GPU lasts as long as its longest block, so at b1, 64 query /
// 8 key heads, 16k, d128 one key head per launch (128 blocks for 132 SMs) made the causal backward as slow
// as the non-causal one (issue 15). There
// the accumulator is 256 MiB (two launches of 4 key heads) instead of 64; at long MHA sequences, where a
// head alone has several waves of blocks, the bytes bound decides as before.
constexpr size_t kAccumulatorChunkAbove = size_t{128} << 20;
constexpr size_t kAccumulatorChunkBytes = size_t{64} << 20;
constexpr int64_t kMinWavesPerLaunch = 3;
// A head dim pair (the Hopper backward's, which run unpadded) counts as its padded kernel's head dim, the
// larger of the two: the wide Hopper kernel's key block is that kernel's (flash_bwd_wide_sm90.cu asserts it).
int64_t backward_keys_per_block(const AttentionProblem& p) {
  const int64_t head_dim = std::max(p.head_dim, p.value_dim());
  if (p.value_dim() != p.head_dim) return flash_cuda::mma_sync_backward_block_n(static_cast<int>(head_dim));
  int64_t keys = 0;
  const bool compiled = with_head_dim<kMmaSyncBackwardHeadDims>(
      head_dim, [&](auto dim) { keys = flash_cuda::BwdTraits<decltype(dim)::value>::kBlockN; });
  FLASHLM_CHECK(compiled, "backward_keys_per_block: head_dim {} has no mma.sync backward kernel", head_dim);
  return keys;
}

void backward_heads(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& o, const TensorView& lse, const TensorView& dout, const TensorView& dq,
                    const TensorView& dk, const TensorView& dv, bool deterministic, float* dq_accum,
                    flash_cuda::BackwardDkdvLauncher dkdv, void* stream) {
  auto f = flash_cuda::make_params(p, q, k, v, o, lse);
  f.dout = dout.data;
  f.dq = dq.data;
  f.dk = dk.data;
  f.dv = dv.data;
  f.do_st = flash_cuda::row_strides(dout);
  f.dq_st = flash_cuda::row_strides(dq);
  f.dk_st = flash_cuda::row_strides(dk);
  f.dv_st = flash_cuda::row_strides(dv);
  f.seq_q_padded = static_cast<int>((p.seq_q + flash_cuda::kRowPad - 1) / flash_cuda::kRowPad * flash_cuda::kRowPad);

  const auto s = static_cast<cudaStream_t>(stream);
  const size_t rows = static_cast<size_t>(p.batch * p.heads_q) * static_cast<size_t>(f.seq_q_padded);
  Buffer delta = Buffer::allocate_on_stream(rows * sizeof(float), "flash backward Delta", stream);
  Buffer lse_log2 = Buffer::allocate_on_stream(rows * sizeof(float), "flash backward lse·log2e", stream);
  f.delta = static_cast<float*>(delta.data());
  f.lse_log2 = static_cast<float*>(lse_log2.data());
  if (!deterministic) {
    FLASHLM_CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, rows * static_cast<size_t>(p.head_dim) * sizeof(float), s),
                       "flash backward dQ clear");
    f.dq_accum = dq_accum;
  }
  const flash_cuda::DkdvPart part{dkdv, p, q, k, v, dout};
  const flash_cuda::DkdvPart* own = dkdv != nullptr ? &part : nullptr;
  if (p.dtype == DType::bf16) {
    flash_cuda::dispatch_head_dim<__nv_bfloat16>(p.head_dim, p.value_dim(), f, deterministic, own, s);
  } else {
    flash_cuda::dispatch_head_dim<__half>(p.head_dim, p.value_dim(), f, deterministic, own, s);
  }
}

}  // namespace

size_t backward_accumulator_bytes_per_kv_head(const AttentionProblem& p) {
  const int64_t seq_q_padded = (p.seq_q + flash_cuda::kRowPad - 1) / flash_cuda::kRowPad * flash_cuda::kRowPad;
  return static_cast<size_t>(p.batch * p.group() * seq_q_padded * p.head_dim) * sizeof(float);
}

int64_t backward_kv_heads_per_launch(const AttentionProblem& p, int multiprocessors) {
  const size_t per_kv_head = backward_accumulator_bytes_per_kv_head(p);
  if (p.heads_k == 0 || per_kv_head * static_cast<size_t>(p.heads_k) <= kAccumulatorChunkAbove) return p.heads_k;
  int64_t kv = std::max<int64_t>(1, static_cast<int64_t>(kAccumulatorChunkBytes / per_kv_head));
  const int64_t keys_per_block = backward_keys_per_block(p);
  const int64_t blocks_per_kv_head = (p.seq_k + keys_per_block - 1) / keys_per_block * p.batch;
  if (blocks_per_kv_head > 0) {
    const int64_t min_blocks = kMinWavesPerLaunch * std::max(multiprocessors, 1);
    kv = std::max(kv, (min_blocks + blocks_per_kv_head - 1) / blocks_per_kv_head);
  }
  kv = std::min(kv, p.heads_k);
  const int64_t launches = (p.heads_k + kv - 1) / kv;
  return (p.heads_k + launches - 1) / launches;  // launches of (nearly) equal size
}

void clear_sink_gradient_cuda(const AttentionProblem& p, void* stream) {
  if (p.dlearnable_sink == nullptr || p.heads_q == 0) return;
  // One float every dsink_stride floats: a strided 2-D memset of rows one float wide (one head: any stride, and
  // the pitch may not be below the width).
  const size_t pitch = p.heads_q == 1 ? sizeof(float) : static_cast<size_t>(p.dsink_stride) * sizeof(float);
  FLASHLM_CUDA_CHECK(cudaMemset2DAsync(p.dlearnable_sink, pitch, 0, sizeof(float), static_cast<size_t>(p.heads_q),
                                       static_cast<cudaStream_t>(stream)),
                     "attention_backward: dlearnable_sink clear");
}

void flash_attention_backward_cuda(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& o, const TensorView& lse,
                                   const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                   const TensorView& dv, bool deterministic, void* stream) {
  flash_cuda::run_flash_backward(p, q, k, v, o, lse, dout, dq, dk, dv, deterministic, nullptr, stream);
}

void flash_cuda::run_flash_backward(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                    const TensorView& v, const TensorView& o, const TensorView& lse,
                                    const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                    const TensorView& dv, bool deterministic, BackwardDkdvLauncher dkdv,
                                    void* stream) {
  FLASHLM_CHECK(dkdv == nullptr || !deterministic,
                "flash_attention_backward_cuda: a dK/dV kernel of another family has no deterministic mode");
  if (p.batch == 0 || p.heads_q == 0 || (p.seq_q == 0 && p.seq_k == 0)) return;
  const size_t per_kv_head = backward_accumulator_bytes_per_kv_head(p);
  int device = 0, multiprocessors = 0;
  FLASHLM_CUDA_CHECK(cudaGetDevice(&device), "flash_attention_backward_cuda: cudaGetDevice");
  FLASHLM_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device),
                     "flash_attention_backward_cuda: multiprocessor count");
  const int64_t kv_per_launch = deterministic ? p.heads_k : backward_kv_heads_per_launch(p, multiprocessors);
  Buffer dq_accum;
  if (!deterministic) {
    dq_accum = Buffer::allocate_on_stream(per_kv_head * static_cast<size_t>(std::min(kv_per_launch, p.heads_k)),
                                          "flash backward dQ accumulator", stream);
  }
  auto* accum = static_cast<float*>(dq_accum.data());
  if (kv_per_launch >= p.heads_k) {
    backward_heads(p, q, k, v, o, lse, dout, dq, dk, dv, deterministic, accum, dkdv, stream);
    return;
  }
  // Views are [batch, seq, heads, head_dim] (lse [batch, heads_q, seq_q]); a group of key/value heads
  // [h0, h1) goes with query heads [h0·group, h1·group).
  const int64_t g = p.group();
  for (int64_t h0 = 0; h0 < p.heads_k; h0 += kv_per_launch) {
    const int64_t h1 = std::min(p.heads_k, h0 + kv_per_launch);
    AttentionProblem part = p;
    part.heads_k = h1 - h0;
    part.heads_q = (h1 - h0) * g;
    // The per-head vectors start at the group's first query head, as the sliced views do.
    if (part.alibi) part.alibi_slopes += h0 * g * part.alibi_head_stride;
    if (part.sink) part.learnable_sink += h0 * g * part.sink_stride;
    if (part.dlearnable_sink != nullptr) part.dlearnable_sink += h0 * g * part.dsink_stride;
    const auto qh = [&](const TensorView& t) { return t.slice(2, h0 * g, h1 * g); };
    const auto kh = [&](const TensorView& t) { return t.slice(2, h0, h1); };
    backward_heads(part, qh(q), kh(k), kh(v), qh(o), lse.slice(1, h0 * g, h1 * g), qh(dout), qh(dq), kh(dk), kh(dv),
                   deterministic, accum, dkdv, stream);
  }
}

}  // namespace flashlm
