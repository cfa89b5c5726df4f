// Where do FP8 training's casts lose bandwidth, and which kernel shape wins it back? (issue 32)
// The xl step's casts (docs/perf.md, FP8 training) run at 55–80% of the memory bandwidth: the weights' casts
// both ways (w and wᵀ from one read), the activations' one-way casts and the tensorwise amax reduction.
// This A/B times the library's kernels (gpu::fp8_cast, gpu::fp8_amax from libflashlm) against variants on
// the xl shapes, with the L2 flushed before each call (a 256 MiB read), and checks that every variant writes
// the library's bytes exactly. Variants:
//   cast  lib   the library's packed kernel: one 64 × 64 tile per block, a grid of every tile.
//         p64   the same tile, a persistent grid (enough blocks to fill the GPU once) striding over tiles,
//               every load of a tile issued before its first conversion.
//         p128  a 128 × 64 tile (16-byte transposed stores, whole 128-byte rows of qt), persistent, loads first.
//   amax  lib   the library's reduction (≤ 1024 blocks, one 16-byte load per iteration).
//         u4    a persistent grid with four 16-byte loads in flight per thread.
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude -Ibuild-gpu/include \
//     dev/cuda/04_fp8_cast_variants.cu -o build-gpu/dev/fp8_cast_variants -Lbuild-gpu/src -lflashlm
//   LD_LIBRARY_PATH=build-gpu/src build-gpu/dev/fp8_cast_variants
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "core/cuda/kernels.cuh"
#include "model/cuda/amax.cuh"
#include "model/cuda/fp8.h"
#include "model/fp8.h"

using namespace flashlm;
using namespace flashlm::gpu;

#define CK(x)                                                                                          \
  do {                                                                                                 \
    const cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) {                                                                           \
      std::printf("%s:%d: %s -> %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));                \
      std::exit(1);                                                                                    \
    }                                                                                                  \
  } while (0)

namespace {

__device__ __forceinline__ uint8_t encode_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// A persistent cast over kRows × 64 tiles (kRows 64 or 128), 256 threads, each thread kRows / 32 packs of 8
// of the tile loaded before any is converted; the transposed copy through shared memory, 8 (kRows 64) or 16
// (kRows 128) bytes of a qt row per store, gathered from the tile's rows. rows, cols multiples of 8 and pointers aligned (the caller checks).
template <int kRows>
__global__ void __launch_bounds__(256)
    cast_persistent(const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t cols, const float* amax,
                    float* dequant, uint8_t* __restrict__ q, uint8_t* __restrict__ qt) {
  constexpr int kCols = 64, kStride = kCols + 4;  // [row][col], 4-byte aligned rows, 2-way bank conflicts
  constexpr int kPacksPerRow = kCols / 8, kLoads = kRows * kPacksPerRow / 256;
  __shared__ __align__(16) uint8_t tile[kRows * kStride];
  const float scale = fp8_scale(*amax, Fp8Format::e4m3);
  if (blockIdx.x == 0 && threadIdx.x == 0) *dequant = fp8_dequant_scale(scale);
  const int64_t tiles_c = (cols + kCols - 1) / kCols, tiles_r = (rows + kRows - 1) / kRows;
  for (int64_t t = blockIdx.x; t < tiles_c * tiles_r; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * kRows, c0 = (t % tiles_c) * kCols;
    Vec<__nv_bfloat16, 8> in[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int v = threadIdx.x + l * 256, i = v / kPacksPerRow, j = (v % kPacksPerRow) * 8;
      if (r0 + i < rows && c0 + j < cols) in[l] = load<8>(x + (r0 + i) * cols + c0 + j);
    }
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int v = threadIdx.x + l * 256, i = v / kPacksPerRow, j = (v % kPacksPerRow) * 8;
      if (r0 + i < rows && c0 + j < cols) {
        uint8_t b[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) b[k] = encode_e4m3(f32(in[l][k]) * scale);
        if (q) {
          uint2 w;
          std::memcpy(&w, b, 8);
          *reinterpret_cast<uint2*>(q + (r0 + i) * cols + c0 + j) = w;
        }
        std::memcpy(tile + i * kStride + j, b, 4);
        std::memcpy(tile + i * kStride + j + 4, b + 4, 4);
      }
    }
    if (!qt) continue;
    __syncthreads();
    constexpr int kBytes = kRows == 128 ? 16 : 8, kChunks = kRows / kBytes;
    for (int v = threadIdx.x; v < kCols * kChunks; v += 256) {
      const int j = v / kChunks, i = (v % kChunks) * kBytes;
      if (c0 + j < cols && r0 + i < rows) {
        uint32_t w[kBytes / 4] = {};
#pragma unroll
        for (int k = 0; k < kBytes; ++k) w[k / 4] |= uint32_t{tile[(i + k) * kStride + j]} << (8 * (k % 4));
        if constexpr (kBytes == 16) {
          *reinterpret_cast<uint4*>(qt + (c0 + j) * rows + r0 + i) = make_uint4(w[0], w[1], w[2], w[3]);
        } else {
          *reinterpret_cast<uint2*>(qt + (c0 + j) * rows + r0 + i) = make_uint2(w[0], w[1]);
        }
      }
    }
    __syncthreads();
  }
}

// Tensorwise amax, persistent, four 16-byte loads in flight per thread.
__global__ void __launch_bounds__(256) amax_u4(const __nv_bfloat16* __restrict__ x, int64_t packs, uint32_t* bits) {
  uint32_t best = 0;
  const int64_t stride = int64_t{gridDim.x} * 256;
  int64_t p = int64_t{blockIdx.x} * 256 + threadIdx.x;
  for (; p + 3 * stride < packs; p += 4 * stride) {
    Vec<__nv_bfloat16, 8> v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = load<8>(x + (p + u * stride) * 8);
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int k = 0; k < 8; ++k) best = max(best, magnitude_bits(f32(v[u][k])));
  }
  for (; p < packs; p += stride) {
    const Vec<__nv_bfloat16, 8> v = load<8>(x + p * 8);
#pragma unroll
    for (int k = 0; k < 8; ++k) best = max(best, magnitude_bits(f32(v[k])));
  }
  block_amax_to<256>(bits, best);
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
  }
};

}  // namespace

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs\n", prop.name, sms);
  const size_t flush_bytes = size_t{256} << 20;
  void* flush = nullptr;
  CK(cudaMalloc(&flush, flush_bytes));
  CK(cudaMemset(flush, 1, flush_bytes));
  float* flush_amax = nullptr;
  CK(cudaMalloc(&flush_amax, 16));

  struct Shape {
    const char* what;
    int64_t rows, cols;
    bool both;
  };
  // xl (d 1600, d_ff 6400, 2 048 tokens): the weights both ways, the activations one way.
  const Shape shapes[] = {{"w q|k|v 4800x1600 both", 4800, 1600, true}, {"w o 1600x1600 both", 1600, 1600, true},
                          {"w w1 6400x1600 both", 6400, 1600, true},     {"w w2 1600x6400 both", 1600, 6400, true},
                          {"x 2048x1600 q", 2048, 1600, false},          {"s 2048x6400 q", 2048, 6400, false},
                          {"x 2048x1600 qt", 2048, 1600, true},          {"dqkv 2048x4800 both", 2048, 4800, true}};
  Timer tm;
  const int reps = 30;
  auto time_it = [&](auto&& fn) {
    std::vector<float> ms;
    for (int r = 0; r < reps + 3; ++r) {
      fp8_amax(static_cast<const float*>(flush), int64_t(flush_bytes / 4), flush_amax, nullptr);  // the L2 flushed
      CK(cudaEventRecord(tm.a));
      fn();
      CK(cudaEventRecord(tm.b));
      CK(cudaEventSynchronize(tm.b));
      float t = 0;
      CK(cudaEventElapsedTime(&t, tm.a, tm.b));
      if (r >= 3) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return double(ms[ms.size() / 2]);
  };
  int occ64 = 0, occ128 = 0, occa = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ64, cast_persistent<64>, 256, 0));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ128, cast_persistent<128>, 256, 0));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occa, amax_u4, 256, 0));
  std::printf("blocks per SM: p64 %d, p128 %d, u4 %d\n", occ64, occ128, occa);
  std::printf("%-26s %-6s %9s %9s %8s  %s\n", "shape", "kernel", "us", "GB/s", "vs lib", "bytes");
  std::mt19937 rng(45);
  bool all_same = true;
  for (const Shape& s : shapes) {
    const int64_t n = s.rows * s.cols;
    std::vector<uint16_t> host(static_cast<size_t>(n));
    std::normal_distribution<float> nd(0.0f, 0.02f);
    for (auto& h : host) {
      const float f = nd(rng);
      uint32_t b;
      std::memcpy(&b, &f, 4);
      h = uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
    __nv_bfloat16* x = nullptr;
    uint8_t *q0, *qt0, *q1, *qt1;
    float *amax, *deq0, *deq1;
    CK(cudaMalloc(&x, size_t(n) * 2));
    for (uint8_t** p : {&q0, &qt0, &q1, &qt1}) CK(cudaMalloc(p, size_t(n)));
    for (float** p : {&amax, &deq0, &deq1}) CK(cudaMalloc(p, 64));
    CK(cudaMemcpy(x, host.data(), size_t(n) * 2, cudaMemcpyHostToDevice));
    const auto* xb = reinterpret_cast<const bf16_t*>(x);
    fp8_amax(xb, n, amax, nullptr);
    const bool want_q = std::strstr(s.what, " qt") == nullptr, want_qt = s.both;
    uint8_t *lq = want_q ? q0 : nullptr, *lqt = want_qt ? qt0 : nullptr;
    uint8_t *vq = want_q ? q1 : nullptr, *vqt = want_qt ? qt1 : nullptr;
    const double bytes = double(n) * (2 + (want_q ? 1 : 0) + (want_qt ? 1 : 0));
    const double lib = time_it([&] { fp8_cast(xb, s.rows, s.cols, amax, Fp8Format::e4m3, lq, lqt, deq0, nullptr); });
    std::printf("%-26s %-6s %9.2f %9.0f %8s\n", s.what, "lib", lib * 1e3, bytes / lib / 1e6, "1.000");
    auto check = [&](const char* name, double ms) {
      std::vector<uint8_t> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
      bool same = true;
      for (int k = 0; k < 2; ++k) {
        uint8_t *l = k ? lqt : lq, *v = k ? vqt : vq;
        if (!l) continue;
        CK(cudaMemcpy(a.data(), l, size_t(n), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b.data(), v, size_t(n), cudaMemcpyDeviceToHost));
        same = same && a == b;
      }
      float d0 = 0, d1 = 0;
      CK(cudaMemcpy(&d0, deq0, 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(&d1, deq1, 4, cudaMemcpyDeviceToHost));
      same = same && d0 == d1;
      all_same = all_same && same;
      std::printf("%-26s %-6s %9.2f %9.0f %8.3f  %s\n", s.what, name, ms * 1e3, bytes / ms / 1e6, lib / ms,
                  same ? "same" : "DIFFERENT");
    };
    const int64_t tiles64 = ((s.rows + 63) / 64) * ((s.cols + 63) / 64), tiles128 = ((s.rows + 127) / 128) * ((s.cols + 63) / 64);
    const unsigned g64 = unsigned(std::min<int64_t>(tiles64, int64_t(occ64) * sms));
    const unsigned g128 = unsigned(std::min<int64_t>(tiles128, int64_t(occ128) * sms));
    CK(cudaMemset(q1, 0, size_t(n)));
    CK(cudaMemset(qt1, 0, size_t(n)));
    const double p64 = time_it([&] { cast_persistent<64><<<g64, 256>>>(x, s.rows, s.cols, amax, deq1, vq, vqt); });
    CK(cudaGetLastError());
    check("p64", p64);
    CK(cudaMemset(q1, 0, size_t(n)));
    CK(cudaMemset(qt1, 0, size_t(n)));
    const double p128 = time_it([&] { cast_persistent<128><<<g128, 256>>>(x, s.rows, s.cols, amax, deq1, vq, vqt); });
    CK(cudaGetLastError());
    check("p128", p128);
    // The amax of the same tensor.
    const double alib = time_it([&] { fp8_amax(xb, n, amax + 4, nullptr); });
    const unsigned ga = unsigned(std::min<int64_t>(int64_t(occa) * sms, (n / 8 + 255) / 256));
    const double au4 = time_it([&] {
      CK(cudaMemsetAsync(amax + 8, 0, 4));
      amax_u4<<<ga, 256>>>(x, n / 8, reinterpret_cast<uint32_t*>(amax + 8));
    });
    float a0 = 0, a1 = 0;
    CK(cudaMemcpy(&a0, amax + 4, 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&a1, amax + 8, 4, cudaMemcpyDeviceToHost));
    all_same = all_same && a0 == a1;
    std::printf("%-26s %-6s %9.2f %9.0f %8s\n", s.what, "amax", alib * 1e3, 2.0 * n / alib / 1e6, "1.000");
    std::printf("%-26s %-6s %9.2f %9.0f %8.3f  %s\n", s.what, "u4", au4 * 1e3, 2.0 * n / au4 / 1e6, alib / au4,
                a0 == a1 ? "same" : "DIFFERENT");
    CK(cudaFree(x));
    for (void* p : {(void*)q0, (void*)qt0, (void*)q1, (void*)qt1, (void*)amax, (void*)deq0, (void*)deq1}) CK(cudaFree(p));
  }
  std::printf("\n%s\n", all_same ? "every variant wrote the library's bytes" : "SOME VARIANT DIFFERS");
  return all_same ? 0 : 1;
}
