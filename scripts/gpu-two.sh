#!/usr/bin/env bash
# Issue 19 in one run on a host with two H200s: the FSDP/DDP tests under mpirun
# -np 2, the CS336 leaderboard step on two GPUs beside PyTorch FSDP2, xl scaling beside PyTorch DDP/FSDP2,
# and the comparison tables.
#   scripts/gpu-two.sh BIN_DIR OUT_DIR [tests leaderboard peer xl one lbbench]
#                                           (default: the first five, in that order; lbbench only when named)
#   DRY_RUN=1 FLASHLM=build/tools/flashlm PYTHON=venv/bin/python scripts/gpu-two.sh - OUT_DIR   # CPU, CI
# BIN_DIR holds flashlm, test_dist, test_ddp, test_fsdp and libflashlm.so from a build for the H200
# (-DCMAKE_CUDA_ARCHITECTURES=90a -DFLASHLM_NATIVE=OFF; README "Two GPUs" says how to carry them). The
# PyTorch peers are this checkout's scripts/peers/. Tables go to OUT_DIR/summary.md and stdout; every log and
# JSON into OUT_DIR/two-gpu.tar.gz (a device call returns at most 8 files).
#   DEADLINE=S   seconds the whole script may take (default 560, inside the device's 600 s per command): a
#                step whose estimate no longer fits is skipped and named at the end; every command's timeout
#                ends at the deadline.
#   DRY_RUN=1    the same steps on the CPU with the tiny model (gloo and MPI, --oversubscribe): every command
#                that needs no GPU runs, the GPU test binaries are only printed; nothing is packed.
# All five steps take about 10 minutes; with the default deadline the last ones may be skipped (the end
# says which): a second call then runs those alone, e.g. `scripts/gpu-two.sh BIN_DIR OUT_DIR xl one`.
# Steps:
#   tests        test_dist, test_ddp and test_fsdp whole under mpirun -np 2 (their GPU tests: NCCL
#                collectives, every DDP variant and ZeRO-1 on GPUs, FSDP sharded storage on two ranks).
#   leaderboard  cs336-8b, one sequence of 32768 tokens per rank, --recompute auto: flashlm FSDP
#                (`mpirun -np 2 flashlm train --ddp fsdp`) in --precision bf16-pure (the leaderboard's: bf16
#                shards, no fp32 masters), then in bf16 (fp32 masters) as the second row, then ZeRO-1 and DDP
#                in bf16 (they keep no bf16-pure path: train refuses it naming FSDP), which the memory plan
#                refuses with the shortfall named unless they fit (its figures for bf16: FSDP 105 GiB, ZeRO-1
#                132, DDP 153). Peak memory per GPU from nvidia-smi.
#   peer         scripts/peers/fsdp2_peer.py under torchrun on both GPUs: bf16-pure (the leaderboard's) and
#                bf16 (fp32 masters, flashlm's precision here).
#   xl           ddp-bench --ddp bucketed,fsdp --zero 0,1 (xl, ctx 512, batch 4 per rank) at world 1 and 2,
#                scripts/peers/ddp_peers.py --worlds 1,2 and fsdp2_peer.py (xl, bf16, no checkpointing) at 1, 2.
#   one          the one-GPU leaderboard step (flashlm bench, bf16-pure, batch 2), for the 0.55x bar.
#   lbbench      (only when named) the leaderboard step through `flashlm ddp-bench --ddp fsdp` at world 2,
#                bf16-pure: its step time beside the plain one-GPU step at one sequence (or "not timed" with
#                the plan's shortfall), exposed communication and memory per rank.
set -uo pipefail
bin=${1:?usage: gpu-two.sh BIN_DIR OUT_DIR [steps]} out=${2:?usage: gpu-two.sh BIN_DIR OUT_DIR [steps]}
shift 2
what=" ${*:-tests leaderboard peer xl one} "
has() { [[ $what == *" $1 "* ]]; }
here=$(cd "$(dirname "$0")" && pwd)
peers=$here/peers
dry=${DRY_RUN:-0}
deadline=${DEADLINE:-560}
mkdir -p "$out/raw"
raw=$out/raw
flashlm=${FLASHLM:-$bin/flashlm}
python=${PYTHON:-python3}
torchrun="$python -m torch.distributed.run --standalone"
# NVLink multicast stays off on the shared hosts (.library/device/KINDS.md), in every process we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mpirun="mpirun --allow-run-as-root --bind-to none -x LD_LIBRARY_PATH -x OMP_NUM_THREADS -x NCCL_NVLS_ENABLE
  -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS"

if [[ $dry == 1 ]]; then
  dev=cpu
  export OMP_NUM_THREADS=1
  mpirun="$mpirun --oversubscribe"
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
  nccl=$("$python" -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
  export LD_LIBRARY_PATH=$bin:${nccl}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
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
  nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader
  "$python" -c "import torch; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count())"
  "$flashlm" info | head -5
fi

skipped=() failed=()
left() { echo $((deadline - SECONDS)); }
# fits EST NAME: whether EST more seconds fit before the deadline (else NAME is skipped, and said so).
fits() {
  if (($(left) >= $1)); then return 0; fi
  echo "-- skipped: $2 needs about $1 s, $(left) s are left"
  skipped+=("$2")
  return 1
}
# bounded LIMIT CMD...: CMD under a timeout of LIMIT seconds or what is left before the deadline; prints its
# exit status, and a failure names the current step in the list the script ends with.
bounded() {
  local limit=$1; shift
  local l; l=$(left)
  ((l < limit)) && limit=$l
  ((limit < 1)) && limit=1
  timeout "$limit" "$@"
  local rc=$?
  echo "exit $rc$( ((rc == 124)) && echo ' (timed out)')"
  ((rc == 0)) || failed+=("$current")
  return $rc
}
current=""
step() {  # NAME DESCRIPTION
  current=$1
  echo "== [$SECONDS s] $1: $2"
}
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

if has tests; then
  step tests "test_dist, test_ddp, test_fsdp under mpirun -np 2"
  for t in test_dist test_ddp test_fsdp; do
    if [[ $dry == 1 ]]; then
      echo "would run: FLASHLM_TEST_WORLD_SIZE=2 $mpirun -np 2 -x FLASHLM_TEST_WORLD_SIZE $bin/$t --gtest_brief=1"
      continue
    fi
    fits 20 "$t" || continue
    FLASHLM_TEST_WORLD_SIZE=2 bounded 150 $mpirun -np 2 -x FLASHLM_TEST_WORLD_SIZE "$bin/$t" --gtest_brief=1 \
      > "$raw/$t-np2.log" 2>&1
    tail -1 "$raw/$t-np2.log"
    grep -E "^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \]|Failure$" "$raw/$t-np2.log" | sort | uniq -c | head -20
  done
fi

# flashlm's leaderboard step under mpirun -np 2 as train runs it (train's own timing per step, --log-every 1),
# then its metrics log as a record (scripts/peers/leaderboard.py). A run whose timed steps were logged is a
# measurement even if train failed after them (its end-of-run evaluation gathers every weight on each rank);
# a ZeRO-1 or DDP run refused by the memory plan is an answer, not a failure.
ours_step() {  # name, precision, train options...
  local name=$1 precision=$2; shift 2
  local before=${#failed[@]}
  [[ -s $raw/tokens.bin ]] || "$python" "$peers/leaderboard.py" tokens --vocab $lb_vocab --count $((1 << 20)) \
    "$raw/tokens.bin"
  sampled "$raw/$name-gpu-memory.csv" bounded 150 $mpirun -np 2 "$flashlm" train "${lb_ours[@]}" --precision $precision "$@" \
    --vocab $lb_vocab --data "$raw/tokens.bin" --eval-batches 1 --log-every 1 --log "$raw/$name.jsonl" \
    > "$raw/$name.log" 2>&1
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
if has leaderboard; then
  for p in "${lb_fsdp_precisions[@]}"; do
    fits 90 "leaderboard (flashlm fsdp $p)" || continue
    step "leaderboard-fsdp-$p" "the leaderboard step on 2 GPUs: flashlm --ddp fsdp, $p ($lb_name, 1 x $lb_context per rank)"
    ours_step "fsdp-$p" "$p" --ddp fsdp
  done
fi
if has peer; then
  for p in "${lb_peers[@]}"; do
    fits 75 "peer fsdp2 $p" || continue
    step "peer-fsdp2-$p" "the leaderboard step on 2 GPUs: PyTorch FSDP2, $p"
    bounded 180 $torchrun --nproc-per-node 2 "$peers/fsdp2_peer.py" "${peer_args[@]}" --precision "$p" \
      --out "$raw/peer-fsdp2-$p.json" > "$raw/peer-fsdp2-$p.log" 2>&1
    grep -E "torch-fsdp2|error|Error|oom|^exit" "$raw/peer-fsdp2-$p.log" | head -5
  done
fi
if has leaderboard; then
  for v in zero1 ddp; do
    fits 60 "leaderboard (flashlm $v)" || continue
    step "leaderboard-$v" "the leaderboard step on 2 GPUs: flashlm $v (the memory plan refuses it when it cannot fit)"
    if [[ $v == zero1 ]]; then ours_step zero1 $lb_precision --ddp bucketed --zero 1
    else ours_step ddp $lb_precision --ddp bucketed; fi
  done
fi

if has xl; then
  for np in 1 2; do
    fits 45 "xl ddp-bench np $np" || continue
    step "xl-ours-np$np" "flashlm ddp-bench --ddp bucketed,fsdp --zero 0,1 at world $np"
    bounded 120 $mpirun -np $np "$flashlm" ddp-bench "${xl_ours[@]}" --format json --out "$raw/xl-ours-np$np.json" \
      > "$raw/xl-ours-np$np.log" 2>&1
    grep -E "median|error|^exit" "$raw/xl-ours-np$np.log" | head -10
  done
  if fits 90 "xl ddp_peers"; then
    step xl-ddp-peers "PyTorch DDP at world 1 and 2 (scripts/peers/ddp_peers.py)"
    bounded 150 "$python" "$peers/ddp_peers.py" "${xl_ddp_peer[@]}" --out "$raw/xl-peer-ddp.json" \
      > "$raw/xl-peer-ddp.log" 2>&1
    grep -E "torch-ddp|error|^exit" "$raw/xl-peer-ddp.log" | head -4
  fi
  for w in 1 2; do
    fits 45 "xl fsdp2 world $w" || continue
    step "xl-fsdp2-w$w" "PyTorch FSDP2 at world $w"
    bounded 90 $torchrun --nproc-per-node $w "$peers/fsdp2_peer.py" "${xl_fsdp_peer[@]}" \
      --out "$raw/xl-peer-fsdp2-w$w.json" > "$raw/xl-peer-fsdp2-w$w.log" 2>&1
    grep -E "torch-fsdp2|error|^exit" "$raw/xl-peer-fsdp2-w$w.log" | head -3
  done
fi

if has one && fits 60 "one-GPU leaderboard step"; then
  step one-gpu "the leaderboard step on one GPU (flashlm bench, bf16-pure, batch 2), for the two-GPU bar"
  CUDA_VISIBLE_DEVICES=0 bounded 150 "$flashlm" bench "${one[@]}" --format json --out "$raw/one-gpu.json" \
    > "$raw/one-gpu.log" 2>&1
  grep -E "^\|" "$raw/one-gpu.log" | head -4
fi

if has lbbench && fits 120 "leaderboard ddp-bench"; then
  step lb-ddp-bench "the leaderboard step through flashlm ddp-bench --ddp fsdp at world 2 (bf16-pure)"
  bounded 240 $mpirun -np 2 "$flashlm" ddp-bench "${lb_bench[@]}" --format json --out "$raw/lb-ddp-bench.json" \
    > "$raw/lb-ddp-bench.log" 2>&1
  grep -E "median|not timed|error|^exit" "$raw/lb-ddp-bench.log" | head -6
fi

step tables "summary.md"
# files: the comma list of the given reports that exist (a skipped or failed step left none).
files() { local f=() p; for p in "$@"; do [[ -s $p ]] && f+=("$p"); done; local IFS=,; echo "${f[*]}"; }
# table TITLE KIND OURS PEERS ARGS...: compare.py's table of OURS against PEERS, or why there is none.
table() {
  echo
  echo "## $1 (peer time / ours)"
  if [[ -z $3 || -z $4 ]]; then echo "(no records: skipped or failed)"; return; fi
  "$python" "$peers/compare.py" "$2" "$3" "$4" "${@:5}" 2>&1
}
{
  echo "# Issue 19 on two GPUs ($(date -u +%F), $(git -C "$here/.." rev-parse --short HEAD 2>/dev/null || echo '?'))"
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
  ((${#skipped[@]})) && echo && echo "skipped at the deadline: ${skipped[*]}"
} > "$out/summary.md"
cat "$out/summary.md"
if [[ $dry != 1 ]]; then
  rm -f "$raw/tokens.bin"  # random ids, 4 MB: remade in a second
  tar -C "$out" -czf "$out/two-gpu.tar.gz" raw && rm -rf "$raw"
fi
step finish "$((${#failed[@]})) step(s) failed${failed[*]:+: ${failed[*]}}"
((${#failed[@]} == 0))
