"""The ``select_lambda`` entry point: pre-registered λ selection on an Optuna grid (App. I.3, I.4, M.2).

Thin: the lock (``selection.lock``), the study and its trials (``selection.grid``), liveness
(``selection.heartbeat``), the rule (``selection.decide``) and the record (``selection.report``)
live in the ``selection`` package. One run: open (or resume) the lock's study, run each grid cell
to completion once as a nested run, decide, run the outward cell when the edge rule asks for one
(it joins the grid and the rule is applied again; a further outward cell only under the
further-extension condition), decide again, log the decision (``decision.json``).

Crashes and concurrency: several ``select_lambda`` processes may work on one study at once. A
process that finds a cell running in another waits for it and then reaches the same decision;
a cell whose worker died (its heartbeat older than ``grace_period``) is failed and retried by the
next process that looks, up to ``max_retry`` times. A cell whose runner raised stays failed.

The lock's content is part of the run's identity (the param ``lock_sha256``), not only its path:

* the lock edited under the same ``study`` name (its study exists): refused before any run starts,
  naming the lock file, the sha256 the study was created under and the lock's sha256 now (a
  pre-registered lock does not change; restore it or give it another study name);
* the lock edited and given another ``study`` name, or its study deleted: a new study and a new
  ``select_lambda`` run; a finished run under the old lock is never reused for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mistill.config import Config, file_digest
from mistill.errors import MistillInputError
from mistill.stages.distill import EMBEDDED_STUDENT
from selection.cells import Runner

TAG_LOCK_SHA = "mistill.selection.lock_sha256"
TAG_RULE = "mistill.selection.rule"
TAG_PICK = "mistill.selection.pick"


@dataclass(frozen=True)
class SelectLambdaConfig(Config):
    """Select λ_P1, λ_P2 by the rule a lock file fixed before any trial.

    lock: the lock file (YAML; see ``selection.lock``).
    prepare_run, targets_run, student_attribute_run, student: what each cell's ``train`` and
        ``evaluate`` runs take.
    workers: cells run at once in this process (threads); more processes may share the study.
    heartbeat_interval: seconds between heartbeats of a running cell's trial.
    grace_period: seconds without a heartbeat after which a running cell's worker counts as dead:
        its trial is failed and the cell retried (must exceed ``heartbeat_interval``).
    max_retry: retries of a cell whose worker died, after which the cell counts as failed.
    storage: the Optuna RDB URL (default ``sqlite:///$MISTILL_ROOT/optuna/selection.db``).
    corpus_name: the experiment's corpus when there is no ``prepare_run`` (custom runners).
    launch: how ``train``/``evaluate`` run: ``mlflow`` (a fresh process each) or ``inline``.
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

    def validate(self) -> None:
        """Refuse string values of the wrong form, naming the field (numbers are the lock's and the
        study's to check)."""
        from mistill.stages.workflow import LAUNCHES
        from mistill.validation import (check_choice, check_device, check_model_spec, check_name,
                                        check_no_text_fields, check_path, check_run_id, check_storage_url)

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
        """``{"lock": sha256 of the lock file's bytes}`` (the only file this stage reads by path)."""
        digest = file_digest(self.lock)
        return {"lock": digest} if digest else {}


def _corpus(cfg: SelectLambdaConfig) -> tuple[str, str]:
    """The corpus name and privacy level: the prepare run's tags, else ``corpus_name``."""
    if cfg.prepare_run:
        from mlflow.tracking import MlflowClient

        tags = MlflowClient().get_run(cfg.prepare_run).data.tags
        return tags["mistill.corpus"], tags.get("mistill.privacy", "restricted")
    if not cfg.corpus_name:
        raise MistillInputError("give prepare_run (or corpus_name with a custom runner)", field="prepare_run")
    return cfg.corpus_name, "synthetic"


def study_name(cfg: SelectLambdaConfig, lock_study: str, corpus: str) -> str:
    """``<lock study>-<12 hex>``: one study per lock name and set of inputs."""
    from mistill.tracking.runs import params_digest

    identity = {"corpus": corpus, "prepare_run": cfg.prepare_run, "targets_run": cfg.targets_run,
                "student_attribute_run": cfg.student_attribute_run, "student": cfg.student}
    return f"{lock_study}-{params_digest(identity)[:12]}"


def run_select_lambda(cfg: SelectLambdaConfig, runner: Runner | None = None) -> str:
    """Run the selection; returns the ``select_lambda`` run id.

    runner: ``(CellRun) -> CellResult``; default :class:`selection.runner.TrainEvaluateRunner`.

    Raises:
        MistillInputError: a bad or changed lock, or no pick because grid cells failed (they are
            logged first; a second invocation skips completed cells and reports failed ones).
    """
    from mlflow.entities import Param

    from mistill.stages.common import mistill_root
    from mistill.tracking.privacy import PrivacyGuard
    from mistill.tracking.runs import StageRun, param_string
    from selection.decide import NO_ELIGIBLE, decide
    from selection.grid import (
        TAG_STUDY,
        TrialTracking,
        default_storage_url,
        open_study,
        run_cells,
        study_cells,
    )
    from selection.heartbeat import Heartbeat
    from selection.lock import load_lock
    from selection.report import (
        cells_table,
        decision_metrics,
        decision_record,
        sensitivity_table,
    )
    from selection.runner import TrainEvaluateRunner

    lock = load_lock(cfg.lock)
    heartbeat = Heartbeat(interval=cfg.heartbeat_interval, grace=cfg.grace_period, max_retry=cfg.max_retry)
    heartbeat.check()
    corpus, level = _corpus(cfg)
    name = study_name(cfg, lock.study, corpus)
    storage = cfg.storage or default_storage_url(mistill_root())
    if runner is None:
        runner = TrainEvaluateRunner(lock=lock, corpus_name=corpus, prepare_run=cfg.prepare_run,
                                     targets_run=cfg.targets_run, student_attribute_run=cfg.student_attribute_run,
                                     student=cfg.student, device=cfg.device, launch=cfg.launch)
        runner.check()
    # refuses a lock changed under an existing study before any run is found or started
    handle = open_study(lock, storage, name, root=mistill_root(), heartbeat=heartbeat)
    inputs = {"prepare": cfg.prepare_run, "targets": cfg.targets_run,
              "student_attribute": cfg.student_attribute_run}
    with StageRun("select_lambda", cfg, corpus=corpus, guard=PrivacyGuard([], level), model=cfg.student,
                  arm=lock.arm, seed=lock.training.seed, inputs=inputs, resume=True, root=mistill_root(),
                  tags={TAG_LOCK_SHA: lock.sha256, TAG_STUDY: name}) as run:
        if run.reused:
            tags = run.run.data.tags
            print(f"select_lambda: reusing finished run {run.run_id}: {tags.get(TAG_RULE)} -> {tags.get(TAG_PICK)}")
            return run.run_id
        run.set_tags({"mistill.selection.storage": storage, "mistill.selection.lock_path": lock.path})
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
                                     workers=cfg.workers, tracking=tracking)}
        cells = study_cells(handle)
        decision = decide(lock, cells.results)
        while decision.pending is not None and decision.pending not in cells.failed \
                and decision.pending not in cells.running | cells.waiting:
            space = {axis: [value] for axis, value in decision.pending.values}
            reports[f"extension {decision.pending.key}"] = run_cells(handle, space, runner, scale=lock.grid.scale,
                                                                     tracking=tracking)
            cells = study_cells(handle)
            decision = decide(lock, cells.results)
        run.log_json("decision.json", decision_record(lock, decision, cells, reports, study=name, storage=storage,
                                                      heartbeat=heartbeat.to_dict()))
        run.log_table("cells", cells_table(lock, decision, cells))
        run.log_table("sensitivity", sensitivity_table(lock, cells))
        run.log_metrics(decision_metrics(lock, decision, cells))
        taken = [e for e in decision.extensions if e.ran]
        run.set_tags({TAG_RULE: decision.rule if decision.complete else "incomplete",
                      TAG_PICK: decision.pick.key if decision.complete else "",
                      "mistill.selection.extension": "; ".join(
                          f"{e.cell.key} {'picked' if e.picked else 'not picked'}" for e in taken) or "none"})
        for key, cell_report in reports.items():
            print(f"select_lambda [{key}]: ran {cell_report.ran}, complete before {cell_report.complete_before}, "
                  f"failed {dict(cell_report.failed_before, **cell_report.failed_now)}, "
                  f"waited for {cell_report.running_elsewhere}, stale (retried) {cell_report.stale}")
        if decision.rule == NO_ELIGIBLE:
            why = {c.key: reason for c, reason in decision.ineligible.items()}
            raise MistillInputError(f"no pick: no grid cell is eligible under the validity floor {why} (see "
                                    f"decision.json of run {run.run_id})", file=lock.path,
                                    field="selection.validity_floor")
        if not decision.complete:
            unresolved = {c.key: cells.failed.get(c, "running" if c in cells.running else
                                                  "queued for retry" if c in cells.waiting else "not run")
                          for c in (*decision.missing, *([decision.pending] if decision.pending else []))}
            raise MistillInputError(f"no pick: cells without a result {unresolved} (cells whose runner failed "
                                    f"are not retried; see decision.json of run {run.run_id})", file=lock.path,
                                    field="grid")
        print(f"select_lambda: {decision.rule} -> {decision.pick.key} (run {run.run_id})")
        return run.run_id
