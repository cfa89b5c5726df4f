#!/usr/bin/env bash
# Stop 53, second call. Builds: s53p = main + programmatic casts; s53k = FP8 forward key block (helper);
# s53d = decode fused combine / split ramp (helper).
set -u
LIMIT=${LIMIT:-560}
export PYTHONUNBUFFERED=1
O=$OUT
for s in s53p s53k s53d; do [ -f .gpu/$s.tar.xz ] && { [ -d .gpu/$s ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/$s.tar.xz; }; done
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
LIBS=${NCCL:+$NCCL:}/usr/local/cuda/lib64
P=$PWD/.gpu/s53p K=$PWD/.gpu/s53k D=$PWD/.gpu/s53d
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
for s in $P $K $D; do [ -d $s ] && echo "$(basename $s): $(cat $s/commit)" | tee -a $O/gpu.txt; done
PEAK=$(grep -q H200 $O/gpu.txt && echo 4800 || echo 3350)
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
pack() { (cd $O && tar czf all.tgz --exclude=all.tgz *.log *.csv *.json *.txt *.md 2>/dev/null); }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE " error|Traceback|FAILED  \]" $O/$n.log; }
ok() { grep -q "PASSED" $O/$1.log && ! grep -q "FAILED" $O/$1.log; }
# ---- FP8 forward key block 192 (s53k)
if [ -d $K ]; then
  r k-tests 120 env LD_LIBRARY_PATH=$K/src:$LIBS $K/tests/test_attention --gtest_brief=1 --gtest_filter='KeyBlock192/*:Grid/Fp8VsReference.*:Grid/Fp8PerHeadCudaForward.*:Fp8PerHeadCuda.*:Fp8Attention.*:Fp8AttentionCuda.*'
  grep -h "^\[  PASSED\|^\[  FAILED" $O/k-tests.log | head -12
  r k-env192 90 env FLASHLM_FP8_KEY_BLOCK=192 LD_LIBRARY_PATH=$K/src:$LIBS $K/tests/test_attention --gtest_brief=1 --gtest_filter='Grid/Fp8VsReference.*:Grid/Fp8PerHeadCudaForward.*:Fp8AttentionCuda.*'
  grep -h "^\[  PASSED\|^\[  FAILED" $O/k-env192.log | head -5
  r k-memcheck 60 env LD_LIBRARY_PATH=$K/src:$LIBS compute-sanitizer --tool memcheck --error-exitcode 99 $K/tests/test_attention --gtest_brief=1 --gtest_filter='KeyBlock192/Fp8VsReference.*q200_k193*:KeyBlock192/Fp8VsReference.*q64_k577*'
  tail -1 $O/k-memcheck.log
  if ok k-tests && ok k-env192; then
    for round in 1 2; do for kb in 128 192; do
      r fp8-kb$kb-$round 40 env FLASHLM_FP8_KEY_BLOCK=$kb LD_LIBRARY_PATH=$K/src:$LIBS $K/tools/flashlm attention-bench --device cuda --quiet --impl flash --dtype fp8 --batch 4 --heads 16 --seq 4096,16384 --d 64,128 --causal=0,1 --forward-only --warmup 5 --reps 20 --format csv --out $O/fp8-kb$kb-$round.csv
    done; done
    for f in $O/fp8-kb*.csv; do echo "== $(basename $f)"; cat $f; done | head -60
  fi
fi
pack
# ---- decode variants (s53d)
if [ -d $D ]; then
  DT=$D/tests/test_attention DF=$D/tools/flashlm
  DF_FILTER='AttentionDecode*:*Kvcache*:*KvCache*'
  r d-tests 60 env LD_LIBRARY_PATH=$D/src:$LIBS $DT --gtest_brief=1 --gtest_filter="$DF_FILTER"
  r d-tests-both 60 env FLASHLM_DECODE_COMBINE=fused FLASHLM_DECODE_SPLIT_LOADS=ahead LD_LIBRARY_PATH=$D/src:$LIBS $DT --gtest_brief=1 --gtest_filter="$DF_FILTER"
  r d-memcheck 90 env FLASHLM_DECODE_COMBINE=fused FLASHLM_DECODE_SPLIT_LOADS=ahead LD_LIBRARY_PATH=$D/src:$LIBS compute-sanitizer --tool memcheck --error-exitcode 99 $DT --gtest_brief=1 --gtest_filter='AttentionDecodeCuda.*'
  r d-racecheck 60 env LD_LIBRARY_PATH=$D/src:$LIBS compute-sanitizer --tool racecheck --error-exitcode 99 $DT --gtest_brief=1 --gtest_filter='AttentionDecodeCuda.VariantsGiveTheDefaultsBits:AttentionDecodeCuda.VariantsGiveNaNForABadSequenceOnly'
  grep -h "^\[  PASSED\|^\[  FAILED\|ERROR SUMMARY" $O/d-*.log
  if ok d-tests && ok d-tests-both; then
    for round in 1 2; do for v in default fused ahead both; do case $v in default) E=;; fused) E=FLASHLM_DECODE_COMBINE=fused;; ahead) E=FLASHLM_DECODE_SPLIT_LOADS=ahead;; both) E="FLASHLM_DECODE_COMBINE=fused FLASHLM_DECODE_SPLIT_LOADS=ahead";; esac
      r dec-$v-$round 40 env $E LD_LIBRARY_PATH=$D/src:$LIBS $DF attention-bench --device cuda --decode --peak-gbps $PEAK --format json --out $O/dec-$v-$round.json
    done; done
    python3 -c "import json,sys;[print(f.split('/')[-1],round(x['ms']*1e3,2),'us',round(x['peak_pct'],1),'%') for f in sys.argv[1:] for x in json.load(open(f))['records'] if x['batch']==1 and x['cache_len']==16384]" $O/dec-*.json
  fi
fi
pack
# ---- programmatic casts (s53p)
r p-fp8 60 env LD_LIBRARY_PATH=$P/src:$LIBS $P/tests/test_gemm_cuda --gtest_brief=1 --gtest_filter='Fp8*'
r p-model 90 env LD_LIBRARY_PATH=$P/src:$LIBS $P/tests/test_model_cuda --gtest_brief=1 --gtest_filter='CudaModelFp8*'
r p-memcheck 45 env LD_LIBRARY_PATH=$P/src:$LIBS compute-sanitizer --tool memcheck $P/tests/test_gemm_cuda --gtest_brief=1 --gtest_filter='Fp8Cast*:Fp8Linear*'
grep -h "^\[  PASSED\|ERROR SUMMARY" $O/p-*.log
pack
if ok p-fp8 && ok p-model; then
  LM=(bench --device cuda --model xl --context 512 --batch 4 --pass step --optimizer-state bf16 --warmup 5 --steps 20 --format json --atomic-attention-backward --precision fp8)
  for round in 1 2; do for v in 1 0; do
    r xl-pdl$v-$round 45 env LD_LIBRARY_PATH=$P/src:$LIBS FLASHLM_PROGRAMMATIC_LAUNCH=$v $P/tools/flashlm "${LM[@]}" --out $O/xl-pdl$v-$round.json
    grep -h "\] xl ctx" $O/xl-pdl$v-$round.log
  done; done
fi
pack
if grep -q H200 $O/gpu.txt; then
  r swap 200 env FLASHLM_LIBRARY=$P/src/libflashlm_attention.so PYTHONPATH=$P/py/python:scripts/peers python3 scripts/peers/attention_swap.py --shapes 1024x8,4096x4 --out $O/swap.json
  grep "step median" $O/swap.log
fi
pack
ls $O | grep -v all.tgz | while read f; do rm -f "$O/$f"; done
echo "[$((SECONDS-t0))s] done"
