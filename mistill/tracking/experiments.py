"""Where stage runs live: the tracking server, one experiment per corpus, nesting and UI links.

* One experiment per corpus: ``mistill/<corpus>`` (:func:`experiment_for_corpus`), artifacts
  inherited from the server (proxied ``mlflow-artifacts:/``), tagged as a model-development
  experiment (``mlflow.experimentKind``) so that the MLflow UI opens on its runs.
* A stage started for another (:func:`child_runs_of`) is nested under it.
* Each ended run logs one ``View run <name> at: <url>`` line (:func:`run_url`; MLflow's own line
  is kept quiet by :func:`quiet_run_links`).

Only a tracking server is accepted (``http(s)://``): never the ``./mlruns`` file store. When no
tracking URI is configured, :func:`resolve_tracking_uri` starts (or reuses) the project's server.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mistill.errors import MistillInputError
from mistill.io import environment_variable, is_safe_name
from mistill.tracking.auth import ensure_client_credentials
from mistill.tracking.connection import is_unreachable
from mistill.tracking.naming import EXPERIMENT_KIND, TAG_DESCRIPTION, TAG_EXPERIMENT_KIND, experiment_description
from mistill.tracking.server import ensure_server

EXPERIMENT_PREFIX = "mistill/"
ENV_PARENT_RUN = "MISTILL_PARENT_RUN_ID"
"""Set by :func:`child_runs_of`: new stage runs, in this process or the ones it launches, are
nested under this run."""


# ------------------------------------------------------------------------------ experiments
def _client(tracking_uri: str | None = None) -> MlflowClient:
    return MlflowClient(tracking_uri=tracking_uri or resolve_tracking_uri())


def resolve_tracking_uri(root: Path | str = ".mistill") -> str:
    """The tracking URI to use: ``MLFLOW_TRACKING_URI`` if set, else the project's server
    (started or reused under ``root``). File stores are refused."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or ensure_server(root)
    if not re.match(r"^(https?|databricks)(://|$)", uri):
        raise MistillInputError(
            f"tracking URI {uri!r} is not a tracking server; mistill never uses a file or "
            f"direct database store: start one with `python -m mistill.tracking.server start`",
            field="MLFLOW_TRACKING_URI")
    ensure_client_credentials(uri, root)  # the project's server needs its owner's credentials
    return uri


def experiment_for_corpus(corpus_name: str, *, tracking_uri: str | None = None) -> str:
    """The experiment name ``mistill/<corpus_name>``, created if missing (artifact location
    inherited from the server) or restored if deleted."""
    if not is_safe_name(corpus_name):
        raise MistillInputError(f"corpus name {corpus_name!r} must be letters, digits, '_', '.', "
                                f"'-'", field="corpus")
    name = EXPERIMENT_PREFIX + corpus_name
    _experiment_id(_client(tracking_uri), name, create=True)
    return name


@contextlib.contextmanager
def _tolerate_mlflow_errors() -> Any:
    """Ignore an MLflow error the caller can do without, but never an unreachable server (each
    ignored outage would cost another wait for the client's bound)."""
    try:
        yield
    except MlflowException as exc:
        if is_unreachable(exc):
            raise


def _experiment_id(client: MlflowClient, experiment: str, *, create: bool = False) -> str | None:
    exp = client.get_experiment_by_name(experiment)
    if exp is None and not create:
        with _tolerate_mlflow_errors():
            exp = client.get_experiment(experiment)  # an id was given
        return exp.experiment_id if exp is not None else None
    if exp is None:
        try:
            return client.create_experiment(experiment, tags={
                TAG_EXPERIMENT_KIND: EXPERIMENT_KIND,
                TAG_DESCRIPTION: experiment_description(experiment.removeprefix(EXPERIMENT_PREFIX))})
        except MlflowException as exc:  # created concurrently by another stage
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                raise exc
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    if create:  # made by `mlflow run` or older code: the kind and the description it lacks
        missing = {TAG_EXPERIMENT_KIND: EXPERIMENT_KIND,
                   TAG_DESCRIPTION: experiment_description(experiment.removeprefix(EXPERIMENT_PREFIX))}
        for key, value in missing.items():
            if key not in (exp.tags or {}):
                with _tolerate_mlflow_errors():
                    client.set_experiment_tag(exp.experiment_id, key, value)
    return exp.experiment_id


def quiet_downloads() -> contextlib.AbstractContextManager[None]:
    """No progress bars for the small downloads (config.json, one per-note file)."""
    return environment_variable("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


# ------------------------------------------------------------------------ nesting and links
@contextlib.contextmanager
def child_runs_of(parent_run_id: str | None) -> Iterator[None]:
    """Nest the stage runs started inside under ``parent_run_id`` (``mlflow.parentRunId``),
    in this process and in the processes it launches (``mlflow run`` included): the id travels
    in ``$MISTILL_PARENT_RUN_ID``, restored on exit. None: no change."""
    if not parent_run_id:
        yield
        return
    with environment_variable(ENV_PARENT_RUN, parent_run_id):
        yield


_ENV_QUIET_LINKS = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
_quiet_links_lock = threading.Lock()
_quiet_links = {"depth": 0, "saved": None}


@contextlib.contextmanager
def quiet_run_links() -> Iterator[None]:
    """MLflow prints ``View run <name> at: <url>`` whenever a run ends; inside this block it
    does not (:class:`~mistill.tracking.runs.StageRun` logs one such line itself, with the run's status).

    Safe across threads (the cells of a λ selection end their runs in worker threads): blocks
    that overlap share one setting of the environment variable, restored when the last ends."""
    with _quiet_links_lock:
        if _quiet_links["depth"] == 0:
            _quiet_links["saved"] = os.environ.get(_ENV_QUIET_LINKS)
            os.environ[_ENV_QUIET_LINKS] = "true"
        _quiet_links["depth"] += 1
    try:
        yield
    finally:
        with _quiet_links_lock:
            _quiet_links["depth"] -= 1
            if _quiet_links["depth"] == 0:
                saved = _quiet_links["saved"]
                if saved is None:
                    os.environ.pop(_ENV_QUIET_LINKS, None)
                else:
                    os.environ[_ENV_QUIET_LINKS] = saved


UI_VIEW = "?workflowType=machine_learning"
"""The UI's query that opens the runs views (MLflow 3 otherwise opens an experiment on its GenAI
traces overview)."""


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """A run's page in the MLflow UI of ``tracking_uri``."""
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}{UI_VIEW}"


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    """An experiment's runs table in the MLflow UI of ``tracking_uri``."""
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs{UI_VIEW}"


__all__ = [
    "EXPERIMENT_PREFIX", "ENV_PARENT_RUN", "UI_VIEW", "resolve_tracking_uri", "experiment_for_corpus",
    "quiet_downloads", "child_runs_of", "quiet_run_links", "run_url", "experiment_url",
]
