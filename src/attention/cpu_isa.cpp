// The CPU flash attention's entry points: pick the kernel variant once (attention/cpu_isa.h), then call it.
#include "attention/cpu_isa.h"

#include <atomic>
#include <cstdlib>

#include "attention/backends.h"
#include "core/check.h"
#include "core/env.h"
#include "flashlm/device.h"

namespace flashlm {

// Each variant's entry points, defined by its copy of flash_cpu.cpp in the namespace src/CMakeLists.txt gives it.
#define FLASHLM_DECLARE_CPU_KERNELS(ns)                                                                              \
  namespace ns {                                                                                                     \
  void flash_forward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,       \
                     const TensorView& o, const TensorView& lse);                                                   \
  void flash_backward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,      \
                      const TensorView& o, const TensorView& lse, const TensorView& dout, const TensorView& dq,     \
                      const TensorView& dk, const TensorView& dv);                                                  \
  }
FLASHLM_DECLARE_CPU_KERNELS(cpu_baseline)
#ifdef FLASHLM_CPU_KERNELS_AVX2
FLASHLM_DECLARE_CPU_KERNELS(cpu_avx2)
#endif
#ifdef FLASHLM_CPU_KERNELS_AVX512
FLASHLM_DECLARE_CPU_KERNELS(cpu_avx512)
#endif
#ifdef FLASHLM_CPU_KERNELS_NATIVE
FLASHLM_DECLARE_CPU_KERNELS(cpu_native)
#endif
#undef FLASHLM_DECLARE_CPU_KERNELS

namespace {

struct Variant {
  const char* name;
  bool (*runs_here)();
  decltype(&cpu_baseline::flash_forward) forward;
  decltype(&cpu_baseline::flash_backward) backward;
};

bool always() { return true; }
#if defined(__x86_64__) && (defined(FLASHLM_CPU_KERNELS_AVX2) || defined(FLASHLM_CPU_KERNELS_AVX512))
// The levels the variants are compiled for (-march=x86-64-v3 / -v4), as libgcc's cpuid check knows them.
bool has_x86_64_v3() { return __builtin_cpu_supports("x86-64-v3"); }
bool has_x86_64_v4() { return __builtin_cpu_supports("x86-64-v4"); }
#endif

// Compiled variants, most portable first.
constexpr Variant kVariants[] = {
    {"baseline", always, cpu_baseline::flash_forward, cpu_baseline::flash_backward},
#ifdef FLASHLM_CPU_KERNELS_AVX2
    {"avx2", has_x86_64_v3, cpu_avx2::flash_forward, cpu_avx2::flash_backward},
#endif
#ifdef FLASHLM_CPU_KERNELS_AVX512
    {"avx512", has_x86_64_v4, cpu_avx512::flash_forward, cpu_avx512::flash_backward},
#endif
#ifdef FLASHLM_CPU_KERNELS_NATIVE
    // The build machine's own instruction set: what FLASHLM_NATIVE=ON builds assume for all their code.
    {"native", always, cpu_native::flash_forward, cpu_native::flash_backward},
#endif
};
constexpr int kNumVariants = int(std::size(kVariants));

int find_runnable(std::string_view isa) {
  for (int i = 0; i < kNumVariants; ++i) {
    if (isa == kVariants[i].name && kVariants[i].runs_here()) return i;
  }
  std::string names;
  for (const std::string& n : runnable_cpu_kernel_isas()) names += (names.empty() ? "" : ", ") + n;
  fail_argument("CPU kernel instruction set '{}' (FLASHLM_CPU_ISA or use_cpu_kernel_isa): expected one this build "
                "has and this CPU runs: {}",
                isa, names);
}

int fastest_runnable() {
  for (int i = kNumVariants - 1; i > 0; --i) {
    if (kVariants[i].runs_here()) return i;
  }
  return 0;
}

std::atomic<int> chosen{-1};  // index into kVariants; -1 until the first call

const Variant& current() {
  int i = chosen.load(std::memory_order_acquire);
  if (i < 0) {
    const char* env = std::getenv("FLASHLM_CPU_ISA");
    i = env && *env ? find_runnable(env) : fastest_runnable();
    chosen.store(i, std::memory_order_release);
  }
  return kVariants[i];
}

}  // namespace

std::vector<std::string> runnable_cpu_kernel_isas() {
  std::vector<std::string> out;
  for (const Variant& v : kVariants) {
    if (v.runs_here()) out.emplace_back(v.name);
  }
  return out;
}

std::string cpu_kernel_isa() { return current().name; }

void use_cpu_kernel_isa(std::string_view isa) { chosen.store(find_runnable(isa), std::memory_order_release); }

std::string cpu_attention_kernels() {
  std::string runnable;
  for (const std::string& n : runnable_cpu_kernel_isas()) runnable += (runnable.empty() ? "" : ", ") + n;
  return fmt::format("{} (runnable here: {}; FLASHLM_CPU_ISA picks another)", cpu_kernel_isa(), runnable);
}

// Here rather than in core/env.cpp: FLASHLM_CPU_ISA's values are this file's variants.
void check_environment() {
  for (const EnvChoice& c : kEnvChoices) env_choice(c);
  for (const EnvNumber& n : kEnvNumbers) env_number(n);
  cpu_kernel_isa();
}

void flash_attention_forward_cpu(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const TensorView& o, const TensorView& lse) {
  current().forward(p, q, k, v, o, lse);
}

void flash_attention_backward_cpu(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& o, const TensorView& lse,
                                  const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                  const TensorView& dv) {
  current().backward(p, q, k, v, o, lse, dout, dq, dk, dv);
}

}  // namespace flashlm
