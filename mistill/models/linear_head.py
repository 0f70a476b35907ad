"""The retriever's supervised head: one-vs-rest logistic regression over every inventory code.

Features are standardised with the training notes' mean and standard deviation; the weights
start at zero and the biases at the (smoothed) log-odds of each code's training prevalence, so
a code never seen in training starts, and stays, near the bottom. The loss is each code's mean
binary cross-entropy over the notes, summed over codes (independent per-code regressions), plus
``l2 / 2 * ||W||^2``; Adam runs ``epochs`` passes over the notes in mini-batches whose order
comes from a generator seeded with ``seed``. Training runs in float32 on CPU, so two trainings
on the same data give the same weights.

Scoring (:meth:`LinearHead.logits`) is batch-invariant: every note's row is computed on its own
in float64, each code's logit as the same element-wise product and sum over that code's weight
row. A note's scores are therefore bit-identical whichever notes it is scored with, and codes
whose weights are identical (e.g. codes never positive in training) get identical logits, so a
ranking breaks their tie by its own rule rather than by the position of the code in a matrix
kernel's blocking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mistill.errors import MistillInputError

__all__ = ["LinearHead", "train_linear_head"]

# codes scored at once by LinearHead.logits: a [block, n_features] float64 block of at most this
# many elements (128 KiB). Below ATen's parallel grain (32768 elements) a block is reduced on one
# thread, which is also the fastest here; the block size does not change any logit
_BLOCK_ELEMENTS = 1 << 14


@dataclass
class LinearHead:
    """A trained head. ``weight [n_codes, n_features]``, ``bias [n_codes]``, and the feature
    standardisation ``mean, scale [n_features]``."""

    weight: torch.Tensor
    bias: torch.Tensor
    mean: torch.Tensor
    scale: torch.Tensor

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Scores of every code: ``x [n, n_features] -> [n, n_codes]`` float64 logits.

        Row ``i`` depends on ``x[i]`` alone and is computed the same way for any ``n`` (module
        doc): no matrix product whose kernel, and so whose summation order, changes with the
        number of rows.
        """
        if x.ndim != 2 or x.shape[1] != self.weight.shape[1]:
            raise MistillInputError(f"features of shape {tuple(x.shape)}; the head expects "
                                    f"[n, {self.weight.shape[1]}]", field="features")
        n_codes, n_features = self.weight.shape
        z = (x.detach().cpu().double() - self.mean.double()) / self.scale.double()  # [n, f]
        bias = self.bias.double()
        out = torch.empty(x.shape[0], n_codes, dtype=torch.float64)
        step = max(1, _BLOCK_ELEMENTS // max(1, n_features))
        for c0 in range(0, n_codes, step):
            w = self.weight[c0:c0 + step].double()  # [block, f]
            for i in range(x.shape[0]):
                # each code's own reduction over its contiguous weight row: the same for every
                # code, block and note
                out[i, c0:c0 + step] = (w * z[i]).sum(-1) + bias[c0:c0 + step]
        return out


def train_linear_head(x: torch.Tensor, y: torch.Tensor, *, l2: float = 1e-3, lr: float = 1e-2,
                      epochs: int = 200, batch_size: int = 512, seed: int = 0) -> LinearHead:
    """Fit the head on ``x [n_notes, n_features]`` and 0/1 labels ``y [n_notes, n_codes]``."""
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise MistillInputError(f"features {tuple(x.shape)} and labels {tuple(y.shape)} do not "
                                "pair up as [n, f] and [n, c]", field="features")
    n = x.shape[0]
    if n == 0:
        raise MistillInputError("no training notes for the linear head", field="train")
    if epochs < 1 or batch_size < 1 or lr <= 0 or l2 < 0:
        raise MistillInputError("epochs and batch_size must be positive, lr > 0, l2 >= 0",
                                field="head")
    x = x.detach().float().cpu()
    y = y.detach().float().cpu()
    mean = x.mean(0)
    scale = x.std(0, unbiased=False).clamp_min(1e-6)
    xs = (x - mean) / scale
    prevalence = (y.sum(0) + 0.5) / (n + 1.0)
    weight = torch.zeros(y.shape[1], x.shape[1], requires_grad=True)
    bias = torch.log(prevalence / (1 - prevalence)).clone().requires_grad_(True)
    opt = torch.optim.Adam([weight, bias], lr=lr)
    gen = torch.Generator().manual_seed(int(seed))
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        for s in range(0, n, batch_size):
            idx = order[s:s + batch_size]
            logits = xs[idx] @ weight.T + bias
            # one logistic regression per code: each code's mean loss over the batch, summed
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                logits, y[idx], reduction="sum") / len(idx)
            loss = loss + 0.5 * l2 * weight.pow(2).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return LinearHead(weight=weight.detach(), bias=bias.detach(), mean=mean, scale=scale)
