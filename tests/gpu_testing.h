// Shared by the GPU tests: skip (with a message) where no CUDA device is visible, so that every GPU test
// also runs, as a skip, on CPU-only machines.
#pragma once
#include <gtest/gtest.h>

#include <string>

#include "core/cuda_runtime.h"
#include "flashlm/device.h"

#define SKIP_WITHOUT_GPU()                                                                      \
  do {                                                                                          \
    if (::flashlm::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";          \
  } while (0)

namespace flashlm::testing {

// Whether the current CUDA device is an sm_90 GPU (the Hopper kernels' target), by the runtime's own
// description of it.
inline bool on_sm90() { return ::flashlm::cuda_device_description().find("(sm_90,") != std::string::npos; }

}  // namespace flashlm::testing

// Skips, saying which of the three is missing, unless the Hopper (sm_90a) kernels can run: a CUDA device, a
// test binary built with them (FLASHLM_WITH_SM90, which tests/CMakeLists.txt defines for test_attention
// only) and an sm_90 GPU. Code after it that names the kernels' own declarations still needs
// #ifdef FLASHLM_WITH_SM90 to compile without them.
#ifdef FLASHLM_WITH_SM90
#define SKIP_WITHOUT_HOPPER()                                                                              \
  do {                                                                                                     \
    SKIP_WITHOUT_GPU();                                                                                    \
    if (!::flashlm::testing::on_sm90())                                                                    \
      GTEST_SKIP() << "the Hopper (sm_90a) kernels run on an sm_90 GPU only; this one is "                 \
                   << ::flashlm::cuda_device_description();                                                \
  } while (0)
#else
#define SKIP_WITHOUT_HOPPER()                                                                              \
  do {                                                                                                     \
    SKIP_WITHOUT_GPU();                                                                                    \
    GTEST_SKIP() << "built without the Hopper (sm_90a) kernels (FLASHLM_WITH_SM90 undefined)";             \
  } while (0)
#endif
