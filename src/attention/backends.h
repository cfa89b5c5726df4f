// The attention backends behind attention_forward / attention_backward. Each takes a validated
// AttentionProblem; none checks arguments again.
#pragma once
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

}  // namespace flashlm
