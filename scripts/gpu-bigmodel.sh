#!/usr/bin/env bash
# On one H200: the big-model measurements of docs/perf.md ("Big models on one GPU") beside the PyTorch
# peers, in one call of about five minutes.
#   scripts/gpu-bigmodel.sh BIN_DIR PEERS_DIR OUT_DIR
# BIN_DIR holds flashlm and libflashlm.so (a build with -DFLASHLM_NATIVE=OFF); PEERS_DIR holds
# leaderboard_peer.py (the CS336 2026 leaderboard step in PyTorch). Logs and JSON go to OUT_DIR.
#   1. the leaderboard step: cs336-8b, batch 2 x context 32768, pure bf16, --recompute auto, with the range
#      split, then the PyTorch peer;
#   2. xl with recomputation at context 4096 and 16384 (batch 2, bf16 with fp32 masters) beside
#      scripts/peers/lm_peers.py --checkpoint (every block under torch.utils.checkpoint);
#   3. the xl and small step at context 512, batch 4 (the SPEC §4 step; PyTorch's side: lm_peers.py).
set -uo pipefail
bin=$1 peers=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=$bin:${nccl}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
t0=$SECONDS
step() { echo "== [$((SECONDS - t0)) s] $*"; }

step "leaderboard step: flashlm (cs336-8b, 2 x 32768, bf16-pure, recompute auto, range split)"
timeout 180 "$bin/flashlm" bench --device cuda --model cs336-8b --context 32768 --batch 2 --precision bf16-pure \
  --pass step --recompute auto --atomic-attention-backward --warmup 1 --steps 2 --profile-ranges \
  --format json --out "$out/leaderboard-ours.json" > "$out/leaderboard-ours.log" 2>&1
echo "exit $?"; grep -E "plan|peak|step|ms" "$out/leaderboard-ours.log" | head -30
step "leaderboard step: PyTorch peer"
timeout 180 python3 "$peers/leaderboard_peer.py" --steps 2 --warmup 1 --out "$out/leaderboard-peer.json" > "$out/leaderboard-peer.log" 2>&1
echo "exit $?"; tail -8 "$out/leaderboard-peer.log"

for ctx in 4096 16384; do
  step "xl, context $ctx, batch 2, bf16: flashlm --recompute selective and blocks:1"
  for rc in selective blocks:1; do
    timeout 90 "$bin/flashlm" bench --device cuda --model xl --context $ctx --batch 2 --precision bf16 \
      --pass step --recompute $rc --warmup 2 --steps 3 --format json \
      --out "$out/xl-$ctx-${rc/:/-}.json" > "$out/xl-$ctx-${rc/:/-}.log" 2>&1
    echo "$rc: exit $?"; grep -E "step|peak" "$out/xl-$ctx-${rc/:/-}.log" | tail -4
  done
  step "xl, context $ctx: PyTorch with every block checkpointed"
  timeout 120 python3 "$here/peers/lm_peers.py" --models xl --context $ctx --batch 2 --modes bf16 --checkpoint \
    --passes step --warmup 2 --steps 3 --out "$out/xl-$ctx-torch.json" > "$out/xl-$ctx-torch.log" 2>&1
  echo "exit $?"; tail -4 "$out/xl-$ctx-torch.log"
done
step "the xl and small train step (context 512, batch 4, bf16 with fp32 masters)"
timeout 90 "$bin/flashlm" bench --device cuda --model small,xl --context 512 --batch 4 --precision bf16 --pass step \
  --warmup 5 --steps 20 --format json --out "$out/step-512.json" > "$out/step-512.log" 2>&1
echo "exit $?"; grep -E "^\|" "$out/step-512.log" | head -8
if [[ ${FLASHLM_PEERS_COMPILE:-1} == 1 ]]; then
  step "the same step in PyTorch, eager bf16 and torch.compile"
  timeout 240 python3 "$here/peers/lm_peers.py" --models small,xl --modes bf16,bf16-compile --passes step \
    --out "$out/step-512-torch.json" > "$out/step-512-torch.log" 2>&1
  echo "exit $?"; tail -6 "$out/step-512-torch.log"
fi
step "done"
