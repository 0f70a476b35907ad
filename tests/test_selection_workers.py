"""λ selection's parallel workers and failed cells: two inline workers as spawned processes finish
a study of real (tiny) train and evaluate cells on one SQLite study and one MLflow server; a cell
that failed is retried by a rerun, at most the study's ``max_retries`` times, with a one-line
summary of what failed and why; inputs that every cell would fail on are refused before any cell
starts, naming the field.

The storage is SQLite only: the shared test fixtures hold no PostgreSQL server (the two-process
PostgreSQL study is covered in ``test_postgres.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from mistill.errors import MistillInputError
from mistill.stages.select_lambda import SelectLambdaConfig, run_select_lambda
from selection.cells import Cell, CellResult, CellRun
from selection.grid import (
    ATTR_FAILURE_RETRY,
    ATTR_MAX_RETRIES,
    ATTR_REASON,
    ATTR_RETRIES,
    DEFAULT_MAX_RETRIES,
    cpu_share,
    open_study,
    run_cells,
    study_cells,
)
from selection.lock import load_lock
from stage_fixtures import tiny_distill_inputs, unique

pytestmark = pytest.mark.usefixtures("pinned_code_version")

TINY_STUDENT = "tiny:qwen3:seed=2"


def write_lock(tmp_path: Path, lambdas: list[float], **sections: dict) -> Path:
    data = {"study": unique("w"), "arm": "mistill", "grid": {"tied": True, "scale": "log", "lambda": lambdas},
            "training": {"seed": 0, "max_steps": 1},
            "selection": {"metric": "micro_f1", "split": "val", "tie_band": 0.004, "tie_break": "m1/P2C/p_pos"},
            "edge": {"extend": False}}
    data.update(sections)
    path = tmp_path / f"{data['study']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class PidRunner:
    """A picklable runner (module level) that records the process, and torch's threads, of each cell."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def __call__(self, run: CellRun) -> CellResult:
        import torch

        with open(self.log, "a") as fh:
            fh.write(f"{run.cell.key} {os.getpid()} {torch.get_num_threads()}\n")
        return CellResult(metric=run.cell.lambdas[0], tie_break=0.5)


def test_worker_processes_share_one_study_and_a_share_of_the_cpus(tmp_path):
    lock = load_lock(write_lock(tmp_path, [0.01, 0.03, 0.1, 0.3]))
    handle = open_study(lock, f"sqlite:///{tmp_path / 'db.sqlite'}", "s", root=tmp_path)
    log = tmp_path / "ran.log"
    report = run_cells(handle, lock.grid.search_space(), PidRunner(log), scale="log", workers=2, processes=True)
    rows = [line.split() for line in log.read_text().splitlines()]
    assert sorted(k for k, _, _ in rows) == sorted(report.ran) == ["lambda=0.01", "lambda=0.03", "lambda=0.1",
                                                                   "lambda=0.3"]
    assert all(int(pid) != os.getpid() for _, pid, _ in rows)  # every cell ran in a worker process
    assert {int(n) for _, _, n in rows} == {cpu_share(2)}
    assert len(study_cells(handle).results) == 4


@pytest.fixture(scope="module")
def tiny_inputs(tracking_uri, tmp_path_factory, pinned_code_version):
    return tiny_distill_inputs(tmp_path_factory.mktemp("workers-root"), "workers", TINY_STUDENT,
                               teacher_split="", train_split="")


def test_two_inline_workers_train_and_evaluate_every_cell(tiny_inputs, tmp_path, monkeypatch):
    """The default runner with ``launch=inline`` and two workers: each worker a spawned process
    that imports transformers and loads its models alone; every cell trains and evaluates once."""
    monkeypatch.setenv("MISTILL_ROOT", str(tiny_inputs["root"]))
    ids = tiny_inputs["ids"]
    lock_path = write_lock(tmp_path, [0.03, 0.1],
                           training={"seed": 0, "max_steps": 1, "grad_accum": 1},
                           selection={"metric": "micro_f1", "split": "val", "tie_band": 0.004,
                                      "tie_break": "smallest_lambda", "max_new_tokens": 4})
    cfg = SelectLambdaConfig(lock=str(lock_path), prepare_run=ids["prepare"], targets_run=ids["targets"],
                             student_attribute_run=ids["student_attribute"], student=TINY_STUDENT, launch="inline",
                             workers=2, train_gradient_checkpointing=False,
                             storage=f"sqlite:///{tmp_path / 'study.db'}")
    run_id = run_select_lambda(cfg)
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.selection.pick"] in ("lambda=0.03", "lambda=0.1")
    cells = client.search_runs([run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
    assert sorted(c.data.tags["mistill.selection.cell"] for c in cells) == ["lambda=0.03", "lambda=0.1"]
    assert all(c.info.status == "FINISHED" and c.data.tags.get("mistill.selection.run.train") for c in cells)


# ------------------------------------------------------------------------------ failed cells
class FlakyRunner:
    """Fails the cells in ``fail`` (λ -> how many calls fail before one succeeds; -1: every call)."""

    def __init__(self, fail: dict[float, int]) -> None:
        self.fail = dict(fail)
        self.calls: list[float] = []

    def __call__(self, run: CellRun) -> CellResult:
        lam = run.cell.lambdas[0]
        self.calls.append(lam)
        left = self.fail.get(lam, 0)
        if left:
            self.fail[lam] = left - 1 if left > 0 else left
            raise RuntimeError(f"cell {lam} ran out of memory")
        return CellResult(metric={0.03: 0.10, 0.1: 0.20, 0.3: 0.15}[lam], tie_break=0.5, run_ids={"train": "t"})


def _study(cfg: SelectLambdaConfig, tmp_path: Path):
    from mistill.stages.select_lambda import study_name

    lock = load_lock(cfg.lock)
    return open_study(lock, cfg.storage, study_name(cfg, lock.study, cfg.corpus_name), root=tmp_path)


def test_a_rerun_retries_exactly_the_failed_cell_and_picks(tracking_uri, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    cfg = SelectLambdaConfig(lock=str(write_lock(tmp_path, [0.03, 0.1, 0.3])), corpus_name=unique("retry"),
                             storage=f"sqlite:///{tmp_path / 'study.db'}")
    runner = FlakyRunner({0.1: 1})
    with pytest.raises(MistillInputError, match="a rerun retries it") as err:
        run_select_lambda(cfg, runner=runner)
    assert err.value.field == "grid" and "RuntimeError: cell 0.1 ran out of memory" in str(err.value)
    assert "select_lambda: failed cells: lambda=0.1 failed 1 time (0/2 retries used, a rerun retries it): " \
           "RuntimeError: cell 0.1 ran out of memory" in capsys.readouterr().out
    handle = _study(cfg, tmp_path)
    assert handle.load().user_attrs[ATTR_MAX_RETRIES] == DEFAULT_MAX_RETRIES
    [failed] = [t for t in handle.load().get_trials() if t.state.name == "FAIL"]
    assert failed.user_attrs[ATTR_REASON] == "RuntimeError: cell 0.1 ran out of memory"

    runner.calls.clear()
    run_id = run_select_lambda(cfg, runner=runner)
    assert runner.calls == [0.1]  # exactly the failed cell
    study = handle.load()
    assert study.user_attrs[ATTR_RETRIES] == {"lambda=0.1": 1}
    [retry] = [t for t in study.get_trials() if t.user_attrs.get(ATTR_FAILURE_RETRY)]
    assert retry.state.name == "COMPLETE" and retry.user_attrs[ATTR_FAILURE_RETRY] == 1
    assert retry.params == failed.params and retry.number > failed.number
    assert study.user_attrs["locked_pick"]["cell"] == "lambda=0.1"
    run = MlflowClient().get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.selection.pick"] == "lambda=0.1"
    cells = study_cells(handle)
    assert cells.retries == {Cell.of({"lambda": 0.1}): 1} and not cells.failed


def test_a_cell_that_keeps_failing_stops_after_the_cap(tracking_uri, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    cfg = SelectLambdaConfig(lock=str(write_lock(tmp_path, [0.03, 0.1, 0.3])), corpus_name=unique("cap"),
                             storage=f"sqlite:///{tmp_path / 'study.db'}")
    runner = FlakyRunner({0.3: -1})
    for _ in range(DEFAULT_MAX_RETRIES + 2):
        with pytest.raises(MistillInputError, match="no pick"):
            run_select_lambda(cfg, runner=runner)
    # one first attempt and two retries; the fourth invocation runs nothing
    assert sorted(runner.calls) == [0.03, 0.1, 0.3, 0.3, 0.3]
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("select_lambda: failed cells: lambda=0.3 failed 3 times (2/2 retries used, out of retries): "
                       "RuntimeError: cell 0.3 ran out of memory")
    assert "out of retries {'lambda=0.3': 'RuntimeError: cell 0.3 ran out of memory'}" in out[-2]
    handle = _study(cfg, tmp_path)
    assert handle.load().user_attrs[ATTR_RETRIES] == {"lambda=0.3": 2}
    assert [t.state.name for t in handle.load().get_trials() if t.params["lambda"] == 0.3] == ["FAIL"] * 3


# ------------------------------------------------------------------------ inputs checked first
def _run_of_stage(stage: str, experiment: str) -> str:
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    run = client.create_run(exp_id, tags={"mistill.stage": stage})
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


@pytest.mark.parametrize("case", ["wrong_stage", "missing_run", "no_student_ranking", "missing_model"])
def test_inputs_every_cell_would_fail_on_are_refused_before_any_cell(tracking_uri, tmp_path, monkeypatch, case):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    experiment = f"mistill/{unique('inputs')}"
    prepare, targets, attribute = (_run_of_stage(s, experiment) for s in ("prepare", "targets", "attribute"))
    fields = {"prepare_run": prepare, "targets_run": targets, "student_attribute_run": attribute,
              "student": TINY_STUDENT}
    wrong = {"wrong_stage": ("targets_run", prepare), "missing_run": ("student_attribute_run", "0" * 32),
             "no_student_ranking": ("student_attribute_run", ""),
             "missing_model": ("student", f"/{unique('nomodel')}/model")}[case]
    fields[wrong[0]] = wrong[1]
    storage = tmp_path / "study.db"
    cfg = SelectLambdaConfig(lock=str(write_lock(tmp_path, [0.03, 0.1])), storage=f"sqlite:///{storage}",
                             launch="inline", **fields)
    with pytest.raises(MistillInputError) as err:
        run_select_lambda(cfg)
    assert err.value.field == wrong[0]
    assert not storage.exists()  # refused before the study was opened: no cell started
