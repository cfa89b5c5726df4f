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

// A tokenizer as saved beside prepared data (tokenizer.json): flashlm's byte-level one,
// {"type": "byte", "vocab_size": 256}, or a byte-level BPE in the `tokenizers` package's own format, as
// scripts/prepare_data.py trains it (`flashlm prepare --tokenizer bpe`).
//
// The BPE is decoded here and encoded by that script: decoding is a table lookup (each id's string, mapped
// back through GPT-2's byte <-> printable-character table to bytes), cheap enough per streamed token, while
// encoding needs the pre-tokenizer's regular expression with Unicode classes, which only the package that
// trained the vocabulary applies exactly as it did in training.
class Tokenizer {
 public:
  static constexpr int64_t kByteVocab = 256;

  static Tokenizer bytes();                        // the byte-level tokenizer
  static Tokenizer load(const std::string& path);  // a tokenizer.json; anything else is an Error naming it

  bool is_bpe() const { return !pieces_.empty(); }
  int64_t vocab_size() const { return is_bpe() ? static_cast<int64_t>(pieces_.size()) : kByteVocab; }
  std::string name() const { return is_bpe() ? "bpe" : "byte"; }
  // Byte-level only (a BPE is an Error saying to encode through scripts/prepare_data.py).
  std::vector<int32_t> encode(std::string_view text) const;
  // Every token must be < vocab_size() (an Error names the first that is not). The bytes of a BPE's tokens
  // concatenated: one token may end inside a UTF-8 character that the next completes.
  std::string decode(std::span<const int32_t> tokens) const;
  std::string json() const;  // byte-level only: what load() reads

 private:
  Tokenizer() = default;
  std::vector<std::string> pieces_;  // a BPE's bytes per id; empty for the byte-level tokenizer
};

// The offset of the first byte of `text` that is not part of valid UTF-8 (no overlong forms, surrogates or
// code points above U+10FFFF, as Python decodes), or std::string::npos when all of it is.
size_t invalid_utf8_at(std::string_view text);

struct PrepareConfig {
  std::vector<std::string> inputs;  // text files, concatenated in this order
  std::string out_dir;              // receives train.bin, val.bin and tokenizer.json (created, with its parents)
  double val_fraction = 0.1;        // the last part of the text, in (0, 0.5]
};

struct PreparedData {
  std::string train_path, val_path, tokenizer_path;
  int64_t train_tokens = 0, val_tokens = 0;
};

// The rule for prepare's inputs, in both paths (this one and the BPE's, scripts/prepare_data.py): each is a
// regular file (a FIFO or a device such as /dev/urandom would be read without end) of at most
// kMaxPrepareInputBytes, or an Error naming it. Returns their total size in bytes.
inline constexpr uint64_t kMaxPrepareInputBytes = uint64_t{4} << 30;
uint64_t check_prepare_inputs(const std::vector<std::string>& inputs);

// Encodes the inputs with the byte-level tokenizer and writes the last val_fraction of the tokens to
// val.bin, the rest to train.bin (nanoGPT's format: raw little-endian uint16, which TokenFile reads), and
// the tokenizer to tokenizer.json. The three are one dataset, written together: a failure (a full disk) leaves
// the old three as they were (core/file.h, write_files_together). Fewer than 2 tokens for either split is
// an Error (neither could hold one prediction).
PreparedData prepare_text_data(const PrepareConfig& config);

}  // namespace flashlm
