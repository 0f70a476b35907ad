"""Tables 39-42 from ``select_lambda`` runs and the evaluations around them (App. I.3, I.4).

A ``select_lambda`` run logs ``decision.json`` (the lock and the decision) and ``cells.csv``
(one row per grid or outward cell: λs, state, the lock's metric and tie-break, band, pick, and
the cell's ``train_run`` and ``evaluate_run``). From those and the ``evaluate`` and
``own_heads`` runs that name a cell's train run:

* Table 39 (:func:`grid_table`): every cell's validation statistics, beside anchor rows (the
  untrained student, the teacher and the reference arm evaluated on the selection's split).
* Table 40 (:func:`dose_response_table`): per cell, the per-note M1 difference from the
  reference arm on the selection's split, per phase, over the notes with events in every phase.
* Table 41 (:func:`confirmation_tables`): the selected arm (the lock's arm at the pick's λ)
  against the reference arm on the selection's split, every seed of each: mean ± sd, and the
  seed-matched, note-clustered comparisons.
* Table 42 (:func:`reselection_table`): each cell's validation statistics, its test micro-F1
  and its own-heads P2C recovery, with note-clustered lines against the reference arm.

``decision.json`` is read defensively: ``pick``, ``band``, ``tied``, ``gaps_to_best`` and
``extensions`` are required (:data:`DECISION_REQUIRED`); any other field is optional and shown
when present.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analysis import paired
from analysis.tables import fmt_ci, fmt_mean_sd
from mistill import stats
from mistill.errors import MistillInputError

__all__ = ["DECISION_REQUIRED", "Selection", "confirmation_tables", "decision_summary",
           "dose_response_table", "grid_table", "reselection_table"]

DECISION_REQUIRED: tuple[str, ...] = ("pick", "band", "tied", "gaps_to_best", "extensions")
ANCHOR_ARMS: tuple[str, ...] = ("untrained", "teacher")
M1_PHASES: tuple[str, ...] = ("P1", "P2", "P2C")
CELL_METRICS: tuple[tuple[str, str], ...] = (
    ("valid_rate", "valid"), ("cap_rate", "cap"), ("m1/P1/p_pos", "M1 P1"),
    ("m1/P2/p_pos", "M1 P2"), ("m1/P2C/p_pos", "M1 P2C"))
"""Metrics of a cell's evaluation shown beside the selection metric in Table 39."""
OWN_CELL = ("P2C", 40)
"""Table 42's own-heads readout: M4 recovery of the own top-40 at P2C (App. I.4)."""


@dataclass
class Selection:
    """One ``select_lambda`` run: its decision record, its cells and the lock's split."""

    run_id: str
    name: str
    model: str
    arm: str
    decision: dict[str, Any]
    lock: dict[str, Any]
    cells: pd.DataFrame
    problems: list[str] = field(default_factory=list)

    @property
    def split(self) -> str:
        return str((self.lock.get("selection") or {}).get("split") or "val")

    @property
    def metric(self) -> str:
        return str((self.lock.get("selection") or {}).get("metric") or "micro_f1")

    @property
    def seed(self) -> int | None:
        seed = (self.lock.get("training") or {}).get("seed")
        return int(seed) if seed is not None else None

    def picked(self) -> pd.Series | None:
        """The picked cell's row, if the record names one."""
        if "picked" not in self.cells.columns:
            return None
        rows = self.cells[self.cells["picked"]]
        return rows.iloc[0] if len(rows) else None


def _bool(col: pd.Series) -> pd.Series:
    return col.astype(str).str.lower().isin(["true", "1", "1.0"])


def load_selection(run: Mapping[str, Any], cells: pd.DataFrame,
                   doc: Mapping[str, Any] | None) -> Selection:
    """A :class:`Selection` from the run's row, its ``cells.csv`` and ``decision.json``
    (either may be missing: what is missing is named in :attr:`Selection.problems`)."""
    problems = []
    doc = dict(doc or {})
    if not doc:
        problems.append("no readable decision.json")
    decision = doc.get("decision") if isinstance(doc.get("decision"), dict) else {}
    lacking = [k for k in DECISION_REQUIRED if k not in decision]
    if doc and lacking:
        problems.append(f"decision.json lacks {lacking}")
    cells = cells.copy()
    for col in ("picked", "in_band", "in_grid"):
        if col in cells.columns:
            cells[col] = _bool(cells[col])
    lock = doc.get("lock") if isinstance(doc.get("lock"), dict) else {}
    return Selection(str(run["run_id"]), str(run.get("run_name") or run["run_id"]),
                     str(run.get("model") or ""), str(run.get("arm") or ""), decision, lock,
                     cells.reset_index(drop=True), problems)


def decision_summary(sel: Selection) -> str:
    """One line: the rule and pick, band, tied cells, extensions, and any optional fields."""
    d = sel.decision
    if not d:
        return f"{sel.name}: " + "; ".join(sel.problems)
    parts = [f"{sel.name}: {d.get('rule', '?')} -> {d.get('pick')}"]
    if "band" in d:
        parts.append(f"band {d['band']}")
    if d.get("tied"):
        parts.append("tied " + ", ".join(map(str, d["tied"])))
    ext = [e for e in d.get("extensions") or [] if isinstance(e, dict) and e.get("ran")]
    parts.append("extensions " + (", ".join(
        f"{e.get('cell')} ({'adopted' if e.get('adopted') else 'not adopted'})" for e in ext)
        or "none"))
    known = {*DECISION_REQUIRED, "rule", "pick_lambda_p1", "pick_lambda_p2", "best", "pending",
             "missing"}
    for key in sorted(set(d) - known):
        value = d[key]
        if isinstance(value, (str, int, float, bool)) or value is None:
            parts.append(f"{key} {value}")
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float))
                                                      for v in value):
            parts.append(f"{key} [{', '.join(map(str, value))}]")
    parts += sel.problems
    return "; ".join(parts)


# ----------------------------------------------------------------------------------- helpers
def _split_runs(evaluate: pd.DataFrame, split: str) -> pd.DataFrame:
    if evaluate.empty:
        return evaluate
    return evaluate[evaluate["split"].fillna("") == split]


def _run_metrics(evaluate: pd.DataFrame, run_id: Any) -> pd.Series | None:
    if evaluate.empty or not isinstance(run_id, str) or not run_id:
        return None
    rows = evaluate[evaluate["run_id"] == run_id]
    return rows.iloc[0] if len(rows) else None


def _value(row: pd.Series | None, key: str) -> float:
    if row is None or key not in row.index or pd.isna(row[key]):
        return math.nan
    return float(row[key])


def _anchor_runs(evaluate: pd.DataFrame, sel: Selection, reference_arm: str) -> pd.DataFrame:
    runs = _split_runs(evaluate, sel.split)
    if runs.empty:
        return runs
    keep = runs["arm"].isin([*ANCHOR_ARMS, reference_arm])
    student = (runs["model"] == sel.model) | (runs["arm"] == "teacher")
    return runs[keep & student]


# ---------------------------------------------------------------------------------- Table 39
def grid_table(selections: Sequence[Selection], evaluate: pd.DataFrame,
               reference_arm: str) -> pd.DataFrame:
    """Table 39: per selection, anchor rows (``untrained``, ``teacher`` and the reference arm on
    the selection's split, each seed) then every cell: λs, state, the lock's metric and
    tie-break, the gap to the best, band and pick, and the cell evaluation's
    :data:`CELL_METRICS`."""
    rows = []
    for sel in selections:
        for _, run in _anchor_runs(evaluate, sel, reference_arm).iterrows():
            rec = {"selection": sel.name, "row": f"{run['arm']} (seed {run['seed']})",
                   "arm": run["arm"], "metric": _value(run, sel.metric)}
            rec.update({k: _value(run, k) for k, _ in CELL_METRICS})
            rows.append(rec)
        for _, cell in sel.cells.iterrows():
            ev = _run_metrics(evaluate, cell.get("evaluate_run"))
            metric = cell.get("metric", cell.get(sel.metric, math.nan))
            rec = {"selection": sel.name, "row": str(cell.get("cell", "")), "arm": sel.arm,
                   "lambda_p1": cell.get("lambda_p1"), "lambda_p2": cell.get("lambda_p2"),
                   "in_grid": cell.get("in_grid", True), "state": cell.get("state", ""),
                   "metric": float(metric) if pd.notna(metric) else math.nan,
                   "tie_break": float(cell["tie_break"]) if "tie_break" in cell.index
                   and pd.notna(cell["tie_break"]) else math.nan,
                   "gap_to_best": pd.to_numeric(cell.get("gap_to_best"), errors="coerce"),
                   "in_band": bool(cell.get("in_band", False)),
                   "picked": bool(cell.get("picked", False))}
            rec.update({k: _value(ev, k) for k, _ in CELL_METRICS})
            rows.append(rec)
    return pd.DataFrame.from_records(rows, columns=[
        "selection", "row", "arm", "lambda_p1", "lambda_p2", "in_grid", "state", "metric",
        "tie_break", "gap_to_best", "in_band", "picked", *(k for k, _ in CELL_METRICS)])


def grid_display(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    for _, r in table.iterrows():
        mark = ("*" if r["picked"] is True else "") + ("+" if r["in_band"] is True else "")
        rec = {"selection": r["selection"], "cell": f"{r['row']}{' ' + mark if mark else ''}",
               "λ_P1": _fmt(r["lambda_p1"], "g"), "λ_P2": _fmt(r["lambda_p2"], "g"),
               "state": r["state"] if isinstance(r["state"], str) else "",
               "metric": _fmt(r["metric"]), "tie-break": _fmt(r["tie_break"]),
               "gap": _fmt(r["gap_to_best"], ".4f")}
        rec.update({label: _fmt(r[k]) for k, label in CELL_METRICS})
        out.append(rec)
    return pd.DataFrame.from_records(out)


def _fmt(v: Any, spec: str = ".3f") -> str:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return ""
    return "" if math.isnan(f) else format(f, spec)


# ---------------------------------------------------------------------------------- Table 40
def _with_all_phases(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows of notes with M1 events in every phase (``m1_<phase>_n > 0``; notes are kept when
    the counts were not logged)."""
    keep = pd.Series(True, index=frame.index)
    for phase in M1_PHASES:
        col = f"m1_{phase}_n"
        if col in frame.columns:
            keep &= pd.to_numeric(frame[col], errors="coerce").fillna(0) > 0
    return frame[keep]


def dose_response_table(selections: Sequence[Selection], per_note: pd.DataFrame,
                        reference_arm: str, *, n_resamples: int = stats.N_BOOTSTRAP,
                        seed: int = 0) -> pd.DataFrame:
    """Table 40: per complete cell, per phase, the cell's per-note M1 (``m1_<phase>_p_pos``)
    minus the reference arm's (the lock's training seed where it has one, else its seeds
    averaged) on the selection's split, over the notes with events in every phase on both
    sides: ``n, mean_diff, n_higher, n_lower, sign_p`` (:func:`analysis.paired.difference_row`).
    A cell without a comparison has a ``note`` saying why."""
    rows = []
    for sel in selections:
        ref = per_note[(per_note["arm"] == reference_arm) & (per_note["split"] == sel.split)
                       & (per_note["model"] == sel.model)] if not per_note.empty else per_note
        if not ref.empty and sel.seed is not None and (ref["seed"] == sel.seed).any():
            ref = ref[ref["seed"] == sel.seed]
        for _, cell in sel.cells.iterrows():
            base = {"selection": sel.name, "cell": str(cell.get("cell", "")),
                    "lambda_p1": cell.get("lambda_p1"), "lambda_p2": cell.get("lambda_p2")}
            mine = per_note[per_note["run_id"] == cell.get("evaluate_run")] \
                if not per_note.empty else per_note
            why = ("the cell has no evaluation" if not isinstance(cell.get("evaluate_run"), str)
                   else "the cell's evaluation has no per-note M1" if mine.empty
                   else f"no evaluate run of {reference_arm} on the {sel.split} notes"
                   if ref.empty else "")
            if why:
                rows.append({**base, "note": why})
                continue
            a, r = _with_all_phases(mine), _with_all_phases(ref)
            for phase in M1_PHASES:
                col = f"m1_{phase}_p_pos"
                if col not in a.columns or col not in r.columns:
                    rows.append({**base, "phase": phase, "note": f"no {col} per note"})
                    continue
                try:
                    res = paired.seed_averaged(a, r, col, n_resamples=n_resamples, seed=seed)
                except MistillInputError as exc:
                    rows.append({**base, "phase": phase, "note": str(exc)})
                    continue
                rows.append({**base, "phase": phase, **paired.difference_row(res), "note": ""})
    return pd.DataFrame.from_records(rows, columns=[
        "selection", "cell", "lambda_p1", "lambda_p2", "phase", "n", "mean_diff", "n_higher",
        "n_lower", "n_tied", "sign_p", "note"])


def dose_response_display(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    for _, r in table.iterrows():
        ok = pd.notna(r.get("n"))
        out.append({"selection": r["selection"], "cell": r["cell"],
                    "phase": r["phase"] if isinstance(r["phase"], str) else "",
                    "notes": int(r["n"]) if ok else "",
                    "Δ M1 (mean per note)": f"{r['mean_diff']:+.3f}" if ok else "",
                    "higher/lower": f"{int(r['n_higher'])}/{int(r['n_lower'])}" if ok else "",
                    "sign p": _fmt(r["sign_p"]) if ok else "", "note": r["note"] or ""})
    return pd.DataFrame.from_records(out)


# ---------------------------------------------------------------------------------- Table 41
def selected_train_runs(sel: Selection, arm_of: Mapping[str, Mapping[str, Any]]) -> set[str]:
    """Train runs of the lock's arm at the pick's λs (``arm_of``: train run -> resolved arm)."""
    pick = sel.picked()
    p1 = sel.decision.get("pick_lambda_p1", None if pick is None else pick.get("lambda_p1"))
    p2 = sel.decision.get("pick_lambda_p2", None if pick is None else pick.get("lambda_p2"))
    if p1 is None or p2 is None:
        return set()
    return {run for run, arm in arm_of.items()
            if math.isclose(float(arm.get("lambda_p1", math.nan)), float(p1), rel_tol=1e-9)
            and math.isclose(float(arm.get("lambda_p2", math.nan)), float(p2), rel_tol=1e-9)}


CONFIRM_MEASURES: tuple[tuple[str, str, str], ...] = (
    ("micro_f1", "micro_f1", "task micro-F1"), ("m1/P1/p_pos", "m1_P1_p_pos", "M1 P1"),
    ("m1/P2/p_pos", "m1_P2_p_pos", "M1 P2"), ("m1/P2C/p_pos", "m1_P2C_p_pos", "M1 P2C"))
"""Table 41's measures: run metric, per-note column, label."""


def confirmation_tables(sel: Selection, evaluate: pd.DataFrame, per_note: pd.DataFrame,
                        selected: set[str], reference_arm: str, *,
                        n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0
                        ) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """Table 41 of one selection: ``(levels, paired, why)``.

    levels: per row (anchors, the selected arm, the reference arm) ``n_seeds`` and per measure
    of :data:`CONFIRM_MEASURES` the mean and sd over seeds; paired: the selected arm minus the
    reference, seed-matched and note-clustered (:func:`analysis.paired.seed_matched`) per
    measure; why: non-empty when the paired lines could not be formed.
    """
    runs = _split_runs(evaluate, sel.split)
    groups = {}
    if not runs.empty:
        for arm in ANCHOR_ARMS:
            got = runs[(runs["arm"] == arm) & ((runs["model"] == sel.model) | (arm == "teacher"))]
            if len(got):
                groups[arm] = got
        chosen = runs[runs["train_run"].isin(list(selected))]
        if len(chosen):
            groups[f"{sel.arm} (selected)"] = chosen
        ref = runs[(runs["arm"] == reference_arm) & (runs["model"] == sel.model)]
        if len(ref):
            groups[reference_arm] = ref
    levels = []
    for label, grp in groups.items():
        rec: dict[str, Any] = {"selection": sel.name, "row": label, "n_seeds": len(grp),
                               "seeds": ",".join(str(s) for s in sorted(grp["seed"].dropna()))}
        for metric, _, name in CONFIRM_MEASURES:
            vals = grp[metric].dropna().to_numpy(float) if metric in grp else np.array([])
            rec[f"{metric}.mean"] = float(vals.mean()) if len(vals) else math.nan
            rec[f"{metric}.sd"] = float(vals.std(ddof=1)) if len(vals) > 1 else math.nan
        levels.append(rec)
    level_frame = pd.DataFrame.from_records(levels)
    label = f"{sel.arm} (selected)"
    if label not in groups:
        return level_frame, pd.DataFrame(), (f"no evaluate run on the {sel.split} notes of a "
                                             f"train run of {sel.arm} at the picked λ")
    if reference_arm not in groups:
        return level_frame, pd.DataFrame(), (f"no evaluate run of {reference_arm} on the "
                                             f"{sel.split} notes")
    a = per_note[per_note["run_id"].isin(groups[label]["run_id"])]
    r = per_note[per_note["run_id"].isin(groups[reference_arm]["run_id"])]
    pairs = []
    for _, col, name in CONFIRM_MEASURES:
        if col not in a.columns or a[col].isna().all() or r[col].isna().all():
            continue
        try:
            res = paired.seed_matched(a, r, col, n_resamples=n_resamples, seed=seed)
        except MistillInputError:
            continue
        pairs.append({"selection": sel.name, "model": sel.model, "arm": label,
                      "reference": reference_arm,
                      "measure": name, **paired.clustered_row(res)})
    why = "" if pairs else "the two arms share no note with per-note values"
    return level_frame, pd.DataFrame.from_records(pairs), why


def confirmation_display(levels: pd.DataFrame) -> pd.DataFrame:
    out = []
    for _, r in levels.iterrows():
        rec = {"selection": r["selection"], "row": r["row"], "seeds": int(r["n_seeds"])}
        for metric, _, name in CONFIRM_MEASURES:
            rec[name] = fmt_mean_sd(r[f"{metric}.mean"], r[f"{metric}.sd"], int(r["n_seeds"]))
        out.append(rec)
    return pd.DataFrame.from_records(out)


# ---------------------------------------------------------------------------------- Table 42
def reselection_table(sel: Selection, evaluate: pd.DataFrame, eval_notes: pd.DataFrame,
                      own: pd.DataFrame, own_notes: pd.DataFrame, reference_arm: str,
                      test_split: str, *, n_resamples: int = stats.N_BOOTSTRAP,
                      seed: int = 0) -> pd.DataFrame:
    """Table 42 of one selection: per cell its validation metric and tie-break, its test
    micro-F1 (the ``evaluate`` run on ``test_split`` of the cell's train run) and own-heads
    recovery at :data:`OWN_CELL` (the cell's ``own_heads`` run), and the note-clustered
    differences of both against every seed of the reference arm of the cell's precision
    (``task Δ``, ``own Δ``: mean [95% CI], notes higher/lower). Missing pieces are named in
    ``note``."""
    phase, k = OWN_CELL
    tests = _split_runs(evaluate, test_split)
    rows = []
    for _, cell in sel.cells.iterrows():
        train = cell.get("train_run")
        rec: dict[str, Any] = {"selection": sel.name, "cell": str(cell.get("cell", "")),
                               "lambda_p1": cell.get("lambda_p1"),
                               "lambda_p2": cell.get("lambda_p2"),
                               "val_metric": pd.to_numeric(cell.get("metric"), errors="coerce"),
                               "val_tie_break": pd.to_numeric(cell.get("tie_break"),
                                                              errors="coerce")}
        notes = []
        if not isinstance(train, str) or not train:
            rows.append({**rec, "note": "the cell has no train run"})
            continue
        test = tests[tests["train_run"] == train] if not tests.empty else tests
        mine_own = own[own["train_run"] == train] if not own.empty else own
        precision = (test["precision"].iloc[0] if len(test) else
                     mine_own["precision"].iloc[0] if len(mine_own) else None)
        if test.empty:
            notes.append(f"no {test_split} evaluation of the cell's train run")
        else:
            rec["test_micro_f1"] = float(test["micro_f1"].iloc[0])
            ref = tests[(tests["arm"] == reference_arm) & (tests["model"] == sel.model)
                        & (tests["precision"] == precision)]
            rec.update(_clustered(eval_notes, test, ref, "micro_f1", "task", n_resamples, seed,
                                  notes, f"no {test_split} evaluation of {reference_arm} "
                                         f"({precision})"))
        if mine_own.empty:
            notes.append("no own_heads run of the cell's train run")
        else:
            cell_notes = own_notes[(own_notes["phase"] == phase) & (own_notes["k"] == k)] \
                if not own_notes.empty else own_notes
            rec["own_recovery"] = _value(mine_own.iloc[0], f"m4/{phase}/k{k}/recovery_own")
            ref_own = own[(own["arm"] == reference_arm) & (own["model"] == sel.model)
                          & (own["precision"] == precision)]
            rec.update(_clustered(cell_notes, mine_own, ref_own, "recovery_own", "own",
                                  n_resamples, seed, notes,
                                  f"no own_heads run of {reference_arm} ({precision})"))
        rows.append({**rec, "note": "; ".join(notes)})
    return pd.DataFrame.from_records(rows, columns=[
        "selection", "cell", "lambda_p1", "lambda_p2", "val_metric", "val_tie_break",
        "test_micro_f1", "task.mean_diff", "task.ci_low", "task.ci_high", "task.n_higher",
        "task.n_lower", "own_recovery", "own.mean_diff", "own.ci_low", "own.ci_high",
        "own.n_higher", "own.n_lower", "note"])


def _clustered(per_note: pd.DataFrame, arm_runs: pd.DataFrame, ref_runs: pd.DataFrame,
               value: str, prefix: str, n_resamples: int, seed: int, notes: list[str],
               missing: str) -> dict[str, Any]:
    if ref_runs.empty:
        notes.append(missing)
        return {}
    a = per_note[per_note["run_id"].isin(arm_runs["run_id"])] if not per_note.empty else per_note
    r = per_note[per_note["run_id"].isin(ref_runs["run_id"])] if not per_note.empty else per_note
    try:
        res = paired.seed_matched(a, r, value, n_resamples=n_resamples, seed=seed).overall
    except MistillInputError as exc:
        notes.append(f"{prefix}: {exc}")
        return {}
    return {f"{prefix}.mean_diff": res.mean_diff, f"{prefix}.ci_low": res.ci_low,
            f"{prefix}.ci_high": res.ci_high, f"{prefix}.n_higher": res.n_higher,
            f"{prefix}.n_lower": res.n_lower}


def reselection_display(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    for _, r in table.iterrows():
        rec = {"selection": r["selection"], "cell": r["cell"],
               "val metric": _fmt(r["val_metric"]), "val tie-break": _fmt(r["val_tie_break"]),
               "test micro-F1": _fmt(r["test_micro_f1"]),
               "task Δ [95% CI]": fmt_ci(r["task.mean_diff"], r["task.ci_low"],
                                        r["task.ci_high"]),
               "own P2C k40": _fmt(r["own_recovery"]),
               "own Δ [95% CI]": fmt_ci(r["own.mean_diff"], r["own.ci_low"], r["own.ci_high"]),
               "note": r["note"] or ""}
        out.append(rec)
    return pd.DataFrame.from_records(out)
