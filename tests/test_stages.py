"""The stages end to end on a real MLflow server with random tiny Qwen3 models: the pipeline's
runs, tags, lineage, artifacts and metrics; reuse of identical runs; per-note resume after a
SIGKILL; the privacy guard against a planted canary; ``mlflow run``; the generated MLproject;
and the errors bad input gives on the command line."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import optuna
import pytest
from mlflow.tracking import MlflowClient

from mistill.data.corpus import Corpus
from mistill.data.synthetic import make_synthetic_corpus
from mistill.stages.characterize import KnockinStageConfig
from mistill.stages.common import load_prepared
from mistill.stages.mlproject import render
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.stages.registry import stages
from mistill.stages.workflow import PipelineConfig, pipeline_steps, run_step
from mistill.tracking.figure_html import figure_json, plotly_js_of
from stage_fixtures import (CANARY_ID, CANARY_SENTENCE, REPO, SLOW_TINY, SMALL, TINY, TINY_HEADS, artifact_paths,
                            freeze_source, leaks, n_runs, phrase_needles, planted_corpus, runs_of,
                            subprocess_env, tracked_texts, unique)

STEPS = ("prepare", "events", "attribute", "knockin")
STUDENT = "tiny:qwen3:seed=2:d_model=8"
"""The students these tests train: a narrow residual stream keeps their steps and logged models small."""
INPUT_OF = {"events": "prepare", "attribute": "events", "knockin": "attribute"}

pytestmark = pytest.mark.usefixtures("pinned_code_version")


@pytest.fixture(scope="module")
def pipeline(tracking_uri: str, tmp_path_factory: pytest.TempPathFactory, pinned_code_version):
    """One inline pipeline on 3 synthetic notes with the tiny model, in its own experiment."""
    root = tmp_path_factory.mktemp("stages-root")
    name = unique("syn")
    cfg = PipelineConfig(corpus="synthetic", corpus_name=name, n_notes=3, teacher_split="", **SMALL)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MISTILL_ROOT", str(root))
        t0 = time.monotonic()
        ids = pipeline_steps(cfg)
        elapsed = time.monotonic() - t0
    return {"cfg": cfg, "ids": ids, "root": root, "corpus": name,
            "experiment": f"mistill/{name}", "seconds": elapsed}


# ---------------------------------------------------------------------------- 1. pipeline
def test_pipeline_runs_tags_lineage_artifacts_metrics(pipeline, monkeypatch, tmp_path):
    monkeypatch.setenv("MISTILL_ROOT", str(pipeline["root"]))
    client = MlflowClient()
    ids, exp, corpus = pipeline["ids"], pipeline["experiment"], pipeline["corpus"]
    assert list(ids) == list(STEPS) == pipeline["cfg"].step_names()  # the pipeline's step counter counts these
    assert len(set(ids.values())) == 4
    # what each run computed and what the experiment holds, on their pages in the UI
    note = client.get_run(ids["attribute"]).data.tags["mlflow.note.content"]
    assert note.startswith("**attribute**: attribution pass") and f"events run `{ids['events']}`" in note
    assert f"corpus `{corpus}`" in note and "config.json" in note
    about = client.get_experiment_by_name(exp).tags["mlflow.note.content"]
    assert f"corpus `{corpus}`" in about and "report" in about

    for step in STEPS:
        found = runs_of(exp, stage=step, corpus=corpus)
        assert list(found["run_id"]) == [ids[step]], step
        assert found["status"].iloc[0] == "FINISHED"
        run = client.get_run(ids[step])
        tags = run.data.tags
        assert tags["mistill.entry_point"] == step
        assert tags["mistill.model"] == TINY
        assert tags["mistill.privacy"] == "synthetic"
        assert tags["mistill.corpus_digest"] == load_prepared(ids["prepare"]).corpus.digest
        lineage = {k: v for k, v in tags.items() if k.startswith("mistill.input.")}
        want = {f"mistill.input.{INPUT_OF[step]}": ids[INPUT_OF[step]]} if step in INPUT_OF else {}
        assert lineage == want, step
        # config.json: the typed arguments and the same lineage
        cfg = json.loads(Path(mlflow.artifacts.download_artifacts(
            run_id=ids[step], artifact_path="config.json", dst_path=str(tmp_path / step))).read_text())
        assert cfg["stage"] == step and cfg["run_id"] == ids[step]
        assert cfg["inputs"] == ({INPUT_OF[step]: ids[INPUT_OF[step]]} if step in INPUT_OF else {})
    assert json.loads(client.get_run(ids["events"]).data.params["n_null"]) == 4

    notes = [n.note_id for n in load_prepared(ids["prepare"]).corpus.notes]
    assert len(notes) == 3
    arts = {step: artifact_paths(client, ids[step]) for step in STEPS}
    assert {"config.json", "data/inventory.json", "data/corpus.jsonl", "corpus_index.csv",
            "corpus_index.md"} <= arts["prepare"]
    assert {"margin_audit.md", "margin_audit.csv", "event_counts.csv", "event_counts.md",
            "coverage.csv"} <= arts["events"]
    for note in notes:
        for f in ("events.jsonl", "realized.jsonl", "coverage.json", "_DONE"):
            assert f"notes/{note}/{f}" in arts["events"]
        assert f"notes/{note}/attribution.npz" in arts["attribute"]
        assert {f"notes/{note}/necessity.jsonl", f"notes/{note}/knockin.jsonl"} <= arts["knockin"]
    assert "head_sets.json" in arts["attribute"]
    assert {"sets_table.csv", "sets_table.md", "sets_table.tex", "recovery_vs_k.html"} <= arts["knockin"]

    # the corpus index lists the notes (ids and codes, no text)
    index = Path(mlflow.artifacts.download_artifacts(run_id=ids["prepare"], artifact_path="corpus_index.csv",
                                                     dst_path=str(tmp_path / "idx"))).read_text()
    assert index.splitlines()[0].split(",")[:3] == ["note_id", "patient_id", "split"]
    assert [line.split(",")[0] for line in index.splitlines()[1:]] == notes

    # head_sets.json: every phase ranks all n_layers * n_heads heads, each exactly once
    sets = json.loads(Path(mlflow.artifacts.download_artifacts(
        run_id=ids["attribute"], artifact_path="head_sets.json", dst_path=str(tmp_path / "hs"))).read_text())
    geom = sets["meta"]["geometry"]
    assert geom["n_layers"] * geom["n_heads"] == sets["meta"]["n_heads"] == TINY_HEADS
    phases = [p for p in ("P1", "P2", "P2C") if p in sets]
    assert "P1" in phases
    for p in phases:
        assert len(sets[p]["ranking"]) == len(set(sets[p]["ranking"])) == TINY_HEADS
        assert sets[p]["importance_c"] == sorted(sets[p]["importance_c"], reverse=True)

    # the recovery figure opens offline: plotly.js travels inside it (gzip, base64), not from a CDN
    fig = Path(mlflow.artifacts.download_artifacts(run_id=ids["knockin"], artifact_path="recovery_vs_k.html",
                                                   dst_path=str(tmp_path / "fig"))).read_text()
    assert plotly_js_of(fig).startswith(b"/**") and b"plotly.js v" in plotly_js_of(fig)[:200]
    assert figure_json(fig)["data"] and len(fig) < 2_500_000
    assert not re.search(r"<script[^>]+src=[\"']https?://", fig)

    m = {step: client.get_run(ids[step]).data.metrics for step in STEPS}
    assert m["prepare"]["n_notes"] == 3
    assert m["events"]["events/P1/realized"] > 0
    assert m["events"]["n_notes"] == 3
    assert "calib/split_half/discoveries_pos" in m["attribute"]
    assert m["attribute"]["calib/P1/n_notes"] == 3
    for k in (3, 8):
        assert f"P1/k{k}/necessity/global" in m["knockin"]
    assert not any(key.startswith("P1/k16") for key in m["knockin"])  # only the k_bins asked for
    # The random tiny model's margin gaps stay below the default range gate (1.0), so no event is
    # gated and recovery is NaN (not logged); the pipeline does not expose range_gate. A knock-in
    # on the same attribute run with range_gate=0 gates the events and logs recovery.
    assert "P1/k3/recovery/global" not in m["knockin"]
    before = n_runs(pipeline["experiment"])
    gated = run_step("knockin", KnockinStageConfig(attribute_run=ids["attribute"], k_bins=(3, 8),
                                                   events_per_phase=3, range_gate=0.0),
                     corpus, launch="inline")
    assert gated != ids["knockin"]
    assert n_runs(pipeline["experiment"]) == before + 1
    gm = client.get_run(gated).data.metrics
    assert "P1/k3/recovery/global" in gm and gm["P1/k3/recovery/global"] == gm["P1/k3/recovery/global"]
    assert client.get_run(gated).data.tags["mistill.input.attribute"] == ids["attribute"]


def test_metric_names_use_slash_never_dot(pipeline):
    """Every metric the pipeline's stages logged names its parts with '/' (MLflow's UI groups a
    run's charts by the part before it), never with '.'."""
    client = MlflowClient()
    names = {step: set(client.get_run(pipeline["ids"][step]).data.metrics) for step in STEPS}
    assert all(names.values())
    assert {step: sorted(k for k in keys if "." in k) for step, keys in names.items()} == \
        {step: [] for step in STEPS}
    assert "events/P1/realized" in names["events"] and "calib/P1/n_notes" in names["attribute"]
    assert any(k.startswith("stability/") or k.startswith("sparsity/") for k in names["attribute"])
    assert "P1/k3/necessity/global" in names["knockin"]


# ------------------------------------------------------------------------------- 2. reuse
def test_identical_pipeline_reuses_every_run(pipeline, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(pipeline["root"]))
    before = n_runs(pipeline["experiment"])
    t0 = time.monotonic()
    again = pipeline_steps(pipeline["cfg"])
    assert again == pipeline["ids"]
    assert n_runs(pipeline["experiment"]) == before
    assert time.monotonic() - t0 < pipeline["seconds"]  # nothing was recomputed


# ---------------------------------------------------------------------- 3. one param changed
def test_changed_param_reuses_prepare_and_reruns_events(pipeline, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(pipeline["root"]))
    exp = pipeline["experiment"]
    before = {step: set(runs_of(exp, stage=step)["run_id"]) for step in STEPS}
    changed = pipeline_steps(dataclasses.replace(pipeline["cfg"], n_null=5))
    assert changed["prepare"] == pipeline["ids"]["prepare"]
    for step in ("events", "attribute", "knockin"):
        assert changed[step] not in before[step], step
        assert set(runs_of(exp, stage=step)["run_id"]) == before[step] | {changed[step]}, step
    assert set(runs_of(exp, stage="prepare")["run_id"]) == before["prepare"]
    client = MlflowClient()
    assert client.get_run(changed["events"]).data.tags["mistill.input.prepare"] == changed["prepare"]
    assert json.loads(client.get_run(changed["events"]).data.params["n_null"]) == 5
    assert client.get_run(changed["events"]).info.status == "FINISHED"


# ---------------------------------------------------------------------- 4. resume after kill
def test_events_resume_after_sigkill_keeps_finished_notes(tracking_uri, tmp_path, monkeypatch):
    root = tmp_path / "root"
    monkeypatch.setenv("MISTILL_ROOT", str(root))
    name = unique("resume")
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=5, model=TINY))
    notes = [n.note_id for n in load_prepared(prep).corpus.notes]
    first = notes[0]
    frozen = freeze_source(tmp_path / "src")
    cmd = [sys.executable, "projects/events.py", "--prepare_run", prep, "--model", SLOW_TINY,
           "--n_null", "4"]
    env = subprocess_env(tracking_uri, root)
    log1 = tmp_path / "events-1.log"
    with log1.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=frozen, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 90
            while True:
                hits = list((root / "work").glob(f"*/notes/{first}/_DONE"))
                if hits:
                    break
                assert proc.poll() is None, f"events exited {proc.returncode}:\n{log1.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "no note finished within 90 s"
                time.sleep(0.01)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    run_dir = hits[0].parents[2]
    run_id = run_dir.name
    done_at_kill = {p.parent.name for p in run_dir.glob("notes/*/_DONE")}
    assert first in done_at_kill
    assert done_at_kill < set(notes), "the stage finished every note before the kill: make notes slower"
    client = MlflowClient()
    assert client.get_run(run_id).info.status == "RUNNING"  # killed: nobody ended the run
    first_dir = run_dir / "notes" / first
    mtimes = {p.name: p.stat().st_mtime_ns for p in first_dir.iterdir() if not p.name.startswith(".")}
    assert {"events.jsonl", "realized.jsonl", "coverage.json", "_DONE"} <= set(mtimes)

    again = subprocess.run(cmd, cwd=frozen, env=env, capture_output=True, text=True, timeout=150)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"mistill events: run {run_id}" in again.stdout
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    events_runs = runs_of(f"mistill/{name}", stage="events")
    assert list(events_runs["run_id"]) == [run_id]  # resumed under the same id, no new run
    assert {p.name: p.stat().st_mtime_ns for p in first_dir.iterdir()
            if not p.name.startswith(".")} == mtimes  # the finished note was not redone
    arts = artifact_paths(client, run_id)
    for note in notes:
        assert (run_dir / "notes" / note / "_DONE").is_file(), note
        assert f"notes/{note}/_DONE" in arts and f"notes/{note}/realized.jsonl" in arts, note
    assert run.data.metrics["n_notes"] == len(notes)
    assert run.data.metrics["events/P1/realized"] > 0


# --------------------------------------------------------------------------- 5. privacy canary


# Regression: prepare once refused its own index, dataset and inventory.json for a restricted
# corpus whose traces list the gold codes and quote inventory descriptions (label codes and
# descriptions are public; see mistill.tracking.privacy).
def test_restricted_prepare_of_synthetic_shaped_notes(tracking_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    syn = make_synthetic_corpus(n_notes=3, seed=0)
    path = Corpus(name="shaped", privacy="restricted", notes=syn.notes,
                  inventory=syn.inventory).to_jsonl(tmp_path / "shaped.jsonl")
    codes = tmp_path / "codes.txt"
    codes.write_text("\n".join(syn.inventory.codes) + "\n")
    run_id = run_prepare(PrepareConfig(corpus=str(path), corpus_name=unique("shaped"),
                                       privacy="restricted", codes_file=str(codes), model=TINY))
    client = MlflowClient()
    assert client.get_run(run_id).info.status == "FINISHED"
    assert {"corpus_index.csv", "data/inventory.json"} <= artifact_paths(client, run_id)


def test_restricted_text_never_reaches_the_server(pipeline, tracking_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    corpus_file, codes_file = planted_corpus(tmp_path)
    assert CANARY_ID in corpus_file.read_text()
    name = unique("restricted")
    # the planted corpus is one training split: the teacher is ranked on all of it
    cfg = PipelineConfig(corpus=str(corpus_file), corpus_name=name, privacy="restricted",
                         codes_file=str(codes_file), teacher_split="", **SMALL)
    ids = pipeline_steps(cfg)
    client = MlflowClient()
    for step in STEPS:
        run = client.get_run(ids[step])
        assert run.info.status == "FINISHED" and run.data.tags["mistill.privacy"] == "restricted"
    prepare_arts = artifact_paths(client, ids["prepare"])
    assert "data/inventory.json" in prepare_arts
    assert not {"data/corpus.jsonl", "data/corpus_meta.json"} & prepare_arts
    assert client.get_run(ids["prepare"]).data.metrics["n_codes_inventory"] == 120
    assert client.get_run(ids["events"]).data.metrics["events/P1/realized"] > 0

    needles = (phrase_needles(CANARY_ID, 3) + phrase_needles(CANARY_SENTENCE, 4)
               + [" 7f3a9c "])
    places = list(tracked_texts(client, f"mistill/{name}", tmp_path / "dl-restricted"))
    where = [w for w, _ in places]
    for step in STEPS:  # the scan saw every run's params, tags, metrics and per-note files
        assert f"{ids[step]} params" in where and f"{ids[step]} artifact config.json" in where
    assert f"{ids['events']} artifact notes/pl-000/realized.jsonl" in where
    assert f"{ids['prepare']} dataset {name}-index" in where
    assert f"{ids['knockin']} artifact recovery_vs_k.html" in where
    assert leaks(places, needles) == []

    # controls: the same scan finds the canary when the same file is marked public ...
    public = unique("public")
    pub = run_prepare(PrepareConfig(corpus=str(corpus_file), corpus_name=public, privacy="public",
                                    codes_file=str(codes_file), model=TINY))
    found_pub = leaks(tracked_texts(client, f"mistill/{public}", tmp_path / "dl-public"), needles)
    assert any(f.startswith(f"{pub} artifact data/corpus.jsonl") for f in found_pub), found_pub
    # ... and finds the synthetic corpus's own text in the synthetic pipeline's prepare run
    monkeypatch.setenv("MISTILL_ROOT", str(pipeline["root"]))
    syn_note = load_prepared(pipeline["ids"]["prepare"]).corpus.notes[0]
    sentence = next(s for s in syn_note.text.splitlines() if len(s.split()) >= 8)
    found_syn = leaks(tracked_texts(client, pipeline["experiment"], tmp_path / "dl-synthetic",
                                    stages=["prepare"]), phrase_needles(sentence, 100))
    assert any("artifact data/corpus.jsonl" in f for f in found_syn), found_syn


# ------------------------------------------------------------------------------- 6. mlflow run
def test_mlflow_run_prepare_entry_point(tracking_uri, tmp_path):
    env = subprocess_env(tracking_uri, tmp_path / "root")
    mlflow_cli = str(Path(sys.executable).parent / "mlflow")
    proc = subprocess.run([mlflow_cli, "run", ".", "-e", "prepare", "--env-manager", "local",
                           "-P", "n_notes=2", "-P", f"model={TINY}",
                           "--experiment-name", "mistill/synthetic"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    launched = re.search(r"Run \(ID '([0-9a-f]{32})'\) succeeded", out)
    assert launched, out[-2000:]
    client = MlflowClient()
    run = client.get_run(launched.group(1))
    assert run.info.status == "FINISHED"
    # the stage adopted the launched run, or (an identical run existed) delegated to it
    target = run.data.tags.get("mistill.delegated_to", run.info.run_id)
    assert re.search(rf"mistill prepare: run {target}\b", out)
    final = client.get_run(target)
    assert final.info.status == "FINISHED"
    assert final.data.tags["mistill.stage"] == "prepare"
    assert final.data.tags["mistill.corpus"] == "synthetic"
    assert client.get_experiment(final.info.experiment_id).name == "mistill/synthetic"
    assert final.data.metrics["n_notes"] == 2
    cfg = json.loads(Path(mlflow.artifacts.download_artifacts(
        run_id=target, artifact_path="config.json", dst_path=str(tmp_path / "cfg"))).read_text())
    assert cfg["config"]["n_notes"] == 2 and isinstance(cfg["config"]["n_notes"], int)
    assert cfg["config"]["model"] == TINY
    assert "data/inventory.json" in artifact_paths(client, target)


def test_mlflow_run_of_a_reused_or_refused_stage_leaves_one_run(tracking_uri, tmp_path):
    """`mlflow run` opens a run before the stage starts: when the stage reuses a finished run, or
    refuses its parameters, that launched run is ended and deleted, so the experiment shows one
    run per piece of work."""
    from mlflow.entities import ViewType

    name = unique("mlrun")
    frozen = freeze_source(tmp_path / "src")
    env = subprocess_env(tracking_uri, tmp_path / "root")
    mlflow_cli = str(Path(sys.executable).parent / "mlflow")

    def launch(*params: str) -> subprocess.CompletedProcess:
        args = [mlflow_cli, "run", ".", "-e", "prepare", "--env-manager", "local",
                "--experiment-name", f"mistill/{name}", "-P", f"corpus_name={name}", "-P", f"model={TINY}"]
        for p in params:
            args += ["-P", p]
        return subprocess.run(args, cwd=frozen, env=env, capture_output=True, text=True, timeout=240)

    first = launch("n_notes=2")
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    second = launch("n_notes=2")
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert "reusing finished run" in second.stdout + second.stderr
    refused = launch("n_notes=0")
    assert refused.returncode != 0
    assert "n_notes" in refused.stderr
    client = MlflowClient()
    exp = client.get_experiment_by_name(f"mistill/{name}")
    deadline = time.monotonic() + 30  # the launched runs are deleted once `mlflow run` ended them
    while True:
        active = client.search_runs([exp.experiment_id], run_view_type=ViewType.ACTIVE_ONLY)
        if len(active) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(r.info.status, r.data.tags.get("mistill.stage")) for r in active] == [("FINISHED", "prepare")]
    every = client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL)
    assert len(every) == 3  # the launched runs of the reuse and of the refusal are deleted
    assert all(r.info.lifecycle_stage == "deleted" for r in every if r.info.run_id != active[0].info.run_id)


# ------------------------------------------------------------------------------- 7. MLproject
def test_mlproject_is_generated_from_the_registry():
    assert (REPO / "MLproject").read_text() == render(), \
        "MLproject is stale: regenerate it with `python -m mistill.stages.mlproject`"
    for name in stages():
        script = REPO / "projects" / f"{name}.py"
        assert script.is_file(), script
        assert f'main("{name}")' in script.read_text()


# ----------------------------------------------------------------------------- 8. bad input
def test_malformed_corpus_and_unknown_parameter_exit_2(tracking_uri, tmp_path):
    env = subprocess_env(tracking_uri, tmp_path / "root")
    bad = tmp_path / "bad.jsonl"
    good = {"note_id": "n1", "patient_id": "p1", "split": "train", "text": "Patient well.",
            "gold_codes": ["I10"]}
    bad.write_text(json.dumps(good) + "\n" + '{"note_id": "n2", "patient_id": \n')
    proc = subprocess.run([sys.executable, "projects/prepare.py", "--corpus", str(bad),
                           "--privacy", "restricted"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"file {bad} line 2" in proc.stderr
    assert "malformed JSON" in proc.stderr
    assert "Traceback" not in proc.stderr

    proc = subprocess.run([sys.executable, "projects/prepare.py", "--n_notez", "3"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown parameter(s) ['n_notez']" in proc.stderr
    assert "field 'n_notez'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_note_field_names_file_line_note_and_field(tracking_uri, tmp_path, monkeypatch, capsys):
    from mistill.stages.cli import main

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    bad = tmp_path / "codes-bad.jsonl"
    rows = [{"note_id": "n1", "patient_id": "p1", "split": "train", "text": "Patient well.",
             "gold_codes": ["I10"]},
            {"note_id": "n2", "patient_id": "p2", "split": "train", "text": "Patient well.",
             "gold_codes": ["I10", "NOT.A.CODE"]}]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit) as exc:
        main("prepare", ["--corpus", str(bad), "--privacy", "restricted"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"file {bad} line 2" in err and "note n2" in err and "field 'gold_codes'" in err

    with pytest.raises(SystemExit) as exc:
        main("prepare", ["--n_notes", "three"])
    assert exc.value.code == 2
    assert "field 'n_notes'" in capsys.readouterr().err


def test_inline_step_without_a_required_input_fails_before_any_run(tracking_uri, tmp_path, monkeypatch):
    """``run_step`` checks the stage's required inputs as the command line does: an inline
    ``events`` step without ``prepare_run`` is refused, naming the field, and no experiment or
    run is made."""
    from mistill.errors import MistillInputError
    from mistill.stages.characterize import EventsConfig

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    name = unique("noinput")
    with pytest.raises(MistillInputError, match=r"prepare_run is required: the run id of a `prepare` run") as err:
        run_step("events", EventsConfig(model=TINY), name, launch="inline")
    assert err.value.field == "prepare_run"
    assert MlflowClient().get_experiment_by_name(f"mistill/{name}") is None


# ------------------------------------------------------------------- distillation stages
def test_distillation_steps_train_and_register(pipeline, monkeypatch):
    """Student ranked on its validation note, teacher targets on the training notes, Vanilla CoT-KD
    and Mistill trained one step each, checkpoints registered with an alias per arm and seed."""
    from mistill.stages.workflow import distill_steps

    monkeypatch.setenv("MISTILL_ROOT", str(pipeline["root"]))
    cfg = pipeline["cfg"].replace(train_arms=("vanilla-bf16", "mistill"), student=STUDENT,
                                  train_max_steps=1, train_grad_accum=1, select_lock="")
    ids = distill_steps(cfg, pipeline["ids"], pipeline["corpus"], None)
    client = MlflowClient()
    assert set(ids) == {"student_events", "student_attribute", "targets", "train_vanilla-bf16", "train_mistill"}
    for run_id in ids.values():
        assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(ids["targets"]).data.tags["mistill.input.teacher_attribute"] == pipeline["ids"]["attribute"]
    # lineage as MLflow dataset inputs too: the corpus index (ids and codes) each stage read
    for run_id in ids.values():
        inputs = client.get_run(run_id).inputs.dataset_inputs
        assert [d.dataset.name for d in inputs] == [f"{pipeline['corpus']}-index"]
    mistill = client.get_run(ids["train_mistill"])
    vanilla = client.get_run(ids["train_vanilla-bf16"])
    assert mistill.data.tags["mistill.arm"] == "mistill" and mistill.data.tags["mistill.precision"] == "bf16"
    # which kernels ran the bf16 matmuls on this CPU (the default cpu_bf16_matmul=auto)
    from mistill.distill.cpu_bf16 import native_bf16
    assert mistill.data.tags["mistill.cpu_bf16_matmul"] == ("native" if native_bf16() else "fp32")
    assert mistill.data.tags["mistill.input.student_attribute"] == ids["student_attribute"]
    assert mistill.data.metrics["train/steps"] == 1
    assert "train/P2/attention" in mistill.data.metrics or "train/P1/attention" in mistill.data.metrics
    assert not any(k.endswith("/attention") for k in vanilla.data.metrics)
    for run in (mistill, vanilla):
        arts = artifact_paths(client, run.info.run_id)
        assert {"arm.json", "event_coverage.csv", "model/MLmodel", "model/model/config.json"} <= arts
        name, alias = run.data.tags["mistill.registered_model"], run.data.tags["mistill.model_alias"]
        version = client.get_model_version_by_alias(name, alias)
        assert version.run_id == run.info.run_id
    assert {mistill.data.tags["mistill.model_alias"], vanilla.data.tags["mistill.model_alias"]} == {
        "mistill-s0", "vanilla-bf16-s0"}
    # a second call reuses every step
    assert distill_steps(cfg, pipeline["ids"], pipeline["corpus"], None) == ids


def test_distillm2_arm_trains_with_the_students_own_generations(pipeline, monkeypatch):
    from mistill.stages.distill import TrainStageConfig, run_train
    from mistill.stages.workflow import distill_steps

    monkeypatch.setenv("MISTILL_ROOT", str(pipeline["root"]))
    cfg = pipeline["cfg"].replace(train_arms=(), student=STUDENT, select_lock="")
    ids = distill_steps(cfg, pipeline["ids"], pipeline["corpus"], None)
    run_id = run_train(TrainStageConfig(targets_run=ids["targets"], student=STUDENT, arm="distillm2",
                                        max_steps=1, grad_accum=1, dispreferred_max_new_tokens=8))
    run = MlflowClient().get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.precision"] == "fp32"
    assert run.data.metrics["train/distillm2/srkl"] > 0
    # the dispreferred generations stay in the local work dir (model text is never logged)
    local = pipeline["root"] / "work" / run_id / "dispreferred"
    assert len(list(local.glob("*.json"))) >= 1
    assert not any(p.startswith("dispreferred") for p in artifact_paths(MlflowClient(), run_id))


def test_selection_evaluation_own_heads_and_report_steps(pipeline, monkeypatch, tmp_path):
    """The pipeline's closing steps on tiny models: a locked 3-cell λ selection whose pick the
    Mistill arm trains with, the LAS simulator, evaluate of teacher / untrained / arms, own-heads
    readouts, and the report, every run linked to what it read."""
    from mistill.stages.workflow import distill_steps, evaluation_steps

    monkeypatch.setenv("MISTILL_ROOT", str(pipeline["root"]))
    lock = tmp_path / "lock.yaml"
    lock.write_text((REPO / "projects/configs/locks/embedded-3cell.yaml").read_text()
                    .replace("study: embedded-3cell", f"study: {unique('study')}")
                    .replace("max_new_tokens: 32", "max_new_tokens: 8")
                    # two grid cells: the pick is always on an edge, so the outward cell runs too
                    .replace("lambda: [0.03, 0.1, 0.3]", "lambda: [0.03, 0.1]"))
    cfg = pipeline["cfg"].replace(train_arms=("vanilla-bf16", "mistill"), student=STUDENT,
                                  train_max_steps=1, train_grad_accum=1, select_lock=str(lock),
                                  las_model="tiny:qwen3", las_max_steps=2, eval_max_new_tokens=8)
    ids = dict(pipeline["ids"])
    ids.update(distill_steps(cfg, ids, pipeline["corpus"], None))
    client = MlflowClient()
    sel = client.get_run(ids["select_lambda"])
    picked = (sel.data.metrics["selected/lambda_p1"], sel.data.metrics["selected/lambda_p2"])
    arm = resolve_arm_of(client.get_run(ids["train_mistill"]))
    assert (arm["lambda_p1"], arm["lambda_p2"]) == pytest.approx(picked)
    # one selected model everywhere: without a probe the arm's training is the picked cell's, so
    # the arm is that cell's run, and the alias, the selection's tags, the study's pick and
    # decision.json all name it
    tags = sel.data.tags
    assert ids["train_mistill"] == tags["mistill.selection.pick_train_run"]
    assert tags["mistill.selection.arm_model"] == tags["mistill.selection.pick_model"]
    assert "mistill.selection.arm_retrained" not in tags
    name, version = tags["mistill.selection.pick_model"].removeprefix("models:/").rsplit("/", 1)
    assert client.get_model_version_by_alias(name, tags["mistill.selection.pick_alias"]).version == version
    decision = json.loads(Path(client.download_artifacts(sel.info.run_id, "decision.json", str(tmp_path))).read_text())
    row = next(r for r in decision["cells"] if r["picked"])
    assert (row["lambda_p1"], row["lambda_p2"]) == pytest.approx(picked)
    study = optuna.load_study(study_name=decision["study"], storage=tags["mistill.selection.storage"])
    pick = study.user_attrs["locked_pick"]
    assert pick["train_run"] == ids["train_mistill"] and pick["cell"] == row["cell"]
    assert study.user_attrs["use_this_trial"].startswith(f"trial {pick['trial']} (cell {row['cell']})")
    assert study.trials[pick["trial"]].params and study.trials[pick["trial"]].state.name == "COMPLETE"
    # the pipeline's gradient-checkpointing setting (off by default) reaches the arms and the cells
    # (the module's other tests train arms of their own in this experiment: only the pipeline's
    # arms and the selection's cells are checked)
    trials = client.search_runs([sel.info.experiment_id], f"tags.mlflow.parentRunId = '{sel.info.run_id}'")
    cells = [r for t in trials for r in client.search_runs(
        [sel.info.experiment_id], f"tags.`mistill.stage` = 'train' and tags.mlflow.parentRunId = '{t.info.run_id}'")]
    trained = cells + [client.get_run(ids["train_mistill"]), client.get_run(ids["train_vanilla-bf16"])]
    assert len(cells) >= 3  # the two grid cells and the outward one at least
    assert {r.data.params["gradient_checkpointing"] for r in trained} == {"false"}
    ev = evaluation_steps(cfg, ids, pipeline["corpus"], None)
    assert {"las_simulator", "evaluate_teacher", "evaluate_untrained", "evaluate_mistill",
            "evaluate_vanilla-bf16", "own_heads_untrained", "own_heads_mistill"} <= set(ev)
    run = client.get_run(ev["evaluate_mistill"])
    assert run.data.tags["mistill.input.train"] == ids["train_mistill"]
    assert run.data.tags["mistill.model_version"] == client.get_run(ids["train_mistill"]).data.tags[
        "mistill.model_version"]
    assert run.data.tags["mistill.input.las"] == ev["las_simulator"] and "fidelity/las_mean" in run.data.metrics
    assert client.get_run(ev["evaluate_teacher"]).data.tags["mistill.arm"] == "teacher"
    own = client.get_run(ev["own_heads_mistill"])
    assert own.data.tags["mistill.input.train"] == ids["train_mistill"]
    from mistill.stages.report import ReportConfig, run_report

    report = client.get_run(run_report(ReportConfig(corpus=pipeline["corpus"])))
    assert report.info.status == "FINISHED"
    assert any(p.endswith(".tex") for p in artifact_paths(client, report.info.run_id))
    text = Path(client.download_artifacts(report.info.run_id, "report.md")).read_text()
    for title in ("Table 11:", "Table 15:", "Table 39:", "Table 40:", "Table 41:", "Table 42:",
                  "Table 47:", "Table 48:", "Table 49:", "Table 50:", "Table 51:",
                  "## Deviations in these runs"):
        assert title in text, title
    # the fixture's Mistill arm has no prose-time set: its P1 window deviation is named
    assert "p1_window_pool=emission" in text


def resolve_arm_of(run) -> dict:
    """The resolved arm flags a train run logged (``arm.json``)."""
    import json as _json

    path = MlflowClient().download_artifacts(run.info.run_id, "arm.json")
    return _json.loads(Path(path).read_text())
