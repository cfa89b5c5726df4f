#!/usr/bin/env bash
# Session 49, call 1: main's build (s49) on whatever GPU comes. Correctness of the Hopper kernels not yet run
# on the stop-48 build (band, ALiBi/sink, routing, varlen, decode; racecheck), then the fa grid beside SDPA
# flash/cuDNN, the window/softcap beside Flex, causal GQA from PyTorch, the op swapped into the compiled LM.
set -u
LIMIT=${LIMIT:-575}
python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/s49.tar.xz
export PYTHONUNBUFFERED=1
O=$OUT S=$PWD/.gpu/s49 T=$PWD/.gpu/s49/tests F=$PWD/.gpu/s49/tools/flashlm
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
LIBS=${NCCL:+$NCCL:}/usr/local/cuda/lib64
export LD_LIBRARY_PATH=$S/src:$LIBS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $O/gpu.txt
python3 -c "import torch;print(torch.__version__, torch.backends.cudnn.version())" | tee -a $O/gpu.txt
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
sum() { echo "[$((SECONDS-t0))s] $1 rc=$2 $(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\]|ERROR SUMMARY|RACECHECK SUMMARY' $O/$1.log | grep -v '^\[  FAILED  \] [A-Z]' | tr '\n' ' ')"
  grep -E '^\[  FAILED  \] [A-Z]' $O/$1.log | head -8; grep -m4 -E "Failure|Which is|error/tol" $O/$1.log; }
g() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < 15 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l stdbuf -oL -eL "$@" > $O/$n.log 2>&1; sum $n $?; }
r() { local n=$1 l=$2; shift 2  # a command with its own --out; log only
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE "error|Traceback" $O/$n.log; }
# 1. Tests: two disjoint GPU filters side by side (the fp64 reference runs on the host's cores).
A='Grid/CudaBandVsReference.*:CudaBand.*:*AlibiSink*:HopperBackwardSchedule.*:CudaAttention.*:Sm90Primitives.*:AttentionExtrasCuda.*:Fp8*Cuda*:AttentionNaN.*'
B='*Varlen*Cuda*:AttentionDecodeCuda.*:AttentionDecode.*'
(timeout 170 stdbuf -oL -eL $T/test_attention --gtest_brief=1 --gtest_filter="$A" > $O/tests-a.log 2>&1; echo $? > $O/tests-a.rc) &
(timeout 170 stdbuf -oL -eL $T/test_attention --gtest_brief=1 --gtest_filter="$B" > $O/tests-b.log 2>&1; echo $? > $O/tests-b.rc) &
wait; sum tests-a $(cat $O/tests-a.rc); sum tests-b $(cat $O/tests-b.rc)
small='Grid/CudaVsReference.*q65_k2100_*:Grid/CudaVsReference.*q127_k64_*:Grid/CudaVsReference.*q17_k130_h4x2_d128*:Grid/CudaVsReference.*q129_k97_h4x2_d256*:CudaAttention.QueryTilesThatSeeNoKey*:CudaAttention.EmptySequencesGiveZeroGradients:Packs/VarlenCudaVsReference.*d128*'
(g racecheck 110 compute-sanitizer --tool racecheck --error-exitcode 99 $T/test_attention --gtest_brief=1 --gtest_filter="$small" > $O/racecheck.sum) &
(FLASHLM_SM90_BWD_SCHEDULE=persistent g racecheck-persistent 110 compute-sanitizer --tool racecheck --error-exitcode 99 $T/test_attention --gtest_brief=1 --gtest_filter="$small" > $O/racecheck-persistent.sum) &
wait; cat $O/racecheck.sum $O/racecheck-persistent.sum
# 2. The fa grid, ours then SDPA (flash, cuDNN), compared.
FB=(attention-bench --device cuda --quiet --impl flash --dtype bf16)
r fa-ours 80 $F "${FB[@]}" --grid fa --warmup 5 --reps 20 --format json --out $O/ours-fa.json
r fa-peers 120 python3 scripts/peers/attention_peers.py --grid fa --backends flash,cudnn --dtype bf16 --warmup 5 --reps 20 --out $O/peers-fa.json
python3 scripts/peers/compare.py attention $O/ours-fa.json $O/peers-fa.json --peer sdpa-flash --peer sdpa-cudnn --min-seq 1024 > $O/compare-fa.md 2>&1; tail -8 $O/compare-fa.md
# 3. GQA 64/8 16k causal and not, CLI and from PyTorch beside SDPA.
r gqa-ours 40 $F "${FB[@]}" --batch 1 --heads 64 --kv-heads 8 --seq 16384 --d 128 --causal=0,1 --warmup 3 --reps 10 --format csv --out $O/gqa.csv
r gqa-torch 90 env FLASHLM_LIBRARY=$S/src/libflashlm_attention.so PYTHONPATH=python python3 scripts/torch_attention_bench.py --shapes 1x64x16384x128x8 --out $O/gqa-torch.json
tail -12 $O/gqa-torch.log
# 4. Sliding window 4096 at 32k and softcap at d256 8k beside FlexAttention.
r win-ours 40 $F "${FB[@]}" --batch 1 --heads 32 --seq 32768 --d 128 --causal=1 --window 4096,0 --warmup 3 --reps 10 --format json --out $O/ours-window.json
r win-full 40 $F "${FB[@]}" --batch 1 --heads 32 --seq 32768 --d 128 --causal=1 --warmup 3 --reps 10 --format json --out $O/ours-full32k.json
r win-flex 110 python3 scripts/peers/flex_attention_peer.py --shapes 1x32x32768x128 --causal 1 --window 4096,0 --dtype bf16 --warmup 3 --reps 10 --out $O/peers-window.json
python3 scripts/peers/compare.py attention $O/ours-window.json $O/peers-window.json --peer flex > $O/compare-window.md 2>&1; tail -4 $O/compare-window.md
# 5. The op swapped into the compiled CS336 small LM (issue 35 item 6).
r swap 150 env FLASHLM_LIBRARY=$S/src/libflashlm_attention.so PYTHONPATH=python python3 scripts/peers/attention_swap.py --shapes 1024x8,4096x4 --out $O/swap.json
tail -8 $O/swap.log
# 6. If time is left: softcap beside Flex, and persistent vs the default launch on the fa grid.
r cap-ours 30 $F "${FB[@]}" --batch 1 --heads 16 --seq 8192 --d 256 --causal=1 --softcap 50 --warmup 3 --reps 10 --format json --out $O/ours-softcap.json
r cap-flex 80 python3 scripts/peers/flex_attention_peer.py --shapes 1x16x8192x256 --causal 1 --softcap 50 --dtype bf16 --warmup 3 --reps 10 --out $O/peers-softcap.json
python3 scripts/peers/compare.py attention $O/ours-softcap.json $O/peers-softcap.json --peer flex > $O/compare-softcap.md 2>&1; tail -4 $O/compare-softcap.md
FLASHLM_SM90_BWD_SCHEDULE=persistent r fa-persistent 80 $F "${FB[@]}" --grid fa --warmup 5 --reps 20 --format json --out $O/ours-fa-persistent.json
echo "[$((SECONDS-t0))s] done"
