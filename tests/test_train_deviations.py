"""A train run that departs from the paper's procedure says so: the tag ``mistill.deviation``.

Unless a locus run (the prose-time set) is given to ``targets`` (``locus_run``), the teacher's P1
window rows are pooled over its P1 emission set; a Mistill arm that supervises them carries
``p1_window_pool=emission``. An arm without window rows, or not Mistill, does not."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from mistill.distill.arms import resolve_arm
from mistill.errors import MistillInputError
from mistill.stages.distill import (DEVIATION_P1_WINDOW_EMISSION, TAG_DEVIATION, TrainStageConfig,
                                    run_train, train_deviations)
from stage_fixtures import tiny_distill_inputs

pytestmark = pytest.mark.usefixtures("pinned_code_version")


@pytest.mark.parametrize("arm,targets,expected", [
    ("mistill", {"window": 8, "locus_run": ""}, (DEVIATION_P1_WINDOW_EMISSION,)),
    ("mistill", {}, (DEVIATION_P1_WINDOW_EMISSION,)),  # the targets' defaults: window 8, no set
    ("randpos", {"window": 8}, (DEVIATION_P1_WINDOW_EMISSION,)),
    ("no-window", {"window": 8}, ()),
    ("p2-only", {"window": 8}, ()),  # lambda_P1 = 0: no window row is supervised
    ("mistill", {"window": 0}, ()),  # targets without window rows
    ("mistill", {"window": 8, "locus_run": "0123456789abcdef0123456789abcdef"}, ()),
    ("vanilla-bf16", {"window": 8}, ()),
    ("feature-kd", {"window": 8}, ()),
])
def test_train_deviations(arm, targets, expected):
    assert train_deviations(resolve_arm(arm), targets) == expected


def test_a_targets_run_tagged_with_the_fallback_passes_it_to_its_arms():
    """Targets given a locus run whose prose-time set was empty fell back (their tag says so)."""
    locus = {"window": 8, "locus_run": "0123456789abcdef0123456789abcdef"}
    fell_back = {TAG_DEVIATION: DEVIATION_P1_WINDOW_EMISSION}
    assert train_deviations(resolve_arm("mistill"), locus, fell_back) == (DEVIATION_P1_WINDOW_EMISSION,)
    assert train_deviations(resolve_arm("no-window"), locus, fell_back) == ()
    assert train_deviations(resolve_arm("mistill"), locus, {TAG_DEVIATION: "other=code"}) == ()


def test_deviation_codes_are_stable():
    assert TAG_DEVIATION == "mistill.deviation"
    assert DEVIATION_P1_WINDOW_EMISSION == "p1_window_pool=emission"


@pytest.fixture(scope="module")
def targets_ids(tracking_uri, tmp_path_factory, pinned_code_version):
    """A characterized synthetic corpus (tiny models), the student's ranking and the teacher's
    targets without a prose-time head set."""
    return tiny_distill_inputs(tmp_path_factory.mktemp("deviations-root"), "dev")


def test_train_runs_carry_the_window_pool_deviation(targets_ids, monkeypatch, capsys):
    monkeypatch.setenv("MISTILL_ROOT", str(targets_ids["root"]))
    ids = targets_ids["ids"]
    client = MlflowClient()
    assert client.get_run(ids["targets"]).data.tags[TAG_DEVIATION] == DEVIATION_P1_WINDOW_EMISSION
    tags = {}
    for arm in ("mistill", "no-window", "vanilla-bf16"):
        run_id = run_train(TrainStageConfig(targets_run=ids["targets"], student_attribute_run=ids["student_attribute"],
                                            student="tiny:qwen3:seed=2", arm=arm, max_steps=1, grad_accum=1,
                                            register=False))
        tags[arm] = client.get_run(run_id).data.tags
    assert tags["mistill"][TAG_DEVIATION] == DEVIATION_P1_WINDOW_EMISSION
    assert TAG_DEVIATION not in tags["no-window"]
    assert TAG_DEVIATION not in tags["vanilla-bf16"]
    err = capsys.readouterr().err
    assert "train: warning:" in err and f"{TAG_DEVIATION}={DEVIATION_P1_WINDOW_EMISSION}" in err


def test_a_train_run_logs_its_generation_probe(targets_ids, monkeypatch):
    """``probe_every=1``: a probe after each optimizer step on the corpus's validation note; the
    untrained tiny student's 4-token generations are all truncated, so every probe is flagged
    and the run tagged. Without CUDA ``probe_backend=auto`` probes with HF (tagged)."""
    from mistill.evaluation.probe import PROBE_METRICS

    monkeypatch.setenv("MISTILL_ROOT", str(targets_ids["root"]))
    ids = targets_ids["ids"]
    run_id = run_train(TrainStageConfig(targets_run=ids["targets"], student="tiny:qwen3:seed=2", arm="vanilla-bf16",
                                        max_steps=2, grad_accum=1, epochs=2, register=False, probe_every=1,
                                        probe_notes=1, probe_max_new_tokens=4))
    client = MlflowClient()
    for name in PROBE_METRICS:
        history = client.get_metric_history(run_id, f"probe/{name}")
        assert sorted(m.step for m in history) == [1, 2], name
    assert {m.value for m in client.get_metric_history(run_id, "probe/truncated_rate")} == {1.0}
    assert {m.value for m in client.get_metric_history(run_id, "probe/mean_tokens")} == {4.0}
    seconds = client.get_metric_history(run_id, "probe/seconds")
    assert sorted(m.step for m in seconds) == [1, 2] and all(m.value > 0 for m in seconds)
    assert client.get_run(run_id).data.tags["mistill.probe_flagged"] == "true"
    assert client.get_run(run_id).data.tags["mistill.probe_backend"] == "hf"  # auto without CUDA
    with pytest.raises(MistillInputError, match="no .nosuch. notes"):
        run_train(TrainStageConfig(targets_run=ids["targets"], student="tiny:qwen3:seed=2", arm="vanilla-bf16",
                                   max_steps=1, grad_accum=1, register=False, probe_every=1, probe_split="nosuch"))
