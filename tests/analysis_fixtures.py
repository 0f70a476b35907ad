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
             jsons: dict[str, Any] | None = None, tags: dict[str, str] | None = None,
             cfg: Config | None = None, inputs: dict[str, str] | None = None,
             notes: dict[str, dict[str, Any]] | None = None,
             history: dict[str, dict[int, float]] | None = None) -> str:
    """One FINISHED run of ``stage`` with these tags, metrics, CSV and JSON artifacts.

    cfg: the run's config (default a :class:`FakeStageConfig`); inputs: lineage
    (``mistill.input.<name>``); notes: per-note files under ``notes/<note_id>/``; history:
    metric -> ``{step: value}``."""
    cfg = cfg or FakeStageConfig(arm=arm or "", seed=seed or 0, tag=f"{stage}-{arm}-{seed}-{model}")
    with StageRun(stage, cfg, corpus=corpus, guard=PrivacyGuard([], "synthetic"), model=model,
                  arm=arm, seed=seed, precision=precision, root=root, code_version="test",
                  tracking_uri=uri, tags=tags, inputs=inputs) as run:
        for note_id, files in (notes or {}).items():
            run.write_note("notes", note_id, files)
        for key, values in (history or {}).items():
            for step, value in sorted(values.items()):
                run.log_metrics({key: value}, step=step)
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
              "mean_generated_tokens": 100.0 + seed, "fidelity/ppl_median": 1.6,
              "fidelity/bleu4_mean": 0.2, "fidelity/las_mean": 0.1,
              "m1/P1/p_pos": 0.8, "m1/P2/p_pos": 0.7, "m1/P2C/p_pos": 0.6 + 0.01 * seed})
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
    m: dict[str, float] = {"m2/region_lift": 2.0 + seed, "m3/near_miss_share": 0.05,
                           "prefix_share": 0.3}
    for phase, k in phase_k:
        m[f"m4/{phase}/k{k}/recovery_own"] = 0.5
        m[f"m4/{phase}/k{k}/recovery_random"] = 0.05
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
                         "micro_f1": [0.21, 0.215, None], "m1/P2C/p_pos": [0.7, 0.75, None],
                         "picked": [False, True, False]})


DECISION = {"lock": {"selection": {"metric": "micro_f1", "tie_break": "m1/P2C/p_pos"}}}


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


# ------------------------------------------------------------- the extended run set
ATTR_NOTES = [f"a{i}" for i in range(8)]
ATTR_KINDS = ["P1", "P1", "P2", "P2C", "NULL", "NULL"]
ATTR_GEOMETRY = {"n_layers": 3, "n_heads": 2}
ATTR_HEAD_OFFSETS = {"P1": [0.9, 0.1, 0.5, 0.0, -0.3, 0.2], "P2": [0.1, 0.8, 0.0, 0.6, 0.2, 0.0],
                     "P2C": [0.0, 0.2, 0.1, 0.0, 0.9, 0.7], "NULL": [0.05] * 6}
"""Per phase, each head's mean importance at the events of the phase (heads L0H0 ... L2H1)."""
STABILITY = {"stability/P1/spearman": 0.93, "stability/P1/top_overlap/8": 6.0,
             "stability/P1/top_overlap/40": 6.0, "stability/P1/full_overlap": 6.0,
             "stability/P1/n_splits": 50.0, "stability/P1/n_patients": 8.0,
             "stability/P1/n_notes": 8.0}


def attribution_arrays(note_index: int) -> dict[str, np.ndarray]:
    """One note's ``attribution.npz``: first-order importances around the heads' phase means
    (a note-specific draw), no exact patches."""
    rng = np.random.default_rng(500 + note_index)
    fo = np.stack([np.asarray(ATTR_HEAD_OFFSETS[k]) + rng.normal(0, 0.1, 6)
                   for k in ATTR_KINDS]).astype(np.float32)
    n = len(ATTR_KINDS)
    return {"event_ids": np.array([f"e{i}" for i in range(n)]), "kinds": np.array(ATTR_KINDS),
            "positions": np.arange(n), "margins": np.ones(n, dtype=np.float32),
            "first_order": fo, "exact": np.full_like(fo, np.nan)}


def attribute_head_sets() -> dict:
    from mistill.instrument.calibration import NoteImportance, calibrate, head_sets_json

    notes = [NoteImportance(note_id=n, patient_id=n, kinds=np.array(ATTR_KINDS),
                            importance=attribution_arrays(i)["first_order"])
             for i, n in enumerate(ATTR_NOTES)]
    names = [f"L{h // 2}H{h % 2}" for h in range(6)]
    sets = head_sets_json(calibrate(notes, q=0.1), names, ks=(2, 4), pool_k=4)
    sets["meta"]["geometry"] = dict(ATTR_GEOMETRY)
    return sets


def val_notes(arm: str, seed: int, delta: float = 0.0) -> pd.DataFrame:
    """Validation per-note metrics with per-phase M1: the reference's M1 fixed per note, an arm
    at ``delta`` above it; note n00 has no P1 events (left out of Table 40)."""
    base = np.linspace(0.4, 0.7, len(NOTES))
    df = eval_notes("vanilla-bf16", seed).assign(micro_f1=base + delta)
    for phase in ("P1", "P2", "P2C"):
        df[f"m1_{phase}_p_pos"] = base + delta
        df[f"m1_{phase}_n"] = [0 if (phase == "P1" and i == 0) else 5 for i in range(len(NOTES))]
    return df


CELL_DELTA = {0.03: 0.02, 0.1: 0.04, 0.3: -0.01}
"""Each cell's validation M1 and micro-F1 above the reference's, per note."""
TEST_DELTA = 0.1
"""mistill's test micro-F1 and own-trace recovery above vanilla-bf16's on every note."""
OWN_TRACE_DELTA = 0.03
CE = {"mistill": {1: 2.0, 2: 1.5, 5: 1.0, 6: 0.9}, "vanilla-bf16": {1: 2.0, 2: 1.4, 5: 0.8, 6: 0.7}}


def own_notes_both(arm: str, seed: int, delta: float) -> pd.DataFrame:
    """Teacher-forced and own-trace rows: own traces at ``delta`` above the teacher-forced
    recovery on every note but n11 (no own-trace events)."""
    teacher = own_notes(arm, seed).assign(traces="teacher")
    own = own_notes("vanilla-bf16", seed).assign(traces="own")
    own["recovery_own"] = own["recovery_own"] + delta
    own = own[own["note_id"] != NOTES[-1]]
    return pd.concat([teacher, own], ignore_index=True)


def train_arm(arm: str, **flags: Any) -> dict:
    from mistill.distill.arms import resolve_arm

    return {**resolve_arm(arm).to_dict(), **flags}


def build_extended_run_set(uri: str, corpus: str, root: Path) -> dict[str, Any]:
    """Runs for Tables 11, 15, 39-42 and 47-51: the characterization's attribute run (per-note
    attributions, stability metrics) named by a knockin run; train runs of mistill,
    vanilla-bf16 (seeds 0, 1), top8 and randheads; their test evaluations and own-heads
    readouts (own traces included); a λ selection with cell runs, validation evaluations and a
    second seed at the pick."""
    from mistill.io import npz_bytes
    from mistill.stages.characterize import AttributeConfig

    ids: dict[str, Any] = {"train": {}, "evaluate": {}, "own_heads": {}}
    notes = {n: {"attribution.npz": npz_bytes(attribution_arrays(i))}
             for i, n in enumerate(ATTR_NOTES)}
    ids["attribute"] = make_run(uri, corpus, "attribute", root, model=TEACHER,
                                cfg=AttributeConfig(fdr_q=0.1, stability_splits=50),
                                notes=notes, metrics=STABILITY,
                                jsons={"head_sets": attribute_head_sets()})
    ids["knockin"] = make_run(uri, corpus, "knockin", root, model=TEACHER,
                              inputs={"attribute": ids["attribute"]},
                              tables={"per_note_sets": knockin_rows()})
    for arm, seeds in (("mistill", (0, 1)), ("vanilla-bf16", (0, 1)), ("top8", (0,)),
                       ("randheads", (0,))):
        for seed in seeds:
            ids["train"][(arm, seed)] = make_run(
                uri, corpus, "train", root, arm=arm, seed=seed, precision="bf16",
                jsons={"arm": train_arm(arm)}, history={"train/ce": CE.get(arm, {1: 1.0})})
    f1_delta = {"mistill": TEST_DELTA, "vanilla-bf16": 0.0, "top8": 0.05, "untrained": -0.2}
    own_delta = {"mistill": OWN_TRACE_DELTA, "vanilla-bf16": 0.0, "top8": 0.0, "untrained": 0.0}
    for arm, seeds in (("mistill", (0, 1)), ("vanilla-bf16", (0, 1)), ("top8", (0,)),
                       ("untrained", (0,))):
        for seed in seeds:
            train = ids["train"].get((arm, seed))
            link = {"train": train} if train else None
            # the top8 evaluation names its checkpoint, as the evaluate stage does
            model = f"run:{train}" if arm == "top8" else STUDENT
            per_note = eval_notes("vanilla-bf16", seed)
            per_note["micro_f1"] = per_note["micro_f1"] + f1_delta[arm]
            ids["evaluate"][(arm, seed)] = make_run(
                uri, corpus, "evaluate", root, arm=arm, seed=seed, precision="bf16", model=model,
                inputs=link, metrics={**eval_metrics("mistill", 0),
                                      "micro_f1": float(per_note["micro_f1"].mean())},
                tables={"per_note_metrics": per_note}, tags={"mistill.split": "test"})
            own_m = own_metrics(arm, seed)
            own_m["m4/P2C/k40/recovery_own"] = 0.6 + (0.1 if arm == "mistill" else 0.0)
            own_m["m4/P2/k40/recovery_own"], own_m["m4/P2/k40/recovery_random"] = 0.55, 0.04
            ids["own_heads"][(arm, seed)] = make_run(
                uri, corpus, "own_heads", root, arm=arm, seed=seed, precision="bf16",
                inputs=link, metrics=own_m, tags={"mistill.split": "test"},
                tables={"own_heads_per_note": own_notes_both(
                    "mistill" if arm == "mistill" else "vanilla-bf16", seed, own_delta[arm])})
    ids.update(_selection_runs(uri, corpus, root))
    return ids


DECISION_RECORD = {
    "lock": {"arm": "mistill", "training": {"seed": 0},
             "selection": {"metric": "micro_f1", "split": "val", "tie_band": 0.004,
                           "tie_break": "m1/P2C/p_pos"}},
    "decision": {"rule": "best_outright", "pick": "lambda=0.1", "pick_lambda_p1": 0.1,
                 "pick_lambda_p2": 0.1, "band": 0.004, "tied": ["lambda=0.1"],
                 "gaps_to_best": {"lambda=0.03": 0.02, "lambda=0.1": 0.0, "lambda=0.3": 0.05},
                 "extensions": [], "extended_grid": ["lambda=0.01"]}}
"""``decision.json`` with the required fields and one newer optional field."""


def _selection_runs(uri: str, corpus: str, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"cells": {}}
    ref_val = {}
    for seed in (0, 1):
        ref_val[seed] = make_run(uri, corpus, "evaluate", root, arm="vanilla-bf16", seed=seed,
                                 precision="bf16", metrics={"micro_f1": 0.5},
                                 tables={"per_note_metrics": val_notes("vanilla-bf16", seed)},
                                 tags={"mistill.split": "val"})
    out["val_reference"] = ref_val
    rows = []
    for lam, delta in CELL_DELTA.items():
        train = make_run(uri, corpus, "train", root, arm="mistill", seed=0, precision="bf16",
                         jsons={"arm": train_arm("mistill", lambda_p1=lam, lambda_p2=lam)},
                         cfg=FakeStageConfig(arm="mistill", tag=f"cell-{lam}"))
        ev = make_run(uri, corpus, "evaluate", root, arm="mistill", seed=0, precision="bf16",
                      inputs={"train": train}, metrics={"micro_f1": 0.5 + delta,
                                                        "m1/P2C/p_pos": 0.5 + delta,
                                                        "valid_rate": 0.9},
                      tables={"per_note_metrics": val_notes("mistill", 0, delta)},
                      tags={"mistill.split": "val"})
        out["cells"][lam] = {"train": train, "evaluate": ev}
        rows.append({"cell": f"lambda={lam!r}", "lambda_p1": lam, "lambda_p2": lam,
                     "in_grid": True, "state": "complete", "micro_f1": 0.5 + delta,
                     "m1/P2C/p_pos": 0.5 + delta, "gap_to_best": repr(0.04 - delta),
                     "in_band": lam == 0.1, "picked": lam == 0.1, "train_run": train,
                     "evaluate_run": ev})
    # a second seed at the pick, evaluated on the validation notes (Table 41)
    train1 = make_run(uri, corpus, "train", root, arm="mistill", seed=1, precision="bf16",
                      jsons={"arm": train_arm("mistill")},
                      cfg=FakeStageConfig(arm="mistill", seed=1, tag="confirm"))
    out["confirm_val"] = make_run(uri, corpus, "evaluate", root, arm="mistill", seed=1,
                                  precision="bf16", inputs={"train": train1},
                                  metrics={"micro_f1": 0.54},
                                  tables={"per_note_metrics": val_notes("mistill", 1, 0.04)},
                                  tags={"mistill.split": "val"})
    # the picked cell's train run on the test notes
    pick_train = out["cells"][0.1]["train"]
    per_note = eval_notes("vanilla-bf16", 0)
    per_note["micro_f1"] = per_note["micro_f1"] + 0.02
    out["cell_test"] = make_run(uri, corpus, "evaluate", root, arm="mistill", seed=0,
                                precision="bf16", inputs={"train": pick_train},
                                metrics={"micro_f1": float(per_note["micro_f1"].mean())},
                                tables={"per_note_metrics": per_note},
                                tags={"mistill.split": "test"})
    out["select_lambda"] = make_run(uri, corpus, "select_lambda", root, arm="mistill", seed=0,
                                    precision="bf16", tables={"cells": pd.DataFrame(rows)},
                                    jsons={"decision": DECISION_RECORD})
    return out


def report_in(corpus: str, tmp_path_factory, **settings: Any) -> str:
    """A ``report`` run of ``corpus`` (``ReportConfig`` fields in ``settings``), its local files
    under a fresh ``MISTILL_ROOT``: the run id."""
    import pytest

    from mistill.stages.report import ReportConfig, run_report

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MISTILL_ROOT", str(tmp_path_factory.mktemp("reader")))
        return run_report(ReportConfig(corpus=corpus, **settings))
