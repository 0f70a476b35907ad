"""What a selection records: ``decision.json``, the cell table and the sensitivity table."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from selection.cells import grid_cells, outward_cell
from selection.decide import Decision, default_bands, ineligibility, pairwise_gaps, sensitivity
from selection.grid import CellReport, StudyCells
from selection.lock import Lock


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def cell_rows(lock: Lock, decision: Decision, cells: StudyCells) -> list[dict[str, Any]]:
    """One row per cell (grid cells first, then outward cells): λs, state, metric, tie-break,
    valid-answer rate, eligibility (and why not), the full-precision gap to the best cell of the
    extended grid, membership of the extended grid and of the band, edge, pick, run ids."""
    grid = grid_cells(lock.grid)
    extra = sorted((set(cells.results) | set(cells.failed) | cells.running | cells.waiting) - set(grid))
    best = cells.results.get(decision.best) if decision.best else None
    rule = lock.selection
    rows = []
    for cell in grid + extra:
        res = cells.results.get(cell)
        state = ("complete" if res else "failed" if cell in cells.failed
                 else "running" if cell in cells.running
                 else "queued for retry" if cell in cells.waiting else "not run")
        trials = cells.trials.get(cell, [])
        p1, p2 = cell.lambdas
        rows.append({
            "cell": cell.key, "lambda_p1": p1, "lambda_p2": p2, "in_grid": cell in grid, "state": state,
            rule.metric: res.metric if res else None,
            **({rule.tie_break_metric: _finite(res.tie_break) if res else None} if rule.tie_break_metric else {}),
            rule.validity_metric: _finite(res.validity) if res else None,
            "eligible": bool(res) and ineligibility(rule, res) is None,
            "ineligible_reason": (ineligibility(rule, res) or "") if res else "",
            "gap_to_best": repr(best.metric - res.metric) if (res and best) else "",
            "in_extended_grid": cell in decision.extended_grid,
            "in_band": cell in decision.tied,
            "on_edge": outward_cell(lock.grid, lock.edge, cell) is not None if cell in grid else False,
            "picked": cell == decision.pick,
            "trials": len(trials),
            "mlflow_run": trials[-1]["mlflow_run"] if trials else None,
            "train_run": res.run_ids.get("train") if res else None,
            "evaluate_run": res.run_ids.get("evaluate") if res else None,
            "error": cells.failed.get(cell, ""),
        })
    return rows


def cells_table(lock: Lock, decision: Decision, cells: StudyCells) -> pd.DataFrame:
    """:func:`cell_rows` as a table."""
    return pd.DataFrame(cell_rows(lock, decision, cells))


def sensitivity_table(lock: Lock, cells: StudyCells, bands: Iterable[float] | None = None) -> pd.DataFrame:
    """The rule re-applied with other bands to the same cells (no retraining)."""
    return pd.DataFrame(sensitivity(lock, cells.results, default_bands(lock) if bands is None else bands))


def decision_record(lock: Lock, decision: Decision, cells: StudyCells, reports: Mapping[str, CellReport],
                    *, study: str, storage: str, bands: Iterable[float] | None = None,
                    heartbeat: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Everything ``decision.json`` holds: the lock, the decision and the rule that decided it (the
    grid and the extended grid, the band result over it, each extension with its further-extension
    condition and gap, the ineligible cells and why), every cell with full-precision gaps, the
    runs' reports, the sensitivity view and the heartbeat settings (interval, grace, max_retry)
    the cells ran under."""
    return {
        "lock": lock.to_dict(),
        "study": study,
        "storage": storage,
        "heartbeat": dict(heartbeat or {}),
        "decision": decision.to_dict(),
        "cells": cell_rows(lock, decision, cells),
        "pairwise_gaps": pairwise_gaps(cells.results),
        "failed": {c.key: e for c, e in cells.failed.items()},
        "running": sorted(c.key for c in cells.running),
        "waiting": sorted(c.key for c in cells.waiting),
        "reports": {name: r.to_dict() for name, r in reports.items()},
        "sensitivity": sensitivity(lock, cells.results, default_bands(lock) if bands is None else bands),
    }


def decision_metrics(lock: Lock, decision: Decision, cells: StudyCells) -> dict[str, float]:
    """Metrics for MLflow: the pick's λs and scores (``selected/lambda_p1``, ``selected/<metric>``),
    the gap to the runner-up, counts."""
    out: dict[str, float] = {"n_cells": float(len(grid_cells(lock.grid))), "n_failed": float(len(cells.failed)),
                             "n_extensions": float(sum(e.ran for e in decision.extensions)),
                             "n_ineligible": float(len(decision.ineligible))}
    if decision.pick is not None:
        res = cells.results[decision.pick]
        out["selected/lambda_p1"], out["selected/lambda_p2"] = decision.pick.lambdas
        out[f"selected/{lock.selection.metric}"] = res.metric
        if lock.selection.tie_break_metric and math.isfinite(res.tie_break):
            out[f"selected/{lock.selection.tie_break_metric}"] = res.tie_break
        if math.isfinite(res.validity):
            out[f"selected/{lock.selection.validity_metric}"] = res.validity
        others = sorted(g for c, g in decision.gaps.items() if c != decision.best and c not in decision.ineligible)
        if others:
            out["gap_best_to_runner_up"] = others[0]
    return out
