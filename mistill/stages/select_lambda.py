"""The ``select_lambda`` entry point: pre-registered λ selection on an Optuna grid (App. I.3, I.4, M.2).

Thin: the lock (``selection.lock``), the study and its trials (``selection.grid``), the rule
(``selection.decide``) and the record (``selection.report``) live in the ``selection`` package.
One run: open (or resume) the lock's study, run each unclaimed grid cell once as a nested run,
decide, run the outward cell when the edge rule asks for one, decide again, log the decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from mistill.config import Config
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
    from selection.decide import decide
    from selection.grid import (
        TAG_STUDY,
        TrialTracking,
        default_storage_url,
        open_study,
        run_cells,
        study_cells,
    )
    from selection.lock import load_lock
    from selection.report import (
        cells_table,
        decision_metrics,
        decision_record,
        sensitivity_table,
    )
    from selection.runner import TrainEvaluateRunner

    lock = load_lock(cfg.lock)
    corpus, level = _corpus(cfg)
    name = study_name(cfg, lock.study, corpus)
    storage = cfg.storage or default_storage_url(mistill_root())
    if runner is None:
        runner = TrainEvaluateRunner(lock=lock, corpus_name=corpus, prepare_run=cfg.prepare_run,
                                     targets_run=cfg.targets_run, student_attribute_run=cfg.student_attribute_run,
                                     student=cfg.student, device=cfg.device, launch=cfg.launch)
        runner.check()
    handle = open_study(lock, storage, name, root=mistill_root())  # refuses a changed lock, even before reuse
    inputs = {"prepare": cfg.prepare_run, "targets": cfg.targets_run,
              "student_attribute": cfg.student_attribute_run}
    with StageRun("select_lambda", cfg, corpus=corpus, guard=PrivacyGuard([], level), model=cfg.student,
                  arm=lock.arm, seed=lock.training.seed, inputs=inputs, resume=True, root=mistill_root(),
                  tags={TAG_LOCK_SHA: lock.sha256, TAG_STUDY: name}) as run:
        if run.reused:
            print(f"select_lambda: reusing finished run {run.run_id}")
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
        tracking = TrialTracking(run.run_id, lock.selection.metric, lock.selection.tie_break)
        reports = {"grid": run_cells(handle, lock.grid.search_space(), runner, scale=lock.grid.scale,
                                     workers=cfg.workers, tracking=tracking)}
        cells = study_cells(handle)
        decision = decide(lock, cells.results)
        while decision.pending is not None and decision.pending not in cells.failed \
                and decision.pending not in cells.running:
            space = {axis: [value] for axis, value in decision.pending.values}
            reports[f"extension {decision.pending.key}"] = run_cells(handle, space, runner, scale=lock.grid.scale,
                                                                     tracking=tracking)
            cells = study_cells(handle)
            decision = decide(lock, cells.results)
        run.log_json("decision.json", decision_record(lock, decision, cells, reports, study=name, storage=storage))
        run.log_table("cells", cells_table(lock, decision, cells))
        run.log_table("sensitivity", sensitivity_table(lock, cells))
        run.log_metrics(decision_metrics(lock, decision, cells))
        taken = [e for e in decision.extensions if e.ran]
        run.set_tags({TAG_RULE: decision.rule if decision.complete else "incomplete",
                      TAG_PICK: decision.pick.key if decision.complete else "",
                      "mistill.selection.extension": "; ".join(
                          f"{e.cell.key} {'adopted' if e.adopted else 'not adopted'}" for e in taken) or "none"})
        for key, cell_report in reports.items():
            print(f"select_lambda [{key}]: ran {cell_report.ran}, complete before {cell_report.complete_before}, "
                  f"failed {dict(cell_report.failed_before, **cell_report.failed_now)}, "
                  f"running elsewhere {cell_report.running_elsewhere}")
        if not decision.complete:
            unresolved = {c.key: cells.failed.get(c, "running" if c in cells.running else "not run")
                          for c in (*decision.missing, *([decision.pending] if decision.pending else []))}
            raise MistillInputError(f"no pick: cells without a result {unresolved} (failed cells are not "
                                    f"retried; see decision.json of run {run.run_id})", file=lock.path, field="grid")
        print(f"select_lambda: {decision.rule} -> {decision.pick.key} (run {run.run_id})")
        return run.run_id
