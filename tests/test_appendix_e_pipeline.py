"""App. E in the pipeline and the report: the four steps run on the teacher after
characterization, nested under the pipeline, each reading the run before it, and the report
lists Tables 16-23 (with rows, or saying why not)."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from mistill.stages.workflow import PipelineConfig, pipeline_steps
from stage_fixtures import SMALL, artifact_paths, unique

pytestmark = pytest.mark.usefixtures("pinned_code_version")

APP_E = ("read_side", "key_block", "trace_edit", "note_edit")


def test_pipeline_runs_appendix_e_on_the_teacher_and_the_report_lists_its_tables(tracking_uri, tmp_path, monkeypatch):
    from mistill.stages.report import ReportConfig, run_report

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    name = unique("appe")
    cfg = PipelineConfig(corpus="synthetic", corpus_name=name, n_notes=3, teacher_split="",
                         **{**SMALL, "read_side": True, "read_side_max_events": 2})
    ids = pipeline_steps(cfg)
    client = MlflowClient()
    runs = {step: client.get_run(ids[step]) for step in APP_E}
    for step, run in runs.items():
        assert run.info.status == "FINISHED" and run.data.tags["mistill.stage"] == step
    assert runs["read_side"].data.params["attribute_run"] == ids["attribute"]
    assert runs["key_block"].data.params["read_side_run"] == ids["read_side"]
    for step in ("trace_edit", "note_edit"):
        assert runs[step].data.params["attribute_run"] == ids["attribute"]
        assert runs[step].data.params["max_events"] == "2"
    assert "key_block.csv" in artifact_paths(client, ids["key_block"])
    # an identical pipeline reuses every App. E step
    assert {step: pipeline_steps(cfg)[step] for step in APP_E} == {step: ids[step] for step in APP_E}

    report = run_report(ReportConfig(corpus=name))
    path = client.download_artifacts(report, "report.md", str(tmp_path))
    text = open(path).read()
    for title in ("Table 16:", "Table 17:", "Table 18:", "Table 19:", "Table 20:", "Table 21:", "Table 23:"):
        assert title in text, title
    assert "no FINISHED read_side runs" not in text
