#!/usr/bin/env bash
# Checks the Hopper forward's head dim pair (head_dim 192 for q and k, head_dim_v 128 for v and o: DeepSeek's
# MLA shape, capabilities.h's kHopperForwardHeadDimPairs) on an sm_90 GPU, and that the Hopper kernels it
# touched still pass their own tests:
#   scripts/gpu-check-dqk-dv.sh BUILD_DIR OUT_DIR
# BUILD_DIR is a CUDA build with 90 in CMAKE_CUDA_ARCHITECTURES (BUILD_DIR/tests/test_attention). Runs
#   pairs         the new tests: (192, 128) forward against the fp64 oracle (ragged lengths, masks, layouts,
#                 GQA, fp16/bf16, window, softcap, ALiBi and sinks), the routing and every refusal by name,
#                 the capability table's CPU tests
#   hopper        the existing tests of the Hopper forward and backward: the fp64-oracle grid (Hopper where
#                 it covers a problem), the Hopper coverage, tile and dispatch tests, the window / softcap
#                 and ALiBi / sink grids, varlen
#   hopper-mma    the same with FLASHLM_ATTENTION_KERNEL=mma (the mma.sync fallback; tests that need a choice
#                 set it themselves)
#   attention     the whole of test_attention
#   memcheck, racecheck   compute-sanitizer on a few small (192, 128) cases: plain, causal bottom-right with
#                 rows without keys, a window, ALiBi and sinks
#   python        flashlm.flash_attn_func at (192, 128) on the GPU (tests/python), where PYTHON (default python3)
#                 has torch with CUDA and pytest; skipped, with a line in the summary, where it has not
# each into OUT_DIR/NAME.log, with a summary table in OUT_DIR/summary.md; exits non-zero if any failed.
set -uo pipefail
usage="usage: gpu-check-dqk-dv.sh BUILD_DIR OUT_DIR"
build=${1:?$usage} out=${2:?$usage}
exe=$build/tests/test_attention
[[ -x $exe ]] || { echo "error: no $exe" >&2; exit 2; }
mkdir -p "$out"
export LD_LIBRARY_PATH=$build/src:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
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

pairs='*HeadDimPair*:AttentionCapabilities.*'
hopper='Grid/CudaVsReference.*:CudaAttention.*Hopper*:CudaAttention.CapabilityTableAndBehaviourAgree:'
hopper+='Grid/CudaBandVsReference.*:CudaBand.*:*CudaAlibiSink*:Packs/VarlenCuda*'
FLASHLM_ATTENTION_KERNEL=auto run pairs 900 "$exe" --gtest_brief=1 --gtest_filter="$pairs"
FLASHLM_ATTENTION_KERNEL=auto run hopper 900 "$exe" --gtest_brief=1 --gtest_filter="$hopper"
FLASHLM_ATTENTION_KERNEL=mma run hopper-mma 900 "$exe" --gtest_brief=1 --gtest_filter="$hopper"
run attention 1200 "$exe" --gtest_brief=1

# Small (192, 128) cases: no mask with one query and one key, bottom-right causal with Nq > Nk (rows without
# keys), a window on a BHSD layout, ALiBi and sinks; plus the routing test (it runs the forward once).
subset='Grid/CudaHeadDimPairVsReference.HopperForwardMatchesFp64Oracle/b2_q1_k1_*:'
subset+='Grid/CudaHeadDimPairVsReference.HopperForwardMatchesFp64Oracle/*q17_k5_*causalBR*:'
subset+='Grid/CudaHeadDimPairVsReference.HopperForwardMatchesFp64Oracle/*q127_k1000_*_w130_70*:'
subset+='Grid/CudaHeadDimPairVsReference.HopperForwardMatchesFp64Oracle/*q300_k300_*alibi_sink*:'
subset+='CudaHeadDimPair.*'
for tool in memcheck racecheck; do
  FLASHLM_ATTENTION_KERNEL=auto run "$tool" 900 compute-sanitizer --tool "$tool" --error-exitcode 99 "$exe" \
    --gtest_brief=1 --gtest_filter="$subset"
done
# The sanitizer runs must have run the cases, not matched none.
for tool in memcheck racecheck; do
  grep -qE '^\[  PASSED  \] [1-9]' "$out/$tool.log" || { echo "error: $tool ran no test" | tee -a "$out/summary.md"; failed=1; }
done

python=${PYTHON:-python3}
library=$build/src/libflashlm_attention.so  # ninja -C BUILD_DIR flashlm_attention
if [[ ! -f $library ]]; then
  echo "| python | - | skipped: no $library |" | tee -a "$out/summary.md"
elif "$python" -c 'import torch, pytest; assert torch.cuda.is_available()' 2> /dev/null; then
  FLASHLM_LIBRARY=$library PYTHONPATH=$(dirname "$0")/../python \
    run python 600 "$python" -m pytest -q -p no:cacheprovider \
    "$(dirname "$0")/../tests/python/test_attention_variants.py" -k "head_dim_v or head_dims_192"
else
  echo "| python | - | skipped: $python has no torch with CUDA, or no pytest |" | tee -a "$out/summary.md"
fi
echo "summary: $out/summary.md"
exit $failed
