// The instruction-set variants of the CPU attention kernels (attention/flash_cpu.cpp, compiled once per variant)
// and the run-time choice between them.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace flashlm {

// The variants this library was built with that this CPU can run, from the most portable to the fastest:
// "baseline" (x86-64 with SSE2, or the architecture's default elsewhere), "avx2" (x86-64-v3: AVX2 and FMA),
// "avx512" (x86-64-v4) where the build leaves -march to the variants (FLASHLM_NATIVE=OFF), and "native"
// (the build machine's -march=native) beside "baseline" where it does not.
std::vector<std::string> runnable_cpu_kernel_isas();

// The variant the CPU flash attention runs: the environment's FLASHLM_CPU_ISA when set (one of
// runnable_cpu_kernel_isas(); anything else is a flashlm::InvalidArgument at the first call), else the fastest
// runnable.
std::string cpu_kernel_isa();

// Makes the CPU flash attention run `isa` from now on (tests force each variant this way);
// flashlm::InvalidArgument naming the runnable ones if it is not one of them.
void use_cpu_kernel_isa(std::string_view isa);

}  // namespace flashlm
