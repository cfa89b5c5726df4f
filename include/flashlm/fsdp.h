// FSDP (ZeRO-3, DdpVariant::fsdp): DataParallel's reduce-scatter (flashlm/ddp.h) over buckets that follow
// the model's parts (fsdp_bucket_plan), the per-bucket ZeroOptimizer (flashlm/zero.h) without its gather
// after the step, and FsdpParameters, which gathers each part's shards when the model is about to read them
// (ParametersNeededHook, a prefetch ahead) and frees them after (ParametersDoneHook). The bucket plan and
// the model parts it follows (fsdp_bucket_plan, fsdp_unit_name) are with the other plans in flashlm/ddp.h.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "flashlm/ddp.h"
#include "flashlm/dtype.h"
#include "flashlm/model.h"

namespace flashlm {

class Communicator;

// What a rank's gathers have brought since FsdpParameters was built, bytes: the other ranks' parts in the
// type each part was gathered in (FP8 ones included); of those, the FP8 gather's e4m3 parts; and the FP8
// gather's amax exchanges (a float per scale group per other rank).
struct FsdpGatherTraffic {
  int64_t bytes = 0, fp8_bytes = 0, fp8_amax_bytes = 0;
};

// FSDP's parameter lifetime over the flat buffers of a model: which parts' weights are whole on this rank.
// After an optimizer step (release_all) each rank holds only its parts of the sharded buckets (and every
// replicated or frozen element). needed(offset, count) — the model's ParametersNeededHook — gathers the
// sharded buckets in those elements unless they are whole or on their way, starts the gathers of the
// `prefetch` parts with shards that followed this one in the last pass of the same kind (begin_pass: a
// forward, or a backward, which reads no embedding; before the first, the layout's neighbours in the
// pass's direction), and waits for those it needs; done() — the ParametersDoneHook — frees them again. A bucket is gathered in the copy the model reads: the working copy
// (bf16/fp16 CUDA model), or the fp32 masters (fp32 models, and DdpParameters::read_as_master: the token
// embedding); under sharded storage with FP8 scale groups, a layer as the e4m3 bytes its FP8 GEMMs read. CUDA: each gather is queued on the communicator's stream behind an event of the model's stream
// and followed by an event of its own, which the model's stream waits for; the host waits for neither.
// CPU: MPI non-blocking all-gathers, waited for in needed(). Collective: every rank makes the same calls.
// Memory, two storages. Full (a model that allocates its flat buffers): the gathers land in place in them, so
// "freeing" bounds what a rank may read, not what it allocates. Sharded (use_sharded_storage(), for a model
// built with ModelOptions::external_parameters): this rank keeps only its parts and the replicated elements,
// packed in ZeroOptimizer::updated_ranges() order (the moments' order), of the masters, the working copy and
// the gradients; a part is gathered into a buffer of a pool of prefetch + 2, allocated once and reused, and
// its backward writes its gradients into one of two gradient buffers, reduce-scattered from there into the
// shard (grad_accum > 1: one whole local gradient buffer instead, PyTorch's no_sync). The model reads both
// through its parameter_storage() table, which needed() and gradients_needed() fill.
class FsdpParameters {
 public:
  // gather_alone (DdpOptions::fsdp_gather_alone, for tests): at a world of one, shard and gather anyway.
  FsdpParameters(Communicator& comm, DdpParameters params, std::span<const DdpBucket> buckets, int prefetch,
                 bool poison_freed, bool gather_alone = false);
  ~FsdpParameters();
  FsdpParameters(const FsdpParameters&) = delete;
  FsdpParameters& operator=(const FsdpParameters&) = delete;

  // The buffers gathered into: the fp32 masters and the model's working copy (nullptr: none); `stream` the
  // model's (CUDA).
  void set_storage(float* masters, void* working, DType working_dtype, void* stream);
  // Sharded storage instead (see above): allocates this rank's shards, the pool and the gradient buffers on
  // the parameters' device, and points `table`'s replicated entries at the shards (the others are filled
  // as parts are gathered). Needs every parameter trainable and untied. await_gradients(offset, count): makes
  // a gradient buffer reusable once the reduce-scatter of those elements is done (DataParallel's).
  // pure (bf16-pure, working_dtype bf16): no fp32 masters at all; the bf16 shard is the parameters, every
  // part is gathered in bf16, and the gradients stay fp32 (the backward's accumulator, reduce-scattered in
  // fp32; ZeroOptimizer::step_bf16 rounds them once).
  // fp8_groups (ModelOptions::fsdp_fp8_gather; fp8_scale_groups of model/fp8.h, ascending): a part holding
  // such groups — a layer, whose sharded elements are its FP8 GEMMs' weights — is gathered as the e4m3
  // bytes those GEMMs read (Fp8WeightGather::gather_groups: one amax per group over every rank, then one
  // byte an element on the wire), into a pool buffer of a byte an element; its table entries point at the
  // bytes with fp8_scales at their group's scale slot, and master null (the CPU model decodes them; CUDA's
  // Fp8Linear multiplies them as they stand, and transposes them for its dx product).
  void use_sharded_storage(std::span<ParameterStorage> table, DType working_dtype, bool pure, int64_t grad_accum,
                           void* stream, std::function<void(int64_t, int64_t)> await_gradients,
                           std::span<const DdpRange> fp8_groups = {});
  bool sharded() const;
  // Sharded storage: this rank's packed elements (ZeroOptimizer's order) of the masters (nullptr for
  // bf16-pure), the working copy (nullptr for fp32 weights; bf16-pure: the parameters) and the gradients, and where the element `offset` of the flat layout is
  // kept there (an element this rank updates), or written by the backward (gradient_source; the bucket's
  // first element: the whole bucket's gradient follows it).
  float* shard_masters() const;
  void* shard_working() const;
  float* shard_gradients() const;
  int64_t packed_index(int64_t offset) const;
  float* gradient_source(int64_t offset) const;
  void gradients_needed(int64_t offset, int64_t count);  // the model's GradientsNeededHook
  void zero_gradients();  // before a step's first backward (CPU; the CUDA model overwrites after zero_grad)
  // Bytes of the pool and the gradient buffers (and the whole local gradients under grad_accum > 1, and the
  // FP8 gather's scale slots).
  int64_t buffer_bytes() const;
  void begin_pass(bool backward);  // the order of the prefetch: the parts ascending, or descending
  void needed(int64_t offset, int64_t count);
  void done(int64_t offset, int64_t count);
  void release_all();   // after an optimizer step: only this rank's parts are current
  void mark_whole();    // after a broadcast or a gather of everything: every part is whole everywhere
  // Collective: gathers every part and keeps them whole until release_all() or hold(false) (evaluation on
  // rank 0 alone must not call a collective).
  void gather_all();
  void hold(bool keep);
  void await_all();  // CUDA: the model's stream waits for every gather in flight; CPU: waits for them
  int64_t units() const;  // model parts (fsdp_unit_name) with sharded buckets
  // Whether every sharded bucket within these elements holds only this rank's part (for checks and tests).
  bool released(int64_t offset, int64_t count) const;
  // The most bytes of other ranks' parts whole (or arriving) at once when a gather started, in the type they
  // are gathered in: the gathered buffers a model reading its weights from a pool would need. (The whole
  // model that every rank holds after a broadcast, before the first step, is not counted.)
  int64_t peak_gathered_bytes() const;
  FsdpGatherTraffic gather_traffic() const;
  int64_t fp8_units() const;  // sharded storage: parts gathered in FP8 (use_sharded_storage's fp8_groups)

 private:
  void needed_sharded(int64_t offset, int64_t count);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashlm
