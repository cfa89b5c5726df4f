#include "flashlm/text.h"

#include <bit>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/file.h"

namespace flashlm {

static_assert(std::endian::native == std::endian::little, "token files are written as little-endian");

namespace {

// A tokenizer.json holds a few dozen bytes; a larger one is not ours.
constexpr uint64_t kMaxTokenizerBytes = uint64_t{1} << 20;

std::string read_whole(const std::string& path, std::string_view owner, uint64_t max_bytes) {
  const ReadOnlyFile file(path, owner);
  FLASHLM_CHECK(file.size() <= max_bytes, "{}: '{}' has {} bytes, more than the {} this reads", owner, path,
                file.size(), max_bytes);
  std::string text(static_cast<size_t>(file.size()), '\0');
  file.read_at(0, std::as_writable_bytes(std::span(text.data(), text.size())));
  return text;
}

}  // namespace

Tokenizer Tokenizer::bytes() { return Tokenizer(); }

Tokenizer Tokenizer::load(const std::string& path) {
  const std::string text = read_whole(path, "tokenizer", kMaxTokenizerBytes);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    fail("tokenizer: '{}' is not valid JSON", path);
  }
  FLASHLM_CHECK(j.is_object(), "tokenizer: '{}' is {}, expected a JSON object", path, std::string(j.type_name()));
  // The `tokenizers` package's files have a "model" object and no "type".
  FLASHLM_CHECK(!j.contains("model") || j.contains("type"),
                "tokenizer: '{}' is a BPE tokenizer of the `tokenizers` package; flashlm's C++ side reads the "
                "byte-level tokenizer only: encode and decode with scripts/prepare_data.py",
                path);
  const auto type = j.find("type");
  FLASHLM_CHECK(type != j.end() && type->is_string() && type->get<std::string>() == "byte",
                "tokenizer: '{}': field 'type' is {}, expected \"byte\"", path,
                type == j.end() ? std::string("missing") : type->dump());
  const auto vocab = j.find("vocab_size");
  FLASHLM_CHECK(vocab != j.end() && vocab->is_number_integer() && vocab->get<int64_t>() == kByteVocab,
                "tokenizer: '{}': field 'vocab_size' is {}, expected {} for the byte-level tokenizer", path,
                vocab == j.end() ? std::string("missing") : vocab->dump(), kByteVocab);
  return Tokenizer();
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> tokens) const {
  std::string out(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    FLASHLM_CHECK(tokens[i] >= 0 && tokens[i] < kByteVocab,
                  "Tokenizer::decode: tokens[{}] = {} outside the byte vocabulary [0, {})", i, tokens[i], kByteVocab);
    out[i] = static_cast<char>(static_cast<unsigned char>(tokens[i]));
  }
  return out;
}

std::string Tokenizer::json() const {
  return nlohmann::json{{"type", name()}, {"vocab_size", vocab_size()}}.dump() + "\n";
}

PreparedData prepare_text_data(const PrepareConfig& c) {
  FLASHLM_CHECK(!c.inputs.empty(), "prepare: no input text files");
  FLASHLM_CHECK(std::isfinite(c.val_fraction) && c.val_fraction > 0 && c.val_fraction <= 0.5,
                "prepare: val_fraction = {}, expected a number in (0, 0.5]", c.val_fraction);
  FLASHLM_CHECK(std::filesystem::is_directory(c.out_dir), "prepare: the output directory '{}' does not exist",
                c.out_dir);
  const Tokenizer tokenizer = Tokenizer::bytes();
  std::vector<uint16_t> tokens;
  for (const std::string& path : c.inputs) {
    // Text files of tens of GB want a streaming tokenizer; this one holds the corpus, so it takes <= 4 GiB.
    const std::string text = read_whole(path, "prepare", uint64_t{4} << 30);
    for (int32_t t : tokenizer.encode(text)) tokens.push_back(static_cast<uint16_t>(t));
  }
  const auto total = static_cast<int64_t>(tokens.size());
  const auto val = static_cast<int64_t>(std::ceil(c.val_fraction * static_cast<double>(total)));
  FLASHLM_CHECK(val >= 2 && total - val >= 2,
                "prepare: {} tokens in all, {} of them for validation: each split needs at least 2 (give more text "
                "or another val_fraction)",
                total, val);
  PreparedData out;
  const std::filesystem::path dir(c.out_dir);
  out.train_path = (dir / "train.bin").string();
  out.val_path = (dir / "val.bin").string();
  out.tokenizer_path = (dir / "tokenizer.json").string();
  out.train_tokens = total - val;
  out.val_tokens = val;
  const std::span<const uint16_t> all(tokens);
  const auto write_tokens = [](const std::string& path, std::span<const uint16_t> part) {
    const std::span<const std::byte> parts[] = {std::as_bytes(part)};
    write_file_atomically(path, parts, "prepare");
  };
  write_tokens(out.train_path, all.first(static_cast<size_t>(out.train_tokens)));
  write_tokens(out.val_path, all.last(static_cast<size_t>(out.val_tokens)));
  const std::string json = tokenizer.json();
  const std::span<const std::byte> parts[] = {std::as_bytes(std::span(json.data(), json.size()))};
  write_file_atomically(out.tokenizer_path, parts, "prepare");
  return out;
}

}  // namespace flashlm
