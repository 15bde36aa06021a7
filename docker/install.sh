#!/usr/bin/env bash
# Installs kvpool into the current Python and keeps the torch that is already there: docker/Dockerfile runs it
# on the PyTorch base image (which brings its CUDA torch); on a machine without a GPU, --cpu puts torch's CPU
# build in first, so that pip never pulls the CUDA build and its nvidia-* packages.
#   usage: install.sh [--cpu | --torch REQUIREMENT] [PIP_INSTALL_ARGS...]    default ".", e.g. -e ".[test]"
#   --cpu              torch==$KVPOOL_TORCH_VERSION (2.13.0) from PyTorch's CPU wheel index, $KVPOOL_TORCH_INDEX
#                      (https://download.pytorch.org/whl/cpu); when that index cannot be reached, the CPU build
#                      torch==VERSION+cpu from the sources pip is configured with (a mirror, a wheel directory)
#   --torch REQUIREMENT  that torch, from the sources pip is configured with
set -euo pipefail

cpu_index=${KVPOOL_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
cpu_version=${KVPOOL_TORCH_VERSION:-2.13.0}
torch_mode="" torch_req=""
case "${1:-}" in
  --cpu) torch_mode=cpu; shift ;;
  --torch)
    torch_mode=req
    torch_req=${2:?"--torch needs a requirement, e.g. torch==2.13.0"}
    shift 2
    ;;
esac
(($#)) || set -- .
python=${PYTHON:-python3}

pip() { "$python" -m pip "$@"; }
# the installed distribution's version: torch.__version__ can differ from it (2.11.0+cu130 for 2.11.0)
torch_version() { "$python" -c 'import importlib.metadata as m; print(m.version("torch"))'; }
reachable() {
  "$python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=15)' \
    "$1" 2>/dev/null
}

case "$torch_mode" in
  cpu)
    if reachable "$cpu_index"; then
      echo "install.sh: torch $cpu_version (CPU build) from $cpu_index"
      pip install --no-cache-dir --index-url "$cpu_index" "torch==$cpu_version"
    else
      echo "install.sh: $cpu_index cannot be reached; looking for torch==$cpu_version+cpu in pip's configured sources"
      if ! pip install --no-cache-dir "torch==$cpu_version+cpu"; then
        echo "install.sh: no CPU build of torch $cpu_version found: set KVPOOL_TORCH_INDEX to a mirror of" \
          "PyTorch's CPU wheel index, or install torch yourself and leave --cpu out" >&2
        exit 1
      fi
    fi
    ;;
  req) pip install --no-cache-dir "$torch_req" ;;
esac
if ! before=$(torch_version); then
  echo "install.sh: $python has no torch; the image gets it from its base, elsewhere pass --cpu" >&2
  exit 1
fi

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$before" >"$constraints"
pip install --no-cache-dir --constraint "$constraints" "$@"

after=$(torch_version)
if [[ "$after" != "$before" ]]; then
  echo "install.sh: torch changed from $before to $after" >&2
  exit 1
fi
scripts=$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
"$scripts/kvpool" --help >/dev/null
echo "install.sh: kvpool installed with torch $after"
