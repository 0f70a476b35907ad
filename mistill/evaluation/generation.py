"""Generation with the paper's decoding (App. J.5): thinking mode, temperature 0.6, top-p 0.95,
top-k 20, a sampling seed per note, a 16,384-token cap. HF ``generate`` backend.

Every output records its decoding settings and seed. A generation that reaches the cap is
flagged ``capped`` (invalid for scoring; see :mod:`mistill.evaluation.parsing`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from mistill.config import Config
from mistill.data.corpus import Note
from mistill.evaluation.parsing import THINK_CLOSE, CodeIndex, parse_answer
from mistill.instrument.passes import stable_seed
from mistill.models.decoding import cache_argument, output_cache
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


@dataclass
class PromptPrefill:
    """One forward of a prompt but its last token, kept to serve both the generation and the
    teacher-forced readouts of the same prompt (one prefill instead of two).

    ids: ``[1, P]`` the prompt's token ids; cache: the key/value cache of ``ids[:, :P-1]``;
    hidden: ``[P-1, d_model]`` their final hidden states (after the final norm).
    The cache grows when used: :func:`generate_hf` continues from a copy of it, and
    :func:`mistill.evaluation.m1.final_hidden` (the last to use it) from the cache itself.
    """

    ids: torch.Tensor
    cache: object
    hidden: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[1])


def prompt_ids(lm: LoadedModel, prompt_text: str) -> torch.Tensor:
    """``[1, P]`` token ids of a chat-templated prompt, on the model's device."""
    device = next(lm.model.parameters()).device
    return torch.tensor([lm.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]], device=device)


@torch.no_grad()
def prefill_prompt(lm: LoadedModel, prompt_text: str) -> PromptPrefill:
    """The prompt's :class:`PromptPrefill` (one forward of all but its last token)."""
    ids = prompt_ids(lm, prompt_text)
    if ids.shape[1] < 2:
        raise ValueError("a prompt to prefill needs at least two tokens")
    was = lm.model.training
    lm.model.eval()
    out = lm.model.model(input_ids=ids[:, :-1], use_cache=True)
    lm.model.train(was)
    return PromptPrefill(ids=ids, cache=output_cache(out), hidden=out.last_hidden_state[0])


@torch.no_grad()
def generate_hf(lm: LoadedModel, prompt_text: str, decoding: DecodingConfig, seed: int, *,
                prefill: PromptPrefill | None = None) -> Generation:
    """Sample one completion of ``prompt_text`` (already chat-templated) with HF ``generate``.

    prefill: the prompt's :class:`PromptPrefill`; generation then continues from a copy of its
    cache (the same tokens up to float summation order) instead of prefilling the prompt again.
    """
    tok = lm.tokenizer
    device = next(lm.model.parameters()).device
    ids = prompt_ids(lm, prompt_text)
    extra = {}
    if prefill is not None:
        if not torch.equal(prefill.ids, ids):
            raise ValueError("the prefill is of another prompt")
        extra[cache_argument(lm.model)] = copy.deepcopy(prefill.cache)
    eos = tok.eos_token_id
    was_training = lm.model.training
    lm.model.eval()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                temperature=decoding.temperature, top_p=decoding.top_p, top_k=decoding.top_k,
                                max_new_tokens=decoding.max_new_tokens,
                                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos, **extra)
    lm.model.train(was_training)
    new = out[0, ids.shape[1]:].tolist()
    if eos is not None and eos in new:
        new = new[:new.index(eos) + 1]
    capped = len(new) >= decoding.max_new_tokens and (eos is None or new[-1] != eos)
    return Generation(text=tok.decode(new, skip_special_tokens=True), token_ids=new, n_tokens=len(new),
                      capped=capped, seed=seed, decoding=decoding.to_dict())


def generation_record(note: Note, gen: Generation, index: CodeIndex) -> dict:
    """What is kept of one generation besides its text: ids, seed, decoding, flags and codes."""
    ans = parse_answer(gen.text, index, capped=gen.capped)
    return {"note_id": note.note_id, "split": note.split, "seed": gen.seed,
            "decoding": gen.decoding, "n_tokens": gen.n_tokens, "capped": gen.capped,
            "valid": ans.valid, "parsed": ans.parsed, "reason": ans.reason,
            "closed_think": ans.valid and THINK_CLOSE in gen.text,
            "degenerate": ans.degenerate, "degenerate_reason": ans.degenerate_reason,
            "codes": list(ans.codes), "n_raw": ans.n_raw,
            "n_out_of_inventory": ans.n_out_of_inventory, "n_malformed": ans.n_malformed}
