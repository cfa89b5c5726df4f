// The training run: the loss falls on synthetic data, and a resumed run continues bit-exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

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

// `--data synthetic` for a vocabulary beyond uint16 (the 8B model's 151936; here 70000 to stay small): the
// walk is stored as uint32 and trains (SyntheticTokens refused anything above 65536 before).
TEST(Train, SyntheticDataWithAVocabularyBeyondUint16) {
  TrainConfig c = tiny_run(3);
  c.model = ModelConfig::named("tiny", 32, 70000);
  c.batch = 2;
  const TrainResult r = train(c);
  ASSERT_EQ(r.train_loss.size(), 3u);
  EXPECT_NEAR(r.train_loss.front().second, std::log(70000.0), 0.3);
  EXPECT_DOUBLE_EQ(r.best_possible_loss, std::log(4.0));
}

// bf16 moments beside fp32 masters (nearest and stochastic): 10 steps + resume + 10 steps give the bits of
// 20 steps (the checkpoint holds the moments widened exactly; the rounding needs only the seed and the step).
TEST(Train, Bf16MomentsResumeBitExactly) {
  std::vector<double> last_loss;  // of the 20-step runs: bf16, bf16-sr, then fp32
  for (const OptimizerState state : {OptimizerState::bf16, OptimizerState::bf16_sr}) {
    const std::string tag = std::string(optimizer_state_name(state));
    SCOPED_TRACE(tag);
    const std::string full = temp_path(tag + "-full.ckpt"), half = temp_path(tag + "-half.ckpt");
    TrainConfig a = tiny_run(20);
    a.options.optimizer_state = state;
    a.checkpoint = full;
    const TrainResult all = train(a);
    TrainConfig b = tiny_run(10);
    b.options.optimizer_state = state;
    b.checkpoint = half;
    train(b);
    b.steps = 20;
    b.resume = true;
    const TrainResult second = train(b);
    ASSERT_EQ(second.train_loss.size(), 10u);
    for (size_t i = 0; i < 10; ++i) EXPECT_EQ(second.train_loss[i].second, all.train_loss[10 + i].second) << i;
    EXPECT_EQ(checkpoint_parameters(full), checkpoint_parameters(half)) << "parameters differ after resume";
    last_loss.push_back(all.train_loss.back().second);
  }
  // The moments' storage changes the run: bf16 moments are not fp32 moments under another name, and the
  // two roundings differ.
  last_loss.push_back(train(tiny_run(20)).train_loss.back().second);
  EXPECT_NE(last_loss[0], last_loss[2]);
  EXPECT_NE(last_loss[1], last_loss[2]);
  EXPECT_NE(last_loss[0], last_loss[1]);
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
