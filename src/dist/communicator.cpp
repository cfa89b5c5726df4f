// Communicator: MPI for the world, the CPU collectives and the bootstrap of NCCL (dist/nccl.cpp), which
// carries the GPU collectives. See include/flashlm/dist.h for the failure model.
#include "flashlm/dist.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <vector>

#include "core/check.h"
#include "dist/run_settings.h"
#include "dist/watchdog.h"
#include "flashlm/device.h"
#ifdef FLASHLM_WITH_NCCL
#include "dist/nccl.h"
#endif

namespace flashlm {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

namespace {

// The process's MPI, started once. At exit (this object's destructor) MPI is finalized only for a world
// of one: with peers, a process that reaches exit without Communicator::finalize() may be a failed rank,
// and MPI_Finalize would block it until every peer finalizes too, while they wait for it in a collective.
// Exiting without finalizing makes mpirun kill the job instead.
struct MpiProcess {
  bool started_by_us = false;
  bool finalized_by_us = false;
  int world_size = 1;
  ~MpiProcess() {
    if (!started_by_us || finalized_by_us || world_size != 1) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
};

MpiProcess& mpi_process() {
  static MpiProcess process;
  return process;
}

std::mutex& mpi_mutex() {
  static std::mutex mu;
  return mu;
}

void start_mpi() {
  std::lock_guard lock(mpi_mutex());
  MpiProcess& p = mpi_process();
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) fail("Communicator: MPI was already finalized in this process (Communicator::finalize())");
  if (initialized) return;  // the host program (or an earlier Communicator) started it
  int provided = 0;
  // SERIALIZED: MPI may be called from any thread, one at a time (the OpenMP workers never call it).
  const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  if (rc != MPI_SUCCESS) fail("MPI_Init_thread failed (MPI error {})", rc);
  p.started_by_us = true;
  MPI_Comm_size(MPI_COMM_WORLD, &p.world_size);
}

std::string mpi_error_string(int rc) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(msg, static_cast<size_t>(len));
}

// The communicator returns MPI errors (MPI_ERRORS_RETURN) instead of aborting: they become flashlm::Error.
void check_mpi(int rc, const char* call, int rank) {
  if (rc != MPI_SUCCESS) throw Error(fmt::format("{} failed on rank {}: {}", call, rank, mpi_error_string(rc)));
}

// An environment variable as a non-negative int, or -1.
int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (*end == '\0' && x >= 0 && x <= INT_MAX) ? static_cast<int>(x) : -1;
}

// The MPI type of a reduction's elements.
MPI_Datatype mpi_type(DType t, const char* fn, const char* arg) {
  if (t == DType::f32) return MPI_FLOAT;
  if (t == DType::f64) return MPI_DOUBLE;
  if (t == DType::f8e4m3) {
    fail("Communicator::{}: {}: fp8_e4m3 elements can be gathered and broadcast, not reduced", fn, arg);
  }
  fail("Communicator::{}: {}: dtype {} is not supported for CPU views (MPI carries fp32 and fp64; fp16 and bf16 "
       "need CUDA views)",
       fn, arg, dtype_name(t));
}

// The MPI type of a gather's or broadcast's elements, which are moved, not computed on: FP8 bytes too (FSDP's
// FP8 weight gather, dist/fp8_gather.h).
MPI_Datatype mpi_move_type(DType t, const char* fn, const char* arg) {
  return t == DType::f8e4m3 ? MPI_BYTE : mpi_type(t, fn, arg);
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return MPI_SUM;  // avg: the sum, then divided by the world size
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
  }
  return MPI_SUM;
}

void check_view(const TensorView& x, const char* fn, const char* arg) {
  FLASHLM_CHECK(x.data != nullptr || x.numel() == 0, "Communicator::{}: {}: null data pointer for {}", fn, arg,
                x.shape_string());
  FLASHLM_CHECK(x.is_contiguous(), "Communicator::{}: {}: the view must be contiguous, got {} with strides [{}]", fn,
                arg, x.shape_string(), fmt::join(x.strides.begin(), x.strides.begin() + x.ndim, ", "));
}

void check_pair(const TensorView& in, const TensorView& out, const char* fn) {
  check_view(in, fn, "in");
  check_view(out, fn, "out");
  FLASHLM_CHECK(in.dtype == out.dtype, "Communicator::{}: in is {} but out is {}", fn, dtype_name(in.dtype),
                dtype_name(out.dtype));
  FLASHLM_CHECK(in.device == out.device, "Communicator::{}: in is on {} but out is on {}", fn, device_name(in.device),
                device_name(out.device));
}

size_t nbytes(const TensorView& x) { return static_cast<size_t>(x.numel()) * dtype_size(x.dtype); }

bool overlap(const TensorView& a, const TensorView& b) {
  const auto* pa = static_cast<const char*>(a.data);
  const auto* pb = static_cast<const char*>(b.data);
  return nbytes(a) && nbytes(b) && pa < pb + nbytes(b) && pb < pa + nbytes(a);
}

template <class T>
void divide(void* data, int64_t n, int by) {
  if (by == 1) return;  // a world of one: the average is the sum
  T* x = static_cast<T*>(data);
  for (int64_t i = 0; i < n; ++i) x[i] /= static_cast<T>(by);
}

void divide(const TensorView& x, int by) {
  if (x.dtype == DType::f32) divide<float>(x.data, x.numel(), by);
  else divide<double>(x.data, x.numel(), by);
}

constexpr int64_t kMpiChunk = int64_t{1} << 30;  // elements per MPI call (counts are int)

// fn(address, count) for each run of at most kMpiChunk elements of x, in order.
template <class Fn>
void for_each_mpi_chunk(const TensorView& x, Fn&& fn) {
  const size_t esize = dtype_size(x.dtype);
  for (int64_t begin = 0; begin < x.numel(); begin += kMpiChunk) {
    fn(static_cast<char*>(x.data) + begin * esize, static_cast<int>(std::min(kMpiChunk, x.numel() - begin)));
  }
}

}  // namespace

// A CPU all-reduce in flight: its MPI requests (one per kMpiChunk elements), and what avg divides after.
struct CommRequest::State {
  std::vector<MPI_Request> requests;
  TensorView x;  // avg: divided after; a reduce-scatter: where the result goes
  ReduceOp op = ReduceOp::sum;
  int world_size = 1;
  int rank = 0;
  // A reduce-scatter in MPI's in-place form leaves this rank's result at the start of its input, not at x.
  void* result_at = nullptr;
};

CommRequest::CommRequest() = default;
// A request dropped while pending (an exception on its way) is left to MPI: the standard forbids freeing or
// cancelling a non-blocking collective, and waiting here could hang on a failed peer.
CommRequest::~CommRequest() = default;
CommRequest::CommRequest(CommRequest&&) noexcept = default;
CommRequest& CommRequest::operator=(CommRequest&&) noexcept = default;
bool CommRequest::pending() const { return state_ != nullptr; }

struct Communicator::Impl {
  MPI_Comm comm = MPI_COMM_NULL;   // a duplicate of MPI_COMM_WORLD with MPI_ERRORS_RETURN
  MPI_Comm local = MPI_COMM_NULL;  // the ranks of this node (shared memory)
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  int local_index = 0;  // rank within `local` (the order of its collectives)
  double timeout_s = dist::default_timeout_s();
  int nccl_max_ctas = 0;  // 0: NCCL's choice
#ifdef FLASHLM_WITH_NCCL
  std::unique_ptr<dist::NcclComm> nccl;
#endif
  std::unique_ptr<dist::Watchdog> watchdog;  // jobs of several ranks

  ~Impl() {
    watchdog.reset();  // before the NCCL communicator it polls
#ifdef FLASHLM_WITH_NCCL
    nccl.reset();
#endif
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (local != MPI_COMM_NULL) MPI_Comm_free(&local);
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }

  void check(int rc, const char* call) const { check_mpi(rc, call, rank); }

  // A CPU collective about to start on this communicator, its MPI requests still to add: the result lands in
  // `result` (which avg divides by the world size once it has).
  std::unique_ptr<CommRequest::State> new_request(const TensorView& result = {}, ReduceOp op = ReduceOp::sum) const {
    auto state = std::make_unique<CommRequest::State>();
    state->x = result;
    state->op = op;
    state->world_size = size;
    state->rank = rank;
    return state;
  }

  // An MPI call that blocks until the peers take part (a collective, a wait), watched by the watchdog.
  template <class Call>
  void blocking(const char* call, Call&& fn) {
    int rc = MPI_SUCCESS;
    {
      const dist::Watched watched(watchdog.get(), call);
      rc = fn();
    }
    check(rc, call);
  }

  // Collective: root's `text` on every rank.
  std::string broadcast_text(std::string text, int root) {
    FLASHLM_CHECK(text.size() <= size_t(INT_MAX), "Communicator: {} bytes of text to broadcast, MPI takes at most {}",
                  text.size(), INT_MAX);
    int len = static_cast<int>(text.size());
    blocking("MPI_Bcast", [&] { return MPI_Bcast(&len, 1, MPI_INT, root, comm); });
    text.resize(static_cast<size_t>(len));
    blocking("MPI_Bcast", [&] { return MPI_Bcast(text.data(), len, MPI_CHAR, root, comm); });
    return text;
  }

  [[noreturn]] void no_cuda(const char* fn) const {
    fail("Communicator::{}: a CUDA view, but flashlm was built without NCCL{}", fn,
         cuda_built() ? " (CMake did not find nccl.h and libnccl next to the CUDA toolkit)" : " (and without CUDA)");
  }

  // The CUDA branch of collective `fn`: NCCL set up on first use (collective), the views' memory (`data`, named
  // `what`) checked to be this rank's device, then run(dist::NcclComm&). Without NCCL, an Error naming fn. `run`
  // takes `auto&`, so its body is compiled only where NCCL is.
  template <class Run>
  void on_nccl(Communicator& c, const char* fn, const char* what, int64_t numel,
               std::initializer_list<const void*> data, Run&& run) {
#ifdef FLASHLM_WITH_NCCL
    c.setup_cuda();
    FLASHLM_CHECK(numel == 0 || std::all_of(data.begin(), data.end(), [&](const void* d) { return nccl->pointer_on_device(d); }),
                  "Communicator::{}: {} must be memory of this rank's device cuda:{}", fn, what, nccl->device());
    run(*nccl);
#else
    (void)c, (void)what, (void)numel, (void)data, (void)run;
    no_cuda(fn);
#endif
  }
};

Communicator::Communicator() : impl_(std::make_unique<Impl>()) {
  start_mpi();
  Impl& m = *impl_;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &m.comm), "MPI_Comm_dup", -1);
  m.check(MPI_Comm_set_errhandler(m.comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  m.check(MPI_Comm_rank(m.comm, &m.rank), "MPI_Comm_rank");
  m.check(MPI_Comm_size(m.comm, &m.size), "MPI_Comm_size");
  if (m.size > 1) m.watchdog = std::make_unique<dist::Watchdog>(m.rank, m.timeout_s);
  m.blocking("MPI_Comm_split_type",
             [&] { return MPI_Comm_split_type(m.comm, MPI_COMM_TYPE_SHARED, m.rank, MPI_INFO_NULL, &m.local); });
  m.check(MPI_Comm_rank(m.local, &m.local_index), "MPI_Comm_rank");
  m.check(MPI_Comm_size(m.local, &m.local_size), "MPI_Comm_size");
  // What the launcher says first (mpirun, then srun), the shared-memory split otherwise or when the
  // launcher's number does not fit this node's ranks (a stale variable of an enclosing job).
  m.local_rank = m.local_index;
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}) {
    const int v = env_int(var);
    if (v >= 0) {
      if (v < m.local_size) m.local_rank = v;
      break;
    }
  }
  // srun without PMI support in MPI starts N singletons, each a world of one that would train alone.
  const int srun_tasks = env_int("SLURM_STEP_NUM_TASKS");
  FLASHLM_CHECK(!(m.size == 1 && srun_tasks > 1 && std::getenv("SLURM_PROCID") && !std::getenv("OMPI_COMM_WORLD_SIZE")),
                "Communicator: srun started {} tasks but MPI sees a world of one: launch with `srun --mpi=pmix` "
                "(or pmi2, whichever this OpenMPI supports) or with mpirun",
                srun_tasks);
}

Communicator::~Communicator() = default;
Communicator::Communicator(Communicator&&) noexcept = default;
Communicator& Communicator::operator=(Communicator&&) noexcept = default;

int Communicator::rank() const { return impl_->rank; }
int Communicator::world_size() const { return impl_->size; }
int Communicator::local_rank() const { return impl_->local_rank; }
int Communicator::local_size() const { return impl_->local_size; }

void Communicator::all_reduce(const TensorView& x, ReduceOp op, void* stream) {
  Impl& m = *impl_;
  check_view(x, "all_reduce", "x");
  if (x.device == Device::cuda) {
    return m.on_nccl(*this, "all_reduce", "x", x.numel(), {x.data}, [&](auto& nccl) {
      nccl.all_reduce(x.data, x.data, static_cast<size_t>(x.numel()), x.dtype, op, stream);
    });
  }
  const MPI_Datatype type = mpi_type(x.dtype, "all_reduce", "x");
  for_each_mpi_chunk(x, [&](void* at, int count) {
    m.blocking("MPI_Allreduce", [&] { return MPI_Allreduce(MPI_IN_PLACE, at, count, type, mpi_op(op), m.comm); });
  });
  if (op == ReduceOp::avg) divide(x, m.size);
}

CommRequest Communicator::all_reduce_async(const TensorView& x, ReduceOp op, void* stream) {
  Impl& m = *impl_;
  check_view(x, "all_reduce_async", "x");
  CommRequest request;
  if (x.device == Device::cuda) {
    all_reduce(x, op, stream);
    return request;
  }
  const MPI_Datatype type = mpi_type(x.dtype, "all_reduce_async", "x");
  auto state = m.new_request(x, op);
  for_each_mpi_chunk(x, [&](void* at, int count) {
    MPI_Request r = MPI_REQUEST_NULL;
    m.check(MPI_Iallreduce(MPI_IN_PLACE, at, count, type, mpi_op(op), m.comm, &r), "MPI_Iallreduce");
    state->requests.push_back(r);
  });
  request.state_ = std::move(state);
  return request;
}

void Communicator::wait(CommRequest& request) {
  if (!request.state_) return;
  CommRequest::State& st = *request.state_;
  impl_->blocking("MPI_Waitall",
                  [&] { return MPI_Waitall(static_cast<int>(st.requests.size()), st.requests.data(), MPI_STATUSES_IGNORE); });
  if (st.result_at && st.result_at != st.x.data) std::memmove(st.x.data, st.result_at, nbytes(st.x));
  if (st.op == ReduceOp::avg) divide(st.x, st.world_size);
  request.state_.reset();
}

bool Communicator::test(CommRequest& request) {
  if (!request.state_) return true;
  CommRequest::State& st = *request.state_;
  int done = 0;
  check_mpi(MPI_Testall(static_cast<int>(st.requests.size()), st.requests.data(), &done, MPI_STATUSES_IGNORE),
            "MPI_Testall", st.rank);
  return done != 0;
}

void Communicator::broadcast(const TensorView& x, int root, void* stream) {
  Impl& m = *impl_;
  check_view(x, "broadcast", "x");
  FLASHLM_CHECK(root >= 0 && root < m.size, "Communicator::broadcast: root {} is not a rank of a world of {}", root,
                m.size);
  if (x.device == Device::cuda) {
    return m.on_nccl(*this, "broadcast", "x", x.numel(), {x.data}, [&](auto& nccl) {
      nccl.broadcast(x.data, static_cast<size_t>(x.numel()), x.dtype, root, stream);
    });
  }
  const MPI_Datatype type = mpi_move_type(x.dtype, "broadcast", "x");
  for_each_mpi_chunk(x, [&](void* at, int count) {
    m.blocking("MPI_Bcast", [&] { return MPI_Bcast(at, count, type, root, m.comm); });
  });
}

void Communicator::all_gather(const TensorView& in, const TensorView& out, void* stream) {
  Impl& m = *impl_;
  check_pair(in, out, "all_gather");
  FLASHLM_CHECK(out.numel() == in.numel() * m.size,
                "Communicator::all_gather: out has {} elements, expected world size {} x in's {} = {}", out.numel(),
                m.size, in.numel(), in.numel() * m.size);
  // In place: `in` is this rank's chunk of `out` (NCCL's convention); any other overlap is an error.
  const bool in_place = in.data == static_cast<char*>(out.data) + static_cast<size_t>(m.rank) * nbytes(in);
  FLASHLM_CHECK(in_place || !overlap(in, out),
                "Communicator::all_gather: in overlaps out without being rank {}'s chunk of it", m.rank);
  if (in.device == Device::cuda) {
    return m.on_nccl(*this, "all_gather", "in and out", out.numel(), {in.data, out.data}, [&](auto& nccl) {
      nccl.all_gather(in.data, out.data, static_cast<size_t>(in.numel()), in.dtype, stream);
    });
  }
  const MPI_Datatype type = mpi_move_type(in.dtype, "all_gather", "in");
  FLASHLM_CHECK(in.numel() <= INT_MAX, "Communicator::all_gather: {} elements per rank, MPI takes at most {}",
                in.numel(), INT_MAX);
  const int count = static_cast<int>(in.numel());
  m.blocking("MPI_Allgather", [&] { return MPI_Allgather(in_place ? MPI_IN_PLACE : in.data, count, type, out.data, count, type, m.comm); });
}

// Checks a reduce-scatter's views (`call` names it) and says whether it is in place: `out` is this rank's
// chunk of `in` (NCCL's convention); any other overlap is an error.
bool Communicator::check_reduce_scatter(const TensorView& in, const TensorView& out, const char* call) const {
  const Impl& m = *impl_;
  check_pair(in, out, call);
  FLASHLM_CHECK(in.numel() == out.numel() * m.size,
                "Communicator::{}: in has {} elements, expected world size {} x out's {} = {}", call, in.numel(), m.size,
                out.numel(), out.numel() * m.size);
  const bool in_place = out.data == static_cast<char*>(in.data) + static_cast<size_t>(m.rank) * nbytes(out);
  FLASHLM_CHECK(in_place || !overlap(in, out), "Communicator::{}: out overlaps in without being rank {}'s chunk of it",
                call, m.rank);
  FLASHLM_CHECK(in.device == Device::cuda || out.numel() <= INT_MAX,
                "Communicator::{}: {} elements per rank, MPI takes at most {}", call, out.numel(), INT_MAX);
  return in_place;
}

void Communicator::reduce_scatter(const TensorView& in, const TensorView& out, ReduceOp op, void* stream) {
  Impl& m = *impl_;
  const bool in_place = check_reduce_scatter(in, out, "reduce_scatter");
  if (in.device == Device::cuda) {
    return m.on_nccl(*this, "reduce_scatter", "in and out", in.numel(), {in.data, out.data}, [&](auto& nccl) {
      nccl.reduce_scatter(in.data, out.data, static_cast<size_t>(out.numel()), in.dtype, op, stream);
    });
  }
  const MPI_Datatype type = mpi_type(in.dtype, "reduce_scatter", "in");
  const int count = static_cast<int>(out.numel());
  if (in_place) {
    // MPI's in-place form reads the whole input from the receive buffer and leaves the result at its start.
    m.blocking("MPI_Reduce_scatter_block", [&] { return MPI_Reduce_scatter_block(MPI_IN_PLACE, in.data, count, type, mpi_op(op), m.comm); });
    if (out.data != in.data) std::memmove(out.data, in.data, nbytes(out));
  } else {
    m.blocking("MPI_Reduce_scatter_block", [&] { return MPI_Reduce_scatter_block(in.data, out.data, count, type, mpi_op(op), m.comm); });
  }
  if (op == ReduceOp::avg) divide(out, m.size);
}

CommRequest Communicator::reduce_scatter_async(const TensorView& in, const TensorView& out, ReduceOp op,
                                               void* stream) {
  Impl& m = *impl_;
  CommRequest request;
  if (in.device == Device::cuda) {
    reduce_scatter(in, out, op, stream);
    return request;
  }
  const bool in_place = check_reduce_scatter(in, out, "reduce_scatter_async");
  const MPI_Datatype type = mpi_type(in.dtype, "reduce_scatter_async", "in");
  auto state = m.new_request(out, op);
  MPI_Request r = MPI_REQUEST_NULL;
  const int count = static_cast<int>(out.numel());
  if (in_place) {
    state->result_at = in.data;
    m.check(MPI_Ireduce_scatter_block(MPI_IN_PLACE, in.data, count, type, mpi_op(op), m.comm, &r),
            "MPI_Ireduce_scatter_block");
  } else {
    m.check(MPI_Ireduce_scatter_block(in.data, out.data, count, type, mpi_op(op), m.comm, &r),
            "MPI_Ireduce_scatter_block");
  }
  state->requests.push_back(r);
  request.state_ = std::move(state);
  return request;
}

void Communicator::all_gather_v(const TensorView& x, std::span<const int64_t> counts, void* stream) {
  Impl& m = *impl_;
  check_view(x, "all_gather_v", "x");
  FLASHLM_CHECK(static_cast<int>(counts.size()) == m.size,
                "Communicator::all_gather_v: {} counts for a world of {} ranks", counts.size(), m.size);
  int64_t total = 0;
  for (int64_t c : counts) {
    FLASHLM_CHECK(c >= 0, "Communicator::all_gather_v: negative count {}", c);
    total += c;
  }
  FLASHLM_CHECK(total == x.numel(), "Communicator::all_gather_v: the counts add up to {} elements, x has {}", total,
                x.numel());
  if (x.device == Device::cuda) {
    return m.on_nccl(*this, "all_gather_v", "x", x.numel(), {x.data}, [&](auto& nccl) {
      std::vector<size_t> sizes(counts.begin(), counts.end());
      nccl.all_gather_v(x.data, sizes, x.dtype, stream);
    });
  }
  const MPI_Datatype type = mpi_move_type(x.dtype, "all_gather_v", "x");
  FLASHLM_CHECK(total <= INT_MAX, "Communicator::all_gather_v: {} elements, MPI_Allgatherv addresses at most {}", total,
                INT_MAX);
  std::vector<int> sizes(counts.size()), displs(counts.size());
  for (size_t r = 0, at = 0; r < counts.size(); at += static_cast<size_t>(counts[r]), ++r) {
    sizes[r] = static_cast<int>(counts[r]);
    displs[r] = static_cast<int>(at);
  }
  m.blocking("MPI_Allgatherv", [&] { return MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, x.data, sizes.data(), displs.data(), type, m.comm); });
}

void Communicator::check_segments(const TensorView& x, std::span<const Segment> segments, const char* call) const {
  const Impl& m = *impl_;
  check_view(x, call, "x");
  std::vector<Segment> sorted(segments.begin(), segments.end());
  std::sort(sorted.begin(), sorted.end(), [](const Segment& a, const Segment& b) { return a.offset < b.offset; });
  int64_t end = 0;  // of the previous segment
  for (const Segment& s : sorted) {
    FLASHLM_CHECK(s.offset >= end && s.part >= 0 && s.offset + s.part * m.size <= x.numel(),
                  "Communicator::{}: segment at {} of {} elements per rank overlaps another or ends past x's {} "
                  "elements",
                  call, s.offset, s.part, x.numel());
    FLASHLM_CHECK(x.device == Device::cuda || s.part <= INT_MAX,
                  "Communicator::{}: {} elements per rank, MPI takes at most {}", call, s.part, INT_MAX);
    end = s.offset + s.part * m.size;
  }
}

CommRequest Communicator::all_gather_segments_async(const TensorView& x, std::span<const Segment> segments,
                                                    void* stream) {
  Impl& m = *impl_;
  CommRequest request;
  if (x.device == Device::cuda) {
    all_gather_segments(x, segments, stream);
    return request;
  }
  check_segments(x, segments, "all_gather_segments_async");
  const MPI_Datatype type = mpi_move_type(x.dtype, "all_gather_segments_async", "x");
  auto state = m.new_request();
  for (const Segment& s : segments) {
    if (s.part == 0) continue;
    void* at = static_cast<char*>(x.data) + size_t(s.offset) * dtype_size(x.dtype);
    MPI_Request r = MPI_REQUEST_NULL;
    m.check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, at, static_cast<int>(s.part), type, m.comm, &r),
            "MPI_Iallgather");
    state->requests.push_back(r);
  }
  request.state_ = std::move(state);
  return request;
}

void Communicator::all_gather_segments(const TensorView& x, std::span<const Segment> segments, void* stream) {
  Impl& m = *impl_;
  check_segments(x, segments, "all_gather_segments");
  if (x.device == Device::cuda) {
    return m.on_nccl(*this, "all_gather_segments", "x", x.numel(), {x.data}, [&](auto& nccl) {
      std::vector<std::pair<size_t, size_t>> pairs;
      for (const Segment& s : segments) pairs.emplace_back(size_t(s.offset), size_t(s.part));
      nccl.all_gather_segments(x.data, pairs, x.dtype, stream);
    });
  }
  const MPI_Datatype type = mpi_move_type(x.dtype, "all_gather_segments", "x");
  for (const Segment& s : segments) {
    if (s.part == 0) continue;
    void* at = static_cast<char*>(x.data) + size_t(s.offset) * dtype_size(x.dtype);
    m.blocking("MPI_Allgather", [&] { return MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, at, static_cast<int>(s.part), type, m.comm); });
  }
}

void Communicator::barrier() {
  impl_->blocking("MPI_Barrier", [&] { return MPI_Barrier(impl_->comm); });
}

int64_t Communicator::agree(int64_t value, std::string_view what) {
  Impl& m = *impl_;
  std::vector<int64_t> all(static_cast<size_t>(m.size));
  m.blocking("MPI_Allgather", [&] { return MPI_Allgather(&value, 1, MPI_INT64_T, all.data(), 1, MPI_INT64_T, m.comm); });
  for (int r = 1; r < m.size; ++r) {
    if (all[r] != all[0]) fail("ranks disagree on {}: rank 0 has {}, rank {} has {}", what, all[0], r, all[r]);
  }
  return value;
}

void Communicator::agree_settings(std::span<const RunSetting> settings) {
  Impl& m = *impl_;
  const std::string text = dist::serialise_settings(settings);
  const uint64_t mine = dist::fnv1a_64(text);
  std::vector<uint64_t> all(static_cast<size_t>(m.size));
  m.blocking("MPI_Allgather",
             [&] { return MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, m.comm); });
  const auto differs = std::find_if(all.begin() + 1, all.end(), [&](uint64_t h) { return h != all[0]; });
  if (differs == all.end()) return;
  const int rank = static_cast<int>(differs - all.begin());
  // Rank 0's settings to every rank; the first rank that differs says how, to every rank.
  const std::string root = m.broadcast_text(m.rank == 0 ? text : std::string(), 0);
  std::string difference;
  if (m.rank == rank) {
    difference = dist::settings_difference(dist::parse_settings(root), settings, rank);
    if (difference.empty()) difference = "the serialised settings";  // a NUL inside a name or value
  }
  difference = m.broadcast_text(std::move(difference), rank);
  throw SettingsMismatch(fmt::format("rank {}'s run configuration differs from rank 0's in {}", rank, difference));
}

std::string Communicator::first_error(std::string_view local_error) {
  Impl& m = *impl_;
  const int mine = local_error.empty() ? INT_MAX : m.rank;
  int first = INT_MAX;
  m.blocking("MPI_Allreduce", [&] { return MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, m.comm); });
  if (first == INT_MAX) return {};
  const std::string msg = m.broadcast_text(first == m.rank ? std::string(local_error.substr(0, 16384)) : "", first);
  return fmt::format("rank {}: {}", first, msg);
}

int Communicator::setup_cuda() {
#ifdef FLASHLM_WITH_NCCL
  Impl& m = *impl_;
  if (m.nccl) return m.nccl->device();
  agree(m.nccl_max_ctas, "the NCCL max CTAs");
  // Every rank picks its device and learns whether any rank cannot, before anyone enters NCCL's init
  // (which would wait forever for a rank that gave up).
  std::string error, uuid;
  const int visible = dist::cuda_visible_devices();
  const int device = visible > 0 ? m.local_rank % visible : -1;
  if (visible == 0) {
    error = "setup_cuda: no CUDA device is visible";
  } else {
    try {
      uuid = dist::cuda_device_uuid(device);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  // Two ranks of one node on the same GPU (more local ranks than GPUs, or CUDA_VISIBLE_DEVICES giving
  // them the same one): compare the devices' UUIDs across the node.
  constexpr int kUuid = 64;
  std::vector<char> mine(kUuid, '\0'), all(static_cast<size_t>(kUuid) * m.local_size, '\0');
  std::memcpy(mine.data(), uuid.data(), std::min<size_t>(uuid.size(), kUuid - 1));
  m.blocking("MPI_Allgather", [&] { return MPI_Allgather(mine.data(), kUuid, MPI_CHAR, all.data(), kUuid, MPI_CHAR, m.local); });
  for (int r = 0; r < m.local_size && error.empty() && !uuid.empty(); ++r) {
    if (r != m.local_index && uuid == std::string(all.data() + static_cast<size_t>(r) * kUuid)) {
      const char* cvd = std::getenv("CUDA_VISIBLE_DEVICES");
      error = fmt::format(
          "setup_cuda: {} ranks on this node but {} GPU(s) visible to rank {} (CUDA_VISIBLE_DEVICES={}): local ranks "
          "{} and {} would share cuda:{} ({}); start at most one rank per GPU",
          m.local_size, visible, m.rank, cvd ? cvd : "unset", std::min(r, m.local_index), std::max(r, m.local_index),
          device, uuid);
    }
  }
  // The device, stream and events, and rank 0's NCCL unique id: failures that only some ranks see.
  std::unique_ptr<dist::NcclComm> nccl;
  dist::NcclId id{};
  if (error.empty()) {
    try {
      nccl = std::make_unique<dist::NcclComm>(m.rank, device);
      if (m.rank == 0) id = dist::nccl_unique_id();
    } catch (const Error& e) {
      error = e.what();
    }
  }
  if (const std::string first = first_error(error); !first.empty()) fail("{}", first);
  m.blocking("MPI_Bcast", [&] { return MPI_Bcast(id.data(), static_cast<int>(id.size()), MPI_CHAR, 0, m.comm); });
  {
    // Blocks until every rank has joined: watched like an MPI collective.
    const dist::Watched watched(m.watchdog.get(), "ncclCommInitRankConfig");
    nccl->connect(id, m.size, m.nccl_max_ctas);
  }
  m.nccl = std::move(nccl);
  if (m.watchdog) m.watchdog->watch(m.nccl.get());
  return device;
#else
  fail("Communicator::setup_cuda: flashlm was built without NCCL{}",
       cuda_built() ? " (CMake did not find nccl.h and libnccl next to the CUDA toolkit)" : " (and without CUDA)");
#endif
}

void Communicator::set_nccl_max_ctas(int ctas) {
  Impl& m = *impl_;
  FLASHLM_CHECK(ctas >= 0, "Communicator::set_nccl_max_ctas: {} CTAs, expected >= 1 (or 0: NCCL's choice)", ctas);
  FLASHLM_CHECK(cuda_device() < 0 || ctas == m.nccl_max_ctas,
                "Communicator::set_nccl_max_ctas: the NCCL communicator exists already (setup_cuda() or a GPU "
                "collective ran); set its CTAs before");
  m.nccl_max_ctas = ctas;
}

int Communicator::nccl_max_ctas() const { return impl_->nccl_max_ctas; }

int Communicator::cuda_device() const {
#ifdef FLASHLM_WITH_NCCL
  return impl_->nccl ? impl_->nccl->device() : -1;
#else
  return -1;
#endif
}

void* Communicator::cuda_stream() const {
#ifdef FLASHLM_WITH_NCCL
  return impl_->nccl ? impl_->nccl->stream() : nullptr;
#else
  return nullptr;
#endif
}

void Communicator::wait(void* stream) {
#ifdef FLASHLM_WITH_NCCL
  if (impl_->nccl) impl_->nccl->wait(stream);
#endif
}

void Communicator::synchronize() {
#ifdef FLASHLM_WITH_NCCL
  if (impl_->nccl) impl_->nccl->synchronize(impl_->timeout_s);
#endif
}

void Communicator::set_timeout(double seconds) {
  dist::check_timeout(seconds, "Communicator::set_timeout");
  impl_->timeout_s = seconds;
  if (impl_->watchdog) impl_->watchdog->set_timeout(seconds);
}

double Communicator::timeout() const { return impl_->timeout_s; }

void Communicator::finalize() {
  std::lock_guard lock(mpi_mutex());
  MpiProcess& p = mpi_process();
  if (!p.started_by_us || p.finalized_by_us) return;  // a host program that started MPI finalizes it
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
  p.finalized_by_us = true;
}

void Communicator::abort(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

bool Communicator::nccl_built() {
#ifdef FLASHLM_WITH_NCCL
  return true;
#else
  return false;
#endif
}

bool Communicator::mpi_started() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  return initialized != 0;
}

}  // namespace flashlm
