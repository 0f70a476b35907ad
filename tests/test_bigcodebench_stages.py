"""BigCodeBench through the stages (App. P, Table 59's programming column) on the project's fixture
in the release's layout: ``prepare -P task=bigcodebench`` reads the problems and the teacher
traces; each problem's API namings are its own candidates and its prompt's imports its aliases;
the teacher is ranked on the ranking batch and its frozen sets are knocked in on the fresh
problems; ``generate`` runs each answer's code against the problem's tests in the sandbox
(pass@1, Table 59's native row)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from stage_fixtures import TINY, unique

from analysis.transfer_tables import native_table
from mistill.errors import MistillInputError
from mistill.stages.characterize import (AttributeConfig, EventsConfig, KnockinStageConfig, run_attribute, run_events,
                                         run_knockin)
from mistill.stages.common import load_prepared
from mistill.stages.distill import TargetsConfig, run_targets
from mistill.stages.evaluate import EvaluateConfig, run_evaluate
from mistill.stages.generate import GenerateConfig, run_generate
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.tasks import note_items, task_for
from mistill.tasks.bigcodebench import load_bigcodebench_corpus, write_bigcodebench_fixture


def test_the_release_becomes_a_corpus_whose_answers_run_against_their_tests(tmp_path):
    paths = write_bigcodebench_fixture(tmp_path)
    corpus = load_bigcodebench_corpus(paths["corpus"], traces_file=paths["traces_file"], split_sizes=(3, 2, 2))
    assert [n.split for n in corpus.notes] == ["train"] * 3 + ["val"] * 2 + ["test"] * 2  # in file order
    assert corpus.notes[0].note_id == "BigCodeBench-0" and corpus.inventory.task == "bigcodebench"
    task = task_for(corpus.inventory)
    for note in corpus.notes:
        assert set(note.gold_codes) <= set(note_items(corpus.inventory, note))
        bound = task.for_note(note)  # the prompt's imports resolve the namings of its trace
        named = {m[0] for m in bound.find_mentions(note.teacher_trace, note_items(corpus.inventory, note))}
        assert set(note.gold_codes) <= named and len(named) == 2  # the near-miss and the chosen attribute
    read = task.answer_reader(corpus.inventory.codes)
    note = corpus.notes[0]
    assert read(note.teacher_trace).codes == note.gold_codes
    assert read("<think>x</think>\nno code here").reason == "no_code"
    outcomes = task.execute_answers(corpus.notes[:2], [corpus.notes[0].teacher_trace, "<think>x</think>\nnone"])
    assert outcomes == ["passed", "no_code"]
    broken = note.teacher_trace.replace("return ", "return 1 + ")  # the reference plus one fails its test
    assert task.execute_answers([note], [broken]) == ["failed"]
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"task_id": "BigCodeBench/999", "trace": "<think>x</think>"}) + "\n")
    with pytest.raises(MistillInputError) as err:
        load_bigcodebench_corpus(paths["corpus"], traces_file=extra)
    assert (err.value.note, err.value.field) == ("BigCodeBench/999", "task_id")
    with pytest.raises(MistillInputError) as err:
        PrepareConfig(task="bigcodebench", corpus=str(paths["corpus"]), split_sizes=(1, 2, 3, 4)).validate()
    assert err.value.field == "split_sizes"


def test_rank_knock_in_frozen_sets_and_pass_at_1_of_the_fresh_problems(tracking_uri, tmp_path, monkeypatch,
                                                                          pinned_code_version):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    paths = write_bigcodebench_fixture(tmp_path / "release", n_problems=6)
    prep = run_prepare(PrepareConfig(task="bigcodebench", corpus=str(paths["corpus"]), corpus_name=unique("bcb"),
                                     traces_file=str(paths["traces_file"]), split_sizes=(3, 0, 3),
                                     privacy="public", model=TINY))
    prepared = load_prepared(prep)
    assert "header" not in prepared.prompt(prepared.corpus.notes[0], None).parts  # the task is the prompt
    client = MlflowClient()
    ranked = {}
    for split in ("train", "test"):
        events = run_events(EventsConfig(prepare_run=prep, model=TINY, split=split, n_null=4))
        counts = client.get_run(events).data.metrics
        assert counts["events/P2/realized"] > 0 and counts["events/P2C/realized"] > 0, counts
        ranked[split] = run_attribute(AttributeConfig(events_run=events, selftest_events=0, stability_splits=5))
    fresh = run_knockin(KnockinStageConfig(attribute_run=ranked["test"], sets_run=ranked["train"], k_bins=(2, 4),
                                           events_per_phase=3, floor_draws=1))
    rows = pd.read_csv(client.download_artifacts(fresh, "per_note_sets.csv", str(tmp_path / "dl")),
                       dtype={"note_id": str})
    assert {"global", "random"} <= set(rows["set"]) and "P2C" in set(rows["phase"])
    # the pilot's targets: read on one batch's traces, pooled over the ranking frozen on another
    targets = run_targets(TargetsConfig(teacher_attribute_run=ranked["test"], sets_run=ranked["train"], split="test",
                                        pool_k=2))
    assert client.get_run(targets).data.tags["mistill.input.sets"] == ranked["train"]
    pools = json.loads(open(client.download_artifacts(targets, "teacher_pools.json", str(tmp_path / "t"))).read())
    frozen = json.loads(open(client.download_artifacts(ranked["train"], "head_sets.json", str(tmp_path / "h"))).read())
    assert set(pools) == {"P2", "P2C"}  # the task's phases: no region-level decision
    for phase in ("P2", "P2C"):
        assert set(pools[phase]["head_names"]) == set(frozen[phase]["ranking"][:2]), phase
    # the native row: the model's code run against each fresh problem's tests (a random model writes none)
    gen = run_generate(GenerateConfig(prepare_run=prep, model=TINY, split="test", max_new_tokens=8))
    m = client.get_run(gen).data.metrics
    assert m["pass_at_1"] == 0.0 and m["verdict/no_code"] == 3.0
    table = pd.read_csv(client.download_artifacts(gen, "generations.csv", str(tmp_path / "g")))
    assert list(table["verdict"]) == ["no_code"] * 3
    # a checkpoint's answers the same way: evaluate runs each against its problem's tests (the pilot's pass@1)
    ev = run_evaluate(EvaluateConfig(prepare_run=prep, model=TINY, arm="teacher", split="test", max_new_tokens=8))
    assert client.get_run(ev).data.metrics["pass_at_1"] == 0.0
    per_note = pd.read_csv(client.download_artifacts(ev, "per_note_metrics.csv", str(tmp_path / "e")))
    assert list(per_note["verdict"]) == ["no_code"] * 3 and list(per_note["passed"]) == [0] * 3
    native = native_table(table, n_resamples=50).set_index("statistic")
    assert native.loc["native pass@1 of the teacher's code (sandboxed tests)", "n"] == 3
    assert native.loc["inputs whose generation held no code", "value"] == 3
