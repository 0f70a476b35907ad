"""The selection lock: a YAML file that fixes the λ selection before any trial runs (App. I.3, I.4,
M.2, O).

A lock names the grid, the arm, the training size and seed, the selection metric, the inclusive
tie band, the tie rule and the edge rule. Its sha256 (over the file's bytes) is written into the
Optuna study when the study is created; a later load under a different lock is refused
(:func:`selection.grid.open_study`). The same sha256 is part of the ``select_lambda`` run's
identity (the param ``lock_sha256``), so a run made under other lock bytes is never reused.
Example (``projects/configs/locks/embedded-3cell.yaml``)::

    study: embedded-3cell
    arm: mistill
    grid: {tied: true, scale: log, lambda: [0.03, 0.1, 0.3]}
    training: {seed: 0, max_steps: 1}
    selection: {metric: micro_f1, split: val, tie_band: 0.004, tie_break: m1/P2C/p_pos}
    edge: {extend: true, max_extensions: 1}

``grid.tied: true`` means λ_P1 = λ_P2 = λ over ``grid.lambda``; ``tied: false`` takes
``grid.lambda_p1`` and ``grid.lambda_p2`` (their product is the grid). ``edge.outward`` may fix the
first outward value per axis and side (``{lambda: {low: 0.01, high: 1.0}}``); otherwise one grid
step outward is used (a ratio for ``scale: log``, a difference for ``scale: linear``).

Two tie rules (``selection.tie_break``):

* **a metric name** (App. I.3, I.4, M.2: ``m1/P2C/p_pos``, M1 at P2C): among the cells within
  ``tie_band`` of the best, the one with the higher value of that metric. When that does not
  decide (**[recon]**, the paper states no fallback): a cell whose tie-break metric is NaN ranks
  last, then ``selection.tie_fallback`` in order, default ``[metric, smaller_lambda]`` (the
  higher selection metric, then the smaller λ); its entries are ``metric``, ``smaller_lambda``
  and ``larger_lambda``, and it ends with exactly one λ order, which always decides.
* **the literal** ``smallest_lambda`` (App. O): among the cells within ``tie_band`` of the best,
  the smallest λ. On an untied grid "smallest" compares ``(λ_P1, λ_P2)`` in that order
  (**[recon]**: the paper's App. O grid is tied).

A validity floor (App. O: "among cells with a valid-answer rate of at least 0.95"):
``selection.validity_floor`` (a number in [0, 1]; absent = no floor) makes every cell whose
``selection.validity_metric`` (default ``valid_rate``, the valid-answer rate the ``evaluate``
stage logs) is below the floor, or not measured, ineligible: it is recorded with the reason and
is neither the best, nor in the band, nor the pick. The floor is inclusive.

App. O's lock, for example::

    selection: {metric: answer_f1, split: val, tie_band: 0.017, tie_break: smallest_lambda,
                validity_floor: 0.95}
    edge: {extend: true, max_extensions: 1, outward: {lambda: {low: 0.01, high: 1.0}}}

The edge rule (``edge``; :mod:`selection.decide` applies it): when the pick sits on the grid's
edge the cell one step outward is run and joins the grid, and the band and the tie rule are
applied again over the extended grid; a further extension, beyond the new edge, is run only if
the new edge cell beats the previous pick by more than the band (App. I.4's "second-extension
condition"), up to ``edge.max_extensions`` outward cells in all.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mistill.errors import MistillInputError
from mistill.io import sha256_file

TIED_AXIS = "lambda"
UNTIED_AXES = ("lambda_p1", "lambda_p2")
SCALES = ("log", "linear")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")

_SECTIONS: dict[str, set[str]] = {
    "grid": {"tied", "scale", TIED_AXIS, *UNTIED_AXES},
    "training": {"seed", "max_steps", "epochs", "grad_accum", "precision"},
    "selection": {"metric", "split", "tie_band", "tie_break", "max_new_tokens", "validity_floor",
                  "validity_metric", "tie_fallback"},
    "edge": {"extend", "max_extensions", "outward"},
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "grid": ("tied", "scale"),
    "training": ("seed", "max_steps"),
    "selection": ("metric", "split", "tie_band", "tie_break"),
    "edge": ("extend",),
}
_TOP = {"study", "arm", "description", *_SECTIONS}

SMALLEST_LAMBDA = "smallest_lambda"
"""``selection.tie_break``'s literal for App. O's tie rule: the smallest λ within the band."""
VALID_RATE = "valid_rate"
"""The valid-answer rate the ``evaluate`` stage logs (the default ``selection.validity_metric``)."""
FALLBACK_METRIC = "metric"
SMALLER_LAMBDA = "smaller_lambda"
LARGER_LAMBDA = "larger_lambda"
LAMBDA_ORDERS = (SMALLER_LAMBDA, LARGER_LAMBDA)
DEFAULT_TIE_FALLBACK = (FALLBACK_METRIC, SMALLER_LAMBDA)


@dataclass(frozen=True)
class GridSpec:
    """The λ grid: ``axes`` maps an axis name to its sorted values; ``tied`` → one axis ``lambda``."""

    tied: bool
    scale: str
    axes: dict[str, tuple[float, ...]]

    def search_space(self) -> dict[str, list[float]]:
        """The axes as Optuna's :class:`~optuna.samplers.GridSampler` takes them."""
        return {name: list(values) for name, values in sorted(self.axes.items())}


@dataclass(frozen=True)
class TrainingSpec:
    """How each cell trains: the seed and the size (``max_steps``; 0 = the full recipe)."""

    seed: int
    max_steps: int
    epochs: int = 2
    grad_accum: int = 8
    precision: str = ""


@dataclass(frozen=True)
class SelectionRule:
    """Select by ``metric`` on ``split``; cells within ``tie_band`` (inclusive) of the best tie.

    tie_band: the inclusive band (App. I.4's measured 0.004; **[recon]** the App. I.3 lock uses 0,
        its pre-registered rule naming no band).
    tie_break: a metric name (the higher value wins the tie) or :data:`SMALLEST_LAMBDA` (the
        smallest λ wins, App. O; **[recon]** on an untied grid (λ_P1, λ_P2) compare in that order).
    validity_floor: cells whose ``validity_metric`` is below it are ineligible (App. O's 0.95);
        **[recon]** a cell whose rate was not measured is ineligible too; None = no floor.
    validity_metric: the valid-answer rate's metric name (the ``evaluate`` stage's ``valid_rate``).
    tie_fallback: **[recon]** what decides a tie the tie-break metric leaves (after a NaN
        tie-break ranks last): entries of ``metric`` (the higher selection metric),
        ``smaller_lambda``, ``larger_lambda``, ending with exactly one λ order. Unused with
        :data:`SMALLEST_LAMBDA`.
    """

    metric: str
    split: str
    tie_band: float
    tie_break: str
    max_new_tokens: int = 16384  # the evaluation's generation cap (the paper's 16,384)
    validity_floor: float | None = None
    validity_metric: str = VALID_RATE
    tie_fallback: tuple[str, ...] = DEFAULT_TIE_FALLBACK

    @property
    def by_smallest_lambda(self) -> bool:
        """True iff ties go to the smallest λ (App. O), not to a tie-break metric."""
        return self.tie_break == SMALLEST_LAMBDA

    @property
    def tie_break_metric(self) -> str | None:
        """The tie-break metric's name, or None under :data:`SMALLEST_LAMBDA`."""
        return None if self.by_smallest_lambda else self.tie_break


@dataclass(frozen=True)
class EdgeRule:
    """When the pick sits on the grid's edge, run the cell one step outward; it joins the grid and
    the band and the tie rule are applied again. A further extension beyond the new edge runs only
    if the new edge cell beats the previous pick by more than the band; at most
    ``max_extensions`` outward cells in all (**[recon]**: extensions continue only beyond the cell
    last added). ``outward`` fixes the first outward value per axis and side."""

    extend: bool
    max_extensions: int = 1
    outward: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Lock:
    """A validated lock file and its sha256 (over the file's bytes)."""

    path: str
    sha256: str
    study: str
    arm: str
    grid: GridSpec
    training: TrainingSpec
    selection: SelectionRule
    edge: EdgeRule
    text: str

    def to_dict(self) -> dict[str, Any]:
        """Plain values for ``decision.json`` and MLflow params."""
        return {"path": self.path, "sha256": self.sha256, "study": self.study, "arm": self.arm,
                "grid": {"tied": self.grid.tied, "scale": self.grid.scale,
                         **{k: list(v) for k, v in self.grid.axes.items()}},
                "training": vars(self.training).copy(),
                "selection": {**vars(self.selection), "tie_fallback": list(self.selection.tie_fallback)},
                "edge": {"extend": self.edge.extend, "max_extensions": self.edge.max_extensions,
                         "outward": self.edge.outward}}


class _Reader:
    """Typed access to one section of the lock; errors name the file and the dotted field."""

    def __init__(self, path: str, section: str, data: Any) -> None:
        self.path, self.section = path, section
        if not isinstance(data, dict):
            raise MistillInputError(f"section {section!r} must be a mapping, got {type(data).__name__}",
                                    file=path, field=section)
        unknown = sorted(set(data) - _SECTIONS[section])
        if unknown:
            raise MistillInputError(f"unknown key(s) {unknown}; known: {sorted(_SECTIONS[section])}",
                                    file=path, field=f"{section}.{unknown[0]}")
        for key in _REQUIRED[section]:
            if key not in data:
                raise MistillInputError("missing (a lock states every rule before any trial)",
                                        file=path, field=f"{section}.{key}")
        self.data = data

    def fail(self, key: str, message: str) -> MistillInputError:
        return MistillInputError(message, file=self.path, field=f"{self.section}.{key}")

    def get(self, key: str, kind: type, default: Any = None) -> Any:
        if key not in self.data:
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(key, f"expected {kind.__name__}, got {value!r}")
        if kind is float and not math.isfinite(value):
            raise self.fail(key, f"expected a finite number, got {value!r}")
        return value

    def values(self, key: str, scale: str) -> tuple[float, ...]:
        raw = self.data.get(key)
        if not isinstance(raw, list) or not raw:
            raise self.fail(key, f"expected a non-empty list of numbers, got {raw!r}")
        out = []
        for v in raw:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise self.fail(key, f"expected numbers, got {v!r}")
            if v < 0 or (scale == "log" and v <= 0):
                raise self.fail(key, f"λ must be {'> 0 on a log grid' if scale == 'log' else '>= 0'}, "
                                     f"got {v!r}")
            out.append(float(v))
        if len(set(out)) != len(out):
            raise self.fail(key, f"repeated values in {raw!r}")
        return tuple(sorted(out))


def _grid(path: str, data: Any) -> GridSpec:
    r = _Reader(path, "grid", data)
    tied = r.get("tied", bool)
    scale = r.get("scale", str)
    if scale not in SCALES:
        raise r.fail("scale", f"expected one of {SCALES}, got {scale!r}")
    names = (TIED_AXIS,) if tied else UNTIED_AXES
    wrong = sorted(set(data) & ({TIED_AXIS, *UNTIED_AXES} - set(names)))
    if wrong:
        raise r.fail(wrong[0], f"not an axis of a {'tied' if tied else 'untied'} grid; use {list(names)}")
    return GridSpec(tied=tied, scale=scale, axes={n: r.values(n, scale) for n in names})


def _training(path: str, data: Any) -> TrainingSpec:
    r = _Reader(path, "training", data)
    spec = TrainingSpec(seed=r.get("seed", int), max_steps=r.get("max_steps", int),
                        epochs=r.get("epochs", int, 2), grad_accum=r.get("grad_accum", int, 8),
                        precision=r.get("precision", str, ""))
    for key in ("seed", "max_steps"):
        if getattr(spec, key) < 0:
            raise r.fail(key, f"must be >= 0, got {getattr(spec, key)}")
    for key in ("epochs", "grad_accum"):
        if getattr(spec, key) < 1:
            raise r.fail(key, f"must be >= 1, got {getattr(spec, key)}")
    return spec


def _tie_fallback(r: _Reader) -> tuple[str, ...]:
    raw = r.get("tie_fallback", list, list(DEFAULT_TIE_FALLBACK))
    known = (FALLBACK_METRIC, *LAMBDA_ORDERS)
    if any(not isinstance(v, str) or v not in known for v in raw) or len(set(raw)) != len(raw):
        raise r.fail("tie_fallback", f"expected distinct entries of {list(known)}, got {raw!r}")
    orders = [v for v in raw if v in LAMBDA_ORDERS]
    if len(orders) != 1 or raw[-1] not in LAMBDA_ORDERS:
        raise r.fail("tie_fallback", f"must end with exactly one of {list(LAMBDA_ORDERS)} (a λ order always "
                                     f"decides), got {raw!r}")
    return tuple(raw)


def _selection(path: str, data: Any) -> SelectionRule:
    r = _Reader(path, "selection", data)
    rule = SelectionRule(metric=r.get("metric", str), split=r.get("split", str),
                         tie_band=r.get("tie_band", float), tie_break=r.get("tie_break", str),
                         max_new_tokens=r.get("max_new_tokens", int, 16384),
                         validity_floor=None if data.get("validity_floor") is None
                         else r.get("validity_floor", float),
                         validity_metric=r.get("validity_metric", str, VALID_RATE),
                         tie_fallback=_tie_fallback(r))
    if rule.max_new_tokens < 1:
        raise r.fail("max_new_tokens", f"must be >= 1, got {rule.max_new_tokens!r}")
    if rule.tie_band < 0:
        raise r.fail("tie_band", f"must be >= 0, got {rule.tie_band!r}")
    if rule.validity_floor is not None and not 0.0 <= rule.validity_floor <= 1.0:
        raise r.fail("validity_floor", f"must be in [0, 1] (a rate), got {rule.validity_floor!r}")
    for key in ("metric", "split", "tie_break", "validity_metric"):
        if not getattr(rule, key).strip():
            raise r.fail(key, "must not be empty")
    for key in ("metric", "tie_break", "validity_metric"):  # MLflow metric names: parts between '/'
        value = getattr(rule, key)
        if "." in value:
            raise r.fail(key, f"{value!r} is not a metric name: metric names separate their parts with '/' "
                              f"(write {value.replace('.', '/')!r})")
    return rule


def _edge(path: str, data: Any, grid: GridSpec) -> EdgeRule:
    r = _Reader(path, "edge", data)
    extend = r.get("extend", bool)
    max_ext = r.get("max_extensions", int, 1)
    if max_ext < 0:
        raise r.fail("max_extensions", f"must be >= 0, got {max_ext}")
    outward_raw = r.get("outward", dict, {}) or {}
    outward: dict[str, dict[str, float]] = {}
    for axis, sides in outward_raw.items():
        if axis not in grid.axes:
            raise r.fail("outward", f"{axis!r} is not an axis of the grid {sorted(grid.axes)}")
        if not isinstance(sides, dict) or not sides or set(sides) - {"low", "high"}:
            raise r.fail("outward", f"{axis}: expected {{low: x, high: y}} (either or both), got {sides!r}")
        values = grid.axes[axis]
        for side, v in sides.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise r.fail("outward", f"{axis}.{side}: expected a number, got {v!r}")
            v = float(v)
            if (side == "low" and not v < values[0]) or (side == "high" and not v > values[-1]):
                raise r.fail("outward", f"{axis}.{side} = {v!r} is not outside the grid {list(values)}")
            if v < 0 or (grid.scale == "log" and v <= 0):
                raise r.fail("outward", f"{axis}.{side} = {v!r} is not a valid λ on a {grid.scale} grid")
        outward[axis] = {side: float(v) for side, v in sides.items()}
    return EdgeRule(extend=extend, max_extensions=max_ext, outward=outward)


def load_lock(path: str | Path) -> Lock:
    """Read and validate a lock file; every error names the file and the field."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise MistillInputError("lock file not found", file=str(p), field="lock")
    text = p.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        raise MistillInputError(f"malformed YAML: {getattr(exc, 'problem', exc)}", file=str(p),
                                line=None if line is None else line + 1) from None
    if not isinstance(data, dict):
        raise MistillInputError("a lock is a YAML mapping", file=str(p), field="lock")
    unknown = sorted(set(data) - _TOP)
    if unknown:
        raise MistillInputError(f"unknown key(s) {unknown}; known: {sorted(_TOP)}", file=str(p),
                                field=unknown[0])
    for key in ("study", "arm", *_SECTIONS):
        if key not in data:
            raise MistillInputError("missing (a lock states every rule before any trial)", file=str(p),
                                    field=key)
    for key in ("study", "arm"):
        if not isinstance(data[key], str) or not _NAME.match(data[key]):
            raise MistillInputError(f"expected a name (letters, digits, '_', '.', '-'), got {data[key]!r}",
                                    file=str(p), field=key)
    grid = _grid(str(p), data["grid"])
    return Lock(path=str(p), sha256=sha256_file(p), study=data["study"], arm=data["arm"], grid=grid,
                training=_training(str(p), data["training"]), selection=_selection(str(p), data["selection"]),
                edge=_edge(str(p), data["edge"], grid), text=text)
