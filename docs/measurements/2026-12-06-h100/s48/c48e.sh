#!/usr/bin/env bash
# Session 48, the one call: the integration build (s48c: bwd-descriptors + decode-fixed-cost + fp8-amax-producers
# on main 1a86f83) against main (s48a), in order of what matters: the Hopper attention tests, the fa grid A/B,
# the FP8 tests and the xl FP8 step A/B, the decoding tests and A/B; then second rounds and SDPA if time is left.
set -u
LIMIT=${LIMIT:-565}
for t in s48a s48c; do python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('.gpu')" .gpu/$t.tar.xz; done
export PYTHONUNBUFFERED=1
O=$OUT C=$PWD/.gpu/s48c T=$PWD/.gpu/s48c/tests
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
LIBS=${NCCL:+$NCCL:}/usr/local/cuda/lib64
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
PEAK=3350; [[ $GPU == *H200* ]] && PEAK=4800
t0=$SECONDS
left() { echo $((LIMIT - (SECONDS - t0))); }
g() { local n=$1 l=$2; shift 2
  local lf=$(left); (( lf < 15 )) && { echo "skip $n"; return; }; (( l > lf - 5 )) && l=$((lf - 5))
  timeout $l env LD_LIBRARY_PATH=$C/src:$LIBS "$@" > $O/$n.log 2>&1; local rc=$?
  echo "[$((SECONDS-t0))s] $n rc=$rc $(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\]|ERROR SUMMARY|RACECHECK SUMMARY' $O/$n.log | grep -v '^\[  FAILED  \] [A-Z]' | tr '\n' ' ')"
  grep -E '^\[  FAILED  \] [A-Z]' $O/$n.log | head -8; grep -m4 -E "Failure|Which is|error/tol" $O/$n.log; }
fl() { local set=$1 tag=$2 lim=$3; shift 3; local S=$PWD/.gpu/$set
  (( $(left) < lim )) && { echo "skip $tag"; return; }
  timeout $lim env LD_LIBRARY_PATH=$S/src:$LIBS $S/tools/flashlm "$@" > $O/$tag.log 2>&1; echo "[$((SECONDS-t0))s] $tag rc=$? $(grep -E '^\|' $O/$tag.log | tail -1 | cut -d'|' -f2-12)"; grep -m3 -i "error" $O/$tag.log; }
FA="attention-bench --device cuda --impl flash --dtype bf16 --grid fa --warmup 5 --reps 20 --format json"
XL="bench --device cuda --pass step --model xl --context 512 --batch 4 --optimizer-state bf16 --warmup 5 --steps 20 --precision fp8 --format json"
DEC="attention-bench --device cuda --decode --peak-gbps $PEAK --format json"
g attention 130 $T/test_attention --gtest_brief=1 --gtest_filter='Grid/CudaVsReference.*:CudaAttention.*Hopper*:*HeadDimPair*:Grid/CudaBandVsReference.*:HopperBackwardSchedule*'
fl s48a fa-main-1 60 $FA --out $O/fa-main-1.json
fl s48c fa-int-1 60 $FA --out $O/fa-int-1.json
g fp8-new 70 $T/test_model_cuda --gtest_brief=1 --gtest_filter='OpsCuda/*.RopeBackwardWritesTheAmaxOfTheWholeQkvGradient:OpsCudaBf16.AdamWWritesTheAmaxesOfTheWeightsItStores:CudaModelFp8.*'
g fp8-linear 25 $T/test_gemm_cuda --gtest_brief=1 --gtest_filter='Fp8Linear.*'
fl s48a xl-main-1 42 $XL --out $O/xl-main-1.json
fl s48c xl-int-1 42 $XL --out $O/xl-int-1.json
g decode 50 $T/test_attention --gtest_brief=1 --gtest_filter='AttentionDecode*'
g decoder 30 $T/test_model --gtest_brief=1 --gtest_filter='PagedKvDecoderCuda.*:KvCacheDecoderCuda.*'
fl s48a dec-main-1 25 $DEC --out $O/dec-main-1.json
FLASHLM_DECODE_COMBINE=separate fl s48c dec-sep-1 25 $DEC --out $O/dec-sep-1.json
FLASHLM_DECODE_COMBINE=fused fl s48c dec-fused-1 25 $DEC --out $O/dec-fused-1.json
fl s48a fa-main-2 60 $FA --out $O/fa-main-2.json
fl s48c fa-int-2 60 $FA --out $O/fa-int-2.json
fl s48a xl-main-2 42 $XL --out $O/xl-main-2.json
fl s48c xl-int-2 42 $XL --out $O/xl-int-2.json
FLASHLM_DECODE_COMBINE=fused fl s48c dec-fused-2 25 $DEC --out $O/dec-fused-2.json
fl s48a dec-main-2 25 $DEC --out $O/dec-main-2.json
python3 - $O <<'PY'
import json,sys,math,os
o=sys.argv[1]
def J(n):
  p=os.path.join(o,n+".json")
  if not os.path.exists(p): return None
  j=json.load(open(p)); return j["records"] if isinstance(j,dict) else j
gm=lambda v: math.exp(sum(map(math.log,v))/len(v)) if v else float('nan')
fa={n:{(r["head_dim"],r["seq_q"],int(r["causal"])):r for r in (J(n) or [])} for n in ("fa-main-1","fa-int-1","fa-main-2","fa-int-2")}
if fa["fa-main-1"] and fa["fa-int-1"]:
  F,B=[],[]
  for k in sorted(fa["fa-main-1"]):
    m=[fa[n][k] for n in ("fa-main-1","fa-main-2") if k in fa[n]]; i=[fa[n][k] for n in ("fa-int-1","fa-int-2") if k in fa[n]]
    f=gm([r["fwd_ms"] for r in m])/gm([r["fwd_ms"] for r in i]); b=gm([r["bwd_ms"] for r in m])/gm([r["bwd_ms"] for r in i]); F.append(f); B.append(b)
    print("fa",k,"bwd main"," ".join(f'{r["bwd_ms"]:.3f}' for r in m),"int"," ".join(f'{r["bwd_ms"]:.3f}' for r in i),f"main/int fwd {f:.3f} bwd {b:.3f}")
  print("fa geomean main/int fwd",round(gm(F),4),"bwd",round(gm(B),4))
for n in ("xl-main-1","xl-int-1","xl-main-2","xl-int-2"):
  r=J(n)
  if r: print(n, {k:v for k,v in r[0].items() if "ms" in k or k in ("precision",)})
dec={n:{(r["batch"],r["cache_len"]):r for r in (J(n) or [])} for n in ("dec-main-1","dec-sep-1","dec-fused-1","dec-fused-2","dec-main-2")}
for k in sorted(dec["dec-main-1"]):
  print("decode b%d %d:"%k, " ".join(f'{n[4:]} {dec[n][k]["ms"]*1000:.1f}us ({dec[n][k].get("peak_pct") or 0:.1f}%)' for n in dec if k in dec[n]))
PY
l=$(left); (( l > 95 )) && { timeout $((l - 10)) python3 scripts/peers/attention_peers.py --grid fa --backends flash,cudnn --out $O/peers-fa.json > $O/peers-fa.log 2>&1; echo "[$((SECONDS-t0))s] fa peers rc=$?"
  for f in fa-main-1 fa-int-1; do python3 scripts/peers/compare.py attention $O/$f.json $O/peers-fa.json --peer sdpa-flash --peer sdpa-cudnn > $O/compare-$f.md 2>&1; echo "== $f"; tail -6 $O/compare-$f.md; done; }
echo "[$((SECONDS-t0))s] done"
cd $O && tar czf all.tgz *.log *.json *.md 2>/dev/null; rm -f *.log *.json *.md
