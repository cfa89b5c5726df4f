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

template void squared_norm<float>(const float*, int64_t, double*, void*);
template void squared_norm<bf16_t>(const bf16_t*, int64_t, double*, void*);

}  // namespace flashlm::gpu
