// Model sizes, parameter layout and the learning-rate schedule.
#include <algorithm>
#include <bit>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>
#include <span>
#include <sstream>
#include <utility>

#include "core/check.h"
#include "core/file.h"
#include "core/json.h"
#include "flashlm/model.h"

namespace flashlm {

int64_t ParameterInfo::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n = checked_mul(n, s, "model: parameter size");
  return n;
}

void ModelConfig::validate() const {
  FLASHLM_CHECK_ARG(vocab >= 2, "model: vocab = {}, expected at least 2", vocab);
  FLASHLM_CHECK_ARG(context >= 1 && context <= kMaxContext, "model: context = {}, expected 1 to {}", context,
                    kMaxContext);
  // The layout holds an entry per layer's weight: a layer count is bounded before it is looped over.
  FLASHLM_CHECK_ARG(layers >= 1 && layers <= kMaxLayers, "model: layers = {}, expected 1..{}", layers, kMaxLayers);
  FLASHLM_CHECK_ARG(d_model >= 1, "model: d_model = {}, expected at least 1", d_model);
  FLASHLM_CHECK_ARG(heads >= 1 && d_model % heads == 0, "model: d_model = {} is not a multiple of heads = {}",
                    d_model, heads);
  FLASHLM_CHECK_ARG(head_dim() % 2 == 0, "model: head_dim = d_model / heads = {} must be even for RoPE", head_dim());
  FLASHLM_CHECK_ARG(d_ff >= 1, "model: d_ff = {}, expected at least 1", d_ff);
  FLASHLM_CHECK_ARG(vocab < (int64_t{1} << 31), "model: vocab = {} does not fit int32 token ids", vocab);
  FLASHLM_CHECK_ARG(rope_theta > 0 && std::isfinite(rope_theta),
                    "model: rope_theta = {}, expected a positive number", rope_theta);
  FLASHLM_CHECK_ARG(norm_eps > 0 && norm_eps < 1, "model: norm_eps = {}, expected in (0, 1)", norm_eps);
  // The parameter count, and its size in fp32 bytes, fit int64 (embedding, head, and per layer
  // 4 d² + 3 d·d_ff + 2 d): the models size their buffers from it unchecked.
  constexpr std::string_view what = "model: parameter count";
  try {
    const int64_t per_layer = checked_add(
        checked_add(checked_product({4, d_model, d_model}, what), checked_product({3, d_model, d_ff}, what), what),
        2 * d_model, what);
    const int64_t total =
        checked_add(checked_product({2, vocab, d_model}, what), checked_mul(layers, per_layer, what), what);
    checked_mul(total, int64_t{sizeof(float)}, "model: parameter bytes");
  } catch (const Error& e) {
    throw InvalidArgument(e.what());  // sizes the caller gave
  }
}

ModelConfig ModelConfig::named(std::string_view name, int64_t context, int64_t vocab) {
  struct Size {
    std::string_view name;
    int64_t d_model, d_ff, layers, heads, vocab;
  };
  static constexpr Size sizes[] = {{"tiny", 32, 64, 2, 4, 10000},           {"small", 768, 3072, 12, 12, 10000},
                                   {"medium", 1024, 4096, 24, 16, 10000},   {"large", 1280, 5120, 36, 20, 10000},
                                   {"xl", 1600, 6400, 48, 25, 10000},       {"2.7B", 2560, 10240, 32, 32, 10000},
                                   {"cs336-8b", 4096, 11008, 34, 32, 151936}};
  FLASHLM_CHECK_ARG(vocab >= 0, "model: vocab = {}, expected >= 0 (0: the size's own)", vocab);
  for (const Size& s : sizes) {
    if (s.name == name) {
      ModelConfig c;
      c.vocab = vocab > 0 ? vocab : s.vocab;
      c.context = context;
      c.d_model = s.d_model;
      c.d_ff = s.d_ff;
      c.layers = s.layers;
      c.heads = s.heads;
      return c;
    }
  }
  fail_argument("unknown model size '{}': expected tiny, small, medium, large, xl, 2.7B or cs336-8b", name);
}

ModelConfig ModelConfig::from_json(std::string_view text, std::vector<std::string>* keys_given) {
  // A model config is the user's own input: a file that is not a bounded JSON object is a usage error.
  nlohmann::json j;
  try {
    j = parse_untrusted_json(text, "model config", 1 << 20);
  } catch (const InvalidArgument&) {
    throw;
  } catch (const Error& e) {
    throw InvalidArgument(e.what());
  }
  FLASHLM_CHECK_ARG(j.is_object(), "model config: expected a JSON object, got {}", j.type_name());
  ModelConfig c;
  if (j.contains("base")) {
    FLASHLM_CHECK_ARG(j["base"].is_string(), "model config: \"base\" must be a size name, got {}", json_excerpt(j["base"]));
    c = named(j["base"].get<std::string>(), c.context);
  }
  auto integer = [&](const char* key, int64_t& field) {
    const nlohmann::json& v = j[key];
    FLASHLM_CHECK_ARG(v.is_number_integer(), "model config: \"{}\" must be an integer, got {}", key, json_excerpt(v));
    field = v.get<int64_t>();
  };
  auto number = [&](const char* key, double& field) {
    const nlohmann::json& v = j[key];
    FLASHLM_CHECK_ARG(v.is_number(), "model config: \"{}\" must be a number, got {}", key, json_excerpt(v));
    field = v.get<double>();
  };
  if (keys_given) keys_given->clear();
  for (const auto& [key, value] : j.items()) {
    if (keys_given) keys_given->push_back(key);
    if (key == "base") continue;
    if (key == "vocab") integer("vocab", c.vocab);
    else if (key == "context") integer("context", c.context);
    else if (key == "d_model") integer("d_model", c.d_model);
    else if (key == "d_ff") integer("d_ff", c.d_ff);
    else if (key == "layers") integer("layers", c.layers);
    else if (key == "heads") integer("heads", c.heads);
    else if (key == "rope_theta") number("rope_theta", c.rope_theta);
    else if (key == "norm_eps") number("norm_eps", c.norm_eps);
    else fail_argument("model config: unknown key {} (expected base, vocab, context, d_model, d_ff, layers, "
                       "heads, rope_theta, norm_eps)", json_excerpt(nlohmann::json(key)));
  }
  c.validate();
  return c;
}

ModelConfig ModelConfig::from_json_file(const std::string& path, std::vector<std::string>* keys_given) {
  std::string text;
  try {
    // ReadOnlyFile refuses a FIFO or a device (a FIFO without a writer would block the read forever).
    const ReadOnlyFile file(path, "model config");
    // A model description is a few hundred bytes; refuse anything large instead of reading it whole.
    constexpr uint64_t kMaxBytes = 1 << 20;
    FLASHLM_CHECK(file.size() <= kMaxBytes, "model config: '{}' is larger than 1 MiB", path);
    text.resize(size_t(file.size()));
    file.read_at(0, std::as_writable_bytes(std::span(text)));
  } catch (const Error& e) {
    throw InvalidArgument(e.what());  // the path is the caller's argument
  }
  try {
    return from_json(text, keys_given);
  } catch (const Error& e) {
    fail_argument("{} (in '{}')", e.what(), path);
  }
}

std::vector<ParameterInfo> parameter_layout(const ModelConfig& c) {
  c.validate();
  std::vector<ParameterInfo> out;
  int64_t offset = 0;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    ParameterInfo p{std::move(name), offset, std::move(shape)};
    offset = checked_add(offset, p.numel(), "model: parameter count");
    out.push_back(std::move(p));
  };
  const int64_t d = c.d_model;
  add("token_embeddings.weight", {c.vocab, d});
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    add(p + "ln1.weight", {d});
    add(p + "attn.q_proj.weight", {d, d});
    add(p + "attn.k_proj.weight", {d, d});
    add(p + "attn.v_proj.weight", {d, d});
    add(p + "attn.output_proj.weight", {d, d});
    add(p + "ln2.weight", {d});
    add(p + "ffn.w1.weight", {c.d_ff, d});
    add(p + "ffn.w2.weight", {d, c.d_ff});
    add(p + "ffn.w3.weight", {c.d_ff, d});
  }
  add("ln_final.weight", {d});
  add("lm_head.weight", {c.vocab, d});
  return out;
}

int64_t ModelConfig::parameter_count() const {
  const auto layout = parameter_layout(*this);
  return layout.back().offset + layout.back().numel();
}

int64_t ModelConfig::non_embedding_parameter_count() const { return parameter_count() - vocab * d_model; }

namespace {

// SplitMix64's finaliser: a bijective 64-bit mix, good enough to turn counters into independent uniforms.
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Normal(0, 0.02) truncated at 3 sigma for element `index`: Box-Muller on counter-based uniforms, redrawn
// (next counter) until inside the truncation. A function of (seed, index) alone, so that any thread
// count, and any device, gives the same weights.
float truncated_normal(uint64_t seed, uint64_t index) {
  const uint64_t key = mix64(seed ^ 0x5851f42d4c957f2dull);
  for (uint64_t draw = 0;; ++draw) {
    const uint64_t r = mix64(key ^ mix64(index * 16 + draw));
    const double u1 = (double(r >> 40) + 0.5) / double(1 << 24);          // (0, 1)
    const double u2 = (double(r & 0xffffffu) + 0.5) / double(1 << 24);   // (0, 1)
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    if (std::fabs(z) <= 3.0) return float(0.02 * z);
  }
}

}  // namespace

void init_parameter_host(const ParameterInfo& p, float* w, uint64_t seed) {
  const int64_t count = p.numel();
  if (p.shape.size() == 1) {  // RMSNorm gains start at 1
    std::fill(w, w + count, 1.0f);
    return;
  }
  // Billions of draws for the large models: in parallel (each value depends on its index only).
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) w[i] = truncated_normal(seed, uint64_t(p.offset + i));
}

void init_parameters_host(const std::vector<ParameterInfo>& layout, float* params, uint64_t seed) {
  for (const auto& p : layout) init_parameter_host(p, params + p.offset, seed);
}

std::unique_ptr<LanguageModel> make_model(const ModelConfig& config, int64_t batch, int64_t seq, Device device,
                                          DType precision, AttentionImpl attention) {
  return make_model(config, batch, seq, device, precision, ModelOptions::with_attention(attention));
}

std::unique_ptr<LanguageModel> make_model(const ModelConfig& config, int64_t batch, int64_t seq, Device device,
                                          DType precision, const ModelOptions& options) {
  if (device == Device::cpu) {
    FLASHLM_CHECK(precision == DType::f32 && !options.bf16_pure,
                  "model: the CPU engine runs fp32 (and fp8 emulated over it), not {}",
                  precision_name(precision, options.bf16_pure, options.fp8));
    return std::make_unique<CpuModel>(config, batch, seq, options);
  }
#ifdef FLASHLM_WITH_CUDA
  return std::make_unique<CudaModel>(config, batch, seq, precision, options);
#else
  fail("model: --device cuda needs a CUDA build of flashlm");
#endif
}

double cosine_lr(const AdamWConfig& c, int64_t step) {
  if (step < c.warmup_steps) return c.lr_max * double(step) / double(c.warmup_steps);
  if (step <= c.cosine_steps) {
    const double progress = double(step - c.warmup_steps) / double(std::max<int64_t>(1, c.cosine_steps - c.warmup_steps));
    return c.lr_min + 0.5 * (1.0 + std::cos(progress * std::numbers::pi)) * (c.lr_max - c.lr_min);
  }
  return c.lr_min;
}

}  // namespace flashlm
