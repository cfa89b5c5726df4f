#!/usr/bin/env bash
# On an H200 (or any sm_90 GPU): the Hopper backward's checks and timings in one device call.
#   scripts/gpu-hopper-bwd.sh BIN_DIR PEERS_DIR OUT_DIR [tests|sanitize|ab|bench|peers|all ...]
# BIN_DIR holds flashlm, test_attention, test_sm90 and libflashlm.so; PEERS_DIR shared/bench's scripts.
# The device tool returns few files: pass a scratch OUT_DIR and tar it into $OUT.
# tests: the wrappers' unit tests, the CUDA grid and CudaAttention tests on the Hopper path (3 repeats: a
# moving error is a race), then forced onto the mma.sync fallback. sanitize: compute-sanitizer memcheck,
# racecheck and synccheck on a small filter. bench: the fa grid (forward + backward) on the Hopper path and
# on the fallback, and the causal GQA shape. ab: BIN_DIR's libflashlm.so against BIN_DIR/b's (another
# build) at 16k, d64 and d128, causal and not, interleaved twice. peers: SDPA flash and cuDNN on the fa
# grid, compared with each fa grid run of this call. The GPU time of one call is short: name only what
# the call needs (the measurements of 2026-12-01 ran "tests bench" and then "ab peers" with the fa grid
# of the Hopper path, a single grid run and a racecheck).
set -uo pipefail
bin=$1 peers=$2 out=$3
shift 3
what=" ${*:-all} "
mkdir -p "$out"
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=$bin:${nccl}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
has() { [[ $what == *" $1 "* || $what == *" all "* ]]; }
filter='Grid/CudaVsReference.*:CudaAttention.*'

if has tests; then
  echo "== sm90 wrappers"
  timeout 60 "$bin/test_sm90" --gtest_brief=1 2>&1 | tail -8
  echo "== CUDA grid on the Hopper path (x3)"
  SECONDS=0
  timeout 240 "$bin/test_attention" --gtest_filter="$filter" --gtest_repeat=3 --gtest_brief=1 > "$out/grid-sm90.log" 2>&1
  echo "exit $? in ${SECONDS}s"; grep -E "^\[  FAILED|Failure|rror" "$out/grid-sm90.log" | sort | uniq -c | head -20
  grep -E "PASSED|tests ran" "$out/grid-sm90.log" | tail -2
  grep -B2 -A8 -m3 "Failure" "$out/grid-sm90.log" | head -60
  echo "== CUDA grid, FLASHLM_ATTENTION_KERNEL=mma"
  SECONDS=0
  FLASHLM_ATTENTION_KERNEL=mma timeout 150 "$bin/test_attention" --gtest_filter="$filter" --gtest_brief=1 > "$out/grid-mma.log" 2>&1
  echo "exit $? in ${SECONDS}s"; grep -E "^\[  FAILED" "$out/grid-mma.log" | head -10; grep -E "PASSED|tests ran" "$out/grid-mma.log" | tail -2
fi

if has sanitize; then
  small='Grid/CudaVsReference.*q127_k64_*:Grid/CudaVsReference.*q17_k130_h4x2_d128*:CudaAttention.QueryTilesThatSeeNoKey*:CudaAttention.EmptySequencesGiveZeroGradients'
  for tool in memcheck racecheck synccheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 99 "$bin/test_attention" --gtest_filter="$small" \
      --gtest_brief=1 > "$out/sanitizer-$tool.log" 2>&1
    echo "$tool: exit $?; $(grep -m1 'ERROR SUMMARY\|RACECHECK SUMMARY' "$out/sanitizer-$tool.log")"
    grep -m3 -E "Invalid|Race|hazard|Barrier" "$out/sanitizer-$tool.log"
  done
fi

bench="$bin/flashlm attention-bench --device cuda --quiet --impl flash --dtype bf16 --warmup 10 --reps 30"
show() { python3 -c "
import json
for r in json.load(open('$1'))['records']: print('$2', 'd', r['head_dim'], 'h', r['heads'], 'kv', r['kv_heads'], 'causal', r['causal'], 'fwd %.3f bwd %.3f ms, bwd %.1f TFLOP/s, peak bwd %.0f MiB' % (r['fwd_ms'], r['bwd_ms'], r['bwd_tflops'], r['peak_bwd_mib']), r['status'])"; }
if has ab; then
  echo "== A/B at 16k: a = BIN_DIR, b = BIN_DIR/b"
  for v in a b a b; do
    lib=$bin; [[ $v == b ]] && lib=$bin/b
    for d in 128 64; do
      LD_LIBRARY_PATH=$lib:${nccl}:/usr/local/cuda/lib64 $bench --batch 1 --heads $((2048 / d)) --seq 16384 --d $d \
        --causal=0,1 --format json --out "$out/ab-$v-$d.json" > /dev/null 2>&1
      show "$out/ab-$v-$d.json" $v
    done
  done
fi

if has bench; then
  echo "== fa grid, bf16: Hopper backward, then the mma.sync fallback"
  $bench --grid fa --format json --out "$out/ours-sm90.json" > "$out/ours-sm90.log" 2>&1 || tail -3 "$out/ours-sm90.log"
  FLASHLM_ATTENTION_KERNEL=mma $bench --grid fa --format json --out "$out/ours-mma.json" > "$out/ours-mma.log" 2>&1 || tail -3 "$out/ours-mma.log"
  python3 - "$out/ours-sm90.json" "$out/ours-mma.json" <<'PY'
import json, sys, math
def load(p):
    return {(r["head_dim"], r["seq_q"], r["causal"]): r for r in json.load(open(p))["records"]}
a, b = load(sys.argv[1]), load(sys.argv[2])
print("d seq causal | bwd ms sm90 | bwd ms mma | speedup | sm90 TFLOP/s")
lg = []
for key in sorted(a, key=lambda k: tuple(str(x) for x in k)):
    ra, rb = a[key], b.get(key)
    ba, bb = ra.get("bwd_ms"), (rb or {}).get("bwd_ms")
    if ba and bb:
        lg.append(math.log(bb / ba)); print(*key, "|", round(ba, 3), "|", round(bb, 3), "|", round(bb / ba, 3), "|", round(ra.get("bwd_tflops") or 0, 1))
    else:
        print(*key, "|", ra.get("status"), ba, bb)
if lg: print("geomean speedup", round(math.exp(sum(lg) / len(lg)), 3))
PY
  echo "== GQA b1 h64/8 n16384 d128"
  for k in auto mma; do
    FLASHLM_ATTENTION_KERNEL=$k $bench --batch 1 --heads 64 --kv-heads 8 --seq 16384 --d 128 --causal=0,1 \
      --format json --out "$out/gqa-$k.json" > "$out/gqa-$k.log" 2>&1 || tail -3 "$out/gqa-$k.log"
    show "$out/gqa-$k.json" "gqa $k"
  done
fi

if has peers; then
  python3 "$peers/attention_peers.py" --grid fa --peers flash,cudnn --out "$out/peers-fa.json" > "$out/peers-fa.log" 2>&1 \
    || tail -5 "$out/peers-fa.log"
  for v in sm90 mma; do
    [[ -f $out/ours-$v.json ]] || continue
    python3 "$peers/compare.py" "$out/ours-$v.json" "$out/peers-fa.json" --ours flash --peer flash --peer cudnn > "$out/compare-$v.md"
    echo "-- $v vs peers"; grep "^|" "$out/compare-$v.md" | head -40; tail -3 "$out/compare-$v.md"
  done
fi
