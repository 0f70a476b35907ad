"""Table 52 (App. M.2): matched λ selection of Mistill against a frozen RandHeads pool.

Two ``select_lambda`` runs form a matched pair when their recorded locks (``decision.json``'s
``lock``) agree on everything but the arm (and the study name, file path and sha256): one
selection protocol for both families (:func:`matched_pairs`). From such a pair:

* the validation cells (:func:`matched_validation_table`): every cell of both selections, its
  validation metric and tie-break, the full-precision gap to the best, the pick under the locked
  band (⋆, as the selection recorded it) and under the sensitivity band (†, 0.005): the lock's
  whole rule re-applied to the recorded cells by :func:`selection.decide.sensitivity`, with the
  lock rebuilt from the record (:func:`selection.lock.lock_from_record`);
* the test cells at the picks (:func:`matched_test_table`): every seed of each family's arm at
  its pick (the train runs whose resolved arm equals the picked cell's, λ, pool and precision
  included, so a RandHeads run on another pool is not one of them), its test micro-F1 and its
  own-heads P2C recovery at k = 40, the median over notes with the random floor, as Table 45
  shows them (:func:`analysis.tables.own_heads_seed_table`);
* the paired comparisons (:func:`matched_paired_table`), the ranked arm minus the control, seed
  i against seed i: per note the mean of its seed pairs' differences, then the tests over notes
  (:func:`analysis.paired.seed_matched`), for the per-note task micro-F1 and the own-heads
  recoveries of :data:`PAIRED_OWN_CELLS`, with each pair's mean difference; and the corpus-level
  micro-F1 difference (:func:`analysis.paired.corpus_f1`), overall and per seed pair.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from analysis import paired
from analysis.selection_tables import Selection
from analysis.tables import fmt_ci, own_heads_seed_table
from mistill import stats
from mistill.errors import MistillInputError
from selection.cells import Cell, CellResult
from selection.decide import sensitivity
from selection.lock import TIED_AXIS, Lock, lock_from_record

__all__ = ["LOCKED_MARK", "MatchedPair", "PAIRED_OWN_CELLS", "PickRuns", "RANKED_ARM", "SENSITIVITY_BAND",
           "SENSITIVITY_MARK", "TEST_OWN_CELL", "cell_results", "matched_pairs", "matched_paired_display",
           "matched_paired_table", "matched_test_display", "matched_test_table",
           "matched_validation_display", "matched_validation_table", "pick_runs", "pick_train_runs"]

RANKED_ARM = "mistill"
"""The family whose pool is the student's own ranked heads; the other selection of a pair is the
control it is compared against (App. M.2: RandHeads on the frozen pool 0)."""
SENSITIVITY_BAND = 0.005
"""App. M.2's secondary tie band, re-applied to the validation cells already run."""
LOCKED_MARK, SENSITIVITY_MARK = "⋆", "†"
UNMATCHED_LOCK_FIELDS: tuple[str, ...] = ("path", "sha256", "study", "arm")
"""Fields of a recorded lock that may differ between the two selections of a matched pair."""
TEST_OWN_CELL: tuple[str, int] = ("P2C", 40)
"""The own-heads readout of the test cells: P2C knock-in recovery of the own top-40."""
PAIRED_OWN_CELLS: tuple[tuple[str, int], ...] = (("P2C", 40), ("P2C", 8), ("P1", 40))
"""The own-heads readouts compared per note (App. M.2 cites P2C at k = 40 and 8, and P1)."""


@dataclass(frozen=True)
class MatchedPair:
    """Two selections under one protocol: ``ranked`` (:data:`RANKED_ARM`) and ``control``."""

    ranked: Selection
    control: Selection

    @property
    def label(self) -> str:
        return f"{self.ranked.arm} vs {self.control.arm}"


def _protocol(lock: Mapping[str, Any]) -> str:
    return json.dumps({k: v for k, v in lock.items() if k not in UNMATCHED_LOCK_FIELDS}, sort_keys=True,
                      default=str)


def matched_pairs(selections: Sequence[Selection]) -> list[MatchedPair]:
    """The matched pairs among ``selections`` (newest first: of two selections of one arm under
    one protocol the first is kept): a :data:`RANKED_ARM` selection and each selection of another
    arm whose recorded lock is the same but for :data:`UNMATCHED_LOCK_FIELDS`."""
    by_protocol: dict[str, dict[str, Selection]] = {}
    for sel in selections:
        if not sel.lock or "arm" not in sel.lock:
            continue
        by_protocol.setdefault(_protocol(sel.lock), {}).setdefault(str(sel.lock["arm"]), sel)
    pairs = []
    for arms in by_protocol.values():
        if RANKED_ARM in arms:
            pairs += [MatchedPair(arms[RANKED_ARM], other) for arm, other in sorted(arms.items())
                      if arm != RANKED_ARM]
    return pairs


def _cell(lock: Lock, lambda_p1: float, lambda_p2: float) -> Cell:
    if lock.grid.tied:
        return Cell.of({TIED_AXIS: lambda_p1})
    return Cell.of({"lambda_p1": lambda_p1, "lambda_p2": lambda_p2})


def _number(value: Any) -> float:
    got = pd.to_numeric(pd.Series([value]), errors="coerce").iloc[0]
    return float(got) if pd.notna(got) else math.nan


def cell_results(sel: Selection, lock: Lock) -> dict[Cell, CellResult]:
    """The recorded cells with a selection metric (``metric``, ``tie_break`` and the lock's
    validity metric of the cell table) as the rule reads them."""
    out: dict[Cell, CellResult] = {}
    for _, row in sel.cells.iterrows():
        metric = _number(row.get("metric"))
        if math.isnan(metric):
            continue
        out[_cell(lock, float(row["lambda_p1"]), float(row["lambda_p2"]))] = CellResult(
            metric=metric, tie_break=_number(row.get("tie_break")),
            validity=_number(row.get(lock.selection.validity_metric)))
    return out


def _band_pick(sel: Selection, band: float) -> tuple[Lock | None, dict[str, Any], str]:
    """The lock rebuilt from the record, the rule's row at ``band``, and why not (non-empty when
    the rule could not be re-applied)."""
    try:
        lock = lock_from_record(sel.lock, source=f"{sel.name}: decision.json")
    except MistillInputError as exc:
        return None, {}, f"the recorded lock cannot be read ({exc})"
    results = cell_results(sel, lock)
    if not results:
        return lock, {}, "no cell with a selection metric"
    [row] = sensitivity(lock, results, [band])
    return lock, row, ""


def matched_validation_table(pairs: Sequence[MatchedPair], *,
                             band: float = SENSITIVITY_BAND) -> pd.DataFrame:
    """Every cell of both selections of each pair: λs, state, the validation metric, the
    tie-break, the recorded gap to the best, ``locked_pick`` (the recorded pick, ⋆) and
    ``band_pick`` (the pick of the lock's rule re-applied with ``band``, †); ``note`` says when
    the band's rule calls for an outward cell that was not run (its pick is then over the grid
    extended so far) or the rule could not be re-applied."""
    rows = []
    for pair in pairs:
        for family, sel in (("ranked", pair.ranked), ("control", pair.control)):
            lock, row, why = _band_pick(sel, band)
            note = why or (f"the {band:g} band calls for {row['pending']}, not run" if row.get("pending") else "")
            for _, cell in sel.cells.iterrows():
                p1, p2 = float(cell["lambda_p1"]), float(cell["lambda_p2"])
                key = _cell(lock, p1, p2).key if lock is not None else ""
                rows.append({"pair": pair.label, "family": family, "selection": sel.name, "arm": sel.arm,
                             "lambda_p1": p1, "lambda_p2": p2, "in_grid": bool(cell.get("in_grid", True)),
                             "state": str(cell.get("state", "")), "metric": _number(cell.get("metric")),
                             "tie_break": _number(cell.get("tie_break")),
                             "gap_to_best": _number(cell.get("gap_to_best")),
                             "locked_pick": bool(cell.get("picked", False)),
                             "band_pick": bool(row) and row.get("pick") == key, "band": band, "note": note})
    return pd.DataFrame.from_records(rows, columns=[
        "pair", "family", "selection", "arm", "lambda_p1", "lambda_p2", "in_grid", "state", "metric",
        "tie_break", "gap_to_best", "locked_pick", "band_pick", "band", "note"])


def _lambda_text(p1: Any, p2: Any) -> str:
    a, b = _number(p1), _number(p2)
    if math.isnan(a):
        return ""
    return f"{a:g}" if a == b or math.isnan(b) else f"{a:g}, {b:g}"


def _fmt(value: Any, spec: str = ".3f") -> str:
    v = _number(value)
    return "" if math.isnan(v) else format(v, spec)


def matched_validation_display(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    for _, r in table.iterrows():
        marks = (LOCKED_MARK if r["locked_pick"] else "") + (SENSITIVITY_MARK if r["band_pick"] else "")
        out.append({"arm": r["arm"], "λ": f"{_lambda_text(r['lambda_p1'], r['lambda_p2'])}"
                                          f"{' ' + marks if marks else ''}",
                    "cell": "grid" if r["in_grid"] else "outward", "state": r["state"],
                    "val micro-F1": _fmt(r["metric"]), "M1 P2C": _fmt(r["tie_break"]),
                    "gap to best": _fmt(r["gap_to_best"], ".10f"), "note": r["note"] or ""})
    return pd.DataFrame.from_records(out)


# ------------------------------------------------------------------------- the test cells
def pick_train_runs(sel: Selection, arms_of: Mapping[str, Mapping[str, Any]]) -> tuple[set[str], str]:
    """The train runs of the selection's arm at its pick: those whose resolved arm (``arms_of``:
    train run -> resolved arm flags) equals the picked cell's train run's in every flag (λ, pool
    mode and seed, precision, ...), the picked cell's own run included; and why none (empty when
    some were found)."""
    pick = sel.picked()
    if pick is None:
        return set(), "the selection records no pick"
    train = pick.get("train_run")
    if not isinstance(train, str) or train not in arms_of:
        return set(), "the picked cell's train run records no resolved arm"
    picked = dict(arms_of[train])
    return {run for run, arm in arms_of.items() if dict(arm) == picked}, ""


def _at(frame: pd.DataFrame, runs: set[str], split: str, model: str) -> pd.DataFrame:
    """The newest run on ``split`` of each of the train runs ``runs`` (of ``model``)."""
    if frame.empty:
        return frame
    got = frame[frame["train_run"].isin(list(runs)) & (frame["split"].fillna("") == split)
                & (frame["model"].fillna("") == model)]
    return got.sort_values("start_time", ascending=False).drop_duplicates("train_run")


@dataclass(frozen=True)
class PickRuns:
    """One family's runs at its pick: the ``evaluate`` and ``own_heads`` runs on the test notes."""

    selection: Selection
    evaluate: pd.DataFrame
    own: pd.DataFrame
    why: str = ""


def pick_runs(sel: Selection, arms_of: Mapping[str, Mapping[str, Any]], evaluate: pd.DataFrame,
              own: pd.DataFrame, test_split: str) -> PickRuns:
    """:class:`PickRuns` of ``sel``: the newest ``evaluate`` and ``own_heads`` run on
    ``test_split`` of each train run at the pick (:func:`pick_train_runs`)."""
    runs, why = pick_train_runs(sel, arms_of)
    return PickRuns(sel, _at(evaluate, runs, test_split, sel.model), _at(own, runs, test_split, sel.model), why)


def matched_test_table(picks: Sequence[PickRuns], own_notes: pd.DataFrame) -> pd.DataFrame:
    """Per family and seed at its pick: the test micro-F1 and, at :data:`TEST_OWN_CELL`, the
    median over notes of the own-heads recovery and of the random floor, with the gated events
    and notes it rests on where recorded (:func:`analysis.tables.own_heads_seed_table`)."""
    phase, k = TEST_OWN_CELL
    cell = f"{phase}.k{k}"
    rows = []
    for pick in picks:
        sel = pick.selection
        picked = sel.picked()
        base = {"selection": sel.name, "arm": sel.arm,
                "lambda": None if picked is None else _lambda_text(picked.get("lambda_p1"), picked.get("lambda_p2"))}
        seeds = sorted({int(s) for s in [*pick.evaluate.get("seed", []), *pick.own.get("seed", [])] if pd.notna(s)})
        if not seeds:
            rows.append({**base, "note": pick.why or "no test evaluation or own-heads run at the pick"})
            continue
        notes = own_notes[own_notes["run_id"].isin(pick.own["run_id"])] if not own_notes.empty else own_notes
        per_seed = own_heads_seed_table(notes, pick.own) if not notes.empty else pd.DataFrame()
        for seed in seeds:
            ev = pick.evaluate[pick.evaluate["seed"] == seed]
            rec: dict[str, Any] = {**base, "seed": seed,
                                   "train_run": ev["train_run"].iloc[0] if len(ev) else None,
                                   "micro_f1": float(ev["micro_f1"].iloc[0]) if len(ev) else math.nan}
            mine = per_seed[per_seed["seed"] == seed] if not per_seed.empty else per_seed
            notes_why = []
            if ev.empty:
                notes_why.append("no test evaluation")
            if mine.empty or f"{cell}.own" not in mine.columns:
                notes_why.append(f"no own-heads {phase} k={k} readout")
            else:
                for part in ("own", "random", "n_gated", "n_notes"):
                    col = f"{cell}.{part}"
                    rec[f"own_{part}"] = float(mine[col].iloc[0]) if col in mine.columns else math.nan
            rows.append({**rec, "note": "; ".join(notes_why)})
    return pd.DataFrame.from_records(rows, columns=[
        "selection", "arm", "lambda", "seed", "train_run", "micro_f1", "own_own", "own_random", "own_n_gated",
        "own_n_notes", "note"])


def matched_test_display(table: pd.DataFrame) -> pd.DataFrame:
    phase, k = TEST_OWN_CELL
    out = []
    for _, r in table.iterrows():
        own, floor = _fmt(r["own_own"]), _fmt(r["own_random"])
        out.append({"arm": r["arm"], "λ": r["lambda"] if isinstance(r["lambda"], str) else "",
                    "seed": "" if pd.isna(r["seed"]) else int(r["seed"]), "test micro-F1": _fmt(r["micro_f1"]),
                    f"own {phase} k{k} (random)": f"{own} ({floor})" if own and floor else own,
                    "note": r["note"] or ""})
    return pd.DataFrame.from_records(out)


# ---------------------------------------------------------------------- paired comparisons
def _pairs_text(result: stats.NoteClustered) -> str:
    return ", ".join(f"{r.mean_diff:+.3f}" for _, r in sorted(result.per_pair.items(), key=lambda kv: str(kv[0])))


def matched_paired_table(ranked: PickRuns, control: PickRuns, eval_notes: pd.DataFrame,
                         own_notes: pd.DataFrame, *, n_resamples: int = stats.N_BOOTSTRAP,
                         corpus_resamples: int = stats.N_BOOTSTRAP_CORPUS, seed: int = 0) -> pd.DataFrame:
    """The ranked arm minus the control at their picks, seed i against seed i: per-note task
    micro-F1 and own-heads recovery at :data:`PAIRED_OWN_CELLS`, note-clustered
    (:func:`analysis.paired.seed_matched`: ``n`` notes, ``mean_diff`` [``ci_low``, ``ci_high``],
    ``n_higher``/``n_lower``, ``sign_p``, ``n_pairs`` and ``per_pair``, each pair's mean); the
    corpus-level micro-F1 difference (:func:`analysis.paired.corpus_f1`), over the seeds and per
    seed pair. A measure without data on both sides is left out; ``note`` says why."""
    rows = []
    label = f"{ranked.selection.arm} − {control.selection.arm}"

    def side(frame: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
        return frame[frame["run_id"].isin(runs["run_id"])] if not frame.empty else frame

    a_eval, r_eval = side(eval_notes, ranked.evaluate), side(eval_notes, control.evaluate)
    measures: list[tuple[str, pd.DataFrame, pd.DataFrame, str]] = [("task micro-F1 (per note)", a_eval, r_eval,
                                                                     "micro_f1")]
    a_own, r_own = side(own_notes, ranked.own), side(own_notes, control.own)
    for phase, k in PAIRED_OWN_CELLS:
        def at(f: pd.DataFrame) -> pd.DataFrame:
            return f[(f["phase"] == phase) & (f["k"] == k)] if not f.empty else f
        measures.append((f"own-heads {phase} recovery, k={k}", at(a_own), at(r_own), "recovery_own"))
    for name, a, r, value in measures:
        rec: dict[str, Any] = {"comparison": label, "measure": name}
        try:
            res = paired.seed_matched(a, r, value, n_resamples=n_resamples, seed=seed)
        except (MistillInputError, KeyError) as exc:
            rows.append({**rec, "note": str(exc)})
            continue
        rows.append({**rec, **paired.clustered_row(res), "per_pair": _pairs_text(res), "note": ""})
    rec = {"comparison": label, "measure": "corpus micro-F1"}
    try:
        overall = paired.corpus_f1(a_eval, r_eval, n_resamples=corpus_resamples, seed=seed)
        common = sorted(set(a_eval["seed"].dropna()) & set(r_eval["seed"].dropna()))
        per_pair = [paired.corpus_f1(a_eval[a_eval["seed"] == s], r_eval[r_eval["seed"] == s],
                                     n_resamples=corpus_resamples, seed=seed).difference for s in common]
        rows.append({**rec, "n_pairs": len(common), "mean_diff": overall.difference, "ci_low": overall.ci_low,
                     "ci_high": overall.ci_high, "per_pair": ", ".join(f"{d:+.3f}" for d in per_pair), "note": ""})
    except (MistillInputError, KeyError) as exc:
        rows.append({**rec, "note": str(exc)})
    return pd.DataFrame.from_records(rows, columns=[
        "comparison", "measure", "n_pairs", "n", "mean_diff", "ci_low", "ci_high", "n_higher", "n_lower",
        "sign_p", "per_pair", "note"])


def matched_paired_display(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    for _, r in table.iterrows():
        counted = pd.notna(r["n_higher"])
        out.append({"comparison": r["comparison"], "measure": r["measure"],
                    "seed pairs": "" if pd.isna(r["n_pairs"]) else int(r["n_pairs"]),
                    "notes": "" if pd.isna(r["n"]) else int(r["n"]),
                    "Δ mean [95% CI]": fmt_ci(r["mean_diff"], r["ci_low"], r["ci_high"]),
                    "higher/lower": f"{int(r['n_higher'])}/{int(r['n_lower'])}" if counted else "",
                    "per pair": r["per_pair"] if isinstance(r["per_pair"], str) else "",
                    "note": r["note"] or ""})
    return pd.DataFrame.from_records(out)
