// Weights for inference and export, from either file a user may hold: a training checkpoint (its header
// carries the configuration) or a safetensors file (its metadata does).
#include <cstring>

#include "core/check.h"
#include "core/file.h"
#include "flashlm/safetensors.h"
#include "flashlm/train.h"
#include "train/checkpoint.h"

namespace flashlm {

ModelWeights load_model_weights(const std::string& path) {
  bool is_checkpoint = false;
  {
    const ReadOnlyFile file(path, "weights");
    char magic[7] = {};
    if (file.size() >= sizeof magic) file.read_at(0, std::as_writable_bytes(std::span(magic)));
    is_checkpoint = std::memcmp(magic, "FLMCKPT", sizeof magic) == 0;  // any format: the reader names old ones
  }
  ModelWeights w;
  if (is_checkpoint) {
    const CheckpointReader ck(path);
    // A shard holds a slice of the flat parameters and moments (the slice's bounds are FSDP's, not recorded).
    FLASHLM_CHECK(ck.header().shard_rank < 0,
                  "weights: '{}' is one shard of a sharded checkpoint (rank {} of {}: PATH.rank{}-of-{}), which holds "
                  "{} of the model's {} parameters: generate and export read a whole checkpoint (train without "
                  "--sharded-checkpoint writes one)",
                  path, ck.header().shard_rank, ck.header().world_size, ck.header().shard_rank,
                  ck.header().world_size, ck.header().shard_elements, ck.header().parameter_count);
    w.config = ck.header().model;
    const auto n = static_cast<size_t>(ck.header().parameter_count);
    w.params.resize(n);
    std::vector<float> m(n), v(n);
    ck.read_payload(w.params, m, v);
    return w;
  }
  const SafetensorsFile file(path);
  w.config = file.model_config();
  w.params.resize(static_cast<size_t>(w.config.parameter_count()));
  file.read_parameters(w.config, w.params);
  return w;
}

}  // namespace flashlm
