"""The Optuna study of a λ selection: one SQLite (RDB) study per lock and inputs, each cell once.

* :func:`open_study` creates the study (direction maximize) with the lock's sha256 in its user
  attributes, or loads it and refuses when the lock changed.
* :func:`run_cells` runs the unclaimed cells of a grid through Optuna's :class:`GridSampler`
  (ask/tell), ``workers`` threads in this process; other processes may work on the same study
  at the same time. Claiming a cell (creating the trial and fixing its grid point) happens under
  an exclusive file lock next to the SQLite file, so no two workers, threads or processes, ever
  claim one cell: a cell with any trial (running, complete or failed) is never run again. Failed
  cells stay failed (reported, not retried).
* :func:`study_cells` reads every trial back as cell results, failures and running cells.

Each trial is a nested MLflow run (``mlflow.parentRunId`` = the ``select_lambda`` run) when a
parent run is given.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mistill.errors import MistillInputError
from selection.cells import Cell, CellResult, CellRun, Runner
from selection.lock import Lock

STUDY_DB = "selection.db"
ATTR_LOCK_SHA = "lock_sha256"
ATTR_LOCK_PATH = "lock_path"
ATTR_LOCK_TEXT = "lock_text"
ATTR_CELL = "cell"
ATTR_MLFLOW_RUN = "mlflow_run"
ATTR_TIE_BREAK = "tie_break"
ATTR_RUN_IDS = "run_ids"
ATTR_ERROR = "error"
TAG_STUDY = "mistill.selection.study"
TAG_CELL = "mistill.selection.cell"
TAG_TRIAL = "mistill.selection.trial"
TRIAL_STAGE = "select_lambda.cell"
_SQLITE = "sqlite:///"

_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


def default_storage_url(root: Path | str) -> str:
    """``sqlite:///<root>/optuna/selection.db`` (absolute path), the directory created."""
    path = (Path(root) / "optuna" / STUDY_DB).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return _SQLITE + str(path)


def lock_file_for(storage_url: str, root: Path | str) -> Path:
    """The file whose exclusive lock serialises cell claims: ``<db>.lock`` beside a SQLite file,
    else one under ``<root>/optuna/`` named by the URL's hash (one machine only)."""
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


@dataclass
class SelectionStudy:
    """An opened study: its name, storage and the file lock that serialises claims."""

    name: str
    storage_url: str
    storage: Any
    lock_file: Path
    created: bool

    def load(self, sampler: Any = None) -> Any:
        import optuna

        return optuna.load_study(study_name=self.name, storage=self.storage, sampler=sampler)


def _storage(url: str) -> Any:
    import optuna

    kwargs = {"connect_args": {"timeout": 120}} if url.startswith(_SQLITE) else {}
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


def open_study(lock: Lock, storage_url: str, study_name: str, *, root: Path | str = ".mistill") -> SelectionStudy:
    """Create the study under ``lock`` or load it; refuse a study created under another lock.

    Raises:
        MistillInputError: the study exists with a different lock sha256 (names the lock file).
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    lock_file = lock_file_for(storage_url, root)
    with exclusive(lock_file):
        storage = _storage(storage_url)
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
            return SelectionStudy(study_name, storage_url, storage, lock_file, created=False)
        study = optuna.create_study(study_name=study_name, storage=storage, direction="maximize")
        study.set_user_attr(ATTR_LOCK_SHA, lock.sha256)
        study.set_user_attr(ATTR_LOCK_PATH, lock.path)
        study.set_user_attr(ATTR_LOCK_TEXT, lock.text)
        study.set_user_attr("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        return SelectionStudy(study_name, storage_url, storage, lock_file, created=True)


def _grid_sampler(space: Mapping[str, list[float]]) -> Any:
    from optuna.samplers import GridSampler

    class ClaimGridSampler(GridSampler):
        """GridSampler whose grid point is fixed at claim time; the worker loop, not the sampler,
        decides when the grid is exhausted (so ask/tell never calls ``study.stop``)."""

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    # seed fixed: every worker must map a grid id to the same cell
    return ClaimGridSampler({k: list(v) for k, v in space.items()}, seed=0)


def _space_of(trial: Any) -> dict[str, list[float]] | None:
    return trial.system_attrs.get("search_space")


def _claimed_ids(study: Any, space: Mapping[str, list[float]]) -> set[int]:
    """Grid ids of ``space`` that some trial (any state) holds."""
    wanted = {k: list(v) for k, v in space.items()}
    return {t.system_attrs["grid_id"] for t in study.get_trials(deepcopy=False)
            if "grid_id" in t.system_attrs and _space_of(t) == wanted}


@dataclass
class CellReport:
    """What one :func:`run_cells` call found and did, by cell key."""

    ran: list[str] = field(default_factory=list)
    failed_now: dict[str, str] = field(default_factory=dict)
    complete_before: list[str] = field(default_factory=list)
    failed_before: dict[str, str] = field(default_factory=dict)
    running_elsewhere: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"ran": sorted(self.ran), "failed_now": self.failed_now,
                "complete_before": sorted(self.complete_before), "failed_before": self.failed_before,
                "running_elsewhere": sorted(self.running_elsewhere)}


@dataclass(frozen=True)
class TrialTracking:
    """Where trial runs go: nested under ``parent_run``; metric names as the lock names them."""

    parent_run: str
    metric: str
    tie_break: str


def _start_trial_run(tracking: TrialTracking, study_name: str, cell: Cell, trial: int) -> str:
    from mlflow.entities import Param, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    parent = client.get_run(tracking.parent_run)
    inherited = {k: v for k, v in parent.data.tags.items()
                 if k in ("mistill.corpus", "mistill.privacy", "mistill.code_version", "mistill.git_commit")}
    tags = {**inherited, "mlflow.parentRunId": tracking.parent_run, "mistill.stage": TRIAL_STAGE,
            TAG_STUDY: study_name, TAG_CELL: cell.key, TAG_TRIAL: str(trial)}
    run = client.create_run(parent.info.experiment_id, run_name=f"cell {cell.key}",
                            tags=tags)
    p1, p2 = cell.lambdas
    client.log_batch(run.info.run_id, params=[Param("lambda_p1", repr(p1)), Param("lambda_p2", repr(p2)),
                                              Param("trial", str(trial))],
                     tags=[RunTag("mistill.selection.lock_sha256",
                                  parent.data.tags.get("mistill.selection.lock_sha256", ""))])
    return run.info.run_id


def _end_trial_run(run_id: str, tracking: TrialTracking, result: CellResult | None, error: str | None) -> None:
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    now = int(time.time() * 1000)
    if result is not None:
        metrics = [Metric(tracking.metric, float(result.metric), now, 0)]
        if math.isfinite(result.tie_break):
            metrics.append(Metric(tracking.tie_break, float(result.tie_break), now, 0))
        tags = [RunTag(f"mistill.selection.run.{k}", v) for k, v in result.run_ids.items()]
        client.log_batch(run_id, metrics=metrics, tags=tags)
    if error is not None:
        client.set_tag(run_id, "mistill.selection.error", error[:5000])
    client.set_terminated(run_id, "FINISHED" if error is None else "FAILED")


def _claim(handle: SelectionStudy, study: Any, space: Mapping[str, list[float]], scale: str) -> tuple[Any, Cell] | None:
    """Under the file lock: the next unclaimed grid point as a RUNNING trial, or None."""
    with exclusive(handle.lock_file):
        n = math.prod(len(v) for v in space.values())
        if len(_claimed_ids(study, space)) >= n:
            return None
        trial = study.ask()
        values = {axis: trial.suggest_float(axis, min(vals), max(vals), log=scale == "log")
                  for axis, vals in sorted(space.items())}
        cell = Cell.of(values)
        trial.set_user_attr(ATTR_CELL, cell.key)
        return trial, cell


def _run_one(handle: SelectionStudy, study: Any, trial: Any, cell: Cell, runner: Runner,
             tracking: TrialTracking | None, report: CellReport, report_lock: threading.Lock) -> None:
    from optuna.trial import TrialState

    mlflow_run = _start_trial_run(tracking, handle.name, cell, trial.number) if tracking else None
    if mlflow_run:
        trial.set_user_attr(ATTR_MLFLOW_RUN, mlflow_run)
    result: CellResult | None = None
    error: str | None = None
    try:
        result = runner(CellRun(cell=cell, trial=trial.number, mlflow_run=mlflow_run))
        if not isinstance(result, CellResult):
            raise TypeError(f"the runner returned {type(result).__name__}, not a CellResult")
        if not math.isfinite(result.metric):
            raise ValueError(f"the selection metric is not finite ({result.metric!r})")
    except Exception as exc:  # noqa: BLE001 - a failed cell is recorded and reported, not retried
        error = f"{type(exc).__name__}: {exc}"
        trial.set_user_attr(ATTR_ERROR, error + "\n" + traceback.format_exc()[-4000:])
        if mlflow_run:
            _end_trial_run(mlflow_run, tracking, None, error)
        study.tell(trial, state=TrialState.FAIL)
        with report_lock:
            report.failed_now[cell.key] = error
        return
    except BaseException:
        trial.set_user_attr(ATTR_ERROR, "interrupted")
        if mlflow_run:
            _end_trial_run(mlflow_run, tracking, None, "interrupted")
        study.tell(trial, state=TrialState.FAIL)
        raise
    trial.set_user_attr(ATTR_TIE_BREAK, result.tie_break if math.isfinite(result.tie_break) else None)
    trial.set_user_attr(ATTR_RUN_IDS, dict(result.run_ids))
    if mlflow_run:
        _end_trial_run(mlflow_run, tracking, result, None)
    study.tell(trial, float(result.metric))
    with report_lock:
        report.ran.append(cell.key)


def run_cells(handle: SelectionStudy, space: Mapping[str, list[float]], runner: Runner, *,
              scale: str, workers: int = 1, tracking: TrialTracking | None = None) -> CellReport:
    """Run every unclaimed cell of ``space`` (``{axis: values}``) once, ``workers`` threads here.

    Cells already complete are skipped; cells that failed earlier, or that another worker is
    running, are reported and not run. Returns what was found and done.
    """
    if workers < 1:
        raise MistillInputError(f"workers must be >= 1, got {workers}", field="workers")
    sampler = _grid_sampler(space)
    study = handle.load(sampler)
    report = CellReport()
    wanted = {k: list(v) for k, v in space.items()}
    for t in study.get_trials(deepcopy=False):
        if _space_of(t) != wanted or ATTR_CELL not in t.user_attrs:
            continue
        key = t.user_attrs[ATTR_CELL]
        if t.state.name == "COMPLETE":
            report.complete_before.append(key)
        elif t.state.name == "FAIL":
            report.failed_before[key] = str(t.user_attrs.get(ATTR_ERROR, "")).splitlines()[0] if \
                t.user_attrs.get(ATTR_ERROR) else "failed"
        elif t.state.name == "RUNNING":
            report.running_elsewhere.append(key)
    report_lock = threading.Lock()

    def work() -> None:
        while True:
            claimed = _claim(handle, study, space, scale)
            if claimed is None:
                return
            trial, cell = claimed
            _run_one(handle, study, trial, cell, runner, tracking, report, report_lock)

    if workers == 1:
        work()
        return report
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
    return report


@dataclass
class StudyCells:
    """Every trial of the study read back by cell."""

    results: dict[Cell, CellResult] = field(default_factory=dict)
    failed: dict[Cell, str] = field(default_factory=dict)
    running: set[Cell] = field(default_factory=set)
    trials: dict[Cell, list[dict[str, Any]]] = field(default_factory=dict)


def study_cells(handle: SelectionStudy) -> StudyCells:
    """Results of the COMPLETE trials, errors of the FAIL ones, the RUNNING cells, and each cell's
    trials (number, state, MLflow run); a cell counts as complete if any of its trials is."""
    out = StudyCells()
    for t in handle.load().get_trials(deepcopy=False):
        if not t.params:
            continue
        cell = Cell.of(t.params)
        out.trials.setdefault(cell, []).append({"number": t.number, "state": t.state.name,
                                                "mlflow_run": t.user_attrs.get(ATTR_MLFLOW_RUN)})
        if t.state.name == "COMPLETE":
            tb = t.user_attrs.get(ATTR_TIE_BREAK)
            out.results[cell] = CellResult(metric=float(t.value), tie_break=math.nan if tb is None else float(tb),
                                           run_ids=dict(t.user_attrs.get(ATTR_RUN_IDS, {})))
        elif t.state.name == "FAIL":
            out.failed[cell] = str(t.user_attrs.get(ATTR_ERROR, "failed")).splitlines()[0]
        elif t.state.name == "RUNNING":
            out.running.add(cell)
    for cell in out.results:
        out.failed.pop(cell, None)
        out.running.discard(cell)
    return out
