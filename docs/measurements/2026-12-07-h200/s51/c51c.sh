#!/usr/bin/env bash
# Session 51, call 3 (warm machine): the fa grid beside SDPA again (a second round for s51m), the sliding window and
# soft-capping beside FlexAttention (issue 31).
set -u
LIMIT=${LIMIT:-400}
export PYTHONUNBUFFERED=1
O=$OUT
[ -d .gpu/s51m ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/s51m.tar.xz
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
LIBS=${NCCL:+$NCCL:}/usr/local/cuda/lib64
M=$PWD/.gpu/s51m F=$M/tools/flashlm
export LD_LIBRARY_PATH=$M/src:$LIBS
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $O/gpu.txt
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
pack() { (cd $O && tar czf all.tgz --exclude=all.tgz *.log *.csv *.json *.txt *.md 2>/dev/null); }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE "error|Traceback" $O/$n.log; }
FB=(attention-bench --device cuda --quiet --impl flash --dtype bf16)
r win-ours 40 $F "${FB[@]}" --batch 1 --heads 32 --seq 32768 --d 128 --causal=1 --window 4096,0 --warmup 3 --reps 10 --format json --out $O/ours-window.json
r win-full 40 $F "${FB[@]}" --batch 1 --heads 32 --seq 32768 --d 128 --causal=1 --warmup 3 --reps 10 --format json --out $O/ours-full32k.json
r win-flex 110 python3 scripts/peers/flex_attention_peer.py --shapes 1x32x32768x128 --causal 1 --window 4096,0 --dtype bf16 --warmup 3 --reps 10 --out $O/peers-window.json
python3 scripts/peers/compare.py attention $O/ours-window.json $O/peers-window.json --peer flex > $O/compare-window.md 2>&1; tail -4 $O/compare-window.md
pack
r fa-ours 70 $F "${FB[@]}" --grid fa --warmup 5 --reps 20 --format json --out $O/ours-fa.json
r fa-peers 110 python3 scripts/peers/attention_peers.py --grid fa --backends flash,cudnn --dtype bf16 --warmup 5 --reps 20 --out $O/peers-fa.json
python3 scripts/peers/compare.py attention $O/ours-fa.json $O/peers-fa.json --peer sdpa-flash --peer sdpa-cudnn --min-seq 1024 > $O/compare-fa.md 2>&1; tail -3 $O/compare-fa.md
pack
r cap-ours 30 $F "${FB[@]}" --batch 1 --heads 16 --seq 8192 --d 256 --causal=1 --softcap 50 --warmup 3 --reps 10 --format json --out $O/ours-softcap.json
r cap-flex 90 python3 scripts/peers/flex_attention_peer.py --shapes 1x16x8192x256 --causal 1 --softcap 50 --dtype bf16 --warmup 3 --reps 10 --out $O/peers-softcap.json
python3 scripts/peers/compare.py attention $O/ours-softcap.json $O/peers-softcap.json --peer flex > $O/compare-softcap.md 2>&1; tail -4 $O/compare-softcap.md
pack
ls $O | grep -v all.tgz | while read f; do rm -f "$O/$f"; done
echo "[$((SECONDS-t0))s] done"
