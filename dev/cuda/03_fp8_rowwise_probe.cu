// Does cuBLASLt run FP8 training's three products with outer-vector scaling (the "rowwise" recipe, issue 32),
// and are the results right? fp8_gemm_cuda (src/model/cuda/gemm.cpp) computes every product of an FP8 linear
// layer as d [rows, cols] = p [rows, k] · q [cols, k]ᵀ, handed to cuBLASLt column-major as
// D [cols, rows] = op(A = q)ᵀ · B = p ("TN"). With CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F on A and B, the
// A scale is a vector of M = cols floats (one per row of q) and the B scale one of N = rows floats (one per row
// of p), and D (i, j) is multiplied by a_scale[i] · b_scale[j]. Fp8Linear's three products:
//   forward  y  [T, N] = x [T, K] · w [N, K]ᵀ        p = x (e4m3, per token),  q = w (e4m3, per output channel)
//   dgrad    dx [T, K] = dy [T, N] · wᵀ [K, N]ᵀ     p = dy (gradient format, per token), q = wᵀ (e4m3, per input column)
//   wgrad    dw [N, K] = dyᵀ [N, T] · xᵀ [K, T]ᵀ    p = dyᵀ (per output channel), q = xᵀ (per input column), fp32 out
// Each row builds that descriptor (bf16 or fp32 D, fp32 compute, with and without fast accumulation, C = D or a
// residual as the library passes it), asks the heuristic for one algorithm, runs cublasLtMatmul, and compares D
// with a host fp64 product of the same FP8 values times the two scale vectors (+ beta · C). Printed: the
// heuristic's and the matmul's status, the max relative error over elements whose reference is at least 1% of
// the largest, and the largest error over its tolerance, tests/model/test_fp8_cuda.cpp's: 2^-8 · s + u · |ref|
// (+ u · |c|) with s the same product over the magnitudes and u the output's rounding (bf16 2^-8, fp32 0); the
// 2^-8 · s is room for Hopper's FP8 accumulation, which is narrower than fp32 between promotions. With fast
// accumulation (no promotions) 2^-5 · s, a guess. The verdict is "ok" when that ratio is at most 1 (a wrong
// layout, vector or mode is off by far more). A tensorwise (scalar) row per shape is the harness's control,
// and one row puts a scale vector 4 bytes past an aligned address (the scalar scale needed 16-byte alignment,
// dev/cuda/02_fp8_gemm_probe.cu). A probe, not an A/B: no times.
//   nvcc -std=c++17 -O1 -gencode=arch=compute_90a,code=sm_90a dev/cuda/03_fp8_rowwise_probe.cu \
//     -o /tmp/fp8_rowwise_probe -lcublasLt && CUBLASLT_LOG_LEVEL=2 /tmp/fp8_rowwise_probe
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#define CUDA_CK(x)                                                                             \
  do {                                                                                         \
    const cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                                   \
      std::printf("%s:%d: %s -> %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));        \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

// A descriptor attribute that must be accepted: a refusal is reported and the row fails.
#define LT_CK(x, ok)                                                                           \
  do {                                                                                         \
    const cublasStatus_t s_ = (x);                                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
      std::printf("  %s -> status %d\n", #x, int(s_));                                         \
      ok = false;                                                                              \
    }                                                                                          \
  } while (0)

namespace {

enum class Fmt { e4m3, e5m2 };

uint8_t encode(float v, Fmt f) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, f == Fmt::e4m3 ? __NV_E4M3 : __NV_E5M2);
}
double decode(uint8_t b, Fmt f) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(b, f == Fmt::e4m3 ? __NV_E4M3 : __NV_E5M2);
  return double(__half2float(__half(h)));
}
cudaDataType fp8_type(Fmt f) { return f == Fmt::e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }
const char* fmt_name(Fmt f) { return f == Fmt::e4m3 ? "e4m3" : "e5m2"; }

struct Case {
  const char* product;  // forward, dgrad, wgrad
  int rows, cols, k;    // d [rows, cols] = p [rows, k] · q [cols, k]ᵀ
  Fmt pf, qf;
  bool d_fp32;
  bool fast_accum;
  bool vector_scales = true;     // false: tensorwise scalars (the control)
  bool residual = false;         // beta = 1 with C a separate array (the forward's residual)
  bool accumulate = false;       // beta = 1 with C = D (dx +=, dw +=)
  int b_scale_offset_floats = 0; // the B (p) scale vector this many floats past a 256-byte aligned address
};

struct Outcome {
  cublasStatus_t heuristic = CUBLAS_STATUS_SUCCESS, matmul = CUBLAS_STATUS_SUCCESS;
  int found = 0;
  bool attrs_ok = true;
  double max_rel = -1;     // over elements at least 1% of the largest
  double worst_ratio = -1; // the largest error / tolerance
  const char* cuda = "";
};

std::mt19937 rng(1234);

// FP8 bytes of values spread over the format's range (a scaled normal, as a cast leaves them), clamped.
std::vector<uint8_t> random_fp8(size_t n, Fmt f) {
  std::normal_distribution<float> nd(0.0f, f == Fmt::e4m3 ? 96.0f : 8192.0f);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = encode(nd(rng), f);
  return v;
}

// Dequantisation scales as rowwise casts produce them: 1 / (fp8_max / amax) over a few orders of magnitude.
std::vector<float> random_scales(size_t n) {
  std::uniform_real_distribution<float> e(-12.0f, 2.0f);
  std::vector<float> v(n);
  for (auto& s : v) s = std::exp2(e(rng));
  return v;
}

Outcome run(cublasLtHandle_t h, const Case& c, void* ws, size_t ws_bytes) {
  Outcome o;
  const int m = c.cols, n = c.rows, k = c.k;  // column-major D [m, n] = op(A) [m, k] · B [k, n]
  const std::vector<uint8_t> p = random_fp8(size_t(n) * k, c.pf), q = random_fp8(size_t(m) * k, c.qf);
  const std::vector<float> a_scale = c.vector_scales ? random_scales(m) : random_scales(1);
  const std::vector<float> b_scale = c.vector_scales ? random_scales(n) : random_scales(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> c_host(size_t(m) * n);
  for (auto& v : c_host) v = nd(rng);
  const bool has_c = c.residual || c.accumulate;

  // The reference, d [rows, cols] row-major = D column-major [m = cols, n = rows].
  std::vector<double> pd(p.size()), qd(q.size());
  for (size_t i = 0; i < p.size(); ++i) pd[i] = decode(p[i], c.pf);
  for (size_t i = 0; i < q.size(); ++i) qd[i] = decode(q[i], c.qf);
  std::vector<double> ref(size_t(m) * n), mag(ref.size()), cref(ref.size());
  for (int r = 0; r < n; ++r) {
    for (int col = 0; col < m; ++col) {
      double acc = 0, acc_abs = 0;
      for (int i = 0; i < k; ++i) {
        acc += pd[size_t(r) * k + i] * qd[size_t(col) * k + i];
        acc_abs += std::fabs(pd[size_t(r) * k + i] * qd[size_t(col) * k + i]);
      }
      const double sa = a_scale[c.vector_scales ? col : 0], sb = b_scale[c.vector_scales ? r : 0];
      // C as the GPU reads it: rounded to D's type first.
      const float cv = c.d_fp32 ? c_host[size_t(r) * m + col]
                                : __bfloat162float(__float2bfloat16(c_host[size_t(r) * m + col]));
      ref[size_t(r) * m + col] = acc * sa * sb + (has_c ? double(cv) : 0.0);
      mag[size_t(r) * m + col] = acc_abs * sa * sb;
      cref[size_t(r) * m + col] = has_c ? double(cv) : 0.0;
    }
  }

  const size_t d_elem = c.d_fp32 ? 4 : 2;
  uint8_t *dp, *dq;
  void *dd, *dc;
  float *das, *dbs;
  CUDA_CK(cudaMalloc(&dp, p.size()));
  CUDA_CK(cudaMalloc(&dq, q.size()));
  CUDA_CK(cudaMalloc(&dd, size_t(m) * n * d_elem));
  CUDA_CK(cudaMalloc(&dc, size_t(m) * n * d_elem));
  CUDA_CK(cudaMalloc(&das, a_scale.size() * 4 + 256));
  CUDA_CK(cudaMalloc(&dbs, b_scale.size() * 4 + 256));
  float* bs_ptr = dbs + c.b_scale_offset_floats;
  CUDA_CK(cudaMemcpy(dp, p.data(), p.size(), cudaMemcpyHostToDevice));
  CUDA_CK(cudaMemcpy(dq, q.data(), q.size(), cudaMemcpyHostToDevice));
  CUDA_CK(cudaMemcpy(das, a_scale.data(), a_scale.size() * 4, cudaMemcpyHostToDevice));
  CUDA_CK(cudaMemcpy(bs_ptr, b_scale.data(), b_scale.size() * 4, cudaMemcpyHostToDevice));
  {
    std::vector<uint8_t> cbytes(size_t(m) * n * d_elem);
    for (size_t i = 0; i < c_host.size(); ++i) {
      if (c.d_fp32) {
        std::memcpy(&cbytes[i * 4], &c_host[i], 4);
      } else {
        const __nv_bfloat16 b = __float2bfloat16(c_host[i]);
        std::memcpy(&cbytes[i * 2], &b, 2);
      }
    }
    CUDA_CK(cudaMemcpy(c.residual ? dc : dd, cbytes.data(), cbytes.size(), cudaMemcpyHostToDevice));
  }
  if (!c.accumulate) CUDA_CK(cudaMemset(dd, 0xff, size_t(m) * n * d_elem));  // NaN: a row left unwritten shows

  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatmulPreference_t pref;
  LT_CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), o.attrs_ok);
  const int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  LT_CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), o.attrs_ok);
  LT_CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), o.attrs_ok);
  if (c.vector_scales) {
    const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    LT_CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode), o.attrs_ok);
    LT_CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode), o.attrs_ok);
  }
  const float* sa = das;
  const float* sb = bs_ptr;
  LT_CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa), o.attrs_ok);
  LT_CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb), o.attrs_ok);
  const int8_t fast = c.fast_accum ? 1 : 0;
  LT_CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast), o.attrs_ok);
  const cudaDataType dt = c.d_fp32 ? CUDA_R_32F : CUDA_R_16BF;
  LT_CK(cublasLtMatrixLayoutCreate(&la, fp8_type(c.qf), k, m, k), o.attrs_ok);
  LT_CK(cublasLtMatrixLayoutCreate(&lb, fp8_type(c.pf), k, n, k), o.attrs_ok);
  LT_CK(cublasLtMatrixLayoutCreate(&ld, dt, m, n, m), o.attrs_ok);
  LT_CK(cublasLtMatmulPreferenceCreate(&pref), o.attrs_ok);
  const uint64_t wsb = ws_bytes;
  LT_CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb),
        o.attrs_ok);
  // As the library does: the operands' pointer alignments (cudaMalloc: 256).
  const uint32_t al = 256;
  for (auto at : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    LT_CK(cublasLtMatmulPreferenceSetAttribute(pref, at, &al, sizeof al), o.attrs_ok);
  }

  cublasLtMatmulHeuristicResult_t res{};
  o.heuristic = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, &res, &o.found);
  if (o.attrs_ok && o.heuristic == CUBLAS_STATUS_SUCCESS && o.found > 0) {
    const float alpha = 1, beta = has_c ? 1 : 0;
    o.matmul = cublasLtMatmul(h, desc, &alpha, dq, la, dp, lb, &beta, c.residual ? dc : dd, ld, dd, ld, &res.algo, ws,
                              ws_bytes, nullptr);
    const cudaError_t ce = cudaDeviceSynchronize();
    o.cuda = cudaGetErrorString(ce);
    if (o.matmul == CUBLAS_STATUS_SUCCESS && ce == cudaSuccess) {
      std::vector<uint8_t> out(size_t(m) * n * d_elem);
      CUDA_CK(cudaMemcpy(out.data(), dd, out.size(), cudaMemcpyDeviceToHost));
      double largest = 0;
      for (double v : ref) largest = std::max(largest, std::fabs(v));
      o.max_rel = 0;
      o.worst_ratio = 0;
      const double acc_bound = c.fast_accum ? 0x1p-5 : 0x1p-8, u = c.d_fp32 ? 0.0 : 0x1p-8;
      for (size_t i = 0; i < ref.size(); ++i) {
        double got;
        if (c.d_fp32) {
          float f;
          std::memcpy(&f, &out[i * 4], 4);
          got = f;
        } else {
          __nv_bfloat16 b;
          std::memcpy(&b, &out[i * 2], 2);
          got = __bfloat162float(b);
        }
        if (!std::isfinite(got)) {
          o.max_rel = o.worst_ratio = INFINITY;
          break;
        }
        const double err = std::fabs(got - ref[i]);
        if (std::fabs(ref[i]) >= 0.01 * largest) o.max_rel = std::max(o.max_rel, err / std::fabs(ref[i]));
        // u · (|ref| + |product| + |c|): an algorithm may round the product to the output type before adding C.
        const double tol = acc_bound * mag[i] + u * (std::fabs(ref[i]) + std::fabs(ref[i] - cref[i]) + std::fabs(cref[i])) + 1e-30;
        o.worst_ratio = std::max(o.worst_ratio, err / tol);
      }
    }
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  cudaFree(dp), cudaFree(dq), cudaFree(dd), cudaFree(dc), cudaFree(das), cudaFree(dbs);
  return o;
}

}  // namespace

int main() {
  cublasLtHandle_t h;
  if (cublasLtCreate(&h) != CUBLAS_STATUS_SUCCESS) {
    std::printf("cublasLtCreate failed\n");
    return 1;
  }
  cudaDeviceProp prop{};
  CUDA_CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s (sm_%d%d), cublasLt %zu, cudart %zu\n", prop.name, prop.major, prop.minor, cublasLtGetVersion(),
              cublasLtGetCudartVersion());
  const size_t ws_bytes = size_t{32} << 20;
  void* ws;
  CUDA_CK(cudaMalloc(&ws, ws_bytes));

  // (T, N, K): tokens, output and input features; a small ragged one and one of a few tiles.
  const int shapes[][3] = {{48, 32, 80}, {256, 384, 512}};
  std::vector<Case> cases;
  for (const auto& s : shapes) {
    const int T = s[0], N = s[1], K = s[2];
    for (const bool fast : {false, true}) {
      cases.push_back({"forward", T, N, K, Fmt::e4m3, Fmt::e4m3, false, fast});
      cases.push_back({"forward+residual", T, N, K, Fmt::e4m3, Fmt::e4m3, false, fast, true, true});
      for (const Fmt g : {Fmt::e4m3, Fmt::e5m2}) {
        cases.push_back({"dgrad", T, K, N, g, Fmt::e4m3, false, fast});
        cases.push_back({"dgrad +=", T, K, N, g, Fmt::e4m3, false, fast, true, false, true});
        cases.push_back({"wgrad (fp32)", N, K, T, g, Fmt::e4m3, true, fast});
        cases.push_back({"wgrad += (fp32)", N, K, T, g, Fmt::e4m3, true, fast, true, false, true});
      }
    }
    cases.push_back({"forward, scalar (control)", T, N, K, Fmt::e4m3, Fmt::e4m3, false, false, false});
    cases.push_back({"forward, B vector 4 B past aligned", T, N, K, Fmt::e4m3, Fmt::e4m3, false, false, true, false,
                     false, 1});
    cases.push_back({"forward, B vector 8 B past aligned", T, N, K, Fmt::e4m3, Fmt::e4m3, false, false, true, false,
                     false, 2});
  }

  std::printf("%-36s %-15s %-9s %-4s %-9s %-9s %-7s %-12s %-12s %s\n", "product", "rows×cols×k", "p·q", "fast",
              "heuristic", "matmul", "found", "max rel err", "err/tol", "verdict");
  int failed = 0;
  for (const Case& c : cases) {
    const Outcome o = run(h, c, ws, ws_bytes);
    const bool ran = o.attrs_ok && o.heuristic == CUBLAS_STATUS_SUCCESS && o.found > 0 &&
                     o.matmul == CUBLAS_STATUS_SUCCESS && o.worst_ratio >= 0;
    const bool pass = ran && o.worst_ratio <= 1.0;
    failed += !pass && c.b_scale_offset_floats == 0;  // the misaligned rows ask a question, they cannot fail
    char shape[32], types[16];
    std::snprintf(shape, sizeof shape, "%d×%d×%d", c.rows, c.cols, c.k);
    std::snprintf(types, sizeof types, "%s·%s", fmt_name(c.pf), fmt_name(c.qf));
    std::printf("%-36s %-15s %-9s %-4s %-9d %-9d %-7d %-12.3g %-12.3g %s%s%s\n", c.product, shape, types,
                c.fast_accum ? "yes" : "no", int(o.heuristic), int(o.matmul), o.found, o.max_rel, o.worst_ratio,
                pass ? "ok" : ran ? "WRONG" : "did not run", *o.cuda && std::strcmp(o.cuda, "no error") ? " " : "",
                *o.cuda && std::strcmp(o.cuda, "no error") ? o.cuda : "");
  }
  std::printf("%d rows failed, misaligned rows not counted (err/tol > 1 or did not run; see the top for the "
              "tolerance)\n",
              failed);
  cudaFree(ws);
  cublasLtDestroy(h);
  return failed == 0 ? 0 : 1;
}
