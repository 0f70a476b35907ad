"""The report's Tables 11, 15, 39-42 and 47-51 on hand-built runs of the real test MLflow server,
against values known in advance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from analysis_fixtures import (
    ATTR_KINDS,
    ATTR_NOTES,
    CELL_DELTA,
    NOTES,
    OWN_DELTA,
    OWN_TRACE_DELTA,
    STABILITY,
    STUDENT,
    TEST_DELTA,
    attribution_arrays,
    build_extended_run_set,
    eval_notes,
)
from mlflow.tracking import MlflowClient
from stage_fixtures import unique

from mistill import stats
from mistill.stages.report import ReportConfig, run_report

pytestmark = pytest.mark.usefixtures("pinned_code_version")

BOOT, SEED = 200, 3


@pytest.fixture(scope="module")
def report(tracking_uri, tmp_path_factory):
    corpus = unique("tables")
    ids = build_extended_run_set(tracking_uri, corpus, tmp_path_factory.mktemp("writers"))
    mp = pytest.MonkeyPatch()
    mp.setenv("MISTILL_ROOT", str(tmp_path_factory.mktemp("reader")))
    try:
        run_id = run_report(ReportConfig(corpus=corpus, bootstrap=BOOT, corpus_bootstrap=BOOT,
                                         seed=SEED, importance_heads=2, profile_k=2,
                                         ce_steps=(2, 5)))
    finally:
        mp.undo()
    return run_id, ids, tmp_path_factory.mktemp("read")


def _file(run_id: str, path: str, dst: Path) -> Path:
    return Path(MlflowClient().download_artifacts(run_id, path, str(dst)))


def _csv(report, name: str) -> pd.DataFrame:
    run_id, _, dst = report
    return pd.read_csv(_file(run_id, f"tables/{name}.csv", dst))


def _text(report, path: str) -> str:
    run_id, _, dst = report
    return _file(run_id, path, dst).read_text()


def test_table11_intervals_are_the_bootstrap_over_notes(report):
    t11 = _csv(report, "table11_importance")
    # per note I_c = mean over the phase's events - mean over NULL events; then over notes
    per_note = {}
    for phase in ("P1", "P2", "P2C"):
        rows = []
        for i in range(len(ATTR_NOTES)):
            fo = attribution_arrays(i)["first_order"].astype(np.float64)
            kinds = np.array(ATTR_KINDS)
            rows.append(fo[kinds == phase].mean(0) - fo[kinds == "NULL"].mean(0))
        per_note[phase] = np.stack(rows)
    p1 = per_note["P1"].mean(0)
    top = int(np.argmax(p1))
    row = t11[t11["head"] == f"L{top // 2}H{top % 2}"].iloc[0]
    ci = stats.bootstrap_ci(per_note["P1"][:, top], np.mean, n_resamples=BOOT, seed=SEED)
    # float32 importances averaged in another order: agreement to ~1e-7 of values ~1
    assert (row["P1.I_c"], row["P1.ci_low"], row["P1.ci_high"]) == pytest.approx(
        tuple(ci), abs=1e-6)
    assert row["P1.ci_low"] < row["P1.I_c"] < row["P1.ci_high"] and row["P1.rank"] == 1
    # the heads listed: the top 2 of any phase; L2H0 leads P2C only -> contrastive-specific
    expected = {int(h) for p in per_note for h in np.argsort(-per_note[p].mean(0))[:2]}
    assert set(t11["head"]) == {f"L{h // 2}H{h % 2}" for h in expected}
    assert t11.loc[t11["head"] == "L2H0", "profile"].iloc[0] == "contrastive-specific"
    shown = _text(report, "tables/table11_importance_display.md")
    assert f"[{ci.low:.3f}, {ci.high:.3f}]" in shown and "1/6" in shown
    assert "\\begin{tabular}" in _text(report, "tables/table11_importance.tex")
    layers = _csv(report, "table11_layers")
    assert layers["n_heads"].sum() == 6 and layers["layers"].tolist() == ["0-0", "1-1", "2-2"]


def test_table15_reads_the_logged_stability(report):
    t15 = _csv(report, "table15_stability")
    assert t15["phase"].tolist() == ["P1"]
    assert t15["spearman"].iloc[0] == pytest.approx(STABILITY["stability/P1/spearman"])
    assert t15["top_overlap.8"].iloc[0] == 6 and t15["n_splits"].iloc[0] == 50
    assert "0.930" in _text(report, "tables/table15_stability.tex")


def test_tables_39_40_read_the_selection(report):
    t39 = _csv(report, "table39_selection")
    cells = t39[t39["lambda_p1"].notna()]
    assert sorted(cells["lambda_p1"]) == sorted(CELL_DELTA)
    assert cells.loc[cells["picked"], "lambda_p1"].tolist() == [0.1]
    assert cells.loc[cells["lambda_p1"] == 0.1, "valid_rate"].iloc[0] == pytest.approx(0.9)
    anchors = t39[t39["lambda_p1"].isna()]
    assert set(anchors["arm"]) == {"vanilla-bf16"} and len(anchors) == 2
    text = _text(report, "report.md")
    # the required decision fields and the optional newer one
    assert "best_outright -> lambda=0.1" in text and "extended_grid [lambda=0.01]" in text
    t40 = _csv(report, "table40_dose_response")
    for lam, delta in CELL_DELTA.items():
        rows = t40[t40["lambda_p1"] == lam]
        assert set(rows["phase"]) == {"P1", "P2", "P2C"}
        assert rows["mean_diff"].to_numpy() == pytest.approx([delta] * 3)
        # the note without P1 events is left out of every phase
        assert set(rows["n"]) == {len(NOTES) - 1}
        higher = rows["n_higher"].iloc[0]
        assert higher == (len(NOTES) - 1 if delta > 0 else 0)


def test_tables_41_42_confirmation_and_reselection(report):
    t41 = _csv(report, "table41_confirmation")
    assert set(t41["row"]) == {"mistill (selected)", "vanilla-bf16"}
    sel = t41[t41["row"] == "mistill (selected)"].iloc[0]
    assert sel["n_seeds"] == 2 and sel["seeds"] == "0,1"
    pairs = _csv(report, "table41_paired")
    task = pairs[pairs["measure"] == "task micro-F1"].iloc[0]
    assert task["n_pairs"] == 2 and task["mean_diff"] == pytest.approx(CELL_DELTA[0.1])
    t42 = _csv(report, "table42_reselection")
    pick = t42[t42["lambda_p1"] == 0.1].iloc[0]
    # one seed (the reference's seed 0 + 0.02 per note) paired with both reference seeds
    r0, r1 = eval_notes("vanilla-bf16", 0)["micro_f1"], eval_notes("vanilla-bf16", 1)["micro_f1"]
    assert pick["task.mean_diff"] == pytest.approx(float((r0 + 0.02 - (r0 + r1) / 2).mean()))
    assert "no own_heads run of the cell's train run" in pick["note"]
    other = t42[t42["lambda_p1"] == 0.3].iloc[0]
    assert "no test evaluation of the cell's train run" in other["note"]


def test_tables_47_48_precision_control(report):
    t47 = _csv(report, "table47_precision")
    m = t47[t47["arm"] == "mistill"].iloc[0]
    assert m["model"] == STUDENT and m["n_seeds"] == 2
    assert m["vs vanilla-bf16.mean_diff"] == pytest.approx(TEST_DELTA)
    assert (m["vs vanilla-bf16.ci_low"], m["vs vanilla-bf16.ci_high"]) == pytest.approx(
        (TEST_DELTA, TEST_DELTA))
    fp32 = t47[t47["arm"] == "mistill-fp32"].iloc[0]
    assert fp32["note"] == "no train runs of arm mistill-fp32 under this experiment"
    t48 = _csv(report, "table48_training_ce")
    v = t48[(t48["arm"] == "vanilla-bf16") & (t48["seed"] == 1)].iloc[0]
    assert (v["step 2"], v["step 5"], v["last"], v["last_step"]) == (1.4, 0.8, 0.7, 6)
    # the selection cells' train runs are not the arm's
    assert len(t48[t48["arm"] == "mistill"]) == 2


def test_table49_own_traces(report):
    t49 = _csv(report, "table49_own_traces")
    m = t49[(t49["arm"] == "mistill") & (t49["seed"] == 0)].iloc[0]
    assert m["coverage"] == len(NOTES) - 1
    # own traces: the reference's cell + 0.03; teacher-forced: the reference's + OWN_DELTA[0]
    assert m["k40.own"] - m["k40.teacher"] == pytest.approx(OWN_TRACE_DELTA - OWN_DELTA[0])
    pairs = _csv(report, "table49_paired")
    clustered = pairs[(pairs["seeds"] == "note-clustered") & (pairs["k"] == 40)
                      & (pairs["comparison"] == "mistill - vanilla-bf16")].iloc[0]
    # on own traces mistill is the reference + 0.03 on every note with events, every seed
    assert clustered["n"] == len(NOTES) - 1 and clustered["n_pairs"] == 2
    assert clustered["mean_diff"] == pytest.approx(OWN_TRACE_DELTA)
    assert clustered["n_higher"] == len(NOTES) - 1


def test_tables_50_51_ablations(report):
    t51 = _csv(report, "table51_ablations")
    top8 = t51[t51["arm"] == "top8"].iloc[0]
    # the top8 evaluation named its checkpoint (run:<id>): read as the student it trained
    assert top8["model"] == STUDENT and top8["P2C.own"] == pytest.approx(0.6)
    # top8's P2C k=40 rows equal vanilla-bf16 seed 0's; mistill seed s is above by OWN_DELTA[s]
    assert top8["vs mistill seed 0.median_diff"] == pytest.approx(-0.05)
    assert top8["vs mistill seed 1.median_diff"] == pytest.approx(-0.01 - 0.02)
    ref = eval_notes("vanilla-bf16", 0)["micro_f1"]
    mistill = (ref + eval_notes("vanilla-bf16", 1)["micro_f1"]) / 2 + TEST_DELTA
    assert top8["f1.mean_diff"] == pytest.approx(float((ref + 0.05 - mistill).mean()))
    notes = dict(zip(t51["arm"], t51["note"].fillna("")))
    assert notes["randpos"] == "no train runs of arm randpos under this experiment"
    assert notes["randheads"] == "no own_heads or evaluate runs of arm randheads"
    t50 = _csv(report, "table50_ablation_plan")
    row = t50[t50["arm"] == "top8"].iloc[0]
    assert row["base"] == "mistill" and row["changes"] == "pool_k: 40 -> 8"
    assert row["P2C vs mistill"] == "lower"
    shown = _text(report, "tables/table51_ablations_display.md")
    assert "no train runs of arm randpos under this experiment" in shown
    assert "randpos" in _text(report, "tables/table51_ablations.tex")


def test_tables_3_45_read_teacher_forced_rows_only(report):
    seeds = _csv(report, "table45_own_heads_seeds")
    m = seeds[(seeds["arm"] == "mistill") & (seeds["seed"] == 0)].iloc[0]
    # own-trace rows (+0.03 over 11 notes) would move the median over notes
    from analysis_fixtures import own_notes
    cell = own_notes("mistill", 0)
    cell = cell[(cell["phase"] == "P2C") & (cell["k"] == 40)]
    assert m["P2C.k40.own"] == pytest.approx(cell["recovery_own"].median())


def test_a_picked_cell_is_the_arm_unless_the_arm_was_retrained():
    """The pipeline's Mistill train step reuses the selection's picked cell: that run is the arm
    (its readouts fill the arm tables); unpicked cells never are; a picked cell gives way to a
    train run of the same arm, seed and precision that is no cell."""
    from analysis.report import cell_train_runs

    cells = pd.DataFrame({"train_run": ["c003", "c01", "c001"], "picked": [False, False, True]})
    train = pd.DataFrame({"run_id": ["c003", "c01", "c001", "v0"],
                          "arm": ["mistill", "mistill", "mistill", "vanilla-bf16"],
                          "seed": [0, 0, 0, 0], "precision": ["bf16"] * 4})
    assert cell_train_runs(cells, train) == {"c003", "c01"}
    retrained = pd.concat([train, pd.DataFrame({"run_id": ["full"], "arm": ["mistill"], "seed": [0],
                                                "precision": ["bf16"]})], ignore_index=True)
    assert cell_train_runs(cells, retrained) == {"c003", "c01", "c001"}
    # another seed of the arm does not displace the pick
    other_seed = retrained.assign(seed=[0, 0, 0, 0, 1])
    assert cell_train_runs(cells, other_seed) == {"c003", "c01"}
    # a cell picked by one selection and not by another stays the pick's
    both = pd.concat([cells, pd.DataFrame({"train_run": ["c001"], "picked": [False]})], ignore_index=True)
    assert cell_train_runs(both, train) == {"c003", "c01"}


def test_report_run_says_how_to_read_numbers_of_this_size(report):
    """The report run's ``report.md`` carries "Reading these numbers at this size": the task
    table rests on the fixture's 12 test notes (its train runs log no step count)."""
    text = _text(report, "report.md")
    start = text.index("## Reading these numbers at this size")
    section = text[start:text.index("\n## ", start + 1)]
    assert f"These runs are small: scored on {len(NOTES)} test notes." in section
    assert "**Meaningful at this size:** teacher-forced M1" in section
    assert "**Not meaningful at this size:** task micro-F1" in section
