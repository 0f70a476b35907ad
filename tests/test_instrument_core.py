"""Invariants of the hook, the prefix runner, patching and attribution on tiny random models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mistill.instrument.attribution import exact_importance, fidelity, first_order, nominees
from mistill.instrument.hooks import HeadHook, Patch, head_mask
from mistill.instrument.patching import (Query, clean_read, knock_in, mean_ablate, sequential_patch)
from mistill.instrument.runner import Runner
from mistill.models.loading import tiny_model

FAMILIES = ["qwen3", "llama"]


@pytest.fixture(scope="module", params=FAMILIES)
def lm(request):
    return tiny_model(request.param, layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=3)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2000, (n,), generator=g)


def _query(ids: torch.Tensor, pos: int) -> Query:
    return Query(position=pos, token_id=int(ids[pos]), target_id=11, competitor_ids=(12, 13, 14, 15))


def test_noop_hook_is_bit_identical(lm):
    ids = _ids(64)[None]
    with torch.no_grad():
        plain = lm.model(ids).logits
        hook = HeadHook(lm.geometry)
        try:
            hooked = lm.model(ids).logits
        finally:
            hook.remove()
    assert torch.equal(plain, hooked)


def test_zeroing_all_heads_equals_zeroing_attention_output(lm):
    g = lm.geometry
    ids = _ids(48)[None]
    layer = 1
    mask = torch.zeros(1, g.n_layers, g.n_heads, dtype=torch.bool)
    mask[0, layer] = True
    zeros = torch.zeros(g.n_layers, g.n_heads, g.d_head)
    with torch.no_grad():
        hook = HeadHook(g)
        try:
            with hook.patch(Patch(mask=mask, values=zeros)):
                via_hook = lm.model(ids).logits
        finally:
            hook.remove()
        handle = g.layers[layer].attn.register_forward_hook(
            lambda mod, args, out: (torch.zeros_like(out[0]),) + tuple(out[1:]))
        try:
            via_output = lm.model(ids).logits
        finally:
            handle.remove()
    torch.testing.assert_close(via_hook, via_output, rtol=0, atol=1e-6)


def test_runner_matches_plain_forward(lm):
    ids = _ids(200, 1)
    with torch.no_grad():
        ref = lm.model(ids[None]).logits[0].float()
    runner = Runner(lm, chunk_size=48)
    prefix, logits = runner.prefill(ids, logits_at=torch.arange(200))
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    q = _query(ids, 150)
    clean = clean_read(runner, HeadHook(lm.geometry), prefix, q)
    torch.testing.assert_close(clean.logits, ref[150], rtol=1e-4, atol=1e-4)


def test_gradient_forward_reproduces_plain_margin(lm):
    ids = _ids(120, 2)
    runner = Runner(lm, chunk_size=64)
    hook = HeadHook(lm.geometry)
    with hook.accumulate_mean() as acc:
        prefix, _ = runner.prefill(ids)
    q = _query(ids, 100)
    plain = clean_read(runner, hook, prefix, q).margin
    for detach in (False, True):
        fo = first_order(runner, hook, prefix, q, acc.mean, detach=detach)
        assert fo.margin == pytest.approx(plain, abs=1e-5)
    assert acc.count == 120


def test_batched_patching_equals_sequential(lm):
    g = lm.geometry
    ids = _ids(150, 4)
    runner = Runner(lm, chunk_size=64)
    hook = HeadHook(g)
    with hook.accumulate_mean() as acc:
        prefix, _ = runner.prefill(ids)
    q = _query(ids, 140)
    clean = clean_read(runner, hook, prefix, q)
    rng = np.random.default_rng(0)
    variants = [[]] + [[h] for h in range(g.n_total_heads)] + [
        sorted(rng.choice(g.n_total_heads, size=4, replace=False).tolist()) for _ in range(6)]
    batched = mean_ablate(runner, hook, prefix, q, variants, acc.mean, hidden_in=clean.hidden_in, batch_size=5)
    seq = sequential_patch(runner, hook, prefix, q, variants, acc.mean)
    torch.testing.assert_close(batched, seq, rtol=1e-4, atol=1e-4)
    assert batched[0] == pytest.approx(clean.margin, abs=1e-4)


def test_knock_in_all_heads_reproduces_clean_margin(lm):
    g = lm.geometry
    clean_ids, donor_ids = _ids(130, 5), _ids(160, 6)
    runner = Runner(lm, chunk_size=64)
    hook = HeadHook(g)
    clean_prefix, _ = runner.prefill(clean_ids)
    donor_prefix, _ = runner.prefill(donor_ids)
    all_heads = list(range(g.n_total_heads))
    for qa, qb in [(120, 150), (90, 40), (60, 100)]:
        q_clean = _query(clean_ids, qa)
        clean = clean_read(runner, hook, clean_prefix, q_clean)
        # corrupted run: the clean token at the donor's event position, in the donor's context
        q_corr = Query(position=qb, token_id=q_clean.token_id, target_id=q_clean.target_id,
                       competitor_ids=q_clean.competitor_ids)
        corr = clean_read(runner, hook, donor_prefix, q_corr)
        m = knock_in(runner, hook, donor_prefix, q_corr, [[], all_heads], clean.z, hidden_in=corr.hidden_in)
        assert m[0] == pytest.approx(corr.margin, abs=1e-4)
        assert m[1] == pytest.approx(clean.margin, abs=1e-4)


def test_attribution_correlates_with_exact_patching():
    lm = tiny_model("qwen3", layers=4, heads=4, kv_heads=2, d_head=16, d_model=64, seed=7)
    g = lm.geometry
    ids = _ids(160, 8)
    runner = Runner(lm, chunk_size=64)
    hook = HeadHook(g)
    with hook.accumulate_mean() as acc:
        prefix, _ = runner.prefill(ids)
    pearsons = []
    for pos in (150, 120, 90):
        q = _query(ids, pos)
        fo = first_order(runner, hook, prefix, q, acc.mean)
        exact = exact_importance(runner, hook, prefix, q, acc.mean, range(g.n_total_heads), fo.margin,
                                 hidden_in=fo.hidden_in)
        pearsons.append(fidelity(fo.importance.numpy(), exact.numpy())["pearson"])
    # mean-ablation of one head on a tiny random model is nearly linear: first order tracks it
    assert min(pearsons) > 0.9


@pytest.mark.parametrize("family", ["qwen2", "smollm3"])
def test_runner_and_knock_in_on_other_families(family):
    # Qwen2 carries q/k/v biases; SmolLM3 skips rotary on every fourth layer (NoPE)
    lm = tiny_model(family, layers=4, heads=4, kv_heads=2, d_head=16, d_model=64, seed=5)
    g = lm.geometry
    assert g.family == family
    if family == "smollm3":
        assert [p.use_rope for p in g.layers] == [True, True, True, False]
    ids = _ids(140, 12)
    with torch.no_grad():
        ref = lm.model(ids[None]).logits[0].float()
    runner, hook = Runner(lm, chunk_size=48), HeadHook(g)
    prefix, logits = runner.prefill(ids, logits_at=torch.arange(140))
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    q = _query(ids, 130)
    prefix.crop(130)
    clean = clean_read(runner, hook, prefix, q)
    m = knock_in(runner, hook, prefix, q, [list(range(g.n_total_heads))], clean.z, hidden_in=clean.hidden_in)
    assert m[0].item() == pytest.approx(clean.margin, abs=1e-5)


def test_nominees_break_exact_ties_by_lower_head_index():
    # 40 heads, |A_h| in three tied groups: 3.0 (heads 30, 5), 1.0 (every tenth from 0), 0 (the rest)
    imp = torch.zeros(40)
    imp[[30, 5]] = torch.tensor([3.0, -3.0])
    imp[[0, 10, 20, 35]] = torch.tensor([1.0, -1.0, 1.0, 1.0])
    assert nominees(imp, [], top=8) == [5, 30, 0, 10, 20, 35, 1, 2]
    # running global heads follow, without repeats
    assert nominees(imp, [2, 39], top=8) == [5, 30, 0, 10, 20, 35, 1, 2, 39]


def test_head_mask_rows():
    lm = tiny_model("llama", layers=2, heads=3, kv_heads=1, d_head=8, d_model=24)
    m = head_mask([[0, 4], [], [5]], lm.geometry)
    assert m.shape == (3, 2, 3)
    assert m[0, 0, 0] and m[0, 1, 1] and m.sum() == 3 and m[2, 1, 2]


def test_batched_first_order_equals_per_event(lm):
    ids = _ids(180, 9)
    runner = Runner(lm, chunk_size=64)
    hook = HeadHook(lm.geometry)
    with hook.accumulate_mean() as acc:
        prefix, _ = runner.prefill(ids)
    from mistill.instrument.attribution import first_order_batch

    positions = [170, 140, 141, 60, 5]
    queries = [_query(ids, p) for p in positions]
    for detach in (False, True):
        batch = first_order_batch(runner, hook, prefix, queries, acc.mean, detach=detach)
        for q, b in zip(queries, batch):
            single = first_order(runner, hook, prefix, q, acc.mean, detach=detach)
            assert b.margin == pytest.approx(single.margin, abs=1e-5)
            torch.testing.assert_close(b.importance, single.importance, rtol=1e-4, atol=1e-5)


def test_math_prefix_attention_gradient_matches_autograd():
    from mistill.instrument import runner as rmod

    torch.manual_seed(0)
    q = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(2, 40, 8, dtype=torch.float64), torch.randn(2, 40, 8, dtype=torch.float64)
    limit = torch.tensor([40, 10, 1, 25, 40, 3])
    old = rmod._KEY_CHUNK
    rmod._KEY_CHUNK = 7  # several chunks
    try:
        out, lse = rmod.prefix_attention(q, k, v, 0.3, row_limit=limit)
        (out.sum() * 0.7 + (lse * torch.arange(6)).sum()).backward()
        g_custom = q.grad.clone()
    finally:
        rmod._KEY_CHUNK = old
    q.grad = None
    s = (q @ k.transpose(-1, -2)) * 0.3
    s = s.masked_fill(torch.arange(40)[None, None] >= limit[None, :, None], float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    ref_out = torch.softmax(s, -1) @ v
    (ref_out.sum() * 0.7 + (ref_lse * torch.arange(6)).sum()).backward()
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_custom.double(), q.grad, rtol=1e-4, atol=1e-5)


def test_prefix_attention_split_at_the_shortest_limit_equals_the_masked_path():
    """Keys every row sees take the unmasked path, the rest the masked one, merged through the
    lse: output, lse and d/dq equal the masked math path over every key (float64)."""
    from mistill.instrument import runner as rmod

    torch.manual_seed(1)
    k, v = torch.randn(2, 50, 8, dtype=torch.float64), torch.randn(2, 50, 8, dtype=torch.float64)
    limit = torch.tensor([50, 23, 17, 31, 17])
    w = torch.randn(5, dtype=torch.float64)
    got = []
    for split in (True, False):
        q = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
        if split:
            out, lse = rmod.prefix_attention(q, k, v, 0.4, row_limit=limit)
        else:
            out, lse = rmod._MathPrefixAttention.apply(q, k, v, 0.4, limit)
        (out.sum() + (lse * w).sum()).backward()
        got.append((out.detach().double(), lse.detach().double(), q.grad.double()))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_lse_share_of_the_query_gradient_is_attention_with_keys_as_values():
    from mistill.instrument.runner import lse_grad_q

    torch.manual_seed(3)
    q = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 30, 8, dtype=torch.float64)
    g = torch.randn(2, 4, dtype=torch.float64)
    lse = torch.logsumexp((q @ k.transpose(-1, -2)) * 0.5, -1)
    (lse * g).sum().backward()

    def attend(a, b, c):
        return torch.softmax((a @ b.transpose(-1, -2)) * 0.5, -1) @ c

    torch.testing.assert_close(lse_grad_q(q.detach(), k, g, 0.5, attend).double(), q.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_norm_is_the_models_rms_norm_op_for_op(family):
    """The function the prefill compiles for its norms (``runner._rms_norm``) gives transformers'
    RMSNorm modules' outputs bit for bit, uncompiled, in float32 and bf16 (input, post-attention
    and the q/k norms); on the CPU the runner never takes the compiled path."""
    from mistill.instrument.runner import _rms_norm

    lm = tiny_model(family, layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=3)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        lm.model.to(dtype)
        for parts in lm.geometry.layers:
            norms = [parts.input_norm, parts.post_norm] + [m for m in (parts.q_norm, parts.k_norm) if m is not None]
            for module in norms:
                with torch.no_grad():
                    module.weight.copy_(1 + 0.1 * torch.randn(module.weight.shape, generator=g))
                width = module.weight.shape[0]
                x = (3 * torch.randn(5, 4, width, generator=g)).to(dtype)
                assert torch.equal(_rms_norm(x, module.weight, module.variance_epsilon), module(x))
    runner = Runner(lm)
    assert runner.fuse_elementwise and runner._fused(torch.zeros(1)) is None
