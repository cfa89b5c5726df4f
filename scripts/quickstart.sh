#!/usr/bin/env bash
# The main job: build flashlm, then benchmark attention (naive vs FlashAttention-2) and print the table:
# on the GPU when one is visible, else on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
flashlm=build/tools/flashlm
$flashlm info
if $flashlm info | grep -q "^cuda: [0-9]"; then
  $flashlm attention-bench --device cuda --impl naive,flash --dtype bf16 --d 64,128 --seq 1024,4096,16384 \
    --batch 1 --heads 16 --causal=0,1 --warmup 5 --reps 20
else
  $flashlm attention-bench --device cpu --impl naive,flash --dtype fp32 --d 64 --seq 512,1024,2048,4096 \
    --causal=0,1 --reps 3 --warmup 1
fi
