"""Key-side blocking: one head prevented from attending to named key positions at one event
(paper App. E, "Blocking what the heads read"; Table 20).

At the decision token the named head's attention row is recomputed with the named keys removed
from its softmax (the rest renormalised), in float32 from the clean residual stream entering its
layer; the result replaces the head's output there and the forward continues from that layer,
every other head and layer unchanged (:func:`key_block`). The reference is the same path with
an empty key set, so the key-side effect ``D = m(reference) - m(blocked)`` carries no kernel
noise; the head's whole effect ``E`` is its mean-ablation at the same token
(:func:`~mistill.instrument.attribution.exact_importance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mistill.instrument.hooks import HeadHook, Patch
from mistill.instrument.keycats import KEY_CATEGORIES, REGION_CATEGORIES
from mistill.instrument.patching import Query, margins_from_logits
from mistill.instrument.runner import KVPrefix, Runner


def blocked_attention(runner: Runner, prefix: KVPrefix, query: Query, hidden_in: torch.Tensor, head: int,
                      key_sets: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's attention row and output at the query with each key set removed from its softmax.

    Args:
        prefix: the note's prefix; the query sees ``prefix[:query.position]`` and its own key
            (key position ``query.position``).
        hidden_in: ``[layer, d_model]`` the clean residual stream entering each layer at the query.
        head: flat head index ``layer * n_heads + head``.
        key_sets: per variant, key positions in ``[0, query.position]`` to remove (empty: the
            reference). A set that removes every key is refused.
    Returns:
        ``probs`` ``[variant, key]`` (float32, over ``query.position + 1`` keys) and ``z``
        ``[variant, d_head]`` (float32).
    """
    g = runner.geometry
    layer, h = divmod(int(head), g.n_heads)
    parts = g.layers[layer]
    pos = int(query.position)
    x = parts.input_norm(hidden_in[layer].to(runner.device, runner.dtype).view(1, 1, -1))
    q = parts.q_proj(x).view(1, 1, g.n_heads, g.d_head)
    k = parts.k_proj(x).view(1, 1, g.n_kv_heads, g.d_head)
    v = parts.v_proj(x).view(1, 1, g.n_kv_heads, g.d_head)
    if parts.q_norm is not None:
        q, k = parts.q_norm(q), parts.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if parts.use_rope:
        cos, sin = g.rotary(x, torch.tensor([[pos]], device=runner.device))
        q, k = g.apply_rope(q, k, cos, sin)
    kv = h // g.n_groups
    keys = torch.cat([prefix.keys[layer][0, kv, :pos], k[0, kv]], dim=0).float()  # [key, d_head]
    values = torch.cat([prefix.values[layer][0, kv, :pos], v[0, kv]], dim=0).float()
    scores = (keys @ q[0, h, 0].float()) * parts.scaling  # [key]
    n_var = len(key_sets)
    masked = scores.unsqueeze(0).repeat(n_var, 1)
    for i, blocked in enumerate(key_sets):
        if len(blocked):
            idx = torch.as_tensor(sorted(set(int(p) for p in blocked)), dtype=torch.long, device=masked.device)
            if int(idx.min()) < 0 or int(idx.max()) > pos:
                raise ValueError(f"key positions must lie in [0, {pos}]")
            if idx.numel() == pos + 1:
                raise ValueError("a key set may not remove every key of the row")
            masked[i, idx] = float("-inf")
    probs = torch.softmax(masked, dim=-1)
    return probs, probs @ values


def key_block(runner: Runner, hook: HeadHook, prefix: KVPrefix, query: Query, hidden_in: torch.Tensor, head: int,
              key_sets: Sequence[Sequence[int]]) -> torch.Tensor:
    """Margins at the query with ``head`` blocked from each key set (:func:`blocked_attention`),
    one row per set in one forward from the head's layer: ``[variant]`` float32. Put the
    reference (an empty set) in the same call as the sets it is compared with: rows of one
    forward share its kernels, so their differences carry no kernel noise.

    ``prefix.length`` must be at least ``query.position``."""
    _, z = blocked_attention(runner, prefix, query, hidden_in, head, key_sets)
    return head_replaced(runner, hook, prefix, query, hidden_in, head, z)


def head_replaced(runner: Runner, hook: HeadHook, prefix: KVPrefix, query: Query, hidden_in: torch.Tensor,
                  head: int, z: torch.Tensor) -> torch.Tensor:
    """Margins at the query with ``head``'s output replaced by each row of ``z`` ``[variant, d_head]``,
    every other head and layer as in the clean forward (it starts at the head's layer from the
    clean residual stream ``hidden_in`` ``[layer, d_model]``): ``[variant]`` float32. Given the
    head's own clean output it returns the clean margin bit for bit."""
    g = runner.geometry
    layer, h = divmod(int(head), g.n_heads)
    n = int(z.shape[0])
    mask = torch.zeros(n, g.n_layers, g.n_heads, dtype=torch.bool, device=runner.device)
    mask[:, layer, h] = True
    values = torch.zeros(n, g.n_layers, g.n_heads, g.d_head, dtype=runner.dtype, device=runner.device)
    values[:, layer, h] = z.to(runner.device, runner.dtype)
    start_hidden = hidden_in[layer].to(runner.device, runner.dtype).view(1, 1, -1).expand(1, n, -1)
    with torch.no_grad(), hook.patch(Patch(mask=mask, values=values)):
        out = runner.forward(prefix, query.position, torch.full((1, n), query.token_id, dtype=torch.long),
                             torch.full((n,), query.position, dtype=torch.long), rows="own",
                             start_layer=layer, start_hidden=start_hidden)
    return margins_from_logits(out.logits[0], query.target_id, query.competitor_ids).float().cpu()


@dataclass(frozen=True)
class KeySet:
    """What a head can be named for reading, and its matched control (App. E, Table 20).

    categories: the key categories (:data:`~mistill.instrument.keycats.KEY_CATEGORIES`) whose
    positions are blocked; phases: the event kinds it is measured at; control: the category the
    matched control keys are drawn from; control_unit: ``"line"`` (whole inventory lines) or
    ``"mention"`` (whole mentions: maximal runs of consecutive tokens of the category).
    """

    name: str
    categories: tuple[str, ...]
    phases: tuple[str, ...]
    control: str
    control_unit: str


KEY_SETS: dict[str, KeySet] = {s.name: s for s in (
    KeySet("region", REGION_CATEGORIES, ("P1",), "other_chapter_lines", "line"),
    KeySet("N", ("N",), ("P2C",), "other_mentions", "mention"),
    KeySet("near_miss_line", ("near_miss_line",), ("P2C",), "other_chapter_lines", "line"),
    KeySet("S", ("S",), ("P2", "P2C"), "other_mentions", "mention"),
)}
"""The named key sets: the emitted chapter's inventory lines at P1 (region readers), the earlier
mentions of the near-miss and its inventory line at P2C (the near-miss loop-back), the earlier
mentions of the code itself. Controls: other chapters' whole lines at the line sets, other
codes' whole earlier mentions at the mention sets (the paper's matched controls)."""


def named_keys(categories: torch.Tensor, position: int, key_set: KeySet) -> list[int]:
    """Key positions in ``[0, position]`` whose category is one of ``key_set``'s (``categories``
    ``[pos]``, :func:`~mistill.instrument.keycats.key_categories`)."""
    ids = torch.tensor([KEY_CATEGORIES.index(c) for c in key_set.categories])
    seen = categories[:position + 1].cpu().long()
    return torch.isin(seen, ids).nonzero().flatten().tolist()


def matched_control(categories: torch.Tensor, base: torch.Tensor, position: int, key_set: KeySet, count: int,
                    seed: int) -> list[int] | None:
    """``count`` control key positions in ``[0, position]`` from ``key_set.control``, whole units
    taken in a seeded order until the count is reached; the last unit taken is cut to the count
    (**[recon]**: the paper matches the count, not how a unit is cut). None when the category
    holds fewer than ``count`` keys before the query.

    Args:
        categories: ``[pos]`` key categories; base: ``[pos]`` the tokens' base buckets (a line's
            tokens share one, :func:`~mistill.distill.buckets.token_buckets`).
    """
    if count <= 0:
        return []
    seen = categories[:position + 1].cpu().long().numpy()
    pos = np.flatnonzero(seen == KEY_CATEGORIES.index(key_set.control))
    if len(pos) < count:
        return None
    if key_set.control_unit == "line":
        unit = base[:position + 1].cpu().long().numpy()[pos]
    elif key_set.control_unit == "mention":
        unit = np.concatenate([[0], np.cumsum(np.diff(pos) > 1)])
    else:
        raise ValueError(f"unknown control unit {key_set.control_unit!r}")
    units = np.unique(unit)  # sorted: the seeded order does not depend on how positions were listed
    order = np.random.default_rng(seed).permutation(len(units))
    picked = np.concatenate([pos[unit == units[i]] for i in order])[:count]
    return sorted(int(p) for p in picked)


__all__ = ["blocked_attention", "key_block", "head_replaced", "KeySet", "KEY_SETS", "named_keys", "matched_control"]
