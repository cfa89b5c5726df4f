// Data parallelism: every rank holds the whole model, trains on its slice of each batch, and the gradients
// are averaged across ranks before each optimizer step (DDP). This header is the gradient synchronisation:
// the parameters as data parallelism sees them, the buckets, and DataParallel with its variants. It works on
// a model's flat fp32 parameter and gradient buffers (a layout of named parameters in CPU or CUDA memory),
// not on a particular model. ZeRO-1's sharded optimizer is in flashlm/zero.h, FSDP's parameter lifetime in
// flashlm/fsdp.h, and DdpModel, which wires them all to a LanguageModel, in flashlm/ddp_model.h.
//
// Ordering on CUDA: a model reports a gradient ready (GradientReadyHook) once the kernels producing it are
// queued on its stream. The all-reduce is then queued on the communicator's stream behind a CUDA event of
// the model's stream (Communicator::all_reduce(x, op, stream)), and finish_backward() makes the model's
// stream wait for the communicator's (Communicator::wait(stream)). The host never waits for the GPU here.
//
// Reduced-precision gradients (DdpOptions::reduce_dtype bf16 or fp16, CUDA only): each bucket's fp32
// gradients are rounded into its 16-bit staging area on the model's stream, averaged in that type by NCCL
// on the communicator's stream (ordered as above), and widened back into the fp32 gradients on the
// communicator's stream right behind the all-reduce; finish_backward() orders the optimizer after all of it.
//
// Reduce-scatter (DdpOptions::reduce_scatter, chosen by DdpModel for ZeRO-1 on CUDA): each bucket is
// reduce-scattered in place instead of all-reduced, straight into the per-bucket ZeRO-1 layout
// (zero_bucket_layout), so that NCCL moves half the bytes of an all-reduce while the backward runs; the
// optimizer then all-gathers the updated parameters. Ordered as the all-reduce above. Afterwards only this
// rank's parts and the replicated tails hold averaged gradients (DataParallel::averaged_ranges()); the
// other elements of the buckets hold unspecified values that nothing may read.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "flashlm/dtype.h"
#include "flashlm/model.h"

namespace flashlm {

class Communicator;
class FsdpParameters;

// How gradients are averaged across ranks.
enum class DdpVariant : uint8_t {
  per_param,  // "per-param": one all-reduce per parameter, after the backward
  flat,       // "flat": one all-reduce over all gradients (packed together), after the backward
  async,      // "async": one all-reduce per parameter, started as its gradient becomes ready in the backward
  bucketed,   // "bucketed": buckets of parameters in reverse order, each all-reduced as soon as it is complete
  // "fsdp": ZeRO-3. Each rank keeps a shard of every linear and embedding weight (and of their gradients and
  // moments); a model part's weights are gathered before it reads them and freed after; each part's
  // gradients are reduce-scattered as soon as they are complete. RMSNorm gains stay whole on every rank.
  fsdp,
};
std::string_view ddp_variant_name(DdpVariant variant);
DdpVariant parse_ddp_variant(std::string_view name);  // flashlm::Error listing the names otherwise
// The element type of the gradient all-reduce: "fp32", "bf16" or "fp16" (dtype names); flashlm::Error otherwise.
DType parse_reduce_dtype(std::string_view name);

// A contiguous run of elements of the flat buffers.
struct DdpRange {
  int64_t offset = 0, count = 0;
};

// The parameters as data parallelism sees them.
struct DdpParameters {
  std::vector<ParameterInfo> layout;  // offsets into the flat fp32 parameter and gradient buffers
  // false: frozen — its gradient is never communicated and it is never updated. Empty: all trainable.
  std::vector<bool> trainable;
  // tied_to[i] = j: parameter i shares parameter j's storage (same offset and shape), so their gradients are
  // one, accumulated by the model from both uses; it is reduced once, as j, after both uses reported it
  // ready. -1 or an empty vector: not tied.
  std::vector<int64_t> tied_to;
  // Parameters the model reads from the fp32 masters although it computes with a low-precision working
  // copy (LanguageModel::master_read_parameters): ZeRO-1 gathers their masters with the copy.
  std::vector<int64_t> read_as_master;
  Device device = Device::cpu;

  static DdpParameters of(const LanguageModel& model);  // every parameter trainable, none tied

  void validate() const;  // flashlm::Error naming the first inconsistency
  int64_t flat_size() const;  // elements of the flat buffers: the end of the last parameter
  int64_t owner(int64_t param) const { return tied_to.empty() || tied_to[size_t(param)] < 0 ? param : tied_to[size_t(param)]; }
  bool is_trainable(int64_t param) const { return trainable.empty() || trainable[size_t(owner(param))]; }
  // The elements of trainable parameters, merged into ascending maximal runs.
  std::vector<DdpRange> trainable_ranges() const;
  // The elements of read_as_master, likewise.
  std::vector<DdpRange> read_as_master_ranges() const;
};

// Parameters whose gradients one collective reduces.
struct DdpBucket {
  std::vector<int64_t> params;  // indices into the layout, in the order given (the order gradients arrive)
  std::vector<DdpRange> ranges;  // their elements as ascending maximal runs of the flat buffer
  int64_t elements = 0;
  // FSDP: parameters kept whole on every rank (one-dimensional ones, the RMSNorm gains): all-reduced and
  // updated everywhere, never sharded (zero_bucket_layout gives them no parts, only a tail).
  bool replicated = false;
};

// Groups `params` (indices into `layout`) in the given order into buckets: a bucket takes the next parameter
// while its fp32 gradients stay within bucket_bytes, and a parameter larger than bucket_bytes gets a bucket
// of its own. bucket_bytes = 0 puts every parameter alone; INT64_MAX puts them all in one bucket.
std::vector<DdpBucket> ddp_buckets(const std::vector<ParameterInfo>& layout, std::span<const int64_t> params,
                                   int64_t bucket_bytes);

struct DdpOptions {
  DdpVariant variant = DdpVariant::bucketed;
  double bucket_mb = 25;   // bucketed: MB (10^6 bytes) of fp32 gradients per bucket, > 0
  int64_t grad_accum = 1;  // micro-steps per optimizer step; only the last one synchronises
  // Element type of the all-reduce. fp32: the gradients themselves. bf16, fp16 (CUDA only: MPI carries fp32
  // and fp64): half the bytes on the wire, at the precision of the 16-bit type (the gradients are rounded to
  // it and NCCL sums in it); fp16 also has fp16's range (above 65504 is inf, below 6e-8 is 0).
  DType reduce_dtype = DType::f32;
  // CUDA, overlapping variants (async, bucketed): SMs the backward's GEMMs leave to NCCL's all-reduce kernels
  // (set_gemm_sm_reserve in model/cuda/gemm.h) on the micro-step that synchronises. -1: the communicator's
  // NCCL max CTAs when set (Communicator::set_nccl_max_ctas; one SM each), else 0. 0: plan for every SM.
  int gemm_sm_reserve = -1;
  // Each bucket reduce-scattered in place into zero_bucket_layout's shards (plus an all-reduce of its tail),
  // for a ZeroOptimizer built on buckets(): half the bytes of the all-reduce during the backward. Needs what
  // reduce_scatter_obstacle() checks. DdpModel sets it for ZeRO-1 on CUDA and for FSDP; on the CPU the
  // overlapping variants reduce-scatter with MPI's non-blocking MPI_Ireduce_scatter_block.
  bool reduce_scatter = false;
  // fsdp: how many model parts ahead of the one being read (in the pass's order: forward, then backward) have
  // their gather started, 0..2. 1: part l+1's gather starts when part l starts.
  int fsdp_prefetch = 1;
  // fsdp, for tests: a freed part's elements this rank does not own are overwritten with NaN, so that a read
  // of a freed weight shows in the loss.
  bool fsdp_poison_freed = false;
  // fsdp, for tests: at a world of one, shard and gather the parts anyway (each rank's part is the whole
  // bucket; the collectives run over the one-rank communicator), so that one process on one GPU exercises
  // the gathers a larger world runs — FSDP's FP8 gather above all. Otherwise a world of one gathers nothing
  // and reads its shards in place. The memory plan does not count the pool it then allocates.
  bool fsdp_gather_alone = false;
};

// The buckets DataParallel launches for `params` under `options`, in launch order (reverse parameter order,
// trainable owners only; per-param and async: one parameter per bucket; flat: one bucket).
std::vector<DdpBucket> ddp_bucket_plan(const DdpParameters& params, const DdpOptions& options);
// The model part a parameter belongs to, the unit FSDP gathers and frees: its name up to the layer index
// ("layers.3." for "layers.3.attn.q_proj.weight"), else up to its first dot ("lm_head."). The models call
// their ParametersNeededHook with exactly these parts' elements.
std::string fsdp_unit_name(std::string_view parameter_name);
// FSDP's buckets: the trainable owners in reverse order (as ddp_bucket_plan), a bucket taking the next
// parameter while it belongs to the same part, is of the same kind (sharded: two or more dimensions;
// replicated: one) and is adjacent in memory, so that every bucket is one contiguous run within one part.
std::vector<DdpBucket> fsdp_bucket_plan(const DdpParameters& params);
// Why DataParallel cannot reduce-scatter with these parameters and options (DdpOptions::reduce_scatter), or
// "" when it can: the bucketed or fsdp variant, fp32 reduction, and every bucket one contiguous range (a frozen or
// tied parameter inside a bucket splits it; the bucket would need packing, and the shard would not be a
// run of the flat buffers).
std::string reduce_scatter_obstacle(const DdpParameters& params, const DdpOptions& options);

// DdpOptions::gemm_sm_reserve with -1 resolved against `comm` (its NCCL max CTAs, 0 when NCCL chooses).
int resolve_gemm_sm_reserve(int requested, const Communicator& comm);

// What the last synchronisation did.
struct DdpStats {
  int64_t collectives = 0;  // all-reduces (reduce_scatter: reduce-scatters, and all-reduces of the tails)
  int64_t elements = 0;     // gradient elements they reduced (a bucket's all, also when reduce-scattered)
  // Communication not hidden by the backward: from the end of the backward's computation until the
  // gradients are synchronised (CPU: host time in finish_backward(); CUDA: between two events of the
  // model's stream).
  double exposed_ms = 0;
};

// Gradient synchronisation. Collective: every rank builds it with the same parameters and options and calls
// the same methods in the same order. Averages over ranks (ReduceOp::avg) and over the grad_accum
// micro-steps.
class DataParallel {
 public:
  DataParallel(Communicator& comm, DdpParameters params, const DdpOptions& options);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  const DdpParameters& parameters() const;
  const DdpOptions& options() const;
  // In launch order: reverse parameter order for every variant (the order a backward produces gradients).
  const std::vector<DdpBucket>& buckets() const;
  // The elements that hold averaged gradients after finish_backward(), ascending: every bucket's ranges;
  // with reduce_scatter only this rank's parts and the tails (zero_bucket_layout).
  const std::vector<DdpRange>& averaged_ranges() const;
  // false at a world of one reducing fp32 (any variant but fsdp): the gradients are already their average,
  // so finish_backward() only divides by grad_accum, gradients_ready() starts nothing, no staging is
  // allocated and last_stats() counts no collective. Every result is the one the collectives would give
  // (each an identity at one rank), bit for bit.
  bool communicates() const;
  // Memory of the staging areas, allocated once at construction on the parameters' device: a bucket of
  // several separate ranges is packed there for its all-reduce; with a 16-bit reduce_dtype every bucket is
  // rounded into its own area (2 bytes per communicated element). Several buckets may be in flight at once,
  // so the areas are not shared.
  int64_t staging_bytes() const;

  // Every rank's parameters := rank 0's, all of them (frozen ones too), so that the ranks start equal.
  // params: the flat buffer; CUDA: queued after the work on `stream`, which waits for it.
  void broadcast_parameters(float* params, void* stream = nullptr);

  // Brackets one micro-step's backward. sync: the last micro-step of grad_accum, whose gradients (the
  // accumulated ones) are synchronised; the others communicate nothing. grads: the flat gradient buffer;
  // stream: the model's (CUDA).
  void begin_backward(float* grads, bool sync, void* stream = nullptr);
  // The model's GradientReadyHook: the gradients of parameters [first, last] are final. async and bucketed
  // start a bucket's all-reduce when its last gradient (both uses of a tied one) has arrived; buckets start
  // in order.
  void gradients_ready(int64_t first, int64_t last);
  GradientReadyHook hook();  // calls gradients_ready
  // Starts the buckets not started yet and completes the synchronisation: then the trainable gradients are
  // averaged over ranks and micro-steps (CPU: in memory; CUDA: for work queued on the stream afterwards);
  // with reduce_scatter only averaged_ranges() are.
  void finish_backward();
  // The last synchronisation's numbers (CUDA: waits for its events).
  DdpStats last_stats();
  // FSDP's sharded storage: the gradients are read from FsdpParameters::gradient_source() and reduced into
  // its packed shard (begin_backward's grads are then fsdp.shard_gradients()). await_gradients: the
  // buckets within these elements have been sent (CPU: their requests waited for; CUDA: the model's stream
  // waits for an event after their collectives), so their gradient buffer may be written again.
  void route_through(FsdpParameters& fsdp);
  void await_gradients(int64_t offset, int64_t count);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashlm
