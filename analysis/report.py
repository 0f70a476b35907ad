"""Assemble the report: find the input runs, build every table and figure they allow, and say
which ones were skipped and why.

:func:`collect_inputs` queries the tracking store (FINISHED runs only, the newest of each model,
arm, precision and seed); :func:`build_report` turns them into a :class:`Report` of tables
(numeric and display frames), plotly figures and notes. Nothing here writes to MLflow: the
``report`` stage (:mod:`mistill.stages.report`) logs the result.

A kind of run that is absent (no ``evaluate``, ``own_heads``, ``knockin`` or ``select_lambda``
runs, no reference arm, a missing artifact) skips the tables that need it with a note in the
report; it never stops the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from mlflow.tracking import MlflowClient

from analysis import figures, query, tables
from mistill import stats
from mistill.errors import MistillInputError
from mistill.instrument.settables import to_markdown

__all__ = ["STAGES", "Report", "ReportInputs", "ReportTable", "build_report", "collect_inputs"]

STAGES: tuple[str, ...] = ("knockin", "evaluate", "own_heads", "select_lambda")
"""The kinds of run the report reads (``mistill.stage`` tag)."""

PER_NOTE_METRICS = "per_note_metrics.csv"
OWN_HEADS_PER_NOTE = "own_heads_per_note.csv"
PER_NOTE_SETS = "per_note_sets.csv"
LAMBDA_CELLS = "cells.csv"
DECISION = "decision.json"

_KEYS: dict[str, tuple[str, ...]] = {"knockin": ("model",), "evaluate": query.RUN_KEY,
                                     "own_heads": query.RUN_KEY,
                                     "select_lambda": query.RUN_KEY}
_ARMED = ("evaluate", "own_heads")  # stages whose runs the ``arms`` filter applies to


@dataclass
class ReportInputs:
    """The runs a report reads: per stage one row per run (:func:`analysis.query.stage_runs`)."""

    experiment: str
    runs: dict[str, pd.DataFrame]

    def lineage(self) -> dict[str, str]:
        """``{"<stage>.<run id>": run id}`` for every input run (the report run's inputs)."""
        return {f"{stage}.{rid}": rid for stage, df in self.runs.items()
                for rid in (df["run_id"] if not df.empty else [])}

    def privacy(self) -> str:
        """The strictest privacy level among the inputs (``restricted`` when none is known)."""
        levels = {str(v) for df in self.runs.values() if not df.empty
                  for v in df["privacy"].dropna()}
        if not levels or "restricted" in levels or not levels <= {"public", "synthetic"}:
            return "restricted"
        return "public" if "public" in levels else "synthetic"


@dataclass
class ReportTable:
    """One table: numeric frame (CSV), display frame (Markdown/LaTeX), title and caption."""

    name: str
    title: str
    caption: str
    numeric: pd.DataFrame
    display: pd.DataFrame


@dataclass
class Report:
    """Tables, figures (name -> plotly figure) and notes (skipped tables, missing artifacts)."""

    experiment: str
    reference_arm: str
    tables: list[ReportTable] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def table(self, name: str) -> ReportTable:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    def markdown(self) -> str:
        """The whole report as one Markdown document."""
        lines = [f"# mistill report: {self.experiment}", "",
                 f"Reference arm: `{self.reference_arm}`. Input runs (FINISHED, newest per "
                 "model, arm, precision and seed): "
                 + ", ".join(f"{k} {v}" for k, v in self.counts.items()) + ".", ""]
        for t in self.tables:
            lines += [f"## {t.title}", "", t.caption, "", to_markdown(t.display)]
        if self.figures:
            lines += ["## Figures", ""] + [f"- `figures/{n}.html`" for n in self.figures] + [""]
        if self.notes:
            lines += ["## Skipped and missing", ""] + [f"- {n}" for n in self.notes] + [""]
        return "\n".join(lines)


def collect_inputs(client: MlflowClient, experiment: str, *, arms: Sequence[str] = (),
                   reference_arm: str = "", split: str = "test") -> ReportInputs:
    """The newest FINISHED run of each (model, arm, precision, seed) of every stage in
    :data:`STAGES` (``knockin``: the newest per model). ``arms`` (non-empty) restricts the
    ``evaluate`` and ``own_heads`` runs to those arms plus the reference, the teacher and the
    untrained student; of those, only runs on ``split`` are read (the λ selection's
    validation evaluations are not test results; runs without a split tag are kept)."""
    keep = tuple(dict.fromkeys([*arms, reference_arm, tables.TEACHER_ARM,
                                tables.UNTRAINED_ARM])) if arms else ()
    runs = {}
    for stage in STAGES:
        df = query.stage_runs(client, experiment, stage, arms=keep if stage in _ARMED else ())
        if stage in _ARMED and not df.empty:
            df = df[df["split"].isna() | (df["split"] == split)]
        runs[stage] = query.latest_runs(df, _KEYS[stage])
    return ReportInputs(experiment, runs)


def build_report(inputs: ReportInputs, *, reference_arm: str,
                 n_resamples: int = stats.N_BOOTSTRAP,
                 corpus_resamples: int = stats.N_BOOTSTRAP_CORPUS, seed: int = 0) -> Report:
    """Every table and figure the inputs allow; the rest named in :attr:`Report.notes`."""
    rep = Report(inputs.experiment, reference_arm,
                 counts={s: len(df) for s, df in inputs.runs.items()})
    _global_sets(rep, inputs.runs["knockin"])
    task_notes = _task(rep, inputs.runs["evaluate"], n_resamples, corpus_resamples, seed)
    _own_heads(rep, inputs.runs["own_heads"], inputs.runs["evaluate"], task_notes,
               n_resamples, seed)
    _lambda(rep, inputs.runs["select_lambda"])
    return rep


# ---------------------------------------------------------------------------------- sections
def _load(rep: Report, runs: pd.DataFrame, artifact: str, required: Sequence[str],
          run_columns: Sequence[str] = ("run_id", *query.RUN_KEY)) -> pd.DataFrame:
    loaded = query.per_note_table(runs, artifact, required, run_columns)
    for run_id, why in loaded.missing.items():
        rep.notes.append(f"run {run_id}: {why}")
    return loaded.frame


def _skip(rep: Report, what: str, why: str) -> None:
    rep.notes.append(f"{what} skipped: {why}.")


def _global_sets(rep: Report, runs: pd.DataFrame) -> None:
    what = "Tables 1/10 (global head sets) and the recovery-against-k figure"
    if runs.empty:
        return _skip(rep, what, "no FINISHED knockin runs")
    rows = _load(rep, runs, PER_NOTE_SETS,
                 ["note_id", "phase", "k", "set", "necessity", "recovery"], ("run_id", "model"))
    if rows.empty:
        return _skip(rep, what, f"no knockin run has {PER_NOTE_SETS}")
    table = tables.global_sets_table(rows)
    ks = sorted(int(k) for k in table["k"].unique())
    rep.tables.append(ReportTable(
        "table10_global_sets", "Table 10: global per-phase sets at every k",
        "Necessity (share of the clean margin destroyed by mean-ablation; >1: flipped) and "
        "knock-in recovery in another note's context, medians over notes, against "
        "count-matched random and bottom-k sets; notes: where the global set beats random / "
        "notes compared.", table, tables.global_sets_display(table)))
    table1_ks = [k for k in ks if k != 16] or ks
    rep.tables.append(ReportTable(
        "table1_global_sets", "Table 1: global per-phase sets",
        f"Table 10 at k in {table1_ks} (k=16 only in Table 10).",
        table[table["k"].isin(table1_ks)].reset_index(drop=True),
        tables.global_sets_display(table, table1_ks)))
    _figure(rep, "recovery_vs_k_global", figures.recovery_long_from_sets(rows),
            "Knock-in recovery of the global sets",
            "median over notes against k; dashed: count-matched random and bottom-k floors")


def _figure(rep: Report, name: str, long: pd.DataFrame, title: str, subtitle: str) -> None:
    """A recovery figure, or a note saying why there is none (no finite recovery to plot)."""
    if long.dropna(subset=["recovery"]).empty:
        _skip(rep, f"figure {name}", "no finite recovery values (no event passed the range gate)")
        return
    rep.figures[name] = figures.recovery_figure(long, title, subtitle)


def _task(rep: Report, runs: pd.DataFrame, n_resamples: int, corpus_resamples: int,
          seed: int) -> pd.DataFrame | None:
    """Tables 2 and 43; returns the per-note task table (for Table 45's task lines)."""
    if runs.empty:
        _skip(rep, "Table 2 (task and fidelity) and Table 43 (paired differences)",
              "no FINISHED evaluate runs")
        return None
    t2 = tables.task_table(runs, rep.reference_arm)
    rep.tables.append(ReportTable(
        "table2_task_fidelity", "Table 2: task and fidelity per arm",
        "Corpus-level metrics of each evaluate run, mean ± sd over seeds (single-seed rows "
        "marked [1 seed]); gap recovered: (arm - untrained) / (teacher - untrained) on "
        "micro-F1.", t2, tables.task_display(t2)))
    per_note = _load(rep, runs, PER_NOTE_METRICS, ["note_id", "micro_f1"])
    what = "Table 43 (paired differences against the reference)"
    if per_note.empty:
        _skip(rep, what, f"no evaluate run has {PER_NOTE_METRICS}")
        return None
    if not (per_note["arm"] == rep.reference_arm).any():
        _skip(rep, what, f"no evaluate run of the reference arm {rep.reference_arm!r}")
        return per_note
    try:
        t43, diffs = tables.task_paired_table(per_note, rep.reference_arm,
                                              n_resamples=n_resamples,
                                              corpus_resamples=corpus_resamples, seed=seed)
    except MistillInputError as exc:
        _skip(rep, what, str(exc))
        return per_note
    if t43.empty:
        _skip(rep, what, "no arm shares a model with the reference arm")
        return per_note
    rep.tables.append(ReportTable(
        "table43_paired", "Table 43: paired differences behind Table 2",
        f"Arm minus {rep.reference_arm} on the same notes, seed-averaged per note: mean "
        f"difference with a percentile bootstrap 95% interval ({n_resamples} resamples), "
        "two-sided Wilcoxon signed-rank p (zeros dropped), exact sign-test p, notes "
        "higher/lower/tied; for micro-F1 also the corpus-level difference with notes "
        f"resampled ({corpus_resamples}) and its bootstrap p.", t43, tables.paired_display(t43)))
    rep.figures["paired_differences_task"] = figures.paired_differences_figure(
        diffs, t43, f"Per-note differences against {rep.reference_arm}",
        "seed-averaged per note; red: mean with its bootstrap 95% interval")
    return per_note


def _own_heads(rep: Report, runs: pd.DataFrame, eval_runs: pd.DataFrame,
               task_notes: pd.DataFrame | None, n_resamples: int, seed: int) -> None:
    what = "Tables 3/45 (own-heads readouts) and the own-heads recovery figure"
    if runs.empty:
        return _skip(rep, what, "no FINISHED own_heads runs")
    per_note = _load(rep, runs, OWN_HEADS_PER_NOTE,
                     ["note_id", "phase", "k", "recovery_own", "recovery_random"])
    if per_note.empty:
        return _skip(rep, what, f"no own_heads run has {OWN_HEADS_PER_NOTE}")
    seeds = tables.own_heads_seed_table(per_note, runs, eval_runs, rep.reference_arm)
    t3 = tables.own_heads_table(seeds, rep.reference_arm)
    rep.tables.append(ReportTable(
        "table3_own_heads", "Table 3: mechanism on each arm's own heads",
        "Knock-in recovery of the own top-k per phase (median over notes, then mean ± sd over "
        "seeds; random-k floor in parentheses), then the run readouts (M2 region lift, prefix "
        "share, M3 near-miss share) and the task micro-F1 of the same seeds.",
        t3, tables.own_heads_display(t3)))
    rep.tables.append(ReportTable(
        "table45_own_heads_seeds", "Table 45: own-heads readouts per seed",
        "Per seed: medians over notes, random-k floors in parentheses; task: that seed's "
        "micro-F1.", seeds, tables.own_heads_seed_display(seeds)))
    _figure(rep, "recovery_vs_k_own", figures.recovery_long_from_own(per_note), "Own-heads knock-in recovery",
            "mean over seeds of medians over notes, against k; dashed: random-k floors")
    cmp_what = "Table 45 seed-matched comparisons"
    if not (per_note["arm"] == rep.reference_arm).any():
        return _skip(rep, cmp_what, f"no own_heads run of the reference arm "
                                    f"{rep.reference_arm!r}")
    try:
        t45, diffs = tables.own_heads_paired_table(per_note, rep.reference_arm, task_notes,
                                                   n_resamples=n_resamples, seed=seed)
    except MistillInputError as exc:
        return _skip(rep, cmp_what, str(exc))
    if t45.empty:
        return _skip(rep, cmp_what, "no arm shares a model with the reference arm")
    rep.tables.append(ReportTable(
        "table45_seed_matched", "Table 45: seed-matched comparisons",
        f"Arm minus {rep.reference_arm}, seed i against seed i (a one-seed side pairs with "
        "every seed), note-clustered: per note the mean of its seed pairs' differences, then "
        "the tests over notes (bootstrap 95% interval of the mean, Wilcoxon, sign test); "
        "pooled note-pair counts are in the CSV, descriptive only.",
        t45, tables.paired_display(t45)))
    rep.figures["paired_differences_own_heads"] = figures.paired_differences_figure(
        diffs, t45, f"Seed-matched differences against {rep.reference_arm}",
        "per note, the mean over its seed pairs; red: mean with its bootstrap 95% interval")


def _selection_columns(run_id: str) -> dict[str, str]:
    """``{<lock's metric>: "metric", <lock's tie-break>: "tie_break"}`` from the run's
    ``decision.json`` (the ``select_lambda`` stage names those columns after its lock)."""
    from mistill.io import read_json
    from mistill.stages.common import RunReader

    try:
        rule = read_json(RunReader(run_id, field=DECISION).file(DECISION))["lock"]["selection"]
        return {str(rule["metric"]): "metric", str(rule["tie_break"]): "tie_break"}
    except (MistillInputError, OSError, KeyError, TypeError, ValueError):
        return {}


def _lambda_cells(rep: Report, runs: pd.DataFrame) -> pd.DataFrame:
    """Every run's cells with ``metric`` and ``tie_break`` columns (named so in ``cells.csv``,
    or after the lock's metric and tie-break as ``decision.json`` says) and ``picked``."""
    frames = []
    for i in range(len(runs)):
        cells = _load(rep, runs.iloc[[i]], LAMBDA_CELLS, ["lambda_p1", "lambda_p2", "state"])
        if cells.empty:
            continue
        if not {"metric", "tie_break"} <= set(cells.columns):
            cells = cells.rename(columns=_selection_columns(runs["run_id"].iloc[i]))
        if not {"metric", "tie_break"} <= set(cells.columns):
            rep.notes.append(f"run {runs['run_id'].iloc[i]}: {LAMBDA_CELLS} has no metric and "
                             f"tie-break columns, and {DECISION} does not name them")
            continue
        if "picked" not in cells.columns:
            cells["picked"] = False
        frames.append(cells)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _lambda(rep: Report, runs: pd.DataFrame) -> None:
    what = "The λ validation frontier"
    if runs.empty:
        return _skip(rep, what, "no FINISHED select_lambda runs")
    cells = _lambda_cells(rep, runs)
    if cells.empty:
        return _skip(rep, what, f"no select_lambda run has a readable {LAMBDA_CELLS}")
    names = dict(zip(runs["run_id"], runs["run_name"]))
    cells.insert(0, "selection", cells["run_id"].map(names).fillna(cells["run_id"]))
    cells["picked"] = cells["picked"].astype(str).str.lower().isin(["true", "1"])
    cols = ["selection", "model", "arm", "lambda_p1", "lambda_p2", "metric", "tie_break",
            "state", "picked"]
    shown = cells[cols].sort_values(["selection", "lambda_p1", "lambda_p2"]).reset_index(
        drop=True)
    rep.tables.append(ReportTable(
        "lambda_cells", "λ selection cells",
        "Validation metric and tie-break per grid cell, the pick marked.", shown, shown))
    rep.figures["lambda_frontier"] = figures.lambda_frontier_figure(cells)
