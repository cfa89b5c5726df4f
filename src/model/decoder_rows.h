// The working rows of one KvCacheDecoder step, shared by its CPU step (decoder.cpp) and its CUDA step
// (cuda/decoder.cpp): one allocation on the decoder's device, cut into named rows.
#pragma once
#include <cstdint>
#include <utility>

#include "flashlm/model.h"

namespace flashlm {

// The working rows of one step: x, h, q, k, v, attention output [d_model]; u, g, s [d_ff]; lse [heads];
// logits [vocab].
struct StepRows {
  float *x, *h, *q, *k, *v, *o, *u, *g, *s, *lse, *logits;
};

inline int64_t step_row_floats(const ModelConfig& c) { return 6 * c.d_model + 3 * c.d_ff + c.heads + c.vocab; }

inline StepRows step_rows(float* base, const ModelConfig& c) {
  StepRows r{};
  float* p = base;
  for (float** row : {&r.x, &r.h, &r.q, &r.k, &r.v, &r.o}) *row = std::exchange(p, p + c.d_model);
  for (float** row : {&r.u, &r.g, &r.s}) *row = std::exchange(p, p + c.d_ff);
  r.lse = std::exchange(p, p + c.heads);
  r.logits = p;
  return r;
}

}  // namespace flashlm
