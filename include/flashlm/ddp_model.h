// DdpModel: data parallelism (flashlm/ddp.h), ZeRO-1 (flashlm/zero.h) and FSDP (flashlm/fsdp.h) wired to a
// LanguageModel. The train step of `flashlm train` under mpirun and of `flashlm ddp-bench`.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "flashlm/ddp.h"
#include "flashlm/fsdp.h"
#include "flashlm/model.h"
#include "flashlm/zero.h"

namespace flashlm {

class Communicator;

// What one rank holds for data-parallel training, bytes (DdpModel::memory()).
struct DdpMemory {
  int64_t parameters = 0;       // fp32 masters (and the working copy) this rank keeps current
  int64_t gradients = 0;        // fp32 gradients this rank keeps averaged
  int64_t optimizer_state = 0;  // AdamW moments
  int64_t gathered = 0;         // FSDP: peak of the other ranks' parts whole at once (peak_gathered_bytes)
  // What holds parameters and gradients: the model's flat buffers, or under FSDP's sharded storage the shards
  // plus the pool of gathered parts and the gradient buffers (FsdpParameters::buffer_bytes).
  int64_t model_buffers = 0;
};

// The sharded optimizers (ZeroOptimizer: ZeRO-1, and FSDP's) keep fp32 moments for fp32 masters; bf16 moments
// beside the masters are the model's own AdamW's. flashlm::InvalidArgument for moments stored otherwise under
// either: DdpModel checks it, and train before it builds anything.
void check_sharded_optimizer_state(OptimizerState state, bool zero1, bool fsdp);
// ModelOptions::grad_dtype bf16 under data parallelism (any variant): an InvalidArgument saying to use fp32.
void check_data_parallel_grad_dtype(DType grad_dtype);

// DataParallel, and ZeroOptimizer when zero1, wired to a LanguageModel: its buffers, stream and gradient-ready
// hook. The train step of `flashlm train` under mpirun and of `flashlm ddp-bench`. With zero1 on CUDA, when
// reduce_scatter_obstacle() finds none and the model is not fp16 (whose overflow check reads every
// gradient), the buckets are reduce-scattered into ZeRO-1's per-bucket layout; otherwise all-reduced.
class DdpModel {
 public:
  // micro_batch_tokens: batch · seq of the model (the tokens one forward reads).
  // options.variant fsdp: FSDP (implies the sharded optimizer whatever zero1 says; not for fp16 models).
  DdpModel(Communicator& comm, LanguageModel& model, int64_t micro_batch_tokens, const DdpOptions& options,
           bool zero1);
  ~DdpModel();  // removes the model's hook
  DdpModel(const DdpModel&) = delete;
  DdpModel& operator=(const DdpModel&) = delete;

  DataParallel& data_parallel();
  ZeroOptimizer* zero();  // nullptr without zero1 (and fsdp)
  FsdpParameters* fsdp();  // nullptr unless fsdp
  DdpMemory memory() const;
  // How the gradients are synchronised: "reduce-scatter" (ZeRO-1 per bucket, see DdpOptions::reduce_scatter)
  // or "all-reduce".
  std::string_view gradient_sync() const;

  void broadcast_parameters();  // rank 0's to every rank
  // Makes the model's stream wait for a ZeRO-1 gather still in flight after optimizer_step() (the next
  // forward waits for it part by part on its own). Call before reading the parameters otherwise.
  void await_parameters();
  // ZeRO-1 on a low-precision CUDA model gathers only the working copy after each step; this gathers the
  // fp32 masters too (collective; a no-op when they are current). Call before reading model.parameters(),
  // e.g. for a checkpoint.
  void gather_master_parameters();
  // FSDP: every part gathered and kept whole until the next forward_backward() (collective), so that one
  // rank alone may run forwards (evaluation). A no-op otherwise.
  void gather_parameters();
  // FSDP's sharded checkpoints, without communication: this rank's elements of the fp32 masters and their
  // AdamW moments (host arrays of zero()->shard_elements() floats, packed in updated_ranges() order), and
  // back: load_shard() leaves every other rank's parts to the gathers of the next forward, so it replaces
  // broadcast_parameters() at the start. flashlm::Error unless fsdp.
  void save_shard(float* params, float* m, float* v);
  void load_shard(const float* params, const float* m, const float* v, int64_t steps);
  // Whether the model keeps its weights in FSDP's shards (built with ModelOptions::external_parameters).
  bool sharded_storage() const;
  // The whole model's parameters on the host, for every storage. init_parameters: the model's own
  // initialisation (sharded: every rank computes the same values and keeps its runs). load_parameters: a
  // host array of parameter_count() floats (every rank the same; a gathered checkpoint, --init).
  // save_parameters (collective): every rank receives the fp32 masters (a gathered checkpoint).
  void init_parameters(uint64_t seed);
  void load_parameters(const float* host);
  void save_parameters(Communicator& comm, float* host);
  // zero_grad, then grad_accum micro-steps of forward and backward (micro-step k reads tokens and targets
  // [k · micro_batch_tokens, (k + 1) · micro_batch_tokens)), the last one synchronised. Returns the mean loss.
  double forward_backward(std::span<const int32_t> tokens, std::span<const int32_t> targets);
  // fp16 unscaling, clipping to c.max_grad_norm and AdamW (ZeRO-1's with zero1). false: an fp16 overflow,
  // the step is skipped on every rank. *norm (if given): the gradient norm before clipping.
  bool optimizer_step(const AdamWConfig& c, double lr, double* norm = nullptr);
  // One training step: forward_backward, then optimizer_step (loss: the mean of this rank's micro-steps).
  // Where data parallelism has nothing to do (a world of one, fp32 reduction, no sharding, no accumulation),
  // the model's own train_step, which on CUDA is one graph: no hook then runs on the host inside the step.
  StepResult train_step(std::span<const int32_t> tokens, std::span<const int32_t> targets, const AdamWConfig& c,
                        double lr);
  int64_t optimizer_steps() const;

 private:
  void copy_kept_masters(float* packed_host, bool to_host);  // zero()->updated_ranges() order
  void masters_changed();  // the working copy of what this rank keeps, after its masters changed
  // tokens and targets hold grad_accum micro-batches of micro_tokens_ each: an Error naming fn otherwise.
  void check_batch(const char* fn, std::span<const int32_t> tokens, std::span<const int32_t> targets) const;

  LanguageModel& model_;
  int64_t micro_tokens_;
  int gemm_sm_reserve_;  // DdpOptions::gemm_sm_reserve resolved
  bool plain_step_ = false;  // train_step is the model's own (see there); the model then has no gradient hook
  std::unique_ptr<DataParallel> ddp_;
  std::unique_ptr<ZeroOptimizer> zero_;
  std::unique_ptr<FsdpParameters> fsdp_;
};

}  // namespace flashlm
