// The attention backends behind attention_forward / attention_backward. Each takes a validated
// AttentionProblem; none checks arguments again.
#pragma once
#include "attention/capabilities.h"
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

// flash_attention_with_kvcache on the CPU (attention/decode_cpu.cpp): the append, then fp64-accumulated
// attention over each sequence's keys (kp.seqlens, the block table's values checked).
void kvcache_attention_cpu(const KvCacheProblem& kp, const TensorView& q, const TensorView& k_cache,
                           const TensorView& v_cache, const int32_t* block_table, const TensorView& k_new,
                           const TensorView& v_new, const TensorView& o, const TensorView& lse);

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
// Zeroes dlearnable_sink (a device vector) on `stream`, before the backward adds the sink's gradient into it.
void clear_sink_gradient_cuda(const AttentionProblem& p, void* stream);
void flash_attention_forward_cuda_f32(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& o, const TensorView& lse, void* stream);
void flash_attention_backward_cuda_f32(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                       const TensorView& v, const TensorView& o, const TensorView& lse,
                                       const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                       const TensorView& dv, void* stream);

// The atomic backward's fp32 dQ accumulator bytes per key/value head (with its query heads, over the
// batch), and how many key/value heads one launch takes so that the accumulator stays bounded without
// launches that under-fill a GPU of `multiprocessors` SMs (cuda/flash_bwd.cu says the rule and why).
size_t backward_accumulator_bytes_per_kv_head(const AttentionProblem& p);
int64_t backward_kv_heads_per_launch(const AttentionProblem& p, int multiprocessors);
// The dynamic shared memory one block of the mma.sync backward asks for at a compiled head dim (the dQ
// pass's too when `deterministic`): the launcher refuses, with an Error, a GPU that grants less.
size_t mma_sync_backward_smem_bytes(int64_t head_dim, bool deterministic);

// flash on Hopper (attention/cuda/hopper/, built where CMAKE_CUDA_ARCHITECTURES has 90): TMA + wgmma,
// warp-specialised, fp16/bf16 at the capability table's Hopper head dims. flash_kernel_family chooses them
// where the predicates below hold; the entry points check them again, the backward per head group (an
// Error, not a fallback, where one fails).
void flash_attention_forward_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& o, const TensorView& lse, void* stream);
// The backward shares the mma.sync backward's host code (preprocess, dQ accumulator, conversion) and runs
// its own dK/dV kernel; it adds dQ with atomics, so it has no deterministic mode.
void flash_attention_backward_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& o, const TensorView& lse,
                                   const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                   const TensorView& dv, void* stream);
// Whether the Hopper kernels run these views: an sm_90 device, fp16/bf16, a head dim of theirs, both
// sequences non-empty, views TMA can describe (`o` too where given: the forward stores O with TMA).
bool flash_forward_sm90_covers(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView* o = nullptr);
bool flash_backward_sm90_covers(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                const TensorView& v, const TensorView& dout);
// The FP8 forward (attention/cuda/hopper/flash_fwd_fp8_sm90.cu, built with the Hopper kernels): fp8_e4m3
// q, k, v with p's descale factors, bf16 o, fp32 lse, head dims 64 and 128. An Error where the current
// device is not an sm_90 GPU or TMA cannot describe q or k (a stride of 2^40 bytes or more, a zero stride of
// a dimension longer than 1, a size past 2^31): fp8 has no fallback.
void flash_attention_forward_fp8_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& o, const TensorView& lse, void* stream);

// Which tensor-core kernels flash_kernel_family may take, from FLASHLM_ATTENTION_KERNEL: "auto" (or unset)
// takes the Hopper kernels where they cover the problem, "mma" forces the mma.sync kernels (to test and
// time the fallback on sm_90). Any other value is an error naming the variable.
enum class FlashKernelChoice { automatic, mma };
FlashKernelChoice flash_kernel_choice();

// The one dispatch of the flash kernels, for both passes (attention.cpp): the family that runs `plan` on
// these views: plan.family, or hopper for a 16-bit problem the Hopper kernels cover (with every variant it
// asks for, and for a head_dim_v of its own a pair their row lists for the pass) unless
// FLASHLM_ATTENTION_KERNEL=mma or (backward) `deterministic`. Asked first on the caller's views: where the plan
// pads and the answer is not hopper, attention.cpp asks again on the padded copies, an exact plan. `dout` is
// read by the backward only.
CudaKernelFamily flash_kernel_family(const CudaAttentionPlan& plan, AttentionPass pass, const AttentionProblem& p,
                                     const TensorView& q, const TensorView& k, const TensorView& v,
                                     const TensorView& o, const TensorView& dout, bool deterministic);

// Copies the first `cols` elements of every [b, s, h] row of `src` into `dst` (both [batch, seq, heads, *]
// views of one dtype on the current device, any 16-byte strides; cols · element size a multiple of 16
// bytes), queued on `stream` (attention/cuda/naive.cu).
void copy_head_rows_cuda(const TensorView& src, const TensorView& dst, int64_t cols, void* stream);
// Copies every element of `src` into `dst` (both [batch, seq, heads, head_dim] views on the current device, any
// strides, head_dim a multiple of 8), converting fp8_e4m3 to bf16 or bf16 to fp32: both exact (e4m3's 4 significant
// bits and its exponents fit bf16's), so a copy holds the very values. Queued on `stream` (attention/cuda/naive.cu).
void convert_head_rows_cuda(const TensorView& src, const TensorView& dst, void* stream);
// Copies every element of the fp8_e4m3 `src` into the bf16 `dst` (views as convert_head_rows_cuda's) times its
// descale, rounded once to bf16 (2^-9 relative): heads.at(b, h / group) for head h of batch b, or `descale` where
// heads.data is null (group: the heads per descale head, the GQA group for q, 1 for k and v). Queued on `stream`.
void dequantise_head_rows_cuda(const TensorView& src, const TensorView& dst, double descale,
                               const AttentionProblem::HeadDescales& heads, int64_t group, void* stream);

// flash_attention_with_kvcache on CUDA (attention/cuda/decode.cu): the append kernel, the split-KV kernel
// (flash-decoding) and the combine of the splits by logsumexp; fp16/bf16, head dims 64, 128 and 256. The
// index arrays are device memory, read by the kernels only (graph capturable).
void kvcache_attention_cuda(const KvCacheProblem& kp, const TensorView& q, const TensorView& k_cache,
                            const TensorView& v_cache, const KvCacheIndex& index, const TensorView& k_new,
                            const TensorView& v_new, const TensorView& o, const TensorView& lse, void* stream);

// naive: materialised S and P through cuBLAS plus softmax kernels (attention/cuda/naive.cu).
void naive_attention_forward_cuda(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& o, const TensorView& lse, void* stream);
void naive_attention_backward_cuda(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& o, const TensorView& lse,
                                   const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                   const TensorView& dv, void* stream);
#endif

// The number of key splits the CUDA kernel uses for a cache of `capacity` keys per sequence (the host does not
// know the lengths), given the blocks the other grid dimensions make and how many blocks the GPU holds at once
// (resident blocks per SM x SMs). Host code (attention/decode.cpp), built without CUDA too, so that CPU tests
// can check it.
int64_t kvcache_num_splits(int64_t capacity, int64_t other_blocks, int resident_blocks);

}  // namespace flashlm
