"""Run conventions against a real MLflow server: tags, params, config.json, status, find_run
paging and typed matching, per-note resume, offline figures, and the privacy guard in StageRun."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import mlflow
import pandas as pd
import plotly.graph_objects as go
import pytest
from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.errors import MistillInputError
from mistill.tracking.artifacts import markdown_table
from mistill.tracking.experiments import experiment_for_corpus, resolve_tracking_uri
from mistill.tracking.figure_html import figure_json, plotly_js_of
from mistill.tracking.identity import (RESUMABLE_STATUSES, canonical_params, code_version, find_run, git_commit,
                                       param_string, params_digest, parse_param, typed_equal)
from mistill.tracking.naming import TAG_CODE_VERSION, TAG_ENTRY_POINT, TAG_PARAMS_DIGEST, metric_name
from mistill.tracking.privacy import PrivacyError, PrivacyGuard
from mistill.tracking.runs import StageRun

CANARY = "the zebra canary walked slowly past the violet lighthouse at dawn"
NOTE = f"Discharge summary. Patient admitted with dyspnea. History notable for {CANARY}."
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclasses.dataclass(frozen=True)
class DemoConfig(Config):
    model: str = MODEL
    arm: str = "mistill"
    seed: int = 0
    lam: float = 0.1
    k: int = 40
    note_field: str = "text"
    layers: tuple[int, ...] = (3, 8)


def corpus() -> str:
    return f"c{uuid.uuid4().hex[:10]}"


def open_guard() -> PrivacyGuard:
    return PrivacyGuard([NOTE], "synthetic")


def stage(cfg: Config, name: str, tmp_path: Path, **kw) -> StageRun:
    kw.setdefault("guard", open_guard())
    kw.setdefault("code_version", "v1")
    return StageRun("attribution", cfg, root=tmp_path / ".mistill", **kw)


# ------------------------------------------------------------------------------ pure helpers
def test_typed_params_do_not_collide() -> None:
    a, b, c = {"k": 1}, {"k": 1.0}, {"k": "1"}
    assert len({params_digest(a), params_digest(b), params_digest(c)}) == 3
    assert canonical_params({"b": True, "a": (1, 2.5)}) == '{"a":[1,2.5],"b":true}'
    assert not typed_equal(1, 1.0) and not typed_equal(1, "1") and not typed_equal(True, 1)
    assert typed_equal([1, 2.0, "x"], [1, 2.0, "x"]) and typed_equal(float("nan"), float("nan"))
    assert parse_param(param_string(1)) == 1 and isinstance(parse_param(param_string(1.0)), float)
    assert parse_param(param_string(True)) is True and parse_param("abc") == "abc"
    long = param_string("x" * 7000)
    assert len(long) <= 6000 and "sha256=" in long


def test_code_version_tracks_source_bytes(tmp_path: Path) -> None:
    (tmp_path / "mistill").mkdir()
    (tmp_path / "mistill" / "a.py").write_text("x = 1\n")
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    v1 = code_version(tmp_path)
    (tmp_path / "mistill" / "__pycache__").mkdir()
    (tmp_path / "mistill" / "__pycache__" / "a.pyc").write_bytes(b"\x00")
    (tmp_path / "mistill" / "notes.txt").write_text("ignored")
    assert code_version(tmp_path) == v1
    (tmp_path / "mistill" / "a.py").write_text("x = 2\n")  # dirty tree -> new version
    assert code_version(tmp_path) != v1
    assert len(v1) == 64 and git_commit(tmp_path) is None


def test_markdown_table_by_hand() -> None:
    df = pd.DataFrame({"head": ["L3H1", "L8|H2"], "I_c": [0.123456789, -2.0], "n": [3, 12]})
    assert markdown_table(df, float_format=".3g") == (
        "| head   |   I_c |   n |\n"
        "| ------ | ----: | --: |\n"
        "| L3H1   | 0.123 |   3 |\n"
        "| L8\\|H2 |    -2 |  12 |\n")


def test_metric_name_joins_parts_with_a_slash() -> None:
    assert metric_name("m1", "P2C", "p_pos") == "m1/P2C/p_pos"
    assert metric_name("", "m4", "P1", "k8") == "m4/P1/k8"  # an empty prefix is left out
    assert metric_name("P1", "k8", *"necessity.global".split(".")) == "P1/k8/necessity/global"
    with pytest.raises(MistillInputError, match=r"'fidelity/ppl_median'"):
        metric_name("fidelity.ppl_median")


def test_file_store_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///tmp/mlruns")
    with pytest.raises(MistillInputError, match="not a tracking server"):
        resolve_tracking_uri()


# ------------------------------------------------------------------------- against a server
def test_log_metrics_refuses_a_dotted_name(tracking_uri: str, tmp_path: Path) -> None:
    """A metric name with '.' is refused before anything of the batch is logged, the error
    naming the '/' form; the run goes on and logs well-named metrics."""
    with stage(DemoConfig(), "a", tmp_path, corpus=corpus()) as run:
        with pytest.raises(MistillInputError, match=r"metric name 'm1\.P2C\.p_pos'.*write 'm1/P2C/p_pos'") as err:
            run.log_metrics({"micro_f1": 0.4, "m1.P2C.p_pos": 0.7})
        assert err.value.field == "metric"
        run.log_metrics({"m1/P2C/p_pos": 0.7})
        run_id = run.run_id
    assert MlflowClient().get_run(run_id).data.metrics == {"m1/P2C/p_pos": 0.7}


def test_stage_run_logs_tags_params_config_and_finishes(tracking_uri: str, tmp_path: Path) -> None:
    cfg, c = DemoConfig(), corpus()
    with stage(cfg, "a", tmp_path, corpus=c, inputs={"traces": "run123"},
               corpus_digest="abc", precision="bf16") as run:
        assert mlflow.active_run().info.run_id == run.run_id
        run.log_metrics({"necessity": 0.5, "n_events": 12}, step=2)
        run.log_json("summary", {"ok": True})
        run.log_table("tables/heads", pd.DataFrame({"head": ["L0H1"], "I_c": [0.25]}))
        run_id = run.run_id
        work = run.work_dir
    assert mlflow.active_run() is None
    client = MlflowClient()
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert got.info.run_name == "mistill s0 · attribution · SmolLM2-135M-Instruct"
    tags = got.data.tags
    assert tags["mistill.stage"] == "attribution" and tags["mistill.model"] == MODEL
    assert tags["mistill.corpus"] == c and tags["mistill.corpus_digest"] == "abc"
    assert tags["mistill.privacy"] == "synthetic" and tags["mistill.arm"] == "mistill"
    assert tags["mistill.seed"] == "0" and tags["mistill.precision"] == "bf16"
    assert tags[TAG_CODE_VERSION] == "v1" and tags[TAG_ENTRY_POINT] == "attribution"
    assert tags[TAG_PARAMS_DIGEST] == params_digest(cfg.to_dict())
    assert tags["mistill.input.traces"] == "run123"
    assert got.data.params == {"model": MODEL, "arm": "mistill", "seed": "0", "lam": "0.1",
                               "k": "40", "note_field": "text", "layers": "[3, 8]"}
    assert got.data.metrics == {"necessity": 0.5, "n_events": 12.0}
    exp = client.get_experiment(got.info.experiment_id)
    assert exp.name == f"mistill/{c}" and exp.artifact_location.startswith("mlflow-artifacts:")
    names = {f.path for f in client.list_artifacts(run_id)}
    assert {"config.json", "summary.json", "tables"} <= names
    assert {f.path for f in client.list_artifacts(run_id, "tables")} == {
        "tables/heads.csv", "tables/heads.md"}
    config = json.loads(Path(client.download_artifacts(run_id, "config.json", str(tmp_path))).read_text())
    assert config["config"] == cfg.to_dict() | {"layers": [3, 8]}
    assert config["stage"] == "attribution" and config["inputs"] == {"traces": "run123"}
    assert config["code_version"] == "v1" and config["run_id"] == run_id
    assert "versions" in config and "git_commit" in config
    assert (work / "config.json").is_file()
    assert experiment_for_corpus(c) == f"mistill/{c}"


def test_exception_marks_run_failed(tracking_uri: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="boom"):
        with stage(DemoConfig(), "f", tmp_path, corpus=corpus()) as run:
            run_id = run.run_id
            raise ValueError("boom")
    assert MlflowClient().get_run(run_id).info.status == "FAILED"
    assert mlflow.active_run() is None


def test_find_run_pages_and_matches_typed_values(tracking_uri: str, tmp_path: Path) -> None:
    c, cfg = corpus(), DemoConfig(k=7)
    with stage(cfg, "t", tmp_path, corpus=c, inputs={"traces": "r1"}) as target:
        pass
    for v in ("v2", "v3", "v4"):  # newer decoys: same params digest, other code versions
        with stage(cfg, "d", tmp_path, corpus=c, inputs={"traces": "r1"}, code_version=v):
            pass
    exp, params = f"mistill/{c}", cfg.to_dict()
    found = find_run(exp, "attribution", params, "v1", {"traces": "r1"}, max_results=1)
    assert found is not None and found.info.run_id == target.run_id
    assert find_run(exp, "attribution", params | {"k": 7.0}, "v1", {"traces": "r1"}) is None
    assert find_run(exp, "attribution", params | {"k": "7"}, "v1", {"traces": "r1"}) is None
    assert find_run(exp, "attribution", params, "v9", {"traces": "r1"}) is None
    assert find_run(exp, "attribution", params, "v1", {"traces": "r2"}) is None
    assert find_run(exp, "attribution", params, "v1", {}) is None
    assert find_run(exp, "other-entry", params, "v1", {"traces": "r1"}) is None
    assert find_run(exp, "attribution", params, "v1", {"traces": "r1"},
                    status=RESUMABLE_STATUSES) is None


def test_find_run_rechecks_typed_values_behind_the_digest(tracking_uri: str, tmp_path: Path) -> None:
    # A run whose digest tag claims {"k": 40} but whose config.json holds k = 40.0 (float):
    # the value-by-value check against config.json must refuse it.
    c = corpus()
    exp_id = MlflowClient().get_experiment_by_name(experiment_for_corpus(c)).experiment_id
    client = MlflowClient()
    run = client.create_run(exp_id, tags={TAG_ENTRY_POINT: "ep", TAG_CODE_VERSION: "v1",
                                          TAG_PARAMS_DIGEST: params_digest({"k": 40})})
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"config": {"k": 40.0}}))
    client.log_artifact(run.info.run_id, str(cfg))
    client.set_terminated(run.info.run_id, "FINISHED")
    assert find_run(f"mistill/{c}", "ep", {"k": 40}, "v1") is None
    cfg.write_text(json.dumps({"config": {"k": 40}}))
    client.log_artifact(run.info.run_id, str(cfg))
    assert find_run(f"mistill/{c}", "ep", {"k": 40}, "v1").info.run_id == run.info.run_id


def test_per_note_resume_after_crash(tracking_uri: str, tmp_path: Path) -> None:
    c, cfg = corpus(), DemoConfig(seed=3)
    notes = ["n1", "n2", "n3", "n4"]
    computed: list[str] = []

    def run_stage(crash_at: str | None) -> StageRun:
        with stage(cfg, "events", tmp_path, corpus=c, resume=True) as run:
            if run.reused:
                return run
            done = run.finished_notes("notes")
            for nid in notes:
                if nid in done:
                    continue
                if nid == crash_at:
                    raise RuntimeError("simulated crash")
                computed.append(nid)
                files = {"events.json": {"note": nid, "margins": [1.5, -0.5]}, "log.txt": nid}
                if nid == "n3" and crash_at:
                    # crash between the local _DONE and the upload: files on disk only
                    from mistill.io import sha256_file

                    for name, content in files.items():
                        p = run.note_artifact_path("notes", nid, name)
                        p.write_text(json.dumps(content) if name.endswith(".json") else content)
                    from mistill.tracking.auth import sign_done

                    sums = {f.name: sha256_file(f) for f in p.parent.iterdir()}
                    signed = sign_done({"files": sums}, run_id=run.run_id, subdir="notes", note_id=nid)
                    (p.parent / "_DONE").write_text(json.dumps(signed))
                else:
                    run.write_note("notes", nid, files)
            return run

    with pytest.raises(RuntimeError, match="simulated crash"):
        run_stage(crash_at="n4")
    client = MlflowClient()
    failed = client.search_runs([client.get_experiment_by_name(f"mistill/{c}").experiment_id])
    assert len(failed) == 1 and failed[0].info.status == "FAILED"
    run_id = failed[0].info.run_id
    work = tmp_path / ".mistill" / "work" / run_id / "notes"
    mtimes = {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file()}
    assert computed == ["n1", "n2", "n3"]

    resumed = run_stage(crash_at=None)
    assert resumed.resumed and resumed.run_id == run_id
    assert computed == ["n1", "n2", "n3", "n4"]  # only the 4th was computed
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())  # nothing rewritten
    assert client.get_run(run_id).info.status == "FINISHED"
    for nid in notes:  # every note reached the store, _DONE included (n3 was synced on resume)
        names = {f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(run_id, f"notes/{nid}")}
        assert names == {"events.json", "log.txt", "_DONE"}

    # identical FINISHED run: reused, nothing done; after losing the local dir the store answers
    shutil.rmtree(tmp_path / ".mistill" / "work")
    again = run_stage(crash_at=None)
    assert again.reused and again.run_id == run_id and len(computed) == 4
    assert again.finished_notes("notes") == set(notes)
    assert again.load_note("notes", "n2", "events.json") == {"note": "n2", "margins": [1.5, -0.5]}
    assert again.load_note("notes", "n3", "log.txt") == b"n3"
    with pytest.raises(RuntimeError, match="reused"):
        again.log_metrics({"x": 1.0})


def test_figure_html_embeds_plotly_js(tracking_uri: str, tmp_path: Path) -> None:
    fig = go.Figure(go.Bar(x=["L0H1", "L3H2"], y=[0.4, 0.1]))
    with stage(DemoConfig(), "fig", tmp_path, corpus=corpus()) as run:
        path = run.log_figure(fig, "figures/importance")
        run_id = run.run_id
    html = path.read_text()
    assert '<script src="https://cdn' not in html
    assert re.findall(r"<script[^>]*>", html) and not re.findall(r"<script[^>]*\bsrc=", html)
    assert b"plotly.js v" in plotly_js_of(html)[:200]  # the library itself is inside, compressed
    assert figure_json(html)["data"][0]["x"] == ["L0H1", "L3H2"]
    client = MlflowClient()
    assert [f.path for f in client.list_artifacts(run_id, "figures")] == ["figures/importance.html"]


def test_restricted_corpus_refuses_canary_everywhere(tracking_uri: str, tmp_path: Path) -> None:
    guard = PrivacyGuard([NOTE], "restricted")
    c = corpus()
    with pytest.raises(PrivacyError, match="param note_field"):
        with stage(DemoConfig(note_field=CANARY), "p", tmp_path, corpus=c, guard=guard):
            pass
    with pytest.raises(PrivacyError, match="tag why"):
        with stage(DemoConfig(), "p", tmp_path, corpus=c, guard=guard, tags={"why": CANARY}):
            pass
    assert MlflowClient().get_experiment_by_name(f"mistill/{c}") is None  # nothing was created

    text_df = pd.DataFrame({"note_id": ["n1"], "text": [NOTE]})
    with stage(DemoConfig(), "p", tmp_path, corpus=c, guard=guard) as run:
        with pytest.raises(PrivacyError, match="metric name"):
            run.log_metrics({CANARY: 1.0})
        with pytest.raises(PrivacyError, match="tag t"):
            run.set_tags({"t": CANARY})
        with pytest.raises(PrivacyError, match="summary.json"):
            run.log_json("summary", {"context": CANARY})
        with pytest.raises(PrivacyError, match="rows.csv"):
            run.log_table("rows", pd.DataFrame({"snippet": [CANARY]}))
        with pytest.raises(PrivacyError, match="dataset"):
            run.log_dataset(text_df, "notes", digest="d1", context="eval")
        with pytest.raises(PrivacyError, match="figure"):
            run.log_figure(go.Figure(layout={"title": CANARY}), "fig")
        with pytest.raises(PrivacyError, match="trace.txt"):
            run.write_note("notes", "n1", {"trace.txt": NOTE})
        assert not (run.work_dir / "notes" / "n1").exists()
        # numbers, code names and ids are fine
        run.log_metrics({"micro_f1": 0.4})
        run.log_json("ok", {"codes": ["N18.9"], "importance": [0.1, 0.2]})
        run.log_dataset(pd.DataFrame({"note_id": ["n1"], "n_codes": [4]}), "ids", "d2", "eval")
        run_id = run.run_id
    client = MlflowClient()
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.data.metrics == {"micro_f1": 0.4}
    assert "t" not in got.data.tags
    assert {f.path for f in client.list_artifacts(run_id)} == {"config.json", "ok.json"}
    assert [d.dataset.name for d in got.inputs.dataset_inputs] == ["ids"]


def test_synthetic_corpus_allows_text(tracking_uri: str, tmp_path: Path) -> None:
    with stage(DemoConfig(note_field=CANARY), "s", tmp_path, corpus=corpus()) as run:
        run.log_json("summary", {"context": CANARY})
        run.log_dataset(pd.DataFrame({"note_id": ["n1"], "text": [NOTE]}), "notes", "d1", "train")
        run.write_note("notes", "n1", {"trace.txt": NOTE})
        run_id = run.run_id
    got = MlflowClient().get_run(run_id)
    assert got.data.params["note_field"] == CANARY
    assert [d.dataset.digest for d in got.inputs.dataset_inputs] == ["d1"]
    assert os.environ["MLFLOW_TRACKING_URI"] == tracking_uri


def test_a_launched_run_of_another_experiment_hands_the_work_to_the_corpus_experiment(
        tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mlflow run`` without ``--experiment-name``: its run sits in the Default experiment; the
    stage works in a run of ``mistill/<corpus>`` and points the launched run there."""
    client = MlflowClient()
    launched = client.create_run(client.get_experiment_by_name("Default").experiment_id).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", launched)
    c = corpus()
    try:
        with stage(DemoConfig(seed=11), "a", tmp_path, corpus=c) as run:
            run.log_metrics({"n_events": 3})
            run_id = run.run_id
            assert "MLFLOW_RUN_ID" not in os.environ
    finally:
        client.set_terminated(launched)  # as `mlflow run` ends it; the reaper then deletes it
    assert run_id != launched
    got = client.get_run(run_id)
    assert client.get_experiment(got.info.experiment_id).name == f"mistill/{c}"
    assert got.info.status == "FINISHED" and got.data.metrics == {"n_events": 3.0}
    assert client.get_run(launched).data.tags["mistill.delegated_to"] == run_id
