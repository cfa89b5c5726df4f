// CudaModel with --precision fp8 (ModelOptions::fp8): the FP8 step against the bf16 step it replaces the
// linear layers' GEMMs of (loss, gradients, a short training run, both gradient formats), reproducibility,
// the CUDA graph, recomputation, the deferred zero_grad and checkpoint resume, bit-exact where the bf16
// path is. Skips without a GPU.
//
// The FP8 state is only derived per step: every scale and FP8 copy is recomputed from the step's own bf16
// tensors right before its GEMM (model/cuda/fp8_linear.h), or, for the block weights, written by the AdamW step
// that stored them (the optimizer's copies), which a resumed run and the run that wrote the checkpoint both
// replace by casts in their next pass. So a checkpoint holds what a bf16 run's holds and resume is bit-exact for
// the same reason the bf16 run's is.
#include <gtest/gtest.h>

#include "core/cuda_runtime.h"
#include "env_testing.h"
#include "gpu_testing.h"
#include "model/random_tokens.h"
#include "model/resume_testing.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "flashlm/device.h"
#include "flashlm/model.h"
#include "flashlm/train.h"

using namespace flashlm;

#ifndef FLASHLM_WITH_CUDA
TEST(CudaModelFp8, NeedsACudaBuild) { GTEST_SKIP() << "flashlm was built without CUDA: CudaModel does not exist"; }
#else
namespace {

ModelConfig fp8_config() {
  ModelConfig c = ModelConfig::named("tiny", 64, 128);  // 2 layers, 4 heads
  c.d_model = 64;  // head_dim 16; d_model, d_ff multiples of 16 (the FP8 GEMMs)
  c.d_ff = 160;
  return c;
}

ModelOptions fp8_options(Fp8Format g, Fp8Recipe recipe = Fp8Recipe::tensorwise) {
  ModelOptions o;
  o.fp8 = true;
  o.fp8_gradients = g;
  o.fp8_recipe = recipe;
  return o;
}

// One forward and backward of batch b from init_parameters(5): the loss, and the gradients into *grads.
double one_step(const ModelConfig& c, const Batch& b, const ModelOptions& o, std::vector<float>* grads) {
  CudaModel m(c, 2, 64, DType::bf16, o);
  m.init_parameters(5);
  m.zero_grad();
  const double loss = m.forward(b.tokens.data(), b.targets.data());
  m.backward();
  grads->resize(size_t(m.parameter_count()));
  m.copy_gradients_to(grads->data());
  return loss;
}

// kTrainSteps AdamW steps on batch b from init_parameters(3): each step's loss, and the final parameters into
// *params where given.
constexpr int kTrainSteps = 30;
std::vector<double> train_losses(const ModelConfig& c, const Batch& b, const ModelOptions& o,
                                 std::vector<float>* params) {
  CudaModel m(c, 2, 64, DType::bf16, o);
  m.init_parameters(3);
  AdamWConfig opt;
  std::vector<double> losses;
  for (int step = 0; step < kTrainSteps; ++step) {
    m.zero_grad();
    losses.push_back(m.forward(b.tokens.data(), b.targets.data()));
    m.backward();
    m.clip_gradients(1.0);
    m.adamw_step(opt, 3e-3);
  }
  if (params) {
    params->resize(size_t(m.parameter_count()));
    m.copy_parameters_to(params->data());
  }
  return losses;
}

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::isnan(a[i]) ? INFINITY : std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return num / den;
}

}  // namespace

// One forward and backward from the same weights: the loss within 1% of bf16's, the gradients within 15%
// (e4m3) and 25% (e5m2) of bf16's in max-norm (relative to the largest gradient element): the quantisation
// of every linear operand to 3 (e4m3) or 2 (e5m2) mantissa bits, through two layers.
TEST(CudaModelFp8, LossAndGradientsTrackBf16) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  const Batch b = make_batch(2 * 64, c.vocab, 1);
  std::vector<float> ref_grads;
  const double ref_loss = one_step(c, b, ModelOptions{}, &ref_grads);
  for (Fp8Format g : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    std::vector<float> grads;
    const double loss = one_step(c, b, fp8_options(g), &grads);
    const double err = rel_error(grads, ref_grads);
    std::printf("fp8 (%s gradients): loss %.6f (bf16 %.6f), gradient error %.4f of the largest\n",
                std::string(fp8_format_name(g)).c_str(), loss, ref_loss, err);
    EXPECT_NEAR(loss, ref_loss, 0.01 * ref_loss) << fp8_format_name(g);
    EXPECT_NE(loss, ref_loss) << "fp8 gave bf16's loss bit for bit: the FP8 path did not run";
    EXPECT_LT(err, g == Fp8Format::e4m3 ? 0.15 : 0.25) << fp8_format_name(g);
  }
}

// 30 AdamW steps on one batch: the FP8 run lowers the loss as bf16 does; at every step its loss is within
// 5% of the first loss of bf16's (which drops by more than 20% over the run), and two FP8 runs give the
// same bits. The losses are printed: which gradient format holds the loss better is read from them.
TEST(CudaModelFp8, TrainingTracksBf16AndIsReproducible) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  const Batch b = make_batch(2 * 64, c.vocab, 2);
  const std::vector<double> ref = train_losses(c, b, ModelOptions{}, nullptr);
  EXPECT_LT(ref.back(), 0.8 * ref.front());
  for (Fp8Format g : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    std::vector<float> p0, p1;
    const std::vector<double> l0 = train_losses(c, b, fp8_options(g), &p0);
    const std::vector<double> l1 = train_losses(c, b, fp8_options(g), &p1);
    EXPECT_EQ(p0, p1) << fp8_format_name(g) << ": two FP8 runs differ";
    EXPECT_EQ(l0, l1) << fp8_format_name(g);
    double worst = 0;
    for (int s = 0; s < kTrainSteps; ++s) {
      worst = std::max(worst, std::fabs(l0[size_t(s)] - ref[size_t(s)]));
      EXPECT_NEAR(l0[size_t(s)], ref[size_t(s)], 0.05 * ref.front()) << fp8_format_name(g) << " step " << s;
    }
    std::printf("fp8 (%s gradients): loss %.5f -> %.5f (bf16 %.5f -> %.5f), largest gap %.5f\n",
                std::string(fp8_format_name(g)).c_str(), l0.front(), l0.back(), ref.front(), ref.back(), worst);
    EXPECT_LT(l0.back(), 0.8 * l0.front()) << fp8_format_name(g);
  }
}

// bf16-pure-fp8: the FP8 GEMMs over bf16-pure storage (the leaderboard's), against bf16-pure: one forward
// and backward within the bounds of LossAndGradientsTrackBf16, then 30 AdamW steps that track bf16-pure's
// losses as TrainingTracksBf16AndIsReproducible asks, twice with the same bits.
TEST(CudaModelFp8, OverBf16PureTracksBf16PureAndIsReproducible) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  ModelOptions pure;
  pure.bf16_pure = true;
  ModelOptions pure_fp8 = fp8_options(Fp8Format::e5m2);
  pure_fp8.bf16_pure = true;
  {
    const Batch b = make_batch(2 * 64, c.vocab, 1);
    std::vector<float> grads[2];
    const double loss[2] = {one_step(c, b, pure, &grads[0]), one_step(c, b, pure_fp8, &grads[1])};
    const double err = rel_error(grads[1], grads[0]);
    std::printf("bf16-pure-fp8: loss %.6f (bf16-pure %.6f), gradient error %.4f of the largest\n", loss[1], loss[0],
                err);
    EXPECT_NEAR(loss[1], loss[0], 0.01 * loss[0]);
    EXPECT_NE(loss[1], loss[0]) << "bf16-pure-fp8 gave bf16-pure's loss bit for bit: the FP8 path did not run";
    EXPECT_LT(err, 0.25);
  }
  const Batch b = make_batch(2 * 64, c.vocab, 2);
  std::vector<float> p0, p1;
  const std::vector<double> ref = train_losses(c, b, pure, nullptr);
  const std::vector<double> l0 = train_losses(c, b, pure_fp8, &p0), l1 = train_losses(c, b, pure_fp8, &p1);
  EXPECT_LT(ref.back(), 0.8 * ref.front());
  EXPECT_EQ(l0, l1);
  EXPECT_EQ(p0, p1) << "two bf16-pure-fp8 runs differ";
  for (int s = 0; s < kTrainSteps; ++s) EXPECT_NEAR(l0[size_t(s)], ref[size_t(s)], 0.05 * ref.front()) << "step " << s;
  std::printf("bf16-pure-fp8: loss %.5f -> %.5f (bf16-pure %.5f -> %.5f)\n", l0.front(), l0.back(), ref.front(),
              ref.back());
  EXPECT_LT(l0.back(), 0.8 * l0.front());
}

// The step as one CUDA graph gives the eager step's bits with FP8 (the scales live on the device and are
// recomputed inside the graph each replay: a new batch each step must change them), and recomputation
// gives the bits of keeping every activation (the recomputed forward casts the same bf16 tensors); over
// bf16 mixed precision and over bf16-pure.
namespace {

// Six train_steps from init_parameters(17) on batches first_batch, first_batch + 1, ..., clipping every other
// step and the learning rate rising: each step's result and the parameters after them (the CUDA graph checked
// "on" where o asks for it).
struct SixSteps {
  std::vector<StepResult> steps;
  std::vector<float> params;
};
SixSteps six_steps(const ModelConfig& c, const ModelOptions& o, int first_batch) {
  SixSteps r;
  CudaModel m(c, 2, 64, DType::bf16, o);
  m.init_parameters(17);
  for (int step = 0; step < 6; ++step) {
    const Batch b = make_batch(2 * 64, c.vocab, first_batch + step);
    AdamWConfig opt;
    opt.max_grad_norm = step % 2 == 0 ? 1e-3 : 1e9;
    r.steps.push_back(m.train_step(b.tokens.data(), b.targets.data(), opt, 1e-3 * (1 + step)));
  }
  if (o.cuda_graph) {
    EXPECT_EQ(m.cuda_graph_status(), "on");
  }
  r.params.resize(size_t(m.parameter_count()));
  m.copy_parameters_to(r.params.data());
  return r;
}

void expect_same_bits(const SixSteps& got, const SixSteps& want, const std::string& what) {
  for (size_t s = 0; s < want.steps.size(); ++s) {
    EXPECT_EQ(got.steps[s].loss, want.steps[s].loss) << what << ", step " << s;
    EXPECT_EQ(got.steps[s].grad_norm, want.steps[s].grad_norm) << what << ", step " << s;
  }
  EXPECT_TRUE(got.params == want.params) << what << ": parameters differ";
}

// The eager step's bits from the graphed step and from recomputation, for fp8 options `base` (bf16_pure and
// the recipe as given).
void expect_graphed_and_recomputed_steps_give_the_eager_bits(const ModelConfig& c, const ModelOptions& base) {
  struct Variant {
    const char* name;
    bool graph;
    RecomputePlan recompute;
  };
  const Variant variants[] = {{"eager", false, {}},
                              {"graphed", true, {}},
                              {"eager, recompute blocks", false, {RecomputePlan::Kind::blocks, 1}},
                              {"graphed, recompute selective", true, {RecomputePlan::Kind::selective, 1}}};
  SixSteps runs[4];
  for (int v = 0; v < 4; ++v) {
    ModelOptions o = base;
    o.cuda_graph = variants[v].graph;
    o.recompute = variants[v].recompute;
    runs[v] = six_steps(c, o, 30);
  }
  for (int v = 1; v < 4; ++v) expect_same_bits(runs[v], runs[0], variants[v].name);
}

}  // namespace

TEST(CudaModelFp8, GraphedAndRecomputedStepsGiveTheEagerBits) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  for (bool pure : {false, true}) {
    SCOPED_TRACE(pure ? "bf16-pure-fp8" : "fp8");
    ModelOptions o = fp8_options(Fp8Format::e5m2);
    o.bf16_pure = pure;
    expect_graphed_and_recomputed_steps_give_the_eager_bits(c, o);
  }
}

// The amaxes from the tensors' producers (ModelOptions::fp8_fused_amax: RMSNorm, SwiGLU, the RoPE backward's
// dqkv, the AdamW step's block weights) give the bits of every cast reducing its own: losses, norms and
// parameters over six steps, eager and graphed, over bf16 (fp32 and bf16 moments) and bf16-pure.
TEST(CudaModelFp8, FusedAmaxesGiveTheBitsOfReducingEachCast) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  struct Storage {
    const char* name;
    bool pure;
    OptimizerState state;
  };
  for (const Storage& st : {Storage{"bf16", false, OptimizerState::fp32},
                            Storage{"bf16, bf16 moments", false, OptimizerState::bf16},
                            Storage{"bf16-pure", true, OptimizerState::fp32}}) {
    for (bool graph : {false, true}) {
      const std::string what = std::string(st.name) + (graph ? ", graphed" : ", eager");
      SixSteps runs[2];
      for (int fused = 0; fused < 2; ++fused) {
        ModelOptions o = fp8_options(Fp8Format::e5m2);
        o.bf16_pure = st.pure;
        o.optimizer_state = st.state;
        o.cuda_graph = graph;
        o.fp8_fused_amax = fused == 1;
        o.fp8_optimizer_weight_cast = false;  // its copies are scaled otherwise (OptimizerWeightCast... below)
        runs[fused] = six_steps(c, o, 40);
      }
      expect_same_bits(runs[1], runs[0], what);
    }
  }
}

// The block weights' FP8 copies written by the AdamW step (ModelOptions::fp8_optimizer_weight_cast, scaled from
// a bound on their new amax) against each pass casting them (scaled from their amax): over six steps, eager and
// graphed, fp32 and bf16 moments, the losses within 0.5% (the scales differ by about the update's size, and the
// bytes with them: FP8 rounding noise, not a drift; the parameters differ, by up to a few updates where a
// gradient near zero changed sign); FLASHLM_FP8_WEIGHT_CAST=pass gives the bits of the option off.
TEST(CudaModelFp8, OptimizerWeightCastTracksThePassCast) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  for (OptimizerState state : {OptimizerState::fp32, OptimizerState::bf16}) {
    for (bool graph : {false, true}) {
      SCOPED_TRACE(std::string(state == OptimizerState::fp32 ? "fp32 moments" : "bf16 moments") +
                   (graph ? ", graphed" : ", eager"));
      ModelOptions o = fp8_options(Fp8Format::e5m2);
      o.optimizer_state = state;
      o.cuda_graph = graph;
      const SixSteps copies = six_steps(c, o, 70);
      o.fp8_optimizer_weight_cast = false;
      const SixSteps pass = six_steps(c, o, 70);
      for (size_t s = 0; s < pass.steps.size(); ++s) {
        EXPECT_NEAR(copies.steps[s].loss, pass.steps[s].loss, 5e-3 * pass.steps[s].loss) << "step " << s;
      }
      EXPECT_FALSE(copies.params == pass.params) << "the copies were not the optimizer's (the same bits as the pass)";
      o.fp8_optimizer_weight_cast = true;
      {
        const flashlm::testing::ScopedEnvironment env("FLASHLM_FP8_WEIGHT_CAST", "pass");
        expect_same_bits(six_steps(c, o, 70), pass, "FLASHLM_FP8_WEIGHT_CAST=pass");
      }
    }
  }
}

// The optimizer's copies without the block weights' bf16 copy (FLASHLM_FP8_WEIGHT_CAST=optimizer, the default)
// give the bits of writing it too (optimizer-bf16): the copy is restored from the masters wherever it is read.
// Six steps, eager and graphed, fp32 and bf16 weight gradients, a checkpoint written after the third and an
// evaluation pass after each of the last three (the next pass then casts from the bf16 copy: a stale one would
// change the losses); the losses, evaluations, norms, parameters and the working copy handed out afterwards are
// the same bits.
TEST(CudaModelFp8, SkippedBf16WeightCopyGivesTheBitsOfWritingIt) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  for (DType grads : {DType::f32, DType::bf16}) {
    for (bool graph : {false, true}) {
      SCOPED_TRACE(std::string(grads == DType::f32 ? "fp32 gradients" : "bf16 gradients") +
                   (graph ? ", graphed" : ", eager"));
      ModelOptions o = fp8_options(Fp8Format::e5m2);
      o.optimizer_state = OptimizerState::bf16;
      o.grad_dtype = grads;
      o.cuda_graph = graph;
      struct Run {
        std::vector<StepResult> steps;
        std::vector<double> evals;
        std::vector<float> params;
        std::vector<uint16_t> working;
      };
      const auto run = [&](const char* cast) {
        const flashlm::testing::ScopedEnvironment env("FLASHLM_FP8_WEIGHT_CAST", cast);
        Run r;
        CudaModel m(c, 2, 64, DType::bf16, o);
        m.init_parameters(29);
        const size_t count = size_t(m.parameter_count());
        for (int step = 0; step < 6; ++step) {
          const Batch b = make_batch(2 * 64, c.vocab, 90 + step);
          AdamWConfig opt;
          opt.max_grad_norm = step % 2 == 0 ? 1e-3 : 1e9;
          r.steps.push_back(m.train_step(b.tokens.data(), b.targets.data(), opt, 1e-3 * (1 + step)));
          if (step == 2) {
            std::vector<float> p(count), mo(count), v(count);
            m.save_state(p, mo, v);
          }
          if (step >= 3) {  // an evaluation pass takes the copies; the next step's pass casts from the bf16 copy
            const Batch e = make_batch(2 * 64, c.vocab, 70 + step);
            r.evals.push_back(m.forward(e.tokens.data(), e.targets.data()));
          }
        }
        r.params.resize(count);
        m.copy_parameters_to(r.params.data());
        r.working.resize(count);
        const void* working = m.working_parameters();  // restored on the model's stream where it was stale
        m.synchronize();
        cuda_copy(r.working.data(), working, count * sizeof(uint16_t));
        return r;
      };
      const Run skipped = run("optimizer"), written = run("optimizer-bf16");
      for (size_t s = 0; s < written.steps.size(); ++s) {
        EXPECT_EQ(skipped.steps[s].loss, written.steps[s].loss) << "step " << s;
        EXPECT_EQ(skipped.steps[s].grad_norm, written.steps[s].grad_norm) << "step " << s;
      }
      for (size_t e = 0; e < written.evals.size(); ++e) EXPECT_EQ(skipped.evals[e], written.evals[e]) << "eval " << e;
      EXPECT_TRUE(skipped.params == written.params) << "parameters differ";
      EXPECT_TRUE(skipped.working == written.working) << "the bf16 working copy handed out differs";
    }
  }
}

// The AdamW step's weight amaxes are trusted only until anything else writes the weights: after a load_state
// (here of the state three steps back, into a model whose slots hold the amaxes of its newer weights), the next
// steps give the bits of a fresh model loading the same state, eager and graphed (the graph's captured pass takes
// the slots; a reduction before its launch refreshes them), over bf16 and bf16-pure.
TEST(CudaModelFp8, WeightAmaxesAreReducedAgainAfterALoad) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  for (bool pure : {false, true}) {
    for (bool graph : {false, true}) {
      SCOPED_TRACE(std::string(pure ? "bf16-pure" : "bf16") + (graph ? ", graphed" : ", eager"));
      ModelOptions o = fp8_options(Fp8Format::e4m3);
      o.bf16_pure = pure;
      o.cuda_graph = graph;
      const AdamWConfig opt;
      const auto step = [&](CudaModel& m, int i) {
        const Batch b = make_batch(2 * 64, c.vocab, 60 + i);
        return m.train_step(b.tokens.data(), b.targets.data(), opt, 3e-3);
      };
      CudaModel a(c, 2, 64, DType::bf16, o);
      a.init_parameters(23);
      for (int i = 0; i < 3; ++i) step(a, i);
      const size_t count = size_t(a.parameter_count());
      std::vector<float> p(count), mo(count), v(count);
      a.save_state(p, mo, v);
      for (int i = 3; i < 6; ++i) step(a, i);  // the slots now hold the amaxes of these later weights
      a.load_state(p, mo, v, 3);
      CudaModel b(c, 2, 64, DType::bf16, o);
      b.load_state(p, mo, v, 3);
      for (int i = 3; i < 6; ++i) {
        const StepResult ra = step(a, i), rb = step(b, i);
        EXPECT_EQ(ra.loss, rb.loss) << "step " << i;
        EXPECT_EQ(ra.grad_norm, rb.grad_norm) << "step " << i;
      }
      std::vector<float> pa(count), pb(count);
      a.copy_parameters_to(pa.data());
      b.copy_parameters_to(pb.data());
      EXPECT_TRUE(pa == pb) << "parameters differ";
    }
  }
}

// zero_grad() is deferred (the backward's GEMMs write over stale gradients with beta 0): with FP8 that must
// give the bits of accumulating onto zeroed gradients, as in the other precisions.
TEST(CudaModelFp8, DeferredZeroGradGivesTheBitsOfAccumulatingOntoZeros) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  const Batch b1 = make_batch(2 * 64, c.vocab, 3), b2 = make_batch(2 * 64, c.vocab, 4);
  std::vector<float> grads[2];
  for (int run = 0; run < 2; ++run) {
    CudaModel m(c, 2, 64, DType::bf16, fp8_options(Fp8Format::e4m3));
    m.init_parameters(9);
    m.zero_grad();
    m.forward(b2.tokens.data(), b2.targets.data());
    m.backward();
    m.zero_grad();
    if (run == 1) m.gradients();  // zeroes them now: the backward then accumulates
    m.forward(b1.tokens.data(), b1.targets.data());
    m.backward();
    grads[run].resize(size_t(m.parameter_count()));
    m.copy_gradients_to(grads[run].data());
  }
  EXPECT_EQ(grads[0], grads[1]);
}

// train() with --precision fp8 resumes from its checkpoint bit-exactly (the FP8 state is derived per step:
// see the top of this file).
TEST(CudaModelFp8, CheckpointResumeIsBitExact) {
  SKIP_WITHOUT_GPU();
  TrainConfig t;
  t.model = fp8_config();
  t.device = Device::cuda;
  t.precision = DType::bf16;
  t.options.fp8 = true;
  flashlm::testing::expect_resume_is_bit_exact(t, "fp8");
  t.options.bf16_pure = true;
  flashlm::testing::expect_resume_is_bit_exact(t, "bf16-pure-fp8");
}

TEST(CudaModelFp8, BadConfigurationsAreErrors) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  ModelOptions o = fp8_options(Fp8Format::e5m2);
  EXPECT_THROW(CudaModel(c, 2, 64, DType::f32, o), Error);
  EXPECT_THROW(CudaModel(c, 2, 64, DType::f16, o), Error);
  o.bf16_pure = true;
  EXPECT_NO_THROW(CudaModel(c, 2, 64, DType::bf16, o));  // bf16-pure-fp8
  o.optimizer_state = OptimizerState::bf16;  // bf16-pure's moments are bf16 by definition: no other choice
  EXPECT_THROW(CudaModel(c, 2, 64, DType::bf16, o), Error);
  o.optimizer_state = OptimizerState::fp32;
  o.bf16_pure = false;
  try {
    CudaModel bad(c, 1, 60, DType::bf16, o);  // 60 tokens: not a multiple of 16
    ADD_FAILURE() << "60 tokens accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be a multiple of 16"), std::string::npos) << e.what();
  }
  ModelConfig odd = c;
  odd.d_ff = 168;  // a multiple of 8 (bf16 is fine), not of 16
  EXPECT_NO_THROW(CudaModel(odd, 2, 64, DType::bf16));
  EXPECT_THROW(CudaModel(odd, 2, 64, DType::bf16, o), Error);
}
// ---------------------------------------------------------------------------------------------------
// The rowwise recipe (ModelOptions::fp8_recipe = rowwise): the same bounds against bf16 as tensorwise, a
// different result from tensorwise's, the graph, recomputation and resume bit-exact.

TEST(CudaModelFp8Rowwise, LossAndGradientsTrackBf16) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  const Batch b = make_batch(2 * 64, c.vocab, 1);
  std::vector<float> ref_grads, tensorwise_grads;
  const double ref_loss = one_step(c, b, ModelOptions{}, &ref_grads);
  const double tensorwise_loss = one_step(c, b, fp8_options(Fp8Format::e5m2), &tensorwise_grads);
  for (Fp8Format g : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    std::vector<float> grads;
    const double loss = one_step(c, b, fp8_options(g, Fp8Recipe::rowwise), &grads);
    const double err = rel_error(grads, ref_grads);
    std::printf("fp8 rowwise (%s gradients): loss %.6f (bf16 %.6f, tensorwise e5m2 %.6f), gradient error %.4f of "
                "the largest (tensorwise e5m2 %.4f)\n",
                std::string(fp8_format_name(g)).c_str(), loss, ref_loss, tensorwise_loss, err,
                rel_error(tensorwise_grads, ref_grads));
    EXPECT_NEAR(loss, ref_loss, 0.01 * ref_loss) << fp8_format_name(g);
    EXPECT_NE(loss, ref_loss) << "rowwise gave bf16's loss bit for bit: the FP8 path did not run";
    EXPECT_NE(loss, tensorwise_loss) << "rowwise gave tensorwise's loss bit for bit: the vectors were not used";
    EXPECT_LT(err, g == Fp8Format::e4m3 ? 0.15 : 0.25) << fp8_format_name(g);
  }
}

// 30 AdamW steps: within 5% of bf16's first loss at every step (TrainingTracksBf16AndIsReproducible's bound),
// learning, and two runs give the same bits.
TEST(CudaModelFp8Rowwise, TrainingTracksBf16AndIsReproducible) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  const Batch b = make_batch(2 * 64, c.vocab, 2);
  std::vector<float> p0, p1;
  const std::vector<double> ref = train_losses(c, b, ModelOptions{}, nullptr);
  const ModelOptions o = fp8_options(Fp8Format::e5m2, Fp8Recipe::rowwise);
  const std::vector<double> l0 = train_losses(c, b, o, &p0), l1 = train_losses(c, b, o, &p1);
  EXPECT_EQ(l0, l1);
  EXPECT_EQ(p0, p1) << "two rowwise runs differ";
  for (int s = 0; s < kTrainSteps; ++s) EXPECT_NEAR(l0[size_t(s)], ref[size_t(s)], 0.05 * ref.front()) << "step " << s;
  std::printf("fp8 rowwise: loss %.5f -> %.5f (bf16 %.5f -> %.5f)\n", l0.front(), l0.back(), ref.front(), ref.back());
  EXPECT_LT(l0.back(), 0.8 * l0.front());
}

TEST(CudaModelFp8Rowwise, GraphedAndRecomputedStepsGiveTheEagerBits) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config();
  for (bool pure : {false, true}) {
    SCOPED_TRACE(pure ? "bf16-pure-fp8 rowwise" : "fp8 rowwise");
    ModelOptions o = fp8_options(Fp8Format::e5m2, Fp8Recipe::rowwise);
    o.bf16_pure = pure;
    expect_graphed_and_recomputed_steps_give_the_eager_bits(c, o);
  }
}

TEST(CudaModelFp8Rowwise, CheckpointResumeIsBitExact) {
  SKIP_WITHOUT_GPU();
  TrainConfig t;
  t.model = fp8_config();
  t.device = Device::cuda;
  t.precision = DType::bf16;
  t.options.fp8 = true;
  t.options.fp8_recipe = Fp8Recipe::rowwise;
  flashlm::testing::expect_resume_is_bit_exact(t, "fp8-rowwise");
}
#endif
