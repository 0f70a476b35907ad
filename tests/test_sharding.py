"""A pass over several processes (``torchrun``, gloo on CPU) against the real tracking server:
the same per-note artifacts as one process, one run, resume after a rank is killed, and the
sharding rule and launcher options."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mistill.distributed import World, current_world, rank_device, shard
from mistill.errors import MistillInputError
from mistill.stages.cli import split_launch_args
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.stages.registry import stage
from stage_fixtures import SLOW_TINY, TINY, freeze_source, runs_of, subprocess_env, unique

PER_NOTE = ("events.jsonl", "realized.jsonl", "coverage.json")


# ------------------------------------------------------------------------------- units
def test_shard_deals_round_robin_and_covers_every_item_once():
    items = [f"n{i}" for i in range(7)]
    parts = [shard(items, World(rank=r, size=3)) for r in range(3)]
    assert parts == [["n0", "n3", "n6"], ["n1", "n4"], ["n2", "n5"]]
    assert sorted(x for p in parts for x in p) == sorted(items)
    assert shard(items, World()) == items


def test_world_from_launcher_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    w = current_world()
    assert (w.rank, w.size, w.local_rank, w.leader, w.distributed) == (3, 4, 1, False, True)
    assert rank_device("cuda", w) == "cuda:1" and rank_device("cpu", w) == "cpu"
    assert rank_device("cuda:0", w) == "cuda:0"  # an explicit device is kept
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="RANK=4"):
        current_world()
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key)
    assert current_world() == World()


def test_launch_options_only_on_shardable_stages():
    events, attribute = stage("events"), stage("attribute")
    assert events.shardable and not attribute.shardable
    assert split_launch_args(events, ["--launcher", "torchrun", "--nproc=2", "--seed", "1"]) == (
        "torchrun", 2, ["--seed", "1"])
    assert split_launch_args(events, ["--seed", "1"]) == ("none", 1, ["--seed", "1"])
    assert split_launch_args(events, ["--nproc", "2.0"])[1] == 2
    for bad in (["--nproc", "0"], ["--nproc", "1.5"], ["--launcher", "slurm"], ["--nproc"]):
        with pytest.raises(MistillInputError):
            split_launch_args(events, bad)
    # a stage whose notes depend on each other keeps them: its parser refuses them as unknown
    assert split_launch_args(attribute, ["--nproc", "2"])[2] == ["--nproc", "2"]


def test_dependent_stage_is_refused_under_several_processes(monkeypatch):
    from mistill.stages.runner import open_stage

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(MistillInputError, match="attribute runs in one process"):
        with open_stage("attribute", None, None, inputs={}):  # type: ignore[arg-type]
            pass


# ------------------------------------------------------------------- two processes, real runs
def _note_files(run_dir: Path) -> dict[str, dict[str, bytes]]:
    return {d.name: {f: (d / f).read_bytes() for f in PER_NOTE}
            for d in sorted((run_dir / "notes").iterdir()) if (d / "_DONE").is_file()}


def _events_run_dir(root: Path, run_id: str) -> Path:
    return root / "work" / run_id


def test_events_on_two_processes_equal_one_process(tracking_uri, tmp_path, monkeypatch):
    """``mlflow run -e events -P launcher=torchrun -P nproc=2``: one run (the launched one),
    every note written once by one of the ranks, the same bytes as one process's run."""
    root = tmp_path / "root"
    monkeypatch.setenv("MISTILL_ROOT", str(root))
    names = unique("one"), unique("two")
    preps = [run_prepare(PrepareConfig(corpus="synthetic", corpus_name=n, n_notes=5, model=TINY)) for n in names]
    frozen = freeze_source(tmp_path / "src")
    env = {**subprocess_env(tracking_uri, root), "OMP_NUM_THREADS": "1"}  # torchrun's default per process

    one = subprocess.run([sys.executable, "projects/events.py", "--prepare_run", preps[0], "--model", TINY,
                          "--n_null", "4"], cwd=frozen, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    one_id = re.search(r"mistill events: run ([0-9a-f]{32})", one.stdout).group(1)

    mlflow_cli = str(Path(sys.executable).parent / "mlflow")
    two = subprocess.run([mlflow_cli, "run", ".", "-e", "events", "--env-manager", "local",
                          "--experiment-name", f"mistill/{names[1]}", "-P", f"prepare_run={preps[1]}",
                          "-P", f"model={TINY}", "-P", "n_null=4", "-P", "launcher=torchrun", "-P", "nproc=2"],
                         cwd=frozen, env=env, capture_output=True, text=True, timeout=300)
    out = two.stdout + two.stderr
    assert two.returncode == 0, out[-4000:]
    assert "events [rank 1/2]" in out and "events [rank 0/2]" in out, out[-3000:]
    two_id = re.search(r"mistill events: run ([0-9a-f]{32})", out).group(1)
    launched = re.search(r"Run \(ID '([0-9a-f]{32})'\) succeeded", out).group(1)
    assert launched == two_id  # rank 0 adopted the run `mlflow run` opened
    assert list(runs_of(f"mistill/{names[1]}", stage="events")["run_id"]) == [two_id]

    client = MlflowClient()
    run = client.get_run(two_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["nproc"] == "2"  # mlflow's -P record; not part of the identity
    a, b = _note_files(_events_run_dir(root, one_id)), _note_files(_events_run_dir(root, two_id))
    assert len(a) == 5 and a.keys() == b.keys()
    for note in a:
        assert a[note] == b[note], note
    # every note's files reached the store, and rank 0 aggregated over all of them
    for note in b:
        names_in_store = {f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(two_id, f"notes/{note}")}
        assert {"_DONE", *PER_NOTE} <= names_in_store, note
    audit = [Path(client.download_artifacts(r, "margin_audit.csv", str(tmp_path / r))).read_text()
             for r in (one_id, two_id)]
    assert audit[0] == audit[1]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the worker of ``rank`` below a ``torchrun`` process (found by its environment)."""
    stack = _children(launcher_pid)
    while stack:
        pid = stack.pop()
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
            return pid
        stack += _children(pid)
    return None


def test_killed_rank_fails_the_pass_and_one_process_finishes_only_the_rest(tracking_uri, tmp_path, monkeypatch):
    root = tmp_path / "root"
    monkeypatch.setenv("MISTILL_ROOT", str(root))
    name = unique("kill")
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=8, model=TINY))
    frozen = freeze_source(tmp_path / "src")
    env = subprocess_env(tracking_uri, root)
    cmd = [sys.executable, "projects/events.py", "--prepare_run", prep, "--model", SLOW_TINY, "--n_null", "4"]
    log_path = tmp_path / "two.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([*cmd, "--launcher", "torchrun", "--nproc", "2"], cwd=frozen, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while not list((root / "work").glob("*/notes/*/_DONE")):
                assert proc.poll() is None, f"exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "no note finished within 180 s"
                time.sleep(0.01)
            victim = None
            while victim is None and proc.poll() is None:
                victim = _rank_pid(proc.pid, 1)
            assert victim is not None, log_path.read_text()[-3000:]
            os.kill(victim, signal.SIGKILL)
            assert proc.wait(timeout=120) != 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    run_dir = next((root / "work").glob("*/notes")).parent
    run_id = run_dir.name
    client = MlflowClient()
    assert client.get_run(run_id).info.status != "FINISHED"
    before = {d.name: {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
              for d in (run_dir / "notes").iterdir() if (d / "_DONE").is_file()}
    assert 0 < len(before) < 8, "every note finished before the kill: make the notes slower"

    again = subprocess.run(cmd, cwd=frozen, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"mistill events: run {run_id}" in again.stdout
    assert client.get_run(run_id).info.status == "FINISHED"
    assert list(runs_of(f"mistill/{name}", stage="events")["run_id"]) == [run_id]
    after = {d.name for d in (run_dir / "notes").iterdir() if (d / "_DONE").is_file()}
    assert len(after) == 8
    for note, mtimes in before.items():  # what the ranks finished before the kill was not redone
        assert {p.name: p.stat().st_mtime_ns for p in (run_dir / "notes" / note).iterdir()
                if p.name in mtimes} == mtimes, note


# ------------------------------------------------------------------------- data-parallel training
@pytest.fixture(scope="module")
def targets_run(tracking_uri, tmp_path_factory, pinned_code_version):
    """The tiny teacher's targets on the 3 training notes of a 6-note synthetic corpus."""
    from mistill.stages.characterize import AttributeConfig, EventsConfig, run_attribute, run_events
    from mistill.stages.distill import TargetsConfig, run_targets

    root = tmp_path_factory.mktemp("ddp-root")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MISTILL_ROOT", str(root))
        prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("ddp"), n_notes=6, model=TINY))
        events = run_events(EventsConfig(prepare_run=prep, model=TINY, n_null=4))
        attribute = run_attribute(AttributeConfig(events_run=events, selftest_events=0, stability_splits=5))
        targets = run_targets(TargetsConfig(teacher_attribute_run=attribute))
    return {"targets": targets, "root": root}


def test_training_on_two_processes_equals_one_process(targets_run, tmp_path, monkeypatch):
    """The Vanilla CoT-KD arm (bf16 weights, the CPU's fp32 GEMMs), a global batch of 3, one
    optimizer step: two gloo processes (two examples and one, gradients summed over the
    ranks) reach the weights and losses of one process, to bf16 rounding of the gradient sums.
    The learning rate is raised so that the step moves bf16 weights by more than their rounding."""
    import torch
    from mlflow.tracking import MlflowClient

    from mistill.models.loading import load_model
    from mistill.stages.distill import TrainStageConfig, run_train

    root = targets_run["root"]
    monkeypatch.setenv("MISTILL_ROOT", str(root))
    args = dict(targets_run=targets_run["targets"], student="tiny:qwen3:seed=2", arm="vanilla-bf16", grad_accum=3,
                max_steps=1, lr=1e-3)
    # `register` tells the two runs apart (identical runs are reused); it does not touch training
    runs = {"one": run_train(TrainStageConfig(**args, register=False))}
    frozen = freeze_source(tmp_path / "src")
    env = subprocess_env(os.environ["MLFLOW_TRACKING_URI"], root)
    cmd = [sys.executable, "projects/train.py", *(f"--{k}={v}" for k, v in args.items()), "--register", "true",
           "--launcher", "torchrun", "--nproc", "2"]
    proc = subprocess.run(cmd, cwd=frozen, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    found = re.findall(r"mistill train: run ([0-9a-f]{32})", proc.stdout)
    assert len(found) == 1, proc.stdout[-2000:]  # printed by rank 0 only
    runs["two"] = found[0]
    client = MlflowClient()
    history = {k: [m.value for m in sorted(client.get_metric_history(r, "train/loss"), key=lambda m: m.step)]
               for k, r in runs.items()}
    assert len(history["one"]) == 1 and history["two"] == pytest.approx(history["one"], rel=1e-3)
    states = {k: torch.load(root / "work" / r / "trainer" / "trainer_state.pt", weights_only=False)
              for k, r in runs.items()}
    assert states["one"]["step"] == states["two"]["step"] == 1
    before = load_model("tiny:qwen3:seed=2").model.state_dict()
    # bf16 gradients are summed in another order (each rank's share, then over the ranks), so a
    # gradient entry can round to another bf16 value; where it is near zero, its sign (Adam's
    # first step moves a weight by lr times that sign) can flip. So: equal to bf16 tolerance
    # except for a handful of entries, and those apart by at most one step of each run
    moved, off, total = 0.0, 0, 0
    bound = 2 * args["max_steps"] * args["lr"] * 1.01
    for key, value in states["one"]["model"].items():
        other = states["two"]["model"][key]
        assert value.dtype == other.dtype == torch.bfloat16
        diff = (other.float() - value.float()).abs()
        close = torch.isclose(other.float(), value.float(), rtol=1.6e-2, atol=1e-5)
        off += int((~close).sum())
        total += value.numel()
        assert float(diff.max()) <= bound, key
        moved = max(moved, float((value.float() - before[key].float()).abs().max()))
    assert off <= total * 1e-3, (off, total)
    assert moved > 1e-4  # the step changed the weights: the comparison is not of untouched models
