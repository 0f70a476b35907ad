"""A workflow's step: reuse an identical finished run of an entry point, or run it.

:func:`run_step` looks for a FINISHED run of the same entry point with the same typed parameters,
the same input runs and the same code version (:func:`mistill.tracking.identity.find_run`); it
reuses it when found, else runs the entry point, through ``mlflow.projects.run(...,
env_manager="local")`` (a fresh process) or in this process. The workflows that chain steps are
in :mod:`mistill.stages.workflow`.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.distributed import barrier, broadcast, current_world
from mistill.errors import MistillInputError
from mistill.io import environment_variable
from mistill.parent_watch import launching
from mistill.progress import get_logger
from mistill.stages.mlproject import _default
from mistill.stages.registry import stages
from mistill.stages.runner import preflight
from mistill.tracking import identity
from mistill.tracking.experiments import child_runs_of, experiment_for_corpus, quiet_run_links
from mistill.tracking.identity import find_run, identity_params
from mistill.tracking.naming import TAG_DELEGATED_TO, TAG_PARENT_RUN

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCHES = ("mlflow", "inline")
"""How a workflow runs its steps: ``mlflow`` (``mlflow.projects.run``, a fresh process each) or
``inline`` (the stage function in this process)."""

_log = get_logger("workflow")


def _param_strings(cfg: Config) -> dict[str, str]:
    return {k: _default(v) for k, v in cfg.to_dict().items()}


def corpus_name_of(corpus: str, corpus_name: str = "", task: str = "icd10") -> str:
    """The corpus name a ``prepare`` config will produce (the experiment is ``mistill/<name>``)."""
    if corpus_name:
        return corpus_name
    if corpus == "synthetic" and task == "catalog":
        return "catalog"
    if corpus == "synthetic":
        return "synthetic"
    if corpus.startswith("mimic:"):
        return "mimic-iv-icd10"
    return Path(corpus).stem


def run_step(stage_name: str, cfg: Config, corpus_name: str, *, launch: str = "mlflow",
             parent: str | None = None) -> str:
    """Reuse an identical finished run of ``stage_name`` or run it; returns the run id.

    launch: ``"mlflow"`` runs the entry point through ``mlflow.projects.run`` (a fresh process,
    as ``mlflow run`` would); ``"inline"`` calls the stage function in this process.
    parent: the run a new step is nested under from its start (a reused run keeps its own).

    Raises:
        MistillInputError: a required input run of the stage is empty
            (:meth:`~mistill.stages.registry.Stage.check_inputs`), before any run is looked up
            or created.
    """
    stage = stages()[stage_name]
    stage.check_inputs(cfg)  # as the command line does: a required input left empty, before any run
    experiment = experiment_for_corpus(corpus_name)
    world = current_world()
    # under a launch of several processes every rank takes the step, in this process (a
    # launched entry point would start a process group of its own from each rank); rank 0
    # decides whether a finished run is reused
    found = None
    if world.leader:
        # identity.code_version, looked up at the call: a test session pins it on the module
        found = find_run(experiment, stage_name, identity_params(cfg), identity.code_version(REPO_ROOT),
                         stage.input_runs(cfg))
    found_id = broadcast(None if found is None else found.info.run_id, world)
    if found_id is not None:
        if found is not None:
            _log.info("[%s] reusing finished run %s (%s)", stage_name, found.info.run_name, found_id)
        return found_id
    _log.info("[%s] running", stage_name)
    if world.distributed and not stage.shardable:
        raise MistillInputError(f"the step {stage_name} runs in one process; run it before the launch",
                                field=stage_name)
    with child_runs_of(parent):
        if launch == "inline" or world.distributed:
            cfg.check_environment()
            preflight(stage, cfg)
            # inside a launched entry point (`mlflow run` sets MLFLOW_RUN_ID), a step run in
            # this process opens its own run rather than adopting the launcher's
            with environment_variable("MLFLOW_RUN_ID", None):
                run_id = stage.run(cfg)
            barrier(world)  # rank 0 aggregates and ends the step's run before any rank reads it
            return run_id
        return _launch(stage_name, cfg, experiment, parent)


def _launch(stage_name: str, cfg: Config, experiment: str, parent: str | None) -> str:
    """Run the entry point through ``mlflow.projects.run`` and wait; the run that holds the work
    (the launched one, or the run it delegated to) must end FINISHED."""
    # the entry point's `python` must be this interpreter (the project's environment)
    bindir = str(Path(os.sys.executable).parent)
    if not os.environ.get("PATH", "").startswith(bindir + os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    # launching(): the step dies with this process (mistill.parent_watch)
    with quiet_run_links(), launching():  # the step's own process logs its run's line
        submitted = mlflow.projects.run(uri=str(REPO_ROOT), entry_point=stage_name,
                                        parameters=_param_strings(cfg), env_manager="local",
                                        experiment_name=experiment, synchronous=True)
    run_id = submitted.run_id
    client = MlflowClient()
    run = client.get_run(run_id)
    delegated = run.data.tags.get(TAG_DELEGATED_TO)
    if delegated:
        run_id = delegated
        run = client.get_run(run_id)
    if run.info.status != "FINISHED":
        raise MistillInputError(f"entry point {stage_name} ended {run.info.status} (run {run_id})",
                                field=stage_name)
    if parent and run.data.tags.get(TAG_PARENT_RUN) != parent:
        client.set_tag(run_id, TAG_PARENT_RUN, parent)
    return run_id


__all__ = ["REPO_ROOT", "LAUNCHES", "corpus_name_of", "run_step"]
