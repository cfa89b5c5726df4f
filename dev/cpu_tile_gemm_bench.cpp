// Times the CPU forward's two tile products (attention/cpu_gemm.h) and its softmax rows (attention/cpu_rows.h)
// alone, at the forward's tile shapes, against the core's FMA peak (measured first, in the same run: the % can
// pass 100 where the clock moved between the two) and against OpenBLAS's sgemm on the same tiles (single-threaded;
// its core is the one its runtime dispatch picks, or OPENBLAS_CORETYPE's). A measurement aid, not a test:
//   build-cpu/dev/cpu_tile_gemm_bench [--head-dim 128] [--seq 4096] [--rounds 20]
// S = scale · Q Kᵀ: Q a 256-query tile in panels of kGemmRows rows, K transposed in panels of kGemmCols columns
// per 512-key tile; P V: acc += P V with P a 256 × 512 tile (row-major), V in panels per 512-key tile.
// "head" runs every key tile of one head (K and V stream from L2/L3 as in the forward), "one tile" the same
// tile again and again (everything in L1/L2). Thread CPU time, the minimum over the rounds. Written for
// docs/perf.md's perf/cpu-attn8 section.
#include <cblas.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/cpu_gemm.h"  // and through core/cpu_simd.h the AVX-512 intrinsics, with its GCC 12 warning guard
#if defined(__AVX__) && !defined(__AVX512F__)
#include <immintrin.h>  // the AVX2 FMA peak loop
#endif
#include "attention/cpu_rows.h"

namespace {

using namespace flashlm::FLASHLM_CPU_KERNELS_NS;

constexpr int64_t kTileQ = 256, kTileK = 512;

double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

template <class F>
double min_seconds(int rounds, F f) {
  f();  // warm the caches and the pages
  double best = 1e30;
  for (int i = 0; i < rounds; ++i) {
    const double t0 = thread_seconds();
    f();
    best = std::min(best, thread_seconds() - t0);
  }
  return best;
}

// The core's FMA peak: 16 independent chains of vector FMAs (the accumulators of one register block), fp32.
double fma_peak_gflops(int rounds) {
  [[maybe_unused]] constexpr int64_t kIters = 20'000'000;  // unused where neither AVX branch is compiled
#if defined(__AVX512F__)
  constexpr int kLanes = 16;
  const double s = min_seconds(rounds, [] {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(float(i));
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-7f);
    for (int64_t it = 0; it < kIters; ++it) {
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
      // Keeps the chains alive and unfused (at most 30 asm operands: two statements).
      asm volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]), "+v"(acc[4]), "+v"(acc[5]),
                   "+v"(acc[6]), "+v"(acc[7]));
      asm volatile("" : "+v"(acc[8]), "+v"(acc[9]), "+v"(acc[10]), "+v"(acc[11]), "+v"(acc[12]), "+v"(acc[13]),
                   "+v"(acc[14]), "+v"(acc[15]));
    }
  });
  return 2.0 * kLanes * 16 * double(kIters) / s * 1e-9;
#elif defined(__AVX__)
  constexpr int kLanes = 8;
  const double s = min_seconds(rounds, [] {
    __m256 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(float(i));
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-7f);
    for (int64_t it = 0; it < kIters; ++it) {
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
      asm volatile("" : "+x"(acc[0]), "+x"(acc[1]), "+x"(acc[2]), "+x"(acc[3]), "+x"(acc[4]), "+x"(acc[5]),
                   "+x"(acc[6]), "+x"(acc[7]), "+x"(acc[8]), "+x"(acc[9]), "+x"(acc[10]), "+x"(acc[11]));
    }
  });
  return 2.0 * kLanes * 12 * double(kIters) / s * 1e-9;
#else
  return 0;
#endif
}

std::vector<float> random_floats(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = u(rng);
  return x;
}

void report(const char* what, double flops, double seconds, double peak) {
  const double g = flops / seconds * 1e-9;
  std::printf("%-44s %8.3f ms  %7.1f GFLOP/s  %5.1f%% of peak\n", what, seconds * 1e3, g, peak > 0 ? 100 * g / peak : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t D = 128, seq = 4096;
  int rounds = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string opt = argv[i];
    const long value = std::strtol(argv[i + 1], nullptr, 10);
    if (opt == "--head-dim" && (value == 64 || value == 128)) D = value;
    else if (opt == "--seq" && value >= kTileK && value <= 65536 && value % kTileK == 0) seq = value;
    else if (opt == "--rounds" && value >= 1 && value <= 1000) rounds = int(value);
    else {
      std::fprintf(stderr, "error: %s %s: expected --head-dim 64|128, --seq a multiple of %lld in [%lld, 65536], "
                   "--rounds 1..1000\n", argv[i], argv[i + 1], (long long)kTileK, (long long)kTileK);
      return 2;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "error: %s: expected a value after it\n", argv[argc - 1]);
    return 2;
  }
  openblas_set_num_threads(1);
  const int64_t key_tiles = seq / kTileK;
  std::mt19937 rng(20261202);
  // The forward's operands, packed as flash_cpu.cpp packs them (Q panels, Kᵀ and V column panels per key tile).
  auto q = random_floats(kTileQ * D, rng), k = random_floats(seq * D, rng), v = random_floats(seq * D, rng);
  std::vector<float> q_panels(size_t(kTileQ * D)), kt_panels(size_t(seq * D)), v_panels(size_t(seq * D));
  for (int64_t r = 0; r < kTileQ; ++r) {
    for (int64_t d = 0; d < D; ++d) q_panels[size_t(panel_row_offset(r, D) + d * kGemmRows)] = q[size_t(r * D + d)];
  }
  for (int64_t j = 0; j < seq; ++j) {
    const int64_t t = j / kTileK, c = j % kTileK;
    float* kt = kt_panels.data() + t * kTileK * D;  // panel c / kGemmCols: D × kGemmCols
    float* vp = v_panels.data() + t * kTileK * D;   // panel d / kGemmCols: kTileK × kGemmCols
    for (int64_t d = 0; d < D; ++d) {
      kt[c / kGemmCols * D * kGemmCols + d * kGemmCols + c % kGemmCols] = k[size_t(j * D + d)];
      vp[d / kGemmCols * kTileK * kGemmCols + c * kGemmCols + d % kGemmCols] = v[size_t(j * D + d)];
    }
  }
  auto p = random_floats(kTileQ * kTileK, rng);
  for (auto& x : p) x = 0.5f * (x + 1.0f);  // probabilities' range
  std::vector<float> s(size_t(kTileQ * kTileK)), acc(size_t(kTileQ * D), 0.0f);
  const float scale = 1.0f / 11.3f;

  const double peak = fma_peak_gflops(std::max(3, rounds / 4));
  std::printf("head_dim %lld, seq %lld, tiles %lld x %lld, register block %lld x %lld, min of %d rounds\n",
              (long long)D, (long long)seq, (long long)kTileQ, (long long)kTileK, (long long)kGemmRows,
              (long long)kGemmCols, rounds);
  std::printf("%-44s %7.1f GFLOP/s\n", "FMA peak (16 independent chains)", peak);
  const double tile_flops = 2.0 * kTileQ * kTileK * D;
  auto s_product = [&](int64_t t) {
    tile_gemm<ALayout::panels, 0, BLayout::panels>(kTileQ, kTileK, D, scale, q_panels.data(), D,
                                                   kt_panels.data() + t * kTileK * D, D * kGemmCols, 0.0f, s.data(),
                                                   kTileK);
  };
  auto pv_product = [&](int64_t t) {
    tile_gemm<ALayout::rows, kTileK, BLayout::panels>(kTileQ, D, kTileK, 1.0f, p.data(), kTileK,
                                                      v_panels.data() + t * kTileK * D, kTileK * kGemmCols, 1.0f,
                                                      acc.data(), D);
  };
  report("S = Q K^T, one tile", tile_flops, min_seconds(rounds, [&] { s_product(0); }), peak);
  report("S = Q K^T, a head's key tiles (per tile)", tile_flops,
         min_seconds(rounds, [&] { for (int64_t t = 0; t < key_tiles; ++t) s_product(t); }) / double(key_tiles), peak);
  report("acc += P V, one tile", tile_flops, min_seconds(rounds, [&] { pv_product(0); }), peak);
  report("acc += P V, a head's key tiles (per tile)", tile_flops,
         min_seconds(rounds, [&] { for (int64_t t = 0; t < key_tiles; ++t) pv_product(t); }) / double(key_tiles), peak);
  // The forward's softmax over the same tile (flash_cpu.cpp's forward_task between the products): per row the
  // maximum, exp(s - max) and its sum, the accumulator row rescaled. Scores of a real S product, so that the
  // exponentials see the forward's range of arguments.
  s_product(0);
  std::vector<float> scores = s, m(size_t(kTileQ), -1e30f), l(size_t(kTileQ), 0.0f);
  auto softmax_rows = [&] {
    for (int64_t r = 0; r < kTileQ; ++r) {
      float* row = s.data() + r * kTileK;
      const float m_new = std::max(m[size_t(r)], row_max_skipping_nan(row, kTileK));
      const float alpha = exp_nonpositive(m[size_t(r)] - m_new);
      float* a = acc.data() + r * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
      l[size_t(r)] = l[size_t(r)] * alpha + exp_shifted_sum(row, kTileK, m_new);
      m[size_t(r)] = m_new - 1.0f;  // the next round's rows rescale too
    }
  };
  const double softmax_s = min_seconds(rounds, [&] {
    std::copy(scores.begin(), scores.end(), s.begin());
    softmax_rows();
  });
  const double copy_s = min_seconds(rounds, [&] { std::copy(scores.begin(), scores.end(), s.begin()); });
  std::printf("%-44s %8.3f ms  (%.1f ns per score; the tile's copy, %.3f ms, subtracted)\n", "softmax rows, one tile",
              (softmax_s - copy_s) * 1e3, (softmax_s - copy_s) * 1e9 / double(kTileQ * kTileK), copy_s * 1e3);
  // OpenBLAS on the same tiles as stored (row-major K and V, no packing of ours: the BLAS packs inside the call).
  auto blas_s = [&](int64_t t) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(kTileQ), int(kTileK), int(D), scale, q.data(), int(D),
                k.data() + t * kTileK * D, int(D), 0.0f, s.data(), int(kTileK));
  };
  auto blas_pv = [&](int64_t t) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(kTileQ), int(D), int(kTileK), 1.0f, p.data(),
                int(kTileK), v.data() + t * kTileK * D, int(D), 1.0f, acc.data(), int(D));
  };
  std::printf("OpenBLAS %s, core %s\n", openblas_get_config(), openblas_get_corename());
  report("OpenBLAS S = Q K^T, one tile", tile_flops, min_seconds(rounds, [&] { blas_s(0); }), peak);
  report("OpenBLAS S = Q K^T, a head's key tiles", tile_flops,
         min_seconds(rounds, [&] { for (int64_t t = 0; t < key_tiles; ++t) blas_s(t); }) / double(key_tiles), peak);
  report("OpenBLAS acc += P V, one tile", tile_flops, min_seconds(rounds, [&] { blas_pv(0); }), peak);
  report("OpenBLAS acc += P V, a head's key tiles", tile_flops,
         min_seconds(rounds, [&] { for (int64_t t = 0; t < key_tiles; ++t) blas_pv(t); }) / double(key_tiles), peak);
  return 0;
}
