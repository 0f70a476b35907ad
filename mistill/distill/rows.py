"""Supervised rows across tokenizers (paper Sec. 4.1, App. I.1 "The window, and its asymmetry.",
"Events across tokenizers.", Table 38).

A *row* is one query position at which the student's pooled attention is matched to the
teacher's: every P1, P2 and P2C event that both models realize (matched by ``event_id``: both
realized the same extracted event, each at its own token position), plus the ``W`` positions
before each such P1 event (window rows), paired by their distance in tokens: teacher ``q_T - d``
with student ``q_S - d``. With the teacher's tokenizer this pairs identical text; across
tokenizers it is the paper's approximation. NULL events are never supervised.

Choices this module makes:

* A window row is kept only when both of its positions are at or after their model's trace
  start (the first token of the trace); the other distances of the same event are kept.
* Window rows of neighbouring P1 events may land on the same position, or on another event's
  position: each stays a row of its own (it belongs to its event and its distance).
* Rows sort by ``(student_pos, role, teacher_pos, phase, event_id, distance)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from mistill.errors import MistillInputError
from mistill.instrument.events import RealizedEvent

__all__ = ["SupervisedRow", "SUPERVISED_KINDS", "supervised_rows", "coverage_table",
           "rows_by_phase"]

SUPERVISED_KINDS: tuple[str, ...] = ("P1", "P2", "P2C")
ROLES: tuple[str, ...] = ("event", "window")


@dataclass(frozen=True)
class SupervisedRow:
    """One supervised position.

    phase: ``P1`` / ``P2`` / ``P2C`` (window rows are ``P1``); role: ``event`` or ``window``;
    event_id: the event (for a window row, the P1 event it precedes); distance: 0 for an event
    row, ``d`` in ``1..W`` for the window row ``d`` tokens before the event; teacher_pos /
    student_pos: the query position in each model's token sequence.
    """

    note_id: str
    phase: str
    role: str
    event_id: str
    distance: int
    teacher_pos: int
    student_pos: int

    def __post_init__(self) -> None:
        if self.phase not in SUPERVISED_KINDS:
            raise MistillInputError(f"unsupervised phase {self.phase!r}", note=self.note_id,
                                    field="phase")
        if self.role not in ROLES:
            raise MistillInputError(f"unknown row role {self.role!r}", note=self.note_id,
                                    field="role")
        if (self.role == "event") != (self.distance == 0) or self.distance < 0:
            raise MistillInputError(f"{self.role} row at distance {self.distance}",
                                    note=self.note_id, field="distance")


def _by_id(events: Sequence[RealizedEvent], side: str) -> dict[str, RealizedEvent]:
    out: dict[str, RealizedEvent] = {}
    for r in events:
        eid = r.event.event_id
        if eid in out:
            raise MistillInputError(f"{side} realizes event {eid} twice", note=r.event.note_id,
                                    field="event_id")
        out[eid] = r
    return out


def supervised_rows(teacher: Sequence[RealizedEvent], student: Sequence[RealizedEvent], *,
                    window: int = 8, teacher_trace_start: int,
                    student_trace_start: int) -> list[SupervisedRow]:
    """The supervised rows of one note.

    teacher / student: the note's events as each model realizes them
    (:func:`mistill.instrument.events.realize_events` on each model's templated text).
    teacher_trace_start / student_trace_start: index of each model's first trace token.
    Returns the event rows (P1/P2/P2C realized by both) and, for each such P1 event, the window
    rows at distances ``1..window`` whose two positions both lie in the trace.
    """
    if window < 0:
        raise ValueError("window must be >= 0")
    t_by = _by_id(teacher, "the teacher")
    s_by = _by_id(student, "the student")
    notes = {r.event.note_id for r in (*teacher, *student)}
    if len(notes) > 1:
        raise MistillInputError(f"events of several notes in one call: {sorted(notes)}",
                                field="note_id")
    rows: list[SupervisedRow] = []
    for eid, t in t_by.items():
        ev = t.event
        if ev.kind not in SUPERVISED_KINDS or eid not in s_by:
            continue
        s = s_by[eid]
        if s.event.kind != ev.kind or s.event.anchor != ev.anchor:
            raise MistillInputError(f"event {eid} differs between teacher and student "
                                    "(different extractions?)", note=ev.note_id,
                                    field="event_id")
        rows.append(SupervisedRow(ev.note_id, ev.kind, "event", eid, 0, t.position,
                                  s.position))
        if ev.kind != "P1":
            continue
        for d in range(1, window + 1):
            tp, sp = t.position - d, s.position - d
            if tp >= teacher_trace_start and sp >= student_trace_start:
                rows.append(SupervisedRow(ev.note_id, "P1", "window", eid, d, tp, sp))
    rows.sort(key=lambda r: (r.student_pos, ROLES.index(r.role), r.teacher_pos,
                             SUPERVISED_KINDS.index(r.phase), r.event_id, r.distance))
    return rows


def rows_by_phase(rows: Sequence[SupervisedRow]) -> dict[str, list[SupervisedRow]]:
    """Rows grouped by the pool that supervises them: ``P1`` (P1 event rows), ``P1_window``,
    ``P2``, ``P2C`` (keys of :func:`mistill.distill.pools.model_pools`)."""
    out: dict[str, list[SupervisedRow]] = {"P1": [], "P1_window": [], "P2": [], "P2C": []}
    for r in rows:
        out["P1_window" if r.role == "window" else r.phase].append(r)
    return out


def coverage_table(teacher_by_note: Mapping[str, Sequence[RealizedEvent]],
                   student_by_note: Mapping[str, Sequence[RealizedEvent]]) -> pd.DataFrame:
    """Table 38's structure: what a student's tokenizer keeps of the teacher's events.

    Per kind (P1, P2, P2C, then ``all`` of the three), indexed by kind: ``teacher_events``
    (events the teacher realizes), ``student_realized`` (those the student also realizes, by
    ``event_id``), ``share``, ``median_note_share`` (median over notes holding teacher events
    of the kind of the note's share), ``notes`` (notes holding teacher events of the kind) and
    ``notes_zero`` (of those, notes where the student realizes none). Shares are NaN where the
    teacher has no event. Both mappings must name the same notes.
    """
    missing = sorted(set(teacher_by_note) ^ set(student_by_note))
    if missing:
        raise MistillInputError(f"teacher and student name different notes (e.g. "
                                f"{missing[0]!r})", note=missing[0], field="note_id")
    kinds = (*SUPERVISED_KINDS, "all")
    n_t = dict.fromkeys(kinds, 0)
    n_s = dict.fromkeys(kinds, 0)
    shares: dict[str, list[float]] = {k: [] for k in kinds}
    zero = dict.fromkeys(kinds, 0)
    for note_id in sorted(teacher_by_note):
        kept = {r.event.event_id for r in student_by_note[note_id]}
        per_t = dict.fromkeys(kinds, 0)
        per_s = dict.fromkeys(kinds, 0)
        for r in teacher_by_note[note_id]:
            k = r.event.kind
            if k not in SUPERVISED_KINDS:
                continue
            if r.event.note_id != note_id:
                raise MistillInputError(f"event {r.event.event_id} listed under another note",
                                        note=note_id, field="note_id")
            hit = r.event.event_id in kept
            for key in (k, "all"):
                per_t[key] += 1
                per_s[key] += int(hit)
        for k in kinds:
            if per_t[k]:
                n_t[k] += per_t[k]
                n_s[k] += per_s[k]
                shares[k].append(per_s[k] / per_t[k])
                zero[k] += int(per_s[k] == 0)
    records = {
        "teacher_events": [n_t[k] for k in kinds],
        "student_realized": [n_s[k] for k in kinds],
        "share": [n_s[k] / n_t[k] if n_t[k] else np.nan for k in kinds],
        "median_note_share": [float(np.median(shares[k])) if shares[k] else np.nan
                              for k in kinds],
        "notes": [len(shares[k]) for k in kinds],
        "notes_zero": [zero[k] for k in kinds],
    }
    return pd.DataFrame(records, index=pd.Index(list(kinds), name="kind"))
