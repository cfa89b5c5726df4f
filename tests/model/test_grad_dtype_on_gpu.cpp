// CudaModel with bf16 gradients beside fp32 masters (ModelOptions::grad_dtype, `--grad-dtype bf16`: an
// experiment of issue 32), over bf16 and fp8 precision: one backward against the fp32-gradient backward (each
// gradient that fp32 one rounded to bf16, within the rounding), two backwards that accumulate, a short training
// run against the fp32-gradient run within a stated bound, the CUDA graph's bits against eager steps, and
// checkpoint resume bit-exact. Skips without a GPU.
#include <gtest/gtest.h>

#include "gpu_testing.h"
#include "model/random_tokens.h"
#include "model/resume_testing.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "flashlm/device.h"
#include "flashlm/error.h"
#include "flashlm/model.h"
#include "flashlm/train.h"

using namespace flashlm;

#ifndef FLASHLM_WITH_CUDA
TEST(CudaModelBf16Gradients, NeedsACudaBuild) {
  GTEST_SKIP() << "flashlm was built without CUDA: CudaModel does not exist";
}
#else
namespace {

// tiny's layers at head_dim 16 (the CUDA attention's smallest) and widths that are multiples of 16 (FP8's GEMMs).
ModelConfig config() {
  ModelConfig c = ModelConfig::named("tiny", 64, 128);  // 2 layers, 4 heads
  c.d_model = 64;
  c.d_ff = 160;
  return c;
}

// The two precisions --grad-dtype bf16 applies to, as (name, fp8).
struct Precision {
  const char* name;
  bool fp8;
};
constexpr Precision kPrecisions[] = {{"bf16", false}, {"fp8", true}};

ModelOptions options(const Precision& p, DType grad_dtype) {
  ModelOptions o;
  o.fp8 = p.fp8;
  o.grad_dtype = grad_dtype;
  return o;
}

// The gradients after `backwards` backwards (batches 1, 2, ...) from a zero_grad, from init_parameters(5).
std::vector<float> gradients_after(const ModelConfig& c, const ModelOptions& o, int backwards, double* norm = nullptr) {
  CudaModel m(c, 2, 64, DType::bf16, o);
  m.init_parameters(5);
  m.zero_grad();
  for (int k = 1; k <= backwards; ++k) {
    const Batch b = make_batch(2 * 64, c.vocab, k);
    m.forward(b.tokens.data(), b.targets.data());
    m.backward();
  }
  if (norm) *norm = m.gradient_norm();
  std::vector<float> g(size_t(m.parameter_count()));
  m.copy_gradients_to(g.data());
  return g;
}

bool is_bf16_value(float x) { return (std::bit_cast<uint32_t>(x) & 0xffffu) == 0; }

// |got - ref| <= rel · |ref| + abs_floor for every element; the worst excess is reported.
::testing::AssertionResult within(const std::vector<float>& got, const std::vector<float>& ref, double rel,
                                  double abs_floor) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << ref.size();
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double(got[i]) - double(ref[i]));
    if (!(err <= rel * std::fabs(double(ref[i])) + abs_floor)) {
      return ::testing::AssertionFailure() << "element " << i << ": " << got[i] << " vs " << ref[i] << " (bound "
                                           << rel * std::fabs(double(ref[i])) + abs_floor << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

double largest(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

}  // namespace

// One backward: every stored gradient is a bf16 value, and it is the fp32-gradient run's rounded to bf16 —
// within half a bf16 ulp (2^-8 relative) and the fp32 summation order of a GEMM whose output type differs
// (cuBLASLt may take another algorithm: 1e-5 of the largest gradient). The norm (over the bf16 values) within
// 2^-8 relative of fp32's.
TEST(CudaModelBf16Gradients, OneBackwardRoundsTheFp32Gradients) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  for (const Precision& p : kPrecisions) {
    SCOPED_TRACE(p.name);
    double norm32 = 0, norm16 = 0;
    const std::vector<float> g32 = gradients_after(c, options(p, DType::f32), 1, &norm32);
    const std::vector<float> g16 = gradients_after(c, options(p, DType::bf16), 1, &norm16);
    size_t not_bf16 = 0, rounded = 0;
    for (size_t i = 0; i < g16.size(); ++i) {
      not_bf16 += !is_bf16_value(g16[i]);
      rounded += g16[i] != g32[i];
    }
    EXPECT_EQ(not_bf16, 0u) << "gradients stored with more than bf16's bits";
    EXPECT_GT(rounded, g16.size() / 2) << "most gradients should have been rounded: did the bf16 path run?";
    EXPECT_TRUE(within(g16, g32, std::ldexp(1.0, -8), 1e-5 * largest(g32)));
    EXPECT_NEAR(norm16, norm32, std::ldexp(norm32, -8));
    std::printf("%s: gradient norm %.7g with bf16 gradients, %.7g with fp32\n", p.name, norm16, norm32);
  }
}

// Two backwards without a zero_grad add up: the second adds to the stored bf16 gradients in fp32 and rounds once
// (the GEMMs through beta = 1, the other kernels through the fp32 staging buffer), so the sum is within two
// roundings (2 · 2^-8 of |g1| + |g2|, bounded by twice the larger) of the fp32-gradient run's sum.
TEST(CudaModelBf16Gradients, TwoBackwardsAccumulate) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  for (const Precision& p : kPrecisions) {
    SCOPED_TRACE(p.name);
    const std::vector<float> g32 = gradients_after(c, options(p, DType::f32), 2);
    const std::vector<float> g16 = gradients_after(c, options(p, DType::bf16), 2);
    const std::vector<float> one = gradients_after(c, options(p, DType::f32), 1);
    std::vector<float> bound_ref(g32.size());  // |g1| + |g2| >= |the sum|: the rounding bound's scale
    for (size_t i = 0; i < g32.size(); ++i) bound_ref[i] = std::fabs(one[i]) + std::fabs(g32[i] - one[i]);
    for (size_t i = 0; i < g16.size(); ++i) {
      ASSERT_LE(std::fabs(double(g16[i]) - double(g32[i])),
                2 * std::ldexp(double(bound_ref[i]), -8) + 1e-5 * largest(g32))
          << "element " << i;
    }
    EXPECT_NE(g16, gradients_after(c, options(p, DType::bf16), 1)) << "the second backward added nothing";
  }
}

// 30 AdamW steps (clipped at 1, lr 3e-3) on one batch: the bf16-gradient run's loss at every step within 1% of the
// fp32-gradient run's first loss (a fifth of the FP8-vs-bf16 bound: each gradient is perturbed by at most 2^-8
// relative, which AdamW's normalised update passes on at about that size, against FP8's 2–3 mantissa bits), the
// loss falling by 20% as fp32's does, and two runs giving the same bits.
TEST(CudaModelBf16Gradients, TrainingTracksFp32GradientsAndIsReproducible) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  const Batch b = make_batch(2 * 64, c.vocab, 2);
  constexpr int kSteps = 30;
  const auto train = [&](const ModelOptions& o, std::vector<float>* params) {
    CudaModel m(c, 2, 64, DType::bf16, o);
    m.init_parameters(3);
    AdamWConfig opt;
    opt.max_grad_norm = 1.0;
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      losses.push_back(m.train_step(b.tokens.data(), b.targets.data(), opt, 3e-3).loss);
    }
    params->resize(size_t(m.parameter_count()));
    m.copy_parameters_to(params->data());
    return losses;
  };
  for (const Precision& p : kPrecisions) {
    SCOPED_TRACE(p.name);
    std::vector<float> p32, p16a, p16b;
    const std::vector<double> ref = train(options(p, DType::f32), &p32);
    const std::vector<double> l0 = train(options(p, DType::bf16), &p16a), l1 = train(options(p, DType::bf16), &p16b);
    EXPECT_EQ(l0, l1);
    EXPECT_TRUE(p16a == p16b) << "two bf16-gradient runs differ";
    EXPECT_LT(ref.back(), 0.8 * ref.front());
    EXPECT_LT(l0.back(), 0.8 * l0.front());
    double worst = 0;
    for (int s = 0; s < kSteps; ++s) {
      worst = std::max(worst, std::fabs(l0[size_t(s)] - ref[size_t(s)]));
      EXPECT_NEAR(l0[size_t(s)], ref[size_t(s)], 0.01 * ref.front()) << "step " << s;
    }
    double dw = 0;
    for (size_t i = 0; i < p32.size(); ++i) dw = std::max(dw, double(std::fabs(p16a[i] - p32[i])));
    std::printf("%s: loss %.5f -> %.5f with bf16 gradients (fp32: %.5f -> %.5f), largest loss gap %.2e, largest "
                "weight gap %.2e\n",
                p.name, l0.front(), l0.back(), ref.front(), ref.back(), worst, dw);
  }
}

// The step as one CUDA graph gives the eager steps' bits: losses, norms, parameters, (clipped) gradients and
// moments after seven steps, every other one clipped, the learning rate rising; with the norm as one pass and
// overlapped with the backward, fp32 and bf16 moments.
TEST(CudaModelBf16Gradients, GraphedStepsGiveTheBitsOfEagerSteps) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  for (const Precision& p : kPrecisions) {
    for (int variant = 0; variant < 3; ++variant) {
      ModelOptions o = options(p, DType::bf16);
      o.overlap_grad_norm = variant == 1;
      o.optimizer_state = variant == 2 ? OptimizerState::bf16 : OptimizerState::fp32;
      const std::string name = std::string(p.name) + (variant == 1 ? ", overlapped norm" : "") +
                               (variant == 2 ? ", bf16 moments" : "");
      SCOPED_TRACE(name);
      std::vector<StepResult> results[2];
      std::vector<float> params[2], grads[2], moments[2];
      for (int graphed = 0; graphed < 2; ++graphed) {
        o.cuda_graph = graphed == 1;
        CudaModel m(c, 2, 64, DType::bf16, o);
        m.init_parameters(17);
        for (int step = 0; step < 7; ++step) {
          const Batch b = make_batch(2 * 64, c.vocab, 20 + step);
          AdamWConfig opt;
          opt.max_grad_norm = step % 2 == 0 ? 1e-3 : 1e9;  // clipped, then not
          results[graphed].push_back(m.train_step(b.tokens.data(), b.targets.data(), opt, 1e-3 * (1 + step)));
        }
        EXPECT_EQ(m.cuda_graph_status(), graphed ? "on" : "off: --cuda-graph off");
        const auto count = size_t(m.parameter_count());
        params[graphed].resize(count);
        grads[graphed].resize(count);
        m.copy_parameters_to(params[graphed].data());
        m.copy_gradients_to(grads[graphed].data());
        std::vector<float> saved(count), mo(count), vo(count);
        m.save_state(saved, mo, vo);
        moments[graphed] = mo;
        moments[graphed].insert(moments[graphed].end(), vo.begin(), vo.end());
      }
      for (size_t i = 0; i < results[0].size(); ++i) {
        EXPECT_EQ(results[1][i].loss, results[0][i].loss) << "step " << i;
        EXPECT_EQ(results[1][i].grad_norm, results[0][i].grad_norm) << "step " << i;
      }
      EXPECT_GT(results[0][2].grad_norm, 1e-3) << "step 2 was meant to be clipped";
      EXPECT_TRUE(params[1] == params[0]) << "parameters differ";
      EXPECT_TRUE(grads[1] == grads[0]) << "gradients differ";
      EXPECT_TRUE(moments[1] == moments[0]) << "moments differ";
    }
  }
}

// train() with bf16 gradients resumes from its checkpoint bit-exactly (the gradients are no state: a checkpoint
// holds what an fp32-gradient run's holds), over bf16 and fp8, fp32 and bf16 moments.
TEST(CudaModelBf16Gradients, CheckpointResumeIsBitExact) {
  SKIP_WITHOUT_GPU();
  for (const Precision& p : kPrecisions) {
    for (const OptimizerState state : {OptimizerState::fp32, OptimizerState::bf16}) {
      TrainConfig t;
      t.model = config();
      t.device = Device::cuda;
      t.precision = DType::bf16;
      t.options = options(p, DType::bf16);
      t.options.optimizer_state = state;
      flashlm::testing::expect_resume_is_bit_exact(
          t, std::string("bf16-gradients-") + p.name + "-" + std::string(optimizer_state_name(state)));
    }
  }
}

// What bf16 gradients cannot be: fp32 or fp16 precision, bf16-pure; and a model with them hands out no fp32
// gradients (data parallelism's entry point).
TEST(CudaModelBf16Gradients, RefusedWhereItDoesNotApply) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  ModelOptions o;
  o.grad_dtype = DType::bf16;
  EXPECT_THROW(CudaModel(c, 2, 64, DType::f32, o), InvalidArgument);
  EXPECT_THROW(CudaModel(c, 2, 64, DType::f16, o), InvalidArgument);
  ModelOptions pure = o;
  pure.bf16_pure = true;
  EXPECT_THROW(CudaModel(c, 2, 64, DType::bf16, pure), InvalidArgument);
  CudaModel m(c, 2, 64, DType::bf16, o);
  EXPECT_EQ(m.grad_dtype(), DType::bf16);
  try {
    m.gradients();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--grad-dtype bf16 keeps no fp32 gradients"), std::string::npos) << e.what();
  }
}
#endif
