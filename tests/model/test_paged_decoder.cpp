// Batched decoding over a paged KV cache: the pool's page bookkeeping; PagedKvDecoder on the CPU (fp32)
// against KvCacheDecoder sequence by sequence (ragged prompts, prefill chunks, pages out of order, a partly
// filled last page); generate_batch against generate_tokens per prompt (seed + b), past the context too; bad
// inputs. On the GPU (skipped without one): the bf16 decoder against the fp32 CPU decoder within bf16
// tolerances, a batch of prompts of different lengths against each prompt decoded alone, the steps replayed as
// CUDA graphs against the same steps launched eagerly (bit for bit).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flashlm/error.h"
#include "flashlm/generate.h"
#include "flashlm/model.h"
#include "gpu_testing.h"
#include "model/decoder_testing.h"
#include "model/random_tokens.h"

using namespace flashlm;

namespace {

// What the CUDA decoding kernels take: head_dim 64; d_ff a multiple of 8; vocab 61 (the LM head padded to 64).
ModelConfig gpu_config() {
  ModelConfig c = ModelConfig::named("tiny", 40, 61);
  c.d_model = 128;
  c.heads = 2;
  c.d_ff = 96;
  c.layers = 2;
  return c;
}


// max |got - want| and max |want|.
struct Diff {
  double err = 0, scale = 0;
  void add(std::span<const float> got, std::span<const float> want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      err = std::max(err, std::isfinite(got[i]) ? std::abs(double(got[i]) - double(want[i])) : INFINITY);
      scale = std::max(scale, std::abs(double(want[i])));
    }
  }
  double relative() const { return err / scale; }
};

// Where a greedy decoder picked `token` from its own logits and `want` are the reference's logits at the same
// point: the token is the reference's argmax, or (where rounding flipped a near tie) within `tol` of it.
void expect_near_argmax(std::span<const float> want, int32_t token, double tol, const std::string& where) {
  const auto best = std::max_element(want.begin(), want.end()) - want.begin();
  if (best == token) return;
  EXPECT_LE(double(want[size_t(best)]) - double(want[size_t(token)]), tol)
      << where << ": token " << token << " where the reference's argmax is " << best;
}

std::vector<float> copy(std::span<const float> s) { return {s.begin(), s.end()}; }

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// The pool's bookkeeping.

TEST(KvPagePool, HandsOutPagesAsSequencesGrowOutOfOrderAndTakesThemBack) {
  KvPagePool pool(3, 16, 6, 3);
  EXPECT_EQ(pool.capacity(), 48);
  EXPECT_EQ(pool.free_pages(), 6);
  pool.reserve(0, 10);  // page 0, partly filled
  pool.advance(0, 10);
  pool.reserve(1, 20);  // pages 1, 2
  pool.advance(1, 20);
  EXPECT_EQ(pool.length(0), 10);
  EXPECT_EQ(pool.length(1), 20);
  pool.reserve(0, 6);  // fits in page 0: no new page
  EXPECT_EQ(pool.pages(0).size(), 1u);
  pool.advance(0, 6);
  pool.reserve(0, 1);  // position 16: a second page, after sequence 1's
  pool.advance(0, 1);
  EXPECT_EQ(std::vector<int32_t>(pool.pages(0).begin(), pool.pages(0).end()), (std::vector<int32_t>{0, 3}));
  EXPECT_EQ(std::vector<int32_t>(pool.pages(1).begin(), pool.pages(1).end()), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(pool.locate(0, 15), (std::pair<int32_t, int64_t>{0, 15}));
  EXPECT_EQ(pool.locate(0, 16), (std::pair<int32_t, int64_t>{3, 0}));
  EXPECT_EQ(pool.locate(1, 19), (std::pair<int32_t, int64_t>{2, 3}));
  EXPECT_THROW(pool.locate(0, 32), Error);  // past its pages
  const std::vector<int32_t> table(pool.block_table().begin(), pool.block_table().end());
  EXPECT_EQ(table, (std::vector<int32_t>{0, 3, -1, 1, 2, -1, -1, -1, -1}));
  EXPECT_EQ(pool.free_pages(), 2);
  // Only what was reserved can be counted in: page 3 holds 1 of its 16 positions.
  EXPECT_THROW(pool.advance(0, 16), Error);
  pool.advance(0, 15);
  EXPECT_EQ(pool.length(0), 32);
  // A released sequence's pages go back; the last released is handed out first.
  pool.release(1);
  EXPECT_EQ(pool.length(1), 0);
  EXPECT_TRUE(pool.pages(1).empty());
  EXPECT_EQ(pool.free_pages(), 4);
  pool.reserve(2, 1);
  EXPECT_EQ(pool.pages(2)[0], 2);
  EXPECT_EQ(pool.block_table()[3], -1);
}

TEST(KvPagePool, ExhaustionAndCapacityAreErrorsThatChangeNothing) {
  KvPagePool pool(2, 16, 3, 2);
  pool.reserve(0, 32);  // two pages
  pool.advance(0, 32);
  try {
    pool.reserve(1, 17);  // two more pages, one free
    FAIL() << "an exhausted pool must be an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the pool is exhausted: sequence 1 needs 2 more pages"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("1 of the 3 pages are free"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.free_pages(), 1);
  EXPECT_TRUE(pool.pages(1).empty());
  try {
    pool.reserve(0, 1);  // past max_pages x page_size
    FAIL() << "a sequence past its capacity must be an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than its 32 (2 pages of 16)"), std::string::npos) << e.what();
  }
  pool.reserve(1, 16);  // the free page
  pool.advance(1, 16);
  EXPECT_EQ(pool.free_pages(), 0);
  EXPECT_THROW(pool.reserve(1, 1), Error);  // position 16 needs a page
  EXPECT_THROW(pool.reserve(2, 1), InvalidArgument);  // no such sequence
  EXPECT_THROW(pool.length(-1), InvalidArgument);
  EXPECT_THROW(pool.reserve(0, -1), InvalidArgument);
  EXPECT_THROW(KvPagePool(0, 16, 1, 1), InvalidArgument);
  EXPECT_THROW(KvPagePool(1, 0, 1, 1), InvalidArgument);
  EXPECT_THROW(KvPagePool(1, 16, 0, 1), InvalidArgument);
  EXPECT_THROW(KvPagePool(1, 16, 1, 0), InvalidArgument);
}

// ---------------------------------------------------------------------------------------------------------
// The decoder on the CPU (fp32).

// Three prompts of different lengths (one longer than a prefill chunk) in one pool, then teacher-forced steps of
// whichever sequences still have room, against KvCacheDecoder fed the same tokens sequence by sequence.
TEST(PagedKvDecoder, CpuBatchMatchesTheContiguousDecoderSequenceBySequence) {
  const ModelConfig c = ragged_decoder_config();
  const std::vector<float> params = decoder_test_parameters(c, 7, 10.0f);
  const std::vector<int64_t> prompt_lengths = {5, 20, 1};
  const int64_t B = int64_t(prompt_lengths.size());
  PagedDecoderOptions o;
  o.batch = B;
  o.page_size = 16;
  PagedKvDecoder paged(c, params, Device::cpu, o);
  EXPECT_EQ(paged.pool().max_pages(), 2);
  EXPECT_EQ(paged.pool().num_pages(), 6);
  std::vector<KvCacheDecoder> alone;
  for (int64_t b = 0; b < B; ++b) alone.emplace_back(c, params);

  Diff diff;
  std::vector<std::vector<int32_t>> fed(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    fed[size_t(b)] = random_tokens(prompt_lengths[size_t(b)], c.vocab, unsigned(20 + b));
    const std::vector<float> got = copy(paged.prefill(b, fed[size_t(b)]));
    diff.add(got, alone[size_t(b)].prefill(fed[size_t(b)]));
    EXPECT_EQ(paged.length(b), prompt_lengths[size_t(b)]);
  }
  for (int step = 0; step < 30; ++step) {
    std::vector<int64_t> seqs;
    std::vector<int32_t> tokens;
    for (int64_t b = 0; b < B; ++b) {
      if (paged.length(b) == c.context) continue;
      seqs.push_back(b);
      tokens.push_back(int32_t((step * 7 + b * 13) % c.vocab));
    }
    if (seqs.empty()) break;
    const std::vector<float> got = copy(paged.step(seqs, tokens));
    ASSERT_EQ(got.size(), seqs.size() * size_t(c.vocab));
    for (size_t i = 0; i < seqs.size(); ++i) {
      const std::span<const float> want = alone[size_t(seqs[i])].step(tokens[i]);
      diff.add(std::span(got).subspan(i * size_t(c.vocab), size_t(c.vocab)), want);
    }
  }
  for (int64_t b = 0; b < B; ++b) EXPECT_EQ(paged.length(b), c.context);
  ASSERT_GT(diff.scale, 0.1);
  EXPECT_LT(diff.relative(), 1e-5) << "max |paged - contiguous| = " << diff.err << " at logit scale " << diff.scale;
  // Sequence 0 took its second page after sequence 1's two and sequence 2's first: not adjacent to its first.
  const auto pages0 = paged.pool().pages(0);
  ASSERT_EQ(pages0.size(), 2u);
  EXPECT_NE(pages0[1], pages0[0] + 1);
  EXPECT_EQ(paged.pool().free_pages(), 0);
  // A full sequence takes no more tokens; a reset one starts again at position 0 with the same logits.
  EXPECT_THROW(paged.step(std::vector<int64_t>{0}, std::vector<int32_t>{1}), InvalidArgument);
  paged.reset(2);
  EXPECT_EQ(paged.length(2), 0);
  EXPECT_EQ(paged.pool().free_pages(), 2);
  KvCacheDecoder fresh(c, params);
  Diff again;
  again.add(copy(paged.prefill(2, fed[2])), fresh.prefill(fed[2]));
  EXPECT_LT(again.relative(), 1e-5);
}

// generate_batch's sequence b is generate_tokens on its prompt with seed + b, sampled and greedy, within the
// context and past it (where each window slides and is prefilled again, its pages recycled through the pool).
TEST(PagedKvDecoder, GenerateBatchIsGenerateTokensPerPromptWithSeedPlusIndex) {
  const ModelConfig c = ragged_decoder_config();
  const std::vector<float> params = decoder_test_parameters(c, 9, 10.0f);
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(3, c.vocab, 1), random_tokens(17, c.vocab, 2),
                                                     random_tokens(c.context + 4, c.vocab, 3), {7}};
  SamplingOptions sampled;
  sampled.temperature = 1.0;
  sampled.seed = 21;
  SamplingOptions greedy;
  greedy.temperature = 0;
  KvCacheDecoder reference(c, params);
  for (const SamplingOptions& opt : {sampled, greedy}) {
    for (const int64_t n_new : {int64_t{4}, 2 * c.context + 3}) {
      PagedDecoderOptions o;
      o.batch = int64_t(prompts.size());
      o.page_size = 16;
      o.num_pages = paged_pool_pages(c, prompts, n_new, o.page_size);  // exactly what the batch needs
      PagedKvDecoder decoder(c, params, Device::cpu, o);
      int64_t seen = 0;
      const BatchGeneration got =
          generate_batch(decoder, prompts, n_new, opt, [&](int64_t b, int32_t token, std::span<const float> logits) {
            EXPECT_EQ(logits.size(), size_t(c.vocab));
            EXPECT_EQ(token, sample_token(logits, [&] {
                        SamplingOptions s = opt;
                        s.seed = opt.seed + uint64_t(b);
                        return s;
                      }(), uint64_t(seen / int64_t(prompts.size()))));
            ++seen;
          });
      EXPECT_EQ(seen, n_new * int64_t(prompts.size()));
      ASSERT_EQ(got.tokens.size(), prompts.size());
      int64_t prompt_tokens = 0;
      for (size_t b = 0; b < prompts.size(); ++b) {
        SamplingOptions alone = opt;
        alone.seed = opt.seed + b;
        EXPECT_EQ(got.tokens[b], generate_tokens(reference, prompts[b], n_new, alone))
            << "sequence " << b << ", temperature " << opt.temperature << ", " << n_new << " new tokens";
        prompt_tokens += std::min<int64_t>(int64_t(prompts[b].size()), c.context);
      }
      EXPECT_EQ(got.prompt_tokens, prompt_tokens);
      EXPECT_GE(got.prefill_seconds, 0);
      EXPECT_GE(got.decode_seconds, 0);
    }
  }
}

TEST(PagedKvDecoder, BadInputsAreClearErrors) {
  const ModelConfig c = ragged_decoder_config();
  const std::vector<float> params = decoder_test_parameters(c, 1, 1.0f);
  const auto expect_error = [](const auto& fn, const std::string& text) {
    try {
      fn();
      ADD_FAILURE() << "expected an error containing '" << text << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  PagedDecoderOptions o;
  o.batch = 0;
  EXPECT_THROW(PagedKvDecoder(c, params, Device::cpu, o), InvalidArgument);
  expect_error([&] { PagedKvDecoder(c, params, Device::cpu, o); }, "batch = 0, expected at least 1");
  for (const int64_t page_size : {0, 8, 24, 272}) {
    o = {};
    o.page_size = page_size;
    EXPECT_THROW(PagedKvDecoder(c, params, Device::cpu, o), InvalidArgument) << page_size;
  }
  expect_error([&] { PagedKvDecoder(c, params, Device::cpu, o); }, "page_size = 272, expected a multiple of 16 in [16, 256]");
  o = {};
  o.num_pages = -1;
  EXPECT_THROW(PagedKvDecoder(c, params, Device::cpu, o), InvalidArgument);
  o = {};
  EXPECT_THROW(PagedKvDecoder(c, std::span(params).first(params.size() - 1), Device::cpu, o), InvalidArgument);
  if (cuda_device_count() == 0) {
    expect_error([&] { PagedKvDecoder(c, params, Device::cuda, o); }, "device cuda: ");
  }
  std::string why;
  EXPECT_TRUE(paged_decoder_supports(c, Device::cpu));
  EXPECT_FALSE(paged_decoder_supports(c, Device::cuda, &why));  // head_dim 8, or no CUDA in this build
  EXPECT_FALSE(why.empty());
  if (cuda_built()) {
    EXPECT_NE(why.find("head_dim 8"), std::string::npos) << why;
    EXPECT_TRUE(paged_decoder_supports(gpu_config(), Device::cuda));
  }

  o = {};
  o.batch = 2;
  o.page_size = 16;
  o.num_pages = 2;
  PagedKvDecoder d(c, params, Device::cpu, o);
  EXPECT_THROW(d.prefill(0, {}), InvalidArgument);
  EXPECT_THROW(d.prefill(2, std::vector<int32_t>{1}), InvalidArgument);
  EXPECT_THROW(d.prefill(0, std::vector<int32_t>{int32_t(c.vocab)}), InvalidArgument);
  expect_error([&] { d.prefill(0, random_tokens(c.context + 1, c.vocab, 4)); },
               "would hold 0 + 24 tokens, more than the model's context of 23 tokens");
  EXPECT_EQ(d.length(0), 0);
  d.prefill(0, random_tokens(17, c.vocab, 5));  // both pages of the pool
  expect_error([&] { d.prefill(1, std::vector<int32_t>{1}); }, "the pool is exhausted");
  EXPECT_EQ(d.length(1), 0);  // the refused prefill took no place
  EXPECT_THROW(d.step(std::vector<int32_t>{1, 2}), Error);  // sequence 1 finds no page either
  EXPECT_THROW(d.step(std::vector<int64_t>{0, 0}, std::vector<int32_t>{1, 2}), InvalidArgument);
  EXPECT_THROW(d.step(std::vector<int64_t>{0}, std::vector<int32_t>{1, 2}), InvalidArgument);
  EXPECT_THROW(d.step(std::vector<int64_t>{0}, std::vector<int32_t>{-1}), InvalidArgument);
  EXPECT_THROW(d.step(std::vector<int64_t>{}, std::vector<int32_t>{}), InvalidArgument);
  d.reset(0);
  EXPECT_EQ(d.pool().free_pages(), 2);

  SamplingOptions s;
  const std::vector<std::vector<int32_t>> one = {{1}};
  EXPECT_THROW(generate_batch(d, one, 3, s), InvalidArgument);  // one prompt for a batch of two
  const std::vector<std::vector<int32_t>> with_empty = {{1}, {}};
  expect_error([&] { generate_batch(d, with_empty, 3, s); }, "prompt 1 is empty");
  const std::vector<std::vector<int32_t>> two = {{1}, {2}};
  EXPECT_THROW(generate_batch(d, two, -1, s), InvalidArgument);
}

// ---------------------------------------------------------------------------------------------------------
// The decoder on the GPU (bf16).

// bf16 weights, activations and pages against the fp32 CPU decoder: logits within 5% of their scale (the bf16
// bound of test_model_on_gpu's CudaModelVsCpu), teacher-forced through two prefill chunks and every step to
// the full context; then greedy tokens, each the CPU's argmax or within that bound of it.
TEST(PagedKvDecoderCuda, Bf16MatchesTheFp32CpuDecoderWithinBf16Tolerance) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = gpu_config();
  const std::vector<float> params = decoder_test_parameters(c, 7, 3.0f);
  constexpr double kTol = 5e-2;
  PagedDecoderOptions o;
  o.page_size = 16;
  PagedKvDecoder gpu(c, params, Device::cuda, o);
  EXPECT_EQ(gpu.device(), Device::cuda);
  KvCacheDecoder cpu(c, params);
  const std::vector<int32_t> tokens = random_tokens(c.context, c.vocab, 11);
  const std::vector<int32_t> prompt(tokens.begin(), tokens.begin() + 20);  // chunks of 16 and 4
  Diff diff;
  diff.add(copy(gpu.prefill(0, prompt)), copy(cpu.prefill(prompt)));
  ASSERT_LT(diff.relative(), kTol) << "after the prompt: max error " << diff.err << " at logit scale " << diff.scale;
  for (size_t t = prompt.size(); t < tokens.size(); ++t) {
    const std::vector<float> got = copy(gpu.step(std::span(&tokens[t], 1)));
    diff.add(got, cpu.step(tokens[t]));
    ASSERT_LT(diff.relative(), kTol) << "position " << t << ": max error " << diff.err << " at scale " << diff.scale;
  }
  RecordProperty("worst_relative_error", std::to_string(diff.relative()));
  EXPECT_THROW(gpu.step(std::span(&tokens[0], 1)), InvalidArgument);  // the context is full

  SamplingOptions greedy;
  greedy.temperature = 0;
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(5, c.vocab, 3)};
  const BatchGeneration g = generate_batch(gpu, prompts, 16, greedy);
  cpu.reset();
  std::vector<float> want = copy(cpu.prefill(prompts[0]));
  for (size_t i = 0; i < g.tokens[0].size(); ++i) {
    expect_near_argmax(want, g.tokens[0][i], kTol * diff.scale, "greedy token " + std::to_string(i));
    want = copy(cpu.step(g.tokens[0][i]));  // the CPU follows the GPU's tokens
  }
}

// Prompts of 3, 17 and 30 tokens in one batch (one pool, pages interleaved as the sequences grow) against each
// decoded alone by a batch-1 decoder: the same greedy tokens (or, where the products' other summation order
// flips a near tie, within the bf16 bound), logits within it.
TEST(PagedKvDecoderCuda, ABatchOfDifferentLengthsEqualsEachPromptDecodedAlone) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = gpu_config();
  const std::vector<float> params = decoder_test_parameters(c, 8, 3.0f);
  constexpr double kTol = 5e-2;
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(3, c.vocab, 1), random_tokens(17, c.vocab, 2),
                                                     random_tokens(30, c.vocab, 3)};
  SamplingOptions greedy;
  greedy.temperature = 0;
  const int64_t n_new = 9;  // 30 + 9 < context 40: no slide
  PagedDecoderOptions o;
  o.batch = 3;
  o.page_size = 16;
  o.num_pages = paged_pool_pages(c, prompts, n_new, o.page_size);
  PagedKvDecoder batch(c, params, Device::cuda, o);
  std::vector<std::vector<std::vector<float>>> batch_logits(prompts.size());
  const BatchGeneration g = generate_batch(batch, prompts, n_new, greedy,
                                           [&](int64_t b, int32_t, std::span<const float> logits) {
                                             batch_logits[size_t(b)].push_back(copy(logits));
                                           });
  PagedDecoderOptions one;
  one.page_size = 16;
  PagedKvDecoder alone(c, params, Device::cuda, one);
  Diff diff;
  for (size_t b = 0; b < prompts.size(); ++b) {
    ASSERT_EQ(g.tokens[b].size(), size_t(n_new));
    alone.reset(0);
    std::vector<float> want = copy(alone.prefill(0, prompts[b]));
    for (size_t i = 0; i < g.tokens[b].size(); ++i) {
      diff.add(batch_logits[b][i], want);
      expect_near_argmax(want, g.tokens[b][i], kTol * diff.scale,
                         "sequence " + std::to_string(b) + ", token " + std::to_string(i));
      want = copy(alone.step(std::span(&g.tokens[b][i], 1)));  // the lone decoder follows the batch's tokens
    }
  }
  EXPECT_LT(diff.relative(), kTol) << "max |batch - alone| = " << diff.err << " at logit scale " << diff.scale;
  RecordProperty("worst_relative_error", std::to_string(diff.relative()));

  // Past the context (each window sliding, re-prefilled, its pages recycled) a seeded sample repeats.
  SamplingOptions sampled;
  sampled.temperature = 0.8;
  sampled.top_k = 10;
  sampled.seed = 4;
  o.num_pages = paged_pool_pages(c, prompts, 2 * c.context, o.page_size);
  PagedKvDecoder long_run(c, params, Device::cuda, o);
  const BatchGeneration first = generate_batch(long_run, prompts, 2 * c.context, sampled);
  EXPECT_EQ(generate_batch(long_run, prompts, 2 * c.context, sampled).tokens, first.tokens);
}

TEST(PagedKvDecoderCuda, ModelsTheKernelsCannotRunAreRefusedByName) {
  SKIP_WITHOUT_GPU();
  ModelConfig c = gpu_config();
  c.heads = 4;  // head_dim 32
  const std::vector<float> params = decoder_test_parameters(c, 1, 1.0f);
  try {
    PagedKvDecoder d(c, params, Device::cuda, PagedDecoderOptions{});
    FAIL() << "head_dim 32 has no CUDA decoding kernel";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 32"), std::string::npos) << e.what();
  }
}

// The steps replayed as CUDA graphs (PagedDecoderOptions::cuda_graph) against the same steps launched kernel by
// kernel: the same tokens and the same logits, bit for bit. Context 512 in pages of 16: the attention's grid
// has four splits (it is sized by the capacity, 32 pages), which a long sequence fills, and one graph serves
// every length: the lengths it is replayed at cross pages (every 16) and, at 128 keys, the tile where a sequence
// takes a third split of 64 keys. Batch 1 from a prompt of 120 tokens; then batch 3 of prompts of 5, 100 and 490
// tokens, the last of which slides past the context and is re-prefilled alone while the others step on (the
// graph of 2 sequences after that of 3); each run twice on one decoder, the second replaying the graphs from
// its first step.
TEST(PagedKvDecoderCuda, CudaGraphStepsGiveTheEagerStepsTokensAndLogitsBitForBit) {
  SKIP_WITHOUT_GPU();
  ModelConfig c = gpu_config();
  c.context = 512;
  const std::vector<float> params = decoder_test_parameters(c, 9, 3.0f);
  SamplingOptions sampled;  // sampled, not greedy: every logit of the top 10 matters to the tokens
  sampled.temperature = 0.8;
  sampled.top_k = 10;
  sampled.seed = 21;
  const int64_t n_new = 40;

  struct Run {
    std::vector<std::vector<int32_t>> tokens;
    std::vector<std::vector<float>> logits;  // per sequence, every new token's logits one after another
    std::string status;                      // cuda_graph_status after the run
  };
  const auto decode = [&](const std::vector<std::vector<int32_t>>& prompts, bool graph) {
    PagedDecoderOptions o;
    o.batch = int64_t(prompts.size());
    o.page_size = 16;
    o.num_pages = paged_pool_pages(c, prompts, n_new, o.page_size);
    o.cuda_graph = graph;
    PagedKvDecoder d(c, params, Device::cuda, o);
    std::vector<Run> runs(2);
    for (Run& run : runs) {
      run.logits.resize(prompts.size());
      run.tokens = generate_batch(d, prompts, n_new, sampled, [&](int64_t b, int32_t, std::span<const float> l) {
                     run.logits[size_t(b)].insert(run.logits[size_t(b)].end(), l.begin(), l.end());
                   }).tokens;
      run.status = d.cuda_graph_status();
    }
    return runs;
  };
  const auto expect_same_bits = [&c](const std::vector<float>& got, const std::vector<float>& want,
                                   const std::string& where) {
    ASSERT_EQ(got.size(), want.size()) << where;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
          << where << ": logit " << i % size_t(c.vocab) << " of new token " << i / size_t(c.vocab) << " is " << got[i]
          << " with the graph, " << want[i] << " without";
    }
  };

  const std::vector<std::vector<std::vector<int32_t>>> cases = {
      {random_tokens(120, c.vocab, 31)},
      {random_tokens(5, c.vocab, 32), random_tokens(100, c.vocab, 33), random_tokens(490, c.vocab, 34)}};
  for (const auto& prompts : cases) {
    const std::string batch = "batch " + std::to_string(prompts.size());
    const std::vector<Run> graph = decode(prompts, true), eager = decode(prompts, false);
    for (size_t r = 0; r < graph.size(); ++r) {
      const std::string where = batch + ", run " + std::to_string(r);
      // The last step of each run was a replay (not a warm-up, not a failed capture's eager step).
      EXPECT_EQ(graph[r].status, "on") << where;
      EXPECT_EQ(eager[r].status, "off: --cuda-graph off") << where;
      EXPECT_EQ(graph[r].tokens, eager[r].tokens) << where;
      for (size_t b = 0; b < prompts.size(); ++b) {
        ASSERT_EQ(graph[r].tokens[b].size(), size_t(n_new)) << where;
        expect_same_bits(graph[r].logits[b], eager[r].logits[b], where + ", sequence " + std::to_string(b));
      }
    }
    EXPECT_EQ(graph[1].tokens, graph[0].tokens) << batch << ": the same seed twice";
  }
}
