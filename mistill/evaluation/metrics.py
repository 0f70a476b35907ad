"""Task and fidelity metrics of App. K, per note and over a corpus.

Inputs are, per note, the gold codes and the predicted codes in emission order (as
:func:`mistill.evaluation.parsing.parse_answer` returns them). Predictions are de-duplicated
here too, keeping the first occurrence, so a ranking metric never counts a code twice.

Conventions where a ratio is 0/0 (documented because the paired tests use per-note values):

- Set precision, recall and F1: a note with empty gold *and* empty prediction scores 1.0 on
  all three (exact agreement). Otherwise 0/0 is 0: an empty prediction has precision 0 and F1
  0 against non-empty gold; a non-empty prediction against empty gold has recall 0 and F1 0.
  The same rule applies to the pooled counts of micro-F1.
- R@k, PSP@k and PSnDCG@k are undefined (NaN) on a note with empty gold; corpus values are
  means over the notes where they are defined. P@k is always defined (hits / k).
- macro-F1 over an empty label set is NaN.

MLflow metric names cannot contain ``@``: keys are spelled ``p_at_8``, ``psndcg_at_15``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from mistill.errors import MistillInputError

PROPENSITY_A = 0.55
PROPENSITY_B = 1.5
DEFAULT_KS = (8, 15)


# ---------------------------------------------------------------------------------------------
# Per-note building blocks


def dedup(codes: Iterable[str]) -> list[str]:
    """Codes in first-occurrence order without repeats."""
    return list(dict.fromkeys(codes))


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def set_counts(pred: Iterable[str], gold: Iterable[str]) -> tuple[int, int, int]:
    """(true positives, false positives, false negatives) of a predicted set against gold."""
    p, g = set(pred), set(gold)
    return len(p & g), len(p - g), len(g - p)


def prf_from_counts(tp: int, fp: int, fn: int) -> tuple[float, float, float]:
    """(precision, recall, F1) from counts; all 1.0 when there is nothing to find or predict."""
    if tp + fp + fn == 0:
        return 1.0, 1.0, 1.0
    return _ratio(tp, tp + fp), _ratio(tp, tp + fn), _ratio(2 * tp, 2 * tp + fp + fn)


def set_f1(pred: Iterable[str], ref: Iterable[str]) -> float:
    """F1 of a predicted code set against a reference set (1.0 when both are empty)."""
    return prf_from_counts(*set_counts(pred, ref))[2]


def precision_at_k(pred: Sequence[str], gold: Iterable[str], k: int) -> float:
    """Hits among the first ``k`` emitted codes, divided by ``k`` (short answers are penalised)."""
    g = set(gold)
    return sum(c in g for c in dedup(pred)[:k]) / k


def recall_at_k(pred: Sequence[str], gold: Iterable[str], k: int) -> float:
    """Hits among the first ``k`` emitted codes, divided by the number of gold codes (NaN if none)."""
    g = set(gold)
    if not g:
        return math.nan
    return sum(c in g for c in dedup(pred)[:k]) / len(g)


def jain_propensity(freq: float | np.ndarray, n_train: int, a: float = PROPENSITY_A,
                    b: float = PROPENSITY_B) -> float | np.ndarray:
    """Jain et al. (2016) propensity ``p_l = 1 / (1 + C exp(-A log(N_l + B)))``.

    ``C = (log N - 1)(B + 1)^A`` with ``N`` the number of training notes and ``N_l`` the label's
    training frequency (natural logarithms). Rare labels get small propensities, hence large
    inverse-propensity weights.
    """
    if n_train <= math.e:
        raise MistillInputError(f"propensities need more than e training notes, got {n_train}",
                                field="n_train")
    c = (math.log(n_train) - 1.0) * (b + 1.0) ** a
    return 1.0 / (1.0 + c * np.exp(-a * np.log(np.asarray(freq, dtype=float) + b)))


def psp_at_k(pred: Sequence[str], gold: Iterable[str], inv_prop: Mapping[str, float],
             k: int) -> float:
    """Propensity-scored precision at ``k``, normalised by the best value achievable on the note.

    ``sum over hits in the first k of 1/p_l`` divided by the sum of the ``min(k, |gold|)``
    largest ``1/p_l`` among the gold labels (the 1/k factors cancel). A perfect ranking scores
    1.0; NaN when the gold set is empty.
    """
    g = set(gold)
    if not g:
        return math.nan
    got = sum(inv_prop[c] for c in dedup(pred)[:k] if c in g)
    best = sum(sorted((inv_prop[c] for c in g), reverse=True)[:k])
    return got / best


def psndcg_at_k(pred: Sequence[str], gold: Iterable[str], inv_prop: Mapping[str, float],
                k: int) -> float:
    """Propensity-scored nDCG at ``k``: ``PSDCG@k(pred) / PSDCG@k(ideal)``.

    ``PSDCG@k = sum_{r=1..k} y_r / (p_r log2(r + 1))``; the ideal ranking lists the gold labels
    by decreasing inverse propensity, which maximises PSDCG. NaN when the gold set is empty.
    """
    g = set(gold)
    if not g:
        return math.nan
    got = sum(inv_prop[c] / math.log2(r + 2) for r, c in enumerate(dedup(pred)[:k]) if c in g)
    ideal = sorted((inv_prop[c] for c in g), reverse=True)[:k]
    best = sum(w / math.log2(r + 2) for r, w in enumerate(ideal))
    return got / best


# ---------------------------------------------------------------------------------------------
# Corpus-level set metrics


def _check_corpus(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> None:
    if len(gold) != len(pred):
        raise MistillInputError(f"{len(gold)} gold sets but {len(pred)} predictions", field="pred")
    if not gold:
        raise MistillInputError("no notes to score", field="gold")
    for name, rows in (("gold", gold), ("pred", pred)):
        for i, row in enumerate(rows):
            if isinstance(row, str) or not all(isinstance(c, str) for c in row):
                raise MistillInputError(f"{name} codes of note index {i} must be a list of strings",
                                        field=name)


def micro_prf(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> tuple[float, float, float]:
    """Micro (precision, recall, F1): true/false positives and false negatives pooled over notes."""
    tp = fp = fn = 0
    for g, p in zip(gold, pred):
        a, b, c = set_counts(p, g)
        tp, fp, fn = tp + a, fp + b, fn + c
    return prf_from_counts(tp, fp, fn)


def label_f1(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict[str, float]:
    """Per-label F1 over the corpus, for every label in the gold sets or the predictions."""
    tp: Counter[str] = Counter()
    fp: Counter[str] = Counter()
    fn: Counter[str] = Counter()
    for g, p in zip(gold, pred):
        gs, ps = set(g), set(p)
        tp.update(gs & ps)
        fp.update(ps - gs)
        fn.update(gs - ps)
    labels = set(tp) | set(fp) | set(fn)
    return {lab: 2 * tp[lab] / (2 * tp[lab] + fp[lab] + fn[lab]) for lab in labels}


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(np.mean(values)) if values else math.nan


def macro_f1(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]],
             labels: Iterable[str] | None = None) -> float:
    """Mean per-label F1 over the labels in the gold sets or the predictions (or over ``labels``)."""
    per_label = label_f1(gold, pred)
    chosen = per_label.keys() if labels is None else labels
    return _mean(per_label.get(lab, 0.0) for lab in chosen)


def head_tail_labels(gold: Sequence[Sequence[str]],
                     train_freq: Mapping[str, int]) -> tuple[set[str], set[str]]:
    """Split the labels present in the gold sets at their median training-split frequency.

    Returns (head, tail): tail holds labels with frequency at most the median (a label absent
    from ``train_freq`` has frequency 0), head the rest.
    """
    present = {c for g in gold for c in g}
    if not present:
        return set(), set()
    median = float(np.median([train_freq.get(c, 0) for c in present]))
    tail = {c for c in present if train_freq.get(c, 0) <= median}
    return present - tail, tail


def gap_recovered(arm: float, base: float, teacher: float) -> float:
    """Share of the gap between the untrained student and the teacher that an arm recovers."""
    return (arm - base) / (teacher - base) if teacher != base else math.nan


# ---------------------------------------------------------------------------------------------
# Per-note rows and the corpus summary


def _inverse_propensities(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]],
                          train_freq: Mapping[str, int] | None,
                          n_train: int | None) -> dict[str, float] | None:
    if train_freq is None:
        return None
    if n_train is None:
        raise MistillInputError("train_freq needs n_train (number of training notes)",
                                field="n_train")
    labels = sorted({c for rows in (gold, pred) for row in rows for c in row})
    props = jain_propensity(np.array([train_freq.get(c, 0) for c in labels]), n_train)
    return {c: 1.0 / float(p) for c, p in zip(labels, np.atleast_1d(props))}


def _scored_predictions(pred: Sequence[Sequence[str]],
                        valid: Sequence[bool] | None) -> list[list[str]]:
    """Predictions de-duplicated, with every invalid generation scored as an empty answer."""
    if valid is not None and len(valid) != len(pred):
        raise MistillInputError(f"{len(valid)} validity flags for {len(pred)} notes", field="valid")
    return [dedup(p) if valid is None or valid[i] else [] for i, p in enumerate(pred)]


def _optional_column(name: str, values: Sequence | None, n: int) -> None:
    if values is not None and len(values) != n:
        raise MistillInputError(f"{len(values)} values of {name} for {n} notes", field=name)


def per_note_metrics(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]], *,
                     valid: Sequence[bool] | None = None, capped: Sequence[bool] | None = None,
                     n_tokens: Sequence[int] | None = None,
                     train_freq: Mapping[str, int] | None = None, n_train: int | None = None,
                     ks: Sequence[int] = DEFAULT_KS,
                     note_ids: Sequence[str] | None = None) -> list[dict]:
    """One row per note: ``f1, precision, recall, tp, fp, fn, n_gold, n_pred``, ``p_at_k`` and
    ``r_at_k`` per ``k``, ``psp_at_k`` and ``psndcg_at_k`` when ``train_freq`` is given, and
    ``note_id, valid, capped, n_tokens`` when given. ``f1`` is the note's own F1, the unit of
    the paired task tests. Invalid notes (``valid`` False) score as empty answers.
    """
    _check_corpus(gold, pred)
    n = len(gold)
    for name, col in (("capped", capped), ("n_tokens", n_tokens), ("note_ids", note_ids)):
        _optional_column(name, col, n)
    scored = _scored_predictions(pred, valid)
    inv_prop = _inverse_propensities(gold, scored, train_freq, n_train)
    rows = []
    for i, (g, p) in enumerate(zip(gold, scored)):
        tp, fp, fn = set_counts(p, g)
        prec, rec, f1 = prf_from_counts(tp, fp, fn)
        row: dict = {} if note_ids is None else {"note_id": note_ids[i]}
        row.update(f1=f1, precision=prec, recall=rec, tp=tp, fp=fp, fn=fn,
                   n_gold=len(set(g)), n_pred=len(p))
        for k in ks:
            row[f"p_at_{k}"] = precision_at_k(p, g, k)
            row[f"r_at_{k}"] = recall_at_k(p, g, k)
            if inv_prop is not None:
                row[f"psp_at_{k}"] = psp_at_k(p, g, inv_prop, k)
                row[f"psndcg_at_{k}"] = psndcg_at_k(p, g, inv_prop, k)
        if valid is not None:
            row["valid"] = bool(valid[i])
        if capped is not None:
            row["capped"] = bool(capped[i])
        if n_tokens is not None:
            row["n_tokens"] = n_tokens[i]
        rows.append(row)
    return rows


def task_metrics(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]], *,
                 valid: Sequence[bool] | None = None, capped: Sequence[bool] | None = None,
                 n_tokens: Sequence[int] | None = None,
                 train_freq: Mapping[str, int] | None = None, n_train: int | None = None,
                 ks: Sequence[int] = DEFAULT_KS) -> dict[str, float]:
    """Corpus task metrics of Table 2 / Table 46.

    Keys: ``n_notes, micro_f1, micro_precision, micro_recall, macro_f1, mean_note_f1``;
    ``p_at_k, r_at_k`` per ``k`` (means over notes); with ``train_freq``: ``psp_at_k,
    psndcg_at_k`` (means of the per-note normalised values), ``head_macro_f1, tail_macro_f1,
    n_head_labels, n_tail_labels``; with ``valid``/``capped``/``n_tokens``: ``valid_rate,
    cap_rate, mean_tokens``. Invalid notes score as empty answers.
    """
    rows = per_note_metrics(gold, pred, valid=valid, capped=capped, n_tokens=n_tokens,
                            train_freq=train_freq, n_train=n_train, ks=ks)
    scored = _scored_predictions(pred, valid)
    prec, rec, f1 = micro_prf(gold, scored)
    out: dict[str, float] = {"n_notes": len(gold), "micro_f1": f1, "micro_precision": prec,
                             "micro_recall": rec, "macro_f1": macro_f1(gold, scored),
                             "mean_note_f1": _mean(r["f1"] for r in rows)}
    for key in rows[0]:
        if key.startswith(("p_at_", "r_at_", "psp_at_", "psndcg_at_")):
            out[key] = _mean(r[key] for r in rows if not math.isnan(r[key]))
    if train_freq is not None:
        head, tail = head_tail_labels(gold, train_freq)
        out["head_macro_f1"] = macro_f1(gold, scored, head)
        out["tail_macro_f1"] = macro_f1(gold, scored, tail)
        out["n_head_labels"], out["n_tail_labels"] = len(head), len(tail)
    if valid is not None:
        out["valid_rate"] = _mean(float(v) for v in valid)
    if capped is not None:
        out["cap_rate"] = _mean(float(c) for c in capped)
    if n_tokens is not None:
        out["mean_tokens"] = _mean(float(t) for t in n_tokens)
    return out


# ---------------------------------------------------------------------------------------------
# Fidelity: BLEU-4 and LAS


def _ngrams(tokens: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def bleu4(hypothesis: str, reference: str) -> float:
    """Sentence-level BLEU-4 (Papineni et al., 2002) on whitespace tokens, without smoothing.

    ``BP * exp(mean_{n=1..4} log p_n)`` with clipped n-gram precisions ``p_n`` and brevity
    penalty ``BP = exp(1 - r/c)`` when the hypothesis (length c) is shorter than the reference
    (length r). Any zero precision (for example no 4-gram match, or a hypothesis shorter than 4
    tokens) makes the score 0.
    """
    hyp, ref = hypothesis.split(), reference.split()
    if not hyp:
        return 0.0
    log_p = 0.0
    for n in range(1, 5):
        h, r = _ngrams(hyp, n), _ngrams(ref, n)
        matched = sum(min(count, r[gram]) for gram, count in h.items())
        total = sum(h.values())
        if matched == 0:
            return 0.0
        log_p += math.log(matched / total) / 4
    bp = 1.0 if len(hyp) > len(ref) else math.exp(1.0 - len(ref) / len(hyp))
    return bp * math.exp(log_p)


def mean_bleu4(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Mean sentence-level BLEU-4 over notes (an arm's traces against the teacher's)."""
    if len(hypotheses) != len(references):
        raise MistillInputError(f"{len(hypotheses)} hypotheses but {len(references)} references",
                                field="references")
    return _mean(bleu4(h, r) for h, r in zip(hypotheses, references))


def las(f1_with_rationale: float, f1_note_only: float) -> float:
    """Leakage-adjusted simulatability of one note: ``F1(sim(note+r), a_T) - F1(sim(note), a_T)``."""
    return f1_with_rationale - f1_note_only


def las_per_note(sim_with_rationale: Sequence[Sequence[str]], sim_note_only: Sequence[Sequence[str]],
                 teacher_answers: Sequence[Sequence[str]]) -> list[float]:
    """Per-note LAS from the simulator's two answers and the teacher's answer ``a_T``."""
    n = len(teacher_answers)
    if len(sim_with_rationale) != n or len(sim_note_only) != n:
        raise MistillInputError("simulator answers and teacher answers differ in length",
                                field="teacher_answers")
    return [las(set_f1(w, t), set_f1(o, t))
            for w, o, t in zip(sim_with_rationale, sim_note_only, teacher_answers)]
