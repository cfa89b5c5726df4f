// The attention backends behind attention_forward / attention_backward. Each takes a validated
// AttentionProblem; none checks arguments again.
#pragma once
#include <cstddef>

#include "attention/problem.h"

namespace flashlm {

void reference_attention_forward_cpu(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                     const TensorView& v, const TensorView& o, const TensorView& lse);
void reference_attention_backward_cpu(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& dout, const TensorView& dq,
                                      const TensorView& dk, const TensorView& dv);

void flash_attention_forward_cpu(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const TensorView& o, const TensorView& lse);
void flash_attention_backward_cpu(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& o, const TensorView& lse,
                                  const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                  const TensorView& dv);

#ifdef FLASHLM_WITH_CUDA
// CUDA backends: tensors are on the current device, validated for alignment and head dim by
// attention.cpp; `stream` is a cudaStream_t. They launch asynchronously and check each launch.

// flash: fp16/bf16 on tensor cores (attention/cuda/flash_*.cu); fp32 on CUDA cores (flash_f32.cu).
void flash_attention_forward_cuda(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& o, const TensorView& lse, void* stream);
void flash_attention_backward_cuda(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& o, const TensorView& lse,
                                   const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                   const TensorView& dv, bool deterministic, void* stream);
// The atomic-dQ backward's fp32 dQ accumulator (4·B·Hq·Nq·D bytes for every head) is used whole up to
// `whole_up_to` bytes; above, the same single launch runs with a ring of as many (batch, kv head) units
// as fit in `ring_bytes` (at least one; flash_bwd.cu, DqMode::bounded). The defaults keep the backward's
// extra memory at seq 32k within the 10% of SPEC's bar (docs/perf.md); tests change them to run the
// bounded path at small shapes.
struct DqAccumulatorLimits {
  size_t whole_up_to, ring_bytes;
};
inline constexpr DqAccumulatorLimits kDefaultDqAccumulatorLimits{size_t{128} << 20, size_t{64} << 20};
DqAccumulatorLimits flash_dq_accumulator_limits();
void set_flash_dq_accumulator_limits(const DqAccumulatorLimits& limits);

void flash_attention_forward_cuda_f32(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& o, const TensorView& lse, void* stream);
void flash_attention_backward_cuda_f32(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                       const TensorView& v, const TensorView& o, const TensorView& lse,
                                       const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                       const TensorView& dv, void* stream);

// flash on Hopper (attention/cuda/hopper/flash_fwd_sm90.cu, built where CMAKE_CUDA_ARCHITECTURES has 90):
// TMA + wgmma, warp-specialised. Launches and returns true when it covers the problem (an sm_90 device,
// fp16/bf16, head dim 64, 128 or 256, views TMA can describe); returns false, launching nothing, otherwise.
bool flash_attention_forward_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& o, const TensorView& lse, void* stream);
// Whether flash_attention_forward_sm90 would run these arguments (for the tests of the dispatch).
bool flash_forward_sm90_covers(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                               const TensorView& v);

// Which tensor-core forward attention_forward may take, from FLASHLM_ATTENTION_KERNEL: "auto" (or unset)
// takes the Hopper kernel where it covers the problem, "mma" forces the mma.sync kernels (to test and time
// the fallback on sm_90). Any other value is an error naming the variable.
enum class FlashKernelChoice { automatic, mma };
FlashKernelChoice flash_kernel_choice();

// Copies the first `cols` elements of every [b, s, h] row of `src` into `dst` (both [batch, seq, heads, *]
// views of one dtype on the current device, any 16-byte strides; cols · element size a multiple of 16
// bytes), queued on `stream` (attention/cuda/naive.cu).
void copy_head_rows_cuda(const TensorView& src, const TensorView& dst, int64_t cols, void* stream);

// naive: materialised S and P through cuBLAS plus softmax kernels (attention/cuda/naive.cu).
void naive_attention_forward_cuda(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& o, const TensorView& lse, void* stream);
void naive_attention_backward_cuda(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& o, const TensorView& lse,
                                   const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                   const TensorView& dv, void* stream);
#endif

}  // namespace flashlm
