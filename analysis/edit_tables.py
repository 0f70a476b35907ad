"""Table 22: the trace edits on the students, an arm against the reference arm (paper App. E).

Each student's ``trace_edit`` run (teacher-forced on the teacher's traces) gives every event's
effect per replacement (``trace_edit_events``). Per seed pair of an arm and the reference arm
(:func:`mistill.stats.seed_matched_pairs`), on the events both runs edited: per note, the mean
over those events of each event's mean effect over the three replacements; the arm minus the
reference per note; then pooled over the seed pairs with the note as the cluster
(:func:`mistill.stats.note_clustered`).
"""

from __future__ import annotations

from collections.abc import Sequence

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


TABLE_COLUMNS: list[str] = ["model", "arm", "reference", "pair", "n_notes", "arm_mean", "reference_mean",
                             "difference", "ci_low", "ci_high", "notes_higher", "notes_lower", "sign_p"]


def edit_pairs_table(events: pd.DataFrame, references: str | Sequence[str], *,
                     n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """Per student model, one row per seed pair of every arm against each reference arm the model
    has runs of, and one pooled row per arm and reference (Table 22 sets each Mistill arm against
    its Vanilla CoT-KD students: the bf16 pair, the fp32 pairs, SmolLM3-3B against both precisions).

    events: ``trace_edit_events`` rows of the students' runs with their ``run_id``, ``arm``,
    ``seed`` and, where several student models are read, ``model`` (runs without an arm are left
    out). references: the reference arm, or several.
    """
    refs = (references,) if isinstance(references, str) else tuple(references)
    if events.empty or "arm" not in events.columns:
        return pd.DataFrame(columns=TABLE_COLUMNS)
    ev = events[events["arm"].notna()]
    models = ev["model"].fillna("").astype(str) if "model" in ev.columns else pd.Series("", index=ev.index)
    rows = []
    for model, by_model in ev.groupby(models, sort=True):
        for reference in refs:
            ref = by_model[by_model["arm"] == reference]
            if ref.empty:
                continue
            ref_runs = {str(s): g for s, g in ref.groupby("seed", sort=True)}
            treated = by_model[~by_model["arm"].isin(refs)]
            for arm, arm_events in treated.groupby("arm", sort=True):
                rows += _arm_rows(str(model), str(arm), reference, arm_events, ref_runs, n_resamples, seed)
    return pd.DataFrame(rows).reindex(columns=TABLE_COLUMNS)


def _arm_rows(model: str, arm: str, reference: str, arm_events: pd.DataFrame, ref_runs: dict[str, pd.DataFrame],
              n_resamples: int, seed: int) -> list[dict]:
    """One arm's rows against one reference: each seed pair, then pooled with the note as the cluster
    (none when the seeds do not pair or no note is shared)."""
    arm_runs = {str(s): g for s, g in arm_events.groupby("seed", sort=True)}
    try:
        pairs = stats.seed_matched_pairs(arm_runs, ref_runs)
    except MistillInputError:
        return []
    diffs, means = {}, {}
    for (s_arm, s_ref), (a, r) in pairs.items():
        shared = _edited(a) & _edited(r)
        na, nr = note_effects(a, shared), note_effects(r, shared)
        diffs[(s_arm, s_ref)] = stats.per_note_differences(na, nr)
        means[(s_arm, s_ref)] = (na, nr)
    if not any(diffs.values()):
        return []
    clustered = stats.note_clustered(diffs, n_resamples=n_resamples, seed=seed)
    head = {"model": model, "arm": arm, "reference": reference}
    rows = []
    for pair, test in clustered.per_pair.items():
        na, nr = means[pair]
        rows.append({**head, "pair": f"seed {pair[0]} vs {pair[1]}", "n_notes": test.n, "arm_mean": _mean(na),
                     "reference_mean": _mean(nr), "difference": test.mean_diff, "ci_low": test.ci_low,
                     "ci_high": test.ci_high, "notes_higher": test.n_higher, "notes_lower": test.n_lower,
                     "sign_p": test.sign_p})
    o = clustered.overall
    rows.append({**head, "pair": "pooled (note-clustered)", "n_notes": o.n, "difference": o.mean_diff,
                 "ci_low": o.ci_low, "ci_high": o.ci_high, "notes_higher": o.n_higher, "notes_lower": o.n_lower,
                 "sign_p": o.sign_p})
    return rows


def _mean(values: dict[str, float]) -> float:
    return float(pd.Series(values, dtype=float).mean()) if values else float("nan")


__all__ = ["TABLE_COLUMNS", "note_effects", "edit_pairs_table"]
