// Decoding with a KV cache: the forward of model_cpu.cpp for one row at position p, with attention over
// the cached keys and values of positions [0, p]. The same layer kernels (ops_cpu.h) and the same attention
// entry point as the training forward, so the logits agree with CpuModel's over the whole prefix (tested).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

#include "core/check.h"
#include "core/cuda_runtime.h"
#include "core/random.h"
#include "flashlm/device.h"
#include "flashlm/generate.h"
#include "model/decoder_rows.h"
#include "model/ops_cpu.h"

namespace flashlm {

namespace {

constexpr uint64_t kSamplingStream = 0x73616d706c65ull;  // "sample"

// Host data into a buffer of the decoder's device.
void upload(void* dst, const void* src, size_t bytes, Device device) {
  if (device == Device::cpu) {
    std::memcpy(dst, src, bytes);
  } else {
    cuda_copy(dst, src, bytes);
  }
}

}  // namespace

KvCacheDecoder::KvCacheDecoder(const ModelConfig& config, std::span<const float> params, Device device)
    : config_(config), device_(device), layout_(parameter_layout(config)) {
  config.validate();
  const int64_t n = layout_.back().offset + layout_.back().numel();
  FLASHLM_CHECK(static_cast<int64_t>(params.size()) == n,
                "KvCacheDecoder: params holds {} floats, the model's parameter_count is {}", params.size(), n);
  FLASHLM_CHECK(device == Device::cpu || cuda_device_count() > 0,
                "KvCacheDecoder: device cuda: {}", cuda_built() ? "no CUDA device is visible" : "not a CUDA build");
  const size_t cache_bytes =
      size_t(checked_product({config.layers, config.context, config.d_model, int64_t{sizeof(float)}}, "KvCacheDecoder: K/V cache bytes"));
  params_ = Buffer::allocate(params.size_bytes(), device, "decoder parameters");
  upload(params_.data(), params.data(), params.size_bytes(), device);
  cache_k_ = Buffer::allocate(cache_bytes, device, "KV cache keys");
  cache_v_ = Buffer::allocate(cache_bytes, device, "KV cache values");
  const int64_t half = config.head_dim() / 2;
  std::vector<float> rope(size_t(2 * config.context * half));
  cpu::rope_tables(rope.data(), rope.data() + config.context * half, config.context, config.head_dim(),
                   config.rope_theta);
  rope_ = Buffer::allocate(rope.size() * sizeof(float), device, "RoPE tables");
  upload(rope_.data(), rope.data(), rope.size() * sizeof(float), device);
  work_ = Buffer::allocate(size_t(step_row_floats(config)) * sizeof(float), device, "decoder rows");
  if (device == Device::cuda) {
    device_token_ = Buffer::allocate(sizeof(int32_t), device, "decoder token");
    host_logits_ = Buffer::allocate(size_t(config.vocab) * sizeof(float), Device::cpu, "decoder logits");
  }
}

const float* KvCacheDecoder::param(const std::string& name) const {
  for (const auto& p : layout_) {
    if (p.name == name) return static_cast<const float*>(params_.data()) + p.offset;
  }
  fail("KvCacheDecoder: no parameter named '{}'", name);
}

const float* KvCacheDecoder::layer_param(int64_t layer, std::string_view name) const {
  return param(fmt::format("layers.{}.{}", layer, name));
}

std::span<const float> KvCacheDecoder::step(int32_t token) {
  feed(token, true);
  return logits();
}

std::span<const float> KvCacheDecoder::prefill(std::span<const int32_t> tokens) {
  FLASHLM_CHECK(!tokens.empty(), "KvCacheDecoder::prefill: no tokens");
  for (size_t i = 0; i < tokens.size(); ++i) feed(tokens[i], i + 1 == tokens.size());
  return logits();
}

std::span<const float> KvCacheDecoder::logits() const {
  const float* p = device_ == Device::cuda ? static_cast<const float*>(host_logits_.data())
                                           : step_rows(static_cast<float*>(work_.data()), config_).logits;
  return {p, static_cast<size_t>(config_.vocab)};
}

void KvCacheDecoder::feed(int32_t token, bool want_logits) {
  const ModelConfig& c = config_;
  FLASHLM_CHECK(token >= 0 && token < c.vocab, "KvCacheDecoder::step: token {} outside [0, vocab = {})", token, c.vocab);
  FLASHLM_CHECK(position_ < c.context, "KvCacheDecoder::step: the cache is full: the model's context is {} tokens",
                c.context);
  if (device_ == Device::cuda) {
    step_rows_cuda(token, want_logits);
    ++position_;
    return;
  }
  const int64_t d = c.d_model, f = c.d_ff, hd = c.head_dim(), half = hd / 2, pos = position_;
  const auto eps = static_cast<float>(c.norm_eps);
  const StepRows r = step_rows(static_cast<float*>(work_.data()), c);
  const float* cos = static_cast<const float*>(rope_.data()) + pos * half;
  const float* sin = static_cast<const float*>(rope_.data()) + c.context * half + pos * half;
  float rstd = 0;
  AttentionOptions attn;  // the new row sees every cached position, itself included: no mask needed
  attn.impl = AttentionImpl::flash;

  cpu::embedding_forward(param("token_embeddings.weight"), &token, r.x, 1, d);
  for (int64_t l = 0; l < c.layers; ++l) {
    float* keys = static_cast<float*>(cache_k_.data()) + l * c.context * d;
    float* values = static_cast<float*>(cache_v_.data()) + l * c.context * d;
    cpu::rmsnorm_forward(r.x, layer_param(l, "ln1.weight"), r.h, &rstd, 1, d, eps);
    cpu::linear_forward(r.h, layer_param(l, "attn.q_proj.weight"), r.q, 1, d, d);
    cpu::linear_forward(r.h, layer_param(l, "attn.k_proj.weight"), keys + pos * d, 1, d, d);
    cpu::linear_forward(r.h, layer_param(l, "attn.v_proj.weight"), values + pos * d, 1, d, d);
    // The tables' row `pos` rotates a one-position sequence as the training forward rotates position pos.
    cpu::rope_forward(r.q, cos, sin, 1, 1, c.heads, hd);
    cpu::rope_forward(keys + pos * d, cos, sin, 1, 1, c.heads, hd);
    attention_forward(TensorView::contiguous(r.q, DType::f32, {1, 1, c.heads, hd}),
                      TensorView::contiguous(keys, DType::f32, {1, pos + 1, c.heads, hd}),
                      TensorView::contiguous(values, DType::f32, {1, pos + 1, c.heads, hd}),
                      TensorView::contiguous(r.o, DType::f32, {1, 1, c.heads, hd}),
                      TensorView::contiguous(r.lse, DType::f32, {1, c.heads, 1}), attn);
    cpu::linear_forward(r.o, layer_param(l, "attn.output_proj.weight"), r.h, 1, d, d);
    for (int64_t i = 0; i < d; ++i) r.x[i] += r.h[i];
    cpu::rmsnorm_forward(r.x, layer_param(l, "ln2.weight"), r.h, &rstd, 1, d, eps);
    cpu::linear_forward(r.h, layer_param(l, "ffn.w1.weight"), r.u, 1, d, f);
    cpu::linear_forward(r.h, layer_param(l, "ffn.w3.weight"), r.g, 1, d, f);
    cpu::swiglu_forward(r.u, r.g, r.s, f);
    cpu::linear_forward(r.s, layer_param(l, "ffn.w2.weight"), r.h, 1, f, d);
    for (int64_t i = 0; i < d; ++i) r.x[i] += r.h[i];
  }
  if (want_logits) {
    cpu::rmsnorm_forward(r.x, param("ln_final.weight"), r.h, &rstd, 1, d, eps);
    cpu::linear_forward(r.h, param("lm_head.weight"), r.logits, 1, d, c.vocab);
  }
  ++position_;
}

#ifndef FLASHLM_WITH_CUDA
void KvCacheDecoder::step_rows_cuda(int32_t, bool) { fail("KvCacheDecoder: device cuda: not a CUDA build"); }
#endif

int32_t sample_token(std::span<const float> logits, const SamplingOptions& o, uint64_t draw) {
  FLASHLM_CHECK(!logits.empty(), "sample_token: no logits");
  FLASHLM_CHECK(std::isfinite(o.temperature) && o.temperature >= 0,
                "sample_token: temperature = {}, expected a finite number >= 0", o.temperature);
  FLASHLM_CHECK(o.top_k >= 0, "sample_token: top_k = {}, expected >= 0 (0: every token)", o.top_k);
  for (size_t i = 0; i < logits.size(); ++i) {
    FLASHLM_CHECK(std::isfinite(logits[i]), "sample_token: logits[{}] = {} is not finite", i, logits[i]);
  }
  // Candidates in order of decreasing logit, the lower index first among equals.
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const auto k = static_cast<size_t>(o.top_k == 0 ? int64_t(logits.size()) : std::min<int64_t>(o.top_k, int64_t(logits.size())));
  const auto before = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(), before);
  if (o.temperature == 0 || k == 1) return order[0];
  std::vector<double> weight(k);
  const double top = logits[order[0]];
  double total = 0;
  for (size_t i = 0; i < k; ++i) total += weight[i] = std::exp((logits[order[i]] - top) / o.temperature);
  // 53 random bits: a uniform double in [0, 1), scaled to the total weight.
  const double u = double(counter_draw(o.seed ^ kSamplingStream, draw) >> 11) * 0x1p-53 * total;
  double cumulative = 0;
  for (size_t i = 0; i < k; ++i) {
    cumulative += weight[i];
    if (u < cumulative) return order[i];
  }
  return order[k - 1];  // u within rounding of the total
}

std::vector<int32_t> generate_tokens(KvCacheDecoder& decoder, std::span<const int32_t> prompt, int64_t max_new_tokens,
                                     const SamplingOptions& options,
                                     const std::function<void(int32_t, std::span<const float>)>& on_token) {
  const auto context = static_cast<size_t>(decoder.config().context);
  FLASHLM_CHECK(!prompt.empty(), "generate: the prompt is empty: give at least one token");
  FLASHLM_CHECK(max_new_tokens >= 0, "generate: max_new_tokens = {}, expected >= 0", max_new_tokens);
  // The tokens the next logits are conditioned on: the last `context` of the prompt and those drawn so far,
  // as nanoGPT's sampler crops its input to the block size.
  std::vector<int32_t> window(prompt.size() > context ? prompt.end() - std::ptrdiff_t(context) : prompt.begin(),
                              prompt.end());
  std::span<const float> logits;
  const auto encode_window = [&] {
    decoder.reset();
    logits = decoder.prefill(window);
  };
  encode_window();
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(max_new_tokens));
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    const int32_t next = sample_token(logits, options, static_cast<uint64_t>(i));
    if (on_token) on_token(next, logits);
    out.push_back(next);
    if (i + 1 == max_new_tokens) break;  // the last token needs no logits after it
    if (window.size() < context) {
      window.push_back(next);
      logits = decoder.step(next);
      continue;
    }
    // A full context slides by one: the oldest token goes and the window is encoded again from position 0,
    // the positions the model was trained on. Nothing in the cache can be kept: past the first layer every
    // cached key depends on the tokens before it, the dropped one included, and RoPE's positions all shift.
    window.erase(window.begin());
    window.push_back(next);
    encode_window();
  }
  return out;
}

}  // namespace flashlm
