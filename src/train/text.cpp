#include "flashlm/text.h"

#include <array>
#include <bit>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/file.h"
#include "core/json.h"

namespace flashlm {

static_assert(std::endian::native == std::endian::little, "token files are written as little-endian");

namespace {

// A byte-level tokenizer.json holds a few dozen bytes; a BPE's grows with its vocabulary and merges
// (about 2 MB for GPT-2's 50257 tokens); beyond this it is not a tokenizer prepare wrote.
constexpr uint64_t kMaxTokenizerBytes = uint64_t{256} << 20;
// A vocabulary id must stay a valid int32 token and index; ModelConfig bounds vocab the same way.
constexpr int64_t kMaxBpeVocab = int64_t{1} << 24;

std::string read_whole(const std::string& path, std::string_view owner, uint64_t max_bytes) {
  const ReadOnlyFile file(path, owner);
  FLASHLM_CHECK(file.size() <= max_bytes, "{}: '{}' has {} bytes, more than the {} this reads", owner, path,
                file.size(), max_bytes);
  std::string text(static_cast<size_t>(file.size()), '\0');
  file.read_at(0, std::as_writable_bytes(std::span(text.data(), text.size())));
  return text;
}

// GPT-2's byte-level alphabet, as the `tokenizers` package's ByteLevel pre-tokenizer uses it: the printable
// bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) stand for themselves as code points, and the other 68 bytes, in
// order, for U+0100 onwards, so that every byte is a visible character in the vocabulary's strings.
// Returns the byte each code point stands for, or -1.
int byte_of_code_point(uint32_t cp) {
  static const std::array<int16_t, 256 + 68> table = [] {
    std::array<int16_t, 256 + 68> t{};
    t.fill(-1);
    uint32_t shifted = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[printable ? static_cast<size_t>(b) : shifted++] = static_cast<int16_t>(b);
    }
    return t;
  }();
  return cp < table.size() ? table[cp] : -1;
}

// Decodes one UTF-8 code point at s[at], advancing at; -1 for a malformed sequence.
int64_t next_code_point(std::string_view s, size_t& at) {
  const auto c = static_cast<unsigned char>(s[at++]);
  int extra = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : -1;
  if (extra < 0) return -1;
  uint32_t cp = extra == 0 ? c : c & (0x3F >> extra);
  for (int i = 0; i < extra; ++i) {
    if (at >= s.size() || (static_cast<unsigned char>(s[at]) & 0xC0) != 0x80) return -1;
    cp = (cp << 6) | (static_cast<unsigned char>(s[at++]) & 0x3F);
  }
  return cp;
}

// A vocabulary string of the byte-level alphabet, back to the bytes it stands for.
std::string bytes_of_piece(const std::string& path, std::string_view piece, int64_t id) {
  std::string out;
  for (size_t at = 0; at < piece.size();) {
    const int64_t cp = next_code_point(piece, at);
    const int b = cp < 0 ? -1 : byte_of_code_point(static_cast<uint32_t>(cp));
    FLASHLM_CHECK(b >= 0,
                  "tokenizer: '{}': token {} ({}) holds a character outside the byte-level alphabet: this reads "
                  "byte-level BPEs only (scripts/prepare_data.py's)",
                  path, id, json_excerpt(std::string(piece)));
    out.push_back(static_cast<char>(b));
  }
  return out;
}

std::string describe(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  return it == j.end() ? std::string("missing") : json_excerpt(*it);
}

// An object's string field, or "" when it is missing or not a string (the caller's message then says what it is).
std::string string_field(const nlohmann::json& object, const char* key) {
  const auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// The `tokenizers` package's tokenizer.json: model.vocab (string -> id) and added_tokens ({id, content}),
// every id in [0, size) once.
std::vector<std::string> load_bpe_pieces(const std::string& path, const nlohmann::json& j) {
  const nlohmann::json& model = j.at("model");
  FLASHLM_CHECK(model.is_object(), "tokenizer: '{}': model is {} ({}), expected an object with \"type\": \"BPE\"",
                path, json_excerpt(model), std::string(model.type_name()));
  FLASHLM_CHECK(string_field(model, "type") == "BPE", "tokenizer: '{}': model.type is {}, expected \"BPE\"", path,
                describe(model, "type"));
  const auto decoder = j.find("decoder");
  FLASHLM_CHECK(decoder != j.end() && decoder->is_object() && string_field(*decoder, "type") == "ByteLevel",
                "tokenizer: '{}': decoder is {}, expected a ByteLevel decoder (this reads byte-level BPEs only)",
                path, decoder == j.end() ? std::string("missing") : json_excerpt(*decoder));
  const auto vocab = model.find("vocab");
  FLASHLM_CHECK(vocab != model.end() && vocab->is_object() && !vocab->empty(),
                "tokenizer: '{}': model.vocab is {}, expected an object of token -> id", path, describe(model, "vocab"));
  std::vector<std::pair<int64_t, std::string>> entries;
  for (const auto& [piece, id] : vocab->items()) {
    FLASHLM_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < kMaxBpeVocab,
                  "tokenizer: '{}': model.vocab[{}] is {}, expected an id in [0, {})", path,
                  json_excerpt(piece), json_excerpt(id), kMaxBpeVocab);
    entries.emplace_back(id.get<int64_t>(), bytes_of_piece(path, piece, id.get<int64_t>()));
  }
  if (const auto added = j.find("added_tokens"); added != j.end() && !added->is_null()) {
    FLASHLM_CHECK(added->is_array(), "tokenizer: '{}': added_tokens is {}, expected an array", path,
                  std::string(added->type_name()));
    for (const auto& t : *added) {
      const auto id = t.is_object() ? t.find("id") : t.end();
      const auto content = t.is_object() ? t.find("content") : t.end();
      FLASHLM_CHECK(id != t.end() && content != t.end() && id->is_number_integer() && content->is_string() &&
                        id->get<int64_t>() >= 0 && id->get<int64_t>() < kMaxBpeVocab,
                    "tokenizer: '{}': an added token is {}, expected {{\"id\": an id in [0, {}), \"content\": a "
                    "string}}",
                    path, json_excerpt(t), kMaxBpeVocab);
      // Added tokens are stored as their text, not in the byte-level alphabet.
      entries.emplace_back(id->get<int64_t>(), content->get<std::string>());
    }
  }
  std::vector<std::string> pieces(entries.size());
  std::vector<bool> seen(entries.size(), false);
  for (auto& [id, bytes] : entries) {
    FLASHLM_CHECK(id < static_cast<int64_t>(entries.size()) && !seen[static_cast<size_t>(id)],
                  "tokenizer: '{}': the {} tokens' ids are not 0..{} each once (id {} is {})", path, entries.size(),
                  entries.size() - 1, id, id < static_cast<int64_t>(entries.size()) ? "repeated" : "out of range");
    seen[static_cast<size_t>(id)] = true;
    pieces[static_cast<size_t>(id)] = std::move(bytes);
  }
  return pieces;
}

// prepare --out data should work in a fresh checkout, as mkdir -p would: the directory and its parents.
void create_output_directory(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  FLASHLM_CHECK(!ec && std::filesystem::is_directory(dir), "prepare: cannot create the output directory '{}': {}",
                dir.string(), ec ? ec.message() : "a file of that name is in the way");
}

}  // namespace

Tokenizer Tokenizer::bytes() { return Tokenizer(); }

Tokenizer Tokenizer::load(const std::string& path) {
  const std::string text = read_whole(path, "tokenizer", kMaxTokenizerBytes);
  const nlohmann::json j = parse_untrusted_json(text, fmt::format("tokenizer: '{}'", path), kMaxTokenizerBytes);
  FLASHLM_CHECK(j.is_object(), "tokenizer: '{}' is {}, expected a JSON object", path, std::string(j.type_name()));
  // The `tokenizers` package's files have a "model" object and no "type".
  if (j.contains("model") && !j.contains("type")) {
    Tokenizer t;
    t.pieces_ = load_bpe_pieces(path, j);
    return t;
  }
  const auto type = j.find("type");
  FLASHLM_CHECK(type != j.end() && type->is_string() && type->get<std::string>() == "byte",
                "tokenizer: '{}': field 'type' is {}, expected \"byte\" (or a `tokenizers` BPE with a \"model\")",
                path, type == j.end() ? std::string("missing") : json_excerpt(*type));
  const auto vocab = j.find("vocab_size");
  FLASHLM_CHECK(vocab != j.end() && vocab->is_number_integer() && vocab->get<int64_t>() == kByteVocab,
                "tokenizer: '{}': field 'vocab_size' is {}, expected {} for the byte-level tokenizer", path,
                vocab == j.end() ? std::string("missing") : json_excerpt(*vocab), kByteVocab);
  return Tokenizer();
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  FLASHLM_CHECK(!is_bpe(), "Tokenizer::encode: a BPE is encoded by scripts/prepare_data.py encode (the "
                           "`tokenizers` package that trained it), not here");
  std::vector<int32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> tokens) const {
  std::string out;
  out.reserve(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    FLASHLM_CHECK(tokens[i] >= 0 && tokens[i] < vocab_size(),
                  "Tokenizer::decode: tokens[{}] = {} outside the {} vocabulary [0, {})", i, tokens[i], name(),
                  vocab_size());
    if (is_bpe()) {
      out += pieces_[static_cast<size_t>(tokens[i])];
    } else {
      out.push_back(static_cast<char>(static_cast<unsigned char>(tokens[i])));
    }
  }
  return out;
}

std::string Tokenizer::json() const {
  FLASHLM_CHECK(!is_bpe(), "Tokenizer::json: a BPE's tokenizer.json is the `tokenizers` package's own file");
  return nlohmann::json{{"type", name()}, {"vocab_size", vocab_size()}}.dump() + "\n";
}

uint64_t check_prepare_inputs(const std::vector<std::string>& inputs) {
  FLASHLM_CHECK(!inputs.empty(), "prepare: no input text files");
  uint64_t total = 0;
  for (const std::string& path : inputs) {
    const ReadOnlyFile file(path, "prepare");
    // Text files of tens of GB want a streaming tokenizer; both paths hold the corpus in memory.
    FLASHLM_CHECK(file.size() <= kMaxPrepareInputBytes, "prepare: '{}' has {} bytes, more than the {} this reads",
                  path, file.size(), kMaxPrepareInputBytes);
    total += file.size();
  }
  return total;
}

size_t invalid_utf8_at(std::string_view text) {
  for (size_t at = 0; at < text.size();) {
    const size_t start = at;
    const int64_t cp = next_code_point(text, at);
    const size_t length = at - start;
    const size_t shortest = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    if (cp < 0 || length != shortest || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return start;
  }
  return std::string::npos;
}

PreparedData prepare_text_data(const PrepareConfig& c) {
  check_prepare_inputs(c.inputs);
  FLASHLM_CHECK(std::isfinite(c.val_fraction) && c.val_fraction > 0 && c.val_fraction <= 0.5,
                "prepare: val_fraction = {}, expected a number in (0, 0.5]", c.val_fraction);
  const Tokenizer tokenizer = Tokenizer::bytes();
  std::vector<uint16_t> tokens;
  for (const std::string& path : c.inputs) {
    const std::string text = read_whole(path, "prepare", kMaxPrepareInputBytes);
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
  create_output_directory(dir);
  out.train_path = (dir / "train.bin").string();
  out.val_path = (dir / "val.bin").string();
  out.tokenizer_path = (dir / "tokenizer.json").string();
  out.train_tokens = total - val;
  out.val_tokens = val;
  const std::span<const uint16_t> all(tokens);
  const std::string json = tokenizer.json();
  const std::span<const std::byte> train_part[] = {std::as_bytes(all.first(static_cast<size_t>(out.train_tokens)))};
  const std::span<const std::byte> val_part[] = {std::as_bytes(all.last(static_cast<size_t>(out.val_tokens)))};
  const std::span<const std::byte> json_part[] = {std::as_bytes(std::span(json.data(), json.size()))};
  const FileToWrite files[] = {{out.train_path, train_part}, {out.val_path, val_part}, {out.tokenizer_path, json_part}};
  write_files_together(files, "prepare");
  return out;
}

}  // namespace flashlm
