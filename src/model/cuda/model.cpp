// The LM on one GPU, step by step as model_cpu.cpp, with mixed precision: activations in T (fp32, bf16,
// fp16), everything that accumulates across steps in fp32 — or, bf16-pure, everything in bf16 with each
// backward's weight gradient accumulated in an fp32 buffer and rounded once. Host code: the layer kernels
// are in model/cuda/ (cuda/ops.h; bf16_pure.h for the pure-bf16 ones), AdamW in optim/, the GEMMs in
// gemm.cpp, attention in attention/cuda/; the step as a CUDA graph in step_graph.cpp, the private
// implementation in model_impl.h.
#include <cuda_runtime.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/array_ops.h"
#include "core/check.h"
#include "core/cuda_check.h"
#include "core/cuda_runtime.h"
#include "flashlm/model.h"
#include "flashlm/profile.h"
#include "model/activations.h"
#include "model/cuda/bf16_pure.h"
#include "model/cuda/model_impl.h"
#include "model/cuda/gemm.h"
#include "model/lm_head.h"
#include "model/ops_cpu.h"
#include "model/cuda/ops.h"
#include "optim/optimizer.h"

namespace flashlm {

CudaModel::CudaModel(const ModelConfig& config, int64_t batch, int64_t seq, DType precision, AttentionImpl attention,
                     void* stream)
    : CudaModel(config, batch, seq, precision, ModelOptions::with_attention(attention), stream) {}

CudaModel::CudaModel(const ModelConfig& config, int64_t batch, int64_t seq, DType precision,
                     const ModelOptions& options, void* stream)
    : LanguageModel(config, Device::cuda, precision, options), impl_(std::make_unique<Impl>(*this)) {
  Impl& m = *impl_;
  FLASHLM_CHECK(precision == DType::f32 || precision == DType::bf16 || precision == DType::f16,
                "CudaModel: precision {} is not supported (fp32, bf16 or fp16)", dtype_name(precision));
  FLASHLM_CHECK(!options.bf16_pure || precision == DType::bf16, "CudaModel: bf16-pure needs precision bf16, not {}",
                dtype_name(precision));
  options.check_optimizer_state();
  options.check_fp8(precision, Device::cuda);
  options.check_grad_dtype(precision, Device::cuda);
  FLASHLM_CHECK(config.d_model % 8 == 0 && config.d_ff % 8 == 0 && config.vocab % 8 == 0,
                "CudaModel: d_model ({}), d_ff ({}) and vocab ({}) must be multiples of 8 (16-byte rows for the "
                "tensor cores)",
                config.d_model, config.d_ff, config.vocab);
  FLASHLM_CHECK(batch >= 1 && seq >= 1 && seq <= config.context, "CudaModel: batch {} and seq {} (context {})", batch,
                seq, config.context);
  // Refuse before allocating anything when the plan does not fit the free memory.
  check_memory_plan(plan_model_memory(config, batch, seq, Device::cuda, precision, options), cuda_free_memory_bytes(),
                    "the GPU");
  m.batch = batch;
  m.seq = seq;
  m.n = checked_mul(batch, seq, "CudaModel: tokens per step");
  m.options = options;
  m.stream = stream;
  for (size_t i = 0; i < m.layout.size(); ++i) {
    m.index.emplace(m.layout[i].name, i);
    m.largest_parameter = std::max(m.largest_parameter, m.layout[i].numel());
    if (m.layout[i].shape.size() == 1) m.gain_row.emplace(m.layout[i].name, int64_t(m.gain_row.size()));
  }
  init_optimizer_state(options.optimizer_state);
  m.adam = &adamw();
  m.scaler = &loss_scaler();

  const size_t pbytes = size_t(m.n_params) * m.state_elem();
  if (!options.external_parameters) {  // otherwise FSDP's shards hold them
    m.params = Buffer::allocate(pbytes, Device::cuda, m.pure ? "parameters (bf16)" : "parameters (fp32 master)");
    m.grads = Buffer::allocate(size_t(m.n_params) * m.grad_elem(), Device::cuda,
                               m.grad_elem() == sizeof(bf16_t) ? "gradients (bf16)" : "gradients (fp32)");
  }
  if (m.bf16_gradients()) {
    // The fp32 accumulator of the bf16 gradients (FSDP's sharded storage gives fp32 gradients instead).
    m.largest_gradient = gradient_staging_elements(config);
    m.staging = Buffer::allocate(size_t(m.largest_gradient) * sizeof(float), Device::cuda,
                                 "fp32 gradient accumulator");
  }
  if (m.pure) {
    m.gains_f32 = Buffer::allocate(m.gain_row.size() * size_t(config.d_model) * sizeof(float), Device::cuda,
                                   "RMSNorm gains (fp32)");
  } else if (precision != DType::f32 && !options.external_parameters) {
    m.params_lp = Buffer::allocate(size_t(m.n_params) * m.elem(), Device::cuda, "parameters (low precision)");
  }
  // bf16-pure: no masters, `weight` the bf16 parameters; no fp32 gradients with bf16 ones (ModelOptions::grad_dtype).
  point_storage_at(m.pure ? nullptr : static_cast<float*>(m.params.data()),
                   m.pure ? m.params.data() : m.params_lp.data(), precision,
                   m.bf16_gradients() ? nullptr : static_cast<float*>(m.grads.data()));
  m.table = storage_.data();

  // Every size is checked: batch, seq and the widths come from the user.
  constexpr std::string_view bytes = "CudaModel: activation bytes";
  const auto elem_bytes = [&](int64_t count, size_t size) { return size_t(checked_mul(count, int64_t(size), bytes)); };
  m.A = layout_activations(config, batch, seq, options.recompute);
  const int64_t qkv_slot = aligned_elements(m.n * config.d_model);
  for (const BlockActivations& b : m.A.blocks) {  // qkv_view's span
    FLASHLM_CHECK(b.k == b.q + qkv_slot && b.v == b.k + qkv_slot,
                  "CudaModel: the activation layout does not keep q, k and v side by side");
  }
  m.acts = Buffer::allocate(elem_bytes(m.A.values, m.elem()), Device::cuda, "activations");
  m.acts_f32 = Buffer::allocate(elem_bytes(m.A.stats, sizeof(float)), Device::cuda, "activations (fp32 statistics)");
  m.head_chunk = head_chunk_tokens(config, m.n, options.head_chunk, int64_t(m.elem()));
  m.logits = Buffer::allocate(elem_bytes(aligned_elements(checked_mul(m.head_chunk, config.vocab, bytes)), m.elem()),
                              Device::cuda, "logits of one LM-head chunk");
  m.row_loss = Buffer::allocate(elem_bytes(m.n, sizeof(float)), Device::cuda, "per-token losses");
  m.scratch = Buffer::allocate(elem_bytes(backward_scratch_elements(config, m.n), m.elem()), Device::cuda,
                               "backward scratch");
  m.tokens = Buffer::allocate(elem_bytes(m.n, sizeof(int32_t)), Device::cuda, "tokens");
  m.targets = Buffer::allocate(elem_bytes(m.n, sizeof(int32_t)), Device::cuda, "targets");
  m.reduce_out = Buffer::allocate(sizeof(double) + sizeof(int), Device::cuda, "reductions");
  if (options.fp8) {
    m.fp8 = std::make_unique<Fp8Linear>(config, m.n, options.fp8_gradients, options.fp8_recipe,
                                        fp8_keeps_inputs(options.fp8_recipe, options.recompute));
  }
  if (precision != DType::f16 && options.overlap_grad_norm) {
    m.norms = std::make_unique<SideStream>();
    m.partial_norms = Buffer::allocate(m.layout.size() * sizeof(double), Device::cuda, "gradient norms per parameter");
  }

  const int64_t half = config.head_dim() / 2;
  std::vector<float> table(size_t(checked_product({2, config.context, half}, "CudaModel: RoPE table size")));
  cpu::rope_tables(table.data(), table.data() + config.context * half, config.context, config.head_dim(),
                   config.rope_theta);
  m.rope = Buffer::allocate(table.size() * sizeof(float), Device::cuda, "RoPE tables");
  cuda_copy(m.rope.data(), table.data(), table.size() * sizeof(float));
  if (m.params.data()) gpu::memset_async(m.params.data(), 0, pbytes, stream);
  m.refresh_gains();
  zero_grad();
}

CudaModel::~CudaModel() = default;

// The pointers to the weights handed out (parameters, working_parameters) may be written through: FP8's weight
// amaxes are stale from then on (Impl::weights_changed).
float* CudaModel::parameters() const {
  FLASHLM_CHECK(!impl_->pure, "CudaModel: a bf16-pure model keeps no fp32 parameters (data parallelism needs "
                              "--precision bf16, fp16 or fp32)");
  impl_->weights_changed();
  return static_cast<float*>(impl_->params.data());
}
float* CudaModel::gradients() const {
  FLASHLM_CHECK(!impl_->pure, "CudaModel: a bf16-pure model keeps no fp32 gradients (data parallelism needs "
                              "--precision bf16, fp16 or fp32)");
  FLASHLM_CHECK(!impl_->mixed_bf16_gradients(), "CudaModel: a model with --grad-dtype bf16 keeps no fp32 gradients "
                                                "(data parallelism needs --grad-dtype fp32)");
  impl_->settle_gradients();  // the caller may read them or add to them
  impl_->norms_current = false;
  return static_cast<float*>(impl_->grads.data());
}

void CudaModel::check_own_storage(std::string_view caller) const {
  FLASHLM_CHECK(!external_parameters(),
                "{}: this model keeps no flat parameters of its own (FSDP's sharded storage: use DdpModel's)", caller);
}
const RecomputePlan& CudaModel::recompute() const { return impl_->A.recompute; }
void* CudaModel::stream() const { return impl_->stream; }

namespace {

// [batch, seq, heads, head_dim] view of a contiguous [batch * seq, d_model] device array.
TensorView heads_view(void* data, DType dtype, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim) {
  return TensorView::contiguous(data, dtype, {batch, seq, heads, head_dim}, Device::cuda);
}

// q, k and v live as one [batch * seq, 3 * d_model] array, each token's q, k and v rows side by side (the
// span of the layout's q, k and v, which lie one after the other): one GEMM writes them and one reads their
// gradients. The [batch, seq, heads, head_dim] view of part `which` (0 q, 1 k, 2 v) of such an array.
TensorView qkv_view(void* qkv, int which, DType dtype, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim) {
  const int64_t d = heads * head_dim;
  TensorView t = heads_view(static_cast<char*>(qkv) + which * d * int64_t(dtype_size(dtype)), dtype, batch, seq, heads,
                            head_dim);
  t.strides = {seq * 3 * d, 3 * d, head_dim, 1};
  return t;
}

}  // namespace

void CudaModel::load_parameters(const float* host) {
  check_own_storage("CudaModel::load_parameters");
  Impl& m = *impl_;
  if (m.pure) {
    m.narrow_from_host(host, static_cast<bf16_t*>(m.params.data()), m.n_params);
  } else {
    cuda_copy(m.params.data(), host, size_t(m.n_params) * sizeof(float));
  }
  parameters_changed();
  gpu::stream_synchronize(m.stream);
}

std::vector<int64_t> CudaModel::master_read_parameters() const {
  std::vector<int64_t> read;
  if (working_dtype() == DType::f32) return read;
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
  impl_->weights_changed();
  return working_dtype() == DType::f32 ? nullptr : impl_->params_lp.data();
}

void CudaModel::parameters_changed() {
  Impl& m = *impl_;
  m.weights_changed();
  if (m.pure) return m.refresh_gains();
  if (!m.params.data()) return;  // FSDP's sharded storage: DdpModel refreshes the working copy of the shards
  with_precision(m.precision, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (!std::is_same_v<T, float>) {
      gpu::cast_from_f32<T>(static_cast<float*>(m.params.data()), static_cast<T*>(m.params_lp.data()), m.n_params,
                            m.stream);
    }
  });
}

void CudaModel::init_parameters(uint64_t seed) {
  // Parameter by parameter through one host buffer: an 8B model's values never exist on the host at once.
  check_own_storage("CudaModel::init_parameters");
  Impl& m = *impl_;
  std::vector<float> host(size_t(m.largest_parameter));
  for (const ParameterInfo& p : m.layout) {
    init_parameter_host(p, host.data(), seed);
    if (m.pure) {
      m.narrow_from_host(host.data(), static_cast<bf16_t*>(m.params.data()) + p.offset, p.numel());
    } else {
      gpu::stream_synchronize(m.stream);
      cuda_copy(m.master(p.name), host.data(), size_t(p.numel()) * sizeof(float));
    }
  }
  parameters_changed();
  gpu::stream_synchronize(m.stream);
}

void CudaModel::copy_parameters_to(float* host) const {
  check_own_storage("CudaModel::copy_parameters_to");
  const Impl& m = *impl_;
  gpu::stream_synchronize(m.stream);
  if (m.pure) return m.widen_to_host(static_cast<const bf16_t*>(m.params.data()), host, m.n_params);
  cuda_copy(host, m.params.data(), size_t(m.n_params) * sizeof(float));
}

void CudaModel::copy_gradients_to(float* host) const {
  check_own_storage("CudaModel::copy_gradients_to");
  const Impl& m = *impl_;
  m.settle_gradients();
  gpu::stream_synchronize(m.stream);
  if (m.bf16_gradients()) return m.widen_to_host(static_cast<const bf16_t*>(m.grads.data()), host, m.n_params);
  cuda_copy(host, m.grads.data(), size_t(m.n_params) * sizeof(float));
}

void CudaModel::copy_logits_to(float* host) const {
  const Impl& m = *impl_;
  FLASHLM_CHECK(m.have_forward, "copy_logits_to: call forward() first");
  const int64_t d = m.c.d_model, V = m.c.vocab;
  // The logits exist one chunk at a time: recomputed here from the final norm's output, as backward() does.
  Buffer staging = Buffer::allocate(size_t(m.head_chunk * V) * sizeof(float), Device::cuda, "logits (fp32 copy)");
  with_precision(m.precision, [&](auto zero) {
    using T = decltype(zero);
    for (int64_t r0 = 0; r0 < m.n; r0 += m.head_chunk) {
      const int64_t rows = std::min(m.head_chunk, m.n - r0);
      linear_forward_cuda(m.a<T>(m.A.h_f) + r0 * d, m.weight("lm_head.weight"), m.logits.data(), rows, d, V,
                          m.precision, m.stream);
      gpu::cast_to_f32<T>(static_cast<const T*>(m.logits.data()), static_cast<float*>(staging.data()), rows * V,
                          m.stream);
      gpu::stream_synchronize(m.stream);
      cuda_copy(host + r0 * V, staging.data(), size_t(rows * V) * sizeof(float));
    }
  });
}

void CudaModel::forward_block(int64_t l, BlockPass pass) {
  Impl& m = *impl_;
  const ModelConfig& c = m.c;
  const int64_t n = m.n, d = c.d_model, f = c.d_ff, hd = c.head_dim();
  const BlockActivations& L = m.A.blocks[size_t(l)];
  const DType dt = m.precision;
  const float eps = float(c.norm_eps);
  const std::string p = fmt::format("layers.{}.", l);
  ScopedRange layer_range(pass == BlockPass::full ? "layer.forward" : "layer.recompute");
  parameters_needed(p);  // the recomputation waits for (FSDP: gathers) the block's weights as the forward does
  with_precision(dt, [&](auto zero) {
    using T = decltype(zero);
    // FP8: the RMSNorm and SwiGLU outputs' amax come from their kernels (null otherwise).
    float* h1_amax = m.fp8_produced_amax(l, Fp8Produced::h1);
    float* h2_amax = m.fp8_produced_amax(l, Fp8Produced::h2);
    float* s_amax = m.fp8_produced_amax(l, Fp8Produced::s);
    gpu::rmsnorm_forward<T>(m.a<T>(L.x_in), m.gain(p + "ln1.weight"), m.a<T>(L.h1), m.f(L.rstd1), n, d, eps, m.stream,
                            h1_amax);
    // q, k, v = h1 · [wq; wk; wv]ᵀ: the three weights lie one after the other in every flat buffer.
    T* qkv = m.a<T>(L.q);
    if (!m.fp8_forward<T>(m.a<T>(L.h1), p + "attn.q_proj.weight", nullptr, qkv, d, 3 * d, false, h1_amax)) {
      linear_forward_cuda(m.a<T>(L.h1), m.weight(p + "attn.q_proj.weight"), qkv, n, d, 3 * d, dt, m.stream);
    }
    // q and k rotated in one pass, as 2·heads heads per token.
    gpu::rope_forward<T>(qkv, m.rope_cos(), m.rope_sin(), m.batch, m.seq, 2 * c.heads, hd, m.stream, 3 * d);
    if (pass != BlockPass::without_attention) {
      ScopedRange attention_range("attention.forward");
      attention_forward(qkv_view(qkv, 0, dt, m.batch, m.seq, c.heads, hd),
                        qkv_view(qkv, 1, dt, m.batch, m.seq, c.heads, hd),
                        qkv_view(qkv, 2, dt, m.batch, m.seq, c.heads, hd),
                        heads_view(m.a<T>(L.attn), dt, m.batch, m.seq, c.heads, hd),
                        TensorView::contiguous(m.f(L.lse), DType::f32, {m.batch, c.heads, m.seq}, Device::cuda),
                        m.attention_options());
    }
    // The residual stream's additions are the GEMMs' epilogues (C = the stream, beta = 1), rounded once.
    if (!m.fp8_forward<T>(m.a<T>(L.attn), p + "attn.output_proj.weight", m.a<T>(L.x_in), m.a<T>(L.x_mid), d, d)) {
      linear_forward_residual_cuda(m.a<T>(L.attn), m.weight(p + "attn.output_proj.weight"), m.a<T>(L.x_in),
                                   m.a<T>(L.x_mid), n, d, d, dt, m.stream);
    }
    gpu::rmsnorm_forward<T>(m.a<T>(L.x_mid), m.gain(p + "ln2.weight"), m.a<T>(L.h2), m.f(L.rstd2), n, d, eps,
                            m.stream, h2_amax);
    // u = h2 · w1ᵀ and g = h2 · w3ᵀ as one strided-batched GEMM (w2 lies between w1 and w3 in the layout).
    if (!m.fp8_forward<T>(m.a<T>(L.h2), p + "ffn.w1.weight", nullptr, m.a<T>(L.u), d, f, false, h2_amax)) {
      linear_forward_pair_cuda(m.a<T>(L.h2), m.weight(p + "ffn.w1.weight"), m.weight(p + "ffn.w3.weight"),
                               m.a<T>(L.u), m.a<T>(L.g), n, d, f, dt, m.stream);
    } else {
      m.fp8_forward<T>(m.a<T>(L.h2), p + "ffn.w3.weight", nullptr, m.a<T>(L.g), d, f, /*same_input*/ true);
    }
    gpu::swiglu_forward<T>(m.a<T>(L.u), m.a<T>(L.g), m.a<T>(L.s), n * f, m.stream, s_amax);
    if (pass == BlockPass::full) {  // a recomputation needs only what the block computed inside
      // The residual stream leaves into the next block's input (or x_out).
      T* x_next = m.a<T>(l + 1 < c.layers ? m.A.blocks[size_t(l + 1)].x_in : m.A.x_out);
      if (!m.fp8_forward<T>(m.a<T>(L.s), p + "ffn.w2.weight", m.a<T>(L.x_mid), x_next, f, d, false, s_amax)) {
        linear_forward_residual_cuda(m.a<T>(L.s), m.weight(p + "ffn.w2.weight"), m.a<T>(L.x_mid), x_next, n, f, d, dt,
                                     m.stream);
      }
    }
  });
  parameters_done(p);
}

double CudaModel::forward(const int32_t* host_tokens, const int32_t* host_targets) {
  Impl& m = *impl_;
  m.upload_batch(host_tokens, host_targets);
  queue_forward();
  std::vector<float> rows(static_cast<size_t>(m.n));
  gpu::stream_synchronize(m.stream);
  cuda_copy(rows.data(), m.row_loss.data(), rows.size() * sizeof(float));
  return m.mean_loss(rows.data());
}

void CudaModel::queue_forward() {
  Impl& m = *impl_;
  const ModelConfig& c = m.c;
  const int64_t n = m.n, d = c.d_model, V = c.vocab;
  memory_set_phase("forward");
  ScopedRange range("forward");
  // The weights may have changed since the last pass: cast them afresh (their amaxes reduced here at once).
  if (m.fp8) {
    if (!m.fp8->weight_copies_current()) m.restore_fp8_weights_bf16();  // their casts read the bf16 copy
    m.fp8->begin_pass(m.fp8_pass_weights(), m.stream);
  }
  const auto* tokens = static_cast<const int32_t*>(m.tokens.data());
  const auto* targets = static_cast<const int32_t*>(m.targets.data());
  const DType dt = m.precision;
  auto* row_loss = static_cast<float*>(m.row_loss.data());

  with_precision(dt, [&](auto zero) {
    using T = decltype(zero);
    parameters_needed("token_embeddings.");
    T* x0 = m.a<T>(m.A.blocks[0].x_in);
    if constexpr (std::is_same_v<T, bf16_t>) {
      if (m.pure) {
        gpu::embedding_forward_bf16(m.pure_param("token_embeddings.weight"), tokens, x0, n, d, V, m.stream);
      } else {
        gpu::embedding_forward<T>(m.master("token_embeddings.weight"), tokens, x0, n, d, V, m.stream);
      }
    } else {
      gpu::embedding_forward<T>(m.master("token_embeddings.weight"), tokens, x0, n, d, V, m.stream);
    }
    parameters_done("token_embeddings.");
  });
  for (int64_t l = 0; l < c.layers; ++l) forward_block(l, BlockPass::full);
  // The working set now holds the last segment's blocks: the backward starts without recomputing them.
  m.materialized_segment = m.A.blocks.back().segment;
  with_precision(dt, [&](auto zero) {
    using T = decltype(zero);
    ScopedRange head_range("head.forward");  // final norm, then the LM head and the loss chunk by chunk
    parameters_needed("ln_final.");
    gpu::rmsnorm_forward<T>(m.a<T>(m.A.x_out), m.gain("ln_final.weight"), m.a<T>(m.A.h_f), m.f(m.A.rstd_f), n, d,
                            float(c.norm_eps), m.stream);
    parameters_done("ln_final.");
    parameters_needed("lm_head.");
    gpu::lm_head_loss_forward_backward<T>(m.a<T>(m.A.h_f), static_cast<const T*>(m.weight("lm_head.weight")), targets, n,
                                          d, V, m.head_chunk, 1.0f, row_loss, nullptr, nullptr,
                                          static_cast<T*>(m.logits.data()), m.stream);
    parameters_done("lm_head.");
  });
  m.have_forward = true;
}

void CudaModel::backward() {
  Impl& m = *impl_;
  FLASHLM_CHECK(m.have_forward, "backward: call forward() first");
  // After zero_grad() this backward's gradients are the whole gradients: written over the stale arrays.
  // Otherwise it accumulates onto the (clipped, if a clip is pending) gradients there.
  const bool overwrite = m.zero_pending;
  if (!overwrite) m.apply_pending_clip();
  // The norm stream may still read the previous gradients: this backward writes them only after it.
  const bool overlap_norms = m.norms && !has_gradient_ready_hook();
  m.norms_current = false;
  // (A captured step starts with the norm stream idle: train_step waits for it before each launch.)
  if (overlap_norms && !m.capturing) m.norms->join(m.stream);
  const ModelConfig& c = m.c;
  const int64_t n = m.n, d = c.d_model, f = c.d_ff, hd = c.head_dim(), V = c.vocab;
  const auto* targets = static_cast<const int32_t*>(m.targets.data());
  const auto* tokens = static_cast<const int32_t*>(m.tokens.data());
  const float* rope_cos = m.rope_cos();
  const float* rope_sin = m.rope_sin();
  const AttentionOptions attn = m.attention_options();
  const DType dt = m.precision;
  memory_set_phase("backward");
  ScopedRange range("backward");

  // Adds to the gradient of `name` what produce(gradient, accumulate) computes, then reports it final. A
  // producer that can write over its array (`can_overwrite`: the GEMMs, beta = 0, or beta = 1 to add) is told
  // accumulate = false when the gradient is still to be zeroed (zero_grad deferred); the others get an array
  // zeroed first and always accumulate. The array: the fp32 gradient itself; with bf16 gradients beside fp32
  // masters (ModelOptions::grad_dtype) the bf16 gradient itself for a GEMM (its fp32 sum rounded once, the
  // stored value added before that rounding when it accumulates); otherwise, and for every producer of
  // bf16-pure, the fp32 staging buffer holding the bf16 gradient widened, rounded back once. So whatever sums
  // several contributions (the embedding's rows, the head's chunks, the gains' tokens) sums them in fp32.
  // add_to_gradients: the same for parameters that lie one after the other in the layout (q, k, v), whose
  // gradients one producer computes as one array; each is then reported final in layout order.
  auto report_final = [&](const std::string& name) {
    if (overlap_norms) m.queue_partial_norm(m.index.at(name));
    gradient_ready(name);
  };
  auto add_to_gradients = [&](std::initializer_list<std::string> names, bool can_overwrite, auto&& produce) {
    const std::string& first = *names.begin();
    int64_t count = 0;
    for (const std::string& name : names) {
      FLASHLM_CHECK(m.info(name).offset == m.info(first).offset + count,
                    "backward: '{}' does not follow '{}' in the parameter layout", name, first);
      count += m.info(name).numel();
    }
    const bool staged = m.bf16_gradients() && !(can_overwrite && m.mixed_bf16_gradients());
    if (!staged) {
      const WeightGrad dw = m.stored_grad(first);
      if (overwrite && !can_overwrite) gpu::memset_async(dw.data, 0, size_t(count) * sizeof(float), m.stream);
      produce(dw, !(overwrite && can_overwrite));
    } else {
      FLASHLM_CHECK(count <= m.largest_gradient, "backward: {} gradients outgrow the staging buffer", count);
      auto* dw = static_cast<float*>(m.staging.data());
      if (!overwrite) gpu::cast_to_f32<bf16_t>(m.bf16_grad(first), dw, count, m.stream);
      if (overwrite && !can_overwrite) gpu::memset_async(dw, 0, size_t(count) * sizeof(float), m.stream);
      produce(WeightGrad(dw), !(overwrite && can_overwrite));
      gpu::cast_from_f32<bf16_t>(dw, m.bf16_grad(first), count, m.stream);
    }
    for (const std::string& name : names) report_final(name);
  };
  // A producer that accumulates in fp32 (can_overwrite false: never handed a bf16 array).
  auto fp32_gradient = [](const WeightGrad& dw) {
    FLASHLM_CHECK(dw.dtype == DType::f32, "backward: an accumulating kernel was handed a {} gradient",
                  dtype_name(dw.dtype));
    return static_cast<float*>(dw.data);
  };
  auto add_to_gradient = [&](const std::string& name, bool can_overwrite, auto&& produce) {
    add_to_gradients({name}, can_overwrite, produce);
  };

  with_precision(dt, [&](auto zero) {
    using T = decltype(zero);
    T* s0 = static_cast<T*>(m.scratch.data());
    const int64_t nd = aligned_elements(n * d), nf = aligned_elements(n * f);
    // dqkv: the gradients of q, k and v as one [n, 3d] array (qkv_view), over three nd-sized slots.
    T *dx = s0, *dh = s0 + nd, *dqkv = s0 + 2 * nd, *dattn = s0 + 5 * nd;
    T *du = s0 + 6 * nd, *dg = du + nf, *ds = dg + nf;
    auto linear_backward = [&](const T* dy, const T* x, const std::string& w, T* dxo, int64_t in, int64_t out,
                               bool accumulate, bool same_input = false, const float* dy_amax = nullptr) {
      add_to_gradient(w, true, [&](WeightGrad dw, bool accumulate_dw) {
        if (m.fp8_backward<T>(dy, x, w, dxo, dw, in, out, accumulate, accumulate_dw, same_input, dy_amax)) return;
        linear_backward_cuda(dy, x, m.weight(w), dxo, dw, n, in, out, dt, accumulate, m.stream, false, accumulate_dw);
      });
    };
    // dxo_amax (FP8; null: none): the amax of the residual gradient it leaves, for the product that reads it next.
    auto rmsnorm_backward = [&](const T* dy, const T* x, const std::string& gain, const float* rstd, T* dxo,
                                float* dxo_amax) {
      add_to_gradient(gain, false, [&](WeightGrad dgain, bool) {
        gpu::rmsnorm_backward<T>(dy, x, m.gain(gain), rstd, dxo, fp32_gradient(dgain), n, d, m.stream, dxo_amax);
      });
    };

    {
      ScopedRange head_range("head.backward");  // loss and LM head chunk by chunk, then the final norm
      // The fused head again, now with gradients (the forward kept no logits): each chunk's logits, their
      // gradient times the loss scale, the chunk's rows of dh and its share of the head's weight gradient.
      parameters_needed("lm_head.");
      gradients_needed("lm_head.");
      add_to_gradient("lm_head.weight", false, [&](WeightGrad dw, bool) {
        gpu::lm_head_loss_forward_backward<T>(m.a<T>(m.A.h_f), static_cast<const T*>(m.weight("lm_head.weight")),
                                              targets, n, d, V, m.head_chunk, float(m.scaler->scale() / double(n)),
                                              nullptr, dh, fp32_gradient(dw), static_cast<T*>(m.logits.data()),
                                              m.stream);
      });
      parameters_done("lm_head.");
      gpu::memset_async(dx, 0, size_t(n * d) * sizeof(T), m.stream);
      parameters_needed("ln_final.");
      gradients_needed("ln_final.");
      rmsnorm_backward(dh, m.a<T>(m.A.x_out), "ln_final.weight", m.f(m.A.rstd_f), dx,
                       m.fp8_produced_amax(c.layers - 1, Fp8Produced::dres_ffn));
      parameters_done("ln_final.");
    }
    for (int64_t l = c.layers - 1; l >= 0; --l) {
      const BlockActivations& L = m.A.blocks[size_t(l)];
      if (L.segment >= 0 && L.segment != m.materialized_segment) {
        // Recompute the segment from its kept input; its last block (this one) stops before its output.
        for (int64_t j = L.segment; j < l; ++j) forward_block(j, BlockPass::full);
        forward_block(l, m.A.recompute.kind == RecomputePlan::Kind::selective ? BlockPass::without_attention
                                                                              : BlockPass::without_output);
        m.materialized_segment = L.segment;
      }
      ScopedRange layer_range("layer.backward");
      const std::string p = fmt::format("layers.{}.", l);
      parameters_needed(p);
      gradients_needed(p);
      linear_backward(dx, m.a<T>(L.s), p + "ffn.w2.weight", ds, f, d, false, false,
                      m.fp8_produced_amax(l, Fp8Produced::dres_ffn));
      float* du_amax = m.fp8_produced_amax(l, Fp8Produced::du);
      float* dg_amax = m.fp8_produced_amax(l, Fp8Produced::dg);
      gpu::swiglu_backward<T>(ds, m.a<T>(L.u), m.a<T>(L.g), du, dg, n * f, m.stream, du_amax, dg_amax);
      const std::string w1 = p + "ffn.w1.weight", w3 = p + "ffn.w3.weight";
      if (m.pure || m.fp8) {  // bf16-pure stages one contiguous range of gradients at a time; fp8: no pair GEMMs
        linear_backward(du, m.a<T>(L.h2), w1, dh, d, f, false, false, du_amax);
        linear_backward(dg, m.a<T>(L.h2), w3, dh, d, f, true, /*same_input*/ true, dg_amax);
      } else {
        // dh = du · w1 + dg · w3, then both weight gradients as one strided-batched GEMM over the fp32
        // gradients (w2's, between them, is final already and left alone), written over them after a
        // zero_grad() as the GEMMs above do.
        linear_backward_cuda(du, nullptr, m.weight(w1), dh, nullptr, n, d, f, dt, false, m.stream);
        linear_backward_cuda(dg, nullptr, m.weight(w3), dh, nullptr, n, d, f, dt, true, m.stream);
        linear_weight_grad_pair_cuda(du, dg, m.a<T>(L.h2), m.stored_grad(w1), m.stored_grad(w3), n, d, f, dt,
                                     !overwrite, m.stream);
        report_final(w1);
        report_final(w3);
      }
      float* dres_attn_amax = m.fp8_produced_amax(l, Fp8Produced::dres_attn);
      rmsnorm_backward(dh, m.a<T>(L.x_mid), p + "ln2.weight", m.f(L.rstd2), dx, dres_attn_amax);
      linear_backward(dx, m.a<T>(L.attn), p + "attn.output_proj.weight", dattn, d, d, false, false, dres_attn_amax);
      {
        ScopedRange attention_range("attention.backward");
        T* qkv = m.a<T>(L.q);
        attention_backward(qkv_view(qkv, 0, dt, m.batch, m.seq, c.heads, hd),
                           qkv_view(qkv, 1, dt, m.batch, m.seq, c.heads, hd),
                           qkv_view(qkv, 2, dt, m.batch, m.seq, c.heads, hd),
                           heads_view(m.a<T>(L.attn), dt, m.batch, m.seq, c.heads, hd),
                           TensorView::contiguous(m.f(L.lse), DType::f32, {m.batch, c.heads, m.seq}, Device::cuda),
                           heads_view(dattn, dt, m.batch, m.seq, c.heads, hd),
                           qkv_view(dqkv, 0, dt, m.batch, m.seq, c.heads, hd),
                           qkv_view(dqkv, 1, dt, m.batch, m.seq, c.heads, hd),
                           qkv_view(dqkv, 2, dt, m.batch, m.seq, c.heads, hd),
                           attn);
      }
      // dq and dk rotated back; with FP8 the kernel reads dv too, for the amax of the whole [n, 3d] dqkv.
      float* dqkv_amax = m.fp8_produced_amax(l, Fp8Produced::dqkv);
      gpu::rope_backward<T>(dqkv, rope_cos, rope_sin, m.batch, m.seq, 2 * c.heads, hd, m.stream, 3 * d, dqkv_amax,
                            3 * c.heads);
      // dh = [dq dk dv] · [wq; wk; wv] and the three weight gradients as one [3d, d] product.
      add_to_gradients({p + "attn.q_proj.weight", p + "attn.k_proj.weight", p + "attn.v_proj.weight"}, true,
                       [&](WeightGrad dw, bool accumulate_dw) {
                         if (m.fp8_backward<T>(dqkv, m.a<T>(L.h1), p + "attn.q_proj.weight", dh, dw, d, 3 * d, false,
                                               accumulate_dw, false, dqkv_amax)) {
                           return;
                         }
                         linear_backward_cuda(dqkv, m.a<T>(L.h1), m.weight(p + "attn.q_proj.weight"), dh, dw, n, d,
                                              3 * d, dt, false, m.stream, false, accumulate_dw);
                       });
      // Layer 0's residual gradient goes to the embedding's backward, not to an FP8 product.
      rmsnorm_backward(dh, m.a<T>(L.x_in), p + "ln1.weight", m.f(L.rstd1), dx,
                       l > 0 ? m.fp8_produced_amax(l - 1, Fp8Produced::dres_ffn) : nullptr);
      parameters_done(p);
    }
    gradients_needed("token_embeddings.");
    add_to_gradient("token_embeddings.weight", false, [&](WeightGrad dtable, bool) {
      gpu::embedding_backward<T>(dx, tokens, fp32_gradient(dtable), n, d, V, m.stream);
    });
  });
  m.have_forward = false;  // the logits buffer now holds a gradient; forward() again before backward()
  m.zero_pending = false;
  m.norms_current = overlap_norms;  // every parameter's gradient went through add_to_gradient
}

void CudaModel::zero_grad() {
  // Deferred (Impl::zero_pending): the next backward writes over the gradients instead of adding to zeros.
  impl_->pending_clip = 1.0f;
  impl_->zero_pending = true;
}

bool CudaModel::unscale_gradients() {
  Impl& m = *impl_;
  if (m.precision != DType::f16) return true;
  m.settle_gradients();
  auto* count = reinterpret_cast<int*>(static_cast<char*>(m.reduce_out.data()) + sizeof(double));
  gpu::count_nonfinite<float>(static_cast<float*>(m.grads.data()), m.n_params, count, m.stream);
  int bad = 0;
  gpu::stream_synchronize(m.stream);
  cuda_copy(&bad, count, sizeof bad);
  if (bad > 0) return m.scaler->update(true);
  gpu::scale_inplace(static_cast<float*>(m.grads.data()), m.n_params, float(1.0 / m.scaler->scale()), m.stream);
  return m.scaler->update(false);
}

double CudaModel::gradient_norm() const {
  check_own_storage("CudaModel::gradient_norm");
  const Impl& m = *impl_;
  m.settle_gradients();
  if (m.norms_current) {  // summed on the host in layout order
    std::vector<double> partial(m.layout.size());
    gpu::stream_synchronize(m.norms->stream);
    cuda_copy(partial.data(), m.partial_norms.data(), partial.size() * sizeof(double));
    double ss = 0;
    for (double p : partial) ss += p;
    return std::sqrt(ss);
  }
  auto* out = static_cast<double*>(m.reduce_out.data());
  if (m.bf16_gradients()) {
    gpu::squared_norm<bf16_t>(static_cast<const bf16_t*>(m.grads.data()), m.n_params, out, m.stream);
  } else {
    gpu::squared_norm<float>(static_cast<const float*>(m.grads.data()), m.n_params, out, m.stream);
  }
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

void CudaModel::release_optimizer_state() {
  Impl& m = *impl_;
  if (!m.adam->allocated()) return;
  gpu::stream_synchronize(m.stream);  // the last AdamW step may still be reading them
  m.graph.reset();                    // a captured step would step the freed moments
  m.adam->release();
}

void CudaModel::synchronize() const { gpu::stream_synchronize(impl_->stream); }

void CudaModel::save_state(std::span<float> params, std::span<float> m, std::span<float> v) const {
  check_own_storage("CudaModel::save_state");
  check_state_arrays("CudaModel::save_state", params.size(), m.size(), v.size(), 0);
  const Impl& s = *impl_;
  copy_parameters_to(params.data());
  // The optimizer's FP8 weight copies are scaled from the amax before the last step, which a checkpoint does not
  // hold: a run resumed from it casts its weights in its first pass. So does this run after writing it, so that
  // the two continue with the same bits (ModelOptions::fp8_optimizer_weight_cast).
  if (s.fp8 && s.fp8->weight_copies_current()) s.weights_changed();
  if (s.pure && s.adam->allocated()) {  // widened to fp32: the checkpoint format is the same for every precision
    s.widen_to_host(s.adam->m_as<bf16_t>(), m.data(), s.n_params);
    s.widen_to_host(s.adam->v_as<bf16_t>(), v.data(), s.n_params);
    return;
  }
  gpu::stream_synchronize(s.stream);
  s.adam->save(m, v);
}

void CudaModel::load_state(std::span<const float> params, std::span<const float> m, std::span<const float> v,
                           int64_t optimizer_steps) {
  check_own_storage("CudaModel::load_state");
  check_state_arrays("CudaModel::load_state", params.size(), m.size(), v.size(), optimizer_steps);
  Impl& s = *impl_;
  if (s.bf16_moments()) check_bf16_moments("CudaModel::load_state", m, v);
  load_parameters(params.data());  // also refreshes what is derived from the parameters
  if (s.pure && !s.bf16_moments()) {  // any fp32 value, rounded on the device as the bf16-pure step rounds
    s.adam->allocate(s.stream);
    gpu::stream_synchronize(s.stream);  // the zeroing above is queued on the model's stream
    s.narrow_from_host(m.data(), s.adam->m_as<bf16_t>(), s.n_params);
    s.narrow_from_host(v.data(), s.adam->v_as<bf16_t>(), s.n_params);
  } else {  // exact for bf16 moments: check_bf16_moments saw only bf16 values
    s.adam->load(m, v, s.stream);
  }
  s.adam->set_steps(optimizer_steps);
}

void CudaModel::adamw_step(const AdamWConfig& cfg, double lr) {
  Impl& m = *impl_;
  memory_set_phase("optimizer");
  ScopedRange range("optimizer_step");
  check_own_storage("CudaModel::adamw_step");
  if (m.zero_pending) m.settle_gradients();  // a step on zeroed gradients (the clip is applied in the kernel)
  m.adam->allocate(m.stream);
  m.adam->begin_step();
  m.queue_adamw(cfg, lr, nullptr);
  // pending_clip stays: the stored gradients are still unclipped for any later reader.
}

}  // namespace flashlm
