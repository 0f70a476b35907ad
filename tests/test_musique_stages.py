"""MuSiQue-Ans through the stages (App. O) on the project's fixture in the release's layout:
``prepare -P task=musique`` reads the questions and the teacher traces; the prompt shows the
passages and the question, each question's candidates are its own; the teacher's answer-emission
heads are located on the ranking questions; students are trained on them (Vanilla CoT-KD and
Mistill, whose one pool is the answer-emission phase's), their answers are scored with the
official EM / F1, their own heads are read out, and the report pairs the two arms by question
(Tables 56 and 57)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from stage_fixtures import REPO, TINY, unique

from analysis.report import build_report, collect_inputs
from mistill.data import flips
from mistill.errors import MistillInputError
from mistill.models.loading import load_tokenizer
from mistill.stages.characterize import (AttributeConfig, EventsConfig, KnockinStageConfig, run_attribute, run_events,
                                         run_knockin)
from mistill.stages.common import load_prepared
from mistill.stages.distill import TargetsConfig, TrainStageConfig, run_targets, run_train
from mistill.stages.evaluate import EvaluateConfig, run_evaluate
from mistill.stages.flip_cohort import FlipCohortConfig, run_flip_cohort
from mistill.stages.flip_test import FlipTestConfig, run_flip_test
from mistill.stages.generate import answer_counts
from mistill.stages.own_heads import OwnHeadsConfig, run_own_heads
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.tasks import note_items, task_for
from mistill.tasks.musique import (fixture_pair_proposals, load_musique_corpus, question_group, split_by_groups,
                                   write_musique_fixture)
from mistill.tracking.experiments import experiment_for_corpus


def test_the_release_layout_becomes_a_corpus_with_per_question_candidates(tmp_path):
    paths = write_musique_fixture(tmp_path)
    corpus = load_musique_corpus(paths["corpus"], traces_file=paths["traces_file"])
    assert len(corpus.notes) == 9 and {n.split for n in corpus.notes} == {"train", "test"}
    assert corpus.inventory.task == "musique"
    union = set()
    for note in corpus.notes:
        # the candidates are the question's own: its passage titles and its answers
        assert set(note.gold_codes) <= set(note.shortlist) and note_items(corpus.inventory, note) == list(note.shortlist)
        assert note.patient_id == question_group(note.note_id) and note.text.endswith("?")
        assert note.teacher_trace.endswith(f"Answer: {note.gold_codes[0]}")
        union |= set(note.shortlist)
    assert union == set(corpus.inventory.codes)
    assert question_group("3hop1__9285_5188_23307") == "9285" and question_group("odd-id") == "odd-id"
    # a trace for a question the release does not hold is refused, naming the file, the question and the field
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"id": "2hop__1_2", "trace": "<think>x</think>\nAnswer: y"}) + "\n")
    with pytest.raises(MistillInputError) as err:
        load_musique_corpus(paths["corpus"], traces_file=extra)
    assert (err.value.note, err.value.field) == ("2hop__1_2", "id")
    with pytest.raises(MistillInputError) as err:
        PrepareConfig(task="musique", corpus="synthetic").validate()
    assert err.value.field == "corpus"
    with pytest.raises(MistillInputError) as err:
        PrepareConfig(task="musique", corpus=str(paths["corpus"]), concepts_file=str(extra)).validate()
    assert err.value.field == "concepts_file"


def test_split_sizes_deal_whole_base_question_groups_in_file_order(tmp_path):
    ids = ["2hop__1_5", "2hop__1_6", "2hop__2_7", "2hop__3_8", "2hop__3_9"]
    assert split_by_groups(ids, (3, 2)) == {"2hop__1_5": "0", "2hop__1_6": "0", "2hop__2_7": "0",
                                            "2hop__3_8": "1", "2hop__3_9": "1"}
    # a group that does not fit closes its split; what no split takes is left out
    assert split_by_groups(["x__1_1", "x__1_2", "x__2_3"], (1, 2)) == {"x__1_1": "1", "x__1_2": "1"}
    paths = write_musique_fixture(tmp_path)  # two questions per base question
    corpus = load_musique_corpus(paths["corpus"], traces_file=paths["traces_file"], split_sizes=(2, 2, 2, 2))
    by_split = {}
    for note in corpus.notes:
        by_split.setdefault(note.split, set()).add(note.patient_id)
    assert {k: len(v) for k, v in by_split.items()} == {"train": 1, "val": 1, "select": 1, "test": 1}
    assert len(corpus.notes) == 8  # the dev file's second group does not fit: left out, its trace ignored
    # a fifth count: the evidence pairs' slice, the dev file's groups after the evaluation questions
    paired = load_musique_corpus(paths["corpus"], split_sizes=(2, 2, 2, 2, 2))
    assert [n.note_id for n in paired.notes if n.split == "pairs"] == [n.note_id for n in load_musique_corpus(
        paths["corpus"]).notes if n.split == "test"][2:]
    with pytest.raises(MistillInputError) as err:
        PrepareConfig(task="musique", corpus=str(paths["corpus"]), split_sizes=(2, 2, 2)).validate()
    assert err.value.field == "split_sizes"


def test_answers_are_read_and_scored_with_the_official_semantics(tmp_path):
    paths = write_musique_fixture(tmp_path)
    corpus = load_musique_corpus(paths["corpus"], traces_file=paths["traces_file"])
    task = task_for(corpus.inventory)
    read = task.answer_reader(corpus.inventory.codes)
    note = corpus.notes[0]
    founder, surname = note.gold_codes
    records = [{"codes": list(read(t).codes)} for t in (
        note.teacher_trace,                                      # the answer: EM 1
        f"<think>r</think>\nAnswer: **The {surname}.**",         # an alias, articles and marks removed: EM 1
        f"<think>r</think>\nAnswer: {founder} Junior",           # partial overlap: F1 only
        "<think>r</think>\nAnswer: unknown",                     # an abstention: no answer
        "<think>never closed")]                                  # invalid: no answer
    assert read("<think>never closed").reason == "unclosed_think" and not read("<think>x").valid
    assert read("<think>r</think>\nAnswer: unknown").reason == "abstained"
    assert read("x", capped=True).reason == "capped"
    scores = answer_counts([note] * len(records), records, task)
    assert list(scores["answer_em"]) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert scores["answer_f1"][2] == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))


def test_rank_knock_in_train_evaluate_and_read_on_questions(tracking_uri, tmp_path, monkeypatch,
                                                            pinned_code_version):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    paths = write_musique_fixture(tmp_path / "release", questions_per_split={"train": 3, "dev": 3})
    name = unique("musique")
    prep = run_prepare(PrepareConfig(task="musique", corpus=str(paths["corpus"]), corpus_name=name,
                                     traces_file=str(paths["traces_file"]), privacy="public", model=TINY))
    prepared = load_prepared(prep)
    assert prepared.inventory.task == "musique"
    prompt = prepared.prompt(prepared.corpus.notes[0], None)
    assert "header" not in prompt.parts and prompt.part("note").startswith("Passage 1: ")
    client = MlflowClient()
    # the teacher's answer-emission heads located on the ranking questions
    events = run_events(EventsConfig(prepare_run=prep, model=TINY, split="train", n_null=4))
    counts = client.get_run(events).data.metrics
    assert counts["events/P2/realized"] > 0, counts  # answer emission is a P2 event
    assert counts.get("events/P1/realized", 0) == 0 and counts.get("events/P2C/realized", 0) == 0
    ranked = run_attribute(AttributeConfig(events_run=events, selftest_events=0, stability_splits=5))
    located = run_knockin(KnockinStageConfig(attribute_run=ranked, k_bins=(2, 4), events_per_phase=3, floor_draws=1))
    rows = pd.read_csv(client.download_artifacts(located, "per_note_sets.csv", str(tmp_path / "dl")),
                       dtype={"note_id": str})
    assert {"global", "random"} <= set(rows["set"]) and "P2" in set(rows["phase"])

    # the student (here the teacher's architecture, so that its own ranking is the teacher's run), trained
    # on the teacher's answer-emission targets
    targets = run_targets(TargetsConfig(teacher_attribute_run=ranked, split="train"))
    trained = {arm: run_train(TrainStageConfig(targets_run=targets, student_attribute_run=ranked, student=TINY,
                                               arm=arm, max_steps=1))
               for arm in ("vanilla-bf16", "mistill")}
    pools = json.loads(open(client.download_artifacts(trained["mistill"], "student_pools.json",
                                                      str(tmp_path / "p"))).read())
    assert set(pools) == {"P2"}  # answer emission is the task's one phase: the only pool
    for arm, run in trained.items():  # each arm's answers, scored with answer EM / F1, and its own heads
        fidelity = arm == "mistill"  # the teacher-forced readouts once; the answers of both
        ev = run_evaluate(EvaluateConfig(prepare_run=prep, split="test", max_new_tokens=8, train_run=run,
                                         fidelity=fidelity))
        m = client.get_run(ev).data.metrics
        assert 0.0 <= m["answer_f1"] <= 1.0 and 0.0 <= m["answer_em"] <= m["answer_f1"], m
        assert not fidelity or m["m1/P2/n"] > 0, m  # the readouts find the answer-emission events
        run_own_heads(OwnHeadsConfig(prepare_run=prep, train_run=run, rank_split="train", test_split="test",
                                     k=(2, 40), necessity_k=2, m2_k=2, max_new_tokens=8, n_null=4,
                                     stability_splits=5, events_per_phase=3, floor_draws=1, range_gate=0.0,
                                     own_traces=False, launch="inline"))

    # Tables 56 and 57 from these runs: readings paired by question, groups from the prepared corpus
    inputs = collect_inputs(client, experiment_for_corpus(name))
    assert inputs.task == "musique"
    rep = build_report(inputs, reference_arm="vanilla-bf16", n_resamples=50, corpus_resamples=50)
    t56, t57 = (next(t for t in rep.tables if t.name == n) for n in ("table56_public_task",
                                                                      "table57_public_task_checkpoints"))
    by = t56.numeric.set_index("reading")
    groups = {n.note_id: n.patient_id for n in prepared.corpus.notes}
    answer = by.loc["(2) answer F1"]
    assert (answer["arm"], answer["reference"], answer["n_seed_pairs"]) == ("mistill", "vanilla-bf16", 1)
    assert answer["n_questions"] == 3 and answer["n_groups"] == len({groups[n.note_id] for n in
                                                                      prepared.corpus.notes if n.split == "test"})
    f1 = t57.numeric.set_index("arm")["answer_f1"]
    assert answer["estimate"] == pytest.approx(f1["mistill"] - f1["vanilla-bf16"])
    assert set(t57.numeric["arm"]) == {"mistill", "vanilla-bf16"}
    assert answer["criterion"] == "lower bound > -0.02" and answer["met"] == (answer["ci_low"] > -0.02)


def test_evidence_pairs_are_frozen_answered_and_read_as_paired_correctness(tracking_uri, tmp_path, monkeypatch,
                                                                           pinned_code_version):
    """App. O's evidence pairs through the evidence-flip machinery: the cohort lock names the pair
    conditions (a paraphrase as the second control), eligibility is the teacher's screen answer
    matching the gold answer (EM), the partner answer need not be a candidate, the flipped gold is
    the partner alone; each checkpoint answers every pair under every condition, and the report's
    reading 3 pairs Mistill with the reference per pair, resampled by base-question group."""
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    paths = write_musique_fixture(tmp_path / "release", questions_per_split={"train": 2, "dev": 6})
    name = unique("mq-pairs")
    prep = run_prepare(PrepareConfig(task="musique", corpus=str(paths["corpus"]), corpus_name=name,
                                     traces_file=str(paths["traces_file"]), privacy="public", model=TINY))
    prepared = load_prepared(prep)
    lock = flips.load_cohort_lock(REPO / "projects/configs/cohorts/o-musique-pairs.yaml")
    assert lock.conditions == flips.PAIR_CONDITIONS
    drawn = flips.draw_cohort(prepared.corpus.notes, set(), lock.draw_n, lock.draw_seed)
    records = fixture_pair_proposals(drawn, load_tokenizer(TINY))
    assert len(records) == len(drawn) == 4  # one question of each base-question group
    proposals = flips.write_proposals(tmp_path / "pairs" / "proposals.jsonl", records)
    with pytest.raises(MistillInputError) as err:  # App. N's conditions are not this lock's
        flips.read_proposals(flips.write_proposals(tmp_path / "order.jsonl", [
            {**records[0], "versions": {**{k: v for k, v in records[0]["versions"].items() if k != "control"},
                                        "order": records[0]["versions"]["control"]}}]), lock.conditions)
    assert err.value.field == "versions"
    decisions = flips.all_accept_ledger(records, lock.review_budget)
    decisions[0] = flips.Decision(decisions[0].case_id, "exclude", "control_meaning", "author", "2026-01-02T10:00:00")
    ledger = flips.write_ledger(tmp_path / "pairs" / "ledger.csv", decisions)
    cohort = run_flip_cohort(FlipCohortConfig(prepare_run=prep, lock="projects/configs/cohorts/o-musique-pairs.yaml",
                                              proposals=str(proposals), ledger=str(ledger), model=TINY))
    client = MlflowClient()
    tags = client.get_run(cohort).data.tags
    assert client.get_run(cohort).data.metrics["n_accepted"] == 3
    corpora = {c: load_prepared(tags[f"mistill.flip_cohort.run.{c}"]).corpus for c in flips.PAIR_CONDITIONS}
    for original, flipped in zip(corpora["original"].notes, corpora["flipped"].notes, strict=True):
        assert original.meta["target_code"] in original.gold_codes
        assert flipped.gold_codes == (flipped.meta["partner_code"],)  # the flip's answer is the partner alone
        assert original.meta["partner_code"] in flipped.text and original.meta["partner_code"] not in \
            original.gold_codes
    # two checkpoints standing for the reference and Mistill, every pair under every condition
    runs = {arm: run_flip_test(FlipTestConfig(cohort_run=cohort, model=model, arm=arm, samples=2, max_new_tokens=6))
            for arm, model in (("vanilla-bf16", TINY), ("mistill", "tiny:qwen3:seed=2"))}
    cases = pd.read_csv(client.download_artifacts(runs["mistill"], "flip_cases.csv", str(tmp_path / "c")))
    assert list(cases["case_id"]) == sorted(d.case_id for d in decisions if d.decision == "accept")
    assert {"agreement_control", "expected_control", "paired_success", "group"} <= set(cases.columns)
    assert cases["D_category"].isna().all()  # free-text answers have no categories
    groups = {n.meta["flip_case"]: n.patient_id for n in corpora["original"].notes}
    assert dict(zip(cases["case_id"], cases["group"].astype(str))) == groups
    # the teacher's gate: clean on the HF path, the prefill-inclusive mask on its heads and on a random draw
    gate = dict(cohort_run=cohort, model=TINY, arm="teacher", samples=2, max_new_tokens=6, backend="hf")
    masked = dict(mask_heads=("L0H1", "L1H2"), mask_regime="prefill")
    settings = {"clean": run_flip_test(FlipTestConfig(**gate)),
                "sham": run_flip_test(FlipTestConfig(**gate, mask="sham", **masked)),
                "target": run_flip_test(FlipTestConfig(**gate, mask="target", **masked)),
                "random1": run_flip_test(FlipTestConfig(**gate, mask="target", mask_random=1, **masked))}
    drawn_heads = json.loads(open(client.download_artifacts(settings["random1"], "key_mask.json",
                                                              str(tmp_path / "k"))).read())
    assert drawn_heads["regime"] == "prefill" and len(drawn_heads["heads"]) == 2
    assert not set(drawn_heads["heads"]) & {"L0H1", "L1H2"} and sorted(h[:2] for h in drawn_heads["heads"]) == \
        ["L0", "L1"]  # one other head of each nominated head's layer
    per_setting = {k: pd.read_csv(client.download_artifacts(r, "flip_cases.csv", str(tmp_path / k))).set_index(
        "case_id")["paired_success"] for k, r in settings.items()}
    inputs = collect_inputs(client, experiment_for_corpus(name))
    rep = build_report(inputs, reference_arm="vanilla-bf16", n_resamples=50, corpus_resamples=50)
    t56, t57, t58 = (next(t for t in rep.tables if t.name == n) for n in (
        "table56_public_task", "table57_public_task_checkpoints", "table58_evidence_mask_gate"))
    g58 = t58.numeric.set_index(["statistic", "weighting"])
    assert g58.loc[("clean P", "equal-pair"), "estimate"] == pytest.approx(per_setting["clean"].mean())
    assert g58.loc[("E_P (sham - target)", "equal-pair"), "estimate"] == pytest.approx(
        (per_setting["sham"] - per_setting["target"]).mean())
    assert g58.loc[("E_P^rand (random - target)", "equal-group"), "n_pairs"] == 3
    reading = t56.numeric.set_index("reading").loc["(3) paired correctness on the evidence pairs"]
    per = t57.numeric.set_index("arm")["paired_correctness"]
    assert (reading["arm"], reading["reference"], reading["n_questions"]) == ("mistill", "vanilla-bf16", 3)
    assert reading["estimate"] == pytest.approx(per["mistill"] - per["vanilla-bf16"])
    assert reading["criterion"] == "lower bound > 0" and reading["met"] == (reading["ci_low"] > 0)
