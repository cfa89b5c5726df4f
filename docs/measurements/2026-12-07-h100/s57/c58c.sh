#!/usr/bin/env bash
# stop 56, third call: decoding at three blocks an SM (s57d) and the torch ops' C++ kernels (s54c).
set -u
LIMIT=${LIMIT:-540}
O=$OUT
for s in s57d s54c; do [ -f .gpu/$s.tar.xz ] && { [ -d .gpu/$s ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/$s.tar.xz; }; done
LIBS=/usr/local/cuda/lib64
K=$PWD/.gpu/s54k R=$PWD/.gpu/s54r D=$PWD/.gpu/s57d N=$PWD/.gpu/s57n C=$PWD/.gpu/s54c
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
for s in $K $R $D $N $C; do [ -d $s ] && echo "$(basename $s): $(cat $s/commit)" | tee -a $O/gpu.txt; done
PEAK=$(grep -q H200 $O/gpu.txt && echo 4800 || echo 3350)
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
pack() { (cd $O && tar czf all.tgz --exclude=all.tgz *.log *.csv *.json *.txt 2>/dev/null); }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE " error|Traceback|FAILED  \]" $O/$n.log; }
ONLY=${ONLY:-d,c}  # which sections: k (d128 key blocks of 176), r (row sum), w (window schedule), d (decode), n (norm), c (C++ ops)
# ---- the 16-bit Hopper forward's key blocks of 176 at d128 (s54k)
if [[ ,$ONLY, == *,k,* ]] && [ -d $K ]; then
r k-tests 110 env FLASHLM_SM90_FWD_D128_TILE=128x176 LD_LIBRARY_PATH=$K/src:$LIBS $K/tests/test_attention --gtest_brief=1 --gtest_filter='Grid/CudaVsReference.*:CudaAttention.Hopper*:*Varlen*Cuda*:AttentionNaN*'
r k-memcheck 50 env FLASHLM_SM90_FWD_D128_TILE=128x176 LD_LIBRARY_PATH=$K/src:$LIBS compute-sanitizer --tool memcheck --error-exitcode 99 $K/tests/test_attention --gtest_brief=1 --gtest_filter='CudaAttention.HopperD128KeyBlocksMatchTheReference'
grep -h "^\[  PASSED\|^\[  FAILED\|ERROR SUMMARY" $O/k-*.log
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
head -2 $O/k-128x128-1.csv | cut -c1-400
fi
pack
# ---- FP8 forward row sum on the tensor cores (s54r)
if [[ ,$ONLY, == *,r,* ]]; then
r r-tests 150 env LD_LIBRARY_PATH=$R/src:$LIBS $R/tests/test_attention --gtest_brief=1 --gtest_filter='*Fp8*:*KeyBlock*:*RowSum*'
grep -h "^\[  PASSED\|^\[  FAILED" $O/r-tests.log | head -20
r r-memcheck 60 env LD_LIBRARY_PATH=$R/src:$LIBS compute-sanitizer --tool memcheck --error-exitcode 99 $R/tests/test_attention --gtest_brief=1 --gtest_filter='RowSumTensorKeyBlock192/Fp8VsReference.*/b2_q200_k193_*:RowSumTensorFp32/Fp8VsReference.*/b2_q1000_k333_h6x1_d128_sliced_causalBR_fp8_e4m3'
r r-racecheck 60 env LD_LIBRARY_PATH=$R/src:$LIBS compute-sanitizer --tool racecheck --error-exitcode 99 $R/tests/test_attention --gtest_brief=1 --gtest_filter='RowSumTensorKeyBlock192/Fp8VsReference.*/b2_q200_k193_*'
tail -n1 $O/r-memcheck.log $O/r-racecheck.log
for round in 1 2; do for m in alu tensor tensor-fp32; do
  r r-$m-$round 30 env FLASHLM_FP8_ROWSUM=$m LD_LIBRARY_PATH=$R/src:$LIBS $R/tools/flashlm attention-bench --device cuda --quiet --impl flash --dtype fp8 --batch 4 --heads 16 --seq 4096,16384 --d 64,128 --causal=0,1 --forward-only --warmup 5 --reps 20 --format csv --out $O/r-$m-$round.csv
done; done
for f in $O/r-*.csv; do echo "$(basename $f) $(tail -n +2 $f | cut -d, -f5,6,9,15 | cut -c1-40 | tr '\n' ' ')"; done
fi
pack
# ---- the window backward: persistent against grid launch (s54r's bf16 kernels are main's)
if [[ ,$ONLY, == *,w,* ]]; then
for round in 1 2; do for v in grid persistent; do
  r w-$v-$round 40 env FLASHLM_SM90_BWD_SCHEDULE=$v LD_LIBRARY_PATH=$R/src:$LIBS $R/tools/flashlm attention-bench --device cuda --quiet --impl flash --dtype bf16 --batch 1 --heads 32 --seq 32768 --d 128 --causal=1 --window 4096,0 --warmup 3 --reps 10 --format csv --out $O/w-$v-$round.csv
  tail -n +2 $O/w-$v-$round.csv | cut -c1-160
done; done
fi
pack
# ---- decoding at three blocks an SM (s57d)
if [[ ,$ONLY, == *,d,* ]]; then
r d-tests 90 env LD_LIBRARY_PATH=$D/src:$LIBS $D/tests/test_attention --gtest_brief=1 --gtest_filter='AttentionDecode*:*Kvcache*:*KvCache*'
r d-tests3 90 env FLASHLM_DECODE_OCCUPANCY=3 LD_LIBRARY_PATH=$D/src:$LIBS $D/tests/test_attention --gtest_brief=1 --gtest_filter='AttentionDecodeCuda.*'
r d-memcheck 60 env LD_LIBRARY_PATH=$D/src:$LIBS compute-sanitizer --tool memcheck --error-exitcode 99 $D/tests/test_attention --gtest_brief=1 --gtest_filter='AttentionDecodeCuda.ThreeBlocksPerSmMatchTheOracle'
grep -h "^\[  PASSED\|^\[  FAILED\|ERROR SUMMARY" $O/d-*.log
for round in 1 2; do for v in 2 3; do
  r dec-occ$v-$round 30 env FLASHLM_DECODE_OCCUPANCY=$v LD_LIBRARY_PATH=$D/src:$LIBS $D/tools/flashlm attention-bench --device cuda --decode --peak-gbps $PEAK --format json --out $O/dec-occ$v-$round.json
done; done
python3 -c "import json,sys;[print(f.split('/')[-1],x['batch'],x['cache_len'],round(x['ms']*1e3,2),'us',round(x['peak_pct'],1),'%') for f in sys.argv[1:] for x in json.load(open(f))['records'] if x['batch']==1]" $O/dec-occ*.json
fi
pack
# ---- the gradient norm beside the backward on SMs of its own (s57n)
if [[ ,$ONLY, == *,n,* ]] && [ -d $N ]; then
  r n-tests 150 env LD_LIBRARY_PATH=$N/src:$LIBS $N/tests/test_model_cuda --gtest_brief=1 --gtest_filter='*SquaredNorm*:CudaModel.OverlappedGradientNorm*:CudaModel.GradNormSideSms*:CudaModel.GraphedStepsGiveTheBitsOfEagerSteps:CudaModelFp8*'
  grep -h "^\[  PASSED\|^\[  FAILED" $O/n-tests.log
  LM=(bench --device cuda --model xl --context 512 --batch 4 --pass step --optimizer-state bf16 --warmup 5 --steps 20 --format json --atomic-attention-backward --precision fp8)
  for round in 1 2; do for v in serial overlap side4 side8; do case $v in serial) E=();; overlap) E=(--overlap-grad-norm);; side4) E=(--overlap-grad-norm --grad-norm-side-sms 4);; side8) E=(--overlap-grad-norm --grad-norm-side-sms 8);; esac
    r xl-$v-$round 45 env LD_LIBRARY_PATH=$N/src:$LIBS $N/tools/flashlm "${LM[@]}" "${E[@]}" --out $O/xl-$v-$round.json
    grep -h "\] xl ctx" $O/xl-$v-$round.log
  done; done
fi
pack
# ---- the torch ops' kernels in C++ (s54c; JIT-built here against the installed torch)
if [[ ,$ONLY, == *,c,* ]] && [ -d $C ]; then
  CE=(env FLASHLM_LIBRARY=$C/src/libflashlm_attention.so PYTHONPATH=$C/py/python LD_LIBRARY_PATH=$C/src:$LIBS TORCH_EXTENSIONS_DIR=$PWD/.gpu/torch_ext)
  r c-pytest 200 "${CE[@]}" FLASHLM_TORCH_CPP_OPS=1 python3 -m pytest -q -p no:cacheprovider $C/py/tests/python/test_torch_op_kernels.py $C/py/tests/python/test_torch_library.py
  tail -3 $O/c-pytest.log
  for i in 1 2; do for v in 0 1; do
    r c-op$v-$i 60 "${CE[@]}" FLASHLM_TORCH_CPP_OPS=$v python3 scripts/torch_op_overhead.py --device cuda --calls 2000 --repeats 15 --out $O/c-op$v-$i.json
    grep -iE "attention_fwd|attention_bwd|scaled_dot" $O/c-op$v-$i.log | head -4
  done; done
  if grep -q H200 $O/gpu.txt; then
    for v in 0 1; do r c-swap$v 200 "${CE[@]}" FLASHLM_TORCH_CPP_OPS=$v PYTHONPATH=$C/py/python:scripts/peers python3 scripts/peers/attention_swap.py --shapes 1024x8,4096x4 --out $O/c-swap$v.json; grep "step median" $O/c-swap$v.log; done
  fi
fi
pack
ls $O | grep -v all.tgz | while read f; do rm -f "$O/$f"; done
echo "[$((SECONDS-t0))s] done"
