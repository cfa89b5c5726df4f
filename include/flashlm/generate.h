// Sampling text from a trained LM: a decoder with a KV cache (each layer keeps the keys and values of every
// position it has seen, so a new token costs one pass of one row through the layers, not a forward over the
// whole prefix), and temperature / top-k sampling whose draws are a pure function of (seed, position), so a
// seed gives the same text on every run and thread count.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "flashlm/memory.h"
#include "flashlm/model.h"

namespace flashlm {

// The CS336 LM (model.h) in fp32, one token at a time, on the CPU or on the current CUDA device (the same
// layer functions as the training forward of each, ops_cpu.h / cuda/ops.h, cuBLASLt in true fp32, and the
// attention entry point with one query over the cached keys, bottom-right causal). The K/V cache holds
// `config.context` positions per layer: [layers][context, heads, head_dim] for keys and for values,
// allocated up front on the decoder's device.
class KvCacheDecoder {
 public:
  // params: the flat fp32 parameters in parameter_layout(config) (a checkpoint's, or a safetensors file's);
  // they are copied (to the GPU for Device::cuda, which needs a CUDA build and a visible GPU).
  KvCacheDecoder(const ModelConfig& config, std::span<const float> params, Device device = Device::cpu);

  const ModelConfig& config() const { return config_; }
  int64_t position() const { return position_; }  // tokens fed so far (the next token's position)
  void reset() { position_ = 0; }                 // forget the cache: the next token is at position 0

  Device device() const { return device_; }

  // Feeds `token` at position(): its keys and values join the cache and the logits of the next token come
  // back ([vocab] on the host, valid until the next call). A token outside [0, vocab) or a full cache is an
  // Error.
  std::span<const float> step(int32_t token);

  // Feeds `tokens` (at least one) as step() would, one after another, and returns the logits after the last;
  // the others' final norm and LM head (a vocab x d_model product per token) are skipped. How a prompt, or
  // generate_tokens' slid window, is encoded.
  std::span<const float> prefill(std::span<const int32_t> tokens);

 private:
  ModelConfig config_;
  Device device_ = Device::cpu;
  std::vector<ParameterInfo> layout_;
  Buffer params_, cache_k_, cache_v_, rope_, work_;
  Buffer device_token_, host_logits_;  // CUDA: the token fed in, the logits brought back
  int64_t position_ = 0;

  // One token through the layers into the cache; the logits too when want_logits (CPU: in the work rows).
  void feed(int32_t token, bool want_logits);
  // model/cuda/decoder.cpp: the CUDA step; the logits (when asked for) land in host_logits_.
  void step_rows_cuda(int32_t token, bool want_logits);
  std::span<const float> logits() const;  // the last fed token's (when it asked for them)

  const float* param(const std::string& name) const;
  const float* layer_param(int64_t layer, std::string_view name) const;  // "layers.<layer>.<name>"
};

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy (the most likely token)
  int64_t top_k = 0;         // sample among the k most likely tokens; 0: all
  uint64_t seed = 0;
};

// One token drawn from softmax(logits / temperature) restricted to the top_k largest logits (ties broken
// by the lower index), with the uniform draw number `draw` of the seed's stream. Bad options or a logit
// that is not finite are Errors.
int32_t sample_token(std::span<const float> logits, const SamplingOptions& options, uint64_t draw);

// Feeds the prompt (at least one token), then samples max_new_tokens tokens one by one (draw i for the
// i-th), each fed back in; on_token (if set) sees each new token with the logits it was drawn from. The
// decoder starts from position 0. Each token is drawn from the logits of the last `context` tokens (prompt
// and new ones), as nanoGPT's sampler does: a longer prompt keeps its last `context` tokens, and once the
// context is full each new token re-encodes the slid window from position 0 (prefill: `context` decoder
// steps, one LM head, per token, where one step does within the context).
std::vector<int32_t> generate_tokens(KvCacheDecoder& decoder, std::span<const int32_t> prompt, int64_t max_new_tokens,
                                     const SamplingOptions& options,
                                     const std::function<void(int32_t, std::span<const float>)>& on_token = {});

}  // namespace flashlm
