// fp16's dynamic loss scale (optim/loss_scaler.h).
#include "optim/loss_scaler.h"

#include <cmath>

#include "core/check.h"
#include "flashlm/model.h"

namespace flashlm {

LossScaler::LossScaler(bool dynamic)
    : dynamic_(dynamic), scale_(dynamic ? LanguageModel::kInitialLossScale : 1.0) {}

void LossScaler::restore(double scale, int64_t good_steps, DType precision) {
  if (!dynamic_) {
    FLASHLM_CHECK(scale == 1.0 && good_steps == 0,
                  "restore_loss_scale: a {} model has no loss scaling, got scale {} after {} good steps (expected 1, 0)",
                  dtype_name(precision), scale, good_steps);
    return;
  }
  FLASHLM_CHECK(std::isfinite(scale) && scale > 0, "restore_loss_scale: scale {}, expected a finite positive number",
                scale);
  FLASHLM_CHECK(good_steps >= 0 && good_steps < LanguageModel::kLossScaleGrowthInterval,
                "restore_loss_scale: good_steps {}, expected 0..{}", good_steps,
                LanguageModel::kLossScaleGrowthInterval - 1);
  scale_ = scale;
  good_steps_ = good_steps;
}

bool LossScaler::update(bool overflow) {
  if (overflow) {
    scale_ /= 2;
    good_steps_ = 0;
    return false;
  }
  if (++good_steps_ == LanguageModel::kLossScaleGrowthInterval) {
    scale_ *= 2;
    good_steps_ = 0;
  }
  return true;
}

}  // namespace flashlm
