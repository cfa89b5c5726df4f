#!/usr/bin/env bash
# On a GPU machine: run the GPU tests, compute-sanitizer on a small grid, then our attention sweep and the
# PyTorch peers' in the same session, and compare them.
#   scripts/gpu-measure.sh BIN_DIR LIB_DIR PEERS_DIR OUT_DIR [tests|bench|profile|lm|all|ddp]
# (lm: the LM engine's GPU tests, flashlm bench beside the PyTorch LM peers, range summaries, memory
# timelines; ddp: on a machine with several GPUs, the distributed tests and benchmarks beside PyTorch DDP)
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
  # A result that changes between runs is a race: the grid three more times, failures only.
  "$bin/test_attention" --gtest_filter='Grid/CudaVsReference.*' --gtest_repeat=3 --gtest_brief=1 \
    > "$out/gpu-tests-repeat.log" 2>&1
  echo "repeat x3: exit $?"; grep -A6 "Failure" "$out/gpu-tests-repeat.log" | head -30
  echo "== compute-sanitizer (memcheck, racecheck) on a small grid"
  small='Grid/CudaVsReference.*q127_k64*:Grid/CudaVsReference.*q17_k130*:Grid/CudaVsReference.*d64_bhsd_causalTL_bf16*'
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 99 "$bin/test_attention" --gtest_filter="$small" --gtest_brief=1 \
      > "$out/sanitizer-$tool.log" 2>&1
    echo "$tool: exit $? ($(grep -c 'Invalid\|Race\|hazard' "$out/sanitizer-$tool.log") findings)"; tail -3 "$out/sanitizer-$tool.log"
  done
fi

if [[ $what == bench || $what == all ]]; then
  echo "== attention sweep, fa grid: flash (default dQ by atomics, and the deterministic separate dQ pass) and naive; then the PyTorch peers"
  fb="$bin/flashlm attention-bench --device cuda --quiet"
  $fb --grid fa --dtype bf16 --warmup 10 --reps 30 --impl flash --format json --out "$out/ours-fa.json" > /dev/null
  $fb --grid fa --dtype bf16 --warmup 10 --reps 30 --impl flash --deterministic --format json --out "$out/ours-fa-det.json" > /dev/null
  $fb --grid fa --dtype bf16 --warmup 3 --reps 5 --impl naive --format json --out "$out/ours-fa-naive.json" > /dev/null
  python3 "$peers/attention_peers.py" --grid fa --peers flash,cudnn --out "$out/peers-fa.json" > "$out/peers-fa.log" 2>&1 \
    || tail -5 "$out/peers-fa.log"
  for mode in "" -det; do
    echo "-- flash$mode vs peers"
    python3 "$peers/compare.py" "$out/ours-fa$mode.json" "$out/peers-fa.json" --ours flash --peer flash --peer cudnn \
      > "$out/compare-fa$mode.md"
    tail -1 "$out/compare-fa$mode.md"
  done
  echo "== memory at seq 32k (b1 h16 d128): flash (dQ by atomics), flash --deterministic (separate dQ pass), naive"
  for extra in "--impl flash" "--impl flash --deterministic" "--impl naive"; do
    $fb --seq 32768 --batch 1 --heads 16 --d 128 --causal=0,1 --dtype bf16 --warmup 1 --reps 3 $extra --format csv \
      | cut -d, -f1,5,7,8,9,12,13,14
  done
  echo "== seed grid (batch 8, one head, causal), fp32 and bf16, naive and flash"
  $fb --grid seed --dtype fp32,bf16 --impl naive,flash --warmup 2 --reps 5 --format json --out "$out/ours-seed.json" \
    | tee "$out/ours-seed.md" | tail -70
fi

if [[ $what == profile || $what == all ]]; then
  echo "== ncu: forward and backward kernels at b4 h16 n4096 d128 bf16"
  ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
      -k regex:'flash_(fwd|bwd_dkdv)_kernel' -c 3 \
      "$bin/flashlm" attention-bench --device cuda --impl flash --dtype bf16 --seq 4096 --batch 4 --heads 16 --d 128 \
      --warmup 0 --reps 1 --quiet > "$out/ncu.txt" 2>&1  # launches: fwd (memory pass), fwd (timed), bwd_dkdv
  grep -E "flash_|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|L1/TEX Cache|DRAM Throughput" "$out/ncu.txt" | head -40
fi

if [[ $what == lm || $what == all ]]; then
  echo "== LM engine GPU tests"
  for t in test_gemm_cuda test_model_cuda; do
    timeout 300 "$bin/$t" --gtest_brief=1 > "$out/$t.log" 2>&1; echo "$t: exit $? ($(tail -1 "$out/$t.log"))"
  done
  echo "== flashlm train on the GPU: small, synthetic data, bf16; 20 steps = 10 + resume + 10 (same checkpoint)"
  tr="$bin/flashlm train --device cuda --model small --context 256 --batch 8 --data synthetic --log-every 10"
  tr="$tr --eval-every 0 --cosine-steps 20"
  timeout 300 $tr --steps 20 --checkpoint "$out/ckpt-full.bin" > "$out/train-full.log" 2>&1; echo "20 steps: exit $?"
  tail -2 "$out/train-full.log"
  timeout 300 $tr --steps 10 --checkpoint "$out/ckpt-half.bin" > "$out/train-half.log" 2>&1 &&
    timeout 300 $tr --steps 20 --checkpoint "$out/ckpt-half.bin" --resume >> "$out/train-half.log" 2>&1
  echo "10 + resume + 10: exit $?"
  cmp "$out/ckpt-full.bin" "$out/ckpt-half.bin" && echo "checkpoints identical" || echo "CHECKPOINTS DIFFER"
  echo "== flashlm bench (the seed's table: context 512, batch 4) and the PyTorch LM peers"
  timeout 400 "$bin/flashlm" bench --device cuda --model small,medium,large,xl,2.7B --context 512 --batch 4 \
    --precision fp32,bf16 --warmup 3 --steps 10 --format json --out "$out/ours-lm.json" > "$out/ours-lm.md"
  tail -32 "$out/ours-lm.md"
  timeout 400 python3 "$peers/lm_peers.py" --models small,medium,large,xl,2.7B --modes fp32,bf16 \
    --out "$out/peers-lm.json" > "$out/peers-lm.log" 2>&1; tail -11 "$out/peers-lm.log"
  timeout 300 python3 "$peers/lm_peers.py" --models small,xl --modes bf16-compile --out "$out/peers-lm-compile.json" \
    > "$out/peers-lm-compile.log" 2>&1; tail -3 "$out/peers-lm-compile.log"
  echo "== range summaries (GPU time by CUDA events), bf16 train step"
  for m in small xl; do
    timeout 120 "$bin/flashlm" bench --device cuda --model $m --context 512 --batch 4 --precision bf16 --pass step \
      --warmup 3 --steps 5 --profile-ranges --quiet > "$out/ranges-$m.txt" 2>&1; tail -16 "$out/ranges-$m.txt"
  done
  echo "== flashlm.attention from PyTorch: attention alone, and swapped into the CS336 small model"
  PYTHONPATH="$(dirname "$0")/../python" FLASHLM_LIBRARY="$lib/libflashlm.so" timeout 400 \
    python3 "$(dirname "$0")/torch_attention_bench.py" --peers "$peers" --models small --out "$out/torch-swap.json" \
    > "$out/torch-swap.log" 2>&1; tail -24 "$out/torch-swap.log"
  echo "== per-kernel summary (CUPTI), xl bf16 train step"
  timeout 120 "$bin/flashlm" bench --device cuda --model xl --context 512 --batch 4 --precision bf16 --pass step \
    --warmup 3 --steps 5 --profile-kernels --quiet > "$out/kernels-xl.txt" 2>&1; head -40 "$out/kernels-xl.txt"
  echo "== memory timelines: large, context 256 (forward, then a train step)"
  for p in bf16 fp32; do
    timeout 120 "$bin/flashlm" bench --device cuda --model large --context 256 --batch 4 --precision $p --pass fwd,step \
      --warmup 1 --steps 1 --memory-timeline "$out/timeline-large-$p.json" --quiet > /dev/null
  done
fi

# Two GPUs or more: the communicator's and DDP's GPU tests, all-reduce, ddp-bench (every variant, ZeRO-1
# off and on) and the PyTorch DDP peers.
if [[ $what == ddp ]]; then
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  n=$(nvidia-smi -L | wc -l)
  # --bind-to none: mpirun's default core binding would leave each rank one core for the xl model's set-up.
  mr="mpirun --allow-run-as-root --bind-to none -np $n -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE -x PATH"
  for t in test_dist test_ddp; do
    timeout 300 $mr "$bin/$t" --gtest_brief=1 > "$out/$t-np$n.log" 2>&1; echo "$t under mpirun -np $n: exit $?"
  done
  echo "== flashlm train --ddp bucketed --zero 1 on $n GPUs (small, synthetic data)"
  timeout 300 $mr "$bin/flashlm" train --device cuda --model small --context 256 --batch 8 --data synthetic \
    --steps 30 --log-every 10 --eval-every 0 --ddp bucketed --bucket-mb 25 --zero 1 2>&1 | tail -5
  timeout 120 $mr "$bin/flashlm" allreduce-bench --device cuda --sizes 1MB,10MB,100MB,1GB --format json \
    --out "$out/allreduce-nccl-np$n.json" | tail -6
  timeout 500 $mr "$bin/flashlm" ddp-bench --zero 0,1 --reduce-dtype fp32,bf16 --nccl-max-ctas 16 --format json \
    --out "$out/ddp-np$n.json" | tail -40
  timeout 400 python3 "$peers/ddp_peers.py" --model xl --out "$out/ddp-peers.json" > "$out/ddp-peers.log" 2>&1
  tail -16 "$out/ddp-peers.log"
fi
