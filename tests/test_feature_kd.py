"""Feature-KD (App. J.3): the hidden-state MSE at every trace position (chunked, equal to the
unchunked mean), the attention KL at the 64 sampled positions, and the arm's flags."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mistill.data.synthetic import make_synthetic_corpus
from mistill.distill.arms import resolve_arm
from mistill.distill.losses import (feature_kd_hidden_term, feature_kd_loss, make_adapter,
                                    uniform_layer_pairs)
from mistill.distill.note_data import build_note_data
from mistill.distill.objective import (FeatureKD, feature_kd_positions, feature_kd_step,
                                       make_feature_kd)
from mistill.instrument.events import extract_events
from mistill.models.loading import tiny_model

DT = torch.float64
# float64 throughout the loss-level tests: chunking only changes the order of the sums, whose
# relative error is bounded by (number of terms) x 2^-53 ~ 1e4 x 1.1e-16 ~ 1e-12 on any CPU;
# 1e-9 leaves three orders of magnitude.
RTOL = 1e-9


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + eps)


def _inputs(pairs=4, pos=150, d_s=8, d_t=16, seed=0):
    h_t = torch.randn(pairs, pos, d_t, generator=_gen(seed), dtype=DT)
    h_s = torch.randn(pairs, pos, d_s, generator=_gen(seed + 1), dtype=DT).requires_grad_()
    return h_t, h_s, make_adapter(d_s, d_t, seed=seed, dtype=DT)


def _grads(loss: torch.Tensor, h_s: torch.Tensor, adapter: nn.Linear) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, [h_s, adapter.weight, adapter.bias]))


def test_hidden_term_is_the_mse_over_every_position():
    h_t, h_s, adapter = _inputs()
    got = feature_kd_hidden_term(h_t, h_s, adapter)
    want = F.mse_loss(_rms(adapter(h_s)), _rms(h_t))  # mean over pair, pos and d_T
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    for g, w in zip(_grads(got, h_s, adapter), _grads(want, h_s, adapter)):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=1e-15)


@pytest.mark.parametrize("chunk", [1, 7, 64, 149, 150, 4096])
def test_chunk_size_changes_neither_the_loss_nor_its_gradients(chunk):
    h_t, h_s, adapter = _inputs(seed=3)
    whole = feature_kd_hidden_term(h_t, h_s, adapter, chunk=10 ** 6)
    part = feature_kd_hidden_term(h_t, h_s, adapter, chunk=chunk)
    torch.testing.assert_close(part, whole, rtol=RTOL, atol=0)
    for g, w in zip(_grads(part, h_s, adapter), _grads(whole, h_s, adapter)):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=1e-15)


def test_per_pair_adapters_and_unstacked_pairs():
    h_t, h_s, _ = _inputs(pairs=3, pos=20)
    adapters = [make_adapter(8, 16, seed=k, dtype=DT) for k in range(3)]
    got = feature_kd_hidden_term(list(h_t), list(h_s), adapters, chunk=6)
    want = torch.stack([F.mse_loss(_rms(a(s)), _rms(t)) for a, s, t in zip(adapters, h_s, h_t)]).mean()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    with pytest.raises(Exception, match="adapters"):
        feature_kd_hidden_term(h_t, h_s, adapters[:2])


def test_attention_and_hidden_positions_may_differ():
    """The attention KL reads the 64 sampled rows, the hidden MSE every position."""
    a = torch.softmax(torch.randn(4, 64, 10, generator=_gen(5), dtype=DT), -1)
    h_t, h_s, adapter = _inputs(pos=300)
    loss, parts = feature_kd_loss(a, a.clone(), h_t, h_s, adapter)
    assert float(parts["attn"]) == 0.0
    torch.testing.assert_close(parts["hidden"], F.mse_loss(_rms(adapter(h_s)), _rms(h_t)).detach(),
                               rtol=RTOL, atol=0)


def test_linspace_layer_map():
    assert uniform_layer_pairs(36, 64, rule="linspace") == [(0, 0), (12, 21), (23, 42), (35, 63)]
    assert uniform_layer_pairs(4, 6, rule="linspace") == [(0, 0), (1, 2), (2, 3), (3, 5)]
    assert uniform_layer_pairs(36, 64) == [(8, 15), (17, 31), (26, 47), (35, 63)]  # block_end


# --------------------------------------------------------------------------- the arm's step
@pytest.fixture(scope="module")
def models():
    corpus = make_synthetic_corpus(n_notes=1, seed=4)
    note = corpus.notes[0]
    teacher = tiny_model("qwen3", layers=6, heads=4, kv_heads=2, d_head=16, d_model=64, seed=1)
    student = tiny_model("qwen3", layers=4, heads=4, kv_heads=2, d_head=16, d_model=48, seed=6)
    student.model.requires_grad_(True)
    events = extract_events(note.note_id, note.teacher_trace, list(corpus.inventory.codes),
                            tokenizer=teacher.tokenizer, n_null=4)
    nd_t = build_note_data(note, corpus.inventory, teacher.tokenizer, events)
    nd_s = build_note_data(note, corpus.inventory, student.tokenizer, events)
    from mistill.distill.objective import compute_note_targets
    from mistill.distill.pools import model_pools
    from test_objective import _head_sets

    pools_t = model_pools(_head_sets(teacher, 0), teacher.geometry.head_names(), k=5)
    targets = compute_note_targets(teacher, nd_t, pools_t, window=8)
    return teacher, student, nd_t, nd_s, targets


def _seed_leaving_out_the_last_position(nd_s, k: int = 64) -> int:
    last = nd_s.input_ids.numel() - 1 - nd_s.trace_start
    return next(s for s in range(100) if last not in feature_kd_positions(nd_s, s, k).tolist())


def test_every_trace_position_enters_the_hidden_term(models):
    """A different last token changes only the last position's hidden states (causal attention):
    the attention KL at the 64 sampled positions (the last not among them) is unchanged, the
    hidden-state term, which reads every position, is not. With 64 sampled positions for the
    hidden term too, both would be unchanged."""
    teacher, student, nd_t, nd_s, targets = models
    n_trace = nd_s.input_ids.numel() - nd_s.trace_start
    assert n_trace > 64
    arm = resolve_arm("feature-kd")
    seed = _seed_leaving_out_the_last_position(nd_s)
    fkd = make_feature_kd(teacher, student, arm, seed)
    _, parts = feature_kd_step(student.model, student, nd_s, nd_t, targets, fkd, arm, seed=seed)
    assert parts["feature_kd/n_hidden_positions"] == n_trace
    assert parts["feature_kd/n_attn_positions"] == 64
    ids = nd_s.input_ids.clone()
    ids[-1] = (int(ids[-1]) + 1) % student.tokenizer.vocab_size
    other = dataclasses.replace(nd_s, inp=dataclasses.replace(nd_s.inp, input_ids=ids))
    _, changed = feature_kd_step(student.model, student, other, nd_t, targets, fkd, arm, seed=seed)
    assert changed["feature_kd/attn"] == pytest.approx(parts["feature_kd/attn"], rel=1e-6)
    assert abs(changed["feature_kd/hidden"] - parts["feature_kd/hidden"]) > 1e-6 * parts["feature_kd/hidden"]


def test_hidden_term_of_the_step_equals_an_all_positions_reference(models):
    """Student and teacher hidden states from the models' own ``output_hidden_states`` (the
    input of layer l is entry l), the MSE over every trace position through the adapter."""
    teacher, student, nd_t, nd_s, targets = models
    arm = resolve_arm("feature-kd")
    fkd = make_feature_kd(teacher, student, arm, 0)
    _, parts = feature_kd_step(student.model, student, nd_s, nd_t, targets, fkd, arm, seed=0)
    with torch.no_grad():
        hs_s = student.model(input_ids=nd_s.input_ids[None], output_hidden_states=True).hidden_states
        hs_t = teacher.model(input_ids=nd_t.input_ids[None], output_hidden_states=True).hidden_states
        ts, tt = nd_s.trace_start, nd_t.trace_start
        want = torch.stack([F.mse_loss(_rms(fkd.adapter(hs_s[s][0, ts:])), _rms(hs_t[t][0, tt:]))
                            for s, t in fkd.pairs]).mean()
    # float32 means over pairs x ~500 positions x 64 widths, summed in another order: relative
    # error ~ sqrt(terms) x 2^-24 ~ 1e-5 at worst; 1e-4 leaves a margin
    assert parts["feature_kd/hidden"] == pytest.approx(float(want), rel=1e-4)


def test_the_arms_flags_build_the_pairs_and_adapters(models):
    teacher, student, *_ = models
    shared = make_feature_kd(teacher, student, resolve_arm("feature-kd"), 0)
    assert isinstance(shared, FeatureKD) and isinstance(shared.adapter, nn.Linear)
    assert shared.pairs == uniform_layer_pairs(4, 6) and shared.n_positions == 64
    per = make_feature_kd(teacher, student, resolve_arm("feature-kd", "fkd_adapter=per_pair,fkd_layer_map=linspace,"
                                                                     "fkd_adapter_bias=false"), 0)
    assert per.pairs == uniform_layer_pairs(4, 6, rule="linspace")
    assert len(per.adapter) == 4 and all(a.bias is None for a in per.adapter)
    assert not torch.equal(per.adapter[0].weight, per.adapter[1].weight)
    again = make_feature_kd(teacher, student, resolve_arm("feature-kd", "fkd_adapter=per_pair"), 0)
    assert torch.equal(again.adapter[2].weight, make_feature_kd(
        teacher, student, resolve_arm("feature-kd", "fkd_adapter=per_pair"), 0).adapter[2].weight)
    assert len(per.parameters()) == 4 and len(shared.parameters()) == 2


@pytest.mark.parametrize("flags", ["fkd_hidden_site=output", "fkd_adapter=per_pair"])
def test_other_flags_train(models, flags):
    teacher, student, nd_t, nd_s, targets = models
    arm = resolve_arm("feature-kd", flags)
    fkd = make_feature_kd(teacher, student, arm, 0)
    student.model.zero_grad(set_to_none=True)
    loss, parts = feature_kd_step(student.model, student, nd_s, nd_t, targets, fkd, arm, seed=0)
    loss.backward()
    assert parts["feature_kd/hidden"] > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in fkd.parameters())
