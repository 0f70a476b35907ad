"""Table 59 (App. P) by hand: coverage, the ranked and the random heads' recovery over the
evaluable inputs, their paired difference, necessity, the ranked set at the other k, and the
earlier-naming read-back against the control panels."""

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


def test_readback_rows_by_hand():
    # per input the N share of the ranked heads (top) and the two control panels; input c lacks
    # the bottom panel's value, so the ranked-minus-bottom pairing reads a and b only
    notes = pd.DataFrame([{"note_id": n, "group": g, "n_share": v, "n_events": 2}
                          for n, vals in {"a": (0.30, 0.05, 0.10), "b": (0.20, 0.04, 0.25),
                                          "c": (0.40, 0.02, math.nan)}.items()
                          for g, v in zip(("top", "random", "bottom"), vals)])
    t = transfer_screen_table(_rows(), n_resamples=200, readback=notes)
    assert list(t.columns) == COLUMNS
    by = t[t["k"] == 40].set_index("statistic")
    assert by.loc["recovery, ranked minus random", "value"] == pytest.approx(0.55)  # the knock-in rows stay
    assert by.loc["read-back on the earlier namings, ranked heads", "value"] == pytest.approx(0.3)
    rand = by.loc["read-back, ranked minus random"]
    assert rand["value"] == pytest.approx((0.25 + 0.16 + 0.38) / 3) and rand["n"] == 3
    assert rand["ci_low"] <= rand["value"] <= rand["ci_high"]
    assert by.loc["inputs where the ranked heads read back more than random", "value"] == 3
    bottom = by.loc["read-back, ranked minus bottom"]
    assert bottom["value"] == pytest.approx((0.20 - 0.05) / 2) and bottom["n"] == 2
    assert by.loc["inputs where the ranked heads read back more than bottom", "value"] == 1
    # without a read-back the table is the knock-in's alone
    assert not transfer_screen_table(_rows(), n_resamples=200)["statistic"].str.startswith("read-back").any()


def test_native_row_by_hand():
    # the teacher's answers graded against the inputs' gold labels, pooled over the inputs with gold
    gens = pd.DataFrame({"note_id": ["a", "b", "c"], "tp": [2, 0, 1], "fp": [1, 3, 1], "fn": [0, 0, 1],
                         "n_gold": [2, 0, 2]})
    t = transfer_screen_table(_rows(), n_resamples=200, generations=gens)
    row = t.set_index("statistic").loc["native micro-F1 of the teacher's answers"]
    assert row["value"] == pytest.approx(2 * 3 / (2 * 3 + 2 + 1)) and row["n"] == 2  # b has no gold label
    assert row["ci_low"] <= row["value"] <= row["ci_high"]
    assert "native micro-F1 of the teacher's answers" not in set(transfer_screen_table(_rows())["statistic"])
    # beside it, the retrieval baseline's top labels graded on the same inputs (those with gold)
    gens = gens.assign(retrieval_tp=[1, 0, 2], retrieval_fp=[4, 5, 3], retrieval_fn=[1, 0, 0], retrieval_top=5)
    by = transfer_screen_table(_rows(), n_resamples=200, generations=gens).set_index("statistic")
    row = by.loc["micro-F1 of the retrieval ranking's top 5"]
    assert row["value"] == pytest.approx(2 * 3 / (2 * 3 + 7 + 1)) and row["n"] == 2
    assert row["ci_low"] <= row["value"] <= row["ci_high"]
    assert by.loc["native micro-F1 of the teacher's answers", "value"] == pytest.approx(2 * 3 / (2 * 3 + 2 + 1))
