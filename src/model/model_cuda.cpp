// The LM on one GPU, step by step as model_cpu.cpp, with mixed precision: activations in T (fp32, bf16,
// fp16), everything that accumulates across steps in fp32 — or, bf16-pure, everything in bf16 with each
// backward's weight gradient accumulated in an fp32 buffer and rounded once. Host code: the layer kernels
// are in model/cuda/ (ops_cuda.h; bf16_pure.h for the pure-bf16 ones), AdamW in optim/, the GEMMs in
// gemm_cuda.cpp, attention in attention/cuda/.
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
#include "model/gemm_cuda.h"
#include "model/lm_head.h"
#include "model/ops_cpu.h"
#include "model/ops_cuda.h"
#include "optim/optimizer.h"

namespace flashlm {

namespace {

// A stream of the model's own and the two events that order it against the model's stream (see
// Impl::norms), destroyed after its queued work has run.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;  // recorded on the model's stream: what the side stream waits for
  cudaEvent_t done = nullptr;   // recorded on the side stream: what the model's stream waits for
  SideStream() {
    FLASHLM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    FLASHLM_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    FLASHLM_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~SideStream() {
    cudaStreamSynchronize(stream);
    cudaEventDestroy(done);
    cudaEventDestroy(ready);
    cudaStreamDestroy(stream);
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  // The side stream waits for what `main` has queued so far.
  void follow(void* main) const {
    FLASHLM_CUDA_CHECK(cudaEventRecord(ready, static_cast<cudaStream_t>(main)), "cudaEventRecord");
    FLASHLM_CUDA_CHECK(cudaStreamWaitEvent(stream, ready, 0), "cudaStreamWaitEvent");
  }
  // `main` waits for what the side stream has queued so far.
  void join(void* main) const {
    FLASHLM_CUDA_CHECK(cudaEventRecord(done, stream), "cudaEventRecord");
    FLASHLM_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(main), done, 0), "cudaStreamWaitEvent");
  }
};

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

// Host memory the GPU reads and writes while a graph runs (the copies of a graph need page-locked memory:
// a copy from pageable memory would read the host array as it was at capture).
template <class T>
struct PinnedArray {
  T* data = nullptr;
  explicit PinnedArray(size_t count) {
    FLASHLM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&data), count * sizeof(T)), "cudaMallocHost");
  }
  ~PinnedArray() { cudaFreeHost(data); }
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
};

// train_step as one CUDA graph (ModelOptions::cuda_graph). The step runs on a stream of its own, created
// blocking so that it stays ordered with the legacy default stream the model may otherwise use (which
// cannot be captured); its first call runs eagerly there (it allocates the moments, the cuBLASLt plans and
// that stream's workspace, none of which may happen inside a capture), the second captures and launches.
// The host arrays: `in` (this step's scalars, copied to the device by the graph's first node), `out` (the
// scalars after clipping: the norm and the factor), `rows` (the per-token losses, copied back by the graph).
struct StepGraph {
  cudaStream_t stream = nullptr;
  cudaGraphExec_t exec = nullptr;
  bool warmed_up = false;
  std::string failure;  // why a capture failed: every later step is eager
  Buffer scalars;       // DeviceStepScalars on the device
  std::unique_ptr<PinnedArray<DeviceStepScalars>> in, out;
  std::unique_ptr<PinnedArray<float>> rows;
  // The host state a replay leaves behind (as the captured step's host code left it).
  bool norms_current = false;
  int64_t materialized_segment = -1;
  int64_t replays = 0;
  StepGraph() { FLASHLM_CUDA_CHECK(cudaStreamCreate(&stream), "cudaStreamCreate (train-step graph)"); }
  ~StepGraph() {
    cudaStreamSynchronize(stream);
    if (exec) cudaGraphExecDestroy(exec);
    cudaStreamDestroy(stream);
  }
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;
};

// Points the model's stream at another one for a scope.
struct StreamScope {
  void*& slot;
  void* saved;
  StreamScope(void*& s, void* to) : slot(s), saved(s) { slot = to; }
  ~StreamScope() { slot = saved; }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;
};

}  // namespace

struct CudaModel::Impl {
  ModelConfig c;
  int64_t batch, seq, n;
  DType precision;
  ModelOptions options;
  bool pure = false;  // bf16-pure: params, grads, adam_m, adam_v hold bf16
  void* stream;
  std::vector<ParameterInfo> layout;
  std::unordered_map<std::string, size_t> index;  // parameter name -> position in layout
  std::unordered_map<std::string, int64_t> gain_row;  // bf16-pure: RMSNorm gain name -> row of gains_f32
  int64_t n_params;
  // params_lp: the weights in `precision` (mixed bf16/fp16 only). staging (bf16-pure): an fp32 array as large
  // as the largest parameter, where a backward accumulates one parameter's gradient (and where widened
  // copies pass through); gains_f32 (bf16-pure): the RMSNorm gains widened, [2 layers + 1, d_model].
  Buffer params, grads, adam_m, adam_v, params_lp, staging, gains_f32;
  Buffer acts, acts_f32, logits, row_loss, scratch, tokens, targets, rope, reduce_out;
  ActivationLayout A;
  int64_t head_chunk = 0;
  int64_t largest_parameter = 0;
  int64_t largest_gradient = 0;  // bf16-pure: the staging buffer's elements (gradient_staging_elements)
  int64_t materialized_segment = -1;  // the segment whose blocks the recomputation working set holds
  int64_t adam_step = 0;
  double loss_scale = 1.0;
  int64_t good_steps = 0;
  // The clipping factor clip_gradients() chose and has not applied yet: adamw_step() applies it inside its
  // kernel (saving a read and a write of every gradient); any other reader of the gradients applies it
  // first (settle_gradients). Mutable: const readers (copies, norms) materialise it too.
  mutable float pending_clip = 1.0f;
  // zero_grad() deferred: the gradient arrays hold stale values that count as zero. The next backward
  // writes each gradient over them: the weight-gradient GEMMs with beta = 0, the others (embedding, LM
  // head, RMSNorm gains: 8% of xl's parameters) into an array zeroed first. So most of the memset of every
  // gradient (8 GB on xl) never runs. Any other reader zeroes them first (settle_gradients). Mutable: const
  // readers settle them too.
  mutable bool zero_pending = false;
  // The gradient norm, overlapped with the backward: as the backward finalises each gradient, its squared
  // norm (fp64, core/cuda/reduce.cuh's fixed order) is queued on a stream of its own that waits for it —
  // a memory-bound read beside the compute-bound GEMMs instead of a pass over every gradient after them.
  // partial_norms[i]: parameter i's Σ g². norms_current: they describe the gradients as they stand (set
  // by a backward that computed them all; dropped by anything that changes the gradients afterwards).
  // Not with a gradient-ready hook (data parallelism changes the gradients after the backward) nor fp16
  // (unscaling does), nor without ModelOptions::overlap_grad_norm.
  std::unique_ptr<SideStream> norms;
  Buffer partial_norms;
  mutable bool norms_current = false;
  bool have_forward = false;
  std::unique_ptr<StepGraph> graph;  // train_step's CUDA graph, from its first call on
  std::string graph_status;          // CudaModel::cuda_graph_status
  bool capturing = false;            // the step's host code is being captured, not run

  size_t elem() const { return dtype_size(precision); }
  size_t state_elem() const { return pure ? sizeof(bf16_t) : sizeof(float); }  // params, grads
  // The optimizer state beside fp32 masters in bf16 (ModelOptions::optimizer_state; bf16-pure's are too).
  bool bf16_moments() const { return options.optimizer_state != OptimizerState::fp32; }
  size_t moment_elem() const { return pure || bf16_moments() ? sizeof(bf16_t) : sizeof(float); }
  template <class T>
  T* a(int64_t offset) const {
    return static_cast<T*>(acts.data()) + offset;
  }
  float* f(int64_t offset) const { return static_cast<float*>(acts_f32.data()) + offset; }
  const ParameterInfo& info(const std::string& name) const {
    const auto it = index.find(name);
    FLASHLM_CHECK(it != index.end(), "CudaModel: no parameter named '{}'", name);
    return layout[it->second];
  }
  // Every parameter through the model's parameter_storage() table: its flat buffers, or FSDP's shards and
  // gathered parts (bf16-pure: `weight` is the bf16 parameter itself).
  const ParameterStorage* table = nullptr;
  bf16_t* pure_param(const std::string& name) const { return static_cast<bf16_t*>(stored(name).weight); }
  // bf16-pure with its own storage: the bf16 gradient the backward rounds its fp32 accumulator into. Under
  // FSDP's sharded storage the gradients are fp32 (the table's), reduce-scattered before any rounding.
  bool bf16_gradients() const { return pure && !options.external_parameters; }
  bf16_t* pure_grad(const std::string& name) const { return static_cast<bf16_t*>(grads.data()) + info(name).offset; }
  const ParameterStorage& stored(const std::string& name) const {
    const auto it = index.find(name);
    FLASHLM_CHECK(it != index.end(), "CudaModel: no parameter named '{}'", name);
    return table[it->second];
  }
  float* master(const std::string& name) const { return stored(name).master; }
  float* grad(const std::string& name) const { return stored(name).grad; }
  // The fp32 RMSNorm gain the norm kernels read: the master, or (bf16-pure) its widened copy. Under FSDP's
  // sharded storage a gain's bf16 value is resident only while its part is gathered, which is when the
  // forward or backward asks for it, so it is widened here, on the stream, instead of in refresh_gains.
  const float* gain(const std::string& name) const {
    if (!pure) return master(name);
    const auto it = gain_row.find(name);
    FLASHLM_CHECK(it != gain_row.end(), "CudaModel: '{}' is not an RMSNorm gain", name);
    float* row = static_cast<float*>(gains_f32.data()) + it->second * c.d_model;
    if (options.external_parameters) gpu::cast_to_f32<bf16_t>(pure_param(name), row, c.d_model, stream);
    return row;
  }
  const float* rope_cos() const { return static_cast<const float*>(rope.data()); }
  const float* rope_sin() const { return rope_cos() + c.context * (c.head_dim() / 2); }
  AttentionOptions attention_options() const {
    AttentionOptions o;
    o.impl = options.attention;
    o.causal = true;
    // By default the separate dQ pass, not fp32 atomics: a training step stays bit-reproducible, which
    // resuming from a checkpoint relies on (it costs the xl step some attention backward: docs/perf.md).
    o.deterministic = options.deterministic;
    o.stream = stream;
    return o;
  }
  // The weight the GEMMs read: the low-precision copy, the fp32 master itself, or the bf16 parameter.
  const void* weight(const std::string& name) const {
    if (pure) return pure_param(name);
    return stored(name).weight;
  }

  // The AdamW moments are allocated (zeroed) by the first adamw_step() or load_state(), as PyTorch's
  // optimizers do: a model that only runs forward, or whose optimizer state lives elsewhere (ZeRO-1's
  // shards), never holds them.
  void allocate_moments() {
    if (adam_m.data()) return;
    const size_t bytes = size_t(n_params) * moment_elem();
    const bool narrow = moment_elem() == sizeof(bf16_t);
    adam_m = Buffer::allocate(bytes, Device::cuda, narrow ? "AdamW first moment (bf16)" : "AdamW first moment");
    adam_v = Buffer::allocate(bytes, Device::cuda, narrow ? "AdamW second moment (bf16)" : "AdamW second moment");
    gpu::memset_async(adam_m.data(), 0, bytes, stream);
    gpu::memset_async(adam_v.data(), 0, bytes, stream);
  }
  // Calls fn(offset, count) over [0, total) in pieces that fit the staging buffer.
  template <class Fn>
  void in_staging_pieces(int64_t total, Fn&& fn) const {
    for (int64_t at = 0; at < total; at += largest_parameter) fn(at, std::min(largest_parameter, total - at));
  }
  // Before the gradients are read as they stand: the deferred zeroing, then the deferred clipping.
  void settle_gradients() const {
    if (!grads.data()) return;  // FSDP's sharded storage: the gradient buffers are FsdpParameters'
    if (zero_pending) {
      gpu::memset_async(grads.data(), 0, size_t(n_params) * state_elem(), stream);
      zero_pending = false;
      norms_current = false;
      pending_clip = 1.0f;
    }
    apply_pending_clip();
  }
  void apply_pending_clip() const {
    if (pending_clip == 1.0f) return;
    norms_current = false;
    if (!pure) {
      gpu::scale_inplace(static_cast<float*>(grads.data()), n_params, pending_clip, stream);
    } else {
      auto* g = static_cast<bf16_t*>(grads.data());
      auto* s = static_cast<float*>(staging.data());
      in_staging_pieces(n_params, [&](int64_t at, int64_t count) {
        gpu::cast_to_f32<bf16_t>(g + at, s, count, stream);
        gpu::scale_inplace(s, count, pending_clip, stream);
        gpu::cast_from_f32<bf16_t>(s, g + at, count, stream);
      });
    }
    pending_clip = 1.0f;
  }
  // Queues parameter i's squared norm on the norm stream, after what the model's stream has queued.
  void queue_partial_norm(size_t i) const {
    norms->follow(stream);
    const ParameterInfo& p = layout[i];
    double* out = static_cast<double*>(partial_norms.data()) + i;
    if (pure) {
      gpu::squared_norm<bf16_t>(static_cast<const bf16_t*>(grads.data()) + p.offset, p.numel(), out, norms->stream);
    } else {
      gpu::squared_norm<float>(static_cast<const float*>(grads.data()) + p.offset, p.numel(), out, norms->stream);
    }
  }
  // bf16-pure: the bf16 device array `src` of `count` values into host fp32, and back.
  void widen_to_host(const bf16_t* src, float* host, int64_t count) const {
    auto* s = static_cast<float*>(staging.data());
    in_staging_pieces(count, [&](int64_t at, int64_t piece) {
      gpu::cast_to_f32<bf16_t>(src + at, s, piece, stream);
      gpu::stream_synchronize(stream);
      cuda_copy(host + at, s, size_t(piece) * sizeof(float));
    });
  }
  void narrow_from_host(const float* host, bf16_t* dst, int64_t count) const {
    auto* s = static_cast<float*>(staging.data());
    in_staging_pieces(count, [&](int64_t at, int64_t piece) {
      gpu::stream_synchronize(stream);  // the previous piece's cast still reads the staging buffer
      cuda_copy(s, host + at, size_t(piece) * sizeof(float));
      gpu::cast_from_f32<bf16_t>(s, dst + at, piece, stream);
    });
    gpu::stream_synchronize(stream);
  }
  // The batch onto the device (checked first), once the previous step no longer reads it.
  void upload_batch(const int32_t* host_tokens, const int32_t* host_targets) const {
    for (int64_t i = 0; i < n; ++i) {
      FLASHLM_CHECK(host_tokens[i] >= 0 && host_tokens[i] < c.vocab,
                    "forward: tokens[{}] = {} outside [0, vocab = {})", i, host_tokens[i], c.vocab);
      FLASHLM_CHECK(host_targets[i] >= 0 && host_targets[i] < c.vocab,
                    "forward: targets[{}] = {} outside [0, vocab = {})", i, host_targets[i], c.vocab);
    }
    gpu::stream_synchronize(stream);  // the previous step may still read the token buffers
    cuda_copy(tokens.data(), host_tokens, size_t(n) * sizeof(int32_t));
    cuda_copy(targets.data(), host_targets, size_t(n) * sizeof(int32_t));
  }
  // The mean of the per-token losses (host values), summed in a fixed order.
  double mean_loss(const float* rows) const {
    double loss = 0;
    for (int64_t i = 0; i < n; ++i) loss += rows[i];
    return loss / double(n);
  }
  // AdamW over every parameter at step adam_step: with `fixed` scalars, or (live not null) with those the
  // kernels read from the device when they run (the graphed step).
  void queue_adamw(const AdamWConfig& cfg, double lr, const AdamWScalars* live) {
    if (pure) {
      auto* w = static_cast<bf16_t*>(params.data());
      const auto* g = static_cast<const bf16_t*>(grads.data());
      auto *mo = static_cast<bf16_t*>(adam_m.data()), *vo = static_cast<bf16_t*>(adam_v.data());
      if (live) {
        gpu::adamw_step_bf16_live(w, g, mo, vo, n_params, live, stream);
      } else {
        gpu::adamw_step_bf16(w, g, mo, vo, n_params, lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, adam_step,
                             stream, pending_clip);
      }
      refresh_gains();
      return;
    }
    with_precision(precision, [&](auto zero) {
      using T = decltype(zero);
      T* copy = nullptr;
      if constexpr (!std::is_same_v<T, float>) copy = static_cast<T*>(params_lp.data());
      auto* w = static_cast<float*>(params.data());
      const auto* g = static_cast<const float*>(grads.data());
      if (bf16_moments()) {
        auto *mo = static_cast<bf16_t*>(adam_m.data()), *vo = static_cast<bf16_t*>(adam_v.data());
        const MomentRounding rounding = moment_rounding();
        if (live) {
          gpu::adamw_step_bf16_moments_live<T>(w, g, mo, vo, n_params, live, rounding.stochastic, 0, copy, stream);
        } else {
          gpu::adamw_step_bf16_moments<T>(w, g, mo, vo, n_params, lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay,
                                          adam_step, rounding, 0, copy, stream, pending_clip);
        }
        return;
      }
      auto *mo = static_cast<float*>(adam_m.data()), *vo = static_cast<float*>(adam_v.data());
      if (live) {
        gpu::adamw_step_live<T>(w, g, mo, vo, n_params, live, copy, stream);
      } else {
        gpu::adamw_step<T>(w, g, mo, vo, n_params, lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, adam_step,
                           copy, stream, pending_clip);
      }
    });
  }
  MomentRounding moment_rounding() const {
    return {options.optimizer_state == OptimizerState::bf16_sr, options.moment_rounding_seed};
  }
  // bf16-pure: the widened RMSNorm gains the norm kernels read, after the parameters changed.
  void refresh_gains() const {
    if (!pure || options.external_parameters) return;  // sharded storage: gain() widens each at its use
    auto* out = static_cast<float*>(gains_f32.data());
    for (const auto& [name, row] : gain_row) {
      gpu::cast_to_f32<bf16_t>(pure_param(name), out + row * c.d_model, c.d_model, stream);
    }
  }
};

CudaModel::CudaModel(const ModelConfig& config, int64_t batch, int64_t seq, DType precision, AttentionImpl attention,
                     void* stream)
    : CudaModel(config, batch, seq, precision, ModelOptions::with_attention(attention), stream) {}

CudaModel::CudaModel(const ModelConfig& config, int64_t batch, int64_t seq, DType precision,
                     const ModelOptions& options, void* stream)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  config.validate();
  FLASHLM_CHECK(precision == DType::f32 || precision == DType::bf16 || precision == DType::f16,
                "CudaModel: precision {} is not supported (fp32, bf16 or fp16)", dtype_name(precision));
  FLASHLM_CHECK(!options.bf16_pure || precision == DType::bf16, "CudaModel: bf16-pure needs precision bf16, not {}",
                dtype_name(precision));
  options.check_optimizer_state();
  FLASHLM_CHECK(config.d_model % 8 == 0 && config.d_ff % 8 == 0 && config.vocab % 8 == 0,
                "CudaModel: d_model ({}), d_ff ({}) and vocab ({}) must be multiples of 8 (16-byte rows for the "
                "tensor cores)",
                config.d_model, config.d_ff, config.vocab);
  FLASHLM_CHECK(batch >= 1 && seq >= 1 && seq <= config.context, "CudaModel: batch {} and seq {} (context {})", batch,
                seq, config.context);
  // Refuse before allocating anything when the plan does not fit the free memory.
  check_memory_plan(plan_model_memory(config, batch, seq, Device::cuda, precision, options), cuda_free_memory_bytes(),
                    "the GPU");
  m.c = config;
  m.batch = batch;
  m.seq = seq;
  m.n = checked_mul(batch, seq, "CudaModel: tokens per step");
  m.precision = precision;
  m.options = options;
  m.pure = options.bf16_pure;
  m.stream = stream;
  m.layout = parameter_layout(config);
  for (size_t i = 0; i < m.layout.size(); ++i) {
    m.index.emplace(m.layout[i].name, i);
    m.largest_parameter = std::max(m.largest_parameter, m.layout[i].numel());
    if (m.layout[i].shape.size() == 1) m.gain_row.emplace(m.layout[i].name, int64_t(m.gain_row.size()));
  }
  m.n_params = m.layout.back().offset + m.layout.back().numel();
  m.loss_scale = precision == DType::f16 ? LanguageModel::kInitialLossScale : 1.0;

  const size_t pbytes = size_t(m.n_params) * m.state_elem();
  if (!options.external_parameters) {  // otherwise FSDP's shards hold them
    m.params = Buffer::allocate(pbytes, Device::cuda, m.pure ? "parameters (bf16)" : "parameters (fp32 master)");
    m.grads = Buffer::allocate(pbytes, Device::cuda, m.pure ? "gradients (bf16)" : "gradients (fp32)");
  }
  if (m.pure) {
    // The fp32 accumulator of the bf16 gradients (FSDP's sharded storage gives fp32 gradients instead).
    if (!options.external_parameters) {
      m.largest_gradient = gradient_staging_elements(config);
      m.staging = Buffer::allocate(size_t(m.largest_gradient) * sizeof(float), Device::cuda,
                                   "fp32 gradient accumulator");
    }
    m.gains_f32 = Buffer::allocate(m.gain_row.size() * size_t(config.d_model) * sizeof(float), Device::cuda,
                                   "RMSNorm gains (fp32)");
  } else if (precision != DType::f32 && !options.external_parameters) {
    m.params_lp = Buffer::allocate(size_t(m.n_params) * m.elem(), Device::cuda, "parameters (low precision)");
  }
  // bf16-pure: no masters, `weight` the bf16 parameters, no fp32 gradients (the model's are bf16).
  point_storage_at(m.pure ? nullptr : static_cast<float*>(m.params.data()),
                   m.pure ? m.params.data() : m.params_lp.data(), precision,
                   m.pure ? nullptr : static_cast<float*>(m.grads.data()));
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

const ModelConfig& CudaModel::config() const { return impl_->c; }
const std::vector<ParameterInfo>& CudaModel::layout() const { return impl_->layout; }
float* CudaModel::parameters() const {
  FLASHLM_CHECK(!impl_->pure, "CudaModel: a bf16-pure model keeps no fp32 parameters (data parallelism needs "
                              "--precision bf16, fp16 or fp32)");
  return static_cast<float*>(impl_->params.data());
}
float* CudaModel::gradients() const {
  FLASHLM_CHECK(!impl_->pure, "CudaModel: a bf16-pure model keeps no fp32 gradients (data parallelism needs "
                              "--precision bf16, fp16 or fp32)");
  impl_->settle_gradients();  // the caller may read them or add to them
  impl_->norms_current = false;
  return static_cast<float*>(impl_->grads.data());
}
bool CudaModel::bf16_pure() const { return impl_->pure; }

OptimizerState CudaModel::optimizer_state() const { return impl_->options.optimizer_state; }
bool CudaModel::external_parameters() const { return impl_->options.external_parameters; }
DType CudaModel::working_dtype() const {
  return impl_->pure || impl_->precision == DType::f32 ? DType::f32 : impl_->precision;
}

void CudaModel::check_own_storage(std::string_view caller) const {
  FLASHLM_CHECK(!impl_->options.external_parameters,
                "{}: this model keeps no flat parameters of its own (FSDP's sharded storage: use DdpModel's)", caller);
}
const RecomputePlan& CudaModel::recompute() const { return impl_->A.recompute; }
void* CudaModel::stream() const { return impl_->stream; }
int64_t CudaModel::parameter_count() const { return impl_->n_params; }
DType CudaModel::precision() const { return impl_->precision; }
double CudaModel::loss_scale() const { return impl_->loss_scale; }
int64_t CudaModel::loss_scale_good_steps() const { return impl_->good_steps; }
void CudaModel::restore_loss_scale(double scale, int64_t good_steps) {
  if (impl_->precision != DType::f16) return LanguageModel::restore_loss_scale(scale, good_steps);
  FLASHLM_CHECK(std::isfinite(scale) && scale > 0, "restore_loss_scale: scale {}, expected a finite positive number",
                scale);
  FLASHLM_CHECK(good_steps >= 0 && good_steps < kLossScaleGrowthInterval,
                "restore_loss_scale: good_steps {}, expected 0..{}", good_steps, kLossScaleGrowthInterval - 1);
  impl_->loss_scale = scale;
  impl_->good_steps = good_steps;
}

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
  if (impl_->precision == DType::f32 || impl_->pure) return read;
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
  return impl_->precision == DType::f32 || impl_->pure ? nullptr : impl_->params_lp.data();
}

void CudaModel::parameters_changed() {
  Impl& m = *impl_;
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
  if (m.pure) return m.widen_to_host(static_cast<const bf16_t*>(m.grads.data()), host, m.n_params);
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
    gpu::rmsnorm_forward<T>(m.a<T>(L.x_in), m.gain(p + "ln1.weight"), m.a<T>(L.h1), m.f(L.rstd1), n, d, eps, m.stream);
    // q, k, v = h1 · [wq; wk; wv]ᵀ: the three weights lie one after the other in every flat buffer.
    T* qkv = m.a<T>(L.q);
    linear_forward_cuda(m.a<T>(L.h1), m.weight(p + "attn.q_proj.weight"), qkv, n, d, 3 * d, dt, m.stream);
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
    linear_forward_residual_cuda(m.a<T>(L.attn), m.weight(p + "attn.output_proj.weight"), m.a<T>(L.x_in),
                                 m.a<T>(L.x_mid), n, d, d, dt, m.stream);
    gpu::rmsnorm_forward<T>(m.a<T>(L.x_mid), m.gain(p + "ln2.weight"), m.a<T>(L.h2), m.f(L.rstd2), n, d, eps,
                            m.stream);
    // u = h2 · w1ᵀ and g = h2 · w3ᵀ as one strided-batched GEMM (w2 lies between w1 and w3 in the layout).
    linear_forward_pair_cuda(m.a<T>(L.h2), m.weight(p + "ffn.w1.weight"), m.weight(p + "ffn.w3.weight"), m.a<T>(L.u),
                             m.a<T>(L.g), n, d, f, dt, m.stream);
    gpu::swiglu_forward<T>(m.a<T>(L.u), m.a<T>(L.g), m.a<T>(L.s), n * f, m.stream);
    if (pass == BlockPass::full) {  // a recomputation needs only what the block computed inside
      // The residual stream leaves into the next block's input (or x_out).
      T* x_next = m.a<T>(l + 1 < c.layers ? m.A.blocks[size_t(l + 1)].x_in : m.A.x_out);
      linear_forward_residual_cuda(m.a<T>(L.s), m.weight(p + "ffn.w2.weight"), m.a<T>(L.x_mid), x_next, n, f, d, dt,
                                   m.stream);
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

  // Adds to the gradient of `name` what produce(fp32 gradient, accumulate) computes, then reports it final:
  // in place into the fp32 gradient, or (bf16-pure) into the staging buffer holding the bf16 gradient
  // widened, rounded back once. A producer that can write over its array (`can_overwrite`: the GEMMs'
  // beta = 0) is told accumulate = false when the gradient is still to be zeroed (zero_grad deferred);
  // the others get an array zeroed first and always accumulate.
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
    const bool bf16 = m.bf16_gradients();
    FLASHLM_CHECK(!bf16 || count <= m.largest_gradient, "backward: {} gradients outgrow the staging buffer", count);
    float* dw = bf16 ? static_cast<float*>(m.staging.data()) : m.grad(first);
    if (bf16 && !overwrite) gpu::cast_to_f32<bf16_t>(m.pure_grad(first), dw, count, m.stream);
    if (overwrite && !can_overwrite) gpu::memset_async(dw, 0, size_t(count) * sizeof(float), m.stream);
    produce(dw, !(overwrite && can_overwrite));
    if (bf16) gpu::cast_from_f32<bf16_t>(dw, m.pure_grad(first), count, m.stream);
    for (const std::string& name : names) report_final(name);
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
                               bool accumulate) {
      add_to_gradient(w, true, [&](float* dw, bool accumulate_dw) {
        linear_backward_cuda(dy, x, m.weight(w), dxo, dw, n, in, out, dt, accumulate, m.stream, false, accumulate_dw);
      });
    };
    auto rmsnorm_backward = [&](const T* dy, const T* x, const std::string& gain, const float* rstd, T* dxo) {
      add_to_gradient(gain, false, [&](float* dgain, bool) {
        gpu::rmsnorm_backward<T>(dy, x, m.gain(gain), rstd, dxo, dgain, n, d, m.stream);
      });
    };

    {
      ScopedRange head_range("head.backward");  // loss and LM head chunk by chunk, then the final norm
      // The fused head again, now with gradients (the forward kept no logits): each chunk's logits, their
      // gradient times the loss scale, the chunk's rows of dh and its share of the head's weight gradient.
      parameters_needed("lm_head.");
      gradients_needed("lm_head.");
      add_to_gradient("lm_head.weight", false, [&](float* dw, bool) {
        gpu::lm_head_loss_forward_backward<T>(m.a<T>(m.A.h_f), static_cast<const T*>(m.weight("lm_head.weight")),
                                              targets, n, d, V, m.head_chunk, float(m.loss_scale / double(n)),
                                              nullptr, dh, dw, static_cast<T*>(m.logits.data()), m.stream);
      });
      parameters_done("lm_head.");
      gpu::memset_async(dx, 0, size_t(n * d) * sizeof(T), m.stream);
      parameters_needed("ln_final.");
      gradients_needed("ln_final.");
      rmsnorm_backward(dh, m.a<T>(m.A.x_out), "ln_final.weight", m.f(m.A.rstd_f), dx);
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
      linear_backward(dx, m.a<T>(L.s), p + "ffn.w2.weight", ds, f, d, false);
      gpu::swiglu_backward<T>(ds, m.a<T>(L.u), m.a<T>(L.g), du, dg, n * f, m.stream);
      const std::string w1 = p + "ffn.w1.weight", w3 = p + "ffn.w3.weight";
      if (m.pure) {  // bf16-pure stages one contiguous range of gradients at a time
        linear_backward(du, m.a<T>(L.h2), w1, dh, d, f, false);
        linear_backward(dg, m.a<T>(L.h2), w3, dh, d, f, true);
      } else {
        // dh = du · w1 + dg · w3, then both weight gradients as one strided-batched GEMM over the fp32
        // gradients (w2's, between them, is final already and left alone), written over them after a
        // zero_grad() as the GEMMs above do.
        linear_backward_cuda(du, nullptr, m.weight(w1), dh, nullptr, n, d, f, dt, false, m.stream);
        linear_backward_cuda(dg, nullptr, m.weight(w3), dh, nullptr, n, d, f, dt, true, m.stream);
        linear_weight_grad_pair_cuda(du, dg, m.a<T>(L.h2), m.grad(w1), m.grad(w3), n, d, f, dt, !overwrite, m.stream);
        report_final(w1);
        report_final(w3);
      }
      rmsnorm_backward(dh, m.a<T>(L.x_mid), p + "ln2.weight", m.f(L.rstd2), dx);
      linear_backward(dx, m.a<T>(L.attn), p + "attn.output_proj.weight", dattn, d, d, false);
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
      gpu::rope_backward<T>(dqkv, rope_cos, rope_sin, m.batch, m.seq, 2 * c.heads, hd, m.stream, 3 * d);
      // dh = [dq dk dv] · [wq; wk; wv] and the three weight gradients as one [3d, d] product.
      add_to_gradients({p + "attn.q_proj.weight", p + "attn.k_proj.weight", p + "attn.v_proj.weight"}, true,
                       [&](float* dw, bool accumulate_dw) {
                         linear_backward_cuda(dqkv, m.a<T>(L.h1), m.weight(p + "attn.q_proj.weight"), dh, dw, n, d,
                                              3 * d, dt, false, m.stream, false, accumulate_dw);
                       });
      rmsnorm_backward(dh, m.a<T>(L.x_in), p + "ln1.weight", m.f(L.rstd1), dx);
      parameters_done(p);
    }
    gradients_needed("token_embeddings.");
    add_to_gradient("token_embeddings.weight", false, [&](float* dtable, bool) {
      gpu::embedding_backward<T>(dx, tokens, dtable, n, d, V, m.stream);
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
  if (m.pure) {
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

int64_t CudaModel::optimizer_steps() const { return impl_->adam_step; }

void CudaModel::release_optimizer_state() {
  Impl& m = *impl_;
  if (!m.adam_m.data()) return;
  gpu::stream_synchronize(m.stream);  // the last AdamW step may still be reading them
  m.graph.reset();                    // a captured step would step the freed moments
  m.adam_m = Buffer();
  m.adam_v = Buffer();
  m.adam_step = 0;
}

void CudaModel::synchronize() const { gpu::stream_synchronize(impl_->stream); }

void CudaModel::save_state(std::span<float> params, std::span<float> m, std::span<float> v) const {
  check_own_storage("CudaModel::save_state");
  check_state_arrays("CudaModel::save_state", params.size(), m.size(), v.size(), 0);
  const Impl& s = *impl_;
  copy_parameters_to(params.data());
  if (!s.adam_m.data()) {  // no step taken yet: zero moments
    std::fill(m.begin(), m.end(), 0.0f);
    std::fill(v.begin(), v.end(), 0.0f);
    return;
  }
  if (s.pure) {  // widened to fp32: the checkpoint format is the same for every precision
    s.widen_to_host(static_cast<const bf16_t*>(s.adam_m.data()), m.data(), s.n_params);
    s.widen_to_host(static_cast<const bf16_t*>(s.adam_v.data()), v.data(), s.n_params);
    return;
  }
  if (s.bf16_moments()) {  // widened to fp32 on the host (exactly), as bf16-pure's are
    gpu::stream_synchronize(s.stream);
    std::vector<bf16_t> narrow(size_t(s.n_params));
    for (const auto& [moment, host] : {std::pair{&s.adam_m, m.data()}, std::pair{&s.adam_v, v.data()}}) {
      cuda_copy(narrow.data(), moment->data(), narrow.size() * sizeof(bf16_t));
      std::transform(narrow.begin(), narrow.end(), host, [](bf16_t x) { return float(x); });
    }
    return;
  }
  const size_t bytes = size_t(s.n_params) * sizeof(float);
  cuda_copy(m.data(), s.adam_m.data(), bytes);
  cuda_copy(v.data(), s.adam_v.data(), bytes);
}

void CudaModel::load_state(std::span<const float> params, std::span<const float> m, std::span<const float> v,
                           int64_t optimizer_steps) {
  check_own_storage("CudaModel::load_state");
  check_state_arrays("CudaModel::load_state", params.size(), m.size(), v.size(), optimizer_steps);
  Impl& s = *impl_;
  if (s.bf16_moments()) check_bf16_moments("CudaModel::load_state", m, v);
  load_parameters(params.data());  // also refreshes what is derived from the parameters
  s.allocate_moments();
  gpu::stream_synchronize(s.stream);  // the zeroing above is queued on the model's stream
  if (s.bf16_moments()) {  // exact: check_bf16_moments saw only bf16 values
    std::vector<bf16_t> narrow(size_t(s.n_params));
    for (const auto& [host, moment] : {std::pair{m.data(), &s.adam_m}, std::pair{v.data(), &s.adam_v}}) {
      std::transform(host, host + s.n_params, narrow.begin(), [](float x) { return bf16_t(x); });
      cuda_copy(moment->data(), narrow.data(), narrow.size() * sizeof(bf16_t));
    }
  } else if (s.pure) {
    s.narrow_from_host(m.data(), static_cast<bf16_t*>(s.adam_m.data()), s.n_params);
    s.narrow_from_host(v.data(), static_cast<bf16_t*>(s.adam_v.data()), s.n_params);
  } else {
    const size_t bytes = size_t(s.n_params) * sizeof(float);
    cuda_copy(s.adam_m.data(), m.data(), bytes);
    cuda_copy(s.adam_v.data(), v.data(), bytes);
  }
  s.adam_step = optimizer_steps;
}

void CudaModel::adamw_step(const AdamWConfig& cfg, double lr) {
  Impl& m = *impl_;
  memory_set_phase("optimizer");
  ScopedRange range("optimizer_step");
  check_own_storage("CudaModel::adamw_step");
  if (m.zero_pending) m.settle_gradients();  // a step on zeroed gradients (the clip is applied in the kernel)
  m.allocate_moments();
  ++m.adam_step;
  m.queue_adamw(cfg, lr, nullptr);
  // pending_clip stays: the stored gradients are still unclipped for any later reader.
}

std::string CudaModel::cuda_graph_status() const { return impl_->graph_status; }

StepResult CudaModel::train_step(const int32_t* tokens, const int32_t* targets, const AdamWConfig& cfg, double lr) {
  Impl& m = *impl_;
  const char* why = nullptr;
  if (!m.options.cuda_graph) {
    why = "off: --cuda-graph off";
  } else if (m.precision == DType::f16) {
    why = "off: fp16's loss scaling reads the overflow count on the host";
  } else if (has_gradient_ready_hook() || has_parameter_hooks()) {
    why = "off: data-parallel hooks run on the host between the step's kernels";
  } else if (RangeProfiler::instance().enabled()) {
    why = "off: profiled ranges time each part with events on the host's side";
  } else if (m.graph && !m.graph->failure.empty()) {
    why = m.graph->failure.c_str();
  }
  if (why) {
    m.graph_status = why;
    return LanguageModel::train_step(tokens, targets, cfg, lr);
  }
  if (!m.graph) m.graph = std::make_unique<StepGraph>();
  StepGraph& g = *m.graph;
  // The step's stream follows the work already queued on the model's own.
  FLASHLM_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(m.stream)), "cudaStreamSynchronize");
  const StreamScope on_step_stream(m.stream, g.stream);
  if (!g.warmed_up) {  // eager, on the step's stream: what it allocates exists before the capture
    const StepResult r = LanguageModel::train_step(tokens, targets, cfg, lr);
    g.scalars = Buffer::allocate(sizeof(DeviceStepScalars), Device::cuda, "train-step scalars");
    g.in = std::make_unique<PinnedArray<DeviceStepScalars>>(1);
    g.out = std::make_unique<PinnedArray<DeviceStepScalars>>(1);
    g.rows = std::make_unique<PinnedArray<float>>(size_t(m.n));
    g.warmed_up = true;
    m.graph_status = "on (this step was the eager warm-up)";
    return r;
  }
  m.upload_batch(tokens, targets);
  if (m.norms) gpu::stream_synchronize(m.norms->stream);  // an eager step's norms may still be running
  *g.in->data = DeviceStepScalars{adamw_scalars(lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, m.adam_step + 1),
                                  cfg.max_grad_norm, 0.0};
  g.in->data->adam.rounding_key = moment_rounding_key(m.options.moment_rounding_seed, m.adam_step + 1);
  if (!g.exec && !capture_step()) {
    m.graph_status = g.failure;
    return LanguageModel::train_step(tokens, targets, cfg, lr);
  }
  FLASHLM_CUDA_CHECK(cudaGraphLaunch(g.exec, g.stream), "cudaGraphLaunch (train step)");
  gpu::stream_synchronize(g.stream);
  ++g.replays;
  ++m.adam_step;
  // The host state the step leaves, as its eager run would.
  m.zero_pending = false;
  m.have_forward = false;
  m.norms_current = g.norms_current;
  m.materialized_segment = g.materialized_segment;
  m.pending_clip = g.out->data->adam.grad_scale;
  m.graph_status = "on";
  return StepResult{m.mean_loss(g.rows->data), g.out->data->norm, true};
}

bool CudaModel::capture_step() {
  Impl& m = *impl_;
  StepGraph& g = *m.graph;
  const auto s = static_cast<cudaStream_t>(m.stream);
  auto* scalars = static_cast<DeviceStepScalars*>(g.scalars.data());
  // The host state the captured code changes, to restore when the capture fails.
  const bool zero_pending = m.zero_pending, norms_current = m.norms_current, have_forward = m.have_forward;
  const float pending_clip = m.pending_clip;
  const int64_t segment = m.materialized_segment;
  cudaGraph_t graph = nullptr;
  try {
    FLASHLM_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    m.capturing = true;
    FLASHLM_CUDA_CHECK(cudaMemcpyAsync(scalars, g.in->data, sizeof(DeviceStepScalars), cudaMemcpyHostToDevice, s),
                       "cudaMemcpyAsync (step scalars)");
    zero_grad();
    queue_forward();
    FLASHLM_CUDA_CHECK(cudaMemcpyAsync(g.rows->data, m.row_loss.data(), size_t(m.n) * sizeof(float),
                                       cudaMemcpyDeviceToHost, s),
                       "cudaMemcpyAsync (per-token losses)");
    backward();
    {
      // clip_gradients on the device: gradient_norm's sum of the per-parameter norms (or of one pass).
      ScopedRange range("clip_gradients");
      if (m.norms_current) {
        m.norms->join(m.stream);
        gpu::clip_on_device(static_cast<const double*>(m.partial_norms.data()), int64_t(m.layout.size()), scalars,
                            m.stream);
      } else {
        m.settle_gradients();
        auto* out = static_cast<double*>(m.reduce_out.data());
        if (m.pure) {
          gpu::squared_norm<bf16_t>(static_cast<const bf16_t*>(m.grads.data()), m.n_params, out, m.stream);
        } else {
          gpu::squared_norm<float>(static_cast<const float*>(m.grads.data()), m.n_params, out, m.stream);
        }
        gpu::clip_on_device(out, 1, scalars, m.stream);
      }
    }
    {
      memory_set_phase("optimizer");
      ScopedRange range("optimizer_step");
      m.queue_adamw(AdamWConfig{}, 0.0, &scalars->adam);
    }
    FLASHLM_CUDA_CHECK(cudaMemcpyAsync(g.out->data, scalars, sizeof(DeviceStepScalars), cudaMemcpyDeviceToHost, s),
                       "cudaMemcpyAsync (step scalars back)");
    m.capturing = false;
    FLASHLM_CUDA_CHECK(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
    FLASHLM_CUDA_CHECK(cudaGraphInstantiate(&g.exec, graph, 0), "cudaGraphInstantiate");
    cudaGraphDestroy(graph);
  } catch (const std::exception& e) {
    m.capturing = false;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
      cudaGraph_t partial = nullptr;
      cudaStreamEndCapture(s, &partial);
      if (partial) cudaGraphDestroy(partial);
    }
    if (graph) cudaGraphDestroy(graph);
    g.exec = nullptr;
    cudaGetLastError();  // the capture's error is reported as the reason, not by the next call
    g.failure = fmt::format("off: the step could not be captured ({})", e.what());
    m.zero_pending = zero_pending;
    m.norms_current = norms_current;
    m.have_forward = have_forward;
    m.pending_clip = pending_clip;
    m.materialized_segment = segment;
    return false;
  }
  g.norms_current = m.norms_current;
  g.materialized_segment = m.materialized_segment;
  return true;
}

}  // namespace flashlm
