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
#pragma once
#include <cstdint>

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

  Device device() const { return device_; }

 private:
  void check(const TensorView& shard, const TensorView& q, const float* scales) const;

  Communicator& comm_;
  Device device_;
  Buffer amaxes_;  // CUDA: the ranks' amaxes, one float each
};

}  // namespace flashlm
