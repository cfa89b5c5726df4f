// AdamW on CUDA (optim/optimizer.h): the header's operations in its order, each rounded once (no fused
// multiply-adds, hence the __f*_rn intrinsics). fp32 masters: one element per thread, or four with 16-byte
// accesses where every array is aligned; pure bf16 and bf16 moments: a pack of eight per thread (16-byte
// accesses of each array) where every array is aligned, else one by one. With StoredAmaxes (FP8 training's
// weight amaxes) every variant runs in contiguous chunks instead (for_each_pack_in_ranges).
#include "core/cuda/kernels.cuh"
#include "core/cuda_check.h"
#include "model/cuda/amax.cuh"
#include "model/cuda/fp8_device.cuh"
#include "model/fp8.h"
#include "optim/optimizer.h"

namespace flashlm::gpu {

namespace {

// One element. grad_scale: the clipping factor, applied here instead of by a pass of its own over the
// gradients (the same single rounding as scale_inplace's g * s).
__device__ __forceinline__ void adamw_element(float& w, float grad, float& m, float& v, const AdamWScalars& a) {
  const float g = a.grad_scale == 1.0f ? grad : __fmul_rn(grad, a.grad_scale);
  const float mi = __fadd_rn(__fmul_rn(a.b1, m), __fmul_rn(a.one_minus_b1, g));
  const float vi = __fadd_rn(__fmul_rn(a.b2, v), __fmul_rn(__fmul_rn(a.one_minus_b2, g), g));
  float wi = __fsub_rn(w, __fdiv_rn(__fmul_rn(a.alpha, mi), __fadd_rn(__fsqrt_rn(vi), a.eps)));
  wi = __fsub_rn(wi, __fmul_rn(a.decay, wi));
  m = mi;
  v = vi;
  w = wi;
}

// With StoredAmaxes: block b steps the kAmaxChunk contiguous elements of chunk b, in pieces split where the
// ranges begin and end, and adds each range piece's largest stored magnitude to the range's amax (one atomic per
// block and piece, model/cuda/amax.cuh). A grid-stride loop would give every thread elements of many ranges.
constexpr int64_t kAmaxChunk = int64_t{1} << 16;

// Elements [a, e) by one block: body(Width<kPack>{}, i) over the whole packs (starting at multiples of kPack)
// where `packed` (every array 16-byte aligned, so such a pack is too), body(Width<1>{}, i) over the rest.
template <class Body>
__device__ __forceinline__ void for_each_pack_in(int64_t a, int64_t e, bool packed, Body body) {
  const int64_t head = packed ? min(e, (a + kPack - 1) / kPack * kPack) : e;
  const int64_t tail = max(head, packed ? e / kPack * kPack : e);
#pragma unroll 1  // under kPack elements: unrolling would only cost registers
  for (int64_t i = a + threadIdx.x; i < head; i += kThreads) body(Width<1>{}, i);
  for (int64_t i = head + int64_t{threadIdx.x} * kPack; i < tail; i += int64_t{kThreads} * kPack) {
    body(Width<kPack>{}, i);
  }
#pragma unroll 1
  for (int64_t i = tail + threadIdx.x; i < e; i += kThreads) body(Width<1>{}, i);
}

// Elements [0, n) as above, in pieces that for_each_pack_in steps. body adds the magnitudes of what it stores
// to `best`, which is reset before each piece and reduced after it.
template <class Body>
__device__ __forceinline__ void for_each_pack_in_ranges(int64_t n, bool packed, const StoredAmaxes& amax,
                                                        uint32_t& best, Body body) {
  const int64_t c0 = int64_t{blockIdx.x} * kAmaxChunk, c1 = min(n, c0 + kAmaxChunk);
  int lo = 0, hi = amax.count;  // the first range that ends past c0
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (amax.ranges[mid].begin + amax.ranges[mid].count <= c0) lo = mid + 1; else hi = mid;
  }
  for (int64_t a = c0; a < c1;) {  // block-uniform: every thread takes every piece
    const AmaxRange* r = lo < amax.count ? amax.ranges + lo : nullptr;
    const bool inside = r && r->begin <= a;
    const int64_t e = min(c1, inside ? r->begin + r->count : r ? r->begin : c1);
    best = 0;
    for_each_pack_in(a, e, packed, body);
    if (inside) {
      block_amax_to<kThreads>(reinterpret_cast<uint32_t*>(r->amax), best);
      __syncthreads();  // block_amax_to's shared array is reused by the next piece
      if (e == r->begin + r->count) ++lo;
    }
    a = e;
  }
}

// The plain step's loop, or (AMAX) the chunked one.
template <bool AMAX, class Body>
__device__ __forceinline__ void for_each_step_pack(int64_t n, int64_t packs, const StoredAmaxes& amax, uint32_t& best,
                                                   Body body) {
  if constexpr (AMAX) {
    for_each_pack_in_ranges(n, packs > 0, amax, best, body);
  } else {
    for_each_pack(n, packs, body);
  }
}

// Elements [first, n), one per thread.
template <class D>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* __restrict__ w, const float* __restrict__ grad, float* __restrict__ m, float* __restrict__ v,
                 int64_t first, int64_t n, AdamWScalars fixed, const AdamWScalars* __restrict__ live,
                 D* __restrict__ copy) {
  const AdamWScalars a = live ? *live : fixed;
  FLASHLM_GRID_STRIDE(j, n - first) {
    const int64_t i = first + j;
    float wi = w[i], mi = m[i], vi = v[i];
    adamw_element(wi, grad[i], mi, vi, a);
    m[i] = mi;
    v[i] = vi;
    w[i] = wi;
    if (copy) copy[i] = from_f32<D>(wi);
  }
}

// Elements [4q, 4q + 4) of the low-precision copy, as one 8-byte store (16 bytes for fp32): four 2-byte
// stores per thread would leave every warp's store instruction writing partial 32-byte sectors. The host
// checks that `copy` is aligned to four elements before it picks adamw_kernel_x4.
template <class D>
__device__ __forceinline__ void store_four(D* __restrict__ copy, int64_t q, float4 wq) {
  if constexpr (std::is_same_v<D, float>) {
    reinterpret_cast<float4*>(copy)[q] = wq;
  } else {
    const D four[4] = {from_f32<D>(wq.x), from_f32<D>(wq.y), from_f32<D>(wq.z), from_f32<D>(wq.w)};
    uint2 bits;
    memcpy(&bits, four, sizeof bits);
    reinterpret_cast<uint2*>(copy)[q] = bits;
  }
}

// Elements [0, 4·n4), four per thread with 16-byte loads and stores (the step is memory bound: 30 bytes
// per parameter with a low-precision copy). Same arithmetic per element as adamw_kernel.
template <class D>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel_x4(float4* __restrict__ w, const float4* __restrict__ grad, float4* __restrict__ m,
                    float4* __restrict__ v, int64_t n4, AdamWScalars fixed, const AdamWScalars* __restrict__ live,
                    D* __restrict__ copy) {
  const AdamWScalars a = live ? *live : fixed;
  FLASHLM_GRID_STRIDE(q, n4) {
    float4 wq = w[q], mq = m[q], vq = v[q];
    const float4 gq = grad[q];
    adamw_element(wq.x, gq.x, mq.x, vq.x, a);
    adamw_element(wq.y, gq.y, mq.y, vq.y, a);
    adamw_element(wq.z, gq.z, mq.z, vq.z, a);
    adamw_element(wq.w, gq.w, mq.w, vq.w, a);
    w[q] = wq;
    m[q] = mq;
    v[q] = vq;
    if (copy) store_four(copy, q, wq);
  }
}

// Pure bf16: every value widened to fp32, stepped by adamw_element, rounded back to bf16 (nearest even).
// AMAX: also the StoredAmaxes of w as stored.
template <bool AMAX>
__global__ void __launch_bounds__(kThreads)
    adamw_bf16_kernel(__nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ grad,
                      __nv_bfloat16* __restrict__ m, __nv_bfloat16* __restrict__ v, int64_t n, int64_t packs,
                      AdamWScalars fixed, const AdamWScalars* __restrict__ live, StoredAmaxes amax) {
  const AdamWScalars a = live ? *live : fixed;
  [[maybe_unused]] uint32_t best = 0;
  for_each_step_pack<AMAX>(n, packs, amax, best, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    Vec<__nv_bfloat16, W> wv = load<W>(w + i), mv = load<W>(m + i), vv = load<W>(v + i);
    const Vec<__nv_bfloat16, W> gv = load<W>(grad + i);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      float wk = f32(wv[k]), mk = f32(mv[k]), vk = f32(vv[k]);
      adamw_element(wk, f32(gv[k]), mk, vk, a);
      wv[k] = from_f32<__nv_bfloat16>(wk);
      mv[k] = from_f32<__nv_bfloat16>(mk);
      vv[k] = from_f32<__nv_bfloat16>(vk);
      if constexpr (AMAX) best = max(best, magnitude_bits(f32(wv[k])));
    }
    store(w + i, wv);
    store(m + i, mv);
    store(v + i, vv);
  });
}

// fp32 masters with moments M and gradients G: bf16 moments widened, stepped by adamw_element with the fp32 w
// and the (widened: exact) g, rounded back to nearest even, or (Stochastic) by bf16_bits_stochastic with the
// 16-bit halves of counter_draw(rounding_key, first_index + i) — the CPU's draw, so the same bits; fp32 moments
// (M = float: the AMAX step of adamw_step, or bf16 gradients; the plain one is adamw_kernel_x4's) stored as they
// are. AMAX: also the StoredAmaxes of the copy as stored (which AMAX needs).
template <int W, class D, class M, class G, bool Stochastic, bool AMAX>
__device__ __forceinline__ Vec<float, W> step_masters(float* __restrict__ w, const G* __restrict__ grad,
                                                      M* __restrict__ m, M* __restrict__ v, D* __restrict__ copy,
                                                      int64_t i, int64_t first_index, const AdamWScalars& a,
                                                      uint32_t& best) {
  Vec<float, W> wv = load<W>(w + i);
  const Vec<G, W> gv = load<W>(grad + i);
  Vec<M, W> mv = load<W>(m + i), vv = load<W>(v + i);
  Vec<D, W> cv;
#pragma unroll
  for (int k = 0; k < W; ++k) {
    float mk = f32(mv[k]), vk = f32(vv[k]);
    adamw_element(wv[k], f32(gv[k]), mk, vk, a);
    if constexpr (std::is_same_v<M, float>) {
      mv[k] = mk;
      vv[k] = vk;
    } else if constexpr (Stochastic) {
      const uint64_t r = counter_draw(a.rounding_key, uint64_t(first_index + i + k));
      mv[k] = __ushort_as_bfloat16(bf16_bits_stochastic(__float_as_uint(mk), uint32_t(r)));
      vv[k] = __ushort_as_bfloat16(bf16_bits_stochastic(__float_as_uint(vk), uint32_t(r >> 16)));
    } else {
      mv[k] = from_f32<__nv_bfloat16>(mk);
      vv[k] = from_f32<__nv_bfloat16>(vk);
    }
    cv[k] = from_f32<D>(wv[k]);
    if constexpr (AMAX) best = max(best, magnitude_bits(f32(cv[k])));
  }
  store(w + i, wv);
  store(m + i, mv);
  store(v + i, vv);
  if (copy) store(copy + i, cv);
  return wv;
}

template <class D, class M, class G, bool Stochastic, bool AMAX>
__global__ void __launch_bounds__(kThreads)
    adamw_masters_kernel(float* __restrict__ w, const G* __restrict__ grad, M* __restrict__ m, M* __restrict__ v,
                         int64_t n, int64_t packs, int64_t first_index, AdamWScalars fixed,
                         const AdamWScalars* __restrict__ live, D* __restrict__ copy, StoredAmaxes amax) {
  const AdamWScalars a = live ? *live : fixed;
  [[maybe_unused]] uint32_t best = 0;
  for_each_step_pack<AMAX>(n, packs, amax, best, [&](auto width, int64_t i) {
    step_masters<decltype(width)::value, D, M, G, Stochastic, AMAX>(w, grad, m, v, copy, i, first_index, a, best);
  });
}

// FP8 weight copies (Fp8WeightCopies), first: each weight's bound from the amax its slot holds (its bf16 copy's
// before the step), the dequantisation scale its new copies will have, and the slot's amax cleared for the
// step's atomics. One thread a weight.
__global__ void fp8_copy_bounds_kernel(Fp8WeightCopies copies, AdamWScalars fixed, const AdamWScalars* __restrict__ live) {
  const AdamWScalars a = live ? *live : fixed;
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < copies.count; r += gridDim.x * blockDim.x) {
    float* slot = copies.weights[r].slot;
    const float bound = fp8_weight_bound(slot[kFp8AmaxIndex], a);
    slot[kFp8BoundIndex] = bound;
    slot[kFp8DequantIndex] = fp8_dequant_scale(fp8_scale(bound, Fp8Format::e4m3));
    slot[kFp8AmaxIndex] = 0.0f;
  }
}

// Then the step: block b < weight_blocks steps a strip of kFp8CopyStripRows × kFp8CopyTile elements of one weight,
// tile by tile, each pack of eight as adamw_masters_kernel steps it (the same bits in w, m, v and, unless
// copies.weights_bf16 is off, the bf16 copy), encoding the new fp32 masters into q straight and, through the
// tile in shared memory, into qt; the strip's largest bf16 magnitude (stored or not) goes to the weight's amax
// with one atomic. The blocks past them step the chunks of `rest` as the plain step does.
static_assert(kFp8CopyTile == kVecTile && kFp8CopyStripRows % kVecTile == 0 && kVecThreads == kThreads);
template <class M, class G, bool Stochastic>
__global__ void __launch_bounds__(kVecThreads)
    adamw_fp8_copies_kernel(float* __restrict__ w, const G* __restrict__ grad, M* __restrict__ m,
                            M* __restrict__ v, __nv_bfloat16* __restrict__ copy, int64_t first_index,
                            AdamWScalars fixed, const AdamWScalars* __restrict__ live, Fp8WeightCopies copies) {
  const AdamWScalars a = live ? *live : fixed;
  uint32_t best = 0;
  const int64_t b = blockIdx.x;
  if (b >= copies.weight_blocks) {
    const ElementChunk chunk = copies.rest[b - copies.weight_blocks];
    for_each_pack_in(chunk.begin, chunk.begin + chunk.count, true, [&](auto width, int64_t i) {
      step_masters<decltype(width)::value, __nv_bfloat16, M, G, Stochastic, false>(w, grad, m, v, copy, i,
                                                                                    first_index, a, best);
    });
    return;
  }
  int lo = 0, hi = copies.count - 1;  // the last weight whose blocks start at or before b
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (copies.weights[mid].first_block <= b) lo = mid; else hi = mid - 1;
  }
  const Fp8WeightCopy& c = copies.weights[lo];
  const int64_t local = b - c.first_block, tile_cols = (c.cols + kVecTile - 1) / kVecTile;
  const int64_t c0 = (local % tile_cols) * kVecTile, strip = (local / tile_cols) * kFp8CopyStripRows;
  const float scale = fp8_scale(c.slot[kFp8BoundIndex], Fp8Format::e4m3);
  __nv_bfloat16* const weight_copy = copies.weights_bf16 ? copy : nullptr;  // the amax is of its values either way
  __shared__ __align__(16) uint8_t tile[kVecTile * kVecTileStride];
  constexpr int kPacksPerRow = kVecTile / kPack;
  for (int64_t r0 = strip; r0 < min(c.rows, strip + kFp8CopyStripRows); r0 += kVecTile) {
    for (int p = threadIdx.x; p < kVecTile * kPacksPerRow; p += kVecThreads) {
      const int i = p / kPacksPerRow, j = (p % kPacksPerRow) * kPack;
      const int64_t r = r0 + i, col = c0 + j;
      if (r < c.rows && col < c.cols) {
        const Vec<float, kPack> wv = step_masters<kPack, __nv_bfloat16, M, G, Stochastic, true>(
            w, grad, m, v, weight_copy, c.begin + r * c.cols + col, first_index, a, best);
        uint32_t word[2] = {0, 0};
#pragma unroll
        for (int k = 0; k < kPack; ++k) word[k / 4] |= uint32_t{fp8_encode<Fp8Format::e4m3>(wv[k] * scale)} << (8 * (k % 4));
        *reinterpret_cast<uint2*>(c.q + r * c.cols + col) = make_uint2(word[0], word[1]);
        put_tile_pack(tile, i, j, word);
      }
    }
    __syncthreads();
    write_transposed_tile(tile, r0, c0, c.rows, c.cols, c.qt);
    __syncthreads();  // the tile is rewritten by the next tile
  }
  block_amax_to<kVecThreads>(reinterpret_cast<uint32_t*>(c.slot + kFp8AmaxIndex), best);
}

// The grid of a step: the plain one's, or one block per kAmaxChunk elements with StoredAmaxes (checked here: a
// table, and what the amaxes are of).
unsigned step_blocks(const char* fn, int64_t n, int64_t packs, const StoredAmaxes& amax, bool stores_bf16) {
  if (amax.count == 0) return packed_blocks(n, packs);
  FLASHLM_CHECK(amax.count > 0 && amax.ranges != nullptr, "{}: {} amax ranges{}, expected a table of >= 1", fn,
                amax.count, amax.ranges ? "" : " (null)");
  // FP8 training's working copy is bf16: only that variant is compiled with amaxes.
  FLASHLM_CHECK(stores_bf16, "{}: amax ranges given without a bf16 param_copy (the amaxes are of the bf16 copy as stored)",
                fn);
  const int64_t chunks = (n + kAmaxChunk - 1) / kAmaxChunk;
  FLASHLM_CHECK(chunks <= INT32_MAX, "{}: n = {}: too many elements for the amax step", fn, n);
  return unsigned(chunks);
}

// The FP8 weight copies' two launches (above), for launch_adamw_masters.
template <class M, class G, class T>
void launch_adamw_copies(const char* fn, float* param, const G* grad, M* m, M* v, const AdamWScalars& fixed,
                         const AdamWScalars* live, bool stochastic, int64_t first_index, T* param_copy,
                         const Fp8WeightCopies& copies, cudaStream_t s) {
  FLASHLM_CHECK((std::is_same_v<T, bf16_t> && param_copy != nullptr),
                "{}: FP8 weight copies given without a bf16 param_copy (the amaxes are of the bf16 copy as stored)", fn);
  FLASHLM_CHECK(copies.weights != nullptr && copies.weight_blocks >= copies.count &&
                    (copies.rest_count == 0 || copies.rest != nullptr) && copies.rest_count >= 0,
                "{}: FP8 weight copies: {} weights in {} blocks, {} rest chunks{}: not a table", fn, copies.count,
                copies.weight_blocks, copies.rest_count, copies.rest ? "" : " (null)");
  FLASHLM_CHECK(aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v) && aligned16(param_copy),
                "{}: FP8 weight copies need every array 16-byte aligned", fn);
  const int64_t blocks = copies.weight_blocks + copies.rest_count;
  FLASHLM_CHECK(blocks <= INT32_MAX, "{}: {} blocks: too many for the FP8 weight copies' step", fn, blocks);
  if constexpr (std::is_same_v<T, bf16_t>) {
    using DM = std::remove_pointer_t<decltype(dev(m))>;
    using DG = std::remove_cv_t<std::remove_pointer_t<decltype(dev(grad))>>;
    fp8_copy_bounds_kernel<<<unsigned(ceil_div(copies.count, kThreads)), kThreads, 0, s>>>(copies, fixed, live);
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "fp8_copy_bounds_kernel");
    const auto kernel = std::is_same_v<M, float> || !stochastic ? adamw_fp8_copies_kernel<DM, DG, false>
                                                                : adamw_fp8_copies_kernel<DM, DG, true>;
    kernel<<<unsigned(blocks), kVecThreads, 0, s>>>(param, dev(grad), dev(m), dev(v), dev(param_copy), first_index, fixed,
                                                    live, copies);
    FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_fp8_copies_kernel");
  }
}

// fp32 masters with moments M, gradients G and copy T (none: T = float and null), the launch of every variant but
// the plain fp32-moment, fp32-gradient step's (adamw_kernel_x4).
template <class M, class G, class T>
void launch_adamw_masters(const char* fn, float* param, const G* grad, M* m, M* v, int64_t n,
                          const AdamWScalars& fixed, const AdamWScalars* live, bool stochastic, int64_t first_index,
                          T* param_copy, const StoredAmaxes& amax, cudaStream_t s) {
  FLASHLM_CHECK(param && grad && m && v, "{}: param, grad, m and v must not be null", fn);
  FLASHLM_CHECK(first_index >= 0, "{}: first_index = {}, expected >= 0", fn, first_index);
  if (amax.copies.count > 0) {
    return launch_adamw_copies(fn, param, grad, m, v, fixed, live, stochastic, first_index, param_copy, amax.copies, s);
  }
  const int64_t packs = pack_count(n, param, grad, m, v, param_copy);
  const unsigned blocks = step_blocks(fn, n, packs, amax, std::is_same_v<T, bf16_t> && param_copy != nullptr);
  using D = std::remove_pointer_t<decltype(dev(param_copy))>;
  using DM = std::remove_pointer_t<decltype(dev(m))>;
  using DG = std::remove_cv_t<std::remove_pointer_t<decltype(dev(grad))>>;
  const auto launch = [&](auto stochastic_constant, auto amax_constant) {
    adamw_masters_kernel<D, DM, DG, decltype(stochastic_constant)::value, decltype(amax_constant)::value>
        <<<blocks, kThreads, 0, s>>>(param, dev(grad), dev(m), dev(v), n, packs, first_index, fixed, live,
                                     dev(param_copy), amax);
  };
  const auto with_amax = [&](auto stochastic_constant) {
    if (amax.count > 0) {
      if constexpr (std::is_same_v<T, bf16_t>) launch(stochastic_constant, std::true_type{});
    } else if constexpr (!std::is_same_v<M, float> || !std::is_same_v<G, float>) {
      launch(stochastic_constant, std::false_type{});  // (fp32 moments and gradients: adamw_kernel_x4's step)
    }
  };
  if constexpr (std::is_same_v<M, float>) {
    with_amax(std::false_type{});  // nothing to round stochastically
  } else if (stochastic) {
    with_amax(std::true_type{});
  } else {
    with_amax(std::false_type{});
  }
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_masters_kernel");
}

// The launches of adamw_step and adamw_step_live: the scalars `fixed`, or those at `live` (device memory,
// read when the kernel runs) when it is not null. bf16 gradients (G = bf16_t) and amaxes take the packed
// kernel of the other variants.
template <class G, class T>
void launch_adamw(const char* fn, float* param, const G* grad, float* m, float* v, int64_t n,
                  const AdamWScalars& fixed, const AdamWScalars* live, T* param_copy, const StoredAmaxes& amax,
                  cudaStream_t s) {
  if (!std::is_same_v<G, float> || amax.count != 0 || amax.copies.count != 0) {
    return launch_adamw_masters(fn, param, grad, m, v, n, fixed, live, false, 0, param_copy, amax, s);
  }
  if constexpr (std::is_same_v<G, float>) {  // the plain step: four fp32 values a thread
    const bool copy_aligned = reinterpret_cast<uintptr_t>(param_copy) % (4 * sizeof(T)) == 0;  // four elements
    const bool vector = aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v) && copy_aligned;
    const int64_t n4 = vector ? n / 4 : 0;
    if (n4 > 0) {
      adamw_kernel_x4<<<elementwise_blocks(n4), kThreads, 0, s>>>(
          reinterpret_cast<float4*>(param), reinterpret_cast<const float4*>(grad), reinterpret_cast<float4*>(m),
          reinterpret_cast<float4*>(v), n4, fixed, live, dev(param_copy));
      FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_kernel_x4");
    }
    if (4 * n4 < n) {
      adamw_kernel<<<elementwise_blocks(n - 4 * n4), kThreads, 0, s>>>(param, grad, m, v, 4 * n4, n, fixed, live,
                                                                       dev(param_copy));
      FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_kernel");
    }
  }
}

void launch_adamw_bf16(const char* fn, bf16_t* param, const bf16_t* grad, bf16_t* m, bf16_t* v, int64_t n,
                       const AdamWScalars& fixed, const AdamWScalars* live, const StoredAmaxes& amax, cudaStream_t s) {
  FLASHLM_CHECK(param && grad && m && v, "{}: param, grad, m and v must not be null", fn);
  FLASHLM_CHECK(amax.copies.count == 0, "{}: FP8 weight copies are written by the fp32-master steps only", fn);
  const int64_t packs = pack_count(n, param, grad, m, v);
  const auto kernel = amax.count > 0 ? adamw_bf16_kernel<true> : adamw_bf16_kernel<false>;
  kernel<<<step_blocks(fn, n, packs, amax, true), kThreads, 0, s>>>(dev(param), dev(grad), dev(m), dev(v), n, packs,
                                                                    fixed, live, amax);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "adamw_bf16_kernel");
}

}  // namespace

template <class T, class G>
void adamw_step(float* param, const G* grad, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, T* param_copy, void* stream, float grad_scale,
                StoredAmaxes amax) {
  check_count("adamw_step", "n", n);
  FLASHLM_CHECK(step >= 1, "adamw_step: step = {}, expected >= 1 (1-based)", step);
  if (n == 0) return;
  const AdamWScalars a = adamw_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  launch_adamw("adamw_step", param, grad, m, v, n, a, nullptr, param_copy, amax, as_stream(stream));
}

template <class T, class G>
void adamw_step_live(float* param, const G* grad, float* m, float* v, int64_t n, const AdamWScalars* scalars,
                     T* param_copy, void* stream, StoredAmaxes amax) {
  check_count("adamw_step_live", "n", n);
  FLASHLM_CHECK(scalars != nullptr, "adamw_step_live: scalars is null");
  if (n == 0) return;
  launch_adamw("adamw_step_live", param, grad, m, v, n, AdamWScalars{}, scalars, param_copy, amax, as_stream(stream));
}

void adamw_step_bf16(bf16_t* param, const bf16_t* grad, bf16_t* m, bf16_t* v, int64_t n, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step, void* stream, float grad_scale,
                     StoredAmaxes amax) {
  check_count("adamw_step_bf16", "n", n);
  FLASHLM_CHECK(step >= 1, "adamw_step_bf16: step = {}, expected >= 1 (1-based)", step);
  if (n == 0) return;
  const AdamWScalars a = adamw_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  launch_adamw_bf16("adamw_step_bf16", param, grad, m, v, n, a, nullptr, amax, as_stream(stream));
}

void adamw_step_bf16_live(bf16_t* param, const bf16_t* grad, bf16_t* m, bf16_t* v, int64_t n,
                          const AdamWScalars* scalars, void* stream, StoredAmaxes amax) {
  check_count("adamw_step_bf16_live", "n", n);
  FLASHLM_CHECK(scalars != nullptr, "adamw_step_bf16_live: scalars is null");
  if (n == 0) return;
  launch_adamw_bf16("adamw_step_bf16_live", param, grad, m, v, n, AdamWScalars{}, scalars, amax, as_stream(stream));
}

template <class T, class G>
void adamw_step_bf16_moments(float* param, const G* grad, bf16_t* m, bf16_t* v, int64_t n, double lr,
                             double beta1, double beta2, double eps, double weight_decay, int64_t step,
                             MomentRounding rounding, int64_t first_index, T* param_copy, void* stream,
                             float grad_scale, StoredAmaxes amax) {
  check_count("adamw_step_bf16_moments", "n", n);
  FLASHLM_CHECK(step >= 1, "adamw_step_bf16_moments: step = {}, expected >= 1 (1-based)", step);
  if (n == 0) return;
  AdamWScalars a = adamw_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  a.rounding_key = moment_rounding_key(rounding.seed, step);
  launch_adamw_masters("adamw_step_bf16_moments", param, grad, m, v, n, a, nullptr, rounding.stochastic, first_index,
                       param_copy, amax, as_stream(stream));
}

template <class T, class G>
void adamw_step_bf16_moments_live(float* param, const G* grad, bf16_t* m, bf16_t* v, int64_t n,
                                  const AdamWScalars* scalars, bool stochastic, int64_t first_index, T* param_copy,
                                  void* stream, StoredAmaxes amax) {
  check_count("adamw_step_bf16_moments_live", "n", n);
  FLASHLM_CHECK(scalars != nullptr, "adamw_step_bf16_moments_live: scalars is null");
  if (n == 0) return;
  launch_adamw_masters("adamw_step_bf16_moments_live", param, grad, m, v, n, AdamWScalars{}, scalars, stochastic,
                       first_index, param_copy, amax, as_stream(stream));
}

#define FLASHLM_ADAMW_INSTANTIATE(T, G)                                                                          \
  template void adamw_step<T, G>(float*, const G*, float*, float*, int64_t, double, double, double, double, double, \
                                 int64_t, T*, void*, float, StoredAmaxes);                                          \
  template void adamw_step_live<T, G>(float*, const G*, float*, float*, int64_t, const AdamWScalars*, T*, void*,   \
                                      StoredAmaxes);                                                                \
  template void adamw_step_bf16_moments<T, G>(float*, const G*, bf16_t*, bf16_t*, int64_t, double, double, double, \
                                              double, double, int64_t, MomentRounding, int64_t, T*, void*, float,   \
                                              StoredAmaxes);                                                        \
  template void adamw_step_bf16_moments_live<T, G>(float*, const G*, bf16_t*, bf16_t*, int64_t,                    \
                                                   const AdamWScalars*, bool, int64_t, T*, void*, StoredAmaxes);

FLASHLM_ADAMW_INSTANTIATE(float, float)
FLASHLM_ADAMW_INSTANTIATE(bf16_t, float)
FLASHLM_ADAMW_INSTANTIATE(fp16_t, float)
// bf16 gradients (ModelOptions::grad_dtype) beside fp32 masters: bf16 and FP8 training, whose copy is bf16.
FLASHLM_ADAMW_INSTANTIATE(bf16_t, bf16_t)

#undef FLASHLM_ADAMW_INSTANTIATE

}  // namespace flashlm::gpu
