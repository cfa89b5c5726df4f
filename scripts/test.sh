#!/usr/bin/env bash
# Builds flashlm and runs every test (CPU tests always; GPU tests run when a GPU is visible and skip
# otherwise). CUDA code, when nvcc is present, is compiled for one architecture to keep this fast.
# Then builds the CPU code again with AddressSanitizer + UBSan (FLASHLM_SANITIZE, in build-sanitize) and
# runs the CPU tests under it: a memory error, a leak or undefined behaviour fails the run.
# SANITIZE=0 skips the second build.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${BUILD_DIR:-build-test}
# The PyTorch package is tested with Debian's torch and, where one can be had, a current torch from the
# package index in a cached virtual environment (scripts/setup-torch.sh; FLASHLM_TORCH_VENV=off skips it).
./scripts/setup-deps.sh
torch_python=$(./scripts/setup-torch.sh) || { echo "flashlm: no current torch; its package tests are skipped" >&2; torch_python=""; }
# The BPE tests (cli.text2model_bpe) run scripts/prepare_data.py with the `tokenizers` package from a small
# cached virtual environment (scripts/setup-tokenizers.sh).
tokenizers_python=$(./scripts/setup-tokenizers.sh) || { echo "flashlm: no tokenizers package; the BPE tests are skipped" >&2; tokenizers_python=""; }
# FLASHLM_WERROR: a warning in our own C++ fails the run (CMakeLists.txt says which warnings stay warnings).
BUILD_DIR=$build ./scripts/build.sh -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90} -DFLASHLM_WERROR=ON \
  -DFLASHLM_TORCH_PYTHON="$torch_python" -DFLASHLM_TOKENIZERS_PYTHON="$tokenizers_python" "$@"
(cd "$build" && ctest --output-on-failure -j "$(nproc)" --timeout 1200)

if [ "${SANITIZE:-1}" != 0 ]; then
  sanitize=${SANITIZE_BUILD_DIR:-build-sanitize}
  BUILD_DIR=$sanitize ./scripts/build.sh -DFLASHLM_CUDA=OFF -DFLASHLM_SANITIZE=ON
  # fast_unwind_on_malloc=0: full stacks for every allocation, so that OpenMPI's own leaks (some through
  # plugins it has unloaded by exit) show the libmpi frames the suppressions match. Leak detection stays on
  # for our code. UBSan findings abort (-fno-sanitize-recover) with a stack.
  export ASAN_OPTIONS=fast_unwind_on_malloc=0
  export LSAN_OPTIONS=suppressions=$root/tests/sanitizer/lsan.supp
  export UBSAN_OPTIONS=print_stacktrace=1
  # Label sanitizer_skip: tests that cannot run under the sanitizers or take too long there (see
  # tests/CMakeLists.txt for each one's reason).
  (cd "$sanitize" && ctest --output-on-failure -j "$(nproc)" --timeout 1200 -LE sanitizer_skip)
fi
