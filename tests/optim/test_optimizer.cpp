// The optimizer arithmetic on the CPU (optim/optimizer.h): pure-bf16 AdamW against the fp32 step it is
// defined by (the same operations on the widened values, rounded to bf16 once), its training behaviour
// beside fp32 masters, splits into ranges, the bf16 squared norm, and bad arguments. The CUDA twins are
// tested against these in tests/model/test_ops_cuda.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashlm/dtype.h"
#include "flashlm/error.h"
#include "optim/optimizer.h"

using namespace flashlm;

namespace {

std::vector<bf16_t> random_bf16(int64_t n, uint64_t seed, float stddev, bool square = false) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<bf16_t> v(static_cast<size_t>(n));
  for (bf16_t& x : v) {
    float f;
    do {
      f = normal(rng);
      if (square) f *= f;
    } while (bf16_t(f).bits == 0);
    x = bf16_t(f);
  }
  return v;
}

std::vector<float> widen(const std::vector<bf16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float(v[i]);
  return out;
}

std::vector<bf16_t> narrow(const std::vector<float>& v) {
  std::vector<bf16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_t(v[i]);
  return out;
}

::testing::AssertionResult same_bits(const std::vector<bf16_t>& a, const std::vector<bf16_t>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].bits != b[i].bits) {
      return ::testing::AssertionFailure() << "first difference at [" << i << "]: " << float(a[i]) << " vs "
                                           << float(b[i]);
    }
  }
  return ::testing::AssertionSuccess();
}

constexpr double kLr = 3e-3, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kDecay = 0.1;

TEST(AdamWBf16Cpu, IsTheFp32StepOnWidenedValuesRoundedOnce) {
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    std::vector<bf16_t> w = random_bf16(n, 10 + n, 0.05f), m = random_bf16(n, 20 + n, 1e-3f),
                        v = random_bf16(n, 30 + n, 1e-3f, /*square=*/true);
    for (int64_t step = 1; step <= 3; ++step) {
      const std::vector<bf16_t> g = random_bf16(n, 40 + n + step, 1e-2f);
      const float grad_scale = step == 2 ? 0.37f : 1.0f;  // a clipping factor on one step
      // The reference: the fp32 step on the widened values (the gradient scaled once, as a separate pass
      // would), rounded to bf16.
      std::vector<float> wf = widen(w), gf = widen(g), mf = widen(m), vf = widen(v);
      for (float& x : gf) x *= grad_scale;
      cpu::adamw_step(wf.data(), gf.data(), mf.data(), vf.data(), n, kLr, kBeta1, kBeta2, kEps, kDecay, step);
      cpu::adamw_step_bf16(w.data(), g.data(), m.data(), v.data(), n, kLr, kBeta1, kBeta2, kEps, kDecay, step,
                           grad_scale);
      EXPECT_TRUE(same_bits(w, narrow(wf))) << "w, step " << step;
      EXPECT_TRUE(same_bits(m, narrow(mf))) << "m, step " << step;
      EXPECT_TRUE(same_bits(v, narrow(vf))) << "v, step " << step;
    }
  }
}

TEST(AdamWBf16Cpu, AnySplitIntoRangesGivesTheSameBits) {
  const int64_t n = 1001, split = 389;
  const std::vector<bf16_t> g = random_bf16(n, 51, 1e-2f);
  std::vector<bf16_t> w = random_bf16(n, 52, 0.05f), m = random_bf16(n, 53, 1e-3f), v = random_bf16(n, 54, 1e-3f, true);
  std::vector<bf16_t> w2 = w, m2 = m, v2 = v;
  cpu::adamw_step_bf16(w.data(), g.data(), m.data(), v.data(), n, kLr, kBeta1, kBeta2, kEps, kDecay, 5);
  cpu::adamw_step_bf16(w2.data(), g.data(), m2.data(), v2.data(), split, kLr, kBeta1, kBeta2, kEps, kDecay, 5);
  cpu::adamw_step_bf16(w2.data() + split, g.data() + split, m2.data() + split, v2.data() + split, n - split, kLr,
                       kBeta1, kBeta2, kEps, kDecay, 5);
  EXPECT_TRUE(same_bits(w, w2));
  EXPECT_TRUE(same_bits(m, m2));
  EXPECT_TRUE(same_bits(v, v2));
}

// Minimising Σ c_i (w_i - t_i)² / 2 from the same start: bf16-pure AdamW converges as fp32 AdamW does, to
// within bf16's resolution of the parameters.
TEST(AdamWBf16Cpu, TrainsAQuadraticLikeFp32Masters) {
  const int64_t n = 64, steps = 250;
  const double lr = 2e-2;
  std::mt19937_64 rng(61);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> curvature(0.5f, 2.0f);
  std::vector<float> t(n), c(n), w(n), m(n, 0.0f), v(n, 0.0f), g(n);
  for (int64_t i = 0; i < n; ++i) {
    t[i] = normal(rng);
    c[i] = curvature(rng);
    w[i] = normal(rng);
  }
  std::vector<bf16_t> wb = narrow(w), mb(n, bf16_t(0.0f)), vb(n, bf16_t(0.0f)), gb(n);
  w = widen(wb);  // the same start
  const auto distance = [&](const std::vector<float>& x) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += std::fabs(double(x[i]) - t[i]);
    return s / double(n);
  };
  const double start = distance(w);
  for (int64_t step = 1; step <= steps; ++step) {
    for (int64_t i = 0; i < n; ++i) {
      g[i] = c[i] * (w[i] - t[i]);
      gb[i] = bf16_t(c[i] * (float(wb[i]) - t[i]));
    }
    cpu::adamw_step(w.data(), g.data(), m.data(), v.data(), n, lr, 0.9, 0.95, 1e-8, 0.0, step);
    cpu::adamw_step_bf16(wb.data(), gb.data(), mb.data(), vb.data(), n, lr, 0.9, 0.95, 1e-8, 0.0, step);
  }
  const double fp32 = distance(w), bf16 = distance(widen(wb));
  EXPECT_LT(fp32, start / 100);
  EXPECT_LT(bf16, start / 100);
  double apart = 0;
  for (int64_t i = 0; i < n; ++i) apart = std::max(apart, std::fabs(double(float(wb[i])) - w[i]));
  EXPECT_LT(apart, 0.03) << "bf16-pure and fp32 AdamW ended " << apart << " apart";
}

TEST(SumSquaresCpu, Bf16IsTheFp32SumOfTheWidenedValues) {
  const std::vector<bf16_t> x = random_bf16(4099, 71, 3.0f);
  const std::vector<float> xf = widen(x);
  const double got = cpu::sum_squares(x.data(), int64_t(x.size()));
  const double want = cpu::sum_squares(xf.data(), int64_t(xf.size()));
  EXPECT_EQ(std::memcmp(&got, &want, sizeof got), 0) << got << " vs " << want;
  const std::vector<bf16_t> ones(10, bf16_t(1.5f));
  EXPECT_EQ(cpu::sum_squares(ones.data(), 10), 22.5);
}

TEST(AdamWCpu, BadArgumentsAreErrors) {
  std::vector<float> f(4, 1.0f);
  std::vector<bf16_t> b(4, bf16_t(1.0f));
  EXPECT_THROW(cpu::adamw_step(f.data(), f.data(), f.data(), f.data(), 4, kLr, kBeta1, kBeta2, kEps, kDecay, 0), Error);
  EXPECT_THROW(cpu::adamw_step_bf16(b.data(), b.data(), b.data(), b.data(), -1, kLr, kBeta1, kBeta2, kEps, kDecay, 1),
               Error);
  try {
    cpu::adamw_step_bf16(b.data(), b.data(), b.data(), b.data(), 4, kLr, kBeta1, kBeta2, kEps, kDecay, 0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cpu::adamw_step_bf16: step = 0, expected >= 1"), std::string::npos)
        << e.what();
  }
}

}  // namespace
