"""How faithful the distillation objective's contribution ``c`` is to exact importance (Sec. 2.3).

The interaction term of the Mistill objective weights a pooled head by ``c``, its direct-path
contribution to the margin divided by the margin (Sec. 4.1): the projection of the head's write on
the margin direction in the unembedding. The attribution pass records that projection for every
head at every event (``NoteAttribution.direct``, in nats: ``m c`` with ``m`` the clean margin)
beside the exact single-head patches of the nominated heads. At each event of ``phase`` (the
paper: every contrastive event with exact patches), over the event's exactly patched heads:

* per event, Spearman and Pearson correlations with the exact importance ``I_h`` of ``c``, of the
  margin-weighted ``m c`` and of first-order attribution ``-A_h`` (medians over events);
* pooled over events, each head's mean ``c`` (``m c``, ``-A_h``) and mean ``I_h`` over the events
  that patched it, correlated across heads;
* the magnitude of ``m c`` against the exact effect, ``sum |m c| / sum |I|`` per event (median over
  events; **[recon]**: the paper gives the ratio, 0.26, without its reduction).

Events with fewer than ``min_heads`` patched heads, or a zero margin, are left out; a correlation
over constant values is NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mistill import stats
from mistill.instrument.passes import NoteAttribution

__all__ = ["QUANTITIES", "event_rows", "pooled", "summary"]

QUANTITIES: tuple[str, ...] = ("c", "mc", "first_order")
"""The quantities held against exact importance: ``c``, the margin-weighted ``m c`` (the direct
effect in nats) and first-order attribution."""


POOLED_NAMES: dict[str, str] = {"spearman": "spearman_pooled", "pearson": "pearson_pooled"}
"""Each correlation's metric name pooled over events (beside its median over events)."""


def _corr(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    if x.size < 3 or x.std() == 0 or y.std() == 0:
        return {"spearman": float("nan"), "pearson": float("nan")}
    return {"spearman": stats.spearman(x, y), "pearson": stats.pearson(x, y)}


def _values(att: NoteAttribution, e: int, heads: np.ndarray) -> dict[str, np.ndarray]:
    mc = att.direct[e, heads].astype(np.float64)
    return {"c": mc / float(att.margins[e]), "mc": mc, "first_order": att.first_order[e, heads].astype(np.float64)}


def _events(att: NoteAttribution, phase: str, min_heads: int):
    """``(event index, patched heads)`` of the note's usable events of ``phase``."""
    if att.direct is None:
        return
    for e, kind in enumerate(att.kinds):
        heads = np.flatnonzero(np.isfinite(att.exact[e]))
        if kind == phase and heads.size >= min_heads and float(att.margins[e]) != 0.0:
            yield e, heads


def event_rows(atts: Sequence[NoteAttribution], phase: str = "P2C", *, min_heads: int = 3) -> list[dict]:
    """One row per usable event: ``note_id, event_id, n_heads, margin``, ``<q>.spearman`` and
    ``<q>.pearson`` for each of :data:`QUANTITIES`, and ``mc_over_exact``."""
    rows = []
    for att in atts:
        for e, heads in _events(att, phase, min_heads):
            exact = att.exact[e, heads].astype(np.float64)
            row: dict = {"note_id": att.note_id, "event_id": att.event_ids[e], "n_heads": int(heads.size),
                         "margin": float(att.margins[e])}
            for name, values in _values(att, e, heads).items():
                row.update({f"{name}.{k}": v for k, v in _corr(values, exact).items()})
            denom = float(np.abs(exact).sum())
            row["mc_over_exact"] = float(np.abs(att.direct[e, heads]).sum()) / denom if denom > 0 else float("nan")
            rows.append(row)
    return rows


def pooled(atts: Sequence[NoteAttribution], phase: str = "P2C", *, min_heads: int = 3) -> dict[str, float]:
    """Each head's mean over the usable events that patched it, correlated across heads:
    ``<q>.spearman`` / ``<q>.pearson`` for each of :data:`QUANTITIES`, and ``n_heads``."""
    sums: dict[int, dict[str, list[float]]] = {}
    for att in atts:
        for e, heads in _events(att, phase, min_heads):
            values = _values(att, e, heads)
            for j, h in enumerate(heads.tolist()):
                acc = sums.setdefault(h, {"exact": [], **{q: [] for q in QUANTITIES}})
                acc["exact"].append(float(att.exact[e, h]))
                for q in QUANTITIES:
                    acc[q].append(float(values[q][j]))
    heads = sorted(sums)
    exact = np.array([np.mean(sums[h]["exact"]) for h in heads])
    out: dict[str, float] = {"n_heads": float(len(heads))}
    for q in QUANTITIES:
        mean_q = np.array([np.mean(sums[h][q]) for h in heads])
        out.update({f"{q}.{k}": v for k, v in _corr(mean_q, exact).items()})
    return out


def summary(rows: Sequence[dict], pooled_values: dict[str, float]) -> dict[str, float]:
    """The readout as metric values (``<q>/spearman``: median over events; ``<q>/spearman_pooled``:
    across heads; ``mc_over_exact``; ``n_events``; ``n_heads_pooled``), finite ones only."""
    out: dict[str, float] = {"n_events": float(len(rows)), "n_heads_pooled": pooled_values.get("n_heads", 0.0)}
    for q in QUANTITIES:
        for k, pooled_name in POOLED_NAMES.items():
            vals = np.array([r[f"{q}.{k}"] for r in rows], dtype=np.float64)
            vals = vals[np.isfinite(vals)]
            out[f"{q}/{k}"] = float(np.median(vals)) if vals.size else float("nan")
            out[f"{q}/{pooled_name}"] = pooled_values.get(f"{q}.{k}", float("nan"))
    ratios = np.array([r["mc_over_exact"] for r in rows], dtype=np.float64)
    ratios = ratios[np.isfinite(ratios)]
    out["mc_over_exact"] = float(np.median(ratios)) if ratios.size else float("nan")
    return {k: v for k, v in out.items() if np.isfinite(v)}
