#!/usr/bin/env bash
# stop 56: s58s = 4f403dd + the optimizer copies beside bf16 gradients + the block weights' bf16 copy restored where read:
# tests, memcheck, xl rows (cast: pass / optimizer-bf16 = last stop's / optimizer = new; gradients fp32 / bf16), peers (H200)
set -u
LIMIT=${LIMIT:-560}; O=$OUT; LIBS=/usr/local/cuda/lib64
python3 -c "import tarfile,sys; [tarfile.open(f).extractall('.gpu') for f in sys.argv[1:]]" .gpu/s58s.tar.xz
M=$PWD/.gpu/s58s; D=$PWD/.gpu/data
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt; echo "s58s: $(cat $M/commit)" | tee -a $O/gpu.txt
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE " error|Traceback|FAILED  \]" $O/$n.log; }
E=(env LD_LIBRARY_PATH=$M/src:$LIBS)
r t-model 150 "${E[@]}" $M/tests/test_model_cuda --gtest_brief=1 --gtest_filter='OpsCudaBf16.AdamW*:CudaModelFp8*:CudaModelBf16Gradients.*:CudaModel.Graph*:CudaModel.*Resume*'
[ "${MEMCHECK:-1}" = 1 ] && r t-memcheck 50 "${E[@]}" compute-sanitizer --tool memcheck --error-exitcode 99 $M/tests/test_model_cuda --gtest_brief=1 --gtest_filter='OpsCudaBf16.AdamWWritesTheFp8CopiesOfTheWeightsItStores'
grep -h "^\[  PASSED\|^\[  FAILED\|^\[  SKIPPED\|ERROR SUMMARY" $O/t-*.log
LM=(bench --device cuda --model xl --context 512 --batch 4 --pass step --optimizer-state bf16 --warmup 5 --steps 20 --format json --atomic-attention-backward --precision fp8)
for round in $(seq 1 ${ROUNDS:-2}); do for v in pass-bf16 optimizer-bf16-bf16 optimizer-bf16 $([ $round = 1 ] && echo pass-fp32 optimizer-bf16-fp32); do
  r xl-$v-$round 40 env FLASHLM_FP8_WEIGHT_CAST=${v%-*} "${E[@]}" $M/tools/flashlm "${LM[@]}" --grad-dtype ${v##*-} --out $O/xl-$v-$round.json
  grep -h "\] xl ctx" $O/xl-$v-$round.log
done; done
[ "${AUTOTUNE:-1}" = 1 ] && r xl-optimizer-bf16-autotune 60 "${E[@]}" $M/tools/flashlm "${LM[@]}" --grad-dtype bf16 --gemm-autotune 8 --out $O/xl-optimizer-bf16-autotune.json
grep -h "\] xl ctx" $O/xl-optimizer-bf16-autotune.log 2>/dev/null
if grep -q H200 $O/gpu.txt && (( $(left) > 150 )); then
  pip install -q --no-deps --no-index --target /tmp/tao .gpu/torchao-*.whl > $O/torchao-install.log 2>&1
  r xl-peers 260 env PYTHONPATH=/tmp/tao:scripts/peers python3 scripts/peers/lm_peers.py --models xl --modes bf16-compile,fp8-torchao-compile --passes step --warmup 5 --steps 20 --out $O/xl-peers.json
  grep -iE "xl|median|ms" $O/xl-peers.log | tail -6
fi
unset FLASHLM_FP8_WEIGHT_CAST
# What time is left: the loss runs (bf16; FP8 with the default copies; + bf16 gradients), if deb.tar.xz came along.
if [ -f .gpu/deb.tar.xz ]; then
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/deb.tar.xz; D=$PWD/.gpu/data
  TR=(train --device cuda --model small --vocab 8192 --context 512 --batch 4 --steps 2000 --eval-every 200 --eval-batches 16 --log-every 0 --data $D/train.bin --val-data $D/val.bin)
  for v in bf16 fp8-optimizer fp8-optimizer-bf16grads; do
    case $v in bf16) X=(--precision bf16);; fp8-optimizer) X=(--precision fp8);; fp8-optimizer-bf16grads) X=(--precision fp8 --grad-dtype bf16);; esac
    r loss-$v 75 "${E[@]}" $M/tools/flashlm "${TR[@]}" "${X[@]}" --log $O/loss-$v.jsonl
    tail -n 1 $O/loss-$v.log | cut -c1-200
  done
fi
(cd $O && tar czf all.tgz --exclude=all.tgz . ; ls | grep -v all.tgz | xargs rm -f)
echo "[$((SECONDS-t0))s] done"
