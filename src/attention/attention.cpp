// Public attention entry points: validate once, then hand the problem to the backend for the device
// and implementation asked for.
#include "flashlm/attention.h"

#include <array>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <utility>

#include "attention/backends.h"
#include "attention/capabilities.h"
#include "core/check.h"
#include "core/cuda_runtime.h"
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
  const char* env = std::getenv("FLASHLM_ATTENTION_KERNEL");
  const std::string_view value = env == nullptr ? "auto" : env;
  if (value == "auto" || value.empty()) return FlashKernelChoice::automatic;
  if (value == "mma") return FlashKernelChoice::mma;
  fail("FLASHLM_ATTENTION_KERNEL: unknown value '{}': expected auto or mma", value);
}

namespace {

// A contiguous [batch, seq, heads, head_dim] tensor from the stream-ordered pool: for an input (`copy`),
// `t`'s values in its first columns and zeros after them; for an output, the kernel's to write.
struct PaddedCopy {
  Buffer buffer;
  TensorView view;
  PaddedCopy(const TensorView& t, int64_t head_dim, bool copy, const char* tag, void* stream) {
    const std::array<int64_t, 4> sizes{t.size(0), t.size(1), t.size(2), head_dim};
    const size_t bytes = static_cast<size_t>(sizes[0] * sizes[1] * sizes[2] * head_dim) * dtype_size(t.dtype);
    buffer = Buffer::allocate_on_stream(bytes, tag, stream);
    view = TensorView::contiguous(buffer.data(), t.dtype, sizes, Device::cuda);
    // Outputs (copy = false) are left as allocated: the kernels write every element, padded columns
    // included. An empty tensor (seq_k = 0 is a valid problem) gets no allocation: no memset of a null.
    if (copy && bytes > 0) cuda_memset_async(buffer.data(), 0, bytes, stream);
    if (copy && t.numel() > 0) copy_head_rows_cuda(t, view, t.size(3), stream);
  }
};

}  // namespace

namespace {

// Whether a family's kernels implement every attention variant the problem asks for.
bool implements_variants(const CudaKernelCapability& caps, const AttentionProblem& p) {
  return (!p.windowed() || caps.sliding_window) && (p.softcap == 0 || caps.softcap) && (!p.alibi || caps.alibi) &&
         (!p.sink || caps.learnable_sink);
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
// plan_cuda_attention; and here a Hopper plan (a head dim pair, which has no mma.sync kernel) is refused
// where those predicates fail.
CudaKernelFamily flash_kernel_family(const CudaAttentionPlan& plan, AttentionPass pass, const AttentionProblem& p,
                                     const TensorView& q, const TensorView& k, const TensorView& v,
                                     const TensorView& o, const TensorView& dout, bool deterministic) {
  // Read on every build, so that a bad value is an error wherever it is set.
  const FlashKernelChoice choice = flash_kernel_choice();
  if (plan.family == CudaKernelFamily::hopper) {
    // Planned there for a head_dim_v of its own, which no other cuda kernel runs: no fallback.
    const std::string_view fn = pass == AttentionPass::forward ? "attention_forward" : "attention_backward";
    FLASHLM_CHECK(choice != FlashKernelChoice::mma,
                  "{}: v: head_dim_v {} differs from head_dim {}, which only the Hopper kernels run on cuda, and "
                  "FLASHLM_ATTENTION_KERNEL=mma forbids them; it runs on the cpu",
                  fn, p.value_dim(), p.head_dim);
    FLASHLM_CHECK(hopper_covers(pass, p, q, k, v, o, dout, deterministic),
                  "{}: v: head_dim_v {} differs from head_dim {}, which only the Hopper kernels run on cuda, and "
                  "they do not run this call: they need a build with 90 in CMAKE_CUDA_ARCHITECTURES, an sm_90 GPU "
                  "(compute capability 9.0) and views TMA can describe (strides under 2^40 bytes, sizes under "
                  "2^31){}; it runs on the cpu",
                  fn, p.value_dim(), p.head_dim,
                  pass == AttentionPass::backward ? ", and no AttentionOptions::deterministic" : "");
    return plan.family;
  }
  if (plan.family != CudaKernelFamily::mma_sync) return plan.family;
  // plan_cuda_attention checked the variants against the mma.sync row; the Hopper row may lack some of them
  // (ALiBi and sinks, unless hopper_alibi_sink_route()), and those problems stay on mma.sync.
  if (!implements_variants(cuda_kernel_capability(CudaKernelFamily::hopper), p)) return plan.family;
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

void flash_forward_cuda(const CudaAttentionPlan& plan, const AttentionProblem& p, const TensorView& q,
                        const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
                        void* stream) {
  switch (flash_kernel_family(plan, AttentionPass::forward, p, q, k, v, o, TensorView{}, false)) {
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
  fail("attention_forward: the {} kernels have no flash forward", cuda_kernel_family_name(plan.family));
}

void flash_backward_cuda(const CudaAttentionPlan& plan, const AttentionProblem& p, const TensorView& q,
                         const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
                         const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                         bool deterministic, void* stream) {
  switch (flash_kernel_family(plan, AttentionPass::backward, p, q, k, v, o, dout, deterministic)) {
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
    case CudaKernelFamily::fp8: break;  // run_backward launches naive; fp8 has no backward
  }
  fail("attention_backward: the {} kernels have no flash backward", cuda_kernel_family_name(plan.family));
}

// A head dim without its own flash kernel (80 for the 2.7B model: 2560 / 32 heads) runs the next larger
// compiled one (the plan's kernel_head_dim) on zero-padded copies: the padded columns add 0 to every Q·K
// product and give 0 in O, dQ, dK and dV, which are dropped when copying back. The scale stays the one of
// the real head dim (p.scale). Correct, not optimised: the copies and the padded work cost (padded / real)
// of the kernel time and one copy of the tensors.
void padded_flash_forward_cuda(const CudaAttentionPlan& plan, const AttentionProblem& p, const TensorView& q,
                               const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
                               void* stream) {
  AttentionProblem padded = p;
  padded.head_dim = plan.kernel_head_dim;
  const PaddedCopy qp(q, padded.head_dim, true, "attention: q padded to the kernel head dim", stream);
  const PaddedCopy kp(k, padded.head_dim, true, "attention: k padded to the kernel head dim", stream);
  const PaddedCopy vp(v, padded.head_dim, true, "attention: v padded to the kernel head dim", stream);
  const PaddedCopy op(o, padded.head_dim, false, "attention: o padded to the kernel head dim", stream);
  flash_forward_cuda(plan, padded, qp.view, kp.view, vp.view, op.view, lse, stream);
  if (o.numel() > 0) copy_head_rows_cuda(op.view, o, p.head_dim, stream);
}

void padded_flash_backward_cuda(const CudaAttentionPlan& plan, const AttentionProblem& p, const TensorView& q,
                                const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
                                const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                const TensorView& dv, bool deterministic, void* stream) {
  AttentionProblem padded = p;
  padded.head_dim = plan.kernel_head_dim;
  const int64_t d = padded.head_dim;
  const PaddedCopy qp(q, d, true, "attention: q padded to the kernel head dim", stream);
  const PaddedCopy kp(k, d, true, "attention: k padded to the kernel head dim", stream);
  const PaddedCopy vp(v, d, true, "attention: v padded to the kernel head dim", stream);
  const PaddedCopy op(o, d, true, "attention: o padded to the kernel head dim", stream);
  const PaddedCopy dop(dout, d, true, "attention: dout padded to the kernel head dim", stream);
  const PaddedCopy dqp(dq, d, false, "attention: dq padded to the kernel head dim", stream);
  const PaddedCopy dkp(dk, d, false, "attention: dk padded to the kernel head dim", stream);
  const PaddedCopy dvp(dv, d, false, "attention: dv padded to the kernel head dim", stream);
  flash_backward_cuda(plan, padded, qp.view, kp.view, vp.view, op.view, lse, dop.view, dqp.view, dkp.view,
                      dvp.view, deterministic, stream);
  if (dq.numel() > 0) copy_head_rows_cuda(dqp.view, dq, p.head_dim, stream);
  if (dk.numel() > 0) copy_head_rows_cuda(dkp.view, dk, p.head_dim, stream);
  if (dv.numel() > 0) copy_head_rows_cuda(dvp.view, dv, p.head_dim, stream);
}
#endif

// The CUDA plan of a validated problem, after the CUDA-only checks of its views; nothing for a CPU problem.
std::optional<CudaAttentionPlan> plan_for_device(std::string_view fn, const AttentionProblem& p, AttentionImpl impl,
                                                 AttentionPass pass, std::initializer_list<NamedView> views,
                                                 const TensorView& lse) {
  if (p.device == Device::cpu) return std::nullopt;
  return check_cuda_arguments(fn, p, impl, pass, views, lse);
}

// Runs a validated (and, on CUDA, planned) forward on the backend of its device.
void run_forward(const AttentionProblem& p, [[maybe_unused]] const std::optional<CudaAttentionPlan>& plan,
                 const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                 const TensorView& lse, const AttentionOptions& options) {
  if (p.device == Device::cpu) {
    if (options.impl == AttentionImpl::naive) reference_attention_forward_cpu(p, q, k, v, o, lse);
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
    case CudaKernelFamily::hopper:  // a head_dim_v of its own (plan_cuda_attention): never padded
    case CudaKernelFamily::mma_sync:
    case CudaKernelFamily::f32:
      if (plan->padded) return padded_flash_forward_cuda(*plan, p, q, k, v, o, lse, options.stream);
      return flash_forward_cuda(*plan, p, q, k, v, o, lse, options.stream);
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
    if (options.impl == AttentionImpl::naive) reference_attention_backward_cpu(p, q, k, v, dout, dq, dk, dv);
    else flash_attention_backward_cpu(p, q, k, v, o, lse, dout, dq, dk, dv);
    return;
  }
#ifdef FLASHLM_WITH_CUDA
  const bool det = options.deterministic;
  switch (plan->family) {
    case CudaKernelFamily::naive:
      return naive_attention_backward_cuda(p, q, k, v, o, lse, dout, dq, dk, dv, options.stream);
    case CudaKernelFamily::fp8: break;  // refused by validate_attention_backward
    case CudaKernelFamily::hopper:        // a head_dim_v of its own (plan_cuda_attention): never padded
    case CudaKernelFamily::mma_sync:
    case CudaKernelFamily::f32:
      if (plan->padded) {
        return padded_flash_backward_cuda(*plan, p, q, k, v, o, lse, dout, dq, dk, dv, det, options.stream);
      }
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
