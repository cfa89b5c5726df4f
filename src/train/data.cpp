#include "flashlm/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/random.h"

namespace flashlm {

// Both formats store tokens (and llm.c its header) little-endian, and tokens() hands out the mapped bytes
// without conversion.
static_assert(std::endian::native == std::endian::little, "token files are read as little-endian");

namespace {

constexpr int32_t kLlmcMagic = 20240520;
constexpr int32_t kLlmcVersion = 1;  // uint16 tokens; version 2 (llama 3's uint32 tokens) is not read
constexpr size_t kLlmcHeaderInts = 256;
constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);


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

std::string errno_text(int err) { return std::strerror(err); }

}  // namespace

// The file is memory-mapped rather than read: corpora run to tens of GB (FineWeb-10B is 20 GB of
// tokens), a mapping costs no RAM beyond the page cache the kernel can evict, and opening is instant.
// Random batches touch a few pages per row, which the kernel pages in on demand.
TokenFile::TokenFile(std::string path, int64_t vocab_size) : path_(std::move(path)) {
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  FLASHLM_CHECK(fd >= 0, "TokenFile: '{}': cannot open: {}", path_, errno_text(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("TokenFile: '{}': cannot stat: {}", path_, errno_text(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("TokenFile: '{}': not a regular file", path_);
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    fail("TokenFile: '{}': the file is empty", path_);
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file open
  FLASHLM_CHECK(map != MAP_FAILED, "TokenFile: '{}': cannot map {} bytes: {}", path_, size, errno_text(map_err));
  map_ = map;
  map_bytes_ = size;
  // A constructor that throws runs no destructor, so the mapping is released here on the way out.
  try {
    parse(size);
    if (vocab_size != 0) validate_tokens(vocab_size);
  } catch (...) {
    unmap();
    throw;
  }
}

void TokenFile::parse(size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(map_);
  int32_t magic = 0;
  if (size >= sizeof(magic)) std::memcpy(&magic, bytes, sizeof(magic));
  if (magic == kLlmcMagic) {
    format_ = TokenFormat::llmc;
    FLASHLM_CHECK(size >= kLlmcHeaderBytes,
                  "TokenFile: '{}': truncated llm.c header: the file has {} bytes, the header alone needs {}",
                  path_, size, kLlmcHeaderBytes);
    int32_t header[kLlmcHeaderInts];
    std::memcpy(header, bytes, kLlmcHeaderBytes);
    FLASHLM_CHECK(header[1] == kLlmcVersion,
                  "TokenFile: '{}': unsupported llm.c version {} (expected {}: uint16 tokens)", path_, header[1],
                  kLlmcVersion);
    const int64_t ntok = header[2];
    FLASHLM_CHECK(ntok >= 0, "TokenFile: '{}': the llm.c header's token count is negative ({})", path_, ntok);
    FLASHLM_CHECK(ntok > 0, "TokenFile: '{}': the llm.c header's token count is 0: no tokens", path_);
    const size_t expected = kLlmcHeaderBytes + static_cast<size_t>(ntok) * sizeof(uint16_t);
    FLASHLM_CHECK(size >= expected,
                  "TokenFile: '{}': truncated llm.c file: the header's token count {} needs {} bytes, the file "
                  "has {}",
                  path_, ntok, expected, size);
    FLASHLM_CHECK(size == expected,
                  "TokenFile: '{}': the llm.c header's token count {} needs {} bytes, but the file has {} "
                  "({} bytes too many)",
                  path_, ntok, expected, size, size - expected);
    tokens_ = {reinterpret_cast<const uint16_t*>(bytes + kLlmcHeaderBytes), static_cast<size_t>(ntok)};
  } else {
    format_ = TokenFormat::nanogpt;
    FLASHLM_CHECK(size % sizeof(uint16_t) == 0,
                  "TokenFile: '{}': the size, {} bytes, is odd: a raw nanoGPT file holds uint16 tokens "
                  "(and its first int32 is not llm.c's magic {})",
                  path_, size, kLlmcMagic);
    tokens_ = {reinterpret_cast<const uint16_t*>(bytes), size / sizeof(uint16_t)};
  }
}

TokenFile& TokenFile::operator=(TokenFile&& o) noexcept {
  if (this != &o) {
    unmap();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    map_bytes_ = std::exchange(o.map_bytes_, 0);
    tokens_ = std::exchange(o.tokens_, {});
    format_ = o.format_;
  }
  return *this;
}

void TokenFile::unmap() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = {};
}

void TokenFile::validate_tokens(int64_t vocab_size) const {
  FLASHLM_CHECK(vocab_size > 0, "TokenFile::validate_tokens: '{}': vocab_size must be positive, got {}", path_,
                vocab_size);
  for (size_t i = 0; i < tokens_.size(); ++i) {
    FLASHLM_CHECK(tokens_[i] < vocab_size,
                  "TokenFile: '{}': token {} at position {} is outside the vocabulary (vocab_size = {})", path_,
                  tokens_[i], i, vocab_size);
  }
}

SyntheticTokens::SyntheticTokens(int64_t vocab_size, int64_t num_tokens, uint64_t seed, int branching)
    : vocab_size_(vocab_size), num_tokens_(num_tokens), branching_(branching) {
  FLASHLM_CHECK(branching >= 1 && branching <= kMaxBranching,
                "SyntheticTokens: branching must be in [1, {}], got {}", kMaxBranching, branching);
  FLASHLM_CHECK(vocab_size >= branching && vocab_size <= 65536,
                "SyntheticTokens: vocab_size must be in [branching = {}, 65536] (tokens are uint16), got {}",
                branching, vocab_size);
  FLASHLM_CHECK(num_tokens >= 2, "SyntheticTokens: num_tokens must be at least 2, got {}", num_tokens);

  // successors[v * branching + j]: the j-th successor of token v. A partial Fisher-Yates shuffle of one
  // permutation per token makes the successors of a token distinct (duplicates would lower the entropy
  // below ln(branching)); the permutation stays a permutation, so it need not be reset between tokens.
  const auto V = static_cast<uint64_t>(vocab_size);
  const auto k = static_cast<uint64_t>(branching);
  std::vector<uint16_t> perm(V);
  std::iota(perm.begin(), perm.end(), uint16_t{0});  // ids 0 .. V-1 fit: V <= 65536
  std::vector<uint16_t> successors(V * k);
  const uint64_t table_key = splitmix64(seed ^ kTableStream);
  for (uint64_t v = 0; v < V; ++v) {
    for (uint64_t j = 0; j < k; ++j) {
      const uint64_t pick = j + below(counter_draw(table_key, v * k + j), V - j);
      std::swap(perm[j], perm[pick]);
      successors[v * k + j] = perm[j];
    }
  }

  buffer_ = Buffer::allocate(static_cast<size_t>(num_tokens) * sizeof(uint16_t), Device::cpu, "synthetic tokens");
  auto* out = static_cast<uint16_t*>(buffer_.data());
  const uint64_t walk_key = splitmix64(seed ^ kWalkStream);
  out[0] = static_cast<uint16_t>(below(counter_draw(walk_key, 0), V));
  for (int64_t i = 1; i < num_tokens; ++i) {
    const uint64_t j = below(counter_draw(walk_key, static_cast<uint64_t>(i)), k);
    out[i] = successors[out[i - 1] * k + j];
  }
}

double SyntheticTokens::optimal_cross_entropy() const { return std::log(static_cast<double>(branching_)); }

TokenBatcher::TokenBatcher(std::span<const uint16_t> tokens, std::string_view name, int64_t batch, int64_t context,
                           BatchOrder order, uint64_t seed)
    : tokens_(tokens), batch_(batch), context_(context), order_(order), seed_(seed) {
  // The bounds keep batch * context and every offset comfortably inside int64.
  FLASHLM_CHECK(batch >= 1 && batch <= INT32_MAX, "TokenBatcher: '{}': batch must be in [1, 2^31), got {}", name,
                batch);
  FLASHLM_CHECK(context >= 1 && context <= INT32_MAX, "TokenBatcher: '{}': context must be in [1, 2^31), got {}",
                name, context);
  const auto n = static_cast<int64_t>(tokens.size());
  FLASHLM_CHECK(n >= context + 1,
                "TokenBatcher: '{}': {} tokens are too few for one sequence: context {} needs at least {} (the "
                "inputs plus the target of the last one)",
                name, n, context, context + 1);
  windows_ = (n - 1) / context;
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
  const uint64_t starts = tokens_.size() - T;
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
    const uint16_t* src = tokens_.data() + start;
    int32_t* x = inputs.data() + b * T;
    int32_t* y = targets.data() + b * T;
    for (size_t t = 0; t < T; ++t) {
      x[t] = src[t];
      y[t] = src[t + 1];
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
