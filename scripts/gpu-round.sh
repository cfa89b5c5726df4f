#!/usr/bin/env bash
# On one H200 (any sm_90 GPU): every GPU test binary once, then the headline measurements beside the
# PyTorch peers, in one call that fits a 10-minute limit.
#   scripts/gpu-round.sh BIN_DIR PEERS_DIR OUT_DIR [tests fa gqa fsdp]   (default: all four)
# BIN_DIR holds flashlm, the test binaries and libflashlm.so (a build with -DFLASHLM_NATIVE=OFF);
# PEERS_DIR the PyTorch peer scripts (attention_peers.py, compare.py). Logs and JSON go to OUT_DIR (tar it:
# a remote runner may return only a few files). Each step is bounded by `timeout`, so one hang cannot eat
# the rest; the elapsed seconds are printed with each heading.
#   tests: test_sm90, the attention GPU grid on the default dispatch (the Hopper kernels on sm_90) and forced
#          onto the mma.sync fallback, the grid three times (a moving error is a race) and a small grid under
#          memcheck/racecheck/synccheck, packed variable-length sequences, NaN semantics, the LM kernels and models, the optimizer, GEMMs, DDP and
#          FSDP at world 1, a bf16 train run resumed bit for bit and a NaN loss stopped.
#          GPU_ROUND_REPEAT=N runs the grid N more times (default 2); GPU_ROUND_FALLBACK=0 skips the mma.sync
#          run (when a call's time is short and the fallback's code did not change).
#   bench: the fa grid (forward and backward) against SDPA flash and cuDNN, the causal GQA shape
#          (64 query / 8 KV heads, seq 16k, d128), FSDP's bookkeeping at world 1 against the plain step (xl).
set -uo pipefail
bin=$1 peers=$2 out=$3
shift 3
what=" ${*:-tests fa gqa fsdp} "
has() { [[ $what == *" $1 "* ]]; }
mkdir -p "$out"
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=$bin:${nccl}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
"$bin/flashlm" info | head -5
t0=$SECONDS
fb="$bin/flashlm attention-bench --device cuda --quiet"
step() { echo "== [$((SECONDS - t0)) s] $*"; }
# gtest binary, time limit, log name, arguments: prints the exit status and the failures, if any.
gtest() {
  local exe=$1 limit=$2 log=$3; shift 3
  timeout "$limit" "$bin/$exe" --gtest_brief=1 "$@" > "$out/$log.log" 2>&1
  local rc=$?
  echo "$exe $*: exit $rc; $(grep -E '^\[  PASSED  \]' "$out/$log.log" | tail -1)"
  grep -E "^\[  FAILED  \]|Failure$" "$out/$log.log" | head -12
}

if has tests; then
step "tests"
gtest test_sm90 60 sm90
gtest test_attention 240 attention-default --gtest_filter='*Cuda*:AttentionNaN*:AttentionCapabilities*:*Varlen*:*Fp8*'
gtest test_attention 200 attention-x2 --gtest_filter='Grid/CudaVsReference.*:CudaAttention.*' --gtest_repeat=${GPU_ROUND_REPEAT:-2}
if [[ ${GPU_ROUND_FALLBACK:-1} == 1 ]]; then
  FLASHLM_ATTENTION_KERNEL=mma gtest test_attention 200 attention-mma --gtest_filter='*Cuda*:AttentionNaN*:*Varlen*'
fi
small='Grid/CudaVsReference.*q127_k64_*:Grid/CudaVsReference.*q17_k130_h4x2_d128*:CudaAttention.QueryTilesThatSeeNoKey*:CudaAttention.EmptySequencesGiveZeroGradients:Packs/VarlenCudaVsReference.*d128*'
sanitize() {  # sanitize TOOL LOGNAME: the small filter under one compute-sanitizer tool
  timeout 120 compute-sanitizer --tool "$1" --error-exitcode 99 "$bin/test_attention" --gtest_brief=1 \
    --gtest_filter="$small" > "$out/$2.log" 2>&1
  echo "$2: exit $?; $(grep -m1 'ERROR SUMMARY\|RACECHECK SUMMARY\|SYNCCHECK SUMMARY' "$out/$2.log")"
}
for tool in memcheck racecheck synccheck; do sanitize $tool sanitizer-$tool; done
# The d64 forward's other tile shapes (chosen only for long sequences, so the small filter reaches them forced).
for tile in 192x128 128x192; do
  for tool in memcheck racecheck; do FLASHLM_SM90_FWD_D64_TILE=$tile sanitize $tool sanitizer-$tool-d64-$tile; done
done
step "LM, optimizer, GEMM, DDP and FSDP at world 1"
gtest test_model_cuda 200 model-cuda
gtest test_optim 60 optim
gtest test_gemm_cuda 120 gemm-cuda
FLASHLM_TEST_WORLD_SIZE=1 gtest test_fsdp 120 fsdp
FLASHLM_TEST_WORLD_SIZE=1 gtest test_ddp 120 ddp --gtest_filter='DdpGpu.*'
FLASHLM_TEST_WORLD_SIZE=1 gtest test_dist 60 dist
step "train on the GPU: bf16, 20 steps = 10 + resume + 10; a NaN loss stops the run"
tr="$bin/flashlm train --device cuda --model tiny --vocab 256 --context 64 --batch 8 --cosine-steps 20 --eval-every 0 --precision bf16"
timeout 60 $tr --steps 20 --checkpoint "$out/full.ckpt" > "$out/train.log" 2>&1
timeout 60 $tr --steps 10 --checkpoint "$out/half.ckpt" >> "$out/train.log" 2>&1
timeout 60 $tr --steps 20 --checkpoint "$out/half.ckpt" --resume >> "$out/train.log" 2>&1
cmp "$out/full.ckpt" "$out/half.ckpt" && echo "resume: checkpoints identical" || echo "resume: CHECKPOINTS DIFFER"
timeout 60 $tr --steps 30 --lr 10 --lr-min 10 --warmup 0 --clip 0 --checkpoint-every 1 --checkpoint "$out/nan.ckpt" \
  > "$out/train-nan.log" 2>&1
echo "NaN run: exit $? ($(grep -m1 'error' "$out/train-nan.log"))"
fi

if has fa; then
step "fa grid, bf16, forward and backward (default dispatch), then the PyTorch peers"
timeout 150 $fb --grid fa --dtype bf16 --impl flash --warmup 10 --reps 30 --format json --out "$out/ours-fa.json" > /dev/null
timeout 180 python3 "$peers/attention_peers.py" --grid fa --peers flash,cudnn --out "$out/peers-fa.json" \
  > "$out/peers-fa.log" 2>&1 || tail -5 "$out/peers-fa.log"
python3 "$peers/compare.py" "$out/ours-fa.json" "$out/peers-fa.json" --ours flash --peer flash --peer cudnn \
  > "$out/compare-fa.md"
grep "^|" "$out/compare-fa.md" | head -40; tail -3 "$out/compare-fa.md"
fi

if has gqa; then
step "causal GQA: b1, 64 query / 8 KV heads, seq 16384, d128 (ours, then SDPA through PyTorch)"
timeout 90 $fb --impl flash --dtype bf16 --batch 1 --heads 64 --kv-heads 8 --seq 16384 --d 128 --causal=0,1 \
  --warmup 3 --reps 10 --format csv | tee "$out/gqa.csv"
if [[ -f "$(dirname "$0")/torch_attention_bench.py" ]]; then
  PYTHONPATH="$(dirname "$0")/../python" FLASHLM_LIBRARY="$bin/libflashlm.so" timeout 120 \
    python3 "$(dirname "$0")/torch_attention_bench.py" --peers "$peers" --models "" --shapes 1x64x16384x128x8 \
    --out "$out/gqa-torch.json" > "$out/gqa-torch.log" 2>&1; tail -8 "$out/gqa-torch.log"
fi
fi

if has fsdp; then
step "FSDP at world 1 against the plain step: xl, context 512, batch 4"
timeout 150 mpirun --allow-run-as-root --bind-to none -np 1 -x LD_LIBRARY_PATH "$bin/flashlm" ddp-bench --device cuda \
  --model xl --context 512 --batch 4 --ddp bucketed,fsdp --bucket-mb 100 --warmup 3 --steps 10 --format md \
  --out "$out/fsdp-np1.md" > /dev/null 2>"$out/fsdp-np1.err"; echo "exit $?"; cat "$out/fsdp-np1.md"; tail -3 "$out/fsdp-np1.err"
fi
step "done"
