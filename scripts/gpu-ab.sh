#!/usr/bin/env bash
# A/B of two builds of libflashlm.so on one GPU, in one session: the GPU attention tests with each, the fa
# grid A, B, A, B (interleaved, so drift shows), the PyTorch peers once, and compare.py for each run.
#   scripts/gpu-ab.sh BIN_DIR LIB_A LIB_B PEERS_DIR OUT_DIR [extra attention-bench flags, e.g. --deterministic]
# BIN_DIR holds flashlm and test_attention (they load libflashlm.so from LD_LIBRARY_PATH); LIB_A and LIB_B
# are directories holding a libflashlm.so each; PEERS_DIR is shared/bench.
set -uo pipefail
bin=$1 lib_a=$2 lib_b=$3 peers=$4 out=$5
shift 5
mkdir -p "$out"
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
base=${nccl}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
lib() { [[ $1 == A* ]] && echo "$lib_a" || echo "$lib_b"; }
for v in A B; do
  LD_LIBRARY_PATH=$(lib $v):$base "$bin/test_attention" --gtest_filter='*Cuda*' --gtest_brief=1 > "$out/tests-$v.log" 2>&1
  echo "GPU attention tests with $v: exit $? ($(tail -1 "$out/tests-$v.log"))"
done
for v in A B A2 B2; do
  LD_LIBRARY_PATH=$(lib $v):$base "$bin/flashlm" attention-bench --device cuda --quiet --grid fa --dtype bf16 \
    --warmup 10 --reps 30 --impl flash --format json --out "$out/fa-$v.json" "$@" > /dev/null
  echo "fa grid $v: exit $?"
done
python3 "$peers/attention_peers.py" --grid fa --peers flash,cudnn --out "$out/peers-fa.json" > "$out/peers-fa.log" 2>&1 \
  || tail -5 "$out/peers-fa.log"
for v in A B A2 B2; do
  python3 "$peers/compare.py" "$out/fa-$v.json" "$out/peers-fa.json" --ours flash --peer flash --peer cudnn \
    > "$out/compare-$v.md"
  echo "$v: $(tail -1 "$out/compare-$v.md")"
done
