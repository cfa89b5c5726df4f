// The training run: the loss falls on synthetic data, and a resumed run continues bit-exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include "flashlm/train.h"

using namespace flashlm;

namespace {

TrainConfig tiny_run(int64_t steps) {
  TrainConfig c;
  c.model = ModelConfig::named("tiny", 32, 64);
  c.batch = 8;
  c.seq = 32;
  c.steps = steps;
  c.optimizer.lr_max = 3e-3;
  c.optimizer.lr_min = 3e-4;
  c.optimizer.warmup_steps = 5;
  c.optimizer.cosine_steps = 20;  // the schedule of the full 20-step run, also for its first half
  c.eval_every = 0;
  c.eval_batches = 2;
  c.log_every = 0;
  return c;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / name).string();
}

}  // namespace

TEST(Train, LossFallsOnSyntheticDataTowardsItsOptimum) {
  TrainConfig c = tiny_run(150);
  c.optimizer.cosine_steps = 150;
  const TrainResult r = train(c);
  ASSERT_EQ(r.train_loss.size(), 150u);
  ASSERT_FALSE(r.val_loss.empty());
  EXPECT_GT(r.best_possible_loss, 0.0);
  EXPECT_NEAR(r.train_loss.front().second, std::log(64.0), 0.3);
  // From ln 64 = 4.16 towards ln 4 = 1.39: well below half-way in 150 steps.
  EXPECT_LT(r.val_loss.back().second, 0.5 * (r.train_loss.front().second + r.best_possible_loss));
}

TEST(Train, TwentyStepsEqualTenStepsThenResumeThenTen) {
  const std::string full = temp_path("full.ckpt"), half = temp_path("half.ckpt");
  TrainConfig a = tiny_run(20);
  a.checkpoint = full;
  train(a);

  TrainConfig b = tiny_run(10);
  b.checkpoint = half;
  const TrainResult first = train(b);
  TrainConfig b2 = tiny_run(20);
  b2.checkpoint = half;
  b2.resume = true;
  const TrainResult second = train(b2);
  EXPECT_EQ(first.last_step, 10);
  EXPECT_EQ(second.first_step, 10);
  EXPECT_EQ(second.last_step, 20);

  const std::vector<float> pa = checkpoint_parameters(full), pb = checkpoint_parameters(half);
  ASSERT_EQ(pa.size(), pb.size());
  size_t differ = 0;
  for (size_t i = 0; i < pa.size(); ++i) differ += pa[i] != pb[i];
  EXPECT_EQ(differ, 0u) << "parameters differ after resume";
}

TEST(Train, BadConfigurationsAreErrors) {
  TrainConfig c = tiny_run(5);
  c.resume = true;  // without a checkpoint path
  EXPECT_THROW(train(c), Error);
  c = tiny_run(5);
  c.train_data = temp_path("missing.bin");
  EXPECT_THROW(train(c), Error);
  c = tiny_run(5);
  c.checkpoint = temp_path("not-a-checkpoint.ckpt");
  std::FILE* f = std::fopen(c.checkpoint.c_str(), "wb");
  std::fputs("hello", f);
  std::fclose(f);
  c.resume = true;
  try {
    train(c);
    FAIL() << "expected flashlm::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not a flashlm checkpoint"), std::string::npos) << e.what();
  }
  TrainConfig other = tiny_run(5);
  other.checkpoint = temp_path("other.ckpt");
  train(other);
  TrainConfig wider = tiny_run(5);
  wider.model.d_model = 64;
  wider.checkpoint = other.checkpoint;
  wider.resume = true;
  EXPECT_THROW(train(wider), Error);  // a checkpoint of another model
}
