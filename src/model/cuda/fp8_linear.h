// CudaModel's FP8 linear layers (--precision fp8, ModelOptions::fp8): each product of a linear layer as
// cuBLASLt's FP8 GEMM (fp8_gemm_cuda) on FP8 copies of its operands, cast from the bf16 activations and
// the bf16 working copy of the weights just before it with tensorwise current scaling (model/fp8.h):
//
//   forward   y  = x · wᵀ (+ residual)   Q(x), Q(w) e4m3                 → bf16 (residual in the epilogue)
//   backward  dx = dy · w  (=, +=)        Q(dy) grad format, Q(wᵀ) e4m3   → bf16
//             dw = dyᵀ · x (=, +=)        Q(dyᵀ), Q(xᵀ)                    → fp32, into the master gradient
//
// Every FP8 copy and scale is derived from the step's own tensors when the product needs it (the backward
// casts x and w again rather than keeping the forward's copies), so nothing FP8 outlives a GEMM: no state
// to checkpoint, recomputation recomputes nothing extra, and the copies live in one buffer of the size of
// one layer's operands (fp8_scratch_layout). All work is queued on the model's stream, host-sync free.
#pragma once
#include <cstdint>

#include "flashlm/dtype.h"
#include "flashlm/memory.h"
#include "flashlm/model.h"
#include "model/activations.h"
#include "model/fp8.h"

namespace flashlm {

class Fp8Linear {
 public:
  // For a model of this config running `tokens` tokens per step. d_model, d_ff and tokens must be
  // multiples of 16 (cuBLASLt's FP8 kernels): an Error otherwise.
  Fp8Linear(const ModelConfig& c, int64_t tokens, Fp8Format gradients);

  // y[n, out] = x[n, in] · w[out, in]ᵀ (+ residual[n, out] when not null).
  void forward(const bf16_t* x, const bf16_t* w, const bf16_t* residual, bf16_t* y, int64_t in, int64_t out,
               void* stream);
  // dx[n, in] (= or += when accumulate_dx) dy[n, out] · w[out, in] (dx may be null: skipped); dw[out, in]
  // (+= or = when !accumulate_dw) dy[n, out]ᵀ · x[n, in] in fp32 (dw may be null: skipped).
  void backward(const bf16_t* dy, const bf16_t* x, const bf16_t* w, bf16_t* dx, float* dw, int64_t in, int64_t out,
                bool accumulate_dx, bool accumulate_dw, void* stream);

  Fp8Format gradients() const { return gradients_; }

 private:
  uint8_t* region(int64_t offset) const { return static_cast<uint8_t*>(buffer_.data()) + offset; }
  float* scales(int slot) const { return reinterpret_cast<float*>(region(layout_.scales)) + kFp8ScaleSlotFloats * slot; }
  float* dequant(int slot) const { return scales(slot) + kFp8DequantIndex; }
  void check_widths(const char* fn, int64_t in, int64_t out) const;

  int64_t n_;
  Fp8Format gradients_;
  Fp8ScratchLayout layout_;
  Buffer buffer_;
};

}  // namespace flashlm
