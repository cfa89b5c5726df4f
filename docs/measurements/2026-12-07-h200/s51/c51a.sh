#!/usr/bin/env bash
# Session 51, call 1: the LM rows on the H200 (issue 32: xl FP8 step beside torch.compile bf16 and torchao's float8
# training; the 8B FP8 row; issue 35 item 6: the op swapped into the compiled small LM). Build $BUILD (s51m: main 830f2a9
# + per-head FP8 descales; the LM code is main's).
set -u
LIMIT=${LIMIT:-560}
BUILD=${BUILD:-s51m}
export PYTHONUNBUFFERED=1
O=$OUT
[ -d .gpu/$BUILD ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/$BUILD.tar.xz
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
LIBS=${NCCL:+$NCCL:}/usr/local/cuda/lib64
S=$PWD/.gpu/$BUILD F=$PWD/.gpu/$BUILD/tools/flashlm
export LD_LIBRARY_PATH=$S/src:$LIBS
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $O/gpu.txt
python3 -c "import torch;print(torch.__version__, torch.backends.cudnn.version())" | tee -a $O/gpu.txt
echo "build $BUILD: $(cat $S/commit)" | tee -a $O/gpu.txt
pip install -q --no-deps --no-index --target /tmp/tao .gpu/torchao-*.whl > $O/torchao-install.log 2>&1; echo "torchao install rc=$?"
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
pack() { (cd $O && tar czf all.tgz --exclude=all.tgz *.log *.csv *.json *.txt *.md 2>/dev/null); }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE "error|Traceback" $O/$n.log; }
LM=(bench --device cuda --model xl --context 512 --batch 4 --pass step --optimizer-state bf16 --warmup 5 --steps 20 --format json)
# 1. xl, context 512 x 4: ours bf16 and FP8 (bf16 moments), the peers, ours again.
r xl-ours-1 90 $F "${LM[@]}" --precision bf16,fp8 --out $O/xl-ours-1.json
r xl-peers 240 env PYTHONPATH=/tmp/tao:scripts/peers python3 scripts/peers/lm_peers.py --models xl --modes bf16-compile,fp8-torchao-compile --passes step --warmup 5 --steps 20 --out $O/xl-peers.json
r xl-ours-2 60 $F "${LM[@]}" --precision fp8 --out $O/xl-ours-2.json
python3 - $O <<'PY' | tee $O/xl-summary.md
import json, sys, os
o = sys.argv[1]
for f in ('xl-ours-1.json', 'xl-peers.json', 'xl-ours-2.json'):
    p = os.path.join(o, f)
    if not os.path.exists(p): print(f, 'missing'); continue
    try: d = json.load(open(p))
    except Exception as e: print(f, 'unreadable', e); continue
    for r in d.get('records', []):
        print(f"| {f} | {r.get('impl')} | {r.get('model')} | {r.get('precision')} | {r.get('status','ok')} | median {r.get('median_ms')} | mean {r.get('mean_ms')} |")
PY
pack
# 2. The op swapped into the compiled CS336 small LM, contexts 1024 x 8 and 4096 x 4 (issue 35 item 6).
r swap 170 env FLASHLM_LIBRARY=$S/src/libflashlm_attention.so PYTHONPATH=$S/py/python:scripts/peers python3 scripts/peers/attention_swap.py --shapes 1024x8,4096x4 --out $O/swap.json
tail -8 $O/swap.log
pack
# 3. The 8B leaderboard configuration in FP8 (an extra row; bf16-pure stays the leaderboard's), where it fits.
if grep -q H200 $O/gpu.txt; then
  r 8b-fp8 150 $F bench --device cuda --model cs336-8b --context 32768 --batch 2 --precision bf16-pure-fp8 --pass step --recompute auto --atomic-attention-backward --warmup 1 --steps 2 --format json --out $O/8b-fp8.json
  tail -5 $O/8b-fp8.log
fi
pack
ls $O | grep -v all.tgz | while read f; do rm -f "$O/$f"; done
echo "[$((SECONDS-t0))s] done"
