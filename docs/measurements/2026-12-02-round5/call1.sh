#!/usr/bin/env bash
# Call 1: bf16-pure FSDP fix and bf16 AdamW moments on the GPU; the small/xl step per moment format beside
# torch eager / torch.compile; then the d256 backward grid.
O=/tmp/c1; mkdir -p $O; source .device/s10/common.sh
step "tests: fsdp (world 1), model, optimizer"
FLASHLM_TEST_WORLD_SIZE=1 gt test_fsdp 90 fsdp
gt test_model_cuda 120 model-cuda
gt test_optim 60 optim
for S in fp32 bf16 bf16-sr; do
  step "step, small and xl, --optimizer-state $S"
  timeout 90 $B/flashlm bench --device cuda --model small,xl --context 512 --batch 4 --precision bf16 --pass step \
    --warmup 5 --steps 20 --optimizer-state $S --format json --out $O/step-$S.json > $O/step-$S.log 2>&1
  echo "exit $?"; grep -E "^\| *(small|xl)" $O/step-$S.log
done
for S in fp32 bf16-sr; do
  step "xl kernels, $S"
  timeout 60 $B/flashlm bench --device cuda --model xl --context 512 --batch 4 --precision bf16 --pass step \
    --warmup 3 --steps 5 --optimizer-state $S --profile-kernels > $O/kernels-xl-$S.txt 2>&1
  echo "exit $?"; grep -iE "adamw|optim" $O/kernels-xl-$S.txt | head -4
done
step "torch eager and torch.compile, small and xl, step"
l=$(( $(left) - 130 )); (( l > 330 )) && l=330
if (( l > 60 )); then
  timeout $l python3 scripts/peers/lm_peers.py --models small,xl --modes bf16,bf16-compile --passes step \
    --warmup 5 --steps 20 --out $O/peers-lm.json > $O/peers-lm.log 2>&1; echo "exit $?"; tail -6 $O/peers-lm.log
fi
step "d256 backward grid x3 and capabilities"
gt test_attention 240 d256 --gtest_filter='*d256*:AttentionCapabilities.*:CudaAttention.*' --gtest_repeat=3
step done
tar czf $OUT/c1.tgz -C /tmp c1; ls -la $OUT
