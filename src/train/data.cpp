#include "flashlm/data.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/file.h"
#include "core/random.h"

namespace flashlm {

// Both formats store tokens (and llm.c its header) little-endian, and they are read without conversion.
static_assert(std::endian::native == std::endian::little, "token files are read as little-endian");

namespace {

constexpr int32_t kLlmcMagic = 20240520;
constexpr int32_t kLlmcVersion = 1;  // uint16 tokens
constexpr int32_t kLlmc32Magic = 20240801;
constexpr int32_t kLlmc32Version = 7;  // uint32 tokens (llm.c's LLaMA-3 files)
constexpr size_t kLlmcHeaderInts = 256;
constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);

// validate_tokens reads this many tokens per pread: 1 MiB, big enough that the system calls cost nothing.
constexpr size_t kValidateChunkTokens = size_t{1} << 19;

// A draw mapped to [0, range) by a 64x64 -> 128-bit multiply (Lemire): no division, and the bias,
// range / 2^64, is far below anything a training run could notice.
uint64_t below(uint64_t bits, uint64_t range) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(bits) * range) >> 64);
}

// Distinct streams from one user seed, so the synthetic table, its walk and the batch offsets are
// independent even when they share a seed.
constexpr uint64_t kTableStream = 0x7461626c65ull;  // "table"
constexpr uint64_t kWalkStream = 0x77616c6bull;     // "walk"
constexpr uint64_t kBatchStream = 0x6261746368ull;  // "batch"

void check_file_range(const std::string& path, int64_t first, int64_t count, int64_t total) {
  FLASHLM_CHECK(first >= 0 && first <= total && count <= total - first,
                "TokenFile::read: '{}': tokens [{}, {}) are outside the file's {} tokens", path, first, first + count,
                total);
}

}  // namespace

int token_bytes(TokenFormat format) { return format == TokenFormat::llmc_uint32 ? 4 : 2; }

TokenFile::TokenFile(std::string path, int64_t vocab_size)
    : path_(path), file_(std::make_unique<const ReadOnlyFile>(std::move(path), "TokenFile")) {
  const uint64_t size = file_->size();
  FLASHLM_CHECK(size > 0, "TokenFile: '{}': the file is empty", path_);
  int32_t magic = 0;
  if (size >= sizeof(magic)) file_->read_at(0, std::as_writable_bytes(std::span(&magic, 1)));
  if (magic == kLlmcMagic || magic == kLlmc32Magic) {
    format_ = magic == kLlmcMagic ? TokenFormat::llmc : TokenFormat::llmc_uint32;
    const int32_t version = magic == kLlmcMagic ? kLlmcVersion : kLlmc32Version;
    const char* dtype = magic == kLlmcMagic ? "uint16" : "uint32";
    FLASHLM_CHECK(size >= kLlmcHeaderBytes,
                  "TokenFile: '{}': truncated llm.c header: the file has {} bytes, the header alone needs {}",
                  path_, size, kLlmcHeaderBytes);
    int32_t header[kLlmcHeaderInts];
    file_->read_at(0, std::as_writable_bytes(std::span(header)));
    FLASHLM_CHECK(header[1] == version,
                  "TokenFile: '{}': unsupported llm.c version {} for magic {} (expected {}: {} tokens)", path_,
                  header[1], magic, version, dtype);
    const int64_t ntok = header[2];
    FLASHLM_CHECK(ntok >= 0, "TokenFile: '{}': the llm.c header's token count is negative ({})", path_, ntok);
    FLASHLM_CHECK(ntok > 0, "TokenFile: '{}': the llm.c header's token count is 0: no tokens", path_);
    // ntok < 2^31 and 4-byte tokens: no overflow.
    const uint64_t expected = kLlmcHeaderBytes + static_cast<uint64_t>(ntok) * static_cast<uint64_t>(token_bytes());
    FLASHLM_CHECK(size >= expected,
                  "TokenFile: '{}': truncated llm.c file: the header's token count {} needs {} bytes, the file "
                  "has {}",
                  path_, ntok, expected, size);
    FLASHLM_CHECK(size == expected,
                  "TokenFile: '{}': the llm.c header's token count {} needs {} bytes, but the file has {} "
                  "({} bytes too many)",
                  path_, ntok, expected, size, size - expected);
    first_byte_ = kLlmcHeaderBytes;
    count_ = ntok;
  } else {
    format_ = TokenFormat::nanogpt;
    FLASHLM_CHECK(size % sizeof(uint16_t) == 0,
                  "TokenFile: '{}': the size, {} bytes, is odd: a raw nanoGPT file holds uint16 tokens "
                  "(and its first int32 is neither of llm.c's magics {} and {})",
                  path_, size, kLlmcMagic, kLlmc32Magic);
    first_byte_ = 0;
    count_ = static_cast<int64_t>(size / sizeof(uint16_t));
  }
  if (vocab_size != 0) validate_tokens(vocab_size);
}

// A moved-from file holds no tokens.
TokenFile::TokenFile(TokenFile&& o) noexcept { *this = std::move(o); }

TokenFile& TokenFile::operator=(TokenFile&& o) noexcept {
  path_ = std::move(o.path_);
  file_ = std::move(o.file_);
  first_byte_ = o.first_byte_;
  count_ = std::exchange(o.count_, 0);
  format_ = o.format_;
  return *this;
}

TokenFile::~TokenFile() = default;

void TokenFile::read(int64_t first, std::span<uint16_t> out) const {
  FLASHLM_CHECK(token_bytes() == 2,
                "TokenFile::read: '{}' holds uint32 tokens: read them into uint32 (this overload takes uint16)", path_);
  check_file_range(path_, first, static_cast<int64_t>(out.size()), count_);
  file_->read_at(first_byte_ + static_cast<uint64_t>(first) * sizeof(uint16_t), std::as_writable_bytes(out));
}

void TokenFile::read(int64_t first, std::span<uint32_t> out) const {
  if (token_bytes() == 4) {
    check_file_range(path_, first, static_cast<int64_t>(out.size()), count_);
    file_->read_at(first_byte_ + static_cast<uint64_t>(first) * sizeof(uint32_t), std::as_writable_bytes(out));
    return;
  }
  // 2-byte tokens: read them into the front half of out, then widen from the back, where no unread token is
  // overwritten (token i's 4 bytes start at 4i, at or past the 2i where it was read).
  std::span<uint16_t> narrow(reinterpret_cast<uint16_t*>(out.data()), out.size());
  read(first, narrow);
  for (size_t i = out.size(); i-- > 0;) {
    uint16_t t;
    std::memcpy(&t, reinterpret_cast<const std::byte*>(out.data()) + i * sizeof(uint16_t), sizeof t);
    out[i] = t;
  }
}

void TokenFile::validate_tokens(int64_t vocab_size) const {
  FLASHLM_CHECK(vocab_size > 0, "TokenFile::validate_tokens: '{}': vocab_size must be positive, got {}", path_,
                vocab_size);
  std::vector<uint32_t> chunk(static_cast<size_t>(std::min<int64_t>(count_, kValidateChunkTokens)));
  for (int64_t at = 0; at < count_; at += static_cast<int64_t>(chunk.size())) {
    const std::span<uint32_t> part(chunk.data(), static_cast<size_t>(std::min<int64_t>(count_ - at, chunk.size())));
    read(at, part);
    for (size_t i = 0; i < part.size(); ++i) {
      FLASHLM_CHECK(part[i] < vocab_size,
                    "TokenFile: '{}': token {} at position {} is outside the vocabulary (vocab_size = {})", path_,
                    part[i], at + static_cast<int64_t>(i), vocab_size);
    }
  }
}

TokenView TokenView::subview(int64_t offset, int64_t count) const {
  FLASHLM_CHECK(offset >= 0 && count >= 0 && offset <= size_ && count <= size_ - offset,
                "TokenView::subview: [{}, {}) is outside the view's {} tokens", offset, offset + count, size_);
  TokenView v = *this;
  v.offset_ = offset_ + offset;
  v.size_ = count;
  return v;
}

template <class T>
void TokenView::read_into(int64_t first, std::span<T> out) const {
  const auto count = static_cast<int64_t>(out.size());
  FLASHLM_CHECK(first >= 0 && first <= size_ && count <= size_ - first,
                "TokenView::read: tokens [{}, {}) are outside the view's {} tokens", first, first + count, size_);
  if (file_ != nullptr) {
    file_->read(offset_ + first, out);
  } else if (memory_bytes_ == 4) {
    if constexpr (sizeof(T) == sizeof(uint32_t)) {
      std::copy_n(wide_memory_.begin() + offset_ + first, out.size(), out.begin());
    } else {
      fail_argument("TokenView::read: the view holds uint32 tokens: read them into uint32 (this overload takes uint16)");
    }
  } else {
    std::copy_n(memory_.begin() + offset_ + first, out.size(), out.begin());
  }
}

void TokenView::read(int64_t first, std::span<uint16_t> out) const { read_into(first, out); }
void TokenView::read(int64_t first, std::span<uint32_t> out) const { read_into(first, out); }

SyntheticTokens::SyntheticTokens(int64_t vocab_size, int64_t num_tokens, uint64_t seed, int branching)
    : vocab_size_(vocab_size), num_tokens_(num_tokens), branching_(branching) {
  FLASHLM_CHECK(branching >= 1 && branching <= kMaxBranching,
                "SyntheticTokens: branching must be in [1, {}], got {}", kMaxBranching, branching);
  FLASHLM_CHECK(vocab_size >= branching && vocab_size < (int64_t{1} << 31),
                "SyntheticTokens: vocab_size must be in [branching = {}, 2^31) (int32 token ids), got {}", branching,
                vocab_size);
  FLASHLM_CHECK(num_tokens >= 2, "SyntheticTokens: num_tokens must be at least 2, got {}", num_tokens);

  // successors[v * branching + j]: the j-th successor of token v. A partial Fisher-Yates shuffle of one
  // permutation per token makes the successors of a token distinct (duplicates would lower the entropy
  // below ln(branching)); the permutation stays a permutation, so it need not be reset between tokens.
  const auto V = static_cast<uint64_t>(vocab_size);
  const auto k = static_cast<uint64_t>(branching);
  std::vector<uint32_t> perm(V);
  std::iota(perm.begin(), perm.end(), uint32_t{0});  // ids 0 .. V-1 fit: V < 2^31
  std::vector<uint32_t> successors(V * k);
  const uint64_t table_key = splitmix64(seed ^ kTableStream);
  for (uint64_t v = 0; v < V; ++v) {
    for (uint64_t j = 0; j < k; ++j) {
      const uint64_t pick = j + below(counter_draw(table_key, v * k + j), V - j);
      std::swap(perm[j], perm[pick]);
      successors[v * k + j] = perm[j];
    }
  }

  const int bytes = token_bytes();
  buffer_ = Buffer::allocate(static_cast<size_t>(checked_mul(num_tokens, bytes, "SyntheticTokens: bytes")),
                             Device::cpu, "synthetic tokens");
  const uint64_t walk_key = splitmix64(seed ^ kWalkStream);
  // The walk at the stored width: every id is below V, so narrowing to uint16 (V <= 65536) loses nothing.
  const auto walk = [&](auto* out) {
    using T = std::remove_pointer_t<decltype(out)>;
    uint64_t at = below(counter_draw(walk_key, 0), V);
    out[0] = static_cast<T>(at);
    for (int64_t i = 1; i < num_tokens; ++i) {
      const uint64_t j = below(counter_draw(walk_key, static_cast<uint64_t>(i)), k);
      at = successors[at * k + j];
      out[i] = static_cast<T>(at);
    }
  };
  if (bytes == 2) walk(static_cast<uint16_t*>(buffer_.data()));
  else walk(static_cast<uint32_t*>(buffer_.data()));
}

TokenView SyntheticTokens::tokens() const {
  const auto n = static_cast<size_t>(num_tokens_);
  if (token_bytes() == 2) return std::span<const uint16_t>(static_cast<const uint16_t*>(buffer_.data()), n);
  return std::span<const uint32_t>(static_cast<const uint32_t*>(buffer_.data()), n);
}

uint32_t SyntheticTokens::token(int64_t i) const {
  FLASHLM_CHECK(i >= 0 && i < num_tokens_, "SyntheticTokens::token: {} outside [0, {})", i, num_tokens_);
  if (token_bytes() == 2) return static_cast<const uint16_t*>(buffer_.data())[i];
  return static_cast<const uint32_t*>(buffer_.data())[i];
}

double SyntheticTokens::optimal_cross_entropy() const { return std::log(static_cast<double>(branching_)); }

TokenBatcher::TokenBatcher(TokenView tokens, std::string_view name, int64_t batch, int64_t context, BatchOrder order,
                           uint64_t seed)
    : tokens_(tokens), batch_(batch), context_(context), order_(order), seed_(seed) {
  // The bounds keep batch * context and every offset comfortably inside int64.
  FLASHLM_CHECK(batch >= 1 && batch <= INT32_MAX, "TokenBatcher: '{}': batch must be in [1, 2^31), got {}", name,
                batch);
  FLASHLM_CHECK(context >= 1 && context <= INT32_MAX, "TokenBatcher: '{}': context must be in [1, 2^31), got {}",
                name, context);
  const int64_t n = tokens.size();
  FLASHLM_CHECK(n >= context + 1,
                "TokenBatcher: '{}': {} tokens are too few for one sequence: context {} needs at least {} (the "
                "inputs plus the target of the last one)",
                name, n, context, context + 1);
  windows_ = (n - 1) / context;
  row_.resize(static_cast<size_t>(context + 1));
}

void TokenBatcher::next(std::span<int32_t> inputs, std::span<int32_t> targets) {
  const auto need = static_cast<size_t>(batch_ * context_);
  FLASHLM_CHECK(inputs.size() == need,
                "TokenBatcher::next: inputs: expected batch * context = {} * {} = {} ints, got {}", batch_,
                context_, need, inputs.size());
  FLASHLM_CHECK(targets.size() == need,
                "TokenBatcher::next: targets: expected batch * context = {} * {} = {} ints, got {}", batch_,
                context_, need, targets.size());
  const auto step = static_cast<uint64_t>(step_);
  const auto B = static_cast<uint64_t>(batch_);
  const auto T = static_cast<size_t>(context_);
  // Random starts lie in [0, n - T - 1], so start + T, the last target, is at most n - 1.
  const uint64_t starts = static_cast<uint64_t>(tokens_.size()) - T;
  const uint64_t step_key = counter_draw(splitmix64(seed_ ^ kBatchStream), step);  // row b of this step: counter_draw(step_key, b)
  const auto shards = static_cast<uint64_t>(shards_);
  for (uint64_t b = 0; b < B; ++b) {
    const uint64_t row = static_cast<uint64_t>(shard_) * B + b;  // within the global batch of B · shards rows
    uint64_t start = 0;
    if (order_ == BatchOrder::sequential) {
      // 128-bit product: step * B outgrows 64 bits long before the step counter does.
      const auto window = static_cast<uint64_t>((static_cast<unsigned __int128>(step) * B * shards + row) %
                                                static_cast<uint64_t>(windows_));
      start = window * T;
    } else {
      start = below(counter_draw(step_key, row), starts);
    }
    tokens_.read(static_cast<int64_t>(start), row_);
    const uint32_t* src = row_.data();
    int32_t* x = inputs.data() + b * T;
    int32_t* y = targets.data() + b * T;
    for (size_t t = 0; t < T; ++t) {
      x[t] = static_cast<int32_t>(src[t]);
      y[t] = static_cast<int32_t>(src[t + 1]);
    }
  }
  ++step_;
}

void TokenBatcher::select_shard(int64_t index, int64_t count) {
  FLASHLM_CHECK(count >= 1 && index >= 0 && index < count,
                "TokenBatcher::select_shard: shard {} of {}, expected 0 <= index < count", index, count);
  shard_ = index;
  shards_ = count;
}

void TokenBatcher::restore(const BatcherState& state) {
  FLASHLM_CHECK(state.step >= 0, "TokenBatcher::restore: state.step must be non-negative, got {}", state.step);
  seed_ = state.seed;
  step_ = state.step;
}

}  // namespace flashlm
