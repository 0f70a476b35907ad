"""Own-heads recovery on the events every student's tokenizer realizes (App. I, Table 38; R-D19).

A teacher event is realized by a student when the student's tokenizer decides at its anchor
(:mod:`mistill.instrument.events`); a tokenizer that merges digit runs drops some character and
contrastive events, so two student families are read on different event sets. The paper checks
that the cross-family comparison does not depend on the dropped events: restricted to the
contrastive events both tokenizers realize, each family's own-heads recovery gain over Vanilla
CoT-KD is recomputed (note-clustered, seed-matched).

Event ids are the teacher's (``<note>:<kind>:<i>``, numbered on the trace's text), so the same id
names the same decision in every student's ``own_heads_knockin_events`` table. A model realizes
the events that any of its ``own_heads`` runs measured on the teacher's traces; the aligned set is
their intersection over the student models. Per run and note, the recovery is the mean over its
gated events (the own set, draw 0, as ``recovery_own``), over every event and over the aligned
ones only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pandas as pd

from mistill import stats

__all__ = ["aligned_event_ids", "note_recovery", "aligned_gain_table"]

EXCLUDED_ARMS: tuple[str, ...] = ("teacher",)
"""Runs that are not a student's: their events do not enter the intersection."""


def aligned_event_ids(events: pd.DataFrame, phase: str = "P2C") -> set[str]:
    """The ``phase`` event ids every student model realizes.

    events: ``own_heads_knockin_events`` rows on the teacher's traces with ``model`` and ``arm``
    columns (the run's), one or more runs per model."""
    rows = events[(events["phase"] == phase) & ~events["arm"].isin(EXCLUDED_ARMS)]
    per_model = [set(grp["event_id"].astype(str)) for _, grp in rows.groupby("model", sort=True)]
    return set.intersection(*per_model) if per_model else set()


def note_recovery(events: pd.DataFrame, phase: str, k: int, keep: set[str] | None = None) -> dict[str, float]:
    """One run's per-note recovery at ``phase`` and ``k``: the mean over its gated events (only
    those in ``keep`` when given); a note without such an event is left out."""
    rows = events[(events["phase"] == phase) & (events["k"] == k)]
    rows = rows[rows["gated"].astype(str).str.lower().isin(("true", "1"))]
    if keep is not None:
        rows = rows[rows["event_id"].astype(str).isin(keep)]
    rows = rows[rows["recovery"].notna()]
    return {str(n): float(v) for n, v in rows.groupby("note_id")["recovery"].mean().items()}


def _by_seed(events: pd.DataFrame, model: str, arm: str, phase: str, k: int,
             keep: set[str] | None) -> dict[int, dict[str, float]]:
    mine = events[(events["model"] == model) & (events["arm"] == arm)]
    out = {int(seed): note_recovery(grp, phase, k, keep) for seed, grp in mine.groupby("seed", sort=True)}
    return {s: v for s, v in out.items() if v}


def _gain(arm_runs: Mapping[int, Mapping[str, float]], ref_runs: Mapping[int, Mapping[str, float]], *,
          n_resamples: int, seed: int) -> dict[str, float]:
    if not arm_runs or not ref_runs:
        return {}
    pairs = stats.seed_matched_pairs(arm_runs, ref_runs)
    c = stats.note_clustered({p: stats.per_note_differences(a, b) for p, (a, b) in pairs.items()},
                             n_resamples=n_resamples, seed=seed)
    return {"gain": c.overall.mean_diff, "low": c.overall.ci_low, "high": c.overall.ci_high,
            "n_notes": c.overall.n, "higher": c.overall.n_higher, "lower": c.overall.n_lower}


def aligned_gain_table(events: pd.DataFrame, reference_arm: str, *, phase: str = "P2C", k: int = 40,
                       n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """Per student model and arm (not the reference, the teacher or the untrained student): the
    recovery gain over ``reference_arm`` of the same model on every event the model realizes and
    on the aligned events (:func:`aligned_event_ids`), seed-matched and note-clustered.

    events: ``own_heads_knockin_events`` rows on the teacher's traces with the run's ``model``,
    ``arm`` and ``seed``. Columns: ``model, arm, reference, phase, k, n_events, n_aligned``, then
    ``all.<x>`` and ``aligned.<x>`` for ``x`` in gain, low, high, n_notes, higher, lower."""
    keep = aligned_event_ids(events, phase)
    rows = []
    students = events[~events["arm"].isin((*EXCLUDED_ARMS, "untrained", reference_arm))]
    for (model, arm), grp in students.groupby(["model", "arm"], sort=True):
        realized = set(events.loc[(events["model"] == model) & (events["phase"] == phase), "event_id"].astype(str))
        rec = {"model": model, "arm": arm, "reference": reference_arm, "phase": phase, "k": k,
               "n_events": len(realized), "n_aligned": len(keep & realized)}
        for name, subset in (("all", None), ("aligned", keep)):
            gain = _gain(_by_seed(events, model, arm, phase, k, subset),
                         _by_seed(events, model, reference_arm, phase, k, subset), n_resamples=n_resamples, seed=seed)
            rec.update({f"{name}.{key}": gain.get(key, math.nan)
                        for key in ("gain", "low", "high", "n_notes", "higher", "lower")})
        rows.append(rec)
    cols = ["model", "arm", "reference", "phase", "k", "n_events", "n_aligned",
            *(f"{name}.{key}" for name in ("all", "aligned")
              for key in ("gain", "low", "high", "n_notes", "higher", "lower"))]
    return pd.DataFrame(rows, columns=cols)
