#!/usr/bin/env bash
# The PyTorch package as a user gets it: builds the platform wheel from python/ (scikit-build-core, no
# build isolation) bundling an already built libflashlm_attention.so (so nothing is compiled again),
# installs it into a fresh --target directory and, from outside the repository and without
# FLASHLM_LIBRARY, imports flashlm and checks an op and its gradients against float64 attention with every python given. Then
# the two ways an install can lack the library must fail clearly: a wheel build given no library, and an
# installed package whose library is gone.
#   wheel_smoke.sh LIBRARY WORKDIR BUILD_PYTHON [PYTHON...]
# BUILD_PYTHON needs pip and scikit-build-core (scripts/setup-torch.sh's environment has them).
set -euo pipefail
library=$1 work=$2 build_python=$3
shift 3
root=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$work" && mkdir -p "$work"
unset FLASHLM_LIBRARY PYTHONPATH
fail() { echo "wheel_smoke: $*" >&2; exit 1; }

build_wheel() {  # build_wheel LIBRARY NAME (the build folder and log's)
  "$build_python" -m pip wheel --no-build-isolation --no-deps -q -w "$work/dist" "$root/python" \
    --config-settings=cmake.define.FLASHLM_PYTHON_LIBRARY="$1" --config-settings=cmake.define.FLASHLM_CUDA=OFF \
    --config-settings=build-dir="$work/$2" >"$work/$2.log" 2>&1
}
start=$SECONDS
build_wheel "$library" wheel || { cat "$work/wheel.log"; fail "the wheel did not build"; }
wheel=$(ls "$work"/dist/flashlm-*.whl)
case $wheel in *-py3-none-linux_*.whl) ;; *) fail "$wheel is not a py3-none-linux platform wheel" ;; esac
contents=$("$build_python" -m zipfile -l "$wheel")  # (not piped into grep -q: pipefail and a closed pipe)
[[ $contents == *flashlm/lib/libflashlm_attention.so* ]] || fail "$wheel lacks the library"
echo "built $(basename "$wheel") in $((SECONDS - start)) s"

"$build_python" -m pip install -q --no-deps --target "$work/site" "$wheel"
cat > "$work/smoke.py" <<'PY'
import math, sys
import torch
import flashlm
site = sys.argv[1]
assert flashlm.__file__.startswith(site) and flashlm._lib.path.startswith(site), (flashlm.__file__, flashlm._lib.path)
g = torch.Generator().manual_seed(7)
q, k, v = (torch.randn(2, 3, 37, 16, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
o = flashlm.scaled_dot_product_attention(q, k, v, is_causal=True)
mask = torch.ones(37, 37, dtype=torch.bool).tril()  # (torch 1.13 has no F.scaled_dot_product_attention)
ref = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(16)).masked_fill(~mask, float("-inf")), -1) @ v
assert (o - ref).abs().max().item() < 1e-10, (o - ref).abs().max().item()
grads = torch.autograd.grad(o.sum(), (q, k, v))
refs = torch.autograd.grad(ref.sum(), (q, k, v))
assert all((a - b).abs().max().item() < 1e-9 for a, b in zip(grads, refs))
print(f"flashlm {flashlm.__version__} from {flashlm._lib.path} with torch {torch.__version__}: forward and "
      "backward match float64 attention")
PY
for python in "$build_python" "$@"; do
  (cd "$work" && PYTHONPATH="$work/site" "$python" smoke.py "$work/site") || fail "the installed wheel failed with $python"
done

# An installed package without its library: the import names what it tried and what to do.
cp -r "$work/site" "$work/site-nolib" && rm "$work/site-nolib/flashlm/lib/libflashlm_attention.so"
if (cd "$work" && PYTHONPATH="$work/site-nolib" "$build_python" -c "import flashlm") >"$work/nolib.log" 2>&1; then
  fail "flashlm imported without its library"
fi
grep -q "ImportError: flashlm: the attention library was not found" "$work/nolib.log" || { cat "$work/nolib.log"; fail "no clear error without the library"; }
# A wheel build told to bundle a library that is not there stops at configure, naming the setting.
if build_wheel "$work/no-such-library.so" nolib-wheel; then
  fail "a wheel built without a library"
fi
message=$(tr -s ' \n' '  ' <"$work/nolib-wheel.log")  # CMake wraps its message at any space
[[ $message == *"FLASHLM_PYTHON_LIBRARY: '$work/no-such-library.so' is not a file"* ]] || { cat "$work/nolib-wheel.log"; fail "no clear error from the wheel build"; }
echo "wheel_smoke: 1 wheel built, installed and run with $(( $# + 1 )) python(s); both missing-library cases fail clearly (${SECONDS} s)"
