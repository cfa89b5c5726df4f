#include "attention/capabilities.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "core/check.h"
#include "core/env.h"

namespace flashlm {

namespace {

constexpr std::array kSixteenBit{DType::f16, DType::bf16};
constexpr std::array kF32{DType::f32};
constexpr std::array kCudaDTypes{DType::f16, DType::bf16, DType::f32};
constexpr std::array kFp8{DType::f8e4m3};

// One row per family: family, dtypes, forward and backward head dims, pads_head_dim, pads_head_dim_v,
// any_head_dim, forward and backward head dim pairs, sliding_window, softcap, alibi, learnable_sink,
// per_head_descales. The window
// and soft-capping run in the 16-bit flash kernels (mma.sync and Hopper, their masked instantiations); ALiBi and
// sinks in mma.sync's masked kernels (cuda/flash_fwd.cu, flash_bwd.cu) and in the Hopper kernels' ALiBi / sink
// instantiations: the Hopper row below lacks them, and hopper_alibi_sink_route() (on unless
// FLASHLM_HOPPER_ALIBI_SINK=0) swaps in kHopperWithAlibiSink, which has them. A head_dim_v of its own runs on the
// flash families' padded copies (mma.sync and fp32, both passes, every variant of the row) and, unpadded, in
// the Hopper forward and backward at their pairs (the CPU paths have them all). Per-head descales run in the fp8
// family (its forward reads them per tile, its backward dequantises per head: capabilities.h); the 16-bit families
// take no descales at all.
const std::array<CudaKernelCapability, 5> kTable{{
    {CudaKernelFamily::mma_sync, kSixteenBit, kMmaSyncForwardHeadDims, kMmaSyncBackwardHeadDims, true, true, false,
     {}, {}, true, true, true, true, false},
    {CudaKernelFamily::f32, kF32, kF32HeadDims, kF32HeadDims, true, true, false, {}, {}, false, false, false, false,
     false},
    {CudaKernelFamily::naive, kCudaDTypes, {}, {}, false, false, true, {}, {}, false, false, false, false, false},
    {CudaKernelFamily::hopper, kSixteenBit, kHopperForwardHeadDims, kHopperBackwardHeadDims, false, false, false,
     kHopperForwardHeadDimPairs, kHopperBackwardHeadDimPairs, true, true, false, false, false},
    {CudaKernelFamily::fp8, kFp8, kFp8ForwardHeadDims, kFp8BackwardHeadDims, false, false, false, {}, {}, false, false,
     false, false, true},
}};
// The Hopper row with ALiBi and sinks, where hopper_alibi_sink_route() holds.
const CudaKernelCapability kHopperWithAlibiSink{CudaKernelFamily::hopper,
                                                kSixteenBit,
                                                kHopperForwardHeadDims,
                                                kHopperBackwardHeadDims,
                                                false,
                                                false,
                                                false,
                                                kHopperForwardHeadDimPairs,
                                                kHopperBackwardHeadDimPairs,
                                                true,
                                                true,
                                                true,
                                                true,
                                                false};

// hopper_alibi_sink_route's state: -1 not read yet, else 0 or 1.
std::atomic<int> hopper_alibi_sink_state{-1};

bool has_dtype(const CudaKernelCapability& c, DType dtype) {
  for (DType d : c.dtypes) {
    if (d == dtype) return true;
  }
  return false;
}

std::string head_dim_list(std::span<const int> dims) {
  std::string s;
  for (int d : dims) {
    if (!s.empty()) s += ", ";
    s += std::to_string(d);
  }
  return s;
}

}  // namespace

std::string_view cuda_kernel_family_name(CudaKernelFamily family) {
  switch (family) {
    case CudaKernelFamily::mma_sync: return "mma.sync";
    case CudaKernelFamily::f32: return "fp32";
    case CudaKernelFamily::naive: return "naive";
    case CudaKernelFamily::hopper: return "hopper";
    case CudaKernelFamily::fp8: return "fp8";
  }
  return "unknown";
}

bool hopper_alibi_sink_route() {
  int state = hopper_alibi_sink_state.load(std::memory_order_relaxed);
  if (state < 0) {
    int unread = -1;
    hopper_alibi_sink_state.compare_exchange_strong(unread, env_choice(kHopperAlibiSink) == "0" ? 0 : 1);
    state = hopper_alibi_sink_state.load(std::memory_order_relaxed);
  }
  return state == 1;
}

void set_hopper_alibi_sink_route(bool on) { hopper_alibi_sink_state.store(on ? 1 : 0); }

const CudaKernelCapability& cuda_kernel_capability(CudaKernelFamily family) {
  if (family == CudaKernelFamily::hopper && hopper_alibi_sink_route()) return kHopperWithAlibiSink;
  for (const auto& c : kTable) {
    if (c.family == family) return c;
  }
  fail("cuda_kernel_capability: no row for kernel family {}", static_cast<int>(family));
}

bool has_head_dim_pair(const CudaKernelCapability& caps, AttentionPass pass, int64_t head_dim, int64_t head_dim_v) {
  const auto pairs = pass == AttentionPass::forward ? caps.forward_head_dim_pairs : caps.backward_head_dim_pairs;
  return std::ranges::any_of(pairs,
                             [&](const HeadDimPair& pair) { return pair.qk == head_dim && pair.v == head_dim_v; });
}

CudaAttentionPlan plan_cuda_attention(std::string_view fn, const AttentionProblem& p, AttentionImpl impl,
                                      AttentionPass pass) {
  FLASHLM_CHECK(p.dtype == DType::f16 || p.dtype == DType::bf16 || p.dtype == DType::f32 || p.dtype == DType::f8e4m3,
                "{}: q: dtype {} is not supported on cuda (fp16, bf16, fp32 or fp8_e4m3)", fn, dtype_name(p.dtype));
  const int64_t elem = static_cast<int64_t>(dtype_size(p.dtype));
  FLASHLM_CHECK(p.head_dim <= kCudaMaxHeadDim && p.head_dim * elem % kCudaRowAlignBytes == 0,
                "{}: q: head_dim {} is not supported on cuda (at most {}, and rows of a multiple of {} bytes: a "
                "multiple of {} for {})",
                fn, p.head_dim, kCudaMaxHeadDim, kCudaRowAlignBytes, kCudaRowAlignBytes / elem, dtype_name(p.dtype));
  // v's rows (and o's, dout's, dv's) move in the same 16-byte vectors, padded or not.
  FLASHLM_CHECK(p.value_dim() <= kCudaMaxHeadDim && p.value_dim() * elem % kCudaRowAlignBytes == 0,
                "{}: v: head_dim_v {} is not supported on cuda (at most {}, and rows of a multiple of {} bytes: a "
                "multiple of {} for {})",
                fn, p.value_dim(), kCudaMaxHeadDim, kCudaRowAlignBytes, kCudaRowAlignBytes / elem,
                dtype_name(p.dtype));

  const bool own_value_dim = p.value_dim() != p.head_dim;
  CudaKernelFamily family = p.dtype == DType::f32      ? CudaKernelFamily::f32
                            : p.dtype == DType::f8e4m3 ? CudaKernelFamily::fp8
                                                       : CudaKernelFamily::mma_sync;
  if (impl == AttentionImpl::naive) family = CudaKernelFamily::naive;
  const CudaKernelCapability& caps = cuda_kernel_capability(family);
  FLASHLM_CHECK(has_dtype(caps, p.dtype), "{}: q: the {} attention kernels do not take dtype {}", fn,
                cuda_kernel_family_name(family), dtype_name(p.dtype));
  // Before the variants: a problem with a head_dim_v the family cannot run is refused for it whatever else it asks.
  const bool forward = pass == AttentionPass::forward;
  FLASHLM_CHECK(!own_value_dim || caps.pads_head_dim_v,
                "{}: v: head_dim_v {} differs from head_dim {}, and the {} {} kernels need one head dim for q, k and "
                "v; it runs on the cpu, and on cuda in the flash kernels (fp16, bf16 and fp32, impl flash)",
                fn, p.value_dim(), p.head_dim, cuda_kernel_family_name(family), forward ? "forward" : "backward");
  FLASHLM_CHECK(!p.windowed() || caps.sliding_window,
                "{}: window_size_left/window_size_right: the {} attention kernels have no sliding window (got "
                "({}, {})); it runs on the cpu",
                fn, cuda_kernel_family_name(family), p.window_left, p.window_right);
  FLASHLM_CHECK(p.softcap == 0 || caps.softcap,
                "{}: softcap: the {} attention kernels have no soft-capping (got {}); it runs on the cpu", fn,
                cuda_kernel_family_name(family), p.softcap);
  FLASHLM_CHECK(!p.alibi || caps.alibi,
                "{}: alibi_slopes: the {} attention kernels have no ALiBi; it runs on the cpu", fn,
                cuda_kernel_family_name(family));
  FLASHLM_CHECK(!p.sink || caps.learnable_sink,
                "{}: learnable_sink: the {} attention kernels have no attention sinks; they run on the cpu", fn,
                cuda_kernel_family_name(family));
  FLASHLM_CHECK(!p.per_head_descales() || caps.per_head_descales,
                "{}: q_descale_heads/k_descale_heads/v_descale_heads: the {} attention kernels take per-tensor "
                "descales only (q_descale, k_descale, v_descale); per-head descales run on the cpu and in the fp8 "
                "kernels",
                fn, cuda_kernel_family_name(family));
  if (caps.any_head_dim) return {family, p.head_dim, false};

  // One kernel head dim for q, k, v and o: p's own, or the next larger where the family pads (both sides of
  // a pair, which pads_head_dim_v let through above, up to the larger one's).
  const int64_t widest = std::max(p.head_dim, p.value_dim());
  const bool pads = caps.pads_head_dim || own_value_dim;
  const std::span<const int> dims = forward ? caps.forward_head_dims : caps.backward_head_dims;
  for (int d : dims) {
    if (d == widest || (pads && d > widest)) {
      return {family, d, d != p.head_dim || d != p.value_dim()};
    }
  }
  FLASHLM_CHECK(!dims.empty(), "{}: q: head_dim {} has no cuda {} kernel for {} (the {} kernels have no {})", fn,
                p.head_dim, forward ? "forward" : "backward", dtype_name(p.dtype), cuda_kernel_family_name(family),
                forward ? "forward" : "backward");
  const std::string compiled = fmt::format(
      "the {} {} kernels are compiled for head dims {}{}", cuda_kernel_family_name(family),
      forward ? "forward" : "backward", head_dim_list(dims),
      caps.pads_head_dim ? ", and smaller head dims run the next larger kernel on zero-padded copies" : "");
  FLASHLM_CHECK(!own_value_dim,
                "{}: v: head_dim_v {} with head_dim {} has no cuda {} kernel for {} ({}; a pair runs the smallest "
                "at least as large as both)",
                fn, p.value_dim(), p.head_dim, forward ? "forward" : "backward", dtype_name(p.dtype), compiled);
  fail("{}: q: head_dim {} has no cuda {} kernel for {} ({})", fn, p.head_dim, forward ? "forward" : "backward",
       dtype_name(p.dtype), compiled);
}

}  // namespace flashlm
