// How many SMs the GEMMs (model/cuda/gemm.h) leave to the communication running beside them: a per-thread
// setting that data parallelism (src/dist/) sets around an overlapped backward and the GEMMs read when they
// plan. Plain C++, no CUDA headers.
#pragma once

namespace flashlm {

// SMs the GEMMs leave to work running beside them — NCCL's all-reduce kernels, which DDP overlaps with
// the backward and which hold their SMs for the whole collective. cuBLASLt then plans each product for
// (SM count − reserve) SMs (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET) instead of queueing the tail of a
// full-device grid behind SMs that stay busy. 0 (the default) plans for the whole device. Per host thread
// (the thread that queues the backward); applies to its calls that follow, each setting with its own
// cached plans. A reserve of at least the device's SM count makes those calls throw flashlm::Error.
void set_gemm_sm_reserve(int sms);
int gemm_sm_reserve();

// Sets the reserve for the lifetime of the object and restores the previous one.
class ScopedGemmSmReserve {
 public:
  explicit ScopedGemmSmReserve(int sms) : previous_(gemm_sm_reserve()) { set_gemm_sm_reserve(sms); }
  ~ScopedGemmSmReserve() { set_gemm_sm_reserve(previous_); }
  ScopedGemmSmReserve(const ScopedGemmSmReserve&) = delete;
  ScopedGemmSmReserve& operator=(const ScopedGemmSmReserve&) = delete;

 private:
  int previous_;
};

}  // namespace flashlm
