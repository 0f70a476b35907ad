"""The decode-regime key mask of the evidence-flip test's causal half (App. N.4): at decode steps
the named heads may not read the named key positions, the prefill stays clean, and an empty mask
changes nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import CompileConfig

from mistill.evaluation.generation import DecodingConfig, generate_hf_many
from mistill.models.grouped_attention import KEY_ROWS, decode_key_mask, grouped_attention_forward
from mistill.models.loading import load_model


class _Layer(torch.nn.Module):
    """What the attention function reads of an attention module: its layer and its groups."""

    def __init__(self, layer_idx: int, groups: int = 4) -> None:
        super().__init__()
        self.layer_idx, self.num_key_value_groups, self.is_causal = layer_idx, groups, True


def _reference(q, k, v, mask, blocked):
    """Plain attention per head: ``blocked`` [B, H, S] keys removed, ``mask`` [B, 1, 1, S] padding."""
    heads, kv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv, dim=1).float()
    v = v.repeat_interleave(heads // kv, dim=1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    allowed = mask.expand_as(scores) & ~blocked[:, :, None, :]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ v).transpose(1, 2), probs


def test_the_named_heads_read_nothing_of_the_named_keys_and_the_others_are_untouched():
    g = torch.Generator().manual_seed(0)
    batch, heads, kv, length, dim = 2, 8, 2, 12, 16
    q = torch.randn(batch, heads, 1, dim, generator=g)
    k, v = torch.randn(batch, kv, length, dim, generator=g), torch.randn(batch, kv, length, dim, generator=g)
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    mask[1, ..., :3] = False  # row 1 left-padded by three positions
    layer = 3
    named = [layer * heads + 1, layer * heads + 6, (layer + 1) * heads + 2]  # one head of another layer
    positions = [[4, 5, 9], [3, 7]]
    modules = {i: _Layer(i) for i in range(6)}
    clean, _ = grouped_attention_forward(modules[layer], q, k, v, mask)
    with decode_key_mask(modules, named, heads, positions):
        masked, _ = grouped_attention_forward(modules[layer], q, k, v, mask)
        with pytest.raises(RuntimeError, match="already in force"):
            with decode_key_mask(modules, named, heads, positions):
                pass
    assert not any(vars(m).get(KEY_ROWS) is not None for m in modules.values())  # removed on exit
    with pytest.raises(ValueError, match="no attention module"):
        with decode_key_mask({layer: modules[layer]}, named, heads, positions):
            pass
    blocked = torch.zeros(batch, heads, length, dtype=torch.bool)
    for b, pos in enumerate(positions):
        for h in (1, 6):
            blocked[b, h, pos] = True
    want, probs = _reference(q, k, v, mask, blocked)
    assert torch.allclose(masked.float(), want, atol=1e-5)
    assert probs[:, [1, 6]][blocked[:, [1, 6], None, :]].abs().max() == 0
    others = [h for h in range(heads) if h not in (1, 6)]
    assert torch.equal(masked[:, :, others], clean[:, :, others])  # bit-identical
    with decode_key_mask(modules, named, heads, [[], []]):  # no position: nothing changes
        assert torch.equal(grouped_attention_forward(modules[layer], q, k, v, mask)[0], clean)
    # a prefill (more than one query position) is never masked
    q2 = torch.randn(batch, heads, 4, dim, generator=g)
    causal = torch.ones(batch, 1, 4, length, dtype=torch.bool)
    with decode_key_mask(modules, named, heads, positions):
        assert torch.equal(grouped_attention_forward(modules[layer], q2, k, v, causal)[0],
                           grouped_attention_forward(_Layer(layer), q2, k, v, causal)[0])


@pytest.fixture(scope="module")
def lm():
    """A tiny Qwen3 whose output layer is scaled up for decisive greedy margins."""
    loaded = load_model("tiny:qwen3:seed=3", dtype="float32", device="cpu")
    with torch.no_grad():
        loaded.model.get_output_embeddings().weight.mul_(8.0)
    return loaded


def _greedy_with_mask_reference(lm, prompt: list[int], hidden: list[int], steps: int) -> tuple[list[int], float]:
    """Greedy tokens with a clean prefill, then every head kept from ``hidden`` by the attention
    mask at each decode step; and the smallest top-1 minus top-2 logit gap over the steps."""
    model = lm.model
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
        tokens, gaps = [], []
        for _ in range(steps):
            top = logits.topk(2).values
            gaps.append(float(top[0] - top[1]))
            nxt = int(logits.argmax())
            tokens.append(nxt)
            mask = torch.ones(1, len(prompt) + len(tokens), dtype=torch.long)
            mask[0, hidden] = 0
            out = model(input_ids=torch.tensor([[nxt]]), attention_mask=mask, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
    return tokens, min(gaps)


def test_masking_every_head_is_a_decode_time_attention_mask_and_an_empty_mask_changes_nothing(lm):
    dec = DecodingConfig(max_new_tokens=6)
    texts = ["the patient was seen for chest pain and", "renal function was stable over the week and the"]
    items = [(t, 11 + i) for i, t in enumerate(texts)]
    prompts = [lm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    hidden = [[1, 2, 3], [0, 4]]
    every = list(range(lm.geometry.n_layers * lm.geometry.n_heads))
    got = generate_hf_many(lm, items, dec, batch_size=2, greedy=True, key_masks=hidden, mask_heads=every)
    for gen, prompt, pos in zip(got, prompts, hidden, strict=True):
        want, gap = _greedy_with_mask_reference(lm, prompt, pos, 6)
        assert gap > 1e-3  # no near-tie excuses a difference
        assert gen.token_ids[:len(want)] == want[:len(gen.token_ids)]
    plain = generate_hf_many(lm, items, dec, batch_size=2, greedy=True)
    assert [g.token_ids for g in plain] != [g.token_ids for g in got]  # the mask acts
    # an empty mask (no head, or no position) is the unmasked generation, sampled or greedy
    for heads, masks in (((), hidden), (every, [[], []])):
        for greedy in (True, False):
            same = generate_hf_many(lm, items, dec, batch_size=2, greedy=greedy, key_masks=masks, mask_heads=heads)
            base = generate_hf_many(lm, items, dec, batch_size=2, greedy=greedy)
            assert [g.token_ids for g in same] == [g.token_ids for g in base]
    with pytest.raises(ValueError, match="outside its prompt"):
        generate_hf_many(lm, items, dec, key_masks=[[999], []], mask_heads=every)


def _greedy_hidden_throughout(lm, prompt: list[int], hidden: list[int], steps: int) -> list[int]:
    """Greedy tokens with ``hidden`` removed by the attention mask from the prefill on."""
    model = lm.model
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    mask[0, hidden] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
        tokens = []
        for _ in range(steps):
            nxt = int(logits.argmax())
            tokens.append(nxt)
            mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], dim=1)
            out = model(input_ids=torch.tensor([[nxt]]), attention_mask=mask, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
    return tokens


def test_the_prefill_inclusive_mask_keeps_the_heads_from_the_keys_in_the_prefill_too(lm):
    """App. O's gate: with ``mask_prefill`` every head kept from the hidden positions from the
    prefill on is an attention mask over those positions for the whole generation; the decode
    regime differs from it (the cache was written with them); a prefill without a mask in force
    stays on SDPA, and one head set's prefill mask leaves the other heads' outputs as they were."""
    dec = DecodingConfig(max_new_tokens=6)
    texts = ["the patient was seen for chest pain and", "renal function was stable over the week and the"]
    items = [(t, 5 + i) for i, t in enumerate(texts)]
    prompts = [lm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    hidden = [[2, 3], [1, 4, 5]]  # never the first position: every query keeps a key
    every = list(range(lm.geometry.n_layers * lm.geometry.n_heads))
    both = generate_hf_many(lm, items, dec, batch_size=2, greedy=True, key_masks=hidden, mask_heads=every,
                            mask_prefill=True)
    decode_only = generate_hf_many(lm, items, dec, batch_size=2, greedy=True, key_masks=hidden, mask_heads=every)
    for gen, prompt, pos in zip(both, prompts, hidden, strict=True):
        want = _greedy_hidden_throughout(lm, prompt, pos, 6)
        assert gen.token_ids[:len(want)] == want[:len(gen.token_ids)]
    assert [g.token_ids for g in both] != [g.token_ids for g in decode_only]
    g = torch.Generator().manual_seed(1)
    batch, heads, kv, q_len, dim = 1, 8, 2, 5, 16
    q = torch.randn(batch, heads, q_len, dim, generator=g)
    k, v = torch.randn(batch, kv, q_len, dim, generator=g), torch.randn(batch, kv, q_len, dim, generator=g)
    layer = 2
    module = _Layer(layer)
    clean, _ = grouped_attention_forward(module, q, k, v, None)
    with decode_key_mask({layer: module}, [layer * heads + 3], heads, [[1]], prefill=True):
        masked, _ = grouped_attention_forward(module, q, k, v, None)
    others = [h for h in range(heads) if h != 3]
    assert torch.allclose(masked[:, :, others].float(), clean[:, :, others].float(), atol=1e-5)
    assert not torch.allclose(masked[:, 2:, 3].float(), clean[:, 2:, 3].float(), atol=1e-5)  # queries after key 1
    assert torch.allclose(masked[:, :1, 3].float(), clean[:, :1, 3].float(), atol=1e-5)  # query 0 never saw it


def test_the_compiled_decode_step_reads_each_batchs_mask(lm):
    """The decode step traced whole by ``torch.compile`` (``fullgraph``, dynamo's eager backend:
    the graph capture the CUDA path compiles, without a C++ toolchain) takes the key mask of each
    call: its tokens are the uncompiled masked path's, for two calls with different masks through
    one compiled step, and differ from the unmasked generation."""
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs, **options) -> Callable:  # dynamo's eager backend, counted
        graphs.append(gm)
        return gm.forward

    compiled = CompileConfig(backend=capture, fullgraph=True, dynamic=False)
    compiled._compile_all_devices = True
    dec = DecodingConfig(max_new_tokens=6)
    texts = ["the patient was seen for chest pain and", "renal function was stable over the week and the"]
    items = [(t, 3 + i) for i, t in enumerate(texts)]
    heads = list(range(lm.geometry.n_heads)) + [lm.geometry.n_heads * (lm.geometry.n_layers - 1) + 1]
    torch._dynamo.reset()
    try:
        counts, masked_greedy = [], []
        for hidden in ([[1, 2, 3], [0, 4]], [[5], [2, 3, 6]]):
            for greedy in (True, False):
                eager = generate_hf_many(lm, items, dec, batch_size=2, greedy=greedy, key_masks=hidden,
                                         mask_heads=heads)
                traced = generate_hf_many(lm, items, dec, batch_size=2, greedy=greedy, key_masks=hidden,
                                          mask_heads=heads, compile_config=compiled)
                assert [g.token_ids for g in traced] == [g.token_ids for g in eager], (hidden, greedy)
                counts.append(len(graphs))
                if greedy:
                    masked_greedy.append([g.token_ids for g in traced])
        assert counts[0] >= 1 and counts[-1] == counts[0]  # traced once; a new mask is a new input, not a new graph
        plain = [g.token_ids for g in generate_hf_many(lm, items, dec, batch_size=2, greedy=True,
                                                       compile_config=compiled)]
        assert all(tokens != plain for tokens in masked_greedy)  # each mask acts
    finally:
        torch._dynamo.reset()
