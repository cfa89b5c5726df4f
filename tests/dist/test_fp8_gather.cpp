// FSDP's FP8 weight gather (dist/fp8_gather.h) on the CPU, run by CTest as one process and under
// `mpirun -np 2` and `-np 4` (main: mpi_test_main.cpp). Every rank ends with the bytes and scales
// fp8_quantize_cpu gives the unsharded weight, bit for bit: fp32 and bf16 shards of fresh random weights
// (a seed from rank 0, printed; no zeros, magnitudes over twelve binades so that some encode as e4m3
// subnormals) of ragged sizes (one element, fewer than the ranks, not a multiple of them), an all-zero
// weight, a NaN or an infinity in one rank's part (every rank's copy must show it). gather_groups, FSDP's
// gather of a layer: two sharded segments with scale groups crossing the ranks' parts, each group against
// its whole weight's quantisation (blocking and in flight), a NaN reaching its own group only. Also: the
// bytes a gather brings (half of what a bf16 gather of the same parts would), the refused arguments, and a communicator
// that gathers FP8 bytes but will not reduce them. On GPUs (skipped without one per rank) the CUDA path
// against the same bits, gather and gather_groups (at a world of one too: NCCL with one rank).
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "dist/fp8_gather.h"
#include "dist/mpi_testing.h"
#include "dist/train_testing.h"
#include "flashlm/dist.h"
#include "flashlm/dtype.h"
#include "flashlm/error.h"
#include "model/fp8.h"
#ifdef FLASHLM_WITH_CUDA
#include "core/cuda_runtime.h"
#endif

using namespace flashlm;

namespace {

Communicator& comm() { return test_world(); }

// A seed for this run's weights, the same on every rank: rank 0's, fresh each run.
uint32_t shared_seed() {
  double seed = comm().is_root() ? double(std::random_device{}()) : 0.0;
  comm().broadcast(std::span<double>(&seed, 1));
  return uint32_t(seed);
}

// `count` non-zero values of both signs with magnitudes from 2^-8 to 2^4; rounded to bf16 for a bf16 weight.
std::vector<float> random_weight(int64_t count, DType dtype, std::mt19937& rng) {
  std::uniform_real_distribution<float> exponent(-8.0f, 4.0f);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> w(static_cast<size_t>(count));
  for (float& x : w) {
    x = std::exp2(exponent(rng)) * (negative(rng) ? -1.0f : 1.0f);
    if (dtype == DType::bf16) x = float(bf16_t(x));
  }
  return w;
}

// What a gather left on this rank.
struct Gathered {
  std::vector<uint8_t> bytes;
  float amax = 0, dequant = 0;
  Fp8GatherTraffic traffic;
};

// This rank's shard of `whole` as FSDP keeps it: its part, then the tail.
std::vector<float> shard_of(const std::vector<float>& whole) {
  const FsdpWeightSplit split = fsdp_weight_split(int64_t(whole.size()), comm().world_size());
  const auto own = whole.begin() + comm().rank() * split.part;
  std::vector<float> shard(own, own + split.part);
  shard.insert(shard.end(), whole.end() - split.tail, whole.end());
  return shard;
}

std::vector<bf16_t> to_bf16(const std::vector<float>& x) {
  std::vector<bf16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = bf16_t(x[i]);
  return out;
}

// Collective: the gather of `whole` (its values exact in `dtype`) from this rank's shard, on the CPU. The
// bytes start as 0xAA, so that a byte the gather left unwritten shows.
Gathered gather_cpu(const std::vector<float>& whole, DType dtype) {
  Fp8WeightGather gather(comm(), Device::cpu);
  std::vector<float> shard = shard_of(whole);
  std::vector<bf16_t> shard16 = to_bf16(shard);
  void* data = dtype == DType::bf16 ? static_cast<void*>(shard16.data()) : static_cast<void*>(shard.data());
  Gathered out;
  out.bytes.assign(whole.size(), 0xAA);
  alignas(kFp8ScaleAlignment) std::array<float, kFp8ScaleSlotFloats> scales{};
  out.traffic = gather.gather(TensorView::contiguous(data, dtype, {int64_t(shard.size())}),
                              TensorView::contiguous(out.bytes.data(), DType::f8e4m3, {int64_t(whole.size())}),
                              scales.data());
  out.amax = scales[kFp8AmaxIndex];
  out.dequant = scales[kFp8DequantIndex];
  return out;
}

// The gathered weight against fp8_quantize_cpu of the whole one: the same bytes and scales, bit for bit.
void expect_whole_weights_bits(const Gathered& got, const std::vector<float>& whole, const std::string& what) {
  std::vector<uint8_t> want(whole.size());
  const float dequant = fp8_quantize_cpu(whole.data(), int64_t(whole.size()), Fp8Format::e4m3, want.data());
  const float amax = fp8_amax_cpu(whole.data(), int64_t(whole.size()));
  size_t differ = 0, first = want.size();
  for (size_t i = 0; i < want.size(); ++i) {
    if (got.bytes[i] == want[i]) continue;
    if (differ++ == 0) first = i;
  }
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << want.size() << " bytes differ, the first at " << first
                        << " (got " << (first < want.size() ? int(got.bytes[first]) : -1) << ", want "
                        << (first < want.size() ? int(want[first]) : -1) << ")";
  // Bit for bit, except that any NaN matches any NaN: a CUDA division yields 0x7fffffff where the host's
  // yields 0x7fc00000, and no consumer reads a NaN's payload.
  const auto same = [](float a, float b) {
    return (std::isnan(a) && std::isnan(b)) || std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
  };
  EXPECT_TRUE(same(got.amax, amax)) << what << ": amax " << got.amax << ", want " << amax;
  EXPECT_TRUE(same(got.dequant, dequant)) << what << ": dequantisation scale " << got.dequant << ", want " << dequant;
}

// Sizes around the world's: one element, fewer elements than ranks, not a multiple, a multiple, larger.
std::vector<int64_t> ragged_counts() {
  const int64_t w = comm().world_size();
  std::vector<int64_t> counts = {1, 2, 3, 5, w + 1, 3 * w + 1, 7 * w, 64, 1000, 4097};
  if (w > 1) counts.push_back(w - 1);
  return counts;
}

TEST(Fp8Gather, SplitsAsFsdpShardsABucket) {
  const FsdpWeightSplit a = fsdp_weight_split(7, 2);
  EXPECT_EQ(a.part, 3);
  EXPECT_EQ(a.tail, 1);
  EXPECT_EQ(a.shard(), 4);
  const FsdpWeightSplit b = fsdp_weight_split(3, 4);  // smaller than the world: all tail
  EXPECT_EQ(b.part, 0);
  EXPECT_EQ(b.tail, 3);
  const FsdpWeightSplit c = fsdp_weight_split(12, 4);
  EXPECT_EQ(c.part, 3);
  EXPECT_EQ(c.tail, 0);
}

TEST(Fp8Gather, MatchesTheWholeWeightsQuantisationBitForBit) {
  const uint32_t seed = shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (int64_t count : ragged_counts()) {
      const std::vector<float> whole = random_weight(count, dtype, rng);
      const std::string what = std::string(dtype_name(dtype)) + ", " + std::to_string(count) + " elements";
      expect_whole_weights_bits(gather_cpu(whole, dtype), whole, what);
    }
  }
}

TEST(Fp8Gather, AllZeroWeightGathersZerosWithTheFlooredScale) {
  const std::vector<float> whole(size_t(5 * comm().world_size() + 3), 0.0f);
  const Gathered got = gather_cpu(whole, DType::bf16);
  expect_whole_weights_bits(got, whole, "zeros");
  EXPECT_EQ(got.amax, 0.0f);
  EXPECT_TRUE(std::isfinite(got.dequant) && got.dequant > 0) << got.dequant;
  EXPECT_EQ(got.dequant, fp8_dequant_scale(fp8_scale(0.0f, Fp8Format::e4m3)));
  for (uint8_t b : got.bytes) EXPECT_EQ(b, 0) << "a zero weight's FP8 copy is zeros";
}

// A NaN in rank r's own part (every r in turn: MPI's MAX would keep it in one operand order only) makes
// every rank's whole copy NaN, as it makes fp8_quantize_cpu's; an infinity makes the scale 0, so the other
// elements encode as zero and the infinity as NaN.
TEST(Fp8Gather, NanOrInfinityInOneRanksPartReachesEveryRank) {
  const int world = comm().world_size();
  const int64_t count = 10 * world + 3;
  const FsdpWeightSplit split = fsdp_weight_split(count, world);
  std::mt19937 rng(shared_seed());
  for (int owner = 0; owner < world; ++owner) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      std::vector<float> whole = random_weight(count, DType::f32, rng);
      whole[size_t(owner * split.part + split.part / 2)] = bad;
      const Gathered got = gather_cpu(whole, DType::f32);
      const std::string what = std::string(std::isnan(bad) ? "NaN" : "inf") + " in rank " + std::to_string(owner) +
                               "'s part";
      expect_whole_weights_bits(got, whole, what);
      if (std::isnan(bad)) {
        EXPECT_TRUE(std::isnan(got.amax)) << what << ": rank " << comm().rank() << " sees amax " << got.amax;
        for (uint8_t b : got.bytes) EXPECT_TRUE(std::isnan(fp8_decode(b, Fp8Format::e4m3))) << what;
      } else {
        EXPECT_TRUE(std::isinf(got.amax)) << what << ": rank " << comm().rank() << " sees amax " << got.amax;
      }
    }
  }
}

// A gather brings the other ranks' parts at one byte an element: half a bf16 gather's bytes, a quarter of an
// fp32 one's, plus one float of amax per other rank. Counted here as the elements this rank did not encode.
TEST(Fp8Gather, BringsHalfTheBytesOfABf16Gather) {
  const int world = comm().world_size();
  std::mt19937 rng(shared_seed());
  for (int64_t count : ragged_counts()) {
    const std::vector<float> whole = random_weight(count, DType::bf16, rng);
    const Gathered got = gather_cpu(whole, DType::bf16);
    const int64_t foreign = count - fsdp_weight_split(count, world).shard();
    EXPECT_EQ(got.traffic.weight_bytes, foreign) << count << " elements";
    EXPECT_EQ(2 * got.traffic.weight_bytes, foreign * int64_t(dtype_size(DType::bf16))) << count << " elements";
    EXPECT_EQ(got.traffic.amax_bytes, (world - 1) * int64_t(sizeof(float)));
  }
}

// `fn` throws flashlm::InvalidArgument whose message holds `text`.
template <class Fn>
void expect_refused(Fn&& fn, const std::string& text) {
  try {
    fn();
    ADD_FAILURE() << "accepted; expected an error saying \"" << text << "\"";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

// gather_groups over a range laid out as FSDP holds a layer: two sharded segments (each rank's part of a
// bucket, and its tail) with three elements between them that no rank gathers (the replicated gains), and
// four scale groups whose bounds cross the ranks' parts. Each group's bytes and scales are fp8_quantize_cpu's
// of that group's whole values, and the elements between the segments are left as they were.
struct GroupedRange {
  int64_t a = 0, b = 0, gap = 3;  // the segments' elements
  std::vector<float> whole;
  std::vector<Communicator::Segment> segments;
  std::vector<std::pair<int64_t, int64_t>> groups;  // [from, to)
  std::vector<Fp8HeldRun> held;
  explicit GroupedRange(std::mt19937& rng) {
    const int64_t w = comm().world_size();
    a = 10 * w + 3;
    b = 6 * w + 5;
    whole = random_weight(a + gap + b, DType::f32, rng);
    const int64_t second = a + gap;
    groups = {{0, 4 * w + 1}, {4 * w + 1, a}, {second, second + b / 2}, {second + b / 2, second + b}};
    for (const auto& [offset, count] : {std::pair{int64_t{0}, a}, std::pair{second, b}}) {
      const FsdpWeightSplit split = fsdp_weight_split(count, int(w));
      segments.push_back({offset, split.part});
      const int64_t own = offset + comm().rank() * split.part, tail = offset + w * split.part;
      held.push_back({own, split.part, whole.data() + own});
      held.push_back({tail, split.tail, whole.data() + tail});
    }
  }
  // Collective: the gather, blocking or through a request.
  std::vector<Gathered> gather(bool async) const {
    Fp8WeightGather g(comm(), Device::cpu);
    std::vector<std::array<float, kFp8ScaleSlotFloats>> slots(groups.size());
    std::vector<Fp8GatherGroup> gg;
    for (size_t k = 0; k < groups.size(); ++k) {
      gg.push_back({groups[k].first, groups[k].second - groups[k].first, slots[k].data()});
    }
    std::vector<uint8_t> bytes(whole.size(), 0xAA);
    const TensorView q = TensorView::contiguous(bytes.data(), DType::f8e4m3, {int64_t(bytes.size())});
    CommRequest request;
    const Fp8GatherTraffic traffic = g.gather_groups(held, DType::f32, segments, gg, q, async ? &request : nullptr);
    if (async) comm().wait(request);
    for (int64_t i = a; i < a + gap; ++i) EXPECT_EQ(bytes[size_t(i)], 0xAA) << "element " << i << " is no segment's";
    std::vector<Gathered> out;
    for (size_t k = 0; k < groups.size(); ++k) {
      Gathered x;
      x.bytes.assign(bytes.begin() + groups[k].first, bytes.begin() + groups[k].second);
      x.amax = slots[k][kFp8AmaxIndex];
      x.dequant = slots[k][kFp8DequantIndex];
      x.traffic = traffic;
      out.push_back(std::move(x));
    }
    return out;
  }
  std::vector<float> group_values(size_t k) const {
    return {whole.begin() + groups[k].first, whole.begin() + groups[k].second};
  }
};

TEST(Fp8Gather, GroupsOfAFsdpPartEachMatchTheirWholeWeightBitForBit) {
  const uint32_t seed = shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const int world = comm().world_size();
  for (bool async : {false, true}) {
    const GroupedRange range(rng);
    const std::vector<Gathered> got = range.gather(async);
    for (size_t k = 0; k < got.size(); ++k) {
      expect_whole_weights_bits(got[k], range.group_values(k), "group " + std::to_string(k) + (async ? ", async" : ""));
    }
    // The segments' foreign parts at a byte each, and a float per group per other rank.
    int64_t foreign = 0;
    for (const Communicator::Segment& s : range.segments) foreign += s.part * (world - 1);
    EXPECT_EQ(got[0].traffic.weight_bytes, foreign);
    EXPECT_EQ(got[0].traffic.amax_bytes, (world - 1) * 4 * int64_t(sizeof(float)));
  }
}

// A NaN in one rank's own part of one group makes that group NaN on every rank (every r in turn), and only it.
TEST(Fp8Gather, ANanReachesItsGroupOnEveryRankAndNoOtherGroup) {
  std::mt19937 rng(shared_seed());
  const int world = comm().world_size();
  for (int owner = 0; owner < world; ++owner) {
    GroupedRange range(rng);
    // The middle of `owner`'s part of the second segment, and the group it falls in (2 or 3).
    const Communicator::Segment& s = range.segments[1];
    const int64_t at = s.offset + owner * s.part + s.part / 2;
    const size_t bad = at < range.groups[2].second ? 2 : 3;
    range.whole[size_t(at)] = std::numeric_limits<float>::quiet_NaN();
    const std::vector<Gathered> got = range.gather(false);
    for (size_t k = 0; k < got.size(); ++k) {
      const std::string what = "NaN in rank " + std::to_string(owner) + "'s part, group " + std::to_string(k);
      expect_whole_weights_bits(got[k], range.group_values(k), what);
      EXPECT_EQ(std::isnan(got[k].amax), k == bad) << what << " on rank " << comm().rank();
      for (uint8_t b : got[k].bytes) EXPECT_EQ(std::isnan(fp8_decode(b, Fp8Format::e4m3)), k == bad) << what;
    }
  }
}

TEST(Fp8Gather, GroupsAreCheckedClearly) {
  std::mt19937 rng(shared_seed());
  const GroupedRange range(rng);
  Fp8WeightGather g(comm(), Device::cpu);
  std::array<float, kFp8ScaleSlotFloats> slot{};
  std::vector<uint8_t> bytes(range.whole.size());
  const TensorView q = TensorView::contiguous(bytes.data(), DType::f8e4m3, {int64_t(bytes.size())});
  const int64_t a = range.a, end = int64_t(range.whole.size());
  const auto run = [&](std::vector<Fp8GatherGroup> groups, std::vector<Fp8HeldRun> held) {
    g.gather_groups(held, DType::f32, range.segments, groups, q);
  };
  const std::vector<Fp8GatherGroup> whole = {{0, a, slot.data()}, {a + range.gap, range.b, slot.data()}};
  expect_refused([&] { run({}, range.held); }, "no scale groups");
  expect_refused([&] { run({{0, a, slot.data()}, {a - 1, end - a + 1, slot.data()}}, range.held); }, "overlap");
  expect_refused([&] { run({{0, a, slot.data()}}, range.held); }, "is not covered by the scale groups");
  expect_refused([&] { run({{0, a, nullptr}, whole[1]}, range.held); }, "has no scale slot");
  expect_refused([&] { run({{0, end + 1, slot.data()}}, range.held); }, "outside the range");
  expect_refused([&] { run(whole, {{end - 1, 2, range.whole.data()}}); }, "a held run [");
  expect_refused([&] { run(whole, {{0, 1, bytes.data()}}); }, "q overlaps the held run at 0");
  expect_refused(
      [&] {
        g.gather_groups(range.held, DType::f16, range.segments, whole, q);
      },
      "the held values are fp16, expected fp32 or bf16");
}

TEST(Fp8Gather, RefusesBadArgumentsClearly) {
  Fp8WeightGather gather(comm(), Device::cpu);
  const int64_t count = 4 * comm().world_size() + 1;
  const int64_t shard_count = fsdp_weight_split(count, comm().world_size()).shard();
  std::vector<float> shard(size_t(shard_count), 1.0f);
  std::vector<uint8_t> bytes(static_cast<size_t>(count));
  alignas(kFp8ScaleAlignment) std::array<float, kFp8ScaleSlotFloats> scales{};
  const TensorView s = TensorView::contiguous(shard.data(), DType::f32, {shard_count});
  const TensorView q = TensorView::contiguous(bytes.data(), DType::f8e4m3, {count});
  const auto run = [&](const TensorView& sv, const TensorView& qv, float* sc) { gather.gather(sv, qv, sc); };

  expect_refused([&] { run(TensorView::contiguous(shard.data(), DType::f16, {shard_count}), q, scales.data()); },
                 "the shard is fp16, expected fp32 or bf16");
  expect_refused([&] { run(s, TensorView::contiguous(bytes.data(), DType::f32, {count / 4}), scales.data()); },
                 "q is fp32, expected fp8_e4m3");
  expect_refused([&] { run(TensorView::contiguous(shard.data(), DType::f32, {shard_count - 1}), q, scales.data()); },
                 "each rank keeps " + std::to_string(shard_count));
  expect_refused([&] { run(s, TensorView::contiguous(bytes.data(), DType::f8e4m3, {0}), scales.data()); },
                 "has no room for a weight");
  expect_refused([&] { run(s, q, nullptr); }, "scales is null");
  expect_refused([&] { run(s, TensorView::contiguous(shard.data(), DType::f8e4m3, {count}), scales.data()); },
                 "q overlaps the shard");
  expect_refused([&] { run(TensorView::contiguous(shard.data(), DType::f32, {shard_count}, Device::cuda), q,
                           scales.data()); },
                 "the shard is on cuda and q on cpu; this gather runs on cpu");
  expect_refused([&] { fsdp_weight_split(0, comm().world_size()); }, "a weight of 0 elements, expected >= 1");
  if (!Communicator::nccl_built()) {
    expect_refused([&] { Fp8WeightGather(comm(), Device::cuda); }, "a CUDA gather needs NCCL");
  }
}

// The communicator moves FP8 bytes (gathers, broadcasts) but refuses to reduce them: MPI would add bytes.
TEST(Fp8Gather, CommunicatorGathersFp8BytesButDoesNotReduceThem) {
  const int world = comm().world_size(), rank = comm().rank();
  std::vector<uint8_t> bytes(size_t(3 * world), 0);
  for (int k = 0; k < 3; ++k) bytes[size_t(3 * rank + k)] = uint8_t(0x80 | (rank * 3 + k));
  comm().all_gather(TensorView::contiguous(bytes.data() + 3 * rank, DType::f8e4m3, {3}),
                    TensorView::contiguous(bytes.data(), DType::f8e4m3, {3 * world}));
  for (int i = 0; i < 3 * world; ++i) EXPECT_EQ(bytes[size_t(i)], uint8_t(0x80 | i)) << "byte " << i;
  uint8_t b = rank == 0 ? 0x5a : 0;
  comm().broadcast(TensorView::contiguous(&b, DType::f8e4m3, {1}));
  EXPECT_EQ(b, 0x5a);
  try {
    comm().all_reduce(TensorView::contiguous(bytes.data(), DType::f8e4m3, {3 * world}), ReduceOp::max);
    ADD_FAILURE() << "an FP8 all-reduce was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8_e4m3 elements can be gathered and broadcast, not reduced"),
              std::string::npos)
        << e.what();
  }
}

#ifdef FLASHLM_WITH_CUDA
// Collective: the CUDA gather of `whole` (exact in `dtype`), on the legacy default stream.
Gathered gather_gpu(Fp8WeightGather& gather, const std::vector<float>& whole, DType dtype) {
  const std::vector<float> shard = shard_of(whole);
  const std::vector<bf16_t> shard16 = to_bf16(shard);
  const void* host = dtype == DType::bf16 ? static_cast<const void*>(shard16.data()) : shard.data();
  const size_t shard_bytes = shard.size() * dtype_size(dtype);
  Buffer x = Buffer::allocate(shard_bytes, Device::cuda, "test: shard");
  Buffer q = Buffer::allocate(whole.size(), Device::cuda, "test: gathered FP8 weight");
  Buffer scales = Buffer::allocate(kFp8ScaleSlotFloats * sizeof(float), Device::cuda, "test: scales");
  cuda_copy(x.data(), host, shard_bytes);
  Gathered out;
  out.bytes.assign(whole.size(), 0xAA);
  cuda_copy(q.data(), out.bytes.data(), whole.size());
  out.traffic = gather.gather(TensorView::contiguous(x.data(), dtype, {int64_t(shard.size())}, Device::cuda),
                              TensorView::contiguous(q.data(), DType::f8e4m3, {int64_t(whole.size())}, Device::cuda),
                              static_cast<float*>(scales.data()), nullptr);
  comm().synchronize();
  std::array<float, kFp8ScaleSlotFloats> host_scales{};
  cuda_copy(out.bytes.data(), q.data(), whole.size());
  cuda_copy(host_scales.data(), scales.data(), sizeof(host_scales));
  out.amax = host_scales[kFp8AmaxIndex];
  out.dequant = host_scales[kFp8DequantIndex];
  return out;
}

TEST(Fp8GatherGpu, MatchesTheWholeWeightsQuantisationBitForBit) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  Fp8WeightGather gather(comm(), Device::cuda);
  const uint32_t seed = shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  // Past the casts' 1024-wide rows too: a whole row and a remainder.
  std::vector<int64_t> counts = ragged_counts();
  counts.push_back(3 * 1024 * comm().world_size() + 517);
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (int64_t count : counts) {
      const std::vector<float> whole = random_weight(count, dtype, rng);
      const std::string what = std::string(dtype_name(dtype)) + ", " + std::to_string(count) + " elements";
      expect_whole_weights_bits(gather_gpu(gather, whole, dtype), whole, what);
    }
  }
  const int world = comm().world_size();
  const FsdpWeightSplit split = fsdp_weight_split(10 * world + 3, world);
  for (int owner = 0; owner < world; ++owner) {
    std::vector<float> whole = random_weight(split.count, DType::bf16, rng);
    whole[size_t(owner * split.part + 1)] = std::numeric_limits<float>::quiet_NaN();
    const Gathered got = gather_gpu(gather, whole, DType::bf16);
    expect_whole_weights_bits(got, whole, "NaN in rank " + std::to_string(owner) + "'s part");
    EXPECT_TRUE(std::isnan(got.amax)) << "rank " << comm().rank();
  }
}

// gather_groups on CUDA (FSDP's gather of a layer on the GPU): the GroupedRange above with its held runs on
// the device, fp32 and bf16, blocking and left in flight (then waited for through the communicator's stream),
// each group's bytes and scale slot fp8_quantize_cpu's of its whole values (the CUDA casts' bits), the
// elements between the segments untouched, the traffic as on the CPU; a NaN in one rank's part reaching
// its own group only.
TEST(Fp8GatherGpu, GroupsOfAFsdpPartEachMatchTheirWholeWeightBitForBit) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  Fp8WeightGather gather(comm(), Device::cuda);
  const uint32_t seed = shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const int world = comm().world_size();
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (int variant = 0; variant < 3; ++variant) {  // blocking, in flight, a NaN in one rank's part
      GroupedRange range(rng);
      if (dtype == DType::bf16) {
        for (float& x : range.whole) x = float(bf16_t(x));
      }
      size_t bad = range.groups.size();
      if (variant == 2) {
        const Communicator::Segment& seg = range.segments[1];
        const int64_t at = seg.offset + (world - 1) * seg.part + seg.part / 2;
        bad = at < range.groups[2].second ? 2 : 3;
        range.whole[size_t(at)] = std::numeric_limits<float>::quiet_NaN();
      }
      const std::string what = std::string(dtype_name(dtype)) + (variant == 1 ? ", in flight" : "") +
                               (variant == 2 ? ", a NaN in the last rank's part" : "");
      const int64_t n = int64_t(range.whole.size());
      const std::vector<bf16_t> whole16 = to_bf16(range.whole);
      const void* host = dtype == DType::bf16 ? static_cast<const void*>(whole16.data()) : range.whole.data();
      Buffer x = Buffer::allocate(size_t(n) * dtype_size(dtype), Device::cuda, "test: held values");
      Buffer q = Buffer::allocate(size_t(n), Device::cuda, "test: gathered FP8 range");
      Buffer slots = Buffer::allocate(range.groups.size() * kFp8ScaleSlotFloats * sizeof(float), Device::cuda,
                                      "test: scale slots");
      cuda_copy(x.data(), host, size_t(n) * dtype_size(dtype));
      std::vector<uint8_t> bytes(size_t(n), 0xAA);
      cuda_copy(q.data(), bytes.data(), bytes.size());
      std::vector<Fp8HeldRun> held;
      for (const Fp8HeldRun& r : range.held) {
        held.push_back({r.at, r.count, static_cast<const char*>(x.data()) + r.at * int64_t(dtype_size(dtype))});
      }
      std::vector<Fp8GatherGroup> groups;
      for (size_t k = 0; k < range.groups.size(); ++k) {
        groups.push_back({range.groups[k].first, range.groups[k].second - range.groups[k].first,
                          static_cast<float*>(slots.data()) + k * kFp8ScaleSlotFloats});
      }
      CommRequest request;
      const TensorView qv = TensorView::contiguous(q.data(), DType::f8e4m3, {n}, Device::cuda);
      const Fp8GatherTraffic traffic =
          gather.gather_groups(held, dtype, range.segments, groups, qv, variant == 1 ? &request : nullptr, nullptr);
      if (variant == 1) comm().wait(static_cast<void*>(nullptr));
      comm().synchronize();
      cuda_copy(bytes.data(), q.data(), bytes.size());
      std::vector<float> host_slots(range.groups.size() * kFp8ScaleSlotFloats);
      cuda_copy(host_slots.data(), slots.data(), host_slots.size() * sizeof(float));
      for (int64_t i = range.a; i < range.a + range.gap; ++i) {
        EXPECT_EQ(bytes[size_t(i)], 0xAA) << what << ": element " << i << " is no segment's";
      }
      for (size_t k = 0; k < range.groups.size(); ++k) {
        Gathered got;
        got.bytes.assign(bytes.begin() + range.groups[k].first, bytes.begin() + range.groups[k].second);
        got.amax = host_slots[k * kFp8ScaleSlotFloats + kFp8AmaxIndex];
        got.dequant = host_slots[k * kFp8ScaleSlotFloats + kFp8DequantIndex];
        expect_whole_weights_bits(got, range.group_values(k), what + ", group " + std::to_string(k));
        if (variant == 2) {
          EXPECT_EQ(std::isnan(got.amax), k == bad) << what << ", group " << k;
        }
      }
      int64_t foreign = 0;
      for (const Communicator::Segment& seg : range.segments) foreign += seg.part * (world - 1);
      EXPECT_EQ(traffic.weight_bytes, foreign) << what;
      EXPECT_EQ(traffic.amax_bytes, (world - 1) * 4 * int64_t(sizeof(float))) << what;
    }
  }
}
#else
TEST(Fp8GatherGpu, SkippedWithoutCuda) { GTEST_SKIP() << "flashlm was built without CUDA"; }
#endif

}  // namespace
