#!/usr/bin/env bash
# Session 51, call 2 (attention). Builds: s51m = main 830f2a9 + per-head FP8 descales on CUDA (its 16-bit kernels' SASS
# is main's) + the lse bound that counts FP8 accumulation; s51p = s51m + bwd-pmin + bwd-query-order.
# 1. Tests of both, side by side. 2. s51m's fa grid beside SDPA flash/cuDNN; causal GQA from PyTorch. 3. A/B s51m
# against s51p (ascending, descending), interleaved. 4. If time is left: decoding, the FP8 forward.
set -u
LIMIT=${LIMIT:-560}
export PYTHONUNBUFFERED=1
O=$OUT
for s in s51m s51p; do [ -f .gpu/$s.tar.xz ] && { [ -d .gpu/$s ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/$s.tar.xz; }; done
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
LIBS=${NCCL:+$NCCL:}/usr/local/cuda/lib64
M=$PWD/.gpu/s51m P=$PWD/.gpu/s51p F=$M/tools/flashlm
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $O/gpu.txt
python3 -c "import torch;print(torch.__version__, torch.backends.cudnn.version())" | tee -a $O/gpu.txt
for s in $M $P; do echo "$(basename $s): $(cat $s/commit 2>/dev/null)" | tee -a $O/gpu.txt; done
PEAK=$(grep -q H200 $O/gpu.txt && echo 4800 || echo 3350)
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
# 1. Tests.
TL=${TL:-140}
tst m-fp8 $M $TL 'Grid/Fp8PerHeadCudaForward.*:Fp8PerHeadCuda.*:Grid/Fp8PerHeadCudaBackward.*:Grid/Fp8VsReference.*:Grid/Fp8CudaBackwardVsReference.*:Fp8AttentionCuda.*:Fp8Attention.*:AttentionCapabilities.*' X=1
(cd $M/py && timeout $TL env FLASHLM_LIBRARY=$M/src/libflashlm_attention.so LD_LIBRARY_PATH=$M/src:$LIBS PYTHONPATH=python python3 -m pytest -q tests/python/test_fp8.py > $O/m-py.log 2>&1; echo $? > $O/m-py.rc) &
if [ -d $P ]; then
  tst p-grid $P $TL 'Grid/CudaVsReference.*_d64_*:Grid/CudaVsReference.*_d128_*:Grid/CudaBandVsReference.*q65_k2100*:CudaAttention.HopperBackwardQueryOrders*' X=1
  tst p-desc $P $TL 'Grid/CudaVsReference.*_d128_*:Grid/CudaBandVsReference.*q65_k2100*_d128_*' FLASHLM_SM90_BWD_ORDER=descending
fi
wait
for n in m-fp8 m-py p-grid p-desc; do [ -f $O/$n.rc ] && sum $n $(cat $O/$n.rc); done
pack
export LD_LIBRARY_PATH=$M/src:$LIBS
FB=(attention-bench --device cuda --quiet --impl flash --dtype bf16)
# 2. The fa grid, ours then SDPA (flash, cuDNN), compared; causal GQA 64/8 16k from PyTorch.
r fa-ours 70 $F "${FB[@]}" --grid fa --warmup 5 --reps 20 --format json --out $O/ours-fa.json
r fa-peers 110 python3 scripts/peers/attention_peers.py --grid fa --backends flash,cudnn --dtype bf16 --warmup 5 --reps 20 --out $O/peers-fa.json
python3 scripts/peers/compare.py attention $O/ours-fa.json $O/peers-fa.json --peer sdpa-flash --peer sdpa-cudnn --min-seq 1024 > $O/compare-fa.md 2>&1; tail -8 $O/compare-fa.md
pack
r gqa-torch 80 env FLASHLM_LIBRARY=$M/src/libflashlm_attention.so PYTHONPATH=$M/py/python python3 scripts/torch_attention_bench.py --shapes 1x64x16384x128x8 --out $O/gqa-torch.json
grep -A6 "flashlm speed" $O/gqa-torch.log
pack
# 3. A/B: m, p ascending, p descending; the fa grid's backward and GQA 64/8 16k.
B=(attention-bench --device cuda --quiet --impl flash --warmup 3 --reps 10 --format csv)
ab() { local tag=$1 bin=$2 ord=$3; shift 3
  env FLASHLM_SM90_BWD_ORDER=$ord LD_LIBRARY_PATH=$bin/src:$LIBS timeout 60 $bin/tools/flashlm "${B[@]}" "$@" --out $O/ab-$tag.csv > /dev/null 2>> $O/ab.log; }
if [ -d $P ] && grep -q "rc=0" <(sum p-grid $(cat $O/p-grid.rc)); then
for round in 1 2; do
  (( $(left) < 130 )) && { echo "round $round skipped: time"; break; }
  for v in m pa pd; do b=$([ $v = m ] && echo $M || echo $P); ord=$([ $v = pd ] && echo descending || echo ascending)
    ab fa-$v-$round $b $ord --dtype bf16 --grid fa
    ab gqa-$v-$round $b $ord --dtype bf16 --batch 1 --heads 64 --kv-heads 8 --seq 16384 --d 128 --causal=0,1
  done
  echo "[$((SECONDS-t0))s] ab round $round"; pack
done
python3 - "$O" <<'PY' | tee $O/ab-summary.md
import csv, glob, os, sys, collections, math
o = sys.argv[1]; rows = collections.defaultdict(list)
for f in sorted(glob.glob(os.path.join(o, 'ab-*.csv'))):
    set_, v, _r = os.path.basename(f)[3:-4].split('-')
    for r in csv.DictReader(open(f)):
        key = (set_, r['batch'], r['heads'], r['kv_heads'], r['seq_q'], r['head_dim'], r['causal'])
        rows[(key, v)].append((float(r['fwd_ms']), float(r['bwd_ms'] or 'nan')))
def med(xs): xs = sorted(xs); return xs[len(xs)//2] if xs else float('nan')
g = collections.defaultdict(list)
print('| set, b, h, hk, s, d, causal | m bwd ms | pa bwd ms | pd bwd ms | m/pa | m/pd |\n|---|---|---|---|---|---|')
for k in sorted({k for k, _ in rows}):
    b = {v: [y for _, y in rows.get((k, v), [])] for v in ('m', 'pa', 'pd')}
    if not b['m']: continue
    rs = [med(b['m']) / med(b[v]) if b[v] else float('nan') for v in ('pa', 'pd')]
    for v, x in zip(('pa', 'pd'), rs):
        if x == x: g[(k[0], v)].append(x)
    print(f'| {", ".join(k)} | ' + ' | '.join(' '.join(f'{y:.3f}' for y in b[v]) for v in ('m', 'pa', 'pd')) + f' | {rs[0]:.3f} | {rs[1]:.3f} |')
for (s, v), xs in sorted(g.items()):
    print(f'geomean bwd {s} m/{v}: {math.exp(sum(map(math.log, xs)) / len(xs)):.4f} over {len(xs)} (min {min(xs):.3f}, max {max(xs):.3f})')
PY
fi
pack
# 4. If time is left: decoding (issue 31), the FP8 forward (issue 33).
r decode-ours 45 $F attention-bench --device cuda --decode --peak-gbps $PEAK --format json --out $O/decode.json
r fp8 30 $F attention-bench --device cuda --quiet --impl flash --dtype fp8 --batch 4 --heads 16 --seq 16384 --d 128 --causal=0,1 --forward-only --warmup 5 --reps 20 --format csv --out $O/fp8-fwd.csv
r decode-peers 70 python3 scripts/peers/decode_peers.py --backends cudnn,flash --peak-gbps $PEAK --out $O/peers-decode.json
pack
ls $O | grep -v all.tgz | while read f; do rm -f "$O/$f"; done
echo "[$((SECONDS-t0))s] done"
