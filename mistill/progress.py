"""Progress and log lines: one place for both.

* :func:`get_logger` gives a child of the ``mistill`` logger. The ``mistill`` logger is set up
  once, on first use (:func:`configure_logging`): one handler writing
  ``<time> <LEVEL> <logger>: <message>`` lines to the current ``sys.stderr``, at the level of
  ``$MISTILL_LOG_LEVEL`` (default ``INFO``). An application that gave the ``mistill`` logger
  handlers of its own keeps them.
* :func:`track` is the progress bar of every loop over notes, steps or events. On a terminal it
  is tqdm's bar. Anywhere else (a log file, a pipe, ``mlflow run`` capturing the output) a
  redrawn bar would write hundreds of lines of carriage returns and cursor codes, so it logs a
  plain line instead: every ``every`` items (default: a tenth of ``total``) or every
  ``seconds`` seconds, whichever comes first, and a last line when the loop ends. Off a
  terminal MLflow's own artifact-transfer bars are switched off as well
  (``MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false`` unless set), when logging is set up.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["LOGGER_NAME", "LogProgress", "configure_logging", "get_logger", "track"]

LOGGER_NAME = "mistill"
ENV_LOG_LEVEL = "MISTILL_LOG_LEVEL"
ENV_MLFLOW_BARS = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
LINES_PER_LOOP = 10
"""Without ``every``, a loop of known length logs a line each tenth of it."""
LOG_SECONDS = 30.0
"""...and at least one line every this many seconds while it runs."""

T = TypeVar("T")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (a redirected or captured
    stderr included), never to the stream that was current when logging was set up."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it
        pass


def configure_logging(level: int | str | None = None) -> logging.Logger:
    """Set up the ``mistill`` logger once: one stderr handler, ``LOG_FORMAT``, no propagation
    to the root logger (so no line is written twice). Idempotent; a logger that already has
    handlers is left as it is. ``level`` (default ``$MISTILL_LOG_LEVEL`` or ``INFO``)."""
    logger = logging.getLogger(LOGGER_NAME)
    if not logger.handlers:
        if not _on_terminal():
            os.environ.setdefault(ENV_MLFLOW_BARS, "false")
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
        logger.propagate = False
        if level is None:
            level = os.environ.get(ENV_LOG_LEVEL, "INFO").upper()
    if level is not None:
        logger.setLevel(level)
    return logger


def get_logger(name: str = "") -> logging.Logger:
    """The logger ``mistill.<name>`` (``mistill`` for an empty name), set up on first use."""
    configure_logging()
    return logging.getLogger(f"{LOGGER_NAME}.{name}" if name else LOGGER_NAME)


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class LogProgress(Generic[T]):
    """tqdm's interface (iterate, ``update``, ``close``, ``with``) writing plain log lines.

    A line reads ``<desc>: <n>/<total> (<pct>%) <elapsed> elapsed, <rate> it/s, eta <eta>``
    (without ``total``: ``<desc>: <n> <elapsed> elapsed, <rate> it/s``). A loop with
    ``leave=False`` (an inner loop, one per note) logs only the timed lines and no last line.
    """

    def __init__(self, iterable: Iterable[T] | None = None, desc: str | None = "",
                 total: int | None = None, *, initial: int = 0, leave: bool = True,
                 disable: bool = False, every: int | None = None, seconds: float = LOG_SECONDS,
                 logger: logging.Logger | None = None) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable = iterable
        self.desc = desc or "progress"
        self.total = total
        self.n = initial
        self.leave = leave
        self.disable = disable
        self.every = every if every is not None else (
            max(1, math.ceil(total / LINES_PER_LOOP)) if total and leave else None)
        self.seconds = seconds
        self.logger = logger or get_logger("progress")
        self._start = self._last_t = time.monotonic()
        self._initial = self._last_n = initial
        self._closed = False

    def __iter__(self) -> Iterator[T]:
        if self.iterable is None:
            raise TypeError("this progress has no iterable: call update() instead")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        return self.total or 0

    def __enter__(self) -> LogProgress[T]:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more items; log a line when ``every`` items or ``seconds`` have passed."""
        self.n += n
        if self.disable or self._closed:
            return
        now = time.monotonic()
        if (self.every and self.n - self._last_n >= self.every) or now - self._last_t >= self.seconds:
            self._log(now)

    def close(self) -> None:
        """End the loop: a last line (``leave=True``) unless the last line already said it all."""
        if self._closed:
            return
        self._closed = True
        if not self.disable and self.leave and (self.n != self._last_n or self.n == self._initial):
            self._log(time.monotonic(), done=True)

    def line(self, now: float | None = None, *, done: bool = False) -> str:
        """The text of one progress line (no carriage return, no escape codes)."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._start
        counted = self.n - self._initial
        rate = counted / elapsed if elapsed > 0 else 0.0
        head = f"{self.desc}: {self.n}/{self.total}" if self.total else f"{self.desc}: {self.n}"
        pct = f" ({100.0 * self.n / self.total:.0f}%)" if self.total else ""
        text = f"{head}{pct} {_duration(elapsed)} elapsed, {rate:.3g} it/s"
        if self.total and not done and rate > 0 and self.n < self.total:
            text += f", eta {_duration((self.total - self.n) / rate)}"
        return text + (", done" if done else "")

    def _log(self, now: float, *, done: bool = False) -> None:
        self.logger.info(self.line(now, done=done))
        self._last_n, self._last_t = self.n, now


def _on_terminal() -> bool:
    stream = sys.stderr
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def track(iterable: Iterable[T] | None = None, desc: str | None = "", total: int | None = None, *,
          initial: int = 0, leave: bool = True, disable: bool = False, every: int | None = None,
          seconds: float = LOG_SECONDS) -> Any:
    """A progress bar over ``iterable`` (or one advanced with ``update(n)``; ``close()`` ends it).

    On a terminal (stderr is a TTY): ``tqdm(iterable, desc, total, initial, leave, disable)``.
    Otherwise a :class:`LogProgress`: plain log lines, every ``every`` items (default: a tenth
    of ``total``) or ``seconds`` seconds, and a last line when the loop ends (``leave``).
    """
    if _on_terminal():
        from tqdm.auto import tqdm  # deferred: tqdm only when a bar is shown

        return tqdm(iterable, desc=desc or None, total=total, initial=initial, leave=leave,
                    disable=disable)
    return LogProgress(iterable, desc, total, initial=initial, leave=leave, disable=disable,
                       every=every, seconds=seconds)
