"""Window attribution, ablation at the locus, follow-through and residual swap on tiny random models."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from mistill.instrument.attribution import fidelity
from mistill.instrument.hooks import HeadHook, Patch
from mistill.instrument.patching import margins_from_logits
from mistill.instrument.runner import Runner
from mistill.instrument.window import (SwapResult, SwapSite, ablate_at, align_positions,
                                       destroyed_share, flip_layer, follow_through, make_window,
                                       masked_margins, forced_tokens, residual_swap, suffix_sum,
                                       swap_layer_grid, transport_ratio, window_attribution,
                                       window_sum)
from mistill.models.loading import tiny_model
from tests.model_fixtures import sharpen

FAMILIES = ["qwen3", "llama"]
N_TOKENS = 140
TARGET, COMPETITORS = 11, (12, 13, 14, 15)
LETTERS = (11, 12, 13, 14, 15)  # the letters after the suffix
SPACED = (21, 22, 23, 24, 25)  # the same letters in another spacing variant
SUFFIX = torch.tensor([101, 102, 103, 104, 105])


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2000, (n,), generator=g)


@pytest.fixture(scope="module", params=FAMILIES)
def note(request):
    lm = sharpen(tiny_model(request.param, layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=3))
    ids = _ids(N_TOKENS, 1)
    runner = Runner(lm, chunk_size=48)
    hook = HeadHook(lm.geometry)
    with hook.accumulate_mean() as acc:
        prefix, _ = runner.prefill(ids)
    return lm, runner, hook, prefix, ids, acc.mean


def _plain_logits(lm, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(tokens.view(1, -1)).logits[0, -1].float()


def _plain_margin(lm, tokens: torch.Tensor, target=TARGET, comps=COMPETITORS) -> float:
    return float(margins_from_logits(_plain_logits(lm, tokens), target, comps))


# -- the window ---------------------------------------------------------------------------------

def test_make_window_clamps_at_floor():
    w = make_window(100, 5, width=64)
    assert (w.start, w.n_window, w.n_rows) == (37, 64, 69)
    assert w.positions.tolist() == list(range(37, 106))
    assert make_window(20, 5).start == 0 and make_window(20, 5).n_window == 21
    assert make_window(20, 0, floor=10).start == 10
    with pytest.raises(ValueError):
        make_window(5, 0, floor=10)


@pytest.mark.parametrize("locus,width", [(90, 64), (20, 64), (110, 16)])
def test_forced_margin_equals_plain_forward(note, locus, width):
    lm, runner, hook, prefix, ids, mean = note
    ref = _plain_margin(lm, torch.cat([ids[:locus + 1], SUFFIX]))
    wa = window_attribution(runner, hook, prefix, ids, locus, SUFFIX, TARGET, COMPETITORS, mean, width=width)
    assert wa.margin == pytest.approx(ref, abs=1e-4)
    win = make_window(locus, SUFFIX.numel(), width=width)
    assert wa.importance.shape == (win.n_rows, lm.geometry.n_total_heads)
    assert wa.n_window == win.n_window and wa.positions.tolist() == win.positions.tolist()
    clean = ablate_at(runner, hook, prefix, ids, locus, SUFFIX, TARGET, COMPETITORS, mean, [([], "both")],
                      width=width)
    assert clean[0].item() == pytest.approx(ref, abs=1e-4)


def test_window_needs_the_prefix_up_to_its_start(note):
    lm, runner, hook, prefix, ids, mean = note
    short = runner.prefill(ids[:30])[0]
    with pytest.raises(ValueError):
        window_attribution(runner, hook, short, ids, 100, SUFFIX, TARGET, COMPETITORS, mean)
    # the prefix holding more than the window start is only read up to it
    full = ablate_at(runner, hook, prefix, ids, 100, SUFFIX, TARGET, COMPETITORS, mean, [([], "both")], width=16)
    exact = runner.prefill(ids[:85])[0]
    cropped = ablate_at(runner, hook, exact, ids, 100, SUFFIX, TARGET, COMPETITORS, mean, [([], "both")], width=16)
    assert full[0].item() == pytest.approx(cropped[0].item(), abs=1e-4)


# -- window attribution against exact ablation -----------------------------------------------------

def _row_masks(runner, n_rows: int, row: int) -> torch.Tensor:
    """One variant per head, ablated at one row only: ``[head, row, layer, head]``."""
    g = runner.geometry
    m = torch.zeros(g.n_total_heads, n_rows, g.n_total_heads, dtype=torch.bool)
    m[torch.arange(g.n_total_heads), row, torch.arange(g.n_total_heads)] = True
    return m.view(g.n_total_heads, n_rows, g.n_layers, g.n_heads)


@pytest.mark.parametrize("family", FAMILIES)
def test_window_attribution_tracks_exact_window_ablation(family):
    lm = tiny_model(family, layers=4, heads=4, kv_heads=2, d_head=16, d_model=64, seed=7)
    g = lm.geometry
    ids = _ids(N_TOKENS, 8)
    runner, hook = Runner(lm, chunk_size=64), HeadHook(g)
    with hook.accumulate_mean() as acc:
        prefix, _ = runner.prefill(ids)
    locus, width = 100, 16
    wa = window_attribution(runner, hook, prefix, ids, locus, SUFFIX, TARGET, COMPETITORS, acc.mean, width=width)
    heads = range(g.n_total_heads)
    for where, first in (("window", window_sum(wa.importance, wa.n_window)),
                         ("suffix", suffix_sum(wa.importance, wa.n_window))):
        ablated = ablate_at(runner, hook, prefix, ids, locus, SUFFIX, TARGET, COMPETITORS, acc.mean,
                            [([h], where) for h in heads], width=width)
        exact = wa.margin - ablated
        assert fidelity(first.numpy(), exact.numpy())["pearson"] > 0.9, where
    # per (position, head): the locus row, a row before it and the last suffix row
    win = make_window(locus, SUFFIX.numel(), width=width)
    tokens = forced_tokens(ids, win, SUFFIX)
    for row in (win.n_window - 1, win.n_window - 3, win.n_rows - 1):
        m = masked_margins(runner, hook, prefix, win.start, tokens, _row_masks(runner, win.n_rows, row),
                           acc.mean, win.n_rows - 1, TARGET, COMPETITORS)
        assert fidelity(wa.importance[row].numpy(), (wa.margin - m).numpy())["pearson"] > 0.9, row


def test_detached_attribution_differs_from_intact(note):
    lm, runner, hook, prefix, ids, mean = note
    intact = window_attribution(runner, hook, prefix, ids, 100, SUFFIX, TARGET, COMPETITORS, mean, width=16)
    cut = window_attribution(runner, hook, prefix, ids, 100, SUFFIX, TARGET, COMPETITORS, mean, width=16,
                             detach=True)
    assert cut.margin == pytest.approx(intact.margin, abs=1e-5)
    # the last layer's heads have only the direct path: the same either way
    last = slice((lm.geometry.n_layers - 1) * lm.geometry.n_heads, None)
    torch.testing.assert_close(cut.importance[:, last], intact.importance[:, last], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(cut.importance, intact.importance, atol=1e-3)


# -- sums and ablation variants -------------------------------------------------------------------

def test_window_and_suffix_sums_partition_the_rows(note):
    lm, runner, hook, prefix, ids, mean = note
    wa = window_attribution(runner, hook, prefix, ids, 90, SUFFIX, TARGET, COMPETITORS, mean, width=24)
    ws, ss = window_sum(wa.importance, wa.n_window), suffix_sum(wa.importance, wa.n_window)
    assert ws.shape == ss.shape == (lm.geometry.n_total_heads,)
    torch.testing.assert_close(ws + ss, wa.importance.sum(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ss, wa.importance[-SUFFIX.numel():].sum(0), rtol=1e-5, atol=1e-6)
    assert wa.n_window == 24


def test_ablate_at_positions(note):
    lm, runner, hook, prefix, ids, mean = note
    g = lm.geometry
    locus, width = 90, 24
    every = list(range(g.n_total_heads))
    variants = [([], "window"), ([5], "window"), ([5], "suffix"), ([5], "both"), (every, "both"),
                (every, "window")]
    m = ablate_at(runner, hook, prefix, ids, locus, SUFFIX, TARGET, COMPETITORS, mean, variants, width=width)
    assert m.shape == (len(variants),) and m.dtype == torch.float32
    assert len({round(x, 4) for x in m[1:4].tolist()}) == 3  # window, suffix, both: three different reads
    # batching does not matter
    again = ablate_at(runner, hook, prefix, ids, locus, SUFFIX, TARGET, COMPETITORS, mean, variants, width=width,
                      batch_size=2)
    torch.testing.assert_close(again, m, rtol=1e-4, atol=1e-4)
    # every head mean-ablated at every window and suffix row: the head outputs are the means
    # everywhere, so the hook can replace them directly in a plain forward of the rows
    win = make_window(locus, SUFFIX.numel(), width=width)
    with torch.no_grad(), hook.patch(Patch(mask=torch.ones(1, win.n_rows, g.n_layers, g.n_heads, dtype=torch.bool),
                                           values=mean)):
        out = runner.forward(prefix, win.start, forced_tokens(ids, win, SUFFIX).view(1, -1), win.positions,
                             rows="causal")
    assert m[4].item() == pytest.approx(float(margins_from_logits(out.logits[0, -1], TARGET, COMPETITORS)), abs=1e-4)
    # and the same as an ablation of every head at the window followed by every head at the suffix:
    # a reference built from plain HF with a pre-hook on o_proj at the forced rows
    ref = _hf_mean_ablated_margin(lm, torch.cat([ids[:locus + 1], SUFFIX]), mean, win.start)
    assert m[4].item() == pytest.approx(ref, abs=1e-4)
    win_only = _hf_mean_ablated_margin(lm, torch.cat([ids[:locus + 1], SUFFIX]), mean, win.start,
                                       stop=locus + 1)
    assert m[5].item() == pytest.approx(win_only, abs=1e-4)


def _hf_mean_ablated_margin(lm, tokens, mean, start, stop=None) -> float:
    """Plain HF forward with every head's output set to its mean at positions ``[start, stop)``."""
    g = lm.geometry
    handles = []

    def make(layer):
        def pre(module, args):
            z = args[0].view(*args[0].shape[:-1], g.n_heads, g.d_head).clone()
            z[:, start:stop] = mean[layer].to(z.dtype)
            return (z.view(args[0].shape),) + tuple(args[1:])
        return pre

    for p in g.layers:
        handles.append(p.o_proj.register_forward_pre_hook(make(p.index)))
    try:
        return _plain_margin(lm, tokens)
    finally:
        for h in handles:
            h.remove()


def test_destroyed_share():
    s = destroyed_share(torch.tensor([4.0, 4.0, 2.0, 0.0, -1.0]), torch.tensor([1.0, -2.0, 2.0, -1.0, -3.0]))
    assert s[:3].tolist() == [0.75, 1.5, 0.0]
    assert math.isnan(s[3]) and math.isnan(s[4])
    assert destroyed_share(2.0, 1.0).item() == 0.5


# -- follow-through -------------------------------------------------------------------------------

def test_follow_through_reproduces_natural_margin(note):
    lm, runner, hook, prefix, ids, mean = note
    locus, q = 90, 104
    ref = _plain_margin(lm, ids[:q + 1])
    sets = [[], [1, 6, 9], list(range(lm.geometry.n_total_heads))]
    plain = follow_through(runner, hook, prefix, ids, locus, q, TARGET, COMPETITORS, mean, sets, width=24)
    sustained = follow_through(runner, hook, prefix, ids, locus, q, TARGET, COMPETITORS, mean, sets, width=24,
                               sustained=True, batch_size=1)
    assert plain.shape == (3,)
    assert plain[0].item() == pytest.approx(ref, abs=1e-4)
    assert sustained[0].item() == pytest.approx(ref, abs=1e-4)
    assert abs(plain[1] - sustained[1]) > 2e-3 and abs(plain[2] - sustained[2]) > 2e-3
    assert abs(plain[1] - plain[0]) > 2e-4
    # the window ablation is the HF forward with the means written at the window positions
    start = make_window(locus, width=24).start
    ref_all = _hf_mean_ablated_margin(lm, ids[:q + 1], mean, start, stop=locus + 1)
    assert plain[2].item() == pytest.approx(ref_all, abs=1e-4)
    ref_sus = _hf_mean_ablated_margin(lm, ids[:q + 1], mean, start, stop=q + 1)
    assert sustained[2].item() == pytest.approx(ref_sus, abs=1e-4)
    short = follow_through(runner, hook, prefix, ids, locus, q, TARGET, COMPETITORS, mean, sets[2:], width=24,
                           sustained=True, include_code=False)
    assert short[0].item() == pytest.approx(_hf_mean_ablated_margin(lm, ids[:q + 1], mean, start, stop=q),
                                            abs=1e-4)


def test_follow_through_at_the_code_token_is_not_sustained_further(note):
    lm, runner, hook, prefix, ids, mean = note
    sets = [[2, 7]]
    a = follow_through(runner, hook, prefix, ids, 100, 100, TARGET, COMPETITORS, mean, sets)
    b = follow_through(runner, hook, prefix, ids, 100, 100, TARGET, COMPETITORS, mean, sets, sustained=True)
    assert a[0].item() == pytest.approx(b[0].item(), abs=1e-5)
    with pytest.raises(ValueError):
        follow_through(runner, hook, prefix, ids, 100, 99, TARGET, COMPETITORS, mean, sets)


# -- residual swap --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Choice:
    target_id: int
    competitor_ids: tuple[int, ...]


def _pick(letters: tuple[int, ...], i: int) -> tuple[int, tuple[int, ...]]:
    return letters[i], letters[:i] + letters[i + 1:]


def _site(locus: int, q: int, choice: int, natural: tuple[int, ...] = LETTERS) -> SwapSite:
    nat, comp = _pick(natural, choice)
    return SwapSite(locus=locus, q=q, forced=_Choice(*_pick(LETTERS, choice)), natural_target_id=nat,
                    natural_competitor_ids=comp)


def test_swap_with_own_residual_is_identity(note):
    lm, runner, hook, prefix, ids, mean = note
    site = _site(95, 103, 0)
    layers = swap_layer_grid(lm.geometry.n_layers, step=1)
    assert layers == [0, 1]
    for place in ("locus", "tail", "code"):
        res = residual_swap(runner, prefix, ids, site, site, layers, place, SUFFIX, width=24)
        assert [r.layer for r in res] == layers
        for r in res:
            assert r.forced == pytest.approx(r.clean_forced, abs=1e-5)
            assert r.natural == pytest.approx(r.clean_natural, abs=1e-5)
            assert r.forced_donor == pytest.approx(r.clean_forced_donor, abs=1e-5)
            assert r.natural_donor == pytest.approx(r.clean_natural_donor, abs=1e-5)
            assert r.n_natural == (8 if place == "tail" else 1)
            assert r.n_forced == {"locus": 1, "tail": 8, "code": 0}[place]
    # clean margins are the plain reads
    r = res[0]
    assert r.clean_forced == pytest.approx(_plain_margin(lm, torch.cat([ids[:96], SUFFIX])), abs=1e-4)
    assert r.clean_natural == pytest.approx(_plain_margin(lm, ids[:104]), abs=1e-4)
    assert r.clean_natural_donor == pytest.approx(r.clean_natural, abs=1e-6)


def _hf_swapped_logits(lm, tokens, layer, pairs, donor_hidden) -> torch.Tensor:
    """Plain HF forward with the output of decoder layer ``layer`` replaced at target positions."""
    def post(module, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h = h.clone()
        for tp, dp in pairs:
            h[0, tp] = donor_hidden[dp]
        return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h

    handle = lm.geometry.layers[layer].layer.register_forward_hook(post)
    try:
        return _plain_logits(lm, tokens)
    finally:
        handle.remove()


@pytest.mark.parametrize("place", ["locus", "tail", "code"])
def test_swap_matches_plain_forward_with_replaced_residual(note, place):
    lm, runner, hook, prefix, ids, mean = note
    # the target writes its letter in another spacing variant than the donor
    target, donor = _site(110, 118, 0, SPACED), _site(70, 79, 3)
    layers = [0, 1]
    with pytest.raises(ValueError):
        residual_swap(runner, prefix, ids, target, donor, layers, place, SUFFIX, width=24)
    res = residual_swap(runner, prefix, ids, target, donor, layers, place, SUFFIX, width=24,
                        donor_natural_id=SPACED[3])
    with torch.no_grad():
        hs = lm.model(ids.view(1, -1), output_hidden_states=True).hidden_states
    t_pos = {"locus": [110], "tail": list(range(103, 111)), "code": [118]}[place]
    d_pos = {"locus": [70], "tail": list(range(63, 71)), "code": [79]}[place]
    pairs = list(zip(t_pos, d_pos))
    f_target, f_comp = _pick(LETTERS, 0)
    f_donor, f_other = _pick(LETTERS, 3)
    n_target, n_comp = _pick(SPACED, 0)
    n_donor, n_other = _pick(SPACED, 3)
    for r, layer in zip(res, layers):
        donor_hidden = hs[layer + 1][0]
        forced_pairs = [(t, d) for t, d in pairs if t <= 110]
        forced = _hf_swapped_logits(lm, torch.cat([ids[:111], SUFFIX]), layer, forced_pairs, donor_hidden)
        natural = _hf_swapped_logits(lm, ids[:119], layer, pairs, donor_hidden)
        assert r.forced == pytest.approx(float(margins_from_logits(forced, f_target, f_comp)), abs=1e-4)
        assert r.forced_donor == pytest.approx(float(margins_from_logits(forced, f_donor, f_other)), abs=1e-4)
        assert r.natural == pytest.approx(float(margins_from_logits(natural, n_target, n_comp)), abs=1e-4)
        assert r.natural_donor == pytest.approx(float(margins_from_logits(natural, n_donor, n_other)), abs=1e-4)
        assert r.donor_wins == (int(natural[list(SPACED)].argmax()) == 3)
    # a different donor changes what it touches
    assert max(abs(r.natural_drop) + abs(r.donor_gain) for r in res) > 5e-4
    if place != "code":
        assert max(abs(r.forced_drop) for r in res) > 5e-4
    else:
        assert all(r.forced == r.clean_forced and r.n_forced == 0 for r in res)


def test_code_swap_hands_the_decision_to_the_donor(note):
    lm, runner, hook, prefix, ids, mean = note
    # two letters: the token the donor's code row prefers most over the target's, and the reverse
    diff = _plain_logits(lm, ids[:80]) - _plain_logits(lm, ids[:119])
    d_letter, t_letter = int(diff.argmax()), int(diff.argmin())

    def site(locus, q, letter, other):
        return SwapSite(locus=locus, q=q, forced=_Choice(letter, (other,)), natural_target_id=letter,
                        natural_competitor_ids=(other,))

    target, donor = site(110, 118, t_letter, d_letter), site(70, 79, d_letter, t_letter)
    res = residual_swap(runner, prefix, ids, target, donor, [0, 1], "code", SUFFIX, width=24)
    t_logits = _plain_logits(lm, ids[:119])
    assert res[0].clean_natural == pytest.approx(float(t_logits[t_letter] - t_logits[d_letter]), abs=1e-4)
    assert res[0].clean_natural_donor == pytest.approx(-res[0].clean_natural, abs=1e-5)
    for r in res:  # two letters: the donor wins exactly where its margin is positive
        assert r.donor_wins == (r.natural_donor > 0)
    # after the last layer but one the code row is mostly the donor's: its letter wins there
    assert res[-1].donor_wins and res[-1].donor_gain > 0
    assert flip_layer(res) in (0, 1)


def test_swap_checks_its_arguments(note):
    lm, runner, hook, prefix, ids, mean = note
    site = _site(95, 103, 0)
    with pytest.raises(ValueError):
        residual_swap(runner, prefix, ids, site, site, [lm.geometry.n_layers - 1], "tail", SUFFIX)
    with pytest.raises(ValueError):
        residual_swap(runner, prefix, ids, site, site, [0], "prose", SUFFIX)
    with pytest.raises(ValueError):
        _site(10, 9, 0)
    stranger = SwapSite(locus=70, q=79, forced=_Choice(99, (11, 12)), natural_target_id=14,
                        natural_competitor_ids=(11,))
    with pytest.raises(ValueError):  # the donor's forced letter is not one of the target's letters
        residual_swap(runner, prefix, ids, site, stranger, [0], "tail", SUFFIX)


def test_align_positions_pairs_from_the_locus_back():
    assert align_positions([3, 4, 5], [10, 11, 12]) == [(3, 10), (4, 11), (5, 12)]
    assert align_positions([1, 2, 3, 4, 5], [11, 12]) == [(4, 11), (5, 12)]
    assert align_positions([5], [8, 9]) == [(5, 9)]


def _result(layer: int, wins: bool, place: str = "code") -> SwapResult:
    return SwapResult(layer=layer, place=place, forced=0.0, forced_donor=0.0, natural=0.0, natural_donor=0.0,
                      clean_forced=0.0, clean_forced_donor=0.0, clean_natural=0.0, clean_natural_donor=0.0,
                      donor_wins=wins, n_forced=0, n_natural=1)


def test_swap_result_to_dict():
    d = _result(4, True).to_dict()
    assert d["layer"] == 4 and d["donor_wins"] is True and d["place"] == "code"
    assert {"forced_drop", "natural_drop", "donor_gain"} <= set(d)


def test_flip_layer():
    assert flip_layer([_result(l, w) for l, w in [(0, False), (4, False), (8, True), (12, True)]]) == 8
    # a win that does not last is not a flip
    assert flip_layer([_result(l, w) for l, w in [(0, True), (4, False), (8, True), (12, True)]]) == 8
    assert flip_layer([_result(12, False), _result(0, True)]) is None
    assert flip_layer([_result(4, True), _result(0, True)]) == 0
    assert flip_layer([]) is None
    with pytest.raises(ValueError):
        flip_layer([_result(0, True), _result(4, True, "tail")])


def test_transport_ratio():
    r = transport_ratio(torch.tensor([1.0, 2.0, 3.0, 0.5]), torch.tensor([4.0, 1.0, 0.5, 2.0]))
    assert r[0].item() == 0.25 and r[3].item() == 0.25
    assert math.isnan(r[1]) and math.isnan(r[2])  # forced drop <= 1 nat
    assert transport_ratio(1.0, 0.8, min_forced_drop=0.5).item() == pytest.approx(1.25)
    assert np.isnan(transport_ratio(1.0, 0.0, min_forced_drop=0.0).item())
