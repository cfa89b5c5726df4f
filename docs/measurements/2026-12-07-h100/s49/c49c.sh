#!/usr/bin/env bash
# Session 49, call 3 (warm): call 2's filter A (timed out at 300 s) split four ways, per-test output.
set -u
O=$OUT S=$PWD/.gpu/s49 T=$PWD/.gpu/s49/tests
[[ -d $S ]] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/s49.tar.xz
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$S/src:${NCCL:+$NCCL:}/usr/local/cuda/lib64
t0=$SECONDS
i=0
for f in 'Grid/CudaBandVsReference.*' '*AlibiSink*' 'CudaBand.*:HopperBackwardSchedule.*:CudaAttention.*:Sm90Primitives.*:AttentionExtrasCuda.*' 'Fp8*Cuda*:AttentionNaN.*'; do
  i=$((i+1)); (timeout ${TL:-270} stdbuf -oL -eL $T/test_attention --gtest_filter="$f" > $O/a$i.log 2>&1; echo $? > $O/a$i.rc) &
done
wait
for j in 1 2 3 4; do echo "a$j rc=$(cat $O/a$j.rc) ok=$(grep -c '^\[       OK' $O/a$j.log) failed=$(grep -c '^\[  FAILED  \] [A-Z]' $O/a$j.log) skipped=$(grep -c '^\[  SKIPPED' $O/a$j.log) $(grep -E '^\[  PASSED|^\[==========\] [0-9]+ tests' $O/a$j.log | tr '\n' ' ')"; grep -E '^\[  FAILED  \] [A-Z]' $O/a$j.log | sort -u | head -5; grep -m3 -E "Failure|Which is" $O/a$j.log; tail -1 $O/a$j.log | cut -c1-200; done
echo "[$((SECONDS-t0))s] done"; cd $O && tar czf all.tgz a*.log && rm -f a*.log a*.rc
