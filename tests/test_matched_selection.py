"""App. M.2's matched selection: the two shipped locks state the paper's protocol and differ only in
the arm, and Table 52 is built from hand-built runs of the real test MLflow server (two
``select_lambda`` runs, the picks' train runs at three seeds, their test evaluations and own-heads
readouts, and decoys that must stay out), its numbers checked against a computation of their own.

The validation cells are the paper's where it prints them (App. M.2's full-precision gaps, the
picks under the 0.004 and 0.005 bands); the other values are illustrative."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from analysis_fixtures import FakeStageConfig, make_run, train_arm
from mlflow.tracking import MlflowClient
from stage_fixtures import unique

from analysis.report import build_report, collect_inputs
from mistill.config import Config
from mistill.distill.arms import resolve_arm
from mistill.instrument.settables import to_latex, to_markdown
from selection.cells import Cell, CellResult
from selection.decide import decide
from selection.lock import lock_from_record, load_lock

pytestmark = pytest.mark.usefixtures("pinned_code_version")

LOCKS = Path(__file__).resolve().parents[1] / "projects" / "configs" / "locks"
BOOT = 200
NOTES = [f"t{i:02d}" for i in range(10)]
SEEDS = (0, 1, 2)
VAL = {  # λ -> (validation micro-F1, M1 at P2C); App. M.2's gaps: 0.0040204002 and 0.0041750956
    "mistill": {0.03: (0.160, 0.80), 0.1: (0.160 - 0.0040204002, 0.85), 0.3: (0.140, 0.86), 0.01: (0.150, 0.70)},
    "randheads": {0.3: (0.130, 0.78), 0.1: (0.120, 0.80), 0.03: (0.130 - 0.0041750956, 0.90), 1.0: (0.020, 0.50)}}
PICK = {"mistill": 0.03, "randheads": 0.3}
LIFT = {0: 0.06, 1: 0.07, 2: 0.065}
"""Mistill's own-heads recovery above RandHeads' per seed (plus a per-note wobble)."""


# ----------------------------------------------------------------------------- the locks
def test_the_matched_locks_state_app_m2s_protocol_and_differ_only_in_the_arm():
    mistill, rand = (load_lock(LOCKS / f"m2-matched-{arm}.yaml") for arm in ("mistill", "randheads"))
    for lock in (mistill, rand):
        assert lock.grid.tied and lock.grid.scale == "log" and lock.grid.axes == {"lambda": (0.03, 0.1, 0.3)}
        t = lock.training
        # the tier-1 bf16 line: every training note, two epochs at global batch 8, seed 0
        assert (t.seed, t.max_steps, t.epochs, t.grad_accum, t.precision, t.train_notes) == (0, 0, 2, 8, "bf16", 0)
        s = lock.selection
        assert (s.metric, s.split, s.tie_band, s.tie_break, s.max_new_tokens, s.validity_floor) == \
            ("micro_f1", "val", 0.004, "m1/P2C/p_pos", 16384, None)
        assert lock.edge.extend and lock.edge.max_extensions == 1  # one boundary cell
        assert lock.edge.outward == {"lambda": {"low": 0.01, "high": 1.0}}  # one grid step outward
    assert (mistill.arm, rand.arm) == ("mistill", "randheads")
    strip = {"path", "sha256", "study", "arm"}
    assert {k: v for k, v in mistill.to_dict().items() if k not in strip} == \
        {k: v for k, v in rand.to_dict().items() if k not in strip}
    # the frozen pool: RandHeads' heads are drawn from the arm's pool seed, 0, not the training seed
    frozen = resolve_arm(rand.arm)
    assert (frozen.pool_mode, frozen.pool_seed) == ("random", 0)
    assert resolve_arm(mistill.arm).pool_mode == "top"
    # the record a selection keeps rebuilds the same lock, so its rule can be re-applied
    assert lock_from_record(rand.to_dict()).to_dict() == rand.to_dict()


# ------------------------------------------------------------------------------ the runs
def _cells_and_results(arm: str):
    lock = load_lock(LOCKS / f"m2-matched-{arm}.yaml")
    results = {Cell.of({"lambda": lam}): CellResult(metric=f1, tie_break=m1, validity=0.95)
               for lam, (f1, m1) in VAL[arm].items()}
    return lock, results


def _own_rows(lift: float, note_shift: np.ndarray) -> pd.DataFrame:
    rows = []
    for i, note in enumerate(NOTES):
        for phase, k in (("P2C", 40), ("P2C", 8), ("P1", 40)):
            base = 0.55 + 0.03 * i + (0.05 if k == 40 else 0.0)
            rows.append({"note_id": note, "phase": phase, "k": k, "traces": "teacher",
                         "recovery_own": base + lift * (1.0 if phase == "P2C" else 0.0) + note_shift[i],
                         "recovery_random": 0.10 + 0.001 * i, "necessity_own": 0.5})
    return pd.DataFrame(rows)


def _eval_rows(seed: int, better: int) -> pd.DataFrame:
    tp = np.array([2 + (i + seed) % 3 + better for i in range(len(NOTES))])
    fp = np.array([1 + i % 2 for i in range(len(NOTES))])
    fn = np.array([3] * len(NOTES))
    return pd.DataFrame({"note_id": NOTES, "tp": tp, "fp": fp, "fn": fn,
                         "micro_f1": 2 * tp / (2 * tp + fp + fn), "valid": True})


@pytest.fixture(scope="module")
def matched(tracking_uri, tmp_path_factory):
    corpus = unique("matched")
    root = tmp_path_factory.mktemp("writers")
    ids: dict = {"train": {}, "evaluate": {}, "own": {}, "per_note": {}}

    def trained(arm: str, seed: int, lam: float, *, pool_seed: int = 0) -> str:
        flags = {"lambda_p1": lam, "lambda_p2": lam, **({"pool_seed": pool_seed} if arm == "randheads" else {})}
        return make_run(tracking_uri, corpus, "train", root, arm=arm, seed=seed, precision="bf16",
                        jsons={"arm": train_arm(arm, **flags)}, tags={"mistill.lambda": f"{lam:g}"},
                        cfg=FakeStageConfig(arm=arm, seed=seed, tag=f"train-{lam}-{pool_seed}"))

    def read(arm: str, seed: int, train: str, own: pd.DataFrame, ev: pd.DataFrame) -> tuple[str, str]:
        link = {"train": train}
        e = make_run(tracking_uri, corpus, "evaluate", root, arm=arm, seed=seed, precision="bf16", inputs=link,
                     cfg=FakeStageConfig(arm=arm, seed=seed, tag=f"evaluate-{train}"),
                     metrics={"micro_f1": float(ev["micro_f1"].mean())}, tables={"per_note_metrics": ev},
                     tags={"mistill.split": "test"})
        o = make_run(tracking_uri, corpus, "own_heads", root, arm=arm, seed=seed, precision="bf16", inputs=link,
                     cfg=FakeStageConfig(arm=arm, seed=seed, tag=f"own-{train}"),
                     metrics={"m4/P2C/k40/recovery_own": float(own["recovery_own"].median())},
                     tables={"own_heads_per_note": own}, tags={"mistill.split": "test"})
        return e, o

    wobble = {s: np.round(np.random.default_rng(40 + s).normal(0, 0.01, len(NOTES)), 4) for s in SEEDS}
    for arm in ("mistill", "randheads"):
        for seed in SEEDS:
            train = trained(arm, seed, PICK[arm])
            own = _own_rows(LIFT[seed], wobble[seed]) if arm == "mistill" else _own_rows(0.0, np.zeros(len(NOTES)))
            ev = _eval_rows(seed, 1 if arm == "mistill" else 0)
            ids["train"][(arm, seed)] = train
            ids["evaluate"][(arm, seed)], ids["own"][(arm, seed)] = read(arm, seed, train, own, ev)
            ids["per_note"][(arm, seed)] = (own, ev)
    # decoys: a RandHeads run on another pool at the same λ, and the main Mistill arm at another λ
    decoys = {("randheads", 1): trained("randheads", 1, 0.3, pool_seed=1), ("mistill", 1): trained("mistill", 1, 0.1)}
    for (arm, seed), train in decoys.items():
        read(arm, seed, train, _own_rows(-0.5, np.zeros(len(NOTES))), _eval_rows(seed, 5))
    for arm in ("mistill", "randheads"):
        lock, results = _cells_and_results(arm)
        d = decide(lock, results)
        rows = []
        for cell, res in sorted(results.items()):
            lam = cell.lambdas[0]
            rows.append({"cell": cell.key, "lambda_p1": lam, "lambda_p2": lam, "in_grid": cell in d.grid,
                         "state": "complete", "micro_f1": res.metric, "m1/P2C/p_pos": res.tie_break,
                         "valid_rate": res.validity, "gap_to_best": repr(d.gaps.get(cell, math.nan)),
                         "in_band": cell in d.tied, "picked": cell == d.pick,
                         "train_run": ids["train"][(arm, 0)] if cell == d.pick else None, "evaluate_run": None})
        make_run(tracking_uri, corpus, "select_lambda", root, arm=arm, seed=0,
                 tables={"cells": pd.DataFrame(rows)},
                 jsons={"decision": {"lock": lock.to_dict(), "decision": d.to_dict()}})
    mp = pytest.MonkeyPatch()
    mp.setenv("MISTILL_ROOT", str(tmp_path_factory.mktemp("reader")))
    try:
        client = MlflowClient()
        inputs = collect_inputs(client, f"mistill/{corpus}", reference_arm="vanilla-bf16")
        rep = build_report(inputs, reference_arm="vanilla-bf16", n_resamples=BOOT, corpus_resamples=BOOT,
                           seed=3, client=client)
    finally:
        mp.undo()
    return {t.name: t for t in rep.tables}, ids


def test_the_validation_cells_mark_the_locked_and_the_sensitivity_picks(matched):
    tables, _ = matched
    t = tables["table52_validation"].numeric
    assert len(t) == 8 and set(t["arm"]) == {"mistill", "randheads"}
    picks = {arm: float(g.loc[g["locked_pick"], "lambda_p1"].iloc[0]) for arm, g in t.groupby("arm")}
    assert picks == PICK  # App. M.2: 0.03 and 0.3
    band = {arm: float(g.loc[g["band_pick"], "lambda_p1"].iloc[0]) for arm, g in t.groupby("arm")}
    assert band == {"mistill": 0.1, "randheads": 0.03}  # the 0.005 band: 0.1 and 0.03
    # RandHeads' 0.005 pick sits on the lower edge and its extension was never run
    rand_note = t.loc[t["arm"] == "randheads", "note"].iloc[0]
    assert "lambda=0.01" in rand_note and "not run" in rand_note
    gap = t[(t["arm"] == "mistill") & (t["lambda_p1"] == 0.1)]["gap_to_best"].iloc[0]
    assert gap == pytest.approx(0.0040204002, abs=1e-12)
    shown = tables["table52_validation"].display
    assert "0.03 ⋆" in set(shown["λ"]) and "0.1 †" in set(shown["λ"]) and "0.3 ⋆" in set(shown["λ"])
    assert "0.0040204002" in set(shown["gap to best"])
    assert "⋆" in to_markdown(shown) and "†" in to_latex(shown)


def test_the_test_cells_are_the_six_pick_runs_with_medians_and_floors(matched):
    tables, ids = matched
    t = tables["table52_test"].numeric
    assert sorted(zip(t["arm"], t["seed"])) == [(a, s) for a in ("mistill", "randheads") for s in SEEDS]
    assert set(t["train_run"]) == {ids["train"][k] for k in ids["train"]}  # no decoy
    for _, row in t.iterrows():
        own, ev = ids["per_note"][(row["arm"], int(row["seed"]))]
        cell = own[(own["phase"] == "P2C") & (own["k"] == 40)]
        assert row["own_own"] == pytest.approx(float(np.median(cell["recovery_own"])), abs=1e-12)
        assert row["own_random"] == pytest.approx(float(np.median(cell["recovery_random"])), abs=1e-12)
        assert row["micro_f1"] == pytest.approx(float(ev["micro_f1"].mean()), abs=1e-12)
        assert row["lambda"] == f"{PICK[row['arm']]:g}"
    shown = tables["table52_test"].display
    assert shown["own P2C k40 (random)"].str.match(r"^\d\.\d{3} \(\d\.\d{3}\)$").all()


def test_the_paired_rows_are_note_clustered_seed_pair_means(matched):
    tables, ids = matched
    t = tables["table52_paired"].numeric.set_index("measure")
    for measure, phase, k in (("own-heads P2C recovery, k=40", "P2C", 40), ("own-heads P2C recovery, k=8", "P2C", 8),
                              ("own-heads P1 recovery, k=40", "P1", 40)):
        per_pair = []
        for s in SEEDS:
            a, r = (ids["per_note"][(arm, s)][0] for arm in ("mistill", "randheads"))
            sel = [x[(x["phase"] == phase) & (x["k"] == k)].set_index("note_id")["recovery_own"] for x in (a, r)]
            per_pair.append(sel[0] - sel[1])
        per_note = pd.concat(per_pair, axis=1).mean(axis=1)
        row = t.loc[measure]
        assert row["n_pairs"] == 3 and row["n"] == len(NOTES)
        assert row["mean_diff"] == pytest.approx(float(per_note.mean()), abs=1e-12)
        assert (row["n_higher"], row["n_lower"]) == (int((per_note > 0).sum()), int((per_note < 0).sum()))
        assert row["per_pair"] == ", ".join(f"{float(d.mean()):+.3f}" for d in per_pair)
        if phase == "P2C":
            assert row["ci_low"] <= row["mean_diff"] <= row["ci_high"] and row["ci_low"] > 0
    # the task, per note and at corpus level (each side's seeds' pooled micro-F1 averaged)
    diffs = [ids["per_note"][("mistill", s)][1]["micro_f1"] - ids["per_note"][("randheads", s)][1]["micro_f1"]
             for s in SEEDS]
    assert t.loc["task micro-F1 (per note)", "mean_diff"] == pytest.approx(float(pd.concat(diffs, axis=1)
                                                                                .mean(axis=1).mean()), abs=1e-12)

    def corpus(ev: pd.DataFrame) -> float:
        tp, fp, fn = (float(ev[c].sum()) for c in ("tp", "fp", "fn"))
        return 2 * tp / (2 * tp + fp + fn)

    pairs = [corpus(ids["per_note"][("mistill", s)][1]) - corpus(ids["per_note"][("randheads", s)][1]) for s in SEEDS]
    row = t.loc["corpus micro-F1"]
    assert row["mean_diff"] == pytest.approx(float(np.mean(pairs)), abs=1e-12) and row["n_pairs"] == 3
    assert row["per_pair"] == ", ".join(f"{d:+.3f}" for d in pairs)
    shown = tables["table52_paired"].display
    shown = shown.set_index("measure")
    k40 = t.loc["own-heads P2C recovery, k=40"]
    assert shown.loc["own-heads P2C recovery, k=40", "Δ mean [95% CI]"] == \
        f"{k40['mean_diff']:+.3f} [{k40['ci_low']:+.3f}, {k40['ci_high']:+.3f}]"
    shown = shown.reset_index()
    assert "mistill − randheads" in to_latex(shown) and "corpus micro-F1" in to_markdown(shown)


@dataclasses.dataclass(frozen=True)
class _SelectionConfig(Config):
    arm: str = ""
    seed: int = 0
    lock: str = ""


def test_a_selection_is_its_locks_two_of_one_arm_and_seed_both_reach_the_report(tracking_uri, tmp_path):
    """App. I.3's selection and App. M.2's matched one are both Mistill at seed 0: the report keeps
    one run per lock (the newest of each), not one per arm and seed."""
    corpus = unique("two-locks")
    locks = ("projects/configs/locks/i3-bf16-selection.yaml", "projects/configs/locks/m2-matched-mistill.yaml")
    made = [make_run(tracking_uri, corpus, "select_lambda", tmp_path, arm="mistill", seed=0, precision="bf16",
                     cfg=_SelectionConfig(arm="mistill", seed=0, lock=lock)) for lock in (*locks, locks[0])]
    inputs = collect_inputs(MlflowClient(), f"mistill/{corpus}")
    kept = inputs.runs["select_lambda"]
    assert sorted(kept["run_id"]) == sorted(made[1:])  # the newer run of the repeated lock, and the other lock's
    assert set(kept["params.lock"]) == set(locks)
