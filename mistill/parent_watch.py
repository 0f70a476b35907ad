"""A launched step dies with the process that launched it.

``select_lambda``, ``characterize`` and the other workflows run their steps as fresh processes
through ``mlflow.projects.run`` (:func:`mistill.stages.steps.run_step` with
``launch=mlflow``). MLflow starts them with no tie to their launcher, so killing the launcher
used to leave its ``train.py`` running. Now the launcher names itself in
``$MISTILL_LAUNCHER_PID`` (:func:`launching`), and the step, as it starts
(:func:`die_with_launcher`), asks Linux to send it SIGTERM when its parent dies
(``prctl(PR_SET_PDEATHSIG)``); where the launcher is not its direct parent (a shell in between)
or the system has no ``prctl``, a daemon thread checks the launcher every second and sends
SIGTERM to the step once it is gone. SIGTERM ends the step's run KILLED, so the next launch
resumes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from mistill.io import environment_variable

ENV_LAUNCHER = "MISTILL_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1
_POLL_S = 1.0


@contextlib.contextmanager
def launching() -> Iterator[None]:
    """Name this process as the launcher of the steps started inside (restored on exit)."""
    with environment_variable(ENV_LAUNCHER, str(os.getpid())):
        yield


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def pid_alive(pid: int) -> bool:
    """True iff process ``pid`` exists and is not a zombie (``/proc``'s state, where there is one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        # state is the field after the parenthesised command name
        if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _watch(pid: int) -> None:
    while pid_alive(pid):
        time.sleep(_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)


def die_with_launcher() -> None:
    """If a launcher named itself (``$MISTILL_LAUNCHER_PID``), end this process with SIGTERM
    when it dies. No-op otherwise."""
    text = os.environ.get(ENV_LAUNCHER, "")
    if not text.isdigit():
        return
    pid = int(text)
    if pid == os.getpid():
        return
    if os.getppid() == pid and _set_pdeathsig(signal.SIGTERM):
        if os.getppid() != pid:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
        return
    if not pid_alive(pid):
        os.kill(os.getpid(), signal.SIGTERM)
        return
    threading.Thread(target=_watch, args=(pid,), name="mistill-launcher-watch", daemon=True).start()
