"""Atomic file writes and strict JSONL reading.

Nothing half-written is ever left behind: every writer goes to a temporary file in the
destination directory and is renamed over the target only once complete (``os.replace`` is
atomic on POSIX within one file system).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from mistill.errors import MistillInputError

SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
"""A name that may be one path component of a run's files (a note id, a corpus, a subdir):
letters, digits, ``_``, ``.``, ``-``, not starting with ``.``."""


def mistill_root() -> Path:
    """Local state root (``$MISTILL_ROOT`` or ``./.mistill``)."""
    return Path(os.environ.get("MISTILL_ROOT", ".mistill"))


def is_safe_name(value: object) -> bool:
    """Whether ``value`` matches :data:`SAFE_NAME` as a whole (a trailing newline fails too)."""
    return isinstance(value, str) and SAFE_NAME.fullmatch(value) is not None and value not in (".", "..")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[TextIO | BinaryIO]:
    """Open a temporary sibling of ``path`` for writing; rename it over ``path`` on success.

    On any exception the temporary file is removed and ``path`` is untouched.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open supports 'w' and 'wb', not {mode!r}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_open(path, "w") as fh:
        fh.write(text)
    return Path(path)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_open(path, "wb") as fh:
        fh.write(data)
    return Path(path)


def _json_default(obj: Any) -> Any:
    # numpy scalars / arrays and paths show up in configs and metrics; keep them readable.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (Path, os.PathLike)):
        return os.fspath(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def dumps(obj: Any, *, indent: int | None = None) -> str:
    return json.dumps(obj, indent=indent, sort_keys=indent is not None, default=_json_default,
                      ensure_ascii=False)


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2) -> Path:
    return write_text(path, dumps(obj, indent=indent) + "\n")


def write_jsonl(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> Path:
    with atomic_open(path, "w") as fh:
        for row in rows:
            fh.write(dumps(row) + "\n")
    return Path(path)


def read_json(path: str | os.PathLike) -> Any:
    p = Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MistillInputError("file not found", file=str(p)) from None
    except json.JSONDecodeError as exc:
        raise MistillInputError(_json_error(exc), file=str(p), line=exc.lineno) from None


def _json_error(exc: json.JSONDecodeError) -> str:
    """One message for a JSON error: some of Python's end in "at" ("Unterminated string starting
    at"), which the column completes."""
    msg = exc.msg[:-3] if exc.msg.endswith(" at") else exc.msg
    return f"malformed JSON: {msg} at column {exc.colno}"


def read_yaml_mapping(path: str | os.PathLike, *, what: str, known: Iterable[str],
                      field: str = "lock") -> tuple[dict[str, Any], str]:
    """The YAML mapping of ``path`` (a ``what``, e.g. "lock") and the file's text.

    A missing file, malformed YAML (with its line), a document that is not a mapping, or a key
    not in ``known`` raises :class:`MistillInputError` naming the file and ``field`` (the
    unknown key's name for an unknown key).
    """
    import yaml  # deferred: PyYAML only when a file is read

    p = Path(path)
    if not p.is_file():
        raise MistillInputError(f"{what} file not found", file=str(p), field=field)
    text = p.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        raise MistillInputError(f"malformed YAML: {getattr(exc, 'problem', exc)}", file=str(p),
                                line=None if line is None else line + 1) from None
    if not isinstance(data, dict):
        raise MistillInputError(f"a {what} is a YAML mapping", file=str(p), field=field)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise MistillInputError(f"unknown key(s) {unknown}; known: {sorted(known)}", file=str(p),
                                field=unknown[0])
    return data, text


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line of a JSONL file, strictly.

    A missing file, a malformed line or a line that is not a JSON object raises
    :class:`MistillInputError` naming the file and the line.
    """
    p = Path(path)
    if not p.exists():
        raise MistillInputError("file not found", file=str(p))
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MistillInputError(_json_error(exc), file=str(p), line=lineno) from None
            if not isinstance(row, dict):
                raise MistillInputError(f"expected a JSON object, got {type(row).__name__}",
                                        file=str(p), line=lineno)
            yield lineno, row


def read_jsonl(path: str | os.PathLike, *, required: Iterable[str] = (),
               id_field: str | None = None) -> list[dict[str, Any]]:
    """Read a JSONL file strictly (:func:`iter_jsonl`); an object missing one of ``required``
    raises :class:`MistillInputError` naming the file, the line, the record's ``id_field`` value
    when present, and the field."""
    rows: list[dict[str, Any]] = []
    required = tuple(required)
    for lineno, row in iter_jsonl(path):
        note = str(row.get(id_field)) if id_field and id_field in row else None
        for key in required:
            if key not in row:
                raise MistillInputError("missing field", file=str(path), line=lineno, note=note,
                                        field=key)
        rows.append(row)
    return rows


def npz_bytes(arrays: Mapping[str, Any]) -> bytes:
    """A compressed ``.npz`` of ``arrays`` as bytes (for per-note artifacts written atomically)."""
    import numpy as np  # deferred: numpy only when needed

    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@contextlib.contextmanager
def environment_variable(key: str, value: str | None) -> Iterator[None]:
    """``$key`` set to ``value`` (None: unset) inside the block and in processes launched there,
    restored (or removed) on exit."""
    saved = os.environ.get(key)
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved
