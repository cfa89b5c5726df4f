#!/usr/bin/env bash
# On one H200: a round of the Hopper forward in one device call (docs/perf.md, "The Hopper forward,
# fourth round" and "fifth round"): correctness, the A/B of the forward's variants against a second build, the PyTorch
# peers, long context, and ncu of our forward and backward beside cuDNN's kernels.
#   scripts/gpu-hopper-fwd4.sh BIN_DIR BASE_LIB_DIR PEERS_DIR OUT_DIR [DEADLINE_S]
# BIN_DIR holds flashlm, test_attention, test_sm90 and libflashlm.so (this branch); BASE_LIB_DIR another
# build's libflashlm.so (main), timed beside it; PEERS_DIR shared/bench's attention_peers.py and
# compare.py; scripts/peers/long_context.py and scripts/ncu_sdpa.py sit beside this script. A step is
# skipped, and says so, once DEADLINE_S seconds (default 400) have passed, so the call ends in its limit.
# PARTS (default "tests sanitize ab peers long ncu") picks the parts; VARIANTS the A/B's instances (values
# of the variable VARIANT_ENV names, default FLASHLM_SM90_FWD_VARIANT, which only the A/B builds of
# exp/hopper-fwd3, 107ea63..a4ddad3, read; exp/hopper-fwd5's A/B build 741d244 read FLASHLM_SM90_FWD_D64; the
# library reads FLASHLM_SM90_FWD_D64_TILE (docs/design.md). On a build without the variable every value
# runs the default; "main2" runs main's build again, a "b" suffix repeats);
# GRID, REPEAT, SHORT and SMALL narrow the tests; TEST_VARIANT (grid; a list) and RACE_VARIANT (racecheck)
# pick the instances tested beside the default, TEST_GRID the grid's filter for them (see below).
set -uo pipefail
parts=" ${PARTS:-tests sanitize ab peers long ncu} "
has() { [[ $parts == *" $1 "* ]]; }
bin=$1 base=$2 peers=$3 out=$4 deadline=${5:-400}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
libs=${nccl}:/usr/local/cuda/lib64
export LD_LIBRARY_PATH=$bin:$libs
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
t0=$SECONDS
step() { echo "== [$((SECONDS - t0)) s] $*"; }
venv=${VARIANT_ENV:-FLASHLM_SM90_FWD_VARIANT}
with_variant() { local v=$1; shift; ( export "$venv=$v"; "$@" ); }
late() { if ((SECONDS - t0 > deadline - ${1:-0})); then echo "   skipped: past the deadline"; return 0; fi; return 1; }
gtest() {
  local exe=$1 limit=$2 log=$3; shift 3
  timeout "$limit" "$bin/$exe" --gtest_brief=1 "$@" > "$out/$log.log" 2>&1
  local rc=$?
  echo "$exe $*: exit $rc; $(grep -E '^\[  PASSED  \]' "$out/$log.log" | tail -2 | tr '\n' ' ')"
  grep -E "^\[  FAILED  \]|Failure$" "$out/$log.log" | head -12
}

if has tests; then
step "tests: wrappers; the CUDA grid on the default dispatch (REPEAT times), then on TEST_VARIANT; mma"
gtest test_sm90 60 sm90
gtest test_attention 150 default --gtest_filter="${GRID:-*Cuda*:*Varlen*:AttentionNaN*}" --gtest_repeat="${REPEAT:-2}"
for v in ${TEST_VARIANT:-23}; do
  with_variant "$v" gtest test_attention 80 "variant$v" --gtest_filter="${TEST_GRID:-Grid/CudaVsReference.*:CudaAttention.*}"
done
if [[ -z ${SHORT:-} ]]; then
  with_variant 29 gtest test_attention 60 variant29 --gtest_filter='Grid/CudaVsReference.*d64*:CudaAttention.*'
  FLASHLM_ATTENTION_KERNEL=mma gtest test_attention 80 mma --gtest_filter='Grid/CudaVsReference.*:*Varlen*'
fi
fi
if has sanitize; then
step "compute-sanitizer on a small filter: the default, then racecheck on the dynamic variant"
small=${SMALL:-'Grid/CudaVsReference.*q127_k64_*:Grid/CudaVsReference.*q17_k130_h4x2_d128*:CudaAttention.QueryTilesThatSeeNoKey*:Packs/VarlenCudaVsReference.*d128*'}
for tool in memcheck racecheck synccheck; do
  late 100 && break
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 99 "$bin/test_attention" --gtest_brief=1 \
    --gtest_filter="$small" > "$out/sanitizer-$tool.log" 2>&1
  echo "$tool: exit $?; $(grep -m1 'ERROR SUMMARY\|RACECHECK SUMMARY\|SYNCCHECK SUMMARY' "$out/sanitizer-$tool.log")"
done
if ! late 90; then
  with_variant "${RACE_VARIANT:-23}" timeout 60 compute-sanitizer --tool racecheck --error-exitcode 99 \
    "$bin/test_attention" --gtest_brief=1 --gtest_filter="$small" > "$out/sanitizer-racecheck-variant.log" 2>&1
  echo "racecheck, variant ${RACE_VARIANT:-23}: exit $?; $(grep -m1 'RACECHECK SUMMARY' "$out/sanitizer-racecheck-variant.log")"
fi
fi

if has ab; then
step "A/B: the fa grid forward, bf16, main's build and this build's variants (interleaved)"
fb="$bin/flashlm attention-bench --device cuda --quiet --grid fa --impl flash --dtype bf16 --warmup 10 --reps 30 --forward-only --format json"
LD_LIBRARY_PATH=$base:$libs timeout 60 $fb --out "$out/fwd-main.json" > /dev/null
for v in ${VARIANTS:-7 1 3 5 13 23 29 main2 7b}; do
  late 15 && break
  case $v in
    main2) LD_LIBRARY_PATH=$base:$libs timeout 60 $fb --out "$out/fwd-main2.json" > /dev/null ;;
    *b) with_variant "${v%b}" timeout 60 $fb --out "$out/fwd-v$v.json" > /dev/null ;;
    *) with_variant "$v" timeout 60 $fb --out "$out/fwd-v$v.json" > /dev/null ;;
  esac
  echo "  $v: exit $?"
done
fi
if has peers; then
step "peers: SDPA flash and cuDNN over the fa grid"
timeout 150 python3 "$peers/attention_peers.py" --grid fa --peers flash,cudnn --out "$out/peers-fa.json" \
  > "$out/peers-fa.log" 2>&1 || tail -5 "$out/peers-fa.log"
for f in "$out"/fwd-*.json; do
  n=$(basename "$f" .json)
  python3 "$peers/compare.py" "$f" "$out/peers-fa.json" --ours flash --peer flash --peer cudnn > "$out/compare-$n.md" 2>&1
  echo "-- $n: $(tail -2 "$out/compare-$n.md" | tr '\n' ' ')"
done
fi

if has long; then
step "long context: b1 h32 d128 causal, 32k and 64k, forward and backward (ours, main's, then SDPA)"
if ! late 110; then
  lb="$bin/flashlm attention-bench --device cuda --impl flash --dtype bf16 --batch 1 --heads 32 --seq 32768,65536 --d 128 --causal=1 --warmup 2 --reps 5 --format csv"
  timeout 60 $lb --out "$out/long-ours.csv" > /dev/null; echo "exit $?"; cat "$out/long-ours.csv"
  LD_LIBRARY_PATH=$base:$libs timeout 60 $lb --out "$out/long-main.csv" > /dev/null; echo "exit $?"; cat "$out/long-main.csv"
  timeout 90 python3 "$here/peers/long_context.py" --out "$out/long-peers.json" 2>&1 | tail -6
fi
fi
if has ncu; then
step "ncu: our forward and backward (b4 h16 n4096 d128 causal; b4 h32 n4096 d64 causal), then cuDNN's"
if ! late 60; then
  for shape in "16 128" "32 64"; do
    set -- $shape
    timeout 60 ncu --clock-control none --set full -k regex:'flash_(fwd|bwd)_sm90_kernel' -c 3 -f -o "$out/ncu-ours-d$2" \
      "$bin/flashlm" attention-bench --device cuda --quiet --impl flash --dtype bf16 --batch 4 --heads "$1" --seq 4096 \
      --d "$2" --causal=1 --warmup 0 --reps 1 > "$out/ncu-ours-d$2.log" 2>&1
    echo "ours d$2: exit $?"; tail -2 "$out/ncu-ours-d$2.log"
  done
fi
if ! late 30; then
  timeout 80 ncu --clock-control none --set full -k regex:'sdpa|fmha|fprop|bprop|flash' -c 8 -f -o "$out/ncu-cudnn" \
    python3 "$here/ncu_sdpa.py" > "$out/ncu-cudnn.log" 2>&1
  echo "cudnn: exit $?"; tail -3 "$out/ncu-cudnn.log"
fi
for r in "$out"/ncu-*.ncu-rep; do
  [[ -f $r ]] || continue
  ncu -i "$r" --page details --csv > "${r%.ncu-rep}-details.csv" 2>/dev/null
  ncu -i "$r" --page raw --csv > "${r%.ncu-rep}-raw.csv" 2>/dev/null
  rm -f "$r"
done
fi
step "done"
