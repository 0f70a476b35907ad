"""A note as one model reads it, and its decision events as queries.

:func:`note_input` builds the prompt in the model's chat template and tokenizes prompt + trace
once; :func:`phase_events` realizes the trace's decision events in that tokenizer, and
:func:`event_queries` turns them into the queries the passes read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mistill.data.corpus import Note
from mistill.data.inventory import Inventory
from mistill.data.prompts import Prompt, build_prompt
from mistill.errors import MistillInputError
from mistill.instrument.events import RealizedEvent, extract_events, realize_events
from mistill.instrument.passes import EventQuery, stable_seed
from mistill.instrument.patching import Query
from mistill.tasks import prompt_wording


@dataclass
class NoteInput:
    """A note as one model sees it: prompt, trace, full text and its token ids and offsets."""

    note: Note
    prompt: Prompt
    trace: str
    full_text: str
    input_ids: torch.Tensor  # [pos]
    offsets: list[tuple[int, int]]

    @property
    def trace_offset(self) -> int:
        return self.prompt.trace_offset


def note_input(note: Note, inventory: Inventory, tokenizer, *, candidates: Sequence[str] | None = None,
               trace: str | None = None, remove_discharge_diagnosis: bool = True,
               narrow_instruction: bool = True, max_positions: int | None = None) -> NoteInput:
    """Build the prompt (chat template of ``tokenizer``) and tokenize prompt + trace once.

    candidates: the lines to list; None lists the note's retrieved shortlist when it has one
    (``Note.shortlist``, set by the ``shortlist`` stage), else the whole inventory.
    """
    trace = note.teacher_trace if trace is None else trace
    if not trace:
        raise MistillInputError("note has no teacher trace", note=note.note_id, field="teacher_trace")
    if candidates is None:
        candidates = note.shortlist
    prompt = build_prompt(note, candidates, inventory, tokenizer,
                          remove_discharge_diagnosis=remove_discharge_diagnosis,
                          narrow_instruction=narrow_instruction, wording=prompt_wording(inventory.task))
    full = prompt.full_text(trace)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    if max_positions is not None and ids.numel() > max_positions:
        raise MistillInputError(f"prompt + trace is {ids.numel()} tokens, beyond the model's "
                                f"{max_positions} positions", note=note.note_id, field="teacher_trace")
    return NoteInput(note=note, prompt=prompt, trace=trace, full_text=full, input_ids=ids,
                     offsets=[tuple(o) for o in enc["offset_mapping"]])


def phase_events(ni: NoteInput, codes: Sequence[str], tokenizer, *, p2c_cap: int = 2,
                 require_think: bool = True, task=None) -> list:
    """The decision events (P1, P2, P2C; no NULL) of ``ni``'s trace, realized in ``tokenizer``
    by the instrument's anchor rule; events the tokenizer cannot realize are dropped. ``task``:
    the label space (:func:`mistill.tasks.task_for`; default ICD-10-CM)."""
    events = extract_events(ni.note.note_id, ni.trace, codes, tokenizer=tokenizer, n_null=0, p2c_cap=p2c_cap,
                            require_think=require_think, task=task)
    return realize_events(events, full_text=ni.full_text, trace_offset=ni.trace_offset, tokenizer=tokenizer,
                          input_ids=ni.input_ids.tolist(), offsets=ni.offsets, codes=list(codes), task=task)


def event_queries(realized: Sequence[RealizedEvent], input_ids: torch.Tensor) -> list[EventQuery]:
    """Realized events as queries: the token at q, the margin's target and competitor ids."""
    out = []
    for r in realized:
        ev = r.event
        out.append(EventQuery(event_id=ev.event_id, kind=ev.kind, target=ev.target, char_index=ev.char_index,
                              query=Query(position=r.position, token_id=int(input_ids[r.position]),
                                          target_id=r.target_id, competitor_ids=tuple(r.competitor_ids))))
    return out


def trace_start_token(ni: NoteInput) -> int:
    """The index of the note's first trace token: the first token ending after the trace's
    first character (``ni.offsets`` are character spans of ``ni.full_text``)."""
    start = ni.trace_offset
    return next((i for i, (_, end) in enumerate(ni.offsets) if end > start), len(ni.offsets))


def subsample_phase_events(queries: Sequence[EventQuery], per_phase: int, note_id: str,
                           seed: int) -> list[EventQuery]:
    """At most ``per_phase`` events of each phase (seeded by note), NULL events dropped; 0 keeps all.

    A cost control for quick runs (the paper measures every event); order is preserved.
    """
    if per_phase <= 0:
        return list(queries)
    rng = np.random.default_rng(stable_seed(seed, note_id, "events_per_phase"))
    keep: set[str] = set()
    for phase in ("P1", "P2", "P2C"):
        ids = [q.event_id for q in queries if q.kind == phase]
        if len(ids) > per_phase:
            ids = rng.choice(ids, size=per_phase, replace=False).tolist()
        keep.update(ids)
    return [q for q in queries if q.event_id in keep]


__all__ = ["NoteInput", "note_input", "phase_events", "event_queries", "trace_start_token",
           "subsample_phase_events"]
