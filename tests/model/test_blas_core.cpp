// The rule that corrects OpenBLAS's kernel choice on CPUs it does not recognise (flashlm/blas.h).
#include <gtest/gtest.h>

#include <cstdlib>

#include "flashlm/blas.h"

using namespace flashlm;

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
  const char* before = std::getenv("OPENBLAS_CORETYPE");
  const std::string saved = before ? before : "";
  setenv("OPENBLAS_CORETYPE", "Prescott", 1);
  EXPECT_EQ(blas_core_to_request(), "");
  EXPECT_NE(blas_description().find("OPENBLAS_CORETYPE=Prescott"), std::string::npos) << blas_description();
  if (before) setenv("OPENBLAS_CORETYPE", saved.c_str(), 1);
  else unsetenv("OPENBLAS_CORETYPE");
}
