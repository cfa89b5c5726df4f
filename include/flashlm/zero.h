// ZeRO-1: the AdamW moments sharded across ranks, over DataParallel's gradients (flashlm/ddp.h). Each rank
// updates only its shard of the parameters and then gathers the rest; FSDP (flashlm/fsdp.h) uses the same
// optimizer per bucket without the gather.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "flashlm/ddp.h"
#include "flashlm/dtype.h"
#include "flashlm/model.h"

namespace flashlm {

class Communicator;

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

}  // namespace flashlm
