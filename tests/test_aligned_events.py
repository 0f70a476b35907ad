"""Own-heads gains on the events every student's tokenizer realizes (Table 38's check, R-D19): the
pure table on hand-made event rows with known gains, then the report's ``own_heads_aligned`` table
built from hand-built runs of two student models on the real test MLflow server."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from analysis_fixtures import make_run, own_notes, report_in
from mlflow.tracking import MlflowClient
from stage_fixtures import unique

from analysis.aligned_events import aligned_event_ids, aligned_gain_table, note_recovery

pytestmark = pytest.mark.usefixtures("pinned_code_version")

NOTES = [f"n{i}" for i in range(5)]
EVENTS = ("P2C:0", "P2C:1", "P2C:2", "P2C:3")
GAIN = {"student-a": {"P2C:0": 0.1, "P2C:1": 0.1, "P2C:2": 0.3, "P2C:3": 0.3},  # all 0.2, aligned 0.1
        "student-b": {"P2C:0": 0.15, "P2C:1": 0.15}}  # realizes two events only: 0.15 both ways
REALIZED = {"student-a": EVENTS, "student-b": EVENTS[:2], "teacher-m": EVENTS}


def _events(model: str, arm: str, seed: int) -> pd.DataFrame:
    rows = []
    for i, note in enumerate(NOTES):
        for j, ev in enumerate(REALIZED[model]):
            base = 0.2 + 0.05 * i + 0.01 * j + 0.02 * seed
            rec = base + (GAIN[model][ev] if arm == "mistill" else 0.0)
            for k in (8, 40):
                rows.append({"note_id": note, "traces": "teacher", "event_id": f"{note}:{ev}", "phase": "P2C",
                             "k": k, "recovery": rec, "gated": True})
        # an ungated event every model realizes: never read
        rows.append({"note_id": note, "traces": "teacher", "event_id": f"{note}:P2C:9", "phase": "P2C", "k": 40,
                     "recovery": float("nan"), "gated": False})
    return pd.DataFrame(rows)


def _all_events() -> pd.DataFrame:
    frames = []
    for model in ("student-a", "student-b"):
        for arm in ("vanilla-bf16", "mistill"):
            for seed in (0, 1):
                frames.append(_events(model, arm, seed).assign(model=model, arm=arm, seed=seed))
    frames.append(_events("teacher-m", "teacher", 0).assign(model="teacher-m", arm="teacher", seed=0))
    return pd.concat(frames, ignore_index=True)


def test_aligned_set_and_per_note_recovery():
    events = _all_events()
    keep = aligned_event_ids(events)
    assert keep == {f"{n}:{ev}" for n in NOTES for ev in EVENTS[:2]} | {f"{n}:P2C:9" for n in NOTES}
    one = _events("student-a", "vanilla-bf16", 0)
    rec = note_recovery(one, "P2C", 40)
    assert rec["n0"] == pytest.approx(0.2 + (0 + 0.01 + 0.02 + 0.03) / 4)
    assert note_recovery(one, "P2C", 40, keep)["n0"] == pytest.approx(0.2 + 0.01 / 2)


def test_gains_on_every_and_on_the_aligned_events():
    table = aligned_gain_table(_all_events(), "vanilla-bf16", n_resamples=50, seed=0).set_index("model")
    assert list(table["arm"]) == ["mistill", "mistill"]
    a, b = table.loc["student-a"], table.loc["student-b"]
    # per note: four realized events and the ungated one (student-a), two and the ungated one (student-b)
    assert (a["n_events"], a["n_aligned"], b["n_events"], b["n_aligned"]) == (25, 15, 15, 15)
    assert a["all.gain"] == pytest.approx(0.2) and a["aligned.gain"] == pytest.approx(0.1)
    assert b["all.gain"] == pytest.approx(0.15) and b["aligned.gain"] == pytest.approx(0.15)
    assert (a["aligned.n_notes"], a["aligned.higher"], a["aligned.lower"]) == (len(NOTES), len(NOTES), 0)


def test_report_table_from_runs(tracking_uri, tmp_path_factory):
    corpus = unique("aligned")
    root = tmp_path_factory.mktemp("writers")
    for model in ("student-a", "student-b"):
        for arm in ("vanilla-bf16", "mistill"):
            for seed in (0, 1):
                make_run(tracking_uri, corpus, "own_heads", root, arm=arm, seed=seed, precision="bf16", model=model,
                         tables={"own_heads_per_note": own_notes(arm, seed),
                                 "own_heads_knockin_events": _events(model, arm, seed)})
    run_id = report_in(corpus, tmp_path_factory, bootstrap=50, corpus_bootstrap=50, seed=0,
                       reference_arm="vanilla-bf16")
    dst = tmp_path_factory.mktemp("read")
    table = pd.read_csv(Path(MlflowClient().download_artifacts(run_id, "tables/own_heads_aligned.csv", str(dst))))
    table = table.set_index("model")
    assert table.loc["student-a", "all.gain"] == pytest.approx(0.2)
    assert table.loc["student-a", "aligned.gain"] == pytest.approx(0.1)
    assert table.loc["student-b", "aligned.gain"] == pytest.approx(0.15)
