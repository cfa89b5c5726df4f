#!/usr/bin/env bash
# Call 4 (main with exp/bwd-d256 merged and the CPU loss-order fix): test_fsdp and test_model on this host's
# 16 cores; the d256 benchmark beside SDPA; ncu of our Hopper backward on 16x32x1024x64 causal; the fa grid again.
O=/tmp/c4; mkdir -p $O; source .device/s10/common.sh
step "tests: fsdp (world 1) and the CPU model on this host's cores"
FLASHLM_TEST_WORLD_SIZE=1 gt test_fsdp 90 fsdp
gt test_model 120 model
step "d256: ours, then SDPA flash and cuDNN"
bench="$B/flashlm attention-bench --device cuda --quiet --impl flash --d 256 --heads 8 --batch 4 --causal=0,1 --warmup 10 --reps 30 --format json"
timeout 60 $bench --dtype bf16 --seq 1024,4096,16384 --out $O/d256.json; echo "exit $?"
timeout 90 python3 scripts/peers/attention_peers.py --shapes 4x8x1024x256,4x8x4096x256,4x8x16384x256 --causal 0,1 --backends flash,cudnn --out $O/d256-peers.json > $O/d256-peers.log 2>&1; echo "exit $?"; tail -8 $O/d256-peers.log
python3 scripts/peers/compare.py attention $O/d256.json $O/d256-peers.json --ours flash --peer sdpa-flash --peer sdpa-cudnn > $O/compare-d256.md 2>&1; cat $O/compare-d256.md
step "ncu: our Hopper backward, 16x32x1024x64 causal"
if (( $(left) > 150 )); then
  timeout 60 ncu --clock-control none --set full -k regex:'flash_bwd_sm90' -c 1 -f -o $O/ncu-ours-bwd \
    $B/flashlm attention-bench --device cuda --quiet --impl flash --dtype bf16 --batch 16 --heads 32 --seq 1024 --d 64 \
    --causal=1 --warmup 0 --reps 1 > $O/ncu-ours-bwd.log 2>&1; echo "exit $?"
  for r in $O/ncu-*.ncu-rep; do [[ -f $r ]] && { ncu -i "$r" --page details --csv > "${r%.ncu-rep}-details.csv"; ncu -i "$r" --page raw --csv > "${r%.ncu-rep}-raw.csv"; rm -f "$r"; }; done
fi
step "fa grid again: ours, then the peers"
if (( $(left) > 90 )); then
  timeout 100 $B/flashlm attention-bench --device cuda --quiet --grid fa --dtype bf16 --impl flash --warmup 10 --reps 30 --format json --out $O/ours-fa.json > /dev/null; echo "exit $?"
  timeout $(( $(left) - 10 )) python3 $P/attention_peers.py --grid fa --peers flash,cudnn --out $O/peers-fa.json > $O/peers-fa.log 2>&1; echo "exit $?"
  python3 $P/compare.py $O/ours-fa.json $O/peers-fa.json --ours flash --peer flash --peer cudnn > $O/compare-fa.md 2>&1; tail -1 $O/compare-fa.md
fi
step done
tar czf $OUT/c4.tgz -C /tmp c4; ls -la $OUT
