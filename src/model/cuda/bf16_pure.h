// Kernels of pure-bf16 training (ModelOptions::bf16_pure): parameters, gradients and AdamW moments held in
// bf16, every value widened to fp32 in registers and rounded once when stored (torch's fused AdamW does the
// same for bf16 parameters). Device pointers, asynchronous on `stream`, flashlm::Error on bad sizes.
//
// adamw_step_bf16's signature is the one agreed with the kernel layer's work (issue 16, feat/lm-ops); it
// lives here until that lands, with the clipping factor as an optional last argument.
#pragma once
#include <cstdint>

#include "flashlm/dtype.h"

namespace flashlm::gpu {

// One AdamW step over n bf16 values (gpu::adamw_step's arithmetic, operation by operation, on the widened
// values): m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g²; w -= alpha m / (sqrt(v) + eps) with
// alpha = lr sqrt(1 - b2^step) / (1 - b1^step); w -= lr · weight_decay · w; then w, m, v rounded to bf16.
// grad_scale multiplies each gradient first (the clipping factor). step is 1-based.
void adamw_step_bf16(bf16_t* param, const bf16_t* grad, bf16_t* m, bf16_t* v, int64_t n, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step, void* stream,
                     float grad_scale = 1.0f);

// x[r] = table[tokens[r]] (bf16 rows copied exactly); rows whose token lies outside [0, vocab) become NaN.
void embedding_forward_bf16(const bf16_t* table, const int32_t* tokens, bf16_t* x, int64_t n, int64_t d,
                            int64_t vocab, void* stream);

}  // namespace flashlm::gpu
