"""Table 59 (App. P) by hand: coverage, the ranked and the random heads' recovery over the
evaluable inputs, their paired difference, necessity, and the ranked set at the other k."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.transfer_tables import COLUMNS, transfer_screen_table


def _rows() -> pd.DataFrame:
    out = []
    for note, (ranked, rand, nec_r, nec_x, events, gated, at100) in {
            "a": (0.5, 0.1, 0.9, 0.1, 2, 1, 0.8), "b": (0.7, 0.0, 1.1, -0.1, 3, 2, 0.9),
            "c": (math.nan, 0.2, 0.5, 0.0, 1, 0, math.nan), "d": (math.nan, math.nan, math.nan, math.nan, 0, 0,
                                                                  math.nan)}.items():
        out += [{"note_id": note, "phase": "P2C", "k": 40, "set": "global", "recovery": ranked, "necessity": nec_r,
                 "n_events": events, "n_gated": gated},
                {"note_id": note, "phase": "P2C", "k": 40, "set": "random", "recovery": rand, "necessity": nec_x,
                 "n_events": events, "n_gated": gated},
                {"note_id": note, "phase": "P2C", "k": 100, "set": "global", "recovery": at100, "necessity": nec_r,
                 "n_events": events, "n_gated": gated},
                {"note_id": note, "phase": "P2", "k": 40, "set": "global", "recovery": 0.0, "necessity": 0.0,
                 "n_events": 1, "n_gated": 1}]
    return pd.DataFrame(out)


def test_table59_by_hand():
    t = transfer_screen_table(_rows(), n_resamples=200)
    assert list(t.columns) == COLUMNS
    at40 = t[t["k"] == 40].set_index("statistic")
    assert at40.loc["inputs with an event of the phase", "value"] == 3  # d has no P2C event
    assert at40.loc["evaluable inputs (a recovery for both sets)", "value"] == 2  # a, b
    assert (at40.loc["evaluable events of all events of the phase", "value"],
            at40.loc["evaluable events of all events of the phase", "n"]) == (3, 6)
    assert at40.loc["recovery, ranked heads", "value"] == pytest.approx(0.6)
    assert at40.loc["recovery, random heads", "value"] == pytest.approx(0.05)
    diff = at40.loc["recovery, ranked minus random"]
    assert diff["value"] == pytest.approx(0.55) and diff["ci_low"] <= 0.55 <= diff["ci_high"] and diff["n"] == 2
    assert at40.loc["inputs where ranked minus random is positive", "value"] == 2
    assert at40.loc["necessity, ranked heads", "value"] == pytest.approx(2.5 / 3)
    assert at40.loc["necessity, random heads", "value"] == pytest.approx(0.0)
    at100 = t[t["k"] == 100].set_index("statistic")
    assert at100.loc["recovery, ranked heads", "value"] == pytest.approx(0.85)
    assert transfer_screen_table(pd.DataFrame()).empty
