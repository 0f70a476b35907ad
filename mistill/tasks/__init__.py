"""Task adapters: the label spaces the instrument's event extraction runs on.

:func:`task` returns a registered task by name:

* ``icd10``: ICD-10-CM coding, the reference task (:mod:`mistill.tasks.icd10`);
* ``musique``: MuSiQue-Ans answer emission (:mod:`mistill.tasks.musique`);
* ``eurlex57k``: EuroVoc labelling of EU acts (:mod:`mistill.tasks.eurlex`);
* ``bigcodebench``: qualified API namings in code generation (:mod:`mistill.tasks.bigcodebench`);
* ``catalog``: the embedded synthetic parts catalogue (:mod:`mistill.tasks.synthetic_catalog`).

Keyword arguments go to the task's constructor (an ICD-10-CM inventory, EuroVoc concepts and
hierarchy, a BigCodeBench problem's aliases, a catalogue). The interface is
:class:`mistill.tasks.base.Task`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mistill.data.prompts import ICD10_WORDING, PromptWording
from mistill.errors import MistillInputError
from mistill.tasks.base import Task
from mistill.tasks.bigcodebench import BIGCODEBENCH_WORDING, BigCodeBenchTask
from mistill.tasks.eurlex import EURLEX_WORDING, EurlexTask
from mistill.tasks.icd10 import ICD10Task
from mistill.tasks.musique import MUSIQUE_WORDING, MuSiQueTask
from mistill.tasks.synthetic_catalog import CATALOG_WORDING, CatalogTask

__all__ = ["Task", "task", "task_for", "prompt_wording", "note_items", "TASK_NAMES", "INVENTORY_TASKS"]


def _icd10(**kw: Any) -> Task:
    return ICD10Task(**kw)


def _musique(inventory: Any = None, **kw: Any) -> Task:
    # each question's candidates are its note's own (note_items), not the task's
    return MuSiQueTask(**kw)


def _eurlex(inventory: Any = None, **kw: Any) -> Task:
    # a prepared inventory holds the labels, their ids and the hierarchy (EurlexTask.from_inventory)
    return EurlexTask.from_inventory(inventory) if inventory is not None else EurlexTask(**kw)


def _bigcodebench(inventory: Any = None, **kw: Any) -> Task:
    # a prepared corpus's inventory holds every problem's namings; each note binds its own imports (for_note)
    return BigCodeBenchTask(items=inventory.descriptions) if inventory is not None else BigCodeBenchTask(**kw)


def _catalog(**kw: Any) -> Task:
    return CatalogTask(**kw)


_REGISTRY: dict[str, Callable[..., Task]] = {
    "icd10": _icd10, "musique": _musique, "eurlex57k": _eurlex, "bigcodebench": _bigcodebench,
    "catalog": _catalog,
}
TASK_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def task(name: str, **kwargs: Any) -> Task:
    """The task registered as ``name`` (one of :data:`TASK_NAMES`); an unknown name raises
    :class:`MistillInputError` on field ``task``."""
    if name not in _REGISTRY:
        raise MistillInputError(f"unknown task {name!r} (one of {', '.join(TASK_NAMES)})", field="task")
    return _REGISTRY[name](**kwargs)


INVENTORY_TASKS: tuple[str, ...] = ("icd10", "catalog", "eurlex57k", "musique", "bigcodebench")
"""Tasks whose label space ``prepare`` builds as an :class:`~mistill.data.inventory.Inventory`: the
ones the stages run on (``Inventory.task``). EURLEX57K's prompt lists each act's candidate list
(:func:`mistill.tasks.eurlex.load_eurlex_corpus`); MuSiQue-Ans's lists none, each question's
candidates being its note's own (:func:`mistill.tasks.musique.load_musique_corpus`); so does
BigCodeBench's, each problem's API namings its own
(:func:`mistill.tasks.bigcodebench.load_bigcodebench_corpus`)."""

PER_NOTE_ITEMS: frozenset[str] = frozenset({"musique", "bigcodebench"})
"""Tasks whose events are extracted over each note's own candidates (``Note.shortlist``) rather
than the whole inventory: the candidates of a MuSiQue question are its passages' titles and its
answers, a BigCodeBench problem's the API namings of its prompts and reference, not every
question's or problem's."""


def note_items(inventory: Any, note: Any) -> list[str]:
    """The items ``note``'s events are extracted over: its own candidates for a task of
    :data:`PER_NOTE_ITEMS`, else the inventory's codes. A note of such a task without candidates
    raises, naming the note and the field."""
    if getattr(inventory, "task", "icd10") not in PER_NOTE_ITEMS:
        return list(inventory.codes)
    if not note.shortlist:
        raise MistillInputError("the note has no candidates to extract its events over", note=note.note_id,
                                field="shortlist")
    return list(note.shortlist)


def task_for(inventory: Any) -> Task:
    """The task of a prepared corpus's inventory (``inventory.task``), built on that inventory."""
    name = getattr(inventory, "task", "icd10")
    if name not in INVENTORY_TASKS:
        raise MistillInputError(f"the inventory's task {name!r} has no stages (one of {', '.join(INVENTORY_TASKS)})",
                                field="task")
    return task(name, inventory=inventory)


def prompt_wording(name: str) -> PromptWording:
    """The prompt sentences of an inventory task (:class:`mistill.data.prompts.PromptWording`)."""
    if name not in INVENTORY_TASKS:
        raise MistillInputError(f"task {name!r} has no prompt wording", field="task")
    return {"icd10": ICD10_WORDING, "catalog": CATALOG_WORDING, "eurlex57k": EURLEX_WORDING,
            "musique": MUSIQUE_WORDING, "bigcodebench": BIGCODEBENCH_WORDING}[name]
