// The KV-cache decoder against the training forward (CpuModel's logits over the whole prefix, at every
// position), and the sampler: greedy, top-k, determinism per seed, frequencies, the window sliding past the
// context, bad options.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "flashlm/error.h"
#include "flashlm/generate.h"
#include "flashlm/model.h"
#include "gpu_testing.h"
#include "model/decoder_testing.h"
#include "model/random_tokens.h"

using namespace flashlm;

namespace {

// The logits [tokens, vocab] of a model's forward over `tokens` tokens (CpuModel::copy_logits_to).
std::vector<float> logits_of(const CpuModel& model, int64_t tokens) {
  std::vector<float> logits(size_t(tokens * model.config().vocab));
  model.copy_logits_to(logits.data());
  return logits;
}


}  // namespace

TEST(KvCacheDecoder, LogitsMatchTheFullForwardAtEveryPosition) {
  const ModelConfig c = ragged_decoder_config();
  const std::vector<float> params = decoder_test_parameters(c, 7, 10.0f);
  const int64_t n = c.context;  // the whole context: the cache ends full
  const std::vector<int32_t> tokens = random_tokens(n, c.vocab, 11), targets = random_tokens(n, c.vocab, 12);
  CpuModel full(c, 1, n);
  std::copy(params.begin(), params.end(), full.parameters());
  full.forward(tokens.data(), targets.data());
  const std::vector<float> full_logits = logits_of(full, n);

  KvCacheDecoder decoder(c, params);
  double worst = 0, scale = 0;
  for (int64_t t = 0; t < n; ++t) {
    EXPECT_EQ(decoder.position(), t);
    const std::span<const float> got = decoder.step(tokens[size_t(t)]);
    ASSERT_EQ(int64_t(got.size()), c.vocab);
    const float* want = full_logits.data() + t * c.vocab;
    for (int64_t v = 0; v < c.vocab; ++v) {
      worst = std::max(worst, double(std::abs(got[size_t(v)] - want[v])));
      scale = std::max(scale, double(std::abs(want[v])));
    }
  }
  ASSERT_GT(scale, 0.1);  // logits that say something
  EXPECT_LT(worst / scale, 1e-5) << "max |decoder - forward| = " << worst << " at logit scale " << scale;
}

TEST(KvCacheDecoder, ResetForgetsTheCacheAndRepeatsBitForBit) {
  const ModelConfig c = ragged_decoder_config();
  KvCacheDecoder decoder(c, decoder_test_parameters(c, 3, 10.0f));
  const std::vector<int32_t> tokens = random_tokens(9, c.vocab, 5);
  std::vector<float> first;
  for (int32_t t : tokens) {
    const auto l = decoder.step(t);
    first.assign(l.begin(), l.end());
  }
  decoder.reset();
  std::span<const float> again;
  for (int32_t t : tokens) again = decoder.step(t);
  EXPECT_EQ(std::vector<float>(again.begin(), again.end()), first);
  // prefill feeds the same tokens, skipping the LM head of all but the last: the same cache, the same logits.
  decoder.reset();
  const std::span<const float> prefilled = decoder.prefill(tokens);
  EXPECT_EQ(decoder.position(), int64_t(tokens.size()));
  EXPECT_EQ(std::vector<float>(prefilled.begin(), prefilled.end()), first);
  const auto next = decoder.step(tokens[0]);
  const std::vector<float> after_prefill(next.begin(), next.end());
  decoder.reset();
  for (int32_t t : tokens) decoder.step(t);
  const auto stepped = decoder.step(tokens[0]);
  EXPECT_EQ(std::vector<float>(stepped.begin(), stepped.end()), after_prefill);
  EXPECT_THROW(decoder.prefill({}), Error);
}

TEST(KvCacheDecoder, BadInputsAreErrors) {
  const ModelConfig c = ragged_decoder_config();
  const std::vector<float> params = decoder_test_parameters(c, 1, 10.0f);
  EXPECT_THROW(KvCacheDecoder(c, std::span(params).first(params.size() - 1)), Error);
  if (cuda_device_count() == 0) {
    try {
      KvCacheDecoder on_gpu(c, params, Device::cuda);
      FAIL() << "a CUDA decoder without a GPU must be an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("device cuda: "), std::string::npos) << e.what();
    }
  }
  KvCacheDecoder decoder(c, params);
  EXPECT_THROW(decoder.step(-1), Error);
  EXPECT_THROW(decoder.step(int32_t(c.vocab)), Error);
  EXPECT_EQ(decoder.position(), 0);  // a refused token takes no place in the cache
  for (int64_t t = 0; t < c.context; ++t) decoder.step(0);
  try {
    decoder.step(0);
    FAIL() << "a full cache must be an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("context is 23"), std::string::npos) << e.what();
  }
}

TEST(Sampling, GreedyAndTopOneTakeTheLargestLogit) {
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 2.0f, 1.5f};
  SamplingOptions greedy;
  greedy.temperature = 0;
  SamplingOptions top1;
  top1.top_k = 1;
  for (uint64_t draw = 0; draw < 50; ++draw) {
    EXPECT_EQ(sample_token(logits, greedy, draw), 1);  // the lower index among equal logits
    EXPECT_EQ(sample_token(logits, top1, draw), 1);
  }
}

TEST(Sampling, TopKDrawsOnlyTheKLargestWithSoftmaxFrequencies) {
  const std::vector<float> logits = {0.3f, 1.0f, -2.0f, 0.0f, 0.7f, -0.5f};
  SamplingOptions o;
  o.top_k = 3;  // tokens 1, 4, 0
  o.temperature = 0.7;
  o.seed = 99;
  std::map<int32_t, int> counts;
  const int draws = 20000;
  for (int i = 0; i < draws; ++i) ++counts[sample_token(logits, o, uint64_t(i))];
  ASSERT_EQ(counts.size(), 3u);
  double total = 0;
  for (int32_t t : {1, 4, 0}) total += std::exp(logits[size_t(t)] / o.temperature);
  for (int32_t t : {1, 4, 0}) {
    const double expected = std::exp(logits[size_t(t)] / o.temperature) / total;
    // 20000 draws: a standard deviation below 0.0036 for every p.
    EXPECT_NEAR(double(counts[t]) / draws, expected, 0.015) << "token " << t;
  }
}

TEST(Sampling, DrawsArePureFunctionsOfSeedAndIndex) {
  const ModelConfig c = ragged_decoder_config();
  KvCacheDecoder decoder(c, decoder_test_parameters(c, 4, 10.0f));
  const std::vector<int32_t> prompt = {3, 1, 4};
  SamplingOptions o;
  o.seed = 5;
  o.temperature = 1.0;
  const auto a = generate_tokens(decoder, prompt, 15, o);
  const auto b = generate_tokens(decoder, prompt, 15, o);
  EXPECT_EQ(a, b);
  bool another_seed_differs = false;
  for (uint64_t s = 6; s < 10 && !another_seed_differs; ++s) {
    o.seed = s;
    another_seed_differs = generate_tokens(decoder, prompt, 15, o) != a;
  }
  EXPECT_TRUE(another_seed_differs);
  // The prompt and the new tokens together fill the context exactly.
  EXPECT_EQ(generate_tokens(decoder, prompt, c.context - 3, o).size(), size_t(c.context - 3));
}

TEST(Sampling, GreedyGenerationFollowsTheFullForward) {
  const ModelConfig c = ragged_decoder_config();
  const std::vector<float> params = decoder_test_parameters(c, 8, 10.0f);
  KvCacheDecoder decoder(c, params);
  const std::vector<int32_t> prompt = {5, 9};
  SamplingOptions greedy;
  greedy.temperature = 0;
  const auto out = generate_tokens(decoder, prompt, 10, greedy);
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), out.begin(), out.end());
  const int64_t n = int64_t(seq.size()) - 1;
  CpuModel full(c, 1, n);
  std::copy(params.begin(), params.end(), full.parameters());
  full.forward(seq.data(), seq.data() + 1);
  const std::vector<float> full_logits = logits_of(full, n);
  for (int64_t t = int64_t(prompt.size()) - 1; t < n; ++t) {
    const float* row = full_logits.data() + t * c.vocab;
    EXPECT_EQ(std::max_element(row, row + c.vocab) - row, seq[size_t(t + 1)]) << "position " << t;
  }
}

TEST(Sampling, BadOptionsAreErrors) {
  const std::vector<float> logits = {0.0f, 1.0f};
  SamplingOptions o;
  o.temperature = -1;
  EXPECT_THROW(sample_token(logits, o, 0), Error);
  o.temperature = std::nan("");
  EXPECT_THROW(sample_token(logits, o, 0), Error);
  o.temperature = 1;
  o.top_k = -2;
  EXPECT_THROW(sample_token(logits, o, 0), Error);
  o.top_k = 0;
  EXPECT_THROW(sample_token(std::vector<float>{0.0f, std::nanf("")}, o, 0), Error);
  EXPECT_THROW(sample_token(std::vector<float>{}, o, 0), Error);
  const ModelConfig c = ragged_decoder_config();
  KvCacheDecoder decoder(c, decoder_test_parameters(c, 2, 10.0f));
  EXPECT_THROW(generate_tokens(decoder, std::vector<int32_t>{}, 3, o), Error);
  EXPECT_THROW(generate_tokens(decoder, std::vector<int32_t>{1}, -1, o), Error);
}

// Beyond the context the window slides, as nanoGPT's sampler does: every token is drawn from the logits of the
// full forward over the last `context` tokens, re-run here from scratch for each one (the naive reference).
// Covers a prompt within the context that the new tokens overrun twice, and a prompt longer than the context.
TEST(Sampling, BeyondTheContextTheWindowSlidesAsAFullForwardOverTheLastContextTokens) {
  const ModelConfig c = ragged_decoder_config();
  const std::vector<float> params = decoder_test_parameters(c, 9, 10.0f);
  KvCacheDecoder decoder(c, params);
  SamplingOptions sampled;
  sampled.temperature = 1.0;
  sampled.seed = 21;
  SamplingOptions greedy;
  greedy.temperature = 0;
  // One model per window length, built once (the reference's cost is its forwards).
  std::map<int64_t, std::unique_ptr<CpuModel>> models;
  // A prompt within the context, sampled; one longer than the context, greedy.
  for (const auto& [prompt_length, o] : {std::pair{int64_t{5}, sampled}, std::pair{c.context + 4, greedy}}) {
    {
      const std::vector<int32_t> prompt = random_tokens(prompt_length, c.vocab, 13);
      const int64_t n_new = 2 * c.context + 3;
      std::vector<std::vector<float>> drawn_from;
      const auto out = generate_tokens(decoder, prompt, n_new, o, [&](int32_t, std::span<const float> logits) {
        drawn_from.emplace_back(logits.begin(), logits.end());
      });
      ASSERT_EQ(int64_t(out.size()), n_new);
      std::vector<int32_t> seq = prompt;
      double worst = 0, scale = 0;
      for (int64_t i = 0; i < n_new; ++i) {
        const int64_t n = std::min<int64_t>(int64_t(seq.size()), c.context);
        const std::vector<int32_t> window(seq.end() - n, seq.end());
        std::unique_ptr<CpuModel>& model = models[n];
        if (!model) {
          model = std::make_unique<CpuModel>(c, 1, n);
          std::copy(params.begin(), params.end(), model->parameters());
        }
        CpuModel& full = *model;
        full.forward(window.data(), window.data());  // the targets do not matter for the logits
        const std::vector<float> full_logits = logits_of(full, n);
        const std::span<const float> want(full_logits.data() + (n - 1) * c.vocab, size_t(c.vocab));
        for (size_t v = 0; v < want.size(); ++v) {
          worst = std::max(worst, double(std::abs(drawn_from[size_t(i)][v] - want[v])));
          scale = std::max(scale, double(std::abs(want[v])));
        }
        ASSERT_EQ(out[size_t(i)], sample_token(want, o, uint64_t(i)))
            << "new token " << i << ", prompt " << prompt_length;
        seq.push_back(out[size_t(i)]);
      }
      EXPECT_LT(worst / scale, 1e-5) << "max |decoder - forward| = " << worst << " at logit scale " << scale;
    }
  }
  // The same seed, the same tokens, past the context too.
  const std::vector<int32_t> prompt = {3, 1, 4};
  EXPECT_EQ(generate_tokens(decoder, prompt, 3 * c.context, sampled),
            generate_tokens(decoder, prompt, 3 * c.context, sampled));
}

// The CUDA decoder against the CPU one: the logits at every position of a full context (fp32 on both;
// cuBLASLt and the CUDA attention sum in other orders, so within 1e-4 of the logits' scale, not bitwise),
// greedy generation giving the same tokens, and a seeded sample repeating on the GPU. Skips without a GPU.
TEST(KvCacheDecoderCuda, MatchesTheCpuDecoderAtEveryPosition) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = ragged_decoder_config();
  const std::vector<float> params = decoder_test_parameters(c, 7, 10.0f);
  const std::vector<int32_t> tokens = random_tokens(c.context, c.vocab, 11);
  KvCacheDecoder cpu(c, params), gpu(c, params, Device::cuda);
  EXPECT_EQ(gpu.device(), Device::cuda);
  double worst = 0;
  for (int64_t p = 0; p < c.context; ++p) {
    const std::span<const float> a = cpu.step(tokens[size_t(p)]);
    const std::vector<float> want(a.begin(), a.end());
    const std::span<const float> b = gpu.step(tokens[size_t(p)]);
    double scale = 0, err = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      scale = std::max(scale, std::abs(double(want[i])));
      err = std::max(err, std::abs(double(b[i]) - double(want[i])));
    }
    worst = std::max(worst, err / scale);
    ASSERT_LT(err, 1e-4 * scale) << "position " << p;
  }
  EXPECT_THROW(gpu.step(0), Error);  // the cache is full
  RecordProperty("worst_relative_error", std::to_string(worst));

  SamplingOptions greedy;
  greedy.temperature = 0;
  const std::vector<int32_t> prompt = random_tokens(3, c.vocab, 5);
  EXPECT_EQ(generate_tokens(gpu, prompt, c.context - 3, greedy), generate_tokens(cpu, prompt, c.context - 3, greedy));
  SamplingOptions sampled;
  sampled.temperature = 0.8;
  sampled.top_k = 10;
  sampled.seed = 4;
  EXPECT_EQ(generate_tokens(gpu, prompt, 12, sampled), generate_tokens(gpu, prompt, 12, sampled));
  // Past the context, where the window slides and is encoded again from position 0.
  EXPECT_EQ(generate_tokens(gpu, prompt, 2 * c.context, greedy), generate_tokens(cpu, prompt, 2 * c.context, greedy));
  EXPECT_EQ(generate_tokens(gpu, prompt, 2 * c.context, sampled), generate_tokens(gpu, prompt, 2 * c.context, sampled));
}
