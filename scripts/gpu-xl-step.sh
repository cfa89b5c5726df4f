#!/usr/bin/env bash
# On one H200: the xl/small train-step measurements of docs/perf.md ("The xl step toward 45% MFU")
# in one call, about four to six minutes (torch.compile of xl is most of it: it did not finish in 75 s).
#   scripts/gpu-xl-step.sh BIN_DIR BASE_DIR PEERS_DIR OUT_DIR
# BIN_DIR holds this branch's flashlm, libflashlm.so, test_gemm_cuda, test_optim and test_model_cuda (a
# build with -DFLASHLM_NATIVE=OFF); BASE_DIR the flashlm and libflashlm.so of the commit to compare with
# (main before the branch), or "-" to skip it; PEERS_DIR holds lm_peers.py and cs336_model.py.
#   1. the GPU tests of the GEMMs, the optimizer and the CUDA model;
#   2. the bf16 step, small and xl (context 512, batch 4): the base build, this build (one CUDA graph per
#      step), this build eager (--cuda-graph off), with the gradient norm as one pass after the backward
#      (--serial-grad-norm: the A/B of its overlap, graphed) and with cuBLASLt autotuning (--gemm-autotune
#      8), then the kernel table (--profile-kernels);
#   3. the PyTorch peers, torch.compile first (xl's compile takes minutes), then eager bf16.
set -uo pipefail
bin=$1 base=$2 peers=$3 out=$4
mkdir -p "$out"
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
libs=${nccl}:/usr/local/cuda/lib64
export PYTHONUNBUFFERED=1
t0=$SECONDS
step() { echo "== [$((SECONDS - t0)) s] $*"; }
bench="bench --device cuda --model small,xl --context 512 --batch 4 --precision bf16 --pass step"

step "GPU tests"
for t in test_gemm_cuda test_optim test_model_cuda; do
  LD_LIBRARY_PATH=$bin:$libs timeout 90 "$bin/$t" > "$out/$t.log" 2>&1
  echo "$t: exit $?"; grep -E "^\[  (PASSED|FAILED) " "$out/$t.log"
done

run() {  # name dir extra-options...
  local name=$1 dir=$2; shift 2
  LD_LIBRARY_PATH=$dir:$libs timeout 90 "$dir/flashlm" $bench --warmup 5 --steps 20 "$@" --format json \
    --out "$out/$name.json" > "$out/$name.log" 2>&1
  echo "$name: exit $?"; grep -E "^\|.*step" "$out/$name.log"
}
if [ "$base" != "-" ]; then step "base build"; run base "$base"; fi
step "this build"; run ours "$bin"
step "this build, eager"; run ours-eager "$bin" --cuda-graph off
step "this build, serial gradient norm"; run ours-serial-norm "$bin" --serial-grad-norm
step "this build, GEMM autotune"; run ours-autotune "$bin" --gemm-autotune 8
step "this build, kernel table"
LD_LIBRARY_PATH=$bin:$libs timeout 90 "$bin/flashlm" $bench --warmup 3 --steps 5 --profile-kernels \
  > "$out/ours-kernels.txt" 2>&1
echo "exit $?"

step "PyTorch peers (eager bf16, torch.compile)"
(cd "$peers" && timeout 300 python3 lm_peers.py --models xl,small --modes bf16-compile,bf16 \
  --out "$out/peers.json") > "$out/peers.log" 2>&1
echo "exit $?"; tail -8 "$out/peers.log"
step "done"
