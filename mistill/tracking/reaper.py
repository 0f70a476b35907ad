"""Delete the run that ``mlflow run`` opened for a stage that did not use it.

``mlflow run`` creates a run before the entry point starts and, once the entry point exits, always
sets that run's status (FINISHED or FAILED); setting the status of a deleted run is an error that
fails the whole ``mlflow run``. A stage that reuses a finished run or waits for another process's
run has no use for that launched run, so it starts this reaper: a small detached process that
waits until ``mlflow run`` has ended the launched run (or until the process that waits on the
stage is gone), then deletes the run, so one ``mlflow run`` leaves one run. A stage that refuses
its input purges the launched run instead, which holds the refused values
(:func:`mistill.tracking.purge.purge_launched_run`); it starts this reaper only where the run
cannot be purged (a backend store it does not know).

    python -m mistill.tracking.reaper RUN_ID WATCH_PID [TIMEOUT_S]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from mistill.parent_watch import pid_alive

POLL_S = 0.2


def spawn_reaper(run_id: str, tracking_uri: str, watch_pid: int | None = None) -> None:
    """Start the reaper for ``run_id`` in its own session (it outlives this process).

    watch_pid: the process that will end the run (default: this process's parent, the
        ``mlflow run`` that launched the entry point).
    """
    env = dict(os.environ)
    env["MLFLOW_TRACKING_URI"] = tracking_uri
    env.pop("MLFLOW_RUN_ID", None)
    pid = os.getppid() if watch_pid is None else watch_pid
    subprocess.Popen([sys.executable, "-m", "mistill.tracking.reaper", run_id, str(pid)], env=env,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, close_fds=True)


def reap(run_id: str, watch_pid: int, timeout_s: float | None = None) -> str:
    """Wait for ``run_id`` to leave RUNNING, then delete it; returns what happened.

    The wait lasts as long as ``watch_pid`` lives (a stage may wait for another process's run,
    then work for hours). If ``watch_pid`` is gone while the run is still RUNNING (``mlflow run``
    was killed before it could end the run), the run is ended FAILED and deleted. ``timeout_s``
    bounds the wait (tests).
    """
    from mlflow.exceptions import MlflowException  # deferred: mlflow.exceptions is slow to import
    from mlflow.tracking import MlflowClient  # deferred: mlflow.tracking is slow to import

    client = MlflowClient()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    orphaned_since: float | None = None
    while deadline is None or time.monotonic() < deadline:
        try:
            run = client.get_run(run_id)
            if run.info.lifecycle_stage == "deleted":
                return "already deleted"
            if run.info.status != "RUNNING":
                client.delete_run(run_id)
                return "deleted"
            if not pid_alive(watch_pid):
                orphaned_since = orphaned_since or time.monotonic()
                if time.monotonic() - orphaned_since > 2.0:
                    client.set_terminated(run_id, "FAILED")
                    client.delete_run(run_id)
                    return "deleted (orphaned)"
        except MlflowException:
            pass
        time.sleep(POLL_S)
    return "gave up"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    timeout = float(args[2]) if len(args) == 3 else None
    reap(args[0], int(args[1]), timeout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
