#!/usr/bin/env bash
# On an H200 (or any sm_90 GPU): the Hopper forward's checks and timings in one device call.
#   scripts/gpu-hopper.sh BIN_DIR PEERS_DIR OUT_DIR [tests|bench|all] [LIB_B_DIR]
# BIN_DIR holds flashlm, test_attention, test_sm90 and libflashlm.so; PEERS_DIR shared/bench's scripts;
# LIB_B_DIR, if given, another build's libflashlm.so, timed beside BIN_DIR's (an A/B in one call).
# The device tool returns at most 8 files of OUT_DIR: pass a scratch directory and tar it into $OUT.
# tests: the wrappers' unit tests, the CUDA grid on the Hopper path (3 repeats: a moving error is a race),
# the grid forced onto the mma.sync fallback, compute-sanitizer memcheck/racecheck/synccheck on a small
# filter. bench: the fa grid forward on the Hopper path and on the fallback, then the PyTorch peers, compared.
set -uo pipefail
bin=$1 peers=$2 out=$3 what=${4:-all} lib_b=${5:-}
mkdir -p "$out"
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=$bin:${nccl}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader

if [[ $what == tests || $what == all ]]; then
  echo "== sm90 wrappers"
  timeout 120 "$bin/test_sm90" --gtest_brief=1 2>&1 | tail -15
  echo "== CUDA grid, Hopper forward where it covers (x3)"
  timeout 400 "$bin/test_attention" --gtest_filter='*Cuda*' --gtest_repeat=3 --gtest_brief=1 > "$out/grid-sm90.log" 2>&1
  echo "exit $?"; grep -E "FAILED|Failure|error" "$out/grid-sm90.log" | head -20; grep -E "PASSED|tests ran" "$out/grid-sm90.log" | tail -2
  echo "== CUDA grid, FLASHLM_ATTENTION_KERNEL=mma"
  FLASHLM_ATTENTION_KERNEL=mma timeout 300 "$bin/test_attention" --gtest_filter='*Cuda*' --gtest_brief=1 > "$out/grid-mma.log" 2>&1
  echo "exit $?"; grep -E "FAILED|Failure" "$out/grid-mma.log" | head -10; grep -E "PASSED" "$out/grid-mma.log" | tail -1
  small='Grid/CudaVsReference.*q127_k64_*:Grid/CudaVsReference.*q17_k130_h4x2_d128*:Grid/CudaVsReference.b1_q129_k97_h4x2_d256*:Grid/CudaVsReference.b2_q17_k130_h4x2_d256*:CudaAttention.QueryTilesThatSeeNoKey*'
  for tool in memcheck racecheck synccheck; do
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 99 "$bin/test_attention" --gtest_filter="$small" \
      --gtest_brief=1 > "$out/sanitizer-$tool.log" 2>&1
    echo "$tool: exit $? ($(grep -c 'Invalid\|Race\|hazard\|Barrier' "$out/sanitizer-$tool.log") findings)"
    grep -m3 -E "Invalid|Race|hazard|Barrier|ERROR SUMMARY" "$out/sanitizer-$tool.log"
  done
fi

if [[ $what == bench || $what == all ]]; then
  echo "== fa grid forward, bf16: Hopper path, then the mma.sync fallback"
  fb="$bin/flashlm attention-bench --device cuda --quiet --grid fa --impl flash --dtype bf16 --warmup 10 --reps 30 --forward-only"
  $fb --format json --out "$out/ours-sm90.json" > /dev/null
  FLASHLM_ATTENTION_KERNEL=mma $fb --format json --out "$out/ours-mma.json" > /dev/null
  variants="sm90 mma"
  if [[ -n $lib_b ]]; then
    LD_LIBRARY_PATH=$lib_b:${nccl}:/usr/local/cuda/lib64 $fb --format json --out "$out/ours-b.json" > /dev/null
    variants="sm90 b mma"
  fi
  python3 "$peers/attention_peers.py" --grid fa --peers flash,cudnn --out "$out/peers-fa.json" > "$out/peers-fa.log" 2>&1 \
    || tail -5 "$out/peers-fa.log"
  for v in $variants; do
    python3 "$peers/compare.py" "$out/ours-$v.json" "$out/peers-fa.json" --ours flash --peer flash --peer cudnn \
      > "$out/compare-$v.md"
    echo "-- $v vs peers (fwd ratios: flash, cudnn)"
    grep "^|" "$out/compare-$v.md" | cut -d"|" -f2-8,10,12
    tail -1 "$out/compare-$v.md"
  done
fi
