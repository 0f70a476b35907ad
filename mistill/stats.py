"""Statistics of App. C, K and L. The note is the unit everywhere.

- Percentile bootstrap over notes (1,000 resamples, 95%) of a per-note statistic.
- Paired differences (arm minus reference, per note): mean difference with its bootstrap
  interval, two-sided Wilcoxon signed-rank p (zero differences dropped), exact two-sided sign
  test p, and the notes higher / lower / tied.
- Seed-matched comparisons, note-clustered: seed i of one arm against seed i of the other (a
  one-seed side pairs with every seed of the other); per note, the mean of its seed pairs'
  differences, then the tests over notes. The pooled note-pair counts are descriptive only.
- Corpus-level micro-F1 difference with notes resampled (10,000 resamples), from code sets or
  from per-note (tp, fp, fn) counts, several seeds of an arm averaged.
- Per-head one-sample t-tests across per-note means, Benjamini-Hochberg FDR, binomial
  recurrence tests with Bonferroni over heads.

Per-note values that are NaN (a note without events of a kind) are dropped and counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np

from mistill.errors import MistillInputError
from mistill.evaluation.metrics import set_counts

T = TypeVar("T")
U = TypeVar("U")

N_BOOTSTRAP = 1000
N_BOOTSTRAP_CORPUS = 10_000
_MAX_RESAMPLE_CELLS = 4_000_000  # resample index matrices are built in chunks of at most this


def _scipy_stats():
    """``scipy.stats``, imported where a test needs it."""
    # deferred: scipy.stats takes about half a second to import, at every process start otherwise
    from scipy import stats

    return stats


def pearson(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Pearson's correlation of two equal-length vectors (NaN where one is constant)."""
    return float(_scipy_stats().pearsonr(x, y).statistic)


def spearman(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Spearman's rank correlation of two equal-length vectors (NaN where one is constant)."""
    return float(_scipy_stats().spearmanr(x, y).statistic)


def exact_binomial_ci(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of the proportion ``k / n``."""
    ci = _scipy_stats().binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)


class CI(NamedTuple):
    """A point estimate with its percentile bootstrap interval."""

    estimate: float
    low: float
    high: float


def _finite_1d(values: Sequence[float] | np.ndarray, field: str) -> tuple[np.ndarray, int]:
    """Values as a float vector with NaNs dropped; also the number dropped."""
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1:
        raise MistillInputError(f"expected one value per note, got shape {arr.shape}", field=field)
    keep = ~np.isnan(arr)
    if not keep.any():
        raise MistillInputError("no per-note values to test", field=field)
    return arr[keep], int((~keep).sum())


def _resample_chunks(n: int, n_resamples: int, seed: int):
    """Yield ``[resample, note]`` index matrices, ``n_resamples`` rows in all, from one seeded RNG."""
    rng = np.random.default_rng(seed)
    rows = max(1, _MAX_RESAMPLE_CELLS // n)
    for start in range(0, n_resamples, rows):
        yield rng.integers(0, n, size=(min(rows, n_resamples - start), n))


def _percentiles(boot: np.ndarray, level: float) -> tuple[float, float]:
    tail = 100.0 * (1.0 - level) / 2.0
    low, high = np.percentile(boot, [tail, 100.0 - tail])
    return float(low), float(high)


def bootstrap_ci(values: Sequence[float] | np.ndarray,
                 stat: Callable[..., Any] = np.mean, n_resamples: int = N_BOOTSTRAP,
                 seed: int = 0, level: float = 0.95) -> CI:
    """Percentile bootstrap interval of ``stat`` over per-note ``values`` (notes resampled).

    ``stat`` is called as ``stat(matrix, axis=1)`` on a ``[resample, note]`` matrix when it
    accepts ``axis`` (numpy reductions do), else once per resample on a vector.
    """
    x, _ = _finite_1d(values, "values")
    parts = []
    for idx in _resample_chunks(len(x), n_resamples, seed):
        sample = x[idx]
        try:
            out = np.asarray(stat(sample, axis=1), dtype=float)
        except TypeError:
            out = None
        if out is None or out.shape != (len(idx),):
            out = np.array([stat(row) for row in sample], dtype=float)
        parts.append(out)
    return CI(float(stat(x)), *_percentiles(np.concatenate(parts), level))


def group_bootstrap_mean(values: Mapping[Hashable, float], groups: Mapping[Hashable, Hashable], *,
                         n_resamples: int = N_BOOTSTRAP, seed: int = 0, level: float = 0.95) -> CI:
    """The mean of per-item ``values`` with a percentile bootstrap over their groups: each
    resample draws the groups with replacement and takes the mean over every item of the drawn
    groups (App. O: questions, resampled by base-question group). NaN values are dropped; an
    item without a group raises, naming it."""
    items = [k for k, v in values.items() if not math.isnan(float(v))]
    if not items:
        raise MistillInputError("no values to resample", field="values")
    missing = [k for k in items if k not in groups]
    if missing:
        raise MistillInputError(f"{len(missing)} items have no group (first: {missing[0]})", note=str(missing[0]),
                                field="groups")
    names = sorted({str(groups[k]) for k in items})
    col = {g: j for j, g in enumerate(names)}
    sums, counts = np.zeros(len(names)), np.zeros(len(names))
    for k in items:
        j = col[str(groups[k])]
        sums[j] += float(values[k])
        counts[j] += 1
    boot = np.concatenate([sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
                           for idx in _resample_chunks(len(names), n_resamples, seed)])
    return CI(float(sums.sum() / counts.sum()), *_percentiles(boot, level))


# ---------------------------------------------------------------------------------------------
# Paired tests over notes


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided sign test p over notes (ties excluded before calling); 1.0 with no trials."""
    if wins < 0 or losses < 0:
        raise MistillInputError("wins and losses must be non-negative", field="wins")
    if wins + losses == 0:
        return 1.0
    return float(_scipy_stats().binomtest(int(wins), int(wins + losses), 0.5, alternative="two-sided").pvalue)


def wilcoxon_p(diffs: np.ndarray) -> float:
    """Two-sided Wilcoxon signed-rank p with zero differences dropped; 1.0 when all are zero."""
    if not np.any(diffs != 0):
        return 1.0
    return float(_scipy_stats().wilcoxon(diffs, zero_method="wilcox", alternative="two-sided").pvalue)


@dataclass(frozen=True)
class PairedDifference:
    """Tests on per-note differences (arm minus reference).

    ``mean_diff`` [``ci_low``, ``ci_high``]: mean per-note difference with its percentile
    bootstrap interval over notes; ``median_diff``; ``wilcoxon_p`` (zeros dropped); ``sign_p``
    (exact, two-sided, ties dropped); notes ``n_higher / n_lower / n_tied``; ``n`` notes tested
    and ``n_dropped`` notes without a value.
    """

    n: int
    mean_diff: float
    median_diff: float
    ci_low: float
    ci_high: float
    wilcoxon_p: float
    sign_p: float
    n_higher: int
    n_lower: int
    n_tied: int
    n_dropped: int = 0


def difference_tests(diffs: Sequence[float] | np.ndarray, *, n_resamples: int = N_BOOTSTRAP,
                     seed: int = 0, level: float = 0.95) -> PairedDifference:
    """All paired tests on a vector of per-note differences (NaNs dropped)."""
    d, dropped = _finite_1d(diffs, "diffs")
    ci = bootstrap_ci(d, np.mean, n_resamples=n_resamples, seed=seed, level=level)
    higher, lower = int((d > 0).sum()), int((d < 0).sum())
    return PairedDifference(n=len(d), mean_diff=ci.estimate, median_diff=float(np.median(d)),
                            ci_low=ci.low, ci_high=ci.high, wilcoxon_p=wilcoxon_p(d),
                            sign_p=sign_test(higher, lower), n_higher=higher, n_lower=lower,
                            n_tied=len(d) - higher - lower, n_dropped=dropped)


def paired_difference(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, *,
                      n_resamples: int = N_BOOTSTRAP, seed: int = 0,
                      level: float = 0.95) -> PairedDifference:
    """Paired comparison of two arms on the same notes: tests on ``a - b`` per note.

    ``a`` and ``b`` are aligned per-note values (same note order); a note missing on either
    side (NaN) is dropped.
    """
    a_arr, b_arr = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a_arr.shape != b_arr.shape:
        raise MistillInputError(f"paired values differ in shape: {a_arr.shape} vs {b_arr.shape}",
                                field="b")
    return difference_tests(a_arr - b_arr, n_resamples=n_resamples, seed=seed, level=level)


def per_note_differences(arm: Mapping[Hashable, float],
                         ref: Mapping[Hashable, float]) -> dict[Hashable, float]:
    """``arm[note] - ref[note]`` for the notes both runs have, in ``arm``'s order."""
    return {note: arm[note] - ref[note] for note in arm if note in ref}


def seed_matched_pairs(arm_runs: Mapping[Hashable, T],
                       ref_runs: Mapping[Hashable, U]) -> dict[tuple[Hashable, Hashable], tuple[T, U]]:
    """Seed-matched pairs ``(arm_seed, ref_seed) -> (arm_run, ref_run)``.

    Seed i of the arm is paired with seed i of the reference (the seeds both have); a side with
    a single seed is paired with every seed of the other side.
    """
    if not arm_runs or not ref_runs:
        raise MistillInputError("seed matching needs at least one run on each side",
                                field="arm_runs" if not arm_runs else "ref_runs")
    if len(ref_runs) == 1:
        (rs, rr), = ref_runs.items()
        return {(s, rs): (run, rr) for s, run in arm_runs.items()}
    if len(arm_runs) == 1:
        (s, run), = arm_runs.items()
        return {(s, rs): (run, rr) for rs, rr in ref_runs.items()}
    common = [s for s in arm_runs if s in ref_runs]
    if not common:
        raise MistillInputError(f"no common seeds: arm {list(arm_runs)} vs reference "
                                f"{list(ref_runs)}", field="seeds")
    return {(s, s): (arm_runs[s], ref_runs[s]) for s in common}


@dataclass(frozen=True)
class NoteClustered:
    """A seed-matched comparison with the note as the unit.

    ``overall``: the tests over notes on ``per_note`` (each note's mean over its seed pairs'
    differences), the test reported in the tables. ``per_pair``: the same tests within each
    seed pair (pairs without any value are left out). ``pooled_*``: note-pair counts over all
    pairs, descriptive only (a note's pairs are not independent trials).
    """

    overall: PairedDifference
    per_note: dict[Hashable, float]
    per_pair: dict[Hashable, PairedDifference]
    pooled_higher: int
    pooled_lower: int
    pooled_tied: int


def note_clustered(diffs_by_seed_pair: Mapping[Hashable, Mapping[Hashable, float]], *,
                   n_resamples: int = N_BOOTSTRAP, seed: int = 0,
                   level: float = 0.95) -> NoteClustered:
    """Note-clustered test of seed-matched differences ``pair -> {note_id: difference}``."""
    if not diffs_by_seed_pair:
        raise MistillInputError("no seed pairs to cluster", field="diffs_by_seed_pair")
    by_note: dict[Hashable, list[float]] = {}
    pooled = []
    per_pair = {}
    for pair, diffs in diffs_by_seed_pair.items():
        values = {n: float(v) for n, v in diffs.items() if not math.isnan(v)}
        for note, v in values.items():
            by_note.setdefault(note, []).append(v)
        pooled.extend(values.values())
        if values:
            per_pair[pair] = difference_tests(list(values.values()), n_resamples=n_resamples,
                                              seed=seed, level=level)
    per_note = {note: float(np.mean(v)) for note, v in by_note.items()}
    overall = difference_tests(list(per_note.values()), n_resamples=n_resamples, seed=seed,
                               level=level)
    p = np.asarray(pooled)
    return NoteClustered(overall=overall, per_note=per_note, per_pair=per_pair,
                         pooled_higher=int((p > 0).sum()), pooled_lower=int((p < 0).sum()),
                         pooled_tied=int((p == 0).sum()))


# ---------------------------------------------------------------------------------------------
# Corpus-level micro-F1 difference


@dataclass(frozen=True)
class CorpusDifference:
    """Difference of corpus-level micro-F1 (a minus b) with notes resampled.

    ``p_bootstrap``: two-sided bootstrap p, ``2 (min(#{diff* <= 0}, #{diff* >= 0}) + 1) /
    (B + 1)`` capped at 1.
    """

    n_notes: int
    micro_f1_a: float
    micro_f1_b: float
    difference: float
    ci_low: float
    ci_high: float
    p_bootstrap: float


def corpus_micro_f1_difference(gold: Sequence[Sequence[str]], pred_a: Sequence[Sequence[str]],
                               pred_b: Sequence[Sequence[str]], *,
                               n_resamples: int = N_BOOTSTRAP_CORPUS, seed: int = 0,
                               level: float = 0.95) -> CorpusDifference:
    """Corpus micro-F1 of ``pred_a`` minus that of ``pred_b``; notes resampled ``n_resamples`` times."""
    if not (len(gold) == len(pred_a) == len(pred_b)) or not gold:
        raise MistillInputError("gold and both predictions need the same, non-zero number of notes",
                                field="pred_b")
    ca = [set_counts(p, g) for g, p in zip(gold, pred_a)]
    cb = [set_counts(p, g) for g, p in zip(gold, pred_b)]
    return corpus_micro_f1_difference_from_counts(ca, cb, n_resamples=n_resamples, seed=seed,
                                                  level=level)


def _micro_f1(c: np.ndarray) -> np.ndarray:
    """Micro-F1 of pooled counts ``[..., (tp, fp, fn)]``; 1.0 where there is nothing to find."""
    tp, fp, fn = c[..., 0], c[..., 1], c[..., 2]
    den = 2 * tp + fp + fn
    return np.where(den > 0, 2 * tp / np.maximum(den, 1), 1.0)


def corpus_micro_f1(counts: Sequence | np.ndarray, *, n_resamples: int = N_BOOTSTRAP_CORPUS, seed: int = 0,
                    level: float = 0.95) -> CI:
    """Corpus micro-F1 of per-note ``(tp, fp, fn)`` counts (``[note, 3]``) with its percentile
    bootstrap interval over notes (each resample pools the drawn notes' counts)."""
    c = _seed_counts(counts, "counts")
    if c.shape[0] != 1:
        raise MistillInputError(f"expected one set of per-note counts, got {c.shape[0]}", field="counts")
    c = c[0]
    boot = np.concatenate([_micro_f1(c[idx].sum(1)) for idx in _resample_chunks(len(c), n_resamples, seed)])
    return CI(float(_micro_f1(c.sum(0))), *_percentiles(boot, level))


def _seed_counts(counts: Sequence | np.ndarray, field: str) -> np.ndarray:
    """Counts as ``[seed, note, 3]`` integers (a ``[note, 3]`` input is one seed)."""
    c = np.asarray(counts)
    if c.ndim == 2:
        c = c[None]
    if c.ndim != 3 or c.shape[-1] != 3 or c.shape[1] == 0 or c.shape[0] == 0:
        raise MistillInputError(f"expected [note, 3] or [seed, note, 3] counts (tp, fp, fn), got "
                                f"shape {c.shape}", field=field)
    if np.any(c < 0) or not np.all(np.equal(np.mod(c, 1), 0)):
        raise MistillInputError("counts must be non-negative integers", field=field)
    return c.astype(np.int64)


def corpus_micro_f1_difference_from_counts(counts_a: Sequence | np.ndarray,
                                           counts_b: Sequence | np.ndarray, *,
                                           n_resamples: int = N_BOOTSTRAP_CORPUS, seed: int = 0,
                                           level: float = 0.95) -> CorpusDifference:
    """Corpus micro-F1 difference (a minus b) from per-note ``(tp, fp, fn)`` counts.

    ``counts_a`` and ``counts_b``: ``[note, 3]``, or ``[seed, note, 3]`` for several seeds of an
    arm (the same notes in the same order on both sides). A side's corpus micro-F1 is the mean
    over its seeds of each seed's pooled micro-F1; one resample draws notes once and applies the
    draw to every seed of both sides.
    """
    ca, cb = _seed_counts(counts_a, "counts_a"), _seed_counts(counts_b, "counts_b")
    if ca.shape[1] != cb.shape[1]:
        raise MistillInputError(f"counts cover {ca.shape[1]} and {cb.shape[1]} notes",
                                field="counts_b")
    n = ca.shape[1]

    def corpus(c: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray | float:
        if idx is None:
            return float(np.mean([_micro_f1(s.sum(0)) for s in c]))
        return np.mean([_micro_f1(s[idx].sum(1)) for s in c], axis=0)

    f1_a, f1_b = corpus(ca), corpus(cb)
    boot = np.concatenate([corpus(ca, idx) - corpus(cb, idx)
                           for idx in _resample_chunks(n, n_resamples, seed)])
    low, high = _percentiles(boot, level)
    k = min(int((boot <= 0).sum()), int((boot >= 0).sum()))
    p = min(1.0, 2.0 * (k + 1) / (n_resamples + 1))
    return CorpusDifference(n_notes=n, micro_f1_a=f1_a, micro_f1_b=f1_b, difference=f1_a - f1_b,
                            ci_low=low, ci_high=high, p_bootstrap=p)


# ---------------------------------------------------------------------------------------------
# Per-head tests (App. C)


def one_sample_t(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided one-sample t-test against 0 of each head across notes.

    x: ``[note, head]`` (trailing dims such as ``[note, layer, head]`` allowed) of per-note means;
    NaN entries (a note without events) are omitted per column. Returns ``(t, p)``, each of
    shape ``x.shape[1:]``; NaN where a column has fewer than two values or zero variance with
    zero mean.
    """
    x = np.asarray(x, dtype=float)
    if x.ndim < 2:
        raise MistillInputError(f"expected [note, head], got shape {x.shape}", field="x")
    n = (~np.isnan(x)).sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.nansum(x, 0) / n
        var = np.nansum((x - mean) ** 2, 0) / (n - 1)
        t = mean / np.sqrt(var / n)
        t = np.where(n >= 2, t, np.nan)
    p = 2.0 * _scipy_stats().t.sf(np.abs(t), np.maximum(n - 1, 1))
    return t, np.where(np.isnan(t), np.nan, p)


class BHResult(NamedTuple):
    """Benjamini-Hochberg: the discoveries and the adjusted p-values (same shape as the input)."""

    reject: np.ndarray
    p_adjusted: np.ndarray


def benjamini_hochberg(p: np.ndarray | Sequence[float], q: float = 0.05) -> BHResult:
    """Benjamini-Hochberg (1995) step-up procedure at FDR ``q`` over all finite p-values.

    Adjusted ``p_(i) = min_{j >= i} p_(j) m / j`` (capped at 1); a test is a discovery when its
    adjusted p is at most ``q``. NaN p-values are not tests: never rejected, not counted in m.
    Feed two-sided p-values and split the discoveries by the sign of the effect
    (:func:`signed_discoveries`).
    """
    p = np.asarray(p, dtype=float)
    flat = p.ravel()
    tested = np.flatnonzero(~np.isnan(flat))
    adjusted = np.full(flat.shape, np.nan)
    if tested.size:
        order = tested[np.argsort(flat[tested], kind="stable")]
        m = tested.size
        scaled = flat[order] * m / np.arange(1, m + 1)
        adjusted[order] = np.minimum(1.0, np.minimum.accumulate(scaled[::-1])[::-1])
    reject = np.zeros(flat.shape, dtype=bool)
    reject[tested] = adjusted[tested] <= q
    return BHResult(reject.reshape(p.shape), adjusted.reshape(p.shape))


@dataclass(frozen=True)
class SignedDiscoveries:
    """Per-head t-test, BH adjustment, and discoveries split by the sign of the mean."""

    t: np.ndarray
    p: np.ndarray
    p_adjusted: np.ndarray
    positive: np.ndarray
    negative: np.ndarray


def signed_discoveries(x: np.ndarray, q: float = 0.05) -> SignedDiscoveries:
    """Heads declared positive / negative at FDR ``q``: t-tests across notes, then BH.

    x: ``[note, head]`` per-note mean importances (e.g. ``I_c`` per note). Under a complete null
    this should declare essentially nothing (the calibration check of App. C).
    """
    t, p = one_sample_t(x)
    bh = benjamini_hochberg(p, q)
    return SignedDiscoveries(t=t, p=p, p_adjusted=bh.p_adjusted,
                             positive=bh.reject & (t > 0), negative=bh.reject & (t < 0))


class RecurrenceResult(NamedTuple):
    """Upper-tail binomial p per head, raw and Bonferroni-adjusted over heads."""

    p: np.ndarray
    p_bonferroni: np.ndarray


def binomial_recurrence(counts: np.ndarray | Sequence[int], n_notes: int,
                        p_null: float | np.ndarray) -> RecurrenceResult:
    """Does a head recur in the notes' top sets more often than chance?

    counts: ``[head]`` (any shape) number of notes whose top set contains the head; ``p_null``:
    the chance a head is in one note's top set (e.g. 20/1600), scalar or per head. One-sided
    ``P(X >= count)`` with ``X ~ Binomial(n_notes, p_null)``, and that p times the number of
    heads, capped at 1.
    """
    c = np.asarray(counts)
    if np.any(c < 0) or np.any(c > n_notes):
        raise MistillInputError(f"recurrence counts must lie in [0, {n_notes}]", field="counts")
    p = _scipy_stats().binom.sf(c - 1, n_notes, p_null)
    return RecurrenceResult(p, np.minimum(1.0, p * c.size))
