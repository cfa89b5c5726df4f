// Batched decoding over a paged KV cache: the page pool's bookkeeping (KvPagePool), PagedKvDecoder's host
// logic (checks, pages reserved before a forward and counted after it, prefill in chunks) and its CPU step
// (fp32, the layer functions of KvCacheDecoder's CPU step), and generate_batch. The CUDA step is
// model/cuda/paged_decoder.cpp.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/attention.h"
#include "flashlm/device.h"
#include "flashlm/generate.h"
#include "model/ops_cpu.h"
#include "model/paged_decoder_impl.h"

namespace flashlm {

// ---------------------------------------------------------------------------------------------------------
// KvPagePool

KvPagePool::KvPagePool(int64_t sequences, int64_t page_size, int64_t num_pages, int64_t max_pages)
    : sequences_(sequences), page_size_(page_size), num_pages_(num_pages), max_pages_(max_pages) {
  FLASHLM_CHECK_ARG(sequences >= 1, "KvPagePool: sequences = {}, expected at least 1", sequences);
  FLASHLM_CHECK_ARG(page_size >= 1, "KvPagePool: page_size = {}, expected at least 1", page_size);
  FLASHLM_CHECK_ARG(num_pages >= 1 && num_pages <= INT32_MAX, "KvPagePool: num_pages = {}, expected 1 .. {}",
                    num_pages, INT32_MAX);
  FLASHLM_CHECK_ARG(max_pages >= 1, "KvPagePool: max_pages = {}, expected at least 1", max_pages);
  checked_mul(max_pages, page_size, "KvPagePool: positions per sequence");
  table_.assign(size_t(checked_mul(sequences, max_pages, "KvPagePool: block table entries")), -1);
  lengths_.assign(size_t(sequences), 0);
  held_.assign(size_t(sequences), 0);
  free_.resize(size_t(num_pages));
  // A stack: page 0 is handed out first.
  for (int64_t i = 0; i < num_pages; ++i) free_[size_t(i)] = int32_t(num_pages - 1 - i);
}

void KvPagePool::check_seq(int64_t seq, const char* fn) const {
  FLASHLM_CHECK_ARG(seq >= 0 && seq < sequences_, "KvPagePool::{}: sequence {} outside [0, {})", fn, seq, sequences_);
}

int64_t KvPagePool::length(int64_t seq) const {
  check_seq(seq, "length");
  return lengths_[size_t(seq)];
}

std::span<const int32_t> KvPagePool::pages(int64_t seq) const {
  check_seq(seq, "pages");
  return std::span(table_).subspan(size_t(seq * max_pages_), size_t(held_[size_t(seq)]));
}

void KvPagePool::reserve(int64_t seq, int64_t n) {
  check_seq(seq, "reserve");
  FLASHLM_CHECK_ARG(n >= 0, "KvPagePool::reserve: n = {}, expected >= 0", n);
  const auto s = size_t(seq);
  const int64_t want = checked_add(lengths_[s], n, "KvPagePool::reserve: positions");
  FLASHLM_CHECK(want <= capacity(),
                "KvPagePool: sequence {} would hold {} positions, more than its {} ({} pages of {})", seq, want,
                capacity(), max_pages_, page_size_);
  const int64_t need = (want + page_size_ - 1) / page_size_ - held_[s];
  if (need <= 0) return;
  FLASHLM_CHECK(need <= free_pages(),
                "KvPagePool: the pool is exhausted: sequence {} needs {} more page{} of {} positions and {} of the "
                "{} pages are free",
                seq, need, need == 1 ? "" : "s", page_size_, free_pages(), num_pages_);
  for (int64_t i = 0; i < need; ++i) {
    table_[size_t(seq * max_pages_ + held_[s])] = free_.back();
    free_.pop_back();
    ++held_[s];
  }
}

void KvPagePool::advance(int64_t seq, int64_t n) {
  check_seq(seq, "advance");
  const auto s = size_t(seq);
  FLASHLM_CHECK(n >= 0 && lengths_[s] + n <= held_[s] * page_size_,
                "KvPagePool::advance: sequence {} holds {} positions in {} pages of {}: {} more were not reserved",
                seq, lengths_[s], held_[s], page_size_, n);
  lengths_[s] += n;
}

void KvPagePool::release(int64_t seq) {
  check_seq(seq, "release");
  const auto s = size_t(seq);
  for (int64_t i = 0; i < held_[s]; ++i) {
    int32_t& entry = table_[size_t(seq * max_pages_ + i)];
    free_.push_back(entry);
    entry = -1;
  }
  held_[s] = 0;
  lengths_[s] = 0;
}

std::pair<int32_t, int64_t> KvPagePool::locate(int64_t seq, int64_t pos) const {
  check_seq(seq, "locate");
  FLASHLM_CHECK_ARG(pos >= 0 && pos < held_[size_t(seq)] * page_size_,
                    "KvPagePool::locate: position {} of sequence {} is not in its {} pages of {}", pos, seq,
                    held_[size_t(seq)], page_size_);
  return {table_[size_t(seq * max_pages_ + pos / page_size_)], pos % page_size_};
}

// ---------------------------------------------------------------------------------------------------------
// PagedKvDecoder

bool paged_decoder_supports(const ModelConfig& config, Device device, std::string* why) {
  const auto no = [&](std::string reason) {
    if (why) *why = std::move(reason);
    return false;
  };
  if (device == Device::cpu) return true;
  if (!cuda_built()) return no("this flashlm was built without CUDA");
  const int64_t hd = config.head_dim();
  if (hd != 64 && hd != 128 && hd != 256) {
    return no(fmt::format("head_dim {} (d_model {} / heads {}) has no CUDA decoding kernel (64, 128 or 256)", hd,
                          config.d_model, config.heads));
  }
  if (config.d_ff % 8 != 0) return no(fmt::format("d_ff {} is not a multiple of 8 (the bf16 GEMMs')", config.d_ff));
  return true;
}

PagedKvDecoder::PagedKvDecoder(const ModelConfig& config, std::span<const float> params, Device device,
                               const PagedDecoderOptions& options)
    : config_(config),
      device_(device),
      pool_([&] {
        config.validate();
        FLASHLM_CHECK_ARG(options.batch >= 1, "PagedKvDecoder: batch = {}, expected at least 1", options.batch);
        FLASHLM_CHECK_ARG(options.page_size >= 16 && options.page_size <= 256 && options.page_size % 16 == 0,
                          "PagedKvDecoder: page_size = {}, expected a multiple of 16 in [16, 256]", options.page_size);
        FLASHLM_CHECK_ARG(options.num_pages >= 0, "PagedKvDecoder: num_pages = {}, expected >= 0 (0: enough for "
                          "every sequence to fill the context)", options.num_pages);
        const int64_t max_pages = (config.context + options.page_size - 1) / options.page_size;
        const int64_t pages = options.num_pages > 0 ? options.num_pages
                                                    : checked_mul(options.batch, max_pages, "PagedKvDecoder: pages");
        return KvPagePool(options.batch, options.page_size, pages, max_pages);
      }()),
      layout_(parameter_layout(config)),
      impl_(std::make_unique<Impl>()) {
  const int64_t n = layout_.back().offset + layout_.back().numel();
  FLASHLM_CHECK_ARG(static_cast<int64_t>(params.size()) == n,
                    "PagedKvDecoder: params holds {} floats, the model's parameter_count is {}", params.size(), n);
  std::string why;
  FLASHLM_CHECK_ARG(device == Device::cpu || cuda_device_count() > 0, "PagedKvDecoder: device cuda: {}",
                    cuda_built() ? "no CUDA device is visible" : "not a CUDA build");
  FLASHLM_CHECK_ARG(paged_decoder_supports(config, device, &why), "PagedKvDecoder: device {}: {}", device_name(device),
                    why);
  const int64_t half = config.head_dim() / 2;
  rope_cos_.resize(size_t(config.context * half));
  rope_sin_.resize(size_t(config.context * half));
  cpu::rope_tables(rope_cos_.data(), rope_sin_.data(), config.context, config.head_dim(), config.rope_theta);
  impl_->max_rows = std::max(pool_.sequences(), kPrefillChunk);
  if (device == Device::cuda) {
    upload_cuda(params, options.cuda_graph);
    return;
  }
  const int64_t d = config.d_model, f = config.d_ff, rows = impl_->max_rows;
  impl_->params = Buffer::allocate(params.size_bytes(), Device::cpu, "paged decoder parameters");
  std::memcpy(impl_->params.data(), params.data(), params.size_bytes());
  const size_t page_bytes = size_t(checked_product(
      {config.layers, pool_.num_pages(), pool_.page_size(), d, int64_t{sizeof(float)}}, "PagedKvDecoder: pages bytes"));
  impl_->k_pages = Buffer::allocate(page_bytes, Device::cpu, "paged KV cache keys");
  impl_->v_pages = Buffer::allocate(page_bytes, Device::cpu, "paged KV cache values");
  impl_->work = Buffer::allocate(size_t(rows * (6 * d + 3 * f + 1)) * sizeof(float), Device::cpu, "paged decoder rows");
}

PagedKvDecoder::~PagedKvDecoder() = default;

#ifndef FLASHLM_WITH_CUDA
void PagedKvDecoder::upload_cuda(std::span<const float>, bool) {
  fail("PagedKvDecoder: device cuda: not a CUDA build");
}
void PagedKvDecoder::Impl::CudaStepDeleter::operator()(CudaStep*) const {}  // never holds one without CUDA
std::string PagedKvDecoder::cuda_graph_status() const { return ""; }
void PagedKvDecoder::forward_cuda(std::span<const int64_t>, int64_t, std::span<const int32_t>, bool) {
  fail("PagedKvDecoder: device cuda: not a CUDA build");
}
#endif

std::span<const float> PagedKvDecoder::prefill(int64_t seq, std::span<const int32_t> tokens) {
  FLASHLM_CHECK_ARG(seq >= 0 && seq < batch(), "PagedKvDecoder::prefill: sequence {} outside [0, batch = {})", seq,
                    batch());
  FLASHLM_CHECK_ARG(!tokens.empty(), "PagedKvDecoder::prefill: no tokens");
  const int64_t n = int64_t(tokens.size()), len = length(seq);
  FLASHLM_CHECK_ARG(len + n <= config_.context,
                    "PagedKvDecoder::prefill: sequence {} would hold {} + {} tokens, more than the model's context of "
                    "{} tokens",
                    seq, len, n, config_.context);
  for (size_t i = 0; i < tokens.size(); ++i) {
    FLASHLM_CHECK_ARG(tokens[i] >= 0 && tokens[i] < config_.vocab,
                      "PagedKvDecoder::prefill: token {} = {} outside [0, vocab = {})", i, tokens[i], config_.vocab);
  }
  pool_.reserve(seq, n);
  const int64_t seqs[1] = {seq};
  for (int64_t at = 0; at < n; at += kPrefillChunk) {
    const int64_t chunk = std::min(kPrefillChunk, n - at);
    forward(seqs, chunk, tokens.subspan(size_t(at), size_t(chunk)), at + chunk == n);
    pool_.advance(seq, chunk);
  }
  return {logits_.data(), size_t(config_.vocab)};
}

std::span<const float> PagedKvDecoder::step(std::span<const int32_t> tokens) {
  std::vector<int64_t> all(static_cast<size_t>(batch()));
  for (int64_t b = 0; b < batch(); ++b) all[size_t(b)] = b;
  return step(all, tokens);
}

std::span<const float> PagedKvDecoder::step(std::span<const int64_t> seqs, std::span<const int32_t> tokens) {
  FLASHLM_CHECK_ARG(!seqs.empty(), "PagedKvDecoder::step: no sequences");
  FLASHLM_CHECK_ARG(tokens.size() == seqs.size(), "PagedKvDecoder::step: {} tokens for {} sequences", tokens.size(),
                    seqs.size());
  std::vector<bool> seen(static_cast<size_t>(batch()), false);
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t s = seqs[i];
    FLASHLM_CHECK_ARG(s >= 0 && s < batch(), "PagedKvDecoder::step: sequence {} outside [0, batch = {})", s, batch());
    FLASHLM_CHECK_ARG(!seen[size_t(s)], "PagedKvDecoder::step: sequence {} given twice", s);
    seen[size_t(s)] = true;
    FLASHLM_CHECK_ARG(tokens[i] >= 0 && tokens[i] < config_.vocab,
                      "PagedKvDecoder::step: token {} = {} outside [0, vocab = {})", i, tokens[i], config_.vocab);
    FLASHLM_CHECK_ARG(length(s) < config_.context,
                      "PagedKvDecoder::step: sequence {} is full: the model's context is {} tokens", s,
                      config_.context);
  }
  for (const int64_t s : seqs) pool_.reserve(s, 1);
  forward(seqs, 1, tokens, true);
  for (const int64_t s : seqs) pool_.advance(s, 1);
  return {logits_.data(), seqs.size() * size_t(config_.vocab)};
}

void PagedKvDecoder::forward(std::span<const int64_t> seqs, int64_t nq, std::span<const int32_t> tokens,
                             bool want_logits) {
  FLASHLM_CHECK(nq == 1 || seqs.size() == 1, "PagedKvDecoder: {} sequences of {} tokens in one forward", seqs.size(),
                nq);
  FLASHLM_CHECK(int64_t(seqs.size()) * nq <= impl_->max_rows, "PagedKvDecoder: {} rows, more than {}",
                int64_t(seqs.size()) * nq, impl_->max_rows);
  logits_.resize(seqs.size() * size_t(config_.vocab));
  if (device_ == Device::cuda) {
    forward_cuda(seqs, nq, tokens, want_logits);
  } else {
    forward_cpu(seqs, nq, tokens, want_logits);
  }
}

void PagedKvDecoder::forward_cpu(std::span<const int64_t> seqs, int64_t nq, std::span<const int32_t> tokens,
                                 bool want_logits) {
  const ModelConfig& c = config_;
  const int64_t B = int64_t(seqs.size()), R = B * nq, d = c.d_model, f = c.d_ff, H = c.heads, hd = c.head_dim(),
                half = hd / 2, P = pool_.num_pages(), ps = pool_.page_size(), mp = pool_.max_pages();
  const auto eps = static_cast<float>(c.norm_eps);
  const float* params = static_cast<const float*>(impl_->params.data());
  const auto weight = [&](size_t index) { return params + layout_[index].offset; };
  // parameter_layout's order: the embedding, then per layer ln1, q, k, v, output, ln2, w1, w2, w3; ln_final, lm_head.
  const auto layer = [&](int64_t l, size_t i) { return weight(1 + size_t(l) * 9 + i); };

  float* p = static_cast<float*>(impl_->work.data());
  const auto take = [&](int64_t n) { return std::exchange(p, p + n); };
  float *x = take(R * d), *h = take(R * d), *q = take(R * d), *k = take(R * d), *v = take(R * d), *o = take(R * d),
        *u = take(R * f), *g = take(R * f), *s = take(R * f), *rstd = take(R);

  // RoPE rows gathered per row (row r of sequence i at its position), cache_seqlens and the block-table rows.
  std::vector<float> cos(size_t(R * half)), sin(size_t(R * half));
  std::vector<int32_t> lens(static_cast<size_t>(B)), table(size_t(B * mp));
  for (int64_t i = 0; i < B; ++i) {
    const int64_t len = pool_.length(seqs[size_t(i)]);
    lens[size_t(i)] = int32_t(len);
    const auto row = pool_.block_table().subspan(size_t(seqs[size_t(i)] * mp), size_t(mp));
    std::copy(row.begin(), row.end(), table.begin() + i * mp);
    for (int64_t t = 0; t < nq; ++t) {
      std::copy_n(rope_cos_.data() + (len + t) * half, half, cos.data() + (i * nq + t) * half);
      std::copy_n(rope_sin_.data() + (len + t) * half, half, sin.data() + (i * nq + t) * half);
    }
  }
  AttentionOptions attn;
  attn.causal = true;  // bottom-right: row t of a sequence sees its cache and the new rows up to itself
  KvCacheIndex index;
  index.cache_seqlens = lens.data();
  index.block_table = table.data();
  index.max_pages = mp;
  const auto rows_view = [&](float* ptr) { return TensorView::contiguous(ptr, DType::f32, {B, nq, H, hd}); };

  cpu::embedding_forward(weight(0), tokens.data(), x, R, d);
  for (int64_t l = 0; l < c.layers; ++l) {
    float* kc = static_cast<float*>(impl_->k_pages.data()) + l * P * ps * d;
    float* vc = static_cast<float*>(impl_->v_pages.data()) + l * P * ps * d;
    cpu::rmsnorm_forward(x, layer(l, 0), h, rstd, R, d, eps);
    cpu::linear_forward(h, layer(l, 1), q, R, d, d);
    cpu::linear_forward(h, layer(l, 2), k, R, d, d);
    cpu::linear_forward(h, layer(l, 3), v, R, d, d);
    cpu::rope_forward(q, cos.data(), sin.data(), 1, R, H, hd);
    cpu::rope_forward(k, cos.data(), sin.data(), 1, R, H, hd);
    flash_attention_with_kvcache(rows_view(q), TensorView::contiguous(kc, DType::f32, {P, ps, H, hd}),
                                 TensorView::contiguous(vc, DType::f32, {P, ps, H, hd}), index, rows_view(k),
                                 rows_view(v), rows_view(o), TensorView{}, attn);
    cpu::linear_forward(o, layer(l, 4), h, R, d, d);
    for (int64_t i = 0; i < R * d; ++i) x[i] += h[i];
    cpu::rmsnorm_forward(x, layer(l, 5), h, rstd, R, d, eps);
    cpu::linear_forward(h, layer(l, 6), u, R, d, f);
    cpu::linear_forward(h, layer(l, 8), g, R, d, f);
    cpu::swiglu_forward(u, g, s, R * f);
    cpu::linear_forward(s, layer(l, 7), h, R, f, d);
    for (int64_t i = 0; i < R * d; ++i) x[i] += h[i];
  }
  if (!want_logits) return;
  // The last row of each sequence: every row when nq = 1, else (one sequence) row nq - 1.
  const int64_t first = nq == 1 ? 0 : nq - 1, n_out = nq == 1 ? B : 1;
  const size_t last = layout_.size() - 1;
  cpu::rmsnorm_forward(x + first * d, weight(last - 1), h, rstd, n_out, d, eps);
  cpu::linear_forward(h, weight(last), logits_.data(), n_out, d, c.vocab);
}

int64_t paged_pool_pages(const ModelConfig& config, std::span<const std::vector<int32_t>> prompts,
                         int64_t max_new_tokens, int64_t page_size) {
  FLASHLM_CHECK_ARG(page_size >= 1, "paged_pool_pages: page_size = {}, expected >= 1", page_size);
  int64_t pages = 0;
  for (const auto& prompt : prompts) {
    const int64_t window = std::min<int64_t>(int64_t(prompt.size()), config.context);
    const int64_t positions = std::max<int64_t>(1, std::min(config.context, window + std::max<int64_t>(max_new_tokens, 0)));
    pages = checked_add(pages, (positions + page_size - 1) / page_size, "paged_pool_pages");
  }
  return pages;
}

BatchGeneration generate_batch(PagedKvDecoder& decoder, std::span<const std::vector<int32_t>> prompts,
                               int64_t max_new_tokens, const SamplingOptions& options,
                               const std::function<void(int64_t, int32_t, std::span<const float>)>& on_token) {
  using clock = std::chrono::steady_clock;
  const int64_t B = decoder.batch(), vocab = decoder.config().vocab;
  const auto context = static_cast<size_t>(decoder.config().context);
  FLASHLM_CHECK_ARG(int64_t(prompts.size()) == B, "generate: {} prompts for a decoder of batch {}", prompts.size(), B);
  FLASHLM_CHECK_ARG(max_new_tokens >= 0, "generate: max_new_tokens = {}, expected >= 0", max_new_tokens);
  for (size_t b = 0; b < prompts.size(); ++b) {
    FLASHLM_CHECK_ARG(!prompts[b].empty(), "generate: prompt {} is empty: give at least one token", b);
  }
  BatchGeneration out;
  out.tokens.resize(static_cast<size_t>(B));
  // Per sequence: the tokens its next logits are conditioned on (generate_tokens' window), those logits, and
  // its sampling options (seed + b).
  std::vector<std::vector<int32_t>> windows(static_cast<size_t>(B));
  std::vector<std::vector<float>> logits(static_cast<size_t>(B));
  std::vector<SamplingOptions> sampling(static_cast<size_t>(B), options);
  const auto t0 = clock::now();
  for (int64_t b = 0; b < B; ++b) {
    const auto& prompt = prompts[size_t(b)];
    windows[size_t(b)].assign(prompt.size() > context ? prompt.end() - std::ptrdiff_t(context) : prompt.begin(),
                              prompt.end());
    sampling[size_t(b)].seed = options.seed + uint64_t(b);
    decoder.reset(b);
  }
  for (int64_t b = 0; b < B; ++b) {
    const auto l = decoder.prefill(b, windows[size_t(b)]);
    logits[size_t(b)].assign(l.begin(), l.end());
    out.prompt_tokens += int64_t(windows[size_t(b)].size());
  }
  const auto t1 = clock::now();
  std::vector<int64_t> stepping;
  std::vector<int32_t> fed;
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    stepping.clear();
    fed.clear();
    for (int64_t b = 0; b < B; ++b) {
      const int32_t next = sample_token(logits[size_t(b)], sampling[size_t(b)], static_cast<uint64_t>(i));
      if (on_token) on_token(b, next, logits[size_t(b)]);
      out.tokens[size_t(b)].push_back(next);
      if (i + 1 == max_new_tokens) continue;  // the last token needs no logits after it
      std::vector<int32_t>& window = windows[size_t(b)];
      if (window.size() < context) {
        window.push_back(next);
        stepping.push_back(b);
        fed.push_back(next);
        continue;
      }
      // A full context slides by one (generate_tokens' rule): this sequence's window is encoded again from
      // position 0 on its own; its old pages go back to the pool first.
      window.erase(window.begin());
      window.push_back(next);
      decoder.reset(b);
      const auto l = decoder.prefill(b, window);
      logits[size_t(b)].assign(l.begin(), l.end());
    }
    if (stepping.empty()) continue;
    const auto l = decoder.step(stepping, fed);
    for (size_t j = 0; j < stepping.size(); ++j) {
      logits[size_t(stepping[j])].assign(l.begin() + std::ptrdiff_t(j * size_t(vocab)),
                                         l.begin() + std::ptrdiff_t((j + 1) * size_t(vocab)));
    }
  }
  const auto t2 = clock::now();
  out.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  out.decode_seconds = std::chrono::duration<double>(t2 - t1).count();
  return out;
}

}  // namespace flashlm
