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
#include <compare>
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
#include "model/cuda/gemm_plan.h"
#include "model/fp8.h"

namespace flashlm {

namespace {

using namespace gemm_detail;  // the plans (gemm_plan.h)

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

// A weight gradient in fp32 whatever act is, or in bf16 from bf16 operands (a GEMM of fp32 or fp16 operands
// into bf16 is no path the model takes).
void check_weight_grad(const Call& c) {
  FLASHLM_CHECK(c.dw == DType::f32 || (c.dw == DType::bf16 && c.act == DType::bf16),
                "{}: dw is {} with act {}; expected fp32 dw, or bf16 dw with bf16 act", c.fn, dtype_name(c.dw),
                dtype_name(c.act));
}

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
// Keys of the plans (gemm_plan.h): everything cuBLASLt needs for one (product, shapes, dtypes, alignments).

cudaDataType cuda_type(DType t) {
  switch (t) {
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
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

void linear_backward_cuda(const void* dy, const void* x, const void* w, void* dx, WeightGrad dw, int64_t n, int64_t in,
                          int64_t out, DType act, bool accumulate_dx, void* stream, bool allow_tf32,
                          bool accumulate_dw) {
  Call c{"linear_backward_cuda", n, in, out, act, allow_tf32, accumulate_dx, accumulate_dw};
  c.dw = dw.dtype;
  ScopedRange range("linear.backward");
  check_shapes(c);
  check_weight_grad(c);
  const size_t e = dtype_size(act);
  const Arg ady{"dy", dy, n * out, e}, ax{"x", x, n * in, e}, aw{"w", w, out * in, e}, adx{"dx", dx, n * in, e},
      adw{"dw", dw.data, out * in, dtype_size(dw.dtype)};
  FLASHLM_CHECK(dx != nullptr || dw.data != nullptr, "{}: dx and dw are both null: nothing to compute", c.fn);
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
    FLASHLM_CUDA_CHECK(cudaMemsetAsync(dw.data, 0, adw.bytes(), static_cast<cudaStream_t>(stream)),
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
    // dwᵀ [in, out] += X · DYᵀ with X = xᵀ [in, n], DY = dyᵀ [out, n]: 16-bit A/B, fp32 (or bf16) C/D;
    // beta = 0 overwrites (cuBLASLt reads no C then).
    const PlanKey key = make_key(CUBLAS_OP_N, CUBLAS_OP_T, /*m*/ in, /*n*/ out, /*k*/ n, /*lda*/ in, /*ldb*/ out,
                                 /*ldd*/ in, cuda_type(act), cuda_type(dw.dtype), compute_type(c), /*A*/ x, /*B*/ dy,
                                 /*D*/ dw.data);
    run_gemm(c, Product::grad_weight, device, key, /*A*/ x, /*B*/ dy, /*D*/ dw.data, adw.bytes(),
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

void linear_weight_grad_pair_cuda(const void* dy0, const void* dy1, const void* x, WeightGrad dw0, WeightGrad dw1,
                                  int64_t n, int64_t in, int64_t out, DType act, bool accumulate_dw, void* stream) {
  Call c{"linear_weight_grad_pair_cuda", n, in, out, act, false, false, accumulate_dw};
  c.dw = dw0.dtype;
  check_shapes(c);
  check_weight_grad(c);
  FLASHLM_CHECK(dw1.dtype == dw0.dtype, "{}: dw0 is {} but dw1 is {}: a pair's gradients share a dtype", c.fn,
                dtype_name(dw0.dtype), dtype_name(dw1.dtype));
  const size_t e = dtype_size(act), ew = dtype_size(dw0.dtype);
  const Arg ady0{"dy0", dy0, n * out, e}, ady1{"dy1", dy1, n * out, e}, ax{"x", x, n * in, e},
      adw0{"dw0", dw0.data, out * in, ew}, adw1{"dw1", dw1.data, out * in, ew};
  check_pair_args(c, {&ady0, &ady1, &ax}, {&adw0, &adw1});
  const int64_t sdy = pair_stride(dy0, dy1, e, n * out), sdw = pair_stride(dw0.data, dw1.data, ew, out * in);
  if (n > 0 && sdy >= 0 && sdw >= 0) {
    ScopedRange range("linear.backward");
    const int device = current_device(c);
    check_pair_on_device(c, {&ady0, &ady1, &ax, &adw0, &adw1}, device);
    // The weight gradient's product (the table at the top) twice: the same X, DY_b at dy0 + b·sdy, D at
    // dw0 + b·sdw (fp32, or bf16); beta = 0 overwrites.
    PlanKey key = make_key(CUBLAS_OP_N, CUBLAS_OP_T, /*m*/ in, /*n*/ out, /*k*/ n, /*lda*/ in, /*ldb*/ out,
                           /*ldd*/ in, cuda_type(act), cuda_type(dw0.dtype), compute_type(c), /*A*/ x, /*B*/ dy0,
                           /*D*/ dw0.data);
    key.batch = 2;
    key.stride_b = sdy;
    key.stride_d = sdw;
    key.align_b = std::min(key.align_b, alignment_of(dy1));
    key.align_c = key.align_d = std::min(key.align_d, alignment_of(dw1.data));
    if (run_gemm(c, Product::grad_weight, device, key, /*A*/ x, /*B*/ dy0, /*D*/ dw0.data,
                 size_t(sdw + out * in) * ew, accumulate_dw ? 1.0f : 0.0f, stream, nullptr,
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
  c.fp8_p_per_row = p.scaling == Fp8Scaling::per_row;
  c.fp8_q_per_row = q.scaling == Fp8Scaling::per_row;
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
  const bool p_rows = c.fp8_p_per_row, q_rows = c.fp8_q_per_row;
  if (p_rows || q_rows) {
    // Outer-vector scaling came with cuBLAS 12.9; an older library would misread the vector as a scalar.
    FLASHLM_CHECK(cublasLtGetVersion() >= 120900,
                  "{}: per-row FP8 scales (--fp8-recipe rowwise) need cuBLASLt >= 12.9 (outer-vector scaling); this "
                  "process loaded cuBLASLt {}",
                  c.fn, cublasLtGetVersion());
  }
  const Arg ap{"p", p.data, rows * k, 1}, aq{"q", q.data, cols * k, 1}, ad{"d", d, rows * cols, dtype_size(out)},
      ar{"residual", residual, rows * cols, dtype_size(out)}, asp{"p.dequant", p.dequant, p_rows ? rows : 1, 4},
      asq{"q.dequant", q.dequant, q_rows ? cols : 1, 4};
  std::vector<const Arg*> used = {&ap, &aq, &ad, &asp, &asq};
  if (residual) used.push_back(&ar);
  for (const Arg* a : used) check_not_null(c, *a);
  for (const Arg* a : {&ap, &aq, &ad}) {
    FLASHLM_CHECK(alignment_of(a->ptr) >= 16, "{}: {} = {} is not 16-byte aligned (cuBLASLt's FP8 kernels)", c.fn,
                  a->name, a->ptr);
  }
  for (const Arg* a : {&asp, &asq}) {
    FLASHLM_CHECK(alignment_of(a->ptr) >= kFp8ScaleAlignment,
                  "{}: {} = {} is not {}-byte aligned (cuBLASLt's FP8 scale pointers; model/fp8.h's scale slots are)",
                  c.fn, a->name, a->ptr, kFp8ScaleAlignment);
  }
  if (residual) {
    FLASHLM_CHECK(alignment_of(residual) >= 16, "{}: residual = {} is not 16-byte aligned", c.fn, residual);
    check_disjoint(c, ad, ar);
  }
  check_disjoint(c, ad, ap);
  check_disjoint(c, ad, aq);
  check_disjoint(c, ad, asp);
  check_disjoint(c, ad, asq);
  const int device = current_device(c);
  for (const Arg* a : used) check_on_device(c, *a, device);

  // dᵀ [cols, rows] = Qᵀ · P with Q = qᵀ [k, cols] and P = pᵀ [k, rows] column-major: the forward's "TN" row
  // of the table at the top, with A = q and B = p.
  const auto fp8_type = [](Fp8Format f) { return f == Fp8Format::e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; };
  PlanKey key = make_key(CUBLAS_OP_T, CUBLAS_OP_N, /*m*/ cols, /*n*/ rows, /*k*/ k, /*lda*/ k, /*ldb*/ k,
                         /*ldd*/ cols, fp8_type(q.format), cuda_type(out), CUBLAS_COMPUTE_32F, /*A*/ q.data,
                         /*B*/ p.data, /*D*/ d, /*C*/ residual);
  key.b_type = static_cast<int32_t>(fp8_type(p.format));
  // A = q: a vector of M = cols scales; B = p: one of N = rows.
  if (q_rows) key.a_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  if (p_rows) key.b_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  run_gemm(c, Product::fp8, device, key, /*A*/ q.data, /*B*/ p.data, d, ad.bytes(), beta, stream, residual,
           /*may_decline*/ false, /*a_scale*/ q.dequant, /*b_scale*/ p.dequant);
}

}  // namespace flashlm
