"""How much a readout rests on: counts beside values, "n too small" below the minimum, and the
random floor's spread over draws (analysis.evidence, the knock-in and own-heads summaries)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis.evidence import MIN_GATED_EVENTS, MIN_NOTES, TOO_SMALL, Support, floor_cell, readout_cell, support_of
from analysis.tables import own_heads_seed_display
from mistill.evaluation.own_heads import m4_rows
from mistill.instrument.passes import KnockinConfig, floor_draw, set_variants
from mistill.stages.characterize import knockin_count_metrics
from mistill.stages.own_heads import summary_metrics
from mistill.stages.workflow import summary_value


def test_the_minimum_needs_both_events_and_notes():
    assert (MIN_GATED_EVENTS, MIN_NOTES) == (10, 3)
    assert Support(10, 3).clears()
    assert not Support(9, 5).clears()
    assert not Support(40, 2).clears()
    assert not Support(None, 4).clears()
    assert Support(4, 1).clears(min_events=4, min_notes=1)


def test_a_cell_shows_its_counts_and_hides_a_value_below_the_minimum():
    assert readout_cell(0.8234, Support(14, 4)) == "0.823 [14 ev / 4 notes]"
    assert readout_cell(0.8234, Support(3, 1)) == f"{TOO_SMALL} [3 ev / 1 note]"
    assert readout_cell(0.8234, Support(3, 1), counts=False) == TOO_SMALL
    assert readout_cell(float("nan"), Support(14, 4)) == "-"
    assert readout_cell(0.5, Support(2, 1), min_events=2, min_notes=1) == "0.500 [2 ev / 1 note]"
    assert support_of({"a": 12.0, "b": 3.0}, "a", "b") == Support(12, 3)
    assert support_of({"a": 12.0}, "a", "b") == Support(12, None)


def test_the_floor_cell_shows_mean_spread_and_draws():
    assert floor_cell(0.0123, 0.0201, 5.0) == "0.012 ± 0.020 (5 draws)"
    assert floor_cell(None, None, None) == "-"


def test_extra_floor_draws_are_new_sets_beside_the_recorded_draw():
    one = set_variants("P1", "n0", KnockinConfig(k_bins=(8,), sets=("global", "random")), {"P1": list(range(30))}, None,
                       270)
    five = set_variants("P1", "n0", KnockinConfig(k_bins=(8,), sets=("global", "random"), floor_draws=5),
                        {"P1": list(range(30))}, None, 270)
    assert five[("random", 8)] == one[("random", 8)]  # the recorded draw is unchanged
    extra = sorted(s for s, _ in five if s not in ("global", "random"))
    assert extra == ["random1", "random2", "random3", "random4"]
    assert len({tuple(five[(s, 8)]) for s in ("random", *extra)}) == 5
    assert all(len(five[(s, 8)]) == 8 for s in extra)
    assert [floor_draw(s) for s in ("random", "random3", "global", "randomx")] == [0, 3, None, None]


def _row(note, event, set_name, recovery, gated=True, phase="P1", k=8):
    # a range of 2 nats above a corrupted margin of -1: the raw gain is twice the recovery
    return {"note_id": note, "event_id": event, "phase": phase, "k": k, "set": set_name, "gated": gated,
            "recovery": recovery if gated else math.nan, "draw": 0, "m_corr": -1.0,
            "m_set": -1.0 + 2 * recovery if gated else 0.0}


def test_own_heads_rows_and_summary_carry_counts_and_the_floor_spread():
    notes = {}
    for n in range(3):
        kin = []
        for e in range(4):
            gated = e != 3
            kin += [_row(f"n{n}", f"e{e}", "global", 0.8, gated), _row(f"n{n}", f"e{e}", "random", 0.1 * n, gated)]
            kin += [_row(f"n{n}", f"e{e}", f"random{d}", 0.05 * d, gated) for d in range(1, 5)]
        nec = [{"phase": "P1", "k": 8, "necessity": 0.5, "clean_margin": 2.0, "ablated_margin": 1.0}] * 4
        notes[f"n{n}"] = m4_rows(f"n{n}", nec, kin, (8,))
    rows = [r for rs in notes.values() for r in rs]
    assert rows[0]["recovery_random"] == 0.0 and rows[0]["n_gated"] == 3
    assert rows[0]["gain_own_nats"] == pytest.approx(1.6)  # the own set's gated events only
    assert np.allclose(rows[0]["recovery_random_floors"], [0.0, 0.05, 0.1, 0.15, 0.2])
    m = summary_metrics(pd.DataFrame(rows), pd.DataFrame(), (8,), 8)
    assert m["m4/P1/k8/n_gated"] == 9 and m["m4/P1/k8/n_notes"] == 3
    assert math.isclose(m["m4/P1/k8/recovery_random"], 0.1)  # the recorded draw: median over notes of draw 0
    assert m["m4/P1/k8/recovery_random_floor_draws"] == 5
    assert math.isclose(m["m4/P1/k8/recovery_random_floor_mean"], (0.1 + 0.05 + 0.1 + 0.15 + 0.2) / 5)
    assert m["m4/P1/k8/recovery_random_floor_sd"] > 0
    assert summary_value("m4/P1/k8/recovery_own", m) == TOO_SMALL  # 9 gated events
    assert summary_value("m4/P1/k8/recovery_own", {**m, "m4/P1/k8/n_gated": 10.0}) == "0.8"


def test_knockin_counts_and_floor_spread():
    per_note = pd.DataFrame([
        {"note_id": f"n{i}", "phase": "P1", "set": s, "k": 8, "recovery": 0.9 if s == "global" else 0.1,
         "n_gated": 4, "necessity": 0.5, "n_events": 5} for i in range(3) for s in ("global", "random")])
    floor_rows = [{"note_id": f"n{i}", "phase": "P1", "set": s, "k": 8, "recovery": 0.1 * d, "n_gated": 4}
                  for i in range(3) for d, s in enumerate(("random", "random1", "random2"))]
    m = knockin_count_metrics(per_note, floor_rows)
    assert m["P1/k8/n_gated"] == 12 and m["P1/k8/n_notes"] == 3
    assert math.isclose(m["P1/k8/recovery/random_floor_mean"], 0.1)
    assert m["P1/k8/recovery/random_floor_draws"] == 3
    assert summary_value("P1/k8/recovery/global", {**m, "P1/k8/recovery/global": 0.9}) == "0.9"
    assert summary_value("P1/k8/recovery/global", {"P1/k8/recovery/global": 0.9, "P1/k8/n_gated": 2.0,
                                                   "P1/k8/n_notes": 1.0}) == TOO_SMALL


def test_the_seed_table_shows_counts_and_too_small_cells():
    seeds = pd.DataFrame([{"model": "m", "arm": "a", "precision": "bf16", "seed": 0, "P1.k8.own": 0.8,
                           "P1.k8.random": 0.1, "P1.k8.n_gated": 12.0, "P1.k8.n_notes": 3.0,
                           "P2.k8.own": 0.7, "P2.k8.random": 0.2, "P2.k8.n_gated": 4.0, "P2.k8.n_notes": 2.0}])
    shown = own_heads_seed_display(seeds).iloc[0]
    assert shown["P1 k8"] == "0.800 (0.100) [12 ev / 3 notes]"
    assert shown["P2 k8"] == f"{TOO_SMALL} [4 ev / 2 notes]"
