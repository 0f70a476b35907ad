"""Statistics against scipy on fixed inputs and against hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from mistill.errors import MistillInputError
from mistill.evaluation.metrics import micro_prf
from mistill.stats import (
    benjamini_hochberg,
    binomial_recurrence,
    bootstrap_ci,
    corpus_micro_f1,
    corpus_micro_f1_difference,
    note_clustered,
    one_sample_t,
    paired_difference,
    per_note_differences,
    seed_matched_pairs,
    sign_test,
    signed_discoveries,
    wilcoxon_p,
)


# Sign test and Wilcoxon ----------------------------------------------------------------------


def test_sign_test_hand_values():
    # 9 wins / 1 loss: 2 * (C(10,0) + C(10,1)) / 2^10 = 22/1024
    assert sign_test(9, 1) == pytest.approx(22 / 1024, rel=1e-12)
    assert sign_test(1, 9) == sign_test(9, 1)
    assert sign_test(5, 5) == 1.0
    assert sign_test(0, 0) == 1.0


def test_wilcoxon_matches_scipy_and_drops_zeros():
    d = np.array([0.5, -0.2, 1.1, 0.0, 0.3, -0.7, 0.9, 0.0, 1.4, 0.05])
    expected = sps.wilcoxon(d[d != 0]).pvalue  # zeros dropped first
    assert wilcoxon_p(d) == pytest.approx(expected)
    assert wilcoxon_p(np.zeros(5)) == 1.0


def test_paired_difference_hand_case():
    a = [1, 2, 3, 4, 5, 6]
    b = [0, 0, 0, 4, 7, 6]
    r = paired_difference(a, b)
    # diffs 1, 2, 3, 0, -2, 0: mean 4/6, median 0.5, 3 higher, 1 lower, 2 tied
    assert r.mean_diff == pytest.approx(4 / 6) and r.median_diff == pytest.approx(0.5)
    assert (r.n, r.n_higher, r.n_lower, r.n_tied, r.n_dropped) == (6, 3, 1, 2, 0)
    # sign test on 3 vs 1: 2 * (1 + 4) / 16 = 0.625
    assert r.sign_p == pytest.approx(0.625)
    # Wilcoxon on 1, 2, 3, -2 (ranks 1, 2.5, 4 vs 2.5): scipy on the non-zero differences
    assert r.wilcoxon_p == pytest.approx(sps.wilcoxon([1, 2, 3, -2]).pvalue)
    assert r.ci_low <= r.mean_diff <= r.ci_high


def test_paired_difference_drops_missing_notes():
    r = paired_difference([1.0, math.nan, 3.0], [0.0, 1.0, 1.0])
    assert (r.n, r.n_dropped) == (2, 1) and r.mean_diff == pytest.approx(1.5)
    with pytest.raises(MistillInputError):
        paired_difference([1.0, 2.0], [1.0])


# Bootstrap ------------------------------------------------------------------------------------


def test_bootstrap_ci_is_percentile_reproducible_and_contains_the_mean():
    x = np.random.default_rng(7).normal(0.3, 1.0, size=150)
    ci = bootstrap_ci(x, seed=3)
    assert ci == bootstrap_ci(x, seed=3)
    assert ci != bootstrap_ci(x, seed=4)
    assert ci.estimate == pytest.approx(x.mean()) and ci.low < ci.estimate < ci.high
    # the same resamples by hand: percentile 2.5 / 97.5 of the resample means
    idx = np.random.default_rng(3).integers(0, 150, size=(1000, 150))
    low, high = np.percentile(x[idx].mean(1), [2.5, 97.5])
    assert (ci.low, ci.high) == pytest.approx((low, high))
    # agrees with scipy's percentile bootstrap up to resampling noise (se of the mean ~0.08)
    ref = sps.bootstrap((x,), np.mean, n_resamples=5000, method="percentile",
                        random_state=0).confidence_interval
    assert ci.low == pytest.approx(ref.low, abs=0.02) and ci.high == pytest.approx(ref.high, abs=0.02)


def test_bootstrap_ci_constant_and_other_statistics():
    assert bootstrap_ci([2.0] * 10) == (2.0, 2.0, 2.0)
    x = np.arange(11.0)
    med = bootstrap_ci(x, stat=np.median)
    assert med.estimate == 5.0 and med.low <= 5.0 <= med.high
    # a statistic without axis= falls back to one call per resample, same resamples
    plain = bootstrap_ci(x, stat=lambda v: float(np.median(v)))
    assert plain == med
    with pytest.raises(MistillInputError):
        bootstrap_ci([math.nan])


# Seed matching and note clustering ------------------------------------------------------------


def test_seed_matched_pairs():
    arm = {0: "a0", 1: "a1", 2: "a2"}
    assert seed_matched_pairs(arm, {0: "r0", 1: "r1", 2: "r2"}) == {
        (0, 0): ("a0", "r0"), (1, 1): ("a1", "r1"), (2, 2): ("a2", "r2")}
    # a one-seed reference pairs with every seed
    assert seed_matched_pairs(arm, {0: "r"}) == {
        (0, 0): ("a0", "r"), (1, 0): ("a1", "r"), (2, 0): ("a2", "r")}
    assert seed_matched_pairs({5: "a"}, {0: "r0", 1: "r1"}) == {
        (5, 0): ("a", "r0"), (5, 1): ("a", "r1")}
    assert seed_matched_pairs(arm, {0: "r0", 1: "r1"}) == {(0, 0): ("a0", "r0"), (1, 1): ("a1", "r1")}
    with pytest.raises(MistillInputError):
        seed_matched_pairs({0: "a", 1: "b"}, {2: "r", 3: "s"})


def test_note_clustered_hand_case():
    diffs = {
        (0, 0): {"n1": 0.1, "n2": -0.2, "n3": 0.3},
        (1, 1): {"n1": 0.3, "n2": 0.0, "n3": math.nan},  # n3 has no value in this pair
        (2, 2): {"n1": -0.1, "n2": -0.1},
    }
    r = note_clustered(diffs)
    # per note: n1 (0.1 + 0.3 - 0.1)/3 = 0.1; n2 (-0.2 + 0 - 0.1)/3 = -0.1; n3 0.3
    assert r.per_note == pytest.approx({"n1": 0.1, "n2": -0.1, "n3": 0.3})
    assert (r.overall.n, r.overall.n_higher, r.overall.n_lower) == (3, 2, 1)
    assert r.overall.mean_diff == pytest.approx(0.1)
    assert r.overall.sign_p == pytest.approx(sign_test(2, 1))
    # pooled note-pair counts (descriptive): 0.1, -0.2, 0.3, 0.3, 0.0, -0.1, -0.1
    assert (r.pooled_higher, r.pooled_lower, r.pooled_tied) == (3, 3, 1)
    assert r.per_pair[(2, 2)].n == 2 and r.per_pair[(2, 2)].n_lower == 2


def test_seed_matching_feeds_note_clustering():
    arm = {0: {"n1": 0.9, "n2": 0.5}, 1: {"n1": 0.7, "n2": 0.6}}
    ref = {0: {"n1": 0.5, "n2": 0.5}}
    diffs = {pair: per_note_differences(a, r) for pair, (a, r) in seed_matched_pairs(arm, ref).items()}
    assert list(diffs) == [(0, 0), (1, 0)]
    assert diffs[(0, 0)] == pytest.approx({"n1": 0.4, "n2": 0.0})
    assert diffs[(1, 0)] == pytest.approx({"n1": 0.2, "n2": 0.1})
    assert note_clustered(diffs).per_note == pytest.approx({"n1": 0.3, "n2": 0.05})


# Corpus-level micro-F1 difference ---------------------------------------------------------------


def test_corpus_micro_f1_difference_hand_case():
    gold = [["A"], ["B"]]
    # a is perfect (1.0); b misses B: tp 1, fn 1 -> 2/3; difference 1/3.
    # A resample holding note 1 k times: b = 2k/(k + 2) -> diff 1 (k=2), 1/3 (k=1), 0 (k=0)
    # with probabilities 1/4, 1/2, 1/4: percentile interval [0, 1], p about 2 * 1/4 = 0.5
    r = corpus_micro_f1_difference(gold, [["A"], ["B"]], [["A"], []])
    assert r.difference == pytest.approx(1 / 3) and r.micro_f1_b == pytest.approx(2 / 3)
    assert (r.ci_low, r.ci_high) == (0.0, 1.0)
    assert r.p_bootstrap == pytest.approx(0.5, abs=0.03)
    same = corpus_micro_f1_difference(gold, [["A"], ["B"]], [["A"], ["B"]], n_resamples=100)
    assert (same.difference, same.ci_low, same.ci_high, same.p_bootstrap) == (0.0, 0.0, 0.0, 1.0)


def test_corpus_micro_f1_difference_matches_a_slow_reference():
    rng = np.random.default_rng(1)
    labels = list("ABCDEFGH")
    gold = [list(rng.choice(labels, 3, replace=False)) for _ in range(30)]
    pa = [list(rng.choice(labels, 2, replace=False)) for _ in range(30)]
    pb = [list(rng.choice(labels, 4, replace=False)) for _ in range(30)]
    r = corpus_micro_f1_difference(gold, pa, pb, n_resamples=300, seed=5)
    idx = np.random.default_rng(5).integers(0, 30, size=(300, 30))
    boot = [micro_prf([gold[i] for i in row], [pa[i] for i in row])[2]
            - micro_prf([gold[i] for i in row], [pb[i] for i in row])[2] for row in idx]
    assert (r.ci_low, r.ci_high) == pytest.approx(tuple(np.percentile(boot, [2.5, 97.5])))
    assert r.difference == pytest.approx(micro_prf(gold, pa)[2] - micro_prf(gold, pb)[2])


# Per-head tests -----------------------------------------------------------------------------------


def test_one_sample_t_matches_scipy():
    x = np.random.default_rng(2).normal(0.2, 1.0, size=(20, 6))  # [note, head]
    t, p = one_sample_t(x)
    ref = sps.ttest_1samp(x, 0.0, axis=0)
    assert t == pytest.approx(ref.statistic) and p == pytest.approx(ref.pvalue)
    x[3, 1] = np.nan  # a note without events for head 1
    t, p = one_sample_t(x)
    ref1 = sps.ttest_1samp(x[~np.isnan(x[:, 1]), 1], 0.0)
    assert t[1] == pytest.approx(ref1.statistic) and p[1] == pytest.approx(ref1.pvalue)
    t3, _ = one_sample_t(np.random.default_rng(0).normal(size=(10, 4, 5)))  # [note, layer, head]
    assert t3.shape == (4, 5)


def test_benjamini_hochberg_textbook_example():
    # Benjamini & Hochberg (1995): 15 p-values, q = 0.05 -> the 4 smallest are discoveries
    # (0.0095 <= 4 * 0.05 / 15 = 0.0133; 0.0201 > 5 * 0.05 / 15 = 0.0167 and no later one passes)
    p = np.array([0.0001, 0.0004, 0.0019, 0.0095, 0.0201, 0.0278, 0.0298, 0.0344, 0.0459,
                  0.3240, 0.4262, 0.5719, 0.6528, 0.7590, 1.0000])
    rng = np.random.default_rng(0)
    perm = rng.permutation(15)
    bh = benjamini_hochberg(p[perm])
    assert bh.reject.sum() == 4 and set(np.flatnonzero(bh.reject)) == set(np.flatnonzero(perm < 4))
    assert bh.p_adjusted == pytest.approx(sps.false_discovery_control(p[perm], method="bh"))


def test_benjamini_hochberg_hand_adjustment_and_nan():
    # sorted 0.01, 0.03, 0.04, 0.2 (m = 4): scaled 0.04, 0.06, 0.0533, 0.2;
    # running minimum from the top: 0.04, 0.0533, 0.0533, 0.2
    bh = benjamini_hochberg([0.01, 0.04, 0.03, 0.2], q=0.05)
    assert bh.p_adjusted == pytest.approx([0.04, 0.16 / 3, 0.16 / 3, 0.2])
    assert bh.reject.tolist() == [True, False, False, False]
    # NaN is not a test: m counts the finite p-values only, shape kept
    bh = benjamini_hochberg(np.array([[0.01, np.nan], [0.04, 0.03]]))
    assert bh.reject.shape == (2, 2) and not bh.reject[0, 1] and np.isnan(bh.p_adjusted[0, 1])
    assert bh.p_adjusted[0, 0] == pytest.approx(0.03)  # 0.01 * 3 / 1


def test_signed_discoveries_null_and_planted_effects():
    rng = np.random.default_rng(11)
    null = rng.normal(size=(100, 200))  # [note, head], complete null
    d = signed_discoveries(null, q=0.05)
    assert d.positive.sum() + d.negative.sum() <= 1
    planted = null.copy()
    planted[:, :5] += 1.0
    planted[:, 5:10] -= 1.0
    d = signed_discoveries(planted, q=0.05)
    assert d.positive[:5].all() and d.negative[5:10].all()
    assert not (d.positive & d.negative).any()


def test_binomial_recurrence_hand_values():
    # X ~ Bin(2, 0.5): P(X >= 2) = 1/4, P(X >= 1) = 3/4, P(X >= 0) = 1; Bonferroni x 3
    r = binomial_recurrence([2, 1, 0], n_notes=2, p_null=0.5)
    assert r.p == pytest.approx([0.25, 0.75, 1.0])
    assert r.p_bonferroni == pytest.approx([0.75, 1.0, 1.0])
    # a head in 42 of 100 notes' top-20 of 1,600 heads: far beyond chance (1.25 expected)
    r = binomial_recurrence(np.array([42, 2]), n_notes=100, p_null=20 / 1600)
    assert r.p_bonferroni[0] < 1e-30 and r.p_bonferroni[1] == pytest.approx(
        min(1.0, 2 * sps.binom.sf(1, 100, 20 / 1600)))
    with pytest.raises(MistillInputError):
        binomial_recurrence([101], n_notes=100, p_null=0.1)


def test_corpus_micro_f1_pools_counts_and_resamples_notes():
    counts = [(2, 1, 0), (0, 0, 3), (1, 1, 1)]  # tp, fp, fn per note
    ci = corpus_micro_f1(counts, n_resamples=500, seed=1)
    assert ci.estimate == pytest.approx(2 * 3 / (2 * 3 + 2 + 4))
    assert ci.low <= ci.estimate <= ci.high and ci.low < ci.high
    # a resample is a draw of notes whose counts are pooled: with one note every draw is that note
    assert tuple(corpus_micro_f1([(1, 1, 0)], n_resamples=50)) == pytest.approx((2 / 3,) * 3)
    with pytest.raises(MistillInputError):
        corpus_micro_f1(np.ones((2, 3, 3), dtype=int))  # two seeds' counts, not one set
