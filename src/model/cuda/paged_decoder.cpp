// PagedKvDecoder on the GPU: the weights cast once to bf16, then each forward (a batch of sequences of one
// new token each, or one sequence's prefill chunk) through the CUDA layer functions (cuda/ops.h) in bf16,
// cuBLASLt's bf16 GEMMs (q|k|v as one product, the residual added in the epilogue of the output and down
// projections, w1 and w3 as one batched product) and flash_attention_with_kvcache over the pool's pages (the
// new keys and values appended in place). The index arrays of a call (tokens, cache_seqlens, block-table rows
// and the RoPE rows of each row's position) go up in one asynchronous copy from a pinned staging array; the
// logits come back the same way, and the host waits for the stream only then.
//
// Everything runs on the decoder's own stream, because a step (one new token per sequence) is replayed as a
// CUDA graph (PagedDecoderOptions::cuda_graph): a few hundred launches per token (about a dozen per layer)
// cost more host time than the GPU spends on a small batch, and stream capture cannot record the legacy
// default stream. The stream is non-blocking: after the constructor (whose uploads on the legacy stream end
// in a synchronisation) nothing of the decoder runs on the legacy stream, and so other legacy-stream work
// in the process neither serialises with the decoder nor invalidates a capture.
//
// What a replay cannot change is every host-side argument of the captured launches, so each must be the same
// at every step a graph serves:
//  - the shapes: B rows of one token (the GEMMs' sizes and plans, the row kernels' grids, the attention's
//    batch) and the index arrays' layout: hence one graph per B, the number of sequences stepped (B varies
//    when generate_batch re-prefills a sliding sequence while the others step);
//  - every pointer: the weights, the pages, the work rows and the index arrays are allocated once, and the
//    per-step data (tokens, lengths, block-table rows, RoPE rows) is copied into the same device_index
//    before each launch; cuBLASLt's workspace is the one its registry keeps for this stream (gemm.h);
//  - the pool's sizes (num_pages, page_size, max_pages), fixed for the decoder's life;
//  - flash_attention_with_kvcache's split-KV grid, which it chooses from the cache's capacity (max_pages ·
//    page_size), never from the lengths, which its kernels read from device memory (a short sequence's
//    trailing splits are empty blocks). The eager step launches that same grid, so a graph captured at any
//    length serves every length the pool allows: nothing is bucketed and nothing is re-captured as
//    sequences grow or cross pages. (A grid sized by the longest sequence would launch fewer blocks early
//    on, but it would be a host scalar that changes per step: buckets and re-captures, for a change the
//    eager path would then have to share to stay bit-identical.)
// The split partials' scratch is stream-ordered (cudaMallocAsync), which a capture records as the graph's
// own allocation. Each B's first step runs eagerly (it builds the GEMM plans and the workspace, and sets
// the attention kernel's attributes: allocations and queries that may not happen inside a capture), its
// second is captured and launched, the later ones replayed.
#include <cuda_runtime.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include "core/array_ops.h"
#include "core/check.h"
#include "core/cuda_check.h"
#include "core/cuda_runtime.h"
#include "flashlm/attention.h"
#include "flashlm/generate.h"
#include "flashlm/profile.h"
#include "flashlm/tensor.h"
#include "model/cuda/gemm.h"
#include "model/cuda/ops.h"
#include "model/cuda/step_graph.h"
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

// The decoder's stream and what its copies and graphs need (the notes at the top of this file).
struct PagedKvDecoder::Impl::CudaStep {
  PinnedArray<uint32_t> host_index;  // the index words of a call, staged for the copy up
  PinnedArray<float> host_logits;    // [rows, vocab_pad], brought back
  cudaStream_t stream = nullptr;
  cudaEvent_t index_sent = nullptr;  // recorded after each copy up: host_index may be rewritten once it is done
  bool graphs_on = true;
  // Per number of sequences stepped: its graph, or null between its eager warm-up and its capture.
  std::map<int64_t, cudaGraphExec_t> graphs;
  std::string failure;  // why a capture failed: every later step is eager
  std::string status;   // PagedKvDecoder::cuda_graph_status

  CudaStep(size_t index_words, size_t logit_floats, bool graphs)
      : host_index(index_words), host_logits(logit_floats), graphs_on(graphs) {
    FLASHLM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                       "cudaStreamCreateWithFlags (paged decoder)");
    const cudaError_t e = cudaEventCreateWithFlags(&index_sent, cudaEventDisableTiming);
    if (e != cudaSuccess) cudaStreamDestroy(stream);
    FLASHLM_CUDA_CHECK(e, "cudaEventCreateWithFlags (paged decoder)");
  }
  ~CudaStep() {
    // Before the stream goes: a stream created later at its address inherits its cuBLASLt workspace (gemm.h).
    cudaStreamSynchronize(stream);
    for (const auto& [rows, exec] : graphs) {
      if (exec) cudaGraphExecDestroy(exec);
    }
    cudaEventDestroy(index_sent);
    cudaStreamDestroy(stream);
  }
  CudaStep(const CudaStep&) = delete;
  CudaStep& operator=(const CudaStep&) = delete;
};

void PagedKvDecoder::Impl::CudaStepDeleter::operator()(CudaStep* s) const { delete s; }

std::string PagedKvDecoder::cuda_graph_status() const { return impl_->cuda ? impl_->cuda->status : ""; }

void PagedKvDecoder::upload_cuda(std::span<const float> params, bool cuda_graph) {
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
  m.cuda.reset(new Impl::CudaStep(size_t(il.words), size_t(m.max_rows * m.vocab_pad), cuda_graph));
}

namespace {

// The kernels of one forward on `stream`, reading the index arrays already in m.device_index (laid out as
// `il` for B sequences of nq rows each): what a step graph captures. Every argument of every launch follows
// from (B, nq, want_logits) and the decoder's fixed buffers and sizes. n_params: parameter_layout's length.
void queue_forward(const PagedKvDecoder::Impl& m, const ModelConfig& c, size_t n_params, const KvPagePool& pool,
                   const IndexLayout& il, int64_t B, int64_t nq, bool want_logits, cudaStream_t stream) {
  const int64_t R = B * nq, d = c.d_model, f = c.d_ff, H = c.heads, hd = c.head_dim(), P = pool.num_pages(),
                ps = pool.page_size(), Vp = m.vocab_pad;
  const auto eps = static_cast<float>(c.norm_eps);
  const auto* w16 = static_cast<const bf16_t*>(m.params.data());
  const auto* w32 = static_cast<const float*>(m.params_f32.data());
  const auto wt = [&](size_t i) { return w16 + m.w16_offset[i]; };
  const auto gain = [&](size_t i) { return w32 + m.f32_offset[i]; };
  const auto li = [](int64_t l, size_t i) { return 1 + size_t(l) * 9 + i; };  // parameter_layout's order
  const size_t lm_head = n_params - 1, ln_final = lm_head - 1;

  const auto* di = static_cast<const uint32_t*>(m.device_index.data());
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
  index.max_pages = pool.max_pages();
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
}

// `queue` captured on the decoder's stream and instantiated; null when that fails, the reason in cs.failure
// and the stream eager again.
cudaGraphExec_t capture_step(PagedKvDecoder::Impl::CudaStep& cs, const std::function<void()>& queue) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  try {
    FLASHLM_CUDA_CHECK(cudaStreamBeginCapture(cs.stream, cudaStreamCaptureModeThreadLocal),
                       "cudaStreamBeginCapture (paged decoder step)");
    queue();
    FLASHLM_CUDA_CHECK(cudaStreamEndCapture(cs.stream, &graph), "cudaStreamEndCapture (paged decoder step)");
    FLASHLM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate (paged decoder step)");
  } catch (const std::exception& e) {
    abandon_capture(cs.stream, graph);
    cs.failure = fmt::format("off: the step could not be captured ({})", e.what());
    return nullptr;
  }
  cudaGraphDestroy(graph);
  return exec;
}

// One step of B sequences (one row each): the graph of B replayed where there is one, else `queue` eagerly
// (the notes at the top of this file say when).
void run_step(PagedKvDecoder::Impl::CudaStep& cs, int64_t B, const std::function<void()>& queue) {
  const char* why = nullptr;
  if (!cs.graphs_on) {
    why = "off: --cuda-graph off";
  } else if (RangeProfiler::instance().enabled()) {
    why = "off: profiled ranges time each part with events on the host's side";  // as the train step's graph
  } else if (!cs.failure.empty()) {
    why = cs.failure.c_str();
  }
  if (why) {
    cs.status = why;
    queue();
    return;
  }
  const auto [graph, first] = cs.graphs.try_emplace(B, nullptr);
  if (first) {
    queue();
    cs.status = fmt::format("on (this step was the eager warm-up of steps of {} sequences)", B);
    return;
  }
  if (!graph->second) {
    graph->second = capture_step(cs, queue);
    if (!graph->second) {
      cs.status = cs.failure;
      queue();
      return;
    }
  }
  FLASHLM_CUDA_CHECK(cudaGraphLaunch(graph->second, cs.stream), "cudaGraphLaunch (paged decoder step)");
  cs.status = "on";
}

}  // namespace

void PagedKvDecoder::forward_cuda(std::span<const int64_t> seqs, int64_t nq, std::span<const int32_t> tokens,
                                  bool want_logits) {
  Impl& m = *impl_;
  Impl::CudaStep& cs = *m.cuda;
  const ModelConfig& c = config_;
  const int64_t B = int64_t(seqs.size()), half = c.head_dim() / 2, mp = pool_.max_pages(), Vp = m.vocab_pad;

  // The index arrays: staged on the host, one copy up. A prefill chunk returns without waiting for the GPU,
  // so the staging array is rewritten only once the previous call's copy has read it.
  const IndexLayout il = index_layout(B * nq, B, mp, half);
  FLASHLM_CUDA_CHECK(cudaEventSynchronize(cs.index_sent), "cudaEventSynchronize (paged decoder index)");
  uint32_t* hi = cs.host_index.data;
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
  cuda_copy_async(m.device_index.data(), hi, size_t(il.words) * 4, cs.stream);
  FLASHLM_CUDA_CHECK(cudaEventRecord(cs.index_sent, cs.stream), "cudaEventRecord (paged decoder index)");

  const auto queue = [&] { queue_forward(m, c, layout_.size(), pool_, il, B, nq, want_logits, cs.stream); };
  if (nq == 1 && want_logits) {
    run_step(cs, B, queue);
  } else {
    queue();
  }
  if (!want_logits) return;
  const int64_t n_out = nq == 1 ? B : 1;
  const CudaRows r = carve_rows(m.work.data(), c, m.max_rows, Vp);
  cuda_copy_async(cs.host_logits.data, r.logits32, size_t(n_out * Vp) * sizeof(float), cs.stream);
  cuda_stream_synchronize(cs.stream);
  for (int64_t i = 0; i < n_out; ++i) {
    std::copy_n(cs.host_logits.data + i * Vp, c.vocab, logits_.data() + i * c.vocab);
  }
}

}  // namespace flashlm
