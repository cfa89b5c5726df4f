#!/usr/bin/env bash
# On a GPU machine: run the GPU tests, compute-sanitizer on a small grid, then our attention sweep and the
# PyTorch peers' in the same session, and compare them.
#   scripts/gpu-measure.sh BIN_DIR LIB_DIR PEERS_DIR OUT_DIR [tests|bench|all]
# BIN_DIR holds flashlm and the test binaries, LIB_DIR libflashlm.so, PEERS_DIR shared/bench's scripts.
set -uo pipefail
bin=$1 lib=$2 peers=$3 out=$4 what=${5:-all}
mkdir -p "$out"
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=$lib:${nccl}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
"$bin/flashlm" info

if [[ $what == tests || $what == all ]]; then
  echo "== GPU tests"
  "$bin/test_attention" --gtest_filter='*Cuda*' --gtest_brief=1 2>&1 | tee "$out/gpu-tests.log" | tail -40
  echo "== compute-sanitizer (memcheck, racecheck) on a small grid"
  small='Grid/CudaVsReference.*q127_k64*:Grid/CudaVsReference.*q17_k130*:Grid/CudaVsReference.*d64_bhsd_causalTL_bf16*'
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 99 "$bin/test_attention" --gtest_filter="$small" --gtest_brief=1 \
      > "$out/sanitizer-$tool.log" 2>&1
    echo "$tool: exit $? ($(grep -c 'Invalid\|Race\|hazard' "$out/sanitizer-$tool.log") findings)"; tail -3 "$out/sanitizer-$tool.log"
  done
fi

if [[ $what == bench || $what == all ]]; then
  echo "== attention sweep, fa grid"
  "$bin/flashlm" attention-bench --device cuda --grid fa --impl flash --dtype bf16 --warmup 10 --reps 30 \
    --format json --out "$out/ours-fa.json" --quiet
  python3 "$peers/attention_peers.py" --grid fa --peers flash,cudnn --out "$out/peers-fa.json" > "$out/peers-fa.log" 2>&1 \
    || tail -5 "$out/peers-fa.log"
  python3 "$peers/compare.py" "$out/ours-fa.json" "$out/peers-fa.json" --ours flash --peer flash --peer cudnn \
    | tee "$out/compare-fa.md"
fi
