// The LM's layers on the CPU in fp32, forward and backward side by side (one home per layer). Row-major
// [rows, features] arrays; backward functions accumulate into parameter gradients (+=) so that
// micro-batches can add up.
#pragma once
#include <cstdint>

namespace flashlm::cpu {

// y[n, out] = x[n, in] · w[out, in]ᵀ (OpenBLAS sgemm).
void linear_forward(const float* x, const float* w, float* y, int64_t n, int64_t in, int64_t out);
// dx = dy · w (or dx += when accumulate_dx), dw += dyᵀ · x. dx or dw may be null: skipped (w or x then unused).
void linear_backward(const float* dy, const float* x, const float* w, float* dx, float* dw, int64_t n, int64_t in,
                     int64_t out, bool accumulate_dx);

// y = x / rms(x) · g with rms = sqrt(mean(x²) + eps); rstd[n] keeps 1/rms for the backward.
void rmsnorm_forward(const float* x, const float* g, float* y, float* rstd, int64_t n, int64_t d, float eps);
// dx += ∂L/∂x, dg += ∂L/∂g.
void rmsnorm_backward(const float* dy, const float* x, const float* g, const float* rstd, float* dx, float* dg,
                      int64_t n, int64_t d);

// Rotary position embedding on interleaved pairs (x[2i], x[2i+1]) of each head, in place, for
// [batch, seq, heads, head_dim] rows at positions 0..seq-1. cos/sin: [context, head_dim / 2].
void rope_forward(float* x, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
                  int64_t head_dim);
// The inverse rotation, applied to the gradient in place.
void rope_backward(float* dx, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
                   int64_t head_dim);
// cos/sin tables for positions [0, context) and theta^(-2i/head_dim).
void rope_tables(float* cos, float* sin, int64_t context, int64_t head_dim, double theta);

// s = silu(u) ⊙ g elementwise over n values.
void swiglu_forward(const float* u, const float* g, float* s, int64_t n);
void swiglu_backward(const float* ds, const float* u, const float* g, float* du, float* dg, int64_t n);

// Mean over n rows of logsumexp(logits) - logits[target].
double cross_entropy_forward(const float* logits, const int32_t* targets, int64_t n, int64_t vocab);
// Overwrites logits with ∂(mean loss)/∂logits = (softmax - onehot) / n.
void cross_entropy_backward(float* logits, const int32_t* targets, int64_t n, int64_t vocab);
// The two of them row by row (also for the fused LM head, model/lm_head.h): logsumexp of one row in fp64
// around its max; and the row overwritten with (softmax - onehot(target)) · scale given that logsumexp.
double row_log_sum_exp(const float* z, int64_t vocab);
void row_softmax_gradient(float* z, int32_t target, int64_t vocab, double log_sum_exp, float scale);

// x[i] = table[tokens[i]]; backward: dtable[tokens[i]] += dx[i].
void embedding_forward(const float* table, const int32_t* tokens, float* x, int64_t n, int64_t d);
void embedding_backward(const float* dx, const int32_t* tokens, float* dtable, int64_t n, int64_t d);

}  // namespace flashlm::cpu
