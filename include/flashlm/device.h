// What compute devices this process can use.
#pragma once
#include <string>

namespace flashlm {

bool cuda_built();      // the library was built with CUDA kernels
int cuda_device_count();  // 0 when not built with CUDA or no GPU/driver is present
int cpu_threads();      // threads the CPU kernels use (OpenMP)
void set_cpu_threads(int n);  // 1..kMaxCpuThreads
// Which instruction-set variant of the CPU attention kernels runs, and which others this CPU could run
// (for `flashlm info`).
std::string cpu_attention_kernels();
// Reads every FLASHLM_* setting the library takes from the environment (src/core/env.h lists them; and
// FLASHLM_CPU_ISA) and throws the first bad one's flashlm::InvalidArgument, naming the variable and what it
// accepts: for a program to refuse a bad environment before it starts work, rather than at the first call that
// reads the setting (in a benchmark sweep, every row recorded as an error).
void check_environment();
// More threads than this only thrash (and libgomp fails to create them, or overflows its stack, near 10^5).
inline constexpr int kMaxCpuThreads = 1024;
// The longest timeout any setting takes (collectives, the tokenizer script), in seconds: a week, past any job
// and far from the overflow of steady_clock's integer nanoseconds.
inline constexpr double kMaxTimeoutSeconds = 7 * 86400.0;

}  // namespace flashlm
