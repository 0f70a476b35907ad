"""App. P's programming pilot: KodCode's training problems through ``prepare -P task=kodcode`` (in
BigCodeBench's label space, their pytest tests run in the sandbox), the teacher's targets read on
them with its pools from a ranking frozen on BigCodeBench's ranking batch (``targets -P events_run
-P sets_run``), Vanilla CoT-KD and Mistill trained on them at λ 0.01, each evaluated (pass@1) and
read on its own heads on BigCodeBench's development batches, and Table 60 built from those runs;
the Table 60 reader's statistics on hand-made rows."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from stage_fixtures import TINY, unique

from analysis import pilot_tables
from analysis.report import build_report, collect_inputs
from mistill.errors import MistillInputError
from mistill.stages.characterize import AttributeConfig, EventsConfig, run_attribute, run_events
from mistill.stages.distill import TargetsConfig, TrainStageConfig, run_targets, run_train
from mistill.stages.evaluate import EvaluateConfig, run_evaluate
from mistill.stages.own_heads import OwnHeadsConfig, run_own_heads
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.tasks import note_items, task_for
from mistill.tasks.bigcodebench import write_bigcodebench_fixture
from mistill.tasks.kodcode import load_kodcode_corpus, write_kodcode_fixture
from mistill.tracking.experiments import experiment_for_corpus


def test_kodcode_problems_become_training_notes_whose_tests_run_in_the_sandbox(tmp_path):
    paths = write_kodcode_fixture(tmp_path, n_problems=8)
    corpus = load_kodcode_corpus(paths["corpus"], traces_file=paths["traces_file"])
    # problem 5 (no import) is left out: its solution names no API
    assert corpus.meta["left_out_without_api"] == 1 and len(corpus.notes) == 7
    assert {n.split for n in corpus.notes} == {"train"} and corpus.inventory.task == "bigcodebench"
    note = corpus.notes[0]
    assert note.text.endswith("```\nimport math\n\ndef count_ways(n, k):\n```") and note.gold_codes == ("math.comb",)
    assert note.shortlist == ("math.comb", "math.perm")  # the solution's namings and the question's
    task = task_for(corpus.inventory)
    named = {m[0] for m in task.for_note(note).find_mentions(note.teacher_trace, note_items(corpus.inventory, note))}
    assert named == {"math.comb", "math.perm"}  # the near-miss the question names, then the chosen attribute
    assert task.execute_answers([note, note], [note.teacher_trace, "<think>x</think>\nno code"]) == ["passed",
                                                                                                      "no_code"]
    wrong = note.teacher_trace.replace("return math.comb(n, k)", "return n")
    assert task.execute_answers([note], [wrong]) == ["failed"]  # the pytest assertion runs and fails
    drawn = load_kodcode_corpus(paths["corpus"], split_sizes=(3,), order_seed=5)
    again = load_kodcode_corpus(paths["corpus"], split_sizes=(3,), order_seed=5)
    assert [n.note_id for n in drawn.notes] == [n.note_id for n in again.notes] and len(drawn.notes) == 3
    assert [n.note_id for n in drawn.notes] != [n.note_id for n in load_kodcode_corpus(
        paths["corpus"], split_sizes=(3,), order_seed=1).notes]  # another seed, another locked draw
    locked = tmp_path / "split.txt"
    locked.write_text("Prefill_4_I\nPrefill_0_I\n")  # a locked split as given: kept in file order
    assert [n.note_id for n in load_kodcode_corpus(paths["corpus"], split_file=locked).notes] == ["Prefill_0_I",
                                                                                                  "Prefill_4_I"]
    locked.write_text("Prefill_5_I\n")  # the problem without an API
    with pytest.raises(MistillInputError) as err:
        load_kodcode_corpus(paths["corpus"], split_file=locked)
    assert (err.value.note, err.value.field) == ("Prefill_5_I", "question_id") and "names no API" in str(err.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_id": "Q1", "question": "q", "solution": "import math\n",
                               "test": "t", "test_info": [{"function_declaration": 3}]}) + "\n")
    with pytest.raises(MistillInputError) as err:
        load_kodcode_corpus(bad)
    assert (err.value.note, err.value.field, err.value.file) == ("Q1", "test_info[0].function_declaration", str(bad))
    with pytest.raises(MistillInputError) as err:
        PrepareConfig(task="kodcode", corpus=str(paths["corpus"]), split_sizes=(3, 2)).validate()
    assert err.value.field == "split_sizes"


def test_targets_take_the_training_notes_events_only_with_a_frozen_ranking():
    with pytest.raises(MistillInputError) as err:
        TargetsConfig(events_run="a" * 32).validate()
    assert err.value.field == "events_run"  # no attribution of these notes: the pools need sets_run
    with pytest.raises(MistillInputError) as err:
        TargetsConfig(events_run="a" * 32, teacher_attribute_run="b" * 32, sets_run="c" * 32).validate()
    assert err.value.field == "teacher_attribute_run"


def _own_rows(values: dict[tuple[str, int], list[float]], k: int = 40) -> pd.DataFrame:
    rows = []
    for (arm, seed), vals in values.items():
        rows += [{"arm": arm, "seed": seed, "note_id": f"t{i}", "phase": "P2C", "k": k, "recovery_own": v,
                  "gain_own_nats": 10 * v} for i, v in enumerate(vals)]
    return pd.DataFrame(rows)


def test_table_60_pairs_seeds_on_the_common_support_and_applies_the_thresholds():
    nan = float("nan")
    own = _own_rows({("vanilla-bf16", 0): [0.5, 0.5, 0.5, nan], ("vanilla-bf16", 1): [0.4, 0.4, 0.4, 0.4],
                     ("mistill", 0): [0.6, 0.5, 0.9, 0.9], ("mistill", 1): [0.5, 0.46, 0.4, 0.9],
                     ("randheads", 0): [0.5, 0.5, 0.5, 0.5], ("randheads", 1): [0.4, 0.4, 0.4, 0.4]})
    groups = {f"t{i}": f"g{i}" for i in range(4)}
    table = pilot_tables.recovery_table(own, groups, n_resamples=200)
    row = table[(table["arm"] == "mistill") & (table["reference"] == "vanilla-bf16")
                & (table["readout"] == "recovery")].iloc[0]
    # t3 lacks vanilla seed 0: off the common support; per input the seed-averaged differences
    diffs = [(0.1 + 0.1) / 2, (0.0 + 0.06) / 2, (0.4 + 0.0) / 2]
    assert row["n_inputs"] == 3 and row["n_groups"] == 3 and row["n_above_zero"] == 3
    assert row["median"] == pytest.approx(np.median(diffs)) and row["mean"] == pytest.approx(np.mean(diffs))
    assert row["seed_pairs"] == "0: +0.1000, 1: +0.0600"
    assert bool(row["met"])  # median +0.10 >= +0.030 and both seed pairs above zero
    gain = table[table["readout"] == "raw gain (nats)"].iloc[0]
    assert gain["mean"] == pytest.approx(10 * np.mean(diffs))  # the same inputs, in nats
    assert pd.isna(table[(table["arm"] == "randheads")]["met"].iloc[0])  # RandHeads - Vanilla: no threshold
    answers = pd.DataFrame([{"arm": arm, "seed": s, "note_id": f"t{i}", "passed": p,
                             "verdict": "passed" if p else "failed"}
                            for arm, per_seed in {"vanilla-bf16": {0: [1, 0, 0, 1], 1: [1, 1, 0, 0]},
                                                  "mistill": {0: [1, 0, 0, 0], 1: [1, 1, 0, 0]},
                                                  "randheads": {0: [1, 1, 1, 1], 1: [1, 1, 0, 0]}}.items()
                            for s, ps in per_seed.items() for i, p in enumerate(ps)])
    passes = pilot_tables.pass_table(answers, groups, n_resamples=200).set_index(["arm", "reference"])
    locked = passes.loc[("mistill", "vanilla-bf16")]
    assert locked["mean"] == pytest.approx(-0.125) and locked["seed_pairs"] == "0: -0.2500, 1: +0.0000"
    assert not locked["met"]  # below the -0.030 floor
    arms = pilot_tables.arm_pass_table(answers)
    assert arms.set_index(["arm", "seed"]).loc[("randheads", 0), "pass_at_1"] == 1.0 and arms["complete"].all()
    verdict = pilot_tables.pilot_verdict(table, passes.reset_index(), arms)
    assert verdict == {"meaningful": True, "acceptable": False}  # recovery gains, but pass@1 falls below its floor


def test_the_pilot_trains_on_kodcode_and_reads_its_students_on_bigcodebench(tracking_uri, tmp_path, monkeypatch,
                                                                              pinned_code_version):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    name = unique("pilot")
    # the assessment batch: math.sqrt and math.prod, each named after math.fsum, so that each problem's
    # contrastive event has a donor with another emitted choice
    code = write_bigcodebench_fixture(tmp_path / "bigcodebench", kinds=(0, 1, 2, 0, 3))
    kod = write_kodcode_fixture(tmp_path / "kodcode", n_problems=4)
    train = run_prepare(PrepareConfig(task="kodcode", corpus=str(kod["corpus"]), corpus_name=name,
                                      traces_file=str(kod["traces_file"]), split_sizes=(3,), privacy="public",
                                      model=TINY))
    dev = run_prepare(PrepareConfig(task="bigcodebench", corpus=str(code["corpus"]), corpus_name=name,
                                    traces_file=str(code["traces_file"]), split_sizes=(3, 2, 0), privacy="public",
                                    model=TINY))
    every = run_prepare(PrepareConfig(task="bigcodebench", corpus=str(code["corpus"]), corpus_name=name,
                                      split_sizes=(0, 0, 5), privacy="public", model=TINY))  # one evaluation split
    client = MlflowClient()
    # the teacher's ranking on the development ranking batch; the training problems' events only
    ranking = run_attribute(AttributeConfig(events_run=run_events(EventsConfig(prepare_run=dev, model=TINY,
                                                                               split="train", n_null=4)),
                                            selftest_events=0, stability_splits=5))
    events = run_events(EventsConfig(prepare_run=train, model=TINY, split="train", n_null=4))
    assert client.get_run(events).data.metrics["events/P2C/realized"] > 0
    targets = run_targets(TargetsConfig(events_run=events, sets_run=ranking, split="train", pool_k=2))
    tags = client.get_run(targets).data.tags
    assert (tags["mistill.input.events"], tags["mistill.input.sets"]) == (events, ranking)
    runs = {arm: run_train(TrainStageConfig(targets_run=targets, student_attribute_run=ranking, student=TINY,
                                            arm=arm, max_steps=1,
                                            overrides="lambda_p1=0.01,lambda_p2=0.01" if arm == "mistill" else ""))
            for arm in ("vanilla-bf16", "mistill")}
    assert client.get_run(runs["mistill"]).data.params["arm.lambda_p2"] == "0.01"
    for arm, run in runs.items():  # pass@1 on the development tasks; own heads ranked and read on its batches
        ev = run_evaluate(EvaluateConfig(prepare_run=every, train_run=run, split="test", max_new_tokens=8,
                                         fidelity=False))
        assert client.get_run(ev).data.metrics["pass_at_1"] == 0.0  # a random model writes no code
        run_own_heads(OwnHeadsConfig(prepare_run=dev, train_run=run, rank_split="train", test_split="val",
                                     k=(2, 40), necessity_k=2, m2_k=2, max_new_tokens=8, n_null=4,
                                     stability_splits=5, events_per_phase=3, floor_draws=1, range_gate=0.0,
                                     own_traces=False, launch="inline"))
    inputs = collect_inputs(client, experiment_for_corpus(name), own_heads_split="val")  # PP/report's
    assert inputs.task == "kodcode"
    rep = build_report(inputs, reference_arm="vanilla-bf16", n_resamples=50, corpus_resamples=50)
    recovery, passes = (next(t for t in rep.tables if t.name == n) for n in ("table60_pilot",
                                                                          "table60_pilot_pass_at_1"))
    per_arm = passes.numeric[passes.numeric["panel"] == "per arm"].set_index("arm")
    assert set(per_arm.index) == {"vanilla-bf16", "mistill"} and (per_arm["n_terminal"] == 5).all()
    change = passes.numeric[passes.numeric["panel"] == "change"].iloc[0]
    assert (change["arm"], change["reference"], change["mean"], change["n_tasks"]) == ("mistill", "vanilla-bf16",
                                                                                       0.0, 5)
    verdict = passes.numeric[passes.numeric["panel"] == "verdict"].set_index("arm")["met"]
    assert bool(verdict["acceptable"]) is True  # no change, every task with a terminal verdict
    row = recovery.numeric.iloc[0]  # own-heads P2C recovery at k=40, paired at the one seed both arms ran
    assert (row["readout"], row["arm"], row["reference"], row["k"]) == ("recovery", "mistill", "vanilla-bf16", 40)
    assert row["seed_pairs"].startswith("0: ") and row["n_inputs"] >= 1
    assert not row["met"]  # one seed pair cannot meet "every seed pair > 0" of two
    assert set(recovery.numeric["k"]) == {40}  # the run read k = 2 and 40: no k = 29 rows
