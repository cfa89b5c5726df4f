// The gradients' squared norm on CUDA (optim/optimizer.h), for clipping: a two-pass fp64 reduction in a
// fixed order (core/cuda/reduce.cuh).
#include "core/cuda/kernels.cuh"
#include "core/cuda/reduce.cuh"
#include "optim/optimizer.h"

namespace flashlm::gpu {

namespace {

struct SquareOp {
  using Acc = double;
  template <class D>
  __device__ double operator()(D x) const {
    const double v = f32(x);
    return v * v;
  }
};

}  // namespace

template <class T>
void squared_norm(const T* x, int64_t n, double* out, void* stream) {
  check_count("squared_norm", "n", n);
  reduce<SquareOp>(dev(x), n, out, as_stream(stream), "squared_norm");
}

namespace {

__global__ void clip_on_device_kernel(const double* __restrict__ partial, int64_t count, DeviceStepScalars* s) {
  double ss = 0;
  for (int64_t i = 0; i < count; ++i) ss = __dadd_rn(ss, partial[i]);
  const double norm = __dsqrt_rn(ss);
  const double max_norm = s->max_norm;
  s->norm = norm;
  // cpu::clip_scale: float(max_norm / (norm + 1e-6)), each operation rounded once.
  s->adam.grad_scale = max_norm > 0 && norm > max_norm ? __double2float_rn(__ddiv_rn(max_norm, __dadd_rn(norm, 1e-6)))
                                                       : 1.0f;
}

}  // namespace

void clip_on_device(const double* partial, int64_t count, DeviceStepScalars* s, void* stream) {
  check_count("clip_on_device", "count", count);
  FLASHLM_CHECK(partial != nullptr && s != nullptr, "clip_on_device: partial and s must not be null");
  clip_on_device_kernel<<<1, 1, 0, as_stream(stream)>>>(partial, count, s);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "clip_on_device_kernel");
}

template void squared_norm<float>(const float*, int64_t, double*, void*);
template void squared_norm<bf16_t>(const bf16_t*, int64_t, double*, void*);

}  // namespace flashlm::gpu
