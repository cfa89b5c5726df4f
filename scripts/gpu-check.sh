#!/usr/bin/env bash
# Checks a build on a GPU host: every GPU test binary, then the commands of docs/perf.md's tables beside the
# PyTorch peers (scripts/peers/), with md/csv/json records and compare.py's tables in OUT_DIR.
#   scripts/gpu-check.sh BUILD_DIR OUT_DIR [STEP ...]
# BUILD_DIR is a CUDA build (cmake -DCMAKE_CUDA_ARCHITECTURES=90 -DFLASHLM_NATIVE=OFF for a Hopper host that
# is not the build machine): BUILD_DIR/tools/flashlm, BUILD_DIR/tests/test_*, BUILD_DIR/src/lib*.so.
# Steps (default: tests and every one-GPU table; with two GPUs visible also ddp and two-gpu):
#   tests        test_sm90, test_attention (whole, on the default dispatch and forced onto the mma.sync
#                kernels), compute-sanitizer memcheck/racecheck/synccheck on a small attention filter,
#                test_model_cuda, test_gemm_cuda, test_model, test_optim, test_fsdp/test_ddp/test_dist at
#                world 1 (and under mpirun -np 2 with two GPUs), the Python package's tests, a bf16 train run
#                resumed bit for bit and a NaN loss stopped. OUT_DIR/tests.md is the summary.
#   attention    the fa grid (fwd + bwd) beside SDPA flash and cuDNN      (scripts/peers/rerun_all.sh)
#   gqa long fp8 d256 torch   GQA, long context, the FP8 forward, head dim 256, the op from PyTorch
#   lm leaderboard            the small/xl step beside eager and torch.compile; the 8B step beside its peer
#   fsdp                      FSDP and DDP at world 1 against the plain xl step
#   ddp          (two GPUs) DDP and ZeRO-1 on two GPUs beside torch DDP
#   two-gpu      (two GPUs) the leaderboard step with FSDP beside PyTorch FSDP2, xl scaling beside torch DDP
#                and FSDP2, the one-GPU step, the leaderboard step through ddp-bench --ddp fsdp;
#                OUT_DIR/two-gpu/summary.md
#   cpu          (only when named) CPU attention beside torch's CPU SDPA and the CPU LM step beside eager
#   ab           (only when named) an A/B of this build's libraries against BASELINE (a directory holding
#                the other build's libflashlm*.so): the GPU attention tests with each, then the fa grid with
#                this build, the baseline, this build, the baseline (interleaved, so that drift shows)
# Environment: PYTHON (default python3: one with torch and CUDA), FLASHLM (default BUILD_DIR/tools/flashlm),
# TIMEOUT_SCALE (default 1: multiplies every command's timeout). DRY_RUN=1 runs on the CPU with tiny shapes
# what can run there (the attention/lm/leaderboard/ddp tables through rerun_all.sh's own dry run, and the
# two-gpu step), and only prints the GPU-only commands: what CI runs (tests/CMakeLists.txt). The script ends
# with "finish: N step(s) failed" and exits non-zero when a test binary or a step failed.
set -uo pipefail
usage="usage: gpu-check.sh BUILD_DIR OUT_DIR [STEP ...]"
build=${1:?$usage} out=${2:?$usage}
shift 2
for s in "$@"; do
  case $s in tests|attention|gqa|long|fp8|d256|torch|lm|leaderboard|fsdp|ddp|two-gpu|cpu|ab) ;;
    *) echo "error: unknown step '$s' ($usage)" >&2; exit 2 ;;
  esac
done
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
peers=$here/peers
dry=${DRY_RUN:-0}
python=${PYTHON:-python3}
flashlm=${FLASHLM:-$build/tools/flashlm}
scale=${TIMEOUT_SCALE:-1}
mkdir -p "$out"
# NVLink multicast stays off in every process we start (it needs a fabric manager the shared hosts lack).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mpirun="mpirun --allow-run-as-root --bind-to none -x LD_LIBRARY_PATH -x OMP_NUM_THREADS -x NCCL_NVLS_ENABLE
  -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS"

if [[ $dry == 1 ]]; then
  gpus=0
  export OMP_NUM_THREADS=1
  mpirun="$mpirun --oversubscribe"
else
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  nccl=$("$python" -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
  export LD_LIBRARY_PATH=$build/src:${nccl}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader
  "$python" -c "import torch; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count())"
  "$flashlm" info | head -5
fi
if (($# > 0)); then
  what=" $* "
elif [[ $dry == 1 || $gpus -ge 2 ]]; then
  what=" tests attention gqa long fp8 d256 torch lm leaderboard fsdp ddp two-gpu "
else
  what=" tests attention gqa long fp8 d256 torch lm leaderboard fsdp "
fi
has() { [[ $what == *" $1 "* ]]; }

failed=()
current=""
step() {  # NAME DESCRIPTION
  current=$1
  echo "== [$SECONDS s] $1: $2"
}
# bounded LIMIT CMD...: CMD under a timeout of LIMIT (× TIMEOUT_SCALE) seconds; prints its exit status, and a
# failure names the current step in the list the script ends with.
bounded() {
  local limit=$(($1 * scale)); shift
  timeout "$limit" "$@"
  local rc=$?
  echo "exit $rc$( ((rc == 124)) && echo ' (timed out)')"
  ((rc == 0)) || failed+=("$current")
  return $rc
}
# print_only CMD...: what a dry run says instead of running a GPU-only command.
print_only() { echo "would run: $*"; }
run_gpu() {  # LIMIT CMD...: bounded, or printed in a dry run
  if [[ $dry == 1 ]]; then shift; print_only "$@"; else bounded "$@"; fi
}
fb=("$flashlm" attention-bench --device cuda --quiet)
pyenv=(env "FLASHLM_LIBRARY=$build/src/libflashlm_attention.so" "PYTHONPATH=$root/python")

if has tests; then
  step tests "every GPU test binary"
  mkdir -p "$out/tests"
  [[ $dry == 1 ]] || printf '| test | exit | result |\n|---|---|---|\n' > "$out/tests.md"
  # gtest NAME LIMIT BINARY ARGS...: one run into tests/NAME.log and a row of tests.md.
  gtest() {
    local name=$1 limit=$2 exe=$3; shift 3
    if [[ $dry == 1 ]]; then print_only "$exe: ${FLASHLM_ATTENTION_KERNEL:+FLASHLM_ATTENTION_KERNEL=$FLASHLM_ATTENTION_KERNEL }${FLASHLM_SM90_FWD_D64_TILE:+FLASHLM_SM90_FWD_D64_TILE=$FLASHLM_SM90_FWD_D64_TILE }${FLASHLM_SM90_BWD_SCHEDULE:+FLASHLM_SM90_BWD_SCHEDULE=$FLASHLM_SM90_BWD_SCHEDULE }$*"; return; fi
    timeout $((limit * scale)) "$@" > "$out/tests/$name.log" 2>&1
    local rc=$? summary
    summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\]|[0-9]+ (passed|failed)|ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' \
      "$out/tests/$name.log" | grep -v '^\[  FAILED  \] [A-Z]' | tr '\n' ' ')
    echo "| $name | $rc$( ((rc == 124)) && echo ' (timed out)') | ${summary:-no summary: see tests/$name.log} |" \
      | tee -a "$out/tests.md"
    grep -E '^\[  FAILED  \] [A-Z]' "$out/tests/$name.log" | head -12
    ((rc == 0)) || failed+=("tests:$name")
  }
  t=$build/tests
  gtest sm90 60 test_sm90 "$t/test_sm90" --gtest_brief=1
  gtest attention 600 test_attention "$t/test_attention" --gtest_brief=1
  FLASHLM_ATTENTION_KERNEL=mma gtest attention-mma 300 test_attention "$t/test_attention" --gtest_brief=1 \
    --gtest_filter='*Cuda*:AttentionNaN*:*Varlen*'
  # The Hopper backward's persistent launch over the same GPU suites (the run above takes the default, grid).
  FLASHLM_SM90_BWD_SCHEDULE=persistent gtest attention-bwd-persistent 400 test_attention "$t/test_attention" \
    --gtest_brief=1 --gtest_filter='*Cuda*:AttentionNaN*:*Varlen*'
  gtest attention-repeat 300 test_attention "$t/test_attention" --gtest_brief=1 \
    --gtest_filter='Grid/CudaVsReference.*:CudaAttention.*' --gtest_repeat=2
  small='Grid/CudaVsReference.*q65_k2100_*:Grid/CudaVsReference.*q127_k64_*:Grid/CudaVsReference.*q17_k130_h4x2_d128*:Grid/CudaVsReference.*q129_k97_h4x2_d256*:CudaAttention.QueryTilesThatSeeNoKey*:CudaAttention.EmptySequencesGiveZeroGradients:Packs/VarlenCudaVsReference.*d128*'
  for tool in memcheck racecheck synccheck; do
    gtest "sanitizer-$tool" 180 "compute-sanitizer --tool $tool test_attention" compute-sanitizer --tool $tool \
      --error-exitcode 99 "$t/test_attention" --gtest_brief=1 --gtest_filter="$small"
  done
  # The Hopper backward's persistent launch (blocks walking several tiles: the q65_k2100 cases).
  for tool in racecheck synccheck; do
    FLASHLM_SM90_BWD_SCHEDULE=persistent gtest "sanitizer-$tool-bwd-persistent" 180 \
      "compute-sanitizer --tool $tool test_attention" compute-sanitizer --tool $tool --error-exitcode 99 \
      "$t/test_attention" --gtest_brief=1 --gtest_filter="$small"
  done
  # The d64 forward's other tiles are chosen only for long sequences: the small filter reaches them forced.
  for tile in 192x128 128x192; do
    FLASHLM_SM90_FWD_D64_TILE=$tile gtest "sanitizer-racecheck-d64-$tile" 180 "compute-sanitizer --tool racecheck test_attention" \
      compute-sanitizer --tool racecheck --error-exitcode 99 "$t/test_attention" --gtest_brief=1 --gtest_filter="$small"
  done
  gtest model-cuda 400 test_model_cuda "$t/test_model_cuda" --gtest_brief=1
  gtest gemm-cuda 200 test_gemm_cuda "$t/test_gemm_cuda" --gtest_brief=1
  gtest model 300 test_model "$t/test_model" --gtest_brief=1
  gtest optim 60 test_optim "$t/test_optim" --gtest_brief=1
  for bin in test_fsdp test_ddp test_dist; do
    FLASHLM_TEST_WORLD_SIZE=1 gtest "${bin#test_}-np1" 200 $bin "$t/$bin" --gtest_brief=1
    if ((gpus >= 2)); then
      FLASHLM_TEST_WORLD_SIZE=2 gtest "${bin#test_}-np2" 300 "mpirun -np 2 $bin" $mpirun -np 2 \
        -x FLASHLM_TEST_WORLD_SIZE "$t/$bin" --gtest_brief=1
    fi
  done
  if [[ $dry == 1 ]] || "$python" -c "import pytest, torch" 2>/dev/null; then
    gtest python 300 "pytest tests/python" env "FLASHLM_LIBRARY=$build/src/libflashlm_attention.so" \
      "FLASHLM_LM_IO=$build/tests/lm_io" "FLASHLM_CLI=$flashlm" "PYTHONPATH=$root/python" \
      "$python" -m pytest -q -p no:cacheprovider "$root/tests/python"
  else
    echo "| python | - | not run: $python has no pytest or torch |" | tee -a "$out/tests.md"
  fi
  if [[ $dry != 1 ]]; then
    tr=("$flashlm" train --device cuda --model tiny --vocab 256 --context 64 --batch 8 --cosine-steps 20
        --eval-every 0 --precision bf16)
    {
      timeout 60 "${tr[@]}" --steps 20 --checkpoint "$out/tests/full.ckpt" &&
        timeout 60 "${tr[@]}" --steps 10 --checkpoint "$out/tests/half.ckpt" &&
        timeout 60 "${tr[@]}" --steps 20 --checkpoint "$out/tests/half.ckpt" --resume
    } > "$out/tests/train-resume.log" 2>&1
    if cmp -s "$out/tests/full.ckpt" "$out/tests/half.ckpt"; then result="checkpoints identical"; rc=0
    else result="CHECKPOINTS DIFFER"; rc=1; failed+=("tests:train-resume"); fi
    echo "| train bf16 20 = 10 + resume + 10 | $rc | $result |" | tee -a "$out/tests.md"
    timeout 60 "${tr[@]}" --steps 30 --lr 10 --lr-min 10 --warmup 0 --clip 0 --checkpoint-every 1 \
      --checkpoint "$out/tests/nan.ckpt" \
      > "$out/tests/train-nan.log" 2>&1
    rc=$?
    if ((rc != 0)) && grep -q 'error' "$out/tests/train-nan.log"; then result="stopped: $(grep -m1 error "$out/tests/train-nan.log")"
    else result="NOT STOPPED (exit $rc)"; failed+=("tests:train-nan"); fi
    echo "| train with a NaN loss | $rc | $result |" | tee -a "$out/tests.md"
    rm -f "$out"/tests/*.ckpt
  fi
fi

# The tables that rerun_all.sh measures beside their peers (it has its own dry run on the CPU).
tables=()
for s in attention lm leaderboard; do has $s && tables+=("$s"); done
if has ddp && ((gpus >= 2 || dry == 1)); then tables+=(ddp); fi
if ((${#tables[@]})); then
  step tables "${tables[*]} beside the peers (scripts/peers/rerun_all.sh)"
  only=$(IFS=,; echo "${tables[*]}")
  ONLY=$only FLASHLM=$flashlm PYTHON=$python DRY_RUN=$dry bounded 3600 "$peers/rerun_all.sh" "$out/tables"
fi

if has gqa; then
  step gqa "causal GQA: b1, 64 query / 8 KV heads, seq 16384, d128, then SDPA from PyTorch"
  run_gpu 120 "${fb[@]}" --impl flash --dtype bf16 --batch 1 --heads 64 --kv-heads 8 --seq 16384 --d 128 \
    --causal=0,1 --warmup 3 --reps 10 --format csv --out "$out/gqa.csv"
  run_gpu 180 "${pyenv[@]}" "$python" "$here/torch_attention_bench.py" --shapes 1x64x16384x128x8 \
    --out "$out/gqa-torch.json"
fi
if has long; then
  step long "long context: b1 h32 d128 causal, 32k and 64k, beside SDPA"
  run_gpu 180 "${fb[@]}" --impl flash --dtype bf16 --batch 1 --heads 32 --seq 32768,65536 --d 128 --causal=1 \
    --warmup 2 --reps 5 --format csv --out "$out/long.csv"
  run_gpu 300 "$python" "$peers/long_context.py" --seqs 32768,65536 --out "$out/long-peers.json"
fi
if has fp8; then
  step fp8 "the FP8 forward beside the bf16 forward, fa grid"
  run_gpu 200 "${fb[@]}" --grid fa --impl flash --dtype fp8,bf16 --forward-only --warmup 10 --reps 30 \
    --format json --out "$out/fp8.json"
  [[ $dry == 1 ]] || "$python" "$here/fp8_bench_table.py" "$out/fp8.json" | tee "$out/fp8.md"
fi
if has d256; then
  step d256 "head dim 256 beside SDPA flash and cuDNN"
  run_gpu 200 "${fb[@]}" --impl flash --d 256 --heads 8 --batch 4 --seq 1024,4096,16384 --causal=0,1 --dtype bf16 \
    --warmup 10 --reps 30 --format json --out "$out/d256.json"
  run_gpu 300 "$python" "$peers/attention_peers.py" --shapes 4x8x1024x256,4x8x4096x256,4x8x16384x256 \
    --causal 0,1 --backends flash,cudnn --out "$out/d256-peers.json"
  [[ $dry == 1 ]] || "$python" "$peers/compare.py" attention "$out/d256.json" "$out/d256-peers.json" \
    --peer sdpa-flash --peer sdpa-cudnn | tee "$out/compare-d256.md"
fi
if has torch; then
  step torch "flashlm.attention from PyTorch: the fa grid and the small LM's shape, host time per call"
  run_gpu 400 "${pyenv[@]}" "$python" "$here/torch_attention_bench.py" --shapes 4x12x512x64 --grid fa \
    --varlen default --out "$out/torch-attention.json"
  run_gpu 200 "${pyenv[@]}" "$python" "$here/torch_op_overhead.py" --device cuda --out "$out/torch-op-overhead.json"
fi
if has fsdp; then
  step fsdp "FSDP and DDP at world 1 against the plain step: xl, context 512, batch 4"
  run_gpu 300 $mpirun -np 1 "$flashlm" ddp-bench --device cuda --model xl --context 512 --batch 4 \
    --ddp bucketed,fsdp --bucket-mb 100 --warmup 3 --steps 10 --format md --out "$out/fsdp-np1.md"
  [[ -s $out/fsdp-np1.md ]] && cat "$out/fsdp-np1.md"
fi
if has ddp && ((gpus >= 2)); then
  step ddp "DDP and ZeRO-1 on two GPUs: every variant, ZeRO-1 off and on"
  bounded 600 $mpirun -np 2 "$flashlm" ddp-bench --device cuda --zero 0,1 --format json --out "$out/ddp-np2.json"
fi
if has cpu; then
  step cpu "CPU attention beside torch's CPU SDPA; the CPU LM step beside eager"
  for t in 1 2; do
    clock=$( ((t == 1)) && echo thread || echo wall)
    OMP_NUM_THREADS=$t bounded 1800 "${pyenv[@]}" "$python" "$here/cpu_attention_bench.py" --reps 3 --clock $clock \
      > "$out/cpu-attention-$t-threads.md"
  done
  bounded 1800 "$python" "$peers/cpu_lm_peer.py" --flashlm "$flashlm" --size tiny --reps 3 --steps 5 > "$out/cpu-lm-tiny.md"
fi

if has ab; then
  step ab "A/B against ${BASELINE:-(BASELINE unset)}: attention tests, then the fa grid A, B, A, B"
  if [[ -z ${BASELINE:-} ]]; then
    echo "error: the ab step needs BASELINE, a directory holding the other build's libflashlm*.so" >&2
    failed+=(ab)
  else
    for v in A B A2 B2; do
      lib=$build/src; [[ $v == B* ]] && lib=$BASELINE
      if [[ $v == ? ]]; then
        LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-} run_gpu 600 "$build/tests/test_attention" --gtest_filter='*Cuda*' \
          --gtest_brief=1 > "$out/ab-tests-$v.log" 2>&1
        tail -1 "$out/ab-tests-$v.log"
      fi
      LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-} run_gpu 200 "${fb[@]}" --grid fa --dtype bf16 --impl flash --warmup 10 \
        --reps 30 --format json --out "$out/ab-fa-$v.json"
    done
  fi
fi

if has two-gpu && ((gpus >= 2 || dry == 1)); then
  # The leaderboard step on two GPUs: flashlm FSDP (train under mpirun -np 2, its per-step log read into a
  # record by scripts/peers/leaderboard.py) beside PyTorch FSDP2 under torchrun; ZeRO-1 and DDP, which the
  # memory plan refuses when they cannot fit; xl scaling at world 1 and 2 beside torch DDP and FSDP2; the
  # one-GPU step the two-GPU one is measured against. Peak memory per GPU from nvidia-smi.
  two=$out/two-gpu
  raw=$two/raw
  mkdir -p "$raw"
  torchrun="$python -m torch.distributed.run --standalone"
  if [[ $dry == 1 ]]; then
    dev=cpu
    lb_ours=(--device cpu --model tiny --context 64 --batch 1 --recompute blocks --steps 3)
    lb_vocab=10000 lb_precision=fp32 lb_context=64 lb_name=tiny
    lb_fsdp_precisions=(fp32)  # the CPU runs fp32 only
    lb_peers=(fp32)
    peer_args=(--device cpu --model tiny --context 64 --warmup 1 --steps 2)
    xl_ours=(--device cpu --model tiny --context 32 --batch 1 --ddp bucketed,fsdp --zero 0,1 --warmup 1 --steps 2)
    xl_ddp_peer=(--device cpu --model tiny --context 32 --batch 1 --worlds 1,2 --warmup 1 --steps 2)
    xl_fsdp_peer=(--device cpu --model tiny --context 32 --batch 1 --precision fp32 --no-checkpoint --warmup 1 --steps 2)
    one=(--device cpu --model tiny --context 64 --batch 2 --precision fp32 --recompute blocks --pass step --warmup 1
         --steps 2)
    lb_bench=(--device cpu --model tiny --context 64 --batch 1 --precision fp32 --recompute auto --ddp fsdp --warmup 1
              --steps 2)
  else
    dev=cuda
    # each of the two ranks half the host's cores: flashlm draws an 8B model's initial weights on the host
    export OMP_NUM_THREADS=$(($(nproc) / 2 > 0 ? $(nproc) / 2 : 1))
    lb_ours=(--device cuda --model cs336-8b --context 32768 --batch 1 --recompute auto --atomic-attention-backward
             --steps 3)
    lb_vocab=151936 lb_precision=bf16 lb_context=32768 lb_name=cs336-8b
    lb_fsdp_precisions=(bf16-pure bf16)  # the leaderboard's first, fp32 masters second
    lb_peers=(bf16-pure bf16)
    peer_args=(--device cuda --model cs336-8b --context 32768 --batch 1 --warmup 1 --steps 2 --timeout-s 120)
    xl_ours=(--device cuda --model xl --context 512 --batch 4 --ddp bucketed,fsdp --zero 0,1 --bucket-mb 100 --warmup 3
             --steps 10)
    xl_ddp_peer=(--device cuda --model xl --context 512 --batch 4 --bucket-mb 100 --worlds 1,2 --warmup 3 --steps 10)
    xl_fsdp_peer=(--device cuda --model xl --context 512 --batch 4 --precision bf16 --no-checkpoint --warmup 3 --steps 10)
    one=(--device cuda --model cs336-8b --context 32768 --batch 2 --precision bf16-pure --recompute auto --pass step
         --atomic-attention-backward --warmup 1 --steps 2)
    lb_bench=(--device cuda --model cs336-8b --context 32768 --batch 1 --precision bf16-pure --recompute auto
              --atomic-attention-backward --ddp fsdp --warmup 1 --steps 2)
  fi
  # GPU memory in use, sampled every 250 ms into FILE while the command after `sampled FILE` runs.
  sampled() {
    local file=$1; shift
    local pid=""
    if [[ $dry != 1 ]]; then
      nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 250 > "$file" 2>/dev/null &
      pid=$!
    fi
    "$@"
    local rc=$?
    [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    return $rc
  }
  # A run whose timed steps were logged is a measurement even if train failed after them (its end-of-run
  # evaluation gathers every weight on each rank); a ZeRO-1 or DDP run refused by the memory plan is an
  # answer, not a failure.
  ours_step() {  # name, precision, train options...
    local name=$1 precision=$2; shift 2
    local before=${#failed[@]}
    [[ -s $raw/tokens.bin ]] || "$python" "$peers/leaderboard.py" tokens --vocab $lb_vocab --count $((1 << 20)) \
      "$raw/tokens.bin"
    sampled "$raw/$name-gpu-memory.csv" bounded 300 $mpirun -np 2 "$flashlm" train "${lb_ours[@]}" \
      --precision $precision "$@" --vocab $lb_vocab --data "$raw/tokens.bin" --eval-batches 1 --log-every 1 \
      --log "$raw/$name.jsonl" > "$raw/$name.log" 2>&1
    grep -E "^memory plan|  total|^data parallel|^step |^error|^exit" "$raw/$name.log" | head -12
    if "$python" "$peers/leaderboard.py" record "$raw/$name.jsonl" --model $lb_name --context $lb_context \
      --batch-per-rank 1 --world 2 --precision $precision --variant "$name" --recompute auto --device $dev \
      --log "$raw/$name.log" --gpu-memory "$raw/$name-gpu-memory.csv" --out "$raw/ours-$name.json"; then
      if ((${#failed[@]} > before)); then
        unset 'failed[-1]'
        echo "note: train exited non-zero after its timed steps: $name.log says why"
      fi
    elif [[ $name != fsdp* ]] && grep -q "^error: .*memory plan: the model needs" "$raw/$name.log"; then
      ((${#failed[@]} > before)) && unset 'failed[-1]'
      echo "$name: refused by the memory plan (above)"
    elif ((${#failed[@]} == before)); then
      failed+=("$current")
    fi
  }
  for p in "${lb_fsdp_precisions[@]}"; do
    step "leaderboard-fsdp-$p" "the leaderboard step on 2 GPUs: flashlm --ddp fsdp, $p ($lb_name, 1 x $lb_context per rank)"
    ours_step "fsdp-$p" "$p" --ddp fsdp
  done
  for p in "${lb_peers[@]}"; do
    step "peer-fsdp2-$p" "the leaderboard step on 2 GPUs: PyTorch FSDP2, $p"
    bounded 300 $torchrun --nproc-per-node 2 "$peers/fsdp2_peer.py" "${peer_args[@]}" --precision "$p" \
      --out "$raw/peer-fsdp2-$p.json" > "$raw/peer-fsdp2-$p.log" 2>&1
    grep -E "torch-fsdp2|error|Error|oom|^exit" "$raw/peer-fsdp2-$p.log" | head -5
  done
  step leaderboard-zero1 "the leaderboard step on 2 GPUs: flashlm ZeRO-1 (the memory plan refuses it when it cannot fit)"
  ours_step zero1 $lb_precision --ddp bucketed --zero 1
  step leaderboard-ddp "the leaderboard step on 2 GPUs: flashlm DDP (the memory plan refuses it when it cannot fit)"
  ours_step ddp $lb_precision --ddp bucketed
  for np in 1 2; do
    step "xl-ours-np$np" "flashlm ddp-bench --ddp bucketed,fsdp --zero 0,1 at world $np"
    bounded 300 $mpirun -np $np "$flashlm" ddp-bench "${xl_ours[@]}" --format json --out "$raw/xl-ours-np$np.json" \
      > "$raw/xl-ours-np$np.log" 2>&1
    grep -E "median|error|^exit" "$raw/xl-ours-np$np.log" | head -10
  done
  step xl-ddp-peers "PyTorch DDP at world 1 and 2 (scripts/peers/ddp_peers.py)"
  bounded 300 "$python" "$peers/ddp_peers.py" "${xl_ddp_peer[@]}" --out "$raw/xl-peer-ddp.json" \
    > "$raw/xl-peer-ddp.log" 2>&1
  grep -E "torch-ddp|error|^exit" "$raw/xl-peer-ddp.log" | head -4
  for w in 1 2; do
    step "xl-fsdp2-w$w" "PyTorch FSDP2 at world $w"
    bounded 300 $torchrun --nproc-per-node $w "$peers/fsdp2_peer.py" "${xl_fsdp_peer[@]}" \
      --out "$raw/xl-peer-fsdp2-w$w.json" > "$raw/xl-peer-fsdp2-w$w.log" 2>&1
    grep -E "torch-fsdp2|error|^exit" "$raw/xl-peer-fsdp2-w$w.log" | head -3
  done
  step one-gpu "the leaderboard step on one GPU (flashlm bench), the two-GPU step's reference"
  CUDA_VISIBLE_DEVICES=0 bounded 300 "$flashlm" bench "${one[@]}" --format json --out "$raw/one-gpu.json" \
    > "$raw/one-gpu.log" 2>&1
  grep -E "^\|" "$raw/one-gpu.log" | head -4
  # ddp-bench times the step against the plain one-GPU step at one sequence (or says "not timed" with the
  # plan's shortfall), with the exposed communication and the memory per rank.
  step lb-ddp-bench "the leaderboard step through flashlm ddp-bench --ddp fsdp at world 2"
  bounded 400 $mpirun -np 2 "$flashlm" ddp-bench "${lb_bench[@]}" --format json --out "$raw/lb-ddp-bench.json" \
    > "$raw/lb-ddp-bench.log" 2>&1
  grep -E "median|not timed|error|^exit" "$raw/lb-ddp-bench.log" | head -6
  rm -f "$raw/tokens.bin"  # random ids, remade in a second

  step two-gpu-tables "two-gpu/summary.md"
  # files: the comma list of the given reports that exist (a failed step left none).
  files() { local f=() p; for p in "$@"; do [[ -s $p ]] && f+=("$p"); done; local IFS=,; echo "${f[*]}"; }
  # table TITLE KIND OURS PEERS ARGS...: compare.py's table of OURS against PEERS, or why there is none.
  table() {
    echo
    echo "## $1 (peer time / ours)"
    if [[ -z $3 || -z $4 ]]; then echo "(no records: the step failed)"; return; fi
    "$python" "$peers/compare.py" "$2" "$3" "$4" "${@:5}" 2>&1
  }
  {
    echo "# Two GPUs ($(date -u +%F), $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?'))"
    echo
    echo "## The leaderboard step (every flashlm and peer record of it)"
    reports=$(files "$raw"/ours-*.json "$raw"/peer-fsdp2-*.json "$raw/one-gpu.json")
    if [[ -n $reports ]]; then "$python" "$peers/leaderboard.py" summary ${reports//,/ } 2>&1; else echo "(none)"; fi
    table "The leaderboard step: flashlm FSDP against PyTorch FSDP2, same precision" lm \
      "$(files "$raw"/ours-fsdp-*.json)" "$(files "$raw"/peer-fsdp2-*.json)" --peer torch-fsdp2
    table "xl, ctx 512: DDP bucketed against PyTorch DDP" ddp "$(files "$raw"/xl-ours-np*.json)" \
      "$(files "$raw/xl-peer-ddp.json")" --ours bucketed --peer torch-ddp
    table "xl, ctx 512: FSDP against PyTorch FSDP2" ddp "$(files "$raw"/xl-ours-np*.json)" \
      "$(files "$raw"/xl-peer-fsdp2-w*.json)" --ours fsdp --peer torch-fsdp2
    echo
    echo "## xl, ctx 512: flashlm ddp-bench at world 1, then 2"
    for f in "$raw"/xl-ours-np*.log; do [[ -s $f ]] && grep -E "^\|" "$f"; done
  } > "$two/summary.md"
  cat "$two/summary.md"
fi

[[ -s $out/tests.md ]] && { echo; echo "## GPU tests"; cat "$out/tests.md"; }
step finish "$((${#failed[@]})) step(s) failed${failed[*]:+: ${failed[*]}}"
((${#failed[@]} == 0))
