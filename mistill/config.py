"""Dataclass configs that serialise to ``config.json``.

Every stage takes one frozen dataclass; ``to_dict`` is what goes to ``config.json`` and to
MLflow params, ``from_dict`` reads it back with type checks, so a resumed or reused run can
compare typed values rather than strings. Fields several configs share are defined once, in a
:class:`ParamGroup` the configs inherit (the groups: :mod:`mistill.params`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from mistill.errors import MistillInputError
from mistill.io import read_json, write_json
from mistill.validation import check_device_available

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
class ParamGroup:
    """Base class of a parameter group: fields several configs share, each defined once.

    A group is a frozen dataclass whose fields all have defaults; its docstring describes its
    fields as a config's does (the command line's help reads the docstrings of every class a
    config inherits, :func:`mistill.stages.cli.field_meanings`), and its :meth:`validate_group`
    refuses invalid values of the fields it declares itself. A :class:`Config` takes a group by
    inheriting it, ``class EventsConfig(Config, EventsParams, ChunkParams)``, and so has its
    fields, with their type, default, help and validation; a group may extend another.
    """

    def validate_group(self) -> None:
        """Refuse invalid values of the fields this group declares (a base group checks its
        own), raising :class:`~mistill.errors.MistillInputError` with ``field`` set. Run by
        :class:`Config` after the config's own :meth:`Config.validate`, so a stage's first check
        (no text in any field) comes first."""


def param_groups(cls: type) -> tuple[type[ParamGroup], ...]:
    """The parameter groups a class takes, base groups first (reversed method resolution order)."""
    return tuple(k for k in reversed(cls.__mro__)
                 if issubclass(k, ParamGroup) and k is not ParamGroup and not issubclass(k, Config))


def group_fields(group: type[ParamGroup]) -> tuple[str, ...]:
    """The fields a group declares itself (not those of the groups it extends)."""
    own = vars(group).get("__annotations__", {})
    return tuple(f.name for f in dataclasses.fields(group) if f.name in own)


def param_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """A config's fields in the order its command line and ``MLproject`` list them: the fields
    it declares itself, in declaration order, then those of the parameter groups it takes, group
    by group in the order its class statement names them."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    grouped = {name for g in param_groups(cls) for name in group_fields(g)}
    order = [name for name in fields if name not in grouped]
    for base in cls.__bases__:
        if dataclasses.is_dataclass(base):
            order += [f.name for f in dataclasses.fields(base) if f.name not in order]
    order += [name for name in fields if name not in order]
    return tuple(fields[name] for name in order)


@dataclasses.dataclass(frozen=True)
class Config:
    """Base class: subclasses are frozen dataclasses of plain typed fields.

    Every construction (direct, :meth:`from_dict`, :meth:`replace`) ends in :meth:`validate`
    and the :meth:`ParamGroup.validate_group` of every group the class takes, so a config that
    exists holds valid values. A subclass that needs its own ``__post_init__`` must call
    ``super().__post_init__()``.

    A subclass may give fields of the groups it takes other defaults, named in one mapping:
    ``class PipelineConfig(Config, NullParams, defaults={"n_null": 10})``; they are listed in
    :attr:`group_defaults`. The type, help and validation stay the group's.
    """

    group_defaults: typing.ClassVar[Mapping[str, Any]] = MappingProxyType({})
    """The defaults this class gives fields of its groups in place of the groups' own."""

    def __init_subclass__(cls, defaults: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not defaults:
            return
        annotations = cls.__dict__.get("__annotations__")
        if annotations is None:
            cls.__annotations__ = annotations = {}
        for name, value in defaults.items():
            group = next((g for g in param_groups(cls) if name in group_fields(g)), None)
            if group is None:
                raise TypeError(f"{cls.__name__}: defaults names {name!r}, a field of none of its parameter groups")
            if name in annotations:
                raise TypeError(f"{cls.__name__}: {name!r} is declared in the class and named in defaults")
            annotations[name] = typing.get_type_hints(group)[name]
            setattr(cls, name, value)  # read by the dataclass decorator as the field's default
        cls.group_defaults = MappingProxyType({**cls.group_defaults, **defaults})

    def __post_init__(self) -> None:
        self.validate()
        for group in param_groups(type(self)):
            if "validate_group" in vars(group):
                vars(group)["validate_group"](self)

    def validate(self) -> None:
        """Refuse values that cannot be valid, raising
        :class:`~mistill.errors.MistillInputError` with ``field`` set and the accepted values
        named (shared checks: :mod:`mistill.validation`). Checks that need another run or the
        corpus belong to the stage, before its run starts. The default accepts everything."""

    def check_environment(self) -> None:
        """Checks that depend on this machine, made when a stage starts and before its run is
        created (not at construction, so a config naming a GPU can be read anywhere): every
        ``device`` / ``*_device`` field names a device this machine has."""
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

    def shared_params(self, other: type[Config]) -> dict[str, Any]:
        """This config's values of the fields of every parameter group ``other`` takes too: what
        a workflow passes on to a step's config (``CharacterizeConfig`` -> ``EventsConfig``), so
        a field added to a group both take is passed on without another edit."""
        names = {f.name for g in param_groups(type(self)) if issubclass(other, g) for f in dataclasses.fields(g)}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in names}

    def content_digests(self) -> dict[str, str]:
        """sha256 of the content of every file this config names by path, by field name.

        A run reads what a file holds, not its path: a lock, code list or corpus edited in place
        must make a different run. The digests join the run's identity as the params
        ``<field>_sha256`` (see :func:`mistill.tracking.identity.identity_params`). Configs that name
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
    if not path or not Path(path).is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def folder_digest(path: str | os.PathLike) -> str | None:
    """sha256 over a folder's files (each one's path below the folder and its bytes' sha256, in
    sorted path order), or None when ``path`` is empty or not a folder."""
    if not path or not Path(path).is_dir():
        return None
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(root).as_posix()}\0{file_digest(f)}\n".encode("utf-8"))
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    """Versions of the libraries a result depends on (recorded in every config.json)."""
    import importlib.metadata as md  # deferred: slow to import, and `mistill --help` imports this module

    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in ("torch", "transformers", "accelerate", "numpy", "scipy", "mlflow", "optuna", "mistill"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out
