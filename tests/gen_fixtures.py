"""A real tiny causal LM whose sampled completion is a fixed text, for generation tests.

A randomly initialised model never closes ``</think>``; this one is a tiny Qwen3 with its
attention and MLP outputs zeroed, so each position's logits depend on the current token only
(a bigram model), and with its embeddings and output rows set so that every token of the
script is followed by the next one (then the end-of-turn token) with a logit gap of hundreds of
nats: top-k/top-p sampling at temperature 0.6 then returns the script for every seed. It is
saved as an ordinary model directory, so it loads through ``load_model`` like any checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mistill.models.loading import embedded_tokenizer, tiny_model

D_MODEL = 64


def scripted_model(directory: Path, script: str, *, after: int | None = None, d_head: int = 16) -> Path:
    """Save a model that continues any chat-templated prompt with ``script`` then EOS.

    ``after``: the token the prompt ends with (default: the last token of the tokenizer's
    generation prompt). The script's tokens must be distinct and differ from ``after``.
    ``d_head``: the attention heads' width (vLLM's CPU attention needs 64; the outputs are zeroed
    either way).
    """
    tok = embedded_tokenizer()
    if after is None:
        prompt = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                         add_generation_prompt=True)
        after = tok(prompt, add_special_tokens=False)["input_ids"][-1]
    chain = [after] + tok(script, add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    assert len(set(chain)) == len(chain) and eos not in chain, "script tokens must be distinct"
    assert len(chain) <= D_MODEL, "script too long for the bigram construction"
    lm = tiny_model("qwen3", layers=1, heads=2, kv_heads=1, d_head=d_head, d_model=D_MODEL, seed=0)
    model = lm.model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        head.zero_()
        for i, token in enumerate(chain):
            emb[token].zero_()
            emb[token, i] = 1.0
            head[chain[i + 1] if i + 1 < len(chain) else eos, i] = 40.0
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory
