"""Distillation losses: every term is zero when the student's quantities equal the teacher's and
positive otherwise; the chunked CoT loss equals a direct unchunked computation (values and
gradients); hand-computed cases for the rest."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mistill.distill.losses import (
    DISTILLM2_ALPHA,
    EVENT_WEIGHT,
    attention_term,
    chunked_cot_loss,
    distillm2_loss,
    event_token_weights,
    feature_kd_loss,
    interaction_term,
    make_adapter,
    mistill_objective,
    sample_positions,
    uniform_layer_pairs,
    write_term,
)
from mistill.errors import MistillInputError

DT = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _distributions(*shape: int, seed: int) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=_gen(seed), dtype=DT) * 2, dim=-1)


# CoT loss ------------------------------------------------------------------------------------

POS, D_MODEL, VOCAB, K = 13, 8, 50, 32


def _cot_inputs(seed: int = 0):
    g = _gen(seed)
    hidden = torch.randn(POS, D_MODEL, generator=g, dtype=DT)
    weight = torch.randn(VOCAB, D_MODEL, generator=g, dtype=DT)
    targets = torch.randint(0, VOCAB, (POS,), generator=g)
    top_ids = torch.stack([torch.randperm(VOCAB, generator=g)[:K] for _ in range(POS)])
    top_logp = torch.log_softmax(torch.randn(POS, VOCAB, generator=g, dtype=DT) * 3, -1)
    top_logp = top_logp.gather(-1, top_ids)  # teacher's full-softmax log-probs: sum < 1
    return hidden, weight, targets, top_ids, top_logp


def _cot_reference(hidden, weight, targets, top_ids, top_logp, *, mode, weights=None,
                   kl_weight=1.0):
    """Direct computation with the full ``[pos, vocab]`` logits."""
    logits = hidden @ weight.t()
    ce = F.cross_entropy(logits, targets, reduction="none")
    p_t = torch.softmax(top_logp, -1)
    if mode == "kl":
        log_q = torch.log_softmax(logits, -1).gather(-1, top_ids)
        dist = (p_t * (p_t.log() - log_q)).sum(-1)
    else:
        q_sorted = torch.softmax(logits, -1).sort(-1, descending=True).values[:, :K]
        dist = (q_sorted - p_t.sort(-1, descending=True).values).abs().sum(-1)
    w = torch.ones(len(targets), dtype=DT) if weights is None else weights
    return (w * ce).sum() / w.sum() + kl_weight * (w * dist).sum() / w.sum()


@pytest.mark.parametrize("mode", ["kl", "uld"])
@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 1024])
@pytest.mark.parametrize("weighted", [False, True])
def test_chunked_cot_equals_unchunked_values_and_gradients(mode, chunk, weighted):
    hidden, weight, targets, top_ids, top_logp = _cot_inputs()
    weights = event_token_weights(POS, [0, 4, 5, 12], dtype=DT) if weighted else None
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, parts = chunked_cot_loss(h1, w1, targets, top_ids, top_logp, kl_weight=0.7,
                                   token_weights=weights, chunk=chunk, mode=mode)
    loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = _cot_reference(h2, w2, targets, top_ids, top_logp, mode=mode, weights=weights,
                         kl_weight=0.7)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12)
    assert set(parts) == {"ce", mode, "n_tokens"} and float(parts["n_tokens"]) == POS
    torch.testing.assert_close(parts["ce"] + 0.7 * parts[mode], loss.detach())


def test_chunked_cot_with_lm_head_module_reaches_its_parameters():
    hidden, weight, targets, top_ids, top_logp = _cot_inputs(1)
    head = nn.Linear(D_MODEL, VOCAB, bias=False, dtype=DT)
    with torch.no_grad():
        head.weight.copy_(weight)
    loss, _ = chunked_cot_loss(hidden, head, targets, top_ids, top_logp, chunk=3)
    loss.backward()
    w2 = weight.clone().requires_grad_()
    _cot_reference(hidden, w2, targets, top_ids, top_logp, mode="kl").backward()
    torch.testing.assert_close(head.weight.grad, w2.grad, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # the no-grad path (no checkpoint) gives the same value
        again, _ = chunked_cot_loss(hidden, head, targets, top_ids, top_logp, chunk=3)
    torch.testing.assert_close(again, loss.detach())


def test_token_weights_x4_equal_the_hand_weighted_mean():
    hidden, weight, targets, top_ids, top_logp = _cot_inputs(2)
    events = [1, 2, 9]
    w = event_token_weights(POS, events + [2], dtype=DT)  # a repeated position counts once
    assert float(w.sum()) == POS + (EVENT_WEIGHT - 1) * len(events)
    loss, parts = chunked_cot_loss(hidden, weight, targets, top_ids, top_logp, token_weights=w,
                                   chunk=4)
    per_token = [chunked_cot_loss(hidden[t:t + 1], weight, targets[t:t + 1], top_ids[t:t + 1],
                                  top_logp[t:t + 1])[1] for t in range(POS)]
    num_ce = sum((4.0 if t in events else 1.0) * float(p["ce"]) for t, p in enumerate(per_token))
    num_kl = sum((4.0 if t in events else 1.0) * float(p["kl"]) for t, p in enumerate(per_token))
    den = POS + 3 * len(events)
    assert float(parts["ce"]) == pytest.approx(num_ce / den, rel=1e-12)
    assert float(parts["kl"]) == pytest.approx(num_kl / den, rel=1e-12)
    assert float(loss.detach()) == pytest.approx((num_ce + num_kl) / den, rel=1e-12)


def _matching_student(top_ids: torch.Tensor, top_logp: torch.Tensor, vocab: int):
    """Hidden states and an identity unembedding whose logits put the student's whole mass on
    the teacher's top ids, in the teacher's renormalised proportions (shifted by a constant)."""
    logits = torch.full((top_ids.shape[0], vocab), -1e4, dtype=DT)  # exp underflows to 0
    logits.scatter_(-1, top_ids, top_logp + 3.0)
    return logits, torch.eye(vocab, dtype=DT)


@pytest.mark.parametrize("mode", ["kl", "uld"])
def test_cot_distillation_part_is_zero_at_the_renormalised_teacher_and_positive_otherwise(mode):
    _, _, _, top_ids, top_logp = _cot_inputs(3)
    targets = top_ids[:, 0]
    hidden, eye = _matching_student(top_ids, top_logp, VOCAB)
    _, parts = chunked_cot_loss(hidden, eye, targets, top_ids, top_logp, chunk=4, mode=mode)
    assert abs(float(parts[mode])) < 1e-12
    other = hidden + torch.randn(hidden.shape, generator=_gen(4), dtype=DT).clamp(-1, 1)
    _, parts = chunked_cot_loss(other, eye, targets, top_ids, top_logp, chunk=4, mode=mode)
    assert float(parts[mode]) > 1e-3


def test_uld_needs_no_shared_vocabulary_but_kl_does():
    hidden, weight, targets, top_ids, top_logp = _cot_inputs(5)
    foreign = top_ids + 10_000  # teacher ids from another tokenizer
    loss, parts = chunked_cot_loss(hidden, weight, targets, foreign, top_logp, mode="uld")
    assert torch.isfinite(loss) and float(parts["uld"]) > 0
    with pytest.raises(MistillInputError, match="teacher_top_ids"):
        chunked_cot_loss(hidden, weight, targets, foreign, top_logp, mode="kl")


def test_cot_bad_inputs_raise():
    hidden, weight, targets, top_ids, top_logp = _cot_inputs(6)
    with pytest.raises(MistillInputError, match="token_weights"):
        chunked_cot_loss(hidden, weight, targets, top_ids, top_logp,
                         token_weights=torch.zeros(POS, dtype=DT))
    with pytest.raises(MistillInputError, match="target_ids"):
        chunked_cot_loss(hidden, weight, targets[:-1], top_ids, top_logp)
    with pytest.raises(MistillInputError, match="mode"):
        chunked_cot_loss(hidden, weight, targets, top_ids, top_logp, mode="js")


def test_cot_bf16_weights_compute_in_float32():
    hidden, weight, targets, top_ids, top_logp = _cot_inputs(7)
    h = hidden.to(torch.bfloat16).requires_grad_()
    loss, _ = chunked_cot_loss(h, weight.to(torch.bfloat16), targets, top_ids, top_logp, chunk=5)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(h.grad.float()).all()
    value = float(loss.detach())
    # 1. Given the logits of the bf16 head (the kernel's bf16 output, the only bf16 rounding on
    # the way), the rest is float32: logsumexp over 50 logits and the KL over 32 teacher ids, a
    # few dozen float32 operations on terms up to |z| ~ 15, so about 32 * 2^-24 * 15 ~ 3e-5 absolute
    # per position at worst against a loss ~ 12: relative 3e-6. Bound 1e-5; measured 7.5e-8 (over
    # ten seeds at most 8.2e-8)
    h16, w16 = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)  # chunks of 5: the loss's GEMM shapes
    bf16_logits = torch.cat([h16[i:i + 5] @ w16.t() for i in range(0, POS, 5)]).double()
    ce = F.cross_entropy(bf16_logits, targets, reduction="none")
    p_t = torch.softmax(top_logp, -1)
    kl = (p_t * (p_t.log() - torch.log_softmax(bf16_logits, -1).gather(-1, top_ids))).sum(-1)
    assert value == pytest.approx(float((ce + kl).mean()), rel=1e-5)
    # 2. Against the float64 loss of the unrounded inputs: rounding h and W to bf16 (u = 2^-8
    # relative each, so 2u on each product) and the logits once more (u) moves each logit by at
    # most 3u * sum_i |h_i W_ji|; each position's CE + KL has a logit gradient of L1 norm at most 4
    # (softmax minus a distribution, twice). First-order worst case: 12u times the mean over
    # positions of the largest sum_i |h_i W_ji|, about 0.035 of the loss here. It cannot be
    # tighter without a statistical model of the rounding signs: the measured error (0.00019 here,
    # at most 0.0011 over ten seeds) is a sum of independent roundings, not a bound
    ref = float(_cot_reference(hidden, weight, targets, top_ids, top_logp, mode="kl"))
    worst = 12 * 2.0 ** -8 * float((hidden.abs() @ weight.abs().t()).max(-1).values.mean())
    assert abs(value - ref) <= worst, (value, ref, worst)


# Mistill terms -------------------------------------------------------------------------------

def test_attention_term_zero_at_equality_positive_otherwise_and_hand_value():
    a_t = _distributions(6, 9, seed=10)
    assert float(attention_term(a_t, a_t.clone())) == 0.0
    a_s = _distributions(6, 9, seed=11).requires_grad_()
    value = attention_term(a_t, a_s)
    value.backward()
    assert float(value.detach()) > 0 and a_s.grad.abs().sum() > 0
    p, q = torch.tensor([[0.5, 0.5, 0.0]], dtype=DT), torch.tensor([[0.25, 0.7, 0.05]], dtype=DT)
    hand = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.7)
    assert float(attention_term(p, q)) == pytest.approx(hand, rel=1e-12)


def test_attention_rows_without_teacher_mass_contribute_nothing():
    a_t, a_s = _distributions(5, 7, seed=12), _distributions(5, 7, seed=13)
    padded_t = torch.cat([a_t, torch.zeros(2, 7, dtype=DT)])
    padded_s = torch.cat([a_s, _distributions(2, 7, seed=14)])
    assert float(attention_term(padded_t, padded_s)) == pytest.approx(
        float(attention_term(a_t, a_s)), rel=1e-12)
    empty = attention_term(torch.zeros(3, 7, dtype=DT), a_s[:3])
    assert float(empty) == 0.0 and not torch.isnan(empty)


def test_attention_term_clamps_at_eps():
    p = torch.tensor([[1.0, 0.0]], dtype=DT)
    q = torch.tensor([[0.0, 1.0]], dtype=DT)
    assert float(attention_term(p, q, eps=1e-8)) == pytest.approx(-math.log(1e-8), rel=1e-12)


def test_interaction_term():
    g = _gen(20)
    m_t, c_t = torch.rand(8, generator=g, dtype=DT), torch.randn(8, generator=g, dtype=DT)
    assert float(interaction_term(m_t.clone(), c_t.clone(), m_t, c_t)) == 0.0
    m_s = torch.rand(8, generator=g, dtype=DT).requires_grad_()
    c_s = torch.randn(8, generator=g, dtype=DT).requires_grad_()
    value = interaction_term(m_s, c_s, m_t, c_t)
    value.backward()
    hand = ((m_s.detach() * c_s.detach() - m_t * c_t) ** 2).mean()
    assert float(value.detach()) > 0
    assert float(value.detach()) == pytest.approx(float(hand), rel=1e-12)
    assert c_s.grad.abs().sum() > 0 and m_s.grad.abs().sum() > 0
    one = interaction_term(*(torch.tensor([v], dtype=DT) for v in (0.5, 2.0, 0.25, 1.0)))
    assert float(one) == pytest.approx((1.0 - 0.25) ** 2)
    empty = torch.zeros(0, dtype=DT)
    assert float(interaction_term(empty, empty, empty, empty)) == 0.0


def test_write_term_raw_and_normalised():
    g = _gen(30)
    c_t = torch.randn(9, generator=g, dtype=DT)
    notes = torch.tensor([7, 7, 7, 3, 3, 3, 3, 5, 5])
    assert float(write_term(c_t.clone(), c_t)) == 0.0
    assert float(write_term(c_t.clone(), c_t, normalize=True, note_index=notes)) == 0.0
    assert float(write_term(c_t.clone(), c_t, normalize=True)) == 0.0
    c_s = torch.randn(9, generator=g, dtype=DT)
    assert float(write_term(c_s, c_t)) == pytest.approx(float(((c_s - c_t) ** 2).mean()))
    assert float(write_term(c_s, c_t, normalize=True, note_index=notes)) > 0
    # Standardisation per note: a positive affine map of c within each note costs nothing...
    scale = torch.tensor([2.0, 2.0, 2.0, 0.5, 0.5, 0.5, 0.5, 3.0, 3.0], dtype=DT)
    shift = torch.tensor([1.0, 1.0, 1.0, -4.0, -4.0, -4.0, -4.0, 0.0, 0.0], dtype=DT)
    affine = c_t * scale + shift
    assert float(write_term(affine, c_t)) > 1.0
    assert float(write_term(affine, c_t, normalize=True, note_index=notes)) < 1e-12
    # ...but not when the notes are pooled into one.
    assert float(write_term(affine, c_t, normalize=True)) > 0.1
    # A note with one event standardises to 0 on both sides.
    lone = write_term(torch.tensor([5.0], dtype=DT), torch.tensor([-1.0], dtype=DT),
                      normalize=True)
    assert float(lone) == 0.0


def test_objective_sums_lambda_weighted_enabled_terms():
    cot = torch.tensor(2.0, dtype=DT, requires_grad=True)
    x = torch.tensor(0.3, dtype=DT, requires_grad=True)
    terms = {"P1": {"attention": x * 1.0, "interaction": x * 2.0, "write": x * 10.0},
             "P2": {"attention": x * 3.0, "interaction": x * 4.0}}
    total, parts = mistill_objective(cot, terms, {"P1": 0.1, "P2": 0.5})
    hand = 2.0 + 0.1 * (0.3 + 0.6) + 0.5 * (0.9 + 1.2)
    assert float(parts["total"]) == pytest.approx(hand, rel=1e-12)
    assert "P1/write" not in parts and float(parts["P2/weighted"]) == pytest.approx(1.05)
    total.backward()
    assert float(x.grad) == pytest.approx(0.1 * 3 + 0.5 * 7, rel=1e-12)
    with_write, _ = mistill_objective(cot, {"P1": terms["P1"]}, {"P1": 0.1},
                                      terms=("attention", "write"))
    assert float(with_write.detach()) == pytest.approx(2.0 + 0.1 * (0.3 + 3.0), rel=1e-12)


def test_objective_lambda_zero_is_exactly_the_cot_loss_and_its_gradient():
    hidden, weight, targets, top_ids, top_logp = _cot_inputs(40)
    h1 = hidden.clone().requires_grad_()
    cot1, _ = chunked_cot_loss(h1, weight, targets, top_ids, top_logp, chunk=4)
    nan_terms = {"attention": h1.sum() * float("nan"), "interaction": h1.mean() * 5}
    total, parts = mistill_objective(cot1, {"P1": nan_terms, "P2": nan_terms},
                                     {"P1": 0.0, "P2": 0.0})
    total.backward()
    h2 = hidden.clone().requires_grad_()
    cot2, _ = chunked_cot_loss(h2, weight, targets, top_ids, top_logp, chunk=4)
    cot2.backward()
    assert torch.equal(total.detach(), cot2.detach())
    assert torch.equal(h1.grad, h2.grad) and not torch.isnan(h1.grad).any()
    assert set(parts) == {"cot", "total"}
    # A zero-lambda phase may also be absent or incomplete.
    only, _ = mistill_objective(cot2.detach(), {}, {"P1": 0.0})
    assert torch.equal(only, cot2.detach())


def test_objective_rejects_inconsistent_configuration():
    cot, t = torch.tensor(1.0), torch.tensor(0.5)
    with pytest.raises(MistillInputError, match="lambdas"):
        mistill_objective(cot, {"P1": {"attention": t, "interaction": t}}, {})
    with pytest.raises(MistillInputError, match="phase_terms"):
        mistill_objective(cot, {"P1": {"attention": t}}, {"P1": 0.1})
    with pytest.raises(MistillInputError, match="terms"):
        mistill_objective(cot, {}, {"P1": 0.1}, terms=("attention", "value"))


def test_uniform_pool_attention_term_equals_feature_kd_attention_kl():
    heads, rows, buckets, d = 6, 10, 8, 5
    per_head_t = _distributions(heads, rows, buckets, seed=50)
    per_head_s = _distributions(heads, rows, buckets, seed=51)
    w = torch.full((heads,), 1.0 / heads, dtype=DT)  # the uniform pool over the layer's heads
    pooled_t = torch.einsum("h,hrb->rb", w, per_head_t)
    pooled_s = torch.einsum("h,hrb->rb", w, per_head_s)
    mistill = attention_term(pooled_t, pooled_s)
    h = torch.randn(1, rows, d, generator=_gen(52), dtype=DT)
    identity = _identity_adapter(d)
    head_avg_t, head_avg_s = per_head_t.mean(0), per_head_s.mean(0)  # Feature-KD's own average
    loss, parts = feature_kd_loss(head_avg_t[None], head_avg_s[None], h, h.clone(), identity)
    assert float(mistill) > 0
    assert float(parts["attn"]) == pytest.approx(float(mistill), rel=1e-12)
    assert float(loss.detach()) == pytest.approx(float(mistill), rel=1e-12)


# Feature-KD ----------------------------------------------------------------------------------

def _identity_adapter(d: int) -> nn.Linear:
    adapter = nn.Linear(d, d, dtype=DT)
    with torch.no_grad():
        adapter.weight.copy_(torch.eye(d, dtype=DT))
        adapter.bias.zero_()
    return adapter


def test_feature_kd_zero_at_identity_adapter_and_equal_features():
    a = _distributions(4, 64, 12, seed=60)
    h = torch.randn(4, 30, 16, generator=_gen(61), dtype=DT)
    loss, parts = feature_kd_loss(a, a.clone(), h, h.clone(), _identity_adapter(16))
    assert float(loss.detach()) == 0.0 and float(parts["attn"]) == 0.0
    assert float(parts["hidden"]) < 1e-28
    # RMS normalisation per position: a positive rescaling of the student costs nothing (up to
    # the 1e-6 inside the square root).
    scaled = h * torch.rand(4, 30, 1, generator=_gen(62), dtype=DT).add(0.5) * 7
    _, parts = feature_kd_loss(a, a.clone(), h, scaled, _identity_adapter(16))
    assert float(parts["hidden"]) < 1e-10
    _, unnormalised = feature_kd_loss(a, a.clone(), h, h * 2, _identity_adapter(16))
    assert float(unnormalised["hidden"]) < 1e-10


def test_feature_kd_positive_otherwise_with_gradients_to_student_and_adapter():
    a_t, a_s = _distributions(4, 64, 12, seed=63), _distributions(4, 64, 12, seed=64)
    h_t = torch.randn(4, 30, 16, generator=_gen(65), dtype=DT)
    h_s = torch.randn(4, 30, 8, generator=_gen(66), dtype=DT).requires_grad_()
    adapter = make_adapter(8, 16, seed=3, dtype=DT)
    a_s.requires_grad_()
    loss, parts = feature_kd_loss(a_t, a_s, h_t, h_s, adapter, attn_weight=1.0,
                                  hidden_weight=1.0)
    loss.backward()
    assert float(parts["attn"]) > 0 and float(parts["hidden"]) > 0
    assert float(loss.detach()) == pytest.approx(float(parts["attn"] + parts["hidden"]), rel=1e-12)
    assert a_s.grad.abs().sum() > 0 and h_s.grad.abs().sum() > 0
    assert adapter.weight.grad.abs().sum() > 0
    hand_hidden = F.mse_loss(_rms(adapter(h_s.detach())), _rms(h_t))
    assert float(parts["hidden"]) == pytest.approx(float(hand_hidden.detach()), rel=1e-10)
    only_attn, _ = feature_kd_loss(a_t, a_s, h_t, h_s, adapter, hidden_weight=0.0)
    assert float(only_attn.detach()) == pytest.approx(float(parts["attn"]), rel=1e-12)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6)


def test_uniform_layer_pairs():
    assert uniform_layer_pairs(36, 64) == [(8, 15), (17, 31), (26, 47), (35, 63)]
    assert uniform_layer_pairs(28, 36) == [(6, 8), (13, 17), (20, 26), (27, 35)]
    assert uniform_layer_pairs(4, 4) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    for n_s, n_t in [(36, 64), (30, 40), (7, 13)]:
        pairs = uniform_layer_pairs(n_s, n_t)
        assert pairs[-1] == (n_s - 1, n_t - 1) and len(pairs) == 4
        assert all(a < b for a, b in zip(pairs, pairs[1:]))
    with pytest.raises(MistillInputError):
        uniform_layer_pairs(3, 64)


def test_sample_positions():
    a = sample_positions(500, 64, _gen(70))
    b = sample_positions(500, 64, _gen(70))
    assert torch.equal(a, b) and a.shape == (64,) and len(set(a.tolist())) == 64
    assert torch.equal(a, a.sort().values) and 0 <= int(a.min()) and int(a.max()) < 500
    assert not torch.equal(a, sample_positions(500, 64, _gen(71)))
    assert torch.equal(sample_positions(40, 64, _gen(70)), torch.arange(40))


def test_adapter_initialisation_depends_on_the_seed_alone():
    torch.manual_seed(0)
    first = make_adapter(8, 16, seed=11)
    torch.rand(1000)  # consume the global RNG
    torch.manual_seed(12345)
    state = torch.get_rng_state()
    second = make_adapter(8, 16, seed=11)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is not touched
    assert torch.equal(first.weight, second.weight) and torch.equal(first.bias, second.bias)
    other = make_adapter(8, 16, seed=12)
    assert not torch.equal(first.weight, other.weight)
    bound = 1 / math.sqrt(8)
    weight, bias = first.weight.detach(), first.bias.detach()
    assert float(weight.abs().max()) <= bound and float(bias.abs().max()) <= bound
    assert weight.shape == (16, 8) and float(weight.std()) > 0.5 * bound / math.sqrt(3)


# DistiLLM-2 ----------------------------------------------------------------------------------

def _skew_case(seed: int, batch: int = 2, pos: int = 5, vocab: int = 11):
    g = _gen(seed)
    s = torch.randn(batch, pos, vocab, generator=g, dtype=DT)
    t = torch.randn(batch, pos, vocab, generator=g, dtype=DT) * 2
    labels = torch.randint(0, vocab, (batch, pos), generator=g)
    labels[:, 0] = -100  # a prompt position without loss
    return s, t, labels


def test_distillm2_zero_when_student_equals_teacher_and_positive_otherwise():
    s, t, lab = _skew_case(80)
    s2, t2, lab2 = _skew_case(81)
    loss, parts = distillm2_loss(t.clone(), t, lab, t2.clone(), t2, lab2)
    assert abs(float(loss.detach())) < 1e-14
    loss, parts = distillm2_loss(s, t, lab, s2, t2, lab2)
    assert float(parts["skl"]) > 0 and float(parts["srkl"]) > 0 and float(loss.detach()) > 0
    assert float(parts["n_pref"]) == 2 * 4 and float(parts["n_dispref"]) == 2 * 4


def test_distillm2_tiny_hand_case():
    # One pair; preferred response of 2 supervised tokens (+1 ignored), dispreferred of 1.
    s_pref = torch.tensor([[9.0, 9.0, 9.0], [0.0, 1.0, 2.0], [1.0, 0.0, 0.0]], dtype=DT)
    t_pref = torch.tensor([[0.0, 0.0, 0.0], [2.0, 1.0, 0.0], [0.5, 0.5, -1.0]], dtype=DT)
    lab_pref = torch.tensor([-100, 1, 0])
    s_dis = torch.tensor([[0.0, 3.0, 0.0], [5.0, 5.0, 5.0]], dtype=DT)
    t_dis = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=DT)
    lab_dis = torch.tensor([2, -100])
    a = DISTILLM2_ALPHA

    def softmax(row):
        e = [math.exp(x) for x in row]
        return [x / sum(e) for x in e]

    def skl(sr, tr):  # KL(p || a p + (1-a) q)
        p, q = softmax(tr), softmax(sr)
        return sum(pi * math.log(pi / (a * pi + (1 - a) * qi)) for pi, qi in zip(p, q))

    def srkl(sr, tr):  # KL(q || (1-a) p + a q)
        p, q = softmax(tr), softmax(sr)
        return sum(qi * math.log(qi / ((1 - a) * pi + a * qi)) for pi, qi in zip(p, q))

    hand_skl = (skl(s_pref[1].tolist(), t_pref[1].tolist())
                + skl(s_pref[2].tolist(), t_pref[2].tolist())) / 2
    hand_srkl = srkl(s_dis[0].tolist(), t_dis[0].tolist())
    loss, parts = distillm2_loss(s_pref, t_pref, lab_pref, s_dis, t_dis, lab_dis)
    assert float(parts["skl"]) == pytest.approx(hand_skl, rel=1e-12)
    assert float(parts["srkl"]) == pytest.approx(hand_srkl, rel=1e-12)
    assert float(loss.detach()) == pytest.approx(hand_skl + hand_srkl, rel=1e-12)
    weighted, _ = distillm2_loss(s_pref, t_pref, lab_pref, s_dis, t_dis, lab_dis, beta=1.5)
    assert float(weighted) == pytest.approx(0.5 * hand_skl + 1.5 * hand_srkl, rel=1e-12)


def _distillm2_reference(s, t, lab, s2, t2, lab2, *, alpha, detach):
    def per_response(sl, tl, lb, kind):
        log_q, log_p = torch.log_softmax(sl, -1), torch.log_softmax(tl, -1)
        if kind == "skl":
            mix = torch.log(alpha * log_p.exp() + (1 - alpha) * log_q.exp())
            per_tok = (log_p.exp() * (log_p - mix)).sum(-1)
        else:
            q_mix = log_q.exp().detach() if detach else log_q.exp()
            mix = torch.log((1 - alpha) * log_p.exp() + alpha * q_mix)
            per_tok = (log_q.exp() * (log_q - mix)).sum(-1)
        m = (lb != -100).to(per_tok.dtype)
        return (per_tok * m).sum(-1) / m.sum(-1)

    return (per_response(s, t, lab, "skl") + per_response(s2, t2, lab2, "srkl")).mean()


@pytest.mark.parametrize("detach", [True, False])
def test_distillm2_chunking_and_gradients_match_a_direct_computation(detach):
    s, t, lab = _skew_case(90)
    s2, t2, lab2 = _skew_case(91)
    grads = []
    for chunk in (1, 3, 1024):
        a, b = s.clone().requires_grad_(), s2.clone().requires_grad_()
        loss, _ = distillm2_loss(a, t, lab, b, t2, lab2, chunk=chunk, detach_mixture=detach)
        loss.backward()
        grads.append((loss.detach(), a.grad, b.grad))
    a, b = s.clone().requires_grad_(), s2.clone().requires_grad_()
    ref = _distillm2_reference(a, t, lab, b, t2, lab2, alpha=DISTILLM2_ALPHA, detach=detach)
    ref.backward()
    for value, ga, gb in grads:
        torch.testing.assert_close(value, ref.detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(ga, a.grad, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(gb, b.grad, rtol=1e-10, atol=1e-13)
    # Ignored positions get no gradient.
    assert grads[0][1][:, 0].abs().sum() == 0


def test_distillm2_needs_a_shared_vocabulary():
    s, t, lab = _skew_case(95)
    with pytest.raises(MistillInputError, match="vocab"):
        distillm2_loss(s, t[..., :-1], lab, s, t, lab)
    with pytest.raises(MistillInputError, match="vocab"):
        distillm2_loss(s, t, lab, s[..., :-1], t[..., :-1], lab)
    with pytest.raises(MistillInputError, match="alpha"):
        distillm2_loss(s, t, lab, s, t, lab, alpha=0.0)
