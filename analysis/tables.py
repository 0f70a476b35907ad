"""The paper's result tables from tidy run tables (:mod:`analysis.query`).

Each builder returns a numeric frame (logged as CSV) and has a ``*_display`` companion of
formatted strings for Markdown and LaTeX (:func:`mistill.instrument.settables.to_markdown`,
:func:`~mistill.instrument.settables.to_latex`):

* Tables 1/10 (:func:`global_sets_table`): global head sets against random and bottom-k sets,
  from ``knockin`` runs' ``per_note_sets.csv`` (:func:`mistill.instrument.settables.sets_table`).
* Table 2 (:func:`task_table`): task and fidelity per arm from ``evaluate`` run metrics, mean and
  sd over seeds, single-seed rows marked, and the share of the untrained-to-teacher micro-F1
  gap each arm recovers.
* Table 43 (:func:`task_paired_table`): per-note paired differences against a reference arm,
  seed-averaged per note, with the corpus-level micro-F1 difference beside the per-note one.
* Tables 3/45 (:func:`own_heads_seed_table`, :func:`own_heads_table`,
  :func:`own_heads_paired_table`): own-heads readouts with their random floors, per seed and
  over seeds, and the seed-matched note-clustered comparisons against the reference.

Rows of one model are ordered teacher, untrained, reference, then the other arms by name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis import paired
from analysis.evidence import TOO_SMALL, Support
from mistill import stats
from mistill.errors import MistillInputError
from mistill.evaluation.metrics import gap_recovered
from mistill.instrument.settables import format_cell, sets_table

__all__ = [
    "PER_NOTE_MEASURES",
    "PHASES",
    "TASK_METRICS",
    "TEACHER_ARM",
    "UNTRAINED_ARM",
    "arm_order",
    "fmt_ci",
    "fmt_mean_sd",
    "global_sets_display",
    "global_sets_table",
    "own_heads_display",
    "own_heads_paired_table",
    "own_heads_seed_display",
    "own_heads_seed_table",
    "own_heads_table",
    "paired_display",
    "task_display",
    "task_paired_table",
    "task_table",
]

TEACHER_ARM = "teacher"
UNTRAINED_ARM = "untrained"
PHASES: tuple[str, ...] = ("P1", "P2", "P2C")
GROUP: tuple[str, ...] = ("model", "arm", "precision")

TASK_METRICS: tuple[tuple[str, str], ...] = (
    ("micro_f1", "micro-F1"), ("macro_f1", "macro-F1"), ("valid_rate", "valid"),
    ("cap_rate", "cap"), ("mean_generated_tokens", "tokens"), ("fidelity/ppl_median", "PPL"),
    ("fidelity/bleu4_mean", "BLEU-4"), ("fidelity/las_mean", "LAS"),
    ("m1/P1/p_pos", "M1 P1"), ("m1/P2/p_pos", "M1 P2"), ("m1/P2C/p_pos", "M1 P2C"))
"""``evaluate`` run metrics of Table 2 (metric name, column label), in column order."""

PER_NOTE_MEASURES: tuple[tuple[str, str], ...] = (
    ("micro_f1", "micro-F1 (per note)"), ("las", "LAS"), ("bleu4", "BLEU-4"), ("ppl", "PPL"))
"""Columns of ``per_note_metrics.csv`` compared note by note in Table 43."""

OWN_METRICS: tuple[tuple[str, str], ...] = (
    ("m2/region_lift", "M2 lift"), ("prefix_share", "prefix share"),
    ("m3/near_miss_share", "M3 near-miss"), ("m5/median_distance", "M5 distance"),
    ("m5/share_window", "M5 window"), ("m5/share_inherited", "M5 inherited"))
"""``own_heads`` run metrics of Table 3 beside the per-note recoveries (M5: the median locus
distance of the window-decided chapter mentions and the window and inherited shares)."""


# ------------------------------------------------------------------------------- formatting
def fmt_mean_sd(mean: float, sd: float, n: int, digits: int = 3) -> str:
    """``mean ± sd`` over seeds; a single seed prints its value alone."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return ""
    if n <= 1 or sd is None or math.isnan(sd):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def fmt_ci(estimate: float, low: float, high: float, digits: int = 3) -> str:
    """``+0.007 [-0.005, +0.019]``."""
    if any(v is None or math.isnan(v) for v in (estimate, low, high)):
        return ""
    return f"{estimate:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def _p(value: float) -> str:
    return format_cell(value, p_value=True)


def arm_order(arms: Sequence[str], reference_arm: str = "") -> list[str]:
    """Teacher, untrained, the reference, then the other arms by name."""
    first = [a for a in (TEACHER_ARM, UNTRAINED_ARM, reference_arm) if a and a in arms]
    return list(dict.fromkeys(first + sorted(a for a in arms if a not in first)))


def _sorted_groups(df: pd.DataFrame, reference_arm: str) -> pd.DataFrame:
    """Rows ordered: models with a teacher row first, then by model; arms by :func:`arm_order`."""
    if df.empty:
        return df
    rank = {a: i for i, a in enumerate(arm_order(df["arm"].dropna().unique().tolist(),
                                                 reference_arm))}
    teacher_models = set(df.loc[df["arm"] == TEACHER_ARM, "model"].astype(str))
    key = pd.DataFrame({
        "t": (~df["model"].astype(str).isin(teacher_models)).astype(int),
        "m": df["model"].astype(str), "a": df["arm"].map(rank).fillna(len(rank)),
        "p": df["precision"].astype(str) if "precision" in df else ""}, index=df.index)
    return df.loc[key.sort_values(["t", "m", "a", "p"], kind="stable").index].reset_index(drop=True)


def _label(arm: str, n_seeds: int) -> str:
    return arm if n_seeds != 1 else f"{arm} [1 seed]"


def _norm(df: pd.DataFrame) -> pd.DataFrame:
    """Group columns as strings (a missing tag is ``""``) so that groupby keeps the row."""
    out = df.copy()
    for col in GROUP:
        if col not in out.columns:
            out[col] = ""
        out[col] = out[col].fillna("").astype(str)
    return out


# --------------------------------------------------------------------------- Tables 1 / 10
def global_sets_table(per_note_sets: pd.DataFrame) -> pd.DataFrame:
    """Table 10 per model: :func:`~mistill.instrument.settables.sets_table` of each model's
    ``per_note_sets`` rows, a ``model`` column in front."""
    frames = []
    for model, grp in per_note_sets.groupby(per_note_sets["model"].fillna(""), sort=True):
        rows = grp.drop(columns=[c for c in ("run_id", "model", "arm", "precision", "seed")
                                 if c in grp.columns]).to_dict("records")
        table = sets_table(rows)
        table.insert(0, "model", model)
        frames.append(table)
    if not frames:
        raise MistillInputError("no knock-in rows", field="per_note_sets")
    return pd.concat(frames, ignore_index=True)


def global_sets_display(table: pd.DataFrame, ks: Sequence[int] | None = None) -> pd.DataFrame:
    """Tables 1/10 as printed: per measure the global, random and bottom medians (and own for
    recovery) and "notes" = notes where the global set beats random / notes compared.
    ``ks``: keep these set sizes (Table 1 prints every k but 16; None keeps all: Table 10)."""
    if ks is not None:
        table = table[table["k"].isin(list(ks))]
    out = []
    for _, r in table.iterrows():
        rec: dict[str, Any] = {"model": r["model"], "phase": r["phase"], "k": int(r["k"])}
        for m, short in (("necessity", "nec."), ("recovery", "rec.")):
            for s in ("global", "random", "bottom", "own"):
                col = f"{m}.{s}"
                if col in table.columns and not (s == "own" and m == "necessity"):
                    rec[f"{short} {s}"] = r[col]
            wins, n = r.get(f"{m}.wins_vs_random"), r.get(f"{m}.n_vs_random")
            rec[f"{short} notes"] = (f"{int(wins)}/{int(n)}" if pd.notna(wins) and pd.notna(n)
                                     else "")
        out.append(rec)
    return pd.DataFrame.from_records(out)


# ----------------------------------------------------------------------------------- Table 2
def _teacher_value(runs: pd.DataFrame, metric: str) -> float:
    vals = runs.loc[runs["arm"] == TEACHER_ARM, metric].dropna() if metric in runs else []
    return float(np.mean(vals)) if len(vals) else math.nan


def task_table(evaluate_runs: pd.DataFrame, reference_arm: str = "") -> pd.DataFrame:
    """Table 2 (numeric): one row per (model, arm, precision) with ``n_seeds``, ``seeds``, and per
    metric of :data:`TASK_METRICS` present ``<metric>.mean`` and ``<metric>.sd`` over seeds (sd
    NaN for one seed), and ``gap_recovered``: (arm - untrained) / (teacher - untrained) on the
    seed-mean micro-F1, the untrained student of the same model, the teacher's mean over its
    runs (NaN without both)."""
    if evaluate_runs.empty:
        raise MistillInputError("no evaluate runs", field="evaluate")
    runs = _norm(evaluate_runs)
    metrics = [m for m, _ in TASK_METRICS if m in runs.columns]
    teacher = _teacher_value(runs, "micro_f1")
    out = []
    for (model, arm, precision), grp in runs.groupby(list(GROUP), sort=False):
        seeds = sorted(int(s) for s in grp["seed"].dropna())
        rec: dict[str, Any] = {"model": model, "arm": arm, "precision": precision,
                               "n_seeds": len(grp), "seeds": ",".join(map(str, seeds))}
        for m in metrics:
            vals = grp[m].dropna().to_numpy(dtype=float)
            rec[f"{m}.mean"] = float(vals.mean()) if len(vals) else math.nan
            rec[f"{m}.sd"] = float(vals.std(ddof=1)) if len(vals) > 1 else math.nan
        base = runs.loc[(runs["model"] == model) & (runs["arm"] == UNTRAINED_ARM), "micro_f1"] \
            if "micro_f1" in runs else pd.Series(dtype=float)
        arm_f1 = rec.get("micro_f1.mean", math.nan)
        rec["gap_recovered"] = (gap_recovered(arm_f1, float(base.mean()), teacher)
                                if len(base.dropna()) and not math.isnan(teacher)
                                and arm not in (TEACHER_ARM,) else math.nan)
        out.append(rec)
    return _sorted_groups(pd.DataFrame.from_records(out), reference_arm)


def task_display(table: pd.DataFrame) -> pd.DataFrame:
    """Table 2 as printed: ``mean ± sd`` cells, single-seed arms marked ``[1 seed]``."""
    out = []
    for _, r in table.iterrows():
        n = int(r["n_seeds"])
        rec: dict[str, Any] = {"model": r["model"], "arm": _label(r["arm"], n),
                               "precision": r["precision"], "seeds": n}
        for m, label in TASK_METRICS:
            if f"{m}.mean" in table.columns:
                rec[label] = fmt_mean_sd(r[f"{m}.mean"], r[f"{m}.sd"], n)
        rec["gap recovered"] = format_cell(r["gap_recovered"])
        out.append(rec)
    return pd.DataFrame.from_records(out)


# ---------------------------------------------------------------------------------- Table 43
def _reference_rows(frame: pd.DataFrame, model: str, reference_arm: str) -> pd.DataFrame | None:
    ref = frame[(frame["model"] == model) & (frame["arm"] == reference_arm)]
    if ref.empty:
        return None
    if ref["precision"].nunique() > 1:
        raise MistillInputError(f"reference arm {reference_arm!r} of model {model} has runs at "
                                f"several precisions {sorted(ref['precision'].unique())}",
                                field="reference_arm")
    return ref


def _compared_arms(frame: pd.DataFrame, reference_arm: str):
    """Per model with reference rows, each other arm (teacher excluded) at each precision:
    yields ``(model, reference rows, arm, precision, the arm's rows)``."""
    for model in sorted(frame["model"].unique()):
        ref = _reference_rows(frame, model, reference_arm)
        if ref is None:
            continue
        arms = frame[(frame["model"] == model) & ~frame["arm"].isin([TEACHER_ARM, reference_arm])]
        for (arm, precision), grp in arms.groupby(["arm", "precision"], sort=True):
            yield model, ref, arm, precision, grp


def task_paired_table(per_note: pd.DataFrame, reference_arm: str, *,
                      n_resamples: int = stats.N_BOOTSTRAP,
                      corpus_resamples: int = stats.N_BOOTSTRAP_CORPUS,
                      seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Table 43: every arm of a model (not the teacher, not the reference) minus the reference
    arm of that model, per measure of :data:`PER_NOTE_MEASURES` present, seed-averaged per note.

    Returns ``(table, differences)``: the table has ``model, arm, precision, reference,
    measure`` and :func:`analysis.paired.difference_row`, plus for micro-F1 the corpus-level
    difference (:func:`analysis.paired.corpus_row`); ``differences`` is one row per
    (comparison, measure, note) with the per-note difference (the figure's input).
    """
    frame = _norm(per_note)
    rows, diffs = [], []
    for model, ref, arm, precision, grp in _compared_arms(frame, reference_arm):
        for measure, label in PER_NOTE_MEASURES:
            if measure not in frame.columns or grp[measure].isna().all() \
                    or ref[measure].isna().all():
                continue
            res = paired.seed_averaged(grp, ref, measure, n_resamples=n_resamples, seed=seed)
            rec = {"model": model, "arm": arm, "precision": precision,
                   "reference": reference_arm, "measure": label,
                   **paired.difference_row(res)}
            if measure == "micro_f1" and set(paired.COUNTS) <= set(frame.columns):
                rec.update(paired.corpus_row(paired.corpus_f1(
                    grp, ref, n_resamples=corpus_resamples, seed=seed)))
            rows.append(rec)
            d = paired.note_differences(grp, ref, measure)
            diffs.append(pd.DataFrame({"model": model, "comparison": f"{arm} - {reference_arm}",
                                       "measure": label, "note_id": d.index,
                                       "difference": d.to_numpy()}))
    table = pd.DataFrame.from_records(rows)
    return table, (pd.concat(diffs, ignore_index=True) if diffs else pd.DataFrame())


def paired_display(table: pd.DataFrame) -> pd.DataFrame:
    """A paired-difference table as printed: ``Δ mean [95% CI]``, p-values, notes
    higher/lower/tied, and the corpus-level micro-F1 difference where present."""
    out = []
    for _, r in table.iterrows():
        rec: dict[str, Any] = {k: r[k] for k in ("model", "arm", "reference", "measure")}
        if "n_pairs" in table.columns:
            rec["seed pairs"] = int(r["n_pairs"])
        rec["notes"] = int(r["n"])
        rec["Δ mean [95% CI]"] = fmt_ci(r["mean_diff"], r["ci_low"], r["ci_high"])
        rec["Δ median"] = format_cell(r["median_diff"])
        rec["higher/lower/tied"] = f"{int(r['n_higher'])}/{int(r['n_lower'])}/{int(r['n_tied'])}"
        rec["Wilcoxon p"] = _p(r["wilcoxon_p"])
        rec["sign p"] = _p(r["sign_p"])
        if "corpus_diff" in table.columns:
            rec["corpus Δ [95% CI]"] = fmt_ci(r["corpus_diff"], r["corpus_ci_low"],
                                              r["corpus_ci_high"])
            rec["corpus p"] = _p(r["corpus_p"])
        out.append(rec)
    return pd.DataFrame.from_records(out)


# ----------------------------------------------------------------------------- Tables 3 / 45
def _cells(per_note: pd.DataFrame) -> list[tuple[str, int]]:
    order = {p: i for i, p in enumerate(PHASES)}
    keys = {(str(p), int(k)) for p, k in zip(per_note["phase"], per_note["k"])}
    return sorted(keys, key=lambda pk: (order.get(pk[0], 99), pk[0], pk[1]))


def own_heads_seed_table(per_note: pd.DataFrame, own_runs: pd.DataFrame,
                         evaluate_runs: pd.DataFrame | None = None,
                         reference_arm: str = "") -> pd.DataFrame:
    """Table 45's per-seed rows: per own-heads run, for each (phase, k) the median over notes of
    ``recovery_own`` (``<phase>.k<k>.own``) and of ``recovery_random`` (``.random``), the run
    metrics of :data:`OWN_METRICS`, and ``task`` = that seed's ``micro_f1`` from the
    ``evaluate`` run of the same model, arm and seed (NaN without one)."""
    frame = _norm(per_note)
    runs = _norm(own_runs)
    evals = _norm(evaluate_runs) if evaluate_runs is not None and not evaluate_runs.empty \
        else None
    cells = _cells(frame)
    out = []
    for _, run in runs.iterrows():
        mine = frame[frame["run_id"] == run["run_id"]]
        if mine.empty:
            continue
        rec: dict[str, Any] = {"run_id": run["run_id"], "model": run["model"], "arm": run["arm"],
                               "precision": run["precision"], "seed": run["seed"]}
        for phase, k in cells:
            cell = mine[(mine["phase"] == phase) & (mine["k"] == k)]
            rec[f"{phase}.k{k}.own"] = float(cell["recovery_own"].median())
            rec[f"{phase}.k{k}.random"] = float(cell["recovery_random"].median())
            if "n_gated" in cell.columns:  # what the cell rests on (analysis.evidence)
                rec[f"{phase}.k{k}.n_gated"] = float(cell["n_gated"].fillna(0).sum())
                rec[f"{phase}.k{k}.n_notes"] = float(cell["recovery_own"].notna().sum())
        for m, _ in OWN_METRICS:
            rec[m] = float(run[m]) if m in runs.columns and pd.notna(run[m]) else math.nan
        rec["task"] = math.nan
        if evals is not None and "micro_f1" in evals.columns:
            match = evals[(evals["model"] == run["model"]) & (evals["arm"] == run["arm"])
                          & (evals["seed"] == run["seed"])]
            if len(match) > 1:
                same = match[match["precision"] == run["precision"]]
                match = same if not same.empty else match
            if not match.empty:
                rec["task"] = float(match["micro_f1"].iloc[0])
        out.append(rec)
    table = pd.DataFrame.from_records(out)
    if table.empty:
        return table
    table["seed"] = table["seed"].astype("Int64")
    return _sorted_groups(table.sort_values("seed", kind="stable"), reference_arm)


def _value_columns(seed_table: pd.DataFrame) -> list[str]:
    skip = {"run_id", "model", "arm", "precision", "seed"}
    return [c for c in seed_table.columns if c not in skip]


def own_heads_table(seed_table: pd.DataFrame, reference_arm: str = "") -> pd.DataFrame:
    """Table 3 (numeric): per (model, arm, precision), ``n_seeds`` and for every column of the
    per-seed table its ``.mean`` and ``.sd`` over seeds (medians over notes, then over seeds)."""
    if seed_table.empty:
        raise MistillInputError("no own-heads rows", field="own_heads")
    cols = _value_columns(seed_table)
    out = []
    for (model, arm, precision), grp in seed_table.groupby(list(GROUP), sort=False):
        rec: dict[str, Any] = {"model": model, "arm": arm, "precision": precision,
                               "n_seeds": len(grp)}
        for c in cols:
            vals = grp[c].dropna().to_numpy(dtype=float)
            rec[f"{c}.mean"] = float(vals.mean()) if len(vals) else math.nan
            rec[f"{c}.sd"] = float(vals.std(ddof=1)) if len(vals) > 1 else math.nan
        out.append(rec)
    return _sorted_groups(pd.DataFrame.from_records(out), reference_arm)


def _recovery_cells(columns: Sequence[str]) -> list[str]:
    return [c[:-len(".own.mean")] for c in columns if c.endswith(".own.mean")]


def own_heads_display(table: pd.DataFrame) -> pd.DataFrame:
    """Table 3 as printed: per (phase, k) own recovery ``mean ± sd`` with the random floor in
    parentheses and, in brackets, the gated events and notes a seed's cell rests on (mean over
    seeds); a cell below the minimum (:mod:`analysis.evidence`) shows "n too small". Then the
    run metrics, single-seed arms marked."""
    out = []
    for _, r in table.iterrows():
        n = int(r["n_seeds"])
        rec: dict[str, Any] = {"model": r["model"], "arm": _label(r["arm"], n),
                               "precision": r["precision"], "seeds": n}
        for cell in _recovery_cells(table.columns):
            own = fmt_mean_sd(r[f"{cell}.own.mean"], r[f"{cell}.own.sd"], n)
            floor = r[f"{cell}.random.mean"]
            text = f"{own} ({floor:.3f})" if own and pd.notna(floor) else own
            if f"{cell}.n_gated.mean" in table.columns:
                support = _support(r[f"{cell}.n_gated.mean"], r[f"{cell}.n_notes.mean"])
                if own:
                    text = f"{text if support.clears() else TOO_SMALL} [{support.label()}]"
            rec[cell.replace(".", " ")] = text
        for m, label in (*OWN_METRICS, ("task", "task")):
            if f"{m}.mean" in table.columns:
                rec[label] = fmt_mean_sd(r[f"{m}.mean"], r[f"{m}.sd"], n)
        out.append(rec)
    return pd.DataFrame.from_records(out)


def own_heads_seed_display(seed_table: pd.DataFrame) -> pd.DataFrame:
    """Table 45's per-seed rows as printed: own recovery with the random floor in parentheses
    and, in brackets, the gated events and notes it rests on; below the minimum
    (:mod:`analysis.evidence`) "n too small"."""
    out = []
    cells = [c[:-len(".own")] for c in seed_table.columns if c.endswith(".own")]
    for _, r in seed_table.iterrows():
        rec: dict[str, Any] = {"model": r["model"], "arm": r["arm"],
                               "precision": r["precision"], "seed": r["seed"]}
        for cell in cells:
            own, floor = r[f"{cell}.own"], r[f"{cell}.random"]
            text = (f"{own:.3f} ({floor:.3f})" if pd.notna(own)
                    and pd.notna(floor) else format_cell(own))
            if f"{cell}.n_gated" in seed_table.columns and pd.notna(own):
                support = _support(r[f"{cell}.n_gated"], r[f"{cell}.n_notes"])
                text = f"{text if support.clears() else TOO_SMALL} [{support.label()}]"
            rec[cell.replace(".", " ")] = text
        for m, label in (*OWN_METRICS, ("task", "task")):
            rec[label] = format_cell(r[m]) if m in seed_table.columns else ""
        out.append(rec)
    return pd.DataFrame.from_records(out)


def _support(n_events: Any, n_notes: Any):
    """:class:`analysis.evidence.Support` from two (possibly NaN) counts."""
    def count(v: Any) -> int | None:
        return None if v is None or v is pd.NA or not math.isfinite(float(v)) else int(round(float(v)))

    return Support(count(n_events), count(n_notes))


def own_heads_paired_table(per_note: pd.DataFrame, reference_arm: str,
                           task_per_note: pd.DataFrame | None = None, *,
                           n_resamples: int = stats.N_BOOTSTRAP,
                           seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Table 45's seed-matched lines: for every arm of a model against the reference arm of
    that model, per (phase, k) the note-clustered comparison of ``recovery_own``
    (:func:`analysis.paired.seed_matched`), and ``task`` the same on per-note micro-F1 from
    ``task_per_note`` (``evaluate`` runs' ``per_note_metrics``) when given.

    Returns ``(table, differences)`` like :func:`task_paired_table` (per-note differences are
    each note's mean over its seed pairs).
    """
    frame = _norm(per_note)
    task = _norm(task_per_note) if task_per_note is not None and not task_per_note.empty \
        else None
    rows, diffs = [], []

    def add(model: str, arm: str, precision: str, label: str, a: pd.DataFrame,
            r: pd.DataFrame, value: str) -> None:
        res = paired.seed_matched(a, r, value, n_resamples=n_resamples, seed=seed)
        rows.append({"model": model, "arm": arm, "precision": precision,
                     "reference": reference_arm, "measure": label, **paired.clustered_row(res)})
        notes = sorted(res.per_note)
        diffs.append(pd.DataFrame({"model": model, "comparison": f"{arm} - {reference_arm}",
                                   "measure": label, "note_id": notes,
                                   "difference": [res.per_note[n] for n in notes]}))

    for model, ref, arm, precision, grp in _compared_arms(frame, reference_arm):
        for phase, k in _cells(grp):
            a = grp[(grp["phase"] == phase) & (grp["k"] == k)]
            r = ref[(ref["phase"] == phase) & (ref["k"] == k)]
            if a["recovery_own"].notna().any() and r["recovery_own"].notna().any():
                add(model, arm, precision, f"M4 {phase} k{k}", a, r, "recovery_own")
        if task is not None and "micro_f1" in task.columns:
            ta = task[(task["model"] == model) & (task["arm"] == arm)
                      & (task["precision"] == precision)]
            tr = _reference_rows(task, model, reference_arm)
            if not ta.empty and tr is not None:
                add(model, arm, precision, "task micro-F1 (per note)", ta, tr, "micro_f1")
    table = pd.DataFrame.from_records(rows)
    return table, (pd.concat(diffs, ignore_index=True) if diffs else pd.DataFrame())
