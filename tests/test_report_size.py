"""The report's "Reading these numbers at this size" section: present when the task table rests
on few test notes or the arms trained for few steps, with those numbers; absent otherwise. On
hand-built runs of the real test MLflow server."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_fixtures import STUDENT, TEACHER, eval_metrics, make_run
from mlflow.tracking import MlflowClient
from stage_fixtures import unique

from analysis.report import (
    MIN_TEST_NOTES,
    MIN_TRAIN_STEPS,
    EvidenceSize,
    build_report,
    collect_inputs,
)

pytestmark = pytest.mark.usefixtures("pinned_code_version")

HEADING = "## Reading these numbers at this size"


def _per_note(n_notes: int, offset: float) -> pd.DataFrame:
    f1 = np.round(np.linspace(0.1, 0.6, n_notes) + offset, 3)
    return pd.DataFrame({"note_id": [f"t{i:03d}" for i in range(n_notes)], "micro_f1": f1,
                         "tp": 2, "fp": 1, "fn": 2, "valid": True})


def _report(tracking_uri: str, root, *, test_notes: int, steps: int, train_notes: int) -> str:
    corpus = unique("size")
    train = {arm: make_run(tracking_uri, corpus, "train", root, arm=arm, seed=0, precision="bf16",
                           metrics={"train/steps": float(steps), "n_notes": float(train_notes)})
             for arm in ("vanilla-bf16", "mistill")}
    # a train run no evaluate run names: its steps are not the arms' of the task table
    make_run(tracking_uri, corpus, "train", root, arm="top8", seed=0, precision="bf16",
             metrics={"train/steps": 1.0, "n_notes": 1.0})
    for offset, arm in enumerate(("teacher", "untrained", "vanilla-bf16", "mistill")):
        make_run(tracking_uri, corpus, "evaluate", root, arm=arm, seed=0, precision="bf16",
                 model=TEACHER if arm == "teacher" else STUDENT,
                 inputs={"train": train[arm]} if arm in train else None,
                 metrics={**eval_metrics("teacher" if arm == "teacher" else "untrained", 0),
                          "n_notes": float(test_notes)},
                 tables={"per_note_metrics": _per_note(test_notes, 0.05 * offset)},
                 tags={"mistill.split": "test"})
    inputs = collect_inputs(MlflowClient(), f"mistill/{corpus}", reference_arm="vanilla-bf16")
    return build_report(inputs, reference_arm="vanilla-bf16", n_resamples=20,
                        corpus_resamples=20).markdown()


@pytest.fixture
def reader_root(tmp_path, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "reader"))


def _section(text: str) -> str:
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    return text[start:end if end >= 0 else None]


def test_small_runs_get_the_section_with_their_numbers(tracking_uri, tmp_path, reader_root):
    text = _report(tracking_uri, tmp_path, test_notes=12, steps=2, train_notes=8)
    section = _section(text)
    # before the tables it qualifies
    assert text.index(HEADING) < text.index("## Table 2")
    assert "arms trained for 2 optimiser steps on 8 notes, scored on 12 test notes" in section
    assert "**Meaningful at this size:** teacher-forced M1" in section
    assert "knock-in recovery of the global sets against count-matched random sets" in section
    assert "own-heads readouts" in section.split("**Not meaningful")[0]
    assert "**Not meaningful at this size:** task micro-F1, validity and fidelity" in section
    assert "1 optimiser step" not in section  # the unnamed train run is not an arm of the table


def test_many_notes_but_few_steps_still_get_the_section(tracking_uri, tmp_path, reader_root):
    section = _section(_report(tracking_uri, tmp_path, test_notes=MIN_TEST_NOTES,
                               steps=MIN_TRAIN_STEPS - 1, train_notes=500))
    assert (f"arms trained for {MIN_TRAIN_STEPS - 1} optimiser steps on 500 notes, scored on "
            f"{MIN_TEST_NOTES} test notes") in section


def test_large_runs_get_no_section(tracking_uri, tmp_path, reader_root):
    text = _report(tracking_uri, tmp_path, test_notes=MIN_TEST_NOTES, steps=MIN_TRAIN_STEPS,
                   train_notes=500)
    assert HEADING not in text and "## Table 2" in text


def test_evidence_size_thresholds_and_wording():
    assert EvidenceSize(MIN_TEST_NOTES - 1).small and not EvidenceSize(MIN_TEST_NOTES).small
    assert EvidenceSize(None, (MIN_TRAIN_STEPS - 1, 5000)).small
    assert not EvidenceSize(None, (MIN_TRAIN_STEPS, 5000)).small
    assert not EvidenceSize().small and EvidenceSize().section() == []
    assert EvidenceSize(1, (2, 40), (8,)).task_basis() == \
        "arms trained for 2 to 40 optimiser steps on 8 notes, scored on 1 test note"
    assert EvidenceSize(12).task_basis() == "scored on 12 test notes"
