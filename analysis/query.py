"""The tracking store as tidy tables: runs found by their ``mistill.*`` tags, their metrics, and
their per-run and per-note CSV artifacts.

One row per run (:func:`stage_runs`): ``run_id``, ``run_name``, ``start_time`` and the tag
columns of :data:`TAG_COLUMNS` (``stage``, ``model``, ``arm``, ``lambda``, ``seed``, ``precision``,
``corpus``, ``privacy``, ...), then one column per metric. :func:`latest_runs` keeps the newest run
of each (model, arm, precision, seed). :func:`per_note_table` stacks one CSV artifact of many
runs with those run columns in front, one row per (run, note) or (run, note, phase, k).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from mlflow.tracking import MlflowClient

from mistill.errors import MistillInputError
from mistill.io import read_json
from mistill.stages.common import RunReader
from mistill.tracking.experiments import _experiment_id
from mistill.tracking.identity import _quote
from mistill.tracking.naming import (CONFIG_ARTIFACT, TAG_ARM, TAG_CORPUS, TAG_INPUT_PREFIX, TAG_LAMBDA, TAG_MODEL,
                                     TAG_PRECISION, TAG_PRIVACY, TAG_SEED, TAG_SPLIT, TAG_STAGE)

__all__ = [
    "RUN_KEY",
    "TAG_COLUMNS",
    "TAG_DEVIATION",
    "ArtifactLoad",
    "experiment_id",
    "latest_runs",
    "metric_history",
    "per_note_table",
    "read_json_artifact",
    "run_config",
    "stage_runs",
]

TAG_DEVIATION = "mistill.deviation"
"""A run's own account of where it departs from the paper: comma-separated deviation codes."""

TAG_COLUMNS: dict[str, str] = {"stage": TAG_STAGE, "model": TAG_MODEL, "arm": TAG_ARM,
                               "lambda": TAG_LAMBDA, "seed": TAG_SEED, "precision": TAG_PRECISION,
                               "corpus": TAG_CORPUS, "privacy": TAG_PRIVACY, "split": TAG_SPLIT,
                               "train_run": TAG_INPUT_PREFIX + "train",
                               "attribute_run": TAG_INPUT_PREFIX + "attribute",
                               "deviation": TAG_DEVIATION}
"""Column name -> the tag it is read from (``lambda``: the λ the run trained, or that the train
run whose checkpoint it reads trained, ``<λ>`` or ``<λ_P1>,<λ_P2>``, None for no λ; ``train_run``,
``attribute_run``: the lineage tags naming the train or attribute run a run read)."""

RUN_KEY: tuple[str, ...] = ("model", "arm", "precision", "seed")
"""What identifies one cell of a table: a run of the same key written later replaces it."""

_PAGE = 1000


def experiment_id(client: MlflowClient, experiment: str) -> str | None:
    """The id of an experiment given by name (``mistill/<corpus>``) or id; None if absent."""
    return _experiment_id(client, experiment)


def stage_runs(client: MlflowClient, experiment: str, stage: str, *,
               arms: Sequence[str] = (), status: str = "FINISHED", params: Sequence[str] = ()) -> pd.DataFrame:
    """Every run of one stage in an experiment, as one row per run (newest first).

    Args:
        client: a client of the tracking server.
        experiment: experiment name or id.
        stage: the ``mistill.stage`` tag (``evaluate``, ``own_heads``, ``knockin``, ...).
        arms: keep only these ``mistill.arm`` values (empty: every arm, and runs without one).
        status: run status to keep (``FINISHED``: runs still being written are left out).
        params: params to read as columns ``params.<name>`` (strings as logged; None if absent).

    Columns: ``run_id, run_name, start_time, end_time``, :data:`TAG_COLUMNS` (``seed`` as a nullable
    integer, missing tags as None), ``checkpoint`` (the model spec as tagged) and one float
    column per metric name logged by any run. ``model`` is the tagged model, except for a run
    on a trained checkpoint (``run:<train run id>``): there, the model that train run trained.
    An absent experiment gives an empty frame with those columns.
    """
    columns = ["run_id", "run_name", "start_time", "end_time", *TAG_COLUMNS, "checkpoint",
               *(f"params.{p}" for p in params)]
    exp_id = experiment_id(client, experiment)
    if exp_id is None:
        return pd.DataFrame(columns=columns)
    filt = f"tags.`{TAG_STAGE}` = '{_quote(stage)}' and attributes.status = '{_quote(status)}'"
    records = []
    token: str | None = None
    while True:
        page = client.search_runs([exp_id], filter_string=filt, max_results=_PAGE,
                                  order_by=["attributes.start_time DESC"], page_token=token)
        for run in page:
            tags = run.data.tags
            rec = {"run_id": run.info.run_id, "run_name": run.info.run_name,
                   "start_time": run.info.start_time, "end_time": run.info.end_time}
            rec.update({col: tags.get(tag) for col, tag in TAG_COLUMNS.items()})
            rec.update({f"params.{p}": run.data.params.get(p) for p in params})
            rec.update(run.data.metrics)
            records.append(rec)
        token = page.token
        if not token:
            break
    df = pd.DataFrame.from_records(records, columns=None if records else columns)
    df = _base_models(client, df)
    if arms:
        df = df[df["arm"].isin(list(arms))]
    df["seed"] = pd.to_numeric(df["seed"], errors="coerce").astype("Int64")
    return df.reset_index(drop=True)


CHECKPOINT_PREFIX = "run:"
"""A model spec naming a train run's checkpoint (``run:<train run id>``)."""


def _base_models(client: MlflowClient, df: pd.DataFrame) -> pd.DataFrame:
    """``model`` of a run on a trained checkpoint (``run:<id>``) replaced by the model that train
    run trained (its ``mistill.model`` tag), so that the arms of one student share a model; the
    spec itself is kept in ``checkpoint``."""
    df = df.copy()
    df["checkpoint"] = df["model"] if "model" in df else None
    if df.empty:
        return df
    base: dict[str, str | None] = {}
    for spec in df["model"].dropna().unique():
        if str(spec).startswith(CHECKPOINT_PREFIX):
            try:
                base[spec] = client.get_run(str(spec)[len(CHECKPOINT_PREFIX):]).data.tags.get(
                    TAG_MODEL)
            except Exception:  # noqa: BLE001  (a deleted train run keeps its spec)
                base[spec] = None
    df["model"] = [base.get(m) or m for m in df["model"]]
    return df


def latest_runs(runs: pd.DataFrame, key: Sequence[str] = RUN_KEY) -> pd.DataFrame:
    """The newest run of each ``key`` (missing key values count as one value)."""
    if runs.empty:
        return runs
    ordered = runs.sort_values("start_time", ascending=False, kind="stable")
    keep = ~ordered[list(key)].astype(str).duplicated()
    return ordered[keep].sort_values(list(key), kind="stable").reset_index(drop=True)


@dataclass
class ArtifactLoad:
    """A CSV artifact of many runs stacked: the rows, and the runs that lacked it (and why)."""

    frame: pd.DataFrame
    missing: dict[str, str] = field(default_factory=dict)


def per_note_table(runs: pd.DataFrame, artifact: str, required: Iterable[str],
                   run_columns: Sequence[str] = ("run_id", *RUN_KEY)) -> ArtifactLoad:
    """Stack the CSV ``artifact`` of every run in ``runs`` with that run's columns in front.

    A run whose artifact is missing or lacks a ``required`` column is left out and named in
    :attr:`ArtifactLoad.missing`. ``note_id`` is read as a string.
    """
    required = list(required)
    frames, missing = [], {}
    for _, run in runs.iterrows():
        try:
            path = RunReader(run["run_id"], field=artifact).file(artifact)
            df = pd.read_csv(path, dtype={"note_id": str})
        except (MistillInputError, OSError, pd.errors.ParserError) as exc:
            missing[run["run_id"]] = f"{artifact}: {exc}"
            continue
        lacking = [c for c in required if c not in df.columns]
        if lacking:
            missing[run["run_id"]] = f"{artifact} lacks columns {lacking}"
            continue
        df = df.drop(columns=[c for c in run_columns if c in df.columns])
        for col in reversed(run_columns):
            df.insert(0, col, run[col])
        frames.append(df)
    if not frames:
        return ArtifactLoad(pd.DataFrame(columns=[*run_columns, *required]), missing)
    out = pd.concat(frames, ignore_index=True)
    if "seed" in out.columns:
        out["seed"] = pd.to_numeric(out["seed"], errors="coerce").astype("Int64")
    return ArtifactLoad(out, missing)


def read_json_artifact(run_id: str, artifact: str) -> Any:
    """A JSON artifact of a run; None when the run lacks it or it does not parse."""
    try:
        return read_json(RunReader(run_id, field=artifact).file(artifact))
    except (MistillInputError, OSError, ValueError):
        return None


def run_config(run_id: str) -> dict[str, Any] | None:
    """A run's whole ``config.json`` (``config``, ``class``, ...); None when it is missing."""
    doc = read_json_artifact(run_id, CONFIG_ARTIFACT)
    return doc if isinstance(doc, dict) else None


def metric_history(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    """``step -> value`` of one metric of a run (the last value logged at a step wins)."""
    return {int(m.step): float(m.value) for m in sorted(client.get_metric_history(run_id, key),
                                                        key=lambda m: (m.step, m.timestamp))}
