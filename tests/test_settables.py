"""Necessity and knock-in summary tables (mistill.instrument.settables) on hand-built rows."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from mistill.errors import MistillInputError
from mistill.instrument.settables import format_cell, sets_long, sets_table, to_latex, to_markdown

NAN = float("nan")


def row(note, phase, k, s, nec, rec, n_events=10, n_gated=8):
    return {"note_id": note, "phase": phase, "k": k, "set": s, "necessity": nec,
            "recovery": rec, "n_events": n_events, "n_gated": n_gated}


def p1_rows():
    nec = {"global": [0.6, 0.7, 0.8, 0.5], "random": [0.1, 0.0, 0.9, 0.5],
           "bottom": [-0.3, -0.2, -0.1, -0.4], "own": [0.65, 0.6, 0.8, 0.4]}
    rec = {"global": [0.7, 0.6, NAN, 0.8], "random": [0.1, 0.0, 0.0, 0.9],
           "bottom": [-0.1, -0.2, -0.3, -0.4], "own": [0.5, 0.7, 0.2, 0.1]}
    return [row(f"n{i}", "P1", 8, s, nec[s][i], rec[s][i]) for s in nec for i in range(4)]


def p2_rows():
    # ten notes, the global set beats random on all of them; no own ranking at this k
    out = []
    for i in range(10):
        out.append(row(f"m{i}", "P2", 3, "global", 0.5 + i / 100, 0.4))
        out.append(row(f"m{i}", "P2", 3, "random", 0.0, 0.05))
    return out


def test_sets_long_medians_and_counts():
    df = sets_long(p1_rows())
    g = df.set_index("set")
    assert list(df["set"]) == ["global", "random", "bottom", "own"]
    assert g.at["global", "necessity"] == pytest.approx(0.65)
    assert g.at["global", "recovery"] == pytest.approx(0.7)      # NaN dropped: [0.6, 0.7, 0.8]
    assert g.at["global", "n_recovery"] == 3 and g.at["global", "n_necessity"] == 4
    assert g.at["bottom", "necessity"] == pytest.approx(-0.25)
    assert g.at["own", "recovery"] == pytest.approx(0.35)


def test_sets_table_wins_and_sign_tests():
    t = sets_table(p2_rows() + p1_rows())           # P2 rows first: output still P1, P2
    assert list(zip(t["phase"], t["k"])) == [("P1", 8), ("P2", 3)]
    p1 = t.iloc[0]
    assert p1["necessity.global"] == pytest.approx(0.65)
    assert p1["necessity.random"] == pytest.approx(0.3)          # median of [0.1, 0, 0.9, 0.5]
    # necessity, global vs random: wins n0 n1, loss n2, tie n3
    assert (p1["necessity.wins_vs_random"], p1["necessity.losses_vs_random"],
            p1["necessity.ties_vs_random"], p1["necessity.n_vs_random"]) == (2, 1, 1, 4)
    assert p1["necessity.sign_p_vs_random"] == pytest.approx(1.0)
    # recovery, global vs random: n2 has no gated events, so 3 notes: wins n0 n1, loss n3
    assert (p1["recovery.wins_vs_random"], p1["recovery.losses_vs_random"],
            p1["recovery.n_vs_random"]) == (2, 1, 3)
    # global vs own: necessity wins n1, loss n0, tie n2, win n3; recovery wins n0 n3, loss n1
    assert (p1["necessity.wins_vs_own"], p1["necessity.losses_vs_own"],
            p1["necessity.ties_vs_own"]) == (2, 1, 1)
    assert (p1["recovery.wins_vs_own"], p1["recovery.losses_vs_own"]) == (2, 1)
    assert p1["n_necessity.own"] == 4
    p2 = t.iloc[1]
    assert p2["necessity.wins_vs_random"] == 10 and p2["recovery.wins_vs_random"] == 10
    assert p2["necessity.sign_p_vs_random"] == pytest.approx(2 * 0.5 ** 10)
    assert pd.isna(p2["necessity.own"]) and pd.isna(p2["necessity.wins_vs_own"])
    assert math.isnan(p2["necessity.sign_p_vs_own"])
    assert str(t["necessity.wins_vs_random"].dtype) == "Int64"


def test_sets_table_rejects_bad_rows():
    with pytest.raises(MistillInputError, match="note n0.*set"):
        sets_table(p1_rows() + [row("n0", "P1", 8, "global", 0.1, 0.1)])
    with pytest.raises(MistillInputError, match="unknown set"):
        sets_table([row("n0", "P1", 8, "best", 0.1, 0.1)])
    with pytest.raises(MistillInputError, match="recovery"):
        sets_table([{"note_id": "n0", "phase": "P1", "k": 8, "set": "global", "necessity": 1}])
    with pytest.raises(MistillInputError):
        sets_table([])


def test_format_cell():
    assert format_cell(0.65) == "0.650"
    assert format_cell(12) == "12"
    assert format_cell(NAN, missing="-") == "-"
    assert format_cell(pd.NA) == ""
    assert format_cell(3e-7, p_value=True) == "3.0e-07"
    assert format_cell(3e-7) == "0.000"
    assert format_cell("P1") == "P1"


def test_markdown_and_latex_writers():
    t = sets_table(p2_rows() + p1_rows())[["phase", "k", "necessity.global",
                                           "necessity.wins_vs_random",
                                           "necessity.sign_p_vs_random", "necessity.own"]]
    md = to_markdown(t).splitlines()
    assert md[0] == ("| phase | k | necessity.global | necessity.wins_vs_random | "
                     "necessity.sign_p_vs_random | necessity.own |")
    assert md[1] == "|---|---:|---:|---:|---:|---:|"
    assert md[2] == "| P1 | 8 | 0.650 | 2 | 1.000 | 0.625 |"
    assert md[3] == "| P2 | 3 | 0.545 | 10 | 0.002 | – |"
    tex = to_latex(t).splitlines()
    assert tex[0] == r"\begin{tabular}{lrrrrr}" and tex[1] == r"\toprule"
    assert tex[2].startswith(r"phase & k & necessity.global & necessity.wins\_vs\_random")
    assert tex[4] == r"P1 & 8 & 0.650 & 2 & 1.000 & 0.625 \\"
    assert tex[5] == r"P2 & 3 & 0.545 & 10 & 0.002 & -- \\"
    assert tex[-1] == r"\end{tabular}" and tex[-2] == r"\bottomrule"
