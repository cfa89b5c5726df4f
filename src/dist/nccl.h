// The NCCL side of Communicator (nccl.cpp, compiled only with CUDA). No MPI here: the caller broadcasts
// the unique id and gathers the device identities with MPI.
#pragma once
#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flashlm/dist.h"
#include "flashlm/dtype.h"

namespace flashlm::dist {

using NcclId = std::array<char, 128>;  // ncclUniqueId (NCCL_UNIQUE_ID_BYTES)

NcclId nccl_unique_id();
int cuda_visible_devices();                // cudaGetDeviceCount, 0 when none
std::string cuda_device_uuid(int device);  // "GPU-xxxxxxxx-...", as nvidia-smi -L prints it
std::string cuda_device_name(int device);  // "NVIDIA H200 (bus 0000:19:00.0)"

class NcclComm {
 public:
  // Makes `device` current and creates the communicator's stream and events (local work only).
  NcclComm(int rank, int device);
  // Creates the NCCL communicator (ncclCommInitRankConfig), blocking until every rank has joined.
  // max_ctas > 0: the config's maxCTAs (the most thread blocks a collective uses); 0: NCCL's choice.
  void connect(const NcclId& id, int world_size, int max_ctas);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int device() const;
  void* stream() const;

  // Queued on the communicator's stream after the work queued so far on `stream`.
  void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, void* stream);
  void broadcast(void* buf, size_t count, DType dtype, int root, void* stream);
  void all_gather(const void* send, void* recv, size_t send_count, DType dtype, void* stream);
  void reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op, void* stream);
  // In place: rank r's chunk (counts[r] elements, chunks back to back in rank order) broadcast from r.
  void all_gather_v(void* buf, const std::vector<size_t>& counts, DType dtype, void* stream);
  // In place, one group: per segment {offset, part} (elements of buf), every rank's chunk
  // buf[offset + r·part, +part) gathered into buf[offset, offset + world·part).
  void all_gather_segments(void* buf, const std::vector<std::pair<size_t, size_t>>& segments, DType dtype,
                           void* stream);

  void wait(void* stream);
  // Polls the queued collectives with `timeout_s` > 0 (0: none); throws after aborting the communicator.
  void synchronize(double timeout_s);
  // For the collective watchdog, from its thread, every poll: "" while the collectives progress; otherwise
  // what is wrong (an NCCL error, or collectives queued more than timeout_s ago that have not finished).
  // Records a probe event behind the collectives queued since the last probe finished.
  std::string watchdog_poll(double timeout_s);
  bool pointer_on_device(const void* p) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashlm::dist
