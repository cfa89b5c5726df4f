#!/usr/bin/env bash
# Stop 53, last call. s53f = main (FP8 key block auto, decode combine through programmatic_launch.cuh);
# s53s = FP8 forward stages / 224-key variants (helper branch fp8-stages).
set -u
LIMIT=${LIMIT:-400}
O=$OUT
for s in s53f s53s; do [ -f .gpu/$s.tar.xz ] && { [ -d .gpu/$s ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/$s.tar.xz; }; done
LIBS=/usr/local/cuda/lib64
F=$PWD/.gpu/s53f S=$PWD/.gpu/s53s
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
for s in $F $S; do [ -d $s ] && echo "$(basename $s): $(cat $s/commit)" | tee -a $O/gpu.txt; done
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
pack() { (cd $O && tar czf all.tgz --exclude=all.tgz *.log *.csv *.json *.txt 2>/dev/null); }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE " error|Traceback|FAILED  \]" $O/$n.log; }
ok() { grep -q "PASSED" $O/$1.log && ! grep -q "FAILED" $O/$1.log; }
# ---- main: the FP8 suites with the auto key block, decoding through the shared programmatic launch
r f-tests 100 env LD_LIBRARY_PATH=$F/src:$LIBS $F/tests/test_attention --gtest_brief=1 --gtest_filter='Grid/Fp8VsReference.*:Grid/Fp8PerHeadCudaForward.*:Fp8PerHeadCuda.*:Fp8Attention.*:Fp8AttentionCuda.*:AttentionDecode*:*Kvcache*:*KvCache*'
grep -h "^\[  PASSED\|^\[  FAILED" $O/f-tests.log | head -8
pack
# ---- FP8 stages / 224 (s53s)
if [ -d $S ]; then
  r s-tests 150 env LD_LIBRARY_PATH=$S/src:$LIBS $S/tests/test_attention --gtest_brief=1 --gtest_filter='Stages3/*:KeyBlock192Stages3/*:KeyBlock224/*:KeyBlock224Stages3/*:Fp8Attention.*:Fp8PerHeadCuda.*'
  grep -h "^\[  PASSED\|^\[  FAILED" $O/s-tests.log | head -12
  r s-memcheck 60 env LD_LIBRARY_PATH=$S/src:$LIBS compute-sanitizer --tool memcheck --error-exitcode 99 $S/tests/test_attention --gtest_brief=1 --gtest_filter='KeyBlock224/Fp8VsReference.*q449_k447*causalTL*:KeyBlock224/Fp8VsReference.*q64_k673*causalBR*:KeyBlock224Stages3/Fp8VsReference.*q449_k447*full*:KeyBlock224Stages3/Fp8VsReference.*q64_k673*causalBR*:KeyBlock192Stages3/Fp8VsReference.*q385_k383*d128*causalBR*:KeyBlock192Stages3/Fp8VsReference.*q64_k577*d128*full*:Stages3/Fp8VsReference.*q300_k129*d128*:Stages3/Fp8VsReference.*q257_k513*d128*'
  tail -1 $O/s-memcheck.log
  for round in 1 2; do for v in "192 2" "192 3" "224 2" "224 3"; do set -- $v
    r s-kb$1-s$2-$round 25 env FLASHLM_FP8_KEY_BLOCK=$1 FLASHLM_FP8_STAGES=$2 LD_LIBRARY_PATH=$S/src:$LIBS $S/tools/flashlm attention-bench --device cuda --quiet --impl flash --dtype fp8 --batch 4 --heads 16 --seq 4096,16384 --d 128 --causal=0,1 --forward-only --warmup 5 --reps 20 --format csv --out $O/s-kb$1-s$2-$round.csv
  done; done
  for f in $O/s-kb*.csv; do echo "$(basename $f) $(tail -n +2 $f | cut -d, -f5,9,15 | tr '\n' ' ')"; done
fi
r f-fp8 30 env LD_LIBRARY_PATH=$F/src:$LIBS $F/tools/flashlm attention-bench --device cuda --quiet --impl flash --dtype fp8 --batch 4 --heads 16 --seq 4096,16384 --d 64,128 --causal=0,1 --forward-only --warmup 5 --reps 20 --format csv --out $O/f-fp8.csv
cat $O/f-fp8.csv
pack
ls $O | grep -v all.tgz | while read f; do rm -f "$O/$f"; done
echo "[$((SECONDS-t0))s] done"
