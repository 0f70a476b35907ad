"""Self-distillation's built-in check: a student that is the teacher itself (the same model, the
same tokenizer) reads out as the teacher. ``evaluate`` of one model as the ``teacher`` and as the
``untrained`` student gives the same teacher-forced readouts (M1 per phase, teacher-trace
perplexity) and the same sampled answers, note for note: the untrained student's row of the
demo's table equals the teacher's when ``-P student`` names the teacher."""

from __future__ import annotations

import pandas as pd
from mlflow.tracking import MlflowClient

from mistill.stages.evaluate import EvaluateConfig, run_evaluate
from mistill.stages.prepare import PrepareConfig, run_prepare
from stage_fixtures import TINY, unique

READOUTS = ("m1/P1/p_pos", "m1/P2/p_pos", "m1/P2C/p_pos", "m1/P1/median_margin", "m1/P2C/median_margin",
            "fidelity/ppl_median", "fidelity/bleu4_mean", "micro_f1", "valid_rate", "mean_generated_tokens")


def test_the_teacher_as_its_own_student_reads_out_as_the_teacher(tracking_uri, tmp_path, monkeypatch,
                                                                  pinned_code_version):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("selfdist"), n_notes=4, model=TINY))
    runs = {arm: run_evaluate(EvaluateConfig(prepare_run=prep, model=TINY, arm=arm, split="", max_new_tokens=6))
            for arm in ("teacher", "untrained")}
    assert runs["teacher"] != runs["untrained"]  # two runs, one per role
    client = MlflowClient()
    metrics = {arm: client.get_run(rid).data.metrics for arm, rid in runs.items()}
    present = [k for k in READOUTS if k in metrics["teacher"]]
    assert "m1/P1/p_pos" in present and "fidelity/ppl_median" in present and metrics["teacher"]["m1/P1/n"] > 0
    for key in present:
        assert metrics["untrained"][key] == metrics["teacher"][key], key
    per_note = {arm: pd.read_csv(client.download_artifacts(rid, "per_note_metrics.csv", str(tmp_path / arm)))
                for arm, rid in runs.items()}
    pd.testing.assert_frame_equal(per_note["teacher"], per_note["untrained"])  # note for note, bit for bit
