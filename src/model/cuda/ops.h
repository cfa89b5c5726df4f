// The LM's layers on CUDA, one file per layer in model/cuda/ (forward, backward and launcher together),
// mirroring ops_cpu.h (same math, same row-major [rows, features] arrays, and backward functions that
// ACCUMULATE (+=) into parameter gradients), for mixed-precision training:
//   - activations and activation gradients are T ∈ {float, bf16_t, fp16_t} (the same bits as float,
//     __nv_bfloat16 and __half, so .cu callers may reinterpret_cast their pointers);
//   - every computation runs in fp32, values are rounded to T once, when stored (round to nearest even);
//   - parameters (master copies) and parameter gradients are fp32.
// The optimizer (AdamW, the gradients' norm) is in optim/optimizer.h, casts and the other array utilities
// in core/array_ops.h.
//
// All pointers are device pointers. Every function is asynchronous on `stream` (a cudaStream_t; nullptr is
// the legacy default stream) and checks its launches (flashlm::CudaError on failure); bad sizes raise
// flashlm::Error before anything is queued. Functions marked [scratch] take a stream-ordered workspace
// (Buffer::allocate_on_stream) that is freed on the same stream, so they never block the host either.
//
// Determinism: nothing here uses floating-point atomics. Every reduction (RMSNorm gains, embedding rows)
// adds in an order fixed by the sizes alone (not by the GPU or by scheduling), so results are bit-identical
// from run to run, which bit-exact checkpoint resume relies on.
//
// Array arguments must not overlap unless stated otherwise.
#pragma once
#include <cstdint>

#include "flashlm/dtype.h"

namespace flashlm::gpu {

// ---------------------------------------------------------------------------------------------------
// Layers. T ∈ {float, bf16_t, fp16_t} (explicitly instantiated in each layer's file).

// y = x / rms(x) · gain with rms = sqrt(mean(x²) + eps); rstd[n] (fp32) keeps 1/rms for the backward.
// x, y: [n, d]; gain: [d].
// y_amax (a device float; null: none): the amax of y as stored, as swiglu_forward's s_amax.
template <class T>
void rmsnorm_forward(const T* x, const float* gain, T* y, float* rstd, int64_t n, int64_t d, float eps,
                     void* stream, float* y_amax = nullptr);
// dx += ∂L/∂x (in T), dgain += ∂L/∂gain (fp32). [scratch: min(ceil(n / 64), 1024) · d floats]
// dx_amax (a device float; null: none): the amax of dx as stored (the residual gradient that the next FP8
// product reads as its dy), as rmsnorm_forward's y_amax.
template <class T>
void rmsnorm_backward(const T* dy, const T* x, const float* gain, const float* rstd, T* dx, float* dgain, int64_t n,
                      int64_t d, void* stream, float* dx_amax = nullptr);

// Rotary embedding, in place, on interleaved pairs (x[2i], x[2i+1]) of [batch, seq, heads, head_dim] rows
// at positions 0..seq-1. cos/sin: fp32 device tables [context >= seq, head_dim / 2], as cpu::rope_tables
// makes them. head_dim must be even. token_stride: elements from one token's heads to the next's (0: heads ·
// head_dim, contiguous); the CUDA model rotates q and k in one call as 2·heads heads of its [tokens, 3·d]
// q|k|v array.
template <class T>
void rope_forward(T* x, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
                  int64_t head_dim, void* stream, int64_t token_stride = 0);
// The inverse rotation, applied to the gradient in place.
// amax (a device float; null: none): the amax of the gradient as stored (swiglu_forward's s_amax), over heads
// [0, amax_heads) of each token (0: heads, the rotated ones): those past `heads` are read, not rotated. The CUDA
// model's dqkv (the q|k|v projection's dy) passes 3·heads, so that dv, which the attention backward wrote beside
// dq and dk, is covered too: the whole [tokens, 3·d] tensor's amax from one kernel, no reduction of its own.
template <class T>
void rope_backward(T* dx, const float* cos, const float* sin, int64_t batch, int64_t seq, int64_t heads,
                   int64_t head_dim, void* stream, int64_t token_stride = 0, float* amax = nullptr,
                   int64_t amax_heads = 0);

// s = silu(u) ⊙ g over n values; backward writes (does not accumulate) du and dg. The *_amax outputs (device
// floats; null: none, du_amax and dg_amax together) receive the amax of s, du, dg as stored, bit for bit what
// fp8_amax computes over them: FP8 training's casts then skip their own reduction (model/cuda/amax.cuh).
template <class T>
void swiglu_forward(const T* u, const T* g, T* s, int64_t n, void* stream, float* s_amax = nullptr);
template <class T>
void swiglu_backward(const T* ds, const T* u, const T* g, T* du, T* dg, int64_t n, void* stream,
                     float* du_amax = nullptr, float* dg_amax = nullptr);

// row_loss[r] = logsumexp(logits[r]) - logits[r, targets[r]] in fp32 for each of n rows of `vocab`
// logits; the caller averages. A target outside [0, vocab) gives row_loss = NaN.
template <class T>
void cross_entropy_forward(const T* logits, const int32_t* targets, float* row_loss, int64_t n, int64_t vocab,
                           void* stream);
// Overwrites logits with (softmax(logits) - onehot(target)) · scale (scale = 1/n for the mean loss, times
// the loss scale with fp16). Rows with a target outside [0, vocab) become NaN. row_loss, when given,
// receives what cross_entropy_forward would have (the same bits), from the same pass over the logits.
template <class T>
void cross_entropy_backward(T* logits, const int32_t* targets, int64_t n, int64_t vocab, float scale, void* stream,
                            float* row_loss = nullptr);

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
// The residual stream.

// y += x, computed in fp32 and rounded to T.
template <class T>
void add_inplace(T* y, const T* x, int64_t n, void* stream);

}  // namespace flashlm::gpu
