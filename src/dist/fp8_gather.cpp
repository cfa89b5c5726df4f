// FSDP's FP8 weight gather (dist/fp8_gather.h): the same four steps on the CPU (MPI, the emulation of
// model/fp8.h) and on CUDA (NCCL, the casts of model/cuda/fp8.h, queued on the caller's stream).
#include "dist/fp8_gather.h"

#include <vector>

#include "core/check.h"
#include "flashlm/device.h"
#include "flashlm/zero.h"
#include "model/fp8.h"
#ifdef FLASHLM_WITH_CUDA
#include "model/cuda/fp8.h"
#endif

namespace flashlm {

namespace {

// FP8 training's weights are e4m3 (model/fp8.h): the gathered copy is their GEMMs' operand as it stands.
constexpr Fp8Format kWeightFormat = Fp8Format::e4m3;

TensorView flat(void* data, DType dtype, int64_t count, Device device) {
  return TensorView::contiguous(data, dtype, {count}, device);
}

#ifdef FLASHLM_WITH_CUDA
// The width a run of elements is cast in: fp8_cast works in 32 × 32 tiles, so a long run cast as one row
// would leave 31 of every 32 tile rows idle.
constexpr int64_t kCastRow = 1024;

// q[n] = e4m3(x[n] · fp8_scale(*amax)), *dequant = its dequantisation scale (written when n >= 1).
template <class T>
void encode_run(const T* x, int64_t n, const float* amax, uint8_t* q, float* dequant, void* stream) {
  const int64_t rows = n / kCastRow, rest = n % kCastRow;
  if (rows > 0) gpu::fp8_cast(x, rows, kCastRow, amax, kWeightFormat, q, nullptr, dequant, stream);
  if (rest > 0) {
    gpu::fp8_cast(x + rows * kCastRow, 1, rest, amax, kWeightFormat, q + rows * kCastRow, nullptr, dequant, stream);
  }
}

template <class T>
void gather_cuda(Communicator& comm, const T* x, const FsdpWeightSplit& split, uint8_t* q, float* amaxes,
                 float* scales, void* stream) {
  const int world = comm.world_size(), rank = comm.rank();
  gpu::fp8_amax(x, split.shard(), amaxes + rank, stream);
  comm.all_gather(flat(amaxes + rank, DType::f32, 1, Device::cuda), flat(amaxes, DType::f32, world, Device::cuda),
                  stream);
  comm.wait(stream);
  // The ranks' amaxes are >= 0 or NaN, so their largest magnitude is their max, a NaN winning.
  float* amax = scales + kFp8AmaxIndex;
  gpu::fp8_amax(amaxes, world, amax, stream);
  encode_run(x, split.part, amax, q + rank * split.part, scales + kFp8DequantIndex, stream);
  encode_run(x + split.part, split.tail, amax, q + world * split.part, scales + kFp8DequantIndex, stream);
  const Communicator::Segment parts[] = {{0, split.part}};
  comm.all_gather_segments(flat(q, DType::f8e4m3, split.count, Device::cuda), parts, stream);
  comm.wait(stream);
}
#endif

}  // namespace

FsdpWeightSplit fsdp_weight_split(int64_t count, int world) {
  FLASHLM_CHECK_ARG(count >= 1, "fsdp_weight_split: a weight of {} elements, expected >= 1", count);
  DdpBucket bucket;
  bucket.ranges = {{0, count}};
  bucket.elements = count;
  const ZeroBucketShard s = zero_bucket_layout(std::span(&bucket, 1), world, 0).buckets.front();
  return {count, s.part, s.tail.count};
}

Fp8WeightGather::Fp8WeightGather(Communicator& comm, Device device) : comm_(comm), device_(device) {
  if (device != Device::cuda) return;
  FLASHLM_CHECK_ARG(Communicator::nccl_built(),
                    "Fp8WeightGather: a CUDA gather needs NCCL, and flashlm was built without it{}",
                    cuda_built() ? "" : " (and without CUDA)");
  comm.setup_cuda();
  amaxes_ = Buffer::allocate(size_t(comm.world_size()) * sizeof(float), Device::cuda,
                             "FP8 weight gather (the ranks' amaxes)");
}

void Fp8WeightGather::check(const TensorView& shard, const TensorView& q, const float* scales) const {
  constexpr const char* fn = "Fp8WeightGather::gather";
  FLASHLM_CHECK_ARG(shard.dtype == DType::f32 || shard.dtype == DType::bf16,
                    "{}: the shard is {}, expected fp32 or bf16 (a weight's master or working copy)", fn,
                    dtype_name(shard.dtype));
  FLASHLM_CHECK_ARG(q.dtype == DType::f8e4m3, "{}: q is {}, expected fp8_e4m3 (the gathered weight's bytes)", fn,
                    dtype_name(q.dtype));
  FLASHLM_CHECK_ARG(shard.device == device_ && q.device == device_, "{}: the shard is on {} and q on {}; this gather "
                    "runs on {}", fn, device_name(shard.device), device_name(q.device), device_name(device_));
  FLASHLM_CHECK_ARG(shard.is_contiguous() && q.is_contiguous(), "{}: the shard ({}) and q ({}) must be contiguous",
                    fn, shard.shape_string(), q.shape_string());
  FLASHLM_CHECK_ARG(q.numel() >= 1 && q.data != nullptr, "{}: q ({}) has no room for a weight", fn, q.shape_string());
  const FsdpWeightSplit split = fsdp_weight_split(q.numel(), comm_.world_size());
  FLASHLM_CHECK_ARG(shard.numel() == split.shard(),
                    "{}: a shard of {} elements; of a weight of {} over {} ranks each rank keeps {} ({} its own, {} "
                    "the tail)",
                    fn, shard.numel(), split.count, comm_.world_size(), split.shard(), split.part, split.tail);
  FLASHLM_CHECK_ARG(shard.data != nullptr, "{}: the shard's data is null", fn);
  const auto* s = static_cast<const char*>(shard.data);
  const auto* b = static_cast<const char*>(q.data);
  const int64_t shard_bytes = checked_mul(shard.numel(), int64_t(dtype_size(shard.dtype)), "the shard's bytes");
  FLASHLM_CHECK_ARG(s + shard_bytes <= b || b + q.numel() <= s,
                    "{}: q overlaps the shard (the gather writes the one while it reads the other)", fn);
  FLASHLM_CHECK_ARG(scales != nullptr, "{}: scales is null", fn);
  const auto misalignment = reinterpret_cast<uintptr_t>(scales) % kFp8ScaleAlignment;
  FLASHLM_CHECK_ARG(device_ == Device::cpu || misalignment == 0,
                    "{}: scales sit {} bytes past a {}-byte boundary (cuBLASLt's FP8 scale pointers must not)", fn,
                    misalignment, kFp8ScaleAlignment);
}

Fp8GatherTraffic Fp8WeightGather::gather(const TensorView& shard, const TensorView& q, float* scales, void* stream) {
  check(shard, q, scales);
  const int world = comm_.world_size(), rank = comm_.rank();
  const FsdpWeightSplit split = fsdp_weight_split(q.numel(), world);
  auto* bytes = static_cast<uint8_t*>(q.data);
  const Fp8GatherTraffic traffic{(world - 1) * split.part, (world - 1) * int64_t(sizeof(float))};
  if (device_ == Device::cuda) {
#ifdef FLASHLM_WITH_CUDA
    auto* amaxes = static_cast<float*>(amaxes_.data());
    if (shard.dtype == DType::bf16) {
      gather_cuda(comm_, shard.ptr<const bf16_t>(), split, bytes, amaxes, scales, stream);
    } else {
      gather_cuda(comm_, shard.ptr<const float>(), split, bytes, amaxes, scales, stream);
    }
#endif
    return traffic;
  }
  // The emulation reads the values widened to fp32, as the CUDA cast does in registers.
  std::vector<float> widened;
  if (shard.dtype == DType::bf16) {
    const auto* b16 = shard.ptr<const bf16_t>();
    widened.resize(size_t(split.shard()));
    for (size_t i = 0; i < widened.size(); ++i) widened[i] = float(b16[i]);
  }
  const float* x = shard.dtype == DType::bf16 ? widened.data() : shard.ptr<const float>();
  std::vector<float> amaxes(static_cast<size_t>(world));
  amaxes[size_t(rank)] = fp8_amax_cpu(x, split.shard());
  comm_.all_gather(flat(&amaxes[size_t(rank)], DType::f32, 1, Device::cpu),
                   flat(amaxes.data(), DType::f32, world, Device::cpu));
  // The ranks' amaxes are >= 0 or NaN, so their largest magnitude is their max, a NaN winning.
  const float amax = fp8_amax_cpu(amaxes.data(), world);
  const float scale = fp8_scale(amax, kWeightFormat);
  fp8_encode_cpu(x, split.part, scale, kWeightFormat, bytes + rank * split.part);
  fp8_encode_cpu(x + split.part, split.tail, scale, kWeightFormat, bytes + world * split.part);
  const Communicator::Segment parts[] = {{0, split.part}};
  comm_.all_gather_segments(flat(bytes, DType::f8e4m3, split.count, Device::cpu), parts);
  scales[kFp8AmaxIndex] = amax;
  scales[kFp8DequantIndex] = fp8_dequant_scale(scale);
  return traffic;
}

}  // namespace flashlm
