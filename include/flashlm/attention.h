// Scaled dot-product attention, forward and backward, on the CPU and (when built) on CUDA.
//
// Shapes (any element strides, last stride 1, so BSHD, BHSD and sliced views all work):
//   q, dq          [batch, seq_q, heads_q, head_dim]
//   k, dk          [batch, seq_k, heads_k, head_dim]     heads_q must be a multiple of heads_k (GQA/MQA)
//   v, dv          [batch, seq_k, heads_k, head_dim_v]   head_dim_v may differ from head_dim (DeepSeek's MLA:
//   o, dout        [batch, seq_q, heads_q, head_dim_v]   192 / 128); the default scale is 1/sqrt(head_dim)
//   lse            [batch, heads_q, seq_q]  fp32 (fp64 allowed for fp64 inputs), natural log
// All of q, k, v, o, do, dq, dk, dv share one dtype and one device, except in FP8 attention: q, k, v in
// fp8_e4m3 (with the per-tensor or per-head descale factors of AttentionOptions), o and dout in bf16 (e4m3's 3 mantissa
// bits are too few for an output), lse fp32, and dq, dk, dv in bf16 or fp32 (one dtype for the three). The
// gradients are those of the dequantised values, value = stored · descale: what a training framework holding
// the real tensors applies (d/d(stored) would be descale times them). The forward runs on an sm_90 GPU (built
// with the sm_90a kernels; flash only, head dims 64 and 128) and on the CPU (both impls, any head dim); the
// backward on CUDA (flash only, head dims 16, 32, 64, 128 and 256, any GPU the 16-bit kernels run on) and on the
// CPU. The CUDA backward runs the bf16 flash backward (Hopper or mma.sync, deterministic too) on exact bf16 copies
// of the stored q, k, v with per-tensor descales folded into its fp32 scale factors: its gradients are rounded as
// the bf16 backward's (fp32 gradients hold those bf16 values); per-head descales are below. The CPU dequantises
// into copies and runs the arithmetic of its other dtypes (naive in fp64, exact there; flash in fp32), the
// reference for the GPU's FP8 kernels rather than a fast path. No varlen and no KV cache for fp8.
//
// Masking: with causal, query i sees key j when j <= i (top-left, PyTorch's is_causal) or
// j <= i + seq_k - seq_q (bottom-right, FlashAttention >= 2.1). A query that sees no key gets
// o = 0, lse = -inf and zero gradients.
//
// Sliding window (flash-attn's window_size = (left, right)): query i sees key j iff
// i + offset - left <= j <= i + offset + right, offset 0 (top-left) or seq_k - seq_q (bottom-right, the
// alignment option applies to the window with or without causal); -1 leaves a side unbounded, and causal
// makes right 0 whatever it holds (as flash-attn does). Soft-capping (Gemma 2): each score s = scale · q·k
// becomes softcap · tanh(s / softcap) before the softmax; 0 is off.
//
// ALiBi (flash-attn's alibi_slopes, fp32 [heads_q] or [batch, heads_q]): the score of query i and key j
// gets -slope · |i + offset - j|, after soft-capping, with the mask's offset (0 top-left, seq_k - seq_q
// bottom-right, flash-attn's). Not learnable: the backward gives it no gradient.
// Attention sinks (gpt-oss; flash-attn's learnable_sink, fp32 [heads_q]): a logit per query head that joins
// every row's softmax denominator and carries no value: P_ij = exp(s_ij) / (Σ_j exp(s_ij) + exp(sink_h)),
// and lse includes it. A row that sees no key then gets o = 0 and lse = sink_h (the sink alone takes the
// denominator) and zero gradients; -inf is no sink. The backward writes dlearnable_sink (where given):
// d(loss)/d(sink_h) = -Σ over the batch and the rows that see a key of exp(sink_h - lse_i) · Delta_i,
// Delta_i = rowsum(dO_i ∘ O_i).
// The window, softcap, ALiBi, sinks and head_dim_v != head_dim run on the CPU (naive and flash). The window
// and softcap also run in the fp16/bf16 CUDA flash kernels (Hopper and mma.sync), ALiBi and sinks in the
// fp16/bf16 mma.sync kernels (the Hopper ones decline them, so those problems run on mma.sync); the fp32,
// naive and fp8 CUDA kernels refuse all four, each by name. head_dim_v != head_dim runs on CUDA in the flash
// kernels (fp16/bf16 and fp32), forward and backward, deterministic and varlen included, wherever the larger
// of the two fits a compiled head dim (up to 256): q and k are zero-padded from head_dim, v and o from
// head_dim_v, both to that kernel's head dim, and the padded columns are dropped (exact, with every variant
// the kernels have; correct, not optimised: the padded work and the copies cost (kernel / real head dim) of
// the kernel time). On an sm_90 GPU the Hopper forward runs head_dim 192 with head_dim_v 128 unpadded. The
// naive and fp8 CUDA kernels refuse it by name (the capability table, src/attention/capabilities.cpp).
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>

#include "flashlm/error.h"
#include "flashlm/tensor.h"

namespace flashlm {

enum class CausalAlign : uint8_t { top_left, bottom_right };
CausalAlign parse_causal_align(std::string_view name);  // "top-left" | "bottom-right"

enum class AttentionImpl : uint8_t {
  naive,  // materialised scores and probabilities (fp64 accumulation on the CPU): the reference
  flash,  // FlashAttention-2: tiles, online softmax, O(seq) extra memory
};
std::string_view attention_impl_name(AttentionImpl impl);
AttentionImpl parse_attention_impl(std::string_view name);

struct AttentionOptions {
  AttentionImpl impl = AttentionImpl::flash;
  bool causal = false;
  CausalAlign align = CausalAlign::top_left;
  std::optional<double> scale;   // default 1/sqrt(head_dim)
  // Backward without floating-point atomics, bit-reproducible. The CUDA flash backward otherwise adds dQ
  // from its dK/dV kernel with fp32 atomics (the faster: docs/perf.md); deterministic takes a separate dQ
  // pass over query tiles instead. The CPU is always deterministic.
  bool deterministic = false;
  void* stream = nullptr;        // cudaStream_t for CUDA tensors; ignored on the CPU
  // FP8 inputs only (else they must stay 1; finite and > 0): q, k and v hold values / descale, so attention
  // computes S = scale · q_descale · k_descale · Q·Kᵀ and O = v_descale · softmax(S)·V (FlashAttention-3's
  // convention); the backward's gradients are of those values (the top of this file).
  float q_descale = 1.0f, k_descale = 1.0f, v_descale = 1.0f;
  // FP8 inputs only: per-head descales in place of the per-tensor ones above (FlashAttention-3's and PyTorch's
  // FP8 SDPA granularity): fp32 [batch, heads_k] each, element (b, hk) the descale of batch b's key/value head
  // hk, and q's applying to every query head of that head's GQA group. Each one given replaces its scalar, which
  // must then stay 1; values finite and > 0 (checked where they can be read here: on the CPU; CUDA descales are
  // device memory, never read on the host, and a NaN among them comes out as NaN in its heads' outputs). Empty
  // views (the default) leave the scalars in charge. The CPU runs them (both impls, forward and backward), and so
  // does CUDA: the forward kernel reads each tile's descales; the backward runs on bf16 copies of the values
  // dequantised head by head (2^-9 relative) after a bf16 forward recomputing o and lse on them, the caller's o
  // and lse unread (docs/usage.md).
  TensorView q_descale_heads, k_descale_heads, v_descale_heads;
  int64_t window_size_left = -1, window_size_right = -1;  // -1: unbounded (see the top of this file)
  double softcap = 0.0;                                    // > 0: scores become softcap · tanh(s / softcap)
  // Empty views (ndim 0, the default) leave each off; see the top of this file.
  TensorView alibi_slopes;     // fp32 [heads_q] or [batch, heads_q] (varlen: [number of sequences, heads_q])
  TensorView learnable_sink;   // fp32 [heads_q]; values finite or -inf
  // Written by the backward (ignored by the forward): the sink's gradient, fp32 [heads_q], summed over the
  // batch (and every sequence of a varlen call). Optional: empty skips it. Needs learnable_sink.
  TensorView dlearnable_sink;
};

// o and lse are written; everything else is read.
void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                       const TensorView& lse, const AttentionOptions& options = {});

// Given the forward's o and lse and the incoming gradient dout, writes dq, dk, dv.
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                        const TensorView& lse, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, const AttentionOptions& options = {});

// Packed variable-length sequences (flash-attn's varlen convention): the batch's sequences laid end to
// end, sequence b owning queries [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and keys [cu_seqlens_k[b],
// cu_seqlens_k[b + 1]). Shapes (any element strides, last stride 1):
//   q, dq            [total_q, heads_q, head_dim]       o, dout   [total_q, heads_q, head_dim_v]
//   k, dk            [total_k, heads_k, head_dim]       v, dv     [total_k, heads_k, head_dim_v]
//   lse              [heads_q, total_q]  fp32 (fp64 allowed for fp64 inputs), flash-attn's varlen layout
// Each sequence is an attention problem of its own (no query sees another sequence's keys); the causal
// mask and its alignment apply per sequence (bottom-right: query i of sequence b sees keys j <= i +
// len_k(b) - len_q(b)). A sequence with no queries writes nothing; its keys get zero dk and dv.
//
// The offsets are checked before any kernel runs: batch + 1 int32 entries each, starting at 0,
// non-decreasing, the last equal to total_q (total_k), and no sequence longer than max_seqlen_q
// (max_seqlen_k). Offsets in device memory (device = cuda) are copied to the host once per call, after the
// work queued on options.stream: that call waits for the stream (no CUDA-graph capture of it).
struct VarlenSequences {
  const int32_t* cu_seqlens_q = nullptr;  // batch + 1 entries
  const int32_t* cu_seqlens_k = nullptr;  // batch + 1 entries
  int64_t batch = 0;
  Device device = Device::cpu;  // where both offset arrays live
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;  // bounds on the sequence lengths
};

void attention_varlen_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                              const TensorView& lse, const VarlenSequences& seqs, const AttentionOptions& options = {});

void attention_varlen_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                               const TensorView& lse, const TensorView& dout, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const VarlenSequences& seqs,
                               const AttentionOptions& options = {});

// Decoding attention over a KV cache (flash-attn's flash_attn_with_kvcache): nq new queries per sequence
// attend to that sequence's keys in a cache, after the optional new keys/values are written into it in place.
// Shapes (any element strides, last stride 1):
//   q, o               [batch, nq, heads_q, head_dim]
//   k_cache, v_cache   paged (index.block_table set): [num_pages, page_size, heads_k, head_dim], sequence b's
//                      key j in page block_table[b][j / page_size], row j % page_size; page_size a multiple
//                      of 16 in [16, 256]
//                      non-paged (block_table null): [batch, max_seq, heads_k, head_dim], key j of b at row j
//   k_new, v_new       [batch, seq_new, heads_k, head_dim] or absent (TensorView{}): written into the cache at
//                      positions cache_seqlens[b] .. cache_seqlens[b] + seq_new - 1 before attending
//   lse                [batch, heads_q, nq] fp32 (fp64 allowed for fp64 inputs), or absent (TensorView{})
// cache_seqlens[b] is the number of keys of sequence b in the cache before the append (flash-attn's meaning);
// the call attends to L_b = cache_seqlens[b] + seq_new keys, which must fit in the sequence's pages
// (max_pages · page_size) or rows (max_seq). Only the block-table entries of the pages that hold those keys
// are read. The queries are the sequence's last nq positions: causal masks and windows are always aligned
// bottom-right (query i sits at position L_b - nq + i and, causal, sees keys j <= L_b - nq + i; options.align
// is not consulted), as in flash-attn. A query that sees no key (L_b = 0, say) gets o = 0, lse = -inf.
// The options' scale, causal, window_size_* and softcap apply as in attention_forward; impl is ignored on the
// CPU (one fp64-accumulating code) and must be flash on CUDA; descales must stay 1 (no fp8).
// cache_seqlens and block_table live on q's device. On the CPU every value is checked first (lengths >= 0 and
// within the capacity, page indices in [0, num_pages)). On CUDA nothing is copied to the host (the call is
// CUDA-graph capturable): the caller guarantees the values, as flash-attn's caller does; the kernels check
// them cheaply and never touch memory outside the cache, a sequence with a bad length or page index getting
// NaN in o and lse (and no append) instead. CUDA: fp16/bf16, head_dim 64, 128 or 256.
struct KvCacheIndex {
  const int32_t* cache_seqlens = nullptr;  // batch entries
  const int32_t* block_table = nullptr;    // [batch, max_pages] page indices; nullptr: the non-paged cache
  int64_t max_pages = 0;                   // block_table's columns
  int64_t block_table_stride = 0;          // elements between block_table's rows; 0: max_pages
};

void flash_attention_with_kvcache(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                  const KvCacheIndex& index, const TensorView& k_new, const TensorView& v_new,
                                  const TensorView& o, const TensorView& lse, const AttentionOptions& options = {});

// FLOPs as the FlashAttention papers count them: forward 4·B·H·Nq·Nk·D, halved when causal with
// Nq = Nk; backward is 2.5× the forward.
double attention_forward_flops(int64_t batch, int64_t heads, int64_t seq_q, int64_t seq_k, int64_t head_dim,
                               bool causal);

}  // namespace flashlm
