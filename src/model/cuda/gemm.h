// The LM's linear layers on the GPU through cuBLASLt: the same products as cpu::linear_forward and
// cpu::linear_backward (ops_cpu.h), on row-major device arrays, with fp32 accumulation.
//
//   forward   y [n, out]  = x [n, in] · w [out, in]ᵀ (+ r)         (act dtype in, act dtype out)
//   backward  dx [n, in]  = dy [n, out] · w [out, in]   (or +=)     (act dtype)
//             dw [out, in] += dy [n, out]ᵀ · x [n, in]   (or =)     (act dtype in, fp32 out: the master gradient;
//                                                                   or bf16 out, WeightGrad)
//
// act ∈ {fp32, bf16, fp16}. Products accumulate in fp32 (CUBLAS_COMPUTE_32F); fp32 data gets true fp32
// products unless allow_tf32 asks for TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32). 16-bit data
// needs in and out to be multiples of 8 and 16-byte aligned pointers (every row then starts on a
// 16-byte boundary, which cuBLASLt's tensor-core kernels want); fp32 data takes any sizes and any
// 4-byte aligned pointers.
//
// Work is queued on `stream` (a cudaStream_t; nullptr = the legacy default stream) of the current
// device, and the call returns without synchronising. Pointers must be device (or managed) memory of
// the current device. Outputs must not overlap inputs or each other.
//
// Resources, created on first use and kept for the life of the process: one cuBLASLt handle per
// device, one 32 MiB workspace per (device, stream) pair (so that concurrent streams never share
// one), and one plan (descriptors + the heuristic's algorithm) per (device, product, shapes, dtypes,
// pointer alignments). The first call for a new stream or shape therefore allocates or queries: run
// each shape once before capturing a CUDA graph. Repeated calls with the same arguments run the same
// algorithm and are bitwise reproducible on one GPU model and cuBLAS version.
//
// Bad arguments throw flashlm::Error naming the argument: dtype, sizes, null, alignment and overlap are
// checked before any CUDA call, then that every pointer is device memory of the current device
// (cudaPointerGetAttributes). A failing cuBLASLt or CUDA call throws flashlm::CudaError naming the call
// and the shapes. Only in builds with
// CUDA (FLASHLM_WITH_CUDA); this header itself needs no CUDA headers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/gemm_sm_reserve.h"  // the SM reserve the plans honour
#include "flashlm/dtype.h"
#include "flashlm/fp8.h"

namespace flashlm {

// y[n, out] = x[n, in] · w[out, in]ᵀ; x, w and y have dtype `act`. n >= 0 (n = 0 does nothing),
// in, out >= 1. y is overwritten (never read).
void linear_forward_cuda(const void* x, const void* w, void* y, int64_t n, int64_t in, int64_t out, DType act,
                         void* stream, bool allow_tf32 = false);

// y[n, out] = x[n, in] · w[out, in]ᵀ + residual[n, out], the residual added to the fp32 accumulator in the
// GEMM's epilogue (cuBLASLt's C operand, beta = 1) and the sum rounded to `act` once: the residual stream's
// addition without a kernel of its own, nor a rounding of the product before it. residual (dtype act) must
// not overlap y, x or w.
void linear_forward_residual_cuda(const void* x, const void* w, const void* residual, void* y, int64_t n, int64_t in,
                                  int64_t out, DType act, void* stream, bool allow_tf32 = false);

// A weight gradient a GEMM writes: fp32 (the master gradient), or bf16 (ModelOptions::grad_dtype: the
// product accumulated in fp32 and rounded once, with += the stored bf16 value added in fp32 before that
// rounding). Null: no weight gradient.
struct WeightGrad {
  void* data = nullptr;
  DType dtype = DType::f32;
  WeightGrad() = default;
  WeightGrad(std::nullptr_t) {}
  WeightGrad(float* p) : data(p) {}
  WeightGrad(bf16_t* p) : data(p), dtype(DType::bf16) {}
  explicit operator bool() const { return data != nullptr; }
};

// dx[n, in] = dy[n, out] · w[out, in], or dx += when accumulate_dx (dtype act; when not accumulating,
// dx is never read); dw[out, in] += dy[n, out]ᵀ · x[n, in] with dw in fp32 whatever act is (or in bf16
// where act is bf16), or dw = when not accumulate_dw (dw is then never read: a gradient's first write needs
// no zeroing before). dx may be null to skip the input gradient (w is then unused and may be null), dw may
// be null to skip the weight gradient (x is then unused and may be null). n = 0 leaves dw unchanged (zeroes
// it when not accumulate_dw: the empty product) and, unless accumulate_dx, does nothing to dx either (it has
// no rows).
void linear_backward_cuda(const void* dy, const void* x, const void* w, void* dx, WeightGrad dw, int64_t n, int64_t in,
                          int64_t out, DType act, bool accumulate_dx, void* stream, bool allow_tf32 = false,
                          bool accumulate_dw = true);

// Two products of one input as one strided-batched GEMM (SwiGLU's w1 and w3, which lie a fixed distance
// apart in every flat buffer, with w2 between them): y0 = x · w0ᵀ and y1 = x · w1ᵀ, each as
// linear_forward_cuda computes it (w0, w1 [out, in]; y0, y1 [n, out]). One GEMM when w1 - w0 and y1 - y0
// are whole, non-negative numbers of elements at least one array long and cuBLASLt has an algorithm for
// the batch; otherwise (and from then on for that shape) two linear_forward_cuda calls. The outputs must
// not overlap each other or any input.
void linear_forward_pair_cuda(const void* x, const void* w0, const void* w1, void* y0, void* y1, int64_t n,
                              int64_t in, int64_t out, DType act, void* stream);

// The weight gradients of such a pair: dw0 += dy0ᵀ · x and dw1 += dy1ᵀ · x (or = when not accumulate_dw:
// never read), dw as linear_backward_cuda writes it (both of one dtype), as one strided-batched GEMM on the
// same conditions (dy1 - dy0 and dw1 - dw0), else two linear_backward_cuda calls.
void linear_weight_grad_pair_cuda(const void* dy0, const void* dy1, const void* x, WeightGrad dw0, WeightGrad dw1,
                                  int64_t n, int64_t in, int64_t out, DType act, bool accumulate_dw, void* stream);

// How an FP8 operand's dequantisation scale applies: one fp32 for the whole operand (tensorwise), or one per
// row of the operand ([rows] for p, [cols] for q: the rowwise recipe, cuBLASLt's outer-vector scaling
// CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, cuBLAS >= 12.9).
enum class Fp8Scaling : uint8_t { tensor, per_row };

// One FP8 operand of fp8_gemm_cuda: row-major FP8 bytes in `format`, and the device fp32 the product is
// multiplied by for it (its dequantisation scale, or per_row one per row; model/fp8.h; cuBLASLt's A/B scale
// pointer).
struct Fp8Operand {
  const void* data;
  Fp8Format format;
  const float* dequant;
  Fp8Scaling scaling = Fp8Scaling::tensor;
};

// FP8 training's GEMM (--precision fp8): d[rows, cols] = p[rows, k] · q[cols, k]ᵀ · (*p.dequant) ·
// (*q.dequant) + beta · c (per_row operands: d[r, c] times p.dequant[r] · q.dequant[c]), through cuBLASLt's FP8 tensor-core path: fp32 accumulation, d in `out` (bf16 or
// fp32), c of d's dtype (`residual` when not null, else d itself; beta 0 reads no c). Every product of an
// FP8 linear layer has this one shape, both operands K-major, which is what cuBLASLt's FP8 kernels take
// ("TN"): forward y = x · wᵀ (p = x, q = w), dx = dy · w (p = dy, q = wᵀ), dw = dyᵀ · x (p = dyᵀ, q = xᵀ),
// with the transposed copies written by the cast (model/cuda/fp8.h). rows, cols and k must be multiples of
// 16, the pointers (the scale pointers included) 16-byte aligned (FP8's requirements), p and q not both e5m2
// (cuBLASLt has no such kernel). The scales are read by the GPU when the GEMM runs: no host synchronisation,
// capturable in a CUDA graph. Plans are cached as for the other products (cuBLASLt-specific notes at the top of this header).
void fp8_gemm_cuda(const Fp8Operand& p, const Fp8Operand& q, void* d, DType out, int64_t rows, int64_t cols,
                   int64_t k, float beta, const void* residual, void* stream);

// Autotuning: with candidates >= 2, each new plan times the heuristic's first choice against up to
// candidates - 1 others (those that split K only with fp32 reductions in the workspace) on the call's own
// inputs (into a scratch output: nothing the call owns is written twice) and keeps the fastest; 0 or 1
// (the default) keeps the heuristic's first choice. The timing synchronises the stream
// once per new plan (so only the first step of a training run pays it) and is skipped while the stream is
// being captured into a CUDA graph. A timed choice may differ between processes, so results are bitwise
// reproducible only within one process when tuning is on. Process-wide; applies to plans built after it.
void set_gemm_autotune(int candidates);
int gemm_autotune();

// What autotuning chose for each plan it timed, in the order the plans were built.
struct GemmTuning {
  std::string product;  // e.g. "y[2048, 1600] = x[2048, 1600] · w[1600, 1600]ᵀ (bf16)"
  int candidates = 0;   // algorithms the heuristic returned and that ran
  int chosen = 0;       // index of the fastest in the heuristic's order (0: its own first choice)
  double first_ms = 0, chosen_ms = 0;  // mean time of the heuristic's first choice and of the chosen one
};
std::vector<GemmTuning> gemm_autotune_results();

// How many times this process asked cuBLASLt's heuristic for an algorithm (once per new plan): lets
// tests check that repeated calls reuse the cached plan.
int64_t gemm_cuda_heuristic_queries();

}  // namespace flashlm
