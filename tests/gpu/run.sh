#!/usr/bin/env bash
# The GPU acceptance checks (tests/gpu/check.py) on a machine with an NVIDIA GPU, run as root:
#
#     tests/gpu/run.sh [--criu PATH] [--out DIR] [--sizes MIB,MIB]
#
# Prints one PASS/FAIL line per item and a summary; exits 0 only when every item passed. Where no
# GPU is present it says SKIP and exits 0. It needs the machine's own Python with PyTorch (CUDA),
# numpy, cuda-python's driver bindings and nvidia-ml-py ($PYTHON, default python3), and criu where the
# project installs it (--criu, default /opt/singularity-slurm/bin/singularity-criu). The project
# need not be installed: its modules are imported from this checkout.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "SKIP: no NVIDIA GPU here (nvidia-smi -L failed or is missing)"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "FAIL: run as root (criu and the CUDA driver's checkpoint calls act on other processes)" >&2
    exit 1
fi
pkg=$(mktemp -d)
trap 'rm -rf "$pkg"' EXIT
mkdir "$pkg/singularity_slurm"
ln -s "$repo"/src/singularity_slurm/* "$pkg/singularity_slurm/"
for part in checkpoint node proxy interpose; do ln -s "$repo/$part" "$pkg/singularity_slurm/$part"; done
PYTHONPATH="$pkg:$here" PYTHONUNBUFFERED=1 "${PYTHON:-python3}" "$here/check.py" "$@"
