// Where a model keeps its activations: one layout for CpuModel and CudaModel, derived from the
// recomputation plan, and the sizes of the other buffers the models allocate. The memory plan
// (plan_model_memory) adds up the same numbers the constructors allocate.
#pragma once
#include <cstdint>
#include <vector>

#include "flashlm/model.h"

namespace flashlm {

// Offsets of one block's activations: values (in the model's activation type) into the value arena, the
// fp32 statistics (RMSNorm 1/rms, attention logsumexp) into the statistics arena. Under recomputation
// several blocks share the offsets of what they recompute (a working slot).
// q, k and v follow one another, each aligned_elements(n · d_model) long: CudaModel holds them as one
// [n, 3 · d_model] array in that span (qkv_view in cuda/model.cpp), the CPU model as three [n, d_model] ones.
struct BlockActivations {
  int64_t x_in, h1, q, k, v, attn, x_mid, h2, u, g, s;  // values
  int64_t rstd1, rstd2, lse;                             // statistics
  // The first block of this block's segment: the backward recomputes blocks [segment, this block] from
  // the kept input of `segment` (blocks:k), or this block from its kept input (selective, segment = itself).
  // -1: nothing is recomputed (none).
  int64_t segment = -1;
};

struct ActivationLayout {
  RecomputePlan recompute;  // resolved
  std::vector<BlockActivations> blocks;
  int64_t x_out = 0, h_f = 0;  // values: the last block's output and the final norm's
  int64_t rstd_f = 0;          // statistics: the final norm's 1/rms
  int64_t values = 0, stats = 0;            // arena sizes (elements)
  int64_t kept_values = 0, kept_stats = 0;  // of which kept from the forward to the backward; the rest is the
                                            // working set the recomputation rewrites
  bool recomputes() const { return recompute.kind != RecomputePlan::Kind::none; }
  // The last block of block l's segment (the one whose backward triggers the segment's recomputation).
  int64_t segment_last(int64_t l) const;
};

// Elements are carved on 64-element boundaries (16-byte aligned rows for tensor cores whatever the type).
constexpr int64_t kActivationAlignment = 64;
inline int64_t aligned_elements(int64_t elements) {
  return (elements + kActivationAlignment - 1) / kActivationAlignment * kActivationAlignment;
}

// plan must be resolved (not automatic). Sizes are checked for overflow.
ActivationLayout layout_activations(const ModelConfig& c, int64_t batch, int64_t seq, const RecomputePlan& plan);

// Backward scratch (elements of the activation type): the residual gradient and five [n, d] arrays, three
// [n, d_ff] ones.
int64_t backward_scratch_elements(const ModelConfig& c, int64_t tokens);

// --precision fp8 on CUDA: the FP8 copies of one linear layer's operands (model/cuda/fp8_linear.h), as byte
// offsets into one buffer: `act` (x in the forward, dy in the backward) and `act_t` (dyᵀ), `act_x_t` (xᵀ),
// each [tokens, widest feature count] bytes; `weight` (w or wᵀ), the largest linear weight; `scales`, the
// device fp32 amax and dequantisation scale of three operands. Each region starts 256-byte aligned.
// A second buffer, the weight cache (Fp8Linear's, cache_bytes): the block weights' FP8 copies, both ways; from
// byte cache_scales two scale slots per weight (cache_slots weights: their own, then their forward inputs'); from
// byte cache_amax the producers' amax outputs (kFp8Produced floats per layer).
// Rowwise (Fp8Recipe::rowwise) adds the scale vectors, each operand's a vector set (Fp8VectorSet): in the
// scratch from byte `vectors` three sets of vector_capacity floats a vector (the act operand's, the weight
// region's, act_x_t's), in the cache from byte cache_vectors one set per weight (cache_slots) of
// cache_vector_capacity floats. Tensorwise has none (the offsets are the buffers' ends).
// keep_inputs (tensorwise, nothing recomputed): from byte cache_inputs the transposed FP8 copies of every block's
// four forward inputs (h1, the attention output, h2, s: [tokens, d] three times and [tokens, d_ff]), written by
// the forward's casts and read by the backward's weight-gradient products instead of a second cast.
// The FP8 buffers' region rule: each region (and each cached weight copy) starts 256-byte aligned.
inline int64_t fp8_region_bytes(int64_t bytes) { return (bytes + 255) / 256 * 256; }
// One rowwise operand's four scale vectors of `capacity` floats — row amax, column amax, row dequantisation,
// column dequantisation — each a region (so 16-byte aligned, as cuBLASLt's scale vectors must be).
struct Fp8VectorSet {
  int64_t capacity = 0;
  int64_t vector_bytes() const { return fp8_region_bytes(capacity * int64_t(sizeof(float))); }
  int64_t bytes() const { return 4 * vector_bytes(); }
  // Vector i (0: row amax, 1: column amax, 2: row dequantisation, 3: column dequantisation) of the set at `base`.
  float* vector(void* base, int i) const { return reinterpret_cast<float*>(static_cast<uint8_t*>(base) + i * vector_bytes()); }
};
struct Fp8ScratchLayout {
  int64_t act = 0, act_t = 0, act_x_t = 0, weight = 0, scales = 0, bytes = 0;
  int64_t act_capacity = 0, weight_capacity = 0;  // bytes of each activation region and of the weight region
  int64_t cache_scales = 0, cache_slots = 0, cache_bytes = 0;
  int64_t cache_amax = 0;  // the producers' amax outputs (Fp8Linear::produced_amax): kFp8Produced per layer
  int64_t vectors = 0, cache_vectors = 0;  // rowwise: the scale vector sets
  Fp8VectorSet vector_set, cache_vector_set;
  int64_t cache_inputs = 0;  // keep_inputs: the forward inputs' transposed copies, to cache_bytes
};
Fp8ScratchLayout fp8_scratch_layout(const ModelConfig& c, int64_t tokens, Fp8Recipe recipe = Fp8Recipe::tensorwise,
                                    bool keep_inputs = false);
// Whether FP8 training keeps the forward inputs' transposed copies (keep_inputs): tensorwise, and only where
// nothing is recomputed — the copies are a byte per element of the four inputs of every block, which
// recomputation exists to avoid holding.
inline bool fp8_keeps_inputs(Fp8Recipe recipe, const RecomputePlan& recompute) {
  return recipe == Fp8Recipe::tensorwise && recompute.kind == RecomputePlan::Kind::none;
}
// The bytes of the forward inputs' transposed copies of one block (fp8_scratch_layout's keep_inputs), each
// input's copy a region.
int64_t fp8_kept_input_bytes(const ModelConfig& c, int64_t tokens);

// --precision fp8 on the CPU (emulated): the fp32 elements of the rounded copies — one block's linear weights
// (q, k, v, output projection, w1, w3, w2 in that order) and one layer's operands: an input [tokens,
// max(d_model, d_ff)], an output gradient [tokens, d_model] (rowwise: [tokens, max(d_model, d_ff)], since
// du and dg, rounded in place for dx's product, are rounded per column into it first for dw's).
int64_t fp8_emulation_elements(const ModelConfig& c, int64_t tokens, Fp8Recipe recipe = Fp8Recipe::tensorwise);

// bf16-pure on CUDA: the fp32 elements of the staging buffer a backward accumulates one gradient in — the
// largest parameter, or the q, k and v weights together (3 · d_model², one GEMM's weight gradient) if larger.
int64_t gradient_staging_elements(const ModelConfig& c);

// Tokens per chunk of the LM head and loss: `requested`, or (0) as many as keep a chunk's logits near
// 1 GiB of `elem_bytes` elements, a multiple of 128, and never more than `tokens`.
int64_t head_chunk_tokens(const ModelConfig& c, int64_t tokens, int64_t requested, int64_t elem_bytes);

}  // namespace flashlm
