// Host fp32 arrays to and from buffers of the parameters' device holding fp32 or (bf16-pure's shards and
// moments) bf16 values, for checkpoints and initialisation: bf16 widened exactly on the way out, rounded to
// nearest even on the way in (bf16_t's rounding, the one the CUDA casts use). CUDA copies are synchronous.
#pragma once
#include <cstdint>

#include "flashlm/tensor.h"

namespace flashlm {

void values_to_host(float* host, const void* src, int64_t count, bool bf16, Device device);
void values_from_host(void* dst, const float* host, int64_t count, bool bf16, Device device);

}  // namespace flashlm
