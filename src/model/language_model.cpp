// What every model shares (flashlm/model.h's LanguageModel): what it is (size, layout, device, precision),
// its optimizer state and loss scale, the data-parallel hooks and the parameter-storage table, the checks of
// checkpoint arrays, and the step.
#include <algorithm>
#include <bit>
#include <climits>
#include <memory>

#include "core/check.h"
#include "flashlm/model.h"
#include "optim/adamw_state.h"
#include "optim/loss_scaler.h"

namespace flashlm {

void LanguageModel::check_state_arrays(std::string_view caller, size_t params, size_t m, size_t v,
                                       int64_t optimizer_steps) const {
  const auto n = size_t(parameter_count());
  for (const auto& [name, size] : {std::pair{"params", params}, std::pair{"m", m}, std::pair{"v", v}}) {
    FLASHLM_CHECK(size == n, "{}: {} holds {} floats, expected parameter_count() = {}", caller, name, size, n);
  }
  FLASHLM_CHECK(optimizer_steps >= 0, "{}: optimizer_steps = {}, expected >= 0", caller, optimizer_steps);
}

void LanguageModel::check_bf16_moments(std::string_view caller, std::span<const float> m,
                                       std::span<const float> v) {
  for (const auto& [name, values] : {std::pair{"m", m}, std::pair{"v", v}}) {
    for (size_t i = 0; i < values.size(); ++i) {
      const float x = values[i];
      FLASHLM_CHECK(std::bit_cast<uint32_t>(x) << 16 == 0,
                    "{}: {}[{}] = {} is not a bf16 value: bf16 moments load only what bf16 moments saved (a "
                    "checkpoint of fp32 moments needs --optimizer-state fp32)",
                    caller, name, i, x);
    }
  }
}

LanguageModel::LanguageModel(const ModelConfig& config, Device device, DType precision, const ModelOptions& options)
    : config_(config),
      layout_(parameter_layout(config)),
      parameter_count_(layout_.back().offset + layout_.back().numel()),
      device_(device),
      precision_(precision),
      bf16_pure_(options.bf16_pure),
      grad_dtype_(options.grad_dtype),
      external_parameters_(options.external_parameters),
      fsdp_fp8_gather_(options.fsdp_fp8_gather()) {}

void LanguageModel::init_optimizer_state(OptimizerState state) {
  adamw_ = std::make_unique<AdamWState>(state, bf16_pure_, parameter_count_, device_);
  loss_scaler_ = std::make_unique<LossScaler>(precision_ == DType::f16);
}

LanguageModel::~LanguageModel() = default;

OptimizerState LanguageModel::optimizer_state() const { return adamw_->state(); }
int64_t LanguageModel::optimizer_steps() const { return adamw_->steps(); }
double LanguageModel::loss_scale() const { return loss_scaler_->scale(); }
int64_t LanguageModel::loss_scale_good_steps() const { return loss_scaler_->good_steps(); }
void LanguageModel::restore_loss_scale(double scale, int64_t good_steps) {
  loss_scaler_->restore(scale, good_steps, precision());
}

void LanguageModel::gradient_ready(std::string_view parameter_name) const {
  if (!gradient_ready_hook_) return;
  const auto& params = layout();
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].name == parameter_name) return gradient_ready_hook_(int64_t(i), int64_t(i));
  }
  fail("gradient_ready: no parameter named '{}'", parameter_name);
}

namespace {

// The elements of every parameter whose name starts with `name_prefix`: one run, since a model part's
// parameters are contiguous in the layout.
std::pair<int64_t, int64_t> prefix_run(const std::vector<ParameterInfo>& layout, std::string_view name_prefix,
                                       std::string_view caller) {
  int64_t begin = INT64_MAX, end = 0;
  for (const ParameterInfo& p : layout) {
    if (std::string_view(p.name).substr(0, name_prefix.size()) != name_prefix) continue;
    begin = std::min(begin, p.offset);
    end = std::max(end, p.offset + p.numel());
  }
  FLASHLM_CHECK(begin < end, "{}: no parameter named '{}...'", caller, name_prefix);
  return {begin, end - begin};
}

}  // namespace

void LanguageModel::parameters_needed(std::string_view name_prefix) const {
  if (!parameters_needed_hook_) return;
  const auto [offset, count] = prefix_run(layout(), name_prefix, "parameters_needed");
  parameters_needed_hook_(offset, count);
}

void LanguageModel::parameters_done(std::string_view name_prefix) const {
  if (!parameters_done_hook_) return;
  const auto [offset, count] = prefix_run(layout(), name_prefix, "parameters_done");
  parameters_done_hook_(offset, count);
}

void LanguageModel::gradients_needed(std::string_view name_prefix) const {
  if (!gradients_needed_hook_) return;
  const auto [offset, count] = prefix_run(layout(), name_prefix, "gradients_needed");
  gradients_needed_hook_(offset, count);
}

void LanguageModel::point_storage_at(float* params, void* working, DType working_dtype, float* grads) {
  const std::vector<ParameterInfo>& params_layout = layout();
  storage_.assign(params_layout.size(), {});
  for (size_t i = 0; i < params_layout.size(); ++i) {
    const int64_t at = params_layout[i].offset;
    ParameterStorage& s = storage_[i];
    s.master = params ? params + at : nullptr;
    s.grad = grads ? grads + at : nullptr;
    s.weight = working ? static_cast<void*>(static_cast<char*>(working) + size_t(at) * dtype_size(working_dtype))
                       : static_cast<void*>(s.master);
  }
}

const ParameterStorage& LanguageModel::stored(std::string_view name) const {
  const std::vector<ParameterInfo>& params_layout = layout();
  for (size_t i = 0; i < params_layout.size(); ++i) {
    if (params_layout[i].name == name) return storage_[i];
  }
  fail("model: no parameter named '{}'", name);
}

bool optimizer_step(LanguageModel& model, const AdamWConfig& c, double lr, double* norm) {
  if (!model.unscale_gradients()) return false;
  const double before = model.clip_gradients(c.max_grad_norm);
  model.adamw_step(c, lr);
  if (norm) *norm = before;
  return true;
}

StepResult LanguageModel::train_step(const int32_t* tokens, const int32_t* targets, const AdamWConfig& c, double lr) {
  StepResult r;
  zero_grad();
  r.loss = forward(tokens, targets);
  backward();
  r.updated = optimizer_step(*this, c, lr, &r.grad_norm);
  return r;
}

}  // namespace flashlm
