// From text to token files and back: the byte-level tokenizer (vocabulary 256: a token is one byte of the
// UTF-8 text, so every file can be encoded and nothing needs a download), `flashlm prepare`, which turns
// text files into the train/validation token files `flashlm train --data` reads, and the tokenizer file
// saved beside them, which `flashlm generate` decodes through.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace flashlm {

// A tokenizer as saved beside prepared data (tokenizer.json): {"type": "byte", "vocab_size": 256}.
// scripts/prepare_data.py writes BPE tokenizers in the `tokenizers` package's own format instead; this
// class reads only the byte-level one and says so for any other.
class Tokenizer {
 public:
  static constexpr int64_t kByteVocab = 256;

  static Tokenizer bytes();                        // the byte-level tokenizer
  static Tokenizer load(const std::string& path);  // a tokenizer.json; anything else is an Error naming it

  int64_t vocab_size() const { return kByteVocab; }
  std::string name() const { return "byte"; }
  std::vector<int32_t> encode(std::string_view text) const;
  // Every token must be < vocab_size() (an Error names the first that is not).
  std::string decode(std::span<const int32_t> tokens) const;
  std::string json() const;  // what load() reads

 private:
  Tokenizer() = default;
};

struct PrepareConfig {
  std::vector<std::string> inputs;  // text files, concatenated in this order
  std::string out_dir;              // receives train.bin, val.bin and tokenizer.json (it must exist)
  double val_fraction = 0.1;        // the last part of the text, in (0, 0.5]
};

struct PreparedData {
  std::string train_path, val_path, tokenizer_path;
  int64_t train_tokens = 0, val_tokens = 0;
};

// Encodes the inputs with the byte-level tokenizer and writes the last val_fraction of the tokens to
// val.bin, the rest to train.bin (nanoGPT's format: raw little-endian uint16, which TokenFile reads), and
// the tokenizer to tokenizer.json. Every file is written atomically. Fewer than 2 tokens for either split is
// an Error (neither could hold one prediction).
PreparedData prepare_text_data(const PrepareConfig& config);

}  // namespace flashlm
