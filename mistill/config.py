"""Dataclass configs that serialise to ``config.json``.

Every stage takes one frozen dataclass; ``to_dict`` is what goes to ``config.json`` and to
MLflow params, ``from_dict`` reads it back with type checks, so a resumed or reused run can
compare typed values rather than strings.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import typing
from pathlib import Path
from typing import Any, TypeVar

from mistill.errors import MistillInputError
from mistill.io import read_json, write_json

C = TypeVar("C", bound="Config")


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    """Coerce a string/JSON value to the annotated type (int, float, bool, str, tuple, Optional)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except (TypeError, ValueError):
                continue
        raise ValueError(f"{name}: cannot read {value!r} as {annotation}")
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if value.strip() else []
        elem = args[0] if args else Any
        items = [_coerce(v, elem, name) for v in value]
        return tuple(items) if origin is tuple else items
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int,)) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{name}: cannot read {value!r} as bool")
    if annotation is int:
        if isinstance(value, bool):
            raise ValueError(f"{name}: bool given for int")
        if isinstance(value, str):
            value = float(value) if any(c in value for c in ".eE") else int(value)
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{name}: {value!r} is not an integer")
        return int(value)
    if annotation is float:
        return float(value)
    if annotation is str:
        return str(value)
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    """Base class: subclasses are frozen dataclasses of plain typed fields.

    Every construction (direct, :meth:`from_dict`, :meth:`replace`) ends in :meth:`validate`,
    so a config that exists holds valid values. A subclass that needs its own
    ``__post_init__`` must call ``super().__post_init__()``.
    """

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse values that cannot be valid, raising
        :class:`~mistill.errors.MistillInputError` with ``field`` set and the accepted values
        named (shared checks: :mod:`mistill.validation`). Checks that need another run or the
        corpus belong to the stage, before its run starts. The default accepts everything."""

    def check_environment(self) -> None:
        """Checks that depend on this machine, made when a stage starts and before its run is
        created (not at construction, so a config naming a GPU can be read anywhere): every
        ``device`` / ``*_device`` field names a device this machine has."""
        from mistill.validation import check_device_available

        for f in dataclasses.fields(self):
            if f.name == "device" or f.name.endswith("_device"):
                check_device_available(str(getattr(self, f.name)), f.name)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any], *, source: str = "config") -> C:
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise MistillInputError(f"unknown parameter(s) {unknown}; known: {sorted(known)}",
                                    file=source, field=unknown[0])
        kwargs = {}
        for name, value in data.items():
            try:
                kwargs[name] = _coerce(value, hints[name], name)
            except (TypeError, ValueError) as exc:
                raise MistillInputError(str(exc), file=source, field=name) from None
        return cls(**kwargs)

    def replace(self: C, **changes: Any) -> C:
        return dataclasses.replace(self, **changes)

    def content_digests(self) -> dict[str, str]:
        """sha256 of the content of every file this config names by path, by field name.

        A run reads what a file holds, not its path: a lock, code list or corpus edited in place
        must make a different run. The digests join the run's identity as the params
        ``<field>_sha256`` (see :func:`mistill.tracking.runs.identity_params`). Configs that name
        files override this; a missing file is left out here and refused by the stage itself.
        """
        return {}

    def save(self, path: str | os.PathLike, **extra: Any) -> Path:
        """Write ``config.json``: every argument plus library versions and ``extra`` context."""
        payload = {"config": self.to_dict(), "class": f"{type(self).__module__}.{type(self).__qualname__}",
                   "versions": library_versions(), **extra}
        return write_json(path, payload)

    @classmethod
    def load(cls: type[C], path: str | os.PathLike) -> C:
        data = read_json(path)
        return cls.from_dict(data.get("config", data), source=str(path))


def file_digest(path: str | os.PathLike) -> str | None:
    """sha256 of a file's bytes, or None when ``path`` is empty or not a file."""
    import hashlib

    if not path or not Path(path).is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    """Versions of the libraries a result depends on (recorded in every config.json)."""
    import importlib.metadata as md

    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in ("torch", "transformers", "accelerate", "numpy", "scipy", "mlflow", "optuna", "mistill"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out
