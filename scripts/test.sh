#!/usr/bin/env bash
# Set everything up and run the test suite (a real MLflow server on a free port, tiny models and
# the real SmolLM2-135M). Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh || exit 1
# shellcheck disable=SC1091
. .venv/bin/activate
export MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1
python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
