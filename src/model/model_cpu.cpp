// The LM on the CPU: the whole training step reads top to bottom — forward, backward, AdamW.
#include <cmath>
#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "core/check.h"
#include "flashlm/model.h"
#include "flashlm/profile.h"
#include "model/activations.h"
#include "model/ops_cpu.h"
#include "optim/optimizer.h"

namespace flashlm {

CpuModel::CpuModel(const ModelConfig& config, int64_t batch, int64_t seq, AttentionImpl attention)
    : CpuModel(config, batch, seq, ModelOptions::with_attention(attention)) {}

CpuModel::CpuModel(const ModelConfig& config, int64_t batch, int64_t seq, const ModelOptions& options)
    : config_(config), batch_(batch), seq_(seq), options_(options), layout_(parameter_layout(config)) {
  FLASHLM_CHECK(batch >= 1, "CpuModel: batch = {}, expected at least 1", batch);
  FLASHLM_CHECK(seq >= 1 && seq <= config.context, "CpuModel: seq = {} outside [1, context = {}]", seq,
                config.context);
  FLASHLM_CHECK(!options.bf16_pure, "CpuModel: the CPU engine runs fp32, not bf16-pure");
  options.check_optimizer_state();
  n_params_ = layout_.back().offset + layout_.back().numel();
  const size_t pbytes = size_t(n_params_) * sizeof(float);
  // FSDP's sharded storage holds them instead (ModelOptions::external_parameters).
  if (!options.external_parameters) {
    params_ = Buffer::allocate(pbytes, Device::cpu, "parameters");
    grads_ = Buffer::allocate(pbytes, Device::cpu, "gradients");
  }
  point_storage_at(parameters(), nullptr, DType::f32, gradients());
  acts_layout_ = std::make_unique<ActivationLayout>(layout_activations(config, batch, seq, options.recompute));
  const int64_t n = batch * seq;  // checked by layout_activations
  constexpr std::string_view bytes = "CpuModel: activation bytes";
  constexpr int64_t kFloat = sizeof(float);
  logits_offset_ = acts_layout_->values;
  const int64_t values = checked_add(logits_offset_, checked_mul(n, config.vocab, "CpuModel: tokens x vocab"), bytes);
  acts_ = Buffer::allocate(size_t(checked_mul(values, kFloat, bytes)), Device::cpu, "activations and logits");
  stats_ = Buffer::allocate(size_t(checked_mul(acts_layout_->stats, kFloat, bytes)), Device::cpu,
                            "activations (statistics)");
  scratch_ = Buffer::allocate(size_t(checked_mul(backward_scratch_elements(config, n), kFloat, bytes)), Device::cpu,
                              "backward scratch");
  const int64_t half = config.head_dim() / 2;
  rope_ = Buffer::allocate(size_t(checked_product({2, config.context, half, kFloat}, "CpuModel: RoPE table bytes")),
                           Device::cpu, "RoPE tables");
  float* rope = static_cast<float*>(rope_.data());
  cpu::rope_tables(rope, rope + config.context * half, config.context, config.head_dim(), config.rope_theta);
  if (!options.external_parameters) std::fill(parameters(), parameters() + n_params_, 0.0f);
  zero_grad();
}

CpuModel::~CpuModel() = default;

// The AdamW moments are allocated by the first step (or load_state): a model whose optimizer state lives
// elsewhere (ZeRO-1's shards) never holds them.
void CpuModel::allocate_moments() {
  if (adam_m_.data()) return;
  const size_t pbytes = size_t(n_params_) * (bf16_moments() ? sizeof(bf16_t) : sizeof(float));
  adam_m_ = Buffer::allocate(pbytes, Device::cpu, bf16_moments() ? "AdamW first moment (bf16)" : "AdamW first moment");
  adam_v_ = Buffer::allocate(pbytes, Device::cpu, bf16_moments() ? "AdamW second moment (bf16)" : "AdamW second moment");
  std::memset(adam_m_.data(), 0, pbytes);  // +0 in fp32 and in bf16
  std::memset(adam_v_.data(), 0, pbytes);
}

void CpuModel::release_optimizer_state() {
  adam_m_ = Buffer();
  adam_v_ = Buffer();
  adam_step_ = 0;
}

float* CpuModel::param(const std::string& name) const { return stored(name).master; }
float* CpuModel::grad(const std::string& name) const { return stored(name).grad; }

void CpuModel::check_own_storage(std::string_view caller) const {
  FLASHLM_CHECK(!options_.external_parameters,
                "{}: this model keeps no flat parameters of its own (FSDP's sharded storage: use DdpModel's)", caller);
}

void CpuModel::init_parameters(uint64_t seed) {
  check_own_storage("CpuModel::init_parameters");
  init_parameters_host(layout_, parameters(), seed);
}

const float* CpuModel::logits() const { return act(logits_offset_); }

namespace {

// [batch, seq, heads, head_dim] view of a contiguous [batch * seq, d_model] array.
TensorView heads_view(float* data, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim) {
  return TensorView::contiguous(data, DType::f32, {batch, seq, heads, head_dim});
}

}  // namespace

double CpuModel::forward(const int32_t* tokens, const int32_t* targets) {
  const ModelConfig& c = config_;
  const int64_t n = batch_ * seq_, d = c.d_model;
  for (int64_t i = 0; i < n; ++i) {
    FLASHLM_CHECK(tokens[i] >= 0 && tokens[i] < c.vocab, "forward: tokens[{}] = {} outside [0, vocab = {})", i,
                  tokens[i], c.vocab);
    FLASHLM_CHECK(targets[i] >= 0 && targets[i] < c.vocab, "forward: targets[{}] = {} outside [0, vocab = {})", i,
                  targets[i], c.vocab);
  }
  tokens_ = tokens;
  targets_ = targets;
  memory_set_phase("forward");
  ScopedRange range("forward");
  const ActivationLayout& A = *acts_layout_;
  parameters_needed("token_embeddings.");
  cpu::embedding_forward(param("token_embeddings.weight"), tokens, act(A.blocks[0].x_in), n, d);
  parameters_done("token_embeddings.");
  for (int64_t l = 0; l < c.layers; ++l) forward_block(l, BlockPass::full);
  // The working set now holds the last segment's blocks: the backward starts without recomputing them.
  materialized_segment_ = A.blocks.back().segment;
  parameters_needed("ln_final.");
  cpu::rmsnorm_forward(act(A.x_out), param("ln_final.weight"), act(A.h_f), stat(A.rstd_f), n, d, float(c.norm_eps));
  parameters_done("ln_final.");
  parameters_needed("lm_head.");
  cpu::linear_forward(act(A.h_f), param("lm_head.weight"), act(logits_offset_), n, d, c.vocab);
  parameters_done("lm_head.");
  return cpu::cross_entropy_forward(act(logits_offset_), targets, n, c.vocab);
}

void CpuModel::forward_block(int64_t l, BlockPass pass) {
  const ModelConfig& c = config_;
  const int64_t n = batch_ * seq_, d = c.d_model, f = c.d_ff, hd = c.head_dim();
  const ActivationLayout& A = *acts_layout_;
  const BlockActivations& a = A.blocks[size_t(l)];
  const std::string p = fmt::format("layers.{}.", l);
  ScopedRange layer_range(pass == BlockPass::full ? "layer.forward" : "layer.recompute");
  parameters_needed(p);
  const float* rope_cos = this->rope_cos();
  const float* rope_sin = this->rope_sin();
  cpu::rmsnorm_forward(act(a.x_in), param(p + "ln1.weight"), act(a.h1), stat(a.rstd1), n, d, float(c.norm_eps));
  cpu::linear_forward(act(a.h1), param(p + "attn.q_proj.weight"), act(a.q), n, d, d);
  cpu::linear_forward(act(a.h1), param(p + "attn.k_proj.weight"), act(a.k), n, d, d);
  cpu::linear_forward(act(a.h1), param(p + "attn.v_proj.weight"), act(a.v), n, d, d);
  cpu::rope_forward(act(a.q), rope_cos, rope_sin, batch_, seq_, c.heads, hd);
  cpu::rope_forward(act(a.k), rope_cos, rope_sin, batch_, seq_, c.heads, hd);
  if (pass != BlockPass::without_attention) {
    ScopedRange attention_range("attention.forward");
    attention_forward(heads_view(act(a.q), batch_, seq_, c.heads, hd), heads_view(act(a.k), batch_, seq_, c.heads, hd),
                      heads_view(act(a.v), batch_, seq_, c.heads, hd), heads_view(act(a.attn), batch_, seq_, c.heads, hd),
                      TensorView::contiguous(stat(a.lse), DType::f32, {batch_, c.heads, seq_}), attention_options());
  }
  float* x_mid = act(a.x_mid);
  cpu::linear_forward(act(a.attn), param(p + "attn.output_proj.weight"), x_mid, n, d, d);
  for (int64_t i = 0; i < n * d; ++i) x_mid[i] += act(a.x_in)[i];
  cpu::rmsnorm_forward(x_mid, param(p + "ln2.weight"), act(a.h2), stat(a.rstd2), n, d, float(c.norm_eps));
  cpu::linear_forward(act(a.h2), param(p + "ffn.w1.weight"), act(a.u), n, d, f);
  cpu::linear_forward(act(a.h2), param(p + "ffn.w3.weight"), act(a.g), n, d, f);
  cpu::swiglu_forward(act(a.u), act(a.g), act(a.s), n * f);
  if (pass == BlockPass::full) {  // a recomputation needs only what the block computed inside
    // The residual stream leaves into the next block's input (or x_out).
    float* x_out = act(l + 1 < c.layers ? A.blocks[size_t(l + 1)].x_in : A.x_out);
    cpu::linear_forward(act(a.s), param(p + "ffn.w2.weight"), x_out, n, f, d);
    for (int64_t i = 0; i < n * d; ++i) x_out[i] += x_mid[i];
  }
  parameters_done(p);
}

AttentionOptions CpuModel::attention_options() const {
  AttentionOptions attn;
  attn.impl = options_.attention;
  attn.causal = true;
  return attn;
}

void CpuModel::backward() {
  FLASHLM_CHECK(tokens_ != nullptr, "backward: call forward() first");
  const ModelConfig& c = config_;
  const int64_t n = batch_ * seq_, d = c.d_model, f = c.d_ff, hd = c.head_dim();
  const ActivationLayout& A = *acts_layout_;
  const float* rope_cos = this->rope_cos();
  const float* rope_sin = this->rope_sin();
  const AttentionOptions attn = attention_options();

  memory_set_phase("backward");
  ScopedRange range("backward");
  float* s0 = static_cast<float*>(scratch_.data());
  float *dx = s0, *dh = s0 + n * d, *dq = s0 + 2 * n * d, *dk = s0 + 3 * n * d, *dv = s0 + 4 * n * d,
        *dattn = s0 + 5 * n * d;
  float *du = s0 + 6 * n * d, *dg = du + n * f, *ds = dg + n * f;

  float* dlogits = act(logits_offset_);
  cpu::cross_entropy_backward(dlogits, targets_, n, c.vocab);
  parameters_needed("lm_head.");
  gradients_needed("lm_head.");
  cpu::linear_backward(dlogits, act(A.h_f), param("lm_head.weight"), dh, grad("lm_head.weight"), n, d, c.vocab,
                       false);
  parameters_done("lm_head.");
  gradient_ready("lm_head.weight");
  std::fill(dx, dx + n * d, 0.0f);
  parameters_needed("ln_final.");
  gradients_needed("ln_final.");
  cpu::rmsnorm_backward(dh, act(A.x_out), param("ln_final.weight"), stat(A.rstd_f), dx, grad("ln_final.weight"), n,
                        d);
  parameters_done("ln_final.");
  gradient_ready("ln_final.weight");

  for (int64_t l = c.layers - 1; l >= 0; --l) {
    const BlockActivations& a = A.blocks[size_t(l)];
    if (a.segment >= 0 && a.segment != materialized_segment_) {
      // Recompute the segment from its kept input; its last block (this one) stops before its output.
      for (int64_t j = a.segment; j < l; ++j) forward_block(j, BlockPass::full);
      forward_block(l, A.recompute.kind == RecomputePlan::Kind::selective ? BlockPass::without_attention
                                                                          : BlockPass::without_output);
      materialized_segment_ = a.segment;
    }
    const std::string p = fmt::format("layers.{}.", l);
    ScopedRange layer_range("layer.backward");
    parameters_needed(p);
    gradients_needed(p);
    // dx holds ∂L/∂(layer output) = ∂L/∂x_mid through the residual, plus the FFN branch below.
    cpu::linear_backward(dx, act(a.s), param(p + "ffn.w2.weight"), ds, grad(p + "ffn.w2.weight"), n, f, d, false);
    gradient_ready(p + "ffn.w2.weight");
    cpu::swiglu_backward(ds, act(a.u), act(a.g), du, dg, n * f);
    cpu::linear_backward(du, act(a.h2), param(p + "ffn.w1.weight"), dh, grad(p + "ffn.w1.weight"), n, d, f, false);
    gradient_ready(p + "ffn.w1.weight");
    cpu::linear_backward(dg, act(a.h2), param(p + "ffn.w3.weight"), dh, grad(p + "ffn.w3.weight"), n, d, f, true);
    gradient_ready(p + "ffn.w3.weight");
    cpu::rmsnorm_backward(dh, act(a.x_mid), param(p + "ln2.weight"), stat(a.rstd2), dx, grad(p + "ln2.weight"), n, d);
    gradient_ready(p + "ln2.weight");
    // dx is now ∂L/∂x_mid; the attention branch adds to ∂L/∂x_in, which is dx plus the branch.
    cpu::linear_backward(dx, act(a.attn), param(p + "attn.output_proj.weight"), dattn,
                         grad(p + "attn.output_proj.weight"), n, d, d, false);
    gradient_ready(p + "attn.output_proj.weight");
    {
      ScopedRange attention_range("attention.backward");
      attention_backward(heads_view(act(a.q), batch_, seq_, c.heads, hd),
                         heads_view(act(a.k), batch_, seq_, c.heads, hd), heads_view(act(a.v), batch_, seq_, c.heads, hd),
                         heads_view(act(a.attn), batch_, seq_, c.heads, hd),
                         TensorView::contiguous(stat(a.lse), DType::f32, {batch_, c.heads, seq_}),
                         heads_view(dattn, batch_, seq_, c.heads, hd), heads_view(dq, batch_, seq_, c.heads, hd),
                         heads_view(dk, batch_, seq_, c.heads, hd), heads_view(dv, batch_, seq_, c.heads, hd), attn);
    }
    cpu::rope_backward(dq, rope_cos, rope_sin, batch_, seq_, c.heads, hd);
    cpu::rope_backward(dk, rope_cos, rope_sin, batch_, seq_, c.heads, hd);
    cpu::linear_backward(dq, act(a.h1), param(p + "attn.q_proj.weight"), dh, grad(p + "attn.q_proj.weight"), n, d, d,
                         false);
    gradient_ready(p + "attn.q_proj.weight");
    cpu::linear_backward(dk, act(a.h1), param(p + "attn.k_proj.weight"), dh, grad(p + "attn.k_proj.weight"), n, d, d,
                         true);
    gradient_ready(p + "attn.k_proj.weight");
    cpu::linear_backward(dv, act(a.h1), param(p + "attn.v_proj.weight"), dh, grad(p + "attn.v_proj.weight"), n, d, d,
                         true);
    gradient_ready(p + "attn.v_proj.weight");
    cpu::rmsnorm_backward(dh, act(a.x_in), param(p + "ln1.weight"), stat(a.rstd1), dx, grad(p + "ln1.weight"), n, d);
    parameters_done(p);
    gradient_ready(p + "ln1.weight");
  }
  gradients_needed("token_embeddings.");
  cpu::embedding_backward(dx, tokens_, grad("token_embeddings.weight"), n, d);
  gradient_ready("token_embeddings.weight");
  tokens_ = nullptr;  // the logits were overwritten by their gradient
}

void CpuModel::zero_grad() {
  // Sharded storage: FsdpParameters zeroes each gradient buffer as it hands it out.
  if (!options_.external_parameters) std::fill(gradients(), gradients() + n_params_, 0.0f);
}

double CpuModel::gradient_norm() const {
  // Fixed chunks summed in a fixed order: the norm (and so the clipping) is bit-identical from run to
  // run whatever the thread count, which resuming from a checkpoint relies on (and ZeRO-1's sharded norm,
  // whose shards are whole chunks).
  check_own_storage("CpuModel::gradient_norm");
  constexpr int64_t kChunk = kGradientNormChunk;
  const int64_t chunks = (n_params_ + kChunk - 1) / kChunk;
  std::vector<double> partial(size_t(chunks), 0.0);
  const float* g = gradients();
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    partial[size_t(c)] = cpu::sum_squares(g + c * kChunk, std::min(n_params_, (c + 1) * kChunk) - c * kChunk);
  }
  double ss = 0;
  for (double x : partial) ss += x;
  return std::sqrt(ss);
}

double CpuModel::clip_gradients(double max_norm) {
  const double norm = gradient_norm();
  if (max_norm > 0 && norm > max_norm) {
    const float scale = cpu::clip_scale(norm, max_norm);
    float* g = gradients();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n_params_; ++i) g[i] *= scale;
  }
  return norm;
}

void CpuModel::save_state(std::span<float> params, std::span<float> m, std::span<float> v) const {
  check_own_storage("CpuModel::save_state");
  check_state_arrays("CpuModel::save_state", params.size(), m.size(), v.size(), 0);
  std::copy(parameters(), parameters() + n_params_, params.begin());
  if (!adam_m_.data()) {  // no step taken yet: zero moments
    std::fill(m.begin(), m.end(), 0.0f);
    std::fill(v.begin(), v.end(), 0.0f);
    return;
  }
  if (bf16_moments()) {  // widened to fp32 (exactly): the checkpoint format is the same for every state
    std::transform(static_cast<const bf16_t*>(adam_m_.data()), static_cast<const bf16_t*>(adam_m_.data()) + n_params_,
                   m.begin(), [](bf16_t x) { return float(x); });
    std::transform(static_cast<const bf16_t*>(adam_v_.data()), static_cast<const bf16_t*>(adam_v_.data()) + n_params_,
                   v.begin(), [](bf16_t x) { return float(x); });
    return;
  }
  std::copy_n(static_cast<const float*>(adam_m_.data()), n_params_, m.begin());
  std::copy_n(static_cast<const float*>(adam_v_.data()), n_params_, v.begin());
}

void CpuModel::load_state(std::span<const float> params, std::span<const float> m, std::span<const float> v,
                          int64_t optimizer_steps) {
  check_own_storage("CpuModel::load_state");
  check_state_arrays("CpuModel::load_state", params.size(), m.size(), v.size(), optimizer_steps);
  if (bf16_moments()) check_bf16_moments("CpuModel::load_state", m, v);
  allocate_moments();
  std::copy(params.begin(), params.end(), parameters());
  if (bf16_moments()) {
    const auto narrow = [](float x) { return bf16_t(x); };
    std::transform(m.begin(), m.end(), static_cast<bf16_t*>(adam_m_.data()), narrow);
    std::transform(v.begin(), v.end(), static_cast<bf16_t*>(adam_v_.data()), narrow);
  } else {
    std::copy(m.begin(), m.end(), static_cast<float*>(adam_m_.data()));
    std::copy(v.begin(), v.end(), static_cast<float*>(adam_v_.data()));
  }
  adam_step_ = optimizer_steps;
}

void CpuModel::adamw_step(const AdamWConfig& c, double lr) {
  memory_set_phase("optimizer");
  ScopedRange range("optimizer_step");
  check_own_storage("CpuModel::adamw_step");
  allocate_moments();
  ++adam_step_;
  if (bf16_moments()) {
    const MomentRounding rounding{options_.optimizer_state == OptimizerState::bf16_sr, options_.moment_rounding_seed};
    cpu::adamw_step_bf16_moments(parameters(), gradients(), static_cast<bf16_t*>(adam_m_.data()),
                                 static_cast<bf16_t*>(adam_v_.data()), n_params_, lr, c.beta1, c.beta2, c.eps,
                                 c.weight_decay, adam_step_, rounding);
    return;
  }
  cpu::adamw_step(parameters(), gradients(), static_cast<float*>(adam_m_.data()), static_cast<float*>(adam_v_.data()),
                  n_params_, lr, c.beta1, c.beta2, c.eps, c.weight_decay, adam_step_);
}

}  // namespace flashlm
