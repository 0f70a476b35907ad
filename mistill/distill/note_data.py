"""One note as one model sees it for distillation: tokens, span buckets, realized events, rows.

Built the same way for the teacher (when its targets are computed) and for the student (at
every micro-step's note), so both sides share the bucket axis and the event ids, and differ
only in their tokenizer's positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mistill.data.corpus import Note
from mistill.data.inventory import Inventory
from mistill.distill.buckets import BucketAxis, build_axis, region_buckets, row_buckets, token_buckets
from mistill.instrument.events import Event, RealizedEvent, realize_events
from mistill.instrument.inputs import NoteInput, note_input
from mistill.tasks import note_items, task_for

PHASES = ("P1", "P2", "P2C")


@dataclass
class NoteData:
    """A note for one model.

    ``realized``: the phase events this model realizes (by event id); ``base_map`` ``[pos]`` the
    base bucket of each token; ``trace_start`` the first trace token.
    """

    note: Note
    inp: NoteInput
    axis: BucketAxis
    base_map: torch.Tensor
    realized: dict[str, RealizedEvent]
    inventory: Inventory
    trace_start: int
    _row_maps: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _carves: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _on_device: dict = field(default_factory=dict, repr=False)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.inp.input_ids

    def row_map(self, event_id: str | None) -> torch.Tensor:
        """``[pos]`` bucket map at a row: carved at P2/P2C event rows, the base map elsewhere."""
        if event_id is None or self.realized[event_id].event.kind == "P1":
            return self.base_map
        if event_id not in self._row_maps:
            self._row_maps[event_id] = row_buckets(self.axis, self.base_map, self.realized[event_id],
                                                   self.inp.prompt, self.inventory, self.inp.offsets)
        return self._row_maps[event_id]

    def region(self, event_id: str) -> list[int]:
        return region_buckets(self.axis, self.realized[event_id].event)

    def carve(self, event_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the row map at ``event_id`` differs from the base map: positions ``[n]`` and
        their buckets ``[n]`` (empty at P1 events)."""
        if event_id not in self._carves:
            full = self.row_map(event_id)
            where = torch.nonzero(full != self.base_map).reshape(-1)
            self._carves[event_id] = (where, full.index_select(0, where))
            self._row_maps.pop(event_id, None)  # the carve is all that is kept
        return self._carves[event_id]

    def row_maps(self, event_ids: Sequence[str | None], device: torch.device | str) -> torch.Tensor:
        """Bucket maps ``[row, pos]`` (int64, on ``device``) of rows at ``event_ids`` (``None``: a
        window row). Built on the device from the base map and each row's carve; when no row is
        carved the result is a stride-0 view of the base map (no copy)."""
        device = torch.device(device)
        key = ("base", device)
        if key not in self._on_device:
            self._on_device[key] = self.base_map.to(device)
        base = self._on_device[key]
        carved = [(r, self.carve(e)) for r, e in enumerate(event_ids)
                  if e is not None and self.realized[e].event.kind != "P1"]
        carved = [(r, c) for r, c in carved if c[0].numel()]
        maps = base.unsqueeze(0).expand(len(event_ids), -1)
        if not carved:
            return maps
        rows = torch.cat([torch.full((c[0].numel(),), r, dtype=torch.long) for r, c in carved])
        pos = torch.cat([c[0] for _, c in carved])
        val = torch.cat([c[1] for _, c in carved])
        maps = maps.clone()
        maps[rows.to(device), pos.to(device)] = val.to(device)
        return maps

    def event_tables(self, event_ids: Sequence[str], device: torch.device | str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per event, on ``device``: target ids ``[e]``, competitor ids ``[e, comp]`` padded with
        ``-1``, and the region mask ``[e, bucket]`` (bool) over this note's bucket axis."""
        key = ("events", tuple(event_ids), torch.device(device))
        if key not in self._on_device:
            real = [self.realized[e] for e in event_ids]
            width = max((len(r.competitor_ids) for r in real), default=0)
            comp = torch.full((len(real), max(width, 1)), -1, dtype=torch.long)
            region = torch.zeros(len(real), self.axis.n, dtype=torch.bool)
            for i, (e, r) in enumerate(zip(event_ids, real)):
                comp[i, :len(r.competitor_ids)] = torch.as_tensor(r.competitor_ids, dtype=torch.long)
                region[i, self.region(e)] = True
            target = torch.as_tensor([r.target_id for r in real], dtype=torch.long)
            self._on_device[key] = (target.to(device), comp.to(device), region.to(device))
        return self._on_device[key]


def first_trace_token(offsets: Sequence[tuple[int, int]], trace_offset: int) -> int:
    """Index of the first token that starts at or after the trace's first character."""
    for i, (s, e) in enumerate(offsets):
        if s >= trace_offset and e > s:
            return i
    raise ValueError("no token inside the trace")


def build_note_data(note: Note, inventory: Inventory, tokenizer, events: Sequence[Event], *,
                    remove_discharge_diagnosis: bool = True, narrow_instruction: bool = True,
                    candidates: Sequence[str] | None = None) -> NoteData:
    """Tokenize the note's prompt + trace, build its bucket axis, realize its phase events."""
    inp = note_input(note, inventory, tokenizer, candidates=candidates,
                     remove_discharge_diagnosis=remove_discharge_diagnosis,
                     narrow_instruction=narrow_instruction)
    axis = build_axis(inp.prompt, inp.trace)
    base = token_buckets(axis, inp.prompt, inp.offsets, len(inp.trace))
    phase_events = [e for e in events if e.kind in PHASES]
    realized = realize_events(phase_events, full_text=inp.full_text, trace_offset=inp.trace_offset,
                              tokenizer=tokenizer, input_ids=inp.input_ids.tolist(), offsets=inp.offsets,
                              codes=note_items(inventory, note), task=task_for(inventory).for_note(note))
    return NoteData(note=note, inp=inp, axis=axis, base_map=base,
                    realized={r.event.event_id: r for r in realized}, inventory=inventory,
                    trace_start=first_trace_token(inp.offsets, inp.trace_offset))
