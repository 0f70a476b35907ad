"""Decode-step attention that reads each key/value head once (grouped queries, no ``repeat_kv``).

transformers' SDPA path expands a grouped-query model's key/value heads to one per query head
(``repeat_kv``) whenever it is given a mask, and a left-padded batch over a static cache always
has one. At a decode step, that copy of the whole cache is most of the step's memory traffic:
Qwen3-4B has 32 query heads over 8 key/value heads, so each step reads and writes four times the
cache it needs. :func:`grouped_attention_forward` instead views the ``G = H / KV`` query heads
of a group as ``G`` rows against their shared key/value head, so one batched matrix product per
group reads the cache once:

    scores = (q [B, KV, G*q, D]) @ (k [B, KV, S, D])^T * scaling      -> [B, KV, G*q, S]
    probs  = softmax over S in float32 (masked positions at -inf)
    out    = probs @ v [B, KV, S, D]                                   -> [B, KV, G*q, D]

Query head ``h`` uses key/value head ``h // G``, as ``repeat_kv`` does. The products run in the
model's dtype with float32 accumulation, so the scores are rounded to that dtype before the
float32 softmax: the precision of transformers' eager attention, not of SDPA's fused kernels.

Only decode steps (queries of at most :data:`GROUPED_MAX_QUERY` positions) with a mask take this
path; a prefill, a call without a mask, or a model without grouped heads goes to
transformers' SDPA function unchanged. :func:`use_grouped_decode_attention` switches a loaded
model to it for the length of a ``with`` block (the batched generation path uses it on CUDA);
the name is registered with transformers' attention and mask interfaces, the mask being SDPA's.

The same path carries the decode-regime key mask of the evidence-flip test's causal half (App.
N.4): within :func:`decode_key_mask`, at every decode step the named heads of each layer are
kept from the named key positions of each batch row (their scores set to the float minimum
before the softmax, the rest renormalised), while the prefill, and so the cache every head
reads, stays clean. Every other head attends as before; an empty mask changes nothing. The mask
is held by the masked layers' attention modules, so the compiled decode step of a static cache
(CUDA) takes each batch's mask like any other input of its graph. With
``prefill=True`` (App. O's prefill-inclusive evidence mask) the prefill's queries take this path
too and the named heads are kept from the named keys there as well, so no position's cache holds
what those heads would have read of them; the prefill's scores are then materialised in float32
(``[B, KV, G, q, S]`` per layer: fine at App. O's few-thousand-token prompts).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

GROUPED_ATTENTION = "mistill_grouped_decode"
"""The name under which :func:`grouped_attention_forward` is registered with transformers."""

GROUPED_MAX_QUERY = 1
"""Queries of at most this many positions (decode steps) take the grouped path; longer ones
(prefills, however short) SDPA's, whose mask handling of fully padded query rows they keep."""


KEY_ROWS = "mistill_key_rows"
"""The attribute of a masked layer's attention module holding the key positions each batch row
hides, ``[B, W]`` bool (True: hidden; ``W`` at least the keys' length, see :func:`mask_width`),
set by :func:`decode_key_mask`; one tensor shared by every masked layer."""

KEY_HEADS = "mistill_key_heads"
"""The attribute holding which of that layer's query heads are masked, ``[H]`` bool."""

KEY_PREFILL = "mistill_key_prefill"
"""The attribute saying whether the mask holds at the prefill's queries too (else decode steps only)."""


def mask_width(n_positions: int) -> int:
    """The width of the rows tensor for keys of up to ``n_positions`` positions: the next power of
    two (at least 64). A compiled decode step is traced for one width, so calls whose caches
    differ a little share it."""
    return 1 << max(6, (max(int(n_positions), 1) - 1).bit_length())


def key_block(heads: Sequence[int], n_heads: int, positions: Sequence[Sequence[int]],
              width: int | None = None) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
    """The mask of the flat heads ``heads`` (``layer * n_heads + head``) kept from the key
    positions ``positions[b]`` of batch row ``b``: the rows ``[B, width]`` bool (True: hidden;
    ``width`` defaults to :func:`mask_width` of one past the largest position) and, per layer with
    a masked head, that layer's ``[H]`` bool head vector. ``(None, {})`` when no head or no
    position is named: nothing is masked."""
    by_layer: dict[int, list[int]] = {}
    for flat in sorted({int(h) for h in heads}):
        layer, head = divmod(flat, int(n_heads))
        by_layer.setdefault(layer, []).append(head)
    reach = max((int(p) + 1 for row in positions for p in row), default=0)
    if not by_layer or reach == 0:
        return None, {}
    width = mask_width(reach) if width is None else int(width)
    if width < reach:
        raise ValueError(f"a key mask position ({reach - 1}) lies outside the mask's width {width}")
    rows = torch.zeros((len(positions), width), dtype=torch.bool)
    for b, row in enumerate(positions):
        if row:
            rows[b, sorted({int(p) for p in row})] = True
    vectors = {}
    for layer, named in by_layer.items():
        vector = torch.zeros(int(n_heads), dtype=torch.bool)
        vector[named] = True
        vectors[layer] = vector
    return rows, vectors


@contextlib.contextmanager
def decode_key_mask(attention: Mapping[int, torch.nn.Module], heads: Sequence[int], n_heads: int,
                    positions: Sequence[Sequence[int]], *, prefill: bool = False,
                    width: int | None = None) -> Iterator[None]:
    """Within the block, at every decode step through :func:`grouped_attention_forward` (and, with
    ``prefill``, at the prefill's queries too), the flat heads ``heads`` (``layer * n_heads +
    head``) may not read the key positions ``positions[b]`` of batch row ``b``.

    ``attention``: layer index -> that layer's attention module (the module transformers hands to
    the attention function). The mask lives on those modules (:data:`KEY_ROWS`, :data:`KEY_HEADS`,
    on their device), not in a global, so that a compiled decode step reads it as an input of its
    graph: a batch's new positions are used without a new compilation as long as the batch size,
    the masked layers and ``width`` (:func:`key_block`) stay the same. Needs the model switched
    with :func:`use_grouped_decode_attention`; removed on exit."""
    rows, vectors = key_block(heads, n_heads, positions, width)
    missing = sorted(set(vectors) - set(attention))
    if missing:
        raise ValueError(f"masked heads on layers {missing}, which have no attention module here")
    if any(hasattr(module, KEY_ROWS) for module in attention.values()):
        raise RuntimeError("a decode key mask is already in force")
    touched = []
    try:
        on_device: dict[torch.device, torch.Tensor] = {}
        for layer, vector in vectors.items():
            module = attention[layer]
            device = next(module.parameters(), vector).device
            if device not in on_device:
                on_device[device] = rows.to(device)
            setattr(module, KEY_ROWS, on_device[device])
            setattr(module, KEY_HEADS, vector.to(device))
            setattr(module, KEY_PREFILL, bool(prefill))
            touched.append(module)
        yield
    finally:
        for module in touched:
            for name in (KEY_ROWS, KEY_HEADS, KEY_PREFILL):
                delattr(module, name)


def _key_block(module: torch.nn.Module, batch: int, q_len: int, length: int) -> torch.Tensor | None:
    """``module``'s key mask as ``[B, H, S]`` bool for a call of ``q_len`` queries over ``length``
    keys (None: no mask in force on this layer, or a prefill under the decode regime)."""
    rows = getattr(module, KEY_ROWS, None)
    if rows is None or (q_len > GROUPED_MAX_QUERY and not getattr(module, KEY_PREFILL, False)):
        return None
    if rows.shape[0] != batch:
        raise RuntimeError(f"the decode key mask has {rows.shape[0]} rows, the batch {batch}")
    if rows.shape[1] >= length:
        rows = rows[:, :length]
    else:  # keys beyond the rows' width are never hidden
        rows = torch.nn.functional.pad(rows, (0, length - rows.shape[1]))
    return rows[:, None, :] & getattr(module, KEY_HEADS)[None, :, None]


def grouped_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` [B, H, q, D] over ``key``/``value`` [B, KV, S, D] (H a multiple of KV).

    ``attention_mask``: SDPA's mask, boolean ``[B, 1, q, S]`` (True: attend) or additive float of
    that shape; None for a prefill means causal over the keys, the queries being the last ``q``
    of them (SDPA's ``is_causal``). Returns ``(out [B, q, H, D], None)``, the layout
    transformers' attention functions return. Falls back to :func:`sdpa_attention_forward` for a
    prefill (``q`` above :data:`GROUPED_MAX_QUERY`) unless a prefill-inclusive key mask is in
    force, without a mask, with dropout, or when ``H == KV``.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    blocked = _key_block(module, batch, q_len, length)
    if blocked is not None and attention_mask is None and q_len > 1:  # SDPA would have been causal
        rows = torch.arange(q_len, device=query.device)[:, None] + (length - q_len)
        attention_mask = (torch.arange(length, device=query.device)[None, :] <= rows)[None, None].expand(
            batch, 1, q_len, length)
    if blocked is None and (q_len > GROUPED_MAX_QUERY or attention_mask is None or dropout > 0.0
                            or kv_heads == heads or attention_mask.shape[-1] != length):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    group = heads // kv_heads
    scale = float(scaling) if scaling is not None else dim ** -0.5
    grouped = query.reshape(batch, kv_heads, group * q_len, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).view(batch, kv_heads, group, q_len, length)
    scores = scores.float() * scale
    lowest = torch.finfo(scores.dtype).min  # the float minimum, not -inf: a fully masked row stays finite
    if attention_mask is not None:
        mask = attention_mask[..., :length][:, :, None]  # [B, 1, 1, q, S] against [B, KV, G, q, S]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, lowest)
        else:
            scores = scores + mask.float()
    if blocked is not None:  # the named heads kept from the named keys (App. N.4)
        scores = scores.masked_fill(blocked.view(batch, kv_heads, group, 1, length), lowest)
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(batch, kv_heads, group * q_len, length)
    out = torch.matmul(probs, value).view(batch, heads, q_len, dim)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def register_grouped_attention() -> None:
    """Register :func:`grouped_attention_forward` (with SDPA's mask) with transformers under
    :data:`GROUPED_ATTENTION`, once per process; :func:`use_grouped_decode_attention` does it."""
    # deferred: transformers' attention registries import its modeling stack (about two seconds
    # of every process start, spent here only by a process that decodes)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_ATTENTION, grouped_attention_forward)
    AttentionMaskInterface.register(GROUPED_ATTENTION, sdpa_mask)


def _configs(model: torch.nn.Module) -> list:
    """Every config object of ``model`` (itself and its submodules'), each once."""
    seen: dict[int, object] = {}
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


@contextlib.contextmanager
def use_grouped_decode_attention(model: torch.nn.Module) -> Iterator[bool]:
    """Within the block, ``model``'s SDPA attention runs through :func:`grouped_attention_forward`.

    Yields whether it switched: only a model whose attention is SDPA is switched (an eager or
    flash model is left as it is). The previous implementation is restored on exit.
    """
    register_grouped_attention()
    configs = [cfg for cfg in _configs(model) if cfg._attn_implementation == "sdpa"]
    for cfg in configs:
        cfg._attn_implementation = GROUPED_ATTENTION
    try:
        yield bool(configs)
    finally:
        for cfg in configs:
            cfg._attn_implementation = "sdpa"
