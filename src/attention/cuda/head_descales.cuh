// A tensor's FP8 descales as the CUDA kernels read them: one per (batch, key/value head) from
// AttentionProblem::HeadDescales (device memory, element (b, hk) at [b · batch_stride + hk · head_stride]), or the
// tensor's per-tensor descale where it has none. The one device view of them: the FP8 forward's tiles
// (hopper/flash_fwd_fp8_sm90.cu) and the dequantising copies of the FP8 backward (naive.cu's convert_rows) both
// read it.
#pragma once
#include <cstdint>

#include "attention/problem.h"

namespace flashlm::flash_cuda {

struct HeadDescalesView {
  const float* data = nullptr;
  int64_t batch_stride = 0, head_stride = 0;
  double scalar = 1.0;  // the per-tensor descale, where data is null

  static HeadDescalesView of(const AttentionProblem::HeadDescales& heads, double per_tensor) {
    return {heads.data, heads.batch_stride, heads.head_stride, per_tensor};
  }
  // In fp64: an fp32 descale times an e4m3 value (4 significant bits) is exact there.
  __device__ __forceinline__ double at(int64_t b, int64_t hk) const {
    return data == nullptr ? scalar : double(__ldg(data + b * batch_stride + hk * head_stride));
  }
};

}  // namespace flashlm::flash_cuda
