"""NULL calibration, global sets, pooled weights, recurrence, sparsity and split-half stability
(mistill.instrument.calibration) on constructed importances with known answers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from mistill.errors import MistillInputError
from mistill.instrument.calibration import (
    NoteImportance,
    bottom_set,
    calibrate,
    global_set,
    head_name,
    head_sets_json,
    importance_c_intervals,
    kind_means,
    note_importance_c,
    own_ranking,
    pool_temperature,
    pooled_weights,
    ranking,
    recurrence,
    sparsity,
    split_half_stability,
)

N_LAYERS, N_PER_LAYER = 4, 12
H = N_LAYERS * N_PER_LAYER
NAMES = [head_name(h, N_PER_LAYER) for h in range(H)]
PLANTED = [10, 20, 30]   # decision heads: shifted at P1 events only
GENERIC = [5, 6]         # generic heads: shifted at every event, NULL included


def planted_notes(n_notes: int = 40, *, seed: int = 0, noise: float = 0.1, shift: float = 0.5,
                  generic: float = 1.0) -> list[NoteImportance]:
    rng = np.random.default_rng(seed)
    kinds = np.array(["NULL"] * 20 + ["P1"] * 10 + ["P2"] * 12)
    notes = []
    for i in range(n_notes):
        imp = rng.normal(0.0, noise, (kinds.size, H))
        imp[:, GENERIC] += generic
        p1 = np.flatnonzero(kinds == "P1")
        imp[np.ix_(p1, PLANTED)] += shift
        notes.append(NoteImportance(f"n{i:03d}", f"pt{i // 2}", kinds, imp.astype(np.float32)))
    return notes


@pytest.fixture(scope="module")
def notes() -> list[NoteImportance]:
    return planted_notes()


@pytest.fixture(scope="module")
def cal(notes):
    return calibrate(notes, phases=("P1", "P2"), seed=0)


# --------------------------------------------------------------------------------------------
# Per-note arithmetic


def test_kind_means_and_note_importance_c_hand_computed():
    ni = NoteImportance("a", "p", ["NULL", "P1", "NULL", "P1", "P2"],
                        [[1, 0], [4, 1], [3, 2], [6, 3], [9, 9]])
    m = kind_means(ni)
    assert set(m) == {"NULL", "P1", "P2"}
    np.testing.assert_allclose(m["NULL"], [2, 1])
    np.testing.assert_allclose(m["P1"], [5, 2])
    np.testing.assert_allclose(note_importance_c(ni, "P1"), [3, 1])
    assert note_importance_c(ni, "P2C") is None
    # P2 - NULL = [9, 9] - [2, 1] = [7, 8]: head 1 first
    np.testing.assert_array_equal(own_ranking(ni, "P2"), [1, 0])


def test_calibrate_hand_computed_two_notes():
    a = NoteImportance("a", "p1", ["NULL", "P1", "P1"], [[1, 1], [2, 5], [4, 1]])
    b = NoteImportance("b", "p2", ["NULL", "NULL", "P1"], [[0, 2], [2, 0], [1, 1]])
    c = NoteImportance("c", "p3", ["P1"], [[10, 10]])          # no NULL: raw only
    cal = calibrate([a, b, c], phases=("P1", "P2C"))
    # a: P1 mean [3,3] - NULL [1,1] = [2,2]; b: [1,1] - [1,1] = [0,0]
    np.testing.assert_allclose(cal.importance_c["P1"], [1.0, 1.0])
    np.testing.assert_allclose(cal.per_note_c["P1"], [[2, 2], [0, 0]])
    assert cal.note_ids["P1"] == ["a", "b"]
    assert (cal.n_notes["P1"], cal.n_notes_raw["P1"]) == (2, 3)
    np.testing.assert_allclose(cal.importance["P1"], [(3 + 1 + 10) / 3] * 2)
    np.testing.assert_allclose(cal.importance_null, [1.0, 1.0])  # a [1,1], b [1,1]
    assert cal.n_notes["P2C"] == 0 and np.isnan(cal.importance_c["P2C"]).all()
    assert cal.n_notes_split == 1  # only b has two NULL events
    s = cal.summary()
    assert s["calib/P2C/n_notes"] == 0.0 and s["calib/P1/n_notes"] == 2.0
    assert all(isinstance(v, float) for v in s.values())


# --------------------------------------------------------------------------------------------
# The calibration checks on planted data


def test_planted_heads_top_the_ranking_and_are_discoveries(cal):
    assert sorted(global_set(cal.importance_c["P1"], 3).tolist()) == PLANTED
    np.testing.assert_allclose(cal.importance_c["P1"][PLANTED], 0.5, atol=0.03)
    assert cal.positive_c["P1"][PLANTED].all()
    assert np.flatnonzero(cal.positive_c["P1"]).tolist() == PLANTED
    # the 45 null heads: BH at FDR 0.05 allows the odd false discovery (this seed makes one)
    assert int(cal.negative_c["P1"].sum()) <= 2
    # P2 carries no decision-specific signal at all
    assert int(cal.positive_c["P2"].sum()) + int(cal.negative_c["P2"].sum()) <= 2
    assert cal.n_notes == {"P1": 40, "P2": 40}


def test_generic_heads_fail_raw_null_but_vanish_under_importance_c(cal):
    # raw importance at NULL events discovers the generic heads where nothing is decided
    assert cal.positive_null[GENERIC].all()
    np.testing.assert_allclose(cal.importance_null[GENERIC], 1.0, atol=0.02)
    np.testing.assert_allclose(cal.importance["P1"][GENERIC], 1.0, atol=0.02)
    # ... and they lead the raw P1 ranking, but I_c subtracts them
    assert set(global_set(cal.importance["P1"], 2).tolist()) == set(GENERIC)
    assert np.abs(cal.importance_c["P1"][GENERIC]).max() < 0.02
    assert not cal.positive_c["P1"][GENERIC].any()
    assert not set(GENERIC) & set(global_set(cal.importance_c["P1"], 3).tolist())


def test_split_half_null_gives_no_discoveries_on_noise(cal, notes):
    assert cal.n_notes_split == 40
    assert int(cal.positive_split.sum()) == 0 and int(cal.negative_split.sum()) == 0
    # the floor is of the order of the s.e. of a mean over 40 notes of a 10-vs-10 contrast
    se = 0.1 * math.sqrt(2 / 10) / math.sqrt(40)
    assert 0 < cal.noise_floor < 4 * se
    assert cal.noise_floor == pytest.approx(np.percentile(np.abs(cal.split_half_diff), 95))
    s = cal.summary()
    assert s["calib/split_half/discoveries_pos"] == 0.0
    assert s["calib/split_half/noise_floor"] == pytest.approx(cal.noise_floor)
    assert s["calib/P1/discoveries_pos"] == 3.0 and s["calib/NULL/discoveries_pos"] >= 2.0


def test_split_half_does_not_depend_on_note_order(cal, notes):
    rev = calibrate(notes[::-1], phases=("P1", "P2"), seed=0)
    np.testing.assert_allclose(rev.split_half_diff, cal.split_half_diff, rtol=1e-12, atol=1e-15)
    assert rev.noise_floor == pytest.approx(cal.noise_floor)
    other = calibrate(notes, phases=("P1",), seed=1)
    assert not np.allclose(other.split_half_diff, cal.split_half_diff)


def test_exact_share_reported_when_masks_given():
    mask = np.array([[True, False], [True, True], [False, False]])
    ni = NoteImportance("a", "p", ["NULL", "P1", "P1"], np.ones((3, 2)), exact_mask=mask)
    cal = calibrate([ni], phases=("P1",))
    assert cal.exact_share["P1"] == pytest.approx(2 / 4)
    assert cal.summary()["calib/P1/exact_share"] == pytest.approx(0.5)


def test_intervals_bracket_the_mean(cal):
    ci = importance_c_intervals(cal, "P1", PLANTED + [0], n_resamples=200)
    for h in PLANTED:
        assert ci[h].low <= cal.importance_c["P1"][h] <= ci[h].high
        assert ci[h].low > 0  # planted heads' intervals exclude zero
    assert ci[0].estimate == pytest.approx(cal.importance_c["P1"][0])


# --------------------------------------------------------------------------------------------
# Rankings, sets and pooled weights


def test_ranking_ties_and_bottom_set():
    x = np.array([1.0, 3.0, 1.0, -2.0, 3.0, -2.0])
    np.testing.assert_array_equal(ranking(x), [1, 4, 0, 2, 3, 5])
    np.testing.assert_array_equal(global_set(x, 3), [1, 4, 0])
    np.testing.assert_array_equal(bottom_set(x, 3), [3, 5, 0])
    assert global_set(x, 100).size == 6  # clipped
    with pytest.raises(MistillInputError):
        ranking(np.array([1.0, np.nan]))


def test_pooled_weights_hand_computed_softmax():
    ic = np.array([3.0, 1.0, 2.0, 0.0])
    heads = [0, 2, 1]
    tau = math.sqrt(((3 - 2) ** 2 + 0 + (1 - 2) ** 2) / 3)  # s.d. (ddof 0) of [3, 2, 1]
    e = [math.exp(v / tau) for v in (3.0, 2.0, 1.0)]
    w = pooled_weights(ic, heads)
    np.testing.assert_allclose(w, [v / sum(e) for v in e], rtol=1e-12)
    assert w.sum() == pytest.approx(1.0)
    assert pool_temperature(ic, heads) == pytest.approx(tau)
    np.testing.assert_allclose(pooled_weights(ic, [3]), [1.0])
    np.testing.assert_allclose(pooled_weights(np.array([2.0, 2.0, 2.0]), [0, 1, 2]), [1 / 3] * 3)


def test_head_sets_json(cal):
    doc = head_sets_json(cal, NAMES, ks=(3, 8), pool_k=5)
    assert json.loads(json.dumps(doc)) == doc                     # JSON-serialisable
    assert json.dumps(doc, sort_keys=True) == json.dumps(
        head_sets_json(cal, NAMES, ks=(3, 8), pool_k=5), sort_keys=True)  # deterministic
    p1 = doc["P1"]
    assert len(p1["ranking"]) == H and sorted(p1["ranking"]) == sorted(NAMES)
    assert set(p1["top"]["3"]) == {NAMES[h] for h in PLANTED}
    assert p1["top"]["8"][:3] == p1["ranking"][:3] and len(p1["top"]["8"]) == 8
    assert p1["importance_c"] == sorted(p1["importance_c"], reverse=True)
    assert p1["bottom"]["3"] == [NAMES[h] for h in bottom_set(cal.importance_c["P1"], 3)]
    pool = p1["pool"]
    assert pool["k"] == 5 and pool["heads"] == p1["ranking"][:5]
    assert list(pool["weights"]) == pool["heads"]
    assert sum(pool["weights"].values()) == pytest.approx(1.0)
    top5 = global_set(cal.importance_c["P1"], 5)
    assert pool["tau"] == pytest.approx(float(cal.importance_c["P1"][top5].std()))
    assert doc["meta"]["n_notes"] == {"P1": 40, "P2": 40} and doc["meta"]["q"] == 0.05
    assert p1["discoveries_pos"] == 3
    with pytest.raises(MistillInputError):
        head_sets_json(cal, NAMES[:-1])


# --------------------------------------------------------------------------------------------
# Recurrence, sparsity, split-half stability


def test_recurrence_counts_and_bonferroni_on_a_planted_head():
    rng = np.random.default_rng(3)
    n_notes, top, planted = 30, 5, 7
    notes = []
    for i in range(n_notes):
        imp = rng.normal(0, 1, (4, H))
        imp[:, planted] += 10.0
        notes.append(NoteImportance(f"n{i}", f"p{i}", ["P1", "P1", "NULL", "NULL"], imp))
    df = recurrence(notes, "P1", top=top, head_names=NAMES)
    assert df.iloc[0]["head"] == planted and df.iloc[0]["name"] == NAMES[planted]
    assert df.iloc[0]["count"] == n_notes
    assert df["count"].sum() == n_notes * top
    assert df["expected"].iloc[0] == pytest.approx(n_notes * top / H)
    assert df.loc[df["recurrent"], "head"].tolist() == [planted]
    p = sps.binom.sf(n_notes - 1, n_notes, top / H)
    assert df.iloc[0]["p"] == pytest.approx(p)
    assert df.iloc[0]["p_bonferroni"] == pytest.approx(min(1.0, p * H))
    assert df.attrs["n_notes"] == n_notes and df.attrs["n_recurrent"] == 1
    # hand count: head 0 strongly in P1 only for the first 4 notes
    for ni in notes[:4]:
        ni.importance[ni.kinds == "P1", 0] += 5.0
    assert int(recurrence(notes, "P1", top=2).set_index("head").at[0, "count"]) == 4
    for ni in notes[:4]:
        ni.importance[ni.kinds == "P1", 0] -= 5.0


def test_sparsity_hand_built():
    x = np.array([5.0, -1.0, 3.0, 0.2, 1.0, 1.0])
    s = sparsity(x, 0.5)
    assert s["n_above_floor"] == 4 and s["heads_above_floor"] == [0, 2, 4, 5]
    assert s["sum_above_floor"] == pytest.approx(10.0)
    assert s["n_carry"] == 2 and s["heads_carry"] == [0, 2]   # 5 + 3 = 8 = 80% of 10
    assert sparsity(x, 0.5, share=0.81)["n_carry"] == 3
    assert sparsity(x, 10.0)["n_carry"] == 0
    assert sparsity(x, -5.0)["n_above_floor"] == 5   # negative I_c never counts


def test_split_half_stability_noise_free_is_perfect():
    ramp = np.linspace(1.0, -1.0, H)
    notes = []
    for i in range(12):
        imp = np.zeros((3, H))
        imp[1:] = ramp
        notes.append(NoteImportance(f"n{i}", f"p{i // 2}", ["NULL", "P1", "P1"], imp))
    res = split_half_stability(notes, "P1", n_splits=20, ks=(8, 16))
    assert res["spearman"] == pytest.approx(1.0)
    assert res["top_overlap"] == {"8": 8.0, "16": 16.0}
    assert res["full_overlap"] == 40.0 and res["full_k"] == 40
    assert (res["n_patients"], res["n_notes"]) == (6, 12)


def test_split_half_stability_high_on_planted_noisy_data(notes):
    res = split_half_stability(notes, "P1", n_splits=30, ks=(3,))
    assert res["top_overlap"]["3"] == 3.0
    assert res["full_overlap"] >= 30


def test_split_half_splits_patients_not_notes():
    # two patients with opposite rankings: every split puts one patient in each half
    ramp = np.linspace(1.0, -1.0, H)
    notes = []
    for i in range(6):
        sign = 1.0 if i < 3 else -1.0
        imp = np.zeros((2, H))
        imp[1] = sign * ramp
        notes.append(NoteImportance(f"n{i}", "A" if i < 3 else "B", ["NULL", "P1"], imp))
    res = split_half_stability(notes, "P1", n_splits=10, ks=(8,))
    assert res["spearman"] == pytest.approx(-1.0)
    assert res["top_overlap"]["8"] == 0.0
    with pytest.raises(MistillInputError):
        split_half_stability(notes[:3], "P1", n_splits=2)


# --------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_names_note_and_field():
    with pytest.raises(MistillInputError, match="note x.*kinds"):
        NoteImportance("x", "p", ["P1", "P9"], np.zeros((2, 3)))
    with pytest.raises(MistillInputError, match="importance"):
        NoteImportance("x", "p", ["P1"], np.zeros((2, 3)))
    with pytest.raises(MistillInputError, match="importance"):
        NoteImportance("x", "p", ["P1"], [[np.nan, 0.0]])
    with pytest.raises(MistillInputError, match="exact_mask"):
        NoteImportance("x", "p", ["P1"], np.zeros((1, 3)), exact_mask=np.ones((1, 2), bool))
    a = NoteImportance("a", "p", ["P1"], np.zeros((1, 3)))
    b = NoteImportance("b", "p", ["P1"], np.zeros((1, 4)))
    with pytest.raises(MistillInputError, match="note b"):
        calibrate([a, b])
    with pytest.raises(MistillInputError, match="note a.*note_id"):
        calibrate([a, a])
    with pytest.raises(MistillInputError, match="phases"):
        calibrate([a], phases=("NULL",))
    with pytest.raises(MistillInputError, match="note a"):
        own_ranking(a, "P1")
