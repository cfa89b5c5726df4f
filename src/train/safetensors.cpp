#include "flashlm/safetensors.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>
#include <set>

#include "core/check.h"
#include "core/file.h"
#include "core/json.h"
#include "flashlm/dtype.h"

namespace flashlm {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

namespace {

// The format's own reader refuses headers above 100 MB; a model's header is a few KB.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";

// Bytes per element of the dtypes the format defines (its Rust reader's list).
uint64_t dtype_bytes(const std::string& dtype) {
  static const std::pair<const char*, uint64_t> sizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
  for (const auto& [name, bytes] : sizes) {
    if (dtype == name) return bytes;
  }
  return 0;
}

// The ModelConfig fields, in the metadata as "flashlm.<name>".
struct ConfigField {
  const char* name;
  int64_t ModelConfig::*integer;
  double ModelConfig::*real;
};
constexpr ConfigField kConfigFields[] = {
    {"vocab", &ModelConfig::vocab, nullptr},   {"context", &ModelConfig::context, nullptr},
    {"d_model", &ModelConfig::d_model, nullptr}, {"d_ff", &ModelConfig::d_ff, nullptr},
    {"layers", &ModelConfig::layers, nullptr}, {"heads", &ModelConfig::heads, nullptr},
    {"rope_theta", nullptr, &ModelConfig::rope_theta}, {"norm_eps", nullptr, &ModelConfig::norm_eps}};

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

}  // namespace

void write_safetensors(const std::string& path, const ModelConfig& config, std::span<const float> params) {
  config.validate();
  const std::vector<ParameterInfo> layout = parameter_layout(config);
  const int64_t n = layout.back().offset + layout.back().numel();
  FLASHLM_CHECK(static_cast<int64_t>(params.size()) == n,
                "write_safetensors: params holds {} floats, the model's parameter_count is {}", params.size(), n);
  nlohmann::json header = nlohmann::json::object();
  nlohmann::json metadata = {{"format", "pt"}};
  for (const ConfigField& f : kConfigFields) {
    metadata[std::string("flashlm.") + f.name] =
        f.integer ? fmt::format("{}", config.*f.integer) : fmt::format("{}", config.*f.real);
  }
  header[kMetadataKey] = metadata;
  // The layout is contiguous and in order, so the data is the parameter buffer itself.
  for (const ParameterInfo& p : layout) {
    const uint64_t begin = uint64_t(p.offset) * sizeof(float);
    header[p.name] = {{"dtype", "F32"}, {"shape", p.shape}, {"data_offsets", {begin, begin + uint64_t(p.numel()) * sizeof(float)}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data 8-byte aligned, as the format's own writer pads
  const uint64_t length = text.size();
  const std::span<const std::byte> parts[] = {std::as_bytes(std::span(&length, 1)),
                                              std::as_bytes(std::span(text.data(), text.size())),
                                              std::as_bytes(params)};
  write_file_atomically(path, parts, "safetensors");
}

SafetensorsFile::SafetensorsFile(const std::string& path)
    : file_(std::make_unique<ReadOnlyFile>(path, "safetensors")) {
  const uint64_t size = file_->size();
  FLASHLM_CHECK(size >= 8, "safetensors: '{}' has {} bytes: too short for the 8-byte header length", path, size);
  uint64_t length = 0;
  file_->read_at(0, std::as_writable_bytes(std::span(&length, 1)));
  FLASHLM_CHECK(length >= 2 && length <= kMaxHeaderBytes && length <= size - 8,
                "safetensors: '{}': the header length is {}, expected [2, {}] bytes within the file's {} after the "
                "length",
                path, length, kMaxHeaderBytes, size - 8);
  std::string text(static_cast<size_t>(length), '\0');
  file_->read_at(8, std::as_writable_bytes(std::span(text.data(), text.size())));
  const nlohmann::json header =
      parse_untrusted_json(text, fmt::format("safetensors: '{}': the header", path), kMaxHeaderBytes);
  FLASHLM_CHECK(header.is_object(), "safetensors: '{}': the header is {}, expected a JSON object", path,
                std::string(header.type_name()));
  data_at_ = 8 + length;
  const uint64_t data_bytes = size - data_at_;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      FLASHLM_CHECK(entry.is_object(), "safetensors: '{}': '{}' is {}, expected an object of strings", path, name,
                    std::string(entry.type_name()));
      for (const auto& [key, value] : entry.items()) {
        FLASHLM_CHECK(value.is_string(), "safetensors: '{}': metadata '{}' is {}, expected a string", path, key,
                      json_excerpt(value));
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const auto bad = [&](const std::string& what) { fail("safetensors: '{}': tensor '{}': {}", path, name, what); };
    if (!entry.is_object()) bad(fmt::format("the entry is {}, expected an object", std::string(entry.type_name())));
    for (const auto& [key, value] : entry.items()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") bad(fmt::format("unknown field '{}'", key));
    }
    if (!entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets"))
      bad("expected the fields dtype, shape and data_offsets");
    Tensor t;
    t.name = name;
    const nlohmann::json& dtype = entry["dtype"];
    if (!dtype.is_string() || dtype_bytes(dtype.get<std::string>()) == 0)
      bad(fmt::format("dtype {} is not one the format defines", json_excerpt(dtype)));
    t.dtype = dtype.get<std::string>();
    const nlohmann::json& shape = entry["shape"];
    if (!shape.is_array()) bad(fmt::format("shape {} is not an array", json_excerpt(shape)));
    // The element count, checked against overflow dimension by dimension: any count above the data's bytes
    // is wrong already.
    uint64_t elements = 1;
    for (const nlohmann::json& dim : shape) {
      if (!dim.is_number_unsigned()) bad(fmt::format("shape {}: {} is not a non-negative integer", json_excerpt(shape), json_excerpt(dim)));
      const auto v = dim.get<uint64_t>();
      if (v > uint64_t(std::numeric_limits<int64_t>::max()) || (v > 0 && elements > data_bytes / v))
        bad(fmt::format("shape {} holds more elements than the file has bytes", json_excerpt(shape)));
      elements *= v;
      t.shape.push_back(static_cast<int64_t>(v));
    }
    const nlohmann::json& offsets = entry["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
      bad(fmt::format("data_offsets {} is not [begin, end] of non-negative integers", json_excerpt(offsets)));
    t.begin = offsets[0].get<uint64_t>();
    t.end = offsets[1].get<uint64_t>();
    if (t.begin > t.end || t.end > data_bytes)
      bad(fmt::format("data_offsets [{}, {}] is not a range inside the {} bytes of data", t.begin, t.end, data_bytes));
    const uint64_t element_bytes = dtype_bytes(t.dtype);
    if (elements > data_bytes / element_bytes || t.end - t.begin != elements * element_bytes)
      bad(fmt::format("shape {} of {} needs {} bytes, data_offsets [{}, {}] hold {}", json_excerpt(shape), t.dtype,
                      elements <= data_bytes / element_bytes ? fmt::format("{}", elements * element_bytes) : "more",
                      t.begin, t.end, t.end - t.begin));
    tensors_.push_back(std::move(t));
  }
  // The tensors tile the data exactly: in offset order none starts before the one before it ends (checked
  // first, for an overlap is the worse fault) and each starts where that one ends.
  std::sort(tensors_.begin(), tensors_.end(),
            [](const Tensor& a, const Tensor& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  for (size_t i = 1; i < tensors_.size(); ++i) {
    const Tensor &a = tensors_[i - 1], &b = tensors_[i];
    FLASHLM_CHECK(b.begin >= a.end, "safetensors: '{}': tensors '{}' and '{}' overlap (bytes [{}, {}) and [{}, {}))",
                  path, a.name, b.name, a.begin, a.end, b.begin, b.end);
  }
  uint64_t at = 0;
  for (const Tensor& t : tensors_) {
    FLASHLM_CHECK(t.begin == at, "safetensors: '{}': bytes [{}, {}) of the data belong to no tensor (before '{}')", path,
                  at, t.begin, t.name);
    at = t.end;
  }
  FLASHLM_CHECK(at == data_bytes, "safetensors: '{}': bytes [{}, {}) at the end of the data belong to no tensor", path,
                at, data_bytes);
}

SafetensorsFile::~SafetensorsFile() = default;

const std::string& SafetensorsFile::path() const { return file_->path(); }

ModelConfig SafetensorsFile::model_config() const {
  ModelConfig c;
  for (const ConfigField& f : kConfigFields) {
    const std::string key = std::string("flashlm.") + f.name;
    const auto it = metadata_.find(key);
    FLASHLM_CHECK(it != metadata_.end(),
                  "safetensors: '{}' has no metadata '{}': it was not written by flashlm export, so the model's "
                  "configuration must come from elsewhere (flashlm train --init takes it from its options)",
                  path(), key);
    const std::string& text = it->second;
    const char* end = text.data() + text.size();
    bool ok = false;
    if (f.integer) {
      int64_t v = 0;
      const auto r = std::from_chars(text.data(), end, v);
      ok = r.ec == std::errc() && r.ptr == end && v >= 1 && v <= std::numeric_limits<int32_t>::max();
      c.*f.integer = v;
    } else {
      double v = 0;
      const auto r = std::from_chars(text.data(), end, v);
      ok = r.ec == std::errc() && r.ptr == end && std::isfinite(v) && v > 0;
      c.*f.real = v;
    }
    FLASHLM_CHECK(ok, "safetensors: '{}': metadata '{}' is \"{}\", expected {}", path(), key, text,
                  f.integer ? "an integer in [1, 2147483647]" : "a finite positive number");
  }
  try {
    c.validate();
  } catch (const Error& e) {
    fail("safetensors: '{}': the metadata's {}", path(), e.what());
  }
  // The parameters this configuration has, estimated in floating point before any int64 product: they
  // must fit the data at 2 bytes each at least, which bounds what a crafted file can make a reader allocate.
  const long double d = c.d_model, layers = c.layers;
  const long double count = 2.0L * c.vocab * d + layers * (4.0L * d * d + 3.0L * d * c.d_ff + 2.0L * d) + d;
  const uint64_t data_bytes = file_->size() - data_at_;
  FLASHLM_CHECK(count <= static_cast<long double>(data_bytes) / 2,
                "safetensors: '{}': the metadata's model has about {:.0f} parameters, more than the {} bytes of data "
                "can hold",
                path(), static_cast<double>(count), data_bytes);
  return c;
}

void SafetensorsFile::read_parameters(const ModelConfig& config, std::span<float> params) const {
  const std::vector<ParameterInfo> layout = parameter_layout(config);
  const int64_t n = layout.back().offset + layout.back().numel();
  FLASHLM_CHECK(static_cast<int64_t>(params.size()) == n,
                "SafetensorsFile::read_parameters: params holds {} floats, the model's parameter_count is {}",
                params.size(), n);
  std::set<std::string> expected;
  for (const ParameterInfo& p : layout) expected.insert(p.name);
  for (const Tensor& t : tensors_) {
    FLASHLM_CHECK(expected.count(t.name) == 1,
                  "safetensors: '{}': tensor '{}' is not a parameter of this model ({} layers: names as the CS336 "
                  "PyTorch model's state_dict, e.g. '{}')",
                  path(), t.name, config.layers, layout[1].name);
  }
  for (const ParameterInfo& p : layout) {
    const auto it = std::find_if(tensors_.begin(), tensors_.end(), [&](const Tensor& t) { return t.name == p.name; });
    FLASHLM_CHECK(it != tensors_.end(), "safetensors: '{}': no tensor '{}' (shape {})", path(), p.name, shape_text(p.shape));
    FLASHLM_CHECK(it->shape == p.shape, "safetensors: '{}': tensor '{}' has shape {}, this model's is {}", path(),
                  p.name, shape_text(it->shape), shape_text(p.shape));
    float* out = params.data() + p.offset;
    const auto count = static_cast<size_t>(p.numel());
    if (it->dtype == "F32") {
      file_->read_at(data_at_ + it->begin, std::as_writable_bytes(std::span(out, count)));
    } else {
      FLASHLM_CHECK(it->dtype == "BF16" || it->dtype == "F16",
                    "safetensors: '{}': tensor '{}' is {}, expected F32, BF16 or F16", path(), p.name, it->dtype);
      std::vector<uint16_t> bits(count);
      file_->read_at(data_at_ + it->begin, std::as_writable_bytes(std::span(bits)));
      for (size_t i = 0; i < count; ++i) {
        bf16_t b;
        b.bits = bits[i];
        out[i] = it->dtype == "BF16" ? static_cast<float>(b) : fp16_t::to_float(bits[i]);
      }
    }
    // A NaN or an infinity in the weights makes every loss and every sampled token NaN, far from here.
    const float* bad = std::find_if(out, out + count, [](float x) { return !std::isfinite(x); });
    FLASHLM_CHECK(bad == out + count, "safetensors: '{}': tensor '{}' holds {} at element {}: the weights must be finite",
                  path(), p.name, *bad, bad - out);
  }
}

}  // namespace flashlm
