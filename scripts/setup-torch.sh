#!/usr/bin/env bash
# Prints the python of a virtual environment with a current PyTorch from the package index (torch >= 2.4:
# torch.library.custom_op, torch.compile, torch.export), creating it on first use, so that the tests run the
# package's operator paths as well as Debian's python3-torch 1.13 (no custom ops, no compile) does. It also
# holds scikit-build-core, which builds the package's wheel in the tests (tests/package/wheel_smoke.sh).
#   FLASHLM_TORCH_VENV=DIR   where it lives (default ~/.cache/flashlm/torch-venv; kept between runs, so only
#                            the first run on a machine downloads: ~4 GB with the CUDA libraries PyPI's
#                            Linux torch depends on, ~5 min here; pip's own cache makes a rebuild faster)
#   FLASHLM_TORCH_VENV=off   skip it (prints nothing)
# Exits non-zero, printing nothing on stdout, when the environment cannot be made (no network, say).
set -euo pipefail
venv=${FLASHLM_TORCH_VENV:-$HOME/.cache/flashlm/torch-venv}
[[ $venv == off ]] && exit 0
ready() { "$venv/bin/python" -c "import torch, pytest; assert hasattr(torch.library, 'custom_op')" 2>/dev/null; }
if ! ready; then
  echo "flashlm: creating $venv with torch from the package index (first run only)" >&2
  rm -rf "$venv"
  /usr/bin/python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q "torch>=2.4" pytest numpy "scikit-build-core>=0.10" >&2
  ready
fi
if ! "$venv/bin/python" -c "import scikit_build_core" 2>/dev/null; then  # (environments made before it was)
  "$venv/bin/python" -m pip install -q "scikit-build-core>=0.10" >&2
fi
echo "$venv/bin/python"
