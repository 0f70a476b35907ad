"""The adapter boundary is real: every step of the demo's pipeline runs unchanged on a second label
space, the embedded parts catalogue (``-P task=catalog``), with tiny random models."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from mistill.stages.workflow import PipelineConfig, pipeline_steps
from stage_fixtures import REPO, TINY, unique

pytestmark = pytest.mark.usefixtures("pinned_code_version")

DEMO_STEPS = ("prepare", "shortlist", "events", "attribute", "knockin", "locus", "read_side", "key_block",
              "trace_edit", "note_edit", "student_events", "student_attribute", "targets", "select_lambda",
              "train_vanilla-bf16", "train_mistill", "las_simulator", "evaluate_teacher", "evaluate_untrained",
              "evaluate_vanilla-bf16", "evaluate_mistill", "own_heads_untrained", "own_heads_vanilla-bf16",
              "own_heads_mistill", "report")


def test_every_pipeline_step_runs_on_the_parts_catalogue(tracking_uri, tmp_path, monkeypatch):
    from mistill.stages.common import load_prepared

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    name = unique("catalog")
    # the λ selection as small as a run of every step needs: two grid cells (the pick is on an
    # edge, so the outward cell runs too), one training step, short generations
    lock = tmp_path / "lock.yaml"
    lock.write_text((REPO / "projects/configs/locks/embedded-3cell.yaml").read_text()
                    .replace("study: embedded-3cell", f"study: {unique('study')}")
                    .replace("max_steps: 2", "max_steps: 1").replace("max_new_tokens: 32", "max_new_tokens: 8")
                    .replace("lambda: [0.03, 0.1, 0.3]", "lambda: [0.03, 0.1]"))
    cfg = PipelineConfig(corpus="synthetic", task="catalog", corpus_name=name, n_notes=4, codes_per_note=(3, 4),
                         model=TINY, student="tiny:qwen3:seed=2:d_model=8", las_model=TINY, launch="inline",
                         n_null=4, selftest_events=0, k_bins=(3, 8), events_per_phase=3, stability_splits=5,
                         select_lock=str(lock), train_max_steps=1, eval_max_new_tokens=8, las_max_steps=1)
    ids = pipeline_steps(cfg)
    assert tuple(ids) == DEMO_STEPS
    client = MlflowClient()
    runs = {step: client.get_run(run_id) for step, run_id in ids.items()}
    assert {step: r.info.status for step, r in runs.items()} == {step: "FINISHED" for step in DEMO_STEPS}

    prepared = load_prepared(ids["shortlist"])
    inventory = prepared.corpus.inventory
    assert inventory.task == "catalog" and all("-" in code for code in inventory.codes)
    assert all(set(n.gold_codes) <= set(inventory.codes) for n in prepared.corpus.notes)

    # the teacher's events: every kind, found by the catalogue's naming rule on part numbers
    events = runs["events"].data.metrics
    for kind in ("P1", "P2", "P2C", "NULL"):
        assert events[f"events/{kind}/realized"] > 0, kind
    assert runs["locus"].data.metrics["locus/n_mentions"] > 0  # family letters probed like chapters
    for step in ("evaluate_teacher", "evaluate_mistill"):
        m = runs[step].data.metrics
        assert "micro_f1" in m and m["m1/P2C/n"] > 0, step
    assert runs["report"].data.metrics["n_tables"] > 0
