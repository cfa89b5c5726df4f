// Token files (both formats, every malformed case), the batcher's contract (shifted targets, wrapping,
// bounds, bit-exact resume) and the synthetic task's determinism and entropy.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "flashlm/data.h"
#include "flashlm/error.h"

using namespace flashlm;

namespace {

// A path under GoogleTest's temporary directory, unique per test.
std::string temp_path(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return ::testing::TempDir() + "flashlm_data_" + info->test_suite_name() + "_" + info->name() + "_" + name;
}

// A file written for one test and removed when it ends.
struct TempFile {
  std::string path;
  explicit TempFile(std::string p) : path(std::move(p)) {}
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() { std::remove(path.c_str()); }
};

TempFile write_file(const std::string& name, const std::vector<unsigned char>& bytes) {
  const std::string path = temp_path(name);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  EXPECT_TRUE(f.good()) << path;
  return TempFile{path};
}

template <class T>
void append(std::vector<unsigned char>& out, const T* data, size_t count) {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  out.insert(out.end(), p, p + count * sizeof(T));
}

// What np.array(tokens, dtype=np.uint16).tofile(f) writes.
std::vector<unsigned char> nanogpt_bytes(const std::vector<uint16_t>& tokens) {
  std::vector<unsigned char> out;
  append(out, tokens.data(), tokens.size());
  return out;
}

// What llm.c's write_datafile writes, with the header fields overridable to make bad files.
std::vector<unsigned char> llmc_bytes(const std::vector<uint16_t>& tokens, int32_t version = 1,
                                      int64_t count = -1) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = version;
  header[2] = static_cast<int32_t>(count >= 0 ? count : static_cast<int64_t>(tokens.size()));
  std::vector<unsigned char> out;
  append(out, header.data(), header.size());
  append(out, tokens.data(), tokens.size());
  return out;
}

// What llm.c's write_datafile writes for LLaMA 3: magic 20240801, version 7, uint32 tokens.
std::vector<unsigned char> llmc32_bytes(const std::vector<uint32_t>& tokens, int32_t version = 7) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240801;
  header[1] = version;
  header[2] = static_cast<int32_t>(tokens.size());
  std::vector<unsigned char> out;
  append(out, header.data(), header.size());
  append(out, tokens.data(), tokens.size());
  return out;
}

std::vector<uint16_t> ramp(size_t n) {
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>(i);
  return t;
}

// Runs `call` and checks that it throws flashlm::Error whose message contains every fragment.
void expect_error(const std::function<void()>& call, std::initializer_list<std::string> fragments) {
  try {
    call();
    ADD_FAILURE() << "expected flashlm::Error";
  } catch (const Error& e) {
    for (const auto& f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

struct Batch {
  std::vector<int32_t> x, y;
  bool operator==(const Batch&) const = default;
};

// Every token of a file, through TokenFile::read.
std::vector<uint16_t> read_all(const TokenFile& f) {
  std::vector<uint16_t> out(static_cast<size_t>(f.size()));
  f.read(0, out);
  return out;
}

Batch next_batch(TokenBatcher& b) {
  Batch out{std::vector<int32_t>(static_cast<size_t>(b.batch() * b.context())),
            std::vector<int32_t>(static_cast<size_t>(b.batch() * b.context()))};
  b.next(out.x, out.y);
  return out;
}

}  // namespace

TEST(TokenFile, LoadsNanoGptRawFile) {
  std::vector<uint16_t> tokens = ramp(1000);
  tokens[3] = 65535;  // the whole uint16 range survives
  const TempFile file = write_file("raw.bin", nanogpt_bytes(tokens));
  const std::string& path = file.path;
  const TokenFile f(path);
  EXPECT_EQ(f.format(), TokenFormat::nanogpt);
  EXPECT_EQ(f.path(), path);
  ASSERT_EQ(f.size(), static_cast<int64_t>(tokens.size()));
  EXPECT_EQ(read_all(f), tokens);
}

TEST(TokenFile, LoadsLlmcFile) {
  std::vector<uint16_t> tokens = ramp(777);
  tokens[0] = 50256;  // GPT-2's <|endoftext|>, with which llm.c's files begin
  const TempFile file = write_file("llmc.bin", llmc_bytes(tokens));
  const TokenFile f(file.path);
  EXPECT_EQ(f.format(), TokenFormat::llmc);
  ASSERT_EQ(f.size(), static_cast<int64_t>(tokens.size()));
  EXPECT_EQ(read_all(f), tokens);
}

TEST(TokenFile, LoadsUint32LlmcFileAndBatchesTokensBeyondUint16) {
  std::vector<uint32_t> tokens(500);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = 70000 + static_cast<uint32_t>(i) * 150;  // up to 144850
  const TempFile file = write_file("llmc32.bin", llmc32_bytes(tokens));
  const TokenFile f(file.path, 151936);
  EXPECT_EQ(f.format(), TokenFormat::llmc_uint32);
  EXPECT_EQ(f.token_bytes(), 4);
  ASSERT_EQ(f.size(), 500);
  std::vector<uint32_t> all(500);
  f.read(0, all);
  EXPECT_EQ(all, tokens);
  std::vector<uint16_t> narrow(4);
  expect_error([&] { f.read(0, narrow); }, {file.path, "holds uint32 tokens"});
  expect_error([&] { TokenFile g(file.path, 100000); }, {file.path, "token 100000 at position 200", "vocab_size = 100000"});
  TokenBatcher b(f, f.path(), 2, 16, BatchOrder::sequential);
  Batch batch = next_batch(b);
  EXPECT_EQ(batch.x[0], 70000);
  EXPECT_EQ(batch.y[0], 70150);
  EXPECT_EQ(batch.x[16], 70000 + 16 * 150);  // row 1 is the second window
  std::vector<unsigned char> truncated = llmc32_bytes(tokens);
  truncated.resize(truncated.size() - 2);
  const TempFile bad(write_file("llmc32_truncated.bin", truncated));
  expect_error([&] { TokenFile g(bad.path); }, {"truncated llm.c file: the header's token count 500 needs 3024 bytes"});
  const TempFile v1(write_file("llmc32_v1.bin", llmc32_bytes(tokens, 1)));
  expect_error([&] { TokenFile g(v1.path); }, {"unsupported llm.c version 1 for magic 20240801 (expected 7: uint32"});
}

TEST(TokenFile, Uint16FilesReadIntoUint32) {
  const std::vector<uint16_t> tokens = ramp(301);
  for (const auto& bytes : {nanogpt_bytes(tokens), llmc_bytes(tokens)}) {
    const TempFile file = write_file("wide.bin", bytes);
    const TokenFile f(file.path);
    EXPECT_EQ(f.token_bytes(), 2);
    std::vector<uint32_t> out(299, 0xdeadbeef);
    f.read(2, out);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], i + 2) << i;
  }
}

TEST(TokenFile, MoveTransfersTheFile) {
  const std::vector<uint16_t> tokens = ramp(64);
  const TempFile file = write_file("move.bin", nanogpt_bytes(tokens));
  TokenFile a(file.path);
  TokenFile b(std::move(a));
  EXPECT_EQ(a.size(), 0);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  ASSERT_EQ(b.size(), 64);
  EXPECT_EQ(read_all(b)[63], 63);
  a = std::move(b);
  EXPECT_EQ(read_all(a)[10], 10);
}

TEST(TokenFile, MalformedFilesNameTheFileAndTheReason) {
  const std::vector<uint16_t> tokens = ramp(100);
  struct Case {
    std::string name;
    std::vector<unsigned char> bytes;
    std::string reason;
  };
  std::vector<unsigned char> odd = nanogpt_bytes(tokens);
  odd.push_back(7);
  std::vector<unsigned char> short_header = llmc_bytes(tokens);
  short_header.resize(600);
  std::vector<unsigned char> truncated = llmc_bytes(tokens);
  truncated.resize(truncated.size() - 2);  // one token short
  std::vector<unsigned char> too_long = llmc_bytes(tokens);
  too_long.push_back(0);
  too_long.push_back(0);
  const std::vector<Case> cases = {
      {"empty.bin", {}, "the file is empty"},
      {"odd.bin", odd, "is odd"},
      {"three_bytes.bin", {1, 2, 3}, "is odd"},
      {"short_header.bin", short_header, "truncated llm.c header"},
      {"truncated.bin", truncated,
       "truncated llm.c file: the header's token count 100 needs 1224 bytes, the file has 1222"},
      {"too_long.bin", too_long, "token count 100 needs 1224 bytes, but the file has 1226 (2 bytes too many)"},
      {"version2.bin", llmc_bytes(tokens, 2), "unsupported llm.c version 2 for magic 20240520 (expected 1: uint16 tokens)"},
      {"version0.bin", llmc_bytes(tokens, 0), "unsupported llm.c version 0"},
      {"count_more.bin", llmc_bytes(tokens, 1, 150), "truncated llm.c file: the header's token count 150"},
      {"count_less.bin", llmc_bytes(tokens, 1, 40), "token count 40 needs 1104 bytes"},
      {"count_negative.bin", llmc_bytes(tokens, 1, 0x80000000LL), "token count is negative (-2147483648)"},
      {"count_zero.bin", llmc_bytes({}, 1, 0), "token count is 0"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const TempFile file = write_file(c.name, c.bytes);
    const std::string& path = file.path;
    expect_error([&] { TokenFile f(path); }, {path, c.reason});
  }
  const std::string missing = temp_path("missing.bin");
  expect_error([&] { TokenFile f(missing); }, {missing, "cannot open", "No such file"});
  expect_error([&] { TokenFile f(::testing::TempDir()); }, {"not a regular file"});
}

TEST(TokenFile, TooFewTokensForOneSequenceNamesTheFile) {
  const TempFile file = write_file("short.bin", nanogpt_bytes(ramp(8)));
  const std::string& path = file.path;
  const TokenFile f(path);
  // 8 tokens hold a context of 7 (inputs 0..6, targets 1..7) but not of 8.
  EXPECT_NO_THROW(TokenBatcher(f, f.path(), 4, 7, BatchOrder::sequential));
  for (BatchOrder order : {BatchOrder::sequential, BatchOrder::random})
    expect_error([&] { TokenBatcher(f, f.path(), 1, 8, order); },
                 {path, "8 tokens are too few for one sequence: context 8 needs at least 9"});
}

TEST(TokenFile, VocabCheckNamesTheFirstBadPosition) {
  std::vector<uint16_t> tokens(50, 3);
  tokens[7] = 150;
  tokens[20] = 200;
  for (const auto& [name, bytes] :
       {std::pair{"raw.bin", nanogpt_bytes(tokens)}, std::pair{"llmc.bin", llmc_bytes(tokens)}}) {
    const TempFile file = write_file(name, bytes);
    const std::string& path = file.path;
    expect_error([&] { TokenFile f(path, 100); },
                 {path, "token 150 at position 7 is outside the vocabulary (vocab_size = 100)"});
    expect_error([&] { TokenFile f(path, 150); }, {"token 150 at position 7"});
    expect_error([&] { TokenFile f(path, 151); }, {"token 200 at position 20"});
    const TokenFile f(path, 201);
    EXPECT_NO_THROW(f.validate_tokens(65536));
    expect_error([&] { f.validate_tokens(4); }, {path, "token 150 at position 7"});
    expect_error([&] { f.validate_tokens(0); }, {"vocab_size must be positive, got 0"});
  }
}

TEST(TokenBatcher, TargetsAreInputsShiftedByOne) {
  const std::vector<uint16_t> tokens = ramp(5000);  // token i is i, so a row's first input is its offset
  for (BatchOrder order : {BatchOrder::sequential, BatchOrder::random}) {
    TokenBatcher batcher(tokens, "ramp", 4, 33, order, 1);
    for (int step = 0; step < 20; ++step) {
      const Batch b = next_batch(batcher);
      for (int r = 0; r < 4; ++r) {
        const int32_t start = b.x[static_cast<size_t>(r * 33)];
        for (int t = 0; t < 33; ++t) {
          EXPECT_EQ(b.x[static_cast<size_t>(r * 33 + t)], start + t);
          EXPECT_EQ(b.y[static_cast<size_t>(r * 33 + t)], start + t + 1);
        }
      }
    }
  }
}

TEST(TokenBatcher, SequentialAdvancesByBTAndWraps) {
  constexpr int64_t T = 16, B = 3;
  const std::vector<uint16_t> tokens = ramp(10 * T + 5);  // 10 windows; the 4 tokens after the last are unused
  TokenBatcher batcher(tokens, "ramp", B, T, BatchOrder::sequential);
  EXPECT_EQ(batcher.windows(), 10);
  for (int64_t step = 0; step < 9; ++step) {
    const Batch b = next_batch(batcher);
    for (int64_t r = 0; r < B; ++r) {
      const int64_t window = (step * B + r) % 10;  // step 3 ends with window 0 again
      EXPECT_EQ(b.x[static_cast<size_t>(r * T)], window * T) << "step " << step << " row " << r;
    }
  }
  // A file of exactly T + 1 tokens is one window, repeated in every row.
  TokenBatcher one(std::span<const uint16_t>(tokens.data(), T + 1), "ramp", B, T, BatchOrder::sequential);
  EXPECT_EQ(one.windows(), 1);
  const Batch b = next_batch(one);
  for (int64_t r = 0; r < B; ++r) EXPECT_EQ(b.y[static_cast<size_t>(r * T + T - 1)], T);
}

TEST(TokenBatcher, RandomOffsetsStayInBoundsAndCoverEveryStart) {
  constexpr int64_t T = 32, B = 8;
  for (size_t n : {size_t{T + 1}, size_t{T + 7}, size_t{4096}}) {
    const std::vector<uint16_t> tokens = ramp(n);
    TokenBatcher batcher(tokens, "ramp", B, T, BatchOrder::random, 42);
    std::set<int32_t> starts;
    for (int step = 0; step < 2000; ++step) {
      const Batch b = next_batch(batcher);
      for (int64_t r = 0; r < B; ++r) {
        const int32_t start = b.x[static_cast<size_t>(r * T)];
        ASSERT_GE(start, 0);
        ASSERT_LE(start + T, static_cast<int64_t>(n) - 1) << "the last target must exist";
        starts.insert(start);
      }
    }
    // 16000 uniform draws reach every start of the small files and about 98% (1 - e^-3.9) of the 4064
    // starts of the large one.
    if (n < 100) EXPECT_EQ(starts.size(), n - T);
    else EXPECT_GT(starts.size(), (n - T) * 9 / 10);
  }
}

TEST(TokenBatcher, RestoreReproducesTheStreamExactly) {
  const std::vector<uint16_t> tokens = ramp(3000);
  for (BatchOrder order : {BatchOrder::sequential, BatchOrder::random}) {
    TokenBatcher a(tokens, "ramp", 5, 17, order, 1234);
    std::vector<Batch> stream;
    BatcherState saved;
    for (int step = 0; step < 50; ++step) {
      if (step == 20) saved = a.state();
      stream.push_back(next_batch(a));
    }
    EXPECT_EQ(saved.step, 20);
    EXPECT_EQ(a.state().step, 50);

    // A fresh batcher built with another seed, as a resumed trainer would before loading its checkpoint.
    TokenBatcher b(tokens, "ramp", 5, 17, order, 999);
    b.restore(saved);
    for (int step = 20; step < 50; ++step) ASSERT_EQ(next_batch(b), stream[static_cast<size_t>(step)]) << step;

    a.restore({1234, 0});  // rewinding the original replays from the start
    for (int step = 0; step < 50; ++step) ASSERT_EQ(next_batch(a), stream[static_cast<size_t>(step)]) << step;
  }
}

TEST(TokenBatcher, SeedsGiveDifferentRandomStreams) {
  const std::vector<uint16_t> tokens = ramp(60000);
  TokenBatcher a(tokens, "ramp", 4, 64, BatchOrder::random, 1);
  TokenBatcher b(tokens, "ramp", 4, 64, BatchOrder::random, 2);
  EXPECT_NE(next_batch(a), next_batch(b));
  EXPECT_NE(next_batch(a), next_batch(a)) << "consecutive batches differ";
}

// Data parallelism: the ranks' batches, concatenated in rank order, are the global batch of one process.
TEST(TokenBatcher, ShardsTogetherReadTheGlobalBatch) {
  const std::vector<uint16_t> tokens = ramp(5000);
  for (BatchOrder order : {BatchOrder::sequential, BatchOrder::random}) {
    TokenBatcher global(tokens, "ramp", 6, 9, order, 42);
    std::vector<TokenBatcher> ranks;
    for (int r = 0; r < 3; ++r) {
      ranks.emplace_back(tokens, "ramp", 2, 9, order, 42);
      ranks.back().select_shard(r, 3);
    }
    for (int step = 0; step < 4; ++step) {
      Batch joined;
      for (TokenBatcher& r : ranks) {
        const Batch b = next_batch(r);
        joined.x.insert(joined.x.end(), b.x.begin(), b.x.end());
        joined.y.insert(joined.y.end(), b.y.begin(), b.y.end());
      }
      EXPECT_EQ(joined, next_batch(global)) << step;
    }
  }
  TokenBatcher b(tokens, "ramp", 2, 9, BatchOrder::random);
  expect_error([&] { b.select_shard(3, 3); }, {"select_shard: shard 3 of 3"});
  expect_error([&] { b.select_shard(0, 0); }, {"select_shard: shard 0 of 0"});
}

TEST(TokenBatcher, BadArgumentsAreErrors) {
  const std::vector<uint16_t> tokens = ramp(100);
  expect_error([&] { TokenBatcher(tokens, "data.bin", 0, 8, BatchOrder::random); },
               {"data.bin", "batch must be in [1, 2^31), got 0"});
  expect_error([&] { TokenBatcher(tokens, "data.bin", 2, -1, BatchOrder::random); },
               {"data.bin", "context must be in [1, 2^31), got -1"});
  TokenBatcher batcher(tokens, "data.bin", 2, 8, BatchOrder::random);
  std::vector<int32_t> x(16), y(15);
  expect_error([&] { batcher.next(x, y); }, {"targets: expected batch * context = 2 * 8 = 16 ints, got 15"});
  expect_error([&] { batcher.next(y, x); }, {"inputs: expected batch * context = 2 * 8 = 16 ints, got 15"});
  EXPECT_EQ(batcher.state().step, 0) << "a failed call draws nothing";
  expect_error([&] { batcher.restore({0, -3}); }, {"state.step must be non-negative, got -3"});
}

namespace {

// Every token of a synthetic walk, read through its view (at the width it is stored in).
std::vector<uint32_t> all_tokens(const SyntheticTokens& data) {
  std::vector<uint32_t> t(static_cast<size_t>(data.size()));
  data.tokens().read(0, t);
  return t;
}

}  // namespace

TEST(SyntheticTokens, DeterministicPerSeed) {
  const SyntheticTokens a(256, 10000, 7), b(256, 10000, 7), c(256, 10000, 8);
  EXPECT_EQ(all_tokens(a), all_tokens(b));
  EXPECT_NE(all_tokens(a), all_tokens(c));
  const SyntheticTokens longer(256, 20000, 7);  // a longer walk extends the shorter one
  const std::vector<uint32_t> walk = all_tokens(longer);
  EXPECT_TRUE(std::ranges::equal(all_tokens(a), std::span(walk).first(10000)));
}

TEST(SyntheticTokens, EmpiricalConditionalEntropyMatchesTheOptimum) {
  for (int branching : {1, 3, 4}) {
    SCOPED_TRACE(branching);
    constexpr int64_t V = 64, N = 2'000'000;
    const SyntheticTokens data(V, N, 11, branching);
    EXPECT_DOUBLE_EQ(data.optimal_cross_entropy(), std::log(branching));
    std::map<std::pair<int, int>, int64_t> pairs;
    std::vector<int64_t> from(V, 0);
    const std::vector<uint32_t> t = all_tokens(data);
    for (size_t i = 0; i + 1 < t.size(); ++i) {
      ASSERT_LT(t[i + 1], V);
      ++pairs[{t[i], t[i + 1]}];
      ++from[t[i]];
    }
    std::vector<int> successors(V, 0);
    double h = 0;  // -sum p(a, b) ln p(b | a), in nats
    for (const auto& [ab, count] : pairs) {
      ++successors[static_cast<size_t>(ab.first)];
      h -= static_cast<double>(count) / static_cast<double>(N - 1) *
           std::log(static_cast<double>(count) / static_cast<double>(from[static_cast<size_t>(ab.first)]));
    }
    for (int s : successors) EXPECT_LE(s, branching);
    EXPECT_NEAR(h, data.optimal_cross_entropy(), 0.01);
  }
}

TEST(SyntheticTokens, FeedsTheBatcher) {
  const SyntheticTokens data(256, 100000, 3);
  TokenBatcher batcher(data.tokens(), "synthetic", 8, 64, BatchOrder::random, 5);
  const Batch b = next_batch(batcher);
  for (size_t i = 0; i < b.x.size(); ++i) {
    EXPECT_LT(b.x[i], 256);
    if (i % 64 != 63) {
      EXPECT_EQ(b.y[i], b.x[i + 1]);
    }
  }
}

TEST(SyntheticTokens, BadArgumentsAreErrors) {
  expect_error([] { SyntheticTokens(256, 1000, 1, 0); }, {"branching must be in [1, 256], got 0"});
  expect_error([] { SyntheticTokens(256, 1000, 1, 257); }, {"branching must be in [1, 256], got 257"});
  expect_error([] { SyntheticTokens(3, 1000, 1, 4); }, {"vocab_size must be in [branching = 4, 2^31)", "got 3"});
  expect_error([] { SyntheticTokens(int64_t{1} << 31, 1000, 1); }, {"vocab_size", "got 2147483648"});
  expect_error([] { SyntheticTokens(256, 1, 1); }, {"num_tokens must be at least 2, got 1"});
  const SyntheticTokens full(65536, 1000, 1, 256);  // the largest uint16 table: every uint16 id is a token
  EXPECT_EQ(full.size(), 1000);
  EXPECT_EQ(full.token_bytes(), 2);
  EXPECT_EQ(full.tokens().token_bytes(), 2);
}

// A vocabulary beyond uint16 (the leaderboard's 151936, `train --data synthetic` for cs336-8b): the walk is
// stored as uint32, reaches ids above 65535, stays below the vocabulary, follows at most `branching`
// successors per token, reads through the view and the batcher at its width, and is refused by the uint16
// read overload rather than truncated.
TEST(SyntheticTokens, VocabularyBeyondUint16IsStoredAsUint32) {
  constexpr int64_t V = 151936, N = 300000;
  const SyntheticTokens data(V, N, 5);
  EXPECT_EQ(data.token_bytes(), 4);
  EXPECT_EQ(data.tokens().token_bytes(), 4);
  EXPECT_EQ(data.tokens().size(), N);
  const std::vector<uint32_t> t = all_tokens(data);
  EXPECT_GT(*std::max_element(t.begin(), t.end()), 65535u);
  EXPECT_LT(*std::max_element(t.begin(), t.end()), uint32_t(V));
  std::map<uint32_t, std::set<uint32_t>> successors;
  for (size_t i = 0; i + 1 < t.size(); ++i) successors[t[i]].insert(t[i + 1]);
  size_t most = 0;
  for (const auto& [from, next] : successors) most = std::max(most, next.size());
  EXPECT_EQ(most, 4u) << "every token has its 4 successors, no more";
  for (int64_t i : {int64_t{0}, int64_t{1}, N / 2, N - 1}) EXPECT_EQ(data.token(i), t[size_t(i)]);
  expect_error([&] { (void)data.token(N); }, {"SyntheticTokens::token: 300000 outside [0, 300000)"});
  std::vector<uint16_t> narrow(4);
  expect_error([&] { data.tokens().read(0, narrow); }, {"holds uint32 tokens"});

  TokenBatcher batcher(data.tokens(), "synthetic", 4, 64, BatchOrder::random, 9);
  const Batch b = next_batch(batcher);
  bool wide = false;
  for (size_t i = 0; i < b.x.size(); ++i) {
    wide = wide || b.x[i] > 65535;
    ASSERT_LT(b.x[i], V);
    if (i % 64 != 63) {
      EXPECT_EQ(b.y[i], b.x[i + 1]);
    }
  }
  EXPECT_TRUE(wide) << "no id above uint16 in the batch: truncated?";
  // The subview (the held-out last 10%) keeps the width.
  const TokenView tail = data.tokens().subview(N - 10, 10);
  std::vector<uint32_t> last(10);
  tail.read(0, last);
  EXPECT_TRUE(std::ranges::equal(last, std::span(t).last(10)));
}

TEST(TokenFile, TruncatedWhileInUseIsAnErrorNotSigbus) {
  const TempFile file = write_file("shrinks.bin", nanogpt_bytes(ramp(10000)));
  const TokenFile f(file.path);
  TokenBatcher batcher(f, f.path(), 4, 64, BatchOrder::random, 3);
  EXPECT_NO_THROW(next_batch(batcher));
  // Another process cuts the file to 50 tokens: no row of 65 fits any more. A memory mapping would
  // raise SIGBUS on the first page beyond the new end.
  ASSERT_EQ(::truncate(file.path.c_str(), 100), 0);
  expect_error([&] { next_batch(batcher); },
               {file.path, "it has 100 bytes now, 20000 when it was opened (was it truncated"});
  expect_error([&] { f.validate_tokens(65536); }, {file.path, "truncated"});
}

TEST(TokenFile, FifoIsRefusedWithoutBlocking) {
  const std::string fifo = temp_path("fifo");
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto opened = std::async(std::launch::async, [&] {
    try {
      TokenFile f(fifo);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  });
  if (opened.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    ADD_FAILURE() << "TokenFile blocked on a FIFO";
    const int fd = ::open(fifo.c_str(), O_WRONLY);  // releases the blocked open()
    if (fd >= 0) ::close(fd);
  }
  const std::string what = opened.get();
  EXPECT_NE(what.find(fifo), std::string::npos) << what;
  EXPECT_NE(what.find("not a regular file (a FIFO)"), std::string::npos) << what;
  ::unlink(fifo.c_str());
}

TEST(TokenView, SubviewsReadTheirRangeAndCheckBounds) {
  const TempFile file = write_file("view.bin", llmc_bytes(ramp(300)));
  const TokenFile f(file.path);
  const std::vector<uint16_t> memory = ramp(300);
  for (const TokenView whole : {TokenView(f), TokenView(memory)}) {
    const TokenView mid = whole.subview(100, 50);
    EXPECT_EQ(mid.size(), 50);
    std::vector<uint16_t> out(10);
    mid.read(40, out);
    EXPECT_EQ(out.front(), 140);
    EXPECT_EQ(out.back(), 149);
    expect_error([&] { mid.read(41, out); }, {"tokens [41, 51) are outside the view's 50 tokens"});
    expect_error([&] { mid.read(-1, out); }, {"outside the view's 50 tokens"});
    expect_error([&] { whole.subview(290, 11); }, {"[290, 301) is outside the view's 300 tokens"});
    expect_error([&] { whole.subview(-1, 1); }, {"outside the view's 300 tokens"});
  }
  std::vector<uint16_t> out(2);
  expect_error([&] { f.read(299, out); }, {file.path, "tokens [299, 301) are outside the file's 300 tokens"});
}
