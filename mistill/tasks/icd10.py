"""ICD-10-CM coding (the reference task) as a :class:`~mistill.tasks.base.Task`.

Every rule delegates to the code that defined it before the task interface existed, so the
events of :func:`~mistill.instrument.events.extract_events` are unchanged:

* a mention is an inventory code in dotted form written as a whole token
  (:func:`mistill.instrument.events.find_mentions`);
* P1 is the chapter letter (the code's first character); the dot is never scored;
* P2C relates codes of one category (the first three characters);
* item-like spans are the inventory mentions plus any run shaped like an ICD-10-CM code;
* the answer is the last JSON list after ``</think>`` restricted to inventory codes
  (:func:`mistill.evaluation.parsing.parse_answer`), scored by set precision / recall / F1 and
  P@8 / P@15 (:mod:`mistill.evaluation.metrics`).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence

from mistill.data.inventory import Inventory
from mistill.tasks.base import Mention, Span, Task, set_scores

__all__ = ["ICD10Task"]


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
        from mistill.evaluation.parsing import CodeIndex

        return CodeIndex(list(self._descriptions))

    def normalise_items(self, items: Collection[str], *, note_id: str | None = None) -> tuple[str, ...]:
        from mistill.instrument.events import normalise_codes

        return normalise_codes(items, note_id=note_id)

    def find_mentions(self, text: str, items: Collection[str], start: int = 0,
                      end: int | None = None) -> list[Mention]:
        from mistill.instrument.events import find_mentions

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
        from mistill.instrument.events import _code_like_spans

        return _code_like_spans(trace, set(items))

    def parse_answer(self, generation: str) -> tuple[str, ...]:
        from mistill.evaluation.parsing import parse_answer

        return parse_answer(generation, self._index).codes

    def metric(self, gold: Sequence[str], pred: Sequence[str]) -> dict[str, float]:
        """Set counts, precision, recall, F1 and P@8 / P@15 of one note."""
        from mistill.evaluation.metrics import precision_at_k

        out = set_scores(gold, pred)
        out.update({f"p_at_{k}": precision_at_k(list(pred), gold, k) for k in (8, 15)})
        return out
