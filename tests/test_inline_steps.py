"""A step run in-process inside a launched entry point opens its own run.

``mlflow run`` hands the process it launches a run through ``MLFLOW_RUN_ID``; a stage adopts that
run. The pipeline (and ``own_heads``) with ``launch=inline`` run their steps in that same process,
so each step must open its own run instead of adopting the launcher's, and the launcher's run id
must be back in the environment afterwards.
"""

from __future__ import annotations

import os

import pytest
from mlflow.tracking import MlflowClient

from mistill.io import environment_variable
from mistill.stages.prepare import PrepareConfig
from mistill.stages.workflow import run_step
from mistill.tracking.experiments import experiment_for_corpus
from stage_fixtures import TINY, unique

pytestmark = pytest.mark.usefixtures("pinned_code_version")


def test_inline_step_under_a_launched_run_opens_its_own(tracking_uri):
    client = MlflowClient()
    name = unique("inline")
    experiment = client.get_experiment_by_name(experiment_for_corpus(name))
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_for_corpus(name))
    launcher = client.create_run(experiment_id).info.run_id
    cfg = PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=4, model=TINY)
    with environment_variable("MLFLOW_RUN_ID", launcher):
        step = run_step("prepare", cfg, name, launch="inline")
        assert os.environ["MLFLOW_RUN_ID"] == launcher
    assert step != launcher
    assert client.get_run(step).data.tags.get("mistill.stage") == "prepare"
    # the launcher's run was left as it was: running, and holding no stage's work
    launched = client.get_run(launcher)
    assert launched.info.status == "RUNNING"
    assert "mistill.stage" not in launched.data.tags


def test_environment_variable_unsets_and_restores():
    key = "MISTILL_TEST_ENV_UNSET"
    os.environ[key] = "kept"
    try:
        with environment_variable(key, None):
            assert key not in os.environ
        assert os.environ[key] == "kept"
    finally:
        os.environ.pop(key, None)
