// Recomputation plans, the activation layout they give, and the memory plan built from it.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <limits>

#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/dtype.h"
#include "flashlm/error.h"
#include "model/activations.h"
#include "model/fp8.h"

namespace flashlm {

RecomputePlan RecomputePlan::parse(std::string_view text) {
  RecomputePlan p;
  if (text == "none") return p;
  if (text == "selective") return p.kind = Kind::selective, p;
  if (text == "auto") return p.kind = Kind::automatic, p;
  if (text == "blocks") return p.kind = Kind::blocks, p;
  if (text.starts_with("blocks:")) {
    const std::string_view k = text.substr(7);
    int64_t every = 0;
    const auto [end, ec] = std::from_chars(k.data(), k.data() + k.size(), every);
    FLASHLM_CHECK_ARG(ec == std::errc() && end == k.data() + k.size() && every >= 1 && every <= 4096,
                      "recompute: '{}': expected blocks:K with K a whole number in [1, 4096]", text);
    p.kind = Kind::blocks;
    p.every = every;
    return p;
  }
  fail_argument("recompute: unknown plan '{}': expected none, blocks, blocks:K, selective or auto", text);
}

std::string RecomputePlan::name() const {
  switch (kind) {
    case Kind::none: return "none";
    case Kind::blocks: return fmt::format("blocks:{}", every);
    case Kind::selective: return "selective";
    case Kind::automatic: return "auto";
  }
  return "?";
}

void parse_precision(std::string_view text, DType& dtype, bool& bf16_pure, bool& fp8) {
  bf16_pure = text == "bf16-pure" || text == "bf16-pure-fp8";
  // Not parse_dtype's "fp8" (the e4m3 dtype): the FP8 GEMMs over bf16 mixed precision, or over pure bf16.
  fp8 = text == "fp8" || text == "bf16-pure-fp8";
  if (bf16_pure || fp8) {
    dtype = DType::bf16;
    return;
  }
  dtype = parse_dtype(text);
  FLASHLM_CHECK_ARG(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16,
                    "precision: '{}': expected fp32, bf16, fp16, bf16-pure, fp8 or bf16-pure-fp8", text);
}

void parse_precision(std::string_view text, DType& dtype, bool& bf16_pure) {
  bool fp8 = false;
  parse_precision(text, dtype, bf16_pure, fp8);
  FLASHLM_CHECK_ARG(!fp8, "precision: '{}': this command takes fp32, bf16, fp16 or bf16-pure", text);
}

OptimizerState parse_optimizer_state(std::string_view text) {
  if (text == "fp32") return OptimizerState::fp32;
  if (text == "bf16") return OptimizerState::bf16;
  if (text == "bf16-sr") return OptimizerState::bf16_sr;
  fail_argument("optimizer state: '{}': expected fp32, bf16 or bf16-sr", text);
}

std::string_view optimizer_state_name(OptimizerState s) {
  switch (s) {
    case OptimizerState::fp32: return "fp32";
    case OptimizerState::bf16: return "bf16";
    case OptimizerState::bf16_sr: return "bf16-sr";
  }
  return "?";
}

void ModelOptions::check_optimizer_state() const {
  FLASHLM_CHECK_ARG(!bf16_pure || optimizer_state == OptimizerState::fp32,
                    "optimizer state: '{}' is for fp32 master weights; bf16-pure keeps its moments in bf16 (rounded "
                    "to nearest) already: leave --optimizer-state at fp32",
                    optimizer_state_name(optimizer_state));
}

DType parse_grad_dtype(std::string_view text) {
  if (text == "fp32") return DType::f32;
  if (text == "bf16") return DType::bf16;
  fail_argument("gradient dtype: '{}': expected fp32 or bf16", text);
}

void ModelOptions::check_grad_dtype(DType precision, Device device) const {
  FLASHLM_CHECK_ARG(grad_dtype == DType::f32 || grad_dtype == DType::bf16,
                    "gradient dtype: {}: expected fp32 or bf16", dtype_name(grad_dtype));
  if (grad_dtype == DType::f32) return;
  FLASHLM_CHECK_ARG(device == Device::cuda, "--grad-dtype bf16 needs --device cuda (the CPU keeps fp32 gradients)");
  FLASHLM_CHECK_ARG(!bf16_pure,
                    "--grad-dtype bf16 is for fp32 master weights; {} keeps bf16 gradients already: leave "
                    "--grad-dtype at fp32",
                    precision_name(precision, bf16_pure, fp8));
  FLASHLM_CHECK_ARG(precision == DType::bf16,
                    "--grad-dtype bf16 needs --precision bf16 or fp8 (bf16 operands for the weight-gradient GEMMs); "
                    "not {}",
                    precision_name(precision, bf16_pure, fp8));
  FLASHLM_CHECK_ARG(!external_parameters,
                    "--grad-dtype bf16 is not for FSDP's sharded storage (it reduce-scatters fp32 gradients): use "
                    "--grad-dtype fp32 with --ddp fsdp");
}

std::string precision_name(DType dtype, bool bf16_pure, bool fp8) {
  if (bf16_pure) return fp8 ? "bf16-pure-fp8" : "bf16-pure";
  return fp8 ? "fp8" : std::string(dtype_name(dtype));
}

void ModelOptions::check_fp8(DType precision, Device device) const {
  if (!fp8) return;
  if (device == Device::cpu) {
    FLASHLM_CHECK_ARG(precision == DType::f32 && !bf16_pure,
                      "precision: fp8 on the CPU is emulated over fp32; not with {}",
                      precision_name(precision, bf16_pure));
    return;
  }
  // Over bf16 either way: mixed (fp32 masters) or pure (bf16-pure-fp8). The FP8 layer reads the bf16 weights
  // the GEMMs would have read and writes fp32 weight gradients, which bf16-pure stages as it does for bf16.
  FLASHLM_CHECK_ARG(precision == DType::bf16,
                    "precision: fp8 runs its linear layers' GEMMs in FP8 over bf16 (mixed precision, or bf16-pure: "
                    "bf16-pure-fp8); not with {}",
                    precision_name(precision, bf16_pure));
}

int64_t ActivationLayout::segment_last(int64_t l) const {
  if (recompute.kind != RecomputePlan::Kind::blocks) return l;
  const int64_t first = blocks[size_t(l)].segment;
  return std::min<int64_t>(int64_t(blocks.size()), first + recompute.every) - 1;
}

int64_t gradient_staging_elements(const ModelConfig& c) {
  int64_t largest = checked_mul(3 * c.d_model, c.d_model, "gradient staging: 3 x d_model^2");
  for (const ParameterInfo& info : parameter_layout(c)) largest = std::max(largest, info.numel());
  return largest;
}

ActivationLayout layout_activations(const ModelConfig& c, int64_t batch, int64_t seq, const RecomputePlan& plan) {
  using Kind = RecomputePlan::Kind;
  FLASHLM_CHECK(plan.kind != Kind::automatic, "layout_activations: resolve --recompute auto first");
  FLASHLM_CHECK(plan.every >= 1, "recompute: blocks:{} needs K >= 1", plan.every);
  FLASHLM_CHECK(batch >= 1 && seq >= 1, "activations: batch {} and seq {}, expected at least 1", batch, seq);
  const int64_t n = checked_mul(batch, seq, "activations: batch x seq");
  const int64_t nd = checked_mul(n, c.d_model, "activations: tokens x d_model");
  const int64_t nf = checked_mul(n, c.d_ff, "activations: tokens x d_ff");
  const int64_t bhs = checked_mul(checked_mul(batch, c.heads, "activations: batch x heads"), seq,
                                      "activations: batch x heads x seq");
  ActivationLayout out;
  out.recompute = plan;
  int64_t v = 0, s = 0;
  auto take = [](int64_t& cursor, int64_t count) {
    const int64_t at = cursor;
    FLASHLM_CHECK(cursor <= std::numeric_limits<int64_t>::max() / 2 - aligned_elements(count),
                  "activations: {} elements overflow 64-bit sizes", cursor);
    cursor += aligned_elements(count);
    return at;
  };
  // Every value and statistic of one block at fresh offsets (x_in too unless `with_input` is false).
  auto whole_block = [&](bool with_input) {
    BlockActivations b{};
    if (with_input) b.x_in = take(v, nd);
    b.h1 = take(v, nd), b.q = take(v, nd), b.k = take(v, nd), b.v = take(v, nd), b.attn = take(v, nd);
    b.x_mid = take(v, nd), b.h2 = take(v, nd), b.u = take(v, nf), b.g = take(v, nf), b.s = take(v, nf);
    b.rstd1 = take(s, n), b.rstd2 = take(s, n), b.lse = take(s, bhs);
    return b;
  };
  const int64_t L = c.layers;
  out.blocks.resize(size_t(L));
  // What is kept from the forward to the backward comes first.
  if (plan.kind == Kind::none) {
    for (auto& b : out.blocks) b = whole_block(true);
  } else if (plan.kind == Kind::blocks) {
    for (int64_t l = 0; l < L; l += plan.every) out.blocks[size_t(l)].x_in = take(v, nd);
  } else {  // selective: the input, the attention output and its logsumexp
    for (auto& b : out.blocks) b.x_in = take(v, nd), b.attn = take(v, nd), b.lse = take(s, bhs);
  }
  out.x_out = take(v, nd);
  out.h_f = take(v, nd);
  out.rstd_f = take(s, n);
  out.kept_values = v;
  out.kept_stats = s;
  // Then the working slots the recomputation rewrites.
  if (plan.kind == Kind::blocks) {
    const int64_t slots = std::min(plan.every, L);
    std::vector<BlockActivations> slot;
    for (int64_t j = 0; j < slots; ++j) slot.push_back(whole_block(j > 0));  // slot 0's input is always kept
    for (int64_t l = 0; l < L; ++l) {
      BlockActivations& b = out.blocks[size_t(l)];
      const int64_t kept_input = b.x_in;
      b = slot[size_t(l % plan.every)];
      if (l % plan.every == 0) b.x_in = kept_input;
      b.segment = l - l % plan.every;
    }
  } else if (plan.kind == Kind::selective) {
    BlockActivations slot{};
    slot.h1 = take(v, nd), slot.q = take(v, nd), slot.k = take(v, nd), slot.v = take(v, nd);
    slot.x_mid = take(v, nd), slot.h2 = take(v, nd), slot.u = take(v, nf), slot.g = take(v, nf), slot.s = take(v, nf);
    slot.rstd1 = take(s, n), slot.rstd2 = take(s, n);
    for (int64_t l = 0; l < L; ++l) {
      BlockActivations& b = out.blocks[size_t(l)];
      BlockActivations merged = slot;
      merged.x_in = b.x_in, merged.attn = b.attn, merged.lse = b.lse, merged.segment = l;
      b = merged;
    }
  }
  out.values = v;
  out.stats = s;
  return out;
}

int64_t backward_scratch_elements(const ModelConfig& c, int64_t tokens) {
  const int64_t nd = aligned_elements(checked_mul(tokens, c.d_model, "scratch: tokens x d_model"));
  const int64_t nf = aligned_elements(checked_mul(tokens, c.d_ff, "scratch: tokens x d_ff"));
  return 6 * nd + 3 * nf;
}

int64_t fp8_kept_input_bytes(const ModelConfig& c, int64_t tokens) {
  const int64_t nd = fp8_region_bytes(checked_mul(tokens, c.d_model, "FP8 kept inputs: tokens x d_model"));
  const int64_t nf = fp8_region_bytes(checked_mul(tokens, c.d_ff, "FP8 kept inputs: tokens x d_ff"));
  return checked_add(checked_mul(3, nd, "FP8 kept inputs"), nf, "FP8 kept inputs");
}

Fp8ScratchLayout fp8_scratch_layout(const ModelConfig& c, int64_t tokens, Fp8Recipe recipe, bool keep_inputs) {
  FLASHLM_CHECK(!keep_inputs || recipe == Fp8Recipe::tensorwise,
                "fp8_scratch_layout: keep_inputs is tensorwise only (rowwise scales xᵀ per column, x per row)");
  // The linear layers' widths: q, k, v together (3d), d, and d_ff (w1, w3 out; w2 in).
  const int64_t widest = std::max(3 * c.d_model, c.d_ff);
  const auto region = fp8_region_bytes;
  Fp8ScratchLayout l;
  l.act_capacity = checked_mul(tokens, widest, "FP8 scratch: tokens x widest layer");
  l.weight_capacity = checked_mul(c.d_model, widest, "FP8 scratch: largest weight");
  l.act = 0;
  l.act_t = region(l.act_capacity);
  l.act_x_t = 2 * l.act_t;
  l.weight = 3 * l.act_t;
  l.scales = l.weight + region(l.weight_capacity);
  l.bytes = l.scales + region(3 * kFp8ScaleSlotFloats * int64_t(sizeof(float)));
  // The weight cache: every block's five linear weights (q/k/v as one, the output projection, w1, w3, w2),
  // each copy (w and wᵀ) starting 256-byte aligned, then the scale slots.
  const int64_t d = c.d_model, f = c.d_ff;
  const int64_t qkv = region(checked_product({3, d, d}, "FP8 weight cache: q/k/v"));
  const int64_t ffn = region(checked_mul(d, f, "FP8 weight cache: a feed-forward weight"));
  const int64_t per_layer = checked_mul(
      2, checked_add(checked_add(qkv, region(d * d), "FP8 weight cache"), checked_mul(3, ffn, "FP8 weight cache"),
                     "FP8 weight cache"),
      "FP8 weight cache");
  l.cache_slots = checked_mul(5, c.layers, "FP8 weight cache: weights");
  l.cache_scales = checked_mul(per_layer, c.layers, "FP8 weight cache");
  // Two scale slots per weight: its own, and its forward input's (whose amax the backward's cast of xᵀ reuses).
  l.cache_amax = checked_add(l.cache_scales,
                             region(2 * l.cache_slots * kFp8ScaleSlotFloats * int64_t(sizeof(float))),
                             "FP8 weight cache");
  // Then the amax outputs of the kernels that produce the linear layers' inputs and output gradients.
  l.cache_bytes = checked_add(l.cache_amax, region(kFp8Produced * c.layers * int64_t(sizeof(float))),
                              "FP8 weight cache");
  l.vectors = l.bytes;
  l.cache_vectors = l.cache_bytes;
  if (recipe == Fp8Recipe::rowwise) {
    // A scratch operand has at most max(tokens, widest) rows or columns, a weight at most widest.
    l.vector_set.capacity = std::max(tokens, widest);
    l.cache_vector_set.capacity = widest;
    l.bytes = checked_add(l.vectors, checked_mul(3, l.vector_set.bytes(), "FP8 scratch: scale vectors"),
                          "FP8 scratch");
    l.cache_bytes = checked_add(l.cache_vectors,
                                checked_mul(l.cache_slots, l.cache_vector_set.bytes(), "FP8 weight cache: scale vectors"),
                                "FP8 weight cache");
  }
  l.cache_inputs = l.cache_bytes;
  if (keep_inputs) {
    l.cache_bytes = checked_add(l.cache_inputs, checked_mul(c.layers, fp8_kept_input_bytes(c, tokens), "FP8 kept inputs"),
                                "FP8 weight cache");
  }
  return l;
}

int64_t fp8_emulation_elements(const ModelConfig& c, int64_t tokens, Fp8Recipe recipe) {
  const int64_t d = c.d_model, f = c.d_ff;
  const int64_t weights = checked_add(checked_product({4, d, d}, "FP8 emulation: attention weights"),
                                      checked_product({3, d, f}, "FP8 emulation: feed-forward weights"),
                                      "FP8 emulation: block weights");
  const int64_t gradient = recipe == Fp8Recipe::rowwise ? std::max(d, f) : d;
  const int64_t operands =
      checked_mul(tokens, checked_add(std::max(d, f), gradient, "FP8 emulation"), "FP8 emulation");
  return checked_add(weights, operands, "FP8 emulation");
}

int64_t head_chunk_tokens(const ModelConfig& c, int64_t tokens, int64_t requested, int64_t elem_bytes) {
  FLASHLM_CHECK(requested >= 0, "head chunk: {} tokens, expected >= 0 (0: automatic)", requested);
  if (requested > 0) return std::min(requested, tokens);
  constexpr int64_t kLogitBytes = int64_t{1} << 30;
  int64_t rows = kLogitBytes / checked_mul(c.vocab, elem_bytes, "head chunk: vocab x element size");
  rows = std::max<int64_t>(128, rows / 128 * 128);
  return std::min(rows, tokens);
}

int64_t MemoryPlan::total_bytes() const {
  int64_t total = 0;
  for (const Item& i : items) total += i.bytes;
  return total;
}

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The plan for a resolved recomputation.
MemoryPlan plan_for(const ModelConfig& c, int64_t batch, int64_t seq, Device device, DType precision,
                    const ModelOptions& o, const RecomputePlan& recompute) {
  MemoryPlan p;
  p.recompute = recompute;
  const int64_t n_params = c.parameter_count();
  const int64_t n = checked_mul(batch, seq, "memory plan: batch x seq");
  const bool cuda = device == Device::cuda;
  const int64_t elem = cuda ? int64_t(dtype_size(precision)) : 4;
  auto bytes = [](int64_t count, int64_t size) { return checked_mul(count, size, "memory plan: bytes"); };
  // A sharded optimizer's share: ZeroOptimizer's shards of ceil(n / world) (rounded up to its grain, and
  // FSDP's replicated gains and tails, are below a MiB at every size here).
  const int64_t moments = (n_params + o.optimizer_shards - 1) / o.optimizer_shards;
  const std::string share =
      o.optimizer_shards > 1 ? fmt::format(", 1/{}: this rank's shard", o.optimizer_shards) : std::string();
  const bool bf16_moments = o.optimizer_state != OptimizerState::fp32;
  const MemoryPlan::Item master_moments =
      bf16_moments ? MemoryPlan::Item{fmt::format("AdamW moments ({}{})", optimizer_state_name(o.optimizer_state), share),
                                      bytes(moments, 4)}
                   : MemoryPlan::Item{"AdamW moments (fp32" + share + ")", bytes(moments, 8)};
  if (o.external_parameters) {
    // FSDP's sharded storage (flashlm/fsdp.h): this rank's 1/world of the matrices, every RMSNorm gain, and
    // the pool of gathered parts and the gradient buffers; each part gathered in the type the model reads it
    // in (CUDA's mixed precision reads the embedding in fp32, the other matrices in the low-precision copy).
    const int64_t world = o.fsdp_world;
    int64_t gains = 0, matrices = 0, largest_part = 0, largest_part_bytes = 0;
    // bf16-pure gathers every part, the embedding too, in bf16; fsdp_fp8_gather a layer's matrices in e4m3.
    const int64_t low = cuda && precision != DType::f32 ? elem : 4;
    const int64_t layer_elem = o.fsdp_fp8_gather() ? 1 : low;
    const int64_t layer = 4 * c.d_model * c.d_model + 3 * c.d_model * c.d_ff + 2 * c.d_model;  // with its gains
    for (const auto& [count, size] : {std::pair{c.vocab * c.d_model, o.bf16_pure ? low : 4}, std::pair{layer, layer_elem},
                                      std::pair{c.vocab * c.d_model, low}}) {
      largest_part = std::max(largest_part, count);
      largest_part_bytes = std::max(largest_part_bytes, bytes(count, size));
    }
    for (const ParameterInfo& info : parameter_layout(c)) (info.shape.size() == 1 ? gains : matrices) += info.numel();
    // The tails: fewer than `world` elements per sharded bucket (two per layer, the embedding, the head).
    const int64_t shard = (matrices + world - 1) / world + gains + (2 * c.layers + 2) * (world - 1);
    const std::string of = fmt::format(", 1/{}: this rank's shard", world);
    if (o.bf16_pure) {
      // No fp32 masters: the bf16 shard is the parameters. The gradients are reduced in fp32 and rounded
      // once into a bf16 shard for AdamW (ZeroOptimizer::step_bf16); the moments are bf16.
      p.items.push_back({"parameters (bf16" + of + ")", bytes(shard, 2)});
      p.items.push_back({"gradients (fp32 reduced + bf16 rounded" + of + ")", bytes(shard, 6)});
      p.items.push_back({"AdamW moments (bf16" + share + ")", bytes(moments, 4)});
    } else {
      p.items.push_back({"parameters (fp32" + of + ")", bytes(shard, 4)});
      if (cuda && precision != DType::f32) {
        p.items.push_back({fmt::format("parameters ({} copy for the GEMMs{})", dtype_name(precision), of), bytes(shard, elem)});
      }
      p.items.push_back({"gradients (fp32" + of + ")", bytes(shard, 4)});
      p.items.push_back(master_moments);
    }
    if (world > 1) {  // at one rank nothing is sharded: the shards are the whole model, read in place
      p.items.push_back({fmt::format("FSDP gathered parts (a pool of prefetch {} + 2{})", o.fsdp_prefetch,
                                     o.fsdp_fp8_gather() ? "; layers as FP8 bytes" : ""),
                         checked_mul(o.fsdp_prefetch + 2, largest_part_bytes, "memory plan: bytes")});
      p.items.push_back(o.fsdp_grad_accum > 1
                            ? MemoryPlan::Item{"FSDP whole local gradients (grad_accum > 1)", bytes(n_params, 4)}
                            : MemoryPlan::Item{"FSDP part gradients (two parts)", bytes(2 * largest_part, 4)});
    }
  } else if (o.bf16_pure) {
    p.items.push_back({"parameters (bf16)", bytes(n_params, 2)});
    p.items.push_back({"gradients (bf16)", bytes(n_params, 2)});
    p.items.push_back({"AdamW moments (bf16" + share + ")", bytes(moments, 4)});
  } else {
    p.items.push_back({"parameters (fp32)", bytes(n_params, 4)});
    if (cuda && precision != DType::f32) {
      p.items.push_back({fmt::format("parameters ({} copy for the GEMMs)", dtype_name(precision)), bytes(n_params, elem)});
    }
    p.items.push_back(o.grad_dtype == DType::bf16 ? MemoryPlan::Item{"gradients (bf16)", bytes(n_params, 2)}
                                                  : MemoryPlan::Item{"gradients (fp32)", bytes(n_params, 4)});
    p.items.push_back(master_moments);
  }
  const ActivationLayout a = layout_activations(c, batch, seq, recompute);
  p.items.push_back({fmt::format("activations kept for the backward (recompute {})", recompute.name()),
                     bytes(a.kept_values, elem) + bytes(a.kept_stats, 4)});
  if (a.recomputes()) {
    p.items.push_back({"activations of the recomputed blocks (working set)",
                       bytes(a.values - a.kept_values, elem) + bytes(a.stats - a.kept_stats, 4)});
  }
  p.items.push_back({"backward scratch", bytes(backward_scratch_elements(c, n), elem)});
  if (!cuda && o.fp8) {
    p.items.push_back(
        {"FP8 emulation: rounded weights and operands", bytes(fp8_emulation_elements(c, n, o.fp8_recipe), 4)});
  }
  if (cuda && o.fp8) {
    const bool keep = fp8_keeps_inputs(o.fp8_recipe, recompute);
    const Fp8ScratchLayout fp8 = fp8_scratch_layout(c, n, o.fp8_recipe, keep);
    p.items.push_back({"FP8 copies of one linear layer's operands", fp8.bytes});
    p.items.push_back({"FP8 copies of the block weights, both ways (one pass)", fp8.cache_inputs});
    if (keep) {
      p.items.push_back({"FP8 transposed copies of the blocks' linear inputs (recompute none)",
                         fp8.cache_bytes - fp8.cache_inputs});
    }
  }
  if (cuda) {
    const int64_t chunk = head_chunk_tokens(c, n, o.head_chunk, elem);
    p.items.push_back({fmt::format("LM head + loss: logits of {} tokens at a time, per-token losses", chunk),
                       bytes(aligned_elements(checked_mul(chunk, c.vocab, "head chunk")), elem) + bytes(n, 4)});
    if ((o.bf16_pure || o.grad_dtype == DType::bf16) && !o.external_parameters) {  // FSDP's are fp32 already
      p.items.push_back({o.bf16_pure ? "fp32 gradient accumulator (the largest gradient a GEMM writes)"
                                     : "fp32 gradient accumulator (embedding, LM head, RMSNorm gains)",
                         bytes(gradient_staging_elements(c), 4)});
    }
    // cuBLASLt's 32 MiB, the embedding backward's sort (~32 bytes a token), the RMSNorm gain partial sums
    // (1024 rows of d floats) and the attention backward's two fp32 rows per query.
    const int64_t workspaces = (int64_t{32} << 20) + bytes(n, 32) + bytes(1024 * c.d_model, 4) +
                               bytes(checked_mul(n, c.heads, "workspaces"), 8);
    p.items.push_back({"workspaces (estimated)", workspaces});
  } else {
    const int64_t chunk = head_chunk_tokens(c, n, o.head_chunk, 4);
    p.items.push_back({fmt::format("LM head + loss: logits of {} tokens at a time", chunk),
                       bytes(checked_mul(chunk, c.vocab, "head chunk"), 4)});
  }
  p.items.push_back({"tokens, targets, RoPE tables",
                     bytes(n, 8) + bytes(checked_mul(c.context, c.head_dim(), "RoPE tables"), 4)});
  return p;
}

}  // namespace

MemoryPlan plan_model_memory(const ModelConfig& c, int64_t batch, int64_t seq, Device device, DType precision,
                             const ModelOptions& o, int64_t available_bytes) {
  c.validate();
  FLASHLM_CHECK(batch >= 1 && seq >= 1 && seq <= c.context, "memory plan: batch {} and seq {} (context {})", batch, seq,
                c.context);
  FLASHLM_CHECK(!o.bf16_pure || (device == Device::cuda && precision == DType::bf16),
                "precision: bf16-pure is a CUDA precision (bf16 parameters, gradients and moments)");
  o.check_fp8(precision, device);
  o.check_optimizer_state();
  o.check_grad_dtype(precision, device);
  FLASHLM_CHECK(o.optimizer_shards >= 1 && o.optimizer_shards <= (int64_t{1} << 20),
                "memory plan: optimizer_shards = {}, expected a rank count in [1, 2^20]", o.optimizer_shards);
  FLASHLM_CHECK(!o.external_parameters || (o.fsdp_world >= 1 && o.fsdp_world <= (int64_t{1} << 20) &&
                                           o.fsdp_prefetch >= 0 && o.fsdp_prefetch <= 2 && o.fsdp_grad_accum >= 1),
                "memory plan: FSDP's sharded storage with {} ranks, prefetch {}, grad_accum {}", o.fsdp_world,
                o.fsdp_prefetch, o.fsdp_grad_accum);
  using Kind = RecomputePlan::Kind;
  if (o.recompute.kind != Kind::automatic) return plan_for(c, batch, seq, device, precision, o, o.recompute);
  if (available_bytes < 0) {
    MemoryPlan p = plan_for(c, batch, seq, device, precision, o, RecomputePlan{});
    p.reason = "auto: no memory limit known on this device, so nothing is recomputed";
    return p;
  }
  // Leave room for the allocator's rounding and the CUDA context's own allocations.
  const int64_t usable = available_bytes - std::max<int64_t>(int64_t{1} << 30, available_bytes / 32);
  std::string tried;
  const RecomputePlan fastest_first[] = {{Kind::none, 1}, {Kind::selective, 1}, {Kind::blocks, 1}};
  for (const RecomputePlan& r : fastest_first) {
    MemoryPlan p = plan_for(c, batch, seq, device, precision, o, r);
    if (p.total_bytes() <= usable) {
      p.reason = fmt::format("auto: {}{} needs {:.1f} of {:.1f} GiB free{}", tried, r.name(),
                             double(p.total_bytes()) / kGiB, double(available_bytes) / kGiB,
                             r.kind == Kind::none        ? ": the fastest plan, nothing recomputed"
                             : r.kind == Kind::selective ? ": recomputes everything but attention"
                                                         : ": recomputes every block once");
      return p;
    }
    tried += fmt::format("{} needs {:.1f} GiB, ", r.name(), double(p.total_bytes()) / kGiB);
  }
  // Memory is all that matters: the block interval with the least memory.
  MemoryPlan best;
  for (int64_t k = 1; k <= c.layers; ++k) {
    MemoryPlan p = plan_for(c, batch, seq, device, precision, o, {Kind::blocks, k});
    if (best.items.empty() || p.total_bytes() < best.total_bytes()) best = std::move(p);
  }
  best.reason = fmt::format("auto: {}so the least memory: {} needs {:.1f} of {:.1f} GiB free", tried,
                            best.recompute.name(), double(best.total_bytes()) / kGiB, double(available_bytes) / kGiB);
  return best;
}

std::string MemoryPlan::format() const {
  std::string out;
  for (const Item& i : items) out += fmt::format("  {:<62} {:>9.2f} GiB\n", i.what, double(i.bytes) / kGiB);
  out += fmt::format("  {:<62} {:>9.2f} GiB", "total", double(total_bytes()) / kGiB);
  if (!reason.empty()) out += "\n  " + reason;
  return out;
}

MemoryPlan resolve_model_memory(const ModelConfig& config, int64_t batch, int64_t seq, Device device, DType precision,
                                ModelOptions& options, int64_t& available_bytes) {
  available_bytes = device == Device::cuda ? cuda_free_memory_bytes() : -1;
  MemoryPlan plan = plan_model_memory(config, batch, seq, device, precision, options, available_bytes);
  options.recompute = plan.recompute;
  return plan;
}

void check_memory_plan(const MemoryPlan& plan, int64_t available_bytes, std::string_view device_label) {
  if (available_bytes < 0 || plan.total_bytes() <= available_bytes) return;
  throw OutOfMemory(fmt::format(
      "memory plan: the model needs {:.2f} GiB but {} has {:.2f} GiB free: {:.2f} GiB short (recompute {}; try "
      "--recompute blocks:1 or selective, bf16-pure, a smaller batch or context)",
      double(plan.total_bytes()) / kGiB, device_label, double(available_bytes) / kGiB,
      double(plan.total_bytes() - available_bytes) / kGiB, plan.recompute.name()));
}

}  // namespace flashlm
