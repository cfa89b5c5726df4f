// FP8 (e4m3) FlashAttention forward for Hopper (sm_90a): e4m3 Q, K and V with per-tensor descale factors,
// fp32 logsumexp, bf16 output, head dims 64 and 128, on e4m3 wgmma.
//
// Correct first, not yet tuned: one warpgroup per block of 64 query rows, no warp specialisation, plain
// loads into shared memory (the views are 16-byte aligned: attention.cpp checks it). Per key block of 128:
// the block's threads write K into a swizzled tile and Vᵀ into another, S = Q·Kᵀ by wgmma from shared
// memory, the online softmax in registers on S's accumulators with softmax_scale·q_descale·k_descale folded
// into the exp2, P rounded to e4m3 (in [0, 1], no range scaling needed) and O += P·V by wgmma with P from
// registers; O is multiplied by v_descale / rowsum at the end.
//
// Two things 8-bit wgmma changes against the 16-bit kernel (flash_fwd_sm90.cu):
//  - both operands must be K-major, so V (keys x channels, channels contiguous) is stored transposed: row d
//    of the Vᵀ tile holds channel d of the block's 128 keys, one 128-byte swizzled row;
//  - the A fragment of a k32 step wants bytes of columns 4t..4t+3 in one register, while S's accumulators
//    give a thread columns 2t, 2t+1 of each 8-column group. Instead of moving bytes between threads, the
//    keys are relabelled: the sum over keys does not care about their order, so the thread packs the four
//    values it has (keys 2t, 2t+1, 8+2t, 9+2t of a 16-key group) as logical columns 4t..4t+3, and Vᵀ's
//    column for logical key L holds the physical key physical_key(L) — the same permutation on both sides.
#include <cuda_fp8.h>

#include <cstdint>

#include "attention/backends.h"
#include "attention/capabilities.h"
#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper/hopper.h"
#include "attention/cuda/hopper/sm90.cuh"
#include "attention/cuda/hopper/softmax_sm90.cuh"
#include "core/check.h"
#include "core/cuda_check.h"

namespace flashlm {
namespace flash_cuda {
namespace {

constexpr int kFp8BlockM = 64;   // one consumer warpgroup: 64 query rows
constexpr int kFp8BlockN = 128;  // keys per block: one 128-byte row of Vᵀ
constexpr int kFp8RowBytes = sm90::kPanelRowBytes;  // every tile row is one 128-byte swizzled row

template <int D>
struct Fp8FwdShared {
  // At D = 64 each 64-byte row still takes a 128-byte swizzled row (the half beyond D is never read).
  alignas(1024) uint8_t q[kFp8BlockM * kFp8RowBytes];
  alignas(1024) uint8_t k[kFp8BlockN * kFp8RowBytes];
  alignas(1024) uint8_t vt[D * kFp8RowBytes];
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of 128-byte rows with the 128-byte swizzle
// (sm90.cuh's layout, one panel).
__device__ __forceinline__ uint32_t fp8_chunk_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * kFp8RowBytes + ((chunk ^ (row % 8)) * 16));
}

// The physical key (within a block) that logical reduction column L of the P·V GEMM stands for. Within each
// 16 keys: L = 4t + 2a + b (t the thread in its quad) holds key 8a + 2t + b, the a-th 8-column group's
// column 2t + b of S's accumulator (see the file comment).
__device__ __forceinline__ int physical_key(int L) {
  return (L & ~15) | (((L >> 1) & 1) << 3) | (((L >> 2) & 3) << 1) | (L & 1);
}

__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  // __nv_cvt_float2_to_fp8x2 puts .x in the low byte; satfinite keeps NaN (a NaN input shows in O).
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// Rows [row_begin, row_begin + rows) of a [seq, D] head (row stride `stride` bytes) into a swizzled tile;
// rows at or past `limit` are zeros.
template <int D>
__device__ __forceinline__ void load_rows(uint8_t* tile, const uint8_t* head, int64_t stride, int row_begin,
                                          int rows, int limit) {
  constexpr int kChunks = D / 16;
  for (int i = threadIdx.x; i < rows * kChunks; i += sm90::kWarpgroupThreads) {
    const int r = i / kChunks, c = i % kChunks, row = row_begin + r;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (row < limit) val = *reinterpret_cast<const uint4*>(head + row * stride + c * 16);
    *reinterpret_cast<uint4*>(tile + fp8_chunk_offset(r, c)) = val;
  }
}

// The Vᵀ tile of keys [n0, n0 + 128): row d, logical column L = V[n0 + physical_key(L)][d] (0 past seq_k).
// Consecutive threads take consecutive channels, so each byte load of a warp reads 32 consecutive bytes.
template <int D>
__device__ __forceinline__ void load_v_transposed(uint8_t* vt, const uint8_t* head, int64_t stride, int n0,
                                                  int seq_k) {
  for (int i = threadIdx.x; i < D * (kFp8BlockN / 16); i += sm90::kWarpgroupThreads) {
    const int d = i % D, chunk = i / D;
    uint32_t w[4];
#pragma unroll
    for (int word = 0; word < 4; ++word) {
      uint32_t packed = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = n0 + physical_key(16 * chunk + 4 * word + e);
        const uint32_t byte = key < seq_k ? head[key * stride + d] : 0u;
        packed |= byte << (8 * e);
      }
      w[word] = packed;
    }
    *reinterpret_cast<uint4*>(vt + fp8_chunk_offset(d, chunk)) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// One block per (64 query rows, query head, batch). p.scale and p.scale_log2 already carry
// q_descale·k_descale; v_descale multiplies O at the end.
template <int D>
__global__ void __launch_bounds__(sm90::kWarpgroupThreads, 1)
    flash_fwd_fp8_sm90_kernel(const FlashParams p, float v_descale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using GemmS = sm90::WgmmaM64E4m3<kFp8BlockN>;
  using GemmO = sm90::WgmmaM64E4m3<D>;
  extern __shared__ unsigned char smem_raw[];
  auto& s = *reinterpret_cast<Fp8FwdShared<D>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int m0 = static_cast<int>(blockIdx.x) * kFp8BlockM, h = static_cast<int>(blockIdx.y),
            b = static_cast<int>(blockIdx.z), hk = h / p.group;
  const int row0 = m0 + 16 * warp + g;  // this thread's rows: row0 and row0 + 8

  const auto* q_head = static_cast<const uint8_t*>(p.q) + b * p.q_st.b + h * p.q_st.h;
  const auto* k_head = static_cast<const uint8_t*>(p.k) + b * p.k_st.b + hk * p.k_st.h;
  const auto* v_head = static_cast<const uint8_t*>(p.v) + b * p.v_st.b + hk * p.v_st.h;

  const int last_row = min(m0 + kFp8BlockM, p.seq_q) - 1;
  const int n_end = p.causal ? max(0, min(p.seq_k, last_row + p.causal_offset + 1)) : p.seq_k;
  const int n_blocks = (n_end + kFp8BlockN - 1) / kFp8BlockN;

  float o[D / 2];
  float sacc[kFp8BlockN / 2];
  uint32_t pa[kFp8BlockN / 32][4];
  WgmmaRowSoftmax<kFp8BlockN> softmax;
  softmax.reset();
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;

  if (n_blocks > 0) load_rows<D>(s.q, q_head, p.q_st.s, m0, kFp8BlockM, p.seq_q);
  for (int nb = 0; nb < n_blocks; ++nb) {
    const int n0 = nb * kFp8BlockN;
    __syncthreads();  // every thread's GEMMs of the previous block have completed (wgmma_wait<0>)
    load_rows<D>(s.k, k_head, p.k_st.s, n0, kFp8BlockN, p.seq_k);
    load_v_transposed<D>(s.vt, v_head, p.v_st.s, n0, p.seq_k);
    sm90::fence_proxy_async_shared();  // the stores above before wgmma's reads
    __syncthreads();

    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk) {
      GemmS::ss(sacc, sm90::k_major_descriptor(s.q, kFp8BlockM, 0, kk), sm90::k_major_descriptor(s.k, kFp8BlockN, 0, kk),
                kk > 0);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_accumulators(sacc);

    float alpha[2];
    softmax.update(sacc, p, n0, m0, row0, t, alpha);
    softmax.rescale(o, alpha);
    // P as e4m3 A fragments, logical columns 32·kk + [0, 32): registers 0/1 (rows g, g + 8) from S's 8-column
    // groups 4kk and 4kk + 1, registers 2/3 from groups 4kk + 2 and 4kk + 3 (the relabelling above).
#pragma unroll
    for (int kk = 0; kk < kFp8BlockN / 32; ++kk) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = 4 * kk + 2 * half;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          pa[kk][2 * half + r] = pack_e4m3x4(sacc[4 * j + 2 * r], sacc[4 * j + 2 * r + 1], sacc[4 * (j + 1) + 2 * r],
                                             sacc[4 * (j + 1) + 2 * r + 1]);
        }
      }
    }

    sm90::fence_accumulators(o);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kFp8BlockN / 32; ++kk) {
      GemmO::rs(o, pa[kk], sm90::k_major_descriptor(s.vt, D, 0, kk), 1);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_accumulators(o);
  }

  // Rows that saw no key have l = 0: O = 0, logsumexp -inf.
  auto* o_head = static_cast<__nv_bfloat16*>(p.o) + b * p.o_st.b + h * p.o_st.h;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(softmax.row_sum[r]);
    const float inv = l != 0.f ? v_descale / l : 0.f;  // NaN l: a NaN reached the row (SPEC §2)
    const int row = row0 + 8 * r;
    if (row >= p.seq_q) continue;
    if (t == 0) {
      p.lse[b * p.lse_b + h * p.lse_h + row * p.lse_s] = l != 0.f ? softmax.row_max[r] * p.scale + logf(l) : -INFINITY;
    }
    __nv_bfloat16* out = o_head + row * p.o_st.s + 2 * t;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) store_pair(out + 8 * j, o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
  }
#endif
}

template <int D>
void launch_forward_fp8_sm90(const FlashParams& f, float v_descale, cudaStream_t stream) {
  auto kernel = flash_fwd_fp8_sm90_kernel<D>;
  constexpr int kSmem = static_cast<int>(sizeof(Fp8FwdShared<D>) + 1024);  // + room to align the base
  FLASHLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                     "flash_fwd_fp8_sm90_kernel: shared-memory opt-in");
  const dim3 grid(static_cast<unsigned>((f.seq_q + kFp8BlockM - 1) / kFp8BlockM), static_cast<unsigned>(f.heads_q),
                  static_cast<unsigned>(f.batch));
  kernel<<<grid, sm90::kWarpgroupThreads, kSmem, stream>>>(f, v_descale);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_fwd_fp8_sm90_kernel launch");
}

}  // namespace
}  // namespace flash_cuda

void flash_attention_forward_fp8_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& o, const TensorView& lse, void* stream) {
  constexpr std::string_view fn = "attention_forward";
  FLASHLM_CHECK(flash_cuda::sm90_multiprocessors() > 0,
                "{}: q: dtype fp8_e4m3 runs only on an sm_90 GPU (H100/H200) with the sm_90a kernels loaded; "
                "this device is not one",
                fn);
  // The grid is (query tiles, heads_q, batch); blockIdx.y and .z stop at 65535, and the kernel indexes rows in int.
  FLASHLM_CHECK(p.heads_q <= 65535 && p.batch <= 65535, "{}: q: fp8_e4m3 takes at most 65535 heads and batch, got {} and {}",
                fn, p.heads_q, p.batch);
  FLASHLM_CHECK(p.seq_q < INT32_MAX - flash_cuda::kFp8BlockM && p.seq_k < INT32_MAX - flash_cuda::kFp8BlockN,
                "{}: q: fp8_e4m3 sequences must be shorter than 2^31 - 128, got seq_q {} and seq_k {}", fn, p.seq_q,
                p.seq_k);
  if (p.batch == 0 || p.heads_q == 0 || p.seq_q == 0) return;  // nothing to write
  auto f = flash_cuda::make_params(p, q, k, v, o, lse);
  const double scale = p.scale * p.q_descale * p.k_descale;  // S of the dequantised inputs
  f.scale = static_cast<float>(scale);
  f.scale_log2 = static_cast<float>(scale) * flash_cuda::kLog2e;
  const auto s = static_cast<cudaStream_t>(stream);
  const auto v_descale = static_cast<float>(p.v_descale);
  const bool launched = with_head_dim<kFp8ForwardHeadDims>(
      p.head_dim, [&](auto dim) { flash_cuda::launch_forward_fp8_sm90<dim.value>(f, v_descale, s); });
  FLASHLM_CHECK(launched, "{}: q: head_dim {} has no fp8_e4m3 kernel", fn, p.head_dim);  // the plan checked it
}

}  // namespace flashlm
