// The token embedding on CUDA (model/cuda/ops.h), forward (a gather, packed when d % 8 == 0) and backward:
// (token, row) pairs radix-sorted (stable, so the rows of one token stay in increasing order); the first
// sorted position of each token adds that token's rows into its table row, one thread per column, exactly
// as the CPU loop does. No two blocks write one table row.
#include <cub/device/device_radix_sort.cuh>

#include <bit>

#include "core/cuda/kernels.cuh"
#include "core/cuda_check.h"
#include "flashlm/memory.h"
#include "model/cuda/ops.h"

namespace flashlm::gpu {

namespace {

constexpr int kEmbThreads = 256;   // backward: columns per block
constexpr int kEmbPositions = 16;  // backward: sorted positions per block
constexpr int64_t kMaxGridY = 65535;

// Packs only when d % kPack == 0, so that no pack straddles two rows.
template <class D>
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(const float* __restrict__ table, const int32_t* __restrict__ tokens, D* __restrict__ x,
                             int64_t n, int64_t d, int64_t vocab, int64_t packs) {
  for_each_pack(n * d, packs, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    const int64_t r = i / d, j = i - r * d;
    const int32_t tok = tokens[r];
    Vec<D, W> xv;
    if (tok >= 0 && tok < vocab) {
      const Vec<float, W> tv = load<W>(table + int64_t{tok} * d + j);
#pragma unroll
      for (int k = 0; k < W; ++k) xv[k] = from_f32<D>(tv[k]);
    } else {
#pragma unroll
      for (int k = 0; k < W; ++k) xv[k] = from_f32<D>(__int_as_float(0x7fc00000));
    }
    store(x + i, xv);
  });
}

// Sort keys: the token, or `vocab` (sorted after every valid token) for a token outside [0, vocab);
// values: the row.
__global__ void __launch_bounds__(kThreads)
    embedding_keys_kernel(const int32_t* __restrict__ tokens, int64_t n, int64_t vocab, uint32_t* __restrict__ keys,
                          int32_t* __restrict__ rows) {
  FLASHLM_GRID_STRIDE(i, n) {
    const int32_t tok = tokens[i];
    keys[i] = tok >= 0 && tok < vocab ? uint32_t(tok) : uint32_t(vocab);
    rows[i] = int32_t(i);
  }
}

// Block (x, y) visits sorted positions [x·kEmbPositions, +kEmbPositions) for columns
// [y·kEmbThreads, +kEmbThreads). A position that starts a run of equal keys owns that token: it adds
// the run's rows (increasing row order, the radix sort being stable) into the token's table row.
template <class D>
__global__ void __launch_bounds__(kEmbThreads)
    embedding_backward_kernel(const D* __restrict__ dx, const uint32_t* __restrict__ keys,
                              const int32_t* __restrict__ rows, float* __restrict__ dtable, int64_t n, int64_t d,
                              int64_t vocab) {
  const int64_t j = int64_t{blockIdx.y} * kEmbThreads + threadIdx.x;
  if (j >= d) return;
  const int64_t p0 = int64_t{blockIdx.x} * kEmbPositions;
  const int64_t p1 = min(n, p0 + kEmbPositions);
  for (int64_t p = p0; p < p1; ++p) {
    const uint32_t key = keys[p];
    if (key >= vocab) break;  // the invalid-token key sorts last: all that follows is invalid too
    if (p > 0 && keys[p - 1] == key) continue;
    // End of the run: the first position in (p, n) whose key is larger (binary search, keys sorted).
    int64_t lo = p + 1, hi = n;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (keys[mid] == key) lo = mid + 1;
      else hi = mid;
    }
    float* out = dtable + int64_t{key} * d + j;
    float acc = *out;
#pragma unroll 4
    for (int64_t q = p; q < lo; ++q) acc += f32(dx[int64_t{rows[q]} * d + j]);
    *out = acc;
  }
}

// The sizes both passes take: n tokens, rows of d values, ids below vocab.
void check_embedding_sizes(const char* fn, int64_t n, int64_t d, int64_t vocab) {
  check_count(fn, "n", n);
  check_width(fn, "d", d);
  check_width(fn, "vocab", vocab);
}

}  // namespace

template <class T>
void embedding_forward(const float* table, const int32_t* tokens, T* x, int64_t n, int64_t d, int64_t vocab,
                       void* stream) {
  check_embedding_sizes("embedding_forward", n, d, vocab);
  if (n == 0) return;
  const int64_t packs = d % kPack == 0 ? pack_count(n * d, table, x) : 0;
  embedding_forward_kernel<<<packed_blocks(n * d, packs), kThreads, 0, as_stream(stream)>>>(table, tokens, dev(x), n,
                                                                                             d, vocab, packs);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "embedding_forward_kernel");
}

template <class T>
void embedding_backward(const T* dx, const int32_t* tokens, float* dtable, int64_t n, int64_t d, int64_t vocab,
                        void* stream) {
  check_embedding_sizes("embedding_backward", n, d, vocab);
  FLASHLM_CHECK(n <= INT_MAX, "embedding_backward: n = {} is too large", n);
  FLASHLM_CHECK(ceil_div(d, kEmbThreads) <= kMaxGridY, "embedding_backward: d = {} is too large", d);
  if (n == 0) return;
  const cudaStream_t s = as_stream(stream);

  // Workspace: keys and rows before and after the sort, then the radix sort's own storage.
  const int end_bit = std::bit_width(uint32_t(vocab));  // every key (at most vocab) fits in end_bit bits
  size_t sort_bytes = 0;
  FLASHLM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr),
                                                     static_cast<uint32_t*>(nullptr),
                                                     static_cast<const int32_t*>(nullptr),
                                                     static_cast<int32_t*>(nullptr), int(n), 0, end_bit, s),
                     "embedding_backward: radix sort size query");
  const size_t array_bytes = (size_t(n) * 4 + 255) / 256 * 256;
  Buffer scratch = Buffer::allocate_on_stream(4 * array_bytes + sort_bytes, "embedding_backward sort", stream);
  char* base = static_cast<char*>(scratch.data());
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(base);
  uint32_t* keys = reinterpret_cast<uint32_t*>(base + array_bytes);
  int32_t* rows_in = reinterpret_cast<int32_t*>(base + 2 * array_bytes);
  int32_t* rows = reinterpret_cast<int32_t*>(base + 3 * array_bytes);
  void* sort_storage = base + 4 * array_bytes;

  embedding_keys_kernel<<<elementwise_blocks(n), kThreads, 0, s>>>(tokens, n, vocab, keys_in, rows_in);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "embedding_keys_kernel");
  FLASHLM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_storage, sort_bytes, keys_in, keys, rows_in, rows, int(n),
                                                     0, end_bit, s),
                     "embedding_backward: radix sort");
  const dim3 grid(unsigned(ceil_div(n, kEmbPositions)), unsigned(ceil_div(d, kEmbThreads)));
  embedding_backward_kernel<<<grid, kEmbThreads, 0, s>>>(dev(dx), keys, rows, dtable, n, d, vocab);
  FLASHLM_CUDA_CHECK(cudaGetLastError(), "embedding_backward_kernel");
}

#define FLASHLM_EMBEDDING_INSTANTIATE(T) \
  template void embedding_forward<T>(const float*, const int32_t*, T*, int64_t, int64_t, int64_t, void*); \
  template void embedding_backward<T>(const T*, const int32_t*, float*, int64_t, int64_t, int64_t, void*);

FLASHLM_EMBEDDING_INSTANTIATE(float)
FLASHLM_EMBEDDING_INSTANTIATE(bf16_t)
FLASHLM_EMBEDDING_INSTANTIATE(fp16_t)

#undef FLASHLM_EMBEDDING_INSTANTIATE

}  // namespace flashlm::gpu
