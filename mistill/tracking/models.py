"""Trained checkpoints as model specs: ``run:<train run id>`` names the model a ``train`` run saved.

The checkpoint is read from the run's local work dir (``$MISTILL_ROOT/work/<run id>/model``) when
this machine trained it, else its ``model`` artifacts are downloaded there once. Every stage that
takes a ``model`` accepts such a spec (see :mod:`mistill.models.loading`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mistill.errors import MistillInputError

RUN_PREFIX = "run:"


def trained_model_dir(run_id: str) -> Path:
    """Local directory of the checkpoint logged by ``train`` run ``run_id`` (``config.json`` inside)."""
    from mlflow.tracking import MlflowClient

    from mistill.stages.common import mistill_root

    local = mistill_root() / "work" / run_id / "model"
    if (local / "config.json").exists():
        return local.resolve()
    client = MlflowClient()
    try:
        run = client.get_run(run_id)
    except Exception as exc:  # noqa: BLE001 - MLflow raises several types for a missing run
        raise MistillInputError(f"no run {run_id!r} on the tracking server ({exc.__class__.__name__})",
                                field="model") from None
    if run.data.tags.get("mistill.stage") != "train":
        raise MistillInputError(f"run {run_id} is a {run.data.tags.get('mistill.stage')!r} run, not a train run",
                                field="model")
    local.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=local.parent, prefix=".dl-model-") as tmp:
        try:
            got = client.download_artifacts(run_id, "model", tmp)
        except Exception:  # noqa: BLE001
            raise MistillInputError(f"train run {run_id} logged no model artifacts", field="model") from None
        if not (Path(got) / "config.json").exists():
            raise MistillInputError(f"the model artifacts of run {run_id} hold no config.json", field="model")
        os.replace(got, local)
    return local.resolve()


def resolve_run_spec(spec: str) -> str:
    """``run:<id>[@layers]`` -> the checkpoint's local path (other specs unchanged)."""
    if not spec.startswith(RUN_PREFIX):
        return spec
    return str(trained_model_dir(spec[len(RUN_PREFIX):]))
