"""Where the platform differs from the paper's text, as data.

Every rule a reader cannot find in the paper (a **[recon]** choice) and every place the
platform's default differs from what the paper states is one :class:`Deviation`. The registry
:data:`DEVIATIONS` is the source of ``docs/DEVIATIONS.md`` (a test checks that the two name
the same parameters and that every parameter exists in a config), and the report reads it to
name, for the runs it reads, every value that differs from the platform's default or from the
paper's stated value (:func:`deviations_in`).

A parameter is named ``<Class>.<field>``, where ``<Class>`` is one of :func:`config_classes`
(the stage configs, the arm, and the selection lock's sections). A run records the field under
its bare name in ``config.json`` (``config``) or, for an arm, under ``arm`` in the same file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PAPER_SILENT = "silent"
"""``Deviation.paper_value`` for a rule the paper does not state (a **[recon]** choice)."""


@dataclass(frozen=True)
class Deviation:
    """One choice: what the paper says, what the platform does, and the parameter that changes it.

    paper_value: the paper's value where it states one, else :data:`PAPER_SILENT`.
    default: the platform's default value of ``parameter``.
    """

    parameter: str
    paper: str
    platform: str
    why: str
    default: Any
    paper_value: Any = PAPER_SILENT

    @property
    def recon(self) -> bool:
        """True iff the paper states no value (the platform's choice is a reconstruction)."""
        return isinstance(self.paper_value, str) and self.paper_value == PAPER_SILENT

    @property
    def class_name(self) -> str:
        return self.parameter.split(".", 1)[0]

    @property
    def field(self) -> str:
        return self.parameter.split(".", 1)[1]


DEVIATIONS: tuple[Deviation, ...] = ()
"""Filled below, one entry per row of ``docs/DEVIATIONS.md``."""


def config_classes() -> dict[str, type]:
    """The dataclasses a deviation's parameter may name, by class name."""
    from mistill.distill.arms import ArmConfig
    from mistill.stages.registry import stages
    from selection.lock import EdgeRule, SelectionRule, TrainingSpec

    out: dict[str, type] = {c.__name__: c for c in (ArmConfig, EdgeRule, SelectionRule, TrainingSpec)}
    for stage in stages().values():
        out[stage.config.__name__] = stage.config
    return out


def field_default(parameter: str) -> Any:
    """The default of ``<Class>.<field>`` in code (``KeyError`` when either does not exist)."""
    cls_name, name = parameter.split(".", 1)
    cls = config_classes()[cls_name]
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                return f.default_factory()  # type: ignore[misc]
            raise KeyError(f"{parameter} has no default")
    raise KeyError(f"{cls_name} has no field {name!r}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b if isinstance(a, bool) and isinstance(b, bool) else False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def deviations_in(config_class: str, config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The registry's parameters of ``config_class`` whose value in ``config`` is not the
    platform's default or differs from the paper's stated value.

    Args:
        config_class: the class name of the run's config (``config.json``'s ``class``, last part),
            or ``ArmConfig`` for the resolved arm.
        config: the run's recorded values by field name.
    Returns:
        one dict per finding: parameter, value, default, paper_value, kind (``non_default``
        when the value is not the default; ``against_paper`` when the value is the default but the
        paper states another value).
    """
    out = []
    for d in DEVIATIONS:
        if d.class_name != config_class or d.field not in config:
            continue
        value = config[d.field]
        if not _same(value, d.default):
            kind = "non_default"
        elif not d.recon and not _same(value, d.paper_value):
            kind = "against_paper"
        else:
            continue
        out.append({"parameter": d.parameter, "value": value, "default": d.default,
                    "paper_value": None if d.recon else d.paper_value, "kind": kind})
    return out
