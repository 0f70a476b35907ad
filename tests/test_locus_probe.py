"""The forcing probe and the locus walk-back: probe rows against a fresh forward, the walk's
definition on hand-built curves, and the batched note-level walk."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from mistill.errors import MistillInputError
from mistill.instrument.locus import (OUTCOMES, SUFFIXES, ForcedChoice, LocusConfig, LocusResult, MentionProbe,
                                      forced_choice_ids, forced_margins, grid_distances, locate, locate_many,
                                      suffix_token_ids, walk_back)
from mistill.instrument.patching import margins_from_logits
from mistill.instrument.runner import Runner
from mistill.models.loading import embedded_tokenizer, tiny_model
from model_fixtures import sharpen

FAMILIES = ["qwen3", "llama"]
LETTERS = list("ABCDEIJKN")


@pytest.fixture(scope="module", params=FAMILIES)
def lm(request):
    return sharpen(tiny_model(request.param, layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=5), 5)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2000, (n,), generator=g)


def _fresh_margin(lm, ids: torch.Tensor, cut: int, suffix: torch.Tensor, choice: ForcedChoice) -> float:
    with torch.no_grad():
        logits = lm.model(torch.cat([ids[:cut + 1], suffix])[None]).logits[0, -1].float()
    return float(margins_from_logits(logits, choice.target_id, choice.competitor_ids))


class _CountForwards:
    def __init__(self, runner: Runner) -> None:
        self.calls = 0
        self._inner = runner.forward

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._inner(*args, **kwargs)


# -- the forced choice -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    return embedded_tokenizer()


@pytest.mark.parametrize("name", sorted(SUFFIXES))
def test_forced_choice_is_the_spaced_letter_token(tok, name):
    ch = forced_choice_ids(tok, SUFFIXES[name], "N", LETTERS)
    assert ch.target_id == tok.convert_tokens_to_ids("ĠN")
    assert ch.competitor_ids == tuple(tok.convert_tokens_to_ids("Ġ" + x) for x in LETTERS if x != "N")
    assert suffix_token_ids(tok, name).tolist() == tok(SUFFIXES[name], add_special_tokens=False)["input_ids"]


class _MergingTokenizer:
    """Character ids without spaces, except that a text containing ``Q`` is one merged id."""

    def __call__(self, text: str, add_special_tokens: bool = False):
        return {"input_ids": [999] if "Q" in text else [ord(c) for c in text if c != " "]}


def test_forced_choice_names_the_letter_that_does_not_follow_the_suffix(tok):
    merging = _MergingTokenizer()
    assert forced_choice_ids(merging, "is", "N", ["A", "N", "B", "A"]) == ForcedChoice(ord("N"), (ord("A"), ord("B")))
    with pytest.raises(MistillInputError, match="'Q'"):
        forced_choice_ids(merging, "is", "N", ["N", "A", "Q"])
    with pytest.raises(MistillInputError, match="'Q'"):
        forced_choice_ids(merging, "is", "Q", ["N", "A"])
    with pytest.raises(MistillInputError, match="competitor"):
        forced_choice_ids(tok, SUFFIXES["B"], "N", ["N"])


# -- the probe rows --------------------------------------------------------------------------

def test_probe_rows_equal_fresh_forwards_in_one_batch(lm):
    ids = _ids(120, 1)
    runner = Runner(lm, chunk_size=32)
    prefix, _ = runner.prefill(ids)
    suffix = suffix_token_ids(lm.tokenizer, "B")
    cuts = [3, 50, 119, 17, 80, 50]
    choices = [forced_choice_ids(lm.tokenizer, SUFFIXES["B"], t, LETTERS) for t in "NEAIKN"]
    counter = _CountForwards(runner)
    runner.forward = counter
    got = forced_margins(runner, prefix, cuts, suffix, choices)
    assert counter.calls == 1
    ref = torch.tensor([_fresh_margin(lm, ids, c, suffix, ch) for c, ch in zip(cuts, choices)])
    assert (got - ref).abs().max().item() <= 1e-5
    assert ref.abs().min().item() > 0.1  # margins of order one: the 1e-5 check has teeth
    # small batches give the same rows; the prefix is untouched
    again = forced_margins(runner, prefix, cuts, suffix, choices, batch_size=2)
    assert (again - got).abs().max().item() <= 1e-5
    assert prefix.length == 120


def test_batch_prefix_len_each_element_sees_its_own_prefix(lm):
    """Against one element per forward, and against the whole prefix (which must differ)."""
    ids = _ids(90, 2)
    runner = Runner(lm, chunk_size=40)
    prefix, _ = runner.prefill(ids)
    suffix = suffix_token_ids(lm.tokenizer, "D")
    lens = torch.tensor([10, 61, 33])
    pos = lens[:, None] + torch.arange(suffix.numel())[None]
    with torch.no_grad():
        joint = runner.forward(prefix, 61, suffix.expand(3, -1), pos, rows="causal",
                               batch_prefix_len=lens).logits
        alone = torch.cat([runner.forward(prefix, int(n), suffix[None], pos[b], rows="causal").logits
                           for b, n in enumerate(lens.tolist())])
        unmasked = runner.forward(prefix, 61, suffix.expand(3, -1), pos, rows="causal").logits
    torch.testing.assert_close(joint, alone, rtol=0, atol=1e-5)
    assert (unmasked[0] - alone[0]).abs().max().item() > 1e-3
    with pytest.raises(ValueError, match="rows='causal'"):
        runner.forward(prefix, 61, suffix.expand(3, -1), pos, rows="own", batch_prefix_len=lens)
    with pytest.raises(ValueError, match="entries"):
        runner.forward(prefix, 61, suffix.expand(3, -1), pos, rows="causal", batch_prefix_len=lens[:2])
    with pytest.raises(ValueError, match="beyond"):
        runner.forward(prefix, 40, suffix.expand(3, -1), pos, rows="causal", batch_prefix_len=lens)


def test_forced_margins_rejects_cuts_outside_the_prefix(lm):
    runner = Runner(lm)
    prefix, _ = runner.prefill(_ids(20))
    ch = forced_choice_ids(lm.tokenizer, SUFFIXES["B"], "N", LETTERS)
    suffix = suffix_token_ids(lm.tokenizer)
    for bad in ([20], [-1]):
        with pytest.raises(MistillInputError, match="cuts"):
            forced_margins(runner, prefix, bad, suffix, ch)
    with pytest.raises(MistillInputError, match="choices"):
        forced_margins(runner, prefix, [1, 2], suffix, [ch])


# -- the configuration -------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("theta", 0.0), ("theta", float("nan")), ("step", 0), ("step", 2.5),
                                         ("max_back", 0), ("extra_steps", -1), ("suffix", "C"),
                                         ("grid_batch", 0), ("step", True)])
def test_locus_config_validation_names_the_field(field, value):
    with pytest.raises(MistillInputError, match=f"'{field}'"):
        LocusConfig(**{field: value})


def test_locus_config_defaults():
    cfg = LocusConfig()
    assert (cfg.theta, cfg.step, cfg.max_back, cfg.extra_steps, cfg.suffix, cfg.grid_batch) == (2.0, 8, 512, 4, "B", 8)
    assert OUTCOMES == ("code_token", "window", "inherited", "probe_failure", "censored")


# -- the walk on hand-built curves -----------------------------------------------------------

class _Curve:
    """A probe from a margin function of the distance ``q - cut``; records every round's cuts."""

    def __init__(self, q: int, fn: Callable[[int], float]) -> None:
        self.q, self.fn, self.rounds = q, fn, []

    def __call__(self, cuts: list[int]) -> list[float]:
        self.rounds.append(list(cuts))
        return [self.fn(self.q - c) for c in cuts]

    @property
    def distances(self) -> list[int]:
        return sorted(self.q - c for r in self.rounds for c in r)


def _step_curve(last_decisive: int, high: float = 6.0, low: float = -3.0) -> Callable[[int], float]:
    return lambda d: high if d <= last_decisive else low


def test_walk_window_refined_to_the_token_with_its_jump():
    q = 300
    probe = _Curve(q, lambda d: 6.0 - 0.1 * d if d <= 13 else -2.5)
    res = walk_back(probe, q, trace_start=20, previous_code_end=None, cfg=LocusConfig())
    assert res.outcome == "window"
    assert (res.locus, res.distance) == (q - 13, 13)
    assert res.jump == pytest.approx((6.0 - 0.8) - (-2.5))
    # grid to the crossing at 16, four extra grid points, every token strictly inside (8, 16)
    assert [d for d, _ in res.curve] == [0, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 32, 40, 48]
    assert res.n_probes == len(res.curve) == 14
    assert res.curve == [(d, probe.fn(d)) for d, _ in res.curve]
    assert not res.returns_above and not res.reached_trace_start


def test_walk_boundary_between_window_and_inherited():
    q = 300
    cfg = LocusConfig()
    fn = _step_curve(13)
    assert walk_back(_Curve(q, fn), q, 20, q - 14, cfg).outcome == "window"   # locus 287 > 286
    res = walk_back(_Curve(q, fn), q, 20, q - 13, cfg)                        # locus 287 == end: inherited
    assert (res.outcome, res.locus, res.distance) == ("inherited", q - 13, 13)
    assert walk_back(_Curve(q, fn), q, 20, q - 5, cfg).outcome == "inherited"


def test_walk_probe_failure_code_token_and_censored():
    q = 1000
    cfg = LocusConfig()
    fail = walk_back(_Curve(q, lambda d: 1.99 if d == 0 else 5.0), q, 10, None, cfg)
    assert (fail.outcome, fail.locus, fail.distance, fail.jump) == ("probe_failure", None, None, None)
    assert [d for d, _ in fail.curve] == [0, 8, 16, 24, 32]  # the crossing and four extra grid points
    assert fail.returns_above
    at_code = walk_back(_Curve(q, lambda d: 2.0 if d == 0 else 1.0), q, 10, None, cfg)  # exactly theta decides
    assert (at_code.outcome, at_code.locus, at_code.distance) == ("code_token", q, 0)
    assert [d for d, _ in at_code.curve] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40]
    assert at_code.jump == pytest.approx(1.0)
    probe = _Curve(q, lambda d: 3.0)
    cens = walk_back(probe, q, 10, None, cfg)
    assert (cens.outcome, cens.locus, cens.distance, cens.reached_trace_start) == ("censored", None, None, False)
    assert probe.distances == list(range(0, 513, 8)) and cens.n_probes == 65
    assert {r.outcome for r in (fail, at_code, cens)} | {"window", "inherited"} == set(OUTCOMES)


def test_walk_returns_above_theta_keeps_the_nearer_crossing():
    q = 400
    # decisive to 20, a dip over (20, 30], decisive again from 31 on (the grid points 32, 40, ...)
    res = walk_back(_Curve(q, lambda d: 4.0 if d <= 20 or d > 30 else 0.5), q, 0, None, LocusConfig())
    assert res.outcome == "window" and res.distance == 20 and res.locus == q - 20
    assert res.returns_above
    assert [d for d, _ in res.curve] == [0, 8, 16, 17, 18, 19, 20, 21, 22, 23, 24, 32, 40, 48, 56]
    assert res.jump == pytest.approx(3.5)
    # a dip inside the refined step: the locus stops before it
    res = walk_back(_Curve(q, lambda d: 0.0 if d in (19, 24) else 4.0), q, 0, None, LocusConfig())
    assert (res.outcome, res.distance, res.returns_above) == ("window", 18, True)
    # a dip between two decisive grid points is not probed: only the crossing step is refined
    res = walk_back(_Curve(q, lambda d: 0.0 if d in (11, 24) else 4.0), q, 0, None, LocusConfig())
    assert res.distance == 23 and 11 not in [d for d, _ in res.curve]


def test_walk_trace_start_rule():
    q = 100
    probe = _Curve(q, lambda d: 3.0)
    res = walk_back(probe, q, trace_start=60, previous_code_end=None, cfg=LocusConfig())
    # earliest cut: the last prompt token 59, probed although it is off the 8-token grid
    assert probe.distances == [0, 8, 16, 24, 32, 40, 41]
    assert (res.outcome, res.locus, res.distance, res.reached_trace_start) == ("window", 59, 41, True)
    assert walk_back(_Curve(q, lambda d: 3.0), q, 60, 70, LocusConfig()).outcome == "inherited"
    # crossing at the off-grid earliest cut: nothing to refine inside (40, 41)
    res = walk_back(_Curve(q, _step_curve(40)), q, 60, None, LocusConfig())
    assert (res.distance, res.reached_trace_start, res.returns_above) == (40, False, False)
    assert [d for d, _ in res.curve] == [0, 8, 16, 24, 32, 40, 41]
    # trace start exactly max_back before q: censored, not the trace-start rule
    res = walk_back(_Curve(600, lambda d: 3.0), 600, 89, None, LocusConfig())
    assert res.outcome == "censored"
    res = walk_back(_Curve(600, lambda d: 3.0), 600, 90, None, LocusConfig())
    assert (res.outcome, res.distance, res.reached_trace_start) == ("window", 511, True)
    with pytest.raises(MistillInputError, match="'q'"):
        walk_back(_Curve(50, lambda d: 3.0), 50, 60, None, LocusConfig())


def test_walk_extra_steps_stay_within_the_allowed_range():
    q = 100
    res = walk_back(_Curve(q, _step_curve(20)), q, 75, None, LocusConfig())  # earliest cut 74: d <= 26
    assert [d for d, _ in res.curve] == [0, 8, 16, 17, 18, 19, 20, 21, 22, 23, 24, 26]
    res = walk_back(_Curve(q, _step_curve(20)), q, 0, None, LocusConfig(extra_steps=0, step=4))
    assert [d for d, _ in res.curve] == [0, 4, 8, 12, 16, 20, 21, 22, 23, 24]
    assert (res.distance, res.returns_above) == (20, False)


def _random_curve(seed: int) -> Callable[[int], float]:
    g = torch.Generator().manual_seed(seed)
    vals = (torch.randn(700, generator=g) * 3 + 2.5).tolist()
    return lambda d: vals[d]


def test_walk_does_not_depend_on_grid_batch():
    cases = [(300, 20, None, _step_curve(13)), (1000, 10, None, lambda d: 3.0), (100, 60, 70, lambda d: 3.0),
             (300, 20, None, _step_curve(0)), (300, 20, None, _step_curve(-1)),
             (400, 0, 390, lambda d: 4.0 if d <= 20 or d > 30 else 0.5)]
    cases += [(600, 30, 580 - s, _random_curve(s)) for s in range(12)]
    cases += [(600, 30, None, lambda d, s=s: 2.5 + math.cos(d / (3 + s))) for s in range(6)]
    seen = set()
    for q, start, prev, fn in cases:
        ref = walk_back(_Curve(q, fn), q, start, prev, LocusConfig(grid_batch=1)).to_dict()
        seen.add(ref["outcome"])
        for gb in (2, 3, 8, 100):
            probe = _Curve(q, fn)
            got = walk_back(probe, q, start, prev, LocusConfig(grid_batch=gb)).to_dict()
            assert got == ref
            grid = grid_distances(q - max(q - 512, start - 1, 0), 8)
            assert probe.rounds[0] == [q]  # the code token alone first
            if len(grid) > 1:  # then a round of grid points, or (a probe failure) the extra steps
                want = min(gb, len(grid) - 1) if got["outcome"] != "probe_failure" else min(4, len(grid) - 1)
                assert len(probe.rounds[1]) == want
    assert seen == set(OUTCOMES)


def test_result_round_trips_through_json_rows():
    import json

    res = walk_back(_Curve(300, _step_curve(13)), 300, 20, None, LocusConfig())
    row = json.loads(json.dumps({"note_id": "n1", **res.to_dict()}))
    assert LocusResult.from_dict(row) == res
    fail = walk_back(_Curve(300, lambda d: 0.0), 300, 20, None, LocusConfig())
    assert LocusResult.from_dict(json.loads(json.dumps(fail.to_dict()))) == fail


# -- the walk on a model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharp_lm(lm):
    """``lm`` with its output layer scaled so forced margins vary over several nats."""
    out = sharpen(tiny_model(lm.geometry.family, layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=5), 5)
    with torch.no_grad():
        out.geometry.lm_head.weight.mul_(20)
    return out


_TOL = 1e-5
"""Per nat of margin (plus one): float32 rounding of the same probe in batches of other shapes."""


def test_locate_many_equals_locate_per_mention(sharp_lm):
    lm = sharp_lm
    ids = _ids(160, 0)
    runner = Runner(lm, chunk_size=64)
    prefix, _ = runner.prefill(ids)
    suffix = suffix_token_ids(lm.tokenizer, "B")
    letters = list("ABCDE")
    cfg = LocusConfig(theta=0.5, step=4, max_back=32, extra_steps=2, grid_batch=3)
    choices = [forced_choice_ids(lm.tokenizer, SUFFIXES["B"], t, letters) for t in letters]
    qs = [70, 99, 112, 126, 151, 159]
    at_code = forced_margins(runner, prefix, [q for q in qs for _ in letters], suffix, choices * len(qs))
    best = at_code.view(len(qs), len(letters)).argmax(1).tolist()  # each mention's emitted letter: the best
    mentions = []
    for i, q in enumerate(qs):
        mentions.append(MentionProbe(q=q, choice=choices[best[i]], trace_start=60,
                                     previous_code_end=None if i == 0 else q - 6 - 3 * i))
    counter = _CountForwards(runner)
    runner.forward = counter
    singles, rounds = [], []
    for m in mentions:
        counter.calls = 0
        singles.append(locate(runner, prefix, m.q, m.choice, suffix, m.trace_start, m.previous_code_end, cfg))
        rounds.append(counter.calls)
    counter.calls = 0
    joint = locate_many(runner, prefix, mentions, suffix, cfg)
    del runner.forward
    margins = [m for r in singles for _, m in r.curve]
    assert min(abs(m - cfg.theta) for m in margins) > 1e-3  # no near-tie decides the comparison
    assert len({r.outcome for r in singles}) >= 3
    for s, j in zip(singles, joint):
        a, b = s.to_dict(), j.to_dict()
        assert [d for d, _ in a.pop("curve")] == [d for d, _ in b["curve"]]
        # the two routes run the probes in batches of other shapes and split the keys at other
        # cuts (the shortest cut of each batch): float32 rounding of logits that the 20x output
        # layer makes large, so the tolerance grows with the margin (observed: <= 1.1e-5 at 6 nats)
        for (_, x), (_, y) in zip(s.curve, j.curve):
            assert abs(x - y) <= _TOL * (1 + abs(x))
        b.pop("curve")
        jump_a, jump_b = a.pop("jump"), b.pop("jump")
        assert a == b
        assert (jump_a is None) == (jump_b is None)
        if jump_a is not None:
            ends = [m for d, m in s.curve]
            assert abs(jump_a - jump_b) <= 2 * _TOL * (1 + max(abs(m) for m in ends))
    # every round of every mention's walk runs in one shared forward
    assert counter.calls == max(rounds) < sum(rounds)
    # the probes reproduce fresh forwards of the cropped context
    for m, r in list(zip(mentions, joint))[:3]:
        d, margin = r.curve[-1]
        assert abs(_fresh_margin(lm, ids, m.q - d, suffix, m.choice) - margin) <= 1e-5


# -- the embedded real model -------------------------------------------------------------------

@pytest.mark.real_model
def test_probe_row_equals_fresh_forward_on_smollm2():
    from mistill.models.loading import EMBEDDED_DEFAULT, load_model

    lm = load_model(EMBEDDED_DEFAULT)
    text = ("Under N, for the chronic kidney disease, I see N18.1, N18.9 and N18.30. N18.1 does not fit; "
            "set aside. For the type 2 diabetes, E11.9 or E11.65; E11.65 matches. Hypertension: I10.")
    ids = torch.tensor(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    runner = Runner(lm)
    prefix, _ = runner.prefill(ids)
    suffix = suffix_token_ids(lm.tokenizer, "B")
    letters = list("ABCDEIJKN")
    choices = [forced_choice_ids(lm.tokenizer, SUFFIXES["B"], t, letters) for t in "NEI"]
    cuts = [12, 30, int(ids.numel()) - 1]
    got = forced_margins(runner, prefix, cuts, suffix, choices)
    ref = torch.tensor([_fresh_margin(lm, ids, c, suffix, ch) for c, ch in zip(cuts, choices)])
    assert ref.abs().min().item() > 0.1
    # 1e-5 nats per nat of margin: 30 float32 layers summed in another order than the fresh forward
    assert ((got - ref).abs() <= 1e-5 * (1 + ref.abs())).all(), (got - ref).tolist()
