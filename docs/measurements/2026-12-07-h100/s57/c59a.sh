#!/usr/bin/env bash
# stop 57: s59s = skip-bf16-copy + the copies only with the tensorwise recipe (fix of the rowwise throw):
# tests, memcheck, xl rows (pass/optimizer x fp32/bf16 grads, two rounds), autotune, peers (torchao + compile)
set -u
LIMIT=${LIMIT:-560}; O=$OUT; LIBS=/usr/local/cuda/lib64
python3 -c "import tarfile,sys; [tarfile.open(f).extractall('.gpu') for f in sys.argv[1:]]" .gpu/s59s.tar.xz
M=$PWD/.gpu/s59s
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt; echo "s59s: $(cat $M/commit)" | tee -a $O/gpu.txt
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE " error|Traceback|FAILED  \]" $O/$n.log; }
E=(env LD_LIBRARY_PATH=$M/src:$LIBS)
[ "${TESTS:-1}" = 1 ] && r t-model 150 "${E[@]}" $M/tests/test_model_cuda --gtest_brief=1 --gtest_filter='OpsCudaBf16.AdamW*:CudaModelFp8*:CudaModelBf16Gradients.*:CudaModel.Graph*:CudaModel.*Resume*'
[ "${MEMCHECK:-1}" = 1 ] && r t-memcheck 50 "${E[@]}" compute-sanitizer --tool memcheck --error-exitcode 99 $M/tests/test_model_cuda --gtest_brief=1 --gtest_filter='OpsCudaBf16.AdamWWritesTheFp8CopiesOfTheWeightsItStores'
grep -h "^\[  PASSED\|^\[  FAILED\|^\[  SKIPPED\|ERROR SUMMARY" $O/t-*.log
LM=(bench --device cuda --model xl --context 512 --batch 4 --pass step --optimizer-state bf16 --warmup 5 --steps 20 --format json --atomic-attention-backward)
for round in $(seq 1 ${ROUNDS:-2}); do for v in ${ROWS:-bf16-fp32 pass-fp32 optimizer-bf16 pass-bf16 $([ $round = 1 ] && echo optimizer-fp32 optimizer-bf16-bf16)}; do
  if [ $v = bf16-fp32 ]; then P=bf16; unset FLASHLM_FP8_WEIGHT_CAST; else P=fp8; export FLASHLM_FP8_WEIGHT_CAST=${v%-*}; fi
  r xl-$v-$round 40 "${E[@]}" $M/tools/flashlm "${LM[@]}" --precision $P --grad-dtype ${v##*-} --out $O/xl-$v-$round.json
  grep -h "\] xl ctx" $O/xl-$v-$round.log
done; done
unset FLASHLM_FP8_WEIGHT_CAST
[ "${AUTOTUNE:-1}" = 1 ] && r xl-optimizer-bf16-autotune 60 "${E[@]}" $M/tools/flashlm "${LM[@]}" --precision fp8 --grad-dtype bf16 --gemm-autotune 8 --out $O/xl-optimizer-bf16-autotune.json
grep -h "\] xl ctx" $O/xl-optimizer-bf16-autotune.log 2>/dev/null
if (( $(left) > ${PEER_MIN:-150} )); then
  pip install -q --no-deps --no-index --target /tmp/tao .gpu/torchao-*.whl > $O/torchao-install.log 2>&1
  r xl-peers $(( $(left) - 5 )) env PYTHONPATH=/tmp/tao:scripts/peers python3 scripts/peers/lm_peers.py --models xl --modes bf16-compile,fp8-torchao-compile --passes step --warmup 5 --steps 20 --out $O/xl-peers.json
  grep -iE "xl|median|ms" $O/xl-peers.log | tail -6
fi
(cd $O && tar czf all.tgz --exclude=all.tgz * ; ls | grep -v all.tgz | xargs rm -f)
echo "[$((SECONDS-t0))s] done"
