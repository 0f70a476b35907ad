"""Liveness of a cell's trial: Optuna's heartbeat, and stale trials failed and retried.

A worker records a heartbeat for the trial it runs every ``interval`` seconds (:func:`beating`;
the first beat is recorded when the cell is claimed). A RUNNING trial whose last heartbeat is
more than ``grace`` seconds old belongs to a worker that stopped (killed, its machine lost):
:func:`fail_stale` fails it through Optuna's :func:`~optuna.storages.fail_stale_trials`, and the
storage's :class:`~optuna.storages.RetryHeartbeatStaleTrialCallback` queues a WAITING copy that
carries the same grid point (params, ``grid_id``, user attributes), at most ``max_retry`` times in
a cell's chain of retries. A trial told FAIL because its runner raised never passes through that
callback: it stays failed until a rerun queues it again (:mod:`selection.grid`).

A RUNNING trial with no heartbeat at all was claimed by a version of this package that recorded
none; it is taken as stale once it started more than ``grace`` seconds ago (its worker cannot be
told apart from a dead one) and is failed and queued the same way.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mistill.errors import MistillInputError

ATTR_HEARTBEAT = "heartbeat_interval"
"""User attribute of every trial claimed with a heartbeat (its interval in seconds)."""


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Silence Optuna's experimental-feature warnings (heartbeat, retry callback) for a call."""
    from optuna.exceptions import ExperimentalWarning  # deferred: Optuna is slow to import

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        yield


@dataclass(frozen=True)
class Heartbeat:
    """How liveness is judged: a beat every ``interval`` s, stale after ``grace`` s without one,
    a stale cell retried at most ``max_retry`` times."""

    interval: int = 30
    grace: int = 120
    max_retry: int = 3

    def check(self) -> None:
        """Refuse settings under which a live worker could be taken for a dead one.

        Raises:
            MistillInputError: ``interval`` < 1, ``grace`` <= ``interval`` or ``max_retry`` < 0.
        """
        if self.interval < 1:
            raise MistillInputError(f"must be >= 1 second, got {self.interval}", field="heartbeat_interval")
        if self.grace <= self.interval:
            raise MistillInputError(f"must exceed heartbeat_interval ({self.interval} s), got {self.grace}",
                                    field="grace_period")
        if self.max_retry < 0:
            raise MistillInputError(f"must be >= 0, got {self.max_retry}", field="max_retry")

    @property
    def poll(self) -> float:
        """Seconds between looks at cells another process runs: the interval, at most 2 s."""
        return float(min(self.interval, 2))

    def to_dict(self) -> dict[str, int]:
        return {"interval": self.interval, "grace": self.grace, "max_retry": self.max_retry}


def rdb_storage(url: str, heartbeat: Heartbeat, engine_kwargs: dict[str, Any]) -> Any:
    """An :class:`~optuna.storages.RDBStorage` with heartbeat and the stale-trial retry callback."""
    import optuna  # deferred: Optuna is slow to import

    heartbeat.check()
    with quiet_optuna():
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=heartbeat.max_retry)
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat.interval,
                                          grace_period=heartbeat.grace, heartbeat_stale_trial_callback=retry)


def _fail_unmonitored(study: Any, storage: Any, study_id: int, grace: int) -> None:
    """Fail, and queue for retry, RUNNING trials with no heartbeat that started over ``grace`` s ago."""
    from optuna.exceptions import UpdateFinishedTrialError  # deferred: Optuna is slow to import
    from optuna.trial import TrialState  # deferred: Optuna is slow to import

    now = datetime.datetime.now()
    callback = storage.get_heartbeat_stale_trial_callback()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if ATTR_HEARTBEAT in t.user_attrs or t.datetime_start is None:
            continue
        if (now - t.datetime_start).total_seconds() <= grace:
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        try:
            failed = storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
        except UpdateFinishedTrialError:  # finished meanwhile by its own worker
            continue
        if failed and callback is not None:
            callback(study, storage.get_trial(trial_id))


def fail_stale(study: Any, storage: Any, study_id: int, grace: int, error_attr: str) -> list[int]:
    """Fail the study's stale RUNNING trials (Optuna's retry callback queues their cells again);
    return the numbers of those failed here: RUNNING before, FAIL now, with no ``error_attr``
    (the user attribute a worker sets before it tells a runner's failure)."""
    import optuna  # deferred: Optuna is slow to import
    from optuna.trial import TrialState  # deferred: Optuna is slow to import

    before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    if not before:
        return []
    with quiet_optuna():
        optuna.storages.fail_stale_trials(study)
        _fail_unmonitored(study, storage, study_id, grace)
    return sorted(t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
                  if t.number in before and not t.user_attrs.get(error_attr))


def queue_retry(study: Any, storage: Any, frozen: Any) -> None:
    """Queue a WAITING copy of the FAIL trial ``frozen`` through the storage's retry callback
    (a worker interrupted in-process gives its cell back as a dead one would)."""
    callback = storage.get_heartbeat_stale_trial_callback()
    if callback is not None:
        with quiet_optuna():
            callback(study, frozen)


def retried_from(frozen: Any) -> int | None:
    """The number of the first trial of the cell's retry chain, or None for a first attempt."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback  # deferred: Optuna is slow to import

    with quiet_optuna():
        return RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen)


@contextlib.contextmanager
def beating(storage: Any, trial_id: int, interval: int) -> Iterator[None]:
    """Record the trial's heartbeat every ``interval`` seconds in a daemon thread while the body
    runs. A failed write (a busy database) is retried at the next beat."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            with contextlib.suppress(Exception):  # the next beat tries again; grace covers a miss
                storage.record_heartbeat(trial_id)

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
