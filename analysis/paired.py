"""Paired comparisons of two arms on the same notes, from tidy per-note tables.

Input frames have one row per (seed, note): columns ``seed``, ``note_id`` and the value
compared. Three comparisons, all with the note as the unit (App. L):

* :func:`seed_averaged` (task and fidelity, Table 43): per note the mean over each arm's seeds,
  then the paired tests of :func:`mistill.stats.paired_difference` on arm minus reference.
* :func:`seed_matched` (mechanism, Table 45): seed i against seed i (a one-seed side pairs
  with every seed of the other), per note the mean of its seed pairs' differences, then the
  tests over notes (:func:`mistill.stats.note_clustered`).
* :func:`corpus_f1` (Table 43, beside the per-note micro-F1): the difference of corpus-level
  micro-F1 from per-note ``tp, fp, fn``, notes resampled, seeds averaged.

The statistics themselves live in :mod:`mistill.stats`; this module only aligns notes and seeds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from mistill import stats
from mistill.errors import MistillInputError

__all__ = [
    "by_seed",
    "clustered_row",
    "corpus_f1",
    "corpus_row",
    "difference_row",
    "note_differences",
    "seed_averaged",
    "seed_matched",
]

COUNTS: tuple[str, str, str] = ("tp", "fp", "fn")


def _check(frame: pd.DataFrame, value: str, what: str) -> None:
    missing = [c for c in ("seed", "note_id", value) if c not in frame.columns]
    if missing:
        raise MistillInputError(f"{what} per-note table lacks {missing}", field=missing[0])
    if frame.empty:
        raise MistillInputError(f"{what} has no per-note rows", field=value)


def by_seed(frame: pd.DataFrame, value: str) -> dict[Hashable, dict[str, float]]:
    """``seed -> {note_id: value}`` (a seed's duplicate notes are averaged)."""
    _check(frame, value, "arm")
    out: dict[Hashable, dict[str, float]] = {}
    for seed, grp in frame.groupby("seed", sort=True, dropna=False):
        means = grp.groupby("note_id", sort=False)[value].mean()
        out[seed] = {str(n): float(v) for n, v in means.items()}
    return out


def _note_means(frame: pd.DataFrame, value: str) -> pd.Series:
    """Per note, the mean over seeds of the value (a note's missing seeds are left out)."""
    return frame.groupby("note_id", sort=True)[value].mean()


def note_differences(arm: pd.DataFrame, ref: pd.DataFrame, value: str) -> pd.Series:
    """Per note (common to both arms), seed-averaged ``arm - ref``; sorted by note id."""
    _check(arm, value, "arm")
    _check(ref, value, "reference")
    a, b = _note_means(arm, value), _note_means(ref, value)
    common = a.index.intersection(b.index)
    return (a.loc[common] - b.loc[common]).sort_index()


def seed_averaged(arm: pd.DataFrame, ref: pd.DataFrame, value: str, *,
                  n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0) -> stats.PairedDifference:
    """Paired tests on the seed-averaged per-note ``value``, arm minus reference."""
    diffs = note_differences(arm, ref, value)
    if diffs.empty:
        raise MistillInputError("the two arms share no note", field="note_id")
    return stats.difference_tests(diffs.to_numpy(), n_resamples=n_resamples, seed=seed)


def seed_matched(arm: pd.DataFrame, ref: pd.DataFrame, value: str, *,
                 n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0) -> stats.NoteClustered:
    """Seed-matched, note-clustered comparison of the per-note ``value``, arm minus reference."""
    pairs = stats.seed_matched_pairs(by_seed(arm, value), by_seed(ref, value))
    diffs = {pair: stats.per_note_differences(a, r) for pair, (a, r) in pairs.items()}
    if not any(diffs.values()):
        raise MistillInputError("the seed pairs share no note", field="note_id")
    return stats.note_clustered(diffs, n_resamples=n_resamples, seed=seed)


def _counts(frame: pd.DataFrame, notes: list[str]) -> np.ndarray:
    """``[seed, note, 3]`` counts over ``notes``, in that order."""
    out = []
    for _, grp in frame.groupby("seed", sort=True, dropna=False):
        per_note = grp.groupby("note_id")[list(COUNTS)].sum()
        out.append(per_note.loc[notes].to_numpy())
    return np.stack(out)


def corpus_f1(arm: pd.DataFrame, ref: pd.DataFrame, *,
              n_resamples: int = stats.N_BOOTSTRAP_CORPUS,
              seed: int = 0) -> stats.CorpusDifference:
    """Corpus-level micro-F1 of the arm minus the reference's (each the mean over its seeds),
    over the notes every seed of both arms scored; notes resampled ``n_resamples`` times."""
    for frame, what in ((arm, "arm"), (ref, "reference")):
        for col in COUNTS:
            _check(frame, col, what)
    notes: set[str] | None = None
    for frame in (arm, ref):
        for _, grp in frame.groupby("seed", dropna=False):
            have = set(grp["note_id"].astype(str))
            notes = have if notes is None else notes & have
    if not notes:
        raise MistillInputError("no note is scored by every seed of both arms", field="note_id")
    order = sorted(notes)
    arm = arm.assign(note_id=arm["note_id"].astype(str))
    ref = ref.assign(note_id=ref["note_id"].astype(str))
    return stats.corpus_micro_f1_difference_from_counts(
        _counts(arm, order), _counts(ref, order), n_resamples=n_resamples, seed=seed)


# ----------------------------------------------------------------------------- table rows
def difference_row(result: stats.PairedDifference) -> dict[str, Any]:
    """A flat row of a paired difference: ``n, mean_diff, ci_low, ci_high, median_diff,
    wilcoxon_p, sign_p, n_higher, n_lower, n_tied, n_dropped``."""
    row = dataclasses.asdict(result)
    order = ("n", "mean_diff", "ci_low", "ci_high", "median_diff", "wilcoxon_p", "sign_p",
             "n_higher", "n_lower", "n_tied", "n_dropped")
    return {k: row[k] for k in order}


def clustered_row(result: stats.NoteClustered) -> dict[str, Any]:
    """:func:`difference_row` of the note-clustered test, with the seed pairs counted and the
    pooled note-pair counts (descriptive)."""
    row = difference_row(result.overall)
    row.update(n_pairs=len(result.per_pair), pooled_higher=result.pooled_higher,
               pooled_lower=result.pooled_lower, pooled_tied=result.pooled_tied)
    return row


def corpus_row(result: stats.CorpusDifference, prefix: str = "corpus_") -> Mapping[str, Any]:
    """The corpus-level micro-F1 difference as ``<prefix>diff``, ``_ci_low``, ``_ci_high``,
    ``_p`` (bootstrap), beside the per-note row."""
    return {f"{prefix}diff": result.difference, f"{prefix}ci_low": result.ci_low,
            f"{prefix}ci_high": result.ci_high, f"{prefix}p": result.p_bootstrap}
