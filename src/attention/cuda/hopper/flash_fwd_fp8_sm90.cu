// FP8 (e4m3) FlashAttention forward for Hopper (sm_90a): e4m3 Q, K and V with per-tensor or per-(batch, key head)
// descale factors, fp32 logsumexp, bf16 output, head dims 64 and 128, on e4m3 wgmma.
//
// The pipeline of the 16-bit kernel (pipeline_sm90.cuh, described in flash_fwd_sm90.cu's file comment):
// one block per SM walking TileSchedule's query-tile pairs, a producer warpgroup whose one thread streams Q and the K/V
// blocks through an mbarrier ring with TMA, two consumer warpgroups of 64 query rows ping-ponging their
// GEMMs, each issuing S of key block n with P·V of block n - 1, setmaxnreg between the roles. The online
// softmax (softmax_sm90.cuh) folds softmax_scale·q_descale·k_descale into the exp2; P is rounded to e4m3 in
// registers (it lies in [0, 1], no range scaling needed) and O is multiplied by v_descale / rowsum at the end.
// Per-head descales (FlashAttention-3's q_descale_ptr..: fp32 [batch, heads_k]) are read at each tile's start
// (Fp8Descales), the tile's factors computed as make_params computes the per-tensor ones, so that descales equal
// in every head give the per-tensor bits.
//
// Two things 8-bit wgmma changes against the 16-bit kernel:
//  - both operands must be K-major, so P·V needs Vᵀ (channels x keys, keys contiguous). A pre-pass
//    (fp8_transpose_v_kernel) writes Vᵀ of every key head into a workspace, [batch, heads_k, D, keys padded
//    to the key block] with zeros past seq_k, and the producer loads its key blocks with TMA like K. It reads
//    and writes N·D bytes per key head once, where the attention reads V once per query tile (docs/perf.md);
//  - the A fragment of a k32 step wants bytes of columns 4t..4t+3 in one register, while S's accumulators
//    give a thread columns 2t, 2t+1 of each 8-column group. Instead of moving bytes between threads, the
//    keys are relabelled: the sum over keys does not care about their order, so the thread packs the four
//    values it has (keys 2t, 2t+1, 8+2t, 9+2t of a 16-key group) as logical columns 4t..4t+3, and Vᵀ's
//    column for logical key L holds the physical key physical_key(L) — the pre-pass applies the same
//    permutation.
// Q and K rows are one swizzled row each: 128 bytes (128-byte swizzle) at head dim 128, 64 bytes (64-byte
// swizzle) at 64. Vᵀ rows are a key block: 128 keys, one 128-byte swizzled row, or, at key blocks of 192
// (FLASHLM_FP8_KEY_BLOCK, fp8_forward_key_block below), three panels of 64 keys with the 64-byte swizzle (a row
// of 192 bytes is no swizzle's width), each a box of its own, P·V's k-steps of 32 keys walking them two by two.
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "attention/backends.h"
#include "attention/capabilities.h"
#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/head_descales.cuh"
#include "attention/cuda/hopper/hopper.h"
#include "attention/cuda/hopper/pipeline_sm90.cuh"
#include "attention/cuda/hopper/schedule_sm90.cuh"
#include "attention/cuda/hopper/sm90.cuh"
#include "attention/cuda/hopper/softmax_sm90.cuh"
#include "attention/cuda/hopper/tma.h"
#include "core/check.h"
#include "core/cuda_check.h"
#include "core/env.h"
#include "flashlm/memory.h"

namespace flashlm {
namespace flash_cuda {
namespace {

// N: keys per key block, 128 (the default) or 192 (FLASHLM_FP8_KEY_BLOCK): longer blocks spread each row's fixed
// work per block (the max and sum reductions, O's rescale, the barrier waits) over more keys, for 32 more S
// registers a thread. Vᵀ's rows are N bytes: one 128-byte swizzle panel at 128; at 192, three 64-byte ones.
template <int D, int N>
struct Fp8FwdTraits {
  static_assert(N == 128 || N == 192, "key blocks of 128 or 192");
  static constexpr int kBlockM = 128;  // two consumer warpgroups of 64 rows
  static constexpr int kBlockN = N;
  static constexpr int kVPanelKeys = N == 128 ? 128 : 64;  // keys per Vᵀ panel: its rows' bytes and swizzle
  static constexpr int kVPanels = N / kVPanelKeys;
  static constexpr int kStages = 2;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = (1 + kConsumers) * sm90::kWarpgroupThreads;
  static constexpr int kConsumerThreads = kConsumers * sm90::kWarpgroupThreads;
  static constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
  static constexpr uint32_t kQBytes = kBlockM * D, kKBytes = kBlockN * D, kVBytes = D * kBlockN;
};

template <int D, int N>
struct Fp8FwdShared {
  using Tr = Fp8FwdTraits<D, N>;
  alignas(1024) uint8_t q[Tr::kBlockM * D];
  alignas(1024) uint8_t k[Tr::kStages][Tr::kBlockN * D];
  alignas(1024) uint8_t vt[Tr::kStages][D * Tr::kBlockN];  // kVPanels panels of D rows x kVPanelKeys bytes
  ForwardBarriers<Tr::kStages> bar;
};
// At head dim 128 and 192 keys: Q 16 KB, K and Vᵀ 2 x 24 KB each, 112 KB and the barriers of the 227 KB.
static_assert(sizeof(Fp8FwdShared<128, 192>) + 1024 <= 227 * 1024);

// The physical key (within a block) that logical reduction column L of the P·V GEMM stands for. Within each
// 16 keys: L = 4t + 2a + b (t the thread in its quad) holds key 8a + 2t + b, the a-th 8-column group's
// column 2t + b of S's accumulator (see the file comment).
__device__ __forceinline__ int physical_key(int L) {
  return (L & ~15) | (((L >> 1) & 1) << 3) | (((L >> 2) & 3) << 1) | (L & 1);
}

__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  // __nv_cvt_float2_to_fp8x2 puts .x in the low byte; satfinite keeps NaN (a NaN input shows in O).
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// ---- The Vᵀ pre-pass: one block per (key block of kTransposeKeys, the attention's, key head, batch),
// grid-strided. The block reads the keys' rows of V (16-byte loads, any row strides) into shared memory, zeros
// past seq_k, and writes the 16-byte chunks of Vᵀ: row d, logical columns L = 16c .. 16c + 15 of the block hold
// V[physical_key(L)][d] (the permutation works within 16 keys, so any multiple of 16 keys per block keeps it).
constexpr int kTransposeThreads = 256;

template <int D, int kTransposeKeys>
__global__ void __launch_bounds__(kTransposeThreads)
    fp8_transpose_v_kernel(const uint8_t* v, RowStrides st, uint8_t* vt, int seq_k, int64_t keys_padded, int heads_k,
                           int64_t blocks) {
  static_assert(kTransposeKeys % 16 == 0 && kTransposeKeys * D <= 48 * 1024);
  __shared__ alignas(16) uint8_t tile[kTransposeKeys * D];
  const int64_t key_blocks = keys_padded / kTransposeKeys;
  for (int64_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const int64_t kb = blk % key_blocks, hk = (blk / key_blocks) % heads_k, b = blk / key_blocks / heads_k;
    const int64_t n0 = kb * kTransposeKeys;
    const uint8_t* head = v + b * st.b + hk * st.h;
    __syncthreads();  // the previous block's reads of the tile are done
    for (int i = threadIdx.x; i < kTransposeKeys * D / 16; i += kTransposeThreads) {
      const int r = i / (D / 16), c = i % (D / 16);
      uint4 val = make_uint4(0, 0, 0, 0);
      if (n0 + r < seq_k) val = *reinterpret_cast<const uint4*>(head + (n0 + r) * st.s + c * 16);
      *reinterpret_cast<uint4*>(tile + r * D + c * 16) = val;
    }
    __syncthreads();
    // Consecutive threads take consecutive channels: each byte read of a warp is 32 bytes of one key row.
    uint8_t* out = vt + ((b * heads_k + hk) * D) * keys_padded + n0;
    for (int i = threadIdx.x; i < D * (kTransposeKeys / 16); i += kTransposeThreads) {
      const int d = i % D, chunk = i / D;
      uint32_t w[4];
#pragma unroll
      for (int word = 0; word < 4; ++word) {
        uint32_t packed = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) packed |= uint32_t{tile[physical_key(16 * chunk + 4 * word + e) * D + d]} << (8 * e);
        w[word] = packed;
      }
      *reinterpret_cast<uint4*>(out + d * keys_padded + 16 * chunk) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// The descales the kernel applies: per tensor (q's and k's folded into FlashParams' scale and scale_log2 by
// make_params, v's the view's scalar), or per (batch, key head) where any of the three views has data.
struct Fp8Descales {
  HeadDescalesView q, k, v;
  double softmax_scale;  // AttentionProblem::scale, without the descales
  bool per_head;         // any of the three per head: the tile's factors are read and computed at its start
};

// ---- The attention kernel: what it puts into the shared pipeline (pipeline_sm90.cuh). The softmax's score scale
// is the tile's (start_tile): FlashParams' scale and scale_log2, which carry per-tensor q_descale·k_descale, or
// the tile's key head's per-head factors; its v descale multiplies O at the end. Q and K come in one
// box per tile (a row is one swizzled row), Vᵀ in one box of D rows per panel (kVPanels per key block: one
// 128-byte-wide at 128 keys, three 64-byte-wide at 192); both GEMMs read K-major operands, P·V with P from
// registers as e4m3. tm_vt maps the pre-pass's Vᵀ as a [batch, D, heads_k, keys_padded] view, in boxes of a
// panel's keys.
template <int D, int N>
struct Fp8FwdKernel : Fp8FwdTraits<D, N> {
  using Tr = Fp8FwdTraits<D, N>;
  using Softmax = WgmmaRowSoftmax<Tr::kBlockN, 0, 1, false, false, true>;
  using PFragments = uint32_t[Tr::kBlockN / 32][4];
  using GemmS = sm90::WgmmaM64E4m3<Tr::kBlockN>;
  using GemmO = sm90::WgmmaM64E4m3<D>;
  static constexpr int kOValues = D / 2;

  Fp8FwdShared<D, N>& s;
  const CUtensorMap *tm_q, *tm_k, *tm_vt;
  Fp8Descales descales;
  float v_scale;  // the current tile's v descale

  __device__ __forceinline__ ForwardBarriers<Tr::kStages>& barriers() { return s.bar; }

  __device__ __forceinline__ void prefetch_descriptors() const {
    sm90::tma_prefetch_descriptor(tm_q);
    sm90::tma_prefetch_descriptor(tm_k);
    sm90::tma_prefetch_descriptor(tm_vt);
  }
  __device__ __forceinline__ void load_q(int m0, int h, int b) {
    sm90::tma_load_4d(s.q, tm_q, s.bar.q_full, 0, m0, h, b);
  }
  __device__ __forceinline__ void load_k(int st, int n0, int hk, int b) {
    sm90::tma_load_4d(s.k[st], tm_k, s.bar.k_full[st], 0, n0, hk, b);
  }
  // The panels complete on the one barrier, armed for the whole block's kVBytes.
  __device__ __forceinline__ void load_v(int st, int n0, int hk, int b) {
#pragma unroll
    for (int panel = 0; panel < Tr::kVPanels; ++panel) {
      sm90::tma_load_4d(s.vt[st] + panel * D * Tr::kVPanelKeys, tm_vt, s.bar.v_full[st], n0 + panel * Tr::kVPanelKeys,
                        0, hk, b);
    }
  }

  __device__ __forceinline__ void gemm_s(float (&sacc)[Tr::kBlockN / 2], int st, int wg) {
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk) {
      GemmS::ss(sacc, sm90::k_major_descriptor_8bit<D>(s.q, 64 * wg, kk),
                sm90::k_major_descriptor_8bit<D>(s.k[st], 0, kk), kk > 0);
    }
  }
  // k-step kk takes logical keys [32kk, 32kk + 32): bytes 32kk of the one 128-byte panel, or, in 64-byte
  // panels, bytes 32·(kk % 2) of panel kk / 2.
  __device__ __forceinline__ void gemm_pv(float (&o)[kOValues], PFragments& pa, int st) {
    constexpr int kStepsPerPanel = Tr::kVPanelKeys / 32;
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 32; ++kk) {
      GemmO::rs(o, pa[kk],
                sm90::k_major_descriptor_8bit<Tr::kVPanelKeys>(s.vt[st] + kk / kStepsPerPanel * D * Tr::kVPanelKeys, 0,
                                                               kk % kStepsPerPanel),
                1);
    }
  }
  // P as e4m3 A fragments, logical columns 32·kk + [0, 32): registers 0/1 (rows g, g + 8) from S's
  // 8-column groups 4kk and 4kk + 1, registers 2/3 from groups 4kk + 2 and 4kk + 3 (the relabelling).
  __device__ __forceinline__ static void pack_p(PFragments& pa, const float (&sacc)[Tr::kBlockN / 2]) {
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 32; ++kk) {
#pragma unroll
      for (int half_k = 0; half_k < 2; ++half_k) {
        const int j = 4 * kk + 2 * half_k;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          pa[kk][2 * half_k + r] = pack_e4m3x4(sacc[4 * j + 2 * r], sacc[4 * j + 2 * r + 1],
                                               sacc[4 * (j + 1) + 2 * r], sacc[4 * (j + 1) + 2 * r + 1]);
        }
      }
    }
  }

  // The tile's factors, as make_params forms the per-tensor ones (scale·q_descale·k_descale in fp64, rounded once
  // to fp32, times log2(e) in fp32): descales equal in every head give the per-tensor bits.
  __device__ __forceinline__ void start_tile(Softmax& softmax, const FlashParams& p, int b, int h) {
    if (!descales.per_head) {
      softmax.scale = p.scale;
      softmax.scale_log2 = p.scale_log2;
      v_scale = static_cast<float>(descales.v.scalar);
      return;
    }
    const int hk = h / p.group;
    softmax.scale = static_cast<float>(descales.softmax_scale * descales.q.at(b, hk) * descales.k.at(b, hk));
    softmax.scale_log2 = softmax.scale * kLog2e;
    v_scale = static_cast<float>(descales.v.at(b, hk));
  }
  __device__ __forceinline__ float o_scale() const { return v_scale; }
  // bf16 O straight from the accumulators.
  __device__ __forceinline__ static void store_o(const float (&o)[kOValues], const float (&inv)[2],
                                                 const FlashParams& p, const ForwardTileRows& tile) {
    store_o_rows_direct<__nv_bfloat16>(o, inv, p, tile);
  }
  __device__ __forceinline__ static void consumer_exit(int) {}
};

template <int D, int N>
__global__ void __launch_bounds__(Fp8FwdTraits<D, N>::kThreads, 1)
    flash_fwd_fp8_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                              const __grid_constant__ CUtensorMap tm_vt, const FlashParams p,
                              const Fp8Descales descales) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  Fp8FwdKernel<D, N> kernel{
      {}, sm90::aligned_shared<Fp8FwdShared<D, N>>(smem_raw), &tm_q, &tm_k, &tm_vt, descales, 0.f};
  run_forward_pipeline(kernel, p);
#endif
}

template <int D, int N>
void launch_forward_fp8_sm90(const FlashParams& f, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& vt,
                             const Fp8Descales& descales, int64_t items, int sm_count, cudaStream_t stream) {
  using Tr = Fp8FwdTraits<D, N>;
  auto kernel = flash_fwd_fp8_sm90_kernel<D, N>;
  constexpr int kSmem = static_cast<int>(forward_smem_bytes<Fp8FwdShared<D, N>>());
  FLASHLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                     "flash_fwd_fp8_sm90_kernel: shared-memory opt-in");
  kernel<<<static_cast<unsigned>(std::min<int64_t>(items, sm_count)), Tr::kThreads, kSmem, stream>>>(q, k, vt, f,
                                                                                                     descales);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_fwd_fp8_sm90_kernel launch");
}

template <int D, int N>
void launch_transpose_v_fp8(const TensorView& v, uint8_t* vt, int64_t keys_padded, int sm_count, cudaStream_t stream) {
  const int64_t blocks = keys_padded / N * v.size(2) * v.size(0);
  fp8_transpose_v_kernel<D, N><<<static_cast<unsigned>(std::min<int64_t>(blocks, int64_t{8} * sm_count)),
                              kTransposeThreads, 0, stream>>>(static_cast<const uint8_t*>(v.data), row_strides(v), vt,
                                                              static_cast<int>(v.size(1)), keys_padded,
                                                              static_cast<int>(v.size(2)), blocks);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "fp8_transpose_v_kernel launch");
}

// Keys per key block. FLASHLM_FP8_KEY_BLOCK, read at each forward (as FLASHLM_SM90_FWD_D64_TILE, so that a test
// can run both and one build be timed both ways), forces "128" or "192"; "auto" or unset chooses: 192 at head dim
// 128 where neither sequence is shorter than 8192, 128 elsewhere: the longer block spreads each row's fixed
// per-block work over more keys, and loses where the last, partly masked block and the causal diagonal are a
// larger share (the two timed against each other: docs/perf.md, "Key blocks of 192"). Anything else is an error
// naming the variable.
int fp8_forward_key_block(const AttentionProblem& p) {
  const std::string_view value = env_choice(kFp8KeyBlock);
  if (value == "128") return 128;
  if (value == "192") return 192;
  return p.head_dim == 128 && std::min(p.seq_q, p.seq_k) >= 8192 ? 192 : 128;
}

}  // namespace
}  // namespace flash_cuda

void flash_attention_forward_fp8_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& o, const TensorView& lse, void* stream) {
  constexpr std::string_view fn = "attention_forward";
  const int sm_count = flash_cuda::sm90_multiprocessors();
  FLASHLM_CHECK(sm_count > 0,
                "{}: q: dtype fp8_e4m3 runs only on an sm_90 GPU (H100/H200) with the sm_90a kernels loaded; "
                "this device is not one",
                fn);
  FLASHLM_CHECK(p.head_dim == 64 || p.head_dim == 128, "{}: q: head_dim {} has no fp8_e4m3 kernel", fn,
                p.head_dim);  // the plan checked it
  // The kernels index rows, heads and work items in int (a block's first key plus its 192 keys included).
  FLASHLM_CHECK(p.seq_q < INT32_MAX - 256 && p.seq_k < INT32_MAX - 256,
                "{}: q: fp8_e4m3 sequences must be shorter than 2^31 - 256, got seq_q {} and seq_k {}", fn, p.seq_q,
                p.seq_k);
  const int key_block = flash_cuda::fp8_forward_key_block(p);  // before the early return: a bad value always fails
  // body(head dim, key block) with both as compile-time constants: the kernels' instantiation for this problem.
  const auto with_shape = [&](auto&& body) {
    with_head_dim<kFp8ForwardHeadDims>(p.head_dim, [&](auto dim) {
      if (key_block == 192) body(dim, std::integral_constant<int, 192>{});
      else body(dim, std::integral_constant<int, 128>{});
    });
  };
  if (p.batch == 0 || p.heads_q == 0 || p.seq_q == 0) return;  // nothing to write
  const int64_t items = flash_cuda::TileSchedule::count(p.seq_q, p.heads_q, p.batch, 128);
  FLASHLM_CHECK(items <= INT32_MAX, "{}: q: fp8_e4m3 takes at most 2^31 - 1 tile pairs (batch · heads · seq_q / 256), "
                "got {}", fn, items);
  const auto f = flash_cuda::make_params(p, q, k, v, o, lse);  // its scale carries per-tensor q_descale·k_descale
  const auto s = static_cast<cudaStream_t>(stream);
  using flash_cuda::HeadDescalesView;
  const flash_cuda::Fp8Descales descales{HeadDescalesView::of(p.q_descale_heads, p.q_descale),
                                         HeadDescalesView::of(p.k_descale_heads, p.k_descale),
                                         HeadDescalesView::of(p.v_descale_heads, p.v_descale), p.scale,
                                         p.per_head_descales()};

  // The tensor maps. TMA describes every view attention.cpp lets through (16-byte aligned base and row
  // strides) except strides of 2^40 bytes or more, zero strides of a dimension longer than 1 and sizes past
  // 2^31: those are refused, naming the view (fp8 has no other kernel). With no keys nothing reads K or Vᵀ,
  // and Q's map stands in for theirs. K comes in boxes of a key block's rows, Vᵀ in boxes of a panel's keys
  // (Fp8FwdTraits: 128 at blocks of 128, 64 at 192) by D rows.
  const auto tq = sm90::rows_tensor_map(q, 128);
  FLASHLM_CHECK(tq.has_value(), "{}: q: the fp8_e4m3 kernel loads it with TMA, which cannot describe this view {}",
                fn, q.shape_string());
  CUtensorMap tk = *tq, tvt = *tq;
  Buffer vt_buffer;
  if (p.seq_k > 0) {
    const auto k_map = sm90::rows_tensor_map(k, key_block);
    FLASHLM_CHECK(k_map.has_value(),
                  "{}: k: the fp8_e4m3 kernel loads it with TMA, which cannot describe this view {}", fn,
                  k.shape_string());
    tk = *k_map;
    const int64_t keys_padded = (p.seq_k + key_block - 1) / key_block * key_block;  // whole blocks: the pre-pass's
    const int64_t bytes = checked_product({p.batch, p.heads_k, p.head_dim, keys_padded}, "attention_forward: fp8 Vᵀ");
    vt_buffer = Buffer::allocate_on_stream(static_cast<size_t>(bytes), "fp8 attention Vᵀ", stream);
    auto* vt = static_cast<uint8_t*>(vt_buffer.data());
    const TensorView vt_view =
        TensorView::contiguous(vt, DType::f8e4m3, {p.batch, p.heads_k, p.head_dim, keys_padded}, Device::cuda)
            .permute({0, 2, 1, 3});  // [batch, D, heads_k, keys]: rows are channels
    const auto vt_map = sm90::rows_tensor_map(vt_view, static_cast<int>(p.head_dim), key_block == 192);
    FLASHLM_CHECK(vt_map.has_value(), "{}: v: the fp8_e4m3 kernel's Vᵀ workspace {} has no TMA description", fn,
                  vt_view.shape_string());
    tvt = *vt_map;
    with_shape([&](auto dim, auto keys) {
      flash_cuda::launch_transpose_v_fp8<dim.value, keys.value>(v, vt, keys_padded, sm_count, s);
    });
  }
  with_shape([&](auto dim, auto keys) {
    flash_cuda::launch_forward_fp8_sm90<dim.value, keys.value>(f, *tq, tk, tvt, descales, items, sm_count, s);
  });
}

}  // namespace flashlm
