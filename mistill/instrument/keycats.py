"""The 15 categories of key position of the read side (paper App. E, "What the heads read").

At an event, every key token of the note's ``[prompt; trace]`` input falls in exactly one of:

========================  =================================================================
``sink``                  the first :data:`SINK_TOKENS` tokens (the attention sink)
``template``              the chat template (outside the user turn and the trace)
``own_line``              the emitted code's inventory line
``category_lines``        the other lines of its three-character category
``chapter_lines``         the other lines of its chapter
``other_chapter_lines``   other chapters' lines
``near_miss_line``        the near-miss's line (P2C)
``inventory_other``       inventory tokens outside any line (the list's header)
``note``                  the note (with the summary header before it)
``instruction``           the instruction
``S``                     earlier mentions of the code in the trace
``N``                     earlier mentions of the near-miss (P2C)
``other_mentions``        mentions of other inventory codes in the trace
``prefix``                the characters of the current mention written so far
``prose``                 the rest of the trace
========================  =================================================================

The categories come from the span buckets of :mod:`mistill.distill.buckets` (one axis over the
untemplated text, so every tokenizer splits the same characters) and from the event's spans.
**[recon]** choices the paper leaves open: a code's chapter is its first letter (the chapter
decision of P1, as the region of :mod:`mistill.instrument.readside`); the summary header that
opens the note goes with the note; where a trace token qualifies for several categories the
later of ``other_mentions`` < ``S`` < ``N`` < ``prefix`` wins; the near-miss's line wins over its
category's (it is the near-miss's own line, a sibling by construction).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import torch

from mistill.data.inventory import category, chapter_letter
from mistill.data.prompts import Prompt
from mistill.distill.buckets import BucketAxis, offsets_array, overlapping_tokens
from mistill.errors import MistillInputError
from mistill.instrument.events import Event, RealizedEvent, find_mentions

KEY_CATEGORIES: tuple[str, ...] = (
    "sink", "template", "own_line", "category_lines", "chapter_lines", "other_chapter_lines", "near_miss_line",
    "inventory_other", "note", "instruction", "S", "N", "other_mentions", "prefix", "prose")
SINK_TOKENS = 8
"""The attention sink: the first tokens of the input (App. E: the first 8)."""

_CAT = {name: i for i, name in enumerate(KEY_CATEGORIES)}
_KIND = {"template": "template", "header": "inventory_other", "summary_header": "note", "note": "note",
         "instruction": "instruction", "trace": "prose"}


def line_category(code: str, event_code: str, near_miss: str | None) -> str:
    """The category of the inventory line of ``code`` at an event emitting ``event_code``."""
    if code == event_code:
        return "own_line"
    if near_miss is not None and code == near_miss:
        return "near_miss_line"
    if category(code) == category(event_code):
        return "category_lines"
    if chapter_letter(code) == chapter_letter(event_code):
        return "chapter_lines"
    return "other_chapter_lines"


def key_categories(axis: BucketAxis, base: torch.Tensor, prompt: Prompt, offsets: Any,
                   event: RealizedEvent | Event, trace: str, codes: Collection[str], *,
                   sink: int = SINK_TOKENS, task=None) -> torch.Tensor:
    """The category (index into :data:`KEY_CATEGORIES`) of every key token at one event.

    Args:
        axis, base: the note's bucket axis and its token -> base bucket map ``[pos]``
            (:func:`~mistill.distill.buckets.build_axis`, :func:`~mistill.distill.buckets.token_buckets`).
        offsets: the tokens' character spans in the templated text ``prompt.full_text(trace)``.
        event: a P1, P2 or P2C event (the read side reads decisions: NULL has no emitted code).
        trace: the trace the events came from; codes: the inventory's dotted codes (mentions of
            other codes are found among them, :func:`~mistill.instrument.events.find_mentions`, or
            the ``task``'s rule, :func:`mistill.tasks.task_for`).
    Returns:
        ``[pos]`` long; every token in exactly one category.
    """
    ev = event.event if isinstance(event, RealizedEvent) else event
    if ev.kind == "NULL" or ev.code is None:
        raise MistillInputError(f"{ev.kind} event {ev.event_id} emits no code: the read side reads P1, P2 and "
                                "P2C events", note=ev.note_id, field="kind")
    offs = offsets_array(offsets)
    n = int(base.shape[-1])
    if offs.shape[0] != n:
        raise MistillInputError(f"{offs.shape[0]} offsets for a base map of {n} tokens", note=ev.note_id,
                                field="offsets")
    by_bucket = np.empty(axis.n_base, dtype=np.int64)
    for b in range(axis.n_base):
        kind = axis.kinds[b]
        if kind == "line":
            by_bucket[b] = _CAT[line_category(axis.line_codes[b], ev.code, ev.near_miss)]
        else:
            by_bucket[b] = _CAT[_KIND[kind]]
    out = torch.from_numpy(by_bucket[base.cpu().numpy()])
    shift = prompt.trace_offset
    current = (ev.mention_start, ev.mention_end) if ev.mention_start is not None else None
    mentions = task.find_mentions(trace, codes) if task is not None else find_mentions(trace, codes)
    others = [(s, e) for c, s, e in mentions
              if current is None or not (s < current[1] and current[0] < e)]
    for name, spans in (("other_mentions", others), ("S", ev.S), ("N", ev.N),
                        ("prefix", [ev.prefix_span] if ev.prefix_span else [])):
        hit = torch.from_numpy(overlapping_tokens(offs, spans, shift))
        out[hit] = _CAT[name]
    out[:min(sink, n)] = _CAT["sink"]
    return out


def category_shares(attn: torch.Tensor, categories: torch.Tensor) -> torch.Tensor:
    """A head's attention row(s) summed per key category: ``[..., key] -> [..., 15]``.

    ``categories``: ``[key]`` (the row's keys; a causal row's later keys carry no mass)."""
    cats = categories.to(attn.device).long()
    out = torch.zeros(*attn.shape[:-1], len(KEY_CATEGORIES), dtype=attn.dtype, device=attn.device)
    return out.index_add_(-1, cats[:attn.shape[-1]], attn)


REGION_CATEGORIES: tuple[str, ...] = ("own_line", "category_lines", "chapter_lines", "near_miss_line")
"""The region: the emitted chapter's inventory lines (App. E)."""
INVENTORY_CATEGORIES: tuple[str, ...] = REGION_CATEGORIES + ("other_chapter_lines", "inventory_other")
"""The inventory: every line and the inventory tokens outside any line."""


def read_measures(rows: torch.Tensor, categories: torch.Tensor, position: int) -> dict[str, np.ndarray]:
    """What heads read at one event (App. E "Definitions").

    Args:
        rows: ``[head, key]`` causal attention rows at the query ``position``.
        categories: ``[key]`` (:func:`key_categories`).
    Returns:
        ``shares`` ``[head, 15]`` (each row's attention per category, summing to 1);
        ``region_lift`` ``[head]``: the share of the head's inventory attention on the region over
        the region's share of the inventory tokens the row sees (1: indifferent; NaN when the head
        puts nothing on the inventory or the region is empty or the whole inventory);
        ``n_eff`` ``[head]``: ``1 / sum p_j^2`` of its attention renormalised over inventory tokens.
    """
    visible = rows[:, :position + 1].double()
    cats = categories[:position + 1].to(visible.device).long()
    shares = category_shares(visible, cats).cpu().numpy()
    region_ids = torch.tensor([KEY_CATEGORIES.index(c) for c in REGION_CATEGORIES], device=cats.device)
    inv_ids = torch.tensor([KEY_CATEGORIES.index(c) for c in INVENTORY_CATEGORIES], device=cats.device)
    in_region, in_inventory = torch.isin(cats, region_ids), torch.isin(cats, inv_ids)
    n_region, n_inventory = int(in_region.sum()), int(in_inventory.sum())
    on_inventory = visible[:, in_inventory]
    mass = on_inventory.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        share_region = (visible[:, in_region].sum(-1) / mass).cpu().numpy()
        if 0 < n_region < n_inventory:
            lift = share_region / (n_region / n_inventory)
        else:
            lift = np.full(rows.shape[0], np.nan)
        p = on_inventory / mass.unsqueeze(-1)
        n_eff = (1.0 / (p ** 2).sum(-1)).cpu().numpy()
    dead = (mass <= 0).cpu().numpy()
    lift[dead], n_eff[dead] = np.nan, np.nan
    return {"shares": shares, "region_lift": lift, "n_eff": n_eff}


def category_counts(categories: Sequence[int] | torch.Tensor, upto: int) -> np.ndarray:
    """Key tokens per category among positions ``[0, upto]`` (what a row at ``upto`` sees): ``[15]``."""
    cats = torch.as_tensor(categories)[:upto + 1].long()
    return np.bincount(cats.numpy(), minlength=len(KEY_CATEGORIES))


__all__ = ["KEY_CATEGORIES", "SINK_TOKENS", "REGION_CATEGORIES", "INVENTORY_CATEGORIES", "line_category",
           "key_categories", "category_shares", "read_measures", "category_counts"]
