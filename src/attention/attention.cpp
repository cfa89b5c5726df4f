// Public attention entry points: validate once, then hand the problem to the backend for the device
// and implementation asked for.
#include "flashlm/attention.h"

#include "attention/backends.h"
#include "core/check.h"

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

void require_cpu_backend(const AttentionProblem& p, std::string_view fn) {
  FLASHLM_CHECK(p.device == Device::cpu, "{}: q: tensors on cuda but flashlm was built without CUDA", fn);
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                       const TensorView& lse, const AttentionOptions& options) {
  const AttentionProblem p = validate_attention_forward(q, k, v, o, lse, options);
  require_cpu_backend(p, "attention_forward");
  if (options.impl == AttentionImpl::naive) reference_attention_forward_cpu(p, q, k, v, o, lse);
  else flash_attention_forward_cpu(p, q, k, v, o, lse);
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                        const TensorView& lse, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, const AttentionOptions& options) {
  const AttentionProblem p = validate_attention_backward(q, k, v, o, lse, dout, dq, dk, dv, options);
  require_cpu_backend(p, "attention_backward");
  if (options.impl == AttentionImpl::naive) reference_attention_backward_cpu(p, q, k, v, dout, dq, dk, dv);
  else flash_attention_backward_cpu(p, q, k, v, o, lse, dout, dq, dk, dv);
}

}  // namespace flashlm
