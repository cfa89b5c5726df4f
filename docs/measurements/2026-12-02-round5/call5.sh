#!/usr/bin/env bash
# Call 5: ncu of the d128 backward, ours (Hopper) and cuDNN's, on 4x16x4096x128 causal (the backward's goal
# is missed most at d128).
O=/tmp/c5; mkdir -p $O; source .device/s10/common.sh
step "ncu: our Hopper backward, 4x16x4096x128 causal"
timeout 90 ncu --clock-control none --set full -k regex:'flash_bwd_sm90' -c 1 -f -o $O/ncu-ours-bwd-d128 \
  $B/flashlm attention-bench --device cuda --quiet --impl flash --dtype bf16 --batch 4 --heads 16 --seq 4096 --d 128 \
  --causal=1 --warmup 0 --reps 1 > $O/ncu-ours-bwd-d128.log 2>&1; echo "exit $?"
step "ncu: cuDNN's backward, the same shape"
timeout 120 ncu --clock-control none --set full -k regex:'bprop' -c 1 -f -o $O/ncu-cudnn-bwd-d128 \
  python3 scripts/ncu_sdpa.py --shapes 4x16x4096x128 --causal 1 > $O/ncu-cudnn-bwd-d128.log 2>&1; echo "exit $?"
for r in $O/ncu-*.ncu-rep; do [[ -f $r ]] && { ncu -i "$r" --page details --csv > "${r%.ncu-rep}-details.csv"; ncu -i "$r" --page raw --csv > "${r%.ncu-rep}-raw.csv"; rm -f "$r"; }; done
step done
tar czf $OUT/c5.tgz -C /tmp c5; ls -la $OUT
