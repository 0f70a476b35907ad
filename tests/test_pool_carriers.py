"""The report's ``pool_carriers`` table (App. M.3): the heads each arm's train run supervised and
the untrained student's own top-40, counted among the trained student's own top-40, on hand-built
runs of the real test MLflow server whose pools and rankings fix every count in advance."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from analysis_fixtures import STUDENT, make_run, train_arm
from mlflow.tracking import MlflowClient
from stage_fixtures import unique

from mistill.distill.pools import Pool
from mistill.stages.report import ReportConfig, run_report

pytestmark = pytest.mark.usefixtures("pinned_code_version")

N_LAYERS, N_HEADS = 8, 16
NAMES = [f"L{layer}H{head}" for layer in range(N_LAYERS) for head in range(N_HEADS)]
PHASES = ("P1", "P2", "P2C")

BASE = {"P1": NAMES[:50], "P2": NAMES[:40], "P2C": NAMES[:40]}
"""The untrained student's own ranking per phase (own_heads_sets.json lists its top 50 at P1)."""


def _ranking(from_base: int, extra: list[str], first: list[str] = ()) -> list[str]:
    """An own top-40: ``first`` (of the untrained student's top-8), ``extra`` (outside its top-50),
    then its ranks 40 - from_base .. 39."""
    out = [*first, *extra, *NAMES[40 - from_base:40]]
    assert len(out) == len(set(out)) == 40
    return out


BOTTOM = NAMES[88:]
"""The bottom-40 pool (every phase): heads none of the untrained student's top-50."""
OUTSIDE = NAMES[50:88]
"""Heads in neither the untrained student's top-50 nor the bottom-40 pool."""

CASES: dict[tuple[str, int], dict] = {
    # arm, seed -> its pool per phase (None: no attention term), its own ranking per phase, and per
    # phase (supervised heads among the own top-40, untrained top-40 among it)
    ("bottom40", 0): {"pool": {p: BOTTOM for p in PHASES},
                      "own": {"P1": _ranking(38, OUTSIDE[:2]), "P2": _ranking(28, OUTSIDE[:12]),
                              "P2C": _ranking(30, [BOTTOM[5], *OUTSIDE[:9]])},
                      "expect": {"P1": (0, 38), "P2": (0, 28), "P2C": (1, 30)}},
    ("bottom40", 1): {"pool": {p: BOTTOM for p in PHASES},
                      "own": {"P1": _ranking(38, OUTSIDE[2:4]), "P2": _ranking(28, OUTSIDE[10:22]),
                              "P2C": _ranking(31, OUTSIDE[20:29])},
                      "expect": {"P1": (0, 38), "P2": (0, 28), "P2C": (0, 31)}},
    ("top8", 0): {"pool": {p: NAMES[:8] for p in PHASES},
                  "own": {"P1": _ranking(30, OUTSIDE[:2], NAMES[:8]),
                          "P2": _ranking(23, OUTSIDE[:9], NAMES[:8]),
                          "P2C": _ranking(25, OUTSIDE[:7], NAMES[:8])},
                  "expect": {"P1": (8, 38), "P2": (8, 31), "P2C": (8, 33)}},
    ("top100", 0): {"pool": {p: NAMES[:100] for p in PHASES},
                    "own": {p: NAMES[:40] for p in PHASES},
                    "expect": {p: (40, 40) for p in PHASES}},
    ("vanilla-bf16", 0): {"pool": None,
                          "own": {p: _ranking(27, OUTSIDE[:13]) for p in PHASES},
                          "expect": {p: (None, 27) for p in PHASES}},
}

RANK_COUNTS = {"P1": (30, 120), "P2": (29, 300), "P2C": (28, 75)}
"""Notes and events behind bottom-40 seed 0's own ranking, per phase."""


def _pools(heads_by_phase: dict[str, list[str]]) -> dict:
    index = {n: i for i, n in enumerate(NAMES)}
    out = {}
    for phase, heads in heads_by_phase.items():
        n = len(heads)
        out[phase] = Pool(heads=tuple(index[h] for h in heads), weights=tuple([1.0 / n] * n),
                          name=f"{phase}:test-{n}", n_heads=N_HEADS).to_dict()
    out["P1_window"] = out["P1"]
    return out


def _own_run(uri: str, corpus: str, root: Path, arm: str, seed: int, ranking: dict[str, list[str]], *,
             train: str | None = None, tags: dict[str, str] | None = None) -> str:
    return make_run(uri, corpus, "own_heads", root, arm=arm, seed=seed, precision="bf16",
                    inputs={"train": train} if train else None,
                    tags={"mistill.split": "test", **(tags or {})},
                    metrics={"m4/P2C/k40/recovery_own": 0.5},
                    jsons={"own_heads_sets": {"rank_attribute": "", "random_panel": NAMES[:16], **ranking}})


@pytest.fixture(scope="module")
def carriers(tracking_uri, tmp_path_factory):
    corpus = unique("carriers")
    root = tmp_path_factory.mktemp("writers")
    _own_run(tracking_uri, corpus, root, "untrained", 0, BASE)
    events = make_run(tracking_uri, corpus, "events", root, metrics={
        f"events/{p}/realized": float(n) for p, (_, n) in RANK_COUNTS.items()})
    attribute = make_run(tracking_uri, corpus, "attribute", root, inputs={"events": events}, metrics={
        f"calib/{p}/n_notes": float(n) for p, (n, _) in RANK_COUNTS.items()})
    for (arm, seed), case in CASES.items():
        jsons = {"arm": train_arm(arm)}
        if case["pool"] is not None:
            jsons["student_pools"] = _pools(case["pool"])
        train = make_run(tracking_uri, corpus, "train", root, arm=arm, seed=seed, precision="bf16", jsons=jsons)
        rank = {"mistill.rank_attribute": attribute, "mistill.rank_events": events} \
            if (arm, seed) == ("bottom40", 0) else None
        _own_run(tracking_uri, corpus, root, arm, seed, case["own"], train=train, tags=rank)
    mp = pytest.MonkeyPatch()
    mp.setenv("MISTILL_ROOT", str(tmp_path_factory.mktemp("reader")))
    try:
        run_id = run_report(ReportConfig(corpus=corpus, bootstrap=50, corpus_bootstrap=50))
    finally:
        mp.undo()
    dst = tmp_path_factory.mktemp("read")
    client = MlflowClient()
    table = pd.read_csv(client.download_artifacts(run_id, "tables/pool_carriers.csv", str(dst)))
    shown = Path(client.download_artifacts(run_id, "tables/pool_carriers_display.md", str(dst))).read_text()
    return table, shown


def test_every_arm_seed_and_phase_holds_its_known_overlaps(carriers):
    table, _ = carriers
    assert sorted(set(zip(table["arm"], table["seed"]))) == sorted(CASES)
    assert (table["model"] == STUDENT).all() and len(table) == len(CASES) * len(PHASES)
    for (arm, seed), case in CASES.items():
        for phase in PHASES:
            row = table[(table["arm"] == arm) & (table["seed"] == seed) & (table["phase"] == phase)].iloc[0]
            pool_hits, base_hits = case["expect"][phase]
            assert row["own_top_k"] == 40 and row["base_top_k"] == 40
            assert row["base_carriers"] == base_hits
            assert row["base_carrier_share"] == pytest.approx(base_hits / 40)
            if pool_hits is None:
                assert pd.isna(row["pool_size"]) and pd.isna(row["pool_carriers"])
                assert row["note"] == "the train run logged no supervised pools"
            else:
                pool = case["pool"][phase]
                assert row["pool_size"] == len(pool) and row["pool_carriers"] == pool_hits
                assert row["pool_carrier_share"] == pytest.approx(pool_hits / len(pool))


def test_the_ranking_counts_come_from_the_runs_behind_the_own_ranking(carriers):
    table, _ = carriers
    bottom = table[(table["arm"] == "bottom40") & (table["seed"] == 0)].set_index("phase")
    for phase, (notes, events) in RANK_COUNTS.items():
        assert bottom.loc[phase, "rank_notes"] == notes and bottom.loc[phase, "rank_events"] == events
    others = table[~((table["arm"] == "bottom40") & (table["seed"] == 0))]
    assert others["rank_notes"].isna().all() and others["rank_events"].isna().all()


def test_the_display_prints_counts_of_their_totals(carriers):
    _, shown = carriers
    assert "1 of 40 (0.025)" in shown  # bottom-40 seed 0 at P2C
    assert "8 of 8 (1.000)" in shown  # top-8
    assert "40 of 100 (0.400)" in shown  # top-100
    assert "30 / 120" in shown
