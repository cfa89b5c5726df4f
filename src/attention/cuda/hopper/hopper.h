// What the Hopper (sm_90a) kernels of this folder offer the rest of the CUDA attention besides the forward
// entry points of backends.h: the device check, and the backward's main kernel as the mma.sync backward's
// host code (cuda/flash_bwd.cu) launches it; that code keeps what both backward paths share: the
// preprocess (Delta, lse·log2e), the fp32 dQ accumulator and its head-group bound, and the conversion of dQ
// to the output dtype. Built where CMAKE_CUDA_ARCHITECTURES has 90 (FLASHLM_WITH_SM90).
#pragma once
#include <cuda_runtime.h>

#include "attention/problem.h"
#include "flashlm/tensor.h"

namespace flashlm::flash_cuda {

struct FlashParams;

// The multiprocessor count of the current device if it runs the Hopper kernels (compute capability 9.0
// and a loadable sm_90a image), else 0. Asked once per device (flash_fwd_sm90.cu).
int sm90_multiprocessors();

// The 16-bit forward's tile shape at head dim 64, query rows × keys per key block (flash_fwd_sm90.cu): from
// the problem's lengths and mask, or the one FLASHLM_SM90_FWD_D64_TILE names ("auto" or unset: chosen;
// "128x128", "192x128", "128x192": forced, which is how the tests run each; anything else is an error
// naming the variable).
enum class Sm90D64Tile { rows128_keys128, rows192_keys128, rows128_keys192 };
Sm90D64Tile sm90_forward_d64_tile(const AttentionProblem& p);

// Whether the Hopper kernel runs these views: an sm_90 device, fp16/bf16, head dim 64 or 128, both
// sequences non-empty, views TMA can describe. The deterministic option is not covered (it takes the
// mma.sync separate dQ pass): the kernel adds dQ with atomics.
bool backward_sm90_covers(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& dout);

// dK and dV into f.dk / f.dv and dS·K added into the fp32 accumulator f.dq_accum (DqAccumLayout order,
// unscaled), from f.delta and f.lse_log2 as the preprocess wrote them: what flash_bwd_dkdv_kernel<T, D,
// true> does (flash_bwd_sm90.cu). Returns false, launching nothing, where backward_sm90_covers is false.
bool launch_backward_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& dout, const FlashParams& f, cudaStream_t stream);

}  // namespace flashlm::flash_cuda
