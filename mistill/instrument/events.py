"""Decision events: where in a reasoning trace a coding decision is written, and how one
model's tokenizer realizes it (paper Sec. 2.2, App. C "Event extraction", App. I.1 "Events
across tokenizers").

Three layers, each usable on its own:

1. **Extraction** (:func:`extract_events`) works on characters. A code is written one
   decision at a time: the chapter letter (P1), each later character of a first mention (P2),
   the character at which a code diverges from a sibling named earlier (P2C). NULL events are
   prose positions with a random letter as target, for calibration. Every event carries an
   *anchor*: the character offset, in the trace, of the first non-blank character its decision
   emits. Only NULL placement depends on a tokenizer (the distance rule counts tokens).
2. **Realization** (:func:`realize_events`) maps an event onto one model's tokens. The model's
   position ``q`` is the last token ending at or before the anchor; the event is kept only if
   token ``q+1`` begins at the anchor (up to leading whitespace), i.e. if the model makes the
   decision there. An event that falls inside a token is *dropped, never moved*.
3. **Margin** (:func:`margin`) and the audit tables (:func:`margin_audit`, :func:`event_counts`,
   :func:`coverage_report`).

The label space is a :class:`mistill.tasks.base.Task` (``task=``; default ICD-10-CM,
:class:`mistill.tasks.icd10.ICD10Task`): it says what a mention is, whether a P1 decision exists,
the P2C relation and the item-like spans NULL placement avoids. The rules below are the
ICD-10-CM task's.

Choices this module makes (the paper leaves them open):

* Mentions are counted in the whole trace, the reasoning block *and* the answer after
  ``</think>`` (the paper counts mentions "in the trace"; the answer's tokens are decided by
  the model like any others). ``include_answer=False`` restricts them to the reasoning block.
* A mention is an inventory code in dotted form written as a whole token of text: the maximal
  run of alphanumerics joined by single dots (``[^\\W_]+(?:\\.[^\\W_]+)*``) must equal the code.
  So ``N18.9`` is not found inside ``N18.91`` or ``XN18.9``, a sentence-final ``I10.`` is
  ``I10``, and matching is case-sensitive. Undotted forms (``N189``) are not mentions. Codes
  given undotted are normalised to the dotted form (dot after the third character).
* P2C cap, per (code, near-miss) pair: the event at the code's *first* mention (when the
  near-miss was named before it) and the event at the code's *first repeat* named after the
  near-miss (its ``S`` is non-empty). A later repeat of the same pair gives no event.
* NULL positions come from the reasoning block only (not the tags, not the answer). "Code
  tokens" for the distance rule are the inventory mentions anywhere in the trace plus any run
  shaped like an ICD-10-CM code (``[A-Z][0-9][0-9A-Z](\\.?[0-9A-Z]{1,4})?``, e.g. a hallucinated
  ``N18.91``), so that no NULL sits next to a code the model wrote.
"""

from __future__ import annotations

import bisect
import math
import os
import random
import re
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from mistill.errors import MistillInputError
from mistill.io import read_jsonl, write_jsonl
from mistill.tasks.icd10 import ICD10Task, dotted_code, find_mentions, normalise_codes

__all__ = [
    "KINDS", "Event", "RealizedEvent", "TraceParts", "dotted_code", "normalise_codes",
    "find_mentions", "split_trace", "extract_events", "write_events_jsonl", "read_events_jsonl",
    "realize_events", "coverage_report", "margin", "entropy_over_choices", "margin_audit",
    "event_counts",
]

KINDS: tuple[str, ...] = ("P1", "P2", "P2C", "NULL")
_KIND_ORDER = {k: i for i, k in enumerate(KINDS)}

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

Span = tuple[int, int]


# --------------------------------------------------------------------------------------------
# Event records
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """One decision in one trace. All offsets are characters in the trace text.

    ``anchor`` is the first non-blank character the decision emits; ``target`` is that
    character (for NULL: a random letter, since nothing is decided there). ``prefix_span`` is
    ``(mention_start, anchor)``, the characters of the current mention written so far. ``S`` and
    ``N`` are the spans of the earlier mentions of the code and of the near-miss (P2C).
    """

    event_id: str
    note_id: str
    kind: str
    anchor: int
    target: str
    competitors: tuple[str, ...]
    code: str | None = None
    char_index: int | None = None
    mention_start: int | None = None
    mention_end: int | None = None
    first_mention: bool = False
    near_miss: str | None = None
    S: tuple[Span, ...] = ()
    N: tuple[Span, ...] = ()
    prefix_span: Span | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KIND_ORDER:
            raise MistillInputError(f"unknown event kind {self.kind!r}", note=self.note_id,
                                    field="kind")
        if not isinstance(self.target, str) or len(self.target) != 1:
            raise MistillInputError(f"target must be one character, got {self.target!r}",
                                    note=self.note_id, field="target")

    def to_dict(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id, "note_id": self.note_id, "kind": self.kind,
            "anchor": self.anchor, "target": self.target,
            "competitors": list(self.competitors), "code": self.code,
            "char_index": self.char_index, "mention_start": self.mention_start,
            "mention_end": self.mention_end, "first_mention": self.first_mention,
            "near_miss": self.near_miss, "S": [list(s) for s in self.S],
            "N": [list(s) for s in self.N],
            "prefix_span": None if self.prefix_span is None else list(self.prefix_span),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Event:
        note = str(d.get("note_id")) if "note_id" in d else None
        for f in fields(cls):
            if f.name not in d:
                raise MistillInputError("missing event field", note=note, field=f.name)
        try:
            return cls(
                event_id=str(d["event_id"]), note_id=str(d["note_id"]), kind=str(d["kind"]),
                anchor=int(d["anchor"]), target=d["target"],
                competitors=tuple(str(c) for c in d["competitors"]),
                code=None if d["code"] is None else str(d["code"]),
                char_index=None if d["char_index"] is None else int(d["char_index"]),
                mention_start=None if d["mention_start"] is None else int(d["mention_start"]),
                mention_end=None if d["mention_end"] is None else int(d["mention_end"]),
                first_mention=bool(d["first_mention"]),
                near_miss=None if d["near_miss"] is None else str(d["near_miss"]),
                S=tuple((int(a), int(b)) for a, b in d["S"]),
                N=tuple((int(a), int(b)) for a, b in d["N"]),
                prefix_span=(None if d["prefix_span"] is None
                             else (int(d["prefix_span"][0]), int(d["prefix_span"][1]))),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, MistillInputError):
                raise
            raise MistillInputError(f"malformed event: {exc}", note=note) from None


@dataclass(frozen=True)
class RealizedEvent:
    """An event as one tokenizer realizes it.

    ``position`` is q, the token whose output predicts the decided token ``q+1``; logits are
    read at q. ``chunk`` is token q+1's text without its leading whitespace (for NULL: the real
    next token, while the target is the random letter). Position tuples index the tokens of
    ``full_text`` overlapping the event's S / N / prefix character spans.
    """

    event: Event
    position: int
    target_id: int
    competitor_ids: tuple[int, ...]
    chunk: str
    S_positions: tuple[int, ...] = ()
    N_positions: tuple[int, ...] = ()
    prefix_positions: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.event.to_dict(), "position": self.position,
                "target_id": self.target_id, "competitor_ids": list(self.competitor_ids),
                "chunk": self.chunk, "S_positions": list(self.S_positions),
                "N_positions": list(self.N_positions),
                "prefix_positions": list(self.prefix_positions)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RealizedEvent:
        return cls(event=Event.from_dict(d["event"]), position=int(d["position"]),
                   target_id=int(d["target_id"]),
                   competitor_ids=tuple(int(i) for i in d["competitor_ids"]),
                   chunk=str(d["chunk"]),
                   S_positions=tuple(int(i) for i in d["S_positions"]),
                   N_positions=tuple(int(i) for i in d["N_positions"]),
                   prefix_positions=tuple(int(i) for i in d["prefix_positions"]))


# --------------------------------------------------------------------------------------------
# Codes, trace parts, mentions
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceParts:
    """Character regions of a trace: reasoning = [reasoning_start, reasoning_end), answer =
    [answer_start, len(trace)). Without think tags (``require_think=False``) the whole trace is
    reasoning and the answer is empty."""

    reasoning_start: int
    reasoning_end: int
    answer_start: int
    closed: bool


def split_trace(trace: str, *, note_id: str, require_think: bool = True) -> TraceParts:
    """Locate the reasoning block. A trace must close its reasoning with ``</think>`` (the
    opening ``<think>`` may sit in the prompt). A trace that opens ``<think>`` without closing
    it is always an error; one with no tag at all is accepted only with ``require_think=False``.
    """
    if not isinstance(trace, str):
        raise MistillInputError(f"trace must be text, got {type(trace).__name__}", note=note_id,
                                field="teacher_trace")
    close = trace.find(THINK_CLOSE)
    if close < 0:
        if THINK_OPEN in trace or require_think:
            raise MistillInputError("reasoning block not closed (no '</think>')", note=note_id,
                                    field="teacher_trace")
        return TraceParts(0, len(trace), len(trace), closed=False)
    open_ = trace.rfind(THINK_OPEN, 0, close)
    start = 0 if open_ < 0 else open_ + len(THINK_OPEN)
    return TraceParts(start, close, close + len(THINK_CLOSE), closed=True)


# --------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------

def _default_task(task: Any) -> Any:
    if task is None:
        return ICD10Task()
    return task


def _aligned(code: str, written: str) -> int:
    """The first index of ``code`` from which ``written`` ends with the same characters: item
    index ``i >= _aligned(...)`` sits at written index ``i + len(written) - len(code)``."""
    n = 0
    while n < min(len(code), len(written)) and code[-1 - n] == written[-1 - n]:
        n += 1
    return len(code) - n


def extract_events(note_id: str, trace: str, codes: Collection[str], *, tokenizer: Any = None,
                   seed: int = 0, n_null: int = 20, null_min_distance: int = 8,
                   p2c_cap: int = 2, require_think: bool = True,
                   include_answer: bool = True, task: Any = None) -> list[Event]:
    """All P1, P2, P2C and NULL events of one trace, sorted by anchor.

    ``codes`` is the label inventory (dotted or undotted for ICD-10-CM). ``tokenizer`` only sets
    the unit of the NULL distance rule (tokens of the trace text via its offset mapping;
    whitespace words when None). ``p2c_cap`` is 2 (first mention + first repeat per pair), 1
    (the code's first mention only) or 0 (uncapped: every mention named after the near-miss).
    NULL draws are seeded by ``random.Random(f"{seed}:{note_id}")`` and so are stable across runs
    and processes. ``require_think=False`` accepts a trace with no think tags at all (all of it
    is then reasoning); ``include_answer=False`` ignores mentions after ``</think>``.

    ``task`` (a :class:`mistill.tasks.base.Task`; default ICD-10-CM) says what a mention is,
    whether the first character is a P1 decision (else it is a P2 candidate like any other),
    which items are related for P2C, which characters are never scored, which spans are
    item-like for NULL placement and which letters NULL events draw. The character trie of P2
    is built over the items whatever the task. When a mention's written form differs from its
    item (an import alias, a capital letter), an event is placed only at item characters from
    which the written form ends with the same characters as the item; ``char_index`` indexes
    the item, ``anchor`` the written text.
    """
    if p2c_cap not in (0, 1, 2):
        raise ValueError(f"p2c_cap must be 0 (uncapped), 1 or 2, got {p2c_cap}")
    if n_null < 0 or null_min_distance < 0:
        raise ValueError("n_null and null_min_distance must be >= 0")
    task = _default_task(task)
    inventory = task.normalise_items(codes, note_id=note_id)
    parts = split_trace(trace, note_id=note_id, require_think=require_think)
    letters = list(task.null_choices(inventory))
    p1_letters = sorted({t for t in map(task.p1_target, inventory) if t}) if task.has_p1 else []
    unscored = frozenset(task.unscored_chars)

    def scored(ch: str) -> bool:
        return ch not in unscored and not ch.isspace()

    # next characters after every inventory prefix: nexts["N18."] = {"1", "9", "3"}
    nexts: dict[str, set[str]] = defaultdict(set)
    for c in inventory:
        for i in range(len(c)):
            nexts[c[:i]].add(c[i])

    search_end = len(trace) if include_answer else parts.reasoning_end
    mentions = task.find_mentions(trace, inventory, parts.reasoning_start, search_end)

    raw: list[dict[str, Any]] = []
    earlier: dict[str, list[Span]] = defaultdict(list)  # code -> spans of its earlier mentions
    named: list[str] = []  # codes in order of first mention
    pair_repeat_done: set[tuple[str, str]] = set()

    for code, ms, me in mentions:
        first = not earlier[code]
        written = trace[ms:me]
        lo = _aligned(code, written)
        shift = len(written) - len(code)
        base = dict(code=code, mention_start=ms, mention_end=me, first_mention=first)
        if first:
            target = task.p1_target(code) if task.has_p1 else None
            if target:
                comp = tuple(letter for letter in p1_letters if letter != target)
                if comp and lo == 0 and code[0] == target:
                    raw.append(dict(base, kind="P1", anchor=ms, target=target, competitors=comp,
                                    char_index=0, prefix_span=(ms, ms)))
            for i in range(1 if task.has_p1 else 0, len(code)):
                ch = code[i]
                if not scored(ch) or i < lo:
                    continue
                comp = tuple(sorted(nexts[code[:i]] - {ch}))
                if not comp:
                    continue
                a = ms + i + shift
                raw.append(dict(base, kind="P2", anchor=a, target=ch, competitors=comp,
                                char_index=i, prefix_span=(ms, a)))
        for sib in named:
            if sib == code or not task.related(code, sib):
                continue
            pair = (code, sib)
            if p2c_cap and not first:  # a repeat: only the pair's first repeat, under cap 2
                if p2c_cap == 1 or pair in pair_repeat_done:
                    continue
                pair_repeat_done.add(pair)
            d = next((k for k in range(min(len(code), len(sib))) if code[k] != sib[k]), None)
            if d is None:  # one code is a prefix of the other: they differ beyond the shorter
                continue
            if d < lo or not scored(code[d]) or not scored(sib[d]):
                continue
            a = ms + d + shift
            raw.append(dict(base, kind="P2C", anchor=a, target=code[d],
                            competitors=(sib[d],), char_index=d, near_miss=sib,
                            S=tuple(earlier[code]), N=tuple(earlier[sib]),
                            prefix_span=(ms, a)))
        earlier[code].append((ms, me))
        if first:
            named.append(code)

    if n_null and len(letters) >= 2:
        anchors = _null_anchors(trace, parts, task.item_like_spans(trace, inventory),
                                tokenizer=tokenizer, min_distance=null_min_distance)
        rng = random.Random(f"{seed}:{note_id}")
        chosen = sorted(rng.sample(anchors, min(n_null, len(anchors))))
        for a in chosen:
            target = rng.choice(letters)
            raw.append(dict(kind="NULL", anchor=a, target=target,
                            competitors=tuple(x for x in letters if x != target)))

    raw.sort(key=lambda r: (r["anchor"], _KIND_ORDER[r["kind"]], r.get("code") or "",
                            r.get("near_miss") or ""))
    counters: Counter[str] = Counter()
    events = []
    for r in raw:
        kind = r.pop("kind")
        i = counters[kind]
        counters[kind] += 1
        events.append(Event(event_id=f"{note_id}:{kind}:{i}", note_id=note_id, kind=kind, **r))
    return events


def _null_anchors(trace: str, parts: TraceParts, code_spans: list[Span], *, tokenizer: Any,
                  min_distance: int) -> list[int]:
    """Anchors (first non-blank char of a unit) of prose units in the reasoning block that are
    at least ``min_distance`` units from every unit overlapping a code."""
    if tokenizer is None:
        units = [(m.start(), m.end()) for m in re.finditer(r"\S+", trace)]
    else:
        enc = tokenizer(trace, add_special_tokens=False, return_offsets_mapping=True)
        units = [(int(s), int(e)) for s, e in enc["offset_mapping"] if int(e) > int(s)]
    n = len(units)
    is_code = [False] * n
    starts = [s for s, _ in code_spans]
    for i, (us, ue) in enumerate(units):
        # any code span with start < ue and end > us
        # code spans never overlap, so the last one starting before ue reaches furthest
        j = bisect.bisect_left(starts, ue) - 1
        is_code[i] = j >= 0 and code_spans[j][1] > us
    # distance (in units) to the nearest code unit, both directions
    dist = [math.inf] * n
    last = -math.inf
    for i in range(n):
        if is_code[i]:
            last = i
        dist[i] = i - last
    last = math.inf
    for i in range(n - 1, -1, -1):
        if is_code[i]:
            last = i
        dist[i] = min(dist[i], last - i)
    anchors = []
    for i, (us, ue) in enumerate(units):
        if is_code[i] or dist[i] < min_distance:
            continue
        if us < parts.reasoning_start or ue > parts.reasoning_end:
            continue
        text = trace[us:ue]
        stripped = text.lstrip()
        if not stripped:
            continue
        anchors.append(us + len(text) - len(stripped))
    return anchors


def write_events_jsonl(path: str | os.PathLike, events: Iterable[Event]) -> None:
    """One event per line, written atomically."""
    write_jsonl(path, (e.to_dict() for e in events))


def read_events_jsonl(path: str | os.PathLike) -> list[Event]:
    required = [f.name for f in fields(Event)]
    rows = read_jsonl(path, required=required, id_field="event_id")
    out = []
    for row in rows:
        try:
            out.append(Event.from_dict(row))
        except MistillInputError as exc:
            raise MistillInputError(f"malformed event {row.get('event_id')!r}", file=str(path),
                                    note=exc.note, field=exc.field) from None
    return out


# --------------------------------------------------------------------------------------------
# Realization on one tokenizer
# --------------------------------------------------------------------------------------------

def _flat_ids(input_ids: Any) -> list[int]:
    if hasattr(input_ids, "tolist"):
        input_ids = input_ids.tolist()
    if input_ids and isinstance(input_ids[0], (list, tuple)):
        if len(input_ids) != 1:
            raise MistillInputError("input_ids must hold one sequence", field="input_ids")
        input_ids = input_ids[0]
    return [int(i) for i in input_ids]


def _flat_offsets(offsets: Any) -> list[Span]:
    if hasattr(offsets, "tolist"):
        offsets = offsets.tolist()
    if offsets and offsets[0] and isinstance(offsets[0][0], (list, tuple)):
        if len(offsets) != 1:
            raise MistillInputError("offsets must hold one sequence", field="offsets")
        offsets = offsets[0]
    return [(int(s), int(e)) for s, e in offsets]


def realize_events(events: Sequence[Event], *, full_text: str, trace_offset: int,
                   tokenizer: Any, input_ids: Any = None, offsets: Any = None,
                   codes: Collection[str] | None = None, add_special_tokens: bool = False,
                   check_target_roundtrip: bool = True,
                   drops: Counter | None = None, task: Any = None) -> list[RealizedEvent]:
    """Realize extracted events on one tokenizer; unrealizable events are dropped, never moved.

    ``full_text = prompt_text + trace`` is exactly what the model reads; the trace starts at
    ``trace_offset``. ``full_text`` is tokenised once with offsets and, by default, without
    added special tokens: a chat-templated prompt already spells its special tokens (Qwen3 and
    SmolLM2 have no BOS to add). For a model that needs a BOS the prompt text does not contain,
    pass ``add_special_tokens=True`` (a leading BOS with offsets (0, 0) is handled), or pass the
    model's own ``input_ids`` / ``offsets`` (one sequence; ends must be non-decreasing).

    For anchor ``a = trace_offset + event.anchor``: q = last token with end <= a; kept only if
    token q+1 begins at a, or before a with only whitespace in between (" N"). Target id =
    ``ids[q+1]`` (NULL: the random letter in q+1's spacing variant, which must be one token).
    Competitor ids: ``lead + c + chunk[1:]`` must encode to exactly one token (``lead`` = the
    leading whitespace of token q+1); for a task of word items (``task.word_items``: EuroVoc
    labels, whose tokens are words, where a one-character substitution is no token), each
    alternative item's own first token instead: ``lead`` + the alternative from the divergence on
    (every inventory item sharing the head and continuing with a competitor character, for P2;
    the near-miss, for P2C), its first token. When the decided chunk covers several characters of the
    code, ``code[:char_index] + c + chunk[1:]`` must also be a prefix of an inventory code (P1,
    P2; only checked when ``codes`` is given) or of the near-miss (P2C, always). An event with
    no surviving competitor is dropped. With ``check_target_roundtrip`` a code event is also
    dropped when ``lead + chunk`` does not encode back to ``[ids[q+1]]`` (a tokenizer whose
    standalone encoding disagrees with its in-context tokens would give wrong competitor ids).

    ``drops``, when given, is incremented per ``(kind, reason)``; reasons: ``inside_token``,
    ``no_position``, ``target_roundtrip``, ``target_not_one_token`` (NULL), ``no_competitor``.
    ``task`` normalises ``codes`` (default ICD-10-CM; see :func:`extract_events`).
    """
    if input_ids is None or offsets is None:
        enc = tokenizer(full_text, add_special_tokens=add_special_tokens,
                        return_offsets_mapping=True)
        input_ids, offsets = enc["input_ids"], enc["offset_mapping"]
    ids = _flat_ids(input_ids)
    offs = _flat_offsets(offsets)
    if len(ids) != len(offs):
        raise MistillInputError(f"{len(ids)} input ids but {len(offs)} offsets", field="offsets")
    starts = [s for s, _ in offs]
    ends = [e for _, e in offs]
    if any(ends[i] > ends[i + 1] for i in range(len(ends) - 1)) or \
            any(starts[i] > starts[i + 1] for i in range(len(starts) - 1)):
        raise MistillInputError("token offsets are not monotone (special tokens appended "
                                "after the text?)", field="offsets")
    if not 0 <= trace_offset <= len(full_text):
        raise MistillInputError(f"trace_offset {trace_offset} outside full_text",
                                field="trace_offset")

    prefixes: set[str] | None = None
    word_items: tuple[str, ...] = ()  # a word-item task's items, whose own first tokens compete
    if codes is not None:
        items = _default_task(task).normalise_items(codes)
        prefixes = {c[:i] for c in items for i in range(1, len(c) + 1)}
        if getattr(task, "word_items", False):
            word_items = tuple(items)
    unk = getattr(tokenizer, "unk_token_id", None)
    cache: dict[str, tuple[int, ...]] = {}

    def encode(s: str) -> tuple[int, ...]:
        if s not in cache:
            cache[s] = tuple(tokenizer.encode(s, add_special_tokens=False))
        return cache[s]

    def one_token(s: str) -> int | None:
        t = encode(s)
        if len(t) != 1 or (unk is not None and t[0] == unk):
            return None
        return t[0]

    def positions(spans: Iterable[Span]) -> tuple[int, ...]:
        out: set[int] = set()
        for s, e in spans:
            s, e = s + trace_offset, e + trace_offset
            if e <= s:
                continue
            i = bisect.bisect_right(ends, s)  # first token ending after s
            while i < len(offs) and starts[i] < e:
                out.add(i)
                i += 1
        return tuple(sorted(out))

    def drop(ev: Event, reason: str) -> None:
        if drops is not None:
            drops[(ev.kind, reason)] += 1

    realized: list[RealizedEvent] = []
    for ev in events:
        a = trace_offset + ev.anchor
        if not 0 <= a < len(full_text):
            raise MistillInputError(f"event {ev.event_id} anchor outside full_text",
                                    note=ev.note_id, field="anchor")
        if ev.kind != "NULL" and full_text[a] != ev.target:
            raise MistillInputError(
                f"event {ev.event_id}: full_text has {full_text[a]!r} at the anchor, not "
                f"{ev.target!r} (wrong trace_offset or a different trace?)",
                note=ev.note_id, field="full_text")
        q = bisect.bisect_right(ends, a) - 1
        nxt = q + 1
        if q < 0 or nxt >= len(offs):
            drop(ev, "no_position")
            continue
        ns, ne = offs[nxt]
        if ns > a or ne <= a or (ns < a and full_text[ns:a].strip()):
            drop(ev, "inside_token")
            continue
        lead = full_text[ns:a]
        chunk = full_text[a:ne]

        if ev.kind == "NULL":
            target_id = one_token(lead + ev.target)
            if target_id is None:
                drop(ev, "target_not_one_token")
                continue
            comp_ids = []
            for c in ev.competitors:
                cid = one_token(lead + c)
                if cid is not None and cid != target_id and cid not in comp_ids:
                    comp_ids.append(cid)
        else:
            target_id = ids[nxt]
            if check_target_roundtrip and encode(lead + chunk) != (target_id,):
                drop(ev, "target_roundtrip")
                continue
            in_code = chunk[: max(1, trace_offset + ev.mention_end - a)] \
                if ev.mention_end is not None else chunk
            head = ev.code[: ev.char_index] if ev.code is not None else ""
            comp_ids = []
            if word_items:  # each alternative's own first token from the divergence on
                alternatives = [ev.near_miss] if ev.kind == "P2C" else word_items
                for alt in alternatives:
                    if alt is None or len(alt) <= len(head) or not alt.startswith(head) \
                            or alt[len(head)] not in ev.competitors:
                        continue
                    toks = encode(lead + alt[len(head):])
                    if toks and toks[0] != target_id and toks[0] != unk and toks[0] not in comp_ids:
                        comp_ids.append(toks[0])
            else:
                for c in ev.competitors:
                    cid = one_token(lead + c + chunk[1:])
                    if cid is None or cid == target_id or cid in comp_ids:
                        continue
                    if len(in_code) > 1:
                        cand = head + c + in_code[1:]
                        if ev.kind == "P2C":
                            if ev.near_miss is None or not ev.near_miss.startswith(cand):
                                continue
                        elif prefixes is not None and cand not in prefixes:
                            continue
                    comp_ids.append(cid)
        if not comp_ids:
            drop(ev, "no_competitor")
            continue
        realized.append(RealizedEvent(
            event=ev, position=q, target_id=int(target_id), competitor_ids=tuple(comp_ids),
            chunk=chunk, S_positions=positions(ev.S), N_positions=positions(ev.N),
            prefix_positions=positions([ev.prefix_span] if ev.prefix_span else [])))
    return realized


def coverage_report(events: Iterable[Event], realized: Iterable[RealizedEvent]
                    ) -> dict[str, dict[str, Any]]:
    """Per kind (and ``"all"``): events extracted, realized, and the realized share (None when
    nothing was extracted). Table 38's structure for one tokenizer."""
    ext = Counter(e.kind for e in events)
    rea = Counter(r.event.kind for r in realized)
    out: dict[str, dict[str, Any]] = {}
    for k in (*KINDS, "all"):
        n = sum(ext.values()) if k == "all" else ext[k]
        m = sum(rea.values()) if k == "all" else rea[k]
        out[k] = {"extracted": n, "realized": m, "share": (m / n) if n else None}
    return out


# --------------------------------------------------------------------------------------------
# Margin and the audit
# --------------------------------------------------------------------------------------------

def _choices(logits: Any, target_id: Any, competitor_ids: Any):
    import torch  # deferred: torch is slow to import

    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    single = x.dim() == 1
    if single:
        x = x.unsqueeze(0)
    if x.dim() != 2:
        raise ValueError(f"logits must be [vocab] or [batch, vocab], got {tuple(logits.shape)}")
    b = x.shape[0]
    t = torch.as_tensor(target_id, dtype=torch.long, device=x.device)
    t = t.expand(b) if t.dim() == 0 else t.reshape(b)
    c = torch.as_tensor(competitor_ids, dtype=torch.long, device=x.device)
    if c.dim() == 1:
        c = c.unsqueeze(0).expand(b, -1)
    if c.shape[0] != b or c.shape[1] == 0:
        raise ValueError(f"competitor_ids of shape {tuple(c.shape)} do not fit batch {b}")
    mask = c >= 0
    if not bool(mask.any(dim=1).all()):
        raise ValueError("every row needs at least one competitor")
    t_logit = x.gather(1, t[:, None]).squeeze(1)
    c_logit = x.gather(1, c.clamp(min=0)).masked_fill(~mask, float("-inf"))
    return t_logit, c_logit, single


def margin(logits: Any, target_id: Any, competitor_ids: Any) -> Any:
    """``logit[target] - logsumexp(logit[competitors])`` in nats (differentiable).

    Shapes: logits ``[vocab]`` with an int target and a sequence of competitor ids -> scalar;
    or logits ``[batch, vocab]``, target ``[batch]`` (or an int) and competitor ids
    ``[batch, n_comp]`` (rows padded with -1) or ``[n_comp]`` shared by every row -> ``[batch]``.
    Computed in at least float32.
    """
    import torch  # deferred: torch is slow to import

    t_logit, c_logit, single = _choices(logits, target_id, competitor_ids)
    m = t_logit - torch.logsumexp(c_logit, dim=1)
    return m[0] if single else m


def entropy_over_choices(logits: Any, target_id: Any, competitor_ids: Any) -> Any:
    """Entropy (nats) of the softmax over ``[target, competitors]``; shapes as :func:`margin`."""
    import torch  # deferred: torch is slow to import

    t_logit, c_logit, single = _choices(logits, target_id, competitor_ids)
    p = torch.softmax(torch.cat([t_logit[:, None], c_logit], dim=1), dim=1)
    h = torch.special.entr(p).sum(dim=1)
    return h[0] if single else h


def _kind_index(kinds: Iterable[str]) -> list[str]:
    present = set(kinds)
    return [k for k in KINDS if k in present] + sorted(present - set(KINDS))


def margin_audit(rows: Iterable[Any], *, live_threshold: float = 5.0):
    """Table 7's structure: per kind, ``count``, margin percentiles ``p10``/``p50``/``p90``
    (linear interpolation), ``median_entropy``, ``share_below_5`` (margin < ``live_threshold``)
    and ``share_below_0``. ``rows`` are ``(kind, margin, entropy)`` tuples or mappings with
    those keys."""
    import pandas as pd  # deferred: pandas is slow to import

    by_kind: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for r in rows:
        if isinstance(r, Mapping):
            kind, m, h = r["kind"], r["margin"], r["entropy"]
        else:
            kind, m, h = r
        by_kind[str(kind)][0].append(float(m))
        by_kind[str(kind)][1].append(float(h))
    cols = ["count", "p10", "p50", "p90", "median_entropy", "share_below_5", "share_below_0"]
    records = []
    index = _kind_index(by_kind)
    for k in index:
        m = np.asarray(by_kind[k][0])
        h = np.asarray(by_kind[k][1])
        p10, p50, p90 = np.percentile(m, [10, 50, 90])
        records.append([len(m), p10, p50, p90, float(np.median(h)),
                        float(np.mean(m < live_threshold)), float(np.mean(m < 0))])
    df = pd.DataFrame(records, index=pd.Index(index, name="kind"), columns=cols)
    return df.astype({"count": int})


def event_counts(events_by_note: Mapping[str, Iterable[Event]]):
    """Table 6's structure: per kind, the number of ``events`` and of ``notes`` having one."""
    import pandas as pd  # deferred: pandas is slow to import

    n_events: Counter[str] = Counter()
    n_notes: Counter[str] = Counter()
    for _note, evs in events_by_note.items():
        kinds = Counter(e.kind for e in evs)
        n_events.update(kinds)
        n_notes.update(kinds.keys())
    index = _kind_index(set(KINDS) | set(n_events))
    return pd.DataFrame({"events": [n_events[k] for k in index],
                         "notes": [n_notes[k] for k in index]},
                        index=pd.Index(index, name="kind"))
