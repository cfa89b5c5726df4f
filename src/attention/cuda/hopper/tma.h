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

// The tensor map of `t` (4-D, 16- or 8-bit, last dimension contiguous, on the GPU) for boxes of one
// 128-byte swizzle panel (64 16-bit or 128 8-bit columns) x box_rows, or, for 8-bit rows of 64 bytes, of the
// whole row with the 64-byte swizzle (the FP8 forward at head dim 64), or, 8-bit with `panels_of_64_bytes`, of 64
// columns with the 64-byte swizzle however long the rows (the FP8 forward's Vᵀ at 192-key blocks, 1.5 panels of
// 128 bytes: three of 64); or nothing when TMA cannot describe the view: a stride that is zero, negative, not a
// multiple of 16 bytes or at least 2^40 bytes; a base not 16-byte aligned; a last dimension not a multiple of the
// box's columns; sizes past 2^31. Such views take the mma.sync kernels.
inline std::optional<CUtensorMap> rows_tensor_map(const TensorView& t, int box_rows, bool panels_of_64_bytes = false) {
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  if (t.ndim != 4 || t.stride(3) != 1 || (elem != 2 && elem != 1)) return std::nullopt;
  const int64_t box_cols = elem == 1 && (t.size(3) == 64 || panels_of_64_bytes) ? 64 : 128 / elem;
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0 || t.size(3) % box_cols != 0) return std::nullopt;
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
    const int64_t bytes = t.stride(d) * elem;
    // A dimension of size 1 is only ever read at coordinate 0: its stride does not matter, so any valid one
    // stands in for whatever the view carries.
    if (t.size(d) == 1) {
      strides[static_cast<size_t>(i)] = 16;
      continue;
    }
    if (bytes <= 0 || bytes % 16 != 0 || bytes >= (int64_t{1} << 40)) return std::nullopt;
    strides[static_cast<size_t>(i)] = static_cast<cuuint64_t>(bytes);
  }
  const std::array<cuuint32_t, 4> box{static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1, 1};
  const std::array<cuuint32_t, 4> element_strides{1, 1, 1, 1};
  CUtensorMap map;
  const CUtensorMapDataType type = elem == 1                  ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : t.dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                            : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUtensorMapSwizzle swizzle = box_cols * elem == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  const CUresult r = encode(&map, type, 4, t.data, dims.data(), strides.data(), box.data(), element_strides.data(),
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return std::nullopt;
  return map;
}

}  // namespace flashlm::sm90
