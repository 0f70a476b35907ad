"""The selection lock: a YAML file that fixes the λ selection before any trial runs (App. I.3, I.4,
M.2, O).

A lock names the grid, the arm, the training notes, size and seed, the selection metric, the
inclusive tie band, the tie rule and the edge rule. Its sha256 (over the file's bytes, so over
every field, ``training.train_notes`` included) is written into the Optuna study when the study is
created; a later load under a different lock is refused (:func:`selection.grid.open_study`). The
same sha256 is part of the ``select_lambda`` run's identity (the param ``lock_sha256``), so a run
made under other lock bytes is never reused. Example
(``projects/configs/locks/embedded-3cell.yaml``)::

    study: embedded-3cell
    arm: mistill
    grid: {tied: true, scale: log, lambda: [0.03, 0.1, 0.3]}
    training: {seed: 0, max_steps: 1}
    selection: {metric: micro_f1, split: val, tie_band: 0.004, tie_break: m1/P2C/p_pos}
    edge: {extend: true, max_extensions: 1}

The training notes (``training.train_notes: {n: 100, seed: 0}``; absent or ``n: 0`` = every note
of the targets run's training split): each cell's ``train`` run gets ``train_notes = n`` and
``train_notes_seed = seed`` and trains on :func:`mistill.stages.distill.train_note_ids` of them
(the split's ids sorted, ``numpy.random.default_rng(seed).permutation``, the first ``n``).
**[recon]**: App. I.3 trains at "100 training notes" without saying how they were chosen. A plain
``train`` run given the same two values trains on the same notes (the Vanilla CoT-KD reference
"trained on the same 100 notes", Tables 39-41). ``seed`` is the draw's, not the training seed's.

Metric names (``selection.metric``, ``selection.tie_break``, ``selection.validity_metric``) are
MLflow metric names, whose parts are separated by ``/`` (``m1/P2C/p_pos``); the dotted spelling
(``m1.P2C.p_pos``) names the same metric and is normalised when the lock is read. A name that,
so normalised, is no metric the evaluation logs (:data:`METRIC_PATTERNS`) is refused, naming the
lock file and the field.

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

    selection: {metric: answer_f1, split: select, tie_band: 0.017, tie_break: smallest_lambda,
                validity_floor: 0.95, fidelity: false}
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mistill.errors import MistillInputError
from mistill.io import read_yaml_mapping, sha256_file

TIED_AXIS = "lambda"
UNTIED_AXES = ("lambda_p1", "lambda_p2")
SCALES = ("log", "linear")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")

_SECTIONS: dict[str, set[str]] = {
    "grid": {"tied", "scale", TIED_AXIS, *UNTIED_AXES},
    "training": {"seed", "max_steps", "epochs", "grad_accum", "precision", "train_notes"},
    "selection": {"metric", "split", "tie_band", "tie_break", "max_new_tokens", "validity_floor",
                  "validity_metric", "tie_fallback", "fidelity"},
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
METRIC_SEPARATOR = "/"
"""Between the parts of a metric name (as :data:`mistill.tracking.naming.METRIC_SEPARATOR`)."""
TRAIN_NOTES_KEYS = ("n", "seed")
"""The keys of ``training.train_notes``: the count (0 = every training note) and the draw's seed."""

METRIC_PATTERNS: tuple[str, ...] = (
    # the task metrics of the evaluate stage (mistill.evaluation.metrics.task_metrics)
    r"micro_f1|micro_precision|micro_recall|macro_f1|mean_note_f1|head_macro_f1|tail_macro_f1",
    r"(p|r|psp|psndcg)_at_[0-9]+",
    r"n_notes|n_head_labels|n_tail_labels",
    # the answers' validity (evaluate)
    r"valid_rate|cap_rate|degenerate_rate|mean_generated_tokens|n_unclosed_think|n_not_json"
    r"|n_out_of_inventory|thinking_switch",
    # M1 per event kind (mistill.evaluation.m1.m1_summary) and the fidelity metrics (evaluate)
    r"m1/(P1|P2|P2C)/(p_pos|median_margin|n)",
    r"fidelity/(ppl_median|bleu4_mean|las_mean)",
    # App. O's answer metrics (mistill.tasks.musique)
    r"answer_f1|answer_em",
)
"""The metric names a lock may select or break ties by (full matches): what the ``evaluate``
stage logs, and App. O's answer metrics."""
_METRIC = re.compile("|".join(f"(?:{p})" for p in METRIC_PATTERNS))


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
    """How each cell trains: the seed and the size (``max_steps``; 0 = the full recipe), and on
    which notes: ``train_notes`` of the training split (0 = every one) drawn with
    ``train_notes_seed`` (:func:`mistill.stages.distill.train_note_ids`; **[recon]** App. I.3
    does not say how its 100 training notes were chosen). The lock spells the last two
    ``train_notes: {n: <count>, seed: <seed>}``."""

    seed: int
    max_steps: int
    epochs: int = 2
    grad_accum: int = 8
    precision: str = ""
    train_notes: int = 0
    train_notes_seed: int = 0


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
    fidelity: whether the cells' ``evaluate`` runs read the teacher-forced fidelity and M1
        readouts (they need the teacher's traces on the selection notes; App. O's selection by
        answer F1 and the smallest λ reads neither: ``fidelity: false``).
    """

    metric: str
    split: str
    tie_band: float
    tie_break: str
    max_new_tokens: int = 16384  # the evaluation's generation cap (the paper's 16,384)
    validity_floor: float | None = None
    validity_metric: str = VALID_RATE
    tie_fallback: tuple[str, ...] = DEFAULT_TIE_FALLBACK
    fidelity: bool = True

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


def _train_notes(r: _Reader) -> tuple[int, int]:
    """``training.train_notes: {n: <count>, seed: <seed>}`` as ``(n, seed)``; absent = ``(0, 0)``
    (every training note). ``n`` is required, ``seed`` too when ``n > 0``."""
    raw = r.get("train_notes", dict, None)
    if raw is None:
        return 0, 0
    unknown = sorted(set(raw) - set(TRAIN_NOTES_KEYS), key=str)
    if unknown:
        raise r.fail("train_notes", f"unknown key(s) {unknown}; expected {{n: <count>, seed: <seed>}}")
    values = {}
    for key in TRAIN_NOTES_KEYS:
        value = raw.get(key)
        if value is None and key == "seed" and raw.get("n") == 0:
            value = 0
        if value is None:
            raise r.fail(f"train_notes.{key}", "missing (a lock states the count and the draw's seed)")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise r.fail(f"train_notes.{key}", f"expected an integer >= 0, got {value!r}"
                                               + (" (0: every training note)" if key == "n" else ""))
        values[key] = value
    return values["n"], values["seed"]


def _training(path: str, data: Any) -> TrainingSpec:
    r = _Reader(path, "training", data)
    n, notes_seed = _train_notes(r)
    spec = TrainingSpec(seed=r.get("seed", int), max_steps=r.get("max_steps", int),
                        epochs=r.get("epochs", int, 2), grad_accum=r.get("grad_accum", int, 8),
                        precision=r.get("precision", str, ""), train_notes=n, train_notes_seed=notes_seed)
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


def known_metric(name: str) -> bool:
    """True iff ``name`` (``/``-separated) is a metric a lock may name (:data:`METRIC_PATTERNS`)."""
    return _METRIC.fullmatch(name) is not None


def _metric(r: _Reader, key: str, default: str | None = None) -> str:
    """The metric named by ``key``, dotted parts normalised to ``/`` (``m1.P2C.p_pos`` is
    ``m1/P2C/p_pos``); refused, naming the field, when it is empty or names no known metric.
    ``tie_break``'s literal :data:`SMALLEST_LAMBDA` is returned as it is."""
    raw = r.get(key, str, default)
    if raw is None or not raw.strip():
        raise r.fail(key, "must not be empty")
    if key == "tie_break" and raw == SMALLEST_LAMBDA:
        return raw
    name = raw.strip().replace(".", METRIC_SEPARATOR)
    if not known_metric(name):
        shown = f"{raw!r}" + (f" (read as {name!r})" if name != raw else "")
        raise r.fail(key, f"{shown} is no metric the evaluation logs; known (full matches): "
                          f"{' | '.join(METRIC_PATTERNS)}")
    return name


def _selection(path: str, data: Any) -> SelectionRule:
    r = _Reader(path, "selection", data)
    rule = SelectionRule(metric=_metric(r, "metric"), split=r.get("split", str),
                         tie_band=r.get("tie_band", float), tie_break=_metric(r, "tie_break"),
                         max_new_tokens=r.get("max_new_tokens", int, 16384),
                         validity_floor=None if data.get("validity_floor") is None
                         else r.get("validity_floor", float),
                         validity_metric=_metric(r, "validity_metric", VALID_RATE),
                         tie_fallback=_tie_fallback(r), fidelity=r.get("fidelity", bool, True))
    if rule.max_new_tokens < 1:
        raise r.fail("max_new_tokens", f"must be >= 1, got {rule.max_new_tokens!r}")
    if rule.tie_band < 0:
        raise r.fail("tie_band", f"must be >= 0, got {rule.tie_band!r}")
    if rule.validity_floor is not None and not 0.0 <= rule.validity_floor <= 1.0:
        raise r.fail("validity_floor", f"must be in [0, 1] (a rate), got {rule.validity_floor!r}")
    if not rule.split.strip():
        raise r.fail("split", "must not be empty")
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
    p = Path(path)
    data, text = read_yaml_mapping(p, what="lock", known=_TOP)
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


def lock_from_record(record: Mapping[str, Any], *, source: str = "decision.json") -> Lock:
    """The :class:`Lock` a selection recorded (``decision.json``'s ``lock``, :meth:`Lock.to_dict`),
    validated by the same section readers as :func:`load_lock`, so that the rule can be re-applied
    to the recorded cells (:func:`selection.decide.decide`, :func:`selection.decide.sensitivity`)
    without the lock file. ``text`` is empty; ``path`` and ``sha256`` are the recorded ones.

    Raises:
        MistillInputError: the record lacks a section or a field, or a value is not valid (names
            ``source`` and the field).
    """
    if not isinstance(record, Mapping):
        raise MistillInputError("a recorded lock is a mapping", file=source, field="lock")
    for key in ("study", "arm", *_SECTIONS):
        if key not in record:
            raise MistillInputError("missing from the recorded lock", file=source, field=f"lock.{key}")
    training = record["training"]
    if not isinstance(training, Mapping):
        raise MistillInputError("expected a mapping", file=source, field="lock.training")
    training = {k: v for k, v in training.items() if k not in ("train_notes", "train_notes_seed")}
    training["train_notes"] = {"n": record["training"].get("train_notes", 0),
                               "seed": record["training"].get("train_notes_seed", 0)}
    selection = {k: v for k, v in dict(record["selection"]).items() if v is not None}
    grid = _grid(source, dict(record["grid"]))
    return Lock(path=str(record.get("path", "")), sha256=str(record.get("sha256", "")), study=str(record["study"]),
                arm=str(record["arm"]), grid=grid, training=_training(source, training),
                selection=_selection(source, selection), edge=_edge(source, dict(record["edge"]), grid), text="")
