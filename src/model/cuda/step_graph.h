// CudaModel::train_step as one CUDA graph (ModelOptions::cuda_graph): the graph's state, and what capturing
// and replaying it needs. The capture and the replay are step_graph.cpp's. PinnedArray and abandon_capture
// serve every graph the library captures (PagedKvDecoder's decoding step too).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/cuda_check.h"
#include "flashlm/tensor.h"
#include "optim/optimizer.h"

namespace flashlm {

// Host memory the GPU reads and writes while a graph runs (the copies of a graph need page-locked memory:
// a copy from pageable memory would read the host array as it was at capture).
template <class T>
struct PinnedArray {
  T* data = nullptr;
  explicit PinnedArray(size_t count) {
    FLASHLM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&data), count * sizeof(T)), "cudaMallocHost");
  }
  ~PinnedArray() { cudaFreeHost(data); }
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
};

// After a capture on `stream` failed part-way (an exception between cudaStreamBeginCapture and a successful
// cudaGraphInstantiate): ends the capture if it is still open, destroys its partial graph and `graph` (the
// captured one, when instantiation failed; may be null), and clears the error the failure left, so that the
// stream runs eagerly again and the next CUDA call reports only its own error.
void abandon_capture(cudaStream_t stream, cudaGraph_t graph);

// train_step as one CUDA graph (ModelOptions::cuda_graph). The step runs on a stream of its own, created
// blocking so that it stays ordered with the legacy default stream the model may otherwise use (which
// cannot be captured); its first call runs eagerly there (it allocates the moments, the cuBLASLt plans and
// that stream's workspace, none of which may happen inside a capture), the second captures and launches.
// The host arrays: `in` (this step's scalars, copied to the device by the graph's first node), `out` (the
// scalars after clipping: the norm and the factor), `rows` (the per-token losses, copied back by the graph).
struct StepGraph {
  cudaStream_t stream = nullptr;
  cudaGraphExec_t exec = nullptr;
  bool warmed_up = false;
  std::string failure;  // why a capture failed: every later step is eager
  Buffer scalars;       // DeviceStepScalars on the device
  std::unique_ptr<PinnedArray<DeviceStepScalars>> in, out;
  std::unique_ptr<PinnedArray<float>> rows;
  // The host state a replay leaves behind (as the captured step's host code left it).
  bool norms_current = false;
  int64_t materialized_segment = -1;
  int64_t replays = 0;
  bool fp8_copies = false;  // captured with the optimizer's FP8 weight copies (CudaModel's fp8_copies_wanted)
  bool fp8_weights_bf16_stale = false;  // whose step leaves the block weights' bf16 copy stale (Impl's flag)
  StepGraph() { FLASHLM_CUDA_CHECK(cudaStreamCreate(&stream), "cudaStreamCreate (train-step graph)"); }
  ~StepGraph() {
    cudaStreamSynchronize(stream);
    if (exec) cudaGraphExecDestroy(exec);
    cudaStreamDestroy(stream);
  }
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;
};

// Points the model's stream at another one for a scope.
struct StreamScope {
  void*& slot;
  void* saved;
  StreamScope(void*& s, void* to) : slot(s), saved(s) { slot = to; }
  ~StreamScope() { slot = saved; }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;
};

}  // namespace flashlm
