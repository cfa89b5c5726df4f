#!/usr/bin/env bash
# On an H200 (or any sm_90 GPU): the FP8 forward's first checks and timings in one device call.
#   scripts/gpu-fp8.sh BIN_DIR OUT_DIR
# BIN_DIR holds flashlm, test_attention and libflashlm.so of an sm_90a build (CMAKE_CUDA_ARCHITECTURES=90a,
# FLASHLM_NATIVE=OFF). tests: the fp8 grid against the fp64 reference (3 repeats: a moving error is a race),
# the dispatch and capability tests, compute-sanitizer memcheck/racecheck/synccheck on a small filter;
# bench: the fa grid forward, fp8 beside bf16 (Hopper kernel) in one run.
set -uo pipefail
bin=$1 out=$2
mkdir -p "$out"
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=$bin:${nccl}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader

echo "== fp8 grid (x3) and the tables' tests"
timeout 300 "$bin/test_attention" --gtest_filter='*Fp8*:AttentionCapabilities*:CudaAttention.CapabilityTableAndBehaviourAgree' \
  --gtest_repeat=3 --gtest_brief=1 > "$out/fp8-grid.log" 2>&1
echo "exit $?"; grep -E "FAILED|Failure|error" "$out/fp8-grid.log" | head -30; grep -E "PASSED|tests ran" "$out/fp8-grid.log" | tail -2
small='Grid/Fp8VsReference.*q17_k130*:Grid/Fp8VsReference.*q127_k64*:Grid/Fp8VsReference.*q300_k129*'
for tool in memcheck racecheck synccheck; do
  timeout 300 compute-sanitizer --tool $tool --error-exitcode 99 "$bin/test_attention" --gtest_filter="$small" \
    --gtest_brief=1 > "$out/fp8-sanitizer-$tool.log" 2>&1
  echo "$tool: exit $? ($(grep -c 'Invalid\|Race\|hazard\|Barrier' "$out/fp8-sanitizer-$tool.log") findings)"
  grep -m3 -E "Invalid|Race|hazard|Barrier|ERROR SUMMARY" "$out/fp8-sanitizer-$tool.log"
done

echo "== fa grid forward: fp8 and bf16"
timeout 300 "$bin/flashlm" attention-bench --device cuda --quiet --grid fa --impl flash --dtype fp8,bf16 --warmup 10 \
  --reps 30 --forward-only --format json --out "$out/fp8-fa.json" > /dev/null
echo "exit $?"
"$bin/flashlm" attention-bench --device cuda --grid fa --impl flash --dtype fp8,bf16 --warmup 5 --reps 10 --forward-only 2>&1 | tail -30
