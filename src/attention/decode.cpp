// flash_attention_with_kvcache: validate once (validate.cpp), the CUDA-only checks of the views and index
// arrays, then the backend of the device.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "attention/backends.h"
#include "attention/decode_split.h"
#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/attention.h"
#include "flashlm/device.h"

namespace flashlm {

namespace {

constexpr std::string_view kFn = "flash_attention_with_kvcache";

using NamedView = std::pair<const char*, const TensorView*>;

// What the CUDA kernels need beyond the common checks: fp16/bf16 at a compiled head dim, memory of the current
// device (the index arrays too), and 16-byte rows so that every row moves in 16-byte vectors.
void check_cuda_kvcache(const KvCacheProblem& kp, const KvCacheIndex& index, std::initializer_list<NamedView> views,
                        const TensorView& lse, const AttentionOptions& options) {
  const AttentionProblem& p = kp.attn;
  FLASHLM_CHECK(cuda_built(), "{}: q: tensors on cuda but flashlm was built without CUDA", kFn);
  FLASHLM_CHECK(p.dtype == DType::bf16 || p.dtype == DType::f16,
                "{}: q: dtype {} is not supported on cuda (fp16 or bf16; fp32 and fp64 run on the cpu)", kFn,
                dtype_name(p.dtype));
  FLASHLM_CHECK(p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256,
                "{}: q: head_dim {} has no cuda kernel (64, 128 or 256)", kFn, p.head_dim);
  FLASHLM_CHECK(options.impl == AttentionImpl::flash,
                "{}: impl: the cuda KV-cache attention has one implementation, flash (got {})", kFn,
                attention_impl_name(options.impl));
  FLASHLM_CHECK(p.batch <= 65535, "{}: q: batch {} exceeds the cuda grid's 65535", kFn, p.batch);
  const int device = cuda_current_device();
  for (const auto& [name, t] : views) {
    if (t->ndim == 0 || t->numel() == 0) continue;
    const int64_t elem = static_cast<int64_t>(dtype_size(t->dtype));
    FLASHLM_CHECK(cuda_pointer_device(t->data) == device,
                  "{}: {}: data is not device memory of the current device cuda:{}", kFn, name, device);
    FLASHLM_CHECK(reinterpret_cast<uintptr_t>(t->data) % 16 == 0,
                  "{}: {}: data pointer must be 16-byte aligned for the cuda kernels", kFn, name);
    for (int d = 0; d < 3; ++d) {
      FLASHLM_CHECK(t->stride(d) * elem % 16 == 0 || t->size(d) == 1,
                    "{}: {}: stride {} of dimension {} is not a multiple of 16 bytes ({} elements of {})", kFn, name,
                    t->stride(d), d, 16 / elem, dtype_name(t->dtype));
    }
  }
  if (kp.has_lse && lse.numel() > 0) {
    FLASHLM_CHECK(lse.dtype == DType::f32, "{}: lse: expected fp32 on cuda", kFn);
    FLASHLM_CHECK(cuda_pointer_device(lse.data) == device,
                  "{}: lse: data is not device memory of the current device cuda:{}", kFn, device);
  }
  if (p.batch > 0) {
    FLASHLM_CHECK(cuda_pointer_device(index.cache_seqlens) == device,
                  "{}: cache_seqlens: expected device memory of the current device cuda:{} (the index arrays live "
                  "on q's device)",
                  kFn, device);
    FLASHLM_CHECK(!kp.paged || cuda_pointer_device(index.block_table) == device,
                  "{}: block_table: expected device memory of the current device cuda:{} (the index arrays live on "
                  "q's device)",
                  kFn, device);
  }
}

}  // namespace

// The smallest split count whose grid keeps at least 95% of the best share of the block slots busy, for
// sequences of the full capacity: a split is a run of whole tiles (decode_split_range), so s splits give
// ceil(tiles / per) busy blocks of per = ceil(tiles / s) tiles per (sequence, head, row chunk), in
// ceil(blocks / slots) waves. Fewer splits at the same share: fewer partials to write and combine.
int64_t kvcache_num_splits(int64_t capacity, int64_t other_blocks, int resident_blocks) {
  if (other_blocks <= 0 || capacity <= 0) return 1;
  const double slots = std::max(resident_blocks, 1);
  const int64_t tiles = (capacity + kDecodeTileKeys - 1) / kDecodeTileKeys;
  const int64_t most = std::clamp<int64_t>(capacity / kDecodeMinKeysPerSplit, 1, kDecodeMaxSplits);
  const auto busy_share = [&](int64_t s) {
    const int64_t per = (tiles + s - 1) / s, used = (tiles + per - 1) / per;
    const double blocks = static_cast<double>(other_blocks) * static_cast<double>(used);
    const double waves = std::ceil(blocks / slots);
    return static_cast<double>(other_blocks) * static_cast<double>(tiles) / (waves * slots * static_cast<double>(per));
  };
  double best = 0;
  for (int64_t s = 1; s <= most; ++s) best = std::max(best, busy_share(s));
  for (int64_t s = 1; s <= most; ++s) {
    if (busy_share(s) >= 0.95 * best) return s;
  }
  return 1;
}

void flash_attention_with_kvcache(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                  const KvCacheIndex& index, const TensorView& k_new, const TensorView& v_new,
                                  const TensorView& o, const TensorView& lse, const AttentionOptions& options) {
  const KvCacheProblem kp = validate_attention_with_kvcache(q, k_cache, v_cache, index, k_new, v_new, o, lse, options);
  if (kp.attn.device == Device::cpu) {
    kvcache_attention_cpu(kp, q, k_cache, v_cache, index.block_table, k_new, v_new, o, lse);
    return;
  }
  check_cuda_kvcache(kp, index,
                     {{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"k_new", &k_new}, {"v_new", &v_new},
                      {"o", &o}},
                     lse, options);
#ifdef FLASHLM_WITH_CUDA
  kvcache_attention_cuda(kp, q, k_cache, v_cache, index, k_new, v_new, o, lse, options.stream);
#endif
}

}  // namespace flashlm
