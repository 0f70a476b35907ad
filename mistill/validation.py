"""Checks shared by the configs' :meth:`~mistill.config.Config.validate`.

Every config validates when it is constructed (``Config.__post_init__``), so a value that cannot
be valid is refused before any MLflow run exists. Each check raises
:class:`~mistill.errors.MistillInputError` naming the field and the values it accepts. Floats
are compared so that NaN never passes (``not (x >= 0)`` is true for NaN), and infinities are
refused wherever a finite number is meant.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import NoReturn

from mistill.errors import MistillInputError

DEVICE_FORMS = ("cpu", "cuda", "cuda:<n>", "mps")
_CUDA_INDEX = re.compile(r"cuda:([0-9]+)")


def fail(message: str, field: str) -> NoReturn:
    """Raise the input error every check raises."""
    raise MistillInputError(message, field=field)


def check_device(value: str, field: str = "device", *, extra: Sequence[str] = ()) -> None:
    """The form of a device: ``cpu``, ``cuda``, ``cuda:<n>`` or ``mps`` (plus the stage's ``extra``
    forms). Whether this machine has it is :func:`check_device_available`'s question, asked when
    a stage starts: a config naming a GPU can be read and compared on any machine."""
    accepted = ", ".join(repr(v) for v in (*DEVICE_FORMS, *extra))
    if value == "cpu" or value in extra:
        return
    if value not in ("cuda", "mps") and _CUDA_INDEX.fullmatch(value) is None:
        fail(f"unknown device {value!r}; accepted: {accepted}", field)


def check_device_available(value: str, field: str = "device") -> None:
    """A device this machine has: ``cuda`` needs ``torch.cuda.is_available()`` and, for
    ``cuda:<n>``, ``n`` below the device count; ``mps`` needs ``torch.backends.mps.is_available()``.
    Other values (``cpu``, a stage's own forms such as ``auto``) pass."""
    index = _CUDA_INDEX.fullmatch(value)
    if value not in ("cuda", "mps") and index is None:
        return
    import torch

    if value == "mps":
        if not torch.backends.mps.is_available():
            fail("device 'mps' is not available on this machine (torch.backends.mps.is_available() "
                 "is False); use 'cpu'", field)
        return
    if not torch.cuda.is_available():
        fail(f"device {value!r}: CUDA is not available on this machine (torch.cuda.is_available() "
             "is False); use 'cpu'", field)
    count = torch.cuda.device_count()
    if index is not None and int(index.group(1)) >= count:
        fail(f"device {value!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}", field)


def check_dtype(value: str, field: str = "dtype") -> None:
    """A dtype name :func:`mistill.models.loading.torch_dtype` reads."""
    from mistill.models.loading import DTYPES

    if value not in DTYPES:
        fail(f"unknown dtype {value!r}; accepted: {sorted(DTYPES)}", field)


def check_choice(value: str, choices: Iterable[str], field: str) -> None:
    """``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        fail(f"{field} must be one of {choices}, got {value!r}", field)


def check_choices(values: Iterable[str], choices: Iterable[str], field: str, *,
                  non_empty: bool = True) -> None:
    """Every value is one of ``choices`` (and, with ``non_empty``, there is at least one)."""
    values, choices = tuple(values), tuple(choices)
    if non_empty and not values:
        fail(f"{field} must name at least one of {choices}", field)
    bad = [v for v in values if v not in choices]
    if bad:
        fail(f"{field}: unknown {bad}; accepted: {choices}", field)


def check_not_empty(value: str, field: str, what: str) -> None:
    """A string that must name something (``what``)."""
    if not value.strip():
        fail(f"{field} is empty: it must name {what}", field)


def check_at_least(value: int | float, low: int | float, field: str, note: str = "") -> None:
    """``value >= low`` and finite; ``note`` says what the smallest values mean (``0: every note``)."""
    if not (math.isfinite(value) and value >= low):
        fail(f"{field} must be >= {low}{f' ({note})' if note else ''}, got {value!r}", field)


def check_non_negative(value: int | float, field: str, note: str = "") -> None:
    """``value >= 0`` and finite."""
    check_at_least(value, 0, field, note)


def check_positive(value: int | float, field: str) -> None:
    """``value > 0`` and finite."""
    if not (math.isfinite(value) and value > 0):
        fail(f"{field} must be > 0, got {value!r}", field)


def check_seed(value: int, field: str = "seed") -> None:
    """A seed is a non-negative integer (NumPy's generators refuse negative seeds)."""
    check_non_negative(value, field, "seeds are non-negative integers")


def check_interval(value: float, field: str, low: float = 0.0, high: float = 1.0, *,
                   low_open: bool = False, high_open: bool = False) -> None:
    """``value`` in the interval from ``low`` to ``high`` (each end closed unless said open)."""
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (math.isfinite(value) and above and below):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        fail(f"{field} must lie in {interval}, got {value!r}", field)


def check_counts(values: Sequence[int], field: str, *, low: int = 1, non_empty: bool = True,
                 unique: bool = True) -> None:
    """A list of counts (``k`` values): each ``>= low``, at least one, no repeats."""
    if non_empty and not values:
        fail(f"{field} must hold at least one value", field)
    bad = [v for v in values if v < low]
    if bad:
        fail(f"{field}: every value must be >= {low}, got {list(values)}", field)
    if unique and len(set(values)) != len(values):
        fail(f"{field} repeats a value: {list(values)}", field)


__all__ = ["DEVICE_FORMS", "fail", "check_device", "check_device_available", "check_dtype", "check_choice", "check_choices",
           "check_not_empty", "check_at_least", "check_non_negative", "check_positive", "check_seed",
           "check_interval", "check_counts"]
