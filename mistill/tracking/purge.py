"""Purge a run from the tracking store: delete it, then remove it for good with ``mlflow gc``.

Deleting an MLflow run only marks it ``deleted``: its params, tags and name stay in the backend
store, and its artifacts in the artifact store, until ``mlflow gc`` removes them. That is not
enough for a run that holds protected text, which can happen before any check of ours runs:
``mlflow run`` opens a run and stores every ``-P`` value as a param *before* the stage starts,
so the privacy guard of a restricted corpus meets those values only once they are stored.
:func:`purge_run` deletes such a run and runs ``mlflow gc`` on it: no row of the run (params,
tags, metrics, the run itself) is left in the backend store and none of its artifacts.

``mlflow gc`` works on the backend store directly, so it needs that store's URI:

* the project's server (:class:`~mistill.tracking.server.TrackingServer` of the mistill root),
  when it is the tracking server in use: its record names its SQLite backend and artifact folder;
* otherwise the environment: ``MISTILL_BACKEND_STORE_URI`` (the ``--backend-store-uri`` the
  server was started with) and, optionally, ``MISTILL_ARTIFACTS_DESTINATION`` (its
  ``--artifacts-destination``), set by whoever runs a server mistill did not start;
* when neither is known the run is deleted, and :class:`RunNotPurgedError` gives the operator the
  ``mlflow gc`` command that finishes the purge.

SQLite keeps the bytes of deleted rows in free pages unless ``secure_delete`` is on; where the
SQLite library has it off, the purge ends with ``VACUUM``, so the text is gone from the file too.

**The run ``mlflow run`` opened** (:func:`purge_launched_run`). Once the entry point has exited,
the ``mlflow run`` command reads the run back and sets its status (always: MLflow compares the
status it reads, a string, with its numeric terminal statuses, so an entry point that ended the
run itself changes nothing). A run purged or deleted before then makes ``mlflow run`` end with a
traceback (``RESOURCE_DOES_NOT_EXIST``, or a deleted run that cannot be updated). So when the
process that launched this one is the ``mlflow run`` command (:func:`mlflow_launcher`), the run
is left as it is and a detached purger (``python -m mistill.tracking.purge RUN_ID PID``) deletes
and purges it as soon as that command has exited; ``mlflow run`` itself prints the run's links
and ``Run (ID ...) failed``, and exits 1, whatever the entry point's exit status (its own code,
which an entry point cannot change). Otherwise (``projects/<stage>.py`` or ``mistill <stage>``
started directly with ``MLFLOW_RUN_ID`` set) the run is purged before the entry point exits. The
purger writes to the ``mlflow run`` command's stderr and keeps it open until the purge is done,
so a caller that reads that stream to its end (a pipe, ``subprocess.run(capture_output=True)``)
returns with the run purged; a purge that fails is reported there with the ``mlflow gc``
command that finishes it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.tracking import MlflowClient

from mistill.errors import MistillInputError
from mistill.parent_watch import pid_alive
from mistill.tracking.privacy import PrivacyError, PrivacyGuard
from mistill.tracking.reaper import spawn_reaper
from mistill.tracking.server import TrackingServer

ENV_BACKEND_STORE_URI = "MISTILL_BACKEND_STORE_URI"
"""The backend store URI of a tracking server mistill did not start (``mlflow server
--backend-store-uri``), so that a run holding protected text can be purged."""

ENV_ARTIFACTS_DESTINATION = "MISTILL_ARTIFACTS_DESTINATION"
"""That server's ``--artifacts-destination`` (optional: ``mlflow gc`` deletes proxied artifacts
through the tracking server)."""

GC_TIMEOUT_S = 300.0
"""The longest ``mlflow gc`` of one run may take (it starts in a few seconds)."""

LAUNCHER_WAIT_MAX_S = 120.0
"""The longest a deferred purge waits for the ``mlflow`` command to exit (it exits within a
second of the entry point); the run is purged then in any case."""

PURGED, DEFERRED, ABSENT = "purged", "deferred", "absent"
"""What :func:`purge_launched_run` did: purged the run, left it to the purger that deletes and
purges it once ``mlflow run`` has exited, or found no such run (already purged)."""

_PENDING: set[str] = set()
"""The runs this process has left to a purger (:func:`purge_launched_run`), purged once."""

_SQLITE = "sqlite:///"
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})


class RunNotPurgedError(PrivacyError):
    """A run holding protected text, or the values of a refused command line, was deleted but
    could not be purged: its params and tags are still in the backend store until an operator
    runs :attr:`command`.

    Attributes:
        run_id: the deleted run.
        reason: why it was not purged.
        command: the ``mlflow gc`` command that purges it.
        where: what held the protected text (``param split``), when known.
    """

    def __init__(self, run_id: str, reason: str, command: str, where: str | None = None) -> None:
        self.run_id, self.reason, self.command = run_id, reason, command
        self.where = where or f"run {run_id}"
        held = f"{where} holds protected note text (corpus privacy level 'restricted'); " if where else ""
        MistillInputError.__init__(
            self, f"{held}run {run_id} is deleted but NOT purged ({reason}): its params and tags stay in "
                  f"the backend store until an operator runs: {command}")


def _redacted(uri: str) -> str:
    """``uri`` without the password of its user info (safe to print)."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def backend_store(tracking_uri: str, root: Path | str) -> tuple[str, str | None] | None:
    """``(backend store URI, artifacts destination or None)`` of the tracking server at
    ``tracking_uri``: the project's server of ``root`` when it is that server, else
    ``MISTILL_BACKEND_STORE_URI`` (with ``MISTILL_ARTIFACTS_DESTINATION``), else None."""
    record = TrackingServer(root).status()
    if record and str(record.get("uri", "")).rstrip("/") == tracking_uri.rstrip("/"):
        server = TrackingServer(record.get("root", root))
        return (str(record.get("backend_store_uri") or server.backend_uri),
                str(record.get("artifacts_destination") or server.artifacts_dir))
    backend = os.environ.get(ENV_BACKEND_STORE_URI, "").strip()
    if not backend:
        return None
    return backend, os.environ.get(ENV_ARTIFACTS_DESTINATION, "").strip() or None


def gc_command(run_id: str, tracking_uri: str, backend: str | None = None,
               artifacts: str | None = None) -> list[str]:
    """The ``mlflow gc`` command line that purges the deleted run ``run_id``."""
    cmd = ["mlflow", "gc", "--backend-store-uri", backend or "<backend store URI>"]
    if artifacts:
        cmd += ["--artifacts-destination", artifacts]
    return cmd + ["--run-ids", run_id, "--tracking-uri", tracking_uri]


def _shown_command(cmd: list[str]) -> str:
    return shlex.join([_redacted(part) if "://" in part else part for part in cmd])


def _is_missing(exc: MlflowException) -> bool:
    return exc.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST)


def _existing_run(client: MlflowClient, run_id: str) -> Run | None:
    """The run, or None when the store no longer has it (already purged)."""
    try:
        return client.get_run(run_id)
    except MlflowException as exc:
        if _is_missing(exc):
            return None
        raise


def purge_run(run_id: str, *, tracking_uri: str | None = None, root: Path | str | None = None) -> None:
    """Delete ``run_id`` and remove it for good from the tracking store (``mlflow gc``).

    A run that no longer exists is left alone (already purged). ``root`` is the mistill root
    whose server record names the backend store (default: ``$MISTILL_ROOT`` or ``.mistill``).

    Raises:
        RunNotPurgedError: the run is deleted, but the backend store is unknown or ``mlflow gc``
            failed; the message gives the command that purges it.
    """
    import mlflow  # deferred: MLflow is slow to import

    uri = tracking_uri or mlflow.get_tracking_uri()
    root = Path(root if root is not None else os.environ.get("MISTILL_ROOT", ".mistill"))
    client = MlflowClient(tracking_uri=uri)
    run = _existing_run(client, run_id)
    if run is None:
        return
    if run.info.lifecycle_stage != "deleted":
        client.delete_run(run_id)
    store = backend_store(uri, root)
    if store is None:
        raise _backend_unknown(run_id, uri)
    backend, artifacts = store
    cmd = gc_command(run_id, uri, backend, artifacts)
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_RUN_ID", None)
    try:
        proc = subprocess.run([sys.executable, "-m", *cmd], env=env, capture_output=True, text=True,
                              timeout=GC_TIMEOUT_S, stdin=subprocess.DEVNULL)
        failure = None if proc.returncode == 0 else (
            f"mlflow gc exited {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:300]}")
    except subprocess.TimeoutExpired:
        failure = f"mlflow gc did not finish within {GC_TIMEOUT_S:.0f} s"
    if failure is not None:
        raise RunNotPurgedError(run_id, failure, _shown_command(cmd))
    drop_freed_pages(backend)


def _backend_unknown(run_id: str, uri: str) -> RunNotPurgedError:
    return RunNotPurgedError(
        run_id, f"the backend store of tracking server {uri} is unknown: set {ENV_BACKEND_STORE_URI} "
                "to the --backend-store-uri it was started with", _shown_command(gc_command(run_id, uri)))


def is_mlflow_run(cmdline: list[str]) -> bool:
    """``cmdline`` is the ``mlflow run`` command: the console script (``mlflow run ...``, also
    through ``python .../mlflow``) or ``python -m mlflow run ...``."""
    for i, part in enumerate(cmdline[:3]):
        if Path(part).name == "mlflow" or (part == "-m" and cmdline[i + 1:i + 2] == ["mlflow"]):
            return "run" in cmdline[i + 1:]
    return False


def mlflow_launcher() -> int | None:
    """The process id of the ``mlflow run`` command that launched this process and waits for it
    (this process's parent, or the parent of the ``sh -c`` shell it was started through), or
    None: another parent, or one that cannot be inspected (no ``psutil``)."""
    try:
        import psutil  # deferred: psutil only when memory is measured
    except ImportError:
        return None
    try:
        proc = psutil.Process(os.getpid()).parent()
        for _ in range(2):
            if proc is None:
                return None
            cmdline = proc.cmdline()
            if is_mlflow_run(cmdline):
                return int(proc.pid)
            if not cmdline or Path(cmdline[0]).name not in _SHELLS:
                return None
            proc = proc.parent()
    except psutil.Error:
        return None
    return None


def purge_launched_run(run_id: str, *, tracking_uri: str | None = None, root: Path | str | None = None) -> str:
    """Purge the run ``mlflow run`` opened for this process (see the module docstring): at once
    (:data:`PURGED`), or, when the ``mlflow run`` command still has to end it, through a
    detached purger that deletes and purges it once that command has exited
    (:data:`DEFERRED`); :data:`ABSENT` when the run no longer exists.

    Raises:
        RunNotPurgedError: the run is deleted, but the backend store is unknown or ``mlflow gc``
            failed; the message gives the command that purges it.
    """
    import mlflow  # deferred: MLflow is slow to import

    uri = tracking_uri or mlflow.get_tracking_uri()
    root = Path(root if root is not None else os.environ.get("MISTILL_ROOT", ".mistill"))
    launcher = mlflow_launcher()
    if launcher is None:
        client = MlflowClient(tracking_uri=uri)
        if _existing_run(client, run_id) is None:
            return ABSENT
        purge_run(run_id, tracking_uri=uri, root=root)
        return PURGED
    if run_id in _PENDING:
        return DEFERRED
    client = MlflowClient(tracking_uri=uri)
    if _existing_run(client, run_id) is None:
        return ABSENT
    if backend_store(uri, root) is None:
        spawn_reaper(run_id, uri, launcher)  # deleted once `mlflow run` has ended it
        raise _backend_unknown(run_id, uri)
    spawn_purger(run_id, uri, root, launcher)
    _PENDING.add(run_id)
    return DEFERRED


def purge_pending(run_id: str) -> bool:
    """True iff this process has left ``run_id`` to a purger (:func:`purge_launched_run`)."""
    return run_id in _PENDING


def purged_words(outcome: str) -> str:
    """How a message says what :func:`purge_launched_run` did to the run."""
    if outcome == DEFERRED:
        return "deleted and purged from the tracking store once `mlflow run` has exited"
    return "deleted and purged from the tracking store"


def spawn_purger(run_id: str, tracking_uri: str, root: Path | str, watch_pid: int) -> None:
    """Start ``python -m mistill.tracking.purge RUN_ID WATCH_PID`` in its own session (it outlives
    this process and the ``mlflow run`` command ``watch_pid``), on this process's stderr."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "MISTILL_ROOT": str(root),
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_RUN_ID", None)
    subprocess.Popen([sys.executable, "-m", "mistill.tracking.purge", run_id, str(watch_pid)], env=env,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def purge_after(run_id: str, watch_pid: int, *, tracking_uri: str | None = None, root: Path | str | None = None,
                wait_max_s: float = LAUNCHER_WAIT_MAX_S) -> None:
    """Wait until the process ``watch_pid`` has exited (at most ``wait_max_s``), then purge
    ``run_id`` (:func:`purge_run`)."""
    deadline = time.monotonic() + wait_max_s
    while _running(watch_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    purge_run(run_id, tracking_uri=tracking_uri, root=root)


def _running(pid: int) -> bool:
    """True iff ``pid`` exists and has not exited (a zombie, not yet reaped by its parent, has)."""
    try:
        import psutil  # deferred: psutil only when memory is measured
    except ImportError:
        return pid_alive(pid)
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return pid_alive(pid)


def drop_freed_pages(backend: str) -> None:
    """For a SQLite backend store whose library leaves deleted rows' bytes in free pages
    (``PRAGMA secure_delete`` off, the library's default, which the deletion also ran with):
    ``VACUUM``, which rewrites the file without them. Other stores are left as they are."""
    if not backend.startswith(_SQLITE):
        return
    with contextlib.closing(sqlite3.connect(backend[len(_SQLITE):], timeout=60)) as db:
        if db.execute("PRAGMA secure_delete").fetchone()[0]:
            return
        db.execute("VACUUM")


def protected_place(run: Run, guard: PrivacyGuard) -> str | None:
    """Where ``run`` holds text ``guard`` protects (``param split``, ``tag mlflow.runName``,
    ``run name``), or None: its params, its tags and its name are checked."""
    places = ((run.data.params, "param"), (run.data.tags, "tag"), ({"name": run.info.run_name or ""}, "run"))
    for mapping, kind in places:
        try:
            guard.check_mapping(mapping, kind)
        except PrivacyError as exc:
            return exc.where
    return None


def purge_if_protected(run_id: str, guard: PrivacyGuard, *, tracking_uri: str | None = None,
                       root: Path | str | None = None, launched: bool = False) -> None:
    """Purge ``run_id`` when its params, tags or name hold text ``guard`` protects, and raise
    :class:`PrivacyError` naming where (never the text); otherwise (or when the run does not
    exist) return. ``launched``: the run is the one ``mlflow run`` opened for this process
    (purged by :func:`purge_launched_run`).

    Raises:
        PrivacyError: the run held protected text and is purged.
        RunNotPurgedError: the run held protected text and is deleted, but not purged.
    """
    if guard.allows_text:
        return
    client = MlflowClient(tracking_uri=tracking_uri)
    run = _existing_run(client, run_id)
    if run is None:
        return
    where = protected_place(run, guard)
    if where is None:
        return
    try:
        if launched:
            outcome = purge_launched_run(run_id, tracking_uri=tracking_uri, root=root)
        else:
            purge_run(run_id, tracking_uri=tracking_uri, root=root)
            outcome = PURGED
    except RunNotPurgedError as exc:
        raise RunNotPurgedError(run_id, exc.reason, exc.command, where=where) from None
    raise PrivacyError(f"{where} (held by run {run_id}, now {purged_words(outcome)})")


def main(argv: list[str] | None = None) -> int:
    """``python -m mistill.tracking.purge RUN_ID WATCH_PID``: :func:`purge_after` (the purger that
    :func:`spawn_purger` starts); a purge that fails is reported on stderr with its command."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m mistill.tracking.purge RUN_ID WATCH_PID", file=sys.stderr)
        return 2
    try:
        purge_after(args[0], int(args[1]))
    except RunNotPurgedError as exc:
        print(f"mistill: {exc}", file=sys.stderr)
        return 1
    except MlflowException as exc:
        print(f"mistill: run {args[0]} that `mlflow run` opened could not be purged ({exc.error_code}); delete "
              "it, then run: mlflow gc --backend-store-uri <backend store URI> --run-ids "
              f"{args[0]}", file=sys.stderr)
        return 1
    return 0


__all__ = ["ABSENT", "DEFERRED", "ENV_ARTIFACTS_DESTINATION", "ENV_BACKEND_STORE_URI", "LAUNCHER_WAIT_MAX_S",
           "PURGED", "RunNotPurgedError", "backend_store", "drop_freed_pages", "gc_command", "is_mlflow_run",
           "mlflow_launcher", "protected_place", "purge_after", "purge_if_protected", "purge_launched_run",
           "purge_pending", "purge_run", "purged_words", "spawn_purger"]

if __name__ == "__main__":
    raise SystemExit(main())
