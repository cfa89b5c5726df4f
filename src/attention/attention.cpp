// Public attention entry points: validate once, then hand the problem to the backend for the device
// and implementation asked for.
#include "flashlm/attention.h"

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#include "attention/backends.h"
#include "attention/capabilities.h"
#include "core/check.h"
#include "core/cuda_runtime.h"
#include "core/env.h"
#include "flashlm/device.h"
#include "flashlm/memory.h"

namespace flashlm {

CausalAlign parse_causal_align(std::string_view name) {
  if (name == "top-left" || name == "top_left") return CausalAlign::top_left;
  if (name == "bottom-right" || name == "bottom_right") return CausalAlign::bottom_right;
  fail_argument("unknown causal alignment '{}': expected top-left or bottom-right", name);
}

std::string_view attention_impl_name(AttentionImpl impl) { return impl == AttentionImpl::naive ? "naive" : "flash"; }

AttentionImpl parse_attention_impl(std::string_view name) {
  if (name == "naive") return AttentionImpl::naive;
  if (name == "flash") return AttentionImpl::flash;
  fail_argument("unknown attention implementation '{}': expected naive or flash", name);
}

double attention_forward_flops(int64_t batch, int64_t heads, int64_t seq_q, int64_t seq_k, int64_t head_dim,
                               bool causal) {
  const double f = 4.0 * double(batch) * double(heads) * double(seq_q) * double(seq_k) * double(head_dim);
  return causal ? f / 2 : f;
}

namespace {

using NamedView = std::pair<const char*, const TensorView*>;

// What the CUDA kernels need beyond the common checks: a kernel for the dtype, head dim and pass (the
// capability table's plan), memory of the current device, and 16-byte alignment of every row so that
// tiles move in 16-byte vectors.
CudaAttentionPlan check_cuda_arguments(std::string_view fn, const AttentionProblem& p, AttentionImpl impl,
                                       AttentionPass pass, std::initializer_list<NamedView> views,
                                       const TensorView& lse) {
  FLASHLM_CHECK(cuda_built(), "{}: q: tensors on cuda but flashlm was built without CUDA", fn);
  const CudaAttentionPlan plan = plan_cuda_attention(fn, p, impl, pass);
  const int device = cuda_current_device();
  for (const auto& [name, t] : views) {
    if (t->numel() == 0) continue;
    const int64_t elem = static_cast<int64_t>(dtype_size(t->dtype));  // o is bf16 for fp8 inputs
    FLASHLM_CHECK(cuda_pointer_device(t->data) == device,
                  "{}: {}: data is not device memory of the current device cuda:{}", fn, name, device);
    FLASHLM_CHECK(reinterpret_cast<uintptr_t>(t->data) % kCudaRowAlignBytes == 0,
                  "{}: {}: data pointer must be 16-byte aligned for the cuda kernels", fn, name);
    for (int d = 0; d < 3; ++d) {
      FLASHLM_CHECK(t->stride(d) * elem % kCudaRowAlignBytes == 0 || t->size(d) == 1,
                    "{}: {}: stride {} of dimension {} is not a multiple of 16 bytes ({} elements of {})", fn, name,
                    t->stride(d), d, kCudaRowAlignBytes / elem, dtype_name(t->dtype));
    }
  }
  if (lse.numel() > 0) {
    FLASHLM_CHECK(cuda_pointer_device(lse.data) == device,
                  "{}: lse: data is not device memory of the current device cuda:{}", fn, device);
    FLASHLM_CHECK(lse.dtype == DType::f32, "{}: lse: expected fp32 on cuda", fn);
  }
  return plan;
}

#ifdef FLASHLM_WITH_CUDA
}  // namespace

FlashKernelChoice flash_kernel_choice() {
  return env_choice(kAttentionKernel) == "mma" ? FlashKernelChoice::mma : FlashKernelChoice::automatic;
}

namespace {

// `t` with `head_dim` columns for a kernel of that head dim: a contiguous [batch, seq, heads, head_dim] tensor
// from the stream-ordered pool, or `t` itself where its rows already have head_dim columns (a head dim pair
// may need only one side padded: (64, 128) pads q and k, not v). For an input (`copy`), t's values in its
// first columns and zeros after them; for an output, the kernel's to write, and copy_back puts its first
// columns into t.
struct PaddedCopy {
  Buffer buffer;
  TensorView view;
  PaddedCopy(const TensorView& t, int64_t head_dim, bool copy, const char* tag, void* stream) {
    if (t.size(3) == head_dim) {
      view = t;
      return;
    }
    const std::array<int64_t, 4> sizes{t.size(0), t.size(1), t.size(2), head_dim};
    const size_t bytes = static_cast<size_t>(sizes[0] * sizes[1] * sizes[2] * head_dim) * dtype_size(t.dtype);
    buffer = Buffer::allocate_on_stream(bytes, tag, stream);
    view = TensorView::contiguous(buffer.data(), t.dtype, sizes, Device::cuda);
    // Outputs (copy = false) are left as allocated: the kernels write every element, padded columns
    // included. An empty tensor (seq_k = 0 is a valid problem) gets no allocation: no memset of a null.
    if (copy && bytes > 0) cuda_memset_async(buffer.data(), 0, bytes, stream);
    if (copy && t.numel() > 0) copy_head_rows_cuda(t, view, t.size(3), stream);
  }
  void copy_back(const TensorView& t, void* stream) const {
    const bool is_t = view.data == t.data;  // the kernel wrote t itself
    if (!is_t && t.numel() > 0) copy_head_rows_cuda(view, t, t.size(3), stream);
  }
};

// Whether a family's kernels implement every attention variant the problem asks for.
bool implements_variants(const CudaKernelCapability& caps, const AttentionProblem& p) {
  return (!p.windowed() || caps.sliding_window) && (p.softcap == 0 || caps.softcap) && (!p.alibi || caps.alibi) &&
         (!p.sink || caps.learnable_sink) && (!p.per_head_descales() || caps.per_head_descales);
}

// Whether the Hopper kernels run the pass on these views (never in a build without them).
bool hopper_covers(AttentionPass pass, const AttentionProblem& p, const TensorView& q, const TensorView& k,
                   const TensorView& v, const TensorView& o, const TensorView& dout, bool deterministic) {
#ifdef FLASHLM_WITH_SM90
  return pass == AttentionPass::forward ? flash_forward_sm90_covers(p, q, k, v, &o)
                                        : !deterministic && flash_backward_sm90_covers(p, q, k, v, dout);
#else
  (void)pass, (void)p, (void)q, (void)k, (void)v, (void)o, (void)dout, (void)deterministic;
  return false;
#endif
}

}  // namespace

// The Hopper family's predicates need the views (a TMA descriptor each, an sm_90 device), not only the
// problem, so the choice between it and mma.sync is made here, on the views the kernels get, rather than in
// plan_cuda_attention.
CudaKernelFamily flash_kernel_family(const CudaAttentionPlan& plan, AttentionPass pass, const AttentionProblem& p,
                                     const TensorView& q, const TensorView& k, const TensorView& v,
                                     const TensorView& o, const TensorView& dout, bool deterministic) {
  // Read on every build, so that a bad value is an error wherever it is set.
  const FlashKernelChoice choice = flash_kernel_choice();
  if (plan.family != CudaKernelFamily::mma_sync) return plan.family;
  // plan_cuda_attention checked the variants against the mma.sync row; the Hopper row may lack some of them
  // (ALiBi and sinks, unless hopper_alibi_sink_route()), and those problems stay on mma.sync. So does a head dim
  // pair the Hopper row does not list for the pass: mma.sync runs it padded.
  const CudaKernelCapability& hopper = cuda_kernel_capability(CudaKernelFamily::hopper);
  if (!implements_variants(hopper, p)) return plan.family;
  if (p.value_dim() != p.head_dim && !has_head_dim_pair(hopper, pass, p.head_dim, p.value_dim())) return plan.family;
  if (choice == FlashKernelChoice::mma) return plan.family;
  if (hopper_covers(pass, p, q, k, v, o, dout, deterministic)) return CudaKernelFamily::hopper;
  return plan.family;
}

namespace {

#ifndef FLASHLM_WITH_SM90
// flash_kernel_family chooses the Hopper kernels only where they are built.
[[noreturn]] void no_hopper_kernels(std::string_view fn) {
  fail("{}: the Hopper kernels were chosen, but this build has none", fn);
}
#endif

// The flash forward on `family`'s kernels, which take these views as they are.
void launch_flash_forward(CudaKernelFamily family, const AttentionProblem& p, const TensorView& q,
                          const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
                          void* stream) {
  switch (family) {
    case CudaKernelFamily::f32: return flash_attention_forward_cuda_f32(p, q, k, v, o, lse, stream);
    case CudaKernelFamily::hopper:
#ifdef FLASHLM_WITH_SM90
      return flash_attention_forward_sm90(p, q, k, v, o, lse, stream);
#else
      no_hopper_kernels("attention_forward");
#endif
    case CudaKernelFamily::mma_sync: return flash_attention_forward_cuda(p, q, k, v, o, lse, stream);
    case CudaKernelFamily::naive:
    case CudaKernelFamily::fp8: break;  // run_forward launches them
  }
  fail("attention_forward: the {} kernels have no flash forward", cuda_kernel_family_name(family));
}

void launch_flash_backward(CudaKernelFamily family, const AttentionProblem& p, const TensorView& q,
                           const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
                           const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                           bool deterministic, void* stream) {
  switch (family) {
    case CudaKernelFamily::f32: return flash_attention_backward_cuda_f32(p, q, k, v, o, lse, dout, dq, dk, dv, stream);
    case CudaKernelFamily::hopper:
#ifdef FLASHLM_WITH_SM90
      return flash_attention_backward_sm90(p, q, k, v, o, lse, dout, dq, dk, dv, stream);
#else
      no_hopper_kernels("attention_backward");
#endif
    case CudaKernelFamily::mma_sync:
      return flash_attention_backward_cuda(p, q, k, v, o, lse, dout, dq, dk, dv, deterministic, stream);
    case CudaKernelFamily::naive:
    case CudaKernelFamily::fp8: break;  // run_backward launches naive, and fp8 on the 16-bit kernels
  }
  fail("attention_backward: the {} kernels have no flash backward", cuda_kernel_family_name(family));
}

// A head dim without its own flash kernel (80 for the 2.7B model: 2560 / 32 heads), or a head_dim_v of its
// own (DeepSeek's MLA: 192 for q and k, 128 for v), runs the plan's kernel_head_dim on zero-padded copies: q, k
// (and dq, dk) from head_dim, v, o, dout (and dv) from head_dim_v. The padded columns add 0 to every Q·K
// product and to Delta = rowsum(dO∘O), and give 0 in O, dQ, dK and dV, which are dropped when copying back.
// The scale stays the one of the real head dim (p.scale). The padded problem is an ordinary one of a compiled
// head dim, so flash_kernel_family may give it to the Hopper kernels. Correct, not optimised: the copies and
// the padded work cost (padded / real) of the kernel time and one copy of the tensors.
AttentionProblem padded_problem(const AttentionProblem& p, const CudaAttentionPlan& plan) {
  AttentionProblem padded = p;
  padded.head_dim = padded.head_dim_v = plan.kernel_head_dim;
  return padded;
}

void padded_flash_forward_cuda(const CudaAttentionPlan& plan, const AttentionProblem& p, const TensorView& q,
                               const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
                               void* stream) {
  const AttentionProblem padded = padded_problem(p, plan);
  const int64_t d = plan.kernel_head_dim;
  const PaddedCopy qp(q, d, true, "attention: q padded to the kernel head dim", stream);
  const PaddedCopy kp(k, d, true, "attention: k padded to the kernel head dim", stream);
  const PaddedCopy vp(v, d, true, "attention: v padded to the kernel head dim", stream);
  const PaddedCopy op(o, d, false, "attention: o padded to the kernel head dim", stream);
  const CudaAttentionPlan exact{plan.family, d, false};
  const CudaKernelFamily family =
      flash_kernel_family(exact, AttentionPass::forward, padded, qp.view, kp.view, vp.view, op.view, TensorView{},
                          false);
  launch_flash_forward(family, padded, qp.view, kp.view, vp.view, op.view, lse, stream);
  op.copy_back(o, stream);
}

void padded_flash_backward_cuda(const CudaAttentionPlan& plan, const AttentionProblem& p, const TensorView& q,
                                const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
                                const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                const TensorView& dv, bool deterministic, void* stream) {
  const AttentionProblem padded = padded_problem(p, plan);
  const int64_t d = plan.kernel_head_dim;
  const PaddedCopy qp(q, d, true, "attention: q padded to the kernel head dim", stream);
  const PaddedCopy kp(k, d, true, "attention: k padded to the kernel head dim", stream);
  const PaddedCopy vp(v, d, true, "attention: v padded to the kernel head dim", stream);
  const PaddedCopy op(o, d, true, "attention: o padded to the kernel head dim", stream);
  const PaddedCopy dop(dout, d, true, "attention: dout padded to the kernel head dim", stream);
  const PaddedCopy dqp(dq, d, false, "attention: dq padded to the kernel head dim", stream);
  const PaddedCopy dkp(dk, d, false, "attention: dk padded to the kernel head dim", stream);
  const PaddedCopy dvp(dv, d, false, "attention: dv padded to the kernel head dim", stream);
  const CudaAttentionPlan exact{plan.family, d, false};
  const CudaKernelFamily family = flash_kernel_family(exact, AttentionPass::backward, padded, qp.view, kp.view,
                                                      vp.view, op.view, dop.view, deterministic);
  launch_flash_backward(family, padded, qp.view, kp.view, vp.view, op.view, lse, dop.view, dqp.view, dkp.view,
                        dvp.view, deterministic, stream);
  dqp.copy_back(dq, stream);
  dkp.copy_back(dk, stream);
  dvp.copy_back(dv, stream);
}

// The flash forward of a plan of the flash families: the views as they are, or padded copies where the plan
// pads and the Hopper kernels do not run the problem as it is (a head dim pair of theirs, which they take
// unpadded).
void flash_forward_cuda(const CudaAttentionPlan& plan, const AttentionProblem& p, const TensorView& q,
                        const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
                        void* stream) {
  const CudaKernelFamily family =
      flash_kernel_family(plan, AttentionPass::forward, p, q, k, v, o, TensorView{}, false);
  if (plan.padded && family != CudaKernelFamily::hopper) {
    return padded_flash_forward_cuda(plan, p, q, k, v, o, lse, stream);
  }
  launch_flash_forward(family, p, q, k, v, o, lse, stream);
}

void flash_backward_cuda(const CudaAttentionPlan& plan, const AttentionProblem& p, const TensorView& q,
                         const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
                         const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                         bool deterministic, void* stream) {
  const CudaKernelFamily family =
      flash_kernel_family(plan, AttentionPass::backward, p, q, k, v, o, dout, deterministic);
  if (plan.padded && family != CudaKernelFamily::hopper) {
    return padded_flash_backward_cuda(plan, p, q, k, v, o, lse, dout, dq, dk, dv, deterministic, stream);
  }
  launch_flash_backward(family, p, q, k, v, o, lse, dout, dq, dk, dv, deterministic, stream);
}

// A contiguous [batch, seq, heads, head_dim] tensor of `dtype` from the stream-ordered pool, holding t's values
// converted exactly (convert_head_rows_cuda) where `copy`, else for a kernel to write; none for an empty t.
struct ConvertedCopy {
  Buffer buffer;
  TensorView view;
  ConvertedCopy(const TensorView& t, DType dtype, bool copy, const char* tag, void* stream) {
    const std::array<int64_t, 4> sizes{t.size(0), t.size(1), t.size(2), t.size(3)};
    const int64_t bytes = checked_product({sizes[0], sizes[1], sizes[2], sizes[3], int64_t(dtype_size(dtype))}, tag);
    if (bytes > 0) buffer = Buffer::allocate_on_stream(static_cast<size_t>(bytes), tag, stream);
    view = TensorView::contiguous(buffer.data(), dtype, sizes, Device::cuda);
    if (copy) convert_head_rows_cuda(t, view, stream);
  }
};

// The 16-bit flash backward of p16 (a bf16 problem; flash_backward_cuda: the Hopper kernels where they cover it,
// else mma.sync) on bf16 q, k, v into the caller's gradients of an fp8 call: the kernels write bf16, into those
// gradients where they are bf16, else into bf16 scratch widened into fp32 afterwards (fp32 gradients holding the
// bf16 values: the kernels round dS, and accumulate in fp32, as the bf16 backward does).
void fp8_backward_on_bf16(const CudaAttentionPlan& plan, const AttentionProblem& p16, const TensorView& q,
                          const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
                          const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                          bool deterministic, void* stream) {
  // The fp8 row's backward head dims are mma.sync's, unpadded: every fp8 backward plan is one of theirs.
  static_assert(kFp8BackwardHeadDims == kMmaSyncBackwardHeadDims);
  const CudaAttentionPlan on_bf16{CudaKernelFamily::mma_sync, plan.kernel_head_dim, false};
  if (dq.dtype == DType::bf16) {
    return flash_backward_cuda(on_bf16, p16, q, k, v, o, lse, dout, dq, dk, dv, deterministic, stream);
  }
  const ConvertedCopy dqb(dq, DType::bf16, false, "attention fp8 backward: dq in bf16", stream);
  const ConvertedCopy dkb(dk, DType::bf16, false, "attention fp8 backward: dk in bf16", stream);
  const ConvertedCopy dvb(dv, DType::bf16, false, "attention fp8 backward: dv in bf16", stream);
  flash_backward_cuda(on_bf16, p16, q, k, v, o, lse, dout, dqb.view, dkb.view, dvb.view, deterministic, stream);
  convert_head_rows_cuda(dqb.view, dq, stream);
  convert_head_rows_cuda(dkb.view, dk, stream);
  convert_head_rows_cuda(dvb.view, dv, stream);
}

// FP8 on CUDA, backward with per-tensor descales: the 16-bit flash backward (fp8_backward_on_bf16) on bf16 copies of
// the stored e4m3 q, k and v. The copies are exact and unscaled; the descales stay in the problem, and make_params
// (cuda/flash_common.cuh, FlashParams::dq_scale) folds them into the kernels' factors: q_descale·k_descale into the
// softmax scale, so that the recomputed P is the FP8 forward's (whose lse the caller passes), and every gradient's
// factor into the one fp32 multiply the kernels already apply to dQ and dK, so that no gradient is rounded more
// than the bf16 backward rounds its own. v stays stored too, its descale going into Delta and those factors: an
// exact route where a dequantised bf16 copy of v (v·v_descale rounded to bf16) would put a rounding of 2^-9 into
// every dP. o and dout are bf16 already. Scratch: the copies of q, k, v (2 bytes an element) and, for fp32
// gradients, three more.
//
// Per-head descales have no such factors: the kernels take one softmax scale and one factor per gradient for the
// whole problem, and making them per (batch, key head) would mean new instantiations of every backward kernel
// (preprocess, both dK/dV kernels, the dQ pass and conversion) for the fp8 route alone. Instead the copies hold the
// dequantised values, stored · the row's head's descale rounded once to bf16 (2^-9 relative,
// dequantise_head_rows_cuda), and a bf16 forward on them recomputes o and lse, so that the backward's recomputed P
// is the softmax of its own inputs (the FP8 forward's lse, of the exact values, would be off from them by up to
// |S|·2^-8 in every exponent); then the backward runs as for bf16 inputs, the caller's o and lse unread. Its
// gradients are those of bf16 inputs within 2^-9 of the dequantised values. The extra cost: that forward (0.4 of
// the backward's FLOPs) and o (bf16) and lse (fp32) as scratch.
void fp8_backward_cuda(const CudaAttentionPlan& plan, const AttentionProblem& p, const TensorView& q,
                       const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
                       const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                       bool deterministic, void* stream) {
  AttentionProblem p16 = p;
  p16.dtype = DType::bf16;
  if (!p.per_head_descales()) {
    const ConvertedCopy qb(q, DType::bf16, true, "attention fp8 backward: q as bf16", stream);
    const ConvertedCopy kb(k, DType::bf16, true, "attention fp8 backward: k as bf16", stream);
    const ConvertedCopy vb(v, DType::bf16, true, "attention fp8 backward: v as bf16", stream);
    return fp8_backward_on_bf16(plan, p16, qb.view, kb.view, vb.view, o, lse, dout, dq, dk, dv, deterministic, stream);
  }
  p16.q_descale = p16.k_descale = p16.v_descale = 1.0;
  p16.q_descale_heads = p16.k_descale_heads = p16.v_descale_heads = {};
  const ConvertedCopy qb(q, DType::bf16, false, "attention fp8 backward: dequantised q", stream);
  const ConvertedCopy kb(k, DType::bf16, false, "attention fp8 backward: dequantised k", stream);
  const ConvertedCopy vb(v, DType::bf16, false, "attention fp8 backward: dequantised v", stream);
  dequantise_head_rows_cuda(q, qb.view, p.q_descale, p.q_descale_heads, p.group(), stream);
  dequantise_head_rows_cuda(k, kb.view, p.k_descale, p.k_descale_heads, 1, stream);
  dequantise_head_rows_cuda(v, vb.view, p.v_descale, p.v_descale_heads, 1, stream);
  const ConvertedCopy ob(o, DType::bf16, false, "attention fp8 backward: o of the dequantised copies", stream);
  const std::array<int64_t, 3> lse_sizes{p.batch, p.heads_q, p.seq_q};
  const Buffer lse_buffer = Buffer::allocate_on_stream(
      static_cast<size_t>(checked_product({p.batch, p.heads_q, p.seq_q, int64_t{4}}, "attention fp8 backward: lse")),
      "attention fp8 backward: lse of the dequantised copies", stream);
  const TensorView lseb = TensorView::contiguous(lse_buffer.data(), DType::f32, lse_sizes, Device::cuda);
  // The forward's plan: mma.sync's forward head dims are its backward's (the Hopper kernels where they cover it).
  static_assert(kMmaSyncForwardHeadDims == kMmaSyncBackwardHeadDims);
  const CudaAttentionPlan forward{CudaKernelFamily::mma_sync, plan.kernel_head_dim, false};
  flash_forward_cuda(forward, p16, qb.view, kb.view, vb.view, ob.view, lseb, stream);
  fp8_backward_on_bf16(plan, p16, qb.view, kb.view, vb.view, ob.view, lseb, dout, dq, dk, dv, deterministic, stream);
}
#endif

// The CUDA plan of a validated problem, after the CUDA-only checks of its views; nothing for a CPU problem.
std::optional<CudaAttentionPlan> plan_for_device(std::string_view fn, const AttentionProblem& p, AttentionImpl impl,
                                                 AttentionPass pass, std::initializer_list<NamedView> views,
                                                 const TensorView& lse) {
  if (p.device == Device::cpu) return std::nullopt;
  return check_cuda_arguments(fn, p, impl, pass, views, lse);
}

// FP8 on the CPU runs the existing CPU paths on dequantised copies: q, k, v as value = stored · descale in the
// path's own arithmetic (fp64 for naive, exact there; fp32 for flash, one rounding of the exact product), o and
// dout read from bf16, the outputs written in that dtype and converted once into the caller's (o bf16; dq, dk,
// dv bf16 or fp32). The copies cost one tensor of the working dtype each, which the CPU, a reference for the
// GPU's FP8 kernels rather than a fast path, can spend; and the kernels stay one code for every dtype.
DType fp8_cpu_working_dtype(AttentionImpl impl) { return impl == AttentionImpl::naive ? DType::f64 : DType::f32; }

std::span<const int64_t> sizes_of(const TensorView& t) {
  return {t.sizes.data(), static_cast<size_t>(t.ndim)};
}

// A contiguous copy of t ([batch, seq, heads, dim]) in `dtype`, each element times its descale: `descale`, or
// where `heads` is given, heads.at(b, h / group) for head h of batch b (group: t's heads per descale head, the
// GQA group for q, 1 for k and v). The product of an e4m3 value, 4 significant bits, and an fp32 descale is
// exact in fp64.
Tensor dequantised_copy(const TensorView& t, DType dtype, double descale, std::string_view tag,
                        const AttentionProblem::HeadDescales& heads = {}, int64_t group = 1) {
  Tensor out = Tensor::empty(sizes_of(t), dtype, Device::cpu, tag);
  copy_into(out, t);
  if (descale == 1.0 && heads.data == nullptr) return out;
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
      T* x = out.view().ptr<T>();
      if (heads.data == nullptr) {
        for (int64_t i = 0; i < out.numel(); ++i) x[i] = static_cast<T>(static_cast<double>(x[i]) * descale);
        return;
      }
      const int64_t batch = t.size(0), seq = t.size(1), nh = t.size(2), dim = t.size(3);
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t s = 0; s < seq; ++s) {
          for (int64_t h = 0; h < nh; ++h) {
            const double d = heads.at(b, h / group);
            T* row = x + ((b * seq + s) * nh + h) * dim;
            for (int64_t e = 0; e < dim; ++e) row[e] = static_cast<T>(static_cast<double>(row[e]) * d);
          }
        }
      }
    } else {
      fail("attention: dequantised copy: working dtype {} is not fp32 or fp64", dtype_name(dtype));
    }
  });
  return out;
}

// q, k, v dequantised into the working dtype of `impl`, and the problem the CPU paths see on them: that dtype and
// no descales (they are in the copies' values).
struct DequantisedFp8 {
  AttentionProblem p;
  Tensor q, k, v;
  DequantisedFp8(const AttentionProblem& fp8, const TensorView& q8, const TensorView& k8, const TensorView& v8,
                 AttentionImpl impl)
      : p(fp8) {
    p.dtype = fp8_cpu_working_dtype(impl);
    p.q_descale = p.k_descale = p.v_descale = 1.0;
    p.q_descale_heads = p.k_descale_heads = p.v_descale_heads = {};
    q = dequantised_copy(q8, p.dtype, fp8.q_descale, "attention fp8 cpu: dequantised q", fp8.q_descale_heads,
                         fp8.group());
    k = dequantised_copy(k8, p.dtype, fp8.k_descale, "attention fp8 cpu: dequantised k", fp8.k_descale_heads);
    v = dequantised_copy(v8, p.dtype, fp8.v_descale, "attention fp8 cpu: dequantised v", fp8.v_descale_heads);
  }
};

void fp8_forward_cpu(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                     const TensorView& o, const TensorView& lse, AttentionImpl impl) {
  const DequantisedFp8 d(p, q, k, v, impl);
  const Tensor od = Tensor::empty(sizes_of(o), d.p.dtype, Device::cpu, "attention fp8 cpu: o before bf16");
  if (impl == AttentionImpl::naive) reference_attention_forward_cpu(d.p, d.q, d.k, d.v, od, lse);
  else flash_attention_forward_cpu(d.p, d.q, d.k, d.v, od, lse);
  copy_into(o, od);
}

void fp8_backward_cpu(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& o, const TensorView& lse, const TensorView& dout, const TensorView& dq,
                      const TensorView& dk, const TensorView& dv, AttentionImpl impl) {
  const DequantisedFp8 d(p, q, k, v, impl);
  const DType w = d.p.dtype;
  const Tensor dqd = Tensor::empty(sizes_of(dq), w, Device::cpu, "attention fp8 cpu: dq");
  const Tensor dkd = Tensor::empty(sizes_of(dk), w, Device::cpu, "attention fp8 cpu: dk");
  const Tensor dvd = Tensor::empty(sizes_of(dv), w, Device::cpu, "attention fp8 cpu: dv");
  const Tensor dod = dequantised_copy(dout, w, 1.0, "attention fp8 cpu: dout");
  if (impl == AttentionImpl::naive) {
    reference_attention_backward_cpu(d.p, d.q, d.k, d.v, dod, dqd, dkd, dvd);
  } else {
    const Tensor od = dequantised_copy(o, w, 1.0, "attention fp8 cpu: o");
    flash_attention_backward_cpu(d.p, d.q, d.k, d.v, od, lse, dod, dqd, dkd, dvd);
  }
  copy_into(dq, dqd);
  copy_into(dk, dkd);
  copy_into(dv, dvd);
}

// Runs a validated (and, on CUDA, planned) forward on the backend of its device.
void run_forward(const AttentionProblem& p, [[maybe_unused]] const std::optional<CudaAttentionPlan>& plan,
                 const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                 const TensorView& lse, const AttentionOptions& options) {
  if (p.device == Device::cpu) {
    if (p.dtype == DType::f8e4m3) fp8_forward_cpu(p, q, k, v, o, lse, options.impl);
    else if (options.impl == AttentionImpl::naive) reference_attention_forward_cpu(p, q, k, v, o, lse);
    else flash_attention_forward_cpu(p, q, k, v, o, lse);
    return;
  }
#ifdef FLASHLM_WITH_CUDA
  switch (plan->family) {
    case CudaKernelFamily::naive: return naive_attention_forward_cuda(p, q, k, v, o, lse, options.stream);
    case CudaKernelFamily::fp8:
#ifdef FLASHLM_WITH_SM90
      return flash_attention_forward_fp8_sm90(p, q, k, v, o, lse, options.stream);
#else
      fail("attention_forward: q: dtype fp8_e4m3 needs the sm_90a kernels, and this build has none (configure "
           "with 90 in CMAKE_CUDA_ARCHITECTURES)");
#endif
    case CudaKernelFamily::hopper: break;  // never planned: flash_kernel_family chooses it
    case CudaKernelFamily::mma_sync:
    case CudaKernelFamily::f32: return flash_forward_cuda(*plan, p, q, k, v, o, lse, options.stream);
  }
  fail("attention_forward: the plan chose the {} kernels, which this build does not launch",
       cuda_kernel_family_name(plan->family));
#endif
}

void run_backward(const AttentionProblem& p, [[maybe_unused]] const std::optional<CudaAttentionPlan>& plan,
                  const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                  const TensorView& lse, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                  const TensorView& dv, const AttentionOptions& options) {
  if (p.device == Device::cpu) {
    if (p.dtype == DType::f8e4m3) fp8_backward_cpu(p, q, k, v, o, lse, dout, dq, dk, dv, options.impl);
    else if (options.impl == AttentionImpl::naive) reference_attention_backward_cpu(p, q, k, v, dout, dq, dk, dv);
    else flash_attention_backward_cpu(p, q, k, v, o, lse, dout, dq, dk, dv);
    return;
  }
#ifdef FLASHLM_WITH_CUDA
  const bool det = options.deterministic;
  switch (plan->family) {
    case CudaKernelFamily::naive:
      return naive_attention_backward_cuda(p, q, k, v, o, lse, dout, dq, dk, dv, options.stream);
    case CudaKernelFamily::fp8:
      return fp8_backward_cuda(*plan, p, q, k, v, o, lse, dout, dq, dk, dv, det, options.stream);
    case CudaKernelFamily::hopper: break;  // never planned: flash_kernel_family chooses it
    case CudaKernelFamily::mma_sync:
    case CudaKernelFamily::f32:
      return flash_backward_cuda(*plan, p, q, k, v, o, lse, dout, dq, dk, dv, det, options.stream);
  }
  fail("attention_backward: the plan chose the {} kernels, which this build does not launch",
       cuda_kernel_family_name(plan->family));
#endif
}

// The backends add the sink's gradient into dlearnable_sink (a varlen call sums it over its runs): zeroed
// first, on the host or (a CUDA problem: the 16-bit flash backward's shared host code adds it, for mma.sync
// and Hopper alike) on the call's stream.
void clear_sink_gradient(const AttentionProblem& p, void* stream) {
  if (p.dlearnable_sink == nullptr) return;
  if (p.device == Device::cpu) {
    for (int64_t h = 0; h < p.heads_q; ++h) p.dlearnable_sink[h * p.dsink_stride] = 0.0f;
    return;
  }
#ifdef FLASHLM_WITH_CUDA
  clear_sink_gradient_cuda(p, stream);
#else
  (void)stream;
  fail("attention_backward: dlearnable_sink: this build has no CUDA");
#endif
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                       const TensorView& lse, const AttentionOptions& options) {
  const AttentionProblem p = validate_attention_forward(q, k, v, o, lse, options);
  const auto plan = plan_for_device("attention_forward", p, options.impl, AttentionPass::forward,
                                    {{"q", &q}, {"k", &k}, {"v", &v}, {"o", &o}}, lse);
  run_forward(p, plan, q, k, v, o, lse, options);
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                        const TensorView& lse, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, const AttentionOptions& options) {
  const AttentionProblem p = validate_attention_backward(q, k, v, o, lse, dout, dq, dk, dv, options);
  const auto plan = plan_for_device(
      "attention_backward", p, options.impl, AttentionPass::backward,
      {{"q", &q}, {"k", &k}, {"v", &v}, {"o", &o}, {"dout", &dout}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}}, lse);
  clear_sink_gradient(p, options.stream);
  run_backward(p, plan, q, k, v, o, lse, dout, dq, dk, dv, options);
}

// Packed sequences run as ordinary batched problems on views into the packed tensors, through the same
// backends (every CUDA path, the padded head dims and the Hopper forward included: each view's TMA
// descriptor ends at its own sequences' end, so nothing is read from or written to a neighbour): one problem
// per run of consecutive sequences of equal lengths, which lie in the pack as a strided batch. The checks ran
// once on the packed views, whose alignment every such view keeps (it starts a whole number of rows in, its
// batch stride is a whole number of rows).
void attention_varlen_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                              const TensorView& lse, const VarlenSequences& seqs, const AttentionOptions& options) {
  const VarlenProblem vp = validate_attention_varlen_forward(q, k, v, o, lse, seqs, options);
  const auto plan = plan_for_device("attention_varlen_forward", vp.packed, options.impl, AttentionPass::forward,
                                    {{"q", &vp.q}, {"k", &vp.k}, {"v", &vp.v}, {"o", &vp.o}}, vp.lse);
  for (int64_t b = 0, e; b < vp.batch(); b = e) {
    e = vp.run_end(b);
    const int64_t n = e - b;
    const AttentionProblem p = vp.run(b, n);
    if (p.seq_q == 0) continue;  // nothing to write
    run_forward(p, plan, vp.query_rows(vp.q, b, n), vp.key_rows(vp.k, b, n), vp.key_rows(vp.v, b, n),
                vp.query_rows(vp.o, b, n), vp.lse_rows(b, n), options);
  }
}

void attention_varlen_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                               const TensorView& lse, const TensorView& dout, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const VarlenSequences& seqs,
                               const AttentionOptions& options) {
  const VarlenProblem vp = validate_attention_varlen_backward(q, k, v, o, lse, dout, dq, dk, dv, seqs, options);
  const auto plan = plan_for_device("attention_varlen_backward", vp.packed, options.impl, AttentionPass::backward,
                                    {{"q", &vp.q},
                                     {"k", &vp.k},
                                     {"v", &vp.v},
                                     {"o", &vp.o},
                                     {"dout", &vp.dout},
                                     {"dq", &vp.dq},
                                     {"dk", &vp.dk},
                                     {"dv", &vp.dv}},
                                    vp.lse);
  clear_sink_gradient(vp.packed, options.stream);
  for (int64_t b = 0, e; b < vp.batch(); b = e) {
    e = vp.run_end(b);
    const int64_t n = e - b;
    const AttentionProblem p = vp.run(b, n);
    if (p.seq_q == 0 && p.seq_k == 0) continue;  // no rows of any gradient belong to them
    // Sequences without queries still run: their keys get zero dk and dv.
    run_backward(p, plan, vp.query_rows(vp.q, b, n), vp.key_rows(vp.k, b, n), vp.key_rows(vp.v, b, n),
                 vp.query_rows(vp.o, b, n), vp.lse_rows(b, n), vp.query_rows(vp.dout, b, n),
                 vp.query_rows(vp.dq, b, n), vp.key_rows(vp.dk, b, n), vp.key_rows(vp.dv, b, n), options);
  }
}

}  // namespace flashlm
