"""Trained checkpoints as model specs: ``run:<train run id>`` names the model a ``train`` run saved.

The checkpoint is read from the run's local work dir (``$MISTILL_ROOT/work/<run id>/model``) when
this machine trained it, else its ``model`` artifacts are downloaded there once. Every stage that
takes a ``model`` accepts such a spec (see :mod:`mistill.models.loading`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from mistill.errors import MistillInputError

RUN_PREFIX = "run:"


def run_artifact_dir(run_id: str, artifact_path: str, *, stage: str, marker: str, field: str) -> Path:
    """Local copy of the directory ``artifact_path`` that a ``stage`` run logged.

    It lives at ``$MISTILL_ROOT/work/<run id>/<artifact_path>``: the run's own work dir when this
    machine ran it (recognised by its ``marker`` file), else the artifacts are downloaded there
    once (into a temporary directory, then renamed, so nothing half-written is left). Errors
    name ``field``: a missing run, a run of another stage, artifacts absent or without ``marker``.
    """
    from mlflow.tracking import MlflowClient

    from mistill.stages.common import mistill_root

    local = mistill_root() / "work" / run_id / artifact_path
    if (local / marker).exists():
        return local.resolve()
    client = MlflowClient()
    try:
        run = client.get_run(run_id)
    except Exception as exc:  # noqa: BLE001 - MLflow raises several types for a missing run
        raise MistillInputError(f"no run {run_id!r} on the tracking server ({exc.__class__.__name__})",
                                field=field) from None
    if run.data.tags.get("mistill.stage") != stage:
        raise MistillInputError(f"run {run_id} is a {run.data.tags.get('mistill.stage')!r} run, not a {stage} run",
                                field=field)
    local.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=local.parent, prefix=f".dl-{artifact_path}-") as tmp:
        try:
            got = client.download_artifacts(run_id, artifact_path, tmp)
        except Exception:  # noqa: BLE001
            raise MistillInputError(f"{stage} run {run_id} logged no {artifact_path} artifacts", field=field) from None
        if not (Path(got) / marker).exists():
            raise MistillInputError(f"the {artifact_path} artifacts of run {run_id} hold no {marker}", field=field)
        if local.exists():
            shutil.rmtree(local)
        os.replace(got, local)
    return local.resolve()


def trained_model_dir(run_id: str) -> Path:
    """Local directory of the checkpoint logged by ``train`` run ``run_id`` (``config.json`` inside)."""
    return run_artifact_dir(run_id, "model", stage="train", marker="config.json", field="model")


def resolve_run_spec(spec: str) -> str:
    """``run:<id>[@layers]`` -> the checkpoint's local path (other specs unchanged)."""
    if not spec.startswith(RUN_PREFIX):
        return spec
    return str(trained_model_dir(spec[len(RUN_PREFIX):]))
