#!/usr/bin/env bash
# Session 49, call 2 (warm): the GPU test filters and racecheck of call 1, given the time they need, side by
# side; the swap at 4096; the fa grid's second round. Every log is packed into all.tgz.
set -u
LIMIT=${LIMIT:-560}
[[ -d .gpu/s49 ]] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/s49.tar.xz
export PYTHONUNBUFFERED=1
O=$OUT S=$PWD/.gpu/s49 T=$PWD/.gpu/s49/tests F=$PWD/.gpu/s49/tools/flashlm
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$S/src:${NCCL:+$NCCL:}/usr/local/cuda/lib64
t0=$SECONDS
pack() { (cd $O && tar czf all.tgz --exclude all.tgz * 2>/dev/null); }
sum() { echo "[$((SECONDS-t0))s] $1 rc=$2 $(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\]|ERROR SUMMARY|RACECHECK SUMMARY' $O/$1.log | grep -v '^\[  FAILED  \] [A-Z]' | tr '\n' ' ') lines=$(wc -l < $O/$1.log)"
  grep -E '^\[  FAILED  \] [A-Z]' $O/$1.log | head -8; grep -m4 -E "Failure|Which is|error/tol" $O/$1.log; }
bg() { local n=$1 l=$2; shift 2; (timeout $l stdbuf -oL -eL "$@" > $O/$n.log 2>&1; echo $? > $O/$n.rc) & }
A='Grid/CudaBandVsReference.*:CudaBand.*:*AlibiSink*:HopperBackwardSchedule.*:CudaAttention.*:Sm90Primitives.*:AttentionExtrasCuda.*:Fp8*Cuda*:AttentionNaN.*'
B='*Varlen*Cuda*:AttentionDecodeCuda.*:AttentionDecode.*'
small='Grid/CudaVsReference.*q65_k2100_*:Grid/CudaVsReference.*q17_k130_h4x2_d128*:Grid/CudaVsReference.*q129_k97_h4x2_d256*:CudaAttention.QueryTilesThatSeeNoKey*'
bg tests-a 300 $T/test_attention --gtest_brief=1 --gtest_filter="$A"
bg tests-b 300 $T/test_attention --gtest_brief=1 --gtest_filter="$B"
bg racecheck 300 compute-sanitizer --tool racecheck --error-exitcode 99 $T/test_attention --gtest_brief=1 --gtest_filter="$small"
FLASHLM_SM90_BWD_SCHEDULE=persistent bg racecheck-persistent 300 compute-sanitizer --tool racecheck --error-exitcode 99 $T/test_attention --gtest_brief=1 --gtest_filter="$small"
wait; for n in tests-a tests-b racecheck racecheck-persistent; do sum $n $(cat $O/$n.rc); done; pack
timeout 160 env FLASHLM_LIBRARY=$S/src/libflashlm_attention.so PYTHONPATH=python python3 scripts/peers/attention_swap.py --shapes 4096x4 --out $O/swap4096.json > $O/swap4096.log 2>&1; echo "[$((SECONDS-t0))s] swap rc=$?"; tail -12 $O/swap4096.log; pack
FB=(attention-bench --device cuda --quiet --impl flash --dtype bf16)
if (( LIMIT - (SECONDS - t0) > 70 )); then
  timeout 40 $F "${FB[@]}" --grid fa --warmup 5 --reps 20 --format json --out $O/ours-fa.json > $O/fa-ours.log 2>&1
  timeout 50 python3 scripts/peers/attention_peers.py --grid fa --backends flash,cudnn --dtype bf16 --warmup 5 --reps 20 --out $O/peers-fa.json > $O/fa-peers.log 2>&1
  python3 scripts/peers/compare.py attention $O/ours-fa.json $O/peers-fa.json --peer sdpa-flash --peer sdpa-cudnn --min-seq 1024 > $O/compare-fa.md 2>&1; tail -3 $O/compare-fa.md
fi
echo "[$((SECONDS-t0))s] done"; pack; cd $O && find . -type f ! -name all.tgz -delete
