// FP8 training's casts on CUDA (model/cuda/fp8.h): the amax reduction and the cast with its transposed copy.
#include <cuda_fp8.h>

#include "core/cuda/kernels.cuh"
#include "core/cuda_check.h"
#include "model/cuda/amax.cuh"
#include "model/cuda/fp8.h"
#include "model/fp8.h"

namespace flashlm::gpu {

namespace {

// 16-byte loads where x is aligned (for_each_pack): scalar 2-byte loads left this reduction at about a
// third of the memory bandwidth.
template <class D>
__global__ void __launch_bounds__(kThreads) fp8_amax_kernel(const D* __restrict__ x, int64_t count, int64_t packs,
                                                            uint32_t* __restrict__ amax_bits) {
  uint32_t best = 0;
  for_each_pack(count, packs, [&](auto width, int64_t i) {
    constexpr int N = decltype(width)::value;
    const Vec<D, N> v = load<N>(x + i);
#pragma unroll
    for (int k = 0; k < N; ++k) best = max(best, magnitude_bits(f32(v[k])));
  });
  block_amax_to<kThreads>(amax_bits, best);
}

template <Fp8Format F>
__device__ __forceinline__ uint8_t encode(float v) {
  // Round to nearest even, saturating to the largest finite value (infinities too); NaN stays NaN.
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, F == Fp8Format::e4m3 ? __NV_E4M3 : __NV_E5M2));
}

constexpr unsigned kAmaxBlocks = 1024;
constexpr int kTile = 32;      // the cast's tile: kTile × kTile elements
constexpr int kTileRows = 8;   // threads per tile column: the block is kTile × kTileRows

// One block per kTile × kTile tile (grid-striding over tile rows past the grid's): each element scaled and
// rounded once, written straight (coalesced along cols) and, through shared memory, transposed (coalesced
// along rows).
template <class D, Fp8Format F>
__global__ void __launch_bounds__(kTile* kTileRows)
    fp8_cast_kernel(const D* __restrict__ x, int64_t rows, int64_t cols, int64_t tile_rows,
                    const float* __restrict__ amax, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                    float* __restrict__ dequant) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  const float scale = fp8_scale(*amax, F);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) *dequant = fp8_dequant_scale(scale);
  const int64_t c0 = int64_t{blockIdx.x} * kTile;
  for (int64_t tr = blockIdx.y; tr < tile_rows; tr += gridDim.y) {
    const int64_t r0 = tr * kTile;
    for (int i = threadIdx.y; i < kTile; i += kTileRows) {
      const int64_t r = r0 + i, c = c0 + threadIdx.x;
      if (r < rows && c < cols) {
        const uint8_t v = encode<F>(f32(x[r * cols + c]) * scale);
        if (q) q[r * cols + c] = v;
        tile[i][threadIdx.x] = v;
      }
    }
    if (!qt) continue;  // uniform over the block
    __syncthreads();
    for (int i = threadIdx.y; i < kTile; i += kTileRows) {
      const int64_t c = c0 + i, r = r0 + threadIdx.x;
      if (r < rows && c < cols) qt[c * rows + r] = tile[threadIdx.x][i];
    }
    __syncthreads();  // the tile is rewritten by the next tile row
  }
}

// The cast with 16-byte loads and 8-byte stores, for rows and cols multiples of 8 (a pack of 8 is then
// wholly inside or outside the matrix) and aligned pointers: one block per kVecTile × kVecTile tile, each
// thread a pack of 8 elements of a row, and for the transposed copy 8 bytes of a column gathered from the
// tile in shared memory. The byte-wide kernel above moves a quarter of that per instruction; its stores
// and transposed writes dominated the FP8 step's casts.
constexpr int kVecTile = 64;
constexpr int kVecThreads = 256;
constexpr int kVecTileStride = kVecTile + 4;  // bytes per tile row: 4-byte aligned, fewer bank conflicts

template <class D, Fp8Format F>
__global__ void __launch_bounds__(kVecThreads)
    fp8_cast_packed_kernel(const D* __restrict__ x, int64_t rows, int64_t cols, int64_t tile_rows,
                           const float* __restrict__ amax, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                           float* __restrict__ dequant) {
  __shared__ __align__(16) uint8_t tile[kVecTile * kVecTileStride];
  const float scale = fp8_scale(*amax, F);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *dequant = fp8_dequant_scale(scale);
  const int64_t c0 = int64_t{blockIdx.x} * kVecTile;
  constexpr int kPacksPerRow = kVecTile / kPack;
  for (int64_t tr = blockIdx.y; tr < tile_rows; tr += gridDim.y) {
    const int64_t r0 = tr * kVecTile;
    for (int v = threadIdx.x; v < kVecTile * kPacksPerRow; v += kVecThreads) {
      const int i = v / kPacksPerRow, j = (v % kPacksPerRow) * kPack;
      const int64_t r = r0 + i, c = c0 + j;
      if (r < rows && c < cols) {
        const Vec<D, kPack> in = load<kPack>(x + r * cols + c);
        uint32_t word[2] = {0, 0};
#pragma unroll
        for (int k = 0; k < kPack; ++k) word[k / 4] |= uint32_t{encode<F>(f32(in[k]) * scale)} << (8 * (k % 4));
        if (q) *reinterpret_cast<uint2*>(q + r * cols + c) = make_uint2(word[0], word[1]);
        *reinterpret_cast<uint32_t*>(tile + i * kVecTileStride + j) = word[0];
        *reinterpret_cast<uint32_t*>(tile + i * kVecTileStride + j + 4) = word[1];
      }
    }
    if (!qt) continue;  // uniform over the block
    __syncthreads();
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
    __syncthreads();  // the tile is rewritten by the next tile row
  }
}

}  // namespace

template <class T>
void fp8_amax(const T* x, int64_t count, float* amax, void* stream) {
  check_count("fp8_amax", "count", count);
  FLASHLM_CHECK(amax != nullptr, "fp8_amax: amax is null");
  clear_amax(amax, as_stream(stream));
  if (count == 0) return;
  FLASHLM_CHECK(x != nullptr, "fp8_amax: x is null");
  // At most kAmaxBlocks blocks (one atomic each), grid-striding over the rest.
  const int64_t packs = pack_count(count, x);
  const unsigned blocks = std::min(packed_blocks(count, packs), kAmaxBlocks);
  fp8_amax_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(dev(x), count, packs, reinterpret_cast<uint32_t*>(amax));
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "fp8_amax_kernel");
}

template <class T>
void fp8_cast(const T* x, int64_t rows, int64_t cols, const float* amax, Fp8Format format, uint8_t* q, uint8_t* qt,
              float* dequant, void* stream) {
  FLASHLM_CHECK(rows >= 1 && cols >= 1, "fp8_cast: rows = {}, cols = {}, expected >= 1", rows, cols);
  FLASHLM_CHECK(rows <= (int64_t{1} << 40) / cols, "fp8_cast: {} × {} elements: too many", rows, cols);
  FLASHLM_CHECK(x && amax && dequant, "fp8_cast: x, amax and dequant must not be null");
  FLASHLM_CHECK(q || qt, "fp8_cast: q and qt are both null: nothing to write");
  using D = std::remove_const_t<std::remove_pointer_t<decltype(dev(x))>>;
  const auto aligned8 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; };
  const bool packed =
      rows % kPack == 0 && cols % kPack == 0 && aligned16(x) && (!q || aligned8(q)) && (!qt || aligned8(qt));
  const int tile = packed ? kVecTile : kTile;
  const int64_t tile_cols = ceil_div(cols, tile), tile_rows = ceil_div(rows, tile);
  FLASHLM_CHECK(tile_cols <= INT32_MAX, "fp8_cast: cols = {}: too many", cols);
  const dim3 grid(unsigned(tile_cols), unsigned(std::min<int64_t>(tile_rows, 65535)));
  const auto launch = [&](auto format_constant) {
    constexpr Fp8Format F = decltype(format_constant)::value;
    if (packed) {
      fp8_cast_packed_kernel<D, F>
          <<<grid, kVecThreads, 0, as_stream(stream)>>>(dev(x), rows, cols, tile_rows, amax, q, qt, dequant);
    } else {
      fp8_cast_kernel<D, F><<<grid, dim3(kTile, kTileRows), 0, as_stream(stream)>>>(dev(x), rows, cols, tile_rows,
                                                                                   amax, q, qt, dequant);
    }
  };
  if (format == Fp8Format::e4m3) {
    launch(std::integral_constant<Fp8Format, Fp8Format::e4m3>{});
  } else {
    launch(std::integral_constant<Fp8Format, Fp8Format::e5m2>{});
  }
  FLASHLM_CUDA_CHECK(cudaGetLastError(), packed ? "fp8_cast_packed_kernel" : "fp8_cast_kernel");
}

template <class T>
void fp8_quantize(const T* x, int64_t rows, int64_t cols, Fp8Format format, uint8_t* q, uint8_t* qt, float* scales,
                  void* stream) {
  FLASHLM_CHECK(rows >= 1 && cols >= 1, "fp8_quantize: rows = {}, cols = {}, expected >= 1", rows, cols);
  fp8_amax(x, rows * cols, scales + kFp8AmaxIndex, stream);
  fp8_cast(x, rows, cols, scales + kFp8AmaxIndex, format, q, qt, scales + kFp8DequantIndex, stream);
}

#define FLASHLM_FP8_INSTANTIATE(T)                                                                          \
  template void fp8_amax<T>(const T*, int64_t, float*, void*);                                             \
  template void fp8_cast<T>(const T*, int64_t, int64_t, const float*, Fp8Format, uint8_t*, uint8_t*, float*, \
                            void*);                                                                         \
  template void fp8_quantize<T>(const T*, int64_t, int64_t, Fp8Format, uint8_t*, uint8_t*, float*, void*);

FLASHLM_FP8_INSTANTIATE(float)
FLASHLM_FP8_INSTANTIATE(bf16_t)

#undef FLASHLM_FP8_INSTANTIATE

}  // namespace flashlm::gpu
