// Public attention entry points: validate once, then hand the problem to the backend for the device
// and implementation asked for.
#include "flashlm/attention.h"

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "attention/backends.h"
#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/device.h"

namespace flashlm {

CausalAlign parse_causal_align(std::string_view name) {
  if (name == "top-left" || name == "top_left") return CausalAlign::top_left;
  if (name == "bottom-right" || name == "bottom_right") return CausalAlign::bottom_right;
  fail("unknown causal alignment '{}': expected top-left or bottom-right", name);
}

std::string_view attention_impl_name(AttentionImpl impl) { return impl == AttentionImpl::naive ? "naive" : "flash"; }

AttentionImpl parse_attention_impl(std::string_view name) {
  if (name == "naive") return AttentionImpl::naive;
  if (name == "flash") return AttentionImpl::flash;
  fail("unknown attention implementation '{}': expected naive or flash", name);
}

double attention_forward_flops(int64_t batch, int64_t heads, int64_t seq_q, int64_t seq_k, int64_t head_dim,
                               bool causal) {
  const double f = 4.0 * double(batch) * double(heads) * double(seq_q) * double(seq_k) * double(head_dim);
  return causal ? f / 2 : f;
}

namespace {

using NamedView = std::pair<const char*, const TensorView*>;

// What the CUDA kernels need beyond the common checks: a supported dtype and head dim, memory of the
// current device, and 16-byte alignment of every row so that tiles move in 16-byte vectors.
void check_cuda_arguments(std::string_view fn, const AttentionProblem& p, std::initializer_list<NamedView> views,
                          const TensorView& lse) {
  FLASHLM_CHECK(cuda_built(), "{}: q: tensors on cuda but flashlm was built without CUDA", fn);
  FLASHLM_CHECK(p.dtype == DType::f16 || p.dtype == DType::bf16 || p.dtype == DType::f32,
                "{}: q: dtype {} is not supported on cuda (fp16, bf16 or fp32)", fn, dtype_name(p.dtype));
  FLASHLM_CHECK(p.head_dim == 16 || p.head_dim == 32 || p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256,
                "{}: q: head_dim {} is not supported on cuda (16, 32, 64, 128 or 256)", fn, p.head_dim);
  const int device = cuda_current_device();
  const int64_t elem = static_cast<int64_t>(dtype_size(p.dtype));
  for (const auto& [name, t] : views) {
    if (t->numel() == 0) continue;
    FLASHLM_CHECK(cuda_pointer_device(t->data) == device,
                  "{}: {}: data is not device memory of the current device cuda:{}", fn, name, device);
    FLASHLM_CHECK(reinterpret_cast<uintptr_t>(t->data) % 16 == 0,
                  "{}: {}: data pointer must be 16-byte aligned for the cuda kernels", fn, name);
    for (int d = 0; d < 3; ++d) {
      FLASHLM_CHECK(t->stride(d) * elem % 16 == 0 || t->size(d) == 1,
                    "{}: {}: stride {} of dimension {} is not a multiple of 16 bytes ({} elements of {})", fn, name,
                    t->stride(d), d, 16 / elem, dtype_name(p.dtype));
    }
  }
  if (lse.numel() > 0) {
    FLASHLM_CHECK(cuda_pointer_device(lse.data) == device,
                  "{}: lse: data is not device memory of the current device cuda:{}", fn, device);
    FLASHLM_CHECK(lse.dtype == DType::f32, "{}: lse: expected fp32 on cuda", fn);
  }
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                       const TensorView& lse, const AttentionOptions& options) {
  const AttentionProblem p = validate_attention_forward(q, k, v, o, lse, options);
  const bool naive = options.impl == AttentionImpl::naive;
  if (p.device == Device::cpu) {
    if (naive) reference_attention_forward_cpu(p, q, k, v, o, lse);
    else flash_attention_forward_cpu(p, q, k, v, o, lse);
    return;
  }
  check_cuda_arguments("attention_forward", p, {{"q", &q}, {"k", &k}, {"v", &v}, {"o", &o}}, lse);
#ifdef FLASHLM_WITH_CUDA
  if (naive) naive_attention_forward_cuda(p, q, k, v, o, lse, options.stream);
  else if (p.dtype == DType::f32) flash_attention_forward_cuda_f32(p, q, k, v, o, lse, options.stream);
  else flash_attention_forward_cuda(p, q, k, v, o, lse, options.stream);
#endif
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                        const TensorView& lse, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, const AttentionOptions& options) {
  const AttentionProblem p = validate_attention_backward(q, k, v, o, lse, dout, dq, dk, dv, options);
  const bool naive = options.impl == AttentionImpl::naive;
  if (p.device == Device::cpu) {
    if (naive) reference_attention_backward_cpu(p, q, k, v, dout, dq, dk, dv);
    else flash_attention_backward_cpu(p, q, k, v, o, lse, dout, dq, dk, dv);
    return;
  }
  check_cuda_arguments("attention_backward", p,
                       {{"q", &q}, {"k", &k}, {"v", &v}, {"o", &o}, {"dout", &dout}, {"dq", &dq}, {"dk", &dk},
                        {"dv", &dv}},
                       lse);
#ifdef FLASHLM_WITH_CUDA
  if (naive) naive_attention_backward_cuda(p, q, k, v, o, lse, dout, dq, dk, dv, options.stream);
  else if (p.dtype == DType::f32) flash_attention_backward_cuda_f32(p, q, k, v, o, lse, dout, dq, dk, dv, options.stream);
  else flash_attention_backward_cuda(p, q, k, v, o, lse, dout, dq, dk, dv, options.deterministic, options.stream);
#endif
}

}  // namespace flashlm
