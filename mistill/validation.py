"""Checks shared by the configs' :meth:`~mistill.config.Config.validate`.

Every config validates when it is constructed (``Config.__post_init__``), so a value that cannot
be valid is refused before any MLflow run exists. Each check raises
:class:`~mistill.errors.MistillInputError` naming the field and the values it accepts. Floats
are compared so that NaN never passes (``not (x >= 0)`` is true for NaN), and infinities are
refused wherever a finite number is meant.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from mistill.errors import MistillInputError
from mistill.io import is_safe_name

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
        _refuse(f"unknown device {_shown(value)}; accepted: {accepted}", field, value)


def check_device_available(value: str, field: str = "device") -> None:
    """A device this machine has: ``cuda`` needs ``torch.cuda.is_available()`` and, for
    ``cuda:<n>``, ``n`` below the device count; ``mps`` needs ``torch.backends.mps.is_available()``.
    Other values (``cpu``, a stage's own forms such as ``auto``) pass."""
    index = _CUDA_INDEX.fullmatch(value)
    if value not in ("cuda", "mps") and index is None:
        return
    import torch  # deferred: torch is slow to import

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


DTYPE_NAMES: dict[str, str] = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
                               "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}
"""The dtype names a config may give, each with the name of its torch dtype
(:data:`mistill.models.loading.DTYPES` maps them to the dtypes)."""


def check_dtype(value: str, field: str = "dtype") -> None:
    """A dtype name :func:`mistill.models.loading.torch_dtype` reads."""
    if value not in DTYPE_NAMES:
        _refuse(f"unknown dtype {_shown(value)}; accepted: {sorted(DTYPE_NAMES)}", field, value)


def check_choice(value: str, choices: Iterable[str], field: str) -> None:
    """``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        _refuse(f"{field} must be one of {choices}, got {_shown(value)}", field, value)


def check_choices(values: Iterable[str], choices: Iterable[str], field: str, *,
                  non_empty: bool = True) -> None:
    """Every value is one of ``choices`` (and, with ``non_empty``, there is at least one)."""
    values, choices = tuple(values), tuple(choices)
    if non_empty and not values:
        fail(f"{field} must name at least one of {choices}", field)
    bad = [v for v in values if v not in choices]
    if bad:
        _refuse(f"{field}: unknown {', '.join(_shown(v) for v in bad)}; accepted: {choices}", field, " ".join(bad))


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


# ------------------------------------------------------------------ string parameters
# Every ``str`` field of a stage config is one of the kinds below, and each kind is checked for
# its form: a run id, a name (split, corpus, arm, row label), a path, a model spec, an
# ``overrides`` string, a storage URL, or one of a fixed list of choices. None of these can be
# a sentence. The form matters for privacy: ``mlflow run`` stores every ``-P`` value as a param
# of the run it opens *before* the stage starts, so a value refused here has already reached the
# tracking store; a value refused as text (:class:`TextValueError`) makes the stage purge that
# run (:mod:`mistill.tracking.purge`), not only delete it.

PROSE_WORDS = 6
"""A parameter value with this many words reads as text, and is refused as such: whitespace-
separated words in any value (:func:`check_no_text`), words between any separators in a name
or in a component of a path that does not exist. Six is the privacy guard's unit (a shared word
6-gram is a leak, see :mod:`mistill.tracking.privacy`); the guard itself checks every value
again when the stage starts (:class:`~mistill.tracking.runs.StageRun`)."""

NAME_MAX_CHARS = 64
"""The longest name (split, corpus, arm): it names folders, experiments and tags."""

PATH_MAX_CHARS = 4096
"""The longest path (PATH_MAX on Linux)."""

RUN_ID = re.compile(r"[0-9a-f]{32}")
"""An MLflow run id, as every MLflow tracking store makes them (``uuid4().hex``)."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NAME_WORD = re.compile(r"[^\W_]+")  # letters and digits, between any other characters
_LETTER_WORD = re.compile(r"[^\W\d_]+")  # letters only: "Qwen3-1.7B" holds one
_PATH_COMPONENT = re.compile(r"[\w.+=,@~-]+")
_LAYER_KEEP = re.compile(r"every-other|layers=[0-9]+(?:,[0-9]+)*")
_TINY_SPEC = re.compile(r"tiny(?::[A-Za-z0-9_]*)?(?::[A-Za-z_]+=[0-9]+)*")
_OVERRIDE_VALUE = re.compile(r"[A-Za-z0-9_]+(?:\+[A-Za-z0-9_]+)*")
_STORAGE_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")


class TextValueError(MistillInputError):
    """A parameter value refused because it has the shape of text (line breaks, or
    :data:`PROSE_WORDS` words or more) where a name, id, path or number is meant.

    Such a value may be note text passed by mistake. Its message never repeats the value, and
    under ``mlflow run`` the run holding it as a param is purged from the tracking store
    (:func:`mistill.stages.cli.main`).
    """


def _shown(value: str) -> str:
    """``value`` quoted when short and without spaces, else only its length: a refusal never
    repeats what could be text."""
    if len(value) <= 40 and not any(c.isspace() for c in value):
        return repr(value)
    return f"a value of {len(value)} characters"


def _refuse(message: str, field: str, value: str) -> NoReturn:
    """Raise the refusal of a malformed ``value``: :class:`TextValueError` when it holds
    :data:`PROSE_WORDS` words or more (letters and digits between any other characters, the
    way a reader finds words in ``the-patient-was-...``), else :class:`MistillInputError`."""
    if len(_NAME_WORD.findall(value)) >= PROSE_WORDS:
        raise TextValueError(message, field=field)
    fail(message, field)


HEAD_NAME = re.compile(r"L\d+H\d+")
"""A head's name as the instrument writes it (``L30H11``: layer 30, head 11), for :func:`check_pattern`."""


def check_pattern(value: str, pattern: re.Pattern, field: str, what: str) -> None:
    """``value`` matches ``pattern`` (``what`` describes the form); a malformed value is refused
    without repeating what could be text (:func:`_refuse`)."""
    check_no_text(value, field)
    if pattern.fullmatch(value) is None:
        _refuse(f"{field}: {_shown(value)} is not {what}", field, value)


def check_no_text(value: str, field: str) -> None:
    """Not text: no line break or other control character, and fewer than :data:`PROSE_WORDS`
    whitespace-separated words. Refused with :class:`TextValueError`, without the value."""
    if _CONTROL.search(value):
        raise TextValueError(f"{field} holds a line break or another control character: a parameter "
                             "is one short value (a name, id, path or number), never text", field=field)
    words = len(value.split())
    if words >= PROSE_WORDS:
        raise TextValueError(f"{field} holds {words} words: a parameter is a name, id, path or number, "
                             f"never text (at most {PROSE_WORDS - 1} whitespace-separated words)",
                             field=field)


def check_no_text_fields(config: Any) -> None:
    """:func:`check_no_text` on every string of a config: each ``str`` field and each string
    item of a tuple field, named by its field. The first check of every stage config, so no
    field (a future one included) takes text, and no later check repeats text in its message."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, str):
                check_no_text(item, f.name)


def check_run_id(value: str, field: str, *, required: bool = False) -> None:
    """An MLflow run id (:data:`RUN_ID`: 32 lowercase hexadecimal characters), or empty unless
    ``required``. Whether the run exists is the stage's question, asked before its run starts."""
    check_no_text(value, field)
    if not value:
        if required:
            fail(f"{field} is empty: it must be the id of an MLflow run (32 hexadecimal characters)", field)
        return
    if RUN_ID.fullmatch(value) is None:
        _refuse(f"{field} must be an MLflow run id (32 lowercase hexadecimal characters)"
                f"{'' if required else ' or empty'}, got {_shown(value)}", field, value)


def check_run_ids(values: Sequence[str], field: str) -> None:
    """Every value an MLflow run id (:func:`check_run_id`, none empty)."""
    for value in values:
        check_run_id(value, field, required=True)


def check_name(value: str, field: str, what: str, *, allow_empty: bool = False) -> None:
    """A short safe name (``what``: a split, a corpus, a row label): letters, digits, ``_``,
    ``.``, ``-``, not starting with ``.`` (:func:`mistill.io.is_safe_name`), at most
    :data:`NAME_MAX_CHARS` characters and fewer than :data:`PROSE_WORDS` words between the
    separators, so a name cannot spell a sentence. Empty only with ``allow_empty``."""
    check_no_text(value, field)
    if not value:
        if not allow_empty:
            fail(f"{field} is empty: it must name {what}", field)
        return
    words = len(_NAME_WORD.findall(value))
    if words >= PROSE_WORDS:
        raise TextValueError(f"{field} must name {what}: a name has at most {PROSE_WORDS - 1} words "
                             f"between '-', '_' and '.', this one has {words}", field=field)
    if not is_safe_name(value) or len(value) > NAME_MAX_CHARS:
        fail(f"{field} must name {what}: letters, digits, '_', '.', '-', not starting with '.', at most "
             f"{NAME_MAX_CHARS} characters; got {_shown(value)}", field)


def check_names(values: Sequence[str], field: str, what: str) -> None:
    """Every value a name (:func:`check_name`, none empty)."""
    for value in values:
        check_name(value, field, what)


def check_path(value: str, field: str, what: str, *, allow_empty: bool = False) -> None:
    """A path (``what``: a corpus file, a lock, a model directory or hub id): one that exists
    here, or one written in plain components (letters, digits and ``_ . - + = , @ ~``, between
    ``/``), none of which holds :data:`PROSE_WORDS` words of letters (``the-patient-was-...``),
    so a config naming a file of another machine stays readable on this one; whether the file
    is there is the stage's check, made before its run. In both cases fewer than
    :data:`PROSE_WORDS` whitespace-separated words, no control character, at most
    :data:`PATH_MAX_CHARS` characters. Empty only with ``allow_empty``."""
    check_no_text(value, field)
    if not value:
        if not allow_empty:
            fail(f"{field} is empty: it must name {what}", field)
        return
    if len(value) > PATH_MAX_CHARS:
        fail(f"{field} is {len(value)} characters long: no path is longer than {PATH_MAX_CHARS}", field)
    if Path(value).expanduser().exists():
        return
    parts = [part for part in value.split("/") if part]
    if not all(_PATH_COMPONENT.fullmatch(part) for part in parts):
        _refuse(f"{field} must name {what}: {_shown(value)} exists nowhere here, and is not a plain "
                "path (components of letters, digits and '_.-+=,@~' between '/')", field, value)
    words = max((len(_LETTER_WORD.findall(part)) for part in parts), default=0)
    if words >= PROSE_WORDS:
        raise TextValueError(f"{field} must name {what}: it exists nowhere here, and one of its "
                             f"components holds {words} words, like text", field=field)


def check_model_spec(value: str, field: str, *, allow_empty: bool = False) -> None:
    """A model spec (:mod:`mistill.models.loading`): ``embedded:<name>``,
    ``tiny:<family>[:<key>=<n>...]``, ``run:<run id>``, or a local directory or hub id
    (:func:`check_path`, optionally ``<dir>::<file>.gguf``); any of them optionally followed by
    a layer selection ``@every-other`` / ``@layers=0,2,...``. Empty only with ``allow_empty``."""
    check_no_text(value, field)
    if not value:
        if not allow_empty:
            fail(f"{field} is empty: it must be a model spec", field)
        return
    base, sep, keep = value.rpartition("@")
    if not sep or "/" in keep:  # as mistill.models.loading.split_layer_spec reads it
        base, keep = value, ""
    elif _LAYER_KEEP.fullmatch(keep) is None:
        _refuse(f"{field}: unknown layer selection {_shown(keep)} (every-other, layers=0,2,...)", field, value)
    what = "a model directory or hub id"
    if base.startswith("embedded:"):
        if not is_safe_name(base[len("embedded:"):]):
            _refuse(f"{field}: embedded:<name> needs a name, got {_shown(value)}", field, value)
    elif base.startswith("tiny:"):
        if _TINY_SPEC.fullmatch(base) is None:
            _refuse(f"{field}: a tiny model is tiny:<family>[:<key>=<n>...], got {_shown(value)}", field, value)
    elif base.startswith("run:"):
        check_run_id(base[len("run:"):], field, required=True)
    else:
        path, gguf_sep, gguf = base.partition("::")
        check_path(path, field, what)
        if gguf_sep and not (is_safe_name(gguf) and gguf.endswith(".gguf")):
            _refuse(f"{field}: <dir>::<file>.gguf names a .gguf file of the directory, got {_shown(gguf)}",
                    field, value)


ARM_FILE_SUFFIXES = (".yaml", ".yml")


def is_arm_path(arm: str) -> bool:
    """Whether ``arm`` is given as an explicit path (a ``.yaml`` / ``.yml`` file name)."""
    return arm.lower().endswith(ARM_FILE_SUFFIXES)


def check_arm(value: str, field: str, *, allow_empty: bool = False) -> None:
    """An arm: a name (:func:`check_name`) or an explicit ``.yaml`` / ``.yml`` path
    (:func:`check_path`). Which arms exist is :func:`mistill.distill.arms.resolve_arm`'s check."""
    if is_arm_path(value):
        check_path(value, field, "an arm file (.yaml)")
    else:
        check_name(value, field, "an arm", allow_empty=allow_empty)


def check_arms(values: Sequence[str], field: str) -> None:
    """Every value an arm (:func:`check_arm`, none empty)."""
    for value in values:
        check_arm(value, field)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def check_overrides(value: str, field: str, keys: Iterable[str]) -> None:
    """``key=value,...``: each key one of ``keys``, each value a finite number or names joined by
    ``+`` (``terms=attention+write``). Whether a value suits its key is the owner's check
    (:func:`mistill.distill.arms.resolve_arm`)."""
    check_no_text(value, field)
    keys = tuple(keys)
    for item in filter(None, (x.strip() for x in value.split(","))):
        key, eq, val = (part.strip() for part in item.partition("="))
        if not eq:
            _refuse(f"{field}: {_shown(item)} is not key=value", field, item)
        if key not in keys:
            _refuse(f"{field}: unknown key {_shown(key)}; known: {sorted(keys)}", field, item)
        if not (_is_number(val) or _OVERRIDE_VALUE.fullmatch(val)):
            _refuse(f"{field}: the value of {key} must be a number or names joined by '+', got "
                    f"{_shown(val)}", field, item)


def check_storage_url(value: str, field: str, *, allow_empty: bool = True) -> None:
    """A database URL (``sqlite:///path``, ``postgresql://host/db``): ``scheme://`` and no spaces;
    empty (the default store) unless ``allow_empty`` is False."""
    check_no_text(value, field)
    if not value:
        if not allow_empty:
            fail(f"{field} is empty: it must be a database URL", field)
        return
    if _STORAGE_URL.fullmatch(value) is None:
        _refuse(f"{field} must be a database URL (scheme://..., no spaces), got {_shown(value)}", field, value)


__all__ = ["DEVICE_FORMS", "fail", "check_device", "check_device_available", "check_dtype", "check_choice",
           "check_choices", "check_not_empty", "check_at_least", "check_non_negative", "check_positive", "check_seed",
           "check_interval", "check_counts", "DTYPE_NAMES", "ARM_FILE_SUFFIXES", "is_arm_path", "PROSE_WORDS",
           "NAME_MAX_CHARS", "PATH_MAX_CHARS", "RUN_ID", "TextValueError", "check_no_text", "check_no_text_fields",
           "check_run_id", "check_run_ids", "check_name", "check_names", "check_path", "check_model_spec", "check_arm",
           "check_arms", "check_overrides", "check_storage_url"]
