// CPU LM: sizes, layout, and the properties that need no PyTorch (the PyTorch comparison is
// tests/python/test_lm_vs_torch.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "flashlm/ddp_model.h"
#include "flashlm/error.h"
#include "flashlm/model.h"
#include "model/activations.h"
#include "optim/optimizer.h"
#include "model/random_tokens.h"

using namespace flashlm;

TEST(ModelConfig, NamedSizesHaveTheSpecParameterCounts) {
  // SPEC §1's table (vocab 10000), in millions.
  const std::pair<const char*, double> sizes[] = {{"small", 128.6}, {"medium", 423.2}, {"large", 969.4},
                                                  {"xl", 1998.2},  {"2.7B", 3406.8}};
  for (auto [name, millions] : sizes) {
    EXPECT_NEAR(double(ModelConfig::named(name).parameter_count()) / 1e6, millions, 0.05) << name;
  }
  EXPECT_THROW(ModelConfig::named("huge"), Error);
}

TEST(ModelConfig, BadConfigsAreErrors) {
  ModelConfig c = ModelConfig::named("tiny");
  c.heads = 3;
  EXPECT_THROW(c.validate(), Error);
  c = ModelConfig::named("tiny");
  c.d_model = 36;
  c.heads = 12;  // head_dim 3: odd, no RoPE pairs
  EXPECT_THROW(c.validate(), Error);
  EXPECT_THROW(CpuModel(ModelConfig::named("tiny", 16), 2, 17), Error);  // seq > context
}

TEST(ModelConfig, SizesWhoseParameterCountOverflowsAreErrors) {
  for (auto set : {+[](ModelConfig& c) { c.d_ff = INT64_MAX; }, +[](ModelConfig& c) { c.d_model = -64; },
                   +[](ModelConfig& c) { c.layers = INT64_MAX; }, +[](ModelConfig& c) {
                     c.d_model = int64_t{1} << 30;
                     c.heads = 1;
                   }}) {
    ModelConfig c = ModelConfig::named("tiny");
    set(c);
    EXPECT_THROW(c.validate(), Error);
    EXPECT_THROW(CpuModel(c, 1, 1), Error);
  }
  ModelConfig c = ModelConfig::named("tiny", 64, 256);
  EXPECT_THROW(CpuModel(c, int64_t{1} << 62, 64), Error);  // the activation plan overflows
}

TEST(ModelConfig, CosineScheduleWarmsUpThenDecays) {
  AdamWConfig c;
  c.lr_max = 1.0;
  c.lr_min = 0.1;
  c.warmup_steps = 10;
  c.cosine_steps = 110;
  EXPECT_DOUBLE_EQ(cosine_lr(c, 0), 0.0);
  EXPECT_DOUBLE_EQ(cosine_lr(c, 5), 0.5);
  EXPECT_DOUBLE_EQ(cosine_lr(c, 10), 1.0);
  EXPECT_NEAR(cosine_lr(c, 60), 0.55, 1e-12);
  EXPECT_DOUBLE_EQ(cosine_lr(c, 110), 0.1);
  EXPECT_DOUBLE_EQ(cosine_lr(c, 500), 0.1);
}

TEST(CpuModel, InitialLossIsNearLogVocabAndTrainingLowersIt) {
  const ModelConfig c = ModelConfig::named("tiny", 32, 64);
  CpuModel model(c, 4, 32);
  model.init_parameters(1);
  std::vector<int32_t> tokens(4 * 32), targets(4 * 32);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = int32_t((i * 7) % 64);
    targets[i] = int32_t((i * 7 + 7) % 64);  // a learnable successor rule
  }
  const double first = model.forward(tokens.data(), targets.data());
  EXPECT_NEAR(first, std::log(64.0), 0.1);
  AdamWConfig opt;
  double loss = first;
  for (int step = 0; step < 30; ++step) {
    model.zero_grad();
    loss = model.forward(tokens.data(), targets.data());
    model.backward();
    EXPECT_TRUE(std::isfinite(model.clip_gradients(1.0)));
    model.adamw_step(opt, 3e-3);
  }
  EXPECT_LT(loss, 0.5 * first);
}

TEST(CpuModel, OutOfRangeTokensAreErrors) {
  CpuModel model(ModelConfig::named("tiny", 8, 16), 1, 8);
  std::vector<int32_t> tokens(8, 3), targets(8, 3);
  tokens[5] = 16;
  try {
    model.forward(tokens.data(), targets.data());
    FAIL() << "expected flashlm::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tokens[5] = 16 outside [0, vocab = 16)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(model.backward(), Error);  // no forward yet
}

TEST(CpuModel, FlashAndNaiveAttentionGiveTheSameLossAndGradients) {
  const ModelConfig c = ModelConfig::named("tiny", 24, 50);
  CpuModel a(c, 2, 24, AttentionImpl::flash), b(c, 2, 24, AttentionImpl::naive);
  a.init_parameters(3);
  b.init_parameters(3);
  std::vector<int32_t> tokens(48), targets(48);
  for (size_t i = 0; i < 48; ++i) tokens[i] = int32_t((i * 13) % 50), targets[i] = int32_t((i * 5 + 1) % 50);
  EXPECT_NEAR(a.forward(tokens.data(), targets.data()), b.forward(tokens.data(), targets.data()), 1e-6);
  a.backward();
  b.backward();
  double max_diff = 0, max_ref = 0;
  for (int64_t i = 0; i < a.parameter_count(); ++i) {
    max_diff = std::max(max_diff, double(std::fabs(a.gradients()[i] - b.gradients()[i])));
    max_ref = std::max(max_ref, double(std::fabs(b.gradients()[i])));
  }
  EXPECT_LE(max_diff, 1e-5 * max_ref);
}

// The LM head and loss in chunks of tokens (ModelOptions::head_chunk) against the whole head in one chunk
// (the unfused path: all [n, vocab] logits, no recomputation), on random tokens, two micro-batches
// accumulated without zero_grad (the head's gradient adds across chunks and calls), a ragged last chunk
// (26 tokens in chunks of 7: 7 + 7 + 7 + 5), chunks of one token, and with recomputation. The per-row
// arithmetic is the same; what may differ is the GEMMs' rounding on fewer rows and the head gradient's sum
// over rows, taken chunk by chunk: loss within 1e-6 relative, every parameter's gradient within 1e-5 of
// its largest element, the logits within 1e-5 of the largest.
TEST(CpuModel, ChunkedLmHeadMatchesTheWholeHead) {
  const ModelConfig c = ModelConfig::named("tiny", 13, 301);
  const int64_t batch = 2, seq = 13, n = batch * seq;
  const std::vector<int32_t> tokens = random_tokens(2 * n, c.vocab, 7), targets = random_tokens(2 * n, c.vocab, 8);
  struct Run {
    double loss = 0;
    std::vector<float> logits, grads;
    int64_t chunk = 0;
  };
  const auto run = [&](int64_t head_chunk, const char* recompute) {
    ModelOptions o;
    o.head_chunk = head_chunk;
    o.recompute = RecomputePlan::parse(recompute);
    CpuModel m(c, batch, seq, o);
    m.init_parameters(11);
    Run r;
    r.chunk = m.head_chunk();
    r.logits.assign(size_t(n * c.vocab), std::nanf(""));
    m.zero_grad();
    for (int64_t micro = 0; micro < 2; ++micro) {
      r.loss += m.forward(tokens.data() + micro * n, targets.data() + micro * n);
      if (micro == 1) m.copy_logits_to(r.logits.data());
      m.backward();
    }
    r.grads.assign(m.gradients(), m.gradients() + m.parameter_count());
    return std::pair{r, m.layout()};
  };
  const auto [whole, layout] = run(n, "none");
  ASSERT_EQ(whole.chunk, n);
  EXPECT_EQ(run(0, "none").first.chunk, n) << "automatic: every token of a small batch in one chunk";
  EXPECT_EQ(run(1000, "none").first.chunk, n) << "a chunk larger than the batch is the batch";
  for (const auto& [chunk, recompute] : {std::pair{int64_t{7}, "none"}, std::pair{int64_t{1}, "none"},
                                         std::pair{int64_t{25}, "none"}, std::pair{int64_t{7}, "blocks:1"}}) {
    SCOPED_TRACE(std::string("head_chunk ") + std::to_string(chunk) + ", recompute " + recompute);
    const Run got = run(chunk, recompute).first;
    EXPECT_EQ(got.chunk, chunk);
    EXPECT_NEAR(got.loss, whole.loss, 1e-6 * whole.loss);
    float logit_ref = 0, logit_diff = 0;
    for (size_t i = 0; i < got.logits.size(); ++i) {
      logit_ref = std::max(logit_ref, std::fabs(whole.logits[i]));
      logit_diff = std::max(logit_diff, std::fabs(got.logits[i] - whole.logits[i]));  // NaN: never written
      ASSERT_FALSE(std::isnan(got.logits[i])) << "logit " << i;
    }
    EXPECT_LE(logit_diff, 1e-5f * logit_ref);
    for (const ParameterInfo& p : layout) {
      double diff = 0, ref = 0;
      for (int64_t i = p.offset; i < p.offset + p.numel(); ++i) {
        diff = std::max(diff, double(std::fabs(got.grads[size_t(i)] - whole.grads[size_t(i)])));
        ref = std::max(ref, double(std::fabs(whole.grads[size_t(i)])));
      }
      EXPECT_GT(ref, 0) << p.name;
      EXPECT_LE(diff, 1e-5 * ref) << p.name;
    }
  }
}

// With a chunk smaller than the batch the model holds one chunk's logits, not [n, vocab]: its activation
// bytes (and the memory plan's) shrink by the logits of the other tokens.
TEST(CpuModel, ChunkedLmHeadHoldsOneChunkOfLogits) {
  const ModelConfig c = ModelConfig::named("tiny", 16, 1000);
  const int64_t batch = 4, seq = 16, n = batch * seq;
  ModelOptions whole, chunked;
  whole.head_chunk = n;
  chunked.head_chunk = 8;
  const CpuModel a(c, batch, seq, whole), b(c, batch, seq, chunked);
  EXPECT_EQ(int64_t(a.activation_bytes()) - int64_t(b.activation_bytes()), (n - 8) * c.vocab * 4);
  const auto logits_item = [&](const ModelOptions& o) {
    for (const MemoryPlan::Item& item : plan_model_memory(c, batch, seq, Device::cpu, DType::f32, o).items) {
      if (item.what.find("logits") != std::string::npos) return std::pair{item.what, item.bytes};
    }
    return std::pair{std::string(), int64_t{0}};
  };
  EXPECT_EQ(logits_item(chunked).second, 8 * c.vocab * 4) << logits_item(chunked).first;
  EXPECT_NE(logits_item(chunked).first.find("8 tokens at a time"), std::string::npos) << logits_item(chunked).first;
  EXPECT_EQ(logits_item(whole).second, n * c.vocab * 4);
  // The automatic chunk keeps near 1 GiB of fp32 logits: the leaderboard vocabulary at 2048 tokens is chunked.
  const ModelConfig big = ModelConfig::named("tiny", 2048, 151936);
  ModelOptions automatic;
  EXPECT_EQ(logits_item(automatic).second, n * c.vocab * 4) << "a small batch: one chunk";
  const MemoryPlan plan = plan_model_memory(big, 1, 2048, Device::cpu, DType::f32, automatic);
  int64_t logits_bytes = 0;
  for (const MemoryPlan::Item& item : plan.items) {
    if (item.what.find("logits") != std::string::npos) logits_bytes = item.bytes;
  }
  EXPECT_LE(logits_bytes, int64_t{1} << 30);
  EXPECT_EQ(logits_bytes % (128 * 151936 * 4), 0) << "a multiple of 128 tokens";
}

TEST(CpuModel, LogitsAreThereOnlyBetweenForwardAndBackward) {
  const ModelConfig c = ModelConfig::named("tiny", 8, 16);
  ModelOptions o;
  o.head_chunk = 3;
  CpuModel model(c, 1, 8, o);
  model.init_parameters(2);
  std::vector<float> logits(8 * 16);
  EXPECT_THROW(model.copy_logits_to(logits.data()), Error);
  const std::vector<int32_t> tokens = random_tokens(8, 16, 1), targets = random_tokens(8, 16, 2);
  model.forward(tokens.data(), targets.data());
  model.copy_logits_to(logits.data());
  model.backward();
  EXPECT_THROW(model.copy_logits_to(logits.data()), Error);
}

// bf16 moments in the model: its step is cpu::adamw_step_bf16_moments on the flat buffers (the moments it
// saves are bf16 values widened, and bit-equal to the kernel's on the same gradients), load_state takes only
// bf16 values back, and bf16-pure with another state than fp32 is refused by name.
TEST(CpuModel, Bf16MomentsAreTheKernelsAndLoadOnlyBf16Values) {
  const ModelConfig c = ModelConfig::named("tiny", 8, 16);
  ModelOptions o;
  o.optimizer_state = OptimizerState::bf16_sr;
  o.moment_rounding_seed = 5;
  CpuModel model(c, 1, 8, o);
  EXPECT_EQ(model.optimizer_state(), OptimizerState::bf16_sr);
  model.init_parameters(3);
  const auto n = size_t(model.parameter_count());
  std::vector<int32_t> tokens(8), targets(8);
  for (size_t i = 0; i < 8; ++i) tokens[i] = int32_t(i * 7 % c.vocab), targets[i] = int32_t((i * 7 + 1) % c.vocab);
  AdamWConfig opt;
  std::vector<float> w(n), mf(n), vf(n);
  for (int step = 1; step <= 2; ++step) {
    model.zero_grad();
    model.forward(tokens.data(), targets.data());
    model.backward();
    model.save_state(w, mf, vf);
    std::vector<bf16_t> m(n), v(n);
    for (size_t i = 0; i < n; ++i) m[i] = bf16_t(mf[i]), v[i] = bf16_t(vf[i]);
    const std::vector<float> g(model.gradients(), model.gradients() + n);
    cpu::adamw_step_bf16_moments(w.data(), g.data(), m.data(), v.data(), int64_t(n), 1e-3, opt.beta1, opt.beta2,
                                 opt.eps, opt.weight_decay, step, MomentRounding{true, 5});
    model.adamw_step(opt, 1e-3);
    std::vector<float> w2(n), m2(n), v2(n);
    model.save_state(w2, m2, v2);
    EXPECT_EQ(w2, w) << "step " << step;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(m2[i], float(m[i])) << "m[" << i << "], step " << step;
      ASSERT_EQ(v2[i], float(v[i])) << "v[" << i << "], step " << step;
    }
    mf = m2;
    vf = v2;
  }
  std::vector<float> not_bf16 = mf;
  not_bf16[3] = 1.0f + 1.0f / 1024;  // between two bf16 values
  try {
    model.load_state(w, not_bf16, vf, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CpuModel::load_state: m[3] = 1.0009766 is not a bf16 value"),
              std::string::npos)
        << e.what();
  }
  ModelOptions pure;
  pure.bf16_pure = true;
  pure.optimizer_state = OptimizerState::bf16;
  try {
    pure.check_optimizer_state();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'bf16' is for fp32 master weights; bf16-pure keeps its moments in bf16"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(parse_optimizer_state("bf16-sr"), OptimizerState::bf16_sr);
  EXPECT_THROW(parse_optimizer_state("bf8"), Error);
}

// --grad-dtype (the bf16-gradient experiment): where bf16 applies (CUDA, bf16 or fp8 over fp32 masters, the model's
// own storage) and the error that says why everywhere else; the memory plan counts 2 bytes a gradient and the
// fp32 accumulator; the CPU model and data parallelism refuse it.
TEST(ModelOptions, Bf16GradientsApplyToCudaBf16AndFp8Only) {
  const auto message = [](const ModelOptions& o, DType precision, Device device) -> std::string {
    try {
      o.check_grad_dtype(precision, device);
      return "";
    } catch (const InvalidArgument& e) {
      return e.what();
    }
  };
  ModelOptions o;
  o.grad_dtype = DType::bf16;
  EXPECT_EQ(message(o, DType::bf16, Device::cuda), "");
  ModelOptions fp8 = o;
  fp8.fp8 = true;
  EXPECT_EQ(message(fp8, DType::bf16, Device::cuda), "");
  EXPECT_NE(message(o, DType::f32, Device::cpu).find("--grad-dtype bf16 needs --device cuda"), std::string::npos);
  EXPECT_NE(message(o, DType::f16, Device::cuda).find("needs --precision bf16 or fp8 (bf16 operands for the "
                                                      "weight-gradient GEMMs); not fp16"),
            std::string::npos);
  EXPECT_NE(message(o, DType::f32, Device::cuda).find("not fp32"), std::string::npos);
  ModelOptions pure = o;
  pure.bf16_pure = true;
  EXPECT_NE(message(pure, DType::bf16, Device::cuda).find("bf16-pure keeps bf16 gradients already"),
            std::string::npos);
  ModelOptions sharded = o;
  sharded.external_parameters = true;
  EXPECT_NE(message(sharded, DType::bf16, Device::cuda).find("not for FSDP's sharded storage"), std::string::npos);
  ModelOptions bad;
  bad.grad_dtype = DType::f16;
  EXPECT_NE(message(bad, DType::bf16, Device::cuda).find("gradient dtype: fp16: expected fp32 or bf16"),
            std::string::npos);
  EXPECT_EQ(message(ModelOptions{}, DType::f16, Device::cpu), "");  // fp32 gradients: every run

  EXPECT_EQ(parse_grad_dtype("bf16"), DType::bf16);
  EXPECT_EQ(parse_grad_dtype("fp32"), DType::f32);
  EXPECT_THROW(parse_grad_dtype("fp16"), InvalidArgument);

  const ModelConfig c = ModelConfig::named("small", 512);
  const auto item_bytes = [](const MemoryPlan& p, const std::string& what) -> int64_t {
    for (const MemoryPlan::Item& i : p.items) {
      if (i.what == what) return i.bytes;
    }
    return -1;
  };
  const MemoryPlan p32 = plan_model_memory(c, 4, 512, Device::cuda, DType::bf16, ModelOptions{});
  const MemoryPlan p16 = plan_model_memory(c, 4, 512, Device::cuda, DType::bf16, o);
  EXPECT_EQ(item_bytes(p32, "gradients (fp32)"), 4 * c.parameter_count());
  EXPECT_EQ(item_bytes(p16, "gradients (bf16)"), 2 * c.parameter_count());
  EXPECT_EQ(item_bytes(p16, "fp32 gradient accumulator (embedding, LM head, RMSNorm gains)"),
            4 * gradient_staging_elements(c));
  EXPECT_THROW(plan_model_memory(c, 4, 512, Device::cpu, DType::f32, o), InvalidArgument);

  EXPECT_THROW(CpuModel(ModelConfig::named("tiny", 16), 1, 16, o), InvalidArgument);
  EXPECT_THROW(check_data_parallel_grad_dtype(DType::bf16), InvalidArgument);
  EXPECT_NO_THROW(check_data_parallel_grad_dtype(DType::f32));
}
