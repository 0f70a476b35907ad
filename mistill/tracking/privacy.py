"""The privacy guard: note and trace text never reaches MLflow for a restricted corpus.

A corpus carries one of three privacy levels (:data:`PRIVACY_LEVELS`). For ``"synthetic"`` and
``"public"`` corpora the guard allows everything. For ``"restricted"`` corpora (e.g. MIMIC-IV under
credentialed access) every string on its way to the tracking store -- param values, tag keys and
values, metric names, artifact files -- is checked against the protected texts (the notes and the
traces written about them) and refused with :class:`PrivacyError` when it contains any of them.

Detection is by shared word 6-grams, so it survives re-wrapping, changed case, punctuation and
the escaping of JSON, CSV and HTML:

* text is lower-cased and split into word tokens (``\\w+``), which collapses whitespace and drops
  punctuation and quoting;
* every 6-gram of every protected text is hashed (a rolling polynomial over per-word hashes,
  vectorised with numpy) into one sorted ``uint64`` array, so hundreds of notes of several
  thousand words index in well under a second;
* a candidate string is refused when one of its 6-grams is in that array;
* protected texts shorter than six words are checked as whole word sequences when their
  normalised form is at least 16 characters long (shorter ones are too common to mean anything).

Public texts (e.g. the ICD-10-CM descriptions of the label inventory, which notes may quote
verbatim) can be passed as ``public_texts``: their 6-grams are removed from the protected index,
so a table of codes and descriptions is not refused because a note repeats a description.

Error messages never repeat the protected text: they name only *where* it was found.
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mistill.errors import MistillInputError

PRIVACY_LEVELS: tuple[str, ...] = ("synthetic", "public", "restricted")
"""Corpus privacy levels; only ``"restricted"`` makes the guard refuse anything."""

NGRAM: int = 6
"""Word n-gram length shared between a candidate and a protected text that counts as a leak."""

MIN_SHORT_CHARS: int = 16
"""Protected texts shorter than :data:`NGRAM` words are matched only if at least this long."""

FREE_TEXT_WORDS: int = 12
"""In a restricted corpus, a dataset cell with at least this many words is free text: refused."""

TEXT_SUFFIXES: frozenset[str] = frozenset(
    {".json", ".jsonl", ".csv", ".tsv", ".md", ".txt", ".html", ".htm", ".tex", ".yaml", ".yml",
     ".log", ".svg", ".xml"})
"""File types read as text and scanned."""

NUMERIC_SUFFIXES: frozenset[str] = frozenset({".npz", ".npy", ".pt", ".safetensors"})
"""Binary numeric files, allowed without scanning (``.npy``/``.npz`` holding strings are scanned)."""

_WORD = re.compile(r"\w+")
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|[nrtbf])")
_MULT = np.uint64(1_000_003)


class PrivacyError(MistillInputError):
    """Refused: a value bound for the tracking store contains protected (restricted) note text.

    ``where`` names the place ("param max_len", "tag mistill.arm", "metric name", an artifact
    path); the protected text itself is never repeated in the message.
    """

    def __init__(self, where: str, *, file: str | None = None) -> None:
        self.where = where
        super().__init__(f"refusing to log {where}: it contains protected note text "
                         f"(corpus privacy level 'restricted')", file=file)


def _unescape(text: str) -> str:
    """Undo JSON-style escapes (``\\n``, ``\\u00e9``) so escaped text tokenises like the original."""
    if "\\" not in text:
        return text
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)) if m.group(1) else " ", text)


# ICD-10-CM code shapes (A00, A00.1, T07.XXXD, QA0.0101): public labels, never protected text.
_CODE = re.compile(r"\b[A-Za-z][0-9][0-9A-Za-z](?:\.[0-9A-Za-z]{1,4})?\b")


def tokens(text: str) -> list[str]:
    """Lower-cased word tokens of ``text`` (JSON escapes undone first; codes dropped)."""
    return [w for seg in segments(text) for w in seg]


def segments(text: str) -> list[list[str]]:
    """Word tokens of ``text`` in runs separated by label codes.

    Codes are public: an n-gram never spans one, so a list of gold codes, or a description
    followed by its code, is never mistaken for a note's text.
    """
    return [_WORD.findall(part.lower()) for part in _CODE.split(_unescape(text))]


def segment_hashes(text: str, n: int = 6) -> np.ndarray:
    """The word n-gram hashes of every code-free run of ``text``."""
    parts = [ngram_hashes(seg, n) for seg in segments(text) if len(seg) >= n]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def ngram_hashes(words: list[str], n: int = NGRAM) -> np.ndarray:
    """Hashes of the word ``n``-grams of ``words``: ``uint64[len(words) - n + 1]`` (empty if short).

    Each word is hashed once (Python's string hash, stable within one process); an n-gram's hash
    is the polynomial ``sum_k h(w_{i+k}) * M^(n-1-k)`` modulo 2^64.
    """
    if len(words) < n:
        return np.zeros(0, dtype=np.uint64)
    h = np.fromiter((hash(w) for w in words), dtype=np.int64, count=len(words)).view(np.uint64)
    m = len(words) - n + 1
    out = h[:m].copy()
    with np.errstate(over="ignore"):
        for k in range(1, n):
            out = out * _MULT + h[k:k + m]
    return out


class PrivacyGuard:
    """Refuse strings, mappings and files that contain protected text, for restricted corpora.

    Args:
        protected_texts: the note texts and trace texts of the corpus (more can be added later
            with :meth:`protect`).
        level: the corpus privacy level, one of :data:`PRIVACY_LEVELS`.
        public_texts: texts known to be public (label descriptions); their 6-grams never count.

    For ``"synthetic"`` and ``"public"`` corpora nothing is indexed and every check passes;
    :attr:`allows_text` tells a stage whether it may log texts at all.
    """

    def __init__(self, protected_texts: Iterable[str], level: str, *,
                 public_texts: Iterable[str] = ()) -> None:
        if level not in PRIVACY_LEVELS:
            raise MistillInputError(f"unknown privacy level {level!r}; use one of {PRIVACY_LEVELS}",
                                    field="privacy")
        self.level = level
        self._hashes = np.zeros(0, dtype=np.uint64)
        self._public = np.zeros(0, dtype=np.uint64)
        self._short: dict[str, list[tuple[str, ...]]] = {}
        if not self.allows_text:
            pub = [segment_hashes(t) for t in public_texts]
            self._public = np.unique(np.concatenate(pub)) if pub else self._public
            self.protect(protected_texts)

    @property
    def allows_text(self) -> bool:
        """True iff the corpus is synthetic or public (texts may be logged)."""
        return self.level != "restricted"

    @property
    def n_protected_ngrams(self) -> int:
        """Number of distinct protected 6-gram hashes indexed."""
        return int(self._hashes.size)

    def protect(self, texts: Iterable[str]) -> None:
        """Add protected texts (e.g. traces generated during a stage). No-op unless restricted."""
        if self.allows_text:
            return
        parts = [self._hashes]
        for text in texts:
            words = tokens(text)
            if len(words) >= NGRAM:
                parts.append(segment_hashes(text))
            elif words and len(" ".join(words)) >= MIN_SHORT_CHARS:
                self._short.setdefault(words[0], []).append(tuple(words))
        merged = np.unique(np.concatenate(parts))
        if self._public.size:
            merged = np.setdiff1d(merged, self._public, assume_unique=True)
        self._hashes = merged

    # ----------------------------------------------------------------------------------- checks
    def contains_protected(self, text: str) -> bool:
        """True iff ``text`` shares a 6-gram with a protected text or contains a short one."""
        if self.allows_text or not text:
            return False
        words = tokens(text)
        if self._hashes.size and len(words) >= NGRAM:
            cand = segment_hashes(text)
            idx = np.searchsorted(self._hashes, cand)
            idx[idx == self._hashes.size] = 0
            if bool(np.any(self._hashes[idx] == cand)):
                return True
        if self._short:
            for i, w in enumerate(words):
                for seq in self._short.get(w, ()):
                    if tuple(words[i:i + len(seq)]) == seq:
                        return True
        return False

    def check_text(self, text: str, where: str) -> None:
        """Raise :class:`PrivacyError` naming ``where`` if ``text`` contains protected text."""
        if self.contains_protected(text):
            raise PrivacyError(where)

    def check_mapping(self, d: Mapping[str, Any], where: str) -> None:
        """Check every key and value of ``d`` (nested mappings and lists too).

        ``where`` is the kind of entry ("param", "tag", "metric"): a refused key is reported as
        "<where> name" (the key itself is not repeated), a refused value as "<where> <key>".
        """
        if self.allows_text:
            return
        for key, value in d.items():
            self.check_text(str(key), f"{where} name")
            self._check_value(value, f"{where} {key}")

    def _check_value(self, value: Any, where: str) -> None:
        if value is None or isinstance(value, (bool, int, float, np.number)):
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                self.check_text(str(k), f"{where} (a key)")
                self._check_value(v, f"{where}.{k}")
            return
        if isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)
            for item in items:
                self._check_value(item, where)
            strings = [s for s in items if isinstance(s, str)]
            if len(strings) > 1:  # text split over list items (word lists, token lists)
                self._check_joined(strings, where)
            return
        self.check_text(str(value), where)

    def _check_joined(self, strings: list[str], where: str) -> None:
        if self.contains_protected(" ".join(strings)) or self.contains_protected("".join(strings)):
            raise PrivacyError(where)

    def check_file(self, path: str | os.PathLike) -> None:
        """Check one file bound for the artifact store.

        Text-like files (:data:`TEXT_SUFFIXES`) are scanned; JSON/JSONL also by their decoded
        strings joined in document order (catches word and token lists). ``.npy``/``.npz`` are
        allowed unless they hold strings (scanned) or objects (refused); ``.pt``/``.safetensors``
        are allowed unscanned. Any other file is scanned if it decodes as UTF-8 text and refused
        otherwise (an unknown binary type: it could hold text we cannot read).
        """
        if self.allows_text:
            return
        p = Path(path)
        where = f"artifact {p.name}"
        suffix = p.suffix.lower()
        if suffix in NUMERIC_SUFFIXES:
            if suffix in (".npy", ".npz"):
                self._check_numpy(p, where)
            return
        raw = p.read_bytes()
        if suffix in TEXT_SUFFIXES:
            text = raw.decode("utf-8", errors="replace")
        else:
            if b"\x00" in raw:
                raise PrivacyError(f"{where} (unknown binary file type {suffix or 'without suffix'})",
                                   file=str(p))
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise PrivacyError(f"{where} (unknown binary file type {suffix or 'without suffix'})",
                                   file=str(p)) from None
        if suffix in (".html", ".htm", ".md", ".xml", ".svg"):
            text = html.unescape(text)
        if self.contains_protected(text):
            raise PrivacyError(where, file=str(p))
        if suffix in (".json", ".jsonl"):
            strings = list(_json_strings(text, jsonl=suffix == ".jsonl"))
            if len(strings) > 1:
                try:
                    self._check_joined(strings, where)
                except PrivacyError:
                    raise PrivacyError(where, file=str(p)) from None

    def _check_numpy(self, p: Path, where: str) -> None:
        try:
            loaded = np.load(p, allow_pickle=False, mmap_mode="r" if p.suffix == ".npy" else None)
        except ValueError:  # object arrays need pickle: they can hold anything
            raise PrivacyError(f"{where} (numpy object array)", file=str(p)) from None
        arrays = [loaded] if isinstance(loaded, np.ndarray) else [loaded[k] for k in loaded.files]
        for arr in arrays:
            if arr.dtype.kind in "US":
                flat = [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
                        for x in np.asarray(arr).ravel().tolist()]
                if self.contains_protected(" ".join(flat)):
                    raise PrivacyError(where, file=str(p))

    def check_dir(self, path: str | os.PathLike) -> None:
        """Check every file under ``path`` (recursively) with :meth:`check_file`."""
        if self.allows_text:
            return
        for root, _dirs, files in os.walk(path):
            for name in sorted(files):
                self.check_file(Path(root) / name)

    def check_dataframe(self, df: Any, where: str) -> None:
        """Check a pandas DataFrame: column names, and string cells of every column.

        Restricted corpora: a text column is refused if any cell contains protected text or is
        free text (at least :data:`FREE_TEXT_WORDS` words); identifiers and short labels pass.
        """
        if self.allows_text:
            return
        for col in df.columns:
            self.check_text(str(col), f"{where} column name")
            series = df[col]
            if series.dtype.kind in "biufcmM":
                continue
            cells = [v for v in series.tolist() if isinstance(v, str)]
            for cell in cells:
                if len(tokens(cell)) >= FREE_TEXT_WORDS:  # label codes are not words here
                    raise PrivacyError(f"{where} column {col!r} (free-text column)")
            if cells:
                self.check_text("\n".join(cells), f"{where} column {col!r}")


def _json_strings(text: str, *, jsonl: bool) -> Iterator[str]:
    """Every string (keys and values) of a JSON or JSONL document, in document order."""
    docs: list[Any] = []
    try:
        if jsonl:
            docs = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            docs = [json.loads(text)]
    except json.JSONDecodeError:
        return
    stack: list[Any] = list(reversed(docs))
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for k, v in reversed(list(item.items())):
                stack.append(v)
                stack.append(k)
        elif isinstance(item, list):
            stack.extend(reversed(item))
