"""The audit of contrastive events (App. C, Table 5, R-C9): the strata, the allocation and the
seeded draw, the blinded sheet kept local, and the label shares of the report."""

from __future__ import annotations

import csv

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from scipy import stats as sps

from mistill.evaluation import audit_frame as af
from mistill.stages.audit_frame import AuditFrameConfig, run_audit_frame
from mistill.stages.characterize import EventsConfig, run_events
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.stages.report import ReportConfig, run_report
from stage_fixtures import TINY, artifact_paths, unique


def test_eight_strata_and_an_even_allocation():
    assert len(set(af.STRATA)) == 8
    assert af.stratum_of(True, True, True) == "aligned/gold/in_answer"
    assert af.stratum_of(False, False, False) == "unaligned/not_gold/not_in_answer"
    pops = dict(zip(af.STRATA, [1, 10, 0, 3, 10, 10, 10, 10], strict=True))
    alloc = af.allocate(pops, 20)
    assert sum(alloc.values()) == 20 and alloc[af.STRATA[0]] == 1 and alloc[af.STRATA[2]] == 0
    assert alloc[af.STRATA[3]] == 3 and max(alloc.values()) - min(v for s, v in alloc.items() if pops[s] > 3) <= 1
    assert sum(af.allocate(pops, 1000).values()) == sum(pops.values())  # never more than there are


def _frame(n_per: list[int]) -> pd.DataFrame:
    rows = []
    for s, n in zip(af.STRATA, n_per, strict=True):
        rows += [{"note_id": f"n{i % 3}", "event_id": f"{s}:{i}", "code": "A01.1", "near_miss": "A01.2",
                  "aligned": True, "gold": True, "in_answer": True, "stratum": s} for i in range(n)]
    return pd.DataFrame(rows, columns=list(af.FRAME_COLUMNS))


def test_the_draw_is_seeded_stratified_and_the_sheet_order_hides_the_strata():
    frame = _frame([5, 5, 5, 5, 1, 0, 5, 5])
    a, b, c = af.draw(frame, 12, seed=3), af.draw(frame, 12, seed=3), af.draw(frame, 12, seed=4)
    pd.testing.assert_frame_equal(a, b)
    assert not a["event_id"].tolist() == c["event_id"].tolist() or not a["sheet_order"].equals(c["sheet_order"])
    assert a["stratum"].value_counts().to_dict() == {s: n for s, n in af.allocate(
        frame["stratum"].value_counts().to_dict(), 12).items() if n}
    assert sorted(a["sheet_order"]) == list(range(1, 13)) and not a["event_id"].duplicated().any()
    text = "abcdefghijklmnopqrstuvwxyz"
    assert af.marked_context(text, (5, 7), 2) == "de[fg]hi"


def test_label_shares_raw_with_exact_intervals_and_population_weighted():
    s0, s1 = af.STRATA[0], af.STRATA[1]
    labelled = pd.DataFrame({"stratum": [s0] * 4 + [s1] * 2,
                             "label": ["verified_rejection"] * 3 + ["enumeration"] + ["enumeration"] * 2})
    shares = af.label_shares(labelled, {s0: 10, s1: 30}).set_index("label")
    rej = shares.loc["verified_rejection"]
    ci = sps.binomtest(3, 6).proportion_ci(method="exact")
    assert (rej["n"], rej["share"]) == (3, 0.5) and (rej["ci_low"], rej["ci_high"]) == pytest.approx((ci.low, ci.high))
    assert rej["weighted_share"] == pytest.approx(10 / 40 * 3 / 4 + 30 / 40 * 0.0)
    assert shares["weighted_share"].sum() == pytest.approx(1.0) and shares["share"].sum() == pytest.approx(1.0)


pytestmark = pytest.mark.usefixtures("pinned_code_version")


def test_audit_frame_and_table_5_on_a_synthetic_corpus(tracking_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    name = unique("audit")
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=4, model=TINY))
    teacher = run_events(EventsConfig(prepare_run=prep, model=TINY, n_null=2))
    student = run_events(EventsConfig(prepare_run=prep, model="tiny:qwen3:seed=2", n_null=2))
    run_id = run_audit_frame(AuditFrameConfig(events_run=teacher, align_events_runs=(student,), n=6, seed=1,
                                              context_chars=40))
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and "audit_frame.csv" in artifact_paths(client, run_id)
    work = tmp_path / "root" / "work" / run_id
    frame = pd.read_csv(next(work.rglob("audit_frame.csv")), dtype={"note_id": str, "event_id": str})
    m = run.data.metrics
    assert m["audit/n_population"] == len(frame) > 0 and m["audit/n_drawn"] == min(6, len(frame))
    assert frame["aligned"].all()  # one tokenizer: every event realized by both
    for s in af.STRATA:
        assert m[f"audit/population/{s}"] == (frame["stratum"] == s).sum()
    # the sheet: local only, blinded, with the trace around both places
    sheet_path = run.data.tags["mistill.audit_frame.sheet"]
    sheet = pd.read_csv(sheet_path, dtype={"note_id": str, "event_id": str}, keep_default_na=False)
    assert list(sheet.columns) == list(af.SHEET_COLUMNS) and "stratum" not in sheet.columns
    assert list(sheet["sheet_order"]) == list(range(1, len(sheet) + 1)) and (sheet["label"] == "").all()
    assert sheet["earlier_mention"].str.contains(r"\[").all() and sheet["decision"].str.contains(r"\[").all()
    stored = "".join(p.read_text(errors="ignore") for p in (tmp_path / "root").rglob("*.csv") if p != sheet_path
                     and "enclave" not in p.parts)
    assert not any(ctx in stored for ctx in sheet["earlier_mention"])
    # the reader's labels -> Table 5
    labels = tmp_path / "labels.csv"
    with labels.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["note_id", "event_id", "label"])
        for i, r in sheet.iterrows():
            w.writerow([r["note_id"], r["event_id"], "verified_rejection" if i % 2 else "enumeration"])
    report = run_report(ReportConfig(corpus=name, bootstrap=20, corpus_bootstrap=20, audit_labels=str(labels)))
    t5 = pd.read_csv(client.download_artifacts(report, "tables/table5_audit_labels.csv", str(tmp_path / "r")))
    joined = pd.read_csv(labels, dtype=str).merge(frame[["note_id", "event_id", "stratum"]], on=["note_id", "event_id"])
    want = af.label_shares(joined, frame["stratum"].value_counts().to_dict()).set_index("label")
    got = t5.set_index("label")
    assert set(got.index) == set(want.index) and (got["frame_run"] == run_id).all()
    for label in want.index:
        assert got.loc[label, "n"] == want.loc[label, "n"]
        assert got.loc[label, "weighted_share"] == pytest.approx(want.loc[label, "weighted_share"])
        assert got.loc[label, "ci_low"] == pytest.approx(want.loc[label, "ci_low"])
    assert np.isclose(got["share"].sum(), 1.0)
