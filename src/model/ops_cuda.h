// The LM's layers on CUDA, mirroring ops_cpu.h (same math, same row-major [rows, features] arrays, and
// backward functions that ACCUMULATE (+=) into parameter gradients), for mixed-precision training:
//   - activations and activation gradients are T ∈ {float, bf16_t, fp16_t} (the same bits as float,
//     __nv_bfloat16 and __half, so .cu callers may reinterpret_cast their pointers);
//   - every computation runs in fp32, values are rounded to T once, when stored (round to nearest even);
//   - parameters (master copies), parameter gradients and AdamW moments are fp32.
//
// All pointers are device pointers. Every function is asynchronous on `stream` (a cudaStream_t; nullptr is
// the legacy default stream) and checks its launches (flashlm::CudaError on failure); bad sizes raise
// flashlm::Error before anything is queued. Functions marked [scratch] take a stream-ordered workspace
// (Buffer::allocate_on_stream) that is freed on the same stream, so they never block the host either.
//
// Determinism: nothing here uses floating-point atomics. Every reduction (RMSNorm gains, embedding rows,
// squared norm) adds in an order fixed by the sizes alone (not by the GPU or by scheduling), so results are
// bit-identical from run to run, which bit-exact checkpoint resume relies on.
//
// Array arguments must not overlap unless stated otherwise.
#pragma once
#include <cstddef>
#include <cstdint>

#include "flashlm/dtype.h"

namespace flashlm::gpu {

// ---------------------------------------------------------------------------------------------------
// Layers. T ∈ {float, bf16_t, fp16_t} (explicitly instantiated in ops_cuda.cu).

// y = x / rms(x) · gain with rms = sqrt(mean(x²) + eps); rstd[n] (fp32) keeps 1/rms for the backward.
// x, y: [n, d]; gain: [d].
template <class T>
void rmsnorm_forward(const T* x, const float* gain, T* y, float* rstd, int64_t n, int64_t d, float eps,
                     void* stream);
// dx += ∂L/∂x (in T), dgain += ∂L/∂gain (fp32). [scratch: min(ceil(n / 64), 1024) · d floats]
template <class T>
void rmsnorm_backward(const T* dy, const T* x, const float* gain, const float* rstd, T* dx, float* dgain, int64_t n,
                      int64_t d, void* stream);

// Rotary embedding, in place, on interleaved pairs (x[2i], x[2i+1]) of [batch, seq, heads, head_dim]
// contiguous rows at positions 0..seq-1. cos/sin: fp32 device tables [context >= seq, head_dim / 2], as
// cpu::rope_tables makes them. head_dim must be even.
template <class T>
void rope_forward(T* x, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
                  int64_t head_dim, void* stream);
// The inverse rotation, applied to the gradient in place.
template <class T>
void rope_backward(T* dx, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
                   int64_t head_dim, void* stream);

// s = silu(u) ⊙ g over n values; backward writes (does not accumulate) du and dg.
template <class T>
void swiglu_forward(const T* u, const T* g, T* s, int64_t n, void* stream);
template <class T>
void swiglu_backward(const T* ds, const T* u, const T* g, T* du, T* dg, int64_t n, void* stream);

// row_loss[r] = logsumexp(logits[r]) - logits[r, targets[r]] in fp32 for each of n rows of `vocab`
// logits; the caller averages. A target outside [0, vocab) gives row_loss = NaN.
template <class T>
void cross_entropy_forward(const T* logits, const int32_t* targets, float* row_loss, int64_t n, int64_t vocab,
                           void* stream);
// Overwrites logits with (softmax(logits) - onehot(target)) · scale (scale = 1/n for the mean loss, times
// the loss scale with fp16). Rows with a target outside [0, vocab) become NaN.
template <class T>
void cross_entropy_backward(T* logits, const int32_t* targets, int64_t n, int64_t vocab, float scale, void* stream);

// x[r] = table[tokens[r]] rounded to T; table: fp32 [vocab, d]. Rows whose token lies outside
// [0, vocab) become NaN.
template <class T>
void embedding_forward(const float* table, const int32_t* tokens, T* x, int64_t n, int64_t d, int64_t vocab,
                       void* stream);
// dtable[tokens[r]] += dx[r], rows of one token added in increasing r (as cpu::embedding_backward does,
// so the fp32 result is bit-identical to it). Tokens outside [0, vocab) are skipped.
// [scratch: 4n int32 + a radix-sort workspace]
template <class T>
void embedding_backward(const T* dx, const int32_t* tokens, float* dtable, int64_t n, int64_t d, int64_t vocab,
                        void* stream);

// ---------------------------------------------------------------------------------------------------
// Optimizer.

// One AdamW step (CS336; CpuModel::adamw_step's arithmetic, operation by operation) over n fp32 values,
// `step` 1-based: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g²; w -= alpha m / (sqrt(v) + eps) with
// alpha = lr sqrt(1 - b2^step) / (1 - b1^step); then w -= lr · weight_decay · w. When param_copy is not
// null, it receives the updated weights rounded to T (the copy the forward reads); with T = float and
// no copy, call adamw_step<float>(..., nullptr, stream). grad_scale multiplies each gradient first (once,
// rounded: the result of scale_inplace(grad, n, grad_scale) followed by the step, without that pass).
template <class T>
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, T* param_copy, void* stream, float grad_scale = 1.0f);

// ---------------------------------------------------------------------------------------------------
// Reductions and elementwise utilities.

// *out = Σ x[i]² accumulated in fp64 (device scalar), in a fixed order: 8192-element chunks, then the
// chunk sums by one block. [scratch: ceil(n / 8192) doubles]
void squared_norm(const float* x, int64_t n, double* out, void* stream);
// *out = number of NaN/±inf values among x[0, n) (device scalar, saturated at INT_MAX).
// [scratch: ceil(n / 8192) int64]
template <class T>
void count_nonfinite(const T* x, int64_t n, int* out, void* stream);

// x *= s over n fp32 values.
void scale_inplace(float* x, int64_t n, float s, void* stream);
// dst = src rounded to T (float -> float is a copy); and back to fp32 (exact).
template <class T>
void cast_from_f32(const float* src, T* dst, int64_t n, void* stream);
template <class T>
void cast_to_f32(const T* src, float* dst, int64_t n, void* stream);
// y += x (the residual stream), computed in fp32 and rounded to T.
template <class T>
void add_inplace(T* y, const T* x, int64_t n, void* stream);

// cudaMemsetAsync(dst, value, bytes, stream) (e.g. 0 to clear gradients, 0xFF to poison with NaN), and
// cudaStreamSynchronize(stream), for callers without the CUDA headers.
void memset_async(void* dst, int value, size_t bytes, void* stream);
void stream_synchronize(void* stream);

}  // namespace flashlm::gpu
