// Shared by the GPU tests: skip (with a message) where no CUDA device is visible, so that every GPU test
// also runs, as a skip, on CPU-only machines.
#pragma once
#include <gtest/gtest.h>

#include "flashlm/device.h"

#define SKIP_WITHOUT_GPU()                                                                      \
  do {                                                                                          \
    if (::flashlm::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";          \
  } while (0)
