"""The ``verify`` stage: the paper's expected values (results_index.yaml) against the tracking store."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from analysis.query import TAG_COLUMNS
from analysis_fixtures import make_run
from mistill.errors import MistillInputError
from mistill.results_index import DATA_FILE, ExpectedValue, MetricSource, load
from mistill.stages.registry import stage_help
from mistill.stages.verify import (AGREES, DIFFERS, NO_READOUT, NOT_RUN, ROLES, Readout, VerifyConfig,
                                   run_verify, status_of, verify_markdown, verify_metrics, verify_table)
from stage_fixtures import unique

pytestmark = pytest.mark.usefixtures("pinned_code_version")

REPO = Path(__file__).resolve().parents[1]


def _value(value: float = 1.0, *, interval: tuple[float, float] | None = None, tolerance: float | None = None,
           source: MetricSource | None = MetricSource("evaluate", "micro_f1")) -> ExpectedValue:
    return ExpectedValue(statistic="s", value=value, interval=interval, tolerance=tolerance,
                         tolerance_source="" if interval else "paper gives none", unit="F1", source=source)


# ----------------------------------------------------------------------------- comparison
def test_an_interval_includes_both_bounds():
    v = _value(0.0, interval=(-0.025, 0.019))
    assert v.agrees(-0.025) and v.agrees(0.019) and v.agrees(0.0)
    assert not v.agrees(-0.0251) and not v.agrees(0.0191)
    assert v.agrees(0.1 + 0.2 - 0.3 + 0.019)  # float rounding at a bound still agrees


def test_a_tolerance_is_absolute_and_inclusive():
    v = _value(6.02, tolerance=0.046)
    assert v.agrees(6.066) and v.agrees(5.974) and v.agrees(6.02)
    assert not v.agrees(6.067) and not v.agrees(5.973)
    exact = _value(2064, tolerance=0)
    assert exact.agrees(2064) and not exact.agrees(2065)


def test_without_a_tolerance_only_the_value_agrees():
    v = _value(0.36, tolerance=None)
    assert v.agrees(0.36) and not v.agrees(0.361)
    assert "paper gives none" in v.allowed()


def test_status_of_each_case():
    assert status_of(_value(1.0, tolerance=0.1), Readout(1.05)) == AGREES
    assert status_of(_value(1.0, tolerance=0.1), Readout(1.2)) == DIFFERS
    assert status_of(_value(1.0, tolerance=0.1), None) == NOT_RUN
    assert status_of(_value(1.0, tolerance=0.1), Readout(float("nan"))) == NOT_RUN
    assert status_of(_value(1.0, tolerance=0.1, source=None), None) == NO_READOUT


def test_metrics_only_for_compared_values_and_per_result():
    table = pd.DataFrame({"id": ["R-C1", "R-C1", "R-D1", "R-D2", "R-D3"], "k": [1, 2, 1, 1, 1],
                          "status": [AGREES, DIFFERS, AGREES, NOT_RUN, NO_READOUT]})
    assert verify_metrics(table) == {
        "verify/R-C1/1/agrees": 1.0, "verify/R-C1/2/agrees": 0.0, "verify/R-D1/1/agrees": 1.0,
        "verify/R-C1/agrees": 0.0, "verify/R-D1/agrees": 1.0,
        "verify/n_agrees": 2.0, "verify/n_differs": 1.0, "verify/n_not_run": 1.0, "verify/n_no_readout": 1.0}


# ------------------------------------------------------------------------------- the data
def test_every_entry_has_its_expected_list_and_most_values_a_source():
    entries = load()
    assert len(entries) == 62
    values = [v for e in entries for v in e.expected]
    assert len(values) >= 200 and sum(v.source is not None for v in values) >= 100
    assert [e.id for e in entries if not e.expected] == ["R-D8", "R-D43", "R-D44"]  # no number stated


def _code_text() -> str:
    files = [*sorted((REPO / "mistill").rglob("*.py")), *sorted((REPO / "analysis").rglob("*.py"))]
    return "\n".join(p.read_text(encoding="utf-8") for p in files if p.name not in ("verify.py", "results_index.py"))


_VALUE_PART = re.compile(r"^(P1|P2|P2C|NULL|all|k\d+|L\d+H\d+|\d+)$")
"""Metric name parts the stages fill in from data (phase, k bin, head, a count), not literals."""


def _templated(part: str, code: str) -> bool:
    """Whether the code writes ``part`` with its numbers filled in (``prose_top8_window`` from
    ``f"passB_prose_top{k}_window"``)."""
    pattern = r"\{\w+\}".join(re.escape(piece) for piece in re.split(r"\d+", part))
    return pattern != re.escape(part) and re.search(pattern, code) is not None


def test_every_source_names_a_metric_the_code_logs_and_an_entry_point_that_exists():
    """A source's metric is logged by the code: its full name is a literal there, or each of its
    fixed parts is (a name built as ``f"{prefix}m4/{phase}/k{k}/recovery_own"`` or
    ``metric_name("events", kind, "realized")``); its entry point and tags exist."""
    code = _code_text()
    literals = set(re.findall(r"[\"'/{}]([A-Za-z_][A-Za-z0-9_]*)(?=[\"'/{}.])", code))
    # and the parts of a dotted key in a string (a table column split into metric parts)
    literals |= {part for text in re.findall(r'"([A-Za-z0-9_.]+)"', code) for part in text.split(".")}
    for e in load():
        for v in e.expected:
            s = v.source
            if s is None:
                continue
            assert s.entry_point in stage_help(), (e.id, s.entry_point)
            for name, value in s.tags:
                assert name in TAG_COLUMNS, (e.id, name)
                if value.startswith("{"):
                    assert value.strip("{}") in ROLES, (e.id, value)
            if f'"{s.metric}"' in code:
                continue
            fixed = [p for p in s.metric.split("/") if not _VALUE_PART.match(p)]
            # a part built as f"{key}_vs_{set}" (the knockin table's comparison columns)
            fixed = [q for p in fixed for q in (p.split("_vs_") if "_vs_{" in code else [p])]
            missing = [p for p in fixed if p not in literals and not _templated(p, code)]
            assert not missing, f"{e.id}: {s.metric}: no code writes the parts {missing}"


def _write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "index.yaml"
    path.write_text(yaml.safe_dump(raw, allow_unicode=True), encoding="utf-8")
    return path


@pytest.mark.parametrize("change, message", [
    (lambda v: v.update(value="six"), "'value' must be a number"),
    (lambda v: v.update(interval=[1.0, 0.0]), "not both"),
    (lambda v: (v.pop("tolerance"), v.pop("tolerance_source"), v.update(interval=[1.0, 0.0])), "lo <= hi"),
    (lambda v: v.pop("tolerance_source"), "tolerance_source"),
    (lambda v: v.update(tolerance=-1), "number >= 0 or null"),
    (lambda v: v.pop("source"), "missing fields \\['source'\\]"),
    (lambda v: v.update(source={"entry_point": "events"}), "'source.metric'"),
    (lambda v: v.update(source={"entry_point": "events", "metric": "m", "reduce": "median"}), "source.reduce"),
    (lambda v: v.update(source={"entry_point": "events", "metric": "m", "tags": ["arm"]}), "source.tags"),
    (lambda v: v.update(colour="red"), "unknown fields \\['colour'\\]"),
])
def test_a_malformed_expected_value_names_the_file_the_entry_and_the_field(tmp_path, change, message):
    raw = yaml.safe_load(DATA_FILE.read_text(encoding="utf-8"))
    entry = raw["entries"][0]
    change(entry["expected"][0])
    path = _write(tmp_path, {"entries": [entry]})
    with pytest.raises(MistillInputError, match=message) as exc:
        load(path)
    text = str(exc.value)
    assert str(path) in text and "(R-C1)" in text and "expected value 1" in text and "field 'expected'" in text


def test_an_entry_without_expected_or_with_a_non_list_is_refused(tmp_path):
    raw = yaml.safe_load(DATA_FILE.read_text(encoding="utf-8"))
    entry = raw["entries"][0]
    with pytest.raises(MistillInputError, match="a list of expected values"):
        load(_write(tmp_path, {"entries": [dict(entry, expected={"value": 1})]}))
    del entry["expected"]
    with pytest.raises(MistillInputError, match=r"missing fields \['expected'\]"):
        load(_write(tmp_path, {"entries": [entry]}))


# --------------------------------------------------------------------- against a real store
R_C1 = {"events/P1/realized": 2064.0, "events/P2/realized": 7688.0, "events/P2C/realized": 3855.0,
        "events/NULL/realized": 2000.0, "margin/P1/median": 6.05}
"""Every R-C1 value as the paper expects it (the margin within class K's 0.046 nats)."""


@pytest.fixture
def verify_store(tracking_uri, tmp_path, monkeypatch):
    """R-C1's events run agrees; R-D1's untrained evaluate runs differ; R-D6 has no own-heads run."""
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "reader"))
    corpus = unique("verify")
    make_run(tracking_uri, corpus, "events", tmp_path, model="teacher-t", metrics=R_C1)
    make_run(tracking_uri, corpus, "evaluate", tmp_path, arm="untrained", seed=0,
             tags={"mistill.split": "test"},
             metrics={"micro_f1": 0.5, "valid_rate": 0.987})
    return corpus


def test_verify_reads_agreeing_differing_and_missing_results(verify_store, tmp_path):
    run_id = run_verify(VerifyConfig(corpus=verify_store))
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.stage"] == "verify"
    table = pd.read_csv(client.download_artifacts(run_id, "verify.csv", str(tmp_path)))
    md = Path(client.download_artifacts(run_id, "verify.md", str(tmp_path))).read_text()
    summary = Path(client.download_artifacts(run_id, "verify_summary.md", str(tmp_path))).read_text()
    assert re.search(r"\| R-C1 +\| +1 \| P1 events", md)

    c1 = table[table["id"] == "R-C1"]
    assert c1["status"].tolist() == [AGREES] * 5
    assert c1["reproduced"].tolist() == [2064.0, 7688.0, 3855.0, 2000.0, 6.05]
    assert c1["paper"].tolist() == [2064.0, 7688.0, 3855.0, 2000.0, 6.02]
    d1 = table[table["id"] == "R-D1"].set_index("k")
    # one run serves both students (no roles given): Qwen3-4B's micro-F1 0.104 and SmolLM3-3B's 0.003
    assert d1["status"].tolist() == [DIFFERS, AGREES, DIFFERS, DIFFERS]
    assert d1.loc[1, "reproduced"] == 0.5 and d1.loc[2, "reproduced"] == 0.987
    d6 = table[table["id"] == "R-D6"]
    assert set(d6["status"]) == {NOT_RUN, NO_READOUT}
    # R-D33: the teacher's D has a readout (flip_test's flip/D), not run here; the contrasts have none
    assert table.loc[table["id"] == "R-D33", "status"].tolist() == [NOT_RUN, NO_READOUT, NO_READOUT]

    m = run.data.metrics
    assert m["verify/R-C1/agrees"] == 1.0 and all(m[f"verify/R-C1/{k}/agrees"] == 1.0 for k in range(1, 6))
    assert m["verify/R-D1/1/agrees"] == 0.0 and m["verify/R-D1/2/agrees"] == 1.0 and m["verify/R-D1/agrees"] == 0.0
    assert not any(k.startswith("verify/R-D6/") for k in m)  # nothing compared: no agrees metric
    assert m["verify/n_differs"] == 3.0 and m["verify/n_agrees"] == 6.0
    assert m["verify/n_no_readout"] == (table["status"] == NO_READOUT).sum()
    assert "**3 of the 9 values compared DO NOT AGREE with the paper** (R-D1)" in summary
    assert "**DIFFERS**" in summary
    inputs = {k for k in run.data.tags if k.startswith("mistill.input.")}
    assert len(inputs) == 2  # the events run and the evaluate run read
    assert run_verify(VerifyConfig(corpus=verify_store)) == run_id  # same runs read: reused


def test_roles_select_the_models_runs(verify_store):
    """With the students named, the untrained run (model ``student-a``) is Qwen3-4B's only."""
    from mistill.stages.verify import verify_store as read_store

    table, reader = read_store(MlflowClient(), f"mistill/{verify_store}", {"student": "student-a",
                                                                           "student_smollm3": "smol",
                                                                           "teacher": "teacher-t"})
    d1 = table[table["id"] == "R-D1"]
    assert d1["status"].tolist() == [DIFFERS, AGREES, NOT_RUN, NOT_RUN]
    assert table[table["id"] == "R-C1"]["status"].eq(AGREES).all()
    assert reader.privacy() == "synthetic"


def test_the_markdown_says_plainly_when_nothing_could_be_compared():
    entries = load()[:1]
    table = verify_table(entries, lambda source: None)
    text = verify_markdown(table)
    assert "No value could be compared" in text and text.count("| R-C1 |") == len(entries[0].expected)


def test_the_report_ends_with_the_verify_section(verify_store, tmp_path):
    from mistill.stages.report import ReportConfig, run_report

    run_id = run_report(ReportConfig(corpus=verify_store, bootstrap=20, corpus_bootstrap=20))
    client = MlflowClient()
    report = Path(client.download_artifacts(run_id, "report.md", str(tmp_path))).read_text()
    section = report[report.index("## The paper's expected values against this store"):]
    assert "DO NOT AGREE with the paper** (R-D1)" in section and "| R-C1 | 1 | P1 events |" in section
    table = pd.read_csv(client.download_artifacts(run_id, "tables/verify.csv", str(tmp_path)))
    assert table.loc[table["id"] == "R-C1", "status"].eq(AGREES).all()
