"""App. I's k = 8 probe (R-D22): a named head moved into an arm's own ranking.

``place_head`` on hand-made rankings and the probe's settings; the report's ``own_heads_probe``
table on hand-built runs of the real test MLflow server, and the probe run kept out of the arm
tables. The stage with ``probe_head`` on a tiny model: ``tests/test_own_heads.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from analysis_fixtures import NOTES, make_run, own_metrics, own_notes, report_in
from mlflow.tracking import MlflowClient
from stage_fixtures import unique

from mistill import stats
from mistill.config import Config
from mistill.errors import MistillInputError
from mistill.evaluation.own_heads import place_head
from mistill.stages.own_heads import OwnHeadsConfig

pytestmark = pytest.mark.usefixtures("pinned_code_version")


def test_place_head_moves_one_head_and_shifts_the_rest():
    ranking = [5, 3, 9, 1, 7, 2, 8, 0, 4, 6, 11, 10]
    moved = place_head(ranking, 11, 8)  # rank 11 -> rank 8: ranks 8-10 shift down by one
    assert moved[:8] == [5, 3, 9, 1, 7, 2, 8, 11] and moved[8:] == [0, 4, 6, 10]
    assert sorted(moved) == sorted(ranking)
    assert place_head(ranking, 5, 3)[:3] == [3, 9, 5]  # moved down as well as up
    assert place_head(ranking, 9, 3) == ranking  # already there: unchanged
    assert place_head([1, 2], 7, 8) == [1, 2, 7]  # absent: inserted at the end of a short ranking
    with pytest.raises(ValueError):
        place_head(ranking, 1, 0)


def test_probe_settings_checked():
    with pytest.raises(MistillInputError, match="probe_head"):
        OwnHeadsConfig(model="embedded:smollm2-135m", probe_head="35:26")
    with pytest.raises(MistillInputError):
        OwnHeadsConfig(model="embedded:smollm2-135m", probe_head="L35H26", probe_phase="P3")
    with pytest.raises(MistillInputError):
        OwnHeadsConfig(model="embedded:smollm2-135m", probe_head="L35H26", probe_rank=0)
    assert OwnHeadsConfig(model="embedded:smollm2-135m", probe_head="L35H26").probe_rank == 8


# ------------------------------------------------------------------------ the report's table
@dataclasses.dataclass(frozen=True)
class _OwnHeadsLike(Config):
    """The params an ``own_heads`` run logs that the report reads (a different digest per run)."""

    tag: str = ""
    probe_head: str = ""
    probe_phase: str = "P2C"
    probe_rank: int = 8


PROBE_GAIN = 0.2
"""The probe run's P2C k=8 recovery is its arm's own-ranking value plus this, on every note."""


def _probe_notes() -> pd.DataFrame:
    rows = own_notes("mistill", 0)
    cell = (rows["phase"] == "P2C") & (rows["k"] == 8)
    rows.loc[cell, "recovery_own"] += PROBE_GAIN
    return rows


@pytest.fixture(scope="module")
def probe_report(tracking_uri, tmp_path_factory):
    corpus = unique("probe")
    root = tmp_path_factory.mktemp("writers")
    ids = {}
    for arm, seeds in (("vanilla-bf16", (0, 1)), ("mistill", (0,))):
        for seed in seeds:
            ids[(arm, seed)] = make_run(tracking_uri, corpus, "own_heads", root, arm=arm, seed=seed,
                                        precision="bf16", cfg=_OwnHeadsLike(tag=f"{arm}-{seed}"),
                                        metrics=own_metrics(arm, seed),
                                        tables={"own_heads_per_note": own_notes(arm, seed)})
    # the probe run is newer than its arm's own-ranking run of the same key
    ids["probe"] = make_run(tracking_uri, corpus, "own_heads", root, arm="mistill", seed=0, precision="bf16",
                            cfg=_OwnHeadsLike(tag="probe", probe_head="L1H2"),
                            metrics={**own_metrics("mistill", 0), "m4/P2C/k8/recovery_own": 0.99},
                            tables={"own_heads_per_note": _probe_notes()})
    run_id = report_in(corpus, tmp_path_factory, bootstrap=50, corpus_bootstrap=50, seed=1,
                       reference_arm="vanilla-bf16")
    return run_id, ids, tmp_path_factory.mktemp("read")


def _csv(report, name: str) -> pd.DataFrame:
    run_id, _, dst = report
    return pd.read_csv(Path(MlflowClient().download_artifacts(run_id, f"tables/{name}.csv", str(dst))))


def test_report_probe_table_against_a_hand_computation(probe_report):
    _, ids, _ = probe_report
    table = _csv(probe_report, "own_heads_probe")
    assert list(table["run_id"]) == [ids["probe"]]
    r = table.iloc[0]
    assert (r["probe_head"], r["phase"], int(r["k"]), int(r["n_notes"])) == ("L1H2", "P2C", 8, len(NOTES))
    own = own_notes("mistill", 0)
    base = own[(own["phase"] == "P2C") & (own["k"] == 8)].set_index("note_id")["recovery_own"]
    assert r["own_ranking"] == pytest.approx(base.median())
    assert r["probe"] == pytest.approx(base.median() + PROBE_GAIN)
    assert r["own_ranking_run"] == ids[("mistill", 0)]
    assert r["vs_own_ranking"] == pytest.approx(PROBE_GAIN)  # the same gain on every note
    # against the reference arm's two seeds: the one-seed probe pairs with each, note-clustered
    refs = {s: own_notes("vanilla-bf16", s) for s in (0, 1)}
    probe = (base + PROBE_GAIN).to_dict()
    by_note = {n: np.mean([probe[n] - refs[s].query("phase == 'P2C' and k == 8").set_index("note_id")
                           .at[n, "recovery_own"] for s in (0, 1)]) for n in NOTES}
    expected = stats.difference_tests(list(by_note.values()), n_resamples=50, seed=1)
    assert r["vs_reference"] == pytest.approx(expected.mean_diff)
    assert (r["vs_reference_low"], r["vs_reference_high"]) == pytest.approx((expected.ci_low, expected.ci_high))
    assert (int(r["notes_higher"]), int(r["notes_lower"])) == (expected.n_higher, expected.n_lower)


def test_probe_run_kept_out_of_the_arm_tables(probe_report):
    _, ids, _ = probe_report
    seeds = _csv(probe_report, "table45_own_heads_seeds")
    mistill = seeds[seeds["arm"] == "mistill"]
    assert len(mistill) == 1
    # the arm's own-ranking value, not the probe's 0.99 (the probe run is the newer of the two)
    col = [c for c in seeds.columns if "P2C" in c and "k8" in c and "own" in c][0]
    own = own_notes("mistill", 0)
    assert mistill.iloc[0][col] == pytest.approx(own.query("phase == 'P2C' and k == 8")["recovery_own"].median())
