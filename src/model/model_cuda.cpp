// The LM on one GPU, step by step as model_cpu.cpp, with mixed precision: activations in T (fp32, bf16,
// fp16), everything that accumulates across steps in fp32. Host code: the layer kernels are in model/cuda/
// (ops_cuda.h), AdamW in optim/, the GEMMs in gemm_cuda.cpp, attention in attention/cuda/.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/array_ops.h"
#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/model.h"
#include "flashlm/profile.h"
#include "model/gemm_cuda.h"
#include "model/ops_cpu.h"
#include "model/ops_cuda.h"
#include "optim/optimizer.h"

namespace flashlm {

namespace {

constexpr double kInitialLossScale = 65536.0;
constexpr int64_t kLossScaleGrowthInterval = 2000;

// Sub-arrays carved from one allocation start on 64-element boundaries: 16-byte aligned for the
// tensor-core loads of attention and cuBLASLt whatever the element type.
int64_t aligned(int64_t elements) { return (elements + 63) / 64 * 64; }

}  // namespace

struct CudaModel::Impl {
  ModelConfig c;
  int64_t batch, seq, n;
  DType precision;
  AttentionImpl attention;
  void* stream;
  std::vector<ParameterInfo> layout;
  int64_t n_params;
  Buffer params, grads, adam_m, adam_v, params_lp;  // params_lp: the weights in `precision` (not for fp32)
  Buffer acts, acts_f32, scratch, tokens, targets, rope, reduce_out;
  int64_t adam_step = 0;
  double loss_scale = 1.0;
  int64_t good_steps = 0;
  // The clipping factor clip_gradients() chose and has not applied yet: adamw_step() applies it inside its
  // kernel (saving a read and a write of every gradient); any other reader of the gradients applies it
  // first (apply_pending_clip). Mutable: const readers (copies, norms) materialise it too.
  mutable float pending_clip = 1.0f;
  // The AdamW moments are allocated (zeroed) by the first adamw_step() or load_state(), as PyTorch's
  // optimizers do: a model that only runs forward, or whose optimizer state lives elsewhere (ZeRO-1's
  // shards), never holds them.
  void allocate_moments() {
    if (adam_m.data()) return;
    const size_t pbytes = size_t(n_params) * sizeof(float);
    adam_m = Buffer::allocate(pbytes, Device::cuda, "AdamW first moment");
    adam_v = Buffer::allocate(pbytes, Device::cuda, "AdamW second moment");
    gpu::memset_async(adam_m.data(), 0, pbytes, stream);
    gpu::memset_async(adam_v.data(), 0, pbytes, stream);
  }
  void apply_pending_clip() const {
    if (pending_clip == 1.0f) return;
    gpu::scale_inplace(static_cast<float*>(grads.data()), n_params, pending_clip, stream);
    pending_clip = 1.0f;
  }
  bool have_forward = false;

  // Offsets (in elements of T, or of float for the *_f32 ones) of one layer's saved activations.
  struct Layer {
    int64_t x_in, h1, q, k, v, attn, x_mid, h2, u, g, s;  // in acts (T)
    int64_t rstd1, rstd2, lse;                             // in acts_f32
  };
  std::vector<Layer> layers;
  int64_t x_out = 0, h_f = 0, logits = 0, rstd_f = 0, row_loss = 0;

  size_t elem() const { return dtype_size(precision); }
  template <class T>
  T* a(int64_t offset) const {
    return static_cast<T*>(acts.data()) + offset;
  }
  float* f(int64_t offset) const { return static_cast<float*>(acts_f32.data()) + offset; }
  const ParameterInfo& info(const std::string& name) const {
    for (const auto& p : layout) {
      if (p.name == name) return p;
    }
    fail("CudaModel: no parameter named '{}'", name);
  }
  float* master(const std::string& name) const { return static_cast<float*>(params.data()) + info(name).offset; }
  float* grad(const std::string& name) const { return static_cast<float*>(grads.data()) + info(name).offset; }
  const float* rope_cos() const { return static_cast<const float*>(rope.data()); }
  const float* rope_sin() const { return rope_cos() + c.context * (c.head_dim() / 2); }
  AttentionOptions attention_options() const {
    AttentionOptions o;
    o.impl = attention;
    o.causal = true;
    // The separate dQ pass, not fp32 atomics: a training step stays bit-reproducible, which resuming
    // from a checkpoint relies on (it costs the xl step ~1 ms of attention backward).
    o.deterministic = true;
    o.stream = stream;
    return o;
  }
  // The weight the GEMMs read: the low-precision copy, or the fp32 master itself.
  const void* weight(const std::string& name) const {
    if (precision == DType::f32) return master(name);
    return static_cast<const char*>(params_lp.data()) + info(name).offset * int64_t(elem());
  }
};

CudaModel::CudaModel(const ModelConfig& config, int64_t batch, int64_t seq, DType precision, AttentionImpl attention,
                     void* stream)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  config.validate();
  FLASHLM_CHECK(precision == DType::f32 || precision == DType::bf16 || precision == DType::f16,
                "CudaModel: precision {} is not supported (fp32, bf16 or fp16)", dtype_name(precision));
  FLASHLM_CHECK(config.d_model % 8 == 0 && config.d_ff % 8 == 0 && config.vocab % 8 == 0,
                "CudaModel: d_model ({}), d_ff ({}) and vocab ({}) must be multiples of 8 (16-byte rows for the "
                "tensor cores)",
                config.d_model, config.d_ff, config.vocab);
  FLASHLM_CHECK(batch >= 1 && seq >= 1 && seq <= config.context, "CudaModel: batch {} and seq {} (context {})", batch,
                seq, config.context);
  m.c = config;
  m.batch = batch;
  m.seq = seq;
  m.n = checked_mul(batch, seq, "CudaModel: tokens per step");
  m.precision = precision;
  m.attention = attention;
  m.stream = stream;
  m.layout = parameter_layout(config);
  m.n_params = m.layout.back().offset + m.layout.back().numel();
  m.loss_scale = precision == DType::f16 ? kInitialLossScale : 1.0;

  const size_t pbytes = size_t(m.n_params) * sizeof(float);
  m.params = Buffer::allocate(pbytes, Device::cuda, "parameters (fp32 master)");
  m.grads = Buffer::allocate(pbytes, Device::cuda, "gradients (fp32)");
  if (precision != DType::f32) {
    m.params_lp = Buffer::allocate(size_t(m.n_params) * m.elem(), Device::cuda, "parameters (low precision)");
  }

  // Every offset is checked: batch, seq and the widths come from the user.
  constexpr std::string_view what = "CudaModel: activation size";
  const int64_t n = m.n, d = config.d_model, f = config.d_ff, bhs = checked_mul(n, config.heads, what);
  int64_t t = 0, t32 = 0;
  auto take = [&](int64_t& cursor, int64_t rows, int64_t width) {
    const int64_t at = cursor;
    cursor = checked_add(cursor, aligned(checked_mul(rows, width, what)), what);
    return at;
  };
  for (int64_t l = 0; l < config.layers; ++l) {
    Impl::Layer L{};
    L.x_in = take(t, n, d);
    L.h1 = take(t, n, d);
    L.q = take(t, n, d);
    L.k = take(t, n, d);
    L.v = take(t, n, d);
    L.attn = take(t, n, d);
    L.x_mid = take(t, n, d);
    L.h2 = take(t, n, d);
    L.u = take(t, n, f);
    L.g = take(t, n, f);
    L.s = take(t, n, f);
    L.rstd1 = take(t32, n, 1);
    L.rstd2 = take(t32, n, 1);
    L.lse = take(t32, bhs, 1);
    m.layers.push_back(L);
  }
  m.x_out = take(t, n, d);
  m.h_f = take(t, n, d);
  m.logits = take(t, n, config.vocab);
  m.rstd_f = take(t32, n, 1);
  m.row_loss = take(t32, n, 1);
  const auto bytes = [&](int64_t elements, size_t elem) {
    return size_t(checked_mul(elements, int64_t(elem), "CudaModel: activation bytes"));
  };
  m.acts = Buffer::allocate(bytes(t, m.elem()), Device::cuda, "activations");
  m.acts_f32 = Buffer::allocate(bytes(t32, sizeof(float)), Device::cuda, "activations (fp32 statistics)");
  // Within t's sum of the same aligned terms, so unchecked.
  m.scratch =
      Buffer::allocate(bytes(6 * aligned(n * d) + 3 * aligned(n * f), m.elem()), Device::cuda, "backward scratch");
  m.tokens = Buffer::allocate(size_t(n) * sizeof(int32_t), Device::cuda, "tokens");
  m.targets = Buffer::allocate(size_t(n) * sizeof(int32_t), Device::cuda, "targets");
  m.reduce_out = Buffer::allocate(sizeof(double) + sizeof(int), Device::cuda, "reductions");

  const int64_t half = config.head_dim() / 2;
  std::vector<float> table(size_t(checked_product({2, config.context, half}, "CudaModel: RoPE table size")));
  cpu::rope_tables(table.data(), table.data() + config.context * half, config.context, config.head_dim(),
                   config.rope_theta);
  m.rope = Buffer::allocate(table.size() * sizeof(float), Device::cuda, "RoPE tables");
  cuda_copy(m.rope.data(), table.data(), table.size() * sizeof(float));
  gpu::memset_async(m.params.data(), 0, pbytes, stream);
  zero_grad();
}

CudaModel::~CudaModel() = default;

const ModelConfig& CudaModel::config() const { return impl_->c; }
const std::vector<ParameterInfo>& CudaModel::layout() const { return impl_->layout; }
float* CudaModel::parameters() const { return static_cast<float*>(impl_->params.data()); }
float* CudaModel::gradients() const {
  impl_->apply_pending_clip();
  return static_cast<float*>(impl_->grads.data());
}
void* CudaModel::stream() const { return impl_->stream; }
int64_t CudaModel::parameter_count() const { return impl_->n_params; }
DType CudaModel::precision() const { return impl_->precision; }
double CudaModel::loss_scale() const { return impl_->loss_scale; }

namespace {

// Calls fn(T{}) with the activation type of the model.
template <class Fn>
void with_precision(DType precision, Fn&& fn) {
  switch (precision) {
    case DType::f32: return fn(float{});
    case DType::bf16: return fn(bf16_t{});
    case DType::f16: return fn(fp16_t{});
    default: fail("CudaModel: precision {} is not supported", dtype_name(precision));
  }
}

// [batch, seq, heads, head_dim] view of a contiguous [batch * seq, d_model] device array.
TensorView heads_view(void* data, DType dtype, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim) {
  return TensorView::contiguous(data, dtype, {batch, seq, heads, head_dim}, Device::cuda);
}

}  // namespace

void CudaModel::load_parameters(const float* host) {
  cuda_copy(impl_->params.data(), host, size_t(impl_->n_params) * sizeof(float));
  parameters_changed();
  gpu::stream_synchronize(impl_->stream);
}

std::vector<int64_t> CudaModel::master_read_parameters() const {
  std::vector<int64_t> read;
  if (impl_->precision == DType::f32) return read;
  // The parameters forward() and backward() pass as m.master(...): the embedding lookup and the RMSNorm gains.
  const auto ends_with = [](const std::string& s, std::string_view tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (size_t i = 0; i < impl_->layout.size(); ++i) {
    const std::string& name = impl_->layout[i].name;
    if (name == "token_embeddings.weight" || ends_with(name, "ln1.weight") || ends_with(name, "ln2.weight") ||
        name == "ln_final.weight") {
      read.push_back(int64_t(i));
    }
  }
  return read;
}

void* CudaModel::working_parameters() const {
  return impl_->precision == DType::f32 ? nullptr : impl_->params_lp.data();
}

void CudaModel::parameters_changed() {
  Impl& m = *impl_;
  with_precision(m.precision, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (!std::is_same_v<T, float>) {
      gpu::cast_from_f32<T>(static_cast<float*>(m.params.data()), static_cast<T*>(m.params_lp.data()), m.n_params,
                            m.stream);
    }
  });
}

void CudaModel::init_parameters(uint64_t seed) {
  std::vector<float> host(size_t(impl_->n_params));
  init_parameters_host(impl_->layout, host.data(), seed);
  load_parameters(host.data());
}

void CudaModel::copy_parameters_to(float* host) const {
  gpu::stream_synchronize(impl_->stream);
  cuda_copy(host, impl_->params.data(), size_t(impl_->n_params) * sizeof(float));
}

void CudaModel::copy_gradients_to(float* host) const {
  impl_->apply_pending_clip();
  gpu::stream_synchronize(impl_->stream);
  cuda_copy(host, impl_->grads.data(), size_t(impl_->n_params) * sizeof(float));
}

void CudaModel::copy_logits_to(float* host) const {
  const Impl& m = *impl_;
  FLASHLM_CHECK(m.have_forward, "copy_logits_to: call forward() first (backward() overwrites the logits)");
  const int64_t count = m.n * m.c.vocab;
  Buffer staging = Buffer::allocate(size_t(count) * sizeof(float), Device::cuda, "logits (fp32 copy)");
  with_precision(m.precision, [&](auto zero) {
    using T = decltype(zero);
    gpu::cast_to_f32<T>(m.a<T>(m.logits), static_cast<float*>(staging.data()), count, m.stream);
  });
  gpu::stream_synchronize(m.stream);
  cuda_copy(host, staging.data(), size_t(count) * sizeof(float));
}

double CudaModel::forward(const int32_t* host_tokens, const int32_t* host_targets) {
  Impl& m = *impl_;
  const ModelConfig& c = m.c;
  const int64_t n = m.n, d = c.d_model, f = c.d_ff, hd = c.head_dim();
  for (int64_t i = 0; i < n; ++i) {
    FLASHLM_CHECK(host_tokens[i] >= 0 && host_tokens[i] < c.vocab, "forward: tokens[{}] = {} outside [0, vocab = {})",
                  i, host_tokens[i], c.vocab);
    FLASHLM_CHECK(host_targets[i] >= 0 && host_targets[i] < c.vocab,
                  "forward: targets[{}] = {} outside [0, vocab = {})", i, host_targets[i], c.vocab);
  }
  memory_set_phase("forward");
  ScopedRange range("forward");
  gpu::stream_synchronize(m.stream);  // the previous step may still read the token buffers
  cuda_copy(m.tokens.data(), host_tokens, size_t(n) * sizeof(int32_t));
  cuda_copy(m.targets.data(), host_targets, size_t(n) * sizeof(int32_t));
  const auto* tokens = static_cast<const int32_t*>(m.tokens.data());
  const auto* targets = static_cast<const int32_t*>(m.targets.data());
  const float* rope_cos = m.rope_cos();
  const float* rope_sin = m.rope_sin();
  const AttentionOptions attn = m.attention_options();
  const DType dt = m.precision;
  const float eps = float(c.norm_eps);

  double loss = 0;
  with_precision(dt, [&](auto zero) {
    using T = decltype(zero);
    parameters_needed("token_embeddings.");
    gpu::embedding_forward<T>(m.master("token_embeddings.weight"), tokens, m.a<T>(m.layers[0].x_in), n, d, c.vocab,
                              m.stream);
    parameters_done("token_embeddings.");
    for (int64_t l = 0; l < c.layers; ++l) {
      ScopedRange layer_range("layer.forward");
      const std::string p = fmt::format("layers.{}.", l);
      parameters_needed(p);
      const Impl::Layer& L = m.layers[size_t(l)];
      T* x_next = m.a<T>(l + 1 < c.layers ? m.layers[size_t(l + 1)].x_in : m.x_out);
      gpu::rmsnorm_forward<T>(m.a<T>(L.x_in), m.master(p + "ln1.weight"), m.a<T>(L.h1), m.f(L.rstd1), n, d, eps,
                              m.stream);
      linear_forward_cuda(m.a<T>(L.h1), m.weight(p + "attn.q_proj.weight"), m.a<T>(L.q), n, d, d, dt, m.stream);
      linear_forward_cuda(m.a<T>(L.h1), m.weight(p + "attn.k_proj.weight"), m.a<T>(L.k), n, d, d, dt, m.stream);
      linear_forward_cuda(m.a<T>(L.h1), m.weight(p + "attn.v_proj.weight"), m.a<T>(L.v), n, d, d, dt, m.stream);
      gpu::rope_forward<T>(m.a<T>(L.q), rope_cos, rope_sin, m.batch, m.seq, c.heads, hd, m.stream);
      gpu::rope_forward<T>(m.a<T>(L.k), rope_cos, rope_sin, m.batch, m.seq, c.heads, hd, m.stream);
      {
        ScopedRange attention_range("attention.forward");
        attention_forward(heads_view(m.a<T>(L.q), dt, m.batch, m.seq, c.heads, hd),
                          heads_view(m.a<T>(L.k), dt, m.batch, m.seq, c.heads, hd),
                          heads_view(m.a<T>(L.v), dt, m.batch, m.seq, c.heads, hd),
                          heads_view(m.a<T>(L.attn), dt, m.batch, m.seq, c.heads, hd),
                          TensorView::contiguous(m.f(L.lse), DType::f32, {m.batch, c.heads, m.seq}, Device::cuda), attn);
      }
      linear_forward_cuda(m.a<T>(L.attn), m.weight(p + "attn.output_proj.weight"), m.a<T>(L.x_mid), n, d, d, dt,
                          m.stream);
      gpu::add_inplace<T>(m.a<T>(L.x_mid), m.a<T>(L.x_in), n * d, m.stream);
      gpu::rmsnorm_forward<T>(m.a<T>(L.x_mid), m.master(p + "ln2.weight"), m.a<T>(L.h2), m.f(L.rstd2), n, d, eps,
                              m.stream);
      linear_forward_cuda(m.a<T>(L.h2), m.weight(p + "ffn.w1.weight"), m.a<T>(L.u), n, d, f, dt, m.stream);
      linear_forward_cuda(m.a<T>(L.h2), m.weight(p + "ffn.w3.weight"), m.a<T>(L.g), n, d, f, dt, m.stream);
      gpu::swiglu_forward<T>(m.a<T>(L.u), m.a<T>(L.g), m.a<T>(L.s), n * f, m.stream);
      linear_forward_cuda(m.a<T>(L.s), m.weight(p + "ffn.w2.weight"), x_next, n, f, d, dt, m.stream);
      gpu::add_inplace<T>(x_next, m.a<T>(L.x_mid), n * d, m.stream);
      parameters_done(p);
    }
    ScopedRange head_range("head.forward");  // final norm, LM head and loss
    parameters_needed("ln_final.");
    parameters_needed("lm_head.");
    gpu::rmsnorm_forward<T>(m.a<T>(m.x_out), m.master("ln_final.weight"), m.a<T>(m.h_f), m.f(m.rstd_f), n, d, eps,
                            m.stream);
    parameters_done("ln_final.");
    linear_forward_cuda(m.a<T>(m.h_f), m.weight("lm_head.weight"), m.a<T>(m.logits), n, d, c.vocab, dt, m.stream);
    parameters_done("lm_head.");
    gpu::cross_entropy_forward<T>(m.a<T>(m.logits), targets, m.f(m.row_loss), n, c.vocab, m.stream);
  });
  // The mean loss, summed on the host in a fixed order.
  std::vector<float> rows(static_cast<size_t>(n));
  gpu::stream_synchronize(m.stream);
  cuda_copy(rows.data(), m.f(m.row_loss), size_t(n) * sizeof(float));
  for (float r : rows) loss += r;
  m.have_forward = true;
  return loss / double(n);
}

void CudaModel::backward() {
  Impl& m = *impl_;
  FLASHLM_CHECK(m.have_forward, "backward: call forward() first");
  m.apply_pending_clip();  // accumulating onto clipped gradients
  const ModelConfig& c = m.c;
  const int64_t n = m.n, d = c.d_model, f = c.d_ff, hd = c.head_dim();
  const auto* targets = static_cast<const int32_t*>(m.targets.data());
  const auto* tokens = static_cast<const int32_t*>(m.tokens.data());
  const float* rope_cos = m.rope_cos();
  const float* rope_sin = m.rope_sin();
  const AttentionOptions attn = m.attention_options();
  const DType dt = m.precision;
  memory_set_phase("backward");
  ScopedRange range("backward");

  with_precision(dt, [&](auto zero) {
    using T = decltype(zero);
    T* s0 = static_cast<T*>(m.scratch.data());
    const int64_t nd = aligned(n * d), nf = aligned(n * f);
    T *dx = s0, *dh = s0 + nd, *dq = s0 + 2 * nd, *dk = s0 + 3 * nd, *dv = s0 + 4 * nd, *dattn = s0 + 5 * nd;
    T *du = s0 + 6 * nd, *dg = du + nf, *ds = dg + nf;

    {
      ScopedRange head_range("head.backward");  // loss, LM head and final norm
      // d(loss)/d(logits), multiplied by the loss scale (1 except for fp16).
      gpu::cross_entropy_backward<T>(m.a<T>(m.logits), targets, n, c.vocab, float(m.loss_scale / double(n)),
                                     m.stream);
      parameters_needed("lm_head.");
      linear_backward_cuda(m.a<T>(m.logits), m.a<T>(m.h_f), m.weight("lm_head.weight"), dh, m.grad("lm_head.weight"),
                           n, d, c.vocab, dt, false, m.stream);
      parameters_done("lm_head.");
      gradient_ready("lm_head.weight");
      gpu::memset_async(dx, 0, size_t(n * d) * sizeof(T), m.stream);
      parameters_needed("ln_final.");
      gpu::rmsnorm_backward<T>(dh, m.a<T>(m.x_out), m.master("ln_final.weight"), m.f(m.rstd_f), dx,
                               m.grad("ln_final.weight"), n, d, m.stream);
      parameters_done("ln_final.");
      gradient_ready("ln_final.weight");
    }
    for (int64_t l = c.layers - 1; l >= 0; --l) {
      ScopedRange layer_range("layer.backward");
      const std::string p = fmt::format("layers.{}.", l);
      const Impl::Layer& L = m.layers[size_t(l)];
      parameters_needed(p);
      linear_backward_cuda(dx, m.a<T>(L.s), m.weight(p + "ffn.w2.weight"), ds, m.grad(p + "ffn.w2.weight"), n, f, d,
                           dt, false, m.stream);
      gradient_ready(p + "ffn.w2.weight");
      gpu::swiglu_backward<T>(ds, m.a<T>(L.u), m.a<T>(L.g), du, dg, n * f, m.stream);
      linear_backward_cuda(du, m.a<T>(L.h2), m.weight(p + "ffn.w1.weight"), dh, m.grad(p + "ffn.w1.weight"), n, d, f,
                           dt, false, m.stream);
      gradient_ready(p + "ffn.w1.weight");
      linear_backward_cuda(dg, m.a<T>(L.h2), m.weight(p + "ffn.w3.weight"), dh, m.grad(p + "ffn.w3.weight"), n, d, f,
                           dt, true, m.stream);
      gradient_ready(p + "ffn.w3.weight");
      gpu::rmsnorm_backward<T>(dh, m.a<T>(L.x_mid), m.master(p + "ln2.weight"), m.f(L.rstd2), dx,
                               m.grad(p + "ln2.weight"), n, d, m.stream);
      gradient_ready(p + "ln2.weight");
      linear_backward_cuda(dx, m.a<T>(L.attn), m.weight(p + "attn.output_proj.weight"), dattn,
                           m.grad(p + "attn.output_proj.weight"), n, d, d, dt, false, m.stream);
      gradient_ready(p + "attn.output_proj.weight");
      {
        ScopedRange attention_range("attention.backward");
        attention_backward(heads_view(m.a<T>(L.q), dt, m.batch, m.seq, c.heads, hd),
                           heads_view(m.a<T>(L.k), dt, m.batch, m.seq, c.heads, hd),
                           heads_view(m.a<T>(L.v), dt, m.batch, m.seq, c.heads, hd),
                           heads_view(m.a<T>(L.attn), dt, m.batch, m.seq, c.heads, hd),
                           TensorView::contiguous(m.f(L.lse), DType::f32, {m.batch, c.heads, m.seq}, Device::cuda),
                           heads_view(dattn, dt, m.batch, m.seq, c.heads, hd), heads_view(dq, dt, m.batch, m.seq, c.heads, hd),
                           heads_view(dk, dt, m.batch, m.seq, c.heads, hd), heads_view(dv, dt, m.batch, m.seq, c.heads, hd),
                           attn);
      }
      gpu::rope_backward<T>(dq, rope_cos, rope_sin, m.batch, m.seq, c.heads, hd, m.stream);
      gpu::rope_backward<T>(dk, rope_cos, rope_sin, m.batch, m.seq, c.heads, hd, m.stream);
      linear_backward_cuda(dq, m.a<T>(L.h1), m.weight(p + "attn.q_proj.weight"), dh, m.grad(p + "attn.q_proj.weight"), n,
                           d, d, dt, false, m.stream);
      gradient_ready(p + "attn.q_proj.weight");
      linear_backward_cuda(dk, m.a<T>(L.h1), m.weight(p + "attn.k_proj.weight"), dh, m.grad(p + "attn.k_proj.weight"), n,
                           d, d, dt, true, m.stream);
      gradient_ready(p + "attn.k_proj.weight");
      linear_backward_cuda(dv, m.a<T>(L.h1), m.weight(p + "attn.v_proj.weight"), dh, m.grad(p + "attn.v_proj.weight"), n,
                           d, d, dt, true, m.stream);
      gradient_ready(p + "attn.v_proj.weight");
      gpu::rmsnorm_backward<T>(dh, m.a<T>(L.x_in), m.master(p + "ln1.weight"), m.f(L.rstd1), dx,
                               m.grad(p + "ln1.weight"), n, d, m.stream);
      parameters_done(p);
      gradient_ready(p + "ln1.weight");
    }
    gpu::embedding_backward<T>(dx, tokens, m.grad("token_embeddings.weight"), n, d, c.vocab, m.stream);
    gradient_ready("token_embeddings.weight");
  });
  m.have_forward = false;  // the logits now hold their gradient
}

void CudaModel::zero_grad() {
  ScopedRange range("zero_grad");
  impl_->pending_clip = 1.0f;
  gpu::memset_async(impl_->grads.data(), 0, size_t(impl_->n_params) * sizeof(float), impl_->stream);
}

bool CudaModel::unscale_gradients() {
  Impl& m = *impl_;
  if (m.precision != DType::f16) return true;
  m.apply_pending_clip();
  auto* count = reinterpret_cast<int*>(static_cast<char*>(m.reduce_out.data()) + sizeof(double));
  gpu::count_nonfinite<float>(static_cast<float*>(m.grads.data()), m.n_params, count, m.stream);
  int bad = 0;
  gpu::stream_synchronize(m.stream);
  cuda_copy(&bad, count, sizeof bad);
  if (bad > 0) {
    m.loss_scale /= 2;
    m.good_steps = 0;
    return false;
  }
  gpu::scale_inplace(static_cast<float*>(m.grads.data()), m.n_params, float(1.0 / m.loss_scale), m.stream);
  if (++m.good_steps == kLossScaleGrowthInterval) {
    m.loss_scale *= 2;
    m.good_steps = 0;
  }
  return true;
}

double CudaModel::gradient_norm() const {
  const Impl& m = *impl_;
  m.apply_pending_clip();
  auto* out = static_cast<double*>(m.reduce_out.data());
  gpu::squared_norm(static_cast<const float*>(m.grads.data()), m.n_params, out, m.stream);
  double ss = 0;
  gpu::stream_synchronize(m.stream);
  cuda_copy(&ss, out, sizeof ss);
  return std::sqrt(ss);
}

double CudaModel::clip_gradients(double max_norm) {
  ScopedRange range("clip_gradients");
  const double norm = gradient_norm();
  // Deferred to adamw_step's kernel (or to the next reader of the gradients): the same product, rounded once.
  if (max_norm > 0 && norm > max_norm) impl_->pending_clip = float(max_norm / (norm + 1e-6));
  return norm;
}

int64_t CudaModel::optimizer_steps() const { return impl_->adam_step; }

void CudaModel::synchronize() const { gpu::stream_synchronize(impl_->stream); }

void CudaModel::save_state(std::span<float> params, std::span<float> m, std::span<float> v) const {
  check_state_arrays("CudaModel::save_state", params.size(), m.size(), v.size(), 0);
  const size_t bytes = size_t(impl_->n_params) * sizeof(float);
  synchronize();
  cuda_copy(params.data(), impl_->params.data(), bytes);
  if (!impl_->adam_m.data()) {  // no step taken yet: zero moments
    std::fill(m.begin(), m.end(), 0.0f);
    std::fill(v.begin(), v.end(), 0.0f);
    return;
  }
  cuda_copy(m.data(), impl_->adam_m.data(), bytes);
  cuda_copy(v.data(), impl_->adam_v.data(), bytes);
}

void CudaModel::load_state(std::span<const float> params, std::span<const float> m, std::span<const float> v,
                           int64_t optimizer_steps) {
  check_state_arrays("CudaModel::load_state", params.size(), m.size(), v.size(), optimizer_steps);
  const size_t bytes = size_t(impl_->n_params) * sizeof(float);
  load_parameters(params.data());  // also refreshes the low-precision copy
  impl_->allocate_moments();
  gpu::stream_synchronize(impl_->stream);  // the zeroing above is queued on the model's stream
  cuda_copy(impl_->adam_m.data(), m.data(), bytes);
  cuda_copy(impl_->adam_v.data(), v.data(), bytes);
  impl_->adam_step = optimizer_steps;
}

void CudaModel::adamw_step(const AdamWConfig& cfg, double lr) {
  Impl& m = *impl_;
  memory_set_phase("optimizer");
  ScopedRange range("optimizer_step");
  m.allocate_moments();
  ++m.adam_step;
  with_precision(m.precision, [&](auto zero) {
    using T = decltype(zero);
    T* copy = nullptr;
    if constexpr (!std::is_same_v<T, float>) copy = static_cast<T*>(m.params_lp.data());
    gpu::adamw_step<T>(static_cast<float*>(m.params.data()), static_cast<const float*>(m.grads.data()),
                       static_cast<float*>(m.adam_m.data()), static_cast<float*>(m.adam_v.data()), m.n_params, lr,
                       cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, m.adam_step, copy, m.stream, m.pending_clip);
  });
  // pending_clip stays: the stored gradients are still unclipped for any later reader.
}

}  // namespace flashlm
