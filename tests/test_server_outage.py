"""A tracking server that goes away: bounded waits, exit code 3 with a clear message, and a
rerun that resumes once the server is back on the same URI.

The outage tests kill a server of their own (in ``tmp_path``, on a free port), never the
session's shared server."""

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

from mistill.errors import MistillInputError, TrackingUnavailableError
from mistill.tracking.connection import (SERVER_TIMEOUT_ENV, client_timeouts,
                                         configure_client_timeouts, tracking_errors,
                                         unavailable_error)
from mistill.tracking.server import TrackingServer, _group_alive, free_port, port_is_free
from stage_fixtures import (REPO, SLOW_TINY, TINY, freeze_source, port_outside_the_ephemeral_range,
                            subprocess_env, unique)

BOUND_S = 15
"""``MISTILL_SERVER_TIMEOUT_S`` of the stages under test: the most one request may take."""

MLFLOW_VARS = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
               "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "MLFLOW_HTTP_REQUEST_TIMEOUT")


# ------------------------------------------------------------------------------- the settings
@pytest.mark.parametrize("budget", [1.0, 2.5, 5.0, 15.0, 20.0, 60.0, 120.0, 600.0, 3600.0])
def test_client_timeouts_fit_the_budget(budget: float) -> None:
    settings = client_timeouts(budget)
    assert settings.worst_case_s <= budget
    assert 0 <= settings.max_retries <= 10 and 0 <= settings.backoff_factor <= 120
    assert settings.request_timeout >= 1


def test_default_budget_retries_a_restart_and_waits_for_a_slow_answer() -> None:
    settings = client_timeouts(60.0)
    # a server that refuses connections is retried for ~20 s (a restart takes seconds) ...
    assert settings.max_retries >= 3 and settings.backoff_s >= 15
    # ... and one attempt may wait 10 s for a loaded server's answer
    assert settings.request_timeout >= 10
    # MLflow's own defaults wait minutes: the budget is what bounds them
    assert settings.worst_case_s <= 60


def test_configure_sets_mlflow_defaults_but_never_overrides_the_user(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in MLFLOW_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MISTILL_SERVER_TIMEOUT_APPLIED", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "77")  # the user's own
    monkeypatch.setenv(SERVER_TIMEOUT_ENV, "60")
    derived = configure_client_timeouts()
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "77"
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == str(derived.max_retries)
    assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == str(derived.backoff_factor)

    # another budget later (or in a subprocess) replaces what mistill set, not what the user set
    monkeypatch.setenv(SERVER_TIMEOUT_ENV, "5")
    smaller = configure_client_timeouts()
    assert smaller.max_retries < derived.max_retries
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == str(smaller.max_retries)
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "77"

    monkeypatch.setenv(SERVER_TIMEOUT_ENV, "soon")
    with pytest.raises(MistillInputError, match=SERVER_TIMEOUT_ENV):
        configure_client_timeouts()


def test_importing_the_tracking_package_bounds_mlflow_requests(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in MLFLOW_VARS and k != "MISTILL_SERVER_TIMEOUT_APPLIED"}
    env[SERVER_TIMEOUT_ENV] = str(BOUND_S)
    code = ("import json, os, mistill.tracking; "
            f"print(json.dumps({{k: os.environ.get(k) for k in {MLFLOW_VARS!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == client_timeouts(BOUND_S).env()


# --------------------------------------------------------------------- recognising an outage
def test_only_a_server_that_cannot_be_reached_is_translated(
        tracking_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    for name, value in client_timeouts(3.0).env().items():  # one quick attempt, no retry
        monkeypatch.setenv(name, value)
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(MlflowException) as caught:
        MlflowClient(tracking_uri=dead).get_experiment_by_name("mistill/nothing")
    error = unavailable_error(caught.value, run_id="abc123")
    assert isinstance(error, TrackingUnavailableError)
    assert error.uri == dead and error.run_id == "abc123"
    assert str(error).startswith(f"tracking server {dead} unreachable after retrying for up to")
    assert "Connection refused" in error.reason and "object at 0x" not in error.reason
    assert "the run abc123 is left as it was; rerun the same command to resume it" in str(error)

    # a wrapper raised while handling the failure (a stage's "no such run") is the outage too
    with pytest.raises(TrackingUnavailableError) as wrapped:
        with tracking_errors(run_id="abc123"):
            try:
                MlflowClient(tracking_uri=dead).get_run("abc123")
            except MlflowException:
                raise MistillInputError("no run 'abc123' on the tracking server") from None
    assert wrapped.value.uri == dead
    assert isinstance(wrapped.value.__cause__, MistillInputError)

    # the server answered with an error: not an outage, passed on unchanged
    with pytest.raises(MlflowException) as answered:
        with tracking_errors():
            MlflowClient(tracking_uri=tracking_uri).get_run("0" * 32)
    assert not isinstance(answered.value, TrackingUnavailableError)
    assert unavailable_error(answered.value) is None
    assert unavailable_error(ConnectionRefusedError("not MLflow's")) is None


# ------------------------------------------------------------------------------ the outages
def _stage_env(uri: str, root: Path) -> dict[str, str]:
    env = subprocess_env(uri, root)
    env[SERVER_TIMEOUT_ENV] = str(BOUND_S)
    return env


def _assert_clear_unreachable_message(stderr: str, stage: str, uri: str) -> None:
    assert f"mistill {stage}: tracking server {uri} unreachable after retrying for up to " \
           f"{BOUND_S} s" in stderr, stderr[-3000:]
    assert "rerun the same command to resume it" in stderr
    assert "Connection refused" in stderr
    assert "Traceback" not in stderr


def test_stage_against_a_dead_server_exits_3_within_the_bound(tmp_path: Path) -> None:
    port = free_port()
    assert port_is_free("127.0.0.1", port)
    uri = f"http://127.0.0.1:{port}"  # nothing listens there
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "projects/prepare.py", "--n_notes", "2",
                               "--corpus_name", unique("dead")], cwd=REPO,
                              env=_stage_env(uri, tmp_path / "root"), capture_output=True,
                              text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("prepare kept retrying a dead server for 3 minutes: requests are not bounded")
    elapsed = time.monotonic() - started
    assert proc.returncode == 3, proc.stderr[-3000:]
    _assert_clear_unreachable_message(proc.stderr, "prepare", uri)
    # interpreter start and imports take most of it on a loaded machine; MLflow's defaults
    # alone would retry this request for about 4 minutes
    assert elapsed < 150


def test_server_killed_mid_stage_exit_3_within_the_bound_and_rerun_resumes(
        tmp_path: Path) -> None:
    frozen = freeze_source(tmp_path / "src")  # one code version for the run and its rerun
    server_root, root = tmp_path / "server", tmp_path / "root"
    server = TrackingServer(root=server_root, port=port_outside_the_ephemeral_range())
    uri = server.start()
    port = int(uri.rsplit(":", 1)[1])
    env = _stage_env(uri, root)
    try:
        prep = subprocess.run([sys.executable, "projects/prepare.py", "--corpus_name",
                               unique("outage"), "--n_notes", "2", "--model", TINY],
                              cwd=frozen, env=env, capture_output=True, text=True, timeout=300)
        assert prep.returncode == 0, prep.stderr[-3000:]
        prep_id = re.search(r"mistill prepare: run (\w+)", prep.stdout).group(1)

        cmd = [sys.executable, "projects/events.py", "--prepare_run", prep_id, "--model",
               SLOW_TINY, "--n_null", "4"]
        proc = subprocess.Popen(cmd, cwd=frozen, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not (hits := list((root / "work").glob("*/notes/*/_DONE"))):
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "no note finished within 240 s"
                time.sleep(0.01)
            record = json.loads((server_root / "server.json").read_text())
            os.killpg(record["pgid"], signal.SIGKILL)  # the server crashes mid-stage
            killed = time.monotonic()
            server._proc.wait(timeout=30)
            try:
                _, err = proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                pytest.fail("the stage kept retrying the dead server for 3 minutes: requests "
                            "are not bounded")
            after_kill = time.monotonic() - killed
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        run_id = hits[0].parents[2].name
        assert not _group_alive(record["pgid"])
        assert proc.returncode == 3, err[-3000:]
        _assert_clear_unreachable_message(err, "events", uri)
        # the failing request gives up within the bound (refused connections: ~3 s of backoff);
        # ending the run costs at most one more bound. MLflow's defaults: over 4 minutes.
        assert after_kill < 2 * BOUND_S, f"exited {after_kill:.1f} s after the server died"

        # the server comes back on the same port and root; the same command resumes the run
        assert TrackingServer(root=server_root, port=port).start() == uri
        again = subprocess.run(cmd, cwd=frozen, env=env, capture_output=True, text=True,
                               timeout=400)
        assert again.returncode == 0, again.stderr[-3000:]
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        # a rerun resumes the run the dead server left RUNNING (its owner process is gone, so
        # its lease has lapsed), under the same id
        assert f"mistill events: run {run_id}" in again.stdout, again.stdout[-2000:]
        assert client.get_run(run_id).info.status == "FINISHED"
        # the error names the run it was writing
        assert f"the run {run_id} is left as it was" in err, err[-3000:]
    finally:
        TrackingServer(root=server_root).stop()
