// The library's narrow door to the CUDA runtime, so that host-only files need no CUDA headers.
// Built from device_cuda.cu with CUDA, from device.cpp's fallbacks without.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>
#include <string_view>

namespace flashlm {

void* cuda_malloc_or_throw(size_t bytes, std::string_view tag);  // OutOfMemory when the GPU is full
void cuda_free_noexcept(void* p);
void* cuda_malloc_async_or_throw(size_t bytes, std::string_view tag, void* stream);  // stream-ordered
void cuda_free_async_noexcept(void* p, void* stream);
int cuda_device_count_or_zero();
int cuda_current_device();
int cuda_pointer_device(const void* p);  // -1 for a host pointer or an unknown one
// Free bytes on the current device (cudaMemGetInfo); -1 when there is no GPU.
int64_t cuda_free_memory_bytes();
// The most dynamic shared memory one thread block may opt in to on the current device
// (cudaDevAttrMaxSharedMemoryPerBlockOptin: 227 KiB on sm_90, 163 on sm_80, 99 on sm_86/89); -1 without a GPU.
int64_t cuda_shared_memory_per_block_optin();
// Waits for the device, then gives the stream-ordered pool's freed blocks back to the driver (the pool keeps
// them otherwise: keep_pool_memory), so that cuda_free_memory_bytes() counts them free again, e.g. before a
// memory plan is checked for a model built after another was destroyed. No-op without a GPU.
void cuda_release_pooled_memory();
std::string cuda_device_description();
void cuda_copy(void* dst, const void* src, size_t bytes);  // any direction, synchronous
void cuda_copy_async(void* dst, const void* src, size_t bytes, void* stream);  // any direction, queued on `stream`
void cuda_memset_async(void* dst, int value, size_t bytes, void* stream);  // queued on `stream`
void cuda_synchronize();
void cuda_stream_synchronize(void* stream);  // waits for the work queued on `stream` (a cudaStream_t)
// Runs fn once per repetition between two CUDA events on the default stream and returns each time in ms.
// `before`, where given, runs before each repetition outside the timed region (e.g. queueing an L2 flush,
// which also keeps the GPU busy while the host prepares fn's launches, so that fn's host cost is not timed).
std::vector<double> cuda_time_each_ms(const std::function<void()>& fn, int reps,
                                      const std::function<void()>& before = {});   // "NVIDIA H200 (sm_90, 132 SMs, 140 GiB), CUDA 13.0, driver 580"

}  // namespace flashlm
