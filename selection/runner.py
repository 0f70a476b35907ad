"""The default cell runner: the ``train`` entry point at the cell's λ, then ``evaluate`` on it.

``train`` gets ``overrides="lambda_p1=<λ_P1>,lambda_p2=<λ_P2>"`` and the lock's arm, seed, size and
training notes (``train_notes``, ``train_notes_seed``: every cell trains on the same notes, which a
plain ``train`` run given the same two values trains on too), and runs as a λ-selection cell
(:func:`mistill.tracking.models.selection_cells`): its checkpoint's registered version gets the
cell alias (``<arm>-l<λ>-s<seed>``), never the arm alias, which ``select_lambda`` gives to the pick
once its decision completes (a reused train run's version gets the cell alias here too);
``evaluate`` (``mistill.stages.evaluate.EvaluateConfig``: ``prepare_run``, ``train_run``,
``split``, ``device``) logs the selection metric (``micro_f1``), the tie-break
(``m1/P2C/p_pos``: P(margin > 0) at P2C events) and the valid-answer rate (``valid_rate``), read
back from its run (:func:`cell_result`). Both go through
:func:`mistill.stages.steps.run_step`, so identical finished runs are reused, and new ones are
nested under the cell's MLflow run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from mlflow.tracking import MlflowClient

from mistill.distill.arms import resolve_arm
from mistill.errors import MistillInputError
from mistill.stages.distill import TrainStageConfig
from mistill.stages.evaluate import EvaluateConfig
from mistill.stages.steps import run_step
from mistill.tracking.models import adopt, cell_alias, selection_cells
from selection.cells import CellResult, CellRun, grid_cells
from selection.lock import Lock


def lambda_overrides(lambda_p1: float, lambda_p2: float) -> str:
    """The ``train`` entry point's ``overrides`` for one cell (exact float repr)."""
    return f"lambda_p1={lambda_p1!r},lambda_p2={lambda_p2!r}"


@dataclass(frozen=True)
class TrainEvaluateRunner:
    """Train one cell through ``train`` and score it through ``evaluate`` (the default runner)."""

    lock: Lock
    corpus_name: str
    prepare_run: str
    targets_run: str
    student_attribute_run: str
    student: str
    device: str = "cpu"
    launch: str = "mlflow"
    gradient_checkpointing: bool = True

    def check(self) -> None:
        """Fail before any trial if the arm or its λ overrides are not valid."""
        for cell in grid_cells(self.lock.grid):
            resolve_arm(self.lock.arm, lambda_overrides(*cell.lambdas))

    def train_cell(self, run: CellRun) -> str:
        """Train ``run``'s cell as a λ-selection cell (reusing an identical finished train run);
        point the cell alias at its registered version; returns the train run id."""
        p1, p2 = run.cell.lambdas
        t = self.lock.training
        train_cfg = TrainStageConfig(targets_run=self.targets_run, student_attribute_run=self.student_attribute_run,
                                     student=self.student, arm=self.lock.arm, overrides=lambda_overrides(p1, p2),
                                     seed=t.seed, precision=t.precision, epochs=t.epochs, grad_accum=t.grad_accum,
                                     max_steps=t.max_steps, train_notes=t.train_notes,
                                     train_notes_seed=t.train_notes_seed, device=self.device,
                                     gradient_checkpointing=self.gradient_checkpointing)
        with selection_cells():
            train_run = run_step("train", train_cfg, self.corpus_name, launch=self.launch, parent=run.mlflow_run)
        adopt(MlflowClient(), train_run, cell_alias(self.lock.arm, p1, p2, t.seed))
        return train_run

    def __call__(self, run: CellRun) -> CellResult:
        train_run = self.train_cell(run)
        eval_cfg = EvaluateConfig(prepare_run=self.prepare_run, train_run=train_run,
                                  split=self.lock.selection.split, device=self.device,
                                  max_new_tokens=self.lock.selection.max_new_tokens,
                                  fidelity=self.lock.selection.fidelity)
        eval_run = run_step("evaluate", eval_cfg, self.corpus_name, launch=self.launch, parent=run.mlflow_run)
        metrics = MlflowClient().get_run(eval_run).data.metrics
        return cell_result(self.lock, metrics, {"train": train_run, "evaluate": eval_run})


def cell_result(lock: Lock, metrics: Mapping[str, float], run_ids: Mapping[str, str]) -> CellResult:
    """A cell's result from its ``evaluate`` run's metrics: the selection metric (required), the
    tie-break metric (NaN when absent or when ties go to the smallest λ) and the valid-answer
    rate (required when the lock sets a validity floor, else NaN when absent).

    Raises:
        MistillInputError: a metric the lock needs is not among ``metrics`` (names the field).
    """
    rule = lock.selection
    where = run_ids.get("evaluate", "")
    needed = [("selection.metric", rule.metric)]
    if rule.validity_floor is not None:
        needed.append(("selection.validity_metric", rule.validity_metric))
    for field, name in needed:
        if name not in metrics:
            raise MistillInputError(f"evaluate run {where} has no metric {name!r}", file=lock.path, field=field)
    tie_break = metrics.get(rule.tie_break_metric, math.nan) if rule.tie_break_metric else math.nan
    return CellResult(metric=float(metrics[rule.metric]), tie_break=float(tie_break), run_ids=dict(run_ids),
                      validity=float(metrics.get(rule.validity_metric, math.nan)))
