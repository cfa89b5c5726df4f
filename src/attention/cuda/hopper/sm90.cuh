// Typed wrappers for what Hopper (sm_90a) adds to the CUDA attention kernels: mbarriers with phases, TMA
// tile loads that complete on an mbarrier, wgmma shared-memory matrix descriptors (128-byte swizzle) and
// warpgroup MMAs, named barriers and register reallocation. Device code only, and only meaningful in a
// translation unit compiled for sm_90a (-gencode=arch=compute_90a,code=sm_90a); the host side of TMA (the
// tensor map of a TensorView) is in tma.h.
//
// Shared-memory tiles are kept in one layout, the one TMA writes with CU_TENSOR_MAP_SWIZZLE_128B: a tile of
// R rows by C 16-bit columns is C / 64 panels of R rows x 128 bytes, panel after panel, and within a panel
// the 16-byte chunk c of row r sits at chunk c ^ (r % 8). Tiles start 1024-byte aligned (the swizzle
// repeats every 8 rows of 128 bytes and both TMA and wgmma apply it to address bits).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace flashlm::sm90 {

constexpr int kWarpgroupThreads = 128;
constexpr int kPanelCols = 64;     // 16-bit columns per 128-byte swizzle panel
constexpr int kPanelRowBytes = 128;
constexpr int kSwizzleAtomBytes = 1024;  // 8 rows of one panel: the period of the swizzle

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A kernel's shared-memory struct at the dynamic shared memory's base rounded up to 1024 bytes (the 128-byte
// swizzle's atom; launch with sizeof(Shared) + 1024 bytes), by pointer arithmetic on the shared array: the
// compiler then still knows that the struct is shared memory and accesses it with 32-bit shared loads and
// stores. Rounding the address as an integer hid that, and made every access to it a generic one with 64-bit
// address arithmetic.
template <class Shared>
__device__ __forceinline__ Shared& aligned_shared(unsigned char* raw) {
  return *reinterpret_cast<Shared*>(raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u));
}

// The calling thread's warpgroup, broadcast from lane 0 so that the compiler knows it is warp-uniform: what
// depends on it (a consumer's rows of a tile, hence its wgmma descriptors) then lives in uniform registers
// instead of being computed per thread and converted (R2UR) before every wgmma.
__device__ __forceinline__ int warpgroup_index() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / kWarpgroupThreads, 0);
}

// Byte offset of 16-bit element (row, col) in a swizzled tile of `rows` rows (see the layout above).
__host__ __device__ constexpr uint32_t swizzled_offset(int rows, int row, int col) {
  const int panel = col / kPanelCols, chunk = (col % kPanelCols) / 8, within = col % 8;
  return static_cast<uint32_t>(panel * rows * kPanelRowBytes + row * kPanelRowBytes + ((chunk ^ (row % 8)) * 16) +
                               within * 2);
}

// ---- mbarrier: a shared-memory barrier whose phase completes when its arrival count is reached and the
// transaction bytes it expects have landed. Waiters name the phase parity they wait for; a fresh barrier is
// in phase 0, so waiting for parity 1 returns at once (the "previous" phase counts as complete), which lets
// a producer wait on empty slots from the first pass on.
struct Mbarrier {
  uint64_t word;

  __device__ __forceinline__ uint32_t addr() const { return smem_u32(&word); }
  // By one thread, before any use; followed by fence_init() and a block-wide barrier.
  __device__ __forceinline__ void init(uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr()), "r"(arrivals) : "memory");
  }
  __device__ __forceinline__ static void fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __device__ __forceinline__ void arrive() {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(addr()) : "memory");
  }
  // One arrival that also announces `bytes` of transactions (TMA copies) the phase must wait for.
  __device__ __forceinline__ void arrive_expect_tx(uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(addr()), "r"(bytes) : "memory");
  }
  __device__ __forceinline__ bool try_wait(uint32_t parity) const {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr()), "r"(parity)
        : "memory");
    return done != 0;
  }
  __device__ __forceinline__ void wait(uint32_t parity) const {
    while (!try_wait(parity)) {
    }
  }
};

// A ring of kStages slots that a producer fills and consumers drain: slot i is on its (i / kStages)-th use,
// whose phase parity is (i / kStages) & 1.
template <int kStages>
struct RingSlot {
  int index;  // running count of slots used
  __device__ __forceinline__ int stage() const { return index % kStages; }
  __device__ __forceinline__ uint32_t parity() const { return static_cast<uint32_t>(index / kStages) & 1u; }
};

// ---- TMA: one tile of a tensor map (built on the host by tma.h), written into shared memory, completing
// on `bar` (which must expect the tile's bytes). Coordinates are elements, innermost dimension first.
__device__ __forceinline__ void tma_load_4d(void* dst, const void* tensor_map, Mbarrier& bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar.addr())
      : "memory");
}

// The reverse: the box of a tensor map at the given coordinates written from shared memory (in the layout a
// load of the same box leaves) by the copy engine; rows past the tensor's ends are not written, so a ragged
// last tile clips. Issued by one thread, it joins a bulk group at bulk_commit() like the bulk reductions
// below: the shared memory may be rewritten once bulk_wait_read<N>() returns, and bulk_wait<N>() before
// the block exits. Shared memory written by ordinary stores needs fence_proxy_async_shared() in each writer
// and a barrier before the issue.
__device__ __forceinline__ void tma_store_4d(const void* tensor_map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(tensor_map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

__device__ __forceinline__ void tma_prefetch_descriptor(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
}

// A contiguous run of `bytes` (a multiple of 16; both addresses 16-byte aligned) copied from global into
// shared memory by the copy engine, completing on `bar` like a tile (per-row fp32 arrays of the backward).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, Mbarrier& bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar.addr())
               : "memory");
}

// ---- Bulk reduce-add: `bytes` (a multiple of 16; both addresses 16-byte aligned) of fp32 in shared memory
// added element by element to global memory by the copy engine, issued by one thread. The writes are
// atomic per element with respect to other reductions (the backward's dQ accumulator). Operations join a
// bulk group at bulk_commit(); bulk_wait_read<N>() returns once all but the N newest groups have read
// their shared memory (the source may be rewritten), bulk_wait<N>() once they are complete. Shared memory
// written by ordinary stores needs fence_proxy_async_shared() (below) in each writer before the issue.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                   reinterpret_cast<uint64_t>(dst)),
               "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ---- wgmma shared-memory matrix descriptors for tiles in the swizzled layout above.
// Fields (PTX "matrix descriptor"): start address, leading- and stride-dimension byte offsets (all >> 4),
// base offset 0 (tiles are 1024-byte aligned), swizzle mode 1 = 128 bytes in bits 62-63.
// `swizzle_mode` 2 is the 64-byte swizzle (8-bit rows of 64 bytes: k_major_descriptor_8bit).
// `offset_bytes` (a multiple of 16) is added to the start address after the base's fields are put together,
// so that a kernel's descriptors of one tile share one loop-invariant base and differ by one 32-bit add: the
// address field is 14 bits of (address >> 4) and shared memory ends below 256 KB, so the add never carries
// into the leading-offset field. (Masking and shifting each tile address again cost ~10 instructions per
// wgmma in the backward, most of its instructions.)
__device__ __forceinline__ uint64_t matrix_descriptor(uint32_t smem_address, uint32_t leading_bytes,
                                                      uint32_t stride_bytes, uint64_t swizzle_mode = 1,
                                                      uint32_t offset_bytes = 0) {
  const uint32_t lo = ((smem_address >> 4) | ((leading_bytes >> 4) << 16)) + (offset_bytes >> 4);
  const uint32_t hi = (stride_bytes >> 4) | (static_cast<uint32_t>(swizzle_mode) << 30);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// An operand whose reduction (K) dimension is the tile's columns (Q and K in S = Q·Kᵀ): the 16 columns
// [16·k_step, 16·k_step + 16) of rows [row0, row0 + 8·m) — consecutive 8-row groups are one swizzle atom
// apart; the leading offset is unused for K-major swizzled operands.
__device__ __forceinline__ uint64_t k_major_descriptor(const void* tile, int tile_rows, int row0, int k_step) {
  const uint32_t offset = static_cast<uint32_t>((k_step * 16 / kPanelCols) * tile_rows * kPanelRowBytes +
                                                row0 * kPanelRowBytes + (k_step * 16 % kPanelCols) * 2);
  return matrix_descriptor(smem_u32(tile), 16, kSwizzleAtomBytes, 1, offset);
}

// An operand whose reduction dimension is the tile's rows and whose N dimension is its columns (V in
// O += P·V, read with wgmma's transpose flag): rows [16·k_step, 16·k_step + 16), all columns. N steps
// from panel to panel (the leading offset), K from one 8-row group to the next (the stride offset).
__device__ __forceinline__ uint64_t mn_major_descriptor(const void* tile, int tile_rows, int k_step) {
  return matrix_descriptor(smem_u32(tile), static_cast<uint32_t>(tile_rows * kPanelRowBytes), kSwizzleAtomBytes, 1,
                           static_cast<uint32_t>(k_step * 16 * kPanelRowBytes));
}

// ---- wgmma.mma_async: D[64 x N] (+)= A[64 x 16] · B[16 x N] for one warpgroup, fp32 accumulators, for the
// N the kernels use (64, 128 and 256 for P·V at those head dims; 80, 128 and 176 for S's key blocks; 32 for
// the wide-head backward's share of Sᵀ and dPᵀ, ss only).
// Accumulator d[i] of thread (warp w of the warpgroup, lane = 4g + t) is row 16w + g + 8·((i / 2) % 2),
// column 8·(i / 4) + 2t + i % 2. A from registers uses mma.sync's m16n8k16 A fragment per warp:
// a[0] = (row g, cols 2t..2t+1), a[1] = (g + 8, 2t..), a[2] = (g, 2t + 8..), a[3] = (g + 8, 2t + 8..).
// ss: A and B from descriptors; rs: A from registers. kTransB = 1 reads B N-major (mn_major_descriptor);
// kTransA = 1 (ss only) reads A M-major, a tile whose rows are the reduction dimension and whose columns
// are A's 64 rows (mn_major_descriptor again: the backward's dQ = dS·K from the dSᵀ tile it stores).
// `accumulate` = 0 overwrites D.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Ends the basic block after exponentials that run under an in-flight wgmma (the backward's Pᵀ under dPᵀ), so that
// the wgmma wait after them stays after them. ptxas hoists a wgmma.wait_group to the top of its basic block: with
// the exponentials and the wait in one block, the d128 backward's SASS waited for dPᵀ first and ran all 32 of
// Pᵀ's exponentials after it. A branch on one of the last values computed splits the block (19 of the 32 then
// run under dPᵀ at d128, 36 of 64 at d64; the rest, not feeding the branch, ptxas still sinks). It compares
// `last_value` with `other`, a value it never equals in practice that ptxas cannot prove different (ptxas
// folds `p == -1` away where p is an ex2 result, which it knows to be non-negative); were they ever equal, the
// branch would only sleep a nanosecond. One compare and one branch a step: the backward 1.019x over the fa grid
// on an H200 (docs/perf.md). The forward's softmax under its own P·V, the same way, was slower at d64 and not
// faster at d128 (docs/perf.md, "What did not work").
__device__ __forceinline__ void keep_above_wgmma_wait(float last_value, float other) {
  if (last_value == other) asm volatile("nanosleep.u32 1;");
}
// Keeps the compiler from moving reads or writes of accumulator registers across an asynchronous wgmma
// (issue ... wait): the registers are "used and redefined" here, in program order.
template <int kN>
__device__ __forceinline__ void fence_accumulators(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <class T, int N>
struct WgmmaM64;
// One specialisation per N, for both 16-bit types (PTX_TYPE is bf16 or f16); the operand lists are
// spelled out because inline PTX names every accumulator register.
#define FLASHLM_SM90_WGMMA_M64N32(T, PTX_TYPE) \
  template <> struct WgmmaM64<T, 32> { \
    template <int kTransB, int kTransA = 0> \
    static __device__ __forceinline__ void ss(float (&d)[16], uint64_t a, uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n32k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %20, %19;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB), "n"(kTransA)); \
    } \
  };
#define FLASHLM_SM90_WGMMA_M64N64(T, PTX_TYPE) \
  template <> struct WgmmaM64<T, 64> { \
    template <int kTransB, int kTransA = 0> \
    static __device__ __forceinline__ void ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %36, %35;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB), "n"(kTransA)); \
    } \
    template <int kTransB> \
    static __device__ __forceinline__ void rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB)); \
    } \
  };
#define FLASHLM_SM90_WGMMA_M64N80(T, PTX_TYPE) \
  template <> struct WgmmaM64<T, 80> { \
    template <int kTransB, int kTransA = 0> \
    static __device__ __forceinline__ void ss(float (&d)[40], uint64_t a, uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n80k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, %44, %43;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]) \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB), "n"(kTransA)); \
    } \
    template <int kTransB> \
    static __device__ __forceinline__ void rs(float (&d)[40], const uint32_t (&a)[4], uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %45, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n80k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, {%40, %41, %42, %43}, %44, p, 1, 1, %46;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]) \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB)); \
    } \
  };
#define FLASHLM_SM90_WGMMA_M64N128(T, PTX_TYPE) \
  template <> struct WgmmaM64<T, 128> { \
    template <int kTransB, int kTransA = 0> \
    static __device__ __forceinline__ void ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %68, %67;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB), "n"(kTransA)); \
    } \
    template <int kTransB> \
    static __device__ __forceinline__ void rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB)); \
    } \
  };
#define FLASHLM_SM90_WGMMA_M64N176(T, PTX_TYPE) \
  template <> struct WgmmaM64<T, 176> { \
    template <int kTransB, int kTransA = 0> \
    static __device__ __forceinline__ void ss(float (&d)[88], uint64_t a, uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n176k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, %92, %91;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]) \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB), "n"(kTransA)); \
    } \
    template <int kTransB> \
    static __device__ __forceinline__ void rs(float (&d)[88], const uint32_t (&a)[4], uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %93, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n176k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, {%88, %89, %90, %91}, %92, p, 1, 1, %94;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]) \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB)); \
    } \
  };
#define FLASHLM_SM90_WGMMA_M64N192(T, PTX_TYPE) \
  template <> struct WgmmaM64<T, 192> { \
    template <int kTransB, int kTransA = 0> \
    static __device__ __forceinline__ void ss(float (&d)[96], uint64_t a, uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n192k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1, %100, %99;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]) \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB), "n"(kTransA)); \
    } \
    template <int kTransB> \
    static __device__ __forceinline__ void rs(float (&d)[96], const uint32_t (&a)[4], uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n192k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, %102;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]) \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB)); \
    } \
  };
#define FLASHLM_SM90_WGMMA_M64N256(T, PTX_TYPE) \
  template <> struct WgmmaM64<T, 256> { \
    template <int kTransB, int kTransA = 0> \
    static __device__ __forceinline__ void ss(float (&d)[128], uint64_t a, uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %132, %131;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB), "n"(kTransA)); \
    } \
    template <int kTransB> \
    static __device__ __forceinline__ void rs(float (&d)[128], const uint32_t (&a)[4], uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX_TYPE "." PTX_TYPE \
                   " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB)); \
    } \
  };
FLASHLM_SM90_WGMMA_M64N32(__nv_bfloat16, "bf16")
FLASHLM_SM90_WGMMA_M64N32(__half, "f16")
FLASHLM_SM90_WGMMA_M64N64(__nv_bfloat16, "bf16")
FLASHLM_SM90_WGMMA_M64N64(__half, "f16")
FLASHLM_SM90_WGMMA_M64N80(__nv_bfloat16, "bf16")
FLASHLM_SM90_WGMMA_M64N80(__half, "f16")
FLASHLM_SM90_WGMMA_M64N128(__nv_bfloat16, "bf16")
FLASHLM_SM90_WGMMA_M64N128(__half, "f16")
FLASHLM_SM90_WGMMA_M64N176(__nv_bfloat16, "bf16")
FLASHLM_SM90_WGMMA_M64N176(__half, "f16")
FLASHLM_SM90_WGMMA_M64N192(__nv_bfloat16, "bf16")
FLASHLM_SM90_WGMMA_M64N192(__half, "f16")
FLASHLM_SM90_WGMMA_M64N256(__nv_bfloat16, "bf16")
FLASHLM_SM90_WGMMA_M64N256(__half, "f16")
#undef FLASHLM_SM90_WGMMA_M64N32
#undef FLASHLM_SM90_WGMMA_M64N64
#undef FLASHLM_SM90_WGMMA_M64N80
#undef FLASHLM_SM90_WGMMA_M64N128
#undef FLASHLM_SM90_WGMMA_M64N176
#undef FLASHLM_SM90_WGMMA_M64N192
#undef FLASHLM_SM90_WGMMA_M64N256

// ---- FP8 (e4m3 x e4m3 -> fp32) wgmma, K = 32 per instruction. 8-bit operands exist only K-major (no
// transpose flags): both A and B tiles keep the reduction dimension along their 128-byte rows, so a k_step
// of 32 fp8 elements is the same 32 bytes k_major_descriptor steps over for 16 16-bit ones. The register A
// fragment (rs) holds, per warp and thread (lane = 4g + t), a[0] = row g, columns 4t..4t+3 (one byte each,
// the lowest column in the lowest byte), a[1] = row g + 8, same columns, a[2] and a[3] the same at columns
// 16 + 4t..16 + 4t + 3. Accumulators are laid out as for the 16-bit wgmma above.
//
// An 8-bit K-major operand in a tile whose rows are kRowBytes long, as TMA writes it (tma.h): 128 bytes with
// the 128-byte swizzle, or 64 bytes (e4m3 at head dim 64) with the 64-byte one, where 16-byte chunk c of
// row r sits at c ^ ((r / 2) % 4) and the pattern repeats every 8 rows = 512 bytes. Rows [row0, row0 + 8·m),
// reduction bytes [32·k_step, 32·k_step + 32).
template <int kRowBytes>
__device__ __forceinline__ uint64_t k_major_descriptor_8bit(const void* tile, int row0, int k_step) {
  static_assert(kRowBytes == 64 || kRowBytes == 128);
  return matrix_descriptor(smem_u32(tile), 16, 8 * kRowBytes, kRowBytes == 128 ? 1 : 2,
                           static_cast<uint32_t>(row0 * kRowBytes + k_step * 32));
}
template <int N>
struct WgmmaM64E4m3;
template <> struct WgmmaM64E4m3<64> {
  static __device__ __forceinline__ void ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(a), "l"(b), "r"(accumulate));
  }
  static __device__ __forceinline__ void rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  }
};
template <> struct WgmmaM64E4m3<128> {
  static __device__ __forceinline__ void ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(a), "l"(b), "r"(accumulate));
  }
  static __device__ __forceinline__ void rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  }
};

// S = Q·Kᵀ of the FP8 forward's 192-key blocks (ss only: no head dim of 192 takes P·V).
template <> struct WgmmaM64E4m3<192> {
  static __device__ __forceinline__ void ss(float (&d)[96], uint64_t a, uint64_t b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
                 : "l"(a), "l"(b), "r"(accumulate));
  }
};

// ---- Named barriers (bar.sync / bar.arrive on ids 1..15; id 0 is __syncthreads'), ids from one enum so
// that no two uses collide. `threads` counts every thread that syncs or arrives, a multiple of 32.
enum class NamedBarrier : uint32_t {
  kWarpgroupTurn0 = 1,   // ping-pong: consumer warpgroup 0 may issue its GEMMs (the ids of warpgroups 1
  kWarpgroupTurn1 = 2,   // and 2 follow: the forward pipeline adds the warpgroup's index)
  kWarpgroupTurn2 = 3,
  kEpilogue0 = 4,        // forward: consumer warpgroup 0's rows of O are in shared memory (TMA store); 1
  kEpilogue1 = 5,        // and 2 the same for those warpgroups
  kEpilogue2 = 6,
  kBackwardDsReady = 7,  // backward: both consumer warpgroups have stored their half of a step's dSᵀ
};
__device__ __forceinline__ void named_barrier_sync(NamedBarrier id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(static_cast<uint32_t>(id)), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(NamedBarrier id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(static_cast<uint32_t>(id)), "r"(threads) : "memory");
}

// ---- setmaxnreg: moves registers between warpgroups of a block launched with a register cap
// (__launch_bounds__(threads, 1)); every thread of the warpgroup executes it, in one branch per role.
template <int kRegisters>
__device__ __forceinline__ void registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// ---- stmatrix: a warp stores four 8x8 tiles of 16-bit values to shared memory in one instruction. Register
// m of lane l holds the two values of tile m at row l / 4, columns 2·(l % 4) and + 1 (the mma and wgmma
// accumulator fragment's layout, packed), and lane l gives the address of row l % 8 of tile l / 8 (16-byte
// aligned: in the swizzled layout, any 8-column chunk).
__device__ __forceinline__ void stmatrix_x4(uint32_t row_address, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_address), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Orders this thread's ordinary shared-memory writes before later reads by the async proxy (TMA, wgmma).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace flashlm::sm90
