// Shared by the CUDA model tests: resuming from a checkpoint is bit-exact. 12 steps straight and 6 steps,
// checkpointed and resumed to 12, must end with the same parameters, bit for bit.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <string>

#include "flashlm/train.h"

namespace flashlm::testing {

// `base` names the model, device, precision and options; the run's length, schedule and files are set here.
// `tag` names the checkpoints (in the test's temporary directory) and the failure.
inline void expect_resume_is_bit_exact(TrainConfig base, const std::string& tag) {
  const auto dir = std::filesystem::path(::testing::TempDir());
  base.batch = 2;
  base.seq = 64;
  base.optimizer.warmup_steps = 2;
  base.optimizer.cosine_steps = 12;
  base.eval_every = 0;
  base.log_every = 0;
  // The full run writes its checkpoint at step 6 too, as the run resumed from there did: with FP8's weight
  // copies from the optimizer, writing a checkpoint makes the next pass cast the weights, as a resumed run's does
  // (CudaModel::save_state); for every other precision a write changes nothing.
  auto run = [&](int64_t steps, const std::string& name, bool resume) {
    TrainConfig c = base;
    c.steps = steps;
    c.checkpoint = (dir / (name + ".ckpt")).string();
    c.checkpoint_every = 6;
    c.resume = resume;
    train(c);
  };
  run(12, tag + "-full", false);
  run(6, tag + "-half", false);
  run(12, tag + "-half", true);
  EXPECT_EQ(checkpoint_parameters((dir / (tag + "-full.ckpt")).string()),
            checkpoint_parameters((dir / (tag + "-half.ckpt")).string()))
      << tag << ": parameters differ after resume";
}

}  // namespace flashlm::testing
