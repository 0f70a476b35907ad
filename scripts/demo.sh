#!/usr/bin/env bash
# Set everything up and run the `pipeline` entry point on the embedded default (synthetic corpus +
# SmolLM2-135M on the CPU), against a local MLflow tracking server. Extra arguments go to
# `mlflow run` (e.g. -P n_notes=8). The server keeps running afterwards so the UI can be opened;
# stop it with: .venv/bin/python -m mistill.tracking.server stop
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1
python -m mistill.tracking.server start >/dev/null
# the URI and the owner's credentials: the server refuses a client without them
eval "$(python -m mistill.tracking.server env)"
# the steps run in the pipeline's own process (no interpreter start and import per step)
mlflow run . -e pipeline --env-manager local --experiment-name mistill/synthetic -P launch=inline "$@"
echo
python - <<'PY'
import os

from mlflow.tracking import MlflowClient

from mistill.tracking.experiments import experiment_url

uri = os.environ["MLFLOW_TRACKING_URI"]
exp = MlflowClient(uri).get_experiment_by_name("mistill/synthetic")
print(f"MLflow UI: {experiment_url(uri, exp.experiment_id) if exp else uri}   (experiment mistill/synthetic)")
PY
