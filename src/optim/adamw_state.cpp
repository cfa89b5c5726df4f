// The AdamW moments and step count a model owns (optim/adamw_state.h).
#include "optim/adamw_state.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/cuda_runtime.h"

namespace flashlm {

AdamWState::AdamWState(OptimizerState state, bool bf16_storage, int64_t count, Device device)
    : state_(state), bf16_(bf16_storage || state != OptimizerState::fp32), count_(count), device_(device) {}

void AdamWState::allocate(void* stream) {
  if (allocated()) return;
  const size_t bytes = size_t(count_) * element_size();
  m_ = Buffer::allocate(bytes, device_, bf16_ ? "AdamW first moment (bf16)" : "AdamW first moment");
  v_ = Buffer::allocate(bytes, device_, bf16_ ? "AdamW second moment (bf16)" : "AdamW second moment");
  for (void* moment : {m_.data(), v_.data()}) {  // +0 in fp32 and in bf16
    if (device_ == Device::cpu) {
      std::memset(moment, 0, bytes);
    } else {
      cuda_memset_async(moment, 0, bytes, stream);
    }
  }
}

void AdamWState::release() {
  m_ = Buffer();
  v_ = Buffer();
  steps_ = 0;
}

void AdamWState::save(std::span<float> m, std::span<float> v) const {
  if (!allocated()) {  // no step taken yet: zero moments
    std::fill(m.begin(), m.end(), 0.0f);
    std::fill(v.begin(), v.end(), 0.0f);
    return;
  }
  for (const auto& [moment, host] : {std::pair{m_.data(), m.data()}, std::pair{v_.data(), v.data()}}) {
    if (!bf16_) {
      if (device_ == Device::cpu) {
        std::memcpy(host, moment, size_t(count_) * sizeof(float));
      } else {
        cuda_copy(host, moment, size_t(count_) * sizeof(float));
      }
      continue;
    }
    // Widened to fp32 (exactly): the checkpoint format is the same for every state.
    const auto widen = [](bf16_t x) { return float(x); };
    if (device_ == Device::cpu) {
      std::transform(static_cast<const bf16_t*>(moment), static_cast<const bf16_t*>(moment) + count_, host, widen);
    } else {
      std::vector<bf16_t> narrow(static_cast<size_t>(count_));
      cuda_copy(narrow.data(), moment, narrow.size() * sizeof(bf16_t));
      std::transform(narrow.begin(), narrow.end(), host, widen);
    }
  }
}

void AdamWState::load(std::span<const float> m, std::span<const float> v, void* stream) {
  allocate(stream);
  if (device_ != Device::cpu) cuda_stream_synchronize(stream);  // the zeroing above is queued on the stream
  for (const auto& [host, moment] : {std::pair{m.data(), m_.data()}, std::pair{v.data(), v_.data()}}) {
    if (!bf16_) {
      if (device_ == Device::cpu) {
        std::memcpy(moment, host, size_t(count_) * sizeof(float));
      } else {
        cuda_copy(moment, host, size_t(count_) * sizeof(float));
      }
      continue;
    }
    const auto narrow = [](float x) { return bf16_t(x); };  // exact: the caller checked for bf16 values
    if (device_ == Device::cpu) {
      std::transform(host, host + count_, static_cast<bf16_t*>(moment), narrow);
    } else {
      std::vector<bf16_t> values(static_cast<size_t>(count_));
      std::transform(host, host + count_, values.begin(), narrow);
      cuda_copy(moment, values.data(), values.size() * sizeof(bf16_t));
    }
  }
}

}  // namespace flashlm
