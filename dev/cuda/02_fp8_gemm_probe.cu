// Which cuBLASLt FP8 configuration runs on this GPU: the descriptors fp8_gemm_cuda (src/model/cuda/gemm.cpp)
// builds for d (bf16) = p (e4m3) · q (e4m3)ᵀ, and one change at a time (C null, no alignment preferences, fast
// accumulation, no scale pointers, fp32 D, every algorithm the heuristic offers, the A scale pointer's alignment),
// with a bf16 control. Issue 32: on an H100 (2026-12-06, cuBLASLt 13.1) the heuristic answered and cublasLtMatmul
// said NOT_SUPPORTED for every row whose A scale pointer sat 4 bytes past an aligned address (the first seven).
// A probe, not an A/B: it prints which calls run, not times.
//   nvcc -std=c++17 -O1 -gencode=arch=compute_90a,code=sm_90a dev/cuda/02_fp8_gemm_probe.cu -o /tmp/fp8_probe \
//     -lcublasLt && CUBLASLT_LOG_LEVEL=3 /tmp/fp8_probe
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>

#define CK(x) do { auto e_ = (x); if (e_) { std::printf("  %s -> %d\n", #x, int(e_)); } } while (0)

struct Variant { const char* name; bool c_null, no_align, fast_accum, no_scales, d_fp32, bf16_inputs, all_algos; int a_scale_offset = 1; };

int main() {
  cublasLtHandle_t h; CK(cublasLtCreate(&h));
  std::printf("cublasLt version %zu, cudart %zu\n", cublasLtGetVersion(), cublasLtGetCudartVersion());
  const int sizes[][3] = {{16, 16, 16}, {256, 384, 512}};
  void *a, *b, *d, *ws; float* scales;
  cudaMalloc(&a, 1 << 20); cudaMalloc(&b, 1 << 20); cudaMalloc(&d, 4 << 20); cudaMalloc(&ws, 32 << 20);
  cudaMalloc(&scales, 256);
  cudaMemset(a, 0x38, 1 << 20); cudaMemset(b, 0x38, 1 << 20);
  std::vector<float> one(8, 1.0f); cudaMemcpy(scales, one.data(), 32, cudaMemcpyHostToDevice);
  const Variant vs[] = {
      {"ours (C = D, alignment prefs, scales)", false, false, false, false, false, false, false},
      {"C = nullptr", true, false, false, false, false, false, false},
      {"no alignment prefs", false, true, false, false, false, false, false},
      {"fast accumulation", false, false, true, false, false, false, false},
      {"no scale pointers", false, false, false, true, false, false, false},
      {"D fp32", false, false, false, false, true, false, false},
      {"every heuristic algo, C = nullptr", true, true, false, false, false, false, true},
      {"bf16 inputs (control)", false, false, false, true, false, true, false},
      {"A scale 8-byte aligned", false, false, false, false, false, false, false, 2},
      {"A scale 16-byte aligned", false, false, false, false, false, false, false, 4},
      {"A scale 256-byte aligned", false, false, false, false, false, false, false, 64},
  };
  for (auto& s : sizes) {
    const int m = s[1], n = s[0], k = s[2];  // column-major: D [m, n] = op(A) [m, k] · B [k, n], A stored [k, m]
    for (const Variant& v : vs) {
      const cudaDataType ab = v.bf16_inputs ? CUDA_R_16BF : CUDA_R_8F_E4M3, dt = v.d_fp32 ? CUDA_R_32F : CUDA_R_16BF;
      cublasLtMatmulDesc_t desc; CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
      if (!v.no_scales) {
        const float* sa = scales + v.a_scale_offset; const float* sb = scales;
        CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa));
        CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb));
      }
      if (v.fast_accum) { int8_t f = 1; CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &f, sizeof f)); }
      cublasLtMatrixLayout_t la, lb, ld;
      CK(cublasLtMatrixLayoutCreate(&la, ab, k, m, k));
      CK(cublasLtMatrixLayoutCreate(&lb, ab, k, n, k));
      CK(cublasLtMatrixLayoutCreate(&ld, dt, m, n, m));
      cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
      uint64_t wsb = 32 << 20;
      CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
      if (!v.no_align) {
        uint32_t al = 256;
        for (auto at : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
          CK(cublasLtMatmulPreferenceSetAttribute(pref, at, &al, sizeof al));
      }
      cublasLtMatmulHeuristicResult_t res[16] = {}; int found = 0;
      const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, v.all_algos ? 16 : 1, res, &found);
      const float alpha = 1, beta = 0;
      int ok = 0, tried = 0; cublasStatus_t first = CUBLAS_STATUS_SUCCESS;
      for (int i = 0; i < found; ++i) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
        ++tried;
        const cublasStatus_t ms = cublasLtMatmul(h, desc, &alpha, a, la, b, lb, &beta, v.c_null ? nullptr : d, ld, d, ld,
                                                 &res[i].algo, ws, wsb, 0);
        if (ms == CUBLAS_STATUS_SUCCESS) ++ok; else if (first == CUBLAS_STATUS_SUCCESS) first = ms;
      }
      const cudaError_t ce = cudaDeviceSynchronize();
      std::printf("%dx%dx%d %-40s heuristic %d found %d: %d of %d algos ran (first failure %d) %s\n", n, m, k, v.name,
                  int(hs), found, ok, tried, int(first), cudaGetErrorString(ce));
      cublasLtMatmulPreferenceDestroy(pref); cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb);
      cublasLtMatrixLayoutDestroy(ld); cublasLtMatmulDescDestroy(desc);
    }
  }
  return 0;
}
