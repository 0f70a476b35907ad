#!/usr/bin/env bash
# Make the folders that the device commands of benchmarks/RESULTS.md name, for a GPU machine that
# has torch and transformers but not the project's environment (no network, no ./scripts/setup.sh):
#
#   carry/smollm2-tokenizer   the embedded SmolLM2 tokenizer, saved as a plain directory (the
#                             benchmarks pad it to each model's vocabulary)
#   carry/minilm-tokenizer    the embedded MiniLM encoder's BERT uncased tokenizer (gte-large's
#                             vocabulary), for the retriever benchmark
#   .whl/                     the locked wheels the benchmarks import beyond torch and
#                             transformers (TRL and its datasets stack, simple-icd-10-cm, MLflow,
#                             and Flask-WTF with WTForms for MLflow's basic-auth server),
#                             downloaded without their dependencies for the GPU machine's Python
#                             (PYVER, default 3.12: the device image's) on manylinux x86-64
#   .whl-arrow/               pyarrow alone: with it .whl/ would pass the 64 MiB a device call
#                             carries, so the two folders travel in separate calls
#
# Run it here, in the repository, with the project's .venv made by ./scripts/setup.sh; copy the
# folders with the tree (ignore them in .git/info/exclude and name them in the call's carry).
# On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl   (then .whl-arrow/)
#   export PYTHONPATH="$SITE:$PWD"
# where SITE is any writable folder (RESULTS.md writes /tmp/site). On a GPU machine that runs
# ./scripts/setup.sh itself, none of this is needed: activate .venv and pass
# `--tokenizer embedded` (or a saved tokenizer directory) to the benchmarks instead.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_HUB_OFFLINE=1
python - <<'PY'
from mistill.models.loading import load_tokenizer

from transformers import AutoTokenizer

from mistill.models.encoder import EMBEDDED_ENCODER, encoder_dir

load_tokenizer("embedded:smollm2-135m").save_pretrained("carry/smollm2-tokenizer")
AutoTokenizer.from_pretrained(str(encoder_dir(EMBEDDED_ENCODER))).save_pretrained("carry/minilm-tokenizer")
print("wrote carry/smollm2-tokenizer and carry/minilm-tokenizer")
PY
rm -rf .whl .whl-arrow
mkdir -p .whl .whl-arrow
pins=()
for name in trl datasets dill multiprocess xxhash pyarrow simple_icd_10_cm mlflow mlflow-skinny mlflow-tracing flask-wtf wtforms; do
  pin=$(grep -i -E "^${name}==" requirements/lock.txt || true)
  [ -n "$pin" ] && pins+=("$pin")
done
plat=(--only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
python -m pip download -q --no-deps "${plat[@]}" -d .whl "${pins[@]}"
mv .whl/pyarrow-*.whl .whl-arrow/
echo "wrote .whl/ and .whl-arrow/ (${#pins[@]} wheels: ${pins[*]})"
