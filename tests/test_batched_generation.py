"""Batched HF generation with a generator per row (:func:`generate_hf_many`): a prompt's tokens
for a seed do not depend on its batch-mates or the batch size, on tiny random models and the real
embedded SmolLM2-135M; the single-prompt path is the same sampler; outputs follow the input
order; the global RNG is untouched; end tokens, the cap and the dynamic-cache fallback; the
batch-size rule on given numbers.

Why exact equality of token ids across batch sizes is expected: every row draws with its own
``torch.Generator`` (PyTorch's one-sample ``torch.multinomial`` draws one exponential variate
per vocabulary entry, whatever the probabilities), so a row's random numbers are the same in any
batch. What differs with the batch is float summation order (padding and batch size change the
shapes of the matrix products), which moves logits by a few units in the last place; a token
changes only if a draw or a top-k/top-p cut lies that close to a tie. The tiny random models have
near-flat logits, so they run in float64 (differences near 1e-15, far below any gap that occurs in
a few dozen draws); the real SmolLM2 in float32 has peaked distributions.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from transformers import Qwen3ForCausalLM

from gen_fixtures import scripted_model
from mistill.evaluation.backends import HFBackend
from mistill.evaluation.generation import (CPU_BATCH, MAX_AUTO_BATCH, DecodingConfig, choose_batch_size,
                                           generate_hf, generate_hf_many, kv_bytes_per_sequence)
from mistill.evaluation.sampling import SampleRequest, sample_notes
from mistill.models.loading import EMBEDDED_DEFAULT, embedded_tokenizer, load_model

NOTES = ["x",
         "Code: chest pain.",
         "Fracture of the left radius after a fall from a ladder; cast applied.",
         "Type 2 diabetes with chronic kidney disease stage 3, on insulin; hypertension. " * 3,
         "Cough and fever for three days."]
"""User turns of five lengths (a few tokens to about a hundred after the template), so that
every batch of several is left-padded."""

SEEDS = [11, 7, 123456, 2 ** 31 - 1, 0]


def _prompts(tokenizer) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": note}], tokenize=False,
                                          add_generation_prompt=True) for note in NOTES]


def _ids(gens) -> list[list[int]]:
    return [g.token_ids for g in gens]


def _tiny(family: str):
    # load_model's dtype names stop at float32; a torch dtype passes straight through
    return load_model(f"tiny:{family}", dtype=torch.float64)


@pytest.fixture(scope="module")
def smollm2():
    return load_model(EMBEDDED_DEFAULT)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tiny_model_batch_of_one_equals_batch_of_four(family):
    """Five prompts of different lengths: alone (batch 1) and in batches of four (then one), with
    sampling and greedily, give the same token ids per (prompt, seed). Float64, so that the
    near-flat logits of a random model cannot flip a token across batch shapes or CPUs."""
    lm = _tiny(family)
    assert lm.dtype == torch.float64
    items = list(zip(_prompts(lm.tokenizer), SEEDS))
    lengths = {len(lm.tokenizer(p, add_special_tokens=False)["input_ids"]) for p, _ in items}
    assert len(lengths) == len(items)  # every batch is padded
    dec = DecodingConfig(max_new_tokens=16)
    for greedy in (False, True):
        alone = [generate_hf_many(lm, [item], dec, batch_size=1, greedy=greedy)[0] for item in items]
        batched = generate_hf_many(lm, items, dec, batch_size=4, greedy=greedy)
        assert _ids(batched) == _ids(alone), f"greedy={greedy}"
        assert all(g.n_tokens == 16 and g.capped for g in batched)  # a random model never ends early
    sampled = generate_hf_many(lm, items, dec, batch_size=4)
    greedy = generate_hf_many(lm, items, dec, batch_size=4, greedy=True)
    assert _ids(sampled) != _ids(greedy)


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_smollm2_batch_of_one_equals_batch_of_four(smollm2, greedy):
    """The real SmolLM2-135M in float32: the same token ids and texts per (prompt, seed) alone
    and in one batch of four. Its next-token distributions are peaked, so float32 summation-order
    differences (about 1e-6 relative) stay far from any tie in 16 draws."""
    items = list(zip(_prompts(smollm2.tokenizer), SEEDS))[1:]
    dec = DecodingConfig(max_new_tokens=16)
    alone = [generate_hf_many(smollm2, [item], dec, batch_size=1, greedy=greedy)[0] for item in items]
    batched = generate_hf_many(smollm2, items, dec, batch_size=4, greedy=greedy)
    assert _ids(batched) == _ids(alone)
    assert [g.text for g in batched] == [g.text for g in alone]
    assert all(g.n_tokens > 0 for g in batched)


def test_generate_hf_is_the_single_item_case_and_outputs_follow_input_order():
    """generate_hf gives exactly generate_hf_many's completion of one item (one sampler), and a
    batch returns its completions in the order of its items, whatever order it decodes them in.
    Float64 tiny model, for the reason the module docstring gives."""
    lm = _tiny("qwen3")
    dec = DecodingConfig(max_new_tokens=12, seed=5)
    items = list(zip(_prompts(lm.tokenizer), SEEDS))
    single = [generate_hf(lm, prompt, dec, seed) for prompt, seed in items]
    assert single[1] == generate_hf_many(lm, [items[1]], dec)[0]  # every field
    forward = generate_hf_many(lm, items, dec, batch_size=3)
    backward = generate_hf_many(lm, items[::-1], dec, batch_size=2)
    assert forward == single and backward == single[::-1]
    assert [g.seed for g in forward] == SEEDS
    assert forward[0].decoding == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 12, "seed": 5}


def test_seeds_differ_rows_do_not_share_and_global_rng_is_untouched():
    """One prompt with three seeds in one batch gives three samples; a seed repeated in the same
    batch gives the same sample twice (rows never share a stream); the global torch RNG and the
    model's eval/train mode are as they were."""
    lm = _tiny("qwen3")
    prompt = _prompts(lm.tokenizer)[1]
    dec = DecodingConfig(max_new_tokens=12)
    lm.model.train()
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    gens = generate_hf_many(lm, [(prompt, 1), (prompt, 2), (prompt, 3), (prompt, 1)], dec)
    assert torch.equal(torch.get_rng_state(), before)
    assert lm.model.training
    lm.model.eval()
    ids = _ids(gens)
    assert len({tuple(x) for x in ids[:3]}) == 3
    assert ids[3] == ids[0]
    generate_hf(lm, prompt, dec, 9)
    assert torch.equal(torch.get_rng_state(), before) and not lm.model.training


def test_end_tokens_cut_rows_that_end_at_different_steps(tmp_path):
    """A scripted bigram model continues a prompt from its last token: one prompt ends where the
    script starts, one a few script tokens in. Batched, the second row ends (EOS) steps before the
    first; each keeps its tokens up to and including EOS, no padding after, not capped; with a cap
    shorter than the script, both are capped at exactly the cap."""
    script = " violet stapler hummed</think>[\"B27\"]"
    lm = load_model(str(scripted_model(tmp_path / "scripted", script)))
    tok = embedded_tokenizer()
    eos = tok.eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "Code: chest pain."}], tokenize=False,
                                   add_generation_prompt=True)
    script_ids = tok(script, add_special_tokens=False)["input_ids"]
    head = tok.decode(script_ids[:3])
    assert tok(chat + head, add_special_tokens=False)["input_ids"][-3:] == script_ids[:3]
    gens = generate_hf_many(lm, [(chat, 1), (chat + head, 2)], DecodingConfig(max_new_tokens=64))
    assert [g.token_ids for g in gens] == [script_ids + [eos], script_ids[3:] + [eos]]
    assert gens[0].text == script and gens[1].text == tok.decode(script_ids[3:])
    assert not any(g.capped for g in gens) and [g.n_tokens for g in gens] == [len(script_ids) + 1,
                                                                             len(script_ids) - 2]
    short = generate_hf_many(lm, [(chat, 1), (chat + head, 2)], DecodingConfig(max_new_tokens=3))
    assert [g.token_ids for g in short] == [script_ids[:3], script_ids[3:6]]
    assert all(g.capped and g.n_tokens == 3 for g in short)


class _NoStaticQwen3(Qwen3ForCausalLM):
    """A Qwen3 class that does not claim transformers' static-cache support."""

    _can_compile_fullgraph = False


def test_model_without_static_cache_support_falls_back_with_one_warning():
    """A model class not marked static-cache ready decodes with the dynamic cache, says so once,
    and gives the same tokens as the static path (greedy, float64)."""
    lm = _tiny("qwen3")
    items = list(zip(_prompts(lm.tokenizer), SEEDS))[:3]
    dec = DecodingConfig(max_new_tokens=8)
    static = generate_hf_many(lm, items, dec, batch_size=3, greedy=True)
    lm.model.__class__ = _NoStaticQwen3
    caches = []
    hook = lm.model.register_forward_pre_hook(
        lambda _m, _a, kw: caches.append(type(kw.get("cache", kw.get("past_key_values"))).__name__),
        with_kwargs=True)
    try:
        with pytest.warns(RuntimeWarning, match="dynamic cache"):
            dynamic = generate_hf_many(lm, items, dec, batch_size=3, greedy=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            generate_hf_many(lm, items[:1], dec, greedy=True)  # no second warning
    finally:
        hook.remove()
    assert set(caches) == {"DynamicCache"}
    assert _ids(dynamic) == _ids(static)


def test_batch_size_rule():
    """The batch-size rule on given numbers: memory share over bytes per sequence, the cap, the
    CPU default, never more than the items nor fewer than one."""
    gib = 2 ** 30
    assert choose_batch_size(100, gib, 80 * gib) == 40  # half of 80 GiB at 1 GiB a sequence
    assert choose_batch_size(10, gib, 80 * gib) == 10
    assert choose_batch_size(500, gib // 8, 120 * gib) == MAX_AUTO_BATCH == 64
    assert choose_batch_size(100, 4 * gib, gib) == 1  # too big for one: tried anyway
    assert choose_batch_size(100, gib, 80 * gib, memory_fraction=0.25, cap=16) == 16
    assert choose_batch_size(100, gib, None) == CPU_BATCH == 8
    assert choose_batch_size(3, gib, None) == 3 and choose_batch_size(0, gib, None) == 0
    # 40 layers x 2 x 8 kv heads x 128 x (36,000 + 16,384) positions x 2 bytes (bf16)
    from transformers import Qwen3Config

    cfg = Qwen3Config(num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                      hidden_size=5120)
    per_seq = kv_bytes_per_sequence(cfg, 36000 + 16384, torch.bfloat16)
    assert per_seq == 40 * 2 * 8 * 128 * 52384 * 2
    assert choose_batch_size(64, per_seq, 100 * gib) == 6  # 50 GiB / 7.99 GiB
    # a config without kv heads or head width: all heads, hidden size / heads
    plain = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    assert kv_bytes_per_sequence(plain, 100, torch.float32) == 2 * 2 * 4 * 16 * 100 * 4


def test_sample_notes_gives_the_longest_prompts_first_and_keeps_each_notes_seed(tmp_path):
    """The stages' sampling loop calls the engine longest prompt first (the first call sizes the
    static cache of the whole run), and each note's generation is its own, keyed by its id and
    drawn with its seed; a second pass reads every note back without calling the engine."""
    class Recording(HFBackend):  # the real HF backend, its calls' prompts noted
        calls: list[list[str]] = []

        def generate_many(self, items):
            self.calls.append([text for text, _ in items])
            return super().generate_many(items)

    lm = load_model("tiny:qwen3:seed=1", dtype="float32", device="cpu")
    dec = DecodingConfig(max_new_tokens=3)
    texts = ["short", "a much longer prompt than the others here", "middling prompt", "tiny",
             "the second longest of the prompts"]
    requests = [SampleRequest(f"n{i}", t, 100 + i) for i, t in enumerate(texts)]
    out = sample_notes(requests, tmp_path, lambda: Recording(lm, dec), dec.to_dict(), chunk=2)
    flat = [t for call in Recording.calls for t in call]
    assert flat == sorted(texts, key=len, reverse=True) and [len(c) for c in Recording.calls] == [2, 2, 1]
    assert sorted(out) == [r.note_id for r in requests]
    assert all(out[r.note_id].seed == r.seed for r in requests)
    Recording.calls.clear()
    again = sample_notes(requests, tmp_path, lambda: Recording(lm, dec), dec.to_dict(), chunk=2)
    assert Recording.calls == []
    assert {k: g.token_ids for k, g in again.items()} == {k: g.token_ids for k, g in out.items()}
