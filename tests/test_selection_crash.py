"""λ selection under crashes and concurrency, with real processes, the real MLflow server and a
real SQLite Optuna storage: a worker SIGKILLed mid-cell is recovered by the next run (the stale
trial failed, the cell retried and completed once), two workers started together on one study
both finish with the same pick and each cell run once, an interrupted or heartbeat-less cell is
retried, and an edited lock file is never silently reused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import yaml

from mistill.errors import MistillInputError
from selection.cells import Cell, CellResult, CellRun, grid_cells
from selection.grid import open_study, run_cells, study_cells
from selection.heartbeat import Heartbeat
from selection.lock import load_lock
from stage_fixtures import REPO, subprocess_env, unique

# 0.1 wins outright (0.05 ahead of 0.3, far outside the 0.004 band); it is interior, so the
# edge rule asks for no outward cell
TABLE = {0.03: (0.10, 0.5), 0.1: (0.20, 0.5), 0.3: (0.15, 0.5)}
PICK = "lambda=0.1"
FAST = Heartbeat(interval=1, grace=3, max_retry=2)
"""Short heartbeat for tests: a beat a second, stale after 3 s (a loaded 2-core machine still
beats within 3 s; a dead worker's cell is retried ~4 s after it died)."""


def write_lock(path: Path, study: str = "crash", tie_band: float = 0.004) -> Path:
    path.write_text(yaml.safe_dump({
        "study": study, "arm": "mistill", "grid": {"tied": True, "scale": "log", "lambda": sorted(TABLE)},
        "training": {"seed": 0, "max_steps": 1},
        "selection": {"metric": "micro_f1", "split": "val", "tie_band": tie_band, "tie_break": "m1/P2C/p_pos"},
        "edge": {"extend": False}}))
    return path


def lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


WORKER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path

    tmp, name, version, mode, corpus = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    workers, hold_s = int(sys.argv[6]), float(sys.argv[7])
    import mistill.tracking.identity as identity

    identity.code_version = lambda repo_root=None: version  # as pinned_code_version
    from mistill.stages.select_lambda import SelectLambdaConfig, run_select_lambda
    from selection.cells import CellResult

    TABLE = %r
    started = []

    def runner(run):
        key = run.cell.key
        started.append(key)
        with open(tmp / "started.log", "a") as fh:
            fh.write(f"{name} {key} {os.getpid()}\\n")
        if mode == "block-second" and len(started) == 2:
            (tmp / "blocked").write_text(key)
            time.sleep(600)  # killed here
        if mode == "barrier":  # hold this cell until the other worker holds one too
            deadline = time.time() + 60
            while len({l.split()[0] for l in (tmp / "started.log").read_text().splitlines()}) < 2 \\
                    and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(hold_s)
        metric, tie_break = TABLE[run.cell.lambdas[0]]
        with open(tmp / "done.log", "a") as fh:
            fh.write(f"{name} {key} {os.getpid()}\\n")
        return CellResult(metric=metric, tie_break=tie_break, run_ids={"train": f"t-{key}"})

    cfg = SelectLambdaConfig(lock=str(tmp / "lock.yaml"), corpus_name=corpus, workers=workers,
                             heartbeat_interval=%d, grace_period=%d, max_retry=%d)
    print("RUN", run_select_lambda(cfg, runner=runner), flush=True)
""") % (TABLE, FAST.interval, FAST.grace, FAST.max_retry)


def start_worker(tmp: Path, name: str, mode: str, corpus: str, version: str, tracking_uri: str, *,
                 workers: int = 1, hold_s: float = 0.0) -> subprocess.Popen:
    """``select_lambda`` in a fresh process with the test runner: ``mode`` ``block-second`` blocks
    in its second cell (to be killed there); ``barrier`` holds each cell until both workers have
    started one, then ``hold_s`` seconds more."""
    env = {**subprocess_env(tracking_uri, tmp / "root"), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [str(tmp), name, version, mode, corpus, str(workers), str(hold_s)]
    return subprocess.Popen([sys.executable, "-c", WORKER, *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stage_config(tmp: Path, corpus: str):
    from mistill.stages.select_lambda import SelectLambdaConfig

    return SelectLambdaConfig(lock=str(tmp / "lock.yaml"), corpus_name=corpus, heartbeat_interval=FAST.interval,
                              grace_period=FAST.grace, max_retry=FAST.max_retry)


def stage_handle(tmp: Path, corpus: str):
    """The study the stage opened under ``<tmp>/root``."""
    from mistill.stages.select_lambda import study_name
    from selection.grid import default_storage_url

    cfg = stage_config(tmp, corpus)
    lock = load_lock(cfg.lock)
    return open_study(lock, default_storage_url(tmp / "root"), study_name(cfg, lock.study, corpus),
                      root=tmp / "root", heartbeat=FAST)


def recording_runner(tmp: Path, name: str, calls: list):
    def runner(run: CellRun) -> CellResult:
        calls.append(run.cell.key)
        metric, tie_break = TABLE[run.cell.lambdas[0]]
        with open(tmp / "done.log", "a") as fh:
            fh.write(f"{name} {run.cell.key} {os.getpid()}\n")
        return CellResult(metric=metric, tie_break=tie_break, run_ids={"train": f"t-{run.cell.key}"})
    return runner


# ------------------------------------------------------------------------------ crash recovery
def test_a_worker_killed_mid_cell_is_recovered_by_the_next_run(tracking_uri, tmp_path, monkeypatch,
                                                               pinned_code_version):
    from mlflow.tracking import MlflowClient

    from mistill.stages.select_lambda import run_select_lambda

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    write_lock(tmp_path / "lock.yaml")
    corpus = unique("selection-kill")
    worker = start_worker(tmp_path, "killed", "block-second", corpus, pinned_code_version, tracking_uri)
    deadline = time.time() + 90
    while not (tmp_path / "blocked").exists():
        assert worker.poll() is None, worker.communicate()[1][-3000:]
        assert time.time() < deadline, "the worker never reached its second cell"
        time.sleep(0.1)
    blocked = (tmp_path / "blocked").read_text()
    os.kill(worker.pid, signal.SIGKILL)
    worker.communicate(timeout=30)
    assert worker.returncode == -signal.SIGKILL
    first = [k for w, k, _ in lines(tmp_path / "done.log")]
    assert len(first) == 1 and blocked not in first  # one cell finished, the next one killed mid-run
    killed = [t for t in stage_handle(tmp_path, corpus).load().get_trials() if t.state.name == "RUNNING"]
    assert [t.user_attrs["cell"] for t in killed] == [blocked]

    calls: list = []
    run_id = run_select_lambda(stage_config(tmp_path, corpus), runner=recording_runner(tmp_path, "rerun", calls))

    # the killed cell was retried and finished here; the cell finished before the kill was not rerun
    assert blocked in calls and first[0] not in calls
    done = lines(tmp_path / "done.log")
    assert sorted(k for _, k, _ in done) == sorted(c.key for c in grid_cells(load_lock(tmp_path / "lock.yaml").grid))
    assert [w for w, k, _ in done if k == blocked] == ["rerun"]  # ran to completion exactly once
    trials = {t.number: t for t in stage_handle(tmp_path, corpus).load().get_trials()}
    stale = trials[killed[0].number]
    assert stale.state.name == "FAIL"
    retries = [t for t in trials.values() if t.system_attrs.get("failed_trial") == stale.number]
    assert len(retries) == 1 and retries[0].state.name == "COMPLETE"
    assert retries[0].params == stale.params and retries[0].system_attrs["grid_id"] == stale.system_attrs["grid_id"]
    assert sum(t.state.name == "COMPLETE" for t in trials.values()) == 3

    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.selection.pick"] == PICK
    children = client.search_runs([run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
    attempts = {c.data.tags["mistill.selection.trial"]: c for c in children
                if c.data.tags["mistill.selection.cell"] == blocked}
    assert attempts[str(stale.number)].info.status == "KILLED"
    assert attempts[str(retries[0].number)].info.status == "FINISHED"
    assert attempts[str(retries[0].number)].data.tags["mistill.selection.retry_of"] == str(stale.number)
    record = json.loads(Path(client.download_artifacts(run_id, "decision.json", str(tmp_path / "dl"))).read_text())
    assert record["reports"]["grid"]["stale"] == {blocked: [stale.number]}
    assert record["heartbeat"] == FAST.to_dict()


def test_two_workers_on_one_study_run_each_cell_once_and_agree(tracking_uri, tmp_path, pinned_code_version):
    write_lock(tmp_path / "lock.yaml")
    corpus = unique("selection-pair")
    # two machines' worth of workers on one study (one thread here, two there: two select_lambda
    # runs, one study); b's cells outlast a's, so a runs out of cells while b still holds one
    workers = [start_worker(tmp_path, "a", "barrier", corpus, pinned_code_version, tracking_uri, hold_s=1.0),
               start_worker(tmp_path, "b", "barrier", corpus, pinned_code_version, tracking_uri, workers=2,
                            hold_s=3.0)]
    outs = [w.communicate(timeout=180) for w in workers]
    for w, (out, err) in zip(workers, outs):
        assert w.returncode == 0, err[-3000:]
    done = lines(tmp_path / "done.log")
    assert sorted(k for _, k, _ in done) == sorted(f"lambda={v!r}" for v in TABLE)  # each cell exactly once
    assert {w for w, _, _ in done} == {"a", "b"}  # both held cells at the same time (the barrier)
    picks = [re.findall(r"-> (lambda=[0-9.e+-]+)", out) for out, _ in outs]
    assert picks == [[PICK], [PICK]]
    trials = stage_handle(tmp_path, corpus).load().get_trials()
    assert len(trials) == 3 and all(t.state.name == "COMPLETE" for t in trials)


# ----------------------------------------------------------------------- retries in one process
def test_an_interrupted_cell_is_queued_again_and_a_failed_one_once_per_rerun(tmp_path):
    lock = load_lock(write_lock(tmp_path / "lock.yaml"))
    handle = open_study(lock, f"sqlite:///{tmp_path / 'db.sqlite'}", "s", root=tmp_path, heartbeat=FAST)
    calls: list = []
    record = recording_runner(tmp_path, "w", calls)

    def runner(run: CellRun) -> CellResult:
        if run.cell.key == "lambda=0.3":
            calls.append(run.cell.key)
            raise RuntimeError("diverged")
        if run.cell.key == "lambda=0.1" and "lambda=0.1" not in calls:
            calls.append(run.cell.key)
            raise KeyboardInterrupt
        return record(run)

    with pytest.raises(KeyboardInterrupt):
        run_cells(handle, lock.grid.search_space(), runner, scale="log")
    interrupted = next(t for t in handle.load().get_trials() if t.params == {"lambda": 0.1})
    assert interrupted.state.name == "FAIL" and interrupted.user_attrs["error"] == "interrupted"
    report = run_cells(handle, lock.grid.search_space(), runner, scale="log")
    assert "lambda=0.1" in report.ran and calls.count("lambda=0.1") == 2
    # a runner's failure is retried once by the rerun (queued at its start), never twice by one call
    assert calls.count("lambda=0.3") == 2 and report.retried == {"lambda=0.3": 1}
    cells = study_cells(handle)
    assert set(cells.results) == {Cell.of({"lambda": 0.03}), Cell.of({"lambda": 0.1})}
    assert list(cells.failed) == [Cell.of({"lambda": 0.3})] and "diverged" in cells.failed[Cell.of({"lambda": 0.3})]
    retry = [t for t in cells.trials[Cell.of({"lambda": 0.1})] if t["state"] == "COMPLETE"]
    assert [t["retry_of"] for t in retry] == [interrupted.number]
    assert not cells.waiting and not cells.running


def test_a_running_trial_without_heartbeat_is_failed_and_retried(tmp_path):
    import optuna

    lock = load_lock(write_lock(tmp_path / "lock.yaml"))
    handle = open_study(lock, f"sqlite:///{tmp_path / 'db.sqlite'}", "s", root=tmp_path, heartbeat=FAST)
    # a cell claimed as before heartbeats were recorded (a grid trial, RUNNING, no heartbeat), its
    # worker gone
    space = lock.grid.search_space()
    with warnings.catch_warnings():  # Optuna's hint that heartbeats go with Study.optimize
        warnings.simplefilter("ignore", UserWarning)
        orphan = handle.load(optuna.samplers.GridSampler(space, seed=0)).ask()
    value = orphan.suggest_float("lambda", 0.03, 0.3, log=True)
    orphan.set_user_attr("cell", Cell.of({"lambda": value}).key)
    time.sleep(FAST.grace + 1)
    calls: list = []
    report = run_cells(handle, space, recording_runner(tmp_path, "w", calls), scale="log")
    assert sorted(calls) == sorted(c.key for c in grid_cells(lock.grid))
    cells = study_cells(handle)
    assert set(cells.results) == set(grid_cells(lock.grid)) and not cells.running
    assert handle.load().trials[orphan.number].state.name == "FAIL"
    assert report.stale == {Cell.of({"lambda": value}).key: [orphan.number]}


# ------------------------------------------------------------------------------ the lock's content
def test_an_edited_lock_outside_the_repository_is_never_reused(tracking_uri, tmp_path, monkeypatch,
                                                               pinned_code_version):
    from mlflow.tracking import MlflowClient

    from mistill.stages.select_lambda import run_select_lambda

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    lock_path = write_lock(tmp_path / "lock.yaml")
    original = lock_path.read_bytes()
    corpus = unique("selection-lock")
    calls: list = []
    first = run_select_lambda(stage_config(tmp_path, corpus), runner=recording_runner(tmp_path, "w", calls))
    assert len(calls) == 3
    old_sha = load_lock(lock_path).sha256
    client = MlflowClient()
    assert client.get_run(first).data.params["lock_sha256"] == old_sha

    # a new pre-registration in the same file (another study name, a wider band): a new run
    write_lock(lock_path, study="crash-wider", tie_band=0.05)
    calls.clear()
    second = run_select_lambda(stage_config(tmp_path, corpus), runner=recording_runner(tmp_path, "w", calls))
    assert second != first and len(calls) == 3
    assert client.get_run(second).data.params["lock_sha256"] == load_lock(lock_path).sha256 != old_sha
    assert client.get_run(second).data.tags["mistill.selection.pick"] == PICK

    # the first lock edited under its own study name: refused, naming the file and both hashes
    write_lock(lock_path, tie_band=0.05)
    new_sha = load_lock(lock_path).sha256
    calls.clear()
    with pytest.raises(MistillInputError) as err:
        run_select_lambda(stage_config(tmp_path, corpus), runner=recording_runner(tmp_path, "w", calls))
    assert err.value.file == str(lock_path) and calls == []
    assert old_sha in str(err.value) and new_sha in str(err.value) and str(lock_path) in str(err.value)

    # the original bytes back: the identical finished run is reused
    lock_path.write_bytes(original)
    assert run_select_lambda(stage_config(tmp_path, corpus), runner=recording_runner(tmp_path, "w", calls)) == first
    assert calls == []
