// FP8 training's device code shared by the casts (model/cuda/fp8.cu) and the AdamW step that writes the block
// weights' copies itself (optim/cuda/adamw.cu, Fp8WeightCopies): the encode, and the packed 64 × 64 tile whose
// transposed copy is written from shared memory. Device code only.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

#include "core/cuda/kernels.cuh"
#include "flashlm/fp8.h"

namespace flashlm::gpu {

template <Fp8Format F>
__device__ __forceinline__ uint8_t fp8_encode(float v) {
  // Round to nearest even, saturating to the largest finite value (infinities too); NaN stays NaN.
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, F == Fp8Format::e4m3 ? __NV_E4M3 : __NV_E5M2));
}

// The packed tile: kVecTile × kVecTile elements, a thread a pack of kPack elements of a row; the tile's bytes
// kept in shared memory (rows kVecTileStride bytes apart) for the transposed copy.
constexpr int kVecTile = 64;
constexpr int kVecThreads = 256;
constexpr int kVecTileStride = kVecTile + 4;  // bytes per tile row: 4-byte aligned, fewer bank conflicts

// Pack `i`'s eight bytes (row i of the tile, columns j..j+7) into the tile.
__device__ __forceinline__ void put_tile_pack(uint8_t* tile, int i, int j, const uint32_t (&word)[2]) {
  *reinterpret_cast<uint32_t*>(tile + i * kVecTileStride + j) = word[0];
  *reinterpret_cast<uint32_t*>(tile + i * kVecTileStride + j + 4) = word[1];
}

// The tile at (r0, c0) of a rows × cols matrix (multiples of kPack) into its transpose qt [cols, rows]: each
// thread 8 bytes of a column, gathered from the tile, one 8-byte store (coalesced along qt's rows). The caller
// synchronises before (the tile written) and after (the tile rewritten).
__device__ __forceinline__ void write_transposed_tile(const uint8_t* tile, int64_t r0, int64_t c0, int64_t rows,
                                                      int64_t cols, uint8_t* __restrict__ qt) {
  constexpr int kPacksPerRow = kVecTile / kPack;
  for (int v = threadIdx.x; v < kVecTile * kPacksPerRow; v += kVecThreads) {
    const int j = v / kPacksPerRow, i = (v % kPacksPerRow) * kPack;  // qt's row c0 + j, columns r0 + i...
    const int64_t c = c0 + j, r = r0 + i;
    if (r < rows && c < cols) {
      uint32_t word[2] = {0, 0};
#pragma unroll
      for (int k = 0; k < kPack; ++k) word[k / 4] |= uint32_t{tile[(i + k) * kVecTileStride + j]} << (8 * (k % 4));
      *reinterpret_cast<uint2*>(qt + c * rows + r) = make_uint2(word[0], word[1]);
    }
  }
}

}  // namespace flashlm::gpu
