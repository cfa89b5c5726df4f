// AttentionProblem: the validated description of one attention call, shared by every backend.
// validate_attention_* is the single place where attention arguments are checked.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <vector>

#include "flashlm/attention.h"

namespace flashlm {

struct AttentionProblem {
  int64_t batch = 0, seq_q = 0, seq_k = 0, heads_q = 0, heads_k = 0, head_dim = 0;
  double scale = 1.0;
  bool causal = false;
  // The mask's alignment: 0 top-left, seq_k - seq_q bottom-right (for the causal mask and the window alike).
  int64_t causal_offset = 0;
  // Sliding window (flash-attn's window_size): key j is visible to query i iff
  // i + causal_offset - window_left <= j <= i + causal_offset + window_right, -1 leaving that side unbounded;
  // causal means window_right = 0 (right_bound() says so whatever window_right holds). softcap > 0: scores s become softcap · tanh(s / softcap); 0 is off.
  int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  // v's (and o's, dout's, dv's) head dim; 0 in a problem built by hand means head_dim (value_dim()).
  int64_t head_dim_v = 0;
  // ALiBi (AttentionOptions::alibi_slopes): score(i, j) += -slope(b, h) · |i + causal_offset - j| after
  // soft-capping; the slope of (b, h) is alibi_slopes[b · alibi_batch_stride + h · alibi_head_stride] (batch
  // stride 0 for [heads_q] slopes; a varlen run's pointer starts at its first sequence).
  bool alibi = false;
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0, alibi_head_stride = 0;
  // Attention sinks (AttentionOptions::learnable_sink): sink(h) joins every row's denominator. The backward
  // adds its gradient into dlearnable_sink (where not null), which attention.cpp zeroes first: a varlen call
  // runs one backward per run of sequences and the gradient sums over all of them.
  bool sink = false;
  const float* learnable_sink = nullptr;
  int64_t sink_stride = 0;
  float* dlearnable_sink = nullptr;
  int64_t dsink_stride = 0;
  DType dtype = DType::f32;  // of q, k, v (o is bf16 where this is fp8_e4m3)
  // fp8_e4m3 only (AttentionOptions); 1 for every other dtype but the bf16 problem the CUDA FP8 backward hands its
  // 16-bit kernels (attention.cpp, fp8_backward_cuda), whose make_params folds them into the kernels' factors.
  double q_descale = 1.0, k_descale = 1.0, v_descale = 1.0;
  // fp8_e4m3 only: per-head descales (AttentionOptions::*_descale_heads), which replace the scalar of their
  // tensor where given; element (b, hk) at data[b · batch_stride + hk · head_stride]. Null: the scalar.
  struct HeadDescales {
    const float* data = nullptr;
    int64_t batch_stride = 0, head_stride = 0;
    double at(int64_t b, int64_t hk) const { return double(data[b * batch_stride + hk * head_stride]); }
  };
  HeadDescales q_descale_heads, k_descale_heads, v_descale_heads;
  Device device = Device::cpu;

  bool per_head_descales() const {
    return q_descale_heads.data != nullptr || k_descale_heads.data != nullptr || v_descale_heads.data != nullptr;
  }

  int64_t group() const { return heads_q / heads_k; }  // query heads per key/value head
  int64_t value_dim() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
  // The ALiBi slope of (b, h), 0 without ALiBi. Out of line (problem.cpp), as sink_logit: the per-ISA CPU kernel
  // objects (flash_cpu.cpp, compiled for AVX-512 too) call both once per head, and an inline copy they emitted
  // as a weak symbol, in AVX code, could be the one the linker keeps for the baseline callers
  // (tests/attention/check_cpu_kernel_objects.py found sink_logit's in the sanitizer build).
  double alibi_slope(int64_t b, int64_t h) const;
  // The bias of (query i, key j) for a slope (0 without ALiBi).
  double alibi_bias(double slope, int64_t i, int64_t j) const {
    return -slope * double(std::llabs(i + causal_offset - j));
  }
  // The sink logit of query head h, -inf (no sink) without one.
  double sink_logit(int64_t h) const;
  // Whether query i sees any key.
  bool sees_keys(int64_t i) const { return first_visible_key(i) < visible_keys(i); }
  // Whether a window narrows the mask beyond the causal one (the CUDA 16-bit kernels' masked instantiations).
  bool windowed() const { return window_left >= 0 || (!causal && window_right >= 0); }
  int64_t right_bound() const { return causal ? 0 : window_right; }  // -1: unbounded
  // The keys query i may see are [first_visible_key(i), visible_keys(i)) (empty where the first is not below
  // the second).
  int64_t first_visible_key(int64_t i) const {
    if (window_left < 0) return 0;
    return clamp_keys(i + causal_offset - window_left);
  }
  int64_t visible_keys(int64_t i) const {
    if (right_bound() < 0) return seq_k;
    return clamp_keys(i + causal_offset + right_bound() + 1);
  }
  // The queries that may see key j are [first_query_seeing(j), last_query_seeing(j)) (capped at seq_q).
  int64_t first_query_seeing(int64_t j) const {
    if (right_bound() < 0) return 0;
    const int64_t i = j - causal_offset - right_bound();
    return i < 0 ? 0 : (i > seq_q ? seq_q : i);
  }
  int64_t last_query_seeing(int64_t j) const {
    if (window_left < 0) return seq_q;
    const int64_t i = j - causal_offset + window_left + 1;
    return i < 0 ? 0 : (i > seq_q ? seq_q : i);
  }

 private:
  int64_t clamp_keys(int64_t n) const { return n < 0 ? 0 : (n > seq_k ? seq_k : n); }
};

AttentionProblem validate_attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                            const TensorView& o, const TensorView& lse,
                                            const AttentionOptions& options);

AttentionProblem validate_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                             const TensorView& o, const TensorView& lse, const TensorView& dout,
                                             const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                             const AttentionOptions& options);

// A validated packed variable-length call (attention_varlen_*): the packed tensors seen as one batch of
// one ([1, total, heads, head_dim], lse [1, heads_q, total_q]), which the common checks validated, and the
// host copies of the offsets, which validate_varlen_offsets checked. Each sequence is then an ordinary
// problem on slices of those views.
struct VarlenProblem {
  AttentionProblem packed;  // batch 1, seq_q = total_q, seq_k = total_k; its causal_offset is unused
  CausalAlign align = CausalAlign::top_left;
  std::vector<int32_t> cu_q, cu_k;  // batch + 1 entries each
  TensorView q, k, v, o, lse, dout, dq, dk, dv;  // the batch-of-one views (dout.. only for the backward)

  int64_t batch() const { return static_cast<int64_t>(cu_q.size()) - 1; }
  int64_t len_q(int64_t b) const { return cu_q[static_cast<size_t>(b + 1)] - cu_q[static_cast<size_t>(b)]; }
  int64_t len_k(int64_t b) const { return cu_k[static_cast<size_t>(b + 1)] - cu_k[static_cast<size_t>(b)]; }
  // Consecutive sequences of equal lengths lie in the pack as a strided batch (batch stride = length · row
  // stride), so a run of them is one batched problem: the end of the run that starts at sequence b ...
  int64_t run_end(int64_t b) const;
  // ... the problem of the n sequences from b (their lengths and their own causal alignment) ...
  AttentionProblem run(int64_t b, int64_t n) const;
  // ... and their rows of a batch-of-one query-side view (q, o, dout, dq), key-side view (k, v, dk, dv) or
  // of lse, as [n, length, heads, head_dim] (lse [n, heads_q, length]).
  TensorView query_rows(const TensorView& t, int64_t b, int64_t n) const { return rows(t, 1, cu_q, b, n); }
  TensorView key_rows(const TensorView& t, int64_t b, int64_t n) const { return rows(t, 1, cu_k, b, n); }
  TensorView lse_rows(int64_t b, int64_t n) const { return rows(lse, 2, cu_q, b, n); }

 private:
  static TensorView rows(const TensorView& t, int seq_dim, const std::vector<int32_t>& cu, int64_t b, int64_t n);
};

// Checks the packed tensors and the offsets (copied to the host from device memory, after the work queued on
// options.stream) and describes the call. The CUDA-only checks (alignment, device memory) stay with
// attention.cpp, as for the batched calls.
VarlenProblem validate_attention_varlen_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                                const TensorView& o, const TensorView& lse,
                                                const VarlenSequences& seqs, const AttentionOptions& options);

VarlenProblem validate_attention_varlen_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                                 const TensorView& o, const TensorView& lse, const TensorView& dout,
                                                 const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                                 const VarlenSequences& seqs, const AttentionOptions& options);

// A validated flash_attention_with_kvcache call. `attn` holds the shared description (batch, seq_q = nq,
// heads, head_dim, scale, causal, window, softcap, dtype, device); its seq_k is the cache's capacity per
// sequence and its causal_offset is unused: for_sequence() gives sequence b's own problem.
struct KvCacheProblem {
  AttentionProblem attn;
  bool paged = false;
  int64_t page_size = 0;   // paged: rows per page; non-paged: max_seq
  int64_t num_pages = 0;   // paged: k_cache.size(0); non-paged: batch
  int64_t max_pages = 0;   // paged: block_table columns; non-paged: 1
  int64_t block_table_stride = 0;
  int64_t seq_new = 0;     // rows of k_new / v_new (0 without them)
  bool has_lse = false;
  std::vector<int32_t> seqlens;  // host copy of cache_seqlens (CPU calls only; empty on CUDA)

  int64_t capacity() const { return attn.seq_k; }  // keys one sequence can hold
  // Sequence b's problem with L keys (cache length + seq_new): seq_k = L, bottom-right alignment.
  AttentionProblem for_sequence(int64_t keys) const {
    AttentionProblem p = attn;
    p.batch = 1;
    p.seq_k = keys;
    p.causal_offset = keys - attn.seq_q;
    return p;
  }
};

// Checks every argument of flash_attention_with_kvcache (on the CPU, the values of cache_seqlens and of the
// block-table entries the call uses, too) and describes the call.
KvCacheProblem validate_attention_with_kvcache(const TensorView& q, const TensorView& k_cache,
                                               const TensorView& v_cache, const KvCacheIndex& index,
                                               const TensorView& k_new, const TensorView& v_new,
                                               const TensorView& o, const TensorView& lse,
                                               const AttentionOptions& options);

// Pointer to the head_dim-long row of a [batch, seq, heads, head_dim] view.
template <class T>
inline T* attention_row(const TensorView& t, int64_t b, int64_t s, int64_t h) {
  return t.ptr<T>() + b * t.stride(0) + s * t.stride(1) + h * t.stride(2);
}

// Element (b, h, s) of a [batch, heads, seq] logsumexp view.
template <class T>
inline T& lse_at(const TensorView& lse, int64_t b, int64_t h, int64_t s) {
  return lse.ptr<T>()[b * lse.stride(0) + h * lse.stride(1) + s * lse.stride(2)];
}

}  // namespace flashlm
