"""Bounded waits on the tracking server, and one clear error when it is gone.

MLflow's HTTP client retries a failed request with exponential backoff; with its defaults (7
retries, factor 2, 120 s per attempt) a stage whose server died waits minutes per request before
it fails. One mistill setting bounds that wait:

``MISTILL_SERVER_TIMEOUT_S`` (default 60)
    The most seconds one request to the tracking server may take, all attempts and backoffs
    included. :func:`configure_client_timeouts` derives MLflow's ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
    ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR``, ``MLFLOW_HTTP_REQUEST_BACKOFF_JITTER`` and
    ``MLFLOW_HTTP_REQUEST_TIMEOUT`` from it, for those the user has not set. Importing
    ``mistill.tracking`` applies it once (MLflow reads these variables at every request, so the
    order of imports does not matter; subprocesses inherit them).

A request that fails because the server cannot be reached (connection refused or reset, or no
answer in time) surfaces as :class:`~mistill.errors.TrackingUnavailableError`, translated here
and only here (:func:`unavailable_error`, :func:`tracking_errors`); the stage command line exits
with code 3 and the run is left as it was, so rerunning the same command resumes it.

This module imports neither MLflow nor ``requests`` at import time.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from mistill.errors import MistillInputError, TrackingUnavailableError

SERVER_TIMEOUT_ENV = "MISTILL_SERVER_TIMEOUT_S"
DEFAULT_SERVER_TIMEOUT_S = 60.0
MIN_ATTEMPT_TIMEOUT_S = 10.0
"""Floor of one attempt's timeout (a healthy local server answers in milliseconds; one on a
loaded machine can stall for seconds), lowered to a quarter of smaller budgets."""
BACKOFF_JITTER_S = 0.5
MAX_RETRIES_LIMIT = 10  # MLflow refuses more (its ``_MLFLOW_HTTP_REQUEST_MAX_RETRIES_LIMIT``)
MAX_BACKOFF_FACTOR = 120  # likewise (``_MLFLOW_HTTP_REQUEST_MAX_BACKOFF_FACTOR_LIMIT``)

_APPLIED_ENV = "MISTILL_SERVER_TIMEOUT_APPLIED"
"""The MLflow variables mistill itself set, ``NAME=value;...``: a later call (or a subprocess
with another budget) may replace those, never a value the user set."""


@dataclass(frozen=True)
class ClientTimeouts:
    """MLflow HTTP client settings whose worst case fits one budget.

    A request makes ``max_retries + 1`` attempts, each waiting at most ``request_timeout`` s;
    before retry ``n`` (1-based) urllib3 sleeps ``0`` for ``n = 1``, else
    ``backoff_factor * 2**(n-1)`` plus up to ``backoff_jitter`` s.
    """

    max_retries: int
    backoff_factor: int
    backoff_jitter: float
    request_timeout: int

    @property
    def backoff_s(self) -> float:
        """Longest total sleep between attempts (jitter included): what a server that refuses
        connections costs before the request fails."""
        sleeps = sum(self.backoff_factor * 2 ** (n - 1) for n in range(2, self.max_retries + 1))
        return sleeps + self.max_retries * self.backoff_jitter

    @property
    def worst_case_s(self) -> float:
        """Longest time one request can take: every attempt times out, every backoff is full."""
        return (self.max_retries + 1) * self.request_timeout + self.backoff_s

    def env(self) -> dict[str, str]:
        """The MLflow environment variables that carry these settings."""
        return {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(self.max_retries),
                "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": str(self.backoff_factor),
                "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": f"{self.backoff_jitter:g}",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": str(self.request_timeout)}


MLFLOW_DEFAULTS = ClientTimeouts(max_retries=7, backoff_factor=2, backoff_jitter=1.0,
                                 request_timeout=120)
"""MLflow's own settings (``mlflow.environment_variables``), in force where a variable is unset."""


def client_timeouts(total_s: float) -> ClientTimeouts:
    """The settings for a budget of ``total_s`` seconds per request (``worst_case_s <= total_s``).

    As many retries as fit with an attempt timeout of at least ``min(10 s, total_s / 4)``, then
    the largest integer backoff factor that still fits (MLflow takes integer factors); the
    attempt timeout gets what is left. Small budgets get one attempt and no retry; MLflow takes
    whole seconds, so the attempt timeout is at least 1 s.
    """
    if not math.isfinite(total_s) or total_s <= 0:
        raise MistillInputError(f"the tracking server timeout must be a positive number of "
                                f"seconds, got {total_s!r}", field=SERVER_TIMEOUT_ENV)
    floor_s = min(MIN_ATTEMPT_TIMEOUT_S, total_s / 4)
    for retries in range(MAX_RETRIES_LIMIT, 0, -1):
        factor = 0
        while factor < MAX_BACKOFF_FACTOR and _fits(retries, factor + 1, floor_s, total_s):
            factor += 1
        if factor == 0:
            continue
        if retries == 1:  # the only sleep, before the first retry, is 0 whatever the factor
            factor = 1
        spent = ClientTimeouts(retries, factor, BACKOFF_JITTER_S, 0).backoff_s
        timeout = math.floor((total_s - spent) / (retries + 1))
        if timeout >= 1:
            return ClientTimeouts(retries, factor, BACKOFF_JITTER_S, timeout)
    return ClientTimeouts(0, 0, 0.0, max(1, math.floor(total_s)))


def _fits(retries: int, factor: int, attempt_s: float, total_s: float) -> bool:
    trial = ClientTimeouts(retries, factor, BACKOFF_JITTER_S, 0)
    return (retries + 1) * attempt_s + trial.backoff_s <= total_s


def server_timeout_s() -> float:
    """The budget per request: ``$MISTILL_SERVER_TIMEOUT_S`` or 60 s."""
    text = os.environ.get(SERVER_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_SERVER_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise MistillInputError(f"must be a positive number of seconds, got {text!r}",
                                field=SERVER_TIMEOUT_ENV)
    return value


def configure_client_timeouts(total_s: float | None = None) -> ClientTimeouts:
    """Set MLflow's HTTP retry and timeout variables from the budget (default
    :func:`server_timeout_s`), each only where the user has not set it. Idempotent.

    Returns the settings derived from the budget (what MLflow uses unless the user overrode a
    variable).
    """
    settings = client_timeouts(server_timeout_s() if total_s is None else total_s)
    ours = dict(item.split("=", 1) for item in os.environ.get(_APPLIED_ENV, "").split(";")
                if "=" in item)
    applied: dict[str, str] = {}
    for name, value in settings.env().items():
        current = os.environ.get(name)
        if current is None or current == ours.get(name):
            os.environ[name] = value
            applied[name] = value
    os.environ[_APPLIED_ENV] = ";".join(f"{k}={v}" for k, v in applied.items())
    return settings


def applied_bound_s() -> float:
    """Worst case of one request under the MLflow variables in force now (MLflow's own defaults
    for those unset)."""

    def number(name: str, default: float) -> float:
        try:
            return float(os.environ[name])
        except (KeyError, ValueError):
            return default

    current = ClientTimeouts(
        int(number("MLFLOW_HTTP_REQUEST_MAX_RETRIES", MLFLOW_DEFAULTS.max_retries)),
        int(number("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", MLFLOW_DEFAULTS.backoff_factor)),
        number("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", MLFLOW_DEFAULTS.backoff_jitter),
        int(number("MLFLOW_HTTP_REQUEST_TIMEOUT", MLFLOW_DEFAULTS.request_timeout)))
    return current.worst_case_s


# ------------------------------------------------------------------------- recognising failures
_MAX_RETRIES_TEXT = re.compile(
    r"Max retries exceeded with url: (?P<url>\S+) \(Caused by (?P<cause>NewConnectionError|"
    r"ConnectTimeoutError|ReadTimeoutError|ProtocolError|RemoteDisconnected)")
_OBJECT_REPR = re.compile(r"<[^<>]*object at 0x[0-9a-f]+>:?\s*|HTTPS?Connection\([^()]*\):\s*")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it was raised from or during (cause, context, wrapped
    arguments, urllib3's ``MaxRetryError.reason``), each once."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        cur = todo.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        linked = [cur.__cause__, cur.__context__, getattr(cur, "reason", None),
                  *(a for a in getattr(cur, "args", ()) if isinstance(a, BaseException))]
        todo.extend(e for e in linked if isinstance(e, BaseException))


def _is_mlflow_error(exc: BaseException) -> bool:
    mlflow_exc = sys.modules.get("mlflow.exceptions")
    return mlflow_exc is not None and isinstance(exc, mlflow_exc.MlflowException)


def _is_connection_failure(exc: BaseException) -> bool:
    """A failure to reach a server at all (not an error answer from it)."""
    requests_exc = sys.modules.get("requests.exceptions")
    if requests_exc is not None and isinstance(
            exc, (requests_exc.ConnectionError, requests_exc.Timeout)):
        return True
    urllib3_exc = sys.modules.get("urllib3.exceptions")
    if urllib3_exc is not None and isinstance(
            exc, (urllib3_exc.NewConnectionError, urllib3_exc.ProtocolError,
                  urllib3_exc.TimeoutError)):
        return True
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    # MLflow joins the failures of parallel artifact transfers into one message, unchained
    return _is_mlflow_error(exc) and bool(_MAX_RETRIES_TEXT.search(str(exc)))


def is_unreachable(exc: BaseException) -> bool:
    """True iff ``exc`` comes from an MLflow request that could not reach its server: an
    ``MlflowException`` and a connection failure or timeout in its chain. Connection errors of
    anything else (a model download, a generation server) are not the tracking server's."""
    chain = list(_chain(exc))
    return any(_is_mlflow_error(e) for e in chain) and any(_is_connection_failure(e)
                                                           for e in chain)


def _server_of(exc: BaseException) -> str | None:
    """``scheme://host:port`` of the request that failed, if the exception says."""
    for cur in _chain(exc):
        request = getattr(cur, "request", None)
        url = getattr(request, "url", None)
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            parts = urlsplit(url)
            return f"{parts.scheme}://{parts.netloc}"
    match = re.search(r"API request to (https?://[^/\s]+)", str(exc))
    return match.group(1) if match else None


def _reason(exc: BaseException) -> str:
    """A one-line account of the failure: the endpoint and urllib3's reason, without reprs."""
    url = ""
    for cur in _chain(exc):
        if type(cur).__name__ == "MaxRetryError":
            url = str(getattr(cur, "url", "") or "").split("?", 1)[0]
            reason = getattr(cur, "reason", None)
            if reason is not None:
                text = _OBJECT_REPR.sub("", str(reason)).strip(" ')\"")
                return f"{url}: {text}" if url else text
    match = _MAX_RETRIES_TEXT.search(str(exc))
    if match:
        return f"{match.group('url')}: {match.group('cause')}"
    for cur in _chain(exc):
        if _is_connection_failure(cur) and not _is_mlflow_error(cur):
            return f"{type(cur).__name__}: {_OBJECT_REPR.sub('', str(cur))}"[:300]
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def active_run_id() -> str | None:
    """The run this process was writing through MLflow's fluent API: the active run, else the
    one ``mlflow.end_run`` last ended or tried to end. None if MLflow was never used."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return None
    with contextlib.suppress(Exception):
        active = mlflow.active_run()
        if active is not None:
            return str(active.info.run_id)
    fluent = sys.modules.get("mlflow.tracking.fluent")
    last = getattr(fluent, "_last_active_run_id", None)  # no public accessor without a request
    with contextlib.suppress(Exception):
        value = last.get() if last is not None else None
        return str(value) if value else None
    return None


def _tracking_uri() -> str:
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        with contextlib.suppress(Exception):
            return str(mlflow.get_tracking_uri())
    return os.environ.get("MLFLOW_TRACKING_URI", "the tracking server")


def unavailable_error(exc: BaseException, *, uri: str | None = None,
                      run_id: str | None = None) -> TrackingUnavailableError | None:
    """``exc`` as a :class:`TrackingUnavailableError` if it (or anything it was raised from)
    is a failure to reach the server, else None.

    Args:
        exc: what a call to the server raised (MLflow wraps ``requests`` errors in
            ``MlflowException``; wrappers such as a ``MistillInputError`` raised while handling
            one are recognised through their context).
        uri: the server's URI (default: the failed request's, else MLflow's tracking URI).
        run_id: the run being written (default: :func:`active_run_id`).
    """
    if isinstance(exc, TrackingUnavailableError):
        return exc
    if not is_unreachable(exc):
        return None
    return TrackingUnavailableError(
        uri or _server_of(exc) or _tracking_uri(), after_s=applied_bound_s(), reason=_reason(exc),
        run_id=run_id if run_id is not None else active_run_id())


@contextlib.contextmanager
def tracking_errors(*, uri: str | None = None, run_id: str | None = None) -> Iterator[None]:
    """Re-raise a failure to reach the tracking server as :class:`TrackingUnavailableError`
    (chained to the original); every other exception passes unchanged."""
    try:
        yield
    except TrackingUnavailableError:
        raise
    except Exception as exc:
        error = unavailable_error(exc, uri=uri, run_id=run_id)
        if error is None:
            raise
        raise error from exc


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on ``host`` (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


__all__ = ["SERVER_TIMEOUT_ENV", "DEFAULT_SERVER_TIMEOUT_S", "ClientTimeouts", "client_timeouts",
           "server_timeout_s", "configure_client_timeouts", "applied_bound_s", "active_run_id",
           "is_unreachable", "unavailable_error", "tracking_errors", "free_port"]
