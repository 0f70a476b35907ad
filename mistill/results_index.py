"""The paper's result index: which entry points reproduce each reported result, as data.

Appendix Q of the paper gives every reported result a reproduction identifier: ``R-C1`` to
``R-C15`` for the characterization of the teacher, ``R-D0`` to ``R-D46`` for the distillation.
``results_index.yaml`` beside this module holds one :class:`ResultEntry` per identifier: the
result in a few words, where the paper reports it, the ``MLproject`` entry points and ``-P``
settings that produce it here, the table that shows it, and whether the platform produces it
(``produced``), part of it (``partial``) or none of it (``missing``), naming what it lacks.

:func:`load` reads and validates the file; :func:`render_markdown` is the source of
``docs/RESULTS_INDEX.md`` (``python -m mistill.results_index > docs/RESULTS_INDEX.md``; a test
checks that the page is current, that the identifiers are exactly the paper's and that every
entry point named exists in ``MLproject``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mistill.errors import MistillInputError

__all__ = ["DATA_FILE", "REGENERATE", "STATUSES", "ResultEntry", "expected_ids", "id_key", "load",
           "paper_result_ids", "render_markdown", "validate"]

DATA_FILE = Path(__file__).with_name("results_index.yaml")
"""The index's data file, shipped with the package."""

REGENERATE = "python -m mistill.results_index > docs/RESULTS_INDEX.md"
"""The command that writes ``docs/RESULTS_INDEX.md`` from the data file."""

PRODUCED, PARTIAL, MISSING = "produced", "partial", "missing"
STATUSES: tuple[str, ...] = (PRODUCED, PARTIAL, MISSING)
"""``produced``: the entry points and the table that shows the result exist; ``partial``: some of
the result can be produced; ``missing``: none of it."""

C_NUMBERS = range(1, 16)
D_NUMBERS = range(0, 47)
"""The identifier ranges of Appendix Q: ``R-C1``..``R-C15`` and ``R-D0``..``R-D46``."""

FIELDS: tuple[str, ...] = ("id", "what", "paper", "entry_points", "params", "report", "status", "needs")

_ID = re.compile(r"^R-([CD])(0|[1-9][0-9]*)$")
_CITED = re.compile(r"\[R-([CD])(\d+)\]")
_RANGE = re.compile(r"\[R-([CD])(\d+)\]\s*[–-]\s*\[R-\1(\d+)\]")


@dataclass(frozen=True)
class ResultEntry:
    """One reported result of the paper and how the platform reproduces it.

    id: the paper's identifier (``R-C3``, ``R-D17``).
    what: the result in a few words.
    paper: where the paper reports it (sections, tables, figures).
    entry_points: the ``MLproject`` entry points that produce it (empty when none does).
    params: the ``-P`` settings that matter (empty: the defaults).
    report: the table or figure that shows it (empty: none).
    status: one of :data:`STATUSES`.
    needs: for a partial or missing result, the capability the platform lacks.
    """

    id: str
    what: str
    paper: str
    entry_points: tuple[str, ...]
    params: str
    report: str
    status: str
    needs: str

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, file: str, position: int) -> ResultEntry:
        """The entry written as a YAML mapping; every field present, strings where strings belong
        and a list of names for ``entry_points``. ``position`` (0-based) names a bad entry."""
        where = f"entry {position + 1}" + (f" ({raw.get('id')})" if isinstance(raw, Mapping) else "")
        if not isinstance(raw, Mapping):
            raise MistillInputError(f"{where} is not a mapping", file=file)
        missing = [f for f in FIELDS if f not in raw]
        unknown = sorted(set(raw) - set(FIELDS))
        if missing or unknown:
            raise MistillInputError(f"{where}: missing fields {missing}, unknown fields {unknown}", file=file)
        for name in FIELDS:
            value = raw[name]
            if name == "entry_points":
                if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                    raise MistillInputError(f"{where}: a list of entry point names is expected", file=file,
                                            field=name)
            elif not isinstance(value, str):
                raise MistillInputError(f"{where}: a string is expected, got {type(value).__name__}", file=file,
                                        field=name)
        return cls(id=raw["id"], what=raw["what"].strip(), paper=raw["paper"].strip(),
                   entry_points=tuple(raw["entry_points"]), params=raw["params"].strip(),
                   report=raw["report"].strip(), status=raw["status"].strip(), needs=raw["needs"].strip())


def id_key(result_id: str) -> tuple[int, int]:
    """Sort key of an identifier: the ``R-C`` ids first, then ``R-D``, each by number."""
    m = _ID.match(result_id)
    if m is None:
        raise ValueError(f"not a result identifier: {result_id!r}")
    return (0 if m.group(1) == "C" else 1, int(m.group(2)))


def expected_ids() -> tuple[str, ...]:
    """Every identifier Appendix Q defines, in :func:`id_key` order."""
    return tuple([f"R-C{n}" for n in C_NUMBERS] + [f"R-D{n}" for n in D_NUMBERS])


def paper_result_ids(paper_text: str) -> set[str]:
    """Every identifier the paper's text cites in brackets (``[R-D17]``), with a written range
    (``[R-C1]–[R-C15]``, en dash or hyphen) expanded to each identifier it spans."""
    ids = {f"R-{kind}{int(n)}" for kind, n in _CITED.findall(paper_text)}
    for kind, low, high in _RANGE.findall(paper_text):
        ids.update(f"R-{kind}{n}" for n in range(int(low), int(high) + 1))
    return ids


def validate(entries: Sequence[ResultEntry], *, file: str = str(DATA_FILE)) -> None:
    """Raise :class:`~mistill.errors.MistillInputError` unless every identifier is well formed and
    listed once, in :func:`id_key` order; every status is one of :data:`STATUSES`; a partial or
    missing result names what it needs; and a produced one names its entry points and the table
    that shows it (and needs nothing)."""
    seen: set[str] = set()
    for e in entries:
        if not _ID.match(e.id):
            raise MistillInputError(f"{e.id!r} is not a result identifier (R-C<n> or R-D<n>)", file=file,
                                    field="id")
        if e.id in seen:
            raise MistillInputError(f"{e.id} is listed twice", file=file, field="id")
        seen.add(e.id)
        if not e.what or not e.paper:
            raise MistillInputError(f"{e.id}: 'what' and 'paper' must not be empty", file=file)
        if e.status not in STATUSES:
            raise MistillInputError(f"{e.id}: status {e.status!r} is not one of {', '.join(STATUSES)}", file=file,
                                    field="status")
        if e.status == PRODUCED:
            if not e.entry_points or not e.report:
                raise MistillInputError(f"{e.id}: a produced result names its entry points and its table",
                                        file=file, field="status")
            if e.needs:
                raise MistillInputError(f"{e.id}: a produced result needs nothing", file=file, field="needs")
        elif not e.needs:
            raise MistillInputError(f"{e.id}: a {e.status} result names what it needs", file=file, field="needs")
    ids = [e.id for e in entries]
    if ids != sorted(ids, key=id_key):
        raise MistillInputError("entries are not in identifier order (R-C1.., then R-D0..)", file=file,
                                field="id")


def load(path: str | Path = DATA_FILE) -> tuple[ResultEntry, ...]:
    """The entries of the data file at ``path``, validated (:func:`validate`)."""
    path = Path(path)
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(raw, Mapping) or not isinstance(raw.get("entries"), list):
        raise MistillInputError("the file must hold a list under 'entries'", file=str(path), field="entries")
    entries = tuple(ResultEntry.from_mapping(item, file=str(path), position=i)
                    for i, item in enumerate(raw["entries"]))
    validate(entries, file=str(path))
    return entries


def _text(value: str) -> str:
    """A Markdown table cell of plain text: pipes escaped, angle brackets as entities."""
    return value.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def _code(value: str) -> str:
    """A Markdown table cell holding ``value`` as one code span (empty for an empty value)."""
    return f"`{value.replace('|', chr(92) + '|')}`" if value else ""


def _counts(entries: Iterable[ResultEntry]) -> dict[str, int]:
    out = dict.fromkeys(STATUSES, 0)
    for e in entries:
        out[e.status] += 1
    return out


def render_markdown(entries: Sequence[ResultEntry] | None = None) -> str:
    """``docs/RESULTS_INDEX.md``: the index as a table, one row per identifier, and the missing
    capabilities each with the identifiers that wait on it."""
    entries = load() if entries is None else entries
    counts = _counts(entries)
    lines = [
        f"Generated from `mistill/results_index.yaml` by `{REGENERATE}`; edit the YAML, not this page.",
        "",
        "# The paper's results and how to reproduce them",
        "",
        "Appendix Q of the paper gives each reported result an identifier, `R-C1`..`R-C15` for the",
        "characterization of the teacher and `R-D0`..`R-D46` for the distillation. Each row below is",
        "one of them: the result, where the paper reports it, the entry points of `MLproject` that",
        "produce it, the `-P` settings that matter (blank: the defaults), and the table that shows it",
        "(a `report` table, or the named artifact of the run that writes it). Status: **produced** when",
        "the entry points and that table exist; **partial** when part of the result can be produced;",
        "**missing** when none of it can, the last column naming what is lacking. How each method is",
        "computed is in [`METHOD.md`](METHOD.md); where the platform departs from the paper, in",
        "[`DEVIATIONS.md`](DEVIATIONS.md).",
        "",
        f"{len(entries)} results: {counts[PRODUCED]} produced, {counts[PARTIAL]} partial, "
        f"{counts[MISSING]} missing.",
        "",
        "| id | result | paper | entry points | settings | shown in | status | needs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        eps = ", ".join(f"`{name}`" for name in e.entry_points)
        lines.append(f"| {e.id} | {_text(e.what)} | {_text(e.paper)} | {eps} | {_code(e.params)} | "
                     f"{_text(e.report)} | {e.status} | {_text(e.needs)} |")
    waiting: dict[str, list[str]] = {}
    for e in entries:
        if e.needs:
            waiting.setdefault(e.needs, []).append(e.id)
    lines += ["", "## What the partial and missing results need", "",
              "| needs | results |", "|---|---|"]
    for needs, ids in waiting.items():
        lines.append(f"| {_text(needs)} | {', '.join(ids)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
