"""The paper's run trees as a plan, and what each step will cost before it runs.

A :class:`PlanStep` is one entry point run of one tree (HD-001, HD-002, DT-000, ...), with the
steps it needs, the result ids of App. Q it serves, and its workload: how many notes (or
optimizer micro-steps) of how many tokens on which model. :func:`estimate` turns a workload into
GPU-hours from the figures recorded in ``benchmarks/results.json`` (:class:`Figures`), scaling
the benchmark's per-note time by the tokens per note (linearly: a lower bound where attention's
quadratic part dominates); every estimate names the figures and the formula it used, and a step
without a recorded figure says so rather than guess. :func:`select` keeps the steps that a set
of result ids needs, with everything they depend on.

The counts are the paper's (App. A, C, J, Q), as :func:`paper_plan` states them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mistill.errors import MistillInputError

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
    tokens: tokens per unit (prompt + trace).
    """

    kind: str
    model: str = ""
    units: int = 0
    tokens: int = 0


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
    "train_opd": ("onpolicy_step.{model}.opd_step_s", ""),
    "train_gold": ("onpolicy_step.{model}.gold_off_policy_step_s", ""),
    "own_heads": ("instrument.{model}.attribution_pass_s", "instrument.{model}.tokens"),
}
COST_NOTES: dict[str, str] = {
    "train_opd": "the benchmark's rollouts are 256 tokens: a lower bound",
    "train_gold": "the benchmark's off-policy step at the 6,144-token cap",
}
NO_FIGURE = ("generate", "evaluate", "shortlist", "las_simulator")
COMPOSITE: dict[str, tuple[str, ...]] = {"characterize": ("events", "attribute", "knockin")}
"""Entry points that run others as nested steps."""


def estimate(work: Workload, figures: Figures) -> Estimate:
    """GPU-hours of ``work``: units x per-unit seconds (x tokens / benchmark tokens) / 3600."""
    if work.kind == "none":
        return Estimate(0.0, "no GPU work")
    if work.kind not in COST_MODELS:
        return Estimate(None, f"no benchmark figure for {work.kind} on a GPU yet")
    time_key, tokens_key = (k.format(model=work.model) for k in COST_MODELS[work.kind])
    per_unit = figures.get(time_key)
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


@dataclass(frozen=True)
class PlanStep:
    """One entry point run of one tree.

    name: unique in the plan (``<tree>/<step>``); needs: the names of the steps whose runs it
    reads; params: the ``-P`` settings that differ from the
    entry point's defaults (inputs given as ``<step name>`` references); disk_gib: the
    artifacts it writes, from rough per-note sizes (**[recon]**: the paper states none; a
    checkpoint of a 4B student in bf16 is 8 GiB).
    """

    tree: str
    step: str
    entry_point: str
    work: Workload
    needs: tuple[str, ...] = ()
    params: Mapping[str, str] = field(default_factory=dict)
    disk_gib: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.tree}/{self.step}"

    @property
    def covers(self) -> tuple[str, ...]:
        """The entry points this step runs: its own and, for a composite one, its nested steps'."""
        return (self.entry_point, *COMPOSITE.get(self.entry_point, ()))


@dataclass(frozen=True)
class PaperCounts:
    """The paper's sizes: notes, tokens and seeds (App. A, C, I, J).

    characterization_traces: HD-001's traces (100 over 94 notes); instruction_notes: the
    instruction control's notes (Table 4: 30, the narrowing sentence removed); full_prompt_tokens: a
    full-inventory prompt + trace (the instrument benchmark's length); shortlist_tokens: a
    shortlist prompt + trace; train_notes, val_notes, test_notes: the distillation corpus;
    selection_notes: the λ selection's training notes; epochs and grad_accum: the recipe.
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

    def micro_steps(self, notes: int, epochs: int | None = None) -> int:
        return notes * (self.epochs if epochs is None else epochs)


def corpus_counts(corpus, lengths: Sequence, base: PaperCounts = PaperCounts()) -> PaperCounts:
    """``base`` with a corpus's own sizes: the median prompt + trace tokens of its notes
    (``lengths``: :func:`mistill.stages.prepare.prompt_lengths`), as shortlist lengths when its
    notes list a shortlist and as full-inventory lengths otherwise, and its split sizes where it
    has the split (``train``, ``val``, ``test``)."""
    import dataclasses
    import statistics

    if not lengths:
        raise MistillInputError("the corpus has no notes to count", field="prepare_run")
    median = int(statistics.median(n.total_tokens for n in lengths))
    shortlisted = any(note.shortlist is not None for note in corpus.notes)
    changes: dict[str, int] = {"shortlist_tokens" if shortlisted else "full_prompt_tokens": median}
    for split, name in (("train", "train_notes"), ("val", "val_notes"), ("test", "test_notes")):
        n = sum(note.split == split for note in corpus.notes)
        if n:
            changes[name] = n
    return dataclasses.replace(base, **changes)


def paper_plan(counts: PaperCounts = PaperCounts()) -> list[PlanStep]:
    """The paper's run trees in order; a step's needs come before it."""
    c = counts
    full, short = c.full_prompt_tokens, c.shortlist_tokens
    steps = [
        PlanStep("HD-001", "prepare", "prepare", Workload("none"),
                 params={"corpus": "mimic:<note table>", "select_n": "94", "remove_discharge_diagnosis": "true"}),
        PlanStep("HD-001", "generate", "generate", Workload("generate"), needs=("HD-001/prepare",)),
        PlanStep("HD-001", "characterize", "characterize",
                 Workload("characterize", "qwen3-14b", c.characterization_traces, full),
                 needs=("HD-001/generate",),
                 disk_gib=c.characterization_traces * 0.05),
        PlanStep("HD-001", "locus", "locus", Workload("locus", "qwen3-14b", c.characterization_traces, full),
                 needs=("HD-001/characterize",), disk_gib=c.characterization_traces * 0.01),
        PlanStep("HD-001", "read_side", "read_side",
                 Workload("read_side", "qwen3-14b", c.characterization_traces, full),
                 needs=("HD-001/characterize",), disk_gib=c.characterization_traces * 0.01),
        PlanStep("HD-001", "key_block", "key_block",
                 Workload("key_block", "qwen3-14b", c.characterization_traces * c.events_per_note),
                 needs=("HD-001/read_side",)),
        PlanStep("HD-001", "trace_edit", "trace_edit",
                 Workload("edits", "qwen3-14b",
                          c.characterization_traces * c.edit_events_per_note * c.edit_reads_per_event),
                 needs=("HD-001/characterize",)),
        PlanStep("HD-001", "note_edit", "note_edit",
                 Workload("edits", "qwen3-14b",
                          c.characterization_traces * c.edit_events_per_note * c.edit_reads_per_event),
                 needs=("HD-001/characterize",)),
        PlanStep("HD-002", "shortlist", "shortlist", Workload("shortlist"), needs=("HD-001/prepare",)),
        PlanStep("HD-002", "generate", "generate", Workload("generate"), needs=("HD-002/shortlist",)),
        PlanStep("HD-002", "characterize", "characterize",
                 Workload("characterize", "qwen3-14b", c.characterization_traces, short),
                 needs=("HD-002/generate",), disk_gib=c.characterization_traces * 0.02),
        PlanStep("instruction", "prepare", "prepare", Workload("none"),
                 params={"corpus": "mimic:<note table>", "select_n": str(c.instruction_notes),
                         "narrow_instruction": "false"}),
        PlanStep("instruction", "generate", "generate", Workload("generate"), needs=("instruction/prepare",)),
        PlanStep("instruction", "characterize", "characterize",
                 Workload("characterize", "qwen3-14b", c.instruction_notes, full), needs=("instruction/generate",)),
        PlanStep("DT-000", "prepare", "prepare", Workload("none"),
                 params={"corpus": "mimic:<distillation corpus>"}),
        PlanStep("DT-000", "shortlist", "shortlist", Workload("shortlist"), needs=("DT-000/prepare",)),
        PlanStep("DT-000", "generate", "generate", Workload("generate"), needs=("DT-000/shortlist",)),
        PlanStep("DT-000", "teacher_attribute", "characterize",
                 Workload("characterize", "qwen3-14b", c.train_notes, short), needs=("DT-000/generate",),
                 disk_gib=c.train_notes * 0.02),
        PlanStep("DT-000", "targets", "targets", Workload("targets", "qwen3-14b", c.train_notes, short),
                 needs=("DT-000/teacher_attribute",), disk_gib=c.train_notes * 0.01),
        PlanStep("DT-000", "student_attribute", "characterize",
                 Workload("characterize", "qwen3-4b", c.val_notes, short), needs=("DT-000/generate",)),
    ]
    from mistill.distill.arms import resolve_arm

    steps.append(PlanStep("DT-000", "student_attribute_smollm3", "characterize",
                          Workload("characterize", "qwen3-4b", c.val_notes, short), needs=("DT-000/generate",),
                          params={"model": "<SmolLM3-3B>"}))
    steps.append(PlanStep("DT-001", "select_lambda", "select_lambda",
                          Workload("train_mistill", "qwen3-4b", 3 * c.micro_steps(c.selection_notes), short),
                          needs=("DT-000/targets", "DT-000/student_attribute"),
                          params={"lock": "projects/configs/locks/i3-bf16-selection.yaml"}, disk_gib=3 * 8.0))
    # (student, arm, cost model, seeds): App. J.4's seed counts; SmolLM3-3B steps are estimated with the
    # Qwen3-4B figures (no SmolLM3 benchmark is recorded)
    arms = [("qwen3-4b", "vanilla-fp32", "train_vanilla", 3), ("qwen3-4b", "vanilla-bf16", "train_vanilla", 3),
            ("qwen3-4b", "feature-kd", "train_mistill", 3), ("qwen3-4b", "distillm2", "train_vanilla", 1),
            ("qwen3-4b", "opd", "train_opd", 1), ("qwen3-4b", "mistill", "train_mistill", 3),
            ("smollm3-3b", "vanilla-fp32", "train_vanilla", 2), ("smollm3-3b", "vanilla-bf16", "train_vanilla", 1),
            ("smollm3-3b", "feature-kd", "train_mistill", 1), ("smollm3-3b", "gold", "train_gold", 1),
            ("smollm3-3b", "mistill", "train_mistill", 2)]
    for student, arm, kind, seeds in arms:
        tree = "DT-001" if arm == "mistill" else "DT-000"
        ranking = "DT-000/student_attribute" + ("_smollm3" if student == "smollm3-3b" else "")
        # the Mistill arms read the student's own ranking and the λ selection's pick
        needs = ("DT-000/targets",) + ((ranking, "DT-001/select_lambda") if arm == "mistill" else ())
        model = {"qwen3-4b": "<Qwen3-4B>", "smollm3-3b": "<SmolLM3-3B>"}[student]
        micro = c.micro_steps(c.train_notes, resolve_arm(arm).epochs or None)
        for seed in range(seeds):
            run = f"{student}_{arm}_s{seed}"
            steps.append(PlanStep(tree, f"train_{run}", "train", Workload(kind, "qwen3-4b", micro, short),
                                  needs=needs, params={"arm": arm, "seed": str(seed), "student": model}, disk_gib=8.0))
            steps.append(PlanStep(tree, f"evaluate_{run}", "evaluate", Workload("evaluate"),
                                  needs=(f"{tree}/train_{run}",), params={"arm": arm}))
            steps.append(PlanStep(tree, f"own_heads_{run}", "own_heads",
                                  Workload("own_heads", "qwen3-4b", c.test_notes, short),
                                  needs=(f"{tree}/train_{run}",), params={"arm": arm}))
    steps.append(PlanStep("report", "report", "report", Workload("none"),
                          needs=tuple(s.name for s in steps if s.entry_point in ("evaluate", "own_heads"))))
    return steps


def _arms_named(params: str) -> set[str]:
    """The arms a result index entry's params name (``arm=<name>``)."""
    import re

    return set(re.findall(r"arm=([A-Za-z0-9_-]+)", params))


def select(plan: Sequence[PlanStep], results: Iterable[str], index: Sequence | None = None) -> list[PlanStep]:
    """The steps of ``plan`` that the result ids ``results`` need, in plan order, with every step
    they read (the whole plan for no ids).

    A result needs the plan's steps of the entry points its result index entry names
    (:mod:`mistill.results_index`); where the entry names arms (``arm=...``), only those arms'
    training, evaluation and own-heads steps. Unknown ids, and ids whose entry points the plan
    does not hold, are refused (``field='results'``)."""
    from mistill.results_index import load

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
        hits = [s.name for s in plan if set(s.covers) & set(entry.entry_points)
                and (not arms or "arm" not in s.params or s.params["arm"] in arms)]
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


def render(plan: Sequence[PlanStep], figures: Figures, *, reused: Mapping[str, str] | None = None) -> str:
    """The plan as text: one line per step (entry point, inputs, reuse, GPU-hours, disk), then
    the totals and the figures file read."""
    reused = reused or {}
    lines = [f"{'step':<42} {'entry point':<14} {'GPU-h':>8} {'disk GiB':>9}  inputs / estimate"]
    total, unknown, disk = 0.0, [], 0.0
    for s in plan:
        est = estimate(s.work, figures)
        hours = "?" if est.gpu_hours is None else f"{est.gpu_hours:.2f}"
        if est.gpu_hours is None:
            unknown.append(s.name)
        else:
            total += est.gpu_hours
        disk += s.disk_gib
        reuse = f" [reuse {reused[s.name]}]" if s.name in reused else ""
        inputs = ", ".join(s.needs[:3]) + (f" +{len(s.needs) - 3}" if len(s.needs) > 3 else "")
        lines.append(f"{s.name:<42} {s.entry_point:<14} {hours:>8} {s.disk_gib:>9.1f}  "
                     f"{inputs or '-'}{reuse}; {est.formula}")
    lines += ["", f"{len(plan)} steps; {total:.1f} GPU-hours where a benchmark figure covers the step "
              f"({len(unknown)} steps without one); about {math.ceil(disk)} GiB of artifacts",
              f"figures: {figures.source}"]
    return "\n".join(lines)


def prepared_counts(prepare_run: str) -> PaperCounts:
    """:func:`corpus_counts` of a ``prepare`` run's corpus, tokenized as that run's model reads it."""
    from mistill.models.loading import load_tokenizer
    from mistill.stages.common import RunReader, load_prepared
    from mistill.stages.prepare import prompt_lengths

    prepared = load_prepared(prepare_run)
    tokenizer = load_tokenizer(RunReader(prepare_run, field="prepare_run").config["model"])
    lengths = prompt_lengths(prepared.corpus, tokenizer, remove_discharge_diagnosis=prepared.remove_discharge_diagnosis,
                             narrow_instruction=prepared.narrow_instruction)
    return corpus_counts(prepared.corpus, lengths)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m mistill.runbook [--results R-C3,R-D12] [--prepare-run RUN] [--figures PATH]``:
    print the plan; with a prepare run, at that corpus's lengths and split sizes (the tracking
    server must be reachable)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mistill.runbook", description=main.__doc__)
    ap.add_argument("--results", default="", help="App. Q ids, comma-separated (empty: every step)")
    ap.add_argument("--prepare-run", default="", help="a prepare run whose corpus sets the lengths")
    ap.add_argument("--figures", default=str(BENCHMARKS_FILE), help="the recorded benchmark figures")
    args = ap.parse_args(argv)
    counts = prepared_counts(args.prepare_run) if args.prepare_run else PaperCounts()
    wanted = [r.strip() for r in args.results.split(",") if r.strip()]
    plan = select(paper_plan(counts), wanted)
    if wanted:
        from mistill.results_index import load

        entries = {e.id: e for e in load()}
        for rid in wanted:
            e = entries[rid]
            print(f"{rid}: {e.what} ({e.status}{'; needs ' + e.needs if e.needs else ''})")
        print()
    print(render(plan, Figures.load(args.figures)))


__all__ = ["BENCHMARKS_FILE", "COST_MODELS", "Figures", "Workload", "Estimate", "estimate", "PlanStep",
           "PaperCounts", "corpus_counts", "prepared_counts", "paper_plan", "select", "render", "main"]


if __name__ == "__main__":
    main()
