// Which kernels OpenBLAS (the LM's CPU matrix products) runs on this CPU, and the fix for a CPU it misjudges.
//
// OpenBLAS picks its kernel set ("core") at load time from a table of CPU models. A model newer than the
// table falls back to the oldest x86-64 set: OpenBLAS 0.3.21 (Debian 12) runs its SSE3 "Prescott" kernels
// on the Xeon (family 6, model 207, AVX-512) of this project's development machines, where its "SkylakeX"
// kernels ran sgemm several times faster (docs/perf.md). It reads OPENBLAS_CORETYPE only while it loads,
// before main(), so a process can correct the choice only by restarting itself with that variable set
// (restart_with_cpu_settings).
#pragma once
#include <string>
#include <string_view>

namespace flashlm {

// The core OpenBLAS runs, as it names it ("SkylakeX", "Haswell", "Prescott", ...).
std::string blas_core();

// The core to request when OpenBLAS chose one without AVX2 kernels on a CPU that has AVX2 and FMA:
// "SkylakeX" where the CPU also has the AVX-512 F/BW/DQ/VL that those kernels use, else "Haswell". Empty
// when OpenBLAS's choice stands, or when OPENBLAS_CORETYPE is set (the user's choice wins).
std::string blas_core_to_request();

// The rule behind blas_core_to_request, for a core OpenBLAS chose and what the CPU offers.
std::string blas_core_for(std::string_view chosen, bool avx2_fma, bool avx512);

// The settings a process can make only before it starts, and restarts itself to make: OPENBLAS_CORETYPE
// when blas_core_to_request() names a core (and FLASHLM_OPENBLAS_CHOSE to the core OpenBLAS had chosen, for
// blas_description), and OMP_WAIT_POLICY=passive when the user has not set it (libgomp reads it once, when it
// loads; see apply_cpu_threading_policy). When either is to be set: sets them and re-executes this program
// (/proc/self/exe) with the same arguments; returns only when there is nothing to set, or when the
// re-execution fails (then the process runs as it was started). Call first thing in main(), before any
// thread or MPI starts.
void restart_with_cpu_settings(char** argv);

// The CPU threading policy (docs/cpu-threading.md): flashlm's OpenMP threads (cpu_threads(): --threads, else
// OMP_NUM_THREADS, else every core) own the cores; OpenBLAS runs single-threaded inside them, each thread one
// block of a matrix product (cpu::sgemm), so that no second pool of threads waits for work beside ours; and
// those threads sleep when idle (OMP_WAIT_POLICY=passive, which restart_with_cpu_settings sets for the CLI)
// rather than spin, since a spinning thread takes the core from the one whose result it waits for as soon as
// the cores are shared. This function sets OpenBLAS's pthreads pool to one thread and leaves an OpenMP build of
// OpenBLAS alone (that one already runs single-threaded inside a parallel region, and its
// openblas_set_num_threads would change our OpenMP thread count). Idempotent; every CPU matrix product calls
// it first, so that no program has to. A program that links the library (Python) sets OMP_WAIT_POLICY itself.
void apply_cpu_threading_policy();

// The threads one OpenBLAS call may use (1 under the policy; OpenMP's count for an OpenMP build of OpenBLAS).
int blas_threads();

// One line for `flashlm info`: OpenBLAS's configuration and core, whether the core was corrected (or should
// be, with the variable that does it), and the threading policy's settings.
std::string blas_description();

}  // namespace flashlm
