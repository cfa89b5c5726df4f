// Data parallelism: every rank holds the whole model, trains on its slice of each batch, and the gradients
// are averaged across ranks before each optimizer step (DDP); ZeRO-1 also shards the AdamW moments, so that
// each rank updates only its shard of the parameters and then gathers the rest. Both work on a model's flat
// fp32 parameter and gradient buffers (a layout of named parameters in CPU or CUDA memory), not on a
// particular model; DdpModel wires them to a LanguageModel.
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
//
// FSDP (ZeRO-3, DdpVariant::fsdp): the same reduce-scatter, over buckets that follow the model's parts
// (fsdp_bucket_plan), the same per-bucket ZeRO optimizer without its gather after the step, and
// FsdpParameters, which gathers each part's shards when the model is about to read them
// (ParametersNeededHook, a prefetch ahead) and frees them after (ParametersDoneHook).
#pragma once
#include <cstdint>
#include <functional>
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

// The model part a parameter belongs to, the unit FSDP gathers and frees: its name up to the layer index
// ("layers.3." for "layers.3.attn.q_proj.weight"), else up to its first dot ("lm_head."). The models call
// their ParametersNeededHook with exactly these parts' elements.
std::string fsdp_unit_name(std::string_view parameter_name);
// FSDP's buckets: the trainable owners in reverse order (as ddp_bucket_plan), a bucket taking the next
// parameter while it belongs to the same part, is of the same kind (sharded: two or more dimensions;
// replicated: one) and is adjacent in memory, so that every bucket is one contiguous run within one part.
std::vector<DdpBucket> fsdp_bucket_plan(const DdpParameters& params);

// ZeRO-1's per-bucket shard layout, for a reduce-scatter whose output is the shard itself. A bucket that is
// one contiguous run of E elements at `offset` is cut into world parts of part = E / world elements: rank r
// owns [offset + r·part, offset + (r + 1)·part), exactly what an in-place reduce-scatter of the bucket's
// first world·part elements leaves averaged on rank r. The tail, the last E % world (< world) elements, is
// owned by every rank: all-reduced, and updated identically everywhere. A replicated bucket is all tail.
struct ZeroBucketShard {
  int64_t offset = 0;  // the bucket's first element of the flat buffers
  int64_t part = 0;    // elements each rank owns
  DdpRange owned;      // this rank's part: {offset + rank · part, part}
  DdpRange tail;       // replicated on every rank: {offset + world · part, E % world}
};
struct ZeroBucketLayout {
  std::vector<ZeroBucketShard> buckets;  // in the order of the buckets given
  int64_t shard_elements = 0;            // Σ part + tail: the elements whose AdamW moments this rank keeps
};
// flashlm::Error when a bucket is not one contiguous range, or rank is not within [0, world).
ZeroBucketLayout zero_bucket_layout(std::span<const DdpBucket> buckets, int world, int rank);

struct DdpOptions {
  DdpVariant variant = DdpVariant::bucketed;
  double bucket_mb = 25;   // bucketed: MB (10^6 bytes) of fp32 gradients per bucket, > 0
  int64_t grad_accum = 1;  // micro-steps per optimizer step; only the last one synchronises
  // Element type of the all-reduce. fp32: the gradients themselves. bf16, fp16 (CUDA only: MPI carries fp32
  // and fp64): half the bytes on the wire, at the precision of the 16-bit type (the gradients are rounded to
  // it and NCCL sums in it); fp16 also has fp16's range (above 65504 is inf, below 6e-8 is 0).
  DType reduce_dtype = DType::f32;
  // CUDA, overlapping variants (async, bucketed): SMs the backward's GEMMs leave to NCCL's all-reduce kernels
  // (set_gemm_sm_reserve in model/gemm_cuda.h) on the micro-step that synchronises. -1: the communicator's
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
};

// The buckets DataParallel launches for `params` under `options`, in launch order (reverse parameter order,
// trainable owners only; per-param and async: one parameter per bucket; flat: one bucket).
std::vector<DdpBucket> ddp_bucket_plan(const DdpParameters& params, const DdpOptions& options);
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

// ZeRO-1: the AdamW moments sharded across ranks. Each rank keeps the moments of its shard, clips and
// updates it with CpuModel's / CudaModel's AdamW arithmetic, and the ranks then gather each other's updated
// shards. Frozen parameters are not updated. Collective, as DataParallel. Two layouts:
//   contiguous: the flat parameter vector cut into equal shards of shard_elements() (a multiple of
//     `grain`; the last ranks' shards are padding past the end); reads all-reduced gradients.
//   per bucket (zero_bucket_layout of DataParallel's buckets): rank r owns part r of every bucket and the
//     tails; reads only those gradients, which DataParallel's reduce_scatter leaves averaged, and gathers
//     with one batch of in-place all-gathers, one per bucket.
class ZeroOptimizer {
 public:
  // The contiguous layout. grain: kGradientNormChunk makes the sharded gradient norm add the same partial
  // sums in the same order as the unsharded one, so that on the CPU the result is bit-identical to
  // CpuModel::adamw_step.
  ZeroOptimizer(Communicator& comm, DdpParameters params, int64_t grain = kGradientNormChunk);
  // The per-bucket layout over `buckets` (DataParallel::buckets() with DdpOptions::reduce_scatter): each one
  // contiguous range of trainable elements. The norm adds the ranks' partial sums, so it is not bit-identical
  // to the unsharded one.
  // gather_after_step false (FSDP): step() leaves the other ranks' parts stale; FsdpParameters gathers
  // them when the model reads them, gather_masters() for checkpoints.
  ZeroOptimizer(Communicator& comm, DdpParameters params, std::span<const DdpBucket> buckets,
                bool gather_after_step = true);
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  bool per_bucket() const;         // the per-bucket layout
  int64_t shard_elements() const;  // contiguous: the same on every rank; per bucket: this rank's owned + tails
  // Contiguous layout: this rank's elements of the flat buffers, clipped to the parameters. flashlm::Error
  // in the per-bucket layout, whose shard is one run per bucket (updated_ranges()).
  DdpRange shard() const;
  std::vector<DdpRange> updated_ranges() const;  // the elements this rank updates, ascending
  int64_t state_bytes() const;     // this rank's optimizer state: two moments (fp32; bf16 under use_bf16_state)
  int64_t steps() const;           // AdamW steps taken

  // grads: the averaged gradients (DataParallel's), equal on every rank (per bucket: in the elements this
  // rank updates; no other element is read). Clips the trainable ones to
  // c.max_grad_norm by their global norm (summed across ranks), takes an AdamW step (bias correction from
  // steps()) on this rank's shard, and gathers the updated parameters from every rank (per bucket on CUDA:
  // queues the gather and returns; see await_parameters). Returns the norm
  // before clipping. CUDA: queued on `stream`; the host waits only to read the norm.
  double step(float* params, float* grads, const AdamWConfig& c, double lr, void* stream = nullptr);
  // The same step for a model whose forward reads a low-precision copy `working` (CUDA, bf16 or fp16, the
  // flat layout of params): the update writes this rank's shard of both, and the copy is gathered — half
  // (bf16) the bytes of the fp32 masters, and no recast of the whole model afterwards — with the masters
  // of DdpParameters::read_as_master (packed into one all-gather). The other ranks' shards of the other
  // masters are then stale until gather_masters() (checkpoints); the AdamW arithmetic and the weights the
  // model computes with are the same as with step().
  double step(float* params, float* grads, void* working, DType working_dtype, const AdamWConfig& c, double lr,
              void* stream);
  bool masters_stale() const;
  // FSDP's sharded storage: step() reads and writes params, grads and working packed in updated_ranges()
  // order (shard_elements() of each, as the moments), not the flat buffers. Per bucket, gather_after_step
  // false only.
  void use_packed_storage();
  // bf16-pure under FSDP's packed storage, before the first step: the moments become bf16 (2 bytes each,
  // as the one-process bf16-pure model keeps them) and the model is stepped by step_bf16, not step.
  void use_bf16_state();
  bool bf16_state() const;
  // The bf16-pure step on this rank's packed shard: params the bf16 parameters themselves (no fp32 master),
  // grads the averaged fp32 gradients (DataParallel's reduce-scatter sums in fp32). Each gradient is
  // rounded to bf16 once (nearest even, into a bf16 shard of this optimizer's), and the norm (summed across
  // ranks), the clipping factor and cpu/gpu::adamw_step_bf16 read the rounded values: at one rank the
  // one-process bf16-pure model's arithmetic, whose backward rounds its fp32 accumulator once the same way.
  // Returns the norm before clipping. CUDA: queued on `stream`; the host waits only to read the norm.
  double step_bf16(bf16_t* params, const float* grads, const AdamWConfig& c, double lr, void* stream = nullptr);
  // Per-bucket layout on CUDA: step() returns with the gather of the updated parameters (or working copy)
  // still in flight, in chunks of buckets in ascending order; `stream` must wait for the chunks holding
  // [offset, offset + count) before reading those elements (DdpModel does it from the model's
  // ParametersNeededHook, so the next forward overlaps the gather). The second form waits for all of it.
  // Both return at once when nothing is in flight.
  void await_parameters(int64_t offset, int64_t count, void* stream);
  void await_parameters(void* stream);
  // Gathers every rank's shard of the fp32 masters (after step(..., working, ...)); collective.
  void gather_masters(float* params, void* stream = nullptr);

  // Checkpoints. gather_state: every rank receives the full moments (host arrays of flat_size() floats;
  // per bucket: 0 for elements of no bucket, the frozen ones). load_state: every rank passes the full
  // moments and keeps its shard.
  void gather_state(float* m, float* v);
  void load_state(const float* m, const float* v, int64_t steps);
  // Sharded checkpoints, without communication: this rank's moments as kept, packed in updated_ranges()
  // order (host arrays of shard_elements() floats), and back.
  void save_shard(float* m, float* v) const;
  void load_shard(const float* m, const float* v, int64_t steps);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// FSDP's parameter lifetime over the flat buffers of a model: which parts' weights are whole on this rank.
// After an optimizer step (release_all) each rank holds only its parts of the sharded buckets (and every
// replicated or frozen element). needed(offset, count) — the model's ParametersNeededHook — gathers the
// sharded buckets in those elements unless they are whole or on their way, starts the gathers of the
// `prefetch` parts with shards that followed this one in the last pass of the same kind (begin_pass: a
// forward, or a backward, which reads no embedding; before the first, the layout's neighbours in the
// pass's direction), and waits for those it needs; done() — the ParametersDoneHook — frees them again. A bucket is gathered in the copy the model reads: the working copy
// (bf16/fp16 CUDA model), or the fp32 masters (fp32 models, and DdpParameters::read_as_master: the token
// embedding). CUDA: each gather is queued on the communicator's stream behind an event of the model's stream
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
  FsdpParameters(Communicator& comm, DdpParameters params, std::span<const DdpBucket> buckets, int prefetch,
                 bool poison_freed);
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
  void use_sharded_storage(std::span<ParameterStorage> table, DType working_dtype, bool pure, int64_t grad_accum,
                           void* stream, std::function<void(int64_t, int64_t)> await_gradients);
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
  // Bytes of the pool and the gradient buffers (and the whole local gradients under grad_accum > 1).
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

 private:
  void needed_sharded(int64_t offset, int64_t count);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

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
  int64_t optimizer_steps() const;

 private:
  void copy_kept_masters(float* packed_host, bool to_host);  // zero()->updated_ranges() order
  void masters_changed();  // the working copy of what this rank keeps, after its masters changed
  LanguageModel& model_;
  int64_t micro_tokens_;
  int gemm_sm_reserve_;  // DdpOptions::gemm_sm_reserve resolved
  std::unique_ptr<DataParallel> ddp_;
  std::unique_ptr<ZeroOptimizer> zero_;
  std::unique_ptr<FsdpParameters> fsdp_;
};

}  // namespace flashlm
