"""The λ selection rules as the paper states them: the edge extension whose outward cell joins the
grid (App. I.4: 0.01 ties 0.03 and M1 at P2C picks 0.01; the second-extension condition), App. O's
variant (validity floor, smallest λ within the band), the tie-break fallbacks as a lock field, the
paper's shipped locks (pinned by sha256) and what ``decision.json`` records.

Cell values that the paper does not print are illustrative and say so; the published ones (App.
I.4's 0.183 against 0.181, App. M.2's full-precision gaps) are used as printed. Every comparison is
of Python floats computed the same way on every machine, so equalities are exact."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from mistill.errors import MistillInputError
from selection.cells import Cell, CellResult, CellRun, grid_cells
from selection.decide import (
    BEST_OUTRIGHT,
    EDGE_EXTENSION,
    FURTHER_LIMIT,
    FURTHER_NOT_MET,
    FURTHER_PENDING,
    FURTHER_RUN,
    NO_ELIGIBLE,
    TIE_BAND,
    decide,
    sensitivity,
)
from selection.grid import StudyCells, open_study, run_cells, study_cells
from selection.lock import DEFAULT_TIE_FALLBACK, SMALLEST_LAMBDA, VALID_RATE, load_lock

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "projects" / "configs" / "locks"

PINNED_SHA256 = {
    # a shipped lock's bytes change only on purpose (last: the embedded demo's one training step,
    # under a new study name); a study made under other bytes refuses the lock
    "embedded-3cell.yaml": "8a882516109c4550a2c9f872b214439d00d4bc91eb72c2c4fcfa9dd632d8a7de",
    "i3-bf16-selection.yaml": "8185abe01b949f6526d7a1584e06dd85159ad0112e1aee1e0c7f1cd4e82851be",
    "i4-fp32-reselection.yaml": "abcee0cd4355a74d84493c97cd9c118874aaff208bd0434760c7ac7b2c9d9629",
    "m2-matched-mistill.yaml": "635499f110535ca2792fe3bceed6220fd2cefc3e0e8753a1a21647b014dd4446",
    "m2-matched-randheads.yaml": "8bfabf9be3103e4403e3b74dd1698387688ea0eeb3f1c9910a9b1704005e4121",
    "o-musique-mistill.yaml": "b05267d45fbf0bed5f1ebddb1c1d98d79016258778c6190e049aa1331fca20cf",
    "o-musique-randheads.yaml": "b2a0390629f08af7707d3f9651b0fae191c83de31b3b4cf4e985780cfc9ff4c9",
}
SECTION = {"i3-bf16-selection.yaml": "App. I.3", "i4-fp32-reselection.yaml": "App. I.4",
           "m2-matched-mistill.yaml": "App. M.2", "m2-matched-randheads.yaml": "App. M.2",
           "o-musique-mistill.yaml": "App. O", "o-musique-randheads.yaml": "App. O"}


def tied(v: float) -> Cell:
    return Cell.of({"lambda": v})


def res(metric: float, tie_break: float = math.nan, validity: float = math.nan) -> CellResult:
    return CellResult(metric=metric, tie_break=tie_break, validity=validity)


def lock_file(tmp_path: Path, name: str = "lock.yaml", *, selection: dict | None = None,
              edge: dict | None = None, grid: list | None = None) -> Path:
    data = {"study": "t", "arm": "mistill",
            "grid": {"tied": True, "scale": "log", "lambda": grid or [0.03, 0.1, 0.3]},
            "training": {"seed": 0, "max_steps": 1},
            "selection": {"metric": "micro_f1", "split": "val", "tie_band": 0.004, "tie_break": "m1/P2C/p_pos",
                          **(selection or {})},
            "edge": edge or {"extend": True, "max_extensions": 1, "outward": {"lambda": {"low": 0.01, "high": 1.0}}}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def fp32_lock():
    return load_lock(LOCKS / "i4-fp32-reselection.yaml")


def i4_grid() -> dict[Cell, CellResult]:
    """App. I.4's grid: monotone, 0.03 best at 0.181 (the other cells' values are illustrative,
    each more than the band below); M1 at P2C illustrative, falling with λ."""
    return {tied(0.03): res(0.181, 0.70), tied(0.1): res(0.170, 0.66), tied(0.3): res(0.150, 0.60),
            tied(1.0): res(0.120, 0.55)}


# ------------------------------------------------------------------------ the edge extension
def test_app_i4_the_outward_cell_joins_the_grid_and_wins_the_tie(fp32_lock):
    results = i4_grid()
    d = decide(fp32_lock, results)
    assert d.pick == tied(0.03) and d.rule == BEST_OUTRIGHT and d.pending == tied(0.01) and not d.complete
    results[tied(0.01)] = res(0.183, 0.72)  # App. I.4: 0.183 against 0.181; 0.01 higher on M1 at P2C
    d = decide(fp32_lock, results)
    assert d.complete and d.pick == tied(0.01) and d.rule == EDGE_EXTENSION
    assert d.grid_pick == tied(0.03) and d.band_rule == TIE_BAND and d.tied == (tied(0.01), tied(0.03))
    assert d.extended_grid == tuple(sorted([tied(0.01), *i4_grid()]))
    [ext] = d.extensions
    assert ext.ran and ext.picked and ext.from_cell == tied(0.03)
    # the second-extension condition: 0.01 beating 0.03 by more than the band, not met
    assert ext.gain == 0.183 - 0.181 and not ext.further_met and ext.further == FURTHER_NOT_MET
    assert ext.next_cell is None and d.pending is None  # no cell at 0.003 is asked for
    record = d.to_dict()
    assert record["extended_grid"][0] == "lambda=0.01" and record["band_rule"] == TIE_BAND
    cond = record["extensions"][0]["further_condition"]
    assert cond == {"rule": "gain > band", "met": False, "gap": 0.183 - 0.181, "band": 0.004, "next": None,
                    "status": FURTHER_NOT_MET}


def test_a_worse_outward_cell_keeps_the_edge_pick(fp32_lock):
    results = {**i4_grid(), tied(0.01): res(0.170, 0.99)}  # 0.011 behind: outside the band
    d = decide(fp32_lock, results)
    assert d.complete and d.pick == tied(0.03) and d.rule == BEST_OUTRIGHT and d.tied == (tied(0.03),)
    assert tied(0.01) in d.extended_grid and d.gaps[tied(0.01)] == 0.181 - 0.170
    [ext] = d.extensions
    assert ext.ran and not ext.picked and not ext.further_met and d.pending is None


def test_an_outward_cell_inside_the_band_but_lower_on_m1_keeps_the_edge_pick(fp32_lock):
    results = {**i4_grid(), tied(0.01): res(0.183, 0.50)}
    d = decide(fp32_lock, results)
    assert d.pick == tied(0.03) and d.rule == TIE_BAND and d.tied == (tied(0.01), tied(0.03))
    assert d.best == tied(0.01) and not d.extensions[0].picked


def test_a_second_extension_runs_only_under_the_condition_and_is_decided_again(fp32_lock):
    results = {**i4_grid(), tied(0.01): res(0.190, 0.60)}  # 0.009 ahead of the pick 0.03: > band
    d = decide(fp32_lock, results)
    assert d.pick == tied(0.01) and d.rule == EDGE_EXTENSION and d.band_rule == BEST_OUTRIGHT
    assert d.pending == tied(0.003) and not d.complete  # one log step beyond 0.01 (x 0.03 / 0.1)
    first = d.extensions[0]
    assert first.further_met and first.gain == 0.190 - 0.181 and first.further == FURTHER_PENDING
    assert [e.ran for e in d.extensions] == [True, False]
    # 0.003 ties 0.01 (0.002 behind) and is higher on M1 at P2C: picked through the tie
    results[tied(0.003)] = res(0.188, 0.65)
    d = decide(fp32_lock, results)
    assert d.complete and d.pick == tied(0.003) and d.rule == EDGE_EXTENSION and d.band_rule == TIE_BAND
    assert d.tied == (tied(0.003), tied(0.01)) and d.best == tied(0.01)
    assert [(e.cell, e.from_cell) for e in d.extensions] == [(tied(0.01), tied(0.03)), (tied(0.003), tied(0.01))]
    assert d.extensions[0].further == FURTHER_RUN and not d.extensions[1].further_met
    # the second extension beating 0.01 by more than the band: the lock's two extensions are spent
    results[tied(0.003)] = res(0.200, 0.10)
    d = decide(fp32_lock, results)
    assert d.pick == tied(0.003) and d.rule == EDGE_EXTENSION and d.band_rule == BEST_OUTRIGHT
    assert d.extensions[1].further_met and d.extensions[1].further == FURTHER_LIMIT and d.complete


def test_sensitivity_reapplies_the_extension_rule_with_each_band(fp32_lock):
    results = {**i4_grid(), tied(0.01): res(0.183, 0.72)}
    results[tied(0.1)] = res(0.170, 0.90)  # illustrative: 0.011 behind 0.03, higher on M1 at P2C
    rows = {r["band"]: r for r in sensitivity(fp32_lock, results, [0.0, 0.004, 0.011])}
    assert rows[0.004]["pick"] == "lambda=0.01" and rows[0.004]["rule"] == EDGE_EXTENSION
    assert rows[0.004]["pending"] is None and rows[0.004]["extended_grid"] == "lambda=0.01"
    # no band: 0.01 is 0.002 ahead of 0.03, so the second-extension condition holds and 0.003 is due
    assert rows[0.0]["pick"] == "lambda=0.01" and rows[0.0]["pending"] == "lambda=0.003"
    # a band of 0.011 ties 0.1 with 0.03 on the grid and M1 picks 0.1, an interior cell: 0.01 was
    # never called for under this band, so it is not part of its grid
    assert rows[0.011]["grid_pick"] == "lambda=0.1" and rows[0.011]["pick"] == "lambda=0.1"
    assert rows[0.011]["extended_grid"] == "" and rows[0.011]["rule"] == TIE_BAND


# ---------------------------------------------------------------------- App. O's variant
def app_o_lock(tmp_path: Path, **selection):
    return load_lock(lock_file(tmp_path, selection={"metric": "answer_f1", "tie_band": 0.017,
                                                    "tie_break": SMALLEST_LAMBDA, "validity_floor": 0.95,
                                                    **selection}))


def test_app_o_lock_parses(tmp_path):
    rule = app_o_lock(tmp_path).selection
    assert rule.by_smallest_lambda and rule.tie_break_metric is None
    assert rule.validity_floor == 0.95 and rule.validity_metric == VALID_RATE == "valid_rate"
    assert rule.tie_fallback == DEFAULT_TIE_FALLBACK == ("metric", "smaller_lambda")
    plain = load_lock(lock_file(tmp_path, "plain.yaml")).selection
    assert plain.validity_floor is None and not plain.by_smallest_lambda and plain.tie_break_metric == "m1/P2C/p_pos"
    assert load_lock(lock_file(tmp_path, "n.yaml", selection={"validity_floor": None})).selection.validity_floor is None


@pytest.mark.parametrize("selection, field", [
    ({"validity_floor": 1.5}, "selection.validity_floor"),
    ({"validity_floor": -0.1}, "selection.validity_floor"),
    ({"validity_floor": "high"}, "selection.validity_floor"),
    ({"validity_metric": " "}, "selection.validity_metric"),
    ({"tie_fallback": ["metric"]}, "selection.tie_fallback"),  # no λ order: may not decide
    ({"tie_fallback": ["smaller_lambda", "metric"]}, "selection.tie_fallback"),  # λ order not last
    ({"tie_fallback": ["smaller_lambda", "larger_lambda"]}, "selection.tie_fallback"),
    ({"tie_fallback": ["metric", "metric", "smaller_lambda"]}, "selection.tie_fallback"),
    ({"tie_fallback": ["loss", "smaller_lambda"]}, "selection.tie_fallback"),
    ({"tie_fallback": "smaller_lambda"}, "selection.tie_fallback"),
])
def test_lock_variant_fields_are_validated(tmp_path, selection, field):
    path = lock_file(tmp_path, selection=selection)
    with pytest.raises(MistillInputError) as err:
        load_lock(path)
    assert err.value.file == str(path) and err.value.field == field


def test_app_o_every_cell_in_the_band_smallest_then_one_outward_step(tmp_path):
    lock = app_o_lock(tmp_path)
    # Mistill's family (illustrative F1): every cell within 0.017 of the best (0.3)
    results = {tied(0.03): res(0.500, validity=0.99), tied(0.1): res(0.505, validity=0.99),
               tied(0.3): res(0.510, validity=0.98)}
    d = decide(lock, results)
    assert d.best == tied(0.3) and d.pick == tied(0.03) and d.rule == TIE_BAND and d.pending == tied(0.01)
    results[tied(0.01)] = res(0.496, validity=0.99)  # 0.014 behind the best: inside the band
    d = decide(lock, results)
    assert d.complete and d.pick == tied(0.01) and d.rule == EDGE_EXTENSION and d.band_rule == TIE_BAND
    assert d.ineligible == {} and not d.extensions[0].further_met


def test_app_o_cells_below_the_validity_floor_are_ineligible_with_the_reason(tmp_path):
    lock = app_o_lock(tmp_path)
    # RandHeads' family (illustrative): the stronger cells below the floor through runaway generations
    results = {tied(0.03): res(0.480, validity=0.97), tied(0.1): res(0.520, validity=0.9499),
               tied(0.3): res(0.560, validity=0.80), tied(0.01): res(0.470, validity=0.95)}  # at the floor
    d = decide(lock, results)
    assert d.grid_pick == tied(0.03) and d.pick == tied(0.01) and d.rule == EDGE_EXTENSION
    assert set(d.ineligible) == {tied(0.1), tied(0.3)} and tied(0.3) not in d.tied
    assert d.ineligible[tied(0.3)] == "valid_rate 0.8 < validity floor 0.95"
    assert d.to_dict()["ineligible"]["lambda=0.1"] == "valid_rate 0.9499 < validity floor 0.95"
    results[tied(0.03)] = res(0.480)  # not measured
    results[tied(0.01)] = res(0.470, validity=0.90)
    d = decide(lock, results)
    assert d.rule == NO_ELIGIBLE and d.pick is None and not d.complete
    assert d.ineligible[tied(0.03)] == "valid_rate not measured (validity floor 0.95)"


def test_an_ineligible_outward_cell_never_meets_the_further_condition(tmp_path):
    lock = load_lock(lock_file(tmp_path, selection={"validity_floor": 0.95},
                               edge={"extend": True, "max_extensions": 2, "outward": {"lambda": {"low": 0.01}}}))
    results = {tied(0.03): res(0.181, 0.5, 0.99), tied(0.1): res(0.170, 0.5, 0.99),
               tied(0.3): res(0.160, 0.5, 0.99), tied(0.01): res(0.300, 0.9, 0.50)}
    d = decide(lock, results)
    assert d.pick == tied(0.03) and d.complete and tied(0.01) in d.ineligible
    assert not d.extensions[0].further_met and d.extensions[0].gain == 0.300 - 0.181


def test_the_tie_fallback_order_is_a_lock_field(tmp_path):
    # the same M1 at P2C and the same metric on two cells within the band: the λ order decides
    results = {tied(0.03): res(0.180, 0.7), tied(0.1): res(0.180, 0.7), tied(0.3): res(0.100, 0.9)}
    default = load_lock(lock_file(tmp_path, edge={"extend": False}))
    assert decide(default, results).pick == tied(0.03)
    larger = load_lock(lock_file(tmp_path, "l.yaml", edge={"extend": False},
                                 selection={"tie_fallback": ["metric", "larger_lambda"]}))
    assert decide(larger, results).pick == tied(0.1)
    # the selection metric comes before the λ order by default; without it only the λ order
    results[tied(0.1)] = res(0.182, 0.7)
    assert decide(default, results).pick == tied(0.1)
    only = load_lock(lock_file(tmp_path, "o.yaml", edge={"extend": False},
                               selection={"tie_fallback": ["smaller_lambda"]}))
    assert decide(only, results).pick == tied(0.03)
    # a NaN tie-break ranks last whatever the fallback
    results[tied(0.03)] = res(0.182, math.nan)
    assert decide(only, results).pick == tied(0.1)


def test_smallest_lambda_on_an_untied_grid_orders_by_lambda_p1_then_lambda_p2(tmp_path):
    path = tmp_path / "u.yaml"
    path.write_text(yaml.safe_dump({
        "study": "u", "arm": "mistill", "grid": {"tied": False, "scale": "log", "lambda_p1": [0.03, 0.1],
                                                 "lambda_p2": [0.03, 0.1]},
        "training": {"seed": 0, "max_steps": 1},
        "selection": {"metric": "answer_f1", "split": "val", "tie_band": 0.017, "tie_break": SMALLEST_LAMBDA},
        "edge": {"extend": False}}))
    lock = load_lock(path)
    c = {(a, b): Cell.of({"lambda_p1": a, "lambda_p2": b}) for a in (0.03, 0.1) for b in (0.03, 0.1)}
    results = {c[0.03, 0.03]: res(0.40), c[0.03, 0.1]: res(0.50), c[0.1, 0.03]: res(0.50), c[0.1, 0.1]: res(0.51)}
    assert decide(lock, results).pick == c[0.03, 0.1]


# ---------------------------------------------------------------------- the shipped locks
@pytest.mark.parametrize("name", sorted(PINNED_SHA256))
def test_shipped_locks_load_with_their_pinned_sha256(name):
    path = LOCKS / name
    lock = load_lock(path)
    assert lock.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() == PINNED_SHA256[name]
    if name in SECTION:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# ") and SECTION[name] in first
    from selection.runner import TrainEvaluateRunner

    TrainEvaluateRunner(lock=lock, corpus_name="c", prepare_run="p", targets_run="t", student_attribute_run="s",
                        student="m").check()  # the arm takes every cell's λ


def test_every_shipped_lock_is_pinned():
    assert sorted(p.name for p in LOCKS.glob("*.yaml")) == sorted(PINNED_SHA256)


def test_the_fp32_lock_states_app_i4(fp32_lock):
    assert fp32_lock.grid.axes == {"lambda": (0.03, 0.1, 0.3, 1.0)} and fp32_lock.grid.tied
    assert fp32_lock.training.train_notes == 0  # tier-1 size: every training note (493)
    assert fp32_lock.training.precision == "fp32" and fp32_lock.training.seed == 0
    assert (fp32_lock.selection.metric, fp32_lock.selection.tie_band, fp32_lock.selection.tie_break) == \
        ("micro_f1", 0.004, "m1/P2C/p_pos")
    assert fp32_lock.edge.extend and fp32_lock.edge.outward["lambda"]["low"] == 0.01


@pytest.mark.parametrize("arm", ["mistill", "randheads"])
def test_the_musique_locks_state_app_o(arm):
    """App. O: tied λ in {0.03, 0.1, 0.3} at seed 0 on the full recipe, answer F1 on the selection
    questions among cells valid at 0.95 or more, the smallest λ within 0.017 of the best, one
    outward cell (0.01 below); the cells read answers only."""
    lock = load_lock(LOCKS / f"o-musique-{arm}.yaml")
    assert lock.arm == arm and lock.grid.tied and lock.grid.axes == {"lambda": (0.03, 0.1, 0.3)}
    assert (lock.training.seed, lock.training.max_steps, lock.training.grad_accum) == (0, 0, 8)
    rule = lock.selection
    assert (rule.metric, rule.split, rule.tie_band, rule.validity_floor) == ("answer_f1", "select", 0.017, 0.95)
    assert rule.by_smallest_lambda and rule.fidelity is False
    assert lock.edge.extend and lock.edge.max_extensions == 1 and lock.edge.outward["lambda"]["low"] == 0.01


def test_the_bf16_lock_trains_on_100_notes():
    """App. I.3: "nine runs at 100 training notes"; the draw's seed is the lock's, apart from the
    training seed."""
    lock = load_lock(LOCKS / "i3-bf16-selection.yaml")
    assert (lock.training.train_notes, lock.training.train_notes_seed, lock.training.seed) == (100, 0, 0)
    assert lock.to_dict()["training"]["train_notes"] == 100


@pytest.mark.parametrize("name", sorted(PINNED_SHA256))
def test_no_shipped_lock_sets_a_near_tie_guard(name):
    """The near-tie guard (``ArmConfig.min_abs_margin``) is off by default, the paper's rule; a lock
    holds no arm flag, so no shipped lock can turn it on."""
    text = (LOCKS / name).read_text()
    found = [float(v) for v in re.findall(r"min_abs_margin\s*[:=]\s*([0-9.eE+-]+)", text)]
    assert all(v == 0 for v in found)
    assert "min_abs_margin" not in json.dumps(load_lock(LOCKS / name).to_dict())


def test_the_bf16_lock_reproduces_app_i3s_pick():
    lock = load_lock(LOCKS / "i3-bf16-selection.yaml")
    assert lock.grid.axes == {"lambda": (0.1, 0.3, 1.0)} and not lock.edge.extend
    # illustrative values: only 0.1 reaches Vanilla CoT-KD (Table 39)
    d = decide(lock, {tied(0.1): res(0.150, 0.80), tied(0.3): res(0.140, 0.85), tied(1.0): res(0.120, 0.86)})
    assert d.complete and d.pick == tied(0.1) and d.extensions == ()


def test_the_matched_locks_reproduce_app_m2s_picks():
    mistill = load_lock(LOCKS / "m2-matched-mistill.yaml")
    # 0.1 is 0.0040204002 behind 0.03 (printed); 0.01 was lower (by an illustrative 0.01)
    results = {tied(0.03): res(0.160, 0.80), tied(0.1): res(0.160 - 0.0040204002, 0.85),
               tied(0.3): res(0.140, 0.86), tied(0.01): res(0.150, 0.70)}
    d = decide(mistill, results)
    assert d.complete and d.pick == tied(0.03) and d.rule == BEST_OUTRIGHT and len(d.extensions) == 1
    rand = load_lock(LOCKS / "m2-matched-randheads.yaml")
    assert rand.arm == "randheads" and rand.edge.max_extensions == 1
    # 0.03 is 0.0041750956 behind 0.3 (printed); the extension to 1 collapsed (illustrative 0.02)
    results = {tied(0.3): res(0.130, 0.78), tied(0.1): res(0.120, 0.80),
               tied(0.03): res(0.130 - 0.0041750956, 0.90), tied(1.0): res(0.020, 0.50)}
    d = decide(rand, results)
    assert d.complete and d.pick == tied(0.3) and [e.cell for e in d.extensions] == [tied(1.0)]
    # the 0.005 sensitivity band picks 0.03, an unextended lower-boundary choice (App. M.2)
    [row] = sensitivity(rand, results, [0.005])
    assert row["pick"] == "lambda=0.03" and row["pending"] == "lambda=0.01"


# ---------------------------------------------------------------------- what is recorded
def test_the_runner_reads_the_valid_answer_rate_and_requires_it_under_a_floor(tmp_path):
    from selection.runner import cell_result

    lock = app_o_lock(tmp_path)
    got = cell_result(lock, {"answer_f1": 0.5, "valid_rate": 0.96, "m1/P2C/p_pos": 0.7}, {"evaluate": "e"})
    assert (got.metric, got.validity, got.run_ids) == (0.5, 0.96, {"evaluate": "e"})
    assert math.isnan(got.tie_break)  # smallest_lambda: no tie-break metric is read
    with pytest.raises(MistillInputError) as err:
        cell_result(lock, {"answer_f1": 0.5}, {"evaluate": "e"})
    assert err.value.field == "selection.validity_metric"
    plain = load_lock(lock_file(tmp_path, "p.yaml"))
    got = cell_result(plain, {"micro_f1": 0.2, "m1/P2C/p_pos": 0.7}, {})
    assert got.tie_break == 0.7 and math.isnan(got.validity)


def test_the_valid_answer_rate_round_trips_through_the_study(tmp_path):
    lock = app_o_lock(tmp_path)
    handle = open_study(lock, f"sqlite:///{tmp_path / 'db.sqlite'}", "s", root=tmp_path)

    def runner(run: CellRun) -> CellResult:
        lam = run.cell.lambdas[0]
        return CellResult(metric=lam, validity=1.0 - lam)

    run_cells(handle, lock.grid.search_space(), runner, scale="log")
    cells = study_cells(handle)
    assert {c: r.validity for c, r in cells.results.items()} == {c: 1.0 - c.lambdas[0] for c in grid_cells(lock.grid)}
    assert all(math.isnan(r.tie_break) for r in cells.results.values())


def test_the_cell_table_and_record_say_why_a_cell_is_ineligible(tmp_path):
    from selection.report import cell_rows, decision_metrics, decision_record

    lock = app_o_lock(tmp_path)
    results = {tied(0.03): res(0.480, validity=0.97), tied(0.1): res(0.520, validity=0.90),
               tied(0.3): res(0.490, validity=0.99), tied(0.01): res(0.476, validity=0.96)}  # 0.014 behind
    cells = StudyCells(results=results)
    d = decide(lock, results)
    rows = {r["cell"]: r for r in cell_rows(lock, d, cells)}
    assert rows["lambda=0.1"]["eligible"] is False and "0.9 < validity floor" in rows["lambda=0.1"]["ineligible_reason"]
    assert rows["lambda=0.01"]["picked"] and rows["lambda=0.01"]["in_extended_grid"]
    assert rows["lambda=0.3"]["valid_rate"] == 0.99 and SMALLEST_LAMBDA not in rows["lambda=0.3"]
    record = json.loads(json.dumps(decision_record(lock, d, cells, {}, study="s", storage="x")))
    assert record["decision"]["ineligible"] == {"lambda=0.1": "valid_rate 0.9 < validity floor 0.95"}
    assert record["lock"]["selection"]["tie_break"] == SMALLEST_LAMBDA
    assert record["lock"]["selection"]["validity_floor"] == 0.95
    metrics = decision_metrics(lock, d, cells)
    assert metrics["selected/valid_rate"] == 0.96 and metrics["n_ineligible"] == 1.0


def test_select_lambda_stage_applies_app_o_lock(tracking_uri, tmp_path, monkeypatch, pinned_code_version):
    from mlflow.tracking import MlflowClient

    from mistill.stages.select_lambda import SelectLambdaConfig, run_select_lambda

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    path = lock_file(tmp_path, selection={"metric": "answer_f1", "tie_band": 0.017, "tie_break": SMALLEST_LAMBDA,
                                          "validity_floor": 0.95})
    table = {0.03: (0.48, 0.97), 0.1: (0.52, 0.90), 0.3: (0.56, 0.80), 0.01: (0.47, 0.96)}
    calls: list = []

    def runner(run: CellRun) -> CellResult:
        lam = run.cell.lambdas[0]
        calls.append(lam)
        metric, valid = table[lam]
        return CellResult(metric=metric, validity=valid)

    run_id = run_select_lambda(SelectLambdaConfig(lock=str(path), corpus_name="selection-app-o"), runner=runner)
    assert sorted(calls) == [0.01, 0.03, 0.1, 0.3]
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.data.tags["mistill.selection.pick"] == "lambda=0.01"
    assert run.data.tags["mistill.selection.rule"] == EDGE_EXTENSION
    record = json.loads(Path(client.download_artifacts(run_id, "decision.json", str(tmp_path / "dl"))).read_text())
    assert set(record["decision"]["ineligible"]) == {"lambda=0.1", "lambda=0.3"}
    children = client.search_runs([run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
    by_cell = {c.data.tags["mistill.selection.cell"]: c.data.metrics for c in children}
    assert by_cell["lambda=0.3"] == {"answer_f1": 0.56, "valid_rate": 0.80}
