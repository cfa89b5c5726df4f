// What the Hopper (sm_90a) kernels of this folder share besides the entry points of backends.h: the
// device check and the 16-bit forward's tile choice. Built where CMAKE_CUDA_ARCHITECTURES has 90
// (FLASHLM_WITH_SM90).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/problem.h"
#include "flashlm/tensor.h"

namespace flashlm::flash_cuda {

// The multiprocessor count of the current device if it runs the Hopper kernels (compute capability 9.0
// and a loadable sm_90a image), else 0. Asked once per device (flash_fwd_sm90.cu).
int sm90_multiprocessors();

// The 16-bit forward's tile shape at head dim 64, query rows × keys per key block (flash_fwd_sm90.cu): from
// the problem's lengths and mask, or the one FLASHLM_SM90_FWD_D64_TILE names ("auto" or unset: chosen;
// "128x128", "192x128", "128x192": forced, which is how the tests run each; anything else is an error
// naming the variable).
enum class Sm90D64Tile { rows128_keys128, rows192_keys128, rows128_keys192 };
Sm90D64Tile sm90_forward_d64_tile(const AttentionProblem& p);

// How the backward's dK/dV kernel is launched (flash_bwd_sm90.cu, bwd_schedule_sm90.h): one block per
// (key block, key head, batch) tile, or a persistent grid of one block per SM walking the tiles heaviest first.
// From FLASHLM_SM90_BWD_SCHEDULE, read at each backward: "grid", "persistent", or "auto" (or unset: `automatic`,
// which sm90_backward_schedule_for resolves per problem); anything else is an error naming the variable.
enum class Sm90BackwardSchedule { automatic, grid, persistent };
Sm90BackwardSchedule sm90_backward_schedule();

// The launch `automatic` takes for a head dim: persistent at 64, grid otherwise, as the fa grid's timings of
// the two chose (docs/perf.md, "A persistent backward": the persistent launch wins at d64 and loses at d128 on
// non-causal and the longest causal shapes).
Sm90BackwardSchedule sm90_backward_schedule_for(Sm90BackwardSchedule requested, int64_t head_dim);
// The backward's wide heads (head dim 256, the (192, 128) pair): flash_bwd_wide_sm90.cu's dK/dV kernel, which
// splits dK, dV and dQ's columns between its consumer warpgroups, runs them (grid launch only, whatever
// FLASHLM_SM90_BWD_SCHEDULE says); flash_bwd_sm90.cu's kernel the others.
constexpr bool sm90_wide_backward(int64_t head_dim, int64_t head_dim_v) { return head_dim > 128 || head_dim_v > 128; }
// Whether the wide kernel runs these views (as flash_backward_sm90_covers for its head dims), and its launch: a
// BackwardDkdvLauncher for run_flash_backward (flash_common.cuh).
bool wide_backward_sm90_covers(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& dout);
struct FlashParams;
void launch_wide_backward_sm90(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& dout, const FlashParams& f,
                               cudaStream_t stream);

}  // namespace flashlm::flash_cuda
