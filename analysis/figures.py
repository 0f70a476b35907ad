"""Plotly figures of the report, logged as self-contained HTML (:meth:`StageRun.log_figure`).

* :func:`recovery_figure`: knock-in recovery against k, one panel per phase, solid lines for
  the sets or arms measured and dashed lines for their random floors.
* :func:`paired_differences_figure`: per-note paired differences, one panel per measure, one
  column of points per comparison, with the mean and its bootstrap interval.
* :func:`lambda_frontier_figure`: the λ selection grid's validation metric against λ, one
  marker per cell coloured by its state, the tie-break value in the hover text.

Legends name what a line is (:func:`series_label`): the arm, its λ and its seeds, and the model
when several are shown; never a run id. Log axes are ticked at the values plotted (0.01, 0.03,
0.1, ...), written as numbers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd

from mistill.errors import MistillInputError
from mistill.tracking.naming import lambda_label, short_model

__all__ = [
    "lambda_frontier_figure",
    "log_axis_ticks",
    "paired_differences_figure",
    "recovery_figure",
    "recovery_long_from_own",
    "recovery_long_from_sets",
    "selection_labels",
    "series_label",
]

_PHASE_ORDER = ("P1", "P2", "P2C")
_FLOOR_COLOURS = {"random": "#7f7f7f", "bottom": "#d62728"}
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
            "#bcbd22", "#d62728", "#7f7f7f")


_RUN_ID = re.compile(r"\b[0-9a-f]{32}\b")
_LAMBDA_COLUMNS = ("lambda", "lambda_p1")
MAX_LOG_TICKS = 12
"""Above this many distinct values a log axis is ticked at 1, 2 and 5 of each decade instead."""


def _present(value: Any) -> bool:
    if value is None:
        return False
    try:
        return not pd.isna(value) and str(value) != ""
    except (TypeError, ValueError):  # a list or array: present
        return True


def _number(value: Any) -> str:
    try:
        return format(float(value), "g")
    except (TypeError, ValueError):
        return str(value)


def _seeds(seeds: Any) -> str | None:
    values = sorted({int(s) for s in (seeds if isinstance(seeds, Iterable) and not isinstance(seeds, str)
                                      else [seeds]) if _present(s)})
    if not values:
        return None
    return f"seed {values[0]}" if len(values) == 1 else "seeds " + ",".join(str(v) for v in values)


def series_label(arm: Any = None, lam: Any = None, seeds: Any = None, model: Any = None,
                 extra: str = "") -> str:
    """A legend name: ``[<model>: ]<arm>[ λ=<λ>][, seed(s) <s>][ <extra>]``.

    model: shown as run names show it (``embedded:smollm2-135m`` -> ``smollm2-135m``; a
    checkpoint ``run:<id>`` is left out); lam: a number, ``"<λ_P1>,<λ_P2>"`` or a pair; seeds:
    one seed or several. A run id never appears: any 32-hex token is dropped.
    """
    parts = []
    if _present(arm):
        parts.append(str(arm))
    if _present(lam):
        label = lambda_label(lam if isinstance(lam, (str, list, tuple)) else float(lam))
        if label:
            parts.append(f"λ={label}")
    head = " ".join(parts) or "model"
    if _present(model) and (shown := short_model(str(model))):
        head = f"{shown}: {head}"
    seed_text = _seeds(seeds) if seeds is not None else None
    text = head + (f", {seed_text}" if seed_text else "") + (f" {extra}" if extra else "")
    return re.sub(r"\s+", " ", _RUN_ID.sub("", text)).strip()


def log_axis_ticks(values: Iterable[float]) -> dict[str, list]:
    """``tickvals``/``ticktext`` for a log axis: the positive values plotted, written as numbers
    (``0.01``, ``0.03``, ``0.1``); above :data:`MAX_LOG_TICKS` of them, 1, 2 and 5 of every
    decade they span."""
    vals = sorted({float(v) for v in values if _present(v) and float(v) > 0})
    if not vals:
        return {}
    if len(vals) > MAX_LOG_TICKS:
        lo, hi = math.floor(math.log10(vals[0])), math.ceil(math.log10(vals[-1]))
        vals = [m * 10.0 ** e for e in range(lo, hi + 1) for m in (1, 2, 5)
                if vals[0] <= m * 10.0 ** e <= vals[-1]] or vals[:1]
    return {"tickvals": vals, "ticktext": [format(v, "g") for v in vals]}


def _lambda_column(df: pd.DataFrame) -> str | None:
    return next((c for c in _LAMBDA_COLUMNS if c in df.columns), None)


def _phases(values: Sequence[str]) -> list[str]:
    present = list(dict.fromkeys(str(v) for v in values))
    return [p for p in _PHASE_ORDER if p in present] + sorted(p for p in present
                                                              if p not in _PHASE_ORDER)


def recovery_long_from_sets(per_note_sets: pd.DataFrame) -> pd.DataFrame:
    """Knock-in rows of ``knockin`` runs as the figure's input: per (model, phase, k, set) the
    median recovery over notes; ``random`` and ``bottom`` are floors. With several models each
    series is named ``<model>: <set>`` (the model as run names show it, never a run id)."""
    g = per_note_sets.groupby(["model", "phase", "k", "set"], sort=True)["recovery"].median()
    out = g.reset_index()
    if out["model"].nunique() <= 1:
        out["series"] = out["set"].astype(str)
    else:
        out["series"] = [series_label(arm=s, model=m) for m, s in zip(out["model"], out["set"])]
    out["floor"] = out["set"].isin(["random", "bottom"])
    return out[["phase", "k", "series", "recovery", "floor"]]


def recovery_long_from_own(per_note_own: pd.DataFrame) -> pd.DataFrame:
    """Own-heads rows as the figure's input: per (model, arm[, λ], phase, k) the mean over seeds
    of the median over notes of ``recovery_own``, and the same of ``recovery_random`` as a floor.

    Each series is named by :func:`series_label`: the arm, its λ (a ``lambda`` column, the runs'
    ``lambda`` of :data:`analysis.query.TAG_COLUMNS`, or ``lambda_p1``, when present) and the
    seeds averaged, with the model when several are shown.
    """
    lam = _lambda_column(per_note_own)
    df = per_note_own.copy()
    df["_lam"] = [_number(v) if _present(v) else "" for v in df[lam]] if lam else ""
    several = df["model"].nunique() > 1
    df["series"] = ""
    for _, grp in df.groupby(["model", "arm", "_lam"], dropna=False, sort=False):
        df.loc[grp.index, "series"] = series_label(
            arm=grp["arm"].iloc[0], lam=grp["_lam"].iloc[0] or None, seeds=grp["seed"].tolist(),
            model=grp["model"].iloc[0] if several else None)
    seed_medians = df.groupby(["series", "seed", "phase", "k"], dropna=False)[
        ["recovery_own", "recovery_random"]].median()
    means = seed_medians.groupby(["series", "phase", "k"], dropna=False).mean().reset_index()
    name = means["series"]
    own = pd.DataFrame({"phase": means["phase"], "k": means["k"], "series": name,
                        "recovery": means["recovery_own"], "floor": False})
    floor = pd.DataFrame({"phase": means["phase"], "k": means["k"], "series": name + " (random)",
                          "recovery": means["recovery_random"], "floor": True})
    return pd.concat([own, floor], ignore_index=True)


def recovery_figure(long: pd.DataFrame, title: str, subtitle: str = ""):
    """Recovery against k per phase; ``long`` has ``phase, k, series, recovery, floor``.

    A floor named ``<series> (random)`` takes its series' colour, dashed; other floors are
    grey (``random``) or red (``bottom``), dashed."""
    import plotly.graph_objects as go  # deferred: plotly is slow to import
    from plotly.subplots import make_subplots  # deferred: plotly is slow to import

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
    import plotly.graph_objects as go  # deferred: plotly is slow to import
    from plotly.subplots import make_subplots  # deferred: plotly is slow to import

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


def selection_labels(cells: pd.DataFrame) -> dict[str, str]:
    """One legend name per ``selection`` of λ cells: :func:`series_label` of its ``arm``,
    ``seed`` and (when several) ``model`` columns; selections that would share a name are told
    apart by their own name when it holds no run id, else by their order (``selection 2``)."""
    several = "model" in cells.columns and cells["model"].nunique() > 1
    first = cells.drop_duplicates("selection")
    base = {}
    for _, row in first.iterrows():
        sel = str(row["selection"])
        if "arm" in cells.columns and _present(row.get("arm")):
            base[sel] = series_label(arm=row["arm"], seeds=row.get("seed"),
                                     model=row.get("model") if several else None)
        else:
            base[sel] = "" if _RUN_ID.search(sel) else sel
    counts = pd.Series(list(base.values())).value_counts()
    out = {}
    for i, (sel, name) in enumerate(base.items(), start=1):
        if name and counts[name] == 1:
            out[sel] = name
        elif not _RUN_ID.search(sel) and sel != name:
            out[sel] = f"{name} ({sel})" if name else sel
        else:
            out[sel] = f"{name} (selection {i})" if name else f"selection {i}"
    return out


def lambda_frontier_figure(cells: pd.DataFrame, title: str = "λ selection: validation frontier"):
    """``cells`` of ``select_lambda`` runs (``lambda_p1, lambda_p2, metric, tie_break, state``;
    optional ``selection`` naming the run, ``arm``, ``seed``, ``model`` and boolean ``picked``):
    the validation metric against λ_P1 on a log axis ticked at the λ values, one line per
    selection run and λ_P2 (when it differs from λ_P1), markers by state, the picked cells
    circled. Lines are named by :func:`selection_labels`."""
    import plotly.graph_objects as go  # deferred: plotly is slow to import

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
    names = selection_labels(df)
    df["line"] = df["selection"].astype(str).map(names)
    if not same:
        df["line"] = df["line"] + " λ_P2=" + df["lambda_p2"].map(_number)
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
    fig.update_xaxes(type="log", title_text="λ (P1)" if not same else "λ", **log_axis_ticks(df["lambda_p1"]))
    fig.update_yaxes(title_text="validation metric")
    subtitle = "markers: " + ", ".join(f"{symbols[i % len(symbols)]} = {s}"
                                       for i, s in enumerate(states))
    fig.update_layout(title=f"{title}<br><sup>{subtitle}</sup>", template="plotly_white")
    return fig
