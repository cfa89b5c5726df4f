// FlashAttention forward for Hopper (sm_90a): TMA loads into an mbarrier ring, wgmma on tensor cores,
// warp specialisation, persistent blocks.
//
// One block per SM walking the query tiles in the order TileSchedule gives: tiles of 128 rows on three
// warpgroups, or at head dim 64 of 192 rows on four (sm90_forward_d64_tile picks the tile shape).
// Warpgroup 0 is the producer: one thread loads each tile's Q once the consumers have released the last
// one, and streams K and V blocks through a ring of kStages shared-memory slots with TMA, each slot guarded
// by a "full" mbarrier (the copy engine completes it) and an "empty" one (every consumer thread arrives
// once it has read the slot); the ring runs on from one tile into the next. The other warpgroups are
// consumers, each owning 64 query rows of the tile: S = Q·Kᵀ by wgmma with both operands in shared memory,
// the online softmax in registers on S's accumulators (exp2 with the scale folded in), P converted to 16
// bits in registers and O += P·V by wgmma with A from registers and V read N-major from its slot. They take
// turns issuing GEMMs (a ring of named barriers), and each issues S of block n with P·V of block n - 1
// so that its softmax of n runs under that GEMM. The producer gives up registers (setmaxnreg) so that the
// consumers can hold S, P and O. Rows past the ends of Q and K are zero-filled by TMA; key columns at or
// past seq_k and above the causal diagonal are masked in S. Each warpgroup writes its normalised O rows
// into a shared-memory stage and one of its threads stores them with TMA (which clips rows past seq_q), or,
// where the stage does not fit beside Q and the K/V ring (Sm90FwdTraits::kStagedO), its threads store them;
// at head dim 64, where the exponentials are the bottleneck, 1 in 8 of them runs on the FMA pipe.
// The control flow above lives in pipeline_sm90.cuh, shared with the FP8 forward; this file supplies the
// 16-bit kernel's tiles, loads, GEMMs and O store (Sm90FwdKernel).
// A sliding window or soft-capping takes a masked instantiation, ALiBi or an attention sink a third one
// (Sm90FwdTraits' MASKED and ALIBI_SINK: the bias and the sink live in WgmmaRowSoftmax), so that the plain
// kernels carry none of their work.
// V and O may have a head dim of their own (Sm90FwdTraits' DV, the capability table's head dim pairs: 192
// for Q·K with 128 for V is DeepSeek's MLA shape): Q's and K's tiles, TMA boxes and S's reduction run over D,
// V's tiles, P·V's columns, the O accumulators and O's store over DV; the softmax sees neither.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string_view>

#include "attention/backends.h"
#include "attention/capabilities.h"
#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper/hopper.h"
#include "attention/cuda/hopper/pipeline_sm90.cuh"
#include "attention/cuda/hopper/schedule_sm90.cuh"
#include "attention/cuda/hopper/sm90.cuh"
#include "attention/cuda/hopper/softmax_sm90.cuh"
#include "attention/cuda/hopper/tma.h"
#include "core/check.h"
#include "core/cuda_check.h"
#include "core/env.h"

namespace flashlm {
namespace flash_cuda {
namespace {

// Keys per block by default: at head dim 256 the O accumulators take 128 registers a thread and Q alone
// 64 KB of shared memory, so key blocks are 80 (40 S registers; two stages of K and V fit in the remaining
// 160 KB). At (192, 128) the registers are d128's, and two stages of 128 keys fit beside Q once O skips
// the shared-memory stage (kStagedO).
template <int D>
constexpr int sm90_default_block_n() {
  return D == 256 ? 80 : 128;
}

// The shared memory one sm_90 block may have, less the room forward_smem_bytes keeps to align its base and
// the barriers' few bytes.
constexpr uint32_t kSm90TileSmemBytes = 227 * 1024 - 2 * 1024;

// D the head dim of Q and K, DV that of V and O (D by default); BM query rows per tile (64 per consumer
// warpgroup: two or three), BN keys per block, ST ring stages; MASKED: the sliding-window / soft-capping
// instantiation (FlashParams::masked, WgmmaRowSoftmax's kMasked), one per head dim on the default tile;
// ALIBI_SINK (with MASKED): the one that adds ALiBi and attention sinks (WgmmaRowSoftmax's kAlibiSink), so
// that neither the plain nor the masked instantiation carries their work.
template <int D, int DV = D, int BM = 128, int BN = sm90_default_block_n<D>(), int ST = 2, bool MASKED = false,
          bool ALIBI_SINK = false>
struct Sm90FwdTraits {
  static_assert(MASKED || !ALIBI_SINK, "ALiBi and sinks take the masked instantiation");
  static constexpr bool kMasked = MASKED;
  static constexpr bool kAlibiSink = ALIBI_SINK;
  static constexpr int kHeadDim = D;
  static constexpr int kValueDim = DV;
  static constexpr int kBlockM = BM;
  static constexpr int kBlockN = BN;
  static constexpr int kStages = ST;
  static constexpr int kConsumers = BM / 64;
  static_assert(BM == 64 * kConsumers && (kConsumers == 2 || kConsumers == 3));
  static constexpr int kThreads = (1 + kConsumers) * sm90::kWarpgroupThreads;
  static constexpr int kConsumerThreads = kConsumers * sm90::kWarpgroupThreads;
  // 128 · (24 + 2 · 240) = 64512 of the SM's 65536 registers; with three consumers 128 · (24 + 3 · 160).
  static constexpr int kProducerRegisters = 24, kConsumerRegisters = kConsumers == 2 ? 240 : 160;
  static constexpr uint32_t kQBytes = kBlockM * D * 2, kKBytes = kBlockN * D * 2, kVBytes = kBlockN * DV * 2;
  static constexpr int kQkPanels = D / sm90::kPanelCols, kValuePanels = DV / sm90::kPanelCols;
  // O leaves through a shared-memory stage and TMA stores where the stage fits beside Q and the K/V ring;
  // where it does not (head dim 256: 64 + 160 KB before it; (192, 128): 48 + 160 KB), the threads store O
  // directly.
  static constexpr bool kStagedO = kQBytes + kStages * (kKBytes + kVBytes) + kBlockM * DV * 2 <= kSm90TileSmemBytes;
  // At head dim 64 the softmax's exponentials take as long as the two GEMMs of a key block: 1 in 8 of them
  // (every 8th group of 8 key columns) runs on the FMA pipe instead of the SFU (exp2_on_fma_pipe).
  static constexpr int kPolyEvery = D == 64 ? 8 : 0;
  // Independent chains for each row's running max and sum (4; at 256 the 10 column groups of a key block
  // of 80 keep one).
  static constexpr int kRowChains = D == 256 ? 1 : 4;
};

// O's staging tile for the TMA store: each consumer warpgroup's 64 rows as DV / 64 panels of 64 rows in
// sm90.cuh's swizzled layout (one store box each). Absent (one element) where O is stored directly.
template <class Tr>
struct Sm90FwdOStage {
  alignas(1024) uint16_t rows[Tr::kStagedO ? Tr::kConsumers * 64 * Tr::kValueDim : 1];
};

template <class Tr>
struct Sm90FwdShared {
  static constexpr int D = Tr::kHeadDim, DV = Tr::kValueDim;
  alignas(1024) uint16_t q[Tr::kBlockM * D];
  alignas(1024) uint16_t k[Tr::kStages][Tr::kBlockN * D];
  alignas(1024) uint16_t v[Tr::kStages][Tr::kBlockN * DV];
  Sm90FwdOStage<Tr> o;
  ForwardBarriers<Tr::kStages> bar;
};

// What the 16-bit kernel puts into the shared pipeline (pipeline_sm90.cuh): Q and K as D / 64 panels of 64
// swizzled columns each, V as DV / 64, S = Q·Kᵀ with both operands in shared memory, P·V with P from
// registers and V read N-major, and O out through a shared-memory stage and TMA stores (or directly where
// the stage does not fit). tm_o (boxes of 64 rows) is read only where Tr::kStagedO.
template <class T, class Tr>
struct Sm90FwdKernel : Tr {
  static constexpr int D = Tr::kHeadDim, DV = Tr::kValueDim;
  using Softmax = WgmmaRowSoftmax<Tr::kBlockN, Tr::kPolyEvery, Tr::kRowChains, Tr::kMasked, Tr::kAlibiSink>;
  using PFragments = uint32_t[Tr::kBlockN / 16][4];
  using GemmS = sm90::WgmmaM64<T, Tr::kBlockN>;
  using GemmO = sm90::WgmmaM64<T, DV>;
  static constexpr int kOValues = DV / 2;

  Sm90FwdShared<Tr>& s;
  const CUtensorMap *tm_q, *tm_k, *tm_v, *tm_o;

  __device__ __forceinline__ ForwardBarriers<Tr::kStages>& barriers() { return s.bar; }

  __device__ __forceinline__ void prefetch_descriptors() const {
    sm90::tma_prefetch_descriptor(tm_q);
    sm90::tma_prefetch_descriptor(tm_k);
    sm90::tma_prefetch_descriptor(tm_v);
    if constexpr (Tr::kStagedO) sm90::tma_prefetch_descriptor(tm_o);
  }
  // One box of kBlockM (Q) or kBlockN (K, V) rows per 64-column panel.
  __device__ __forceinline__ void load_q(int m0, int h, int b) {
#pragma unroll
    for (int panel = 0; panel < Tr::kQkPanels; ++panel) {
      sm90::tma_load_4d(s.q + panel * Tr::kBlockM * sm90::kPanelCols, tm_q, s.bar.q_full, panel * sm90::kPanelCols,
                        m0, h, b);
    }
  }
  __device__ __forceinline__ void load_k(int st, int n0, int hk, int b) {
#pragma unroll
    for (int panel = 0; panel < Tr::kQkPanels; ++panel) {
      sm90::tma_load_4d(s.k[st] + panel * Tr::kBlockN * sm90::kPanelCols, tm_k, s.bar.k_full[st],
                        panel * sm90::kPanelCols, n0, hk, b);
    }
  }
  __device__ __forceinline__ void load_v(int st, int n0, int hk, int b) {
#pragma unroll
    for (int panel = 0; panel < Tr::kValuePanels; ++panel) {
      sm90::tma_load_4d(s.v[st] + panel * Tr::kBlockN * sm90::kPanelCols, tm_v, s.bar.v_full[st],
                        panel * sm90::kPanelCols, n0, hk, b);
    }
  }

  __device__ __forceinline__ void gemm_s(float (&sacc)[Tr::kBlockN / 2], int st, int wg) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      GemmS::template ss<0>(sacc, sm90::k_major_descriptor(s.q, Tr::kBlockM, 64 * wg, kk),
                            sm90::k_major_descriptor(s.k[st], Tr::kBlockN, 0, kk), kk > 0);
    }
  }
  __device__ __forceinline__ void gemm_pv(float (&o)[kOValues], PFragments& pa, int st) {
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
      GemmO::template rs<1>(o, pa[kk], sm90::mn_major_descriptor(s.v[st], Tr::kBlockN, kk), 1);
    }
  }
  // P as wgmma A fragments: keys [16·kk, 16·kk + 16) are S's column blocks 2·kk and 2·kk + 1.
  __device__ __forceinline__ static void pack_p(PFragments& pa, const float (&sacc)[Tr::kBlockN / 2]) {
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
#pragma unroll
      for (int e = 0; e < 4; ++e) pa[kk][e] = MmaOp<T>::pack(sacc[8 * kk + 2 * e], sacc[8 * kk + 2 * e + 1]);
    }
  }

  // Nothing kept per tile: the scale is the problem's (p.scale), O's factor 1.
  template <class Softmax>
  __device__ __forceinline__ static void start_tile(Softmax&, const FlashParams&, int, int) {}
  __device__ __forceinline__ static float o_scale() { return 1.f; }
  __device__ __forceinline__ void store_o(const float (&o)[kOValues], const float (&inv)[2], const FlashParams& p,
                                          const ForwardTileRows& tile) {
    if constexpr (Tr::kStagedO) {
      // Through shared memory: the warpgroup's 64 rows into its staging panels, then one thread stores the
      // panels with TMA, which skips rows past seq_q. The previous tile's store must have read the panels
      // before they are written again. Each stmatrix writes a warp's 16 rows x 16 columns: tiles 0 and 1
      // are rows [0, 8) and [8, 16) of column group 2·jj, tiles 2 and 3 the same of group 2·jj + 1, so
      // lane l addresses row 8·(m % 2) + l % 8, column group 2·jj + m / 2 of its tile m = l / 8.
      const auto epilogue =
          static_cast<sm90::NamedBarrier>(static_cast<uint32_t>(sm90::NamedBarrier::kEpilogue0) + tile.wg);
      uint16_t* stage = s.o.rows + tile.wg * 64 * DV;
      if (tile.ctid == 0) sm90::bulk_wait_read<0>();
      sm90::named_barrier_sync(epilogue, sm90::kWarpgroupThreads);
      const int lane = 4 * tile.g + tile.t, m = lane / 8;
      const int row = 16 * tile.warp + 8 * (m % 2) + lane % 8;
      const uint32_t stage_address = sm90::smem_u32(stage);
#pragma unroll
      for (int jj = 0; jj < DV / 16; ++jj) {
        const float* oj = o + 8 * jj;  // column groups 2·jj (oj[0..3]) and 2·jj + 1 (oj[4..7])
        sm90::stmatrix_x4(stage_address + sm90::swizzled_offset(64, row, 8 * (2 * jj + m / 2)),
                          MmaOp<T>::pack(oj[0] * inv[0], oj[1] * inv[0]), MmaOp<T>::pack(oj[2] * inv[1], oj[3] * inv[1]),
                          MmaOp<T>::pack(oj[4] * inv[0], oj[5] * inv[0]), MmaOp<T>::pack(oj[6] * inv[1], oj[7] * inv[1]));
      }
      sm90::fence_proxy_async_shared();
      sm90::named_barrier_sync(epilogue, sm90::kWarpgroupThreads);
      if (tile.ctid == 0) {
#pragma unroll
        for (int panel = 0; panel < Tr::kValuePanels; ++panel) {
          sm90::tma_store_4d(tm_o, stage + panel * 64 * sm90::kPanelCols, panel * sm90::kPanelCols, tile.wg_row0,
                             tile.h, tile.b);
        }
        sm90::bulk_commit();
      }
    } else {
      store_o_rows_direct<T>(o, inv, p, tile);
    }
  }
  // The shared memory the last TMA stores read must outlive them.
  __device__ __forceinline__ static void consumer_exit(int ctid) {
    if (Tr::kStagedO && ctid == 0) sm90::bulk_wait<0>();
  }
};

template <class T, class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                          const FlashParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  Sm90FwdKernel<T, Tr> kernel{{}, sm90::aligned_shared<Sm90FwdShared<Tr>>(smem_raw), &tm_q, &tm_k, &tm_v, &tm_o};
  run_forward_pipeline(kernel, p);
#endif
}

// TileSchedule's item count, on the host.
int64_t sm90_work_items(int64_t seq_q, int64_t heads_q, int64_t batch, int block_m) {
  return TileSchedule::count(seq_q, heads_q, batch, block_m);
}

// Where the problem takes the masked kernel or its ALiBi / sink instantiation (`masked`, `alibi_sink`), calls
// f(Traits{}) with that kernel's traits at head dims D and DV on their default tile and returns true; else
// returns false and leaves the plain kernel's tile to the caller.
template <int D, int DV, class F>
bool with_masked_traits(bool masked, bool alibi_sink, F& f) {
  constexpr int kBlockN = sm90_default_block_n<D>();
  if (alibi_sink) f(Sm90FwdTraits<D, DV, 128, kBlockN, 2, true, true>{});
  else if (masked) f(Sm90FwdTraits<D, DV, 128, kBlockN, 2, true>{});
  return masked || alibi_sink;
}

// Calls f(Traits{}) with the traits of the kernel that runs problem `p` and returns true, or returns false
// where the capability table lists no Hopper forward for its head dim (or its pair of head dims, where v has
// one of its own). A sliding window or soft-capping takes the masked kernel on the head dims' default tile
// (FLASHLM_SM90_FWD_D64_TILE does not apply), ALiBi or a sink (with or without them) the masked kernel's
// ALiBi / sink instantiation on the same tile.
template <class F>
bool with_forward_traits(const AttentionProblem& p, F&& f) {
  const bool masked = uses_masked_kernels(p), alibi_sink = p.alibi || p.sink;
  if (p.value_dim() != p.head_dim) {
    return with_head_dim_pair<kHopperForwardHeadDimPairs>(p.head_dim, p.value_dim(), [&](auto dim, auto dim_v) {
      constexpr int D = decltype(dim)::value, DV = decltype(dim_v)::value;
      if (!with_masked_traits<D, DV>(masked, alibi_sink, f)) f(Sm90FwdTraits<D, DV>{});
    });
  }
  return with_head_dim<kHopperForwardHeadDims>(p.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    if (with_masked_traits<D, D>(masked, alibi_sink, f)) return;
    if constexpr (D == 64) {
      switch (sm90_forward_d64_tile(p)) {
        case Sm90D64Tile::rows192_keys128: return f(Sm90FwdTraits<64, 64, 192, 128>{});
        case Sm90D64Tile::rows128_keys192: return f(Sm90FwdTraits<64, 64, 128, 192>{});
        case Sm90D64Tile::rows128_keys128: break;
      }
    }
    f(Sm90FwdTraits<D>{});
  });
}

// One block per multiprocessor (or per work item, where there are fewer): see TileSchedule.
template <class T, class Tr>
void launch_forward_sm90(const FlashParams& f, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& v,
                         const CUtensorMap& o, int sm_count, cudaStream_t stream) {
  auto kernel = flash_fwd_sm90_kernel<T, Tr>;
  constexpr int kSmem = static_cast<int>(forward_smem_bytes<Sm90FwdShared<Tr>>());
  static_assert(kSmem <= 227 * 1024, "an sm_90 block has at most 227 KB of shared memory");
  FLASHLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                     "flash_fwd_sm90_kernel: shared-memory opt-in");
  const int64_t items = sm90_work_items(f.seq_q, f.heads_q, f.batch, Tr::kBlockM);
  kernel<<<static_cast<unsigned>(std::min<int64_t>(items, sm_count)), Tr::kThreads, kSmem, stream>>>(q, k, v, o, f);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_fwd_sm90_kernel launch");
}

struct Sm90ForwardPlan {
  CUtensorMap q, k, v;
  CUtensorMap o;  // where the kernel stages O (Tr::kStagedO: TMA stores) and an O is given; else unused
  int sm_count;
};

// The tensor maps for `p`, or nothing where this kernel does not cover the problem.
std::optional<Sm90ForwardPlan> plan_forward_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                                 const TensorView& v, const TensorView* o) {
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return std::nullopt;
  if (p.batch == 0 || p.seq_q == 0 || p.seq_k == 0 || p.heads_q == 0) return std::nullopt;
  int query_rows = 0, key_rows = 0;
  bool staged_o = false;
  const bool compiled = with_forward_traits(p, [&]<class Tr>(Tr) {
    query_rows = Tr::kBlockM;
    key_rows = Tr::kBlockN;
    staged_o = Tr::kStagedO;
  });
  if (!compiled) return std::nullopt;
  // The kernel counts work items in 32-bit integers.
  if (sm90_work_items(p.seq_q, p.heads_q, p.batch, query_rows) > INT32_MAX) return std::nullopt;
  const int sm_count = sm90_multiprocessors();
  if (sm_count == 0) return std::nullopt;
  auto tq = sm90::rows_tensor_map(q, query_rows);
  auto tk = sm90::rows_tensor_map(k, key_rows), tv = sm90::rows_tensor_map(v, key_rows);
  if (!tq || !tk || !tv) return std::nullopt;
  // O in boxes of one consumer warpgroup's 64 rows. Validation leaves only views TMA can describe (16-byte
  // strides and base), so a failure here is a limit of the map (2^40-byte strides): the fallback takes it.
  if (o == nullptr || !staged_o) return Sm90ForwardPlan{*tq, *tk, *tv, *tq, sm_count};
  const auto to = sm90::rows_tensor_map(*o, 64);
  if (!to) return std::nullopt;
  return Sm90ForwardPlan{*tq, *tk, *tv, *to, sm_count};
}

}  // namespace

// Three consumer warpgroups on 192-row tiles (a third warp per scheduler to cover the softmax's dependency
// chains) pay off where neither sequence is short and nothing is masked, key blocks of 192 (the per-block
// fixed work spread over more keys) on long causal problems; shorter, both lose to the padding of the last
// 192-row tile or key block and, causal, the wider diagonal. The thresholds are where the fa grid's
// timings cross over (docs/perf.md, the Hopper forward's tile shapes).
Sm90D64Tile sm90_forward_d64_tile(const AttentionProblem& p) {
  const std::string_view forced = env_choice(kSm90ForwardD64Tile);
  if (forced == "128x128") return Sm90D64Tile::rows128_keys128;
  if (forced == "192x128") return Sm90D64Tile::rows192_keys128;
  if (forced == "128x192") return Sm90D64Tile::rows128_keys192;
  const int64_t shorter = std::min(p.seq_q, p.seq_k);
  if (!p.causal && shorter >= 4096) return Sm90D64Tile::rows192_keys128;
  if (p.causal && shorter >= 8192) return Sm90D64Tile::rows128_keys192;
  return Sm90D64Tile::rows128_keys128;
}

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
                    cudaFuncGetAttributes(&attr, flash_fwd_sm90_kernel<__nv_bfloat16, Sm90FwdTraits<128>>) == cudaSuccess &&
                    attr.binaryVersion == 90;
    cudaGetLastError();  // a failed query must not surface at the next launch check
    cached[device] = ok ? sms : -1;
  }
  return std::max(cached[device], 0);
}

}  // namespace flash_cuda

bool flash_forward_sm90_covers(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView* o) {
  return flash_cuda::plan_forward_sm90(p, q, k, v, o).has_value();
}

void flash_attention_forward_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& o, const TensorView& lse, void* stream) {
  const auto plan = flash_cuda::plan_forward_sm90(p, q, k, v, &o);
  FLASHLM_CHECK(plan.has_value(), "attention_forward: the Hopper forward was chosen for a problem it does not cover");
  const auto f = flash_cuda::make_params(p, q, k, v, o, lse);
  const auto s = static_cast<cudaStream_t>(stream);
  using flash_cuda::launch_forward_sm90;
  auto launch = [&]<class T>(T) {
    flash_cuda::with_forward_traits(p, [&]<class Tr>(Tr) {
      launch_forward_sm90<T, Tr>(f, plan->q, plan->k, plan->v, plan->o, plan->sm_count, s);
    });
  };
  if (p.dtype == DType::bf16) launch(__nv_bfloat16{});
  else launch(__half{});
}

}  // namespace flashlm
