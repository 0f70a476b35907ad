"""First-order attribution of every head at one event, and its fidelity self-test.

``A_h = (mu_h - z_h) . d margin / d z_h`` estimates the change of the margin when head ``h`` is
mean-ablated at the event, so the first-order estimate of the importance
``I_h = margin - margin(h mean-ablated)`` is ``-A_h``. One sign convention everywhere:
importance positive = the head supports the emitted choice.

One forward and one backward at the event position give ``A_h`` for all heads. With the graph
intact (default) the gradient follows every path through later layers; ``detach=True`` cuts the
graph at every layer's head outputs, keeping only each head's direct path (the paper's
defective hook, kept for the self-test).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mistill import stats
from mistill.instrument.hooks import HeadHook
from mistill.instrument.patching import Query, margins_from_logits, mean_ablate
from mistill.instrument.runner import KVPrefix, Runner
from mistill.models.geometry import HeadGeometry, final_norm_scale


@dataclass
class FirstOrder:
    """Result of one attribution at one event.

    ``margin``: clean margin; ``importance``: ``[layer * head]`` first-order estimate of ``I_h``
    (= ``-A_h``); ``z``: ``[layer, head, d_head]`` clean head outputs; ``hidden_in``:
    ``[layer, d_model]`` residual stream entering each layer (clean); ``logits``: ``[vocab]``;
    ``final_hidden``: ``[d_model]`` the residual stream entering the final norm (clean).
    """

    margin: float
    importance: torch.Tensor
    z: torch.Tensor
    hidden_in: torch.Tensor
    logits: torch.Tensor
    final_hidden: torch.Tensor | None = None


def first_order(runner: Runner, hook: HeadHook, prefix: KVPrefix, query: Query, mean: torch.Tensor,
                *, detach: bool = False) -> FirstOrder:
    """Forward + backward at ``query``: the first-order importance of every head.

    Args:
        mean: ``[layer, head, d_head]`` per-head means over the note (from the prefill).
    """
    with torch.enable_grad(), hook.grad_leaf(detach=detach) as leaves:
        out = runner.forward(prefix, query.position, torch.tensor([[query.token_id]]),
                             torch.tensor([query.position]), rows="own", capture_hidden=True)
        m = margins_from_logits(out.logits[0, 0], query.target_id, query.competitor_ids)
        m.backward()
        grads = leaves.grads[0, 0].float()  # [layer, head, d_head]
        z = leaves.z[0, 0]
    a = ((mean.float().to(z.device) - z.float()) * grads).sum(-1)  # A_h [layer, head]
    return FirstOrder(margin=float(m.detach()), importance=(-a).flatten().detach().cpu(),
                      z=z.detach(), hidden_in=out.hidden_in[:, 0, 0].detach(),
                      logits=out.logits[0, 0].detach(), final_hidden=out.final_hidden[0, 0].detach())


def exact_importance(runner: Runner, hook: HeadHook, prefix: KVPrefix, query: Query,
                     mean: torch.Tensor, heads: Sequence[int], clean_margin: float, *,
                     hidden_in: torch.Tensor | None = None, batch_size: int = 256) -> torch.Tensor:
    """``I_h = margin - margin(h mean-ablated)`` for each head in ``heads`` (one variant each)."""
    ablated = mean_ablate(runner, hook, prefix, query, [[h] for h in heads], mean,
                          hidden_in=hidden_in, batch_size=batch_size)
    return clean_margin - ablated


def nominees(first_order_importance: torch.Tensor, running_global: Sequence[int], top: int = 40) -> list[int]:
    """The event's top ``top`` heads by ``|A_h|`` (exact ties by lower flat index) plus the
    running global heads, deduplicated."""
    k = min(top, first_order_importance.numel())
    order = torch.sort(first_order_importance.abs(), descending=True, stable=True).indices
    picked = order[:k].tolist()
    for h in running_global:
        if h not in picked:
            picked.append(h)
    return picked


def fidelity(first_order_importance: np.ndarray, exact: np.ndarray, *, top: int = 20) -> dict[str, float]:
    """Agreement of first-order and exact importances over all heads at one event (Table 8).

    Returns Pearson, Spearman, the overlap of the two top-``top`` sets (by absolute value) and
    the share of the exact top-``top``'s summed absolute effect captured by attribution's top.
    """
    fo = np.asarray(first_order_importance, dtype=np.float64)
    ex = np.asarray(exact, dtype=np.float64)
    top_fo = set(np.argsort(-np.abs(fo), kind="stable")[:top].tolist())
    top_ex = np.argsort(-np.abs(ex), kind="stable")[:top]
    denom = np.abs(ex[top_ex]).sum()
    return {
        "pearson": stats.pearson(fo, ex) if fo.std() > 0 and ex.std() > 0 else float("nan"),
        "spearman": stats.spearman(fo, ex) if fo.std() > 0 and ex.std() > 0 else float("nan"),
        "top_overlap": float(len(top_fo & set(top_ex.tolist()))),
        "share_captured": float(np.abs(ex[list(top_fo)]).sum() / denom) if denom > 0 else float("nan"),
    }


def first_order_batch(runner: Runner, hook: HeadHook, prefix: KVPrefix, queries: Sequence[Query],
                      mean: torch.Tensor, *, detach: bool = False) -> list[FirstOrder]:
    """:func:`first_order` for several events of one note in one forward and one backward.

    Each event is a row that sees exactly what its own single-token forward sees (the prefix up
    to its position and its own key), so rows are independent and the gradient of the summed
    margins gives each event its own ``d margin / d z``. Requires ``prefix.length`` >= every
    position.
    """
    if not queries:
        return []
    n = len(queries)
    ids = torch.tensor([[q.token_id for q in queries]])
    pos = torch.tensor([q.position for q in queries])
    with torch.enable_grad(), hook.grad_leaf(detach=detach) as leaves:
        out = runner.forward(prefix, int(pos.max()), ids, pos, rows="own", capture_hidden=True,
                             row_prefix_len=pos)
        margins = torch.stack([margins_from_logits(out.logits[0, i], q.target_id, q.competitor_ids)
                               for i, q in enumerate(queries)])
        margins.sum().backward()
        grads = leaves.grads[0].float()  # [row, layer, head, d_head]
        z = leaves.z[0]
    a = ((mean.float().to(z.device).unsqueeze(0) - z.float()) * grads).sum(-1)  # [row, layer, head]
    imp = (-a).flatten(1).detach().cpu()
    return [FirstOrder(margin=float(margins[i].detach()), importance=imp[i], z=z[i].detach(),
                       hidden_in=out.hidden_in[:, 0, i].detach(), logits=out.logits[0, i].detach(),
                       final_hidden=out.final_hidden[0, i].detach())
            for i in range(n)]


def direct_effects(geometry: HeadGeometry, z: torch.Tensor, final_hidden: torch.Tensor, logits: torch.Tensor,
                   queries: Sequence[Query]) -> torch.Tensor:
    """Each head's direct-path effect on the margin in nats at each event, ``[event, layer * head]``
    float32.

    The head's write ``W_O[:, h] z_h`` taken through the final RMSNorm with its scale frozen at
    the clean residual ``x`` and projected on the margin direction in the unembedding,
    ``u = W_U[t] - sum_c softmax(logits_C)_c W_U[c]`` (the gradient of ``logit_t -
    logsumexp(logits_C)`` with respect to the norm's output)::

        direct_h = (g * W_O[:, h] z_h * rsqrt(mean(x^2) + eps)) . u

    the direct-logit attribution of the margin (Sec. 2.3). Divided by the clean margin it is the
    contribution ``c`` of a one-head pool in the distillation objective's interaction term
    (Sec. 4.1); ``o_proj``'s bias belongs to no head and is left out. The events of one call
    share each layer's float32 copy of ``W_O`` (one copy per call, not per event).

    Args:
        z: ``[event, layer, head, d_head]`` clean head outputs; final_hidden: ``[event, d_model]``;
            logits: ``[event, vocab]`` clean logits at the queries; queries: one per event.
    """
    g = geometry
    x = final_hidden.float()
    w_u = g.lm_head.weight
    rows = []
    for i, q in enumerate(queries):
        comp = torch.as_tensor(list(q.competitor_ids), dtype=torch.long, device=x.device)
        w_c = torch.softmax(logits[i].float().to(x.device).index_select(-1, comp), dim=-1)
        rows.append(w_u[q.target_id].float() - (w_c.unsqueeze(-1) * w_u.index_select(0, comp).float()).sum(0))
    j = g.final_norm.weight.float() * final_norm_scale(g, x).unsqueeze(-1) * torch.stack(rows)  # [event, d_model]
    out = [torch.einsum("ehd,mhd,em->eh", z[:, l].float().to(x.device),
                        parts.o_proj.weight.float().reshape(g.d_model, g.n_heads, g.d_head), j)
           for l, parts in zip(range(z.shape[1]), g.layers)]
    return torch.cat(out, dim=1).detach().cpu()
