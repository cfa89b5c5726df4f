#!/usr/bin/env bash
# Call 6: the stmatrix O epilogue of the 16-bit Hopper forward: test_sm90, the CUDA grid on the default
# dispatch, the sanitizers on the small filter (both d64 tiles that stage O), then the fa grid's forward
# A/B against the previous epilogue (libflashlm.so of 53195f9), alternated, and the peers.
set -uo pipefail
B=$PWD/.device/s11 OLD=$PWD/.device/s11old O=/tmp/c6; mkdir -p $O
t0=$SECONDS; left() { echo $((${DEADLINE:-200} - (SECONDS - t0))); }
step() { echo "== [$((SECONDS - t0)) s] $* (left $(left) s)"; }
export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64 PYTHONUNBUFFERED=1
step "test_sm90, then the CUDA grid"
timeout 30 $B/test_sm90 --gtest_brief=1 > $O/sm90.log 2>&1; echo "exit $?; $(grep PASSED $O/sm90.log)"; grep -E "FAILED|Failure" $O/sm90.log | head
timeout 100 $B/test_attention --gtest_brief=1 --gtest_filter='Grid/CudaVsReference.*:CudaAttention.*:*Varlen*:*Fp8*' > $O/grid.log 2>&1
echo "exit $?; $(grep PASSED $O/grid.log)"; grep -E "^\[  FAILED|Failure$" $O/grid.log | head
small='Grid/CudaVsReference.*q127_k64_*:Grid/CudaVsReference.*q17_k130_h4x2_d128*:CudaAttention.QueryTilesThatSeeNoKey*'
for v in memcheck:auto racecheck:auto racecheck:192x128 racecheck:128x192; do
  tool=${v%%:*} tile=${v##*:}
  (( $(left) < 60 )) && { echo "sanitizer $v: SKIPPED"; continue; }
  FLASHLM_SM90_FWD_D64_TILE=$tile timeout 40 compute-sanitizer --tool $tool --error-exitcode 99 $B/test_attention --gtest_brief=1 --gtest_filter="$small" > $O/san-$tool-$tile.log 2>&1
  echo "$tool $tile: exit $?; $(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' $O/san-$tool-$tile.log)"
done
step "fa grid forward: new, old, new, old"
fb="$B/flashlm attention-bench --device cuda --quiet --grid fa --dtype bf16 --impl flash --forward-only --warmup 10 --reps 30 --format json"
for i in 1 2; do
  timeout 40 $fb --out $O/new-$i.json > /dev/null; echo "new $i: exit $?"
  LD_LIBRARY_PATH=$OLD:$LD_LIBRARY_PATH timeout 40 $fb --out $O/old-$i.json > /dev/null; echo "old $i: exit $?"
done
step "peers"
(( $(left) > 35 )) && { timeout $(( $(left) - 8 )) python3 $B/peers/attention_peers.py --grid fa --peers cudnn --out $O/peers-fa.json > $O/peers.log 2>&1; echo "exit $?"; }
for f in new-1 old-1 new-2 old-2; do python3 $B/peers/compare.py $O/$f.json $O/peers-fa.json --ours flash --peer cudnn 2>&1 | tail -1 | sed "s/^/$f: /"; done
step done
tar czf $OUT/c6.tgz -C /tmp c6; ls -la $OUT
