"""The read side of a head group at decision events (paper App. E; App. K "M2–M5 and the prefix share").

What a group of heads attends to at an event's query position q, on the span-bucket axis of
:mod:`mistill.distill.buckets`:

- **Region lift** (M2): of a head's attention on the shortlist lines, the share that falls on
  the emitted code's chapter (its own line, its category and sibling lines, the rest of its
  chapter), divided by the chapter's share of the shortlist's tokens; 1 is chance. The chapter
  is the emitted letter at P1 and the chapter of the emitted code at P2/P2C. The lines are read
  on the *base* bucket map (no carving), so a P2C event's own and sibling lines count as lines.
- **Near-miss share** (M3): the share of a head's attention on the earlier mentions of the
  near-miss (the carved ``N`` slot) at P2C events that have such mentions; beside it, the share
  on the code's own earlier mentions (``S``).
- **Prefix share**: the share of a head's attention on the current mention's already-emitted
  characters (the carved ``prefix`` slot).

Per note (App. E, L.4): the region lift is the median over the note's events per head, then the
mean over the heads; the shares are means over the note's events and heads. Reports take the
median over notes.

The attention rows are recomputed from the layers' inputs with the model's own parts
(:mod:`mistill.distill.attention_rows`), one plain forward per note.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from mistill.data.inventory import chapter_letter
from mistill.distill.attention_rows import LayerInputs, layer_keys
from mistill.distill.buckets import BucketAxis, bucketize
from mistill.errors import MistillInputError
from mistill.instrument.events import Event
from mistill.instrument.runner import NO_ROWS, KVPrefix, Runner
from mistill.models.loading import LoadedModel

__all__ = ["head_attention_rows", "prefix_attention_rows", "chapter_region", "line_buckets", "token_counts", "region_lift",
           "slot_share", "note_region_lift", "note_share", "event_chapter", "bucket_rows"]


@torch.no_grad()
def head_attention_rows(lm: LoadedModel, input_ids: torch.Tensor, positions: Sequence[int],
                        heads: Sequence[int]) -> torch.Tensor:
    """Causal attention rows of flat ``heads`` (``layer * n_heads + head``) at query ``positions``.

    One plain forward of ``input_ids`` ``[pos]`` through the decoder (no LM head) keeps the
    inputs of the layers the heads sit in; each layer's keys are projected once. Returns
    ``[row, h, pos]`` float32 in the order of ``positions`` and ``heads``; row ``r`` sums to 1
    over keys ``0..positions[r]``.
    """
    g = lm.geometry
    heads = [int(h) for h in heads]
    if any(not 0 <= h < g.n_total_heads for h in heads):
        raise MistillInputError(f"head indices must lie in 0..{g.n_total_heads - 1}", field="heads")
    ids = input_ids.reshape(-1).to(lm.device).long()
    n = int(ids.numel())
    rows = torch.as_tensor(list(positions), dtype=torch.long, device=lm.device)
    out = torch.zeros(rows.numel(), len(heads), n, dtype=torch.float32)
    if not heads or not rows.numel():
        return out
    by_layer: dict[int, list[int]] = {}
    for j, h in enumerate(heads):
        by_layer.setdefault(h // g.n_heads, []).append(j)
    with LayerInputs(g, by_layer) as kept:
        lm.model.model(input_ids=ids.unsqueeze(0), use_cache=False)
        pos_ids = torch.arange(n, device=lm.device)
        for layer, cols in by_layer.items():
            within = [heads[j] % g.n_heads for j in cols]
            keys = layer_keys(g.layers[layer], g, kept[layer][0], sorted(set(within)), pos_ids)
            probs = keys.rows(rows, within)  # [row, h_layer, pos]
            out[:, cols] = probs.float().cpu()
    return out


@torch.no_grad()
def prefix_attention_rows(runner: Runner, prefix: KVPrefix, positions: Sequence[int],
                          heads: Sequence[int]) -> torch.Tensor:
    """:func:`head_attention_rows` read off a note's prefix: the same ``[row, h, pos]`` float32,
    on the runner's device (the read side reduces them there).

    The keys are the prefix's (the prefill stored them normed and rotated); the queries come
    from the residual stream entering each head's layer at the event positions, which one
    forward of the events' tokens as rows against the prefix gives (each row sees the prefix up
    to its own position, ``row_prefix_len``). Nothing the size of the note is kept beyond the
    prefix every pass holds anyway.

    Args:
        prefix: the note's prefix (at least ``max(positions) + 1`` written).
    """
    g = runner.geometry
    heads = [int(h) for h in heads]
    if any(not 0 <= h < g.n_total_heads for h in heads):
        raise MistillInputError(f"head indices must lie in 0..{g.n_total_heads - 1}", field="heads")
    pos = torch.as_tensor(list(positions), dtype=torch.long)
    n = int(prefix.written)
    out = torch.zeros(pos.numel(), len(heads), n, dtype=torch.float32, device=runner.device)
    if not heads or not pos.numel():
        return out
    if int(pos.max()) >= n:
        raise MistillInputError(f"event position {int(pos.max())} beyond the prefix ({n} tokens)", field="positions")
    tokens = prefix.input_ids[pos.to(prefix.input_ids.device)].view(1, -1)
    res = runner.forward(prefix, int(pos.max()), tokens, pos, rows="own", row_prefix_len=pos, capture_hidden=True,
                         logits_rows=NO_ROWS)
    hidden = res.hidden_in[:, 0]  # [layer, row, d_model]
    pos_dev = pos.to(runner.device)
    visible = torch.arange(n, device=runner.device).unsqueeze(0) <= pos_dev.unsqueeze(1)  # [row, key]
    by_layer: dict[int, list[int]] = {}
    for j, h in enumerate(heads):
        by_layer.setdefault(h // g.n_heads, []).append(j)
    for layer, cols in sorted(by_layer.items()):
        parts = g.layers[layer]
        x = parts.input_norm(hidden[layer].unsqueeze(0))  # [1, row, d_model]
        q = parts.q_proj(x).view(1, -1, g.n_heads, g.d_head)
        if parts.q_norm is not None:
            q = parts.q_norm(q)
        q = q.transpose(1, 2)  # [1, head, row, d_head]
        if parts.use_rope:
            cos, sin = g.rotary(x, pos_dev.view(1, -1))
            q, _ = g.apply_rope(q, q, cos, sin)
        for j in cols:
            h = heads[j] % g.n_heads
            keys = prefix.keys[layer][0, h // g.n_groups, :n].float()  # [key, d_head]
            scores = (q[0, h].float() @ keys.T) * parts.scaling  # [row, key]
            out[:, j] = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return out


def event_chapter(event: Event) -> str:
    """The chapter letter an event decides within: its target at P1, its code's at P2/P2C."""
    if event.kind == "P1":
        return event.target
    if event.code is None:
        raise MistillInputError(f"{event.kind} event {event.event_id} has no code", note=event.note_id,
                                field="code")
    return chapter_letter(event.code)


def line_buckets(axis: BucketAxis) -> list[int]:
    """Every shortlist line bucket of the axis (the inventory the model sees)."""
    return sorted(axis.line_codes)


def chapter_region(axis: BucketAxis, chapter: str) -> list[int]:
    """The line buckets of the candidate codes in ``chapter`` (the M2 region)."""
    return sorted(i for i, c in axis.line_codes.items() if chapter_letter(c) == chapter)


def token_counts(bucket_map: torch.Tensor, n_buckets: int, upto: int | None = None) -> np.ndarray:
    """``[bucket]`` number of tokens per bucket among positions ``0..upto`` (all when None)."""
    m = bucket_map.reshape(-1)
    if upto is not None:
        m = m[:upto + 1]
    return np.bincount(m.cpu().numpy().astype(np.int64), minlength=n_buckets).astype(np.float64)


def region_lift(bucket_rows: np.ndarray, lines: Sequence[int], region: Sequence[int],
                counts: np.ndarray) -> np.ndarray:
    """Region lift per head.

    bucket_rows: ``[head, bucket]`` attention summed per bucket (base map); lines: the line
    buckets; region: the region's buckets (a subset of ``lines``); counts: ``[bucket]`` token
    counts. Returns ``[head]``: ``(a_region / a_lines) / (n_region / n_lines)``; NaN where the
    head puts nothing on the lines or the region holds no token (or all of them).
    """
    rows = np.atleast_2d(np.asarray(bucket_rows, dtype=np.float64))
    lines, region = list(lines), list(region)
    if not set(region) <= set(lines):
        raise MistillInputError("the region must be a subset of the line buckets", field="region")
    n_lines, n_region = counts[lines].sum(), counts[region].sum()
    on_lines = rows[:, lines].sum(-1)
    on_region = rows[:, region].sum(-1)
    if n_lines <= 0 or n_region <= 0 or n_region >= n_lines:
        return np.full(rows.shape[0], np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(on_lines > 0, on_region / np.where(on_lines > 0, on_lines, 1.0), np.nan)
    return share / (n_region / n_lines)


def slot_share(bucket_rows: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
    """``[head]`` share of each head's total attention on ``buckets`` (rows need not be normalised)."""
    rows = np.atleast_2d(np.asarray(bucket_rows, dtype=np.float64))
    total = rows.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, rows[:, list(buckets)].sum(-1) / np.where(total > 0, total, 1.0), np.nan)


def note_region_lift(lifts: np.ndarray) -> float:
    """One note's region lift from ``[event, head]`` lifts: median over events per head, mean over heads."""
    lifts = np.atleast_2d(np.asarray(lifts, dtype=np.float64))
    if lifts.size == 0 or np.isnan(lifts).all():
        return float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # heads with no finite lift at this note
        per_head = np.nanmedian(lifts, axis=0)
        return float(np.nanmean(per_head))


def note_share(shares: np.ndarray) -> float:
    """One note's share from ``[event, head]`` shares: the mean over events and heads (NaN skipped)."""
    shares = np.asarray(shares, dtype=np.float64)
    if shares.size == 0 or np.isnan(shares).all():
        return float("nan")
    return float(np.nanmean(shares))


def bucket_rows(attn: torch.Tensor, bucket_map: torch.Tensor, n_buckets: int) -> np.ndarray:
    """``[head, pos]`` attention at one row -> ``[head, bucket]`` (float64 numpy)."""
    return bucketize(attn, bucket_map, n_buckets).double().cpu().numpy()
