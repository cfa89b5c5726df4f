// FP8 training's casts on CUDA (model/cuda/fp8.h): the amax reductions (tensorwise, and per row and column for
// rowwise) and the cast with its transposed copy, scaled per tensor or per row and column.
#include <cuda_fp8.h>

#include "core/cuda/kernels.cuh"
#include "core/cuda/programmatic_launch.cuh"
#include "core/cuda_check.h"
#include "model/cuda/amax.cuh"
#include "model/cuda/fp8.h"
#include "model/cuda/fp8_device.cuh"
#include "model/fp8.h"

namespace flashlm::gpu {

namespace {

// 16-byte loads where x is aligned (for_each_pack): scalar 2-byte loads left this reduction at about a
// third of the memory bandwidth.
template <class D>
__global__ void __launch_bounds__(kThreads) fp8_amax_kernel(const D* __restrict__ x, int64_t count, int64_t packs,
                                                            uint32_t* __restrict__ amax_bits) {
  allow_dependent_launch();  // the cast that reads this amax is launched programmatically
  uint32_t best = 0;
  for_each_pack(count, packs, [&](auto width, int64_t i) {
    constexpr int N = decltype(width)::value;
    const Vec<D, N> v = load<N>(x + i);
#pragma unroll
    for (int k = 0; k < N; ++k) best = max(best, magnitude_bits(f32(v[k])));
  });
  block_amax_to<kThreads>(amax_bits, best);
}

// fp8_amax_segments: block b reduces chunk b − first_chunk of the segment whose chunks hold b (a binary search
// over the segments' first chunks), with 16-byte loads where the segment is aligned, and adds its largest
// magnitude to the segment's amax with one atomic.
__global__ void __launch_bounds__(kThreads)
    fp8_amax_segments_kernel(const Fp8AmaxSegment* __restrict__ segments, int n) {
  int lo = 0, hi = n - 1;
  const int64_t b = blockIdx.x;
  while (lo < hi) {  // the last segment whose first chunk is <= b
    const int mid = (lo + hi + 1) / 2;
    if (segments[mid].first_chunk <= b) lo = mid; else hi = mid - 1;
  }
  const Fp8AmaxSegment s = segments[lo];
  const int64_t begin = (b - s.first_chunk) * kFp8AmaxChunk;
  const int64_t count = min(kFp8AmaxChunk, s.count - begin);
  const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(s.x) + begin;
  uint32_t best = 0;
  // begin is a multiple of kPack, so x is as aligned as the segment.
  const int64_t packs = reinterpret_cast<uintptr_t>(x) % 16 == 0 ? count / kPack : 0;
  for (int64_t q = threadIdx.x; q < packs; q += kThreads) {
    const Vec<__nv_bfloat16, kPack> v = load<kPack>(x + q * kPack);
#pragma unroll
    for (int k = 0; k < kPack; ++k) best = max(best, magnitude_bits(f32(v[k])));
  }
  for (int64_t i = packs * kPack + threadIdx.x; i < count; i += kThreads) best = max(best, magnitude_bits(f32(x[i])));
  block_amax_to<kThreads>(reinterpret_cast<uint32_t*>(s.amax), best);
}

// Rowwise: the largest |x| of every row and every column of x [rows, cols], one kAmaxTile-column strip per
// blockIdx.x, grid-striding over its tile rows. Each warp reads 32 consecutive elements of a row and adds their
// maximum to the row's amax (one atomic); each thread keeps its column's maximum over every row it reads, and
// the block adds it to the column's amax (one atomic per column) at the end. Integer atomics on the magnitudes'
// bits, as fp8_amax: order-independent, NaN above infinity.
constexpr int kAmaxTile = 64;                       // columns per block
constexpr int kAmaxGroups = kThreads / kAmaxTile;   // rows read at once

template <class D>
__global__ void __launch_bounds__(kThreads)
    fp8_amax_rows_cols_kernel(const D* __restrict__ x, int64_t rows, int64_t cols, uint32_t* __restrict__ row_bits,
                              uint32_t* __restrict__ col_bits) {
  __shared__ uint32_t col_best[kAmaxGroups][kAmaxTile];
  const int lane = threadIdx.x % kAmaxTile, group = threadIdx.x / kAmaxTile;
  const int64_t c = int64_t{blockIdx.x} * kAmaxTile + lane;
  uint32_t col = 0;
  for (int64_t r = int64_t{blockIdx.y} * kAmaxGroups + group; r < rows; r += int64_t{gridDim.y} * kAmaxGroups) {
    const uint32_t v = c < cols ? magnitude_bits(f32(x[r * cols + c])) : 0;
    col = max(col, v);
    const uint32_t row = warp_max_bits(v);  // uniform over the warp: r is the same for its 32 lanes
    if (threadIdx.x % 32 == 0) atomicMax(row_bits + r, row);
  }
  col_best[group][lane] = col;
  __syncthreads();
  if (group == 0 && c < cols) {
    for (int g = 1; g < kAmaxGroups; ++g) col = max(col, col_best[g][lane]);
    atomicMax(col_bits + c, col);
  }
}

constexpr unsigned kAmaxBlocks = 1024;
constexpr int kTile = 32;      // the cast's tile: kTile × kTile elements
constexpr int kTileRows = 8;   // threads per tile column: the block is kTile × kTileRows

// Where a cast reads its amaxes and writes its dequantisation scales. Tensorwise: amax and dequant, one float
// each. Rowwise: row_amax and row_dequant, one per row of x (q's scales), and col_amax and col_dequant, one
// per column (qt's); those of a copy not written are not read.
struct CastScales {
  const float* amax = nullptr;
  float* dequant = nullptr;
  const float* row_amax = nullptr;
  const float* col_amax = nullptr;
  float* row_dequant = nullptr;
  float* col_dequant = nullptr;
};

// Rowwise: a tile's scales in shared memory, so that each is computed once per tile rather than per element.
// The column scales (qt's) are the same for every tile row of a block: computed once, before its first tile,
// and their dequantisation scales written by the blocks of the first tile row; the row scales (q's) per tile,
// their dequantisation scales written by the blocks of the first tile column. The caller synchronises before
// reading them. Thread t of the loading row takes the scale of row or column i0 + t (of n) from its amax, and
// writes its dequantisation scale too where `write_dequant`.
template <Fp8Format F>
__device__ __forceinline__ void load_tile_scales(const float* amax, float* dequant, int64_t i0, int64_t n, int t,
                                                 int tile, bool write_dequant, float* scale) {
  const int64_t i = i0 + t;
  if (t < tile && i < n) {
    scale[t] = fp8_scale(amax[i], F);
    if (write_dequant) dequant[i] = fp8_dequant_scale(scale[t]);
  }
}

// One block per kTile × kTile tile (grid-striding over tile rows past the grid's): each element scaled and
// rounded once (rowwise: once per copy, each with its own scale), written straight (coalesced along cols)
// and, through shared memory, transposed (coalesced along rows).
template <class D, Fp8Format F, bool kRowwise>
__global__ void __launch_bounds__(kTile* kTileRows)
    fp8_cast_kernel(const D* __restrict__ x, int64_t rows, int64_t cols, int64_t tile_rows, CastScales s,
                    uint8_t* __restrict__ q, uint8_t* __restrict__ qt) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  __shared__ float row_scale[kRowwise ? kTile : 1], col_scale[kRowwise ? kTile : 1];
  wait_for_prerequisite_grids();  // launched programmatically, as the packed kernel below
  allow_dependent_launch();
  const int64_t c0 = int64_t{blockIdx.x} * kTile;
  float scale = 0.0f;
  if constexpr (kRowwise) {
    if (qt && threadIdx.y == 0) {
      load_tile_scales<F>(s.col_amax, s.col_dequant, c0, cols, threadIdx.x, kTile, blockIdx.y == 0, col_scale);
    }
  } else {
    scale = fp8_scale(*s.amax, F);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) *s.dequant = fp8_dequant_scale(scale);
  }
  for (int64_t tr = blockIdx.y; tr < tile_rows; tr += gridDim.y) {
    const int64_t r0 = tr * kTile;
    if constexpr (kRowwise) {
      if (q && threadIdx.y == 0) {
        load_tile_scales<F>(s.row_amax, s.row_dequant, r0, rows, threadIdx.x, kTile, blockIdx.x == 0, row_scale);
      }
      __syncthreads();
    }
    for (int i = threadIdx.y; i < kTile; i += kTileRows) {
      const int64_t r = r0 + i, c = c0 + threadIdx.x;
      if (r < rows && c < cols) {
        if constexpr (kRowwise) {
          const float v = f32(x[r * cols + c]);
          if (q) q[r * cols + c] = fp8_encode<F>(v * row_scale[i]);
          if (qt) tile[i][threadIdx.x] = fp8_encode<F>(v * col_scale[threadIdx.x]);
        } else {
          const uint8_t v = fp8_encode<F>(f32(x[r * cols + c]) * scale);
          if (q) q[r * cols + c] = v;
          tile[i][threadIdx.x] = v;
        }
      }
    }
    if (!qt) {  // uniform over the block
      if constexpr (kRowwise) __syncthreads();  // row_scale is rewritten by the next tile row
      continue;
    }
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
// (kVecTile, kVecThreads and kVecTileStride: model/cuda/fp8_device.cuh, the tile AdamW's weight copies share.)

template <class D, Fp8Format F, bool kRowwise>
__global__ void __launch_bounds__(kVecThreads)
    fp8_cast_packed_kernel(const D* __restrict__ x, int64_t rows, int64_t cols, int64_t tile_rows, CastScales s,
                           uint8_t* __restrict__ q, uint8_t* __restrict__ qt) {
  __shared__ __align__(16) uint8_t tile[kVecTile * kVecTileStride];
  __shared__ float row_scale[kRowwise ? kVecTile : 1], col_scale[kRowwise ? kVecTile : 1];
  wait_for_prerequisite_grids();  // launched programmatically: x and its amax come from the kernel before
  allow_dependent_launch();
  const int64_t c0 = int64_t{blockIdx.x} * kVecTile;
  float scale = 0.0f;
  if constexpr (kRowwise) {
    if (qt) {
      load_tile_scales<F>(s.col_amax, s.col_dequant, c0, cols, threadIdx.x, kVecTile, blockIdx.y == 0, col_scale);
    }
  } else {
    scale = fp8_scale(*s.amax, F);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *s.dequant = fp8_dequant_scale(scale);
  }
  constexpr int kPacksPerRow = kVecTile / kPack;
  for (int64_t tr = blockIdx.y; tr < tile_rows; tr += gridDim.y) {
    const int64_t r0 = tr * kVecTile;
    if constexpr (kRowwise) {
      if (q) {
        load_tile_scales<F>(s.row_amax, s.row_dequant, r0, rows, threadIdx.x, kVecTile, blockIdx.x == 0, row_scale);
      }
      __syncthreads();
    }
    for (int v = threadIdx.x; v < kVecTile * kPacksPerRow; v += kVecThreads) {
      const int i = v / kPacksPerRow, j = (v % kPacksPerRow) * kPack;
      const int64_t r = r0 + i, c = c0 + j;
      if (r < rows && c < cols) {
        const Vec<D, kPack> in = load<kPack>(x + r * cols + c);
        uint32_t word[2] = {0, 0};
        if constexpr (kRowwise) {
          // Two copies, two scales: q's word by the row's, the tile's (qt's) by each column's.
          uint32_t word_t[2] = {0, 0};
          const float rs = q ? row_scale[i] : 0.0f;
#pragma unroll
          for (int k = 0; k < kPack; ++k) {
            const float e = f32(in[k]);
            if (q) word[k / 4] |= uint32_t{fp8_encode<F>(e * rs)} << (8 * (k % 4));
            if (qt) word_t[k / 4] |= uint32_t{fp8_encode<F>(e * col_scale[j + k])} << (8 * (k % 4));
          }
          if (q) *reinterpret_cast<uint2*>(q + r * cols + c) = make_uint2(word[0], word[1]);
          put_tile_pack(tile, i, j, word_t);
        } else {
#pragma unroll
          for (int k = 0; k < kPack; ++k) word[k / 4] |= uint32_t{fp8_encode<F>(f32(in[k]) * scale)} << (8 * (k % 4));
          if (q) *reinterpret_cast<uint2*>(q + r * cols + c) = make_uint2(word[0], word[1]);
          put_tile_pack(tile, i, j, word);
        }
      }
    }
    if (!qt) {  // uniform over the block
      if constexpr (kRowwise) __syncthreads();  // row_scale is rewritten by the next tile row
      continue;
    }
    __syncthreads();
    write_transposed_tile(tile, r0, c0, rows, cols, qt);
    __syncthreads();  // the tile is rewritten by the next tile row
  }
}

// The launch both casts share: the packed kernel where the sizes and pointers allow, else the byte-wide one.
template <bool kRowwise, class T>
void launch_cast(const char* fn, const T* x, int64_t rows, int64_t cols, const CastScales& scales, Fp8Format format,
                 uint8_t* q, uint8_t* qt, void* stream) {
  FLASHLM_CHECK(rows >= 1 && cols >= 1, "{}: rows = {}, cols = {}, expected >= 1", fn, rows, cols);
  FLASHLM_CHECK(rows <= (int64_t{1} << 40) / cols, "{}: {} × {} elements: too many", fn, rows, cols);
  FLASHLM_CHECK(q || qt, "{}: q and qt are both null: nothing to write", fn);
  using D = std::remove_const_t<std::remove_pointer_t<decltype(dev(x))>>;
  const auto aligned8 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; };
  const bool packed =
      rows % kPack == 0 && cols % kPack == 0 && aligned16(x) && (!q || aligned8(q)) && (!qt || aligned8(qt));
  const int tile = packed ? kVecTile : kTile;
  const int64_t tile_cols = ceil_div(cols, tile), tile_rows = ceil_div(rows, tile);
  FLASHLM_CHECK(tile_cols <= INT32_MAX, "{}: cols = {}: too many", fn, cols);
  const dim3 grid(unsigned(tile_cols), unsigned(std::min<int64_t>(tile_rows, 65535)));
  const auto launch = [&](auto format_constant) {
    constexpr Fp8Format F = decltype(format_constant)::value;
    // Programmatic: a cast follows its producer (a norm, the SwiGLU, an amax reduction, another cast), which lets
    // it be placed early; at training sizes a cast is a few microseconds of bytes, so its launch gap counts.
    if (packed) {
      launch_programmatic("fp8_cast_packed_kernel", fp8_cast_packed_kernel<D, F, kRowwise>, grid, dim3(kVecThreads),
                          0, as_stream(stream), dev(x), rows, cols, tile_rows, scales, q, qt);
    } else {
      launch_programmatic("fp8_cast_kernel", fp8_cast_kernel<D, F, kRowwise>, grid, dim3(kTile, kTileRows), 0,
                          as_stream(stream), dev(x), rows, cols, tile_rows, scales, q, qt);
    }
  };
  if (format == Fp8Format::e4m3) {
    launch(std::integral_constant<Fp8Format, Fp8Format::e4m3>{});
  } else {
    launch(std::integral_constant<Fp8Format, Fp8Format::e5m2>{});
  }
}

__global__ void fp8_scales_from_amaxes_kernel(const float* __restrict__ amaxes, int64_t count, int64_t stride,
                                              Fp8Format format, float* __restrict__ scales) {
  uint32_t best = 0;
  for (int64_t i = 0; i < count; ++i) best = max(best, magnitude_bits(amaxes[i * stride]));
  const float amax = __uint_as_float(best);
  scales[kFp8AmaxIndex] = amax;
  scales[kFp8DequantIndex] = fp8_dequant_scale(fp8_scale(amax, format));
}

// One block per kTile × kTile tile (grid-striding over tile rows past the grid's), through shared memory so
// that both the reads (along cols) and the writes (along rows) are coalesced.
__global__ void __launch_bounds__(kTile* kTileRows)
    fp8_transpose_kernel(const uint8_t* __restrict__ q, int64_t rows, int64_t cols, int64_t tile_rows,
                         uint8_t* __restrict__ qt) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  const int64_t c0 = int64_t{blockIdx.x} * kTile;
  for (int64_t tr = blockIdx.y; tr < tile_rows; tr += gridDim.y) {
    const int64_t r0 = tr * kTile;
    for (int i = threadIdx.y; i < kTile; i += kTileRows) {
      const int64_t r = r0 + i, c = c0 + threadIdx.x;
      if (r < rows && c < cols) tile[i][threadIdx.x] = q[r * cols + c];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < kTile; i += kTileRows) {
      const int64_t c = c0 + i, r = r0 + threadIdx.x;
      if (r < rows && c < cols) qt[c * rows + r] = tile[threadIdx.x][i];
    }
    __syncthreads();  // the tile is rewritten by the next tile row
  }
}

}  // namespace

void fp8_scales_from_amaxes(const float* amaxes, int64_t count, int64_t stride, Fp8Format format, float* scales,
                            void* stream) {
  FLASHLM_CHECK(count >= 1 && stride >= 1, "fp8_scales_from_amaxes: {} amaxes {} apart, expected >= 1 each", count,
                stride);
  FLASHLM_CHECK(amaxes && scales, "fp8_scales_from_amaxes: amaxes and scales must not be null");
  fp8_scales_from_amaxes_kernel<<<1, 1, 0, as_stream(stream)>>>(amaxes, count, stride, format, scales);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "fp8_scales_from_amaxes_kernel");
}

void fp8_transpose(const uint8_t* q, int64_t rows, int64_t cols, uint8_t* qt, void* stream) {
  FLASHLM_CHECK(rows >= 1 && cols >= 1, "fp8_transpose: rows = {}, cols = {}, expected >= 1", rows, cols);
  FLASHLM_CHECK(q && qt, "fp8_transpose: q and qt must not be null");
  const int64_t tile_cols = ceil_div(cols, int64_t{kTile}), tile_rows = ceil_div(rows, int64_t{kTile});
  FLASHLM_CHECK(tile_cols <= INT32_MAX, "fp8_transpose: cols = {}: too many", cols);
  const dim3 grid(unsigned(tile_cols), unsigned(std::min<int64_t>(tile_rows, 65535)));
  fp8_transpose_kernel<<<grid, dim3(kTile, kTileRows), 0, as_stream(stream)>>>(q, rows, cols, tile_rows, qt);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "fp8_transpose_kernel");
}

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

void fp8_amax_segments(const Fp8AmaxSegment* segments, int n, int64_t chunks, void* stream) {
  FLASHLM_CHECK(segments != nullptr && n >= 1, "fp8_amax_segments: {} segments{}, expected >= 1 and a table", n,
                segments ? "" : " (null)");
  FLASHLM_CHECK(chunks >= 1 && chunks <= INT32_MAX, "fp8_amax_segments: {} chunks, expected 1 to 2^31 - 1", chunks);
  fp8_amax_segments_kernel<<<unsigned(chunks), kThreads, 0, as_stream(stream)>>>(segments, n);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "fp8_amax_segments_kernel");
}

template <class T>
void fp8_cast(const T* x, int64_t rows, int64_t cols, const float* amax, Fp8Format format, uint8_t* q, uint8_t* qt,
              float* dequant, void* stream) {
  FLASHLM_CHECK(x && amax && dequant, "fp8_cast: x, amax and dequant must not be null");
  CastScales scales;
  scales.amax = amax;
  scales.dequant = dequant;
  launch_cast<false>("fp8_cast", x, rows, cols, scales, format, q, qt, stream);
}

template <class T>
void fp8_amax_rows_cols(const T* x, int64_t rows, int64_t cols, float* row_amax, float* col_amax, void* stream) {
  FLASHLM_CHECK(rows >= 1 && cols >= 1, "fp8_amax_rows_cols: rows = {}, cols = {}, expected >= 1", rows, cols);
  FLASHLM_CHECK(rows <= (int64_t{1} << 40) / cols, "fp8_amax_rows_cols: {} × {} elements: too many", rows, cols);
  FLASHLM_CHECK(x && row_amax && col_amax, "fp8_amax_rows_cols: x, row_amax and col_amax must not be null");
  const cudaStream_t s = as_stream(stream);
  FLASHLM_CUDA_CHECK(cudaMemsetAsync(row_amax, 0, size_t(rows) * sizeof(float), s), "cudaMemsetAsync (row amaxes)");
  FLASHLM_CUDA_CHECK(cudaMemsetAsync(col_amax, 0, size_t(cols) * sizeof(float), s), "cudaMemsetAsync (column amaxes)");
  const int64_t strips = ceil_div(cols, kAmaxTile);
  FLASHLM_CHECK(strips <= INT32_MAX, "fp8_amax_rows_cols: cols = {}: too many", cols);
  // Enough blocks down the rows to fill the GPU; each adds one atomic per column, so not more.
  const unsigned down = unsigned(std::min<int64_t>(ceil_div(rows, kAmaxGroups), std::max<int64_t>(1, 1024 / strips)));
  fp8_amax_rows_cols_kernel<<<dim3(unsigned(strips), std::max(down, 1u)), kThreads, 0, s>>>(
      dev(x), rows, cols, reinterpret_cast<uint32_t*>(row_amax), reinterpret_cast<uint32_t*>(col_amax));
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "fp8_amax_rows_cols_kernel");
}

template <class T>
void fp8_cast_rowwise(const T* x, int64_t rows, int64_t cols, const float* row_amax, const float* col_amax,
                      Fp8Format format, uint8_t* q, uint8_t* qt, float* row_dequant, float* col_dequant, void* stream) {
  FLASHLM_CHECK(x != nullptr, "fp8_cast_rowwise: x is null");
  FLASHLM_CHECK(!q || (row_amax && row_dequant), "fp8_cast_rowwise: q needs row_amax and row_dequant");
  FLASHLM_CHECK(!qt || (col_amax && col_dequant), "fp8_cast_rowwise: qt needs col_amax and col_dequant");
  CastScales scales;
  scales.row_amax = row_amax;
  scales.col_amax = col_amax;
  scales.row_dequant = row_dequant;
  scales.col_dequant = col_dequant;
  launch_cast<true>("fp8_cast_rowwise", x, rows, cols, scales, format, q, qt, stream);
}

template <class T>
void fp8_quantize_rowwise(const T* x, int64_t rows, int64_t cols, Fp8Format format, uint8_t* q, uint8_t* qt,
                          const Fp8ScaleVectors& v, void* stream) {
  fp8_amax_rows_cols(x, rows, cols, v.row_amax, v.col_amax, stream);
  fp8_cast_rowwise(x, rows, cols, v.row_amax, v.col_amax, format, q, qt, v.row_dequant, v.col_dequant, stream);
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
  template void fp8_quantize<T>(const T*, int64_t, int64_t, Fp8Format, uint8_t*, uint8_t*, float*, void*);      \
  template void fp8_amax_rows_cols<T>(const T*, int64_t, int64_t, float*, float*, void*);                   \
  template void fp8_cast_rowwise<T>(const T*, int64_t, int64_t, const float*, const float*, Fp8Format, uint8_t*, \
                                    uint8_t*, float*, float*, void*);                                       \
  template void fp8_quantize_rowwise<T>(const T*, int64_t, int64_t, Fp8Format, uint8_t*, uint8_t*,           \
                                        const Fp8ScaleVectors&, void*);

FLASHLM_FP8_INSTANTIATE(float)
FLASHLM_FP8_INSTANTIATE(bf16_t)

#undef FLASHLM_FP8_INSTANTIATE

}  // namespace flashlm::gpu
