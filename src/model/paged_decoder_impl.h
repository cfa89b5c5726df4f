// PagedKvDecoder's buffers on its device, shared by its host logic and CPU step (model/paged_decoder.cpp) and
// its CUDA step (model/cuda/paged_decoder.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "flashlm/generate.h"
#include "flashlm/memory.h"

namespace flashlm {

struct PagedKvDecoder::Impl {
  int64_t max_rows = 0;  // rows of one forward: max(batch, kPrefillChunk)
  // CPU: the fp32 parameters (parameter_layout's offsets). CUDA: the linear layers' weights in bf16 at
  // offsets w16_offset (16-byte aligned; the LM head padded with zero rows to vocab_pad), and the embedding
  // table and RMSNorm gains in fp32 at offsets f32_offset (-1 where a parameter is not there).
  Buffer params, params_f32;
  std::vector<int64_t> w16_offset, f32_offset;
  int64_t vocab_pad = 0;
  // The pool's storage: [layers, num_pages, page_size, heads, head_dim] for keys and for values (fp32 on the
  // CPU, bf16 on CUDA).
  Buffer k_pages, v_pages;
  // The rows of one forward (CPU: fp32; CUDA: bf16 activations, fp32 statistics and logits).
  Buffer work;
  // CUDA: the per-call index arrays (tokens, cache_seqlens, block table, the gathered RoPE rows) on the
  // device, at one fixed address (the step graphs read them there), staged on the host and copied in one
  // transfer.
  Buffer device_index;
  // CUDA: the decoder's stream, the pinned staging arrays of the copies in and out, and the step graphs
  // (model/cuda/paged_decoder.cpp; this header stays free of CUDA's).
  struct CudaStep;
  struct CudaStepDeleter {
    void operator()(CudaStep* s) const;
  };
  std::unique_ptr<CudaStep, CudaStepDeleter> cuda;
};

}  // namespace flashlm
