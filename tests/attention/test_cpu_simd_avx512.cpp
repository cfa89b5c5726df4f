// The AVX-512 softmax rows' exp (core/cpu_simd.h's exp_fp32_nonpositive_x16: its own polynomial and rounding)
// against libm, with the scalar variant's tolerance (test_attention_cpu.cpp), on the CPUs that run it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#if defined(FLASHLM_TEST_AVX512_EXP)
namespace flashlm::cpu_test_avx512 {
void exp_fp32_nonpositive_x16_over(const float* args, float* out, size_t n);  // cpu_simd_avx512_exp.cpp
}
#endif

namespace {

TEST(CpuSimd, ExpFp32NonpositiveX16MatchesLibmWithinAFewUlp) {
#if defined(FLASHLM_TEST_AVX512_EXP)
  if (!__builtin_cpu_supports("x86-64-v4")) GTEST_SKIP() << "this CPU does not run x86-64-v4";
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> wide(-87.0f, 0.0f), softmax(-30.0f, 0.0f), near_zero(-0.5f, 0.0f);
  std::vector<float> args;
  for (int i = 0; i < 30000; ++i) args.push_back(i % 3 == 0 ? wide(rng) : i % 3 == 1 ? softmax(rng) : near_zero(rng));
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // The reduction's and the clamp's boundaries, and the values the masking relies on (exp(0) = 1, exp(-inf) = 0).
  for (float a : {0.0f, -0.0f, -1e-8f, -0.3465f, -0.3466f, -0.6931f, -1.0f, -87.29f, -87.31f, -87.0f, -100.0f, -inf}) {
    args.push_back(a);
  }
  args.push_back(nan);
  while (args.size() % 16) args.push_back(-1.0f);
  std::vector<float> got(args.size(), -1.0f);
  flashlm::cpu_test_avx512::exp_fp32_nonpositive_x16_over(args.data(), got.data(), args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    if (std::isnan(args[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << "NaN must stay NaN, got " << got[i];
      continue;
    }
    const double want = args[i] < -87.3f ? 0.0 : std::exp(double(args[i]));  // 0 below e^-87.3, as the scalar
    EXPECT_LE(std::abs(got[i] - want), 4e-7 * want + 2e-38)
        << "exp_fp32_nonpositive_x16(" << args[i] << ") = " << got[i] << ", libm " << want;
    if (args[i] == 0.0f) {
      EXPECT_EQ(got[i], 1.0f);
    }
    if (args[i] < -87.3f) {
      EXPECT_EQ(got[i], 0.0f) << "at " << args[i];
    }
  }
#else
  GTEST_SKIP() << "built without the x86-64-v4 object (not x86-64, or not GCC/Clang)";
#endif
}

}  // namespace
