// CudaModel's FP8 linear layers (--precision fp8, ModelOptions::fp8): each product of a linear layer as
// cuBLASLt's FP8 GEMM (fp8_gemm_cuda) on FP8 copies of its operands, cast from the bf16 activations and
// the bf16 working copy of the weights just before it with tensorwise current scaling (model/fp8.h):
//
//   forward   y  = x · wᵀ (+ residual)   Q(x), Q(w) e4m3                 → bf16 (residual in the epilogue)
//   backward  dx = dy · w  (=, +=)        Q(dy) grad format, Q(wᵀ) e4m3   → bf16
//             dw = dyᵀ · x (=, +=)        Q(dyᵀ), Q(xᵀ)                    → fp32, into the master gradient
//
// The activations' FP8 copies are derived from the step's own tensors when the product needs them (the
// backward casts x again rather than keeping the forward's copy), in one buffer of the size of one layer's
// operands (fp8_scratch_layout). A weight named by the caller is cast once per pass instead: its first
// product after begin_pass() writes both its copies, w and wᵀ, from one read of the bf16 weight, and the
// pass's later products (the backward's dx, a recomputed forward) read them. The weights are the bulk of a
// step's cast traffic at training batch sizes (xl, 2 048 tokens: 41 M weight elements a layer against 3 to 13
// M activation ones a product), and they do not change within a pass, so the cached copies are the bytes a
// fresh cast would write and the results are bit-identical. The cache costs two bytes per block weight
// element (about 4 GB for xl), allocated with the layer. Nothing FP8 outlives a pass: no state to checkpoint.
// All work is queued on the model's stream, host-sync free.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>

#include "flashlm/dtype.h"
#include "flashlm/memory.h"
#include "flashlm/model.h"
#include "model/activations.h"
#include "model/cuda/gemm.h"
#include "model/fp8.h"

namespace flashlm {

class Fp8Linear {
 public:
  // For a model of this config running `tokens` tokens per step. d_model, d_ff and tokens must be
  // multiples of 16 (cuBLASLt's FP8 kernels): an Error otherwise.
  Fp8Linear(const ModelConfig& c, int64_t tokens, Fp8Format gradients);

  // A new pass (a forward and the backward that follows it): the weights may have changed since the last,
  // so each named weight's FP8 copies are cast again at its first product.
  void begin_pass() { ++pass_; }

  // y[n, out] = x[n, in] · w[out, in]ᵀ (+ residual[n, out] when not null). weight: w's name, whose FP8 copies
  // are cast once per pass and reused (see the top); empty: w is cast for this product alone.
  void forward(const bf16_t* x, const bf16_t* w, const bf16_t* residual, bf16_t* y, int64_t in, int64_t out,
               void* stream, std::string_view weight = {});
  // dx[n, in] (= or += when accumulate_dx) dy[n, out] · w[out, in] (dx may be null: skipped); dw[out, in]
  // (+= or = when !accumulate_dw) dy[n, out]ᵀ · x[n, in] in fp32 (dw may be null: skipped). weight: as above.
  void backward(const bf16_t* dy, const bf16_t* x, const bf16_t* w, bf16_t* dx, float* dw, int64_t in, int64_t out,
                bool accumulate_dx, bool accumulate_dw, void* stream, std::string_view weight = {});

  Fp8Format gradients() const { return gradients_; }

 private:
  uint8_t* region(int64_t offset) const { return static_cast<uint8_t*>(buffer_.data()) + offset; }
  float* scales(int slot) const { return reinterpret_cast<float*>(region(layout_.scales)) + kFp8ScaleSlotFloats * slot; }
  float* dequant(int slot) const { return scales(slot) + kFp8DequantIndex; }
  void check_widths(const char* fn, int64_t in, int64_t out) const;

  // One named weight's place in the cache: w's copy at `offset`, wᵀ's at `offset_t`, its scale slot, and the
  // pass they were cast in.
  struct CachedWeight {
    int64_t offset = 0, offset_t = 0, elements = 0;
    int slot = 0;
    uint64_t pass = 0;
  };
  // w (or wᵀ when transposed) as a GEMM operand: from the cache when named, else cast into the scratch.
  Fp8Operand weight_operand(const bf16_t* w, std::string_view name, int64_t in, int64_t out, bool transposed,
                            void* stream);
  // The weight's entry, its copies cast now if this pass has not cast them yet.
  const CachedWeight& cached(std::string_view name, const bf16_t* w, int64_t in, int64_t out, void* stream);
  uint8_t* cache_at(int64_t offset) const { return static_cast<uint8_t*>(cache_.data()) + offset; }
  float* cache_dequant(int slot) const {
    return reinterpret_cast<float*>(cache_at(layout_.cache_scales)) + kFp8ScaleSlotFloats * slot + kFp8DequantIndex;
  }

  int64_t n_;
  Fp8Format gradients_;
  Fp8ScratchLayout layout_;
  Buffer buffer_;
  // The weight cache (layout_.cache_*): the block weights' FP8 copies, both ways, then their scale slots.
  Buffer cache_;
  int64_t cache_used_ = 0;
  std::unordered_map<std::string, CachedWeight> cached_;
  uint64_t pass_ = 1;
};

}  // namespace flashlm
