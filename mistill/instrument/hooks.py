"""The head hook: one forward pre-hook per layer on the input of ``o_proj``.

The input of a layer's output projection is the concatenation of its heads' outputs, viewed
here as ``[batch, pos, head, d_head]``; ``z_h(p)`` is head ``h``'s slice at position ``p``.
The hooks are registered once (:class:`HeadHook`) and switched between modes by context
managers that always restore the idle state and release captured tensors:

- idle (no mode): the hook returns ``None`` and the forward is bit-identical to a plain one;
- :meth:`HeadHook.accumulate_mean`: running sum of ``z`` over every position seen, giving the
  per-head mean ``mu_h`` used by mean-ablation;
- :meth:`HeadHook.record`: keep ``z`` at chosen rows (clean values for knock-in);
- :meth:`HeadHook.grad_leaf`: add a zero leaf to ``z`` so one backward yields
  ``d margin / d z_h`` for every head; ``detach=True`` cuts each layer's graph (only each
  head's direct path survives — the defective hook of the paper, kept for the self-test);
- :meth:`HeadHook.patch`: replace chosen ``(row, layer, head)`` entries by given values — the
  means (mean-ablation) or values recorded elsewhere (knock-in) — in one ``torch.where`` per
  layer, whatever the number of variants.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from mistill.models.geometry import HeadGeometry


@dataclass
class MeanAccumulator:
    """Running per-head sum of ``z`` over positions. ``mean``: ``[layer, head, d_head]`` (float32)."""

    total: torch.Tensor  # [layer, head, d_head] float64 on CPU-friendly device
    count: int = 0

    @property
    def mean(self) -> torch.Tensor:
        if self.count == 0:
            raise RuntimeError("no positions accumulated")
        return (self.total / self.count).float()


@dataclass
class Recording:
    """Head outputs recorded at chosen rows: ``values`` ``[row, layer, head, d_head]``."""

    rows: torch.Tensor  # [row] indices into the forward's flattened (batch*pos) rows
    per_layer: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def values(self) -> torch.Tensor:
        layers = sorted(self.per_layer)
        return torch.stack([self.per_layer[i] for i in layers], dim=1)


@dataclass
class GradLeaves:
    """Zero leaves added to ``z`` per layer; after backward, :attr:`grads` is ``d out / d z``."""

    leaves: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def grads(self) -> torch.Tensor:
        """``[batch, pos, layer, head, d_head]`` gradients (zeros where no gradient flowed)."""
        out = []
        for i in sorted(self.leaves):
            g = self.leaves[i].grad
            out.append(torch.zeros_like(self.leaves[i]) if g is None else g)
        return torch.stack(out, dim=2)

    @property
    def z(self) -> torch.Tensor:
        """The clean ``z`` seen by the hook: ``[batch, pos, layer, head, d_head]`` (detached)."""
        return torch.stack([self.values[i] for i in sorted(self.values)], dim=2)


@dataclass
class Patch:
    """Replace ``z`` where ``mask`` is set.

    Attributes:
        mask: bool ``[..., pos, layer, head]`` broadcast against the forward's ``[batch, pos]``
            (e.g. ``[pos, layer, head]`` for variants folded into the position axis).
        values: ``[layer, head, d_head]`` (one value per head, e.g. means) or
            ``[..., pos, layer, head, d_head]`` (per row, e.g. knock-in values).
    """

    mask: torch.Tensor
    values: torch.Tensor


class HeadHook:
    """Pre-hooks on every layer's ``o_proj``, idle unless a mode is active."""

    def __init__(self, geometry: HeadGeometry) -> None:
        self.geometry = geometry
        self._mean: MeanAccumulator | None = None
        self._record: Recording | None = None
        self._grad: GradLeaves | None = None
        self._grad_detach = False
        self._patches: list[Patch] = []
        self._handles = []
        for parts in geometry.layers:
            self._handles.append(parts.o_proj.register_forward_pre_hook(self._make_hook(parts.index)))

    # -- registration ---------------------------------------------------------------------
    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> HeadHook:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    @property
    def idle(self) -> bool:
        return (self._mean is None and self._record is None and self._grad is None
                and not self._patches)

    def _make_hook(self, layer: int):
        def hook(module, args):
            if self.idle:
                return None
            return (self._apply(layer, args[0]),) + tuple(args[1:])
        return hook

    # -- the work done inside the hook ---------------------------------------------------------
    def _apply(self, layer: int, z_flat: torch.Tensor) -> torch.Tensor:
        g = self.geometry
        z = z_flat.view(*z_flat.shape[:-1], g.n_heads, g.d_head)  # [batch, pos, head, d_head]
        if self._patches:
            for p in self._patches:
                m = p.mask[..., layer, :]  # [..., pos, head]
                v = p.values[layer] if p.values.dim() == 3 else p.values[..., layer, :, :]
                z = torch.where(m.unsqueeze(-1), v.to(z.dtype), z)
        if self._mean is not None:
            self._mean.total[layer] += z.detach().reshape(-1, g.n_heads, g.d_head).sum(
                0, dtype=torch.float32).to(self._mean.total.dtype)
            if layer == 0:
                self._mean.count += z.shape[0] * z.shape[1]
        if self._record is not None:
            rows = z.detach().reshape(-1, g.n_heads, g.d_head)
            self._record.per_layer[layer] = rows.index_select(0, self._record.rows.to(rows.device)).clone()
        if self._grad is not None:
            base = z.detach() if self._grad_detach else z
            self._grad.values[layer] = z.detach()
            leaf = torch.zeros_like(z, requires_grad=True)
            self._grad.leaves[layer] = leaf
            z = base + leaf
        return z.reshape(z_flat.shape)

    # -- modes -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate_mean(self, accumulator: MeanAccumulator | None = None) -> Iterator[MeanAccumulator]:
        """Sum ``z`` over every row of every forward inside the block (float64 running sum)."""
        g = self.geometry
        acc = accumulator or MeanAccumulator(
            total=torch.zeros(g.n_layers, g.n_heads, g.d_head, dtype=torch.float64,
                              device=g.embed.weight.device))
        self._mean = acc
        try:
            yield acc
        finally:
            self._mean = None

    @contextlib.contextmanager
    def record(self, rows: Sequence[int] | torch.Tensor) -> Iterator[Recording]:
        """Keep ``z`` at ``rows`` (indices into the flattened ``batch*pos`` rows of the forward)."""
        rec = Recording(rows=torch.as_tensor(rows, dtype=torch.long))
        self._record = rec
        try:
            yield rec
        finally:
            self._record = None

    @contextlib.contextmanager
    def grad_leaf(self, *, detach: bool = False) -> Iterator[GradLeaves]:
        """Expose every head's output as a gradient leaf (graph intact unless ``detach``)."""
        leaves = GradLeaves()
        self._grad, self._grad_detach = leaves, detach
        try:
            yield leaves
        finally:
            self._grad, self._grad_detach = None, False

    @contextlib.contextmanager
    def patch(self, *patches: Patch) -> Iterator[None]:
        """Mean-ablate or knock in: replace ``z`` where each patch's mask is set."""
        self._patches = list(patches)
        try:
            yield
        finally:
            self._patches = []


def head_mask(sets: Sequence[Sequence[int]], geometry: HeadGeometry,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Rows of flat head indices -> bool mask ``[row, layer, head]``."""
    rows = [r for r, heads in enumerate(sets) for _ in heads]
    cols = [h for heads in sets for h in heads]
    m = torch.zeros(len(sets), geometry.n_total_heads, dtype=torch.bool)
    if cols:
        m[torch.tensor(rows), torch.tensor(cols)] = True
    return m.view(len(sets), geometry.n_layers, geometry.n_heads).to(device)
