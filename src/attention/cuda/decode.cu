// flash_attention_with_kvcache on CUDA: flash-decoding. Three kernels on the caller's stream:
//   append   k_new / v_new rows into the cache at cache_seqlens[b] + t (16-byte vectors);
//   split    grid (split × row chunk, kv head, batch): each block takes one slice of one sequence's key range
//            (decode_split.h) for one key/value head and 16 query rows of its GQA group (group × nq rows, in
//            chunks of 16: an m16 tile), so K and V are read from HBM once per group (per row chunk, the chunks
//            of a split adjacent in the grid so that a re-read hits L2); it writes a partial (max, sum,
//            unnormalised acc) per row, or the final o and lse when there is one split;
//   combine  merges the splits of each row by logsumexp; on sm_90 launched as the split kernel's programmatic
//            dependent, so that its launch overlaps the split kernel's last blocks.
// The split kernel is bound by the bytes of K and V: its tiles of 64 keys stream through a ring of cp.async
// stages (two tiles in flight per block, two blocks per SM at d <= 128), and the arithmetic runs on tensor
// cores (mma.sync m16n8k16, each warp 16 keys of a tile) so that it issues few instructions per byte. The
// splits are chosen so that the grid fills the GPU's resident blocks in whole waves (kvcache_num_splits).
// Scores are kept in the log2 domain (exp2).
//
// The index arrays are trusted as flash-attn trusts them, but checked where they are read: a sequence whose
// length is negative or exceeds the capacity, or a block-table entry outside [0, num_pages), is neither
// appended nor read; its rows get NaN in o and lse.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attention/backends.h"
#include "attention/cuda/flash_common.cuh"
#include "attention/decode_split.h"
#include "core/check.h"
#include "core/cuda/programmatic_launch.cuh"
#include "core/cuda_check.h"
#include "flashlm/memory.h"

namespace flashlm {

namespace decode_cuda {

namespace fc = flash_cuda;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerBlock = 16;  // query rows of a split-kernel block: one m16 tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

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
  int rows;        // group · nq query rows per key/value head
  int row_chunks;  // ceil(rows / 16): the split kernel's blocks per (split, key/value head, sequence)
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

// ---- The split kernel: tensor cores over a cp.async ring of K/V tiles.
//
// One block of kWarps warps per (split, key/value head, row chunk, sequence). Its 16 query rows (an m16 tile:
// row r of the chunk is query (row0 + r) / group of head hk · group + (row0 + r) % group, rows past the
// group · nq rows of the head zero and masked) are the A operand of mma.sync m16n8k16; the split's keys stream
// through kStages shared-memory stages of kDecodeTileKeys keys (K and V), kStages - 1 tiles in flight while one
// is multiplied. Warp w takes keys [16w, 16w + 16) of every tile: S = Q·Kᵀ (16 x 16), its online softmax in
// registers, O += P·V with P re-packed as the A operand (the fragment addressing, swizzle and packing of
// flash_fwd.cu's kernel); the warps' (max, sum, accumulator) are merged in shared memory at the end.
template <int D>
struct SplitTraits {
  static constexpr int kRows = kRowsPerBlock;
  static constexpr int kStages = D == 64 ? 6 : 3;   // 96 KB of K/V stages at d64 and d128, 192 KB at d256
  static constexpr int kTileBytes = kDecodeTileKeys * D * 2;
  static constexpr size_t kQBytes = size_t(kRows) * D * 2;
  static constexpr size_t kPipeBytes = size_t(2) * kStages * kTileBytes;
  static constexpr size_t kMergeBytes = size_t(kWarps) * kRows * (D + 2) * sizeof(float);
  static constexpr size_t kSmemBytes = kQBytes + kPipeBytes > kMergeBytes ? kQBytes + kPipeBytes : kMergeBytes;
  // d64/d128: two blocks per SM (2 x 100 KB of shared memory); d256: one.
  static constexpr int kMinBlocks = D <= 128 ? 2 : 1;
  // Q's A fragments stay in registers up to d128 (32 registers); d256 re-reads them from shared memory.
  static constexpr bool kQInRegisters = D <= 128;
};

template <class T, int D>
__global__ void __launch_bounds__(kThreads, SplitTraits<D>::kMinBlocks) split_kernel(const DecodeParams p) {
  using Tr = SplitTraits<D>;
  using Mma = fc::MmaOp<T>;
  using Xs = fc::XorSwizzle<D>;  // D >= 64: the row-XOR swizzle
  constexpr int kRows = Tr::kRows, kStages = Tr::kStages, kN = kDecodeTileKeys, kChunks = D / 8;
  static_assert(kN == 16 * kWarps, "each warp takes 16 keys of a tile");
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kRows * D;
  T* sV = sK + kStages * kN * D;

  // The combine, launched as this grid's programmatic dependent, may place its blocks once every block here
  // has started; they wait for this grid to finish, so only their launch is earlier.
  gpu::allow_dependent_launch();
  const int chunk = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.row_chunks));
  const int split = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.row_chunks));
  const int hk = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int row0 = chunk * kRows, rows = min(kRows, p.rows - row0);

  const int cached = p.seqlens[b];
  bool bad = !sequence_valid(p, cached);
  const int len = bad ? 0 : cached + p.seq_new;
  // Every split of the sequence divides the keys any of its queries sees, the same way for each row chunk.
  const int lo = key_lo(p, len, 0), hi = max(lo, key_hi(p, len, p.nq - 1));
  const DecodeSplitRange range = decode_split_range(lo, hi, p.num_splits, split);

  // Q rows into shared memory (zeros past the head's rows); they travel in the first cp.async group.
  {
    const T* q = static_cast<const T*>(p.q);
    for (int c = tid; c < kRows * kChunks; c += kThreads) {
      const int r = c / kChunks, ch = c % kChunks;
      const T* src = q;
      int bytes = 0;
      if (r < rows) {
        const int rg = row0 + r, qi = rg / p.group, h = hk * p.group + rg % p.group;
        src = q + b * p.q_b + qi * p.q_s + h * p.q_h + ch * 8;
        bytes = 16;
      }
      fc::cp_async_16(fc::smem_addr(sQ + fc::Swizzle<D>::offset(r, ch)), src, bytes);
    }
  }

  // The keys this lane's two rows (g and g + 8 of the chunk) see within the split: [rlo, rhi).
  int rlo[2], rhi[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = g + 8 * rr;
    rlo[rr] = 0, rhi[rr] = 0;
    if (r < rows) {
      const int qi = (row0 + r) / p.group;
      rlo[rr] = max(key_lo(p, len, qi), range.first);
      rhi[rr] = min(key_hi(p, len, qi), range.end);
    }
  }

  // Tile i of the split into stage i % kStages. Thread tid copies 16-byte chunk tid % kChunks of the tile rows
  // tid / kChunks + j · kRowStep; a 16-row group of the tile lies in one page (tiles start at multiples of 64,
  // pages are multiples of 16 rows), so the block table is read once per group, and only for groups holding a
  // key of [range.first, range.end) (entries past a sequence's pages are never read). Rows outside that range
  // are zero-filled: their scores are masked, and P = 0 times a zero V row adds nothing.
  constexpr int kRowStep = kThreads / kChunks;  // 16 (d64), 8 (d128), 4 (d256)
  constexpr int kPerGroup = 16 / kRowStep;
  static_assert(kThreads % kChunks == 0 && 16 % kRowStep == 0, "a thread's rows tile each 16-row group");
  const int r_sub = tid / kChunks, ch = tid % kChunks;
  const T* k_head = static_cast<const T*>(p.k_cache) + hk * p.kc_h;
  const T* v_head = static_cast<const T*>(p.v_cache) + hk * p.vc_h;
  const int32_t* bt_row = p.block_table != nullptr ? p.block_table + b * p.bt_stride : nullptr;
  const uint32_t sQ_addr = fc::smem_addr(sQ), sK_addr = fc::smem_addr(sK), sV_addr = fc::smem_addr(sV);
  auto load_tile = [&](int i) {
    const int base = range.begin + i * kN;
    const int v_lo = range.first - base, v_hi = range.end - base;  // tile rows [v_lo, v_hi) are the split's
    const uint32_t k_dst = sK_addr + (i % kStages) * Tr::kTileBytes;
    const uint32_t v_dst = sV_addr + (i % kStages) * Tr::kTileBytes;
#pragma unroll
    for (int grp = 0; grp < kN / 16; ++grp) {
      int64_t k_off = 0, v_off = 0;
      bool ok = false;
      if (grp * 16 < v_hi && grp * 16 + 16 > v_lo) {
        const int gpos = base + grp * 16;  // < range.end: no overflow
        int page = b, prow = gpos;
        if (bt_row != nullptr) {
          page = bt_row[gpos / p.page_size];
          prow = gpos % p.page_size;
        }
        ok = page >= 0 && page < p.num_pages;  // non-paged: page = b < batch = num_pages
        if (!ok) bad = true;
        k_off = page * p.kc_p + prow * p.kc_r;
        v_off = page * p.vc_p + prow * p.vc_r;
      }
#pragma unroll
      for (int j = 0; j < kPerGroup; ++j) {
        const int rin = j * kRowStep + r_sub, r = grp * 16 + rin;
        const bool valid = ok && r >= v_lo && r < v_hi;
        const uint32_t dst_off = 2 * fc::Swizzle<D>::offset(r, ch);
        fc::cp_async_16(k_dst + dst_off, valid ? k_head + k_off + rin * p.kc_r + ch * 8 : k_head, valid ? 16 : 0);
        fc::cp_async_16(v_dst + dst_off, valid ? v_head + v_off + rin * p.vc_r + ch * 8 : v_head, valid ? 16 : 0);
      }
    }
  };

#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < range.tiles) load_tile(i);
    fc::cp_async_commit();  // one group per tile slot, empty or not, so that the wait counts stay fixed
  }

  // ldmatrix lane offsets (flash_fwd.cu): Q rows as A, K rows as B, V rows (transposed) as B.
  const uint32_t q_off = Xs::lane_offset(lane % 16, lane / 16);
  const uint32_t k_off = Xs::lane_offset((lane % 8) + (lane / 16) * 8, (lane / 8) % 2);
  const uint32_t v_off = Xs::lane_offset((lane % 8) + ((lane / 8) % 2) * 8, lane / 16);
  const float scale_log2 = p.scale * kLog2e;
  const float softcap_in = p.softcap > 0.0f ? p.scale / p.softcap : 0.0f;
  const float softcap_out = p.softcap * kLog2e;

  uint32_t qf[Tr::kQInRegisters ? D / 16 : 1][4];
  float acc[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};  // log2 domain; l is this lane's part of the quad's sum

  for (int i = 0; i < range.tiles; ++i) {
    fc::cp_async_wait<kStages - 2>();
    __syncthreads();  // tile i is visible to all; every warp is done with the stage tile i + kStages - 1 reuses
    if (i + kStages - 1 < range.tiles) load_tile(i + kStages - 1);
    fc::cp_async_commit();
    if constexpr (Tr::kQInRegisters) {
      if (i == 0) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) fc::ldmatrix_x4(qf[kk], sQ_addr + Xs::at(q_off, 0, kk));
      }
    }
    const uint32_t k_addr = sK_addr + (i % kStages) * Tr::kTileBytes;
    const uint32_t v_addr = sV_addr + (i % kStages) * Tr::kTileBytes;

    // S = Q Kᵀ over this warp's 16 keys: s[n] holds keys 16·warp + 8n + 2t + (e & 1) of rows g + 8·(e / 2).
    float s[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a_smem[4];
      const uint32_t* a = a_smem;
      if constexpr (Tr::kQInRegisters) a = qf[kk];
      else fc::ldmatrix_x4(a_smem, sQ_addr + Xs::at(q_off, 0, kk));
      uint32_t bk[4];
      fc::ldmatrix_x4(bk, k_addr + Xs::at(k_off, warp * 16, kk));
      Mma::run(s[0], a, bk);
      Mma::run(s[1], a, bk + 2);
    }

    // Scale (and soft-cap) into the log2 domain; keys a row does not see (or outside the split) become -inf.
    const int base = range.begin + i * kN;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = warp * 16 + n * 8 + 2 * t + (e & 1);  // within the tile (base + key may pass int32)
        const float x = s[n][e];
        const float v = p.softcap > 0.0f ? softcap_out * tanhf(x * softcap_in) : x * scale_log2;
        s[n][e] = key >= rlo[e / 2] - base && key < rhi[e / 2] - base ? v : kNegInf;
      }

    // Online softmax of the two rows: rescale by exp2(m_old - m_new), P = exp2(S - m_new).
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float mx = max_propagating_nan(max_propagating_nan(s[0][2 * rr], s[0][2 * rr + 1]),
                                     max_propagating_nan(s[1][2 * rr], s[1][2 * rr + 1]));
      mx = fc::quad_max(mx);
      const float m_new = max_propagating_nan(m[rr], mx);
      const float m_use = m_new == kNegInf ? 0.0f : m_new;  // nothing visible yet: P = 0, alpha = 0, no NaN
      const float alpha = fc::fast_exp2(m[rr] - m_use);
      m[rr] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        s[n][2 * rr] = fc::fast_exp2(s[n][2 * rr] - m_use);
        s[n][2 * rr + 1] = fc::fast_exp2(s[n][2 * rr + 1] - m_use);
        sum += s[n][2 * rr] + s[n][2 * rr + 1];
      }
      l[rr] = l[rr] * alpha + sum;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        acc[dt][2 * rr] *= alpha;
        acc[dt][2 * rr + 1] *= alpha;
      }
    }

    // O += P V: P's C fragments re-packed as the A operand of this warp's 16 keys.
    uint32_t pa[4];
    pa[0] = Mma::pack(s[0][0], s[0][1]);
    pa[1] = Mma::pack(s[0][2], s[0][3]);
    pa[2] = Mma::pack(s[1][0], s[1][1]);
    pa[3] = Mma::pack(s[1][2], s[1][3]);
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt) {
      uint32_t bv[4];
      fc::ldmatrix_x4_trans(bv, v_addr + Xs::at(v_off, warp * 16, dt));
      Mma::run(acc[2 * dt], pa, bv);
      Mma::run(acc[2 * dt + 1], pa, bv + 2);
    }
  }

  // Merge the warps in shared memory (over the stages: every copy has landed and every warp is done with them).
  fc::cp_async_wait_all();
  __syncthreads();
  float* sm_acc = reinterpret_cast<float*>(smem_raw);  // [kWarps][kRows][D]
  float* sm_m = sm_acc + kWarps * kRows * D;           // [kWarps][kRows]
  float* sm_l = sm_m + kWarps * kRows;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = g + 8 * rr;
    const float lsum = fc::quad_sum(l[rr]);
    if (t == 0) sm_m[warp * kRows + r] = m[rr], sm_l[warp * kRows + r] = lsum;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<float2*>(&sm_acc[(warp * kRows + r) * D + dt * 8 + 2 * t]) =
          make_float2(acc[dt][2 * rr], acc[dt][2 * rr + 1]);
    }
  }
  bad = __syncthreads_or(bad);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int idx = tid; idx < rows * D; idx += kThreads) {
    const int r = idx / D, e = idx % D;
    float mx = kNegInf;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = max_propagating_nan(mx, sm_m[w * kRows + r]);
    float sum = 0.0f, a = 0.0f;
    if (mx != kNegInf) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float wt = exp2f(sm_m[w * kRows + r] - mx);
        sum = fmaf(sm_l[w * kRows + r], wt, sum);
        a = fmaf(sm_acc[(w * kRows + r) * D + e], wt, a);
      }
    }
    const int rg = row0 + r, qi = rg / p.group, h = hk * p.group + rg % p.group;
    if (p.num_splits == 1) {
      // sum 0: the row sees no key (o = 0, lse = -inf); sum NaN: a NaN reached the row (o and lse NaN).
      const float out = bad ? nan : (sum != 0.0f ? a / sum : 0.0f);
      static_cast<T*>(p.o)[b * p.o_b + qi * p.o_s + h * p.o_h + e] = fc::from_float<T>(out);
      if (e == 0 && p.lse != nullptr) {
        p.lse[b * p.lse_b + h * p.lse_h + qi * p.lse_s] =
            bad ? nan : (sum != 0.0f ? (mx + log2f(sum)) * kLn2 : kNegInf);
      }
    } else {
      const int64_t part = ((static_cast<int64_t>(b) * p.heads_q + h) * p.nq + qi) * p.num_splits + split;
      p.part_acc[part * D + e] = a;
      if (e == 0) p.part_ml[2 * part] = mx, p.part_ml[2 * part + 1] = bad ? nan : sum;
    }
  }
}

// One block of D threads per query row (b, h, qi): the splits' partials merged by logsumexp. A NaN sum marks a
// split that met a bad index or a NaN: the row is NaN. The kernel is latency-bound (a few hundred KB of partials at
// batch 1, read right after the split kernel wrote them), so every load is issued before any is used: each
// thread's accumulators of the first kChunk splits go out beside the maxima and sums, as they do not depend on
// the weights; every further kChunk splits cost one more round trip (the loop used to make one per 8 splits).
// The sums run in the same order as before, so the bits are the same.
template <class T, int D>
__global__ void __launch_bounds__(D) combine_kernel(const DecodeParams p) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int kChunk = 32;
  __shared__ float sm_w[kDecodeMaxSplits], sm_l[kDecodeMaxSplits];
  const int64_t row = blockIdx.x;
  const int e = threadIdx.x, splits = p.num_splits;
  // Launched as a programmatic dependent of the split kernel (launch_attention): this block may be resident
  // before the split grid has finished; wait here until it has and its partials are visible.
  gpu::wait_for_prerequisite_grids();
  const int qi = static_cast<int>(row % p.nq), h = static_cast<int>(row / p.nq % p.heads_q);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.nq) * p.heads_q));
  const float* ml = p.part_ml + row * splits * 2;
  const float* acc = p.part_acc + row * splits * D;
  float part[kChunk];
#pragma unroll
  for (int i = 0; i < kChunk; ++i) part[i] = i < splits ? acc[i * D + e] : 0.0f;
  for (int s = e; s < splits; s += D) sm_w[s] = ml[2 * s], sm_l[s] = ml[2 * s + 1];
  __syncthreads();
  float mx = kNegInf;
  bool bad = false;
  for (int s = 0; s < splits; ++s) {
    mx = fmaxf(mx, sm_w[s]);
    bad = bad || isnan(sm_l[s]);
  }
  __syncthreads();  // every thread has read the maxima before they become weights
  for (int s = e; s < splits; s += D) sm_w[s] = mx == kNegInf ? 0.0f : exp2f(sm_w[s] - mx);
  __syncthreads();
  float sum = 0.0f, a = 0.0f;
  if (mx != kNegInf) {
    for (int s = 0; s < splits; ++s) sum = fmaf(sm_l[s], sm_w[s], sum);
    for (int c = 0; c < splits; c += kChunk) {
      if (c > 0) {
#pragma unroll
        for (int i = 0; i < kChunk; ++i) part[i] = c + i < splits ? acc[(c + i) * D + e] : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        if (c + i < splits) a = fmaf(part[i], sm_w[c + i], a);
      }
    }
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  static_cast<T*>(p.o)[b * p.o_b + qi * p.o_s + h * p.o_h + e] =
      fc::from_float<T>(bad ? nan : (sum != 0.0f ? a / sum : 0.0f));
  if (e == 0 && p.lse != nullptr) {
    p.lse[b * p.lse_b + h * p.lse_h + qi * p.lse_s] = bad ? nan : (sum != 0.0f ? (mx + log2f(sum)) * kLn2 : kNegInf);
  }
}

// The blocks of the split kernel the device holds at once (resident blocks per SM x SMs), with the kernel's
// shared-memory opt-in done: once per device and instantiation (the host cost of a decoding call counts).
constexpr int kCachedDevices = 64;
template <class T, int D>
int split_kernel_slots(int device) {
  static std::atomic<int> cache[kCachedDevices] = {};
  if (device >= 0 && device < kCachedDevices) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  using Tr = SplitTraits<D>;
  FLASHLM_CUDA_CHECK(cudaFuncSetAttribute(split_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(Tr::kSmemBytes)),
                     "flash_attention_with_kvcache: split kernel shared-memory opt-in");
  // All of the unified L1 as shared memory, so that two blocks fit an SM (the carveout is otherwise the
  // driver's choice, which may hold one).
  FLASHLM_CUDA_CHECK(cudaFuncSetAttribute(split_kernel<T, D>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          static_cast<int>(cudaSharedmemCarveoutMaxShared)),
                     "flash_attention_with_kvcache: split kernel shared-memory carveout");
  int resident = 0, multiprocessors = 0;
  FLASHLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, split_kernel<T, D>, kThreads,
                                                                   Tr::kSmemBytes),
                     "flash_attention_with_kvcache: split kernel occupancy");
  FLASHLM_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device),
                     "flash_attention_with_kvcache: multiprocessor count");
  const int slots = std::max(resident, 1) * std::max(multiprocessors, 1);
  if (device >= 0 && device < kCachedDevices) cache[device].store(slots, std::memory_order_relaxed);
  return slots;
}

// Splits from the blocks the device holds at once, then the workspace, the split kernel and the combine.
template <class T, int D>
void launch_attention(DecodeParams p, const AttentionProblem& a, int device, cudaStream_t stream) {
  using Tr = SplitTraits<D>;
  const int slots = split_kernel_slots<T, D>(device);
  p.num_splits = static_cast<int>(
      kvcache_num_splits(p.capacity, static_cast<int64_t>(a.batch) * a.heads_k * p.row_chunks, slots));
  FLASHLM_CHECK(static_cast<int64_t>(p.num_splits) * p.row_chunks <= std::numeric_limits<int32_t>::max(),
                "flash_attention_with_kvcache: q: {} row chunks x {} splits exceed the cuda grid", p.row_chunks,
                p.num_splits);
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
  const dim3 grid(static_cast<unsigned>(p.num_splits * p.row_chunks), static_cast<unsigned>(p.heads_k),
                  static_cast<unsigned>(p.batch));
  split_kernel<T, D><<<grid, kThreads, Tr::kSmemBytes, stream>>>(p);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_attention_with_kvcache: split kernel launch");
  if (p.num_splits > 1) {
    // Programmatic (sm_90): the combine's launch overlaps the split kernel's last blocks, off the end of a short
    // decoding call.
    const auto rows = static_cast<unsigned>(static_cast<int64_t>(p.batch) * p.heads_q * p.nq);
    gpu::launch_programmatic("flash_attention_with_kvcache: combine kernel launch", combine_kernel<T, D>, dim3(rows),
                             dim3(D), 0, stream, p);
  }
}

template <class T>
void launch_attention_head_dim(const DecodeParams& p, const AttentionProblem& a, int device, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_attention<T, 64>(p, a, device, stream);
    case 128: return launch_attention<T, 128>(p, a, device, stream);
    case 256: return launch_attention<T, 256>(p, a, device, stream);
    default: fail("flash_attention_with_kvcache: no cuda kernel for head_dim {}", p.head_dim);
  }
}

// A bound of int32 range for a window side: any width past the capacity and the queries sees everything.
int window_side(int64_t w, int64_t capacity, int64_t nq) {
  if (w < 0) return -1;
  return static_cast<int>(std::min(w, capacity + nq));
}

}  // namespace decode_cuda

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
  p.row_chunks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  FLASHLM_CHECK(a.heads_k <= 65535, "flash_attention_with_kvcache: k_cache: {} key/value heads exceed the cuda grid's "
                "65535", a.heads_k);
  int device = 0;
  FLASHLM_CUDA_CHECK(cudaGetDevice(&device), "flash_attention_with_kvcache: cudaGetDevice");
  if (a.dtype == DType::bf16) launch_attention_head_dim<__nv_bfloat16>(p, a, device, s);
  else launch_attention_head_dim<__half>(p, a, device, s);
}

}  // namespace flashlm
