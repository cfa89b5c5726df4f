// The plans of cuda/gemm.cpp's GEMMs (gemm_plan.h): descriptors and layouts, the heuristic's query and the
// opt-in autotuning among its candidates, and the state behind set_gemm_autotune. Host code only.
#include "model/cuda/gemm_plan.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/cuda_check.h"
#include "flashlm/error.h"
#include "model/cuda/gemm.h"

namespace flashlm {

namespace gemm_detail {

namespace {

std::atomic<int64_t> g_heuristic_queries{0};
std::atomic<int> g_autotune{0};  // set_gemm_autotune
constexpr int kMaxAutotune = 64;
constexpr int kTimedRuns = 5;  // per candidate, after one untimed run

std::mutex g_tunings_mutex;
std::vector<GemmTuning>& tunings() {
  static auto* all = new std::vector<GemmTuning>();  // leaked on purpose, as gemm.cpp's per-device state
  return *all;
}

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

}  // namespace

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
      return fmt::format("dw[{}, {}] ({}) {} dy[{}, {}]ᵀ · x[{}, {}] ({}{})", c.out, c.in, dtype_name(c.dw),
                         c.accumulate_dw ? "+=" : "=", c.n, c.out, c.n, c.in, t, tf32);
    case Product::fp8:
      return fmt::format("d[{}, {}] ({}) {} p[{}, {}] ({}{}) · q[{}, {}]ᵀ ({}{}){}", c.n, c.out, t,
                         c.accumulate_dw ? "+=" : "=", c.n, c.in, fp8_format_name(c.fp8_p),
                         c.fp8_p_per_row ? ", per-row scales" : "", c.out, c.in, fp8_format_name(c.fp8_q),
                         c.fp8_q_per_row ? ", per-row scales" : "", c.residual ? " + residual" : "");
  }
  return "?";
}

[[noreturn]] void throw_blas(const Call& c, Product p, const char* call, cublasStatus_t s) {
  throw CudaError(
      fmt::format("{}: {} failed: {} [status {}] for {}", c.fn, call, status_name(s), int(s), describe(c, p)));
}

void set_scales(cublasLtMatmulDesc_t desc, const float* a_scale, const float* b_scale, const Call& c, Product p) {
  if (!a_scale && !b_scale) return;
  const std::pair<cublasLtMatmulDescAttributes_t, const float*> scales[] = {
      {CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale}, {CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale}};
  for (const auto& [attr, ptr] : scales) {
    const cublasStatus_t set = cublasLtMatmulDescSetAttribute(desc, attr, &ptr, sizeof(ptr));
    if (set != CUBLAS_STATUS_SUCCESS) throw_blas(c, p, "cublasLtMatmulDescSetAttribute(A/B_SCALE_POINTER)", set);
  }
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
  // Outer-vector scaling (rowwise FP8) only where asked: tensorwise descriptors stay as they were.
  const std::pair<cublasLtMatmulDescAttributes_t, int32_t> scale_modes[] = {
      {CUBLASLT_MATMUL_DESC_A_SCALE_MODE, key.a_scale_mode}, {CUBLASLT_MATMUL_DESC_B_SCALE_MODE, key.b_scale_mode}};
  for (const auto& [attr, mode] : scale_modes) {
    if (mode != 0) {
      check(cublasLtMatmulDescSetAttribute(plan.desc, attr, &mode, sizeof(mode)),
            "cublasLtMatmulDescSetAttribute(A/B_SCALE_MODE)");
    }
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

}  // namespace gemm_detail

using gemm_detail::g_autotune;
using gemm_detail::g_heuristic_queries;
using gemm_detail::g_tunings_mutex;
using gemm_detail::kMaxAutotune;
using gemm_detail::tunings;

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
