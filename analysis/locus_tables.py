"""The locus pass's tables (paper App. F, Tables 25–33, Figure 5) from its per-mention rows.

Inputs are the rows the ``locus`` stage stores per note (:mod:`mistill.instrument.locus_pass`):
``probes`` (one row per chapter mention: outcome, distance, jump, the compared suffixes, the
locus-token class, Table 28's shares, pass A's destroyed shares), ``pass_b``,
``follow_through`` and ``swap`` rows. Set effects are reported as the paper does: medians over
notes of per-note means, with the 10th–90th percentile over notes where the paper gives one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from mistill.instrument.locus import OUTCOMES
from mistill.instrument.locus_tokens import TOKEN_CLASSES

__all__ = ["suffix_table", "outcome_table", "locus_token_table", "position_table", "prose_time_table",
           "pass_a_table", "pass_b_table", "follow_through_table", "reads_table", "swap_table", "distance_table",
           "summary_metrics", "MENTION_KINDS"]

MENTION_KINDS = ("first_code", "previous_same_chapter", "previous_other_chapter")
"""Table 26's columns besides "all": the first code of the trace, and mentions whose previous
code (the one mentioned just before) is in the same or in another chapter."""


def _note_stats(df: pd.DataFrame, col: str) -> tuple[float, float, float, int]:
    """Median over notes of the per-note mean of ``col``, its 10th and 90th percentiles, notes."""
    if df.empty or col not in df:
        return float("nan"), float("nan"), float("nan"), 0
    per_note = df.groupby("note_id")[col].mean().dropna()
    if per_note.empty:
        return float("nan"), float("nan"), float("nan"), 0
    return (float(per_note.median()), float(per_note.quantile(0.1)), float(per_note.quantile(0.9)),
            int(per_note.size))


def _shares(outcomes: pd.Series) -> dict[str, float]:
    n = len(outcomes)
    return {o: (float((outcomes == o).sum()) / n if n else float("nan")) for o in OUTCOMES}


def outcome_table(probes: pd.DataFrame) -> pd.DataFrame:
    """Table 26: each outcome's share of the mentions of each column (all, then by kind of
    mention), and the number of mentions."""
    if probes.empty:
        return pd.DataFrame()
    cols = {"all": probes}
    cols.update({k: probes[probes["mention_kind"] == k] for k in MENTION_KINDS})
    out = pd.DataFrame({name: {**_shares(df["outcome"]), "n_mentions": float(len(df))} for name, df in cols.items()})
    out.index.name = "outcome"
    return out


def suffix_table(probes: pd.DataFrame, suffix: str, compared: Sequence[str]) -> pd.DataFrame:
    """Table 25: under each suffix, the outcome shares, the median distance of the window loci
    and the per-mention agreement of the outcome with the run's suffix."""
    if probes.empty:
        return pd.DataFrame()
    rows = []
    for name in [suffix, *compared]:
        o_col = "outcome" if name == suffix else f"outcome_{name}"
        d_col = "distance" if name == suffix else f"distance_{name}"
        if o_col not in probes:
            continue
        window = probes[probes[o_col] == "window"][d_col].dropna()
        rows.append({"suffix": name, **_shares(probes[o_col]),
                     "median_window_distance": float(window.median()) if len(window) else float("nan"),
                     "agreement": float((probes[o_col] == probes["outcome"]).mean()),
                     "n_mentions": len(probes)})
    return pd.DataFrame(rows).set_index("suffix")


def distance_table(probes: pd.DataFrame) -> pd.DataFrame:
    """Distances and robustness (App. F, "Distance, step size and robustness"): the window
    loci's median distance with its 10th–90th percentile (all, and first codes), the median jump
    across the crossing step, the share whose curve returns above θ, and per-note window and
    inherited shares (median, 10th, 90th percentile over notes)."""
    if probes.empty:
        return pd.DataFrame()
    win = probes[probes["outcome"] == "window"]
    first = win[win["mention_kind"] == "first_code"]
    rows = []

    def quant(name: str, s: pd.Series) -> None:
        s = s.dropna().astype(float)
        rows.append({"quantity": name, "median": float(s.median()) if len(s) else float("nan"),
                     "p10": float(s.quantile(0.1)) if len(s) else float("nan"),
                     "p90": float(s.quantile(0.9)) if len(s) else float("nan"), "n": int(len(s))})

    quant("window distance (tokens)", win["distance"])
    quant("window distance, first codes", first["distance"])
    quant("jump across the crossing step (nats)", probes["jump"] if "jump" in probes else pd.Series(dtype=float))
    per_note = probes.groupby("note_id")["outcome"]
    quant("per-note window share", per_note.apply(lambda s: float((s == "window").mean())))
    quant("per-note inherited share", per_note.apply(lambda s: float((s == "inherited").mean())))
    back = probes["returns_above"].dropna().astype(float) if "returns_above" in probes else pd.Series(dtype=float)
    rows.append({"quantity": "share returning above theta", "median": float(back.mean()) if len(back) else float("nan"),
                 "p10": float("nan"), "p90": float("nan"), "n": int(len(back))})
    return pd.DataFrame(rows).set_index("quantity")


def locus_token_table(probes: pd.DataFrame, window_class_counts: Mapping[str, int]) -> pd.DataFrame:
    """Table 27: for the window-decided mentions, each class's share among every attribution
    window token (base rate), among the loci, and the lift (loci share / base rate)."""
    total = sum(int(v) for v in window_class_counts.values())
    loci = probes[probes["outcome"] == "window"]["locus_class"].dropna() if "locus_class" in probes else pd.Series()
    rows = []
    for c in TOKEN_CLASSES:
        base = window_class_counts.get(c, 0) / total if total else float("nan")
        share = float((loci == c).mean()) if len(loci) else float("nan")
        rows.append({"class": c, "base_rate": base, "loci_share": share,
                     "lift": share / base if base and np.isfinite(base) and base > 0 else float("nan")})
    return pd.DataFrame(rows).set_index("class")


def position_table(probes: pd.DataFrame) -> pd.DataFrame:
    """Table 28: mean over the attributed mentions of each event's share of its positive
    importance at the locus, 1–3 before, 4–15, 16–63 before, and at the suffix."""
    cols = [c for c in ("share_locus", "share_before_1_3", "share_before_4_15", "share_before_16_63",
                        "share_suffix") if c in probes]
    if not cols:
        return pd.DataFrame()
    att = probes[probes["attributed"].astype(bool)]
    return pd.DataFrame({"share": att[cols].mean(), "n_mentions": len(att)}).rename(
        index=lambda c: c.removeprefix("share_"))


def prose_time_table(head_sets: Mapping, names: Sequence[str], emission_rank: Sequence[int], *,
                     top: int = 16) -> pd.DataFrame:
    """Table 29: the prose-time top-``top``: I_c summed over the window positions with its 95 %
    bootstrap interval, and each head's rank in the emission-time chapter ranking; the overlaps
    with the emission set at k = 8, 16, 40 are in the columns ``shared_top<k>`` of the first row."""
    body = head_sets.get("prose_time")
    if not body:
        return pd.DataFrame()
    emission_pos = {names[h]: i + 1 for i, h in enumerate(emission_rank)}
    intervals = body.get("intervals", {})
    rows = []
    for i, (head, ic) in enumerate(zip(body["ranking"][:top], body["importance_c"][:top])):
        lo, hi = intervals.get(head, [float("nan"), float("nan")])
        rows.append({"rank": i + 1, "head": head, "I_c": ic, "ci_low": lo, "ci_high": hi,
                     "emission_rank": emission_pos.get(head)})
    out = pd.DataFrame(rows).set_index("rank")
    emission_names = [names[h] for h in emission_rank]
    for k in (8, 16, 40):
        out.loc[out.index[0], f"shared_top{k}"] = len(set(body["ranking"][:k]) & set(emission_names[:k]))
    return out


def _set_rows(df: pd.DataFrame, prefix: str) -> pd.DataFrame:
    rows = []
    for col in [c for c in df.columns if c.startswith(prefix)]:
        med, p10, p90, n = _note_stats(df, col)
        rows.append({"set": col.removeprefix(prefix), "destroyed_share": med, "p10": p10, "p90": p90, "n_notes": n})
    return pd.DataFrame(rows).set_index("set") if rows else pd.DataFrame()


def pass_a_table(probes: pd.DataFrame, pass_k: Sequence[int], position_k: int) -> pd.DataFrame:
    """Table 30: share of the forced margin destroyed by each set of pass A (medians over notes
    of per-note means over the attributed mentions, with the 10th–90th percentile)."""
    if probes.empty or "attributed" not in probes:
        return pd.DataFrame()
    return _set_rows(probes[probes["attributed"].astype(bool)], "passA_")


def pass_b_table(pass_b: pd.DataFrame, pass_k: Sequence[int]) -> pd.DataFrame:
    """Table 32: pass B's destroyed shares, and the notes on which the prose-time set (window
    only) beats count-matched random heads."""
    if pass_b.empty:
        return pd.DataFrame()
    out = _set_rows(pass_b, "passB_")
    for k in pass_k:
        a, b = f"passB_prose_top{k}_window", f"passB_random{k}_window"
        if a in pass_b and b in pass_b:
            per = pass_b.groupby("note_id")[[a, b]].mean().dropna()
            out.loc[f"prose_top{k}_window", "notes_beating_random"] = int((per[a] > per[b]).sum())
            out.loc[f"prose_top{k}_window", "notes_compared"] = int(len(per))
    return out


def follow_through_table(ft: pd.DataFrame, *, min_forced_drop: float = 1.0) -> pd.DataFrame:
    """Table 31: per set (window-ablated, then sustained to the code): the natural margin removed
    at the chapter letter (median, mean), the ratio natural / forced on the mentions whose forced
    drop exceeds ``min_forced_drop`` nats (the prose-time set, whose forced drop pass B measured),
    and the share of natural decisions flipped."""
    if ft.empty:
        return pd.DataFrame()
    rows = []
    for (name, sustained), g in ft.groupby(["set", "sustained"], sort=True):
        forced = pd.to_numeric(g["forced_drop"], errors="coerce")
        keep = forced > min_forced_drop
        ratio = float((g.loc[keep, "natural_drop"].median() / forced[keep].median())) if keep.any() else float("nan")
        rows.append({"set": name, "sustained": bool(sustained),
                     "forced_drop_median": float(forced.median()) if forced.notna().any() else float("nan"),
                     "natural_drop_median": float(g["natural_drop"].median()),
                     "natural_drop_mean": float(g["natural_drop"].mean()),
                     "ratio_natural_forced": ratio, "flipped_share": float(g["flipped"].astype(float).mean()),
                     "n_mentions": int(len(g))})
    return pd.DataFrame(rows).set_index(["set", "sustained"])


def reads_table(reads: pd.DataFrame) -> pd.DataFrame:
    """Table 33: per head group, the mean over loci of each category's share, the region lift
    and ``n_eff`` over inventory tokens."""
    if reads.empty:
        return pd.DataFrame()
    values = reads.drop(columns=[c for c in ("note_id", "event_id") if c in reads]).mean()
    rows: dict[str, dict[str, float]] = {}
    for key, v in values.items():
        group, quantity = str(key).split(".", 1)
        rows.setdefault(group, {})[quantity] = float(v)
    out = pd.DataFrame.from_dict(rows, orient="index")
    out.index.name = "group"
    out["n_loci"] = len(reads)
    return out


def swap_table(swap: pd.DataFrame) -> pd.DataFrame:
    """Figure 5's data: per place and layer, the median of every numeric quantity of the swap
    rows (forced and natural margins of the target's and the donor's letter, their drops)."""
    if swap.empty:
        return pd.DataFrame()
    numeric = [c for c in swap.columns if c not in ("note_id", "event_id", "donor_event_id", "place", "layer")
               and pd.api.types.is_numeric_dtype(swap[c])]
    out = swap.groupby(["place", "layer"])[numeric].median()
    out["n_mentions"] = swap.groupby(["place", "layer"]).size()
    return out


def summary_metrics(probes: pd.DataFrame, pass_b: pd.DataFrame, ft: pd.DataFrame,
                    follow_k: int) -> dict[str, float]:
    """Scalar metrics of the locus run: outcome shares, the median window distance, pass B's
    prose-time top-8 and top-16 at the window, and the follow-through ratio."""
    out: dict[str, float] = {}
    if probes.empty:
        return out
    for o, v in _shares(probes["outcome"]).items():
        out[f"locus/share_{o}"] = v
    win = probes[probes["outcome"] == "window"]["distance"].dropna()
    if len(win):
        out["locus/median_window_distance"] = float(win.median())
    out["locus/n_mentions"] = float(len(probes))
    for col in [c for c in pass_b.columns if c.startswith("passB_prose_top")] if not pass_b.empty else []:
        med = _note_stats(pass_b, col)[0]
        if np.isfinite(med):
            out[f"locus/{col}"] = med
    table = follow_through_table(ft)
    if not table.empty and ("prose", False) in table.index:
        ratio = table.loc[("prose", False), "ratio_natural_forced"]
        if np.isfinite(ratio):
            out["locus/follow_through_ratio"] = float(ratio)
    return {k: float(v) for k, v in out.items() if v is not None and np.isfinite(v)}
