"""What a report is: its inputs, its tables and the report itself (:class:`Report`), the artifact
names it reads and the table choices the paper leaves open. :mod:`analysis.report_sections` fills
a :class:`Report`; :mod:`analysis.report` assembles it from the tracking store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from analysis import figures, run_deviations, tables
from mistill.instrument.settables import to_markdown

PER_NOTE_METRICS = "per_note_metrics.csv"
OWN_HEADS_PER_NOTE = "own_heads_per_note.csv"
PER_NOTE_SETS = "per_note_sets.csv"
LAMBDA_CELLS = "cells.csv"
DECISION = "decision.json"

_ARM_KEY = ("arm", "seed", "precision")  # what makes train runs the same arm


@dataclass
class ReportInputs:
    """The runs a report reads: per stage one row per run (:func:`analysis.query.stage_runs`)."""

    experiment: str
    runs: dict[str, pd.DataFrame]
    extra: dict[str, pd.DataFrame] = field(default_factory=dict)
    """``attribute``, ``train``, ``evaluate_all``, ``own_heads_all`` and ``select_lambda_all``: runs
    read beyond the newest of each cell (the last three: every split, every run; Table 52 pairs
    selections by their recorded lock, not by the cell key)."""
    task: str = "icd10"
    """The label space of the experiment's corpus (its prepare runs' ``task``)."""

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


def cell_train_runs(cells: pd.DataFrame, train: pd.DataFrame) -> set[str]:
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
