// Sampling text from a trained LM: a decoder with a KV cache (each layer keeps the keys and values of every
// position it has seen, so a new token costs one pass of one row through the layers, not a forward over the
// whole prefix), and temperature / top-k sampling whose draws are a pure function of (seed, position), so a
// seed gives the same text on every run and thread count.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
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

// ---------------------------------------------------------------------------------------------------------
// Batched decoding over a paged KV cache (generate --batch, and generate --device cuda's default).

// The page bookkeeping of a paged KV cache, on the host: `num_pages` pages of `page_size` positions shared
// by `sequences` sequences, each holding at most `max_pages` pages (its row of the block table). Pages are
// handed out from a free list as a sequence grows and go back to it when the sequence is released (the last
// released page is the next handed out), so a sequence's pages need not be adjacent nor in order. Only the
// indices live here: the K/V storage is the decoder's ([num_pages, page_size, heads, head_dim] per layer, one
// page index meaning the same slot in every layer).
class KvPagePool {
 public:
  // sequences >= 1, page_size >= 1, num_pages >= 1, max_pages >= 1: InvalidArgument otherwise.
  KvPagePool(int64_t sequences, int64_t page_size, int64_t num_pages, int64_t max_pages);

  int64_t sequences() const { return sequences_; }
  int64_t page_size() const { return page_size_; }
  int64_t num_pages() const { return num_pages_; }
  int64_t max_pages() const { return max_pages_; }
  int64_t free_pages() const { return int64_t(free_.size()); }
  int64_t capacity() const { return max_pages_ * page_size_; }  // positions one sequence can hold

  int64_t length(int64_t seq) const;                    // positions the sequence holds
  std::span<const int32_t> pages(int64_t seq) const;    // its pages in position order
  // Makes room for `n` more positions after length(seq), taking pages from the free list as needed (length
  // is unchanged until advance). Error when the sequence would pass capacity() or the pool has too few free
  // pages left (the message names both counts); nothing changes then.
  void reserve(int64_t seq, int64_t n);
  // length(seq) += n, within the pages reserved; Error otherwise.
  void advance(int64_t seq, int64_t n);
  // The sequence's pages back to the free list, its length 0.
  void release(int64_t seq);
  // The page and row of position pos (< length(seq) + what reserve made room for).
  std::pair<int32_t, int64_t> locate(int64_t seq, int64_t pos) const;
  // [sequences, max_pages] int32 row-major, each row the sequence's pages then -1 (never read by the kernels).
  std::span<const int32_t> block_table() const { return table_; }

 private:
  int64_t sequences_, page_size_, num_pages_, max_pages_;
  std::vector<int32_t> table_, free_;
  std::vector<int64_t> lengths_, held_;  // per sequence: positions, pages held
  void check_seq(int64_t seq, const char* fn) const;
};

struct PagedDecoderOptions {
  int64_t batch = 1;        // sequences decoded together, >= 1
  int64_t page_size = 256;  // positions per page: a multiple of 16 in [16, 256] (flash_attention_with_kvcache's)
  // Pages in the pool shared by the batch; 0: enough for every sequence to fill the context. generate_batch
  // callers size it to what their prompts and new tokens need (paged_pool_pages).
  int64_t num_pages = 0;
  // CUDA: each forward of one new token per sequence (every step; a prefill's last chunk when it is one token)
  // replayed as one CUDA graph, one per number of sequences, captured after that number's first (eager)
  // forward; false: every forward launched kernel by kernel. The two give bit-identical logits. Prefill chunks
  // of several tokens always run eagerly. Ignored on the CPU.
  bool cuda_graph = true;
};

// The CS336 LM decoding a batch of sequences at once over one paged KV-cache pool (KvPagePool), attention
// through flash_attention_with_kvcache (the new keys and values appended in place, each sequence at its own
// length, bottom-right causal). On the CPU everything is fp32 (the layer functions of KvCacheDecoder's CPU
// step, fp32 pages): the reference the tests hold it to. On CUDA the linear layers run in bf16 on a bf16 copy
// of the weights (cast once from the fp32 checkpoint; the embedding table and the RMSNorm gains stay fp32 as
// the layer functions take them), activations and pages in bf16, logits rounded from bf16 to fp32; the model
// needs a head_dim of 64, 128 or 256 (the CUDA decoding kernels') and d_ff a multiple of 8 (InvalidArgument
// naming the field otherwise; paged_decoder_supports says beforehand).
class PagedKvDecoder {
 public:
  PagedKvDecoder(const ModelConfig& config, std::span<const float> params, Device device,
                 const PagedDecoderOptions& options);
  ~PagedKvDecoder();
  PagedKvDecoder(const PagedKvDecoder&) = delete;
  PagedKvDecoder& operator=(const PagedKvDecoder&) = delete;

  const ModelConfig& config() const { return config_; }
  Device device() const { return device_; }
  int64_t batch() const { return pool_.sequences(); }
  const KvPagePool& pool() const { return pool_; }
  int64_t length(int64_t seq) const { return pool_.length(seq); }  // the next token's position
  void reset(int64_t seq) { pool_.release(seq); }                   // its pages back to the pool

  // Feeds `tokens` (at least one) to sequence seq after what it holds, in chunks of up to kPrefillChunk
  // queries per attention call, and returns the logits after the last ([vocab] on the host, valid until the
  // next call). A token outside [0, vocab) or more positions than the context are InvalidArgument; an
  // exhausted pool an Error; either leaves the sequence as it was.
  std::span<const float> prefill(int64_t seq, std::span<const int32_t> tokens);
  // One token for each of `seqs` (distinct sequences, tokens[i] for seqs[i]) in one batched step; returns
  // their logits, [seqs.size(), vocab] row-major on the host, valid until the next call.
  std::span<const float> step(std::span<const int64_t> seqs, std::span<const int32_t> tokens);
  // One token for every sequence of the batch: step(0, 1, ..., batch - 1).
  std::span<const float> step(std::span<const int32_t> tokens);

  // CUDA: how the last forward of one token per sequence (a step) ran: "on" (a graph replay), "on (...)" (an
  // eager warm-up before a capture), or "off: <why>" (cuda_graph off, profiled ranges, or a capture that
  // failed: every later step is eager); "" on the CPU.
  std::string cuda_graph_status() const;

  static constexpr int64_t kPrefillChunk = 16;  // query rows per prefill call (the decoding kernels' Nq 1-16)

  struct Impl;  // the device's buffers (model/paged_decoder.cpp, model/cuda/paged_decoder.cpp)

 private:
  ModelConfig config_;
  Device device_;
  KvPagePool pool_;
  std::vector<ParameterInfo> layout_;
  std::vector<float> rope_cos_, rope_sin_;  // host tables [context, head_dim / 2]
  std::vector<float> logits_;               // host [rows, vocab]
  std::unique_ptr<Impl> impl_;

  // The rows of one call: `batch` sequences of `nq` new tokens each (nq == 1, or batch == 1), tokens
  // row-major, positions already reserved; logits of each sequence's last row into logits_ when want_logits.
  void forward(std::span<const int64_t> seqs, int64_t nq, std::span<const int32_t> tokens, bool want_logits);
  void forward_cpu(std::span<const int64_t> seqs, int64_t nq, std::span<const int32_t> tokens, bool want_logits);
  void forward_cuda(std::span<const int64_t> seqs, int64_t nq, std::span<const int32_t> tokens, bool want_logits);
  void upload_cuda(std::span<const float> params, bool cuda_graph);  // model/cuda/paged_decoder.cpp
};

// Whether PagedKvDecoder runs this model on `device` (the CPU runs any); when not, *why (if given) says why.
bool paged_decoder_supports(const ModelConfig& config, Device device, std::string* why = nullptr);

// Pages a batch needs: each prompt's window (its last `context` tokens) and max_new_tokens more, capped at
// the context (past it the window slides and the sequence's pages are reused), in pages of page_size.
int64_t paged_pool_pages(const ModelConfig& config, std::span<const std::vector<int32_t>> prompts,
                         int64_t max_new_tokens, int64_t page_size);

struct BatchGeneration {
  std::vector<std::vector<int32_t>> tokens;  // per sequence, max_new_tokens each
  int64_t prompt_tokens = 0;                 // tokens prefilled before the first new ones
  double prefill_seconds = 0;                // wall time of those prefills (and their first logits)
  double decode_seconds = 0;                 // wall time of everything after (steps, slides, sampling)
};

// generate_tokens for a batch: prompts[b] (at least one token) is sequence b of the decoder (prompts.size()
// == decoder.batch()); every sequence gets max_new_tokens tokens, stepped together. Sequence b draws with
// seed options.seed + b (draw i for its i-th token), so it is exactly the text generate_tokens gives its
// prompt with that seed, within the logits' rounding; past the context its window slides as generate_tokens'
// does (its pages released and the last `context` tokens prefilled again from position 0, alone, while the
// others step on). on_token (if set) sees (sequence, token, logits) for every new token, sequence by sequence
// within a step.
BatchGeneration generate_batch(PagedKvDecoder& decoder, std::span<const std::vector<int32_t>> prompts,
                               int64_t max_new_tokens, const SamplingOptions& options,
                               const std::function<void(int64_t, int32_t, std::span<const float>)>& on_token = {});

}  // namespace flashlm
