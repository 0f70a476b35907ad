"""One decoding step of a causal LM with its key/value cache, across transformers versions.

transformers 5 renamed the forward argument and output field of the key/value cache from
``past_key_values`` to ``cache`` within the 5.x series (5.17 has the old name, 5.24 the new).
mistill admits every 5.x release, so the few loops that decode token by token go through
:func:`cached_step` instead of naming either.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


@functools.lru_cache(maxsize=32)
def _cache_argument(forward_type: type) -> str:
    """The name of the key/value cache argument of a model class's ``forward``."""
    params = inspect.signature(forward_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which ``model``'s ``forward`` (and ``generate``) take the key/value cache."""
    return _cache_argument(type(model))


def output_cache(out: Any) -> Any:
    """The key/value cache a forward returned (``cache`` or ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    return getattr(out, "past_key_values", None) if cache is None else cache


def cached_step(model: torch.nn.Module, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    """Run ``input_ids`` [1, T] after the positions held in ``cache`` (None at the start).

    Returns the logits [1, T, V] and the cache extended by the T positions.
    """
    res = model(input_ids=input_ids, use_cache=True, **{cache_argument(model): cache})
    return res.logits, output_cache(res)
