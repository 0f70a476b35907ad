"""Errors a user sees: bad input (:class:`MistillInputError`, which names the file, the note and
the field it concerns) and an unreachable tracking server (:class:`TrackingUnavailableError`)."""

from __future__ import annotations


class MistillInputError(ValueError):
    """Bad input: malformed file, unknown code, unclosed trace, mismatched tokenizer, changed lock.

    The message always carries where the problem is (``file``, ``note``, ``field``), so a user
    with a 500-note corpus can find the offending record without a debugger.
    """

    def __init__(self, message: str, *, file: str | None = None, note: str | None = None,
                 field: str | None = None, line: int | None = None) -> None:
        where = []
        if file is not None:
            where.append(f"file {file}" + (f" line {line}" if line is not None else ""))
        if note is not None:
            where.append(f"note {note}")
        if field is not None:
            where.append(f"field {field!r}")
        self.file, self.note, self.field, self.line = file, note, field, line
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class TrackingUnavailableError(RuntimeError):
    """The tracking server could not be reached within the bound (``MISTILL_SERVER_TIMEOUT_S``).

    Not bad input: the run is left as it was, and rerunning the same command once the server is
    back on the same URI resumes it. The stage command line exits with code 3 on it.

    Args:
        uri: the tracking server's URI.
        after_s: the longest one request may have waited (all retries included).
        reason: the last failure, in one line (endpoint and connection error).
        run_id: the run being written, if one was started or resumed.
    """

    def __init__(self, uri: str, after_s: float, reason: str, run_id: str | None = None) -> None:
        self.uri, self.after_s, self.reason, self.run_id = uri, after_s, reason, run_id
        what = (f"the run {run_id} is left as it was; rerun the same command to resume it"
                if run_id else "any run it started is left as it was; rerun the same command to "
                               "resume it")
        super().__init__(f"tracking server {uri} unreachable after retrying for up to "
                         f"{after_s:.0f} s ({reason}): {what} once the server is back on {uri} "
                         f"(the bound is MISTILL_SERVER_TIMEOUT_S)")

    def __reduce__(self) -> tuple[type, tuple[str, float, str, str | None]]:
        return type(self), (self.uri, self.after_s, self.reason, self.run_id)
