#!/usr/bin/env bash
# Checks the head dims of v's own on CUDA (head_dim for q and k, head_dim_v for v and o: DeepSeek's MLA attends
# with 192 and 128) on a GPU: the padded path of the mma.sync and fp32 kernels (every pair whose larger head dim
# fits a compiled one, forward and backward; capabilities.h's pads_head_dim_v), the Hopper kernels' own pair
# (kHopperForwardHeadDimPairs, kHopperBackwardHeadDimPairs: unpadded, sm_90, the backward on the wide-head
# kernel), and that the kernels they touch still pass their own tests:
#   scripts/gpu-check-dqk-dv.sh BUILD_DIR OUT_DIR
# BUILD_DIR is a CUDA build (BUILD_DIR/tests/test_attention; 90 in CMAKE_CUDA_ARCHITECTURES for the Hopper
# runs, which skip elsewhere). Runs
#   pairs         the pair tests: every pair padded on mma.sync (FLASHLM_ATTENTION_KERNEL=mma) and on the default
#                 route, forward and backward against the fp64 oracle (ragged lengths, masks, layouts, GQA,
#                 fp16/bf16/fp32, deterministic, window, softcap, ALiBi and sinks), (192, 128) on the Hopper
#                 forward and backward, varlen packs, the routing and every refusal by name, the capability
#                 table's CPU tests
#   hopper        the existing tests of the Hopper forward and backward: the fp64-oracle grid (Hopper where
#                 it covers a problem, the padded head dims included), the Hopper coverage, tile and dispatch
#                 tests, the window / softcap and ALiBi / sink grids, varlen
#   hopper-mma    the same with FLASHLM_ATTENTION_KERNEL=mma (the mma.sync fallback; tests that need a choice
#                 set it themselves)
#   attention     the whole of test_attention
#   memcheck, racecheck   compute-sanitizer on a few small cases: (192, 128) on the Hopper kernels, both passes
#                 (plain, causal bottom-right with rows without keys, a window, ALiBi and sinks), padded pairs in both
#                 passes ((192, 128) to 256, deterministic with rows without keys; (64, 128) and (128, 64), one
#                 side padded; fp32 (24, 40)) and the routing tests
#   python        flashlm.flash_attn_func with head_dim_v on the GPU (tests/python), where PYTHON (default
#                 python3) has torch with CUDA and pytest; skipped, with a line in the summary, where it has not
# each into OUT_DIR/NAME.log, with a summary table in OUT_DIR/summary.md; exits non-zero if any failed.
set -uo pipefail
usage="usage: gpu-check-dqk-dv.sh BUILD_DIR OUT_DIR"
source "$(dirname "$0")/gpu_check_lib.sh"  # build, out, exe, the summary header, failed, run()

pairs='*HeadDimPair*:AttentionCapabilities.*:AttentionExtrasCuda.*:CudaAlibiSink.PlannedOnMmaSync*'
hopper='Grid/CudaVsReference.*:CudaAttention.*Hopper*:CudaAttention.CapabilityTableAndBehaviourAgree:'
hopper+='Grid/CudaBandVsReference.*:CudaBand.*:*CudaAlibiSink*:Packs/VarlenCuda*'
FLASHLM_ATTENTION_KERNEL=auto run pairs 900 "$exe" --gtest_brief=1 --gtest_filter="$pairs"
FLASHLM_ATTENTION_KERNEL=auto run hopper 900 "$exe" --gtest_brief=1 --gtest_filter="$hopper"
FLASHLM_ATTENTION_KERNEL=mma run hopper-mma 900 "$exe" --gtest_brief=1 --gtest_filter="$hopper"
run attention 1200 "$exe" --gtest_brief=1

# Small cases. The Hopper kernels at (192, 128), both passes: no mask with one query and one key, bottom-right
# causal with Nq > Nk (rows without keys), a window on a BHSD layout, ALiBi and sinks. The padded path in both
# passes (each case on mma.sync and on the default route): (192, 128) with one query and one key, and
# deterministic with rows without keys; (64, 128) and (128, 64), one side padded, the other the caller's views;
# fp32 (24, 40). The routing tests (they run both passes).
subset='Grid/CudaHeadDimPairVsReference.HopperMatchesFp64OracleInBothPasses/b2_q1_k1_*:'
subset+='Grid/CudaHeadDimPairVsReference.HopperMatchesFp64OracleInBothPasses/*q17_k5_*causalBR*:'
subset+='Grid/CudaHeadDimPairVsReference.HopperMatchesFp64OracleInBothPasses/*q127_k1000_*_w130_70*:'
subset+='Grid/CudaHeadDimPairVsReference.HopperMatchesFp64OracleInBothPasses/*q300_k300_*alibi_sink*:'
padded='Grid/CudaPaddedHeadDimPairVsReference.FlashMatchesFp64OracleInBothPasses'
subset+="$padded/b2_q1_k1_h4x2_d192_dv128_bshd_full_fp16:"
subset+="$padded/b1_q17_k5_h6x1_d192_dv128_sliced_causalBR_bf16_det:"
subset+="$padded/b1_q17_k130_h4x2_d64_dv128_bhsd_causalBR_fp16:"
subset+="$padded/b1_q17_k5_h6x1_d128_dv64_bshd_full_bf16_det:"
subset+="$padded/b1_q65_k200_h2x2_d24_dv40_sliced_full_fp32:"
subset+='CudaHeadDimPair.*'
for tool in memcheck racecheck; do
  FLASHLM_ATTENTION_KERNEL=auto run "$tool" 900 compute-sanitizer --tool "$tool" --error-exitcode 99 "$exe" \
    --gtest_brief=1 --gtest_filter="$subset"
done
# The sanitizer runs must have run the cases, not matched none.
for tool in memcheck racecheck; do
  grep -qE '^\[  PASSED  \] [1-9]' "$out/$tool.log" || { echo "error: $tool ran no test" | tee -a "$out/summary.md"; failed=1; }
done

python=${PYTHON:-python3}
library=$build/src/libflashlm_attention.so  # ninja -C BUILD_DIR flashlm_attention
if [[ ! -f $library ]]; then
  echo "| python | - | skipped: no $library |" | tee -a "$out/summary.md"
elif "$python" -c 'import torch, pytest; assert torch.cuda.is_available()' 2> /dev/null; then
  FLASHLM_LIBRARY=$library PYTHONPATH=$(dirname "$0")/../python \
    run python 600 "$python" -m pytest -q -p no:cacheprovider \
    "$(dirname "$0")/../tests/python/test_attention_variants.py" -k "head_dim_v or head_dims_192"
else
  echo "| python | - | skipped: $python has no torch with CUDA, or no pytest |" | tee -a "$out/summary.md"
fi
echo "summary: $out/summary.md"
exit $failed
