"""Leases: at most one live process works on a run, and a run's claim is atomic in the store.

A stage run that is being worked on carries a lease in its tags: the owner (host, pid, the
process's start time and a random nonce), a heartbeat (epoch seconds, refreshed every
``ttl / 4`` by a background thread) and a generation number. Another process that finds the
run RUNNING with a fresh heartbeat, and an owner not known to be dead, treats it as busy: it
waits for the run to finish and reuses it, or refuses (:class:`LeaseSettings.on_busy`).

Taking a run, or creating a new one, is a *claim*: creating an MLflow experiment with a name
derived from what is claimed. The tracking store keeps experiment names unique (SQLite and
PostgreSQL alike), so of several processes that claim the same name at the same moment exactly
one succeeds, on one machine or many. The claim experiment is soft-deleted at once, so it never
shows in the UI; its name stays taken until ``mlflow gc`` purges it, and each claim name is used
once (a takeover claims the next generation).

* Creating a run with identity ``key``: claim ``mistill.lease/<key>/new/<g>``; ``g`` advances only
  when the previous claim is older than the lease's time to live and produced no run (its
  claimant died before creating the run).
* Taking over a resumable run whose lease has lapsed: claim
  ``mistill.lease/<run id>/<generation + 1>``.

An owner on this host whose process is gone is dead at once; an owner elsewhere is dead when
its heartbeat is older than the time to live. A process that finds at its next heartbeat that
the run's owner tag is no longer its own has lost the lease: it stops writing and never changes
the run's status.

Settings (environment): ``MISTILL_LEASE_TTL_S`` (default 120), ``MISTILL_ON_BUSY`` (``wait`` or
``refuse``; default ``wait``), ``MISTILL_WAIT_MAX_S`` (longest wait for a busy run, 0 = no limit;
default 0).
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mistill.tracking.connection import is_unreachable

TAG_LEASE_OWNER = "mistill.lease.owner"
TAG_LEASE_HEARTBEAT = "mistill.lease.heartbeat"
TAG_LEASE_GENERATION = "mistill.lease.generation"
TAG_LEASE_TTL = "mistill.lease.ttl_s"
CLAIM_PREFIX = "mistill.lease/"

ENV_TTL = "MISTILL_LEASE_TTL_S"
ENV_ON_BUSY = "MISTILL_ON_BUSY"
ENV_WAIT_MAX = "MISTILL_WAIT_MAX_S"
ON_BUSY_CHOICES = ("wait", "refuse")


class LeaseError(RuntimeError):
    """A run is held by another live process (``on_busy=refuse``, or the wait ran out), or this
    process lost its lease on the run it was writing."""


@dataclass(frozen=True)
class LeaseSettings:
    """How long a lease lives without a heartbeat, and what a process does with a busy run."""

    ttl_s: float = 120.0
    on_busy: str = "wait"
    wait_max_s: float = 0.0

    @property
    def heartbeat_s(self) -> float:
        return max(self.ttl_s / 4.0, 0.05)

    @property
    def poll_s(self) -> float:
        return min(max(self.ttl_s / 8.0, 0.2), 5.0)

    @classmethod
    def from_env(cls) -> LeaseSettings:
        def number(name: str, default: float) -> float:
            raw = os.environ.get(name, "")
            try:
                value = float(raw) if raw else default
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
            if value < 0:
                raise ValueError(f"{name}={raw!r} must be >= 0")
            return value

        on_busy = os.environ.get(ENV_ON_BUSY, "wait") or "wait"
        if on_busy not in ON_BUSY_CHOICES:
            raise ValueError(f"{ENV_ON_BUSY}={on_busy!r}: expected one of {ON_BUSY_CHOICES}")
        ttl = number(ENV_TTL, 120.0)
        if ttl <= 0:
            raise ValueError(f"{ENV_TTL} must be > 0")
        return cls(ttl_s=ttl, on_busy=on_busy, wait_max_s=number(ENV_WAIT_MAX, 0.0))


# ----------------------------------------------------------------------------------- owners
def _process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or
    '' where there is no ``/proc``: guards against a reused pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return ""
    return fields[19] if len(fields) > 19 else ""


def new_owner() -> str:
    """``<host>|<pid>|<start ticks>|<nonce>``: unique per StageRun, checkable on this host."""
    pid = os.getpid()
    return f"{socket.gethostname()}|{pid}|{_process_start(pid)}|{uuid.uuid4().hex[:12]}"


def owner_known_dead(owner: str) -> bool:
    """True iff ``owner`` ran on this host and its process is gone (or the pid was reused)."""
    parts = owner.split("|")
    if len(parts) != 4 or parts[0] != socket.gethostname():
        return False
    try:
        pid = int(parts[1])
    except ValueError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    start = _process_start(pid)
    if start and parts[2] and start != parts[2]:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def describe_owner(owner: str) -> str:
    parts = owner.split("|")
    return f"pid {parts[1]} on {parts[0]}" if len(parts) == 4 else (owner or "an unknown process")


def lease_held(run: Run, settings: LeaseSettings, now: float | None = None) -> bool:
    """True iff ``run`` is RUNNING under a live lease: a heartbeat younger than the ttl, from an
    owner not known to be dead. A RUNNING run with no lease tags (written before leases, or
    adopted but not yet tagged) counts as held for one ttl after its start."""
    if run.info.status != "RUNNING":
        return False
    tags = run.data.tags
    owner = tags.get(TAG_LEASE_OWNER, "")
    if owner and owner_known_dead(owner):
        return False
    now = time.time() if now is None else now
    try:
        beat = float(tags[TAG_LEASE_HEARTBEAT])
    except (KeyError, ValueError):
        beat = (run.info.start_time or 0) / 1000.0
    try:
        ttl = float(tags.get(TAG_LEASE_TTL, settings.ttl_s))
    except ValueError:
        ttl = settings.ttl_s
    return now - beat <= max(ttl, settings.ttl_s)


def generation(run: Run) -> int:
    try:
        return int(run.data.tags.get(TAG_LEASE_GENERATION, "-1"))
    except ValueError:
        return -1


# ----------------------------------------------------------------------------------- claims
def identity_key(experiment_id: str, entry_point: str, params_digest: str, code_version: str,
                 inputs: Mapping[str, str]) -> str:
    """sha256 of everything that makes two runs identical (what :func:`find_run` compares)."""
    text = "\x00".join([experiment_id, entry_point, params_digest, code_version]
                       + [f"{k}={v}" for k, v in sorted(inputs.items())])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def claim(client: MlflowClient, name: str) -> bool:
    """Atomically take the claim ``name``: True for the one process that created it."""
    try:
        exp_id = client.create_experiment(CLAIM_PREFIX + name)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_ALREADY_EXISTS" or "already exists" in str(exc):
            return False
        raise
    try:
        client.delete_experiment(exp_id)  # hidden from the UI; the name stays taken
    except MlflowException as exc:
        if is_unreachable(exc):
            raise
    return True


def claim_age_s(client: MlflowClient, name: str, now: float | None = None) -> float | None:
    """Seconds since the claim ``name`` was taken, or None if nobody has taken it."""
    exp = client.get_experiment_by_name(CLAIM_PREFIX + name)
    if exp is None:
        return None
    now = time.time() if now is None else now
    return now - (exp.creation_time or 0) / 1000.0


def claim_new_run(client: MlflowClient, key: str, settings: LeaseSettings) -> bool | None:
    """Claim the creation of the run with identity ``key``.

    Returns True (this process creates the run), False (another process holds a live claim:
    wait for its run to appear), or None never; a claim older than the ttl that produced no run
    is passed over to the next generation.
    """
    g = 0
    while True:
        name = f"{key}/new/{g}"
        age = claim_age_s(client, name)
        if age is None:
            if claim(client, name):
                return True
            continue  # taken a moment ago: look at it again
        if age <= settings.ttl_s:
            return False
        g += 1


# -------------------------------------------------------------------------------- heartbeat
class Heartbeat:
    """Refreshes a run's lease every ``settings.heartbeat_s`` in a daemon thread.

    At each beat it reads the run's owner tag first: if another owner took the run over (this
    process was presumed dead), :attr:`lost` is set and the beats stop. Failures to reach the
    server are retried at the next beat (the lease simply ages meanwhile).
    """

    def __init__(self, client: MlflowClient, run_id: str, owner: str, settings: LeaseSettings) -> None:
        self.client = client
        self.run_id = run_id
        self.owner = owner
        self.settings = settings
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"mistill-lease-{run_id[:8]}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            try:
                self.beat()
            except MlflowException:
                continue
            except Exception:  # noqa: BLE001 - a connection error type of the HTTP stack
                continue
            if self.lost:
                return

    def beat(self) -> None:
        """One heartbeat: check ownership, then refresh the heartbeat tag."""
        run = self.client.get_run(self.run_id)
        if run.data.tags.get(TAG_LEASE_OWNER) != self.owner:
            self.lost = True
            return
        self.client.set_tag(self.run_id, TAG_LEASE_HEARTBEAT, f"{time.time():.3f}")

    def still_owner(self) -> bool:
        """Ask the store now whether this process still owns the run."""
        if self.lost:
            return False
        run = self.client.get_run(self.run_id)
        self.lost = run.data.tags.get(TAG_LEASE_OWNER) != self.owner
        return not self.lost

    def stop(self, wait: bool = True) -> None:
        """Stop beating; ``wait=False`` does not wait for a beat in flight (the server is gone)."""
        self._stop.set()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


def lease_tags(owner: str, gen: int, settings: LeaseSettings) -> dict[str, str]:
    return {TAG_LEASE_OWNER: owner, TAG_LEASE_HEARTBEAT: f"{time.time():.3f}",
            TAG_LEASE_GENERATION: str(gen), TAG_LEASE_TTL: f"{settings.ttl_s:g}"}


__all__ = ["LeaseSettings", "LeaseError", "Heartbeat", "new_owner", "owner_known_dead", "lease_held",
           "generation", "identity_key", "claim", "claim_new_run", "claim_age_s", "lease_tags",
           "describe_owner", "TAG_LEASE_OWNER", "TAG_LEASE_HEARTBEAT", "TAG_LEASE_GENERATION",
           "TAG_LEASE_TTL", "CLAIM_PREFIX"]
