"""EURLEX57K through the stages (App. P, Table 59's chain) on the project's fixture in the release's
layout: ``prepare -P task=eurlex57k`` reads the acts, the concept file, the hierarchy and the
traces; the teacher is ranked on the development batch (the train acts), and its frozen sets are
knocked in on fresh acts (the test acts) against count-matched random heads, and read there for
the earlier-naming read-back against the random and bottom panels."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from stage_fixtures import TINY, unique

from analysis.report import collect_inputs
from analysis.report_model import Report
from analysis.report_sections import transfer_screen_section
from mistill.errors import MistillInputError
from mistill.stages.characterize import (AttributeConfig, EventsConfig, KnockinStageConfig, run_attribute, run_events,
                                         run_knockin)
from mistill.stages.common import load_prepared
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.stages.readside import ReadSideConfig, run_read_side
from mistill.tracking.experiments import experiment_for_corpus
from mistill.tasks.eurlex import EurlexTask, load_eurlex_corpus, write_eurlex_fixture


def test_the_release_layout_becomes_a_corpus_with_candidate_lists(tmp_path):
    paths = write_eurlex_fixture(tmp_path)
    corpus = load_eurlex_corpus(paths["dataset"], paths["concepts_file"], hierarchy_file=paths["hierarchy_file"],
                                traces_file=paths["traces_file"], candidates=6)
    assert len(corpus.notes) == 12 and {n.split for n in corpus.notes} == {"train", "val", "test"}
    assert corpus.inventory.task == "eurlex57k" and len(corpus.inventory) == 16
    task = EurlexTask.from_inventory(corpus.inventory)
    for note in corpus.notes:
        assert len(note.shortlist) == 6 and set(note.gold_codes) <= set(note.shortlist)
        # the near-miss the trace names is one of the gold concept's siblings, and it is listed
        assert any(task.related(note.gold_codes[0], c) for c in note.shortlist)
        assert note.teacher_trace.endswith(json.dumps(list(note.gold_codes)))
    again = load_eurlex_corpus(paths["dataset"], paths["concepts_file"], hierarchy_file=paths["hierarchy_file"],
                               candidates=6)
    assert [n.shortlist for n in again.notes] == [n.shortlist for n in corpus.notes]  # seeded per act
    assert again.notes[0].teacher_trace is None
    every = load_eurlex_corpus(paths["dataset"], paths["concepts_file"], candidates=40)  # more than there are
    assert {len(n.shortlist) for n in every.notes} == {16}
    task_near = task.neighbours()  # the hierarchy's neighbours are exactly the related pairs
    assert all((b in task_near[a]) == task.related(a, b) for a in task_near for b in task_near)
    # a trace for an act the dataset lacks is refused, naming the file, the act and the field
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"celex_id": "32999R9999", "trace": "<think>x</think>[]"}) + "\n")
    with pytest.raises(MistillInputError) as err:
        load_eurlex_corpus(paths["dataset"], paths["concepts_file"], traces_file=extra)
    assert (err.value.note, err.value.field) == ("32999R9999", "celex_id")
    with pytest.raises(MistillInputError) as err:
        PrepareConfig(task="eurlex57k", corpus=str(paths["dataset"])).validate()
    assert err.value.field == "concepts_file"


def test_rank_on_the_development_acts_and_knock_in_the_frozen_sets_on_fresh_acts(tracking_uri, tmp_path, monkeypatch,
                                                                                 pinned_code_version):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    paths = write_eurlex_fixture(tmp_path / "release", acts_per_split={"train": 3, "test": 2})
    name = unique("eurlex")
    prep = run_prepare(PrepareConfig(task="eurlex57k", corpus=str(paths["dataset"]), corpus_name=name,
                                     concepts_file=str(paths["concepts_file"]),
                                     hierarchy_file=str(paths["hierarchy_file"]),
                                     traces_file=str(paths["traces_file"]), candidates=6, privacy="public",
                                     model=TINY))
    prepared = load_prepared(prep)
    assert prepared.inventory.task == "eurlex57k" and prepared.inventory.relations  # the hierarchy travels
    ranked = {}
    for split in ("train", "test"):
        events = run_events(EventsConfig(prepare_run=prep, model=TINY, split=split, n_null=4))
        counts = MlflowClient().get_run(events).data.metrics
        assert counts["events/P2/realized"] > 0 and counts["events/P2C/realized"] > 0, counts
        assert counts["events/NULL/realized"] > 0 and counts.get("events/P1/realized", 0) == 0  # no region decision
        ranked[split] = run_attribute(AttributeConfig(events_run=events, selftest_events=0, stability_splits=5))
    fresh = run_knockin(KnockinStageConfig(attribute_run=ranked["test"], sets_run=ranked["train"], k_bins=(2, 4),
                                           events_per_phase=3, floor_draws=1))
    run = MlflowClient().get_run(fresh)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.input.sets"] == ranked["train"]
    rows = pd.read_csv(MlflowClient().download_artifacts(fresh, "per_note_sets.csv", str(tmp_path / "dl")),
                       dtype={"note_id": str})
    assert set(rows["note_id"]) <= {n.note_id for n in prepared.corpus.notes if n.split == "test"}
    assert {"global", "random"} <= set(rows["set"]) and set(rows["phase"]) <= {"P2", "P2C", "NULL"}
    # the read-back diagnostic: the frozen ranking's panel read on the fresh acts
    readback = run_read_side(ReadSideConfig(attribute_run=ranked["test"], sets_run=ranked["train"], panel_top=4,
                                            panel_bottom=4, panel_random=4))
    assert MlflowClient().get_run(readback).data.tags["mistill.input.sets"] == ranked["train"]
    shares = pd.read_csv(MlflowClient().download_artifacts(readback, "readside_readback_notes.csv",
                                                           str(tmp_path / "rb")), dtype={"note_id": str})
    assert set(shares["group"]) == {"top", "random", "bottom"} and shares["n_share"].between(0, 1).all()
    # the report's inputs of a EURLEX experiment: its task, and the knock-in and read side of the
    # frozen ranking, from which Table 59 is built (in place of the clinical instruction control)
    inputs = collect_inputs(MlflowClient(), experiment_for_corpus(name))
    assert inputs.task == "eurlex57k" and list(inputs.extra["knockin_sets"]["run_id"]) == [fresh]
    assert list(inputs.extra["read_side_sets"]["run_id"]) == [readback] and inputs.extra["read_side"].empty
    rep = Report(inputs.experiment, "vanilla-bf16")
    transfer_screen_section(rep, inputs.extra["knockin_sets"], n_resamples=50, seed=0, k=4,  # the fixture's top k
                            read_side_sets=inputs.extra["read_side_sets"])
    (t59,) = [t for t in rep.tables if t.name == "table59_transfer_screen"]
    assert set(t59.numeric["run_id"]) == {fresh} and set(t59.numeric["sets_run"]) == {ranked["train"]}
    by = t59.numeric[t59.numeric["k"] == 4].set_index("statistic")
    p2c = rows[(rows["phase"] == "P2C") & (rows["k"] == 4) & (rows["set"] == "global")]
    assert by.loc["inputs with an event of the phase", "value"] == int((p2c["n_events"] > 0).sum()) > 0
    assert by.loc["evaluable events of all events of the phase", "n"] == int(p2c["n_events"].sum())
    top = shares[shares["group"] == "top"]
    assert by.loc["read-back on the earlier namings, ranked heads", "value"] == pytest.approx(top["n_share"].mean())
    assert by.loc["read-back, ranked minus random", "n"] == len(top) > 0


def test_table59_finds_the_generate_run_that_traced_the_screened_inputs(tracking_uri):
    # the lineage the report follows: knockin -> its attribute run -> that run's events run -> the
    # prepared corpus it read; only a generate run there gives Table 59 its native row
    from analysis.report import screen_generations
    from mistill.tracking.naming import TAG_INPUT_PREFIX, TAG_STAGE

    client = MlflowClient()
    exp = client.create_experiment(unique("lineage"))

    def run(stage: str, **inputs: str) -> str:
        r = client.create_run(exp, tags={TAG_STAGE: stage, **{TAG_INPUT_PREFIX + k: v for k, v in inputs.items()}})
        client.set_terminated(r.info.run_id)
        return r.info.run_id

    generated = run("generate")
    prepared = run("prepare")
    chains = {source: run("attribute", events=run("events", prepare=source)) for source in (generated, prepared)}
    sets = pd.DataFrame([{"run_id": f"knockin-{i}", "attribute_run": attribute}
                         for i, attribute in enumerate(chains.values())])
    found = screen_generations(client, sets)
    assert found.to_dict("records") == [{"knockin_run": "knockin-0", "run_id": generated}]


def test_generate_grades_the_retrieval_baseline_beside_the_answers(tracking_uri, tmp_path, monkeypatch,
                                                                 pinned_code_version):
    # Table 59's native row on EURLEX: the teacher's answers and, on the same acts, the top labels
    # of the retrieval ranking of each act's shown candidates
    from mistill.stages.generate import GenerateConfig, retrieval_counts, run_generate

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    paths = write_eurlex_fixture(tmp_path / "release", acts_per_split={"test": 3})
    prep = run_prepare(PrepareConfig(task="eurlex57k", corpus=str(paths["dataset"]), corpus_name=unique("eurlex"),
                                     concepts_file=str(paths["concepts_file"]),
                                     hierarchy_file=str(paths["hierarchy_file"]), candidates=6, privacy="public",
                                     model=TINY))
    gen = run_generate(GenerateConfig(prepare_run=prep, model=TINY, split="test", max_new_tokens=8, retrieval_top=2))
    client = MlflowClient()
    table = pd.read_csv(client.download_artifacts(gen, "generations.csv", str(tmp_path / "g")),
                        dtype={"note_id": str})
    prepared = load_prepared(prep)
    notes = [n for n in prepared.corpus.notes if n.split == "test"]
    assert list(table["note_id"]) == [n.note_id for n in notes] and set(table["retrieval_top"]) == {2}
    task = EurlexTask.from_inventory(prepared.inventory)
    for note, row in zip(notes, table.itertuples(), strict=True):
        top = task.retrieval_ranking(note.text, note.shortlist)[:2]
        assert set(top) <= set(note.shortlist)
        hits = len(set(top) & set(note.gold_codes))
        assert (row.retrieval_tp, row.retrieval_fp, row.retrieval_fn) == (hits, 2 - hits, len(note.gold_codes) - hits)
    # the fixture's acts name their gold concepts in the title: the baseline finds them
    assert table["retrieval_tp"].sum() > 0
    tp, fp, fn = (int(table[k].sum()) for k in ("retrieval_tp", "retrieval_fp", "retrieval_fn"))
    assert client.get_run(gen).data.metrics["retrieval_micro_f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    # every concept ranked instead of the shown list
    wide = retrieval_counts(notes, task, prepared.inventory.codes, 2, "inventory")
    assert len(wide) == len(notes) and (wide["retrieval_tp"] + wide["retrieval_fp"] == 2).all()
    with pytest.raises(MistillInputError) as err:
        GenerateConfig(prepare_run=prep, retrieval_scope="corpus").validate()
    assert err.value.field == "retrieval_scope"
