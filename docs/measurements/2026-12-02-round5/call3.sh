#!/usr/bin/env bash
# Call 3: bf16-pure training one process vs FSDP at np 1 with a sharded checkpoint and resume; the 8B step
# through ddp-bench (bf16-pure FSDP at np 1); the d256 benchmark beside SDPA.
O=/tmp/c3; mkdir -p $O; source .device/s10/common.sh
step "bf16-pure: one process vs FSDP at np 1, sharded resume"
tr="$B/flashlm train --device cuda --model small --context 256 --batch 4 --log-every 5 --precision bf16-pure --eval-every 0"
timeout 60 $tr --steps 20 > $O/pure-one.log 2>&1; echo "one process exit $?"; grep -iE "loss" $O/pure-one.log | tail -4
timeout 60 $mp $tr --steps 20 --ddp fsdp --checkpoint $O/p.ckpt --sharded-checkpoint > $O/pure-fsdp.log 2>&1; echo "fsdp np1 exit $?"; grep -iE "loss" $O/pure-fsdp.log | tail -4
timeout 60 $mp $tr --steps 30 --ddp fsdp --checkpoint $O/p.ckpt --sharded-checkpoint --resume > $O/pure-resume.log 2>&1; echo "resume exit $?"; grep -iE "loss" $O/pure-resume.log | tail -3
step "d256 benchmark beside SDPA"
bench="$B/flashlm attention-bench --device cuda --quiet --impl flash --d 256 --heads 8 --batch 4 --causal=0,1 --warmup 10 --reps 30 --format json"
timeout 60 $bench --dtype bf16,fp16 --seq 1024,4096,16384 --out $O/d256.json; echo "exit $?"
timeout 40 $bench --dtype bf16 --seq 1024,4096,16384 --deterministic --out $O/d256-det.json; echo "exit $?"
timeout 90 python3 scripts/peers/attention_peers.py --shapes 4x8x1024x256,4x8x4096x256,4x8x16384x256 --causal 0,1 --backends flash,cudnn --out $O/d256-peers.json > $O/d256-peers.log 2>&1 || tail -5 $O/d256-peers.log
python3 scripts/peers/compare.py attention $O/d256.json $O/d256-peers.json --ours flash --peer flash --peer cudnn > $O/compare-d256.md 2>&1; cat $O/compare-d256.md | head -20
step "8B step through ddp-bench, bf16-pure FSDP at np 1"
if (( $(left) > 90 )); then
  timeout $(( $(left) - 15 )) $mp $B/flashlm ddp-bench --device cuda --model cs336-8b --context 32768 --batch 1 --ddp fsdp \
    --precision bf16-pure --recompute auto --atomic-attention-backward --warmup 1 --steps 2 --format md --out $O/lb-np1.md \
    > $O/lb-np1.log 2>&1; echo "exit $?"; cat $O/lb-np1.md 2>/dev/null; tail -4 $O/lb-np1.log
fi
step done
tar czf $OUT/c3.tgz -C /tmp c3; ls -la $OUT
