// The C ABI (include/flashlm/flashlm.h): converts C tensors to TensorViews, calls the C++ API and turns
// exceptions into status codes plus a thread-local message.
#include "flashlm/flashlm.h"

#include <exception>
#include <string>

#include "core/check.h"
#include "flashlm/attention.h"
#include "flashlm/device.h"

namespace {

thread_local std::string g_last_error;

static_assert(static_cast<int>(flashlm::DType::f64) == FLASHLM_FP64 && static_cast<int>(flashlm::DType::f32) == FLASHLM_FP32 &&
                  static_cast<int>(flashlm::DType::f16) == FLASHLM_FP16 &&
                  static_cast<int>(flashlm::DType::bf16) == FLASHLM_BF16 &&
                  static_cast<int>(flashlm::DType::f8e4m3) == FLASHLM_FP8_E4M3,
              "flashlm_dtype and flashlm::DType must share their numbering");

flashlm::TensorView to_view(const flashlm_tensor* t, const char* name) {
  using namespace flashlm;
  FLASHLM_CHECK(t != nullptr, "{}: null flashlm_tensor pointer", name);
  FLASHLM_CHECK(t->ndim >= 0 && t->ndim <= FLASHLM_MAX_DIMS, "{}: ndim {} outside [0, {}]", name, t->ndim,
                FLASHLM_MAX_DIMS);
  FLASHLM_CHECK(t->dtype >= FLASHLM_FP64 && t->dtype <= FLASHLM_FP8_E4M3, "{}: unknown dtype code {}", name, t->dtype);
  FLASHLM_CHECK(t->device == FLASHLM_CPU || t->device == FLASHLM_CUDA, "{}: unknown device code {}", name, t->device);
  TensorView v;
  v.data = t->data;
  v.ndim = t->ndim;
  v.dtype = static_cast<DType>(t->dtype);  // the enums share their numbering
  v.device = t->device == FLASHLM_CPU ? Device::cpu : Device::cuda;
  for (int d = 0; d < t->ndim; ++d) {
    v.sizes[static_cast<size_t>(d)] = t->sizes[d];
    v.strides[static_cast<size_t>(d)] = t->strides[d];
  }
  return v;
}

flashlm::AttentionOptions to_options(const flashlm_attention_options* o) {
  using namespace flashlm;
  const flashlm_attention_options c = o ? *o : flashlm_attention_options_default();
  FLASHLM_CHECK(c.impl == FLASHLM_FLASH || c.impl == FLASHLM_NAIVE, "options: unknown impl code {}", c.impl);
  FLASHLM_CHECK(c.causal_align == FLASHLM_TOP_LEFT || c.causal_align == FLASHLM_BOTTOM_RIGHT,
                "options: unknown causal_align code {}", c.causal_align);
  AttentionOptions opt;
  opt.impl = c.impl == FLASHLM_NAIVE ? AttentionImpl::naive : AttentionImpl::flash;
  opt.causal = c.causal != 0;
  opt.align = c.causal_align == FLASHLM_BOTTOM_RIGHT ? CausalAlign::bottom_right : CausalAlign::top_left;
  opt.deterministic = c.deterministic != 0;
  if (c.has_scale) opt.scale = c.scale;
  opt.q_descale = c.q_descale;
  opt.k_descale = c.k_descale;
  opt.v_descale = c.v_descale;
  opt.stream = c.stream;
  opt.window_size_left = c.window_size_left;
  opt.window_size_right = c.window_size_right;
  opt.softcap = c.softcap;
  if (c.alibi_slopes) opt.alibi_slopes = to_view(c.alibi_slopes, "alibi_slopes");
  if (c.learnable_sink) opt.learnable_sink = to_view(c.learnable_sink, "learnable_sink");
  if (c.dlearnable_sink) opt.dlearnable_sink = to_view(c.dlearnable_sink, "dlearnable_sink");
  if (c.q_descale_heads) opt.q_descale_heads = to_view(c.q_descale_heads, "q_descale_heads");
  if (c.k_descale_heads) opt.k_descale_heads = to_view(c.k_descale_heads, "k_descale_heads");
  if (c.v_descale_heads) opt.v_descale_heads = to_view(c.v_descale_heads, "v_descale_heads");
  return opt;
}

flashlm::VarlenSequences to_varlen(const flashlm_varlen* s) {
  using namespace flashlm;
  FLASHLM_CHECK(s != nullptr, "seqs: null flashlm_varlen pointer");
  FLASHLM_CHECK(s->device == FLASHLM_CPU || s->device == FLASHLM_CUDA, "seqs: unknown device code {}", s->device);
  VarlenSequences out;
  out.cu_seqlens_q = s->cu_seqlens_q;
  out.cu_seqlens_k = s->cu_seqlens_k;
  out.batch = s->batch;
  out.device = s->device == FLASHLM_CPU ? Device::cpu : Device::cuda;
  out.max_seqlen_q = s->max_seqlen_q;
  out.max_seqlen_k = s->max_seqlen_k;
  return out;
}

// Runs fn, mapping each exception type to its status.
template <class Fn>
flashlm_status guarded(Fn&& fn) {
  try {
    fn();
    return FLASHLM_OK;
  } catch (const flashlm::OutOfMemory& e) {
    g_last_error = e.what();
    return FLASHLM_OUT_OF_MEMORY;
  } catch (const flashlm::CudaError& e) {
    g_last_error = e.what();
    return FLASHLM_RUNTIME_ERROR;
  } catch (const flashlm::Error& e) {
    g_last_error = e.what();
    return FLASHLM_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    g_last_error = "out of host memory";
    return FLASHLM_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return FLASHLM_RUNTIME_ERROR;
  }
}

}  // namespace

extern "C" {

flashlm_attention_options flashlm_attention_options_default(void) {
  return flashlm_attention_options{FLASHLM_FLASH, 0, FLASHLM_TOP_LEFT, 0, 0, 0.0, 1.0f, 1.0f, 1.0f, nullptr, -1, -1, 0.0,
                                   nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
}

flashlm_status flashlm_attention_forward(const flashlm_tensor* q, const flashlm_tensor* k, const flashlm_tensor* v,
                                         const flashlm_tensor* o, const flashlm_tensor* lse,
                                         const flashlm_attention_options* options) {
  return guarded([&] {
    flashlm::attention_forward(to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), to_view(o, "o"),
                               to_view(lse, "lse"), to_options(options));
  });
}

flashlm_status flashlm_attention_backward(const flashlm_tensor* q, const flashlm_tensor* k, const flashlm_tensor* v,
                                          const flashlm_tensor* o, const flashlm_tensor* lse,
                                          const flashlm_tensor* dout, const flashlm_tensor* dq,
                                          const flashlm_tensor* dk, const flashlm_tensor* dv,
                                          const flashlm_attention_options* options) {
  return guarded([&] {
    flashlm::attention_backward(to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), to_view(o, "o"),
                                to_view(lse, "lse"), to_view(dout, "dout"), to_view(dq, "dq"), to_view(dk, "dk"),
                                to_view(dv, "dv"), to_options(options));
  });
}

flashlm_status flashlm_attention_varlen_forward(const flashlm_tensor* q, const flashlm_tensor* k,
                                                const flashlm_tensor* v, const flashlm_tensor* o,
                                                const flashlm_tensor* lse, const flashlm_varlen* seqs,
                                                const flashlm_attention_options* options) {
  return guarded([&] {
    flashlm::attention_varlen_forward(to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), to_view(o, "o"),
                                      to_view(lse, "lse"), to_varlen(seqs), to_options(options));
  });
}

flashlm_status flashlm_attention_varlen_backward(const flashlm_tensor* q, const flashlm_tensor* k,
                                                 const flashlm_tensor* v, const flashlm_tensor* o,
                                                 const flashlm_tensor* lse, const flashlm_tensor* dout,
                                                 const flashlm_tensor* dq, const flashlm_tensor* dk,
                                                 const flashlm_tensor* dv, const flashlm_varlen* seqs,
                                                 const flashlm_attention_options* options) {
  return guarded([&] {
    flashlm::attention_varlen_backward(to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), to_view(o, "o"),
                                       to_view(lse, "lse"), to_view(dout, "dout"), to_view(dq, "dq"),
                                       to_view(dk, "dk"), to_view(dv, "dv"), to_varlen(seqs), to_options(options));
  });
}

flashlm_status flashlm_attention_with_kvcache(const flashlm_tensor* q, const flashlm_tensor* k_cache,
                                              const flashlm_tensor* v_cache, const flashlm_kvcache_index* index,
                                              const flashlm_tensor* k_new, const flashlm_tensor* v_new,
                                              const flashlm_tensor* o, const flashlm_tensor* lse,
                                              const flashlm_attention_options* options) {
  return guarded([&] {
    FLASHLM_CHECK(index != nullptr, "index: null flashlm_kvcache_index pointer");
    flashlm::KvCacheIndex ix;
    ix.cache_seqlens = index->cache_seqlens;
    ix.block_table = index->block_table;
    ix.max_pages = index->max_pages;
    ix.block_table_stride = index->block_table_stride;
    // NULL stands for an absent tensor (k_new and v_new together, lse).
    const auto optional_view = [](const flashlm_tensor* t, const char* name) {
      return t == nullptr ? flashlm::TensorView{} : to_view(t, name);
    };
    flashlm::flash_attention_with_kvcache(to_view(q, "q"), to_view(k_cache, "k_cache"), to_view(v_cache, "v_cache"),
                                          ix, optional_view(k_new, "k_new"), optional_view(v_new, "v_new"),
                                          to_view(o, "o"), optional_view(lse, "lse"), to_options(options));
  });
}

const char* flashlm_last_error(void) { return g_last_error.c_str(); }

const char* flashlm_version(void) { return FLASHLM_VERSION; }

int32_t flashlm_abi_version(void) { return FLASHLM_ABI_VERSION; }

int32_t flashlm_cuda_built(void) { return flashlm::cuda_built() ? 1 : 0; }

int32_t flashlm_cuda_device_count(void) { return flashlm::cuda_device_count(); }

}  // extern "C"
