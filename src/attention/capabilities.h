// Which CUDA attention kernels exist: for each kernel family, the dtypes, the head dims it is compiled
// for and the passes (forward, backward) it runs. The one table that the CUDA argument checks
// (attention.cpp) and the launchers (cuda/flash_fwd.cu, flash_bwd.cu, flash_f32.cu, hopper/) both read: the
// launchers instantiate their kernels from the head-dim lists below, so a head dim is supported exactly
// where a kernel for it is compiled.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#include "attention/problem.h"

namespace flashlm {

enum class AttentionPass { forward, backward };

enum class CudaKernelFamily {
  mma_sync,  // fp16/bf16 FlashAttention-2 on tensor cores (mma.sync, cuda/flash_fwd.cu, flash_bwd.cu)
  f32,       // fp32 FlashAttention-2 on CUDA cores (cuda/flash_f32.cu)
  naive,     // materialised S and P through cuBLAS (cuda/naive.cu)
  hopper,    // sm_90a wgmma/TMA forward and backward (cuda/hopper/): see below
  fp8,       // e4m3 inputs: the sm_90a wgmma forward, bf16 output (cuda/hopper/flash_fwd_fp8_sm90.cu); the
             // backward on the 16-bit flash kernels (below, kFp8BackwardHeadDims); per-tensor or per-head descales
};

std::string_view cuda_kernel_family_name(CudaKernelFamily family);

// Head dims with a compiled kernel, ascending. The mma.sync backward's shared memory at head dims 128
// and 256 fits sm_80 and sm_90 but not sm_86/sm_89: there it is an Error at launch (cuda/flash_bwd.cu).
inline constexpr std::array<int, 5> kMmaSyncForwardHeadDims{16, 32, 64, 128, 256};
inline constexpr std::array<int, 5> kMmaSyncBackwardHeadDims{16, 32, 64, 128, 256};
inline constexpr std::array<int, 5> kF32HeadDims{16, 32, 64, 128, 256};
// The Hopper kernels' head dims (cuda/hopper/ instantiates its kernels from these lists). Their predicates
// need the views as well as the problem (a TMA descriptor per view, an sm_90 device), so
// plan_cuda_attention plans mma.sync for fp16/bf16 and flash_kernel_family (backends.h) turns that into the
// Hopper family, for the forward and the backward alike, where flash_forward_sm90_covers and
// flash_backward_sm90_covers hold. The Hopper backward has no deterministic mode:
// AttentionOptions::deterministic takes the mma.sync backward's separate dQ pass on every GPU.
inline constexpr std::array<int, 3> kHopperForwardHeadDims{64, 128, 256};
// The backward's 64 and 128 run flash_bwd_sm90.cu's kernel, 256 flash_bwd_wide_sm90.cu's (dK, dV and dQ
// split by columns between the consumer warpgroups).
inline constexpr std::array<int, 3> kHopperBackwardHeadDims{64, 128, 256};

// A head dim for q and k (qk: the S = Q·Kᵀ reduction) and a different one for v and o (v: P·V's columns),
// as a kernel is compiled for the pair (DeepSeek's MLA attends with 192 and 128).
struct HeadDimPair {
  int qk, v;
};
// The pairs the Hopper forward and backward are compiled for (cuda/hopper/flash_fwd_sm90.cu and
// flash_bwd_wide_sm90.cu instantiate them from these lists): flash_kernel_family runs such a problem there as
// it is, unpadded. The backward's pair takes the wide-head dK/dV kernel: flash_bwd_sm90.cu's would hold dK
// and dV of a warpgroup's 64 keys, 160 fp32 a thread at (192, 128), beside Sᵀ and dPᵀ, past the 240 a consumer
// thread has; the wide kernel splits their columns between the two consumer warpgroups. Elsewhere (another
// GPU, views TMA cannot describe, a deterministic backward) a pair runs on the padding families' kernels
// (pads_head_dim_v below).
inline constexpr std::array<HeadDimPair, 1> kHopperForwardHeadDimPairs{{{192, 128}}};
inline constexpr std::array<HeadDimPair, 1> kHopperBackwardHeadDimPairs{{{192, 128}}};
// The FP8 forward's head dims (fp8_e4m3 inputs; the launcher, cuda/hopper/flash_fwd_fp8_sm90.cu, also
// requires an sm_90 device and q and k views TMA can describe, an error otherwise: fp8 has no fallback).
inline constexpr std::array<int, 2> kFp8ForwardHeadDims{64, 128};
// The FP8 backward runs the 16-bit flash backward (the Hopper kernels where they cover the problem, else
// mma.sync: the bf16 dispatch, flash_kernel_family) on exact bf16 copies of q, k and v with per-tensor descales
// folded into its scale factors, or, with per-head descales, on bf16 copies of the dequantised values after a bf16
// forward on them (attention.cpp, fp8_backward_cuda): the head dims of the kernels it runs on, mma.sync's being the
// fallback for every problem. Any GPU those kernels run on, sm_90 not required.
inline constexpr std::array<int, 5> kFp8BackwardHeadDims = kMmaSyncBackwardHeadDims;

// Every CUDA kernel moves rows in 16-byte vectors: head_dim · element size must be a multiple of this.
inline constexpr int64_t kCudaRowAlignBytes = 16;
// The largest head dim any CUDA path accepts (the naive path too, though cuBLAS itself has no limit).
inline constexpr int64_t kCudaMaxHeadDim = 256;

struct CudaKernelCapability {
  CudaKernelFamily family;
  std::span<const DType> dtypes;
  // Compiled head dims per pass, ascending. A family that pads (flash) runs any head dim up to the
  // largest on the next larger kernel with zero-padded copies; `any_head_dim` families (naive) take
  // every head dim up to kCudaMaxHeadDim.
  std::span<const int> forward_head_dims, backward_head_dims;
  bool pads_head_dim;
  // A head_dim_v of its own on the same padded path: q and k padded from head_dim, v, o, dout and dv from
  // head_dim_v, both to the smallest compiled head dim of the pass at least as large as either. Exact: zero
  // columns change neither S = Q·Kᵀ nor Delta = rowsum(dO∘O), give zero columns of O, dQ, dK and dV, which
  // are dropped, and the scale stays 1/sqrt(head_dim) (p.scale).
  bool pads_head_dim_v;
  bool any_head_dim;
  // The (head_dim, head_dim_v) pairs with head_dim_v != head_dim compiled per pass, exact, unpadded (the
  // Hopper forward's and backward's). plan_cuda_attention plans no family on them: it plans a pair on a family
  // that pads it (mma.sync for fp16/bf16), and flash_kernel_family runs it on the Hopper kernels unpadded where
  // their row lists the pair for the pass and they cover the views.
  std::span<const HeadDimPair> forward_head_dim_pairs, backward_head_dim_pairs;
  // The attention variants the family's kernels implement (AttentionOptions::window_size_*, softcap: the
  // 16-bit flash kernels' masked instantiations, cuda/flash_common.cuh; alibi_slopes, learnable_sink); a
  // problem that asks for one a family lacks is an Error naming the option, never a silent full mask.
  // The Hopper row must not claim a variant the mma.sync row lacks: plan_cuda_attention checks the
  // planned family (mma.sync), and flash_kernel_family moves the problem to the Hopper kernels only where
  // the Hopper row has every variant it asks for.
  bool sliding_window;
  bool softcap;
  bool alibi;           // AttentionOptions::alibi_slopes
  bool learnable_sink;  // AttentionOptions::learnable_sink and the backward's dlearnable_sink
  // AttentionOptions::q_descale_heads, k_descale_heads, v_descale_heads (fp8 inputs, [batch, heads_k]): the fp8
  // row's, whose forward kernel reads each tile's descales at its start and whose backward runs on bf16 copies of
  // the values dequantised head by head (rounded once to bf16) after a bf16 forward on them; the CPU runs them too.
  bool per_head_descales;
};

// The row of `family` in the table. The Hopper row claims ALiBi and sinks where hopper_alibi_sink_route()
// holds (by default).
const CudaKernelCapability& cuda_kernel_capability(CudaKernelFamily family);

// Whether `caps` lists (head_dim, head_dim_v) among the pairs it runs unpadded in `pass`.
bool has_head_dim_pair(const CudaKernelCapability& caps, AttentionPass pass, int64_t head_dim, int64_t head_dim_v);

// Whether the Hopper kernels take ALiBi and attention sinks (their ALiBi / sink instantiations,
// cuda/hopper/flash_fwd_sm90.cu and flash_bwd_sm90.cu): yes unless FLASHLM_HOPPER_ALIBI_SINK=0, which keeps
// those problems on mma.sync ("1" or unset: on; anything else is an error naming the variable). On an H100 the
// Hopper forward with ALiBi and a sink ran 1.3–2.3× mma.sync's and forward + backward 1.2× at d128, 0.95× at
// d64 (docs/perf.md, "Attention variants"). Read once, at the first call. set_hopper_alibi_sink_route
// overrides it for the rest of the process (the tests run the route both ways in one binary).
bool hopper_alibi_sink_route();
void set_hopper_alibi_sink_route(bool on);

// What runs a validated CUDA problem: the kernel family and the head dim of the kernel instantiation
// (p.head_dim, or the next larger compiled one when the family pads; for a head_dim_v of its own, the
// smallest compiled one at least as large as both, one head dim for q, k, v and o).
struct CudaAttentionPlan {
  CudaKernelFamily family;
  int64_t kernel_head_dim;
  // kernel_head_dim differs from p.head_dim or p.value_dim(): the padded path (attention.cpp) copies around
  // the kernel (but flash_kernel_family may take the Hopper kernels for the problem as it is)
  bool padded;
};

// The plan for `p` (dtype and head dim as validate_attention_* found them) with implementation `impl`,
// or flashlm::Error naming `fn`, the argument (q) and what the table supports.
CudaAttentionPlan plan_cuda_attention(std::string_view fn, const AttentionProblem& p, AttentionImpl impl,
                                      AttentionPass pass);

// Calls fn(std::integral_constant<int, pair.qk>{}, std::integral_constant<int, pair.v>{}) for the pair of
// `kPairs` equal to (head_dim, head_dim_v) and returns true, or returns false when kPairs has no such pair:
// with_head_dim for kernels compiled for a head_dim_v of its own.
template <const auto& kPairs, class Fn>
bool with_head_dim_pair(int64_t head_dim, int64_t head_dim_v, Fn&& fn) {
  return [&]<size_t... I>(std::index_sequence<I...>) {
    return ((head_dim == kPairs[I].qk && head_dim_v == kPairs[I].v
                 ? (fn(std::integral_constant<int, kPairs[I].qk>{}, std::integral_constant<int, kPairs[I].v>{}), true)
                 : false) ||
            ...);
  }(std::make_index_sequence<kPairs.size()>{});
}

// Calls fn(std::integral_constant<int, D>{}) for the D of `kDims` equal to head_dim and returns true, or
// returns false when kDims has no such D: the launchers' switch from a runtime head dim to a template
// argument, instantiating exactly the kernels the table lists.
template <const auto& kDims, class Fn>
bool with_head_dim(int64_t head_dim, Fn&& fn) {
  return [&]<size_t... I>(std::index_sequence<I...>) {
    return ((head_dim == kDims[I] ? (fn(std::integral_constant<int, kDims[I]>{}), true) : false) || ...);
  }(std::make_index_sequence<kDims.size()>{});
}

}  // namespace flashlm
