"""Leases on runs, with real processes against the real MLflow server: two identical stages make
one run, a second process waits for a live run and reuses it, a killed owner is taken over at
once and only the missing notes run, a FINISHED run's status never changes, a process that lost
its lease stops writing; per-note artifacts are verified against their ``_DONE`` checksums."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.errors import MistillInputError
from mistill.stages.common import RunReader
from mistill.tracking.lease import (TAG_LEASE_GENERATION, TAG_LEASE_HEARTBEAT, TAG_LEASE_OWNER, LeaseError,
                                    claim, owner_known_dead)
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.runs import StageRun

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("lease_worker.py")


@dataclasses.dataclass(frozen=True)
class LeaseTestConfig(Config):
    n_notes: int = 3


def _corpus() -> str:
    return f"lease-{uuid.uuid4().hex[:8]}"


def _env(tracking_uri: str, root: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"MLFLOW_TRACKING_URI": tracking_uri, "MISTILL_ROOT": str(root), "PYTHONUNBUFFERED": "1",
                "MLFLOW_DISABLE_TELEMETRY": "true", **extra})
    for key in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        env.pop(key, None)
    return env


def _worker(corpus: str, count: Path, n: int, sleep_s: float, env: dict[str, str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), corpus, str(count), str(n), str(sleep_s), *extra],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _runs(corpus: str, view: int = ViewType.ALL) -> list:
    client = MlflowClient()
    exp = client.get_experiment_by_name(f"mistill/{corpus}")
    if exp is None:
        return []
    return [r for r in client.search_runs([exp.experiment_id], run_view_type=view)
            if r.data.tags.get("mistill.stage") == "lease-test"]


def _counts(path: Path) -> Counter:
    return Counter(line.split()[0] for line in path.read_text().splitlines()) if path.exists() else Counter()


def _wait_for_first_note(root: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not list((root / "work").glob("*/notes/n0/_DONE")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the first note never finished"
        time.sleep(0.05)


def _read_line_until(proc: subprocess.Popen, needle: str, timeout: float = 120) -> str:
    """Read ``proc``'s stderr line by line until a line holds ``needle``; returns that line."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        if sel.select(timeout=0.5):
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            if needle in line:
                return line
    raise AssertionError(f"no line with {needle!r} on stderr: {''.join(seen)[-3000:]}")


def test_two_identical_stages_started_together_make_one_run(tracking_uri, tmp_path):
    corpus, count, root = _corpus(), tmp_path / "count.txt", tmp_path / "root"
    env = _env(tracking_uri, root)
    procs = [_worker(corpus, count, 3, 0.3, env) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    runs = _runs(corpus)
    assert len(runs) == 1, [(r.info.run_id, r.info.status) for r in runs]
    assert runs[0].info.status == "FINISHED"
    assert {out.strip().splitlines()[-1] for out, _ in outs} == {f"run {runs[0].info.run_id}"}
    assert _counts(count) == Counter({"n0": 1, "n1": 1, "n2": 1})  # every note computed once


def test_second_process_waits_for_the_live_run_and_reuses_it(tracking_uri, tmp_path):
    corpus, count, root = _corpus(), tmp_path / "count.txt", tmp_path / "root"
    gate = tmp_path / "gate"
    env = _env(tracking_uri, root, LEASE_TEST_GATE=str(gate))
    first = _worker(corpus, count, 4, 0.1, env)
    _wait_for_first_note(root, first)
    second = _worker(corpus, count, 4, 0.1, env)
    line = _read_line_until(second, "waiting for it to finish")  # the first is held at its gate
    gate.touch()
    out1, err1 = first.communicate(timeout=180)
    out2, err2 = second.communicate(timeout=180)
    assert first.returncode == 0, err1[-3000:]
    assert second.returncode == 0, err2[-3000:]
    assert f"pid {first.pid}" in line
    runs = _runs(corpus)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert out2.strip().splitlines()[-1] == f"run {runs[0].info.run_id}"
    assert _counts(count) == Counter({f"n{i}": 1 for i in range(4)})


def test_busy_run_is_refused_on_request(tracking_uri, tmp_path):
    corpus, count, root = _corpus(), tmp_path / "count.txt", tmp_path / "root"
    gate = tmp_path / "gate"
    first = _worker(corpus, count, 4, 0.1, _env(tracking_uri, root, LEASE_TEST_GATE=str(gate)))
    _wait_for_first_note(root, first)
    second = _worker(corpus, count, 4, 0.1, _env(tracking_uri, root, MISTILL_ON_BUSY="refuse"))
    _, err2 = second.communicate(timeout=120)
    gate.touch()
    first.communicate(timeout=180)
    assert second.returncode != 0
    assert "LeaseError" in err2 and "being worked on by run" in err2 and f"pid {first.pid}" in err2
    assert first.returncode == 0
    assert [r.info.status for r in _runs(corpus)] == ["FINISHED"]


def test_killed_owner_is_taken_over_at_once_and_only_missing_notes_run(tracking_uri, tmp_path):
    corpus, count, root = _corpus(), tmp_path / "count.txt", tmp_path / "root"
    env = _env(tracking_uri, root)  # default time to live: 120 s; a dead local owner needs none
    crashed = _worker(corpus, count, 4, 0.05, env, "1")
    crashed.communicate(timeout=120)
    assert crashed.returncode == -9
    (run,) = _runs(corpus)
    assert run.info.status == "RUNNING"
    assert owner_known_dead(run.data.tags[TAG_LEASE_OWNER])
    start = time.monotonic()
    again = _worker(corpus, count, 4, 0.05, env)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-3000:]
    assert time.monotonic() - start < 60  # not the 120 s time to live
    (final,) = _runs(corpus)
    assert final.info.run_id == run.info.run_id and final.info.status == "FINISHED"
    assert final.data.tags[TAG_LEASE_GENERATION] == "1"
    assert _counts(count) == Counter({f"n{i}": 1 for i in range(4)})


def _stage(corpus: str, root: Path, **kw) -> StageRun:
    return StageRun("lease-test", LeaseTestConfig(), corpus=corpus, guard=PrivacyGuard([], "synthetic"),
                    resume=True, root=root, code_version="lease-test-v1", **kw)


def test_finished_run_status_never_changes(tracking_uri, tmp_path):
    corpus = _corpus()
    client = MlflowClient()
    with pytest.raises(RuntimeError, match="boom"):
        with _stage(corpus, tmp_path / "root") as run:
            client.set_terminated(run.run_id, "FINISHED")  # finished elsewhere meanwhile
            raise RuntimeError("boom")
    assert client.get_run(run.run_id).info.status == "FINISHED"


def test_a_process_that_lost_its_lease_stops_writing_and_leaves_the_status(tracking_uri, tmp_path):
    corpus = _corpus()
    client = MlflowClient()
    with pytest.raises(LeaseError, match="taken over"):
        with _stage(corpus, tmp_path / "root") as run:
            run.write_note("notes", "n0", {"value.json": {"i": 0}})
            client.set_tag(run.run_id, TAG_LEASE_OWNER, "elsewhere|1|1|abc")  # presumed dead, taken
            run._heartbeat.beat()
            run.write_note("notes", "n1", {"value.json": {"i": 1}})
    stored = client.get_run(run.run_id)
    assert stored.info.status == "RUNNING"  # the new owner's to end, not this process's
    assert not (tmp_path / "root" / "work" / run.run_id / "notes" / "n1").exists()


def test_a_lapsed_remote_lease_is_taken_over_and_a_live_one_waited_for(tracking_uri, tmp_path, monkeypatch):
    corpus = _corpus()
    client = MlflowClient()
    monkeypatch.setenv("MISTILL_LEASE_TTL_S", "2")
    monkeypatch.setenv("MISTILL_WAIT_MAX_S", "1")
    from mistill.tracking.runs import _pop_fluent_run

    first = _stage(corpus, tmp_path / "root").__enter__()
    run_id = first.run_id
    first._heartbeat.stop()
    _pop_fluent_run(run_id)  # from here on the run stands for another host's process
    try:
        # another host's owner with a fresh heartbeat: busy; this process gives up after 1 s
        client.set_tag(run_id, TAG_LEASE_OWNER, "otherhost|42|7|abc")
        client.set_tag(run_id, TAG_LEASE_HEARTBEAT, f"{time.time():.3f}")
        with pytest.raises(LeaseError, match="gave up"):
            _stage(corpus, tmp_path / "root").__enter__()
        # its heartbeat older than the time to live: taken over at the next generation
        client.set_tag(run_id, TAG_LEASE_HEARTBEAT, f"{time.time() - 10:.3f}")
        with _stage(corpus, tmp_path / "root") as second:
            assert second.resumed and second.run_id == run_id
            assert client.get_run(run_id).data.tags[TAG_LEASE_GENERATION] == "1"
        assert client.get_run(run_id).info.status == "FINISHED"
    finally:
        _pop_fluent_run(run_id)


def test_claims_are_exclusive(tracking_uri):
    client = MlflowClient()
    name = f"test/{uuid.uuid4().hex}"
    assert claim(client, name) is True
    assert claim(client, name) is False
    exp = client.get_experiment_by_name("mistill.lease/" + name)
    assert exp is not None and exp.lifecycle_stage == "deleted"  # hidden from the UI


# ------------------------------------------------------------------------ _DONE checksums
def test_changed_per_note_artifact_is_refused_naming_run_note_and_file(tracking_uri, tmp_path, monkeypatch):
    root = tmp_path / "root"
    monkeypatch.setenv("MISTILL_ROOT", str(root))
    corpus = _corpus()
    with _stage(corpus, root) as run:
        run.write_note("notes", "n0", {"value.json": {"i": 0}, "blob.bin": b"\x00\x01"})
    reader = RunReader(run.run_id)
    assert reader.note_file("notes", "n0", "blob.bin").read_bytes() == b"\x00\x01"
    local = root / "work" / run.run_id / "notes" / "n0" / "blob.bin"
    local.write_bytes(b"\x00\x02")
    with pytest.raises(MistillInputError) as err:
        RunReader(run.run_id).note_file("notes", "n0", "blob.bin")
    msg = str(err.value)
    assert run.run_id in msg and "note n0" in msg and "blob.bin" in msg and "sha256" in msg

    # the same file changed in the artifact store (no local copy: downloaded, then checked)
    import shutil

    shutil.rmtree(root / "work" / run.run_id)
    client = MlflowClient()
    tampered = tmp_path / "tampered" / "value.json"
    tampered.parent.mkdir()
    tampered.write_text('{"i": 5}')
    client.log_artifact(run.run_id, str(tampered), "notes/n0")
    with pytest.raises(MistillInputError, match="value.json"):
        RunReader(run.run_id).note_file("notes", "n0", "value.json")
