"""The tracking server's life: start, health, reuse by PID, busy port, stop by process group."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from mistill.tracking.server import TrackingServer, _pid_alive, health_ok, port_is_free


def test_session_server_is_healthy_sqlite_and_never_mlruns(tracking_uri: str) -> None:
    assert tracking_uri.startswith("http://127.0.0.1:")
    assert health_ok(tracking_uri)
    assert os.environ["MLFLOW_TRACKING_URI"] == tracking_uri
    assert not Path("mlruns").exists()


def test_start_busy_port_reuse_status_cli_and_stop(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        busy_port = busy.getsockname()[1]
        assert not port_is_free("127.0.0.1", busy_port)

        server = TrackingServer(root=root, port=busy_port)
        uri = server.start()
        try:
            # the requested port was taken: another free one was chosen
            record = json.loads((root / "server.json").read_text())
            assert record["port"] != busy_port
            assert uri == record["uri"] == f"http://127.0.0.1:{record['port']}"
            assert health_ok(uri)
            assert (root / "mlflow.db").is_file() and (root / "server.log").is_file()
            assert record["pgid"] == record["pid"]  # own session: the group is the tree

            # a second start (even from another instance) reuses the same process
            again = TrackingServer(root=root, port=busy_port)
            assert again.start() == uri
            assert json.loads((root / "server.json").read_text())["pid"] == record["pid"]
            status = again.status()
            assert status is not None and status["healthy"] and status["pid"] == record["pid"]
            assert again.uri == uri

            cli = subprocess.run([sys.executable, "-m", "mistill.tracking.server", "uri",
                                  "--root", str(root)], capture_output=True, text=True,
                                 timeout=60)
            assert cli.returncode == 0 and cli.stdout.strip() == uri
        finally:
            stopped = TrackingServer(root=root).stop()

    assert stopped
    assert not health_ok(uri)
    assert not _pid_alive(record["pid"])
    assert not (root / "server.json").exists()
    assert TrackingServer(root=root).status() is None
    assert TrackingServer(root=root).stop() is False


def test_stale_record_is_not_reported_live(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "server.json").write_text(json.dumps(
        {"pid": dead.pid, "port": 1, "uri": "http://127.0.0.1:1", "root": str(tmp_path)}))
    server = TrackingServer(root=tmp_path)
    assert server.status() is None
    assert server.uri is None
    cli = subprocess.run([sys.executable, "-m", "mistill.tracking.server", "status",
                          "--root", str(tmp_path)], capture_output=True, text=True, timeout=60)
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
    assert _pid_alive(os.getpid())
    assert not (tmp_path / "server.json").exists()
