#!/usr/bin/env bash
# On a GPU machine: the PyTorch package's tests (the CUDA ones included: CUDA-graph capture of forward +
# backward, torch.compile on bf16) and its measurements beside SDPA flash and cuDNN, in one session:
# host time per call, the small LM's attention (4x12x512x64 causal bf16), the fa grid, and the CS336 small
# model's step with its attention swapped (eager bf16 and bf16-compile).
#   scripts/gpu-torch-op.sh LIB_DIR PEERS_DIR OUT_DIR [all|tests|attention|lm]
# (tests: the pytest run and the host overhead; attention: small-LM shape + fa grid; lm: the swapped model.
# All three may pass a 10-minute device call: split them across calls there.)
# LIB_DIR holds libflashlm_attention.so (or libflashlm.so; built with -DFLASHLM_NATIVE=OFF), PEERS_DIR
# shared/bench's scripts.
set -uo pipefail
lib=$(cd "$1" && pwd) peers=$(cd "$2" && pwd) out=$3 what=${4:-all}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=$lib:${nccl}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
library=$lib/libflashlm_attention.so; [[ -f $library ]] || library=$lib/libflashlm.so
export FLASHLM_LIBRARY=$library PYTHONPATH=$root/python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
python3 -c "import torch, flashlm; print('torch', torch.__version__, '| flashlm', flashlm.__version__, flashlm._lib.path)"

if [[ $what == tests || $what == all ]]; then
echo "== Python package tests (CPU and CUDA)"
timeout 420 python3 -m pytest -q -p no:cacheprovider -rs "$root/tests/python/test_torch_library.py" \
  "$root/tests/python/test_signatures.py" "$root/tests/python/test_torch_attention.py" \
  "$root/tests/python/test_varlen.py" > "$out/pytest.log" 2>&1
echo "pytest exit $?"; tail -25 "$out/pytest.log"

echo "== host time per call above the C call (tiny shape, bf16)"
timeout 150 python3 "$root/scripts/torch_op_overhead.py" --device cuda --out "$out/overhead.json" 2>&1 | tee "$out/overhead.md"
fi

if [[ $what == attention || $what == all ]]; then
echo "== the small LM's attention (4x12x512x64 causal bf16) through PyTorch beside SDPA flash and cuDNN (bar: >= 0.9x SDPA flash fwd+bwd)"
timeout 120 python3 "$root/scripts/torch_attention_bench.py" --shapes 4x12x512x64 \
  --out "$out/torch-small-lm.json" > "$out/torch-small-lm.log" 2>&1
echo "exit $?"; cat "$out/torch-small-lm.log"
echo "== the fa grid through PyTorch beside SDPA flash and cuDNN"
timeout 420 python3 "$root/scripts/torch_attention_bench.py" --shapes "" --grid fa \
  --out "$out/torch-attention.json" > "$out/torch-attention.log" 2>&1
echo "exit $?"; cat "$out/torch-attention.log"
fi

if [[ $what == lm || $what == all ]]; then
echo "== the CS336 small model's step with its attention swapped (eager bf16, then bf16-compile)"
for mode in bf16 bf16-compile; do
  timeout 270 python3 "$root/scripts/torch_attention_bench.py" --peers "$peers" --shapes "" --models small \
    --mode $mode --repeats 3 --out "$out/torch-lm-$mode.json" > "$out/torch-lm-$mode.log" 2>&1
  echo "$mode: exit $?"; tail -6 "$out/torch-lm-$mode.log"
done
fi
