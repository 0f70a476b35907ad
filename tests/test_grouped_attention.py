"""The grouped decode attention equals transformers' SDPA attention, and batched generation uses it."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mistill.evaluation.generation import DecodingConfig, generate_hf_many
from mistill.models import grouped_attention as ga
from mistill.models.loading import tiny_model


def _inputs(q_len: int, *, heads: int = 8, kv_heads: int = 2, length: int = 21, dim: int = 16, seed: int = 0):
    """query [3, heads, q_len, dim], key/value [3, kv_heads, length, dim], a left-padded causal
    boolean mask [3, 1, q_len, length] (row r has r * 3 padded positions)."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(3, heads, q_len, dim, generator=g)
    key = torch.randn(3, kv_heads, length, dim, generator=g)
    value = torch.randn(3, kv_heads, length, dim, generator=g)
    mask = torch.ones(3, 1, q_len, length, dtype=torch.bool)
    for r in range(3):
        mask[r, :, :, :3 * r] = False
    for i in range(q_len):  # the last q_len positions are the queries': causal among them
        mask[:, :, i, length - q_len + i + 1:] = False
    return query, key, value, mask


class _Attn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 4


@pytest.mark.parametrize("additive", [False, True])
def test_grouped_equals_sdpa_at_decode_steps(additive: bool) -> None:
    q_len = ga.GROUPED_MAX_QUERY
    query, key, value, mask = _inputs(q_len)
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = _Attn()
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    got, weights = ga.grouped_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert weights is None and got.shape == (3, q_len, 8, 16) == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefill_and_maskless_calls_are_sdpa_unchanged() -> None:
    module = _Attn()
    query, key, value, mask = _inputs(ga.GROUPED_MAX_QUERY + 1, length=30)
    assert torch.equal(ga.grouped_attention_forward(module, query, key, value, mask)[0],
                       sdpa_attention_forward(module, query, key, value, mask)[0])
    query, key, value, _ = _inputs(1)
    assert torch.equal(ga.grouped_attention_forward(module, query, key, value, None)[0],
                       sdpa_attention_forward(module, query, key, value, None)[0])


def test_switch_applies_to_sdpa_models_only_and_restores() -> None:
    lm = tiny_model("qwen3", heads=8, kv_heads=2)
    with ga.use_grouped_decode_attention(lm.model) as switched:
        assert switched and lm.model.config._attn_implementation == ga.GROUPED_ATTENTION
    assert lm.model.config._attn_implementation == "sdpa"
    eager = tiny_model("qwen3", heads=8, kv_heads=2, attn_implementation="eager")
    with ga.use_grouped_decode_attention(eager.model) as switched:
        assert not switched and eager.model.config._attn_implementation == "eager"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_decode_step_logits_match_sdpa(family: str) -> None:
    """A left-padded batch: prefill, then two decode steps, under SDPA and under the grouped path."""
    lm = tiny_model(family, heads=8, kv_heads=2, layers=2, logit_scale=4)
    ids = torch.randint(5, 200, (3, 9), generator=torch.Generator().manual_seed(1))
    att = torch.ones_like(ids)
    att[1, :3] = 0
    att[2, :6] = 0

    def logits() -> torch.Tensor:
        out = lm.model.generate(ids, attention_mask=att, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                eos_token_id=None, output_logits=True, return_dict_in_generate=True,
                                cache_implementation="static", disable_compile=True)
        return torch.stack(out.logits, 1)  # [3, 3, vocab]

    with torch.no_grad():
        want = logits()
        with ga.use_grouped_decode_attention(lm.model):
            got = logits()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_fully_masked_row_stays_finite() -> None:
    query, key, value, mask = _inputs(1)
    mask[1] = False  # a padded query row: nothing to attend to
    out, _ = ga.grouped_attention_forward(_Attn(), query, key, value, mask)
    assert torch.isfinite(out).all()


def test_short_padded_prompts_generate() -> None:
    """Prompts of a few tokens, left-padded together (their prefill has fully padded rows)."""
    lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
    gens = generate_hf_many(lm, [("Code:", 11), ("Code the longer note, please:", 12)], DecodingConfig(max_new_tokens=5))
    assert len(gens) == 2 and all(1 <= g.n_tokens <= 5 for g in gens)


def test_batched_generation_decodes_through_the_grouped_path() -> None:
    calls: list[int] = []

    def counted(module, query, key, value, attention_mask, **kwargs):
        calls.append(int(query.shape[2]))
        return ga.grouped_attention_forward(module, query, key, value, attention_mask, **kwargs)

    lm = tiny_model("qwen3", heads=8, kv_heads=2, logit_scale=8)
    ga.register_grouped_attention()  # the real function first, so that the counted one replaces it
    AttentionInterface.register(ga.GROUPED_ATTENTION, counted)
    try:
        gens = generate_hf_many(lm, [("alpha beta " * 4, 1), ("gamma " * 9, 2)], DecodingConfig(max_new_tokens=4),
                                batch_size=2)
    finally:
        AttentionInterface.register(ga.GROUPED_ATTENTION, ga.grouped_attention_forward)
    assert len(gens) == 2 and all(1 <= g.n_tokens <= 4 for g in gens)
    assert 1 in calls, "decode steps (one query position) went through the grouped function"
    assert lm.model.config._attn_implementation == "sdpa"
