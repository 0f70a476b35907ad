"""What a person sees in the MLflow UI and in the logs, against a real server: experiments that
open on their runs, run names that say what a run is, the own-heads ranking nested under its
readout, pipeline step tags written as the steps finish, runs stopped by SIGTERM ended KILLED,
system metrics on the long stages, one ``View run`` line per run, progress lines without
cursor codes, and figure legends that name arms, never run ids."""

from __future__ import annotations

import dataclasses
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.experiments import experiment_for_corpus
from mistill.tracking.naming import EXPERIMENT_KIND, TAG_EXPERIMENT_KIND, TAG_LAMBDA, TAG_PARENT_RUN
from mistill.tracking.runs import StageRun, system_metrics_wanted
from stage_fixtures import REPO, TINY, subprocess_env, unique

RUN_ID = re.compile(r"[0-9a-f]{32}")
CURSOR_CODES = re.compile(r"\r|\x1b\[")


@dataclasses.dataclass(frozen=True)
class TrainDemo(Config):
    student: str = "embedded:smollm2-135m@every-other"
    arm: str = "mistill"
    seed: int = 0
    train_notes: int = 0


@dataclasses.dataclass(frozen=True)
class ReadoutDemo(Config):
    model: str = ""
    split: str = "test"
    seed: int = 0


def stage_run(stage: str, cfg: Config, corpus: str, tmp_path: Path, **kw) -> StageRun:
    return StageRun(stage, cfg, corpus=corpus, guard=PrivacyGuard([], "synthetic"), code_version="v1",
                    root=tmp_path / ".mistill", **kw)


@pytest.fixture(autouse=True)
def _no_system_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the system-metrics test samples them (each sample is a call to the server)."""
    monkeypatch.setenv("MISTILL_SYSTEM_METRICS", "0")


# ---------------------------------------------------------------------------------- experiments
def test_experiments_are_tagged_as_model_development(tracking_uri: str) -> None:
    client = MlflowClient()
    name = unique("kind")
    exp = client.get_experiment_by_name(experiment_for_corpus(name))
    assert exp.tags[TAG_EXPERIMENT_KIND] == EXPERIMENT_KIND == "custom_model_development"
    # an experiment made without the tag (as `mlflow run --experiment-name` makes it) gets it
    other = unique("kind")
    client.create_experiment(f"mistill/{other}")
    experiment_for_corpus(other)
    assert client.get_experiment_by_name(f"mistill/{other}").tags[TAG_EXPERIMENT_KIND] == EXPERIMENT_KIND


# ------------------------------------------------------------------------------------ run names
def test_run_names_say_stage_model_arm_lambda_split_seed(tracking_uri: str, tmp_path: Path) -> None:
    corpus = unique("names")
    with stage_run("train", TrainDemo(), corpus, tmp_path, model=TrainDemo.student, lam=(0.03, 0.03)) as train:
        train_id = train.run_id
    with stage_run("evaluate", ReadoutDemo(model=f"run:{train_id}"), corpus, tmp_path) as readout:
        readout_id = readout.run_id
    client = MlflowClient()
    trained, read = client.get_run(train_id), client.get_run(readout_id)
    assert trained.info.run_name == "mistill λ0.03 s0 · train · smollm2-135m@every-other"
    assert trained.data.tags[TAG_LAMBDA] == "0.03"
    # a readout of the checkpoint `run:<id>` is named by what that run trained, not by its id
    assert read.info.run_name == "mistill λ0.03 s0 · evaluate · smollm2-135m@every-other · test"
    assert not RUN_ID.search(read.info.run_name) and read.data.tags[TAG_LAMBDA] == "0.03"
    # a selection cell trains on part of the notes: its name says so, unlike the arm's on all of them
    with stage_run("train", TrainDemo(train_notes=100), corpus, tmp_path, model=TrainDemo.student,
                   lam=(0.03, 0.03)) as cell:
        cell_id = cell.run_id
    assert client.get_run(cell_id).info.run_name == "mistill λ0.03 s0 n100 · train · smollm2-135m@every-other"


def test_one_view_run_line_per_run_in_the_log(tracking_uri: str, tmp_path: Path, capsys) -> None:
    with stage_run("evaluate", ReadoutDemo(model="tiny:qwen3"), unique("links"), tmp_path) as run:
        run_id = run.run_id
    out, err = capsys.readouterr()
    assert "View run" not in out  # MLflow's own print is replaced by the logged line
    lines = [line for line in err.splitlines() if "View run" in line]
    assert len(lines) == 1 and "evaluate · tiny-qwen3 · test · s0 (FINISHED)" in lines[0] and run_id in lines[0]
    assert " INFO " in lines[0]


def test_a_selection_prints_each_view_run_line_at_most_once(tracking_uri: str, tmp_path: Path, monkeypatch,
                                                            capsys, pinned_code_version) -> None:
    """``select_lambda`` with two worker threads, each cell training a (stand-in) train run: the
    log holds one ``View run`` line per stage run (the selection's and each train run's), none
    for the cells' trial runs, and MLflow prints none of its own."""
    from mistill.stages.select_lambda import SelectLambdaConfig, run_select_lambda
    from selection.cells import CellResult

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    lock = tmp_path / "lock.yaml"
    lock.write_text((REPO / "projects/configs/locks/embedded-3cell.yaml").read_text()
                    .replace("study: embedded-3cell", f"study: {unique('study')}"))
    corpus = unique("select")
    scores = {0.03: 0.20, 0.1: 0.25, 0.3: 0.21}  # the middle cell wins: no edge extension

    def runner(cell_run):
        lam = cell_run.cell.lambdas[0]
        cfg = TrainDemo(seed=sorted(scores).index(lam))
        with stage_run("train", cfg, corpus, tmp_path, model=cfg.student, lam=cell_run.cell.lambdas) as train:
            train_id = train.run_id
        return CellResult(metric=scores[lam], tie_break=0.5, validity=1.0, run_ids={"train": train_id})

    run_id = run_select_lambda(SelectLambdaConfig(lock=str(lock), corpus_name=corpus, workers=2), runner=runner)
    out, err = capsys.readouterr()
    assert "View run" not in out  # MLflow's own print (it would name the cells' trial runs too)
    lines = [line for line in err.splitlines() if "View run" in line]
    client = MlflowClient()
    trials = client.search_runs([client.get_run(run_id).info.experiment_id],
                                filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
    assert len(trials) == 3
    trained = {t.data.tags["mistill.selection.run.train"] for t in trials}
    shown = [RUN_ID.findall(line)[-1] for line in lines]
    assert sorted(shown) == sorted([run_id, *trained])  # each once, the trial runs never
    assert not {t.info.run_id for t in trials} & set(shown)


# --------------------------------------------------------------------------------------- nesting
def test_own_heads_ranking_runs_are_nested_under_it(tracking_uri: str, tmp_path: Path, monkeypatch, capsys,
                                                    pinned_code_version) -> None:
    """own_heads on a plain tiny model: the events and attribute runs it starts to rank the
    arm's heads carry its run id as ``mlflow.parentRunId``; the progress of every loop reaches
    stderr as plain lines."""
    from mistill.stages.own_heads import OwnHeadsConfig, run_own_heads
    from mistill.stages.prepare import PrepareConfig
    from mistill.stages.workflow import run_step

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    name = unique("nest")
    prep = run_step("prepare", PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=6, model=TINY), name,
                    launch="inline")
    run_id = run_own_heads(OwnHeadsConfig(prepare_run=prep, model=TINY, k=(2,), necessity_k=2, m2_k=2,
                                          events_per_phase=2, n_null=2, stability_splits=5, max_notes=1,
                                          own_traces=False, launch="inline"))
    client = MlflowClient()
    tags = client.get_run(run_id).data.tags
    for key in ("mistill.rank_events", "mistill.rank_attribute"):
        ranking = client.get_run(tags[key])
        assert ranking.data.tags[TAG_PARENT_RUN] == run_id, key
        assert ranking.info.status == "FINISHED"
    err = capsys.readouterr().err
    assert "events: 1/1 (100%)" in err and "attribute: 1/1 (100%)" in err
    assert "own_heads teacher traces: 1/1 (100%)" in err
    assert not CURSOR_CODES.search(err)


def test_pipeline_tags_each_step_as_it_finishes_and_ends_failed(tracking_uri: str, tmp_path: Path, monkeypatch,
                                                               pinned_code_version) -> None:
    """A pipeline whose teacher split holds no note fails after ``prepare``: the pipeline run
    ends FAILED, and already names its finished ``prepare`` step."""
    from mistill.errors import MistillInputError
    from mistill.stages.workflow import STEP_TAG, PipelineConfig, run_pipeline

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    name = unique("steps")
    cfg = PipelineConfig(corpus="synthetic", corpus_name=name, n_notes=3, model=TINY, teacher_split="absent",
                         train_arms=(), shortlist=False, report=False, launch="inline")
    with pytest.raises(MistillInputError, match="absent"):
        run_pipeline(cfg)
    client = MlflowClient()
    exp = client.get_experiment_by_name(f"mistill/{name}")
    (pipeline,) = client.search_runs([exp.experiment_id], "tags.`mistill.stage` = 'pipeline'")
    (prepare,) = client.search_runs([exp.experiment_id], "tags.`mistill.stage` = 'prepare'")
    assert pipeline.info.status == "FAILED"
    assert pipeline.data.tags[STEP_TAG + "prepare"] == prepare.info.run_id
    assert prepare.data.tags[TAG_PARENT_RUN] == pipeline.info.run_id
    assert pipeline.info.run_name == "pipeline · tiny-qwen3 · s0"


KILLED_SCRIPT = textwrap.dedent("""
    import dataclasses, sys, time
    from mistill.config import Config
    from mistill.tracking.privacy import PrivacyGuard
    from mistill.tracking.runs import StageRun

    @dataclasses.dataclass(frozen=True)
    class Demo(Config):
        seed: int = 0

    guard = PrivacyGuard([], "synthetic")
    with StageRun("pipeline", Demo(), corpus=sys.argv[1], guard=guard, code_version="v1", root=sys.argv[2]) as outer:
        with StageRun("events", Demo(seed=1), corpus=sys.argv[1], guard=guard, code_version="v1",
                      root=sys.argv[2]) as inner:
            print(outer.run_id, inner.run_id, flush=True)
            time.sleep(120)
""")


def test_sigterm_ends_the_runs_killed(tracking_uri: str, tmp_path: Path) -> None:
    env = subprocess_env(tracking_uri, tmp_path)
    env["MISTILL_SYSTEM_METRICS"] = "0"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SCRIPT, unique("killed"), str(tmp_path / ".mistill")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        outer, inner = line.split()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    client = MlflowClient()
    assert client.get_run(inner).info.status == "KILLED"
    assert client.get_run(outer).info.status == "KILLED"
    assert client.get_run(inner).data.tags[TAG_PARENT_RUN] == outer


# --------------------------------------------------------------------------------- system metrics
def test_long_stages_log_system_metrics(tracking_uri: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MISTILL_SYSTEM_METRICS")
    assert system_metrics_wanted("train") and system_metrics_wanted("attribute")
    assert not system_metrics_wanted("prepare")
    monkeypatch.setenv("MISTILL_SYSTEM_METRICS", "0")
    assert not system_metrics_wanted("train")
    monkeypatch.setenv("MISTILL_SYSTEM_METRICS", "1")
    assert system_metrics_wanted("prepare")
    monkeypatch.delenv("MISTILL_SYSTEM_METRICS")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    with stage_run("train", TrainDemo(), unique("sysm"), tmp_path, model=TrainDemo.student) as run:
        run_id = run.run_id
        time.sleep(2.0)  # four sampling intervals: at least one sample is logged
    metrics = MlflowClient().get_run(run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics and "system/system_memory_usage_megabytes" in metrics


# -------------------------------------------------------------------------------------- progress
def test_progress_off_a_terminal_is_plain_lines(capsys) -> None:
    from mistill.progress import track

    for _ in track(range(40), desc="notes"):
        pass
    bar = track(total=3, desc="steps", initial=1)
    bar.update(1)
    bar.update(1)
    bar.close()
    inner = track(range(5), desc="per note", leave=False)
    assert list(inner) == list(range(5))
    err = capsys.readouterr().err
    assert not CURSOR_CODES.search(err)
    notes = [line for line in err.splitlines() if "notes: " in line]
    assert len(notes) == 10 and "notes: 40/40 (100%)" in notes[-1]  # a line per tenth
    assert "steps: 3/3 (100%)" in err and "per note" not in err  # inner loops: timed lines only
    assert all(" INFO mistill.progress: " in line for line in err.splitlines())


# --------------------------------------------------------------------------------------- figures
def test_figure_legends_name_arms_and_seeds_never_run_ids() -> None:
    from analysis.figures import lambda_frontier_figure, recovery_figure, recovery_long_from_own

    ids = ["0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"]
    cells = pd.DataFrame({
        "selection": [ids[0]] * 3 + [ids[1]] * 3, "arm": ["mistill"] * 3 + ["randheads"] * 3, "seed": 0,
        "lambda_p1": [0.01, 0.03, 0.1] * 2, "lambda_p2": [0.01, 0.03, 0.1] * 2,
        "metric": [0.2, 0.24, 0.21, 0.18, 0.19, 0.2], "tie_break": 0.5, "state": "complete",
        "picked": [False, True, False] * 2})
    fig = lambda_frontier_figure(cells)
    names = [t.name for t in fig.data if t.name != "pick"]
    assert names == ["mistill, seed 0", "randheads, seed 0"]
    assert not any(RUN_ID.search(t.name) for t in fig.data)
    assert list(fig.layout.xaxis.ticktext) == ["0.01", "0.03", "0.1"]  # log ticks written as the λ values
    own = pd.DataFrame({"model": "m", "arm": ["mistill"] * 4 + ["vanilla-bf16"] * 4, "seed": [0, 0, 1, 1] * 2,
                        "lambda": [0.03] * 4 + [None] * 4, "phase": "P1", "k": [8, 40] * 4,
                        "recovery_own": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], "recovery_random": 0.0})
    names = {t.name for t in recovery_figure(recovery_long_from_own(own), "own").data}
    assert names == {"mistill λ=0.03, seeds 0,1", "vanilla-bf16, seeds 0,1",
                     "mistill λ=0.03, seeds 0,1 (random)", "vanilla-bf16, seeds 0,1 (random)"}
