// Data parallelism (flashlm/ddp.h) on the CPU, run by CTest as one process and under `mpirun -np 2` and
// `-np 4` (main: mpi_test_main.cpp, see mpi_testing.h). Every DDP variant, gradient accumulation and ZeRO-1
// reproduce single-process full-batch training of a toy model with a frozen and a tied parameter (each rank
// trains on its slice of the global batch; every rank also trains the single-process reference locally);
// the frozen parameter is never communicated, the tied one is reduced once; ZeRO-1 is bit-identical to
// CpuModel's AdamW; the bucket plan; the real LM with bucketed DDP against one process; ZeRO-1's per-bucket
// layout with DataParallel's reduce-scatter (its arithmetic, the toy, replicated tails, checkpoints). On GPUs
// (skipped without one per rank) also the 16-bit gradient all-reduce (DdpOptions::reduce_dtype) and the
// reduce-scatter path that DdpModel picks for ZeRO-1 on CUDA.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "dist/mpi_testing.h"
#include "dist/toy_model.h"
#include "dist/toy_training.h"
#include "dist/train_testing.h"
#include "flashlm/ddp.h"
#include "flashlm/ddp_model.h"
#include "flashlm/device.h"
#include "flashlm/dist.h"
#include "flashlm/error.h"
#include "flashlm/memory.h"
#include "flashlm/zero.h"
#include "optim/optimizer.h"
#ifdef FLASHLM_WITH_CUDA
#include "core/cuda_runtime.h"
#endif

using namespace flashlm;
using namespace toy;  // the toy's training: its batches, AdamW and the single-process run

namespace {

Communicator& comm() { return test_world(); }

// A world of one reduces nothing (DataParallel::communicates): no collective, no element, no staging.
bool alone() { return comm().world_size() == 1; }

struct ToyRun {
  std::vector<float> initial, final;     // rank 0's weights after the broadcast; this rank's at the end
  std::vector<DdpStats> stats;           // every step's synchronisation
  std::vector<int64_t> started_after;    // collectives started after each gradient-ready report (last step)
  bool frozen_gradient_kept = true;      // the frozen gradient, set to a rank-dependent value, survived
};

// kSteps on this rank's slice of each global batch, in grad_accum micro-batches, synchronised by DDP and
// updated by ToyAdamW or ZeRO-1 (grain 16: several shards even for this small model).
ToyRun train_data_parallel(const DdpOptions& opt, bool zero1) {
  const int n = comm().world_size(), r = comm().rank();
  toy::Model model(1 + uint64_t(r));  // the ranks start different: the broadcast makes them equal
  DataParallel ddp(comm(), model.params, opt);
  std::unique_ptr<ZeroOptimizer> zero;
  if (zero1 && opt.reduce_scatter) zero = std::make_unique<ZeroOptimizer>(comm(), model.params, ddp.buckets());
  else if (zero1) zero = std::make_unique<ZeroOptimizer>(comm(), model.params, 16);
  ToyRun run;
  model.hook = [&](int64_t first, int64_t last) {
    ddp.gradients_ready(first, last);
    run.started_after.push_back(ddp.last_stats().collectives);
  };
  ddp.broadcast_parameters(model.w.data());
  run.initial = model.w;
  ToyAdamW adam;
  const int64_t rows = kGlobalRows / n, micro = rows / opt.grad_accum;
  const DdpRange frozen{model.params.layout[toy::kFrozen].offset, model.params.layout[toy::kFrozen].numel()};
  std::vector<int32_t> x, y;
  for (int64_t s = 0; s < kSteps; ++s) {
    global_batch(s, x, y);
    std::fill(model.g.begin(), model.g.end(), 0.0f);
    std::fill_n(model.g.begin() + frozen.offset, frozen.count, float(r + 1));
    run.started_after.clear();
    for (int64_t k = 0; k < opt.grad_accum; ++k) {
      const auto at = size_t(r * rows + k * micro);
      ddp.begin_backward(model.g.data(), k + 1 == opt.grad_accum);
      model.forward_backward(std::span(x).subspan(at, size_t(micro)), std::span(y).subspan(at, size_t(micro)));
      ddp.finish_backward();
    }
    for (int64_t i = 0; i < frozen.count; ++i) run.frozen_gradient_kept &= model.g[size_t(frozen.offset + i)] == float(r + 1);
    std::fill_n(model.g.begin() + frozen.offset, frozen.count, 0.0f);
    run.stats.push_back(ddp.last_stats());
    if (zero) zero->step(model.w.data(), model.g.data(), toy_adamw(), kLr);
    else adam.step(model, toy_adamw(), kLr);
  }
  run.final = model.w;
  return run;
}

DdpOptions options(DdpVariant v, double bucket_mb = 25, int64_t grad_accum = 1, DType reduce_dtype = DType::f32) {
  DdpOptions o;
  o.variant = v;
  o.bucket_mb = bucket_mb;
  o.grad_accum = grad_accum;
  o.reduce_dtype = reduce_dtype;
  return o;
}

std::string describe(const DdpOptions& o) {
  return std::string(ddp_variant_name(o.variant)) + " bucket_mb " + std::to_string(o.bucket_mb) + " grad_accum " +
         std::to_string(o.grad_accum) + " reduce_dtype " + std::string(dtype_name(o.reduce_dtype));
}

// The toy's trainable gradient elements: E (once, although it has two uses), W1, W2 — not F.
constexpr int64_t kCommunicated = toy::V * toy::D + 2 * toy::H * toy::D;

// 800 bytes: W2 and W1 (384 bytes each) share a bucket, E (512 bytes) gets the next; 1 MB: one bucket of
// two ranges (F lies between E and W1), reduced through the staging area.
const std::vector<DdpOptions> kEveryVariant = {
    options(DdpVariant::per_param), options(DdpVariant::flat),           options(DdpVariant::async),
    options(DdpVariant::bucketed, 0.0008), options(DdpVariant::bucketed, 1.0),
};

// ---------------------------------------------------------------------------------------------------
// The bucket plan (a pure function).

TEST(DdpBuckets, SizesGiveOneTwoAndThreeBuckets) {
  // Four contiguous parameters of 400, 800, 200 and 1200 bytes, offered last first as a backward ends them.
  std::vector<ParameterInfo> layout = {{"a", 0, {100}}, {"b", 100, {200}}, {"c", 300, {50}}, {"d", 350, {300}}};
  const std::vector<int64_t> reverse = {3, 2, 1, 0};
  auto params_of = [](const std::vector<DdpBucket>& buckets) {
    std::vector<std::vector<int64_t>> out;
    for (const auto& b : buckets) out.push_back(b.params);
    return out;
  };
  const auto one = ddp_buckets(layout, reverse, 2600);
  EXPECT_EQ(params_of(one), (std::vector<std::vector<int64_t>>{{3, 2, 1, 0}}));
  ASSERT_EQ(one[0].ranges.size(), 1u);
  EXPECT_EQ(one[0].ranges[0].offset, 0);
  EXPECT_EQ(one[0].ranges[0].count, 650);
  EXPECT_EQ(one[0].elements, 650);
  EXPECT_EQ(params_of(ddp_buckets(layout, reverse, 1400)), (std::vector<std::vector<int64_t>>{{3, 2}, {1, 0}}));
  // d (1200 bytes) is larger than a bucket: alone; c + b fill one exactly; a starts the third.
  const auto three = ddp_buckets(layout, reverse, 1000);
  EXPECT_EQ(params_of(three), (std::vector<std::vector<int64_t>>{{3}, {2, 1}, {0}}));
  ASSERT_EQ(three[1].ranges.size(), 1u);  // b and c are adjacent: one range
  EXPECT_EQ(three[1].ranges[0].offset, 100);
  EXPECT_EQ(three[1].ranges[0].count, 250);
  EXPECT_EQ(ddp_buckets(layout, reverse, 0).size(), 4u);
  EXPECT_EQ(ddp_buckets(layout, reverse, INT64_MAX).size(), 1u);
  // Without b (frozen): one bucket of two separate ranges.
  const auto gap = ddp_buckets(layout, std::vector<int64_t>{3, 2, 0}, INT64_MAX);
  ASSERT_EQ(gap.size(), 1u);
  ASSERT_EQ(gap[0].ranges.size(), 2u);
  EXPECT_EQ(gap[0].ranges[0].offset, 0);
  EXPECT_EQ(gap[0].ranges[0].count, 100);
  EXPECT_EQ(gap[0].ranges[1].offset, 300);
  EXPECT_EQ(gap[0].ranges[1].count, 350);
  EXPECT_EQ(gap[0].elements, 450);
  EXPECT_THROW(ddp_buckets(layout, reverse, -1), Error);
  EXPECT_THROW(ddp_buckets(layout, std::vector<int64_t>{4}, 100), Error);
}

TEST(DdpBuckets, DataParallelPlansTheToyInReverseWithoutFrozenOrTiedEntries) {
  toy::Model model(1);
  const auto buckets_of = [&](const DdpOptions& o) {
    DataParallel ddp(comm(), model.params, o);
    std::vector<std::vector<int64_t>> out;
    for (const auto& b : ddp.buckets()) out.push_back(b.params);
    return out;
  };
  using Plan = std::vector<std::vector<int64_t>>;
  EXPECT_EQ(buckets_of(options(DdpVariant::per_param)), (Plan{{toy::kFc2}, {toy::kFc1}, {toy::kEmbed}}));
  EXPECT_EQ(buckets_of(options(DdpVariant::async)), (Plan{{toy::kFc2}, {toy::kFc1}, {toy::kEmbed}}));
  EXPECT_EQ(buckets_of(options(DdpVariant::flat)), (Plan{{toy::kFc2, toy::kFc1, toy::kEmbed}}));
  EXPECT_EQ(buckets_of(options(DdpVariant::bucketed, 0.0008)), (Plan{{toy::kFc2, toy::kFc1}, {toy::kEmbed}}));
}

// fp32 buckets are reduced in place unless a frozen or tied parameter leaves a gap in them (flat over the toy:
// F lies between E and W1), which are packed into their own staging area — except at a world of one, which
// reduces nothing and stages nothing.
TEST(DdpBuckets, StagingOnlyForBucketsWithGaps) {
  toy::Model model(1);
  const auto staging = [&](const DdpOptions& o) { return DataParallel(comm(), model.params, o).staging_bytes(); };
  EXPECT_EQ(staging(options(DdpVariant::per_param)), 0);
  EXPECT_EQ(staging(options(DdpVariant::bucketed, 0.0008)), 0);
  EXPECT_EQ(staging(options(DdpVariant::flat)), alone() ? 0 : kCommunicated * int64_t(sizeof(float)));
  EXPECT_EQ(DataParallel(comm(), model.params, options(DdpVariant::flat)).communicates(), !alone());
}

// ---------------------------------------------------------------------------------------------------
// The toy model: DDP and ZeRO-1 against single-process full-batch training.

TEST(Ddp, EveryVariantReproducesFullBatchTraining) {
  const std::vector<float> reference = train_single_process();
  for (const DdpOptions& o : kEveryVariant) {
    const ToyRun run = train_data_parallel(o, false);
    EXPECT_LE(max_abs_diff(run.final, reference), 1e-6) << describe(o);
  }
}

TEST(Ddp, GradientAccumulationReproducesFullBatchTraining) {
  const std::vector<float> reference = train_single_process();
  for (DdpVariant v : {DdpVariant::bucketed, DdpVariant::async, DdpVariant::flat}) {
    const DdpOptions o = options(v, 0.0008, 2);
    const ToyRun run = train_data_parallel(o, false);
    EXPECT_LE(max_abs_diff(run.final, reference), 1e-6) << describe(o);
    for (const DdpStats& s : run.stats) EXPECT_EQ(s.elements, alone() ? 0 : kCommunicated) << describe(o);  // once per step
  }
}

TEST(Ddp, FrozenParameterIsNeverCommunicatedNorUpdated) {
  for (const DdpOptions& o : kEveryVariant) {
    const ToyRun run = train_data_parallel(o, false);
    EXPECT_TRUE(run.frozen_gradient_kept) << describe(o);
    const int64_t f = toy::Model(1).params.layout[toy::kFrozen].offset;
    for (int64_t i = 0; i < toy::D * toy::D; ++i) {
      EXPECT_EQ(run.final[size_t(f + i)], run.initial[size_t(f + i)]) << describe(o) << " element " << i;
    }
  }
}

// E has two uses: its bucket starts only after the second (the embedding, last in the backward), and its
// elements are reduced once.
TEST(Ddp, TiedWeightIsReducedOnceAfterBothUses) {
  struct Expect {
    DdpOptions o;
    int64_t collectives;
    std::vector<int64_t> started_after;  // reports: head, fc2, fc1, embed
  };
  const std::vector<Expect> cases = {
      {options(DdpVariant::per_param), 3, {0, 0, 0, 0}},  // everything after the backward
      {options(DdpVariant::flat), 1, {0, 0, 0, 0}},
      {options(DdpVariant::async), 3, {0, 1, 2, 3}},      // each as soon as it is final; E last
      {options(DdpVariant::bucketed, 0.0008), 2, {0, 0, 1, 2}},
  };
  for (const Expect& e : cases) {
    const ToyRun run = train_data_parallel(e.o, false);
    // A world of one starts nothing, after any report or at the end.
    EXPECT_EQ(run.started_after, alone() ? std::vector<int64_t>(4, 0) : e.started_after) << describe(e.o);
    for (const DdpStats& s : run.stats) {
      EXPECT_EQ(s.collectives, alone() ? 0 : e.collectives) << describe(e.o);
      EXPECT_EQ(s.elements, alone() ? 0 : kCommunicated) << describe(e.o);
      EXPECT_GE(s.exposed_ms, 0.0);
    }
  }
}

TEST(Zero1, ReproducesFullBatchTraining) {
  const std::vector<float> reference = train_single_process();
  for (const DdpOptions& o : {options(DdpVariant::bucketed, 0.0008), options(DdpVariant::flat, 25, 2)}) {
    const ToyRun run = train_data_parallel(o, true);
    EXPECT_LE(max_abs_diff(run.final, reference), 1e-6) << describe(o);
    EXPECT_TRUE(run.frozen_gradient_kept);
    const int64_t f = toy::Model(1).params.layout[toy::kFrozen].offset;
    for (int64_t i = 0; i < toy::D * toy::D; ++i) EXPECT_EQ(run.final[size_t(f + i)], run.initial[size_t(f + i)]);
  }
}

// Full moments loaded into the shards and gathered back (a checkpoint's round trip) are the same values, and
// load_state sets the step count.
void expect_state_round_trip(ZeroOptimizer& zero, int64_t n, int64_t steps) {
  const auto count = static_cast<size_t>(n);
  std::vector<float> m(count), v(count), m2(count), v2(count);
  for (int64_t i = 0; i < n; ++i) m[size_t(i)] = float(i), v[size_t(i)] = float(2 * i);
  zero.load_state(m.data(), v.data(), steps);
  zero.gather_state(m2.data(), v2.data());
  EXPECT_EQ(m2, m);
  EXPECT_EQ(v2, v);
  EXPECT_EQ(zero.steps(), steps);
}

TEST(Zero1, ShardsAreEqualAndCoverTheParameters) {
  toy::Model model(1);
  const int64_t n = model.params.flat_size();  // 384
  const int world = comm().world_size();
  ZeroOptimizer zero(comm(), model.params, 16);
  const int64_t s = zero.shard_elements();
  EXPECT_EQ(s % 16, 0);
  EXPECT_GE(s * world, n);
  EXPECT_LT(s * world, n + 16 * world);  // padding below one grain per rank
  EXPECT_EQ(comm().agree(s, "the shard size"), s);
  EXPECT_EQ(zero.state_bytes(), 2 * s * int64_t(sizeof(float)));
  const DdpRange mine = zero.shard();
  EXPECT_EQ(mine.offset, std::min(n, comm().rank() * s));
  std::vector<double> owned(size_t(n), 0.0);
  for (int64_t i = 0; i < mine.count; ++i) owned[size_t(mine.offset + i)] = 1.0;
  comm().all_reduce(std::span<double>(owned), ReduceOp::sum);
  for (double o : owned) EXPECT_EQ(o, 1.0);  // every element has exactly one owner
  expect_state_round_trip(zero, n, 7);
}

// ---------------------------------------------------------------------------------------------------
// ZeRO-1's per-bucket layout with DataParallel's reduce-scatter. DdpModel picks it on CUDA only; on the CPU
// DataParallel and ZeroOptimizer run it too (MPI's blocking reduce-scatter), which tests its arithmetic here.

// Buckets whose sizes divide by the world size and do not (a tail), one smaller than the world (all tail),
// for every world size 1..5 and every rank: each element of a bucket is owned by exactly one rank or is in
// the tail, which every rank owns; the parts are what an in-place reduce-scatter leaves on each rank.
TEST(Zero1PerBucket, LayoutOfBucketsThatDoAndDoNotDivide) {
  std::vector<DdpBucket> buckets(3);
  buckets[0].ranges = {{100, 12}};  // 12: divides by 1, 2, 3, 4
  buckets[1].ranges = {{30, 7}};    // 7: a tail at 2..5
  buckets[2].ranges = {{50, 2}};    // 2: all tail at 3..5
  for (DdpBucket& b : buckets) b.elements = b.ranges.front().count;
  for (int world = 1; world <= 5; ++world) {
    std::vector<int> owners(112, 0), tails(112, 0);
    for (int rank = 0; rank < world; ++rank) {
      const ZeroBucketLayout layout = zero_bucket_layout(buckets, world, rank);
      ASSERT_EQ(layout.buckets.size(), buckets.size());
      int64_t elements = 0;
      for (size_t b = 0; b < buckets.size(); ++b) {
        const ZeroBucketShard& s = layout.buckets[b];
        const DdpRange whole = buckets[b].ranges.front();
        EXPECT_EQ(s.offset, whole.offset);
        EXPECT_EQ(s.part, whole.count / world);
        EXPECT_EQ(s.owned.offset, whole.offset + rank * s.part);
        EXPECT_EQ(s.owned.count, s.part);
        EXPECT_EQ(s.tail.offset, whole.offset + world * s.part);
        EXPECT_EQ(s.tail.count, whole.count % world);
        EXPECT_LT(s.tail.count, world);
        for (int64_t i = 0; i < s.owned.count; ++i) ++owners[size_t(s.owned.offset + i)];
        for (int64_t i = 0; i < s.tail.count; ++i) ++tails[size_t(s.tail.offset + i)];
        elements += s.part + s.tail.count;
      }
      EXPECT_EQ(layout.shard_elements, elements);
    }
    for (const DdpBucket& b : buckets) {
      for (int64_t i = b.ranges.front().offset; i < b.ranges.front().offset + b.ranges.front().count; ++i) {
        const bool owned_once = owners[size_t(i)] == 1 && tails[size_t(i)] == 0;
        const bool tail_everywhere = owners[size_t(i)] == 0 && tails[size_t(i)] == world;
        EXPECT_TRUE(owned_once || tail_everywhere) << "world " << world << " element " << i;
      }
    }
  }
  // world 4: 12 -> 3 each; 7 -> 1 each + 3; 2 -> 0 each + 2. Per rank 3 + 1 + 3 + 0 + 2 = 9 of 21.
  EXPECT_EQ(zero_bucket_layout(buckets, 4, 3).shard_elements, 9);
  buckets[1].ranges = {{30, 3}, {40, 4}};  // a frozen parameter inside the bucket
  EXPECT_THROW(zero_bucket_layout(buckets, 2, 0), Error);
  EXPECT_THROW(zero_bucket_layout(buckets, 2, 2), Error);
}

// When DataParallel can reduce-scatter: the bucketed variant in fp32 with every bucket one run.
TEST(Zero1PerBucket, ReduceScatterNeedsBucketedFp32ContiguousBuckets) {
  const toy::Model model(1);
  EXPECT_EQ(reduce_scatter_obstacle(model.params, options(DdpVariant::bucketed, 0.0008)), "");
  // 1 MB: one bucket of two ranges (F lies between E and W1).
  EXPECT_NE(reduce_scatter_obstacle(model.params, options(DdpVariant::bucketed, 1.0)).find("2 separate ranges"),
            std::string::npos);
  EXPECT_NE(reduce_scatter_obstacle(model.params, options(DdpVariant::flat)).find("flat"), std::string::npos);
  EXPECT_NE(reduce_scatter_obstacle(model.params, options(DdpVariant::bucketed, 0.0008, 1, DType::bf16)).find("bf16"),
            std::string::npos);
  DdpOptions o = options(DdpVariant::bucketed, 1.0);
  o.reduce_scatter = true;
  EXPECT_THROW(DataParallel(comm(), model.params, o), Error);
}

// The toy trained with every bucket reduce-scattered into ZeRO-1's per-bucket shards reproduces full-batch
// training (also with gradient accumulation); the frozen gradient is never touched; every rank keeps the
// moments of 1/world of the parameters.
TEST(Zero1PerBucket, ReduceScatterReproducesFullBatchTraining) {
  const std::vector<float> reference = train_single_process();
  for (DdpOptions o : {options(DdpVariant::bucketed, 0.0008), options(DdpVariant::bucketed, 0.0008, 2)}) {
    o.reduce_scatter = true;
    const ToyRun run = train_data_parallel(o, true);
    EXPECT_LE(max_abs_diff(run.final, reference), 1e-6) << describe(o);
    EXPECT_TRUE(run.frozen_gradient_kept);
    for (const DdpStats& st : run.stats) {
      EXPECT_EQ(st.elements, alone() ? 0 : kCommunicated) << describe(o);
      EXPECT_EQ(st.collectives, alone() ? 0 : 2) << describe(o);  // two buckets, sizes 192 and 128: no tails at 2, 4
    }
  }
  toy::Model model(1);
  DdpOptions o = options(DdpVariant::bucketed, 0.0008);
  o.reduce_scatter = true;
  DataParallel ddp(comm(), model.params, o);
  const ZeroOptimizer zero(comm(), model.params, ddp.buckets());
  EXPECT_TRUE(zero.per_bucket());
  EXPECT_EQ(zero.shard_elements(), kCommunicated / comm().world_size());
  EXPECT_EQ(zero.state_bytes(), 2 * kCommunicated / comm().world_size() * int64_t(sizeof(float)));
  // DataParallel averages exactly the elements ZeRO-1 updates.
  auto elements = [](const std::vector<DdpRange>& ranges) {
    std::vector<int64_t> out;
    for (const DdpRange& r : ranges) {
      for (int64_t i = r.offset; i < r.offset + r.count; ++i) out.push_back(i);
    }
    return out;
  };
  EXPECT_EQ(elements(ddp.averaged_ranges()), elements(zero.updated_ranges()));
  EXPECT_THROW(zero.shard(), Error);
}

// Parameters of 13, 7 and 2 elements, each its own bucket, so that the world sizes 2 and 4 leave tails (and
// 2 < 4 is all tail): DataParallel's reduce-scatter leaves this rank's parts and the tails averaged, and
// ZeroOptimizer's steps on them match unsharded AdamW on the averaged gradients; the moments round-trip
// through a checkpoint.
TEST(Zero1PerBucket, TailsAreReplicatedAndTrainedLikeTheRest) {
  DdpParameters params;
  params.layout = {{"a", 0, {13}}, {"b", 13, {7}}, {"c", 20, {2}}};
  const int64_t n = params.flat_size();
  const int world = comm().world_size(), rank = comm().rank();
  DdpOptions o = options(DdpVariant::bucketed, 1e-6);  // one parameter per bucket
  o.reduce_scatter = true;
  DataParallel ddp(comm(), params, o);
  ZeroOptimizer zero(comm(), params, ddp.buckets());
  ASSERT_EQ(ddp.buckets().size(), 3u);
  // Rank r's gradient of element i. Their mean over 1, 2 or 4 ranks is a multiple of 0.025 minus 0.43, never
  // near 0, where AdamW's update (g / sqrt(g²)) would turn rounding noise into a full step.
  auto grad = [](int64_t i, int r, int step) { return 0.1f * float((i * 7 + 3 * r + step) % 11) - 0.43f; };
  const auto count = static_cast<size_t>(n);
  std::vector<float> w(count), ref_w(count), ref_m(count, 0.0f), ref_v(count, 0.0f), g(count);
  for (int64_t i = 0; i < n; ++i) w[size_t(i)] = ref_w[size_t(i)] = 0.05f * float(i % 5) - 0.1f;
  AdamWConfig c;
  c.max_grad_norm = 0.8;  // clips at 1 and 2 ranks, not at 4 (the mean of more ranks is smaller)
  for (int step = 0; step < 3; ++step) {
    std::vector<float> mean(count, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      g[size_t(i)] = grad(i, rank, step);
      for (int r = 0; r < world; ++r) mean[size_t(i)] += grad(i, r, step) / float(world);
    }
    ddp.begin_backward(g.data(), true);
    ddp.gradients_ready(0, 2);
    ddp.finish_backward();
    double averaged_error = 0;
    for (const DdpRange& r : ddp.averaged_ranges()) {
      for (int64_t i = r.offset; i < r.offset + r.count; ++i) {
        averaged_error = std::max(averaged_error, double(std::abs(g[size_t(i)] - mean[size_t(i)])));
      }
    }
    EXPECT_LE(averaged_error, 1e-6) << "step " << step;
    const double norm = zero.step(w.data(), g.data(), c, kLr);
    // The unsharded reference on the mean gradients.
    const double want = std::sqrt(cpu::sum_squares(mean.data(), n));
    EXPECT_NEAR(norm, want, 1e-6 * want) << "step " << step;
    if (want > c.max_grad_norm) {
      for (float& x : mean) x *= cpu::clip_scale(want, c.max_grad_norm);
    }
    cpu::adamw_step(ref_w.data(), mean.data(), ref_m.data(), ref_v.data(), n, kLr, c.beta1, c.beta2, c.eps,
                    c.weight_decay, step + 1);
    EXPECT_LE(max_abs_diff(w, ref_w), 1e-6) << "step " << step;
  }
  std::vector<float> m(count), v(count);
  zero.gather_state(m.data(), v.data());
  EXPECT_LE(max_abs_diff(m, ref_m), 1e-6);
  EXPECT_LE(max_abs_diff(v, ref_v), 1e-6);
  expect_state_round_trip(zero, n, 9);
}

// The real LM: ZeRO-1's sharded step gives the bits of CpuModel's own clipping and AdamW, given the same
// (DDP-averaged) gradients. vocab 10000 makes 11 norm chunks, so the shards are several at 2 and 4 ranks.
TEST(Zero1, BitIdenticalToCpuModelAdamW) {
  const ModelConfig mc = ModelConfig::named("tiny", 16, 10000);
  const int64_t batch = 2, seq = 16;
  CpuModel plain(mc, batch, seq), sharded(mc, batch, seq);
  plain.init_parameters(3);
  sharded.init_parameters(3);
  const DdpOptions o = options(DdpVariant::bucketed, 0.5);
  DdpModel a(comm(), plain, batch * seq, o, false), b(comm(), sharded, batch * seq, o, true);
  ASSERT_NE(b.zero(), nullptr);
  EXPECT_LT(b.zero()->state_bytes(), 2 * plain.parameter_count() * int64_t(sizeof(float)) / comm().world_size() +
                                         2 * kGradientNormChunk * int64_t(sizeof(float)));
  a.broadcast_parameters();
  b.broadcast_parameters();
  AdamWConfig c;
  c.max_grad_norm = 0.05;  // clips
  std::vector<int32_t> x(size_t(batch * seq)), y(x.size());
  for (int s = 0; s < kSteps; ++s) {
    std::mt19937 rng(uint32_t(1000 * s + comm().rank()));
    std::uniform_int_distribution<int32_t> token(0, int32_t(mc.vocab - 1));
    for (size_t i = 0; i < x.size(); ++i) x[i] = token(rng), y[i] = token(rng);
    a.forward_backward(x, y);
    b.forward_backward(x, y);
    const size_t bytes = size_t(plain.parameter_count()) * sizeof(float);
    EXPECT_EQ(std::memcmp(plain.gradients(), sharded.gradients(), bytes), 0) << "step " << s;
    double na = 0, nb = 0;
    a.optimizer_step(c, 1e-3, &na);
    b.optimizer_step(c, 1e-3, &nb);
    EXPECT_EQ(na, nb) << "step " << s;
    EXPECT_GT(na, c.max_grad_norm) << "step " << s;
    EXPECT_EQ(std::memcmp(plain.parameters(), sharded.parameters(), bytes), 0) << "step " << s;
  }
  EXPECT_EQ(b.optimizer_steps(), kSteps);
}

// The LM trained for kLmSteps on global batches of `global` sequences of kLmSeq tokens (the same on every
// rank): by one process on the whole batch, or data-parallel, each rank on its slice.
constexpr int64_t kLmSeq = 16, kLmSteps = 3;

struct LmBatches {
  std::vector<int32_t> x, y;
  LmBatches(int64_t vocab, int64_t global, int64_t step) : x(size_t(global * kLmSeq)), y(x.size()) {
    std::mt19937 rng(uint32_t(77 + step));
    std::uniform_int_distribution<int32_t> token(0, int32_t(vocab - 1));
    for (size_t i = 0; i < x.size(); ++i) x[i] = token(rng), y[i] = token(rng);
  }
};

void train_whole_batch(LanguageModel& model, int64_t global) {
  for (int64_t s = 0; s < kLmSteps; ++s) {
    const LmBatches b(model.config().vocab, global, s);
    model.zero_grad();
    model.forward(b.x.data(), b.y.data());
    model.backward();
    optimizer_step(model, AdamWConfig{}, 1e-3);
  }
}

void train_rank_slices(DdpModel& dp, const ModelConfig& mc, int64_t global, const AdamWConfig& adamw = {}) {
  const int64_t local = global / comm().world_size();
  const auto at = size_t(comm().rank() * local * kLmSeq), count = size_t(local * kLmSeq);
  dp.broadcast_parameters();
  for (int64_t s = 0; s < kLmSteps; ++s) {
    const LmBatches b(mc.vocab, global, s);
    dp.train_step(std::span(b.x).subspan(at, count), std::span(b.y).subspan(at, count), adamw, 1e-3);
  }
  dp.await_parameters();  // ZeRO-1's last gather may still be in flight; the callers read the parameters
}

// The real LM, bucketed, against one process training on the whole batch.
TEST(Ddp, CpuModelBucketedMatchesOneProcess) {
  const ModelConfig mc = ModelConfig::named("tiny", kLmSeq, 256);
  const int64_t global = 4, local = global / comm().world_size();
  CpuModel one(mc, global, kLmSeq);
  one.init_parameters(5);
  train_whole_batch(one, global);
  CpuModel part(mc, local, kLmSeq);
  part.init_parameters(5 + uint64_t(comm().rank()));
  DdpModel dp(comm(), part, local * kLmSeq, options(DdpVariant::bucketed, 0.02), false);
  EXPECT_GT(dp.data_parallel().buckets().size(), 2u);
  train_rank_slices(dp, mc, global);
  const auto count = size_t(one.parameter_count());
  EXPECT_LE(relative_l2({part.parameters(), count}, {one.parameters(), count}), 1e-5);
}

// A world of one: every variant, with and without ZeRO-1, trains the real LM to the bits of the plain step
// (the model's own forward, backward and AdamW on the same batch), and DataParallel communicates nothing:
// no bucket launched, staged or waited for (DdpStats counts none), the gradients left as the backward wrote
// them. Under mpirun with more ranks the comparison is Ddp.CpuModelBucketedMatchesOneProcess's.
TEST(Ddp, WorldOfOneIsThePlainStepBitForBitAndCommunicatesNothing) {
  if (!alone()) GTEST_SKIP() << "a world of one only (this run has " << comm().world_size() << " ranks)";
  const ModelConfig mc = ModelConfig::named("tiny", kLmSeq, 256);
  const int64_t global = 4;
  CpuModel one(mc, global, kLmSeq);
  one.init_parameters(5);
  train_whole_batch(one, global);
  const std::vector<float> plain(one.parameters(), one.parameters() + one.parameter_count());
  for (const DdpOptions& o : {options(DdpVariant::per_param), options(DdpVariant::flat), options(DdpVariant::async),
                              options(DdpVariant::bucketed, 0.02)}) {
    for (bool zero1 : {false, true}) {
      SCOPED_TRACE(describe(o) + (zero1 ? " ZeRO-1" : ""));
      CpuModel part(mc, global, kLmSeq);
      part.init_parameters(5);
      DdpModel dp(comm(), part, global * kLmSeq, o, zero1);
      EXPECT_FALSE(dp.data_parallel().communicates());
      EXPECT_EQ(dp.data_parallel().staging_bytes(), 0);
      train_rank_slices(dp, mc, global);
      const DdpStats st = dp.data_parallel().last_stats();
      EXPECT_EQ(st.collectives, 0);
      EXPECT_EQ(st.elements, 0);
      EXPECT_EQ(std::vector<float>(part.parameters(), part.parameters() + part.parameter_count()), plain);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// CUDA (NCCL): skipped without NCCL or without a GPU per local rank.

#ifdef FLASHLM_WITH_CUDA
ModelConfig gpu_config() {
  ModelConfig c = ModelConfig::named("tiny", kLmSeq, 256);
  c.d_model = 64;  // head_dim 16: the smallest the tensor-core attention takes
  c.d_ff = 128;
  return c;
}

// A bf16 model's working copy's values.
std::vector<float> bf16_values(const std::vector<uint16_t>& bits) {
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = std::bit_cast<float>(uint32_t(bits[i]) << 16);
  return values;
}

// Each variant (and ZeRO-1) on CudaModel against the same GPU training the whole batch alone: the NCCL
// ordering (events, the model's stream waiting for the communicator's) gives the single-GPU result.
TEST(DdpGpu, EveryVariantMatchesOneGpuOnTheWholeBatch) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  comm().setup_cuda();
  const ModelConfig mc = gpu_config();
  const int64_t global = 8, local = global / comm().world_size();
  CudaModel one(mc, global, kLmSeq, DType::f32);
  one.init_parameters(5);
  train_whole_batch(one, global);
  const std::vector<float> reference = host_parameters(one);
  for (const DdpOptions& o : {options(DdpVariant::per_param), options(DdpVariant::flat), options(DdpVariant::async),
                              options(DdpVariant::bucketed, 0.02), options(DdpVariant::bucketed, 0.02, 2)}) {
    for (bool zero1 : {false, true}) {
      CudaModel part(mc, local / o.grad_accum, kLmSeq, DType::f32);
      part.init_parameters(5 + uint64_t(comm().rank()));
      DdpModel dp(comm(), part, local / o.grad_accum * kLmSeq, o, zero1);
      train_rank_slices(dp, mc, global);
      EXPECT_LE(relative_l2(host_parameters(part), reference), 1e-5) << describe(o) << (zero1 ? " ZeRO-1" : "");
      const DdpStats st = dp.data_parallel().last_stats();
      EXPECT_EQ(st.elements, alone() ? 0 : part.parameter_count()) << describe(o);
      EXPECT_GE(st.exposed_ms, 0.0) << describe(o);
      // With nothing to communicate, shard or accumulate, DdpModel::train_step is the model's own: one graph.
      if (alone() && !zero1 && o.grad_accum == 1) {
        EXPECT_EQ(part.cuda_graph_status(), "on") << describe(o);
      }
    }
  }
}

// Whether x is a value of the 16-bit type (the result of rounding to it, widened back exactly).
bool representable(float x, DType type) {
  return type == DType::bf16 ? float(bf16_t(x)) == x : float(fp16_t(x)) == x;
}

// The toy's gradients (this rank's slice of a batch) in GPU memory, synchronised with a 16-bit all-reduce by
// every variant: each communicated gradient is a value of the type and the fp32 average over ranks within
// the type's error; the frozen gradient is untouched. The error: every rank's gradient is rounded to the
// type, and NCCL's average rounds again for its scaling by 1/N and each of its N - 1 additions, each by at
// most u = 2^-8 (bf16) or 2^-11 (fp16) of at most the mean of the ranks' |g| (fp16: plus half its smallest
// subnormal, 2^-25, per rounding).
TEST(DdpGpu, SixteenBitAllReduceOfTheToyGradients) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  comm().setup_cuda();
  const int n = comm().world_size(), r = comm().rank();
  toy::Model model(1);
  std::vector<int32_t> x, y;
  global_batch(0, x, y);
  const int64_t rows = kGlobalRows / n;
  model.forward_backward(std::span(x).subspan(size_t(r * rows), size_t(rows)),
                         std::span(y).subspan(size_t(r * rows), size_t(rows)));
  const DdpRange frozen{model.params.layout[toy::kFrozen].offset, model.params.layout[toy::kFrozen].numel()};
  std::fill_n(model.g.begin() + frozen.offset, frozen.count, float(r + 1));
  std::vector<float> mean = model.g, mean_abs(model.g.size());
  for (size_t i = 0; i < mean.size(); ++i) mean_abs[i] = std::abs(model.g[i]);
  comm().all_reduce(std::span<float>(mean), ReduceOp::avg);
  comm().all_reduce(std::span<float>(mean_abs), ReduceOp::avg);

  DdpParameters params = model.params;
  params.device = Device::cuda;
  const size_t bytes = model.g.size() * sizeof(float);
  const Buffer grads = Buffer::allocate(bytes, Device::cuda, "test gradients");
  auto* g = static_cast<float*>(grads.data());
  std::vector<DdpOptions> cases = kEveryVariant;
  cases.push_back(options(DdpVariant::bucketed, 0.0008, 2));
  for (DType type : {DType::bf16, DType::f16}) {
    const double u = std::ldexp(1.0, type == DType::bf16 ? -8 : -11);
    const double subnormal = type == DType::bf16 ? 0.0 : std::ldexp(1.0, -25);
    for (DdpOptions o : cases) {
      o.reduce_dtype = type;
      DataParallel ddp(comm(), params, o);
      EXPECT_EQ(ddp.staging_bytes(), kCommunicated * 2) << describe(o);  // every bucket, 2 bytes per element
      cuda_copy(g, model.g.data(), bytes);
      for (int64_t k = 0; k + 1 < o.grad_accum; ++k) {
        ddp.begin_backward(g, false);
        ddp.finish_backward();
      }
      ddp.begin_backward(g, true);
      for (toy::Param p : {toy::kHead, toy::kFc2, toy::kFc1, toy::kEmbed}) ddp.gradients_ready(p, p);
      ddp.finish_backward();
      cuda_synchronize();
      std::vector<float> got(model.g.size());
      cuda_copy(got.data(), g, bytes);

      const double accum = double(o.grad_accum);
      int64_t too_far = 0, not_rounded = 0, differ = 0;
      for (const DdpRange& range : model.params.trainable_ranges()) {
        for (int64_t i = range.offset; i < range.offset + range.count; ++i) {
          const double v = got[size_t(i)], want = mean[size_t(i)] / accum;
          const double bound = (double(n) + 1) * (u * mean_abs[size_t(i)] + subnormal) / accum * 1.01;
          too_far += std::abs(v - want) > bound;
          not_rounded += !representable(float(v * accum), type);
          differ += v != want;
        }
      }
      EXPECT_EQ(too_far, 0) << describe(o);
      EXPECT_EQ(not_rounded, 0) << describe(o);
      EXPECT_GT(differ, 0) << describe(o) << ": no gradient was rounded, as if reduced in fp32";
      for (int64_t i = 0; i < frozen.count; ++i) {
        EXPECT_EQ(got[size_t(frozen.offset + i)], float(r + 1)) << describe(o) << " frozen element " << i;
      }
    }
  }
}

// CudaModel trained with a bf16 all-reduce against the same training with an fp32 one, every variant with and
// without ZeRO-1: the synchronised gradients are bf16 values, and the parameter updates agree within 3e-2
// relative L2 but are not bit-identical (the bf16 path did round). AdamW divides each gradient by its own
// running magnitude, so a relative error in a gradient moves its update by about as much: on two H200s the
// updates differ by 1.14e-2 (~3 of bf16's rounding errors u = 2^-8; a CPU simulation that only rounds
// each gradient and perturbs it by up to 5u gives 3.6e-3, NCCL also rounds its bf16 sums). A bucket reduced
// wrongly (unreduced, mis-scaled, misplaced) moves its parameters' updates by O(1) instead.
// ZeRO-1 on a bf16 model gathers the working weights, not the fp32 masters: the weights the model computes
// with are plain DDP's, bit for bit, after the same steps (the same AdamW kernel per element writes the
// master and its bf16 rounding), and gather_master_parameters() brings back the full fp32 masters. Without
// clipping: with it, the sharded norm adds its partial sums in another order, and one bf16 weight that
// rounds the other way changes every later step a little (measured: a third of the weights ~1e-3 apart).
TEST(DdpGpu, ZeroOneInBf16GathersTheWorkingWeightsAndTheMastersOnDemand) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  comm().setup_cuda();
  const ModelConfig mc = gpu_config();
  const int64_t global = 8, local = global / comm().world_size();
  CudaModel plain(mc, local, kLmSeq, DType::bf16), sharded(mc, local, kLmSeq, DType::bf16);
  plain.init_parameters(5);
  sharded.init_parameters(5);
  DdpModel a(comm(), plain, local * kLmSeq, options(DdpVariant::bucketed, 0.02), false);
  DdpModel b(comm(), sharded, local * kLmSeq, options(DdpVariant::bucketed, 0.02), true);
  AdamWConfig no_clip;
  no_clip.max_grad_norm = 0;
  train_rank_slices(a, mc, global, no_clip);
  train_rank_slices(b, mc, global, no_clip);
  const auto n = size_t(plain.parameter_count());
  ASSERT_NE(plain.working_parameters(), nullptr);
  const std::vector<uint16_t> wa = working_bits(plain), wb = working_bits(sharded);
  const std::vector<float> fa = bf16_values(wa), fb = bf16_values(wb);
  // A shard that was not gathered would still hold the initial weights, ~10% away after these steps.
  size_t differ = 0;
  for (size_t i = 0; i < n; ++i) differ += wa[i] != wb[i];
  EXPECT_EQ(differ, 0u) << "of " << n << " working weights; relative L2 " << relative_l2(fb, fa);
  EXPECT_EQ(b.zero()->masters_stale(), comm().world_size() > 1);
  b.gather_master_parameters();
  EXPECT_FALSE(b.zero()->masters_stale());
  EXPECT_EQ(relative_l2(host_parameters(sharded), host_parameters(plain)), 0.0);
}

// ZeRO-1 with bucketed DDP on CUDA reduce-scatters each bucket into the per-bucket shards: fp32 training
// matches plain bucketed DDP (all-reduce, unsharded AdamW), also with gradient accumulation; a bf16 model's
// gathered working weights match plain DDP's and gather_master_parameters() brings back the masters; the
// moments round-trip through a checkpoint (gather_state, load_state into a fresh optimizer).
TEST(DdpGpu, ZeroOneReduceScatterTrainsLikeAllReduce) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  comm().setup_cuda();
  const ModelConfig mc = gpu_config();
  const int64_t global = 8, local = global / comm().world_size();
  for (const DdpOptions& o : {options(DdpVariant::bucketed, 0.02), options(DdpVariant::bucketed, 0.02, 2)}) {
    CudaModel plain(mc, local / o.grad_accum, kLmSeq, DType::f32), sharded(mc, local / o.grad_accum, kLmSeq, DType::f32);
    plain.init_parameters(5);
    sharded.init_parameters(5);
    DdpModel a(comm(), plain, local / o.grad_accum * kLmSeq, o, false);
    DdpModel b(comm(), sharded, local / o.grad_accum * kLmSeq, o, true);
    EXPECT_EQ(a.gradient_sync(), "all-reduce");
    EXPECT_EQ(b.gradient_sync(), "reduce-scatter") << describe(o);
    ASSERT_NE(b.zero(), nullptr);
    EXPECT_TRUE(b.zero()->per_bucket());
    // The state is 1/world of the moments, plus tails of fewer than world elements per bucket.
    const int64_t buckets = int64_t(b.data_parallel().buckets().size());
    EXPECT_LE(b.zero()->shard_elements(), plain.parameter_count() / comm().world_size() + buckets * comm().world_size());
    train_rank_slices(a, mc, global);
    train_rank_slices(b, mc, global);
    EXPECT_LE(relative_l2(host_parameters(sharded), host_parameters(plain)), 1e-6) << describe(o);
    const DdpStats st = b.data_parallel().last_stats();
    EXPECT_EQ(st.elements, alone() ? 0 : sharded.parameter_count()) << describe(o);
    EXPECT_GE(st.collectives, alone() ? 0 : buckets) << describe(o);  // one reduce-scatter per bucket, plus the tails

    // Checkpoint: the moments through the host, into a fresh per-bucket optimizer.
    const auto n = size_t(sharded.parameter_count());
    std::vector<float> m(n), v(n), m2(n), v2(n), w_plain(n), m_plain(n), v_plain(n);
    b.zero()->gather_state(m.data(), v.data());
    plain.save_state(w_plain, m_plain, v_plain);  // unsharded AdamW's moments
    EXPECT_LE(relative_l2(m, m_plain), 1e-5) << describe(o);
    EXPECT_LE(relative_l2(v, v_plain), 1e-5) << describe(o);
    ZeroOptimizer fresh(comm(), DdpParameters::of(sharded), b.data_parallel().buckets());
    fresh.load_state(m.data(), v.data(), b.optimizer_steps());
    fresh.gather_state(m2.data(), v2.data());
    EXPECT_EQ(m2, m) << describe(o);
    EXPECT_EQ(v2, v) << describe(o);
    EXPECT_EQ(fresh.steps(), kLmSteps);
  }

  // bf16: the working copy is updated on each rank's parts and tails and all-gathered per bucket.
  CudaModel plain(mc, local, kLmSeq, DType::bf16), sharded(mc, local, kLmSeq, DType::bf16);
  plain.init_parameters(5);
  sharded.init_parameters(5);
  DdpModel a(comm(), plain, local * kLmSeq, options(DdpVariant::bucketed, 0.02), false);
  DdpModel b(comm(), sharded, local * kLmSeq, options(DdpVariant::bucketed, 0.02), true);
  EXPECT_EQ(b.gradient_sync(), "reduce-scatter");
  // Without clipping (whose norm the shards sum in another order), as in ZeroOneInBf16...; and at two
  // ranks a reduce-scatter adds the same two values per element as an all-reduce: the same bits.
  AdamWConfig no_clip;
  no_clip.max_grad_norm = 0;
  train_rank_slices(a, mc, global, no_clip);
  train_rank_slices(b, mc, global, no_clip);
  const auto n = size_t(plain.parameter_count());
  const std::vector<uint16_t> wa = working_bits(plain), wb = working_bits(sharded);
  const std::vector<float> fa = bf16_values(wa), fb = bf16_values(wb);
  size_t differ = 0;
  for (size_t i = 0; i < n; ++i) differ += wa[i] != wb[i];
  if (comm().world_size() == 2) {
    EXPECT_EQ(differ, 0u) << "of " << n << " working weights; relative L2 " << relative_l2(fb, fa);
  } else {  // other summation orders: bf16 roundings may differ, an ungathered part would be ~10% off
    EXPECT_LE(relative_l2(fb, fa), 1e-3);
  }
  EXPECT_EQ(b.zero()->masters_stale(), comm().world_size() > 1);
  b.gather_master_parameters();
  EXPECT_FALSE(b.zero()->masters_stale());
  EXPECT_LE(relative_l2(host_parameters(sharded), host_parameters(plain)), 1e-5);
}

TEST(DdpGpu, Bf16AllReduceTrainsLikeFp32) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  comm().setup_cuda();
  const ModelConfig mc = gpu_config();
  const int64_t global = 8, local = global / comm().world_size();
  CudaModel start(mc, 1, kLmSeq, DType::f32);
  start.init_parameters(5);  // rank 0's, which the broadcast gives every rank
  const std::vector<float> initial = host_parameters(start);
  const auto update = [&](const std::vector<float>& trained) {
    std::vector<float> d(trained.size());
    for (size_t i = 0; i < d.size(); ++i) d[i] = trained[i] - initial[i];
    return d;
  };
  for (DdpOptions o : {options(DdpVariant::per_param), options(DdpVariant::flat), options(DdpVariant::async),
                       options(DdpVariant::bucketed, 0.02), options(DdpVariant::bucketed, 0.02, 2)}) {
    for (bool zero1 : {false, true}) {
      std::vector<float> trained[2];  // fp32, bf16 all-reduce
      for (int bf16 : {0, 1}) {
        o.reduce_dtype = bf16 ? DType::bf16 : DType::f32;
        CudaModel part(mc, local / o.grad_accum, kLmSeq, DType::f32);
        part.init_parameters(5 + uint64_t(comm().rank()));
        DdpModel dp(comm(), part, local / o.grad_accum * kLmSeq, o, zero1);
        EXPECT_EQ(dp.data_parallel().staging_bytes(), bf16 ? 2 * part.parameter_count() : 0) << describe(o);
        train_rank_slices(dp, mc, global);
        trained[bf16] = host_parameters(part);
        if (!bf16) continue;
        // One more synchronised backward: what the optimizer would read are bf16 values (times 1/grad_accum).
        const LmBatches b(mc.vocab, local, kLmSteps);
        dp.forward_backward(b.x, b.y);
        std::vector<float> grads(size_t(part.parameter_count()));
        part.copy_gradients_to(grads.data());
        int64_t not_rounded = 0;
        for (float v : grads) not_rounded += !representable(v * float(o.grad_accum), DType::bf16);
        EXPECT_EQ(not_rounded, 0) << describe(o);
      }
      const std::string what = describe(o) + (zero1 ? " ZeRO-1" : "");
      EXPECT_LE(relative_l2(update(trained[1]), update(trained[0])), 3e-2) << what;
      EXPECT_TRUE(trained[1] != trained[0]) << what << ": bit-identical to the fp32 all-reduce";
    }
  }
}
#else
TEST(DdpGpu, SkippedWithoutCuda) { GTEST_SKIP() << "flashlm was built without CUDA"; }
#endif

// ---------------------------------------------------------------------------------------------------
// Bad input: errors naming the problem, raised identically on every rank before any communication.

TEST(DdpErrors, VariantNames) {
  for (DdpVariant v : {DdpVariant::per_param, DdpVariant::flat, DdpVariant::async, DdpVariant::bucketed}) {
    EXPECT_EQ(parse_ddp_variant(ddp_variant_name(v)), v);
  }
  try {
    parse_ddp_variant("ring");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown DDP variant 'ring'"), std::string::npos) << e.what();
  }
}

TEST(DdpErrors, InconsistentParameters) {
  auto message = [](const DdpParameters& p) {
    try {
      p.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  toy::Model model(1);
  DdpParameters p = model.params;
  p.tied_to[toy::kHead] = toy::kFc1;  // another shape
  EXPECT_NE(message(p).find("does not share its storage"), std::string::npos) << message(p);
  p = model.params;
  p.tied_to[toy::kHead] = -1;  // E's storage twice, untied
  EXPECT_NE(message(p).find("overlap"), std::string::npos) << message(p);
  p = model.params;
  p.trainable[toy::kHead] = false;
  EXPECT_NE(message(p).find("both are trainable or both frozen"), std::string::npos) << message(p);
  p = model.params;
  p.trainable.pop_back();
  EXPECT_NE(message(p).find("trainable has 4 entries for 5 parameters"), std::string::npos) << message(p);
  EXPECT_THROW(DataParallel(comm(), model.params, options(DdpVariant::bucketed, 0)), Error);
  EXPECT_THROW(DataParallel(comm(), model.params, options(DdpVariant::flat, 25, 0)), Error);
  EXPECT_THROW(ZeroOptimizer(comm(), model.params, 0), Error);
}

// The 16-bit all-reduce is NCCL's: on CPU parameters (MPI) it is refused before any communication.
TEST(DdpErrors, ReducedPrecisionNeedsCuda) {
  for (DType t : {DType::f32, DType::bf16, DType::f16}) EXPECT_EQ(parse_reduce_dtype(dtype_name(t)), t);
  auto message = [](const DdpOptions& o) {
    try {
      DataParallel ddp(comm(), toy::Model(1).params, o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (DType t : {DType::bf16, DType::f16}) {
    const std::string m = message(options(DdpVariant::bucketed, 25, 1, t));
    EXPECT_NE(m.find(std::string(dtype_name(t)) + " gradient reduction needs --device cuda (NCCL)"), std::string::npos)
        << m;
  }
  const std::string m = message(options(DdpVariant::flat, 25, 1, DType::f64));
  EXPECT_NE(m.find("reduce_dtype fp64, expected fp32, bf16 or fp16"), std::string::npos) << m;
  try {
    parse_reduce_dtype("fp8");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown gradient reduction type 'fp8'"), std::string::npos) << e.what();
  }
}

TEST(DdpErrors, MisusedBackwardBrackets) {
  toy::Model model(1);
  DataParallel ddp(comm(), model.params, options(DdpVariant::async, 25, 2));
  EXPECT_THROW(ddp.finish_backward(), Error);                      // no begin
  EXPECT_THROW(ddp.begin_backward(model.g.data(), true), Error);   // micro-step 1 of 2 must not sync
  ddp.begin_backward(model.g.data(), false);
  EXPECT_THROW(ddp.begin_backward(model.g.data(), false), Error);  // not finished
  ddp.finish_backward();
  EXPECT_THROW(ddp.begin_backward(model.g.data(), false), Error);  // micro-step 2 of 2 must sync
  ddp.begin_backward(model.g.data(), true);
  EXPECT_THROW(ddp.gradients_ready(0, 5), Error);  // 5 parameters: 0..4
  ddp.gradients_ready(toy::kFc2, toy::kFc2);
  try {
    ddp.gradients_ready(toy::kFc2, toy::kFc2);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'fc2.weight' was reported twice"), std::string::npos) << e.what();
  }
  ddp.finish_backward();  // completes what was started, on every rank
}

}  // namespace
