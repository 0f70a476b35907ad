"""Recomputed attention rows, head outputs, contribution and region mass on tiny random models.

The random models get sharpened q/k/v/o weights (unit-variance rows, perturbed q/k norms), so
their attention is far from uniform and a wrong mask, rotary or GQA mapping shows.
"""

from __future__ import annotations

import pytest
import torch

from mistill.distill.attention_rows import (LayerInputs, attention_rows, contribution, head_outputs,
                                            layer_keys, region_mass)
from mistill.errors import MistillInputError
from mistill.models.loading import tiny_model
from model_fixtures import sharpen

# (family, layers, heads, kv_heads): GQA groups of 2 and 4; SmolLM3 has a NoPE layer (index 3)
CASES = [("qwen3", 2, 4, 2), ("llama", 2, 4, 1), ("smollm3", 4, 4, 2)]
N_POS = 40




@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def lm(request):
    family, layers, heads, kv = request.param
    return sharpen(tiny_model(family, layers=layers, heads=heads, kv_heads=kv, d_head=16, d_model=64,
                              seed=5, attn_implementation="eager"))


def _ids(n: int = N_POS, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2000, (1, n), generator=torch.Generator().manual_seed(seed))


def test_rows_equal_eager_attention(lm):
    g = lm.geometry
    ids = _ids()
    rows = [0, 1, 7, 22, 39, 13]
    with torch.no_grad(), LayerInputs(g, range(g.n_layers)) as kept:
        out = lm.model(ids, output_attentions=True)
        for l in range(g.n_layers):
            heads = [3, 0, 2] if l % 2 == 0 else [1, 2, 3, 0]
            probs = attention_rows(g.layers[l], g, kept[l][0], rows, heads, torch.arange(N_POS))
            eager = out.attentions[l][0][heads][:, rows].transpose(0, 1)  # [row, h, pos]
            assert probs.shape == (len(rows), len(heads), N_POS)
            # recomputed rows against eager attention (other kernels): probabilities <= 1 agree
            # to a few float32 eps; atol 1e-6 is about 8 eps (observed: <= 1 eps, default /
            # AVX2 / AVX-512 kernels)
            torch.testing.assert_close(probs, eager, atol=1e-6, rtol=1e-5)
            # causal: nothing after the row, each row a distribution
            future = torch.arange(N_POS)[None, :] > torch.tensor(rows)[:, None]
            assert float(probs.masked_select(future[:, None, :].expand_as(probs)).abs().max()) == 0.0
            torch.testing.assert_close(probs.sum(-1), torch.ones(len(rows), len(heads)))
            # attention is far from uniform, so the comparison has teeth
            sharpness = probs.max(-1).values * (torch.tensor(rows, dtype=torch.float32)[:, None] + 1)
            assert float(sharpness.mean()) > 2.0  # 1.0 for uniform rows


def test_nope_layer_is_used_and_rows_depend_on_rotary():
    lm = sharpen(tiny_model("smollm3", layers=4, heads=4, kv_heads=2, seed=5))
    g = lm.geometry
    assert [p.use_rope for p in g.layers] == [True, True, True, False]
    ids = _ids()
    with torch.no_grad(), LayerInputs(g, [2, 3]) as kept:
        lm.model(ids)
        shifted = torch.arange(N_POS) * 3  # not a constant shift: rotary rows change, NoPE rows do not
        for l, moves in ((2, True), (3, False)):
            a = attention_rows(g.layers[l], g, kept[l][0], [30, 39], [0, 3], torch.arange(N_POS))
            b = attention_rows(g.layers[l], g, kept[l][0], [30, 39], [0, 3], shifted)
            assert (float((a - b).abs().max()) > 1e-3) == moves


def test_head_outputs_equal_o_proj_input(lm):
    g = lm.geometry
    ids = _ids(seed=1)
    seen = {}
    handles = [p.o_proj.register_forward_pre_hook(
        lambda mod, args, l=p.index: seen.__setitem__(l, args[0][0].view(N_POS, g.n_heads, g.d_head)))
        for p in g.layers]
    try:
        with torch.no_grad(), LayerInputs(g, range(g.n_layers)) as kept:
            lm.model(ids)
            rows = [3, 17, 39]
            for l in range(g.n_layers):
                heads = [2, 0, 3]
                keys = layer_keys(g.layers[l], g, kept[l][0], [0, 1, 2, 3], torch.arange(N_POS))
                probs = attention_rows(g.layers[l], g, kept[l][0], rows, heads, torch.arange(N_POS), keys=keys)
                z = head_outputs(g.layers[l], g, kept[l][0], probs, heads, keys=keys)
                z_alone = head_outputs(g.layers[l], g, kept[l][0], probs, heads)
                want = seen[l][rows][:, heads]
                torch.testing.assert_close(z, want, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(z_alone, z)
    finally:
        for h in handles:
            h.remove()


def test_layer_inputs_keyword_call_and_release(lm):
    g = lm.geometry
    x = torch.randn(1, 6, g.d_model)
    pos = torch.arange(6)[None]
    with torch.no_grad(), LayerInputs(g, [0], final_residual=True) as kept:
        g.layers[0].layer(hidden_states=x, attention_mask=None, position_ids=pos,
                          position_embeddings=g.rotary(x, pos))
        assert kept[0] is x
        lm.model(_ids(8))
        assert kept[0].shape == (1, 8, g.d_model) and kept.final.shape == (1, 8, g.d_model)
    assert kept.inputs == {} and kept.final is None  # released on exit
    handles = sum(len(p.layer._forward_pre_hooks) for p in g.layers)
    assert handles == 0


def test_rows_gradient_matches_eager_and_reaches_earlier_layers(lm):
    g = lm.geometry
    ids = _ids(24, seed=2)
    rows, heads, l = [5, 23, 11], [1, 3], g.n_layers - 1
    target = torch.rand(len(rows), len(heads), 24, generator=torch.Generator().manual_seed(0))

    def grads(loss):
        lm.model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in lm.model.named_parameters()
                if p.grad is not None and ("q_proj" in n or "k_proj" in n or "v_proj" in n)}

    with LayerInputs(g, [l]) as kept:
        lm.model(ids)
        probs = attention_rows(g.layers[l], g, kept[l][0], rows, heads, torch.arange(24))
        ours = grads((probs * target).sum())
    eager = lm.model(ids, output_attentions=True).attentions[l][0][heads][:, rows].transpose(0, 1)
    ref = grads((eager * target).sum())
    lm.model.zero_grad(set_to_none=True)
    q_name = next(n for n in ours if f"layers.{l}." in n and "q_proj.weight" in n)
    k_name = q_name.replace("q_proj", "k_proj")
    assert float(ours[q_name].abs().max()) > 0 and float(ours[k_name].abs().max()) > 0
    assert any("layers.0." in n and float(t.abs().max()) > 0 for n, t in ours.items())  # earlier layer
    assert set(ours) == set(ref)
    for n in ours:
        torch.testing.assert_close(ours[n], ref[n], atol=1e-5, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_:FutureWarning")
@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_keeps_the_graph(reentrant):
    lm = sharpen(tiny_model("qwen3", layers=3, heads=4, kv_heads=2, seed=7))
    g = lm.geometry
    ids = _ids(20, seed=3)

    def step():
        lm.model.zero_grad(set_to_none=True)
        with LayerInputs(g, [1, 2]) as kept:
            out = lm.model(ids, labels=ids, use_cache=False)
            loss = out.loss
            for l in (1, 2):
                probs = attention_rows(g.layers[l], g, kept[l][0], [4, 19], [0, 3], torch.arange(20))
                loss = loss + probs[..., :3].pow(2).sum()
            loss.backward()
        return {n: p.grad.clone() for n, p in lm.model.named_parameters() if p.grad is not None}

    lm.model.train()
    plain = step()
    lm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    try:
        ckpt = step()
    finally:
        lm.model.gradient_checkpointing_disable()
        lm.model.eval()
    assert set(plain) == set(ckpt)
    eps = torch.finfo(torch.float32).eps
    for n in plain:
        # Reentrant checkpointing replays each layer in backward and accumulates a weight's
        # gradient over the 20 positions and the attention-row terms in another order; a
        # reordered float32 sum is off by a few eps times the size of its terms, for which the
        # tensor's largest entry stands (a small entry may be a cancellation of large terms).
        # Observed: below 5 eps x max|grad| under the default, AVX2 and AVX-512 kernels; a lost
        # graph would miss whole terms, orders of magnitude more.
        scale = float(plain[n].abs().max())
        torch.testing.assert_close(ckpt[n], plain[n], rtol=0.0, atol=32 * eps * scale)


def test_contribution_hand_computed():
    lm = sharpen(tiny_model("llama", layers=2, heads=4, kv_heads=2, seed=1))
    g = lm.geometry
    gen = torch.Generator().manual_seed(4)
    z = {0: torch.randn(2, 2, g.d_head, generator=gen), 1: torch.randn(2, 1, g.d_head, generator=gen)}
    heads = {0: [3, 1], 1: [2]}
    weights = {0: [0.5, 0.2], 1: [0.3]}
    x = torch.randn(2, g.d_model, generator=gen)
    targets, comps = [10, 11], [[12, 13, 14], [15]]
    comp_logits = [torch.tensor([0.1, -0.4, 0.7]), torch.tensor([2.0])]
    margins = torch.tensor([1.5, -0.8])
    c = contribution(z, heads, weights, g, x, targets, comps, comp_logits, margins)
    # by hand, one row and one head at a time
    W_U = g.lm_head.weight
    gamma, eps = g.final_norm.weight, g.final_norm.variance_epsilon
    want = []
    for r in range(2):
        v = torch.zeros(g.d_model)
        for l in (0, 1):
            for j, h in enumerate(heads[l]):
                W = g.layers[l].o_proj.weight[:, h * g.d_head:(h + 1) * g.d_head]
                v = v + weights[l][j] * (W @ z[l][r, j])
        dy = gamma * v / torch.sqrt((x[r] ** 2).mean() + eps)
        p = torch.softmax(comp_logits[r], 0)
        u = W_U[targets[r]] - sum(p[i] * W_U[cid] for i, cid in enumerate(comps[r]))
        want.append(float((dy @ u).detach()) / float(margins[r]))
    torch.testing.assert_close(c.detach(), torch.tensor(want), atol=1e-5, rtol=1e-5)
    # a stacked [row, comp] tensor of competitor logits (padding ignored) gives the same
    stacked = torch.tensor([[0.1, -0.4, 0.7], [2.0, 99.0, 99.0]])
    c2 = contribution(z, heads, weights, g, x, targets, comps, stacked, margins)
    torch.testing.assert_close(c2, c)
    # linear in the pool weights: doubling every weight doubles c
    c3 = contribution(z, heads, {l: [2 * w for w in ws] for l, ws in weights.items()}, g, x, targets,
                      comps, comp_logits, margins)
    torch.testing.assert_close(c3, 2 * c)
    with pytest.raises(MistillInputError):
        contribution(z, heads, weights, g, x, targets, [[12], []], comp_logits, margins)


def test_region_mass_hand_computed():
    rows = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.0, 0.25, 0.25]], requires_grad=True)
    m = region_mass(rows, [[1, 3], [0, 0, 2]])
    torch.testing.assert_close(m, torch.tensor([0.6, 0.75]))
    m.sum().backward()
    torch.testing.assert_close(rows.grad, torch.tensor([[0.0, 1, 0, 1], [1, 0, 1, 0]]))
    with pytest.raises(MistillInputError):
        region_mass(rows.detach(), [[4], [0]])


@pytest.mark.parametrize("reentrant", [True, False])
def test_layer_inputs_ignore_checkpoint_replays(reentrant):
    """A checkpoint that wraps the module call replays the layer (and its pre-hook) in backward;
    the kept tensor must stay the forward's, with its graph."""
    from torch.utils.checkpoint import checkpoint

    lm = sharpen(tiny_model("qwen3", layers=2, heads=4, kv_heads=2, seed=2))
    g = lm.geometry
    pos = torch.arange(10)[None]
    x0 = torch.randn(1, 10, g.d_model, requires_grad=True)

    def run(h):
        out = g.layers[0].layer(h, attention_mask=None, position_ids=pos,
                                position_embeddings=g.rotary(h, pos))
        return out[0] if isinstance(out, tuple) else out

    with LayerInputs(g, [0]) as kept:
        x = x0 * 2.0  # a non-leaf with a graph, like a residual stream
        y = checkpoint(run, x, use_reentrant=reentrant)
        assert kept[0] is x
        probs = attention_rows(g.layers[0], g, kept[0][0], [9], [1], torch.arange(10))
        (y.sum() + probs[..., :4].sum()).backward()  # replays the layer, firing the hook again
        assert kept[0] is x
    assert x0.grad is not None and float(x0.grad.abs().max()) > 0
