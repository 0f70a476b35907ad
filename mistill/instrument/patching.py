"""Exact interventions at one event, many variants per forward: mean-ablation and knock-in.

A *variant* is a set of heads whose output at the event position is replaced — by its mean
over the note (mean-ablation) or by a value recorded in another run (knock-in). All variants
of one event run as rows of one forward against the shared prefix (:class:`Runner`, rows
``"own"``); a batch whose heads all sit in layers ``>= l`` starts from the clean residual
stream entering layer ``l`` (captured by the clean forward), so its earlier layers are not
recomputed. Variants are sorted by their lowest layer before batching to make that pay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mistill.instrument.hooks import HeadHook, Patch, head_mask
from mistill.instrument.runner import KVPrefix, Runner


@dataclass(frozen=True)
class Query:
    """One decision read at one position: the token fed there, and the margin's ids.

    ``position``: the query's position id (= prefix length it sees); ``token_id``: the token
    at that position; ``target_id``/``competitor_ids``: the margin's token ids.
    """

    position: int
    token_id: int
    target_id: int
    competitor_ids: tuple[int, ...]


def margins_from_logits(logits: torch.Tensor, target_id: int, competitor_ids: Sequence[int]) -> torch.Tensor:
    """``logit[target] - logsumexp(logit[competitors])`` per row: ``[row, vocab] -> [row]``."""
    comp = torch.as_tensor(list(competitor_ids), dtype=torch.long, device=logits.device)
    return logits[..., target_id] - torch.logsumexp(logits.index_select(-1, comp), dim=-1)


@dataclass
class CleanRead:
    """The unpatched forward at a query: margin, head outputs ``z`` ``[layer, head, d_head]`` and
    the residual stream entering each layer ``hidden_in`` ``[layer, d_model]``."""

    margin: float
    z: torch.Tensor
    hidden_in: torch.Tensor
    logits: torch.Tensor


def clean_read(runner: Runner, hook: HeadHook, prefix: KVPrefix, query: Query) -> CleanRead:
    """Single-token forward at ``query`` against ``prefix[:query.position]``, recording z."""
    with torch.no_grad(), hook.record([0]) as rec:
        out = runner.forward(prefix, query.position, torch.tensor([[query.token_id]]),
                             torch.tensor([query.position]), rows="own", capture_hidden=True)
    logits = out.logits[0, 0]
    m = margins_from_logits(logits, query.target_id, query.competitor_ids)
    return CleanRead(margin=float(m), z=rec.values[0], hidden_in=out.hidden_in[:, 0, 0], logits=logits)


def _lowest_layer(heads: Sequence[int], n_heads: int) -> int:
    return min((h // n_heads for h in heads), default=10 ** 9)


def run_variants(runner: Runner, hook: HeadHook, prefix: KVPrefix, query: Query,
                 variants: Sequence[Sequence[int]], values: torch.Tensor, *,
                 hidden_in: torch.Tensor | None = None, batch_size: int = 256) -> torch.Tensor:
    """Margins with each variant's heads replaced by ``values`` at the query position.

    Args:
        variants: one list of flat head indices per variant (an empty list = no intervention).
        values: ``[layer, head, d_head]`` replacement (the means for mean-ablation, another
            run's clean outputs for knock-in).
        hidden_in: ``[layer, d_model]`` residual stream entering each layer in the unpatched
            forward at this query (enables starting late; ``None`` always starts at layer 0).
    Returns:
        ``[variant]`` float32 margins, in the order given.
    """
    g = runner.geometry
    order = sorted(range(len(variants)), key=lambda i: _lowest_layer(variants[i], g.n_heads))
    result = torch.empty(len(variants), dtype=torch.float32)
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            sets = [variants[i] for i in idx]
            n = len(sets)
            first = min(_lowest_layer(s, g.n_heads) for s in sets)
            # all variants clean above `first`: start there from the clean residual stream
            start_layer = first if hidden_in is not None and first < g.n_layers else 0
            mask = head_mask(sets, g, device=runner.device)  # [row, layer, head]
            start_hidden = None
            if hidden_in is not None and start_layer > 0:
                start_hidden = hidden_in[start_layer].view(1, 1, -1).expand(1, n, -1)
            with hook.patch(Patch(mask=mask, values=values)):
                out = runner.forward(prefix, query.position,
                                     torch.full((1, n), query.token_id, dtype=torch.long),
                                     torch.full((n,), query.position, dtype=torch.long), rows="own",
                                     start_layer=start_layer, start_hidden=start_hidden)
            m = margins_from_logits(out.logits[0], query.target_id, query.competitor_ids)
            result[torch.as_tensor(idx)] = m.float().cpu()
    return result


@dataclass(frozen=True)
class EventVariants:
    """One event's variants for :func:`run_event_variants`: its query, the variants (lists of
    flat head indices) and the clean residual stream entering each layer there, ``hidden_in``
    ``[layer, d_model]`` (None: its rows start at layer 0)."""

    query: Query
    variants: Sequence[Sequence[int]]
    hidden_in: torch.Tensor | None = None


def run_event_variants(runner: Runner, hook: HeadHook, prefix: KVPrefix, events: Sequence[EventVariants],
                       values: torch.Tensor, *, batch_size: int = 256) -> list[torch.Tensor]:
    """:func:`run_variants` for several events of one note at once.

    Every (event, variant) is a row; rows of different events share forwards, each row seeing
    the prefix up to its own event's position (``row_prefix_len``: the keys every row of a
    forward sees take the fused path, the rest the exact float32 path) and its own key, so each
    row is its own single-token forward up to summation order. Rows are sorted by their
    variant's lowest layer (then by event and variant) before batching; a batch starts at the
    lowest layer it patches, from each row's clean residual stream, when every event has one.
    ``prefix.length`` must reach every event's position.

    Returns:
        Per event, ``[variant]`` float32 margins in its variants' order.
    """
    g = runner.geometry
    rows = [(e, v) for e, item in enumerate(events) for v in range(len(item.variants))]
    low = [_lowest_layer(events[e].variants[v], g.n_heads) for e, v in rows]
    order = sorted(range(len(rows)), key=lambda i: (low[i], i))
    out = [torch.empty(len(item.variants), dtype=torch.float32) for item in events]
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            picked = [rows[i] for i in order[start:start + batch_size]]
            first = min(low[i] for i in order[start:start + batch_size])
            can_start = all(events[e].hidden_in is not None for e, _ in picked)
            start_layer = first if can_start and first < g.n_layers else 0
            mask = head_mask([events[e].variants[v] for e, v in picked], g, device=runner.device)
            start_hidden = None
            if start_layer > 0:
                start_hidden = torch.stack([events[e].hidden_in[start_layer] for e, _ in picked]).unsqueeze(0)
            positions = torch.tensor([events[e].query.position for e, _ in picked], dtype=torch.long)
            tokens = torch.tensor([[events[e].query.token_id for e, _ in picked]], dtype=torch.long)
            with hook.patch(Patch(mask=mask, values=values)):
                res = runner.forward(prefix, int(positions.max()), tokens, positions, rows="own",
                                     start_layer=start_layer, start_hidden=start_hidden,
                                     row_prefix_len=positions)
            for e in sorted({e for e, _ in picked}):
                at = [j for j, (ee, _) in enumerate(picked) if ee == e]
                q = events[e].query
                m = margins_from_logits(res.logits[0, torch.as_tensor(at, device=res.logits.device)], q.target_id,
                                        q.competitor_ids)
                out[e][torch.as_tensor([picked[j][1] for j in at])] = m.float().cpu()
    return out


def mean_ablate(runner: Runner, hook: HeadHook, prefix: KVPrefix, query: Query,
                variants: Sequence[Sequence[int]], mean: torch.Tensor, *,
                hidden_in: torch.Tensor | None = None, batch_size: int = 256) -> torch.Tensor:
    """Margins with each variant's heads mean-ablated at the query (``mean`` ``[layer, head, d_head]``)."""
    return run_variants(runner, hook, prefix, query, variants, mean, hidden_in=hidden_in,
                        batch_size=batch_size)


def knock_in(runner: Runner, hook: HeadHook, prefix: KVPrefix, query: Query,
             variants: Sequence[Sequence[int]], clean_z: torch.Tensor, *,
             hidden_in: torch.Tensor | None = None, batch_size: int = 256) -> torch.Tensor:
    """Margins in a corrupted context with each variant's heads set to ``clean_z`` ``[layer, head, d_head]``."""
    return run_variants(runner, hook, prefix, query, variants, clean_z, hidden_in=hidden_in,
                        batch_size=batch_size)


def sequential_patch(runner: Runner, hook: HeadHook, prefix: KVPrefix, query: Query,
                     variants: Sequence[Sequence[int]], values: torch.Tensor) -> torch.Tensor:
    """Reference path: one variant per forward, from layer 0 (for tests and benchmarks)."""
    out = torch.empty(len(variants), dtype=torch.float32)
    for i, heads in enumerate(variants):
        out[i] = run_variants(runner, hook, prefix, query, [heads], values, hidden_in=None, batch_size=1)[0]
    return out
