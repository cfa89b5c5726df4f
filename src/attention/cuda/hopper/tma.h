// The host side of TMA: a CUtensorMap for tiles of rows of a [batch, seq, heads, head_dim] view, as the
// Hopper kernels load them (sm90.cuh's swizzled layout: boxes of 64 columns x `box_rows` rows, 128-byte
// swizzle, rows past the end of the view zero-filled by the copy engine). The encoder is the driver's
// cuTensorMapEncodeTiled, reached through the runtime's entry-point query, so nothing links -lcuda.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <array>
#include <cstdint>
#include <optional>

#include "flashlm/tensor.h"

namespace flashlm::sm90 {

// The driver's encoder, looked up once (nullptr where the driver lacks it).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // the failed query must not surface at the next launch check
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// The tensor map of `t` (4-D, 16-bit, last dimension contiguous, on the GPU) for boxes of 64 x box_rows,
// or nothing when TMA cannot describe the view: a stride that is zero, negative, not a multiple of 16 bytes
// or at least 2^40 bytes; a base not 16-byte aligned; a head dim not a multiple of 64; sizes past 2^31.
// Such views take the mma.sync kernels.
inline std::optional<CUtensorMap> rows_tensor_map(const TensorView& t, int box_rows) {
  if (t.ndim != 4 || t.stride(3) != 1 || dtype_size(t.dtype) != 2) return std::nullopt;
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0 || t.size(3) % 64 != 0) return std::nullopt;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return std::nullopt;
  // Innermost first: head_dim, seq, heads, batch.
  const std::array<cuuint64_t, 4> dims{static_cast<cuuint64_t>(t.size(3)), static_cast<cuuint64_t>(t.size(1)),
                                       static_cast<cuuint64_t>(t.size(2)), static_cast<cuuint64_t>(t.size(0))};
  std::array<cuuint64_t, 3> strides{};
  const int dim_of_stride[3] = {1, 2, 0};
  for (int i = 0; i < 3; ++i) {
    const int d = dim_of_stride[i];
    if (dims[static_cast<size_t>(i) + 1] > (1ull << 31)) return std::nullopt;
    const int64_t bytes = t.stride(d) * 2;
    // A dimension of size 1 is only ever read at coordinate 0: its stride does not matter, so any valid one
    // stands in for whatever the view carries.
    if (t.size(d) == 1) {
      strides[static_cast<size_t>(i)] = 16;
      continue;
    }
    if (bytes <= 0 || bytes % 16 != 0 || bytes >= (int64_t{1} << 40)) return std::nullopt;
    strides[static_cast<size_t>(i)] = static_cast<cuuint64_t>(bytes);
  }
  const std::array<cuuint32_t, 4> box{64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const std::array<cuuint32_t, 4> element_strides{1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = encode(&map,
                            t.dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                            4, t.data, dims.data(), strides.data(), box.data(), element_strides.data(),
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return std::nullopt;
  return map;
}

}  // namespace flashlm::sm90
