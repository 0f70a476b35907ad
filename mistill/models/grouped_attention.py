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
reads, stays clean. Every other head attends as before; an empty mask changes nothing. With
``prefill=True`` (App. O's prefill-inclusive evidence mask) the prefill's queries take this path
too and the named heads are kept from the named keys there as well, so no position's cache holds
what those heads would have read of them; the prefill's scores are then materialised in float32
(``[B, KV, G, q, S]`` per layer: fine at App. O's few-thousand-token prompts).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

GROUPED_ATTENTION = "mistill_grouped_decode"
"""The name under which :func:`grouped_attention_forward` is registered with transformers."""

GROUPED_MAX_QUERY = 1
"""Queries of at most this many positions (decode steps) take the grouped path; longer ones
(prefills, however short) SDPA's, whose mask handling of fully padded query rows they keep."""


@dataclass(frozen=True)
class DecodeKeyMask:
    """Key positions some heads may not read at decode steps.

    heads: layer -> the query heads of that layer that are masked.
    positions: per batch row, the key positions (cache indices) those heads may not read.
    prefill: whether the prefill's queries are masked too (else decode steps only).
    """

    heads: Mapping[int, tuple[int, ...]]
    positions: tuple[tuple[int, ...], ...]
    prefill: bool = False
    _built: dict = field(default_factory=dict, compare=False, repr=False)

    def blocked(self, layer: int, n_heads: int, length: int, device: torch.device) -> torch.Tensor | None:
        """``[B, H, S]`` True where layer ``layer``'s head may not read the key (None: no head of
        the layer is masked, or no row has a position). Built once per layer, cache length and
        device: a static cache's decode steps share it."""
        heads = self.heads.get(int(layer), ())
        if not heads or not any(self.positions):
            return None
        key = (int(layer), int(n_heads), int(length), str(device))
        if key not in self._built:
            rows = torch.zeros((len(self.positions), length), dtype=torch.bool)
            for b, pos in enumerate(self.positions):
                if pos:
                    rows[b, list(pos)] = True
            out = torch.zeros((len(self.positions), n_heads, length), dtype=torch.bool)
            out[:, list(heads)] = rows[:, None]
            self._built[key] = out.to(device)
        return self._built[key]


_ACTIVE: list[DecodeKeyMask] = []
"""The decode key mask in force (:func:`decode_key_mask`), at most one."""


@contextlib.contextmanager
def decode_key_mask(heads: Sequence[int], n_heads: int, positions: Sequence[Sequence[int]], *,
                    prefill: bool = False) -> Iterator[None]:
    """Within the block, at every decode step through :func:`grouped_attention_forward` (and, with
    ``prefill``, at the prefill's queries too), the flat heads ``heads`` (``layer * n_heads +
    head``) may not read the key positions ``positions[b]`` of batch row ``b``. Needs the model
    switched with :func:`use_grouped_decode_attention`."""
    if _ACTIVE:
        raise RuntimeError("a decode key mask is already in force")
    by_layer: dict[int, list[int]] = {}
    for flat in sorted({int(h) for h in heads}):
        layer, head = divmod(flat, int(n_heads))
        by_layer.setdefault(layer, []).append(head)
    _ACTIVE.append(DecodeKeyMask({k: tuple(v) for k, v in by_layer.items()},
                                 tuple(tuple(sorted({int(p) for p in row})) for row in positions), bool(prefill)))
    try:
        yield
    finally:
        _ACTIVE.clear()


def _key_block(module: torch.nn.Module, batch: int, heads: int, length: int,
               device: torch.device) -> torch.Tensor | None:
    """The active decode key mask's ``[B, H, S]`` block for ``module``'s layer (None: none)."""
    if not _ACTIVE:
        return None
    mask = _ACTIVE[0]
    if len(mask.positions) != batch:
        raise RuntimeError(f"the decode key mask has {len(mask.positions)} rows, the batch {batch}")
    return mask.blocked(int(module.layer_idx), heads, length, device)


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
    masks_prefill = bool(_ACTIVE) and _ACTIVE[0].prefill
    blocked = _key_block(module, batch, heads, length, query.device) \
        if q_len <= GROUPED_MAX_QUERY or masks_prefill else None
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
