"""A pass over several processes (``torchrun``, gloo on CPU) against the real tracking server:
the same per-note artifacts as one process, one run, resume after a rank is killed, and the
sharding rule and launcher options."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mistill.distill.trainer import COST_METRICS
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
    events, las = stage("events"), stage("las_simulator")
    for name in ("events", "attribute", "knockin", "locus", "targets", "generate", "evaluate", "own_heads", "train"):
        assert stage(name).shardable, name
    assert not las.shardable
    assert split_launch_args(events, ["--launcher", "torchrun", "--nproc=2", "--seed", "1"]) == (
        "torchrun", 2, ["--seed", "1"])
    assert split_launch_args(events, ["--seed", "1"]) == ("none", 1, ["--seed", "1"])
    assert split_launch_args(events, ["--nproc", "2.0"])[1] == 2
    for bad in (["--nproc", "0"], ["--nproc", "1.5"], ["--launcher", "slurm"], ["--nproc"]):
        with pytest.raises(MistillInputError):
            split_launch_args(events, bad)
    # a stage that runs in one process keeps them: its parser refuses them as unknown
    assert split_launch_args(las, ["--nproc", "2"])[2] == ["--nproc", "2"]


def test_one_process_stage_is_refused_under_several_processes(monkeypatch):
    from mistill.stages.runner import open_stage

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(MistillInputError, match="las_simulator runs in one process"):
        with open_stage("las_simulator", None, None, inputs={}):  # type: ignore[arg-type]
            pass


def test_attribution_waves_resume_from_finished_notes():
    """A pass resumed with some notes finished (their means given) measures the rest exactly as
    the whole pass did: each note's running global ranking comes from every note before it."""
    import numpy as np
    import torch

    from mistill.instrument.hooks import HeadHook
    from mistill.instrument.passes import AttributionConfig, EventQuery, phase_means, running_global_top
    from mistill.instrument.patching import Query
    from mistill.instrument.runner import Runner
    from mistill.instrument.waves import attribute_waves
    from mistill.models.loading import tiny_model

    lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=16, d_model=64, seed=3)
    runner, hook = Runner(lm, chunk_size=64), HeadHook(lm.geometry)
    gen = torch.Generator().manual_seed(0)
    inputs = {}
    for n in range(5):
        ids = torch.randint(0, 2000, (60 + 10 * n,), generator=gen)
        events = [EventQuery(event_id=f"n{n}:{k}:{p}", kind=k, target=str(p % 3),
                             query=Query(position=p, token_id=int(ids[p]), target_id=300 + p % 5,
                                         competitor_ids=tuple(300 + x for x in range(5) if x != p % 5)))
                  for p, k in ((50, "P1"), (40, "P2C"), (30, "NULL"), (20, "P1"))]
        inputs[f"n{n}"] = (ids, events)
    order = list(inputs)
    cfg = AttributionConfig(top_nominees=3, global_nominees=2, null_exact_fraction=1.0, chunk_size=64)
    seen: list[int] = []

    def running(means):
        seen.append(len(means.get("P1", [])))
        return running_global_top(means.get("P1", []), 2)

    full = {a.note_id: a for a in attribute_waves(runner, hook, order, {}, inputs.__getitem__, cfg, running, World(),
                                                  progress=False)}
    assert seen == [0, 1, 2, 3, 4]  # note k ranks its globals from the k notes before it
    done_means = {n: phase_means(full[n].kinds, full[n].first_order) for n in order[:3]}
    rest = list(attribute_waves(runner, hook, order, done_means, inputs.__getitem__, cfg, running, World(),
                                progress=False))
    assert [a.note_id for a in rest] == ["n3", "n4"]
    for a in rest:
        for key, value in a.arrays().items():
            nan_ok = value.dtype.kind == "f"
            assert np.array_equal(value, full[a.note_id].arrays()[key], equal_nan=nan_ok), (a.note_id, key)
    assert np.isfinite(full["n4"].exact[0]).sum() >= 3  # the exact patches did run


# ------------------------------------------------------------------- two processes, real runs
_ONE_PROCESS_CHAIN = """
import json
import sys

sys.path.insert(0, ".")
from mistill.stages.cli import main  # noqa: E402

ids = {}
for name, stage, argv in json.loads(sys.argv[1]):
    ids[name] = main(stage, [a.format(**ids) for a in argv])
print("chain " + json.dumps(ids))
"""
"""Entry points run one after another in one process, as ``projects/<stage>.py`` runs each
(``mistill.stages.cli.main`` on its arguments): ``[[name, stage, argv], ...]``, where an argument
may name an earlier step's run id as ``{name}``; prints ``chain {name: run id}``."""

OWN_HEADS_ARGS = dict(model=TINY, k=(2, 4), necessity_k=4, m2_k=4, n_random=1, range_gate=1e-6, events_per_phase=2,
                      max_new_tokens=4, n_null=4, stability_splits=5, test_split="", launch="inline")
OWN_HEADS_CLI = [f"--{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in OWN_HEADS_ARGS.items()]
ATTRIBUTE_CLI = ["--selftest_events", "1", "--stability_splits", "5"]
KNOCKIN_CLI = ["--k_bins", "3,8", "--events_per_phase", "3"]


class Launched:
    """The module's passes over one and two processes, each started once, when a test first asks.

    Five-note synthetic corpora (identical notes, one corpus per pass, so each is its own run):
    the one-process reference runs ``events -> attribute -> knockin`` and ``own_heads`` (a
    six-note corpus) in one process (:data:`_ONE_PROCESS_CHAIN`); the two-process passes are
    ``mlflow run -e events`` under torchrun and under accelerate, ``mlflow run -e attribute``
    under torchrun on the torchrun events, a torchrun ``knockin`` on that attribute run, and a
    torchrun ``own_heads``. Every process computes with one thread (as torchrun sets it): the
    same float summation order."""

    def __init__(self, tracking_uri: str, tmp: Path) -> None:
        self.tmp, self.root = tmp, tmp / "root"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MISTILL_ROOT", str(self.root))
            self.names = {k: unique(k) for k in ("one", "torchrun", "accelerate", "own-one", "own-two")}
            self.preps = {k: run_prepare(PrepareConfig(corpus="synthetic", corpus_name=n, model=TINY,
                                                       n_notes=6 if k.startswith("own") else 5))
                          for k, n in self.names.items()}
        self.frozen = freeze_source(tmp / "src")
        self.env = {**subprocess_env(tracking_uri, self.root), "OMP_NUM_THREADS": "1"}
        self.mlflow_cli = str(Path(sys.executable).parent / "mlflow")
        self._done: dict[str, object] = {}

    def _once(self, key: str, make):
        if key not in self._done:
            self._done[key] = make()
        return self._done[key]

    def _run(self, cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=self.frozen, env=self.env, capture_output=True, text=True, timeout=900)

    def one(self) -> dict[str, str]:
        """The one-process runs: ``events``, ``attribute``, ``knockin``, ``own_heads``."""
        def make() -> dict[str, str]:
            plan = [["events", "events", ["--prepare_run", self.preps["one"], "--model", TINY, "--n_null", "4"]],
                    ["attribute", "attribute", ["--events_run", "{events}", *ATTRIBUTE_CLI]],
                    ["knockin", "knockin", ["--attribute_run", "{attribute}", *KNOCKIN_CLI]],
                    ["own_heads", "own_heads", ["--prepare_run", self.preps["own-one"], *OWN_HEADS_CLI]]]
            proc = self._run([sys.executable, "-c", _ONE_PROCESS_CHAIN, json.dumps(plan)])
            out = proc.stdout + proc.stderr
            assert proc.returncode == 0, out[-4000:]
            ids = json.loads(re.search(r"^chain (\{.*\})$", proc.stdout, re.M).group(1))
            for stage_name, run_id in ids.items():  # each printed by its entry point
                assert f"mistill {stage_name}: run {run_id}" in proc.stdout, stage_name
            return ids
        return self._once("one", make)

    def events(self, launcher: str) -> subprocess.CompletedProcess:
        """``mlflow run -e events -P launcher=<launcher> -P nproc=2``."""
        return self._once(f"events-{launcher}", lambda: self._run(
            [self.mlflow_cli, "run", ".", "-e", "events", "--env-manager", "local",
             "--experiment-name", f"mistill/{self.names[launcher]}", "-P", f"prepare_run={self.preps[launcher]}",
             "-P", f"model={TINY}", "-P", "n_null=4", "-P", f"launcher={launcher}", "-P", "nproc=2"]))

    def events_run(self, launcher: str) -> str:
        out = self.events(launcher).stdout + self.events(launcher).stderr
        assert self.events(launcher).returncode == 0, out[-4000:]
        return re.search(r"mistill events: run ([0-9a-f]{32})", out).group(1)

    def attribute(self) -> str:
        """``mlflow run -e attribute -P launcher=torchrun -P nproc=2`` on the torchrun events."""
        return self._once("attribute", lambda: _run_id("attribute", self._run(
            [self.mlflow_cli, "run", ".", "-e", "attribute", "--env-manager", "local", "--experiment-name",
             f"mistill/{self.names['torchrun']}", "-P", f"events_run={self.events_run('torchrun')}", "-P",
             "selftest_events=1", "-P", "stability_splits=5", "-P", "launcher=torchrun", "-P", "nproc=2"])))

    def knockin(self) -> str:
        """``projects/knockin.py --launcher torchrun --nproc 2`` on the two-process attribute run."""
        return self._once("knockin", lambda: _run_id("knockin", self._run(
            [sys.executable, "projects/knockin.py", "--attribute_run", self.attribute(), *KNOCKIN_CLI,
             "--launcher", "torchrun", "--nproc", "2"])))

    def own_heads(self) -> str:
        """``projects/own_heads.py --launcher torchrun --nproc 2`` on the second six-note corpus."""
        return self._once("own_heads", lambda: _run_id("own_heads", self._run(
            [sys.executable, "projects/own_heads.py", "--prepare_run", self.preps["own-two"], *OWN_HEADS_CLI,
             "--launcher", "torchrun", "--nproc", "2"])))


@pytest.fixture(scope="module")
def launched(tracking_uri, tmp_path_factory) -> Launched:
    return Launched(tracking_uri, tmp_path_factory.mktemp("launched"))


def _note_files(run_dir: Path) -> dict[str, dict[str, bytes]]:
    return {d.name: {f: (d / f).read_bytes() for f in PER_NOTE}
            for d in sorted((run_dir / "notes").iterdir()) if (d / "_DONE").is_file()}


def _events_run_dir(root: Path, run_id: str) -> Path:
    return root / "work" / run_id


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_events_on_two_processes_equal_one_process(launched, tmp_path, launcher):
    """``mlflow run -e events -P launcher=torchrun -P nproc=2`` (or ``accelerate launch``): one
    run (the launched one), every note written once by one of the ranks, the same bytes as one
    process's run."""
    root = launched.root
    one_id = launched.one()["events"]
    two = launched.events(launcher)
    out = two.stdout + two.stderr
    assert two.returncode == 0, out[-4000:]
    assert "events [rank 1/2]" in out and "events [rank 0/2]" in out, out[-3000:]
    two_id = re.search(r"mistill events: run ([0-9a-f]{32})", out).group(1)
    launched_id = re.search(r"Run \(ID '([0-9a-f]{32})'\) succeeded", out).group(1)
    assert launched_id == two_id  # rank 0 adopted the run `mlflow run` opened
    assert list(runs_of(f"mistill/{launched.names[launcher]}", stage="events")["run_id"]) == [two_id]

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


def _files(root: Path, run_id: str, subdir: str, names: tuple[str, ...]) -> dict[str, dict[str, bytes]]:
    base = root / "work" / run_id / subdir
    return {d.name: {f: (d / f).read_bytes() for f in names} for d in sorted(base.iterdir()) if (d / "_DONE").is_file()}


def _run_id(stage_name: str, proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    said = "\n".join(line for line in out.splitlines() if line.startswith("mistill "))  # every rank's errors
    assert proc.returncode == 0, said + "\n" + out[-3000:]
    found = re.findall(rf"mistill {stage_name}: run ([0-9a-f]{{32}})", out)
    assert len(found) == 1, out[-3000:]  # printed by rank 0 only
    return found[0]


def test_attribute_and_knockin_on_two_processes_equal_one_process(launched, tmp_path):
    """``-e attribute -P launcher=torchrun -P nproc=2`` (notes in waves: each note's running
    global ranking from every note before it) and a 2-process ``knockin`` (steps in waves, clean
    reads exchanged) write the bytes one process writes, and the same global sets and tables.
    Five notes on two ranks: the last wave has one note, the knock-in a wrapped donor step.
    Each reads events of the same notes (one process's and the torchrun pass's, the same bytes)."""
    root = launched.root
    one_att, one_kin = launched.one()["attribute"], launched.one()["knockin"]
    two_att, two_kin = launched.attribute(), launched.knockin()

    client = MlflowClient()
    for run_id in (two_att, two_kin):
        assert client.get_run(run_id).info.status == "FINISHED"
    for (a, b), files in (((one_att, two_att), ("attribution.npz", "selftest.json")),
                          ((one_kin, two_kin), ("necessity.jsonl", "knockin.jsonl"))):
        mine, theirs = _files(root, a, "notes", files), _files(root, b, "notes", files)
        assert len(mine) == 5 and mine == theirs
    sets = [json.loads(Path(client.download_artifacts(r, "head_sets.json", str(tmp_path / r))).read_text())
            for r in (one_att, two_att)]
    assert {k: v for k, v in sets[0].items() if k != "meta"} == {k: v for k, v in sets[1].items() if k != "meta"}
    tables = [Path(client.download_artifacts(r, "sets_table.csv", str(tmp_path / r))).read_text()
              for r in (one_kin, two_kin)]
    assert tables[0] == tables[1] and len(tables[0].splitlines()) > 2


def test_own_heads_on_two_processes_equals_one_process(launched):
    """``own_heads`` of a model on two processes: its ranking steps (events, attribute) run on
    both ranks inside the launch, the notes' readouts are the one-process bytes, and the own
    generations are shared between the ranks."""
    root = launched.root
    one, two = launched.one()["own_heads"], launched.own_heads()
    client = MlflowClient()
    run = client.get_run(two)
    assert run.info.status == "FINISHED"
    ranking = client.get_run(run.data.tags["mistill.rank_attribute"])
    assert ranking.info.status == "FINISHED" and ranking.data.tags.get("mistill.stage") == "attribute"
    files = ("m4.json", "readside.json", "m5.json")
    mine, theirs = _files(root, one, "notes", files), _files(root, two, "notes", files)
    assert len(mine) == 6 and mine == theirs
    m_one, m_two = client.get_run(one).data.metrics, run.data.metrics
    assert m_one == m_two and "own/coverage/n_generated" in m_two and m_two["own/coverage/n_generated"] == 6


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
                max_steps=2, lr=1e-3)
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
    # the first loss is of the same weights (only the summation order differs); the second is of
    # the weights after one update, which may differ in the few entries whose near-zero gradient
    # flipped sign (at most 0.1% of the entries, asserted below). The update moves the loss by
    # about 0.2 nats; 1e-4 of the loss (about 2e-3 nats) is 1% of that move (measured: 2e-6)
    assert len(history["one"]) == 2 and history["two"][0] == pytest.approx(history["one"][0], rel=1e-3)
    assert history["two"][1] == pytest.approx(history["one"][1], rel=1e-4)
    assert history["one"][1] != history["one"][0]  # the update changed the loss: the comparison is not vacuous
    states = {k: torch.load(root / "work" / r / "trainer" / "trainer_state.pt", weights_only=False)
              for k, r in runs.items()}
    assert states["one"]["step"] == states["two"]["step"] == 2
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


@pytest.fixture(scope="module")
def mistill_inputs(tracking_uri, tmp_path_factory, pinned_code_version):
    """Targets and the student's own ranking for three synthetic notes (the Mistill arms' inputs)."""
    from stage_fixtures import tiny_distill_inputs

    return tiny_distill_inputs(tmp_path_factory.mktemp("fsdp-root"), "fsdp", "tiny:qwen3:seed=2", teacher_split="")


def test_fp32_mistill_on_two_processes_shards_and_equals_one_process(mistill_inputs, tmp_path):
    """The fp32 Mistill arm on two gloo processes runs under FSDP (``sharding=auto``): a global
    batch of 3 (two examples on one rank, one and a zero-weight repeat on the other), one
    optimizer step. Losses and weights equal one process's (both with one thread), up to the
    sign of Adam's first step on gradient entries that round differently when summed in
    another order; the checkpoint saved from the gathered weights equals the trainer's state."""
    import torch
    from safetensors.torch import load_file

    from mistill.models.loading import load_model
    from mistill.tracking.models import HF_SUBDIR, MODEL_ARTIFACT

    root = mistill_inputs["root"]
    ids = mistill_inputs["ids"]
    args = dict(targets_run=ids["targets"], student_attribute_run=ids["student_attribute"],
                student="tiny:qwen3:seed=2", arm="mistill-fp32", grad_accum=3, max_steps=1, lr=1e-3)
    frozen = freeze_source(tmp_path / "src")
    env = {**subprocess_env(os.environ["MLFLOW_TRACKING_URI"], root), "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "projects/train.py", *(f"--{k}={v}" for k, v in args.items())]
    runs, logs = {}, {}
    for name, extra in (("one", ["--register", "false"]),
                        ("two", ["--register", "true", "--launcher", "torchrun", "--nproc", "2"])):
        proc = subprocess.run(base + extra, cwd=frozen, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        found = re.findall(r"mistill train: run ([0-9a-f]{32})", proc.stdout)
        assert len(found) == 1, proc.stdout[-2000:]
        runs[name], logs[name] = found[0], proc.stdout + proc.stderr
    client = MlflowClient()
    assert [client.get_run(runs[k]).data.tags["mistill.sharding"] for k in ("one", "two")] == ["replicate", "fsdp"]
    logged = sorted(k for k in client.get_run(runs["one"]).data.metrics if k.startswith("train/"))
    assert {"train/loss", "train/grad_norm"} <= set(logged) and any("attention" in k for k in logged), logged
    assert "train/step_seconds" in logged  # the step's wall time: the machine's, not compared
    for key in [k for k in logged if k.split("/")[-1] not in COST_METRICS]:
        # the loss, each mechanism term, the gradient norm, the learning rate, the notes per step
        one, two = (client.get_run(runs[k]).data.metrics.get(key) for k in ("one", "two"))
        assert two == pytest.approx(one, rel=1e-4, abs=1e-7), key
    states = {k: torch.load(root / "work" / r / "trainer" / "trainer_state.pt", weights_only=False)
              for k, r in runs.items()}
    assert states["one"]["step"] == states["two"]["step"] == 1
    # the optimizer state of the sharded run was gathered whole, keyed by parameter name
    assert set(states["two"]["optimizer"]["state"]) == set(states["one"]["optimizer"]["state"])
    before = load_model("tiny:qwen3:seed=2").model.state_dict()
    moved, off, total = 0.0, 0, 0
    for key, value in states["one"]["model"].items():
        other = states["two"]["model"][key]
        assert value.dtype == other.dtype == torch.float32
        close = torch.isclose(other, value, rtol=1e-5, atol=1e-7)
        off += int((~close).sum())
        total += value.numel()
        assert float((other - value).abs().max()) <= 2 * args["lr"] * 1.01, key
        moved = max(moved, float((value - before[key].float()).abs().max()))
    assert off <= total * 1e-3, (off, total)
    assert moved > 1e-4
    saved = load_file(root / "work" / runs["two"] / MODEL_ARTIFACT / HF_SUBDIR / "model.safetensors")
    for key, value in saved.items():
        torch.testing.assert_close(value.float(), states["two"]["model"][key].float(), rtol=0, atol=0)


_RESUME_SCRIPT = """
import sys
from pathlib import Path

import torch

from mistill.distill.trainer import RecipeConfig, Trainer, prepare_student
from mistill.distributed import current_world, init_world
from mistill.models.loading import tiny_model

g = torch.Generator().manual_seed(0)
data = [torch.randint(0, 3000, (24,), generator=g) for _ in range(5)]


def step(model, idx):
    ids = data[idx][None]
    loss = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1].float(), ids[0, 1:])
    return loss, {"ce": float(loss.detach())}


def run(phase, state_dir, out):
    lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
    recipe = RecipeConfig(seed=3, precision="fp32", epochs=2, lr=1e-3, grad_accum=2, checkpoint_every=1)
    logs = []
    trainer = Trainer(prepare_student(lm.model, recipe), 5, recipe, step, state_dir=state_dir,
                      log=lambda m, s: logs.append((s, m["ce"])), world=current_world())
    if phase == "resume":
        assert trainer.load_state() and trainer.step == 3, trainer.step
    trainer.train(stop_after=3 if phase == "crash" else None, progress=False)
    model_state = trainer.full_state()[0]  # under FSDP every rank gathers, rank 0 gets it
    if world.leader:
        torch.save({"model": model_state, "logs": logs, "step": trainer.step, "fsdp": trainer.fsdp}, out)


world = init_world("cpu")
args = sys.argv[1:]
for i in range(0, len(args), 3):  # phase, state dir, output file; one trainer after another
    run(args[i], Path(args[i + 1]), Path(args[i + 2]))
"""


def test_training_resumes_on_another_world_size(tmp_path):
    """Three optimizer steps on two gloo processes (fp32 master weights, so sharded by FSDP;
    rank 0 saves the gathered state after each), the rest of the schedule resumed by one
    process from that state, and the other way round: the weights and losses of one process's
    uninterrupted run, to float32 summation order (the ranks' shares summed apart)."""
    import torch

    script = tmp_path / "resume_trainer.py"
    script.write_text(_RESUME_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def run(*cmd: str) -> None:
        proc = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

    # each launch runs its trainers one after another, each from a fresh model: the full run and
    # three steps in one process; three steps on two processes and, on two processes, the rest of
    # the one-process crash; then one process resumes the two-process crash
    run(sys.executable, str(script), "full", str(tmp_path / "full"), str(tmp_path / "full.pt"),
        "crash", str(tmp_path / "one"), str(tmp_path / "crash1.pt"))
    run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
        "crash", str(tmp_path / "two"), str(tmp_path / "crash.pt"),
        "resume", str(tmp_path / "one"), str(tmp_path / "resumed2.pt"))
    run(sys.executable, str(script), "resume", str(tmp_path / "two"), str(tmp_path / "resumed.pt"))
    full, crash, resumed, crash1, resumed2 = (torch.load(tmp_path / f"{n}.pt")
                                              for n in ("full", "crash", "resumed", "crash1", "resumed2"))
    assert full["step"] == 6 and crash["step"] == crash1["step"] == 3 and resumed["step"] == resumed2["step"] == 6
    assert crash["fsdp"] and resumed2["fsdp"] and not (full["fsdp"] or resumed["fsdp"] or crash1["fsdp"])
    for first, rest in ((crash, resumed), (crash1, resumed2)):
        assert [ce for _, ce in first["logs"] + rest["logs"]] == pytest.approx([ce for _, ce in full["logs"]],
                                                                               rel=1e-5)
        moved = 0.0
        for key, value in full["model"].items():
            torch.testing.assert_close(rest["model"][key], value, rtol=1e-4, atol=1e-6)
            moved = max(moved, float((first["model"][key] - value).abs().max()))
        assert moved > 1e-4  # the last three steps changed the weights: the resume did work
