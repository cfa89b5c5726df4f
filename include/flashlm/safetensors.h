// Model weights in the safetensors format, so that PyTorch (and anything else that reads it) can load what
// flashlm trained, and flashlm can start from weights made elsewhere. The file: an 8-byte little-endian
// header length N, N bytes of JSON ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {string: string}}), then the tensors' raw little-endian bytes, offsets relative to the
// end of the header. flashlm writes the CS336 PyTorch model's state_dict names and shapes (model.h's
// parameter_layout) in F32, and the model's configuration in the metadata.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "flashlm/model.h"

namespace flashlm {

class ReadOnlyFile;  // src/core/file.h

// Writes params (the flat fp32 parameters of parameter_layout(config)) atomically to `path`, with
// metadata {"format": "pt", "flashlm.vocab": "...", ...: every ModelConfig field, as decimal text}.
void write_safetensors(const std::string& path, const ModelConfig& config, std::span<const float> params);

// A safetensors file opened for reading. The file is untrusted: the constructor checks the header length
// against the file, that the header is a JSON object whose every entry is a tensor (a known dtype, a shape
// of non-negative integers whose byte count matches its data_offsets) or the string-to-string metadata,
// and that the tensors' byte ranges lie inside the data, do not overlap and leave no gap, before anything
// is read from the data.
class SafetensorsFile {
 public:
  struct Tensor {
    std::string name, dtype;  // dtype as the format names it: "F32", "BF16", "F16", "I64", ...
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // bytes, relative to the start of the data
  };

  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();

  const std::string& path() const;
  const std::vector<Tensor>& tensors() const { return tensors_; }  // in order of data_offsets
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The configuration write_safetensors stored in the metadata; a file without it (one PyTorch wrote) is
  // an Error saying which field is missing.
  ModelConfig model_config() const;

  // Every parameter of parameter_layout(config) into params (parameter_count floats): the file must hold
  // exactly those names, each with its shape, in F32, BF16 or F16 (widened to fp32). A missing, extra or
  // misshapen tensor is an Error naming it.
  void read_parameters(const ModelConfig& config, std::span<float> params) const;

 private:
  std::unique_ptr<ReadOnlyFile> file_;
  uint64_t data_at_ = 0;
  std::vector<Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace flashlm
