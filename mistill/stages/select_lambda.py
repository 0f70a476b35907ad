"""The ``select_lambda`` entry point: pre-registered λ selection on an Optuna grid (App. I.3, I.4, M.2).

Thin: the lock (``selection.lock``), the study and its trials (``selection.grid``), liveness
(``selection.heartbeat``), the rule (``selection.decide``) and the record (``selection.report``)
live in the ``selection`` package. One run: open (or resume) the lock's study, run each grid cell
to completion once as a nested run, decide, run the outward cell when the edge rule asks for one
(it joins the grid and the rule is applied again; a further outward cell only under the
further-extension condition), decide again, log the decision (``decision.json``).

Inputs are checked before the study is opened or any cell starts (:func:`check_inputs`): each
input run given must exist, be finished and come from the stage the field names (``prepare_run``
a ``prepare`` run or a run that stands for one, ``targets_run`` a ``targets`` run,
``student_attribute_run`` an ``attribute`` run) and the student model must be there (a local
directory with its ``config.json``, a model in the local Hugging Face cache, an installed
embedded model, or a finished ``train`` run's checkpoint); with the default runner the prepare
and targets runs are required, and the student's ranking too when the lock's arm is a Mistill
arm. A failure that is the input's fault is refused naming the field, never recorded as a failed
cell.

Workers: ``workers`` cells run at once. With the default runner each worker is a spawned process
(importing and loading models from several threads at once is not safe), its torch threads
limited to its share of the CPUs; each claims cells of the same Optuna study and logs to the same
MLflow server. A custom runner (a callable that need not pickle) runs in threads of this process.

Crashes, failures and concurrency: several ``select_lambda`` processes may work on one study at
once. A process that finds a cell running in another waits for it and then reaches the same
decision; a cell whose worker died (its heartbeat older than ``grace_period``) is failed and
retried by the next process that looks, up to ``max_retry`` times. A cell whose runner raised is
failed with its reason and not run again in the same invocation; a rerun of the same lock and
study retries it, at most ``max_retries`` times per cell (the study's user attribute, default 2),
and each invocation prints one line on the cells that failed, how often, and why.

The lock's content is part of the run's identity (the param ``lock_sha256``), not only its path:

* the lock edited under the same ``study`` name (its study exists): refused before any run starts,
  naming the lock file, the sha256 the study was created under and the lock's sha256 now (a
  pre-registered lock does not change; restore it or give it another study name);
* the lock edited and given another ``study`` name, or its study deleted: a new study and a new
  ``select_lambda`` run; a finished run under the old lock is never reused for it.

The pick in the model registry: each cell's ``train`` run registers its checkpoint with the cell
alias ``<arm>-l<λ>-s<seed>`` (``mistill-l0p03-s0``; see :mod:`mistill.tracking.models`), never the
arm alias; when the decision completes, the arm alias ``<arm>-s<seed>`` (``mistill-s0``) is
pointed at the picked cell's version (tag ``mistill.selection.pick_model``; its train run:
``mistill.selection.pick_train_run``), so ``models:/<name>@mistill-s0`` is the model the rule
picked. A pipeline whose arm trains exactly as the cells did reuses the picked cell's run for the
arm; one that trains the arm again (a probe, more notes) re-points the alias at the new version
and tags the ``select_lambda`` run with it (``mistill.selection.arm_model``) and with the params
that differ (``mistill.selection.arm_retrained``).

The Optuna study: ``study.best_trial`` is the cell with the highest selection metric, **not the
pick** (the rule applies a tie band, a tie-break, the validity floor and the edge extension);
the pick is the study's user attribute ``locked_pick`` (the decision's rule, cell, trial, λs,
metric, lock sha256, ``select_lambda`` run and train run), and the study's user attribute
``use_this_trial`` says so in a sentence, where Optuna Dashboard shows it beside ``best_trial``. The run logs the study as artifacts: ``optuna/study.db``
(a SQLite copy of this study alone; not for a restricted corpus, whose guard reads no database
files) and ``optuna/trials.json`` (every trial: number, state, params, value, user attributes).
To browse it with Optuna Dashboard (not a dependency of this
project: ``pip install optuna-dashboard``)::

    mlflow artifacts download -r <select_lambda run id> -a optuna/study.db -d .
    optuna-dashboard sqlite:///study.db

or open the live storage itself, e.g. ``optuna-dashboard sqlite:///$MISTILL_ROOT/optuna/selection.db``
(the ``mistill.selection.storage`` tag names it).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow.entities import Param
from mlflow.tracking import MlflowClient

from mistill.config import Config, file_digest
from mistill.distill.arms import resolve_arm
from mistill.errors import MistillInputError
from mistill.stages.common import mistill_root
from mistill.stages.distill import EMBEDDED_STUDENT
from mistill.stages.registry import stage, stage_help
from mistill.stages.runner import preflight
from mistill.stages.steps import LAUNCHES
from mistill.tracking.models import adopt, arm_alias
from mistill.tracking.postgres import masked
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.identity import param_string, params_digest, repo_file
from mistill.tracking.runs import StageRun
from mistill.validation import (check_choice, check_device, check_model_spec, check_name, check_no_text_fields,
                                check_path, check_run_id, check_storage_url)
from selection.cells import Runner, grid_cells
from selection.decide import NO_ELIGIBLE, decide
from selection.grid import (TAG_STUDY, TrialTracking, default_storage_url, failure_summary, open_study, run_cells,
                            study_cells)
from selection.heartbeat import Heartbeat, quiet_optuna
from selection.lock import load_lock
from selection.report import cells_table, decision_metrics, decision_record, sensitivity_table
from selection.runner import TrainEvaluateRunner, lambda_overrides

if TYPE_CHECKING:
    from mistill.tracking.runs import StageRun
    from selection.decide import Decision
    from selection.grid import SelectionStudy, StudyCells
    from selection.lock import Lock

TAG_LOCK_SHA = "mistill.selection.lock_sha256"
TAG_RULE = "mistill.selection.rule"
TAG_PICK = "mistill.selection.pick"
TAG_PICK_MODEL = "mistill.selection.pick_model"
TAG_PICK_TRAIN_RUN = "mistill.selection.pick_train_run"
ATTR_LOCKED_PICK = "locked_pick"
ATTR_USE_TRIAL = "use_this_trial"
STUDY_ARTIFACT_DIR = "optuna"


@dataclass(frozen=True)
class SelectLambdaConfig(Config):
    """Select λ_P1, λ_P2 by the rule a lock file fixed before any trial.

    lock: the lock file (YAML; see ``selection.lock``).
    prepare_run, targets_run, student_attribute_run, student: what each cell's ``train`` and
        ``evaluate`` runs take.
    workers: cells run at once: worker processes with the default runner, threads with a custom
        one; more ``select_lambda`` processes may share the study.
    heartbeat_interval: seconds between heartbeats of a running cell's trial.
    grace_period: seconds without a heartbeat after which a running cell's worker counts as dead:
        its trial is failed and the cell retried (must exceed ``heartbeat_interval``).
    max_retry: retries of a cell whose worker died, after which the cell counts as failed.
    storage: the Optuna RDB URL (default ``sqlite:///$MISTILL_ROOT/optuna/selection.db``).
    corpus_name: the experiment's corpus when there is no ``prepare_run`` (custom runners).
    launch: how ``train``/``evaluate`` run: ``mlflow`` (a fresh process each) or ``inline``.
    train_gradient_checkpointing: the cells' ``train`` runs recompute the student's layers in the
        backward (``RecipeParams.gradient_checkpointing``; memory only, not part of the lock).
    """

    lock: str = "projects/configs/locks/embedded-3cell.yaml"
    prepare_run: str = ""
    targets_run: str = ""
    student_attribute_run: str = ""
    student: str = EMBEDDED_STUDENT
    device: str = "cpu"
    workers: int = 1
    storage: str = ""
    corpus_name: str = ""
    launch: str = "mlflow"
    heartbeat_interval: int = 30
    grace_period: int = 120
    max_retry: int = 3
    train_gradient_checkpointing: bool = True

    def validate(self) -> None:
        """Refuse string values of the wrong form, naming the field (numbers are the lock's and the
        study's to check)."""
        check_no_text_fields(self)
        check_path(self.lock, "lock", "a lock file (.yaml)")
        for field in ("prepare_run", "targets_run", "student_attribute_run"):
            check_run_id(getattr(self, field), field)
        check_model_spec(self.student, "student")
        check_device(self.device)
        check_storage_url(self.storage, "storage")
        check_name(self.corpus_name, "corpus_name", "the corpus", allow_empty=True)
        check_choice(self.launch, LAUNCHES, "launch")

    def content_digests(self) -> dict[str, str]:
        """``{"lock": sha256 of the lock file's bytes}`` (the only file this stage reads by path;
        a relative path found from here or, failing that, under the repository root)."""
        digest = file_digest(repo_file(self.lock))
        return {"lock": digest} if digest else {}


def _corpus(cfg: SelectLambdaConfig) -> tuple[str, str]:
    """The corpus name and privacy level: the prepare run's tags, else ``corpus_name``."""
    if cfg.prepare_run:
        tags = MlflowClient().get_run(cfg.prepare_run).data.tags
        return tags["mistill.corpus"], tags.get("mistill.privacy", "restricted")
    if not cfg.corpus_name:
        raise MistillInputError("give prepare_run (or corpus_name with a custom runner)", field="prepare_run")
    return cfg.corpus_name, "synthetic"


def study_name(cfg: SelectLambdaConfig, lock_study: str, corpus: str) -> str:
    """``<lock study>-<12 hex>``: one study per lock name and set of inputs."""
    identity = {"corpus": corpus, "prepare_run": cfg.prepare_run, "targets_run": cfg.targets_run,
                "student_attribute_run": cfg.student_attribute_run, "student": cfg.student}
    return f"{lock_study}-{params_digest(identity)[:12]}"


def run_select_lambda(cfg: SelectLambdaConfig, runner: Runner | None = None) -> str:
    """Run the selection; returns the ``select_lambda`` run id.

    runner: ``(CellRun) -> CellResult``; default :class:`selection.runner.TrainEvaluateRunner`.

    The pick is the study's ``locked_pick`` user attribute and the ``mistill.selection.pick`` tag;
    the study's ``best_trial`` is only the cell with the highest metric, not the pick.

    Raises:
        MistillInputError: a bad or changed lock, an input run or model that is missing or of the
            wrong stage (before any cell starts; names the field), or no pick because grid cells
            failed (they are logged first with a one-line summary; a second invocation skips
            completed cells and retries failed ones while they have retries left).
    """
    lock = load_lock(repo_file(cfg.lock))  # a relative lock missing here: the repository's
    heartbeat = Heartbeat(interval=cfg.heartbeat_interval, grace=cfg.grace_period, max_retry=cfg.max_retry)
    heartbeat.check()
    default_runner = runner is None
    check_inputs(cfg, lock, default_runner=default_runner)
    corpus, level = _corpus(cfg)
    name = study_name(cfg, lock.study, corpus)
    storage = cfg.storage or default_storage_url(mistill_root())
    if runner is None:
        runner = TrainEvaluateRunner(lock=lock, corpus_name=corpus, prepare_run=cfg.prepare_run,
                                     targets_run=cfg.targets_run, student_attribute_run=cfg.student_attribute_run,
                                     student=cfg.student, device=cfg.device, launch=cfg.launch,
                                     gradient_checkpointing=cfg.train_gradient_checkpointing)
        runner.check()
    # refuses a lock changed under an existing study before any run is found or started
    handle = open_study(lock, storage, name, root=mistill_root(), heartbeat=heartbeat)
    inputs = {"prepare": cfg.prepare_run, "targets": cfg.targets_run,
              "student_attribute": cfg.student_attribute_run}
    with StageRun("select_lambda", cfg, corpus=corpus, guard=PrivacyGuard([], level), model=cfg.student,
                  description=stage_help()["select_lambda"],
                  arm=lock.arm, seed=lock.training.seed, inputs=inputs, resume=True, root=mistill_root(),
                  tags={TAG_LOCK_SHA: lock.sha256, TAG_STUDY: name}) as run:
        if run.reused:
            tags = run.run.data.tags
            print(f"select_lambda: reusing finished run {run.run_id}: {tags.get(TAG_RULE)} -> {tags.get(TAG_PICK)}")
            return run.run_id
        run.set_tags({"mistill.selection.storage": masked(storage), "mistill.selection.lock_path": lock.path})
        if handle.created:  # the lock's sha256 (tag above) was fixed into a new study by this run
            run.set_tags({"mistill.selection.study_created": "true"})
        existing = run.client.get_run(run.run_id).data.params
        lock_params = {"lock.sha256": lock.sha256, "lock.arm": lock.arm,
                       "lock.grid": lock.to_dict()["grid"], "lock.training": lock.to_dict()["training"],
                       "lock.selection": lock.to_dict()["selection"], "lock.edge": lock.to_dict()["edge"]}
        run.client.log_batch(run.run_id, params=[Param(k, param_string(v)) for k, v in lock_params.items()
                                                 if k not in existing])
        tracking = TrialTracking(run.run_id, lock.selection.metric, lock.selection.tie_break_metric or "",
                                 lock.selection.validity_metric)
        reports = {"grid": run_cells(handle, lock.grid.search_space(), runner, scale=lock.grid.scale,
                                     workers=cfg.workers, tracking=tracking, processes=default_runner)}
        cells = study_cells(handle)
        decision = decide(lock, cells.results)
        while decision.pending is not None and decision.pending not in cells.running | cells.waiting:
            pending = decision.pending
            failed_here = any(pending.key in r.failed_now for r in reports.values())
            if pending in cells.failed and (failed_here or not cells.retryable(pending)):
                break  # failed in this invocation, or out of retries
            space = {axis: [value] for axis, value in pending.values}
            reports[f"extension {pending.key}"] = run_cells(handle, space, runner, scale=lock.grid.scale,
                                                            tracking=tracking)
            cells = study_cells(handle)
            decision = decide(lock, cells.results)
        run.log_json("decision.json", decision_record(lock, decision, cells, reports, study=name, storage=masked(storage),
                                                      heartbeat=heartbeat.to_dict()))
        run.log_table("cells", cells_table(lock, decision, cells))
        run.log_table("sensitivity", sensitivity_table(lock, cells))
        run.log_metrics(decision_metrics(lock, decision, cells))
        if decision.complete and decision.pick is not None:
            _record_pick(run, handle, lock, decision, cells)
        _log_study(run, handle)
        taken = [e for e in decision.extensions if e.ran]
        run.set_tags({TAG_RULE: decision.rule if decision.complete else "incomplete",
                      TAG_PICK: decision.pick.key if decision.complete else "",
                      "mistill.selection.extension": "; ".join(
                          f"{e.cell.key} {'picked' if e.picked else 'not picked'}" for e in taken) or "none"})
        for key, cell_report in reports.items():
            print(f"select_lambda [{key}]: ran {cell_report.ran}, complete before {cell_report.complete_before}, "
                  f"retried after failing {cell_report.retried}, failed now {cell_report.failed_now}, "
                  f"out of retries {cell_report.gave_up}, waited for {cell_report.running_elsewhere}, "
                  f"stale (retried) {cell_report.stale}")
        failures = failure_summary(cells)
        if failures:
            print(f"select_lambda: failed cells: {failures}")
        if decision.rule == NO_ELIGIBLE:
            why = {c.key: reason for c, reason in decision.ineligible.items()}
            raise MistillInputError(f"no pick: no grid cell is eligible under the validity floor {why} (see "
                                    f"decision.json of run {run.run_id})", file=lock.path,
                                    field="selection.validity_floor")
        if not decision.complete:
            unresolved = {c.key: cells.failed.get(c, "running" if c in cells.running else
                                                  "queued for retry" if c in cells.waiting else "not run")
                          for c in (*decision.missing, *([decision.pending] if decision.pending else []))}
            raise MistillInputError(f"no pick: cells without a result {unresolved}; failed cells: "
                                    f"{failures or 'none'} (a rerun retries a failed cell at most "
                                    f"{cells.max_retries} times; see decision.json of run {run.run_id})",
                                    file=lock.path, field="grid")
        print(f"select_lambda: {decision.rule} -> {decision.pick.key} (run {run.run_id})")
        return run.run_id


def check_inputs(cfg: SelectLambdaConfig, lock: Lock, *, default_runner: bool) -> None:
    """Refuse, before the study is opened or any cell starts, the inputs every cell would fail on:
    an input run that is missing, unfinished or of another stage, a student model or lock file
    that is not there (:func:`~mistill.stages.runner.preflight`); with the default runner also a
    required input run left empty (``student_attribute_run`` when the lock's arm is a Mistill arm).

    Raises:
        MistillInputError: names the field.
    """
    entry = stage("select_lambda")
    if default_runner:
        entry.check_inputs(cfg)
        first = grid_cells(lock.grid)[0]
        if resolve_arm(lock.arm, lambda_overrides(*first.lambdas)).objective == "mistill" \
                and not cfg.student_attribute_run:
            raise MistillInputError(f"student_attribute_run is required: the lock's arm {lock.arm!r} needs the "
                                    f"student's calibrated ranking ({entry.input_description('student_attribute')})",
                                    field="student_attribute_run")
    preflight(entry, cfg)


def locked_pick(lock: Lock, decision: Decision, cells: StudyCells, run_id: str) -> dict[str, Any]:
    """The study's ``locked_pick`` user attribute: the rule, the picked cell and its λs, its
    selection metric (and tie-break, validity), the lock's sha256 and the ``select_lambda`` run."""
    res = cells.results[decision.pick]
    p1, p2 = decision.pick.lambdas
    out = {"cell": decision.pick.key, "lambda_p1": p1, "lambda_p2": p2, "rule": decision.rule,
           "metric": lock.selection.metric, "value": res.metric, "lock_sha256": lock.sha256,
           "select_lambda_run": run_id, "train_run": res.run_ids.get("train")}
    if math.isfinite(res.tie_break):
        out["tie_break"] = res.tie_break
    if math.isfinite(res.validity):
        out["validity"] = res.validity
    return out


def _record_pick(run: StageRun, handle: SelectionStudy, lock: Lock, decision: Decision, cells: StudyCells) -> None:
    """The pick into the study (``locked_pick``) and the registry: the arm alias on the picked
    cell's model version, when its train run registered one."""
    summary = locked_pick(lock, decision, cells, run.run_id)
    complete = [t["number"] for t in cells.trials.get(decision.pick, []) if t["state"] == "COMPLETE"]
    if complete:
        summary["trial"] = complete[-1]
    handle.storage.set_study_user_attr(handle.study_id, ATTR_LOCKED_PICK, summary)
    # Optuna's own best_trial is the first trial with the highest value: ties within the lock's band
    # are the locked rule's to break, so the study says which trial to read
    handle.storage.set_study_user_attr(handle.study_id, ATTR_USE_TRIAL, (
        f"trial {summary.get('trial', '?')} (cell {summary['cell']}): the pick of the locked rule "
        f"{summary['rule']!r}; Optuna's best_trial is only the first trial with the highest "
        f"{summary['metric']}, ties unbroken; read user_attrs['{ATTR_LOCKED_PICK}']"))
    train_run = summary["train_run"]
    if not train_run:
        return
    alias = arm_alias(lock.arm, lock.training.seed)
    adopted = adopt(run.client, train_run, alias)
    if adopted is not None:
        name, version = adopted
        run.set_tags({TAG_PICK_MODEL: f"models:/{name}/{version}", "mistill.selection.pick_alias": alias,
                      TAG_PICK_TRAIN_RUN: train_run})
        print(f"select_lambda: alias {alias} -> models:/{name}/{version} (train run {train_run})")


def _log_study(run: StageRun, handle: SelectionStudy) -> None:
    """Log the study as ``optuna/trials.json`` and, unless the corpus is restricted (the guard
    cannot read a database file), ``optuna/study.db``: a SQLite copy holding this study alone,
    whatever the storage."""
    import optuna  # deferred: Optuna is slow to import

    with tempfile.TemporaryDirectory(prefix="mistill-study-") as tmp:
        folder = Path(tmp) / STUDY_ARTIFACT_DIR
        folder.mkdir()
        if run.guard.allows_text:
            copy = optuna.storages.RDBStorage(f"sqlite:///{folder / 'study.db'}")
            try:
                with quiet_optuna():
                    optuna.copy_study(from_study_name=handle.name, from_storage=handle.storage, to_storage=copy)
            finally:
                copy.engine.dispose()
        study = handle.load()
        trials = [{"number": t.number, "state": t.state.name, "params": t.params, "value": t.value,
                   "user_attrs": t.user_attrs} for t in study.get_trials(deepcopy=False)]
        (folder / "trials.json").write_text(json.dumps({"study": handle.name, "user_attrs": study.user_attrs,
                                                        "trials": trials}, indent=1, default=str))
        run.log_artifact_file(folder, STUDY_ARTIFACT_DIR)
