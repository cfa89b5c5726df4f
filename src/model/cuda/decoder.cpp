// KvCacheDecoder's step on the GPU: decoder.cpp's CPU step line for line, through the CUDA layer functions
// (cuda/ops.h) in fp32, cuBLASLt's true-fp32 products and the attention entry point on device views, so a
// greedy sample matches the CPU decoder's tokens within what fp32 rounding allows. Everything is queued on
// the legacy default stream, which orders it with the synchronous copies of the token in and the logits out.
#include "core/cuda_runtime.h"
#include "flashlm/attention.h"
#include "flashlm/generate.h"
#include "flashlm/tensor.h"
#include "model/decoder_rows.h"
#include "model/cuda/gemm.h"
#include "model/cuda/ops.h"

namespace flashlm {

void KvCacheDecoder::step_rows_cuda(int32_t token, bool want_logits) {
  const ModelConfig& c = config_;
  void* const stream = nullptr;
  const int64_t d = c.d_model, f = c.d_ff, hd = c.head_dim(), half = hd / 2, pos = position_;
  const auto eps = static_cast<float>(c.norm_eps);
  const StepRows r = step_rows(static_cast<float*>(work_.data()), c);
  const float* cos = static_cast<const float*>(rope_.data()) + pos * half;
  const float* sin = static_cast<const float*>(rope_.data()) + c.context * half + pos * half;
  // RMSNorm's 1/rms, which only a backward reads: kept in the first lse slot, free outside the attention.
  float* rstd = r.lse;
  AttentionOptions attn;  // one query, the newest position, over every cached key: bottom-right causal
  attn.impl = AttentionImpl::flash;
  attn.causal = true;
  attn.align = CausalAlign::bottom_right;
  attn.stream = stream;
  const auto linear = [&](const float* x, const float* w, float* y, int64_t in, int64_t out) {
    linear_forward_cuda(x, w, y, 1, in, out, DType::f32, stream);
  };
  const auto view = [](float* p, std::initializer_list<int64_t> sizes) {
    return TensorView::contiguous(p, DType::f32, sizes, Device::cuda);
  };

  cuda_copy(device_token_.data(), &token, sizeof token);
  gpu::embedding_forward<float>(param("token_embeddings.weight"), static_cast<const int32_t*>(device_token_.data()),
                                r.x, 1, d, c.vocab, stream);
  for (int64_t l = 0; l < c.layers; ++l) {
    float* keys = static_cast<float*>(cache_k_.data()) + l * c.context * d;
    float* values = static_cast<float*>(cache_v_.data()) + l * c.context * d;
    gpu::rmsnorm_forward<float>(r.x, layer_param(l, "ln1.weight"), r.h, rstd, 1, d, eps, stream);
    linear(r.h, layer_param(l, "attn.q_proj.weight"), r.q, d, d);
    linear(r.h, layer_param(l, "attn.k_proj.weight"), keys + pos * d, d, d);
    linear(r.h, layer_param(l, "attn.v_proj.weight"), values + pos * d, d, d);
    gpu::rope_forward<float>(r.q, cos, sin, 1, 1, c.heads, hd, stream);
    gpu::rope_forward<float>(keys + pos * d, cos, sin, 1, 1, c.heads, hd, stream);
    attention_forward(view(r.q, {1, 1, c.heads, hd}), view(keys, {1, pos + 1, c.heads, hd}),
                      view(values, {1, pos + 1, c.heads, hd}), view(r.o, {1, 1, c.heads, hd}),
                      view(r.lse, {1, c.heads, 1}), attn);
    linear(r.o, layer_param(l, "attn.output_proj.weight"), r.h, d, d);
    gpu::add_inplace<float>(r.x, r.h, d, stream);
    gpu::rmsnorm_forward<float>(r.x, layer_param(l, "ln2.weight"), r.h, rstd, 1, d, eps, stream);
    linear(r.h, layer_param(l, "ffn.w1.weight"), r.u, d, f);
    linear(r.h, layer_param(l, "ffn.w3.weight"), r.g, d, f);
    gpu::swiglu_forward<float>(r.u, r.g, r.s, f, stream);
    linear(r.s, layer_param(l, "ffn.w2.weight"), r.h, f, d);
    gpu::add_inplace<float>(r.x, r.h, d, stream);
  }
  if (!want_logits) return;
  gpu::rmsnorm_forward<float>(r.x, param("ln_final.weight"), r.h, rstd, 1, d, eps, stream);
  linear(r.h, param("lm_head.weight"), r.logits, d, c.vocab);
  cuda_copy(host_logits_.data(), r.logits, size_t(c.vocab) * sizeof(float));
}

}  // namespace flashlm
