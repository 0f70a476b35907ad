"""The ``generate`` stage end to end on a real MLflow server: flags and rates, the traced corpus
(a prepared corpus downstream stages read), reuse, per-note resume after a crash, the cap, and
no generated text on the server for a restricted corpus.

The model is a real tiny checkpoint whose sampled completion is a fixed script that closes
``</think>`` and answers with one inventory code (:func:`gen_fixtures.scripted_model`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import mistill.stages.generate as generate_stage
from gen_fixtures import scripted_model
from mistill.data.corpus import Corpus
from mistill.data.synthetic import make_synthetic_corpus
from mistill.errors import MistillInputError
from mistill.models.loading import embedded_tokenizer
from mistill.stages.characterize import EventsConfig, run_events
from mistill.stages.common import RunReader, load_prepared
from mistill.stages.generate import GenerateConfig, run_generate
from mistill.stages.prepare import PrepareConfig, run_prepare
from stage_fixtures import TINY, artifact_paths, leaks, phrase_needles, runs_of, tracked_texts, unique

SECRET = "violet stapler hummed softly near eleven quiet dunes"

pytestmark = pytest.mark.usefixtures("pinned_code_version")


def _script_for(codes) -> tuple[str, str]:
    """A script answering with an inventory code whose tokens keep the script's tokens distinct."""
    tok = embedded_tokenizer()
    for code in codes:
        script = f" {SECRET}</think>[\"{code}\"]"
        ids = tok(script, add_special_tokens=False)["input_ids"]
        if len(set(ids)) == len(ids) and 198 not in ids:
            return script, code
    raise AssertionError("no inventory code fits the bigram script")


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """(model dir, script, code) for the synthetic inventory of 120 codes, seed 0."""
    inv = make_synthetic_corpus(n_notes=1, seed=0).inventory
    script, code = _script_for(inv.codes)
    path = scripted_model(tmp_path_factory.mktemp("scripted") / "model", script)
    return str(path), script, code


def _prepare(root, monkeypatch, n_notes=3) -> str:
    monkeypatch.setenv("MISTILL_ROOT", str(root))
    return run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("gen"), n_notes=n_notes,
                                     model=TINY))


def test_generate_flags_rates_traced_corpus_and_reuse(tracking_uri, tmp_path, monkeypatch, scripted):
    model, script, code = scripted
    prep = _prepare(tmp_path / "root", monkeypatch)
    notes = load_prepared(prep).corpus.notes
    cfg = GenerateConfig(prepare_run=prep, model=model, max_new_tokens=64)
    run_id = run_generate(cfg)
    client = MlflowClient()
    run = client.get_run(run_id)
    m = run.data.metrics
    assert run.info.status == "FINISHED" and run.data.tags["mistill.stage"] == "generate"
    assert run.data.tags["mistill.input.prepare"] == prep
    assert m["n_notes"] == 3 and m["valid_rate"] == 1.0 and m["cap_rate"] == 0.0
    assert m["degenerate_rate"] == 0.0 and m["parsed_rate"] == 1.0 and m["n_traced_notes"] == 3
    n_script = len(embedded_tokenizer()(script, add_special_tokens=False)["input_ids"])
    assert m["mean_generated_tokens"] == n_script + 1  # the script, then end-of-turn
    assert m["thinking_template"] == 0.0  # the tiny tokenizer's template has no thinking switch
    arts = artifact_paths(client, run_id)
    for note in notes:
        assert {f"notes/{note.note_id}/generation.json", f"notes/{note.note_id}/trace.txt",
                f"notes/{note.note_id}/_DONE"} <= arts
    assert {"data/corpus.jsonl", "data/inventory.json", "generations.csv", "decoding.json"} <= arts
    # every answer graded against its note's gold codes: the model's native micro-F1
    import mlflow
    import pandas as pd

    table = pd.read_csv(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="generations.csv",
                                                            dst_path=str(tmp_path / "gens")), dtype={"note_id": str})
    hits = [int(code in n.gold_codes) for n in notes]
    assert list(table["tp"]) == hits and list(table["fp"]) == [1 - h for h in hits]
    assert list(table["n_gold"]) == [len(set(n.gold_codes)) for n in notes]
    assert list(table["fn"]) == [len(set(n.gold_codes)) - h for n, h in zip(notes, hits)]
    tp, gold = sum(hits), sum(len(set(n.gold_codes)) for n in notes)
    assert m["answer_micro_f1"] == pytest.approx(2 * tp / (2 * tp + (3 - tp) + (gold - tp)))
    assert m["n_graded_notes"] == 3

    traced = load_prepared(run_id)  # the generate run is a prepared corpus
    assert [n.note_id for n in traced.corpus.notes] == [n.note_id for n in notes]
    assert all(n.teacher_trace == script for n in traced.corpus.notes)
    assert traced.corpus.digest == run.data.tags["mistill.corpus_digest"]
    record = json_artifact(client, run_id, f"notes/{notes[0].note_id}/generation.json", tmp_path)
    assert record["codes"] == [code] and record["valid"] and record["decoding"]["top_k"] == 20
    assert record["decoding"]["backend"] == "hf" and record["decoding"]["max_new_tokens"] == 64
    from mistill.evaluation.generation import note_seed

    assert record["seed"] == note_seed(cfg.decoding(), notes[0].note_id)

    assert run_generate(cfg) == run_id  # identical call: the finished run is reused
    assert len(runs_of(client.get_experiment(run.info.experiment_id).name, stage="generate")) == 1

    # downstream: events reads the generate run as its prepare run
    events = run_events(EventsConfig(prepare_run=run_id, model=TINY, n_null=2))
    ev = client.get_run(events)
    assert ev.info.status == "FINISHED" and ev.data.metrics["n_notes"] == 3
    assert ev.data.tags["mistill.input.prepare"] == run_id


def json_artifact(client, run_id, path, tmp_path):
    import json

    import mlflow

    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path,
                                                dst_path=str(tmp_path / "dl" / path.replace("/", "_")))
    return json.loads(open(local).read())


def test_generate_cap_counts_and_keeps_no_trace(tracking_uri, tmp_path, monkeypatch, scripted):
    model, _, _ = scripted
    prep = _prepare(tmp_path / "root", monkeypatch, n_notes=2)
    run_id = run_generate(GenerateConfig(prepare_run=prep, model=model, max_new_tokens=3))
    run = MlflowClient().get_run(run_id)
    m = run.data.metrics
    assert run.info.status == "FINISHED"
    assert m["cap_rate"] == 1.0 and m["valid_rate"] == 0.0 and m["degenerate_rate"] == 1.0
    assert m["reason/capped"] == 2 and m["mean_generated_tokens"] == 3 and m["n_traced_notes"] == 0
    # no valid trace: no traced corpus, said in a tag (a corpus file must hold notes)
    assert run.data.tags["mistill.generate.traced_notes"] == "none"
    assert "mistill.data_dir" not in run.data.tags


def test_generate_resumes_a_crashed_run_without_redoing_notes(tracking_uri, tmp_path, monkeypatch,
                                                              scripted):
    model, script, _ = scripted
    prep = _prepare(tmp_path / "root", monkeypatch)
    notes = [n.note_id for n in load_prepared(prep).corpus.notes]
    cfg = GenerateConfig(prepare_run=prep, model=model, max_new_tokens=64, batch_size=1)
    real = generate_stage.generation_record
    calls = []

    def crash_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash during the second note")
        return real(*args, **kwargs)

    monkeypatch.setattr(generate_stage, "generation_record", crash_on_second)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_generate(cfg)
    monkeypatch.setattr(generate_stage, "generation_record", real)
    client = MlflowClient()
    exp = client.get_experiment_by_name(f"mistill/{load_prepared(prep).corpus.name}").name
    failed = runs_of(exp, stage="generate")
    assert list(failed["status"]) == ["FAILED"]
    run_id = failed["run_id"].iloc[0]
    first = tmp_path / "root" / "work" / run_id / "notes" / notes[0]
    assert (first / "_DONE").is_file() and not (first.parent / notes[1]).exists()
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}

    assert run_generate(cfg) == run_id  # resumed under the same id
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == mtimes  # not redone
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["n_notes"] == 3
    assert run.data.metrics["valid_rate"] == 1.0
    assert len(runs_of(exp, stage="generate")) == 1
    assert [n.teacher_trace for n in load_prepared(run_id).corpus.notes] == [script] * 3


def _restricted_prepare(tmp_path, name: str, syn: Corpus) -> str:
    """A prepare run of ``syn``'s notes marked restricted (MISTILL_ROOT already set)."""
    path = Corpus(name="shaped", privacy="restricted", notes=syn.notes,
                  inventory=syn.inventory).to_jsonl(tmp_path / "restricted.jsonl")
    codes = tmp_path / "codes.txt"
    codes.write_text("\n".join(syn.inventory.codes) + "\n")
    return run_prepare(PrepareConfig(corpus=str(path), corpus_name=name, privacy="restricted",
                                     codes_file=str(codes), model=TINY))


def test_restricted_resume_reads_finished_traces_from_the_enclave_checked(tracking_uri, tmp_path,
                                                                          monkeypatch, scripted):
    """A restricted run that crashed resumes from the traces in its enclave, each checked against
    the sha256 its note's _DONE recorded: a trace changed meanwhile is refused."""
    model, script, _ = scripted
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    syn = make_synthetic_corpus(n_notes=3, seed=0)
    prep = _restricted_prepare(tmp_path, unique("restricted-res"), syn)
    cfg = GenerateConfig(prepare_run=prep, model=model, max_new_tokens=64, batch_size=1)
    real = generate_stage.generation_record
    calls = []

    def crash_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash during the second note")
        return real(*args, **kwargs)

    monkeypatch.setattr(generate_stage, "generation_record", crash_on_second)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_generate(cfg)
    monkeypatch.setattr(generate_stage, "generation_record", real)
    exp = f"mistill/{load_prepared(prep).corpus.name}"
    run_id = runs_of(exp, stage="generate")["run_id"].iloc[0]
    first = syn.notes[0].note_id
    trace = tmp_path / "root" / "work" / run_id / "enclave" / "notes" / first / "trace.txt"
    assert trace.read_text() == script
    assert not any(a.endswith("trace.txt") for a in artifact_paths(MlflowClient(), run_id))

    trace.write_text(script + " changed")
    with pytest.raises(MistillInputError) as err:
        run_generate(cfg)
    msg = str(err.value)
    assert run_id in msg and f"note {first}" in msg and "trace.txt" in msg and "sha256" in msg

    trace.write_text(script)
    assert run_generate(cfg) == run_id  # resumed under the same id, the first trace from the enclave
    assert MlflowClient().get_run(run_id).info.status == "FINISHED"
    assert [n.teacher_trace for n in load_prepared(run_id).corpus.notes] == [script] * 3


def test_restricted_generated_text_never_reaches_the_server(tracking_uri, tmp_path, monkeypatch,
                                                            scripted):
    model, script, code = scripted
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    syn = make_synthetic_corpus(n_notes=2, seed=0)
    name = unique("restricted-gen")
    prep = _restricted_prepare(tmp_path, name, syn)
    run_id = run_generate(GenerateConfig(prepare_run=prep, model=model, max_new_tokens=64))
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.privacy"] == "restricted"
    assert run.data.metrics["valid_rate"] == 1.0 and run.data.metrics["n_traced_notes"] == 2
    arts = artifact_paths(client, run_id)
    assert not any(a.endswith("trace.txt") for a in arts)
    assert "data/corpus.jsonl" not in arts and "generations.csv" in arts
    # the traces are local files of the run's enclave (both tags name it), recorded in _DONE,
    # read back through RunReader; and they are in the local traced corpus
    enclave = Path(run.data.tags["mistill.enclave_dir"])
    assert run.data.tags["mistill.generate.enclave_dir"] == str(enclave)
    texts = sorted(p.read_text() for p in enclave.glob("notes/*/trace.txt"))
    assert texts == [script, script]
    done = json_artifact(client, run_id, f"notes/{syn.notes[0].note_id}/_DONE", tmp_path / "done")
    assert "trace.txt" in done["local_files"] and "trace.txt" not in done["files"]
    reader = RunReader(run_id)
    assert reader.note_file("notes", syn.notes[0].note_id, "trace.txt").read_text() == script
    traced = load_prepared(run_id)
    assert [n.teacher_trace for n in traced.corpus.notes] == [script, script]
    record = json_artifact(client, run_id, f"notes/{syn.notes[0].note_id}/generation.json", tmp_path)
    assert record["codes"] == [code]

    needles = phrase_needles(SECRET, 4)
    places = list(tracked_texts(client, f"mistill/{name}", tmp_path / "dl-restricted",
                                stages=["generate"]))
    assert any(w.endswith("generations.csv") for w, _ in places)
    assert leaks(places, needles) == []
    # control: the same scan finds the generated text in a synthetic corpus's generate run
    prep_syn = _prepare(tmp_path / "root-syn", monkeypatch, n_notes=1)
    syn_run = run_generate(GenerateConfig(prepare_run=prep_syn, model=model, max_new_tokens=64))
    exp = client.get_experiment(client.get_run(syn_run).info.experiment_id).name
    found = leaks(tracked_texts(client, exp, tmp_path / "dl-syn", stages=["generate"]), needles)
    assert any("trace.txt" in f for f in found), found
