// Which kernels OpenBLAS (the LM's CPU matrix products) runs on this CPU, and the fix for a CPU it misjudges.
//
// OpenBLAS picks its kernel set ("core") at load time from a table of CPU models. A model newer than the
// table falls back to the oldest x86-64 set: OpenBLAS 0.3.21 (Debian 12) runs its SSE3 "Prescott" kernels
// on the Xeon (family 6, model 207, AVX-512) of this project's development machines, where its "SkylakeX"
// kernels ran sgemm several times faster (docs/perf.md). It reads OPENBLAS_CORETYPE only while it loads,
// before main(), so a process can correct the choice only by restarting itself with that variable set
// (restart_with_blas_core_if_misjudged).
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

// If blas_core_to_request() names a core: sets OPENBLAS_CORETYPE to it (and FLASHLM_OPENBLAS_CHOSE to the
// core OpenBLAS had chosen, for blas_description) and re-executes this program (/proc/self/exe) with the
// same arguments; returns only when there is nothing to correct, or when the re-execution fails (then
// OpenBLAS's own choice stays). Call first thing in main(), before any thread or MPI starts.
void restart_with_blas_core_if_misjudged(char** argv);

// One line for `flashlm info`: OpenBLAS's configuration and core, and whether the core was corrected (or
// should be, with the variable that does it).
std::string blas_description();

}  // namespace flashlm
