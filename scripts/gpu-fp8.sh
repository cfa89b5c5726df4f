#!/usr/bin/env bash
# On an H200 (or any sm_90 GPU): the FP8 forward's checks and timings in one device call.
#   scripts/gpu-fp8.sh BIN_DIR OUT_DIR [OLD_BIN_DIR]
# BIN_DIR holds flashlm, test_attention, test_sm90 and libflashlm.so of an sm_90a build
# (CMAKE_CUDA_ARCHITECTURES=90, FLASHLM_NATIVE=OFF); OLD_BIN_DIR, if given, flashlm and libflashlm.so of
# another build whose FP8 forward is timed beside (the same fa grid). In order of what matters most:
# tests: the sm90 primitives, the fp8 grid against the fp64 reference (twice: a moving error is a race),
# the dispatch and capability tests, the fa-grid benchmark (fp8 beside bf16; the old build's fp8), the
# 16-bit CUDA grid once (the Hopper kernels share tma.h and the forward's helpers), compute-sanitizer
# memcheck/racecheck/synccheck on a small fp8 filter, and torch's FP8 SDPA (scripts/fp8_sdpa_probe.py).
# The device tool brings back at most 8 files: the logs are gathered into tests.log and sanitizers.log and
# the per-step ones removed at the end.
set -uo pipefail
bin=$1 out=$2 old=${3:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
base_path=${nccl}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export LD_LIBRARY_PATH=$bin:$base_path
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
summary() { grep -E "^\[  (PASSED|FAILED) |tests? ran|^\[  FAILED  \]" "$1" | head -12; }

echo "== sm90 primitives"
timeout 30 "$bin/test_sm90" --gtest_brief=1 > "$out/sm90.log" 2>&1; echo "exit $?"; summary "$out/sm90.log"; cat "$out/sm90.log" >> "$out/tests.log"

echo "== fp8 smoke (one case; a hang or failure skips the other fp8 steps)"
timeout 20 "$bin/test_attention" --gtest_filter='Grid/Fp8VsReference.*q300_k129*d128*' --gtest_brief=1 > "$out/fp8-smoke.log" 2>&1
smoke=$?; echo "exit $smoke"; summary "$out/fp8-smoke.log"; cat "$out/fp8-smoke.log" >> "$out/tests.log"
if [[ $smoke -eq 0 ]]; then
echo "== fp8 grid (x2) and the tables' tests"
timeout 60 "$bin/test_attention" --gtest_filter='*Fp8*:AttentionCapabilities*:CudaAttention.CapabilityTableAndBehaviourAgree' \
  --gtest_repeat=2 --gtest_brief=1 > "$out/fp8-grid.log" 2>&1
echo "exit $?"; grep -E "Failure|error|differs" "$out/fp8-grid.log" | head -20; summary "$out/fp8-grid.log"
cat "$out/fp8-grid.log" >> "$out/tests.log"

echo "== fa grid forward: fp8 and bf16"
timeout 60 "$bin/flashlm" attention-bench --device cuda --quiet --grid fa --impl flash --dtype fp8,bf16 --warmup 10 \
  --reps 30 --forward-only --format json --out "$out/fp8-fa.json" >> "$out/tests.log" 2>&1
echo "exit $?"
if [[ -n $old ]]; then
  LD_LIBRARY_PATH=$old:$base_path timeout 60 "$old/flashlm" attention-bench --device cuda --quiet --grid fa --impl flash \
    --dtype fp8 --warmup 10 --reps 30 --forward-only --format json --out "$out/fp8-fa-old.json" >> "$out/tests.log" 2>&1
  echo "old: exit $?"
fi

fi
echo "== 16-bit CUDA grid (its bf16 half) and CudaAttention (default dispatch: the Hopper kernels)"
timeout 60 "$bin/test_attention" --gtest_filter='Grid/CudaVsReference.*bf16*:CudaAttention.*' --gtest_brief=1 \
  > "$out/cuda-grid.log" 2>&1
echo "exit $?"; grep -E "Failure" "$out/cuda-grid.log" | head -5; summary "$out/cuda-grid.log"
cat "$out/cuda-grid.log" >> "$out/tests.log"

if [[ $smoke -eq 0 ]]; then
small='Grid/Fp8VsReference.*q17_k130*:Grid/Fp8VsReference.*q300_k129*:Fp8Attention.EmptySequences'
for tool in memcheck racecheck synccheck; do
  timeout 40 compute-sanitizer --tool $tool --error-exitcode 99 "$bin/test_attention" --gtest_filter="$small" \
    --gtest_brief=1 > "$out/fp8-sanitizer-$tool.log" 2>&1
  echo "$tool: exit $? ($(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' "$out/fp8-sanitizer-$tool.log"))"
  cat "$out/fp8-sanitizer-$tool.log" >> "$out/sanitizers.log"
done

fi
echo "== torch FP8 SDPA"
PYTHONUNBUFFERED=1 timeout 45 python3 "$here/fp8_sdpa_probe.py" --out "$out/fp8-peers.json" > "$out/probe.log" 2>&1
echo "exit $?"; grep -E "^torch|: runs|: no:" "$out/probe.log"

echo "== table"
peers=(); [[ -s $out/fp8-peers.json ]] && [[ $(cat "$out/fp8-peers.json") != "[]" ]] && peers=(--peers "$out/fp8-peers.json")
oldj=(); [[ -s $out/fp8-fa-old.json ]] && oldj=(--old "$out/fp8-fa-old.json")
[[ -s $out/fp8-fa.json ]] && python3 "$here/fp8_bench_table.py" "$out/fp8-fa.json" "${oldj[@]}" "${peers[@]}" | tee "$out/fp8-table.md"
rm -f "$out"/sm90.log "$out"/fp8-smoke.log "$out"/fp8-grid.log "$out"/cuda-grid.log "$out"/fp8-sanitizer-*.log
