# Sourced by the call scripts: paths, the deadline, a gtest runner.
set -uo pipefail
B=$PWD/.device/s10 P=$PWD/.device/s10/peers
t0=$SECONDS
left() { echo $((${DEADLINE:-575} - (SECONDS - t0))); }
step() { echo "== [$((SECONDS - t0)) s] $* (left $(left) s)"; }
nccl=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=$B:$nccl:/usr/local/cuda/lib64 PYTHONUNBUFFERED=1
mp="mpirun --allow-run-as-root --bind-to none -np 1 -x LD_LIBRARY_PATH"
gt() {  # binary limit log args...
  local exe=$1 limit=$2 log=$3; shift 3
  local l=$(( $(left) - 20 )); (( l < limit )) && limit=$l
  if (( limit < 10 )); then echo "$exe: SKIPPED (no time)"; return; fi
  timeout "$limit" "$B/$exe" --gtest_brief=1 "$@" > "$O/$log.log" 2>&1
  echo "$exe $*: exit $?; $(grep -E '^\[  PASSED  \]' "$O/$log.log" | tail -1)"
  grep -E "^\[  FAILED  \]|Failure$" "$O/$log.log" | head -12
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
