#!/usr/bin/env bash
# Installs kvpool into the current Python and keeps the torch that is already there: docker/Dockerfile runs it
# on the PyTorch base image, CI runs it the same way after --torch has put a CPU build in first.
#   usage: install.sh [--torch REQUIREMENT] [PIP_INSTALL_ARGS...]    default ".", e.g. ".[test]" or -e ".[test]"
set -euo pipefail

torch_req=""
if [[ "${1:-}" == "--torch" ]]; then
  torch_req=${2:?"--torch needs a requirement, e.g. torch==2.13.0"}
  shift 2
fi
(($#)) || set -- .
python=${PYTHON:-python3}

pip() { "$python" -m pip "$@"; }
# the installed distribution's version: torch.__version__ can differ from it (2.11.0+cu130 for 2.11.0)
torch_version() { "$python" -c 'import importlib.metadata as m; print(m.version("torch"))'; }

if [[ -n "$torch_req" ]]; then
  pip install --no-cache-dir "$torch_req"
fi
if ! before=$(torch_version); then
  echo "install.sh: $python has no torch; the image gets it from its base, elsewhere pass --torch" >&2
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
