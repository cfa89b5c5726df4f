#!/usr/bin/env bash
# Call 2 of docs/perf.md "The xl step, third round": the final build (serial norm by default) — the GEMM and
# model tests, then base and ours back to back, then ours' kernel table; everything packed into one file.
set -uo pipefail
D=$PWD/.device/xl-step3 o=/tmp/xl3c2
mkdir -p $o
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
libs=$nccl:/usr/local/cuda/lib64
t0=$SECONDS
for t in test_gemm_cuda test_model_cuda; do
  LD_LIBRARY_PATH=$D/ours:$libs timeout 60 $D/ours/$t > $o/$t.log 2>&1; echo "[$((SECONDS-t0)) s] $t: exit $?"
  grep -E "^\[  (PASSED|FAILED) |tests ran" $o/$t.log
done
b="bench --device cuda --context 512 --batch 4 --precision bf16 --pass step"
for v in base ours; do
  LD_LIBRARY_PATH=$D/$v:$libs timeout 40 $D/$v/flashlm $b --model small,xl --warmup 5 --steps 20 --format json \
    --out $o/$v.json > $o/$v.log 2>&1; echo "[$((SECONDS-t0)) s] $v: exit $?"; grep -E "^\|.*step" $o/$v.log
done
LD_LIBRARY_PATH=$D/ours:$libs timeout 30 $D/ours/flashlm $b --model xl --warmup 3 --steps 5 --profile-kernels \
  > $o/ours-kernels-xl.txt 2>&1; echo "[$((SECONDS-t0)) s] kernels: exit $?"
grep -E "adamw|rmsnorm|add_column|reduce_|swiglu" $o/ours-kernels-xl.txt | cut -c1-150
tar czf ${OUT:-/tmp}/xl3c2.tgz -C /tmp xl3c2
