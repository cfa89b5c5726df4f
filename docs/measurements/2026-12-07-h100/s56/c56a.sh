#!/usr/bin/env bash
# Stop 56. Sections (ONLY=...): f (s56f: AdamW writes the FP8 weight copies: tests, memcheck, xl A/B optimizer/pass),
# g (s55g: bf16 weight gradients: tests), gx (s55g: xl A/B fp32/bf16 gradients), k (s54k: d128 key blocks of 176)
set -u
LIMIT=${LIMIT:-570}; O=$OUT; LIBS=/usr/local/cuda/lib64
for s in s56f s55g s54k; do [ -f .gpu/$s.tar.xz ] && { [ -d .gpu/$s ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/$s.tar.xz; }; done
F=$PWD/.gpu/s56f G=$PWD/.gpu/s55g K=$PWD/.gpu/s54k
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
for s in $F $G $K; do [ -d $s ] && echo "$(basename $s): $(cat $s/commit)" | tee -a $O/gpu.txt; done
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE " error|Traceback|FAILED  \]" $O/$n.log; }
ONLY=${ONLY:-f,g}
LM=(bench --device cuda --model xl --context 512 --batch 4 --pass step --optimizer-state bf16 --warmup 5 --steps 20 --format json --atomic-attention-backward --precision fp8)
if [[ ,$ONLY, == *,f,* ]] && [ -d $F ]; then
r f-ops 60 env LD_LIBRARY_PATH=$F/src:$LIBS $F/tests/test_model_cuda --gtest_brief=1 --gtest_filter='OpsCudaBf16.AdamW*'
r f-memcheck 60 env LD_LIBRARY_PATH=$F/src:$LIBS compute-sanitizer --tool memcheck --error-exitcode 99 $F/tests/test_model_cuda --gtest_brief=1 --gtest_filter='OpsCudaBf16.AdamWWritesTheFp8CopiesOfTheWeightsItStores'
r f-model 170 env LD_LIBRARY_PATH=$F/src:$LIBS $F/tests/test_model_cuda --gtest_brief=1 --gtest_filter='CudaModelFp8.*'
grep -h "^\[  PASSED\|^\[  FAILED\|ERROR SUMMARY\|Failure" $O/f-*.log | head -20
if grep -q "^\[  PASSED" $O/f-ops.log && ! grep -q "FAILED  \]" $O/f-ops.log; then
for round in 1 2; do for v in optimizer pass; do
  r xlf-$v-$round 50 env FLASHLM_FP8_WEIGHT_CAST=$v LD_LIBRARY_PATH=$F/src:$LIBS $F/tools/flashlm "${LM[@]}" --out $O/xlf-$v-$round.json
  grep -h "\] xl ctx" $O/xlf-$v-$round.log; tail -n 1 $O/xlf-$v-$round.log | cut -c1-200
done; done
fi
fi
if [[ ,$ONLY, == *,g,* ]] && [ -d $G ]; then
r g-tests 120 env LD_LIBRARY_PATH=$G/src:$LIBS $G/tests/test_model_cuda --gtest_brief=1 --gtest_filter='CudaModelBf16Gradients.*:OpsCudaBf16.AdamWWithBf16GradientsIsTheStepOnTheWidenedGradients:CudaModelFp8.*'
r g-gemm 60 env LD_LIBRARY_PATH=$G/src:$LIBS $G/tests/test_gemm_cuda --gtest_brief=1 --gtest_filter='GemmCuda*:Fp8*'
grep -h "^\[  PASSED\|^\[  FAILED\|^\[  SKIPPED" $O/g-*.log
fi
if [[ ,$ONLY, == *,gx,* ]] && [ -d $G ]; then
for round in 1 2; do for v in fp32 bf16; do
  r xlg-$v-$round 50 env LD_LIBRARY_PATH=$G/src:$LIBS $G/tools/flashlm "${LM[@]}" --grad-dtype $v --out $O/xlg-$v-$round.json
  grep -h "\] xl ctx" $O/xlg-$v-$round.log; tail -n 1 $O/xlg-$v-$round.log | cut -c1-200
done; done
fi
if [[ ,$ONLY, == *,k,* ]] && [ -d $K ]; then
r k-tests 80 env LD_LIBRARY_PATH=$K/src:$LIBS $K/tests/test_attention --gtest_brief=1 --gtest_filter='CudaAttention.HopperD128KeyBlocksMatchTheReference:CudaAttention.HopperD64TileShapesMatchTheReference'
grep -h "^\[  PASSED\|^\[  FAILED" $O/k-tests*.log
if grep -q "^\[  PASSED  \] 2 tests" $O/k-tests.log; then
for round in 1 2; do for v in 128x128 128x176; do
  r k-$v-$round 30 env FLASHLM_SM90_FWD_D128_TILE=$v LD_LIBRARY_PATH=$K/src:$LIBS $K/tools/flashlm attention-bench --device cuda --quiet --impl flash --dtype bf16 --grid fa --forward-only --warmup 5 --reps 20 --format csv --out $O/k-$v-$round.csv
done; done
python3 - $O <<'PY'
import csv,sys,glob,collections
O=sys.argv[1]; t=collections.defaultdict(dict)
for f in sorted(glob.glob(O+'/k-128x*-*.csv')):
    v=f.split('/')[-1][2:-4]
    for row in csv.DictReader(open(f)):
        key=tuple(row.get(c,'') for c in ('batch','heads','seq_q','head_dim','causal'))
        ms=[row[c] for c in row if c.startswith('fwd') and 'ms' in c]
        t[key][v]=float(ms[0]) if ms else float('nan')
for k,d in sorted(t.items(), key=lambda x:(int(x[0][3] or 0),int(x[0][2] or 0),x[0][4])):
    a=[d.get('128x128-%d'%i) for i in (1,2)]; b=[d.get('128x176-%d'%i) for i in (1,2)]
    if None in a or None in b: continue
    print(k, 'fwd ms 128:',a,'176:',b,'176/128 speed-up %.3f'%((a[0]+a[1])/(b[0]+b[1])))
PY
fi
fi
echo "[$((SECONDS-t0))s] done"
