"""The audit labels file and Table 24's strata, and Table 22's student pairs, by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis.audit import read_audit_labels, stratified_readouts
from mistill.errors import MistillInputError


def test_labels_file_is_read_and_bad_rows_are_named(tmp_path):
    good = tmp_path / "audit.csv"
    good.write_text("note_id,event_id,label\n7,7:P2C:1,verified_rejection\n7,7:P2C:4,enumeration\n")
    labels = read_audit_labels(good)
    assert list(labels["note_id"]) == ["7", "7"] and list(labels["label"]) == ["verified_rejection", "enumeration"]
    (tmp_path / "cols.csv").write_text("note_id,label\n7,enumeration\n")
    with pytest.raises(MistillInputError, match="missing column") as err:
        read_audit_labels(tmp_path / "cols.csv")
    assert err.value.field == "event_id"
    (tmp_path / "empty.csv").write_text("note_id,event_id,label\n7,7:P2C:1,\n")
    with pytest.raises(MistillInputError, match="line 2: empty label"):
        read_audit_labels(tmp_path / "empty.csv")
    (tmp_path / "twice.csv").write_text("note_id,event_id,label\n7,e1,enumeration\n7,e1,other\n")
    with pytest.raises(MistillInputError, match="line 3: event e1 labeled twice"):
        read_audit_labels(tmp_path / "twice.csv")
    with pytest.raises(MistillInputError, match="does not exist"):
        read_audit_labels(tmp_path / "missing.csv")


def test_strata_by_hand():
    labels = pd.DataFrame({"note_id": ["a", "a", "b", "b"], "event_id": ["e1", "e2", "e3", "e4"],
                           "label": ["verified_rejection", "enumeration", "verified_rejection", "other"]})
    m1 = pd.DataFrame({"note_id": ["a", "a", "b", "b", "b"], "event_id": ["e1", "e2", "e3", "e4", "e5"],
                       "kind": ["P2C", "P2C", "P2C", "P2C", "P2C"], "margin": [0.5, -1.0, -0.2, 2.0, 3.0]})
    kin = pd.DataFrame({"note_id": ["a", "a", "b", "b"], "event_id": ["e1", "e1", "e3", "e4"],
                        "phase": ["P2C"] * 4, "k": [40, 8, 40, 40], "recovery": [0.8, 0.1, 0.4, 0.9],
                        "gated": [True, True, True, False]})
    t = stratified_readouts(labels, m1, kin, k=40).set_index("stratum")
    assert t.loc["verified rejection", "m1_n"] == 2 and t.loc["verified rejection", "m1_p_pos"] == 0.5
    assert t.loc["other labeled", "m1_n"] == 2 and t.loc["other labeled", "m1_p_pos"] == 0.5  # e5 is unlabeled
    assert t.loc["verified rejection", "knockin_n"] == 2
    assert t.loc["verified rejection", "recovery_k40"] == pytest.approx(0.6)  # e1 and e3 at k=40
    assert t.loc["other labeled", "knockin_n"] == 0 and math.isnan(t.loc["other labeled", "recovery_k40"])
    empty = stratified_readouts(labels, m1, pd.DataFrame(), k=40).set_index("stratum")
    assert empty.loc["verified rejection", "knockin_n"] == 0


def test_student_edit_pairs_by_hand():
    from analysis.edit_tables import edit_pairs_table, note_effects

    def run(arm, seed, effects):  # effects: {(note, event): (neutral, unrelated, other_category)}
        return pd.DataFrame([{"run_id": f"{arm}{seed}", "arm": arm, "seed": seed, "note_id": n, "event_id": e,
                              "neutral": a, "unrelated": b, "other_category": c}
                             for (n, e), (a, b, c) in effects.items()])

    ref0 = run("vanilla-bf16", 0, {("n1", "e1"): (1.0, 1.0, 1.0), ("n1", "e2"): (3.0, None, 3.0),
                                   ("n2", "e3"): (0.0, 0.0, 0.0)})
    ref1 = run("vanilla-bf16", 1, {("n1", "e1"): (2.0, 2.0, 2.0), ("n2", "e3"): (1.0, 1.0, 1.0)})
    mis0 = run("mistill", 0, {("n1", "e1"): (2.0, 2.0, 2.0), ("n2", "e3"): (1.0, 1.0, 4.0),
                              ("n2", "e9"): (9.0, 9.0, 9.0)})  # e9: the reference did not edit it
    mis1 = run("mistill", 1, {("n1", "e1"): (2.0, 2.0, 2.0), ("n2", "e3"): (0.0, 0.0, 0.0)})
    assert note_effects(ref0) == {"n1": 2.0, "n2": 0.0}  # e2's mean skips its missing replacement
    t = edit_pairs_table(pd.concat([ref0, ref1, mis0, mis1]), "vanilla-bf16", n_resamples=50)
    pairs = t.set_index("pair")
    # seed 0: shared events e1, e3 -> n1: 2 - 1, n2: 2 - 0; seed 1: n1: 2 - 2, n2: 0 - 1
    assert pairs.loc["seed 0 vs 0", "difference"] == pytest.approx(1.5)
    assert pairs.loc["seed 1 vs 1", "difference"] == pytest.approx(-0.5)
    pooled = pairs.loc["pooled (note-clustered)"]
    assert pooled["difference"] == pytest.approx(np.mean([(1 + 0) / 2, (2 - 1) / 2]))
    assert pooled["n_notes"] == 2 and set(t["arm"]) == {"mistill"} and set(t["reference"]) == {"vanilla-bf16"}
    assert edit_pairs_table(pd.concat([mis0, mis1]), "vanilla-bf16").empty  # no reference runs
    # several student models and both references: each model's arms against its own references
    # only; a model without an fp32 reference gets no rows against it
    smol = [r.assign(model="smollm3-3b") for r in (ref0, ref1, mis0, mis1)]
    qwen = [r.assign(model="qwen3-4b") for r in (ref0, ref1, mis0, mis1)]
    fp32 = run("vanilla-fp32", 0, {("n1", "e1"): (0.0, 0.0, 0.0), ("n2", "e3"): (0.0, 0.0, 0.0)}).assign(
        model="smollm3-3b")
    both = edit_pairs_table(pd.concat([*smol, *qwen, fp32]), ("vanilla-bf16", "vanilla-fp32"), n_resamples=50)
    pooled = both[both["pair"] == "pooled (note-clustered)"].set_index(["model", "reference"])
    assert set(pooled.index) == {("qwen3-4b", "vanilla-bf16"), ("smollm3-3b", "vanilla-bf16"),
                                 ("smollm3-3b", "vanilla-fp32")}
    assert pooled.loc[("qwen3-4b", "vanilla-bf16"), "difference"] == pytest.approx(pooled_diff := np.mean([0.5, 0.5]))
    assert pooled.loc[("smollm3-3b", "vanilla-bf16"), "difference"] == pytest.approx(pooled_diff)
    # against the one fp32 seed, seed 0 pairs with it: n1 2 - 0, n2 2 - 0 over the shared e1, e3
    fp = both[(both["reference"] == "vanilla-fp32") & (both["pair"] == "seed 0 vs 0")]
    assert len(fp) == 1 and fp["difference"].iloc[0] == pytest.approx(np.mean([2.0, 2.0]))
