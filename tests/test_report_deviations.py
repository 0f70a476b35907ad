"""The report names the deviations from the paper in the runs it reads: registry parameters at a
non-default value (a stage config, a train run's resolved arm) and the runs' own tags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from analysis_fixtures import TEACHER, knockin_rows, make_run, train_arm
from mlflow.tracking import MlflowClient
from stage_fixtures import unique

import mistill.deviations as registry
from mistill.deviations import Deviation
from mistill.stages.characterize import AttributeConfig
from mistill.stages.report import ReportConfig, run_report

pytestmark = pytest.mark.usefixtures("pinned_code_version")

MARGIN = Deviation(choice="near-tie guard", section="App. I.1", parameter="ArmConfig.min_abs_margin", paper="the paper states no filter",
                   platform="an opt-in guard: events with a margin below it leave the interaction term",
                   why="c divides by the margin", default=0.0, paper_value=0.0)
FDR = Deviation(choice="BH level", section="App. C", parameter="AttributeConfig.fdr_q", paper="BH at FDR 0.05 (App. C)",
                platform="BH at fdr_q", why="a parameter", default=0.05, paper_value=0.05)


def _runs(uri: str, corpus: str, root: Path) -> dict[str, str]:
    ids = {"top8": make_run(uri, corpus, "train", root, arm="top8", seed=0, precision="bf16",
                            jsons={"arm": train_arm("top8", min_abs_margin=0.3)}),
           "vanilla": make_run(uri, corpus, "train", root, arm="vanilla-bf16", seed=0,
                               precision="bf16", jsons={"arm": train_arm("vanilla-bf16")}),
           "attribute": make_run(uri, corpus, "attribute", root, model=TEACHER,
                                 cfg=AttributeConfig(fdr_q=0.1)),
           "attribute_default": make_run(uri, corpus, "attribute", root, model="other",
                                         cfg=AttributeConfig())}
    ids["knockin"] = make_run(uri, corpus, "knockin", root, model=TEACHER,
                              inputs={"attribute": ids["attribute"]},
                              tables={"per_note_sets": knockin_rows()})
    ids["knockin_default"] = make_run(uri, corpus, "knockin", root, model="other",
                                      inputs={"attribute": ids["attribute_default"]},
                                      tables={"per_note_sets": knockin_rows()})
    ids["tagged"] = make_run(uri, corpus, "evaluate", root, arm="mistill", seed=0,
                             precision="bf16", metrics={"micro_f1": 0.3},
                             tags={"mistill.deviation": "D3, D7,"})
    return ids


def _artifact(run_id: str, path: str, dst: Path) -> Path:
    return Path(MlflowClient().download_artifacts(run_id, path, str(dst)))


def test_report_lists_non_default_registry_values_and_tags(tracking_uri, tmp_path, monkeypatch):
    corpus = unique("deviations")
    ids = _runs(tracking_uri, corpus, tmp_path / "w")
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "reader"))
    monkeypatch.setattr(registry, "DEVIATIONS", (MARGIN, FDR))
    run_id = run_report(ReportConfig(corpus=corpus, bootstrap=10, corpus_bootstrap=10))
    doc = json.loads(_artifact(run_id, "deviations.json", tmp_path).read_text())
    found = {(f["run_id"], f["parameter"]): f for f in doc["findings"]}
    # the default-valued arm and attribute run are not listed
    assert set(found) == {(ids["top8"], "ArmConfig.min_abs_margin"),
                          (ids["attribute"], "AttributeConfig.fdr_q")}
    margin = found[(ids["top8"], "ArmConfig.min_abs_margin")]
    assert (margin["value"], margin["default"], margin["paper_value"], margin["kind"],
            margin["stage"]) == (0.3, 0.0, 0.0, "non_default", "train")
    assert found[(ids["attribute"], "AttributeConfig.fdr_q")]["paper_value"] == 0.05
    assert doc["tags"] == [{"run_id": ids["tagged"], "run_name": doc["tags"][0]["run_name"],
                            "stage": "evaluate", "arm": "mistill", "codes": "D3,D7"}]
    text = _artifact(run_id, "report.md", tmp_path / "md").read_text()
    section = text.split("## Deviations in these runs", 1)[1].split("\n## ", 1)[0]
    assert ids["top8"] in section and "ArmConfig.min_abs_margin" in section
    assert "| 0.3 | 0.0 |" in section and "non_default" in section
    assert ids["vanilla"] not in section and ids["attribute_default"] not in section
    assert "D3,D7" in section and "None found." not in section
    assert MlflowClient().get_run(run_id).data.metrics["n_deviations"] == 2


def test_report_says_none_found(tracking_uri, tmp_path, monkeypatch):
    corpus = unique("no-deviations")
    make_run(tracking_uri, corpus, "train", tmp_path / "w", arm="vanilla-bf16", seed=0,
             precision="bf16", jsons={"arm": train_arm("vanilla-bf16")})
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "reader"))
    monkeypatch.setattr(registry, "DEVIATIONS", (MARGIN, FDR))
    run_id = run_report(ReportConfig(corpus=corpus, bootstrap=10, corpus_bootstrap=10))
    text = _artifact(run_id, "report.md", tmp_path).read_text()
    assert "## Deviations in these runs" in text
    assert "None found." in text.split("## Deviations in these runs", 1)[1]
    doc = json.loads(_artifact(run_id, "deviations.json", tmp_path / "j").read_text())
    assert doc == {"findings": [], "tags": [], "problems": []}
