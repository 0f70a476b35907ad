"""MLflow entry point ``verify``: the reproduced numbers against the values the paper expects.

Every entry of :mod:`mistill.results_index` lists the values Appendix Q of the paper expects for
one result (:class:`~mistill.results_index.ExpectedValue`): the value, the paper's interval or
tolerance, and the metric of the platform's runs that holds the reproduced value
(:class:`~mistill.results_index.MetricSource`). ``verify`` reads those metrics from the FINISHED
runs of experiment ``mistill/<corpus>`` and gives each expected value one status:

* ``agrees``: the reproduced value lies within the paper's interval, or within its tolerance of
  the paper's value (bounds included; where the paper gives no tolerance, only the value itself);
* ``differs``: it lies outside;
* ``not run``: no finished run of the source's entry point, with its tags and params, logs the
  metric;
* ``no readout``: no run of the platform logs that number (the source is null).

A source's runs: those of its entry point whose tags (``arm``, ``model``, ``seed``, ``split``,
``lambda``, ...) and params match; a model tag ``{teacher}``, ``{student}`` or
``{student_smollm3}`` is the model given for that role (unset: any model); a param asked as
``""`` also matches a run without it, and an ``own_heads`` run with a ``probe_head`` (App. I's
k = 8 probe) is read only by a source naming that probe. ``reduce: newest``
reads the newest such run; ``reduce: mean`` the mean over the newest run of each seed.

One ``verify`` run logs:

* ``verify.csv`` / ``verify.md``: one row per expected value (``id``, ``k`` its position in the
  entry's list from 1, the statistic, the paper's value and what agrees with it, the reproduced
  value and its interval where the runs log one, the status, the metric read and the runs read);
  ``verify_summary.md``: the same, led by the values that differ, said plainly;
* metrics ``verify/<id>/<k>/agrees`` (1 or 0) for each value compared (agrees or differs),
  ``verify/<id>/agrees`` (1 when every compared value of the result agrees, else 0; absent when
  none was compared) and ``verify/n_<status>`` (values per status).

The same table is a section of the ``report`` stage's ``report.md`` (:func:`verify_markdown`).
Every run read is recorded as lineage, so an identical request over the same runs reuses the
finished verify run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlflow
import pandas as pd
from mlflow.tracking import MlflowClient

from analysis.query import TAG_COLUMNS, latest_runs, stage_runs
from mistill.config import Config
from mistill.errors import MistillInputError
from mistill.io import write_text
from mistill.results_index import MEAN, ExpectedValue, MetricSource, ResultEntry, load, source_text
from mistill.stages.common import mistill_root
from mistill.stages.registry import stage_help
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.experiments import experiment_for_corpus, resolve_tracking_uri
from mistill.tracking.runs import StageRun
from mistill.validation import check_model_spec, check_name, check_no_text_fields, check_not_empty

AGREES, DIFFERS, NOT_RUN, NO_READOUT = "agrees", "differs", "not run", "no readout"
STATUSES: tuple[str, ...] = (AGREES, DIFFERS, NOT_RUN, NO_READOUT)
"""The status of one expected value (see the module's docstring)."""

ROLES: tuple[str, ...] = ("teacher", "student", "student_smollm3")
"""The model roles a source's ``model`` tag may name as ``{role}``."""

COLUMNS: tuple[str, ...] = ("id", "k", "statistic", "unit", "paper", "agrees_within", "reproduced",
                            "reproduced_lo", "reproduced_hi", "status", "source", "runs")
"""The columns of the verify table."""


@dataclass(frozen=True)
class VerifyConfig(Config):
    """What verify reads.

    corpus: the corpus name; the runs read and the verify run are in ``mistill/<corpus>``.
    teacher, student, student_smollm3: the model each role names (a run's ``mistill.model`` tag,
        e.g. ``embedded:smollm2-135m``); a source whose ``model`` tag names an empty role reads
        the runs of every model.
    """

    corpus: str = "synthetic"
    teacher: str = ""
    student: str = ""
    student_smollm3: str = ""

    def validate(self) -> None:
        check_no_text_fields(self)
        check_not_empty(self.corpus, "corpus", "the corpus whose experiment is read")
        check_name(self.corpus, "corpus", "the corpus whose experiment is read")
        for role in ROLES:
            check_model_spec(getattr(self, role), role, allow_empty=True)

    def roles(self) -> dict[str, str]:
        """Role -> model spec, for the roles given."""
        return {r: getattr(self, r) for r in ROLES if getattr(self, r)}


@dataclass(frozen=True)
class Readout:
    """A reproduced value: the metric's value, its interval where the runs log one, the runs read."""

    value: float
    lo: float | None = None
    hi: float | None = None
    run_ids: tuple[str, ...] = ()


def status_of(expected: ExpectedValue, readout: Readout | None) -> str:
    """The status of one expected value given what was read (None: nothing was)."""
    if expected.source is None:
        return NO_READOUT
    if readout is None or not math.isfinite(readout.value):
        return NOT_RUN
    return AGREES if expected.agrees(readout.value) else DIFFERS


@dataclass
class StoreReader:
    """Reads sources from one experiment of a tracking server; remembers every run it read."""

    client: MlflowClient
    experiment: str
    roles: Mapping[str, str] = field(default_factory=dict)
    read: dict[str, str] = field(default_factory=dict)  # run id -> stage
    levels: set[str] = field(default_factory=set)  # privacy levels of the runs read
    _runs: dict[str, pd.DataFrame] = field(default_factory=dict)
    _params: dict[str, dict[str, str]] = field(default_factory=dict)

    def _stage(self, entry_point: str) -> pd.DataFrame:
        if entry_point not in self._runs:
            self._runs[entry_point] = stage_runs(self.client, self.experiment, entry_point)
        return self._runs[entry_point]

    def _run_params(self, run_id: str) -> dict[str, str]:
        if run_id not in self._params:
            self._params[run_id] = dict(self.client.get_run(run_id).data.params)
        return self._params[run_id]

    def _tag_value(self, name: str, value: str) -> str | None:
        """The tag value a source asks for, a ``{role}`` replaced (None: the role is unset)."""
        if value.startswith("{") and value.endswith("}"):
            role = value[1:-1]
            if role not in ROLES:
                raise MistillInputError(f"source tag {name}={value!r}: no such role (one of {', '.join(ROLES)})",
                                        field="expected")
            return self.roles.get(role)
        return value

    def runs(self, source: MetricSource) -> pd.DataFrame:
        """The source's runs that log its metric, newest first."""
        df = self._stage(source.entry_point)
        if df.empty or source.metric not in df.columns:
            return df.iloc[0:0]
        df = df[df[source.metric].notna()]
        for name, value in source.tags:
            if name not in TAG_COLUMNS:
                raise MistillInputError(f"source tag {name!r} is not one of {', '.join(TAG_COLUMNS)}",
                                        field="expected")
            wanted = self._tag_value(name, value)
            if wanted is None:
                continue
            df = df[df[name].astype("string") == wanted]
        asked = dict(source.params)
        if source.entry_point == "own_heads":  # a probe run is read only by a source naming its probe
            asked.setdefault("probe_head", "")
        if asked:
            keep = [all(self._run_params(rid).get(k, "") == v for k, v in asked.items()) for rid in df["run_id"]]
            df = df[keep]
        return df

    def privacy(self) -> str:
        """The strictest privacy level of the runs read (``synthetic`` when none was read;
        ``restricted`` for an unknown level), as the report decides its own."""
        if not self.levels:
            return "synthetic"
        if "restricted" in self.levels or not self.levels <= {"public", "synthetic"}:
            return "restricted"
        return "public" if "public" in self.levels else "synthetic"

    def __call__(self, source: MetricSource) -> Readout | None:
        """The reproduced value of a source; None when no matching run logs its metric."""
        df = self.runs(source)
        if df.empty:
            return None
        if source.reduce == MEAN:
            df = latest_runs(df, key=("seed",))
        else:
            df = df.head(1)
        for rid in df["run_id"]:
            self.read[rid] = source.entry_point
        self.levels.update(str(v) for v in df["privacy"].dropna())
        lo = hi = None
        if source.interval is not None and all(m in df.columns for m in source.interval):
            lo, hi = (float(df[m].mean()) for m in source.interval)
        return Readout(value=float(df[source.metric].mean()), lo=lo, hi=hi, run_ids=tuple(df["run_id"]))


def verify_table(entries: Sequence[ResultEntry], read: Any) -> pd.DataFrame:
    """One row per expected value of ``entries`` (:data:`COLUMNS`); ``read`` maps a
    :class:`~mistill.results_index.MetricSource` to a :class:`Readout` or None."""
    rows = []
    for e in entries:
        for k, v in enumerate(e.expected, start=1):
            readout = read(v.source) if v.source is not None else None
            rows.append({"id": e.id, "k": k, "statistic": v.statistic, "unit": v.unit, "paper": v.value,
                         "agrees_within": v.allowed(),
                         "reproduced": readout.value if readout else math.nan,
                         "reproduced_lo": readout.lo if readout and readout.lo is not None else math.nan,
                         "reproduced_hi": readout.hi if readout and readout.hi is not None else math.nan,
                         "status": status_of(v, readout), "source": source_text(v.source),
                         "runs": ",".join(readout.run_ids) if readout else ""})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def verify_metrics(table: pd.DataFrame) -> dict[str, float]:
    """``verify/<id>/<k>/agrees`` per compared value, ``verify/<id>/agrees`` per result with a
    compared value, ``verify/n_<status>`` per status (spaces as ``_``)."""
    out: dict[str, float] = {}
    compared = table[table["status"].isin([AGREES, DIFFERS])]
    for _, row in compared.iterrows():
        out[f"verify/{row['id']}/{int(row['k'])}/agrees"] = float(row["status"] == AGREES)
    for rid, group in compared.groupby("id", sort=False):
        out[f"verify/{rid}/agrees"] = float((group["status"] == AGREES).all())
    for s in STATUSES:
        out[f"verify/n_{s.replace(' ', '_')}"] = float((table["status"] == s).sum())
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def verify_markdown(table: pd.DataFrame, *, heading: str = "#") -> str:
    """The verify table as Markdown, led by a plain statement of how many values differ."""
    counts = {s: int((table["status"] == s).sum()) for s in STATUSES}
    compared = counts[AGREES] + counts[DIFFERS]
    lines = [f"{heading} The paper's expected values against this store", ""]
    if counts[DIFFERS]:
        ids = list(dict.fromkeys(table.loc[table["status"] == DIFFERS, "id"]))
        lines.append(f"**{counts[DIFFERS]} of the {compared} values compared DO NOT AGREE with the paper** "
                     f"({', '.join(ids)}).")
    elif compared:
        lines.append(f"All {compared} values compared agree with the paper.")
    else:
        lines.append("No value could be compared: no finished run logs any of the metrics read.")
    lines += ["", f"{counts[AGREES]} agree, {counts[DIFFERS]} differ, {counts[NOT_RUN]} not run (no finished "
              f"run logs the metric), {counts[NO_READOUT]} no readout (no run of the platform logs the number). "
              "A run of the embedded default (a small model on a synthetic corpus) is not the paper's "
              "setting: its numbers are not expected to agree.", "",
              "| id | k | statistic | unit | paper | agrees within | reproduced | status | read from |",
              "|---|---|---|---|---|---|---|---|---|"]
    for _, r in table.iterrows():
        rep = _cell(r["reproduced"])
        if rep and not (math.isnan(r["reproduced_lo"]) or math.isnan(r["reproduced_hi"])):
            rep += f" [{_cell(r['reproduced_lo'])}, {_cell(r['reproduced_hi'])}]"
        status = f"**{r['status'].upper()}**" if r["status"] == DIFFERS else r["status"]
        lines.append(f"| {r['id']} | {r['k']} | {_cell(r['statistic'])} | {_cell(r['unit'])} | "
                     f"{_cell(float(r['paper']))} | {_cell(r['agrees_within'])} | {rep} | {status} | "
                     f"{_cell(r['source'])} |")
    return "\n".join(lines) + "\n"


def verify_store(client: MlflowClient, experiment: str, roles: Mapping[str, str] | None = None,
                 entries: Sequence[ResultEntry] | None = None) -> tuple[pd.DataFrame, StoreReader]:
    """The verify table of one experiment, and the reader (the runs it read, their privacy)."""
    reader = StoreReader(client, experiment, dict(roles or {}))
    table = verify_table(load() if entries is None else entries, reader)
    return table, reader


def run_verify(cfg: VerifyConfig) -> str:
    """Read the store, compare, log the table and the metrics; returns the verify run's id (an
    identical request over the same runs reuses the finished one)."""
    uri = resolve_tracking_uri(mistill_root())
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    experiment = experiment_for_corpus(cfg.corpus, tracking_uri=uri)
    table, reader = verify_store(client, experiment, cfg.roles())
    lineage = {f"{stage}.{rid}": rid for rid, stage in reader.read.items()}
    with StageRun("verify", cfg, corpus=cfg.corpus, guard=PrivacyGuard([], reader.privacy()), inputs=lineage,
                  description=stage_help()["verify"],
                  resume=True, root=mistill_root(), tracking_uri=uri) as run:
        if run.reused:
            print(f"verify: reusing finished run {run.run_id}")
            return run.run_id
        run.log_table("verify", table, index=False)
        summary = run.work_dir / "artifacts" / "verify_summary.md"
        text = verify_markdown(table)
        write_text(summary, text)
        run.log_artifact_file(summary)
        run.log_metrics(verify_metrics(table))
        print(text, end="")
        print(f"verify: {len(table)} expected values -> run {run.run_id}")
        return run.run_id
