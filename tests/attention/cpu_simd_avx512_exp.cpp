// core/cpu_simd.h's AVX-512 exp compiled for x86-64-v4 into the test binary, which is otherwise built for the
// baseline: in a namespace of its own, as each kernel copy (attention.cpu_kernel_objects checks this object
// too), called by test_cpu_simd_avx512.cpp only where the CPU runs x86-64-v4.
#include <cstddef>

#include "core/cpu_simd.h"

namespace flashlm::FLASHLM_CPU_KERNELS_NS {

void exp_fp32_nonpositive_x16_over(const float* args, float* out, size_t n) {
  for (size_t i = 0; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(out + i, exp_fp32_nonpositive_x16(_mm512_loadu_ps(args + i)));
  }
}

}  // namespace flashlm::FLASHLM_CPU_KERNELS_NS
