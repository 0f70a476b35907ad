"""The label inventory: billable ICD-10-CM diagnosis codes, one prompt line each, one shared order.

The paper (App. A, "The full inventory in context") lists every assignable code as a line
``"<code> <description>"`` in a single order, shuffled once with a fixed seed and shared by every
prompt: the shared order makes the inventory a cacheable prefix and the shuffle removes ICD order
as a positional cue. :class:`Inventory` is that object. It is immutable; ``restrict`` and
``billable(codes=...)`` give sub-inventories.

Code vocabulary used throughout mistill:

- a *code* is written in dotted form, ``N18.9`` (``normalize`` accepts ``N189``, ``n18.9``);
- its *category* is the first three characters (``N18``); codes sharing a category are
  *siblings* (the near-misses of P2C events);
- its *chapter letter* is the first character (``N``); the paper's "chapter" or "region";
- its *block* is the ICD-10-CM block (range of categories, ``N17-N19``) containing the category.

The billable list comes from ``simple-icd-10-cm`` (v1.5.0 ships the April 2026 ICD-10-CM:
74,724 billable codes, ``is_leaf(c) and is_category_or_subcategory(c)``). It is built once per
process and cached: the first call costs the package import (about 2.5 s on the project's CPU
machine, it parses the XML) plus about 0.2 s to filter and describe; later calls are free.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import re
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from mistill.errors import MistillInputError
from mistill.io import read_json, write_json

__all__ = [
    "Inventory",
    "normalize",
    "category",
    "chapter_letter",
    "icd10_block",
    "icd10_chapter",
    "billable_codes",
    "icd10cm_source",
    "as_code_list",
    "undecodable_byte",
    "utf8_lines",
]

INVENTORY_FORMAT = "mistill-inventory/1"

# A letter, then a digit and an alphanumeric or (FY2026 "QA0" codes) a letter and a digit, then
# up to four more characters: accepts the placeholder "X" and seventh characters ("T36.0X1A").
# Lower case is upper-cased first.
_CODE_RE = re.compile(r"^([A-Z](?:[0-9][0-9A-Z]|[A-Z][0-9]))\.?([0-9A-Z]{1,4})?$")

# What ``errors="surrogateescape"`` makes of a byte that is not UTF-8: U+DC80..U+DCFF. Strict
# UTF-8 decoding never yields these code points, so one in a line read that way is a bad byte.
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def undecodable_byte(line: str) -> tuple[int, int] | None:
    """``(byte value, 1-based byte column)`` of the first byte that is not UTF-8 in ``line``
    (read with ``errors="surrogateescape"``), or None when the whole line is UTF-8."""
    m = _ESCAPED_BYTE.search(line)
    if m is None:
        return None
    column = len(line[:m.start()].encode("utf-8", "surrogateescape")) + 1
    return ord(m.group()) - 0xDC00, column


def utf8_lines(path: str | os.PathLike, *, field: str | None = None) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a text file that must be UTF-8 (lines split as text mode does).

    A byte that is not UTF-8 raises :class:`MistillInputError` naming the file, the line, the
    byte and its column (and ``field``), instead of a bare ``UnicodeDecodeError``.
    """
    with Path(path).open(encoding="utf-8", errors="surrogateescape") as fh:
        for lineno, line in enumerate(fh, start=1):
            bad = undecodable_byte(line)
            if bad is not None:
                raise MistillInputError(f"byte 0x{bad[0]:02X} at byte {bad[1]} of the line is not UTF-8",
                                        file=str(path), line=lineno, field=field)
            yield lineno, line


def _shape(code: str) -> str | None:
    """Dotted form of ``code`` if it has the shape of an ICD-10-CM code, else None."""
    if not isinstance(code, str):
        return None
    m = _CODE_RE.match(code.strip().upper())
    if m is None:
        return None
    head, tail = m.group(1), m.group(2)
    return f"{head}.{tail}" if tail else head


def normalize(code: str, *, strict: bool = True) -> str:
    """Canonical dotted form of a code: ``"N189"``, ``"n18.9"``, ``" N18.9 "`` -> ``"N18.9"``.

    strict: raise :class:`MistillInputError` when ``code`` is malformed or is not a billable
    ICD-10-CM code (checked against ``simple-icd-10-cm``). Not strict: never raise; a code with
    the right shape comes back dotted, anything else comes back stripped and upper-cased (so a
    membership test against an inventory simply fails).
    """
    dotted = _shape(code)
    if dotted is None:
        if strict:
            raise MistillInputError(f"malformed ICD-10-CM code {code!r}", field="code")
        return code.strip().upper() if isinstance(code, str) else str(code)
    if strict and dotted not in _billable_set():
        raise MistillInputError(f"{dotted!r} is not a billable ICD-10-CM diagnosis code "
                                f"({icd10cm_source()})", field="code")
    return dotted


def category(code: str) -> str:
    """Three-character category of a dotted code: ``"N18.9"`` -> ``"N18"``."""
    return code[:3]


def chapter_letter(code: str) -> str:
    """Chapter letter (first character) of a code: ``"N18.9"`` -> ``"N"``."""
    return code[:1]


# ---------------------------------------------------------------------------------------------
# simple-icd-10-cm access (imported lazily: the import parses the full XML, ~2.5 s)
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _icd():
    with warnings.catch_warnings():  # its data loading uses deprecated importlib.resources calls
        warnings.simplefilter("ignore", DeprecationWarning)
        import simple_icd_10_cm  # deferred: the ICD-10-CM list package, only when the list is read

        simple_icd_10_cm.is_valid_item("A00.0")  # data are loaded on first use
    return simple_icd_10_cm


@functools.lru_cache(maxsize=1)
def icd10cm_source() -> str:
    """Where the billable list comes from, e.g. ``"simple-icd-10-cm 1.5.0"`` (recorded in JSON)."""
    try:
        return f"simple-icd-10-cm {version('simple-icd-10-cm')}"
    except PackageNotFoundError:  # pragma: no cover - installed as a dependency
        return "simple-icd-10-cm (unknown version)"


@functools.lru_cache(maxsize=1)
def _billable_table() -> tuple[tuple[str, str], ...]:
    """Sorted ``(code, description)`` pairs of every billable ICD-10-CM code."""
    icd = _icd()
    # get_all_codes lists a name twice when a block and its only category share it (B20).
    billable = {c for c in icd.get_all_codes(True)
                if icd.is_leaf(c) and icd.is_category_or_subcategory(c)}
    return tuple((c, icd.get_description(c)) for c in sorted(billable))


@functools.lru_cache(maxsize=1)
def _billable_set() -> frozenset[str]:
    return frozenset(c for c, _ in _billable_table())


@functools.lru_cache(maxsize=1)
def _billable_descriptions() -> Mapping[str, str]:
    return types.MappingProxyType(dict(_billable_table()))


def billable_codes() -> tuple[str, ...]:
    """All billable ICD-10-CM codes, sorted (74,724 in simple-icd-10-cm 1.5.0)."""
    return tuple(c for c, _ in _billable_table())


@functools.lru_cache(maxsize=None)
def icd10_block(code: str) -> str:
    """The ICD-10-CM block containing the code's category, e.g. ``"N18.9"`` -> ``"N17-N19"``.

    Read from ``simple_icd_10_cm.get_ancestors``: the ancestor just below the chapter (a few
    single-category blocks carry the category's own name, e.g. ``B10``).
    """
    dotted = _shape(code)
    icd = _icd()
    if dotted is None or not icd.is_valid_item(dotted):
        raise MistillInputError(f"{code!r} is not an ICD-10-CM code; its block is unknown",
                                field="code")
    ancestors = icd.get_ancestors(dotted)
    if len(ancestors) < 2:
        raise MistillInputError(f"{code!r} has no block above it", field="code")
    return ancestors[-2]


@functools.lru_cache(maxsize=None)
def icd10_chapter(code: str) -> str:
    """The true ICD-10-CM chapter number (``"14"`` for N18.9), one of 22 (not the letter)."""
    dotted = _shape(code)
    icd = _icd()
    if dotted is None or not icd.is_valid_item(dotted):
        raise MistillInputError(f"{code!r} is not an ICD-10-CM code; its chapter is unknown",
                                field="code")
    return icd.get_ancestors(dotted)[-1]


@functools.lru_cache(maxsize=8)
def _cached_full(order_seed: int) -> "Inventory":
    codes = list(billable_codes())
    random.Random(order_seed).shuffle(codes)
    return Inventory(codes=tuple(codes), descriptions=_billable_descriptions(),
                     order_seed=order_seed, source=icd10cm_source())


# ---------------------------------------------------------------------------------------------
# Inventory
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Inventory:
    """An ordered, immutable list of assignable codes with their descriptions.

    codes: the prompt order (a seeded shuffle of the sorted codes for ``billable``).
    descriptions: code -> description, for every code in ``codes`` (read-only mapping).
    order_seed: the seed of the shuffle (recorded; ``restrict`` keeps the parent's order).
    source: where the descriptions came from (free text, recorded in ``inventory.json``).
    task: the label space's task (:func:`mistill.tasks.task_for`): ``icd10`` (ICD-10-CM codes),
        ``catalog`` (the embedded parts catalogue) or ``eurlex57k`` (EuroVoc labels); recorded in
        ``inventory.json``.
    relations: code -> its broader codes, for a label space whose structural relation is a
        hierarchy the codes do not spell (EuroVoc); empty for the others. Recorded in
        ``inventory.json`` and in the digest when not empty.

    Equality and hashing follow ``digest`` (the sha256 of the ordered lines).
    """

    codes: tuple[str, ...]
    descriptions: Mapping[str, str]
    order_seed: int = 0
    source: str = ""
    task: str = "icd10"
    relations: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        codes = tuple(self.codes)
        object.__setattr__(self, "codes", codes)
        index: dict[str, int] = {}
        for i, c in enumerate(codes):
            if not isinstance(c, str) or not c or c != c.strip():
                raise MistillInputError(f"inventory code {c!r} is not a clean string",
                                        field="codes")
            if c in index:
                raise MistillInputError(f"inventory lists {c!r} twice", field="codes")
            index[c] = i
        if not codes:
            raise MistillInputError("an inventory needs at least one code", field="codes")
        if not isinstance(self.task, str) or not self.task:
            raise MistillInputError(f"inventory task {self.task!r} must name a task", field="task")
        desc = self.descriptions
        missing = [c for c in codes if c not in desc]
        if missing:
            raise MistillInputError(f"no description for {missing[0]!r} "
                                    f"({len(missing)} codes lack one)", field="descriptions")
        for c in codes:
            d = desc[c]
            if not isinstance(d, str) or "\n" in d:
                raise MistillInputError(f"description of {c!r} must be a one-line string",
                                        field="descriptions")
        # Keep only this inventory's codes, read-only (the full billable table is shared).
        if len(desc) != len(codes):
            desc = {c: desc[c] for c in codes}
        if not isinstance(desc, types.MappingProxyType):
            desc = types.MappingProxyType(dict(desc))
        object.__setattr__(self, "descriptions", desc)
        object.__setattr__(self, "_index", index)
        relations: dict[str, tuple[str, ...]] = {}
        for c, broader in dict(self.relations).items():
            unknown = [x for x in (c, *broader) if x not in index]
            if unknown or isinstance(broader, str):
                raise MistillInputError(f"relation {c!r} -> {broader!r} names {unknown[0] if unknown else broader!r}, "
                                        "not a list of inventory codes", field="relations")
            if broader:
                relations[c] = tuple(dict.fromkeys(broader))
        object.__setattr__(self, "relations", types.MappingProxyType(relations))

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def billable(cls, order_seed: int = 0, codes: Iterable[str] | None = None) -> "Inventory":
        """The billable ICD-10-CM inventory, shuffled with ``random.Random(order_seed)``.

        codes: restrict to these codes (dotted or undotted; duplicates collapse), e.g. the 5,651
        MIMIC-IV diagnosis codes. The order is then the seeded shuffle of the *sorted* restricted
        list. A code that is not a billable ICD-10-CM code raises :class:`MistillInputError`
        naming it. The full inventory (``codes=None``) is cached per seed.
        """
        if codes is None:
            return _cached_full(int(order_seed))
        chosen = sorted(_normalize_many(codes))
        random.Random(order_seed).shuffle(chosen)
        return cls(codes=tuple(chosen), descriptions=_billable_descriptions(),
                   order_seed=int(order_seed), source=icd10cm_source())

    @classmethod
    def from_code_file(cls, path: str | os.PathLike, order_seed: int = 0) -> "Inventory":
        """Billable inventory restricted to the codes of a text file, one code per line.

        Dotted or undotted codes; blank lines and lines starting with ``#`` are skipped. An
        unknown code, or a byte that is not UTF-8, raises :class:`MistillInputError` naming the
        file, the line and the code (or byte).
        """
        p = Path(path)
        if not p.exists():
            raise MistillInputError("code file not found", file=str(p))
        codes: list[str] = []
        for lineno, raw in utf8_lines(p, field="code"):
            s = raw.strip()
            if not s or s.startswith("#"):
                continue
            dotted = _shape(s)
            if dotted is None or dotted not in _billable_set():
                what = "malformed code" if dotted is None else "not a billable ICD-10-CM code"
                raise MistillInputError(f"{s!r}: {what} ({icd10cm_source()})", file=str(p),
                                        line=lineno, field="code")
            codes.append(dotted)
        if not codes:
            raise MistillInputError("code file lists no codes", file=str(p))
        return cls.billable(order_seed=order_seed, codes=codes)

    def restrict(self, codes: Iterable[str]) -> "Inventory":
        """Sub-inventory with only ``codes``, in *this* inventory's order (same ``order_seed``).

        Codes are normalised; one not in this inventory raises :class:`MistillInputError`.
        """
        keep = {self.normalize(c) for c in codes}
        if not keep:
            raise MistillInputError("restrict() needs at least one code", field="codes")
        kept = tuple(c for c in self.codes if c in keep)
        relations = {c: tuple(b for b in self.relations[c] if b in keep) for c in kept if c in self.relations}
        return Inventory(codes=kept, descriptions=self.descriptions, order_seed=self.order_seed,
                         source=self.source, task=self.task, relations=relations)

    # -- lookups ------------------------------------------------------------------------------

    def normalize(self, code: str, *, strict: bool = True) -> str:
        """Dotted form of ``code``; strict: raise unless the code is in this inventory."""
        if isinstance(code, str) and code in self._index:
            return code
        dotted = normalize(code, strict=False)
        if strict and dotted not in self._index:
            raise MistillInputError(f"code {code!r} is not in the inventory "
                                    f"({len(self)} codes)", field="code")
        return dotted

    def __contains__(self, code: object) -> bool:
        if not isinstance(code, str):
            return False
        return code in self._index or normalize(code, strict=False) in self._index

    def __len__(self) -> int:
        return len(self.codes)

    def __iter__(self) -> Iterator[str]:
        return iter(self.codes)

    def index(self, code: str) -> int:
        """Position of ``code`` in the prompt order."""
        return self._index[self.normalize(code)]

    def description(self, code: str) -> str:
        return self.descriptions[self.normalize(code)]

    def line(self, code: str) -> str:
        """The prompt line of ``code``: ``"<code> <description>"``."""
        c = self.normalize(code)
        return f"{c} {self.descriptions[c]}"

    def lines(self) -> list[str]:
        """Every prompt line, in the inventory order."""
        d = self.descriptions
        return [f"{c} {d[c]}" for c in self.codes]

    category = staticmethod(category)
    chapter_letter = staticmethod(chapter_letter)

    @functools.cached_property
    def _by_category(self) -> Mapping[str, tuple[str, ...]]:
        groups: dict[str, list[str]] = {}
        for c in self.codes:
            groups.setdefault(category(c), []).append(c)
        return types.MappingProxyType({k: tuple(v) for k, v in groups.items()})

    def siblings(self, code: str) -> tuple[str, ...]:
        """The other inventory codes of ``code``'s category, in inventory order.

        ``code`` need not be in the inventory (its category is what matters)."""
        c = normalize(code, strict=False)
        return tuple(x for x in self._by_category.get(category(c), ()) if x != c)

    def categories(self) -> tuple[str, ...]:
        """Categories present, in order of first appearance in the inventory order."""
        return tuple(self._by_category)

    def codes_in_category(self, cat: str) -> tuple[str, ...]:
        return self._by_category.get(cat, ())

    @functools.cached_property
    def letters(self) -> tuple[str, ...]:
        """Sorted chapter letters used by the inventory (26 for the full billable list)."""
        return tuple(sorted({chapter_letter(c) for c in self.codes}))

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of the ordered prompt lines joined by newlines (then the relations, one line
        each in inventory order, when there are any)."""
        lines = self.lines()
        if self.relations:
            lines += ["", *(f"{c} < {' | '.join(self.relations[c])}" for c in self.codes if c in self.relations)]
        return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Inventory):
            return NotImplemented
        return self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return (f"Inventory({len(self)} codes, {len(self.letters)} letters, "
                f"order_seed={self.order_seed}, digest={self.digest[:12]})")

    # -- persistence --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": INVENTORY_FORMAT,
            "order_seed": self.order_seed,
            "source": self.source,
            "task": self.task,
            "n_codes": len(self),
            "digest": self.digest,
            "codes": list(self.codes),
            "descriptions": {c: self.descriptions[c] for c in self.codes},
            **({"relations": {c: list(self.relations[c]) for c in self.codes if c in self.relations}}
               if self.relations else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, file: str | None = None) -> "Inventory":
        if not isinstance(data, Mapping):
            raise MistillInputError("inventory JSON must be an object", file=file)
        if data.get("format") != INVENTORY_FORMAT:
            raise MistillInputError(f"unknown inventory format {data.get('format')!r}, "
                                    f"expected {INVENTORY_FORMAT!r}", file=file, field="format")
        for key, typ in (("codes", list), ("descriptions", dict), ("order_seed", int)):
            if not isinstance(data.get(key), typ):
                raise MistillInputError(f"missing or mistyped field (expected {typ.__name__})",
                                        file=file, field=key)
        try:
            inv = cls(codes=tuple(data["codes"]), descriptions=dict(data["descriptions"]),
                      order_seed=data["order_seed"], source=str(data.get("source", "")),
                      task=str(data.get("task", "icd10")),
                      relations=dict(data.get("relations") or {}))
        except MistillInputError as exc:
            raise MistillInputError(exc.args[0], file=file, field=exc.field) from None
        if "digest" in data and data["digest"] != inv.digest:
            raise MistillInputError("inventory digest does not match its lines (edited file?)",
                                    file=file, field="digest")
        return inv

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write ``inventory.json`` atomically (codes in order, descriptions, seed, digest)."""
        return write_json(path, self.to_dict(), indent=None)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Inventory":
        """Read ``inventory.json``; a digest that does not match the lines is an error."""
        return cls.from_dict(read_json(path), file=str(path))


def _normalize_many(codes: Iterable[str]) -> set[str]:
    if isinstance(codes, str):
        raise TypeError("codes must be an iterable of code strings, not one string")
    out: set[str] = set()
    for c in codes:
        out.add(normalize(c, strict=True))
    if not out:
        raise MistillInputError("an inventory needs at least one code", field="codes")
    return out


def as_code_list(codes: Sequence[str] | None, inventory: Inventory) -> tuple[str, ...]:
    """Normalise a candidate list against ``inventory`` (None -> the whole inventory order)."""
    if codes is None:
        return inventory.codes
    out = tuple(inventory.normalize(c) for c in codes)
    if len(set(out)) != len(out):
        seen: set[str] = set()
        dup = next(c for c in out if c in seen or seen.add(c))
        raise MistillInputError(f"candidate list names {dup!r} twice", field="candidate_codes")
    return out
