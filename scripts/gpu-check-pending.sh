#!/usr/bin/env bash
# The GPU runs that dev/experiments/README.md's patches and docs/perf.md's open rows wait for, on one GPU host:
#   scripts/gpu-check-pending.sh MAIN_BUILD OUT_DIR SECTION[=EXPERIMENT_BUILD] ...
# MAIN_BUILD is main's CUDA build (tools/flashlm, src/lib*.so, tests/test_attention), EXPERIMENT_BUILD the build of
# main with the section's patch applied (git am dev/experiments/NAME.patch); each section's records go to OUT_DIR.
#   xl            issue 32's rows: the xl step (context 512 x 4, bf16 moments) in bf16 and FP8 (the default copies with
#                 bf16 gradients; the pass's casts), two interleaved rounds, then torch.compile bf16 and torchao's
#                 float8 (where torchao imports: PYTHONPATH) in the same run (scripts/peers/lm_peers.py)
#   window        the sliding window 4096 at 32k (b1 h32 d128 causal): the backward's grid launch against the
#                 persistent one (FLASHLM_SM90_BWD_SCHEDULE), two interleaved rounds; then windows of 2048 and
#                 8192 (the same tiles, other step counts: the cost per tile and per step), and the full causal
#                 problem plain and with a window that never bites (32768, 0: the masked kernels' cost per step over
#                 the same work) (docs/perf.md, "Where the band's backward loses")
#   decode-tma=B  decode-tma-loads.patch: test_attention's decoding suites with FLASHLM_DECODE_LOADS=tma and the
#                 default, memcheck on the TMA test, then attention-bench --decode: main, B with cp.async, B with
#                 tma, two interleaved rounds
# Each run into OUT_DIR/NAME.log with a row of OUT_DIR/summary.md (gpu_check_lib.sh); exits non-zero if any failed.
# Environment: PYTHON (default python3, with torch), PEAK_GBPS (default: 4800 on an H200, else 3350).
set -uo pipefail
usage="usage: gpu-check-pending.sh MAIN_BUILD OUT_DIR SECTION[=EXPERIMENT_BUILD] ..."
(($# > 2)) || { echo "error: name at least one section ($usage)" >&2; exit 2; }
for section in "${@:3}"; do
  case ${section%%=*} in
    xl | window | decode-tma) ;;
    *) echo "error: unknown section '${section%%=*}' ($usage)" >&2; exit 2 ;;
  esac
done
# build (MAIN_BUILD), out, OUT_DIR/gpu.txt and summary.md's header, main's libraries on the path, failed, run()
source "$(dirname "$0")/gpu_check_lib.sh"
main=$build
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
libs=/usr/local/cuda/lib64
peak=${PEAK_GBPS:-$(grep -q H200 "$out/gpu.txt" && echo 4800 || echo 3350)}
# An env prefix per build (timeout runs programs, not shell functions): its libraries first on the path.
on_main=(env "LD_LIBRARY_PATH=$main/src:$libs")
flashlm=$main/tools/flashlm

for section in "$@"; do
  name=${section%%=*} exp=${section#*=}
  [[ $section == *=* ]] || exp=""
  case $name in
    xl)
      lm=(bench --device cuda --model xl --context 512 --batch 4 --pass step --optimizer-state bf16 --warmup 5
          --steps 20 --format json --atomic-attention-backward)
      for round in 1 2; do
        run xl-bf16-$round 90 "${on_main[@]}" "$flashlm" "${lm[@]}" --precision bf16 --out "$out/xl-bf16-$round.json"
        run xl-fp8-$round 90 "${on_main[@]}" "$flashlm" "${lm[@]}" --precision fp8 --grad-dtype bf16 \
          --out "$out/xl-fp8-$round.json"
        run xl-fp8-pass-$round 90 "${on_main[@]}" FLASHLM_FP8_WEIGHT_CAST=pass "$flashlm" "${lm[@]}" --precision fp8 \
          --grad-dtype bf16 --out "$out/xl-fp8-pass-$round.json"
      done
      modes=bf16-compile
      "$python" -c "import torchao" 2>/dev/null && modes+=,fp8-torchao-compile
      peers=$root/scripts/peers
      run xl-peers 900 env PYTHONPATH="$peers:${PYTHONPATH:-}" "$python" "$peers/lm_peers.py" \
        --models xl --modes "$modes" --passes step --warmup 5 --steps 20 --out "$out/xl-peers.json"
      grep -h "step:" "$out/xl-peers.log" ;;
    window)
      shape=(attention-bench --device cuda --quiet --impl flash --dtype bf16 --batch 1 --heads 32 --seq 32768 --d 128
             --causal=1 --format csv)
      for round in 1 2; do for launch in grid persistent; do
        run window-$launch-$round 90 "${on_main[@]}" "FLASHLM_SM90_BWD_SCHEDULE=$launch" "$flashlm" \
          "${shape[@]}" --window 4096,0 --warmup 3 --reps 10 --out "$out/window-$launch-$round.csv"
      done; done
      for round in 1 2; do for window in 2048,0 8192,0 none 32768,0; do
        band=(); [[ $window == none ]] || band=(--window "$window")
        run causal-window-${window%%,*}-$round 120 "${on_main[@]}" "$flashlm" "${shape[@]}" "${band[@]}" --warmup 2 \
          --reps 5 --out "$out/causal-window-${window%%,*}-$round.csv"
      done; done ;;
    decode-tma)
      [[ -x $exp/tests/test_attention ]] || {
        echo "error: decode-tma=BUILD needs BUILD/tests/test_attention" >&2
        exit 2
      }
      on_exp=(env "LD_LIBRARY_PATH=$exp/src:$libs")
      tests=("$exp/tests/test_attention" --gtest_brief=1)
      filter='AttentionDecode*:*KvCache*:*Kvcache*'
      run decode-tests-tma 300 "${on_exp[@]}" FLASHLM_DECODE_LOADS=tma "${tests[@]}" --gtest_filter="$filter"
      run decode-tests-default 300 "${on_exp[@]}" "${tests[@]}" --gtest_filter="$filter"
      run decode-memcheck 300 "${on_exp[@]}" compute-sanitizer --tool memcheck --error-exitcode 99 "${tests[@]}" \
        --gtest_filter='AttentionDecodeCuda.TmaLoads*'
      for round in 1 2; do for v in main cp.async tma; do
        bench=("${on_exp[@]}" "FLASHLM_DECODE_LOADS=$v" "$exp/tools/flashlm")
        [[ $v == main ]] && bench=("${on_main[@]}" "$flashlm")
        run decode-$v-$round 120 "${bench[@]}" attention-bench --device cuda --decode --peak-gbps "$peak" \
          --format json --out "$out/decode-$v-$round.json"
      done; done ;;
  esac
done
echo "summary: $out/summary.md"
exit "$failed"
