// fp16's dynamic loss scale (CudaModel in fp16): the loss gradient is multiplied by scale() so that small
// gradients survive fp16; after the backward an overflow (an inf or nan among the gradients) halves the
// scale and the step is skipped, and LanguageModel::kLossScaleGrowthInterval good steps in a row double it.
// A static scaler (every other precision) keeps a scale of 1 and no count.
#pragma once
#include <cstdint>

#include "flashlm/dtype.h"

namespace flashlm {

class LossScaler {
 public:
  explicit LossScaler(bool dynamic);
  bool dynamic() const { return dynamic_; }
  double scale() const { return scale_; }
  int64_t good_steps() const { return good_steps_; }  // in a row since the scale last changed
  // A checkpoint's state: a finite positive scale and a count in [0, the growth interval); a static scaler
  // accepts only (1, 0). `precision` names the model's in that error.
  void restore(double scale, int64_t good_steps, DType precision);
  // After a backward: overflow halves the scale and returns false (skip the step); otherwise counts a good
  // step, doubling the scale at the growth interval, and returns true.
  bool update(bool overflow);

 private:
  bool dynamic_;
  double scale_;
  int64_t good_steps_ = 0;
};

}  // namespace flashlm
