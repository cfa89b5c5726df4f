// AttentionProblem: the validated description of one attention call, shared by every backend.
// validate_attention_* is the single place where attention arguments are checked.
#pragma once
#include <cstdint>

#include "flashlm/attention.h"

namespace flashlm {

struct AttentionProblem {
  int64_t batch = 0, seq_q = 0, seq_k = 0, heads_q = 0, heads_k = 0, head_dim = 0;
  double scale = 1.0;
  bool causal = false;
  // Key j is visible to query i iff !causal or j <= i + causal_offset (0 top-left, seq_k - seq_q bottom-right).
  int64_t causal_offset = 0;
  DType dtype = DType::f32;
  Device device = Device::cpu;

  int64_t group() const { return heads_q / heads_k; }  // query heads per key/value head
  // Number of keys query i may see: the visible keys are [0, visible_keys(i)).
  int64_t visible_keys(int64_t i) const {
    if (!causal) return seq_k;
    const int64_t n = i + causal_offset + 1;
    return n < 0 ? 0 : (n > seq_k ? seq_k : n);
  }
  // First query that sees key j (queries before it are masked for j).
  int64_t first_query_seeing(int64_t j) const {
    if (!causal) return 0;
    const int64_t i = j - causal_offset;
    return i < 0 ? 0 : i;
  }
};

AttentionProblem validate_attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                            const TensorView& o, const TensorView& lse,
                                            const AttentionOptions& options);

AttentionProblem validate_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                             const TensorView& o, const TensorView& lse, const TensorView& dout,
                                             const TensorView& dq, const TensorView& dk, const TensorView& dv,
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
