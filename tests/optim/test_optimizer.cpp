// The optimizer arithmetic on the CPU (optim/optimizer.h): pure-bf16 AdamW against the fp32 step it is
// defined by (the same operations on the widened values, rounded to bf16 once), its training behaviour
// beside fp32 masters, splits into ranges, the bf16 squared norm, and bad arguments; fp32 masters with bf16
// moments (round to nearest and stochastic) against a scalar reference, the stochastic rounding's bias, and
// the trajectory's distance from fp32 moments against its derived bound. The CUDA twins are tested against
// these in tests/model/test_ops_cuda.cpp.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashlm/dtype.h"
#include "flashlm/error.h"
#include "core/random.h"
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

std::vector<float> random_f32(int64_t n, uint64_t seed, float stddev, bool square = false) {
  return widen(random_bf16(n, seed, stddev, square));
}

// The scalar reference of the stochastic rounding: x's bf16 truncation, one bf16 step up when its 16
// discarded bits plus the element's 16 random bits carry (probability discarded / 2^16).
float stochastic_reference(float x, uint64_t key, int64_t index, int half) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t random = uint32_t(counter_draw(key, uint64_t(index)) >> (16 * half)) & 0xffffu;
  const uint32_t up = (bits & 0xffffu) + random >= 0x10000u ? 1u : 0u;
  return std::bit_cast<float>(((bits >> 16) + up) << 16);
}

// fp32 masters with bf16 moments: the fp32 step on the widened moments (cpu::adamw_step), the moments then
// rounded to nearest even, or stochastically as stochastic_reference says.
TEST(AdamWBf16MomentsCpu, IsTheFp32StepOnWidenedMomentsRoundedOnce) {
  for (const bool stochastic : {false, true}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}}) {
      SCOPED_TRACE(std::string(stochastic ? "stochastic" : "nearest") + ", n = " + std::to_string(n));
      const MomentRounding rounding{stochastic, 977};
      const int64_t first = stochastic ? 12345 : 0;
      std::vector<float> w = random_f32(n, 110 + n, 0.05f);
      std::vector<bf16_t> m = random_bf16(n, 120 + n, 1e-3f), v = random_bf16(n, 130 + n, 1e-3f, true);
      for (int64_t step = 1; step <= 3; ++step) {
        const std::vector<float> g = random_f32(n, 140 + n + step, 1e-2f);
        std::vector<float> wf = w, mf = widen(m), vf = widen(v);
        cpu::adamw_step(wf.data(), g.data(), mf.data(), vf.data(), n, kLr, kBeta1, kBeta2, kEps, kDecay, step);
        cpu::adamw_step_bf16_moments(w.data(), g.data(), m.data(), v.data(), n, kLr, kBeta1, kBeta2, kEps, kDecay,
                                     step, rounding, first);
        EXPECT_EQ(std::memcmp(w.data(), wf.data(), size_t(n) * sizeof(float)), 0) << "w, step " << step;
        std::vector<bf16_t> want_m = narrow(mf), want_v = narrow(vf);
        if (stochastic) {
          const uint64_t key = moment_rounding_key(rounding.seed, step);
          for (int64_t i = 0; i < n; ++i) {
            want_m[size_t(i)] = bf16_t(stochastic_reference(mf[size_t(i)], key, first + i, 0));
            want_v[size_t(i)] = bf16_t(stochastic_reference(vf[size_t(i)], key, first + i, 1));
          }
        }
        EXPECT_TRUE(same_bits(m, want_m)) << "m, step " << step;
        EXPECT_TRUE(same_bits(v, want_v)) << "v, step " << step;
      }
    }
  }
}

TEST(AdamWBf16MomentsCpu, AnySplitIntoRangesGivesTheSameBits) {
  const int64_t n = 1001, split = 389;
  const std::vector<float> g = random_f32(n, 151, 1e-2f);
  for (const bool stochastic : {false, true}) {
    std::vector<float> w = random_f32(n, 152, 0.05f);
    std::vector<bf16_t> m = random_bf16(n, 153, 1e-3f), v = random_bf16(n, 154, 1e-3f, true);
    std::vector<float> w2 = w;
    std::vector<bf16_t> m2 = m, v2 = v;
    const MomentRounding r{stochastic, 5};
    cpu::adamw_step_bf16_moments(w.data(), g.data(), m.data(), v.data(), n, kLr, kBeta1, kBeta2, kEps, kDecay, 5, r);
    cpu::adamw_step_bf16_moments(w2.data(), g.data(), m2.data(), v2.data(), split, kLr, kBeta1, kBeta2, kEps, kDecay,
                                 5, r);
    cpu::adamw_step_bf16_moments(w2.data() + split, g.data() + split, m2.data() + split, v2.data() + split, n - split,
                                 kLr, kBeta1, kBeta2, kEps, kDecay, 5, r, split);
    EXPECT_EQ(std::memcmp(w.data(), w2.data(), sizeof(float) * size_t(n)), 0);
    EXPECT_TRUE(same_bits(m, m2));
    EXPECT_TRUE(same_bits(v, v2));
  }
}

// The stochastic rounding is unbiased: one value x rounded at 2^16 indices averages to x. Each rounding is
// x's lower or upper bf16 neighbour (a step u apart), so the mean of N of them has a standard deviation of at
// most u / (2 sqrt N) = u / 512; the bound is 6 of those. A draw that ignored the index (one rounding for
// every element) would be off by min(f, 1 - f) u, here 0.3 u.
TEST(AdamWBf16MomentsCpu, StochasticRoundingIsUnbiased) {
  const float lower = 1.0f, u = 1.0f / 128;  // bf16 neighbours 1 and 1 + 2^-7
  const float x = lower + 0.3f * u;
  const int64_t n = int64_t{1} << 16;
  for (const int64_t step : {int64_t{1}, int64_t{2}}) {
    const uint64_t key = moment_rounding_key(42, step);
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t random = uint32_t(counter_draw(key, uint64_t(i)));
      bf16_t b;
      b.bits = bf16_bits_stochastic(std::bit_cast<uint32_t>(x), random);
      sum += float(b);
    }
    const double mean = sum / double(n);
    EXPECT_NEAR(mean, x, 6.0 * u / 512) << "step " << step;
  }
}

// NaN stays a NaN (also one whose payload lies in the discarded bits), infinities stay infinite, and a bf16
// value stays itself, whatever the random bits.
TEST(AdamWBf16MomentsCpu, StochasticRoundingKeepsSpecialsAndBf16Values) {
  for (const uint32_t random : {0u, 0x8000u, 0xffffu}) {
    for (const uint32_t nan : {0x7f800001u, 0xffc00000u}) {
      const uint16_t b = bf16_bits_stochastic(nan, random);
      EXPECT_TRUE((b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0) << std::hex << nan << " -> " << b;
    }
    EXPECT_EQ(bf16_bits_stochastic(0x7f800000u, random), 0x7f80u);
    EXPECT_EQ(bf16_bits_stochastic(0xff800000u, random), 0xff80u);
    EXPECT_EQ(bf16_bits_stochastic(0x3f810000u, random), 0x3f81u);
  }
}

// Why bf16-sr exists: with beta2 = 0.999 a step changes v by 0.1% of itself, below half of bf16's relative
// step (2^-9 = 0.2%), so v rounded to nearest does not decay at all when the gradients vanish, while fp32's
// v halves in ln 2 / 0.001 = 693 steps; stochastic rounding decays it on average (the default beta2 = 0.95
// changes v by 5% a step, which rounding to nearest keeps).
TEST(AdamWBf16MomentsCpu, NearestStallsASlowSecondMomentAndStochasticDoesNot) {
  const int64_t n = 1024, steps = 693;
  std::vector<float> w(n, 0.0f), wn(n, 0.0f), ws(n, 0.0f), zeros(n, 0.0f), mf(n, 0.0f), vf(n, 1.0f);
  std::vector<bf16_t> mn(n, bf16_t(0.0f)), vn(n, bf16_t(1.0f)), ms = mn, vs = vn;
  for (int64_t step = 1; step <= steps; ++step) {
    cpu::adamw_step(w.data(), zeros.data(), mf.data(), vf.data(), n, kLr, kBeta1, 0.999, kEps, 0.0, step);
    cpu::adamw_step_bf16_moments(wn.data(), zeros.data(), mn.data(), vn.data(), n, kLr, kBeta1, 0.999, kEps, 0.0,
                                 step, MomentRounding{false, 0});
    cpu::adamw_step_bf16_moments(ws.data(), zeros.data(), ms.data(), vs.data(), n, kLr, kBeta1, 0.999, kEps, 0.0,
                                 step, MomentRounding{true, 9});
  }
  double mean_sr = 0;
  for (const bf16_t x : vs) mean_sr += float(x);
  mean_sr /= double(n);
  EXPECT_NEAR(vf[0], 0.5, 0.01);
  EXPECT_EQ(float(vn[0]), 1.0f) << "rounded to nearest, v no longer stalls: the rationale above is stale";
  // Unbiased steps keep the mean on fp32's path; each element's spread after k steps is at most
  // sqrt(k) u / 2 with u <= 2^-7 (v <= 1): 0.103, so the mean of 1024 has sigma <= 0.0032; bound 6 sigma.
  EXPECT_NEAR(mean_sr, vf[0], 0.02) << "stochastic rounding should follow fp32's decay on average";
}

// With the same gradients, the moments and the weights with bf16 moments stay within derived distances of
// those with fp32 moments. Each rounding moves a moment x by at most r|x| (r = 2^-9 to nearest, 2^-8
// stochastically) and the recurrence x' = b x + (1 - b) y shrinks an earlier error by b per step, so
// |m_b - m_f| <= E_m = r max|m_b| / (1 - b1) and |v_b - v_f| <= E_v = r max|v_b| / (1 - b2) (max over the
// steps so far). The update u = alpha m / (sqrt(v) + eps) then differs by at most
// alpha (E_m / (sqrt(v_f) + eps) + |m_b| E_v / ((sqrt(v_b) + sqrt(v_f)) (sqrt(v_b) + eps) (sqrt(v_f) + eps)))
// (u_b - u_f split as (m_b - m_f) / (sqrt(v_f) + eps) + m_b (1 / (sqrt(v_b) + eps) - 1 / (sqrt(v_f) + eps))),
// summed over the steps for w; 1e-5 of each update covers the fp32 roundings of the two paths. Reading the
// stored moments as anything but their widened values breaks the moment bounds at once.
TEST(AdamWBf16MomentsCpu, StaysWithinTheDerivedBoundOfFp32Moments) {
  const int64_t n = 256, steps = 200;
  for (const bool stochastic : {false, true}) {
    SCOPED_TRACE(stochastic ? "stochastic" : "nearest");
    const double r = stochastic ? 1.0 / 256 : 1.0 / 512;
    std::vector<float> w = random_f32(n, 161, 0.05f), wb = w, mf(n, 0.0f), vf(n, 0.0f);
    std::vector<bf16_t> mb(n, bf16_t(0.0f)), vb(n, bf16_t(0.0f));
    std::vector<double> max_m(n, 0.0), max_v(n, 0.0), w_bound(n, 0.0);
    for (int64_t step = 1; step <= steps; ++step) {
      // Gradients with a drift and noise: the moments move, some of them through zero.
      std::vector<float> g = random_f32(n, 1000 + step, 1e-2f);
      for (int64_t i = 0; i < n; ++i) g[size_t(i)] += 1e-2f * float(i % 7 - 3) / 3.0f;
      const std::vector<float> before = w;
      cpu::adamw_step(w.data(), g.data(), mf.data(), vf.data(), n, kLr, kBeta1, kBeta2, kEps, 0.0, step);
      cpu::adamw_step_bf16_moments(wb.data(), g.data(), mb.data(), vb.data(), n, kLr, kBeta1, kBeta2, kEps, 0.0, step,
                                   MomentRounding{stochastic, 3});
      const double alpha = adamw_scalars(kLr, kBeta1, kBeta2, kEps, 0.0, step).alpha;
      for (int64_t i = 0; i < n; ++i) {
        const auto k = size_t(i);
        const double m_b = float(mb[k]), v_b = float(vb[k]);
        max_m[k] = std::max(max_m[k], std::fabs(m_b));
        max_v[k] = std::max(max_v[k], v_b);
        // (1 + 2r): the rounded value's size, not the exact one's, is what the test sees.
        const double e_m = r * (1 + 2 * r) * max_m[k] / (1 - kBeta1), e_v = r * (1 + 2 * r) * max_v[k] / (1 - kBeta2);
        ASSERT_LE(std::fabs(m_b - mf[k]), e_m) << "m, element " << i << ", step " << step;
        ASSERT_LE(std::fabs(v_b - vf[k]), e_v) << "v, element " << i << ", step " << step;
        const double sf = std::sqrt(double(vf[k])), sb = std::sqrt(v_b);
        w_bound[k] += alpha * (e_m / (sf + kEps) + std::fabs(m_b) * e_v / ((sb + sf) * (sb + kEps) * (sf + kEps))) +
                      1e-5 * std::fabs(double(w[k]) - before[k]);
        ASSERT_LE(std::fabs(double(wb[k]) - w[k]), w_bound[k]) << "w, element " << i << ", step " << step;
      }
    }
  }
}

// FP8 training's weight copies written by the AdamW step (Fp8WeightCopies) are scaled from fp8_weight_bound of
// the bf16 copy's amax before the step: it must hold every stored weight after it, whatever the gradients,
// and exceed their amax by little more than update_bound. Gradient sequences that press on the Cauchy-Schwarz
// bound (growing as (b2 / b1)^t, its equality case), spikes, sign flips, zeros and plain noise, for several
// betas, with fp32 moments and bf16 moments rounded either way; decay and clipping factors included.
TEST(AdamWUpdateBound, HoldsTheStoredWeightsWhateverTheGradients) {
  const int64_t n = 512, steps = 300;
  struct Betas {
    double b1, b2;
  };
  for (const Betas betas : {Betas{0.9, 0.95}, Betas{0.9, 0.999}, Betas{0.8, 0.99}, Betas{0.0, 0.5}, Betas{0.95, 0.95}}) {
    for (const int moments : {0, 1, 2}) {  // fp32, bf16 nearest, bf16 stochastic
      SCOPED_TRACE("b1 " + std::to_string(betas.b1) + " b2 " + std::to_string(betas.b2) + " moments " +
                   std::to_string(moments));
      std::vector<float> w = random_f32(n, 500 + moments, 0.02f), mf(n, 0.0f), vf(n, 0.0f);
      w[7] = 0.0f;
      std::vector<bf16_t> mb(n, bf16_t(0.0f)), vb(n, bf16_t(0.0f));
      std::mt19937_64 rng(900 + moments);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      double worst_slack = 0.0;
      for (int64_t step = 1; step <= steps; ++step) {
        const double lr = step % 50 == 0 ? 0.0 : 1e-3 * (1.0 + double(step % 3));
        const float clip = step % 11 == 0 ? 0.25f : 1.0f;
        float amax = 0.0f;  // the bf16 copy's, as the step's slot holds it
        for (float x : w) amax = std::max(amax, std::fabs(float(bf16_t(x))));
        const AdamWScalars a = adamw_scalars(lr, betas.b1, betas.b2, kEps, kDecay, step, clip);
        const float bound = fp8_weight_bound(amax, a);
        std::vector<float> g(n);
        for (int64_t i = 0; i < n; ++i) {
          const auto k = size_t(i);
          switch (i % 6) {
            case 0: g[k] = normal(rng); break;
            case 1: g[k] = float(std::pow(betas.b2 / std::max(betas.b1, 0.01), double(step))) * 1e-3f; break;
            case 2: g[k] = step % 37 == 0 ? 1e4f : 1e-4f * normal(rng); break;
            case 3: g[k] = step % 2 ? 1.0f : -1.0f; break;
            case 4: g[k] = step < 100 ? 0.0f : 1.0f; break;
            default: g[k] = float(i) * 1e-3f; break;
          }
          g[k] *= clip;  // the CPU steps take clipped gradients
        }
        if (moments == 0) {
          cpu::adamw_step(w.data(), g.data(), mf.data(), vf.data(), n, lr, betas.b1, betas.b2, kEps, kDecay, step);
        } else {
          cpu::adamw_step_bf16_moments(w.data(), g.data(), mb.data(), vb.data(), n, lr, betas.b1, betas.b2, kEps,
                                       kDecay, step, MomentRounding{moments == 2, 5});
        }
        float after = 0.0f;
        for (float x : w) after = std::max(after, std::fabs(x));
        ASSERT_LE(after, bound) << "step " << step;
        ASSERT_LE(std::fabs(float(bf16_t(after))), bound * (1.0f + 0x1p-8f)) << "step " << step;
        if (std::isinf(bound)) {  // b1² >= b2: no bound, and the model casts in the pass instead
          ASSERT_GE(betas.b1 * betas.b1, betas.b2);
          continue;
        }
        // Looser than the amax after by a few of the updates it allows for (the largest weight may move inward by
        // one) and of the amax's own 2^-8 (+ 2^-10; the master within half a bf16 step of its copy).
        worst_slack = std::max(worst_slack, (double(bound) - after) / (double(a.update_bound) + 0x1p-7 * amax));
      }
      EXPECT_LT(worst_slack, 4.0) << "bound - amax after, in update bounds + 2^-7 amax";
    }
  }
}

TEST(AdamWUpdateBound, IsLrAtTheFirstStepAndInfiniteWithoutAdamsCondition) {
  EXPECT_NEAR(adamw_update_bound(1e-3, 0.9, 0.95, 1), 1.25e-3, 1e-15);
  EXPECT_NEAR(adamw_update_bound(1e-3, 0.9, 1.0, 10), 1.25e-3 * (0.1 / (1 - std::pow(0.9, 10))) *
                                                          std::sqrt(10.0 * (1 - std::pow(0.81, 10)) / 0.19),
              1e-12);
  // The large-step limit at CS336's betas: 1.25 · 0.1 / sqrt(0.05) / sqrt(1 - 0.81 / 0.95) · lr.
  EXPECT_NEAR(adamw_update_bound(1.0, 0.9, 0.95, 100000), 1.25 * 0.1 / std::sqrt(0.05) / std::sqrt(1 - 0.81 / 0.95),
              1e-9);
  EXPECT_TRUE(std::isinf(adamw_update_bound(1e-3, 0.99, 0.95, 5)));  // b1² >= b2: none holds
  EXPECT_TRUE(std::isinf(adamw_update_bound(1e-3, 0.9, 0.81, 5)));
  EXPECT_TRUE(std::isinf(adamw_update_bound(1e-3, 0.9, 0.95, 0)));
  EXPECT_TRUE(std::isnan(fp8_weight_bound(NAN, adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 3))));
  EXPECT_EQ(adamw_scalars(1e-3, 0.99, 0.95, 1e-8, 0.1, 3).update_bound, INFINITY);
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
