"""The paper's result index: which entry points reproduce each reported result, as data.

Appendix Q of the paper gives every reported result a reproduction identifier: ``R-C1`` to
``R-C15`` for the characterization of the teacher, ``R-D0`` to ``R-D46`` for the distillation.
``results_index.yaml`` beside this module holds one :class:`ResultEntry` per identifier: the
result in a few words, where the paper reports it, the ``MLproject`` entry points and ``-P``
settings that produce it here, the table that shows it, and whether the platform produces it
(``produced``), part of it (``partial``) or none of it (``missing``), naming what it lacks, and
the values the paper expects (:class:`ExpectedValue`, from the "Expected:" lines of Appendix Q),
each with its interval or tolerance and, where a run of the platform logs the number, the metric
that holds the reproduced value (:class:`MetricSource`; ``mistill.stages.verify`` compares them).

:func:`load` reads and validates the file; :func:`render_markdown` is the source of
``docs/RESULTS_INDEX.md`` (``python -m mistill.results_index > docs/RESULTS_INDEX.md``; a test
checks that the page is current, that the identifiers are exactly the paper's and that every
entry point named exists in ``MLproject``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mistill.errors import MistillInputError

__all__ = ["DATA_FILE", "EXPECTED_FIELDS", "REDUCTIONS", "REGENERATE", "SOURCE_FIELDS", "STATUSES",
           "ExpectedValue", "MetricSource", "ResultEntry", "expected_ids", "id_key", "load",
           "paper_result_ids", "render_markdown", "source_text", "validate"]

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

FIELDS: tuple[str, ...] = ("id", "what", "paper", "entry_points", "params", "report", "status", "needs",
                           "expected")

EXPECTED_FIELDS: tuple[str, ...] = ("statistic", "value", "interval", "tolerance", "tolerance_source", "unit",
                                    "source")
"""Fields of one expected value; ``interval`` or else ``tolerance`` with ``tolerance_source``."""

SOURCE_FIELDS: tuple[str, ...] = ("entry_point", "metric", "tags", "params", "reduce", "interval")
"""Fields of a source; ``entry_point`` and ``metric`` are required, the others optional."""

NEWEST, MEAN = "newest", "mean"
REDUCTIONS: tuple[str, ...] = (NEWEST, MEAN)
"""How the matching runs give one value: the newest run's metric, or the mean over the newest run of
each seed (a value the paper reports as a mean over seeds)."""


@dataclass(frozen=True)
class MetricSource:
    """Where the tracking store holds the reproduced value of one expected value.

    entry_point: the ``MLproject`` entry point whose FINISHED runs are read (their
        ``mistill.stage`` tag).
    metric: the metric key as the runs log it.
    tags: run tags that must match, by their short names (``arm``, ``model``, ``seed``,
        ``precision``, ``split``, ``lambda``: the columns of :data:`analysis.query.TAG_COLUMNS`);
        a value ``{teacher}``, ``{student}`` or ``{student_smollm3}`` stands for the model given
        for that role, and an unset role matches every model.
    params: run params that must match (``lock`` of a ``select_lambda`` run).
    reduce: one of :data:`REDUCTIONS`.
    interval: the metrics holding the reproduced value's interval (lower, upper), where the runs
        log one; empty: none.
    """

    entry_point: str
    metric: str
    tags: tuple[tuple[str, str], ...] = ()
    params: tuple[tuple[str, str], ...] = ()
    reduce: str = NEWEST
    interval: tuple[str, str] | None = None


@dataclass(frozen=True)
class ExpectedValue:
    """One value the paper expects for a result (Appendix Q, "Expected:").

    statistic: what is measured, in words.
    value: the paper's value.
    interval: the paper's interval ``(lo, hi)``, bounds included; None when it gives a tolerance.
    tolerance: the absolute tolerance around ``value`` (bounds included); None where the paper
        gives none (then only the value itself agrees) or gives an interval.
    tolerance_source: the paper's words for the tolerance ("exact ...", its nondeterminism class),
        or "paper gives none"; empty with an interval.
    unit: nats, share, count, F1, ...
    source: where the platform logs the reproduced value; None when no run logs it.
    """

    statistic: str
    value: float
    interval: tuple[float, float] | None
    tolerance: float | None
    tolerance_source: str
    unit: str
    source: MetricSource | None

    def bounds(self) -> tuple[float, float]:
        """The closed range of values that agree with the paper."""
        if self.interval is not None:
            return self.interval
        tol = self.tolerance or 0.0
        return (self.value - tol, self.value + tol)

    def agrees(self, reproduced: float) -> bool:
        """Whether a reproduced value lies in :meth:`bounds`, both included (up to float rounding:
        a reproduced value equal to a bound as printed agrees)."""
        lo, hi = self.bounds()
        slack = 1e-9 * max(1.0, abs(lo), abs(hi))
        return lo - slack <= reproduced <= hi + slack

    def allowed(self) -> str:
        """The paper's interval or tolerance in words, for a table cell."""
        if self.interval is not None:
            return f"[{_num(self.interval[0])}, {_num(self.interval[1])}]"
        if self.tolerance is None:
            return f"the value only ({self.tolerance_source})"
        if self.tolerance == 0:
            return self.tolerance_source
        return f"± {_num(self.tolerance)} ({self.tolerance_source})"


def _num(value: float) -> str:
    return f"{value:g}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _string_map(raw: Any, what: str, bad: Callable[[str], MistillInputError]) -> tuple[tuple[str, str], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) and k for k in raw):
        raise bad(f"'{what}' must map names to values")
    out = []
    for k, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise bad(f"'{what}.{k}' must be a string or a number")
        out.append((k, str(v)))
    return tuple(out)


def _source(raw: Any, bad: Callable[[str], MistillInputError]) -> MetricSource | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise bad("'source' must be a mapping or null")
    unknown = sorted(set(raw) - set(SOURCE_FIELDS))
    if unknown:
        raise bad(f"'source' has unknown fields {unknown}")
    for name in ("entry_point", "metric"):
        if not isinstance(raw.get(name), str) or not raw[name].strip():
            raise bad(f"'source.{name}' must be a non-empty string")
    reduce = raw.get("reduce", NEWEST)
    if reduce not in REDUCTIONS:
        raise bad(f"'source.reduce' must be one of {', '.join(REDUCTIONS)}, got {reduce!r}")
    interval = raw.get("interval")
    if interval is not None and (not isinstance(interval, list) or len(interval) != 2
                                 or not all(isinstance(m, str) and m for m in interval)):
        raise bad("'source.interval' must be two metric names [lower, upper]")
    return MetricSource(entry_point=raw["entry_point"].strip(), metric=raw["metric"].strip(),
                        tags=_string_map(raw.get("tags"), "source.tags", bad),
                        params=_string_map(raw.get("params"), "source.params", bad), reduce=reduce,
                        interval=tuple(interval) if interval else None)


def _expected(raw: Any, where: str, file: str) -> tuple[ExpectedValue, ...]:
    """The ``expected`` field of one entry, checked; ``where`` names the entry."""
    if not isinstance(raw, list):
        raise MistillInputError(f"{where}: a list of expected values is expected", file=file, field="expected")
    out = []
    for i, item in enumerate(raw):
        def bad(message: str, _i: int = i) -> MistillInputError:
            return MistillInputError(f"{where}, expected value {_i + 1}: {message}", file=file, field="expected")

        if not isinstance(item, Mapping):
            raise bad("not a mapping")
        unknown = sorted(set(item) - set(EXPECTED_FIELDS))
        missing = [f for f in ("statistic", "value", "unit", "source") if f not in item]
        if unknown or missing:
            raise bad(f"missing fields {missing}, unknown fields {unknown}")
        for name in ("statistic", "unit"):
            if not isinstance(item[name], str) or not item[name].strip():
                raise bad(f"'{name}' must be a non-empty string")
        if not _is_number(item["value"]):
            raise bad(f"'value' must be a number, got {item['value']!r}")
        interval, tolerance, words = None, None, ""
        if "interval" in item:
            if "tolerance" in item or "tolerance_source" in item:
                raise bad("give either 'interval' or 'tolerance' with 'tolerance_source', not both")
            iv = item["interval"]
            if not isinstance(iv, list) or len(iv) != 2 or not all(_is_number(x) for x in iv) or iv[0] > iv[1]:
                raise bad(f"'interval' must be [lo, hi] with lo <= hi, got {iv!r}")
            interval = (float(iv[0]), float(iv[1]))
        else:
            if "tolerance" not in item or "tolerance_source" not in item:
                raise bad("give 'interval', or 'tolerance' (null where the paper gives none) and "
                          "'tolerance_source'")
            tolerance = item["tolerance"]
            if tolerance is not None and (not _is_number(tolerance) or tolerance < 0):
                raise bad(f"'tolerance' must be a number >= 0 or null, got {tolerance!r}")
            words = item["tolerance_source"]
            if not isinstance(words, str) or not words.strip():
                raise bad("'tolerance_source' must say where the tolerance comes from "
                          "(\"paper gives none\" where it gives none)")
        out.append(ExpectedValue(statistic=item["statistic"].strip(), value=float(item["value"]),
                                 interval=interval, tolerance=None if tolerance is None else float(tolerance),
                                 tolerance_source=words.strip(), unit=item["unit"].strip(),
                                 source=_source(item["source"], bad)))
    return tuple(out)

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
    expected: the values the paper expects (empty where Appendix Q states none).
    """

    id: str
    what: str
    paper: str
    entry_points: tuple[str, ...]
    params: str
    report: str
    status: str
    needs: str
    expected: tuple[ExpectedValue, ...] = ()

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
            if name == "expected":
                continue
            if name == "entry_points":
                if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                    raise MistillInputError(f"{where}: a list of entry point names is expected", file=file,
                                            field=name)
            elif not isinstance(value, str):
                raise MistillInputError(f"{where}: a string is expected, got {type(value).__name__}", file=file,
                                        field=name)
        return cls(id=raw["id"], what=raw["what"].strip(), paper=raw["paper"].strip(),
                   entry_points=tuple(raw["entry_points"]), params=raw["params"].strip(),
                   report=raw["report"].strip(), status=raw["status"].strip(), needs=raw["needs"].strip(),
                   expected=_expected(raw["expected"], where, file))


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
    lines += _expected_section(entries)
    return "\n".join(lines) + "\n"


def source_text(source: MetricSource | None) -> str:
    """A source in words: ``<entry point>: <metric> [tag=value, ...]`` (empty for None)."""
    if source is None:
        return ""
    filters = [f"{k}={v}" for k, v in (*source.tags, *source.params)]
    if source.reduce == MEAN:
        filters.append("mean over seeds")
    return f"{source.entry_point}: {source.metric}" + (f" [{', '.join(filters)}]" if filters else "")


def _expected_section(entries: Sequence[ResultEntry]) -> list[str]:
    """The page's section listing every expected value of Appendix Q and where it is read."""
    values = [v for e in entries for v in e.expected]
    with_source = sum(v.source is not None for v in values)
    lines = ["", "## Expected values", "",
             "The values Appendix Q of the paper expects for each result, with the paper's interval or",
             "tolerance (its nondeterminism classes: K for teacher-forced passes, T for training, G for",
             "generation; \"exact\" where the paper says the number is exact; where it gives none, only",
             "the value itself agrees), and the metric of the platform's runs that holds the reproduced",
             "value. The entry point `verify` (`mistill verify`) reads those metrics from the tracking",
             "store and says for each value whether it agrees. A value with no metric has no readout: no",
             "run of the platform logs that number.",
             "",
             f"{len(values)} expected values: {with_source} with a metric, {len(values) - with_source} without.",
             "",
             "| id | statistic | paper | agrees within | unit | read from |",
             "|---|---|---|---|---|---|"]
    for e in entries:
        if not e.expected:
            lines.append(f"| {e.id} | Appendix Q states no expected value | | | | |")
        for v in e.expected:
            lines.append(f"| {e.id} | {_text(v.statistic)} | {_num(v.value)} | {_text(v.allowed())} | "
                         f"{_text(v.unit)} | {_code(source_text(v.source)) or 'no readout'} |")
    return lines


if __name__ == "__main__":
    print(render_markdown(), end="")
