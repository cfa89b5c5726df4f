// FSDP's FP8 weight gather (--precision fp8): a sharded weight gathered whole as the e4m3 copy its FP8 GEMM
// reads (model/fp8.h), at one byte an element on the wire instead of bf16's two or fp32's four. Each rank
// holds FSDP's shard of the weight (fsdp_weight_split); the gather
//   1. takes the shard's amax (max |x|, a NaN wins: fp8_amax_cpu / gpu::fp8_amax);
//   2. all-gathers the ranks' amaxes and takes their max the same way: the weight's amax. Gathered (one
//      float a rank), not all-reduced with ReduceOp::max: MPI leaves MAX with a NaN undefined (OpenMPI's
//      a > b ? a : b keeps it in one operand order only) and NCCL does not document it, while a NaN on
//      one rank must make every rank's copy NaN, as it makes fp8_quantize_cpu's;
//   3. encodes the shard to e4m3 with scale = fp8_scale(that amax), tensorwise current scaling;
//   4. all-gathers the encoded parts in place (Communicator::all_gather_segments) into the whole weight.
// The scale depends only on the weight's amax and the encoding is elementwise, so every rank ends with the
// bytes and dequantisation scale fp8_quantize_cpu gives the unsharded weight, bit for bit. The CPU (MPI)
// and CUDA (NCCL; the casts of model/cuda/fp8.h) paths are one function apart in fp8_gather.cpp.
//
// gather_groups is the same for a whole FSDP part (FsdpParameters under ModelOptions::fsdp_fp8_gather), on
// the CPU and on CUDA: a layer's sharded buckets hold several weights, each with its own scale (q, k and v
// one), and a rank's part of a bucket crosses weights. So each rank takes one amax per scale group over the
// elements it holds of it, the ranks exchange the G amaxes in one all-gather, and each element is encoded
// with its group's scale: every group's bytes and scale are again the unsharded weight's, bit for bit — on
// CUDA the bytes and scale the plain FP8 step's cast of the whole bf16 weight writes (Fp8Linear).
#pragma once
#include <cstdint>
#include <span>

#include "flashlm/dist.h"
#include "flashlm/memory.h"
#include "flashlm/tensor.h"

namespace flashlm {

// How FSDP shards a weight of `count` elements over `world` ranks: zero_bucket_layout's rule for one
// bucket. Rank r owns elements [r·part, (r + 1)·part), and every rank keeps the tail, the last
// count − world·part (< world) elements. A rank's shard is its part followed by the tail, as FSDP's packed
// storage holds a bucket's runs. A weight smaller than the world is all tail: nothing to gather.
struct FsdpWeightSplit {
  int64_t count = 0;  // the whole weight's elements
  int64_t part = 0;   // each rank's own elements: count / world
  int64_t tail = 0;   // the last count mod world elements, on every rank
  int64_t shard() const { return part + tail; }
};
FsdpWeightSplit fsdp_weight_split(int64_t count, int world);

// What one gather brought to this rank: the other ranks' encoded parts (bf16's gather of the same shard
// brings twice the weight bytes, fp32's four times) and their amaxes (one float each).
struct Fp8GatherTraffic {
  int64_t weight_bytes = 0, amax_bytes = 0;
};

// gather_groups' arguments. A run of elements this rank holds of the gathered range: `count` values (fp32
// or bf16, as the call says) at `values`, whose place in the range is [at, at + count).
struct Fp8HeldRun {
  int64_t at = 0, count = 0;
  const void* values = nullptr;
};
// Elements [offset, offset + count) of the range that share one scale, and their scale slot of
// kFp8ScaleSlotFloats floats (model/fp8.h): the group's amax and dequantisation scale on return.
struct Fp8GatherGroup {
  int64_t offset = 0, count = 0;
  float* scales = nullptr;
};

class Fp8WeightGather {
 public:
  // Gathers weights on `device` among `comm`'s ranks: Device::cpu through MPI, Device::cuda through NCCL on
  // the communicator's GPU (collective then: it calls comm.setup_cuda()), holding one device float per
  // rank for their amaxes. An Error for CUDA in a build without NCCL.
  Fp8WeightGather(Communicator& comm, Device device);

  // Collective: every rank passes its shard of the same weight. shard: this rank's part then the tail
  // (fsdp_weight_split(q.numel(), world).shard() elements, fp32 or bf16, contiguous). q: the whole weight's
  // place, fp8_e4m3 and contiguous, q.numel() >= 1: its e4m3 bytes on return. scales: one operand's slot of
  // kFp8ScaleSlotFloats floats (model/fp8.h; 16-byte aligned on CUDA, cuBLASLt's rule): the weight's amax
  // at kFp8AmaxIndex, its dequantisation scale at kFp8DequantIndex. All on the gather's device. CPU:
  // blocking. CUDA: queued on `stream`, without a host synchronisation (q and scales are ready to work
  // queued on `stream` after this call).
  Fp8GatherTraffic gather(const TensorView& shard, const TensorView& q, float* scales, void* stream = nullptr);

  // Collective: a range of several scale groups, as FSDP holds a model part. q: the range's place,
  // fp8_e4m3, contiguous, on the gather's device: on return (or after wait(*request)) every element of a
  // segment or a held run holds its e4m3 byte (the range's other elements are left as they are). held: this
  // rank's elements (its part of each segment, and the tails every rank keeps), of type `dtype` (fp32 or
  // bf16), on the gather's device. segments: the parts the ranks hold, as Communicator::all_gather_segments
  // takes them (relative to q). groups: disjoint, together covering every held element and every segment's
  // elements; each group's amax is taken over its elements on every rank (NaN wins) and written to its slot
  // (on the gather's device; 16-byte aligned on CUDA) with its dequantisation scale, and its elements are
  // encoded with fp8_scale of that amax. Every rank passes the same segments and groups.
  // CPU: request null, blocking; else the bytes' all-gather is left in flight there (the scales are written
  // before return). CUDA: everything queued on `stream` without a host synchronisation (the first call with
  // more groups or pieces than before synchronises `stream` to grow the gather's device scratch): the
  // groups' amaxes (one reduction per piece a group shares with a held run), one all-gather of the G amaxes
  // (`stream` waits for it: the encoding needs the scales), the encoding, and the bytes' all-gather on the
  // communicator's stream; request null: `stream` waits for that too; else (*request is left as it is) the
  // all-gather is left in flight, and the caller orders the bytes' readers after the communicator's stream
  // (an event recorded there, as FSDP does, or Communicator::wait).
  Fp8GatherTraffic gather_groups(std::span<const Fp8HeldRun> held, DType dtype,
                                 std::span<const Communicator::Segment> segments, std::span<const Fp8GatherGroup> groups,
                                 const TensorView& q, CommRequest* request = nullptr, void* stream = nullptr);

  Device device() const { return device_; }

 private:
  void check(const TensorView& shard, const TensorView& q, const float* scales) const;
  void check_groups(std::span<const Fp8HeldRun> held, DType dtype, std::span<const Communicator::Segment> segments,
                    std::span<const Fp8GatherGroup> groups, const TensorView& q) const;

  Communicator& comm_;
  Device device_;
  Buffer amaxes_;  // CUDA: the ranks' amaxes (gather: one float each; gather_groups: its scratch)
};

}  // namespace flashlm
