"""The analysis package and the ``report`` entry point: statistics against scipy and hand
values, and a report over hand-built runs on the real test MLflow server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from analysis_fixtures import (
    NOTES,
    OWN_DELTA,
    STUDENT,
    build_run_set,
    eval_notes,
    make_run,
    own_notes,
)
from mlflow.tracking import MlflowClient
from scipy import stats as sps
from stage_fixtures import unique

from analysis import paired, query, tables
from analysis.report import build_report, collect_inputs
from mistill import stats
from mistill.errors import MistillInputError
from mistill.evaluation.metrics import micro_prf
from mistill.stages.report import ReportConfig, run_report

pytestmark = pytest.mark.usefixtures("pinned_code_version")


# ------------------------------------------------------------------------------ statistics
def test_counts_corpus_difference_equals_the_set_version():
    rng = np.random.default_rng(3)
    labels = list("ABCDEFG")
    gold = [list(rng.choice(labels, 3, replace=False)) for _ in range(25)]
    pa = [list(rng.choice(labels, 2, replace=False)) for _ in range(25)]
    pb = [list(rng.choice(labels, 3, replace=False)) for _ in range(25)]
    by_sets = stats.corpus_micro_f1_difference(gold, pa, pb, n_resamples=400, seed=2)
    ca = [(len(set(p) & set(g)), len(set(p) - set(g)), len(set(g) - set(p)))
          for g, p in zip(gold, pa)]
    cb = [(len(set(p) & set(g)), len(set(p) - set(g)), len(set(g) - set(p)))
          for g, p in zip(gold, pb)]
    by_counts = stats.corpus_micro_f1_difference_from_counts(ca, cb, n_resamples=400, seed=2)
    assert by_counts == by_sets
    assert by_counts.difference == pytest.approx(micro_prf(gold, pa)[2] - micro_prf(gold, pb)[2])

def test_counts_corpus_difference_averages_seeds():
    # arm: seed 0 perfect on both notes (F1 1), seed 1 tp 1 fp 2 per note (F1 1/2) -> 0.75
    # reference: one seed with tp 1 fn 1 per note (F1 2/3); difference 0.75 - 2/3
    a = [[(1, 0, 0), (1, 0, 0)], [(1, 2, 0), (1, 2, 0)]]
    b = [(1, 0, 1), (1, 0, 1)]
    r = stats.corpus_micro_f1_difference_from_counts(a, b, n_resamples=50)
    assert r.micro_f1_a == pytest.approx(0.75) and r.micro_f1_b == pytest.approx(2 / 3)
    # every resample holds identical notes: the interval is the point
    assert (r.ci_low, r.ci_high) == pytest.approx((0.75 - 2 / 3, 0.75 - 2 / 3))
    with pytest.raises(MistillInputError):
        stats.corpus_micro_f1_difference_from_counts(a, [(1, 0, 1)] * 3)
    with pytest.raises(MistillInputError):
        stats.corpus_micro_f1_difference_from_counts([(1, -1, 0)], [(1, 0, 0)])


def _frame(values_by_seed: dict[int, list[float]], notes=None) -> pd.DataFrame:
    notes = notes or [f"n{i:02d}" for i in range(len(next(iter(values_by_seed.values()))))]
    return pd.DataFrame([{"seed": s, "note_id": n, "v": v} for s, vals in values_by_seed.items()
                         for n, v in zip(notes, vals)])


def test_seed_averaged_matches_scipy_and_a_hand_bootstrap():
    rng = np.random.default_rng(11)
    a = {0: rng.normal(0.3, 0.1, 40).tolist(), 1: rng.normal(0.35, 0.1, 40).tolist()}
    b = {0: rng.normal(0.3, 0.1, 40).tolist()}
    res = paired.seed_averaged(_frame(a), _frame(b), "v", n_resamples=500, seed=4)
    d = (np.array(a[0]) + np.array(a[1])) / 2 - np.array(b[0])
    assert res.n == 40 and res.mean_diff == pytest.approx(d.mean())
    assert res.wilcoxon_p == pytest.approx(sps.wilcoxon(d).pvalue)
    wins = int((d > 0).sum())
    assert res.sign_p == pytest.approx(sps.binomtest(wins, 40, 0.5).pvalue)
    assert (res.n_higher, res.n_lower, res.n_tied) == (wins, 40 - wins, 0)
    idx = np.random.default_rng(4).integers(0, 40, size=(500, 40))
    assert (res.ci_low, res.ci_high) == pytest.approx(
        tuple(np.percentile(d[idx].mean(1), [2.5, 97.5])))


def test_seed_averaged_uses_common_notes_and_drops_zero_differences():
    a = _frame({0: [1.0, 2.0, 3.0, 9.0]}, ["x", "y", "z", "only-a"])
    b = _frame({0: [1.0, 1.0, 1.0]}, ["x", "y", "z"])
    res = paired.seed_averaged(a, b, "v", n_resamples=100)
    assert res.n == 3 and (res.n_higher, res.n_lower, res.n_tied) == (2, 0, 1)
    assert res.wilcoxon_p == pytest.approx(sps.wilcoxon([1.0, 2.0]).pvalue)
    with pytest.raises(MistillInputError):
        paired.seed_averaged(a, _frame({0: [1.0]}, ["elsewhere"]), "v")


def test_seed_matched_is_note_clustered():
    # seed 0 pair: +0.2 on every note; seed 1 pair: -0.1 -> per note mean +0.05
    ref = _frame({0: [0.1, 0.2, 0.3], 1: [0.5, 0.5, 0.5]})
    arm = _frame({0: [0.3, 0.4, 0.5], 1: [0.4, 0.4, 0.4]})
    res = paired.seed_matched(arm, ref, "v", n_resamples=100)
    assert res.per_note == pytest.approx({"n00": 0.05, "n01": 0.05, "n02": 0.05})
    assert res.overall.n_higher == 3 and res.overall.sign_p == pytest.approx(0.25)
    assert (res.pooled_higher, res.pooled_lower) == (3, 3)
    row = paired.clustered_row(res)
    assert row["n_pairs"] == 2 and row["mean_diff"] == pytest.approx(0.05)
    # a one-seed arm pairs with every reference seed
    one = paired.seed_matched(_frame({0: [0.3, 0.4, 0.5]}), ref, "v", n_resamples=100)
    assert len(one.per_pair) == 2
    assert one.per_note["n00"] == pytest.approx(((0.3 - 0.1) + (0.3 - 0.5)) / 2)


def test_corpus_f1_pools_the_notes_every_seed_scored():
    arm = pd.DataFrame({"seed": [0, 0, 1, 1, 1], "note_id": ["a", "b", "a", "b", "c"],
                        "tp": [1, 1, 1, 0, 5], "fp": [0, 0, 1, 0, 0], "fn": [0, 0, 0, 1, 0]})
    ref = pd.DataFrame({"seed": [0, 0], "note_id": ["a", "b"], "tp": [0, 1], "fp": [0, 0],
                        "fn": [1, 0]})
    r = paired.corpus_f1(arm, ref, n_resamples=100)
    # arm seed 0: tp 2 -> 1.0; seed 1 on a, b: tp 1 fp 1 fn 1 -> 0.5; mean 0.75. ref: 2/3
    assert r.n_notes == 2
    assert r.difference == pytest.approx(0.75 - 2 / 3)


# ----------------------------------------------------------------------------- tables
def test_arm_order_and_formatting():
    assert tables.arm_order(["z", "mistill", "teacher", "vanilla-bf16", "untrained"],
                            "vanilla-bf16") == ["teacher", "untrained", "vanilla-bf16",
                                                "mistill", "z"]
    assert tables.fmt_mean_sd(0.14923, 0.0041, 3) == "0.149 ± 0.004"
    assert tables.fmt_mean_sd(0.179, float("nan"), 1) == "0.179"
    assert tables.fmt_ci(0.007, -0.005, 0.019) == "+0.007 [-0.005, +0.019]"


def test_task_table_means_sds_and_gap():
    runs = pd.DataFrame([
        {"model": "t", "arm": "teacher", "precision": "bf16", "seed": 0, "micro_f1": 0.5},
        {"model": "s", "arm": "untrained", "precision": "bf16", "seed": 0, "micro_f1": 0.1},
        {"model": "s", "arm": "mistill", "precision": "bf16", "seed": 0, "micro_f1": 0.34},
        {"model": "s", "arm": "mistill", "precision": "bf16", "seed": 1, "micro_f1": 0.36},
        {"model": "s", "arm": "opd", "precision": None, "seed": 0, "micro_f1": 0.2}])
    t = tables.task_table(runs)
    assert t["arm"].tolist() == ["teacher", "untrained", "mistill", "opd"]
    m = t[t["arm"] == "mistill"].iloc[0]
    assert m["micro_f1.mean"] == pytest.approx(0.35)
    assert m["micro_f1.sd"] == pytest.approx(np.std([0.34, 0.36], ddof=1))
    assert m["gap_recovered"] == pytest.approx(0.625)
    shown = tables.task_display(t)
    assert shown.loc[3, "arm"] == "opd [1 seed]" and shown.loc[2, "micro-F1"] == "0.350 ± 0.014"
    assert np.isnan(t[t["arm"] == "teacher"].iloc[0]["gap_recovered"])


# ------------------------------------------------------------------ the report, end to end
@pytest.fixture(scope="module")
def run_set(tracking_uri, tmp_path_factory):
    corpus = unique("report")
    root = tmp_path_factory.mktemp("writers")
    ids = build_run_set(tracking_uri, corpus, root)
    return corpus, ids


@pytest.fixture
def reader_root(tmp_path, monkeypatch):
    """The report reads through a fresh local root (artifacts downloaded, not found locally)."""
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "reader"))
    return tmp_path / "reader"


def _artifact(run_id: str, path: str, dst: Path) -> Path:
    return Path(MlflowClient().download_artifacts(run_id, path, str(dst)))


def _csv(run_id: str, name: str, dst: Path) -> pd.DataFrame:
    return pd.read_csv(_artifact(run_id, f"tables/{name}.csv", dst), dtype={"note_id": str})


def test_query_reads_tags_metrics_and_per_note_tables(tracking_uri, run_set, reader_root):
    corpus, _ = run_set
    client = MlflowClient()
    runs = query.stage_runs(client, f"mistill/{corpus}", "evaluate")
    assert len(runs) == 7 and set(runs["arm"]) == {"teacher", "untrained", "vanilla-bf16",
                                                   "mistill", "opd"}
    row = runs[(runs["arm"] == "mistill") & (runs["seed"] == 1)].iloc[0]
    assert row["micro_f1"] == pytest.approx(0.36) and row["precision"] == "bf16"
    assert row["model"] == STUDENT and row["corpus"] == corpus
    only = query.stage_runs(client, f"mistill/{corpus}", "evaluate", arms=("opd",))
    assert only["arm"].tolist() == ["opd"]
    loaded = query.per_note_table(runs, "per_note_metrics.csv", ["note_id", "micro_f1"])
    assert not loaded.missing and len(loaded.frame) == 7 * len(NOTES)
    mine = loaded.frame[(loaded.frame["arm"] == "mistill") & (loaded.frame["seed"] == 0)]
    assert mine["micro_f1"].to_numpy() == pytest.approx(eval_notes("mistill", 0)["micro_f1"])
    missing = query.per_note_table(runs.head(1), "nope.csv", ["note_id"])
    assert missing.frame.empty and runs.loc[0, "run_id"] in missing.missing
    assert query.stage_runs(client, "mistill/no-such-corpus", "evaluate").empty


def test_lambda_column_is_the_trained_lambda_and_names_figure_series(tracking_uri, tmp_path, reader_root):
    """``lambda`` (a tag column) is the λ a train run trained, and on a readout of its checkpoint
    the λ of that train run; the own-heads figure's legend names arm and λ, never a run id."""
    import re

    from analysis_fixtures import FakeStageConfig

    from mistill.tracking.privacy import PrivacyGuard
    from mistill.tracking.runs import StageRun

    corpus = unique("lambda")
    exp = f"mistill/{corpus}"
    trained = {}
    for seed in (0, 1):
        with StageRun("train", FakeStageConfig(arm="mistill", seed=seed, tag="train"), corpus=corpus,
                      guard=PrivacyGuard([], "synthetic"), model=STUDENT, arm="mistill", seed=seed,
                      precision="bf16", lam=(0.03, 0.03), root=tmp_path, code_version="test",
                      tracking_uri=tracking_uri) as run:
            trained[seed] = run.run_id
    for arm in ("mistill", "vanilla-bf16"):
        for seed in (0, 1):
            make_run(tracking_uri, corpus, "own_heads", tmp_path, arm=arm, seed=seed, precision="bf16",
                     model=f"run:{trained[seed]}" if arm == "mistill" else STUDENT,
                     tables={"own_heads_per_note": own_notes(arm, seed)})
    client = MlflowClient()
    assert "lambda" in query.TAG_COLUMNS
    assert query.stage_runs(client, exp, "train")["lambda"].tolist() == ["0.03", "0.03"]
    own = query.stage_runs(client, exp, "own_heads")
    assert sorted(own.loc[own["arm"] == "mistill", "lambda"]) == ["0.03", "0.03"]
    assert own.loc[own["arm"] == "vanilla-bf16", "lambda"].isna().all()
    assert set(own["model"]) == {STUDENT}  # the checkpoint's runs are the student's

    rep = build_report(collect_inputs(client, exp, reference_arm="vanilla-bf16"), reference_arm="vanilla-bf16",
                       n_resamples=50, corpus_resamples=50)
    names = {t.name for t in rep.figures["recovery_vs_k_own"].data}
    assert {"mistill λ=0.03, seeds 0,1", "vanilla-bf16, seeds 0,1"} <= names
    assert not any(re.search(r"[0-9a-f]{32}", n) for n in names)


def test_newer_run_of_the_same_cell_replaces_the_older(tracking_uri, tmp_path, reader_root):
    corpus = unique("latest")
    make_run(tracking_uri, corpus, "evaluate", tmp_path, arm="mistill", seed=0,
             metrics={"micro_f1": 0.1})
    newer = make_run(tracking_uri, corpus, "evaluate", tmp_path, arm="mistill", seed=0,
                     metrics={"micro_f1": 0.2})
    runs = query.latest_runs(query.stage_runs(MlflowClient(), f"mistill/{corpus}", "evaluate"))
    assert runs["run_id"].tolist() == [newer]


def test_report_numbers_match_hand_values(tracking_uri, run_set, reader_root, tmp_path):
    corpus, ids = run_set
    cfg = ReportConfig(corpus=corpus, bootstrap=300, corpus_bootstrap=500, seed=1)
    run_id = run_report(cfg)
    run = MlflowClient().get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.stage"] == "report"
    # 8 tables from these runs, and the 36 always-listed ones (empty rows where no data; 10 of
    # them App. E's Tables 16-24 and the read-side patient collapse, one the pool arms' carriers,
    # three Table 52's parts, one App. I's k = 8 probe, one Table 38's aligned-event gains, one
    # Table 4's instruction control, two Table 54's and two Table 55's evidence-flip readings, Table 5's
    # audit shares)
    assert run.data.metrics["n_runs/evaluate"] == 7 and run.data.metrics["n_tables"] == 8 + 36
    inputs = {k for k in run.data.tags if k.startswith("mistill.input.")}
    assert f"mistill.input.evaluate.{ids['evaluate'][('opd', 0)]}" in inputs and len(inputs) == 14

    # Table 2: mean and sd over seeds, the gap recovered, single seeds marked
    t2 = _csv(run_id, "table2_task_fidelity", tmp_path)
    m = t2[t2["arm"] == "mistill"].iloc[0]
    assert m["micro_f1.mean"] == pytest.approx(0.35) and m["gap_recovered"] == pytest.approx(0.625)
    assert m["m1/P2C/p_pos.mean"] == pytest.approx(0.605)
    assert t2["arm"].tolist()[:3] == ["teacher", "untrained", "vanilla-bf16"]
    shown = _artifact(run_id, "tables/table2_task_fidelity_display.md", tmp_path).read_text()
    assert "opd [1 seed]" in shown and "0.350 ± 0.014" in shown

    # Table 43: mistill is the reference + 0.1 on every note and seed
    t43 = _csv(run_id, "table43_paired", tmp_path)
    row = t43[(t43["arm"] == "mistill") & (t43["measure"] == "micro-F1 (per note)")].iloc[0]
    assert row["mean_diff"] == pytest.approx(0.1) and row["n"] == len(NOTES)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((0.1, 0.1))
    assert row["n_higher"] == len(NOTES) and row["sign_p"] == pytest.approx(2 * 0.5 ** len(NOTES))
    ref = (eval_notes("vanilla-bf16", 0)["micro_f1"] + eval_notes("vanilla-bf16", 1)["micro_f1"]) / 2
    d = eval_notes("opd", 0)["micro_f1"] - ref
    opd = t43[(t43["arm"] == "opd") & (t43["measure"] == "micro-F1 (per note)")].iloc[0]
    assert opd["mean_diff"] == pytest.approx(d.mean())
    assert opd["wilcoxon_p"] == pytest.approx(sps.wilcoxon(d).pvalue)
    # corpus-level micro-F1: per seed pooled counts, mean over seeds
    def corpus(arm, seeds):
        f1 = []
        for s in seeds:
            c = eval_notes(arm, s)[["tp", "fp", "fn"]].sum()
            f1.append(2 * c.tp / (2 * c.tp + c.fp + c.fn))
        return np.mean(f1)
    assert row["corpus_diff"] == pytest.approx(corpus("mistill", (0, 1))
                                               - corpus("vanilla-bf16", (0, 1)))
    assert set(t43["measure"]) == {"micro-F1 (per note)", "LAS", "BLEU-4", "PPL"}
    assert "untrained" in set(t43["arm"]) and "teacher" not in set(t43["arm"])

    # Table 45: per-seed medians and the note-clustered comparison at P2C k=40
    t45s = _csv(run_id, "table45_own_heads_seeds", tmp_path)
    s1 = t45s[(t45s["arm"] == "mistill") & (t45s["seed"] == 1)].iloc[0]
    own = own_notes("mistill", 1)
    cell = own[(own["phase"] == "P2C") & (own["k"] == 40)]
    assert s1["P2C.k40.own"] == pytest.approx(cell["recovery_own"].median())
    assert s1["P2C.k40.random"] == pytest.approx(cell["recovery_random"].median())
    assert s1["task"] == pytest.approx(0.36) and s1["m2/region_lift"] == pytest.approx(3.0)
    t45 = _csv(run_id, "table45_seed_matched", tmp_path)
    p2c = t45[(t45["arm"] == "mistill") & (t45["measure"] == "M4 P2C k40")].iloc[0]
    assert p2c["mean_diff"] == pytest.approx(np.mean(list(OWN_DELTA.values())))
    assert p2c["n_pairs"] == 2 and p2c["n_higher"] == len(NOTES)
    assert p2c["pooled_higher"] == 2 * len(NOTES)
    p1 = t45[(t45["arm"] == "mistill") & (t45["measure"] == "M4 P1 k8")].iloc[0]
    assert p1["n_tied"] == len(NOTES) and p1["sign_p"] == 1.0
    task = t45[t45["measure"] == "task micro-F1 (per note)"].iloc[0]
    assert task["mean_diff"] == pytest.approx(0.1)
    t3 = _csv(run_id, "table3_own_heads", tmp_path)
    assert t3.loc[t3["arm"] == "mistill", "m2/region_lift.mean"].iloc[0] == pytest.approx(2.5)

    # Tables 1/10: the global set beats random on all but one note at P1 k=8
    t10 = _csv(run_id, "table10_global_sets", tmp_path)
    assert sorted(t10["k"].unique()) == [3, 8, 16, 40]
    r = t10[(t10["phase"] == "P1") & (t10["k"] == 8)].iloc[0]
    assert (r["recovery.wins_vs_random"], r["recovery.n_vs_random"]) == (5, 6)
    assert 16 not in set(_csv(run_id, "table1_global_sets", tmp_path)["k"])
    tex = _artifact(run_id, "tables/table1_global_sets.tex", tmp_path).read_text()
    assert tex.startswith("\\begin{tabular}") and "5/6" in tex

    # λ cells, the figures and the report text
    cells = _csv(run_id, "lambda_cells", tmp_path)
    assert cells["metric"].max() == pytest.approx(0.24) and len(cells) == 7
    stage_cells = cells[cells["arm"] == "randheads"]  # columns named after the lock
    assert stage_cells["metric"].tolist()[:2] == pytest.approx([0.21, 0.215])
    assert stage_cells["picked"].tolist() == [False, True, False]
    names = {a.path for a in MlflowClient().list_artifacts(run_id, "figures")}
    assert names == {f"figures/{n}.html" for n in (
        "recovery_vs_k_global", "paired_differences_task", "recovery_vs_k_own",
        "paired_differences_own_heads", "lambda_frontier")}
    html = _artifact(run_id, "figures/lambda_frontier.html", tmp_path).read_text()
    assert "plotly" in html and "picked" in html
    text = _artifact(run_id, "report.md", tmp_path).read_text()
    assert "## Table 43" in text
    # the run set has every kind of run but the locus pass: that is the one skipped section
    skipped = [line for line in text.splitlines() if "skipped" in line]
    assert skipped[0] == "- Tables 25-33 and Figure 1 (the locus pass) skipped: no FINISHED locus runs."
    assert skipped[1].startswith("- Tables 9/35/36 (two characterizations side by side) skipped: no pair")
    # the fixture's knock-in runs carry no lineage back to a corpus: no patients to collapse to
    assert all("App. C's patient collapse" in line and "names no attribute run" in line for line in skipped[2:-1])
    assert len(skipped) > 3
    assert skipped[-1] == ("- Table 53 (learning curve), Figure 8 and the training cost skipped: no FINISHED train "
                           "runs.")

    # the same request over the same runs reuses the finished report
    assert run_report(cfg) == run_id


def test_report_skips_absent_kinds_and_says_so(tracking_uri, tmp_path, reader_root):
    corpus = unique("partial")
    build_run_set(tracking_uri, corpus, tmp_path, kinds=("evaluate",))
    run_id = run_report(ReportConfig(corpus=corpus, bootstrap=50, corpus_bootstrap=50))
    text = _artifact(run_id, "report.md", tmp_path).read_text()
    assert "## Table 2" in text and "## Table 43" in text
    for what in ("Tables 1/10", "Tables 3/45", "λ validation frontier"):
        assert f"{what}" in text and "skipped" in text
    assert "no FINISHED own_heads runs" in text and "no FINISHED knockin runs" in text
    # a reference arm that has no runs: Table 43 skipped, Table 2 still there
    other = run_report(ReportConfig(corpus=corpus, reference_arm="feature-kd", bootstrap=50,
                                    corpus_bootstrap=50))
    text = _artifact(other, "report.md", tmp_path / "o").read_text()
    assert "## Table 2" in text and "no evaluate run of the reference arm 'feature-kd'" in text
    # an experiment with no runs at all still gives a report
    empty = run_report(ReportConfig(corpus=unique("empty"), bootstrap=10, corpus_bootstrap=10))
    # only the always-listed tables, each with empty rows and the reason
    assert MlflowClient().get_run(empty).data.metrics["n_tables"] == 36
    text = _artifact(empty, "report.md", tmp_path / "e").read_text()
    assert "no train runs of arm top8 under this experiment" in text
    assert "No rows: no FINISHED select_lambda runs." in text


def test_arms_filter_keeps_reference_teacher_and_untrained(tracking_uri, run_set, reader_root):
    corpus, _ = run_set
    inputs = collect_inputs(MlflowClient(), f"mistill/{corpus}", arms=("opd",),
                            reference_arm="vanilla-bf16")
    assert set(inputs.runs["evaluate"]["arm"]) == {"opd", "vanilla-bf16", "teacher", "untrained"}
    assert set(inputs.runs["own_heads"]["arm"]) == {"vanilla-bf16"}
    rep = build_report(inputs, reference_arm="vanilla-bf16", n_resamples=20,
                       corpus_resamples=20)
    assert set(rep.table("table43_paired").numeric["arm"]) == {"opd", "untrained"}
    assert inputs.privacy() == "synthetic"
    assert json.loads(json.dumps(inputs.lineage()))  # plain strings, one per input run


def test_report_reads_only_the_split_it_reports_on(tracking_uri, tmp_path):
    """A λ-selection cell's validation evaluation of the same arm and seed, newer than the test
    evaluation, is not read as the arm's test result."""
    from analysis_fixtures import make_run

    corpus = unique("split")
    test_run = make_run(tracking_uri, corpus, "evaluate", tmp_path, arm="mistill", seed=0, precision="bf16",
                        metrics={"micro_f1": 0.25}, tags={"mistill.split": "test"})
    make_run(tracking_uri, corpus, "evaluate", tmp_path, arm="mistill", seed=0, precision="bf16",
             metrics={"micro_f1": 0.75}, tags={"mistill.split": "val"})
    got = collect_inputs(MlflowClient(), f"mistill/{corpus}")
    assert list(got.runs["evaluate"]["run_id"]) == [test_run]
    assert got.runs["evaluate"]["micro_f1"].tolist() == [0.25]
    val = collect_inputs(MlflowClient(), f"mistill/{corpus}", split="val")
    assert val.runs["evaluate"]["micro_f1"].tolist() == [0.75]
