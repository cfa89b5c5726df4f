// The LM head and the cross-entropy fused, on the CPU and on CUDA side by side: the loss of n tokens, and
// optionally its gradients, computed `chunk` tokens at a time, so that the [n, vocab] logits never exist —
// only one chunk's [chunk, vocab] in a workspace the caller owns. Per chunk of rows r0..r0+rows:
//   logits = h[r0 : r0+rows] · wᵀ                                  (workspace; one GEMM)
//   row loss = logsumexp(logits) - logits[target]                   (the cross-entropy kernels)
//   with gradients: logits ← (softmax(logits) - onehot(target)) · grad_scale, in place;
//   dh[r0 : r0+rows] = logits · w (written), dw += logitsᵀ · h[r0 : r0+rows]   (two GEMMs)
// so dw and dh are complete after the last chunk of the same pass. grad_scale is what the mean loss's
// gradient wants (1 / the tokens the mean is over, times the loss scale with fp16).
//
// The per-row arithmetic is the unfused path's (cpu::cross_entropy_*, gpu::cross_entropy_*), and the GEMMs
// are the same products on fewer rows, so loss and gradients match the unfused head within the rounding of
// the GEMMs (whose algorithm may change with the row count) and of the loss's sum (here in row order). A backward that recomputes the logits (the forward kept none) costs one extra head
// GEMM over the unfused path; that is the price of never holding [n, vocab].
#pragma once
#include <cstdint>

namespace flashlm {

// Checks the arguments of both functions below (flashlm::Error naming `fn` and the bad argument): n >= 0;
// d, vocab and chunk in [1, 2^31) with n · d representable; h, w, targets and workspace
// non-null when n > 0; dh and dw both given or both null.
void check_lm_head_arguments(const char* fn, const void* h, const void* w, const int32_t* targets, int64_t n,
                             int64_t d, int64_t vocab, int64_t chunk, const void* dh, const float* dw,
                             const void* workspace);

namespace cpu {

// fp32. h [n, d], w [vocab, d], targets [n] (each in [0, vocab), else flashlm::Error), workspace
// [min(chunk, n), vocab]. Returns the mean loss over the n rows (row losses in fp64, added in row order).
// dh [n, d] and dw [vocab, d]: both null for the loss alone (the forward), or both given.
double lm_head_loss_forward_backward(const float* h, const float* w, const int32_t* targets, int64_t n, int64_t d,
                                     int64_t vocab, int64_t chunk, float grad_scale, float* dh, float* dw,
                                     float* workspace);

}  // namespace cpu

namespace gpu {

// T ∈ {float, bf16_t, fp16_t} for h [n, d], w [vocab, d], dh and the workspace [min(chunk, n), vocab]; dw
// fp32 (the master gradient, accumulated by the GEMM in fp32). Device pointers, asynchronous on `stream`.
// row_loss [n] (fp32) receives each row's loss (NaN where the target lies outside [0, vocab)); it may be
// null when the gradients are asked for. The GEMMs go through model/cuda/gemm.h (its size and alignment
// rules apply: 16-bit T needs d and vocab multiples of 8 and 16-byte aligned pointers). Only in builds with
// CUDA.
template <class T>
void lm_head_loss_forward_backward(const T* h, const T* w, const int32_t* targets, int64_t n, int64_t d,
                                   int64_t vocab, int64_t chunk, float grad_scale, float* row_loss, T* dh, float* dw,
                                   T* workspace, void* stream);

}  // namespace gpu

}  // namespace flashlm
