// Helpers shared by the data-parallel tests (test_ddp, test_fsdp): distances between parameter vectors,
// and on CUDA whether every rank has a GPU and a CudaModel's parameters and bf16 working copy on the host.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "dist/mpi_testing.h"
#include "flashlm/dist.h"
#include "flashlm/model.h"
#ifdef FLASHLM_WITH_CUDA
#include "core/cuda_runtime.h"
#include "flashlm/device.h"
#endif

inline double max_abs_diff(std::span<const float> a, std::span<const float> b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(double(a[i]) - double(b[i])));
  return d;
}

// ‖got − want‖ / ‖want‖.
inline double relative_l2(std::span<const float> got, std::span<const float> want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

#ifdef FLASHLM_WITH_CUDA
// Collective: NCCL was built and every rank of every node has a GPU of its own.
inline bool gpus_for_every_rank() {
  flashlm::Communicator& comm = test_world();
  double missing = flashlm::Communicator::nccl_built() && flashlm::cuda_device_count() >= comm.local_size() ? 0.0 : 1.0;
  comm.all_reduce(std::span<double>(&missing, 1), flashlm::ReduceOp::max);
  return missing == 0;
}

inline std::vector<float> host_parameters(flashlm::CudaModel& m) {
  std::vector<float> out(size_t(m.parameter_count()));
  m.copy_parameters_to(out.data());
  return out;
}

// A bf16 model's working copy, its bits.
inline std::vector<uint16_t> working_bits(const flashlm::CudaModel& m) {
  std::vector<uint16_t> bits(size_t(m.parameter_count()));
  flashlm::cuda_copy(bits.data(), m.working_parameters(), bits.size() * sizeof(uint16_t));
  return bits;
}
#endif
