"""The Optuna study of a λ selection: one RDB study per lock and inputs, each cell run to a result.

* :func:`open_study` creates the study (direction maximize) with the lock's sha256 and the retry
  cap of failed cells (``max_retries``) in its user attributes, or loads it and refuses when the
  lock changed. Its storage records heartbeats (:mod:`selection.heartbeat`: interval, grace
  period, retries).
* :func:`run_cells` runs the cells of a grid through Optuna's :class:`GridSampler` (ask/tell),
  ``workers`` at once: threads of this process, or with ``processes`` spawned worker processes
  (each its own interpreter, storage connection and MLflow client, its torch threads a share of
  the CPUs), for runners that load models (importing and loading models is not thread-safe);
  other processes may work on the same study at the same time. Claiming a cell (failing stale
  trials, taking a queued retry or creating a trial and fixing its grid point, recording its
  first heartbeat) happens under an exclusive lock (a file lock next to a SQLite file, an
  advisory lock on PostgreSQL), so no two workers ever hold one cell at once.
* A cell whose runner raised is failed, with its reason (``failure_reason``, one line) on the
  trial, and is not run again by the same call. The next call on the study (a rerun) queues it
  again, at most ``max_retries`` times per cell (the study's user attribute of that name); the
  study's ``failure_retries`` attribute counts the retries per cell and each retry trial carries
  its number (``failure_retry``). A cell out of retries stays failed and is reported with its
  reason (:func:`failure_summary`).
* A cell whose worker stopped (killed, its machine lost, interrupted) is retried within the same
  call: its heartbeat goes stale after the grace period, the next claim fails the trial and
  Optuna's :class:`~optuna.storages.RetryHeartbeatStaleTrialCallback` queues a WAITING trial with
  the same grid point, which the next free worker takes; at most ``max_retry`` such retries per
  attempt, after which the cell counts as failed (and a rerun retries it as above). A worker
  interrupted in-process (``KeyboardInterrupt``) fails its trial and queues the retry at once.
* A worker with nothing left to claim while cells of its grid are RUNNING (or queued) elsewhere
  waits for them, polling; it never ends on another worker's cell. A stale one is failed and
  retried by the polling worker itself, so the wait is bounded by the grace period whenever the
  other worker is dead. Every worker then reads the same finished cells and reaches the same
  decision.
* :func:`study_cells` reads every trial back as cell results, failures and running cells.

Each trial is a nested MLflow run (``mlflow.parentRunId`` = the ``select_lambda`` run) when a
parent run is given; the run of an attempt whose worker stopped ends KILLED when its cell is
retried.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import multiprocessing
import os
import pickle
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mistill.errors import MistillInputError
from mistill.tracking.postgres import database_url, ensure_database, is_postgres, libpq_url, selection_storage_url
from mistill.tracking.experiments import quiet_run_links
from selection.cells import Cell, CellResult, CellRun, Runner
from selection.heartbeat import (ATTR_HEARTBEAT, Heartbeat, beating, fail_stale, queue_retry, quiet_optuna, rdb_storage,
                                 retried_from)
from selection.lock import Lock

STUDY_DB = "selection.db"
ATTR_LOCK_SHA = "lock_sha256"
ATTR_LOCK_PATH = "lock_path"
ATTR_LOCK_TEXT = "lock_text"
ATTR_CELL = "cell"
ATTR_MLFLOW_RUN = "mlflow_run"
ATTR_TIE_BREAK = "tie_break"
ATTR_VALIDITY = "validity"
ATTR_RUN_IDS = "run_ids"
ATTR_ERROR = "error"
ATTR_REASON = "failure_reason"
ATTR_FAILURE_RETRY = "failure_retry"
ATTR_MAX_RETRIES = "max_retries"
ATTR_RETRIES = "failure_retries"
DEFAULT_MAX_RETRIES = 2
"""Retries of a failed cell when the study does not say otherwise **[recon]**: the paper states
no retry policy; two reruns cover a transient failure (a lost file system, a busy server) without
hiding a cell that fails every time."""
REASON_CHARS = 500
STALE_ERROR = "worker stopped: heartbeat stale, retries used up"
INTERRUPTED = "interrupted"
TAG_STUDY = "mistill.selection.study"
TAG_CELL = "mistill.selection.cell"
TAG_TRIAL = "mistill.selection.trial"
TAG_RETRY_OF = "mistill.selection.retry_of"
TAG_ERROR = "mistill.selection.error"
TRIAL_STAGE = "select_lambda.cell"
_SQLITE = "sqlite:///"

_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


def default_storage_url(root: Path | str) -> str:
    """``sqlite:///<root>/optuna/selection.db`` (absolute path, the directory created), or with
    ``$MISTILL_DATABASE_URL`` set, database ``<name>_selection`` of that PostgreSQL server
    (created on first use; :mod:`mistill.tracking.postgres`)."""
    url = database_url()
    if url:
        storage = selection_storage_url(url)
        ensure_database(storage)
        return storage
    path = (Path(root) / "optuna" / STUDY_DB).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return _SQLITE + str(path)


def lock_file_for(storage_url: str, root: Path | str) -> Path:
    """The file whose exclusive lock serialises cell claims (:func:`claim_lock`; a PostgreSQL
    storage uses an advisory lock instead): ``<db>.lock`` beside a SQLite file, else one under
    ``<root>/optuna/`` named by the URL's hash (one machine only)."""
    if storage_url.startswith(_SQLITE):
        return Path(storage_url[len(_SQLITE):] + ".lock")
    digest = hashlib.sha256(storage_url.encode()).hexdigest()[:16]
    return Path(root) / "optuna" / f"{digest}.lock"


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """An exclusive lock held across threads (a lock per path) and processes (``flock``)."""
    key = str(path.resolve())
    with _thread_locks_guard:
        tlock = _thread_locks.setdefault(key, threading.Lock())
    path.parent.mkdir(parents=True, exist_ok=True)
    with tlock, open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def advisory_key(study_name: str) -> int:
    """The PostgreSQL advisory-lock key of a study's claims (a signed 64-bit hash of its name)."""
    return int.from_bytes(hashlib.sha256(f"mistill.selection:{study_name}".encode()).digest()[:8], "big",
                          signed=True)


@contextlib.contextmanager
def claim_lock(storage_url: str, study_name: str, lock_file: Path) -> Iterator[None]:
    """The exclusive lock that serialises the claims on one study: on a PostgreSQL storage an
    advisory lock of that server (held by every worker on any machine, keyed by the study's
    name), else the file lock :func:`exclusive` of ``lock_file`` (one machine, or a shared
    filesystem). Threads of one process take it in turn either way."""
    if not is_postgres(storage_url):
        with exclusive(lock_file):
            yield
        return
    import psycopg  # deferred: psycopg is optional (PostgreSQL only)

    key = advisory_key(study_name)
    with _thread_locks_guard:
        tlock = _thread_locks.setdefault(f"pg:{storage_url}:{key}", threading.Lock())
    with tlock, psycopg.connect(libpq_url(storage_url), autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (key,))
        try:
            yield
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (key,))


@dataclass
class SelectionStudy:
    """An opened study: its name, storage (with heartbeat), the file lock that serialises claims
    and the retry cap of failed cells recorded in the study."""

    name: str
    storage_url: str
    storage: Any
    lock_file: Path
    created: bool
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    max_retries: int = DEFAULT_MAX_RETRIES

    def load(self, sampler: Any = None) -> Any:
        import optuna  # deferred: Optuna is slow to import

        return optuna.load_study(study_name=self.name, storage=self.storage, sampler=sampler)

    @property
    def study_id(self) -> int:
        return self.storage.get_study_id_from_name(self.name)


def _storage(url: str, heartbeat: Heartbeat) -> Any:
    kwargs = {"connect_args": {"timeout": 120}} if url.startswith(_SQLITE) else {}
    return rdb_storage(url, heartbeat, kwargs)


def _check_max_retries(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MistillInputError(f"the retry cap of failed cells must be an integer >= 0, got {value!r}",
                                field=ATTR_MAX_RETRIES)
    return value


def open_study(lock: Lock, storage_url: str, study_name: str, *, root: Path | str = ".mistill",
               heartbeat: Heartbeat | None = None, max_retries: int | None = None) -> SelectionStudy:
    """Create the study under ``lock`` or load it; refuse a study created under another lock.

    heartbeat: how this process records and judges liveness (default :class:`Heartbeat`).
    max_retries: retries of a failed cell across reruns, recorded as the study's user attribute
        ``max_retries``; None keeps the recorded value (:data:`DEFAULT_MAX_RETRIES` for a new
        study or one that records none).

    Raises:
        MistillInputError: the study exists with a different lock sha256 (names the lock file and
            both hashes), the heartbeat settings are invalid, or the retry cap is not an integer
            >= 0.
    """
    import optuna  # deferred: Optuna is slow to import

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    heartbeat = heartbeat or Heartbeat()
    if max_retries is not None:
        _check_max_retries(max_retries)
    lock_file = lock_file_for(storage_url, root)
    with claim_lock(storage_url, study_name, lock_file):
        storage = _storage(storage_url, heartbeat)
        try:
            study_id = storage.get_study_id_from_name(study_name)
        except KeyError:
            study_id = None
        if study_id is not None:
            attrs = storage.get_study_user_attrs(study_id)
            stored = attrs.get(ATTR_LOCK_SHA)
            if stored != lock.sha256:
                raise MistillInputError(
                    f"study {study_name!r} in {storage_url} was created under lock sha256 {stored} "
                    f"(file {attrs.get(ATTR_LOCK_PATH)}); this lock's sha256 is {lock.sha256}. A "
                    f"pre-registered lock cannot change after its study started: restore the lock, "
                    f"or give the new one another study name", file=lock.path, field="sha256")
            cap = attrs.get(ATTR_MAX_RETRIES)
            if max_retries is not None or cap is None:
                cap = DEFAULT_MAX_RETRIES if max_retries is None else max_retries
                storage.set_study_user_attr(study_id, ATTR_MAX_RETRIES, cap)
            return SelectionStudy(study_name, storage_url, storage, lock_file, created=False, heartbeat=heartbeat,
                                  max_retries=_check_max_retries(cap))
        study = optuna.create_study(study_name=study_name, storage=storage, direction="maximize")
        cap = DEFAULT_MAX_RETRIES if max_retries is None else max_retries
        study.set_user_attr(ATTR_LOCK_SHA, lock.sha256)
        study.set_user_attr(ATTR_LOCK_PATH, lock.path)
        study.set_user_attr(ATTR_LOCK_TEXT, lock.text)
        study.set_user_attr(ATTR_MAX_RETRIES, cap)
        study.set_user_attr("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        return SelectionStudy(study_name, storage_url, storage, lock_file, created=True, heartbeat=heartbeat,
                              max_retries=cap)


def _grid_sampler(space: Mapping[str, list[float]]) -> Any:
    from optuna.samplers import GridSampler  # deferred: Optuna is slow to import

    class ClaimGridSampler(GridSampler):
        """GridSampler whose grid point is fixed at claim time; the worker loop, not the sampler,
        decides when the grid is exhausted (so ask/tell never calls ``study.stop``). A queued
        retry keeps the grid point of the trial it retries (GridSampler leaves a trial that
        already has a ``grid_id`` alone)."""

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    # seed fixed: every worker must map a grid id to the same cell
    return ClaimGridSampler({k: list(v) for k, v in space.items()}, seed=0)


def _space_of(trial: Any) -> dict[str, list[float]] | None:
    return trial.system_attrs.get("search_space")


def _in_space(trials: Iterable[Any], space: Mapping[str, list[float]]) -> list[Any]:
    """The trials whose grid point belongs to ``space``."""
    wanted = {k: list(v) for k, v in space.items()}
    return [t for t in trials if "grid_id" in t.system_attrs and _space_of(t) == wanted]


def _claimed_ids(trials: Iterable[Any], space: Mapping[str, list[float]]) -> set[int]:
    """Grid ids of ``space`` that some trial (any state) holds."""
    return {t.system_attrs["grid_id"] for t in _in_space(trials, space)}


_STATE_RANK = {"COMPLETE": 0, "RUNNING": 1, "WAITING": 2, "FAIL": 3}


def _deciding_trials(trials: Iterable[Any]) -> dict[Cell, Any]:
    """For each cell, the trial that states where it stands: its first COMPLETE trial, else a
    RUNNING one, else a queued (WAITING) retry, else its latest FAIL."""
    out: dict[Cell, Any] = {}
    for t in sorted(trials, key=lambda t: t.number):
        if not t.params or t.state.name not in _STATE_RANK:
            continue
        cell = Cell.of(t.params)
        held = out.get(cell)
        if held is None or _STATE_RANK[t.state.name] < _STATE_RANK[held.state.name] or \
                (t.state.name == held.state.name == "FAIL"):
            out[cell] = t
    return out


def _error_of(trial: Any) -> str:
    """A FAIL trial's reason in one line: the runner's error, else the stale-heartbeat reason."""
    reason = trial.user_attrs.get(ATTR_REASON)
    if reason:
        return str(reason)
    error = trial.user_attrs.get(ATTR_ERROR)
    return str(error).splitlines()[0] if error else STALE_ERROR


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= REASON_CHARS else line[:REASON_CHARS - 3] + "..."


def _retries_used(trials: Iterable[Any]) -> int:
    """How many times a rerun queued the cell of ``trials`` (all of one cell) after it failed."""
    return max((int(t.user_attrs.get(ATTR_FAILURE_RETRY) or 0) for t in trials), default=0)


def _by_cell(trials: Iterable[Any]) -> dict[Cell, list[Any]]:
    out: dict[Cell, list[Any]] = {}
    for t in trials:
        if t.params:
            out.setdefault(Cell.of(t.params), []).append(t)
    return out


@dataclass
class CellReport:
    """What one :func:`run_cells` call found and did, by cell key.

    ``failed_before``: cells failed when the call began, with their reasons; ``retried``: those
    of them the call queued again (the retry's number, 1 for the first), ``gave_up``: those out of
    retries (not run again). ``running_elsewhere``: cells some other worker held (RUNNING or
    queued) when the call began; the call waited for them. ``stale``: trials this call failed
    because their heartbeat went stale (their cells were queued again unless out of retries).
    ``superseded``: cells whose trial another worker failed as stale while this one still ran it
    (its result is dropped; the retry stands).
    """

    ran: list[str] = field(default_factory=list)
    failed_now: dict[str, str] = field(default_factory=dict)
    complete_before: list[str] = field(default_factory=list)
    failed_before: dict[str, str] = field(default_factory=dict)
    retried: dict[str, int] = field(default_factory=dict)
    gave_up: dict[str, str] = field(default_factory=dict)
    running_elsewhere: list[str] = field(default_factory=list)
    stale: dict[str, list[int]] = field(default_factory=dict)
    superseded: list[str] = field(default_factory=list)

    def merge(self, other: CellReport) -> None:
        """Add what another worker of the same call (a worker process) ran, failed and saw go stale."""
        self.ran.extend(other.ran)
        self.failed_now.update(other.failed_now)
        for key, numbers in other.stale.items():
            self.stale.setdefault(key, []).extend(numbers)
        self.superseded.extend(other.superseded)

    def to_dict(self) -> dict[str, Any]:
        return {"ran": sorted(self.ran), "failed_now": self.failed_now,
                "complete_before": sorted(self.complete_before), "failed_before": self.failed_before,
                "retried": self.retried, "gave_up": self.gave_up,
                "running_elsewhere": sorted(self.running_elsewhere), "stale": self.stale,
                "superseded": sorted(self.superseded)}


@dataclass(frozen=True)
class TrialTracking:
    """Where trial runs go: nested under ``parent_run``; metric names as the lock names them
    (``tie_break`` empty when ties go to the smallest λ; ``validity`` the valid-answer rate's)."""

    parent_run: str
    metric: str
    tie_break: str
    validity: str = ""


@dataclass(frozen=True)
class Claim:
    """A cell this worker holds: its RUNNING trial (and the trial's storage id), and, for a
    retry, the number of the first trial of the cell and the MLflow run of the attempt it
    replaces."""

    trial: Any
    trial_id: int
    cell: Cell
    retry_of: int | None = None
    replaced_run: str | None = None


def _start_trial_run(tracking: TrialTracking, study_name: str, claim: Claim) -> str:
    from mlflow.entities import Param, RunTag  # deferred: mlflow.entities is slow to import
    from mlflow.tracking import MlflowClient  # deferred: mlflow.tracking is slow to import

    client = MlflowClient()
    parent = client.get_run(tracking.parent_run)
    inherited = {k: v for k, v in parent.data.tags.items()
                 if k in ("mistill.corpus", "mistill.privacy", "mistill.code_version", "mistill.git_commit")}
    tags = {**inherited, "mlflow.parentRunId": tracking.parent_run, "mistill.stage": TRIAL_STAGE,
            TAG_STUDY: study_name, TAG_CELL: claim.cell.key, TAG_TRIAL: str(claim.trial.number)}
    if claim.retry_of is not None:
        tags[TAG_RETRY_OF] = str(claim.retry_of)
    run = client.create_run(parent.info.experiment_id, run_name=f"cell {claim.cell.key}",
                            tags=tags)
    p1, p2 = claim.cell.lambdas
    client.log_batch(run.info.run_id, params=[Param("lambda_p1", repr(p1)), Param("lambda_p2", repr(p2)),
                                              Param("trial", str(claim.trial.number))],
                     tags=[RunTag("mistill.selection.lock_sha256",
                                  parent.data.tags.get("mistill.selection.lock_sha256", ""))])
    return run.info.run_id


def _end_trial_run(run_id: str, tracking: TrialTracking, result: CellResult | None, error: str | None,
                   status: str | None = None) -> None:
    from mlflow.entities import Metric, RunTag  # deferred: mlflow.entities is slow to import
    from mlflow.tracking import MlflowClient  # deferred: mlflow.tracking is slow to import

    client = MlflowClient()
    now = int(time.time() * 1000)
    if result is not None:
        metrics = [Metric(tracking.metric, float(result.metric), now, 0)]
        if tracking.tie_break and math.isfinite(result.tie_break):
            metrics.append(Metric(tracking.tie_break, float(result.tie_break), now, 0))
        if tracking.validity and math.isfinite(result.validity):
            metrics.append(Metric(tracking.validity, float(result.validity), now, 0))
        tags = [RunTag(f"mistill.selection.run.{k}", v) for k, v in result.run_ids.items()]
        client.log_batch(run_id, metrics=metrics, tags=tags)
    if error is not None:
        client.set_tag(run_id, TAG_ERROR, error[:5000])
    with quiet_run_links():  # a cell's run is one row of the select_lambda run, not a log line
        client.set_terminated(run_id, status or ("FINISHED" if error is None else "FAILED"))


def _close_replaced_run(run_id: str, trial_number: int) -> None:
    """End the MLflow run of an attempt whose worker stopped: KILLED, saying which trial retries it."""
    from mlflow.exceptions import MlflowException  # deferred: mlflow.exceptions is slow to import
    from mlflow.tracking import MlflowClient  # deferred: mlflow.tracking is slow to import

    client = MlflowClient()
    with contextlib.suppress(MlflowException):
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_tag(run_id, TAG_ERROR, f"worker stopped (heartbeat stale); retried as trial {trial_number}")
            with quiet_run_links():
                client.set_terminated(run_id, "KILLED")


def _claim(handle: SelectionStudy, study: Any, space: Mapping[str, list[float]], scale: str,
           report: CellReport, report_lock: threading.Lock) -> Claim | None:
    """Under the file lock: fail stale trials (queuing their retries), then take a queued retry or
    the next unclaimed grid point as a RUNNING trial with its first heartbeat; None when every
    grid point of ``space`` is held and no retry is queued."""
    from optuna.trial import TrialState  # deferred: Optuna is slow to import

    with claim_lock(handle.storage_url, handle.name, handle.lock_file):
        stale = fail_stale(study, handle.storage, handle.study_id, handle.heartbeat.grace, ATTR_ERROR)
        trials = study.get_trials(deepcopy=False)
        if stale:
            with report_lock:
                for t in trials:
                    if t.number in stale and t.params:
                        report.stale.setdefault(Cell.of(t.params).key, []).append(t.number)
        ours = _in_space(trials, space)
        queued = any(t.state == TrialState.WAITING for t in ours)
        if not queued and len(_claimed_ids(ours, space)) >= math.prod(len(v) for v in space.values()):
            return None
        with quiet_optuna():
            trial = study.ask()  # takes a queued (WAITING) retry first, else a new trial
        trial_id = handle.storage.get_trial_id_from_study_id_trial_number(handle.study_id, trial.number)
        handle.storage.record_heartbeat(trial_id)
        values = {axis: trial.suggest_float(axis, min(vals), max(vals), log=scale == "log")
                  for axis, vals in sorted(space.items())}
        cell = Cell.of(values)
        trial.set_user_attr(ATTR_CELL, cell.key)
        trial.set_user_attr(ATTR_HEARTBEAT, handle.heartbeat.interval)
        frozen = handle.storage.get_trial(trial_id)
        retry_of = retried_from(frozen)
        if retry_of is None:
            return Claim(trial, trial_id, cell)
        if frozen.user_attrs.get(ATTR_ERROR):  # copied from the attempt it retries
            trial.set_user_attr(ATTR_ERROR, None)
        return Claim(trial, trial_id, cell, retry_of, frozen.user_attrs.get(ATTR_MLFLOW_RUN))


def _tell(handle: SelectionStudy, study: Any, claim: Claim, attrs: Mapping[str, Any], value: float | None,
          state: Any = None) -> Any | None:
    """Write ``attrs`` to the claimed trial and tell it (a value: COMPLETE; ``state``: FAIL); the
    frozen trial, or None when another worker failed it as stale meanwhile (no longer ours)."""
    from optuna.exceptions import UpdateFinishedTrialError  # deferred: Optuna is slow to import

    try:
        for key, val in attrs.items():
            claim.trial.set_user_attr(key, val)
        return study.tell(claim.trial, value, state=state)
    except (UpdateFinishedTrialError, ValueError):  # ValueError: "Cannot tell a FAIL trial"
        if handle.storage.get_trial(claim.trial_id).state.is_finished():
            return None
        raise


def _run_one(handle: SelectionStudy, study: Any, claim: Claim, runner: Runner,
             tracking: TrialTracking | None, report: CellReport, report_lock: threading.Lock) -> None:
    """Run one claimed cell with its heartbeat beating; record its result or its failure."""
    with beating(handle.storage, claim.trial_id, handle.heartbeat.interval):
        _run_claimed(handle, study, claim, runner, tracking, report, report_lock)


def _run_claimed(handle: SelectionStudy, study: Any, claim: Claim, runner: Runner,
                 tracking: TrialTracking | None, report: CellReport, report_lock: threading.Lock) -> None:
    from optuna.trial import TrialState  # deferred: Optuna is slow to import

    trial, cell = claim.trial, claim.cell
    if claim.replaced_run and tracking:
        _close_replaced_run(claim.replaced_run, trial.number)
    mlflow_run = _start_trial_run(tracking, handle.name, claim) if tracking else None
    if mlflow_run:
        trial.set_user_attr(ATTR_MLFLOW_RUN, mlflow_run)
    try:
        result = runner(CellRun(cell=cell, trial=trial.number, mlflow_run=mlflow_run))
        if not isinstance(result, CellResult):
            raise TypeError(f"the runner returned {type(result).__name__}, not a CellResult")
        if not math.isfinite(result.metric):
            raise ValueError(f"the selection metric is not finite ({result.metric!r})")
    except Exception as exc:  # noqa: BLE001 - a failed cell is recorded and reported; a rerun retries it
        error = f"{type(exc).__name__}: {exc}"
        told = _tell(handle, study, claim, {ATTR_ERROR: error + "\n" + traceback.format_exc()[-4000:],
                                            ATTR_REASON: _one_line(error)}, None, state=TrialState.FAIL)
        if mlflow_run:
            _end_trial_run(mlflow_run, tracking, None, error)
        with report_lock:
            if told is None:  # failed as stale meanwhile: its retry decides the cell
                report.superseded.append(cell.key)
            else:
                report.failed_now[cell.key] = error
        return
    except BaseException:  # interrupted: give the cell back as a stopped worker would
        told = _tell(handle, study, claim, {ATTR_ERROR: INTERRUPTED}, None, state=TrialState.FAIL)
        if mlflow_run:
            _end_trial_run(mlflow_run, tracking, None, INTERRUPTED, status="KILLED")
        if told is not None:
            queue_retry(study, handle.storage, told)
        raise
    attrs = {ATTR_TIE_BREAK: result.tie_break if math.isfinite(result.tie_break) else None,
             ATTR_VALIDITY: result.validity if math.isfinite(result.validity) else None,
             ATTR_RUN_IDS: dict(result.run_ids)}
    if _tell(handle, study, claim, attrs, float(result.metric)) is None:
        if mlflow_run:
            _end_trial_run(mlflow_run, tracking, result, "superseded: the heartbeat went stale while the cell "
                                                         "ran and the cell was retried", status="KILLED")
        with report_lock:
            report.superseded.append(cell.key)
        return
    if mlflow_run:
        _end_trial_run(mlflow_run, tracking, result, None)
    with report_lock:
        report.ran.append(cell.key)


def _found(study: Any, space: Mapping[str, list[float]]) -> CellReport:
    """What the study already holds for ``space`` before this call claims anything."""
    report = CellReport()
    for cell, t in _deciding_trials(_in_space(study.get_trials(deepcopy=False), space)).items():
        if t.state.name == "COMPLETE":
            report.complete_before.append(cell.key)
        elif t.state.name == "FAIL":
            report.failed_before[cell.key] = _error_of(t)
        else:
            report.running_elsewhere.append(cell.key)
    return report


def _unfinished(study: Any, space: Mapping[str, list[float]]) -> bool:
    """True while a trial of ``space`` is RUNNING or queued (WAITING)."""
    return any(t.state.name in ("RUNNING", "WAITING") for t in _in_space(study.get_trials(deepcopy=False), space))


def _queue_failed(handle: SelectionStudy, study: Any, space: Mapping[str, list[float]], report: CellReport) -> None:
    """Under the claim lock: queue again (a WAITING trial at the same grid point) every cell of
    ``space`` whose latest attempt failed, while it has retries left under the study's cap;
    record the retry's number on the trial and in the study's ``failure_retries``; report the
    cells out of retries in ``gave_up``."""
    import optuna  # deferred: Optuna is slow to import

    with claim_lock(handle.storage_url, handle.name, handle.lock_file):
        trials = _in_space(study.get_trials(deepcopy=False), space)
        cells = _by_cell(trials)
        queued: dict[str, int] = {}
        for cell, t in sorted(_deciding_trials(trials).items()):
            if t.state.name != "FAIL":
                continue
            used = _retries_used(cells[cell])
            if used >= handle.max_retries:
                report.gave_up[cell.key] = _error_of(t)
                continue
            first = retried_from(t)
            system_attrs = {k: v for k, v in t.system_attrs.items() if k in ("grid_id", "search_space")}
            system_attrs["failed_trial"] = t.number if first is None else first
            user_attrs = {ATTR_CELL: cell.key, ATTR_FAILURE_RETRY: used + 1, "retry_reason": _error_of(t)}
            study.add_trial(optuna.create_trial(state=optuna.trial.TrialState.WAITING, params=t.params,
                                                distributions=t.distributions, user_attrs=user_attrs,
                                                system_attrs=system_attrs))
            queued[cell.key] = used + 1
        if queued:
            counts = dict(handle.storage.get_study_user_attrs(handle.study_id).get(ATTR_RETRIES) or {})
            counts.update(queued)
            handle.storage.set_study_user_attr(handle.study_id, ATTR_RETRIES, counts)
            report.retried.update(queued)


def _work(handle: SelectionStudy, study: Any, space: Mapping[str, list[float]], runner: Runner, scale: str,
          tracking: TrialTracking | None, report: CellReport, workers: int) -> None:
    """Claim and run cells in ``workers`` threads of this process until no cell of ``space`` is
    running or queued anywhere; re-raise the first error of a thread."""
    report_lock = threading.Lock()
    finished_here = threading.Condition()  # wakes this process's waiting threads at once

    def work() -> None:
        while True:
            claim = _claim(handle, study, space, scale, report, report_lock)
            if claim is not None:
                try:
                    _run_one(handle, study, claim, runner, tracking, report, report_lock)
                finally:
                    with finished_here:
                        finished_here.notify_all()
            elif _unfinished(study, space):
                with finished_here:
                    finished_here.wait(timeout=handle.heartbeat.poll)
            else:
                return

    if workers == 1:
        work()
        return
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, name=f"select-lambda-{i}") for i in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to open the study and run cells (sent pickled to it)."""

    storage_url: str
    study_name: str
    lock_file: Path
    heartbeat: Heartbeat
    max_retries: int
    space: dict[str, list[float]]
    scale: str
    runner: Runner
    tracking: TrialTracking | None
    tracking_uri: str
    torch_threads: int


def cpu_share(workers: int) -> int:
    """The CPUs this process may use, divided among ``workers`` (at least 1 each)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without CPU affinity
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, workers))


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` when it pickles, else a RuntimeError carrying its type, message and traceback."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return RuntimeError(f"{type(exc).__name__}: {exc}\n{text[-4000:]}")


def _process_main(spec: WorkerSpec, conn: Any) -> None:
    """A worker process: limit torch to its share of the CPUs, open the study, claim and run cells
    until none is running or queued; send back ``("ok", CellReport)`` or ``("error", exception)``."""
    threads = str(spec.torch_threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = threads
    try:
        import mlflow  # deferred: MLflow is slow to import
        import torch  # deferred: torch is slow to import

        torch.set_num_threads(spec.torch_threads)
        mlflow.set_tracking_uri(spec.tracking_uri)
        handle = SelectionStudy(spec.study_name, spec.storage_url, _storage(spec.storage_url, spec.heartbeat),
                                spec.lock_file, created=False, heartbeat=spec.heartbeat,
                                max_retries=spec.max_retries)
        report = CellReport()
        _work(handle, handle.load(_grid_sampler(spec.space)), spec.space, spec.runner, spec.scale, spec.tracking,
              report, 1)
        conn.send(("ok", report))
    except BaseException as exc:  # noqa: BLE001 - sent to the parent, which re-raises it
        conn.send(("error", _sendable(exc)))
    finally:
        conn.close()


def _run_processes(spec: WorkerSpec, workers: int) -> list[CellReport]:
    """Start ``workers`` spawned worker processes on ``spec`` and wait for all of them; their
    reports, or the first error once every process has ended (a process that died without a
    word is an error too; its cell is retried by the others once its heartbeat is stale)."""
    ctx = multiprocessing.get_context("spawn")
    started: list[tuple[Any, Any]] = []
    try:
        for i in range(workers):
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_process_main, args=(spec, sender), name=f"select-lambda-{i}")
            proc.start()
            sender.close()
            started.append((proc, receiver))
        reports: list[CellReport] = []
        errors: list[BaseException] = []
        for proc, receiver in started:
            try:
                kind, payload = receiver.recv()
            except EOFError:
                proc.join()
                kind, payload = "error", RuntimeError(f"λ-selection worker process {proc.name} exited with code "
                                                      f"{proc.exitcode} before reporting")
            proc.join()
            (reports if kind == "ok" else errors).append(payload)
    except BaseException:  # interrupted here: the workers give their cells back themselves
        for proc, _ in started:
            proc.join(timeout=max(30, spec.heartbeat.grace))
            if proc.is_alive():
                proc.terminate()
        raise
    if errors:
        raise errors[0]
    return reports


def run_cells(handle: SelectionStudy, space: Mapping[str, list[float]], runner: Runner, *,
              scale: str, workers: int = 1, tracking: TrialTracking | None = None,
              processes: bool = False) -> CellReport:
    """Run every cell of ``space`` (``{axis: values}``) to a result, ``workers`` at once.

    Cells already complete are skipped; cells failed earlier are queued again first while they
    have retries left under the study's ``max_retries`` (a cell failing in this call is not run
    again by it); cells another worker is running are waited for (a stale one is failed and
    retried here). Returns once no cell of ``space`` is running or queued anywhere.

    processes: with ``workers`` > 1, run each worker as a spawned process (``runner`` must
        pickle), with ``torch.set_num_threads`` at its share of the CPUs; else threads here.
    """
    if workers < 1:
        raise MistillInputError(f"workers must be >= 1, got {workers}", field="workers")
    study = handle.load(_grid_sampler(space))
    report = _found(study, space)
    _queue_failed(handle, study, space, report)
    if not processes or workers == 1:
        _work(handle, study, space, runner, scale, tracking, report, workers)
        return report
    import mlflow  # deferred: MLflow is slow to import

    spec = WorkerSpec(storage_url=handle.storage_url, study_name=handle.name, lock_file=handle.lock_file,
                      heartbeat=handle.heartbeat, max_retries=handle.max_retries,
                      space={k: list(v) for k, v in space.items()}, scale=scale, runner=runner, tracking=tracking,
                      tracking_uri=mlflow.get_tracking_uri(), torch_threads=cpu_share(workers))
    for part in _run_processes(spec, workers):
        report.merge(part)
    return report


@dataclass
class StudyCells:
    """Every trial of the study read back by cell; ``retries``: how many times reruns queued a
    cell after it failed (cells never retried are absent); ``failures``: a cell's failed attempts;
    ``max_retries``: the study's cap on ``retries``."""

    results: dict[Cell, CellResult] = field(default_factory=dict)
    failed: dict[Cell, str] = field(default_factory=dict)
    running: set[Cell] = field(default_factory=set)
    waiting: set[Cell] = field(default_factory=set)
    trials: dict[Cell, list[dict[str, Any]]] = field(default_factory=dict)
    retries: dict[Cell, int] = field(default_factory=dict)
    failures: dict[Cell, int] = field(default_factory=dict)
    max_retries: int = DEFAULT_MAX_RETRIES

    def retryable(self, cell: Cell) -> bool:
        """True when ``cell`` failed and a rerun would queue it again (retries left)."""
        return cell in self.failed and self.retries.get(cell, 0) < self.max_retries


def failure_summary(cells: StudyCells) -> str:
    """One line on the failed cells: for each, its failed attempts, the retries used of the cap,
    whether a rerun retries it, and the last reason; empty when no cell failed."""
    parts = []
    for cell in sorted(cells.failed):
        used, n = cells.retries.get(cell, 0), cells.failures.get(cell, 1)
        then = "a rerun retries it" if cells.retryable(cell) else "out of retries"
        parts.append(f"{cell.key} failed {n} time{'s' if n != 1 else ''} ({used}/{cells.max_retries} retries "
                     f"used, {then}): {cells.failed[cell]}")
    return "; ".join(parts)


def study_cells(handle: SelectionStudy) -> StudyCells:
    """Results of the complete cells, errors of the failed ones (no trial of theirs complete,
    running or queued), the running and the queued (retry WAITING) cells, each cell's trials
    (number, state, MLflow run, the trial it retries, the failure retry's number and the failure's
    reason) and its failure retries and failed attempts."""
    out = StudyCells(max_retries=handle.max_retries)
    trials = handle.load().get_trials(deepcopy=False)
    for t in trials:
        if t.params:
            cell = Cell.of(t.params)
            out.trials.setdefault(cell, []).append({
                "number": t.number, "state": t.state.name, "mlflow_run": t.user_attrs.get(ATTR_MLFLOW_RUN),
                "retry_of": retried_from(t), "failure_retry": t.user_attrs.get(ATTR_FAILURE_RETRY),
                "failure_reason": _error_of(t) if t.state.name == "FAIL" else None})
            if t.state.name == "FAIL":
                out.failures[cell] = out.failures.get(cell, 0) + 1
    for cell, group in _by_cell(trials).items():
        used = _retries_used(group)
        if used:
            out.retries[cell] = used
    for cell, t in _deciding_trials(trials).items():
        if t.state.name == "COMPLETE":
            tb, valid = t.user_attrs.get(ATTR_TIE_BREAK), t.user_attrs.get(ATTR_VALIDITY)
            out.results[cell] = CellResult(metric=float(t.value), tie_break=math.nan if tb is None else float(tb),
                                           run_ids=dict(t.user_attrs.get(ATTR_RUN_IDS, {})),
                                           validity=math.nan if valid is None else float(valid))
        elif t.state.name == "FAIL":
            out.failed[cell] = _error_of(t)
        elif t.state.name == "RUNNING":
            out.running.add(cell)
        else:
            out.waiting.add(cell)
    return out
