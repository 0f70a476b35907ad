"""ICD-10-CM coding (the reference task) as a :class:`~mistill.tasks.base.Task`.

The module also holds the code rules :mod:`mistill.instrument.events` re-exports, so the events
of :func:`~mistill.instrument.events.extract_events` are unchanged:

* a mention is an inventory code in dotted form written as a whole token
  (:func:`find_mentions`);
* P1 is the chapter letter (the code's first character); the dot is never scored;
* P2C relates codes of one category (the first three characters);
* item-like spans are the inventory mentions plus any run shaped like an ICD-10-CM code;
* the answer is the last JSON list after ``</think>`` restricted to inventory codes
  (:func:`mistill.evaluation.parsing.parse_answer`), scored by set precision / recall / F1 and
  P@8 / P@15 (:mod:`mistill.evaluation.metrics`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Mapping, Sequence

from mistill.data.inventory import Inventory
from mistill.errors import MistillInputError
from mistill.evaluation.metrics import precision_at_k
from mistill.evaluation.parsing import CodeIndex, parse_answer
from mistill.tasks.base import Mention, Span, Task, set_scores

__all__ = ["ICD10Task", "dotted_code", "normalise_codes", "find_mentions"]

# Maximal runs of (unicode) alphanumerics joined by single dots: the unit a mention must equal.
_RUN = re.compile(r"[^\W_]+(?:\.[^\W_]+)*")
# Anything shaped like an ICD-10-CM code, dotted or not: never prose for NULL placement.
_CODE_SHAPE = re.compile(r"[A-Z][0-9][0-9A-Z](?:\.?[0-9A-Z]{1,4})?")


def dotted_code(code: str) -> str:
    """``N189`` -> ``N18.9``; dotted codes and codes of at most three characters are kept."""
    code = code.strip()
    if "." in code or len(code) <= 3:
        return code
    return f"{code[:3]}.{code[3:]}"


def normalise_codes(codes: Collection[str], *, note_id: str | None = None) -> tuple[str, ...]:
    """Dotted, de-duplicated, sorted inventory. Raises on an empty or malformed list."""
    if isinstance(codes, str):
        raise MistillInputError("codes must be a collection of codes, not one string",
                                note=note_id, field="codes")
    out = set()
    for c in codes:
        if not isinstance(c, str) or not c.strip():
            raise MistillInputError(f"bad inventory code {c!r}", note=note_id, field="codes")
        d = dotted_code(c)
        if _RUN.fullmatch(d) is None:
            raise MistillInputError(f"inventory code {c!r} is not alphanumerics joined by dots",
                                    note=note_id, field="codes")
        out.add(d)
    if not out:
        raise MistillInputError("empty code inventory", note=note_id, field="codes")
    return tuple(sorted(out))


def find_mentions(text: str, codes: Collection[str], *, start: int = 0,
                  end: int | None = None) -> list[tuple[str, int, int]]:
    """``(code, start, end)`` of every whole-token dotted mention of an inventory code in
    ``text[start:end]`` (offsets are into ``text``), in text order. ``codes`` must already be
    dotted (see :func:`normalise_codes`)."""
    code_set = set(codes)
    end = len(text) if end is None else end
    return [(m.group(), m.start(), m.end()) for m in _RUN.finditer(text, start, end)
            if m.group() in code_set]


def _code_like_spans(trace: str, code_set: set[str]) -> list[Span]:
    return [(m.start(), m.end()) for m in _RUN.finditer(trace)
            if m.group() in code_set or _CODE_SHAPE.fullmatch(m.group())]


class ICD10Task(Task):
    """ICD-10-CM codes. ``inventory``: an :class:`Inventory`, a mapping code -> description, or
    None (the billable ICD-10-CM list, loaded when first needed by :attr:`items` or
    :meth:`parse_answer`)."""

    name = "icd10"
    has_p1 = True
    unscored_chars = frozenset(".")

    def __init__(self, inventory: Inventory | Mapping[str, str] | None = None) -> None:
        super().__init__()
        self._inventory = inventory

    @functools.cached_property
    def _descriptions(self) -> Mapping[str, str]:
        if self._inventory is None:
            return Inventory.billable().descriptions
        if isinstance(self._inventory, Inventory):
            return self._inventory.descriptions
        return dict(self._inventory)

    @property
    def items(self) -> Mapping[str, str]:
        return self._descriptions

    @functools.cached_property
    def _index(self):
        return CodeIndex(list(self._descriptions))

    def normalise_items(self, items: Collection[str], *, note_id: str | None = None) -> tuple[str, ...]:
        return normalise_codes(items, note_id=note_id)

    def find_mentions(self, text: str, items: Collection[str], start: int = 0,
                      end: int | None = None) -> list[Mention]:
        return find_mentions(text, items, start=start, end=end)

    def related(self, a: str, b: str) -> bool:
        """Siblings: one three-character category."""
        return a[:3] == b[:3]

    def p1_target(self, item: str) -> str | None:
        return item[0]

    def null_choices(self, items: Collection[str]) -> tuple[str, ...]:
        """The inventory's chapter letters (fewer than two: no NULL events)."""
        return tuple(sorted({c[0] for c in items}))

    def item_like_spans(self, trace: str, items: Collection[str]) -> list[Span]:
        return _code_like_spans(trace, set(items))

    def parse_answer(self, generation: str) -> tuple[str, ...]:
        return parse_answer(generation, self._index).codes

    def metric(self, gold: Sequence[str], pred: Sequence[str]) -> dict[str, float]:
        """Set counts, precision, recall, F1 and P@8 / P@15 of one note."""
        out = set_scores(gold, pred)
        out.update({f"p_at_{k}": precision_at_k(list(pred), gold, k) for k in (8, 15)})
        return out
