"""Knock-in of another characterization's global sets (``knockin -P sets_run=...``; App. B's
instruction control, Table 4) on a tiny model: its own sets given as the other run change nothing,
another run's sets leave the own-set rows as they were, and a run that is not an attribute run is
refused."""

from __future__ import annotations

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from stage_fixtures import TINY, unique

from mistill.errors import MistillInputError
from mistill.stages.characterize import (AttributeConfig, EventsConfig, KnockinStageConfig, run_attribute, run_events,
                                         run_knockin)
from mistill.stages.prepare import PrepareConfig, run_prepare


def _rows(run_id: str, dst) -> pd.DataFrame:
    path = MlflowClient().download_artifacts(run_id, "per_note_sets.csv", str(dst))
    return pd.read_csv(path, dtype={"note_id": str}).sort_values(["note_id", "phase", "k", "set"]).reset_index(drop=True)


def test_knockin_of_another_runs_sets(tracking_uri, tmp_path, monkeypatch, pinned_code_version):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("sets"), n_notes=3, model=TINY))
    events = run_events(EventsConfig(prepare_run=prep, model=TINY, n_null=4))
    att = run_attribute(AttributeConfig(events_run=events, selftest_events=0, stability_splits=5))
    other = run_attribute(AttributeConfig(events_run=events, selftest_events=0, stability_splits=5, detach=True))
    base = KnockinStageConfig(attribute_run=att, k_bins=(2, 4), events_per_phase=3, floor_draws=1)
    own = _rows(run_knockin(base), tmp_path / "own")
    same = _rows(run_knockin(base.replace(sets_run=att)), tmp_path / "same")
    pd.testing.assert_frame_equal(own, same)
    cross_run = run_knockin(base.replace(sets_run=other))
    tags = MlflowClient().get_run(cross_run).data.tags
    assert tags["mistill.input.sets"] == other and tags["mistill.input.attribute"] == att
    cross = _rows(cross_run, tmp_path / "cross")
    # the notes, events and own sets are the attribute run's; only the global and bottom sets move
    kept = ["own", "random"]
    pd.testing.assert_frame_equal(own[own["set"].isin(kept)].reset_index(drop=True),
                                  cross[cross["set"].isin(kept)].reset_index(drop=True))
    with pytest.raises(MistillInputError) as err:
        run_knockin(base.replace(sets_run=events))
    assert err.value.field == "sets_run"
