// The CUDA LM against the CPU LM (fp32 reference): logits, loss and gradients per precision, loss
// scaling, reproducibility and a short training run. Skips without a GPU.
#include <gtest/gtest.h>

#include "gpu_testing.h"
#include "model/random_tokens.h"
#include "model/resume_testing.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/array_ops.h"
#include "flashlm/device.h"
#include "flashlm/model.h"
#include "flashlm/train.h"

using namespace flashlm;

#ifndef FLASHLM_WITH_CUDA
TEST(CudaModel, NeedsACudaBuild) { GTEST_SKIP() << "flashlm was built without CUDA: CudaModel does not exist"; }
#else
namespace {

ModelConfig small_config() {
  ModelConfig c = ModelConfig::named("tiny", 64, 128);  // d_model 32, d_ff 64, 2 layers, 4 heads of 8
  c.d_model = 64;  // head_dim 16: the smallest the tensor-core attention takes
  c.d_ff = 128;
  return c;
}

// max |a - b| / max |b|.
double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::isnan(a[i]) ? INFINITY : std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return num / den;
}

class CudaModelVsCpu : public ::testing::TestWithParam<DType> {};

TEST_P(CudaModelVsCpu, LossLogitsAndGradientsMatchTheCpuModel) {
  SKIP_WITHOUT_GPU();
  const DType precision = GetParam();
  const ModelConfig c = small_config();
  const int64_t batch = 2, seq = 64, n = batch * seq;
  CpuModel cpu(c, batch, seq);
  CudaModel gpu(c, batch, seq, precision);
  cpu.init_parameters(5);
  gpu.init_parameters(5);
  const Batch b = make_batch(n, c.vocab, 1);

  const double cpu_loss = cpu.forward(b.tokens.data(), b.targets.data());
  const double gpu_loss = gpu.forward(b.tokens.data(), b.targets.data());
  std::vector<float> cpu_logits(size_t(n * c.vocab)), gpu_logits(size_t(n * c.vocab));
  cpu.copy_logits_to(cpu_logits.data());
  gpu.copy_logits_to(gpu_logits.data());
  cpu.zero_grad();
  cpu.backward();
  gpu.zero_grad();
  gpu.backward();
  ASSERT_TRUE(gpu.unscale_gradients());
  std::vector<float> cpu_grads(cpu.gradients(), cpu.gradients() + cpu.parameter_count());
  std::vector<float> gpu_grads(size_t(gpu.parameter_count()));
  gpu.copy_gradients_to(gpu_grads.data());

  // fp32: GEMMs without TF32 and fp32 attention, so only summation order differs. bf16/fp16: activations
  // rounded to 8 or 11 bits at every layer.
  const double tol = precision == DType::f32 ? 1e-4 : precision == DType::f16 ? 2e-2 : 5e-2;
  EXPECT_NEAR(gpu_loss, cpu_loss, tol * cpu_loss);
  EXPECT_LE(rel_error(gpu_logits, cpu_logits), tol);
  for (const auto& p : cpu.layout()) {
    const std::vector<float> a(gpu_grads.begin() + p.offset, gpu_grads.begin() + p.offset + p.numel());
    const std::vector<float> e(cpu_grads.begin() + p.offset, cpu_grads.begin() + p.offset + p.numel());
    EXPECT_LE(rel_error(a, e), 2 * tol) << p.name << " in " << dtype_name(precision);
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, CudaModelVsCpu, ::testing::Values(DType::f32, DType::bf16, DType::f16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(CudaModel, TrainingIsReproducibleAndLowersTheLossInEveryPrecision) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = small_config();
  const Batch b = make_batch(2 * 64, c.vocab, 2);
  AdamWConfig opt;
  for (DType precision : {DType::f32, DType::bf16, DType::f16}) {
    std::vector<float> final_params[2];
    double first = 0, last = 0;
    for (int run = 0; run < 2; ++run) {
      CudaModel m(c, 2, 64, precision);
      m.init_parameters(3);
      for (int step = 0; step < 25; ++step) {
        m.zero_grad();
        const double loss = m.forward(b.tokens.data(), b.targets.data());
        if (step == 0) first = loss;
        last = loss;
        m.backward();
        if (!m.unscale_gradients()) continue;  // fp16 overflow: skipped, scale halved
        m.clip_gradients(1.0);
        m.adamw_step(opt, 3e-3);
      }
      final_params[run].resize(size_t(m.parameter_count()));
      m.copy_parameters_to(final_params[run].data());
    }
    EXPECT_EQ(final_params[0], final_params[1]) << dtype_name(precision) << ": two runs differ";
    EXPECT_LT(last, 0.8 * first) << dtype_name(precision);
  }
}

// zero_grad() is deferred: the next backward writes each gradient over the stale arrays. That must give
// the bits of the same backward accumulated onto gradients zeroed first (gradients() zeroes them), in
// every precision and bf16-pure, after an earlier step left large stale values there.
TEST(CudaModel, DeferredZeroGradGivesTheBitsOfAccumulatingOntoZeros) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = small_config();
  const Batch b1 = make_batch(2 * 64, c.vocab, 3), b2 = make_batch(2 * 64, c.vocab, 4);
  for (int variant = 0; variant < 4; ++variant) {
    const DType precision = variant == 0 ? DType::f32 : variant == 2 ? DType::f16 : DType::bf16;
    ModelOptions options;
    options.bf16_pure = variant == 3;
    const std::string name = variant == 3 ? "bf16-pure" : std::string(dtype_name(precision));
    std::vector<float> grads[2];
    for (int run = 0; run < 2; ++run) {
      CudaModel m(c, 2, 64, precision, options);
      m.init_parameters(9);
      m.zero_grad();  // stale values: another batch's gradients, twice over
      m.forward(b2.tokens.data(), b2.targets.data());
      m.backward();
      m.forward(b2.tokens.data(), b2.targets.data());
      m.backward();
      m.zero_grad();
      if (run == 1 && !options.bf16_pure) m.gradients();  // zeroes them now: the backward then accumulates
      if (run == 1 && options.bf16_pure) {               // no fp32 pointer: a copy zeroes them as well
        std::vector<float> zeros(size_t(m.parameter_count()));
        m.copy_gradients_to(zeros.data());
        for (float z : zeros) ASSERT_EQ(z, 0.0f) << name << ": zero_grad then a read did not give zeros";
      }
      m.forward(b1.tokens.data(), b1.targets.data());
      m.backward();
      grads[run].resize(size_t(m.parameter_count()));
      m.copy_gradients_to(grads[run].data());
    }
    EXPECT_EQ(grads[0], grads[1]) << name << ": the overwriting backward differs from accumulating onto zeros";
  }
}

// Two backwards after one zero_grad() add up (the second accumulates onto the first's overwritten
// gradients), as in the CPU model.
TEST(CudaModel, TwoBackwardsAccumulateAsTheCpuModel) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = small_config();
  const int64_t batch = 2, seq = 64;
  const Batch b1 = make_batch(batch * seq, c.vocab, 5), b2 = make_batch(batch * seq, c.vocab, 6);
  for (DType precision : {DType::f32, DType::bf16}) {
    CpuModel cpu(c, batch, seq);
    CudaModel gpu(c, batch, seq, precision);
    cpu.init_parameters(11);
    gpu.init_parameters(11);
    cpu.zero_grad();
    gpu.zero_grad();
    for (const Batch* b : {&b1, &b2}) {
      cpu.forward(b->tokens.data(), b->targets.data());
      cpu.backward();
      gpu.forward(b->tokens.data(), b->targets.data());
      gpu.backward();
    }
    std::vector<float> cpu_grads(cpu.gradients(), cpu.gradients() + cpu.parameter_count());
    std::vector<float> gpu_grads(size_t(gpu.parameter_count()));
    gpu.copy_gradients_to(gpu_grads.data());
    const double tol = precision == DType::f32 ? 1e-4 : 5e-2;
    for (const auto& p : cpu.layout()) {
      const std::vector<float> a(gpu_grads.begin() + p.offset, gpu_grads.begin() + p.offset + p.numel());
      const std::vector<float> e(cpu_grads.begin() + p.offset, cpu_grads.begin() + p.offset + p.numel());
      EXPECT_LE(rel_error(a, e), 2 * tol) << p.name << " in " << dtype_name(precision);
    }
    EXPECT_GT(gpu.gradient_norm(), 0.0);
    gpu.zero_grad();
    EXPECT_EQ(gpu.gradient_norm(), 0.0) << "zero_grad then the norm: the deferred zeroing was not applied";
  }
}

// The norm the backward computes beside itself, parameter by parameter, is the norm of the gradients it
// leaves (fp64 sums in another order: equal to ~1e-12), and anything that changes the gradients after it
// (a clip applied, gradients() handed out for writing) makes gradient_norm() read them again.
TEST(CudaModel, OverlappedGradientNormIsTheNormOfTheGradients) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = small_config();
  const Batch b = make_batch(2 * 64, c.vocab, 7);
  for (int variant = 0; variant < 3; ++variant) {
    ModelOptions options;
    options.bf16_pure = variant == 2;
    options.overlap_grad_norm = true;  // not the default
    const DType precision = variant == 0 ? DType::f32 : DType::bf16;
    const std::string name = variant == 2 ? "bf16-pure" : std::string(dtype_name(precision));
    CudaModel m(c, 2, 64, precision, options);
    m.init_parameters(13);
    m.zero_grad();
    m.forward(b.tokens.data(), b.targets.data());
    m.backward();
    const double norm = m.gradient_norm();
    std::vector<float> g(size_t(m.parameter_count()));
    m.copy_gradients_to(g.data());
    double ss = 0;
    for (float v : g) ss += double(v) * double(v);
    ASSERT_GT(ss, 0.0) << name;
    EXPECT_NEAR(norm, std::sqrt(ss), 1e-12 * std::sqrt(ss)) << name;
    const double clipped = m.clip_gradients(norm / 2);
    EXPECT_EQ(clipped, norm) << name;
    // clip_gradients scales by max / (norm + 1e-6), rounded to fp32 (and, bf16-pure, each gradient to bf16).
    const double after_clip = norm * (norm / 2) / (norm + 1e-6);
    const double tol = options.bf16_pure ? 1e-3 : 1e-6;
    EXPECT_NEAR(m.gradient_norm(), after_clip, tol * norm) << name << ": the norm after clipping";
    if (!options.bf16_pure) {
      float* grads = m.gradients();  // written by the caller: 3 x the gradients
      gpu::scale_inplace(grads, m.parameter_count(), 3.0f, m.stream());
      EXPECT_NEAR(m.gradient_norm(), 3 * after_clip, tol * norm) << name << ": the norm after gradients() was written";
    }
  }
}

// train_step as one CUDA graph (captured at the second step, replayed after) gives the bits of the eager
// step: the losses, norms, parameters and gradients, with a new batch, lr and clipping bound every step
// (the graph must read them, not replay the first step's), clipping on every other step; with bf16 moments
// (4: nearest, 5: stochastic, whose rounding key the graph must read each step too) the moments as well.
TEST(CudaModel, GraphedStepsGiveTheBitsOfEagerSteps) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = small_config();
  for (int variant = 0; variant < 6; ++variant) {
    ModelOptions options;
    options.bf16_pure = variant == 2;
    options.overlap_grad_norm = variant != 3;  // 3: the norm as one pass after the backward
    options.optimizer_state = variant == 4 ? OptimizerState::bf16 : variant == 5 ? OptimizerState::bf16_sr
                                                                                 : OptimizerState::fp32;
    options.moment_rounding_seed = 99;
    const DType precision = variant == 0 ? DType::f32 : DType::bf16;
    const std::string name = std::string(variant == 2 ? "bf16-pure" : dtype_name(precision)) +
                             (variant == 3 ? ", serial norm" : "") +
                             (variant >= 4 ? ", " + std::string(optimizer_state_name(options.optimizer_state)) + " moments"
                                           : std::string());
    std::vector<StepResult> results[2];
    std::vector<float> params[2], grads[2], moments[2];
    std::string status[2];
    for (int graphed = 0; graphed < 2; ++graphed) {
      options.cuda_graph = graphed == 1;
      CudaModel m(c, 2, 64, precision, options);
      m.init_parameters(17);
      for (int step = 0; step < 7; ++step) {  // the last one clipped: its factor stays pending for the reads
        const Batch b = make_batch(2 * 64, c.vocab, 20 + step);
        AdamWConfig opt;
        opt.max_grad_norm = step % 2 == 0 ? 1e-3 : 1e9;  // clipped, then not
        results[graphed].push_back(m.train_step(b.tokens.data(), b.targets.data(), opt, 1e-3 * (1 + step)));
        if (graphed == 1 && step == 0) {
          EXPECT_EQ(m.cuda_graph_status(), "on (this step was the eager warm-up)") << name;
        }
      }
      status[graphed] = m.cuda_graph_status();
      EXPECT_EQ(m.optimizer_steps(), 7) << name;
      params[graphed].resize(size_t(m.parameter_count()));
      grads[graphed].resize(size_t(m.parameter_count()));
      m.copy_parameters_to(params[graphed].data());
      m.copy_gradients_to(grads[graphed].data());  // as clip_gradients left them: clipped or not
      const auto count = size_t(m.parameter_count());
      std::vector<float> saved(count), mo(count), vo(count);
      m.save_state(saved, mo, vo);
      moments[graphed] = mo;
      moments[graphed].insert(moments[graphed].end(), vo.begin(), vo.end());
    }
    EXPECT_EQ(status[0], "off: --cuda-graph off") << name;
    EXPECT_EQ(status[1], "on") << name;
    for (size_t i = 0; i < results[0].size(); ++i) {
      EXPECT_EQ(results[1][i].loss, results[0][i].loss) << name << ", step " << i;
      EXPECT_EQ(results[1][i].grad_norm, results[0][i].grad_norm) << name << ", step " << i;
      EXPECT_TRUE(results[1][i].updated) << name;
      if (i > 0) {
        EXPECT_NE(results[1][i].loss, results[1][i - 1].loss) << name << ": the same loss twice";
      }
    }
    EXPECT_GT(results[0][2].grad_norm, 1e-3) << name << ": step 2 was meant to be clipped";
    EXPECT_TRUE(params[1] == params[0]) << name << ": the graphed steps' parameters differ from the eager ones";
    EXPECT_TRUE(grads[1] == grads[0]) << name << ": the graphed steps' gradients differ from the eager ones";
    EXPECT_TRUE(moments[1] == moments[0]) << name << ": the graphed steps' moments differ from the eager ones";
  }
}

// Where a step cannot be captured it runs eagerly and says why: fp16 (the loss scale's overflow check on
// the host), a gradient-ready hook (data parallelism).
TEST(CudaModel, UncapturableStepsRunEagerlyAndSayWhy) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = small_config();
  const Batch b = make_batch(2 * 64, c.vocab, 8);
  AdamWConfig opt;
  {
    CudaModel m(c, 2, 64, DType::f16);
    m.init_parameters(5);
    for (int step = 0; step < 3; ++step) m.train_step(b.tokens.data(), b.targets.data(), opt, 1e-3);
    EXPECT_EQ(m.cuda_graph_status().rfind("off: fp16", 0), 0u) << m.cuda_graph_status();
  }
  CudaModel m(c, 2, 64, DType::bf16);
  m.init_parameters(5);
  int ready = 0;
  m.set_gradient_ready_hook([&](int64_t, int64_t) { ++ready; });
  for (int step = 0; step < 3; ++step) m.train_step(b.tokens.data(), b.targets.data(), opt, 1e-3);
  EXPECT_EQ(m.cuda_graph_status().rfind("off: data-parallel hooks", 0), 0u) << m.cuda_graph_status();
  EXPECT_EQ(ready, 3 * int(m.layout().size())) << "the hook must see every gradient of every step";
  EXPECT_EQ(m.optimizer_steps(), 3);
}

TEST(CudaModel, Fp16LossScaleStartsHighAndOtherPrecisionsUseOne) {
  SKIP_WITHOUT_GPU();
  EXPECT_EQ(CudaModel(small_config(), 1, 16, DType::f16).loss_scale(), 65536.0);
  EXPECT_EQ(CudaModel(small_config(), 1, 16, DType::bf16).loss_scale(), 1.0);
}

// The loss scale of every step of a metrics log (JSON lines with a "loss_scale" field).
std::vector<double> logged_loss_scales(const std::string& path) {
  std::vector<double> scales;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find("\"loss_scale\":");
    if (at != std::string::npos && line.find("\"val_loss\"") == std::string::npos)
      scales.push_back(std::strtod(line.c_str() + at + 13, nullptr));
  }
  return scales;
}

// fp16 on resume: the checkpoint carries the dynamic loss scale and its count of good steps, so 10 steps +
// resume + 10 steps equal 20 steps bit for bit even after overflows changed the scale (before, a resumed
// run restarted at 65536 and skipped steps the uninterrupted run took).
TEST(CudaModel, Fp16TrainingResumesTheLossScaleBitExactly) {
  SKIP_WITHOUT_GPU();
  const auto dir = std::filesystem::path(::testing::TempDir());
  auto run = [&](int64_t steps, const std::string& name, bool resume) {
    TrainConfig c;
    c.model = small_config();
    c.device = Device::cuda;
    c.precision = DType::f16;
    c.batch = 4;
    c.seq = 64;
    c.steps = steps;
    c.optimizer.lr_max = 3e-3;
    c.optimizer.lr_min = 3e-4;
    c.optimizer.warmup_steps = 2;
    c.optimizer.cosine_steps = 20;
    c.eval_every = 0;
    c.log_every = 0;
    c.loss_scale_init = 16777216.0;  // 2^24: the first steps overflow and halve it, so it moves before step 10
    c.checkpoint = (dir / (name + ".ckpt")).string();
    c.metrics_log = (dir / (name + (resume ? "-resumed" : "") + ".jsonl")).string();
    c.resume = resume;
    return train(c);
  };
  run(20, "fp16-full", false);
  run(10, "fp16-half", false);
  run(20, "fp16-half", true);
  const std::vector<double> full = logged_loss_scales((dir / "fp16-full.jsonl").string());
  const std::vector<double> first = logged_loss_scales((dir / "fp16-half.jsonl").string());
  const std::vector<double> second = logged_loss_scales((dir / "fp16-half-resumed.jsonl").string());
  ASSERT_EQ(full.size(), 20u);
  ASSERT_EQ(first.size(), 10u);
  ASSERT_EQ(second.size(), 10u);
  // The test means something only if the scale moved before the checkpoint.
  ASSERT_LT(first.back(), 16777216.0) << "no fp16 overflow in the first 10 steps";
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(second[i], full[10 + i]) << "loss scale of step " << 10 + i;
  EXPECT_EQ(checkpoint_parameters((dir / "fp16-full.ckpt").string()),
            checkpoint_parameters((dir / "fp16-half.ckpt").string()))
      << "parameters differ after resume";
}

// bf16 moments (nearest and stochastic) on resume: 6 steps + resume + 6 steps give the parameters of 12
// steps, bit for bit (the checkpoint holds the moments widened exactly; the stochastic rounding needs only
// the seed and the step count).
TEST(CudaModel, Bf16MomentsResumeBitExactly) {
  SKIP_WITHOUT_GPU();
  for (const OptimizerState state : {OptimizerState::bf16, OptimizerState::bf16_sr}) {
    TrainConfig c;
    c.model = small_config();
    c.device = Device::cuda;
    c.precision = DType::bf16;
    c.options.optimizer_state = state;
    flashlm::testing::expect_resume_is_bit_exact(c, "cuda-moments-" + std::string(optimizer_state_name(state)));
  }
}

TEST(CudaModel, RestoreLossScaleChecksItsArguments) {
  SKIP_WITHOUT_GPU();
  CudaModel f16(small_config(), 1, 16, DType::f16);
  f16.restore_loss_scale(1024.0, 7);
  EXPECT_EQ(f16.loss_scale(), 1024.0);
  EXPECT_EQ(f16.loss_scale_good_steps(), 7);
  EXPECT_THROW(f16.restore_loss_scale(0.0, 0), Error);
  EXPECT_THROW(f16.restore_loss_scale(std::nan(""), 0), Error);
  EXPECT_THROW(f16.restore_loss_scale(1024.0, LanguageModel::kLossScaleGrowthInterval), Error);
  CudaModel bf16(small_config(), 1, 16, DType::bf16);
  bf16.restore_loss_scale(1.0, 0);
  EXPECT_THROW(bf16.restore_loss_scale(1024.0, 0), Error);
}

TEST(CudaModel, BadConfigurationsAreErrors) {
  SKIP_WITHOUT_GPU();
  ModelConfig c = small_config();
  EXPECT_THROW(CudaModel(c, 1, 16, DType::f64), Error);
  c.vocab = 100;  // not a multiple of 8
  EXPECT_THROW(CudaModel(c, 1, 16, DType::bf16), Error);
}

}  // namespace
#endif  // FLASHLM_WITH_CUDA
