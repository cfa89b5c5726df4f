// The plans behind cuda/gemm.h's GEMMs, private to src/model/cuda: one cuBLASLt descriptor, layouts and
// algorithm per (product, shapes, dtypes, alignments), chosen by the heuristic or, with set_gemm_autotune, by
// timing its next candidates. gemm_plan.cpp builds the plans and keeps the autotuning state; gemm.cpp checks
// the arguments, caches the plans per device and runs them.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "flashlm/dtype.h"
#include "flashlm/fp8.h"

namespace flashlm::gemm_detail {

// cuBLAS's recommendation for Hopper (4 MiB suffices before it); the heuristic may pick split-K or
// stream-K algorithms that use it.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

// One call, as the caller sees it (for checks and messages).
enum class Product : uint8_t { forward, grad_input, grad_weight, fp8 };

struct Call {
  const char* fn;
  int64_t n, in, out;
  DType act;
  bool allow_tf32;
  bool accumulate_dx;
  bool accumulate_dw = true;
  bool residual = false;
  DType dw = DType::f32;  // Product::grad_weight's output: the fp32 master gradient, or a bf16 gradient
  Fp8Format fp8_p = Fp8Format::e4m3, fp8_q = Fp8Format::e4m3;  // Product::fp8's operands (n = rows, in = k, out = cols)
  bool fp8_p_per_row = false, fp8_q_per_row = false;            // and whether their scales are vectors
};

const char* status_name(cublasStatus_t s);

// The call's product in the caller's terms, for error messages and the autotuning records.
std::string describe(const Call& c, Product p);

// Throws a CudaError naming the cuBLASLt function, its status and the call.
[[noreturn]] void throw_blas(const Call& c, Product p, const char* call, cublasStatus_t s);

// A column-major GEMM D[m, n] = op(A) · op(B) + beta · C, as cuBLASLt sees it (C has D's layout: D itself,
// or the residual of linear_forward_residual_cuda).
struct PlanKey {
  int32_t op_a, op_b;  // cublasOperation_t
  int64_t m, n, k;
  int64_t lda, ldb, ldd;
  int32_t ab_type, d_type;  // cudaDataType
  int32_t compute;          // cublasComputeType_t
  uint32_t align_a, align_b, align_c, align_d;  // pointer alignments in bytes (<= 256), part of the heuristic's query
  int32_t sm_target = 0;               // CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET; 0: the whole device
  // Strided batches (the pair products): batch products, operand i of product b at ptr_i + b·stride_i
  // elements (stride_b = 0: every product reads the same B).
  int32_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_d = 0;
  int32_t b_type = -1;  // B's cudaDataType where it differs from A's (FP8: e4m3 · e5m2); -1: ab_type
  // FP8 operands' scale modes (cublasLtMatmulMatrixScale_t); 0, the scalar, is not set on the descriptor.
  int32_t a_scale_mode = 0, b_scale_mode = 0;
  auto operator<=>(const PlanKey&) const = default;
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // C uses d's layout
  cublasLtMatmulAlgo_t algo{};
};

// What autotuning needs to run one plan's candidates: the call's inputs (read only), C when it is not D,
// and where the output goes instead of D (a scratch array the timing allocates).
struct TimingInputs {
  const void* a;
  const void* b;
  const void* c;  // nullptr: C is the output, as in the call
  float beta;
  size_t d_bytes;
  void* stream;
  void* workspace;
  const float* a_scale = nullptr;  // FP8 operands' device scales (see set_scales)
  const float* b_scale = nullptr;
};

// Points an FP8 plan's descriptor at the call's operand scales (CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER).
// Set before the heuristic query as well as per call, so that the heuristic (and the autotuning runs) see the
// descriptor the matmul will run with. (On 2026-12-04 every FP8 matmul was refused with NOT_SUPPORTED when
// the scales were set only after the query; whether this is the cause is not yet confirmed on the GPU.)
// The pointers belong to the call, so each call sets them again.
void set_scales(cublasLtMatmulDesc_t desc, const float* a_scale, const float* b_scale, const Call& c, Product p);

// Builds the plan of `key`: descriptors, the heuristic's algorithm, or the fastest of its candidates when
// autotuning is on (timed on `timing`'s inputs). Throws a CudaError when cuBLASLt has no algorithm for it.
Plan build_plan(cublasLtHandle_t handle, const PlanKey& key, const Call& c, Product p, const TimingInputs& timing);

}  // namespace flashlm::gemm_detail
