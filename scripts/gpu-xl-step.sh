#!/usr/bin/env bash
# On one H200: the xl/small train-step measurements of docs/perf.md ("The xl step ..." subsections) in one
# call, under a deadline (DEADLINE seconds from the start, default 400): torch.compile of xl takes minutes,
# so it runs last with whatever time is left, and everything before it is bounded.
#   scripts/gpu-xl-step.sh BIN_DIR BASE_DIR OUT_DIR        (from the checkout's root: the peers are scripts/peers)
# BIN_DIR holds this branch's flashlm, libflashlm.so, test_gemm_cuda, test_optim and test_model_cuda, and
# optionally test_fsdp and test_ddp (a build with -DFLASHLM_NATIVE=OFF); BASE_DIR the flashlm and libflashlm.so of the commit to compare with
# (main before the branch), or "-" to skip it.
#   1. the GPU tests of the GEMMs, the optimizer, the CUDA model (and FSDP and DDP at world 1), and a bf16
#      train run resumed bit for bit;
#   2. the bf16 step, small and xl (context 512, batch 4, one CUDA graph per step): the base build, this
#      build, this build with each gradient's norm beside the backward (--overlap-grad-norm: the A/B of
#      that overlap against the default single pass), then this build's kernel table (--profile-kernels, xl);
#   3. the PyTorch peers (scripts/peers/lm_peers.py, the step only): xl under torch.compile first (the
#      issue's bar is against it), then small compiled and eager, then xl eager, each while time is left.
set -uo pipefail
bin=$1 base=$2 out=$3
mkdir -p "$out"
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
libs=${nccl}:/usr/local/cuda/lib64
export PYTHONUNBUFFERED=1
t0=$SECONDS
deadline=${DEADLINE:-400}
left() { echo $((deadline - (SECONDS - t0))); }
step() { echo "== [$((SECONDS - t0)) s, $(left) s left] $*"; }
bench="bench --device cuda --context 512 --batch 4 --precision bf16 --pass step"

step "GPU tests"
gtest() {  # binary seconds log gtest-options...
  local t=$1 limit=$2 log=$3; shift 3
  LD_LIBRARY_PATH=$bin:$libs FLASHLM_TEST_WORLD_SIZE=1 timeout "$limit" "$bin/$t" "$@" > "$out/$log.log" 2>&1
  echo "$t $*: exit $?"; grep -E "^\[  (PASSED|FAILED) |tests ran" "$out/$log.log"
}
gtest test_gemm_cuda 90 gemm-cuda
gtest test_optim 30 optim
gtest test_model_cuda 90 model-cuda
if [ -x "$bin/test_fsdp" ]; then gtest test_fsdp 60 fsdp; fi
if [ -x "$bin/test_ddp" ]; then gtest test_ddp 60 ddp --gtest_filter='DdpGpu.*'; fi
step "train on the GPU: bf16, 20 steps = 10 + resume + 10"
tr="$bin/flashlm train --device cuda --model tiny --vocab 256 --context 64 --batch 8 --cosine-steps 20 --eval-every 0 --precision bf16"
export LD_LIBRARY_PATH=$bin:$libs
timeout 30 $tr --steps 20 --checkpoint "$out/full.ckpt" > "$out/train.log" 2>&1
timeout 30 $tr --steps 10 --checkpoint "$out/half.ckpt" >> "$out/train.log" 2>&1
timeout 30 $tr --steps 20 --checkpoint "$out/half.ckpt" --resume >> "$out/train.log" 2>&1
cmp "$out/full.ckpt" "$out/half.ckpt" && echo "resume: checkpoints identical" || echo "resume: CHECKPOINTS DIFFER"
rm -f "$out"/*.ckpt
unset LD_LIBRARY_PATH

run() {  # name dir models extra-options...
  local name=$1 dir=$2 models=$3; shift 3
  LD_LIBRARY_PATH=$dir:$libs timeout 90 "$dir/flashlm" $bench --model "$models" --warmup 5 --steps 20 "$@" \
    --format json --out "$out/$name.json" > "$out/$name.log" 2>&1
  echo "$name: exit $?"; grep -E "^\|.*step" "$out/$name.log"
}
if [ "$base" != "-" ]; then step "base build"; run base "$base" small,xl; fi
step "this build"; run ours "$bin" small,xl
step "this build, gradient norm beside the backward"; run ours-overlap-norm "$bin" small,xl --overlap-grad-norm
step "this build, kernel table"
LD_LIBRARY_PATH=$bin:$libs timeout 60 "$bin/flashlm" $bench --model xl --warmup 3 --steps 5 --profile-kernels \
  > "$out/ours-kernels-xl.txt" 2>&1
echo "exit $?"

peers() {  # name models modes: one lm_peers.py process, bounded by the time left
  local name=$1 models=$2 modes=$3 limit=$(( $(left) - 5 ))
  if (( limit < 30 )); then echo "$name: skipped, $(left) s left"; return; fi
  step "PyTorch peers: $models $modes (limit $limit s)"
  timeout "$limit" python3 scripts/peers/lm_peers.py --models "$models" --modes "$modes" --passes step \
    --out "$out/peers-$name.json" > "$out/peers-$name.log" 2>&1
  echo "exit $?"; tail -4 "$out/peers-$name.log"
}
peers xl-compile xl bf16-compile
peers small small bf16-compile,bf16
peers xl-eager xl bf16
step "done"
