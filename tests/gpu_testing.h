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
