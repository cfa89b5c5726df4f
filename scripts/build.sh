#!/usr/bin/env bash
# Configures and builds flashlm into ${BUILD_DIR:-build}. Extra arguments go to cmake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup-deps.sh
build=${BUILD_DIR:-build}
# A new build tree uses Ninja where it is installed (Debian's ninja-build; optional) and no generator was
# chosen (CMAKE_GENERATOR). Make orders whole targets: on 2 cores, while the sanitizer build's AVX-512 copy of
# attention/flash_cpu.cpp compiled (110 s), the other core sat idle for 100 s because the library's other
# files waited for it; Ninja orders files. An existing tree keeps the generator it was made with.
generator=()
if [ ! -f "$build/CMakeCache.txt" ] && [ -z "${CMAKE_GENERATOR:-}" ] && command -v ninja >/dev/null; then
  generator=(-G Ninja)
fi
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build" -j "$(nproc)"
