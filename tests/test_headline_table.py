"""The pipeline's headline table (:func:`mistill.stages.workflow.headline_table`) on runs of the
real test MLflow server: each column reads its own metric of the right run, absent runs and
metrics show as ``-``, and the heading says which columns are meaningful at the runs' size."""

from __future__ import annotations

import re

import pytest
from mlflow.tracking import MlflowClient
from stage_fixtures import unique

from mistill.stages.workflow import headline_table

DECOYS = {
    "evaluate": {"m1/P1/median_margin": 9.01, "m1/P1/n": 9.02, "macro_f1": 9.03, "cap_rate": 9.04,
                 "m1/NULL/p_pos": 9.05},
    "own_heads": {"m4/P1/k40/recovery_own": 9.11, "m4/P2C/k8/recovery_own": 9.12,
                  "own/m4/P1/k8/recovery_own": 9.13, "m4/P1/k40/recovery_random": 9.14,
                  "own/m4/P1/k8/recovery_random": 9.15},
    "knockin": {"P2C/k8/recovery/global": 9.21, "P1/k40/recovery/global": 9.22,
                "P1/k8/necessity/global": 9.23, "P1/k8/recovery/bottom": 9.24,
                "P1/k40/recovery/random": 9.25},
}
"""Metrics near the right ones in name, at values no column may show."""


def _run(client: MlflowClient, exp: str, metrics: dict[str, float], tags: dict[str, str] | None = None) -> str:
    run = client.create_run(exp, tags=tags)
    for key, value in metrics.items():
        client.log_metric(run.info.run_id, key, value)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def _evaluate(base: float, n_notes: int, skip: str = "") -> dict[str, float]:
    m = {"m1/P1/p_pos": base + 0.001, "m1/P2/p_pos": base + 0.002, "m1/P2C/p_pos": base + 0.003,
         "micro_f1": base + 0.004, "valid_rate": base + 0.005, "n_notes": float(n_notes),
         **DECOYS["evaluate"]}
    m.pop(skip, None)
    return m


def _own(base: float, n_gated: float = 12.0, n_notes: float = 3.0) -> dict[str, float]:
    return {"m4/P1/k8/recovery_own": base + 0.006, "m4/P1/k8/recovery_random": base + 0.007,
            "m4/P1/k8/n_gated": n_gated, "m4/P1/k8/n_notes": n_notes,
            "m4/P1/k8/recovery_random_floor_mean": base + 0.008, "m4/P1/k8/recovery_random_floor_sd": 0.011,
            "m4/P1/k8/recovery_random_floor_draws": 5.0, **DECOYS["own_heads"]}


def _run_set(tracking_uri: str, *, test_notes: int, steps: int, train_notes: int) -> dict[str, str]:
    client = MlflowClient(tracking_uri)
    exp = client.create_experiment(unique("headline"))
    ids = {"knockin": _run(client, exp, {"P1/k8/recovery/global": 0.106, "P1/k8/recovery/random": 0.107,
                                         "P1/k8/n_gated": 40.0, "P1/k8/n_notes": 4.0,
                                         "P1/k8/recovery/random_floor_mean": 0.108,
                                         "P1/k8/recovery/random_floor_sd": 0.012,
                                         "P1/k8/recovery/random_floor_draws": 5.0, **DECOYS["knockin"]})}
    for arm in ("vanilla-bf16", "mistill"):
        ids[f"train_{arm}"] = _run(client, exp, {"train/steps": float(steps),
                                                 "n_notes": float(train_notes), "train/loss": 9.3})
    ids["evaluate_teacher"] = _run(client, exp, _evaluate(0.1, test_notes), {"mistill.backend": "vllm"})
    ids["evaluate_untrained"] = _run(client, exp, _evaluate(0.2, test_notes), {"mistill.backend": "hf"})
    ids["evaluate_vanilla-bf16"] = _run(client, exp, _evaluate(0.3, test_notes, skip="m1/P2/p_pos"))
    ids["evaluate_mistill"] = _run(client, exp, _evaluate(0.4, test_notes))
    ids["own_heads_untrained"] = _run(client, exp, _own(0.2))
    ids["own_heads_vanilla-bf16"] = _run(client, exp, _own(0.3, n_gated=4.0, n_notes=1.0))  # below the minimum
    ids["own_heads_mistill"] = "0" * 32  # a run the store does not have
    return ids


def _rows(text: str) -> dict[str, list[str]]:
    out = {}
    for line in text.splitlines()[1:]:
        for label in ("model", "teacher", "untrained student", "vanilla-bf16", "mistill"):
            if line.startswith(f"  {label} "):
                out[label] = re.split(r"\s{2,}", line[len(label) + 2:].strip())
    return out


def test_each_column_reads_its_metric_and_missing_shows_as_dash(tracking_uri):
    text = headline_table(_run_set(tracking_uri, test_notes=8, steps=2, train_notes=8))
    rows = _rows(text)
    assert list(rows) == ["model", "teacher", "untrained student", "vanilla-bf16", "mistill"]
    # M1 P1, P2, P2C, recovery own [support], recovery random, the floor over draws, micro-F1,
    # valid rate, the backend that sampled
    assert rows["teacher"] == ["0.101", "0.102", "0.103", "0.106 [40 ev / 4 notes]", "0.107",
                               "0.108 ± 0.012 (5 draws)", "0.104", "0.105", "vllm"]
    assert rows["untrained student"] == ["0.201", "0.202", "0.203", "0.206 [12 ev / 3 notes]", "0.207",
                                         "0.208 ± 0.011 (5 draws)", "0.204", "0.205", "hf"]
    assert rows["vanilla-bf16"] == ["0.301", "-", "0.303", "n too small [4 ev / 1 note]", "n too small",
                                    "0.308 ± 0.011 (5 draws)", "0.304", "0.305", "-"]
    assert rows["mistill"] == ["0.401", "0.402", "0.403", "-", "-", "-", "0.404", "0.405", "-"]
    assert "9." not in text  # no near-named metric shown


def test_heading_marks_what_is_meaningful_at_this_size(tracking_uri):
    small = headline_table(_run_set(tracking_uri, test_notes=8, steps=2, train_notes=8))
    heading = small.splitlines()[0]
    assert ("MEANINGFUL at this size (measured per event): M1 P1/P2/P2C. rec own vs rec random: meaningful "
            "only for teacher, untrained student; n too small for vanilla-bf16 (a cell needs at least 10 gated "
            "events from 3 notes). NOT MEANINGFUL at this size: micro-F1, valid (arms trained for 2 optimiser "
            "steps on 8 notes, scored on 8 test notes)") in heading
    clear = headline_table({k: v for k, v in _run_set(tracking_uri, test_notes=8, steps=2, train_notes=8).items()
                            if not k.startswith(("evaluate_vanilla", "evaluate_mistill", "train_"))})
    assert "MEANINGFUL at this size (measured per event): M1 P1/P2/P2C, rec own vs rec random." in \
        clear.splitlines()[0]
    # the minimum is a parameter
    lower = headline_table(_run_set(tracking_uri, test_notes=8, steps=2, train_notes=8), min_events=4, min_notes=1)
    assert "M1 P1/P2/P2C, rec own vs rec random." in lower.splitlines()[0]
    assert _rows(lower)["vanilla-bf16"][3] == "0.306 [4 ev / 1 note]"
    large = headline_table(_run_set(tracking_uri, test_notes=500, steps=2000, train_notes=3000))
    heading = large.splitlines()[0]
    assert "MEANINGFUL" not in heading
    assert "rec own vs rec random: meaningful only for teacher, untrained student; n too small for vanilla-bf16" \
        in heading
    assert "arms trained for 2000 optimiser steps on 3000 notes, scored on 500 test notes" in heading


def test_no_runs_at_all_gives_dashes(tracking_uri):
    text = headline_table({})
    rows = _rows(text)
    assert rows["teacher"] == ["-"] * 9 and rows["untrained student"] == ["-"] * 9
    assert "vanilla-bf16" not in rows


@pytest.mark.parametrize("steps,notes,small", [(99, 500, True), (100, 500, False),
                                               (2000, 29, True), (2000, 30, False)])
def test_thresholds(tracking_uri, steps, notes, small):
    heading = headline_table(_run_set(tracking_uri, test_notes=notes, steps=steps,
                                      train_notes=100)).splitlines()[0]
    assert ("NOT MEANINGFUL at this size" in heading) is small
