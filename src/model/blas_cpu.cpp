#include "flashlm/blas.h"

#include "model/blas_cpu.h"

#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <mutex>
#include <string_view>

namespace flashlm {

namespace {

// OpenBLAS's x86-64 cores whose sgemm kernels predate AVX2 (kernel/x86_64/KERNEL.*): on a CPU with AVX2,
// OpenBLAS choosing one of these means it did not recognise the CPU.
constexpr std::array<std::string_view, 16> kPreAvx2Cores{
    "katmai", "coppermine", "northwood", "prescott", "banias", "atom",    "core2", "penryn",
    "dunnington", "nehalem", "athlon",   "opteron",  "opteron(sse3)", "barcelona", "bobcat", "nano"};

bool is_pre_avx2_core(std::string name) {
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return std::find(kPreAvx2Cores.begin(), kPreAvx2Cores.end(), name) != kPreAvx2Cores.end();
}

}  // namespace

std::string blas_core() {
  const char* name = openblas_get_corename();
  return name ? name : "unknown";
}

std::string blas_core_for(std::string_view chosen, bool avx2_fma, bool avx512) {
  if (!avx2_fma || !is_pre_avx2_core(std::string(chosen))) return {};
  return avx512 ? "SkylakeX" : "Haswell";
}

std::string blas_core_to_request() {
  if (std::getenv("OPENBLAS_CORETYPE")) return {};
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return blas_core_for(blas_core(), avx2_fma, avx512);
#else
  return {};
#endif
}

void restart_with_cpu_settings(char** argv) {
  const std::string core = blas_core_to_request();
  const bool set_wait_policy = std::getenv("OMP_WAIT_POLICY") == nullptr;
  if (core.empty() && !set_wait_policy) return;
  if (!core.empty()) {
    const std::string chosen = blas_core();
    if (setenv("OPENBLAS_CORETYPE", core.c_str(), 1) != 0) return;
    setenv("FLASHLM_OPENBLAS_CHOSE", chosen.c_str(), 1);
  }
  if (set_wait_policy && setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
  execv("/proc/self/exe", argv);
  // execv failed: run on as started (`flashlm info` then shows OpenBLAS's own choice).
  if (!core.empty()) {
    unsetenv("OPENBLAS_CORETYPE");
    unsetenv("FLASHLM_OPENBLAS_CHOSE");
  }
  if (set_wait_policy) unsetenv("OMP_WAIT_POLICY");
}

void apply_cpu_threading_policy() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (openblas_get_parallel() == 1) openblas_set_num_threads(1);  // 1: the pthreads build (0: none, 2: OpenMP)
  });
}

int blas_threads() { return openblas_get_num_threads(); }

namespace cpu {

namespace {

// Blocks of C start on multiples of this, so that each block's sgemm runs whole kernel tiles.
constexpr int64_t kBlockAlign = 16;
// Below this many multiply-adds a product runs in one call: the threads' start would cost more than the split
// saves.
constexpr int64_t kMinParallelWork = int64_t(1) << 15;

void sgemm_block(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, int(m), int(n),
              int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
}

}  // namespace

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  apply_cpu_threading_policy();
  if (m <= 0 || n <= 0) return;
  const bool split_rows = m >= n;
  const int64_t extent = split_rows ? m : n;
  const int64_t blocks_max = (extent + kBlockAlign - 1) / kBlockAlign;
  const int threads = omp_in_parallel() ? 1 : int(std::min<int64_t>(omp_get_max_threads(), blocks_max));
  if (threads <= 1 || m * n * k < kMinParallelWork) {
    sgemm_block(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const int64_t per_thread = (blocks_max + threads - 1) / threads * kBlockAlign;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int t = 0; t < threads; ++t) {
    const int64_t lo = t * per_thread, hi = std::min(extent, lo + per_thread);
    if (lo >= hi) continue;
    if (split_rows) {  // rows lo..hi of C: rows of op(A)
      sgemm_block(trans_a, trans_b, hi - lo, n, k, alpha, trans_a ? a + lo : a + lo * lda, lda, b, ldb, beta,
                  c + lo * ldc, ldc);
    } else {  // columns lo..hi of C: columns of op(B)
      sgemm_block(trans_a, trans_b, m, hi - lo, k, alpha, a, lda, trans_b ? b + lo * ldb : b + lo, ldb, beta, c + lo,
                  ldc);
    }
  }
}

}  // namespace cpu

std::string blas_description() {
  const char* config = openblas_get_config();
  std::string line = fmt::format("{}, core {}", config ? config : "OpenBLAS", blas_core());
  const char* chose = std::getenv("FLASHLM_OPENBLAS_CHOSE");
  const char* requested = std::getenv("OPENBLAS_CORETYPE");
  if (chose && requested) {
    line += fmt::format(" (OpenBLAS chose {} for this CPU; flashlm restarted with OPENBLAS_CORETYPE={})", chose, requested);
  } else if (requested) {
    line += fmt::format(" (OPENBLAS_CORETYPE={})", requested);
  } else if (const std::string better = blas_core_to_request(); !better.empty()) {
    line += fmt::format(" (slow kernels for this CPU: set OPENBLAS_CORETYPE={})", better);
  }
  apply_cpu_threading_policy();
  const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
  line += fmt::format("; {} thread(s) per product in each OpenMP thread, OMP_WAIT_POLICY={}", blas_threads(),
                      wait_policy ? wait_policy : "unset (OpenMP's threads spin when idle)");
  return line;
}

}  // namespace flashlm
