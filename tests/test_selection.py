"""Pre-registered λ selection: the lock and its sha256 refusal, the Optuna grid (each cell once,
across two processes; failed cells reported, and retried by a rerun up to the study's cap), the decision rule on hand-built cells
(winner, tie band and tie-break, the inclusive boundary, the edge extension), the sensitivity view,
and the ``select_lambda`` stage on a real MLflow server with a deterministic runner."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import yaml

from mistill.errors import MistillInputError
from selection.cells import Cell, CellResult, CellRun, grid_cells, outward_cell
from selection.decide import (
    BEST_OUTRIGHT,
    EDGE_EXTENSION,
    FURTHER_LIMIT,
    FURTHER_NOT_MET,
    INCOMPLETE,
    TIE_BAND,
    decide,
    pairwise_gaps,
    sensitivity,
)
from selection.grid import open_study, run_cells, study_cells
from selection.lock import load_lock

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "projects" / "configs" / "locks" / "embedded-3cell.yaml"


def lock_dict(**changes) -> dict:
    data = {"study": "t", "arm": "mistill",
            "grid": {"tied": True, "scale": "log", "lambda": [0.03, 0.1, 0.3]},
            "training": {"seed": 0, "max_steps": 1},
            "selection": {"metric": "micro_f1", "split": "val", "tie_band": 0.004, "tie_break": "m1/P2C/p_pos"},
            "edge": {"extend": True, "max_extensions": 1}}
    for dotted, value in changes.items():
        *head, last = dotted.split("__")
        node = data
        for part in head:
            node = node[part]
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return data


def write_lock(tmp_path: Path, name: str = "lock.yaml", **changes) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(lock_dict(**changes)))
    return path


def tied(v: float) -> Cell:
    return Cell.of({"lambda": v})


def res(metric: float, tie_break: float = math.nan) -> CellResult:
    return CellResult(metric=metric, tie_break=tie_break)


# ------------------------------------------------------------------------------------ the lock
def test_example_lock_loads_with_its_sha256():
    lock = load_lock(EXAMPLE)
    assert lock.grid.tied and lock.grid.axes == {"lambda": (0.03, 0.1, 0.3)}
    assert lock.selection.tie_band == 0.004 and lock.selection.tie_break == "m1/P2C/p_pos"
    assert lock.edge.outward == {"lambda": {"low": 0.01, "high": 1.0}}
    import hashlib
    assert lock.sha256 == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    assert [c.lambdas for c in grid_cells(lock.grid)] == [(0.03, 0.03), (0.1, 0.1), (0.3, 0.3)]


@pytest.mark.parametrize("changes, field", [
    ({"selection__tie_band": None}, "selection.tie_band"),
    ({"selection__tie_band": -0.1}, "selection.tie_band"),
    ({"selection__tie_band": "narrow"}, "selection.tie_band"),
    ({"edge": None}, "edge"),
    ({"grid__lambda": []}, "grid.lambda"),
    ({"grid__lambda": [0.0, 0.1]}, "grid.lambda"),  # log grid needs > 0
    ({"grid__lambda": [0.1, 0.1]}, "grid.lambda"),
    ({"grid__scale": "cubic"}, "grid.scale"),
    ({"grid__lambda_p1": [0.1]}, "grid.lambda_p1"),  # not an axis of a tied grid
    ({"training__seed": True}, "training.seed"),
    ({"training__max_step": 3}, "training.max_step"),
    ({"edge__outward": {"lambda": {"low": 0.05}}}, "edge.outward"),  # inside the grid
    ({"arm": "../x"}, "arm"),
    ({"extra": 1}, "extra"),
    ({"selection__tie_break": "m1.P2X.p_pos"}, "selection.tie_break"),  # no such event kind
    ({"selection__tie_break": "m1/P2C/p_neg"}, "selection.tie_break"),
    ({"selection__metric": "micro_f2"}, "selection.metric"),
    ({"selection__validity_metric": "eval.valid_rate"}, "selection.validity_metric"),  # eval/valid_rate: none
    ({"training__train_notes": 100}, "training.train_notes"),  # a mapping {n, seed}
    ({"training__train_notes": {"n": 100}}, "training.train_notes.seed"),
    ({"training__train_notes": {"n": -1, "seed": 0}}, "training.train_notes.n"),
    ({"training__train_notes": {"n": True, "seed": 0}}, "training.train_notes.n"),
    ({"training__train_notes": {"n": 100, "seed": 0.5}}, "training.train_notes.seed"),
    ({"training__train_notes": {"n": 100, "seed": 0, "order": "sorted"}}, "training.train_notes"),
])
def test_lock_validation_names_the_file_and_field(tmp_path, changes, field):
    path = write_lock(tmp_path, **changes)
    with pytest.raises(MistillInputError) as err:
        load_lock(path)
    assert err.value.file == str(path) and err.value.field == field
    assert str(path) in str(err.value)


def test_dotted_metric_names_are_the_same_metric(tmp_path):
    """``m1.P2C.p_pos`` is read as ``m1/P2C/p_pos`` (MLflow's name), in every metric field."""
    from mistill.tracking.naming import METRIC_SEPARATOR
    from selection.lock import METRIC_SEPARATOR as LOCK_SEPARATOR
    from selection.runner import cell_result

    assert LOCK_SEPARATOR == METRIC_SEPARATOR

    slash = load_lock(write_lock(tmp_path, "slash.yaml"))
    dotted = load_lock(write_lock(tmp_path, "dotted.yaml", selection__tie_break="m1.P2C.p_pos",
                                  selection__metric="fidelity.ppl_median", selection__validity_metric="valid_rate"))
    assert slash.selection.tie_break == dotted.selection.tie_break == "m1/P2C/p_pos"
    assert dotted.selection.metric == "fidelity/ppl_median" and dotted.selection.tie_break_metric == "m1/P2C/p_pos"
    assert dotted.to_dict()["selection"]["tie_break"] == "m1/P2C/p_pos"
    got = cell_result(dotted, {"fidelity/ppl_median": 3.0, "m1/P2C/p_pos": 0.7}, {"evaluate": "e"})
    assert (got.metric, got.tie_break) == (3.0, 0.7)
    assert slash.sha256 != dotted.sha256  # the hash is the file's bytes: the spelling is in it


def test_an_unknown_metric_is_refused_naming_the_lock_and_the_field(tmp_path):
    path = write_lock(tmp_path, selection__tie_break="m1.P2C.ppos")
    with pytest.raises(MistillInputError) as err:
        load_lock(path)
    assert err.value.file == str(path) and err.value.field == "selection.tie_break"
    assert "'m1.P2C.ppos' (read as 'm1/P2C/ppos') is no metric" in str(err.value) and str(path) in str(err.value)


# ------------------------------------------------------------------------ the training notes
def test_train_notes_is_a_lock_field_and_changes_the_hash(tmp_path):
    every = load_lock(write_lock(tmp_path, "every.yaml"))
    assert (every.training.train_notes, every.training.train_notes_seed) == (0, 0)  # absent: every note
    locks = {(n, seed): load_lock(write_lock(tmp_path, f"n{n}-s{seed}.yaml",
                                             training__train_notes={"n": n, "seed": seed}))
             for n, seed in ((100, 0), (100, 1), (50, 0), (0, 0))}
    assert {(k.training.train_notes, k.training.train_notes_seed) for k in locks.values()} == set(locks)
    shas = [every.sha256, *(k.sha256 for k in locks.values())]
    assert len(set(shas)) == len(shas)
    training = locks[100, 1].to_dict()["training"]
    assert (training["train_notes"], training["train_notes_seed"]) == (100, 1)
    zero = load_lock(write_lock(tmp_path, "zero.yaml", training__train_notes={"n": 0}))  # n 0: no seed needed
    assert (zero.training.train_notes, zero.training.train_notes_seed) == (0, 0)


def test_the_training_notes_rule():
    """Sorted ids, ``default_rng(seed).permutation``, the first n: the same ids for one seed, other
    ids for another, never more than asked, nested in n, and refused above the split's size."""
    import numpy as np

    from mistill.stages.distill import train_note_ids

    ids = [f"note-{i:03d}" for i in range(493)][::-1]  # the order given does not matter
    first = train_note_ids(ids, 100, 0)
    assert first == train_note_ids(sorted(ids), 100, 0) == train_note_ids(ids, 100, 0)
    assert len(first) == len(set(first)) == 100 and set(first) <= set(ids) and first == sorted(first)
    expected = sorted(sorted(ids)[i] for i in np.random.default_rng(0).permutation(493)[:100])
    assert first == expected
    assert train_note_ids(ids, 100, 1) != first and len(train_note_ids(ids, 100, 1)) == 100
    assert set(first) <= set(train_note_ids(ids, 250, 0))  # one seed: 100 of the 250
    assert train_note_ids(ids, 0, 5) == sorted(ids) == train_note_ids(ids, 493, 5)
    for n in (1, 7, 492):
        assert len(train_note_ids(ids, n, 3)) == n
    with pytest.raises(MistillInputError, match="exceeds the 493 notes") as err:
        train_note_ids(ids, 494, 0)
    assert err.value.field == "train_notes"
    with pytest.raises(MistillInputError) as err:
        train_note_ids(["a", "a", "b"], 1, 0)
    assert err.value.field == "train_notes"


def test_train_stage_config_takes_the_training_notes():
    from mistill.stages.distill import TrainStageConfig

    cfg = TrainStageConfig(targets_run="a" * 32, train_notes=100, train_notes_seed=3)
    assert cfg.to_dict()["train_notes"] == 100 and cfg.to_dict()["train_notes_seed"] == 3
    for field, value in (("train_notes", -1), ("train_notes_seed", -2)):
        with pytest.raises(MistillInputError) as err:
            TrainStageConfig(targets_run="a" * 32, **{field: value})
        assert err.value.field == field


def test_untied_grid_is_the_product_of_its_axes(tmp_path):
    path = write_lock(tmp_path, grid={"tied": False, "scale": "log", "lambda_p1": [0.03, 0.1],
                                     "lambda_p2": [0.1, 0.3, 1.0]})
    cells = grid_cells(load_lock(path).grid)
    assert len(cells) == 6 and (0.03, 1.0) in [c.lambdas for c in cells]


def test_missing_and_malformed_lock_files(tmp_path):
    with pytest.raises(MistillInputError, match="lock file not found"):
        load_lock(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("study: [unclosed\n")
    with pytest.raises(MistillInputError, match="malformed YAML") as err:
        load_lock(bad)
    assert err.value.file == str(bad)


def test_a_changed_lock_refuses_to_load_the_study(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    first = load_lock(write_lock(tmp_path))
    handle = open_study(first, url, "s", root=tmp_path)
    assert handle.created and handle.load().user_attrs["lock_sha256"] == first.sha256
    again = open_study(first, url, "s", root=tmp_path)
    assert not again.created
    changed = load_lock(write_lock(tmp_path, name="widened.yaml", selection__tie_band=0.005))
    with pytest.raises(MistillInputError) as err:
        open_study(changed, url, "s", root=tmp_path)
    assert err.value.file == str(tmp_path / "widened.yaml") and first.sha256 in str(err.value)
    assert open_study(changed, url, "other", root=tmp_path).created  # another study name is another study


# ----------------------------------------------------------------------------------- the grid
def fixed_runner(table: dict[float, tuple[float, float]], calls: list | None = None, fail: set | None = None):
    def runner(run: CellRun) -> CellResult:
        lam = run.cell.lambdas[0]
        if calls is not None:
            calls.append(lam)
        if fail and lam in fail:
            raise RuntimeError(f"cell {lam} diverged")
        metric, tb = table[lam]
        return CellResult(metric=metric, tie_break=tb, run_ids={"train": f"t{lam}"})
    return runner


def test_failed_cells_are_reported_and_retried_by_a_rerun(tmp_path):
    lock = load_lock(write_lock(tmp_path))
    handle = open_study(lock, f"sqlite:///{tmp_path / 'db.sqlite'}", "s", root=tmp_path)
    table = {0.03: (0.10, 0.7), 0.1: (0.12, 0.8), 0.3: (0.11, 0.9)}
    calls: list = []
    first = run_cells(handle, lock.grid.search_space(), fixed_runner(table, calls, fail={0.1}), scale="log")
    assert sorted(calls) == [0.03, 0.1, 0.3]  # the failed cell is not run again by the same call
    assert list(first.failed_now) == ["lambda=0.1"] and "diverged" in first.failed_now["lambda=0.1"]
    assert sorted(first.ran) == ["lambda=0.03", "lambda=0.3"]
    cells = study_cells(handle)
    assert set(cells.failed) == {tied(0.1)} and set(cells.results) == {tied(0.03), tied(0.3)}
    assert cells.results[tied(0.3)].tie_break == 0.9 and cells.results[tied(0.3)].run_ids == {"train": "t0.3"}
    d = decide(lock, cells.results)
    assert d.rule == INCOMPLETE and d.pick is None and d.missing == (tied(0.1),)
    calls.clear()
    second = run_cells(handle, lock.grid.search_space(), fixed_runner(table, calls), scale="log")
    assert calls == [0.1] and second.ran == ["lambda=0.1"] and second.retried == {"lambda=0.1": 1}
    assert sorted(second.complete_before) == ["lambda=0.03", "lambda=0.3"]
    assert list(second.failed_before) == ["lambda=0.1"] and "diverged" in second.failed_before["lambda=0.1"]
    cells = study_cells(handle)
    assert cells.failed == {} and len(cells.results) == 3 and cells.retries == {tied(0.1): 1}


def test_a_study_without_retries_reports_failed_cells_and_runs_nothing(tmp_path):
    lock = load_lock(write_lock(tmp_path))
    handle = open_study(lock, f"sqlite:///{tmp_path / 'db.sqlite'}", "s", root=tmp_path, max_retries=0)
    table = {0.03: (0.10, 0.7), 0.1: (0.12, 0.8), 0.3: (0.11, 0.9)}
    run_cells(handle, lock.grid.search_space(), fixed_runner(table, fail={0.1}), scale="log")
    calls: list = []
    second = run_cells(handle, lock.grid.search_space(), fixed_runner(table, calls), scale="log")
    assert calls == [] and second.ran == [] and second.failed_now == {} and second.retried == {}
    assert list(second.gave_up) == ["lambda=0.1"] and "diverged" in second.gave_up["lambda=0.1"]
    assert set(study_cells(handle).failed) == {tied(0.1)}


def test_threads_in_one_process_run_each_cell_once(tmp_path):
    lock = load_lock(write_lock(tmp_path, grid__lambda=[0.01, 0.03, 0.1, 0.3, 1.0, 3.0]))
    handle = open_study(lock, f"sqlite:///{tmp_path / 'db.sqlite'}", "s", root=tmp_path)
    calls: list = []
    guard = threading.Lock()

    def runner(run: CellRun) -> CellResult:
        with guard:
            calls.append((run.cell.key, threading.get_ident()))
        return CellResult(metric=run.cell.lambdas[0])

    report = run_cells(handle, lock.grid.search_space(), runner, scale="log", workers=3)
    assert sorted(k for k, _ in calls) == sorted(c.key for c in grid_cells(lock.grid))
    assert len(report.ran) == 6 and len(study_cells(handle).results) == 6


WORKER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from selection.cells import CellResult
    from selection.grid import open_study, run_cells
    from selection.lock import load_lock

    tmp, name = Path(sys.argv[1]), sys.argv[2]
    lock = load_lock(tmp / "lock.yaml")
    (tmp / f"ready-{name}").touch()
    while len(list(tmp.glob("ready-*"))) < 2:   # both processes start claiming together
        time.sleep(0.01)
    handle = open_study(lock, f"sqlite:///{tmp / 'db.sqlite'}", "shared", root=tmp)

    def runner(run):
        with open(tmp / "ran.log", "a") as fh:
            fh.write(f"{name} {run.cell.key} {os.getpid()}\\n")
        time.sleep(0.2)
        return CellResult(metric=run.cell.lambdas[0], tie_break=0.5)

    report = run_cells(handle, lock.grid.search_space(), runner, scale=lock.grid.scale)
    print("RAN", name, len(report.ran))
""")


def test_two_processes_share_one_study_and_run_each_cell_once(tmp_path):
    write_lock(tmp_path, grid__lambda=[0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), name], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    lines = [line.split() for line in (tmp_path / "ran.log").read_text().splitlines()]
    keys = sorted(k for _, k, _ in lines)
    lock = load_lock(tmp_path / "lock.yaml")
    assert keys == sorted(c.key for c in grid_cells(lock.grid))  # every cell, each exactly once
    assert {w for w, _, _ in lines} == {"a", "b"}  # both processes did work
    assert len({pid for _, _, pid in lines}) == 2
    handle = open_study(lock, f"sqlite:///{tmp_path / 'db.sqlite'}", "shared", root=tmp_path)
    trials = handle.load().get_trials()
    assert len(trials) == 8 and all(t.state.name == "COMPLETE" for t in trials)
    assert sorted(t.params["lambda"] for t in trials) == sorted(lock.grid.axes["lambda"])


# ---------------------------------------------------------------------------- the decision rule
@pytest.fixture
def lock3(tmp_path):
    return load_lock(write_lock(tmp_path))


def test_clear_winner(lock3):
    results = {tied(0.03): res(0.140, 0.9), tied(0.1): res(0.150, 0.1), tied(0.3): res(0.120, 0.5)}
    d = decide(lock3, results)
    assert d.rule == BEST_OUTRIGHT and d.pick == tied(0.1) and d.tied == (tied(0.1),)
    assert d.gaps[tied(0.03)] == 0.150 - 0.140  # full precision, not rounded
    assert d.extensions == ()  # interior pick: no extension


def test_tie_inside_the_band_is_broken_by_m1_at_p2c(lock3):
    results = {tied(0.03): res(0.148, 0.70), tied(0.1): res(0.150, 0.60), tied(0.3): res(0.120, 0.99)}
    d = decide(lock3, results, extend=False)
    assert d.rule == TIE_BAND and d.best == tied(0.1) and d.pick == tied(0.03)
    assert set(d.tied) == {tied(0.03), tied(0.1)}  # 0.3 is far outside: its M1 does not count


def test_the_band_is_inclusive_despite_float_error(lock3):
    # 0.183 - 0.179 == 0.0040000000000000036 in floats: exactly the band, so a tie (App. I.4)
    assert 0.183 - 0.179 > 0.004
    results = {tied(0.03): res(0.179, 0.9), tied(0.1): res(0.183, 0.1), tied(0.3): res(0.100, 0.5)}
    d = decide(lock3, results, extend=False)
    assert d.rule == TIE_BAND and d.pick == tied(0.03)
    # the paper's closest call, 0.0040204002 behind: outside the band
    results[tied(0.03)] = res(0.183 - 0.0040204002, 0.9)
    d = decide(lock3, results, extend=False)
    assert d.rule == BEST_OUTRIGHT and d.pick == tied(0.1)
    assert d.gaps[tied(0.03)] == pytest.approx(0.0040204002, abs=1e-15)


def test_an_outward_cell_beating_the_pick_by_more_than_the_band_is_picked(tmp_path):
    lock = load_lock(write_lock(tmp_path, edge={"extend": True, "max_extensions": 1,
                                                "outward": {"lambda": {"low": 0.01}}}))
    results = {tied(0.03): res(0.181, 0.5), tied(0.1): res(0.170, 0.5), tied(0.3): res(0.160, 0.5)}
    d = decide(lock, results)
    assert d.pending == tied(0.01) and d.pick == tied(0.03) and not d.complete  # run it first
    results[tied(0.01)] = res(0.190, 0.1)
    d = decide(lock, results)
    assert d.complete and d.rule == EDGE_EXTENSION and d.pick == tied(0.01) and d.band_rule == BEST_OUTRIGHT
    assert [(e.cell, e.from_cell, e.picked) for e in d.extensions] == [(tied(0.01), tied(0.03), True)]
    assert d.extensions[0].gain == pytest.approx(0.009)
    # the further-extension condition holds, but one outward cell is all this lock allows
    assert d.extensions[0].further_met and d.extensions[0].further == FURTHER_LIMIT and d.pending is None


def test_an_outward_cell_tied_exactly_at_the_band_joins_the_tie(tmp_path):
    lock = load_lock(write_lock(tmp_path, edge={"extend": True, "max_extensions": 2,
                                                "outward": {"lambda": {"high": 1.0}}}))
    results = {tied(0.03): res(0.10, 0.5), tied(0.1): res(0.11, 0.5), tied(0.3): res(0.150, 0.5),
               tied(1.0): res(0.154, 0.99)}  # 0.004 ahead: inside the inclusive band, not beyond it
    d = decide(lock, results)
    assert d.complete and d.grid_pick == tied(0.3)
    assert d.rule == EDGE_EXTENSION and d.band_rule == TIE_BAND and d.pick == tied(1.0)  # M1 breaks the tie
    assert set(d.tied) == {tied(0.3), tied(1.0)}
    [ext] = d.extensions
    assert ext.ran and ext.picked and not ext.further_met and ext.further == FURTHER_NOT_MET


def test_outward_steps_without_explicit_values(tmp_path):
    lock = load_lock(write_lock(tmp_path, edge={"extend": True, "max_extensions": 3}))
    assert outward_cell(lock.grid, lock.edge, tied(0.03)) == tied(0.009)  # one log step: x 0.03/0.1
    assert outward_cell(lock.grid, lock.edge, tied(0.3)) == tied(0.9)
    assert outward_cell(lock.grid, lock.edge, tied(0.1)) is None
    results = {tied(0.03): res(0.2), tied(0.1): res(0.1), tied(0.3): res(0.1), tied(0.009): res(0.3)}
    d = decide(lock, results)  # adopted, so the rule steps out again from the new edge
    assert d.pick == tied(0.009) and d.pending == tied(0.0027) and d.rule == EDGE_EXTENSION
    lin = load_lock(write_lock(tmp_path, grid={"tied": False, "scale": "linear", "lambda_p1": [0.1, 0.2],
                                              "lambda_p2": [0.1, 0.2, 0.3]}))
    corner = Cell.of({"lambda_p1": 0.2, "lambda_p2": 0.1})
    assert outward_cell(lin.grid, lin.edge, corner) == Cell.of({"lambda_p1": 0.3, "lambda_p2": 0.0})
    side = Cell.of({"lambda_p1": 0.1, "lambda_p2": 0.2})
    assert outward_cell(lin.grid, lin.edge, side) == Cell.of({"lambda_p1": 0.0, "lambda_p2": 0.2})


def test_sensitivity_reapplies_other_bands_to_the_same_cells(lock3):
    # App. M.2's shape: 0.1 is 0.0040204002 behind 0.03; a 0.005 band ties them and M1 picks 0.1
    results = {tied(0.03): res(0.160, 0.70), tied(0.1): res(0.160 - 0.0040204002, 0.80),
               tied(0.3): res(0.140, 0.85), tied(0.01): res(0.150, 0.60)}
    rows = {r["band"]: r for r in sensitivity(lock3, results, [0.0, 0.004, 0.005])}
    assert rows[0.004]["pick"] == "lambda=0.03" and rows[0.004]["rule"] == BEST_OUTRIGHT
    assert rows[0.004]["is_locked_band"] and not rows[0.005]["is_locked_band"]
    assert rows[0.005]["pick"] == "lambda=0.1" and rows[0.005]["rule"] == TIE_BAND and rows[0.005]["n_tied"] == 2
    assert rows[0.0]["pick"] == "lambda=0.03"
    gaps = pairwise_gaps(results)
    assert gaps["lambda=0.03"]["lambda=0.1"] == 0.160 - (0.160 - 0.0040204002)


# ------------------------------------------------------------------------------- the stage
def test_select_lambda_stage_nests_cells_and_logs_the_decision(tracking_uri, tmp_path, monkeypatch,
                                                                pinned_code_version):
    from mlflow.tracking import MlflowClient

    from mistill.stages.select_lambda import SelectLambdaConfig, run_select_lambda

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    lock_path = write_lock(tmp_path, edge={"extend": True, "max_extensions": 2,
                                           "outward": {"lambda": {"low": 0.01}}})
    # 0.03 wins on the edge; 0.01 beats it by more than the band, so 0.003 (the next step) runs
    # too; 0.003 ties 0.01 and loses the tie on M1 at P2C
    table = {0.03: (0.181, 0.70), 0.1: (0.170, 0.80), 0.3: (0.150, 0.90), 0.01: (0.190, 0.60),
             0.003: (0.192, 0.10)}
    calls: list = []
    cfg = SelectLambdaConfig(lock=str(lock_path), corpus_name="selection-test", workers=2)
    run_id = run_select_lambda(cfg, runner=fixed_runner(table, calls))
    assert sorted(calls) == [0.003, 0.01, 0.03, 0.1, 0.3]

    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    lock = load_lock(lock_path)
    tags = run.data.tags
    assert tags["mistill.selection.lock_sha256"] == lock.sha256
    assert tags["mistill.selection.rule"] == EDGE_EXTENSION and tags["mistill.selection.pick"] == "lambda=0.01"
    assert tags["mistill.selection.study_created"] == "true"
    assert run.data.metrics["selected/lambda_p1"] == 0.01 == run.data.metrics["selected/lambda_p2"]
    assert run.data.metrics["selected/micro_f1"] == 0.190
    assert json.loads(run.data.params["lock.selection"])["tie_band"] == 0.004

    children = client.search_runs([run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
    assert sorted(c.data.tags["mistill.selection.cell"] for c in children) == \
        sorted(f"lambda={v!r}" for v in table)
    by_cell = {c.data.tags["mistill.selection.cell"]: c for c in children}
    assert by_cell["lambda=0.1"].data.metrics == {"micro_f1": 0.170, "m1/P2C/p_pos": 0.80}
    assert by_cell["lambda=0.1"].data.tags["mistill.selection.run.train"] == "t0.1"
    assert all(c.info.status == "FINISHED" for c in children)

    local = client.download_artifacts(run_id, "decision.json", str(tmp_path / "dl"))
    record = json.loads(Path(local).read_text())
    assert record["decision"]["rule"] == EDGE_EXTENSION and record["decision"]["pick"] == "lambda=0.01"
    assert [(e["cell"], e["picked"]) for e in record["decision"]["extensions"]] == \
        [("lambda=0.01", True), ("lambda=0.003", False)]
    first, second = record["decision"]["extensions"]
    assert first["further_condition"]["met"] and first["further_condition"]["gap"] == 0.190 - 0.181
    assert not second["further_condition"]["met"]  # 0.003 is not 0.004 ahead of 0.01
    assert record["decision"]["extended_grid"] == ["lambda=0.003", "lambda=0.01", "lambda=0.03", "lambda=0.1",
                                                   "lambda=0.3"]
    assert record["decision"]["band_rule"] == TIE_BAND and record["decision"]["grid_pick"] == "lambda=0.03"
    assert record["decision"]["best"] == "lambda=0.003"  # gaps are to the extended grid's best
    assert record["decision"]["gaps_to_best"]["lambda=0.1"] == 0.192 - 0.170
    assert record["lock"]["sha256"] == lock.sha256
    assert {r["band"] for r in record["sensitivity"]} >= {0.004, 0.002, 0.008}
    arts = {a.path for a in client.list_artifacts(run_id)}
    assert {"cells.csv", "cells.md", "sensitivity.csv", "sensitivity.md"} <= arts

    # a second identical invocation reuses the finished run and runs nothing
    calls.clear()
    assert run_select_lambda(cfg, runner=fixed_runner(table, calls)) == run_id and calls == []

    # the same study under an edited lock is refused, naming the lock file
    lock_path.write_text(lock_path.read_text().replace("0.004", "0.005"))
    with pytest.raises(MistillInputError) as err:
        run_select_lambda(cfg, runner=fixed_runner(table, calls))
    assert err.value.file == str(lock_path) and calls == []


def test_select_lambda_stage_reports_failed_cells_and_a_rerun_retries_them(tracking_uri, tmp_path, monkeypatch,
                                                           pinned_code_version):
    from mlflow.tracking import MlflowClient

    from mistill.stages.select_lambda import SelectLambdaConfig, run_select_lambda

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    lock_path = write_lock(tmp_path)
    table = {0.03: (0.1, 0.5), 0.1: (0.2, 0.5), 0.3: (0.15, 0.5)}
    cfg = SelectLambdaConfig(lock=str(lock_path), corpus_name="selection-test-fail")
    with pytest.raises(MistillInputError, match="diverged"):
        run_select_lambda(cfg, runner=fixed_runner(table, fail={0.3}))
    calls: list = []
    run_select_lambda(cfg, runner=fixed_runner(table, calls))
    assert calls == [0.3]  # completed cells skipped, the failed one retried
    client = MlflowClient()
    exp = client.get_experiment_by_name("mistill/selection-test-fail")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`mistill.stage` = 'select_lambda'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # the second call resumed the same run
    assert runs[0].data.tags["mistill.selection.pick"] == "lambda=0.1"
    failed = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FAILED' and "
                                "tags.`mistill.stage` = 'select_lambda.cell'")
    assert [r.data.tags["mistill.selection.cell"] for r in failed] == ["lambda=0.3"]


def test_default_lock_resolves_from_any_folder(tracking_uri, tmp_path, monkeypatch, pinned_code_version):
    """The default lock (``projects/configs/...``, relative) read from a folder where it is not:
    found under the repository root, for the stage's run and for both configs' content digests."""
    from mlflow.tracking import MlflowClient

    from mistill.stages.select_lambda import SelectLambdaConfig, run_select_lambda
    from mistill.stages.workflow import PipelineConfig
    from stage_fixtures import unique

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = SelectLambdaConfig(corpus_name=unique("lockcwd"))
    assert not Path(cfg.lock).exists() and cfg.lock == PipelineConfig().select_lock
    sha = load_lock(EXAMPLE).sha256
    assert cfg.content_digests() == {"lock": sha}
    assert PipelineConfig().content_digests()["select_lock"] == sha
    table = {0.03: (0.20, 0.5), 0.1: (0.25, 0.5), 0.3: (0.21, 0.5)}  # the middle cell: no extension
    run_id = run_select_lambda(cfg, runner=fixed_runner(table))
    tags = MlflowClient().get_run(run_id).data.tags
    assert tags["mistill.selection.pick"] == "lambda=0.1" and tags["mistill.selection.lock_sha256"] == sha
    assert Path(tags["mistill.selection.lock_path"]).resolve() == EXAMPLE.resolve()


def test_default_runner_checks_the_arm_before_any_trial(tmp_path):
    from selection.runner import TrainEvaluateRunner, lambda_overrides

    assert lambda_overrides(0.03, 0.1) == "lambda_p1=0.03,lambda_p2=0.1"
    good = load_lock(write_lock(tmp_path))
    TrainEvaluateRunner(lock=good, corpus_name="c", prepare_run="p", targets_run="t",
                        student_attribute_run="s", student="m").check()
    bad = load_lock(write_lock(tmp_path, name="bad.yaml", arm="no-such-arm"))
    with pytest.raises(MistillInputError):
        TrainEvaluateRunner(lock=bad, corpus_name="c", prepare_run="p", targets_run="t",
                            student_attribute_run="s", student="m").check()


# ---------------------------------------------------------- a cell's training notes, end to end
TINY_STUDENT = "tiny:qwen3:seed=2"


@pytest.fixture(scope="module")
def tiny_inputs(tracking_uri, tmp_path_factory, pinned_code_version):
    """Characterization, the student's ranking and the teacher's targets on 3 synthetic notes, every
    one a training note of the targets run."""
    from stage_fixtures import tiny_distill_inputs

    return tiny_distill_inputs(tmp_path_factory.mktemp("train-notes-root"), "trainnotes", TINY_STUDENT,
                               teacher_split="", train_split="")


def _train_notes_json(client, run_id: str, dest: Path) -> dict:
    return json.loads(Path(client.download_artifacts(run_id, "train_notes.json", str(dest))).read_text())


def test_a_selection_cell_trains_on_exactly_the_locks_notes(tiny_inputs, tmp_path, monkeypatch,
                                                             pinned_code_version):
    """The lock's ``train_notes`` reach each cell's ``train`` run, which trains on exactly
    :func:`train_note_ids` of the targets run's notes and records them; a plain ``train`` run given
    the same two values is the same run (reused), one given another draw seed is not and trains on
    other notes."""
    from mlflow.tracking import MlflowClient

    from mistill.stages.distill import TrainStageConfig, run_train, train_note_ids
    from mistill.stages.select_lambda import SelectLambdaConfig, run_select_lambda
    from selection.runner import TrainEvaluateRunner, lambda_overrides
    from stage_fixtures import unique

    monkeypatch.setenv("MISTILL_ROOT", str(tiny_inputs["root"]))
    ids = tiny_inputs["ids"]
    client = MlflowClient()
    split = sorted(Path(a.path).name for a in client.list_artifacts(ids["targets"], "notes") if a.is_dir)
    assert len(split) == 3
    n, seed = 2, 0
    other = next(s for s in range(1, 50) if train_note_ids(split, n, s) != train_note_ids(split, n, seed))
    chosen = train_note_ids(split, n, seed)

    lock_path = write_lock(tmp_path, study=unique("train-notes"), grid={"tied": True, "scale": "log",
                                                                       "lambda": [0.1]},
                           training={"seed": 1, "max_steps": 1, "grad_accum": 1,
                                     "train_notes": {"n": n, "seed": seed}},
                           edge={"extend": False})
    lock = load_lock(lock_path)
    cells = TrainEvaluateRunner(lock=lock, corpus_name=tiny_inputs["corpus"], prepare_run=ids["prepare"],
                                targets_run=ids["targets"], student_attribute_run=ids["student_attribute"],
                                student=TINY_STUDENT, launch="inline", gradient_checkpointing=False)
    trained: list[str] = []

    def runner(run: CellRun) -> CellResult:
        trained.append(cells.train_cell(run))
        return CellResult(metric=0.2, tie_break=0.5, run_ids={"train": trained[-1]})

    cfg = SelectLambdaConfig(lock=str(lock_path), prepare_run=ids["prepare"], targets_run=ids["targets"],
                             student_attribute_run=ids["student_attribute"], student=TINY_STUDENT, launch="inline",
                             train_gradient_checkpointing=False)
    run_select_lambda(cfg, runner=runner)
    [cell_train] = trained
    run = client.get_run(cell_train)
    assert run.info.status == "FINISHED"
    assert (run.data.params["train_notes"], run.data.params["train_notes_seed"]) == (str(n), str(seed))
    record = _train_notes_json(client, cell_train, tmp_path / "cell")
    assert record["note_ids"] == chosen and record["n_split"] == 3 and record["n_chosen"] == n
    assert run.data.params["train_notes.sha256"] == record["sha256"]
    assert run.data.metrics["n_notes"] == n
    config = json.loads(Path(client.download_artifacts(cell_train, "config.json", str(tmp_path / "cfg"))).read_text())
    assert config["train_notes"]["note_ids"] == chosen

    # a plain train run with the same values is the cell's run; another draw seed is another run
    plain = TrainStageConfig(targets_run=ids["targets"], student_attribute_run=ids["student_attribute"],
                             student=TINY_STUDENT, arm=lock.arm, overrides=lambda_overrides(0.1, 0.1), seed=1,
                             epochs=2, grad_accum=1, max_steps=1, gradient_checkpointing=False,
                             train_notes=n, train_notes_seed=seed)
    assert run_train(plain) == cell_train
    moved = run_train(plain.replace(train_notes_seed=other))
    assert moved != cell_train
    assert _train_notes_json(client, moved, tmp_path / "moved")["note_ids"] == train_note_ids(split, n, other) != chosen
    every = run_train(plain.replace(train_notes=0, arm="vanilla-bf16", overrides=""))
    assert _train_notes_json(client, every, tmp_path / "every")["note_ids"] == split
    with pytest.raises(MistillInputError, match="exceeds the 3 notes") as err:
        run_train(plain.replace(train_notes=4))
    assert err.value.field == "train_notes"
