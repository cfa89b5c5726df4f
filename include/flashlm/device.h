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
// More threads than this only thrash (and libgomp fails to create them, or overflows its stack, near 10^5).
inline constexpr int kMaxCpuThreads = 1024;

}  // namespace flashlm
