// FP8 training's arithmetic (--precision fp8, ModelOptions::fp8): tensorwise current scaling, as
// torchao's "tensorwise" float8 recipe. Before each FP8 GEMM every operand is scaled by
//
//   scale = fp8_max / max(amax, 1e-12)        amax = max |x| over the whole tensor, now
//
// and rounded to FP8 (round to nearest even, saturating to ±fp8_max); cuBLASLt multiplies the FP8 values,
// accumulates in fp32 and multiplies the result by both dequantisation scales 1 / scale. Weights and
// activations are e4m3, the output gradients e4m3 or e5m2 (ModelOptions::fp8_gradients). The bit types
// are flashlm/dtype.h's f8e4m3_t and f8e5m2_t.
//
// The rowwise recipe (ModelOptions::fp8_recipe, Fp8Recipe::rowwise; torchao's "rowwise") applies the same rule
// to each row of an operand along the dimension its product does not sum over, its amax that row's: the GEMM
// multiplies element (i, j) of its result by p's dequantisation scale of row i and q's of row j (cuBLASLt's
// outer-vector scaling). A tensor [rows, cols] that a layer uses both ways is cast twice: straight, scaled per
// row, and transposed, scaled per column (the rows of the transposed copy).
//
// The scale rule below is compiled into the CUDA cast kernel (model/cuda/fp8.cu) and the CPU emulation
// (fp8_cpu.cpp) alike, so both quantise to the same bits. The CPU emulation is the reference the GPU
// kernels are tested against, and runs where CI has no GPU.
#pragma once
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "core/host_device.h"
#include "flashlm/dtype.h"
#include "flashlm/fp8.h"

namespace flashlm {

struct ParameterInfo;  // flashlm/model.h (not included: the CUDA casts include this header)

// The block linear weights whose products are FP8 GEMMs (the names after "layers.<l>."), in the CPU
// emulation's order: q, k and v first, which share one scale (the CUDA model's fused [3d, d] weight, one
// amax over the three), then output_proj, w1, w3 and w2, each scaled on its own.
inline constexpr std::string_view kFp8BlockWeights[] = {"attn.q_proj.weight", "attn.k_proj.weight",
                                                        "attn.v_proj.weight", "attn.output_proj.weight",
                                                        "ffn.w1.weight",      "ffn.w3.weight",
                                                        "ffn.w2.weight"};
inline constexpr size_t kFp8SharedScaleWeights = 3;  // q, k, v

// Elements [offset, offset + count) of the flat parameters that one tensorwise scale covers.
struct Fp8ScaleGroup {
  int64_t offset = 0, count = 0;
};
// Every layer's scale groups over a model's layout, ascending: q‖k‖v (adjacent in parameter_layout, so one
// run), output_proj, w1, w2, w3. What FSDP's FP8 gather takes one amax of (fsdp_fp8_gather).
std::vector<Fp8ScaleGroup> fp8_scale_groups(const std::vector<ParameterInfo>& layout);

// The amax floor: an all-zero tensor gets a large finite scale (its FP8 copy is zero) instead of inf.
constexpr float kFp8AmaxFloor = 1e-12f;

FLASHLM_HOST_DEVICE inline float fp8_max_value(Fp8Format f) { return f == Fp8Format::e4m3 ? 448.0f : 57344.0f; }

// The quantisation scale for a tensor of this amax. A NaN amax (a NaN in the tensor) gives a NaN scale,
// so that the FP8 copy and the product are NaN too (`<` is false for NaN: no floor applied); an infinite
// amax gives 0, and inf · 0 is NaN where the infinity was.
FLASHLM_HOST_DEVICE inline float fp8_scale(float amax, Fp8Format f) {
  const float floored = amax < kFp8AmaxFloor ? kFp8AmaxFloor : amax;
  return fp8_max_value(f) / floored;
}

// What the GEMM multiplies its result by, per operand (cuBLASLt's A/B scale).
FLASHLM_HOST_DEVICE inline float fp8_dequant_scale(float scale) { return 1.0f / scale; }

// One operand's scales on the device (CUDA): a slot of kFp8ScaleSlotFloats fp32, 16-byte aligned, with the
// dequantisation scale at kFp8DequantIndex and the amax at kFp8AmaxIndex, each on its own 16 bytes. The
// dequantisation scale is the pointer cuBLASLt's FP8 GEMM reads as the operand's A/B scale, and cuBLASLt
// wants it 16-byte aligned: with it 4 bytes past an aligned address cublasLtMatmul answered NOT_SUPPORTED
// (cuBLASLt 13.1 on an H100, dev/cuda/02_fp8_gemm_probe.cu) though its heuristic had offered an algorithm.
// A block weight whose copies the AdamW step wrote (Fp8WeightCopies, optim/optimizer.h) also keeps there the
// bound its copies were scaled by (kFp8BoundIndex), beside its dequantisation scale.
inline constexpr int64_t kFp8DequantIndex = 0, kFp8BoundIndex = 1, kFp8AmaxIndex = 4, kFp8ScaleSlotFloats = 8;
inline constexpr uint32_t kFp8ScaleAlignment = 16;

// The tensors of a block whose producing kernels also write their amax (FP8 training on CUDA): the two
// RMSNorm outputs, the SwiGLU output, the SwiGLU backward's du and dg (w1's and w3's output gradients), and
// the residual gradient at the block's two products that read it as dy: dres_ffn, w2's (written by the
// backward of the next block's ln1, or of the final norm), and dres_attn, the output projection's (written by
// the backward of this block's ln2); and dqkv, the q|k|v projection's dy, whose amax the RoPE backward writes
// (it rotates dq and dk and reads dv, which the attention backward left beside them: one kernel covers the
// whole tensor). The casts of those tensors then skip their own reduction.
enum class Fp8Produced { h1, h2, s, du, dg, dres_ffn, dres_attn, dqkv };
inline constexpr int64_t kFp8Produced = 8;

// Whether the block weights' amax slots (CUDA: Fp8Linear's) hold the amaxes of the weights as they are stored
// now: set by the kernel that stored them and wrote their amaxes too (the AdamW step, for the weights it
// covered, in pass order), made stale by anything else that writes a weight, and taken once by the next pass,
// which trusts the slots only for exactly the weights set, and otherwise reduces them itself. Host-side state:
// a stale flag costs one reduction, a trusted stale amax would cost the bits.
class Fp8WeightAmaxes {
 public:
  void set_current(std::vector<const void*> weights) { current_ = std::move(weights); }
  void stale() { current_.clear(); }
  bool current() const { return !current_.empty(); }
  // Whether the slots hold the amaxes of `weights`, exactly these in this order; stale afterwards either way.
  bool take(const std::vector<const void*>& weights) {
    const bool hold = !weights.empty() && weights == current_;
    current_.clear();
    return hold;
  }

 private:
  std::vector<const void*> current_;
};

// ---------------------------------------------------------------------------------------------------
// The CPU emulation (fp8_cpu.cpp).

uint8_t fp8_encode(float v, Fp8Format f);  // f8e4m3_t / f8e5m2_t::from_float
float fp8_decode(uint8_t bits, Fp8Format f);

// max |x| over count values as the CUDA reduction computes it: a NaN anywhere gives NaN.
float fp8_amax_cpu(const float* x, int64_t count);

// What the CUDA cast writes for x[count] (the values of a bf16 or fp32 tensor, widened) with this scale:
// q[i] = encode(x[i] · scale).
void fp8_encode_cpu(const float* x, int64_t count, float scale, Fp8Format f, uint8_t* q);

// out[i] = decode(q[i]) · dequant: a tensor's FP8 bytes back in fp32, the values its GEMM multiplies. With
// q and dequant from fp8_quantize_cpu (or its gather) these are fp8_round_trip_cpu's values bit for bit.
void fp8_dequantize_cpu(const uint8_t* q, int64_t count, float dequant, Fp8Format f, float* out);

// The same with the tensor's own scale, fp8_scale(amax of x). Returns the dequantisation scale.
float fp8_quantize_cpu(const float* x, int64_t count, Fp8Format f, uint8_t* q);

// x rounded through FP8 and back, as the FP8 GEMMs see it: out[i] = decode(encode(x[i] · scale)) / scale with
// scale = fp8_scale(amax) (out may be x). amax is the tensor's, which may span several arrays (q, k and v as
// one tensor): fp8_amax_cpu over each, combined with fp8_amax_max. The CPU model's emulated FP8 training
// (ModelOptions::fp8 on the CPU) rounds its linear layers' operands so.
void fp8_round_trip_cpu(const float* x, int64_t count, float amax, Fp8Format f, float* out);
// The larger of two amaxes, NaN winning (as the reductions order magnitudes by their bits).
float fp8_amax_max(float a, float b);

// Rowwise, the CPU emulation of the CUDA casts (model/cuda/fp8.h's fp8_amax_rows_cols, fp8_cast_rowwise):
// row_amax[r] = max |x[r, ·]| and col_amax[c] = max |x[·, c]| of x [rows, cols], as fp8_amax_cpu reduces
// (NaN wins); either may be null.
void fp8_amax_rows_cols_cpu(const float* x, int64_t rows, int64_t cols, float* row_amax, float* col_amax);
// q [rows, cols] = encode(x[r, c] · fp8_scale(row_amax[r])) with row_dequant[r] its dequantisation scale, and
// qt [cols, rows] = encode(x[r, c] · fp8_scale(col_amax[c])) with col_dequant[c] (each pair may be null).
void fp8_cast_rowwise_cpu(const float* x, int64_t rows, int64_t cols, const float* row_amax, const float* col_amax,
                          Fp8Format f, uint8_t* q, uint8_t* qt, float* row_dequant, float* col_dequant);
// x [rows, cols] rounded through FP8 and back per row (row_amax[rows]) or per column (col_amax[cols]), as
// fp8_round_trip_cpu rounds a tensor (out may be x): what the CPU model's rowwise emulation multiplies.
void fp8_round_trip_rows_cpu(const float* x, int64_t rows, int64_t cols, const float* row_amax, Fp8Format f, float* out);
void fp8_round_trip_cols_cpu(const float* x, int64_t rows, int64_t cols, const float* col_amax, Fp8Format f, float* out);

// The product cuBLASLt computes from FP8 operands, in fp64: every product of two FP8 values is exact there,
// and so is the sum of e4m3 · e4m3 products (they span 2^-18 to 2^18) for k up to 2^16; with e5m2 (2^-16
// to 2^16) the sum rounds at most at 2^-53 of its largest term, far below any GPU tolerance:
//   d[r, c] = p_dequant · q_dequant · Σ_k decode(p[r, k]) · decode(q[c, k])     (p [rows, k], q [cols, k])
void fp8_matmul_nt_cpu(const uint8_t* p, Fp8Format pf, float p_dequant, const uint8_t* q, Fp8Format qf, float q_dequant,
                       int64_t rows, int64_t cols, int64_t k, double* d);
// The same with outer-vector scales (rowwise): p_dequant[rows] and q_dequant[cols], d[r, c] multiplied by
// p_dequant[r] · q_dequant[c].
void fp8_matmul_nt_rowwise_cpu(const uint8_t* p, Fp8Format pf, const float* p_dequant, const uint8_t* q, Fp8Format qf,
                               const float* q_dequant, int64_t rows, int64_t cols, int64_t k, double* d);

// The emulated FP8 linear layer, in fp64 from the quantised operands (the reference of the GPU's):
//   forward   y [n, out]  = Q(x) · Q(w)ᵀ                  x, w in e4m3
//   backward  dx [n, in]  = Q(dy) · Q(w)                  dy in grad_format
//             dw [out, in] = Q(dy)ᵀ · Q(x)
// Q(t) is t quantised tensorwise with its own scale and dequantised: the backward's operands are scaled
// over the whole tensor whichever way they are laid out, so Q(dy)ᵀ is Q(dyᵀ) (a transposed copy holds the
// same bytes). dx or dw may be null. Rowwise, Q scales each operand per row of the dimension its product
// does not sum over: Q(x) and Q(dy) per token, Q(w) per output channel in the forward and per input column
// in dx's product, Q(dyᵀ) per output channel and Q(xᵀ) per input column in dw's.
void fp8_linear_forward_cpu(const float* x, const float* w, double* y, int64_t n, int64_t in, int64_t out,
                            Fp8Recipe recipe = Fp8Recipe::tensorwise);
void fp8_linear_backward_cpu(const float* dy, const float* x, const float* w, double* dx, double* dw, int64_t n,
                             int64_t in, int64_t out, Fp8Format grad_format, Fp8Recipe recipe = Fp8Recipe::tensorwise);

}  // namespace flashlm
