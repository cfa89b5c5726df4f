// AttentionProblem's members that the per-ISA CPU kernel objects call (problem.h says why they are here).
#include "attention/problem.h"

#include <limits>

namespace flashlm {

double AttentionProblem::alibi_slope(int64_t b, int64_t h) const {
  return alibi ? double(alibi_slopes[b * alibi_batch_stride + h * alibi_head_stride]) : 0.0;
}

double AttentionProblem::sink_logit(int64_t h) const {
  return sink ? double(learnable_sink[h * sink_stride]) : -std::numeric_limits<double>::infinity();
}

}  // namespace flashlm
