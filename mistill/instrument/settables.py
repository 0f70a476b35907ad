"""Necessity and knock-in summary tables of the set tests (paper Tables 1, 10 and 14).

Input rows, one per note x phase x k x set::

    {"note_id", "phase", "k", "set": "global" | "random" | "bottom" | "own",
     "necessity": per-note mean over the note's events of the share of the clean margin
                  destroyed (>1: flipped),
     "recovery":  per-note mean over the note's gated events of the knock-in recovery
                  (NaN if the note has no gated event),
     "n_events", "n_gated"}

:func:`sets_table` gives one row per (phase, k): per set the median over notes of necessity and
of recovery with the notes counted, and the paired comparisons of the global set against the
random set and against the note's own ranking: notes where the global set is higher / lower /
tied (among notes having both values) and the exact two-sided sign-test p (ties dropped). The
"notes" column of Tables 1 and 10 is ``*.wins_vs_random``.

:func:`to_markdown` and :func:`to_latex` are small writers with no tabulate dependency.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from mistill import stats
from mistill.errors import MistillInputError

__all__ = ["SETS", "MEASURES", "COMPARISONS", "sets_long", "sets_table", "to_markdown",
           "to_latex", "format_cell"]

SETS: tuple[str, ...] = ("global", "random", "bottom", "own")
MEASURES: tuple[str, ...] = ("necessity", "recovery")
COMPARISONS: tuple[str, ...] = ("random", "own")  # the global set against these
_PHASE_ORDER = {"P1": 0, "P2": 1, "P2C": 2}
_REQUIRED = ("note_id", "phase", "k", "set", "necessity", "recovery")


def _frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Validated rows as a DataFrame with float measures; one row per (phase, k, set, note)."""
    recs = []
    for i, r in enumerate(rows):
        missing = [f for f in _REQUIRED if f not in r]
        note = str(r.get("note_id")) if "note_id" in r else None
        if missing:
            raise MistillInputError(f"set-test row {i} lacks {missing}", note=note,
                                    field=missing[0])
        if r["set"] not in SETS:
            raise MistillInputError(f"unknown set {r['set']!r}; expected one of {list(SETS)}",
                                    note=note, field="set")
        try:
            k = int(r["k"])
            vals = {m: float("nan") if r[m] is None else float(r[m]) for m in MEASURES}
        except (TypeError, ValueError) as exc:
            raise MistillInputError(f"set-test row {i}: {exc}", note=note, field="k") from exc
        recs.append({"note_id": note, "phase": str(r["phase"]), "k": k, "set": r["set"], **vals,
                     "n_events": r.get("n_events"), "n_gated": r.get("n_gated")})
    if not recs:
        raise MistillInputError("no set-test rows", field="rows")
    df = pd.DataFrame.from_records(recs)
    dup = df.duplicated(["phase", "k", "set", "note_id"])
    if dup.any():
        r = df[dup].iloc[0]
        raise MistillInputError(f"two rows for phase {r.phase}, k={r.k}, set {r.set}",
                                note=r.note_id, field="set")
    return df


def _group_order(df: pd.DataFrame) -> list[tuple[str, int]]:
    keys = {(p, int(k)) for p, k in zip(df["phase"], df["k"])}
    return sorted(keys, key=lambda pk: (_PHASE_ORDER.get(pk[0], 99), pk[0], pk[1]))


def sets_long(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Per (phase, k, set): median over notes of necessity and of recovery, and the notes
    counted for each (NaNs dropped). Columns ``phase, k, set, necessity, n_necessity, recovery,
    n_recovery``."""
    return _long(_frame(rows))


def _long(df: pd.DataFrame) -> pd.DataFrame:
    out = []
    for (phase, k) in _group_order(df):
        g = df[(df["phase"] == phase) & (df["k"] == k)]
        for s in SETS:
            gs = g[g["set"] == s]
            if gs.empty:
                continue
            rec = {"phase": phase, "k": k, "set": s}
            for m in MEASURES:
                v = gs[m].dropna()
                rec[m] = float(v.median()) if len(v) else float("nan")
                rec[f"n_{m}"] = int(len(v))
            out.append(rec)
    return pd.DataFrame.from_records(out)


def _paired(g: pd.DataFrame, measure: str, other: str) -> dict[str, Any]:
    """Global against ``other`` on one measure, notes having both values."""
    a = g[g["set"] == "global"].set_index("note_id")[measure].dropna()
    b = g[g["set"] == other].set_index("note_id")[measure].dropna()
    both = a.index.intersection(b.index)
    d = a.loc[both].to_numpy() - b.loc[both].to_numpy()
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    return {"wins": wins, "losses": losses, "ties": int(len(d) - wins - losses),
            "n": int(len(d)), "sign_p": stats.sign_test(wins, losses) if len(d) else float("nan")}


def sets_table(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per (phase, k), phases in P1/P2/P2C order and k ascending.

    Columns: ``phase, k``; for each set present in the rows ``<measure>.<set>`` (median over
    notes) and ``n_<measure>.<set>`` (notes counted); for each comparison set present
    ``<measure>.wins_vs_<set>``, ``.losses_vs_<set>``, ``.ties_vs_<set>``, ``.n_vs_<set>``
    (notes having both) and ``.sign_p_vs_<set>``. Cells of a (phase, k) lacking a set are NaN
    (counts are nullable integers).
    """
    df = _frame(rows)
    present = [s for s in SETS if (df["set"] == s).any()]
    comps = [c for c in COMPARISONS if c in present and "global" in present]
    long = _long(df)
    out = []
    for (phase, k) in _group_order(df):
        rec: dict[str, Any] = {"phase": phase, "k": k}
        cell = long[(long["phase"] == phase) & (long["k"] == k)].set_index("set")
        for m in MEASURES:
            for s in present:
                rec[f"{m}.{s}"] = float(cell.at[s, m]) if s in cell.index else float("nan")
                rec[f"n_{m}.{s}"] = int(cell.at[s, f"n_{m}"]) if s in cell.index else pd.NA
        g = df[(df["phase"] == phase) & (df["k"] == k)]
        for m in MEASURES:
            for c in comps:
                res = _paired(g, m, c) if {"global", c} <= set(g["set"]) else None
                for key in ("wins", "losses", "ties", "n", "sign_p"):
                    rec[f"{m}.{key}_vs_{c}"] = (res[key] if res is not None else
                                                (float("nan") if key == "sign_p" else pd.NA))
        out.append(rec)
    table = pd.DataFrame.from_records(out)
    for col in table.columns:
        if col.startswith("n_") or any(f".{key}_vs_" in col for key in
                                       ("wins", "losses", "ties", "n")):
            table[col] = table[col].astype("Int64")
    return table


# --------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------

def _is_p_column(name: str) -> bool:
    return name == "p" or name.endswith("_p") or "sign_p" in name or name.startswith("p_")


def format_cell(value: Any, *, digits: int = 3, p_value: bool = False, missing: str = "") -> str:
    """A table cell: integers as integers, other numbers to ``digits`` decimals (a p-value below
    ``10**-digits`` in scientific notation so it does not print as zero), NaN/NA as ``missing``."""
    if value is None or value is pd.NA:
        return missing
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isnan(v):
            return missing
        if p_value and 0 < v < 10 ** -digits:
            return f"{v:.1e}"
        return f"{v:.{digits}f}"
    return str(value)


def _cells(df: pd.DataFrame, digits: int,
           missing: str) -> tuple[list[str], list[list[str]], list[bool]]:
    if not isinstance(df.index, pd.RangeIndex):
        df = df.reset_index()
    cols = [str(c) for c in df.columns]
    numeric = [pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])
               for c in df.columns]
    body = [[format_cell(v, digits=digits, p_value=_is_p_column(c), missing=missing)
             for c, v in zip(cols, row)] for row in df.itertuples(index=False, name=None)]
    return cols, body, numeric


def to_markdown(df: pd.DataFrame, *, digits: int = 3, missing: str = "–") -> str:
    """A GitHub-flavoured Markdown table of ``df`` (numbers right-aligned)."""
    cols, body, numeric = _cells(df, digits, missing)

    def esc(s: str) -> str:
        return s.replace("|", "\\|")

    lines = ["| " + " | ".join(esc(c) for c in cols) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(esc(v) for v in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
                  "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}",
                  "^": r"\textasciicircum{}"}


def _latex_escape(s: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in s)


def to_latex(df: pd.DataFrame, *, digits: int = 3, missing: str = "--",
             booktabs: bool = True) -> str:
    """A LaTeX ``tabular`` of ``df`` (``booktabs`` rules by default; numbers right-aligned)."""
    cols, body, numeric = _cells(df, digits, "\x00")
    top, mid, bottom = ((r"\toprule", r"\midrule", r"\bottomrule") if booktabs
                        else (r"\hline", r"\hline", r"\hline"))
    spec = "".join("r" if n else "l" for n in numeric)

    def cell(v: str) -> str:
        return missing if v == "\x00" else _latex_escape(v)

    lines = [rf"\begin{{tabular}}{{{spec}}}", top,
             " & ".join(_latex_escape(c) for c in cols) + r" \\", mid]
    lines += [" & ".join(cell(v) for v in row) + r" \\" for row in body]
    lines += [bottom, r"\end{tabular}"]
    return "\n".join(lines) + "\n"

