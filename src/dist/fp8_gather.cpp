// FSDP's FP8 weight gather (dist/fp8_gather.h): the same four steps on the CPU (MPI, the emulation of
// model/fp8.h) and on CUDA (NCCL, the casts of model/cuda/fp8.h, queued on the caller's stream), for one
// weight (gather: gather_cuda, or the CPU's one-group gather_groups) and for a FSDP part of several scale
// groups (gather_groups: gather_groups_cuda, or the CPU's loop below it).
#include "dist/fp8_gather.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "core/check.h"
#include "flashlm/device.h"
#include "flashlm/zero.h"
#include "model/fp8.h"
#ifdef FLASHLM_WITH_CUDA
#include "core/cuda_runtime.h"
#include "model/cuda/fp8.h"
#endif

namespace flashlm {

namespace {

// FP8 training's weights are e4m3 (model/fp8.h): the gathered copy is their GEMMs' operand as it stands.
constexpr Fp8Format kWeightFormat = Fp8Format::e4m3;

TensorView flat(void* data, DType dtype, int64_t count, Device device) {
  return TensorView::contiguous(data, dtype, {count}, device);
}

// The elements [a, b) that [offset, offset + count) and [at, at + n) share (a >= b: none).
std::pair<int64_t, int64_t> shared(int64_t offset, int64_t count, int64_t at, int64_t n) {
  return {std::max(offset, at), std::min(offset + count, at + n)};
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

// gather_groups on CUDA, queued on `stream` (scratch: G + world·G + pieces device floats). A piece is the
// elements a group and a held run share: its amax reduced on its own, a group's pieces' amaxes combined (NaN
// wins) into this rank's amax of the group; the G amaxes of every rank in one all-gather, each group's slot
// written from its column of them; each piece encoded with its group's scale; the segments all-gathered on the
// communicator's stream, which `stream` waits for unless the gather is left in flight.
template <class T>
void gather_groups_cuda(Communicator& comm, std::span<const Fp8HeldRun> held,
                        std::span<const Communicator::Segment> segments, std::span<const Fp8GatherGroup> groups,
                        const TensorView& q, float* scratch, bool in_flight, void* stream) {
  const int64_t world = comm.world_size(), G = int64_t(groups.size());
  float* mine = scratch;
  float* amaxes = scratch + G;
  float* partials = amaxes + world * G;
  struct Piece {
    const T* x;
    int64_t at, count;
  };
  std::vector<std::vector<Piece>> pieces(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const Fp8HeldRun& r : held) {
      const auto [a, b] = shared(groups[g].offset, groups[g].count, r.at, r.count);
      if (a < b) pieces[g].push_back({static_cast<const T*>(r.values) + (a - r.at), a, b - a});
    }
  }
  float* partial = partials;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<Piece>& p = pieces[g];
    if (p.size() == 1) {
      gpu::fp8_amax(p.front().x, p.front().count, mine + g, stream);
      continue;
    }
    for (size_t k = 0; k < p.size(); ++k) gpu::fp8_amax(p[k].x, p[k].count, partial + k, stream);
    gpu::fp8_amax(static_cast<const float*>(partial), int64_t(p.size()), mine + g, stream);  // none: 0
    partial += p.size();
  }
  comm.all_gather(flat(mine, DType::f32, G, Device::cuda), flat(amaxes, DType::f32, world * G, Device::cuda), stream);
  comm.wait(stream);
  auto* bytes = static_cast<uint8_t*>(q.data);
  for (size_t g = 0; g < groups.size(); ++g) {
    float* slot = groups[g].scales;
    gpu::fp8_scales_from_amaxes(amaxes + g, world, G, kWeightFormat, slot, stream);
    for (const Piece& p : pieces[g]) {
      encode_run(p.x, p.count, slot + kFp8AmaxIndex, bytes + p.at, slot + kFp8DequantIndex, stream);
    }
  }
  comm.all_gather_segments(q, segments, stream);
  if (!in_flight) comm.wait(stream);
}

// The device floats gather_groups_cuda works in.
int64_t groups_scratch_floats(std::span<const Fp8HeldRun> held, std::span<const Fp8GatherGroup> groups, int world) {
  int64_t pieces = 0;
  for (const Fp8GatherGroup& g : groups) {
    for (const Fp8HeldRun& r : held) {
      const auto [a, b] = shared(g.offset, g.count, r.at, r.count);
      pieces += a < b ? 1 : 0;
    }
  }
  return int64_t(groups.size()) * (1 + world) + pieces;
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
  if (device_ == Device::cuda) {
    const Fp8GatherTraffic traffic{(world - 1) * split.part, (world - 1) * int64_t(sizeof(float))};
#ifdef FLASHLM_WITH_CUDA
    auto* bytes = static_cast<uint8_t*>(q.data);
    auto* amaxes = static_cast<float*>(amaxes_.data());
    if (shard.dtype == DType::bf16) {
      gather_cuda(comm_, shard.ptr<const bf16_t>(), split, bytes, amaxes, scales, stream);
    } else {
      gather_cuda(comm_, shard.ptr<const float>(), split, bytes, amaxes, scales, stream);
    }
#endif
    return traffic;
  }
  // On the CPU one weight is a range of one group: this rank's part and the tail held, the parts gathered.
  const auto* values = static_cast<const char*>(shard.data);
  const Fp8HeldRun held[] = {{rank * split.part, split.part, values},
                             {world * split.part, split.tail, values + split.part * int64_t(dtype_size(shard.dtype))}};
  const Communicator::Segment parts[] = {{0, split.part}};
  const Fp8GatherGroup whole[] = {{0, split.count, scales}};
  return gather_groups(held, shard.dtype, parts, whole, q);
}

void Fp8WeightGather::check_groups(std::span<const Fp8HeldRun> held, DType dtype,
                                   std::span<const Communicator::Segment> segments,
                                   std::span<const Fp8GatherGroup> groups, const TensorView& q) const {
  constexpr const char* fn = "Fp8WeightGather::gather_groups";
  FLASHLM_CHECK_ARG(dtype == DType::f32 || dtype == DType::bf16,
                    "{}: the held values are {}, expected fp32 or bf16 (a weight's master or working copy)", fn,
                    dtype_name(dtype));
  FLASHLM_CHECK_ARG(q.dtype == DType::f8e4m3, "{}: q is {}, expected fp8_e4m3 (the gathered range's bytes)", fn,
                    dtype_name(q.dtype));
  FLASHLM_CHECK_ARG(q.device == device_ && q.is_contiguous() && q.numel() >= 1 && q.data != nullptr,
                    "{}: q ({} on {}) must be a contiguous range of at least one element on {}, this gather's device",
                    fn, q.shape_string(), device_name(q.device), device_name(device_));
  FLASHLM_CHECK_ARG(!groups.empty(), "{}: no scale groups", fn);
  const int64_t count = q.numel(), world = comm_.world_size();
  std::vector<Fp8GatherGroup> sorted(groups.begin(), groups.end());
  std::sort(sorted.begin(), sorted.end(), [](const Fp8GatherGroup& a, const Fp8GatherGroup& b) {
    return a.offset < b.offset;
  });
  for (size_t g = 0; g < sorted.size(); ++g) {
    const Fp8GatherGroup& x = sorted[g];
    FLASHLM_CHECK_ARG(x.offset >= 0 && x.count >= 1 && x.offset + x.count <= count,
                      "{}: a scale group [{}, {}) outside the range of {} elements (or empty)", fn, x.offset,
                      x.offset + x.count, count);
    FLASHLM_CHECK_ARG(x.scales != nullptr, "{}: the scale group at {} has no scale slot", fn, x.offset);
    const auto misalignment = reinterpret_cast<uintptr_t>(x.scales) % kFp8ScaleAlignment;
    FLASHLM_CHECK_ARG(device_ == Device::cpu || misalignment == 0,
                      "{}: the scale slot of the group at {} sits {} bytes past a {}-byte boundary (cuBLASLt's FP8 "
                      "scale pointers must not)", fn, x.offset, misalignment, kFp8ScaleAlignment);
    FLASHLM_CHECK_ARG(g == 0 || sorted[g - 1].offset + sorted[g - 1].count <= x.offset,
                      "{}: scale groups [{}, {}) and [{}, {}) overlap", fn, sorted[g - 1].offset,
                      sorted[g - 1].offset + sorted[g - 1].count, x.offset, x.offset + x.count);
  }
  // Every element gathered or held must have a scale: the groups it falls in cover [a, b) whole.
  const auto covered = [&](int64_t a, int64_t b) {
    int64_t n = 0;
    for (const Fp8GatherGroup& x : sorted) {
      const auto [from, to] = shared(x.offset, x.count, a, b - a);
      n += std::max<int64_t>(0, to - from);
    }
    return n == b - a;
  };
  const auto* bytes = static_cast<const char*>(q.data);
  for (const Fp8HeldRun& r : held) {
    FLASHLM_CHECK_ARG(r.at >= 0 && r.count >= 0 && r.at + r.count <= count,
                      "{}: a held run [{}, {}) outside the range of {} elements", fn, r.at, r.at + r.count, count);
    if (r.count == 0) continue;
    FLASHLM_CHECK_ARG(r.values != nullptr, "{}: the held run at {} has no values", fn, r.at);
    FLASHLM_CHECK_ARG(covered(r.at, r.at + r.count), "{}: the held run [{}, {}) is not covered by the scale groups",
                      fn, r.at, r.at + r.count);
    const auto* v = static_cast<const char*>(r.values);
    const int64_t run_bytes = checked_mul(r.count, int64_t(dtype_size(dtype)), "a held run's bytes");
    FLASHLM_CHECK_ARG(v + run_bytes <= bytes || bytes + count <= v,
                      "{}: q overlaps the held run at {} (the gather writes the one while it reads the other)", fn, r.at);
  }
  for (const Communicator::Segment& s : segments) {
    FLASHLM_CHECK_ARG(s.offset >= 0 && s.part >= 0 && s.offset + s.part * world <= count,
                      "{}: a segment of {} ranks' parts of {} from {} outside the range of {} elements", fn, world,
                      s.part, s.offset, count);
    FLASHLM_CHECK_ARG(covered(s.offset, s.offset + s.part * world),
                      "{}: the segment [{}, {}) is not covered by the scale groups", fn, s.offset,
                      s.offset + s.part * world);
  }
}

Fp8GatherTraffic Fp8WeightGather::gather_groups(std::span<const Fp8HeldRun> held, DType dtype,
                                                std::span<const Communicator::Segment> segments,
                                                std::span<const Fp8GatherGroup> groups, const TensorView& q,
                                                CommRequest* request, void* stream) {
  check_groups(held, dtype, segments, groups, q);
  const int world = comm_.world_size(), rank = comm_.rank();
  const size_t G = groups.size();
  Fp8GatherTraffic traffic{0, (world - 1) * int64_t(G) * int64_t(sizeof(float))};
  for (const Communicator::Segment& s : segments) traffic.weight_bytes += s.part * (world - 1);
  if (device_ == Device::cuda) {
#ifdef FLASHLM_WITH_CUDA
    const int64_t floats = groups_scratch_floats(held, groups, world);
    if (int64_t(amaxes_.bytes()) < floats * int64_t(sizeof(float))) {
      cuda_stream_synchronize(stream);  // the last gather's kernels may still read the smaller buffer
      amaxes_ = Buffer::allocate(size_t(floats) * sizeof(float), Device::cuda, "FP8 weight gather (amaxes)");
    }
    auto* scratch = static_cast<float*>(amaxes_.data());
    if (dtype == DType::bf16) {
      gather_groups_cuda<bf16_t>(comm_, held, segments, groups, q, scratch, request != nullptr, stream);
    } else {
      gather_groups_cuda<float>(comm_, held, segments, groups, q, scratch, request != nullptr, stream);
    }
#endif
    return traffic;
  }
  // The emulation reads the values widened to fp32, as the CUDA cast does in registers.
  std::vector<std::vector<float>> widened(held.size());
  std::vector<const float*> values(held.size());
  for (size_t r = 0; r < held.size(); ++r) {
    if (dtype == DType::f32) {
      values[r] = static_cast<const float*>(held[r].values);
      continue;
    }
    const auto* b16 = static_cast<const bf16_t*>(held[r].values);
    widened[r].resize(size_t(held[r].count));
    for (size_t i = 0; i < widened[r].size(); ++i) widened[r][i] = float(b16[i]);
    values[r] = widened[r].data();
  }
  // This rank's amax of each group over what it holds of it (0 where nothing), then every rank's.
  std::vector<float> amaxes(size_t(world) * G, 0.0f);
  float* mine = amaxes.data() + size_t(rank) * G;
  for (size_t r = 0; r < held.size(); ++r) {
    for (size_t g = 0; g < G; ++g) {
      const auto [a, b] = shared(groups[g].offset, groups[g].count, held[r].at, held[r].count);
      if (a < b) mine[g] = fp8_amax_max(mine[g], fp8_amax_cpu(values[r] + (a - held[r].at), b - a));
    }
  }
  comm_.all_gather(flat(mine, DType::f32, int64_t(G), Device::cpu),
                   flat(amaxes.data(), DType::f32, int64_t(world) * int64_t(G), Device::cpu));
  std::vector<float> scale(G);
  for (size_t g = 0; g < G; ++g) {
    // The amaxes are >= 0 or NaN, so their largest magnitude is their max, a NaN winning.
    float amax = 0.0f;
    for (int k = 0; k < world; ++k) amax = fp8_amax_max(amax, amaxes[size_t(k) * G + g]);
    scale[g] = fp8_scale(amax, kWeightFormat);
    groups[g].scales[kFp8AmaxIndex] = amax;
    groups[g].scales[kFp8DequantIndex] = fp8_dequant_scale(scale[g]);
  }
  auto* bytes = static_cast<uint8_t*>(q.data);
  for (size_t r = 0; r < held.size(); ++r) {
    for (size_t g = 0; g < G; ++g) {
      const auto [a, b] = shared(groups[g].offset, groups[g].count, held[r].at, held[r].count);
      if (a < b) fp8_encode_cpu(values[r] + (a - held[r].at), b - a, scale[g], kWeightFormat, bytes + a);
    }
  }
  if (request) {
    *request = comm_.all_gather_segments_async(q, segments);
  } else {
    comm_.all_gather_segments(q, segments);
  }
  return traffic;
}

}  // namespace flashlm
