"""Start, reuse and stop the project's MLflow tracking server.

One server per project root (default ``.mistill/``): SQLite backend ``<root>/mlflow.db`` (or a
PostgreSQL database, :mod:`mistill.tracking.postgres`), proxied
artifacts under ``<root>/artifacts`` (clients get ``mlflow-artifacts:/`` URIs and need not share
the disk), log in ``<root>/server.log``, and a record ``<root>/server.json`` with
``{pid, pgid, port, uri, root}``. The server runs in its own process session, so one signal to its
process group stops the whole tree (the ``mlflow server`` launcher and its uvicorn worker).
The ``./mlruns`` file store is never used.

Ports: an explicitly given port is used or :meth:`TrackingServer.start` fails
(:class:`PortUnavailableError`, saying who holds it); port 0 means any free port; no port means
the root's last port if it is free, else 5000 if free, else a free one. A live server of the root
is reused, unless it listens on another port than the one explicitly asked for (an error too).

This module does not import MLflow (it only launches it), so the CLI is quick::

    python -m mistill.tracking.server start  [--root R] [--port P]   # prints the tracking URI
    python -m mistill.tracking.server stop   [--root R]
    python -m mistill.tracking.server status [--root R]              # JSON, or "not running"
    python -m mistill.tracking.server uri    [--root R]
    eval "$(python -m mistill.tracking.server env [--root R])"   # URI and credentials, for a shell

Only the store's owner can change it: the server runs MLflow's ``basic-auth`` app with the
owner as its only (admin) user, others have no permission, and its files are owner-only (umask
077; directories 700, files 600). The credentials are made at the first start and kept in
``<root>/credentials.json`` (mode 600); :meth:`TrackingServer.start` points this process's
clients at them (``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``, inherited by the
processes it launches); see :mod:`mistill.tracking.auth`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mistill.io import write_json
from mistill.parent_watch import pid_alive
from mistill.tracking.auth import (AUTH_CONFIG_FILE, AUTH_DB_FILE, CREDENTIALS_FILE, ENV_CREDENTIALS,
                                   ENV_PASSWORD, ENV_USERNAME, load_credentials, make_owner_only,
                                   use_credentials, write_auth_config)
from mistill.tracking.connection import free_port
from mistill.tracking.postgres import database_url, ensure_database, tracking_store_uri

SERVER_ENV: dict[str, str] = {
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}
"""Environment the server runs with (job execution off: healthy in ~5 s instead of ~11 s)."""

DEFAULT_PORT = 5000


class PortUnavailableError(RuntimeError):
    """An explicitly requested port cannot be used: another process listens on it, or the
    root's server runs on another port."""


def port_is_free(host: str, port: int) -> bool:
    """True iff a server could bind and listen on ``host:port`` now.

    Binds with ``SO_REUSEADDR``, as uvicorn does: connections of a stopped server lingering in
    TIME_WAIT do not make its port look taken, a listening socket does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def health_ok(uri: str, timeout: float = 2.0) -> bool:
    """True iff ``GET <uri>/health`` answers 200 with body ``OK``."""
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout) as resp:
            return resp.status == 200 and resp.read(16).strip() == b"OK"
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _is_mlflow_server(pid: int) -> bool:
    """Guard against PID reuse: the process's command line must be an ``mlflow server``."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.parent.exists():  # no /proc (macOS): trust the health check instead
        return True
    try:
        args = cmdline.read_bytes().split(b"\x00")
    except OSError:
        return False
    return b"mlflow" in b" ".join(args) and b"server" in args


def _group_alive(pgid: int) -> bool:
    """True iff a non-zombie process of process group ``pgid`` exists."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields: state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _listener(port: int) -> tuple[int | None, list[list[str]]]:
    """PID of the process listening on TCP ``port`` and the command lines of it and its two
    closest ancestors (``mlflow server`` listens through a uvicorn child); ``(None, [])`` if
    unknown (another user's process, or no ``psutil``)."""
    try:
        import psutil  # deferred: psutil only when memory is measured
    except ImportError:
        return None, []
    with contextlib.suppress(Exception):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port \
                    and conn.pid:
                lines: list[list[str]] = []
                with contextlib.suppress(Exception):
                    proc = psutil.Process(conn.pid)
                    for p in [proc, *proc.parents()[:2]]:
                        lines.append(p.cmdline())
                return conn.pid, lines
    return None, []


def _cmdline_root(cmdlines: list[list[str]]) -> str | None:
    """The project root of a ``mlflow server`` launched by :class:`TrackingServer` (the
    directory of its ``--backend-store-uri sqlite:///<root>/mlflow.db``), if any line has it."""
    for cmdline in cmdlines:
        for flag, value in zip(cmdline, cmdline[1:]):
            if flag == "--backend-store-uri" and value.startswith("sqlite:///"):
                return str(Path(value[len("sqlite:///"):]).parent)
    return None


def describe_port_holder(host: str, port: int, root: Path | None = None) -> str:
    """Who holds ``host:port``, in words: an MLflow server (of which root), or another process."""
    pid, cmdlines = _listener(port)
    command = " ".join(cmdlines[0])[:200] if cmdlines and cmdlines[0] else ""
    who = f" (pid {pid}: {command})" if pid and command else (f" (pid {pid})" if pid else "")
    if health_ok(f"http://{host}:{port}", timeout=2.0):
        other = _cmdline_root(cmdlines)
        if other is None:
            return f"an MLflow server not started by mistill{who}"
        if root is not None and Path(other) == root:
            return f"an MLflow server of this root missing from its server.json{who}"
        return f"the MLflow server of another root, {other}{who}"
    return f"a process that is not an MLflow server{who}"


class TrackingServer:
    """The MLflow tracking server of one project root.

    Args:
        root: directory holding ``mlflow.db``, ``artifacts/``, ``server.log``, ``server.json``.
        host: interface to bind (``127.0.0.1``: local clients only).
        port: the port to use, exactly (:meth:`start` fails if it is taken); 0: any free port;
            None: the root's last port if free, else 5000 if free, else a free one.
        database_url: a PostgreSQL server's ``postgresql://user@host:port/name`` to keep the
            runs in (default ``$MISTILL_DATABASE_URL``, see :mod:`mistill.tracking.postgres`);
            none: SQLite ``<root>/mlflow.db``.
    """

    def __init__(self, root: Path | str = Path(".mistill"), host: str = "127.0.0.1",
                 port: int | None = None, database_url: str | None = None) -> None:
        self.database_url = database_url
        self.root = Path(root).absolute()
        self.host = host
        self.port = None if port is None else int(port)
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def explicit_port(self) -> bool:
        """True iff a specific port was asked for (not None, not 0)."""
        return bool(self.port)

    # ------------------------------------------------------------------------------- paths
    @property
    def record_path(self) -> Path:
        return self.root / "server.json"

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    def _database_url(self) -> str | None:
        return self.database_url or database_url()

    @property
    def backend_uri(self) -> str:
        """The backend store: the PostgreSQL database of ``database_url``, else SQLite."""
        url = self._database_url()
        if url:
            return tracking_store_uri(url)
        return f"sqlite:///{self.root / 'mlflow.db'}"

    @property
    def artifacts_dir(self) -> Path:
        return self.root / "artifacts"

    @property
    def uri(self) -> str | None:
        """Tracking URI of the live server recorded for this root, or None."""
        record = self.status()
        return record["uri"] if record and record["healthy"] else None

    # ------------------------------------------------------------------------------ record
    def _read_record(self) -> dict[str, Any] | None:
        try:
            record = json.loads(self.record_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None
        if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
            return None
        return record

    def _record_live(self, record: dict[str, Any]) -> bool:
        pid = int(record["pid"])
        return pid_alive(pid) and _is_mlflow_server(pid)

    def status(self) -> dict[str, Any] | None:
        """The record ``{pid, pgid, port, uri, root, ...}`` plus ``healthy``, or None.

        None when no server is recorded for this root or the recorded process is gone.
        """
        record = self._read_record()
        if record is None or not self._record_live(record):
            return None
        return {**record, "healthy": health_ok(str(record.get("uri", "")))}

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """Exclusive lock on ``<root>/server.lock``: two stages never start two servers."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "server.lock", "a+") as fh:
            os.chmod(fh.name, 0o600)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    # ------------------------------------------------------------------------------- start
    def start(self, timeout: float = 90) -> str:
        """Start the server (or reuse the live one recorded for this root); return its URI.

        Raises :class:`PortUnavailableError` if an explicitly requested port is taken (saying by
        whom) or the root's live server listens on another port; RuntimeError (with the tail of
        ``server.log``) if the server exits or is not healthy within ``timeout`` seconds.
        """
        with self._lock():
            record = self._read_record()
            last_port: int | None = None
            if record is not None:
                last_port = record.get("port") if isinstance(record.get("port"), int) else None
                if self._record_live(record) and health_ok(str(record.get("uri", ""))):
                    return self._reused(record)
                if self._record_live(record):  # alive but not answering: starting, or wedged
                    uri = str(record.get("uri", ""))
                    if self._wait_healthy(uri, int(record["pid"]), min(timeout, 30.0)):
                        return self._reused(record)
                    self._kill(int(record["pid"]), int(record.get("pgid", record["pid"])))
                self.record_path.unlink(missing_ok=True)
            deadline = time.monotonic() + timeout
            last_error = ""
            for attempt in range(3):  # a chosen port can be taken before the server binds it
                port = self._choose_port(last_port if attempt == 0 else None)
                uri = f"http://{self.host}:{port}"
                proc = self._launch(port)
                if self._wait_healthy(uri, proc.pid, max(1.0, deadline - time.monotonic()),
                                      proc=proc):
                    self._proc = proc
                    write_json(self.record_path, {
                        "pid": proc.pid, "pgid": os.getpgid(proc.pid), "port": port, "uri": uri,
                        "root": str(self.root), "backend_store_uri": self.backend_uri,
                        "artifacts_destination": str(self.artifacts_dir), "auth": "basic-auth",
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
                    self.secure_files()
                    use_credentials(self.root)
                    return uri
                exited = proc.poll() is not None
                self._kill(proc.pid, proc.pid, proc=proc)
                last_error = self._log_tail()
                port_race = "address already in use" in last_error.lower() or \
                    "errno 98" in last_error.lower()
                if exited and port_race and self.explicit_port:
                    raise self._port_taken(port)
                if not exited or time.monotonic() >= deadline or not port_race:
                    break
            raise RuntimeError(f"MLflow server for {self.root} did not become healthy within "
                               f"{timeout:.0f} s; tail of {self.log_path}:\n{last_error}")

    def _reused(self, record: dict[str, Any]) -> str:
        """The URI of the root's live server, if it is on the port asked for."""
        uri = str(record["uri"])
        if self.explicit_port and record.get("port") != self.port:
            raise PortUnavailableError(
                f"the MLflow server of {self.root} is already running on port "
                f"{record.get('port')} ({uri}, pid {record.get('pid')}), not on the requested port "
                f"{self.port}: use {uri}, or stop it first (python -m mistill.tracking.server "
                f"stop --root {self.root}) and start it again on port {self.port}")
        use_credentials(self.root)
        return uri

    def _choose_port(self, last_port: int | None) -> int:
        """The port to launch on: the requested one (checked free), or by the default rule."""
        if self.explicit_port:
            assert self.port is not None
            if not port_is_free(self.host, self.port):
                raise self._port_taken(self.port)
            return self.port
        if self.port is None:
            for candidate in (last_port, DEFAULT_PORT):
                if candidate and port_is_free(self.host, candidate):
                    return candidate
        return free_port(self.host)

    def _port_taken(self, port: int) -> PortUnavailableError:
        return PortUnavailableError(
            f"port {port} on {self.host} is taken by "
            f"{describe_port_holder(self.host, port, self.root)}; the MLflow server of "
            f"{self.root} was not started: choose another --port, or leave --port out to get "
            f"{DEFAULT_PORT} or a free port")

    def _launch(self, port: int) -> subprocess.Popen[bytes]:
        url = self._database_url()
        if url:
            ensure_database(url)
        self.artifacts_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.secure_files()
        creds = load_credentials(self.root, create=True)
        auth_config = write_auth_config(self.root, creds)
        cmd = [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
               "--backend-store-uri", self.backend_uri,
               "--artifacts-destination", str(self.artifacts_dir),
               "--host", self.host, "--port", str(port), "--workers", "1"]
        env = {**os.environ, **SERVER_ENV,
               "MLFLOW_AUTH_CONFIG_PATH": str(auth_config),
               "MLFLOW_AUTH_ADMIN_USERNAME": creds["username"],
               "MLFLOW_AUTH_ADMIN_PASSWORD": creds["password"],
               "MLFLOW_FLASK_SERVER_SECRET_KEY": creds["flask_secret_key"],
               "MLFLOW_BASIC_AUTH_FAIL_CLOSED": "true"}
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", ENV_USERNAME, ENV_PASSWORD,
                     ENV_CREDENTIALS):
            env.pop(name, None)
        with open(self.log_path, "ab") as log:
            os.chmod(self.log_path, 0o600)
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            log.flush()
            # umask 077: the database, the auth database and every artifact the server writes
            # are readable and writable by the owner only
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=self.root, env=env,
                                    start_new_session=True, umask=0o077)

    def secure_files(self) -> None:
        """Make the store owner-only: the root directory and the artifact store 700 (files 600),
        the database files (SQLite and its journals), the auth database, the credentials, the
        auth config, the log, the record and the lock 600."""
        self.root.mkdir(parents=True, exist_ok=True)
        make_owner_only(self.artifacts_dir)
        files = [self.root / name for name in (
            CREDENTIALS_FILE, AUTH_CONFIG_FILE, "server.log", "server.json", "server.lock")]
        files += [p for pattern in ("mlflow.db*", f"{AUTH_DB_FILE}*")
                  for p in self.root.glob(pattern)]
        make_owner_only(*files)
        with contextlib.suppress(OSError):
            os.chmod(self.root, 0o700)

    def _wait_healthy(self, uri: str, pid: int, timeout: float,
                      proc: subprocess.Popen[bytes] | None = None) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                return False
            if proc is None and not pid_alive(pid):
                return False
            if health_ok(uri, timeout=1.0):
                return True
            time.sleep(0.25)
        return False

    def _log_tail(self, n: int = 4000) -> str:
        """The last ``n`` bytes the latest launch wrote to ``server.log``."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        latest = data[data.rfind(b"\n=== ") + 1:] if b"\n=== " in data else data
        return latest[-n:].decode("utf-8", errors="replace")

    # -------------------------------------------------------------------------------- stop
    def stop(self, grace: float = 10.0) -> bool:
        """Stop the recorded server: SIGTERM to its process group, SIGKILL after ``grace`` s.

        Returns True if a live server was stopped; removes ``server.json`` in any case.
        """
        with self._lock():
            record = self._read_record()
            stopped = False
            if record is not None and self._record_live(record):
                pid = int(record["pid"])
                proc = self._proc if self._proc is not None and self._proc.pid == pid else None
                self._kill(pid, int(record.get("pgid", pid)), grace=grace, proc=proc)
                stopped = True
            self.record_path.unlink(missing_ok=True)
            self._proc = None
            return stopped

    @staticmethod
    def _kill(pid: int, pgid: int, grace: float = 10.0,
              proc: subprocess.Popen[bytes] | None = None) -> None:
        """SIGTERM the group ``pgid`` (or just ``pid``), then SIGKILL what is left after ``grace``."""

        def signal_all(sig: int) -> None:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

        def reap() -> None:
            if proc is not None:
                proc.poll()
            else:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)

        signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while True:
            reap()
            if not pid_alive(pid) and not _group_alive(pgid):
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        signal_all(signal.SIGKILL)
        for _ in range(50):
            reap()
            if not pid_alive(pid) and not _group_alive(pgid):
                return
            time.sleep(0.1)


def ensure_server(root: Path | str = ".mistill", port: int | None = None) -> str:
    """Start (or reuse) the server of ``root``, point this process's MLflow clients at it.

    ``port`` as for :class:`TrackingServer` (None: the root's last port, else 5000, else a free
    one). Sets ``MLFLOW_TRACKING_URI`` and ``MLFLOW_DISABLE_TELEMETRY=true``; returns the URI.
    """
    uri = TrackingServer(Path(root), port=port).start()
    os.environ["MLFLOW_TRACKING_URI"] = uri
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    return uri


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mistill.tracking.server",
                                     description="Manage the mistill MLflow tracking server.")
    parser.add_argument("command", choices=("start", "stop", "status", "uri", "env"))
    parser.add_argument("--root", default=".mistill", help="project root (default .mistill)")
    parser.add_argument("--port", type=int, default=None,
                        help="start on exactly this port, or fail if it is taken; 0: any free "
                             "port (default: the root's last port if free, else 5000 if free, "
                             "else a free one)")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    server = TrackingServer(Path(args.root), host=args.host, port=args.port)
    if args.command == "start":
        try:
            print(server.start())
        except PortUnavailableError as exc:
            print(f"mistill server: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "stop":
        print("stopped" if server.stop() else "not running")
        return 0
    record = server.status()
    if args.command == "status":
        print(json.dumps(record, indent=2, sort_keys=True) if record else "not running")
        return 0 if record else 1
    if record and record["healthy"]:
        if args.command == "env":  # for a shell: eval "$(python -m mistill.tracking.server env)"
            creds = load_credentials(server.root)
            print(f"export MLFLOW_TRACKING_URI={shlex.quote(record['uri'])}")
            if creds.get("username") and creds.get("password"):
                print(f"export {ENV_USERNAME}={shlex.quote(creds['username'])}")
                print(f"export {ENV_PASSWORD}={shlex.quote(creds['password'])}")
                print(f"export {ENV_CREDENTIALS}="
                      f"{shlex.quote(str(server.root / CREDENTIALS_FILE))}")
            return 0
        print(record["uri"])
        return 0
    print("not running", file=sys.stderr)
    return 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
