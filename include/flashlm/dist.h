// Communicator: the processes of a data-parallel job and the collectives between them. MPI starts the
// processes' world and carries the CPU collectives; NCCL (CUDA builds) carries the GPU collectives.
//
// Launching: `mpirun -np N flashlm ...` (OpenMPI), `srun --mpi=pmix flashlm ...` (Slurm), or a plain
// `flashlm ...`, which is a world of one (OpenMPI's singleton MPI_Init). Every rank must call the same
// collectives in the same order with the same sizes (agree() checks a size).
//
// Failures: MPI errors come back as flashlm::Error (the communicator uses MPI_ERRORS_RETURN), naming the
// call and the rank. A rank that fails must not leave the others waiting in a collective forever:
//   - exit non-zero *without* finalize() (or call Communicator::abort()). OpenMPI's mpirun then kills the
//     remaining ranks and exits non-zero itself. A rank that called MPI_Finalize would instead block in
//     it (OpenMPI's finalize waits for every peer) while its peers wait in their collective: a deadlock.
//     Under srun, abort() (MPI_Abort) ends the whole step; a plain non-zero exit does so only with
//     `srun --kill-on-bad-exit=1`.
//   - A rank that stalls (hangs, or calls other collectives than its peers) is caught by the collective
//     timeout (set_timeout; default 600 s or $FLASHLM_DIST_TIMEOUT_S; 0: off). In a job of several ranks a
//     watchdog thread watches every blocking MPI call of the communicator (the collectives, wait(request),
//     the NCCL set-up) and the GPU collectives queued on its stream (an event recorded behind them,
//     ncclCommGetAsyncError polled): one that has not finished within the timeout, or an NCCL error, makes
//     it print "error: rank R: <operation> did not finish within T s ..." and end the job (MPI_Abort). The
//     peers of a stalled rank are the ones that report, since they are the ones waiting.
//   - synchronize() waits for the GPU collectives itself, polling the stream and ncclCommGetAsyncError
//     with the same timeout; on an NCCL error or the timeout it aborts the NCCL communicator
//     (ncclCommAbort) and throws, so that a caller may give up cleanly before the watchdog ends the job.
//   - Ranks started with different settings: agree_settings() compares the whole run configuration at
//     the start and throws SettingsMismatch on every rank, naming the setting.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "flashlm/error.h"
#include "flashlm/tensor.h"

namespace flashlm {

// One setting of a run for Communicator::agree_settings: its name ("steps", "optimizer.lr_max") and its
// value as canonical text (integers in decimal, reals in shortest round-trip form, lists comma-joined).
struct RunSetting {
  std::string name, value;
};

// Thrown by Communicator::agree_settings on every rank at once, when the ranks of a job were started with
// different settings: a usage error of the whole job (the CLI exits 2 on every rank), not a failed rank.
class SettingsMismatch : public Error {
 public:
  using Error::Error;
};

// avg: the sum divided by the world size (NCCL's ncclAvg; sum then scale on the CPU).
enum class ReduceOp : uint8_t { sum, avg, max, min };
std::string_view reduce_op_name(ReduceOp op);

// A collective in flight (Communicator::all_reduce_async): finished by Communicator::wait(request).
// Move-only; an empty (default) request is finished.
class CommRequest {
 public:
  CommRequest();
  ~CommRequest();
  CommRequest(CommRequest&&) noexcept;
  CommRequest& operator=(CommRequest&&) noexcept;
  CommRequest(const CommRequest&) = delete;
  CommRequest& operator=(const CommRequest&) = delete;
  bool pending() const;  // started and not yet waited for

 private:
  friend class Communicator;
  struct State;
  std::unique_ptr<State> state_;
};

class Communicator {
 public:
  // Collective over all processes. Initialises MPI once per process on first use (MPI_Init_thread,
  // MPI_THREAD_SERIALIZED: any thread may call, one at a time) unless the host program already did.
  Communicator();
  ~Communicator();
  Communicator(Communicator&&) noexcept;
  Communicator& operator=(Communicator&&) noexcept;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int world_size() const;
  // This process's index among the ranks of its node, and how many they are: from
  // OMPI_COMM_WORLD_LOCAL_RANK (mpirun), else SLURM_LOCALID (srun), else the rank within
  // MPI_Comm_split_type(MPI_COMM_TYPE_SHARED); local_size() always from the latter.
  int local_rank() const;
  int local_size() const;
  bool is_root() const { return rank() == 0; }

  // Collectives on contiguous views; every rank passes views of the same dtype and size.
  // CPU views (MPI): fp32 or fp64. CUDA views (NCCL): fp32, fp64, fp16, bf16, on this rank's device
  // (setup_cuda()). Gathers and broadcasts, which move elements without arithmetic, also carry fp8_e4m3
  // bytes on either (FSDP's FP8 weight gather); reductions refuse them. GPU collectives are queued on the
  // communicator's own stream after the work already queued on `stream` (nullptr: the legacy default
  // stream) and do not block the host: call wait(stream) before using the result on a stream, or
  // synchronize() before using it on the host.
  //
  // x := op over ranks of x (in place).
  void all_reduce(const TensorView& x, ReduceOp op = ReduceOp::sum, void* stream = nullptr);
  // x := root's x.
  void broadcast(const TensorView& x, int root = 0, void* stream = nullptr);
  // out (world_size · in.numel elements) := every rank's `in`, in rank order. `in` may be this rank's
  // chunk of `out` (in place).
  void all_gather(const TensorView& in, const TensorView& out, void* stream = nullptr);
  // out (in.numel / world_size elements) := op over ranks of this rank's chunk of `in`. `out` may be this
  // rank's chunk of `in` (in place).
  void reduce_scatter(const TensorView& in, const TensorView& out, ReduceOp op = ReduceOp::sum,
                      void* stream = nullptr);
  // In place, chunks of any sizes: x holds every rank's chunk in rank order (counts[r] elements for rank r,
  // Σ counts = x.numel); afterwards every chunk holds its owner's values on every rank. MPI_Allgatherv on
  // the CPU; on GPUs one NCCL broadcast per rank in a group (NCCL's all-gather needs equal chunks).
  void all_gather_v(const TensorView& x, std::span<const int64_t> counts, void* stream = nullptr);
  // In place, several segments at once: for each segment, rank r's chunk x[offset + r·part, +part) goes to
  // every rank, so that afterwards x[offset, offset + world·part) holds every rank's chunk in rank order on
  // every rank (all_gather with `in` = this rank's chunk of `out`, per segment). Segments must not overlap.
  // GPUs: one NCCL group of all-gathers (one launch, no host round trip between segments); CPU: one
  // MPI_Allgather per segment.
  struct Segment {
    int64_t offset = 0, part = 0;  // elements of x
  };
  void all_gather_segments(const TensorView& x, std::span<const Segment> segments, void* stream = nullptr);
  void barrier();  // MPI_Barrier (host)

  // all_reduce that returns before the reduction is done, for overlapping it with computation. CPU views:
  // a non-blocking MPI_Iallreduce; x must not be touched until wait(request), and MPI progresses it inside
  // MPI calls (test() is one). CUDA views: all_reduce(x, op, stream), already asynchronous to the host; the
  // request is finished at once (order later GPU work after it with wait(stream)).
  CommRequest all_reduce_async(const TensorView& x, ReduceOp op = ReduceOp::sum, void* stream = nullptr);
  // The same for a reduce-scatter (CPU: MPI_Ireduce_scatter_block; `in` and `out` untouched until wait())
  // and for all_gather_segments (CPU: one MPI_Iallgather per segment; x untouched until wait()).
  CommRequest reduce_scatter_async(const TensorView& in, const TensorView& out, ReduceOp op = ReduceOp::sum,
                                   void* stream = nullptr);
  CommRequest all_gather_segments_async(const TensorView& x, std::span<const Segment> segments,
                                        void* stream = nullptr);
  // Blocks until `request` is finished (then applies avg's division on the CPU); an empty request returns.
  void wait(CommRequest& request);
  // Progresses MPI and says whether `request` is finished (wait() must still be called to complete it).
  bool test(CommRequest& request);

  // Checks that every rank has the same `value` (a size, a step count, a checksum) and returns it;
  // otherwise every rank throws "ranks disagree on <what>: rank 0 has X, rank 2 has Y".
  int64_t agree(int64_t value, std::string_view what);

  // Checks that every rank has the same run settings (the same names and values in the same order): each
  // rank hashes their canonical serialisation and the hashes are all-gathered; when they differ, rank 0's
  // settings go to the lowest rank R that differs, which compares them one by one, and every rank throws
  // SettingsMismatch("rank R's run configuration differs from rank 0's in <name> (rank 0: X, rank R: Y)
  // [, <name> (...)]") listing every setting that differs. Settings that may legitimately differ per rank
  // (output paths, thread counts) are the caller's to leave out.
  void agree_settings(std::span<const RunSetting> settings);

  // Collective: "" when `local_error` is empty on every rank; otherwise, on every rank, "rank R: <its
  // error>" of the lowest rank that has one. For decisions all ranks must take together (skip a step,
  // give up), so that no rank is left alone in a later collective.
  std::string first_error(std::string_view local_error);

  // Host-buffer conveniences (float or double): comm.all_reduce(std::span(vec)).
  template <class T>
  void all_reduce(std::span<T> x, ReduceOp op = ReduceOp::sum) {
    all_reduce(host_view(x), op);
  }
  template <class T>
  void broadcast(std::span<T> x, int root = 0) {
    broadcast(host_view(x), root);
  }
  template <class T>
  void all_gather(std::span<T> in, std::span<T> out) {
    all_gather(host_view(in), host_view(out));
  }
  template <class T>
  void reduce_scatter(std::span<T> in, std::span<T> out, ReduceOp op = ReduceOp::sum) {
    reduce_scatter(host_view(in), host_view(out), op);
  }

  // GPU side (CUDA builds with NCCL: nccl_built()). setup_cuda() is collective: it picks this rank's GPU
  // (local rank modulo the visible GPUs; an error on every rank when two ranks of a node would share one,
  // i.e. more local ranks than GPUs, or when a rank has none), makes it current (cudaSetDevice), and
  // creates the NCCL communicator (unique id broadcast with MPI). The first GPU collective calls it
  // implicitly; call it first to allocate buffers on the right device. Returns the device index.
  int setup_cuda();
  // The most CTAs (thread blocks, one SM each) an NCCL collective may use: NCCL's communicator config
  // maxCTAs, for leaving SMs to computation that runs beside the collectives (the backward under DDP).
  // 0: NCCL's choice. Set before setup_cuda(), to the same value on every rank (setup_cuda() checks);
  // the environment variable NCCL_MAX_CTAS, when set, overrides it (NCCL reads it at init).
  void set_nccl_max_ctas(int ctas);
  int nccl_max_ctas() const;
  int cuda_device() const;     // -1 before setup_cuda()
  void* cuda_stream() const;   // the communicator's stream (cudaStream_t); nullptr before setup_cuda()
  void wait(void* stream);     // `stream` waits (on the GPU) for every GPU collective queued so far
  // Blocks the host until every GPU collective queued so far has finished, polling NCCL's asynchronous
  // error state; throws (and aborts the NCCL communicator) on an NCCL error or after the timeout.
  void synchronize();
  // The collective timeout in seconds (see the top of this file): finite, >= 0, 0 turns it off. Local to
  // this rank, which may be changed at any time; the watchdog reads it at each poll.
  void set_timeout(double seconds);
  double timeout() const;

  // Process-wide. finalize(): MPI_Finalize, after the job's last collective, on success only (see the top
  // of this file); Communicators must be destroyed before. A process that never calls it finalizes MPI
  // at exit when it is a world of one, and otherwise exits without finalizing (so that a failed rank
  // never blocks in MPI_Finalize).
  static void finalize();
  // MPI_Abort: ends every rank of the job with `code` (mpirun and srun both kill the job).
  [[noreturn]] static void abort(int code);
  // Whether the GPU collectives were built (CUDA and NCCL found at configure time).
  static bool nccl_built();
  // Whether this process has started MPI (through a Communicator or its host program).
  static bool mpi_started();

 private:
  bool check_reduce_scatter(const TensorView& in, const TensorView& out, const char* call) const;
  void check_segments(const TensorView& x, std::span<const Segment> segments, const char* call) const;
  template <class T>
  static TensorView host_view(std::span<T> x) {
    return TensorView::contiguous(x.data(), dtype_of<T>(), {static_cast<int64_t>(x.size())});
  }
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashlm
