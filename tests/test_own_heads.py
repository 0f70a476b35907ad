"""Own-heads readouts (App. K, L.4): M4 and necessity of the own set match plain forwards, the random
floor is count-matched, M2 / M3 / the prefix share follow their definitions on hand-built rows,
and the ``own_heads`` stage runs end to end against a real MLflow server with its linking tags."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from mistill.data.synthetic import make_synthetic_corpus
from mistill.distill.buckets import build_axis, region_buckets, row_buckets, token_buckets
from mistill.errors import MistillInputError
from mistill.evaluation.own_heads import (M5_OUTCOMES, draw_config, m4_rows, m5_summary, note_case, own_knockin,
                                          random_panel, readside_note, subsample_case)
from mistill.instrument.hooks import HeadHook
from mistill.instrument.passes import set_variants
from mistill.instrument.readside import (bucket_rows, chapter_region, head_attention_rows, line_buckets,
                                         note_region_lift, note_share, region_lift, slot_share, token_counts)
from mistill.instrument.runner import Runner
from mistill.models.loading import load_model
import oracle_fixtures as O
from stage_fixtures import TINY, TINY_HEADS, unique


@pytest.fixture(scope="module")
def tiny():
    corpus = make_synthetic_corpus(n_notes=3, seed=0)
    lm = load_model(TINY)
    cases = [subsample_case(note_case(n, corpus.inventory, lm), 3, 0) for n in corpus.notes[:2]]
    rank = {p: np.random.default_rng(7).permutation(lm.geometry.n_total_heads).tolist()
            for p in ("P1", "P2", "P2C")}
    return {"corpus": corpus, "lm": lm, "cases": cases, "rank": rank}


# ------------------------------------------------------------------------------------------ M4
EPS32 = float(np.finfo(np.float32).eps)


def _margin_tol(*margins: float) -> float:
    """How far the instrument's float32 margin may sit from the plain forward's.

    The instrument reads each margin from a single-position forward against the note's cached
    prefix through its own attention kernels (the random floor in the same batches); the
    reference from one Hugging Face forward of the same tokens. Both round every sum differently:
    a margin, a difference of logits, ends within an ulp or so of its size (observed: below
    1 EPS32 x max(1, |m|) over these notes' ~3,000-token contexts). 64 EPS32 x max(1, |m|).
    """
    return 64 * EPS32 * max(1.0, *(abs(m) for m in margins))


def _recovery_tol(m_corr: float, m_all: float, m_set: float) -> float:
    """The margin tolerance carried through ``(m_set - m_corr) / (m_all - m_corr)``: numerator
    and denominator each move by at most twice it, the ratio by that over the range."""
    d = _margin_tol(m_corr, m_all, m_set)
    return d * (2.0 + 2.0 * abs((m_set - m_corr) / (m_all - m_corr))) / abs(m_all - m_corr)


def _necessity_tol(clean: float, ablated: float) -> float:
    """The margin tolerance carried through ``(clean - ablated) / clean``."""
    d = _margin_tol(clean, ablated)
    return d * (1.0 + abs(ablated / clean)) / abs(clean)


def test_own_m4_against_plain_forwards(tiny):
    """M4's knock-in and necessity of the own top-k against an independent reference: plain
    forwards of the notes' tokens with the heads' outputs at the event replaced through
    ``o_proj`` pre-hooks (:mod:`oracle_fixtures`): the clean note's outputs knocked into the
    donor's context before its matched event (the donor event is the one ``own_knockin``
    names; it must be of the same kind with another target), the note's own per-head means for
    necessity. One event per phase keeps the reference's full-length forwards few."""
    lm = tiny["lm"]
    # a different ranking per phase, so that a set taken from another phase's ranking shows
    rank = {p: np.random.default_rng(seed).permutation(lm.geometry.n_total_heads).tolist()
            for seed, p in enumerate(("P1", "P2", "P2C"), start=7)}
    assert len({tuple(r[:3]) for r in rank.values()}) == 3
    target, donor = (subsample_case(c, 1, 0) for c in tiny["cases"])
    runner, hook = Runner(lm), HeadHook(lm.geometry)
    gate = 1e-6
    k_bins = (3, 8)
    nec, kin = own_knockin(runner, hook, target, donor, rank, k_bins, n_random=2, seed=0, range_gate=gate)
    clean_q = {q.event_id: q for q in target.queries}
    donor_q = {q.event_id: q for q in donor.queries}
    ids_t, ids_d = target.inp.input_ids, donor.inp.input_ids
    n_heads = lm.geometry.n_total_heads

    # necessity: the own top-k set to the note's means at each of its own events
    phase_events = [q for q in target.queries if q.kind in rank]
    assert {(r["event_id"], r["k"]) for r in nec} == {(q.event_id, k) for q in phase_events for k in k_bins}
    mean = O.mean_z(lm.model, ids_t)
    nec_ref = {}
    for q in phase_events:
        want = O.reference_necessity(lm.model, ids_t, q.query, {k: rank[q.kind][:k] for k in k_bins}, mean)
        for k in k_bins:
            nec_ref[(q.event_id, k)] = want
    for r in nec:
        want, k = nec_ref[(r["event_id"], r["k"])], r["k"]
        clean_m, ablated = want["clean_margin"], want["ablated_margin"][k]
        assert r["clean_margin"] == pytest.approx(clean_m, abs=_margin_tol(clean_m)), r["event_id"]
        assert r["ablated_margin"] == pytest.approx(ablated, abs=_margin_tol(ablated)), (r["event_id"], k)
        assert abs(clean_m) > 1e-3  # far from the 1e-6 below which no share is taken
        assert r["necessity"] == pytest.approx(want["necessity"][k], abs=_necessity_tol(clean_m, ablated))

    # knock-in: the own set's clean outputs in the donor's context at the matched event
    own = [r for r in kin if r["set"] == "global"]
    assert own and {r["k"] for r in own} == set(k_bins)
    kin_ref = {}
    n_gated = 0
    for eid in sorted({r["event_id"] for r in own}):
        rows = [r for r in own if r["event_id"] == eid]
        ev, match = clean_q[eid], donor_q[rows[0]["donor_event_id"]]
        assert match.kind == ev.kind and match.target != ev.target
        assert {r["donor_event_id"] for r in rows} == {match.event_id} and len(rows) == len(k_bins)
        want = O.reference_knockin(lm.model, ids_t, ev.query, ids_d, match.query.position,
                                   {k: rank[ev.kind][:k] for k in k_bins}, n_heads)
        kin_ref[eid] = want
        assert want["m_all"] == pytest.approx(want["clean_margin"], abs=_margin_tol(want["clean_margin"]))
        rng = want["m_all"] - want["m_corr"]
        assert abs(rng - gate) > 10 * _margin_tol(want["m_all"], want["m_corr"])  # the gate is not in doubt
        for r in rows:
            k = r["k"]
            for m, w in (("m_corr", want["m_corr"]), ("m_all", want["m_all"]), ("m_set", want["m_set"][k])):
                assert r[m] == pytest.approx(w, abs=_margin_tol(w)), (eid, k, m)
            assert r["gated"] == (rng >= gate)
            if r["gated"]:
                n_gated += 1
                assert r["recovery"] == pytest.approx(
                    want["recovery"][k], abs=_recovery_tol(want["m_corr"], want["m_all"], want["m_set"][k])), (eid, k)
            else:
                assert math.isnan(r["recovery"])
    assert n_gated > 0
    # the random floor runs the same events in the same context: same corrupted and all-heads margins
    for r in (r for r in kin if r["set"] == "random"):
        want = kin_ref[r["event_id"]]
        assert r["m_corr"] == pytest.approx(want["m_corr"], abs=_margin_tol(want["m_corr"]))
        assert r["m_all"] == pytest.approx(want["m_all"], abs=_margin_tol(want["m_all"]))

    # the per-note readouts: means of the reference's per-event values
    rows = m4_rows(target.note_id, nec, kin, k_bins)
    for row in rows:
        phase, k = row["phase"], row["k"]
        cell = [eid for eid, w in kin_ref.items() if clean_q[eid].kind == phase and w["m_all"] - w["m_corr"] >= gate]
        if cell:
            vals = [kin_ref[e]["recovery"][k] for e in cell]
            tol = float(np.mean([_recovery_tol(kin_ref[e]["m_corr"], kin_ref[e]["m_all"], kin_ref[e]["m_set"][k])
                                 for e in cell]))
            assert row["recovery_own"] == pytest.approx(float(np.mean(vals)), abs=tol), (phase, k)
        else:
            assert math.isnan(row["recovery_own"])
        events = [q.event_id for q in phase_events if q.kind == phase]
        want_nec = [nec_ref[(e, k)]["necessity"][k] for e in events]
        tol = float(np.mean([_necessity_tol(nec_ref[(e, k)]["clean_margin"], nec_ref[(e, k)]["ablated_margin"][k])
                             for e in events]))
        assert row["necessity_own"] == pytest.approx(float(np.mean(want_nec)), abs=tol), (phase, k)
        assert row["n_random_draws"] == 2


def test_random_floor_sets_are_count_matched_and_redrawn(tiny):
    n = tiny["lm"].geometry.n_total_heads
    rank = tiny["rank"]
    draws = [set_variants("P2C", "note-a", draw_config((3, 8), d, seed=0), rank, None, n) for d in range(4)]
    for d, sets in enumerate(draws):
        for k in (3, 8):
            heads = sets[("random", k)]
            assert len(heads) == k and len(set(heads)) == k and all(0 <= h < n for h in heads)
        assert (("global", 3) in sets) == (d == 0)  # the own set is measured once
    assert len({tuple(s[("random", 3)]) for s in draws}) > 1  # redrawn per draw
    assert draws[1][("random", 3)] == set_variants("P2C", "note-a", draw_config((3, 8), 1, seed=0), rank,
                                                   None, n)[("random", 3)]  # seeded
    assert len(random_panel(n, 4, 0)) == 4 and random_panel(n, 4, 0) == random_panel(n, 4, 0)


# ---------------------------------------------------------------------------------- read side
def test_region_lift_on_hand_built_rows():
    counts = np.array([5, 10, 10, 20, 5], dtype=float)  # buckets; lines 1..3, region = bucket 1
    rows = np.array([[0.5, 0.25, 0.25, 0.0, 0.0],   # half of its line attention on the region
                     [0.2, 0.2, 0.2, 0.4, 0.0],     # line attention in proportion to tokens
                     [1.0, 0.0, 0.0, 0.0, 0.0]])    # nothing on the lines
    lift = region_lift(rows, [1, 2, 3], [1], counts)
    # region holds 10 of 40 line tokens: share 0.5 -> lift 2; share 0.25 -> lift 1
    assert lift[0] == pytest.approx(2.0) and lift[1] == pytest.approx(1.0) and math.isnan(lift[2])
    # per note: median over events per head, then mean over heads
    per_event = np.array([[2.0, 1.0], [4.0, 1.0], [3.0, np.nan]])
    assert note_region_lift(per_event) == pytest.approx((3.0 + 1.0) / 2)
    assert slot_share(np.array([[0.1, 0.3, 0.6]]), [2])[0] == pytest.approx(0.6)
    assert note_share(np.array([[0.2, 0.4], [np.nan, 0.6]])) == pytest.approx(0.4)
    with pytest.raises(MistillInputError):
        region_lift(rows, [1, 2], [3], counts)


def test_shares_and_region_on_a_real_axis(tiny):
    corpus, lm, case = tiny["corpus"], tiny["lm"], tiny["cases"][0]
    prompt, trace, offsets = case.inp.prompt, case.inp.trace, case.inp.offsets
    axis = build_axis(prompt, trace)
    base = token_buckets(axis, prompt, offsets, len(trace))
    p1 = next(r for r in case.realized if r.event.kind == "P1")
    assert chapter_region(axis, p1.event.target) == region_buckets(axis, p1)  # P1: the emitted chapter
    assert set(chapter_region(axis, p1.event.target)) <= set(line_buckets(axis))
    full = next(r for r in note_case(corpus.notes[0], corpus.inventory, lm).realized
                if r.event.kind == "P2C" and r.event.N)
    carved = row_buckets(axis, base, full, prompt, corpus.inventory, offsets)
    n = full.position + 1
    on_n = (carved[:n] == axis.slot("N")).float()
    on_prefix = (carved[:n] == axis.slot("prefix")).float()
    assert on_n.sum() > 0
    attn = torch.stack([on_n / on_n.sum(), 0.5 * on_n / on_n.sum() + 0.5 * on_prefix / max(on_prefix.sum(), 1)])
    rows = bucket_rows(attn, carved, axis.n)
    nm = slot_share(rows, [axis.slot("N")])
    assert nm[0] == pytest.approx(1.0) and slot_share(rows, [axis.slot("prefix")])[0] == pytest.approx(0.0)
    if on_prefix.sum():
        assert nm[1] == pytest.approx(0.5)
    # token counts only up to the query position
    assert token_counts(base, axis.n, upto=10).sum() == 11


def test_attention_rows_and_readside_note(tiny):
    lm, case = tiny["lm"], tiny["cases"][0]
    pos = [r.position for r in case.realized[:2]]
    rows = head_attention_rows(lm, case.inp.input_ids, pos, [0, 5, 7])
    assert rows.shape == (2, 3, case.n_tokens)
    assert torch.allclose(rows.sum(-1), torch.ones(2, 3), atol=1e-5)
    assert float(rows[0, :, pos[0] + 1:].abs().sum()) == 0.0
    rank = tiny["rank"]
    groups = {"own": {p: r[:4] for p, r in rank.items()}, "random": {p: [0, 1, 2, 3] for p in rank}}
    calls = []
    handle = lm.model.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        out = readside_note(lm, case, tiny["corpus"].inventory, groups)
    finally:
        handle.remove()
    assert len(calls) == 1  # both phases' rows come from one forward
    assert out["n_events.P1"] > 0 and out["own.m2.P1"] > 0
    for key in ("own.prefix_share", "random.prefix_share"):
        assert 0.0 <= out[key] <= 1.0
    # each phase read alone (its own forward, only its heads) gives the same values
    for phase in ("P1", "P2C"):
        alone = readside_note(lm, case, tiny["corpus"].inventory,
                              {name: {phase: g[phase]} for name, g in groups.items()})
        keys = [k for k in alone if f".{phase}" in k or (phase == "P2C" and (".m3." in k or "prefix" in k))]
        assert keys
        for k in keys:
            assert alone[k] == pytest.approx(out[k], rel=1e-5, abs=1e-7, nan_ok=True), k


def test_m5_summary_on_hand_built_rows():
    rows = [{"outcome": "window", "distance": 7}, {"outcome": "window", "distance": 23},
            {"outcome": "window", "distance": 1}, {"outcome": "inherited", "distance": 40},
            {"outcome": "code_token", "distance": 0}, {"outcome": "probe_failure", "distance": None},
            {"outcome": "censored", "distance": None}, {"outcome": "probe_failure", "distance": None}]
    got = m5_summary(rows)
    assert got["median_distance"] == 7.0  # of the window-decided mentions only
    assert got["share_window"] == 3 / 8 and got["share_inherited"] == 1 / 8 and got["share_code_token"] == 1 / 8
    assert got["share_probe_failure"] == 2 / 8 and got["share_censored"] == 1 / 8
    # the five outcomes partition the mentions: eighths are exact in binary, so the sum is exactly 1
    assert sum(got[f"share_{o}"] for o in M5_OUTCOMES) == 1.0
    assert got["n_mentions"] == 8.0
    empty = m5_summary([])
    assert math.isnan(empty["median_distance"]) and math.isnan(empty["share_window"]) and empty["n_mentions"] == 0


# ------------------------------------------------------------------------------------ stage
def test_own_heads_stage_end_to_end(tracking_uri, tmp_path, monkeypatch, pinned_code_version):
    from mistill.stages.characterize import AttributeConfig, EventsConfig
    from mistill.stages.distill import TargetsConfig, TrainStageConfig
    from mistill.stages.own_heads import OwnHeadsConfig, run_own_heads
    from mistill.stages.prepare import PrepareConfig
    from mistill.stages.workflow import run_step

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    name = unique("own")
    prep = run_step("prepare", PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=8), name,
                    launch="inline")
    # a trained arm made by the existing stages: teacher ranked on one training note, one step
    ev = run_step("events", EventsConfig(prepare_run=prep, model=TINY, split="train", max_notes=1, n_null=4),
                  name, launch="inline")
    att = run_step("attribute", AttributeConfig(events_run=ev, stability_splits=5), name, launch="inline")
    tg = run_step("targets", TargetsConfig(teacher_attribute_run=att, split="train"), name, launch="inline")
    train = run_step("train", TrainStageConfig(targets_run=tg, student="tiny:qwen3:seed=2", arm="vanilla-bf16",
                                               max_steps=1, grad_accum=1), name, launch="inline")
    cfg = OwnHeadsConfig(prepare_run=prep, train_run=train, k=(2, 4), necessity_k=4, m2_k=4, n_random=2,
                         range_gate=1e-6, events_per_phase=3, max_new_tokens=6, n_null=4, stability_splits=5,
                         max_notes=2, launch="inline")
    run_id = run_own_heads(cfg)
    client = MlflowClient()
    run = client.get_run(run_id)
    tags, metrics = run.data.tags, run.data.metrics
    train_tags = client.get_run(train).data.tags
    assert run.info.status == "FINISHED"
    assert tags["mistill.input.train"] == train and tags["mistill.input.prepare"] == prep
    for key in ("mistill.arm", "mistill.seed", "mistill.precision", "mistill.registered_model",
                "mistill.model_version"):
        assert tags[key] == train_tags[key], key
    assert tags["mistill.model"] == f"run:{train}"
    # the ranking: events + attribute of the arm on the validation notes, findable by run_step
    rank_att = client.get_run(tags["mistill.rank_attribute"])
    assert rank_att.data.tags["mistill.stage"] == "attribute"
    rank_ev = client.get_run(tags["mistill.rank_events"])
    assert rank_ev.data.tags["mistill.model"] == f"run:{train}"
    import json

    assert json.loads(client.download_artifacts(tags["mistill.rank_events"], "config.json", str(tmp_path))
                      and (tmp_path / "config.json").read_text())["config"]["split"] == "val"
    # the output contract
    local = client.download_artifacts(run_id, "own_heads_per_note.csv", str(tmp_path / "dl"))
    import pandas as pd

    table = pd.read_csv(local)
    assert {"note_id", "phase", "k", "recovery_own", "recovery_random", "necessity_own", "traces"} <= set(table)
    assert set(table["traces"]) == {"teacher"} and set(table["k"]) == {2, 4} and table["note_id"].nunique() == 2
    assert any(k.startswith("m4/P") and k.endswith("/recovery_own") for k in metrics)
    assert any(k.startswith("m4/P") and k.endswith("/recovery_random") for k in metrics)
    assert {"m2/region_lift", "prefix_share", "n_notes"} <= set(metrics)
    # M5: the forcing probe on the arm's own model at every chapter mention of the test notes
    m5 = {f"m5/share_{o}" for o in M5_OUTCOMES} | {"m5/n_mentions"}
    assert m5 <= set(metrics)
    assert metrics["m5/n_mentions"] > 0
    # every mention receives exactly one of the five outcomes, so the shares sum to 1: five
    # quotients count/n, each within half an ulp (2^-53 relative), and four additions, so well
    # within 1e-12
    assert sum(metrics[f"m5/share_{o}"] for o in M5_OUTCOMES) == pytest.approx(1.0, rel=0, abs=1e-12)
    assert metrics["own/coverage/n_generated"] == 2 and metrics["own/coverage/n_with_events"] == 0
    assert metrics["own/coverage/n_closed"] <= 2
    # a second identical call reuses the finished run
    assert run_own_heads(cfg) == run_id
    # the k = 8 probe (App. I): a head from outside the own top-4 moved to rank 3 of one phase's
    # ranking, nothing else changed; the ranking runs are reused
    sets = json.loads(Path(client.download_artifacts(run_id, "own_heads_sets.json", str(tmp_path / "s0"))).read_text())
    phase = next(p for p in ("P2C", "P1", "P2") if p in sets)
    outside = next(n for n in (f"L{i // 4}H{i % 4}" for i in range(TINY_HEADS)) if n not in sets[phase])
    probe_cfg = cfg.replace(probe_head=outside, probe_phase=phase, probe_rank=3, own_traces=False)
    probe_run = run_own_heads(probe_cfg)
    assert probe_run != run_id
    probe_tags = client.get_run(probe_run).data.tags
    assert probe_tags["mistill.rank_attribute"] == tags["mistill.rank_attribute"]
    probed = json.loads(Path(client.download_artifacts(probe_run, "own_heads_sets.json",
                                                       str(tmp_path / "s1"))).read_text())
    assert probed["probe"] == {"head": outside, "phase": phase, "rank": 3, "own_rank": probed["probe"]["own_rank"]}
    assert probed["probe"]["own_rank"] > 4
    assert probed[phase] == sets[phase][:2] + [outside] + sets[phase][2:3]
    assert all(probed[p] == sets[p] for p in sets if p in ("P1", "P2", "P2C") and p != phase)
    # per-event knock-in rows (Table 24's input): the own set's recovery at each event, draw 0;
    # their mean per note, phase and k is the note's recovery_own
    events = pd.read_csv(client.download_artifacts(run_id, "own_heads_knockin_events.csv", str(tmp_path / "dl2")),
                         dtype={"note_id": str})
    assert {"note_id", "traces", "event_id", "phase", "k", "recovery", "gated"} <= set(events) and len(events)
    by_note = pd.read_csv(local, dtype={"note_id": str}).set_index(["note_id", "phase", "k"])["recovery_own"]
    for key, value in events.dropna(subset=["recovery"]).groupby(["note_id", "phase", "k"])["recovery"].mean().items():
        assert by_note[key] == pytest.approx(value), key

    # App. E on the trained arm: its own ranking's attribute run feeds the read side and the edits
    from mistill.stages.edits import TraceEditConfig, run_trace_edit
    from mistill.stages.readside import ReadSideConfig, run_read_side

    rank = tags["mistill.rank_attribute"]
    for stage_run in (run_read_side(ReadSideConfig(attribute_run=rank, panel_top=2, panel_bottom=0, panel_random=2)),
                      run_trace_edit(TraceEditConfig(attribute_run=rank, max_events=2))):
        got = client.get_run(stage_run)
        assert got.info.status == "FINISHED" and got.data.tags["mistill.model"] == f"run:{train}"
        assert got.data.tags["mistill.arm"] == train_tags["mistill.arm"]  # pairs with the arm's other runs
        assert got.data.tags["mistill.seed"] == train_tags["mistill.seed"]

    # Table 24: the arm's M1 and knock-in recovery on audited contrastive events
    from mistill.stages.evaluate import EvaluateConfig, run_evaluate
    from mistill.stages.report import ReportConfig, run_report

    evaluated = run_evaluate(EvaluateConfig(prepare_run=prep, train_run=train, split="val", max_notes=2,
                                            max_new_tokens=6))
    m1 = pd.read_csv(client.download_artifacts(evaluated, "m1_events.csv", str(tmp_path / "m1")),
                     dtype={"note_id": str})
    p2c = m1[m1["kind"] == "P2C"].reset_index(drop=True)
    assert len(p2c) >= 2
    labels = p2c[["note_id", "event_id"]].assign(
        label=["verified_rejection" if i % 2 == 0 else "enumeration" for i in range(len(p2c))])
    labels.to_csv(tmp_path / "audit.csv", index=False)
    report = run_report(ReportConfig(corpus=name, split="val", audit_labels=str(tmp_path / "audit.csv")))
    t24 = pd.read_csv(client.download_artifacts(report, "tables/table24_audited_events.csv", str(tmp_path / "t24")))
    rows = t24[t24["arm"] == "vanilla-bf16"].set_index("stratum")
    verified = p2c.iloc[::2]["margin"]
    assert rows.loc["verified rejection", "m1_n"] == len(verified)
    assert rows.loc["verified rejection", "m1_p_pos"] == pytest.approx(float((verified > 0).mean()))
    assert rows.loc["other labeled", "m1_n"] == len(p2c) - len(verified)
    text = open(client.download_artifacts(report, "report.md", str(tmp_path / "md"))).read()
    assert "Table 22:" in text and "Table 24:" in text
