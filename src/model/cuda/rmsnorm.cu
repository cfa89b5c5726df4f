// RMSNorm on CUDA (model/cuda/ops.h), forward and backward: one warp per row, 8 rows per 256-thread block
// (lanes stride over the row, so any d works); with d % 8 == 0 the rows are read in packs, and the row
// sums still add each lane's elements in the lane-strided order (through a shared-memory stage, below).
// The gain gradient is summed in two deterministic passes: chunks of 64 rows (more past 64 Ki rows, at
// most 1024 chunks; one thread per column, rows in order) into a scratch [chunks, d], in the same launch
// as dx, then 8 interleaved chunk sums per column added in a fixed order.
#include "core/cuda/kernels.cuh"
#include "core/cuda/programmatic_launch.cuh"
#include "core/cuda_check.h"
#include "model/cuda/amax.cuh"
#include "flashlm/memory.h"
#include "model/cuda/ops.h"

namespace flashlm::gpu {

namespace {

constexpr int kNormRows = 8;                      // rows (warps) per block
constexpr int kNormThreads = 32 * kNormRows;
constexpr int kStageWords = 128;                  // 16-byte words of a row span staged per warp (2 KiB)
constexpr int64_t kGainRows = 64;                 // gain gradient: rows per partial sum (at least)
constexpr int64_t kGainMaxChunks = 1024;          // and at most this many partial sums (bounds the scratch)
constexpr int kGainThreads = 256;                 // columns per block of the partial sums
constexpr int kGainBatch = 16;                    // rows whose loads a thread issues together
constexpr int kColumnThreads = 256;               // chunk-sum kernel: 32 columns x 8 chunk lanes

// RMSNorm, one warp per row. PACKED (the host's choice: d % kPack == 0 and every pointer 16-byte aligned)
// only changes how the row is read. A row sum keeps the plain lane-strided order either way (lane l adds
// elements l, l + 32, l + 64, ... in turn, then warp_sum): the packed path copies the row, one span of at
// most 2 KiB at a time, into the warp's shared-memory stage with coalesced 16-byte loads, and each lane
// then reads its strided elements back from the stage. The elementwise writes have no order to keep:
// lane l takes the packs [8l + 256m, +8).

template <class D>
constexpr int kStageElements = kStageWords * 16 / int(sizeof(D));  // elements per staged span

// Copies elements [begin, begin + count) of each of the A rows (count · sizeof(D) a multiple of 16, at
// most 2 KiB; rows + begin 16-byte aligned) into this warp's stage[a], all loads issued before the first
// store, and waits until the whole warp has written them.
template <int A, class D>
__device__ __forceinline__ void stage_span(const D* const (&rows)[A], int begin, int count,
                                           uint4 (*stage)[kStageWords]) {
  constexpr int kPerLane = kStageWords / 32;
  const int lane = threadIdx.x % 32, words = count * int(sizeof(D)) / 16;
  uint4 w[A][kPerLane];
#pragma unroll
  for (int a = 0; a < A; ++a) {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      if (lane + 32 * k < words) w[a][k] = reinterpret_cast<const uint4*>(rows[a] + begin)[lane + 32 * k];
    }
  }
#pragma unroll
  for (int a = 0; a < A; ++a) {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      if (lane + 32 * k < words) stage[a][lane + 32 * k] = w[a][k];
    }
  }
  __syncwarp();
}

// AMAX: also y's amax for FP8 training, one atomic per warp (model/cuda/amax.cuh).
template <bool PACKED, bool AMAX, class D>
__global__ void __launch_bounds__(kNormThreads)
    rmsnorm_forward_kernel(const D* __restrict__ x, const float* __restrict__ gain, D* __restrict__ y,
                           float* __restrict__ rstd, int64_t n, int d, float eps, uint32_t* __restrict__ y_amax) {
  allow_dependent_launch();  // FP8 training casts the result next (programmatically)
  const int64_t row = int64_t{blockIdx.x} * kNormRows + threadIdx.x / 32;
  if (row >= n) return;  // the whole warp leaves together
  const int lane = threadIdx.x % 32;
  const D* xr = x + row * d;
  float ss = 0.f;
  const auto add_square = [&](D xj) {
    const float v = f32(xj);
    ss += v * v;
  };
  if constexpr (PACKED) {
    __shared__ uint4 stage[kNormRows][1][kStageWords];
    uint4 (*own)[kStageWords] = stage[threadIdx.x / 32];
    const D* xs = reinterpret_cast<const D*>(own[0]);
    for (int begin = 0; begin < d; begin += kStageElements<D>) {
      const int count = min(d - begin, kStageElements<D>);
      stage_span({xr}, begin, count, own);
      for (int j = lane; j < count; j += 32) add_square(xs[j]);
      __syncwarp();  // the next span overwrites the stage
    }
  } else {
    for (int j = lane; j < d; j += 32) add_square(xr[j]);
  }
  ss = warp_sum(ss);
  const float s = 1.0f / sqrtf(ss / float(d) + eps);
  if (lane == 0) rstd[row] = s;
  D* yr = y + row * d;
  constexpr int W = PACKED ? kPack : 1;
  uint32_t best = 0;
  for (int j = W * lane; j < d; j += 32 * W) {
    const Vec<D, W> xv = load<W>(xr + j);
    const Vec<float, W> gv = load<W>(gain + j);
    Vec<D, W> yv;
#pragma unroll
    for (int k = 0; k < W; ++k) yv[k] = from_f32<D>(f32(xv[k]) * s * gv[k]);
    store(yr + j, yv);
    if constexpr (AMAX) {
#pragma unroll
      for (int k = 0; k < W; ++k) best = max(best, magnitude_bits(f32(yv[k])));
    }
  }
  if constexpr (AMAX) {
    best = warp_max_bits(best);
    if (lane == 0) atomicMax(y_amax, best);
  }
}

// dx_j += s g_j dy_j - x_j s³ (Σ_k dy_k g_k x_k) / d, one warp per row: rows [8 block, +8) of a block.
// AMAX: also the amax of dx as stored (the residual gradient, the next FP8 product's dy), one atomic per warp.
template <bool PACKED, bool AMAX, class D>
__device__ __forceinline__ void backward_dx_rows(const D* __restrict__ dy, const D* __restrict__ x,
                                                 const float* __restrict__ gain, const float* __restrict__ rstd,
                                                 D* __restrict__ dx, int64_t n, int d, int64_t block,
                                                 uint32_t* __restrict__ dx_amax) {
  const int64_t row = block * kNormRows + threadIdx.x / 32;
  if (row >= n) return;
  const int lane = threadIdx.x % 32;
  const D* dyr = dy + row * d;
  const D* xr = x + row * d;
  D* dxr = dx + row * d;
  float dot = 0.f;
  const auto add_product = [&](int j, D dyj, D xj) { dot += f32(dyj) * gain[j] * f32(xj); };
  if constexpr (PACKED) {
    __shared__ uint4 stage[kNormRows][2][kStageWords];
    uint4 (*own)[kStageWords] = stage[threadIdx.x / 32];
    const D* dys = reinterpret_cast<const D*>(own[0]);
    const D* xs = reinterpret_cast<const D*>(own[1]);
    for (int begin = 0; begin < d; begin += kStageElements<D>) {
      const int count = min(d - begin, kStageElements<D>);
      stage_span({dyr, xr}, begin, count, own);
      for (int j = lane; j < count; j += 32) add_product(begin + j, dys[j], xs[j]);
      __syncwarp();  // the next span overwrites the stage
    }
  } else {
    for (int j = lane; j < d; j += 32) add_product(j, dyr[j], xr[j]);
  }
  dot = warp_sum(dot);
  const float s = rstd[row];
  const float c = dot * s * s * s / float(d);
  constexpr int W = PACKED ? kPack : 1;
  uint32_t best = 0;
  for (int j = W * lane; j < d; j += 32 * W) {
    Vec<D, W> dxv = load<W>(dxr + j);
    const Vec<D, W> dyv = load<W>(dyr + j), xv = load<W>(xr + j);
    const Vec<float, W> gv = load<W>(gain + j);
#pragma unroll
    for (int k = 0; k < W; ++k) dxv[k] = from_f32<D>(f32(dxv[k]) + (s * gv[k] * f32(dyv[k]) - f32(xv[k]) * c));
    store(dxr + j, dxv);
    if constexpr (AMAX) {
#pragma unroll
      for (int k = 0; k < W; ++k) best = max(best, magnitude_bits(f32(dxv[k])));
    }
  }
  if constexpr (AMAX) {
    best = warp_max_bits(best);
    if (lane == 0) atomicMax(dx_amax, best);
  }
}

// partial[c, j] = Σ over the rows r of chunk c (chunk_rows rows, in order) of dy[r, j] x[r, j] rstd[r],
// for the kGainThreads columns of column block `column_block`.
template <class D>
__device__ __forceinline__ void gain_partials(const D* __restrict__ dy, const D* __restrict__ x,
                                              const float* __restrict__ rstd, float* __restrict__ partial, int64_t n,
                                              int d, int64_t chunk_rows, int64_t column_block, int64_t c) {
  const int j = int(column_block) * kGainThreads + int(threadIdx.x);
  if (j >= d) return;
  const int64_t r0 = c * chunk_rows, r1 = min(n, r0 + chunk_rows);
  // Each row's term rounded as (dy·x)·rstd fused into the sum (the contraction nvcc makes of
  // `acc += dy * x * rstd`, written out so that the order is this file's, not the compiler's), rows in
  // order. The loads of kGainBatch rows are issued before their terms are added: one row at a time left
  // each thread one load in flight (docs/perf.md, the xl step).
  const auto term = [](float acc, D dyv, D xv, float s) { return __fmaf_rn(__fmul_rn(f32(dyv), f32(xv)), s, acc); };
  float acc = 0.f;
  int64_t r = r0;
  for (; r + kGainBatch <= r1; r += kGainBatch) {
    D dyv[kGainBatch], xv[kGainBatch];
    float sv[kGainBatch];
#pragma unroll
    for (int k = 0; k < kGainBatch; ++k) {
      dyv[k] = dy[(r + k) * d + j];
      xv[k] = x[(r + k) * d + j];
      sv[k] = rstd[r + k];
    }
#pragma unroll
    for (int k = 0; k < kGainBatch; ++k) acc = term(acc, dyv[k], xv[k], sv[k]);
  }
  for (; r < r1; ++r) acc = term(acc, dy[r * d + j], x[r * d + j], rstd[r]);
  partial[c * d + j] = acc;
}

// The backward's two independent parts in one launch: blocks [0, dx_blocks) compute dx (8 rows each), the
// others one (column block, chunk) of the gain partials each. Both read dy and x and write different
// arrays, so they run side by side instead of one kernel after the other (at xl's 2048 rows each alone
// holds about a quarter of an H200's warp slots).
template <bool PACKED, bool AMAX, class D>
__global__ void __launch_bounds__(kNormThreads)
    rmsnorm_backward_kernel(const D* __restrict__ dy, const D* __restrict__ x, const float* __restrict__ gain,
                            const float* __restrict__ rstd, D* __restrict__ dx, float* __restrict__ partial, int64_t n,
                            int d, int64_t dx_blocks, int64_t column_blocks, int64_t chunk_rows,
                            uint32_t* __restrict__ dx_amax) {
  static_assert(kGainThreads == kNormThreads, "one block size for both parts");
  allow_dependent_launch();  // FP8 training casts the result next (programmatically)
  const int64_t block = blockIdx.x;
  if (block < dx_blocks) {
    backward_dx_rows<PACKED, AMAX>(dy, x, gain, rstd, dx, n, d, block, dx_amax);
  } else {
    const int64_t b = block - dx_blocks;
    gain_partials(dy, x, rstd, partial, n, d, chunk_rows, b % column_blocks, b / column_blocks);
  }
}

// out[j] += Σ_c partial[c, j]: chunk lane t (of 8) sums chunks t, t + 8, ... in order, then lane 0 adds
// the 8 lane sums in order. Grid: ceil(d / 32).
__global__ void __launch_bounds__(kColumnThreads)
    add_column_sums_kernel(const float* __restrict__ partial, int64_t chunks, int d, float* __restrict__ out) {
  constexpr int kLanes = kColumnThreads / 32;
  __shared__ float lane_sum[kLanes][33];
  const int tx = int(threadIdx.x) % 32, ty = int(threadIdx.x) / 32;
  const int j = int(blockIdx.x) * 32 + tx;
  float acc = 0.f;
  if (j < d) {
    for (int64_t c = ty; c < chunks; c += kLanes) acc += partial[c * d + j];
  }
  lane_sum[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && j < d) {
    float total = lane_sum[0][tx];
    for (int t = 1; t < kLanes; ++t) total += lane_sum[t][tx];
    out[j] += total;
  }
}

// Both passes' checks of n rows of width d, and their grid: one block per kNormRows rows.
int64_t checked_norm_blocks(const char* fn, int64_t n, int64_t d) {
  check_count(fn, "n", n);
  check_width(fn, "d", d);
  const int64_t blocks = ceil_div(n, kNormRows);
  FLASHLM_CHECK(blocks <= INT_MAX, "{}: n = {} is too large", fn, n);
  return blocks;
}

}  // namespace

template <class T>
void rmsnorm_forward(const T* x, const float* gain, T* y, float* rstd, int64_t n, int64_t d, float eps, void* stream,
                     float* y_amax) {
  const int64_t blocks = checked_norm_blocks("rmsnorm_forward", n, d);
  const cudaStream_t s = as_stream(stream);
  if (y_amax) clear_amax(y_amax, s);
  if (n == 0) return;
  auto* amax_bits = reinterpret_cast<uint32_t*>(y_amax);
  const auto launch = [&](auto packed) {
    constexpr bool P = decltype(packed)::value;
    if (y_amax) {
      rmsnorm_forward_kernel<P, true>
          <<<unsigned(blocks), kNormThreads, 0, s>>>(dev(x), gain, dev(y), rstd, n, int(d), eps, amax_bits);
    } else {
      rmsnorm_forward_kernel<P, false>
          <<<unsigned(blocks), kNormThreads, 0, s>>>(dev(x), gain, dev(y), rstd, n, int(d), eps, nullptr);
    }
  };
  if (d % kPack == 0 && aligned16(x) && aligned16(gain) && aligned16(y)) {
    launch(std::true_type{});
  } else {
    launch(std::false_type{});
  }
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "rmsnorm_forward_kernel");
}

template <class T>
void rmsnorm_backward(const T* dy, const T* x, const float* gain, const float* rstd, T* dx, float* dgain, int64_t n,
                      int64_t d, void* stream, float* dx_amax) {
  const int64_t blocks = checked_norm_blocks("rmsnorm_backward", n, d);
  const cudaStream_t s = as_stream(stream);
  if (dx_amax) clear_amax(dx_amax, s);
  if (n == 0) return;

  // dgain's partials beside dx (they read dy, x and rstd only): chunks of rows fixed by n alone (64 rows,
  // more when n exceeds 64 Ki rows so that there are at most 1024 chunks), then the chunks summed in a
  // fixed order.
  const int64_t chunk_rows = std::max(kGainRows, ceil_div(n, kGainMaxChunks));
  const int64_t chunks = ceil_div(n, chunk_rows);  // <= kGainMaxChunks
  Buffer scratch = Buffer::allocate_on_stream(size_t(chunks) * size_t(d) * sizeof(float),
                                              "rmsnorm_backward gain partials", stream);
  float* partial = static_cast<float*>(scratch.data());
  const int64_t column_blocks = ceil_div(d, kGainThreads);
  const int64_t grid = blocks + column_blocks * chunks;
  FLASHLM_CHECK(grid <= INT_MAX, "rmsnorm_backward: n = {}, d = {} is too large", n, d);
  auto* amax_bits = reinterpret_cast<uint32_t*>(dx_amax);
  const auto launch = [&](auto packed, auto amax) {
    rmsnorm_backward_kernel<decltype(packed)::value, decltype(amax)::value>
        <<<unsigned(grid), kNormThreads, 0, s>>>(dev(dy), dev(x), gain, rstd, dev(dx), partial, n, int(d), blocks,
                                                 column_blocks, chunk_rows, amax_bits);
  };
  const auto with_amax = [&](auto packed) {
    if (dx_amax) {
      launch(packed, std::true_type{});
    } else {
      launch(packed, std::false_type{});
    }
  };
  if (d % kPack == 0 && aligned16(dy) && aligned16(x) && aligned16(gain) && aligned16(dx)) {
    with_amax(std::true_type{});
  } else {
    with_amax(std::false_type{});
  }
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "rmsnorm_backward_kernel");
  add_column_sums_kernel<<<unsigned(ceil_div(d, 32)), kColumnThreads, 0, s>>>(partial, chunks, int(d), dgain);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "add_column_sums_kernel");
}

#define FLASHLM_RMSNORM_INSTANTIATE(T) \
  template void rmsnorm_forward<T>(const T*, const float*, T*, float*, int64_t, int64_t, float, void*, float*);  \
  template void rmsnorm_backward<T>(const T*, const T*, const float*, const float*, T*, float*, int64_t, int64_t, \
                                    void*, float*);

FLASHLM_RMSNORM_INSTANTIATE(float)
FLASHLM_RMSNORM_INSTANTIATE(bf16_t)
FLASHLM_RMSNORM_INSTANTIATE(fp16_t)

#undef FLASHLM_RMSNORM_INSTANTIATE

}  // namespace flashlm::gpu
