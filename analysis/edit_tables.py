"""Table 22: the trace edits on the students, an arm against the reference arm (paper App. E).

Each student's ``trace_edit`` run (teacher-forced on the teacher's traces) gives every event's
effect per replacement (``trace_edit_events``). Per seed pair of an arm and the reference arm
(:func:`mistill.stats.seed_matched_pairs`), on the events both runs edited: per note, the mean
over those events of each event's mean effect over the three replacements; the arm minus the
reference per note; then pooled over the seed pairs with the note as the cluster
(:func:`mistill.stats.note_clustered`).
"""

from __future__ import annotations

import pandas as pd

from mistill import stats
from mistill.errors import MistillInputError

REPLACEMENTS = ("neutral", "unrelated", "other_category")


def note_effects(events: pd.DataFrame, keep: set[str] | None = None) -> dict[str, float]:
    """``note_id -> mean over its events of the mean effect over the replacements`` of one run
    (``keep``: only these event ids)."""
    e = events if keep is None else events[events["event_id"].isin(keep)]
    cols = [c for c in REPLACEMENTS if c in e.columns]
    effect = e[cols].apply(pd.to_numeric, errors="coerce").mean(axis=1, skipna=True)
    per_note = effect.groupby(e["note_id"].astype(str)).mean().dropna()
    return {str(k): float(v) for k, v in per_note.items()}


def _edited(events: pd.DataFrame) -> set[str]:
    cols = [c for c in REPLACEMENTS if c in events.columns]
    ok = events[cols].apply(pd.to_numeric, errors="coerce").notna().any(axis=1)
    return set(events.loc[ok, "event_id"].astype(str))


def edit_pairs_table(events: pd.DataFrame, reference_arm: str, *, n_resamples: int = stats.N_BOOTSTRAP,
                     seed: int = 0) -> pd.DataFrame:
    """One row per seed pair of every arm against ``reference_arm`` and one pooled row per arm.

    events: ``trace_edit_events`` rows of the students' runs with their ``run_id``, ``arm`` and
    ``seed`` (runs without an arm are left out).
    """
    cols = ["arm", "pair", "n_notes", "arm_mean", "reference_mean", "difference", "ci_low", "ci_high",
            "notes_higher", "notes_lower", "sign_p"]
    if events.empty or "arm" not in events.columns:
        return pd.DataFrame(columns=cols)
    ev = events[events["arm"].notna()]
    ref = ev[ev["arm"] == reference_arm]
    if ref.empty:
        return pd.DataFrame(columns=cols)
    ref_runs = {str(s): g for s, g in ref.groupby("seed", sort=True)}
    rows = []
    for arm, arm_events in ev[ev["arm"] != reference_arm].groupby("arm", sort=True):
        arm_runs = {str(s): g for s, g in arm_events.groupby("seed", sort=True)}
        try:
            pairs = stats.seed_matched_pairs(arm_runs, ref_runs)
        except MistillInputError:
            continue
        diffs, means = {}, {}
        for (s_arm, s_ref), (a, r) in pairs.items():
            shared = _edited(a) & _edited(r)
            na, nr = note_effects(a, shared), note_effects(r, shared)
            diffs[(s_arm, s_ref)] = stats.per_note_differences(na, nr)
            means[(s_arm, s_ref)] = (na, nr)
        if not any(diffs.values()):
            continue
        clustered = stats.note_clustered(diffs, n_resamples=n_resamples, seed=seed)
        for pair, test in clustered.per_pair.items():
            na, nr = means[pair]
            rows.append({"arm": arm, "pair": f"seed {pair[0]} vs {pair[1]}", "n_notes": test.n,
                         "arm_mean": _mean(na), "reference_mean": _mean(nr), "difference": test.mean_diff,
                         "ci_low": test.ci_low, "ci_high": test.ci_high, "notes_higher": test.n_higher,
                         "notes_lower": test.n_lower, "sign_p": test.sign_p})
        o = clustered.overall
        rows.append({"arm": arm, "pair": "pooled (note-clustered)", "n_notes": o.n, "difference": o.mean_diff,
                     "ci_low": o.ci_low, "ci_high": o.ci_high, "notes_higher": o.n_higher,
                     "notes_lower": o.n_lower, "sign_p": o.sign_p})
    return pd.DataFrame(rows).reindex(columns=cols)


def _mean(values: dict[str, float]) -> float:
    return float(pd.Series(values, dtype=float).mean()) if values else float("nan")


__all__ = ["note_effects", "edit_pairs_table"]
