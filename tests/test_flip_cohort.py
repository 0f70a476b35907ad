"""The evidence-flip cohort (App. N.2, R-D35): the proposals' checks, the ledger, the freeze and
its re-verification, and the ``flip_cohort`` stage end to end on synthetic and restricted corpora."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mistill.data import flips
from mistill.data.corpus import Corpus
from mistill.data.synthetic import make_synthetic_corpus
from mistill.errors import MistillInputError
from mistill.models.loading import EMBEDDED_DEFAULT, load_tokenizer
from mistill.stages.common import load_prepared
from mistill.stages.flip_cohort import FlipCohortConfig, run_flip_cohort
from mistill.stages.prepare import PrepareConfig, run_prepare
from stage_fixtures import TINY, artifact_paths, leaks, phrase_needles, tracked_texts, unique

SECRET = "violet stapler hummed softly near eleven quiet dunes"
EDIT_SECRET = "amber kettle whistled beside nine drowsy copper owls"
LOCK = """study: ef-test
draw: {{n: {n}, seed: 0}}
eligibility: {{teacher_success: true}}
disjoint: true
review: {{budget: {budget}, reason_codes: [no_coherent_flip, pair, evidence]}}
conditions: [original, flipped, irrelevant, order]
"""


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_DEFAULT)


@pytest.fixture(scope="module")
def synthetic():
    corpus = make_synthetic_corpus(n_notes=6, seed=0, n_codes_range=(3, 4), inventory_size=60)
    return corpus, flips.draw_cohort(corpus.notes, [], 5, 0)


@pytest.fixture(scope="module")
def records(synthetic, tokenizer):
    corpus, drawn = synthetic
    return flips.synthetic_flip_proposals(drawn, corpus.inventory, tokenizer, seed=0)


def _lock(path: Path, n: int = 5, budget: int = 4) -> flips.CohortLock:
    path.write_text(LOCK.format(n=n, budget=budget))
    return flips.load_cohort_lock(path)


def _check(tmp_path, synthetic, tokenizer, rows):
    corpus, drawn = synthetic
    path = flips.write_proposals(tmp_path / "proposals.jsonl", rows)
    return flips.check_proposals(flips.read_proposals(path), drawn, corpus.inventory, tokenizer, file=str(path))


def _refused(tmp_path, synthetic, tokenizer, rows, case: str, field: str) -> MistillInputError:
    with pytest.raises(MistillInputError) as err:
        _check(tmp_path, synthetic, tokenizer, rows)
    assert (err.value.file, err.value.note, err.value.field) == (str(tmp_path / "proposals.jsonl"), case, field), \
        str(err.value)
    return err.value


def test_the_draw_is_seeded_disjoint_and_one_note_per_patient(synthetic):
    corpus, drawn = synthetic
    again = flips.draw_cohort(corpus.notes, [], 5, 0)
    assert [n.note_id for n in drawn] == [n.note_id for n in again]
    assert len({n.patient_id for n in drawn}) == 5
    excluded = {drawn[0].patient_id}
    assert drawn[0].patient_id not in {n.patient_id for n in flips.draw_cohort(corpus.notes, excluded, 5, 0)}
    assert [n.note_id for n in flips.draw_cohort(corpus.notes, [], 5, 1)] != [n.note_id for n in drawn]


def test_synthetic_proposals_pass_every_check(tmp_path, synthetic, tokenizer, records):
    assert len(records) >= 4
    checked = _check(tmp_path, synthetic, tokenizer, records)
    for case in checked:
        assert case.mask_tokens["original"][0] == case.mask_tokens["original"][1] > 0
        assert case.edit_words["irrelevant"] == case.edit_words["flipped"] > 0
        assert case.texts["flipped"] != case.texts["original"] == case.note.text
        assert case.gold["flipped"] == tuple(case.proposal.partner_code if c == case.proposal.target_code else c
                                             for c in case.note.gold_codes)


def test_each_failed_check_names_the_file_the_case_and_the_field(tmp_path, synthetic, tokenizer, records):
    rows = copy.deepcopy(records[:2])
    case = rows[1]["case_id"]

    def variant(edit) -> list[dict]:
        out = copy.deepcopy(rows)
        edit(out[1])
        return out

    flip = rows[1]["versions"]["flipped"]
    _refused(tmp_path, synthetic, tokenizer, variant(lambda r: r["versions"]["original"]["edits"].append(
        {"start": 0, "end": 0, "text": "x "})), case, "versions.original.edits")
    # the sham one token short of the target
    s, e = flip["sham_mask"][0]
    offsets = flips.token_offsets(tokenizer, flips.apply_edits(
        synthetic[1][[n.note_id for n in synthetic[1]].index(rows[1]["note_id"])].text,
        [flips.Edit(**x) for x in flip["edits"]])[0])
    shorter = max(b for a, b in offsets if b < e)
    err = _refused(tmp_path, synthetic, tokenizer, variant(
        lambda r: r["versions"]["flipped"].update(sham_mask=[[s, shorter]])), case, "versions.flipped.sham_mask")
    assert "not token-matched" in str(err)
    # declared, the mismatch is kept as a recorded fact (the paper's one case)
    declared = variant(lambda r: (r["versions"]["flipped"].update(sham_mask=[[s, shorter]]),
                                  r.update(exceptions=["mask_length"])))
    kept = _check(tmp_path, synthetic, tokenizer, declared)[1]
    assert any(f.startswith("mask_length_flipped:") for f in kept.facts)
    _refused(tmp_path, synthetic, tokenizer, variant(lambda r: r["versions"]["irrelevant"]["edits"][0].update(
        text="Two words. ")), case, "versions.irrelevant.edits")
    evidence = rows[1]["versions"]["original"]["target_mask"][0]
    _refused(tmp_path, synthetic, tokenizer, variant(lambda r: r["versions"]["irrelevant"]["edits"][0].update(
        start=evidence[0] + 1, end=evidence[0] + 1)), case, "versions.irrelevant.edits")
    _refused(tmp_path, synthetic, tokenizer, variant(lambda r: r["versions"]["order"]["edits"][0].update(
        text=r["versions"]["order"]["edits"][0]["text"] + " extra")), case, "versions.order.edits")
    _refused(tmp_path, synthetic, tokenizer, variant(lambda r: r.update(target_code=r["partner_code"])), case,
             "target_code")
    _refused(tmp_path, synthetic, tokenizer, variant(lambda r: r["versions"]["flipped"].update(edits=[])), case,
             "versions.flipped.edits")
    _refused(tmp_path, synthetic, tokenizer, variant(lambda r: r["versions"].pop("order")), case, "versions")
    _refused(tmp_path, synthetic, tokenizer, variant(lambda r: r.update(note_id=rows[0]["note_id"])), case,
             "note_id")


def test_the_ledger_is_checked_against_the_proposals(tmp_path, records):
    lock = _lock(tmp_path / "lock.yaml", budget=3)
    proposals = flips.read_proposals(flips.write_proposals(tmp_path / "p.jsonl", records))
    good = flips.all_accept_ledger(records, 3)
    assert [d.case_id for d in flips.read_ledger(flips.write_ledger(tmp_path / "l.csv", good), proposals, lock)] == \
        [r["case_id"] for r in records[:3]]
    cases = {
        "beyond": (good + [flips.Decision(records[3]["case_id"], "accept", "", "me", "2026-01-01T00:00:00")],
                   "case_id"),
        "reason": ([good[0], flips.Decision(good[1].case_id, "exclude", "dislike", "me", "2026-01-01"), good[2]],
                   "reason_code"),
        "missing": (good[:2], "case_id"),
        "time": ([good[0], good[1], flips.Decision(good[2].case_id, "accept", "", "me", "yesterday")], "timestamp"),
    }
    for name, (decisions, field) in cases.items():
        path = flips.write_ledger(tmp_path / f"{name}.csv", decisions)
        with pytest.raises(MistillInputError) as err:
            flips.read_ledger(path, proposals, lock)
        assert err.value.file == str(path) and err.value.field == field, (name, str(err.value))


def test_a_frozen_cohort_is_reverified_and_a_changed_case_refused(tmp_path, synthetic, tokenizer, records):
    corpus, drawn = synthetic
    lock = _lock(tmp_path / "lock.yaml", budget=3)

    def record_of(rows):
        path = flips.write_proposals(tmp_path / "p.jsonl", rows)
        proposals = flips.read_proposals(path)
        checked = flips.check_proposals(proposals, drawn, corpus.inventory, tokenizer, file=str(path))
        decisions = flips.read_ledger(ledger, proposals, lock)
        accepted = [c for c in checked if c.case_id in {d.case_id for d in decisions if d.decision == "accept"}]
        return flips.frozen_record(lock, flips.sha256_file(ledger), proposals, decisions, accepted, corpus.digest)

    ledger = flips.write_ledger(tmp_path / "l.csv", flips.all_accept_ledger(records, 3))
    frozen = flips.write_frozen(tmp_path / "FROZEN", record_of(records))
    flips.verify_frozen(frozen, record_of(records))  # unchanged: verified
    assert len(json.loads(frozen.read_text())["cases"]) == 3
    changed = copy.deepcopy(records)
    edit = changed[1]["versions"]["irrelevant"]["edits"][0]
    edit["text"] = edit["text"].replace("visitor", "visitors")
    with pytest.raises(MistillInputError) as err:
        flips.verify_frozen(frozen, record_of(changed))
    assert (err.value.file, err.value.note) == (str(frozen), changed[1]["case_id"])
    assert err.value.field in ("reviewed.proposal_sha256", "versions.irrelevant")
    ledger.write_text(ledger.read_text().replace("synthetic", "another"))
    with pytest.raises(MistillInputError) as err:
        flips.verify_frozen(frozen, record_of(records))
    assert err.value.field == "ledger_sha256"


# ---------------------------------------------------------------------------------- the stage
pytestmark = pytest.mark.usefixtures("pinned_code_version")


def test_flip_cohort_end_to_end_on_a_synthetic_corpus(tracking_uri, tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    name = unique("flip")
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=8, codes_per_note=(3, 4),
                                     inventory_size=60, model=TINY))
    exclude = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("flip-train"), n_notes=2,
                                        codes_per_note=(3, 4), inventory_size=60, model=TINY))
    lock = tmp_path / "lock.yaml"
    _lock(lock, n=5, budget=4)
    with pytest.raises(MistillInputError) as err:  # the lock wants the training corpora excluded
        run_flip_cohort(FlipCohortConfig(prepare_run=prep, lock=str(lock)))
    assert err.value.field == "exclude_prepare_runs"
    # the draw alone: what the author writes proposals for
    draw_run = run_flip_cohort(FlipCohortConfig(prepare_run=prep, exclude_prepare_runs=(exclude,), lock=str(lock)))
    client = MlflowClient()
    assert client.get_run(draw_run).data.metrics["n_drawn"] == 5
    prepared = load_prepared(prep)
    excluded = {n.patient_id for n in load_prepared(exclude).corpus.notes}
    drawn = flips.draw_cohort(prepared.corpus.notes, excluded, 5, 0)
    assert not excluded & {n.patient_id for n in drawn}
    records = flips.synthetic_flip_proposals(drawn, prepared.inventory, tokenizer, seed=0)
    proposals = flips.write_proposals(tmp_path / "authored" / "proposals.jsonl", records)
    decisions = flips.all_accept_ledger(records, 4)
    decisions[1] = flips.Decision(decisions[1].case_id, "exclude", "no_coherent_flip", "author",
                                  "2026-01-02T10:00:00")
    ledger = flips.write_ledger(tmp_path / "authored" / "ledger.csv", decisions)
    cfg = FlipCohortConfig(prepare_run=prep, exclude_prepare_runs=(exclude,), lock=str(lock),
                           proposals=str(proposals), ledger=str(ledger))
    run_id = run_flip_cohort(cfg)
    run = client.get_run(run_id)
    m = run.data.metrics
    assert (m["n_drawn"], m["n_proposals"], m["n_reviewed"], m["n_accepted"], m["n_excluded"]) == \
        (5, len(records), 4, 3, 1)
    assert m["n_not_reached"] == len(records) - 4 and m["n_excluded/no_coherent_flip"] == 1
    assert run.data.params["lock_sha256"] == flips.sha256_file(lock) == run.data.tags["mistill.flip_cohort.lock_sha256"]
    frozen = tmp_path / "authored" / "FROZEN"
    assert frozen.is_file() and run.data.tags["mistill.flip_cohort.frozen_sha256"] == flips.sha256_file(frozen)
    assert {"cohort_accounting.json", "frozen/FROZEN", "cohort_draw.csv", "cohort_cases.csv"} <= \
        artifact_paths(client, run_id)
    corpora = {}
    for cond in flips.CONDITIONS:
        child = run.data.tags[f"mistill.flip_cohort.run.{cond}"]
        assert client.get_run(child).data.tags["mlflow.parentRunId"] == run_id
        corpora[cond] = load_prepared(child).corpus
    accepted = [d.case_id for d in decisions if d.decision == "accept"]
    assert [n.meta["flip_case"] for n in corpora["flipped"].notes] == accepted
    source = {n.note_id: n for n in prepared.corpus.notes}
    for i, note in enumerate(corpora["original"].notes):
        assert note.text == source[note.note_id].text
        for cond in ("flipped", "irrelevant", "order"):
            assert corpora[cond].notes[i].text != note.text and corpora[cond].notes[i].note_id == note.note_id
        assert note.meta["target_code"] in note.gold_codes
        assert note.meta["partner_code"] in corpora["flipped"].notes[i].gold_codes
        assert note.split == "test" and note.teacher_trace is None
    with pytest.raises(MistillInputError, match="evidence-flip cohort"):
        load_prepared(run_id)
    # anything changed after freezing is refused before any run
    changed = copy.deepcopy(records)
    edit = changed[0]["versions"]["irrelevant"]["edits"][0]
    edit["text"] = edit["text"].replace("visitor", "visitors")
    flips.write_proposals(proposals, changed)
    with pytest.raises(MistillInputError) as err:
        run_flip_cohort(cfg)
    assert err.value.file == str(frozen) and err.value.note == records[0]["case_id"]


def test_restricted_cohort_keeps_every_text_off_the_store(tracking_uri, tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    syn = make_synthetic_corpus(n_notes=4, seed=0, n_codes_range=(3, 4))
    planted = [replace(n, text=n.text.replace("\n\n", f"\n\nChart note: {SECRET}.\n\n", 1)) for n in syn.notes]
    path = Corpus(name="shaped", privacy="restricted", notes=planted, inventory=syn.inventory).to_jsonl(
        tmp_path / "restricted.jsonl")
    codes = tmp_path / "codes.txt"
    codes.write_text("\n".join(syn.inventory.codes) + "\n")
    name = unique("flip-restricted")
    prep = run_prepare(PrepareConfig(corpus=str(path), corpus_name=name, privacy="restricted",
                                     codes_file=str(codes), model=TINY))
    exclude = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("flip-dev"), n_notes=2, seed=5,
                                        codes_per_note=(3, 4), inventory_size=60, model=TINY))
    lock = tmp_path / "lock.yaml"
    _lock(lock, n=4, budget=4)
    prepared = load_prepared(prep)
    drawn = flips.draw_cohort(prepared.corpus.notes, [], 4, 0)
    records = flips.synthetic_flip_proposals(drawn, prepared.inventory, tokenizer, seed=0)
    for r in records:  # the irrelevant edits write a second secret, as many words as the flip
        edit = r["versions"]["irrelevant"]["edits"][0]
        edit["text"] = " ".join((EDIT_SECRET.split() * 9)[:len(flips.words(edit["text"]))]) + ". "
    proposals = flips.write_proposals(tmp_path / "a" / "proposals.jsonl", records)
    ledger = flips.write_ledger(tmp_path / "a" / "ledger.csv", flips.all_accept_ledger(records, 4))
    run_id = run_flip_cohort(FlipCohortConfig(prepare_run=prep, exclude_prepare_runs=(exclude,), lock=str(lock),
                                              proposals=str(proposals), ledger=str(ledger)))
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.data.tags["mistill.privacy"] == "restricted" and run.data.metrics["n_accepted"] == len(records[:4])
    flipped = load_prepared(run.data.tags["mistill.flip_cohort.run.flipped"])
    assert "data/corpus.jsonl" not in artifact_paths(client, run.data.tags["mistill.flip_cohort.run.flipped"])
    assert all(SECRET in n.text for n in flipped.corpus.notes)
    needles = phrase_needles(SECRET, 4) + phrase_needles(EDIT_SECRET, 4)
    places = list(tracked_texts(client, f"mistill/{name}", tmp_path / "dl"))
    assert not leaks(places, needles)
