// Training data: token files (nanoGPT's raw .bin and llm.c's headered .bin, uint16 or uint32), a synthetic Markov-chain
// task with a known optimal loss, and TokenBatcher, whose whole state is (seed, step) so that a resumed
// run draws exactly the batches the uninterrupted run would have drawn.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "flashlm/memory.h"


namespace flashlm {

class ReadOnlyFile;  // src/core/file.h

enum class TokenFormat : uint8_t {
  nanogpt,  // a flat array of little-endian uint16 tokens (np.array(ids, dtype=np.uint16).tofile(f))
  llmc,     // 256 int32 header (magic 20240520, version 1, token count), then the uint16 tokens
  // llm.c's LLaMA-3 files: the same header with magic 20240801 and version 7, then uint32 tokens. flashlm
  // prepare writes this one when the vocabulary outgrows uint16 (more than 65536 tokens).
  llmc_uint32,
};

// Bytes per token in a file of this format: 2, or 4 for llmc_uint32.
int token_bytes(TokenFormat format);

// A read-only token file. The format is detected from the first int32 (an llm.c magic; read as two raw
// tokens 20240520 is 56824, 308, and 56824 is beyond GPT-2's 50257-token vocabulary). Every inconsistency between
// the file's size and its header is a flashlm::Error naming the path. Anything but a regular file (a FIFO,
// a directory, a device) is refused before it is read.
//
// Tokens are read with pread() when asked for, not memory-mapped: corpora run to tens of GB, reading a
// batch's rows costs a few system calls per train step, and a file truncated by another process while a run
// reads it then gives a short read, an Error naming the file, where a mapping would kill the process with
// SIGBUS (catching that signal would need a process-wide handler that MPI and CUDA also claim).
class TokenFile {
 public:
  // vocab_size > 0 also runs validate_tokens(vocab_size); 0 skips the check.
  explicit TokenFile(std::string path, int64_t vocab_size = 0);
  TokenFile(TokenFile&&) noexcept;
  TokenFile& operator=(TokenFile&&) noexcept;
  ~TokenFile();

  int64_t size() const { return count_; }  // tokens
  TokenFormat format() const { return format_; }
  const std::string& path() const { return path_; }

  int token_bytes() const { return flashlm::token_bytes(format_); }

  // Tokens [first, first + out.size()) into out. A range beyond size() is an Error, and so is a file
  // that has shrunk since it was opened. The uint16 overload reads 2-byte files only (a uint32 file is an
  // Error); the uint32 one reads both.
  void read(int64_t first, std::span<uint16_t> out) const;
  void read(int64_t first, std::span<uint32_t> out) const;

  // Throws, naming the first position whose token is >= vocab_size. Reads the whole file, in chunks.
  void validate_tokens(int64_t vocab_size) const;

 private:
  std::string path_;
  std::unique_ptr<const ReadOnlyFile> file_;
  uint64_t first_byte_ = 0;  // where the tokens start: after llm.c's header
  int64_t count_ = 0;
  TokenFormat format_ = TokenFormat::nanogpt;
};

// A contiguous run of tokens that a batcher cuts sequences from: in memory (synthetic data; uint16, or
// uint32 for a vocabulary beyond 65536) or a range of a TokenFile. Neither is owned: the memory or the file
// must outlive the view.
class TokenView {
 public:
  TokenView() = default;
  TokenView(std::span<const uint16_t> memory)  // NOLINT(google-explicit-constructor): a span is a view
      : memory_(memory), size_(static_cast<int64_t>(memory.size())) {}
  TokenView(const std::vector<uint16_t>& memory)  // NOLINT(google-explicit-constructor): as its span
      : TokenView(std::span<const uint16_t>(memory)) {}
  TokenView(std::span<const uint32_t> memory)  // NOLINT(google-explicit-constructor): a span is a view
      : wide_memory_(memory), memory_bytes_(4), size_(static_cast<int64_t>(memory.size())) {}
  TokenView(const std::vector<uint32_t>& memory)  // NOLINT(google-explicit-constructor): as its span
      : TokenView(std::span<const uint32_t>(memory)) {}
  // The view refers to the TokenFile object itself: it must not be moved while the view is in use.
  TokenView(const TokenFile& file)  // NOLINT(google-explicit-constructor): so is a whole file
      : file_(&file), size_(file.size()) {}

  int64_t size() const { return size_; }
  int token_bytes() const { return file_ != nullptr ? file_->token_bytes() : memory_bytes_; }
  // Tokens [offset, offset + count) of this view; the range must lie inside it.
  TokenView subview(int64_t offset, int64_t count) const;
  // Tokens [first, first + out.size()) of this view into out (uint16: 2-byte tokens only, as TokenFile;
  // 4-byte ones are an Error there).
  void read(int64_t first, std::span<uint16_t> out) const;
  void read(int64_t first, std::span<uint32_t> out) const;

 private:
  template <class T>
  void read_into(int64_t first, std::span<T> out) const;
  const TokenFile* file_ = nullptr;
  std::span<const uint16_t> memory_;       // 2-byte tokens in memory
  std::span<const uint32_t> wide_memory_;  // 4-byte tokens in memory
  int memory_bytes_ = 2;
  int64_t offset_ = 0, size_ = 0;
};

// A learnable stand-in for a corpus (`--data synthetic`): a random walk on a fixed, seeded "successor"
// table in which every token has `branching` distinct successors, each followed with probability
// 1/branching. Given the current token, the next one has entropy ln(branching) whatever came before, so
// optimal_cross_entropy() = ln(branching) nats is the best loss any model can reach, against ln(vocab_size)
// for a uniform guess (ln 4 = 1.386 vs ln 256 = 5.545 for the defaults a tiny model trains on).
class SyntheticTokens {
 public:
  static constexpr int kMaxBranching = 256;  // keeps the successor table (vocab x branching) small

  // vocab_size in [branching, 2^31) (ModelConfig's int32 token ids), num_tokens >= 2, branching in [1, 256].
  // The tokens are stored as uint16 up to a vocabulary of 65536 and as uint32 beyond (token_bytes()); the
  // walk is the same at both widths, so a vocabulary that fits uint16 keeps the data it always had.
  SyntheticTokens(int64_t vocab_size, int64_t num_tokens, uint64_t seed, int branching = 4);

  static int token_bytes_for(int64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }
  int token_bytes() const { return token_bytes_for(vocab_size_); }
  // The whole walk, at the stored width.
  TokenView tokens() const;
  uint32_t token(int64_t i) const;  // token i < size(), whatever the width
  int64_t size() const { return num_tokens_; }
  int64_t vocab_size() const { return vocab_size_; }
  int branching() const { return branching_; }
  double optimal_cross_entropy() const;  // nats per token: ln(branching)

 private:
  Buffer buffer_;  // num_tokens uint16 or uint32 (token_bytes()), through the tracked allocator
  int64_t vocab_size_ = 0;
  int64_t num_tokens_ = 0;
  int branching_ = 0;
};

enum class BatchOrder : uint8_t {
  // Windows at token offsets 0, T, 2T, ... in order, B per batch, wrapping to the first window after
  // the last: for validation, where every run must score the same tokens.
  sequential,
  // Each row starts at an independent uniform offset in [0, n - T - 1]: for training.
  random,
};

// Everything a checkpoint needs to resume a batcher: restore(state()) makes the following next() calls
// produce exactly what they would have. Trivially copyable, so it can be written as raw bytes.
struct BatcherState {
  uint64_t seed = 0;  // used only by BatchOrder::random
  int64_t step = 0;   // batches drawn so far
};
static_assert(std::is_trivially_copyable_v<BatcherState>);

// Cuts next-token-prediction batches out of a token sequence: inputs[b][t] = tokens[s_b + t] and
// targets[b][t] = tokens[s_b + t + 1], for t < T. Batch `step` is a pure function of (seed, step) — a
// counter-based hash gives the random offsets — so there is no generator state to save besides the step.
// The batcher does not own the tokens: the TokenFile or SyntheticTokens must outlive it.
class TokenBatcher {
 public:
  // `name` (the file's path, or "synthetic") is what errors report. The sequence must hold at least
  // context + 1 tokens, so that one window has its targets.
  TokenBatcher(TokenView tokens, std::string_view name, int64_t batch, int64_t context,
               BatchOrder order, uint64_t seed = 0);

  // Fills inputs and targets, each batch * context int32 in row-major [batch][context] order (int32: the
  // index type embedding and loss kernels take; token ids were checked against the vocabulary, and
  // ModelConfig bounds it far below 2^31), and advances.
  void next(std::span<int32_t> inputs, std::span<int32_t> targets);

  BatcherState state() const { return {seed_, step_}; }
  void restore(const BatcherState& state);

  // Data parallelism: rank `index` of `count` takes rows [index · batch, (index + 1) · batch) of the batches
  // that a batcher of batch · count rows would cut, so the ranks together read what one process reads with
  // the global batch.
  void select_shard(int64_t index, int64_t count);

  int64_t batch() const { return batch_; }
  int64_t context() const { return context_; }
  // The number of distinct sequential windows, floor((n - 1) / T): ceil(windows() / batch()) sequential
  // batches cover every window once (the last batch wraps to the first windows).
  int64_t windows() const { return windows_; }

 private:
  TokenView tokens_;
  std::vector<uint32_t> row_;  // the context + 1 tokens of one row, as read
  int64_t batch_ = 0;
  int64_t context_ = 0;
  int64_t windows_ = 0;
  BatchOrder order_ = BatchOrder::random;
  uint64_t seed_ = 0;
  int64_t step_ = 0;
  int64_t shard_ = 0, shards_ = 1;
};

}  // namespace flashlm
