"""The task interface: what the instrument's event extraction needs to know about a label space.

:func:`mistill.instrument.events.extract_events` is written once for every label space. What
differs between tasks is small and lives in a :class:`Task`:

* what a *mention* (a naming of an item) is in text: :meth:`Task.find_mentions`, character
  offsets, tokenizer-independent. The written form of a mention may differ from the item (an
  import alias, a capitalised first letter): the extractor places an event on the written text
  only where the written form and the item share the rest of the naming (see
  :func:`mistill.instrument.events.extract_events`);
* whether there is a region-level decision (P1): :attr:`Task.has_p1` and
  :meth:`Task.p1_target` (ICD-10-CM: the chapter letter). Without one, every trie-divergent
  character of a first naming is a P2 event, the first character included;
* the structural relation under which a later naming is contrasted with an earlier one (P2C):
  :meth:`Task.related`;
* which spans of a trace are item-like and so never prose for NULL placement:
  :meth:`Task.item_like_spans`;
* how an answer is read from a generation and scored: :meth:`Task.parse_answer`,
  :meth:`Task.metric`.

P2 events use one character trie over the items for every task: the characters of an item are
its characters, whatever the label space.
"""

from __future__ import annotations

import re
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from mistill.errors import MistillInputError
from mistill.evaluation.metrics import prf_from_counts, set_counts
from mistill.evaluation.parsing import Answer, CodeIndex, parse_answer, reasoning_closed, split_reasoning
from mistill.io import iter_jsonl

AnswerReader = Callable[..., Answer]
"""``reader(generation, capped=False) -> Answer``: how the stages read a generation's answer."""

__all__ = ["Task", "AnswerReader", "Span", "Mention", "Record", "record_id", "read_traces", "whole_word_mentions", "set_scores",
           "answer_part", "THINK_CLOSE"]

Span = tuple[int, int]
Mention = tuple[str, int, int]

THINK_CLOSE = "</think>"


class Task(ABC):
    """One label space as the instrument sees it.

    Attributes:
        name: the registry name (``icd10``, ``musique``, ...).
        has_p1: whether the first character of a first naming is a region-level decision
            (P1) with :meth:`p1_target` as its target.
        unscored_chars: characters never scored as a P2/P2C target (whitespace never is: an
            event's anchor is a non-blank character). ICD-10-CM: the dot.
        items: the task-level inventory, item -> description (may be empty for tasks whose
            candidates are given per record, e.g. MuSiQue's passages).
        word_items: items are written in words a tokenizer keeps whole (EuroVoc labels): a
            divergence's competitors are the alternative items' own first tokens, not a
            one-character substitution (:func:`mistill.instrument.events.realize_events`).
    """

    name: str = ""
    has_p1: bool = False
    unscored_chars: frozenset[str] = frozenset()
    word_items: bool = False

    def __init__(self, items: Mapping[str, str] | None = None) -> None:
        self._items: Mapping[str, str] = MappingProxyType(dict(items or {}))

    @property
    def items(self) -> Mapping[str, str]:
        return self._items

    def item_text(self, item: str) -> str:
        """The description of ``item`` (empty when the task has none)."""
        return self.items.get(item, "")

    # -- the label space ---------------------------------------------------------------------

    def normalise_items(self, items: Collection[str], *, note_id: str | None = None) -> tuple[str, ...]:
        """The inventory as the extractor uses it: stripped, de-duplicated, sorted. An empty list
        or a non-string item raises :class:`MistillInputError` (field ``codes``)."""
        if isinstance(items, str):
            raise MistillInputError("items must be a collection of items, not one string",
                                    note=note_id, field="codes")
        out: set[str] = set()
        for it in items:
            if not isinstance(it, str) or not it.strip():
                raise MistillInputError(f"bad inventory item {it!r}", note=note_id, field="codes")
            out.add(it.strip())
        if not out:
            raise MistillInputError("empty item inventory", note=note_id, field="codes")
        return tuple(sorted(out))

    @abstractmethod
    def find_mentions(self, text: str, items: Collection[str], start: int = 0,
                      end: int | None = None) -> list[Mention]:
        """``(item, start, end)`` of every naming of an item in ``text[start:end]`` (offsets into
        ``text``), in text order. ``text[start:end]`` of a mention is its written form."""

    @abstractmethod
    def related(self, a: str, b: str) -> bool:
        """Whether an earlier naming of ``b`` is a near-miss for a naming of ``a`` (P2C)."""

    def for_note(self, note: object) -> "Task":
        """The task as one note's events see it: itself, unless the task binds something of the
        note (BigCodeBench: the imports of the problem's prompt as aliases)."""
        return self

    @property
    def phases(self) -> tuple[str, ...]:
        """The decision phases the task's events can have, the pools a distillation builds: P1
        where there is a region-level decision, P2, and P2C where items are related."""
        return (("P1",) if self.has_p1 else ()) + ("P2", "P2C")

    def p1_target(self, item: str) -> str | None:
        """The region-level decision character of ``item`` (its first character), or None."""
        return None

    def null_choices(self, items: Collection[str]) -> tuple[str, ...]:
        """Targets drawn for NULL events (random letters; the other choices are the
        competitors): the distinct first characters of the items that are letters or digits,
        or the 26 capital letters when fewer than two exist."""
        firsts = sorted({it[0] for it in items if it and it[0].isalnum()})
        return tuple(firsts) if len(firsts) >= 2 else tuple(string.ascii_uppercase)

    def item_like_spans(self, trace: str, items: Collection[str]) -> list[Span]:
        """Spans of ``trace`` that look like an item (never prose for NULL placement), sorted
        and non-overlapping. Default: the mentions of the items."""
        return _merge([(s, e) for _, s, e in self.find_mentions(trace, items)])

    # -- answers -----------------------------------------------------------------------------

    @abstractmethod
    def parse_answer(self, generation: str) -> tuple[str, ...]:
        """The answer of a generation (empty when there is none or the generation is invalid)."""

    def answer_index(self, codes: Collection[str]) -> CodeIndex:
        """The lookup the stages parse a generation's answer entries with
        (:func:`mistill.evaluation.parsing.parse_answer`), over a prepared inventory's ``codes``:
        the entries the task's own answer reader accepts. Default: the codes as written."""
        return CodeIndex(codes)

    def answer_reader(self, codes: Collection[str]) -> AnswerReader:
        """How the stages read a generation's answer (validity, the answer's entries, the flags of
        :class:`mistill.evaluation.parsing.Answer`) for a prepared inventory's ``codes``. Default:
        the shared JSON-list parser over :meth:`answer_index`."""
        index = self.answer_index(codes)

        def read(generation: str, capped: bool = False) -> Answer:
            return parse_answer(generation, index, capped=capped)
        return read

    def execute_answers(self, notes: Sequence[object], generations: Sequence[str]) -> list[str] | None:
        """The terminal outcome of running each generation's answer against its note's tests
        (:data:`mistill.evaluation.sandbox.OUTCOMES`; BigCodeBench's pass@1), or None for a task
        whose answers are not executed."""
        return None

    def retrieval_ranking(self, text: str, candidates: Sequence[str]) -> tuple[str, ...] | None:
        """``candidates`` ordered by a retrieval baseline's score against an input's ``text``, best
        first, or None for a task without such a baseline (App. P sets the top-5 of a retrieval
        ranking beside the EURLEX teacher's native micro-F1)."""
        return None

    set_valued: bool = True
    """Whether an answer is a set of items scored by set counts (micro-F1); False for a task whose
    answer is one string scored by :meth:`metric` (MuSiQue-Ans: answer EM and F1)."""

    @abstractmethod
    def metric(self, gold: Sequence[str], pred: Sequence[str]) -> dict[str, float]:
        """The task metric of one record's prediction against its gold answer."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, {len(self.items)} items)"


# ------------------------------------------------------------------------------------ helpers

def _merge(spans: Iterable[Span]) -> list[Span]:
    out: list[Span] = []
    for s, e in sorted(spans):
        if out and s < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def whole_word_mentions(text: str, items: Collection[str], start: int = 0, end: int | None = None, *,
                        ignore_case: bool = False) -> list[Mention]:
    """Namings of ``items`` in ``text[start:end]`` as whole words: not preceded or followed by a
    letter, digit or underscore. Where namings overlap, the earliest start wins and, at one
    start, the longest item ("public health policy" over "public health"); the search resumes
    after the chosen naming. With ``ignore_case`` a naming matches an item in any case."""
    end = len(text) if end is None else end
    ordered = sorted({it for it in items if it}, key=lambda s: (-len(s), s))
    if not ordered:
        return []
    flags = re.IGNORECASE if ignore_case else 0
    pattern = re.compile(r"(?<!\w)(?:" + "|".join(re.escape(it) for it in ordered) + r")(?!\w)", flags)
    lookup = {(it.casefold() if ignore_case else it): it for it in reversed(ordered)}
    out: list[Mention] = []
    for m in pattern.finditer(text, start, end):
        key = m.group().casefold() if ignore_case else m.group()
        out.append((lookup[key], m.start(), m.end()))
    return out


def set_scores(gold: Iterable[str], pred: Iterable[str]) -> dict[str, float]:
    """Set counts and precision / recall / F1 of ``pred`` against ``gold`` (the metrics module's
    0/0 convention: empty against empty scores 1.0). The counts let callers pool micro-F1."""
    tp, fp, fn = set_counts(pred, gold)
    p, r, f = prf_from_counts(tp, fp, fn)
    return {"tp": float(tp), "fp": float(fp), "fn": float(fn), "precision": p, "recall": r, "f1": f}


def answer_part(generation: str) -> str | None:
    """The text after the last ``</think>``; the whole generation when it has no think tag; None
    when a reasoning block is opened and not closed (an invalid generation)."""
    if not reasoning_closed(generation):
        return None
    return split_reasoning(generation)[1]


class Record:
    """Checks the fields of one input record, raising :class:`MistillInputError` that names the
    file, the line (JSONL), the record's id and the field."""

    def __init__(self, row: object, *, file: str, line: int | None = None, record: str | None = None,
                 prefix: str = "") -> None:
        self.file, self.line, self.record, self.prefix = file, line, record, prefix
        if not isinstance(row, Mapping):
            raise self.fail(f"expected a JSON object, got {type(row).__name__}", None)
        self.row = row

    def fail(self, message: str, field: str | None) -> MistillInputError:
        """The error for ``field`` (prefixed, e.g. ``paragraphs[3].title``)."""
        name = self.prefix.rstrip(".") if field is None and self.prefix else \
            (None if field is None else self.prefix + field)
        return MistillInputError(message, file=self.file, line=self.line, note=self.record, field=name)

    def text(self, key: str, *, default: str | None = None, allow_empty: bool = True) -> str:
        """A string field (``default`` when absent, if given)."""
        if key not in self.row or self.row[key] is None:
            if default is not None:
                return default
            raise self.fail("missing field", key)
        value = self.row[key]
        if not isinstance(value, str):
            raise self.fail(f"must be a string, got {type(value).__name__}", key)
        if not allow_empty and not value.strip():
            raise self.fail("must be a non-empty string", key)
        return value

    def texts(self, key: str, *, default: Sequence[str] | None = None, ids: bool = False) -> tuple[str, ...]:
        """A list of strings (with ``ids``, integers are accepted and read as strings)."""
        if key not in self.row or self.row[key] is None:
            if default is not None:
                return tuple(default)
            raise self.fail("missing field", key)
        value = self.row[key]
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise self.fail(f"must be a list of strings, got {type(value).__name__}", key)
        out = []
        for v in value:
            if ids and isinstance(v, int) and not isinstance(v, bool):
                v = str(v)
            if not isinstance(v, str):
                raise self.fail(f"entry {v!r} is not a string", key)
            out.append(v)
        return tuple(out)

    def flag(self, key: str, *, default: bool | None = None) -> bool:
        if key not in self.row or self.row[key] is None:
            if default is not None:
                return default
            raise self.fail("missing field", key)
        value = self.row[key]
        if not isinstance(value, bool):
            raise self.fail(f"must be true or false, got {value!r}", key)
        return value

    def integer(self, key: str) -> int:
        if key not in self.row:
            raise self.fail("missing field", key)
        value = self.row[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"must be an integer, got {value!r}", key)
        return value


def jsonl_records(path: str | Path, id_key: str) -> Iterator[tuple[Record, str]]:
    """Each row of a JSONL release file as a :class:`Record` with its id (the field ``id_key``); a
    missing, empty or repeated id raises, naming the file, the line and the field."""
    p = Path(path)
    seen: set[str] = set()
    for lineno, row in iter_jsonl(p):
        rec = Record(row, file=str(p), line=lineno, record=record_id(row, id_key))
        rid = rec.text(id_key, allow_empty=False)
        if rid in seen:
            raise rec.fail(f"duplicate {id_key}", id_key)
        seen.add(rid)
        yield rec, rid


def read_traces(path: str | Path, id_key: str, known: Collection[str], what: str) -> dict[str, str]:
    """Teacher traces made elsewhere: JSONL rows ``{<id_key>, "trace"}`` -> ``{id: trace}``. A trace
    whose id is not in ``known`` (a ``what`` the release does not hold), a missing or repeated id
    and an empty trace raise, naming the file, the record and the field."""
    known = set(known)
    traces: dict[str, str] = {}
    for rec, rid in jsonl_records(path, id_key):
        if rid not in known:
            raise MistillInputError(f"a trace for {what} the release does not hold", file=str(path), note=rid,
                                    field=id_key)
        traces[rid] = rec.text("trace", allow_empty=False)
    return traces


def record_id(row: object, key: str) -> str | None:
    """The id a record names itself by, for error messages (None when it has none)."""
    if isinstance(row, Mapping) and isinstance(row.get(key), (str, int)) and not isinstance(row.get(key), bool):
        return str(row[key])
    return None
