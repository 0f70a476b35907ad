"""Task and fidelity metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest

from mistill.errors import MistillInputError
from mistill.evaluation.metrics import (
    bleu4,
    gap_recovered,
    head_tail_labels,
    jain_propensity,
    las,
    las_per_note,
    macro_f1,
    mean_bleu4,
    micro_prf,
    per_note_metrics,
    precision_at_k,
    psndcg_at_k,
    psp_at_k,
    recall_at_k,
    set_f1,
    task_metrics,
)

# Two notes used throughout.
#   note 1: gold {A,B,C}, pred [A,B,E] -> tp 2 (A,B), fp 1 (E), fn 1 (C): P 2/3, R 2/3, F1 4/6
#   note 2: gold {A,D},   pred [D]     -> tp 1 (D),   fp 0,     fn 1 (A): P 1,   R 1/2, F1 2/3
GOLD = [["A", "B", "C"], ["A", "D"]]
PRED = [["A", "B", "E"], ["D"]]


def test_per_note_f1_hand_values():
    rows = per_note_metrics(GOLD, PRED, note_ids=["n1", "n2"])
    assert rows[0]["note_id"] == "n1"
    assert (rows[0]["tp"], rows[0]["fp"], rows[0]["fn"]) == (2, 1, 1)
    assert rows[0]["f1"] == pytest.approx(2 / 3)
    assert rows[1]["precision"] == 1.0 and rows[1]["recall"] == 0.5
    assert rows[1]["f1"] == pytest.approx(2 / 3)


def test_micro_vs_macro():
    # micro: tp 3, fp 1, fn 2 -> P 3/4, R 3/5, F1 6/9
    p, r, f = micro_prf(GOLD, PRED)
    assert (p, r, f) == pytest.approx((0.75, 0.6, 2 / 3))
    # macro over labels in gold or pred {A,B,C,D,E}:
    #   A: tp 1 fn 1 -> 2/3; B: tp 1 -> 1; C: fn 1 -> 0; D: tp 1 -> 1; E: fp 1 -> 0
    #   (2/3 + 1 + 0 + 1 + 0) / 5 = 8/15
    assert macro_f1(GOLD, PRED) == pytest.approx(8 / 15)


def test_empty_prediction_conventions():
    assert set_f1([], ["A"]) == 0.0  # empty answer against gold
    assert set_f1(["A"], []) == 0.0
    assert set_f1([], []) == 1.0  # documented choice: exact agreement
    assert set_f1(["A", "B"], ["B", "C"]) == pytest.approx(0.5)  # tp 1 fp 1 fn 1 -> 2/4


def test_precision_at_8_penalises_a_three_code_answer():
    # note 1: 2 hits among 3 codes, over k=8 -> 2/8; note 2: 1 hit -> 1/8
    assert precision_at_k(["A", "B", "E"], ["A", "B", "C"], 8) == 0.25
    assert precision_at_k(["D"], ["A", "D"], 8) == 0.125
    out = task_metrics(GOLD, PRED)
    assert out["p_at_8"] == pytest.approx((0.25 + 0.125) / 2)
    # R@8: 2/3 and 1/2
    assert out["r_at_8"] == pytest.approx((2 / 3 + 0.5) / 2)
    assert out["p_at_15"] == pytest.approx((2 / 15 + 1 / 15) / 2)


def test_recall_at_k_uses_emission_order_and_dedup():
    assert recall_at_k(["E", "F", "A"], ["A"], 2) == 0.0
    assert recall_at_k(["E", "F", "A"], ["A"], 3) == 1.0
    # a repeated code does not take a second slot: [A, A, B] ranks A, B
    assert recall_at_k(["A", "A", "B"], ["A", "B"], 2) == 1.0
    assert precision_at_k(["A", "A", "B"], ["A", "B"], 2) == 1.0
    assert math.isnan(recall_at_k(["A"], [], 8))


def test_jain_propensity_hand_values():
    # N = 100: C = (ln 100 - 1) * 2.5^0.55 = 3.605170 * 1.655268 = 5.967505
    # N_l = 0: (1.5)^-0.55 = 0.800110 -> p = 1 / (1 + 4.774661) = 0.173170
    # N_l = 50: (51.5)^-0.55 = 0.114421 -> p = 1 / (1 + 0.682808) = 0.594245
    assert jain_propensity(0, 100) == pytest.approx(0.173170, abs=1e-6)
    assert jain_propensity(50, 100) == pytest.approx(0.594245, abs=1e-6)
    assert jain_propensity(1000, 100) > jain_propensity(50, 100)  # frequent labels: higher p
    with pytest.raises(MistillInputError):
        jain_propensity(3, 2)


def test_psp_and_psndcg_hand_values_and_normalisation():
    w = {"A": 4.0, "B": 2.0, "C": 1.0}  # inverse propensities
    gold = ["A", "B", "C"]
    # PSP@2 of [C, A]: hits 1 + 4 = 5; best = two largest weights 4 + 2 = 6 -> 5/6
    assert psp_at_k(["C", "A"], gold, w, 2) == pytest.approx(5 / 6)
    # PSnDCG@2 of [C, A]: 1/log2(2) + 4/log2(3) = 3.523719; ideal 4 + 2/log2(3) = 5.261860
    assert psndcg_at_k(["C", "A"], gold, w, 2) == pytest.approx(3.523719 / 5.261860, abs=1e-6)
    # the ideal ranking (decreasing inverse propensity) reaches 1.0 on both
    assert psp_at_k(["A", "B"], gold, w, 2) == pytest.approx(1.0)
    assert psndcg_at_k(["A", "B", "C", "X"], gold, w, 8) == pytest.approx(1.0)
    # any order of all gold codes is perfect for PSP@k with k >= |gold|, not for PSnDCG
    assert psp_at_k(["C", "B", "A"], gold, w, 8) == pytest.approx(1.0)
    assert psndcg_at_k(["C", "B", "A"], gold, w, 8) < 1.0


def test_psp_from_training_frequencies_perfect_ranking():
    freq = {"A": 50, "B": 3, "C": 0}
    gold = [["A", "B", "C"], ["A"]]
    # perfect ranking: rarest (largest 1/p) first
    pred = [["C", "B", "A"], ["A"]]
    out = task_metrics(gold, pred, train_freq=freq, n_train=100)
    for k in (8, 15):
        assert out[f"psp_at_{k}"] == pytest.approx(1.0)
        assert out[f"psndcg_at_{k}"] == pytest.approx(1.0)
    # note 1 with only A (the most frequent) at k=8: 1/p_A over the sum of all three
    # 1/p_A = 1.682808, 1/p_B = 3.609311, 1/p_C = 5.774661 -> 1.682808 / 11.066780 = 0.152059
    rows = per_note_metrics(gold, [["A"], ["A"]], train_freq=freq, n_train=100)
    assert rows[0]["psp_at_8"] == pytest.approx(0.152059, abs=1e-6)
    with pytest.raises(MistillInputError):
        task_metrics(gold, pred, train_freq=freq)  # n_train missing


def test_head_tail_split_at_median_training_frequency():
    # labels present in gold: A 100, B 50, C 5, D 1 -> median 27.5; tail (<= median) {C, D}
    freq = {"A": 100, "B": 50, "C": 5, "D": 1, "E": 0}
    head, tail = head_tail_labels(GOLD, freq)
    assert head == {"A", "B"} and tail == {"C", "D"}  # E is only predicted: in neither
    out = task_metrics(GOLD, PRED, train_freq=freq, n_train=1000)
    assert out["head_macro_f1"] == pytest.approx((2 / 3 + 1) / 2)  # A 2/3, B 1
    assert out["tail_macro_f1"] == pytest.approx((0 + 1) / 2)  # C 0, D 1
    assert (out["n_head_labels"], out["n_tail_labels"]) == (2, 2)
    # odd count: frequencies 1, 5, 100 -> median 5, and the label at the median is tail
    head, tail = head_tail_labels([["X", "Y", "Z"]], {"X": 1, "Y": 5, "Z": 100})
    assert head == {"Z"} and tail == {"X", "Y"}


def test_invalid_generation_scores_as_empty_and_rates():
    out = task_metrics(GOLD, PRED, valid=[True, False], capped=[False, True], n_tokens=[100, 300])
    # note 2 scored as [] -> tp 2, fp 1, fn 3 -> micro F1 4/8
    assert out["micro_f1"] == pytest.approx(0.5)
    assert out["mean_note_f1"] == pytest.approx((2 / 3 + 0.0) / 2)
    assert (out["valid_rate"], out["cap_rate"], out["mean_tokens"]) == (0.5, 0.5, 200.0)
    rows = per_note_metrics(GOLD, PRED, valid=[True, False])
    assert rows[1]["n_pred"] == 0 and rows[1]["f1"] == 0.0 and rows[1]["valid"] is False


def test_bad_input_raises():
    with pytest.raises(MistillInputError):
        task_metrics(GOLD, PRED[:1])
    with pytest.raises(MistillInputError):
        task_metrics([], [])
    with pytest.raises(MistillInputError):
        task_metrics(["A"], [["A"]])  # a string where a code list belongs
    with pytest.raises(MistillInputError):
        task_metrics(GOLD, PRED, valid=[True])


def test_gap_recovered():
    assert gap_recovered(0.15, 0.10, 0.20) == pytest.approx(0.5)
    assert math.isnan(gap_recovered(0.1, 0.2, 0.2))


# BLEU-4 ---------------------------------------------------------------------------------------


def test_bleu_identical_is_one():
    s = "the cat sat on the mat"
    assert bleu4(s, s) == pytest.approx(1.0)


def test_bleu_without_a_4gram_match_is_zero():
    # unigrams to trigrams match, but no 4-gram does: unsmoothed BLEU is 0
    assert bleu4("the cat sat on the mat", "the cat sat under the mat") == 0.0
    assert bleu4("a b c", "a b c") == 0.0  # fewer than 4 tokens: no 4-gram at all
    assert bleu4("", "a b c d") == 0.0


def test_bleu_brevity_penalty():
    # every n-gram of the 6-token hypothesis matches; r = 8, c = 6 -> exp(1 - 8/6) = 0.716531
    assert bleu4("a b c d e f", "a b c d e f g h") == pytest.approx(math.exp(1 - 8 / 6))
    # a longer hypothesis is not penalised by BP (its precisions drop instead)
    assert bleu4("a b c d e f g h", "a b c d e f") == pytest.approx(
        (6 / 8 * 5 / 7 * 4 / 6 * 3 / 5) ** 0.25)


def test_bleu_hand_value_and_clipping():
    # "a b c d e x" vs "a b c d e f": p1 5/6, p2 4/5, p3 3/4, p4 2/3 -> (1/3)^(1/4) = 0.759836
    assert bleu4("a b c d e x", "a b c d e f") == pytest.approx((1 / 3) ** 0.25)
    # clipping: "a a b c d" vs "a b c d e": p1 4/5 (second a clipped), p2 3/4, p3 2/3, p4 1/2
    #   product 0.2 -> 0.2^(1/4) = 0.668740
    assert bleu4("a a b c d", "a b c d e") == pytest.approx(0.2 ** 0.25)
    assert mean_bleu4(["a b c d", "x"], ["a b c d", "y"]) == pytest.approx(0.5)


# LAS ------------------------------------------------------------------------------------------


def test_las_per_note():
    # teacher {A, B}; with rationale the simulator says {A, B} -> 1; note only {A} -> 2/3
    assert las_per_note([["A", "B"]], [["A"]], [["A", "B"]]) == pytest.approx([1 / 3])
    assert las(0.4, 0.25) == pytest.approx(0.15)
