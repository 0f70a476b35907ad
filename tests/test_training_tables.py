"""Table 53 and Figure 8 (the learning curve), App. I.5's training cost and App. L.5/L.6's replicate
pairing: the pure functions of :mod:`analysis.training_tables` on small hand-made frames, and the
report's tables from hand-built runs of the real test MLflow server, against numbers computed
here independently."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from analysis_fixtures import NOTES, STUDENT, make_run
from mlflow.tracking import MlflowClient
from scipy import stats as sps
from stage_fixtures import unique

from analysis import training_tables as tt
from mistill import stats
from mistill.config import Config
from mistill.errors import MistillInputError
from mistill.stages.report import ReportConfig, run_report

BOOT, SEED = 200, 3


# ------------------------------------------------------------------------ pure functions
def test_train_sizes_read_the_param_then_the_note_count():
    train = pd.DataFrame({"run_id": ["a", "b", "c", "d"], "n_notes": [100.0, 493.0, np.nan, np.nan]})
    sizes = tt.train_sizes(train, {"a": "100", "b": "0", "c": "250"})
    assert sizes == {"a": 100, "b": 493, "c": 250}  # d: neither a size nor a count


def test_learning_curve_runs_keep_the_newest_per_size():
    ev = pd.DataFrame({"run_id": ["e1", "e2", "e3", "e4"], "start_time": [1, 2, 3, 4],
                       "model": "m", "arm": "mistill", "precision": "bf16", "seed": [0, 0, 0, 0],
                       "train_run": ["t100", "t100", "tall", None]})
    runs = tt.learning_curve_runs(ev, {"t100": 100, "tall": 493})
    assert list(runs["run_id"]) == ["e2", "e3"] and list(runs["train_notes"]) == [100, 493]


def _notes(run_id: str, seed: int, f1: np.ndarray, m1: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame({"run_id": run_id, "seed": seed, "note_id": [f"n{i}" for i in range(len(f1))],
                         "micro_f1": f1, "m1_P2C_p_pos": m1})


def test_learning_curve_table_pairs_seed_by_seed_and_pools_note_pairs():
    f1_ref = {0: np.array([0.1, 0.2, 0.3, 0.4]), 1: np.array([0.2, 0.2, 0.2, 0.2])}
    f1_arm = {0: np.array([0.2, 0.1, 0.35, 0.4]), 1: np.array([0.3, 0.3, 0.1, 0.25])}
    m1 = np.array([0.5, 0.6, 0.7, 0.8])
    runs, notes = [], []
    for arm, f1 in (("mistill", f1_arm), ("vanilla-bf16", f1_ref)):
        for s in (0, 1):
            rid = f"{arm}{s}"
            runs.append({"run_id": rid, "model": "m", "arm": arm, "precision": "bf16", "seed": s, "train_notes": 493,
                         "micro_f1": f1[s].mean() + 0.01, "m1/P2C/p_pos": 0.7 + 0.01 * s})
            notes.append(_notes(rid, s, f1[s], m1 + (0.05 if arm == "mistill" else 0.0)))
    table = tt.learning_curve_table(pd.DataFrame(runs), pd.concat(notes), references=("vanilla-bf16",),
                                    n_resamples=BOOT, seed=SEED)
    arm_row = table[table["arm"] == "mistill"].iloc[0]
    per_pair = [f1_arm[s] - f1_ref[s] for s in (0, 1)]
    clustered = np.mean(per_pair, axis=0)
    pooled = np.concatenate(per_pair)
    assert arm_row["f1_mean_diff"] == pytest.approx(clustered.mean())
    assert (arm_row["f1_pooled_higher"], arm_row["f1_pooled_lower"]) == ((pooled > 0).sum(), (pooled < 0).sum())
    assert arm_row["f1_pooled_sign_p"] == pytest.approx(
        sps.binomtest(int((pooled > 0).sum()), int((pooled != 0).sum())).pvalue)
    assert arm_row["m1_p2c_mean_diff"] == pytest.approx(0.05) and arm_row["m1_p2c_n_higher"] == 4
    assert arm_row["f1_mean"] == pytest.approx(np.mean([f1_arm[s].mean() + 0.01 for s in (0, 1)]))
    assert arm_row["m1_p2c_sd"] == pytest.approx(np.std([0.7, 0.71], ddof=1))
    ref_row = table[table["arm"] == "vanilla-bf16"].iloc[0]
    assert pd.isna(ref_row.get("reference")) and ref_row["n_test_notes"] == 4
    shown = tt.learning_curve_display(table)
    assert shown.loc[0, "micro-F1 higher/lower"] == f"{(pooled > 0).sum()}/{(pooled < 0).sum()}"
    fig = tt.learning_curve_figure(table)
    assert {t.name for t in fig.data} == {"mistill", "vanilla-bf16"}


def test_training_cost_from_the_step_metrics_and_the_system_fallback():
    train = pd.DataFrame({"run_id": ["a", "b"], "model": "m", "arm": ["mistill", "vanilla-bf16"],
                          "precision": "bf16", "seed": [0, 0], "lambda": None, "train_notes": [100, 100],
                          "run_seconds": [600.0, 300.0], "train/steps": [2.0, 2.0]})
    hist = pd.DataFrame([("a", "train/step_seconds", 1, 10.0), ("a", "train/step_seconds", 2, 14.0),
                         ("a", "train/step_notes", 1, 4.0), ("a", "train/step_notes", 2, 4.0),
                         ("a", "train/peak_memory_gib", 1, 3.0), ("a", "train/peak_memory_gib", 2, 3.5),
                         ("b", "train/step_seconds", 1, 4.0), ("b", "train/step_seconds", 2, 4.0),
                         ("b", "train/step_notes", 1, 4.0), ("b", "train/step_notes", 2, 4.0),
                         ("b", "system/gpu_0_memory_usage_megabytes", 0, 2000.0),
                         ("b", "system/gpu_1_memory_usage_megabytes", 0, 1000.0)],
                        columns=["run_id", "metric", "step", "value"])
    runs = tt.training_cost_runs(train, hist).set_index("run_id")
    assert runs.loc["a", "s_per_note"] == pytest.approx(24 / 8) and runs.loc["a", "s_per_step"] == 12.0
    assert runs.loc["a", "peak_memory_gib"] == 3.5 and runs.loc["a", "run_minutes"] == 10.0
    assert runs.loc["b", "peak_memory_gib"] == pytest.approx(2000e6 / 2 ** 30)
    assert runs.loc["b", "peak_source"].startswith("system metrics")
    table = tt.training_cost_table(runs.reset_index(), "vanilla-bf16").set_index("arm")
    assert table.loc["mistill", "s_per_note_ratio"] == pytest.approx(3.0 / 1.0)
    assert table.loc["mistill", "peak_memory_diff_gib"] == pytest.approx(3.5 - 2000e6 / 2 ** 30)
    assert np.isnan(table.loc["vanilla-bf16", "s_per_note_ratio"])
    shown = tt.training_cost_display(table.reset_index(), "vanilla-bf16")
    assert list(shown["s per note"]) == ["3.0", "1.0"] and list(shown["train min"]) == ["0.4", "0.1"]


def test_replicate_pairs_parse_and_refuse():
    assert tt.parse_replicate_pairs(["a", "b", "c", "d"]) == [("a", "b"), ("c", "d")]
    for bad in (["a"], ["a", "b", "c"], ["a", "a"]):
        with pytest.raises(MistillInputError, match="replicate_runs"):
            tt.parse_replicate_pairs(bad)


def test_replicate_differences_and_tests():
    a = pd.DataFrame({"note_id": ["x", "y", "z", "w"], "micro_f1": [0.5, 0.4, 0.3, np.nan], "las": 0.1})
    b = pd.DataFrame({"note_id": ["x", "y", "z", "v"], "micro_f1": [0.4, 0.4, 0.35, 0.2]})
    long = tt.replicate_differences(a, b, tt.EVALUATE_MEASURES)
    assert set(long["measure"]) == {"micro-F1"}  # LAS: run b has none; w, v: one side only
    table = tt.replicate_table(long, n_resamples=BOOT, seed=SEED).iloc[0]
    assert table["n"] == 3 and table["mean_diff"] == pytest.approx((0.1 + 0.0 - 0.05) / 3)
    assert (table["n_higher"], table["n_lower"], table["n_tied"]) == (1, 1, 1)
    assert table["median_a_minus_b"] == pytest.approx(0.4 - 0.4)
    assert tt.top_k_agreement({"P2C": ["h1", "h2", "h3"]}, {"P2C": ["h2", "h1", "h4"]}, "P2C", 2) == \
        {"top_k_overlap": 2, "same_order": False}
    assert tt.top_k_agreement({"P2C": ["h1"]}, None, "P2C", 1) == {}


# ------------------------------------------------------------------------ the report
@dataclasses.dataclass(frozen=True)
class TrainParams(Config):
    """What a train run logs that these tables read: ``train_notes`` (0: every note)."""

    arm: str = ""
    seed: int = 0
    train_notes: int = 0
    tag: str = ""


N = len(NOTES)
ALL = 493  # the training split: a train run on every note (train_notes 0) logs this n_notes
F1_REF = {(100, 0): np.linspace(0.1, 0.4, N), (ALL, 0): np.linspace(0.2, 0.5, N),
          (ALL, 1): np.linspace(0.25, 0.45, N)}
F1_GAIN = {(100, 0): np.tile([0.05, -0.02, 0.0, 0.03], N // 4), (ALL, 0): np.tile([0.04, 0.01, -0.03], N // 3),
           (ALL, 1): np.tile([0.02, -0.01], N // 2)}
M1_GAIN = {100: 0.03, ALL: 0.02}
STEP = {"mistill": (12.0, 2.5), "vanilla-bf16": (4.0, 2.0)}  # seconds per step, peak GiB
OWN_K = (8, 40)


def _eval_notes(arm: str, size: int, seed: int) -> pd.DataFrame:
    f1 = F1_REF[(size, seed)] + (F1_GAIN[(size, seed)] if arm == "mistill" else 0.0)
    m1 = np.linspace(0.6, 0.8, N) + (M1_GAIN[size] if arm == "mistill" else 0.0)
    return pd.DataFrame({"note_id": NOTES, "micro_f1": f1, "m1_P2C_p_pos": m1, "las": f1 / 2,
                         "tp": 1, "fp": 1, "fn": 1})


def _own_notes(shift: float) -> pd.DataFrame:
    rows = [{"note_id": n, "traces": "teacher", "phase": p, "k": k, "recovery_own": 0.5 + 0.02 * i + shift * (i % 3 - 1),
             "recovery_random": 0.05} for i, n in enumerate(NOTES) for p in ("P1", "P2C") for k in OWN_K]
    return pd.DataFrame(rows)


def _build(uri: str, corpus: str, root: Path) -> dict:
    ids: dict = {"train": {}, "evaluate": {}}
    for arm in ("mistill", "vanilla-bf16"):
        for size, seed in ((100, 0), (ALL, 0), (ALL, 1)):
            seconds, peak = STEP[arm]
            history = {"train/step_seconds": {1: seconds, 2: seconds + 2.0}, "train/step_notes": {1: 4.0, 2: 4.0}}
            if arm == "mistill":
                history["train/peak_memory_gib"] = {1: peak - 1.0, 2: peak}
            else:  # an older run: only MLflow's sampled GPU memory
                history["system/gpu_0_memory_usage_megabytes"] = {0: peak * 2 ** 30 / 1e6, 1: 100.0}
            train = make_run(uri, corpus, "train", root, arm=arm, seed=seed, precision="bf16",
                             cfg=TrainParams(arm=arm, seed=seed, train_notes=0 if size == ALL else size),
                             metrics={"n_notes": float(size), "train/steps": 2.0}, history=history)
            ids["train"][(arm, size, seed)] = train
            per_note = _eval_notes(arm, size, seed)
            ids["evaluate"][(arm, size, seed)] = make_run(
                uri, corpus, "evaluate", root, arm=arm, seed=seed, precision="bf16", model=STUDENT,
                inputs={"train": train}, tags={"mistill.split": "test"},
                cfg=TrainParams(arm=arm, seed=seed, train_notes=size, tag="eval"),
                metrics={"micro_f1": float(per_note["micro_f1"].mean()) + 0.01,
                         "m1/P2C/p_pos": float(per_note["m1_P2C_p_pos"].mean())},
                tables={"per_note_metrics": per_note})
    # a replicate evaluation of mistill's seed-0 checkpoint, written first so the curve reads the other
    replicate = _eval_notes("mistill", ALL, 0).assign(micro_f1=lambda d: d["micro_f1"] + np.tile([0.01, -0.01, 0.0], N // 3))
    ids["replicate"] = make_run(uri, corpus, "evaluate", root, arm="mistill", seed=0, precision="bf16",
                                inputs={"train": ids["train"][("mistill", ALL, 0)]}, tags={"mistill.split": "val"},
                                cfg=TrainParams(arm="mistill", tag="replicate"), metrics={"micro_f1": 0.3},
                                tables={"per_note_metrics": replicate})
    sets = {"P1": [f"L0H{i}" for i in range(40)], "P2C": [f"L1H{i}" for i in range(40)]}
    swapped = {**sets, "P2C": [sets["P2C"][1], sets["P2C"][0], *sets["P2C"][2:39], "L9H9"]}
    ids["own"] = [make_run(uri, corpus, "own_heads", root, arm="mistill", seed=0, precision="bf16",
                           inputs={"train": ids["train"][("mistill", ALL, 0)]}, tags={"mistill.split": "test"},
                           cfg=TrainParams(arm="mistill", tag=f"own-{i}"),
                           tables={"own_heads_per_note": _own_notes(shift)}, jsons={"own_heads_sets": s})
                  for i, (shift, s) in enumerate(((0.0, sets), (0.01, swapped)))]
    return ids


@pytest.fixture(scope="module")
def report(tracking_uri, tmp_path_factory, pinned_code_version):
    corpus = unique("training")
    ids = _build(tracking_uri, corpus, tmp_path_factory.mktemp("writers"))
    pairs = (ids["evaluate"][("mistill", ALL, 0)], ids["replicate"], *ids["own"])
    mp = pytest.MonkeyPatch()
    mp.setenv("MISTILL_ROOT", str(tmp_path_factory.mktemp("reader")))
    try:
        run_id = run_report(ReportConfig(corpus=corpus, bootstrap=BOOT, corpus_bootstrap=BOOT, seed=SEED,
                                         replicate_runs=pairs))
    finally:
        mp.undo()
    return run_id, ids, tmp_path_factory.mktemp("read")


def _csv(report, name: str) -> pd.DataFrame:
    run_id, _, dst = report
    return pd.read_csv(MlflowClient().download_artifacts(run_id, f"tables/{name}.csv", str(dst)))


def test_learning_curve_against_an_independent_computation(report):
    t53 = _csv(report, "table53_learning_curve")
    assert sorted(set(t53["train_notes"])) == [100, ALL]
    rows = t53[t53["arm"] == "mistill"].set_index("train_notes")
    assert set(rows["reference"]) == {"vanilla-bf16"}
    # 100 notes: one seed pair, the per-note differences themselves
    d100 = F1_GAIN[(100, 0)]
    assert rows.loc[100, "f1_mean_diff"] == pytest.approx(d100.mean())
    assert rows.loc[100, "f1_pooled_higher"] == (d100 > 0).sum() and rows.loc[100, "f1_pooled_lower"] == (d100 < 0).sum()
    assert rows.loc[100, "f1_pooled_sign_p"] == pytest.approx(
        sps.binomtest(int((d100 > 0).sum()), int((d100 != 0).sum())).pvalue)
    ci = stats.bootstrap_ci(d100, np.mean, n_resamples=BOOT, seed=SEED)
    assert (rows.loc[100, "f1_ci_low"], rows.loc[100, "f1_ci_high"]) == pytest.approx((ci.low, ci.high))
    # every training note: seed i against seed i, per note the mean of the two pairs' differences
    pooled = np.concatenate([F1_GAIN[(ALL, 0)], F1_GAIN[(ALL, 1)]])
    clustered = (F1_GAIN[(ALL, 0)] + F1_GAIN[(ALL, 1)]) / 2
    assert rows.loc[ALL, "f1_mean_diff"] == pytest.approx(clustered.mean())
    assert rows.loc[ALL, "f1_n_pairs"] == 2
    assert (rows.loc[ALL, "f1_pooled_higher"], rows.loc[ALL, "f1_pooled_lower"]) == ((pooled > 0).sum(), (pooled < 0).sum())
    assert rows.loc[ALL, "m1_p2c_mean_diff"] == pytest.approx(M1_GAIN[ALL])
    levels = [float(_eval_notes("mistill", ALL, s)["micro_f1"].mean()) + 0.01 for s in (0, 1)]
    assert rows.loc[ALL, "f1_mean"] == pytest.approx(np.mean(levels))
    assert rows.loc[ALL, "f1_sd"] == pytest.approx(np.std(levels, ddof=1))
    assert (rows["n_test_notes"] == N).all()
    run_id, _, dst = report
    html = Path(MlflowClient().download_artifacts(run_id, "figures/learning_curve.html", str(dst)))
    assert html.stat().st_size > 0
    md = Path(MlflowClient().download_artifacts(run_id, "report.md", str(dst))).read_text()
    assert "Table 53: learning curve" in md and f"same {N} test notes (6 evaluate runs)" in md


def test_training_cost_per_arm(report):
    cost = _csv(report, "training_cost").set_index(["arm", "train_notes"])
    # per step: (s, s + 2) seconds on 4 notes each
    for arm, (seconds, peak) in STEP.items():
        assert cost.loc[(arm, ALL), "s_per_note_mean"] == pytest.approx((2 * seconds + 2) / 8)
        assert cost.loc[(arm, ALL), "runs"] == 2
        assert cost.loc[(arm, ALL), "peak_memory_gib"] == pytest.approx(peak)
    ratio = (2 * STEP["mistill"][0] + 2) / (2 * STEP["vanilla-bf16"][0] + 2)
    assert cost.loc[("mistill", 100), "s_per_note_ratio"] == pytest.approx(ratio)
    per_run = _csv(report, "training_cost_runs")
    assert len(per_run) == 6 and set(per_run["peak_source"].str.split(" ").str[0]) == {"torch", "system"}


def test_replicate_pairs(report):
    table = _csv(report, "replicate_pairs")
    ev = table[table["stage"] == "evaluate"].set_index("measure")
    d = -np.tile([0.01, -0.01, 0.0], N // 3)  # run a (the test evaluation) minus the replicate
    assert ev.loc["micro-F1", "mean_diff"] == pytest.approx(d.mean(), abs=1e-12)
    assert (ev.loc["micro-F1", "n_higher"], ev.loc["micro-F1", "n_lower"]) == ((d > 0).sum(), (d < 0).sum())
    assert ev.loc["micro-F1", "sign_p"] == pytest.approx(sps.binomtest(int((d > 0).sum()), int((d != 0).sum())).pvalue)
    assert ev.loc["M1 P2C", "mean_diff"] == pytest.approx(0.0) and bool(ev["same_checkpoint"].all())
    own = table[table["stage"] == "own_heads"].set_index(["phase", "k"])
    shift = -0.01 * np.array([i % 3 - 1 for i in range(N)])
    assert own.loc[("P2C", 40), "mean_diff"] == pytest.approx(shift.mean(), abs=1e-12)
    assert own.loc[("P2C", 40), "n"] == N
    assert own.loc[("P2C", 40), "top_k_overlap"] == 39 and not own.loc[("P2C", 40), "same_order"]
    assert own.loc[("P2C", 8), "top_k_overlap"] == 8 and not own.loc[("P2C", 8), "same_order"]
    assert own.loc[("P1", 8), "top_k_overlap"] == 8 and own.loc[("P1", 8), "same_order"]
