// Optimizer arithmetic shared by every optimizer of the library (the models' AdamW, ZeRO-1's sharded one in
// src/dist/), on the CPU and on CUDA side by side, so that the same gradients give the same bits whichever
// of them updates a parameter.
//
// AdamW (CS336's formulation), `step` 1-based, per element in fp32, in this order, each operation rounded
// once (no fused multiply-adds):
//   g  = grad                      (times grad_scale, the clipping factor, when it is not 1)
//   m' = b1 · m + (1 - b1) · g
//   v' = b2 · v + ((1 - b2) · g) · g
//   w' = w - (alpha · m') / (sqrt(v') + eps)      alpha = lr · sqrt(1 - b2^step) / (1 - b1^step)
//   w''= w' - (lr · weight_decay) · w'
// with alpha, b1, b2, 1 - b1, 1 - b2, eps and lr · weight_decay rounded to fp32 once (AdamWScalars). Where
// torch.optim.AdamW differs: it decays w before the update, and adds eps to sqrt(v') / sqrt(1 - b2^step)
// (here eps meets sqrt(v') before the bias correction, which alpha carries). The bf16 variant's storage
// scheme — every value widened to fp32 in registers, the results rounded to bf16 once — is torch's fused
// AdamW's for bf16 parameters. Element-wise: any split of a buffer into ranges gives the same bits as one
// call over it.
//
// GPU functions: device pointers, asynchronous on `stream` (a cudaStream_t; nullptr is the legacy default
// stream), launches checked (flashlm::CudaError), bad sizes raise flashlm::Error before anything is queued;
// only in builds with CUDA (FLASHLM_WITH_CUDA). This header itself needs no CUDA headers.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/random.h"
#include "flashlm/dtype.h"

namespace flashlm {

// The step's scalars in fp32, computed once per call from the fp64 hyper-parameters (the one place they
// are computed, so that every variant rounds them alike).
struct AdamWScalars {
  float alpha, b1, one_minus_b1, b2, one_minus_b2, eps, decay, grad_scale;
  uint64_t rounding_key = 0;  // bf16-sr moments: moment_rounding_key(seed, step)
};

// How the bf16 moments are rounded after each step: to nearest even, or stochastically from `seed` (the run's).
struct MomentRounding {
  bool stochastic = false;
  uint64_t seed = 0;
};

constexpr uint64_t moment_rounding_key(uint64_t seed, int64_t step) { return counter_draw(seed, uint64_t(step)); }

// The bf16 bits of the fp32 value with bits `x`, rounded up with probability (the low 16 bits of x) / 2^16
// where `random` is 16 uniform bits: truncation of x + random. NaN stays a quiet NaN; a value within one
// bf16 step of the largest finite may round to infinity, as a wider format would have overflowed.
constexpr uint16_t bf16_bits_stochastic(uint32_t x, uint32_t random) {
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
  return uint16_t((x + (random & 0xffffu)) >> 16);
}

// The amaxes an AdamW step also writes (FP8 training's block weights, ModelOptions::fp8): for each range,
// *amax = max |value| over the values the step stores in elements [begin, begin + count) of its buffers — the
// low-precision copy (param_copy), or bf16-pure's parameters — bit for bit what gpu::fp8_amax reduces over them
// afterwards (the magnitudes' bits, a NaN winning). Each *amax must be zero before the step (the caller clears
// them). The next FP8 cast of those weights then skips a reduction over every block weight.
struct AmaxRange {
  int64_t begin = 0, count = 0;
  float* amax = nullptr;  // device
};
// ranges: `count` device entries, ascending and disjoint, each count >= 1, within the step's n; none: {}.
struct StoredAmaxes {
  const AmaxRange* ranges = nullptr;
  int count = 0;
};

// A train step's scalars in device memory, for a step replayed as a CUDA graph: the host writes adam (with
// grad_scale 1) and max_norm before each replay; gpu::clip_on_device sets norm and adam.grad_scale; AdamW
// reads adam (gpu::adamw_step_live).
struct DeviceStepScalars {
  AdamWScalars adam;
  double max_norm;
  double norm;
};

inline AdamWScalars adamw_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                                  int64_t step, float grad_scale = 1.0f) {
  const double t = double(step);
  const float alpha = float(lr * std::sqrt(1.0 - std::pow(beta2, t)) / (1.0 - std::pow(beta1, t)));
  const float b1 = float(beta1), b2 = float(beta2);
  return {alpha, b1, 1 - b1, b2, 1 - b2, float(eps), float(lr * weight_decay), grad_scale};
}

}  // namespace flashlm

namespace flashlm::cpu {

// Σ x[i]² over n values, accumulated in fp64 in index order (bf16 values widened exactly).
double sum_squares(const float* x, int64_t n);
double sum_squares(const bf16_t* x, int64_t n);
// The factor that scales gradients of global norm `norm` down to max_norm (used when norm > max_norm).
inline float clip_scale(double norm, double max_norm) { return float(max_norm / (norm + 1e-6)); }
// One AdamW step (above; gpu::adamw_step's bits) over n fp32 values.
void adamw_step(float* w, const float* g, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step);
// Pure bf16 (gpu::adamw_step_bf16's bits): parameters, gradients and moments stored in bf16, each widened
// to fp32, stepped as above, and w'', m', v' rounded to bf16 (nearest even). grad_scale: the clipping
// factor, applied to the widened gradient.
void adamw_step_bf16(bf16_t* w, const bf16_t* g, bf16_t* m, bf16_t* v, int64_t n, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step, float grad_scale = 1.0f);
// bf16 moments (above; gpu::adamw_step_bf16_moments's bits): fp32 w and g [n], bf16 m and v [n]; element i
// is element first_index + i of the whole buffer (its stochastic rounding's counter).
void adamw_step_bf16_moments(float* w, const float* g, bf16_t* m, bf16_t* v, int64_t n, double lr, double beta1,
                             double beta2, double eps, double weight_decay, int64_t step, MomentRounding rounding,
                             int64_t first_index = 0);

}  // namespace flashlm::cpu

namespace flashlm::gpu {

// One AdamW step (above; cpu::adamw_step's bits) over n fp32 values. When param_copy is not null, it
// receives the updated weights rounded to T ∈ {float, bf16_t, fp16_t} (the copy the forward reads); with
// T = float and no copy, call adamw_step<float>(..., nullptr, stream). grad_scale multiplies each gradient
// first (once, rounded: the result of scale_inplace(grad, n, grad_scale) followed by the step, without that
// pass).
// amax (every variant; none by default): the StoredAmaxes of what the step stores, which needs a bf16 param_copy
// here (an Error otherwise). The same bits in every array with or without it.
template <class T>
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, T* param_copy, void* stream, float grad_scale = 1.0f,
                StoredAmaxes amax = {});

// Pure bf16 (cpu::adamw_step_bf16's bits): param, grad, m and v all bf16 [n], updated in place, 16-byte
// accesses where all four are aligned. The moments must start at zero (the first step's m' = (1 - b1) g).
void adamw_step_bf16(bf16_t* param, const bf16_t* grad, bf16_t* m, bf16_t* v, int64_t n, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step, void* stream,
                     float grad_scale = 1.0f, StoredAmaxes amax = {});

// bf16 moments (above; cpu::adamw_step_bf16_moments's bits), with adamw_step's param_copy and grad_scale.
template <class T>
void adamw_step_bf16_moments(float* param, const float* grad, bf16_t* m, bf16_t* v, int64_t n, double lr,
                             double beta1, double beta2, double eps, double weight_decay, int64_t step,
                             MomentRounding rounding, int64_t first_index, T* param_copy, void* stream,
                             float grad_scale = 1.0f, StoredAmaxes amax = {});

// adamw_step and adamw_step_bf16 with the step's scalars read from device memory when the kernels run, not
// fixed when they are queued: a CUDA graph of the train step replays them with each step's lr, step count
// and clipping factor (CudaModel::train_step).
template <class T>
void adamw_step_live(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWScalars* scalars,
                     T* param_copy, void* stream, StoredAmaxes amax = {});
void adamw_step_bf16_live(bf16_t* param, const bf16_t* grad, bf16_t* m, bf16_t* v, int64_t n,
                          const AdamWScalars* scalars, void* stream, StoredAmaxes amax = {});
// bf16 moments, live: the rounding key too is read from scalars (stochastic: whether to use it).
template <class T>
void adamw_step_bf16_moments_live(float* param, const float* grad, bf16_t* m, bf16_t* v, int64_t n,
                                  const AdamWScalars* scalars, bool stochastic, int64_t first_index, T* param_copy,
                                  void* stream, StoredAmaxes amax = {});

// Clipping on the device, for a graphed step: s->norm = sqrt(Σ partial[0, count)) summed in index order in
// fp64, and s->adam.grad_scale = cpu::clip_scale(norm, s->max_norm) when max_norm > 0 and norm > max_norm,
// else 1 — the host's arithmetic of CudaModel::clip_gradients, bit for bit (one thread, IEEE roundings).
void clip_on_device(const double* partial, int64_t count, DeviceStepScalars* s, void* stream);

// *out = Σ x[i]² accumulated in fp64 (device scalar), T ∈ {float, bf16_t}, in a fixed order: 8192-element
// chunks, then the chunk sums by one block (the gradient norm for clipping; with bf16 gradients the factor
// then goes to adamw_step_bf16's grad_scale). [scratch: ceil(n / 8192) doubles, stream-ordered]
template <class T>
void squared_norm(const T* x, int64_t n, double* out, void* stream);

}  // namespace flashlm::gpu
