"""Assemble the report: find the input runs, build every table and figure they allow, and say
which ones were skipped and why.

:func:`collect_inputs` queries the tracking store (FINISHED runs only, the newest of each model,
arm, precision and seed); :func:`build_report` turns them into a :class:`Report` of tables
(numeric and display frames), plotly figures and notes. Nothing here writes to MLflow: the
``report`` stage (:mod:`mistill.stages.report`) logs the result.

A kind of run that is absent (no ``evaluate``, ``own_heads``, ``knockin`` or ``select_lambda``
runs, no reference arm, a missing artifact) skips Tables 1/10, 2, 43 and 3/45 with a note in the
report; it never stops the report. Tables 11, 15, 39-42 and 47-51 and App. M.3's carriers are
always listed: where the runs read hold no data for them, their rows are empty and say why
(:attr:`ReportTable.reason` and the ``note`` column).

The report also names every deviation from the paper it finds in the runs it reads
(:mod:`analysis.run_deviations`): registry parameters at a value other than the default or the
paper's, and the runs' own ``mistill.deviation`` tags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from analysis import (ablation_tables, characterization, figures, locus_figures, query, run_deviations,
                      selection_tables as seltab, tables)
from analysis.audit import stratified_readouts
from analysis.edit_tables import edit_pairs_table
from mistill import stats
from mistill.errors import MistillInputError
from mistill.instrument.settables import to_markdown
from mistill.io import read_json
from mistill.stages.common import RunReader

__all__ = ["MIN_TEST_NOTES", "MIN_TRAIN_STEPS", "STAGES", "EvidenceSize", "Report", "ReportInputs",
           "ReportTable", "build_report", "collect_inputs", "evidence_size"]

STAGES: tuple[str, ...] = ("knockin", "evaluate", "own_heads", "select_lambda")
"""The kinds of run the report reads (``mistill.stage`` tag) for Tables 1/10, 2, 43 and 3/45,
the newest of each cell; it also reads the ``attribute`` runs the knockin runs name, every
``train`` run, and every ``evaluate`` and ``own_heads`` run of any split
(:attr:`ReportInputs.extra`)."""

PER_NOTE_METRICS = "per_note_metrics.csv"
OWN_HEADS_PER_NOTE = "own_heads_per_note.csv"
PER_NOTE_SETS = "per_note_sets.csv"
LAMBDA_CELLS = "cells.csv"
DECISION = "decision.json"

MIN_TEST_NOTES = 30
"""Fewer test notes than this behind the task table (Tables 2/43) make the report add
"Reading these numbers at this size": task micro-F1, validity and fidelity on so few notes say
little about an arm, while the per-event readouts (teacher-forced M1, knock-in recovery against
random sets, own-heads readouts) still rest on many events per note. A reading aid only: no
table's numbers depend on it; 30 is a conventional floor for a mean over notes."""

MIN_TRAIN_STEPS = 100
"""A trained arm whose train run ran fewer optimiser steps (``train/steps``) than this
makes the report add "Reading these numbers at this size": such an arm is barely moved from the
untrained student, so its task and fidelity numbers are not evidence about its objective. A
reading aid only, like :data:`MIN_TEST_NOTES`."""

_KEYS: dict[str, tuple[str, ...]] = {"knockin": ("model",), "evaluate": query.RUN_KEY,
                                     "own_heads": query.RUN_KEY,
                                     "select_lambda": query.RUN_KEY}
_ARMED = ("evaluate", "own_heads")  # stages whose runs the ``arms`` filter applies to


@dataclass
class ReportInputs:
    """The runs a report reads: per stage one row per run (:func:`analysis.query.stage_runs`)."""

    experiment: str
    runs: dict[str, pd.DataFrame]
    extra: dict[str, pd.DataFrame] = field(default_factory=dict)
    """``attribute``, ``train``, ``evaluate_all`` and ``own_heads_all``: runs read beyond the
    newest of each cell (the last two: every split, every run)."""

    def frames(self) -> list[pd.DataFrame]:
        return [df for df in (*self.runs.values(), *self.extra.values()) if not df.empty]

    def lineage(self) -> dict[str, str]:
        """``{"<stage>.<run id>": run id}`` for every input run (the report run's inputs)."""
        out = {f"{stage}.{rid}": rid for stage, df in self.runs.items()
               for rid in (df["run_id"] if not df.empty else [])}
        for df in self.extra.values():
            for stage, rid in zip(df.get("stage", []), df.get("run_id", [])):
                out.setdefault(f"{stage}.{rid}", rid)
        return out

    def all_runs(self) -> list[dict[str, Any]]:
        """Every input run once (its row: run id, name, stage, arm, tags)."""
        seen: dict[str, dict[str, Any]] = {}
        for df in self.frames():
            for rec in df.to_dict("records"):
                seen.setdefault(str(rec["run_id"]), rec)
        return list(seen.values())

    def privacy(self) -> str:
        """The strictest privacy level among the inputs (``restricted`` when none is known)."""
        levels = {str(v) for df in self.frames() for v in df["privacy"].dropna()}
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
    reason: str = ""
    """Why the table has no rows (empty when it has some)."""


@dataclass
class Report:
    """Tables, figures (name -> plotly figure) and notes (skipped tables, missing artifacts)."""

    experiment: str
    reference_arm: str
    tables: list[ReportTable] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    deviations: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(
        columns=list(run_deviations.FINDING_COLUMNS)))
    deviation_tags: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(
        columns=list(run_deviations.TAG_COLUMNS)))
    deviation_problems: list[str] = field(default_factory=list)
    size_section: list[str] = field(default_factory=list)
    """The "Reading these numbers at this size" section's lines (empty when the evidence is
    not small: :meth:`EvidenceSize.section`)."""

    def table(self, name: str) -> ReportTable:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    def deviations_json(self) -> dict[str, Any]:
        """The ``deviations.json`` artifact: findings, tags and unreadable runs."""
        return {"findings": _records(self.deviations), "tags": _records(self.deviation_tags),
                "problems": list(self.deviation_problems)}

    def deviations_markdown(self) -> list[str]:
        """The "Deviations in these runs" section."""
        lines = ["## Deviations in these runs", "",
                 "Registry parameters (docs/DEVIATIONS.md) whose recorded value in a run read is "
                 "not the platform's default, or is the default where the paper states another "
                 "value; then the runs' own `mistill.deviation` tags.", ""]
        if self.deviations.empty and self.deviation_tags.empty:
            lines += ["None found.", ""]
        if not self.deviations.empty:
            shown = self.deviations.rename(columns={"run_id": "run", "paper_value": "paper"})
            shown = shown[["run", "stage", "arm", "parameter", "value", "default", "paper",
                           "kind"]].astype(object).map(_cell_text)
            lines += [to_markdown(shown)]
        if not self.deviation_tags.empty:
            lines += ["Tags:", "", to_markdown(self.deviation_tags[
                ["run_id", "stage", "arm", "codes"]].rename(columns={"run_id": "run"}))]
        if self.deviation_problems:
            lines += [f"- {p}" for p in self.deviation_problems] + [""]
        return lines

    def markdown(self) -> str:
        """The whole report as one Markdown document."""
        lines = [f"# mistill report: {self.experiment}", "",
                 f"Reference arm: `{self.reference_arm}`. Input runs (FINISHED, newest per "
                 "model, arm, precision and seed): "
                 + ", ".join(f"{k} {v}" for k, v in self.counts.items()) + ".", ""]
        lines += self.size_section
        for t in self.tables:
            lines += [f"## {t.title}", "", t.caption, ""]
            if t.reason:
                lines += [f"No rows: {t.reason}.", ""]
            lines += [to_markdown(t.display)]
        lines += self.deviations_markdown()
        if self.figures:
            lines += ["## Figures", ""] + [f"- `figures/{n}.html`" for n in self.figures] + [""]
        if self.notes:
            lines += ["## Skipped and missing", ""] + [f"- {n}" for n in self.notes] + [""]
        return "\n".join(lines)


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: _plain(v) for k, v in rec.items()} for rec in df.to_dict("records")]


def _plain(value: Any) -> Any:
    """A JSON-ready value (tuples as lists, NaN as None, numpy scalars as Python)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    return value


def _cell_text(value: Any) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def collect_inputs(client: MlflowClient, experiment: str, *, arms: Sequence[str] = (),
                   reference_arm: str = "", split: str = "test") -> ReportInputs:
    """The newest FINISHED run of each (model, arm, precision, seed) of every stage in
    :data:`STAGES` (``knockin``: the newest per model). ``arms`` (non-empty) restricts the
    ``evaluate`` and ``own_heads`` runs to those arms plus the reference, the teacher and the
    untrained student; of those, only runs on ``split`` are read (the λ selection's
    validation evaluations are not test results; runs without a split tag are kept)."""
    keep = tuple(dict.fromkeys([*arms, reference_arm, tables.TEACHER_ARM,
                                tables.UNTRAINED_ARM])) if arms else ()
    runs = {"select_lambda": query.latest_runs(query.stage_runs(client, experiment,
                                                                "select_lambda"),
                                               _KEYS["select_lambda"])}
    train_all = query.stage_runs(client, experiment, "train")
    cell_train = _cell_train_runs(_selection_cells(runs["select_lambda"]), train_all)
    for stage in STAGES:
        if stage in runs:
            continue
        df = query.stage_runs(client, experiment, stage, arms=keep if stage in _ARMED else ())
        if stage in _ARMED and not df.empty:
            df = df[(df["split"].isna() | (df["split"] == split))
                    & ~df["train_run"].isin(cell_train)]
        runs[stage] = query.latest_runs(df, _KEYS[stage])
    runs = {stage: runs[stage] for stage in STAGES}
    extra = {"evaluate_all": query.stage_runs(client, experiment, "evaluate"),
             "own_heads_all": query.stage_runs(client, experiment, "own_heads"),
             "train": train_all}
    named = set(runs["knockin"]["attribute_run"].dropna()) if not runs["knockin"].empty else set()
    attribute = query.stage_runs(client, experiment, "attribute")
    extra["attribute"] = attribute[attribute["run_id"].isin(named)].reset_index(drop=True) \
        if not attribute.empty else attribute
    for stage in ("locus", *READ_SIDE_STAGES):
        found = query.stage_runs(client, experiment, stage)
        extra[stage] = query.latest_runs(found, ("model",)) if not found.empty else found
        if stage == "trace_edit":  # Table 22 pairs the students' runs by arm and seed
            extra["trace_edit_all"] = query.latest_runs(found, query.RUN_KEY) if not found.empty else found
    return ReportInputs(experiment, runs, extra)


@dataclass(frozen=True)
class TableChoices:
    """**[recon]** Choices of the tables the paper leaves open (``ReportConfig`` fields).

    importance_heads: Table 11 lists the heads in the top-``importance_heads`` of any phase.
    profile_k: a head "ranks high" in a phase (its write-side profile) when in the top
        ``profile_k``.
    layer_blocks: Table 11's layer blocks as fractions of the depth (the paper's 0-11 / 12-23 /
        24-31 / 32-39 of 40 layers).
    ce_steps: Table 48's optimiser steps.
    sign_alpha: Table 50 calls an ablation higher or lower than Mistill at P2C when the paired
        sign test's p is below it, else level (the paper marks pre-registered expectations).
    """

    importance_heads: int = 8
    profile_k: int = 40
    layer_blocks: tuple[float, ...] = (0.3, 0.6, 0.8)
    ce_steps: tuple[int, ...] = (5, 20, 60, 120)
    sign_alpha: float = 0.05


_ARM_KEY = ("arm", "seed", "precision")


def _cell_train_runs(cells: pd.DataFrame, train: pd.DataFrame) -> set[str]:
    """The train runs of λ-selection cells whose readouts are Table 42's, not an arm's.

    ``cells``: the stacked cell tables (``train_run``, ``picked``); ``train``: every train run
    read. A cell that was not picked is left out of the arm tables. A picked cell is the arm at its
    selected λ (the pipeline's own train step of that arm reuses it), so it stays, unless another
    train run of the same arm, seed and precision that is no cell exists (an arm retrained at the
    pick with the full recipe): then that run is the arm's.
    """
    if cells.empty or "train_run" not in cells.columns:
        return set()
    known = cells["train_run"].notna()
    runs = cells["train_run"].astype(str)
    picked = cells["picked"].astype(str).str.lower().isin(("true", "1")) if "picked" in cells.columns \
        else pd.Series(False, index=cells.index)
    picked_runs = set(runs[picked & known])
    out = set(runs[~picked & known]) - picked_runs
    if train.empty or not set(_ARM_KEY) <= set(train.columns):
        return out
    key_of = {str(r["run_id"]): tuple(str(r[c]) for c in _ARM_KEY) for _, r in train.iterrows()}
    retrained = {key_of[r] for r in key_of if r not in out and r not in picked_runs}
    return out | {r for r in picked_runs if key_of.get(r) in retrained}


def _selection_cells(selections: pd.DataFrame) -> pd.DataFrame:
    """Every selection's cell table, stacked (empty when none was read)."""
    if selections.empty:
        return pd.DataFrame()
    return query.per_note_table(selections, LAMBDA_CELLS, ["train_run"], ("run_id",)).frame


def build_report(inputs: ReportInputs, *, reference_arm: str,
                 n_resamples: int = stats.N_BOOTSTRAP,
                 corpus_resamples: int = stats.N_BOOTSTRAP_CORPUS, seed: int = 0,
                 choices: TableChoices = TableChoices(), split: str = "test",
                 client: MlflowClient | None = None, audit_labels: pd.DataFrame | None = None) -> Report:
    """Every table and figure the inputs allow; the rest named in :attr:`Report.notes`."""
    client = client or MlflowClient()
    rep = Report(inputs.experiment, reference_arm,
                 counts={s: len(df) for s, df in inputs.runs.items()})
    _global_sets(rep, inputs.runs["knockin"])
    task_notes = _task(rep, inputs.runs["evaluate"], n_resamples, corpus_resamples, seed)
    _own_heads(rep, inputs.runs["own_heads"], inputs.runs["evaluate"], task_notes,
               n_resamples, seed)
    cells = _lambda(rep, inputs.runs["select_lambda"])
    extra = _Extra.load(inputs, split)
    rep.counts.update({s: len(inputs.extra[s]) for s in ("attribute", "train")
                       if s in inputs.extra})
    _characterization(rep, client, extra, choices, n_resamples, seed)
    _locus(rep, inputs.extra.get("locus", pd.DataFrame()))
    _read_side(rep, {stage: inputs.extra.get(stage, pd.DataFrame()) for stage in READ_SIDE_STAGES})
    _audit(rep, inputs.runs["evaluate"], inputs.runs["own_heads"], audit_labels)
    _student_edits(rep, inputs.extra.get("trace_edit_all", pd.DataFrame()), reference_arm, n_resamples, seed)
    _selection(rep, inputs.runs["select_lambda"], cells, extra, n_resamples, seed)
    _ablations(rep, client, extra, cells, choices, n_resamples, seed)
    rep.size_section = evidence_size(inputs.runs["evaluate"], task_notes,
                                     inputs.extra.get("train", pd.DataFrame())).section()
    rep.deviations, rep.deviation_problems = run_deviations.run_deviations(inputs.all_runs())
    rep.deviation_tags = run_deviations.deviation_tags(inputs.all_runs())
    rep.notes = list(dict.fromkeys(rep.notes))
    return rep


# ------------------------------------------------------------------ how much evidence there is
def _span(values: Sequence[int], unit: str) -> str:
    """``"2 optimiser steps"``, ``"2 to 120 optimiser steps"`` (values: distinct, sorted)."""
    if not values:
        return f"an unknown number of {unit}"
    n = f"{values[0]}" if len(values) == 1 else f"{values[0]} to {values[-1]}"
    return f"{n} {unit[:-1] if values[-1] == 1 else unit}"


@dataclass(frozen=True)
class EvidenceSize:
    """How much the task numbers rest on: the test notes behind the task table, and the
    optimiser steps and training notes of the trained arms' train runs.

    test_notes: distinct test notes scored (None: no evaluate run read).
    train_steps, train_notes: the distinct ``train/steps`` and ``n_notes`` of the train runs,
        sorted (empty: no train run read, or none logged them).
    """

    test_notes: int | None = None
    train_steps: tuple[int, ...] = ()
    train_notes: tuple[int, ...] = ()

    @property
    def small(self) -> bool:
        """Fewer than :data:`MIN_TEST_NOTES` test notes, or a train run of fewer than
        :data:`MIN_TRAIN_STEPS` optimiser steps."""
        return ((self.test_notes is not None and self.test_notes < MIN_TEST_NOTES)
                or bool(self.train_steps and self.train_steps[0] < MIN_TRAIN_STEPS))

    def task_basis(self) -> str:
        """What the task numbers rest on, in words, e.g. ``"arms trained for 2 optimiser steps
        on 8 notes, scored on 8 test notes"``."""
        parts = []
        if self.train_steps or self.train_notes:
            parts.append(f"arms trained for {_span(self.train_steps, 'optimiser steps')} on "
                         f"{_span(self.train_notes, 'notes')}")
        if self.test_notes is not None:
            parts.append(f"scored on {_span((self.test_notes,), 'test notes')}")
        return ", ".join(parts) or "an unknown number of notes and steps"

    def section(self) -> list[str]:
        """The report's "Reading these numbers at this size" section (Markdown lines), or no
        lines when the evidence is not small."""
        if not self.small:
            return []
        return [
            "## Reading these numbers at this size", "",
            f"These runs are small: {self.task_basis()}. The report calls runs small below "
            f"{MIN_TEST_NOTES} test notes or {MIN_TRAIN_STEPS} optimiser steps "
            "(`analysis.report.MIN_TEST_NOTES`, `MIN_TRAIN_STEPS`).", "",
            "- **Meaningful at this size:** teacher-forced M1 (P(margin > 0) per event kind), "
            "knock-in recovery of the global sets against count-matched random sets (Tables "
            "1/10), and the own-heads readouts (Tables 3/45: own top-k recovery against random "
            "heads, region lift, near-miss share). Each is measured per event, many events per "
            "note, and the recoveries against a control on the same notes.",
            f"- **Not meaningful at this size:** task micro-F1, validity and fidelity of the "
            f"trained arms (Tables 2 and 43, and the task columns of the other tables): "
            f"{self.task_basis()}. Differences between arms there are not evidence about "
            f"their objectives.", ""]


def _ints(frame: pd.DataFrame, column: str) -> tuple[int, ...]:
    if frame.empty or column not in frame.columns:
        return ()
    values = pd.to_numeric(frame[column], errors="coerce").dropna()
    return tuple(sorted({int(v) for v in values}))


def evidence_size(evaluate: pd.DataFrame, task_notes: pd.DataFrame | None,
                  train: pd.DataFrame) -> EvidenceSize:
    """The size of the evidence behind the task table.

    evaluate: the evaluate runs of the task table (their ``n_notes`` metric is the fallback
    count of test notes); task_notes: their per-note table (distinct ``note_id`` counted when
    present); train: train runs (``train/steps``, ``n_notes`` metrics), restricted to those the
    evaluate runs name (``train_run``) when any are named.
    """
    if task_notes is not None and not task_notes.empty and "note_id" in task_notes.columns:
        test_notes: int | None = int(task_notes["note_id"].nunique())
    else:
        counts = _ints(evaluate, "n_notes")
        test_notes = counts[-1] if counts else None
    named = set(evaluate["train_run"].dropna()) if "train_run" in evaluate.columns else set()
    if not train.empty and named and train["run_id"].isin(named).any():
        train = train[train["run_id"].isin(named)]
    return EvidenceSize(test_notes, _ints(train, "train/steps"), _ints(train, "n_notes"))


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
    per_note = ablation_tables._traces(_load(  # with λ, for the figure's legend (arm and λ)
        rep, runs, OWN_HEADS_PER_NOTE, ["note_id", "phase", "k", "recovery_own",
                                        "recovery_random"], ("run_id", *query.RUN_KEY, "lambda")), "teacher")
    if per_note.empty:
        return _skip(rep, what, f"no own_heads run has {OWN_HEADS_PER_NOTE}")
    seeds = tables.own_heads_seed_table(per_note, runs, eval_runs, rep.reference_arm)
    t3 = tables.own_heads_table(seeds, rep.reference_arm)
    rep.tables.append(ReportTable(
        "table3_own_heads", "Table 3: mechanism on each arm's own heads",
        "Knock-in recovery of the own top-k per phase (median over notes, then mean ± sd over "
        "seeds; random-k floor in parentheses; in brackets the gated events and notes a seed's cell "
        "rests on, 'n too small' in place of a value below the minimum of analysis.evidence), then "
        "the run readouts (M2 region lift, prefix share, M3 near-miss share) and the task micro-F1 "
        "of the same seeds.",
        t3, tables.own_heads_display(t3)))
    rep.tables.append(ReportTable(
        "table45_own_heads_seeds", "Table 45: own-heads readouts per seed",
        "Per seed: medians over notes, random-k floors in parentheses, the gated events and notes "
        "behind each cell in brackets ('n too small' below the minimum); task: that seed's "
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


def _lambda(rep: Report, runs: pd.DataFrame) -> pd.DataFrame:
    """The λ cells table and frontier figure; returns every run's cells (empty without)."""
    what = "The λ validation frontier"
    if runs.empty:
        _skip(rep, what, "no FINISHED select_lambda runs")
        return pd.DataFrame()
    cells = _lambda_cells(rep, runs)
    if cells.empty:
        _skip(rep, what, f"no select_lambda run has a readable {LAMBDA_CELLS}")
        return cells
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
    return cells


# ------------------------------------------------------------------ always-listed tables
def _listed(rep: Report, name: str, title: str, caption: str, numeric: pd.DataFrame,
            display: pd.DataFrame, reason: str = "", columns: Sequence[str] = ()) -> None:
    """Add a table that is listed whether or not it has rows: without rows its display is one
    row of empty cells whose ``note`` says why (``reason``)."""
    if numeric.empty and not reason:
        reason = "no rows"
    if numeric.empty:
        cols = list(display.columns) or list(columns)
        display = pd.DataFrame([{**{c: "" for c in cols if c != "note"}, "note": reason}])
        numeric = pd.DataFrame(columns=list(numeric.columns) or [*cols, "note"])
    rep.tables.append(ReportTable(name, title, caption, numeric, display,
                                  reason if numeric.empty else ""))


_PER_NOTE_RUN_COLUMNS = ("run_id", "split", *query.RUN_KEY)


@dataclass
class _Extra:
    """The runs beyond the newest of each cell, with their per-note tables."""

    attribute: pd.DataFrame
    train: pd.DataFrame
    evaluate: pd.DataFrame
    own: pd.DataFrame
    eval_notes: pd.DataFrame
    own_notes: pd.DataFrame
    split: str

    @classmethod
    def load(cls, inputs: ReportInputs, split: str) -> _Extra:
        empty = pd.DataFrame(columns=["run_id", "run_name", "start_time", *query.TAG_COLUMNS])
        get = inputs.extra.get
        evaluate, own = get("evaluate_all", empty), get("own_heads_all", empty)
        eval_notes = query.per_note_table(evaluate, PER_NOTE_METRICS, ["note_id", "micro_f1"],
                                          _PER_NOTE_RUN_COLUMNS).frame
        own_notes = query.per_note_table(own, OWN_HEADS_PER_NOTE,
                                         ["note_id", "phase", "k", "recovery_own",
                                          "recovery_random"], _PER_NOTE_RUN_COLUMNS).frame
        return cls(get("attribute", empty), get("train", empty), evaluate, own,
                   _norm(eval_notes), _norm(own_notes), split)

    def test_runs(self, frame: pd.DataFrame, cell_train: set[str]) -> pd.DataFrame:
        """The newest run of each cell on the report's split (runs without a split tag kept),
        leaving out the readouts of λ-selection cells (``cell_train``: their train runs)."""
        if frame.empty:
            return frame
        on = frame[(frame["split"].isna() | (frame["split"] == self.split))
                   & ~frame["train_run"].isin(cell_train)]
        return query.latest_runs(on)


def _norm(frame: pd.DataFrame) -> pd.DataFrame:
    if frame.empty:
        return frame
    out = frame.copy()
    for col in ("model", "arm", "precision", "split"):
        if col in out.columns:
            out[col] = out[col].fillna("").astype(str)
    return out


# ---------------------------------------------------------------------- Tables 25-33, Figure 1
LOCUS_TABLES: tuple[tuple[str, str, str], ...] = (
    ("table25_suffixes", "Table 25: the locus under the forcing suffixes",
     "Outcome shares, the median distance of the window loci and the per-mention agreement with the "
     "run's suffix, on the same chapter mentions."),
    ("table26_outcomes", "Table 26: where the chapter can be elicited",
     "The forcing probe's outcome for every chapter mention, as a share of each column's mentions; "
     "the previous code is the code mentioned just before, in the same or in another chapter."),
    ("locus_distances", "Locus distances and robustness",
     "The window loci's distance before the letter, the jump across the crossing step, the share "
     "whose curve returns above theta, and the per-note window and inherited shares."),
    ("table27_locus_tokens", "Table 27: the locus token",
     "Each token class's share among all attribution-window tokens (base rate), among the window "
     "loci, and the lift."),
    ("table28_importance_position", "Table 28: where the importance sits",
     "Mean share of each attributed mention's positive importance (window plus suffix) at the locus, "
     "1-3, 4-15 and 16-63 tokens before it, and at the suffix."),
    ("table29_prose_time", "Table 29: the prose-time ranking",
     "Decision-specific importance summed over the attribution-window positions (I_c, nats, mean "
     "over notes) with its 95% bootstrap interval, and the head's rank in the emission-time chapter "
     "ranking; shared_top<k>: heads shared with the emission set's top-k."),
    ("table30_pass_a", "Table 30: pass A",
     "Share of the forced chapter margin destroyed by mean-ablating each set at the locus (medians "
     "over notes of per-note means, 10th-90th percentile over notes); window/suffix: restricted by "
     "position."),
    ("table31_follow_through", "Table 31: follow-through of the window ablation to the code",
     "Per set mean-ablated over the attribution window (sustained: to the code), the natural margin "
     "removed at the chapter letter after the original continuation, the ratio natural/forced on "
     "mentions whose forced drop exceeds one nat, and the share of natural decisions flipped."),
    ("table32_pass_b", "Table 32: pass B, the fixed prose-time set",
     "Share of the forced chapter margin destroyed by the global prose-time top-k at the window, the "
     "suffix and both, against random-k and the prose-time bottom-k at the window; notes on which "
     "the prose-time set beats random."),
    ("table33_locus_reads", "Table 33: what the prose-time heads read at the locus",
     "Attention at the locus token in the natural context, mean over loci, for four 16-head groups: "
     "share on the emitted chapter's lines (region), other lines, the note, the reasoning prose and "
     "the sink; region lift; n_eff over inventory tokens."),
    ("residual_swap", "Residual swap (Figure 5's data)",
     "Per place (locus, tail, code token) and layer: medians over mentions of the forced and natural "
     "margins after writing a donor mention's residual in."))


def _locus(rep: Report, runs: pd.DataFrame) -> None:
    """Tables 25-33 and Figure 1 from the newest ``locus`` run of each model."""
    if runs.empty:
        return _skip(rep, "Tables 25-33 and Figure 1 (the locus pass)", "no FINISHED locus runs")
    loaded: dict[str, pd.DataFrame] = {}
    for name, title, caption in LOCUS_TABLES:
        frame = _load(rep, runs, f"{name}.csv", [], ("run_id", "model"))
        loaded[name] = frame
        _listed(rep, name, title, caption, frame, frame.drop(columns=["run_id"], errors="ignore"),
                "" if not frame.empty else "the locus runs logged no rows for it")
    mentions = _load(rep, runs, "locus_mentions.csv", ["outcome", "distance"], ("run_id", "model"))
    for key, fig in locus_figures.figure1(mentions, loaded["table30_pass_a"], loaded["table32_pass_b"],
                                          loaded["table33_locus_reads"], loaded["table27_locus_tokens"]).items():
        rep.figures[key] = fig


# ---------------------------------------------------------------------- Tables 16-23
READ_SIDE_STAGES = ("read_side", "key_block", "trace_edit", "note_edit")
READ_SIDE_TABLES: tuple[tuple[str, str, str, str], ...] = (
    ("read_side", "readside_groups", "Table 16: what the decision heads read, by group",
     "Per phase, the region lift of the global top-k, the random panel and the bottom-k (per note: "
     "median over events per head, mean over heads; median over notes), the notes on which the top-k "
     "beats the random panel (sign test), and the top-k's shares on the sink, the inventory lines, the "
     "note, the trace prose and the code prefix."),
    ("read_side", "readside_heads_P1", "Table 17: the chapter (P1) top-k head by head",
     "I_c, median shares on the region, the prose and the sink, region lift, n_eff over inventory "
     "tokens, r across events between the region share and the head's importance, and the family by "
     "the stated rule (region reader / prose reader / mixed)."),
    ("read_side", "readside_heads_P2", "Table 18: the code (P2) top-k head by head", "As Table 17, at P2 events."),
    ("read_side", "readside_heads_P2C", "Table 19: the contrastive (P2C) top-k head by head",
     "As Table 17, at P2C events; r is taken between the share on the near-miss's earlier mentions "
     "and the head's importance."),
    ("key_block", "key_block", "Table 20: blocking what the named heads read",
     "E: the head's mean-ablation effect on the margin (share of events with E above the threshold); "
     "D: the margin lost when the head cannot attend to the keys it is named for, against the "
     "empty-set reference, and to as many matched control keys; share: median D/E over events with E "
     "above the threshold; right: the per-note mean of named minus control with its bootstrap "
     "interval, notes higher / lower and the sign test."),
    ("trace_edit", "trace_edit", "Table 21: editing the earlier mention of the near-miss",
     "Effect = margin under the identity edit minus margin under the replacement (positive: the edit "
     "lowered the margin), per replacement, with the sign and Wilcoxon tests; mediated: the median "
     "share of the change removed when the mediation set is mean-ablated during both reads, over "
     "events whose effect exceeds half a nat; paired rows: neutral minus each code replacement. "
     "Per run, so one row block per model (Table 22 compares the students' blocks)."),
    ("note_edit", "note_edit", "Table 23: editing the note",
     "The contrastive margin's change when the emitted code's distinguishing description words, the "
     "sibling's, matched other-chapter words or matched words in no description are replaced in the "
     "note (identity minus variant), over events with a distinguishing word in the note; per note, "
     "the code's words minus each control with its bootstrap interval and sign test."),
)


def _read_side(rep: Report, runs: dict[str, pd.DataFrame]) -> None:
    """Tables 16-23 from the newest run of each App. E stage per model (one row block per model)."""
    for stage, name, title, caption in READ_SIDE_TABLES:
        found = runs.get(stage, pd.DataFrame())
        if found.empty:
            frame, why = pd.DataFrame(), f"no FINISHED {stage} runs"
        else:
            frame = _load(rep, found, f"{name}.csv", [], ("run_id", "model"))
            why = "" if not frame.empty else f"the {stage} runs logged no rows for it"
        _listed(rep, f"appE_{name}", title, caption, frame, frame.drop(columns=["run_id"], errors="ignore"), why,
                columns=("model",))


def _student_edits(rep: Report, runs: pd.DataFrame, reference_arm: str, n_resamples: int, seed: int) -> None:
    """Table 22: every arm's trace edits against the reference arm's, per seed pair and pooled."""
    name, title = "table22_student_edits", "Table 22: the trace edits on the students"
    caption = ("Per note, the mean edit effect over the three replacements on the events both arms' runs "
               f"edited; each arm minus the reference arm ({reference_arm}) per seed pair, and pooled with "
               "the note as the cluster (bootstrap-over-notes 95% interval; notes higher / lower; sign test). "
               "The ordering is a property of the trained pair.")
    cols = ["arm", "pair", "n_notes", "arm_mean", "reference_mean", "difference", "ci_low", "ci_high",
            "notes_higher", "notes_lower", "sign_p"]
    students = runs[runs["arm"].notna()] if not runs.empty and "arm" in runs.columns else pd.DataFrame()
    if students.empty:
        return _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(),
                       "no FINISHED trace_edit runs of a trained arm", columns=cols)
    events = _load(rep, students, "trace_edit_events.csv", ["event_id"], ("run_id", "arm", "seed"))
    table = edit_pairs_table(events, reference_arm, n_resamples=n_resamples, seed=seed)
    _listed(rep, name, title, caption, table, table,
            "" if len(table) else f"no arm's trace_edit runs pair with the reference arm's ({reference_arm})",
            columns=cols)


def _audit(rep: Report, evaluate: pd.DataFrame, own: pd.DataFrame, labels: pd.DataFrame | None) -> None:
    """Table 24: M1 and own-heads knock-in recovery at k=40 on the audited contrastive events, per
    model, arm, precision and seed (an ``evaluate`` run and the ``own_heads`` run of the same key)."""
    name, title = "table24_audited_events", "Table 24: the readouts on the audited contrastive events"
    caption = ("M1 (share of the labeled P2C events where the model's teacher-forced margin favours the "
               "teacher's choice) and own-heads knock-in recovery at k=40 (mean over gated events), on the "
               "verified rejections and on the other labeled events (enumerations and the remaining classes).")
    cols = ["model", "arm", "precision", "seed", "stratum", "m1_n", "m1_p_pos", "knockin_n", "recovery_k40"]
    if labels is None:
        return _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(),
                       "no audit labels given (ReportConfig.audit_labels)", columns=cols)
    if evaluate.empty:
        return _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(), "no FINISHED evaluate runs",
                       columns=cols)
    m1 = _load(rep, evaluate, "m1_events.csv", ["event_id", "kind", "margin"])
    kin = _load(rep, own, "own_heads_knockin_events.csv", ["event_id", "phase", "k", "recovery", "gated"]) \
        if not own.empty else pd.DataFrame()
    if len(kin):
        kin = kin[kin["traces"] == "teacher"]
    rows = []
    for key, m1_run in (m1.groupby(list(query.RUN_KEY), dropna=False, sort=True) if len(m1) else []):
        kin_run = kin
        if len(kin):
            match = pd.Series(True, index=kin.index)
            for col, value in zip(query.RUN_KEY, key):
                match &= kin[col].astype(str) == str(value)
            kin_run = kin[match]
        table = stratified_readouts(labels, m1_run, kin_run, k=40)
        for col, value in reversed(list(zip(query.RUN_KEY, key))):
            table.insert(0, col, value)
        rows.append(table)
    frame = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=cols)
    _listed(rep, name, title, caption, frame, frame, "" if len(frame) else "no evaluate run logged m1_events",
            columns=cols)


# ---------------------------------------------------------------------- Tables 11 and 15
def _characterization(rep: Report, client: MlflowClient, extra: _Extra, choices: TableChoices,
                      n_resamples: int, seed: int) -> None:
    runs = extra.attribute
    why = "" if not runs.empty else \
        "no knockin run read names an attribute run (the characterization's ranking)"
    t11, t11d, layers = [], [], []
    for _, run in runs.iterrows():
        try:
            data = characterization.load_calibration(client, run["run_id"], str(run["model"]))
            table = characterization.importance_table(
                data, top_k=choices.importance_heads, profile_k=choices.profile_k,
                n_resamples=n_resamples, seed=seed)
            t11.append(table)
            t11d.append(characterization.importance_display(table))
            layers.append(characterization.layer_table(data, bounds=choices.layer_blocks))
        except MistillInputError as exc:
            why = str(exc)
    cat = (lambda frames: pd.concat(frames, ignore_index=True) if frames else pd.DataFrame())
    _listed(rep, "table11_importance", "Table 11: decision-specific importance of representative "
            "heads",
            f"I_c (nats; mean over notes of per-note I_c) with its percentile bootstrap 95% "
            f"interval over notes ({n_resamples} resamples) and its rank among all heads, per "
            f"phase, for the heads in the top {choices.importance_heads} of any phase; profile: "
            f"the phases in whose top {choices.profile_k} the head ranks (all: shared, one: "
            "specific); P2C raw I: the raw importance, exact where measured, not "
            "NULL-calibrated.", cat(t11), cat(t11d), why,
            ["model", "head", "P1 I_c [95% CI]", "P1 rank", "P2 I_c [95% CI]", "P2 rank",
             "P2C I_c [95% CI]", "P2C rank", "profile", "P2C raw I"])
    layer_frame = cat(layers)
    _listed(rep, "table11_layers", "Table 11 (last row): layers of the chapter top-40",
            "Heads of the P1 top-40 in each block of layers and their share of its summed I_c.",
            layer_frame, layer_frame.drop(columns=["run_id"], errors="ignore"), why,
            ["model", "phase", "top_k", "layers", "n_heads", "share_I_c"])
    t15 = characterization.stability_table(runs) if not runs.empty else pd.DataFrame()
    why15 = why if runs.empty else ("the attribute run logged no split-half stability (it needs "
                                    "notes of at least four patients)")
    _listed(rep, "table15_stability", "Table 15: split-half stability of the head discovery",
            "The I_c ranking on one random half of the patients against the other: medians over "
            "splits of the Spearman correlation over all heads and of the top-k overlaps, and of "
            "each half's top-40 overlap with the full ranking.", t15,
            characterization.stability_display(t15) if not t15.empty else pd.DataFrame(), why15,
            ["model", "phase", *(label for _, label in characterization.STABILITY_COLUMNS)])


# --------------------------------------------------------------------------- Tables 39-42
def _selections(rep: Report, runs: pd.DataFrame, cells: pd.DataFrame
                ) -> list[seltab.Selection]:
    out = []
    for _, run in runs.iterrows():
        mine = cells[cells["run_id"] == run["run_id"]] if not cells.empty else pd.DataFrame()
        doc = query.read_json_artifact(run["run_id"], DECISION)
        sel = seltab.load_selection(run.to_dict(), mine, doc if isinstance(doc, dict) else None)
        out.append(sel)
    return out


def _train_arms(train_runs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Train run id -> its resolved arm (runs without one left out)."""
    out = {}
    for rid in train_runs:
        arm = run_deviations.resolved_arm(rid, query.run_config(rid))
        if arm is not None:
            out[rid] = arm
    return out


def _selection(rep: Report, runs: pd.DataFrame, cells: pd.DataFrame, extra: _Extra,
               n_resamples: int, seed: int) -> None:
    sels = _selections(rep, runs, cells)
    none = "no FINISHED select_lambda runs" if runs.empty else ""
    ref = rep.reference_arm
    t39 = seltab.grid_table(sels, extra.evaluate, ref) if sels else pd.DataFrame()
    decisions = " ".join(seltab.decision_summary(s) + "." for s in sels)
    _listed(rep, "table39_selection", "Table 39: the λ selection on the validation notes",
            "Every cell of each selection (*: picked, +: within the tie band of the best) with "
            "the lock's metric and tie-break and its evaluation's valid and cap rates and M1 per "
            f"phase; anchor rows: untrained, teacher and {ref} evaluated on the selection's "
            f"notes. {decisions}".strip(), t39,
            seltab.grid_display(t39) if not t39.empty else pd.DataFrame(),
            none or "the select_lambda runs have no cells",
            ["selection", "cell", "λ_P1", "λ_P2", "state", "metric", "tie-break", "gap"])
    t40 = seltab.dose_response_table(sels, extra.eval_notes, ref, n_resamples=n_resamples,
                                     seed=seed) if sels else pd.DataFrame()
    _listed(rep, "table40_dose_response", "Table 40: dose response of M1 on the validation notes",
            f"Per cell, M1 (share of events with a positive margin, per note) minus {ref}'s on "
            "the selection's notes with events in every phase: mean per-note difference, notes "
            "higher/lower, exact sign-test p.", t40,
            seltab.dose_response_display(t40) if not t40.empty else pd.DataFrame(),
            none or "the select_lambda runs have no cells",
            ["selection", "cell", "phase", "notes", "Δ M1 (mean per note)", "higher/lower",
             "sign p"])
    picked_train = [t for s in sels for t in (extra.evaluate[
        (extra.evaluate["split"] == s.split) & (extra.evaluate["arm"] == s.arm)]["train_run"]
        .dropna().unique() if not extra.evaluate.empty else [])]
    arms = _train_arms(sorted(set(picked_train)))
    levels, pairs, whys = [], [], []
    for sel in sels:
        lv, pr, why = seltab.confirmation_tables(
            sel, extra.evaluate, extra.eval_notes, seltab.selected_train_runs(sel, arms), ref,
            n_resamples=n_resamples, seed=seed)
        levels.append(lv)
        pairs.append(pr)
        if why:
            whys.append(f"{sel.name}: {why}")
    lv = pd.concat(levels, ignore_index=True) if levels else pd.DataFrame()
    pr = pd.concat(pairs, ignore_index=True) if pairs else pd.DataFrame()
    _listed(rep, "table41_confirmation", "Table 41: the selected λ against the reference, "
            "every seed", f"The lock's arm at the picked λ and {ref}, each over its seeds on the "
            "selection's notes (mean ± sd), with the untrained student and the teacher as "
            "anchors.", lv,
            seltab.confirmation_display(lv) if not lv.empty else pd.DataFrame(),
            none or "; ".join(whys) or "no evaluations on the selection's notes",
            ["selection", "row", "seeds", "task micro-F1", "M1 P1", "M1 P2", "M1 P2C"])
    _listed(rep, "table41_paired", "Table 41 (paired): seed-matched comparisons",
            f"The selected arm minus {ref}, seed i against seed i (a one-seed side pairs with "
            "every seed), note-clustered: per note the mean of its seed pairs' differences, then "
            "the tests over notes.", pr,
            tables.paired_display(pr) if not pr.empty else pd.DataFrame(),
            none or "; ".join(whys) or "no paired lines",
            ["model", "arm", "reference", "measure", "seed pairs", "notes", "Δ mean [95% CI]"])
    t42 = pd.concat([seltab.reselection_table(
        s, extra.evaluate, extra.eval_notes, extra.own, _own_teacher(extra.own_notes), ref,
        extra.split, n_resamples=n_resamples, seed=seed) for s in sels], ignore_index=True) \
        if sels else pd.DataFrame()
    _listed(rep, "table42_reselection", "Table 42: the selection's cells on the test notes and "
            "their own heads",
            f"Per cell: the validation metric and tie-break; micro-F1 on the {extra.split} notes "
            "and the own top-40 P2C recovery of the cell's train run; Δ: note-clustered against "
            f"every seed of {ref} at the cell's precision (mean [95% CI]).", t42,
            seltab.reselection_display(t42) if not t42.empty else pd.DataFrame(),
            none or "the select_lambda runs have no cells",
            ["selection", "cell", "val metric", "test micro-F1", "own P2C k40"])


def _own_teacher(own_notes: pd.DataFrame) -> pd.DataFrame:
    return ablation_tables._traces(own_notes, "teacher")


# --------------------------------------------------------------------------- Tables 47-51
def _ablations(rep: Report, client: MlflowClient, extra: _Extra, cells: pd.DataFrame,
               choices: TableChoices, n_resamples: int, seed: int) -> None:
    cell_train = _cell_train_runs(cells, extra.train)
    evaluate = extra.test_runs(extra.evaluate, cell_train)
    own = extra.test_runs(extra.own, cell_train)
    train = extra.train[~extra.train["run_id"].isin(cell_train)] if not extra.train.empty \
        else extra.train
    train = query.latest_runs(train) if not train.empty else train
    ev_notes = extra.eval_notes[extra.eval_notes["run_id"].isin(evaluate["run_id"])] \
        if not extra.eval_notes.empty else extra.eval_notes
    own_notes = extra.own_notes[extra.own_notes["run_id"].isin(own["run_id"])] \
        if not extra.own_notes.empty else extra.own_notes
    t47 = ablation_tables.precision_table(evaluate, ev_notes, train, n_resamples=n_resamples,
                                          seed=seed)
    _listed(rep, "table47_precision", "Table 47: precision control, task side",
            "Test micro-F1, valid and cap rate, mean ± sd over seeds; Δ: paired per-note "
            "micro-F1 difference from each Vanilla CoT-KD arm's seed-averaged notes with its "
            "bootstrap 95% interval.", t47, ablation_tables.precision_display(t47))
    precision_train = train[train["arm"].isin(ablation_tables.PRECISION_ARMS)] \
        if not train.empty else train
    history = {rid: query.metric_history(client, rid, "train/ce")
               for rid in precision_train.get("run_id", [])}
    t48 = ablation_tables.training_ce_table(train, history, choices.ce_steps)
    shown48 = t48.drop(columns=["last_step"]).astype(object).map(
        lambda v: "" if v is None or (isinstance(v, float) and v != v) else
        f"{v:.3f}" if isinstance(v, float) else str(v))
    _listed(rep, "table48_training_ce", "Table 48: training cross-entropy per seed",
            f"Cross-entropy on the trace tokens (train/ce) at optimiser steps "
            f"{', '.join(map(str, choices.ce_steps))} and at the run's last step "
            "(empty: the run logged no value at that step).", t48, shown48)
    arms = ablation_tables.ablation_arms()
    t49, p49 = ablation_tables.own_traces_table(
        own, own_notes, train, [*ablation_tables.PRECISION_ARMS, *arms],
        n_resamples=n_resamples, seed=seed)
    _listed(rep, "table49_own_traces", "Table 49: own-heads knock-in on each student's own traces",
            "P2C knock-in recovery of the own top-k on the arm's own generated traces (mean over "
            "notes, random floor in parentheses; coverage: notes with a measurable own-trace "
            "recovery) beside the teacher-forced cell on the same notes.", t49,
            ablation_tables.own_traces_display(t49))
    _listed(rep, "table49_paired", "Table 49 (bottom): Mistill minus Vanilla CoT-KD on own traces",
            "On the notes both arms have own-trace events for: per seed pair, and note-clustered "
            "over the notes with at least one pair.", p49,
            _own_pairs_display(p49) if not p49.empty else pd.DataFrame(),
            "no own-trace readouts of both mistill and a Vanilla CoT-KD arm",
            ["comparison", "k", "seeds", "notes", "Δ mean [95% CI]"])
    t51 = ablation_tables.ablation_table(own, own_notes, evaluate, ev_notes, train, arms,
                                         n_resamples=n_resamples, seed=seed)
    t50 = ablation_tables.ablation_plan_table(arms, t51, alpha=choices.sign_alpha)
    _listed(rep, "table50_ablation_plan", "Table 50: the ablations and the direction of their "
            "effects", "Each ablation arm, its base and the flags it changes, and its measured "
            "P2C recovery and micro-F1 against Mistill (higher / lower: every Mistill seed's "
            "sign test, or the micro-F1 interval, excludes no difference; level: none does; "
            "mixed otherwise).", t50, t50)
    _listed(rep, "table51_ablations", "Table 51: ablations on each arm's own heads",
            "P2C and P2: own top-40 knock-in recovery, median over notes (mean over seeds), "
            "random floor in parentheses; Δ P2C: per-note paired median difference against "
            "each Mistill seed (sign-test p); vs base: notes higher/lower than the untrained "
            "student; M2: P2C region lift (random); prefix: share on the emitted prefix; "
            "micro-F1 with the paired difference from Mistill's seed-averaged notes [95% "
            "interval].", t51, ablation_tables.ablation_display(t51))
    _pool_carriers(rep, client, own)


POOLS_FILE = "student_pools.json"
OWN_SETS_FILE = "own_heads_sets.json"
RANK_TAGS = {"notes": ("mistill.rank_attribute", "calib/{phase}/n_notes"),
             "events": ("mistill.rank_events", "events/{phase}/realized")}
"""What the carriers table reads of the runs behind an own ranking: the own-heads run's tag naming
the ranking's attribute (events) run, and that run's per-phase note (event) count metric."""


def _rank_counts(client: MlflowClient, run_id: str) -> dict[str, float]:
    """``{"<phase>/notes": n, "<phase>/events": n}`` of the runs behind an own-heads run's
    ranking (empty where a run or a metric is missing)."""
    out: dict[str, float] = {}
    try:
        tags = client.get_run(run_id).data.tags
        for what, (tag, metric) in RANK_TAGS.items():
            if not tags.get(tag):
                continue
            metrics = client.get_run(tags[tag]).data.metrics
            for phase in ablation_tables.CARRIER_PHASES:
                value = metrics.get(metric.format(phase=phase))
                if value is not None:
                    out[f"{phase}/{what}"] = float(value)
    except MlflowException:
        return out
    return out


def _pool_carriers(rep: Report, client: MlflowClient, own: pd.DataFrame) -> None:
    """App. M.3's carriers: the supervised pools and the untrained student's own top-40 among
    each trained arm's own top-40 (:func:`analysis.ablation_tables.pool_carriers_table`)."""
    k = ablation_tables.OWN_K
    sets = {rid: query.read_json_artifact(rid, OWN_SETS_FILE) for rid in own.get("run_id", [])}
    trains = {str(t) for t in own.get("train_run", pd.Series(dtype=object)).dropna() if t}
    pools = {t: query.read_json_artifact(t, POOLS_FILE) for t in sorted(trains)}
    counts = {rid: _rank_counts(client, rid) for rid in own.get("run_id", [])}
    table = ablation_tables.pool_carriers_table(own, pools, sets, counts, k=k)
    _listed(rep, "pool_carriers", "App. M.3: the supervised heads among each arm's carriers",
            f"Per trained arm, seed and phase: of the heads its train run supervised (pool), how many "
            f"are among the trained student's own top-{k} after training (its own-heads ranking), "
            f"and how many of the untrained student's own top-{k} are (the paper's carriers, 27-38 "
            f"of 40); share: over the pool, and over the own top-{k}. Ranking notes / events: "
            "what the trained student's own ranking rests on at that phase.",
            table, ablation_tables.pool_carriers_display(table) if not table.empty else pd.DataFrame(),
            "no own_heads runs of a trained arm", list(ablation_tables.CARRIER_COLUMNS))


def _own_pairs_display(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    for _, r in table.iterrows():
        out.append({"comparison": r["comparison"], "k": int(r["k"]), "seeds": r["seeds"],
                    "notes": int(r["n"]),
                    "Δ mean [95% CI]": tables.fmt_ci(r["mean_diff"], r["ci_low"], r["ci_high"]),
                    "higher/lower": f"{int(r['n_higher'])}/{int(r['n_lower'])}",
                    "sign p": tables.format_cell(r["sign_p"], p_value=True)})
    return pd.DataFrame.from_records(out)
