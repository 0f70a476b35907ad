"""Only the store's owner can change it, and a reader can tell when something else did.

Against the session's real MLflow server (started by :class:`TrackingServer`, MLflow's
``basic-auth`` app): a client without the owner's credentials is refused (HTTP 401) when it
writes over, or deletes, a FINISHED run's per-note artifacts; a ``_DONE`` marker that holds the
right sha256 but no signature, a wrong one, or one copied from another note is refused, naming
the run and the file; a tampered local cache is never used as is; the store's files are
owner-only; a step launched by a workflow dies with its launcher.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import requests
from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.errors import MistillInputError
from mistill.io import sha256_file
from mistill.stages.common import RunReader
from mistill.tracking.auth import CREDENTIALS_FILE, sign_done
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.runs import StageRun

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class SecurityTestConfig(Config):
    n_notes: int = 2


def _finished_run(root: Path) -> StageRun:
    """A FINISHED run with two notes, each with ``events.jsonl`` and ``log.txt``."""
    corpus = f"sec-{uuid.uuid4().hex[:8]}"
    with StageRun("security-test", SecurityTestConfig(), corpus=corpus,
                  guard=PrivacyGuard([], "synthetic"), resume=True, root=root,
                  code_version="security-test-v1") as run:
        for nid in ("n0", "n1"):
            run.write_note("notes", nid, {"events.jsonl": f'{{"note": "{nid}", "margin": 1.5}}\n',
                                          "log.txt": nid})
    return run


def _artifact_url(uri: str, client: MlflowClient, run_id: str, path: str) -> str:
    run = client.get_run(run_id)
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")
    base = run.info.artifact_uri[len("mlflow-artifacts:/"):].strip("/")
    return f"{uri}/api/2.0/mlflow-artifacts/artifacts/{base}/{path}"


def _store_bytes(client: MlflowClient, run_id: str, path: str, dst: Path) -> bytes:
    dst.mkdir(parents=True, exist_ok=True)
    return Path(client.download_artifacts(run_id, path, str(dst))).read_bytes()


@pytest.fixture()
def finished(tracking_uri, tmp_path, monkeypatch):
    root = tmp_path / "root"
    monkeypatch.setenv("MISTILL_ROOT", str(root))
    return _finished_run(root), root


def test_unauthenticated_writes_to_a_finished_run_are_refused(tracking_uri, finished, tmp_path):
    run, _ = finished
    client = MlflowClient()
    events = _artifact_url(tracking_uri, client, run.run_id, "notes/n0/events.jsonl")
    done = _artifact_url(tracking_uri, client, run.run_id, "notes/n0/_DONE")
    before = _store_bytes(client, run.run_id, "notes/n0/events.jsonl", tmp_path / "before")

    for auth in (None, ("mistill", "not-the-password"), ("admin", "password1234")):
        put = requests.put(events, data=b'{"note": "n0", "margin": -9.0}\n', auth=auth, timeout=30)
        assert put.status_code in (401, 403), (auth, put.status_code, put.text[:200])
        delete = requests.delete(done, auth=auth, timeout=30)
        assert delete.status_code in (401, 403), (auth, delete.status_code)
        # nor can it read the store, or make a run
        get = requests.get(f"{tracking_uri}/api/2.0/mlflow/runs/get", params={"run_id": run.run_id},
                           auth=auth, timeout=30)
        assert get.status_code in (401, 403), (auth, get.status_code)
        create = requests.post(f"{tracking_uri}/api/2.0/mlflow/experiments/create",
                               json={"name": f"intruder-{uuid.uuid4().hex[:6]}"}, auth=auth, timeout=30)
        assert create.status_code in (401, 403), (auth, create.status_code)
    assert requests.get(f"{tracking_uri}/health", timeout=30).status_code == 200

    # the store is unchanged, and the project's own (authenticated) client reads it as written
    assert _store_bytes(client, run.run_id, "notes/n0/events.jsonl", tmp_path / "after") == before
    names = {f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(run.run_id, "notes/n0")}
    assert names == {"events.jsonl", "log.txt", "_DONE"}
    assert b'"margin": 1.5' in RunReader(run.run_id).note_file("notes", "n0", "events.jsonl").read_bytes()


def _upload(client: MlflowClient, run_id: str, tmp: Path, name: str, content: bytes) -> None:
    src = tmp / uuid.uuid4().hex / name
    src.parent.mkdir(parents=True)
    src.write_bytes(content)
    client.log_artifact(run_id, str(src), "notes/n0")


def test_a_forged_done_is_refused_naming_run_and_file(tracking_uri, finished, tmp_path):
    """Even a writer with the store's credentials but not its key (a forged file plus a _DONE
    holding the file's sha256) is caught when the run is read."""
    run, root = finished
    client = MlflowClient()
    forged = b'{"note": "n0", "margin": -9.0}\n'
    work = root / "work" / run.run_id
    stored = json.loads(_store_bytes(client, run.run_id, "notes/n0/_DONE", tmp_path / "orig"))
    assert stored["signature"]["alg"] == "hmac-sha256"
    digest_path = tmp_path / "forged.jsonl"
    digest_path.write_bytes(forged)
    files = {**stored["files"], "events.jsonl": sha256_file(digest_path)}

    key = b"\x01" * 32
    other = sign_done({"files": stored["files"]}, run_id=run.run_id, subdir="notes", note_id="n1")
    for name, done in {
        "no signature": {"files": files},
        "a made-up signature": {"files": files, "signature": {"alg": "hmac-sha256", "value": "0" * 64}},
        "another key": sign_done({"files": files}, run_id=run.run_id, subdir="notes", note_id="n0", key=key),
        "another note's marker": other,
    }.items():
        _upload(client, run.run_id, tmp_path, "events.jsonl", forged)
        _upload(client, run.run_id, tmp_path, "_DONE", json.dumps(done).encode())
        import shutil

        shutil.rmtree(work, ignore_errors=True)  # nothing cached: read from the store
        with pytest.raises(MistillInputError) as err:
            RunReader(run.run_id).note_file("notes", "n0", "events.jsonl")
        msg = str(err.value)
        assert run.run_id in msg and "notes/n0/_DONE" in msg and "signature" in msg, (name, msg)


def test_a_tampered_local_cache_is_not_used(tracking_uri, finished):
    run, root = finished
    reader = RunReader(run.run_id)
    path = reader.note_file("notes", "n0", "events.jsonl")  # cached in the work dir now
    done_path = path.parent / "_DONE"
    original = done_path.read_text()

    # the cached file and a cached _DONE that matches it, unsigned: refused
    path.write_bytes(b'{"note": "n0", "margin": -9.0}\n')
    done = json.loads(original)
    done["files"]["events.jsonl"] = sha256_file(path)
    done.pop("signature")
    done_path.write_text(json.dumps(done))
    with pytest.raises(MistillInputError, match="signature"):
        RunReader(run.run_id).note_file("notes", "n0", "events.jsonl")
    # with the store's marker back, the changed file no longer matches its record
    done_path.write_text(original)
    with pytest.raises(MistillInputError, match="sha256"):
        RunReader(run.run_id).note_file("notes", "n0", "events.jsonl")

    # a run-level file is read from the store, whatever the work dir holds
    config = reader.work_dir / "config.json"
    RunReader(run.run_id).config  # noqa: B018  (cached now)
    config.write_text(json.dumps({"config": {"n_notes": 99}}))
    assert RunReader(run.run_id).config["n_notes"] == 2


def test_resume_refuses_an_unsigned_local_done(tracking_uri, tmp_path, monkeypatch):
    root = tmp_path / "root"
    monkeypatch.setenv("MISTILL_ROOT", str(root))
    corpus = f"sec-{uuid.uuid4().hex[:8]}"

    def stage() -> StageRun:
        return StageRun("security-test", SecurityTestConfig(), corpus=corpus,
                        guard=PrivacyGuard([], "synthetic"), resume=True, root=root,
                        code_version="security-test-v1")

    with pytest.raises(RuntimeError, match="crash"):
        with stage() as run:
            run.write_note("notes", "n0", {"log.txt": "n0"})
            raise RuntimeError("crash")
    note = root / "work" / run.run_id / "notes" / "n1"
    note.mkdir(parents=True)
    (note / "log.txt").write_text("forged")
    (note / "_DONE").write_text(json.dumps({"files": {"log.txt": sha256_file(note / "log.txt")}}))
    with pytest.raises(MistillInputError) as err:
        with stage() as again:
            again.finished_notes("notes")
    assert run.run_id in str(err.value) and "notes/n1/_DONE" in str(err.value)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_store_files_are_owner_only(tracking_uri, tracking_root, finished):
    run, _ = finished
    root = tracking_root  # the session server's (another test's server may have set the credentials' env)
    record = json.loads((root / "server.json").read_text())
    assert record["uri"] == tracking_uri and record["auth"] == "basic-auth"
    assert _mode(root) == 0o700
    for name in ("mlflow.db", "auth.db", CREDENTIALS_FILE, "auth.ini", "server.log", "server.json"):
        assert (root / name).is_file(), name
        assert _mode(root / name) == 0o600, (name, oct(_mode(root / name)))
    artifacts = root / "artifacts"
    seen = 0
    for path in [artifacts, *artifacts.rglob("*")]:
        assert _mode(path) == (0o700 if path.is_dir() else 0o600), (path, oct(_mode(path)))
        seen += path.name == "_DONE"
    assert seen >= 2  # the run's markers were among them
    assert "password" not in (root / "auth.ini").read_text()


LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    from mistill.parent_watch import launching
    with launching():
        child = subprocess.Popen(["bash", "-c", sys.argv[1]])
    print(child.pid, flush=True)
    time.sleep(120)
""")

STEP = ("from mistill.parent_watch import die_with_launcher; import os, time; "
        "die_with_launcher(); open({ready!r}, 'w').write(str(os.getpid())); time.sleep(120)")


@pytest.mark.parametrize("shell", ["exec", "shell-in-between"])
def test_a_launched_step_dies_with_its_launcher(tmp_path, shell):
    ready = tmp_path / "ready"
    step = f"{sys.executable} -c \"{STEP.format(ready=str(ready))}\""
    command = step if shell == "exec" else f"{step}; true"  # bash stays between the two
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, command], cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() or not ready.read_text():
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.1)
        pid = int(ready.read_text())
        launcher.kill()  # SIGKILL: the launcher gets no chance to clean up
        launcher.wait()
        deadline = time.monotonic() + 15
        while _running(pid):
            assert time.monotonic() < deadline, f"step {pid} outlived its launcher"
            time.sleep(0.1)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if ready.exists() and ready.read_text() and _running(int(ready.read_text())):
            os.kill(int(ready.read_text()), signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
