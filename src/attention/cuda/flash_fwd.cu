// FlashAttention-2 forward on tensor cores (mma.sync m16n8k16, fp16/bf16, fp32 accumulation).
//
// One block per (query tile of kBlockM rows, query head, batch); each warp owns 16·kMTiles query rows. K and V
// tiles stream through two shared-memory stages with cp.async, so the next tile loads while this one is
// multiplied. S = Q·Kᵀ stays in registers, the online softmax works on it in place (exp2 with log2(e)
// folded into the scale), and its accumulator fragments are re-packed directly as the A operand of
// O += P·V — P never touches shared memory. Key tiles that the causal mask (or a sliding window) hides are
// never loaded; only tiles that cross the diagonal (the band's edges) or the end of the keys are masked.
// Sliding window, soft-capping, ALiBi and attention sinks take a second instantiation of the kernel (kMasked),
// so that the plain one carries none of their work.
#include "attention/backends.h"
#include "attention/capabilities.h"
#include "attention/cuda/flash_common.cuh"
#include "core/cuda_check.h"

namespace flashlm {
namespace flash_cuda {

FlashParams make_params(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& o, const TensorView& lse) {
  FlashParams f{};
  f.q = q.data;
  f.k = k.data;
  f.v = v.data;
  f.o = o.data;
  f.lse = lse.ptr<float>();
  f.q_st = row_strides(q);
  f.k_st = row_strides(k);
  f.v_st = row_strides(v);
  f.o_st = row_strides(o);
  f.lse_b = lse.stride(0);
  f.lse_h = lse.stride(1);
  f.lse_s = lse.stride(2);
  f.batch = static_cast<int>(p.batch);
  f.seq_q = static_cast<int>(p.seq_q);
  f.seq_k = static_cast<int>(p.seq_k);
  f.heads_q = static_cast<int>(p.heads_q);
  f.heads_k = static_cast<int>(p.heads_k);
  f.group = static_cast<int>(p.group());
  const double scale = p.scale * p.q_descale * p.k_descale;  // the score of the dequantised values (1 and 1 but FP8)
  f.scale = static_cast<float>(scale);
  f.scale_log2 = static_cast<float>(scale) * kLog2e;
  f.dq_scale = static_cast<float>(p.scale * p.k_descale * p.v_descale);
  f.dk_scale = static_cast<float>(p.scale * p.q_descale * p.v_descale);
  f.delta_scale = static_cast<float>(1.0 / p.v_descale);
  f.causal = p.causal;
  f.causal_offset = static_cast<int>(p.causal_offset);
  f.masked = uses_masked_kernels(p);
  const auto band_side = [&](int64_t w) { return w < 0 || w >= p.seq_q + p.seq_k ? -1 : static_cast<int>(w); };
  f.window_left = band_side(p.window_left);
  f.window_right = band_side(p.right_bound());
  f.softcap = static_cast<float>(p.softcap);
  f.softcap_in = p.softcap > 0 ? static_cast<float>(p.scale / p.softcap) : 0.f;
  f.softcap_out = p.softcap > 0 ? static_cast<float>(p.softcap / p.scale) : 0.f;
  if (p.alibi) {
    f.alibi_slopes = p.alibi_slopes;
    f.alibi_b = p.alibi_batch_stride;
    f.alibi_h = p.alibi_head_stride;
  }
  if (p.sink) {
    f.sink = p.learnable_sink;
    f.sink_stride = p.sink_stride;
    f.dsink = p.dlearnable_sink;
    f.dsink_stride = p.dsink_stride;
  }
  return f;
}

namespace {

template <int D>
struct FwdTraits {
  // Each warp owns kMTiles x 16 query rows, so every K and V fragment read from shared memory feeds
  // kMTiles MMAs: with one 16-row tile per warp the kernel is bound by shared-memory bandwidth.
  static constexpr int kWarps = 4;
  static constexpr int kMTiles = D <= 128 ? 2 : 1;
  static constexpr int kBlockM = 16 * kMTiles * kWarps;
  // 64-key tiles up to d128 (faster at d128 than 32-key tiles: docs/perf.md, "Kernel tuning notes").
  static constexpr int kBlockN = D <= 128 ? 64 : 32;
  static constexpr int kThreads = 32 * kWarps;
  // Q fragments stay in registers where they fit; larger head dims re-read Q from shared memory.
  static constexpr bool kQInRegisters = D <= 64;
  // Q·Kᵀ k-steps unrolled per loop iteration: at d128 a full unroll lets the compiler load K/Q fragments of
  // later k-steps early, which pushed the live set past 255 registers (spills).
  static constexpr int kQKUnroll = D == 128 ? 4 : D / 16;
  static constexpr size_t kSmemBytes = size_t(kBlockM + 4 * kBlockN) * D * 2;  // Q, 2 stages of K and V
};

// kMasked: the sliding-window / soft-capping / ALiBi / sink instantiation (FlashParams::masked): key tiles
// outside the band are skipped, scores soft-capped and biased, tiles crossing the band's edge masked
// element-wise, and the sink starts each row's softmax. The plain one keeps the causal mask alone and none of
// that code.
template <class T, int D, bool kMasked>
__global__ void __launch_bounds__(FwdTraits<D>::kThreads) flash_fwd_kernel(const FlashParams p) {
  using Tr = FwdTraits<D>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kThreads = Tr::kThreads, kM = Tr::kMTiles;
  using Mma = MmaOp<T>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * D;
  T* sV = sK + 2 * kBlockN * D;

  // Heaviest (last, under a causal mask) query tiles first, so the tail of the grid is short.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int m0 = m_block * kBlockM;
  const int warp_tile0 = warp * 16 * kM;  // this warp's first row within the block
  const int warp_row0 = m0 + warp_tile0;

  const T* q_head = static_cast<const T*>(p.q) + b * p.q_st.b + h * p.q_st.h;
  const T* k_head = static_cast<const T*>(p.k) + b * p.k_st.b + hk * p.k_st.h;
  const T* v_head = static_cast<const T*>(p.v) + b * p.v_st.b + hk * p.v_st.h;

  const int last_row = min(m0 + kBlockM, p.seq_q) - 1;
  // Key tiles [nb_first, n_blocks) are visited; tile nb lives in stage nb & 1.
  const TileRange tiles = visited_key_tiles<kMasked>(p, m0, last_row, kBlockN);
  const int nb_first = tiles.first, n_blocks = tiles.first + tiles.count();

  load_tile_async<kBlockM, D, kThreads>(sQ, q_head, p.q_st.s, m0, p.seq_q, tid);
  if (n_blocks > nb_first) {
    const int first_stage = nb_first & 1;
    load_tile_async<kBlockN, D, kThreads>(sK + first_stage * kBlockN * D, k_head, p.k_st.s, nb_first * kBlockN,
                                          p.seq_k, tid);
    load_tile_async<kBlockN, D, kThreads>(sV + first_stage * kBlockN * D, v_head, p.v_st.s, nb_first * kBlockN,
                                          p.seq_k, tid);
  }
  cp_async_commit();

  // A-operand fragments of this warp's Q rows (used only when they stay in registers).
  uint32_t qf[Tr::kQInRegisters ? kM : 1][Tr::kQInRegisters ? D / 16 : 1][4];
  auto load_q = [&](uint32_t* frag, int mt, int kk) {
    ldmatrix_x4(frag, smem_addr(sQ + Swizzle<D>::offset(warp_tile0 + mt * 16 + (lane % 16), 2 * kk + lane / 16)));
  };

  // Byte offsets of this lane's ldmatrix rows within a tile, for chunk pair 0 (see XorSwizzle): every
  // other fragment address is one of these XOR a constant plus a constant, so only three offsets stay live
  // across the key loop instead of one precomputed address per (fragment, k-step).
  // (Head dims below 64 use a different swizzle and keep the generic Swizzle<D>::offset addressing.)
  constexpr bool kXor = D >= 64;
  using Xs = XorSwizzle<D>;
  const int k_row = (lane % 8) + (lane / 16) * 8, k_b = (lane / 8) % 2;
  const int v_row = (lane % 8) + ((lane / 8) % 2) * 8, v_b = lane / 16;
  const uint32_t q_off = kXor ? Xs::lane_offset(warp_tile0 + (lane % 16), lane / 16) : 0;
  const uint32_t k_off = kXor ? Xs::lane_offset(k_row, k_b) : 0;
  const uint32_t v_off = kXor ? Xs::lane_offset(v_row, v_b) : 0;
  const uint32_t sQ_addr = smem_addr(sQ), sK_addr = smem_addr(sK), sV_addr = smem_addr(sV);
  auto q_frag = [&](uint32_t q_lane_off, int mt, int kk) -> uint32_t {
    if constexpr (kXor) return sQ_addr + Xs::at(q_lane_off, mt * 16, kk);
    else return smem_addr(sQ + Swizzle<D>::offset(warp_tile0 + mt * 16 + (lane % 16), 2 * kk + lane / 16));
  };
  // K fragment (key rows nt·16.., d chunk pair kk) and V fragment (key rows kk·16.., d chunk pair dt) of a stage.
  auto k_frag = [&](uint32_t tile, uint32_t k_lane_off, int nt, int kk) -> uint32_t {
    if constexpr (kXor) return tile + Xs::at(k_lane_off, nt * 16, kk);
    else return tile + 2 * Swizzle<D>::offset(nt * 16 + k_row, 2 * kk + k_b);
  };
  auto v_frag = [&](uint32_t tile, uint32_t v_lane_off, int kk, int dt) -> uint32_t {
    if constexpr (kXor) return tile + Xs::at(v_lane_off, kk * 16, dt);
    else return tile + 2 * Swizzle<D>::offset(kk * 16 + v_row, 2 * dt + v_b);
  };

  float acc[kM][D / 8][4] = {};
  float row_max[kM][2], row_sum[kM][2];
  // The sink (masked kernels) starts every row's online softmax as a first "key" of weight exp(sink - m) and
  // no value, as the CPU flash path does: m = sink (in raw-score units, as row_max is kept), and l = 1 held
  // by lane t = 0 alone (each lane's row_sum is its part of the quad's sum). No sink (-inf): m = -inf, l = 0.
  // A row that sees no key keeps them: o = 0, lse = sink.
  float m_init = -INFINITY, l_init = 0.f;
  [[maybe_unused]] float slope_raw = 0.f;
  if constexpr (kMasked) {
    const float sink = sink_logit(p, h);
    if (sink != -INFINITY) {
      m_init = sink / p.scale;
      l_init = t == 0 ? 1.f : 0.f;
    }
    slope_raw = alibi_slope_raw(p, b, h);
  }
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
    row_max[mt][0] = row_max[mt][1] = m_init;
    row_sum[mt][0] = row_sum[mt][1] = l_init;
  }

  for (int nb = nb_first; nb < n_blocks; ++nb) {
    const int stage = nb & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile nb is visible to all; every warp is done with the stage about to be refilled
    if (nb + 1 < n_blocks) {
      // The K/V head offsets are recomputed here from opaque copies of b and hk: held across the key loop
      // as 64-bit values they were spilled (d128).
      const int b_nb = static_cast<int>(opaque(b)), hk_nb = static_cast<int>(opaque(hk));
      const T* k_head_nb = static_cast<const T*>(p.k) + b_nb * p.k_st.b + hk_nb * p.k_st.h;
      const T* v_head_nb = static_cast<const T*>(p.v) + b_nb * p.v_st.b + hk_nb * p.v_st.h;
      load_tile_async<kBlockN, D, kThreads>(sK + (stage ^ 1) * kBlockN * D, k_head_nb, p.k_st.s,
                                            (nb + 1) * kBlockN, p.seq_k, tid);
      load_tile_async<kBlockN, D, kThreads>(sV + (stage ^ 1) * kBlockN * D, v_head_nb, p.v_st.s,
                                            (nb + 1) * kBlockN, p.seq_k, tid);
    }
    cp_async_commit();
    if constexpr (Tr::kQInRegisters) {
      if (nb == nb_first) {
#pragma unroll
        for (int mt = 0; mt < kM; ++mt)
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) load_q(qf[mt][kk], mt, kk);
      }
    }
    const uint32_t k_addr = sK_addr + stage * (kBlockN * D * 2);
    const uint32_t v_addr = sV_addr + stage * (kBlockN * D * 2);

    // S = Q Kᵀ for this warp's rows; each K fragment serves all kM row tiles.
    float s[kM][kBlockN / 8][4] = {};
    // The fragment addresses within a tile are loop-invariant; recomputing them here (one XOR each) is
    // cheaper than the registers the compiler would otherwise hold them in (and spill) across the key loop.
    const uint32_t q_off_nb = opaque(q_off), k_off_nb = opaque(k_off), v_off_nb = opaque(v_off);
#pragma unroll Tr::kQKUnroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a_smem[kM][4];
      if constexpr (!Tr::kQInRegisters) {
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) ldmatrix_x4(a_smem[mt], q_frag(q_off_nb, mt, kk));
      }
#pragma unroll
      for (int nt = 0; nt < kBlockN / 16; ++nt) {
        uint32_t bk[4];
        ldmatrix_x4(bk, k_frag(k_addr, k_off_nb, nt, kk));
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          const uint32_t* a;
          if constexpr (Tr::kQInRegisters) a = qf[mt][kk];
          else a = a_smem[mt];
          Mma::run(s[mt][2 * nt], a, bk);
          Mma::run(s[mt][2 * nt + 1], a, bk + 2);
        }
      }
    }

    const int n0 = nb * kBlockN;
    if constexpr (kMasked) {
      cap_and_mask_scores(s, p, tile_in_band(p, warp_row0, warp_row0 + 16 * kM - 1, n0, n0 + kBlockN - 1), warp_row0,
                          n0, g, t, slope_raw);
    } else {
      if (scores_need_mask(p, warp_row0, n0, kBlockN)) mask_scores(s, p, warp_row0, n0, g, t);
    }

    // Online softmax: rescale the running state by exp(m_old - m_new), P = exp(S - m_new).
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[mt][r];
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt) {
          mx = max_propagating_nan(mx, max_propagating_nan(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        }
        mx = quad_max(mx);
        const float m_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;  // all masked so far: P = 0, no NaN
        const float alpha = fast_exp2(row_max[mt][r] * p.scale_log2 - m_scaled);
        row_max[mt][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt) {
          s[mt][nt][2 * r] = fast_exp2(fmaf(s[mt][nt][2 * r], p.scale_log2, -m_scaled));
          s[mt][nt][2 * r + 1] = fast_exp2(fmaf(s[mt][nt][2 * r + 1], p.scale_log2, -m_scaled));
          sum += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
        }
        row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          acc[mt][dt][2 * r] *= alpha;
          acc[mt][dt][2 * r + 1] *= alpha;
        }
      }
    }

    // O += P V, with P's accumulator fragments re-packed as the A operand; each V fragment serves all
    // kM row tiles.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[kM][4];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) {
        a[mt][0] = Mma::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = Mma::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = Mma::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = Mma::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, v_frag(v_addr, v_off_nb, kk, dt));
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          Mma::run(acc[mt][2 * dt], a[mt], bv);
          Mma::run(acc[mt][2 * dt + 1], a[mt], bv + 2);
        }
      }
    }
  }

  // Normalise, write logsumexp, and stage O through this warp's own Q rows for 16-byte stores. A block
  // whose rows see no key (n_blocks = 0) never passed the loop's barrier: other threads' cp.async of Q
  // rows into this warp's staging area may still be in flight, so every thread waits for its copies
  // and then the block synchronises (with __syncwarp only, such a late Q chunk overwrote the zeros of
  // a fully masked row — seen as a rare O error of ~|q| in the bottom-right causal Nq > Nk case).
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(row_sum[mt][r]);
      // l = 0: no key seen and no sink (O = 0, lse = -inf); l NaN: a NaN reached the row, and O and lse are NaN.
      const float inv = l != 0.f ? 1.f / l : 0.f;
      const int row = warp_row0 + mt * 16 + g + 8 * r;
      if (t == 0 && row < p.seq_q) {
        p.lse[b * p.lse_b + h * p.lse_h + row * p.lse_s] = l != 0.f ? row_max[mt][r] * p.scale + logf(l) : -INFINITY;
      }
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        store_pair(sQ + Swizzle<D>::offset(warp_tile0 + mt * 16 + g + 8 * r, dt) + 2 * t, acc[mt][dt][2 * r] * inv,
                   acc[mt][dt][2 * r + 1] * inv);
      }
    }
  }
  __syncwarp();
  T* o_head = static_cast<T*>(p.o) + b * p.o_st.b + h * p.o_st.h;
  for (int c = lane; c < 16 * kM * (D / 8); c += 32) {
    const int r = c / (D / 8), ch = c % (D / 8);
    const int row = warp_row0 + r;
    if (row < p.seq_q) {
      *reinterpret_cast<uint4*>(o_head + row * p.o_st.s + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + Swizzle<D>::offset(warp_tile0 + r, ch));
    }
  }
}

template <class T, int D>
void launch_forward(const FlashParams& f, cudaStream_t stream) {
  using Tr = FwdTraits<D>;
  auto kernel = f.masked ? flash_fwd_kernel<T, D, true> : flash_fwd_kernel<T, D, false>;
  FLASHLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Tr::kSmemBytes)),
                     "flash_fwd_kernel: shared-memory opt-in");
  const dim3 grid((f.seq_q + Tr::kBlockM - 1) / Tr::kBlockM, f.heads_q, f.batch);
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(f);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "flash_fwd_kernel launch");
}

template <class T>
void dispatch_head_dim(int64_t d, const FlashParams& f, cudaStream_t stream) {
  const bool launched =
      with_head_dim<kMmaSyncForwardHeadDims>(d, [&](auto dim) { launch_forward<T, decltype(dim)::value>(f, stream); });
  FLASHLM_CHECK(launched, "flash_attention_forward_cuda: head_dim {} has no kernel (the capability table lists it)", d);
}

}  // namespace
}  // namespace flash_cuda

void flash_attention_forward_cuda(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& o, const TensorView& lse, void* stream) {
  if (p.batch == 0 || p.seq_q == 0 || p.heads_q == 0) return;
  const auto f = flash_cuda::make_params(p, q, k, v, o, lse);
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::bf16) flash_cuda::dispatch_head_dim<__nv_bfloat16>(p.head_dim, f, s);
  else flash_cuda::dispatch_head_dim<__half>(p.head_dim, f, s);
}

}  // namespace flashlm
