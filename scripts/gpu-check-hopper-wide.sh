#!/usr/bin/env bash
# Checks the Hopper backward's wide-head kernel (cuda/hopper/flash_bwd_wide_sm90.cu: head dim 256 and the
# (192, 128) pair, unpadded) on an sm_90 GPU, and times it against the mma.sync backward:
#   scripts/gpu-check-hopper-wide.sh BUILD_DIR OUT_DIR
# BUILD_DIR is a CUDA build with 90 in CMAKE_CUDA_ARCHITECTURES (BUILD_DIR/tests/test_attention; the timing
# also needs BUILD_DIR/tools/flashlm). Runs
#   wide          the tests that reach it: the fp64-oracle grids at d256 and (192, 128) (ragged lengths, both
#                 causal alignments, layouts, GQA, poisoned outputs; the deterministic cases stay on mma.sync),
#                 the window / softcap and ALiBi / sink grids at d256, varlen packs, the FP8 backward at d256
#                 (on bf16 copies), the routing, coverage and head-group tests, the capability table's
#   wide-mma      the same with FLASHLM_ATTENTION_KERNEL=mma (the mma.sync fallback)
#   attention     the whole of test_attention
#   memcheck, racecheck   compute-sanitizer on a small subset: one query and one key, ragged bottom-right causal
#                 (rows without keys), a window and soft-capping, ALiBi and sinks, at d256 and (192, 128)
#   bench-hopper, bench-mma   attention-bench at d256 and (192, 128), bf16, b2 h16 4k and b1 h16 16k, causal and
#                 not: the default route (the Hopper kernels) and FLASHLM_ATTENTION_KERNEL=mma (mma.sync, the
#                 pair padded to 256), one after the other on the same GPU
# each into OUT_DIR/NAME.log, with a summary table in OUT_DIR/summary.md; exits non-zero if any failed.
set -uo pipefail
usage="usage: gpu-check-hopper-wide.sh BUILD_DIR OUT_DIR"
source "$(dirname "$0")/gpu_check_lib.sh"  # build, out, exe, the summary header, failed, run()

wide='Grid/CudaVsReference.*_d256_*:Grid/CudaHeadDimPairVsReference.*:Grid/CudaPaddedHeadDimPairVsReference.*_d192_*:'
wide+='Grid/CudaPaddedHeadDimPairVsReference.*_d256_*:Grid/CudaBandVsReference.*_d256_*:'
wide+='Grid/CudaAlibiSinkVsReference.*_d256_*:CudaAlibiSink.*:CudaAttention.*Hopper*:CudaAttention.FlashKernelFamily*:'
wide+='CudaAttention.BackwardHeadGroups*:CudaHeadDimPair.*:Packs/VarlenCudaBandVsReference.*_d256_*:'
wide+='Packs/VarlenCudaBandVsReference.*_d192_*:Packs/VarlenCudaHeadDimPairVsReference.*:'
wide+='Grid/Fp8CudaBackwardVsReference.*_d256_*:AttentionCapabilities.*'
FLASHLM_ATTENTION_KERNEL=auto run wide 1200 "$exe" --gtest_brief=1 --gtest_filter="$wide"
FLASHLM_ATTENTION_KERNEL=mma run wide-mma 1200 "$exe" --gtest_brief=1 --gtest_filter="$wide"
run attention 1500 "$exe" --gtest_brief=1

subset='Grid/CudaHeadDimPairVsReference.HopperMatchesFp64OracleInBothPasses/b2_q1_k1_*:'
subset+='Grid/CudaHeadDimPairVsReference.HopperMatchesFp64OracleInBothPasses/*q17_k5_*causalBR*:'
subset+='Grid/CudaHeadDimPairVsReference.HopperMatchesFp64OracleInBothPasses/*q127_k1000_*_w130_70*:'
subset+='Grid/CudaHeadDimPairVsReference.HopperMatchesFp64OracleInBothPasses/*q300_k300_*alibi_sink*:'
subset+='Grid/CudaVsReference.FlashAndNaiveMatchFp64Oracle/b2_q1_k77_h4x2_d256_bshd_full_fp16_atomic:'
subset+='Grid/CudaVsReference.FlashAndNaiveMatchFp64Oracle/*q127_k64_h4x2_d256_*causalBR*:'
subset+='Grid/CudaBandVsReference.HopperAndMmaSyncMatchFp64Oracle/*q129_k97_*_d256_*:'
subset+='Grid/CudaAlibiSinkVsReference.HopperMatchesFp64Oracle/*q129_k97_*_d256_*'
for tool in memcheck racecheck; do
  FLASHLM_ATTENTION_KERNEL=auto run "$tool" 1200 compute-sanitizer --tool "$tool" --error-exitcode 99 "$exe" \
    --gtest_brief=1 --gtest_filter="$subset"
done
# The sanitizer runs must have run the cases, not matched none.
for tool in memcheck racecheck; do
  grep -qE '^\[  PASSED  \] [1-9]' "$out/$tool.log" ||
    { echo "error: $tool ran no test" | tee -a "$out/summary.md"; failed=1; }
done

cli=$build/tools/flashlm
if [[ -x $cli ]]; then
  for route in hopper mma; do
    kernel=auto
    [[ $route == mma ]] && kernel=mma
    for shape in "--batch 2 --heads 16 --seq 4096" "--batch 1 --heads 16 --seq 16384"; do
      # shellcheck disable=SC2086  # the shape is a list of arguments
      FLASHLM_ATTENTION_KERNEL=$kernel run "bench-$route-$(echo $shape | tr -d ' -')" 600 "$cli" attention-bench \
        --device cuda --impl flash --dtype bf16 $shape --d 256 --causal=0,1
      # shellcheck disable=SC2086
      FLASHLM_ATTENTION_KERNEL=$kernel run "bench-$route-$(echo $shape | tr -d ' -')-dv128" 600 "$cli" \
        attention-bench --device cuda --impl flash --dtype bf16 $shape --d 192 --d-v 128 --causal=0,1
    done
  done
else
  echo "| bench | - | skipped: no $cli |" | tee -a "$out/summary.md"
fi
echo "summary: $out/summary.md"
exit $failed
