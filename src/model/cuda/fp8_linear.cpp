// CudaModel's FP8 linear layers (model/cuda/fp8_linear.h): the casts (model/cuda/fp8.h) and the FP8 GEMMs
// (model/cuda/gemm.h) in the order each product needs them. Host code only.
#include "model/cuda/fp8_linear.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "core/check.h"
#include "core/cuda_check.h"
#include "core/cuda_runtime.h"
#include "flashlm/profile.h"
#include "model/cuda/fp8.h"
#include "model/cuda/gemm.h"

namespace flashlm {

namespace {

std::vector<const void*> weight_pointers(std::span<const Fp8WeightRef> weights) {
  std::vector<const void*> p;
  p.reserve(weights.size());
  for (const Fp8WeightRef& r : weights) p.push_back(r.w);
  return p;
}

}  // namespace

Fp8Linear::Fp8Linear(const ModelConfig& c, int64_t tokens, Fp8Format gradients, Fp8Recipe recipe, bool keep_inputs)
    : n_(tokens),
      layers_(c.layers),
      gradients_(gradients),
      recipe_(recipe),
      layout_(fp8_scratch_layout(c, tokens, recipe, keep_inputs)),
      keep_inputs_(keep_inputs) {
  FLASHLM_CHECK(c.d_model % 16 == 0 && c.d_ff % 16 == 0,
                "precision fp8: d_model ({}) and d_ff ({}) must be multiples of 16 (cuBLASLt's FP8 GEMMs)", c.d_model,
                c.d_ff);
  FLASHLM_CHECK(tokens >= 16 && tokens % 16 == 0,
                "precision fp8: batch · seq = {} tokens must be a multiple of 16 (the weight gradients' GEMMs sum "
                "over tokens; cuBLASLt's FP8 kernels need K a multiple of 16)",
                tokens);
  buffer_ = Buffer::allocate(size_t(layout_.bytes), Device::cuda, "FP8 copies of one linear layer's operands");

  // The weight cache (fp8_scratch_layout), allocated now: a pass may run inside CUDA-graph capture, where no
  // memory can be allocated.
  cache_ = Buffer::allocate(size_t(layout_.cache_bytes), Device::cuda, "FP8 copies of the block weights, both ways");
}

Fp8Linear::CachedWeight& Fp8Linear::entry(std::string_view name, int64_t in, int64_t out) {
  auto it = cached_.find(std::string(name));
  if (it == cached_.end()) {
    CachedWeight e;
    e.elements = in * out;
    e.offset = cache_used_;
    e.offset_t = e.offset + fp8_region_bytes(e.elements);
    e.slot = int(cached_.size());
    FLASHLM_CHECK(e.offset_t + fp8_region_bytes(e.elements) <= layout_.cache_scales && e.slot < layout_.cache_slots,
                  "Fp8Linear: weight '{}' ({} x {}) does not fit the FP8 weight cache sized for this model's blocks "
                  "({} weights, {} bytes, {} used)",
                  name, out, in, cached_.size(), layout_.cache_scales, cache_used_);
    cache_used_ = e.offset_t + fp8_region_bytes(e.elements);
    it = cached_.emplace(std::string(name), e).first;
  }
  CachedWeight& e = it->second;
  FLASHLM_CHECK(e.elements == in * out, "Fp8Linear: weight '{}' was {} elements, now {} x {}", name, e.elements, out,
                in);
  return e;
}

void Fp8Linear::begin_pass(std::span<const Fp8WeightRef> weights, void* stream) {
  ++pass_;
  act_.x = act_x_t_ = nullptr;
  // Taken once: the next pass reduces (and casts) unless the weights' writer says so anew.
  const std::vector<const void*> places = weight_pointers(weights);
  const bool copies = weight_copies_.take(places);
  const bool current = weight_amaxes_.take(places) || copies;
  if (weights.empty() || recipe_ != Fp8Recipe::tensorwise) return;
  if (!current && !reduce_weight_amaxes(weights, stream)) return;
  for (const Fp8WeightRef& r : weights) {
    CachedWeight& e = cached_.find(r.name)->second;
    e.amax_pass = pass_;
    if (copies) e.pass = pass_;  // the optimizer's copies stand for this pass's casts
  }
}

Fp8Linear::WeightCopy Fp8Linear::weight_copy(const Fp8WeightRef& r) {
  FLASHLM_CHECK(recipe_ == Fp8Recipe::tensorwise,
                "Fp8Linear::weight_copy: weight '{}': only tensorwise copies can be written by the optimizer", r.name);
  const CachedWeight& e = entry(r.name, r.in, r.out);
  return {cache_at(e.offset), cache_at(e.offset_t), cache_dequant(e.slot) - kFp8DequantIndex};
}

void Fp8Linear::set_weight_copies_current(std::span<const Fp8WeightRef> weights) {
  for (const Fp8WeightRef& r : weights) {
    FLASHLM_CHECK(cached_.contains(r.name),
                  "Fp8Linear::set_weight_copies_current: weight '{}' has no cache entry (weight_copy was not asked)",
                  r.name);
  }
  weight_copies_.set_current(weight_pointers(weights));
}

bool Fp8Linear::cast_weights(std::span<const Fp8WeightRef> weights, void* stream) {
  if (!reduce_weight_amaxes(weights, stream)) return false;
  for (const Fp8WeightRef& r : weights) cast_with_amax(entry(r.name, r.in, r.out), r.w, r.in, r.out, stream);
  return true;
}

void Fp8Linear::cast_with_amax(const CachedWeight& e, const bf16_t* w, int64_t in, int64_t out, void* stream) {
  const float* slot = cache_dequant(e.slot) - kFp8DequantIndex;
  gpu::fp8_cast(w, out, in, slot + kFp8AmaxIndex, Fp8Format::e4m3, cache_at(e.offset), cache_at(e.offset_t),
                cache_dequant(e.slot), stream);
}

bool Fp8Linear::reduce_weight_amaxes(std::span<const Fp8WeightRef> weights, void* stream) {
  FLASHLM_CHECK(recipe_ == Fp8Recipe::tensorwise && !weights.empty(),
                "Fp8Linear::reduce_weight_amaxes: tensorwise weights only ({} given)", weights.size());
  std::vector<gpu::Fp8AmaxSegment> table;
  table.reserve(weights.size());
  int64_t chunks = 0;
  for (const Fp8WeightRef& r : weights) {
    FLASHLM_CHECK(r.w != nullptr, "Fp8Linear::begin_pass: weight '{}' is null", r.name);
    const CachedWeight& e = entry(r.name, r.in, r.out);
    table.push_back({r.w, e.elements, chunks, cache_dequant(e.slot) - kFp8DequantIndex + kFp8AmaxIndex});
    chunks += gpu::fp8_amax_chunks(e.elements);
  }
  const auto same = [](const gpu::Fp8AmaxSegment& a, const gpu::Fp8AmaxSegment& b) {
    return a.x == b.x && a.count == b.count && a.first_chunk == b.first_chunk && a.amax == b.amax;
  };
  if (!std::ranges::equal(table, amax_table_, same)) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FLASHLM_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture), "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone) return false;  // no upload inside a capture: weight by weight instead
    FLASHLM_CHECK(int64_t(table.size()) <= layout_.cache_slots, "Fp8Linear::begin_pass: {} weights, {} cache slots",
                  table.size(), layout_.cache_slots);
    if (!amax_segments_.data()) {
      amax_segments_ = Buffer::allocate(size_t(layout_.cache_slots) * sizeof(gpu::Fp8AmaxSegment), Device::cuda,
                                        "FP8 weight amax segments");
    }
    cuda_stream_synchronize(stream);  // the previous table may still be read by queued work
    cuda_copy(amax_segments_.data(), table.data(), table.size() * sizeof(gpu::Fp8AmaxSegment));
    amax_table_ = std::move(table);
    amax_chunks_ = chunks;
  }
  clear_weight_amaxes(stream);
  gpu::fp8_amax_segments(static_cast<const gpu::Fp8AmaxSegment*>(amax_segments_.data()), int(amax_table_.size()),
                         amax_chunks_, stream);
  return true;
}

float* Fp8Linear::weight_amax(const Fp8WeightRef& r) {
  FLASHLM_CHECK(recipe_ == Fp8Recipe::tensorwise,
                "Fp8Linear::weight_amax: weight '{}': rowwise casts reduce their weights per row and column themselves",
                r.name);
  return cache_dequant(entry(r.name, r.in, r.out).slot) - kFp8DequantIndex + kFp8AmaxIndex;
}

void Fp8Linear::clear_weight_amaxes(void* stream) {
  // Every weight's scale slot at once (their dequantisation scales too, which each weight's cast writes again
  // before any product reads them).
  FLASHLM_CUDA_CHECK(cudaMemsetAsync(cache_at(layout_.cache_scales), 0,
                                     size_t(layout_.cache_slots) * kFp8ScaleSlotFloats * sizeof(float),
                                     static_cast<cudaStream_t>(stream)),
                     "cudaMemsetAsync (FP8 weight amaxes)");
}

void Fp8Linear::set_weight_amaxes_current(std::span<const Fp8WeightRef> weights) {
  for (const Fp8WeightRef& r : weights) {
    FLASHLM_CHECK(cached_.contains(r.name),
                  "Fp8Linear::set_weight_amaxes_current: weight '{}' has no amax slot (weight_amax was not asked)",
                  r.name);
  }
  weight_amaxes_.set_current(weight_pointers(weights));
}

Fp8Linear::CachedWeight& Fp8Linear::cached(std::string_view name, const bf16_t* w, int64_t in, int64_t out,
                                           void* stream) {
  CachedWeight& e = entry(name, in, out);
  if (e.pass != pass_) {
    if (e.amax_pass == pass_) {  // begin_pass reduced its amax: the cast alone
      cast_with_amax(e, w, in, out, stream);
    } else if (recipe_ == Fp8Recipe::rowwise) {
      gpu::fp8_quantize_rowwise(w, out, in, Fp8Format::e4m3, cache_at(e.offset), cache_at(e.offset_t),
                                cache_vectors(e.slot), stream);
    } else {
      gpu::fp8_quantize(w, out, in, Fp8Format::e4m3, cache_at(e.offset), cache_at(e.offset_t),
                        cache_dequant(e.slot) - kFp8DequantIndex, stream);
    }
    e.pass = pass_;
  }
  return e;
}

uint8_t* Fp8Linear::kept_input(CachedWeight& e, int64_t in) {
  if (e.input_t < 0) {
    const int64_t bytes = fp8_region_bytes(n_ * in);
    FLASHLM_CHECK(layout_.cache_inputs + inputs_used_ + bytes <= layout_.cache_bytes,
                  "Fp8Linear: the forward inputs' transposed copies outgrow their region ({} bytes, {} used, {} more)",
                  layout_.cache_bytes - layout_.cache_inputs, inputs_used_, bytes);
    e.input_t = layout_.cache_inputs + inputs_used_;
    inputs_used_ += bytes;
  }
  return cache_at(e.input_t);
}

void Fp8Linear::check_weight(const char* fn, const Fp8LinearWeight& w, std::string_view name) const {
  if (!w.gathered()) {
    FLASHLM_CHECK(w.w != nullptr, "Fp8Linear::{}: weight '{}' is null", fn, name);
    return;
  }
  FLASHLM_CHECK(recipe_ == Fp8Recipe::tensorwise,
                "Fp8Linear::{}: weight '{}' arrived as tensorwise FP8 bytes (FSDP's FP8 gather), and this layer scales "
                "rowwise (per row and per column: gather its bf16 values instead)", fn, name);
  FLASHLM_CHECK(w.scales != nullptr, "Fp8Linear::{}: weight '{}' arrived as FP8 bytes without a scale slot", fn, name);
}

Fp8Operand Fp8Linear::weight_operand(const Fp8LinearWeight& weight, std::string_view name, int64_t in, int64_t out,
                                     bool transposed, void* stream) {
  if (weight.gathered()) {  // the bytes as they arrived; wᵀ transposed into the scratch's weight region
    const float* dequant_w = weight.scales + kFp8DequantIndex;
    if (!transposed) return {weight.q, Fp8Format::e4m3, dequant_w};
    uint8_t* qt = region(layout_.weight);
    gpu::fp8_transpose(weight.q, out, in, qt, stream);
    return {qt, Fp8Format::e4m3, dequant_w};
  }
  const bf16_t* w = weight.w;
  if (name.empty()) {  // cast for this product alone, into the scratch's weight region
    uint8_t* q = region(layout_.weight);
    if (recipe_ == Fp8Recipe::rowwise) {
      const gpu::Fp8ScaleVectors v = scratch_vectors(1);
      gpu::fp8_quantize_rowwise(w, out, in, Fp8Format::e4m3, transposed ? nullptr : q, transposed ? q : nullptr, v,
                                stream);
      return {q, Fp8Format::e4m3, transposed ? v.col_dequant : v.row_dequant, Fp8Scaling::per_row};
    }
    gpu::fp8_quantize(w, out, in, Fp8Format::e4m3, transposed ? nullptr : q, transposed ? q : nullptr, scales(1),
                      stream);
    return {q, Fp8Format::e4m3, dequant(1)};
  }
  return cached_operand(cached(name, w, in, out, stream), transposed);
}

void Fp8Linear::check_widths(const char* fn, int64_t in, int64_t out) const {
  FLASHLM_CHECK(in >= 1 && out >= 1 && n_ * in <= layout_.act_capacity && n_ * out <= layout_.act_capacity &&
                    in * out <= layout_.weight_capacity,
                "Fp8Linear::{}: in = {}, out = {} outgrow the FP8 scratch of this model", fn, in, out);
}

float* Fp8Linear::produced_amax(int64_t layer, Fp8Produced t) const {
  FLASHLM_CHECK(layer >= 0 && layer < layers_, "Fp8Linear::produced_amax: layer {} of {}", layer, layers_);
  if (recipe_ == Fp8Recipe::rowwise) return nullptr;
  return reinterpret_cast<float*>(cache_at(layout_.cache_amax)) + layer * kFp8Produced + int64_t(t);
}

void Fp8Linear::forward(const bf16_t* x, const Fp8LinearWeight& w, const bf16_t* residual, bf16_t* y, int64_t in,
                        int64_t out, void* stream, std::string_view weight, bool same_input, const float* x_amax) {
  check_widths("forward", in, out);
  check_weight("forward", w, weight);
  // Checked before any work is queued: a refused call writes nothing.
  FLASHLM_CHECK(!same_input || (act_.x == x && act_.in == in),
                "Fp8Linear::forward: same_input, but the FP8 scratch holds no cast of this x (the previous product "
                "had another input, or a backward came between)");
  ScopedRange range("linear.forward");
  if (recipe_ == Fp8Recipe::rowwise) {
    FLASHLM_CHECK(x_amax == nullptr, "Fp8Linear::forward: x_amax given, but rowwise casts reduce x per row themselves");
    return forward_rowwise(x, w.w, residual, y, in, out, stream, weight, same_input);
  }
  uint8_t* qx = region(layout_.act);
  // A named weight's entry keeps its input's scales for the backward; gathered bytes bypass its cached copies.
  CachedWeight* e = nullptr;
  if (!weight.empty()) e = w.gathered() ? &entry(weight, in, out) : &cached(weight, w.w, in, out, stream);
  if (!same_input) {
    // A named weight's input scales go to its input slot, for the backward's cast of xᵀ (or, kept, its read).
    const int slot_index = e ? e->slot : -1;
    float* slot = e ? input_scales(e->slot) : scales(0);
    uint8_t* qx_t = e && keep_inputs_ ? kept_input(*e, in) : nullptr;
    if (x_amax) {  // reduced by x's producer: the cast alone
      gpu::fp8_cast(x, n_, in, x_amax, Fp8Format::e4m3, qx, qx_t, slot + kFp8DequantIndex, stream);
    } else {
      gpu::fp8_quantize(x, n_, in, Fp8Format::e4m3, qx, qx_t, slot, stream);
    }
    act_ = {x, in, slot_index, x_amax ? x_amax : slot + kFp8AmaxIndex, qx_t};
  }
  if (e && act_.slot >= 0) e->input = act_, e->input_pass = pass_;
  const float* dequant_x = act_.slot >= 0 ? input_scales(act_.slot) + kFp8DequantIndex : dequant(0);
  const Fp8Operand qw = e && !w.gathered() ? cached_operand(*e, /*transposed*/ false)
                                           : weight_operand(w, weight, in, out, /*transposed*/ false, stream);
  fp8_gemm_cuda({qx, Fp8Format::e4m3, dequant_x}, qw, y, DType::bf16, n_, out, in, residual ? 1.0f : 0.0f, residual,
                stream);
}

void Fp8Linear::backward(const bf16_t* dy, const bf16_t* x, const Fp8LinearWeight& w, bf16_t* dx, WeightGrad dw,
                         int64_t in, int64_t out, bool accumulate_dx, bool accumulate_dw, void* stream,
                         std::string_view weight, bool same_input, const float* dy_amax) {
  check_widths("backward", in, out);
  if (dx) check_weight("backward", w, weight);
  FLASHLM_CHECK(dx || dw, "Fp8Linear::backward: dx and dw are both null: nothing to compute");
  FLASHLM_CHECK(!same_input || dw, "Fp8Linear::backward: same_input without dw: no cast of x to share");
  FLASHLM_CHECK(!same_input || (act_x_t_ == x && act_x_t_in_ == in),
                "Fp8Linear::backward: same_input, but the FP8 scratch holds no cast of this xᵀ (the previous backward "
                "had another input)");
  ScopedRange range("linear.backward");
  if (recipe_ == Fp8Recipe::rowwise) {
    FLASHLM_CHECK(dy_amax == nullptr,
                  "Fp8Linear::backward: dy_amax given, but rowwise casts reduce dy per row and column themselves");
    return backward_rowwise(dy, x, w.w, dx, dw, in, out, accumulate_dx, accumulate_dw, stream, weight, same_input);
  }
  act_.x = nullptr;  // the act region is dy's now
  // dy once, both ways: dy [n, out] for dx's product (K = out), dyᵀ [out, n] for dw's (K = n).
  uint8_t *qdy = region(layout_.act), *qdy_t = region(layout_.act_t);
  if (dy_amax) {  // reduced by dy's producer: the cast alone
    gpu::fp8_cast(dy, n_, out, dy_amax, gradients_, dx ? qdy : nullptr, dw ? qdy_t : nullptr, dequant(0), stream);
  } else {
    gpu::fp8_quantize(dy, n_, out, gradients_, dx ? qdy : nullptr, dw ? qdy_t : nullptr, scales(0), stream);
  }
  const Fp8Operand grad{qdy, gradients_, dequant(0)}, grad_t{qdy_t, gradients_, dequant(0)};
  if (dx) {
    // dx [n, in] = dy [n, out] · (wᵀ [in, out])ᵀ: w's transposed copy is K-major.
    const Fp8Operand qw_t = weight_operand(w, weight, in, out, /*transposed*/ true, stream);
    fp8_gemm_cuda(grad, qw_t, dx, DType::bf16, n_, in, out, accumulate_dx ? 1.0f : 0.0f, nullptr, stream);
  }
  if (dw) {
    // dw [out, in] = dyᵀ [out, n] · (xᵀ [in, n])ᵀ, into the fp32 (or bf16) gradient.
    if (!same_input) {
      const auto it = weight.empty() ? cached_.end() : cached_.find(std::string(weight));
      const InputCast* forward = it == cached_.end() ? nullptr : &it->second.input;
      act_x_t_q_ = region(layout_.act_x_t);
      if (forward && it->second.input_pass == pass_ && forward->x == x && forward->in == in) {
        float* slot = input_scales(forward->slot);
        if (forward->x_t) {  // the forward kept xᵀ: nothing to cast
          act_x_t_q_ = forward->x_t;
        } else {  // the forward of this pass reduced this x already (or x's producer did): its amax, the cast alone
          gpu::fp8_cast(x, n_, in, forward->amax, Fp8Format::e4m3, nullptr, act_x_t_q_, slot + kFp8DequantIndex,
                        stream);
        }
        act_x_t_dequant_ = slot + kFp8DequantIndex;
      } else {
        gpu::fp8_quantize(x, n_, in, Fp8Format::e4m3, nullptr, act_x_t_q_, scales(2), stream);
        act_x_t_dequant_ = dequant(2);
      }
      act_x_t_ = x;
      act_x_t_in_ = in;
    }
    fp8_gemm_cuda(grad_t, {act_x_t_q_, Fp8Format::e4m3, act_x_t_dequant_}, dw.data, dw.dtype, out, in, n_,
                  accumulate_dw ? 1.0f : 0.0f, nullptr, stream);
  }
}

void Fp8Linear::forward_rowwise(const bf16_t* x, const bf16_t* w, const bf16_t* residual, bf16_t* y, int64_t in,
                                int64_t out, void* stream, std::string_view weight, bool same_input) {
  uint8_t* qx = region(layout_.act);
  const gpu::Fp8ScaleVectors xv = scratch_vectors(0);
  if (!same_input) {
    gpu::fp8_quantize_rowwise(x, n_, in, Fp8Format::e4m3, qx, nullptr, xv, stream);
    act_ = {x, in, -1, nullptr};
  }
  const Fp8Operand qw = weight_operand(w, weight, in, out, /*transposed*/ false, stream);
  fp8_gemm_cuda({qx, Fp8Format::e4m3, xv.row_dequant, Fp8Scaling::per_row}, qw, y, DType::bf16, n_, out, in,
                residual ? 1.0f : 0.0f, residual, stream);
}

void Fp8Linear::backward_rowwise(const bf16_t* dy, const bf16_t* x, const bf16_t* w, bf16_t* dx, WeightGrad dw, int64_t in,
                                 int64_t out, bool accumulate_dx, bool accumulate_dw, void* stream,
                                 std::string_view weight, bool same_input) {
  act_.x = nullptr;  // the act region (and its vectors) are dy's now
  // dy once, both ways: dy [n, out] per token for dx's product, dyᵀ [out, n] per output channel for dw's.
  uint8_t *qdy = region(layout_.act), *qdy_t = region(layout_.act_t);
  const gpu::Fp8ScaleVectors dyv = scratch_vectors(0);
  gpu::fp8_quantize_rowwise(dy, n_, out, gradients_, dx ? qdy : nullptr, dw ? qdy_t : nullptr, dyv, stream);
  if (dx) {
    // dx [n, in] = dy [n, out] · (wᵀ [in, out])ᵀ, wᵀ per input column.
    const Fp8Operand qw_t = weight_operand(w, weight, in, out, /*transposed*/ true, stream);
    fp8_gemm_cuda({qdy, gradients_, dyv.row_dequant, Fp8Scaling::per_row}, qw_t, dx, DType::bf16, n_, in, out,
                  accumulate_dx ? 1.0f : 0.0f, nullptr, stream);
  }
  if (dw) {
    // dw [out, in] = dyᵀ [out, n] · (xᵀ [in, n])ᵀ, xᵀ per input column, into the fp32 (or bf16) gradient.
    uint8_t* qx_t = region(layout_.act_x_t);
    if (!same_input) {
      const gpu::Fp8ScaleVectors xv = scratch_vectors(2);
      gpu::fp8_quantize_rowwise(x, n_, in, Fp8Format::e4m3, nullptr, qx_t, xv, stream);
      act_x_t_ = x;
      act_x_t_in_ = in;
      act_x_t_dequant_ = xv.col_dequant;
    }
    fp8_gemm_cuda({qdy_t, gradients_, dyv.col_dequant, Fp8Scaling::per_row},
                  {qx_t, Fp8Format::e4m3, act_x_t_dequant_, Fp8Scaling::per_row}, dw.data, dw.dtype, out, in, n_,
                  accumulate_dw ? 1.0f : 0.0f, nullptr, stream);
  }
}

}  // namespace flashlm
