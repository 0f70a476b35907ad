"""Table 54: the evidence-flip test's behavioural half (App. N.3, R-D33), from ``flip_test`` runs.

:func:`flip_behaviour_table`: one row per checkpoint (the newest ``flip_test`` run of each cohort,
model, arm, precision and seed): ``D`` with its case-clustered interval, ``s``, the follow rates,
paired success, the two control statistics per control, invalid outputs, the decomposition of
``D`` and the category-level ``D``, as each run logged them (``flip/*`` metrics).

:func:`flip_contrasts_table`: the locked seed-pair contrasts (:data:`FLIP_CONTRASTS`): per case
the seed-matched differences in ``D`` averaged over the seed pairs, then a case-clustered
percentile bootstrap and an exact sign test over cases (:func:`mistill.stats.note_clustered`
with the case as the unit), with each seed pair's mean difference beside it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pandas as pd

from analysis import query
from mistill import stats
from mistill.evaluation.flip_test import CASE_READINGS

FLIP_RUN_KEY: tuple[str, ...] = ("params.cohort_run", *query.RUN_KEY)
"""One checkpoint on one cohort."""

FLIP_CONTRASTS: tuple[tuple[str, tuple[str, str], tuple[str, str]], ...] = (
    ("primary", ("mistill", "bf16"), ("vanilla-bf16", "bf16")),
    ("secondary", ("mistill-fp32", "fp32"), ("vanilla-fp32", "fp32")),
)
"""App. N.1's locked comparisons, ``(name, (arm, precision), (reference arm, precision))``: bf16
Mistill minus bf16 Vanilla CoT-KD over seeds 0-2 (primary), the fp32 pair at λ 0.01 (secondary)."""

BEHAVIOUR_COLUMNS = ("run_id", "cohort_run", *query.RUN_KEY, "n_cases", "D", "D_lo", "D_hi", *(
    r for r in CASE_READINGS if r not in ("D", "D_category")), "D_category", "D_category_lo", "D_category_hi",
    "n_cases_category")
CONTRAST_COLUMNS = ("contrast", "cohort_run", "arm", "reference", "precision", "seed_pairs", "n_cases", "mean_diff",
                    "ci_low", "ci_high", "median_diff", "cases_higher", "cases_lower", "cases_tied", "sign_p",
                    "per_pair")


def latest_flip_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The newest ``flip_test`` run (read with the param ``cohort_run``) of each checkpoint on
    each cohort."""
    return runs if runs.empty else query.latest_runs(runs, FLIP_RUN_KEY)


def flip_behaviour_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Table 54's checkpoint rows (:data:`BEHAVIOUR_COLUMNS`) from :func:`latest_flip_runs`."""
    rows = []
    for _, run in runs.iterrows():
        rec = {"run_id": run["run_id"], "cohort_run": run["params.cohort_run"],
               **{c: run.get(c) for c in query.RUN_KEY}}
        for col in BEHAVIOUR_COLUMNS[len(query.RUN_KEY) + 2:]:
            rec[col] = run.get(f"flip/{col}", float("nan"))
        rows.append(rec)
    return pd.DataFrame.from_records(rows, columns=list(BEHAVIOUR_COLUMNS))


def _case_d(cases: pd.DataFrame, run_id: str) -> dict[Hashable, float]:
    part = cases[cases["run_id"] == run_id]
    return {str(c): float(d) for c, d in zip(part["case_id"], part["D"], strict=True)}


def flip_contrasts_table(runs: pd.DataFrame, cases: pd.DataFrame, *, n_resamples: int = stats.N_BOOTSTRAP,
                         seed: int = 0, contrasts: Sequence = FLIP_CONTRASTS) -> pd.DataFrame:
    """The locked contrasts (:data:`CONTRAST_COLUMNS`) per cohort with runs on both sides.

    runs: :func:`latest_flip_runs`; cases: their ``flip_cases`` tables stacked (``run_id``,
    ``case_id``, ``D``)."""
    rows = []
    for cohort, group in runs.groupby("params.cohort_run", sort=True):
        for name, (arm, precision), (ref, ref_precision) in contrasts:
            def side(a: str, p: str) -> dict[int, dict[Hashable, float]]:
                sel = group[(group["arm"] == a) & (group["precision"].fillna("") == p) & group["seed"].notna()]
                return {int(r["seed"]): _case_d(cases, r["run_id"]) for _, r in sel.iterrows()}

            mine, theirs = side(arm, precision), side(ref, ref_precision)
            if not mine or not theirs:
                continue
            pairs = stats.seed_matched_pairs(mine, theirs)
            diffs = {p: stats.per_note_differences(a, b) for p, (a, b) in pairs.items()}
            result = stats.note_clustered(diffs, n_resamples=n_resamples, seed=seed)
            o = result.overall
            per_pair = "; ".join(f"s{a}-s{b} {result.per_pair[(a, b)].mean_diff:+.3f}"
                                 for a, b in sorted(result.per_pair))
            rows.append({"contrast": name, "cohort_run": cohort, "arm": arm, "reference": ref, "precision": precision,
                         "seed_pairs": len(pairs), "n_cases": o.n, "mean_diff": o.mean_diff, "ci_low": o.ci_low,
                         "ci_high": o.ci_high, "median_diff": o.median_diff, "cases_higher": o.n_higher,
                         "cases_lower": o.n_lower, "cases_tied": o.n_tied, "sign_p": o.sign_p, "per_pair": per_pair})
    return pd.DataFrame.from_records(rows, columns=list(CONTRAST_COLUMNS))


__all__ = ["FLIP_RUN_KEY", "FLIP_CONTRASTS", "BEHAVIOUR_COLUMNS", "CONTRAST_COLUMNS", "latest_flip_runs",
           "flip_behaviour_table", "flip_contrasts_table"]
