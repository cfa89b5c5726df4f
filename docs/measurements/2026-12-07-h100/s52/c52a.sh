#!/usr/bin/env bash
# Session 52, call 1 (ran on an H100 80GB HBM3; the A/B step was skipped by the failed FP8 tests and the fa-grid A/B was run by hand: ab-fa-*.csv). Builds: s52m = main c502c61; s52l = 920d4a1 + dev/experiments' lazy-rescale patches (FP8, 16-bit).
# 1. s52l's tests (FP8, Hopper 16-bit grids). 2. A/B m vs l interleaved: FP8 forward rows, fa grid forward.
# 3. Issue 35 item 6: host profile of the swapped op at 1024x8; the op's host cost per call on CUDA.
set -u
LIMIT=${LIMIT:-560}
export PYTHONUNBUFFERED=1
O=$OUT
for s in s52m s52l; do [ -f .gpu/$s.tar.xz ] && { [ -d .gpu/$s ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/$s.tar.xz; }; done
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
LIBS=${NCCL:+$NCCL:}/usr/local/cuda/lib64
M=$PWD/.gpu/s52m L=$PWD/.gpu/s52l F=$M/tools/flashlm
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $O/gpu.txt
python3 -c "import torch;print(torch.__version__, torch.backends.cudnn.version())" | tee -a $O/gpu.txt
for s in $M $L; do echo "$(basename $s): $(cat $s/commit 2>/dev/null)" | tee -a $O/gpu.txt; done
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
pack() { (cd $O && tar czf all.tgz --exclude=all.tgz *.log *.csv *.json *.txt *.md 2>/dev/null); }
sum() { echo "[$((SECONDS-t0))s] $1 rc=$2 $(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\]|passed|failed' $O/$1.log | grep -v '^\[  FAILED  \] [A-Z]' | tail -3 | tr '\n' ' ')"
  grep -E '^\[  FAILED  \] [A-Z]|^FAILED' $O/$1.log | head -8; grep -m4 -E "Failure|Which is|error/tol|lse of" $O/$1.log; }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE "error|Traceback" $O/$n.log; }
tst() { local n=$1 b=$2 l=$3 f=$4; shift 4
  (timeout $l stdbuf -oL -eL env "$@" LD_LIBRARY_PATH=$b/src:$LIBS $b/tests/test_attention --gtest_brief=1 --gtest_filter="$f" > $O/$n.log 2>&1; echo $? > $O/$n.rc) & }
# 1. Tests of the lazy rescale.
TL=${TL:-150}
tst l-fp8 $L $TL 'Fp8AttentionCuda.*:Grid/Fp8VsReference.*:Grid/Fp8PerHeadCudaForward.*:AttentionNaN*' X=1
tst l-16 $L $TL 'CudaAttention.Hopper*:Grid/CudaVsReference.*_d64_*:Grid/CudaVsReference.*_d128_*:*HeadDimPair*' X=1
wait
for n in l-fp8 l-16; do [ -f $O/$n.rc ] && sum $n $(cat $O/$n.rc); done
pack
# 2. A/B, interleaved: FP8 forward rows and the fa grid's forward.
B=(attention-bench --device cuda --quiet --impl flash --warmup 5 --reps 20 --forward-only --format csv)
ab() { local tag=$1 bin=$2; shift 2
  LD_LIBRARY_PATH=$bin/src:$LIBS timeout 80 $bin/tools/flashlm "${B[@]}" "$@" --out $O/ab-$tag.csv > /dev/null 2>> $O/ab.log; }
if grep -q 0 $O/l-fp8.rc && grep -q 0 $O/l-16.rc; then
for round in 1 2; do
  (( $(left) < 150 )) && { echo "round $round skipped: time"; break; }
  for v in m l; do b=$([ $v = m ] && echo $M || echo $L)
    ab fp8-$v-$round $b --dtype fp8 --batch 4 --heads 16 --seq 4096,16384 --d 64,128 --causal=0,1
    ab fa-$v-$round $b --dtype bf16 --grid fa
  done
  echo "[$((SECONDS-t0))s] ab round $round"; pack
done
python3 - "$O" <<'PY' | tee $O/ab-summary.md
import csv, glob, os, sys, collections, math
o = sys.argv[1]; rows = collections.defaultdict(list)
for f in sorted(glob.glob(os.path.join(o, 'ab-*.csv'))):
    set_, v, _r = os.path.basename(f)[3:-4].split('-')
    for r in csv.DictReader(open(f)):
        key = (set_, r['batch'], r['heads'], r['seq_q'], r['head_dim'], r['causal'])
        rows[(key, v)].append(float(r['fwd_ms']))
def med(xs): xs = sorted(xs); return xs[len(xs)//2] if xs else float('nan')
g = collections.defaultdict(list)
print('| set, b, h, s, d, causal | m fwd ms | l fwd ms | m/l |\n|---|---|---|---|')
for k in sorted({k for k, _ in rows}):
    m, l = rows.get((k, 'm'), []), rows.get((k, 'l'), [])
    if not m or not l: continue
    x = min(m) / min(l); g[k[0]].append(x)
    print(f'| {", ".join(k)} | ' + ' '.join(f'{y:.3f}' for y in m) + ' | ' + ' '.join(f'{y:.3f}' for y in l) + f' | {x:.3f} |')
for s, xs in sorted(g.items()):
    print(f'geomean fwd {s} m/l (best of rounds): {math.exp(sum(map(math.log, xs)) / len(xs)):.4f} over {len(xs)} (min {min(xs):.3f}, max {max(xs):.3f})')
PY
fi
pack
# 3. Issue 35 item 6: where the host time goes at 1024 x 8; the op's host cost per call on CUDA.
export LD_LIBRARY_PATH=$M/src:$LIBS
r swap-profile 150 env FLASHLM_LIBRARY=$M/src/libflashlm_attention.so PYTHONPATH=$M/py/python:scripts/peers python3 scripts/peers/attention_swap.py --shapes 1024x8 --attention flashlm,sdpa-cudnn --profile --rows 30 --out $O/swap-profile.json
grep -E "step median|host: wall" $O/swap-profile.log
r op-overhead 90 env FLASHLM_LIBRARY=$M/src/libflashlm_attention.so PYTHONPATH=$M/py/python python3 scripts/torch_op_overhead.py --device cuda --shape 8x12x1024x64 --calls 500 --repeats 5 --out $O/op-overhead.json
tail -20 $O/op-overhead.log
pack
ls $O | grep -v all.tgz | while read f; do rm -f "$O/$f"; done
echo "[$((SECONDS-t0))s] done"
