"""The public-task extension's readings (App. O, Tables 56 and 57) from MuSiQue-Ans runs.

* :func:`readings_table` (Table 56, readings 1 and 2): each compared arm minus the reference arm,
  seed i against seed i. Per question, the difference of the own-heads final-line P2 recovery at
  k = 40 (``own_heads`` runs' per-note rows; a question counts where both runs of a seed pair
  recover it, the common support) or of the answer F1 (``evaluate`` runs' per-note rows), averaged
  over the seed pairs that have it; the estimate is the mean over questions with a percentile
  bootstrap over base-question groups (the notes' ``patient_id``,
  :func:`mistill.tasks.musique.question_group`), and both counts are reported. The locked
  criteria: recovery, lower bound above 0 (Mistill against Vanilla CoT-KD); answer F1, lower
  bound above -0.02.
  Reading 3: the paired correctness ``P`` per evidence pair (``flip_test`` runs' per-case
  ``paired_success`` on the pair cohort: success on the original and on the flipped input at the
  same sample index, over the N samples), seed-paired the same way and resampled by the pairs'
  base-question groups; the locked criterion, lower bound above 0.
* :func:`checkpoint_table` (Table 57): per checkpoint (model, arm, precision, seed), the answer F1
  and valid-answer rate of its ``evaluate`` run, the mean own-heads P2 recovery at k = 40 over
  the questions its ``own_heads`` run recovers, and its paired correctness over the pairs.

* :func:`gate_table` (Table 58, reading 4): the teacher's prefill-inclusive evidence-key mask on
  the pairs, from its clean, sham-, target- and random-masked ``flip_test`` runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from mistill import stats
from mistill.errors import MistillInputError

__all__ = ["READING_PHASE", "READING_K", "READING_COLUMNS", "CHECKPOINT_COLUMNS", "GATE_COLUMNS",
           "seed_paired_differences", "readings_table", "checkpoint_table", "gate_table"]

READING_PHASE = "P2"
"""The answer-emission event's phase: the task's one phase."""
READING_K = 40
"""The own top-k of reading 1."""
CRITERIA: Mapping[str, float] = {"recovery": 0.0, "answer_f1": -0.02, "paired_correctness": 0.0}
"""The locked criteria: the lower bound must lie above these (recovery; answer F1; paired
correctness on the evidence pairs)."""

READING_COLUMNS: tuple[str, ...] = ("reading", "arm", "reference", "estimate", "ci_low", "ci_high", "n_questions",
                                    "n_groups", "n_seed_pairs", "seed_pairs", "criterion", "met")
CHECKPOINT_COLUMNS: tuple[str, ...] = ("model", "arm", "precision", "seed", "answer_f1", "valid_rate", "n_questions",
                                       "recovery_own", "n_recovered", "paired_correctness", "n_pairs")


def seed_paired_differences(arm: pd.DataFrame, ref: pd.DataFrame, value: str) -> tuple[dict[str, float], dict]:
    """``({question: mean over seed pairs of arm - ref}, {seed: that pair's mean difference})``:
    ``arm`` and ``ref`` hold ``seed, note_id`` and ``value``; a seed both have is a pair, and a
    question enters a pair where both values are finite."""
    by_q: dict[str, list[float]] = {}
    per_pair: dict = {}
    for seed in sorted(set(arm["seed"]) & set(ref["seed"])):
        a = arm[arm["seed"] == seed].groupby("note_id")[value].mean()
        r = ref[ref["seed"] == seed].groupby("note_id")[value].mean()
        d = (a - r).dropna()
        if d.empty:
            continue
        per_pair[seed] = float(d.mean())
        for q, v in d.items():
            by_q.setdefault(str(q), []).append(float(v))
    return {q: float(np.mean(v)) for q, v in by_q.items()}, per_pair


def _reading(name: str, criterion_key: str, arm: str, reference: str, diffs: dict[str, float], per_pair: dict,
             groups: Mapping[str, str], n_resamples: int, seed: int, locked: bool) -> dict:
    ci = stats.group_bootstrap_mean(diffs, groups, n_resamples=n_resamples, seed=seed)
    bound = CRITERIA[criterion_key]
    return {"reading": name, "arm": arm, "reference": reference, "estimate": ci.estimate, "ci_low": ci.low,
            "ci_high": ci.high, "n_questions": len(diffs), "n_groups": len({groups[q] for q in diffs}),
            "n_seed_pairs": len(per_pair), "seed_pairs": ", ".join(f"{s}: {v:+.3f}" for s, v in per_pair.items()),
            "criterion": f"lower bound > {bound:g}" if locked else "secondary (no criterion)",
            "met": bool(ci.low > bound) if locked else None}


def readings_table(own: pd.DataFrame, answers: pd.DataFrame, groups: Mapping[str, str], *,
                   pair_rows: pd.DataFrame | None = None,
                   reference: str = "vanilla-bf16", primary: str = "mistill", secondary: Sequence[str] = ("randheads",),
                   k: int = READING_K, n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """Table 56's readings 1 to 3 (module docstring). ``own``: ``own_heads`` per-note rows with
    ``arm, seed, note_id, phase, k, recovery_own``; ``answers``: ``evaluate`` per-note rows with
    ``arm, seed, note_id, answer_f1``; ``groups``: question -> base-question group; ``pair_rows``:
    ``flip_test`` per-case rows with ``arm, seed, case_id, paired_success, group``. The primary
    arm against the reference carries the locked criteria; the primary arm is also read against
    each ``secondary`` arm on recovery and on paired correctness (no criterion). A comparison
    without a seed pair is left out."""
    rows = []
    own = own[(own["phase"] == READING_PHASE) & (own["k"].astype(int) == k)] if not own.empty else own
    if not own.empty:
        comparisons = [(reference, True)] + [(other, False) for other in secondary]
        for ref, locked in comparisons:
            diffs, pairs = seed_paired_differences(own[own["arm"] == primary], own[own["arm"] == ref],
                                                   "recovery_own")
            if diffs:
                rows.append(_reading(f"(1) own-heads {READING_PHASE} recovery, k={k}", "recovery", primary, ref,
                                     diffs, pairs, groups, n_resamples, seed, locked))
    if not answers.empty:
        diffs, pairs = seed_paired_differences(answers[answers["arm"] == primary],
                                               answers[answers["arm"] == reference], "answer_f1")
        if diffs:
            rows.append(_reading("(2) answer F1", "answer_f1", primary, reference, diffs, pairs, groups,
                                 n_resamples, seed, True))
    if pair_rows is not None and not pair_rows.empty:
        by_case = pair_rows.rename(columns={"case_id": "note_id"})
        pair_groups = dict(zip(by_case["note_id"].astype(str), by_case["group"].astype(str)))
        for ref, locked in [(reference, True)] + [(other, False) for other in secondary]:
            diffs, per_pair = seed_paired_differences(by_case[by_case["arm"] == primary], by_case[by_case["arm"] == ref],
                                                      "paired_success")
            if diffs:
                rows.append(_reading("(3) paired correctness on the evidence pairs", "paired_correctness", primary,
                                     ref, diffs, per_pair, pair_groups, n_resamples, seed, locked))
    return pd.DataFrame(rows, columns=list(READING_COLUMNS))


def checkpoint_table(own: pd.DataFrame, answers: pd.DataFrame, eval_runs: pd.DataFrame,
                     k: int = READING_K, pair_rows: pd.DataFrame | None = None) -> pd.DataFrame:
    """Table 57 (module docstring): one row per checkpoint with an ``evaluate``, ``own_heads`` or
    ``flip_test`` run. ``eval_runs``: the evaluate runs' rows (``model, arm, precision, seed`` and
    ``valid_rate``); ``pair_rows``: the flip_test runs' per-case rows (``paired_success``)."""
    key = ["model", "arm", "precision", "seed"]
    cells: dict[tuple, dict] = {}
    if not answers.empty:
        for cell, grp in answers.groupby(key, sort=True, dropna=False):
            cells.setdefault(cell, {})["answer_f1"] = float(grp["answer_f1"].mean())
            cells[cell]["n_questions"] = int(grp["note_id"].nunique())
    if not eval_runs.empty and "valid_rate" in eval_runs:
        for cell, grp in eval_runs.groupby(key, sort=True, dropna=False):
            cells.setdefault(cell, {})["valid_rate"] = float(grp["valid_rate"].mean())
    if not own.empty:
        sel = own[(own["phase"] == READING_PHASE) & (own["k"].astype(int) == k)]
        for cell, grp in sel.groupby(key, sort=True, dropna=False):
            per_q = grp.groupby("note_id")["recovery_own"].mean().dropna()
            cells.setdefault(cell, {})["recovery_own"] = float(per_q.mean()) if len(per_q) else np.nan
            cells[cell]["n_recovered"] = len(per_q)
    if pair_rows is not None and not pair_rows.empty:
        for cell, grp in pair_rows.groupby(key, sort=True, dropna=False):
            cells.setdefault(cell, {})["paired_correctness"] = float(grp["paired_success"].mean())
            cells[cell]["n_pairs"] = int(grp["case_id"].nunique())
    if not cells:
        raise MistillInputError("no evaluate, own_heads or flip_test rows of a MuSiQue-Ans experiment", field="runs")
    out = [{**dict(zip(key, cell)), **vals} for cell, vals in sorted(cells.items(), key=lambda kv: str(kv[0]))]
    return pd.DataFrame(out).reindex(columns=list(CHECKPOINT_COLUMNS))


GATE_COLUMNS: tuple[str, ...] = ("statistic", "weighting", "estimate", "ci_low", "ci_high", "n_pairs", "n_groups")
"""Table 58's columns."""


def _weighted(values: Mapping[str, float], groups: Mapping[str, str], weighting: str, n_resamples: int,
              seed: int) -> stats.CI:
    """The mean of per-pair ``values``: ``equal-group`` (the mean of per-group means, bootstrap over
    the groups' means) or ``equal-pair`` (the mean over pairs, groups resampled)."""
    if weighting == "equal-pair":
        return stats.group_bootstrap_mean(values, groups, n_resamples=n_resamples, seed=seed)
    by_group: dict[str, list[float]] = {}
    for pair, v in values.items():
        by_group.setdefault(str(groups[pair]), []).append(float(v))
    means = np.array([np.mean(v) for _, v in sorted(by_group.items())])
    return stats.bootstrap_ci(means, n_resamples=n_resamples, seed=seed)


def gate_table(rows: pd.DataFrame, *, n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """Table 58, the teacher's evidence-mask gate on the evidence pairs (App. O, reading 4). ``rows``:
    per pair and setting (``case_id, group, setting, paired_success``; settings ``clean``, ``sham``,
    ``target`` and ``random<n>``, the layer-matched random draws under the target mask). Per pair
    ``P`` is the paired correctness; the readings are the clean ``P``, ``E_P = P_sham - P_target``
    and ``E_P^rand = P_random - P_target`` (the draws' mean), each in the recorded equal-group
    weighting and the equal-pair sensitivity, with percentile bootstraps over groups; a reading
    whose settings are missing is left out."""
    if rows.empty:
        return pd.DataFrame(columns=list(GATE_COLUMNS))
    wide = rows.pivot_table(index="case_id", columns="setting", values="paired_success", aggfunc="mean")
    groups = dict(zip(rows["case_id"].astype(str), rows["group"].astype(str)))
    randoms = [c for c in wide.columns if str(c).startswith("random")]
    readings: dict[str, pd.Series] = {}
    if "clean" in wide:
        readings["clean P"] = wide["clean"]
    if {"sham", "target"} <= set(wide.columns):
        readings["E_P (sham - target)"] = wide["sham"] - wide["target"]
    if randoms and "target" in wide:
        readings["E_P^rand (random - target)"] = wide[randoms].mean(axis=1) - wide["target"]
    out = []
    for name, series in readings.items():
        values = {str(k): float(v) for k, v in series.dropna().items()}
        if not values:
            continue
        for weighting in ("equal-group", "equal-pair"):
            ci = _weighted(values, groups, weighting, n_resamples, seed)
            out.append({"statistic": name, "weighting": weighting, "estimate": ci.estimate, "ci_low": ci.low,
                        "ci_high": ci.high, "n_pairs": len(values), "n_groups": len({groups[p] for p in values})})
    return pd.DataFrame(out, columns=list(GATE_COLUMNS))
