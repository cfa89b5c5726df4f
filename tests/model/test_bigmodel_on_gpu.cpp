// Big-model machinery on the GPU: activation recomputation (bit-identical gradients), the LM head in token
// chunks, pure bf16 (parameters, gradients, moments in bf16) and the memory plan's refusal. Skips without a
// GPU.
#include <gtest/gtest.h>

#include "gpu_testing.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "flashlm/error.h"
#include "flashlm/memory.h"
#include "flashlm/model.h"

using namespace flashlm;

#ifndef FLASHLM_WITH_CUDA
TEST(CudaBigModel, NeedsACudaBuild) { GTEST_SKIP() << "flashlm was built without CUDA"; }
#else
namespace {

ModelConfig three_blocks() {
  ModelConfig c = ModelConfig::named("tiny", 64, 128);
  c.d_model = 64;  // head_dim 16: the smallest the tensor-core attention takes
  c.d_ff = 128;
  c.layers = 3;
  return c;
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<float> grads, params;  // after the last backward / the last step
};

// `steps` train steps on fresh pseudo-random tokens, the gradients of the last backward kept.
TrainRun train(const ModelConfig& c, DType precision, const ModelOptions& o, int steps, uint64_t seed = 5) {
  const int64_t batch = 2, seq = 64, n = batch * seq;
  CudaModel model(c, batch, seq, precision, o);
  model.init_parameters(seed);
  std::vector<int32_t> tokens(static_cast<size_t>(n)), targets(static_cast<size_t>(n));
  uint32_t state = 777;
  auto next = [&] { return state = state * 1664525u + 1013904223u, int32_t((state >> 8) % uint32_t(c.vocab)); };
  TrainRun r;
  r.grads.resize(size_t(model.parameter_count()));
  r.params.resize(size_t(model.parameter_count()));
  AdamWConfig opt;
  for (int s = 0; s < steps; ++s) {
    for (int64_t i = 0; i < n; ++i) tokens[size_t(i)] = next(), targets[size_t(i)] = next() % 16;
    model.zero_grad();
    r.losses.push_back(model.forward(tokens.data(), targets.data()));
    model.backward();
    if (s + 1 == steps) model.copy_gradients_to(r.grads.data());
    optimizer_step(model, opt, 3e-3);
  }
  model.copy_parameters_to(r.params.data());
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::isnan(a[i]) ? INFINITY : std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return num / den;
}

ModelOptions with(const char* recompute, bool pure = false, int64_t head_chunk = 0) {
  ModelOptions o;
  o.recompute = RecomputePlan::parse(recompute);
  o.bf16_pure = pure;
  o.head_chunk = head_chunk;
  return o;
}

}  // namespace

class CudaRecompute : public ::testing::TestWithParam<DType> {};

TEST_P(CudaRecompute, GradientsAndUpdatesAreBitIdenticalToKeepingEverything) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = three_blocks();
  const TrainRun reference = train(c, GetParam(), with("none"), 2);
  for (const char* plan : {"blocks:1", "blocks:2", "selective"}) {
    const TrainRun r = train(c, GetParam(), with(plan), 2);
    EXPECT_EQ(r.losses, reference.losses) << plan;
    EXPECT_TRUE(same_bits(r.grads, reference.grads)) << plan;
    EXPECT_TRUE(same_bits(r.params, reference.params)) << plan;
  }
  // bf16-pure recomputes identically too.
  if (GetParam() == DType::bf16) {
    const TrainRun pure = train(c, DType::bf16, with("none", true), 2);
    const TrainRun pure_selective = train(c, DType::bf16, with("selective", true), 2);
    EXPECT_TRUE(same_bits(pure_selective.grads, pure.grads));
    EXPECT_TRUE(same_bits(pure_selective.params, pure.params));
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, CudaRecompute, ::testing::Values(DType::f32, DType::bf16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(CudaRecompute, TheAtomicAttentionBackwardGivesTheDeterministicGradientsWithinRounding) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = three_blocks();
  ModelOptions atomic = with("selective");
  atomic.deterministic = false;
  const TrainRun fast = train(c, DType::bf16, atomic, 1);
  const TrainRun exact = train(c, DType::bf16, with("selective"), 1);
  EXPECT_EQ(fast.losses, exact.losses);  // the forward does not depend on it
  EXPECT_LE(rel_error(fast.grads, exact.grads), 2e-2);
}

TEST(CudaHeadChunks, RaggedChunksGiveTheLossAndGradientsOfOneChunk) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = three_blocks();
  const TrainRun whole = train(c, DType::f32, with("none", false, 128), 1);  // every token in one chunk
  const TrainRun chunked = train(c, DType::f32, with("none", false, 48), 1);  // 48 + 48 + 32 tokens
  ASSERT_EQ(whole.losses.size(), 1u);
  EXPECT_NEAR(chunked.losses[0], whole.losses[0], 1e-6 * whole.losses[0]);
  EXPECT_LE(rel_error(chunked.grads, whole.grads), 1e-5);
}

TEST(CudaBf16Pure, FirstGradientsAreTheMixedOnesRoundedToBf16) {
  SKIP_WITHOUT_GPU();
  // Same weights rounded to bf16 in both; mixed keeps fp32 gradients, pure accumulates each weight's gradient
  // in fp32 and rounds it once: the pure gradients are the mixed ones rounded to bf16, bit for bit.
  const ModelConfig c = three_blocks();
  const TrainRun mixed = train(c, DType::bf16, with("none"), 1);
  const TrainRun pure = train(c, DType::bf16, with("none", true), 1);
  EXPECT_EQ(pure.losses, mixed.losses);
  std::vector<float> rounded(mixed.grads.size());
  for (size_t i = 0; i < rounded.size(); ++i) rounded[i] = float(bf16_t(mixed.grads[i]));
  EXPECT_TRUE(same_bits(pure.grads, rounded));
}

TEST(CudaBf16Pure, TrainsLikeMixedPrecision) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = three_blocks();
  const TrainRun mixed = train(c, DType::bf16, with("none"), 40);
  const TrainRun pure = train(c, DType::bf16, with("none", true), 40);
  EXPECT_LT(pure.losses.back(), 0.8 * pure.losses.front());
  EXPECT_NEAR(pure.losses.back(), mixed.losses.back(), 0.1 * mixed.losses.back());
  for (float p : pure.params) ASSERT_EQ(float(bf16_t(p)), p);  // the parameters are bf16 values
}

TEST(CudaBf16Pure, CheckpointStateRoundTripsAndTrainingContinuesIdentically) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = three_blocks();
  const int64_t batch = 2, seq = 64, n = batch * seq;
  CudaModel a(c, batch, seq, DType::bf16, with("none", true));
  a.init_parameters(9);
  std::vector<int32_t> tokens(static_cast<size_t>(n)), targets(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) tokens[size_t(i)] = int32_t((i * 37) % c.vocab), targets[size_t(i)] = int32_t(i % 16);
  AdamWConfig opt;
  auto step = [&](CudaModel& m) {
    m.zero_grad();
    const double loss = m.forward(tokens.data(), targets.data());
    m.backward();
    optimizer_step(m, opt, 1e-3);
    return loss;
  };
  step(a);
  step(a);
  const size_t count = size_t(a.parameter_count());
  std::vector<float> p(count), m1(count), v1(count);
  a.save_state(p, m1, v1);
  CudaModel b(c, batch, seq, DType::bf16, with("none", true));
  b.load_state(p, m1, v1, a.optimizer_steps());
  std::vector<float> p2(count), m2(count), v2(count);
  b.save_state(p2, m2, v2);
  EXPECT_TRUE(same_bits(p, p2) && same_bits(m1, m2) && same_bits(v1, v2));
  EXPECT_EQ(step(a), step(b));
  a.copy_parameters_to(p.data());
  b.copy_parameters_to(p2.data());
  EXPECT_TRUE(same_bits(p, p2));
  EXPECT_THROW(a.parameters(), Error);  // no fp32 masters for data parallelism
  EXPECT_THROW(a.gradients(), Error);
  EXPECT_THROW(CudaModel(c, batch, seq, DType::f16, with("none", true)), Error);
}

TEST(CudaMemoryPlan, ARunThatCannotFitIsRefusedBeforeAllocating) {
  SKIP_WITHOUT_GPU();
  const int64_t before = memory_stats(Device::cuda).current_bytes;
  try {
    CudaModel m(ModelConfig::named("cs336-8b", 65536), 4, 65536, DType::bf16, with("none"));
    FAIL() << "expected flashlm::OutOfMemory";
  } catch (const OutOfMemory& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("memory plan: the model needs"), std::string::npos) << message;
    EXPECT_NE(message.find("GiB short"), std::string::npos) << message;
  }
  EXPECT_EQ(memory_stats(Device::cuda).current_bytes, before);
}
#endif
