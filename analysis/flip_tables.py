"""Tables 54 and 55: the evidence-flip test (App. N; R-D33, R-D34), from ``flip_test`` runs.

A ``flip_test`` run is read as one of three kinds (:func:`flip_runs`): the behavioural half's
run (no mask, sampled by the generation path, ``backend`` ``auto`` or ``vllm``), the causal half's
clean reference (no mask, ``backend=hf``) or a masked run (``mask`` ``target`` or ``sham``, HF),
whose nominated heads are labelled ``named`` (``mask_heads``) or ``top<k> <phase>`` (a ranking).

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

FLIP_PARAMS: tuple[str, ...] = ("cohort_run", "backend", "mask", "mask_heads", "mask_heads_run", "mask_phase",
                                 "mask_k", "mask_regime", "mask_random")
"""The ``flip_test`` params the tables read (``query.stage_runs(..., params=FLIP_PARAMS)``)."""

FLIP_RUN_KEY: tuple[str, ...] = ("params.cohort_run", *query.RUN_KEY, "kind", "mask", "heads")
"""One checkpoint on one cohort, one kind of run, one mask on one head set."""

BEHAVIOUR, CLEAN_HF, MASKED = "behaviour", "clean_hf", "masked"

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


def _heads_label(run: pd.Series) -> str:
    """The masked head set: ``named``, or ``top<k> <phase>``; a prefill-inclusive mask adds
    ``prefill`` and a layer-matched random draw ``random<n>`` (App. O's gate)."""
    if not run.get("params.mask"):
        return ""
    label = "named" if run.get("params.mask_heads") else f"top{run.get('params.mask_k')} {run.get('params.mask_phase')}"
    if _text(run.get("params.mask_regime")) == "prefill":
        label += " prefill"
    if _text(run.get("params.mask_random")) not in ("", "0"):
        label += f" random{run.get('params.mask_random')}"
    return label


def flip_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The newest ``flip_test`` run (read with :data:`FLIP_PARAMS`) of each checkpoint, kind, mask
    and head set on each cohort, with the columns ``kind``, ``mask`` and ``heads``."""
    if runs.empty:
        return runs
    runs = runs.copy()
    runs["mask"] = runs["params.mask"].fillna("").astype(str)
    runs["heads"] = [_heads_label(r) for _, r in runs.iterrows()]
    backend = runs["params.backend"].fillna("auto").astype(str)
    runs["kind"] = [MASKED if m else CLEAN_HF if b == "hf" else BEHAVIOUR for m, b in zip(runs["mask"], backend)]
    return query.latest_runs(runs, FLIP_RUN_KEY)


def behaviour_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The behavioural half's runs (Table 54) among :func:`flip_runs`' result."""
    return runs if runs.empty else runs[runs["kind"] == BEHAVIOUR].reset_index(drop=True)


def flip_behaviour_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Table 54's checkpoint rows (:data:`BEHAVIOUR_COLUMNS`) from :func:`behaviour_runs`."""
    rows = []
    for _, run in runs.iterrows():
        rec = {"run_id": run["run_id"], "cohort_run": run["params.cohort_run"],
               **{c: run.get(c) for c in query.RUN_KEY}}
        for col in BEHAVIOUR_COLUMNS[len(query.RUN_KEY) + 2:]:
            rec[col] = run.get(f"flip/{col}", float("nan"))
        rows.append(rec)
    return pd.DataFrame.from_records(rows, columns=list(BEHAVIOUR_COLUMNS))


def _per_case(cases: pd.DataFrame, run_id: str) -> pd.Series:
    """One run's ``D`` per case (index: case ids as strings)."""
    part = cases[cases["run_id"] == run_id]
    return pd.Series(part["D"].to_numpy(dtype=float), index=part["case_id"].astype(str).to_numpy())


def _text(value) -> str:
    """A cell as :func:`_rows` compares it: missing (None, NaN, NA) as ``""``, else its string."""
    return "" if value is None or (not isinstance(value, str) and pd.isna(value)) else str(value)


def _rows(group: pd.DataFrame, **match) -> pd.DataFrame:
    """The runs of ``group`` whose columns hold the values ``match`` names, compared as strings
    (a missing value as ``""``: a run without a precision matches ``precision=""``)."""
    keep = pd.Series(True, index=group.index)
    for column, value in match.items():
        keep &= group[column].map(_text) == _text(value)
    return group[keep]


def flip_contrasts_table(runs: pd.DataFrame, cases: pd.DataFrame, *, n_resamples: int = stats.N_BOOTSTRAP,
                         seed: int = 0, contrasts: Sequence = FLIP_CONTRASTS) -> pd.DataFrame:
    """The locked contrasts (:data:`CONTRAST_COLUMNS`) per cohort with runs on both sides.

    runs: :func:`behaviour_runs`; cases: their ``flip_cases`` tables stacked (``run_id``,
    ``case_id``, ``D``)."""
    rows = []
    for cohort, group in runs.groupby("params.cohort_run", sort=True):
        for name, (arm, precision), (ref, ref_precision) in contrasts:
            def side(a: str, p: str) -> dict[int, dict[Hashable, float]]:
                sel = _rows(group, arm=a, precision=p)
                return {int(r["seed"]): _per_case(cases, r["run_id"]).to_dict()
                        for _, r in sel[sel["seed"].notna()].iterrows()}

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


CAUSAL_COLUMNS = ("cohort_run", *query.RUN_KEY, "heads", "n_cases", "D_clean", "delta_target", "delta_target_low",
                  "delta_target_high", "delta_sham", "delta_sham_low", "delta_sham_high", "target_minus_sham",
                  "target_minus_sham_low", "target_minus_sham_high", "cases_higher", "cases_lower")
INTERACTION_COLUMNS = ("statistic", "cohort_run", "model", "arm", "heads", "n_cases", "estimate", "ci_low", "ci_high",
                       "cases_higher", "cases_lower")

FLIP_INTERACTION: tuple[tuple[str, str], tuple[str, str]] = (("mistill", "bf16"), ("vanilla-bf16", "bf16"))
"""The training-benefit interaction's two checkpoints (App. N.4): the bf16 seed-0 Mistill and
Vanilla CoT-KD students, each on its own top-40."""


def _tests(diff: pd.Series, n_resamples: int, seed: int) -> stats.PairedDifference:
    return stats.difference_tests(diff.dropna().to_numpy(dtype=float), n_resamples=n_resamples, seed=seed)


def _same(group: pd.DataFrame, run: pd.Series, kind: str, mask: str = "", heads: str = "") -> pd.DataFrame:
    """``run``'s checkpoint's runs of ``kind`` (and, with ``mask``, of that mask on ``heads``)."""
    masked = {"mask": mask, "heads": heads} if mask else {}
    return _rows(group, **{c: run[c] for c in query.RUN_KEY}, kind=kind, **masked)


def flip_causal_table(runs: pd.DataFrame, cases: pd.DataFrame, *, n_resamples: int = stats.N_BOOTSTRAP,
                      seed: int = 0) -> pd.DataFrame:
    """Table 55's rows (:data:`CAUSAL_COLUMNS`): per checkpoint and head set with a target and a
    sham run and a clean HF run, ``ΔD = D_clean - D_masked`` per mask and target minus sham
    (per case ``D_sham - D_target``), means with case-clustered intervals.

    runs: :func:`flip_runs`; cases: their ``flip_cases`` tables stacked (``run_id``, ``case_id``, ``D``)."""
    rows = []
    for cohort, group in runs.groupby("params.cohort_run", sort=True):
        targets = group[(group["kind"] == MASKED) & (group["mask"] == "target")]
        for _, run in targets.iterrows():
            sham, clean = _same(group, run, MASKED, "sham", run["heads"]), _same(group, run, CLEAN_HF)
            if sham.empty or clean.empty:
                continue
            d_t, d_s = _per_case(cases, run["run_id"]), _per_case(cases, sham.iloc[0]["run_id"])
            d_c = _per_case(cases, clean.iloc[0]["run_id"])
            dt, ds, ts = _tests(d_c - d_t, n_resamples, seed), _tests(d_c - d_s, n_resamples, seed), \
                _tests(d_s - d_t, n_resamples, seed)
            rows.append({"cohort_run": cohort, **{c: run[c] for c in query.RUN_KEY}, "heads": run["heads"],
                         "n_cases": ts.n, "D_clean": float(d_c.mean()), "delta_target": dt.mean_diff,
                         "delta_target_low": dt.ci_low, "delta_target_high": dt.ci_high, "delta_sham": ds.mean_diff,
                         "delta_sham_low": ds.ci_low, "delta_sham_high": ds.ci_high, "target_minus_sham": ts.mean_diff,
                         "target_minus_sham_low": ts.ci_low, "target_minus_sham_high": ts.ci_high,
                         "cases_higher": ts.n_higher, "cases_lower": ts.n_lower})
    return pd.DataFrame.from_records(rows, columns=list(CAUSAL_COLUMNS))


def flip_interaction_table(runs: pd.DataFrame, cases: pd.DataFrame, *, n_resamples: int = stats.N_BOOTSTRAP,
                           seed: int = 0) -> pd.DataFrame:
    """The training-benefit interaction and the execution-path offsets (:data:`INTERACTION_COLUMNS`).

    ``L = G_sham - G_target`` with ``G = D_Mistill - D_Vanilla`` per case (:data:`FLIP_INTERACTION`'s
    seed-0 checkpoints, the same head-set label on both, e.g. their own top-40); each checkpoint's
    execution-path offset, ``D`` of the behavioural run minus ``D`` of the clean HF run, per case."""
    rows = []
    (arm_m, prec_m), (arm_v, prec_v) = FLIP_INTERACTION
    for cohort, group in runs.groupby("params.cohort_run", sort=True):
        masked = group[group["kind"] == MASKED]
        for heads in sorted(set(masked["heads"])):
            sides = [_rows(masked, arm=a, precision=p, seed=0, mask=m, heads=heads)
                     for a, p in FLIP_INTERACTION for m in ("sham", "target")]
            if any(s.empty for s in sides):
                continue
            (ms, mt, vs, vt) = (_per_case(cases, s.iloc[0]["run_id"]) for s in sides)
            result = _tests((ms - vs) - (mt - vt), n_resamples, seed)
            rows.append({"statistic": "L = G_sham - G_target", "cohort_run": cohort, "model": sides[0].iloc[0]["model"],
                         "arm": f"{arm_m} - {arm_v}", "heads": heads, "n_cases": result.n,
                         "estimate": result.mean_diff, "ci_low": result.ci_low, "ci_high": result.ci_high,
                         "cases_higher": result.n_higher, "cases_lower": result.n_lower})
        for _, clean in group[group["kind"] == CLEAN_HF].iterrows():
            behaviour = _same(group, clean, BEHAVIOUR)
            if behaviour.empty:
                continue
            result = _tests(_per_case(cases, behaviour.iloc[0]["run_id"]) - _per_case(cases, clean["run_id"]),
                            n_resamples, seed)
            rows.append({"statistic": "execution-path offset", "cohort_run": cohort, "model": clean["model"],
                         "arm": clean["arm"], "heads": "", "n_cases": result.n, "estimate": result.mean_diff,
                         "ci_low": result.ci_low, "ci_high": result.ci_high, "cases_higher": result.n_higher,
                         "cases_lower": result.n_lower})
    return pd.DataFrame.from_records(rows, columns=list(INTERACTION_COLUMNS))


__all__ = ["FLIP_PARAMS", "FLIP_RUN_KEY", "FLIP_CONTRASTS", "FLIP_INTERACTION", "BEHAVIOUR", "CLEAN_HF", "MASKED",
           "BEHAVIOUR_COLUMNS", "CONTRAST_COLUMNS", "CAUSAL_COLUMNS", "INTERACTION_COLUMNS", "flip_runs",
           "behaviour_runs", "flip_behaviour_table", "flip_contrasts_table", "flip_causal_table",
           "flip_interaction_table"]
