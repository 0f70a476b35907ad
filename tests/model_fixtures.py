"""Helpers that shape tiny random models for tests."""

from __future__ import annotations

import torch


def sharpen(lm, seed: int = 0, *, final_norm: bool = False):
    """Re-draw q/k/v/o (larger q/k) and the q/k norms so attention is far from uniform; with
    ``final_norm`` also perturb the final norm's weight (after the layers, same generator)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.geometry.layers:
            for lin, gain in ((p.q_proj, 1.6), (p.k_proj, 1.6), (p.v_proj, 1.0), (p.o_proj, 1.0)):
                lin.weight.copy_(gain * torch.randn(lin.weight.shape, generator=gen) / lin.weight.shape[1] ** 0.5)
            for norm in (p.q_norm, p.k_norm):
                if norm is not None:
                    norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
        if final_norm:
            lm.geometry.final_norm.weight.copy_(1 + 0.3 * torch.randn(lm.geometry.d_model, generator=gen))
    return lm
