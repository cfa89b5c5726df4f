// The state an AdamW optimizer keeps beside a model's parameters: the two moments and the step count, and
// how the moments are stored (ModelOptions::optimizer_state: fp32, or bf16 rounded to nearest or
// stochastically; a bf16-pure model's are bf16 too). The models own one each (LanguageModel) and queue the
// update themselves (optim/optimizer.h's kernels); ZeRO-1 and FSDP keep their sharded state instead.
//
// The moments are allocated, zeroed, by the first step or a load, as PyTorch's optimizers do: a model that
// only runs forward, or whose optimizer state lives elsewhere, never holds them.
#pragma once
#include <cstdint>
#include <span>

#include "flashlm/model.h"
#include "optim/optimizer.h"

namespace flashlm {

class AdamWState {
 public:
  // `count` moments of each kind in `device` memory; bf16_storage: stored in bf16 even though `state` is
  // fp32 (a bf16-pure model).
  AdamWState(OptimizerState state, bool bf16_storage, int64_t count, Device device);

  OptimizerState state() const { return state_; }
  bool bf16() const { return bf16_; }  // the moments are bf16_t, else float
  size_t element_size() const { return bf16_ ? sizeof(bf16_t) : sizeof(float); }
  // How bf16 moments are rounded after each step, from the run's seed.
  MomentRounding rounding(uint64_t seed) const { return {state_ == OptimizerState::bf16_sr, seed}; }

  int64_t steps() const { return steps_; }  // steps taken (the next one is steps() + 1, 1-based)
  int64_t begin_step() { return ++steps_; }  // counts the step about to be queued and returns its number
  void set_steps(int64_t steps) { steps_ = steps; }

  bool allocated() const { return m_.data() != nullptr; }
  // Zeroed moments unless they exist (on CUDA queued on `stream`).
  void allocate(void* stream = nullptr);
  // Frees the moments and restarts the count at 0 (the caller makes sure no queued work reads them).
  void release();
  void* m() const { return m_.data(); }
  void* v() const { return v_.data(); }
  template <class T>
  T* m_as() const {
    return static_cast<T*>(m_.data());
  }
  template <class T>
  T* v_as() const {
    return static_cast<T*>(v_.data());
  }

  // Checkpoints: the moments as host fp32 arrays of `count` values (bf16 widened exactly; zeros before the
  // first step), and back (bf16: each value must be a bf16 value, LanguageModel::check_bf16_moments; the
  // device copies are synchronous). Not for a bf16-pure model's device moments, which pass through its
  // staging buffer instead.
  void save(std::span<float> m, std::span<float> v) const;
  void load(std::span<const float> m, std::span<const float> v, void* stream = nullptr);

 private:
  OptimizerState state_;
  bool bf16_;
  int64_t count_;
  Device device_;
  int64_t steps_ = 0;
  Buffer m_, v_;
};

}  // namespace flashlm
