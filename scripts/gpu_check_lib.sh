# Sourced by the attention GPU checks (gpu-check-dqk-dv.sh, gpu-check-hopper-variants.sh,
# gpu-check-hopper-wide.sh): their common start and the runner that writes one log and one summary row per run.
# Before sourcing, the caller sets `usage`; its arguments are BUILD_DIR OUT_DIR. Sets build, out and exe (BUILD_DIR/tests/test_attention, which must
# exist), the library path, OUT_DIR/gpu.txt and OUT_DIR/summary.md's header, and failed=0.
build=${1:?$usage} out=${2:?$usage}
exe=$build/tests/test_attention
[[ -x $exe ]] || { echo "error: no $exe" >&2; exit 2; }
mkdir -p "$out"
export LD_LIBRARY_PATH=$build/src:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
printf '| run | exit | result |\n|---|---|---|\n' > "$out/summary.md"
failed=0

run() {  # NAME LIMIT CMD...: one run into OUT_DIR/NAME.log and a row of summary.md; failed=1 if it failed
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local summary
  summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\]|ERROR SUMMARY|RACECHECK SUMMARY' "$out/$name.log" |
    grep -v '^\[  FAILED  \] [A-Z]' | tr '\n' ' ')
  echo "| $name | $rc$( ((rc == 124)) && echo ' (timed out)') | ${summary:-see $name.log} |" | tee -a "$out/summary.md"
  grep -E '^\[  FAILED  \] [A-Z]' "$out/$name.log" | head -20
  ((rc == 0)) || failed=1
}
