"""Attention rows of chosen heads at chosen positions, recomputed from a layer's input.

Mistill supervises attention only at a few hundred positions per note and through a few
dozen heads (paper App. I.5): instead of asking the model for its full attention matrices
(eager attention over the whole sequence, ``[batch, head, pos, pos]``), the trainer keeps the
input hidden states of the pooled layers (:class:`LayerInputs`) and recomputes, for the chosen
query rows and heads only, the causal softmax with the model's own parts:

``x = input_norm(h)``; ``q = q_norm(x[row] W_Q[h]^T)``; ``k = k_norm(x W_K[kv(h)]^T)``;
rotary on both (skipped on NoPE layers); ``probs = softmax(scaling * q k^T)`` over keys
``<= row``; with GQA a query head ``h`` reads KV head ``kv(h) = h // (n_heads // n_kv_heads)``.

The heads' outputs are rebuilt from the same rows (``z_h = probs_h v_kv(h)``), and
:func:`contribution` turns a pool's outputs into the share of the margin its direct path
writes ([recon]; docs/METHOD.md). :func:`region_mass` is the pooled attention on region buckets.

Numerics: the projections and q/k norms run in the parameters' dtype, exactly as the layer
runs them; rotary, scores, softmax and everything after are float32 with autocast off.
Every function is a pure function of its tensor inputs and the modules, so it can sit inside
``torch.utils.checkpoint`` and gradients reach the model's weights and, through ``hidden_in``,
every earlier layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mistill.errors import MistillInputError
from mistill.models.geometry import HeadGeometry, LayerParts, final_norm_scale

__all__ = ["LayerInputs", "in_plain_forward", "LayerKeys", "layer_keys", "attention_rows", "head_outputs",
           "contribution", "region_mass"]


# --------------------------------------------------------------------------------------------
# Keeping the layers' inputs
# --------------------------------------------------------------------------------------------

def _in_backward() -> bool:
    """True while autograd runs a backward pass (a checkpoint replaying a layer)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def in_plain_forward() -> bool:
    """True when work done now builds an ordinary autograd graph: gradients on, not inside a
    backward replay, and not inside an activation checkpoint's forward (which would drop or
    replay whatever is computed here)."""
    if not torch.is_grad_enabled() or _in_backward():
        return False
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is None


class LayerInputs:
    """Keep the hidden states entering chosen decoder layers (and optionally the final norm).

    A context manager: on entry it registers one forward pre-hook per chosen layer
    (``geometry.layers[l].layer``; ``with_kwargs=True``, so ``hidden_states`` is found whether
    the model passes it positionally or by keyword); on exit it removes the hooks and releases
    the captured tensors. Compute the losses on the recomputed rows inside the block (the
    backward may run after it: autograd holds its own references).

    ``self[l]`` is ``[batch, pos, d_model]``, the very tensor given to the layer, graph intact,
    so a loss on rows recomputed from it backpropagates into this layer's q/k/v weights and
    through the residual stream into every earlier layer. With ``final_residual=True``,
    :attr:`final` is the residual stream entering the final norm ``[batch, pos, d_model]``.

    Gradient checkpointing: the tensor kept is the one the forward pass handed to the layer.
    Where the checkpoint wraps the module call (``torch.utils.checkpoint`` around a layer, or a
    transformers release that checkpoints ``__call__``; 5.24 checkpoints ``forward`` and keeps
    module hooks outside), the backward pass replays the layer and fires the hook again (with
    a detached copy under reentrant checkpointing); replays are recognised (autograd's current
    graph task is set) and ignored, so what is kept is always the forward's tensor, whose graph
    reaches the earlier checkpoints. Each new forward inside the block overwrites the previous
    one's tensors.

    ``on_input(layer, hidden)``, if given, is called with each kept tensor as soon as the layer
    receives it (during the forward pass, replays excluded): work that reads a layer's input can
    run then, so its autograd nodes sit beside the layer's own (see
    :class:`mistill.distill.objective.RowSetBlocks`).
    """

    def __init__(self, geometry: HeadGeometry, layers: Iterable[int], *,
                 final_residual: bool = False,
                 on_input: Callable[[int, torch.Tensor], None] | None = None) -> None:
        self.geometry = geometry
        self.layers = tuple(sorted({int(l) for l in layers}))
        for l in self.layers:
            if not 0 <= l < geometry.n_layers:
                raise MistillInputError(f"layer {l} outside 0..{geometry.n_layers - 1}", field="layers")
        self.want_final = final_residual
        self.on_input = on_input
        self.inputs: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None
        self._handles: list = []

    def _layer_hook(self, layer: int):
        def hook(module, args, kwargs):
            if _in_backward():
                return None
            hidden = args[0] if args else kwargs.get("hidden_states")
            if hidden is None:
                raise RuntimeError(f"layer {layer} was called without hidden_states")
            self.inputs[layer] = hidden
            if self.on_input is not None:
                self.on_input(layer, hidden)
            return None
        return hook

    def _final_hook(self, module, args, kwargs):
        if _in_backward():
            return None
        self.final = args[0] if args else kwargs.get("hidden_states")
        return None

    def __enter__(self) -> LayerInputs:
        try:
            for l in self.layers:
                module = self.geometry.layers[l].layer
                self._handles.append(module.register_forward_pre_hook(self._layer_hook(l),
                                                                      with_kwargs=True))
            if self.want_final:
                self._handles.append(self.geometry.final_norm.register_forward_pre_hook(
                    self._final_hook, with_kwargs=True))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.inputs = {}
        self.final = None

    def __getitem__(self, layer: int) -> torch.Tensor:
        try:
            return self.inputs[layer]
        except KeyError:
            raise KeyError(f"no input captured for layer {layer} (captured: {sorted(self.inputs)})") from None


# --------------------------------------------------------------------------------------------
# Recomputing rows
# --------------------------------------------------------------------------------------------

def _as_index(x, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.long, device=device).reshape(-1)


def _project_heads(linear: nn.Linear, x: torch.Tensor, heads: torch.Tensor, n_total: int,
                   d_head: int) -> torch.Tensor:
    """Only the output rows of ``heads`` of a q/k/v projection: ``[n, d_model] -> [n, h, d_head]``."""
    d_in = linear.weight.shape[1]
    w = linear.weight.reshape(n_total, d_head, d_in).index_select(0, heads).reshape(-1, d_in)
    b = None
    if linear.bias is not None:
        b = linear.bias.reshape(n_total, d_head).index_select(0, heads).reshape(-1)
    return F.linear(x.to(w.dtype), w, b).view(x.shape[0], heads.numel(), d_head)


def _rope(geometry: HeadGeometry, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on ``[h, n, d_head]`` float32 with ``cos``/``sin`` ``[n, d_head]``."""
    y, _ = geometry.apply_rope(x.unsqueeze(0), x.unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0))
    return y[0]


@dataclass
class LayerKeys:
    """One layer's key side for a set of query heads, computed once and shared by row chunks.

    Attributes:
        parts, geometry: the layer and the model.
        heads: ``[h]`` query-head indices within the layer.
        kv_local: ``[h]`` index of each head's KV head within :attr:`kv_heads`.
        kv_heads: ``[kv]`` the KV heads the chosen query heads read.
        normed: ``[pos, d_model]`` ``input_norm(hidden_in)`` (parameter dtype).
        keys: ``[kv, pos, d_head]`` float32, k-norm and rotary applied.
        cos, sin: ``[pos, d_head]`` float32 rotary tables (``None`` on NoPE layers).
    """

    parts: LayerParts
    geometry: HeadGeometry
    heads: torch.Tensor
    kv_local: torch.Tensor
    kv_heads: torch.Tensor
    normed: torch.Tensor
    keys: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    _values: torch.Tensor | None = None

    @property
    def n_pos(self) -> int:
        return self.normed.shape[0]

    @property
    def values(self) -> torch.Tensor:
        """``[kv, pos, d_head]`` float32 values of :attr:`kv_heads` (projected on first use)."""
        if self._values is None:
            g = self.geometry
            with torch.autocast(self.normed.device.type, enabled=False):
                v = _project_heads(self.parts.v_proj, self.normed, self.kv_heads, g.n_kv_heads, g.d_head)
            self._values = v.float().transpose(0, 1)
        return self._values

    def subset(self, heads: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Positions in :attr:`heads` of ``heads`` (each must be one of them): ``[h']``."""
        want = _as_index(heads, self.heads.device)
        hit = want.unsqueeze(1) == self.heads.unsqueeze(0)
        if not bool(hit.any(1).all()):
            raise MistillInputError(f"heads {want.tolist()} not all among {self.heads.tolist()}",
                                    field="heads")
        return hit.float().argmax(1)

    def rows(self, rows: Sequence[int] | torch.Tensor, heads: Sequence[int] | torch.Tensor | None = None
             ) -> torch.Tensor:
        """Causal attention probabilities ``[row, h, pos]`` (float32) of ``heads`` (default: all of
        :attr:`heads`, in that order) at query positions ``rows``; keys after a row get 0."""
        g, parts = self.geometry, self.parts
        r = _as_index(rows, self.normed.device)
        if r.numel() and (int(r.min()) < 0 or int(r.max()) >= self.n_pos):
            raise MistillInputError(f"rows must lie in 0..{self.n_pos - 1}", field="rows")
        sel = (torch.arange(self.heads.numel(), device=r.device) if heads is None
               else self.subset(heads))
        qh = self.heads.index_select(0, sel)
        with torch.autocast(self.normed.device.type, enabled=False):
            q = _project_heads(parts.q_proj, self.normed.index_select(0, r), qh, g.n_heads, g.d_head)
            if parts.q_norm is not None:
                q = parts.q_norm(q)
            q = q.float().transpose(0, 1)  # [h, row, d_head]
            if self.cos is not None:
                q = _rope(g, q, self.cos.index_select(0, r), self.sin.index_select(0, r))
            k = self.keys.index_select(0, self.kv_local.index_select(0, sel))  # [h, pos, d_head]
            scores = torch.matmul(q, k.transpose(1, 2)) * parts.scaling  # [h, row, pos]
            future = torch.arange(self.n_pos, device=r.device).unsqueeze(0) > r.unsqueeze(1)
            scores = scores.masked_fill(future.unsqueeze(0), float("-inf"))
            return torch.softmax(scores, dim=-1).transpose(0, 1)  # [row, h, pos]

    def outputs(self, probs: torch.Tensor, heads: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Head outputs ``z`` ``[row, h, d_head]`` (float32) from rows ``probs`` ``[row, h, pos]``."""
        sel = (torch.arange(self.heads.numel(), device=self.heads.device) if heads is None
               else self.subset(heads))
        if probs.shape[1] != sel.numel() or probs.shape[2] > self.n_pos:
            raise MistillInputError(f"probs of shape {tuple(probs.shape)} do not fit {sel.numel()} heads "
                                    f"over {self.n_pos} positions", field="probs")
        n = probs.shape[2]
        v = self.values.index_select(0, self.kv_local.index_select(0, sel))[:, :n]  # [h, pos, d_head]
        with torch.autocast(probs.device.type, enabled=False):
            return torch.matmul(probs.float().transpose(0, 1), v).transpose(0, 1)


def layer_keys(parts: LayerParts, geometry: HeadGeometry, hidden_in: torch.Tensor,
               heads: Sequence[int] | torch.Tensor, position_ids: Sequence[int] | torch.Tensor) -> LayerKeys:
    """Project one layer's keys once for the query ``heads`` (indices within the layer).

    Args:
        hidden_in: ``[pos, d_model]`` the residual stream entering the layer.
        heads: ``[h]`` query heads; only their KV heads' keys are projected.
        position_ids: ``[pos]`` rotary positions of the tokens.
    """
    g = geometry
    if hidden_in.dim() != 2 or hidden_in.shape[1] != g.d_model:
        raise MistillInputError(f"hidden_in must be [pos, {g.d_model}], got {tuple(hidden_in.shape)}",
                                field="hidden_in")
    device = hidden_in.device
    h = _as_index(heads, device)
    if h.numel() and (int(h.min()) < 0 or int(h.max()) >= g.n_heads):
        raise MistillInputError(f"head indices must lie in 0..{g.n_heads - 1} (within the layer)",
                                field="heads")
    pos_ids = _as_index(position_ids, device)
    if pos_ids.numel() != hidden_in.shape[0]:
        raise MistillInputError(f"{pos_ids.numel()} position ids for {hidden_in.shape[0]} positions",
                                field="position_ids")
    kv_of = torch.div(h, g.n_groups, rounding_mode="floor")
    kv_heads, kv_local = torch.unique(kv_of, sorted=True, return_inverse=True)
    normed = parts.input_norm(hidden_in)
    cos = sin = None
    with torch.autocast(device.type, enabled=False):
        k = _project_heads(parts.k_proj, normed, kv_heads, g.n_kv_heads, g.d_head)
        if parts.k_norm is not None:
            k = parts.k_norm(k)
        k = k.float().transpose(0, 1)  # [kv, pos, d_head]
        if parts.use_rope:
            ref = torch.empty(0, dtype=torch.float32, device=device)
            cos, sin = g.rotary(ref, pos_ids.unsqueeze(0))
            cos, sin = cos[0].float(), sin[0].float()
            k = _rope(g, k, cos, sin)
    return LayerKeys(parts=parts, geometry=g, heads=h, kv_local=kv_local, kv_heads=kv_heads,
                     normed=normed, keys=k, cos=cos, sin=sin)


def attention_rows(parts: LayerParts, geometry: HeadGeometry, hidden_in: torch.Tensor,
                   rows: Sequence[int] | torch.Tensor, heads: Sequence[int] | torch.Tensor,
                   position_ids: Sequence[int] | torch.Tensor, *,
                   keys: LayerKeys | None = None) -> torch.Tensor:
    """Causal attention probabilities of chosen query heads at chosen positions.

    Args:
        parts: the layer (``geometry.layers[l]``).
        hidden_in: ``[pos, d_model]`` residual stream entering the layer (from :class:`LayerInputs`).
        rows: ``[row]`` query positions (indices into ``pos``).
        heads: ``[h]`` head indices within the layer.
        position_ids: ``[pos]`` rotary positions.
        keys: a :func:`layer_keys` result for this layer to reuse (its heads must include ``heads``).
    Returns:
        ``[row, h, pos]`` float32; row ``r`` is a distribution over keys ``0..rows[r]``.
    """
    if keys is None:
        keys = layer_keys(parts, geometry, hidden_in, heads, position_ids)
        return keys.rows(rows)
    return keys.rows(rows, heads)


def head_outputs(parts: LayerParts, geometry: HeadGeometry, hidden_in: torch.Tensor,
                 probs: torch.Tensor, heads: Sequence[int] | torch.Tensor, *,
                 keys: LayerKeys | None = None) -> torch.Tensor:
    """The heads' outputs rebuilt from attention rows: ``z_h = probs_h @ v_kv(h)``.

    Equal to the slice of ``o_proj``'s input for those heads at those rows.

    Args:
        hidden_in: ``[pos, d_model]``; probs: ``[row, h, pos]`` from :func:`attention_rows`;
        heads: ``[h]`` head indices within the layer (same order as ``probs``).
    Returns:
        ``z`` ``[row, h, d_head]`` float32.
    """
    if keys is None:
        # values only: no query/key work; position ids are irrelevant to v
        g = geometry
        h = _as_index(heads, hidden_in.device)
        kv_of = torch.div(h, g.n_groups, rounding_mode="floor")
        kv_heads, kv_local = torch.unique(kv_of, sorted=True, return_inverse=True)
        keys = LayerKeys(parts=parts, geometry=g, heads=h, kv_local=kv_local, kv_heads=kv_heads,
                         normed=parts.input_norm(hidden_in), keys=torch.empty(0), cos=None, sin=None)
        return keys.outputs(probs)
    return keys.outputs(probs, heads)


# --------------------------------------------------------------------------------------------
# Contribution c and region mass m
# --------------------------------------------------------------------------------------------

def _competitors(competitor_ids: Sequence[Sequence[int]], competitor_logits, n_rows: int,
                 device: torch.device, detach: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ids ``[row, comp]`` and softmax weights ``[row, comp]`` (0 on padding).

    Fast path: ``competitor_ids`` a ``[row, comp]`` tensor padded with ``-1`` and
    ``competitor_logits`` a ``[row, comp]`` tensor (values at padding ignored)."""
    if isinstance(competitor_ids, torch.Tensor):
        ids = competitor_ids.to(device)
        if ids.shape[0] != n_rows or not isinstance(competitor_logits, torch.Tensor) \
                or competitor_logits.shape != ids.shape:
            raise MistillInputError("padded competitor ids and logits must both be [row, comp]",
                                    field="competitor_ids")
        mask = ids >= 0
        logits = competitor_logits.to(device, torch.float32)
        logits = (logits.detach() if detach else logits).masked_fill(~mask, float("-inf"))
        return ids.clamp_min(0), torch.softmax(logits, dim=-1).masked_fill(~mask, 0.0)
    if len(competitor_ids) != n_rows:
        raise MistillInputError(f"{len(competitor_ids)} competitor lists for {n_rows} rows",
                                field="competitor_ids")
    width = max((len(c) for c in competitor_ids), default=0)
    if width == 0 or any(len(c) == 0 for c in competitor_ids):
        raise MistillInputError("every row needs at least one competitor", field="competitor_ids")
    ids = torch.zeros(n_rows, width, dtype=torch.long, device=device)
    mask = torch.zeros(n_rows, width, dtype=torch.bool, device=device)
    rows_logits = []
    stacked = None if isinstance(competitor_logits, (list, tuple)) else competitor_logits
    if stacked is None and len(competitor_logits) != n_rows:
        raise MistillInputError(f"{len(competitor_logits)} competitor-logit rows for {n_rows} rows",
                                field="competitor_logits")
    for r, c in enumerate(competitor_ids):
        n = len(c)
        ids[r, :n] = torch.as_tensor(list(c), dtype=torch.long, device=device)
        mask[r, :n] = True
        row = stacked[r, :n] if stacked is not None else torch.as_tensor(competitor_logits[r]).reshape(-1)
        if row.numel() != n:
            raise MistillInputError(f"row {r}: {row.numel()} competitor logits for {n} competitors",
                                    field="competitor_logits")
        row = row.to(device, torch.float32)
        rows_logits.append(F.pad(row.detach() if detach else row, (0, width - n), value=float("-inf")))
    weights = torch.softmax(torch.stack(rows_logits), dim=-1)
    return ids, weights.masked_fill(~mask, 0.0)


def contribution(z_by_layer: Mapping[int, torch.Tensor],
                 heads_by_layer: Mapping[int, Sequence[int] | torch.Tensor],
                 weights_by_layer: Mapping[int, Sequence[float] | torch.Tensor], geometry: HeadGeometry,
                 final_residual: torch.Tensor, target_ids: Sequence[int] | torch.Tensor,
                 competitor_ids: Sequence[Sequence[int]], competitor_logits, margins: torch.Tensor, *,
                 frozen: bool = True) -> torch.Tensor:
    """``c``: the pooled heads' direct-path contribution to the margin, divided by the margin.

    With ``W_O[:, h]`` the columns of layer ``l``'s ``o_proj`` that read head ``h``, ``g`` and
    ``eps`` the final RMSNorm's weight and epsilon, ``x`` the clean final residual at the row,
    ``W_U`` the unembedding, ``t`` the target and ``C`` the competitors::

        v    = sum_l sum_{h in pool_l} w_h W_O[:, h] z_h              (pooled direct write, [d_model])
        dy   = g * v * rsqrt(mean(x^2) + eps)                        (final norm, scale frozen at x)
        u    = W_U[t] - sum_{c in C} softmax(logits_C)_c W_U[c]      (d margin / d logits, mapped back)
        c    = (dy . u) / margin

    ``u`` is the gradient of ``margin = logit_t - logsumexp(logits_C)`` with respect to the
    final-norm output; ``dy . u`` is the first-order margin change written directly by the pool
    (``o_proj``'s bias, not attributable to a head, is left out). Small margins make ``c``
    large; the caller decides what to do with them.

    Args:
        z_by_layer: ``{layer: [row, h, d_head]}`` head outputs at the rows.
        heads_by_layer: ``{layer: [h]}`` head indices within the layer (order of ``z``).
        weights_by_layer: ``{layer: [h]}`` pool weights ``w_h``.
        final_residual: ``[row, d_model]`` residual stream entering the final norm.
        target_ids: ``[row]``; competitor_ids: ``row`` lists of ids, or ``[row, comp]`` padded
            with ``-1`` (then ``competitor_logits`` is ``[row, comp]`` too).
        competitor_logits: ``row`` 1-D tensors of the clean logits at the competitors, or a
            ``[row, comp]`` tensor (entries past a row's list ignored).
        margins: ``[row]`` the clean margins.
        frozen: detach the linearisation point (the norm scale and the competitor softmax), so
            gradients reach ``c`` only through ``z``, ``W_O``, ``g``, ``W_U`` and ``margins``.
    Returns:
        ``[row]`` float32.
    """
    g = geometry
    n_rows = final_residual.shape[0]
    device = final_residual.device
    if set(z_by_layer) != set(heads_by_layer) or set(z_by_layer) != set(weights_by_layer):
        raise MistillInputError("z_by_layer, heads_by_layer and weights_by_layer must share their layers",
                                field="layers")
    with torch.autocast(device.type, enabled=False):
        v = torch.zeros(n_rows, g.d_model, dtype=torch.float32, device=device)
        for l, z in z_by_layer.items():
            heads = _as_index(heads_by_layer[l], device)
            w = torch.as_tensor(weights_by_layer[l], device=device).float().reshape(-1)
            if z.shape != (n_rows, heads.numel(), g.d_head) or w.numel() != heads.numel():
                raise MistillInputError(f"layer {l}: z {tuple(z.shape)}, {heads.numel()} heads and "
                                        f"{w.numel()} weights do not fit {n_rows} rows", field="z")
            w_o = g.layers[l].o_proj.weight.reshape(g.d_model, g.n_heads, g.d_head).index_select(1, heads)
            v = v + torch.einsum("rhd,mhd,h->rm", z.float(), w_o.float(), w)
        x = final_residual.detach() if frozen else final_residual
        scale = final_norm_scale(g, x)  # [row]
        dy = g.final_norm.weight.float() * v * scale.unsqueeze(-1)  # [row, d_model]
        t = _as_index(target_ids, device)
        if t.numel() != n_rows:
            raise MistillInputError(f"{t.numel()} targets for {n_rows} rows", field="target_ids")
        c_ids, c_w = _competitors(competitor_ids, competitor_logits, n_rows, device, detach=frozen)
        w_u = g.lm_head.weight
        d_target = (dy * w_u.index_select(0, t).float()).sum(-1)  # [row]
        d_comp = torch.einsum("rm,rcm->rc", dy, w_u[c_ids].float())  # [row, comp]
        direct = d_target - (c_w * d_comp).sum(-1)
        return direct / torch.as_tensor(margins, device=device).float().reshape(-1)


def region_mass(bucket_rows: torch.Tensor, region: Sequence[Sequence[int]]) -> torch.Tensor:
    """``m``: the pooled attention on each row's region buckets.

    Args:
        bucket_rows: ``[row, bucket]`` pooled bucket rows ``a_bar``.
        region: one list of bucket indices per row (duplicates count once), or a ``[row, bucket]``
            bool mask.
    Returns:
        ``[row]`` ``sum_{b in region[r]} a_bar[r, b]`` (differentiable in ``bucket_rows``).
    """
    n_rows, n_buckets = bucket_rows.shape
    if isinstance(region, torch.Tensor):
        if region.shape != bucket_rows.shape or region.dtype != torch.bool:
            raise MistillInputError(f"region mask must be bool {tuple(bucket_rows.shape)}", field="region")
        return (bucket_rows * region).sum(-1)
    if len(region) != n_rows:
        raise MistillInputError(f"{len(region)} regions for {n_rows} rows", field="region")
    mask = torch.zeros(n_rows, n_buckets, dtype=torch.bool, device=bucket_rows.device)
    for r, buckets in enumerate(region):
        idx = _as_index(list(buckets), bucket_rows.device)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n_buckets):
            raise MistillInputError(f"row {r}: region buckets outside 0..{n_buckets - 1}", field="region")
        mask[r, idx] = True
    return (bucket_rows * mask).sum(-1)
