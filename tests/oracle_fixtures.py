"""Independent references for the instrument's numbers: plain Hugging Face forwards.

Nothing here imports the instrument. Every quantity is read from a full forward of the model over
the tokens a measurement sees (no key-value cache, no row folding, no late start), with one
forward pre-hook per layer on ``self_attn.o_proj`` that views its input as ``[batch, pos, head,
d_head]`` to read the head outputs ``z`` or replace some of them. The query is always the last
position of the forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

ZFn = Callable[[int, torch.Tensor], "torch.Tensor | None"]


def n_layers_heads(model) -> tuple[int, int, int]:
    """``(layers, heads, d_head)`` from the model's config."""
    cfg = model.config
    d_head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_attention_heads, d_head


@contextlib.contextmanager
def o_proj_hooks(model, fn: ZFn) -> Iterator[None]:
    """Call ``fn(layer, z)`` on every layer's ``o_proj`` input ``z`` ``[batch, pos, head, d_head]``;
    a returned tensor replaces it."""
    _, n_heads, d_head = n_layers_heads(model)
    handles = []

    def make(layer: int):
        def pre(module, args):
            flat = args[0]
            out = fn(layer, flat.view(*flat.shape[:-1], n_heads, d_head))
            if out is None:
                return None
            return (out.reshape(flat.shape),) + tuple(args[1:])
        return pre

    for i, block in enumerate(model.model.layers):
        handles.append(block.self_attn.o_proj.register_forward_pre_hook(make(i)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def last_logits(model, ids: Sequence[int] | torch.Tensor, fn: ZFn | None = None) -> torch.Tensor:
    """The next-token logits ``[vocab]`` at the last position of ``ids`` (one full forward)."""
    x = torch.as_tensor(ids, dtype=torch.long).view(1, -1)
    ctx = o_proj_hooks(model, fn) if fn is not None else contextlib.nullcontext()
    with ctx:
        return model(input_ids=x, use_cache=False, logits_to_keep=1).logits[0, -1]


def margin(logits: torch.Tensor, target: int, competitors: Sequence[int]) -> torch.Tensor:
    """``logit[target] - log sum_c exp(logit[c])``, written out (max-shifted) in float64."""
    x = logits.double()
    comp = x[list(competitors)]
    top = comp.max()
    return x[target] - (top + torch.log(torch.exp(comp - top).sum()))


def mean_z(model, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Per-head mean of ``z`` over every position of ``ids`` ``[layer, head, d_head]``, summed in
    float64 and returned in float32."""
    n_layers, n_heads, d_head = n_layers_heads(model)
    total = torch.zeros(n_layers, n_heads, d_head, dtype=torch.float64)
    count = {}

    def read(layer, z):
        total[layer] += z[0].double().sum(0)
        count[layer] = z.shape[1]

    with torch.no_grad():
        last_logits(model, ids, read)
    assert set(count) == set(range(n_layers)) and len(set(count.values())) == 1
    return (total / count[0]).float()


def clean_z(model, ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z [layer, head, d_head], logits [vocab])`` at the last position of ``ids``."""
    n_layers, _, _ = n_layers_heads(model)
    got = {}

    def read(layer, z):
        got[layer] = z[0, -1].detach().clone()

    with torch.no_grad():
        logits = last_logits(model, ids, read)
    return torch.stack([got[i] for i in range(n_layers)]), logits


def patched_logits(model, ids: Sequence[int] | torch.Tensor, heads: Sequence[int],
                   values: torch.Tensor) -> torch.Tensor:
    """Logits at the last position with the flat ``heads`` (``layer * n_heads + head``) replaced
    there by ``values[layer, head]`` ``[layer, head, d_head]``; every other entry untouched."""
    _, n_heads, _ = n_layers_heads(model)
    by_layer: dict[int, list[int]] = {}
    for h in heads:
        by_layer.setdefault(int(h) // n_heads, []).append(int(h) % n_heads)

    def patch(layer, z):
        if layer not in by_layer:
            return None
        z = z.clone()
        for h in by_layer[layer]:
            z[0, -1, h] = values[layer, h].to(z.dtype)
        return z

    with torch.no_grad():
        return last_logits(model, ids, patch)


def patched_margin(model, ids, target: int, competitors: Sequence[int], heads: Sequence[int],
                   values: torch.Tensor) -> float:
    return float(margin(patched_logits(model, ids, heads, values), target, competitors))


def attribution_autograd(model, ids, target: int, competitors: Sequence[int], mean: torch.Tensor, *,
                         detach: bool) -> torch.Tensor:
    """``A_h = (mu_h - z_h) . d margin / d z_h`` at the last position ``[layer, head]``.

    Each layer's last-position head outputs are replaced by a fresh leaf equal to their clean
    value, so the gradient with respect to that leaf is ``d margin / d z_h``. ``detach=False``:
    the leaf is ``z + 0`` with ``z`` still in the graph (later layers see the earlier leaves),
    so the gradient follows every path; ``detach=True``: the leaf replaces ``z`` outright, so the
    graph is cut at every head output and only each head's path around later heads remains.
    """
    n_layers, _, _ = n_layers_heads(model)
    leaves: dict[int, torch.Tensor] = {}
    clean: dict[int, torch.Tensor] = {}

    def make_leaf(layer, z):
        clean[layer] = z[0, -1].detach().clone()
        leaf = torch.zeros_like(z[0, -1], requires_grad=True)
        leaves[layer] = leaf
        last = (z[0, -1].detach() if detach else z[0, -1]) + leaf
        return torch.cat([z[:, :-1], last.unsqueeze(0).unsqueeze(0)], dim=1)

    with torch.enable_grad():
        m = margin(last_logits(model, ids, make_leaf), target, competitors)
        grads = torch.autograd.grad(m, [leaves[i] for i in range(n_layers)])
    g = torch.stack([x.double() for x in grads])
    z = torch.stack([clean[i] for i in range(n_layers)]).double()
    return ((mean.double() - z) * g).sum(-1)


def attribution_finite_difference(model, ids, target: int, competitors: Sequence[int], mean: torch.Tensor,
                                  head: int, *, detach: bool, step: float = 1e-4,
                                  z0: torch.Tensor | None = None) -> float:
    """The same ``A_h`` as a central difference along ``mu_h - z_h``:
    ``[m(z_h + s v) - m(z_h - s v)] / 2s``, ``v = mu_h - z_h``, every other head of the position
    left to the forward (graph intact) or pinned to its clean value (``detach``: later heads do
    not react, which is what cutting the graph at every head output computes). ``z0``: the clean
    head outputs at the position (read here when not given)."""
    n_layers, n_heads, _ = n_layers_heads(model)
    if z0 is None:
        z0, _ = clean_z(model, ids)
    layer, h = divmod(int(head), n_heads)
    v = mean[layer, h].to(z0.dtype) - z0[layer, h]

    def moved(s):
        def fn(i, z):
            if i == layer:
                z = z.clone()
                z[0, -1, h] = z0[layer, h] + s * v
                return z
            if detach and i > layer:
                z = z.clone()
                z[0, -1] = z0[i]
                return z
            return None
        with torch.no_grad():
            return margin(last_logits(model, ids, fn), target, competitors)

    return float((moved(step) - moved(-step)) / (2 * step))


def reference_necessity(model, ids, query, sets: dict, mean: torch.Tensor) -> dict:
    """Necessity at ``query`` (position, token_id, target_id, competitor_ids) from plain forwards
    of ``ids[:position + 1]``: the clean margin, and per named head set the margin with the set's
    outputs at the query replaced by ``mean`` ``[layer, head, d_head]`` and the share of the
    clean margin destroyed, ``(clean - ablated) / clean``."""
    sub = ids[:query.position + 1]
    t, c = query.target_id, query.competitor_ids
    clean = float(margin(clean_z(model, sub)[1], t, c))
    ablated = {key: patched_margin(model, sub, t, c, heads, mean) for key, heads in sets.items()}
    return {"clean_margin": clean, "ablated_margin": ablated,
            "necessity": {key: (clean - m) / clean for key, m in ablated.items()}}


def reference_knockin(model, clean_ids, clean_query, donor_ids, donor_position: int,
                      sets: dict, n_heads: int) -> dict:
    """Knock-in from plain forwards: the clean run's head outputs at its event (``clean_query`` in
    ``clean_ids``); the corrupted run
    = the donor's tokens before its matched position followed by the clean token; ``m_corr``
    plain, ``m_all`` with every head's output knocked in, ``m_set`` per named set; recovery
    ``(m_set - m_corr) / (m_all - m_corr)``."""
    z, clean_logits = clean_z(model, clean_ids[:clean_query.position + 1])
    corrupted = torch.cat([torch.as_tensor(donor_ids[:donor_position]), torch.tensor([clean_query.token_id])])
    t, c = clean_query.target_id, clean_query.competitor_ids
    m_corr = patched_margin(model, corrupted, t, c, [], z)
    m_all = patched_margin(model, corrupted, t, c, range(n_heads), z)
    m_set = {key: patched_margin(model, corrupted, t, c, heads, z) for key, heads in sets.items()}
    return {"clean_margin": float(margin(clean_logits, t, c)), "m_corr": m_corr, "m_all": m_all, "m_set": m_set,
            "recovery": {key: (m - m_corr) / (m_all - m_corr) for key, m in m_set.items()}}
