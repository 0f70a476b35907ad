"""Plotly figures of the report, logged as self-contained HTML (:meth:`StageRun.log_figure`).

* :func:`recovery_figure`: knock-in recovery against k, one panel per phase, solid lines for
  the sets or arms measured and dashed lines for their random floors.
* :func:`paired_differences_figure`: per-note paired differences, one panel per measure, one
  column of points per comparison, with the mean and its bootstrap interval.
* :func:`lambda_frontier_figure`: the λ selection grid's validation metric against λ, one
  marker per cell coloured by its state, the tie-break value in the hover text.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from mistill.errors import MistillInputError

__all__ = [
    "lambda_frontier_figure",
    "paired_differences_figure",
    "recovery_figure",
    "recovery_long_from_own",
    "recovery_long_from_sets",
]

_PHASE_ORDER = ("P1", "P2", "P2C")
_FLOOR_COLOURS = {"random": "#7f7f7f", "bottom": "#d62728"}
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
            "#bcbd22", "#d62728", "#7f7f7f")


def _phases(values: Sequence[str]) -> list[str]:
    present = list(dict.fromkeys(str(v) for v in values))
    return [p for p in _PHASE_ORDER if p in present] + sorted(p for p in present
                                                              if p not in _PHASE_ORDER)


def recovery_long_from_sets(per_note_sets: pd.DataFrame) -> pd.DataFrame:
    """Knock-in rows of ``knockin`` runs as the figure's input: per (model, phase, k, set) the
    median recovery over notes; ``random`` and ``bottom`` are floors."""
    g = per_note_sets.groupby(["model", "phase", "k", "set"], sort=True)["recovery"].median()
    out = g.reset_index()
    out["series"] = out["set"] if out["model"].nunique() <= 1 else \
        out["model"].astype(str) + " " + out["set"]
    out["floor"] = out["set"].isin(["random", "bottom"])
    return out[["phase", "k", "series", "recovery", "floor"]]


def recovery_long_from_own(per_note_own: pd.DataFrame) -> pd.DataFrame:
    """Own-heads rows as the figure's input: per (model, arm, phase, k) the mean over seeds of
    the median over notes of ``recovery_own``, and the same of ``recovery_random`` as a floor."""
    seed_medians = per_note_own.groupby(["model", "arm", "seed", "phase", "k"], dropna=False)[
        ["recovery_own", "recovery_random"]].median()
    means = seed_medians.groupby(["model", "arm", "phase", "k"], dropna=False).mean().reset_index()
    several = means["model"].nunique() > 1
    name = (means["model"].astype(str) + " " if several else "") + means["arm"].astype(str)
    own = pd.DataFrame({"phase": means["phase"], "k": means["k"], "series": name,
                        "recovery": means["recovery_own"], "floor": False})
    floor = pd.DataFrame({"phase": means["phase"], "k": means["k"], "series": name + " (random)",
                          "recovery": means["recovery_random"], "floor": True})
    return pd.concat([own, floor], ignore_index=True)


def recovery_figure(long: pd.DataFrame, title: str, subtitle: str = ""):
    """Recovery against k per phase; ``long`` has ``phase, k, series, recovery, floor``.

    A floor named ``<series> (random)`` takes its series' colour, dashed; other floors are
    grey (``random``) or red (``bottom``), dashed."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    long = long.dropna(subset=["series", "recovery"]).assign(series=lambda d: d["series"].astype(str))
    if long.empty:
        raise MistillInputError("no recovery values to plot", field="recovery")
    phases = _phases(long["phase"])
    fig = make_subplots(rows=1, cols=len(phases), subplot_titles=phases, shared_yaxes=True)
    bases = list(dict.fromkeys(long.loc[~long["floor"], "series"]))
    colour = {s: _PALETTE[i % len(_PALETTE)] for i, s in enumerate(bases)}
    colour.update({s: _FLOOR_COLOURS.get(s.split()[-1], "#7f7f7f")
                   for s in long.loc[long["floor"], "series"] if s not in colour})
    for j, phase in enumerate(phases, start=1):
        sub = long[long["phase"] == phase]
        for series, grp in sub.groupby("series", sort=False):
            grp = grp.sort_values("k")
            is_floor = bool(grp["floor"].iloc[0])
            base = next((b for b in bases if series.startswith(b + " ")), series)
            fig.add_trace(go.Scatter(
                x=grp["k"].tolist(), y=grp["recovery"].tolist(), mode="lines+markers",
                name=series, legendgroup=series, showlegend=j == 1,
                line={"color": colour.get(base, colour.get(series)),
                      "dash": "dash" if is_floor else "solid"}), row=1, col=j)
        ks = sorted({int(k) for k in sub["k"]})
        fig.update_xaxes(type="log", title_text="k (heads)", tickvals=ks,
                         ticktext=[str(k) for k in ks], row=1, col=j)
    fig.update_yaxes(title_text="knock-in recovery (median over notes)", row=1, col=1)
    fig.update_layout(title=f"{title}<br><sup>{subtitle}</sup>" if subtitle else title,
                      template="plotly_white")
    return fig


def paired_differences_figure(differences: pd.DataFrame, summary: pd.DataFrame, title: str,
                              subtitle: str = ""):
    """Per-note differences (``model, comparison, measure, note_id, difference``), one panel
    per measure; ``summary`` (a paired table: ``arm, reference, measure, mean_diff, ci_low,
    ci_high``) adds each comparison's mean with its 95% interval."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if differences.empty:
        raise MistillInputError("no per-note differences to plot", field="differences")
    measures = list(dict.fromkeys(differences["measure"]))
    several = differences["model"].nunique() > 1
    fig = make_subplots(rows=len(measures), cols=1, subplot_titles=measures,
                        vertical_spacing=min(0.12, 0.5 / max(1, len(measures))))
    for i, measure in enumerate(measures, start=1):
        sub = differences[differences["measure"] == measure]
        label = (sub["model"].astype(str) + ": " if several else "") + sub["comparison"]
        fig.add_trace(go.Box(x=label, y=sub["difference"], boxpoints="all", jitter=0.4,
                             pointpos=0, name=measure, showlegend=False,
                             marker={"size": 4, "color": "#1f77b4"}, line={"color": "#9ecae1"},
                             text=sub["note_id"], hovertemplate="%{text}: %{y:.3f}"),
                      row=i, col=1)
        rows = summary[summary["measure"] == measure] if not summary.empty else summary
        if not rows.empty:
            x = (rows["model"].astype(str) + ": " if several else "") + \
                rows["arm"].astype(str) + " - " + rows["reference"].astype(str)
            fig.add_trace(go.Scatter(
                x=x, y=rows["mean_diff"], mode="markers", showlegend=i == 1,
                name="mean [95% CI]", legendgroup="mean",
                marker={"symbol": "diamond", "size": 10, "color": "#d62728"},
                error_y={"type": "data", "symmetric": False,
                         "array": (rows["ci_high"] - rows["mean_diff"]).tolist(),
                         "arrayminus": (rows["mean_diff"] - rows["ci_low"]).tolist()}),
                row=i, col=1)
        fig.add_hline(y=0, line={"color": "#444", "width": 1}, row=i, col=1)
        fig.update_yaxes(title_text="arm - reference", row=i, col=1)
    fig.update_layout(title=f"{title}<br><sup>{subtitle}</sup>" if subtitle else title,
                      template="plotly_white", height=320 * len(measures) + 120)
    return fig


def lambda_frontier_figure(cells: pd.DataFrame, title: str = "λ selection: validation frontier"):
    """``cells`` of ``select_lambda`` runs (``lambda_p1, lambda_p2, metric, tie_break, state``;
    optional ``selection`` naming the run and boolean ``picked``): the validation metric against
    λ_P1 on a log axis, one line per selection run and λ_P2 (when it differs from λ_P1),
    markers by state, the picked cells circled."""
    import plotly.graph_objects as go

    need = ["lambda_p1", "lambda_p2", "metric", "tie_break", "state"]
    missing = [c for c in need if c not in cells.columns]
    if missing:
        raise MistillInputError(f"λ cells lack {missing}", field=missing[0])
    if cells.empty:
        raise MistillInputError("no λ cells to plot", field="cells")
    df = cells.copy()
    if "selection" not in df.columns:
        df["selection"] = "selection"
    same = bool((df["lambda_p1"] == df["lambda_p2"]).all())
    df["line"] = df["selection"].astype(str) if same else \
        df["selection"].astype(str) + " λ_P2=" + df["lambda_p2"].astype(str)
    symbols = ["circle", "square", "diamond", "x", "triangle-up", "star", "cross"]
    states = list(dict.fromkeys(df["state"].astype(str)))
    fig = go.Figure()
    for i, (line, grp) in enumerate(df.groupby("line", sort=True)):
        grp = grp.sort_values("lambda_p1")
        fig.add_trace(go.Scatter(
            x=grp["lambda_p1"], y=grp["metric"], mode="lines+markers", name=line,
            line={"color": _PALETTE[i % len(_PALETTE)]},
            marker={"size": 11, "symbol": [symbols[states.index(str(s)) % len(symbols)]
                                           for s in grp["state"]]},
            text=[f"state {s}; tie-break {t:.4g}; λ_P2 {p2:g}" for s, t, p2 in
                  zip(grp["state"], grp["tie_break"].astype(float), grp["lambda_p2"])],
            hovertemplate="λ_P1 %{x:g}: %{y:.4f}<br>%{text}"))
    if "picked" in df.columns and df["picked"].astype(bool).any():
        pick = df[df["picked"].astype(bool)]
        fig.add_trace(go.Scatter(x=pick["lambda_p1"], y=pick["metric"], mode="markers",
                                 name="pick", marker={"size": 22, "symbol": "circle-open",
                                                      "color": "#d62728", "line": {"width": 2}},
                                 hoverinfo="skip"))
    fig.update_xaxes(type="log", title_text="λ (P1)" if not same else "λ")
    fig.update_yaxes(title_text="validation metric")
    subtitle = "markers: " + ", ".join(f"{symbols[i % len(symbols)]} = {s}"
                                       for i, s in enumerate(states))
    fig.update_layout(title=f"{title}<br><sup>{subtitle}</sup>", template="plotly_white")
    return fig
