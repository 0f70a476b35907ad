"""The pre-registered decision rule, pure: cell results in, a pick and the reason for it out.

1. **Eligibility** (App. O, only when the lock sets ``selection.validity_floor``): a cell whose
   valid-answer rate is below the floor, or not measured, is ineligible; it is recorded with the
   reason and takes no further part (not the best, not in the band, not the pick). The floor is
   inclusive ("at least 0.95"), compared with the tolerance below.
2. **Best outright**: the eligible cell with the highest selection metric, when no other eligible
   cell lies within the tie band of it. The band is inclusive: a gap of exactly ``tie_band`` ties
   (compared with an absolute tolerance of :data:`BAND_TOLERANCE`, so 0.183 - 0.179 ties under
   0.004 even though the float difference is 0.0040000000000000036).
3. **Tie band then tie rule**: otherwise, among the eligible cells within the band of the best,
   either the one with the higher tie-break metric (App. I.3, I.4, M.2: M1 at P2C) or, when the
   lock says ``tie_break: smallest_lambda``, the smallest λ (App. O). **[recon]** (the paper
   states no fallback for the tie-break metric): a NaN tie-break ranks last, then the lock's
   ``selection.tie_fallback`` decides, by default the higher selection metric, then the smaller λ.
4. **Edge extension** (App. I.4, M.2, O): when the pick sits on the grid's edge, the cell one step
   outward is run and **joins the grid**; rules 1-3 are applied again over the extended grid, so
   the outward cell can be picked outright or through a tie (App. I.4: 0.01 at 0.183 ties 0.03 at
   0.181 under the 0.004 band, and M1 at P2C picks 0.01). A **further extension**, one more step
   beyond the new edge, is run only if the new edge cell beats the previous pick (the pick before
   it joined) by more than the band, with the band's tolerance; App. I.4 calls this "the
   second-extension condition". An ineligible edge cell never meets it. At most
   ``edge.max_extensions`` outward cells are run in all. **[recon]**: extensions continue only
   beyond the cell that was last added (the side of the first extension); a pick that moves to
   the grid's other edge when the band is applied again calls for no extension there. When the
   next outward cell has no result yet the decision says so (``pending``) and the caller runs it
   and decides again.

Outward cells in ``results`` that the rule did not call for (another band's extension, as in the
sensitivity view) are not part of the grid. Gaps are kept at full precision in the record.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from selection.cells import Cell, CellResult, grid_cells, outward_cell
from selection.lock import FALLBACK_METRIC, SMALLER_LAMBDA, Lock, SelectionRule

BAND_TOLERANCE = 1e-12
"""Absolute tolerance on the band and floor comparisons: far below any real metric gap (the
paper's closest calls were 2.0e-5 outside the band), far above float rounding of metrics in
[0, 1]."""

BEST_OUTRIGHT = "best_outright"
TIE_BAND = "tie_band"
EDGE_EXTENSION = "edge_extension"
INCOMPLETE = "incomplete"
NO_ELIGIBLE = "no_eligible_cell"

FURTHER_RUN = "run"
FURTHER_PENDING = "pending"
FURTHER_NOT_MET = "not run: condition not met"
FURTHER_LIMIT = "not run: max_extensions reached"
FURTHER_NO_STEP = "not run: no outward step"


def within_band(gap: float, band: float) -> bool:
    """True iff ``gap`` (best minus a cell, >= 0) is inside the inclusive band."""
    return gap <= band + BAND_TOLERANCE


def beats_by_more_than_band(new: float, old: float, band: float) -> bool:
    """True iff ``new`` exceeds ``old`` by more than the band (the further-extension condition)."""
    return new - old > band + BAND_TOLERANCE


def ineligibility(rule: SelectionRule, result: CellResult) -> str | None:
    """Why a cell is below the lock's validity floor, or None when it is eligible."""
    floor = rule.validity_floor
    if floor is None:
        return None
    if not math.isfinite(result.validity):
        return f"{rule.validity_metric} not measured (validity floor {floor!r})"
    if result.validity < floor - BAND_TOLERANCE:
        return f"{rule.validity_metric} {result.validity!r} < validity floor {floor!r}"
    return None


@dataclass(frozen=True)
class BandResult:
    """Rules 1-3 applied once over ``cells``: the best, the tie set, the pick and its rule
    (:data:`BEST_OUTRIGHT` or :data:`TIE_BAND`); ``gaps`` = best minus each cell (eligible or
    not) at full precision."""

    cells: tuple[Cell, ...]
    best: Cell
    pick: Cell
    tied: tuple[Cell, ...]
    gaps: dict[Cell, float]
    rule: str

    def to_dict(self) -> dict[str, Any]:
        return {"cells": [c.key for c in self.cells], "best": self.best.key, "pick": self.pick.key,
                "rule": self.rule, "tied": [c.key for c in self.tied]}


@dataclass(frozen=True)
class Extension:
    """One outward cell the edge rule called for.

    cell: the outward cell; from_cell: the pick before it joined the grid.
    ran: whether it has a result (False: it is the decision's ``pending`` cell).
    gain: its metric minus ``from_cell``'s (full precision); None when not run.
    after: the band and tie rule applied again over the grid it joined; None when not run.
    further_met: the further-extension condition (``gain`` > band, the cell eligible).
    next_cell, further: the next outward cell and what became of it (``FURTHER_*``).
    """

    cell: Cell
    from_cell: Cell
    ran: bool
    gain: float | None = None
    after: BandResult | None = None
    further_met: bool = False
    next_cell: Cell | None = None
    further: str = ""

    @property
    def picked(self) -> bool:
        """True iff the outward cell is the pick once the band and tie rule were applied again."""
        return self.after is not None and self.after.pick == self.cell

    def to_dict(self, band: float) -> dict[str, Any]:
        return {"cell": self.cell.key, "from": self.from_cell.key, "ran": self.ran, "gain": self.gain,
                "picked": self.picked, "adopted": self.picked,  # "adopted": the name earlier records use
                "after": self.after.to_dict() if self.after else None,
                "further_condition": {"rule": "gain > band", "met": self.further_met, "gap": self.gain,
                                      "band": band, "next": self.next_cell.key if self.next_cell else None,
                                      "status": self.further} if self.ran else None}


@dataclass(frozen=True)
class Decision:
    """The outcome of the rule on one set of cell results.

    rule: how the pick was reached (:data:`BEST_OUTRIGHT`, :data:`TIE_BAND`,
        :data:`EDGE_EXTENSION` when the pick is an outward cell, :data:`INCOMPLETE`,
        :data:`NO_ELIGIBLE`); ``band_rule``: the band result over the final (extended) grid.
    best, tied, gaps: over the final grid (``extended_grid``); ``grid_pick``: the pick over the
        locked grid before any extension.
    ineligible: cells below the validity floor, with the reason.
    """

    rule: str
    pick: Cell | None
    band: float
    best: Cell | None = None
    tied: tuple[Cell, ...] = ()
    gaps: dict[Cell, float] = field(default_factory=dict)
    extensions: tuple[Extension, ...] = ()
    pending: Cell | None = None
    missing: tuple[Cell, ...] = ()
    grid: tuple[Cell, ...] = ()
    extended_grid: tuple[Cell, ...] = ()
    grid_pick: Cell | None = None
    band_rule: str | None = None
    ineligible: dict[Cell, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """True iff a pick was made and no outward cell is still to run."""
        return self.pick is not None and self.pending is None

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "pick": self.pick.key if self.pick else None,
                "pick_lambda_p1": self.pick.lambdas[0] if self.pick else None,
                "pick_lambda_p2": self.pick.lambdas[1] if self.pick else None,
                "band": self.band, "band_rule": self.band_rule,
                "grid_pick": self.grid_pick.key if self.grid_pick else None,
                "grid": [c.key for c in self.grid], "extended_grid": [c.key for c in self.extended_grid],
                "best": self.best.key if self.best else None,
                "tied": [c.key for c in self.tied],
                "gaps_to_best": {c.key: g for c, g in self.gaps.items()},
                "ineligible": {c.key: why for c, why in self.ineligible.items()},
                "extensions": [e.to_dict(self.band) for e in self.extensions],
                "pending": self.pending.key if self.pending else None,
                "missing": [c.key for c in self.missing]}


def tie_key(rule: SelectionRule, cell: Cell, result: CellResult) -> tuple[float, ...]:
    """Higher wins a tie: the smallest λ under ``smallest_lambda``; else the tie-break metric (NaN
    last), then ``rule.tie_fallback`` in order."""
    if rule.by_smallest_lambda:
        return tuple(-v for v in cell.lambdas)
    keys = [result.tie_break if math.isfinite(result.tie_break) else -math.inf]
    for entry in rule.tie_fallback:
        if entry == FALLBACK_METRIC:
            keys.append(result.metric)
        else:
            keys.extend(-v if entry == SMALLER_LAMBDA else v for v in cell.lambdas)
    return tuple(keys)


def apply_band(rule: SelectionRule, cells: Sequence[Cell], results: Mapping[Cell, CellResult], band: float,
               ineligible: Mapping[Cell, str]) -> BandResult | None:
    """Rules 2-3 over the eligible ``cells``; None when none is eligible."""
    eligible = [c for c in cells if c not in ineligible]
    if not eligible:
        return None
    best = max(eligible, key=lambda c: (results[c].metric, *tie_key(rule, c, results[c])))
    top = results[best].metric
    gaps = {c: top - results[c].metric for c in cells}
    tied = tuple(sorted(c for c in eligible if within_band(gaps[c], band)))
    pick = best if len(tied) == 1 else max(tied, key=lambda c: tie_key(rule, c, results[c]))
    return BandResult(tuple(sorted(cells)), best, pick, tied, gaps, BEST_OUTRIGHT if len(tied) == 1 else TIE_BAND)


def _extend(lock: Lock, results: Mapping[Cell, CellResult], band: float, first: BandResult,
            ineligible: dict[Cell, str]) -> tuple[BandResult, list[Extension], Cell | None]:
    """The edge rule from the grid's pick ``first``: the final band result, the extensions and the
    pending outward cell (None when nothing is left to run)."""
    rule, current, extensions = lock.selection, first, []
    out = outward_cell(lock.grid, lock.edge, first.pick)
    while out is not None and len(extensions) < lock.edge.max_extensions:
        if out not in results:
            extensions.append(Extension(out, current.pick, ran=False))
            return current, extensions, out
        why = ineligibility(rule, results[out])
        if why:
            ineligible[out] = why
        after = apply_band(rule, (*current.cells, out), results, band, ineligible)
        gain = results[out].metric - results[current.pick].metric
        met = why is None and beats_by_more_than_band(results[out].metric, results[current.pick].metric, band)
        nxt = outward_cell(lock.grid, lock.edge, out) if met else None
        further = (FURTHER_NOT_MET if not met else FURTHER_NO_STEP if nxt is None
                   else FURTHER_LIMIT if len(extensions) + 1 >= lock.edge.max_extensions
                   else FURTHER_RUN if nxt in results else FURTHER_PENDING)
        extensions.append(Extension(out, current.pick, True, gain, after, met, nxt, further))
        current = after
        out = nxt
    return current, extensions, None


def decide(lock: Lock, results: Mapping[Cell, CellResult], *, band: float | None = None,
           extend: bool | None = None) -> Decision:
    """Apply the lock's rule to ``results`` (grid cells and any outward cells already run).

    Args:
        lock: the selection lock (grid, band, tie rule, validity floor, edge rule).
        results: the finished cells.
        band: another tie band (the sensitivity view); default the lock's.
        extend: override the lock's ``edge.extend`` (the sensitivity view keeps the lock's).
    """
    band = lock.selection.tie_band if band is None else band
    grid = tuple(grid_cells(lock.grid))
    missing = tuple(c for c in grid if c not in results)
    if missing:
        return Decision(rule=INCOMPLETE, pick=None, band=band, missing=missing, grid=grid)
    ineligible = {c: why for c in grid if (why := ineligibility(lock.selection, results[c]))}
    first = apply_band(lock.selection, grid, results, band, ineligible)
    if first is None:
        return Decision(rule=NO_ELIGIBLE, pick=None, band=band, grid=grid, extended_grid=grid,
                        gaps={}, ineligible=ineligible)
    decision = Decision(rule=first.rule, pick=first.pick, band=band, best=first.best, tied=first.tied,
                        gaps=first.gaps, grid=grid, extended_grid=first.cells, grid_pick=first.pick,
                        band_rule=first.rule, ineligible=ineligible)
    if not (lock.edge.extend if extend is None else extend):
        return decision
    final, extensions, pending = _extend(lock, results, band, first, ineligible)
    rule = EDGE_EXTENSION if final.pick not in grid else final.rule
    return replace(decision, rule=rule, pick=final.pick, best=final.best, tied=final.tied, gaps=final.gaps,
                   extended_grid=final.cells, band_rule=final.rule, extensions=tuple(extensions),
                   pending=pending, ineligible=dict(ineligible))


def pairwise_gaps(results: Mapping[Cell, CellResult]) -> dict[str, dict[str, float]]:
    """``gaps[a][b]`` = metric(a) - metric(b) at full precision, for every pair of cells."""
    cells = sorted(results)
    return {a.key: {b.key: results[a].metric - results[b].metric for b in cells if b != a} for a in cells}


def sensitivity(lock: Lock, results: Mapping[Cell, CellResult], bands: Iterable[float]) -> list[dict[str, Any]]:
    """Re-apply the whole rule (eligibility, band, tie rule, edge extension with the further-
    extension condition) with other bands to the same cells, without running anything.

    An outward cell a band would call for but that was never run is reported in ``pending``;
    the pick shown is then the one over the grid extended so far. Outward cells that were run
    for another band but that this band's rule does not call for are left out of its grid.
    """
    rows = []
    for band in bands:
        d = decide(lock, results, band=band)
        rows.append({"band": band, "pick": d.pick.key if d.pick else None, "rule": d.rule,
                     "grid_pick": d.grid_pick.key if d.grid_pick else None,
                     "n_tied": len(d.tied),
                     "pick_metric": results[d.pick].metric if d.pick else None,
                     "extended_grid": ";".join(c.key for c in d.extended_grid if c not in d.grid),
                     "pending": d.pending.key if d.pending else None,
                     "is_locked_band": math.isclose(band, lock.selection.tie_band, rel_tol=0, abs_tol=1e-15)})
    return rows


def default_bands(lock: Lock) -> list[float]:
    """The locked band with a few around it: 0, half, the band, 1.25x, 1.5x, 2x."""
    b = lock.selection.tie_band
    return sorted({0.0, b / 2, b, b * 1.25, b * 1.5, b * 2})
