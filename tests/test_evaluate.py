"""M1 and teacher-trace perplexity against direct computations, and the ``evaluate`` stage end to
end on the real MLflow server with a tiny model: predictions, flags, per-note metrics, fidelity,
M1, reuse and per-note resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from mistill.data.synthetic import make_synthetic_corpus
from mistill.evaluation.m1 import m1_summary, note_margins, teacher_forced_readouts, trace_perplexity
from mistill.instrument.events import extract_events, margin, realize_events
from mistill.models.loading import load_model
from mistill.stages.common import note_input
from stage_fixtures import TINY, artifact_paths, unique


def test_m1_summary_on_hand_built_events():
    rows = [{"kind": "P1", "margin": 2.0}, {"kind": "P1", "margin": -1.0}, {"kind": "P1", "margin": 0.0},
            {"kind": "P2C", "margin": -0.5}, {"kind": "NULL", "margin": 9.0}]
    out = m1_summary(rows)
    assert out["m1/P1/p_pos"] == pytest.approx(1 / 3)  # a zero margin is not positive
    assert out["m1/P1/median_margin"] == 0.0 and out["m1/P1/n"] == 3.0
    assert out["m1/P2C/p_pos"] == 0.0 and out["m1/P2C/median_margin"] == -0.5
    assert out["m1/P2/n"] == 0.0 and "m1/P2/p_pos" not in out  # no events: no rate
    assert not any(k.startswith("m1/NULL") for k in out)


@pytest.fixture(scope="module")
def tiny_note():
    corpus = make_synthetic_corpus(n_notes=1, seed=3)
    lm = load_model("tiny:qwen3:seed=2")
    ni = note_input(corpus.notes[0], corpus.inventory, lm.tokenizer)
    return corpus, lm, ni


def test_note_margins_equal_full_forward_margins(tiny_note):
    corpus, lm, ni = tiny_note
    codes = list(corpus.inventory.codes)
    rows = note_margins(lm, ni, codes)
    assert rows and {r["kind"] for r in rows} <= {"P1", "P2", "P2C"}
    events = [e for e in extract_events(ni.note.note_id, ni.trace, codes, tokenizer=lm.tokenizer, n_null=0)]
    realized = realize_events(events, full_text=ni.full_text, trace_offset=ni.trace_offset, tokenizer=lm.tokenizer,
                              input_ids=ni.input_ids.tolist(), offsets=ni.offsets, codes=codes)
    with torch.no_grad():
        logits = lm.model(input_ids=ni.input_ids.unsqueeze(0)).logits[0].float()
    want = {r.event.event_id: float(margin(logits[r.position], r.target_id, list(r.competitor_ids)))
            for r in realized}
    for r in rows:
        assert r["margin"] == pytest.approx(want[r["event_id"]], abs=1e-4)


def test_trace_perplexity_equals_the_mean_cross_entropy(tiny_note):
    _, lm, ni = tiny_note
    from mistill.distill.note_data import first_trace_token

    ts = first_trace_token(ni.offsets, ni.trace_offset)
    with torch.no_grad():
        logits = lm.model(input_ids=ni.input_ids.unsqueeze(0)).logits[0].float()
    nll = torch.nn.functional.cross_entropy(logits[ts - 1:-1], ni.input_ids[ts:])
    assert trace_perplexity(lm, ni.input_ids, ts, chunk=7) == pytest.approx(math.exp(float(nll)), rel=1e-4)


def test_teacher_forced_readouts_share_one_forward(tiny_note):
    corpus, lm, ni = tiny_note
    from mistill.distill.note_data import first_trace_token

    codes = list(corpus.inventory.codes)
    ts = first_trace_token(ni.offsets, ni.trace_offset)
    calls = []
    handle = lm.model.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        ppl, rows = teacher_forced_readouts(lm, ni, codes, ts)
    finally:
        handle.remove()
    assert len(calls) == 1
    assert rows and ppl == pytest.approx(trace_perplexity(lm, ni.input_ids, ts), rel=1e-6)
    alone = note_margins(lm, ni, codes)
    assert [r["event_id"] for r in rows] == [r["event_id"] for r in alone]
    for a, b in zip(rows, alone):
        assert a["margin"] == pytest.approx(b["margin"], abs=1e-5)


def test_evaluate_stage_end_to_end(tracking_uri, tmp_path, monkeypatch, pinned_code_version):
    from mistill.stages.evaluate import EvaluateConfig, run_evaluate
    from mistill.stages.prepare import PrepareConfig, run_prepare

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    name = unique("eval")
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=4, model=TINY))
    cfg = EvaluateConfig(prepare_run=prep, model=TINY, arm="untrained", split="", max_new_tokens=6)
    run_id = run_evaluate(cfg)
    client = MlflowClient()
    run = client.get_run(run_id)
    m, tags = run.data.metrics, run.data.tags
    assert tags["mistill.stage"] == "evaluate" and tags["mistill.arm"] == "untrained"
    assert tags["mistill.input.prepare"] == prep and "mistill.input.train" not in tags
    assert tags["mistill.split"] == "all"  # split "" reads every note; the report filters on this tag
    # a 6-token cap cuts every thinking generation: counted as capped and invalid, never a crash
    assert m["n_notes"] == 4 and m["cap_rate"] == 1.0 and m["valid_rate"] == 0.0 and m["micro_f1"] == 0.0
    assert m["mean_generated_tokens"] == 6.0
    assert m["fidelity/ppl_median"] > 1.0 and 0.0 <= m["fidelity/bleu4_mean"] <= 1.0
    assert m["m1/P1/n"] > 0 and 0.0 <= m["m1/P1/p_pos"] <= 1.0
    paths = artifact_paths(client, run_id)
    assert {"per_note_metrics.csv", "predictions.jsonl", "metrics.json"} <= {p.rsplit("/", 1)[-1] for p in paths}
    got = client.download_artifacts(run_id, "predictions.jsonl", str(tmp_path))
    preds = [json.loads(line) for line in open(got).read().splitlines()]
    assert len(preds) == 4 and all(p["capped"] and not p["valid"] and p["codes"] == [] for p in preds)
    seeds = [p["seed"] for p in preds]
    assert len(set(seeds)) == 4  # one sampling seed per note
    import pandas as pd

    per_note = pd.read_csv(client.download_artifacts(run_id, "per_note_metrics.csv", str(tmp_path)))
    assert list(per_note.columns[:2]) == ["note_id", "micro_f1"]
    assert {"tp", "fp", "fn", "valid", "ppl", "bleu4", "m1_P1_p_pos"} <= set(per_note.columns)
    assert np.median(per_note["ppl"]) == pytest.approx(m["fidelity/ppl_median"])
    # synthetic corpus: the generations are artifacts; an identical second call reuses the run
    assert any(p.endswith("generation.txt") for p in paths)
    assert run_evaluate(cfg) == run_id


def test_evaluate_resumes_without_redoing_finished_notes(tracking_uri, tmp_path, monkeypatch, pinned_code_version):
    """A run that crashed during its readouts is resumed: the notes are not sampled again (each
    sample was staged as it arrived) and the notes written before the crash are not read again."""
    import mistill.stages.evaluate as ev
    from mistill.evaluation.backends import HFBackend
    from mistill.stages.prepare import PrepareConfig, run_prepare

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("evres"), n_notes=4, model=TINY))
    cfg = ev.EvaluateConfig(prepare_run=prep, model=TINY, arm="untrained", split="", max_new_tokens=4,
                            fidelity=False)
    sampled: list[int] = []
    real_many = HFBackend.generate_many

    def counting_many(self, items):
        sampled.extend(seed for _, seed in items)
        return real_many(self, items)
    monkeypatch.setattr(HFBackend, "generate_many", counting_many)
    read: list[str] = []
    real_record = ev.generation_record

    def crashing_record(note, gen, index):
        read.append(note.note_id)
        if len(read) == 3:
            raise KeyboardInterrupt("simulated crash")
        return real_record(note, gen, index)
    monkeypatch.setattr(ev, "generation_record", crashing_record)
    with pytest.raises(KeyboardInterrupt):
        ev.run_evaluate(cfg)
    assert len(sampled) == 4 and len(read) == 3  # every note sampled in one call, then the crash
    sampled.clear()
    read.clear()
    monkeypatch.setattr(ev, "generation_record", lambda *a: (read.append(a[0].note_id), real_record(*a))[1])
    run_id = ev.run_evaluate(cfg)
    assert sampled == []  # the staged samples were read back, not drawn again
    assert len(read) == 2  # the two notes written before the crash were not read again
    run = MlflowClient().get_run(run_id)
    assert run.data.metrics["n_notes"] == 4 and run.data.tags["mistill.backend"] == "hf"


def test_restricted_generations_are_local_files_of_the_enclave(tracking_uri, tmp_path, monkeypatch,
                                                               pinned_code_version):
    """For a restricted corpus each generation is a local file of the run's enclave, recorded in
    its note's _DONE, read back through RunReader, and never an artifact."""
    from mistill.data.corpus import Corpus
    from mistill.errors import MistillInputError
    from mistill.stages.common import RunReader
    from mistill.stages.evaluate import EvaluateConfig, run_evaluate
    from mistill.stages.prepare import PrepareConfig, run_prepare

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    syn = make_synthetic_corpus(n_notes=2, seed=0)
    path = Corpus(name="shaped", privacy="restricted", notes=syn.notes,
                  inventory=syn.inventory).to_jsonl(tmp_path / "restricted.jsonl")
    codes = tmp_path / "codes.txt"
    codes.write_text("\n".join(syn.inventory.codes) + "\n")
    prep = run_prepare(PrepareConfig(corpus=str(path), corpus_name=unique("eval-restricted"), privacy="restricted",
                                     codes_file=str(codes), model=TINY))
    run_id = run_evaluate(EvaluateConfig(prepare_run=prep, model=TINY, arm="untrained", split="",
                                         max_new_tokens=6, fidelity=False))
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["n_notes"] == 2
    paths = artifact_paths(client, run_id)
    assert not any(p.endswith("generation.txt") for p in paths)
    enclave = tmp_path / "root" / "work" / run_id / "enclave"
    assert run.data.tags["mistill.enclave_dir"] == str(enclave.resolve())
    reader = RunReader(run_id)
    for note in syn.notes:
        local = enclave / "notes" / note.note_id / "generation.txt"
        assert local.is_file() and f"notes/{note.note_id}/prediction.json" in paths
        done = json.loads(open(client.download_artifacts(run_id, f"notes/{note.note_id}/_DONE",
                                                         str(tmp_path / note.note_id))).read())
        assert set(done["local_files"]) == {"generation.txt"} and "generation.txt" not in done["files"]
        assert reader.note_file("notes", note.note_id, "generation.txt").read_text() == local.read_text()
    local.write_text(local.read_text() + " changed")
    with pytest.raises(MistillInputError, match="sha256"):
        RunReader(run_id).note_file("notes", syn.notes[-1].note_id, "generation.txt")
