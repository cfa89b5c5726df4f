// FSDP (DdpVariant::fsdp, flashlm/fsdp.h) on the CPU, run by CTest as one process and under `mpirun -np 2`
// and `-np 4` (main: mpi_test_main.cpp). The real LM (CpuModel, tiny) trained by FSDP, each rank on its
// slice of every global batch, against one process training on the whole batch: after 5 steps the
// parameters and AdamW moments gathered from the shards are within 1e-6 (relative L2) of the single
// process's, and within 1e-6 element by element of bucketed DDP's on the same slices (cutting the batch
// reorders sums, which AdamW amplifies in a few elements to ~1e-6 against one process; FSDP adds nothing
// to that), with every prefetch depth, with gradient accumulation and with activation recomputation. A world of one, without
// accumulation, gives the single process's bits. Freed weights are poisoned with NaN, so a forward or
// backward that read a part before gathering it would show in the loss. Also: the bucket plan follows the
// model's parts; the gathered bytes stay within the prefetch bound; evaluation on rank 0 alone after
// gather_parameters(); a rank that dies mid-step (FLASHLM_TEST_DIE_ON_RANK, run by dying_rank.cmake). FSDP's
// FP8 gather (--precision fp8): the losses of every rank on the same batch are the one-process fp8 run's bit
// for bit, sliced batches train as full storage's local rounding does, the layers bring half a bf16
// gather's bytes, a NaN in one rank's part reaches every rank's copy, the plan on both devices, and
// DdpOptions::fsdp_gather_alone (a world of one gathering too). On GPUs (skipped without one per rank) FSDP
// against bucketed DDP on CudaModel, fp32 and bf16, and FSDP's FP8 gather on CudaModel against the plain
// FP8 step.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <memory>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "dist/mpi_testing.h"
#include "dist/toy_model.h"
#include "dist/toy_training.h"
#include "dist/train_testing.h"
#include "flashlm/ddp.h"
#include "flashlm/ddp_model.h"
#include "flashlm/dist.h"
#include "flashlm/error.h"
#include "flashlm/fsdp.h"
#include "flashlm/memory.h"
#include "flashlm/model.h"
#include "flashlm/train.h"
#include "flashlm/zero.h"
#include "model/fp8.h"
#include "optim/optimizer.h"
#ifdef FLASHLM_WITH_CUDA
#include "core/cuda_runtime.h"
#include "flashlm/device.h"
#include "model/cuda/fp8.h"
#endif

using namespace flashlm;

namespace {

Communicator& comm() { return test_world(); }

constexpr int64_t kSeq = 16, kSteps = 5;
constexpr int64_t kGlobal = 8;  // sequences per step: divisible by every world size (1, 2, 4) times grad_accum 2
constexpr double kLr = 1e-3;

ModelConfig lm_config() { return ModelConfig::named("tiny", kSeq, 256); }

AdamWConfig clipping_adamw() {
  AdamWConfig c;
  c.max_grad_norm = 0.5;  // clips some steps: the sharded norm must be the global one
  return c;
}

struct Batches {
  std::vector<int32_t> x, y;
  Batches(int64_t vocab, int64_t step) : x(size_t(kGlobal * kSeq)), y(x.size()) {
    std::mt19937 rng(uint32_t(31 + step));
    std::uniform_int_distribution<int32_t> token(0, int32_t(vocab - 1));
    for (size_t i = 0; i < x.size(); ++i) x[i] = token(rng), y[i] = token(rng);
  }
};

// The single-process reference: kSteps on the whole global batch. Returns its parameters and moments.
struct State {
  std::vector<float> params, m, v;
};
State train_one_process(const ModelConfig& mc) {
  CpuModel one(mc, kGlobal, kSeq);
  one.init_parameters(11);
  for (int64_t s = 0; s < kSteps; ++s) {
    const Batches b(mc.vocab, s);
    one.zero_grad();
    one.forward(b.x.data(), b.y.data());
    one.backward();
    optimizer_step(one, clipping_adamw(), kLr);
  }
  const auto n = size_t(one.parameter_count());
  State st{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  one.save_state(st.params, st.m, st.v);
  return st;
}

DdpOptions fsdp_options(int prefetch, int64_t grad_accum = 1) {
  DdpOptions o;
  o.variant = DdpVariant::fsdp;
  o.grad_accum = grad_accum;
  o.fsdp_prefetch = prefetch;
  o.fsdp_poison_freed = true;
  return o;
}

// kSteps of FSDP, each rank on its rows of every global batch; every loss must be finite (a read of a
// poisoned, freed weight would make it NaN).
void train_fsdp(DdpModel& dp, const ModelConfig& mc, std::vector<double>* losses = nullptr) {
  const int64_t local = kGlobal / comm().world_size();
  const auto at = size_t(comm().rank() * local * kSeq), count = size_t(local * kSeq);
  dp.broadcast_parameters();
  for (int64_t s = 0; s < kSteps; ++s) {
    const Batches b(mc.vocab, s);
    const double loss = dp.forward_backward(std::span(b.x).subspan(at, count), std::span(b.y).subspan(at, count));
    EXPECT_TRUE(std::isfinite(loss)) << "step " << s << ": a freed weight was read";
    if (losses) losses->push_back(loss);
    dp.optimizer_step(clipping_adamw(), kLr);
  }
}

// The tiny LM on this rank's rows of the global batch under FSDP with `prefetch`, freed weights poisoned.
struct FsdpLm {
  ModelConfig mc = lm_config();
  int64_t local = kGlobal / comm().world_size();
  CpuModel model{mc, local, kSeq};
  DdpModel dp;
  explicit FsdpLm(int prefetch) : dp(comm(), model, local * kSeq, fsdp_options(prefetch), false) {
    model.init_parameters(11);
  }
  // One more forward and backward, on the first rows of step `step`'s batch; returns the loss.
  double forward_backward(int64_t step) {
    const Batches b(mc.vocab, step);
    return dp.forward_backward(std::span(b.x).first(size_t(local * kSeq)), std::span(b.y).first(size_t(local * kSeq)));
  }
};

// kSteps of bucketed DDP on the same slices and micro-batches: the data-parallel arithmetic without FSDP.
State train_ddp(const ModelConfig& mc, int64_t grad_accum) {
  const int64_t local = kGlobal / comm().world_size();
  CpuModel part(mc, local / grad_accum, kSeq);
  part.init_parameters(11);
  DdpOptions o;
  o.variant = DdpVariant::bucketed;
  o.bucket_mb = 0.02;
  o.grad_accum = grad_accum;
  DdpModel dp(comm(), part, local / grad_accum * kSeq, o, false);
  train_fsdp(dp, mc);
  const auto n = size_t(part.parameter_count());
  State st{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  part.save_state(st.params, st.m, st.v);
  return st;
}

// The whole state, gathered from the shards on every rank.
State gathered_state(DdpModel& dp, const LanguageModel& model) {
  const auto n = size_t(model.parameter_count());
  State st{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  dp.gather_master_parameters();
  model.save_state(st.params, st.m, st.v);
  dp.zero()->gather_state(st.m.data(), st.v.data());
  return st;
}

// FSDP's gathered state against one process on the whole batch and against DDP on the same slices.
void expect_trains_like(const State& got, const State& one, const State& ddp, const std::string& what) {
  EXPECT_LE(relative_l2(got.params, one.params), 1e-6) << what;
  EXPECT_LE(relative_l2(got.m, one.m), 1e-6) << what;
  EXPECT_LE(relative_l2(got.v, one.v), 1e-6) << what;
  EXPECT_LE(max_abs_diff(got.params, ddp.params), 1e-6) << what;
  EXPECT_LE(max_abs_diff(got.m, ddp.m), 1e-6) << what;
  EXPECT_LE(max_abs_diff(got.v, ddp.v), 1e-6) << what;
}

// ---------------------------------------------------------------------------------------------------
// The plan.

TEST(FsdpPlan, UnitNamesAreTheModelsParts) {
  EXPECT_EQ(fsdp_unit_name("layers.3.attn.q_proj.weight"), "layers.3.");
  EXPECT_EQ(fsdp_unit_name("layers.12.ln1.weight"), "layers.12.");
  EXPECT_EQ(fsdp_unit_name("token_embeddings.weight"), "token_embeddings.");
  EXPECT_EQ(fsdp_unit_name("lm_head.weight"), "lm_head.");
  EXPECT_EQ(fsdp_unit_name("bias"), "bias");
}

// Every trainable element in exactly one bucket; a bucket is one run within one part, sharded when its
// parameters are matrices and replicated when they are gains; reverse order.
TEST(FsdpPlan, BucketsAreContiguousRunsOfOnePartAndKind) {
  const ModelConfig mc = lm_config();
  const DdpParameters params{parameter_layout(mc), {}, {}, {}, Device::cpu};
  const std::vector<DdpBucket> buckets = fsdp_bucket_plan(params);
  // Per layer: [q k v o] and [w1 w2 w3] sharded, ln1 and ln2 replicated; the embedding, ln_final, the head.
  EXPECT_EQ(buckets.size(), size_t(4 * mc.layers + 3));
  std::vector<int> covered(size_t(params.flat_size()), 0);
  int64_t last_offset = params.flat_size();
  for (const DdpBucket& b : buckets) {
    ASSERT_EQ(b.ranges.size(), 1u);
    EXPECT_LT(b.ranges.front().offset, last_offset);
    last_offset = b.ranges.front().offset;
    std::set<std::string> units;
    for (int64_t p : b.params) {
      const ParameterInfo& info = params.layout[size_t(p)];
      units.insert(fsdp_unit_name(info.name));
      EXPECT_EQ(b.replicated, info.shape.size() == 1) << info.name;
      for (int64_t i = 0; i < info.numel(); ++i) ++covered[size_t(info.offset + i)];
    }
    EXPECT_EQ(units.size(), 1u);
  }
  EXPECT_TRUE(std::all_of(covered.begin(), covered.end(), [](int c) { return c == 1; }));
  // A replicated bucket has no parts: all-reduced and updated on every rank.
  const ZeroBucketLayout layout = zero_bucket_layout(buckets, 4, 1);
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (!buckets[b].replicated) continue;
    EXPECT_EQ(layout.buckets[b].part, 0);
    EXPECT_EQ(layout.buckets[b].tail.count, buckets[b].elements);
  }
}

// ---------------------------------------------------------------------------------------------------
// Training against one process.

TEST(Fsdp, ReproducesFullBatchTrainingWithEveryPrefetchDepth) {
  const ModelConfig mc = lm_config();
  const State one = train_one_process(mc), ddp = train_ddp(mc, 1);
  for (int prefetch : {0, 1, 2}) {
    const int64_t local = kGlobal / comm().world_size();
    CpuModel part(mc, local, kSeq);
    part.init_parameters(11 + uint64_t(comm().rank()));  // the ranks start different: the broadcast fixes it
    DdpModel dp(comm(), part, local * kSeq, fsdp_options(prefetch), false);
    ASSERT_NE(dp.fsdp(), nullptr);
    EXPECT_EQ(dp.fsdp()->units(), comm().world_size() > 1 ? mc.layers + 2 : 0);
    EXPECT_EQ(dp.gradient_sync(), "reduce-scatter");
    train_fsdp(dp, mc);
    EXPECT_EQ(dp.optimizer_steps(), kSteps);
    const State got = gathered_state(dp, part);
    expect_trains_like(got, one, ddp, "prefetch " + std::to_string(prefetch));
    if (comm().world_size() == 1) {
      EXPECT_EQ(got.params, one.params) << "prefetch " << prefetch;
      EXPECT_EQ(got.v, one.v) << "prefetch " << prefetch;
    }
  }
}

TEST(Fsdp, GradientAccumulationReproducesFullBatchTraining) {
  const ModelConfig mc = lm_config();
  const int64_t local = kGlobal / comm().world_size(), accum = 2;
  const State one = train_one_process(mc), ddp = train_ddp(mc, accum);
  CpuModel part(mc, local / accum, kSeq);
  part.init_parameters(11);
  DdpModel dp(comm(), part, local / accum * kSeq, fsdp_options(1, accum), false);
  train_fsdp(dp, mc);
  expect_trains_like(gathered_state(dp, part), one, ddp, "grad_accum 2");
}

// FSDP with activation recomputation: a recomputing backward reads each block's weights again after the
// forward freed them, so it gathers them again (the poisoned freed weights would otherwise show as NaN).
// blocks (every block's input kept), blocks:2 (a two-block segment recomputed at once) and selective (no
// attention recomputed), without and with gradient accumulation, against the single process on the whole
// batch, which does not recompute.
TEST(Fsdp, RecomputationReproducesFullBatchTraining) {
  const ModelConfig mc = lm_config();
  const State one = train_one_process(mc);
  for (int64_t accum : {1, 2}) {
    const State ddp = train_ddp(mc, accum);
    const int64_t local = kGlobal / comm().world_size() / accum;
    for (const char* plan : {"blocks", "blocks:2", "selective"}) {
      ModelOptions options;
      options.recompute = RecomputePlan::parse(plan);
      CpuModel part(mc, local, kSeq, options);
      part.init_parameters(11);
      DdpModel dp(comm(), part, local * kSeq, fsdp_options(1, accum), false);
      train_fsdp(dp, mc);
      const std::string what = std::string("recompute ") + plan + ", grad_accum " + std::to_string(accum);
      EXPECT_TRUE(dp.fsdp()->released(0, part.parameter_count())) << what;
      expect_trains_like(gathered_state(dp, part), one, ddp, what);
    }
  }
}

// Each rank keeps 1/world of the sharded weights, their gradients and moments; the parts whole at once
// stay within the prefetch bound: the part being read and `prefetch` more, plus the one being freed.
TEST(Fsdp, ShardsAndGatheredBytesPerRank) {
  const ModelConfig mc = lm_config();
  const int64_t world = comm().world_size();
  const std::vector<ParameterInfo> layout = parameter_layout(mc);
  int64_t largest_part = 0;  // elements of the largest model part
  for (const ParameterInfo& p : layout) {
    int64_t part = 0;
    for (const ParameterInfo& q : layout) part += fsdp_unit_name(q.name) == fsdp_unit_name(p.name) ? q.numel() : 0;
    largest_part = std::max(largest_part, part);
  }
  for (int prefetch : {0, 2}) {
    FsdpLm lm(prefetch);
    train_fsdp(lm.dp, mc);
    lm.forward_backward(kSteps);
    const DdpMemory mem = lm.dp.memory();
    const int64_t n = lm.model.parameter_count(), f32 = 4;
    // The replicated gains and the tails (< world elements per bucket) on top of 1/world.
    const int64_t slack = (2 * mc.layers + 1) * mc.d_model + (2 * mc.layers + 2) * world;
    EXPECT_LE(mem.parameters, (n / world + slack) * f32) << "prefetch " << prefetch;
    EXPECT_EQ(mem.gradients, mem.parameters);
    EXPECT_EQ(mem.optimizer_state, 2 * mem.parameters);
    EXPECT_EQ(mem.model_buffers, 2 * n * f32);
    const int64_t bound = (prefetch + 2) * largest_part * (world - 1) / world * f32;
    EXPECT_LE(mem.gathered, bound) << "prefetch " << prefetch;
    if (world > 1) {
      EXPECT_GT(mem.gathered, 0) << "prefetch " << prefetch;
    }
  }
}

// After a step every part is released; so is it after a forward and backward, since each part is freed
// after use and the backward's prefetch follows the parts the last backward read, which ends at layer 0 (no
// gather of the embedding, which the backward does not read, is left in flight).
TEST(Fsdp, EveryPartIsReleasedAfterUse) {
  FsdpLm lm(2);
  train_fsdp(lm.dp, lm.mc);
  const int64_t n = lm.model.parameter_count();
  EXPECT_TRUE(lm.dp.fsdp()->released(0, n));
  lm.forward_backward(kSteps);
  EXPECT_TRUE(lm.dp.fsdp()->released(0, n));
  lm.dp.gather_parameters();
  EXPECT_EQ(lm.dp.fsdp()->released(0, n), comm().world_size() == 1);  // nothing to gather at one rank
  lm.dp.optimizer_step(clipping_adamw(), kLr);
  EXPECT_TRUE(lm.dp.fsdp()->released(0, n));
}

// The toy (toy_model.h: a frozen F, and the head tied to the embedding E) through FSDP's pieces driven by
// hand: its whole model one part, needed before each forward-backward and done after. Frozen: in no bucket,
// so never sharded, freed or updated, and whole everywhere; tied: E's gradient (both uses) reduce-scattered
// once, E sharded like any weight. Trains like the toy's single process on the whole batch.
TEST(Fsdp, ToyWithFrozenAndTiedParameters) {
  const int rank = comm().rank(), world = comm().world_size();
  toy::Model model(1 + uint64_t(rank));
  DdpOptions o = fsdp_options(1);
  o.reduce_scatter = true;
  DataParallel ddp(comm(), model.params, o);
  for (const DdpBucket& b : ddp.buckets()) {
    for (int64_t p : b.params) EXPECT_TRUE(p != toy::kFrozen && p != toy::kHead) << "parameter " << p;
  }
  ZeroOptimizer zero(comm(), model.params, ddp.buckets(), false);
  FsdpParameters fsdp(comm(), model.params, ddp.buckets(), 1, true);
  fsdp.set_storage(model.w.data(), nullptr, DType::f32, nullptr);
  model.hook = ddp.hook();
  ddp.broadcast_parameters(model.w.data());
  fsdp.mark_whole();
  const DdpRange frozen{model.params.layout[toy::kFrozen].offset, model.params.layout[toy::kFrozen].numel()};
  const std::vector<float> frozen_before(model.w.begin() + frozen.offset, model.w.begin() + frozen.offset + frozen.count);
  const int64_t n = model.params.flat_size(), rows = toy::kGlobalRows / world;
  std::vector<int32_t> x, y;
  for (int64_t s = 0; s < toy::kSteps; ++s) {
    toy::global_batch(s, x, y);
    std::fill(model.g.begin(), model.g.end(), 0.0f);
    fsdp.begin_pass(false);
    fsdp.needed(0, n);
    ddp.begin_backward(model.g.data(), true);
    const double loss = model.forward_backward(std::span(x).subspan(size_t(rank * rows), size_t(rows)),
                                               std::span(y).subspan(size_t(rank * rows), size_t(rows)));
    EXPECT_TRUE(std::isfinite(loss)) << "step " << s << ": a freed weight was read";
    ddp.finish_backward();
    fsdp.done(0, n);
    zero.step(model.w.data(), model.g.data(), toy::toy_adamw(), toy::kLr);
    fsdp.release_all();
    const std::vector<float> frozen_now(model.w.begin() + frozen.offset, model.w.begin() + frozen.offset + frozen.count);
    EXPECT_EQ(frozen_now, frozen_before) << "step " << s << ": the frozen weight changed or was freed";
  }
  fsdp.gather_all();
  EXPECT_LE(max_abs_diff(model.w, toy::train_single_process()), 1e-6);
}

// A sharded save's moments are this rank's elements in updated_ranges() order (ascending), as its masters
// are and as docs/design.md's checkpoint table says: element by element the gathered moments at those
// ranges. (The moments used to be packed in bucket order, which is descending.)
TEST(Fsdp, ShardedMomentsFollowTheUpdatedRanges) {
  FsdpLm lm(1);
  train_fsdp(lm.dp, lm.mc);
  const State all = gathered_state(lm.dp, lm.model);
  const auto k = size_t(lm.dp.zero()->shard_elements());
  std::vector<float> params(k), m(k), v(k);
  lm.dp.save_shard(params.data(), m.data(), v.data());
  std::vector<float> want_params, want_m, want_v;
  for (const DdpRange& r : lm.dp.zero()->updated_ranges()) {
    const auto at = std::ptrdiff_t(r.offset), end = std::ptrdiff_t(r.offset + r.count);
    want_params.insert(want_params.end(), all.params.begin() + at, all.params.begin() + end);
    want_m.insert(want_m.end(), all.m.begin() + at, all.m.begin() + end);
    want_v.insert(want_v.end(), all.v.begin() + at, all.v.begin() + end);
  }
  EXPECT_EQ(params, want_params);
  EXPECT_EQ(m, want_m);
  EXPECT_EQ(v, want_v);
}

// A model that stepped alone holds its own AdamW moments; once FSDP's (or ZeRO-1's) sharded optimizer takes
// over they are released, so that a rank does not hold the optimizer state twice (ddp-bench measures every
// variant on one model after the plain step: its FSDP row once showed 15 GB of model moments at xl).
TEST(Fsdp, TheModelsOwnMomentsAreReleased) {
  const ModelConfig mc = lm_config();
  const int64_t local = kGlobal / comm().world_size();
  for (bool fsdp : {true, false}) {
    CpuModel part(mc, local, kSeq);
    part.init_parameters(11);
    const Batches b(mc.vocab, 0);
    part.zero_grad();
    part.forward(b.x.data(), b.y.data());
    part.backward();
    optimizer_step(part, clipping_adamw(), kLr);
    ASSERT_EQ(part.optimizer_steps(), 1);
    const int64_t before = memory_stats(Device::cpu).current_bytes, n = part.parameter_count();
    DdpOptions o = fsdp ? fsdp_options(1) : DdpOptions{};
    DdpModel dp(comm(), part, local * kSeq, o, /*zero1=*/true);
    ASSERT_NE(dp.zero(), nullptr);
    EXPECT_EQ(part.optimizer_steps(), 0) << (fsdp ? "fsdp" : "zero1");
    // The model's 2n floats of moments are gone; the sharded optimizer allocated its own share (plus DDP's
    // staging, none here: fp32 buckets of one run each).
    const int64_t now = memory_stats(Device::cpu).current_bytes;
    EXPECT_LE(now - before, dp.zero()->state_bytes() + dp.data_parallel().staging_bytes() - 2 * n * 4)
        << (fsdp ? "fsdp" : "zero1");
    train_fsdp(dp, mc);
    EXPECT_EQ(dp.optimizer_steps(), kSteps);
  }
}

// After gather_parameters() one rank alone may evaluate (no collective), and training then goes on.
TEST(Fsdp, GatheredParametersLetOneRankEvaluate) {
  FsdpLm lm(1);
  train_fsdp(lm.dp, lm.mc);
  lm.dp.gather_parameters();
  const Batches b(lm.mc.vocab, 100);
  double loss = 0;
  if (comm().is_root()) {
    for (int k = 0; k < 2; ++k) loss = lm.model.forward(b.x.data(), b.y.data());
  }
  comm().broadcast(std::span<double>(&loss, 1));
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_TRUE(std::isfinite(lm.forward_backward(100)));
  lm.dp.optimizer_step(clipping_adamw(), kLr);
}

// ---------------------------------------------------------------------------------------------------
// Sharded storage (ModelOptions::external_parameters): the model allocates no flat buffers; each rank keeps
// its shards, a pool of gathered parts and two part gradient buffers (or whole local gradients under
// grad_accum > 1), and the model reads and writes through its parameter_storage() table.

ModelOptions sharded_options(const char* recompute = "none", int64_t prefetch = 1, int64_t grad_accum = 1) {
  ModelOptions o;
  o.recompute = RecomputePlan::parse(recompute);
  o.external_parameters = true;
  o.fsdp_world = comm().world_size();
  o.fsdp_prefetch = prefetch;
  o.fsdp_grad_accum = grad_accum;
  o.optimizer_shards = comm().world_size();
  return o;
}

// The whole state of a sharded-storage run, gathered from the shards on every rank.
State gathered_sharded(DdpModel& dp, const LanguageModel& model) {
  const auto n = size_t(model.parameter_count());
  State st{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  dp.save_parameters(comm(), st.params.data());
  dp.zero()->gather_state(st.m.data(), st.v.data());
  return st;
}

// Steps [from, to) of the schedule train_fsdp runs, each rank on its rows.
void train_steps(DdpModel& dp, const ModelConfig& mc, int64_t from, int64_t to) {
  const int64_t local = kGlobal / comm().world_size();
  const auto at = size_t(comm().rank() * local * kSeq), count = size_t(local * kSeq);
  for (int64_t s = from; s < to; ++s) {
    const Batches b(mc.vocab, s);
    const double loss = dp.forward_backward(std::span(b.x).subspan(at, count), std::span(b.y).subspan(at, count));
    EXPECT_TRUE(std::isfinite(loss)) << "step " << s << ": a part was read before its gather";
    dp.optimizer_step(clipping_adamw(), kLr);
  }
}

// A model with sharded storage under FSDP, initialised by DdpModel (every rank the single process's values).
struct ShardedLm {
  ModelConfig mc = lm_config();
  std::unique_ptr<CpuModel> model;
  std::unique_ptr<DdpModel> dp;
  ShardedLm(const char* recompute, int prefetch, int64_t accum) {
    const int64_t micro = kGlobal / comm().world_size() / accum;
    model = std::make_unique<CpuModel>(mc, micro, kSeq, sharded_options(recompute, prefetch, accum));
    dp = std::make_unique<DdpModel>(comm(), *model, micro * kSeq, fsdp_options(prefetch, accum), false);
    dp->init_parameters(11);
  }
};

// The same arithmetic as full storage, bit for bit (the same reduce-scatters of the same values, the same
// AdamW over the same runs), so also within 1e-6 of one process and of DDP, and a world of one gives the
// single process's bits: every prefetch depth, gradient accumulation (whole local gradients) and each
// recomputation plan (a recomputing backward gathers each block again into the pool).
TEST(FsdpSharded, TrainsLikeFullStorageBitForBit) {
  const ModelConfig mc = lm_config();
  const State one = train_one_process(mc);
  struct Case {
    const char* recompute;
    int prefetch;
    int64_t accum;
  };
  const Case cases[] = {{"none", 0, 1},     {"none", 2, 1},      {"none", 1, 2},
                        {"blocks:2", 1, 1}, {"selective", 2, 1}, {"blocks", 1, 2}};
  for (const Case& c : cases) {
    const std::string what = std::string("recompute ") + c.recompute + ", prefetch " + std::to_string(c.prefetch) +
                             ", grad_accum " + std::to_string(c.accum);
    const int64_t micro = kGlobal / comm().world_size() / c.accum;
    ModelOptions full_options;
    full_options.recompute = RecomputePlan::parse(c.recompute);
    CpuModel full(mc, micro, kSeq, full_options);
    full.init_parameters(11);
    DdpModel full_dp(comm(), full, micro * kSeq, fsdp_options(c.prefetch, c.accum), false);
    train_fsdp(full_dp, mc);
    const State want = gathered_state(full_dp, full);

    ShardedLm lm(c.recompute, c.prefetch, c.accum);
    ASSERT_TRUE(lm.dp->sharded_storage());
    EXPECT_EQ(lm.model->parameters(), nullptr);
    train_fsdp(*lm.dp, mc);
    EXPECT_TRUE(lm.dp->fsdp()->released(0, lm.model->parameter_count())) << what;
    const State got = gathered_sharded(*lm.dp, *lm.model);
    EXPECT_EQ(got.params, want.params) << what;
    EXPECT_EQ(got.m, want.m) << what;
    EXPECT_EQ(got.v, want.v) << what;
    EXPECT_LE(relative_l2(got.params, one.params), 1e-6) << what;
    EXPECT_LE(relative_l2(got.v, one.v), 1e-6) << what;
    if (comm().world_size() == 1 && c.accum == 1) {
      EXPECT_EQ(got.params, one.params) << what;
      EXPECT_EQ(got.v, one.v) << what;
    }
  }
}

// What a rank allocates, by the tracked allocator: the model without its flat buffers exactly 2n floats
// below the full model; DdpModel then this rank's shards of the masters, gradients and both moments (each
// at most n/world + the gains + the tails) plus the pool (prefetch + 2 parts) and two part gradient buffers,
// all of it as DdpMemory reports — at two ranks about half what full storage allocates (2n floats in the
// model, 2(n/world) moments), at four about a quarter.
TEST(FsdpSharded, ARankAllocatesItsShardAndAPool) {
  const ModelConfig mc = lm_config();
  const int64_t world = comm().world_size(), local = kGlobal / world, f32 = 4;
  const std::vector<ParameterInfo> layout = parameter_layout(mc);
  int64_t largest_part = 0;
  for (const ParameterInfo& p : layout) {
    int64_t part = 0;
    for (const ParameterInfo& q : layout) part += fsdp_unit_name(q.name) == fsdp_unit_name(p.name) ? q.numel() : 0;
    largest_part = std::max(largest_part, part);
  }
  const int64_t n = mc.parameter_count();
  const int64_t slack = (2 * mc.layers + 1) * mc.d_model + (2 * mc.layers + 2) * world;
  for (int prefetch : {0, 2}) {
    const int64_t before_full = memory_stats(Device::cpu).current_bytes;
    int64_t full_bytes = 0;
    {
      CpuModel full(mc, local, kSeq);
      full_bytes = memory_stats(Device::cpu).current_bytes - before_full;
    }
    const int64_t before = memory_stats(Device::cpu).current_bytes;
    CpuModel model(mc, local, kSeq, sharded_options("none", prefetch));
    const int64_t model_bytes = memory_stats(Device::cpu).current_bytes - before;
    EXPECT_EQ(full_bytes - model_bytes, 2 * n * f32);
    DdpModel dp(comm(), model, local * kSeq, fsdp_options(prefetch), false);
    const int64_t dp_bytes = memory_stats(Device::cpu).current_bytes - before - model_bytes;
    const DdpMemory mem = dp.memory();
    const int64_t shard = dp.zero()->shard_elements();
    EXPECT_LE(shard, n / world + slack);
    EXPECT_EQ(mem.parameters, shard * f32);
    EXPECT_EQ(mem.gradients, shard * f32);
    EXPECT_EQ(mem.optimizer_state, 2 * shard * f32);
    const int64_t pool = world > 1 ? (prefetch + 2) * largest_part * f32 + 2 * largest_part * f32 : 0;
    EXPECT_EQ(dp.fsdp()->buffer_bytes(), pool) << "prefetch " << prefetch;
    EXPECT_EQ(mem.model_buffers, mem.parameters + mem.gradients + pool);
    EXPECT_EQ(dp_bytes, mem.model_buffers + mem.optimizer_state + dp.data_parallel().staging_bytes())
        << "prefetch " << prefetch;
    // Training allocates nothing more, and the parts whole at once stay within the pool.
    dp.init_parameters(11);
    train_steps(dp, mc, 0, 2);
    EXPECT_EQ(memory_stats(Device::cpu).current_bytes - before - model_bytes, dp_bytes);
    EXPECT_LE(mem.gathered, pool);
    EXPECT_LE(dp.memory().gathered, (prefetch + 2) * largest_part * (world - 1) / world * f32);
  }
}

// Sharded checkpoints resume bit-exactly; a gathered one loads into a sharded run at this world size
// bit-exactly, and into one process (the single process's parameters within 1e-6).
TEST(FsdpSharded, CheckpointsResumeBitExactly) {
  ShardedLm straight("none", 1, 1);
  train_steps(*straight.dp, straight.mc, 0, kSteps);
  const State want = gathered_sharded(*straight.dp, *straight.model);

  ShardedLm first("none", 1, 1);
  train_steps(*first.dp, first.mc, 0, 3);
  const auto k = size_t(first.dp->zero()->shard_elements());
  std::vector<float> params(k), m(k), v(k);
  first.dp->save_shard(params.data(), m.data(), v.data());
  const State gathered = gathered_sharded(*first.dp, *first.model);

  ShardedLm resumed("none", 1, 1);
  resumed.dp->load_shard(params.data(), m.data(), v.data(), 3);
  train_steps(*resumed.dp, resumed.mc, 3, kSteps);
  const State got = gathered_sharded(*resumed.dp, *resumed.model);
  EXPECT_EQ(got.params, want.params) << "sharded checkpoint";
  EXPECT_EQ(got.v, want.v) << "sharded checkpoint";

  ShardedLm reloaded("none", 1, 1);
  reloaded.dp->load_parameters(gathered.params.data());
  reloaded.dp->zero()->load_state(gathered.m.data(), gathered.v.data(), 3);
  train_steps(*reloaded.dp, reloaded.mc, 3, kSteps);
  const State again = gathered_sharded(*reloaded.dp, *reloaded.model);
  EXPECT_EQ(again.params, want.params) << "gathered checkpoint";
  EXPECT_EQ(again.m, want.m) << "gathered checkpoint";

  // One process continues the gathered state on the whole batch.
  CpuModel one(first.mc, kGlobal, kSeq);
  one.load_state(gathered.params, gathered.m, gathered.v, 3);
  for (int64_t s = 3; s < kSteps; ++s) {
    const Batches b(first.mc.vocab, s);
    one.zero_grad();
    one.forward(b.x.data(), b.y.data());
    one.backward();
    optimizer_step(one, clipping_adamw(), kLr);
  }
  const auto n = size_t(one.parameter_count());
  State single{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  one.save_state(single.params, single.m, single.v);
  EXPECT_LE(relative_l2(single.params, want.params), 1e-6);
}

// gather_parameters() holds every part whole (one buffer of the whole model, freed by the next step) so that
// rank 0 alone evaluates: the loss full storage gives, bit for bit; then training goes on within its bytes.
TEST(FsdpSharded, RankZeroEvaluatesAfterGatherParameters) {
  const ModelConfig mc = lm_config();
  const int64_t local = kGlobal / comm().world_size();
  CpuModel full(mc, local, kSeq);
  full.init_parameters(11);
  DdpModel full_dp(comm(), full, local * kSeq, fsdp_options(1), false);
  full_dp.broadcast_parameters();
  train_steps(full_dp, mc, 0, 2);
  full_dp.gather_parameters();
  ShardedLm lm("none", 1, 1);
  train_steps(*lm.dp, mc, 0, 2);
  const int64_t held = memory_stats(Device::cpu).current_bytes;
  lm.dp->gather_parameters();
  const Batches b(mc.vocab, 100);
  double loss = 0, want = 0;
  if (comm().is_root()) {
    for (int k = 0; k < 2; ++k) loss = lm.model->forward(b.x.data(), b.y.data());
    want = full.forward(b.x.data(), b.y.data());
  }
  comm().broadcast(std::span<double>(&loss, 1));
  comm().broadcast(std::span<double>(&want, 1));
  EXPECT_EQ(loss, want);
  EXPECT_TRUE(std::isfinite(loss));
  train_steps(*lm.dp, mc, kSteps, kSteps + 1);
  EXPECT_EQ(memory_stats(Device::cpu).current_bytes, held);
}

// The memory plan counts what a rank allocates under sharded storage: its share of the masters, working
// copy and gradients (as of the moments), plus the pool and the part gradients — xl at two ranks in bf16
// about 9.6 GiB below ZeRO-1's plan, whose parameters and gradients are whole; at one rank the same as the
// plain model's (nothing is sharded, nothing gathered).
TEST(FsdpSharded, ThePlanCountsThisRanksShare) {
  const ModelConfig mc = ModelConfig::named("xl", 512);
  const auto total = [&](int64_t world, bool sharded, int64_t accum) {
    ModelOptions o;
    o.optimizer_shards = world;
    o.external_parameters = sharded;
    o.fsdp_world = world;
    o.fsdp_grad_accum = accum;
    return plan_model_memory(mc, 4, 512, Device::cuda, DType::bf16, o).total_bytes();
  };
  const int64_t n = mc.parameter_count(), layer = 4 * 1600 * 1600 + 3 * 1600 * 6400 + 2 * 1600;
  EXPECT_EQ(total(1, true, 1), total(1, false, 1));
  const int64_t saved = total(2, false, 1) - total(2, true, 1);
  // Half of (fp32 master + bf16 copy + fp32 gradient) saved, less the pool (3 layers in bf16) and the two
  // part gradients (fp32), give or take the gains and tails every rank keeps.
  const int64_t want = n / 2 * (4 + 2 + 4) - 3 * layer * 2 - 2 * layer * 4;
  EXPECT_NEAR(double(saved), double(want), 1e6);
  // grad_accum > 1 keeps whole local gradients instead of two parts' (PyTorch's no_sync).
  EXPECT_EQ(total(2, true, 2) - total(2, true, 1), n * 4 - 2 * layer * 4);
}

// The poison mode still means something: a forward that skips the gathers (the hooks removed) reads the
// poisoned pool, and its loss is NaN (at one rank nothing is sharded, so it reads real weights).
TEST(FsdpSharded, AReadBeforeTheGatherIsNaN) {
  ShardedLm lm("none", 1, 1);
  train_steps(*lm.dp, lm.mc, 0, 2);
  lm.model->set_parameters_needed_hook({});
  lm.model->set_parameters_done_hook({});
  const Batches b(lm.mc.vocab, 0);
  const double loss = lm.model->forward(b.x.data(), b.y.data());
  EXPECT_EQ(std::isnan(loss), comm().world_size() > 1) << loss;
}

// ---------------------------------------------------------------------------------------------------
// FSDP's FP8 gather (--precision fp8, tensorwise; ModelOptions::fsdp_fp8_gather): under sharded storage the
// layers' linear weights arrive as the e4m3 bytes and scales their emulated FP8 GEMMs read.

ModelOptions fp8_options(bool sharded, const char* recompute = "none") {
  ModelOptions o = sharded_options(recompute);
  o.external_parameters = sharded;
  o.fp8 = true;
  return o;
}

AdamWConfig unclipped_adamw() {
  AdamWConfig c;
  c.max_grad_norm = 0;  // the sharded norm adds the ranks' partial sums in another order than one process
  return c;
}

// The tiny LM in fp8 under FSDP with sharded storage, each rank reading `rows` sequences a step.
struct Fp8ShardedLm {
  ModelConfig mc = lm_config();
  int64_t rows;
  std::unique_ptr<CpuModel> model;
  std::unique_ptr<DdpModel> dp;
  explicit Fp8ShardedLm(int64_t rows, ModelOptions o = fp8_options(true), DdpOptions d = fsdp_options(1))
      : rows(rows) {
    model = std::make_unique<CpuModel>(mc, rows, kSeq, o);
    dp = std::make_unique<DdpModel>(comm(), *model, rows * kSeq, d, false);
    dp->init_parameters(11);
  }
  // Step `step`'s batch: every rank the same first `rows` sequences (whole), or this rank's slice of it.
  double step(int64_t step, bool whole, const AdamWConfig& c) {
    const Batches b(mc.vocab, step);
    const auto at = whole ? size_t(0) : size_t(comm().rank() * rows * kSeq), count = size_t(rows * kSeq);
    const double loss = dp->forward_backward(std::span(b.x).subspan(at, count), std::span(b.y).subspan(at, count));
    dp->optimizer_step(c, kLr);
    return loss;
  }
};

// Every rank on the same whole batch, so that averaging the ranks' gradients changes nothing: the losses are
// the one-process fp8 run's (no FSDP) bit for bit, step after step — the gathered bytes decode to the values
// the one process rounds its whole weights to. At two ranks the average of two equal gradients is exact; at
// more, sums of three or more round, so after the first step (the gather alone) the losses are close only.
// With DdpOptions::fsdp_gather_alone a world of one gathers too (its one part of each bucket, over the
// one-rank communicator) and gives the same bits: the switch the GPU tests exercise the CUDA gather with.
TEST(FsdpFp8, LossesAreTheOneProcessRunsBitForBit) {
  const ModelConfig mc = lm_config();
  constexpr int64_t kRows = 2, kFp8Steps = 4;
  CpuModel one(mc, kRows, kSeq, fp8_options(false));
  one.init_parameters(11);
  std::vector<double> want;
  for (int64_t s = 0; s < kFp8Steps; ++s) {
    const Batches b(mc.vocab, s);
    one.zero_grad();
    want.push_back(one.forward(b.x.data(), b.y.data()));
    one.backward();
    optimizer_step(one, unclipped_adamw(), kLr);
  }
  for (bool alone : {false, true}) {
    SCOPED_TRACE(alone ? "fsdp_gather_alone" : "as FSDP runs");
    DdpOptions d = fsdp_options(1);
    d.fsdp_gather_alone = alone;
    Fp8ShardedLm lm(kRows, fp8_options(true), d);
    EXPECT_EQ(lm.dp->fsdp()->fp8_units(), comm().world_size() > 1 || alone ? mc.layers : 0);
    for (int64_t s = 0; s < kFp8Steps; ++s) {
      const double got = lm.step(s, true, unclipped_adamw());
      if (comm().world_size() <= 2 || s == 0) {
        EXPECT_EQ(std::bit_cast<uint64_t>(got), std::bit_cast<uint64_t>(want[size_t(s)]))
            << "step " << s << ": " << got << " against one process's " << want[size_t(s)];
      } else {
        EXPECT_NEAR(got, want[size_t(s)], 1e-6 * std::fabs(want[size_t(s)])) << "step " << s;
      }
    }
    // A forward and a backward gathered each layer once a step, as bytes: none foreign at one rank.
    const FsdpGatherTraffic t = lm.dp->fsdp()->gather_traffic();
    EXPECT_EQ(t.fp8_amax_bytes, kFp8Steps * 2 * mc.layers * 5 * (comm().world_size() - 1) * int64_t(sizeof(float)));
  }
}

// Each rank on its slice: FP8-gathered sharded storage against full storage, which gathers the fp32 weights
// in place and rounds them locally — the same losses and parameters bit for bit at every world size, with
// clipping and with a recomputing backward (which gathers each block's bytes again).
TEST(FsdpFp8, GatheredBytesTrainLikeRoundingTheGatheredWeights) {
  const ModelConfig mc = lm_config();
  const int64_t rows = kGlobal / comm().world_size();
  for (const char* recompute : {"none", "blocks"}) {
    CpuModel full(mc, rows, kSeq, fp8_options(false, recompute));
    full.init_parameters(11);
    DdpModel full_dp(comm(), full, rows * kSeq, fsdp_options(1), false);
    full_dp.broadcast_parameters();
    Fp8ShardedLm lm(rows, fp8_options(true, recompute));
    for (int64_t s = 0; s < kSteps; ++s) {
      const Batches b(mc.vocab, s);
      const auto at = size_t(comm().rank() * rows * kSeq), count = size_t(rows * kSeq);
      const double want =
          full_dp.forward_backward(std::span(b.x).subspan(at, count), std::span(b.y).subspan(at, count));
      full_dp.optimizer_step(clipping_adamw(), kLr);
      const double got = lm.step(s, false, clipping_adamw());
      EXPECT_EQ(std::bit_cast<uint64_t>(got), std::bit_cast<uint64_t>(want))
          << recompute << ", step " << s << ": " << got << " against " << want;
    }
    EXPECT_EQ(gathered_sharded(*lm.dp, *lm.model).params, gathered_state(full_dp, full).params) << recompute;
  }
}

// The layers' parts bring one byte an element: half what a bf16 gather of the same parts brings, a quarter
// of the fp32 gather the CPU model has without FP8 (the rowwise recipe, gathered as without fp8). Counted
// from the bucket plan: a forward and a backward gather each layer once, each rank's foreign parts of its
// buckets, plus a float per scale group (q‖k‖v, output_proj, w1, w2, w3) per other rank.
TEST(FsdpFp8, LayersBringHalfTheBytesOfABf16Gather) {
  const ModelConfig mc = lm_config();
  const int64_t world = comm().world_size(), rows = kGlobal / world;
  Fp8ShardedLm lm(rows);
  ModelOptions rowwise = fp8_options(true);
  rowwise.fp8_recipe = Fp8Recipe::rowwise;
  Fp8ShardedLm wide(rows, rowwise);
  EXPECT_EQ(wide.dp->fsdp()->fp8_units(), 0);
  lm.step(0, false, clipping_adamw());
  wide.step(0, false, clipping_adamw());
  const FsdpGatherTraffic fp8 = lm.dp->fsdp()->gather_traffic(), fp32 = wide.dp->fsdp()->gather_traffic();
  DdpParameters params;
  params.layout = parameter_layout(mc);
  params.device = Device::cpu;
  const std::vector<DdpBucket> buckets = fsdp_bucket_plan(params);
  int64_t foreign = 0;  // elements of the layers' buckets that other ranks own
  const ZeroBucketLayout layout = zero_bucket_layout(buckets, int(world), comm().rank());
  for (size_t b = 0; b < buckets.size(); ++b) {
    const std::string& name = params.layout[size_t(buckets[b].params.front())].name;
    if (name.starts_with("layers.")) foreign += layout.buckets[b].part * (world - 1);
  }
  EXPECT_EQ(fp8.fp8_bytes, 2 * foreign);
  EXPECT_EQ(2 * fp8.fp8_bytes, 2 * foreign * int64_t(dtype_size(DType::bf16)));
  EXPECT_EQ(fp8.fp8_amax_bytes, 2 * mc.layers * 5 * (world - 1) * int64_t(sizeof(float)));
  // The other parts (embedding, head) are gathered in fp32 by both; the layers at 4 bytes without FP8.
  EXPECT_EQ(fp32.fp8_bytes, 0);
  EXPECT_EQ(fp32.bytes - (fp8.bytes - fp8.fp8_bytes), 4 * fp8.fp8_bytes);
  EXPECT_EQ(fp8.fp8_bytes > 0, world > 1);
}

// A NaN in one element of w2 that one rank owns (not a tail every rank keeps) makes every rank's gathered
// w2 NaN — its amax NaN and every byte a NaN — while the other scale groups of the same bucket (w1, w3)
// stay finite; the loss is NaN on every rank, as the one-process fp8 model's is.
TEST(FsdpFp8, ANanInOneRanksPartReachesEveryRanksCopy) {
  const int64_t world = comm().world_size();
  if (world == 1) GTEST_SKIP() << "nothing is gathered at one rank";
  const ModelConfig mc = lm_config();
  Fp8ShardedLm lm(1);
  std::vector<float> host(size_t(lm.model->parameter_count()));
  lm.dp->save_parameters(comm(), host.data());
  DdpParameters params;
  params.layout = parameter_layout(mc);
  const std::vector<DdpBucket> buckets = fsdp_bucket_plan(params);
  const ZeroBucketLayout layout = zero_bucket_layout(buckets, int(world), comm().rank());
  const auto index_of = [&](std::string_view name) {
    const auto at = std::find_if(params.layout.begin(), params.layout.end(),
                                 [&](const ParameterInfo& p) { return p.name == name; });
    return size_t(at - params.layout.begin());
  };
  const ParameterInfo& w2 = params.layout[index_of("layers.1.ffn.w2.weight")];
  // w2's middle element, and the rank whose part of w2's bucket holds it (not the tail).
  const auto b = size_t(std::find_if(buckets.begin(), buckets.end(), [&](const DdpBucket& x) {
                   return x.ranges.front().offset <= w2.offset && w2.offset < x.ranges.front().offset + x.elements;
                 }) - buckets.begin());
  const ZeroBucketShard& z = layout.buckets[b];
  const int64_t at = w2.offset + w2.numel() / 2, owner = (at - z.offset) / z.part;
  ASSERT_LT(owner, world) << "w2's middle element is in the tail every rank keeps";
  SCOPED_TRACE("a NaN in rank " + std::to_string(owner) + "'s part");
  host[size_t(at)] = std::numeric_limits<float>::quiet_NaN();
  lm.dp->load_parameters(host.data());
  lm.dp->gather_parameters();
  for (const char* name : {"layers.1.ffn.w1.weight", "layers.1.ffn.w2.weight", "layers.1.ffn.w3.weight",
                           "layers.1.attn.q_proj.weight"}) {
    const ParameterInfo& p = params.layout[index_of(name)];
    const ParameterStorage& t = lm.model->parameter_storage()[index_of(name)];
    ASSERT_NE(t.fp8_scales, nullptr) << name;
    EXPECT_EQ(t.master, nullptr) << name;
    const bool nan = p.name == w2.name;
    EXPECT_EQ(std::isnan(t.fp8_scales[kFp8AmaxIndex]), nan) << name << " on rank " << comm().rank();
    const auto* bytes = static_cast<const uint8_t*>(t.weight);
    int64_t nans = 0;
    for (int64_t i = 0; i < p.numel(); ++i) nans += std::isnan(fp8_decode(bytes[i], Fp8Format::e4m3)) ? 1 : 0;
    EXPECT_EQ(nans, nan ? p.numel() : 0) << name << " on rank " << comm().rank();
  }
  CpuModel one(mc, 1, kSeq, fp8_options(false));
  one.load_state(host, std::vector<float>(host.size()), std::vector<float>(host.size()), 0);
  const Batches batch(mc.vocab, 0);
  EXPECT_TRUE(std::isnan(one.forward(batch.x.data(), batch.y.data())));
  const double loss = lm.dp->forward_backward(std::span(batch.x).first(size_t(kSeq)), std::span(batch.y).first(size_t(kSeq)));
  EXPECT_TRUE(std::isnan(loss)) << "rank " << comm().rank() << ": " << loss;
}

// The memory plan counts a layer's gathered part at a byte an element (the pool holds prefetch + 2 of the
// largest part: at xl the embedding's fp32 then, not a layer's), on the CPU and on CUDA (whose Fp8Linear
// multiplies the gathered bytes); rowwise gathers the layers as without fp8 (fp32 on the CPU, bf16 on CUDA).
TEST(FsdpFp8, ThePlanCountsLayersAtAByteOnEveryDevice) {
  const ModelConfig mc = ModelConfig::named("xl", 512);
  ModelOptions o = fp8_options(true);
  o.fsdp_world = 2;
  o.optimizer_shards = 2;
  const auto pool = [&](const ModelOptions& options) {
    const MemoryPlan plan = plan_model_memory(mc, 4, 512, Device::cpu, DType::f32, options);
    for (const MemoryPlan::Item& item : plan.items) {
      if (item.what.starts_with("FSDP gathered parts")) return item.bytes;
    }
    ADD_FAILURE() << "no pool in the plan:\n" << plan.format();
    return int64_t{0};
  };
  const int64_t layer = 4 * mc.d_model * mc.d_model + 3 * mc.d_model * mc.d_ff + 2 * mc.d_model;
  const int64_t embedding = mc.vocab * mc.d_model * 4;
  EXPECT_EQ(pool(o), 3 * std::max(layer, embedding));
  ModelOptions rowwise = o;
  rowwise.fp8_recipe = Fp8Recipe::rowwise;
  EXPECT_EQ(pool(rowwise), 3 * std::max(layer * 4, embedding));
  // The option: fp8, tensorwise, sharded storage — whatever the device.
  EXPECT_TRUE(o.fsdp_fp8_gather());
  EXPECT_FALSE(rowwise.fsdp_fp8_gather());
  ModelOptions full = o, bf16 = o;
  full.external_parameters = false;
  bf16.fp8 = false;
  EXPECT_FALSE(full.fsdp_fp8_gather());
  EXPECT_FALSE(bf16.fsdp_fp8_gather());
  const auto cuda_pool = [&](const ModelOptions& options) {
    const MemoryPlan plan = plan_model_memory(mc, 4, 512, Device::cuda, DType::bf16, options);
    for (const MemoryPlan::Item& item : plan.items) {
      if (item.what.starts_with("FSDP gathered parts")) {
        EXPECT_EQ(item.what.find("FP8 bytes") != std::string::npos, options.fsdp_fp8_gather()) << item.what;
        return item.bytes;
      }
    }
    ADD_FAILURE() << "no pool in the plan:\n" << plan.format();
    return int64_t{0};
  };
  // CUDA reads the embedding in fp32 (the masters), the head and (without the FP8 gather) the layers in bf16.
  EXPECT_EQ(cuda_pool(o), 3 * std::max(layer, embedding));
  EXPECT_EQ(cuda_pool(rowwise), 3 * std::max(layer * 2, embedding));
  EXPECT_LT(cuda_pool(o), cuda_pool(rowwise));
  ModelOptions alone = o;
  alone.fsdp_world = 1;
  alone.optimizer_shards = 1;
  plan_model_memory(mc, 4, 512, Device::cuda, DType::bf16, alone);
}

// ---------------------------------------------------------------------------------------------------
// bf16-pure under FSDP: the sharded bf16 AdamW. (The CPU model runs fp32 only, so the model-level
// bf16-pure FSDP tests are the GPU ones below; here the optimizer on the packed shards, which is the same
// code on both devices.)

// The tiny LM's layout on the CPU and FSDP's buckets over it, as DdpModel builds them.
struct PureShards {
  DdpParameters params;
  std::vector<DdpBucket> buckets;
  PureShards() {
    params.layout = parameter_layout(lm_config());
    params.device = Device::cpu;
    buckets = fsdp_bucket_plan(params);
  }
  std::unique_ptr<ZeroOptimizer> optimizer() const {
    auto z = std::make_unique<ZeroOptimizer>(comm(), params, buckets, false);
    z->use_packed_storage();
    z->use_bf16_state();
    return z;
  }
};

// This rank's packed elements (updated_ranges() order) of a whole array.
template <class T>
std::vector<T> packed_of(const ZeroOptimizer& z, const std::vector<T>& whole) {
  std::vector<T> out;
  for (const DdpRange& r : z.updated_ranges()) {
    out.insert(out.end(), whole.begin() + std::ptrdiff_t(r.offset), whole.begin() + std::ptrdiff_t(r.offset + r.count));
  }
  return out;
}

// Step s's averaged fp32 gradients (the same on every rank, as DataParallel leaves them), fresh random values.
std::vector<float> pure_gradients(int64_t n, int64_t step) {
  std::mt19937 rng(uint32_t(77 + step));
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> g(static_cast<size_t>(n));
  for (float& x : g) x = normal(rng);
  return g;
}

// The one-process bf16-pure step over the whole model: each fp32 gradient rounded to bf16 once, the norm
// of the rounded values, cpu::adamw_step_bf16 with the clip factor.
struct PureReference {
  std::vector<bf16_t> w, m, v;
  int64_t steps = 0;
  double step(const std::vector<float>& g32, const AdamWConfig& c) {
    std::vector<bf16_t> g(g32.size());
    for (size_t i = 0; i < g.size(); ++i) g[i] = bf16_t(g32[i]);
    const double norm = std::sqrt(cpu::sum_squares(g.data(), int64_t(g.size())));
    const float gs = c.max_grad_norm > 0 && norm > c.max_grad_norm ? cpu::clip_scale(norm, c.max_grad_norm) : 1.0f;
    cpu::adamw_step_bf16(w.data(), g.data(), m.data(), v.data(), int64_t(w.size()), kLr, c.beta1, c.beta2, c.eps,
                         c.weight_decay, ++steps, gs);
    return norm;
  }
};

std::vector<uint16_t> bits_of(const std::vector<bf16_t>& x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = x[i].bits;
  return out;
}

// Every rank's step_bf16 on its packed shard gives the one-process bf16-pure step's bits in the elements it
// updates, at every world size: AdamW is element-wise and each gradient is rounded once either way. Without
// clipping exactly; with clipping the norm adds the ranks' partial sums (at one rank: one sum in the
// one-process order, so the bits again), within 1e-12 of the one-process norm, and the parameters then
// within a bf16 step of it in the rare element whose clip factor rounds apart.
TEST(FsdpBf16Pure, ShardedAdamWIsTheOneProcessStep) {
  const PureShards shards;
  const int64_t n = shards.params.flat_size();
  for (double max_norm : {0.0, 0.05}) {
    AdamWConfig c;
    c.max_grad_norm = max_norm;
    PureReference one;
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (int64_t i = 0; i < n; ++i) one.w.push_back(bf16_t(normal(rng)));
    one.m.assign(size_t(n), bf16_t(0.0f));
    one.v.assign(size_t(n), bf16_t(0.0f));
    const auto z = shards.optimizer();
    EXPECT_EQ(z->state_bytes(), 2 * z->shard_elements() * 2) << "two bf16 moments";
    std::vector<bf16_t> w = packed_of(*z, one.w);
    bool clipped = false;
    for (int64_t s = 0; s < kSteps; ++s) {
      const std::vector<float> g = pure_gradients(n, s);
      const std::vector<float> mine = packed_of(*z, g);
      const double got = z->step_bf16(w.data(), mine.data(), c, kLr);
      const double want = one.step(g, c);
      clipped = clipped || (max_norm > 0 && want > max_norm);
      if (comm().world_size() == 1) EXPECT_EQ(got, want) << "step " << s;
      else EXPECT_NEAR(got, want, 1e-12 * want) << "step " << s;
    }
    EXPECT_EQ(clipped, max_norm > 0) << "the clipping case must clip";
    const std::vector<bf16_t> want = packed_of(*z, one.w);
    if (max_norm == 0 || comm().world_size() == 1) {
      EXPECT_EQ(bits_of(w), bits_of(want)) << "max_grad_norm " << max_norm;
    } else {
      size_t apart = 0;
      for (size_t i = 0; i < w.size(); ++i) apart += w[i].bits != want[i].bits;
      EXPECT_LE(double(apart), 1e-3 * double(w.size()));
    }
    // The moments as a sharded checkpoint keeps them (widened exactly) and as gathered.
    std::vector<float> m(size_t(z->shard_elements())), v(m.size());
    z->save_shard(m.data(), v.data());
    const std::vector<bf16_t> want_v = packed_of(*z, one.v);
    if (max_norm == 0) {
      for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(bf16_t(v[i]).bits, want_v[i].bits) << "element " << i;
      std::vector<float> gm(static_cast<size_t>(n)), gv(static_cast<size_t>(n));
      z->gather_state(gm.data(), gv.data());
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(gm[size_t(i)], float(one.m[size_t(i)])) << "element " << i;
    }
  }
}

// A sharded checkpoint of the bf16 moments (widened to fp32, as a checkpoint holds them) resumes bit-exactly:
// 3 steps, save, a fresh optimizer loads the shard, 2 more steps == 5 straight.
TEST(FsdpBf16Pure, ShardedMomentsResumeBitExactly) {
  const PureShards shards;
  const int64_t n = shards.params.flat_size();
  AdamWConfig c;
  c.max_grad_norm = 0.05;
  std::vector<bf16_t> start(static_cast<size_t>(n));
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (bf16_t& x : start) x = bf16_t(normal(rng));
  const auto straight = shards.optimizer();
  std::vector<bf16_t> w = packed_of(*straight, start);
  for (int64_t s = 0; s < kSteps; ++s) straight->step_bf16(w.data(), packed_of(*straight, pure_gradients(n, s)).data(), c, kLr);

  const auto first = shards.optimizer();
  std::vector<bf16_t> w2 = packed_of(*first, start);
  for (int64_t s = 0; s < 3; ++s) first->step_bf16(w2.data(), packed_of(*first, pure_gradients(n, s)).data(), c, kLr);
  std::vector<float> m(size_t(first->shard_elements())), v(m.size());
  first->save_shard(m.data(), v.data());
  const auto resumed = shards.optimizer();
  resumed->load_shard(m.data(), v.data(), first->steps());
  for (int64_t s = 3; s < kSteps; ++s) resumed->step_bf16(w2.data(), packed_of(*resumed, pure_gradients(n, s)).data(), c, kLr);
  EXPECT_EQ(bits_of(w2), bits_of(w));
  std::vector<float> m1(m.size()), v1(m.size()), m2(m.size()), v2(m.size());
  straight->save_shard(m1.data(), v1.data());
  resumed->save_shard(m2.data(), v2.data());
  EXPECT_EQ(m2, m1);
  EXPECT_EQ(v2, v1);
}

// What a rank of bf16-pure FSDP holds by the plan: 2-byte parameter shards, fp32 gradients reduced into and
// their bf16 rounding, 2-byte moments, every part gathered in bf16 (the embedding too), no fp32 master and
// no fp32 accumulator of the model's own; xl at two ranks about n/2 · 6 bytes below mixed bf16 FSDP.
TEST(FsdpBf16Pure, ThePlanCountsTwoByteShards) {
  const ModelConfig mc = ModelConfig::named("xl", 512);
  const auto plan = [&](int64_t world, bool pure) {
    ModelOptions o;
    o.bf16_pure = pure;
    o.optimizer_shards = world;
    o.external_parameters = true;
    o.fsdp_world = world;
    return plan_model_memory(mc, 4, 512, Device::cuda, DType::bf16, o);
  };
  const int64_t n = mc.parameter_count();
  for (int64_t world : {int64_t{1}, int64_t{2}, int64_t{4}}) {
    const MemoryPlan p = plan(world, true);
    int64_t params = -1, grads = -1, moments = -1;
    for (const MemoryPlan::Item& it : p.items) {
      EXPECT_EQ(it.what.find("fp32 master"), std::string::npos) << it.what;
      EXPECT_EQ(it.what.find("accumulator"), std::string::npos) << it.what;
      if (it.what.starts_with("parameters (bf16")) params = it.bytes;
      if (it.what.starts_with("gradients (fp32 reduced + bf16")) grads = it.bytes;
      if (it.what.starts_with("AdamW moments (bf16")) moments = it.bytes;
    }
    ASSERT_GT(params, 0) << p.format();
    EXPECT_EQ(grads, 3 * params) << "fp32 + bf16 per element";
    EXPECT_NEAR(double(params), double(n) / double(world) * 2, 1e6) << "world " << world;
    EXPECT_NEAR(double(moments), double(n) / double(world) * 4, 1e6) << "world " << world;
  }
  // Against mixed bf16 FSDP at two ranks: (4 + 2 + 4 + 8) - (2 + 6 + 4) = 6 bytes per shard element saved,
  // and the pool's 3 buffers sized by the largest part in the type it is gathered in: mixed gathers the
  // embedding in fp32 (10000 x 1600 x 4 bytes, larger than a layer in bf16), bf16-pure in bf16 (then a
  // layer is the largest).
  const int64_t saved = plan(2, false).total_bytes() - plan(2, true).total_bytes();
  const int64_t embedding = 10000 * 1600, layer = 4 * 1600 * 1600 + 3 * 1600 * 6400 + 2 * 1600;
  const int64_t pool = 3 * (std::max(embedding * 4, layer * 2) - std::max(embedding * 2, layer * 2));
  EXPECT_NEAR(double(saved), double(n) / 2 * 6 + double(pool), 1e6);
}

// bf16-pure under DDP or ZeRO-1 is refused naming FSDP as the way (before anything is allocated).
// A train() run of the test LM on synthetic data, one sequence per rank.
TrainConfig synthetic_lm_run(int64_t steps) {
  TrainConfig cfg;
  cfg.model = lm_config();
  cfg.seq = kSeq;
  cfg.batch = 1;
  cfg.steps = steps;
  cfg.train_data = "synthetic";
  cfg.comm = &comm();
  return cfg;
}

TEST(FsdpBf16Pure, DdpAndZeroOneRefuseNamingFsdp) {
  TrainConfig cfg = synthetic_lm_run(1);
  cfg.precision = DType::bf16;
  cfg.options.bf16_pure = true;
  for (bool zero1 : {false, true}) {
    cfg.zero1 = zero1;
    try {
      train(cfg);
      ADD_FAILURE() << "bf16-pure under " << (zero1 ? "ZeRO-1" : "DDP") << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("use --ddp fsdp"), std::string::npos) << e.what();
    }
  }
}

// bf16 moments beside fp32 masters are the model's own AdamW's: ZeRO-1 and FSDP, whose ZeroOptimizer keeps
// fp32 moment shards, refuse them by name; plain DDP (each rank steps its own model) trains with them.
TEST(DdpBf16Moments, ZeroOneAndFsdpRefuseAndDdpTrains) {
  TrainConfig cfg = synthetic_lm_run(2);
  cfg.options.optimizer_state = OptimizerState::bf16;
  for (const bool fsdp : {false, true}) {
    TrainConfig c = cfg;
    c.zero1 = !fsdp;
    if (fsdp) c.ddp.variant = DdpVariant::fsdp;
    try {
      train(c);
      ADD_FAILURE() << "bf16 moments under " << (fsdp ? "FSDP" : "ZeRO-1") << " were accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--optimizer-state bf16 is the model's own AdamW's; ZeRO-1 and FSDP "
                                           "shard fp32 moments"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(train(cfg).last_step, 2);
}

// A job whose rank FLASHLM_TEST_DIE_ON_RANK exits in the middle of a step (after its backward, before the
// update) must end: the others wait in a collective until mpirun kills them. Run by dying_rank.cmake.
TEST(FsdpFailure, RankDiesMidStep) {
  const char* env = std::getenv("FLASHLM_TEST_DIE_ON_RANK");
  if (env == nullptr) GTEST_SKIP() << "run by dying_rank.cmake with FLASHLM_TEST_DIE_ON_RANK set";
  FsdpLm lm(1);
  lm.dp.broadcast_parameters();
  lm.forward_backward(0);
  if (comm().rank() == std::atoi(env)) std::_Exit(3);
  lm.dp.optimizer_step(clipping_adamw(), kLr);
  lm.forward_backward(1);
  ADD_FAILURE() << "rank " << comm().rank() << " finished a step its peer died in";
}

TEST(FsdpErrors, PrefetchAndPrecisionAreChecked) {
  const ModelConfig mc = lm_config();
  CpuModel part(mc, 1, kSeq);
  DdpOptions o = fsdp_options(3);
  try {
    DdpModel dp(comm(), part, kSeq, o, false);
    ADD_FAILURE() << "prefetch 3 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fsdp_prefetch = 3, expected 0, 1 or 2"), std::string::npos) << e.what();
  }
  DdpOptions bucketed;
  bucketed.fsdp_gather_alone = true;
  try {
    DdpModel dp(comm(), part, kSeq, bucketed, false);
    ADD_FAILURE() << "fsdp_gather_alone was accepted for bucketed DDP";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fsdp_gather_alone gathers FSDP's parts at a world of one; it needs --ddp "
                                         "fsdp, not bucketed"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(parse_ddp_variant("fsdp"), DdpVariant::fsdp);
  try {
    parse_ddp_variant("zero3");
    ADD_FAILURE() << "zero3 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bucketed or fsdp"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------------
// CUDA (NCCL): skipped without NCCL or without a GPU per local rank.

#ifdef FLASHLM_WITH_CUDA
// kSteps of DDP (a) and FSDP (b) side by side on this rank's slices; FSDP's losses must be finite (its freed
// weights are poisoned).
void train_side_by_side(DdpModel& a, DdpModel& b, const ModelConfig& mc, const AdamWConfig& adamw) {
  const int64_t local = kGlobal / comm().world_size();
  const auto at = size_t(comm().rank() * local * kSeq), count = size_t(local * kSeq);
  a.broadcast_parameters();
  b.broadcast_parameters();
  for (int64_t s = 0; s < kSteps; ++s) {
    const Batches batch(mc.vocab, s);
    const auto x = std::span(batch.x).subspan(at, count), y = std::span(batch.y).subspan(at, count);
    a.forward_backward(x, y);
    EXPECT_TRUE(std::isfinite(b.forward_backward(x, y))) << "step " << s << ": a freed weight was read";
    a.optimizer_step(adamw, kLr);
    b.optimizer_step(adamw, kLr);
  }
}

ModelConfig gpu_config() {
  ModelConfig mc = lm_config();
  mc.d_model = 64;  // head_dim 16: the smallest the tensor-core attention takes
  mc.d_ff = 128;
  return mc;
}

// FSDP on CudaModel against bucketed DDP on the same GPUs, with the gathers and reduce-scatters ordered by
// CUDA events only. fp32 (with and without accumulation): within 1e-6 relative L2 (the shards' norm adds
// partial sums in another order). bf16 without clipping: FSDP's AdamW writes each rank's parts of the
// working copy as DDP's recast does and gathers them, so at one or two ranks (where a reduce-scatter adds
// what an all-reduce adds) the working weights are DDP's bits; the masters gathered afterwards match.
TEST(FsdpGpu, TrainsLikeBucketedDdp) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  comm().setup_cuda();
  const ModelConfig mc = gpu_config();
  const int64_t local = kGlobal / comm().world_size();
  DdpOptions ddp;
  ddp.variant = DdpVariant::bucketed;
  ddp.bucket_mb = 0.02;
  for (int64_t accum : {int64_t{1}, int64_t{2}}) {
    CudaModel plain(mc, local / accum, kSeq, DType::f32), sharded(mc, local / accum, kSeq, DType::f32);
    plain.init_parameters(11);
    sharded.init_parameters(11);
    ddp.grad_accum = accum;
    DdpModel a(comm(), plain, local / accum * kSeq, ddp, false);
    DdpModel b(comm(), sharded, local / accum * kSeq, fsdp_options(1, accum), false);
    train_side_by_side(a, b, mc, AdamWConfig{});
    b.gather_master_parameters();
    EXPECT_LE(relative_l2(host_parameters(sharded), host_parameters(plain)), 1e-6) << "fp32 grad_accum " << accum;
  }
  ddp.grad_accum = 1;
  CudaModel plain(mc, local, kSeq, DType::bf16), sharded(mc, local, kSeq, DType::bf16);
  plain.init_parameters(11);
  sharded.init_parameters(11);
  DdpModel a(comm(), plain, local * kSeq, ddp, false);
  DdpModel b(comm(), sharded, local * kSeq, fsdp_options(2), false);
  AdamWConfig no_clip;
  no_clip.max_grad_norm = 0;
  train_side_by_side(a, b, mc, no_clip);
  b.gather_parameters();  // the working copy whole, as for an evaluation
  b.await_parameters();
  const std::vector<uint16_t> wa = working_bits(plain), wb = working_bits(sharded);
  size_t differ = 0;
  for (size_t i = 0; i < wa.size(); ++i) differ += wa[i] != wb[i];
  if (comm().world_size() <= 2) EXPECT_EQ(differ, 0u) << "of " << wa.size() << " working weights";
  else EXPECT_LE(double(differ), 1e-2 * double(wa.size()));
  b.gather_master_parameters();
  EXPECT_LE(relative_l2(host_parameters(sharded), host_parameters(plain)), 1e-5);
}

// A world of one on one GPU: FSDP gathers nothing and gives the plain model's training (bf16, no clipping).
TEST(FsdpGpu, WorldOfOneTrainsLikeTheModelAlone) {
  if (!gpus_for_every_rank() || comm().world_size() != 1) GTEST_SKIP() << "one GPU, one rank";
  comm().setup_cuda();
  const ModelConfig mc = gpu_config();
  CudaModel alone(mc, kGlobal, kSeq, DType::bf16), sharded(mc, kGlobal, kSeq, DType::bf16);
  alone.init_parameters(11);
  sharded.init_parameters(11);
  DdpModel b(comm(), sharded, kGlobal * kSeq, fsdp_options(1), false);
  EXPECT_EQ(b.fsdp()->units(), 0);
  AdamWConfig no_clip;
  no_clip.max_grad_norm = 0;
  b.broadcast_parameters();
  for (int64_t s = 0; s < kSteps; ++s) {
    const Batches batch(mc.vocab, s);
    alone.zero_grad();
    const double want = alone.forward(batch.x.data(), batch.y.data());
    alone.backward();
    optimizer_step(alone, no_clip, kLr);
    EXPECT_EQ(b.forward_backward(batch.x, batch.y), want) << "step " << s;
    b.optimizer_step(no_clip, kLr);
  }
  EXPECT_EQ(working_bits(sharded), working_bits(alone));
  EXPECT_EQ(host_parameters(sharded), host_parameters(alone));
}

// Sharded storage on CudaModel (fp32 and bf16, with and without accumulation) against full storage on the
// same slices: at one rank nothing is sharded and the packed shard is the flat layout, so the bits are full
// storage's; at more ranks the gathered parts sit at other addresses (the GEMMs may choose other
// algorithms), so within 1e-6 (fp32) and 1e-5 (bf16) relative L2; and a rank allocates less.
TEST(FsdpGpu, ShardedStorageTrainsLikeFullStorage) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  comm().setup_cuda();
  const ModelConfig mc = gpu_config();
  const int64_t local = kGlobal / comm().world_size();
  AdamWConfig no_clip;
  no_clip.max_grad_norm = 0;
  for (DType dt : {DType::f32, DType::bf16}) {
    for (int64_t accum : {int64_t{1}, int64_t{2}}) {
      const std::string what = std::string(dtype_name(dt)) + ", grad_accum " + std::to_string(accum);
      const int64_t micro = local / accum;
      CudaModel full(mc, micro, kSeq, dt);
      full.init_parameters(11);
      CudaModel sharded(mc, micro, kSeq, dt, sharded_options("none", 1, accum));
      DdpModel a(comm(), full, micro * kSeq, fsdp_options(1, accum), false);
      DdpModel b(comm(), sharded, micro * kSeq, fsdp_options(1, accum), false);
      ASSERT_TRUE(b.sharded_storage());
      b.init_parameters(11);
      train_side_by_side(a, b, mc, no_clip);
      a.gather_master_parameters();
      const std::vector<float> want = host_parameters(full);
      std::vector<float> got(want.size());
      b.save_parameters(comm(), got.data());
      if (comm().world_size() == 1) {
        EXPECT_EQ(got, want) << what;
      } else {
        EXPECT_LE(relative_l2(got, want), dt == DType::f32 ? 1e-6 : 1e-5) << what;
        EXPECT_LT(b.memory().model_buffers, a.memory().model_buffers) << what;
      }
    }
  }
}

// bf16-pure under FSDP's sharded storage (bf16 parameter shards, no fp32 masters, fp32 reduce-scatter
// rounded once, bf16 AdamW on the shard) against the one-process bf16-pure model on the whole batch.
ModelOptions pure_options(bool sharded) {
  ModelOptions o = sharded ? sharded_options() : ModelOptions{};
  o.bf16_pure = true;
  return o;
}

// The whole state of a bf16-pure FSDP run (widened to fp32), gathered on every rank.
State gathered_pure(DdpModel& dp, const LanguageModel& model) {
  const auto n = size_t(model.parameter_count());
  State st{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  dp.save_parameters(comm(), st.params.data());
  dp.zero()->gather_state(st.m.data(), st.v.data());
  return st;
}

State model_state(const CudaModel& model) {
  const auto n = size_t(model.parameter_count());
  State st{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  model.save_state(st.params, st.m, st.v);
  return st;
}

// kSteps of the one-process bf16-pure model on the whole batch (no clipping: the sharded norm adds the ranks'
// partial sums in another order), and FSDP's on this rank's rows. At one rank every loss, parameter and
// moment is the one-process model's bit for bit (nothing is sharded: the model writes its fp32 gradients
// straight into the shard, rounded to bf16 once as the one-process backward rounds its accumulator, and the
// bf16 AdamW is element-wise). At more ranks the ranks' fp32 gradients are summed in fp32 and rounded once,
// and the cut batch reorders the GEMMs' sums: within 2e-2 relative L2 (a bf16 ulp is 2^-8 of a value).
TEST(FsdpGpu, Bf16PureTrainsLikeTheOneProcessModel) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  comm().setup_cuda();
  const ModelConfig mc = gpu_config();
  const int64_t local = kGlobal / comm().world_size();
  const auto at = size_t(comm().rank() * local * kSeq), count = size_t(local * kSeq);
  AdamWConfig no_clip;
  no_clip.max_grad_norm = 0;
  CudaModel alone(mc, kGlobal, kSeq, DType::bf16, pure_options(false));
  alone.init_parameters(11);
  CudaModel sharded(mc, local, kSeq, DType::bf16, pure_options(true));
  DdpModel dp(comm(), sharded, local * kSeq, fsdp_options(1), false);
  ASSERT_TRUE(dp.sharded_storage());
  EXPECT_EQ(dp.fsdp()->shard_masters(), nullptr) << "bf16-pure keeps no fp32 masters";
  EXPECT_EQ(dp.zero()->state_bytes(), 2 * dp.zero()->shard_elements() * 2) << "bf16 moments";
  dp.init_parameters(11);
  for (int64_t s = 0; s < kSteps; ++s) {
    const Batches b(mc.vocab, s);
    alone.zero_grad();
    const double want = alone.forward(b.x.data(), b.y.data());
    alone.backward();
    optimizer_step(alone, no_clip, kLr);
    double got = dp.forward_backward(std::span(b.x).subspan(at, count), std::span(b.y).subspan(at, count));
    comm().all_reduce(std::span<double>(&got, 1), ReduceOp::avg);
    dp.optimizer_step(no_clip, kLr);
    ASSERT_TRUE(std::isfinite(got)) << "step " << s << ": a freed weight was read";
    if (comm().world_size() == 1) EXPECT_EQ(got, want) << "step " << s;
    else EXPECT_NEAR(got, want, 1e-2 * std::abs(want)) << "step " << s;
  }
  const State got = gathered_pure(dp, sharded), want = model_state(alone);
  if (comm().world_size() == 1) {
    EXPECT_EQ(got.params, want.params);
    EXPECT_EQ(got.m, want.m);
    EXPECT_EQ(got.v, want.v);
  } else {
    EXPECT_LE(relative_l2(got.params, want.params), 2e-2);
    EXPECT_LE(relative_l2(got.m, want.m), 2e-2);
  }
}

// bf16-pure FSDP checkpoints: a sharded one resumes bit-exactly (3 steps, save, fresh model and load, 2 more
// == 5 straight, with clipping); the gathered one loads into the one-process bf16-pure model exactly (bf16
// values widened to fp32 and rounded back are the same bf16) and trains on.
TEST(FsdpGpu, Bf16PureCheckpointsResumeBitExactly) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  comm().setup_cuda();
  const ModelConfig mc = gpu_config();
  const int64_t local = kGlobal / comm().world_size();
  const auto run = [&](DdpModel& dp, int64_t from, int64_t to) {
    const auto at = size_t(comm().rank() * local * kSeq), count = size_t(local * kSeq);
    for (int64_t s = from; s < to; ++s) {
      const Batches b(mc.vocab, s);
      EXPECT_TRUE(std::isfinite(dp.forward_backward(std::span(b.x).subspan(at, count),
                                                    std::span(b.y).subspan(at, count))));
      dp.optimizer_step(clipping_adamw(), kLr);
    }
  };
  CudaModel m1(mc, local, kSeq, DType::bf16, pure_options(true));
  DdpModel straight(comm(), m1, local * kSeq, fsdp_options(1), false);
  straight.init_parameters(11);
  run(straight, 0, kSteps);
  const State want = gathered_pure(straight, m1);

  std::vector<float> params, m, v;
  State gathered;
  {
    CudaModel m2(mc, local, kSeq, DType::bf16, pure_options(true));
    DdpModel first(comm(), m2, local * kSeq, fsdp_options(1), false);
    first.init_parameters(11);
    run(first, 0, 3);
    const auto k = size_t(first.zero()->shard_elements());
    params.resize(k), m.resize(k), v.resize(k);
    first.save_shard(params.data(), m.data(), v.data());
    gathered = gathered_pure(first, m2);
  }
  CudaModel m3(mc, local, kSeq, DType::bf16, pure_options(true));
  DdpModel resumed(comm(), m3, local * kSeq, fsdp_options(1), false);
  resumed.load_shard(params.data(), m.data(), v.data(), 3);
  run(resumed, 3, kSteps);
  const State got = gathered_pure(resumed, m3);
  EXPECT_EQ(got.params, want.params) << "sharded checkpoint";
  EXPECT_EQ(got.m, want.m) << "sharded checkpoint";
  EXPECT_EQ(got.v, want.v) << "sharded checkpoint";

  CudaModel one(mc, kGlobal, kSeq, DType::bf16, pure_options(false));
  one.load_state(gathered.params, gathered.m, gathered.v, 3);
  const State loaded = model_state(one);
  EXPECT_EQ(loaded.params, gathered.params) << "gathered checkpoint in one process";
  EXPECT_EQ(loaded.m, gathered.m);
  EXPECT_EQ(loaded.v, gathered.v);
  const Batches b(mc.vocab, 3);
  one.zero_grad();
  EXPECT_TRUE(std::isfinite(one.forward(b.x.data(), b.y.data())));
  one.backward();
  optimizer_step(one, clipping_adamw(), kLr);
  EXPECT_EQ(one.optimizer_steps(), 4);
}

// FSDP's FP8 gather on CudaModel (--precision fp8, tensorwise, sharded storage), at any world with one GPU per
// rank — at a world of one through DdpOptions::fsdp_gather_alone, so that NCCL's one-rank communicator carries
// the gathers a larger world runs. Every rank trains on the same whole batch, as the one-process plain FP8
// model does (CudaModel without FSDP, whose Fp8Linear casts its bf16 working copy).
//   1. After gather_parameters(), before any step (both models' bf16 weights are init_parameters(11)'s,
//      the same bits), each layer's scale groups (q‖k‖v, output_proj, w1, w2, w3): the gathered e4m3 bytes,
//      amax and dequantisation scale are those of gpu::fp8_quantize over the plain model's whole bf16
//      weight, bit for bit, and the bytes transposed (gpu::fp8_transpose, the backward's wᵀ) its transposed
//      cast; the group's weights sit one byte an element apart, with `master` null.
//   2. kSteps steps, no clipping: the losses and the parameters (fp32 masters) against the plain FP8 step's.
//      Each product multiplies the same FP8 operands as the plain step's (1.), but from the pool rather than
//      Fp8Linear's 256-byte aligned cache, and the GEMMs' plans are keyed by the operands' alignment, so
//      cuBLASLt may choose another algorithm (another fp32 summation order) — which e4m3's 3-bit mantissa then
//      amplifies wherever a rounding flips a code. So: every loss within 1e-4 relative and the parameters
//      within 1e-3 relative L2 (a wrong scale, a missing transpose or another group's scale is off by far
//      more); whether they came out bit-identical is printed. (At more than two ranks the mean of equal
//      gradients rounds too.) The FSDP step runs eagerly (its hooks keep it out of a CUDA graph), the plain one
//      eagerly as well.
//   3. The traffic counters: the layers' foreign parts at one byte an element (FsdpGatherTraffic::fp8_bytes,
//      none at one rank) and a float per scale group per other rank, for the one gather_parameters() and a
//      forward and a backward gather per step.
//   4. Rowwise gathers the layers in bf16 (no FP8 parts) and trains.
TEST(FsdpGpu, Fp8GatherTrainsLikeThePlainFp8Step) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  comm().setup_cuda();
  const ModelConfig mc = gpu_config();
  constexpr int64_t kRows = 2;
  const int64_t world = comm().world_size();
  ModelOptions plain_options;
  plain_options.fp8 = true;
  ModelOptions fsdp_fp8 = sharded_options();
  fsdp_fp8.fp8 = true;
  ASSERT_TRUE(fsdp_fp8.fsdp_fp8_gather());
  DdpOptions d = fsdp_options(1);
  d.fsdp_gather_alone = true;
  CudaModel plain(mc, kRows, kSeq, DType::bf16, plain_options);
  plain.init_parameters(11);
  CudaModel sharded(mc, kRows, kSeq, DType::bf16, fsdp_fp8);
  DdpModel dp(comm(), sharded, kRows * kSeq, d, false);
  dp.init_parameters(11);
  ASSERT_EQ(dp.fsdp()->fp8_units(), mc.layers);

  // 1. The gathered bytes against the local cast of the whole bf16 weight.
  dp.gather_parameters();
  dp.await_parameters();
  cuda_stream_synchronize(sharded.stream());
  cuda_stream_synchronize(plain.stream());
  const std::vector<ParameterInfo>& layout = sharded.layout();
  const std::span<ParameterStorage> table = sharded.parameter_storage();
  const auto index_at = [&](int64_t offset) {
    return size_t(std::find_if(layout.begin(), layout.end(), [&](const ParameterInfo& p) { return p.offset == offset; }) -
                  layout.begin());
  };
  const std::vector<Fp8ScaleGroup> groups = fp8_scale_groups(layout);
  ASSERT_EQ(int64_t(groups.size()), 5 * mc.layers);
  int64_t largest = 0;
  for (const Fp8ScaleGroup& g : groups) largest = std::max(largest, g.count);
  Buffer q = Buffer::allocate(size_t(largest), Device::cuda, "test: local cast");
  Buffer qt = Buffer::allocate(size_t(largest), Device::cuda, "test: local transposed cast");
  Buffer gt = Buffer::allocate(size_t(largest), Device::cuda, "test: gathered bytes transposed");
  Buffer slot = Buffer::allocate(kFp8ScaleSlotFloats * sizeof(float), Device::cuda, "test: local scales");
  for (const Fp8ScaleGroup& g : groups) {
    const size_t i = index_at(g.offset);
    ASSERT_LT(i, layout.size());
    const std::string& name = layout[i].name;
    const ParameterStorage& t = table[i];
    ASSERT_NE(t.fp8_scales, nullptr) << name;
    EXPECT_EQ(t.master, nullptr) << name;
    for (size_t j = i; j < layout.size() && layout[j].offset < g.offset + g.count; ++j) {
      EXPECT_EQ(static_cast<const char*>(table[j].weight) - static_cast<const char*>(t.weight),
                layout[j].offset - g.offset)
          << layout[j].name << ": one byte an element after " << name;
      EXPECT_EQ(table[j].fp8_scales, t.fp8_scales) << layout[j].name << " shares " << name << "'s scale";
    }
    const int64_t cols = layout[i].shape.back(), rows = g.count / cols;
    const auto* w = static_cast<const bf16_t*>(plain.working_parameters()) + g.offset;
    gpu::fp8_quantize(w, rows, cols, Fp8Format::e4m3, static_cast<uint8_t*>(q.data()), static_cast<uint8_t*>(qt.data()),
                      static_cast<float*>(slot.data()), nullptr);
    gpu::fp8_transpose(static_cast<const uint8_t*>(t.weight), rows, cols, static_cast<uint8_t*>(gt.data()), nullptr);
    cuda_stream_synchronize(nullptr);
    std::vector<uint8_t> got(size_t(g.count)), want(got.size()), got_t(got.size()), want_t(got.size());
    cuda_copy(got.data(), t.weight, got.size());
    cuda_copy(want.data(), q.data(), want.size());
    cuda_copy(got_t.data(), gt.data(), got_t.size());
    cuda_copy(want_t.data(), qt.data(), want_t.size());
    std::array<float, kFp8ScaleSlotFloats> got_scales{}, want_scales{};
    cuda_copy(got_scales.data(), t.fp8_scales, sizeof(got_scales));
    cuda_copy(want_scales.data(), slot.data(), sizeof(want_scales));
    EXPECT_EQ(got, want) << name << ": the gathered bytes";
    EXPECT_EQ(got_t, want_t) << name << ": the gathered bytes transposed";
    EXPECT_EQ(std::bit_cast<uint32_t>(got_scales[kFp8AmaxIndex]), std::bit_cast<uint32_t>(want_scales[kFp8AmaxIndex]))
        << name << ": amax " << got_scales[kFp8AmaxIndex] << ", want " << want_scales[kFp8AmaxIndex];
    EXPECT_EQ(std::bit_cast<uint32_t>(got_scales[kFp8DequantIndex]),
              std::bit_cast<uint32_t>(want_scales[kFp8DequantIndex]))
        << name << ": dequantisation scale " << got_scales[kFp8DequantIndex] << ", want "
        << want_scales[kFp8DequantIndex];
  }

  // 2. Training against the plain FP8 step.
  AdamWConfig no_clip;
  no_clip.max_grad_norm = 0;
  bool identical = true;
  const auto count = size_t(kRows * kSeq);
  for (int64_t s = 0; s < kSteps; ++s) {
    const Batches b(mc.vocab, s);
    plain.zero_grad();
    const double want = plain.forward(b.x.data(), b.y.data());
    plain.backward();
    optimizer_step(plain, no_clip, kLr);
    const double got = dp.forward_backward(std::span(b.x).first(count), std::span(b.y).first(count));
    dp.optimizer_step(no_clip, kLr);
    ASSERT_TRUE(std::isfinite(got)) << "step " << s;
    EXPECT_NEAR(got, want, 1e-4 * std::fabs(want)) << "step " << s;
    identical = identical && std::bit_cast<uint64_t>(got) == std::bit_cast<uint64_t>(want);
  }
  std::vector<float> got(size_t(sharded.parameter_count()));
  dp.save_parameters(comm(), got.data());
  const std::vector<float> want = host_parameters(plain);
  EXPECT_LE(relative_l2(got, want), 1e-3);
  identical = identical && got == want;
  std::printf("[   INFO   ] FSDP's FP8 step at %lld rank(s): %s the plain FP8 step after %lld steps (parameters "
              "relative L2 %.3g)\n",
              static_cast<long long>(world), identical ? "bit-identical to" : "within tolerance of, not identical to",
              static_cast<long long>(kSteps), relative_l2(got, want));
  RecordProperty("fp8_step_bit_identical", identical ? "yes" : "no");

  // 3. The traffic: a byte per foreign element of the layers, a float per group per other rank.
  DdpParameters params;
  params.layout = parameter_layout(mc);
  const std::vector<DdpBucket> buckets = fsdp_bucket_plan(params);
  const ZeroBucketLayout shards = zero_bucket_layout(buckets, int(world), comm().rank());
  int64_t foreign = 0;
  for (size_t k = 0; k < buckets.size(); ++k) {
    if (params.layout[size_t(buckets[k].params.front())].name.starts_with("layers.")) {
      foreign += shards.buckets[k].part * (world - 1);
    }
  }
  const int64_t gathers = 2 * kSteps + 1;  // gather_parameters(), then a forward and a backward a step
  const FsdpGatherTraffic traffic = dp.fsdp()->gather_traffic();
  EXPECT_EQ(traffic.fp8_bytes, gathers * foreign);
  EXPECT_EQ(traffic.fp8_amax_bytes, gathers * 5 * mc.layers * (world - 1) * int64_t(sizeof(float)));

  // 4. Rowwise: no FP8 parts, the layers gathered in bf16.
  ModelOptions rowwise = fsdp_fp8;
  rowwise.fp8_recipe = Fp8Recipe::rowwise;
  CudaModel wide(mc, kRows, kSeq, DType::bf16, rowwise);
  DdpModel wide_dp(comm(), wide, kRows * kSeq, d, false);
  wide_dp.init_parameters(11);
  EXPECT_EQ(wide_dp.fsdp()->fp8_units(), 0);
  const Batches b(mc.vocab, 0);
  EXPECT_TRUE(std::isfinite(wide_dp.forward_backward(std::span(b.x).first(count), std::span(b.y).first(count))));
  wide_dp.optimizer_step(no_clip, kLr);
  EXPECT_EQ(wide_dp.fsdp()->gather_traffic().fp8_bytes, 0);
}
#else
TEST(FsdpGpu, SkippedWithoutCuda) { GTEST_SKIP() << "flashlm was built without CUDA"; }
#endif

}  // namespace
