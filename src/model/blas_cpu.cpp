#include "flashlm/blas.h"

#include <cblas.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
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

void restart_with_blas_core_if_misjudged(char** argv) {
  const std::string core = blas_core_to_request();
  if (core.empty()) return;
  const std::string chosen = blas_core();
  if (setenv("OPENBLAS_CORETYPE", core.c_str(), 1) != 0) return;
  setenv("FLASHLM_OPENBLAS_CHOSE", chosen.c_str(), 1);
  execv("/proc/self/exe", argv);
  unsetenv("OPENBLAS_CORETYPE");  // execv failed: keep OpenBLAS's choice, and say so in `flashlm info`
  unsetenv("FLASHLM_OPENBLAS_CHOSE");
}

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
  return line;
}

}  // namespace flashlm
