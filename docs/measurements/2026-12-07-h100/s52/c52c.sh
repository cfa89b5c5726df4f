#!/usr/bin/env bash
# Session 52, call 3: host cost per call at a tiny shape (this tree's python); the swapped op's host profile at
# 1024 x 8; the xl FP8 step with the Hopper (atomic) attention backward and its kernel table; the torchao peer.
set -u
LIMIT=${LIMIT:-540}
export PYTHONUNBUFFERED=1
O=$OUT
[ -d .gpu/s52m ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/s52m.tar.xz
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
LIBS=${NCCL:+$NCCL:}/usr/local/cuda/lib64
M=$PWD/.gpu/s52m F=$M/tools/flashlm
export LD_LIBRARY_PATH=$M/src:$LIBS FLASHLM_LIBRARY=$M/src/libflashlm_attention.so
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt; lscpu | grep -E "Model name" | tee -a $O/gpu.txt
echo "library and flashlm: $(cat $M/commit)" | tee -a $O/gpu.txt
pip install -q --no-deps --no-index --target /tmp/tao .gpu/torchao-*.whl > $O/torchao-install.log 2>&1; echo "torchao install rc=$?"
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
pack() { (cd $O && tar czf all.tgz --exclude=all.tgz --exclude=ncu.tgz *.log *.csv *.json *.txt *.md 2>/dev/null); }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE "error|Traceback" $O/$n.log; }
# The build with one device view of the FP8 head descales (s52d): its FP8 tests first.
[ -d .gpu/s52d ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/s52d.tar.xz
D=$PWD/.gpu/s52d; echo "s52d: $(cat $D/commit)" | tee -a $O/gpu.txt
r d-fp8 90 env LD_LIBRARY_PATH=$D/src:$LIBS $D/tests/test_attention --gtest_brief=1 --gtest_filter='Grid/Fp8PerHeadCudaForward.*:Fp8PerHeadCuda.*:Grid/Fp8PerHeadCudaBackward.*:Fp8AttentionCuda.*:Grid/Fp8CudaBackwardVsReference.*_d128_*'
grep -E "^\[  (PASSED|FAILED) " $O/d-fp8.log | head -6
r op-tiny 60 env PYTHONPATH=$PWD/python python3 scripts/torch_op_overhead.py --device cuda --shape 1x1x128x64 --calls 1000 --repeats 5 --out $O/op-tiny.json
grep "^|" $O/op-tiny.log
r swap-profile 120 env PYTHONPATH=$PWD/python:scripts/peers python3 scripts/peers/attention_swap.py --shapes 1024x8 --attention flashlm,sdpa-cudnn --profile --rows 30 --out $O/swap-profile.json
grep -E "step median|host: wall" $O/swap-profile.log
pack
LM=(bench --device cuda --model xl --context 512 --batch 4 --pass step --optimizer-state bf16 --warmup 5 --steps 20 --format json)
r xl-det 60 $F "${LM[@]}" --precision bf16,fp8 --out $O/xl-det.json
r xl-atomic 60 $F "${LM[@]}" --precision bf16,fp8 --atomic-attention-backward --out $O/xl-atomic.json
r xl-kernels 80 $F bench --device cuda --model xl --context 512 --batch 4 --pass step --optimizer-state bf16 --precision fp8 --atomic-attention-backward --warmup 3 --steps 5 --profile-kernels
grep -hE "\] xl ctx" $O/xl-*.log
pack
# Decoding at batch 1, 16k (issue 31's one row under 70%): ncu on the split and combine kernels, cold L2.
if command -v ncu >/dev/null; then
  r ncu-decode 90 ncu --set full --cache-control all -k regex:"split_kernel|combine_kernel" -c 2 -o $O/decode-b1-16k $F attention-bench --device cuda --decode --batch 1 --cache 16384 --warmup 1 --reps 1
  ncu --import $O/decode-b1-16k.ncu-rep --page details > $O/ncu-decode-details.txt 2>&1; grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size|Elapsed Cycles" $O/ncu-decode-details.txt | head -24
  (cd $O && tar czf ncu.tgz decode-b1-16k.ncu-rep 2>/dev/null); rm -f $O/decode-b1-16k.ncu-rep
fi
pack
r xl-peers 400 env PYTHONPATH=/tmp/tao:scripts/peers python3 scripts/peers/lm_peers.py --models xl --modes fp8-torchao-compile,bf16-compile --passes step --warmup 5 --steps 20 --out $O/xl-peers.json
tail -4 $O/xl-peers.log
pack
ls $O | grep -vE "all.tgz|ncu.tgz" | while read f; do rm -f "$O/$f"; done
echo "[$((SECONDS-t0))s] done"
