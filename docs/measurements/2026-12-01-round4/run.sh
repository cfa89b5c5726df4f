#!/usr/bin/env bash
# The merged main on one H200: every GPU test (forced d64 tiles under the sanitizers), the fa grid beside
# the peers, the xl/small step, bf16-pure FSDP at world 1, the mma.sync fallback, the 8B step through ddp-bench.
set -uo pipefail
B=$PWD/.device/final P=$B/peers O=/tmp/fin
mkdir -p $O
t0=$SECONDS
left() { echo $((${DEADLINE:-575} - (SECONDS - t0))); }
GPU_ROUND_REPEAT=1 GPU_ROUND_FALLBACK=0 bash scripts/gpu-round.sh $B $P $O/round tests fa
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))")
export LD_LIBRARY_PATH=$B:$nccl:/usr/local/cuda/lib64
mp="mpirun --allow-run-as-root --bind-to none -np 1 -x LD_LIBRARY_PATH"
echo "== [$((SECONDS - t0)) s] xl and small step, left $(left)"
if (( $(left) > 40 )); then
  timeout 80 $B/flashlm bench --device cuda --model small,xl --context 512 --batch 4 --precision bf16 --pass step \
    --warmup 5 --steps 20 --format json --out $O/step.json > $O/step.log 2>&1; echo "exit $?"; grep -E "^\|" $O/step.log
fi
echo "== [$((SECONDS - t0)) s] bf16-pure: one process vs FSDP at np 1, sharded resume, left $(left)"
if (( $(left) > 60 )); then
  tr="$B/flashlm train --device cuda --model small --context 256 --batch 4 --log-every 5 --precision bf16-pure --eval-every 0"
  timeout 60 $tr --steps 20 > $O/pure-one.log 2>&1; echo "one process exit $?"; grep -iE "step +(5|10|15|20)\b|loss" $O/pure-one.log | tail -4
  timeout 60 $mp $tr --steps 20 --ddp fsdp --checkpoint $O/p.ckpt --sharded-checkpoint > $O/pure-fsdp.log 2>&1; echo "fsdp np1 exit $?"; grep -iE "loss" $O/pure-fsdp.log | tail -4
  timeout 60 $mp $tr --steps 30 --ddp fsdp --checkpoint $O/p.ckpt --sharded-checkpoint --resume > $O/pure-resume.log 2>&1; echo "resume exit $?"; grep -iE "loss" $O/pure-resume.log | tail -3
fi
echo "== [$((SECONDS - t0)) s] mma.sync fallback (grid, varlen), left $(left)"
if (( $(left) > 100 )); then
  FLASHLM_ATTENTION_KERNEL=mma timeout 90 $B/test_attention --gtest_brief=1 --gtest_filter='Grid/CudaVsReference.*:*Varlen*' > $O/mma.log 2>&1
  echo "exit $?; $(grep -E '^\[  PASSED' $O/mma.log)"; grep -E "^\[  FAILED" $O/mma.log | head
fi
echo "== [$((SECONDS - t0)) s] 8B step through ddp-bench, bf16-pure FSDP at np 1, left $(left)"
if (( $(left) > 90 )); then
  timeout $(( $(left) - 15 )) $mp $B/flashlm ddp-bench --device cuda --model cs336-8b --context 32768 --batch 1 --ddp fsdp \
    --precision bf16-pure --recompute auto --atomic-attention-backward --warmup 1 --steps 2 --format md --out $O/lb-np1.md \
    > $O/lb-np1.log 2>&1; echo "exit $?"; cat $O/lb-np1.md 2>/dev/null; tail -4 $O/lb-np1.log
fi
echo "== [$((SECONDS - t0)) s] done"
tar czf ${OUT:-/tmp}/final.tgz -C /tmp fin; ls -la ${OUT:-/tmp}
