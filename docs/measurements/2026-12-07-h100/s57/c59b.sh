#!/usr/bin/env bash
# stop 57, second call: the 2000-step loss runs over three seeds (s59s), then the norm on side SMs (s57n), bf16 grads
# then the gradient norm on side SMs (s57n) with bf16 gradients.
set -u
LIMIT=${LIMIT:-560}; O=$OUT; LIBS=/usr/local/cuda/lib64
for f in s59s s57n deb; do [ -f .gpu/$f.tar.xz ] && python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/$f.tar.xz; done
M=$PWD/.gpu/s59s; N=$PWD/.gpu/s57n; D=$PWD/.gpu/data
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt; for s in $M $N; do echo "$(basename $s): $(cat $s/commit)" | tee -a $O/gpu.txt; done
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE " error|Traceback|FAILED  \]" $O/$n.log; }
E=(env LD_LIBRARY_PATH=$M/src:$LIBS)
TR=(train --device cuda --model small --vocab 8192 --context 512 --batch 4 --steps 2000 --eval-every 200 --eval-batches 16 --log-every 0 --data $D/train.bin --val-data $D/val.bin)
for seed in ${SEEDS:-1 2 1234}; do for v in bf16 fp8-pass fp8-optimizer fp8-optimizer-bf16grads; do
  [ $seed = 1234 ] && [ $v != fp8-pass ] && continue  # seed 1234's other three ran in c58a (stop 57, first call)
  unset FLASHLM_FP8_WEIGHT_CAST
  case $v in bf16) X=(--precision bf16);; fp8-pass) X=(--precision fp8); export FLASHLM_FP8_WEIGHT_CAST=pass;; fp8-optimizer) X=(--precision fp8);; fp8-optimizer-bf16grads) X=(--precision fp8 --grad-dtype bf16);; esac
  r loss-$v-s$seed 40 "${E[@]}" $M/tools/flashlm "${TR[@]}" "${X[@]}" --seed $seed --log $O/loss-$v-s$seed.jsonl
  tail -n 1 $O/loss-$v-s$seed.log | cut -c1-200
done; done
unset FLASHLM_FP8_WEIGHT_CAST
python3 - $O <<'PY'
import json,sys,glob
for f in sorted(glob.glob(sys.argv[1]+'/loss-*.jsonl')):
    rows=[json.loads(l) for l in open(f) if l.strip()]
    tr=[r['loss'] for r in rows if 'loss' in r and r.get('step',0)>1000 and 'val_loss' not in r]
    va=[r['val_loss'] for r in rows if 'val_loss' in r]
    print(f.split('/')[-1], 'steps>1000 mean loss %.4f' % (sum(tr)/len(tr)) if tr else 'no train rows', 'val', va[-1:] )
PY
(cd $O && tar czf loss.tgz *.jsonl loss-*.log 2>/dev/null)
if [ -d $N ]; then
  r n-tests 150 env LD_LIBRARY_PATH=$N/src:$LIBS $N/tests/test_model_cuda --gtest_brief=1 --gtest_filter='*SquaredNorm*:CudaModel.OverlappedGradientNorm*:CudaModel.GradNormSideSms*:CudaModel.GraphedStepsGiveTheBitsOfEagerSteps:CudaModelFp8*:CudaModelBf16Gradients.Graph*'
  grep -h "^\[  PASSED\|^\[  FAILED" $O/n-tests.log
  LM=(bench --device cuda --model xl --context 512 --batch 4 --pass step --optimizer-state bf16 --warmup 5 --steps 20 --format json --atomic-attention-backward --precision fp8 --grad-dtype bf16)
  for round in 1 2; do for v in serial overlap side8; do case $v in serial) X=();; overlap) X=(--overlap-grad-norm);; side8) X=(--overlap-grad-norm --grad-norm-side-sms 8);; esac
    r xln-$v-$round 45 env LD_LIBRARY_PATH=$N/src:$LIBS $N/tools/flashlm "${LM[@]}" "${X[@]}" --out $O/xln-$v-$round.json
    grep -h "\] xl ctx" $O/xln-$v-$round.log
  done; done
fi
(cd $O && tar czf all.tgz --exclude=all.tgz --exclude=loss.tgz . ; ls | grep -v "all.tgz\|loss.tgz" | xargs rm -f)
echo "[$((SECONDS-t0))s] done"
