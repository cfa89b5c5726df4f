// Elementwise utilities and checks over device arrays, for every layer of the library (the LM's models,
// data parallelism): casts between fp32 and the 16-bit types, scaling, a non-finite count, memset and
// stream synchronisation for callers without the CUDA headers. Conventions as in model/cuda/ops.h: device
// pointers, asynchronous on `stream` (a cudaStream_t; nullptr is the legacy default stream), launches
// checked (flashlm::CudaError), bad sizes raise flashlm::Error before anything is queued. Only in builds
// with CUDA (FLASHLM_WITH_CUDA); this header itself needs no CUDA headers.
#pragma once
#include <cstddef>
#include <cstdint>

#include "flashlm/dtype.h"

namespace flashlm::gpu {

// *out = number of NaN/±inf values among x[0, n) (device scalar, saturated at INT_MAX), T ∈ {float,
// bf16_t, fp16_t}. [scratch: ceil(n / 8192) int64, stream-ordered]
template <class T>
void count_nonfinite(const T* x, int64_t n, int* out, void* stream);

// x *= s over n fp32 values.
void scale_inplace(float* x, int64_t n, float s, void* stream);
// dst = src rounded to T (round to nearest even; float -> float is a copy); and back to fp32 (exact).
template <class T>
void cast_from_f32(const float* src, T* dst, int64_t n, void* stream);
template <class T>
void cast_to_f32(const T* src, float* dst, int64_t n, void* stream);

// cudaMemsetAsync(dst, value, bytes, stream) (e.g. 0 to clear gradients, 0xFF to poison with NaN), and
// cudaStreamSynchronize(stream).
void memset_async(void* dst, int value, size_t bytes, void* stream);
void stream_synchronize(void* stream);

}  // namespace flashlm::gpu
