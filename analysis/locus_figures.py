"""Figure 1 of the paper from the locus pass's tables (App. F; Sec. 3.4).

* (a) :func:`locus_distance_figure`: the distance of the window loci before the letter, stacked
  by whether the locus token is a word of the emitted code's own description; the subtitle gives
  that class's lift over its base rate.
* (b) :func:`window_suffix_figure`: window-only against suffix-only ablation of the emission
  top-16 (pass A) and the fixed prose-time top-16 (pass B): the share of the forced margin
  destroyed.
* (c) :func:`locus_reads_figure`: what each 16-head group reads at the locus (Table 33's shares).

Each takes the frames the report loads (one model's rows or several, told apart by ``model``).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

__all__ = ["figure1", "locus_distance_figure", "window_suffix_figure", "locus_reads_figure"]

_CATEGORIES = ("region", "other_lines", "note", "prose", "sink", "rest")


def locus_distance_figure(mentions: pd.DataFrame, lift: float | None = None):
    """(a) Histogram of the window loci's distance (tokens before the letter)."""
    import plotly.graph_objects as go  # deferred: plotly is slow to import

    win = mentions[mentions["outcome"] == "window"].dropna(subset=["distance"])
    if win.empty:
        return None
    own = win.get("locus_class", pd.Series(index=win.index, dtype=object)) == "own_description"
    fig = go.Figure()
    fig.add_trace(go.Histogram(x=win.loc[own, "distance"].tolist(), name="own description word", xbins={"size": 2}))
    fig.add_trace(go.Histogram(x=win.loc[~own, "distance"].tolist(), name="other token", xbins={"size": 2}))
    sub = f"{len(win)} window-decided mentions; median {win['distance'].median():.0f} tokens"
    if lift is not None and pd.notna(lift):
        sub += f"; own-description lift {lift:.1f}"
    fig.update_layout(barmode="stack", template="plotly_white",
                      title=f"Figure 1a: where the chapter becomes elicitable<br><sup>{sub}</sup>",
                      xaxis_title="locus distance before the letter (tokens)", yaxis_title="mentions")
    return fig


def _share(frame: pd.DataFrame, key: str, column: str = "destroyed_share") -> float | None:
    if frame.empty or "set" not in frame or column not in frame:
        return None
    rows = frame[frame["set"] == key]
    return float(rows[column].median()) if len(rows) else None


def window_suffix_figure(pass_a: pd.DataFrame, pass_b: pd.DataFrame, k: int = 16):
    """(b) Window-only vs suffix-only ablation of the emission and prose-time top-k."""
    import plotly.graph_objects as go  # deferred: plotly is slow to import

    bars = {
        f"emission top-{k}": (_share(pass_a, f"emission_top{k}_window"), _share(pass_a, f"emission_top{k}_suffix")),
        f"prose-time top-{k}": (_share(pass_b, f"prose_top{k}_window"), _share(pass_b, f"prose_top{k}_suffix")),
    }
    if all(v is None for pair in bars.values() for v in pair):
        return None
    fig = go.Figure()
    for name, (window, suffix) in bars.items():
        fig.add_trace(go.Bar(x=["window positions only", "suffix positions only"], y=[window, suffix], name=name))
    fig.update_layout(barmode="group", template="plotly_white",
                      title="Figure 1b: the dissociation by position<br><sup>share of the forced chapter margin "
                            "destroyed (median over notes)</sup>", yaxis_title="share destroyed")
    return fig


def locus_reads_figure(reads: pd.DataFrame):
    """(c) Stacked attention shares of each head group at the locus."""
    import plotly.graph_objects as go  # deferred: plotly is slow to import

    if reads.empty or "group" not in reads:
        return None
    fig = go.Figure()
    for cat in _CATEGORIES:
        if cat in reads:
            fig.add_trace(go.Bar(x=reads["group"].astype(str).tolist(), y=reads[cat].tolist(), name=cat))
    fig.update_layout(barmode="stack", template="plotly_white",
                      title="Figure 1c: what the heads read at the locus<br><sup>attention share per key "
                            "category, mean over loci</sup>", yaxis_title="attention share")
    return fig


def figure1(mentions: pd.DataFrame, pass_a: pd.DataFrame, pass_b: pd.DataFrame, reads: pd.DataFrame,
            tokens: pd.DataFrame | None = None) -> dict[str, Any]:
    """The three panels that the frames allow, keyed ``figure1a_locus_distance`` etc."""
    lift = None
    if tokens is not None and not tokens.empty and "class" in tokens:
        row = tokens[tokens["class"] == "own_description"]
        lift = float(row["lift"].iloc[0]) if len(row) else None
    out = {"figure1a_locus_distance": locus_distance_figure(mentions, lift) if not mentions.empty else None,
           "figure1b_window_suffix": window_suffix_figure(pass_a, pass_b),
           "figure1c_locus_reads": locus_reads_figure(reads)}
    return {k: v for k, v in out.items() if v is not None}
