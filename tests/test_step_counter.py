"""The pipeline's step counter: the steps it plans are the steps it runs (the full demo's order
here; ``tests/test_stages.py`` and ``tests/test_tasks_pipeline.py`` compare the plan with the
steps real pipelines ran), and each finished step logs ``step i/N``."""

from __future__ import annotations

import logging

from mistill.stages.workflow import STEP_TAG, PipelineConfig, step_tagger

DEMO = ["prepare", "shortlist", "events", "attribute", "knockin", "locus", "read_side", "key_block", "trace_edit",
        "note_edit", "student_events", "student_attribute", "targets", "select_lambda", "train_vanilla-bf16",
        "train_mistill", "las_simulator", "evaluate_teacher", "evaluate_untrained", "evaluate_vanilla-bf16",
        "evaluate_mistill", "own_heads_untrained", "own_heads_vanilla-bf16", "own_heads_mistill", "report"]


class TagSink:
    """Collects the tags a pipeline run would get."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)


def test_the_plan_follows_the_config():
    assert PipelineConfig().step_names() == DEMO
    bare = PipelineConfig(shortlist=False, locus=False, read_side=False, own_heads=False, select_lock="",
                          train_arms=("vanilla-bf16",), report=False)
    assert bare.step_names() == ["prepare", "events", "attribute", "knockin", "student_events", "student_attribute",
                                 "targets", "train_vanilla-bf16", "las_simulator", "evaluate_teacher",
                                 "evaluate_untrained", "evaluate_vanilla-bf16"]
    assert PipelineConfig(train_arms=()).step_names()[-2:] == ["note_edit", "report"]


def test_each_finished_step_is_tagged_and_counted(caplog):
    sink = TagSink()
    on_step = step_tagger(sink, ["prepare", "events", "report"])
    with caplog.at_level(logging.INFO, logger="mistill.workflow"):
        on_step("prepare", "r1")
        on_step("events", "r2")
    assert sink.tags == {STEP_TAG + "prepare": "r1", STEP_TAG + "events": "r2"}
    lines = [r.getMessage() for r in caplog.records if "step" in r.getMessage()]
    assert lines == ["[pipeline] step 1/3 done: prepare (r1)", "[pipeline] step 2/3 done: events (r2)"]
