// The unfused attention baseline on the GPU: the scores S [B, Hq, Nq, Nk] (fp32) and the probabilities
// P (in the input dtype, so that P·V and the gradient GEMMs run on tensor cores like any framework's
// unfused path) are materialised in device memory, with cuBLAS for every product and small kernels for
// the softmax. It exists to be measured against FlashAttention, O(seq²) memory wall included.
//
// Every (batch, key head) is one GEMM batch entry. q and dout are first packed as [B, Hq, Nq, D]; since
// the query heads of one GQA group are adjacent there, the group's queries form one [group·Nq, D]
// matrix and K/V are used once per group without being copied per query head, and dK, dV come out
// already summed over the group (the reduction runs inside the GEMM's fp32 accumulator).
//
// Extra device memory, with e = sizeof(T), R = B·Hq·Nq query rows, L = Nk rounded up to 8 and
// KV = B·Hk·Nk·D: forward (4 + e)·R·L + e·(R·D + 2·KV) (S, P, packed Q/O, K, V); backward
// (8 + e)·R·L + 4·R + e·(2·R·D + 2·KV) (S, dP, P/dS, row lse, packed Q, dO/dQ, K/dK, V/dV).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <type_traits>

#include "attention/backends.h"
#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/head_descales.cuh"
#include "core/check.h"
#include "core/cuda_check.h"
#include "core/softmax_stats.cuh"
#include "flashlm/profile.h"

namespace flashlm {

namespace {

using flash_cuda::from_float;
using flash_cuda::row_strides;
using flash_cuda::RowStrides;

constexpr int kThreads = 256;  // one block per row of S for the softmax kernels
constexpr int kWarps = kThreads / 32;

// ---------------------------------------------------------------------------------------------------
// Element types (from_float: flash_common.cuh).

template <class T>
constexpr cudaDataType blas_type() {
  if constexpr (std::is_same_v<T, __half>) return CUDA_R_16F;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return CUDA_R_16BF;
  else return CUDA_R_32F;
}

// ---------------------------------------------------------------------------------------------------
// Kernels.

// Copies head_dim-long rows between two [batch, seq, heads, head_dim] layouts (strides in elements of
// elem_bytes each), 16 bytes per thread (attention.cpp guarantees 16-byte aligned rows, and
// head_dim·sizeof(T) is a multiple of 16). The index runs over (b, h, s) so that the packed [B, H, N, D]
// side is read or written sequentially.
__global__ void copy_rows(const char* __restrict__ src, RowStrides src_st, char* __restrict__ dst,
                          RowStrides dst_st, int64_t elem_bytes, int64_t seq, int64_t heads, int64_t vecs_per_row,
                          int64_t total) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; idx < total; idx += step) {
    const int64_t vec = idx % vecs_per_row, row = idx / vecs_per_row;
    const int64_t s = row % seq, bh = row / seq, h = bh % heads, b = bh / heads;
    const int64_t byte = vec * 16;
    *reinterpret_cast<uint4*>(dst + (b * dst_st.b + s * dst_st.s + h * dst_st.h) * elem_bytes + byte) =
        *reinterpret_cast<const uint4*>(src + (b * src_st.b + s * src_st.s + h * src_st.h) * elem_bytes + byte);
  }
}

// Eight e4m3 values to bf16, in vectors (an 8-byte load, a 16-byte store): each pair of values, exact as floats
// (every e4m3 value is a half), becomes the two bf16 halves of a word through to_bf16x2(float2).
template <class ToBf16x2>
__device__ __forceinline__ void e4m3x8_to_bf16(const __nv_fp8_e4m3* in, __nv_bfloat16* out, ToBf16x2 to_bf16x2) {
  const uint2 raw = *reinterpret_cast<const uint2*>(in);
  const uint32_t words[2] = {raw.x, raw.y};
  uint32_t packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(words[i / 2] >> (16 * (i % 2)));
    packed[i] = to_bf16x2(__half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3))));
  }
  *reinterpret_cast<uint4*>(out) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// Eight elements widened exactly, in vectors: e4m3 to bf16 (every e4m3 value is a bf16 value), or a 16-byte bf16
// load and two 16-byte fp32 stores.
__device__ __forceinline__ void widen8(const __nv_fp8_e4m3* in, __nv_bfloat16* out) {
  e4m3x8_to_bf16(in, out, [](float2 f) {
    const __nv_bfloat162 b = __float22bfloat162_rn(f);
    return *reinterpret_cast<const uint32_t*>(&b);
  });
}

__device__ __forceinline__ void widen8(const __nv_bfloat16* in, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(in);
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  float f[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
    f[2 * i] = pair.x, f[2 * i + 1] = pair.y;
  }
  reinterpret_cast<float4*>(out)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(out)[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// Eight e4m3 values times `descale`, each rounded once to bf16: the product of e4m3's 4 significant bits and an
// fp32 descale's 24 is exact in fp64, which __double2bfloat16 rounds to nearest even (dequantise_head_rows_cuda).
__device__ __forceinline__ void dequantise8(const __nv_fp8_e4m3* in, double descale, __nv_bfloat16* out) {
  e4m3x8_to_bf16(in, out, [descale](float2 f) {
    const __nv_bfloat16 lo = __double2bfloat16(double(f.x) * descale), hi = __double2bfloat16(double(f.y) * descale);
    return uint32_t{__bfloat16_as_ushort(lo)} | uint32_t{__bfloat16_as_ushort(hi)} << 16;
  });
}

// What convert_rows multiplies the rows by: nothing (Exact, the widenings of convert_head_rows_cuda), or the
// descale of the row's batch b and head h (dequantise_head_rows_cuda): the view's (b, h / group), `group` heads
// sharing one.
struct Exact {};
struct RowDescales {
  flash_cuda::HeadDescalesView heads;
  int64_t group;
  template <class Index>
  __device__ __forceinline__ double at(Index b, Index h) const {
    return heads.at(int64_t{b}, int64_t{h / static_cast<Index>(group)});
  }
};

// copy_rows converting each element from Src to Dst, 8 elements per thread (widen8, or dequantise8 with a
// Descale): rows of any head_dim that is a multiple of 8, the index running as copy_rows'. Index is uint32_t
// where the launch's indices fit (a 32-bit division is a few instructions, a 64-bit one a call, and this kernel
// does three per eight elements; with 64-bit indices it ran at a fifth of the bandwidth).
template <class Src, class Dst, class Index, class Descale>
__global__ void convert_rows(const Src* __restrict__ src, RowStrides src_st, Dst* __restrict__ dst, RowStrides dst_st,
                             Index seq, Index heads, Index octets_per_row, Index total, Descale descale) {
  const Index step = Index{gridDim.x} * blockDim.x;
  for (Index idx = Index{blockIdx.x} * blockDim.x + threadIdx.x; idx < total; idx += step) {
    const Index octet = idx % octets_per_row, row = idx / octets_per_row;
    const Index s = row % seq, bh = row / seq, h = bh % heads, b = bh / heads;
    const Src* in = src + int64_t{b} * src_st.b + int64_t{s} * src_st.s + int64_t{h} * src_st.h + int64_t{octet} * 8;
    Dst* out = dst + int64_t{b} * dst_st.b + int64_t{s} * dst_st.s + int64_t{h} * dst_st.h + int64_t{octet} * 8;
    if constexpr (std::is_same_v<Descale, Exact>) widen8(in, out);
    else dequantise8(in, descale.at(b, h), out);
  }
}

// AttentionProblem::visible_keys on the device: query i sees keys [0, visible_keys).
__device__ __forceinline__ int64_t visible_keys(int64_t i, int64_t seq_k, bool causal, int64_t causal_offset) {
  if (!causal) return seq_k;
  const int64_t n = i + causal_offset + 1;
  return n < 0 ? 0 : (n > seq_k ? seq_k : n);
}

// Logsumexp view [batch, heads_q, seq_q] in elements; data is null when the caller wants no lse.
struct LseView {
  float* data;
  int64_t b, h, s;
};

// One block per query row (b, h, i) of S: P = softmax over the visible keys [0, visible), 0 beyond.
// A row that sees no key gets P = 0 and lse = -inf.
template <class T>
__global__ void __launch_bounds__(kThreads)
    softmax_rows(const float* __restrict__ s, T* __restrict__ p, int64_t ld, int64_t seq_q, int64_t seq_k,
                 int64_t heads_q, bool causal, int64_t causal_offset, LseView lse) {
  const int64_t row = blockIdx.x;
  const int64_t i = row % seq_q;
  const int64_t visible = visible_keys(i, seq_k, causal, causal_offset);
  const float* srow = s + row * ld;
  T* prow = p + row * ld;

  // Online max and sum in one pass over the row instead of two.
  float m = -INFINITY, l = 0.f;
  for (int64_t j = threadIdx.x; j < visible; j += kThreads) {
    const float x = srow[j];
    if (x > m || x != x) {  // a NaN becomes the max: the row's statistics, and so its P and lse, turn NaN
      l = l * expf(m - x) + 1.f;
      m = x;
    } else if (m != -INFINITY) {  // x = m = -inf (a -inf score first): adds exp(-inf) = 0, not exp(NaN)
      l += expf(x - m);
    }
  }
  block_merge_stats<kThreads>(m, l);

  for (int64_t j = threadIdx.x; j < seq_k; j += kThreads) {
    prow[j] = from_float<T>(j < visible ? expf(srow[j] - m) / l : 0.f);
  }
  if (lse.data && threadIdx.x == 0) {
    const int64_t bh = row / seq_q;
    lse.data[bh / heads_q * lse.b + bh % heads_q * lse.h + i * lse.s] = visible > 0 ? m + logf(l) : -INFINITY;
  }
}

// One block per query row: with P_j = exp(S_j - lse) in fp32 (0 for masked keys), Delta = Σ_j P_j dP_j
// and dS_j = P_j (dP_j - Delta). P comes from S rather than from the rounded P buffer so that dS is
// rounded to T once, as in FlashAttention. A row that sees no key gets dS = 0.
template <class T>
__global__ void __launch_bounds__(kThreads)
    softmax_grad_rows(const float* __restrict__ s, const float* __restrict__ dp, const float* __restrict__ row_lse,
                      T* __restrict__ ds, int64_t ld, int64_t seq_q, int64_t seq_k, bool causal,
                      int64_t causal_offset) {
  const int64_t row = blockIdx.x;
  const int64_t visible = visible_keys(row % seq_q, seq_k, causal, causal_offset);
  const float* srow = s + row * ld;
  const float* dprow = dp + row * ld;
  T* dsrow = ds + row * ld;
  const float lse = row_lse[row];

  float acc = 0.f;
  for (int64_t j = threadIdx.x; j < visible; j += kThreads) acc += expf(srow[j] - lse) * dprow[j];
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  __shared__ float warp_sum[kWarps];
  if (threadIdx.x % 32 == 0) warp_sum[threadIdx.x / 32] = acc;
  __syncthreads();
  float delta = 0.f;
  for (int w = 0; w < kWarps; ++w) delta += warp_sum[w];

  for (int64_t j = threadIdx.x; j < seq_k; j += kThreads) {
    dsrow[j] = from_float<T>(j < visible ? expf(srow[j] - lse) * (dprow[j] - delta) : 0.f);
  }
}

// ---------------------------------------------------------------------------------------------------
// Host side.

void check_blas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    fail("naive_attention: {} failed: {} ({})", what, cublasGetStatusString(status), cublasGetStatusName(status));
  }
}

// One cuBLAS handle per device, created on first use. A handle carries one stream and one workspace,
// so calls on the same device take turns through `mutex`. Handles are never destroyed: static
// destructors may run after the CUDA context is gone.
struct DeviceBlas {
  std::mutex mutex;
  cublasHandle_t handle = nullptr;
};

DeviceBlas& blas_for_current_device() {
  static std::mutex registry_mutex;
  static std::map<int, std::unique_ptr<DeviceBlas>> registry;
  int device = 0;
  FLASHLM_CUDA_CHECK(cudaGetDevice(&device), "naive_attention: cudaGetDevice");
  const std::lock_guard lock(registry_mutex);
  std::unique_ptr<DeviceBlas>& slot = registry[device];
  if (!slot) {
    auto fresh = std::make_unique<DeviceBlas>();
    check_blas(cublasCreate(&fresh->handle), "cublasCreate");
    slot = std::move(fresh);
  }
  return *slot;
}

int blas_int(int64_t v, const char* what) {
  FLASHLM_CHECK(v <= INT_MAX, "naive_attention: {} = {} exceeds cuBLAS's 32-bit dimensions", what, v);
  return static_cast<int>(v);
}

// A strided batch of column-major matrices, as cuBLAS sees it.
struct Operand {
  const void* data;
  int64_t ld, stride;
};

// C[i] = alpha · op(A[i]) op(B[i]) for i < batch, fp32 accumulation (CUBLAS_COMPUTE_32F with the
// handle's default math mode: fp32 operands get true fp32 products, never TF32). Each C here is a
// dense stack of `batch` matrices, which is what lets an empty sum (k = 0) be a memset.
void gemm(cublasHandle_t handle, cudaStream_t stream, cublasOperation_t op_a, cublasOperation_t op_b, int64_t m,
          int64_t n, int64_t k, float alpha, Operand a, Operand b, cudaDataType ab_type, void* c, int64_t ldc,
          int64_t stride_c, cudaDataType c_type, int64_t batch, const char* what) {
  if (m == 0 || n == 0 || batch == 0) return;
  if (k == 0) {
    const size_t elem = c_type == CUDA_R_32F ? 4 : 2;
    FLASHLM_CUDA_CHECK(cudaMemsetAsync(c, 0, static_cast<size_t>(batch * stride_c) * elem, stream), what);
    return;
  }
  const float beta = 0.f;
  const cublasStatus_t status = cublasGemmStridedBatchedEx(
      handle, op_a, op_b, blas_int(m, "m"), blas_int(n, "n"), blas_int(k, "k"), &alpha, a.data, ab_type,
      blas_int(a.ld, "lda"), a.stride, b.data, ab_type, blas_int(b.ld, "ldb"), b.stride, &beta, c, c_type,
      blas_int(ldc, "ldc"), stride_c, blas_int(batch, "batch"), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  check_blas(status, what);
}

// Sizes of one call. Rows of S and P are padded to a multiple of 8 elements so that every row starts
// 16-byte aligned (fp16 P, fp32 S), which cuBLAS's tensor-core kernels want.
struct Dims {
  int64_t heads_q, seq_q, seq_k, head_dim;
  int64_t group_rows;  // group · seq_q: rows of one GEMM batch entry
  int64_t entries;     // batch · heads_k: GEMM batch entries
  int64_t rows;        // batch · heads_q · seq_q: rows of S and P
  int64_t ld;          // row pitch of S and P
};

Dims dims_of(const AttentionProblem& p) {
  Dims d{p.heads_q, p.seq_q, p.seq_k, p.head_dim, 0, 0, 0, 0};
  d.group_rows = p.group() * p.seq_q;
  d.entries = p.batch * p.heads_k;
  d.rows = p.batch * p.heads_q * p.seq_q;
  d.ld = (p.seq_k + 7) / 8 * 8;
  FLASHLM_CHECK(d.rows <= INT_MAX, "naive_attention: {} query rows (batch · heads · seq_q) exceed one CUDA grid",
                d.rows);
  checked_product({d.rows, d.ld, int64_t{sizeof(float)}}, "naive_attention: bytes of the scores S");  // O(N²)
  return d;
}

// Scratch from the stream-ordered pool: no cudaMalloc/cudaFree (and no device-wide synchronisation) per
// call, and freed in stream order once the call's work is done.
Buffer allocate(int64_t elems, size_t elem_size, const char* tag, cudaStream_t stream) {
  return Buffer::allocate_on_stream(static_cast<size_t>(elems) * elem_size, tag, stream);
}

// Strides of a packed [batch, heads, seq, head_dim] buffer, seen as [batch, seq, heads, head_dim].
RowStrides packed_strides(int64_t seq, int64_t heads, int64_t head_dim) {
  return {heads * seq * head_dim, head_dim, seq * head_dim};
}

void copy_heads(const void* src, RowStrides src_st, void* dst, RowStrides dst_st, const TensorView& shape,
                size_t elem, cudaStream_t stream, const char* what) {
  const int64_t vecs_per_row = shape.size(3) * static_cast<int64_t>(elem) / 16;
  const int64_t total = shape.size(0) * shape.size(1) * shape.size(2) * vecs_per_row;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65536);
  copy_rows<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const char*>(src), src_st, static_cast<char*>(dst), dst_st, static_cast<int64_t>(elem),
      shape.size(1), shape.size(2), vecs_per_row, total);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), what);
}

}  // namespace

void copy_head_rows_cuda(const TensorView& src, const TensorView& dst, int64_t cols, void* stream) {
  const size_t elem = dtype_size(src.dtype);
  FLASHLM_CHECK(src.dtype == dst.dtype && cols <= src.size(3) && cols <= dst.size(3) &&
                    cols * static_cast<int64_t>(elem) % 16 == 0,
                "copy_head_rows_cuda: src {} and dst {}: {} columns cannot be copied in 16-byte vectors",
                src.shape_string(), dst.shape_string(), cols);
  TensorView shape = src;
  shape.sizes[3] = cols;
  copy_heads(src.data, row_strides(src), dst.data, row_strides(dst), shape, elem,
             static_cast<cudaStream_t>(stream), "copy_head_rows_cuda: copy_rows");
}

namespace {

// convert_rows over every element of src into dst (`fn` names the caller in the errors): one shape, rows of a
// multiple of 8 elements, each starting 16-byte aligned (widen8's and dequantise8's vectors; check_cuda_arguments'
// rule for the views they convert).
template <class Descale>
void convert_every_row(std::string_view fn, const TensorView& src, const TensorView& dst, const Descale& descale,
                       void* stream) {
  FLASHLM_CHECK(src.size(0) == dst.size(0) && src.size(1) == dst.size(1) && src.size(2) == dst.size(2) &&
                    src.size(3) == dst.size(3) && src.size(3) % 8 == 0,
                "{}: src {} {} and dst {} {}: expected one shape with rows of a multiple of 8 elements", fn,
                dtype_name(src.dtype), src.shape_string(), dtype_name(dst.dtype), dst.shape_string());
  for (const TensorView* t : {&src, &dst}) {
    const int64_t elem = static_cast<int64_t>(dtype_size(t->dtype));
    bool aligned = reinterpret_cast<uintptr_t>(t->data) % 16 == 0;
    for (int d = 0; d < 3; ++d) aligned = aligned && (t->size(d) == 1 || t->stride(d) * elem % 16 == 0);
    FLASHLM_CHECK(aligned, "{}: {} {}: rows must start 16-byte aligned", fn, dtype_name(t->dtype), t->shape_string());
  }
  const int64_t octets_per_row = src.size(3) / 8;
  const int64_t total =
      checked_product({src.size(0), src.size(1), src.size(2), octets_per_row}, "convert_rows: element count");
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65536);
  const auto s = static_cast<cudaStream_t>(stream);
  // 32-bit indices where the last one plus a grid's stride stays below 2^32.
  const bool narrow = total + blocks * kThreads <= int64_t{UINT32_MAX};
  const auto launch = [&](auto src_zero, auto dst_zero) {
    using Src = decltype(src_zero);
    using Dst = decltype(dst_zero);
    const auto run = [&](auto index_zero) {
      using Index = decltype(index_zero);
      convert_rows<Src, Dst, Index, Descale><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
          static_cast<const Src*>(src.data), row_strides(src), static_cast<Dst*>(dst.data), row_strides(dst),
          static_cast<Index>(src.size(1)), static_cast<Index>(src.size(2)), static_cast<Index>(octets_per_row),
          static_cast<Index>(total), descale);
    };
    if (narrow) run(uint32_t{});
    else run(int64_t{});
  };
  if (src.dtype == DType::f8e4m3) launch(__nv_fp8_e4m3{}, __nv_bfloat16{});
  else if constexpr (std::is_same_v<Descale, Exact>) launch(__nv_bfloat16{}, float{});
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "convert_rows launch");
}

}  // namespace

void convert_head_rows_cuda(const TensorView& src, const TensorView& dst, void* stream) {
  const bool widens = (src.dtype == DType::f8e4m3 && dst.dtype == DType::bf16) ||
                      (src.dtype == DType::bf16 && dst.dtype == DType::f32);
  FLASHLM_CHECK(widens, "convert_head_rows_cuda: src {} and dst {}: expected fp8_e4m3 to bf16 or bf16 to fp32",
                dtype_name(src.dtype), dtype_name(dst.dtype));
  convert_every_row("convert_head_rows_cuda", src, dst, Exact{}, stream);
}

void dequantise_head_rows_cuda(const TensorView& src, const TensorView& dst, double descale,
                               const AttentionProblem::HeadDescales& heads, int64_t group, void* stream) {
  FLASHLM_CHECK(src.dtype == DType::f8e4m3 && dst.dtype == DType::bf16 && group >= 1,
                "dequantise_head_rows_cuda: src {} and dst {} (group {}): expected fp8_e4m3 to bf16",
                dtype_name(src.dtype), dtype_name(dst.dtype), group);
  convert_every_row("dequantise_head_rows_cuda", src, dst,
                    RowDescales{flash_cuda::HeadDescalesView::of(heads, descale), group}, stream);
}

namespace {

// View -> packed [batch, heads, seq, head_dim] buffer.
void gather(const TensorView& t, void* packed, size_t elem, cudaStream_t stream, const char* what) {
  copy_heads(t.data, row_strides(t), packed, packed_strides(t.size(1), t.size(2), t.size(3)), t, elem, stream, what);
}

// Packed [batch, heads, seq, head_dim] buffer -> view.
void scatter(const void* packed, const TensorView& t, size_t elem, cudaStream_t stream, const char* what) {
  copy_heads(packed, packed_strides(t.size(1), t.size(2), t.size(3)), t.data, row_strides(t), t, elem, stream, what);
}

template <class T>
void launch_softmax(const AttentionProblem& p, const Dims& d, const float* s, T* pr, LseView lse,
                    cudaStream_t stream) {
  if (d.rows == 0) return;
  softmax_rows<T><<<static_cast<unsigned>(d.rows), kThreads, 0, stream>>>(s, pr, d.ld, d.seq_q, d.seq_k, d.heads_q,
                                                                            p.causal, p.causal_offset, lse);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "naive_attention: softmax_rows");
}

// The three GEMM shapes, over the row-major packed buffers (cuBLAS is column-major, so each row-major
// X [r, c] is handed over as Xᵀ with leading dimension c):
//   scores:  C [group_rows, seq_k]  = alpha · X [group_rows, D] · Y [seq_k, D]ᵀ       (S, dP)
//   apply:   C [group_rows, D]      = alpha · P [group_rows, seq_k] · Y [seq_k, D]   (O, dQ)
//   reduce:  C [seq_k, D]           = alpha · P [group_rows, seq_k]ᵀ · X [group_rows, D]  (dV, dK)
// The products of one call, on this device's cuBLAS handle: held for the call (the handle is shared by the
// process's threads) and bound to the call's stream.
struct Gemms {
  Gemms(cudaStream_t stream_, const Dims& d_, cudaDataType type_)
      : blas(blas_for_current_device()), lock(blas.mutex), handle(blas.handle), stream(stream_), d(d_), type(type_) {
    check_blas(cublasSetStream(handle, stream), "cublasSetStream");
  }
  DeviceBlas& blas;
  std::lock_guard<std::mutex> lock;
  cublasHandle_t handle;
  cudaStream_t stream;
  Dims d;
  cudaDataType type;  // of the packed inputs, P, and every output but S/dP

  int64_t x_stride() const { return d.group_rows * d.head_dim; }
  int64_t y_stride() const { return d.seq_k * d.head_dim; }
  int64_t p_stride() const { return d.group_rows * d.ld; }

  void scores(const void* x, const void* y, float alpha, float* c, const char* what) const {
    gemm(handle, stream, CUBLAS_OP_T, CUBLAS_OP_N, d.seq_k, d.group_rows, d.head_dim, alpha,
         {y, d.head_dim, y_stride()}, {x, d.head_dim, x_stride()}, type, c, d.ld, p_stride(), CUDA_R_32F, d.entries,
         what);
  }
  void apply(const void* p, const void* y, float alpha, void* c, const char* what) const {
    gemm(handle, stream, CUBLAS_OP_N, CUBLAS_OP_N, d.head_dim, d.group_rows, d.seq_k, alpha,
         {y, d.head_dim, y_stride()}, {p, d.ld, p_stride()}, type, c, d.head_dim, x_stride(), type, d.entries, what);
  }
  void reduce(const void* p, const void* x, float alpha, void* c, const char* what) const {
    gemm(handle, stream, CUBLAS_OP_N, CUBLAS_OP_T, d.head_dim, d.seq_k, d.group_rows, alpha,
         {x, d.head_dim, x_stride()}, {p, d.ld, p_stride()}, type, c, d.head_dim, y_stride(), type, d.entries, what);
  }
};

template <class T>
void forward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
             const TensorView& o, const TensorView& lse, cudaStream_t stream) {
  constexpr size_t e = sizeof(T);
  const Dims d = dims_of(p);
  const Gemms gemms(stream, d, blas_type<T>());

  // q_c is reused for O once S is computed.
  Buffer q_c = allocate(d.rows * d.head_dim, e, "naive attention packed Q, then O", stream);
  Buffer k_c = allocate(d.entries * d.seq_k * d.head_dim, e, "naive attention packed K", stream);
  Buffer v_c = allocate(d.entries * d.seq_k * d.head_dim, e, "naive attention packed V", stream);
  Buffer s = allocate(d.rows * d.ld, sizeof(float), "naive attention scores S", stream);
  Buffer pr = allocate(d.rows * d.ld, e, "naive attention probabilities P", stream);

  gather(q, q_c.data(), e, stream, "naive_attention: copy_rows (gather q)");
  gather(k, k_c.data(), e, stream, "naive_attention: copy_rows (gather k)");
  gather(v, v_c.data(), e, stream, "naive_attention: copy_rows (gather v)");
  // NVTX ranges (and --profile-ranges) around each sub-op, as the seed profiled its unfused attention.
  {
    ScopedRange range("attention.qk_matmul");
    gemms.scores(q_c.data(), k_c.data(), static_cast<float>(p.scale), static_cast<float*>(s.data()),
                 "S = scale Q K^T");
  }
  {
    ScopedRange range("attention.softmax");
    launch_softmax<T>(p, d, static_cast<const float*>(s.data()), static_cast<T*>(pr.data()),
                      {lse.ptr<float>(), lse.stride(0), lse.stride(1), lse.stride(2)}, stream);
  }
  {
    ScopedRange range("attention.av_matmul");
    gemms.apply(pr.data(), v_c.data(), 1.f, q_c.data(), "O = P V");
  }
  scatter(q_c.data(), o, e, stream, "naive_attention: copy_rows (scatter o)");
  FLASHLM_CUDA_CHECK(cudaStreamSynchronize(stream), "naive_attention_forward: cudaStreamSynchronize");
}

template <class T>
void backward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv,
              cudaStream_t stream) {
  constexpr size_t e = sizeof(T);
  const Dims d = dims_of(p);
  const Gemms gemms(stream, d, blas_type<T>());
  const auto scale = static_cast<float>(p.scale);

  // Packed inputs take the gradients once consumed (V -> dV, dO -> dQ, K -> dK) and P's buffer takes
  // dS; S stays alive next to dP because dS is computed from fp32 P = exp(S - lse).
  Buffer q_c = allocate(d.rows * d.head_dim, e, "naive attention packed Q", stream);
  Buffer do_c = allocate(d.rows * d.head_dim, e, "naive attention packed dO, then dQ", stream);
  Buffer k_c = allocate(d.entries * d.seq_k * d.head_dim, e, "naive attention packed K, then dK", stream);
  Buffer v_c = allocate(d.entries * d.seq_k * d.head_dim, e, "naive attention packed V, then dV", stream);
  Buffer s = allocate(d.rows * d.ld, sizeof(float), "naive attention scores S", stream);
  Buffer dp = allocate(d.rows * d.ld, sizeof(float), "naive attention dP", stream);
  Buffer pr = allocate(d.rows * d.ld, e, "naive attention probabilities P, then dS", stream);
  Buffer row_lse = allocate(d.rows, sizeof(float), "naive attention row logsumexp", stream);
  auto* s_f = static_cast<float*>(s.data());
  auto* dp_f = static_cast<float*>(dp.data());
  auto* p_t = static_cast<T*>(pr.data());
  auto* lse_f = static_cast<float*>(row_lse.data());

  gather(q, q_c.data(), e, stream, "naive_attention: copy_rows (gather q)");
  gather(k, k_c.data(), e, stream, "naive_attention: copy_rows (gather k)");
  gather(v, v_c.data(), e, stream, "naive_attention: copy_rows (gather v)");
  gather(dout, do_c.data(), e, stream, "naive_attention: copy_rows (gather dout)");
  // P and its logsumexp are recomputed from S rather than taken from the forward, as the CPU
  // reference does; the packed lse is [batch, heads_q, seq_q] contiguous.
  {
    ScopedRange range("attention.qk_matmul");
    gemms.scores(q_c.data(), k_c.data(), scale, s_f, "S = scale Q K^T");
  }
  {
    ScopedRange range("attention.softmax");
    launch_softmax<T>(p, d, s_f, p_t, {lse_f, d.heads_q * d.seq_q, d.seq_q, 1}, stream);
  }
  {
    ScopedRange range("attention.dp_matmul");
    gemms.scores(do_c.data(), v_c.data(), 1.f, dp_f, "dP = dO V^T");
  }
  {
    ScopedRange range("attention.dv_matmul");
    gemms.reduce(p_t, do_c.data(), 1.f, v_c.data(), "dV = P^T dO");
  }
  if (d.rows > 0) {
    ScopedRange range("attention.softmax_backward");
    softmax_grad_rows<T><<<static_cast<unsigned>(d.rows), kThreads, 0, stream>>>(
        s_f, dp_f, lse_f, p_t, d.ld, d.seq_q, d.seq_k, p.causal, p.causal_offset);
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "naive_attention: softmax_grad_rows");
  }
  {
    ScopedRange range("attention.dq_matmul");
    gemms.apply(p_t, k_c.data(), scale, do_c.data(), "dQ = scale dS K");
  }
  {
    ScopedRange range("attention.dk_matmul");
    gemms.reduce(p_t, q_c.data(), scale, k_c.data(), "dK = scale dS^T Q");
  }
  scatter(do_c.data(), dq, e, stream, "naive_attention: copy_rows (scatter dq)");
  scatter(k_c.data(), dk, e, stream, "naive_attention: copy_rows (scatter dk)");
  scatter(v_c.data(), dv, e, stream, "naive_attention: copy_rows (scatter dv)");
  FLASHLM_CUDA_CHECK(cudaStreamSynchronize(stream), "naive_attention_backward: cudaStreamSynchronize");
}

template <class Fn>
void dispatch_cuda_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f16: fn(__half{}); return;
    case DType::bf16: fn(__nv_bfloat16{}); return;
    case DType::f32: fn(float{}); return;
    default: fail("naive_attention: dtype {} is not supported on cuda", dtype_name(dtype));
  }
}

}  // namespace

void naive_attention_forward_cuda(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& o, const TensorView& lse, void* stream) {
  dispatch_cuda_dtype(p.dtype, [&](auto t) {
    forward<decltype(t)>(p, q, k, v, o, lse, static_cast<cudaStream_t>(stream));
  });
}

// o and lse are not read: P is recomputed from S and Delta taken as Σ_j P_ij dP_ij, as on the CPU.
void naive_attention_backward_cuda(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& /*o*/, const TensorView& /*lse*/,
                                   const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                   const TensorView& dv, void* stream) {
  dispatch_cuda_dtype(p.dtype, [&](auto t) {
    backward<decltype(t)>(p, q, k, v, dout, dq, dk, dv, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace flashlm
