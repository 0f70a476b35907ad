"""The deviations from the paper in the runs a report reads.

Two sources, both per run:

* the run's recorded configuration (``config.json``: ``config`` under ``class``) checked against
  the registry :data:`mistill.deviations.DEVIATIONS` with
  :func:`mistill.deviations.deviations_in`; for a ``train`` run also its resolved arm
  (class ``ArmConfig``), read from ``config.json``'s ``arm`` when it holds one, else from the
  run's ``arm.json``;
* the run's ``mistill.deviation`` tag (comma-separated codes the stage set itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from analysis.query import read_json_artifact, run_config
from mistill.deviations import arm_conventions, deviations_in

__all__ = ["ARM_CLASS", "ARM_JSON", "FINDING_COLUMNS", "TAG_COLUMNS", "deviation_tags",
           "run_deviations"]

ARM_CLASS = "ArmConfig"
ARM_JSON = "arm.json"
FINDING_COLUMNS: tuple[str, ...] = ("run_id", "run_name", "stage", "arm", "parameter", "value",
                                    "default", "paper_value", "kind")
TAG_COLUMNS: tuple[str, ...] = ("run_id", "run_name", "stage", "arm", "codes")


def _class_name(doc: Mapping[str, Any]) -> str:
    return str(doc.get("class", "")).rsplit(".", 1)[-1]


def resolved_arm(run_id: str, doc: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A train run's resolved arm: ``config.json``'s ``arm`` when it is a mapping of flags
    (``config``'s ``arm`` is the arm's name), else the run's ``arm.json``."""
    if doc:
        for holder in (doc, doc.get("config") or {}):
            arm = holder.get("arm") if isinstance(holder, Mapping) else None
            if isinstance(arm, Mapping):
                return dict(arm.get("config", arm)) if isinstance(arm.get("config"), Mapping) \
                    else dict(arm)
    arm = read_json_artifact(run_id, ARM_JSON)
    return dict(arm) if isinstance(arm, Mapping) else None


def _rows(run: Mapping[str, Any], findings: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each finding of ``run`` as a row of :data:`FINDING_COLUMNS`."""
    return [{"run_id": run["run_id"], "run_name": run.get("run_name"), "stage": run.get("stage"),
             "arm": run.get("arm"), **d} for d in findings]


def run_deviations(runs: Iterable[Mapping[str, Any]]) -> tuple[pd.DataFrame, list[str]]:
    """``(findings, problems)``: one row per registry parameter whose recorded value in a run
    is not the default or, at the default, differs from the paper (:data:`FINDING_COLUMNS`);
    ``problems`` names the runs whose configuration could not be read."""
    rows, problems = [], []
    for run in runs:
        doc = run_config(str(run["run_id"]))
        if doc is None or not isinstance(doc.get("config"), Mapping):
            problems.append(f"run {run['run_id']} ({run.get('stage')}): no readable config.json")
            continue
        rows += _rows(run, deviations_in(_class_name(doc), doc["config"]))
        if run.get("stage") == "train":
            arm = resolved_arm(str(run["run_id"]), doc)
            if arm is None:
                problems.append(f"run {run['run_id']} (train): no resolved arm recorded")
            else:
                rows += _rows(run, deviations_in(ARM_CLASS, arm) + arm_conventions(arm))
    return pd.DataFrame.from_records(rows, columns=list(FINDING_COLUMNS)), problems


def deviation_tags(runs: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per run whose ``mistill.deviation`` tag names codes (:data:`TAG_COLUMNS`;
    ``codes``: the codes, comma-separated, without blanks)."""
    rows = []
    for run in runs:
        tag = run.get("deviation")
        if not isinstance(tag, str):
            continue
        codes = [c.strip() for c in tag.split(",") if c.strip()]
        if codes:
            rows.append({"run_id": run["run_id"], "run_name": run.get("run_name"),
                         "stage": run.get("stage"), "arm": run.get("arm"),
                         "codes": ",".join(codes)})
    return pd.DataFrame.from_records(rows, columns=list(TAG_COLUMNS))
