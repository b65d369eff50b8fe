#!/usr/bin/env bash
# Put torch (>= 2.11) into the environment of the Python interpreter given as $1, choosing the
# build for this machine. Used by the Makefile (the README's commands) and scripts/check_wheel.sh.
#
#   1. torch already importable by that interpreter: kept as it is, whatever its version or build.
#   2. a GPU (nvidia-smi lists one): torch from the configured index (PyPI's build carries CUDA).
#   3. no GPU: a CPU build, so pip does not fetch gigabytes of CUDA libraries that cannot be used:
#      a. a torch wheel pip finds without any index (its find-links: a local wheel directory, as on
#         this project's machines) is installed from disk, then torch's own dependencies
#         (sympy, networkx, ...) from the configured index;
#      b. otherwise PyTorch's CPU wheel index.
#
# TORCH_SPEC overrides the requirement (default 'torch>=2.11'), e.g. TORCH_SPEC='torch==2.11.0'.
set -euo pipefail

py=${1:?usage: scripts/install_torch.sh PYTHON}
spec=${TORCH_SPEC:-torch>=2.11}
cpu_index=https://download.pytorch.org/whl/cpu
pip=("$py" -m pip install --quiet --disable-pip-version-check)

if version=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    echo "install_torch: torch $version is already installed; kept"
    exit 0
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install_torch: a GPU is present; installing '$spec' (CUDA build) from the package index"
    "${pip[@]}" "$spec"
elif "${pip[@]}" --no-index --no-deps "$spec" 2>/dev/null; then
    version=$("$py" -c 'from importlib.metadata import version; print(version("torch"))')
    echo "install_torch: no GPU; installed torch $version from a local wheel"
    "${pip[@]}" "torch==$version"  # its dependencies; the installed torch satisfies the pin
else
    echo "install_torch: no GPU; installing '$spec' (CPU build) from $cpu_index"
    "${pip[@]}" "$spec" --index-url "$cpu_index"
fi
"$py" -W ignore -c 'import torch; print("install_torch: torch", torch.__version__, "ready")'
