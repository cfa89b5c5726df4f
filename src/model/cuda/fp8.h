// FP8 training's casts on CUDA (--precision fp8; the arithmetic in model/fp8.h): the tensorwise amax of a
// tensor and its FP8 copies, straight and transposed, with the scale computed on the device from the amax
// (no host synchronisation: a step with these stays one CUDA graph). The bits are those of the CPU
// emulation (fp8_quantize_cpu). Asynchronous on `stream`; device pointers; T ∈ {float, bf16_t}.
#pragma once
#include <cstdint>

#include "flashlm/dtype.h"
#include "flashlm/fp8.h"

namespace flashlm::gpu {

// *amax = max |x| over x[count] (a NaN anywhere gives NaN): a memset of *amax, then one reduction (integer
// atomics on the magnitudes' bits: the result does not depend on the order, so it is reproducible).
template <class T>
void fp8_amax(const T* x, int64_t count, float* amax, void* stream);

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

}  // namespace flashlm::gpu
