#include "train/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <utility>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "core/file.h"
#include "core/json.h"

namespace flashlm {

// The payload is written as the host holds it.
static_assert(std::endian::native == std::endian::little, "checkpoints are little-endian");

namespace {

constexpr char kMagic[8] = {'F', 'L', 'M', 'C', 'K', 'P', 'T', '2'};
constexpr char kMagicFormat1[8] = {'F', 'L', 'M', 'C', 'K', 'P', 'T', '1'};
constexpr int64_t kFormat = 2;
constexpr uint64_t kPreludeBytes = 20;              // magic, header length, header CRC
constexpr uint64_t kMaxHeaderBytes = uint64_t{1} << 20;  // a header is a few hundred bytes
constexpr int64_t kFingerprintTokens = int64_t{1} << 19;
constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
// The run settings (CheckpointHeader::run_settings) a resume exists to change: how long to train (the
// cosine's length follows --steps unless given), where and how often to checkpoint, and --init, which a
// resume may not give (the weights are the checkpoint's).
constexpr std::string_view kResumeMayChange[] = {"steps", "optimizer.cosine_steps", "checkpoint", "checkpoint_every",
                                                 "init"};

// zlib's crc32_z takes size_t lengths, so any buffer goes in one call.
uint32_t crc32_update(uint32_t crc, const void* data, size_t bytes) {
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), bytes));
}

uint32_t header_crc(const unsigned char (&prelude)[16], const std::string& text) {
  return crc32_update(crc32_update(0, prelude, sizeof prelude), text.data(), text.size());
}

uint32_t payload_crc(std::span<const float> params, std::span<const float> m, std::span<const float> v) {
  uint32_t crc = 0;
  for (std::span<const float> part : {params, m, v}) crc = crc32_update(crc, part.data(), part.size_bytes());
  return crc;
}

nlohmann::json model_json(const ModelConfig& c) {
  return {{"vocab", c.vocab},   {"context", c.context}, {"d_model", c.d_model},       {"d_ff", c.d_ff},
          {"layers", c.layers}, {"heads", c.heads},     {"rope_theta", c.rope_theta}, {"norm_eps", c.norm_eps}};
}

// Reads the fields of one JSON object of a checkpoint's header, each checked for presence, type and
// range, every error naming the file and the field (`prefix` + key: "model.d_model").
class Fields {
 public:
  Fields(const std::string& path, const nlohmann::json& object, std::string prefix)
      : path_(path), object_(object), prefix_(std::move(prefix)) {}

  const nlohmann::json& at(const char* key) const {
    const auto it = object_.find(key);
    if (it == object_.end()) fail("checkpoint: '{}': the header has no field '{}{}'", path_, prefix_, key);
    return *it;
  }
  [[noreturn]] void bad(const char* key, const std::string& expected) const {
    fail("checkpoint: '{}': header field '{}{}' is {}, expected {}", path_, prefix_, key, json_excerpt(at(key)),
         expected);
  }
  int64_t integer(const char* key, int64_t lo, int64_t hi) const {
    const nlohmann::json& j = at(key);
    const std::string range = fmt::format("an integer in [{}, {}]", lo, hi);
    if (!j.is_number_integer()) bad(key, range);
    // nlohmann keeps non-negative integers unsigned: one beyond INT64_MAX must not wrap to a negative one.
    if (j.is_number_unsigned() && j.get<uint64_t>() > static_cast<uint64_t>(hi)) bad(key, range);
    const auto value = j.get<int64_t>();
    if (value < lo || value > hi) bad(key, range);
    return value;
  }
  uint64_t unsigned_integer(const char* key, uint64_t hi = std::numeric_limits<uint64_t>::max()) const {
    const nlohmann::json& j = at(key);
    if (!j.is_number_unsigned() || j.get<uint64_t>() > hi) bad(key, fmt::format("an integer in [0, {}]", hi));
    return j.get<uint64_t>();
  }
  double positive_number(const char* key) const {
    const nlohmann::json& j = at(key);
    if (!j.is_number() || !std::isfinite(j.get<double>()) || j.get<double>() <= 0) bad(key, "a finite positive number");
    return j.get<double>();
  }
  std::string string(const char* key) const {
    if (!at(key).is_string()) bad(key, "a string");
    return at(key).get<std::string>();
  }
  Fields object(const char* key) const {
    if (!at(key).is_object()) bad(key, "an object");
    return Fields(path_, at(key), prefix_ + key + ".");
  }

 private:
  const std::string& path_;
  const nlohmann::json& object_;
  std::string prefix_;
};

CheckpointHeader parse_header(const std::string& path, const nlohmann::json& j, uint32_t* payload_crc_out) {
  FLASHLM_CHECK(j.is_object(), "checkpoint: '{}': the header is {}, expected a JSON object", path,
                std::string(j.type_name()));
  const Fields f(path, j, "");
  const int64_t format = f.integer("format", 0, std::numeric_limits<int64_t>::max());
  FLASHLM_CHECK(format == kFormat, "checkpoint: '{}': header field 'format' is {}, this flashlm reads format {}", path,
                format, kFormat);
  CheckpointHeader h;
  const Fields model = f.object("model");
  h.model.vocab = model.integer("vocab", 2, kMaxInt32);
  h.model.context = model.integer("context", 1, kMaxInt32);
  h.model.d_model = model.integer("d_model", 1, kMaxInt32);
  h.model.d_ff = model.integer("d_ff", 1, kMaxInt32);
  h.model.layers = model.integer("layers", 1, kMaxInt32);
  h.model.heads = model.integer("heads", 1, kMaxInt32);
  h.model.rope_theta = model.positive_number("rope_theta");
  h.model.norm_eps = model.positive_number("norm_eps");
  // Sizes no model can have are the file's fault, not the caller's: a runtime error (the CLI's exit 1), not
  // the InvalidArgument that ModelConfig::validate raises for a user's own configuration.
  try {
    h.model.validate();
  } catch (const InvalidArgument& e) {
    throw Error(fmt::format("checkpoint: '{}': the header's model is not one flashlm can build: {}", path, e.what()));
  }
  h.batch = f.integer("batch", 1, kMaxInt32);
  h.seq = f.integer("seq", 1, kMaxInt32);
  h.next_step = f.integer("next_step", 0, std::numeric_limits<int64_t>::max());
  h.optimizer_steps = f.integer("optimizer_steps", 0, h.next_step);
  h.seed = f.unsigned_integer("seed");
  const Fields data = f.object("train_data");
  h.train_data.name = data.string("name");
  h.train_data.tokens = data.integer("tokens", 2, std::numeric_limits<int64_t>::max());
  h.train_data.fingerprint = static_cast<uint32_t>(data.unsigned_integer("fingerprint", UINT32_MAX));
  h.world_size = f.integer("world_size", 1, kMaxInt32);
  h.grad_accum = f.integer("grad_accum", 1, kMaxInt32);
  // The batcher draws grad_accum batches a step from the run's seed: any other position is not one a run left.
  h.batcher.seed = f.unsigned_integer("batcher_seed");
  if (h.batcher.seed != h.seed) f.bad("batcher_seed", fmt::format("the run's seed {}", h.seed));
  const int64_t batcher_step = f.integer("batcher_step", 0, std::numeric_limits<int64_t>::max());
  if (h.next_step > std::numeric_limits<int64_t>::max() / h.grad_accum || batcher_step != h.next_step * h.grad_accum)
    f.bad("batcher_step", fmt::format("next_step * grad_accum = {} * {}", h.next_step, h.grad_accum));
  h.batcher.step = batcher_step;
  h.parameter_count = f.integer("parameter_count", 1, std::numeric_limits<int64_t>::max());
  const std::string precision = f.string("precision");
  if (precision == dtype_name(DType::f32)) h.precision = DType::f32;
  else if (precision == dtype_name(DType::bf16)) h.precision = DType::bf16;
  else if (precision == dtype_name(DType::f16)) h.precision = DType::f16;
  else if (precision == precision_name(DType::bf16, true)) h.precision = DType::bf16, h.bf16_pure = true;
  else f.bad("precision", "\"fp32\", \"bf16\", \"fp16\" or \"bf16-pure\"");
  if (j.contains("optimizer_state")) {
    const std::string state = f.string("optimizer_state");
    bool known = false;
    for (OptimizerState s : {OptimizerState::fp32, OptimizerState::bf16, OptimizerState::bf16_sr}) {
      if (state == optimizer_state_name(s)) h.optimizer_state = s, known = true;
    }
    if (!known) f.bad("optimizer_state", "\"fp32\", \"bf16\" or \"bf16-sr\"");
  }
  h.loss_scale = f.positive_number("loss_scale");
  // Absent in the format-2 files written before the field existed: those resume with a fresh count.
  if (j.contains("loss_scale_good_steps"))
    h.loss_scale_good_steps = f.integer("loss_scale_good_steps", 0, LanguageModel::kLossScaleGrowthInterval - 1);
  if (j.contains("shard_rank")) {
    h.shard_rank = f.integer("shard_rank", 0, h.world_size - 1);
    h.shard_elements = f.integer("shard_elements", 1, h.parameter_count);
  }
  if (j.contains("run_settings")) {
    // Names and values are only compared, never parsed: strings, nothing nested, and none dumped in a message.
    const nlohmann::json& settings = f.at("run_settings");
    if (!settings.is_object()) f.bad("run_settings", "an object of strings");
    for (const auto& [name, value] : settings.items()) {
      FLASHLM_CHECK(value.is_string(),
                    "checkpoint: '{}': header field 'run_settings' holds a value that is not a string", path);
      h.run_settings.push_back({name, value.get<std::string>()});
    }
  }
  *payload_crc_out = static_cast<uint32_t>(f.unsigned_integer("payload_crc32", UINT32_MAX));
  return h;
}

nlohmann::json header_json(const CheckpointHeader& h, uint32_t payload_crc32) {
  nlohmann::json j = {{"format", kFormat},
          {"model", model_json(h.model)},
          {"batch", h.batch},
          {"seq", h.seq},
          {"next_step", h.next_step},
          {"optimizer_steps", h.optimizer_steps},
          {"seed", h.seed},
          {"train_data",
           {{"name", h.train_data.name}, {"tokens", h.train_data.tokens}, {"fingerprint", h.train_data.fingerprint}}},
          {"batcher_seed", h.batcher.seed},
          {"batcher_step", h.batcher.step},
          {"parameter_count", h.parameter_count},
          {"precision", precision_name(h.precision, h.bf16_pure)},
          {"optimizer_state", optimizer_state_name(h.optimizer_state)},
          {"loss_scale", h.loss_scale},
          {"loss_scale_good_steps", h.loss_scale_good_steps},
          {"world_size", h.world_size},
          {"grad_accum", h.grad_accum},
          {"payload_crc32", payload_crc32}};
  if (h.shard_rank >= 0) {
    j["shard_rank"] = h.shard_rank;
    j["shard_elements"] = h.shard_elements;
  }
  if (!h.run_settings.empty()) {
    nlohmann::json settings = nlohmann::json::object();
    for (const RunSetting& s : h.run_settings) settings[s.name] = s.value;
    j["run_settings"] = std::move(settings);
  }
  return j;
}

std::string directory_of(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

}  // namespace

DataIdentity data_identity(std::string name, TokenView tokens) {
  DataIdentity id{std::move(name), tokens.size(), 0};
  id.fingerprint = crc32_update(0, &id.tokens, sizeof id.tokens);
  const int64_t head = std::min(tokens.size(), kFingerprintTokens);
  const int64_t tail_at = std::max(head, tokens.size() - kFingerprintTokens);
  // The tokens are hashed at the file's own width, so 2-byte data keeps the fingerprints it always had.
  std::vector<uint32_t> buf(static_cast<size_t>(head));
  std::vector<uint16_t> narrow(buf.size());
  for (const auto& [first, count] : {std::pair{int64_t{0}, head}, std::pair{tail_at, tokens.size() - tail_at}}) {
    const std::span<uint32_t> part(buf.data(), static_cast<size_t>(count));
    tokens.read(first, part);
    if (tokens.token_bytes() == 4) {
      id.fingerprint = crc32_update(id.fingerprint, part.data(), part.size_bytes());
    } else {
      std::copy(part.begin(), part.end(), narrow.begin());
      id.fingerprint = crc32_update(id.fingerprint, narrow.data(), part.size() * sizeof(uint16_t));
    }
  }
  return id;
}

CheckpointLock check_checkpoint_writable(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    FLASHLM_CHECK(!S_ISDIR(st.st_mode), "checkpoint: '{}' is a directory: give a file path such as '{}/run.ckpt'",
                  path, path);
    FLASHLM_CHECK(S_ISREG(st.st_mode), "checkpoint: '{}' exists and is not a regular file", path);
  }
  const std::string dir = directory_of(path);
  FLASHLM_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode),
                "checkpoint: '{}': the directory '{}' does not exist", path, dir);
  // Creating a temporary as the checkpoint's are is the one test of permission that cannot be wrong.
  const std::string tmp = temporary_path(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NONBLOCK | O_CLOEXEC, 0644);
  FLASHLM_CHECK(fd >= 0, "checkpoint: cannot create '{}': {}", tmp, errno_text(errno));
  ::close(fd);
  ::unlink(tmp.c_str());
  return CheckpointLock(path);
}

CheckpointLock::CheckpointLock(const std::string& path) : path_(path + ".lock") {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_NONBLOCK | O_CLOEXEC, 0644);
  FLASHLM_CHECK(fd_ >= 0, "checkpoint: cannot create the lock '{}': {}", path_, errno_text(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fail("checkpoint: the lock '{}' is not a regular file", path_);
  }
  // flock() belongs to the open file: it goes when the run's process does, however it ends, so a lock a
  // killed run left is free again.
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char owner[32] = {};
    const ssize_t got = ::pread(fd_, owner, sizeof owner - 1, 0);
    ::close(fd_);
    std::string pid = got > 0 ? std::string(owner, static_cast<size_t>(got)) : std::string();
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    FLASHLM_CHECK(err != EWOULDBLOCK, "checkpoint: '{}' is in use by another run (process {}, which holds '{}'): give "
                  "this run another --checkpoint, or wait for that one to end", path,
                  pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos ? "unknown" : pid, path_);
    fail("checkpoint: cannot lock '{}': {}", path_, errno_text(err));
  }
  const std::string pid = fmt::format("{}\n", ::getpid());
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    const int err = errno;
    ::close(fd_);
    fail("checkpoint: cannot write the lock '{}': {}", path_, errno_text(err));
  }
  // Nobody else writes this checkpoint now: a temporary of it is a killed writer's.
  remove_stale_temporaries(path);
}

CheckpointLock::CheckpointLock(CheckpointLock&& o) noexcept : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)) {}

CheckpointLock& CheckpointLock::operator=(CheckpointLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

CheckpointLock::~CheckpointLock() {
  // The file stays: removing it would let a third run lock a new file while a second still waits on this one.
  if (fd_ >= 0) ::close(fd_);
}

void write_checkpoint(const std::string& path, const CheckpointHeader& header, std::span<const float> params,
                      std::span<const float> m, std::span<const float> v) {
  const auto n = static_cast<size_t>(header.payload_elements());
  FLASHLM_CHECK(params.size() == n && m.size() == n && v.size() == n,
                "write_checkpoint: params, m and v hold {}, {} and {} floats, expected {} = {} each",
                params.size(), m.size(), v.size(), header.shard_rank >= 0 ? "shard_elements" : "parameter_count", n);
  const std::string text = header_json(header, payload_crc(params, m, v)).dump();
  unsigned char prelude[16];
  const uint64_t len = text.size();
  std::memcpy(prelude, kMagic, sizeof kMagic);
  std::memcpy(prelude + 8, &len, sizeof len);
  const uint32_t crc = header_crc(prelude, text);

  const auto bytes = [](const void* data, size_t size) {
    return std::span(static_cast<const std::byte*>(data), size);
  };
  const std::span<const std::byte> parts[] = {bytes(prelude, sizeof prelude), bytes(&crc, sizeof crc),
                                              bytes(text.data(), text.size()), std::as_bytes(params),
                                              std::as_bytes(m), std::as_bytes(v)};
  write_file_atomically(path, parts, "checkpoint");
}

CheckpointReader::CheckpointReader(const std::string& path)
    : file_(std::make_unique<ReadOnlyFile>(path, "checkpoint")) {
  const uint64_t size = file_->size();
  unsigned char prelude[16] = {};
  uint32_t crc = 0;
  FLASHLM_CHECK(size >= kPreludeBytes, "checkpoint: '{}' is not a flashlm checkpoint: {} bytes", path, size);
  file_->read_at(0, std::as_writable_bytes(std::span(prelude)));
  file_->read_at(16, std::as_writable_bytes(std::span(&crc, 1)));
  FLASHLM_CHECK(std::memcmp(prelude, kMagicFormat1, 8) != 0,
                "checkpoint: '{}' is in the old format 1, which has no checksums and is not read any more: "
                "resume it with the flashlm that wrote it, or start the run again",
                path);
  FLASHLM_CHECK(std::memcmp(prelude, kMagic, 8) == 0, "checkpoint: '{}' is not a flashlm checkpoint", path);
  uint64_t len = 0;
  std::memcpy(&len, prelude + 8, sizeof len);
  FLASHLM_CHECK(len <= kMaxHeaderBytes && len <= size - kPreludeBytes,
                "checkpoint: '{}' has a corrupt header: it claims {} bytes, the file has {} after the first {}", path,
                len, size - kPreludeBytes, kPreludeBytes);
  std::string text(len, '\0');
  file_->read_at(kPreludeBytes, std::as_writable_bytes(std::span(text.data(), text.size())));
  FLASHLM_CHECK(header_crc(prelude, text) == crc,
                "checkpoint: '{}' has a corrupt header: its CRC-32 is {:08x}, the header stored {:08x}", path,
                header_crc(prelude, text), crc);
  const nlohmann::json j =
      parse_untrusted_json(text, fmt::format("checkpoint: '{}' has a corrupt header: it", path), kMaxHeaderBytes);
  header_ = parse_header(path, j, &payload_crc_);
  payload_at_ = kPreludeBytes + len;
  // Exactly three arrays of parameter_count (a shard: shard_elements) floats follow the header; checked by
  // division so that no product can overflow, and before anything is allocated for them.
  const uint64_t payload = size - payload_at_;
  const auto n = static_cast<uint64_t>(header_.payload_elements());
  FLASHLM_CHECK(payload % (3 * sizeof(float)) == 0 && payload / (3 * sizeof(float)) == n,
                "checkpoint: '{}': header field '{}' is {}, which needs {} payload bytes (3 x {} floats), but the file "
                "has {}{}",
                path, header_.shard_rank >= 0 ? "shard_elements" : "parameter_count", n, n <= payload ? fmt::format("{}", n * 3 * sizeof(float)) : std::string("more"), n, payload,
                n > payload / (3 * sizeof(float)) ? " (truncated?)" : "");
}

CheckpointReader::~CheckpointReader() = default;

void CheckpointReader::read_payload(std::span<float> params, std::span<float> m, std::span<float> v) const {
  const auto n = static_cast<size_t>(header_.payload_elements());
  FLASHLM_CHECK(params.size() == n && m.size() == n && v.size() == n,
                "CheckpointReader::read_payload: params, m and v hold {}, {} and {} floats, expected {} each",
                params.size(), m.size(), v.size(), n);
  uint64_t at = payload_at_;
  for (std::span<float> part : {params, m, v}) {
    file_->read_at(at, std::as_writable_bytes(part));
    at += part.size_bytes();
  }
  const uint32_t crc = payload_crc(params, m, v);
  FLASHLM_CHECK(crc == payload_crc_,
                "checkpoint: '{}' is corrupt: the parameters and moments have CRC-32 {:08x}, the header stored {:08x}",
                file_->path(), crc, payload_crc_);
}

void check_resumable(const std::string& path, const CheckpointHeader& saved, const CheckpointHeader& run) {
  auto differs = [&](std::string_view field, const auto& in_file, const auto& in_run) {
    if (in_file != in_run)
      fail("train: checkpoint '{}' differs from this run in {}: the checkpoint has {}, this run {}", path, field,
           in_file, in_run);
  };
  const nlohmann::json a = model_json(saved.model), b = model_json(run.model);
  for (const auto& [key, value] : b.items()) differs("model." + key, a.at(key).dump(), value.dump());
  // The data each rank reads depends on the global batch (ranks x batch, TokenBatcher::select_shard) and
  // grad_accum: another world size continues the run with the same global batch (bit-exactly only the same).
  if (saved.world_size * saved.batch != run.world_size * run.batch) {
    if (saved.world_size != run.world_size)
      fail("train: checkpoint '{}' differs from this run in world_size: the checkpoint has {}, this run {}, and "
           "another world size must keep the global batch (ranks x batch: {} x {} in the checkpoint, {} x {} here)",
           path, saved.world_size, run.world_size, saved.world_size, saved.batch, run.world_size, run.batch);
    differs("batch", saved.batch, run.batch);
  }
  differs("seq (the context of a batch)", saved.seq, run.seq);
  differs("precision", precision_name(saved.precision, saved.bf16_pure), precision_name(run.precision, run.bf16_pure));
  differs("optimizer_state", optimizer_state_name(saved.optimizer_state), optimizer_state_name(run.optimizer_state));
  differs("grad_accum", saved.grad_accum, run.grad_accum);
  differs("seed", saved.seed, run.seed);
  const DataIdentity &d0 = saved.train_data, &d1 = run.train_data;
  if (d0.tokens != d1.tokens || d0.fingerprint != d1.fingerprint)
    fail("train: checkpoint '{}' differs from this run in train_data: the checkpoint was trained on '{}' ({} tokens, "
         "fingerprint {:08x}), this run reads '{}' ({} tokens, fingerprint {:08x})",
         path, d0.name, d0.tokens, d0.fingerprint, d1.name, d1.tokens, d1.fingerprint);
  differs("parameter_count", saved.parameter_count, run.parameter_count);
  // A shard may be another run's (each rank reads its own file): every rank checks its own.
  if (saved.shard_rank >= 0 && !saved.run_settings.empty() && !run.run_settings.empty()) {
    std::map<std::string, std::pair<std::optional<std::string>, std::optional<std::string>>> settings;
    for (const RunSetting& s : saved.run_settings) settings[s.name].first = s.value;
    for (const RunSetting& s : run.run_settings) settings[s.name].second = s.value;
    // The file's text is shown cut short: a crafted header may hold a long one.
    const auto shown = [](const std::optional<std::string>& v) {
      if (!v) return std::string("not recorded");
      return v->size() <= 80 ? *v : v->substr(0, 80) + "...";
    };
    std::string diffs;
    for (const auto& [name, values] : settings) {
      if (values.first == values.second || std::ranges::find(kResumeMayChange, name) != std::end(kResumeMayChange))
        continue;
      diffs += fmt::format("{}{} is {} there, {} in this run", diffs.empty() ? "" : "; ", shown(name),
                           shown(values.first), shown(values.second));
    }
    if (!diffs.empty())
      fail("train: checkpoint '{}': this shard was written by a run with a different configuration: {}. A sharded "
           "resume repeats every setting of the run but --steps and the checkpoint and output options",
           path, diffs);
  }
}

}  // namespace flashlm
