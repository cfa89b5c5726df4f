// The fused LM head + cross-entropy on CUDA (model/lm_head.h): host code queuing, per chunk of tokens, the
// head's GEMM (model/cuda/gemm.h) and the cross-entropy kernel (model/cuda/cross_entropy.cu) — the forward
// kernel for the loss alone, else the backward kernel, which writes the loss and the logits' gradient in one
// pass — then the two gradient GEMMs.
#include <algorithm>

#include "core/check.h"
#include "flashlm/dtype.h"
#include "model/cuda/gemm.h"
#include "model/lm_head.h"
#include "model/cuda/ops.h"

namespace flashlm::gpu {

template <class T>
void lm_head_loss_forward_backward(const T* h, const T* w, const int32_t* targets, int64_t n, int64_t d,
                                   int64_t vocab, int64_t chunk, float grad_scale, float* row_loss, T* dh, float* dw,
                                   T* workspace, void* stream) {
  const char* fn = "gpu::lm_head_loss_forward_backward";
  FLASHLM_CHECK(row_loss || dh, "{}: row_loss is null and no gradient is asked for: nothing to compute", fn);
  check_lm_head_arguments(fn, h, w, targets, n, d, vocab, chunk, dh, dw, workspace);
  const DType dt = dtype_of<T>();
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t rows = std::min(chunk, n - r0);
    float* loss = row_loss ? row_loss + r0 : nullptr;
    linear_forward_cuda(h + r0 * d, w, workspace, rows, d, vocab, dt, stream);
    if (!dh) {
      cross_entropy_forward<T>(workspace, targets + r0, loss, rows, vocab, stream);
      continue;
    }
    cross_entropy_backward<T>(workspace, targets + r0, rows, vocab, grad_scale, stream, loss);
    linear_backward_cuda(workspace, h + r0 * d, w, dh + r0 * d, dw, rows, d, vocab, dt, /*accumulate_dx=*/false,
                         stream);
  }
}

#define FLASHLM_LM_HEAD_INSTANTIATE(T)                                                                         \
  template void lm_head_loss_forward_backward<T>(const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, \
                                                 int64_t, float, float*, T*, float*, T*, void*);

FLASHLM_LM_HEAD_INSTANTIATE(float)
FLASHLM_LM_HEAD_INSTANTIATE(bf16_t)
FLASHLM_LM_HEAD_INSTANTIATE(fp16_t)

#undef FLASHLM_LM_HEAD_INSTANTIATE

}  // namespace flashlm::gpu
