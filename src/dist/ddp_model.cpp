// DdpModel (include/flashlm/ddp_model.h): DataParallel, ZeroOptimizer and FsdpParameters wired to a
// LanguageModel — its flat buffers or FSDP's shards, its stream and its hooks — and the whole model's
// parameters and sharded checkpoints on the host whatever the storage.
#include "flashlm/ddp_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "dist/values.h"
#include "flashlm/dist.h"
#include "model/fp8.h"

#ifdef FLASHLM_WITH_CUDA
#include "core/array_ops.h"
#include "core/gemm_sm_reserve.h"
#endif

namespace flashlm {

void check_sharded_optimizer_state(OptimizerState state, bool zero1, bool fsdp) {
  FLASHLM_CHECK_ARG(state == OptimizerState::fp32 || (!zero1 && !fsdp),
                    "data parallelism: --optimizer-state {} is the model's own AdamW's; ZeRO-1 and FSDP shard fp32 "
                    "moments: use --optimizer-state fp32 with {}",
                    optimizer_state_name(state), fsdp ? "--ddp fsdp" : "--zero 1");
}

void check_data_parallel_grad_dtype(DType grad_dtype) {
  FLASHLM_CHECK_ARG(grad_dtype == DType::f32,
                    "data parallelism: --grad-dtype {} is for one GPU's step; DDP, ZeRO-1 and FSDP reduce "
                    "fp32 gradients: use --grad-dtype fp32",
                    dtype_name(grad_dtype));
}

DdpModel::DdpModel(Communicator& comm, LanguageModel& model, int64_t micro_batch_tokens, const DdpOptions& options,
                   bool zero1)
    : model_(model),
      micro_tokens_(micro_batch_tokens),
      gemm_sm_reserve_(resolve_gemm_sm_reserve(options.gemm_sm_reserve, comm)) {
  FLASHLM_CHECK(micro_batch_tokens >= 1, "DdpModel: micro_batch_tokens = {}, expected >= 1", micro_batch_tokens);
  check_data_parallel_grad_dtype(model.grad_dtype());
  const DdpParameters params = DdpParameters::of(model);
  const bool fsdp = options.variant == DdpVariant::fsdp;
  FLASHLM_CHECK(!fsdp || model.precision() != DType::f16,
                "DdpModel: --ddp fsdp trains fp32 or bf16 models, not fp16 (its overflow check reads every gradient, "
                "and each rank keeps only its shard of them)");
  // bf16-pure keeps no fp32 masters or gradients in the model for DDP to all-reduce or ZeRO-1 to update:
  // FSDP's sharded storage holds its bf16 parameters instead (use_sharded_storage's pure).
  FLASHLM_CHECK(!model.bf16_pure() || (fsdp && model.external_parameters()),
                "DdpModel: bf16-pure runs under data parallelism with --ddp fsdp and sharded storage only "
                "(ModelOptions::external_parameters: its bf16 shards are the parameters); DDP and ZeRO-1 need the "
                "fp32 masters of --precision bf16");
  check_sharded_optimizer_state(model.optimizer_state(), zero1, fsdp);
  FLASHLM_CHECK(fsdp || !model.external_parameters(),
                "DdpModel: a model built with external_parameters keeps its weights in FSDP's shards: it needs "
                "--ddp fsdp");
  FLASHLM_CHECK(fsdp || !options.fsdp_gather_alone,
                "DdpModel: fsdp_gather_alone gathers FSDP's parts at a world of one; it needs --ddp fsdp, not {}",
                ddp_variant_name(options.variant));
  FLASHLM_CHECK(!fsdp || (options.fsdp_prefetch >= 0 && options.fsdp_prefetch <= 2),
                "DdpModel: fsdp_prefetch = {}, expected 0, 1 or 2 parts ahead", options.fsdp_prefetch);
  // ZeRO-1 on CUDA: reduce-scatter each bucket into this rank's shard rather than all-reduce it (half the
  // bytes during the backward). Not for fp16 models, whose overflow check (unscale_gradients) reads every
  // gradient; not on the CPU, where ZeRO-1's contiguous layout keeps it bit-identical to CpuModel's AdamW
  // (whose norm chunks the shards follow). FSDP always.
  DdpOptions sync = options;
  sync.reduce_scatter = fsdp || (zero1 && model.device() == Device::cuda && model.precision() != DType::f16 &&
                                 reduce_scatter_obstacle(params, options).empty());
  ddp_ = std::make_unique<DataParallel>(comm, params, sync);
  if (fsdp) {
    zero_ = std::make_unique<ZeroOptimizer>(comm, params, ddp_->buckets(), false);
    fsdp_ = std::make_unique<FsdpParameters>(comm, params, ddp_->buckets(), options.fsdp_prefetch,
                                             options.fsdp_poison_freed, options.fsdp_gather_alone);
    if (model.external_parameters()) {
      // Sharded storage: this rank's shards, the pool and the gradient buffers are all that hold them.
      const bool pure = model.bf16_pure();
      // --precision fp8, tensorwise: the layers' FP8 weights arrive as the e4m3 bytes their GEMMs read.
      std::vector<DdpRange> fp8_groups;
      if (model.fsdp_fp8_gather()) {  // ModelOptions::fsdp_fp8_gather: CPU and CUDA
        for (const Fp8ScaleGroup& g : fp8_scale_groups(model.layout())) fp8_groups.push_back({g.offset, g.count});
      }
      fsdp_->use_sharded_storage(model_.parameter_storage(), pure ? DType::bf16 : model.working_dtype(), pure,
                                 options.grad_accum, model.stream(),
                                 [this](int64_t offset, int64_t count) { ddp_->await_gradients(offset, count); },
                                 fp8_groups);
      ddp_->route_through(*fsdp_);
      zero_->use_packed_storage();
      if (pure) zero_->use_bf16_state();
      model_.set_gradients_needed_hook(
          [this](int64_t offset, int64_t count) { fsdp_->gradients_needed(offset, count); });
    } else {
      fsdp_->set_storage(model.parameters(), model.working_parameters(), model.precision(), model.stream());
    }
    model_.set_parameters_needed_hook([this](int64_t offset, int64_t count) { fsdp_->needed(offset, count); });
    model_.set_parameters_done_hook([this](int64_t offset, int64_t count) { fsdp_->done(offset, count); });
  } else if (zero1 && sync.reduce_scatter) {
    zero_ = std::make_unique<ZeroOptimizer>(comm, params, ddp_->buckets());
  } else if (zero1) {
    zero_ = std::make_unique<ZeroOptimizer>(comm, params);
  }
  // The sharded optimizer keeps the moments now: a rank holding the model's own as well (a model that
  // stepped alone before, as ddp-bench's plain row does) would hold the optimizer state twice.
  if (zero_) model_.release_optimizer_state();
  // With nothing to reduce, shard or average, the hook would only count reports, and its presence keeps a
  // CUDA model's step out of its graph (CudaModel::train_step): leave it out, and step as the model alone.
  plain_step_ = !ddp_->communicates() && !zero_ && !fsdp_ && options.grad_accum == 1;
  if (!plain_step_) model_.set_gradient_ready_hook(ddp_->hook());
  // The forward waits for each part of ZeRO-1's gather only as it reaches it.
  if (zero_ && !fsdp_) {
    model_.set_parameters_needed_hook(
        [this](int64_t offset, int64_t count) { zero_->await_parameters(offset, count, model_.stream()); });
  }
}

DdpModel::~DdpModel() {
  model_.set_gradient_ready_hook({});
  model_.set_gradients_needed_hook({});
  model_.set_parameters_needed_hook({});
  model_.set_parameters_done_hook({});
  try {
    await_parameters();  // the model outlives this: no gather may still be writing its parameters
  } catch (...) {
  }
}

void DdpModel::await_parameters() {
  if (fsdp_) fsdp_->await_all();
  else if (zero_) zero_->await_parameters(model_.stream());
}

DataParallel& DdpModel::data_parallel() { return *ddp_; }
ZeroOptimizer* DdpModel::zero() { return zero_.get(); }
FsdpParameters* DdpModel::fsdp() { return fsdp_.get(); }
std::string_view DdpModel::gradient_sync() const {
  return ddp_->options().reduce_scatter ? "reduce-scatter" : "all-reduce";
}

DdpMemory DdpModel::memory() const {
  DdpMemory mem;
  const int64_t n = model_.parameter_count(), f32 = int64_t(sizeof(float));
  const int64_t working = model_.working_dtype() != DType::f32 ? int64_t(dtype_size(model_.working_dtype())) : 0;
  if (!fsdp_) {
    mem.parameters = n * (f32 + working);
    mem.gradients = n * f32;
  } else if (model_.bf16_pure()) {
    // This rank's parts and the tails: the bf16 parameters, the fp32 gradients reduced into and their
    // bf16 rounding (ZeroOptimizer::step_bf16).
    mem.parameters = zero_->shard_elements() * int64_t(sizeof(bf16_t));
    mem.gradients = zero_->shard_elements() * (f32 + int64_t(sizeof(bf16_t)));
    mem.gathered = fsdp_->peak_gathered_bytes();
  } else {
    // This rank's parts and the replicated tails, of the masters (and the working copy) and the gradients.
    mem.parameters = zero_->shard_elements() * (f32 + working);
    mem.gradients = zero_->shard_elements() * f32;
    mem.gathered = fsdp_->peak_gathered_bytes();
  }
  mem.model_buffers = fsdp_ && fsdp_->sharded() ? mem.parameters + mem.gradients + fsdp_->buffer_bytes()
                                                : n * (2 * f32 + working);
  // Without a sharded optimizer the model's own moments: fp32, or bf16 (ModelOptions::optimizer_state).
  const int64_t moment = model_.optimizer_state() == OptimizerState::fp32 ? f32 : int64_t(sizeof(bf16_t));
  mem.optimizer_state = zero_ ? zero_->state_bytes() : 2 * n * moment;
  return mem;
}

bool DdpModel::sharded_storage() const { return fsdp_ && fsdp_->sharded(); }

void DdpModel::gather_master_parameters() {
  await_parameters();
  if (sharded_storage()) return;  // nothing holds the whole masters: save_parameters() gathers them to the host
  if (zero_ && zero_->masters_stale()) zero_->gather_masters(model_.parameters(), model_.stream());
}

void DdpModel::gather_parameters() {
  if (fsdp_) fsdp_->gather_all();
}

namespace {

// `count` floats between host memory and memory of `device`.
void copy_floats(float* dst, Device dst_device, const float* src, Device src_device, int64_t count) {
  copy_into(TensorView::contiguous(dst, DType::f32, {count}, dst_device),
            TensorView::contiguous(const_cast<float*>(src), DType::f32, {count}, src_device));
}

}  // namespace

// The fp32 masters this rank keeps: the packed shard, or its runs of the model's flat buffer; bf16-pure:
// its bf16 parameters, widened (to_host) or rounded.
void DdpModel::copy_kept_masters(float* packed_host, bool to_host) {
  const Device device = model_.device();
  if (sharded_storage()) {
    const bool pure = model_.bf16_pure();
    void* shard = pure ? fsdp_->shard_working() : fsdp_->shard_masters();
    if (to_host) values_to_host(packed_host, shard, zero_->shard_elements(), pure, device);
    else values_from_host(shard, packed_host, zero_->shard_elements(), pure, device);
    return;
  }
  int64_t at = 0;
  for (const DdpRange& r : zero_->updated_ranges()) {
    if (to_host) copy_floats(packed_host + at, Device::cpu, model_.parameters() + r.offset, device, r.count);
    else copy_floats(model_.parameters() + r.offset, device, packed_host + at, Device::cpu, r.count);
    at += r.count;
  }
}

void DdpModel::masters_changed() {
  // bf16-pure: the parameters are the shards themselves; the model widens its RMSNorm gains from them.
  if (!sharded_storage() || model_.bf16_pure()) return model_.parameters_changed();
  const DType w = model_.working_dtype();
  if (w == DType::f32) return;
#ifdef FLASHLM_WITH_CUDA
  const int64_t count = zero_->shard_elements();
  if (w == DType::bf16) {
    gpu::cast_from_f32<bf16_t>(fsdp_->shard_masters(), static_cast<bf16_t*>(fsdp_->shard_working()), count,
                               model_.stream());
  } else {
    gpu::cast_from_f32<fp16_t>(fsdp_->shard_masters(), static_cast<fp16_t*>(fsdp_->shard_working()), count,
                               model_.stream());
  }
#endif
}

void DdpModel::save_shard(float* params, float* m, float* v) {
  FLASHLM_CHECK(fsdp_ != nullptr, "DdpModel::save_shard: sharded checkpoints are FSDP's (--ddp fsdp)");
  await_parameters();
  model_.synchronize();
  copy_kept_masters(params, true);
  zero_->save_shard(m, v);
}

void DdpModel::load_shard(const float* params, const float* m, const float* v, int64_t steps) {
  FLASHLM_CHECK(fsdp_ != nullptr, "DdpModel::load_shard: sharded checkpoints are FSDP's (--ddp fsdp)");
  await_parameters();
  model_.synchronize();
  copy_kept_masters(const_cast<float*>(params), false);
  zero_->load_shard(m, v, steps);
  masters_changed();  // the working copy of this rank's parts (the others are gathered)
  fsdp_->release_all();
  model_.synchronize();
}

void DdpModel::load_parameters(const float* host) {
  await_parameters();
  model_.synchronize();
  if (!sharded_storage()) {
    copy_floats(model_.parameters(), model_.device(), host, Device::cpu, model_.parameter_count());
  } else {
    std::vector<float> packed(size_t(zero_->shard_elements()));
    int64_t at = 0;
    for (const DdpRange& r : zero_->updated_ranges()) {
      std::copy_n(host + r.offset, r.count, packed.begin() + at);
      at += r.count;
    }
    copy_kept_masters(packed.data(), false);
    fsdp_->release_all();
  }
  masters_changed();
  model_.synchronize();
}

void DdpModel::init_parameters(uint64_t seed) {
  if (!sharded_storage()) return model_.init_parameters(seed);
  // Each rank computes every parameter's values (the single process's), one parameter at a time through a
  // host buffer, and copies the pieces it keeps into its packed shard: no rank holds more than one
  // parameter's values on the host, nor another rank's parts anywhere.
  await_parameters();
  model_.synchronize();
  const std::vector<ParameterInfo>& layout = model_.layout();
  const std::vector<DdpRange> kept = zero_->updated_ranges();
  std::vector<int64_t> kept_at(kept.size());
  for (size_t k = 1; k < kept.size(); ++k) kept_at[k] = kept_at[k - 1] + kept[k - 1].count;
  std::vector<float> values;
  for (const ParameterInfo& p : layout) {
    values.resize(size_t(p.numel()));
    init_parameter_host(p, values.data(), seed);
    for (size_t k = 0; k < kept.size(); ++k) {
      const int64_t a = std::max(p.offset, kept[k].offset);
      const int64_t b = std::min(p.offset + p.numel(), kept[k].offset + kept[k].count);
      if (a >= b) continue;
      const int64_t at = kept_at[k] + (a - kept[k].offset);
      if (model_.bf16_pure()) {
        values_from_host(static_cast<bf16_t*>(fsdp_->shard_working()) + at, values.data() + (a - p.offset), b - a,
                         true, model_.device());
      } else {
        copy_floats(fsdp_->shard_masters() + at, model_.device(), values.data() + (a - p.offset), Device::cpu, b - a);
      }
    }
  }
  fsdp_->release_all();
  masters_changed();
  model_.synchronize();
}

void DdpModel::save_parameters(Communicator& comm, float* host) {
  if (!sharded_storage()) {
    gather_master_parameters();
    model_.synchronize();
    copy_floats(host, Device::cpu, model_.parameters(), model_.device(), model_.parameter_count());
    return;
  }
  await_parameters();
  model_.synchronize();
  std::vector<float> packed(size_t(zero_->shard_elements()));
  copy_kept_masters(packed.data(), true);
  const int64_t n = model_.parameter_count();
  std::fill(host, host + n, 0.0f);
  int64_t at = 0;
  for (const DdpRange& r : zero_->updated_ranges()) {
    std::copy_n(packed.begin() + at, r.count, host + r.offset);
    at += r.count;
  }
  // Every rank's parts into place on every rank (the tails are equal everywhere).
  std::vector<Communicator::Segment> segments;
  for (const ZeroBucketShard& z : zero_bucket_layout(ddp_->buckets(), comm.world_size(), comm.rank()).buckets) {
    if (z.part > 0) segments.push_back({z.offset, z.part});
  }
  comm.all_gather_segments(TensorView::contiguous(host, DType::f32, {n}), segments);
}

void DdpModel::broadcast_parameters() {
  // Sharded storage: no rank holds another's parts to send; every rank computed (init_parameters) or read
  // (load_parameters) the same values and kept its own.
  if (sharded_storage()) return;
  await_parameters();
  ddp_->broadcast_parameters(model_.parameters(), model_.stream());
  model_.parameters_changed();
  if (fsdp_) fsdp_->mark_whole();
}

double DdpModel::forward_backward(std::span<const int32_t> tokens, std::span<const int32_t> targets) {
  const int64_t accum = ddp_->options().grad_accum;
  check_batch("DdpModel::forward_backward", tokens, targets);
  model_.zero_grad();
  if (fsdp_) {
    fsdp_->hold(false);  // a gather_parameters() before (evaluation) ends here
    fsdp_->zero_gradients();
  }
  float* grads = sharded_storage() ? fsdp_->shard_gradients() : nullptr;
  double loss = 0;
  for (int64_t k = 0; k < accum; ++k) {
    if (fsdp_) fsdp_->begin_pass(false);
    loss += model_.forward(tokens.data() + k * micro_tokens_, targets.data() + k * micro_tokens_);
    // ZeRO-1: every part was waited for by the forward already; the backward reads them too. FSDP gathers
    // again for the backward, part by part.
    if (fsdp_) fsdp_->begin_pass(true);
    else await_parameters();
    const bool sync = k + 1 == accum;
    ddp_->begin_backward(grads ? grads : model_.gradients(), sync, model_.stream());
    {
#ifdef FLASHLM_WITH_CUDA
      // While the all-reduces overlap the backward they hold SMs: plan the GEMMs for the rest (at a world
      // of one nothing overlaps, and the GEMMs are planned as in the step without DDP).
      const DdpVariant v = ddp_->options().variant;
      const bool overlapped = sync && model_.device() == Device::cuda && ddp_->communicates() &&
                              (v == DdpVariant::async || v == DdpVariant::bucketed || v == DdpVariant::fsdp);
      const ScopedGemmSmReserve reserve(overlapped ? gemm_sm_reserve_ : gemm_sm_reserve());
#endif
      model_.backward();
    }
    ddp_->finish_backward();
  }
  return loss / double(accum);
}

bool DdpModel::optimizer_step(const AdamWConfig& c, double lr, double* norm) {
  // The gradients are equal on every rank, and so is an fp16 overflow and its skipped step.
  if (!zero_) return flashlm::optimizer_step(model_, c, lr, norm);
  if (!model_.unscale_gradients()) return false;
  // A low-precision CUDA model: the update writes this rank's shard of the working copy too, and the ranks
  // gather only that copy (half the bytes of the fp32 masters, no recast of the whole model).
  const bool packed = sharded_storage();
  if (packed && model_.bf16_pure()) {
    const double before = zero_->step_bf16(static_cast<bf16_t*>(fsdp_->shard_working()), fsdp_->shard_gradients(), c,
                                           lr, model_.stream());
    fsdp_->release_all();
    model_.parameters_changed();  // the widened RMSNorm gains, from the updated bf16 shard
    if (norm) *norm = before;
    return true;
  }
  void* working = packed ? fsdp_->shard_working() : model_.working_parameters();
  float* params = packed ? fsdp_->shard_masters() : model_.parameters();
  float* grads = packed ? fsdp_->shard_gradients() : model_.gradients();
  const double before = working ? zero_->step(params, grads, working, model_.precision(), c, lr, model_.stream())
                                : zero_->step(params, grads, c, lr, model_.stream());
  if (fsdp_) fsdp_->release_all();  // the other ranks' parts are gathered when the next forward reads them
  else if (!working) model_.parameters_changed();
  if (norm) *norm = before;
  return true;
}

void DdpModel::check_batch(const char* fn, std::span<const int32_t> tokens, std::span<const int32_t> targets) const {
  const int64_t accum = ddp_->options().grad_accum;
  FLASHLM_CHECK(static_cast<int64_t>(tokens.size()) == accum * micro_tokens_ && targets.size() == tokens.size(),
                "{}: {} tokens and {} targets, expected grad_accum {} x {} of each", fn, tokens.size(), targets.size(),
                accum, micro_tokens_);
}

StepResult DdpModel::train_step(std::span<const int32_t> tokens, std::span<const int32_t> targets,
                                const AdamWConfig& c, double lr) {
  if (!plain_step_) {
    StepResult r;
    r.loss = forward_backward(tokens, targets);
    r.updated = optimizer_step(c, lr, &r.grad_norm);
    return r;
  }
  check_batch("DdpModel::train_step", tokens, targets);
  return model_.train_step(tokens.data(), targets.data(), c, lr);
}

int64_t DdpModel::optimizer_steps() const { return zero_ ? zero_->steps() : model_.optimizer_steps(); }

}  // namespace flashlm
