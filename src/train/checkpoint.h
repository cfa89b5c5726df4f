// Checkpoint files: what a training run needs to continue bit-exactly (parameters, AdamW's moments and step,
// the data position), in a format whose every byte is checked before it is trusted. The layout (format 2)
// is described in docs/design.md ("Checkpoints"):
//
//   "FLMCKPT2" | uint64 header bytes h | uint32 CRC-32 of the 16 bytes before it and the header | header
//   (JSON, h bytes) | parameters, first moments, second moments (fp32, parameter_count each)
//
// with the payload's CRC-32 inside the header. A reader checks the header's checksum, then every field's
// type and range and the file's size against parameter_count, before it allocates anything, and the
// payload's checksum after reading it.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "flashlm/data.h"
#include "flashlm/dist.h"
#include "flashlm/dtype.h"
#include "flashlm/model.h"

namespace flashlm {

// Which token sequence a run trains on, so that a resume can tell whether it reads the same one. The
// name (the path, or "synthetic") is for messages only: a file moved elsewhere holds the same data. The
// fingerprint is a CRC-32 of the token count and the first and last 512 Ki tokens, cheap for a corpus of
// tens of GB and different for any file that is not a copy.
struct DataIdentity {
  std::string name;
  int64_t tokens = 0;
  uint32_t fingerprint = 0;
};
DataIdentity data_identity(std::string name, TokenView tokens);

struct CheckpointHeader {
  ModelConfig model;
  int64_t batch = 0, seq = 0;
  int64_t next_step = 0;        // the first step a resumed run takes
  int64_t optimizer_steps = 0;  // AdamW updates so far: at most next_step (fp16 skips overflowing steps)
  uint64_t seed = 0;            // weights, data order and synthetic data
  DataIdentity train_data;
  BatcherState batcher;  // its step is next_step * grad_accum; its seed is `seed`
  int64_t parameter_count = 0;
  DType precision = DType::f32;
  bool bf16_pure = false;  // "bf16-pure" in the file: bf16 parameters and moments, stored widened to fp32
  // The moments beside fp32 masters ("optimizer_state": fp32, bf16, bf16-sr; absent in files written before
  // the field existed, which are fp32): bf16 moments are stored widened to fp32, exactly.
  OptimizerState optimizer_state = OptimizerState::fp32;
  double loss_scale = 1;
  int64_t loss_scale_good_steps = 0;  // fp16: good steps in a row since the scale last changed
  int64_t world_size = 1, grad_accum = 1;
  // A shard of FSDP's sharded checkpoint (shard_rank >= 0): the payload is rank shard_rank's shard_elements
  // elements of the masters and moments (DdpModel::save_shard), not parameter_count.
  int64_t shard_rank = -1, shard_elements = 0;
  // A shard: the settings of the run that wrote it, as its ranks agreed on them (Communicator::
  // agree_settings), but for "resume". Each rank resumes from its own file, which may be another run's: a run of the same
  // shapes that differed only in, say, the learning rate would pass every other check. Empty in files
  // written before the field existed.
  std::vector<RunSetting> run_settings;
  int64_t payload_elements() const { return shard_rank >= 0 ? shard_elements : parameter_count; }
};

// Writes a temporary beside `path` (one of this writer's alone), flushes it to the disk and renames it over
// `path`, so that a run killed mid-write leaves the previous checkpoint; on failure no temporary is left
// behind. params, m and v hold header.payload_elements() floats each.
void write_checkpoint(const std::string& path, const CheckpointHeader& header, std::span<const float> params,
                      std::span<const float> m, std::span<const float> v);

// A run's claim on its checkpoint path for as long as it lives: an exclusive flock() on path + ".lock", which
// records the owner's process id. A second run on the same path (in another process or this one) is refused,
// naming that process; the lock of a run that was killed is free. Once held, the temporaries that killed
// writers left beside the path are removed.
class CheckpointLock {
 public:
  CheckpointLock() = default;  // holds nothing
  explicit CheckpointLock(const std::string& path);
  CheckpointLock(CheckpointLock&& o) noexcept;
  CheckpointLock& operator=(CheckpointLock&& o) noexcept;
  CheckpointLock(const CheckpointLock&) = delete;
  CheckpointLock& operator=(const CheckpointLock&) = delete;
  ~CheckpointLock();

 private:
  std::string path_;  // the lock file
  int fd_ = -1;
};

// Throws unless a checkpoint could be written to `path` now: its directory exists, `path` is not a directory
// or anything else but a regular file, a temporary beside it can be created, and no other run holds it.
// Returns the lock that keeps it this run's. A run checks this before its first step rather than losing the
// whole run to a typo when the first checkpoint is due.
[[nodiscard]] CheckpointLock check_checkpoint_writable(const std::string& path);

// A checkpoint file opened for reading: the constructor reads and checks the header (its checksum, every
// field's type and range, and the file's size against parameter_count), read_payload the rest.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& path);
  ~CheckpointReader();

  const CheckpointHeader& header() const { return header_; }
  // params, m and v: header().payload_elements() floats each. Verifies the payload's checksum.
  void read_payload(std::span<float> params, std::span<float> m, std::span<float> v) const;

 private:
  std::unique_ptr<ReadOnlyFile> file_;
  CheckpointHeader header_;
  uint64_t payload_at_ = 0;
  uint32_t payload_crc_ = 0;
};

// Throws, naming the checkpoint's path and the first field that differs, unless a run configured as `run`
// can continue from `saved`: the same model, context, precision, grad_accum, seed, training data and
// parameter count, and the same global batch (world size x batch: another world size reads the same data
// then, from a checkpoint that holds the whole state). Bit-exactly with the same world size and batch. A shard
// that records its run's settings must have been written with `run`'s run_settings, but for those a resume
// may change: steps (and optimizer.cosine_steps, which follows --steps unless given), checkpoint,
// checkpoint_every and init.
void check_resumable(const std::string& path, const CheckpointHeader& saved, const CheckpointHeader& run);

}  // namespace flashlm
