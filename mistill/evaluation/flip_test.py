"""The evidence-flip test's behavioural readings (App. N.1, N.3; Table 54).

A case is a note with an emitted gold code ``A`` and a partner ``B``; the flip rewrites the
note's evidence so that it supports ``B``; two controls (an irrelevant edit of matched length, an
order permutation) accompany it (:mod:`mistill.data.flips`). A checkpoint answers every case
``N`` times under each condition, sample ``k`` of every condition drawn with the same seed
(:func:`sample_seed`: the seed key is the case and the sample index, shared across conditions).

Each answer scores ``v`` (:func:`flip_value`): +1 if it emits ``A`` and not ``B``, -1 if ``B``
and not ``A``, 0 otherwise; an invalid output (the generation cap reached, the reasoning left
open, no parsable answer) scores 0 and is counted. Per case (:func:`case_readings`):

- ``D = (mean v | original - mean v | flipped) / 2``, the directional sensitivity;
- ``follow_original`` = Pr(v = +1 | original), ``follow_flipped`` = Pr(v = -1 | flipped) and
  their mean ``s``; ``paired_success``: both at the same sample index;
- per control ``agreement_<control>`` (the control's ``v`` equals the original's at the same
  sample index; matching wrong answers and matching zeros count) and ``expected_<control>``
  (Pr(v = +1) under the control);
- ``invalid``: the share of the case's outputs, all conditions, that were invalid;
- **[recon]** the decomposition ``D = d_lose_a + d_adopt_b`` with
  ``d_lose_a = (mean v | original - Pr(v = +1 | flipped)) / 2`` (A lost under the flip) and
  ``d_adopt_b = Pr(v = -1 | flipped) / 2`` (B adopted): the paper names the decomposition
  without its formula (docs/DEVIATIONS.md, "evidence-flip decomposition");
- the category-level secondary ``D_category``: the same on the three-character categories of
  ``A`` and ``B`` (:func:`category_value`), on cases whose categories differ (NaN elsewhere).

The case is the unit: a checkpoint's readings are means over cases with case-clustered
percentile bootstraps (:func:`checkpoint_readings`).

App. O's evidence pairs read the same way on a free-text label space (MuSiQue-Ans answers): an
answer emits ``A`` when it matches one of the case's gold answers (``A`` and its aliases) exactly
under the task's metric (EM), ``B`` when it matches ``B`` (:func:`answer_matches`); their second
control is the paraphrase ``control``, and ``paired_success`` is App. O's paired correctness ``P``
(success on the original and on the flipped input at the same sample index). Such a label space
has no categories: ``v_category`` is 0 and ``D_category`` NaN.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np
import pandas as pd

from mistill import stats
from mistill.data.corpus import Note
from mistill.data.flips import CONDITIONS
from mistill.data.inventory import Inventory, category
from mistill.evaluation.generation import DecodingConfig
from mistill.instrument.passes import stable_seed
from mistill.tasks import Task

SAMPLE_COLUMNS = ("case_id", "condition", "sample", "seed", "valid", "capped", "n_tokens", "emits_a", "emits_b",
                  "v", "v_category")
"""One row per answer: what the stage's ``flip_samples`` table holds (codes and flags, never text)."""

def answer_matches(task: Task, codes: Collection[str], refs: Sequence[str]) -> bool:
    """Whether an answer (``codes``, as the task's answer reader gives them) names one of
    ``refs``: a set-valued task's codes hold one; a free-text task's answer equals one under the
    task's metric (EM)."""
    if task.set_valued:
        return bool(set(codes) & set(refs))
    return bool(codes) and bool(refs) and task.metric(tuple(refs), tuple(codes))["em"] == 1.0


def screen_answer(task: Task, inventory: Inventory, note: Note) -> tuple[str, ...] | None:
    """A note's screen answer (its ``teacher_trace``) as codes, for the cohort's eligibility: None
    without a trace or a valid answer; for a free-text task the note's gold answers when the
    answer matches one (:func:`answer_matches`), else the answer as read."""
    if not note.teacher_trace:
        return None
    answer = task.answer_reader(inventory.codes)(note.teacher_trace)
    if not (answer.valid and answer.parsed):
        return None
    return tuple(note.gold_codes) if answer_matches(task, answer.codes, note.gold_codes) else tuple(answer.codes)


def sample_seed(decoding: DecodingConfig, case_id: str, sample: int) -> int:
    """The seed of sample ``sample`` of case ``case_id``: the same in every condition."""
    return stable_seed(decoding.seed, case_id, "flip-sample", sample) % (2 ** 31)


def flip_value(codes: Collection[str], a: str, b: str) -> int:
    """+1 if ``codes`` holds ``a`` and not ``b``, -1 if ``b`` and not ``a``, else 0."""
    has_a, has_b = a in codes, b in codes
    return int(has_a and not has_b) - int(has_b and not has_a)


def category_value(codes: Collection[str], a: str, b: str) -> int:
    """:func:`flip_value` on categories: +1 if some code of ``codes`` is in ``a``'s category and
    none in ``b``'s, -1 the other way round, else 0 (0 when the two categories are one)."""
    cats = {category(c) for c in codes}
    return flip_value(cats, category(a), category(b)) if category(a) != category(b) else 0


def sample_row(case_id: str, condition: str, sample: int, seed: int, codes: Collection[str], *, valid: bool,
               capped: bool, n_tokens: int, a: str, b: str, task: Task | None = None,
               a_refs: Sequence[str] = ()) -> dict:
    """One answer's row (:data:`SAMPLE_COLUMNS`); an invalid answer's codes are not read. With a
    free-text ``task`` the answer is matched by :func:`answer_matches` (``A`` by ``a_refs``, its gold
    answers, or ``a`` alone) and has no category."""
    codes = set(codes) if valid else set()
    if task is not None and not task.set_valued:
        has_a = answer_matches(task, tuple(codes), tuple(a_refs) or (a,))
        has_b = answer_matches(task, tuple(codes), (b,))
        v_category = 0
    else:
        has_a, has_b, v_category = a in codes, b in codes, category_value(codes, a, b)
    return {"case_id": case_id, "condition": condition, "sample": int(sample), "seed": int(seed),
            "valid": bool(valid), "capped": bool(capped), "n_tokens": int(n_tokens), "emits_a": has_a,
            "emits_b": has_b, "v": int(has_a and not has_b) - int(has_b and not has_a), "v_category": v_category}


def case_reading_names(conditions: Sequence[str] = CONDITIONS) -> tuple[str, ...]:
    """:data:`CASE_READINGS` for a cohort of ``conditions`` (its two controls are the last two)."""
    controls = tuple(conditions[2:])
    return ("D", "s", "follow_original", "follow_flipped", "paired_success",
            *(f"agreement_{c}" for c in controls), *(f"expected_{c}" for c in controls),
            "invalid", "d_lose_a", "d_adopt_b", "D_category")


CASE_READINGS = case_reading_names(CONDITIONS)
"""Per case of an App. N cohort, in this order (see the module docstring)."""


def _matrix(samples: pd.DataFrame, column: str, conditions: Sequence[str] = CONDITIONS) -> dict[str, np.ndarray]:
    """``condition -> [case, sample]`` values of ``column`` (cases sorted, samples in order)."""
    out = {}
    for cond in conditions:
        part = samples[samples["condition"] == cond].pivot(index="case_id", columns="sample", values=column)
        out[cond] = part.sort_index().to_numpy(dtype=float)
    return out


def case_readings(samples: pd.DataFrame, categories_differ: Mapping[str, bool],
                  conditions: Sequence[str] = CONDITIONS) -> pd.DataFrame:
    """Per case (index ``case_id``, sorted), the readings of :func:`case_reading_names` from one
    checkpoint's answers (``samples``: :data:`SAMPLE_COLUMNS`; every case answered the same ``N``
    times under every one of ``conditions``). ``categories_differ``: case -> whether A's and B's
    categories differ."""
    counts = samples.groupby(["case_id", "condition"])["sample"].nunique().unstack()
    missing = [c for c in conditions if c not in counts.columns]
    if missing or counts.isna().to_numpy().any() or len(np.unique(counts.to_numpy())) != 1:
        raise ValueError(f"every case needs the same number of samples under each of {tuple(conditions)}")
    cases = sorted(samples["case_id"].unique())
    v = _matrix(samples, "v", conditions)
    valid = _matrix(samples, "valid", conditions)
    vo, vf = v["original"], v["flipped"]
    out = pd.DataFrame(index=pd.Index(cases, name="case_id"))
    out["D"] = (vo.mean(1) - vf.mean(1)) / 2
    out["follow_original"] = (vo == 1).mean(1)
    out["follow_flipped"] = (vf == -1).mean(1)
    out["s"] = (out["follow_original"] + out["follow_flipped"]) / 2
    out["paired_success"] = ((vo == 1) & (vf == -1)).mean(1)
    for ctrl in conditions[2:]:
        out[f"agreement_{ctrl}"] = (v[ctrl] == vo).mean(1)
        out[f"expected_{ctrl}"] = (v[ctrl] == 1).mean(1)
    out["invalid"] = 1.0 - np.concatenate([valid[c] for c in conditions], axis=1).mean(1)
    out["d_lose_a"] = (vo.mean(1) - (vf == 1).mean(1)) / 2
    out["d_adopt_b"] = (vf == -1).mean(1) / 2
    vc = _matrix(samples, "v_category", conditions)
    differ = np.array([bool(categories_differ[c]) for c in cases])
    out["D_category"] = np.where(differ, (vc["original"].mean(1) - vc["flipped"].mean(1)) / 2, np.nan)
    return out[list(case_reading_names(conditions))]


def checkpoint_readings(cases: pd.DataFrame, *, n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0) -> dict:
    """One checkpoint's readings over cases: each of :data:`CASE_READINGS` as its mean over the
    cases that have it, ``D`` and ``D_category`` with case-clustered 95 % percentile bootstrap
    intervals (``D_lo``, ``D_hi``, ...), and the case counts (``n_cases``, ``n_cases_category``)."""
    out: dict = {"n_cases": int(len(cases))}
    for name in cases.columns:
        values = cases[name].dropna().to_numpy(dtype=float)
        out[name] = float(values.mean()) if len(values) else float("nan")
    for name in ("D", "D_category"):
        values = cases[name].dropna().to_numpy(dtype=float)
        if len(values):
            ci = stats.bootstrap_ci(values, n_resamples=n_resamples, seed=seed)
            out[f"{name}_lo"], out[f"{name}_hi"] = ci.low, ci.high
        else:
            out[f"{name}_lo"] = out[f"{name}_hi"] = float("nan")
    out["n_cases_category"] = int(cases["D_category"].notna().sum())
    return out


__all__ = ["SAMPLE_COLUMNS", "CASE_READINGS", "sample_seed", "flip_value", "category_value", "sample_row",
           "case_readings", "case_reading_names", "checkpoint_readings", "answer_matches", "screen_answer"]
