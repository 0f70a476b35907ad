"""The instrument and the pipeline follow the paper's stated procedures, and the rules the paper
leaves open are the documented ones: the knock-in donor is the next note in corpus order at a
matched event with a different emitted choice (Sec. 2.3), the last note's donor wraps to the
first, an event the next note cannot match goes to the first later note that can; P2 and P2C
nominees are patched exactly with the paper's counts (App. C, D); the teacher is ranked on the
validation notes (Sec. 4.2); the M4 floor is one random draw per bin (App. K); the LAS simulator
reads the whole note (App. K)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from mistill.instrument.hooks import HeadHook
from mistill.instrument.passes import (AttributionConfig, DonorCandidate, DonorWork, EventQuery,
                                       KnockinConfig, attribute_note, donor_order, knockin_sweep,
                                       match_donor_event, per_note_set_rows, plan_donors, trace_fraction)
from mistill.instrument.patching import Query
from mistill.instrument.runner import Runner
from mistill.models.loading import tiny_model


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen3", layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=5)


def _ev(note: str, i: int, kind: str, position: int, target: str, char_index: int | None = 0,
        token_id: int = 7) -> EventQuery:
    letters = list(range(300, 306))
    t = letters[i % len(letters)]
    return EventQuery(event_id=f"{note}:{kind}:{i}", kind=kind, target=target, char_index=char_index,
                      query=Query(position=position, token_id=token_id, target_id=t,
                                  competitor_ids=tuple(x for x in letters if x != t)))


# ------------------------------------------------------------------------------- the donor
def test_donor_is_the_next_note_in_corpus_order_and_the_last_note_wraps():
    assert donor_order(4, 0) == [1, 2, 3]
    assert donor_order(4, 1)[0] == 2 and donor_order(4, 2)[0] == 3
    # the last note's next note is the first (the paper knocks in on every one of its notes)
    assert donor_order(4, 3) == [0, 1, 2]
    assert donor_order(4, 3, wrap=False) == [] and donor_order(4, 1, wrap=False) == [2, 3]
    assert all(i not in donor_order(5, i) for i in range(5))  # never its own donor
    assert donor_order(1, 0) == []


def test_an_event_the_next_note_cannot_match_goes_to_the_first_later_note_that_can():
    clean = [_ev("a", 0, "P1", 60, "N"), _ev("a", 1, "P2C", 80, "9", 4), _ev("a", 2, "NULL", 70, "Q")]
    nxt = DonorCandidate("b", [_ev("b", 0, "P1", 50, "E"), _ev("b", 1, "P2C", 90, "9", 4)], 100)  # same choice
    later = DonorCandidate("c", [_ev("c", 0, "P2C", 40, "1", 4)], 100)
    last = DonorCandidate("d", [_ev("d", 0, "P2C", 30, "2", 4)], 100)
    plan = plan_donors(clean, 100, 0, [nxt, later, last], no_match="next")
    assert [(c.note_id, [(i, m.event_id) for i, m in ms]) for c, ms in plan] == [
        ("b", [(0, "b:P1:0")]), ("c", [(1, "c:P2C:0")])]  # NULL is never knocked in
    dropped = plan_donors(clean, 100, 0, [nxt, later, last], no_match="drop")
    assert [(c.note_id, [i for i, _ in ms]) for c, ms in dropped] == [("b", [0])]
    # candidates are read only as far as needed
    seen = []

    def lazy():
        for c in (nxt, later, last):
            seen.append(c.note_id)
            yield c

    plan_donors(clean, 100, 0, lazy(), no_match="next")
    assert seen == ["b", "c"]
    with pytest.raises(ValueError, match="no_match"):
        plan_donors(clean, 100, 0, [nxt], no_match="skip")


def test_matched_event_is_nearest_in_the_trace_not_in_the_whole_input():
    """Clean note: a 1000-token prompt, its trace [1000, 1100), the event half-way (1050). Donor:
    a 400-token prompt, its trace [400, 656). Half-way through the donor's trace is 528; the
    nearest fraction of the whole input (1050/1100 = 0.955 -> 626 of 656) is the late event.
    Fractions here are multiples of 1/256, exact in float."""
    ev = _ev("a", 0, "P1", 1050, "N")
    donor = [_ev("b", 0, "P1", 528, "E"), _ev("b", 1, "P1", 600, "I")]
    rel = trace_fraction(1050, 1100, 1000)
    assert rel == 0.5
    assert match_donor_event(ev, rel, donor, 656, 400).event_id == "b:P1:0"
    # the same character index wins over a nearer event of another index
    p2 = _ev("a", 1, "P2", 1050, "8", 3)
    donor2 = [_ev("b", 2, "P2", 530, "1", 2), _ev("b", 3, "P2", 600, "2", 3), _ev("b", 4, "P2", 440, "3", 3)]
    assert match_donor_event(p2, rel, donor2, 656, 400).event_id == "b:P2:3"
    # the same emitted choice is never matched; equal distances go to the lower position
    tie = [_ev("b", 5, "P1", 528, "N"), _ev("b", 6, "P1", 560, "E"), _ev("b", 7, "P1", 496, "I")]
    assert match_donor_event(ev, rel, tie, 656, 400).event_id == "b:P1:7"


def test_donor_steps_sweep_each_donor_after_its_clean_note():
    from mistill.stages.characterize import donor_steps

    assert donor_steps(3, {0: [1], 1: [2], 2: [0]}) == {1: [(0, 1)], 2: [(1, 2)], 3: [(2, 0)]}
    # note 0's unmatched events skip to note 2; note 2's wrap to notes 0 and 1
    assert donor_steps(3, {0: [1, 2], 2: [0, 1]}) == {1: [(0, 1)], 2: [(0, 2)], 3: [(2, 0)], 4: [(2, 1)]}


def test_one_donor_sweep_serves_several_clean_notes(lm):
    """A donor prefilled once runs the matched events of two clean notes; knocking in every
    head returns each clean margin (the scale of recovery)."""
    g = lm.geometry
    runner, hook = Runner(lm, chunk_size=64), HeadHook(g)
    gen = torch.Generator().manual_seed(3)
    ids = {n: torch.randint(0, 2000, (length,), generator=gen) for n, length in (("a", 90), ("b", 100), ("c", 120))}
    evs = {"a": [_ev("a", 0, "P1", 80, "N", token_id=int(ids["a"][80])),
                 _ev("a", 1, "P2C", 85, "9", 4, token_id=int(ids["a"][85]))],
           "b": [_ev("b", 0, "P1", 70, "E", token_id=int(ids["b"][70]))],
           "c": [_ev("c", 0, "P1", 100, "I", token_id=int(ids["c"][100])),
                 _ev("c", 1, "P2C", 110, "1", 4, token_id=int(ids["c"][110]))]}
    rank = {p: list(range(g.n_total_heads)) for p in ("P1", "P2", "P2C")}
    cfg = KnockinConfig(k_bins=(3,), sets=("global", "random"), chunk_size=64, range_gate=0.0)
    cleans = {n: knockin_sweep(runner, hook, n, ids[n], evs[n], cfg, rank, progress=False).clean for n in ("a", "b")}
    cands = {n: DonorCandidate(n, evs[n], int(ids[n].numel())) for n in evs}
    plan_a = dict((c.note_id, m) for c, m in plan_donors(evs["a"], 90, 0, [cands["b"], cands["c"]]))
    plan_b = dict((c.note_id, m) for c, m in plan_donors(evs["b"], 100, 0, [cands["c"], cands["a"]]))
    assert [i for i, _ in plan_a["b"]] == [0] and [i for i, _ in plan_a["c"]] == [1] and list(plan_b) == ["c"]
    sweep = knockin_sweep(runner, hook, "c", ids["c"], [], cfg, rank, progress=False,
                          work=[DonorWork(cleans["a"], plan_a["c"]), DonorWork(cleans["b"], plan_b["c"])])
    assert sweep.necessity == []
    assert {(r["note_id"], r["event_id"], r["donor_event_id"]) for r in sweep.knockin} == {
        ("a", "a:P2C:1", "c:P2C:1"), ("b", "b:P1:0", "c:P1:0")}
    for r in sweep.knockin:
        clean = cleans[r["note_id"]]
        want = float(clean.margins[[e.event_id for e in clean.events].index(r["event_id"])])
        # every head knocked in reproduces the clean forward up to float32 summation order
        assert r["m_all"] == pytest.approx(want, abs=1e-4 * max(1.0, abs(want))) and r["donor_id"] == "c"


def test_a_note_without_knock_in_still_has_set_rows():
    nec = [{"note_id": "a", "phase": "P1", "set": "global", "k": 3, "necessity": 0.5}]
    rows = per_note_set_rows(nec, [])
    assert len(rows) == 1 and math.isnan(rows[0]["recovery"]) and rows[0]["n_gated"] == 0


# --------------------------------------------------------------------- exact P2 / P2C nominees
def test_attribute_defaults_patch_p2_and_p2c_with_the_papers_nominees():
    from mistill.stages.characterize import AttributeConfig, _attribution_config
    from mistill.stages.workflow import CharacterizeConfig, PipelineConfig

    cfg = AttributeConfig()
    assert cfg.exact_p2 and (cfg.top_nominees, cfg.global_nominees) == (40, 16)
    assert (cfg.p2_top_nominees, cfg.p2_global_nominees) == (24, 8)  # App. C, the intact-hook re-run
    assert (cfg.p2c_top_nominees, cfg.p2c_global_nominees) == (40, 16)  # App. D, the exact refinement
    acfg = _attribution_config(cfg)
    assert set(acfg.exact_kinds) == {"P1", "NULL", "P2", "P2C"}
    assert [acfg.nominee_counts(k) for k in ("P1", "NULL", "P2", "P2C")] == [(40, 16), (40, 16), (24, 8), (40, 16)]
    assert set(_attribution_config(cfg.replace(exact_p2=False)).exact_kinds) == {"P1", "NULL"}
    assert CharacterizeConfig().attribute_config().exact_p2
    assert PipelineConfig().characterize_config().attribute_config().exact_p2


def test_exact_patches_follow_each_kinds_nominee_counts(lm):
    g = lm.geometry
    ids = torch.randint(0, 2000, (150,), generator=torch.Generator().manual_seed(4))
    kinds = ["P1", "P2", "P2C", "NULL", "NULL"]
    events = [_ev("n", i, k, p, str(i), token_id=int(ids[p])) for i, (k, p) in
              enumerate(zip(kinds, [140, 130, 120, 100, 90]))]
    cfg = AttributionConfig(top_nominees=5, global_nominees=2, p2_top_nominees=3, p2_global_nominees=1,
                            p2c_top_nominees=4, p2c_global_nominees=3, null_exact_fraction=1.0, chunk_size=64)
    running = {"P1": [11, 10, 9], "NULL": [11, 10, 9], "P2": [11, 10, 9], "P2C": [11, 10, 9]}
    att = attribute_note(Runner(lm, chunk_size=64), HeadHook(g), "n", ids, events, cfg, running, progress=False)
    for i, (top, n_global) in enumerate([(5, 2), (3, 1), (4, 3), (5, 2), (5, 2)]):
        measured = set(np.flatnonzero(~np.isnan(att.exact[i])).tolist())
        fo = torch.from_numpy(att.first_order[i])
        top_heads = torch.sort(fo.abs(), descending=True, stable=True).indices[:top].tolist()
        want = set(top_heads) | set([11, 10, 9][:n_global])
        assert measured == want, kinds[i]


def test_running_global_is_the_chapter_ranking_unless_asked_per_phase():
    from mistill.stages.characterize import AttributeConfig, running_globals

    means = {"P1": [np.array([0.0, 3.0, 1.0, 2.0])], "P2": [np.array([5.0, 0.0, 0.0, 1.0])], "P2C": []}
    cfg = AttributeConfig(global_nominees=2, p2_global_nominees=1, p2c_global_nominees=1)
    assert running_globals(means, cfg) == {k: [1, 3] for k in ("P1", "NULL", "P2", "P2C")}
    per_phase = running_globals(means, cfg.replace(phase_running_global=True))
    assert per_phase["P2"] == [0, 3] and per_phase["P2C"] == [] and per_phase["P1"] == [1, 3]


# ------------------------------------------------------------- teacher split, floors, LAS cap
def test_pipeline_ranks_the_teacher_on_the_validation_notes_by_default():
    from mistill.stages.workflow import PipelineConfig

    cfg = PipelineConfig()
    assert cfg.teacher_split == "val"
    ch = cfg.characterize_config("0" * 32)
    assert ch.rank_split == "val" and ch.attribute_config().split == "val"
    assert ch.events_config().split == ""  # the targets read the training notes' events


def test_m4_floor_is_one_draw_per_bin_and_las_reads_whole_notes():
    from mistill.stages.las import LasSimulatorConfig
    from mistill.stages.own_heads import OwnHeadsConfig
    from mistill.stages.workflow import PipelineConfig

    assert OwnHeadsConfig().n_random == 1
    assert OwnHeadsConfig().donor_wrap and OwnHeadsConfig().donor_no_match == "next"
    assert LasSimulatorConfig().max_note_words == 0
    assert PipelineConfig().las_max_note_words == 128  # the CPU demo's cap, passed by the pipeline


def test_own_knockin_skips_to_the_next_note_that_matches():
    """M4 uses the instrument's donor rules: the next note's events match where they can, an
    event it cannot match is knocked into the following note."""
    from mistill.data.synthetic import make_synthetic_corpus
    from mistill.evaluation.own_heads import NoteCase, m4_rows, note_case, own_knockin
    from mistill.models.loading import load_model
    from stage_fixtures import TINY

    corpus = make_synthetic_corpus(n_notes=3, seed=0)
    lm_ = load_model(TINY)
    target, nxt, later = (note_case(n, corpus.inventory, lm_) for n in corpus.notes)
    p1 = [q for q in target.queries if q.kind == "P1"][:2]
    p2 = [q for q in target.queries if q.kind == "P2"][:2]
    target = NoteCase(target.note_id, target.inp, target.realized, p1 + p2)
    nxt = NoteCase(nxt.note_id, nxt.inp, nxt.realized, [q for q in nxt.queries if q.kind != "P2"])  # no P2
    rank = {p: list(range(lm_.geometry.n_total_heads)) for p in ("P1", "P2", "P2C")}
    runner, hook = Runner(lm_), HeadHook(lm_.geometry)
    _, kin = own_knockin(runner, hook, target, [nxt, later], rank, (2,), seed=0, range_gate=0.0)
    donors = {(r["event_id"], r["donor_id"]) for r in kin}
    assert donors == {(q.event_id, nxt.note_id) for q in p1} | {(q.event_id, later.note_id) for q in p2}
    assert {r["draw"] for r in kin} == {0}  # one random draw per bin by default
    _, dropped = own_knockin(runner, hook, target, [nxt, later], rank, (2,), seed=0, range_gate=0.0,
                             no_match="drop")
    assert {r["donor_id"] for r in dropped} == {nxt.note_id} and not any(r["phase"] == "P2" for r in dropped)
    rows = m4_rows(target.note_id, [], kin, (2,))
    assert {r["phase"] for r in rows} == {"P1", "P2"} and all(r["n_random_draws"] == 1 for r in rows)


# -------------------------------------------------------------------------------- the stages
def test_characterization_ranks_and_knocks_in_on_the_rank_split(tracking_uri, tmp_path, monkeypatch,
                                                                pinned_code_version):
    """The attribute run ranks only the validation notes and says so in its params; the knock-in
    runs on those notes, each into the next one, the last into the first."""
    from mistill.stages.workflow import CharacterizeConfig, characterize_steps, run_step
    from mistill.stages.prepare import PrepareConfig
    from stage_fixtures import TINY, unique

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    name = unique("fid")
    prep = run_step("prepare", PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=8), name, launch="inline")
    cfg = CharacterizeConfig(prepare_run=prep, model=TINY, rank_split="val", n_null=4, k_bins=(2,),
                             range_gate=0.0, events_per_phase=2, stability_splits=5, launch="inline")
    ids = characterize_steps(cfg, name)
    client = MlflowClient()
    params = client.get_run(ids["attribute"]).data.params
    assert params["split"] == "val" and params["exact_p2"].lower() == "true"
    assert client.get_run(ids["events"]).data.params["split"] == ""
    from mistill.stages.common import load_prepared

    notes = load_prepared(prep).corpus.notes
    val = [n.note_id for n in notes if n.split == "val"]
    assert len(val) == 2 and len(notes) == 8
    arts = {f.path for f in client.list_artifacts(ids["attribute"], "notes")}
    assert arts == {f"notes/{n}" for n in val}
    assert client.get_run(ids["attribute"]).data.metrics["calib/P1/n_notes"] == 2
    donors = {}
    for i, note in enumerate(val):
        path = client.download_artifacts(ids["knockin"], f"notes/{note}/knockin.jsonl", str(tmp_path / f"k{i}"))
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        assert rows and {r["note_id"] for r in rows} == {note}
        donors[note] = {r["donor_id"] for r in rows}
    assert donors == {val[0]: {val[1]}, val[1]: {val[0]}}  # the next note; the last wraps to the first
