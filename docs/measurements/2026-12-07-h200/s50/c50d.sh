#!/usr/bin/env bash
# Session 50, a short call: main 35d2a69 (s50m) against s50-int dbd3589 (s50i: main + the softmax kept under its own
# P·V + per-head FP8 descales), interleaved on the fa grid and the FP8 forward, then what time is left of the
# fp64-oracle tests of s50i.
set -u
LIMIT=${LIMIT:-170}
O=$OUT
for s in s50m s50i; do python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/$s.tar.xz; done
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
LIBS=${NCCL:+$NCCL:}/usr/local/cuda/lib64
M=$PWD/.gpu/s50m K=$PWD/.gpu/s50i
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $O/gpu.txt
t0=$SECONDS
pack() { (cd $O && tar czf all.tgz --exclude=all.tgz *.log *.csv *.txt *.md 2>/dev/null); }
B=(attention-bench --device cuda --quiet --impl flash --warmup 3 --reps 10 --format csv)
for round in 1 2; do
  for v in m k; do b=$([ $v = m ] && echo $M || echo $K)
    LD_LIBRARY_PATH=$b/src:$LIBS timeout 60 $b/tools/flashlm "${B[@]}" --dtype bf16 --grid fa --out $O/ab-fa-$v-$round.csv > /dev/null 2>> $O/ab.log
    LD_LIBRARY_PATH=$b/src:$LIBS timeout 30 $b/tools/flashlm "${B[@]}" --dtype fp8 --batch 4 --heads 16 --seq 4096,16384 --d 128 --causal=0,1 --forward-only --out $O/ab-fp8-$v-$round.csv > /dev/null 2>> $O/ab.log
    echo "[$((SECONDS-t0))s] $v $round"
  done
  pack
done
python3 - "$O" <<'PY' | tee $O/ab-summary.md
import csv, glob, os, sys, collections, math
o = sys.argv[1]; rows = collections.defaultdict(list)
for f in sorted(glob.glob(os.path.join(o, 'ab-*.csv'))):
    _, set_, v, _r = os.path.basename(f)[:-4].split('-')
    for r in csv.DictReader(open(f)):
        key = (set_, r['dtype'], r['batch'], r['heads'], r['seq_q'], r['head_dim'], r['causal'])
        rows[(key, v)].append((float(r['fwd_ms']), float(r['bwd_ms'] or 'nan')))
med = lambda xs: sorted(xs)[len(xs) // 2]
g = collections.defaultdict(list)
print('| set, dtype, b, h, s, d, causal | main fwd / bwd ms | k fwd / bwd ms | main/k fwd | main/k bwd |\n|---|---|---|---|---|')
for k in sorted({k for k, _ in rows}):
    m, kk = rows.get((k, 'm'), []), rows.get((k, 'k'), [])
    if not m or not kk: continue
    rf = med([a for a, _ in m]) / med([a for a, _ in kk]); rb = med([b for _, b in m]) / med([b for _, b in kk])
    g[(k[0], 'fwd')].append(rf)
    if rb == rb: g[(k[0], 'bwd')].append(rb)
    print(f'| {", ".join(k)} | ' + ' '.join(f'{a:.3f}/{b:.3f}' for a, b in m) + ' | ' + ' '.join(f'{a:.3f}/{b:.3f}' for a, b in kk) + f' | {rf:.3f} | {rb:.3f} |')
for (s, p), xs in sorted(g.items()):
    print(f'geomean {s} {p} main/k: {math.exp(sum(map(math.log, xs)) / len(xs)):.4f} over {len(xs)} (min {min(xs):.3f}, max {max(xs):.3f})')
PY
pack
left=$((LIMIT - (SECONDS - t0) - 5))
if (( left > 20 )); then
  LD_LIBRARY_PATH=$K/src:$LIBS timeout $left stdbuf -oL $K/tests/test_attention --gtest_filter='Grid/CudaVsReference.*_d128_*:Grid/CudaVsReference.*_d64_*:*Fp8*Cuda*' > $O/k-tests.log 2>&1
  echo "[$((SECONDS-t0))s] tests rc=$? $(grep -c '^\[       OK' $O/k-tests.log) ok, $(grep -c '^\[  FAILED  \] [A-Z]' $O/k-tests.log) failed"
  grep -m5 '^\[  FAILED  \] [A-Z]' $O/k-tests.log
fi
pack
ls $O | grep -v all.tgz | while read f; do rm -f "$O/$f"; done
echo "[$((SECONDS-t0))s] done"
