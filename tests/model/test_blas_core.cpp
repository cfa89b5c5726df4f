// The rule that corrects OpenBLAS's kernel choice on CPUs it does not recognise (flashlm/blas.h).
#include <cblas.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "env_testing.h"
#include "flashlm/blas.h"
#include "flashlm/device.h"
#include "model/blas_cpu.h"
#include "model/ops_cpu.h"

using namespace flashlm;
using flashlm::testing::ScopedEnvironment;

TEST(BlasCore, PreAvx2CoreOnAnAvx2CpuIsCorrected) {
  EXPECT_EQ(blas_core_for("Prescott", true, true), "SkylakeX");
  EXPECT_EQ(blas_core_for("prescott", true, false), "Haswell");
  EXPECT_EQ(blas_core_for("Nehalem", true, false), "Haswell");
}

TEST(BlasCore, AFittingChoiceOrAnOldCpuIsLeftAlone) {
  EXPECT_EQ(blas_core_for("SkylakeX", true, true), "");
  EXPECT_EQ(blas_core_for("Haswell", true, true), "");  // a deliberate choice (e.g. on Zen), not a fallback
  EXPECT_EQ(blas_core_for("Zen", true, false), "");
  EXPECT_EQ(blas_core_for("Prescott", false, false), "");  // the CPU has no AVX2: Prescott is right
}

TEST(BlasCore, TheUsersOpenblasCoretypeWins) {
  const ScopedEnvironment coretype("OPENBLAS_CORETYPE", "Prescott");
  EXPECT_EQ(blas_core_to_request(), "");
  EXPECT_NE(blas_description().find("OPENBLAS_CORETYPE=Prescott"), std::string::npos) << blas_description();
}

// The CPU threading policy (flashlm/blas.h): after a matrix product, OpenBLAS's own pool is down to one
// thread (its pthreads build) and OpenMP's thread count is what the program set.
TEST(CpuThreading, AProductLeavesOpenblasSingleThreadedAndOpenmpAsSet) {
  const int saved = cpu_threads();
  set_cpu_threads(2);
  const std::vector<float> x(4 * 8, 1.0f), w(16 * 8, 1.0f);
  std::vector<float> y(4 * 16);
  cpu::linear_forward(x.data(), w.data(), y.data(), 4, 8, 16);
  EXPECT_EQ(y[0], 8.0f);
  EXPECT_EQ(cpu_threads(), 2);
  if (openblas_get_parallel() == 1) {
    EXPECT_EQ(blas_threads(), 1) << "OpenBLAS's pthreads pool still runs beside OpenMP's";
  }
  set_cpu_threads(saved);
}

// cpu::sgemm splits C across the threads by rows or by columns: every transpose, both splits, a last block
// shorter than the others, thread counts that leave threads without a block and a product too small to split,
// against a double sum; the padding at the end of each row of C stays untouched.
TEST(CpuThreading, SplitProductsMatchTheDefinition) {
  const int saved = cpu_threads();
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  struct Shape {
    int64_t m, n, k;
  };
  for (const Shape s : {Shape{67, 5, 120}, Shape{3, 131, 100}, Shape{130, 70, 9}, Shape{1, 1000, 64}, Shape{17, 2, 1}}) {
    for (int threads : {1, 2, 3, 8}) {
      for (int ta = 0; ta < 2; ++ta) {
        for (int tb = 0; tb < 2; ++tb) {
          const int64_t lda = (ta ? s.m : s.k) + 3, ldb = (tb ? s.k : s.n) + 2, ldc = s.n + 1;
          std::vector<float> a(size_t((ta ? s.k : s.m) * lda)), b(size_t((tb ? s.n : s.k) * ldb)),
              c(size_t(s.m * ldc));
          for (float& v : a) v = dist(rng);
          for (float& v : b) v = dist(rng);
          for (float& v : c) v = dist(rng);
          std::vector<float> expected = c;
          for (int64_t i = 0; i < s.m; ++i) {
            for (int64_t j = 0; j < s.n; ++j) {
              double sum = 0;
              for (int64_t p = 0; p < s.k; ++p) {
                sum += double(ta ? a[size_t(p * lda + i)] : a[size_t(i * lda + p)]) *
                       double(tb ? b[size_t(j * ldb + p)] : b[size_t(p * ldb + j)]);
              }
              expected[size_t(i * ldc + j)] = float(0.5 * sum + 2.0 * c[size_t(i * ldc + j)]);
            }
          }
          set_cpu_threads(threads);
          cpu::sgemm(ta, tb, s.m, s.n, s.k, 0.5f, a.data(), lda, b.data(), ldb, 2.0f, c.data(), ldc);
          for (size_t i = 0; i < c.size(); ++i) {
            ASSERT_NEAR(c[i], expected[i], 1e-4) << "m " << s.m << " n " << s.n << " k " << s.k << " threads "
                                                 << threads << " ta " << ta << " tb " << tb << " at " << i;
          }
        }
      }
    }
  }
  set_cpu_threads(saved);
}
