"""The ``locus`` stage end to end against a real MLflow server: what it logs, the locus
definition on its own rows, per-note resume after a crash, and the prose-time set reaching the
teacher's P1 window rows in ``targets`` (no deviation tag once a locus run is given).

The teacher is a tiny random Qwen3 whose output layer is scaled 20x (``logit_scale=20``) so
that forced chapter margins span several nats: with the paper's theta = 2 some mentions are
decisive and others are not, and every outcome path of the walk is exercised."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from mistill.instrument.locus import OUTCOMES
from stage_fixtures import artifact_paths, unique

pytestmark = pytest.mark.usefixtures("pinned_code_version")

TEACHER = "tiny:qwen3:logit_scale=400"
N_HEADS = 2 * 4


def _locus_config(attribute_run: str, **kw):
    from mistill.stages.locus import LocusStageConfig

    base = dict(attribute_run=attribute_run, compare_suffixes=("D",), max_mentions=4, width=16,
                pass_k=(2, 4), position_k=4, follow_k=4, swap_layers=(0, 1), tail=4, stability_splits=5)
    return LocusStageConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def characterized(tracking_uri: str, tmp_path_factory: pytest.TempPathFactory):
    from mistill.stages.characterize import AttributeConfig, EventsConfig
    from mistill.stages.prepare import PrepareConfig
    from mistill.stages.workflow import run_step

    root = tmp_path_factory.mktemp("locus-root")
    name = unique("locus")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MISTILL_ROOT", str(root))
        mp.setenv("TQDM_DISABLE", "1")
        prep = run_step("prepare", PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=4), name,
                        launch="inline")
        ev = run_step("events", EventsConfig(prepare_run=prep, model=TEACHER, n_null=4), name, launch="inline")
        att = run_step("attribute", AttributeConfig(events_run=ev, stability_splits=5, selftest_events=0), name,
                       launch="inline")
    return {"root": root, "name": name, "prepare": prep, "events": ev, "attribute": att}


@pytest.fixture(scope="module")
def locus_run(characterized):
    from mistill.stages.locus import run_locus

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MISTILL_ROOT", str(characterized["root"]))
        mp.setenv("TQDM_DISABLE", "1")
        run_id = run_locus(_locus_config(characterized["attribute"]))
    return run_id


def _download(run_id: str, path: str, dst: Path) -> Path:
    return Path(MlflowClient().download_artifacts(run_id, path, str(dst)))


def test_locus_run_logs_sets_tables_and_notes(locus_run, characterized, tmp_path):
    client = MlflowClient()
    run = client.get_run(locus_run)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mistill.stage"] == "locus"
    assert run.data.tags["mistill.input.attribute"] == characterized["attribute"]
    arts = artifact_paths(client, locus_run)
    assert {"head_sets.json", "read_panel.json", "table26_outcomes.csv", "locus_mentions.csv",
            "table25_suffixes.csv", "locus_distances.csv"} <= arts
    assert sum(1 for p in arts if p.endswith("/locus.jsonl")) == 4  # one per note
    sets = json.loads(_download(locus_run, "head_sets.json", tmp_path).read_text())
    for key in ("prose_time", "transport"):
        ranking = sets[key]["ranking"]
        assert sorted(ranking) == sorted(f"L{l}H{h}" for l in range(2) for h in range(4)), key
    mentions = pd.read_csv(_download(locus_run, "locus_mentions.csv", tmp_path))
    assert set(mentions["outcome"]) <= set(OUTCOMES)
    assert len(set(mentions["outcome"])) >= 2  # the sharpened teacher gives decisive and undecided mentions
    assert mentions.groupby("note_id").size().max() <= 4  # max_mentions
    outcomes = pd.read_csv(_download(locus_run, "table26_outcomes.csv", tmp_path)).set_index("outcome")
    kinds = ["first_code", "previous_same_chapter", "previous_other_chapter"]
    assert outcomes.loc["n_mentions", "all"] == len(mentions) == outcomes.loc["n_mentions", kinds].sum()
    for col in ["all", *kinds]:
        if outcomes.loc["n_mentions", col] > 0:  # each column's outcome shares partition its mentions
            assert outcomes.loc[list(OUTCOMES), col].sum() == pytest.approx(1.0, abs=1e-12), col
    assert outcomes.loc["window", "all"] == pytest.approx((mentions["outcome"] == "window").mean())
    # the second half ran on the attributed mentions: pass A and B, follow-through of the window ones
    assert mentions["attributed"].fillna(False).astype(bool).any()
    assert {"table30_pass_a.csv", "table32_pass_b.csv", "table29_prose_time.csv"} <= arts
    if (mentions["outcome"] == "window").any():
        assert "table31_follow_through.csv" in arts
    metrics = run.data.metrics
    assert any(k.startswith("locus/") for k in metrics)


def test_locus_rows_follow_the_definition(locus_run, characterized, tmp_path):
    """On every logged mention: the locus is the farthest distance whose probes, and every probe
    nearer the letter, stay >= theta; the one probed just beyond it (when probed) is below theta;
    window loci lie after the previous code, inherited ones at or before it."""
    from mistill.stages.locus import PROBE_FILE, PROBE_NOTES

    theta = 2.0
    rows = []
    for path in artifact_paths(MlflowClient(), locus_run):
        if f"{PROBE_NOTES}/" in path and path.endswith("/" + PROBE_FILE):
            text = _download(locus_run, path, tmp_path / path.replace("/", "_")).read_text()
            rows += [json.loads(line) for line in text.splitlines() if line]
    assert rows
    for r in rows:
        curve = dict((int(d), float(m)) for d, m in r["curve"])
        assert 0 in curve
        if r["outcome"] == "probe_failure":
            assert curve[0] < theta
            continue
        assert curve[0] >= theta
        if r["outcome"] == "censored":  # decisive at every grid point back to max_back
            assert r["locus"] is None and all(m >= theta for m in curve.values())
            continue
        d = r["distance"]
        assert all(m >= theta for dd, m in curve.items() if dd <= d)
        beyond = [m for dd, m in sorted(curve.items()) if dd > d]
        if beyond and not r["reached_trace_start"]:
            assert beyond[0] < theta
        assert r["locus"] == r["q"] - d
        if r["outcome"] == "code_token":
            assert d == 0
        if r["outcome"] == "window":
            assert d >= 1
        assert r["attributed"] == (r["outcome"] in ("window", "code_token", "censored"))


def test_locus_resumes_after_a_crash_without_redoing_notes(characterized, monkeypatch):
    """A run that crashed in the middle of the probe half resumes under its run id: the notes
    finished before the crash are not probed again."""
    import mistill.instrument.locus_pass as lp
    import mistill.stages.locus as locus_stage
    from mistill.stages.locus import run_locus

    monkeypatch.setenv("MISTILL_ROOT", str(characterized["root"]))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    cfg = _locus_config(characterized["attribute"], compare_suffixes=(), swap_layers=(0,), seed=3)
    real = lp.probe_note
    calls: list[str] = []

    def crashing(*args, **kwargs):
        calls.append(kwargs["note_id"])
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(locus_stage, "probe_note", crashing)
    with pytest.raises(KeyboardInterrupt):
        run_locus(cfg)
    crashed = MlflowClient().search_runs(
        [MlflowClient().get_experiment_by_name(f"mistill/{characterized['name']}").experiment_id],
        "tags.`mistill.stage` = 'locus' and params.seed = '3'")
    assert len(crashed) == 1 and crashed[0].info.status in ("FAILED", "KILLED")
    first_two = list(calls[:2])
    counted: list[str] = []

    def counting(*args, **kwargs):
        counted.append(kwargs["note_id"])
        return real(*args, **kwargs)

    monkeypatch.setattr(locus_stage, "probe_note", counting)
    run_id = run_locus(cfg)
    assert run_id == crashed[0].info.run_id
    assert len(counted) == 2 and not set(counted) & set(first_two)
    assert MlflowClient().get_run(run_id).info.status == "FINISHED"


def test_targets_pool_the_p1_window_over_the_prose_time_set(locus_run, characterized, monkeypatch, tmp_path):
    from mistill.stages.distill import DEVIATION_P1_WINDOW_EMISSION, TAG_DEVIATION, TargetsConfig
    from mistill.stages.workflow import run_step

    monkeypatch.setenv("MISTILL_ROOT", str(characterized["root"]))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    name = characterized["name"]
    with_locus = run_step("targets", TargetsConfig(teacher_attribute_run=characterized["attribute"],
                                                   locus_run=locus_run, split=""), name, launch="inline")
    without = run_step("targets", TargetsConfig(teacher_attribute_run=characterized["attribute"], split=""), name,
                       launch="inline")
    client = MlflowClient()
    assert TAG_DEVIATION not in client.get_run(with_locus).data.tags
    assert client.get_run(with_locus).data.tags["mistill.input.locus"] == locus_run
    assert client.get_run(without).data.tags[TAG_DEVIATION] == DEVIATION_P1_WINDOW_EMISSION
    sets = json.loads(_download(locus_run, "head_sets.json", tmp_path / "l").read_text())
    att_sets = json.loads(_download(characterized["attribute"], "head_sets.json", tmp_path / "a").read_text())
    names = [f"L{l}H{h}" for l in range(2) for h in range(4)]
    pools = json.loads(_download(with_locus, "teacher_pools.json", tmp_path / "w").read_text())
    fallback = json.loads(_download(without, "teacher_pools.json", tmp_path / "wo").read_text())
    window_key = "P1_window"
    want = [names.index(h) for h in sets["prose_time"]["ranking"][:len(pools[window_key]["heads"])]]
    assert sorted(pools[window_key]["heads"]) == sorted(want)
    emission = [names.index(h) for h in att_sets["P1"]["ranking"][:len(fallback[window_key]["heads"])]]
    assert sorted(fallback[window_key]["heads"]) == sorted(emission)
    assert np.isclose(sum(pools[window_key]["weights"]), 1.0)


def test_targets_fall_back_to_the_emission_pool_when_the_locus_run_has_no_prose_time_set(
        locus_run, characterized, monkeypatch, tmp_path):
    """A locus run none of whose mentions had a locus to attribute has no prose-time set: the
    targets pool the P1 window over the emission set, tagged as the deviation, and a Mistill
    arm trained on them inherits the tag."""
    from mistill.distill.arms import resolve_arm
    from mistill.stages.distill import (DEVIATION_P1_WINDOW_EMISSION, TAG_DEVIATION, TargetsConfig,
                                        prose_time_sets, train_deviations)
    from mistill.stages.workflow import run_step

    monkeypatch.setenv("MISTILL_ROOT", str(characterized["root"]))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    client = MlflowClient()
    sets = json.loads(_download(locus_run, "head_sets.json", tmp_path / "l").read_text())
    sets.pop("prose_time")
    source = client.get_run(locus_run)
    empty = client.create_run(source.info.experiment_id, tags={"mistill.stage": "locus"}).info.run_id
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "head_sets.json").write_text(json.dumps(sets))
    client.log_artifact(empty, str(tmp_path / "e" / "head_sets.json"))
    client.set_terminated(empty)
    assert prose_time_sets(empty) is None and prose_time_sets(locus_run) is not None
    targets = run_step("targets", TargetsConfig(teacher_attribute_run=characterized["attribute"], locus_run=empty,
                                                split=""), characterized["name"], launch="inline")
    tags = client.get_run(targets).data.tags
    assert tags[TAG_DEVIATION] == DEVIATION_P1_WINDOW_EMISSION
    assert train_deviations(resolve_arm("mistill"), {"window": 8, "locus_run": empty}, tags) \
        == (DEVIATION_P1_WINDOW_EMISSION,)
    assert train_deviations(resolve_arm("mistill"), {"window": 8, "locus_run": locus_run}, {}) == ()


def test_locus_refuses_a_run_of_another_stage(characterized, monkeypatch):
    from mistill.errors import MistillInputError
    from mistill.stages.locus import run_locus

    monkeypatch.setenv("MISTILL_ROOT", str(characterized["root"]))
    with pytest.raises(MistillInputError, match="not attribute") as err:
        run_locus(_locus_config(characterized["events"]))
    assert err.value.field == "attribute_run"


def test_report_shows_the_locus_tables_and_figure_1(locus_run, characterized, monkeypatch, tmp_path):
    from mistill.stages.report import ReportConfig, run_report

    monkeypatch.setenv("MISTILL_ROOT", str(characterized["root"]))
    report = run_report(ReportConfig(corpus=characterized["name"]))
    client = MlflowClient()
    assert client.get_run(report).info.status == "FINISHED"
    text = _download(report, "report.md", tmp_path).read_text()
    for title in ("Table 25:", "Table 26:", "Table 29:", "Table 30:", "Table 32:"):
        assert title in text, title
    arts = artifact_paths(client, report)
    assert any("figure1" in p for p in arts), sorted(arts)
