"""Each model's head pool per phase (paper Sec. 4.1, App. I.1 "Head pools.", App. M.1 tier E,
App. M.3 "What bottom-40 is.").

A pool is a set of heads with weights summing to one; the pooled attention row of a supervised
position is ``sum_h w_h * bucketize(attn_h)``. Pools are read from a ``head_sets.json``
document (:func:`mistill.instrument.calibration.head_sets_json`): per phase the full ranking of
head names by ``I_c`` and ``importance_c`` in ranking order.

Modes:

* ``top``: the top-k by ``I_c``, ``w = softmax(I_c / tau)``, ``tau`` the s.d. of their ``I_c``
  (:func:`mistill.instrument.calibration.pooled_weights`). Mistill's pool.
* ``bottom``: the k most negative heads (most negative first), carrying the top-k's weight
  profile: weight i of the top-k goes to bottom head i (App. M.3).
* ``random``: k heads drawn without replacement from the heads of the layers the top-k occupies
  ("forty random heads of the same layers", App. M.1), carrying the top-k's weight profile in
  draw order (RandHeads). The draw is seeded by ``(seed, phase)``: one seed gives a different,
  fixed draw per phase.
* ``random_all``: the same, drawn from all heads of the model.
* ``uniform``: every head of the layers the top-k occupies, equal weights (the uniform-pool
  control of App. M.1 tier E).

Top-8 / top-100 pools are ``mode="top"`` with ``k=8`` / ``k=100``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mistill.errors import MistillInputError
from mistill.instrument.calibration import bottom_set, pooled_weights

__all__ = ["Pool", "POOL_MODES", "pool_from_head_sets", "model_pools", "parse_head_names"]

POOL_MODES: tuple[str, ...] = ("top", "bottom", "random", "random_all", "uniform")
_NAME = re.compile(r"^L(\d+)H(\d+)$")


@dataclass(frozen=True)
class Pool:
    """A weighted head pool.

    heads: flat head indices (``layer * n_heads + head``); weights: one per head, summing to 1;
    n_heads: query heads per layer (to split flat indices); name: a label such as
    ``"P2C:top-40"``.
    """

    heads: tuple[int, ...]
    weights: tuple[float, ...]
    name: str
    n_heads: int

    def __post_init__(self) -> None:
        heads = tuple(int(h) for h in self.heads)
        weights = tuple(float(w) for w in self.weights)
        object.__setattr__(self, "heads", heads)
        object.__setattr__(self, "weights", weights)
        if not heads or len(heads) != len(weights):
            raise MistillInputError(f"pool {self.name}: {len(heads)} heads and {len(weights)} "
                                    "weights", field="pool")
        if len(set(heads)) != len(heads) or min(heads) < 0:
            raise MistillInputError(f"pool {self.name}: heads must be distinct flat indices",
                                    field="pool")
        if self.n_heads < 1:
            raise MistillInputError(f"pool {self.name}: n_heads must be positive",
                                    field="n_heads")
        if min(weights) < 0 or abs(sum(weights) - 1.0) > 1e-6:
            raise MistillInputError(f"pool {self.name}: weights must be >= 0 and sum to 1 "
                                    f"(sum {sum(weights)})", field="pool")

    def __len__(self) -> int:
        return len(self.heads)

    @property
    def layers(self) -> tuple[int, ...]:
        """Sorted distinct layers of the pool's heads."""
        return tuple(sorted({h // self.n_heads for h in self.heads}))

    def by_layer(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``layer -> (head-in-layer indices [head] long, weights [head] float32)``, layers in
        ascending order, heads in pool order within a layer."""
        out: dict[int, tuple[list[int], list[float]]] = {}
        for h, w in zip(self.heads, self.weights):
            idx, ws = out.setdefault(h // self.n_heads, ([], []))
            idx.append(h % self.n_heads)
            ws.append(w)
        return {layer: (torch.tensor(out[layer][0], dtype=torch.long),
                        torch.tensor(out[layer][1], dtype=torch.float32))
                for layer in sorted(out)}

    def names(self) -> list[str]:
        """``L{layer}H{head}`` of each head, pool order."""
        return [f"L{h // self.n_heads}H{h % self.n_heads}" for h in self.heads]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "n_heads": self.n_heads, "heads": list(self.heads),
                "head_names": self.names(), "weights": list(self.weights)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Pool":
        return cls(heads=tuple(d["heads"]), weights=tuple(d["weights"]), name=str(d["name"]),
                   n_heads=int(d["n_heads"]))


def parse_head_names(head_names: Sequence[str]) -> int:
    """Check that ``head_names`` are ``L{layer}H{head}`` in flat order; return heads per layer."""
    names = list(head_names)
    parsed = []
    for n in names:
        m = _NAME.match(str(n))
        if m is None:
            raise MistillInputError(f"malformed head name {n!r}; expected L<layer>H<head>",
                                    field="head_names")
        parsed.append((int(m.group(1)), int(m.group(2))))
    if not parsed:
        raise MistillInputError("no head names", field="head_names")
    n_heads = sum(1 for layer, _ in parsed if layer == 0)
    if n_heads == 0 or len(parsed) % n_heads or any(
            p != (i // n_heads, i % n_heads) for i, p in enumerate(parsed)):
        raise MistillInputError("head names are not L{layer}H{head} in flat order "
                                "(layer * n_heads + head)", field="head_names")
    return n_heads


def _importance(head_sets: Mapping[str, Any], phase: str,
                head_names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``([head] I_c by flat index, [head] flat indices in the document's ranking order)``."""
    doc = head_sets.get(phase)
    if not isinstance(doc, Mapping):
        missing = (head_sets.get("meta") or {}).get("phases_missing", [])
        why = " (no note calibrated it)" if phase in missing else ""
        raise MistillInputError(f"head sets have no phase {phase}{why}", field=phase)
    ranking, values = doc.get("ranking"), doc.get("importance_c")
    if not isinstance(ranking, list) or not isinstance(values, list) or \
            len(ranking) != len(values):
        raise MistillInputError("a phase needs 'ranking' and 'importance_c' lists of one "
                                "length", field=f"{phase}.ranking")
    index = {n: i for i, n in enumerate(head_names)}
    if len(ranking) != len(index) or set(ranking) != set(index):
        raise MistillInputError(f"the {phase} ranking does not list every head of the model "
                                f"once ({len(ranking)} names for {len(index)} heads)",
                                field=f"{phase}.ranking")
    x = np.empty(len(index), dtype=float)
    for n, v in zip(ranking, values):
        x[index[n]] = float(v)
    if not np.all(np.isfinite(x)):
        raise MistillInputError("importance_c has non-finite values",
                                field=f"{phase}.importance_c")
    order = np.asarray([index[n] for n in ranking], dtype=np.int64)
    return x, order


def _phase_rng(seed: int, phase: str) -> np.random.Generator:
    tag = int.from_bytes(hashlib.sha256(phase.encode("utf-8")).digest()[:8], "little")
    return np.random.default_rng([int(seed), tag])


def pool_from_head_sets(head_sets: Mapping[str, Any], phase: str, head_names: Sequence[str], *,
                        k: int = 40, mode: str = "top", seed: int = 0) -> Pool:
    """One phase's pool from a ``head_sets.json`` document.

    head_names: every head's name in flat order (``HeadGeometry.head_names()``). k is clipped
    to the number of heads. See the module docstring for the modes; ``seed`` only matters for
    ``random``.
    """
    if mode not in POOL_MODES:
        raise MistillInputError(f"unknown pool mode {mode!r}; use one of {POOL_MODES}",
                                field="mode")
    if int(k) < 1:
        raise MistillInputError("a pool needs k >= 1", field="k")
    n_heads = parse_head_names(head_names)
    x, order = _importance(head_sets, phase, head_names)  # order: the ranking as written
    k = min(int(k), x.size)
    top = order[:k]
    profile = pooled_weights(x, top)
    if mode == "top":
        heads, weights, name = top, profile, f"{phase}:top-{k}"
    elif mode == "bottom":
        heads, weights, name = bottom_set(x, k), profile, f"{phase}:bottom-{k}"
    elif mode in ("random", "random_all"):
        if mode == "random":
            layers = sorted({int(h) // n_heads for h in top})
            candidates = np.asarray([layer * n_heads + h for layer in layers for h in range(n_heads)])
        else:
            candidates = np.arange(x.size)
        heads = candidates[_phase_rng(seed, phase).choice(candidates.size, size=min(k, candidates.size),
                                                          replace=False)]
        # the top-k's profile; renormalised only when the layers hold fewer than k heads
        weights = profile if heads.size == profile.size else profile[:heads.size] / profile[:heads.size].sum()
        name = f"{phase}:{mode}-{k}:seed{int(seed)}"
    else:  # uniform
        layers = sorted({int(h) // n_heads for h in top})
        heads = np.asarray([layer * n_heads + h for layer in layers for h in range(n_heads)])
        weights = np.full(heads.size, 1.0 / heads.size)
        name = f"{phase}:uniform-top{k}-layers{len(layers)}"
    return Pool(heads=tuple(int(h) for h in heads), weights=tuple(float(w) for w in weights),
                name=name, n_heads=n_heads)


def model_pools(head_sets: Mapping[str, Any], head_names: Sequence[str], *, k: int = 40,
                mode: str = "top", seed: int = 0,
                phases: Sequence[str] = ("P1", "P2", "P2C"),
                window_head_sets: Mapping[str, Any] | None = None) -> dict[str, Pool]:
    """A model's pools: one per phase, plus ``P1_window`` for the W window rows before P1
    events.

    ``P1_window`` is built from ``window_head_sets`` (the prose-time set, same document
    format, phase key ``P1``) with the same ``k``/``mode``/``seed`` when given, else it is the
    P1 pool. It is present whenever ``P1`` is among ``phases`` or ``window_head_sets`` is given.
    The teacher's window pool is its prose-time set in the paper (App. I.1); the fallback to the
    P1 (emission) pool is a departure the ``targets`` and ``train`` runs tag
    (:data:`mistill.stages.distill.DEVIATION_P1_WINDOW_EMISSION`). The student's window rows read
    its own P1 pool, as in the paper.
    """
    pools = {ph: pool_from_head_sets(head_sets, ph, head_names, k=k, mode=mode, seed=seed)
             for ph in phases}
    if window_head_sets is not None:
        win = pool_from_head_sets(window_head_sets, "P1", head_names, k=k, mode=mode,
                                  seed=seed)
        pools["P1_window"] = Pool(heads=win.heads, weights=win.weights,
                                  name="P1_window:" + win.name.split(":", 1)[1],
                                  n_heads=win.n_heads)
    elif "P1" in pools:
        pools["P1_window"] = pools["P1"]
    return pools
