#!/usr/bin/env bash
# Prints the python of a small virtual environment with the `tokenizers` package from the package index
# (Hugging Face's Rust BPE; Debian has no package of it), creating it on first use: what
# `flashlm prepare --tokenizer bpe` and `flashlm generate` on BPE data run scripts/prepare_data.py with.
#   FLASHLM_TOKENIZERS_VENV=DIR   where it lives (default ~/.cache/flashlm/tokenizers-venv; ~80 MB, seconds)
# Use it as: export FLASHLM_PYTHON=$(scripts/setup-tokenizers.sh)
# Exits non-zero, printing nothing on stdout, when the environment cannot be made (no network, say).
set -euo pipefail
venv=${FLASHLM_TOKENIZERS_VENV:-$HOME/.cache/flashlm/tokenizers-venv}
ready() { "$venv/bin/python" -c "import tokenizers" 2>/dev/null; }
if ! ready; then
  echo "flashlm: creating $venv with tokenizers from the package index (first run only)" >&2
  rm -rf "$venv"
  /usr/bin/python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q "tokenizers>=0.15" >&2
  ready
fi
echo "$venv/bin/python"
