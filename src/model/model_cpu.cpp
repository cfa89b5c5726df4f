// The LM on the CPU: the whole training step reads top to bottom — forward, backward, AdamW.
#include <cmath>
#include <algorithm>
#include <cstring>
#include <random>
#include <span>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "flashlm/model.h"
#include "flashlm/profile.h"
#include "model/activations.h"
#include "model/fp8.h"
#include "model/lm_head.h"
#include "model/ops_cpu.h"
#include "optim/adamw_state.h"
#include "optim/optimizer.h"

namespace flashlm {

struct CpuModel::Impl {
  const CpuModel& model;  // for its size and its parameter_storage() table
  int64_t batch, seq;
  ModelOptions options;
  // acts: the activation values (ActivationLayout's), then the logits of one LM-head chunk [head_chunk,
  // vocab]; stats: its fp32 statistics (RMSNorm 1/rms, attention logsumexp); rope: the RoPE tables
  // [context, head_dim / 2] (cos, then sin).
  Buffer params, grads, acts, stats, scratch, rope;
  // --precision fp8 (emulated): one block's linear weights rounded through e4m3, then a linear layer's input
  // and output gradient rounded (fp8_emulation_elements); empty otherwise.
  Buffer fp8;
  ActivationLayout acts_layout;
  int64_t logits_offset = 0;
  // Tokens per chunk of the fused LM head + loss (head_chunk_tokens). When it covers every token the
  // forward's logits stay in the chunk buffer and the backward turns them into their gradient, as the
  // unfused head did; otherwise the backward recomputes each chunk's logits (one more head GEMM) and the
  // [n, vocab] logits never exist.
  int64_t head_chunk = 0;
  int64_t materialized_segment = -1;  // the segment whose blocks the working set holds
  const int32_t* tokens = nullptr;
  const int32_t* targets = nullptr;

  Impl(const CpuModel& model, int64_t batch, int64_t seq, const ModelOptions& options)
      : model(model), batch(batch), seq(seq), options(options) {}
  float* param(const std::string& name) const { return model.stored(name).master; }
  float* grad(const std::string& name) const { return model.stored(name).grad; }
  float* act(int64_t offset) const { return static_cast<float*>(acts.data()) + offset; }
  float* stat(int64_t offset) const { return static_cast<float*>(stats.data()) + offset; }
  const float* rope_cos() const { return static_cast<const float*>(rope.data()); }
  const float* rope_sin() const { return rope_cos() + model.config().context * (model.config().head_dim() / 2); }
  // --precision fp8 (emulated, ModelOptions::fp8): the operands of block p's linear layers rounded through FP8
  // as the CUDA model's FP8 GEMMs take them (q, k and v as one [3d, d] weight and one [n, 3d] output
  // gradient), tensorwise or rowwise (ModelOptions::fp8_recipe). Without fp8 each returns its argument.
  float* fp8_region(int64_t offset) const { return static_cast<float*>(fp8.data()) + offset; }
  int64_t fp8_weight_numel(std::string_view name) const {
    const ModelConfig& c = model.config();
    return c.d_model * (name.starts_with("attn.") ? c.d_model : c.d_ff);
  }
  // A block weight's [out, in].
  std::pair<int64_t, int64_t> fp8_weight_shape(std::string_view name) const {
    const ModelConfig& c = model.config();
    if (name.starts_with("attn.")) return {c.d_model, c.d_model};
    return name == "ffn.w2.weight" ? std::pair{c.d_model, c.d_ff} : std::pair{c.d_ff, c.d_model};
  }
  int64_t fp8_weight_offset(std::string_view name) const {
    int64_t offset = 0;
    for (std::string_view w : kFp8BlockWeights) {
      if (w == name) return offset;
      offset += fp8_weight_numel(w);
    }
    fail("CpuModel: '{}' is not a block's linear weight", name);
  }
  bool rowwise() const { return options.fp8 && options.fp8_recipe == Fp8Recipe::rowwise; }
  // Which products the rounded weights are for: rowwise rounds w per output channel (its rows) for the
  // forward and per input column for the backward's dx; tensorwise rounds them the same for both.
  enum class WeightUse { forward, backward };
  // Block p's weights rounded (e4m3) into the fp8 buffer: at each forward and backward of the block, after
  // parameters_needed (FSDP gathers them then). q, k and v as the CUDA model's fused [3d, d] weight: one
  // amax tensorwise, one per input column (over all 3d rows) rowwise; their rows are their own.
  void round_block_weights(const std::string& p, WeightUse use) const {
    if (!options.fp8) return;
    if (decode_gathered_weights(p)) return;
    const auto weight = [&](std::string_view w) { return param(p + std::string(w)); };
    const std::span<const std::string_view> qkv(kFp8BlockWeights, kFp8SharedScaleWeights);
    if (rowwise()) {
      const ModelConfig& c = model.config();
      std::vector<float> amax(size_t(std::max(c.d_model, c.d_ff))), qkv_cols(size_t(c.d_model), 0.0f);
      if (use == WeightUse::backward) {
        for (std::string_view w : qkv) {
          fp8_amax_rows_cols_cpu(weight(w), c.d_model, c.d_model, nullptr, amax.data());
          for (int64_t j = 0; j < c.d_model; ++j) qkv_cols[size_t(j)] = fp8_amax_max(qkv_cols[size_t(j)], amax[size_t(j)]);
        }
      }
      for (size_t i = 0; i < std::size(kFp8BlockWeights); ++i) {
        const std::string_view w = kFp8BlockWeights[i];
        const auto [out, in] = fp8_weight_shape(w);
        float* rounded = fp8_region(fp8_weight_offset(w));
        if (use == WeightUse::forward) {
          fp8_amax_rows_cols_cpu(weight(w), out, in, amax.data(), nullptr);
          fp8_round_trip_rows_cpu(weight(w), out, in, amax.data(), Fp8Format::e4m3, rounded);
        } else {
          if (i >= qkv.size()) fp8_amax_rows_cols_cpu(weight(w), out, in, nullptr, amax.data());
          fp8_round_trip_cols_cpu(weight(w), out, in, i < qkv.size() ? qkv_cols.data() : amax.data(), Fp8Format::e4m3,
                                  rounded);
        }
      }
      return;
    }
    float qkv_amax = 0.0f;
    for (std::string_view w : qkv) qkv_amax = fp8_amax_max(qkv_amax, fp8_amax_cpu(weight(w), fp8_weight_numel(w)));
    for (size_t i = 0; i < std::size(kFp8BlockWeights); ++i) {
      const std::string_view w = kFp8BlockWeights[i];
      const int64_t count = fp8_weight_numel(w);
      const float amax = i < qkv.size() ? qkv_amax : fp8_amax_cpu(weight(w), count);
      fp8_round_trip_cpu(weight(w), count, amax, Fp8Format::e4m3, fp8_region(fp8_weight_offset(w)));
    }
  }
  // FSDP's FP8 gather (ModelOptions::fsdp_fp8_gather) brought block p's linear weights as e4m3 bytes, each
  // with its scale group's dequantisation scale (q, k and v one group): decoded, they are the values the
  // rounding above gives from the whole fp32 weights, bit for bit — the same amax over the same elements,
  // so the same scale, and an elementwise encoding (dist/fp8_gather.h). False where they came otherwise
  // (one rank, full storage, no FSDP): then round them here.
  bool decode_gathered_weights(const std::string& p) const {
    const ParameterStorage& first = model.stored(p + std::string(kFp8BlockWeights[0]));
    for (std::string_view w : kFp8BlockWeights) {
      const ParameterStorage& t = model.stored(p + std::string(w));
      FLASHLM_CHECK((t.fp8_scales != nullptr) == (first.fp8_scales != nullptr),
                    "CpuModel: '{}{}' and '{}{}' arrived one in FP8 and one not: a layer's FP8 weights are gathered "
                    "alike", p, w, p, kFp8BlockWeights[0]);
      if (!t.fp8_scales) continue;
      FLASHLM_CHECK(!rowwise(), "CpuModel: '{}{}' arrived as tensorwise FP8 bytes, and this model scales rowwise", p, w);
      fp8_dequantize_cpu(static_cast<const uint8_t*>(t.weight), fp8_weight_numel(w), t.fp8_scales[kFp8DequantIndex],
                         Fp8Format::e4m3, fp8_region(fp8_weight_offset(w)));
    }
    return first.fp8_scales != nullptr;
  }
  // The weight a linear layer of block p multiplies by.
  const float* linear_weight(const std::string& p, std::string_view name) const {
    return options.fp8 ? fp8_region(fp8_weight_offset(name)) : param(p + std::string(name));
  }
  // x [rows, cols] as a linear layer's input in the forward (and tensorwise in the backward): rounded (e4m3,
  // rowwise per token) into the input region (after the weights), or x itself.
  float* input_region() const { return fp8_region(fp8_emulation_elements(model.config(), 0)); }
  const float* linear_input(const float* x, int64_t rows, int64_t cols) const {
    if (!options.fp8) return x;
    float* out = input_region();
    if (rowwise()) {
      std::vector<float> amax(static_cast<size_t>(rows));
      fp8_amax_rows_cols_cpu(x, rows, cols, amax.data(), nullptr);
      fp8_round_trip_rows_cpu(x, rows, cols, amax.data(), Fp8Format::e4m3, out);
    } else {
      fp8_round_trip_cpu(x, rows * cols, fp8_amax_cpu(x, rows * cols), Fp8Format::e4m3, out);
    }
    return out;
  }
  // An output gradient: rounded in the gradient format into the gradient region (in place where it is
  // scratch nothing else reads: in_place).
  const float* output_gradient(float* dy, int64_t count, bool in_place) const {
    if (!options.fp8) return dy;
    const ModelConfig& c = model.config();
    const int64_t n = batch * seq;
    float* out = in_place ? dy : fp8_region(fp8_emulation_elements(c, 0) + n * std::max(c.d_model, c.d_ff));
    fp8_round_trip_cpu(dy, count, fp8_amax_cpu(dy, count), options.fp8_gradients, out);
    return out;
  }

  // A linear layer's backward, cpu::linear_backward's, on its operands as the FP8 GEMMs take them: dy [n, out]
  // (rounded in place when in_place: scratch nothing else reads), x [n, in], w as round_block_weights left it
  // for the backward.
  void linear_backward(float* dy, bool in_place, const float* x, const float* w, float* dx, float* dw, int64_t in,
                       int64_t out, bool accumulate_dx) const {
    const int64_t n = batch * seq;
    if (rowwise()) return linear_backward_rowwise(dy, in_place, nullptr, x, w, dx, dw, in, out, accumulate_dx);
    cpu::linear_backward(output_gradient(dy, n * out, in_place), linear_input(x, n, in), w, dx, dw, n, in, out,
                         accumulate_dx);
  }
  // Rowwise: dw from dy and x rounded per column (output channel, input column) into the gradient and input
  // regions, then dx from dy rounded per token — by its own amaxes, or by dy_row_amax[n] (q, k and v's
  // gradients joined, as the CUDA model's one [n, 3d] dy) — in place or into the gradient region.
  void linear_backward_rowwise(float* dy, bool in_place, const float* dy_row_amax, const float* x, const float* w,
                               float* dx, float* dw, int64_t in, int64_t out, bool accumulate_dx) const {
    const ModelConfig& c = model.config();
    const int64_t n = batch * seq;
    float* input = input_region();
    float* gradient = input + n * std::max(c.d_model, c.d_ff);
    std::vector<float> amax(size_t(std::max({n, in, out})));
    fp8_amax_rows_cols_cpu(dy, n, out, nullptr, amax.data());
    fp8_round_trip_cols_cpu(dy, n, out, amax.data(), options.fp8_gradients, gradient);
    fp8_amax_rows_cols_cpu(x, n, in, nullptr, amax.data());
    fp8_round_trip_cols_cpu(x, n, in, amax.data(), Fp8Format::e4m3, input);
    cpu::linear_backward(gradient, input, nullptr, nullptr, dw, n, in, out, false);
    if (!dy_row_amax) {
      fp8_amax_rows_cols_cpu(dy, n, out, amax.data(), nullptr);
      dy_row_amax = amax.data();
    }
    float* dy_rows = in_place ? dy : gradient;
    fp8_round_trip_rows_cpu(dy, n, out, dy_row_amax, options.fp8_gradients, dy_rows);
    cpu::linear_backward(dy_rows, nullptr, w, dx, nullptr, n, in, out, accumulate_dx);
  }

  // The attention call of every layer (causal).
  AttentionOptions attention_options() const {
    AttentionOptions attn;
    attn.impl = options.attention;
    attn.causal = true;
    return attn;
  }
};

CpuModel::CpuModel(const ModelConfig& config, int64_t batch, int64_t seq, AttentionImpl attention)
    : CpuModel(config, batch, seq, ModelOptions::with_attention(attention)) {}

CpuModel::CpuModel(const ModelConfig& config, int64_t batch, int64_t seq, const ModelOptions& options)
    : LanguageModel(config, Device::cpu, DType::f32, options), impl_(std::make_unique<Impl>(*this, batch, seq, options)) {
  Impl& s = *impl_;
  FLASHLM_CHECK(batch >= 1, "CpuModel: batch = {}, expected at least 1", batch);
  FLASHLM_CHECK(seq >= 1 && seq <= config.context, "CpuModel: seq = {} outside [1, context = {}]", seq,
                config.context);
  FLASHLM_CHECK(!options.bf16_pure, "CpuModel: the CPU engine runs fp32, not bf16-pure");
  options.check_fp8(DType::f32, Device::cpu);  // fp8: emulated over fp32
  options.check_optimizer_state();
  options.check_grad_dtype(DType::f32, Device::cpu);
  init_optimizer_state(options.optimizer_state);
  const size_t pbytes = size_t(parameter_count()) * sizeof(float);
  // FSDP's sharded storage holds them instead (ModelOptions::external_parameters).
  if (!options.external_parameters) {
    s.params = Buffer::allocate(pbytes, Device::cpu, "parameters");
    s.grads = Buffer::allocate(pbytes, Device::cpu, "gradients");
  }
  point_storage_at(parameters(), nullptr, DType::f32, gradients());
  s.acts_layout = layout_activations(config, batch, seq, options.recompute);
  const int64_t n = batch * seq;  // checked by layout_activations
  constexpr std::string_view bytes = "CpuModel: activation bytes";
  constexpr int64_t kFloat = sizeof(float);
  s.logits_offset = s.acts_layout.values;
  s.head_chunk = head_chunk_tokens(config, n, options.head_chunk, kFloat);
  const int64_t values =
      checked_add(s.logits_offset, checked_mul(s.head_chunk, config.vocab, "CpuModel: head chunk x vocab"), bytes);
  s.acts = Buffer::allocate(size_t(checked_mul(values, kFloat, bytes)), Device::cpu,
                            "activations and the logits of one LM-head chunk");
  s.stats = Buffer::allocate(size_t(checked_mul(s.acts_layout.stats, kFloat, bytes)), Device::cpu,
                            "activations (statistics)");
  s.scratch = Buffer::allocate(size_t(checked_mul(backward_scratch_elements(config, n), kFloat, bytes)), Device::cpu,
                              "backward scratch");
  if (options.fp8) {
    s.fp8 = Buffer::allocate(size_t(checked_mul(fp8_emulation_elements(config, n, options.fp8_recipe), kFloat, bytes)),
                             Device::cpu,
                             "FP8 emulation: rounded weights and operands");
  }
  const int64_t half = config.head_dim() / 2;
  s.rope = Buffer::allocate(size_t(checked_product({2, config.context, half, kFloat}, "CpuModel: RoPE table bytes")),
                           Device::cpu, "RoPE tables");
  float* rope = static_cast<float*>(s.rope.data());
  cpu::rope_tables(rope, rope + config.context * half, config.context, config.head_dim(), config.rope_theta);
  if (!options.external_parameters) std::fill(parameters(), parameters() + parameter_count(), 0.0f);
  zero_grad();
}

CpuModel::~CpuModel() = default;

float* CpuModel::parameters() const { return static_cast<float*>(impl_->params.data()); }
float* CpuModel::gradients() const { return static_cast<float*>(impl_->grads.data()); }
size_t CpuModel::activation_bytes() const { return impl_->acts.bytes() + impl_->stats.bytes(); }
const RecomputePlan& CpuModel::recompute() const { return impl_->options.recompute; }

void CpuModel::release_optimizer_state() { adamw().release(); }

void CpuModel::check_own_storage(std::string_view caller) const {
  FLASHLM_CHECK(!external_parameters(),
                "{}: this model keeps no flat parameters of its own (FSDP's sharded storage: use DdpModel's)", caller);
}

void CpuModel::init_parameters(uint64_t seed) {
  check_own_storage("CpuModel::init_parameters");
  init_parameters_host(layout(), parameters(), seed);
}

int64_t CpuModel::head_chunk() const { return impl_->head_chunk; }

void CpuModel::copy_logits_to(float* out) const {
  const Impl& s = *impl_;
  FLASHLM_CHECK(s.tokens != nullptr, "copy_logits_to: call forward() first (and not backward() since)");
  const int64_t n = s.batch * s.seq, d = config().d_model, V = config().vocab;
  const float* h = s.act(s.acts_layout.h_f);
  // Recomputed from the final norm's output in the forward's chunks: the same products on the same rows,
  // so the same values the loss was computed from.
  parameters_needed("lm_head.");
  for (int64_t r0 = 0; r0 < n; r0 += s.head_chunk) {
    cpu::linear_forward(h + r0 * d, s.param("lm_head.weight"), out + r0 * V, std::min(s.head_chunk, n - r0), d, V);
  }
  parameters_done("lm_head.");
}

namespace {

// [batch, seq, heads, head_dim] view of a contiguous [batch * seq, d_model] array.
TensorView heads_view(float* data, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim) {
  return TensorView::contiguous(data, DType::f32, {batch, seq, heads, head_dim});
}

}  // namespace

double CpuModel::forward(const int32_t* tokens, const int32_t* targets) {
  Impl& s = *impl_;
  const ModelConfig& c = config();
  const int64_t n = s.batch * s.seq, d = c.d_model;
  for (int64_t i = 0; i < n; ++i) {
    FLASHLM_CHECK(tokens[i] >= 0 && tokens[i] < c.vocab, "forward: tokens[{}] = {} outside [0, vocab = {})", i,
                  tokens[i], c.vocab);
    FLASHLM_CHECK(targets[i] >= 0 && targets[i] < c.vocab, "forward: targets[{}] = {} outside [0, vocab = {})", i,
                  targets[i], c.vocab);
  }
  s.tokens = tokens;
  s.targets = targets;
  memory_set_phase("forward");
  ScopedRange range("forward");
  const ActivationLayout& A = s.acts_layout;
  parameters_needed("token_embeddings.");
  cpu::embedding_forward(s.param("token_embeddings.weight"), tokens, s.act(A.blocks[0].x_in), n, d);
  parameters_done("token_embeddings.");
  for (int64_t l = 0; l < c.layers; ++l) forward_block(l, BlockPass::full);
  // The working set now holds the last segment's blocks: the backward starts without recomputing them.
  s.materialized_segment = A.blocks.back().segment;
  parameters_needed("ln_final.");
  cpu::rmsnorm_forward(s.act(A.x_out), s.param("ln_final.weight"), s.act(A.h_f), s.stat(A.rstd_f), n, d, float(c.norm_eps));
  parameters_done("ln_final.");
  parameters_needed("lm_head.");
  // The loss alone, a chunk of tokens at a time; with one chunk its logits stay for the backward.
  const double loss = cpu::lm_head_loss_forward_backward(s.act(A.h_f), s.param("lm_head.weight"), targets, n, d,
                                                         c.vocab, s.head_chunk, 1.0f, nullptr, nullptr,
                                                         s.act(s.logits_offset));
  parameters_done("lm_head.");
  return loss;
}

void CpuModel::forward_block(int64_t l, BlockPass pass) {
  Impl& s = *impl_;
  const ModelConfig& c = config();
  const int64_t n = s.batch * s.seq, d = c.d_model, f = c.d_ff, hd = c.head_dim();
  const ActivationLayout& A = s.acts_layout;
  const BlockActivations& a = A.blocks[size_t(l)];
  const std::string p = fmt::format("layers.{}.", l);
  ScopedRange layer_range(pass == BlockPass::full ? "layer.forward" : "layer.recompute");
  parameters_needed(p);
  const float* rope_cos = s.rope_cos();
  const float* rope_sin = s.rope_sin();
  s.round_block_weights(p, Impl::WeightUse::forward);  // --precision fp8: the linear layers' operands rounded (Impl)
  cpu::rmsnorm_forward(s.act(a.x_in), s.param(p + "ln1.weight"), s.act(a.h1), s.stat(a.rstd1), n, d, float(c.norm_eps));
  const float* h1 = s.linear_input(s.act(a.h1), n, d);
  cpu::linear_forward(h1, s.linear_weight(p, "attn.q_proj.weight"), s.act(a.q), n, d, d);
  cpu::linear_forward(h1, s.linear_weight(p, "attn.k_proj.weight"), s.act(a.k), n, d, d);
  cpu::linear_forward(h1, s.linear_weight(p, "attn.v_proj.weight"), s.act(a.v), n, d, d);
  cpu::rope_forward(s.act(a.q), rope_cos, rope_sin, s.batch, s.seq, c.heads, hd);
  cpu::rope_forward(s.act(a.k), rope_cos, rope_sin, s.batch, s.seq, c.heads, hd);
  if (pass != BlockPass::without_attention) {
    ScopedRange attention_range("attention.forward");
    attention_forward(heads_view(s.act(a.q), s.batch, s.seq, c.heads, hd), heads_view(s.act(a.k), s.batch, s.seq, c.heads, hd),
                      heads_view(s.act(a.v), s.batch, s.seq, c.heads, hd), heads_view(s.act(a.attn), s.batch, s.seq, c.heads, hd),
                      TensorView::contiguous(s.stat(a.lse), DType::f32, {s.batch, c.heads, s.seq}), s.attention_options());
  }
  float* x_mid = s.act(a.x_mid);
  cpu::linear_forward(s.linear_input(s.act(a.attn), n, d), s.linear_weight(p, "attn.output_proj.weight"), x_mid, n, d,
                      d);
  for (int64_t i = 0; i < n * d; ++i) x_mid[i] += s.act(a.x_in)[i];
  cpu::rmsnorm_forward(x_mid, s.param(p + "ln2.weight"), s.act(a.h2), s.stat(a.rstd2), n, d, float(c.norm_eps));
  const float* h2 = s.linear_input(s.act(a.h2), n, d);
  cpu::linear_forward(h2, s.linear_weight(p, "ffn.w1.weight"), s.act(a.u), n, d, f);
  cpu::linear_forward(h2, s.linear_weight(p, "ffn.w3.weight"), s.act(a.g), n, d, f);
  cpu::swiglu_forward(s.act(a.u), s.act(a.g), s.act(a.s), n * f);
  if (pass == BlockPass::full) {  // a recomputation needs only what the block computed inside
    // The residual stream leaves into the next block's input (or x_out).
    float* x_out = s.act(l + 1 < c.layers ? A.blocks[size_t(l + 1)].x_in : A.x_out);
    cpu::linear_forward(s.linear_input(s.act(a.s), n, f), s.linear_weight(p, "ffn.w2.weight"), x_out, n, f, d);
    for (int64_t i = 0; i < n * d; ++i) x_out[i] += x_mid[i];
  }
  parameters_done(p);
}

void CpuModel::backward() {
  Impl& s = *impl_;
  FLASHLM_CHECK(s.tokens != nullptr, "backward: call forward() first");
  const ModelConfig& c = config();
  const int64_t n = s.batch * s.seq, d = c.d_model, f = c.d_ff, hd = c.head_dim();
  const ActivationLayout& A = s.acts_layout;
  const float* rope_cos = s.rope_cos();
  const float* rope_sin = s.rope_sin();
  const AttentionOptions attn = s.attention_options();

  memory_set_phase("backward");
  ScopedRange range("backward");
  float* s0 = static_cast<float*>(s.scratch.data());
  float *dx = s0, *dh = s0 + n * d, *dq = s0 + 2 * n * d, *dk = s0 + 3 * n * d, *dv = s0 + 4 * n * d,
        *dattn = s0 + 5 * n * d;
  float *du = s0 + 6 * n * d, *dg = du + n * f, *ds = dg + n * f;

  float* logits = s.act(s.logits_offset);
  parameters_needed("lm_head.");
  gradients_needed("lm_head.");
  if (s.head_chunk >= n) {
    // One chunk: the forward's logits are still there; they become their gradient in place.
    cpu::cross_entropy_backward(logits, s.targets, n, c.vocab);
    cpu::linear_backward(logits, s.act(A.h_f), s.param("lm_head.weight"), dh, s.grad("lm_head.weight"), n, d, c.vocab,
                         false);
  } else {
    // Chunk by chunk: each chunk's logits recomputed, turned into their gradient (the mean loss's: 1/n,
    // as cross_entropy_backward scales it), then dh for the chunk's rows and the head's gradient.
    cpu::lm_head_loss_forward_backward(s.act(A.h_f), s.param("lm_head.weight"), s.targets, n, d, c.vocab,
                                       s.head_chunk, 1.0f / float(n), dh, s.grad("lm_head.weight"), logits);
  }
  parameters_done("lm_head.");
  gradient_ready("lm_head.weight");
  std::fill(dx, dx + n * d, 0.0f);
  parameters_needed("ln_final.");
  gradients_needed("ln_final.");
  cpu::rmsnorm_backward(dh, s.act(A.x_out), s.param("ln_final.weight"), s.stat(A.rstd_f), dx, s.grad("ln_final.weight"), n,
                        d);
  parameters_done("ln_final.");
  gradient_ready("ln_final.weight");

  for (int64_t l = c.layers - 1; l >= 0; --l) {
    const BlockActivations& a = A.blocks[size_t(l)];
    if (a.segment >= 0 && a.segment != s.materialized_segment) {
      // Recompute the segment from its kept input; its last block (this one) stops before its output.
      for (int64_t j = a.segment; j < l; ++j) forward_block(j, BlockPass::full);
      forward_block(l, A.recompute.kind == RecomputePlan::Kind::selective ? BlockPass::without_attention
                                                                          : BlockPass::without_output);
      s.materialized_segment = a.segment;
    }
    const std::string p = fmt::format("layers.{}.", l);
    ScopedRange layer_range("layer.backward");
    parameters_needed(p);
    gradients_needed(p);
    s.round_block_weights(p, Impl::WeightUse::backward);  // --precision fp8: and the output gradients rounded too
    // dx holds ∂L/∂(layer output) = ∂L/∂x_mid through the residual, plus the FFN branch below.
    s.linear_backward(dx, false, s.act(a.s), s.linear_weight(p, "ffn.w2.weight"), ds, s.grad(p + "ffn.w2.weight"), f, d,
                      false);
    gradient_ready(p + "ffn.w2.weight");
    cpu::swiglu_backward(ds, s.act(a.u), s.act(a.g), du, dg, n * f);
    s.linear_backward(du, true, s.act(a.h2), s.linear_weight(p, "ffn.w1.weight"), dh, s.grad(p + "ffn.w1.weight"), d, f,
                      false);
    gradient_ready(p + "ffn.w1.weight");
    s.linear_backward(dg, true, s.act(a.h2), s.linear_weight(p, "ffn.w3.weight"), dh, s.grad(p + "ffn.w3.weight"), d, f,
                      true);
    gradient_ready(p + "ffn.w3.weight");
    cpu::rmsnorm_backward(dh, s.act(a.x_mid), s.param(p + "ln2.weight"), s.stat(a.rstd2), dx, s.grad(p + "ln2.weight"), n, d);
    gradient_ready(p + "ln2.weight");
    // dx is now ∂L/∂x_mid; the attention branch adds to ∂L/∂x_in, which is dx plus the branch.
    s.linear_backward(dx, false, s.act(a.attn), s.linear_weight(p, "attn.output_proj.weight"), dattn,
                      s.grad(p + "attn.output_proj.weight"), d, d, false);
    gradient_ready(p + "attn.output_proj.weight");
    {
      ScopedRange attention_range("attention.backward");
      attention_backward(heads_view(s.act(a.q), s.batch, s.seq, c.heads, hd),
                         heads_view(s.act(a.k), s.batch, s.seq, c.heads, hd), heads_view(s.act(a.v), s.batch, s.seq, c.heads, hd),
                         heads_view(s.act(a.attn), s.batch, s.seq, c.heads, hd),
                         TensorView::contiguous(s.stat(a.lse), DType::f32, {s.batch, c.heads, s.seq}),
                         heads_view(dattn, s.batch, s.seq, c.heads, hd), heads_view(dq, s.batch, s.seq, c.heads, hd),
                         heads_view(dk, s.batch, s.seq, c.heads, hd), heads_view(dv, s.batch, s.seq, c.heads, hd), attn);
    }
    cpu::rope_backward(dq, rope_cos, rope_sin, s.batch, s.seq, c.heads, hd);
    cpu::rope_backward(dk, rope_cos, rope_sin, s.batch, s.seq, c.heads, hd);
    const std::pair<float*, const char*> qkv[] = {
        {dq, "attn.q_proj.weight"}, {dk, "attn.k_proj.weight"}, {dv, "attn.v_proj.weight"}};
    if (s.rowwise()) {
      // dq, dk, dv as one [n, 3d] gradient: dx's product scales each token by its amax over all three.
      std::vector<float> token_amax(size_t(n), 0.0f), amax(static_cast<size_t>(n));
      for (const auto& [g, w] : qkv) {
        fp8_amax_rows_cols_cpu(g, n, d, amax.data(), nullptr);
        for (int64_t r = 0; r < n; ++r) token_amax[size_t(r)] = fp8_amax_max(token_amax[size_t(r)], amax[size_t(r)]);
      }
      for (const auto& [g, w] : qkv) {
        s.linear_backward_rowwise(g, true, token_amax.data(), s.act(a.h1), s.linear_weight(p, w), dh,
                                  s.grad(p + w), d, d, g != dq);
        gradient_ready(p + w);
      }
    } else {
      if (s.options.fp8) {  // dq, dk, dv rounded as one [n, 3d] gradient, in place (scratch)
        const float amax = fp8_amax_max(fp8_amax_max(fp8_amax_cpu(dq, n * d), fp8_amax_cpu(dk, n * d)),
                                        fp8_amax_cpu(dv, n * d));
        for (float* g : {dq, dk, dv}) fp8_round_trip_cpu(g, n * d, amax, s.options.fp8_gradients, g);
      }
      const float* h1 = s.linear_input(s.act(a.h1), n, d);
      for (const auto& [g, w] : qkv) {
        cpu::linear_backward(g, h1, s.linear_weight(p, w), dh, s.grad(p + w), n, d, d, g != dq);
        gradient_ready(p + w);
      }
    }
    cpu::rmsnorm_backward(dh, s.act(a.x_in), s.param(p + "ln1.weight"), s.stat(a.rstd1), dx, s.grad(p + "ln1.weight"), n, d);
    parameters_done(p);
    gradient_ready(p + "ln1.weight");
  }
  gradients_needed("token_embeddings.");
  cpu::embedding_backward(dx, s.tokens, s.grad("token_embeddings.weight"), n, d);
  gradient_ready("token_embeddings.weight");
  s.tokens = nullptr;  // the logits chunk was overwritten by a gradient; the working set may be recomputed
}

void CpuModel::zero_grad() {
  // Sharded storage: FsdpParameters zeroes each gradient buffer as it hands it out.
  if (!external_parameters()) std::fill(gradients(), gradients() + parameter_count(), 0.0f);
}

double CpuModel::gradient_norm() const {
  // Fixed chunks summed in a fixed order: the norm (and so the clipping) is bit-identical from run to
  // run whatever the thread count, which resuming from a checkpoint relies on (and ZeRO-1's sharded norm,
  // whose shards are whole chunks).
  check_own_storage("CpuModel::gradient_norm");
  constexpr int64_t kChunk = kGradientNormChunk;
  const int64_t n = parameter_count();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(size_t(chunks), 0.0);
  const float* g = gradients();
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    partial[size_t(c)] = cpu::sum_squares(g + c * kChunk, std::min(n, (c + 1) * kChunk) - c * kChunk);
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
    const int64_t n = parameter_count();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) g[i] *= scale;
  }
  return norm;
}

void CpuModel::save_state(std::span<float> params, std::span<float> m, std::span<float> v) const {
  check_own_storage("CpuModel::save_state");
  check_state_arrays("CpuModel::save_state", params.size(), m.size(), v.size(), 0);
  std::copy(parameters(), parameters() + parameter_count(), params.begin());
  adamw().save(m, v);
}

void CpuModel::load_state(std::span<const float> params, std::span<const float> m, std::span<const float> v,
                          int64_t optimizer_steps) {
  check_own_storage("CpuModel::load_state");
  check_state_arrays("CpuModel::load_state", params.size(), m.size(), v.size(), optimizer_steps);
  if (adamw().bf16()) check_bf16_moments("CpuModel::load_state", m, v);
  adamw().allocate();
  std::copy(params.begin(), params.end(), parameters());
  adamw().load(m, v);
  adamw().set_steps(optimizer_steps);
}

void CpuModel::adamw_step(const AdamWConfig& c, double lr) {
  memory_set_phase("optimizer");
  ScopedRange range("optimizer_step");
  check_own_storage("CpuModel::adamw_step");
  AdamWState& state = adamw();
  state.allocate();
  const int64_t step = state.begin_step();
  const int64_t n = parameter_count();
  if (state.bf16()) {
    cpu::adamw_step_bf16_moments(parameters(), gradients(), state.m_as<bf16_t>(), state.v_as<bf16_t>(), n, lr,
                                 c.beta1, c.beta2, c.eps, c.weight_decay, step,
                                 state.rounding(impl_->options.moment_rounding_seed));
    return;
  }
  cpu::adamw_step(parameters(), gradients(), state.m_as<float>(), state.v_as<float>(), n, lr, c.beta1, c.beta2, c.eps,
                  c.weight_decay, step);
}

}  // namespace flashlm
