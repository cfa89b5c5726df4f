// From text to a model and back: the byte-level tokenizer and `prepare`, safetensors written and read back
// (and files a hostile or buggy writer would make, built here independently of src/train/safetensors.cpp),
// train --init from a safetensors file, and the metrics log.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <csignal>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "flashlm/data.h"
#include "flashlm/dtype.h"
#include "flashlm/safetensors.h"
#include "flashlm/text.h"
#include "flashlm/train.h"
#include "train/checkpoint.h"

using namespace flashlm;

namespace {

std::string temp_path(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return (std::filesystem::path(::testing::TempDir()) / (std::string("flashlm_t2m_") + info->name() + "_" + name))
      .string();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void expect_error(const std::function<void()>& call, std::initializer_list<std::string> fragments) {
  try {
    call();
    ADD_FAILURE() << "expected flashlm::Error";
  } catch (const Error& e) {
    for (const auto& f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

ModelConfig small_model() {
  ModelConfig c = ModelConfig::named("tiny", 16, 64);
  c.layers = 1;
  return c;
}

std::vector<float> counting_parameters(const ModelConfig& c) {
  std::vector<float> p(size_t(c.parameter_count()));
  for (size_t i = 0; i < p.size(); ++i) p[i] = float(i % 1000) * 0.001f - 0.5f;
  return p;
}

// A safetensors file as the format describes it: {"name": {dtype, shape, data_offsets}} and the data.
struct SafetensorsBytes {
  nlohmann::json header;
  std::string data;

  static SafetensorsBytes read(const std::string& path) {
    const std::string bytes = read_bytes(path);
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    return {nlohmann::json::parse(bytes.substr(8, n)), bytes.substr(8 + n)};
  }
  std::string bytes() const {
    const std::string text = header.dump();
    const uint64_t n = text.size();
    return std::string(reinterpret_cast<const char*>(&n), 8) + text + data;
  }
};

}  // namespace

TEST(Tokenizer, BytesRoundTripAndErrors) {
  const Tokenizer t = Tokenizer::bytes();
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(char(b));
  const std::vector<int32_t> ids = t.encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[size_t(b)], b);
  EXPECT_EQ(t.decode(ids), all);
  expect_error([&] { t.decode(std::vector<int32_t>{65, 256}); }, {"tokens[1] = 256"});

  const std::string path = temp_path("tokenizer.json");
  write_bytes(path, t.json());
  EXPECT_EQ(Tokenizer::load(path).vocab_size(), 256);
  write_bytes(path, R"({"model": {"type": "BPE"}, "added_tokens": []})");
  expect_error([&] { Tokenizer::load(path); }, {"decoder is missing", "byte-level BPEs only"});
  write_bytes(path, R"({"type": "word", "vocab_size": 256})");
  expect_error([&] { Tokenizer::load(path); }, {"'type' is \"word\""});
  write_bytes(path, R"({"type": "byte", "vocab_size": 300})");
  expect_error([&] { Tokenizer::load(path); }, {"'vocab_size' is 300"});
  write_bytes(path, "{not json");
  expect_error([&] { Tokenizer::load(path); }, {"not valid JSON"});
  expect_error([&] { Tokenizer::load(::testing::TempDir()); }, {"not a regular file"});
}

// A byte-level BPE in the `tokenizers` package's format, written by hand: every one of the 256 byte
// characters of GPT-2's alphabet plus merges, each id's string mapped back to its bytes on decode.
TEST(Tokenizer, BpeDecodesThroughTheByteLevelAlphabet) {
  // GPT-2's table, built independently of the reader: printable bytes are themselves, the 68 others
  // U+0100.. in byte order.
  std::vector<std::string> chars(256);
  int shifted = 256;
  const auto utf8 = [](int cp) {
    std::string s;
    if (cp < 0x80) s.push_back(char(cp));
    else { s.push_back(char(0xC0 | (cp >> 6))); s.push_back(char(0x80 | (cp & 0x3F))); }
    return s;
  };
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    chars[size_t(b)] = utf8(printable ? b : shifted++);
  }
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[chars[size_t(b)]] = (b * 7 + 3) % 256;  // ids shuffled against bytes
  vocab[chars[' '] + "the"] = 256;
  vocab[chars[0xC3] + chars[0xA9]] = 257;  // "é" in UTF-8
  vocab[chars['\n'] + chars['\n']] = 258;
  nlohmann::json j = {{"version", "1.0"},
                      {"added_tokens", nlohmann::json::array({{{"id", 259}, {"content", "<|end|>"}}})},
                      {"decoder", {{"type", "ByteLevel"}}},
                      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  const std::string path = temp_path("bpe.json");
  write_bytes(path, j.dump());
  const Tokenizer t = Tokenizer::load(path);
  EXPECT_TRUE(t.is_bpe());
  EXPECT_EQ(t.name(), "bpe");
  EXPECT_EQ(t.vocab_size(), 260);
  std::string all;
  std::vector<int32_t> ids;
  for (int b = 0; b < 256; ++b) {
    all.push_back(char(b));
    ids.push_back((b * 7 + 3) % 256);
  }
  EXPECT_EQ(t.decode(ids), all);
  EXPECT_EQ(t.decode(std::vector<int32_t>{256, 257, 258, 259}), " the\xc3\xa9\n\n<|end|>");
  expect_error([&] { t.decode(std::vector<int32_t>{260}); }, {"tokens[0] = 260 outside the bpe vocabulary [0, 260)"});
  expect_error([&] { t.encode("a"); }, {"scripts/prepare_data.py encode"});

  nlohmann::json bad = j;
  bad["model"]["vocab"]["\xe6\x97\xa5"] = 260;  // a CJK character is no byte of the alphabet
  write_bytes(path, bad.dump());
  expect_error([&] { Tokenizer::load(path); }, {"token 260", "outside the byte-level alphabet"});
  bad = j;
  bad["model"]["vocab"][chars['a'] + chars['b']] = 300;
  write_bytes(path, bad.dump());
  expect_error([&] { Tokenizer::load(path); }, {"not 0..260 each once (id 300 is out of range)"});
  bad = j;
  bad["model"]["vocab"][chars['a'] + chars['b']] = 5;
  write_bytes(path, bad.dump());
  expect_error([&] { Tokenizer::load(path); }, {"id 5 is repeated"});
  bad = j;
  bad["decoder"]["type"] = "WordPiece";
  write_bytes(path, bad.dump());
  expect_error([&] { Tokenizer::load(path); }, {"expected a ByteLevel decoder"});
  bad = j;
  bad["model"]["vocab"]["x"] = -1;
  write_bytes(path, bad.dump());
  expect_error([&] { Tokenizer::load(path); }, {"model.vocab[\"x\"] is -1"});
}

TEST(Prepare, WritesTokenFilesTrainReadsAndTheTokenizer) {
  const std::string dir = temp_path("out");
  std::filesystem::create_directories(dir);
  const std::string a = temp_path("a.txt"), b = temp_path("b.txt");
  std::string text_a, text_b = "\xce\xbb and \xff bytes\n";
  for (int i = 0; i < 50; ++i) text_a += "line " + std::to_string(i) + " of some text\n";
  write_bytes(a, text_a);
  write_bytes(b, text_b);
  PrepareConfig cfg;
  cfg.inputs = {a, b};
  cfg.out_dir = dir;
  cfg.val_fraction = 0.25;
  const PreparedData d = prepare_text_data(cfg);
  const std::string all = text_a + text_b;
  EXPECT_EQ(d.train_tokens + d.val_tokens, int64_t(all.size()));
  EXPECT_EQ(d.val_tokens, int64_t((all.size() + 3) / 4));  // ceil(0.25 n)
  const TokenFile train(d.train_path, 256), val(d.val_path, 256);
  ASSERT_EQ(train.size(), d.train_tokens);
  std::vector<uint16_t> tokens(size_t(train.size() + val.size()));
  train.read(0, std::span(tokens).first(size_t(train.size())));
  val.read(0, std::span(tokens).subspan(size_t(train.size())));
  std::string back;
  for (uint16_t t : tokens) back.push_back(char(t));
  EXPECT_EQ(back, all);
  EXPECT_EQ(Tokenizer::load(d.tokenizer_path).vocab_size(), 256);

  cfg.val_fraction = 0.6;
  expect_error([&] { prepare_text_data(cfg); }, {"val_fraction = 0.6"});
  cfg.val_fraction = 0.1;
  // The output directory is made with its parents, as prepare --out data in a fresh checkout wants; a file
  // in its place is an Error naming it.
  std::filesystem::remove_all(dir + "/new");  // left by an earlier run
  cfg.out_dir = dir + "/new/data";
  const PreparedData nested = prepare_text_data(cfg);
  EXPECT_EQ(nested.train_tokens + nested.val_tokens, d.train_tokens + d.val_tokens);
  EXPECT_TRUE(std::filesystem::is_regular_file(dir + "/new/data/train.bin"));
  cfg.out_dir = a;
  expect_error([&] { prepare_text_data(cfg); }, {"cannot create the output directory", a});
  cfg.out_dir = dir;
  write_bytes(a, "abc");
  cfg.inputs = {a};
  expect_error([&] { prepare_text_data(cfg); }, {"3 tokens in all", "at least 2"});
  cfg.inputs = {a + ".none"};
  expect_error([&] { prepare_text_data(cfg); }, {"cannot open"});
  cfg.inputs = {};
  expect_error([&] { prepare_text_data(cfg); }, {"no input"});
}

TEST(Safetensors, RoundTripKeepsEveryBitNameShapeAndConfig) {
  ModelConfig c = small_model();
  c.rope_theta = 500000.5;
  c.norm_eps = 1e-6;
  const std::vector<float> params = counting_parameters(c);
  const std::string path = temp_path("m.safetensors");
  write_safetensors(path, c, params);

  // The file as the format describes it, read independently.
  const SafetensorsBytes raw = SafetensorsBytes::read(path);
  EXPECT_EQ((read_bytes(path).size() - raw.data.size()) % 8, 0u);  // the data starts 8-byte aligned
  EXPECT_EQ(raw.header["__metadata__"]["format"], "pt");
  const auto layout = parameter_layout(c);
  EXPECT_EQ(raw.header.size(), layout.size() + 1);
  for (const ParameterInfo& p : layout) {
    const nlohmann::json& t = raw.header.at(p.name);
    EXPECT_EQ(t["dtype"], "F32");
    EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), p.shape);
    const auto begin = t["data_offsets"][0].get<size_t>(), end = t["data_offsets"][1].get<size_t>();
    ASSERT_EQ(end - begin, size_t(p.numel()) * 4);
    EXPECT_EQ(std::memcmp(raw.data.data() + begin, params.data() + p.offset, end - begin), 0) << p.name;
  }
  EXPECT_EQ(raw.header.at("token_embeddings.weight")["shape"], nlohmann::json::array({64, 32}));

  const SafetensorsFile file(path);
  const ModelConfig back = file.model_config();
  EXPECT_EQ(back.vocab, c.vocab);
  EXPECT_EQ(back.context, c.context);
  EXPECT_EQ(back.d_model, c.d_model);
  EXPECT_EQ(back.d_ff, c.d_ff);
  EXPECT_EQ(back.layers, c.layers);
  EXPECT_EQ(back.heads, c.heads);
  EXPECT_EQ(back.rope_theta, c.rope_theta);
  EXPECT_EQ(back.norm_eps, c.norm_eps);
  std::vector<float> read(params.size(), std::nanf(""));
  file.read_parameters(c, read);
  EXPECT_EQ(std::memcmp(read.data(), params.data(), params.size() * 4), 0);
}

TEST(Safetensors, SixteenBitTensorsAreWidened) {
  const ModelConfig c = small_model();
  const std::vector<float> params = counting_parameters(c);
  const std::string path = temp_path("m.safetensors");
  write_safetensors(path, c, params);
  SafetensorsBytes raw = SafetensorsBytes::read(path);
  // Rewrite every tensor as BF16 (the embedding as F16), packed in the same order.
  std::string data;
  std::vector<float> expected(params.size());
  for (const ParameterInfo& p : parameter_layout(c)) {
    const bool half = p.name == "token_embeddings.weight";
    const size_t begin = data.size();
    for (int64_t i = 0; i < p.numel(); ++i) {
      const float x = params[size_t(p.offset + i)];
      const uint16_t bits = half ? fp16_t(x).bits : bf16_t(x).bits;
      expected[size_t(p.offset + i)] = half ? float(fp16_t(x)) : float(bf16_t(x));
      data.append(reinterpret_cast<const char*>(&bits), 2);
    }
    raw.header[p.name]["dtype"] = half ? "F16" : "BF16";
    raw.header[p.name]["data_offsets"] = {begin, data.size()};
  }
  raw.data = data;
  write_bytes(path, raw.bytes());
  std::vector<float> read(params.size());
  SafetensorsFile(path).read_parameters(c, read);
  EXPECT_EQ(read, expected);
}

TEST(Safetensors, UntrustedFilesAreErrorsNamingWhatIsWrong) {
  const ModelConfig c = small_model();
  const std::vector<float> params = counting_parameters(c);
  const std::string good = temp_path("good.safetensors"), bad = temp_path("bad.safetensors");
  write_safetensors(good, c, params);
  const SafetensorsBytes base = SafetensorsBytes::read(good);
  std::vector<float> out(params.size());
  const auto open_fails = [&](const SafetensorsBytes& s, std::initializer_list<std::string> fragments) {
    write_bytes(bad, s.bytes());
    expect_error([&] { SafetensorsFile f(bad); }, fragments);
  };
  const auto read_fails = [&](const SafetensorsBytes& s, std::initializer_list<std::string> fragments) {
    write_bytes(bad, s.bytes());
    expect_error([&] { SafetensorsFile(bad).read_parameters(c, out); }, fragments);
  };
  const std::string q = "layers.0.attn.q_proj.weight", k = "layers.0.attn.k_proj.weight";

  write_bytes(bad, "1234567");
  expect_error([&] { SafetensorsFile f(bad); }, {"too short"});
  std::string huge = base.bytes();
  const uint64_t n = uint64_t(1) << 40;
  std::memcpy(huge.data(), &n, 8);
  write_bytes(bad, huge);
  expect_error([&] { SafetensorsFile f(bad); }, {"header length is 1099511627776"});
  std::string not_json = base.bytes();
  not_json[8] = '[';
  write_bytes(bad, not_json);
  expect_error([&] { SafetensorsFile f(bad); }, {"not valid JSON"});

  SafetensorsBytes s = base;
  s.header = nlohmann::json::array();
  open_fails(s, {"expected a JSON object"});
  s = base;
  s.header[q]["dtype"] = "F31";
  open_fails(s, {q, "dtype \"F31\""});
  s = base;
  s.header[q]["shape"] = {32, -32};
  open_fails(s, {q, "-32 is not a non-negative integer"});
  s = base;
  s.header[q]["shape"] = {uint64_t(1) << 62, uint64_t(1) << 62};
  open_fails(s, {q, "more elements than the file has bytes"});
  s = base;
  s.header[q]["shape"] = {32, 16};
  open_fails(s, {q, "needs 2048 bytes", "hold 4096"});
  s = base;
  s.header[q]["data_offsets"] = {0, uint64_t(1) << 50};
  open_fails(s, {q, "not a range inside"});
  s = base;
  s.header[q]["data_offsets"] = {8, 4};
  open_fails(s, {q, "not a range inside"});
  s = base;
  s.header[q]["data_offsets"] = "0-4096";
  open_fails(s, {q, "not [begin, end]"});
  s = base;
  s.header[q]["extra"] = 1;
  open_fails(s, {q, "unknown field 'extra'"});
  s = base;
  s.header[q].erase("shape");
  open_fails(s, {q, "expected the fields"});
  s = base;  // q's bytes moved onto k's: the two overlap, and q's old place is no one's
  s.header[q]["data_offsets"] = s.header[k]["data_offsets"];
  open_fails(s, {"overlap"});
  s = base;
  s.data += std::string(4, '\0');
  open_fails(s, {"at the end of the data belong to no tensor"});
  s = base;
  s.header["__metadata__"]["flashlm.heads"] = 4;
  open_fails(s, {"metadata 'flashlm.heads' is 4, expected a string"});

  // Well-formed files that are not this model's parameters.
  s = base;
  s.header["layers.1.ln1.weight"] = {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {s.data.size(), s.data.size()}}};
  read_fails(s, {"tensor 'layers.1.ln1.weight' is not a parameter of this model"});
  s = base;
  s.header.erase("lm_head.weight");
  s.data.resize(s.data.size() - 64 * 32 * 4);  // lm_head is the layout's last tensor
  read_fails(s, {"no tensor 'lm_head.weight' (shape [64, 32])"});
  s = base;
  s.header[q]["shape"] = {16, 64};
  read_fails(s, {q, "has shape [16, 64], this model's is [32, 32]"});
  s = base;
  s.header[q]["dtype"] = "I32";
  read_fails(s, {q, "is I32, expected F32, BF16 or F16"});

  // The configuration in the metadata: absent (a file PyTorch wrote), malformed, or too big for the data.
  s = base;
  s.header.erase("__metadata__");
  write_bytes(bad, s.bytes());
  expect_error([&] { SafetensorsFile(bad).model_config(); }, {"no metadata 'flashlm.vocab'", "train --init"});
  s = base;
  s.header["__metadata__"]["flashlm.layers"] = "2x";
  write_bytes(bad, s.bytes());
  expect_error([&] { SafetensorsFile(bad).model_config(); }, {"'flashlm.layers' is \"2x\""});
  s = base;
  s.header["__metadata__"]["flashlm.heads"] = "5";
  write_bytes(bad, s.bytes());
  expect_error([&] { SafetensorsFile(bad).model_config(); }, {"not a multiple of heads = 5"});
  s = base;
  s.header["__metadata__"]["flashlm.vocab"] = "1000000";
  s.header["__metadata__"]["flashlm.d_model"] = "1024";
  write_bytes(bad, s.bytes());
  expect_error([&] { SafetensorsFile(bad).model_config(); }, {"more than the", "bytes of data can hold"});
  s.header["__metadata__"]["flashlm.vocab"] = "2000000000";
  s.header["__metadata__"]["flashlm.d_model"] = "2000000000";
  s.header["__metadata__"]["flashlm.heads"] = "1";
  write_bytes(bad, s.bytes());
  expect_error([&] { SafetensorsFile(bad).model_config(); }, {"overflows"});
}

TEST(Safetensors, WeightsComeFromCheckpointsAndExportsAlike) {
  TrainConfig cfg;
  cfg.model = small_model();
  cfg.batch = 2;
  cfg.seq = 16;
  cfg.steps = 3;
  cfg.eval_every = 0;
  cfg.eval_batches = 1;
  cfg.log_every = 0;
  cfg.checkpoint = temp_path("run.ckpt");
  cfg.metrics_log = temp_path("metrics.jsonl");
  train(cfg);
  const ModelWeights from_ckpt = load_model_weights(cfg.checkpoint);
  EXPECT_EQ(from_ckpt.params, checkpoint_parameters(cfg.checkpoint));
  EXPECT_EQ(from_ckpt.config.layers, 1);
  const std::string exported = temp_path("m.safetensors");
  write_safetensors(exported, from_ckpt.config, from_ckpt.params);
  const ModelWeights from_export = load_model_weights(exported);
  EXPECT_EQ(from_export.params, from_ckpt.params);
  EXPECT_EQ(from_export.config.d_model, from_ckpt.config.d_model);

  // One record per step and one for the final evaluation, each with its fields.
  std::ifstream log(cfg.metrics_log);
  std::vector<nlohmann::json> records;
  for (std::string line; std::getline(log, line);) records.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(records.size(), 4u);
  for (int64_t s = 1; s <= 3; ++s) {
    const nlohmann::json& r = records[size_t(s - 1)];
    EXPECT_EQ(r["step"], s);
    for (const char* key : {"loss", "lr", "grad_norm", "loss_scale", "elapsed_s"}) EXPECT_TRUE(r[key].is_number()) << key;
  }
  EXPECT_TRUE(records[0]["ms_per_step"].is_number());  // the first step prints a progress line
  EXPECT_TRUE(records[2]["tokens_per_s"].is_number());  // and so does the last
  EXPECT_EQ(records[3]["step"], 3);
  EXPECT_TRUE(records[3]["val_loss"].is_number());

  // train --init: a run with a zero learning rate keeps the weights it was given, bit for bit.
  TrainConfig again = cfg;
  again.init = exported;
  again.checkpoint = temp_path("init.ckpt");
  again.metrics_log.clear();
  again.steps = 1;
  again.optimizer.lr_max = again.optimizer.lr_min = 0;
  train(again);
  EXPECT_EQ(checkpoint_parameters(again.checkpoint), from_ckpt.params);
  // Without --init the seeded initialisation is there instead.
  again.init.clear();
  train(again);
  EXPECT_NE(checkpoint_parameters(again.checkpoint), from_ckpt.params);

  again.init = exported;
  again.resume = true;
  expect_error([&] { train(again); }, {"--init and --resume"});
  again.resume = false;
  again.model.d_ff = 48;
  expect_error([&] { train(again); }, {"has shape [64, 32], this model's is [48, 32]"});
  again.model = cfg.model;
  again.metrics_log = ::testing::TempDir() + "/missing-dir/m.jsonl";
  expect_error([&] { train(again); }, {"cannot open the metrics log"});
}

// A few hundred KB of '[' once crashed every reader (nlohmann's serializer recursed through the value to
// quote it in the message); and the whole of a bad value went into the message.
TEST(UntrustedJson, DeepNestingAndHugeValuesAreErrorsNotCrashes) {
  constexpr int kDepth = 200'000;
  const std::string deep = std::string(kDepth, '[') + std::string(kDepth, ']');
  const std::string path = temp_path("deep.json");
  const auto refused = [&](const std::function<void()>& read) {
    try {
      read();
      ADD_FAILURE() << "expected flashlm::Error";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("nest deeper than 64 levels"), std::string::npos) << what.substr(0, 300);
      EXPECT_LT(what.size(), 400u) << what.substr(0, 300);
    }
  };
  write_bytes(path, R"({"model": )" + deep + "}");
  refused([&] { Tokenizer::load(path); });
  refused([&] { ModelConfig::from_json(R"({"vocab": )" + deep + "}"); });
  const std::string text = R"({"w": {"dtype": )" + deep + "}}";
  const uint64_t n = text.size();
  write_bytes(path, std::string(reinterpret_cast<const char*>(&n), 8) + text);
  refused([&] { SafetensorsFile f(path); });
  refused([&] { load_model_weights(path); });
  // A checkpoint header with a valid CRC around a nested "format".
  const std::string header = R"({"format": )" + deep + "}";
  std::string prelude = "FLMCKPT2";
  const uint64_t len = header.size();
  prelude.append(reinterpret_cast<const char*>(&len), 8);
  const auto crc = static_cast<uint32_t>(
      crc32_z(crc32_z(0, reinterpret_cast<const Bytef*>(prelude.data()), prelude.size()),
              reinterpret_cast<const Bytef*>(header.data()), header.size()));
  write_bytes(path, prelude + std::string(reinterpret_cast<const char*>(&crc), 4) + header);
  refused([&] { load_model_weights(path); });

  // 64 levels are fine where the value is of the wrong type: the message names it, in part.
  const std::string long_string(100'000, 'x');
  write_bytes(path, R"({"type": ")" + long_string + R"(", "vocab_size": 256})");
  const auto short_message = [&](const std::function<void()>& read, const std::string& fragment) {
    try {
      read();
      ADD_FAILURE() << "expected flashlm::Error";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(fragment), std::string::npos) << what.substr(0, 300);
      EXPECT_NE(what.find("xxx..."), std::string::npos) << what.substr(0, 300);
      EXPECT_LT(what.size(), 400u) << what.substr(0, 300);
    }
  };
  short_message([&] { Tokenizer::load(path); }, "field 'type' is \"xxx");
  const std::string nested = std::string(60, '[') + '"' + long_string + '"' + std::string(60, ']');
  const std::string text2 = R"({"w": {"dtype": "F32", "shape": )" + nested + R"(, "data_offsets": [0, 0]}})";
  const uint64_t n2 = text2.size();
  write_bytes(path, std::string(reinterpret_cast<const char*>(&n2), 8) + text2);
  short_message([&] { SafetensorsFile f(path); }, "tensor 'w': shape [[[");
}

TEST(Tokenizer, FieldsOfTheWrongTypeNameTheFileAndTheField) {
  const std::string path = temp_path("tokenizer.json");
  write_bytes(path, R"({"model": "BPE", "decoder": {"type": "ByteLevel"}})");
  expect_error([&] { Tokenizer::load(path); }, {path, "model is \"BPE\" (string), expected an object"});
  write_bytes(path, R"({"model": {"type": 5, "vocab": {"a": 0}}, "decoder": {"type": "ByteLevel"}})");
  expect_error([&] { Tokenizer::load(path); }, {path, "model.type is 5, expected \"BPE\""});
  write_bytes(path, R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "decoder": {"type": ["ByteLevel"]}})");
  expect_error([&] { Tokenizer::load(path); }, {path, "decoder is {\"type\":[\"ByteLevel\"]}"});
}

// The prompt of a BPE goes to the `tokenizers` package, which takes text only.
TEST(Tokenizer, InvalidUtf8IsFoundWhereItStarts) {
  EXPECT_EQ(invalid_utf8_at("plain \xce\xbb \xe6\x97\xa5 \xf0\x9f\x98\x80"), std::string::npos);
  EXPECT_EQ(invalid_utf8_at("ab\xff"), 2u);
  EXPECT_EQ(invalid_utf8_at("a\xce"), 1u);            // cut short
  EXPECT_EQ(invalid_utf8_at("a\xc0\xaf"), 1u);        // overlong '/'
  EXPECT_EQ(invalid_utf8_at("a\xed\xa0\x80"), 1u);    // a surrogate
  EXPECT_EQ(invalid_utf8_at("a\xf4\x90\x80\x80"), 1u);  // above U+10FFFF
}

// A file size limit stands in for a full disk: a write past it fails (EFBIG, SIGXFSZ ignored) as one past
// the disk's end does (ENOSPC), part way through the dataset.
TEST(Prepare, AFailedWriteLeavesTheOldDatasetWhole) {
  const std::string dir = temp_path("out");
  std::filesystem::create_directories(dir);
  const std::string a = temp_path("a.txt");
  write_bytes(a, std::string(1000, 'o'));
  PrepareConfig cfg;
  cfg.inputs = {a};
  cfg.out_dir = dir;
  cfg.val_fraction = 0.5;
  const PreparedData old = prepare_text_data(cfg);
  const std::string old_train = read_bytes(old.train_path), old_val = read_bytes(old.val_path);
  // 2001 bytes of new text: train.bin gets 1000 tokens (2000 bytes), val.bin 1001 (2002 bytes), so that with
  // files limited to 2000 bytes train.bin is written and val.bin fails.
  write_bytes(a, std::string(2001, 'n'));
  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limit = saved;
  limit.rlim_cur = 2000;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  std::string what;
  try {
    prepare_text_data(cfg);
  } catch (const Error& e) {
    what = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(what.find("failed writing"), std::string::npos) << what;
  EXPECT_NE(what.find(dir + "/val.bin"), std::string::npos) << what;
  EXPECT_EQ(read_bytes(old.train_path), old_train) << "train.bin is not the old one";
  EXPECT_EQ(read_bytes(old.val_path), old_val) << "val.bin is not the old one";
  std::vector<std::string> names;  // and no temporaries
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"tokenizer.json", "train.bin", "val.bin"}));
  // And with room, the new set.
  const PreparedData now = prepare_text_data(cfg);
  EXPECT_EQ(now.train_tokens, 1000);
  EXPECT_EQ(read_bytes(now.val_path).size(), 2002u);
}

TEST(Prepare, EveryInputIsARegularFile) {
  const std::string a = temp_path("a.txt");
  write_bytes(a, "some text");
  EXPECT_EQ(check_prepare_inputs({a, a}), 18u);
  expect_error([&] { check_prepare_inputs({a, "/dev/urandom"}); }, {"'/dev/urandom'", "not a regular file (a device)"});
  expect_error([&] { check_prepare_inputs({::testing::TempDir()}); }, {"not a regular file (a directory)"});
  expect_error([&] { check_prepare_inputs({}); }, {"no input"});
}

TEST(Safetensors, NonFiniteWeightsAreRefusedNamingTheTensor) {
  const ModelConfig c = small_model();
  std::vector<float> params = counting_parameters(c);
  const std::vector<ParameterInfo> layout = parameter_layout(c);
  const std::string path = temp_path("nan.safetensors");
  std::vector<float> out(params.size());
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    std::vector<float> p = params;
    p[size_t(layout[2].offset + 3)] = bad;
    write_safetensors(path, c, p);
    expect_error([&] { SafetensorsFile(path).read_parameters(c, out); },
                 {path, "tensor '" + layout[2].name + "' holds", "at element 3", "must be finite"});
    expect_error([&] { load_model_weights(path); }, {"tensor '" + layout[2].name + "'"});
  }
  // In bf16 too: 0x7f80 is +inf.
  SafetensorsBytes s;
  write_safetensors(path, c, params);
  s = SafetensorsBytes::read(path);
  std::string data;
  for (const ParameterInfo& p : layout) {
    const uint64_t begin = data.size();
    for (int64_t i = 0; i < p.numel(); ++i)  // 1.0, and +inf first in the last tensor
      data += p.name == layout.back().name && i == 0 ? std::string("\x80\x7f", 2) : std::string("\x80\x3f", 2);
    s.header[p.name] = {{"dtype", "BF16"}, {"shape", p.shape}, {"data_offsets", {begin, data.size()}}};
  }
  s.data = data;
  write_bytes(path, s.bytes());
  expect_error([&] { SafetensorsFile(path).read_parameters(c, out); },
               {"tensor '" + layout.back().name + "' holds inf at element 0"});
}

TEST(Safetensors, AShardOfAShardedCheckpointIsNamedAsOne) {
  TrainConfig cfg;
  cfg.model = small_model();
  cfg.batch = 2;
  cfg.seq = 16;
  cfg.steps = 1;
  cfg.eval_every = 0;
  cfg.eval_batches = 1;
  cfg.log_every = 0;
  cfg.checkpoint = temp_path("whole.ckpt");
  train(cfg);
  // A shard as FSDP's rank 1 of 2 writes it: the header says so, and the payload is its slice.
  CheckpointReader whole(cfg.checkpoint);
  CheckpointHeader h = whole.header();
  h.world_size = 2;
  h.shard_rank = 1;
  h.shard_elements = h.parameter_count / 2;
  const std::vector<float> slice(size_t(h.shard_elements), 0.5f);
  const std::string shard = cfg.checkpoint + ".rank1-of-2";
  write_checkpoint(shard, h, slice, slice, slice);
  expect_error([&] { load_model_weights(shard); },
               {shard, "is one shard of a sharded checkpoint (rank 1 of 2", "generate and export read a whole"});
}
