"""Tables of how the students were trained, from tidy run tables (:mod:`analysis.query`):

* the learning curve (Sec. 4.3, Figure 8; App. M.5, Table 53: :func:`learning_curve_table`,
  :func:`learning_curve_figure`): each arm trained on part of the training notes (a ``train``
  run's ``train_notes``) and on all of them, evaluated on the same test notes: task micro-F1 and
  M1 at P2C per arm and size (mean ± sd over seeds), and Mistill against Vanilla CoT-KD at each
  size, seed-matched per note;
* the training cost per arm (Sec. 6; App. I.5: :func:`training_cost_runs`,
  :func:`training_cost_table`): peak memory, seconds per optimizer step and per note, with and
  without the Mistill terms (an arm against the reference arm trained on as many notes);
* the replicate pairing (App. L.5, L.6: :func:`replicate_differences`,
  :func:`replicate_table`): two ``evaluate`` runs, or two ``own_heads`` runs, of one
  configuration (a same-seed replicate, or one checkpoint read on other hardware) paired note by
  note: their per-note differences, the summary and the paired tests.

Pure functions on DataFrames; the report section (:mod:`analysis.report_sections`) reads the runs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis import paired, tables
from analysis.ablation_tables import MISTILL_ARM, VANILLA_ARMS
from analysis.figures import series_label
from mistill import stats
from mistill.errors import MistillInputError
from mistill.instrument.settables import format_cell

__all__ = [
    "COST_METRICS",
    "EVALUATE_MEASURES",
    "LEARNING_CURVE_MEASURES",
    "OWN_HEADS_MEASURE",
    "learning_curve_display",
    "learning_curve_figure",
    "learning_curve_runs",
    "learning_curve_table",
    "parse_replicate_pairs",
    "replicate_differences",
    "replicate_display",
    "replicate_table",
    "top_k_agreement",
    "train_sizes",
    "training_cost_display",
    "training_cost_runs_display",
    "training_cost_runs",
    "training_cost_table",
]

ARM_KEY: tuple[str, ...] = ("model", "arm", "precision", "seed")
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
            "#d62728", "#7f7f7f")

# ------------------------------------------------------------------------- the learning curve
LEARNING_CURVE_MEASURES: tuple[tuple[str, str, str, str], ...] = (
    ("micro_f1", "micro_f1", "f1", "micro-F1"),
    ("m1_P2C_p_pos", "m1/P2C/p_pos", "m1_p2c", "M1 P2C"))
"""Table 53's measures: (per-note column of ``per_note_metrics.csv``, the evaluate run's metric,
the prefix of its columns here, its label). Levels are the run metrics (corpus-level micro-F1,
M1 over every event), mean ± sd over seeds; the paired columns compare the per-note values."""


def train_sizes(train: pd.DataFrame, train_notes: Mapping[str, Any]) -> dict[str, int]:
    """Train run id -> the number of training notes it trained on: its ``train_notes`` param
    (``train_notes``: run id -> that param) when above 0, else (0: every training note) its
    ``n_notes`` metric. A run with neither is left out."""
    out: dict[str, int] = {}
    metric = train["n_notes"] if "n_notes" in train.columns else pd.Series(np.nan, index=train.index)
    for rid, n_notes in zip(train.get("run_id", []), metric):
        asked = pd.to_numeric(pd.Series([train_notes.get(str(rid))]), errors="coerce").iloc[0]
        if not pd.isna(asked) and asked > 0:
            out[str(rid)] = int(asked)
        elif not pd.isna(n_notes):
            out[str(rid)] = int(n_notes)
    return out


def learning_curve_runs(evaluate: pd.DataFrame, sizes: Mapping[str, int]) -> pd.DataFrame:
    """The evaluate runs of trained checkpoints whose train run has a known size, with a
    ``train_notes`` column: the newest run of each model, arm, precision, seed and size."""
    if evaluate.empty or "train_run" not in evaluate.columns:
        return evaluate.iloc[0:0].assign(train_notes=pd.Series(dtype="Int64"))
    runs = evaluate[evaluate["train_run"].astype(str).isin(sizes)].copy()
    runs["train_notes"] = runs["train_run"].astype(str).map(sizes).astype("Int64")
    if runs.empty:
        return runs
    ordered = runs.sort_values("start_time", ascending=False, kind="stable")
    keep = ~ordered[[*ARM_KEY, "train_notes"]].astype(str).duplicated()
    return ordered[keep].sort_values(["model", "train_notes", "arm", "seed"], kind="stable").reset_index(drop=True)


def _levels(runs: pd.DataFrame) -> dict[str, Any]:
    seeds = sorted(int(s) for s in runs["seed"].dropna())
    rec: dict[str, Any] = {"precision": ",".join(sorted({str(p) for p in runs["precision"].dropna()})),
                           "seeds": ",".join(map(str, seeds)), "n_seeds": len(runs)}
    for _, metric, prefix, _ in LEARNING_CURVE_MEASURES:
        values = pd.to_numeric(runs[metric], errors="coerce") if metric in runs.columns else pd.Series(dtype=float)
        values = values.dropna()
        rec[f"{prefix}_mean"] = float(values.mean()) if len(values) else math.nan
        rec[f"{prefix}_sd"] = float(values.std(ddof=1)) if len(values) > 1 else math.nan
    return rec


def _paired_columns(arm_notes: pd.DataFrame, ref_notes: pd.DataFrame, column: str, prefix: str,
                    n_resamples: int, seed: int) -> dict[str, Any]:
    """Seed-matched, note-clustered ``arm - reference`` of one per-note column: the clustered
    tests, and the note-pairs pooled over seed pairs with their sign test (descriptive when
    there are several seed pairs: the paper's "higher / lower" of Table 53)."""
    if column not in arm_notes.columns or column not in ref_notes.columns:
        return {}
    a, r = arm_notes.dropna(subset=[column]), ref_notes.dropna(subset=[column])
    if a.empty or r.empty:
        return {}
    try:
        result = paired.seed_matched(a, r, column, n_resamples=n_resamples, seed=seed)
    except MistillInputError:
        return {}
    row = paired.clustered_row(result)
    out = {f"{prefix}_{k}": v for k, v in row.items()}
    out[f"{prefix}_pooled_sign_p"] = stats.sign_test(result.pooled_higher, result.pooled_lower)
    return out


def learning_curve_table(runs: pd.DataFrame, per_note: pd.DataFrame, *, arm: str = MISTILL_ARM,
                         references: Sequence[str] = VANILLA_ARMS, n_resamples: int = stats.N_BOOTSTRAP,
                         seed: int = 0) -> pd.DataFrame:
    """Table 53: per model and training-set size, one row per arm of ``arm`` and ``references``
    evaluated at that size (levels: the run metrics' mean and sd over seeds), and for ``arm``
    one row per reference present at the same size with the paired columns: per measure of
    :data:`LEARNING_CURVE_MEASURES`, seed i against seed i (a one-seed side pairs with every
    seed), per note the mean of its seed pairs' differences, then the tests over notes
    (``<prefix>_mean_diff``, ``_ci_low``, ``_ci_high``, ``_n``, ``_n_higher``, ...,
    ``_sign_p``), and the note-pairs pooled over the seed pairs (``_pooled_higher``,
    ``_pooled_lower``, ``_pooled_sign_p``: descriptive with several pairs, as the paper counts
    them). **[recon]** The paper's Table 53 gives the higher / lower counts and the sign test; the
    note-clustered mean difference and its interval beside them, and M1 at P2C as the mechanism
    readout of every size, follow App. M.5's text.

    runs: :func:`learning_curve_runs` (``run_id``, ``model``, ``arm``, ``precision``, ``seed``,
    ``train_notes`` and the metrics); per_note: ``per_note_metrics.csv`` of those runs
    (``run_id``, ``seed``, ``note_id`` and the per-note columns).
    """
    shown = list(dict.fromkeys([arm, *references]))
    if runs.empty:
        return pd.DataFrame()
    rows = []
    for (model, size), at in runs[runs["arm"].isin(shown)].groupby(["model", "train_notes"], sort=True):
        for name in shown:
            mine = at[at["arm"] == name]
            if mine.empty:
                continue
            base = {"model": model, "train_notes": int(size), "arm": name, **_levels(mine),
                    "n_test_notes": int(per_note.loc[per_note["run_id"].isin(mine["run_id"]), "note_id"].nunique())
                    if not per_note.empty else 0}
            refs = [r for r in references if r != name and (at["arm"] == r).any()] if name == arm else []
            if not refs:
                rows.append(base)
                continue
            arm_notes = per_note[per_note["run_id"].isin(mine["run_id"])]
            for ref in refs:
                ref_runs = at[at["arm"] == ref]
                ref_notes = per_note[per_note["run_id"].isin(ref_runs["run_id"])]
                rec = {**base, "reference": ref,
                       "reference_precision": ",".join(sorted({str(p) for p in ref_runs["precision"].dropna()}))}
                for column, _, prefix, _ in LEARNING_CURVE_MEASURES:
                    rec.update(_paired_columns(arm_notes, ref_notes, column, prefix, n_resamples, seed))
                rows.append(rec)
    return pd.DataFrame.from_records(rows)


def _get(row: pd.Series, key: str) -> Any:
    value = row.get(key)
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _counts(row: pd.Series, prefix: str) -> str:
    hi, lo = _get(row, f"{prefix}_pooled_higher"), _get(row, f"{prefix}_pooled_lower")
    return "" if hi is None or lo is None else f"{int(hi)}/{int(lo)}"


def learning_curve_display(table: pd.DataFrame) -> pd.DataFrame:
    """Table 53 as printed: levels mean ± sd over seeds, then against the reference: Δ mean
    [95% CI] (note-clustered), notes (note-pairs) higher/lower and their sign-test p."""
    out = []
    for _, r in table.iterrows():
        n = int(r["n_seeds"])
        rec: dict[str, Any] = {"model": r["model"], "training notes": int(r["train_notes"]), "arm": r["arm"],
                               "precision": r["precision"], "seeds": r["seeds"]}
        for _, _, prefix, label in LEARNING_CURVE_MEASURES:
            rec[label] = tables.fmt_mean_sd(r[f"{prefix}_mean"], r[f"{prefix}_sd"], n)
        rec["vs"] = _get(r, "reference") or ""
        for _, _, prefix, label in LEARNING_CURVE_MEASURES:
            mean = _get(r, f"{prefix}_mean_diff")
            rec[f"Δ {label} [95% CI]"] = "" if mean is None else tables.fmt_ci(
                mean, r[f"{prefix}_ci_low"], r[f"{prefix}_ci_high"])
            rec[f"{label} higher/lower"] = _counts(r, prefix)
            p = _get(r, f"{prefix}_pooled_sign_p")
            rec[f"{label} sign p"] = "" if p is None else format_cell(p, p_value=True)
        out.append(rec)
    return pd.DataFrame.from_records(out)


def learning_curve_figure(table: pd.DataFrame, title: str = "Learning curve"):
    """Figure 8: micro-F1 and M1 at P2C against the number of training notes, one line per
    model and arm (mean over seeds, the between-seed sd as error bars)."""
    import plotly.graph_objects as go  # deferred: plotly is slow to import
    from plotly.subplots import make_subplots  # deferred: plotly is slow to import

    if table.empty:
        raise MistillInputError("no learning-curve rows to plot", field="train_notes")
    levels = table.drop_duplicates(["model", "arm", "train_notes"]).sort_values("train_notes")
    several = levels["model"].nunique() > 1
    fig = make_subplots(rows=1, cols=len(LEARNING_CURVE_MEASURES),
                        subplot_titles=[label for *_, label in LEARNING_CURVE_MEASURES])
    for i, ((model, arm), line) in enumerate(levels.groupby(["model", "arm"], sort=True)):
        name = series_label(arm=arm, model=model if several else None)
        for j, (_, _, prefix, label) in enumerate(LEARNING_CURVE_MEASURES, start=1):
            sd = line[f"{prefix}_sd"].fillna(0.0)
            fig.add_trace(go.Scatter(
                x=line["train_notes"], y=line[f"{prefix}_mean"], mode="lines+markers", name=name,
                legendgroup=name, showlegend=j == 1, line={"color": _PALETTE[i % len(_PALETTE)]},
                error_y={"type": "data", "array": sd.tolist(), "visible": True},
                text=[f"seeds {s}" for s in line["seeds"]],
                hovertemplate=f"{name}<br>%{{x}} notes: %{{y:.3f}} ({label}, %{{text}})<extra></extra>"),
                row=1, col=j)
            fig.update_xaxes(title_text="training notes", type="log",
                             tickvals=sorted(levels["train_notes"].unique().tolist()), row=1, col=j)
            fig.update_yaxes(title_text=label, row=1, col=j)
    fig.update_layout(title=f"{title}<br><sup>mean over seeds on the test notes; error bars: the "
                            "between-seed sd</sup>", template="plotly_white", height=480)
    return fig


# ---------------------------------------------------------------------------- training cost
COST_METRICS: tuple[str, ...] = ("train/step_seconds", "train/step_notes", "train/peak_memory_gib")
"""The train stage's per-step cost metrics (:func:`mistill.distill.trainer.step_cost`)."""
SYSTEM_GPU_MEMORY = re.compile(r"^system/gpu_(\d+)_memory_usage_megabytes$")
"""MLflow's sampled GPU memory (whole device, every 10 s): the fallback peak of a run that logged
no ``train/peak_memory_gib`` (a run of an older version, or an on-policy arm on TRL's trainer)."""


def _run_cost(run: pd.Series, history: pd.DataFrame) -> dict[str, Any]:
    mine = history[history["run_id"] == run["run_id"]] if not history.empty else history

    def values(metric: str) -> pd.Series:
        return mine.loc[mine["metric"] == metric].sort_values("step")["value"] if not mine.empty else pd.Series(
            dtype=float)

    seconds, notes, peak = (values(m) for m in COST_METRICS)
    rec: dict[str, Any] = {"steps_timed": int(len(seconds)),
                           "train_seconds": float(seconds.sum()) if len(seconds) else math.nan,
                           "s_per_step": float(seconds.median()) if len(seconds) else math.nan}
    seen = float(notes.sum()) if len(notes) else math.nan
    rec["notes_seen"] = seen
    rec["s_per_note"] = rec["train_seconds"] / seen if len(seconds) and seen > 0 else math.nan
    rec["peak_memory_gib"], rec["peak_source"] = math.nan, ""
    if len(peak):
        rec["peak_memory_gib"], rec["peak_source"] = float(peak.max()), "torch (train/peak_memory_gib)"
    elif not mine.empty:
        gpu = mine[mine["metric"].astype(str).str.match(SYSTEM_GPU_MEMORY.pattern)]
        if not gpu.empty:
            rec["peak_memory_gib"] = float(gpu["value"].max()) * 1e6 / 2 ** 30
            rec["peak_source"] = "system metrics (GPU, sampled)"
    return rec


def training_cost_runs(train: pd.DataFrame, history: pd.DataFrame) -> pd.DataFrame:
    """Per train run, what training cost: ``steps`` (``train/steps``), ``train_notes`` (its
    size), ``steps_timed``, ``train_seconds`` (the optimizer steps' summed wall time),
    ``s_per_step`` (their median), ``notes_seen`` (the notes of those steps), ``s_per_note``
    (train seconds over notes seen), ``peak_memory_gib`` and where it was read
    (``peak_source``: the step's torch peak, else MLflow's sampled GPU memory), and
    ``run_minutes`` (the run's wall time, loading and saving included).

    train: one row per train run (``run_id``, ``model``, ``arm``, ``precision``, ``seed``,
    ``lambda``, ``train_notes``, ``run_seconds``, ``train/steps``); history: the metric values of
    those runs, long (``run_id``, ``metric``, ``step``, ``value``): :data:`COST_METRICS` and the
    ``system/gpu_<i>_memory_usage_megabytes`` series.

    **[recon]** The paper quotes seconds per note and per eight-note step and the step's peak; it
    does not say how they were timed: here seconds per note count the optimizer steps only, and
    the peak is torch's on the device (the sampled whole-device GPU memory of MLflow's system
    metrics where a run logged none).
    """
    if train.empty:
        return pd.DataFrame()
    rows = []
    for _, run in train.iterrows():
        rec = {c: run.get(c) for c in ("run_id", "model", "arm", "precision", "seed", "lambda", "train_notes")}
        steps = run.get("train/steps")
        rec["steps"] = int(steps) if steps is not None and not pd.isna(steps) else pd.NA
        rec.update(_run_cost(run, history))
        seconds = run.get("run_seconds")
        rec["run_minutes"] = float(seconds) / 60 if seconds is not None and not pd.isna(seconds) else math.nan
        rows.append(rec)
    out = pd.DataFrame.from_records(rows)
    out["seed"] = pd.to_numeric(out["seed"], errors="coerce").astype("Int64")
    out["train_notes"] = pd.to_numeric(out["train_notes"], errors="coerce").astype("Int64")
    return out.sort_values(["model", "train_notes", "arm", "seed"], kind="stable").reset_index(drop=True)


def training_cost_runs_display(per_run: pd.DataFrame) -> pd.DataFrame:
    """The per-run training cost as printed (no run ids)."""
    shown = per_run.drop(columns=["run_id"], errors="ignore").astype(object)
    return shown.map(lambda v: v if isinstance(v, str) else format_cell(v, digits=2))


def _mean(values: pd.Series) -> float:
    values = pd.to_numeric(values, errors="coerce").dropna()
    return float(values.mean()) if len(values) else math.nan


def _extreme(values: pd.Series, how: str) -> float:
    values = pd.to_numeric(values, errors="coerce").dropna()
    return float(getattr(values, how)()) if len(values) else math.nan


def training_cost_table(per_run: pd.DataFrame, reference_arm: str) -> pd.DataFrame:
    """Per model, arm, precision and training-set size: the runs and seeds, the mean, min and
    max over runs of seconds per note, seconds per optimizer step (each run's median), training
    minutes and run minutes, the largest peak memory, and against ``reference_arm`` trained on as
    many notes (with and without the Mistill terms when the reference is Vanilla CoT-KD):
    ``s_per_note_ratio`` (this arm's mean s per note over the reference's) and
    ``peak_memory_diff_gib``."""
    if per_run.empty:
        return pd.DataFrame()
    rows = []
    for (model, arm, precision, size), grp in per_run.groupby(["model", "arm", "precision", "train_notes"],
                                                              sort=True, dropna=False):
        rec: dict[str, Any] = {"model": model, "arm": arm, "precision": precision,
                               "train_notes": size, "runs": len(grp),
                               "seeds": ",".join(str(int(s)) for s in sorted(grp["seed"].dropna().unique())),
                               "steps": _extreme(grp["steps"], "max")}
        for col in ("s_per_note", "s_per_step"):
            rec[f"{col}_mean"] = _mean(grp[col])
            rec[f"{col}_min"], rec[f"{col}_max"] = _extreme(grp[col], "min"), _extreme(grp[col], "max")
        for col in ("train_seconds", "run_minutes"):
            scale = 60.0 if col == "train_seconds" else 1.0
            name = "train_minutes" if col == "train_seconds" else col
            rec[f"{name}_min"] = _extreme(grp[col], "min") / scale
            rec[f"{name}_max"] = _extreme(grp[col], "max") / scale
        rec["peak_memory_gib"] = _extreme(grp["peak_memory_gib"], "max")
        rec["peak_source"] = ", ".join(sorted({s for s in grp["peak_source"] if s}))
        rows.append(rec)
    out = pd.DataFrame.from_records(rows)
    out["s_per_note_ratio"], out["peak_memory_diff_gib"] = math.nan, math.nan
    for i, r in out.iterrows():
        ref = out[(out["model"] == r["model"]) & (out["arm"] == reference_arm)
                  & (out["train_notes"].astype(str) == str(r["train_notes"]))]
        if r["arm"] == reference_arm or ref.empty:
            continue
        ref = ref.iloc[0]
        if ref["s_per_note_mean"] > 0:
            out.loc[i, "s_per_note_ratio"] = r["s_per_note_mean"] / ref["s_per_note_mean"]
        out.loc[i, "peak_memory_diff_gib"] = r["peak_memory_gib"] - ref["peak_memory_gib"]
    return out


def _span_text(low: float, high: float, digits: int) -> str:
    if math.isnan(low):
        return ""
    return f"{low:.{digits}f}" if math.isclose(low, high) else f"{low:.{digits}f}–{high:.{digits}f}"


def training_cost_display(table: pd.DataFrame, reference_arm: str) -> pd.DataFrame:
    """The training-cost table as printed: min–max over runs, the peak in GiB and the ratio to
    the reference arm."""
    out = []
    for _, r in table.iterrows():
        out.append({"model": r["model"], "arm": r["arm"], "precision": r["precision"],
                    "training notes": "" if pd.isna(r["train_notes"]) else int(r["train_notes"]),
                    "runs (seeds)": f"{int(r['runs'])} ({r['seeds']})",
                    "steps": format_cell(r["steps"], digits=0),
                    "s per note": _span_text(r["s_per_note_min"], r["s_per_note_max"], 1),
                    "s per step": _span_text(r["s_per_step_min"], r["s_per_step_max"], 1),
                    "train min": _span_text(r["train_minutes_min"], r["train_minutes_max"], 1),
                    "run min": _span_text(r["run_minutes_min"], r["run_minutes_max"], 1),
                    "peak GiB": format_cell(r["peak_memory_gib"], digits=1),
                    f"s per note / {reference_arm}": format_cell(r["s_per_note_ratio"], digits=2),
                    f"Δ peak GiB vs {reference_arm}": "" if pd.isna(r["peak_memory_diff_gib"])
                    else f"{r['peak_memory_diff_gib']:+.1f}",
                    "peak from": r["peak_source"]})
    return pd.DataFrame.from_records(out)


# ------------------------------------------------------------------------ replicate pairing
EVALUATE_MEASURES: tuple[tuple[str, str], ...] = (
    ("micro_f1", "micro-F1"), ("m1_P1_p_pos", "M1 P1"), ("m1_P2_p_pos", "M1 P2"),
    ("m1_P2C_p_pos", "M1 P2C"), ("las", "LAS"), ("bleu4", "BLEU-4"), ("ppl", "PPL"))
"""Per-note columns of ``per_note_metrics.csv`` paired between two evaluate runs (App. L.5:
micro-F1, M1 at P2C and LAS), those both runs have. **[recon]** M1 at P1 and P2, BLEU-4 and PPL
are paired too, where both runs have them."""
OWN_HEADS_MEASURE = "recovery_own"
"""The per-note column of ``own_heads_per_note.csv`` paired between two own-heads runs (App. L.6:
M4, the own top-k's knock-in recovery), per traces, phase and k."""


def parse_replicate_pairs(runs: Sequence[str]) -> list[tuple[str, str]]:
    """Run ids taken in pairs (run a, run b, run a, run b, ...) as ``[(a, b), ...]``; an odd
    count, or a run paired with itself, raises :class:`MistillInputError` naming
    ``replicate_runs``."""
    if len(runs) % 2:
        raise MistillInputError(f"replicate_runs takes runs in pairs, got {len(runs)}", field="replicate_runs")
    out = [(str(runs[i]), str(runs[i + 1])) for i in range(0, len(runs), 2)]
    for a, b in out:
        if a == b:
            raise MistillInputError(f"replicate_runs pairs run {a} with itself", field="replicate_runs")
    return out


def replicate_differences(a: pd.DataFrame, b: pd.DataFrame, measures: Sequence[tuple[str, str]],
                          keys: Sequence[str] = ()) -> pd.DataFrame:
    """Run a's and run b's per-note tables paired by note (and ``keys``, e.g. traces, phase and
    k): long rows ``*keys, measure, note_id, a, b, difference`` (a - b) for every measure both
    tables have, on the notes both have a finite value for."""
    cols = ["note_id", *keys]
    out = []
    for column, label in measures:
        if column not in a.columns or column not in b.columns:
            continue
        left = a[[*cols, column]].groupby(cols, sort=True)[column].mean()
        right = b[[*cols, column]].groupby(cols, sort=True)[column].mean()
        both = pd.concat({"a": left, "b": right}, axis=1, join="inner").dropna().reset_index()
        if both.empty:
            continue
        both["difference"] = both["a"] - both["b"]
        both.insert(0, "measure", label)
        out.append(both[[*keys, "measure", "note_id", "a", "b", "difference"]])
    if not out:
        return pd.DataFrame(columns=[*keys, "measure", "note_id", "a", "b", "difference"])
    return pd.concat(out, ignore_index=True)


def replicate_table(differences: pd.DataFrame, keys: Sequence[str] = (), *,
                    n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """Per measure (and ``keys``): the notes paired, each run's mean and median over them, the
    difference of the medians, and the paired tests of a - b over notes
    (:func:`mistill.stats.difference_tests`: mean with its bootstrap 95% interval, median,
    Wilcoxon and exact sign-test p, notes higher/lower/tied)."""
    if differences.empty:
        return pd.DataFrame()
    rows = []
    for group, sub in differences.groupby([*keys, "measure"], sort=False):
        group = group if isinstance(group, tuple) else (group,)
        rec: dict[str, Any] = dict(zip([*keys, "measure"], group))
        rec.update(a_mean=float(sub["a"].mean()), b_mean=float(sub["b"].mean()),
                   a_median=float(sub["a"].median()), b_median=float(sub["b"].median()))
        rec["median_a_minus_b"] = rec["a_median"] - rec["b_median"]
        rec.update(paired.difference_row(stats.difference_tests(sub["difference"].to_numpy(),
                                                                n_resamples=n_resamples, seed=seed)))
        rows.append(rec)
    return pd.DataFrame.from_records(rows)


def top_k_agreement(sets_a: Mapping[str, Any] | None, sets_b: Mapping[str, Any] | None, phase: str,
                    k: int) -> dict[str, Any]:
    """Whether two own-heads runs ranked the same heads (``own_heads_sets.json``: phase -> heads in
    rank order): ``top_k_overlap`` (heads in both top-k) and ``same_order`` (the two top-k
    identical in order); empty when either ranking is missing or shorter than k."""
    if not isinstance(sets_a, Mapping) or not isinstance(sets_b, Mapping):
        return {}
    a, b = sets_a.get(phase), sets_b.get(phase)
    if not isinstance(a, list) or not isinstance(b, list) or len(a) < k or len(b) < k:
        return {}
    return {"top_k_overlap": len(set(a[:k]) & set(b[:k])), "same_order": list(a[:k]) == list(b[:k])}


def replicate_display(table: pd.DataFrame) -> pd.DataFrame:
    """The replicate pairing as printed: the pair, what was compared, notes, each run's mean
    (median), Δ mean [95% CI], Δ median, higher/lower/tied, sign and Wilcoxon p, and for
    own-heads pairs the top-k agreement."""
    out = []
    for _, r in table.iterrows():
        rec: dict[str, Any] = {"pair": int(r["pair"]), "stage": r["stage"], "run a": r["run_a_name"],
                               "run b": r["run_b_name"], "same checkpoint": "yes" if r["same_checkpoint"] else "no",
                               "measure": r["measure"]}
        if r["stage"] == "own_heads":
            rec["traces / phase / k"] = f"{r['traces']} / {r['phase']} / {int(r['k'])}"
        rec.update({"notes": int(r["n"]),
                    "a mean (median)": f"{r['a_mean']:.3f} ({r['a_median']:.3f})",
                    "b mean (median)": f"{r['b_mean']:.3f} ({r['b_median']:.3f})",
                    "Δ mean [95% CI]": tables.fmt_ci(r["mean_diff"], r["ci_low"], r["ci_high"]),
                    "Δ median": format_cell(r["median_diff"]),
                    "higher/lower/tied": f"{int(r['n_higher'])}/{int(r['n_lower'])}/{int(r['n_tied'])}",
                    "sign p": format_cell(r["sign_p"], p_value=True),
                    "Wilcoxon p": format_cell(r["wilcoxon_p"], p_value=True)})
        if "top_k_overlap" in table.columns:
            overlap = _get(r, "top_k_overlap")
            rec["top-k shared (same order)"] = "" if overlap is None else \
                f"{int(overlap)}/{int(r['k'])} ({'yes' if bool(r['same_order']) else 'no'})"
        out.append(rec)
    return pd.DataFrame.from_records(out).fillna("")
