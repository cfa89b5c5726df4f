#!/usr/bin/env bash
# Call 2: d256 on the mma.sync kernels and under the sanitizers; the mma.sync fallback grid; the fa grid
# beside SDPA flash and cuDNN; ncu of the lowest forward shape (16x32x1024x64 causal), ours and cuDNN's.
O=/tmp/c2; mkdir -p $O; source .device/s10/common.sh
step "d256 on the mma.sync kernels only"
FLASHLM_ATTENTION_KERNEL=mma gt test_attention 120 d256-mma --gtest_filter='*d256*:CudaAttention.*'
small='Grid/CudaVsReference.*q17_k130_h4x2_d256*:Grid/CudaVsReference.*q127_k64_h4x2_d256*:Grid/CudaVsReference.*q129_k97_h4x2_d256*'
for tool in memcheck racecheck synccheck; do
  step "sanitizer $tool, d256"
  timeout 100 compute-sanitizer --tool $tool --error-exitcode 99 $B/test_attention --gtest_filter="$small" --gtest_brief=1 > $O/san-$tool.log 2>&1
  echo "$tool: exit $?; $(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' $O/san-$tool.log)"; grep -m3 -E "Invalid|hazard|Barrier" $O/san-$tool.log
done
step "mma.sync fallback grid and varlen"
FLASHLM_ATTENTION_KERNEL=mma gt test_attention 90 mma --gtest_filter='Grid/CudaVsReference.*:*Varlen*'
step "fa grid, ours then the peers"
timeout 150 $B/flashlm attention-bench --device cuda --quiet --grid fa --dtype bf16 --impl flash --warmup 10 --reps 30 --format json --out $O/ours-fa.json > /dev/null; echo "exit $?"
timeout 190 python3 $P/attention_peers.py --grid fa --peers flash,cudnn --out $O/peers-fa.json > $O/peers-fa.log 2>&1; echo "exit $?"
python3 $P/compare.py attention $O/ours-fa.json $O/peers-fa.json --ours flash --peer flash --peer cudnn > $O/compare-fa.md 2>&1; grep -E "\| 1024 \| 64" $O/compare-fa.md
step "ncu, 16x32x1024x64 causal forward: ours, then cuDNN's"
if (( $(left) > 60 )); then
  timeout 45 ncu --clock-control none --set full -k regex:'flash_fwd_sm90_kernel' -c 1 -f -o $O/ncu-ours \
    $B/flashlm attention-bench --device cuda --quiet --impl flash --dtype bf16 --batch 16 --heads 32 --seq 1024 --d 64 \
    --causal=1 --forward-only --warmup 0 --reps 1 > $O/ncu-ours.log 2>&1; echo "ours: exit $?"
fi
if (( $(left) > 40 )); then
  timeout $(( $(left) - 15 )) ncu --clock-control none --set full -k regex:'sdpa|fmha|fprop|flash' -c 2 -f -o $O/ncu-cudnn \
    python3 scripts/ncu_sdpa.py --shapes 16x32x1024x64 --causal 1 > $O/ncu-cudnn.log 2>&1; echo "cudnn: exit $?"
fi
for r in $O/ncu-*.ncu-rep; do
  [[ -f $r ]] || continue
  ncu -i "$r" --page details --csv > "${r%.ncu-rep}-details.csv" 2>/dev/null; ncu -i "$r" --page raw --csv > "${r%.ncu-rep}-raw.csv" 2>/dev/null; rm -f "$r"
done
step done
tar czf $OUT/c2.tgz -C /tmp c2; ls -la $OUT
