"""Errors raised on bad input. Each names the file, the note and the field it concerns."""

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
