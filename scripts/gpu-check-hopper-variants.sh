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
build=${1:?$usage} out=${2:?$usage}
exe=$build/tests/test_attention
[[ -x $exe ]] || { echo "error: no $exe" >&2; exit 2; }
mkdir -p "$out"
export LD_LIBRARY_PATH=$build/src:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
printf '| run | exit | result |\n|---|---|---|\n' > "$out/summary.md"
failed=0

run() {  # NAME LIMIT CMD...: one run into OUT_DIR/NAME.log and a row of summary.md
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local summary
  summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\]|ERROR SUMMARY|RACECHECK SUMMARY' "$out/$name.log" |
    grep -v '^\[  FAILED  \] [A-Z]' | tr '\n' ' ')
  echo "| $name | $rc$( ((rc == 124)) && echo ' (timed out)') | ${summary:-see $name.log} |" | tee -a "$out/summary.md"
  grep -E '^\[  FAILED  \] [A-Z]' "$out/$name.log" | head -20
  ((rc == 0)) || failed=1
}

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
