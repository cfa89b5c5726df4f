#!/usr/bin/env bash
# Builds flashlm and runs every test (CPU tests always; GPU tests run when a GPU is visible and skip
# otherwise). CUDA code, when nvcc is present, is compiled for one architecture to keep this fast.
set -euo pipefail
cd "$(dirname "$0")/.."
# The PyTorch package is tested with Debian's torch and, where one can be had, a current torch from the
# package index in a cached virtual environment (scripts/setup-torch.sh; FLASHLM_TORCH_VENV=off skips it).
./scripts/setup-deps.sh
torch_python=$(./scripts/setup-torch.sh) || { echo "flashlm: no current torch; its package tests are skipped" >&2; torch_python=""; }
BUILD_DIR=${BUILD_DIR:-build-test} ./scripts/build.sh -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90} \
  -DFLASHLM_TORCH_PYTHON="$torch_python" "$@"
cd "${BUILD_DIR:-build-test}"
ctest --output-on-failure -j "$(nproc)" --timeout 1200
