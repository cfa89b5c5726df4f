// cuBLASLt behind linear_forward_cuda / linear_backward_cuda (cuda/gemm.h). Host code only: compiled by
// the C++ compiler, no kernels.
//
// Row-major data, column-major cuBLASLt. A row-major [r, c] array with row pitch c, read column-major,
// is the [c, r] matrix Mᵀ with leading dimension c, and (A·B)ᵀ = Bᵀ·Aᵀ. So every product is handed to
// cuBLASLt transposed: each row-major array is passed as its own transpose (no copy), the operands swap
// places, and cuBLASLt writes Dᵀ column-major, which is D row-major. Every layout stays in cuBLASLt's
// default column order (CUBLASLT_ORDER_COL), the best-covered path, rather than CUBLASLT_ORDER_ROW.
// With X = xᵀ [in, n], W = wᵀ [in, out], DY = dyᵀ [out, n] (the arrays as cuBLASLt reads them):
//
//   product      cuBLASLt computes        ops    m    n    k    A stored, lda   B stored, ldb   D, ldd
//   forward      yᵀ [out, n]   = Wᵀ · X    T, N   out  n    in   [in, out], in   [in, n], in     [out, n], out
//     + residual yᵀ [out, n]  += Rᵀ (C = rᵀ, beta 1, the layout of D; C and D are different arrays)
//   grad_input   dxᵀ [in, n]   = W · DY    N, N   in   n    out  [in, out], in   [out, n], out   [in, n], in
//   grad_weight  dwᵀ [in, out] = X · DYᵀ   N, T   in   out  n    [in, n], in     [out, n], out   [in, out], in
//
// (cuBLASLt layouts describe matrices as stored, before op: rows = m or k for A, k or n for B.)
// The forward is the "TN" case that tensor-core kernels like best, as in cuBLAS-based frameworks.
#include "model/cuda/gemm.h"

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <compare>
#include <cstring>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/cuda_check.h"
#include "flashlm/error.h"
#include "flashlm/memory.h"
#include "flashlm/profile.h"

namespace flashlm {

namespace {

// cuBLAS's recommendation for Hopper (4 MiB suffices before it); the heuristic may pick split-K or
// stream-K algorithms that use it.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

std::atomic<int64_t> g_heuristic_queries{0};
std::atomic<int> g_autotune{0};  // set_gemm_autotune
constexpr int kMaxAutotune = 64;
constexpr int kTimedRuns = 5;  // per candidate, after one untimed run

std::mutex g_tunings_mutex;
std::vector<GemmTuning>& tunings() {
  static auto* all = new std::vector<GemmTuning>();  // leaked on purpose, as the per-device state below
  return *all;
}

const char* status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED (library not initialised)";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED (resource allocation failed)";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE (unsupported value or parameter)";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH (not supported by this GPU)";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR (access to GPU memory failed)";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED (the GPU program failed to run)";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED (functionality not supported)";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "unknown cuBLAS status";
}

// ---------------------------------------------------------------------------------------------------
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
  Fp8Format fp8_p = Fp8Format::e4m3, fp8_q = Fp8Format::e4m3;  // Product::fp8's operands (n = rows, in = k, out = cols)
};

std::string describe(const Call& c, Product p) {
  const std::string_view t = dtype_name(c.act);
  const char* tf32 = c.act == DType::f32 && c.allow_tf32 ? ", TF32 allowed" : "";
  switch (p) {
    case Product::forward:
      return fmt::format("y[{}, {}] = x[{}, {}] · w[{}, {}]ᵀ{} ({}{})", c.n, c.out, c.n, c.in, c.out, c.in,
                         c.residual ? fmt::format(" + residual[{}, {}]", c.n, c.out) : "", t, tf32);
    case Product::grad_input:
      return fmt::format("dx[{}, {}] {} dy[{}, {}] · w[{}, {}] ({}{})", c.n, c.in, c.accumulate_dx ? "+=" : "=", c.n,
                         c.out, c.out, c.in, t, tf32);
    case Product::grad_weight:
      return fmt::format("dw[{}, {}] (fp32) {} dy[{}, {}]ᵀ · x[{}, {}] ({}{})", c.out, c.in,
                         c.accumulate_dw ? "+=" : "=", c.n, c.out, c.n, c.in, t, tf32);
    case Product::fp8:
      return fmt::format("d[{}, {}] ({}) {} p[{}, {}] ({}) · q[{}, {}]ᵀ ({}){}", c.n, c.out, t,
                         c.accumulate_dw ? "+=" : "=", c.n, c.in, fp8_format_name(c.fp8_p), c.out, c.in,
                         fp8_format_name(c.fp8_q), c.residual ? " + residual" : "");
  }
  return "?";
}

[[noreturn]] void throw_blas(const Call& c, Product p, const char* call, cublasStatus_t s) {
  throw CudaError(
      fmt::format("{}: {} failed: {} [status {}] for {}", c.fn, call, status_name(s), int(s), describe(c, p)));
}

// ---------------------------------------------------------------------------------------------------
// Argument checks (flashlm::Error naming the argument). Shapes and dtypes first, without touching CUDA.

void check_shapes(const Call& c) {
  FLASHLM_CHECK(c.act == DType::f32 || c.act == DType::bf16 || c.act == DType::f16,
                "{}: act = {}, expected fp32, bf16 or fp16", c.fn, dtype_name(c.act));
  FLASHLM_CHECK(c.n >= 0, "{}: n = {}, expected >= 0", c.fn, c.n);
  FLASHLM_CHECK(c.in >= 1, "{}: in = {}, expected >= 1", c.fn, c.in);
  FLASHLM_CHECK(c.out >= 1, "{}: out = {}, expected >= 1", c.fn, c.out);
  if (c.act != DType::f32) {
    // in and out are the row pitches of every operand: multiples of 8 keep each 16-bit row 16-byte aligned.
    FLASHLM_CHECK(c.in % 8 == 0,
                  "{}: in = {} must be a multiple of 8 for {} (cuBLASLt wants 16-byte aligned rows); pad the features",
                  c.fn, c.in, dtype_name(c.act));
    FLASHLM_CHECK(c.out % 8 == 0,
                  "{}: out = {} must be a multiple of 8 for {} (cuBLASLt wants 16-byte aligned rows); pad the features",
                  c.fn, c.out, dtype_name(c.act));
  }
  // cuBLASLt takes 64-bit sizes; keep element counts (and byte sizes) far from overflowing.
  constexpr int64_t kMax = int64_t{1} << 40;
  FLASHLM_CHECK(c.n <= kMax / c.in && c.n <= kMax / c.out && c.in <= kMax / c.out,
                "{}: n = {}, in = {}, out = {}: arrays too large", c.fn, c.n, c.in, c.out);
}

// One array argument: its name, pointer and size, for the null/device/alignment/overlap checks.
struct Arg {
  const char* name;
  const void* ptr;
  int64_t elems;
  size_t elem_size;
  size_t bytes() const { return static_cast<size_t>(elems) * elem_size; }
};

void check_not_null(const Call& c, const Arg& a) {
  FLASHLM_CHECK(a.ptr != nullptr, "{}: {} is null", c.fn, a.name);
}

uint32_t alignment_of(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lowest_bit = v & (~v + 1);
  return static_cast<uint32_t>(lowest_bit == 0 || lowest_bit > 256 ? 256 : lowest_bit);  // cuBLASLt's default is 256
}

void check_alignment(const Call& c, const Arg& a) {
  const size_t need = c.act == DType::f32 || a.elem_size == 4 ? 4 : 16;
  FLASHLM_CHECK(alignment_of(a.ptr) >= need, "{}: {} = {} is not {}-byte aligned{}", c.fn, a.name, a.ptr, need,
                need == 16 ? " (16-bit operands need 16-byte aligned pointers)" : "");
}

void check_on_device(const Call& c, const Arg& a, int device) {
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, a.ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail("{}: {} = {} is not a pointer CUDA knows ({}); expected device memory on cuda:{}", c.fn, a.name, a.ptr,
         cudaGetErrorString(err), device);
  }
  const bool device_memory = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  FLASHLM_CHECK(device_memory, "{}: {} = {} is host memory; expected device memory on cuda:{}", c.fn, a.name, a.ptr,
                device);
  FLASHLM_CHECK(attr.type == cudaMemoryTypeManaged || attr.device == device,
                "{}: {} is on cuda:{}, but the current device is cuda:{}", c.fn, a.name, attr.device, device);
}

void check_disjoint(const Call& c, const Arg& a, const Arg& b) {
  if (a.ptr == nullptr || b.ptr == nullptr || a.elems == 0 || b.elems == 0) return;
  const auto a0 = reinterpret_cast<uintptr_t>(a.ptr), b0 = reinterpret_cast<uintptr_t>(b.ptr);
  const bool overlap = a0 < b0 + b.bytes() && b0 < a0 + a.bytes();
  FLASHLM_CHECK(!overlap, "{}: {} and {} overlap in memory", c.fn, a.name, b.name);
}

int current_device(const Call& c) {
  int device = -1;
  FLASHLM_CUDA_CHECK(cudaGetDevice(&device), fmt::format("{}: cudaGetDevice", c.fn));
  return device;
}

// ---------------------------------------------------------------------------------------------------
// Plans: everything cuBLASLt needs for one (product, shapes, dtypes, alignments), built once.

cudaDataType cuda_type(DType t) {
  switch (t) {
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

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
  auto operator<=>(const PlanKey&) const = default;
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // C uses d's layout
  cublasLtMatmulAlgo_t algo{};
};

// Destroys a half-built plan when building it throws.
struct PlanGuard {
  Plan* plan;
  cublasLtMatmulPreference_t pref = nullptr;
  ~PlanGuard() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (!plan) return;
    if (plan->d) cublasLtMatrixLayoutDestroy(plan->d);
    if (plan->b) cublasLtMatrixLayoutDestroy(plan->b);
    if (plan->a) cublasLtMatrixLayoutDestroy(plan->a);
    if (plan->desc) cublasLtMatmulDescDestroy(plan->desc);
  }
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
void set_scales(cublasLtMatmulDesc_t desc, const float* a_scale, const float* b_scale, const Call& c, Product p) {
  if (!a_scale && !b_scale) return;
  const std::pair<cublasLtMatmulDescAttributes_t, const float*> scales[] = {
      {CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale}, {CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale}};
  for (const auto& [attr, ptr] : scales) {
    const cublasStatus_t set = cublasLtMatmulDescSetAttribute(desc, attr, &ptr, sizeof(ptr));
    if (set != CUBLAS_STATUS_SUCCESS) throw_blas(c, p, "cublasLtMatmulDescSetAttribute(A/B_SCALE_POINTER)", set);
  }
}

// The index of the fastest of `algos` on the call's inputs (0 when timing is not possible: a stream being
// captured, or no memory for the scratch output).
int fastest_algorithm(cublasLtHandle_t handle, const Plan& plan, const std::vector<cublasLtMatmulHeuristicResult_t>& algos,
                      const TimingInputs& t, const Call& c, Product p) {
  const auto s = static_cast<cudaStream_t>(t.stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FLASHLM_CUDA_CHECK(cudaStreamIsCapturing(s, &capture), fmt::format("{}: cudaStreamIsCapturing", c.fn));
  if (capture != cudaStreamCaptureStatusNone) return 0;
  // A plain cudaMalloc, not a tracked Buffer: a transient array freed before the call returns, which the
  // memory statistics and timeline of the model should not show as its own.
  void* scratch = nullptr;
  if (cudaMalloc(&scratch, t.d_bytes) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  cudaEvent_t start = nullptr, stop = nullptr;
  FLASHLM_CUDA_CHECK(cudaEventCreate(&start), "cudaEventCreate");
  FLASHLM_CUDA_CHECK(cudaEventCreate(&stop), "cudaEventCreate");
  FLASHLM_CUDA_CHECK(cudaMemsetAsync(scratch, 0, t.d_bytes, s), "cudaMemsetAsync(autotune scratch)");
  const float alpha = 1.0f;
  const void* c_in = t.c ? t.c : scratch;
  std::vector<double> ms(algos.size(), INFINITY);
  for (size_t i = 0; i < algos.size(); ++i) {
    auto run = [&] {
      return cublasLtMatmul(handle, plan.desc, &alpha, t.a, plan.a, t.b, plan.b, &t.beta, c_in, plan.d, scratch, plan.d,
                            &algos[i].algo, t.workspace, kWorkspaceBytes, s);
    };
    if (run() != CUBLAS_STATUS_SUCCESS) continue;  // a candidate that does not run is not chosen
    FLASHLM_CUDA_CHECK(cudaEventRecord(start, s), "cudaEventRecord");
    bool ok = true;
    for (int r = 0; r < kTimedRuns && ok; ++r) ok = run() == CUBLAS_STATUS_SUCCESS;
    FLASHLM_CUDA_CHECK(cudaEventRecord(stop, s), "cudaEventRecord");
    FLASHLM_CUDA_CHECK(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float elapsed = 0;
    FLASHLM_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop), "cudaEventElapsedTime");
    if (ok) ms[i] = double(elapsed) / kTimedRuns;
  }
  FLASHLM_CUDA_CHECK(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(scratch);
  const int best = int(std::min_element(ms.begin(), ms.end()) - ms.begin());
  if (!std::isfinite(ms[size_t(best)])) return 0;
  const std::lock_guard lock(g_tunings_mutex);
  tunings().push_back(GemmTuning{describe(c, p), int(algos.size()), best, ms[0], ms[size_t(best)]});
  return best;
}

Plan build_plan(cublasLtHandle_t handle, const PlanKey& key, const Call& c, Product p, const TimingInputs& timing) {
  Plan plan;
  PlanGuard guard{&plan};
  auto check = [&](cublasStatus_t s, const char* call) {
    if (s != CUBLAS_STATUS_SUCCESS) throw_blas(c, p, call, s);
  };
  const auto op_a = static_cast<cublasOperation_t>(key.op_a), op_b = static_cast<cublasOperation_t>(key.op_b);
  const auto ab_type = static_cast<cudaDataType>(key.ab_type), d_type = static_cast<cudaDataType>(key.d_type);

  check(cublasLtMatmulDescCreate(&plan.desc, static_cast<cublasComputeType_t>(key.compute), CUDA_R_32F),
        "cublasLtMatmulDescCreate");
  const int32_t ta = op_a, tb = op_b;
  check(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
        "cublasLtMatmulDescSetAttribute(TRANSA)");
  check(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
        "cublasLtMatmulDescSetAttribute(TRANSB)");
  if (key.sm_target > 0) {
    check(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &key.sm_target,
                                         sizeof(key.sm_target)),
          "cublasLtMatmulDescSetAttribute(SM_COUNT_TARGET)");
  }
  set_scales(plan.desc, timing.a_scale, timing.b_scale, c, p);

  // Layouts of the matrices as stored (before op), column-major.
  const bool na = op_a == CUBLAS_OP_N, nb = op_b == CUBLAS_OP_N;
  const auto rows_a = uint64_t(na ? key.m : key.k), cols_a = uint64_t(na ? key.k : key.m);
  const auto rows_b = uint64_t(nb ? key.k : key.n), cols_b = uint64_t(nb ? key.n : key.k);
  check(cublasLtMatrixLayoutCreate(&plan.a, ab_type, rows_a, cols_a, key.lda), "cublasLtMatrixLayoutCreate(A)");
  const auto b_type = key.b_type >= 0 ? static_cast<cudaDataType>(key.b_type) : ab_type;
  check(cublasLtMatrixLayoutCreate(&plan.b, b_type, rows_b, cols_b, key.ldb), "cublasLtMatrixLayoutCreate(B)");
  check(cublasLtMatrixLayoutCreate(&plan.d, d_type, uint64_t(key.m), uint64_t(key.n), key.ldd),
        "cublasLtMatrixLayoutCreate(C/D)");
  if (key.batch > 1) {
    const std::pair<cublasLtMatrixLayout_t, int64_t> strided[] = {
        {plan.a, key.stride_a}, {plan.b, key.stride_b}, {plan.d, key.stride_d}};
    for (const auto& [layout, stride] : strided) {
      check(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &key.batch, sizeof(key.batch)),
            "cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)");
      check(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                             sizeof(stride)),
            "cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)");
    }
  }

  check(cublasLtMatmulPreferenceCreate(&guard.pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t workspace = kWorkspaceBytes;
  check(cublasLtMatmulPreferenceSetAttribute(guard.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                             sizeof(workspace)),
        "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
  // The heuristic assumes 256-byte aligned pointers unless told otherwise; views into larger buffers are
  // often less aligned, and an algorithm chosen for 256 could then fail or read misaligned.
  const struct {
    cublasLtMatmulPreferenceAttributes_t attr;
    uint32_t bytes;
    const char* what;
  } alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a, "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGN_A)"},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b, "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGN_B)"},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c, "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGN_C)"},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_d, "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGN_D)"},
  };
  for (const auto& a : alignments) {
    check(cublasLtMatmulPreferenceSetAttribute(guard.pref, a.attr, &a.bytes, sizeof(a.bytes)), a.what);
  }

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  g_heuristic_queries.fetch_add(1, std::memory_order_relaxed);
  check(cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.a, plan.b, plan.d, plan.d, guard.pref, 1, &result,
                                       &found),
        "cublasLtMatmulAlgoGetHeuristic");
  if (found < 1 || result.state != CUBLAS_STATUS_SUCCESS) {
    throw CudaError(fmt::format(
        "{}: cublasLtMatmulAlgoGetHeuristic found no algorithm for {} (column-major m = {}, n = {}, k = {}, op {}{}, "
        "ld {}/{}/{}, pointer alignment {}/{}/{}/{} bytes, workspace {} MiB){}",
        c.fn, describe(c, p), key.m, key.n, key.k, op_a == CUBLAS_OP_N ? 'N' : 'T', op_b == CUBLAS_OP_N ? 'N' : 'T',
        key.lda, key.ldb, key.ldd, key.align_a, key.align_b, key.align_c, key.align_d, kWorkspaceBytes >> 20,
        found < 1 ? "" : fmt::format(": {}", status_name(result.state))));
  }
  if (result.workspaceSize > kWorkspaceBytes) {
    throw CudaError(fmt::format("{}: cuBLASLt's algorithm for {} wants {} bytes of workspace, more than the {} given",
                                c.fn, describe(c, p), result.workspaceSize, kWorkspaceBytes));
  }
  plan.algo = result.algo;
  const int wanted = std::min(g_autotune.load(std::memory_order_relaxed), kMaxAutotune);
  if (wanted >= 2) {
    // Autotuning: the heuristic's own choice against its next ones. Those may split K and add the parts
    // up in the output type (a bf16 rounding per part) or in place over C = D, so only splits reduced in
    // fp32 in the workspace (or none) are candidates. A candidate may still round the product to a 16-bit
    // output type before adding beta·C, as some first choices do (test_gemm_cuda's += bound allows it).
    // The timing runs with the call's beta and C == D when the call has it (D is the scratch then), so
    // beta need not be part of the key: any algorithm runs with any beta.
    const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    check(cublasLtMatmulPreferenceSetAttribute(guard.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions,
                                               sizeof(reductions)),
          "cublasLtMatmulPreferenceSetAttribute(REDUCTION_SCHEME_MASK)");
    std::vector<cublasLtMatmulHeuristicResult_t> more(static_cast<size_t>(wanted));
    int more_found = 0;
    check(cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.a, plan.b, plan.d, plan.d, guard.pref, wanted,
                                         more.data(), &more_found),
          "cublasLtMatmulAlgoGetHeuristic");
    std::vector<cublasLtMatmulHeuristicResult_t> candidates{result};
    for (int i = 0; i < more_found && int(candidates.size()) < wanted; ++i) {
      const cublasLtMatmulHeuristicResult_t& r = more[size_t(i)];
      const bool same = std::memcmp(&r.algo, &result.algo, sizeof(r.algo)) == 0;
      if (!same && r.state == CUBLAS_STATUS_SUCCESS && r.workspaceSize <= kWorkspaceBytes) candidates.push_back(r);
    }
    if (candidates.size() >= 2) {
      plan.algo = candidates[size_t(fastest_algorithm(handle, plan, candidates, timing, c, p))].algo;
    }
  }
  guard.plan = nullptr;  // keep the descriptors: the plan lives for the process
  return plan;
}

// ---------------------------------------------------------------------------------------------------
// Per-device state, created on first use and never destroyed (static destructors may run after the
// CUDA context is gone). Calls on one device take turns through `mutex` while they look up their plan
// and workspace and queue the matmul; the GPU work itself runs asynchronously.

struct DeviceLt {
  std::mutex mutex;
  cublasLtHandle_t handle = nullptr;
  // One workspace per stream: two streams running at once must not share one (and per-stream
  // workspaces keep results reproducible). Keyed by the cudaStream_t value and never freed (32 MiB per
  // stream ever used). A stream created at the address of a destroyed one inherits its workspace, so a
  // stream must not be destroyed while a matmul on it is still running if another may take its place.
  std::map<void*, Buffer> workspaces;
  std::map<PlanKey, Plan> plans;
  std::set<PlanKey> declined;  // batched products cuBLASLt has no algorithm for: run as single GEMMs instead
  int sm_count = 0;  // the device's multiprocessors
};

DeviceLt& lt_for_device(int device, const Call& c) {
  static std::mutex registry_mutex;
  static auto* registry = new std::map<int, DeviceLt*>();  // leaked on purpose, see above
  const std::lock_guard lock(registry_mutex);
  DeviceLt*& slot = (*registry)[device];
  if (!slot) {
    auto fresh = std::make_unique<DeviceLt>();
    const cublasStatus_t s = cublasLtCreate(&fresh->handle);
    if (s != CUBLAS_STATUS_SUCCESS) {
      throw CudaError(fmt::format("{}: cublasLtCreate failed on cuda:{}: {}", c.fn, device, status_name(s)));
    }
    FLASHLM_CUDA_CHECK(cudaDeviceGetAttribute(&fresh->sm_count, cudaDevAttrMultiProcessorCount, device),
                       "cudaDeviceGetAttribute(MultiProcessorCount)");
    slot = fresh.release();
  }
  return *slot;
}

// D = op(A)·op(B) + beta·C on `stream` through the cached plan (C is D unless given). d_bytes: D's size.
// may_decline: a batched key whose plan cannot be built (no algorithm) returns false, having run
// nothing, now and for every later call with that key, instead of throwing.
// a_scale, b_scale: FP8 operands' device scales (CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER), set on the cached
// descriptor before each call (under the device's lock), since they belong to the call, not the plan.
bool run_gemm(const Call& c, Product p, int device, PlanKey key, const void* a, const void* b, void* d,
              size_t d_bytes, float beta, void* stream, const void* c_input = nullptr, bool may_decline = false,
              const float* a_scale = nullptr, const float* b_scale = nullptr) {
  DeviceLt& lt = lt_for_device(device, c);
  const std::lock_guard lock(lt.mutex);
  const int reserve = gemm_sm_reserve();
  if (reserve > 0) {
    FLASHLM_CHECK(reserve < lt.sm_count,
                  "{}: set_gemm_sm_reserve({}) leaves no SM of cuda:{}'s {} for the GEMMs (--gemm-sm-reserve must be "
                  "below the SM count)",
                  c.fn, reserve, device, lt.sm_count);
    key.sm_target = lt.sm_count - reserve;
  }

  auto ws = lt.workspaces.find(stream);
  if (ws == lt.workspaces.end()) {
    ws = lt.workspaces.emplace(stream, Buffer::allocate(kWorkspaceBytes, Device::cuda, "cublasLt workspace")).first;
  }
  auto plan = lt.plans.find(key);
  if (plan == lt.plans.end()) {
    if (may_decline && lt.declined.count(key)) return false;
    const TimingInputs timing{a, b, c_input, beta, d_bytes, stream, ws->second.data(), a_scale, b_scale};
    try {
      plan = lt.plans.emplace(key, build_plan(lt.handle, key, c, p, timing)).first;
    } catch (const CudaError&) {
      if (!may_decline) throw;
      lt.declined.insert(key);
      return false;
    }
  }

  const float alpha = 1.0f;
  const Plan& pl = plan->second;
  set_scales(pl.desc, a_scale, b_scale, c, p);
  const cublasStatus_t s =
      cublasLtMatmul(lt.handle, pl.desc, &alpha, a, pl.a, b, pl.b, &beta, c_input ? c_input : d, pl.d, d, pl.d, &pl.algo,
                     ws->second.data(), kWorkspaceBytes, static_cast<cudaStream_t>(stream));
  if (s != CUBLAS_STATUS_SUCCESS) throw_blas(c, p, "cublasLtMatmul", s);
  return true;
}

cublasComputeType_t compute_type(const Call& c) {
  return c.act == DType::f32 && c.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

PlanKey make_key(cublasOperation_t op_a, cublasOperation_t op_b, int64_t m, int64_t n, int64_t k, int64_t lda,
                 int64_t ldb, int64_t ldd, cudaDataType ab_type, cudaDataType d_type, cublasComputeType_t compute,
                 const void* a, const void* b, const void* d, const void* c = nullptr) {
  return PlanKey{static_cast<int32_t>(op_a),
                 static_cast<int32_t>(op_b),
                 m,
                 n,
                 k,
                 lda,
                 ldb,
                 ldd,
                 static_cast<int32_t>(ab_type),
                 static_cast<int32_t>(d_type),
                 static_cast<int32_t>(compute),
                 alignment_of(a),
                 alignment_of(b),
                 alignment_of(c ? c : d),
                 alignment_of(d)};
}

}  // namespace

// ---------------------------------------------------------------------------------------------------

namespace {

// y = x · wᵀ (+ residual when given): linear_forward_cuda and linear_forward_residual_cuda.
void forward_gemm(const Call& c, const void* x, const void* w, const void* residual, void* y, void* stream) {
  ScopedRange range("linear.forward");
  check_shapes(c);
  const size_t e = dtype_size(c.act);
  const Arg ax{"x", x, c.n * c.in, e}, aw{"w", w, c.out * c.in, e}, ay{"y", y, c.n * c.out, e},
      ar{"residual", residual, c.n * c.out, e};
  const Arg* used[4] = {&ax, &aw, &ay, &ar};
  const int count = residual ? 4 : 3;
  for (int i = 0; i < count; ++i) check_not_null(c, *used[i]);
  for (int i = 0; i < count; ++i) check_alignment(c, *used[i]);
  check_disjoint(c, ay, ax);
  check_disjoint(c, ay, aw);
  if (residual) check_disjoint(c, ay, ar);
  if (c.n == 0) return;

  const int device = current_device(c);
  for (int i = 0; i < count; ++i) check_on_device(c, *used[i], device);

  // yᵀ [out, n] = Wᵀ · X (+ Rᵀ) with W = wᵀ [in, out] and X = xᵀ [in, n] (see the table at the top).
  const PlanKey key = make_key(CUBLAS_OP_T, CUBLAS_OP_N, /*m*/ c.out, /*n*/ c.n, /*k*/ c.in, /*lda*/ c.in,
                               /*ldb*/ c.in, /*ldd*/ c.out, cuda_type(c.act), cuda_type(c.act), compute_type(c),
                               /*A*/ w, /*B*/ x, /*D*/ y, /*C*/ residual);
  run_gemm(c, Product::forward, device, key, /*A*/ w, /*B*/ x, /*D*/ y, ay.bytes(), residual ? 1.0f : 0.0f, stream,
           residual);
}

}  // namespace

void linear_forward_cuda(const void* x, const void* w, void* y, int64_t n, int64_t in, int64_t out, DType act,
                         void* stream, bool allow_tf32) {
  forward_gemm(Call{"linear_forward_cuda", n, in, out, act, allow_tf32, false}, x, w, nullptr, y, stream);
}

void linear_forward_residual_cuda(const void* x, const void* w, const void* residual, void* y, int64_t n, int64_t in,
                                  int64_t out, DType act, void* stream, bool allow_tf32) {
  Call c{"linear_forward_residual_cuda", n, in, out, act, allow_tf32, false};
  c.residual = true;
  FLASHLM_CHECK(residual != nullptr, "{}: residual is null", c.fn);
  forward_gemm(c, x, w, residual, y, stream);
}

void linear_backward_cuda(const void* dy, const void* x, const void* w, void* dx, float* dw, int64_t n, int64_t in,
                          int64_t out, DType act, bool accumulate_dx, void* stream, bool allow_tf32,
                          bool accumulate_dw) {
  const Call c{"linear_backward_cuda", n, in, out, act, allow_tf32, accumulate_dx, accumulate_dw};
  ScopedRange range("linear.backward");
  check_shapes(c);
  const size_t e = dtype_size(act);
  const Arg ady{"dy", dy, n * out, e}, ax{"x", x, n * in, e}, aw{"w", w, out * in, e}, adx{"dx", dx, n * in, e},
      adw{"dw", dw, out * in, sizeof(float)};
  FLASHLM_CHECK(dx != nullptr || dw != nullptr, "{}: dx and dw are both null: nothing to compute", c.fn);
  check_not_null(c, ady);
  if (dx) check_not_null(c, aw);
  if (dw) check_not_null(c, ax);
  // The arrays this call reads or writes.
  const Arg* used[5];
  int count = 0;
  used[count++] = &ady;
  if (dx) {
    used[count++] = &aw;
    used[count++] = &adx;
  }
  if (dw) {
    used[count++] = &ax;
    used[count++] = &adw;
  }
  for (int i = 0; i < count; ++i) check_alignment(c, *used[i]);
  // dx is written before dw's product reads x and dy, so dx must not overlap them either.
  if (dx) {
    check_disjoint(c, adx, ady);
    check_disjoint(c, adx, aw);
    if (dw) {
      check_disjoint(c, adx, ax);
      check_disjoint(c, adx, adw);
    }
  }
  if (dw) {
    check_disjoint(c, adw, ady);
    check_disjoint(c, adw, ax);
    if (dx) check_disjoint(c, adw, aw);
  }
  const bool zero_dw = dw && !accumulate_dw;  // an empty product still overwrites dw, with zeros
  if (n == 0 && !zero_dw) return;

  const int device = current_device(c);
  for (int i = 0; i < count; ++i) check_on_device(c, *used[i], device);
  if (n == 0) {
    FLASHLM_CUDA_CHECK(cudaMemsetAsync(dw, 0, adw.bytes(), static_cast<cudaStream_t>(stream)),
                       fmt::format("{}: cudaMemsetAsync(dw)", c.fn));
    return;
  }

  if (dx) {
    // dxᵀ [in, n] = W · DY with W = wᵀ [in, out], DY = dyᵀ [out, n]; beta = 1 adds to dx.
    const PlanKey key = make_key(CUBLAS_OP_N, CUBLAS_OP_N, /*m*/ in, /*n*/ n, /*k*/ out, /*lda*/ in, /*ldb*/ out,
                                 /*ldd*/ in, cuda_type(act), cuda_type(act), compute_type(c), /*A*/ w, /*B*/ dy,
                                 /*D*/ dx);
    run_gemm(c, Product::grad_input, device, key, /*A*/ w, /*B*/ dy, /*D*/ dx, adx.bytes(), accumulate_dx ? 1.0f : 0.0f,
             stream);
  }
  if (dw) {
    // dwᵀ [in, out] += X · DYᵀ with X = xᵀ [in, n], DY = dyᵀ [out, n]: 16-bit A/B, fp32 C/D; beta = 0
    // overwrites (cuBLASLt reads no C then).
    const PlanKey key = make_key(CUBLAS_OP_N, CUBLAS_OP_T, /*m*/ in, /*n*/ out, /*k*/ n, /*lda*/ in, /*ldb*/ out,
                                 /*ldd*/ in, cuda_type(act), CUDA_R_32F, compute_type(c), /*A*/ x, /*B*/ dy, /*D*/ dw);
    run_gemm(c, Product::grad_weight, device, key, /*A*/ x, /*B*/ dy, /*D*/ dw, adw.bytes(),
             accumulate_dw ? 1.0f : 0.0f, stream);
  }
}

namespace {

// The distance from a to b in elements of e bytes when it is a whole, non-negative number of them and at
// least `span` (so that the two arrays of a pair are disjoint); -1 otherwise.
int64_t pair_stride(const void* a, const void* b, size_t e, int64_t span) {
  const intptr_t bytes = reinterpret_cast<intptr_t>(b) - reinterpret_cast<intptr_t>(a);
  if (bytes < 0 || bytes % intptr_t(e) != 0) return -1;
  const int64_t stride = int64_t(bytes / intptr_t(e));
  return stride >= span ? stride : -1;
}

void check_pair_args(const Call& c, std::initializer_list<const Arg*> inputs, std::initializer_list<const Arg*> outputs) {
  for (const Arg* a : inputs) check_not_null(c, *a);
  for (const Arg* a : outputs) check_not_null(c, *a);
  for (const Arg* a : inputs) check_alignment(c, *a);
  for (const Arg* a : outputs) check_alignment(c, *a);
  for (const Arg* o : outputs) {
    for (const Arg* i : inputs) check_disjoint(c, *o, *i);
  }
  check_disjoint(c, **outputs.begin(), **(outputs.begin() + 1));
}

void check_pair_on_device(const Call& c, std::initializer_list<const Arg*> args, int device) {
  for (const Arg* a : args) check_on_device(c, *a, device);
}

}  // namespace

void linear_forward_pair_cuda(const void* x, const void* w0, const void* w1, void* y0, void* y1, int64_t n,
                              int64_t in, int64_t out, DType act, void* stream) {
  const Call c{"linear_forward_pair_cuda", n, in, out, act, false, false};
  check_shapes(c);
  const size_t e = dtype_size(act);
  const Arg ax{"x", x, n * in, e}, aw0{"w0", w0, out * in, e}, aw1{"w1", w1, out * in, e}, ay0{"y0", y0, n * out, e},
      ay1{"y1", y1, n * out, e};
  check_pair_args(c, {&ax, &aw0, &aw1}, {&ay0, &ay1});
  if (n == 0) return;
  const int64_t sw = pair_stride(w0, w1, e, out * in), sy = pair_stride(y0, y1, e, n * out);
  if (sw >= 0 && sy >= 0) {
    ScopedRange range("linear.forward");
    const int device = current_device(c);
    check_pair_on_device(c, {&ax, &aw0, &aw1, &ay0, &ay1}, device);
    // The forward's product (the table at the top) twice: A = W_b at w0 + b·sw, the same X, D at y0 + b·sy.
    PlanKey key = make_key(CUBLAS_OP_T, CUBLAS_OP_N, /*m*/ out, /*n*/ n, /*k*/ in, /*lda*/ in, /*ldb*/ in,
                           /*ldd*/ out, cuda_type(act), cuda_type(act), compute_type(c), /*A*/ w0, /*B*/ x, /*D*/ y0);
    key.batch = 2;
    key.stride_a = sw;
    key.stride_d = sy;
    key.align_a = std::min(key.align_a, alignment_of(w1));
    key.align_c = key.align_d = std::min(key.align_d, alignment_of(y1));
    if (run_gemm(c, Product::forward, device, key, /*A*/ w0, /*B*/ x, /*D*/ y0, size_t(sy + n * out) * e, 0.0f, stream,
                 nullptr, /*may_decline*/ true)) {
      return;
    }
  }
  linear_forward_cuda(x, w0, y0, n, in, out, act, stream);
  linear_forward_cuda(x, w1, y1, n, in, out, act, stream);
}

void linear_weight_grad_pair_cuda(const void* dy0, const void* dy1, const void* x, float* dw0, float* dw1, int64_t n,
                                  int64_t in, int64_t out, DType act, bool accumulate_dw, void* stream) {
  const Call c{"linear_weight_grad_pair_cuda", n, in, out, act, false, false, accumulate_dw};
  check_shapes(c);
  const size_t e = dtype_size(act);
  const Arg ady0{"dy0", dy0, n * out, e}, ady1{"dy1", dy1, n * out, e}, ax{"x", x, n * in, e},
      adw0{"dw0", dw0, out * in, sizeof(float)}, adw1{"dw1", dw1, out * in, sizeof(float)};
  check_pair_args(c, {&ady0, &ady1, &ax}, {&adw0, &adw1});
  const int64_t sdy = pair_stride(dy0, dy1, e, n * out), sdw = pair_stride(dw0, dw1, sizeof(float), out * in);
  if (n > 0 && sdy >= 0 && sdw >= 0) {
    ScopedRange range("linear.backward");
    const int device = current_device(c);
    check_pair_on_device(c, {&ady0, &ady1, &ax, &adw0, &adw1}, device);
    // The weight gradient's product (the table at the top) twice: the same X, DY_b at dy0 + b·sdy, D at
    // dw0 + b·sdw (fp32); beta = 0 overwrites.
    PlanKey key = make_key(CUBLAS_OP_N, CUBLAS_OP_T, /*m*/ in, /*n*/ out, /*k*/ n, /*lda*/ in, /*ldb*/ out,
                           /*ldd*/ in, cuda_type(act), CUDA_R_32F, compute_type(c), /*A*/ x, /*B*/ dy0, /*D*/ dw0);
    key.batch = 2;
    key.stride_b = sdy;
    key.stride_d = sdw;
    key.align_b = std::min(key.align_b, alignment_of(dy1));
    key.align_c = key.align_d = std::min(key.align_d, alignment_of(dw1));
    if (run_gemm(c, Product::grad_weight, device, key, /*A*/ x, /*B*/ dy0, /*D*/ dw0,
                 size_t(sdw + out * in) * sizeof(float), accumulate_dw ? 1.0f : 0.0f, stream, nullptr,
                 /*may_decline*/ true)) {
      return;
    }
  }
  linear_backward_cuda(dy0, x, nullptr, nullptr, dw0, n, in, out, act, false, stream, false, accumulate_dw);
  linear_backward_cuda(dy1, x, nullptr, nullptr, dw1, n, in, out, act, false, stream, false, accumulate_dw);
}

void fp8_gemm_cuda(const Fp8Operand& p, const Fp8Operand& q, void* d, DType out, int64_t rows, int64_t cols,
                   int64_t k, float beta, const void* residual, void* stream) {
  Call c{"fp8_gemm_cuda", rows, k, cols, out, false, false, beta != 0.0f, residual != nullptr};
  c.fp8_p = p.format;
  c.fp8_q = q.format;
  ScopedRange range("linear.fp8");
  FLASHLM_CHECK(out == DType::bf16 || out == DType::f32, "{}: out = {}, expected bf16 or fp32", c.fn, dtype_name(out));
  FLASHLM_CHECK(!(p.format == Fp8Format::e5m2 && q.format == Fp8Format::e5m2),
                "{}: p and q are both e5m2; cuBLASLt multiplies e4m3 · e4m3, e4m3 · e5m2 or e5m2 · e4m3", c.fn);
  FLASHLM_CHECK(beta == 0.0f || beta == 1.0f, "{}: beta = {}, expected 0 or 1", c.fn, beta);
  FLASHLM_CHECK(rows >= 1 && cols >= 1 && k >= 1, "{}: rows = {}, cols = {}, k = {}, expected >= 1", c.fn, rows, cols, k);
  FLASHLM_CHECK(rows % 16 == 0 && cols % 16 == 0 && k % 16 == 0,
                "{}: rows = {}, cols = {}, k = {} must be multiples of 16 (cuBLASLt's FP8 kernels)", c.fn, rows, cols, k);
  constexpr int64_t kMax = int64_t{1} << 40;
  FLASHLM_CHECK(rows <= kMax / k && cols <= kMax / k && rows <= kMax / cols, "{}: rows = {}, cols = {}, k = {}: arrays too large",
                c.fn, rows, cols, k);
  const Arg ap{"p", p.data, rows * k, 1}, aq{"q", q.data, cols * k, 1}, ad{"d", d, rows * cols, dtype_size(out)},
      ar{"residual", residual, rows * cols, dtype_size(out)}, asp{"p.dequant", p.dequant, 1, 4},
      asq{"q.dequant", q.dequant, 1, 4};
  std::vector<const Arg*> used = {&ap, &aq, &ad, &asp, &asq};
  if (residual) used.push_back(&ar);
  for (const Arg* a : used) check_not_null(c, *a);
  for (const Arg* a : {&ap, &aq, &ad}) {
    FLASHLM_CHECK(alignment_of(a->ptr) >= 16, "{}: {} = {} is not 16-byte aligned (cuBLASLt's FP8 kernels)", c.fn,
                  a->name, a->ptr);
  }
  if (residual) {
    FLASHLM_CHECK(alignment_of(residual) >= 16, "{}: residual = {} is not 16-byte aligned", c.fn, residual);
    check_disjoint(c, ad, ar);
  }
  check_disjoint(c, ad, ap);
  check_disjoint(c, ad, aq);
  const int device = current_device(c);
  for (const Arg* a : used) check_on_device(c, *a, device);

  // dᵀ [cols, rows] = Qᵀ · P with Q = qᵀ [k, cols] and P = pᵀ [k, rows] column-major: the forward's "TN" row
  // of the table at the top, with A = q and B = p.
  const auto fp8_type = [](Fp8Format f) { return f == Fp8Format::e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; };
  PlanKey key = make_key(CUBLAS_OP_T, CUBLAS_OP_N, /*m*/ cols, /*n*/ rows, /*k*/ k, /*lda*/ k, /*ldb*/ k,
                         /*ldd*/ cols, fp8_type(q.format), cuda_type(out), CUBLAS_COMPUTE_32F, /*A*/ q.data,
                         /*B*/ p.data, /*D*/ d, /*C*/ residual);
  key.b_type = static_cast<int32_t>(fp8_type(p.format));
  run_gemm(c, Product::fp8, device, key, /*A*/ q.data, /*B*/ p.data, d, ad.bytes(), beta, stream, residual,
           /*may_decline*/ false, /*a_scale*/ q.dequant, /*b_scale*/ p.dequant);
}

void set_gemm_autotune(int candidates) {
  FLASHLM_CHECK(candidates >= 0 && candidates <= kMaxAutotune, "set_gemm_autotune: {} candidates, expected 0 to {}",
                candidates, kMaxAutotune);
  g_autotune.store(candidates, std::memory_order_relaxed);
}

int gemm_autotune() { return g_autotune.load(std::memory_order_relaxed); }

std::vector<GemmTuning> gemm_autotune_results() {
  const std::lock_guard lock(g_tunings_mutex);
  return tunings();
}

int64_t gemm_cuda_heuristic_queries() { return g_heuristic_queries.load(std::memory_order_relaxed); }

}  // namespace flashlm
