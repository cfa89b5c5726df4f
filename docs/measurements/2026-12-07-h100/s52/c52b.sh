#!/usr/bin/env bash
# Session 52, call 2: the attention op's host cost per call on CUDA (issue 35 item 6) with main c502c61's python
# (old) and this tree's (new: direct CPU/CUDA kernels); perf of the bare C loop where perf exists; the op swapped
# into the compiled small LM at 1024 x 8 and 4096 x 4 beside SDPA flash and cuDNN (new python).
set -u
export PYTHONUNBUFFERED=1
O=$OUT
[ -d .gpu/s52m ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/s52m.tar.xz
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
LIBS=${NCCL:+$NCCL:}/usr/local/cuda/lib64
M=$PWD/.gpu/s52m
export LD_LIBRARY_PATH=$M/src:$LIBS FLASHLM_LIBRARY=$M/src/libflashlm_attention.so
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt; lscpu | grep -E "Model name|^CPU\(s\)" | tee -a $O/gpu.txt
echo "library: $(cat $M/commit); python new: $(git log --oneline -1 2>/dev/null)" | tee -a $O/gpu.txt
t0=$SECONDS
for py in old new; do P=$([ $py = old ] && echo $M/py/python || echo $PWD/python)
  PYTHONPATH=$P timeout 100 python3 scripts/torch_op_overhead.py --device cuda --shape 8x12x1024x64 --calls 500 --repeats 5 --out $O/op-overhead-$py.json > $O/op-overhead-$py.log 2>&1
  echo "[$((SECONDS-t0))s] op-overhead $py"; grep "^|" $O/op-overhead-$py.log
done
if command -v perf >/dev/null; then
  PYTHONPATH=$PWD/python timeout 60 perf record -g -o $O/perf.data python3 cloop.py > $O/cloop.log 2>&1
  perf report -i $O/perf.data --no-children --sort dso,symbol -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | cut -c1-150 | head -60 > $O/perf.txt; head -45 $O/perf.txt; rm -f $O/perf.data
else
  echo "no perf"; PYTHONPATH=$PWD/python timeout 60 python3 cloop.py
fi
echo "[$((SECONDS-t0))s] swap"
PYTHONPATH=$PWD/python:scripts/peers timeout 300 python3 scripts/peers/attention_swap.py --shapes 1024x8,4096x4 --attention sdpa-flash,sdpa-cudnn,flashlm --out $O/swap.json > $O/swap.log 2>&1
grep "step median" $O/swap.log
echo "[$((SECONDS-t0))s] done"
