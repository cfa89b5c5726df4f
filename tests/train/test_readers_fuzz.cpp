// Bounded random-mutation fuzzing of the readers of untrusted files: token files, checkpoints, and the JSON
// ones (safetensors headers, tokenizer.json, --model-config), those structure-aware (values of other types
// and sizes, nesting far deeper than any real file, fields removed and added): every mutated file must
// give either a flashlm::Error or a result that is consistent with the file, never a crash (run under the
// sanitizer build, an out-of-bounds read, an overflow or a stack overflow is one).
// Mutations are drawn from a fixed seed so that a failure repeats; FLASHLM_FUZZ_SEED picks another seed and
// FLASHLM_FUZZ_ITERATIONS another count, for longer runs by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "flashlm/data.h"
#include "flashlm/model.h"
#include "flashlm/safetensors.h"
#include "flashlm/text.h"
#include "flashlm/error.h"
#include "train/checkpoint.h"
#include "train/checkpoint_bytes.h"

using namespace flashlm;
using flashlm::test::CheckpointBytes;

namespace {

uint64_t env_or(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::strtoull(v, nullptr, 10) : fallback;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / ("flashlm_fuzz_" + name)).string();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(bytes.size()));
}

template <class T>
void put(std::string& bytes, size_t at, T value) {
  if (at + sizeof value <= bytes.size()) std::memcpy(bytes.data() + at, &value, sizeof value);
}

// Byte-level mutations of any file: bit flips, overwritten bytes, extreme integers at random places,
// truncation, extension and duplicated spans.
std::string mutate_bytes(std::string bytes, std::mt19937_64& rng) {
  const int edits = 1 + int(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    const size_t at = bytes.empty() ? 0 : rng() % bytes.size();
    switch (rng() % 7) {
      case 0:
        if (!bytes.empty()) bytes[at] = char(bytes[at] ^ (1 << (rng() % 8)));
        break;
      case 1:
        if (!bytes.empty()) bytes[at] = char(rng());
        break;
      case 2: {
        static constexpr int64_t extremes[] = {0, -1, 1, INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, 20240520, 255};
        const int64_t v = extremes[rng() % std::size(extremes)];
        if (rng() % 2) put(bytes, at & ~size_t{3}, int32_t(v));
        else put(bytes, at & ~size_t{7}, v);
        break;
      }
      case 3:
        bytes.resize(at);
        break;
      case 4:
        for (int i = 0, n = int(rng() % 64); i < n; ++i) bytes.push_back(char(rng()));
        break;
      case 5:
        if (!bytes.empty()) bytes.insert(at, bytes.substr(rng() % bytes.size(), rng() % 32));
        break;
      default:
        if (!bytes.empty()) bytes.erase(at, rng() % 16);
        break;
    }
  }
  return bytes;
}

// A JSON value of a random type, with the values that break readers: extremes, negatives, wrong types.
nlohmann::json random_json(std::mt19937_64& rng) {
  switch (rng() % 10) {
    case 0: return nullptr;
    case 1: return -1;
    case 2: return 0;
    case 3: return std::numeric_limits<int64_t>::max();
    case 4: return std::numeric_limits<uint64_t>::max();
    case 5: return std::numeric_limits<int64_t>::min();
    case 6: return 1e300;
    case 7: return "x";
    case 8: return nlohmann::json::array({1});
    default: return int64_t(rng() % 1000);
  }
}

// Changes one field of the header (at any depth) to a random value, or removes it, and fixes the
// checksums so that the reader's field checks, not its checksum, must catch it.
CheckpointBytes mutate_header(CheckpointBytes c, std::mt19937_64& rng) {
  nlohmann::json* target = &c.header;
  std::vector<std::string> keys;
  for (auto& [k, v] : target->items()) keys.push_back(k);
  std::string key = keys[rng() % keys.size()];
  if ((*target)[key].is_object() && rng() % 2) {
    target = &(*target)[key];
    keys.clear();
    for (auto& [k, v] : target->items()) keys.push_back(k);
    key = keys[rng() % keys.size()];
  }
  if (rng() % 8 == 0) target->erase(key);
  else (*target)[key] = random_json(rng);
  return c;
}

// `depth` arrays, one inside the other, around a number: deeper than kMaxJsonDepth must be refused.
nlohmann::json nested(int depth) {
  nlohmann::json j = 1;
  for (int i = 0; i < depth; ++i) j = nlohmann::json::array({std::move(j)});
  return j;
}

constexpr const char* kDeepMark = "\x01" "deep" "\x01";

// Structure-aware mutations of a JSON document: a node at any depth replaced by a value of another type
// or size (an extreme number, a long string, nesting around the readers' limit and thousands of times past
// it), removed, wrapped, or given a new field; and, on the text, a run of unmatched '[' or '{"a":'.
std::string mutate_json(nlohmann::json doc, std::mt19937_64& rng) {
  const int edits = 1 + int(rng() % 3);
  for (int e = 0; e < edits; ++e) {
    nlohmann::json* parent = nullptr;
    nlohmann::json* node = &doc;
    std::string key;
    size_t index = 0;
    while (node->is_structured() && !node->empty() && rng() % 4 != 0) {
      parent = node;
      if (node->is_object()) {
        auto it = node->begin();
        std::advance(it, rng() % node->size());
        key = it.key();
        node = &(*node)[key];
      } else {
        index = rng() % node->size();
        node = &(*node)[index];
      }
    }
    switch (rng() % 7) {
      case 0: *node = random_json(rng); break;
      case 1:  // around the readers' limit of 64 levels, or (marked, built in the text below) far beyond it
        *node = rng() % 3 ? nested(1 + int(rng() % 100)) : nlohmann::json(kDeepMark);
        break;
      case 2: *node = std::string(rng() % 20000, char('a' + rng() % 26)); break;
      case 3:
        if (parent && parent->is_object()) parent->erase(key);
        else if (parent) parent->erase(index);
        break;
      case 4: *node = rng() % 2 ? nlohmann::json::array({*node}) : nlohmann::json{{"x", *node}}; break;
      case 5:
        if (node->is_object()) (*node)["fuzz" + std::to_string(rng() % 4)] = rng() % 2 ? nlohmann::json("v") : random_json(rng);
        break;
      default:
        if (node->is_string()) *node = node->get<std::string>() + char(rng());  // maybe not UTF-8
        else if (node->is_number_integer())  // ±1 in two's complement: wraps at the ends instead of overflowing
          *node = int64_t(uint64_t(node->get<int64_t>()) + uint64_t(rng() % 3) - 1);
        break;
    }
  }
  std::string text = doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  // Nesting too deep to build here (nlohmann's own dump would overflow the stack): made in the text.
  const std::string mark = nlohmann::json(kDeepMark).dump();
  for (size_t at = text.find(mark); at != std::string::npos; at = text.find(mark, at)) {
    const size_t depth = 1000 + rng() % 200000;
    text.replace(at, mark.size(), std::string(depth, '[') + std::string(depth, ']'));
    at += 2 * depth;
  }
  if (rng() % 6 == 0) {
    const std::string open = rng() % 2 ? "[" : "{\"a\":";
    const size_t at = rng() % (text.size() + 1);
    std::string run;
    for (size_t i = 0, n = 1 + rng() % 100000; i < n; ++i) run += open;
    text.insert(at, run);
  }
  return text;
}

// Writes `iterations` files from make(iteration) to `path` and reads each with accept(bytes), which
// asserts what an accepted file must satisfy. A rejection must be a flashlm::Error naming the file, and
// both outcomes must occur: the mutations reach past the first check.
void fuzz_reader(const std::string& path, uint64_t iterations, const std::function<std::string(uint64_t)>& make,
                 const std::function<void(const std::string&)>& accept) {
  uint64_t errors = 0, accepted = 0;
  for (uint64_t it = 0; it < iterations && !::testing::Test::HasFatalFailure(); ++it) {
    const std::string bytes = make(it);
    write_bytes(path, bytes);
    SCOPED_TRACE("iteration " + std::to_string(it));
    try {
      accept(bytes);
      ++accepted;
    } catch (const Error& e) {
      ASSERT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      ++errors;
    }
  }
  EXPECT_GT(errors, 0u);
  EXPECT_GT(accepted, 0u);
  std::filesystem::remove(path);
}

}  // namespace

TEST(ReaderFuzz, TokenFilesGiveAnErrorOrConsistentTokens) {
  std::mt19937_64 rng(env_or("FLASHLM_FUZZ_SEED", 14));
  const uint64_t iterations = env_or("FLASHLM_FUZZ_ITERATIONS", 1500);
  std::vector<uint16_t> tokens(700);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint16_t(i * 37 % 300);
  std::string raw(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  std::string llmc(1024, '\0');
  put(llmc, 0, int32_t{20240520});
  put(llmc, 4, int32_t{1});
  put(llmc, 8, int32_t(tokens.size()));
  llmc += raw;
  const std::string path = temp_path("tokens.bin");
  fuzz_reader(
      path, iterations, [&](uint64_t it) { return mutate_bytes(it % 2 ? llmc : raw, rng); },
      [&](const std::string& bytes) {
        const TokenFile f(path, 300);
        // Accepted: the tokens lie inside the file and the vocabulary, and a batcher reads every one.
        const int64_t header = f.format() == TokenFormat::nanogpt ? 0 : 1024;
        ASSERT_EQ(header + 2 * f.size(), int64_t(bytes.size()));
        std::vector<uint16_t> all(size_t(f.size()));
        f.read(0, all);
        for (uint16_t t : all) ASSERT_LT(t, 300);
        if (f.size() >= 9) {
          TokenBatcher b(f, f.path(), 2, 8, BatchOrder::sequential);
          std::vector<int32_t> x(16), y(16);
          for (int64_t i = 0; i < b.windows(); i += 2) b.next(x, y);
        }
      });
}

TEST(ReaderFuzz, CheckpointsGiveAnErrorOrAConsistentState) {
  std::mt19937_64 rng(env_or("FLASHLM_FUZZ_SEED", 14) + 1);
  const uint64_t iterations = env_or("FLASHLM_FUZZ_ITERATIONS", 1500);
  // A real checkpoint of a small model's shape: a header as train writes it and 3 x n floats.
  CheckpointHeader h;
  h.model = ModelConfig::named("tiny", 16, 64);
  h.batch = 2;
  h.seq = 16;
  h.next_step = 5;
  h.optimizer_steps = 5;
  h.seed = 1234;
  h.train_data = {"synthetic", 1000, 0xabcdef};
  h.batcher = {1234, 5};
  h.parameter_count = 257;
  std::vector<float> state(size_t(h.parameter_count));
  for (size_t i = 0; i < state.size(); ++i) state[i] = float(i) * 0.5f - 3.0f;
  const std::string path = temp_path("state.ckpt");
  write_checkpoint(path, h, state, state, state);
  const CheckpointBytes good = CheckpointBytes::read(path);
  std::ifstream in(path, std::ios::binary);
  const std::string good_bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());

  // Half the files have a valid checksum around a wrong field; half are damaged anywhere.
  fuzz_reader(
      path, iterations,
      [&](uint64_t it) { return it % 2 ? mutate_header(good, rng).bytes() : mutate_bytes(good_bytes, rng); },
      [&](const std::string& bytes) {
        const CheckpointReader reader(path);
        const CheckpointHeader& r = reader.header();
        const auto n = size_t(r.parameter_count);
        // Accepted: the sizes agree with the file, the ranges hold, and the payload reads back.
        ASSERT_LE(3 * n * sizeof(float), bytes.size());
        ASSERT_GE(r.next_step, r.optimizer_steps);
        ASSERT_GE(r.optimizer_steps, 0);
        ASSERT_EQ(r.batcher.step, r.next_step * r.grad_accum);
        std::vector<float> p(n), m(n), v(n);
        reader.read_payload(p, m, v);
        // Against the run that wrote the original, a header that differs in what resume needs is refused.
        try {
          check_resumable(path, r, h);
        } catch (const Error& e) {
          ASSERT_NE(std::string(e.what()).find("differs from this run"), std::string::npos) << e.what();
        }
      });
}

TEST(ReaderFuzz, SafetensorsHeadersGiveAnErrorOrFiniteWeights) {
  std::mt19937_64 rng(env_or("FLASHLM_FUZZ_SEED", 14) + 2);
  const uint64_t iterations = env_or("FLASHLM_FUZZ_ITERATIONS", 1500) / 3;
  ModelConfig c = ModelConfig::named("tiny", 16, 64);
  c.layers = 1;
  std::vector<float> params(size_t(c.parameter_count()));
  for (size_t i = 0; i < params.size(); ++i) params[i] = float(i % 100) * 0.01f;
  const std::string path = temp_path("model.safetensors");
  write_safetensors(path, c, params);
  std::ifstream in(path, std::ios::binary);
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t length = 0;
  std::memcpy(&length, good.data(), 8);
  const nlohmann::json header = nlohmann::json::parse(good.substr(8, length));
  const std::string data = good.substr(8 + length);
  fuzz_reader(
      path, iterations,
      [&](uint64_t it) {
        if (it % 4 == 3) return mutate_bytes(good, rng);
        const std::string text = mutate_json(header, rng);
        const uint64_t n = text.size();
        return std::string(reinterpret_cast<const char*>(&n), 8) + text + data;
      },
      [&](const std::string&) {
        const SafetensorsFile f(path);
        const ModelConfig m = f.model_config();
        std::vector<float> out(size_t(m.parameter_count()));
        f.read_parameters(m, out);
        for (float x : out) ASSERT_TRUE(std::isfinite(x));
      });
}

TEST(ReaderFuzz, TokenizerFilesGiveAnErrorOrADecodingTokenizer) {
  std::mt19937_64 rng(env_or("FLASHLM_FUZZ_SEED", 14) + 3);
  const uint64_t iterations = env_or("FLASHLM_FUZZ_ITERATIONS", 1500) / 3;
  // A byte-level BPE as the `tokenizers` package writes it: GPT-2's 256 byte characters and a merge.
  nlohmann::json vocab = nlohmann::json::object();
  int shifted = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : shifted++;
    std::string ch;
    if (cp < 0x80) ch.push_back(char(cp));
    else ch = {char(0xC0 | (cp >> 6)), char(0x80 | (cp & 0x3F))};
    vocab[ch] = b;
  }
  vocab["ab"] = 256;
  const nlohmann::json bpe = {{"version", "1.0"},
                              {"added_tokens", nlohmann::json::array({{{"id", 257}, {"content", "<|end|>"}}})},
                              {"decoder", {{"type", "ByteLevel"}}},
                              {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"a b"}}}}};
  const nlohmann::json bytes = nlohmann::json::parse(Tokenizer::bytes().json());
  const std::string path = temp_path("tokenizer.json");
  fuzz_reader(
      path, iterations,
      [&](uint64_t it) {
        if (it % 4 == 3) return mutate_bytes(bpe.dump(), rng);
        return mutate_json(it % 4 == 2 ? bytes : bpe, rng);
      },
      [&](const std::string&) {
        const Tokenizer t = Tokenizer::load(path);
        ASSERT_GT(t.vocab_size(), 0);
        std::vector<int32_t> all(size_t(t.vocab_size()));
        for (size_t i = 0; i < all.size(); ++i) all[i] = int32_t(i);
        t.decode(all);
      });
}

TEST(ReaderFuzz, ModelConfigsGiveAnErrorOrAValidModel) {
  std::mt19937_64 rng(env_or("FLASHLM_FUZZ_SEED", 14) + 4);
  const uint64_t iterations = env_or("FLASHLM_FUZZ_ITERATIONS", 1500) / 3;
  const nlohmann::json config = {{"base", "tiny"}, {"vocab", 300}, {"context", 64}, {"layers", 2},
                                 {"heads", 4},     {"d_model", 64}, {"d_ff", 128},  {"rope_theta", 10000.0}};
  const std::string path = temp_path("model.json");
  fuzz_reader(
      path, iterations,
      [&](uint64_t it) { return it % 4 == 3 ? mutate_bytes(config.dump(), rng) : mutate_json(config, rng); },
      [&](const std::string&) {
        const ModelConfig m = ModelConfig::from_json_file(path);
        m.validate();
        ASSERT_GT(m.parameter_count(), 0);
      });
}
