"""A minimal stage for the lease tests, run as its own process: one StageRun (resume on) that
computes ``n`` notes, each logged to a count file before it is written, with a pause per note.

    python tests/lease_worker.py CORPUS COUNT_FILE N SLEEP_S [KILL_AFTER]

Prints ``run <id>`` when done. With ``KILL_AFTER`` = k, the process SIGKILLs itself right after
note k is written (a crash nobody cleans up after). With ``LEASE_TEST_GATE`` = a path in the
environment, every note after the first waits until that file exists.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

from mistill.config import Config
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.runs import StageRun

CODE_VERSION = "lease-test-v1"


@dataclasses.dataclass(frozen=True)
class LeaseTestConfig(Config):
    n_notes: int = 3


def main(argv: list[str]) -> int:
    corpus, count_file, n, sleep_s = argv[0], Path(argv[1]), int(argv[2]), float(argv[3])
    kill_after = int(argv[4]) if len(argv) > 4 else None
    root = Path(os.environ["MISTILL_ROOT"])
    with StageRun("lease-test", LeaseTestConfig(n_notes=n), corpus=corpus,
                  guard=PrivacyGuard([], "synthetic"), resume=True, root=root,
                  code_version=CODE_VERSION) as run:
        if not run.reused:
            done = run.finished_notes("notes")
            for i in range(n):
                note = f"n{i}"
                if note in done:
                    continue
                gate = os.environ.get("LEASE_TEST_GATE")
                while gate and i > 0 and not Path(gate).exists():
                    time.sleep(0.05)
                with count_file.open("a") as fh:
                    fh.write(f"{note} {os.getpid()}\n")
                time.sleep(sleep_s)
                run.write_note("notes", note, {"value.json": {"i": i}})
                if kill_after is not None and i == kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
    print(f"run {run.run_id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
