#!/usr/bin/env bash
# Builds flashlm and runs every test (CPU tests always; GPU tests run when a GPU is visible and skip
# otherwise). CUDA code, when nvcc is present, is compiled for one architecture to keep this fast.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-test} ./scripts/build.sh -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90} "$@"
cd "${BUILD_DIR:-build-test}"
ctest --output-on-failure -j "$(nproc)" --timeout 1200
