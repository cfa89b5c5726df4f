// FP8 training's casts on CUDA (--precision fp8; the arithmetic in model/fp8.h): the tensorwise amax of a
// tensor (or, rowwise, of its rows and columns) and its FP8 copies, straight and transposed, with the scale
// computed on the device from the amax (no host synchronisation: a step with these stays one CUDA graph). The
// bits are those of the CPU emulation (fp8_quantize_cpu, fp8_cast_rowwise_cpu). Asynchronous on `stream`; device pointers; T ∈ {float, bf16_t}.
#pragma once
#include <cstdint>

#include "flashlm/dtype.h"
#include "flashlm/fp8.h"

namespace flashlm::gpu {

// *amax = max |x| over x[count] (a NaN anywhere gives NaN): a memset of *amax, then one reduction (integer
// atomics on the magnitudes' bits: the result does not depend on the order, so it is reproducible).
template <class T>
void fp8_amax(const T* x, int64_t count, float* amax, void* stream);

// The amaxes of many tensors in one launch (the block weights' at the start of a pass: one kernel instead of one
// per weight). Segment i: *amax = max |x[0, count)| like fp8_amax, into a float that must be zero before the
// launch (the caller clears them, in one memset where they are together); its blocks are
// [first_chunk, first_chunk + fp8_amax_chunks(count)) of the grid, the segments in order, chunks contiguous.
struct Fp8AmaxSegment {
  const bf16_t* x;
  int64_t count;
  int64_t first_chunk;
  float* amax;
};
// The blocks of a segment of `count` elements: one per kFp8AmaxChunk elements.
constexpr int64_t kFp8AmaxChunk = int64_t{1} << 16;
inline int64_t fp8_amax_chunks(int64_t count) { return (count + kFp8AmaxChunk - 1) / kFp8AmaxChunk; }
// segments: `n` device entries (first_chunk increasing from 0); chunks: the last one's first_chunk + its chunks.
void fp8_amax_segments(const Fp8AmaxSegment* segments, int n, int64_t chunks, void* stream);

// x [rows, cols] rounded to FP8 `format` with scale = fp8_scale(*amax): q [rows, cols] (when not null) and
// its transpose qt [cols, rows] (when not null; the K-major copy a cuBLASLt FP8 operand stored the other way
// needs), from one read of x. *dequant = 1 / scale (the GEMM's scale for this operand). rows, cols >= 1.
template <class T>
void fp8_cast(const T* x, int64_t rows, int64_t cols, const float* amax, Fp8Format format, uint8_t* q, uint8_t* qt,
              float* dequant, void* stream);

// Both: amax (into scales[kFp8AmaxIndex]) then the cast (dequantisation scale into scales[kFp8DequantIndex]).
// scales: one operand's slot of kFp8ScaleSlotFloats device floats, 16-byte aligned (model/fp8.h).
template <class T>
void fp8_quantize(const T* x, int64_t rows, int64_t cols, Fp8Format format, uint8_t* q, uint8_t* qt, float* scales,
                  void* stream);

// FSDP's FP8 gather (dist/fp8_gather.h): scales[kFp8AmaxIndex] = the largest of amaxes[0], amaxes[stride], …,
// amaxes[(count − 1)·stride] (each >= 0 or NaN: every rank's amax of one scale group; NaN wins, as the
// reductions order magnitudes by their bits), and scales[kFp8DequantIndex] = its dequantisation scale in
// `format`: the values fp8_quantize writes for a tensor of that amax. One thread; count >= 1.
void fp8_scales_from_amaxes(const float* amaxes, int64_t count, int64_t stride, Fp8Format format, float* scales,
                            void* stream);

// qt [cols, rows] = q [rows, cols] transposed, FP8 bytes as they are: a tensorwise copy transposed keeps its
// scale, so this is the transposed cast of the same tensor, bit for bit (FSDP's gathered weights: the wᵀ of
// the backward's dx product from the gathered w). rows, cols >= 1.
void fp8_transpose(const uint8_t* q, int64_t rows, int64_t cols, uint8_t* qt, void* stream);

// ---------------------------------------------------------------------------------------------------
// Rowwise (Fp8Recipe::rowwise): a tensor's copies scaled per row (straight) and per column (transposed). The
// producer-fused amax (Fp8Produced) is tensorwise only: these casts reduce their own amaxes.

// One operand's device scale vectors: the row amaxes and dequantisation scales [rows], the column ones [cols].
// The dequantisation vectors are what cuBLASLt's outer-vector scaling reads: 16-byte aligned
// (kFp8ScaleAlignment, as the Fp8VectorSet regions are).
struct Fp8ScaleVectors {
  float* row_amax;
  float* col_amax;
  float* row_dequant;
  float* col_dequant;
};

// row_amax[r] = max |x[r, ·]| and col_amax[c] = max |x[·, c]| of x [rows, cols] (NaN wins), from one read of x:
// memsets of both, then one reduction (integer atomics on the magnitudes' bits: reproducible). rows, cols >= 1.
template <class T>
void fp8_amax_rows_cols(const T* x, int64_t rows, int64_t cols, float* row_amax, float* col_amax, void* stream);

// x [rows, cols] rounded to FP8 `format`, from one read of x: q [rows, cols] (when not null) scaled per row by
// fp8_scale(row_amax[r]), row_dequant[r] = 1 / that scale; qt [cols, rows] (when not null) scaled per column by
// fp8_scale(col_amax[c]), col_dequant[c]. The bits of fp8_cast_rowwise_cpu. rows, cols >= 1.
template <class T>
void fp8_cast_rowwise(const T* x, int64_t rows, int64_t cols, const float* row_amax, const float* col_amax,
                      Fp8Format format, uint8_t* q, uint8_t* qt, float* row_dequant, float* col_dequant, void* stream);

// Both: the amaxes into v's, then the cast (its dequantisation scales into v's).
template <class T>
void fp8_quantize_rowwise(const T* x, int64_t rows, int64_t cols, Fp8Format format, uint8_t* q, uint8_t* qt,
                          const Fp8ScaleVectors& v, void* stream);

}  // namespace flashlm::gpu
