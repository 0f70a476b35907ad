"""App. O's readings by hand: seed-paired differences per question, the mean over questions with a
bootstrap over base-question groups, the locked criteria and the per-checkpoint table."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.public_task_tables import checkpoint_table, gate_table, readings_table, seed_paired_differences
from mistill import stats
from mistill.errors import MistillInputError


def _own(arm: str, seed: int, values: dict[str, float]) -> list[dict]:
    return [{"model": "s", "arm": arm, "precision": "bf16", "seed": seed, "note_id": q, "phase": "P2", "k": 40,
             "recovery_own": v} for q, v in values.items()]


def test_group_bootstrap_resamples_groups_not_items():
    values = {"a1": 1.0, "a2": 1.0, "a3": 1.0, "b1": 0.0}
    groups = {"a1": "a", "a2": "a", "a3": "a", "b1": "b"}
    ci = stats.group_bootstrap_mean(values, groups, n_resamples=2000, seed=0)
    assert ci.estimate == pytest.approx(0.75)  # the mean over items, each item once
    # a resample holds group a twice, a and b, or b twice: means 1, 0.75 and 0 only
    assert ci.low == pytest.approx(0.0) and ci.high == pytest.approx(1.0)
    same = stats.group_bootstrap_mean({"x": 0.2, "y": 0.2}, {"x": "g", "y": "h"}, n_resamples=100)
    assert (same.estimate, same.low, same.high) == pytest.approx((0.2, 0.2, 0.2))
    with pytest.raises(MistillInputError) as err:
        stats.group_bootstrap_mean({"x": 1.0}, {}, n_resamples=10)
    assert (err.value.note, err.value.field) == ("x", "groups")


def test_readings_pair_seeds_by_question_on_the_common_support():
    own = pd.DataFrame(_own("mistill", 0, {"q1": 0.5, "q2": 0.4, "q3": np.nan})
                       + _own("mistill", 1, {"q1": 0.7, "q2": 0.2, "q3": 0.3})
                       + _own("vanilla-bf16", 0, {"q1": 0.4, "q2": 0.4, "q3": 0.1})
                       + _own("vanilla-bf16", 1, {"q1": 0.5, "q2": 0.4, "q3": 0.1})
                       + _own("randheads", 0, {"q1": 0.9, "q2": 0.9, "q3": 0.9}))
    diffs, pairs = seed_paired_differences(own[own["arm"] == "mistill"], own[own["arm"] == "vanilla-bf16"],
                                           "recovery_own")
    # q3 is recovered in seed pair 1 only (seed 0's Mistill value is gated out)
    assert diffs == pytest.approx({"q1": 0.15, "q2": -0.1, "q3": 0.2})
    assert pairs == pytest.approx({0: 0.05, 1: (0.2 - 0.2 + 0.2) / 3})
    answers = pd.DataFrame([{"model": "s", "arm": arm, "precision": "bf16", "seed": 0, "note_id": q,
                             "answer_f1": v} for arm, vals in (("mistill", (1.0, 0.5, 0.0)),
                                                               ("vanilla-bf16", (1.0, 0.0, 0.0)))
                            for q, v in zip(("q1", "q2", "q3"), vals)])
    groups = {"q1": "g1", "q2": "g1", "q3": "g2"}
    table = readings_table(own, answers, groups, n_resamples=200).set_index(["reading", "reference"])
    primary = table.loc[("(1) own-heads P2 recovery, k=40", "vanilla-bf16")]
    assert primary["estimate"] == pytest.approx(0.25 / 3) and (primary["n_questions"], primary["n_groups"]) == (3, 2)
    assert primary["criterion"] == "lower bound > 0" and primary["met"] == (primary["ci_low"] > 0)
    secondary = table.loc[("(1) own-heads P2 recovery, k=40", "randheads")]  # seed 0 only; no criterion
    assert secondary["estimate"] == pytest.approx(np.mean([0.5 - 0.9, 0.4 - 0.9]))
    assert secondary["n_seed_pairs"] == 1 and secondary["met"] is None
    f1 = table.loc[("(2) answer F1", "vanilla-bf16")]
    assert f1["estimate"] == pytest.approx(0.5 / 3) and f1["criterion"] == "lower bound > -0.02"
    runs = pd.DataFrame([{"model": "s", "arm": a, "precision": "bf16", "seed": 0, "valid_rate": r}
                         for a, r in (("mistill", 1.0), ("vanilla-bf16", 0.5))])
    per = checkpoint_table(own, answers, runs).set_index(["arm", "seed"])
    assert per.loc[("mistill", 0), "answer_f1"] == pytest.approx(0.5)
    assert per.loc[("mistill", 0), "recovery_own"] == pytest.approx(0.45)
    assert per.loc[("mistill", 0), "n_recovered"] == 2 and per.loc[("vanilla-bf16", 0), "valid_rate"] == 0.5


def test_the_gate_reads_each_setting_per_pair_in_both_weightings():
    """Table 58: per pair P in each setting; E_P = sham - target, E_P^rand = the random draws' mean -
    target; equal-group averages the group means (a group of two pairs weighs as one of one pair),
    equal-pair the pairs."""
    p = {"clean": [1.0, 0.5, 0.0], "sham": [1.0, 1.0, 0.5], "target": [0.5, 0.5, 0.5],
         "random1": [1.0, 0.5, 0.5], "random2": [0.5, 0.5, 1.0]}
    groups = ["g1", "g1", "g2"]
    rows = pd.DataFrame([{"case_id": f"c{i}", "group": groups[i], "setting": k, "paired_success": v[i]}
                         for k, v in p.items() for i in range(3)])
    table = gate_table(rows, n_resamples=100).set_index(["statistic", "weighting"])
    assert table.loc[("clean P", "equal-pair"), "estimate"] == pytest.approx(0.5)
    assert table.loc[("clean P", "equal-group"), "estimate"] == pytest.approx((0.75 + 0.0) / 2)
    e_p = np.array(p["sham"]) - np.array(p["target"])  # 0.5, 0.5, 0
    assert table.loc[("E_P (sham - target)", "equal-pair"), "estimate"] == pytest.approx(e_p.mean())
    assert table.loc[("E_P (sham - target)", "equal-group"), "estimate"] == pytest.approx((0.5 + 0.0) / 2)
    rand = (np.array(p["random1"]) + np.array(p["random2"])) / 2 - np.array(p["target"])  # 0.25, 0, 0.25
    assert table.loc[("E_P^rand (random - target)", "equal-pair"), "estimate"] == pytest.approx(rand.mean())
    assert set(table["n_pairs"]) == {3} and set(table["n_groups"]) == {2}
    assert gate_table(rows[rows["setting"] != "sham"], n_resamples=10)["statistic"].tolist().count(
        "E_P (sham - target)") == 0  # a reading whose settings are missing is left out
