"""The attribution and knock-in passes on a tiny model with hand-made queries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mistill.distributed import World
from mistill.instrument.hooks import HeadHook
from mistill.instrument.passes import (AttributionConfig, EventQuery, KnockinConfig, attribute_note,
                                       knockin_sweep, match_donor_event, per_note_set_rows, set_variants)
from mistill.instrument.patching import Query
from mistill.instrument.runner import Runner
from mistill.instrument.waves import attribute_waves, selftest_scope
from mistill.models.loading import tiny_model


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen3", layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=11)


def _events(ids: torch.Tensor, positions, kinds, note: str):
    letters = list(range(300, 310))
    out = []
    for i, (p, k) in enumerate(zip(positions, kinds)):
        t = letters[i % len(letters)]
        out.append(EventQuery(event_id=f"{note}:{k}:{i}", kind=k, target=str(i % 3), char_index=0,
                              query=Query(position=p, token_id=int(ids[p]), target_id=t,
                                          competitor_ids=tuple(x for x in letters if x != t))))
    return out


def test_attribution_pass_shapes_exact_and_selftest(lm):
    g = lm.geometry
    ids = torch.randint(0, 2000, (150,), generator=torch.Generator().manual_seed(0))
    kinds = ["P1", "P2", "P1", "NULL", "NULL", "P2C", "NULL", "NULL"]
    events = _events(ids, [140, 130, 120, 100, 90, 90, 70, 60], kinds, "n0")  # a shared position, as P2 and P2C can have
    cfg = AttributionConfig(top_nominees=5, global_nominees=2, exact_kinds=("P1", "NULL"), chunk_size=64,
                            selftest_events=1, grad_batch=3)
    att = attribute_note(Runner(lm, chunk_size=64), HeadHook(g), "n0", ids, events, cfg,
                         running_global=[0, 1], progress=False)
    assert att.first_order.shape == (8, g.n_total_heads)
    exact_rows = ~np.isnan(att.exact).all(axis=1)
    # P1 events and half (2 of 4) of the NULL events get exact patches; P2/P2C do not (exact_kinds)
    assert exact_rows.tolist()[:3] == [True, False, True] and not exact_rows[5]
    assert exact_rows[[3, 4, 6, 7]].sum() == 2
    # every exact row covers the top-5 nominees plus the running global heads
    for r in np.flatnonzero(exact_rows):
        measured = set(np.flatnonzero(~np.isnan(att.exact[r])).tolist())
        assert {0, 1} <= measured and 5 <= len(measured) <= 7
    assert len(att.selftest) == 1 and att.selftest[0]["intact.pearson"] > 0.8
    # the noise readouts: a CPU's repeated forwards agree, so every head with an effect is above
    # the floor and the correlation above it is the correlation over those heads; the all-heads
    # knock-in reproduces the clean margin
    row = att.selftest[0]
    assert row["noise.sd"] < 1e-5 and row["noise.range"] < 1e-5
    assert row["n_above_noise"] >= 0.9 * g.n_total_heads
    if row["n_above_noise"] == g.n_total_heads:
        assert row["intact_above_noise.pearson"] == pytest.approx(row["intact.pearson"], abs=1e-12)
    assert row["intact_above_noise.pearson"] > 0.8 and np.isfinite(row["detached_above_noise.pearson"])
    assert abs(row["knockin_all.minus_clean"]) < 1e-4
    imp = att.importance
    assert np.isfinite(imp).all()


def test_selftest_restricted_to_the_first_notes_of_the_pass(lm):
    """``selftest_notes=1``: only the pass's first note in corpus order is self-tested (the paper's
    ten P1 events of one note), also when that note finished before a resume; 0: every note."""
    gen = torch.Generator().manual_seed(4)
    inputs = {}
    for n in range(3):
        ids = torch.randint(0, 2000, (90,), generator=gen)
        inputs[f"n{n}"] = (ids, _events(ids, [80, 70, 60], ["P1", "P1", "NULL"], f"n{n}"))
    order = list(inputs)
    cfg = AttributionConfig(top_nominees=2, global_nominees=0, exact_kinds=("P1",), chunk_size=64,
                            selftest_events=2, selftest_notes=1)
    assert selftest_scope(cfg, order, "n0") is cfg
    assert selftest_scope(cfg, order, "n2").selftest_events == 0
    assert selftest_scope(cfg.replace(selftest_notes=0), order, "n2").selftest_events == 2
    runner, hook = Runner(lm, chunk_size=64), HeadHook(lm.geometry)

    def waves(c, done=None):
        return {a.note_id: len(a.selftest) for a in attribute_waves(runner, hook, order, done or {}, inputs.__getitem__,
                                                                    c, lambda means: [], World(), progress=False)}

    assert waves(cfg) == {"n0": 2, "n1": 0, "n2": 0}
    assert waves(cfg.replace(selftest_notes=2, selftest_events=1)) == {"n0": 1, "n1": 1, "n2": 0}
    done = {"n0": {"P1": np.zeros(lm.geometry.n_total_heads)}}
    assert waves(cfg, done) == {"n1": 0, "n2": 0}


def test_knockin_sweep_all_heads_and_gate(lm):
    g = lm.geometry
    runner, hook = Runner(lm, chunk_size=64), HeadHook(g)
    ids_a = torch.randint(0, 2000, (120,), generator=torch.Generator().manual_seed(1))
    ids_b = torch.randint(0, 2000, (140,), generator=torch.Generator().manual_seed(2))
    ev_a = _events(ids_a, [110, 100, 90, 50], ["P1", "P1", "P2", "NULL"], "a")
    ev_b = _events(ids_b, [130, 120, 95, 80], ["P1", "P1", "P2", "P2"], "b")
    rank = {p: list(range(g.n_total_heads)) for p in ("P1", "P2", "P2C")}
    cfg = KnockinConfig(k_bins=(3, 8), chunk_size=64, range_gate=0.0)
    first = knockin_sweep(runner, hook, "a", ids_a, ev_a, cfg, rank, progress=False)
    assert first.knockin == [] and {r["set"] for r in first.necessity} == {"global", "random", "bottom"}
    # necessity of the empty set would be 0; of every set here a finite ratio of the clean margin
    assert all(np.isfinite(r["necessity"]) for r in first.necessity)
    assert first.clean.z.abs().sum() > 0
    second = knockin_sweep(runner, hook, "b", ids_b, ev_b, cfg, rank, previous=first.clean,
                           previous_len=int(ids_a.numel()), progress=False)
    kin = second.knockin
    assert kin and all(r["donor_id"] == "b" and r["note_id"] == "a" for r in kin)
    # NULL events are not knocked in; the three phase events of note a are
    assert {r["event_id"] for r in kin} == {e.event_id for e in ev_a[:3]}
    assert all(np.isfinite(r["recovery"]) == (r["m_all"] - r["m_corr"] >= 0.0) for r in kin)
    # knock-in of all heads equals a's clean margin at every event (the scale of recovery)
    for r in kin:
        assert r["m_all"] == pytest.approx(r["clean_margin"], abs=1e-4)
    rows = per_note_set_rows(first.necessity, kin)
    assert {(r["phase"], r["set"], r["k"]) for r in rows} >= {("P1", "global", 3), ("P2", "random", 8)}


def test_match_donor_event_rules():
    q = Query(position=50, token_id=1, target_id=2, competitor_ids=(3,))
    ev = EventQuery("a:P1:0", "P1", q, target="N", char_index=0)
    donor = [EventQuery("b:P1:0", "P1", Query(10, 1, 2, (3,)), target="N", char_index=0),
             EventQuery("b:P1:1", "P1", Query(80, 1, 2, (3,)), target="E", char_index=0),
             EventQuery("b:P1:2", "P1", Query(40, 1, 2, (3,)), target="I", char_index=0),
             EventQuery("b:P2:3", "P2", Query(45, 1, 2, (3,)), target="E", char_index=1)]
    # same kind, different letter, nearest relative position (50/100 vs 40/100)
    assert match_donor_event(ev, 0.5, donor, 100).event_id == "b:P1:2"
    assert match_donor_event(ev, 0.5, donor[:1], 100) is None


def test_set_variants_random_is_seeded_and_count_matched(lm):
    rank = {"P1": list(range(12))}
    cfg = KnockinConfig(k_bins=(3, 8), sets=("global", "random", "bottom"))
    a = set_variants("P1", "n1", cfg, rank, None, 12)
    b = set_variants("P1", "n1", cfg, rank, None, 12)
    assert a == b and len(a[("random", 8)]) == 8 and a[("bottom", 3)] == [11, 10, 9]
    draws = {tuple(set_variants("P1", f"n{i}", cfg, rank, None, 12)[("random", 3)]) for i in range(10)}
    assert len(draws) > 1  # redrawn per note


def test_variants_of_several_events_share_forwards_exactly(lm):
    """Rows of several events in one forward, each seeing the prefix up to its own event, give
    each event's single-event margins (float32, to summation order), whether they start at layer
    0 or from the clean residual stream, and whatever rows share a batch."""
    from mistill.instrument.patching import EventVariants, clean_read, mean_ablate, run_event_variants
    from mistill.instrument.passes import prefill_note

    g = lm.geometry
    runner, hook = Runner(lm, chunk_size=64), HeadHook(g)
    ids = torch.randint(0, 2000, (150,), generator=torch.Generator().manual_seed(5))
    events = _events(ids, [140, 97, 96, 41], ["P1", "P2", "P1", "NULL"], "m")
    prefix, mean = prefill_note(runner, hook, ids)
    variants = [[[h] for h in range(0, g.n_total_heads, 1 + i)] + [[0, g.n_total_heads - 1], []]
                for i in range(len(events))]
    single, items = [], []
    for ev, vs in zip(events, variants):
        prefix.uncrop()
        prefix.crop(ev.query.position)
        clean = clean_read(runner, hook, prefix, ev.query)
        single.append(mean_ablate(runner, hook, prefix, ev.query, vs, mean, hidden_in=clean.hidden_in))
        items.append(EventVariants(ev.query, vs, clean.hidden_in))
    prefix.uncrop()
    for batch in (5, 64):
        for start_late in (True, False):
            got = run_event_variants(runner, hook, prefix, [it if start_late else EventVariants(it.query, it.variants)
                                                            for it in items], mean, batch_size=batch)
            for a, b in zip(got, single):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    # an empty variant is the clean margin; the ablations move it
    assert abs(float(single[0][-1]) - clean_read(runner, hook, prefix, events[0].query).margin) < 1e-5
    assert float((single[0][:-1] - single[0][-1]).abs().max()) > 1e-4
