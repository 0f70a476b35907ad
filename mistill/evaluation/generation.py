"""Generation with the paper's decoding (App. J.5): thinking mode, temperature 0.6, top-p 0.95,
top-k 20, a sampling seed per note, a 16,384-token cap. HF ``generate`` backend, many prompts per
call (:func:`generate_hf_many`) or one (:func:`generate_hf`).

Every output records its decoding settings and seed. A generation that reaches the cap is
flagged ``capped`` (invalid for scoring; see :mod:`mistill.evaluation.parsing`).

Per-row seeded sampling. Each row of a batch draws its tokens with a ``torch.Generator`` of its
own, seeded with that row's seed (:class:`SeededSampler`, a logits processor): transformers'
temperature, top-k and top-p warpers, in the order HF applies them when it samples, then one
``torch.multinomial`` draw per row. ``generate`` itself runs with ``do_sample=False`` and so
takes the drawn token. A note's random stream thus depends on its seed alone: not on its
batch-mates, the batch size, the order of the prompts or the global RNG (which is left as it
was). The draw is batch-invariant up to float summation order: padding and batch size change the
shapes of the model's matrix products, so logits can differ in their last bits between a batch
of one and a batch of many, and a token changes only where a draw (or a top-k/top-p cut) falls
within that distance of a tie. :func:`generate_hf` is the single-prompt case of the same sampler,
so a seed gives the same tokens alone and in a batch. These are not the tokens that
``torch.manual_seed(seed)`` with HF's own sampler gives for the same seed.

Batches. :func:`generate_hf_many` tokenizes like :func:`prompt_ids`, sorts the prompts longest
first (less padding; the first batch holds the longest, so memory runs out at once if it does) and
decodes each batch in one ``generate`` call with left padding and an attention mask (HF derives
each row's positions from the mask). Its batch size, unless given, is :func:`choose_batch_size`'s.

Key/value cache and compilation. The batched path preallocates transformers' static cache
(``cache_implementation="static"``), sized once per call for the longest prompt plus
``max_new_tokens`` (``max_cache_len``, where transformers has it), so that every batch of a call
has the same cache shape. On CUDA, transformers compiles the decode step of a static cache by
itself (``torch.compile`` in ``reduce-overhead`` mode, i.e. CUDA graphs; a new batch size
compiles once more), the evidence-flip test's decode-regime key mask included; on CPU nothing is
compiled (``disable_compile``) unless a ``compile_config`` asks for it. A model with SDPA attention
decodes through :mod:`mistill.models.grouped_attention` for the length of the call: its decode
steps read each key/value head once instead of expanding them per query head (``repeat_kv``),
which is most of a long-context step's memory traffic; prefills stay on SDPA. A model class that
transformers does not mark ready for the static cache (``_can_compile_fullgraph``) decodes with
the dynamic cache instead, with one warning. On CUDA, a batch whose longest prompt exceeds
:data:`PREFILL_CHUNK` tokens is prefilled in chunks of that many positions
(``prefill_chunk_size``), so that a batch of very long prompts never needs one forward over all
of them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from mistill.config import Config
from mistill.data.corpus import Note
from mistill.evaluation.parsing import THINK_CLOSE, Answer
from mistill.instrument.passes import stable_seed
from mistill.models.grouped_attention import decode_key_mask, mask_width, use_grouped_decode_attention
from mistill.models.loading import LoadedModel


@dataclass(frozen=True)
class DecodingConfig(Config):
    """The paper's decoding; greedy decoding is not used (it loops in thinking mode)."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    max_new_tokens: int = 16384
    seed: int = 0


@dataclass
class Generation:
    """One sampled completion: its text, token ids, length, whether it hit the cap, its seed."""

    text: str
    token_ids: list[int]
    n_tokens: int
    capped: bool
    seed: int
    decoding: dict


def note_seed(decoding: DecodingConfig, note_id: str) -> int:
    """The sampling seed of one note (independent of any training seed)."""
    return stable_seed(decoding.seed, note_id, "sampling") % (2 ** 31)


def prompt_ids(lm: LoadedModel, prompt_text: str) -> torch.Tensor:
    """``[1, P]`` token ids of a chat-templated prompt, on the model's device."""
    device = next(lm.model.parameters()).device
    return torch.tensor([lm.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]], device=device)


PREFILL_CHUNK = 2048
"""Prompt positions per forward of a chunked prefill (CUDA, static cache): a batch whose longest
prompt is longer is left-padded to a multiple of it, so that every chunk has one shape."""

MAX_AUTO_BATCH = 64
"""The most prompts :func:`choose_batch_size` puts in one ``generate`` call."""

CPU_BATCH = 8
"""Prompts per ``generate`` call on a CPU (and other devices without a memory query)."""

KV_MEMORY_FRACTION = 0.5
"""Share of the free device memory :func:`choose_batch_size` gives to the key/value caches; the
rest is for the prefill's activations, the logits and the compiled decode graphs."""


class SeededSampler(LogitsProcessor):
    """Draw each row's next token with that row's own generator, under ``decoding``.

    ``generators``: one ``torch.Generator`` per batch row, in row order, on the device of the
    scores. A call takes ``input_ids`` ``[B, T]`` and ``scores`` ``[B, V]`` (the logits after
    transformers' other processors), applies transformers' temperature, top-k and top-p warpers
    (in the order ``generate`` applies them when it samples; each only where it changes
    anything, as there), draws one token per row with ``torch.multinomial`` and its generator,
    and returns ``[B, V]`` scores that are 0 at each row's drawn token and -inf elsewhere: a
    ``generate`` call with ``do_sample=False`` then takes exactly the drawn tokens. Rows that
    already ended keep drawing (``generate`` pads them); their draws use only their own
    generators, so no other row's stream moves.
    """

    def __init__(self, decoding: DecodingConfig, generators: Sequence[torch.Generator]) -> None:
        warpers: list[LogitsProcessor] = []
        if decoding.temperature is not None and float(decoding.temperature) != 1.0:
            warpers.append(TemperatureLogitsWarper(float(decoding.temperature)))
        if decoding.top_k is not None and int(decoding.top_k) != 0:
            warpers.append(TopKLogitsWarper(top_k=int(decoding.top_k)))
        if decoding.top_p is not None and float(decoding.top_p) < 1.0:
            warpers.append(TopPLogitsWarper(top_p=float(decoding.top_p)))
        self.warpers = warpers
        self.generators = list(generators)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[0] != len(self.generators):
            raise RuntimeError(f"{scores.shape[0]} rows of scores for {len(self.generators)} generators")
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        probs = torch.softmax(scores, dim=-1)
        drawn = torch.cat([torch.multinomial(probs[row], 1, generator=gen)
                           for row, gen in enumerate(self.generators)])
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, drawn[:, None], 0.0)


def choose_batch_size(n_items: int, kv_bytes_per_sequence: int, free_bytes: int | None, *,
                      cap: int = MAX_AUTO_BATCH, cpu_default: int = CPU_BATCH,
                      memory_fraction: float = KV_MEMORY_FRACTION) -> int:
    """How many prompts to decode per ``generate`` call when the caller does not say.

    ``free_bytes``: the device memory free for this call (CUDA), or None (CPU). On CUDA, as many
    sequences as ``memory_fraction`` of ``free_bytes`` holds at ``kv_bytes_per_sequence`` each
    (:func:`kv_bytes_per_sequence`), at most ``cap``; on CPU ``cpu_default``. Never more than
    ``n_items``, never fewer than one (zero for no items): a single sequence that does not fit is
    tried anyway, and fails with the device's out-of-memory error.
    """
    if n_items <= 0:
        return 0
    if free_bytes is None:
        n = cpu_default
    else:
        n = min(cap, int(free_bytes * memory_fraction) // max(1, int(kv_bytes_per_sequence)))
    return max(1, min(n, n_items))


def kv_bytes_per_sequence(config: Any, n_positions: int, dtype: torch.dtype) -> int:
    """Bytes of key/value cache one sequence of ``n_positions`` positions takes.

    layers x 2 (keys, values) x key/value heads x head width x positions x bytes per element,
    from the model's (text) config: ``num_hidden_layers``, ``num_key_value_heads`` (else
    ``num_attention_heads``), ``head_dim`` (else ``hidden_size / num_attention_heads``). Layers
    with a sliding window are counted at full length (an upper bound).
    """
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return int(cfg.num_hidden_layers) * 2 * kv_heads * head_dim * int(n_positions) * dtype.itemsize


def _free_device_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on a CUDA device: the driver's free memory plus what PyTorch's
    allocator holds unused (a previous batch's cache); None elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


@functools.lru_cache(maxsize=None)
def _generation_option(name: str) -> bool:
    """Whether the installed transformers' ``GenerationConfig`` has the option ``name``."""
    return hasattr(GenerationConfig(), name)


_DYNAMIC_CACHE_WARNED: set[str] = set()


def static_cache_ready(model: torch.nn.Module) -> bool:
    """Whether ``model``'s class takes transformers' static key/value cache.

    transformers marks such classes ``_can_compile_fullgraph`` (its own tests of the static cache
    skip the others); a class that keeps a cache of its own kind (``_supports_default_dynamic_cache``
    false: Mamba-like models) does not take it either. The first time a class is refused, one
    warning says that it decodes with the dynamic cache.
    """
    cls = type(model)
    ready = bool(getattr(cls, "_can_compile_fullgraph", False))
    default_cache = getattr(cls, "_supports_default_dynamic_cache", None)
    if ready and callable(default_cache):
        ready = bool(default_cache())
    if not ready and cls.__qualname__ not in _DYNAMIC_CACHE_WARNED:
        _DYNAMIC_CACHE_WARNED.add(cls.__qualname__)
        warnings.warn(f"{cls.__qualname__} is not marked ready for transformers' static key/value cache: "
                      "generation decodes it with the dynamic cache (no preallocated cache, no compiled "
                      "decode step)", RuntimeWarning, stacklevel=2)
    return ready


def _stop_ids(lm: LoadedModel) -> set[int]:
    """Token ids that end a completion: the tokenizer's EOS and the model's generation EOS ids."""
    ids: set[int] = set()
    for value in (lm.tokenizer.eos_token_id, getattr(getattr(lm.model, "generation_config", None),
                                                     "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _pad_id(lm: LoadedModel, stops: set[int]) -> int:
    """The id written into padding (masked, never attended): the tokenizer's pad, else EOS."""
    tok = lm.tokenizer
    for value in (tok.pad_token_id, tok.eos_token_id):
        if value is not None:
            return int(value)
    return min(stops) if stops else 0


def _run_generate(lm: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, seeds: Sequence[int],
                  decoding: DecodingConfig, *, greedy: bool, options: dict[str, Any]) -> torch.Tensor:
    """One ``generate`` call over a left-padded batch, each row drawn with its own seed.

    input_ids, attention_mask: ``[B, L]`` (padding on the left, mask 0 there); ``seeds``: B seeds;
    ``options``: further ``generate`` arguments (cache, compilation, chunked prefill).
    Returns ``[B, L + N]`` with ``N <= decoding.max_new_tokens``; rows that ended early are padded.
    """
    device = input_ids.device
    stops = _stop_ids(lm)
    processors = LogitsProcessorList()
    if not greedy:
        generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]
        processors.append(SeededSampler(decoding, generators))
    kwargs: dict[str, Any] = dict(attention_mask=attention_mask, do_sample=False, num_beams=1,
                                  temperature=None, top_k=None, top_p=None,
                                  max_new_tokens=int(decoding.max_new_tokens),
                                  pad_token_id=_pad_id(lm, stops), logits_processor=processors)
    if stops:
        kwargs["eos_token_id"] = sorted(stops)
    return lm.model.generate(input_ids, **kwargs, **options)


def _generation(lm: LoadedModel, new: list[int], seed: int, decoding: DecodingConfig, stops: set[int]) -> Generation:
    """A :class:`Generation` from one row's new token ids: cut after the first end token (kept)."""
    cut = next((k for k, token in enumerate(new) if token in stops), None)
    if cut is not None:
        new = new[:cut + 1]
    capped = len(new) >= decoding.max_new_tokens and (not new or new[-1] not in stops)
    return Generation(text=lm.tokenizer.decode(new, skip_special_tokens=True), token_ids=new, n_tokens=len(new),
                      capped=capped, seed=int(seed), decoding=decoding.to_dict())


@torch.no_grad()
def generate_hf_many(lm: LoadedModel, items: Sequence[tuple[str, int]], decoding: DecodingConfig, *,
                     batch_size: int | None = None, greedy: bool = False,
                     key_masks: Sequence[Sequence[int]] | None = None,
                     mask_heads: Sequence[int] = (), mask_prefill: bool = False,
                     compile_config: Any | None = None) -> list[Generation]:
    """Completions of ``(prompt_text, seed)`` pairs (prompts already chat-templated), in the order given.

    The prompts are tokenized like :func:`prompt_ids`, sorted longest first and decoded
    ``batch_size`` at a time, left-padded to ``[B, L]`` with an attention mask, in one HF
    ``generate`` call per batch; each row draws its tokens with its own generator seeded with its
    seed (:class:`SeededSampler`), so a completion depends on its prompt and seed, not on the
    other prompts or the batch size (up to float summation order; see the module docstring).
    ``greedy``: take each row's most likely token instead of drawing (no seed used).

    ``batch_size``: prompts per call; None: :func:`choose_batch_size` (on CUDA from the free
    memory and the key/value bytes of the longest prompt plus ``max_new_tokens``, at most
    :data:`MAX_AUTO_BATCH`; on CPU :data:`CPU_BATCH`). The cache is transformers' static cache
    where the model class takes it (:func:`static_cache_ready`), compiled on CUDA. Prefill
    memory: on CUDA a batch whose prompts exceed :data:`PREFILL_CHUNK` tokens is prefilled in
    chunks of that size; elsewhere (and with a transformers without ``prefill_chunk_size``) a
    batch is prefilled in one forward, whose activations grow with batch size x longest prompt,
    so pass a smaller ``batch_size`` for very long prompts there.

    ``key_masks`` (one per item: token positions of its prompt) and ``mask_heads`` (flat heads
    ``layer * n_heads + head``): the decode-regime key mask of App. N.4. The prompt is prefilled
    clean; at every decode step the named heads may not read the named prompt positions
    (:func:`mistill.models.grouped_attention.decode_key_mask`), in the compiled decode step like
    an unmasked call; with ``mask_prefill`` (App. O's prefill-inclusive mask) the prefill's
    queries are masked too, and that call is not compiled.

    ``compile_config``: transformers' ``CompileConfig`` for the decode step of a static cache. None
    keeps transformers' choice (compiled on CUDA, not on a CPU); one whose ``_compile_all_devices``
    is set compiles on any device (the suite traces the decode step on a CPU this way).

    Each completion keeps its new tokens up to and including the first end token (the
    tokenizer's EOS or one of the model's generation EOS ids), is ``capped`` when it reached
    ``max_new_tokens`` without one, and its text is decoded with special tokens skipped. The
    model's train/eval mode and the global RNG are left as they were.
    """
    pairs = [(str(text), int(seed)) for text, seed in items]
    if not pairs:
        return []
    if batch_size is not None and int(batch_size) < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    model = lm.model
    device = next(model.parameters()).device
    ids = [lm.tokenizer(text, add_special_tokens=False)["input_ids"] for text, _ in pairs]
    if any(len(x) == 0 for x in ids):
        raise ValueError("a prompt to generate from needs at least one token")
    masking = key_masks is not None
    if masking and len(key_masks) != len(pairs):
        raise ValueError(f"{len(key_masks)} key masks for {len(pairs)} prompts")
    if masking and any(not 0 <= int(p) < len(x) for m, x in zip(key_masks, ids) for p in m):
        raise ValueError("a key mask position lies outside its prompt")
    order = sorted(range(len(pairs)), key=lambda i: -len(ids[i]))  # longest first; ties keep their order
    static = static_cache_ready(model)
    chunked = static and device.type == "cuda" and _generation_option("prefill_chunk_size")

    def width(n_tokens: int) -> int:  # a batch's padded length: chunked prefills take whole chunks
        return -(-n_tokens // PREFILL_CHUNK) * PREFILL_CHUNK if chunked and n_tokens > PREFILL_CHUNK else n_tokens

    cache_len = width(len(ids[order[0]])) + int(decoding.max_new_tokens)
    # transformers never shrinks a model's static cache between calls (no recompilation)
    positions = max(cache_len, int(getattr(model, "_previous_max_cache_length", 0) or 0)) if static else cache_len
    if batch_size is None:
        batch_size = choose_batch_size(len(pairs), kv_bytes_per_sequence(model.config, positions, lm.dtype),
                                       _free_device_bytes(device))
    options: dict[str, Any] = {}
    if static:
        options["cache_implementation"] = "static"
        if _generation_option("max_cache_len"):
            options["max_cache_len"] = cache_len  # one cache shape for every batch of the call
    if compile_config is not None:
        options["compile_config"] = compile_config
    elif device.type != "cuda" and _generation_option("disable_compile"):
        options["disable_compile"] = True
    if mask_prefill and masking and _generation_option("disable_compile"):
        options["disable_compile"] = True
    stops = _stop_ids(lm)
    pad = _pad_id(lm, stops)
    attention = {part.index: part.attn for part in lm.geometry.layers} if masking else {}
    out: list[Generation | None] = [None] * len(pairs)
    was_training = model.training
    model.eval()
    try:
        with use_grouped_decode_attention(model):  # decode steps read each key/value head once
            for start in range(0, len(order), int(batch_size)):
                rows = order[start:start + int(batch_size)]
                n = width(len(ids[rows[0]]))
                batch = torch.full((len(rows), n), pad, dtype=torch.long)
                mask = torch.zeros((len(rows), n), dtype=torch.long)
                for r, i in enumerate(rows):
                    batch[r, n - len(ids[i]):] = torch.tensor(ids[i], dtype=torch.long)
                    mask[r, n - len(ids[i]):] = 1
                extra = dict(options)
                if chunked and n > PREFILL_CHUNK:
                    extra["prefill_chunk_size"] = PREFILL_CHUNK
                hidden = [[n - len(ids[i]) + int(p) for p in key_masks[i]] for i in rows] if masking else []
                with decode_key_mask(attention, mask_heads, lm.geometry.n_heads, hidden, prefill=mask_prefill,
                                     width=mask_width(positions)) if masking else nullcontext():
                    seqs = _run_generate(lm, batch.to(device), mask.to(device), [pairs[i][1] for i in rows],
                                         decoding, greedy=greedy, options=extra)
                new_rows = seqs[:, n:].tolist()
                for r, i in enumerate(rows):
                    out[i] = _generation(lm, new_rows[r], pairs[i][1], decoding, stops)
    finally:
        model.train(was_training)
    return [gen for gen in out if gen is not None]


def generate_hf(lm: LoadedModel, prompt_text: str, decoding: DecodingConfig, seed: int) -> Generation:
    """Sample one completion of ``prompt_text`` (already chat-templated) with HF ``generate``: the
    single-prompt case of :func:`generate_hf_many` (the same per-row seeded sampler), so ``seed``
    gives the same tokens here as in any batch."""
    return generate_hf_many(lm, [(prompt_text, seed)], decoding, batch_size=1)[0]


def generation_record(note: Note, gen: Generation, read: Callable[..., Answer]) -> dict:
    """What is kept of one generation besides its text: ids, seed, decoding, flags and codes.

    read: the task's answer reader (:meth:`mistill.tasks.base.Task.answer_reader`)."""
    ans = read(gen.text, capped=gen.capped)
    return {"note_id": note.note_id, "split": note.split, "seed": gen.seed,
            "decoding": gen.decoding, "n_tokens": gen.n_tokens, "capped": gen.capped,
            "valid": ans.valid, "parsed": ans.parsed, "reason": ans.reason,
            "closed_think": ans.valid and THINK_CLOSE in gen.text,
            "degenerate": ans.degenerate, "degenerate_reason": ans.degenerate_reason,
            "codes": list(ans.codes), "n_raw": ans.n_raw,
            "n_out_of_inventory": ans.n_out_of_inventory, "n_malformed": ans.n_malformed}
