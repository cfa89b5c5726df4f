#!/usr/bin/env bash
# Checks the Hopper kernels' ALiBi / attention-sink instantiations on an sm_90 GPU (taken by default;
# FLASHLM_HOPPER_ALIBI_SINK=0 keeps those problems on mma.sync: capabilities.h):
#   scripts/gpu-check-hopper-variants.sh BUILD_DIR OUT_DIR
# BUILD_DIR is a CUDA build with 90 in CMAKE_CUDA_ARCHITECTURES (BUILD_DIR/tests/test_attention). Runs
#   variants      the ALiBi / sink tests (fp64 oracle, varlen, the route, NaN and inf) and the capability
#                 table's, on the default route (the tests force it both ways themselves; ~90 s on an H100)
#   variants-off  the same with FLASHLM_HOPPER_ALIBI_SINK=0
#   attention     the whole of test_attention
#   memcheck-dNN, racecheck-dNN   compute-sanitizer on a small Hopper ALiBi / sink subset at head dims 64, 128
# each into OUT_DIR/NAME.log, with a summary table in OUT_DIR/summary.md; exits non-zero if any failed.
set -uo pipefail
usage="usage: gpu-check-hopper-variants.sh BUILD_DIR OUT_DIR"
source "$(dirname "$0")/gpu_check_lib.sh"  # build, out, exe, the summary header, failed, run()

variants='*AlibiSink*:*AttentionCapabilities*'
run variants 900 "$exe" --gtest_brief=1 --gtest_filter="$variants"
FLASHLM_HOPPER_ALIBI_SINK=0 run variants-off 900 "$exe" --gtest_brief=1 --gtest_filter="$variants"
run attention 900 "$exe" --gtest_brief=1

# Small Hopper cases per head dim: ragged lengths, both causal alignments, ALiBi and a sink together, a
# window and soft-capping beside them (varlen), rows without keys (bottom-right, Nq > Nk).
for d in 64 128; do
  subset="Grid/CudaAlibiSinkVsReference.HopperMatchesFp64Oracle/*q17_k130_*_d${d}_*alibi*:"
  subset+="Grid/CudaAlibiSinkVsReference.HopperMatchesFp64Oracle/*q130_k17_*_d${d}_*causalBR*:"
  subset+="Packs/VarlenCudaAlibiSinkVsReference.HopperMatchesPerSequenceReference/*_d${d}_*alibi*sink"
  for tool in memcheck racecheck; do
    run "$tool-d$d" 900 compute-sanitizer --tool "$tool" --error-exitcode 99 "$exe" --gtest_brief=1 \
      --gtest_filter="$subset"
  done
done
echo "summary: $out/summary.md"
exit $failed
