"""What the prose-time heads read at the locus (paper App. F, Table 33; Figure 1c).

Attention rows are read at the locus token in the natural context (no suffix) for head groups
(the prose-time top-16, the emission top-16, the prose-time bottom-16, 16 random heads). Each
head's row is split over five categories of key tokens plus the rest:

- ``region``: the emitted chapter's inventory lines; ``other_lines``: the other lines;
- ``note``: the discharge summary; ``prose``: the reasoning written so far;
- ``sink``: the first :data:`SINK_TOKENS` tokens (they take this category whatever they are);
- ``rest``: template, headers and the instruction.

Beside the shares: the region lift (:func:`mistill.instrument.readside.region_lift`) and
``n_eff = 1 / sum_j p_j^2`` over inventory tokens (the head's attention renormalised over the
lines). Per group, values are means over the group's heads; a note's value is the mean over
its loci. Descriptive: attention is read, not intervened on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from mistill.distill.buckets import BucketAxis, build_axis, token_buckets
from mistill.instrument.readside import chapter_region, head_attention_rows, line_buckets, region_lift, token_counts
from mistill.models.loading import LoadedModel

__all__ = ["CATEGORIES", "SINK_TOKENS", "token_categories", "locus_reads"]

CATEGORIES: tuple[str, ...] = ("region", "other_lines", "note", "prose", "sink", "rest")
SINK_TOKENS = 8
"""The sink: the first 8 tokens (App. E's read side)."""


def token_categories(axis: BucketAxis, bucket_map: torch.Tensor, chapter: str) -> np.ndarray:
    """``[pos]`` category index (into :data:`CATEGORIES`) of every token for a decision in ``chapter``."""
    base = bucket_map.reshape(-1).cpu().numpy()
    region = set(chapter_region(axis, chapter))
    lines = set(line_buckets(axis))
    per_bucket = np.full(axis.n, CATEGORIES.index("rest"), dtype=np.int64)
    for b, kind in enumerate(axis.kinds):
        if b in region:
            per_bucket[b] = CATEGORIES.index("region")
        elif b in lines:
            per_bucket[b] = CATEGORIES.index("other_lines")
        elif kind == "note":
            per_bucket[b] = CATEGORIES.index("note")
        elif kind == "trace":
            per_bucket[b] = CATEGORIES.index("prose")
    out = per_bucket[base]
    out[:SINK_TOKENS] = CATEGORIES.index("sink")
    return out


def _n_eff(rows: np.ndarray, inventory_mask: np.ndarray) -> np.ndarray:
    """``[head]`` effective number of inventory tokens attended: ``1 / sum p^2`` of each row
    renormalised over the inventory tokens (NaN for a head that puts nothing there)."""
    p = rows[:, inventory_mask]
    total = p.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(total > 0, p / np.where(total > 0, total, 1.0), np.nan)
        return 1.0 / (q ** 2).sum(-1)


def locus_reads(lm: LoadedModel, input_ids: torch.Tensor, prompt, trace: str, offsets: Sequence[tuple[int, int]],
                loci: Sequence[tuple[int, str]], groups: Mapping[str, Sequence[int]]) -> list[dict[str, float]]:
    """One row per locus: for each group, the mean over its heads of each category's share, the
    region lift and ``n_eff``.

    Args:
        input_ids: ``[pos]`` the note's prompt + trace tokens.
        prompt, trace, offsets: the note's prompt, trace and token character offsets (the bucket
            axis of :mod:`mistill.distill.buckets`).
        loci: ``(locus position, emitted chapter letter)`` per mention.
        groups: group name -> flat heads.
    Returns:
        ``[{"<group>.<category>": share, "<group>.region_lift": ..., "<group>.n_eff": ...}]``.
    """
    if not loci:
        return []
    axis = build_axis(prompt, trace)
    base = token_buckets(axis, prompt, offsets, len(trace))
    union = sorted({int(h) for hs in groups.values() for h in hs})
    attn = head_attention_rows(lm, input_ids, [p for p, _ in loci], union).double().numpy()  # [row, h, pos]
    col = {h: j for j, h in enumerate(union)}
    lines = line_buckets(axis)
    out = []
    for i, (pos, chapter) in enumerate(loci):
        cats = token_categories(axis, base, chapter)[:pos + 1]
        inventory = np.isin(cats, [CATEGORIES.index("region"), CATEGORIES.index("other_lines")])
        counts = token_counts(base, axis.n, upto=pos)
        region = chapter_region(axis, chapter)
        row: dict[str, float] = {}
        for name, heads in groups.items():
            a = attn[i][[col[int(h)] for h in heads]][:, :pos + 1]  # [h, pos]
            for c, cat in enumerate(CATEGORIES):
                row[f"{name}.{cat}"] = float(a[:, cats == c].sum(-1).mean())
            by_bucket = np.zeros((a.shape[0], axis.n))
            np.add.at(by_bucket.T, base[:pos + 1].cpu().numpy(), a.T)
            with np.errstate(all="ignore"):
                lift = region_lift(by_bucket, lines, region, counts)
                row[f"{name}.region_lift"] = float(np.nanmean(lift)) if np.isfinite(lift).any() else float("nan")
                ne = _n_eff(a, inventory)
                row[f"{name}.n_eff"] = float(np.nanmean(ne)) if np.isfinite(ne).any() else float("nan")
        out.append(row)
    return out
