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

#include "core/host_device.h"
#include "core/random.h"
#include "flashlm/dtype.h"

namespace flashlm {

// The step's scalars in fp32, computed once per call from the fp64 hyper-parameters (the one place they
// are computed, so that every variant rounds them alike).
struct AdamWScalars {
  float alpha, b1, one_minus_b1, b2, one_minus_b2, eps, decay, grad_scale;
  uint64_t rounding_key = 0;  // bf16-sr moments: moment_rounding_key(seed, step)
  // An upper bound on |alpha · m' / (sqrt(v') + eps)|, the update before the decay, whatever the gradients
  // were (adamw_update_bound); infinity where none holds. Read by FP8 training's weight copies (Fp8WeightCopies).
  float update_bound = 0;
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
// FP8 training's block weights copied by the step itself (ModelOptions::fp8_optimizer_weight_cast), so that no
// pass casts them: besides its bf16 copy (param_copy) and that copy's amax, weight r — elements
// [begin, begin + rows · cols) of the step's buffers, row-major — gets its e4m3 copies q [rows, cols] and
// qt [cols, rows], each element encode(w'' · fp8_scale(bound)) from the fp32 master, with bound =
// fp8_weight_bound(amax, scalars) of the amax its slot held before the step (that of its bf16 copy as
// stored). A scale from a bound rather than from the amax of w'' is what lets the step write the copies as
// it computes w'': the bound is at least that amax, larger by at most about update_bound (1.46 · lr at CS336's
// betas), so nothing saturates and the bytes keep e4m3's relative precision. The slot (model/fp8.h) afterwards holds
// the bound at kFp8BoundIndex, the dequantisation scale the GEMMs read, and the new amax of the bf16 copy.
// Every element of the buffers outside the weights is stepped by the chunks of `rest`.
struct Fp8WeightCopy {
  int64_t begin = 0, rows = 0, cols = 0;
  uint8_t* q = nullptr;   // device [rows, cols]
  uint8_t* qt = nullptr;  // device [cols, rows]
  float* slot = nullptr;  // device: its scale slot
  int64_t first_block = 0;  // the sum of fp8_copy_blocks over the weights before it
};
struct ElementChunk {
  int64_t begin = 0, count = 0;
};
struct Fp8WeightCopies {
  const Fp8WeightCopy* weights = nullptr;  // device, `count` entries, disjoint, first_block ascending
  int count = 0;
  int64_t weight_blocks = 0;           // the step kernel's blocks over the weights (fp8_copy_blocks)
  const ElementChunk* rest = nullptr;  // device: the other elements in chunks of <= 65 536, 8-aligned starts
  int rest_count = 0;
  // Whether the weights' bf16 copies are written too. false: their part of the bf16 copy keeps what it held
  // (its owner restores it from the masters before anything reads it: the same bits), and the slots' amaxes
  // are still those of the bf16 values it would hold. The rest's bf16 copy is written either way.
  bool weights_bf16 = true;
};
// The step kernel's blocks for a weight of rows × cols: one per strip of kFp8CopyStripRows rows and
// kFp8CopyTile columns, stepped as tiles of kFp8CopyTile × kFp8CopyTile (whose transposes go to qt).
inline constexpr int64_t kFp8CopyTile = 64, kFp8CopyStripRows = 256;
inline int64_t fp8_copy_blocks(int64_t rows, int64_t cols) {
  return ((cols + kFp8CopyTile - 1) / kFp8CopyTile) * ((rows + kFp8CopyStripRows - 1) / kFp8CopyStripRows);
}

// ranges: `count` device entries, ascending and disjoint, each count >= 1, within the step's n; none: {}.
// copies: with count > 0 the step writes the copies above instead (and the ranges are not read): fp32 masters
// with a bf16 copy only, rows and cols multiples of 8, begin 8-aligned, every array 16-byte aligned.
struct StoredAmaxes {
  const AmaxRange* ranges = nullptr;
  int count = 0;
  Fp8WeightCopies copies = {};
};

// A train step's scalars in device memory, for a step replayed as a CUDA graph: the host writes adam (with
// grad_scale 1) and max_norm before each replay; gpu::clip_on_device sets norm and adam.grad_scale; AdamW
// reads adam (gpu::adamw_step_live).
struct DeviceStepScalars {
  AdamWScalars adam;
  double max_norm;
  double norm;
};

// Σ_{k<t} r^k for r >= 0, t >= 1, without cancellation where r is close to 1.
inline double geometric_sum(double r, double t) {
  if (r == 1.0) return t;
  return -std::expm1(t * std::log(r)) / (1.0 - r);
}

// A bound on |alpha · m'| / sqrt(v') at step t over every gradient sequence, m and v starting at zero: with
// a_i = (1 - b1) b1^(t-i) and c_i = (1 - b2) b2^(t-i), m' = Σ a_i g_i and v' = Σ c_i g_i², so by Cauchy-Schwarz
// |m'| <= sqrt(Σ a_i² / c_i) · sqrt(v') = (1 - b1) / sqrt(1 - b2) · sqrt(Σ_{k<t} (b1² / b2)^k) · sqrt(v'), and
// alpha = lr · sqrt(1 - b2^t) / (1 - b1^t). eps only lowers the update. Step 1 gives lr exactly (Adam's first
// step is lr · sign(g)). Finite only where b1² < b2 (Adam's usual condition; the CS336 and GPT defaults have
// it): otherwise infinity, and nothing may be inferred from it. Times 1.25: the bf16 moments' rounding moves
// m' and v' off the exact recurrences by a few of their own ulps per step, and fp32 evaluation by less.
inline double adamw_update_bound(double lr, double beta1, double beta2, int64_t step) {
  const double rho = beta1 * beta1 / beta2;
  if (!(rho < 1.0) || !(beta1 >= 0.0 && beta1 < 1.0) || !(beta2 > 0.0 && beta2 <= 1.0) || step < 1) {
    return INFINITY;
  }
  const double t = double(step);
  // alpha · (1 - b1) / sqrt(1 - b2) with the bias corrections as sums, finite at b2 = 1 too.
  const double ratio = lr / geometric_sum(beta1, t) * std::sqrt(geometric_sum(beta2, t));
  return 1.25 * std::abs(ratio) * std::sqrt(geometric_sum(rho, t));
}

// Whether AdamW's update has that bound at these betas (b1² < b2), whatever the learning rate and step.
inline bool adamw_update_bounded(double beta1, double beta2) {
  return std::isfinite(adamw_update_bound(1.0, beta1, beta2, 1));
}

inline AdamWScalars adamw_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                                  int64_t step, float grad_scale = 1.0f) {
  const double t = double(step);
  const float alpha = float(lr * std::sqrt(1.0 - std::pow(beta2, t)) / (1.0 - std::pow(beta1, t)));
  const float b1 = float(beta1), b2 = float(beta2);
  AdamWScalars a{alpha, b1, 1 - b1, b2, 1 - b2, float(eps), float(lr * weight_decay), grad_scale};
  a.update_bound = float(adamw_update_bound(lr, beta1, beta2, step));
  return a;
}

// The largest |w''| an AdamW step with scalars `a` can store, given that the bf16 copy of w before it had this
// amax (FP8 training's weights copied by the step, Fp8WeightCopies): the fp32 master lies within half a bf16
// step of its copy (|w| <= amax · (1 + 2^-8)), the update adds at most a.update_bound, the decay scales by
// |1 - decay|, and 2^-10 covers the fp32 roundings of the three. NaN stays NaN; infinity where the update
// bound is infinite.
FLASHLM_HOST_DEVICE inline float fp8_weight_bound(float amax_before, const AdamWScalars& a) {
  const float w = amax_before * (1.0f + 0x1p-8f) + a.update_bound;
  const float decay = 1.0f - a.decay < 0.0f ? a.decay - 1.0f : 1.0f - a.decay;
  return w * (decay > 1.0f ? decay : 1.0f) * (1.0f + 0x1p-10f);
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
// The gradients G: fp32, or bf16 with T = bf16_t (ModelOptions::grad_dtype; this and the three below): each
// widened to fp32 (exact), so the step is the fp32 step on the widened gradients, bit for bit.
template <class T, class G = float>
void adamw_step(float* param, const G* grad, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, T* param_copy, void* stream, float grad_scale = 1.0f,
                StoredAmaxes amax = {});

// Pure bf16 (cpu::adamw_step_bf16's bits): param, grad, m and v all bf16 [n], updated in place, 16-byte
// accesses where all four are aligned. The moments must start at zero (the first step's m' = (1 - b1) g).
void adamw_step_bf16(bf16_t* param, const bf16_t* grad, bf16_t* m, bf16_t* v, int64_t n, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step, void* stream,
                     float grad_scale = 1.0f, StoredAmaxes amax = {});

// bf16 moments (above; cpu::adamw_step_bf16_moments's bits), with adamw_step's param_copy and grad_scale.
template <class T, class G = float>
void adamw_step_bf16_moments(float* param, const G* grad, bf16_t* m, bf16_t* v, int64_t n, double lr,
                             double beta1, double beta2, double eps, double weight_decay, int64_t step,
                             MomentRounding rounding, int64_t first_index, T* param_copy, void* stream,
                             float grad_scale = 1.0f, StoredAmaxes amax = {});

// adamw_step and adamw_step_bf16 with the step's scalars read from device memory when the kernels run, not
// fixed when they are queued: a CUDA graph of the train step replays them with each step's lr, step count
// and clipping factor (CudaModel::train_step).
template <class T, class G = float>
void adamw_step_live(float* param, const G* grad, float* m, float* v, int64_t n, const AdamWScalars* scalars,
                     T* param_copy, void* stream, StoredAmaxes amax = {});
void adamw_step_bf16_live(bf16_t* param, const bf16_t* grad, bf16_t* m, bf16_t* v, int64_t n,
                          const AdamWScalars* scalars, void* stream, StoredAmaxes amax = {});
// bf16 moments, live: the rounding key too is read from scalars (stochastic: whether to use it).
template <class T, class G = float>
void adamw_step_bf16_moments_live(float* param, const G* grad, bf16_t* m, bf16_t* v, int64_t n,
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
