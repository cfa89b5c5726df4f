#!/usr/bin/env bash
# The main job: build flashlm, then benchmark attention (naive vs FlashAttention-2) and print the table.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
flashlm=build/tools/flashlm
$flashlm info
$flashlm attention-bench --device cpu --impl naive,flash --dtype fp32 --d 64 --seq 512,1024,2048,4096 \
  --causal=0,1 --reps 3 --warmup 1
