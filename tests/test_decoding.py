"""The token-by-token decoding step works with either name transformers gives the key/value cache."""

from __future__ import annotations

import torch

from mistill.models.decoding import cached_step
from mistill.models.loading import tiny_model


class _OlderSignature(torch.nn.Module):
    """A model whose forward takes and returns the cache under transformers' earlier name
    (``past_key_values``), as releases before the rename do; it wraps a real tiny model."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, past_key_values=None, use_cache=True):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        res = self.inner(input_ids=input_ids, use_cache=use_cache, **{"cache": past_key_values})
        out = CausalLMOutputWithPast(logits=res.logits)
        out["past_key_values"] = res.cache
        return out


def _greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    out, cache, step = [], None, ids
    for _ in range(n):
        logits, cache = cached_step(model, step, cache)
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        step = torch.tensor([[nxt]])
    return out


def test_cached_steps_match_full_forward_under_both_cache_names():
    model = tiny_model("llama", seed=3).model.eval()
    ids = torch.tensor([[5, 17, 9, 33, 2, 41]])
    with torch.no_grad():
        new = _greedy(model, ids, 6)
        old = _greedy(_OlderSignature(model), ids, 6)
        full = ids
        for _ in range(6):  # greedy with a full forward each step, no cache
            nxt = model(input_ids=full, use_cache=False).logits[0, -1].argmax()
            full = torch.cat([full, nxt.view(1, 1)], dim=1)
    assert new == old == full[0, ids.shape[1]:].tolist()
