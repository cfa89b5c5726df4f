// CudaModel's FP8 linear layers (--precision fp8, ModelOptions::fp8): each product of a linear layer as
// cuBLASLt's FP8 GEMM (fp8_gemm_cuda) on FP8 copies of its operands, cast from the bf16 activations and
// the bf16 working copy of the weights just before it with tensorwise current scaling (model/fp8.h):
//
//   forward   y  = x · wᵀ (+ residual)   Q(x), Q(w) e4m3                 → bf16 (residual in the epilogue)
//   backward  dx = dy · w  (=, +=)        Q(dy) grad format, Q(wᵀ) e4m3   → bf16
//             dw = dyᵀ · x (=, +=)        Q(dyᵀ), Q(xᵀ)                    → fp32, into the master gradient
//                                                                            (or bf16: ModelOptions::grad_dtype)
//
// The activations' FP8 copies are derived from the step's own tensors when the product needs them (the
// backward casts x again rather than keeping the forward's copy), in one buffer of the size of one layer's
// operands (fp8_scratch_layout). For a named weight the forward keeps x's scales, and the backward's cast of
// xᵀ reuses its amax instead of reducing x again (the same tensor: the same amax). Two products of one input
// (w1 and w3 of the feed-forward) share its cast: the caller says so (same_input), and the second product
// reads the first's FP8 copy. A weight named by the caller is cast once per pass instead: its first
// product after begin_pass() writes both its copies, w and wᵀ, from one read of the bf16 weight, and the
// pass's later products (the backward's dx, a recomputed forward) read them. The weights are the bulk of a
// step's cast traffic at training batch sizes (xl, 2 048 tokens: 41 M weight elements a layer against 3 to 13
// M activation ones a product), and they do not change within a pass, so the cached copies are the bytes a
// fresh cast would write and the results are bit-identical. The cache costs two bytes per block weight
// element (about 4 GB for xl), allocated with the layer. Nothing FP8 outlives a pass: no state to checkpoint.
// With keep_inputs (tensorwise, nothing recomputed: fp8_keeps_inputs) a named weight's forward casts its input
// both ways, and the transposed copy waits in the cache for the backward's dw product, which then casts
// nothing: x is read once a step instead of twice, and a small cast launch (latency-bound at training sizes:
// dev/cuda/04_fp8_cast_variants.cu) goes. The same bytes as the backward's cast with the forward's amax.
// All work is queued on the model's stream, host-sync free. Under FSDP's FP8 gather a named weight arrives as
// the e4m3 bytes and scale its cast would give (Fp8LinearWeight): no cast, no cache, wᵀ transposed from them.
//
// Rowwise (Fp8Recipe::rowwise): each operand scaled per row of the dimension its product does not sum over,
// the GEMMs reading the scale vectors (Fp8Scaling::per_row):
//
//   forward   Q(x) per token, Q(w) per output channel
//   backward  dx: Q(dy) per token, Q(wᵀ) per input column;  dw: Q(dyᵀ) per output channel, Q(xᵀ) per input column
//
// Every cast reduces its own row and column amaxes (fp8_quantize_rowwise): the producers' fused amaxes and the
// forward's amax of x are tensorwise and not used. The cache and same_input work as above, the scale vectors
// beside the copies (fp8_scratch_layout's vector sets).
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>
#include <string_view>
#include <unordered_map>

#include "flashlm/dtype.h"
#include "flashlm/memory.h"
#include "flashlm/model.h"
#include "model/activations.h"
#include "model/cuda/fp8.h"
#include "model/cuda/gemm.h"
#include "model/fp8.h"

namespace flashlm {

// A weight as a product reads it: its bf16 values [out, in], cast by the layer (implicitly, from a bf16
// pointer), or — FSDP's FP8 gather (ModelOptions::fsdp_fp8_gather) — the e4m3 bytes [out, in] it arrived as
// and its scale slot (ParameterStorage::fp8_scales: the dequantisation scale at kFp8DequantIndex), which the
// layer multiplies as they stand: the forward's GEMM reads the bytes, and the backward's dx product their
// transpose (gpu::fp8_transpose into the scratch's weight region; a transpose of tensorwise bytes keeps
// their scale, so it is the transposed cast, bit for bit). Those bytes are what the cast of the whole bf16
// weight writes (dist/fp8_gather.h), so such a product multiplies the plain step's operands. Tensorwise
// only: rowwise scales w per row and wᵀ per column, which tensorwise bytes cannot give (an Error).
struct Fp8LinearWeight {
  Fp8LinearWeight(const bf16_t* values) : w(values) {}  // NOLINT(google-explicit-constructor): a bf16 weight
  Fp8LinearWeight(const uint8_t* bytes, const float* scale_slot) : q(bytes), scales(scale_slot) {}
  bool gathered() const { return q != nullptr; }
  const bf16_t* w = nullptr;
  const uint8_t* q = nullptr;
  const float* scales = nullptr;
};

// A named block weight as the model holds it for a pass: its name (Fp8Linear's cache key), its bf16 values
// [out, in] and their place, fixed while the model lives (not under FSDP's sharded storage).
struct Fp8WeightRef {
  std::string name;
  const bf16_t* w;
  int64_t in, out;
};

class Fp8Linear {
 public:
  // For a model of this config running `tokens` tokens per step. d_model, d_ff and tokens must be
  // multiples of 16 (cuBLASLt's FP8 kernels): an Error otherwise.
  // keep_inputs: see the top (an Error with rowwise).
  Fp8Linear(const ModelConfig& c, int64_t tokens, Fp8Format gradients, Fp8Recipe recipe = Fp8Recipe::tensorwise,
            bool keep_inputs = false);

  // A new pass (a forward and the backward that follows it): the weights may have changed since the last,
  // so each named weight's FP8 copies are cast again at its first product. weights (tensorwise; empty: none):
  // the named weights the pass will read, whose amaxes are then reduced here in one kernel (one memset of
  // their slots, one launch) instead of one reduction per weight at its cast, which only casts. Their places
  // go up to the device once, outside any CUDA-graph capture; a list that changes inside a capture is taken
  // weight by weight that pass instead.
  // When the slots hold the weights' amaxes already (weight_amaxes_current below), for exactly these weights,
  // it takes them instead and reduces nothing: once, the next begin_pass reduces again unless told so anew.
  void begin_pass(std::span<const Fp8WeightRef> weights = {}, void* stream = nullptr);

  // The named weights' amaxes from the kernel that stores the weights (the optimizer step: gpu::adamw_step's
  // StoredAmaxes; ModelOptions::fp8_fused_amax), tensorwise only. weight_amax: where weight r's amax goes (its
  // scale slot's, which begin_pass would reduce into; its entry made at first use). clear_weight_amaxes: zeroes
  // every weight's slot, queued before that kernel. set_weight_amaxes_current(weights): the slots now hold the
  // amaxes of these weights as stored, so that the next begin_pass over them reduces nothing. weights_changed:
  // anything else that writes a weight calls it (the next begin_pass then reduces): stale, never trusted.
  float* weight_amax(const Fp8WeightRef& r);
  void clear_weight_amaxes(void* stream);
  void set_weight_amaxes_current(std::span<const Fp8WeightRef> weights);
  void weights_changed() {
    weight_amaxes_.stale();
    weight_copies_.stale();
  }
  bool weight_amaxes_current() const { return weight_amaxes_.current(); }
  // The named weights' FP8 copies from the optimizer step itself (gpu::adamw_step's Fp8WeightCopies;
  // ModelOptions::fp8_optimizer_weight_cast), tensorwise only. weight_copy: where weight r's copies and scale slot
  // are (its cache entry, made at first use). set_weight_copies_current(weights): the cache holds these weights'
  // copies as stored, with their dequantisation scales and amaxes in their slots, so that the next begin_pass
  // over exactly these weights casts none of them (once, as the amaxes; weights_changed makes them stale).
  // cast_weights: the copies of these weights cast now from their bf16 values, their amaxes reduced first (a
  // graphed step whose captured pass takes the optimizer's copies, when they are stale); false where it could
  // not be queued (inside a capture).
  struct WeightCopy {
    uint8_t* q;
    uint8_t* qt;
    float* slot;
  };
  WeightCopy weight_copy(const Fp8WeightRef& r);
  void set_weight_copies_current(std::span<const Fp8WeightRef> weights);
  bool weight_copies_current() const { return weight_copies_.current(); }
  bool cast_weights(std::span<const Fp8WeightRef> weights, void* stream);
  // begin_pass's reduction of these weights' amaxes into their slots, queued now (the stale fallback of a
  // graphed step whose captured begin_pass takes the optimizer's amaxes). False where it was not queued: inside
  // a CUDA-graph capture with a list of weights not uploaded yet (their casts then reduce them one by one).
  bool reduce_weight_amaxes(std::span<const Fp8WeightRef> weights, void* stream);

  // y[n, out] = x[n, in] · w[out, in]ᵀ (+ residual[n, out] when not null). weight: w's name, whose FP8 copies
  // are cast once per pass and reused (see the top); empty: w is cast for this product alone.
  // same_input: x is the previous forward's x, unchanged since, and its FP8 copy is reused (an Error if
  // the previous product had another input or a backward came between).
  // x_amax: x's amax, written by the kernel that produced x (produced_amax); null: reduced here. Tensorwise
  // only (rowwise reduces per row: an Error when given).
  // w: bf16 values, or gathered FP8 bytes (Fp8LinearWeight), which skip the cast and the cache.
  void forward(const bf16_t* x, const Fp8LinearWeight& w, const bf16_t* residual, bf16_t* y, int64_t in, int64_t out,
               void* stream, std::string_view weight = {}, bool same_input = false, const float* x_amax = nullptr);
  // dx[n, in] (= or += when accumulate_dx) dy[n, out] · w[out, in] (dx may be null: skipped); dw[out, in]
  // (+= or = when !accumulate_dw) dy[n, out]ᵀ · x[n, in] in fp32, or in bf16 (a bf16 WeightGrad: the GEMM's fp32
  // sum rounded once; dw may be null: skipped). weight: as above.
  // same_input: x is the previous backward's x (both computing dw), and its transposed FP8 copy is reused.
  // For a named weight whose forward this pass saw this same x, xᵀ is cast with that forward's amax.
  // dy_amax: as x_amax, for dy.
  void backward(const bf16_t* dy, const bf16_t* x, const Fp8LinearWeight& w, bf16_t* dx, WeightGrad dw, int64_t in,
                int64_t out, bool accumulate_dx, bool accumulate_dw, void* stream, std::string_view weight = {},
                bool same_input = false, const float* dy_amax = nullptr);

  // Where the kernel producing tensor t of block `layer` writes its amax (a device float that lives as long
  // as this object), for forward's x_amax and backward's dy_amax. Tensorwise: null under rowwise, whose casts
  // reduce per row and column themselves, so that the producers skip the reduction.
  float* produced_amax(int64_t layer, Fp8Produced t) const;

  Fp8Format gradients() const { return gradients_; }
  Fp8Recipe recipe() const { return recipe_; }

 private:
  uint8_t* region(int64_t offset) const { return static_cast<uint8_t*>(buffer_.data()) + offset; }
  float* scales(int slot) const { return reinterpret_cast<float*>(region(layout_.scales)) + kFp8ScaleSlotFloats * slot; }
  float* dequant(int slot) const { return scales(slot) + kFp8DequantIndex; }
  void check_widths(const char* fn, int64_t in, int64_t out) const;

  // One named weight's place in the cache: w's copy at `offset`, wᵀ's at `offset_t`, its scale slot, and the
  // pass they were cast in.
  // A forward input's cast: which x (x [n, in]; null: none), the scale slot its dequantisation scale went to
  // (input_scales(slot), or -1 for the scratch's slot 0) and its amax (in that slot, or its producer's).
  // With keep_inputs, x_t: x's transposed copy, kept for the backward (null: not kept).
  struct InputCast {
    const bf16_t* x = nullptr;
    int64_t in = 0;
    int slot = -1;
    const float* amax = nullptr;
    uint8_t* x_t = nullptr;
  };
  // input: the cast of this weight's forward input in pass input_pass (its own slot, or that of the
  // product whose input it shared); the backward reuses its amax for that same x only.
  // input_t: with keep_inputs, the offset of its forward input's transposed copy in the cache (-1: none yet).
  // amax_pass: the pass whose begin_pass reduced its amax (its cast then casts alone).
  struct CachedWeight {
    int64_t offset = 0, offset_t = 0, elements = 0, input_t = -1;
    uint64_t amax_pass = 0;
    int slot = 0;
    uint64_t pass = 0, input_pass = 0;
    InputCast input;
  };
  // The cached copy of w (or wᵀ when transposed) as a GEMM operand: rowwise, w's row scales or (wᵀ) its
  // column scales.
  Fp8Operand cached_operand(const CachedWeight& e, bool transposed) const {
    if (recipe_ == Fp8Recipe::rowwise) {
      const gpu::Fp8ScaleVectors v = cache_vectors(e.slot);
      return {cache_at(transposed ? e.offset_t : e.offset), Fp8Format::e4m3, transposed ? v.col_dequant : v.row_dequant,
              Fp8Scaling::per_row};
    }
    return {cache_at(transposed ? e.offset_t : e.offset), Fp8Format::e4m3, cache_dequant(e.slot)};
  }
  // w (or wᵀ when transposed) as a GEMM operand: gathered bytes as they stand (wᵀ: transposed into the
  // scratch's weight region), from the cache when named, else cast into the scratch.
  Fp8Operand weight_operand(const Fp8LinearWeight& w, std::string_view name, int64_t in, int64_t out,
                            bool transposed, void* stream);
  // Refuses gathered bytes under rowwise, and bytes without a scale slot.
  void check_weight(const char* fn, const Fp8LinearWeight& w, std::string_view name) const;
  // Where weight e's forward input [n_, in] keeps its transposed copy (keep_inputs), handed out at first use.
  uint8_t* kept_input(CachedWeight& e, int64_t in);
  // The weight's entry, created (with its cache places) at its first use.
  CachedWeight& entry(std::string_view name, int64_t in, int64_t out);
  // Its copies cast from w with the amax its slot holds.
  void cast_with_amax(const CachedWeight& e, const bf16_t* w, int64_t in, int64_t out, void* stream);
  // The weight's entry, its copies cast now if this pass has not cast them yet.
  CachedWeight& cached(std::string_view name, const bf16_t* w, int64_t in, int64_t out, void* stream);
  uint8_t* cache_at(int64_t offset) const { return static_cast<uint8_t*>(cache_.data()) + offset; }
  float* cache_dequant(int slot) const {
    return reinterpret_cast<float*>(cache_at(layout_.cache_scales)) + kFp8ScaleSlotFloats * slot + kFp8DequantIndex;
  }
  // The scale slot of weight `slot`'s forward input (after the weights' own slots).
  float* input_scales(int slot) const {
    return reinterpret_cast<float*>(cache_at(layout_.cache_scales)) +
           kFp8ScaleSlotFloats * (layout_.cache_slots + slot);
  }
  // Rowwise: the scale vectors of the scratch's operand `slot` (0: act's, x or dy; 1: the weight region's;
  // 2: act_x_t's) and of cached weight `slot`.
  gpu::Fp8ScaleVectors vectors(uint8_t* base, const Fp8VectorSet& set) const {
    return {set.vector(base, 0), set.vector(base, 1), set.vector(base, 2), set.vector(base, 3)};
  }
  gpu::Fp8ScaleVectors scratch_vectors(int slot) const {
    return vectors(region(layout_.vectors + slot * layout_.vector_set.bytes()), layout_.vector_set);
  }
  gpu::Fp8ScaleVectors cache_vectors(int slot) const {
    return vectors(cache_at(layout_.cache_vectors + slot * layout_.cache_vector_set.bytes()), layout_.cache_vector_set);
  }
  void forward_rowwise(const bf16_t* x, const bf16_t* w, const bf16_t* residual, bf16_t* y, int64_t in, int64_t out,
                       void* stream, std::string_view weight, bool same_input);
  void backward_rowwise(const bf16_t* dy, const bf16_t* x, const bf16_t* w, bf16_t* dx, WeightGrad dw, int64_t in,
                        int64_t out, bool accumulate_dx, bool accumulate_dw, void* stream, std::string_view weight,
                        bool same_input);

  // What the scratch's FP8 copies hold: the forward's input cast in act, the backward's xᵀ in act_x_t (and
  // its dequantisation scale); null x: none.
  InputCast act_;
  const bf16_t* act_x_t_ = nullptr;
  uint8_t* act_x_t_q_ = nullptr;  // where that xᵀ's FP8 copy is: the scratch's act_x_t or a kept input's
  const float* act_x_t_dequant_ = nullptr;
  int64_t act_x_t_in_ = 0;

  int64_t n_;
  int64_t layers_;
  Fp8Format gradients_;
  Fp8Recipe recipe_;
  Fp8ScratchLayout layout_;
  Buffer buffer_;
  // The weight cache (layout_.cache_*): the block weights' FP8 copies, both ways, then their scale slots.
  Buffer cache_;
  int64_t cache_used_ = 0;
  bool keep_inputs_ = false;
  // begin_pass's weight amaxes: the segment table on the device (one per cache slot at most) and the host
  // copy it was uploaded from.
  Buffer amax_segments_;
  std::vector<gpu::Fp8AmaxSegment> amax_table_;
  int64_t amax_chunks_ = 0;
  Fp8WeightAmaxes weight_amaxes_;  // whether the slots hold the weights' amaxes (set_weight_amaxes_current)
  Fp8WeightAmaxes weight_copies_;  // whether the cache holds the optimizer's copies (set_weight_copies_current)
  int64_t inputs_used_ = 0;  // bytes of the kept inputs' region handed out
  std::unordered_map<std::string, CachedWeight> cached_;
  uint64_t pass_ = 1;
};

}  // namespace flashlm
