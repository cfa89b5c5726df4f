// The state beside the optimizer arithmetic (optim/adamw_state.h, optim/loss_scaler.h): fp16's dynamic loss
// scale (back-off, growth, restore bounds) and the AdamW moments' storage on the CPU (zero before the first
// step, checkpoint copies in fp32 and bf16, release).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "flashlm/error.h"
#include "flashlm/model.h"
#include "optim/adamw_state.h"
#include "optim/loss_scaler.h"

using namespace flashlm;

TEST(LossScaler, OverflowHalvesTheScaleAndGoodStepsDoubleItAtTheInterval) {
  LossScaler s(true);
  EXPECT_EQ(s.scale(), LanguageModel::kInitialLossScale);
  EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.good_steps(), 1);
  EXPECT_FALSE(s.update(true));
  EXPECT_EQ(s.scale(), LanguageModel::kInitialLossScale / 2);
  EXPECT_EQ(s.good_steps(), 0);
  for (int64_t i = 0; i + 1 < LanguageModel::kLossScaleGrowthInterval; ++i) EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), LanguageModel::kInitialLossScale / 2);
  EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), LanguageModel::kInitialLossScale);
  EXPECT_EQ(s.good_steps(), 0);
}

TEST(LossScaler, RestoreTakesACheckpointsStateAndRefusesBadOnes) {
  LossScaler s(true);
  s.restore(1024.0, 7, DType::f16);
  EXPECT_EQ(s.scale(), 1024.0);
  EXPECT_EQ(s.good_steps(), 7);
  EXPECT_THROW(s.restore(0.0, 0, DType::f16), Error);
  EXPECT_THROW(s.restore(std::numeric_limits<double>::infinity(), 0, DType::f16), Error);
  EXPECT_THROW(s.restore(1024.0, -1, DType::f16), Error);
  EXPECT_THROW(s.restore(1024.0, LanguageModel::kLossScaleGrowthInterval, DType::f16), Error);
  EXPECT_EQ(s.scale(), 1024.0);  // a refused state changes nothing
  LossScaler fixed(false);
  EXPECT_EQ(fixed.scale(), 1.0);
  fixed.restore(1.0, 0, DType::bf16);
  EXPECT_THROW(fixed.restore(2.0, 0, DType::bf16), Error);
  EXPECT_THROW(fixed.restore(1.0, 3, DType::bf16), Error);
}

TEST(AdamWStateCpu, MomentsAreZeroUntilAllocatedAndRoundTripThroughCheckpoints) {
  for (const OptimizerState state : {OptimizerState::fp32, OptimizerState::bf16, OptimizerState::bf16_sr}) {
    AdamWState s(state, false, 5, Device::cpu);
    EXPECT_EQ(s.element_size(), state == OptimizerState::fp32 ? sizeof(float) : sizeof(bf16_t));
    std::vector<float> m(5, 9.0f), v(5, 9.0f);
    s.save(m, v);
    EXPECT_FALSE(s.allocated());
    EXPECT_EQ(m, std::vector<float>(5, 0.0f));
    EXPECT_EQ(v, std::vector<float>(5, 0.0f));
    const std::vector<float> m_in{0.5f, -1.25f, 3.0f, 0.0f, 2.0f}, v_in{1.0f, 0.25f, 4.0f, 8.0f, 0.125f};  // bf16 values
    s.load(m_in, v_in);
    s.set_steps(3);
    EXPECT_EQ(s.begin_step(), 4);
    s.save(m, v);
    EXPECT_EQ(m, m_in);
    EXPECT_EQ(v, v_in);
    s.release();
    EXPECT_FALSE(s.allocated());
    EXPECT_EQ(s.steps(), 0);
  }
  EXPECT_TRUE(AdamWState(OptimizerState::fp32, true, 1, Device::cpu).bf16());  // bf16-pure's moments
}
