#!/usr/bin/env bash
# Re-runs docs/perf.md's fa grid, LM step, leaderboard and DDP ratios (scripts/gpu-check.sh runs it beside
# the other tables): flashlm's benchmark and the PyTorch peer beside it in one session,
# then scripts/peers/compare.py on the two JSON files. On the GPU machine (PyTorch with CUDA, triton not
# needed):
#   LD_LIBRARY_PATH=... scripts/peers/rerun_all.sh OUT_DIR            # everything (an hour or so on one H200)
#   ONLY=attention,lm scripts/peers/rerun_all.sh OUT_DIR             # a subset: attention, window, lm, leaderboard, ddp
#   DRY_RUN=1 scripts/peers/rerun_all.sh OUT_DIR                     # CPU, tiny shapes: what CI runs
# FLASHLM (default build/tools/flashlm) is our binary, PYTHON (default python3) the one with torch, MPIRUN
# (default "mpirun --allow-run-as-root --bind-to none") starts the 2-rank runs. The tables go to stdout and
# OUT_DIR/compare-*.md, the raw records to OUT_DIR/*.json.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: rerun_all.sh OUT_DIR}
mkdir -p "$out"
flashlm=${FLASHLM:-$here/../../build/tools/flashlm}
python=${PYTHON:-python3}
mpirun=${MPIRUN:-mpirun --allow-run-as-root --bind-to none}
only=${ONLY:-attention,window,lm,leaderboard,ddp}
peers=$here
want() { [[ ",$only," == *",$1,"* ]]; }
compare() {  # kind, ours, peers, args...: the table to stdout and to OUT/compare-<name>.md
  local kind=$1 name=$2; shift 2
  echo "== $name"
  "$python" "$peers/compare.py" "$kind" "$@" | tee "$out/compare-$name.md"
}

if [[ ${DRY_RUN:-0} == 1 ]]; then
  dev=cpu
  attention_ours=(--impl flash --seq 64,96 --d 16 --heads 2 --causal=0,1 --dtype fp32 --warmup 1 --reps 2)
  attention_peer=(--shapes 1x2x64x16,1x2x96x16 --backends math --dtype fp32 --warmup 1 --reps 2)
  attention_cols=(--peer sdpa-math)
  # The sliding window and soft-capping against FlexAttention (forward only: it has no CPU backward).
  window_ours=(--impl flash --seq 64,96 --d 16 --heads 2 --causal=1 --window 16,0 --dtype fp32 --warmup 1 --reps 2)
  window_peer=(--shapes 1x2x64x16,1x2x96x16 --causal 1 --window 16,0 --dtype fp32 --warmup 1 --reps 2 --no-compile)
  softcap_ours=(--impl flash --seq 64 --d 32 --heads 2 --causal=1 --softcap 5 --dtype fp32 --warmup 1 --reps 2)
  softcap_peer=(--shapes 1x2x64x32 --causal 1 --softcap 5 --dtype fp32 --warmup 1 --reps 2 --no-compile)
  lm_ours=(--model tiny --context 32 --batch 2 --precision fp32 --warmup 1 --steps 2)
  lm_peer=(--models tiny --context 32 --batch 2 --modes fp32,fp32-compile --passes step --warmup 1 --steps 2)
  leaderboard_ours=(--model tiny --context 64 --batch 1 --precision fp32 --recompute blocks --pass step --warmup 1 --steps 1)
  leaderboard_peer=(--models tiny --context 64 --batch 1 --modes fp32 --checkpoint --passes step --warmup 1 --steps 1)
  ddp_ours=(--model tiny --context 32 --batch 1 --ddp bucketed --bucket-mb 25 --precision fp32 --warmup 1 --steps 2)
  ddp_peer=(--model tiny --context 32 --batch 1 --bucket-mb 25 --worlds 1,2 --warmup 1 --steps 2)
  [[ " $mpirun " == *" --oversubscribe "* ]] || mpirun="$mpirun --oversubscribe"  # 2 ranks on a small machine
else
  dev=cuda
  attention_ours=(--grid fa --impl flash --dtype bf16 --warmup 5 --reps 20)
  attention_peer=(--grid fa --backends flash,cudnn --dtype bf16 --warmup 5 --reps 20)
  attention_cols=(--peer sdpa-flash --peer sdpa-cudnn --min-seq 1024)
  # Issue 31: a 4096-key sliding window at 32k (b1, h32, d128, causal; the full causal row is the attention
  # grid's neighbour: attention-bench --seq 32768 without --window), soft-capping at d256, 8k.
  window_ours=(--impl flash --batch 1 --heads 32 --seq 32768 --d 128 --causal=1 --window 4096,0 --dtype bf16 --warmup 3 --reps 10)
  window_peer=(--shapes 1x32x32768x128 --causal 1 --window 4096,0 --dtype bf16 --warmup 3 --reps 10)
  softcap_ours=(--impl flash --batch 1 --heads 16 --seq 8192 --d 256 --causal=1 --softcap 50 --dtype bf16 --warmup 3 --reps 10)
  softcap_peer=(--shapes 1x16x8192x256 --causal 1 --softcap 50 --dtype bf16 --warmup 3 --reps 10)
  lm_ours=(--model small,xl --context 512 --batch 4 --precision bf16 --warmup 5 --steps 10)
  lm_peer=(--models small,xl --context 512 --batch 4 --modes bf16,bf16-compile --warmup 5 --steps 10)
  leaderboard_ours=(--model cs336-8b --context 32768 --batch 2 --precision bf16-pure --recompute auto --pass step
                    --atomic-attention-backward --warmup 1 --steps 2)
  leaderboard_peer=(--models cs336-8b --context 32768 --batch 2 --modes bf16-pure --checkpoint --passes step
                    --warmup 1 --steps 2)
  ddp_ours=(--model xl --context 512 --batch 4 --ddp bucketed --bucket-mb 25 --precision bf16 --warmup 3 --steps 8)
  ddp_peer=(--model xl --context 512 --batch 4 --bucket-mb 25 --worlds 1,2 --warmup 3 --steps 8)
fi

if want attention; then
  "$flashlm" attention-bench --device $dev "${attention_ours[@]}" --quiet --format json --out "$out/ours-attention.json" >/dev/null
  "$python" "$peers/attention_peers.py" --device $dev "${attention_peer[@]}" --out "$out/peers-attention.json" >/dev/null
  compare attention attention "$out/ours-attention.json" "$out/peers-attention.json" "${attention_cols[@]}"
fi
if want window; then
  for kind in window softcap; do
    ours_args="${kind}_ours[@]" peer_args="${kind}_peer[@]"
    "$flashlm" attention-bench --device $dev "${!ours_args}" --quiet --format json --out "$out/ours-$kind.json" >/dev/null
    "$python" "$peers/flex_attention_peer.py" --device $dev "${!peer_args}" --out "$out/peers-$kind.json" >/dev/null
    compare attention "$kind" "$out/ours-$kind.json" "$out/peers-$kind.json" --peer flex
  done
fi
if want lm; then
  "$flashlm" bench --device $dev "${lm_ours[@]}" --quiet --format json --out "$out/ours-lm.json" >/dev/null
  "$python" "$peers/lm_peers.py" --device $dev "${lm_peer[@]}" --out "$out/peers-lm.json" >/dev/null
  compare lm lm "$out/ours-lm.json" "$out/peers-lm.json" --peer torch-eager --peer torch-compile
fi
if want leaderboard; then
  "$flashlm" bench --device $dev "${leaderboard_ours[@]}" --quiet --format json --out "$out/ours-leaderboard.json" >/dev/null
  "$python" "$peers/lm_peers.py" --device $dev "${leaderboard_peer[@]}" --out "$out/peers-leaderboard.json" >/dev/null
  compare lm leaderboard "$out/ours-leaderboard.json" "$out/peers-leaderboard.json" --peer torch-eager
fi
if want ddp; then
  $mpirun -np 2 "$flashlm" ddp-bench --device $dev "${ddp_ours[@]}" --quiet --format json --out "$out/ours-ddp.json" >/dev/null
  "$python" "$peers/ddp_peers.py" --device $dev "${ddp_peer[@]}" --out "$out/peers-ddp.json" >/dev/null
  compare ddp ddp "$out/ours-ddp.json" "$out/peers-ddp.json" --peer torch-ddp
fi
