#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages flashlm builds with, when any is missing. Idempotent and quiet
# when everything is there. CUDA is optional: install the CUDA toolkit yourself to build the kernels.
set -euo pipefail

# python3-torch (CPU) and python3-pytest run the PyTorch binding tests (python3-venv holds the current torch
# of scripts/setup-torch.sh); OpenMPI (libopenmpi-dev, and openmpi-bin's mpirun) starts distributed jobs
# and carries the CPU collectives; zlib1g-dev's CRC-32 checksums checkpoints; python3-matplotlib draws the
# plots (scripts/plot_*.py); ninja-build schedules the build file by file (scripts/build.sh takes it for a new
# build tree, else make).
packages=(cmake g++ make ninja-build libfmt-dev libcli11-dev nlohmann-json3-dev libgtest-dev libopenblas-dev libopenmpi-dev
          openmpi-bin zlib1g-dev python3-torch python3-pytest python3-venv
          python3-matplotlib)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "flashlm: installing ${missing[*]}" >&2
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
