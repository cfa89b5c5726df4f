#!/usr/bin/env bash
# Stop 53, third call: the decode variants' tests with room (they timed out at 60 s in c53b), then the A/B.
set -u
LIMIT=${LIMIT:-420}
O=$OUT
[ -d .gpu/s53d ] || python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/s53d.tar.xz
LIBS=/usr/local/cuda/lib64
D=$PWD/.gpu/s53d DT=$PWD/.gpu/s53d/tests/test_attention DF=$PWD/.gpu/s53d/tools/flashlm
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt; echo "s53d: $(cat $D/commit)" | tee -a $O/gpu.txt
PEAK=$(grep -q H200 $O/gpu.txt && echo 4800 || echo 3350)
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
pack() { (cd $O && tar czf all.tgz --exclude=all.tgz *.log *.json *.txt 2>/dev/null); }
r() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < l / 2 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l "$@" > $O/$n.log 2>&1; echo "[$((SECONDS-t0))s] $n rc=$?"; grep -m3 -iE " error|Traceback|FAILED  \]" $O/$n.log; }
export LD_LIBRARY_PATH=$D/src:$LIBS
# The bench first: it does not depend on the tests' length.
for round in 1 2; do for v in default fused ahead both; do case $v in default) E=;; fused) E=FLASHLM_DECODE_COMBINE=fused;; ahead) E=FLASHLM_DECODE_SPLIT_LOADS=ahead;; both) E="FLASHLM_DECODE_COMBINE=fused FLASHLM_DECODE_SPLIT_LOADS=ahead";; esac
  r dec-$v-$round 30 env $E $DF attention-bench --device cuda --decode --peak-gbps $PEAK --format json --out $O/dec-$v-$round.json
done; done
python3 -c "import json,sys;[print(f.split('/')[-1],x['batch'],x['cache_len'],round(x['ms']*1e3,2),'us',round(x['peak_pct'],1),'%') for f in sys.argv[1:] for x in json.load(open(f))['records'] if x['batch']==1 and x['cache_len']==16384]" $O/dec-*.json
pack
r d-new 200 $DT --gtest_filter='AttentionDecodeCuda.Variants*'
grep -E "^\[       OK|FAILED|^\[ RUN" $O/d-new.log | tail -8
r d-old 90 $DT --gtest_brief=1 --gtest_filter='AttentionDecode*:*Kvcache*:*KvCache*:-AttentionDecodeCuda.Variants*'
tail -3 $O/d-old.log
pack
r d-memcheck 60 env FLASHLM_DECODE_COMBINE=fused FLASHLM_DECODE_SPLIT_LOADS=ahead compute-sanitizer --tool memcheck --error-exitcode 99 $DT --gtest_brief=1 --gtest_filter='AttentionDecodeCuda.VariantsGiveNaNForABadSequenceOnly'
tail -1 $O/d-memcheck.log
pack
ls $O | grep -v all.tgz | while read f; do rm -f "$O/$f"; done
echo "[$((SECONDS-t0))s] done"
