/* flashlm C ABI: attention forward and backward on raw pointers, for bindings (Python ctypes, Rust, …).
 *
 * Every function returns a flashlm_status; on failure flashlm_last_error() returns the message of the
 * last failed call on the calling thread (valid until that thread's next call). Nothing is written when
 * a call fails its argument checks.
 *
 * A tensor is a pointer plus sizes and element strides, a dtype and a device. Attention shapes:
 *   q, dq               [batch, seq_q, heads_q, head_dim]
 *   k, dk               [batch, seq_k, heads_k, head_dim]   heads_q a multiple of heads_k (GQA/MQA)
 *   v, dv               [batch, seq_k, heads_k, head_dim_v] head_dim_v may differ from head_dim (see below)
 *   o, dout             [batch, seq_q, heads_q, head_dim_v]
 *   lse                 [batch, heads_q, seq_q], fp32 (fp64 allowed for fp64 inputs on the CPU)
 * Any strides with a unit stride on head_dim (BSHD, BHSD, sliced views). CUDA tensors must be memory
 * of the calling thread's current device; `stream` is a cudaStream_t (NULL: the legacy default stream).
 * Causal masks: query i sees key j when j <= i (top-left, PyTorch's is_causal) or
 * j <= i + seq_k - seq_q (bottom-right). A query that sees no key gets o = 0, lse = -inf and zero
 * gradients.
 * Sliding window (flash-attn's window_size): query i sees key j iff i + offset - left <= j <= i + offset + right,
 * offset 0 (top-left) or seq_k - seq_q (bottom-right, causal_align, with or without causal); -1 leaves a side
 * unbounded, causal makes right 0. softcap > 0: scores s become softcap * tanh(s / softcap); 0 is off.
 * alibi_slopes (fp32 [heads_q] or [batch, heads_q]): scores get -slope * |i + offset - j| after the softcap.
 * learnable_sink (fp32 [heads_q], finite or -inf): a per-head logit in every row's softmax denominator with no
 * value (lse includes it; a row that sees no key gets o = 0, lse = sink); the backward writes its gradient,
 * summed over the batch, to dlearnable_sink where that is given. The window, softcap, ALiBi, sinks and
 * head_dim_v != head_dim run on the CPU; on CUDA the fp16/bf16 flash kernels run the window and softcap
 * (Hopper and mma.sync) and ALiBi and sinks (mma.sync), the fp16/bf16 and fp32 flash kernels head_dim_v !=
 * head_dim in both passes (on zero-padded copies up to head dim 256; the Hopper forward on an sm_90 GPU runs
 * head_dim 192 with head_dim_v 128 unpadded), and every other case is refused (FLASHLM_INVALID_ARGUMENT naming
 * the option). flashlm/attention.h has the full definitions.
 *
 * Packed variable-length sequences (flash-attn's varlen convention; flashlm_attention_varlen_*):
 *   q, dq               [total_q, heads_q, head_dim]      o, dout   [total_q, heads_q, head_dim_v]
 *   k, dk               [total_k, heads_k, head_dim]      v, dv     [total_k, heads_k, head_dim_v]
 *   lse                 [heads_q, total_q], fp32
 * sequence b owning rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b],
 * cu_seqlens_k[b + 1]) of k; the causal mask applies per sequence (bottom-right: j <= i + len_k - len_q).
 * The offsets (batch + 1 int32 each, from 0, non-decreasing, the last = total, no length above max_seqlen)
 * are checked on the host first; offsets in CUDA memory are copied once per call after the work queued on
 * `stream`, which the call waits for.
 */
#ifndef FLASHLM_FLASHLM_H
#define FLASHLM_FLASHLM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 2: adds flashlm_attention_varlen_forward/backward and flashlm_varlen (version 1's calls are unchanged).
 * 3: adds FLASHLM_FP8_E4M3 and the descales of flashlm_attention_options.
 * 4: appends window_size_left, window_size_right and softcap to flashlm_attention_options (a caller built
 *    against an older header passes a shorter struct: check flashlm_abi_version() first).
 * 5: appends alibi_slopes, learnable_sink and dlearnable_sink (tensor pointers, NULL: none) to
 *    flashlm_attention_options; v may have a head dim of its own. Version 4's calls are unchanged;
 *    adds flashlm_attention_with_kvcache and flashlm_kvcache_index (decoding over a paged KV cache).
 * 6: appends q_descale_heads, k_descale_heads and v_descale_heads (tensor pointers, NULL: the scalar descale) to
 *    flashlm_attention_options. Version 5's calls are unchanged. */
#define FLASHLM_ABI_VERSION 6
#define FLASHLM_MAX_DIMS 6

typedef enum flashlm_status {
  FLASHLM_OK = 0,
  FLASHLM_INVALID_ARGUMENT = 1, /* a shape, dtype, device, stride or option the call cannot take */
  FLASHLM_OUT_OF_MEMORY = 2,    /* host or device memory for the call's workspace */
  FLASHLM_RUNTIME_ERROR = 3     /* a CUDA failure or another error not caused by the arguments */
} flashlm_status;

/* FLASHLM_FP8_E4M3: OCP e4m3 (PyTorch's float8_e4m3fn), q/k/v of attention with o and dout in bf16, lse fp32 and
 * dq/dk/dv bf16 or fp32 (the gradients of the dequantised values, stored * descale). The forward runs on the CPU
 * and on an sm_90 GPU, the backward on the CPU and on CUDA (the bf16 flash kernels on exact bf16 copies, the
 * descales folded into their scale factors: flashlm/attention.h); no varlen, no KV cache. */
typedef enum flashlm_dtype {
  FLASHLM_FP64 = 0,
  FLASHLM_FP32 = 1,
  FLASHLM_FP16 = 2,
  FLASHLM_BF16 = 3,
  FLASHLM_FP8_E4M3 = 4
} flashlm_dtype;

typedef enum flashlm_device { FLASHLM_CPU = 0, FLASHLM_CUDA = 1 } flashlm_device;

typedef enum flashlm_causal_align { FLASHLM_TOP_LEFT = 0, FLASHLM_BOTTOM_RIGHT = 1 } flashlm_causal_align;

typedef enum flashlm_attention_impl { FLASHLM_FLASH = 0, FLASHLM_NAIVE = 1 } flashlm_attention_impl;

typedef struct flashlm_tensor {
  void* data;
  int32_t ndim;
  int32_t dtype;  /* flashlm_dtype */
  int32_t device; /* flashlm_device */
  int64_t sizes[FLASHLM_MAX_DIMS];
  int64_t strides[FLASHLM_MAX_DIMS]; /* in elements */
} flashlm_tensor;

typedef struct flashlm_attention_options {
  int32_t impl;          /* flashlm_attention_impl */
  int32_t causal;        /* 0 or 1 */
  int32_t causal_align;  /* flashlm_causal_align */
  int32_t deterministic; /* CUDA backward without atomics */
  int32_t has_scale;     /* 0: scale = 1/sqrt(head_dim) */
  double scale;
  /* fp8_e4m3 inputs only (1 otherwise): S = scale * q_descale * k_descale * Q K^T, O = v_descale * P V. */
  float q_descale, k_descale, v_descale;
  void* stream; /* cudaStream_t */
  int64_t window_size_left, window_size_right; /* -1: unbounded (ABI 4) */
  double softcap;                              /* 0: off (ABI 4) */
  const struct flashlm_tensor* alibi_slopes;   /* NULL: none; fp32 [heads_q] or [batch, heads_q] (ABI 5) */
  const struct flashlm_tensor* learnable_sink; /* NULL: none; fp32 [heads_q] (ABI 5) */
  const struct flashlm_tensor* dlearnable_sink; /* backward output, NULL: not computed; fp32 [heads_q] (ABI 5) */
  /* fp8_e4m3 inputs only: per-head descales in place of the scalar of the same name (which must then be 1), fp32
   * [batch, heads_k], q's applying to every query head of the key head's group, on q's device (ABI 6). */
  const struct flashlm_tensor* q_descale_heads;
  const struct flashlm_tensor* k_descale_heads;
  const struct flashlm_tensor* v_descale_heads;
} flashlm_attention_options;

/* Defaults: flash, not causal, top-left, atomic dQ, scale 1/sqrt(head_dim), descales 1, default stream, no
 * window (-1, -1), no softcap, no ALiBi, no sinks, no per-head descales. */
flashlm_attention_options flashlm_attention_options_default(void);

flashlm_status flashlm_attention_forward(const flashlm_tensor* q, const flashlm_tensor* k, const flashlm_tensor* v,
                                         const flashlm_tensor* o, const flashlm_tensor* lse,
                                         const flashlm_attention_options* options);

flashlm_status flashlm_attention_backward(const flashlm_tensor* q, const flashlm_tensor* k, const flashlm_tensor* v,
                                          const flashlm_tensor* o, const flashlm_tensor* lse,
                                          const flashlm_tensor* dout, const flashlm_tensor* dq,
                                          const flashlm_tensor* dk, const flashlm_tensor* dv,
                                          const flashlm_attention_options* options);

typedef struct flashlm_varlen {
  const int32_t* cu_seqlens_q; /* batch + 1 offsets into q's rows */
  const int32_t* cu_seqlens_k; /* batch + 1 offsets into k's rows */
  int64_t batch;               /* number of sequences */
  int32_t device;              /* flashlm_device of both offset arrays (CPU offsets serve CUDA tensors too) */
  int64_t max_seqlen_q;        /* bounds on the sequence lengths */
  int64_t max_seqlen_k;
} flashlm_varlen;

flashlm_status flashlm_attention_varlen_forward(const flashlm_tensor* q, const flashlm_tensor* k,
                                                const flashlm_tensor* v, const flashlm_tensor* o,
                                                const flashlm_tensor* lse, const flashlm_varlen* seqs,
                                                const flashlm_attention_options* options);

flashlm_status flashlm_attention_varlen_backward(const flashlm_tensor* q, const flashlm_tensor* k,
                                                 const flashlm_tensor* v, const flashlm_tensor* o,
                                                 const flashlm_tensor* lse, const flashlm_tensor* dout,
                                                 const flashlm_tensor* dq, const flashlm_tensor* dk,
                                                 const flashlm_tensor* dv, const flashlm_varlen* seqs,
                                                 const flashlm_attention_options* options);

/* Decoding attention over a KV cache (flash-attn's flash_attn_with_kvcache; flashlm/attention.h says it all):
 *   q, o                [batch, nq, heads_q, head_dim]
 *   k_cache, v_cache    paged: [num_pages, page_size, heads_k, head_dim] (page_size a multiple of 16 in
 *                       [16, 256]); non-paged (block_table NULL): [batch, max_seq, heads_k, head_dim]
 *   k_new, v_new        [batch, seq_new, heads_k, head_dim], or both NULL: appended IN PLACE into the cache at
 *                       cache_seqlens[b] (the lengths before the append) before attending
 *   lse                 [batch, heads_q, nq] fp32, or NULL
 * Causal masks and windows are aligned bottom-right (the queries are each sequence's last nq positions).
 * cache_seqlens and block_table are int32 arrays on q's device. On the CPU their values are checked; on CUDA
 * nothing is copied to the host (graph capturable): the caller guarantees them, and a sequence with a bad
 * length or page index gets NaN in o and lse instead of an error. CUDA: fp16/bf16, head_dim 64, 128, 256. */
typedef struct flashlm_kvcache_index {
  const int32_t* cache_seqlens; /* batch lengths */
  const int32_t* block_table;   /* [batch, max_pages] page indices; NULL: the non-paged cache */
  int64_t max_pages;            /* block_table's columns (0 without a block table) */
  int64_t block_table_stride;   /* elements between rows; 0: max_pages */
} flashlm_kvcache_index;

flashlm_status flashlm_attention_with_kvcache(const flashlm_tensor* q, const flashlm_tensor* k_cache,
                                              const flashlm_tensor* v_cache, const flashlm_kvcache_index* index,
                                              const flashlm_tensor* k_new, const flashlm_tensor* v_new,
                                              const flashlm_tensor* o, const flashlm_tensor* lse,
                                              const flashlm_attention_options* options);

/* Message of the calling thread's last failed call ("" if none). */
const char* flashlm_last_error(void);

/* "0.1.0" */
const char* flashlm_version(void);
/* FLASHLM_ABI_VERSION of the library (check it against the header's). */
int32_t flashlm_abi_version(void);
/* 1 when the library was built with CUDA kernels. */
int32_t flashlm_cuda_built(void);
/* CUDA devices visible (0 without CUDA). */
int32_t flashlm_cuda_device_count(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASHLM_FLASHLM_H */
