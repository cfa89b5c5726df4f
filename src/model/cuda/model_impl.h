// CudaModel's private implementation, shared by its step (model.cpp) and the step's CUDA graph
// (step_graph.cpp): the buffers, the deferred gradient work and the helpers both queue through.
#pragma once
#include <cuda_runtime.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/array_ops.h"
#include "core/check.h"
#include "core/cuda_check.h"
#include "core/cuda_runtime.h"
#include "core/env.h"
#include "flashlm/model.h"
#include "model/activations.h"
#include "model/cuda/fp8_linear.h"
#include "model/cuda/step_graph.h"
#include "model/cuda/ops.h"
#include "optim/adamw_state.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"

namespace flashlm {
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
inline void with_precision(DType precision, Fn&& fn) {
  switch (precision) {
    case DType::f32: return fn(float{});
    case DType::bf16: return fn(bf16_t{});
    case DType::f16: return fn(fp16_t{});
    default: fail("CudaModel: precision {} is not supported", dtype_name(precision));
  }
}

struct CudaModel::Impl {
  // What the model is (LanguageModel's, fixed when it is built), by the short names the step uses.
  const ModelConfig& c;
  const std::vector<ParameterInfo>& layout;
  const int64_t n_params;
  const DType precision;
  const bool pure;  // bf16-pure: params, grads and the AdamW moments hold bf16
  int64_t batch, seq, n;
  ModelOptions options;
  void* stream;
  std::unordered_map<std::string, size_t> index;  // parameter name -> position in layout
  std::unordered_map<std::string, int64_t> gain_row;  // bf16-pure: RMSNorm gain name -> row of gains_f32
  // params_lp: the weights in `precision` (mixed bf16/fp16 only). staging (bf16 gradients: bf16-pure, or
  // ModelOptions::grad_dtype): an fp32 array as large as the largest parameter, where a backward accumulates
  // one parameter's gradient (and where widened copies pass through); gains_f32 (bf16-pure): the RMSNorm gains
  // widened, [2 layers + 1, d_model].
  Buffer params, grads, params_lp, staging, gains_f32;
  Buffer acts, acts_f32, logits, row_loss, scratch, tokens, targets, rope, reduce_out;
  ActivationLayout A;
  int64_t head_chunk = 0;
  int64_t largest_parameter = 0;
  int64_t largest_gradient = 0;  // bf16 gradients: the staging buffer's elements (gradient_staging_elements)
  int64_t materialized_segment = -1;  // the segment whose blocks the recomputation working set holds
  // The model's optimizer state and loss scale (LanguageModel's).
  AdamWState* adam = nullptr;
  LossScaler* scaler = nullptr;
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
  std::unique_ptr<Fp8Linear> fp8;    // --precision fp8: the blocks' linear layers in FP8 (null otherwise)
  std::unique_ptr<StepGraph> graph;  // train_step's CUDA graph, from its first call on
  std::string graph_status;          // CudaModel::cuda_graph_status
  bool capturing = false;            // the step's host code is being captured, not run

  explicit Impl(const LanguageModel& model)
      : c(model.config()),
        layout(model.layout()),
        n_params(model.parameter_count()),
        precision(model.precision()),
        pure(model.bf16_pure()) {}

  size_t elem() const { return dtype_size(precision); }
  size_t state_elem() const { return pure ? sizeof(bf16_t) : sizeof(float); }  // params
  size_t grad_elem() const { return pure || mixed_bf16_gradients() ? sizeof(bf16_t) : sizeof(float); }
  // The optimizer state beside fp32 masters in bf16 (ModelOptions::optimizer_state; bf16-pure's are too).
  bool bf16_moments() const { return options.optimizer_state != OptimizerState::fp32; }
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
  // bf16-pure with its own storage, or bf16 gradients beside fp32 masters (ModelOptions::grad_dtype): the bf16
  // gradients the backward writes. Under FSDP's sharded storage bf16-pure's gradients are fp32 (the table's),
  // reduce-scattered before any rounding.
  bool bf16_gradients() const { return (pure && !options.external_parameters) || mixed_bf16_gradients(); }
  bool mixed_bf16_gradients() const { return !pure && options.grad_dtype == DType::bf16; }
  bf16_t* bf16_grad(const std::string& name) const { return static_cast<bf16_t*>(grads.data()) + info(name).offset; }
  const ParameterStorage& stored(const std::string& name) const {
    const auto it = index.find(name);
    FLASHLM_CHECK(it != index.end(), "CudaModel: no parameter named '{}'", name);
    return table[it->second];
  }
  float* master(const std::string& name) const { return stored(name).master; }
  float* grad(const std::string& name) const { return stored(name).grad; }
  // The gradient of `name` as stored, for a GEMM to write (bf16 under bf16_gradients()).
  WeightGrad stored_grad(const std::string& name) const {
    return bf16_gradients() ? WeightGrad(bf16_grad(name)) : WeightGrad(grad(name));
  }
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

  // --precision fp8: block weight w as its FP8 products read it: the e4m3 bytes and scale slot FSDP's FP8 gather
  // brought (ParameterStorage::fp8_scales; ModelOptions::fsdp_fp8_gather), or its bf16 values, which Fp8Linear
  // casts. (q, k and v arrive as one run of bytes with one scale: the [3d, d] weight the model multiplies.)
  Fp8LinearWeight fp8_weight(const std::string& w) const {
    const ParameterStorage& t = stored(w);
    if (t.fp8_scales) return {static_cast<const uint8_t*>(t.weight), t.fp8_scales};
    return static_cast<const bf16_t*>(weight(w));
  }

  // --precision fp8: a block's linear layer through Fp8Linear, returning true; false where the model runs
  // its linear layers in its precision's own GEMMs (the caller then calls those, unchanged).
  // same_input: x is the previous FP8 product's input (Fp8Linear::forward, ::backward).
  // x_amax: x's amax from its producer (fp8_produced_amax), or null.
  template <class T>
  bool fp8_forward(const T* x, const std::string& w, const T* residual, T* y, int64_t in, int64_t out,
                   bool same_input = false, const float* x_amax = nullptr) const {
    if constexpr (std::is_same_v<T, bf16_t>) {
      if (fp8) {
        fp8->forward(x, fp8_weight(w), residual, y, in, out, stream, w, same_input, x_amax);
        return true;
      }
    }
    return false;
  }
  template <class T>
  bool fp8_backward(const T* dy, const T* x, const std::string& w, T* dx, WeightGrad dw, int64_t in, int64_t out,
                    bool accumulate_dx, bool accumulate_dw, bool same_input = false,
                    const float* dy_amax = nullptr) const {
    if constexpr (std::is_same_v<T, bf16_t>) {
      if (fp8) {
        fp8->backward(dy, x, fp8_weight(w), dx, dw, in, out, accumulate_dx, accumulate_dw,
                      stream, w, same_input, dy_amax);
        return true;
      }
    }
    return false;
  }

  // --precision fp8: the blocks' named FP8 weights for Fp8Linear::begin_pass, which reduces their amaxes in one
  // kernel; empty under FSDP's sharded storage, whose weights are resident only while their part is gathered
  // (each is then reduced at its cast, or arrives as FP8 bytes with its scale). Built at the first pass: the
  // places do not move after it.
  std::span<const Fp8WeightRef> fp8_pass_weights() const {
    if (!fp8 || options.external_parameters) return {};
    if (fp8_weight_refs.empty()) {
      const int64_t d = c.d_model, f = c.d_ff;
      for (int64_t l = 0; l < c.layers; ++l) {
        const std::string p = fmt::format("layers.{}.", l);
        for (const auto& [name, in, out] : {std::tuple{"attn.q_proj.weight", d, 3 * d},
                                            std::tuple{"attn.output_proj.weight", d, d}, std::tuple{"ffn.w1.weight", d, f},
                                            std::tuple{"ffn.w3.weight", d, f}, std::tuple{"ffn.w2.weight", f, d}}) {
          const std::string w = p + name;
          fp8_weight_refs.push_back({w, static_cast<const bf16_t*>(weight(w)), in, out});
        }
      }
    }
    return fp8_weight_refs;
  }
  mutable std::vector<Fp8WeightRef> fp8_weight_refs;

  // --precision fp8 (tensorwise): where the kernel producing tensor t of block l writes its amax; null otherwise,
  // rowwise included (the producers then reduce nothing), and without ModelOptions::fp8_fused_amax.
  float* fp8_produced_amax(int64_t l, Fp8Produced t) const {
    return fp8 && options.fp8_fused_amax ? fp8->produced_amax(l, t) : nullptr;
  }

  // --precision fp8 (tensorwise, the model's own storage, ModelOptions::fp8_fused_amax): the AdamW step writes
  // the block weights' amaxes as it stores them (StoredAmaxes: each weight's run of the flat buffers, q‖k‖v as one,
  // into its Fp8Linear slot), and the next begin_pass reduces none. {} otherwise. The table goes up to the device
  // at the first step, which is eager (train_step's graph captures its second).
  // copies (fp8_copies_wanted): the step writes the weights' FP8 copies too (StoredAmaxes::copies).
  StoredAmaxes fp8_stored_amaxes(bool copies = false) {
    if (!fp8 || !options.fp8_fused_amax || fp8->recipe() != Fp8Recipe::tensorwise) return {};
    const std::span<const Fp8WeightRef> weights = fp8_pass_weights();
    if (weights.empty()) return {};  // FSDP's sharded storage
    if (!fp8_amax_ranges.data()) {
      FLASHLM_CHECK(!capturing, "CudaModel: the FP8 weight amax table is uploaded by an eager step, not a capture");
      // One range per scale group (fp8_scale_groups: ascending, q‖k‖v as one), into the slot of its weight.
      std::unordered_map<int64_t, const Fp8WeightRef*> at;
      for (const Fp8WeightRef& r : weights) at.emplace(info(r.name).offset, &r);
      std::vector<AmaxRange> ranges;
      for (const Fp8ScaleGroup& g : fp8_scale_groups(layout)) {
        const auto it = at.find(g.offset);
        FLASHLM_CHECK(it != at.end() && it->second->in * it->second->out == g.count,
                      "CudaModel: FP8 scale group at element {} ({} elements) is no block weight the passes read",
                      g.offset, g.count);
        ranges.push_back({g.offset, g.count, fp8->weight_amax(*it->second)});
      }
      FLASHLM_CHECK(ranges.size() == weights.size(), "CudaModel: {} FP8 scale groups for {} FP8 weights",
                    ranges.size(), weights.size());
      fp8_amax_ranges = Buffer::allocate(ranges.size() * sizeof(AmaxRange), Device::cuda, "FP8 weight amax ranges");
      cuda_copy(fp8_amax_ranges.data(), ranges.data(), ranges.size() * sizeof(AmaxRange));
    }
    StoredAmaxes stored{static_cast<const AmaxRange*>(fp8_amax_ranges.data()), int(weights.size())};
    if (copies) stored.copies = fp8_weight_copies(weights);
    return stored;
  }
  Buffer fp8_amax_ranges;

  // ModelOptions::fp8_optimizer_weight_cast where it applies: fp32 masters with a bf16 copy, the fused amaxes of
  // the tensorwise recipe (fp8_stored_amaxes; rowwise scales are taken by each pass), FLASHLM_FP8_WEIGHT_CAST not
  // `pass`, and betas whose update has a bound (beta1² < beta2: fp8_betas_bounded, set by each eager step from its
  // betas; a captured step keeps the warm-up's). With fp32 or bf16 weight gradients alike (the kernel reads either).
  bool fp8_copies_wanted() const {
    return fp8 && !pure && precision == DType::bf16 && options.fp8_optimizer_weight_cast && options.fp8_fused_amax &&
           fp8->recipe() == Fp8Recipe::tensorwise && fp8_betas_bounded && env_choice(kFp8WeightCast) != "pass";
  }
  bool fp8_betas_bounded = false;
  // The tables of StoredAmaxes::copies: each FP8 weight's place in the flat buffers and cache (ascending), and
  // the chunks of every other element. Uploaded once, by an eager step.
  Fp8WeightCopies fp8_weight_copies(std::span<const Fp8WeightRef> weights) {
    if (!fp8_copy_table.data()) {
      FLASHLM_CHECK(!capturing, "CudaModel: the FP8 weight copy table is uploaded by an eager step, not a capture");
      std::vector<const Fp8WeightRef*> order;
      for (const Fp8WeightRef& r : weights) order.push_back(&r);
      std::ranges::sort(order, {}, [&](const Fp8WeightRef* r) { return info(r->name).offset; });
      std::vector<Fp8WeightCopy> table;
      std::vector<ElementChunk> rest;
      constexpr int64_t kChunk = int64_t{1} << 16;
      const auto add_rest = [&](int64_t a, int64_t e) {
        for (; a < e; a += kChunk) rest.push_back({a, std::min(kChunk, e - a)});
      };
      int64_t at = 0, blocks = 0;
      for (const Fp8WeightRef* r : order) {
        const int64_t begin = info(r->name).offset;
        FLASHLM_CHECK(begin >= at && begin % 8 == 0 && r->in % 8 == 0 && r->out % 8 == 0,
                      "CudaModel: FP8 weight '{}' at element {} ({} x {}) cannot be copied by the optimizer (8-aligned "
                      "places and sizes, disjoint)", r->name, begin, r->out, r->in);
        add_rest(at, begin);
        const Fp8Linear::WeightCopy places = fp8->weight_copy(*r);
        table.push_back({begin, r->out, r->in, places.q, places.qt, places.slot, blocks});
        blocks += fp8_copy_blocks(r->out, r->in);
        at = begin + r->in * r->out;
      }
      add_rest(at, n_params);
      FLASHLM_CHECK(int64_t(rest.size()) <= INT32_MAX, "CudaModel: {} chunks outside the FP8 weights", rest.size());
      fp8_copy_table = Buffer::allocate(table.size() * sizeof(Fp8WeightCopy), Device::cuda, "FP8 weight copy table");
      cuda_copy(fp8_copy_table.data(), table.data(), table.size() * sizeof(Fp8WeightCopy));
      fp8_copy_rest = Buffer::allocate(std::max<size_t>(1, rest.size()) * sizeof(ElementChunk), Device::cuda,
                                       "FP8 weight copy step's other elements");
      if (!rest.empty()) cuda_copy(fp8_copy_rest.data(), rest.data(), rest.size() * sizeof(ElementChunk));
      fp8_copy_counts = {int64_t(table.size()), blocks, int64_t(rest.size())};
    }
    return {static_cast<const Fp8WeightCopy*>(fp8_copy_table.data()), int(fp8_copy_counts[0]), fp8_copy_counts[1],
            static_cast<const ElementChunk*>(fp8_copy_rest.data()), int(fp8_copy_counts[2])};
  }
  Buffer fp8_copy_table, fp8_copy_rest;
  std::array<int64_t, 3> fp8_copy_counts{};  // weights, their blocks, rest chunks
  // Anything but the fused AdamW step wrote the weights, or may read or write them through a pointer handed out:
  // the next pass reduces their amaxes (Fp8Linear), and the block weights' bf16 copy is made whole first.
  void weights_changed() const {
    restore_fp8_weights_bf16();
    if (fp8) fp8->weights_changed();
  }
  // The optimizer's FP8 weight copies without the block weights' bf16 copies (FLASHLM_FP8_WEIGHT_CAST=optimizer;
  // Fp8WeightCopies::weights_bf16 off): after such a step params_lp's part for those weights is stale, which
  // nothing in a pass reads while the copies are current (the FP8 GEMMs take them; the LM head, the embedding and
  // the gains are written as before). Whatever could read it first restores the copy from the masters here: the
  // rounding the step would have stored (from_f32, nearest even), so every bit is as if it had been written.
  mutable bool fp8_weights_bf16_stale = false;
  void restore_fp8_weights_bf16() const {
    if (!fp8_weights_bf16_stale) return;
    FLASHLM_CHECK(!capturing, "CudaModel: the block weights' bf16 copy is restored by eager code, not a capture");
    gpu::cast_from_f32<bf16_t>(static_cast<const float*>(params.data()), static_cast<bf16_t*>(params_lp.data()),
                               n_params, stream);
    fp8_weights_bf16_stale = false;
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
      gpu::memset_async(grads.data(), 0, size_t(n_params) * grad_elem(), stream);
      zero_pending = false;
      norms_current = false;
      pending_clip = 1.0f;
    }
    apply_pending_clip();
  }
  void apply_pending_clip() const {
    if (pending_clip == 1.0f) return;
    norms_current = false;
    if (!bf16_gradients()) {
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
    if (bf16_gradients()) {
      gpu::squared_norm<bf16_t>(static_cast<const bf16_t*>(grads.data()) + p.offset, p.numel(), out, norms->stream);
    } else {
      gpu::squared_norm<float>(static_cast<const float*>(grads.data()) + p.offset, p.numel(), out, norms->stream);
    }
  }
  // bf16-pure (and bf16 gradients): the bf16 device array `src` of `count` values into host fp32, and back.
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
  // AdamW over every parameter at step adam->steps(): with `fixed` scalars, or (live not null) with those the
  // kernels read from the device when they run (the graphed step).
  // With FP8's fused amaxes (fp8_stored_amaxes) the step also writes the block weights' amaxes.
  // With the optimizer's FP8 weight copies (fp8_copies_wanted) it writes those too, and its first kernel takes
  // the amaxes the slots hold (their bounds come from them), so nothing clears them before.
  void queue_adamw(const AdamWConfig& cfg, double lr, const AdamWScalars* live) {
    if (!live) fp8_betas_bounded = adamw_update_bounded(cfg.beta1, cfg.beta2);
    const bool copies = fp8_copies_wanted();
    StoredAmaxes amax = fp8_stored_amaxes(copies);
    // FLASHLM_FP8_WEIGHT_CAST=optimizer-bf16: the step writes the block weights' bf16 copy too (the A/B).
    amax.copies.weights_bf16 = env_choice(kFp8WeightCast) == "optimizer-bf16";
    if (fp8) fp8->weights_changed();  // not Impl's: the step writes whatever part of the bf16 copy is stale
    if (amax.count > 0 && amax.copies.count == 0) fp8->clear_weight_amaxes(stream);
    queue_adamw_kernels(cfg, lr, live, amax);
    if (amax.count > 0) fp8->set_weight_amaxes_current(fp8_pass_weights());
    if (amax.copies.count > 0) fp8->set_weight_copies_current(fp8_pass_weights());
    fp8_weights_bf16_stale = amax.copies.count > 0 && !amax.copies.weights_bf16;
  }
  void queue_adamw_kernels(const AdamWConfig& cfg, double lr, const AdamWScalars* live, const StoredAmaxes& amax) {
    if (pure) {
      auto* w = static_cast<bf16_t*>(params.data());
      const auto* g = static_cast<const bf16_t*>(grads.data());
      auto *mo = adam->m_as<bf16_t>(), *vo = adam->v_as<bf16_t>();
      if (live) {
        gpu::adamw_step_bf16_live(w, g, mo, vo, n_params, live, stream, amax);
      } else {
        gpu::adamw_step_bf16(w, g, mo, vo, n_params, lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay,
                             adam->steps(), stream, pending_clip, amax);
      }
      refresh_gains();
      return;
    }
    with_precision(precision, [&](auto zero) {
      using T = decltype(zero);
      if constexpr (std::is_same_v<T, bf16_t>) {
        if (mixed_bf16_gradients()) {
          return queue_adamw_masters<T>(static_cast<const bf16_t*>(grads.data()), cfg, lr, live, amax);
        }
      }
      queue_adamw_masters<T>(static_cast<const float*>(grads.data()), cfg, lr, live, amax);
    });
  }
  // AdamW over fp32 masters with gradients G (fp32, or bf16: ModelOptions::grad_dtype) and the copy in T.
  template <class T, class G>
  void queue_adamw_masters(const G* g, const AdamWConfig& cfg, double lr, const AdamWScalars* live,
                           const StoredAmaxes& amax) {
    T* copy = nullptr;
    if constexpr (!std::is_same_v<T, float>) copy = static_cast<T*>(params_lp.data());
    auto* w = static_cast<float*>(params.data());
    if (bf16_moments()) {
      auto *mo = adam->m_as<bf16_t>(), *vo = adam->v_as<bf16_t>();
      const MomentRounding rounding = adam->rounding(options.moment_rounding_seed);
      if (live) {
        gpu::adamw_step_bf16_moments_live<T>(w, g, mo, vo, n_params, live, rounding.stochastic, 0, copy, stream, amax);
      } else {
        gpu::adamw_step_bf16_moments<T>(w, g, mo, vo, n_params, lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay,
                                        adam->steps(), rounding, 0, copy, stream, pending_clip, amax);
      }
      return;
    }
    auto *mo = adam->m_as<float>(), *vo = adam->v_as<float>();
    if (live) {
      gpu::adamw_step_live<T>(w, g, mo, vo, n_params, live, copy, stream, amax);
    } else {
      gpu::adamw_step<T>(w, g, mo, vo, n_params, lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, adam->steps(),
                         copy, stream, pending_clip, amax);
    }
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

}  // namespace flashlm
