"""Sandboxed execution of generated code: the pass@1 of the programming tasks (paper App. P).

A program (the model's code followed by the task's tests, as BigCodeBench runs them) is executed
by :func:`run_program` in a child Python process that

* starts in a fresh temporary directory (its working directory, ``HOME`` and ``TMPDIR``), removed
  afterwards, with a minimal environment and the interpreter in isolated mode (``-I``: no
  ``PYTHONPATH``, no user site, the script's folder not on the path);
* runs under resource limits (:class:`SandboxLimits`): address space, CPU seconds, the size of
  any file it writes, and a wall-clock timeout after which its whole process group is killed;
* has no network: in a new network namespace (``unshare -rn``, only the loopback device, down)
  where the kernel lets an unprivileged user create one, and in every case behind a guard that
  makes the socket module's connecting calls raise (:data:`ISOLATION` says which applied).

The harness executes the program as a module, then runs every ``unittest.TestCase`` it defines, and
writes the outcome to a receipt file named on its command line: a program that ends the process
itself (``sys.exit``, ``os._exit``) leaves none and is an ``error``, whatever its exit status.
Each program gets exactly one terminal :class:`Verdict` (:data:`OUTCOMES`): ``passed`` (at least one
test ran and every test passed), ``failed`` (a test failed or raised), ``error`` (the program did
not run to its tests: a syntax error, an import error, an exception at module level, no tests),
``timeout``, ``memory`` (a ``MemoryError`` or the address-space limit), ``no_code`` (no program to
run: the generation held no code block). pass@1 is the share of ``passed`` over every task
(:func:`pass_at_1`), a task without code counting as not passed.

The limits are **[recon]**: the paper states sandboxed execution, not its limits; the defaults
(60 s, 4 GiB, 64 MiB of files) leave BigCodeBench's library tasks (pandas, matplotlib) room.
"""

from __future__ import annotations

import functools
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SandboxLimits", "Verdict", "OUTCOMES", "ISOLATION", "run_program", "run_programs", "pass_at_1",
           "network_namespace_available"]

OUTCOMES: tuple[str, ...] = ("passed", "failed", "error", "timeout", "memory", "no_code")
"""Every terminal result of one program (module docstring)."""
ISOLATION = ("netns", "socket-guard")
"""How the network was cut: a new network namespace (with the guard inside it), or the guard alone."""

_HARNESS = '''\
import socket, sys, types, unittest

RECEIPT = sys.argv[1]


def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")


def _end(outcome):
    with open(RECEIPT, "w", encoding="utf-8") as fh:
        fh.write(outcome)
    sys.exit(0)


for _name in ("connect", "connect_ex", "sendto"):
    setattr(socket.socket, _name, _no_network)
socket.create_connection = socket.getaddrinfo = socket.gethostbyname = _no_network
try:
    source = open("program.py", encoding="utf-8").read()
    module = types.ModuleType("program")
    module.__file__ = "program.py"
    sys.modules["program"] = module
    exec(compile(source, "program.py", "exec"), module.__dict__)
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
except MemoryError:
    _end("memory")
except BaseException as exc:  # an exit at module level included: the tests never ran
    print(f"the program did not run to its tests: {type(exc).__name__}: {exc}", file=sys.stderr)
    _end("error")
if suite.countTestCases() == 0:
    print("the program defines no tests", file=sys.stderr)
    _end("error")
try:
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=0).run(suite)
except MemoryError:
    _end("memory")
if any("MemoryError" in str(e) for _, e in result.errors):
    _end("memory")
_end("passed" if result.wasSuccessful() else "failed")
'''
"""The child's script: the program run as a module, then its tests; the outcome is written to the
receipt file named on its command line (a program that ends the process itself, even with status
0, leaves no receipt and is an ``error``)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use (**[recon]**, see the module docstring).

    timeout_s: wall-clock seconds before the process group is killed (``timeout``);
    memory_mb: address space of the child (``RLIMIT_AS``; exceeding it is ``memory``);
    file_mb: the largest file it may write (``RLIMIT_FSIZE``);
    output_bytes: the stdout and stderr kept in :attr:`Verdict.detail` (the tail).
    """

    timeout_s: float = 60.0
    memory_mb: int = 4096
    file_mb: int = 64
    output_bytes: int = 4096

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or self.memory_mb < 64 or self.file_mb < 1 or self.output_bytes < 0:
            raise ValueError(f"sandbox limits out of range: {self}")


@dataclass(frozen=True)
class Verdict:
    """The terminal result of one program: ``outcome`` (one of :data:`OUTCOMES`), the child's exit
    code (None: not run, or killed at the timeout), wall seconds, the isolation used and the tail of
    its stderr (the test runner's report; the task's own public code, never a note)."""

    task_id: str
    outcome: str
    returncode: int | None
    seconds: float
    isolation: str
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Whether ``unshare -rn`` can start a process in a new user and network namespace here."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limit(limits: SandboxLimits):
    """The child's ``preexec_fn``: its resource limits (a new session is started by Popen)."""
    memory = limits.memory_mb * 2 ** 20
    cpu = int(limits.timeout_s) + 2

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * 2 ** 20,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _outcome(receipt: str, code: int | None, stderr: str) -> str:
    """The verdict from the harness's receipt; without one, from how the process ended."""
    if receipt in ("passed", "failed", "memory", "error"):
        return receipt
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    if code is not None and code < 0 and -code == signal.SIGXCPU:
        return "timeout"
    return "error"


def run_program(program: str | None, *, task_id: str = "", limits: SandboxLimits = SandboxLimits()) -> Verdict:
    """Execute ``program`` (the model's code and the task's tests, one Python source) in the sandbox
    and return its :class:`Verdict`; ``None`` or blank: ``no_code`` without running anything."""
    netns = network_namespace_available()
    isolation = ISOLATION[0] if netns else ISOLATION[1]
    if program is None or not program.strip():
        return Verdict(task_id, "no_code", None, 0.0, isolation)
    work = Path(tempfile.mkdtemp(prefix="mistill-sandbox-"))
    try:
        (work / "program.py").write_text(program, encoding="utf-8")
        (work / "harness.py").write_text(_HARNESS, encoding="utf-8")
        receipt = work / f".verdict-{secrets.token_hex(8)}"
        env = {"PATH": os.defpath, "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-I", "harness.py", receipt.name]
        if netns:
            cmd = [shutil.which("unshare") or "unshare", "-rn", "--", *cmd]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_limit(limits))
        try:
            _, err = proc.communicate(timeout=limits.timeout_s)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            with_group(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            code = None
        seconds = time.perf_counter() - start
        text = err.decode("utf-8", errors="replace")
        tail = text[-limits.output_bytes:] if limits.output_bytes else ""
        written = receipt.read_text(encoding="utf-8").strip() if receipt.is_file() else ""
        outcome = "timeout" if code is None else _outcome(written, code, text)
        return Verdict(task_id, outcome, code, seconds, isolation, tail)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def with_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (the child and everything it started)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def run_programs(programs: Iterable[tuple[str, str | None]], *,
                 limits: SandboxLimits = SandboxLimits()) -> list[Verdict]:
    """``(task_id, program)`` pairs run one after another: one verdict per task, in order (a
    task's failure of any kind is its verdict, never an exception that loses the others)."""
    return [run_program(program, task_id=task_id, limits=limits) for task_id, program in programs]


def pass_at_1(verdicts: Sequence[Verdict]) -> float:
    """The share of tasks whose single sample passed (NaN for no tasks)."""
    if not verdicts:
        return float("nan")
    return sum(v.passed for v in verdicts) / len(verdicts)
