"""Hand-built run sets for the report tests: real runs on the test MLflow server, written through
:class:`StageRun` with the tags, metrics and artifacts of the stage contracts the report reads
(``evaluate``, ``own_heads``, ``knockin``, ``select_lambda``), with values whose statistics are
known in advance."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mistill.config import Config
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.runs import StageRun

STUDENT = "student-a"
TEACHER = "teacher-t"
NOTES = [f"n{i:02d}" for i in range(12)]


@dataclasses.dataclass(frozen=True)
class FakeStageConfig(Config):
    """The fields a real stage would log as params (a different digest per run)."""

    arm: str = ""
    seed: int = 0
    tag: str = ""


def make_run(uri: str, corpus: str, stage: str, root: Path, *, arm: str | None = None,
             seed: int | None = None, precision: str | None = None, model: str = STUDENT,
             metrics: dict[str, float] | None = None,
             tables: dict[str, pd.DataFrame] | None = None,
             jsons: dict[str, Any] | None = None, tags: dict[str, str] | None = None) -> str:
    """One FINISHED run of ``stage`` with these tags, metrics, CSV and JSON artifacts."""
    cfg = FakeStageConfig(arm=arm or "", seed=seed or 0, tag=f"{stage}-{arm}-{seed}-{model}")
    with StageRun(stage, cfg, corpus=corpus, guard=PrivacyGuard([], "synthetic"), model=model,
                  arm=arm, seed=seed, precision=precision, root=root, code_version="test",
                  tracking_uri=uri, tags=tags) as run:
        if metrics:
            run.log_metrics(metrics)
        for name, df in (tables or {}).items():
            run.log_table(name, df, index=False)
        for name, obj in (jsons or {}).items():
            run.log_json(name, obj)
        return run.run_id


# --------------------------------------------------------------------------- known values
def eval_notes(arm: str, seed: int) -> pd.DataFrame:
    """Per-note metrics: the reference's F1 from a fixed draw; ``mistill`` exactly +0.1 on every
    note and seed; ``opd`` (one seed) a second fixed draw; counts consistent with small lists."""
    rng = np.random.default_rng(100 + seed)
    base = np.round(rng.uniform(0.1, 0.6, len(NOTES)), 3)
    f1 = {"vanilla-bf16": base, "mistill": base + 0.1, "untrained": base * 0.2,
          "teacher": np.full(len(NOTES), 0.7),
          "opd": np.round(np.random.default_rng(7).uniform(0.0, 0.8, len(NOTES)), 3)}[arm]
    tp = {"vanilla-bf16": 2, "mistill": 3, "untrained": 0, "teacher": 4, "opd": 2}[arm]
    return pd.DataFrame({"note_id": NOTES, "micro_f1": f1,
                         "tp": [tp + (i % 2) * seed for i in range(len(NOTES))],
                         "fp": [1 + i % 3 for i in range(len(NOTES))],
                         "fn": [2] * len(NOTES), "valid": True,
                         "ppl": 1.5 + f1, "bleu4": f1 / 2, "las": f1 - 0.05})


EVAL_RUNS: dict[tuple[str, int], dict[str, float]] = {
    ("teacher", 0): {"micro_f1": 0.5},
    ("untrained", 0): {"micro_f1": 0.1},
    ("vanilla-bf16", 0): {"micro_f1": 0.30}, ("vanilla-bf16", 1): {"micro_f1": 0.32},
    ("mistill", 0): {"micro_f1": 0.34}, ("mistill", 1): {"micro_f1": 0.36},
    ("opd", 0): {"micro_f1": 0.25},
}
"""Run-level micro-F1 per (arm, seed): mistill's seed mean 0.35, gap recovered 0.625."""


def eval_metrics(arm: str, seed: int) -> dict[str, float]:
    m = dict(EVAL_RUNS[(arm, seed)])
    m.update({"macro_f1": m["micro_f1"] / 2, "valid_rate": 0.9, "cap_rate": 0.1,
              "mean_generated_tokens": 100.0 + seed, "fidelity.ppl_median": 1.6,
              "fidelity.bleu4_mean": 0.2, "fidelity.las_mean": 0.1,
              "m1.P1.p_pos": 0.8, "m1.P2.p_pos": 0.7, "m1.P2C.p_pos": 0.6 + 0.01 * seed})
    return m


OWN_DELTA = {0: 0.05, 1: 0.01}
"""Mistill's own P2C k=40 recovery is the reference's plus this, per seed (every note)."""


def own_notes(arm: str, seed: int) -> pd.DataFrame:
    rows = []
    for i, note in enumerate(NOTES):
        for phase in ("P1", "P2C"):
            for k in (8, 40):
                ref = 0.3 + 0.04 * i + (0.1 if k == 40 else 0.0) + 0.02 * seed
                own = ref + (OWN_DELTA[seed] if arm == "mistill" and phase == "P2C" and k == 40
                             else 0.0)
                rows.append({"note_id": note, "phase": phase, "k": k, "recovery_own": own,
                             "recovery_random": 0.05 + 0.001 * i, "necessity_own": 0.5})
    return pd.DataFrame(rows)


def own_metrics(arm: str, seed: int, phase_k=(("P1", 8), ("P1", 40), ("P2C", 8), ("P2C", 40))):
    m: dict[str, float] = {"m2.region_lift": 2.0 + seed, "m3.near_miss_share": 0.05,
                           "prefix_share": 0.3}
    for phase, k in phase_k:
        m[f"m4.{phase}.k{k}.recovery_own"] = 0.5
        m[f"m4.{phase}.k{k}.recovery_random"] = 0.05
    return m


def knockin_rows() -> pd.DataFrame:
    """Global sets beat random on every note but n00 at P1 k=8 (recovery)."""
    rows = []
    for i, note in enumerate(NOTES[:6]):
        for phase in ("P1", "P2C"):
            for k in (3, 8, 16, 40):
                for s, val in (("global", 0.5 + 0.01 * k), ("random", 0.05), ("bottom", -0.1),
                               ("own", 0.45)):
                    rec = val if not (s == "global" and i == 0 and phase == "P1" and k == 8) \
                        else 0.0
                    rows.append({"note_id": note, "phase": phase, "k": k, "set": s,
                                 "necessity": val + 0.1, "recovery": rec, "n_events": 3,
                                 "n_gated": 2})
    return pd.DataFrame(rows)


def lambda_cells() -> pd.DataFrame:
    return pd.DataFrame({"lambda_p1": [0.01, 0.03, 0.1, 0.3], "lambda_p2": [0.01, 0.03, 0.1, 0.3],
                         "metric": [0.20, 0.24, 0.238, 0.19], "tie_break": [0.7, 0.8, 0.82, 0.6],
                         "state": ["done", "picked", "done", "done"]})


def stage_lambda_cells() -> pd.DataFrame:
    """Cells as the ``select_lambda`` stage writes them: metric and tie-break columns named after
    its lock (``decision.json`` says which), the pick in ``picked``."""
    return pd.DataFrame({"cell": ["a", "b", "c"], "lambda_p1": [0.03, 0.1, 0.3],
                         "lambda_p2": [0.03, 0.1, 0.3], "in_grid": True,
                         "state": ["complete", "complete", "failed"],
                         "micro_f1": [0.21, 0.215, None], "m1.P2C.p_pos": [0.7, 0.75, None],
                         "picked": [False, True, False]})


DECISION = {"lock": {"selection": {"metric": "micro_f1", "tie_break": "m1.P2C.p_pos"}}}


def build_run_set(uri: str, corpus: str, root: Path, *, kinds=("evaluate", "own_heads",
                                                                "knockin", "select_lambda")
                  ) -> dict[str, Any]:
    """The whole hand-built run set of one corpus; returns the run ids by kind."""
    ids: dict[str, Any] = {"evaluate": {}, "own_heads": {}}
    if "evaluate" in kinds:
        for (arm, seed) in EVAL_RUNS:
            model = TEACHER if arm == "teacher" else STUDENT
            ids["evaluate"][(arm, seed)] = make_run(
                uri, corpus, "evaluate", root, arm=arm, seed=seed, precision="bf16", model=model,
                metrics=eval_metrics(arm, seed),
                tables={"per_note_metrics": eval_notes(arm, seed)})
    if "own_heads" in kinds:
        for arm in ("vanilla-bf16", "mistill"):
            for seed in (0, 1):
                ids["own_heads"][(arm, seed)] = make_run(
                    uri, corpus, "own_heads", root, arm=arm, seed=seed, precision="bf16",
                    metrics=own_metrics(arm, seed),
                    tables={"own_heads_per_note": own_notes(arm, seed)})
    if "knockin" in kinds:
        ids["knockin"] = make_run(uri, corpus, "knockin", root, model=TEACHER,
                                  tables={"per_note_sets": knockin_rows()})
    if "select_lambda" in kinds:
        ids["select_lambda"] = make_run(uri, corpus, "select_lambda", root, arm="mistill",
                                        seed=0, tables={"cells": lambda_cells()})
        ids["select_lambda_stage"] = make_run(
            uri, corpus, "select_lambda", root, arm="randheads", seed=0,
            tables={"cells": stage_lambda_cells()}, jsons={"decision": DECISION})
    return ids
