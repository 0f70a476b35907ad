"""The tracking server's life: start, health, reuse by PID, explicit ports, restart, stop by
process group."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from stage_fixtures import port_outside_the_ephemeral_range

from mistill.parent_watch import pid_alive
from mistill.tracking.server import (TrackingServer, _group_alive, free_port,
                                     health_ok, port_is_free)

REPO = Path(__file__).resolve().parents[1]


def _server_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mistill.tracking.server", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=180)


def _crash(root: Path, server: TrackingServer | None = None) -> dict:
    """SIGKILL the recorded server's whole process group (a crash: nothing is cleaned up, the
    record stays); return the record."""
    record = json.loads((root / "server.json").read_text())
    os.killpg(record["pgid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _group_alive(record["pgid"]) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(record["pid"], os.WNOHANG)
        time.sleep(0.05)
    if server is not None and server._proc is not None:
        server._proc.wait(timeout=10)
    assert not _group_alive(record["pgid"])
    return record


def test_session_server_is_healthy_sqlite_and_never_mlruns(tracking_uri: str) -> None:
    assert tracking_uri.startswith("http://127.0.0.1:")
    assert health_ok(tracking_uri)
    assert os.environ["MLFLOW_TRACKING_URI"] == tracking_uri
    assert not Path("mlruns").exists()


def test_start_any_port_reuse_status_cli_and_stop(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    server = TrackingServer(root=root, port=0)  # 0: any free port
    uri = server.start()
    try:
        record = json.loads((root / "server.json").read_text())
        assert uri == record["uri"] == f"http://127.0.0.1:{record['port']}"
        assert health_ok(uri)
        assert (root / "mlflow.db").is_file() and (root / "server.log").is_file()
        assert record["pgid"] == record["pid"]  # own session: the group is the tree

        # a second start (even from another instance, any port or none asked) reuses the process
        for port in (0, None, record["port"]):
            again = TrackingServer(root=root, port=port)
            assert again.start() == uri
            assert json.loads((root / "server.json").read_text())["pid"] == record["pid"]
        status = again.status()
        assert status is not None and status["healthy"] and status["pid"] == record["pid"]
        assert again.uri == uri

        cli = _server_cli("uri", "--root", str(root))
        assert cli.returncode == 0 and cli.stdout.strip() == uri
    finally:
        stopped = TrackingServer(root=root).stop()

    assert stopped
    assert not health_ok(uri)
    assert not pid_alive(record["pid"])
    assert not (root / "server.json").exists()
    assert TrackingServer(root=root).status() is None
    assert TrackingServer(root=root).stop() is False


def test_start_port_is_used_exactly_or_the_command_fails_saying_who_holds_it(
        tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    port = free_port()
    started = _server_cli("start", "--root", str(first), "--port", str(port))
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        uri = f"http://127.0.0.1:{port}"
        assert started.stdout.strip() == uri
        assert health_ok(uri)
        assert json.loads((first / "server.json").read_text())["port"] == port

        # the root's server runs on `port`: asking for another port says so, and starts nothing
        other = free_port()
        moved = _server_cli("start", "--root", str(first), "--port", str(other))
        assert moved.returncode == 2, moved.stdout
        assert f"already running on port {port}" in moved.stderr
        assert f"not on the requested port {other}" in moved.stderr
        assert "Traceback" not in moved.stderr
        assert port_is_free("127.0.0.1", other)

        # a port held by another root's server
        taken = _server_cli("start", "--root", str(second), "--port", str(port))
        assert taken.returncode == 2, taken.stdout
        assert f"port {port} on 127.0.0.1 is taken by the MLflow server of another root, " \
               f"{first}" in taken.stderr
        assert not (second / "server.json").exists()

        # a port held by a listening socket that is not an MLflow server
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen(8)
            busy_port = busy.getsockname()[1]
            refused = _server_cli("start", "--root", str(second), "--port", str(busy_port))
            assert refused.returncode == 2, refused.stdout
            assert f"port {busy_port} on 127.0.0.1 is taken by a process that is not an " \
                   f"MLflow server (pid {os.getpid()}" in refused.stderr
            assert refused.stdout == ""
            assert "Traceback" not in refused.stderr
        assert not (second / "server.json").exists()
        assert TrackingServer(root=second).status() is None
    finally:
        TrackingServer(root=first).stop()


def test_restart_after_a_crash_comes_back_on_the_same_port(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    server = TrackingServer(root=root, port=port_outside_the_ephemeral_range())
    uri = server.start()
    port = int(uri.rsplit(":", 1)[1])
    try:
        # a client holds a keep-alive connection when the server dies: the server's end of it
        # lingers in TIME_WAIT on `port` after the client lets go
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().read().strip() == b"OK"
        _crash(root, server)
        conn.close()
        time.sleep(0.2)

        restarted = _server_cli("start", "--root", str(root), "--port", str(port))
        assert restarted.returncode == 0, restarted.stderr[-2000:]
        assert restarted.stdout.strip() == uri
        assert health_ok(uri)

        # no port asked: the root's last port once it is free, so stages that were given the URI
        # find it again (on a loaded machine the kernel can take a moment to release it)
        _crash(root)
        deadline = time.monotonic() + 30
        while not port_is_free("127.0.0.1", port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert port_is_free("127.0.0.1", port), f"port {port} still taken 30 s after the crash"
        assert TrackingServer(root=root).start() == uri
        assert health_ok(uri)
    finally:
        TrackingServer(root=root).stop()


def test_stale_record_is_not_reported_live(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "server.json").write_text(json.dumps(
        {"pid": dead.pid, "port": 1, "uri": "http://127.0.0.1:1", "root": str(tmp_path)}))
    server = TrackingServer(root=tmp_path)
    assert server.status() is None
    assert server.uri is None
    cli = _server_cli("status", "--root", str(tmp_path))
    assert cli.returncode == 1 and cli.stdout.strip() == "not running"


def test_a_live_non_mlflow_pid_is_never_taken_for_the_server(tmp_path: Path) -> None:
    # PID reuse guard: a record naming a live process that is not `mlflow server` is stale,
    # so stop() must not signal it.
    (tmp_path / "server.json").write_text(json.dumps(
        {"pid": os.getpid(), "pgid": os.getpgid(0), "port": 1, "uri": "http://127.0.0.1:1",
         "root": str(tmp_path)}))
    server = TrackingServer(root=tmp_path)
    assert server.status() is None
    assert server.stop() is False
    assert pid_alive(os.getpid())
    assert not (tmp_path / "server.json").exists()
