"""The paper's run trees as a plan, and what each step will cost before it runs.

A :class:`PlanStep` is one entry point run of one tree (HD-001, HD-002, DT-000, ...), with the
steps it needs, the result ids of App. Q it serves, and its workload: how many notes (or
optimizer micro-steps) of how many tokens on which model. :func:`estimate` turns a workload into
GPU-hours from the figures recorded in ``benchmarks/results.json`` (:class:`Figures`); every
estimate names the figures and the formula it used, and a step without a recorded figure says so
rather than guess.

- A per-note pass or a training step: the benchmark's per-unit time, scaled by the tokens per
  note (linearly: a lower bound where attention's quadratic part dominates).
- Sampling (``generate``, ``evaluate``; :func:`generation_estimate`): a batched engine's measured
  wall time for a batch of prompts (``sampling.<engine>.<model>.p<prompt>.b<batch>.n<new>.wall_s``,
  vLLM preferred, then batched HF), per note, on a line through two measured new-token counts, at
  the shortest recorded prompt length at least the work's and the batch of least time per note;
  a model without its own such figures falls back to the HF backend at batch 1 (``generate.*``).
  A step bound to one path (the evidence-flip test's HF runs, clean or under the decode key mask)
  reads that path's figures only (``Workload.engine``).
- On-policy training (:func:`rollout_estimate`): the measured step (with TRL's colocated vLLM
  rollouts where recorded, else through HF generation), plus the rest of the rollout at the same
  backend's time per generated token.

:func:`render` prints the steps, their GPU-hours by tree and in total; :func:`select` keeps the
steps that a set of result ids needs, with everything they depend on.

The counts are the paper's (App. A, C, J, Q), as :func:`paper_plan` states them.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import re
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mistill.distill.arms import arm_names, resolve_arm
from mistill.errors import MistillInputError, TrackingUnavailableError
from mistill.results_index import load
from mistill.stages.cli import EXIT_INPUT, EXIT_UNREACHABLE

BENCHMARKS_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "results.json"
GIB = 2 ** 30


@dataclass(frozen=True)
class Figures:
    """The recorded benchmark figures: ``key -> value`` (``benchmarks/results.json``)."""

    values: Mapping[str, float]
    source: str = str(BENCHMARKS_FILE)

    @classmethod
    def load(cls, path: str | Path = BENCHMARKS_FILE) -> Figures:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise MistillInputError(f"cannot read the benchmark figures ({exc.__class__.__name__})",
                                    file=str(path)) from None
        return cls({k: float(v["value"]) for k, v in raw.items() if isinstance(v, Mapping) and "value" in v},
                   str(path))

    def get(self, key: str) -> float | None:
        return self.values.get(key)


@dataclass(frozen=True)
class Workload:
    """What a step computes.

    kind: one of :data:`COST_MODELS` (``none``: no GPU work, e.g. the report);
    model: the benchmark architecture (``qwen3-14b``, ``qwen3-4b``);
    units: notes for a per-note pass, optimizer micro-steps for training, events for key blocking;
    tokens: tokens per unit (prompt + trace; for generation, the prompt);
    new_tokens: tokens generated per unit (generation, on-policy rollouts, the own traces of
        ``own_heads``);
    on_policy_fraction: the share of on-policy training steps that roll out;
    sampler: the model whose own generations an ``own_heads`` step samples before its passes
        (``new_tokens`` each after a ``tokens - new_tokens``-token prompt; empty: none).
    head_notes, epochs, codes: the retriever's linear head (``shortlist``): the notes it trains
        on, its epochs and the inventory it scores (``units`` are then the notes encoded and
        ``tokens`` their words).
    predictions: notes the LAS simulator predicts for, each twice (with the rationale and from the
        note alone): ``evaluate``'s test notes, ``las_simulator``'s validation notes.
    engine: the one sampling path a generation step runs on (``hf_batched``: the HF path, clean;
        ``hf_masked``: the HF path under the decode-regime key mask); empty: whichever engine the
        stage resolves, costed from :data:`SAMPLING_ENGINES` in order.
    """

    kind: str
    model: str = ""
    units: int = 0
    tokens: int = 0
    new_tokens: int = 0
    on_policy_fraction: float = 1.0
    sampler: str = ""
    head_notes: int = 0
    epochs: int = 0
    codes: int = 0
    predictions: int = 0
    engine: str = ""


@dataclass(frozen=True)
class Estimate:
    """GPU-hours of a step (None: no recorded figure covers it), how they were computed, and the
    figures read."""

    gpu_hours: float | None
    formula: str
    keys: tuple[str, ...] = ()


# kind -> (figure of the per-unit time, figure of the tokens it was measured at; empty: not scaled)
COST_MODELS: dict[str, tuple[str, str]] = {
    # events + attribution of a note: the prefill and the attribution pass at the benchmark's length
    "characterize": ("instrument.{model}.attribution_pass_s", "instrument.{model}.tokens"),
    "locus": ("locus.{model}.note_s_with_null_windows_and_follow_through", "locus.{model}.tokens"),
    "read_side": ("readside.{model}.read_side_s", "readside.{model}.tokens"),
    "key_block": ("readside.{model}.key_block_event_s", ""),
    "edits": ("readside_edits.{model}.edit_refeed256_s", ""),
    "targets": ("instrument.{model}.prefill_s", "instrument.{model}.tokens"),
    "train_vanilla": ("train_step.{model}.vanilla_step_s", "train_step.{model}.tokens"),
    "train_mistill": ("train_step.{model}.mistill_step_s", "train_step.{model}.tokens"),
    "own_heads": ("instrument.{model}.attribution_pass_s", "instrument.{model}.tokens"),
}
COST_NOTES: dict[str, str] = {
    "own_heads": "the attribution pass",
}
ROLLOUTS = ("train_opd", "train_gold")
"""On-policy kinds, costed by :func:`rollout_estimate`."""
GENERATION = ("generate", "evaluate")
"""Kinds costed as sampling ``work.new_tokens`` after a ``work.tokens`` prompt for each of
``work.units`` notes (:func:`generation_estimate`). From a batched engine's measured wall time
where one is recorded for the model (:data:`SAMPLING_ENGINES`, in that order: the figures
``sampling.<engine>.<model>.p<prompt tokens>.b<batch>.n<new tokens>.wall_s``, the wall seconds of
``batch`` prompts each generating ``new tokens``, their prefills included, the engine's start not),
a note costing the wall time of its batch over the batch size, on a line through the two measured
new-token counts nearest the work's; otherwise from ``benchmarks/bench_generate.py``'s HF figures
at batch 1 (``generate.<model>.p<prompt tokens>.{prefill_s,decode_per_token_s}``), an upper bound
for a batched engine."""
SAMPLING_ENGINES: tuple[str, ...] = ("vllm", "hf_batched")
"""The batched engines whose ``sampling.*`` figures cost generation, most preferred first."""
PINNED_ENGINES: tuple[str, ...] = ("hf_batched", "hf_masked", "hf_masked_eager")
"""The paths a step may be bound to (``Workload.engine``): the batched HF path; the same path
under the decode-regime key mask, its decode step compiled (``benchmarks/bench_sampling.py
--engine hf_masked``); and the masked path uncompiled, as the prefill-inclusive regime runs
(``--engine hf_masked_eager``)."""
ENGINE_BOUNDS: dict[str, tuple[str, str]] = {
    "hf_batched": ("hf_masked", "the same HF path, batching and compiled decode step, without the mask's "
                                "extra work on the scores"),
}
"""A pinned path -> (a path at least as slow, why): where the pinned path has no usable figure for
the work, the slower path's measured figure costs it, as an upper bound the formula names."""
STAND_INS: dict[str, tuple[str, str]] = {
    "smollm3-3b": ("qwen3-4b", "SmolLM3-3B reads less per token than Qwen3-4B: 3.1B against 4.0B parameters, "
                               "4 key-value heads against 8 at the same 36 layers of 128-wide heads"),
}
"""A model -> (a larger model, why it is larger in every term a forward reads): where the model has
no batched-engine or forward-pass figure of its own, the larger model's measured figure costs it,
as an upper bound that the estimate's formula names."""
PASS_STAND_INS: dict[str, tuple[str, str]] = {
    "qwen3-4b": ("qwen3-14b", "Qwen3-14B reads more per token than Qwen3-4B: 14.8B against 4.0B parameters, 40 "
                              "layers of 40 query heads against 36 of 32, both with 8 key-value heads"),
}
"""A model -> (a larger model, why): where a per-note or per-event pass (:data:`COST_MODELS`) has no
figure for the model, the larger model's figure costs it, as an upper bound the formula names
(the students' trace edits of Table 22, timed on the teacher only)."""
READOUT = ("instrument.{model}.prefill_s", "instrument.{model}.tokens")
"""The figures of one teacher-forced forward, which ``evaluate`` runs per note over the teacher's
prompt and trace for its readouts after sampling (the prefill the instrument benchmark times)."""
SHORTLIST = ("shortlist.note_s", "shortlist.note_words", "shortlist.description_s", "shortlist.head_note_epoch_s",
             "shortlist.codes")
"""``benchmarks/bench_shortlist_las.py``'s retriever figures: seconds to encode and pool one note
of ``note_words`` words on the card, to encode one code description, and per note and epoch of
the linear head on the host, at ``codes`` codes."""
LAS = ("las.step_s", "las.tokens", "las.predict_rationale_batch_s", "las.predict_note_batch_s", "las.predict_batch")
"""``benchmarks/bench_shortlist_las.py``'s LAS simulator figures (Qwen3-1.7B): one training step
(a note's two sequences, the longer of ``tokens``), and one batch of ``predict_batch`` greedy
predictions with the rationale and one from the notes alone
(:func:`mistill.evaluation.las.greedy_answers`, as ``evaluate`` and ``las_simulator`` decode them)."""
COMPOSITE: dict[str, tuple[str, ...]] = {"characterize": ("events", "attribute", "knockin")}
"""Entry points that run others as nested steps."""


def sampling_key(engine: str, model: str, prompt: int, batch: int, new_tokens: int) -> str:
    """The figure of ``batch`` prompts of ``prompt`` tokens each sampling ``new_tokens`` tokens
    on ``engine``: their wall seconds."""
    return f"sampling.{engine}.{model}.p{prompt}.b{batch}.n{new_tokens}.wall_s"


def _sampling_walls(figures: Figures, engine: str, model: str) -> dict[int, dict[int, dict[int, float]]]:
    """The recorded wall times of ``engine`` on ``model``: prompt tokens -> batch -> new tokens ->
    seconds (the other figures under the same prefix, such as the engine's start, are not read)."""
    pattern = re.compile(re.escape(f"sampling.{engine}.{model}.") + r"p(\d+)\.b(\d+)\.n(\d+)\.wall_s")
    table: dict[int, dict[int, dict[int, float]]] = {}
    for key, value in figures.values.items():
        if m := pattern.fullmatch(key):
            prompt, batch, new = (int(g) for g in m.groups())
            table.setdefault(prompt, {}).setdefault(batch, {})[new] = value
    return table


def _prompt_length(lengths: Iterable[int], tokens: int) -> int:
    """The recorded prompt length to cost a ``tokens``-token prompt at: the shortest one at least
    as long (an upper bound), else the longest (shorter than the work's: a lower bound)."""
    ordered = sorted(lengths)
    return next((n for n in ordered if n >= tokens), ordered[-1])


def _segment(counts: Iterable[int], n: int) -> tuple[int, int]:
    """Two recorded new-token counts ``n1 < n2`` (at least two are given) whose line gives the
    time at ``n``: those either side of ``n``, else the two nearest it (extrapolated)."""
    ordered = sorted(counts)
    i = max(0, min(bisect.bisect_left(ordered, n) - 1, len(ordered) - 2))
    return ordered[i], ordered[i + 1]


def _prompt_note(recorded: int, tokens: int) -> str:
    """What costing a ``tokens``-token prompt at a ``recorded``-token one makes of the estimate."""
    if recorded < tokens:
        return f"; prompts shorter than the work's {tokens} tokens: a lower bound"
    if recorded > tokens:
        return f"; prompts longer than the work's {tokens} tokens: an upper bound"
    return ""


def _sampling_estimate(engine: str, work: Workload, figures: Figures) -> Estimate | str:
    """``work`` costed from ``engine``'s measured wall times, or why it cannot be (empty: the
    engine has no figure at all)."""
    table = _sampling_walls(figures, engine, work.model)
    if not table:
        others = any(k.startswith(f"sampling.{engine}.") and k.endswith(".wall_s") for k in figures.values)
        return (f"sampling.{engine}.{work.model}.* is not recorded (another model's figures are not used for it)"
                if others else "")
    prompt = _prompt_length(table, work.tokens)
    curves = {b: walls for b, walls in table[prompt].items() if len(walls) >= 2}
    if not curves:
        return f"sampling.{engine}.{work.model}.p{prompt}: no batch is recorded at two new-token counts"
    fitting = {b: walls for b, walls in curves.items() if b <= max(work.units, 1)}
    if not fitting:
        return (f"sampling.{engine}.{work.model}.p{prompt}: every batch recorded at two new-token counts is "
                f"larger than the work's {work.units} notes")
    n = work.new_tokens

    def per_note(batch: int) -> float:
        walls = fitting[batch]
        n1, n2 = _segment(walls, n)
        return (walls[n1] + (walls[n2] - walls[n1]) * (n - n1) / (n2 - n1)) / batch

    batch = min(fitting, key=lambda b: (per_note(b), b))
    walls = fitting[batch]
    n1, n2 = _segment(walls, n)
    w1, w2 = walls[n1], walls[n2]
    beyond = "" if n1 <= n <= n2 else f", extrapolated to {n}"
    keys = (sampling_key(engine, work.model, prompt, batch, n1), sampling_key(engine, work.model, prompt, batch, n2))
    formula = (f"{work.units} x ({w1:.4g} s + ({w2:.4g} - {w1:.4g}) s x ({n} - {n1}) / ({n2} - {n1})) / {batch} "
               f"(measured: {engine}, batch {batch}, {prompt}-token prompts, {n1} and {n2} new tokens{beyond}"
               f"{_prompt_note(prompt, work.tokens)})")
    seconds = work.units * per_note(batch)
    compiling = _compile_seconds(engine, work.model, prompt, table[prompt], figures)
    if compiling is not None:
        compile_s, warm_keys = compiling
        seconds += compile_s
        formula += f" + {compile_s:.4g} s compiling the decode step once (the warm-up less its timed run)"
        keys += warm_keys
    return Estimate(seconds / 3600, formula, keys)


def _compile_seconds(engine: str, model: str, prompt: int, walls: Mapping[int, Mapping[int, float]],
                     figures: Figures) -> tuple[float, tuple[str, ...]] | None:
    """The one-time cost of compiling ``engine``'s decode step where its figures were timed after
    a warm-up (``sampling.<engine>.<model>.p<prompt>.warmup_s``: ``bench_sampling.py --warmup``
    runs the largest new-token count at its largest batch once, untimed): the warm-up's wall less
    the timed wall of the same batch and count, with the two keys read. None: no warm-up recorded
    (the walls then hold whatever compiling there was)."""
    warm_key = f"sampling.{engine}.{model}.p{prompt}.warmup_s"
    warm = figures.get(warm_key)
    if warm is None:
        return None
    new, batch = max((n, b) for b, counts in walls.items() for n in counts)
    return max(0.0, warm - walls[batch][new]), (warm_key, sampling_key(engine, model, prompt, batch, new))


def _hf_generation_estimate(work: Workload, figures: Figures) -> Estimate:
    """``work`` costed from the HF backend at batch 1: the prefill measured at the nearest recorded
    prompt length, scaled by the prompt's tokens, plus the new tokens at that length's time per
    token."""
    prefix = f"generate.{work.model}.p"
    lengths = sorted(int(m.group(1)) for k in figures.values
                     if (m := re.fullmatch(re.escape(prefix) + r"(\d+)\.prefill_s", k)))
    if not lengths:
        return Estimate(None, f"{prefix}<tokens>.prefill_s is not recorded")
    bench = min(lengths, key=lambda n: (abs(n - work.tokens), n))
    prefill_key, token_key = f"{prefix}{bench}.prefill_s", f"{prefix}{bench}.decode_per_token_s"
    prefill, per_token = figures.get(prefill_key), figures.get(token_key)
    if prefill is None or per_token is None:
        return Estimate(None, f"{token_key} is not recorded")
    per_unit = prefill * work.tokens / bench + work.new_tokens * per_token
    return Estimate(work.units * per_unit / 3600,
                    f"{work.units} x ({prefill:.3g} s x {work.tokens} / {bench} tokens + {work.new_tokens} x "
                    f"{per_token:.3g} s) (HF backend, batch 1: an upper bound for a batched engine)",
                    (prefill_key, token_key))


def generation_estimate(work: Workload, figures: Figures) -> Estimate:
    """GPU-hours of sampling ``work.new_tokens`` after a ``work.tokens`` prompt for each of
    ``work.units`` notes.

    The first engine of :data:`SAMPLING_ENGINES` with a usable figure for ``work.model`` (its own:
    no other model's figures stand in for it) costs it: at the shortest recorded prompt length at
    least the work's (else the longest, said to be shorter), among the batches no larger than the
    work's notes and recorded at two new-token counts or more, the batch of least seconds per note,
    ``(w1 + (w2 - w1) x (N - n1) / (n2 - n1)) / batch`` from the walls ``w1``, ``w2`` measured at the
    counts ``n1 < n2`` either side of the work's ``N`` (else the two nearest it); GPU-hours are notes
    x that / 3600. Without one, the HF backend at batch 1 (``generate.*`` figures), its formula
    saying why each recorded engine was passed over; without that either, no estimate. A step bound
    to one path (``work.engine``) reads that engine's figures only, then those of the slower path
    :data:`ENGINE_BOUNDS` names, then the HF batch-1 bound."""
    if work.engine and work.engine not in PINNED_ENGINES:
        raise ValueError(f"unknown sampling path {work.engine!r}: one of {', '.join(PINNED_ENGINES)}")
    engines = (work.engine,) if work.engine else SAMPLING_ENGINES
    passed: list[str] = []
    for engine in engines:
        found = _sampling_estimate(engine, work, figures)
        if isinstance(found, Estimate):
            return found
        if found:
            passed.append(found)
        elif work.engine:  # the bound path has no figure at all: say so beside the fallback
            passed.append(f"sampling.{engine}.{work.model}.* is not recorded")
    if work.engine in ENGINE_BOUNDS:  # a slower path's figures: an upper bound, said so
        slower, why = ENGINE_BOUNDS[work.engine]
        found = _sampling_estimate(slower, work, figures)
        if isinstance(found, Estimate):
            return Estimate(found.gpu_hours, f"{found.formula}; {slower}'s figures stand for {work.engine}: an upper "
                                             f"bound ({why}); {'; '.join(passed)}", found.keys)
    if work.model in STAND_INS:  # a larger model's batched figures: an upper bound, said so
        larger, why = STAND_INS[work.model]
        for engine in engines:
            found = _sampling_estimate(engine, dataclasses.replace(work, model=larger), figures)
            if isinstance(found, Estimate):
                return Estimate(found.gpu_hours, f"{found.formula}; {larger}'s figures stand for {work.model}: "
                                                 f"an upper bound ({why})", found.keys)
    hf = _hf_generation_estimate(work, figures)
    return Estimate(hf.gpu_hours, "; ".join([hf.formula, *passed]), hf.keys) if passed else hf


def _vllm_token_rate(work: Workload, figures: Figures) -> tuple[float, int, tuple[str, str]] | str:
    """The student's vLLM batch-1 time per generated token, ``(w2 - w1) / (n2 - n1)`` at the
    recorded prompt length :func:`generation_estimate` would pick among those with a batch-1
    figure, with that length and the two figures read; or why there is none."""
    table = _sampling_walls(figures, "vllm", work.model)
    lengths = [p for p, batches in table.items() if 1 in batches]
    if not lengths:
        return f"sampling.vllm.{work.model}.p<tokens>.b1.n<new tokens>.wall_s is not recorded"
    prompt = _prompt_length(lengths, work.tokens)
    walls = table[prompt][1]
    if len(walls) < 2:
        return (f"sampling.vllm.{work.model}.p{prompt}.b1 is recorded at one new-token count; a time per "
                "token needs two")
    n1, n2 = _segment(walls, work.new_tokens)
    return ((walls[n2] - walls[n1]) / (n2 - n1), prompt,
            (sampling_key("vllm", work.model, prompt, 1, n1), sampling_key("vllm", work.model, prompt, 1, n2)))


def _onpolicy_estimate(work: Workload, figures: Figures, on_key: str, vllm: bool) -> Estimate:
    """On-policy training from the step measured at ``on_key`` (``vllm``: with TRL's colocated
    vLLM rollouts, the rest of the rollout at vLLM's batch-1 time per token; else through HF
    generation, the rest at the HF backend's)."""
    p = f"onpolicy_step.{work.model}."
    keys = [on_key, p + "opd_rollout_tokens"] + ([p + "gold_off_policy_step_s"] if work.kind == "train_gold" else [])
    values = [figures.get(k) for k in keys]
    if any(v is None for v in values):
        return Estimate(None, f"{keys[values.index(None)]} is not recorded")
    step, cap = values[0], int(values[1])
    extra = max(0, work.new_tokens - cap)
    if vllm:
        per_token = 0.0
        if extra:
            rate = _vllm_token_rate(work, figures)
            if isinstance(rate, str):
                return Estimate(None, rate)
            per_token, prompt, token_keys = rate
            keys += token_keys
            how = (f"the step measured with TRL's colocated vLLM rollouts of {cap} tokens, the rest at vLLM's "
                   f"batch-1 time per token at {prompt}-token prompts")
        else:
            how = f"the step measured with TRL's colocated vLLM rollouts of {cap} tokens"
    else:
        rollout = _hf_generation_estimate(Workload("generate", work.model, 1, work.tokens, 1), figures)
        if rollout.gpu_hours is None:
            return Estimate(None, rollout.formula)
        per_token = figures.get(rollout.keys[1])
        keys.append(rollout.keys[1])
        how = "through HF generation"
    on_policy = step + extra * per_token
    if work.kind == "train_opd":
        per_unit, text = on_policy, f"({step:.3g} s + {extra} x {per_token:.3g} s)"
    else:
        f = work.on_policy_fraction
        per_unit = f * on_policy + (1 - f) * values[2]
        text = f"({f:g} x ({step:.3g} s + {extra} x {per_token:.3g} s) + {1 - f:g} x {values[2]:.3g} s)"
        how += "; the off-policy steps as measured"
    return Estimate(work.units * per_unit / 3600, f"{work.units} x {text} (a {work.new_tokens}-token rollout, {how})",
                    tuple(keys))


def rollout_estimate(work: Workload, figures: Figures) -> Estimate:
    """GPU-hours of on-policy training (``benchmarks/bench_onpolicy_step.py``): each step's
    measured time with a rollout of ``onpolicy_step.<model>.opd_rollout_tokens`` tokens, plus the
    rest of a ``work.new_tokens`` rollout at the student's time per generated token. GOLD
    (``train_gold``) rolls out on the arm's on-policy fraction of its steps
    (``work.on_policy_fraction``) and trains on the teacher's trace, cut at the rollout cap, on the
    others (the benchmark's off-policy step, ``gold_off_policy_step_s``).

    Where the on-policy step is recorded with TRL's colocated vLLM rollouts
    (``opd_step_vllm_s``, ``gold_on_policy_step_vllm_s``), that step, the rest of the rollout at
    vLLM's batch-1 time per token (``sampling.vllm.<model>.p<prompt>.b1.n<new tokens>.wall_s``
    at two counts); where that time is not recorded, or the step is not, the step through HF
    generation (``opd_step_s``, ``gold_on_policy_step_s``), the rest at the HF backend's time per
    token (``generate.<model>.p<prompt>.decode_per_token_s``), its formula saying why vLLM's was
    passed over."""
    name = "opd_step" if work.kind == "train_opd" else "gold_on_policy_step"
    vllm_key = f"onpolicy_step.{work.model}.{name}_vllm_s"
    passed = ""
    if figures.get(vllm_key) is not None:
        found = _onpolicy_estimate(work, figures, vllm_key, vllm=True)
        if found.gpu_hours is not None:
            return found
        passed = found.formula
    hf = _onpolicy_estimate(work, figures, f"onpolicy_step.{work.model}.{name}_s", vllm=False)
    return Estimate(hf.gpu_hours, f"{hf.formula}; {vllm_key} not used: {passed}", hf.keys) if passed else hf


def _sum(parts: Sequence[Estimate]) -> Estimate:
    """Estimates of a step's parts added: the hours (None when a part has none), the formulas
    joined by ``+``, the figures read."""
    hours = None if any(p.gpu_hours is None for p in parts) else sum(p.gpu_hours for p in parts)
    return Estimate(hours, " + ".join(f"[{p.formula}]" for p in parts), tuple(k for p in parts for k in p.keys))


def readout_estimate(work: Workload, figures: Figures) -> Estimate:
    """GPU-hours of ``evaluate``'s teacher-forced readouts: one forward per note over its prompt
    and the teacher's trace (``work.tokens + work.new_tokens``), from :data:`READOUT`'s figures
    scaled by tokens (the model's own, else its :data:`STAND_INS` larger model's, said so)."""
    note = ""
    model = work.model
    if figures.get(READOUT[0].format(model=model)) is None and model in STAND_INS:
        model, why = STAND_INS[model]
        note = f"; {model}'s forward stands for {work.model}'s: an upper bound ({why})"
    time_key, tokens_key = (k.format(model=model) for k in READOUT)
    per_note, bench = figures.get(time_key), figures.get(tokens_key)
    if per_note is None or bench is None:
        return Estimate(None, f"{time_key} is not recorded")
    tokens = work.tokens + work.new_tokens
    return Estimate(work.units * per_note * tokens / bench / 3600,
                    f"{work.units} x {per_note:.3g} s x ({tokens} / {bench:.0f} tokens) (the readouts' forward{note})",
                    (time_key, tokens_key))


def _missing(keys: Sequence[str], figures: Figures) -> str:
    """The first of ``keys`` without a recorded figure, or empty."""
    return next((k for k in keys if figures.get(k) is None), "")


def shortlist_estimate(work: Workload, figures: Figures) -> Estimate:
    """GPU-hours of a ``shortlist`` step (:data:`SHORTLIST`'s figures): ``units`` notes encoded
    (scaled by words), the inventory's descriptions, and the head's ``epochs`` over ``head_notes``
    notes (scaled by codes; it trains on the host while the stage holds the card)."""
    missing = _missing(SHORTLIST, figures)
    if missing:
        return Estimate(None, f"{missing} is not recorded (benchmarks/bench_shortlist_las.py)")
    note_s, words, desc_s, head_s, codes = (figures.get(k) for k in SHORTLIST)
    seconds = (work.units * note_s * work.tokens / words + work.codes * desc_s
               + work.epochs * work.head_notes * head_s * work.codes / codes)
    return Estimate(seconds / 3600,
                    f"{work.units} notes x {note_s:.3g} s x ({work.tokens} / {words:.0f} words) + {work.codes} "
                    f"descriptions x {desc_s:.3g} s + {work.epochs} epochs x {work.head_notes} notes x {head_s:.3g} s "
                    f"x ({work.codes} / {codes:.0f} codes) (the head, on the host)", SHORTLIST)


def las_estimate(work: Workload, figures: Figures) -> Estimate:
    """GPU-hours of the LAS simulator's part of a step (:data:`LAS`'s figures): ``las_simulator``'s
    ``units`` training steps of ``tokens``-token sequences (scaled by tokens), and two greedy
    predictions for each of ``predictions`` notes, decoded in batches of the benchmark's size."""
    missing = _missing(LAS, figures)
    if missing:
        return Estimate(None, f"{missing} is not recorded (benchmarks/bench_shortlist_las.py)")
    step_s, bench_tokens, with_rationale, note_only, batch = (figures.get(k) for k in LAS)
    train = work.units * step_s * work.tokens / bench_tokens if work.kind == "las_simulator" else 0.0
    batches = -(-work.predictions // int(batch))
    predict = batches * (with_rationale + note_only)
    parts = [f"{work.units} steps x {step_s:.3g} s x ({work.tokens} / {bench_tokens:.0f} tokens)"] \
        if work.kind == "las_simulator" else []
    parts.append(f"{batches} batches of {batch:.0f} x ({with_rationale:.3g} + {note_only:.3g}) s "
                 "(the LAS simulator's predictions)")
    return Estimate((train + predict) / 3600, " + ".join(parts), LAS)


def estimate(work: Workload, figures: Figures) -> Estimate:
    """GPU-hours of ``work``: units x per-unit seconds (x tokens / benchmark tokens) / 3600; for
    generation, :func:`generation_estimate` (``evaluate`` adds :func:`readout_estimate`); for
    on-policy training, :func:`rollout_estimate`; an ``own_heads`` step with a ``sampler`` adds
    the generation of its own traces; ``shortlist`` and ``las_simulator`` steps, and the LAS
    predictions of an ``evaluate`` step, from :data:`SHORTLIST` and :data:`LAS`."""
    if work.kind == "none":
        return Estimate(0.0, "no GPU work")
    if work.kind == "evaluate":
        parts = [generation_estimate(work, figures), readout_estimate(work, figures)]
        return _sum(parts + [las_estimate(work, figures)] if work.predictions else parts)
    if work.kind == "shortlist":
        return shortlist_estimate(work, figures)
    if work.kind == "las_simulator":
        return las_estimate(work, figures)
    if work.kind in GENERATION:
        return generation_estimate(work, figures)
    if work.kind in ROLLOUTS:
        return rollout_estimate(work, figures)
    if work.kind == "own_heads" and work.sampler:
        traces = Workload("generate", work.sampler, work.units, work.tokens - work.new_tokens, work.new_tokens)
        passes = dataclasses.replace(work, sampler="", new_tokens=0)
        return _sum([estimate(passes, figures), generation_estimate(traces, figures)])
    if work.kind not in COST_MODELS:
        return Estimate(None, f"no benchmark figure for {work.kind} on a GPU yet")
    time_key, tokens_key = (k.format(model=work.model) for k in COST_MODELS[work.kind])
    per_unit = figures.get(time_key)
    if per_unit is None and work.model in PASS_STAND_INS:  # a larger model's pass: an upper bound, said so
        larger, why = PASS_STAND_INS[work.model]
        found = estimate(dataclasses.replace(work, model=larger), figures)
        if found.gpu_hours is not None:
            return Estimate(found.gpu_hours, f"{found.formula}; {larger}'s figure stands for {work.model}'s: an "
                                             f"upper bound ({why})", found.keys)
    if per_unit is None:
        return Estimate(None, f"{time_key} is not recorded")
    keys = [time_key]
    scale, scale_text = 1.0, ""
    if tokens_key:
        bench_tokens = figures.get(tokens_key)
        if bench_tokens is None:
            return Estimate(None, f"{tokens_key} is not recorded")
        keys.append(tokens_key)
        scale = work.tokens / bench_tokens
        scale_text = f" x ({work.tokens} / {bench_tokens:.0f} tokens)"
    hours = work.units * per_unit * scale / 3600
    note = f" ({COST_NOTES[work.kind]})" if work.kind in COST_NOTES else ""
    return Estimate(hours, f"{work.units} x {per_unit:.3g} s{scale_text}{note}", tuple(keys))


ROLES: tuple[str, ...] = ("teacher", "student", "student_smollm3", "encoder", "las_model", "corpus",
                           "distill_corpus", "split_file", "flip_proposals", "flip_ledger", "eurlex_dataset",
                           "eurlex_concepts", "eurlex_hierarchy", "bigcodebench_file", "musique_release",
                           "musique_pair_proposals", "musique_pair_ledger", "kodcode_file")
"""The placeholders a step's ``params`` may hold (``{teacher}``): the models and data a reproduction
is given (:class:`mistill.stages.reproduce.ReproduceConfig` has a field of each name)."""


@dataclass(frozen=True)
class PlanStep:
    """One entry point run of one tree.

    name: unique in the plan (``<tree>/<step>``).
    inputs: config field -> the step whose run it takes (``<step name>``, or
        ``<step name>:<nested step>`` for a run a composite step nests, e.g.
        ``DT-000/teacher_attribute:attribute``); a ``*_runs`` field takes several, comma-separated.
    needs: every step whose run this one reads: those of ``inputs`` and any read otherwise
        (a Mistill arm reads the λ the selection picked).
    params: the ``-P`` settings that differ from the entry point's defaults; ``{role}``
        placeholders (:data:`ROLES`) stand for the models and data given.
    disk_gib: the artifacts it writes, from rough per-note sizes (**[recon]**: the paper states
        none; a checkpoint of a 4B student in bf16 is 8 GiB).
    skip_synthetic: on a synthetic corpus the step is not run: ``generate`` (the corpus carries
        scripted teacher traces; the step then stands for its input) and the retriever's
        training notes (the shortlist generates synthetic ones).
    synthetic_params: on a synthetic corpus, these replace ``params`` (a key set to ``""`` is
        dropped): the evidence-flip cohort's synthetic cases stand for the author's files there.
    model_run: a ``train`` step whose checkpoint is the step's model (``-P model=run:<its run id>``;
        empty: the ``model`` param, if any): a trained student characterized like the teacher.
    experiment: empty, or the suffix of an experiment of the tree's own (``<corpus>-<experiment>``):
        a tree whose arms would share the main trees' table keys (model, arm, precision, seed) runs
        and is reported there (MQ's students on MuSiQue-Ans).
    """

    tree: str
    step: str
    entry_point: str
    work: Workload
    needs: tuple[str, ...] = ()
    params: Mapping[str, str] = field(default_factory=dict)
    disk_gib: float = 0.0
    inputs: Mapping[str, str] = field(default_factory=dict)
    skip_synthetic: bool = False
    synthetic_params: Mapping[str, str] = field(default_factory=dict)
    model_run: str = ""
    experiment: str = ""

    @property
    def name(self) -> str:
        return f"{self.tree}/{self.step}"

    def params_for(self, synthetic: bool) -> dict[str, str]:
        """The ``-P`` settings on the corpus given: ``params``, with ``synthetic_params`` over them
        on a synthetic corpus."""
        if not synthetic or not self.synthetic_params:
            return dict(self.params)
        merged = {**self.params, **self.synthetic_params}
        return {k: v for k, v in merged.items() if v != ""}

    @property
    def covers(self) -> tuple[str, ...]:
        """The entry points this step runs: its own and, for a composite one, its nested steps'."""
        return (self.entry_point, *COMPOSITE.get(self.entry_point, ()))


def _step(tree: str, step: str, entry_point: str, work: Workload, *, inputs: Mapping[str, str] | None = None,
          after: tuple[str, ...] = (), params: Mapping[str, str] | None = None, disk_gib: float = 0.0,
          skip_synthetic: bool = False, synthetic_params: Mapping[str, str] | None = None,
          model_run: str = "", experiment: str = "") -> PlanStep:
    """A :class:`PlanStep` whose ``needs`` are the steps of its ``inputs``, ``model_run`` and ``after``."""
    inputs = dict(inputs or {})
    needs: list[str] = []
    for ref in [*(r for refs in inputs.values() for r in refs.split(",")), *([model_run] if model_run else []),
                *after]:
        name = ref.split(":", 1)[0]
        if name not in needs:
            needs.append(name)
    return PlanStep(tree, step, entry_point, work, tuple(needs), dict(params or {}), disk_gib, inputs,
                    skip_synthetic, dict(synthetic_params or {}), model_run, experiment)


@dataclass(frozen=True)
class PaperCounts:
    """The paper's sizes: notes, tokens and seeds (App. A, C, I, J).

    characterization_traces: HD-001's traces (100 over 94 notes); instruction_notes: the
    instruction control's notes (Table 4: 30, the narrowing sentence removed); full_prompt_tokens: a
    full-inventory prompt + trace (the instrument benchmark's length); shortlist_tokens: a
    shortlist prompt + trace; train_notes, val_notes, test_notes: the distillation corpus;
    selection_notes: the λ selection's training notes; epochs and grad_accum: the recipe.
    trace_tokens: the tokens a trace takes, the teacher's and the students' generations alike
    (**[recon]**: the paper states the 16,384-token cap and that 200 of the 500 training traces
    run past 6,144 tokens, App. J.3, not a median; 6,000 sits just under that).
    retriever_train_notes: the linear head's training notes (App. A: the MIMIC-IV ICD-10 train
    split of 89,099 summaries, less the patients of both corpora: an upper bound);
    inventory_codes: the diagnosis codes (5,651); head_epochs: the head's epochs
    (:class:`mistill.data.shortlist.RetrieverSettings`); note_words: the words of a summary
    (**[recon]**: the paper states none; 1,500); note_tokens: the same note in the LAS simulator's
    tokens (**[recon]**: 2,000); simulator_steps: the LAS simulator's training steps, one pass over
    the teacher's training traces (**[recon]**: App. K states no schedule).
    flip_pool: the release notes the evidence-flip cohort is drawn from, screened by the teacher
    (**[recon]**: App. N.2 draws 300 patients disjoint from every development cohort without
    naming the pool; 400 leaves room for the distillation corpus's patients); flip_cases: the
    approved cases (33), flip_samples: answers per case and condition (4), flip_conditions: 4.
    eurlex_rank_acts, eurlex_assess_acts: the EURLEX57K development batch the teacher is ranked on
    and the disjoint assessment batch (**[recon]**: App. P states neither size; 40 each, the
    programming pilot's assessment size), eurlex_fresh_acts: the fresh acts (100);
    eurlex_prompt_tokens: an act's prompt with its candidate list (**[recon]**: 4,000), its
    trace ``trace_tokens`` long.
    code_rank_tasks, code_assess_tasks, code_fresh_tasks: BigCodeBench's ranking batches, its
    assessment batch and the fresh tasks (App. P: three screening batches of 180 development tasks,
    two ranked and one assessed, and 100 fresh tasks; **[recon]**: batches of 60 each, so 120 and
    60); code_prompt_tokens: a problem's instruct prompt (**[recon]**: 1,000).
    kodcode_problems: the programming pilot's training problems (App. P: a locked split of 2,000);
    kodcode_prompt_tokens: a KodCode problem's prompt (**[recon]**: 500); pilot_seeds: its paired
    training seeds (2); pilot_lambda: its fixed loss weight (0.01, App. P).
    musique_splits: App. O's training, ranking, selection and evaluation questions (2,000, 102,
    1,203, 1,610); musique_prompt_tokens: a question's prompt, its 20 passages (**[recon]**:
    3,000); musique_trace_tokens: a MuSiQue-Ans trace (**[recon]**: 2,000; the cap is 16,384);
    musique_seeds: the training seeds of each arm (3).
    musique_pair_slice: the dev file's questions after the evaluation questions, the evidence
    pairs' bases (**[recon]**: the remaining 807 of 2,417; App. O screens 385 two-hop bases there);
    musique_pair_bases: the bases the cohort's draw orders (385); musique_pairs: the accepted pairs
    (16); musique_pair_samples: answers per pair and condition (4); musique_gate_draws: the
    teacher gate's layer-matched random head draws (3).
    """

    characterization_traces: int = 100
    instruction_notes: int = 30
    full_prompt_tokens: int = 106_000
    shortlist_tokens: int = 36_000
    train_notes: int = 493
    val_notes: int = 100
    test_notes: int = 150
    selection_notes: int = 100
    epochs: int = 2
    events_per_note: int = 150
    edit_events_per_note: int = 20
    edit_reads_per_event: int = 4
    trace_tokens: int = 6_000
    retriever_train_notes: int = 89_099
    inventory_codes: int = 5_651
    head_epochs: int = 200
    note_words: int = 1_500
    note_tokens: int = 2_000
    simulator_steps: int = 493
    flip_pool: int = 400
    flip_cases: int = 33
    flip_samples: int = 4
    flip_conditions: int = 4
    eurlex_rank_acts: int = 40
    eurlex_assess_acts: int = 40
    eurlex_fresh_acts: int = 100
    eurlex_prompt_tokens: int = 4_000
    code_rank_tasks: int = 120
    code_assess_tasks: int = 60
    code_fresh_tasks: int = 100
    code_prompt_tokens: int = 1_000
    musique_splits: tuple[int, int, int, int] = (2_000, 102, 1_203, 1_610)
    musique_prompt_tokens: int = 3_000
    musique_trace_tokens: int = 2_000
    musique_seeds: int = 3
    musique_pair_slice: int = 807
    musique_pair_bases: int = 385
    musique_pairs: int = 16
    musique_pair_samples: int = 4
    musique_gate_draws: int = 3
    kodcode_problems: int = 2_000
    kodcode_prompt_tokens: int = 500
    pilot_seeds: int = 2
    pilot_lambda: float = 0.01

    def micro_steps(self, notes: int, epochs: int | None = None) -> int:
        return notes * (self.epochs if epochs is None else epochs)


def corpus_counts(corpus, lengths: Sequence, base: PaperCounts = PaperCounts(), *, sizes: bool = True) -> PaperCounts:
    """``base`` with a corpus's own sizes: the median prompt + trace tokens of its notes
    (``lengths``: :func:`mistill.stages.prepare.prompt_lengths`), as shortlist lengths when its
    notes list a shortlist and as full-inventory lengths otherwise, the median trace of the notes
    that carry one, and (``sizes``) its split sizes where it has the split (``train``, ``val``,
    ``test``)."""
    if not lengths:
        raise MistillInputError("the corpus has no notes to count", field="prepare_run")
    median = int(statistics.median(n.total_tokens for n in lengths))
    shortlisted = any(note.shortlist is not None for note in corpus.notes)
    changes: dict[str, int] = {"shortlist_tokens" if shortlisted else "full_prompt_tokens": median}
    traced = [n.total_tokens - n.prompt_tokens for n in lengths if n.has_trace]
    if traced:
        changes["trace_tokens"] = int(statistics.median(traced))
    for split, name in (("train", "train_notes"), ("val", "val_notes"), ("test", "test_notes")):
        n = sum(note.split == split for note in corpus.notes)
        if n and sizes:
            changes[name] = n
    return dataclasses.replace(base, **changes)


SELFTEST: dict[str, str] = {"selftest_events": "10", "selftest_notes": "1"}
"""The attribution self-test as the paper ran it (Sec. 2.3, Table 8): ten P1 events of one note,
every head patched exactly, on HD-001's characterization."""

STUDENTS: dict[str, str] = {"qwen3-4b": "{student}", "smollm3-3b": "{student_smollm3}"}
"""The students' plan names and the role that holds each one's model."""

ARM_SEEDS: tuple[tuple[str, str, str, int], ...] = (
    ("qwen3-4b", "vanilla-fp32", "train_vanilla", 3), ("qwen3-4b", "vanilla-bf16", "train_vanilla", 3),
    ("qwen3-4b", "feature-kd", "train_mistill", 3), ("qwen3-4b", "distillm2", "train_vanilla", 1),
    ("qwen3-4b", "opd", "train_opd", 1), ("qwen3-4b", "mistill", "train_mistill", 3),
    ("smollm3-3b", "vanilla-fp32", "train_vanilla", 2), ("smollm3-3b", "vanilla-bf16", "train_vanilla", 1),
    ("smollm3-3b", "feature-kd", "train_mistill", 1), ("smollm3-3b", "gold", "train_gold", 1),
    ("smollm3-3b", "mistill", "train_mistill", 3))
"""(student, arm, cost model, seeds) of the main comparison: App. J.4's seed counts, with the third
SmolLM3-3B Mistill seed of the revision (R-D27, R-D36). SmolLM3-3B's
generations are estimated from its own recorded figures; its training, characterization and own-heads steps
from the Qwen3-4B ones (no SmolLM3 training or pass benchmark is recorded)."""

ABLATION_SEEDS: tuple[tuple[str, str, str, int], ...] = tuple(
    ("qwen3-4b", arm, "train_vanilla" if arm == "event-weighted-vanilla" else "train_mistill", seeds)
    for arm, seeds in (("randheads", 3), ("randpos", 1), ("randboth", 1), ("bottom40", 1), ("top8", 1),
                       ("top100", 1), ("uniform", 1), ("no-window", 1), ("event-weighted-vanilla", 1),
                       ("p1-only", 1), ("p2-only", 1), ("attention-only", 1), ("interaction-only", 1),
                       ("write-term", 1), ("mistill-fp32", 3), ("low-lambda", 1),
                       ("mistill-fp32-bf16-lambda", 3))) + tuple(
    ("smollm3-3b", arm, "train_mistill", seeds)
    for arm, seeds in (("randheads", 2), ("randpos", 1), ("bottom40", 2), ("top8", 1), ("attention-only", 1)))
"""The controls and ablations of App. L and M (tree DT-001), on Qwen3-4B unless named: one seed
each, three for RandHeads (R-D26), for Mistill with fp32 master weights at the λ of the fp32
re-selection (App. I.4, R-D30) and at the bf16 selection's (the precision control, R-D17); the
lower-λ ablation at its own λ (R-D14, :data:`OWN_LAMBDA_ARMS`); on SmolLM3-3B, RandHeads and the
bottom-40 pool at two seeds (R-D12, R-D13), the top-8 pool (R-D13), RandPos (R-D7) and
attention-only (R-D11) at one; the
others at the bf16 selection's λ."""

PROBE: tuple[str, str, str] = ("qwen3-4b", "mistill-fp32", "L35H26")
"""(student, arm, head) of App. I's k = 8 probe: the head the fp32 arm's first-order ranking puts at
rank 12 (rank 3 in every bf16 arm), moved to rank 8 of its own P2C ranking (R-D22)."""

OWN_LAMBDA_ARMS: frozenset[str] = frozenset({"low-lambda"})
"""Mechanism arms that train at the λ of their arm file, never a selection's pick."""
SELECTION_OF: dict[str, str] = {"mistill-fp32-bf16-lambda": "DT-001/select_lambda"}
"""A mechanism arm whose λ comes from another selection than its precision's (the fp32 arm of the
precision control reads the bf16 selection)."""


def _traced_corpus(tree: str, prepare: str, prepare_params: Mapping[str, str], generation: Workload) -> list[PlanStep]:
    """A tree's corpus and the teacher's traces on it: its ``prepare`` step (when ``prepare`` is
    ``"prepare"``; else the step named ``prepare``, a shortlist, stands for it) then ``generate``
    (``generation``: its workload)."""
    steps = []
    if prepare == "prepare":
        steps.append(_step(tree, "prepare", "prepare", Workload("none"),
                           params={"model": "{teacher}", **prepare_params}))
    steps.append(_step(tree, "generate", "generate", generation, inputs={"prepare_run": f"{tree}/{prepare}"},
                       params={"model": "{teacher}"}, skip_synthetic=True))
    return steps


def paper_plan(counts: PaperCounts = PaperCounts()) -> list[PlanStep]:
    """The paper's run trees in order; a step's needs come before it.

    HD-001: the teacher characterized with the full inventory in context (App. A-F), with its
    locus, read side, key blocking and edits; HD-002: the same notes with the retrieved shortlist
    (App. G); ``instruction``: without the prompt's narrowing sentence (Table 4); DT-000: the
    distillation corpus, its shortlist, the teacher's traces and targets, the students'
    rankings, the LAS simulator, and the teacher's and untrained students' evaluations; DT-001:
    the λ selection and the Mistill arms; EF: the evidence-flip test (App. N); the report.
    """
    c = counts
    full, short = c.full_prompt_tokens, c.shortlist_tokens
    release = {"corpus": "{corpus}", "split_file": "{split_file}"}
    chars = c.characterization_traces
    steps: list[PlanStep] = []
    # HD-001: the full inventory
    trace = c.trace_tokens

    def generation(model: str, notes: int, tokens: int) -> Workload:
        return Workload("generate", model, notes, tokens - trace, trace)

    def retrieval(notes: int) -> Workload:  # the corpus's notes and the head's training notes encoded
        return Workload("shortlist", "gte-large", notes + c.retriever_train_notes, c.note_words,
                        head_notes=c.retriever_train_notes, epochs=c.head_epochs, codes=c.inventory_codes)

    steps += _traced_corpus("HD-001", "prepare", {**release, "select_n": "94", "remove_discharge_diagnosis": "true"},
                            generation("qwen3-14b", chars, full))
    attr = {"attribute_run": "HD-001/characterize:attribute"}
    steps += [
        _step("HD-001", "characterize", "characterize", Workload("characterize", "qwen3-14b", chars, full),
              inputs={"prepare_run": "HD-001/generate"},
              params={"model": "{teacher}", **SELFTEST}, disk_gib=chars * 0.05),
        _step("HD-001", "locus", "locus", Workload("locus", "qwen3-14b", chars, full), inputs=attr,
              disk_gib=chars * 0.01),
        _step("HD-001", "read_side", "read_side", Workload("read_side", "qwen3-14b", chars, full), inputs=attr,
              disk_gib=chars * 0.01),
        _step("HD-001", "key_block", "key_block", Workload("key_block", "qwen3-14b", chars * c.events_per_note),
              inputs={"read_side_run": "HD-001/read_side"}),
        _step("HD-001", "trace_edit", "trace_edit",
              Workload("edits", "qwen3-14b", chars * c.edit_events_per_note * c.edit_reads_per_event), inputs=attr),
        _step("HD-001", "note_edit", "note_edit",
              Workload("edits", "qwen3-14b", chars * c.edit_events_per_note * c.edit_reads_per_event), inputs=attr),
    ]
    # Table 9 (R-C8): the first 50 notes attributed again with the intact graph and with the detached
    # hook, the P2 nominees patched exactly in both; the report pairs the two runs of one events run
    steps.append(_step("HD-001", "events_50", "events", Workload("targets", "qwen3-14b", 50, full),
                       inputs={"prepare_run": "HD-001/generate"}, params={"model": "{teacher}", "max_notes": "50"}))
    steps += [_step("HD-001", f"attribute_50_{name}", "attribute", Workload("characterize", "qwen3-14b", 50, full),
                    inputs={"events_run": "HD-001/events_50"}, params={"detach": flag}, disk_gib=50 * 0.05)
              for name, flag in (("intact", "false"), ("detached", "true"))]
    # HD-002: the same notes with the retrieved shortlist (the retriever trains on the release's
    # training split, its patients kept apart from the corpus's by the shortlist stage)
    retriever = {**release, "model": "{teacher}"}
    steps += [
        _step("HD-002", "retriever_notes", "prepare", Workload("none"), params=retriever, skip_synthetic=True),
        _step("HD-002", "shortlist", "shortlist", retrieval(chars),
              inputs={"prepare_run": "HD-001/prepare", "train_prepare_run": "HD-002/retriever_notes"},
              params={"encoder": "{encoder}"}),
    ]
    steps += _traced_corpus("HD-002", "shortlist", {}, generation("qwen3-14b", chars, short))
    steps.append(_step("HD-002", "characterize", "characterize", Workload("characterize", "qwen3-14b", chars, short),
                       inputs={"prepare_run": "HD-002/generate"}, params={"model": "{teacher}"},
                       disk_gib=chars * 0.02))
    # Table 35's locus and read-side rows: the shortlist characterization's own (R-C7)
    attr2 = {"attribute_run": "HD-002/characterize:attribute"}
    steps += [_step("HD-002", stage, stage, Workload(stage, "qwen3-14b", chars, short), inputs=attr2,
                    disk_gib=chars * 0.01) for stage in ("locus", "read_side")]
    # the instruction control
    steps += _traced_corpus("instruction", "prepare",
                            {**release, "select_n": str(c.instruction_notes), "narrow_instruction": "false"},
                            generation("qwen3-14b", c.instruction_notes, full))
    steps.append(_step("instruction", "characterize", "characterize",
                       Workload("characterize", "qwen3-14b", c.instruction_notes, full),
                       inputs={"prepare_run": "instruction/generate"}, params={"model": "{teacher}"}))
    # Table 4's readings: HD-001's global sets knocked into the regenerated traces (their own
    # events and notes; costed as a characterization of those notes, an upper bound), and the
    # regenerated traces' locus
    attr_i = {"attribute_run": "instruction/characterize:attribute"}
    steps += [
        _step("instruction", "knockin_hd001_sets", "knockin",
              Workload("characterize", "qwen3-14b", c.instruction_notes, full),
              inputs={**attr_i, "sets_run": "HD-001/characterize:attribute"}),
        _step("instruction", "locus", "locus", Workload("locus", "qwen3-14b", c.instruction_notes, full),
              inputs=attr_i, disk_gib=c.instruction_notes * 0.01),
    ]
    # DT-000: the distillation corpus on its shortlist; the teacher is ranked on the validation
    # notes (the characterization notes, App. A) and read on every note, so that its targets read
    # the training notes'
    data = "DT-000/generate"
    steps += [
        _step("DT-000", "prepare", "prepare", Workload("none"),
              params={"corpus": "{distill_corpus}", "model": "{teacher}"}),
        _step("DT-000", "retriever_notes", "prepare", Workload("none"), params=retriever, skip_synthetic=True),
        _step("DT-000", "shortlist", "shortlist", retrieval(c.train_notes + c.val_notes + c.test_notes),
              inputs={"prepare_run": "DT-000/prepare", "train_prepare_run": "DT-000/retriever_notes"},
              params={"encoder": "{encoder}"}),
    ]
    steps += _traced_corpus("DT-000", "shortlist", {},
                            generation("qwen3-14b", c.train_notes + c.val_notes + c.test_notes, short))
    teacher_attr = "DT-000/teacher_attribute:attribute"
    steps += [
        _step("DT-000", "teacher_attribute", "characterize",
              Workload("characterize", "qwen3-14b", c.train_notes + c.val_notes, short),
              inputs={"prepare_run": data}, params={"model": "{teacher}", "rank_split": "val"},
              disk_gib=(c.train_notes + c.val_notes) * 0.02),
        _step("DT-000", "locus", "locus", Workload("locus", "qwen3-14b", c.val_notes, short),
              inputs={"attribute_run": teacher_attr}, disk_gib=c.val_notes * 0.01),
        _step("DT-000", "targets", "targets", Workload("targets", "qwen3-14b", c.train_notes, short),
              inputs={"teacher_attribute_run": teacher_attr, "locus_run": "DT-000/locus"},
              params={"split": "train"}, disk_gib=c.train_notes * 0.01),
    ]
    for student, role in STUDENTS.items():
        steps.append(_step("DT-000", f"student_attribute_{student}", "characterize",
                           Workload("characterize", "qwen3-4b", c.val_notes, short),
                           inputs={"prepare_run": data}, params={"model": role, "split": "val"}))
    steps.append(_step("DT-000", "las_simulator", "las_simulator",
                       Workload("las_simulator", "qwen3-1.7b", c.simulator_steps, c.note_tokens + trace,
                                predictions=c.val_notes),
                       inputs={"prepare_run": data},
                       params={"model": "{las_model}", "max_steps": str(c.simulator_steps)}))
    evaluation = {"prepare_run": data, "las_run": "DT-000/las_simulator"}
    def answers(model: str) -> Workload:  # the test notes' generations (the teacher-forced reads add a prefill)
        return Workload("evaluate", model, c.test_notes, short - trace, trace, predictions=c.test_notes)

    steps.append(_step("DT-000", "evaluate_teacher", "evaluate", answers("qwen3-14b"), inputs=evaluation,
                       params={"model": "{teacher}", "arm": "teacher", "split": "test"}))
    # the audit frame of Table 5 (R-C9): the teacher's contrastive events on the test notes, each
    # student tokenizer's realization of them, the stratified draw and the blinded sheet
    steps.append(_step("DT-000", "events_test", "events", Workload("targets", "qwen3-14b", c.test_notes, short),
                       inputs={"prepare_run": data}, params={"model": "{teacher}", "split": "test"}))
    for student, role in STUDENTS.items():
        steps.append(_step("DT-000", f"events_test_{student}", "events",
                           Workload("targets", "qwen3-4b", c.test_notes, short),
                           inputs={"prepare_run": data}, params={"model": role, "split": "test"}))
    steps.append(_step("DT-000", "audit_frame", "audit_frame", Workload("none"),
                       inputs={"events_run": "DT-000/events_test",
                               "align_events_runs": ",".join(f"DT-000/events_test_{s}" for s in STUDENTS)}))
    for student, role in STUDENTS.items():
        steps.append(_step("DT-000", f"evaluate_{student}_untrained", "evaluate", answers(student),
                           inputs=evaluation, params={"model": role, "arm": "untrained", "split": "test"}))
        steps.append(_step("DT-000", f"own_heads_{student}_untrained", "own_heads",
                           Workload("own_heads", "qwen3-4b", c.test_notes, short, trace, sampler=student),
                           inputs={"prepare_run": data}, params={"model": role}))

    steps.append(_step("DT-001", "select_lambda", "select_lambda",
                       Workload("train_mistill", "qwen3-4b", 3 * c.micro_steps(c.selection_notes), short),
                       inputs={"prepare_run": data, "targets_run": "DT-000/targets",
                               "student_attribute_run": "DT-000/student_attribute_qwen3-4b:attribute"},
                       params={"lock": "projects/configs/locks/i3-bf16-selection.yaml", "student": "{student}"},
                       disk_gib=3 * 8.0))
    steps.append(_step("DT-001", "select_lambda_fp32", "select_lambda",
                       Workload("train_mistill", "qwen3-4b", 5 * c.micro_steps(c.train_notes), short),
                       inputs={"prepare_run": data, "targets_run": "DT-000/targets",
                               "student_attribute_run": "DT-000/student_attribute_qwen3-4b:attribute"},
                       params={"lock": "projects/configs/locks/i4-fp32-reselection.yaml", "student": "{student}"},
                       disk_gib=5 * 8.0))
    # the Vanilla CoT-KD reference of the selection's tables (Tables 39-41): trained on the same
    # training notes as the bf16 selection's cells (its lock: 100 notes, note seed 0), read on
    # the validation notes the selection reads
    for seed in range(3):
        run = f"qwen3-4b_vanilla-bf16_n{c.selection_notes}_s{seed}"
        steps.append(_step("DT-001", f"train_{run}", "train",
                           Workload("train_vanilla", "qwen3-4b", c.micro_steps(c.selection_notes), short),
                           inputs={"targets_run": "DT-000/targets"},
                           params={"arm": "vanilla-bf16", "seed": str(seed), "student": "{student}",
                                   "train_notes": str(c.selection_notes), "train_notes_seed": "0"}, disk_gib=8.0))
        steps.append(_step("DT-001", f"evaluate_{run}", "evaluate",
                           Workload("evaluate", "qwen3-4b", c.val_notes, short - trace, trace,
                                    predictions=c.val_notes),
                           inputs={**evaluation, "train_run": f"DT-001/train_{run}"},
                           params={"arm": "vanilla-bf16", "split": "val"}))
    for student, arm, kind, seeds in ARM_SEEDS + ABLATION_SEEDS:
        resolved = resolve_arm(arm)
        mechanism = resolved.objective == "mistill"
        tree = "DT-001" if mechanism or (student, arm, kind, seeds) in ABLATION_SEEDS else "DT-000"
        micro = c.micro_steps(c.train_notes, resolved.epochs or None)
        rollout = min(trace, resolved.rollout_cap) if resolved.rollout_cap else trace
        work = Workload(kind, "qwen3-4b", micro, short, rollout if kind in ROLLOUTS else 0,
                        resolved.on_policy_fraction)
        inputs = {"targets_run": "DT-000/targets"}
        after: tuple[str, ...] = ()
        if mechanism:  # the Mistill arms read the student's own ranking and the selection's λ
            inputs["student_attribute_run"] = f"DT-000/student_attribute_{student}:attribute"
            if arm not in OWN_LAMBDA_ARMS:
                after = (SELECTION_OF.get(arm) or ("DT-001/select_lambda_fp32" if resolved.precision == "fp32"
                                                   else "DT-001/select_lambda"),)
        for seed in range(seeds):
            run = f"{student}_{arm}_s{seed}"
            steps.append(_step(tree, f"train_{run}", "train", work,
                               inputs=inputs, after=after,
                               params={"arm": arm, "seed": str(seed), "student": STUDENTS[student]}, disk_gib=8.0))
            steps.append(_step(tree, f"evaluate_{run}", "evaluate", answers(student),
                               inputs={**evaluation, "train_run": f"{tree}/train_{run}"},
                               params={"arm": arm, "split": "test"}))
            steps.append(_step(tree, f"own_heads_{run}", "own_heads",
                               Workload("own_heads", "qwen3-4b", c.test_notes, short, trace, sampler=student),
                               inputs={"prepare_run": data, "train_run": f"{tree}/train_{run}"}))
    # App. I's k = 8 probe (R-D22): the fp32 arm at the re-selected λ, seed 0, with the named head
    # moved to rank 8 of its own P2C ranking; on the teacher's traces only (its ranking runs are
    # the own-heads step's, reused); the head names a Qwen3-4B head, so a synthetic run skips it
    student, arm, head = PROBE
    run = f"{student}_{arm}_s0"
    steps.append(_step("DT-001", f"own_heads_probe_{run}", "own_heads",
                       Workload("own_heads", "qwen3-4b", c.test_notes, short, trace),
                       inputs={"prepare_run": data, "train_run": f"DT-001/train_{run}"},
                       params={"probe_head": head, "probe_phase": "P2C", "probe_rank": "8", "own_traces": "false"},
                       after=(f"DT-001/own_heads_{run}",), skip_synthetic=True))
    steps += _matched_tree(c)  # before EF, which flip-tests its RandHeads pick
    steps += _evidence_flip_tree(c, release, generation)
    steps += _student_edit_tree(c, data)
    steps += _eurlex_tree(c)
    steps += _bigcodebench_tree(c)
    steps += _musique_tree(c)
    steps += _musique_pairs_tree(c)
    steps += _pilot_tree(c)
    steps += _learning_curve_tree(c, evaluation)
    steps.append(_step("report", "report", "report", Workload("none"),
                       after=tuple(s.name for s in steps if not s.experiment
                                   and s.entry_point in ("evaluate", "own_heads", "flip_test", "trace_edit"))))
    return steps


TRANSFER_TREES: tuple[str, ...] = ("EF", "ST", "M2", "EU", "BC", "MQ", "MP", "PP", "LC")
"""The trees priced beside the main reproduction (the characterization and distillation trees)
rather than inside its budget: the tests the paper ran after its main campaign (its ``REBUTTAL/``
and ``DT-005/`` artifacts: App. N's evidence-flip test, EF, Table 22's trace edits on the
students, ST, App. M.2's matched selection, M2, App. P's screens on EURLEX57K, EU, and on
BigCodeBench, BC, App. O's public-task extension on MuSiQue-Ans, MQ, with its evidence pairs, MP,
and App. P's programming pilot, PP), and App. M.5's learning curve, LC (three smaller trainings run
to decide whether to grow the corpus; no other result reads them)."""

EURLEX_BATCHES: tuple[tuple[str, str, str], ...] = (
    ("rank", "train", "eurlex_rank_acts"), ("assess", "val", "eurlex_assess_acts"),
    ("fresh", "test", "eurlex_fresh_acts"))
"""(batch, split of the release, :class:`PaperCounts` size) of App. P's EURLEX57K screen: the
development batch the teacher's heads are ranked on, the disjoint assessment batch, and the fresh
acts; each batch the first acts of its split."""
CODE_BATCHES: tuple[tuple[str, str, str], ...] = (
    ("rank", "train", "code_rank_tasks"), ("assess", "val", "code_assess_tasks"), ("fresh", "test", "code_fresh_tasks"))
"""(batch, split, :class:`PaperCounts` size) of App. P's BigCodeBench screen, dealt in the release's
order (``prepare -P split_sizes``)."""
EURLEX_PANEL: dict[str, str] = {"panel_top": "40", "panel_bottom": "40", "panel_random": "40"}
"""The read-back's panels (App. P): the ranked P2C top-40 against 40 random heads and the bottom-40."""


LEARNING_CURVE_SIZES: tuple[int, ...] = (100, 250)
"""App. M.5's smaller training sets (Table 53, Figure 8): the first n training notes in note seed
0's order; the full set's rows are the main arms' seeds."""
LEARNING_CURVE_ARMS: tuple[tuple[str, str], ...] = (("vanilla-bf16", "train_vanilla"), ("mistill", "train_mistill"))
"""(arm, workload kind) of the learning curve: Vanilla CoT-KD and Mistill, both with bf16 weights."""


def _learning_curve_tree(c: PaperCounts, evaluation: Mapping[str, str]) -> list[PlanStep]:
    """LC, App. M.5's learning curve (R-D8; Table 53, Figure 8): seed 0 of each arm of
    :data:`LEARNING_CURVE_ARMS` trained on each size of :data:`LEARNING_CURVE_SIZES` (Mistill at
    the bf16 selection's λ) and evaluated on the test notes. Vanilla CoT-KD at the selection's
    size is DT-001's reference run of that size (the same notes, note seed and seed), evaluated
    here on the test notes as well."""
    short, trace = c.shortlist_tokens, c.trace_tokens
    steps = []
    for n in LEARNING_CURVE_SIZES:
        for arm, kind in LEARNING_CURVE_ARMS:
            run = f"qwen3-4b_{arm}_n{n}_s0"
            reused = arm == "vanilla-bf16" and n == c.selection_notes  # DT-001's selection reference
            train = f"DT-001/train_{run}" if reused else f"LC/train_{run}"
            if not reused:
                mechanism = kind == "train_mistill"
                steps.append(_step(
                    "LC", f"train_{run}", "train", Workload(kind, "qwen3-4b", c.micro_steps(n), short),
                    inputs={"targets_run": "DT-000/targets",
                            **({"student_attribute_run": "DT-000/student_attribute_qwen3-4b:attribute"}
                               if mechanism else {})},
                    after=("DT-001/select_lambda",) if mechanism else (),
                    params={"arm": arm, "seed": "0", "student": "{student}", "train_notes": str(n),
                            "train_notes_seed": "0"}, disk_gib=8.0))
            steps.append(_step("LC", f"evaluate_{run}", "evaluate",
                               Workload("evaluate", "qwen3-4b", c.test_notes, short - trace, trace,
                                        predictions=c.test_notes),
                               inputs={**evaluation, "train_run": train}, params={"arm": arm, "split": "test"}))
    return steps


MATCHED_FAMILIES: tuple[tuple[str, str], ...] = (("mistill", "m2-mistill"), ("randheads", "m2-randheads"))
"""App. M.2's two families: (the lock's arm, the arm its picks are trained and read under, whose
name keeps them beside the main arms in the arm tables)."""


def _matched_tree(c: PaperCounts) -> list[PlanStep]:
    """M2, App. M.2's matched selection (R-D31, R-D32; Table 52): on DT-000's corpus, targets and
    the student's ranking, the λ selection of Mistill and of RandHeads on the frozen pool 0 under
    one protocol (locks ``m2-matched-mistill`` and ``m2-matched-randheads``: three grid cells and
    one outward cell each, full trainings), then three seeds of each family at its pick, each
    evaluated on the test notes and read on its own heads. The picks train as the arms
    ``m2-mistill`` and ``m2-randheads`` (:data:`MATCHED_FAMILIES`)."""
    data, short, trace = "DT-000/generate", c.shortlist_tokens, c.trace_tokens
    cell = c.micro_steps(c.train_notes)
    ranking = {"student_attribute_run": "DT-000/student_attribute_qwen3-4b:attribute"}
    steps = []
    for family, arm in MATCHED_FAMILIES:
        selection = f"select_lambda_{family}"
        steps.append(_step("M2", selection, "select_lambda", Workload("train_mistill", "qwen3-4b", 4 * cell, short),
                           inputs={"prepare_run": data, "targets_run": "DT-000/targets", **ranking},
                           params={"lock": f"projects/configs/locks/m2-matched-{family}.yaml",
                                   "student": "{student}"}, disk_gib=4 * 8.0))
        for seed in range(3):
            run = f"qwen3-4b_{arm}_s{seed}"
            steps += [
                _step("M2", f"train_{run}", "train", Workload("train_mistill", "qwen3-4b", cell, short),
                      inputs={"targets_run": "DT-000/targets", **ranking}, after=(f"M2/{selection}",),
                      params={"arm": arm, "seed": str(seed), "student": "{student}"}, disk_gib=8.0),
                _step("M2", f"evaluate_{run}", "evaluate",
                      Workload("evaluate", "qwen3-4b", c.test_notes, short - trace, trace, predictions=c.test_notes),
                      inputs={"prepare_run": data, "las_run": "DT-000/las_simulator", "train_run": f"M2/train_{run}"},
                      params={"arm": arm, "split": "test"}),
                _step("M2", f"own_heads_{run}", "own_heads",
                      Workload("own_heads", "qwen3-4b", c.test_notes, short, trace, sampler="qwen3-4b"),
                      inputs={"prepare_run": data, "train_run": f"M2/train_{run}"}),
            ]
    return steps


def _eurlex_tree(c: PaperCounts) -> list[PlanStep]:
    """EU, Table 59 on EURLEX57K (App. P, R-D41): the release prepared with its EuroVoc candidate
    lists (roles ``eurlex_dataset``, ``eurlex_concepts``, ``eurlex_hierarchy``) and screened over
    :data:`EURLEX_BATCHES` (:func:`_screen_tree`)."""
    release = {"task": "eurlex57k", "corpus": "{eurlex_dataset}", "concepts_file": "{eurlex_concepts}",
               "hierarchy_file": "{eurlex_hierarchy}", "model": "{teacher}"}
    return _screen_tree("EU", release, [(b, split, getattr(c, size)) for b, split, size in EURLEX_BATCHES],
                        c.eurlex_prompt_tokens, c.trace_tokens)


def _bigcodebench_tree(c: PaperCounts) -> list[PlanStep]:
    """BC, Table 59 on BigCodeBench (App. P, R-D42): the release (role ``bigcodebench_file``) dealt
    in file order into the ranking, assessment and fresh batches of :data:`CODE_BATCHES`
    (``prepare -P split_sizes``) and screened over them (:func:`_screen_tree`); the fresh problems'
    generations are run against their tests in the sandbox (pass@1, the native row)."""
    batches = [(b, split, getattr(c, size)) for b, split, size in CODE_BATCHES]
    release = {"task": "bigcodebench", "corpus": "{bigcodebench_file}", "model": "{teacher}",
               "split_sizes": ",".join(str(n) for _, _, n in batches)}
    return _screen_tree("BC", release, batches, c.code_prompt_tokens, c.trace_tokens)


def _screen_tree(tree: str, release: Mapping[str, str], batches: Sequence[tuple[str, str, int]], prompt: int,
                 trace: int) -> list[PlanStep]:
    """App. P's screen of one label space: the release prepared (``release``: ``prepare``'s params),
    the teacher's traces on each batch (``(batch, split, inputs)``; ``rank`` first), its events and
    attribution there; the ranking batch's ranking frozen and knocked in (``knockin -P
    sets_run``) and read (``read_side -P sets_run``, :data:`EURLEX_PANEL`) on the other batches;
    and the tree's report. Its runs go to an experiment of the tree's own (the task's name), so
    that its report reads them alone. The releases are not synthetic, so a synthetic corpus skips
    the tree (the stages run on the project's fixtures of the releases in the suite)."""
    total = prompt + trace
    steps = [_step(tree, "prepare", "prepare", Workload("none"), params=release, skip_synthetic=True)]
    for batch, split, inputs in batches:
        steps += [
            _step(tree, f"generate_{batch}", "generate", Workload("generate", "qwen3-14b", inputs, prompt, trace),
                  inputs={"prepare_run": f"{tree}/prepare"},
                  params={"model": "{teacher}", "split": split, "max_notes": str(inputs)}, skip_synthetic=True),
            _step(tree, f"events_{batch}", "events", Workload("targets", "qwen3-14b", inputs, total),
                  inputs={"prepare_run": f"{tree}/generate_{batch}"}, params={"model": "{teacher}", "split": split},
                  skip_synthetic=True),
            _step(tree, f"attribute_{batch}", "attribute", Workload("characterize", "qwen3-14b", inputs, total),
                  inputs={"events_run": f"{tree}/events_{batch}"}, disk_gib=inputs * 0.02, skip_synthetic=True),
        ]
        if batch == "rank":
            continue
        frozen = {"attribute_run": f"{tree}/attribute_{batch}", "sets_run": f"{tree}/attribute_rank"}
        steps += [  # the knock-in costed as a characterization of the batch (an upper bound)
            _step(tree, f"knockin_{batch}", "knockin", Workload("characterize", "qwen3-14b", inputs, total),
                  inputs=frozen, skip_synthetic=True),
            _step(tree, f"read_side_{batch}", "read_side", Workload("read_side", "qwen3-14b", inputs, total),
                  inputs=frozen, params=EURLEX_PANEL, disk_gib=inputs * 0.01, skip_synthetic=True),
        ]
    steps.append(_step(tree, "report", "report", Workload("none"), skip_synthetic=True,
                       after=tuple(s.name for s in steps if s.entry_point in ("knockin", "read_side"))))
    return [dataclasses.replace(s, experiment=release["task"]) for s in steps]


MUSIQUE_EXPERIMENT = "musique"
"""MQ's experiment suffix (:attr:`PlanStep.experiment`): its arms are the main trees' arm names on
another task, so they are run and reported in an experiment of their own."""

MUSIQUE_ARMS: tuple[tuple[str, str, str], ...] = (
    ("vanilla-bf16", "train_vanilla", ""), ("mistill", "train_mistill", "select_lambda_mistill"),
    ("randheads", "train_mistill", "select_lambda_randheads"))
"""App. O's arms: (arm, training workload, the selection whose pick it trains with)."""


def _musique_tree(c: PaperCounts) -> list[PlanStep]:
    """MQ, App. O's public-task extension on MuSiQue-Ans (R-D37, R-D38; Tables 56-57): the release
    (role ``musique_release``, the folder of its train and dev files) dealt by base-question group
    into App. O's splits twice, once with only the training and ranking questions, which the
    teacher traces (``prepare_traced``, then ``generate``), once with the selection and evaluation
    questions too (``prepare``: the answers-only evaluations read it); the teacher characterized on
    the ranking questions and read on the training ones (its targets), the untrained student
    ranked on the ranking questions (the Mistill pool); the λ selection of each mechanism family on
    the selection questions (locks ``o-musique-mistill``, ``o-musique-randheads``); three seeds of
    Vanilla CoT-KD, Mistill and RandHeads, each evaluated on the evaluation questions (answer F1)
    and read on its own heads on the ranking questions; the untrained student the same. The release
    is not synthetic, so a synthetic corpus skips the tree (the stages run on the project's MuSiQue
    fixture in the suite)."""
    train, rank, select, test = c.musique_splits
    prompt, trace = c.musique_prompt_tokens, c.musique_trace_tokens
    total = prompt + trace
    release = {"task": "musique", "corpus": "{musique_release}", "model": "{teacher}"}
    data = "MQ/generate"
    answers = {"prepare_run": "MQ/prepare"}  # answers only: the evaluation questions carry no teacher trace
    read = {"split": "test", "fidelity": "false"}
    own = {"prepare_run": data}
    own_splits = {"rank_split": "val", "test_split": "val"}  # teacher-forced on the ranking questions
    steps = [
        _step("MQ", "prepare_traced", "prepare", Workload("none"), skip_synthetic=True,
              params={**release, "split_sizes": f"{train},{rank},0,0"}),
        _step("MQ", "prepare", "prepare", Workload("none"), skip_synthetic=True,
              params={**release, "split_sizes": ",".join(map(str, c.musique_splits))}),
        _step("MQ", "generate", "generate", Workload("generate", "qwen3-14b", train + rank, prompt, trace),
              inputs={"prepare_run": "MQ/prepare_traced"}, params={"model": "{teacher}"}, skip_synthetic=True),
        _step("MQ", "teacher_attribute", "characterize", Workload("characterize", "qwen3-14b", train + rank, total),
              inputs={"prepare_run": data}, params={"model": "{teacher}", "rank_split": "val"},
              disk_gib=(train + rank) * 0.02, skip_synthetic=True),
        _step("MQ", "targets", "targets", Workload("targets", "qwen3-14b", train, total),
              inputs={"teacher_attribute_run": "MQ/teacher_attribute:attribute"}, params={"split": "train"},
              disk_gib=train * 0.01, skip_synthetic=True),
        _step("MQ", "student_attribute", "characterize", Workload("characterize", "qwen3-4b", rank, total),
              inputs={"prepare_run": data}, params={"model": "{student}", "split": "val"}, skip_synthetic=True),
        _step("MQ", "evaluate_untrained", "evaluate", Workload("generate", "qwen3-4b", test, prompt, trace),
              inputs=answers,
              params={"model": "{student}", "arm": "untrained", **read}, skip_synthetic=True),
        _step("MQ", "own_heads_untrained", "own_heads",
              Workload("own_heads", "qwen3-4b", rank, total, trace, sampler="qwen3-4b"),
              inputs=own, params={"model": "{student}", **own_splits}, skip_synthetic=True),
    ]
    # an answers-only evaluation is its generations (no teacher-forced readouts, no LAS simulator)
    cell = c.micro_steps(train)
    for arm in ("mistill", "randheads"):  # three grid cells and one outward cell, each a full training
        steps.append(_step("MQ", f"select_lambda_{arm}", "select_lambda",
                           Workload("train_mistill", "qwen3-4b", 4 * cell, total),
                           inputs={"prepare_run": "MQ/prepare", "targets_run": "MQ/targets",
                                   "student_attribute_run": "MQ/student_attribute:attribute"},
                           params={"lock": f"projects/configs/locks/o-musique-{arm}.yaml", "student": "{student}"},
                           disk_gib=4 * 8.0, skip_synthetic=True))
    for arm, kind, selection in MUSIQUE_ARMS:
        inputs = {"targets_run": "MQ/targets"}
        if selection:
            inputs["student_attribute_run"] = "MQ/student_attribute:attribute"
        for seed in range(c.musique_seeds):
            run = f"{arm}_s{seed}"
            steps += [
                _step("MQ", f"train_{run}", "train", Workload(kind, "qwen3-4b", cell, total), inputs=inputs,
                      after=(f"MQ/{selection}",) if selection else (), disk_gib=8.0, skip_synthetic=True,
                      params={"arm": arm, "seed": str(seed), "student": "{student}"}),
                _step("MQ", f"evaluate_{run}", "evaluate", Workload("generate", "qwen3-4b", test, prompt, trace),
                      inputs={**answers, "train_run": f"MQ/train_{run}"}, params={"arm": arm, **read},
                      skip_synthetic=True),
                _step("MQ", f"own_heads_{run}", "own_heads",
                      Workload("own_heads", "qwen3-4b", rank, total, trace, sampler="qwen3-4b"),
                      inputs={**own, "train_run": f"MQ/train_{run}"}, params=own_splits, skip_synthetic=True),
            ]
    steps.append(_step("MQ", "report", "report", Workload("none"), skip_synthetic=True,
                       params={"own_heads_split": "val"},  # the answers on the evaluation questions
                       after=tuple(s.name for s in steps if s.entry_point in ("evaluate", "own_heads"))))
    return [dataclasses.replace(s, experiment=MUSIQUE_EXPERIMENT) for s in steps]


PILOT_EXPERIMENT = "programming-pilot"
"""PP's experiment suffix (:attr:`PlanStep.experiment`): its arms are the main trees' arm names
trained on another task."""

PILOT_ARMS: tuple[tuple[str, str], ...] = (
    ("vanilla-bf16", "train_vanilla"), ("mistill", "train_mistill"), ("randheads", "train_mistill"))
"""App. P's pilot arms: (arm, training workload). The mechanism arms train at the pilot's fixed λ."""

PILOT_K: str = "29,40"
"""The own-heads budgets the pilot reads: k = 40, primary, and k = 29, its sensitivity (App. P)."""


def _pilot_tree(c: PaperCounts) -> list[PlanStep]:
    """PP, App. P's programming pilot (R-D43 to R-D46; Table 60): KodCode's training problems (role
    ``kodcode_file``) drawn into the locked split and traced by the teacher, their events read and
    the teacher's targets pooled over the ranking BC froze on its ranking batches (``targets -P
    events_run -P sets_run``); BigCodeBench's development tasks (role ``bigcodebench_file``, BC's
    ranking and assessment batches) prepared twice, once dealt as BC deals them and traced by the
    teacher (the students' own heads are ranked on the ranking batches and read on the assessment
    batch, teacher-forced on those traces), once as one evaluation split (pass@1 on all of them);
    the untrained student ranked on the ranking batches (the Mistill pool) and read there; three
    arms at two paired seeds, the mechanism arms at λ fixed to :attr:`PaperCounts.pilot_lambda`
    (no selection), each evaluated and read on its own heads at :data:`PILOT_K`. The releases are
    not synthetic, so a synthetic corpus skips the tree (the stages run on the project's KodCode
    and BigCodeBench fixtures in the suite)."""
    train, prompt, trace = c.kodcode_problems, c.kodcode_prompt_tokens, c.trace_tokens
    rank, assess = c.code_rank_tasks, c.code_assess_tasks
    dev_prompt = c.code_prompt_tokens
    dev = {"task": "bigcodebench", "corpus": "{bigcodebench_file}", "model": "{teacher}"}
    own = {"prepare_run": "PP/generate_dev"}
    own_params = {"rank_split": "train", "test_split": "val", "k": PILOT_K, "own_traces": "false"}
    lam = f"{c.pilot_lambda:g}"
    steps = [
        _step("PP", "prepare", "prepare", Workload("none"), skip_synthetic=True,
              params={"task": "kodcode", "corpus": "{kodcode_file}", "model": "{teacher}", "split_sizes": str(train)}),
        _step("PP", "generate", "generate", Workload("generate", "qwen3-14b", train, prompt, trace),
              inputs={"prepare_run": "PP/prepare"}, params={"model": "{teacher}"}, skip_synthetic=True),
        _step("PP", "events", "events", Workload("targets", "qwen3-14b", train, prompt + trace),
              inputs={"prepare_run": "PP/generate"}, params={"model": "{teacher}", "split": "train"},
              skip_synthetic=True),
        _step("PP", "targets", "targets", Workload("targets", "qwen3-14b", train, prompt + trace),
              inputs={"events_run": "PP/events", "sets_run": "BC/attribute_rank"}, params={"split": "train"},
              disk_gib=train * 0.01, skip_synthetic=True),
        _step("PP", "prepare_dev", "prepare", Workload("none"), skip_synthetic=True,
              params={**dev, "split_sizes": f"{rank},{assess},0"}),
        _step("PP", "prepare_eval", "prepare", Workload("none"), skip_synthetic=True,
              params={**dev, "split_sizes": f"0,0,{rank + assess}"}),
        _step("PP", "generate_dev", "generate", Workload("generate", "qwen3-14b", rank + assess, dev_prompt, trace),
              inputs={"prepare_run": "PP/prepare_dev"}, params={"model": "{teacher}"}, skip_synthetic=True),
        _step("PP", "student_attribute", "characterize",
              Workload("characterize", "qwen3-4b", rank, dev_prompt + trace),
              inputs=own, params={"model": "{student}", "split": "train"}, skip_synthetic=True),
        _step("PP", "own_heads_untrained", "own_heads",
              Workload("own_heads", "qwen3-4b", assess, dev_prompt + trace, trace),
              inputs=own, params={"model": "{student}", **own_params}, skip_synthetic=True),
    ]
    cell = c.micro_steps(train)
    for arm, kind in PILOT_ARMS:
        inputs = {"targets_run": "PP/targets"}
        params = {"arm": arm, "student": "{student}"}
        if kind == "train_mistill":
            inputs["student_attribute_run"] = "PP/student_attribute:attribute"
            params["overrides"] = f"lambda_p1={lam},lambda_p2={lam}"
        for seed in range(c.pilot_seeds):
            run = f"{arm}_s{seed}"
            steps += [
                _step("PP", f"train_{run}", "train", Workload(kind, "qwen3-4b", cell, prompt + trace), inputs=inputs,
                      params={**params, "seed": str(seed)}, disk_gib=8.0, skip_synthetic=True),
                _step("PP", f"evaluate_{run}", "evaluate",
                      Workload("generate", "qwen3-4b", rank + assess, dev_prompt, trace),
                      inputs={"prepare_run": "PP/prepare_eval", "train_run": f"PP/train_{run}"},
                      params={"arm": arm, "split": "test", "fidelity": "false"}, skip_synthetic=True),
                _step("PP", f"own_heads_{run}", "own_heads",
                      Workload("own_heads", "qwen3-4b", assess, dev_prompt + trace, trace),
                      inputs={**own, "train_run": f"PP/train_{run}"}, params=own_params, skip_synthetic=True),
            ]
    steps.append(_step("PP", "report", "report", Workload("none"), skip_synthetic=True,
                       params={"own_heads_split": "val", "bootstrap": "10000"},  # App. P: 10,000-draw intervals
                       after=tuple(s.name for s in steps if s.entry_point in ("evaluate", "own_heads"))))
    return [dataclasses.replace(s, experiment=PILOT_EXPERIMENT) for s in steps]


def _musique_pairs_tree(c: PaperCounts) -> list[PlanStep]:
    """MP, App. O's evidence pairs (R-D39, R-D40; Tables 56-58, readings 3 and 4): the release dealt as MQ deals it
    with the evidence pairs' slice of the dev file after the evaluation questions (a fifth
    ``split_sizes`` count, split ``pairs``), the teacher's screen traces on that slice, the cohort
    (lock ``o-musique-pairs``: the slice's bases in a seeded order, teacher-success-conditioned,
    App. O's conditions) from the author's proposals and ledger (roles ``musique_pair_proposals``,
    ``musique_pair_ledger``), then every MQ checkpoint's answers to every pair under every
    condition (``flip_test``: paired correctness), the teacher's gate (clean on the HF path, then
    the prefill-inclusive evidence-key mask over its MQ answer-emission top-40, sham and target,
    and over :attr:`PaperCounts.musique_gate_draws` layer-matched random draws, target), and the
    experiment's report again. The runs go
    to MQ's experiment; the release is not synthetic, so a synthetic corpus skips the tree."""
    prompt, trace = c.musique_prompt_tokens, c.musique_trace_tokens
    sizes = ",".join(map(str, (*c.musique_splits, c.musique_pair_slice)))
    answers = c.musique_pairs * c.flip_conditions * c.musique_pair_samples
    steps = [
        _step("MP", "prepare", "prepare", Workload("none"), skip_synthetic=True,
              params={"task": "musique", "corpus": "{musique_release}", "model": "{teacher}", "split_sizes": sizes}),
        _step("MP", "generate", "generate", Workload("generate", "qwen3-14b", c.musique_pair_slice, prompt, trace),
              inputs={"prepare_run": "MP/prepare"}, params={"model": "{teacher}", "split": "pairs"},
              skip_synthetic=True),
        _step("MP", "flip_cohort", "flip_cohort", Workload("none"), inputs={"prepare_run": "MP/generate"},
              params={"lock": "projects/configs/cohorts/o-musique-pairs.yaml", "proposals": "{musique_pair_proposals}",
                      "ledger": "{musique_pair_ledger}", "model": "{teacher}"}, skip_synthetic=True),
    ]
    for arm, _, _ in MUSIQUE_ARMS:
        for seed in range(c.musique_seeds):
            run = f"{arm}_s{seed}"
            steps.append(_step("MP", f"flip_test_{run}", "flip_test",
                               Workload("generate", "qwen3-4b", answers, prompt, trace),
                               inputs={"cohort_run": "MP/flip_cohort", "train_run": f"MQ/train_{run}"},
                               params={"samples": str(c.musique_pair_samples)}, skip_synthetic=True))
    # the teacher's gate (Table 58, R-D40): clean on the HF path, then the prefill-inclusive mask over
    # its frozen answer-emission top-40 (sham, target) and over layer-matched random draws (target)
    teacher = {"model": "{teacher}", "arm": "teacher", "samples": str(c.musique_pair_samples), "backend": "hf"}
    clean = Workload("generate", "qwen3-14b", answers, prompt, trace, engine="hf_batched")
    masked = dataclasses.replace(clean, engine="hf_masked_eager")  # the prefill-inclusive mask is not compiled
    nominated = {"mask_heads_run": "MQ/teacher_attribute:attribute"}
    mask = {"mask_phase": "P2", "mask_k": "40", "mask_regime": "prefill"}
    steps.append(_step("MP", "gate_clean", "flip_test", clean, inputs={"cohort_run": "MP/flip_cohort"},
                       params=teacher, skip_synthetic=True))
    gates = [("sham", "sham", 0), ("target", "target", 0),
             *((f"random{d}", "target", d) for d in range(1, c.musique_gate_draws + 1))]
    for label, which, draw in gates:
        steps.append(_step("MP", f"gate_{label}", "flip_test", masked,
                           inputs={"cohort_run": "MP/flip_cohort", **nominated}, skip_synthetic=True,
                           params={**teacher, "mask": which, **mask, **({"mask_random": str(draw)} if draw else {})}))
    steps.append(_step("MP", "report", "report", Workload("none"), skip_synthetic=True,
                       params={"own_heads_split": "val"},
                       after=("MQ/report", *(s.name for s in steps if s.entry_point == "flip_test"))))
    return [dataclasses.replace(s, experiment=MUSIQUE_EXPERIMENT) for s in steps]


STUDENT_EDITS: tuple[tuple[str, str, str, int], ...] = (
    ("qwen3-4b", "mistill", "DT-001", 3), ("qwen3-4b", "vanilla-bf16", "DT-000", 3),
    ("qwen3-4b", "mistill-fp32-bf16-lambda", "DT-001", 3), ("qwen3-4b", "vanilla-fp32", "DT-000", 3),
    ("qwen3-4b", "mistill-fp32", "DT-001", 1),
    ("smollm3-3b", "mistill", "DT-001", 3), ("smollm3-3b", "vanilla-bf16", "DT-000", 1),
    ("smollm3-3b", "vanilla-fp32", "DT-000", 2))
"""(student, arm, tree of its train steps, seeds) of the checkpoints Table 22 edits (App. E, R-D28): the
bf16 Qwen3-4B pair, the fp32 pair at the λ transferred from bf16, fp32 Mistill at the re-selected λ
on one seed (R-D30), and SmolLM3-3B's Mistill against its Vanilla CoT-KD students of both
precisions; every seed the main comparison trains."""


def _student_edit_tree(c: PaperCounts, data: str) -> list[PlanStep]:
    """ST, Table 22: each checkpoint of :data:`STUDENT_EDITS` characterized like the teacher on the
    test notes, teacher-forced on the teacher's traces (``events`` and ``attribute`` with the
    checkpoint as the model), then the near-miss edits with its own top-2 contrastive heads as the
    mediation set (``trace_edit``; SmolLM3-3B's passes costed from Qwen3-4B's figures, as
    :data:`ARM_SEEDS` says)."""
    short = c.shortlist_tokens
    steps: list[PlanStep] = []
    for student, arm, tree, seeds in STUDENT_EDITS:
        for seed in range(seeds):
            run = f"{student}_{arm}_s{seed}"
            steps += [
                _step("ST", f"events_{run}", "events", Workload("targets", "qwen3-4b", c.test_notes, short),
                      inputs={"prepare_run": data}, params={"split": "test"}, model_run=f"{tree}/train_{run}"),
                _step("ST", f"attribute_{run}", "attribute", Workload("characterize", "qwen3-4b", c.test_notes, short),
                      inputs={"events_run": f"ST/events_{run}"}, disk_gib=c.test_notes * 0.02),
                _step("ST", f"trace_edit_{run}", "trace_edit",
                      Workload("edits", "qwen3-4b", c.test_notes * c.edit_events_per_note * c.edit_reads_per_event),
                      inputs={"attribute_run": f"ST/attribute_{run}"}),
            ]
    return steps

FLIP_CHECKPOINTS: tuple[tuple[str, str, int], ...] = (
    ("mistill", "DT-001", 3), ("vanilla-bf16", "DT-000", 3), ("mistill-fp32", "DT-001", 3),
    ("vanilla-fp32", "DT-000", 3), ("m2-randheads", "M2", 1))
"""(arm, tree of its train steps, seeds) of the Qwen3-4B checkpoints the evidence-flip test reads
(App. N.1: the locked primary's bf16 pair and the secondary's fp32 pair, three seeds each; the
teacher beside them; and, descriptive, App. M.2's matched-selection RandHeads pick, tree M2's
``m2-randheads``, **[recon]** its seed 0: the paper's fourteen checkpoints hold one)."""


FLIP_CAUSAL: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("teacher", (("pair", "L30H11,L38H39"), ("top40", "DT-000/teacher_attribute:attribute"))),
    ("mistill", (("top40", "DT-001/own_heads_{run}"),)),
    ("vanilla-bf16", (("top40", "DT-000/own_heads_{run}"),)))
"""The causal half's checkpoints and nominated head sets (App. N.4): the teacher's named pair and
its own P2C top-40 (its characterization's ranking), and each bf16 seed-0 student's own top-40 (the
ranking of its ``own_heads`` step); ``(label, heads)``: head names, else the step whose ranking is
read (``{run}``: the student's run name). The named pair names Qwen3-14B heads, so a synthetic
corpus skips its steps."""


def _evidence_flip_tree(c: PaperCounts, release: Mapping[str, str], generation) -> list[PlanStep]:
    """EF, the evidence-flip test (App. N): a pool of release notes on their retrieved shortlist
    (the retriever's notes exclude the pool's patients), the teacher's screen traces, the cohort
    drawn disjoint from the distillation corpus's patients with the author's proposals and the
    reviewer's ledger (roles ``flip_proposals``, ``flip_ledger``; on a synthetic corpus the
    platform's synthetic cases), then every locked checkpoint's behavioural half, and the causal
    half (App. N.4, :data:`FLIP_CAUSAL`) on the HF path: each of its checkpoints clean, then under
    the target and the sham key mask on each of its nominated head sets."""
    short, trace = c.shortlist_tokens, c.trace_tokens
    answers = c.flip_cases * c.flip_conditions * c.flip_samples
    steps = [
        _step("EF", "prepare", "prepare", Workload("none"),
              params={**release, "select_n": str(c.flip_pool), "model": "{teacher}"}),
        _step("EF", "shortlist", "shortlist",
              Workload("shortlist", "gte-large", c.flip_pool + c.retriever_train_notes, c.note_words,
                       head_notes=c.retriever_train_notes, epochs=c.head_epochs, codes=c.inventory_codes),
              inputs={"prepare_run": "EF/prepare", "train_prepare_run": "DT-000/retriever_notes"},
              params={"encoder": "{encoder}"}),
    ]
    steps += _traced_corpus("EF", "shortlist", {}, generation("qwen3-14b", c.flip_pool, short))
    steps.append(_step("EF", "flip_cohort", "flip_cohort", Workload("none"),
                       inputs={"prepare_run": "EF/generate", "exclude_prepare_runs": "DT-000/prepare"},
                       params={"lock": "projects/configs/cohorts/ef-cohort.yaml", "proposals": "{flip_proposals}",
                               "ledger": "{flip_ledger}", "model": "{teacher}"},
                       synthetic_params={"lock": "projects/configs/cohorts/ef-cohort-embedded.yaml",
                                         "proposals": "", "ledger": "", "synthetic_cases": "true"}))
    cohort = {"cohort_run": "EF/flip_cohort"}
    steps.append(_step("EF", "flip_test_teacher", "flip_test",
                       Workload("generate", "qwen3-14b", answers, short - trace, trace), inputs=cohort,
                       params={"model": "{teacher}", "arm": "teacher"}))
    for arm, tree, seeds in FLIP_CHECKPOINTS:
        for seed in range(seeds):
            run = f"qwen3-4b_{arm}_s{seed}"
            steps.append(_step("EF", f"flip_test_{run}", "flip_test",
                               Workload("generate", "qwen3-4b", answers, short - trace, trace),
                               inputs={**cohort, "train_run": f"{tree}/train_{run}"}))
    trees = {arm: tree for arm, tree, _ in FLIP_CHECKPOINTS}
    for checkpoint, head_sets in FLIP_CAUSAL:
        if checkpoint == "teacher":  # the teacher by role, as the behavioural step reads it
            model, name, inputs, params = "qwen3-14b", "teacher", cohort, {"model": "{teacher}", "arm": "teacher"}
        else:
            model, name = "qwen3-4b", f"qwen3-4b_{checkpoint}_s0"
            inputs, params = {**cohort, "train_run": f"{trees[checkpoint]}/train_{name}"}, {}
        work = Workload("generate", model, answers, short - trace, trace, engine="hf_batched")
        steps.append(_step("EF", f"flip_test_{name}_hf", "flip_test", work, inputs=inputs,
                           params={**params, "backend": "hf"}))
        masked = dataclasses.replace(work, engine="hf_masked")
        for label, heads in head_sets:
            named = heads.startswith("L")  # head names, else the step whose ranking is read
            nominated = {"mask_heads": heads} if named else {"mask_k": "40", "mask_phase": "P2C"}
            ranking = {} if named else {"mask_heads_run": heads.format(run=name)}
            for mask in ("target", "sham"):
                steps.append(_step("EF", f"flip_test_{name}_{mask}_{label}", "flip_test", masked,
                                   inputs={**inputs, **ranking},
                                   params={**params, "backend": "hf", "mask": mask, **nominated},
                                   skip_synthetic=named))
    return steps


RESULT_TREES: dict[str, tuple[str, ...]] = {"R-C7": ("HD-001", "HD-002"), "R-C14": ("instruction",),
                                            "R-D20": ("HD-001",), "R-D33": ("EF",), "R-D34": ("EF",),
                                            "R-D35": ("EF",), "R-D28": ("ST",), "R-D30": ("DT-000", "DT-001", "ST"),
                                            "R-C9": ("DT-000", "DT-001"), "R-D41": ("EU",), "R-D42": ("BC",),
                                            "R-D37": ("MQ",), "R-D38": ("MQ",),
                                            "R-D31": ("M2",), "R-D32": ("M2",), "R-D8": ("DT-000", "DT-001", "LC"),
                                            "R-D39": ("MQ", "MP"), "R-D40": ("MQ", "MP"),
                                            **{rid: ("BC", "PP") for rid in ("R-D43", "R-D44", "R-D45", "R-D46")}}
"""The trees a result reads where it is not its half's default (:func:`result_trees`)."""


def result_trees(result_id: str) -> tuple[str, ...]:
    """The trees whose steps produce a result: the characterization results (``R-C``) read HD-001,
    the full-inventory characterization, the distillation results (``R-D``) DT-000 and DT-001,
    except where :data:`RESULT_TREES` says otherwise (R-C7 compares HD-001 with the shortlist's
    HD-002; R-C14 is the instruction control; R-D20, the faithfulness of the objective's ``c``,
    is read on the teacher's characterization; the evidence-flip results, R-D33 to R-D35, are tree
    EF's); the report serves every result."""
    default = ("HD-001",) if result_id.startswith("R-C") else ("DT-000", "DT-001")
    return (*RESULT_TREES.get(result_id, default), "report")


def _arm_of(step: PlanStep, by_name: Mapping[str, PlanStep]) -> str | None:
    """The arm a step trains or reads: its ``arm`` param, else its ``train_run`` input's or its
    ``model_run``'s, else the one arm its input steps read (a trained student's attribute pass and
    edits read its events; None: no arm, as for the corpus's steps)."""
    if "arm" in step.params:
        return step.params["arm"]
    train = step.inputs.get("train_run") or step.model_run
    if train:
        return by_name[train].params.get("arm") if train in by_name else None
    sources = {ref.split(":", 1)[0] for refs in step.inputs.values() for ref in refs.split(",")}
    arms = {_arm_of(by_name[s], by_name) for s in sources if s in by_name}
    return arms.pop() if len(arms) == 1 else None


def _arms_named(params: str) -> set[str]:
    """The arms a result index entry's params name: ``arm=<name>``, or a list ``arm=a, b, c`` (the
    listed words that are arm names)."""
    known = set(arm_names())
    lists = re.findall(r"arm=([A-Za-z0-9_-]+(?:\s*,\s*[A-Za-z0-9_-]+)*)", params)
    return {name for found in lists for i, name in enumerate(re.split(r"\s*,\s*", found))
            if i == 0 or name in known}


def select(plan: Sequence[PlanStep], results: Iterable[str], index: Sequence | None = None) -> list[PlanStep]:
    """The steps of ``plan`` that the result ids ``results`` need, in plan order, with every step
    they read (the whole plan for no ids).

    A result needs the plan's steps, in its trees (:func:`result_trees`), of the entry points its
    result index entry names (:mod:`mistill.results_index`); where the entry names arms (``arm=...``), only those arms'
    training, evaluation and own-heads steps. Unknown ids, and ids whose entry points the plan
    does not hold, are refused (``field='results'``)."""
    wanted = [r.strip() for r in results if r.strip()]
    if not wanted:
        return list(plan)
    entries = {e.id: e for e in (index if index is not None else load())}
    unknown = [r for r in wanted if r not in entries]
    if unknown:
        raise MistillInputError(f"unknown result ids {', '.join(unknown)} (App. Q's ids: see "
                                "docs/RESULTS_INDEX.md)", field="results")
    by_name = {s.name: s for s in plan}
    todo: list[str] = []
    for rid in wanted:
        entry = entries[rid]
        arms = _arms_named(entry.params)
        trees = result_trees(rid)
        hits = [s.name for s in plan if set(s.covers) & set(entry.entry_points) and s.tree in trees
                and (not arms or _arm_of(s, by_name) in (None, *arms))]
        if not hits:
            raise MistillInputError(f"{rid} ({entry.status}) needs entry points the plan does not run: "
                                    f"{', '.join(entry.entry_points) or 'none'}", field="results")
        todo += hits
    keep: set[str] = set()
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        if by_name[name].entry_point != "report":  # the report reads what the selection ran
            todo += list(by_name[name].needs)
    return [s for s in plan if s.name in keep]


@dataclass(frozen=True)
class Subtotal:
    """The GPU-hours of a group of steps where a figure covers them, the steps, and how many of
    them no figure covers."""

    gpu_hours: float
    steps: int
    without_figure: int


def subtotals(plan: Sequence[PlanStep], figures: Figures, by: str = "tree") -> dict[str, Subtotal]:
    """The plan's estimates summed by ``by`` (``tree`` or ``entry_point``), in plan order."""
    if by not in ("tree", "entry_point"):
        raise MistillInputError(f"cannot group the plan by {by!r} (tree, entry_point)", field="by")
    return _group(plan, [estimate(s.work, figures) for s in plan], by)


def _group(plan: Sequence[PlanStep], estimates: Sequence[Estimate], by: str) -> dict[str, Subtotal]:
    groups: dict[str, Subtotal] = {}
    for step, est in zip(plan, estimates):
        name = getattr(step, by)
        had = groups.get(name, Subtotal(0.0, 0, 0))
        groups[name] = Subtotal(had.gpu_hours + (est.gpu_hours or 0.0), had.steps + 1,
                                had.without_figure + (est.gpu_hours is None))
    return groups


def _subtotal_lines(title: str, groups: Mapping[str, Subtotal]) -> list[str]:
    lines = [f"GPU-hours by {title}:"]
    for name, sub in groups.items():
        missing = f", {sub.without_figure} without a figure" if sub.without_figure else ""
        steps = f"{sub.steps} step" + ("" if sub.steps == 1 else "s")
        lines.append(f"  {name:<16} {sub.gpu_hours:>9.2f}  ({steps}{missing})")
    return lines


def render(plan: Sequence[PlanStep], figures: Figures, *, reused: Mapping[str, str] | None = None,
           skipped: Mapping[str, str] | None = None, by_entry_point: bool = False) -> str:
    """The plan as text: one line per step (entry point, inputs, reuse or why it is skipped,
    GPU-hours, disk), then the GPU-hours of each tree (and, ``by_entry_point``, of each entry
    point), the totals and the figures file read."""
    reused, skipped = reused or {}, skipped or {}
    lines = [f"{'step':<42} {'entry point':<14} {'GPU-h':>8} {'disk GiB':>9}  inputs / estimate"]
    total, unknown, disk = 0.0, [], 0.0
    names = {s.name for s in plan}
    estimates = [estimate(s.work, figures) for s in plan]
    for s, est in zip(plan, estimates):
        hours = "?" if est.gpu_hours is None else f"{est.gpu_hours:.2f}"
        if est.gpu_hours is None:
            unknown.append(s.name)
        else:
            total += est.gpu_hours
        disk += s.disk_gib
        reuse = f" [reuse {reused[s.name]}]" if s.name in reused else ""
        reuse += f" [{skipped[s.name]}]" if s.name in skipped else ""
        needs = [n for n in s.needs if n in names]  # the report reads what the selection runs
        inputs = ", ".join(needs[:3]) + (f" +{len(needs) - 3}" if len(needs) > 3 else "")
        lines.append(f"{s.name:<42} {s.entry_point:<14} {hours:>8} {s.disk_gib:>9.1f}  "
                     f"{inputs or '-'}{reuse}; {est.formula}")
    lines += ["", *_subtotal_lines("tree", _group(plan, estimates, "tree"))]
    if by_entry_point:
        lines += ["", *_subtotal_lines("entry point", _group(plan, estimates, "entry_point"))]
    transfer = sum(e.gpu_hours or 0.0 for s, e in zip(plan, estimates) if s.tree in TRANSFER_TREES)
    lines += ["", f"{len(plan)} steps; {total:.1f} GPU-hours where a benchmark figure covers the step "
              f"({len(unknown)} steps without one); about {math.ceil(disk)} GiB of artifacts"]
    if transfer:
        lines.append(f"of which the main reproduction {total - transfer:.1f} and the trees priced apart "
                     f"({', '.join(TRANSFER_TREES)}) {transfer:.1f}")
    lines.append(f"figures: {figures.source}")
    return "\n".join(lines)


def prepared_counts(prepare_run: str, base: PaperCounts = PaperCounts(), *, sizes: bool = True) -> PaperCounts:
    """:func:`corpus_counts` of a ``prepare`` run's corpus (or of a run standing for one),
    tokenized as that run's model reads it, over ``base``; ``sizes=False`` keeps ``base``'s split
    sizes."""
    from mistill.stages.common import RunReader, load_prepared, load_tokenizer  # deferred: torch, MLflow
    from mistill.stages.prepare import prompt_lengths  # deferred: torch, MLflow

    prepared = load_prepared(prepare_run)
    tokenizer = load_tokenizer(RunReader(prepare_run, field="prepare_run").config["model"])
    lengths = prompt_lengths(prepared.corpus, tokenizer, **prepared.prompt_settings)
    return corpus_counts(prepared.corpus, lengths, base, sizes=sizes)


PROG = "python -m mistill.runbook"
ALL_RESULTS = "all"
"""The ``--results`` value that stands for every result (as no value does)."""


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m mistill.runbook [--results R-C3,R-D12|all] [--prepare-run RUN] [--figures PATH]
    [--by-entry-point]``: print the plan; with a prepare run, at that corpus's lengths and split
    sizes (the tracking server must be reachable).

    Exits with code 2 on bad input (an unknown result id, an unreadable figures file), 3 when the
    tracking server cannot be reached, as the stage command line does."""
    ap = argparse.ArgumentParser(prog=PROG, description=main.__doc__)
    ap.add_argument("--results", default="",
                    help=f"App. Q ids, comma-separated ('{ALL_RESULTS}' or empty: every step)")
    ap.add_argument("--prepare-run", default="", help="a prepare run whose corpus sets the lengths")
    ap.add_argument("--figures", default=str(BENCHMARKS_FILE), help="the recorded benchmark figures")
    ap.add_argument("--by-entry-point", action="store_true",
                    help="also sum the GPU-hours by entry point")
    args = ap.parse_args(argv)
    try:
        _print_plan(args.results, args.prepare_run, args.figures, by_entry_point=args.by_entry_point)
    except MistillInputError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_INPUT) from None
    except TrackingUnavailableError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_UNREACHABLE) from None


def _print_plan(results: str, prepare_run: str, figures_file: str, *, by_entry_point: bool) -> None:
    """:func:`main`'s work: the results' descriptions, then the plan they need (every step where
    ``results`` is empty or holds ``all``; the other ids it holds are checked all the same)."""
    given = [r.strip() for r in results.split(",") if r.strip()]
    wanted = [r for r in given if r.lower() != ALL_RESULTS]
    figures = Figures.load(figures_file)
    counts = prepared_counts(prepare_run) if prepare_run else PaperCounts()
    plan = paper_plan(counts)
    chosen = select(plan, wanted)
    if len(wanted) == len(given):
        plan = chosen
    if wanted:
        entries = {e.id: e for e in load()}
        for rid in wanted:
            e = entries[rid]
            print(f"{rid}: {e.what} ({e.status}{'; needs ' + e.needs if e.needs else ''})")
        print()
    print(render(plan, figures, by_entry_point=by_entry_point))


__all__ = ["BENCHMARKS_FILE", "COST_MODELS", "SAMPLING_ENGINES", "Figures", "Workload", "Estimate", "estimate",
           "generation_estimate", "rollout_estimate", "sampling_key", "PlanStep", "PaperCounts", "corpus_counts",
           "prepared_counts", "paper_plan", "select", "Subtotal", "subtotals", "render", "main"]


if __name__ == "__main__":
    main()
