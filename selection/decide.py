"""The pre-registered decision rule, pure: cell results in, a pick and the reason for it out.

1. **Best outright**: the grid cell with the highest selection metric, when no other cell lies
   within the tie band of it. The band is inclusive: a gap of exactly ``tie_band`` ties (compared
   with an absolute tolerance of :data:`BAND_TOLERANCE`, so 0.183 - 0.179 ties under 0.004 even
   though the float difference is 0.0040000000000000036).
2. **Tie band then tie-break**: otherwise, among the cells within the band of the best, the one
   with the higher tie-break metric (M1 at P2C); NaN ranks last; a tie there goes to the higher
   selection metric, then to the smaller λ.
3. **Edge extension**: when the pick sits on the grid's edge, the cell one step outward is run;
   it replaces the pick only if its metric beats the pick's by more than the band (the same
   tolerance). An adopted cell sits on the new edge, so the rule repeats, up to
   ``max_extensions`` outward cells in all. When the outward cell has no result yet the decision
   says so (``pending``) and the caller runs it and decides again.

Gaps are kept at full precision (``repr`` of the float) in the decision record.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from selection.cells import Cell, CellResult, grid_cells, outward_cell
from selection.lock import Lock

BAND_TOLERANCE = 1e-12
"""Absolute tolerance on the band comparisons: far below any real metric gap (the paper's closest
calls were 2.0e-5 outside the band), far above float rounding of metrics in [0, 1]."""

BEST_OUTRIGHT = "best_outright"
TIE_BAND = "tie_band"
EDGE_EXTENSION = "edge_extension"
INCOMPLETE = "incomplete"


def within_band(gap: float, band: float) -> bool:
    """True iff ``gap`` (best minus a cell, >= 0) is inside the inclusive band."""
    return gap <= band + BAND_TOLERANCE


def beats_by_more_than_band(new: float, old: float, band: float) -> bool:
    """True iff ``new`` exceeds ``old`` by more than the band (the edge rule's adoption test)."""
    return new - old > band + BAND_TOLERANCE


@dataclass(frozen=True)
class Extension:
    """One outward cell the edge rule ran: from which pick, its gain, whether it was adopted."""

    cell: Cell
    from_cell: Cell
    gain: float | None
    adopted: bool
    ran: bool

    def to_dict(self) -> dict[str, Any]:
        return {"cell": self.cell.key, "from": self.from_cell.key, "gain": self.gain,
                "adopted": self.adopted, "ran": self.ran}


@dataclass(frozen=True)
class Decision:
    """The outcome of the rule on one set of cell results."""

    rule: str
    pick: Cell | None
    band: float
    best: Cell | None = None
    tied: tuple[Cell, ...] = ()
    gaps: dict[Cell, float] = field(default_factory=dict)
    extensions: tuple[Extension, ...] = ()
    pending: Cell | None = None
    missing: tuple[Cell, ...] = ()

    @property
    def complete(self) -> bool:
        """True iff a pick was made and no outward cell is still to run."""
        return self.pick is not None and self.pending is None

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "pick": self.pick.key if self.pick else None,
                "pick_lambda_p1": self.pick.lambdas[0] if self.pick else None,
                "pick_lambda_p2": self.pick.lambdas[1] if self.pick else None,
                "band": self.band, "best": self.best.key if self.best else None,
                "tied": [c.key for c in self.tied],
                "gaps_to_best": {c.key: g for c, g in self.gaps.items()},
                "extensions": [e.to_dict() for e in self.extensions],
                "pending": self.pending.key if self.pending else None,
                "missing": [c.key for c in self.missing]}


def _rank_key(cell: Cell, result: CellResult) -> tuple[float, float, tuple[float, ...]]:
    tb = result.tie_break if math.isfinite(result.tie_break) else -math.inf
    return (tb, result.metric, tuple(-v for _, v in cell.values))


def _band_pick(cells: Iterable[Cell], results: Mapping[Cell, CellResult], band: float
               ) -> tuple[Cell, Cell, tuple[Cell, ...], dict[Cell, float]]:
    cells = list(cells)
    best = max(cells, key=lambda c: (results[c].metric, *_rank_key(c, results[c])))
    top = results[best].metric
    gaps = {c: top - results[c].metric for c in cells}
    tied = tuple(sorted(c for c in cells if within_band(gaps[c], band)))
    pick = best if len(tied) == 1 else max(tied, key=lambda c: _rank_key(c, results[c]))
    return best, pick, tied, gaps


def decide(lock: Lock, results: Mapping[Cell, CellResult], *, band: float | None = None,
           extend: bool | None = None) -> Decision:
    """Apply the lock's rule to ``results`` (grid cells and any outward cells already run).

    Args:
        lock: the selection lock (grid, band, edge rule).
        results: the finished cells.
        band: another tie band (the sensitivity view); default the lock's.
        extend: override the lock's ``edge.extend`` (the sensitivity view keeps the lock's).
    """
    band = lock.selection.tie_band if band is None else band
    cells = grid_cells(lock.grid)
    missing = tuple(c for c in cells if c not in results)
    if missing:
        return Decision(rule=INCOMPLETE, pick=None, band=band, missing=missing)
    best, pick, tied, gaps = _band_pick(cells, results, band)
    rule = BEST_OUTRIGHT if len(tied) == 1 else TIE_BAND
    decision = Decision(rule=rule, pick=pick, band=band, best=best, tied=tied, gaps=gaps)
    if not (lock.edge.extend if extend is None else extend):
        return decision
    extensions: list[Extension] = []
    current = pick
    while len(extensions) < lock.edge.max_extensions:
        out = outward_cell(lock.grid, lock.edge, current)
        if out is None:
            break
        if out not in results:
            extensions.append(Extension(out, current, None, False, False))
            return replace(decision, rule=rule, pick=current, extensions=tuple(extensions), pending=out)
        gain = results[out].metric - results[current].metric
        adopted = beats_by_more_than_band(results[out].metric, results[current].metric, band)
        extensions.append(Extension(out, current, gain, adopted, True))
        if not adopted:
            break
        current, rule = out, EDGE_EXTENSION
    return replace(decision, rule=rule, pick=current, extensions=tuple(extensions))


def pairwise_gaps(results: Mapping[Cell, CellResult]) -> dict[str, dict[str, float]]:
    """``gaps[a][b]`` = metric(a) - metric(b) at full precision, for every pair of cells."""
    cells = sorted(results)
    return {a.key: {b.key: results[a].metric - results[b].metric for b in cells if b != a} for a in cells}


def sensitivity(lock: Lock, results: Mapping[Cell, CellResult], bands: Iterable[float]) -> list[dict[str, Any]]:
    """Re-apply the rule with other bands to the same cells, without running anything.

    An outward cell a band would call for but that was never run is reported in ``pending``;
    the pick shown is then the one before that extension.
    """
    rows = []
    for band in bands:
        d = decide(lock, results, band=band)
        rows.append({"band": band, "pick": d.pick.key if d.pick else None, "rule": d.rule,
                     "n_tied": len(d.tied),
                     "pick_metric": results[d.pick].metric if d.pick else None,
                     "pending": d.pending.key if d.pending else None,
                     "is_locked_band": math.isclose(band, lock.selection.tie_band, rel_tol=0, abs_tol=1e-15)})
    return rows


def default_bands(lock: Lock) -> list[float]:
    """The locked band with a few around it: 0, half, the band, 1.25x, 1.5x, 2x."""
    b = lock.selection.tie_band
    return sorted({0.0, b / 2, b, b * 1.25, b * 1.5, b * 2})
