// PagedKvDecoder on the GPU: the weights cast once to bf16, then each forward (a batch of sequences of one
// new token each, or one sequence's prefill chunk) through the CUDA layer functions (cuda/ops.h) in bf16,
// cuBLASLt's bf16 GEMMs (q|k|v as one product, the residual added in the epilogue of the output and down
// projections, w1 and w3 as one batched product) and flash_attention_with_kvcache over the pool's pages (the
// new keys and values appended in place). The index arrays of a call (tokens, cache_seqlens, block-table rows
// and the RoPE rows of each row's position) go up in one copy; everything runs on the legacy default stream,
// which orders it with the synchronous copies in and the logits out.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "core/array_ops.h"
#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/attention.h"
#include "flashlm/generate.h"
#include "flashlm/tensor.h"
#include "model/cuda/gemm.h"
#include "model/cuda/ops.h"
#include "model/paged_decoder_impl.h"

namespace flashlm {

namespace {

constexpr int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Cuts one allocation into arrays whose starts are 256-byte aligned.
struct Carver {
  uintptr_t base;  // 0 when only the size is wanted
  size_t at = 0;
  template <class T>
  T* take(int64_t n) {
    T* p = base == 0 ? nullptr : reinterpret_cast<T*>(base + at);
    at += size_t(round_up(n * int64_t(sizeof(T)), 256));
    return p;
  }
};

// The work rows of one forward of up to `rows` rows, in the order Carver hands them out.
struct CudaRows {
  bf16_t *x0, *x1, *h, *qkv, *o, *u, *g, *s, *logits16;
  float *rstd, *logits32;
};

CudaRows carve_rows(void* base, const ModelConfig& c, int64_t rows, int64_t vocab_pad, size_t* bytes = nullptr) {
  Carver cv{reinterpret_cast<uintptr_t>(base)};
  CudaRows r{};
  const int64_t d = c.d_model, f = c.d_ff;
  r.x0 = cv.take<bf16_t>(rows * d);
  r.x1 = cv.take<bf16_t>(rows * d);
  r.h = cv.take<bf16_t>(rows * d);
  r.qkv = cv.take<bf16_t>(rows * 3 * d);
  r.o = cv.take<bf16_t>(rows * d);
  r.u = cv.take<bf16_t>(rows * f);
  r.g = cv.take<bf16_t>(rows * f);
  r.s = cv.take<bf16_t>(rows * f);
  r.logits16 = cv.take<bf16_t>(rows * vocab_pad);
  r.rstd = cv.take<float>(rows);
  r.logits32 = cv.take<float>(rows * vocab_pad);
  if (bytes) *bytes = cv.at;
  return r;
}

// The index words of one call: tokens [rows], cache_seqlens [batch], block table [batch, max_pages] (int32),
// then the RoPE cos and sin rows [rows, half] (fp32), each section 64-byte aligned.
struct IndexLayout {
  int64_t tokens, lens, table, cos, sin, words;
};

IndexLayout index_layout(int64_t rows, int64_t batch, int64_t max_pages, int64_t half) {
  IndexLayout l{};
  int64_t at = 0;
  const auto take = [&](int64_t n) { return std::exchange(at, at + round_up(n, 16)); };
  l.tokens = take(rows);
  l.lens = take(batch);
  l.table = take(batch * max_pages);
  l.cos = take(rows * half);
  l.sin = take(rows * half);
  l.words = at;
  return l;
}

}  // namespace

void PagedKvDecoder::upload_cuda(std::span<const float> params) {
  Impl& m = *impl_;
  const ModelConfig& c = config_;
  const size_t lm_head = layout_.size() - 1;
  m.vocab_pad = round_up(c.vocab, 8);  // the bf16 GEMM's output rows: zero rows past the vocabulary
  m.w16_offset.assign(layout_.size(), -1);
  m.f32_offset.assign(layout_.size(), -1);
  int64_t n16 = 0, n32 = 0, largest = 1;
  for (size_t i = 0; i < layout_.size(); ++i) {
    const ParameterInfo& info = layout_[i];
    if (info.shape.size() == 2 && i != 0) {  // a linear layer's weight [out, in]
      m.w16_offset[i] = n16;
      const int64_t out_rows = i == lm_head ? m.vocab_pad : info.shape[0];
      n16 = checked_add(n16, round_up(out_rows * info.shape[1], 8), "PagedKvDecoder: bf16 weights");
      largest = std::max(largest, info.numel());
    } else {  // the embedding table and the RMSNorm gains, which the layer functions take in fp32
      m.f32_offset[i] = n32;
      n32 = checked_add(n32, round_up(info.numel(), 4), "PagedKvDecoder: fp32 parameters");
    }
  }
  // q, k and v as one [3 d_model, d_model] weight: adjacent in every layer (d_model² is a multiple of 8).
  for (int64_t l = 0; l < c.layers; ++l) {
    const size_t q = 2 + size_t(l) * 9;
    FLASHLM_CHECK(m.w16_offset[q + 1] == m.w16_offset[q] + c.d_model * c.d_model &&
                      m.w16_offset[q + 2] == m.w16_offset[q + 1] + c.d_model * c.d_model,
                  "PagedKvDecoder: layer {}'s q, k and v weights are not adjacent", l);
  }
  m.params = Buffer::allocate(size_t(n16) * sizeof(bf16_t), Device::cuda, "paged decoder bf16 weights");
  m.params_f32 = Buffer::allocate(size_t(n32) * sizeof(float), Device::cuda, "paged decoder fp32 parameters");
  gpu::memset_async(m.params.data(), 0, m.params.bytes(), nullptr);  // the LM head's padding rows
  {
    Buffer staging = Buffer::allocate(size_t(largest) * sizeof(float), Device::cuda, "paged decoder weight staging");
    auto* w16 = static_cast<bf16_t*>(m.params.data());
    auto* w32 = static_cast<float*>(m.params_f32.data());
    for (size_t i = 0; i < layout_.size(); ++i) {
      const ParameterInfo& info = layout_[i];
      const float* src = params.data() + info.offset;
      const size_t bytes = size_t(info.numel()) * sizeof(float);
      if (m.w16_offset[i] >= 0) {
        // Into the staging buffer (the legacy stream orders this copy after the previous cast), then rounded.
        cuda_copy(staging.data(), src, bytes);
        gpu::cast_from_f32<bf16_t>(static_cast<const float*>(staging.data()), w16 + m.w16_offset[i], info.numel(),
                                   nullptr);
      } else {
        cuda_copy(w32 + m.f32_offset[i], src, bytes);
      }
    }
    gpu::stream_synchronize(nullptr);  // before the staging buffer goes
  }
  const int64_t d = c.d_model;
  const size_t page_bytes =
      size_t(checked_product({c.layers, pool_.num_pages(), pool_.page_size(), d, int64_t{sizeof(bf16_t)}},
                             "PagedKvDecoder: pages bytes"));
  m.k_pages = Buffer::allocate(page_bytes, Device::cuda, "paged KV cache keys");
  m.v_pages = Buffer::allocate(page_bytes, Device::cuda, "paged KV cache values");
  size_t work_bytes = 0;
  carve_rows(nullptr, c, m.max_rows, m.vocab_pad, &work_bytes);
  m.work = Buffer::allocate(work_bytes, Device::cuda, "paged decoder rows");
  const IndexLayout il = index_layout(m.max_rows, pool_.sequences(), pool_.max_pages(), c.head_dim() / 2);
  m.device_index = Buffer::allocate(size_t(il.words) * 4, Device::cuda, "paged decoder index");
  m.host_index.assign(size_t(il.words), 0);
  m.host_logits.resize(size_t(m.max_rows * m.vocab_pad));
}

void PagedKvDecoder::forward_cuda(std::span<const int64_t> seqs, int64_t nq, std::span<const int32_t> tokens,
                                  bool want_logits) {
  Impl& m = *impl_;
  const ModelConfig& c = config_;
  void* const stream = nullptr;
  const int64_t B = int64_t(seqs.size()), R = B * nq, d = c.d_model, f = c.d_ff, H = c.heads, hd = c.head_dim(),
                half = hd / 2, P = pool_.num_pages(), ps = pool_.page_size(), mp = pool_.max_pages(), Vp = m.vocab_pad;
  const auto eps = static_cast<float>(c.norm_eps);
  const auto* w16 = static_cast<const bf16_t*>(m.params.data());
  const auto* w32 = static_cast<const float*>(m.params_f32.data());
  const auto wt = [&](size_t i) { return w16 + m.w16_offset[i]; };
  const auto gain = [&](size_t i) { return w32 + m.f32_offset[i]; };
  const auto li = [](int64_t l, size_t i) { return 1 + size_t(l) * 9 + i; };  // parameter_layout's order
  const size_t lm_head = layout_.size() - 1, ln_final = lm_head - 1;

  // The index arrays: staged on the host, one copy up.
  const IndexLayout il = index_layout(R, B, mp, half);
  uint32_t* hi = m.host_index.data();
  for (int64_t i = 0; i < B; ++i) {
    const int64_t seq = seqs[size_t(i)], len = pool_.length(seq);
    hi[il.lens + i] = uint32_t(int32_t(len));
    const auto row = pool_.block_table().subspan(size_t(seq * mp), size_t(mp));
    std::memcpy(hi + il.table + i * mp, row.data(), size_t(mp) * sizeof(int32_t));
    for (int64_t t = 0; t < nq; ++t) {
      const int64_t r = i * nq + t;
      hi[il.tokens + r] = uint32_t(tokens[size_t(r)]);
      std::memcpy(hi + il.cos + r * half, rope_cos_.data() + (len + t) * half, size_t(half) * sizeof(float));
      std::memcpy(hi + il.sin + r * half, rope_sin_.data() + (len + t) * half, size_t(half) * sizeof(float));
    }
  }
  cuda_copy(m.device_index.data(), hi, size_t(il.words) * 4);
  auto* di = static_cast<uint32_t*>(m.device_index.data());
  const auto* tok = reinterpret_cast<const int32_t*>(di + il.tokens);
  const auto* cos = reinterpret_cast<const float*>(di + il.cos);
  const auto* sin = reinterpret_cast<const float*>(di + il.sin);

  CudaRows r = carve_rows(m.work.data(), c, m.max_rows, Vp);
  bf16_t *x = r.x0, *x_next = r.x1;
  AttentionOptions attn;
  attn.causal = true;  // bottom-right: row t of a sequence sees its cache and the new rows up to itself
  attn.stream = stream;
  KvCacheIndex index;
  index.cache_seqlens = reinterpret_cast<const int32_t*>(di + il.lens);
  index.block_table = reinterpret_cast<const int32_t*>(di + il.table);
  index.max_pages = mp;
  // q | k | v of each row, as [B, nq, 3 H, hd] cut into its three heads' ranges.
  const TensorView qkv = TensorView::contiguous(r.qkv, DType::bf16, {B, nq, 3 * H, hd}, Device::cuda);
  const TensorView q = qkv.slice(2, 0, H), k_new = qkv.slice(2, H, 2 * H), v_new = qkv.slice(2, 2 * H, 3 * H);
  const TensorView o = TensorView::contiguous(r.o, DType::bf16, {B, nq, H, hd}, Device::cuda);

  gpu::embedding_forward<bf16_t>(w32 + m.f32_offset[0], tok, x, R, d, c.vocab, stream);
  for (int64_t l = 0; l < c.layers; ++l) {
    const int64_t layer_elems = P * ps * d;
    const TensorView k_cache = TensorView::contiguous(static_cast<bf16_t*>(m.k_pages.data()) + l * layer_elems,
                                                      DType::bf16, {P, ps, H, hd}, Device::cuda);
    const TensorView v_cache = TensorView::contiguous(static_cast<bf16_t*>(m.v_pages.data()) + l * layer_elems,
                                                      DType::bf16, {P, ps, H, hd}, Device::cuda);
    gpu::rmsnorm_forward<bf16_t>(x, gain(li(l, 0)), r.h, r.rstd, R, d, eps, stream);
    linear_forward_cuda(r.h, wt(li(l, 1)), r.qkv, R, d, 3 * d, DType::bf16, stream);  // q, k, v adjacent
    // q and k rotated in one call: 2 H heads of each [3 d] row, row r at its own position (the gathered tables).
    gpu::rope_forward<bf16_t>(r.qkv, cos, sin, 1, R, 2 * H, hd, stream, 3 * d);
    flash_attention_with_kvcache(q, k_cache, v_cache, index, k_new, v_new, o, TensorView{}, attn);
    linear_forward_residual_cuda(r.o, wt(li(l, 4)), x, x_next, R, d, d, DType::bf16, stream);
    std::swap(x, x_next);
    gpu::rmsnorm_forward<bf16_t>(x, gain(li(l, 5)), r.h, r.rstd, R, d, eps, stream);
    linear_forward_pair_cuda(r.h, wt(li(l, 6)), wt(li(l, 8)), r.u, r.g, R, d, f, DType::bf16, stream);
    gpu::swiglu_forward<bf16_t>(r.u, r.g, r.s, R * f, stream);
    linear_forward_residual_cuda(r.s, wt(li(l, 7)), x, x_next, R, f, d, DType::bf16, stream);
    std::swap(x, x_next);
  }
  if (!want_logits) return;
  // The last row of each sequence: every row when nq = 1, else (one sequence) row nq - 1.
  const int64_t first = nq == 1 ? 0 : nq - 1, n_out = nq == 1 ? B : 1;
  gpu::rmsnorm_forward<bf16_t>(x + first * d, gain(ln_final), r.h, r.rstd, n_out, d, eps, stream);
  linear_forward_cuda(r.h, wt(lm_head), r.logits16, n_out, d, Vp, DType::bf16, stream);
  gpu::cast_to_f32<bf16_t>(r.logits16, r.logits32, n_out * Vp, stream);
  cuda_copy(m.host_logits.data(), r.logits32, size_t(n_out * Vp) * sizeof(float));
  for (int64_t i = 0; i < n_out; ++i) {
    std::copy_n(m.host_logits.data() + i * Vp, c.vocab, logits_.data() + i * c.vocab);
  }
}

}  // namespace flashlm
