// Optimizer arithmetic shared by every optimizer of the library (the models' AdamW, ZeRO-1's sharded one in
// src/dist/), on the CPU and on CUDA side by side, so that the same gradients give the same bits whichever
// of them updates a parameter. Flat fp32 arrays: parameters (master copies), gradients, AdamW moments.
//
// GPU functions: device pointers, asynchronous on `stream` (a cudaStream_t; nullptr is the legacy default
// stream), launches checked (flashlm::CudaError), bad sizes raise flashlm::Error before anything is queued;
// only in builds with CUDA (FLASHLM_WITH_CUDA). This header itself needs no CUDA headers.
#pragma once
#include <cstdint>

#include "flashlm/dtype.h"

namespace flashlm::cpu {

// Σ x[i]² over n values, accumulated in fp64 in index order.
double sum_squares(const float* x, int64_t n);
// The factor that scales gradients of global norm `norm` down to max_norm (used when norm > max_norm).
inline float clip_scale(double norm, double max_norm) { return float(max_norm / (norm + 1e-6)); }
// One AdamW step (CS336; gpu::adamw_step's arithmetic) over n fp32 values, `step` 1-based:
// m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g²; w -= alpha m / (sqrt(v) + eps) with
// alpha = lr sqrt(1 - b2^step) / (1 - b1^step); then w -= lr · weight_decay · w. Element-wise: any split of
// a buffer into ranges gives the same bits as one call over all of it.
void adamw_step(float* w, const float* g, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step);

}  // namespace flashlm::cpu

namespace flashlm::gpu {

// One AdamW step (CS336; cpu::adamw_step's arithmetic, operation by operation) over n fp32 values,
// `step` 1-based: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g²; w -= alpha m / (sqrt(v) + eps) with
// alpha = lr sqrt(1 - b2^step) / (1 - b1^step); then w -= lr · weight_decay · w. When param_copy is not
// null, it receives the updated weights rounded to T ∈ {float, bf16_t, fp16_t} (the copy the forward
// reads); with T = float and no copy, call adamw_step<float>(..., nullptr, stream). grad_scale multiplies
// each gradient first (once, rounded: the result of scale_inplace(grad, n, grad_scale) followed by the
// step, without that pass).
template <class T>
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, T* param_copy, void* stream, float grad_scale = 1.0f);

// *out = Σ x[i]² accumulated in fp64 (device scalar), in a fixed order: 8192-element chunks, then the
// chunk sums by one block. [scratch: ceil(n / 8192) doubles, stream-ordered]
void squared_norm(const float* x, int64_t n, double* out, void* stream);

}  // namespace flashlm::gpu
