"""Cells of a λ grid, what a cell run returns, and the one-step-outward cell of the edge rule."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from selection.lock import TIED_AXIS, EdgeRule, GridSpec

OUTWARD_DIGITS = 12
"""Computed outward values are rounded to this many significant digits (0.03 / (0.1 / 0.03) is
0.009, not 0.009000000000000001), so a resumed study finds the same cell again."""


@dataclass(frozen=True, order=True)
class Cell:
    """One grid point: ``values`` = sorted ``(axis, λ)`` pairs (axis ``lambda`` on a tied grid)."""

    values: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, values: Mapping[str, float]) -> Cell:
        return cls(tuple(sorted((str(k), float(v)) for k, v in values.items())))

    def as_dict(self) -> dict[str, float]:
        return dict(self.values)

    @property
    def lambdas(self) -> tuple[float, float]:
        """``(λ_P1, λ_P2)`` whatever the grid's shape."""
        d = self.as_dict()
        if TIED_AXIS in d:
            return d[TIED_AXIS], d[TIED_AXIS]
        return d["lambda_p1"], d["lambda_p2"]

    @property
    def key(self) -> str:
        """``lambda=0.03`` or ``lambda_p1=0.03,lambda_p2=0.1`` (shortest exact float repr)."""
        return ",".join(f"{k}={v!r}" for k, v in self.values)


@dataclass(frozen=True)
class CellRun:
    """What a runner is handed: the cell, its Optuna trial number and its nested MLflow run."""

    cell: Cell
    trial: int
    mlflow_run: str | None = None


@dataclass(frozen=True)
class CellResult:
    """A cell's outcome: the selection metric, the tie-break metric (NaN when not measurable or
    when the lock breaks ties by the smallest λ), the valid-answer rate (NaN when not measured;
    read against the lock's validity floor) and the ids of the runs that produced them
    (``{"train": ..., "evaluate": ...}``)."""

    metric: float
    tie_break: float = math.nan
    run_ids: dict[str, str] = field(default_factory=dict)
    validity: float = math.nan


Runner = Callable[[CellRun], CellResult]
"""A cell runner: trains and evaluates one cell, returns its :class:`CellResult`."""


def grid_cells(grid: GridSpec) -> list[Cell]:
    """Every cell of the grid (product of the axes), in sorted order."""
    names = sorted(grid.axes)
    return sorted(Cell.of(dict(zip(names, combo)))
                  for combo in itertools.product(*(grid.axes[n] for n in names)))


def _round(value: float) -> float:
    return float(f"{value:.{OUTWARD_DIGITS}g}")


def _step_out(grid: GridSpec, edge: EdgeRule, axis: str, value: float) -> float | None:
    """The next value outward from ``value`` on ``axis``, or None when ``value`` is inside the
    grid (not on or past an edge) or the axis has no step (a single value, or a non-positive
    result)."""
    values = grid.axes[axis]
    low, high = values[0], values[-1]
    if low < value < high or len(values) < 2:
        side = None
    elif value <= low:
        side = "low"
    else:
        side = "high"
    if side is None:
        return None
    explicit = edge.outward.get(axis, {}).get(side)
    if explicit is not None and value == (low if side == "low" else high):
        return explicit
    edge_value, inner = (values[0], values[1]) if side == "low" else (values[-1], values[-2])
    if grid.scale == "log":
        ratio = edge_value / inner
        out = value * ratio
    else:
        out = value + (edge_value - inner)
    if out < 0 or (grid.scale == "log" and out <= 0) or not math.isfinite(out):
        return None
    return _round(out)


def outward_cell(grid: GridSpec, edge: EdgeRule, cell: Cell) -> Cell | None:
    """The cell one grid step outward from ``cell`` along every axis on which it sits on (or past)
    the grid's edge; None when it is on no edge. A corner steps outward along both axes."""
    values = cell.as_dict()
    moved = False
    for axis in sorted(values):
        if axis not in grid.axes:
            return None
        out = _step_out(grid, edge, axis, values[axis])
        if out is not None:
            values[axis] = out
            moved = True
    return Cell.of(values) if moved else None
