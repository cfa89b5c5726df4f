// flash_attention_with_kvcache on CUDA: flash-decoding. Three kernels on the caller's stream:
//   append   k_new / v_new rows into the cache at cache_seqlens[b] + t (16-byte vectors);
//   split    grid (split, kv head × row chunk, batch): each block takes one slice of one sequence's key range
//            for one key/value head and every query row of its GQA group (group × nq rows, in chunks of
//            kRows), so K and V are read from HBM once per group (per row chunk); it writes a partial
//            (max, sum, unnormalised acc) per row, or the final o and lse when there is one split;
//   combine  merges the splits of each row by logsumexp.
// The split kernel runs on CUDA cores: it is bound by the bytes of K and V, not by arithmetic. Each warp is cut
// into groups of D/8 lanes, one key per group and one 16-byte vector (8 elements of head_dim) per lane, so a
// key row is read as whole 16-byte vectors along head_dim; a group keeps its own online softmax (max, sum,
// accumulator of its 8 columns) over the keys it visits, and the block merges its groups in shared memory at
// the end. Scores are kept in the log2 domain (exp2).
//
// The index arrays are trusted as flash-attn trusts them, but checked where they are read: a sequence whose
// length is negative or exceeds the capacity, or a block-table entry outside [0, num_pages), is neither
// appended nor read; its rows get NaN in o and lse.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention/backends.h"
#include "core/check.h"
#include "core/cuda_check.h"
#include "flashlm/memory.h"

namespace flashlm {

namespace decode_cuda {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// Keys of one split are a multiple of this (a whole number of 16-byte-aligned page rows at any page size).
constexpr int kSplitKeyMultiple = 16;
// At most this many splits: the combine reads every split of a row, and more add no parallelism.
constexpr int64_t kMaxSplits = 128;
// A split takes at least this many keys, so that its block has enough loads to be worth launching.
constexpr int64_t kMinKeysPerSplit = 128;

struct DecodeParams {
  const void* q;
  void* o;
  float* lse;  // null without lse
  void* k_cache;
  void* v_cache;
  const void* k_new;
  const void* v_new;
  const int32_t* seqlens;
  const int32_t* block_table;  // null: non-paged
  int64_t q_b, q_s, q_h, o_b, o_s, o_h;
  int64_t kc_p, kc_r, kc_h, vc_p, vc_r, vc_h;  // page (non-paged: batch), row, head strides
  int64_t kn_b, kn_s, kn_h, vn_b, vn_s, vn_h;
  int64_t lse_b, lse_h, lse_s;
  int64_t bt_stride;
  int batch, nq, heads_q, heads_k, group, head_dim, seq_new;
  int page_size, num_pages, capacity;
  int rows;  // group · nq query rows per key/value head
  int window_left, right_bound;  // -1: unbounded (right_bound is 0 when causal)
  float scale, softcap;          // softcap 0: off
  int num_splits;
  float* part_acc;  // [batch · heads_q · nq, num_splits, head_dim]
  float* part_ml;   // [batch · heads_q · nq, num_splits, 2]: max (log2 domain), sum
};

__device__ __forceinline__ bool sequence_valid(const DecodeParams& p, int len) {
  return len >= 0 && len <= p.capacity - p.seq_new;
}

// The page holding key `pos` of sequence b and the row in it; page < 0 where the block table is bad.
__device__ __forceinline__ int page_of(const DecodeParams& p, int b, int pos, int& row) {
  if (p.block_table == nullptr) {
    row = pos;
    return b;
  }
  const int page = p.block_table[b * p.bt_stride + pos / p.page_size];
  row = pos % p.page_size;
  return page >= 0 && page < p.num_pages ? page : -1;
}

// The keys query qi of a sequence of `len` keys sees: [key_lo, key_hi) (bottom-right alignment).
__device__ __forceinline__ int key_lo(const DecodeParams& p, int len, int qi) {
  if (p.window_left < 0) return 0;
  return min(len, max(0, len - p.nq + qi - p.window_left));
}
__device__ __forceinline__ int key_hi(const DecodeParams& p, int len, int qi) {
  if (p.right_bound < 0) return len;
  return min(len, max(0, len - p.nq + qi + p.right_bound + 1));
}

template <class T>
struct Vec8;
template <>
struct Vec8<__nv_bfloat16> {
  static __device__ __forceinline__ void to_float(const uint4& v, float (&f)[8]) {
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __bfloat1622float2(h[i]);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
  static __device__ __forceinline__ uint4 from_float(const float (&f)[8]) {
    uint4 v;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
  static __device__ __forceinline__ __nv_bfloat16 one(float x) { return __float2bfloat16(x); }
};
template <>
struct Vec8<__half> {
  static __device__ __forceinline__ void to_float(const uint4& v, float (&f)[8]) {
    const auto* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __half22float2(h[i]);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
  static __device__ __forceinline__ uint4 from_float(const float (&f)[8]) {
    uint4 v;
    auto* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
  static __device__ __forceinline__ __half one(float x) { return __float2half(x); }
};

// One thread block per (token, sequence): the heads_k · head_dim / 8 vectors of k_new and v_new at that token.
__global__ void append_kernel(const DecodeParams p) {
  const int t = blockIdx.x, b = blockIdx.y;
  const int len = p.seqlens[b];
  if (!sequence_valid(p, len)) return;
  int row = 0;
  const int page = page_of(p, b, len + t, row);
  if (page < 0) return;
  const int vectors = p.head_dim / 8;
  for (int i = threadIdx.x; i < p.heads_k * vectors; i += blockDim.x) {
    const int h = i / vectors, c = (i % vectors) * 8;
    // The elements are 2 bytes; the offsets count elements, hence the uint16_t base pointers.
    const auto* kn = static_cast<const uint16_t*>(p.k_new) + b * p.kn_b + t * p.kn_s + h * p.kn_h + c;
    const auto* vn = static_cast<const uint16_t*>(p.v_new) + b * p.vn_b + t * p.vn_s + h * p.vn_h + c;
    auto* kc = static_cast<uint16_t*>(p.k_cache) + page * p.kc_p + row * p.kc_r + h * p.kc_h + c;
    auto* vc = static_cast<uint16_t*>(p.v_cache) + page * p.vc_p + row * p.vc_r + h * p.vc_h + c;
    *reinterpret_cast<uint4*>(kc) = *reinterpret_cast<const uint4*>(kn);
    *reinterpret_cast<uint4*>(vc) = *reinterpret_cast<const uint4*>(vn);
  }
}

// Row r of a key/value head's rows is query r / group of query head hk · group + r % group.
template <class T, int D, int ROWS>
__global__ void __launch_bounds__(kThreads) split_kernel(const DecodeParams p) {
  constexpr int kLanesPerKey = D / 8;              // one 16-byte vector each
  constexpr int kKeysPerWarp = 32 / kLanesPerKey;  // keys a warp reads per step
  constexpr int kUnroll = ROWS == 8 ? 2 : 4;       // steps in flight per iteration (registers allow it)
  constexpr int kGroups = kWarps * kKeysPerWarp;
  constexpr int kKeysPerIteration = kGroups * kUnroll;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  __shared__ float sm_m[kGroups][ROWS], sm_l[kGroups][ROWS];
  __shared__ __align__(16) float sm_acc[kGroups][ROWS][D];

  const int split = blockIdx.x, hk = blockIdx.y % p.heads_k, chunk = blockIdx.y / p.heads_k, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_in_warp = lane / kLanesPerKey, col = (lane % kLanesPerKey) * 8;
  const int grp = warp * kKeysPerWarp + group_in_warp;
  const int row0 = chunk * ROWS, rows = min(ROWS, p.rows - row0);

  const int cached = p.seqlens[b];
  bool bad = !sequence_valid(p, cached);
  const int len = bad ? 0 : cached + p.seq_new;
  // Every split of the sequence divides the keys any of its queries sees, the same way for each row chunk.
  const int lo = key_lo(p, len, 0), hi = max(lo, key_hi(p, len, p.nq - 1));
  // In 64 bits: split · per_split may pass the int32 range for a cache near it.
  const int64_t per_split = ((static_cast<int64_t>(hi) - lo + p.num_splits - 1) / p.num_splits +
                             kSplitKeyMultiple - 1) / kSplitKeyMultiple * kSplitKeyMultiple;
  const int kb = static_cast<int>(min(static_cast<int64_t>(hi), lo + static_cast<int64_t>(split) * per_split));
  const int ke = static_cast<int>(min(static_cast<int64_t>(hi), static_cast<int64_t>(kb) + per_split));

  float q[ROWS][8];
  int row_lo[ROWS], row_hi[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    row_lo[r] = 0, row_hi[r] = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) q[r][e] = 0.0f;
    if (r < rows) {
      const int rg = row0 + r, qi = rg / p.group, h = hk * p.group + rg % p.group;
      const auto* src = static_cast<const T*>(p.q) + b * p.q_b + qi * p.q_s + h * p.q_h + col;
      Vec8<T>::to_float(*reinterpret_cast<const uint4*>(src), q[r]);
#pragma unroll
      for (int e = 0; e < 8; ++e) q[r][e] *= p.scale;
      row_lo[r] = key_lo(p, len, qi), row_hi[r] = key_hi(p, len, qi);
    }
  }

  float m[ROWS], l[ROWS], acc[ROWS][8];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    m[r] = kNegInf, l[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.0f;
  }

  const auto* k_base = static_cast<const T*>(p.k_cache) + hk * p.kc_h + col;
  const auto* v_base = static_cast<const T*>(p.v_cache) + hk * p.vc_h + col;
  for (int base = kb; base < ke; base += kKeysPerIteration) {
    uint4 kv[kUnroll], vv[kUnroll];
    int key[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      key[u] = base + (warp * kUnroll + u) * kKeysPerWarp + group_in_warp;
      kv[u] = make_uint4(0, 0, 0, 0), vv[u] = make_uint4(0, 0, 0, 0);
      if (key[u] < ke) {
        int row = 0;
        const int page = page_of(p, b, key[u], row);
        if (page < 0) {
          bad = true;
        } else {
          kv[u] = __ldg(reinterpret_cast<const uint4*>(k_base + page * p.kc_p + row * p.kc_r));
          vv[u] = __ldg(reinterpret_cast<const uint4*>(v_base + page * p.vc_p + row * p.vc_r));
        }
      }
    }
    float s[kUnroll][ROWS];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[8];
      Vec8<T>::to_float(kv[u], kf);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        s[u][r] = kNegInf;
        if (r < rows) {
          float d = 0.0f;
#pragma unroll
          for (int e = 0; e < 8; ++e) d = fmaf(q[r][e], kf[e], d);
#pragma unroll
          for (int off = kLanesPerKey / 2; off > 0; off /= 2) d += __shfl_xor_sync(0xffffffffu, d, off);
          if (p.softcap > 0.0f) d = p.softcap * tanhf(d / p.softcap);
          if (key[u] >= row_lo[r] && key[u] < row_hi[r] && key[u] < ke) s[u][r] = d * kLog2e;
        }
      }
    }
    // The online softmax of this group's rows: rescale by the new max, then s becomes the probabilities.
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) mx = fmaxf(mx, s[u][r]);
      if (mx == kNegInf) continue;  // nothing visible yet: s stays -inf and gives p = 0 below
      const float alpha = exp2f(m[r] - mx);
      m[r] = mx;
      l[r] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        s[u][r] = exp2f(s[u][r] - mx);
        l[r] += s[u][r];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float vf[8];
      Vec8<T>::to_float(vv[u], vf);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (m[r] == kNegInf) continue;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(s[u][r], vf[e], acc[r][e]);
      }
    }
  }

  // Merge the groups: each writes its rows' state, then the block combines them column by column.
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (col == 0) sm_m[grp][r] = m[r], sm_l[grp][r] = l[r];
    auto* dst = reinterpret_cast<float4*>(&sm_acc[grp][r][col]);
    dst[0] = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    dst[1] = make_float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
  }
  bad = __syncthreads_or(bad);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int idx = threadIdx.x; idx < rows * D; idx += kThreads) {
    const int r = idx / D, e = idx % D;
    float mx = kNegInf;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) mx = fmaxf(mx, sm_m[g][r]);
    float sum = 0.0f, a = 0.0f;
    if (mx != kNegInf) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        const float w = exp2f(sm_m[g][r] - mx);
        sum = fmaf(sm_l[g][r], w, sum);
        a = fmaf(sm_acc[g][r][e], w, a);
      }
    }
    const int rg = row0 + r, qi = rg / p.group, h = hk * p.group + rg % p.group;
    if (p.num_splits == 1) {
      const float out = bad ? nan : (sum > 0.0f ? a / sum : 0.0f);
      static_cast<T*>(p.o)[b * p.o_b + qi * p.o_s + h * p.o_h + e] = Vec8<T>::one(out);
      if (e == 0 && p.lse != nullptr) {
        p.lse[b * p.lse_b + h * p.lse_h + qi * p.lse_s] =
            bad ? nan : (sum > 0.0f ? (mx + log2f(sum)) * kLn2 : kNegInf);
      }
    } else {
      const int64_t part = ((static_cast<int64_t>(b) * p.heads_q + h) * p.nq + qi) * p.num_splits + split;
      p.part_acc[part * D + e] = a;
      if (e == 0) p.part_ml[2 * part] = mx, p.part_ml[2 * part + 1] = bad ? nan : sum;
    }
  }
}

// One block of D threads per query row (b, h, qi): the splits' partials merged by logsumexp.
template <class T, int D>
__global__ void __launch_bounds__(D) combine_kernel(const DecodeParams p) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t row = blockIdx.x;
  const int e = threadIdx.x;
  const int qi = static_cast<int>(row % p.nq), h = static_cast<int>(row / p.nq % p.heads_q);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.nq) * p.heads_q));
  const float* ml = p.part_ml + row * p.num_splits * 2;
  const float* acc = p.part_acc + row * p.num_splits * D;
  float mx = kNegInf;
  bool bad = false;
  for (int s = 0; s < p.num_splits; ++s) {
    mx = fmaxf(mx, ml[2 * s]);
    bad = bad || isnan(ml[2 * s + 1]);
  }
  float sum = 0.0f, a = 0.0f;
  if (mx != kNegInf) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = exp2f(ml[2 * s] - mx);
      sum = fmaf(ml[2 * s + 1], w, sum);
      a = fmaf(acc[s * D + e], w, a);
    }
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  static_cast<T*>(p.o)[b * p.o_b + qi * p.o_s + h * p.o_h + e] = Vec8<T>::one(bad ? nan : (sum > 0.0f ? a / sum : 0.0f));
  if (e == 0 && p.lse != nullptr) {
    p.lse[b * p.lse_b + h * p.lse_h + qi * p.lse_s] = bad ? nan : (sum > 0.0f ? (mx + log2f(sum)) * kLn2 : kNegInf);
  }
}

// Splits from the resident blocks the split kernel gets per SM (its occupancy), then the workspace, the split
// kernel and the combine.
template <class T, int D, int ROWS>
void launch_attention(DecodeParams p, const AttentionProblem& a, int row_chunks, int multiprocessors,
                      cudaStream_t stream) {
  int resident = 0;
  FLASHLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, split_kernel<T, D, ROWS>, kThreads, 0),
                     "flash_attention_with_kvcache: split kernel occupancy");
  p.num_splits = static_cast<int>(kvcache_num_splits(p.capacity, a.batch * a.heads_k * row_chunks,
                                                     std::max(resident, 1) * multiprocessors));
  Buffer workspace;
  if (p.num_splits > 1) {
    const int64_t parts = checked_product({a.batch, a.heads_q, a.seq_q, p.num_splits},
                                          "flash_attention_with_kvcache: split partials");
    const int64_t floats = checked_mul(parts, a.head_dim + 2, "flash_attention_with_kvcache: split partials");
    workspace = Buffer::allocate_on_stream(static_cast<size_t>(floats) * sizeof(float),
                                           "flash_attention_with_kvcache: split partials", stream);
    p.part_acc = static_cast<float*>(workspace.data());
    p.part_ml = p.part_acc + parts * a.head_dim;
  }
  const dim3 grid(static_cast<unsigned>(p.num_splits), static_cast<unsigned>(p.heads_k * row_chunks),
                  static_cast<unsigned>(p.batch));
  split_kernel<T, D, ROWS><<<grid, kThreads, 0, stream>>>(p);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_attention_with_kvcache: split kernel launch");
  if (p.num_splits > 1) {
    const auto rows = static_cast<unsigned>(static_cast<int64_t>(p.batch) * p.heads_q * p.nq);
    combine_kernel<T, D><<<rows, D, 0, stream>>>(p);
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_attention_with_kvcache: combine kernel launch");
  }
}

template <class T>
void launch_attention_head_dim(const DecodeParams& p, const AttentionProblem& a, int row_chunks, int rows_per_block,
                               int multiprocessors, cudaStream_t stream) {
  const auto launch = [&](auto d) {
    constexpr int D = decltype(d)::value;
    if (rows_per_block == 4) launch_attention<T, D, 4>(p, a, row_chunks, multiprocessors, stream);
    else launch_attention<T, D, 8>(p, a, row_chunks, multiprocessors, stream);
  };
  switch (p.head_dim) {
    case 64: return launch(std::integral_constant<int, 64>{});
    case 128: return launch(std::integral_constant<int, 128>{});
    case 256: return launch(std::integral_constant<int, 256>{});
    default: fail("flash_attention_with_kvcache: no cuda kernel for head_dim {}", p.head_dim);
  }
}

// A bound of int32 range for a window side: any width past the capacity and the queries sees everything.
int window_side(int64_t w, int64_t capacity, int64_t nq) {
  if (w < 0) return -1;
  return static_cast<int>(std::min(w, capacity + nq));
}

}  // namespace decode_cuda

int64_t kvcache_num_splits(int64_t capacity, int64_t other_blocks, int resident_blocks) {
  using namespace decode_cuda;
  if (other_blocks <= 0 || capacity <= 0) return 1;
  // One wave of resident blocks: fewer leaves SMs idle, more only adds partials to combine.
  const int64_t wanted = (std::max(resident_blocks, 1) + other_blocks - 1) / other_blocks;
  const int64_t most = std::max<int64_t>(1, std::min(kMaxSplits, capacity / kMinKeysPerSplit));
  return std::clamp<int64_t>(wanted, 1, most);
}

void kvcache_attention_cuda(const KvCacheProblem& kp, const TensorView& q, const TensorView& k_cache,
                            const TensorView& v_cache, const KvCacheIndex& index, const TensorView& k_new,
                            const TensorView& v_new, const TensorView& o, const TensorView& lse, void* stream) {
  using namespace decode_cuda;
  const AttentionProblem& a = kp.attn;
  if (a.batch == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  DecodeParams p{};
  p.q = q.data, p.o = o.data, p.lse = kp.has_lse ? lse.ptr<float>() : nullptr;
  p.k_cache = k_cache.data, p.v_cache = v_cache.data;
  p.seqlens = index.cache_seqlens, p.block_table = kp.paged ? index.block_table : nullptr;
  p.q_b = q.stride(0), p.q_s = q.stride(1), p.q_h = q.stride(2);
  p.o_b = o.stride(0), p.o_s = o.stride(1), p.o_h = o.stride(2);
  p.kc_p = k_cache.stride(0), p.kc_r = k_cache.stride(1), p.kc_h = k_cache.stride(2);
  p.vc_p = v_cache.stride(0), p.vc_r = v_cache.stride(1), p.vc_h = v_cache.stride(2);
  if (kp.has_lse) p.lse_b = lse.stride(0), p.lse_h = lse.stride(1), p.lse_s = lse.stride(2);
  p.bt_stride = kp.block_table_stride;
  p.batch = static_cast<int>(a.batch), p.nq = static_cast<int>(a.seq_q);
  p.heads_q = static_cast<int>(a.heads_q), p.heads_k = static_cast<int>(a.heads_k);
  p.group = static_cast<int>(a.group()), p.head_dim = static_cast<int>(a.head_dim);
  p.seq_new = static_cast<int>(kp.seq_new);
  p.page_size = static_cast<int>(kp.page_size), p.num_pages = static_cast<int>(std::min<int64_t>(
                                                    kp.num_pages, std::numeric_limits<int32_t>::max()));
  p.capacity = static_cast<int>(kp.capacity());
  p.window_left = window_side(a.window_left, kp.capacity(), a.seq_q);
  p.right_bound = window_side(a.right_bound(), kp.capacity(), a.seq_q);
  p.scale = static_cast<float>(a.scale), p.softcap = static_cast<float>(a.softcap);
  FLASHLM_CHECK(a.seq_q <= std::numeric_limits<int32_t>::max() / std::max<int64_t>(a.heads_q, 1) &&
                    kp.seq_new <= std::numeric_limits<int32_t>::max(),
                "flash_attention_with_kvcache: q: {} queries x {} heads exceed the cuda kernels' int32 rows",
                a.seq_q, a.heads_q);

  if (kp.seq_new > 0) {
    p.k_new = k_new.data, p.v_new = v_new.data;
    p.kn_b = k_new.stride(0), p.kn_s = k_new.stride(1), p.kn_h = k_new.stride(2);
    p.vn_b = v_new.stride(0), p.vn_s = v_new.stride(1), p.vn_h = v_new.stride(2);
    append_kernel<<<dim3(static_cast<unsigned>(kp.seq_new), static_cast<unsigned>(a.batch)), 128, 0, s>>>(p);
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_attention_with_kvcache: append kernel launch");
  }
  if (a.seq_q == 0 || a.heads_q == 0) return;

  p.rows = static_cast<int>(a.group() * a.seq_q);
  const int rows_per_block = p.rows <= 4 ? 4 : 8;
  const int64_t row_chunks = (p.rows + rows_per_block - 1) / rows_per_block;
  FLASHLM_CHECK(a.heads_k * row_chunks <= 65535,
                "flash_attention_with_kvcache: q: heads_k {} x {} row chunks of {} (group x nq) rows exceed the cuda "
                "grid's 65535",
                a.heads_k, row_chunks, rows_per_block);
  int device = 0, multiprocessors = 0;
  FLASHLM_CUDA_CHECK(cudaGetDevice(&device), "flash_attention_with_kvcache: cudaGetDevice");
  FLASHLM_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device),
                     "flash_attention_with_kvcache: multiprocessor count");
  const int chunks = static_cast<int>(row_chunks);
  if (a.dtype == DType::bf16) launch_attention_head_dim<__nv_bfloat16>(p, a, chunks, rows_per_block, multiprocessors, s);
  else launch_attention_head_dim<__half>(p, a, chunks, rows_per_block, multiprocessors, s);
}

}  // namespace flashlm
