#!/usr/bin/env bash
# The main job: build flashlm, benchmark attention (naive vs FlashAttention-2; on the GPU when one is
# visible, else on the CPU), train a tiny LM on synthetic data on the CPU for a few seconds, then go from a
# text that ships with the system (the GPL-3 licence) to token files, a trained model, its safetensors
# export and a sample.
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
echo
echo "== a short training run (tiny LM, synthetic data whose best possible loss is ln 4 = 1.386)"
$flashlm train --device cpu --model tiny --steps 200 --log-every 25 --eval-every 100

echo
echo "== from a text file to a sample: prepare, train, export, generate (CPU, a minute or two)"
text=/usr/share/common-licenses/GPL-3
[ -r "$text" ] || text=README.md  # not a Debian system: the repository's own text
out=build/quickstart
mkdir -p "$out"
$flashlm prepare "$text" --out "$out"
$flashlm train --device cpu --data "$out/train.bin" --val-data "$out/val.bin" --vocab 256 --model tiny --context 128 \
  --batch 8 --steps 200 --log-every 50 --eval-every 100 --checkpoint "$out/run.ckpt" --log "$out/metrics.jsonl"
$flashlm export "$out/run.ckpt" "$out/model.safetensors"
$flashlm generate --checkpoint "$out/run.ckpt" --tokenizer "$out/tokenizer.json" --prompt "This License" \
  --max-tokens 100 --temperature 0.8 --top-k 40 --seed 1
