// The Hopper wrappers of attention/cuda/hopper/ one at a time, on random data against the host: a TMA tile
// round trip through an mbarrier (strided view, zero-filled rows past the end), a TMA tile store (clipped
// at the view's end), the forward's FMA-pipe exp2 against exp2, e4m3 tiles of 64- and 128-byte rows by TMA
// into an e4m3 wgmma (the FP8 forward's layouts), accumulator fragments through stmatrix into the swizzled
// layout (the forward's O epilogue), a bulk copy through an mbarrier, bulk reduce-adds from several blocks into one buffer, and single-warpgroup wgmma products with both operands in shared memory, with A in registers
// and B read N-major, and with both A and B read M/N-major from a panel of wider tiles (the backward's
// dQ = dS·K). Skips without an sm_90 GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper/sm90.cuh"
#include "attention/cuda/hopper/tma.h"
#include "flashlm/dtype.h"

namespace {

using flashlm::sm90::swizzled_offset;

bool have_sm90() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && prop.minor == 0;
}

#define SKIP_WITHOUT_SM90()                                                      \
  do {                                                                           \
    if (!have_sm90()) GTEST_SKIP() << "no compute capability 9.0 GPU visible";   \
  } while (0)

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

std::vector<__nv_bfloat16> random_bf16(size_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist;
  std::vector<__nv_bfloat16> v(n);
  for (auto& x : v) x = __float2bfloat16(dist(gen));
  return v;
}

template <class T>
T* device_copy(const std::vector<T>& h) {
  T* d = nullptr;
  if (cudaMalloc(&d, h.size() * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

constexpr int kRows = 128, kCols = 128;  // one tile: 2 panels of 128 rows

// Loads the tile at (row0, head, batch) with TMA and copies shared memory out byte for byte.
__global__ void tma_round_trip_kernel(const __grid_constant__ CUtensorMap map, int row0, int head, int batch,
                                      uint16_t* out) {
  __shared__ alignas(1024) uint16_t tile[kRows * kCols];
  __shared__ flashlm::sm90::Mbarrier bar;
  if (threadIdx.x == 0) {
    bar.init(1);
    flashlm::sm90::Mbarrier::fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bar.arrive_expect_tx(kRows * kCols * 2);
    for (int panel = 0; panel < kCols / 64; ++panel) {
      flashlm::sm90::tma_load_4d(tile + panel * kRows * 64, &map, bar, panel * 64, row0, head, batch);
    }
  }
  bar.wait(0);
  for (int i = threadIdx.x; i < kRows * kCols; i += blockDim.x) out[i] = tile[i];
}

TEST(Sm90Primitives, TmaTileRoundTripThroughMbarrier) {
  SKIP_WITHOUT_SM90();
  // A [2, 100, 3, 128] view sliced out of [2, 103, 3, 136] storage: padded rows and head dim.
  const int B = 2, S = 100, H = 3, D = 128, Sp = 103, Dp = 136;
  auto host = random_bf16(size_t(B) * Sp * H * Dp, 1);
  __nv_bfloat16* storage = device_copy(host);
  ASSERT_NE(storage, nullptr);
  flashlm::TensorView view = flashlm::TensorView::contiguous(storage, flashlm::DType::bf16, {B, Sp, H, Dp},
                                                             flashlm::Device::cuda);
  view = view.slice(1, 2, 2 + S).slice(3, 0, D);
  const auto map = flashlm::sm90::rows_tensor_map(view, kRows);
  ASSERT_TRUE(map.has_value());
  uint16_t* out = nullptr;
  CUDA_OK(cudaMalloc(&out, kRows * kCols * 2));
  for (auto [row0, head, batch] : {std::tuple{0, 0, 0}, std::tuple{37, 2, 1}}) {  // the second runs past row 100
    CUDA_OK(cudaMemset(out, 0xff, kRows * kCols * 2));
    tma_round_trip_kernel<<<1, 128>>>(*map, row0, head, batch, out);
    CUDA_OK(cudaGetLastError());
    std::vector<uint16_t> got(kRows * kCols);
    CUDA_OK(cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int r = 0; r < kRows; ++r) {
      for (int c = 0; c < kCols; ++c) {
        const int s = row0 + r;
        uint16_t want = 0;
        if (s < S) {
          const __nv_bfloat16 x = host[((size_t(batch) * Sp + 2 + s) * H + head) * Dp + c];
          want = *reinterpret_cast<const uint16_t*>(&x);
        }
        bad += got[swizzled_offset(kRows, r, c) / 2] != want;
      }
    }
    EXPECT_EQ(bad, 0) << "tile at row " << row0 << " head " << head << " batch " << batch;
  }
  cudaFree(out);
  cudaFree(storage);
}

// The reverse of the round trip: a tile of kRows rows written into shared memory in the swizzled layout by
// ordinary stores (the forward's O staging), then stored with TMA at (row0, head, batch) in boxes of 64 rows.
__global__ void tma_store_kernel(const __grid_constant__ CUtensorMap map, const uint16_t* tile_in, int row0,
                                 int head, int batch) {
  __shared__ alignas(1024) uint16_t tile[kRows * kCols];
  for (int i = threadIdx.x; i < kRows * kCols; i += blockDim.x) {
    const int r = i / kCols, c = i % kCols;  // 64-row boxes: rows [64·b, 64·b + 64) are one 64-row tile
    tile[(r / 64) * 64 * kCols + flashlm::sm90::swizzled_offset(64, r % 64, c) / 2] = tile_in[i];
  }
  flashlm::sm90::fence_proxy_async_shared();
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int box = 0; box < kRows / 64; ++box) {
      for (int panel = 0; panel < kCols / 64; ++panel) {
        flashlm::sm90::tma_store_4d(&map, tile + box * 64 * kCols + panel * 64 * 64, panel * 64, row0 + 64 * box,
                                    head, batch);
      }
    }
    flashlm::sm90::bulk_commit();
    flashlm::sm90::bulk_wait<0>();
  }
}

TEST(Sm90Primitives, TmaTileStoreWritesItsBoxAndClipsAtTheEnd) {
  SKIP_WITHOUT_SM90();
  // The same sliced [2, 100, 3, 128] view of [2, 103, 3, 136] storage; storage starts poisoned, and only the
  // stored rows inside the view may change.
  const int B = 2, S = 100, H = 3, D = 128, Sp = 103, Dp = 136;
  const size_t n = size_t(B) * Sp * H * Dp;
  std::vector<uint16_t> poison(n, 0x7fc1);
  uint16_t* storage = device_copy(poison);
  ASSERT_NE(storage, nullptr);
  flashlm::TensorView view = flashlm::TensorView::contiguous(storage, flashlm::DType::bf16, {B, Sp, H, Dp},
                                                             flashlm::Device::cuda);
  view = view.slice(1, 2, 2 + S).slice(3, 0, D);
  const auto map = flashlm::sm90::rows_tensor_map(view, 64);
  ASSERT_TRUE(map.has_value());
  const auto tile_bf16 = random_bf16(size_t(kRows) * kCols, 5);
  std::vector<uint16_t> tile(tile_bf16.size());
  std::memcpy(tile.data(), tile_bf16.data(), tile.size() * 2);
  uint16_t* tile_dev = device_copy(tile);
  ASSERT_NE(tile_dev, nullptr);
  const int row0 = 37, head = 2, batch = 1;  // rows 37..164: the last 65 fall past row 100 and are clipped
  tma_store_kernel<<<1, 128>>>(*map, tile_dev, row0, head, batch);
  CUDA_OK(cudaGetLastError());
  std::vector<uint16_t> got(n);
  CUDA_OK(cudaMemcpy(got.data(), storage, n * 2, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int b = 0; b < B; ++b)
    for (int sp = 0; sp < Sp; ++sp)
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < Dp; ++c) {
          const int s = sp - 2, r = s - row0;
          const bool stored = b == batch && h == head && c < D && s >= 0 && s < S && r >= 0 && r < kRows;
          const uint16_t want = stored ? tile[size_t(r) * kCols + c] : uint16_t{0x7fc1};
          bad += got[((size_t(b) * Sp + sp) * H + h) * Dp + c] != want;
        }
  EXPECT_EQ(bad, 0);
  cudaFree(tile_dev);
  cudaFree(storage);
}

// exp2_on_fma_pipe (the forward's exponentials moved off the SFU) against exp2 in double over the range the
// softmax feeds it (x <= 0), with the edges: 0 for -inf and below -127, NaN kept.
__global__ void exp2_on_fma_pipe_kernel(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = flashlm::flash_cuda::exp2_on_fma_pipe(x[i]);
}

TEST(Sm90Primitives, Exp2OnFmaPipeIsWithinItsBoundOfExp2) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 gen(11);
  std::uniform_real_distribution<float> dist(-130.f, 0.f);
  std::vector<float> x(1 << 16);
  for (auto& v : x) v = dist(gen);
  for (int i = 0; i < 4096; ++i) x[static_cast<size_t>(i)] = -static_cast<float>(i) / 4096.f;  // [-1, 0] densely
  const float edges[] = {0.f, -0.f, -0.5f, -1.f, -126.f, -126.5f, -127.f, -127.5f, -200.f, -INFINITY, NAN};
  x.insert(x.end(), std::begin(edges), std::end(edges));
  float* xd = device_copy(x);
  float* yd = nullptr;
  ASSERT_NE(xd, nullptr);
  CUDA_OK(cudaMalloc(&yd, x.size() * 4));
  const int n = static_cast<int>(x.size());
  exp2_on_fma_pipe_kernel<<<(n + 255) / 256, 256>>>(xd, yd, n);
  CUDA_OK(cudaGetLastError());
  std::vector<float> y(x.size());
  CUDA_OK(cudaMemcpy(y.data(), yd, y.size() * 4, cudaMemcpyDeviceToHost));
  double worst = 0;
  int bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) {
      bad += !std::isnan(y[i]);
    } else if (x[i] < -126.5f) {
      bad += y[i] != 0.f;  // flushed like fast_exp2's results under 2^-126
    } else if (x[i] >= -126.f) {
      const double want = std::exp2(static_cast<double>(x[i]));
      worst = std::max(worst, std::fabs(y[i] - want) / want);
    } else {
      bad += !(y[i] >= 0.f && y[i] < 1.2e-38f);  // denormal or 0 between
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_LE(worst, 8e-5);  // the fit's 7.5e-5 plus fp32 rounding
  cudaFree(xd);
  cudaFree(yd);
}

// C[64 x 128] = A[64 x 128] · B[128 x 128]ᵀ with A and B both K-major in shared memory (S = Q·Kᵀ's form);
// or, with kRegistersA, C = A · V where A comes from registers and V[128 keys x 128] is read N-major
// (O += P·V's form). Inputs are row-major in global memory and written into the swizzled layout here.
template <bool kRegistersA>
__global__ void wgmma_tile_kernel(const __nv_bfloat16* a, const __nv_bfloat16* bm, float* c) {
  __shared__ alignas(1024) uint16_t sa[64 * 128];
  __shared__ alignas(1024) uint16_t sb[128 * 128];
  const int tid = threadIdx.x;
  for (int i = tid; i < 64 * 128; i += 128) {
    sa[swizzled_offset(64, i / 128, i % 128) / 2] = reinterpret_cast<const uint16_t*>(a)[i];
  }
  for (int i = tid; i < 128 * 128; i += 128) {
    sb[swizzled_offset(128, i / 128, i % 128) / 2] = reinterpret_cast<const uint16_t*>(bm)[i];
  }
  flashlm::sm90::fence_proxy_async_shared();
  __syncthreads();
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  using Gemm = flashlm::sm90::WgmmaM64<__nv_bfloat16, 128>;
  const int warp = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  flashlm::sm90::fence_accumulators(d);
  flashlm::sm90::wgmma_fence();
  if constexpr (kRegistersA) {
    for (int kk = 0; kk < 8; ++kk) {
      uint32_t frag[4];
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * warp + g + 8 * (e % 2), col = 16 * kk + 8 * (e / 2) + 2 * t;
        const uint16_t lo = reinterpret_cast<const uint16_t*>(a)[row * 128 + col];
        const uint16_t hi = reinterpret_cast<const uint16_t*>(a)[row * 128 + col + 1];
        frag[e] = uint32_t(lo) | (uint32_t(hi) << 16);
      }
      Gemm::rs<1>(d, frag, flashlm::sm90::mn_major_descriptor(sb, 128, kk), 1);
    }
  } else {
    for (int kk = 0; kk < 8; ++kk) {
      Gemm::ss<0>(d, flashlm::sm90::k_major_descriptor(sa, 64, 0, kk), flashlm::sm90::k_major_descriptor(sb, 128, 0, kk),
                  kk > 0);
    }
  }
  flashlm::sm90::wgmma_commit();
  flashlm::sm90::wgmma_wait<0>();
  flashlm::sm90::fence_accumulators(d);
  for (int i = 0; i < 64; ++i) {
    const int row = 16 * warp + g + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * t + i % 2;
    c[row * 128 + col] = d[i];
  }
}

template <bool kRegistersA>
void check_wgmma_tile() {
  auto a = random_bf16(64 * 128, 2), bm = random_bf16(128 * 128, 3);
  __nv_bfloat16 *da = device_copy(a), *db = device_copy(bm);
  float* dc = nullptr;
  ASSERT_EQ(cudaMalloc(&dc, 64 * 128 * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(dc, 0xff, 64 * 128 * 4), cudaSuccess);  // NaN poison
  wgmma_tile_kernel<kRegistersA><<<1, 128>>>(da, db, dc);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> c(64 * 128);
  ASSERT_EQ(cudaMemcpy(c.data(), dc, c.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  double worst = 0;
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < 128; ++j) {
      double want = 0;
      for (int k = 0; k < 128; ++k) {
        const double x = __bfloat162float(a[i * 128 + k]);
        // K-major B holds B[n][k] (the product is A·Bᵀ); N-major holds B[k][n].
        const double y = kRegistersA ? __bfloat162float(bm[k * 128 + j]) : __bfloat162float(bm[j * 128 + k]);
        want += x * y;
      }
      const double err = std::fabs(c[i * 128 + j] - want);
      worst = std::isnan(err) ? INFINITY : std::max(worst, err);
    }
  }
  EXPECT_LE(worst, 1e-3) << (kRegistersA ? "A in registers, B N-major" : "A and B K-major in shared memory");
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
}

TEST(Sm90Primitives, WgmmaBothOperandsInSharedMemoryMatchHostProduct) {
  SKIP_WITHOUT_SM90();
  check_wgmma_tile<false>();
}

TEST(Sm90Primitives, WgmmaRegisterAAndNMajorBMatchHostProduct) {
  SKIP_WITHOUT_SM90();
  check_wgmma_tile<true>();
}

// C[64 x 64] = Aᵀ·B where A is stored [128 (the reduction) x 128] and B [128 x 128] in the swizzled layout
// and the product reads panel `a_panel` of A M-major and panel `b_panel` of B N-major: the dQ product of
// the backward (dSᵀ stored keys x queries, K keys x head dim).
__global__ void wgmma_m_major_a_kernel(const __nv_bfloat16* a, const __nv_bfloat16* bm, float* c, int a_panel,
                                       int b_panel) {
  __shared__ alignas(1024) uint16_t sa[128 * 128];
  __shared__ alignas(1024) uint16_t sb[128 * 128];
  const int tid = threadIdx.x;
  for (int i = tid; i < 128 * 128; i += 128) {
    sa[swizzled_offset(128, i / 128, i % 128) / 2] = reinterpret_cast<const uint16_t*>(a)[i];
    sb[swizzled_offset(128, i / 128, i % 128) / 2] = reinterpret_cast<const uint16_t*>(bm)[i];
  }
  flashlm::sm90::fence_proxy_async_shared();
  __syncthreads();
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  using Gemm = flashlm::sm90::WgmmaM64<__nv_bfloat16, 64>;
  flashlm::sm90::fence_accumulators(d);
  flashlm::sm90::wgmma_fence();
  for (int kk = 0; kk < 8; ++kk) {
    Gemm::ss<1, 1>(d, flashlm::sm90::mn_major_descriptor(sa + a_panel * 128 * 64, 128, kk),
                   flashlm::sm90::mn_major_descriptor(sb + b_panel * 128 * 64, 128, kk), kk > 0);
  }
  flashlm::sm90::wgmma_commit();
  flashlm::sm90::wgmma_wait<0>();
  flashlm::sm90::fence_accumulators(d);
  const int warp = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  for (int i = 0; i < 32; ++i) {
    const int row = 16 * warp + g + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * t + i % 2;
    c[row * 64 + col] = d[i];
  }
}

void check_wgmma_m_major_a(int a_panel, int b_panel) {
  auto a = random_bf16(128 * 128, 4 + a_panel), bm = random_bf16(128 * 128, 6 + b_panel);
  __nv_bfloat16 *da = device_copy(a), *db = device_copy(bm);
  float* dc = nullptr;
  ASSERT_EQ(cudaMalloc(&dc, 64 * 64 * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(dc, 0xff, 64 * 64 * 4), cudaSuccess);  // NaN poison
  wgmma_m_major_a_kernel<<<1, 128>>>(da, db, dc, a_panel, b_panel);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> c(64 * 64);
  ASSERT_EQ(cudaMemcpy(c.data(), dc, c.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  double worst = 0;
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < 64; ++j) {
      double want = 0;
      for (int k = 0; k < 128; ++k) {
        want += double(__bfloat162float(a[k * 128 + 64 * a_panel + i])) * __bfloat162float(bm[k * 128 + 64 * b_panel + j]);
      }
      const double err = std::fabs(c[i * 64 + j] - want);
      worst = std::isnan(err) ? INFINITY : std::max(worst, err);
    }
  }
  EXPECT_LE(worst, 1e-3) << "A panel " << a_panel << ", B panel " << b_panel;
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
}

TEST(Sm90Primitives, WgmmaMMajorAAndNMajorBFromTilePanelsMatchHostProduct) {
  SKIP_WITHOUT_SM90();
  for (int a_panel : {0, 1}) {
    for (int b_panel : {0, 1}) check_wgmma_m_major_a(a_panel, b_panel);
  }
}

// C[64 x 128] = A[64 x K]·B[128 x K]ᵀ in e4m3 with K = kRowBytes (64 or 128): both tiles loaded by TMA from
// [1, rows, 1, K] views (tma.h's 8-bit boxes: the whole 64-byte row with the 64-byte swizzle, or one
// 128-byte panel with the 128-byte swizzle) and read K-major by e4m3 wgmma through k_major_descriptor_8bit
// (the FP8 forward's S = Q·Kᵀ). B's view has fewer than 128 rows: TMA zero-fills the rest.
template <int kRowBytes>
__global__ void e4m3_tma_wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                                      float* c) {
  __shared__ alignas(1024) uint8_t sa[64 * kRowBytes];
  __shared__ alignas(1024) uint8_t sb[128 * kRowBytes];
  __shared__ flashlm::sm90::Mbarrier bar;
  const int tid = threadIdx.x;
  if (tid == 0) {
    bar.init(1);
    flashlm::sm90::Mbarrier::fence_init();
  }
  __syncthreads();
  if (tid == 0) {
    bar.arrive_expect_tx((64 + 128) * kRowBytes);
    flashlm::sm90::tma_load_4d(sa, &map_a, bar, 0, 0, 0, 0);
    flashlm::sm90::tma_load_4d(sb, &map_b, bar, 0, 0, 0, 0);
  }
  bar.wait(0);
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  flashlm::sm90::fence_accumulators(d);
  flashlm::sm90::wgmma_fence();
  for (int kk = 0; kk < kRowBytes / 32; ++kk) {
    flashlm::sm90::WgmmaM64E4m3<128>::ss(d, flashlm::sm90::k_major_descriptor_8bit<kRowBytes>(sa, 0, kk),
                                         flashlm::sm90::k_major_descriptor_8bit<kRowBytes>(sb, 0, kk), kk > 0);
  }
  flashlm::sm90::wgmma_commit();
  flashlm::sm90::wgmma_wait<0>();
  flashlm::sm90::fence_accumulators(d);
  const int warp = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  for (int i = 0; i < 64; ++i) {
    const int row = 16 * warp + g + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * t + i % 2;
    c[row * 128 + col] = d[i];
  }
}

template <int kRowBytes>
void check_e4m3_tma_wgmma() {
  constexpr int kBRows = 100;  // of the 128 the tile holds
  std::mt19937_64 gen(11 + kRowBytes);
  std::normal_distribution<float> dist(0.f, 4.f);
  std::vector<uint8_t> a(64 * kRowBytes), bm(kBRows * kRowBytes);
  for (auto& x : a) x = flashlm::f8e4m3_t(dist(gen)).bits;
  for (auto& x : bm) x = flashlm::f8e4m3_t(dist(gen)).bits;
  uint8_t *da = device_copy(a), *db = device_copy(bm);
  ASSERT_NE(da, nullptr);
  ASSERT_NE(db, nullptr);
  const auto map_a = flashlm::sm90::rows_tensor_map(
      flashlm::TensorView::contiguous(da, flashlm::DType::f8e4m3, {1, 64, 1, kRowBytes}, flashlm::Device::cuda), 64);
  const auto map_b = flashlm::sm90::rows_tensor_map(
      flashlm::TensorView::contiguous(db, flashlm::DType::f8e4m3, {1, kBRows, 1, kRowBytes}, flashlm::Device::cuda),
      128);
  ASSERT_TRUE(map_a.has_value() && map_b.has_value());
  float* dc = nullptr;
  ASSERT_EQ(cudaMalloc(&dc, 64 * 128 * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(dc, 0xff, 64 * 128 * 4), cudaSuccess);  // NaN poison
  e4m3_tma_wgmma_kernel<kRowBytes><<<1, 128>>>(*map_a, *map_b, dc);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> c(64 * 128);
  ASSERT_EQ(cudaMemcpy(c.data(), dc, c.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  int bad = 0;
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < 128; ++j) {
      double want = 0, magnitude = 0;
      for (int k = 0; j < kBRows && k < kRowBytes; ++k) {
        const double x = flashlm::f8e4m3_t::to_float(a[i * kRowBytes + k]);
        const double y = flashlm::f8e4m3_t::to_float(bm[j * kRowBytes + k]);
        want += x * y;
        magnitude += std::fabs(x * y);
      }
      // The products are exact in fp32; the tensor cores' e4m3 accumulation keeps fewer bits than fp32, so
      // the bound is relative to the sum of |products| (a layout error is off by the products themselves).
      const double err = std::fabs(c[i * 128 + j] - want);
      bad += !(err <= 4e-3 * magnitude + 1e-6);
    }
  }
  EXPECT_EQ(bad, 0) << kRowBytes << "-byte rows";
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
}

TEST(Sm90Primitives, E4m3TmaTilesOf64And128ByteRowsThroughWgmmaMatchHostProduct) {
  SKIP_WITHOUT_SM90();
  check_e4m3_tma_wgmma<64>();
  check_e4m3_tma_wgmma<128>();
}

// `n` floats from global memory at `src` into shared memory by one bulk copy completing on an mbarrier,
// then out again.
__global__ void bulk_load_kernel(const float* src, float* out, int n) {
  __shared__ alignas(16) float buf[256];
  __shared__ flashlm::sm90::Mbarrier bar;
  for (int i = threadIdx.x; i < 256; i += blockDim.x) buf[i] = -1.f;
  if (threadIdx.x == 0) {
    bar.init(1);
    flashlm::sm90::Mbarrier::fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bar.arrive_expect_tx(static_cast<uint32_t>(n * 4));
    flashlm::sm90::bulk_load(buf, src, static_cast<uint32_t>(n * 4), bar);
  }
  bar.wait(0);
  for (int i = threadIdx.x; i < 256; i += blockDim.x) out[i] = buf[i];
}

TEST(Sm90Primitives, BulkLoadThroughMbarrierCopiesExactlyItsBytes) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 gen(9);
  std::normal_distribution<float> dist;
  std::vector<float> h(256 + 4);
  for (auto& x : h) x = dist(gen);
  float* src = device_copy(h);
  float* out = nullptr;
  ASSERT_NE(src, nullptr);
  ASSERT_EQ(cudaMalloc(&out, 256 * 4), cudaSuccess);
  for (int n : {4, 128, 252}) {
    ASSERT_EQ(cudaMemset(out, 0xff, 256 * 4), cudaSuccess);
    bulk_load_kernel<<<1, 128>>>(src + 4, out, n);  // a 16-byte aligned source inside the allocation
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    std::vector<float> got(256);
    ASSERT_EQ(cudaMemcpy(got.data(), out, 256 * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    int bad = 0;
    for (int i = 0; i < 256; ++i) bad += got[i] != (i < n ? h[4 + i] : -1.f);
    EXPECT_EQ(bad, 0) << n << " floats";
  }
  cudaFree(src);
  cudaFree(out);
}

// One warpgroup writes a 64 x 128 tile of 16-bit values, held as wgmma accumulator fragments (thread 4g + t
// of warp w: rows 16w + g and + 8, columns 8j + 2t and + 1), into the swizzled layout with stmatrix, in the
// 16-bit forward's epilogue order; value (row, col) = row * 128 + col, so every element names its place.
__global__ void stmatrix_tile_kernel(uint16_t* out) {
  constexpr int kTileRows = 64, kTileCols = 128;
  __shared__ alignas(1024) uint16_t tile[kTileRows * kTileCols];
  for (int i = threadIdx.x; i < kTileRows * kTileCols; i += blockDim.x) tile[i] = 0xffff;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  auto value = [&](int r, int j, int e) {  // fragment element o[4j + 2r + e]
    return static_cast<uint32_t>((16 * warp + g + 8 * r) * kTileCols + 8 * j + 2 * t + e);
  };
  auto pair = [&](int r, int j) { return value(r, j, 0) | (value(r, j, 1) << 16); };
  const int m = lane / 8, row = 16 * warp + 8 * (m % 2) + lane % 8;
  for (int jj = 0; jj < kTileCols / 16; ++jj) {
    flashlm::sm90::stmatrix_x4(flashlm::sm90::smem_u32(tile) + swizzled_offset(kTileRows, row, 8 * (2 * jj + m / 2)),
                               pair(0, 2 * jj), pair(1, 2 * jj), pair(0, 2 * jj + 1), pair(1, 2 * jj + 1));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTileRows * kTileCols; i += blockDim.x) out[i] = tile[i];
}

TEST(Sm90Primitives, StmatrixWritesAccumulatorFragmentsIntoTheSwizzledTile) {
  SKIP_WITHOUT_SM90();
  constexpr int kTileRows = 64, kTileCols = 128;
  uint16_t* out = nullptr;
  ASSERT_EQ(cudaMalloc(&out, kTileRows * kTileCols * 2), cudaSuccess);
  stmatrix_tile_kernel<<<1, 128>>>(out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<uint16_t> got(kTileRows * kTileCols);
  ASSERT_EQ(cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  int bad = 0;
  for (int row = 0; row < kTileRows; ++row) {
    for (int col = 0; col < kTileCols; ++col) {
      bad += got[swizzled_offset(kTileRows, row, col) / 2] != row * kTileCols + col;
    }
  }
  EXPECT_EQ(bad, 0) << "of " << kTileRows * kTileCols << " elements";
  cudaFree(out);
}

// Every block adds `in` (n floats, staged in shared memory) into `out` with one bulk reduce-add per warp
// (each warp its own 1024-float slice of the n = 4096), twice: out must end as its old value plus
// 2·blocks·in, as with atomics.
__global__ void bulk_reduce_kernel(const float* in, float* out) {
  __shared__ alignas(128) float buf[4][1024];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int round = 0; round < 2; ++round) {
    if (lane == 0) flashlm::sm90::bulk_wait_read<0>();  // the last round's reduce has read the buffer
    __syncwarp();
    for (int i = lane; i < 1024; i += 32) buf[warp][i] = in[warp * 1024 + i];
    flashlm::sm90::fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0) {
      flashlm::sm90::bulk_reduce_add_f32(out + warp * 1024, buf[warp], 1024 * 4);
      flashlm::sm90::bulk_commit();
    }
  }
  if (lane == 0) flashlm::sm90::bulk_wait<0>();
}

TEST(Sm90Primitives, BulkReduceAddFromManyBlocksSumsLikeAtomics) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 gen(11);
  std::uniform_int_distribution<int> small(-8, 8);  // small integers: every sum order gives the same float
  std::vector<float> in(4096), base(4096);
  for (auto& x : in) x = static_cast<float>(small(gen));
  for (auto& x : base) x = static_cast<float>(small(gen)) * 64.f;
  float* din = device_copy(in);
  float* dout = device_copy(base);
  ASSERT_NE(din, nullptr);
  ASSERT_NE(dout, nullptr);
  constexpr int kBlocks = 66;
  bulk_reduce_kernel<<<kBlocks, 128>>>(din, dout);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> got(4096);
  ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  int bad = 0;
  for (int i = 0; i < 4096; ++i) bad += got[i] != base[i] + 2.f * kBlocks * in[i];
  EXPECT_EQ(bad, 0);
  cudaFree(din);
  cudaFree(dout);
}

}  // namespace
