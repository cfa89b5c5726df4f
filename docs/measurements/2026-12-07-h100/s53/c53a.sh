#!/usr/bin/env bash
# Prepared at the end of stop 52 (see NEXT.md). Builds: s53m = main 61ef643; s53c = s53m + decode-combine-loads-first.
set -u
LIMIT=${LIMIT:-540}
export PYTHONUNBUFFERED=1
O=$OUT
for s in s53m s53c; do [ -d .gpu/$s ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/$s.tar.xz; done
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
LIBS=${NCCL:+$NCCL:}/usr/local/cuda/lib64
M=$PWD/.gpu/s53m C=$PWD/.gpu/s53c F=$M/tools/flashlm
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
for s in $M $C; do echo "$(basename $s): $(cat $s/commit)" | tee -a $O/gpu.txt; done
{ which g++ c++ gcc nvcc ninja cmake; python3 -c "import torch,sys;print(torch.__version__, sys.version)"; ls $(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")/include/torch/csrc/stable 2>&1 | head; } > $O/toolchain.txt 2>&1
PEAK=$(grep -q H200 $O/gpu.txt && echo 4800 || echo 3350)
pip install -q --no-deps --no-index --target /tmp/tao .gpu/torchao-*.whl > $O/torchao-install.log 2>&1
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
pack() { (cd $O && tar czf all.tgz --exclude=all.tgz *.log *.csv *.json *.txt *.md 2>/dev/null); }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE "error|Traceback" $O/$n.log; }
r c-tests 90 env LD_LIBRARY_PATH=$C/src:$LIBS $C/tests/test_attention --gtest_brief=1 --gtest_filter='AttentionDecode*:*Kvcache*:*KvCache*'
grep -E "^\[  (PASSED|FAILED) " $O/c-tests.log | head -5
r c-memcheck 90 env LD_LIBRARY_PATH=$C/src:$LIBS compute-sanitizer --tool memcheck $C/tests/test_attention --gtest_brief=1 --gtest_filter='AttentionDecodeCuda.*'
tail -2 $O/c-memcheck.log
if grep -q "PASSED" $O/c-tests.log && ! grep -q "FAILED" $O/c-tests.log; then
  for round in 1 2; do for v in m c; do b=$([ $v = m ] && echo $M || echo $C)
    r dec-$v-$round 45 env LD_LIBRARY_PATH=$b/src:$LIBS $b/tools/flashlm attention-bench --device cuda --decode --peak-gbps $PEAK --format json --out $O/dec-$v-$round.json
  done; done
fi
pack
export LD_LIBRARY_PATH=$M/src:$LIBS
LM=(bench --device cuda --model xl --context 512 --batch 4 --pass step --optimizer-state bf16 --warmup 5 --steps 20 --format json --atomic-attention-backward)
r xl-fp8 60 $F "${LM[@]}" --precision bf16,fp8 --out $O/xl-fp8.json
r xl-fp8-tune 120 $F "${LM[@]}" --precision fp8 --gemm-autotune 8 --out $O/xl-fp8-tune.json
grep -hE "\] xl ctx" $O/xl-*.log
pack
if grep -q H200 $O/gpu.txt; then
  r swap 200 env FLASHLM_LIBRARY=$M/src/libflashlm_attention.so PYTHONPATH=$M/py/python:scripts/peers python3 scripts/peers/attention_swap.py --shapes 1024x8,4096x4 --out $O/swap.json
  grep "step median" $O/swap.log
fi
pack
r xl-peers 400 env PYTHONPATH=/tmp/tao:scripts/peers python3 scripts/peers/lm_peers.py --models xl --modes fp8-torchao-compile,bf16-compile --passes step --warmup 5 --steps 20 --out $O/xl-peers.json
tail -4 $O/xl-peers.log
pack
ls $O | grep -v all.tgz | while read f; do rm -f "$O/$f"; done
echo "[$((SECONDS-t0))s] done"
