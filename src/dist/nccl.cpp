// NCCL communicator for Communicator's GPU collectives (CUDA builds only): one device per process, a
// stream of its own, collectives ordered after the caller's stream with events, waits that poll NCCL's
// asynchronous error state with a timeout.
#include "dist/nccl.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "core/check.h"
#include "core/cuda_check.h"

namespace flashlm::dist {

static_assert(sizeof(ncclUniqueId) == std::tuple_size_v<NcclId>, "NcclId must hold an ncclUniqueId");
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 17, 0)
#error "flashlm needs NCCL 2.17 or newer (ncclConfig_t.maxCTAs)"
#endif

namespace {

// "<call> failed on rank R: <NCCL's error string> (<NCCL's last error message>)".
void check_nccl(ncclResult_t res, const char* call, int rank, ncclComm_t comm = nullptr) {
  if (res == ncclSuccess) return;
  const char* last = ncclGetLastError(comm);
  throw Error(fmt::format("{} failed on rank {}: {}{}", call, rank, ncclGetErrorString(res),
                          last && *last ? fmt::format(" ({})", last) : std::string()));
}

// The NCCL type of a gather's or broadcast's elements, which are moved, not computed on: FP8 as bytes
// (FSDP's FP8 weight gather, dist/fp8_gather.h).
ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f64: return ncclFloat64;
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::f8e4m3: return ncclUint8;
  }
  fail("NCCL: unsupported dtype {}", dtype_name(t));
}

// The NCCL type of a reduction's elements: bytes would be added as integers, so FP8 is refused.
ncclDataType_t nccl_reduce_type(DType t, const char* call) {
  if (t == DType::f8e4m3) fail("{}: fp8_e4m3 elements can be gathered and broadcast, not reduced", call);
  return nccl_type(t);
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  fail("NCCL: unsupported reduction");
}

// Never use NVLink SHARP / multicast (NVLS): multicast objects are a machine-wide resource that a job
// on a shared machine must not take (and that some hosts lend without), so NVLS stays off unless the
// user sets NCCL_NVLS_ENABLE explicitly. Set before the process's first NCCL call, since NCCL reads its
// environment once.
void keep_nvls_off() { setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0); }

}  // namespace

NcclId nccl_unique_id() {
  keep_nvls_off();
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId", 0);
  NcclId out;
  std::memcpy(out.data(), &id, sizeof id);
  return out;
}

int cuda_visible_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::string cuda_device_uuid(int device) {
  cudaDeviceProp prop{};
  FLASHLM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  const auto* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  std::string s = "GPU-";
  for (int i = 0; i < 16; ++i) {
    s += fmt::format("{:02x}", u[i]);
    if (i == 3 || i == 5 || i == 7 || i == 9) s += '-';
  }
  return s;
}

std::string cuda_device_name(int device) {
  cudaDeviceProp prop{};
  FLASHLM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  return fmt::format("{} (bus {:04x}:{:02x}:{:02x}.0)", prop.name, prop.pciDomainID, prop.pciBusID, prop.pciDeviceID);
}

struct NcclComm::Impl {
  int rank = 0, world_size = 1, device = -1;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t in = nullptr, out = nullptr;
  bool aborted = false;
  std::string abort_reason;
  // The watchdog's view (watchdog_poll, on its thread): collectives queued so far, the one queued last, and
  // a probe event recorded behind those queued up to `probed` (the last of them `probe_call`), pending
  // since probe_at. `mu` orders the
  // watchdog's use of `comm` against its abort.
  std::atomic<uint64_t> queued{0};
  std::atomic<const char*> last_queued{""};
  cudaEvent_t probe = nullptr;
  bool probe_pending = false;
  uint64_t probed = 0;
  const char* probe_call = "";
  std::chrono::steady_clock::time_point probe_at;
  std::mutex mu;

  void use_device() const { FLASHLM_CUDA_CHECK(cudaSetDevice(device), "cudaSetDevice"); }

  void check_usable() const {
    if (aborted) fail("NCCL communicator of rank {} was aborted earlier: {}", rank, abort_reason);
    if (!comm) fail("NCCL communicator of rank {} is not connected", rank);
  }

  // The communicator's stream waits for the work queued so far on the caller's stream; `call` is the
  // collective about to be queued behind it.
  void order_after(void* caller, const char* call) {
    check_usable();
    queued.fetch_add(1, std::memory_order_relaxed);
    last_queued.store(call, std::memory_order_relaxed);
    use_device();
    const auto s = static_cast<cudaStream_t>(caller);
    if (s == stream) return;
    FLASHLM_CUDA_CHECK(cudaEventRecord(in, s), "cudaEventRecord (before a collective)");
    FLASHLM_CUDA_CHECK(cudaStreamWaitEvent(stream, in, 0), "cudaStreamWaitEvent (before a collective)");
  }

  // A world of one and an in-place collective: the result is the input, so NCCL is not called. (NCCL's
  // one-rank path runs ncclAvg as a pre-multiplied sum by 1/1, a kernel over every element: skipping it
  // took a visible share off DDP's xl step at one rank, docs/perf.md.) Called after order_after, so that
  // work queued on the communicator's stream behind the collective (DDP's unpacking) stays ordered.
  bool alone(const void* send, const void* recv) const { return world_size == 1 && send == recv; }

  [[noreturn]] void abort_and_throw(const std::string& why) {
    {
      std::lock_guard lock(mu);
      aborted = true;
      abort_reason = why;
      ncclCommAbort(comm);  // unblocks the kernels waiting for peers and frees the communicator
      comm = nullptr;
    }
    throw Error(why);
  }
};

NcclComm::NcclComm(int rank, int device) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.rank = rank;
  m.device = device;
  m.use_device();
  FLASHLM_CUDA_CHECK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  FLASHLM_CUDA_CHECK(cudaEventCreateWithFlags(&m.in, cudaEventDisableTiming), "cudaEventCreate");
  FLASHLM_CUDA_CHECK(cudaEventCreateWithFlags(&m.out, cudaEventDisableTiming), "cudaEventCreate");
  FLASHLM_CUDA_CHECK(cudaEventCreateWithFlags(&m.probe, cudaEventDisableTiming), "cudaEventCreate");
}

void NcclComm::connect(const NcclId& id, int world_size, int max_ctas) {
  Impl& m = *impl_;
  FLASHLM_CHECK(m.comm == nullptr, "NcclComm::connect: rank {} is already connected", m.rank);
  m.use_device();
  m.world_size = world_size;
  keep_nvls_off();  // before the communicator's init (ranks other than 0 make no earlier NCCL call)
  ncclUniqueId uid;
  std::memcpy(&uid, id.data(), sizeof uid);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;  // blocking, every field NCCL's default
  if (max_ctas > 0) config.maxCTAs = max_ctas;
  check_nccl(ncclCommInitRankConfig(&m.comm, world_size, uid, m.rank, &config), "ncclCommInitRankConfig", m.rank);
}

NcclComm::~NcclComm() {
  if (!impl_) return;
  Impl& m = *impl_;
  cudaSetDevice(m.device);
  if (m.comm) {
    // During an exception (a failed rank) the peers may never join a clean shutdown: abort, which is
    // local; otherwise destroy (which flushes this rank's queued collectives first).
    if (std::uncaught_exceptions() > 0) ncclCommAbort(m.comm);
    else ncclCommDestroy(m.comm);
  }
  if (m.in) cudaEventDestroy(m.in);
  if (m.out) cudaEventDestroy(m.out);
  if (m.probe) cudaEventDestroy(m.probe);
  if (m.stream) cudaStreamDestroy(m.stream);
}

int NcclComm::device() const { return impl_->device; }
void* NcclComm::stream() const { return impl_->stream; }

void NcclComm::all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, void* stream) {
  Impl& m = *impl_;
  const ncclDataType_t type = nccl_reduce_type(dtype, "ncclAllReduce");
  m.order_after(stream, "ncclAllReduce");
  if (m.alone(send, recv)) return;
  check_nccl(ncclAllReduce(send, recv, count, type, nccl_op(op), m.comm, m.stream), "ncclAllReduce", m.rank, m.comm);
}

void NcclComm::broadcast(void* buf, size_t count, DType dtype, int root, void* stream) {
  Impl& m = *impl_;
  m.order_after(stream, "ncclBroadcast");
  if (m.alone(buf, buf)) return;
  check_nccl(ncclBroadcast(buf, buf, count, nccl_type(dtype), root, m.comm, m.stream), "ncclBroadcast", m.rank,
             m.comm);
}

void NcclComm::all_gather(const void* send, void* recv, size_t send_count, DType dtype, void* stream) {
  Impl& m = *impl_;
  m.order_after(stream, "ncclAllGather");
  if (m.alone(send, recv)) return;
  check_nccl(ncclAllGather(send, recv, send_count, nccl_type(dtype), m.comm, m.stream), "ncclAllGather", m.rank,
             m.comm);
}

void NcclComm::reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op,
                              void* stream) {
  Impl& m = *impl_;
  const ncclDataType_t type = nccl_reduce_type(dtype, "ncclReduceScatter");
  m.order_after(stream, "ncclReduceScatter");
  if (m.alone(send, recv)) return;
  check_nccl(ncclReduceScatter(send, recv, recv_count, type, nccl_op(op), m.comm, m.stream), "ncclReduceScatter",
             m.rank, m.comm);
}

void NcclComm::all_gather_v(void* buf, const std::vector<size_t>& counts, DType dtype, void* stream) {
  Impl& m = *impl_;
  m.order_after(stream, "ncclBroadcast (all_gather_v)");
  if (m.alone(buf, buf)) return;
  char* at = static_cast<char*>(buf);
  check_nccl(ncclGroupStart(), "ncclGroupStart", m.rank, m.comm);
  for (size_t r = 0; r < counts.size(); ++r) {
    if (counts[r] > 0) {
      const ncclResult_t res = ncclBroadcast(at, at, counts[r], nccl_type(dtype), static_cast<int>(r), m.comm, m.stream);
      if (res != ncclSuccess) {
        ncclGroupEnd();
        check_nccl(res, "ncclBroadcast", m.rank, m.comm);
      }
    }
    at += counts[r] * dtype_size(dtype);
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd", m.rank, m.comm);
}

void NcclComm::all_gather_segments(void* buf, const std::vector<std::pair<size_t, size_t>>& segments, DType dtype,
                                   void* stream) {
  Impl& m = *impl_;
  m.order_after(stream, "ncclAllGather (all_gather_segments)");
  if (m.alone(buf, buf)) return;  // rank 0's chunk of every segment is the segment
  const size_t size = dtype_size(dtype);
  char* base = static_cast<char*>(buf);
  check_nccl(ncclGroupStart(), "ncclGroupStart", m.rank, m.comm);
  for (const auto& [offset, part] : segments) {
    if (part == 0) continue;
    // In place, NCCL's convention: the send buffer is this rank's chunk of the receive buffer.
    char* recv = base + offset * size;
    const char* send = recv + size_t(m.rank) * part * size;
    const ncclResult_t res = ncclAllGather(send, recv, part, nccl_type(dtype), m.comm, m.stream);
    if (res != ncclSuccess) {
      ncclGroupEnd();
      check_nccl(res, "ncclAllGather", m.rank, m.comm);
    }
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd", m.rank, m.comm);
}

void NcclComm::wait(void* stream) {
  Impl& m = *impl_;
  m.check_usable();
  m.use_device();
  const auto s = static_cast<cudaStream_t>(stream);
  if (s == m.stream) return;
  FLASHLM_CUDA_CHECK(cudaEventRecord(m.out, m.stream), "cudaEventRecord (after collectives)");
  FLASHLM_CUDA_CHECK(cudaStreamWaitEvent(s, m.out, 0), "cudaStreamWaitEvent (after collectives)");
}

void NcclComm::synchronize(double timeout_s) {
  Impl& m = *impl_;
  m.check_usable();
  m.use_device();
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t q = cudaStreamQuery(m.stream);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) FLASHLM_CUDA_CHECK(q, "NCCL collective (cudaStreamQuery)");
    ncclResult_t async = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(m.comm, &async), "ncclCommGetAsyncError", m.rank, m.comm);
    if (async != ncclSuccess && async != ncclInProgress) {
      const char* last = ncclGetLastError(m.comm);
      m.abort_and_throw(fmt::format("NCCL collective failed on rank {}: {}{}; the communicator was aborted", m.rank,
                                    ncclGetErrorString(async), last && *last ? fmt::format(" ({})", last) : ""));
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (timeout_s > 0 && waited > timeout_s) {
      m.abort_and_throw(fmt::format(
          "NCCL collectives on rank {} did not finish within {:.0f} s (a peer died, hangs, or called different "
          "collectives); the communicator was aborted",
          m.rank, timeout_s));
    }
    // Spin briefly (short collectives are timed through this loop), then poll gently.
    if (waited < 0.01) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

std::string NcclComm::watchdog_poll(double timeout_s) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  if (m.aborted || !m.comm) return {};  // synchronize() gave up on it already, and threw
  ncclResult_t async = ncclSuccess;
  if (ncclCommGetAsyncError(m.comm, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
    const char* last = ncclGetLastError(m.comm);
    return fmt::format("NCCL collective failed: {}{}", ncclGetErrorString(async),
                       last && *last ? fmt::format(" ({})", last) : "");
  }
  if (cudaSetDevice(m.device) != cudaSuccess) return fmt::format("cudaSetDevice({}) failed", m.device);
  const auto now = std::chrono::steady_clock::now();
  if (m.probe_pending) {
    const cudaError_t q = cudaEventQuery(m.probe);
    if (q == cudaSuccess) {
      m.probe_pending = false;
    } else if (q != cudaErrorNotReady) {
      return fmt::format("NCCL collectives on cuda:{}: {}", m.device, cudaGetErrorString(q));
    } else if (std::chrono::duration<double>(now - m.probe_at).count() > timeout_s) {
      return fmt::format("the NCCL collectives on cuda:{} up to collective {} of this rank ({}) did not finish within "
                         "{} s",
                         m.device, m.probed, m.probe_call, timeout_s);
    }
  }
  const uint64_t queued = m.queued.load(std::memory_order_relaxed);
  if (!m.probe_pending && queued != m.probed) {
    // Behind everything queued so far on the stream (the CUDA runtime orders this against the other
    // thread's launches on it). The time counts from now: queued collectives may legitimately wait for the
    // computation they follow (order_after), which the timeout's generous default covers.
    if (cudaEventRecord(m.probe, m.stream) != cudaSuccess) return "cudaEventRecord (the watchdog's probe) failed";
    m.probed = queued;
    m.probe_call = m.last_queued.load(std::memory_order_relaxed);
    m.probe_at = now;
    m.probe_pending = true;
  }
  return {};
}

bool NcclComm::pointer_on_device(const void* p) const {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) && attr.device == impl_->device;
}

}  // namespace flashlm::dist
