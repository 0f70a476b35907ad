"""Span buckets: one axis over the untemplated ``[prompt; trace]`` for every tokenizer (paper
Sec. 4.1, App. I.1 "Span buckets.").

A *bucket* is a character range of the untemplated text ``prompt.user_text + trace``. Because
the ranges are built from text only, a teacher and a student with different tokenizers share
one bucket list, and each model's pooled attention row becomes a distribution over the same
axis once every key token's attention is summed into the bucket containing its text.

The axis, in order:

* bucket 0, ``template``: the chat-template tokens (everything of the templated text outside the
  user turn and the trace) and the first-position attention sink;
* the shortlist ``header`` (absent, with the lines, where the prompt lists no candidates);
* one ``line`` bucket per candidate line (``"<code> <description>"``), prompt order;
* the ``summary_header``;
* the ``note`` in windows of 32 whitespace words;
* the ``instruction``;
* the ``trace`` split at sentence boundaries, pieces capped at 400 characters;
* five ``carved`` slots, always present and empty except at P2/P2C rows: ``own_line``,
  ``siblings``, ``S``, ``N``, ``prefix`` (App. I.1: the code's own line, its category siblings'
  lines, its earlier mentions, the near-miss's earlier mentions, its emitted prefix).

The base buckets (all but ``template`` and the carved slots) partition the untemplated text
with no gap: characters between parts (the newlines of the prompt layout, the whitespace after
a sentence) belong to the preceding bucket, so every base bucket except the first of the user
turn and of the trace starts at a non-blank character.

A token goes to the base bucket holding its first non-blank character (the whole token's first
character when it is blank only), mapped to untemplated coordinates. Tokens whose character
lies in the template, tokens with empty offsets (added special tokens) and position 0 (the
sink) go to bucket 0.

Choices this module makes (the paper leaves them open):

* Trace sentence boundaries: after ``.``, ``?`` or ``!`` followed by whitespace, and at every
  newline; the whitespace run after the boundary stays with the sentence it ends. A piece over
  the cap is cut at the last word start within the cap (a hard cut at the cap when a single
  word is longer).
* A note window starts at a word (its first character is the window's first word's first
  character) and runs to the next window's first word; the last one runs to the instruction.
* At a carved row, the precedence when a token qualifies for several slots is ``own_line`` <
  ``siblings`` < ``S`` < ``N`` < ``prefix`` (later wins); the own and sibling lines are carved
  whole (their bucket, trailing newline included), S / N / prefix by token overlap with the
  event's character spans (the rule :func:`mistill.instrument.events.realize_events` uses for
  ``S_positions``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mistill.data.inventory import Inventory, chapter_letter
from mistill.data.prompts import Prompt
from mistill.errors import MistillInputError
from mistill.instrument.events import Event, RealizedEvent

__all__ = ["BucketAxis", "CARVED", "BUCKET_KINDS", "build_axis", "token_buckets", "row_buckets",
           "bucketize", "region_buckets", "trace_pieces", "note_windows", "offsets_array", "overlapping_tokens"]

CARVED: tuple[str, ...] = ("own_line", "siblings", "S", "N", "prefix")
BUCKET_KINDS: tuple[str, ...] = ("template", "header", "line", "summary_header", "note",
                                 "instruction", "trace", "carved")
CARVED_PHASES = ("P2", "P2C")

Span = tuple[int, int]

# A boundary: a sentence end followed by whitespace, or a whitespace run holding a newline.
_BOUNDARY = re.compile(r"[.?!]\s+|[^\S\n]*\n\s*")
_BLANK = re.compile(r"\s+")
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class BucketAxis:
    """The bucket axis of one note and trace.

    names / kinds: ``[bucket]`` names (``"template"``, ``"header"``, ``"line:N18.9"``,
    ``"summary_header"``, ``"note:0"``, ``"instruction"``, ``"trace:0"``, the carved slots'
    names) and kinds (:data:`BUCKET_KINDS`).
    spans: ``[bucket]`` ``(start, end)`` in the untemplated text ``user_text + trace``;
    ``(-1, -1)`` for ``template`` and the carved slots.
    line_codes: line bucket index -> code.
    user_len: ``len(user_text)``; text_len: ``len(user_text) + len(trace)``.
    blank_runs: the whitespace runs of the untemplated text, ``(start, end)`` (the axis keeps
    where the blanks are, not the text, to find a token's first non-blank character).
    """

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    spans: tuple[Span, ...]
    line_codes: Mapping[int, str]
    user_len: int
    text_len: int
    blank_runs: tuple[Span, ...] = ()

    @property
    def n(self) -> int:
        """Number of buckets (template + base buckets + the five carved slots)."""
        return len(self.names)

    @property
    def n_base(self) -> int:
        """Buckets a token can fall in before carving (template + base buckets)."""
        return self.n - len(CARVED)

    def slot(self, name: str) -> int:
        """Index of a carved slot (``own_line``, ``siblings``, ``S``, ``N``, ``prefix``)."""
        if name not in CARVED:
            raise KeyError(f"{name!r} is not a carved slot; slots are {CARVED}")
        return self.n_base + CARVED.index(name)

    def index(self, name: str) -> int:
        """Index of a bucket by name."""
        return self.names.index(name)

    def line_bucket(self, code: str) -> int | None:
        """The line bucket of a candidate code, None when the code is not a candidate."""
        return self._code_to_line.get(code)

    @property
    def _code_to_line(self) -> dict[str, int]:
        cached = self.__dict__.get("_c2l")
        if cached is None:
            cached = {c: i for i, c in self.line_codes.items()}
            object.__setattr__(self, "_c2l", cached)
        return cached

    @property
    def base_starts(self) -> np.ndarray:
        """``[base bucket]`` start offsets of buckets 1 .. n_base-1 (ascending)."""
        cached = self.__dict__.get("_starts")
        if cached is None:
            cached = np.asarray([s for s, _ in self.spans[1:self.n_base]], dtype=np.int64)
            object.__setattr__(self, "_starts", cached)
        return cached

    def of_kind(self, kind: str) -> list[int]:
        """Indices of the buckets of one kind."""
        return [i for i, k in enumerate(self.kinds) if k == kind]

    def bucket_of(self, u: int) -> int:
        """Base bucket holding untemplated character ``u``."""
        if not 0 <= u < self.text_len:
            raise IndexError(f"character {u} outside the untemplated text ({self.text_len})")
        return int(np.searchsorted(self.base_starts, u, side="right"))  # 1 + base index


# --------------------------------------------------------------------------------------------
# Building the axis
# --------------------------------------------------------------------------------------------

def note_windows(text: str, start: int, end: int, words: int) -> list[Span]:
    """``text[start:end]`` in windows of ``words`` whitespace words, contiguous, covering it.

    Window j starts at its first word (the first window at ``start``) and ends where the next
    begins (the last at ``end``)."""
    if words < 1:
        raise ValueError("note windows need at least one word")
    word_starts = [m.start() for m in _WORD.finditer(text, start, end)]
    cuts = [start] + [word_starts[i] for i in range(words, len(word_starts), words)]
    if start == end:
        return []
    return [(a, b) for a, b in zip(cuts, cuts[1:] + [end])]


def _cap(text: str, start: int, end: int, cap: int) -> list[Span]:
    out: list[Span] = []
    while end - start > cap:
        limit = start + cap
        # last word start within the cap: a non-blank character after a blank one
        cut = None
        for p in range(limit, start, -1):
            if not text[p].isspace() and text[p - 1].isspace():
                cut = p
                break
        cut = cut if cut is not None else limit
        out.append((start, cut))
        start = cut
    out.append((start, end))
    return out


def trace_pieces(trace: str, cap: int = 400) -> list[Span]:
    """The trace split at sentence boundaries, pieces of at most ``cap`` characters.

    Spans are trace characters, contiguous and covering the trace (an empty trace gives none).
    """
    if cap < 1:
        raise ValueError("trace pieces need a positive cap")
    if not trace:
        return []
    cuts = [0] + [m.end() for m in _BOUNDARY.finditer(trace) if 0 < m.end() < len(trace)]
    cuts = sorted(set(cuts))
    out: list[Span] = []
    for a, b in zip(cuts, cuts[1:] + [len(trace)]):
        out.extend(_cap(trace, a, b, cap))
    return out


def build_axis(prompt: Prompt, trace: str, *, note_window_words: int = 32,
               trace_piece_chars: int = 400) -> BucketAxis:
    """The bucket axis of ``prompt`` and ``trace`` (identical for any tokenizer).

    Bucket 0 is the template/sink bucket, then the base buckets in text order (header, one per
    candidate line, summary header, note windows, instruction, trace pieces), then the five
    carved slots. The base buckets partition ``user_text + trace`` exactly.
    """
    user = prompt.user_text
    parts = prompt.parts
    listed = "header" in parts  # a prompt without a list starts at its summary header
    for name in (("header",) if listed else ()) + ("summary_header", "note", "instruction"):
        if name not in parts:
            raise MistillInputError("prompt lacks a part the span buckets need",
                                    note=prompt.note_id, field=name)
    codes = list(prompt.codes)
    if (listed and not codes) or any(c not in prompt.line_spans for c in codes):
        raise MistillInputError("prompt has no line span for every candidate code",
                                note=prompt.note_id, field="line_spans")
    if not isinstance(trace, str):
        raise MistillInputError("trace must be text", note=prompt.note_id, field="trace")

    # (start, name, kind, code); each base bucket ends where the next starts
    starts: list[tuple[int, str, str, str | None]] = [(0, "header", "header", None)] if listed else []
    for c in codes:
        starts.append((prompt.line_spans[c][0], f"line:{c}", "line", c))
    starts.append((parts["summary_header"][0], "summary_header", "summary_header", None))
    ns, ne = parts["note"][0], parts["instruction"][0]
    for j, (a, _) in enumerate(note_windows(user, ns, ne, note_window_words)):
        starts.append((a, f"note:{j}", "note", None))
    starts.append((parts["instruction"][0], "instruction", "instruction", None))
    L = len(user)
    for j, (a, _) in enumerate(trace_pieces(trace, trace_piece_chars)):
        starts.append((L + a, f"trace:{j}", "trace", None))
    total = L + len(trace)
    positions = [s for s, *_ in starts]
    if positions[0] != 0 or any(b <= a for a, b in zip(positions, positions[1:])) \
            or positions[-1] >= total:
        raise MistillInputError("prompt parts are not in the layout order header, lines, "
                                "summary header, note, instruction", note=prompt.note_id,
                                field="parts")

    names = ["template"]
    kinds = ["template"]
    spans: list[Span] = [(-1, -1)]
    line_codes: dict[int, str] = {}
    ends = positions[1:] + [total]
    for (s, name, kind, code), e in zip(starts, ends):
        if code is not None:
            line_codes[len(names)] = code
        names.append(name)
        kinds.append(kind)
        spans.append((s, e))
    for name in CARVED:
        names.append(name)
        kinds.append("carved")
        spans.append((-1, -1))
    blanks = tuple((m.start(), m.end()) for m in _BLANK.finditer(user))
    blanks += tuple((L + m.start(), L + m.end()) for m in _BLANK.finditer(trace))
    return BucketAxis(names=tuple(names), kinds=tuple(kinds), spans=tuple(spans),
                      line_codes=line_codes, user_len=L, text_len=total, blank_runs=blanks)


# --------------------------------------------------------------------------------------------
# Tokens -> buckets
# --------------------------------------------------------------------------------------------

def offsets_array(offsets: Any) -> np.ndarray:
    """Token character spans (one sequence, or a batch of one) as ``[pos, 2]`` int64."""
    if hasattr(offsets, "tolist"):
        offsets = offsets.tolist()
    offs = list(offsets)
    if offs and offs[0] and isinstance(offs[0][0], (list, tuple)):
        if len(offs) != 1:
            raise MistillInputError("offsets must hold one sequence", field="offsets")
        offs = offs[0]
    arr = np.asarray(offs, dtype=np.int64).reshape(-1, 2)
    return arr


def _check_fit(axis: BucketAxis, prompt: Prompt, trace_len: int) -> None:
    if len(prompt.user_text) != axis.user_len or axis.user_len + trace_len != axis.text_len:
        raise MistillInputError(
            f"the axis was built for a user turn of {axis.user_len} and a trace of "
            f"{axis.text_len - axis.user_len} characters, not {len(prompt.user_text)} and "
            f"{trace_len}", note=prompt.note_id, field="axis")


def _blank_mask(axis: BucketAxis, prompt: Prompt, trace_len: int) -> np.ndarray:
    """``[char]`` bool over the templated text ``prompt.text + trace``: True where blank."""
    n_text = len(prompt.text)
    mask = np.zeros(n_text + trace_len, dtype=bool)
    for m in _BLANK.finditer(prompt.text):
        mask[m.start():m.end()] = True
    L = axis.user_len
    for s, e in axis.blank_runs:
        if s >= L:
            mask[n_text + s - L:n_text + e - L] = True
    return mask


def token_buckets(axis: BucketAxis, prompt: Prompt, offsets: Any,
                  trace_len: int) -> torch.Tensor:
    """The base bucket of every token of the model's templated text ``prompt.text + trace``.

    offsets: ``[pos]`` ``(start, end)`` character offsets of the model's tokens in the
    templated text (its fast tokenizer, ``add_special_tokens=False``). Returns ``[pos]`` long:
    the base bucket holding the token's first non-blank character (its first character when
    blank only) mapped to untemplated coordinates; 0 for template tokens, for tokens with empty
    offsets and for position 0.
    """
    _check_fit(axis, prompt, trace_len)
    offs = offsets_array(offsets)
    n_pos = offs.shape[0]
    out = np.zeros(n_pos, dtype=np.int64)
    if n_pos == 0:
        return torch.from_numpy(out)
    full_len = len(prompt.text) + trace_len
    s, e = offs[:, 0], offs[:, 1]
    if (e > full_len).any() or (s < 0).any():
        raise MistillInputError(f"token offsets reach beyond the templated text ({full_len} "
                                "characters)", note=prompt.note_id, field="offsets")
    blank = _blank_mask(axis, prompt, trace_len)
    # next non-blank character at or after each position (full_len where none)
    idx = np.where(~blank, np.arange(full_len), full_len)
    nxt = np.minimum.accumulate(idx[::-1])[::-1] if full_len else idx
    nxt = np.append(nxt, full_len)
    valid = e > s
    key = np.where(valid, nxt[np.clip(s, 0, full_len)], 0)
    key = np.where(valid & (key >= e), s, key)  # a blank-only token keeps its first character
    uo, L = prompt.user_offset, axis.user_len
    to = prompt.trace_offset
    in_user = (key >= uo) & (key < uo + L)
    in_trace = (key >= to) & (key < to + trace_len)
    u = np.where(in_user, key - uo, np.where(in_trace, L + key - to, -1))
    bucket = np.searchsorted(axis.base_starts, u, side="right")  # 1 + base index
    keep = valid & (in_user | in_trace)
    out[keep] = bucket[keep]
    out[0] = 0
    return torch.from_numpy(out)


def overlapping_tokens(offs: np.ndarray, spans: Iterable[Span], shift: int) -> np.ndarray:
    """Token indices whose (non-empty) offsets overlap any of the character spans + shift."""
    s, e = offs[:, 0], offs[:, 1]
    hit = np.zeros(offs.shape[0], dtype=bool)
    for a, b in spans:
        a, b = a + shift, b + shift
        if b <= a:
            continue
        hit |= (s < b) & (e > a) & (e > s)
    return hit


def row_buckets(axis: BucketAxis, base: torch.Tensor, realized_event: RealizedEvent | Event,
                prompt: Prompt, inventory: Inventory, offsets: Any) -> torch.Tensor:
    """The token -> bucket map at one supervised row.

    At a P2/P2C row: ``base`` (``[pos]``, from :func:`token_buckets`) with tokens carved out:
    the code's own line -> ``own_line``; the lines of its category siblings among the candidates
    -> ``siblings``; tokens overlapping the event's ``S`` spans -> ``S``, its ``N`` spans -> ``N``
    and its ``prefix_span`` -> ``prefix`` (event spans are trace characters; shifted by
    ``prompt.trace_offset``). At P1 (and window) rows: ``base`` unchanged. Returns a new
    ``[pos]`` long tensor.
    """
    ev = realized_event.event if isinstance(realized_event, RealizedEvent) else realized_event
    out = base.clone()
    if ev.kind not in CARVED_PHASES:
        return out
    if ev.code is None:
        raise MistillInputError(f"{ev.kind} event {ev.event_id} has no code", note=ev.note_id,
                                field="code")
    offs = offsets_array(offsets)
    if offs.shape[0] != base.shape[-1]:
        raise MistillInputError(f"{offs.shape[0]} offsets for a base map of "
                                f"{base.shape[-1]} tokens", note=ev.note_id, field="offsets")
    own = axis.line_bucket(ev.code)
    if own is not None:
        out[base == own] = axis.slot("own_line")
    sib_lines = [b for b in (axis.line_bucket(c) for c in inventory.siblings(ev.code))
                 if b is not None]
    if sib_lines:
        out[torch.isin(base, torch.tensor(sib_lines, dtype=base.dtype))] = axis.slot("siblings")
    shift = prompt.trace_offset
    for name, spans in (("S", ev.S), ("N", ev.N),
                        ("prefix", [ev.prefix_span] if ev.prefix_span else [])):
        hit = torch.from_numpy(overlapping_tokens(offs, spans, shift))
        out[hit] = axis.slot(name)
    return out


# --------------------------------------------------------------------------------------------
# Attention rows -> bucket rows; region buckets
# --------------------------------------------------------------------------------------------

def bucketize(attn: torch.Tensor, buckets: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """Sum an attention row over buckets.

    attn: ``[..., pos]`` probabilities over the key positions up to the query (``pos`` may be
    shorter than ``buckets``: the first ``pos`` entries of the map are used). buckets:
    ``[pos]`` or ``[..., pos]`` broadcastable to ``attn``, values in ``[0, n_buckets)``.
    Returns ``[..., bucket]`` (float32 at least; half inputs are promoted) by ``scatter_add``:
    differentiable in ``attn``, each row's total equal to ``attn``'s.
    """
    n_pos = attn.shape[-1]
    if buckets.shape[-1] < n_pos:
        raise ValueError(f"bucket map of {buckets.shape[-1]} positions for attention over "
                         f"{n_pos}")
    idx = buckets[..., :n_pos].to(device=attn.device, dtype=torch.long)
    dtype = torch.promote_types(attn.dtype, torch.float32)
    src = attn.to(dtype)
    shape = torch.broadcast_shapes(src.shape, idx.shape)
    src = src.expand(shape)
    idx = idx.expand(shape)
    out = torch.zeros(*shape[:-1], n_buckets, dtype=dtype, device=attn.device)
    return out.scatter_add(-1, idx, src)


def region_buckets(axis: BucketAxis, event: Event | RealizedEvent) -> list[int]:
    """The buckets of an event's region (the region mass ``m(e)`` sums the pooled row here).

    P1: the line buckets of every candidate code whose chapter letter is the emitted letter
    (``event.target``). P2/P2C: the ``own_line`` and ``siblings`` slots. NULL has no region.
    """
    ev = event.event if isinstance(event, RealizedEvent) else event
    if ev.kind == "P1":
        return sorted(i for i, c in axis.line_codes.items() if chapter_letter(c) == ev.target)
    if ev.kind in CARVED_PHASES:
        return [axis.slot("own_line"), axis.slot("siblings")]
    raise MistillInputError(f"{ev.kind} events have no region", note=ev.note_id, field="kind")
