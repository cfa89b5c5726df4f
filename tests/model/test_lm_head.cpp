// The fused LM head + cross-entropy on the CPU (model/lm_head.h) against the unfused path it replaces
// (cpu::linear_forward, cross_entropy_forward/backward, linear_backward over all rows at once): fresh
// random inputs, ragged sizes, chunks that do and do not divide the tokens, outputs poisoned with NaN, and
// a dw that already holds a gradient (the head's gradient accumulates). The CUDA twin is tested in
// test_ops_cuda.cpp.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "flashlm/error.h"
#include "model/lm_head.h"
#include "model/ops_cpu.h"
#include "model/random_tokens.h"

using namespace flashlm;

namespace {

std::vector<float> random_normal(int64_t n, uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    do x = normal(rng);
    while (x == 0.0f);
  }
  return v;
}

// max |got - want| <= rtol · max |want| (NaN fails).
::testing::AssertionResult close(const std::vector<float>& got, const std::vector<float>& want, double rtol) {
  double scale = 0, worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < want.size(); ++i) scale = std::max(scale, std::fabs(double(want[i])));
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(double(got[i]) - double(want[i]));
    if (!(err <= worst)) {
      worst = std::isnan(err) ? INFINITY : err;
      at = i;
    }
  }
  if (worst <= rtol * scale) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "worst [" << at << "]: got " << got[at] << ", want " << want[at]
                                       << " (max |want| " << scale << ")";
}

struct Unfused {
  double loss;
  std::vector<float> dh, dw;
};

// The head as the models compute it without fusion: all n rows of logits at once.
Unfused unfused_head(const std::vector<float>& h, const std::vector<float>& w, const std::vector<int32_t>& targets,
                     int64_t n, int64_t d, int64_t vocab, const std::vector<float>& dw0) {
  std::vector<float> logits(size_t(n * vocab));
  cpu::linear_forward(h.data(), w.data(), logits.data(), n, d, vocab);
  Unfused u{cpu::cross_entropy_forward(logits.data(), targets.data(), n, vocab), std::vector<float>(size_t(n * d)),
            dw0};
  cpu::cross_entropy_backward(logits.data(), targets.data(), n, vocab);
  cpu::linear_backward(logits.data(), h.data(), w.data(), u.dh.data(), u.dw.data(), n, d, vocab, false);
  return u;
}

TEST(LmHeadCpu, FusedMatchesUnfusedLossAndGradients) {
  struct Case {
    int64_t n, d, vocab, chunk;
  };
  const Case cases[] = {{1, 8, 10, 1},        {17, 36, 1000, 7},  {17, 36, 1000, 17}, {17, 36, 1000, 64},
                        {127, 16, 5003, 32},  {300, 8, 257, 128}, {64, 24, 97, 1}};
  for (const Case& c : cases) {
    SCOPED_TRACE("n " + std::to_string(c.n) + ", d " + std::to_string(c.d) + ", vocab " + std::to_string(c.vocab) +
                 ", chunk " + std::to_string(c.chunk));
    const uint64_t seed = uint64_t(c.n * 1000003 + c.d * 1009 + c.vocab + c.chunk);
    const std::vector<float> h = random_normal(c.n * c.d, seed, 1.0f), w = random_normal(c.vocab * c.d, seed + 1, 0.5f);
    const std::vector<int32_t> targets = random_tokens(c.n, c.vocab, seed + 2);
    const std::vector<float> dw0 = random_normal(c.vocab * c.d, seed + 3, 1e-2f);  // a gradient already there
    const Unfused want = unfused_head(h, w, targets, c.n, c.d, c.vocab, dw0);

    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> dh(size_t(c.n * c.d), nan), dw = dw0;
    std::vector<float> workspace(size_t(std::min(c.chunk, c.n) * c.vocab), nan);
    const double loss = cpu::lm_head_loss_forward_backward(h.data(), w.data(), targets.data(), c.n, c.d, c.vocab,
                                                           c.chunk, 1.0f / float(c.n), dh.data(), dw.data(),
                                                           workspace.data());
    EXPECT_NEAR(loss, want.loss, 1e-6 * want.loss);
    EXPECT_TRUE(close(dh, want.dh, 1e-5)) << "dh";
    EXPECT_TRUE(close(dw, want.dw, 1e-5)) << "dw";

    // The loss alone (the forward): the same loss, nothing else written.
    std::fill(workspace.begin(), workspace.end(), nan);
    const double forward = cpu::lm_head_loss_forward_backward(h.data(), w.data(), targets.data(), c.n, c.d, c.vocab,
                                                              c.chunk, 1.0f, nullptr, nullptr, workspace.data());
    EXPECT_EQ(forward, loss) << "the loss must not depend on whether gradients are computed";
  }
}

// The loss is a sum over rows: its bits must not depend on the thread count or on the run (an OpenMP
// reduction combined the threads' partial sums in the order they finished).
TEST(LmHeadCpu, LossHasTheSameBitsAtEveryThreadCountAndRun) {
  const int64_t n = 203, d = 16, vocab = 301;
  const std::vector<float> h = random_normal(n * d, 81, 1.0f), w = random_normal(vocab * d, 82, 0.5f);
  const std::vector<int32_t> targets = random_tokens(n, vocab, 83);
  std::vector<float> logits(size_t(n * vocab));
  cpu::linear_forward(h.data(), w.data(), logits.data(), n, d, vocab);
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(1);
  const double want = cpu::cross_entropy_forward(logits.data(), targets.data(), n, vocab);
  for (int threads = 2; threads <= 7; ++threads) {
    omp_set_num_threads(threads);
    for (int run = 0; run < 8; ++run) {
      EXPECT_EQ(cpu::cross_entropy_forward(logits.data(), targets.data(), n, vocab), want)
          << threads << " threads, run " << run;
    }
  }
  omp_set_num_threads(threads_before);
}

TEST(LmHeadCpu, GradScaleScalesTheGradientsOnly) {
  const int64_t n = 20, d = 8, vocab = 50, chunk = 6;
  const std::vector<float> h = random_normal(n * d, 71, 1.0f), w = random_normal(vocab * d, 72, 0.5f);
  const std::vector<int32_t> targets = random_tokens(n, vocab, 73);
  std::vector<float> workspace(size_t(chunk * vocab));
  std::vector<float> dh1(size_t(n * d)), dw1(size_t(vocab * d), 0.0f), dh4(dh1), dw4(dw1);
  const double loss1 = cpu::lm_head_loss_forward_backward(h.data(), w.data(), targets.data(), n, d, vocab, chunk,
                                                          0.25f, dh1.data(), dw1.data(), workspace.data());
  const double loss4 = cpu::lm_head_loss_forward_backward(h.data(), w.data(), targets.data(), n, d, vocab, chunk, 1.0f,
                                                          dh4.data(), dw4.data(), workspace.data());
  EXPECT_EQ(loss1, loss4);
  for (float& x : dh1) x *= 4;  // a power of two: exact
  for (float& x : dw1) x *= 4;
  EXPECT_TRUE(close(dh4, dh1, 1e-6));
  EXPECT_TRUE(close(dw4, dw1, 1e-6));
}

TEST(LmHeadCpu, EmptyInputDoesNothing) {
  std::vector<float> dh(1, 2.0f), dw(8, 1.0f);
  EXPECT_EQ(cpu::lm_head_loss_forward_backward(nullptr, nullptr, nullptr, 0, 4, 2, 16, 1.0f, dh.data(), dw.data(),
                                               nullptr),
            0.0);
  EXPECT_EQ(dh, std::vector<float>(1, 2.0f));
  EXPECT_EQ(dw, std::vector<float>(8, 1.0f));
}

void expect_error(const std::function<void()>& call, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(LmHeadCpu, BadArgumentsAreErrors) {
  const int64_t n = 4, d = 8, vocab = 10;
  std::vector<float> h(n * d, 1.0f), w(vocab * d, 1.0f), dh(n * d), dw(vocab * d), ws(n * vocab);
  std::vector<int32_t> targets = {0, 1, 2, 3};
  const auto call = [&](int64_t nn, int64_t dd, int64_t vv, int64_t chunk, float* dhp, float* dwp, float* wsp) {
    return [=, &h, &w, &targets] {
      cpu::lm_head_loss_forward_backward(h.data(), w.data(), targets.data(), nn, dd, vv, chunk, 1.0f, dhp, dwp, wsp);
    };
  };
  expect_error(call(-1, d, vocab, 4, dh.data(), dw.data(), ws.data()), {"lm_head_loss_forward_backward", "n = -1"});
  expect_error(call(n, 0, vocab, 4, dh.data(), dw.data(), ws.data()), {"d = 0"});
  expect_error(call(n, d, 0, 4, dh.data(), dw.data(), ws.data()), {"vocab = 0"});
  expect_error(call(n, d, vocab, 0, dh.data(), dw.data(), ws.data()), {"chunk = 0"});
  expect_error(call(int64_t{1} << 62, d, vocab, 4, dh.data(), dw.data(), ws.data()), {"n x d"});
  expect_error(call(n, d, vocab, 4, dh.data(), nullptr, ws.data()), {"dh and dw"});
  expect_error(call(n, d, vocab, 4, nullptr, dw.data(), ws.data()), {"dh and dw"});
  expect_error(call(n, d, vocab, 4, dh.data(), dw.data(), nullptr), {"workspace"});
  targets[2] = 10;
  expect_error(call(n, d, vocab, 4, dh.data(), dw.data(), ws.data()), {"targets[2] = 10", "[0, 10)"});
  targets[2] = -1;
  expect_error(call(n, d, vocab, 4, nullptr, nullptr, ws.data()), {"targets[2] = -1"});
}

}  // namespace
