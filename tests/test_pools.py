"""Head pools from head_sets.json: top-k softmax weights by hand, bottom/random carrying the
top-k profile, seeded random pools, the uniform control, the P1 window fallback."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from mistill.distill.pools import Pool, model_pools, pool_from_head_sets
from mistill.errors import MistillInputError
from mistill.instrument.calibration import NoteImportance, calibrate, head_name, head_sets_json

N_LAYERS, N_PER_LAYER = 5, 4
H = N_LAYERS * N_PER_LAYER
NAMES = [head_name(h, N_PER_LAYER) for h in range(H)]


def hand_doc(values: dict[str, list[float]]) -> dict:
    """A head_sets document with given I_c per phase (flat order), ranked as the writer does."""
    doc: dict = {"meta": {"n_heads": H, "phases_missing": []}}
    for ph, x in values.items():
        order = sorted(range(H), key=lambda h: (-x[h], h))
        doc[ph] = {"ranking": [NAMES[h] for h in order], "importance_c": [x[h] for h in order]}
    return doc


# I_c by flat head: L3H1 = 2.0, L0H2 = 0.0 (then everything else below), L4H3 most negative
X = [-0.5] * H
X[3 * 4 + 1], X[0 * 4 + 2], X[1 * 4 + 0] = 2.0, 0.0, -1.0
X[4 * 4 + 3], X[2 * 4 + 2] = -3.0, -2.0


@pytest.fixture(scope="module")
def doc():
    rng = np.random.default_rng(1)
    return hand_doc({"P1": X, "P2": list(rng.normal(size=H)), "P2C": list(rng.normal(size=H))})


def test_top_weights_are_the_softmax_by_hand(doc):
    pool = pool_from_head_sets(doc, "P1", NAMES, k=2)
    assert pool.heads == (13, 2) and pool.names() == ["L3H1", "L0H2"]
    # tau = s.d. of (2, 0) = 1: w = softmax(2, 0)
    e2 = math.exp(2.0)
    assert pool.weights == pytest.approx((e2 / (e2 + 1), 1 / (e2 + 1)), abs=1e-12)
    assert sum(pool.weights) == pytest.approx(1.0)
    three = pool_from_head_sets(doc, "P1", NAMES, k=3)  # (2, 0, -0.5): tau = s.d.
    x = np.array([2.0, 0.0, -0.5])
    tau = math.sqrt(((x - x.mean()) ** 2).mean())
    w = np.exp(x / tau) / np.exp(x / tau).sum()
    assert three.heads[:2] == (13, 2) and three.weights == pytest.approx(tuple(w), abs=1e-12)
    assert pool.layers == (0, 3)
    by = pool.by_layer()
    assert list(by) == [0, 3]
    assert by[3][0].tolist() == [1] and by[0][0].tolist() == [2]
    assert by[3][1].dtype == torch.float32 and by[3][1].item() == pytest.approx(e2 / (e2 + 1))
    assert pool_from_head_sets(doc, "P1", NAMES, k=500).heads.__len__() == H  # k clipped


def test_pool_matches_the_calibration_writer():
    rng = np.random.default_rng(0)
    kinds = np.array(["NULL"] * 6 + ["P1"] * 4 + ["P2"] * 4 + ["P2C"] * 3)
    notes = [NoteImportance(f"n{i}", f"p{i}", kinds,
                            rng.normal(size=(kinds.size, H)).astype(np.float32))
             for i in range(6)]
    written = json.loads(json.dumps(head_sets_json(calibrate(notes), NAMES, ks=(3, 8),
                                                   pool_k=8)))
    for ph in ("P1", "P2", "P2C"):
        pool = pool_from_head_sets(written, ph, NAMES, k=8)
        assert pool.names() == written[ph]["pool"]["heads"] == written[ph]["top"]["8"]
        assert list(pool.weights) == pytest.approx(
            [written[ph]["pool"]["weights"][n] for n in pool.names()], abs=1e-12)
        bottom = pool_from_head_sets(written, ph, NAMES, k=8, mode="bottom")
        assert bottom.names() == written[ph]["bottom"]["8"]


def test_bottom_and_random_carry_the_top_profile(doc):
    for ph in ("P1", "P2C"):
        top = pool_from_head_sets(doc, ph, NAMES, k=6)
        bottom = pool_from_head_sets(doc, ph, NAMES, k=6, mode="bottom")
        rand = pool_from_head_sets(doc, ph, NAMES, k=6, mode="random", seed=0)
        assert bottom.weights == top.weights and rand.weights == top.weights
        assert len(set(rand.heads)) == 6 and all(0 <= h < H for h in rand.heads)
        assert set(rand.layers) <= set(top.layers)  # RandHeads: random heads of the same layers
        anywhere = pool_from_head_sets(doc, ph, NAMES, k=6, mode="random_all", seed=0)
        assert anywhere.weights == top.weights and len(set(anywhere.heads)) == 6
    bottom = pool_from_head_sets(doc, "P1", NAMES, k=3, mode="bottom")
    # most negative first: L4H3 (-3) takes the top head's weight, then L2H2 (-2), L1H0 (-1)
    assert bottom.names() == ["L4H3", "L2H2", "L1H0"]
    top = pool_from_head_sets(doc, "P1", NAMES, k=3)
    assert bottom.weights[0] == top.weights[0] == max(bottom.weights)
    assert not set(bottom.heads) & set(top.heads)


def test_random_pool_is_seeded(doc):
    a = pool_from_head_sets(doc, "P2", NAMES, k=8, mode="random", seed=0)
    b = pool_from_head_sets(doc, "P2", NAMES, k=8, mode="random", seed=0)
    c = pool_from_head_sets(doc, "P2", NAMES, k=8, mode="random", seed=1)
    assert a == b and a.heads != c.heads and a.weights == c.weights
    other_phase = pool_from_head_sets(doc, "P2C", NAMES, k=8, mode="random", seed=0)
    assert other_phase.heads != a.heads  # one seed, a different fixed draw per phase
    assert "seed0" in a.name and "seed1" in c.name


def test_uniform_pool_covers_the_top_layers(doc):
    top = pool_from_head_sets(doc, "P1", NAMES, k=2)  # layers 0 and 3
    uni = pool_from_head_sets(doc, "P1", NAMES, k=2, mode="uniform")
    assert uni.layers == top.layers == (0, 3)
    assert uni.heads == (0, 1, 2, 3, 12, 13, 14, 15)
    assert set(uni.weights) == {1 / 8} and sum(uni.weights) == pytest.approx(1.0)
    by = uni.by_layer()
    assert {layer: idx.tolist() for layer, (idx, _) in by.items()} == \
        {0: [0, 1, 2, 3], 3: [0, 1, 2, 3]}
    for p in ("P2", "P2C"):
        t = pool_from_head_sets(doc, p, NAMES, k=5)
        u = pool_from_head_sets(doc, p, NAMES, k=5, mode="uniform")
        assert set(u.heads) == {layer * N_PER_LAYER + h for layer in t.layers
                                for h in range(N_PER_LAYER)}


def test_model_pools_and_the_window_fallback(doc):
    pools = model_pools(doc, NAMES, k=4)
    assert set(pools) == {"P1", "P2", "P2C", "P1_window"}
    assert pools["P1_window"] == pools["P1"]
    for ph in ("P1", "P2", "P2C"):
        assert pools[ph] == pool_from_head_sets(doc, ph, NAMES, k=4)
    prose = hand_doc({"P1": list(reversed(X))})
    with_window = model_pools(doc, NAMES, k=4, window_head_sets=prose)
    win = with_window["P1_window"]
    assert win.heads == pool_from_head_sets(prose, "P1", NAMES, k=4).heads
    assert win.heads != pools["P1"].heads and win.name.startswith("P1_window:")
    assert with_window["P1"] == pools["P1"]
    rand = model_pools(doc, NAMES, k=4, mode="random", seed=3)
    assert rand["P1_window"] == rand["P1"]
    only_p2 = model_pools(doc, NAMES, k=4, phases=("P2",))
    assert set(only_p2) == {"P2"}


def test_bad_documents_and_names_raise(doc):
    missing = {"meta": {"phases_missing": ["P2C"]}, "P1": doc["P1"]}
    with pytest.raises(MistillInputError) as exc:
        pool_from_head_sets(missing, "P2C", NAMES)
    assert exc.value.field == "P2C" and "no note calibrated it" in str(exc.value)
    short = {"P1": {"ranking": doc["P1"]["ranking"][:-1],
                    "importance_c": doc["P1"]["importance_c"][:-1]}}
    with pytest.raises(MistillInputError):
        pool_from_head_sets(short, "P1", NAMES)
    with pytest.raises(MistillInputError):
        pool_from_head_sets(doc, "P1", NAMES, mode="best")
    with pytest.raises(MistillInputError):
        pool_from_head_sets(doc, "P1", list(reversed(NAMES)))  # not flat order
    with pytest.raises(MistillInputError):
        Pool(heads=(1, 2), weights=(0.5, 0.6), name="x", n_heads=4)
    pool = pool_from_head_sets(doc, "P1", NAMES, k=5)
    assert Pool.from_dict(json.loads(json.dumps(pool.to_dict()))) == pool
