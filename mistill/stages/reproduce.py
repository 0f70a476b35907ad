"""``reproduce``: the paper's run trees (:mod:`mistill.runbook`) run, or planned, with one command.

Given the models and data (:data:`~mistill.runbook.ROLES`: the teacher, the two students, the
retriever's encoder, the LAS simulator's base model, the MIMIC-IV ICD-10 release), the entry
point runs the steps of every tree a result selection needs, in plan order:

* one ``reproduce`` run per invocation, and under it one run per tree (HD-001, HD-002, the
  instruction control, DT-000, DT-001, the report), named after the tree; each step's run is
  nested under its tree's run from its start;
* a step runs through :func:`~mistill.stages.steps.run_step`, which reuses an identical
  finished run (same typed parameters, input runs and code version) and else runs the entry
  point; a composite step (``characterize``) runs its nested steps the same way;
* each run tags the steps it finished (``mistill.step.<tree>/<step>``): a reproduction stopped
  part-way resumes under the same runs when the same command is given again, redoing nothing
  that finished, and an identical finished one is reused whole.

A step's config is built from the plan (:class:`~mistill.runbook.PlanStep`: its inputs, its
``-P`` settings with the roles filled in), this config's ``device``, ``dtype``, ``launch`` and
corpus name, and the ``settings`` file (entry point or step name -> field -> value), in that
order of precedence, the step's input runs last. The Mistill arms train with the λ that their
selection picked (``selected/lambda_p1`` and ``_p2``, as the pipeline does: the bf16 selection's,
or the fp32 re-selection's for Mistill with fp32 master weights).

With ``dry_run``, or when a model or data path the selected steps need is missing, nothing runs:
the plan is printed with each step's estimate (:func:`~mistill.runbook.render`) and, where the
roles given make a step's config known, the finished run it would reuse.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from mlflow.tracking import MlflowClient

from mistill.config import Config, file_digest
from mistill.data.corpus import PRIVACY_LEVELS
from mistill.errors import MistillInputError
from mistill.io import environment_variable
from mistill.progress import get_logger
from mistill.results_index import load
from mistill.runbook import ROLES, Figures, PaperCounts, PlanStep, paper_plan, prepared_counts, render, select
from mistill.stages.cli import discard_launched_run
from mistill.stages.common import mistill_root
from mistill.stages.registry import stage, stage_help
from mistill.stages.steps import LAUNCHES, REPO_ROOT, corpus_name_of
from mistill.stages.workflow import characterize_steps, run_step
from mistill.tracking import identity
from mistill.tracking.experiments import experiment_for_corpus
from mistill.tracking.identity import find_run, identity_params, repo_file
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.runs import StageRun
from mistill.validation import (check_choice, check_device, check_dtype, check_model_spec, check_name, check_names,
                                check_no_text_fields, check_not_empty, check_path)
from selection.runner import lambda_overrides

_log = get_logger("reproduce")

STEP_TAG = "mistill.step."
"""``mistill.step.<tree>/<step>`` (``.../<nested step>`` for a composite step's nested runs) on the
``reproduce`` run and on its tree's run: the run id of that step."""
TAG_TREE = "mistill.tree"
MODEL_ROLES = ("teacher", "student", "student_smollm3", "encoder", "las_model")
DATA_ROLES = ("corpus", "distill_corpus", "split_file", "flip_proposals", "flip_ledger", "eurlex_dataset",
              "eurlex_concepts", "eurlex_hierarchy", "bigcodebench_file", "musique_release", "musique_pair_proposals",
              "musique_pair_ledger", "kodcode_file")
OPTIONAL_ROLES = ("split_file",)
"""Roles a plan may leave empty (the release's own split column is then used)."""


@dataclass(frozen=True)
class ReproduceConfig(Config):
    """The paper's run trees on local models and data.

    teacher, student, student_smollm3: local model directories (or model specs) of Qwen3-14B,
    Qwen3-4B and SmolLM3-3B; encoder: the retriever's sentence encoder (gte-large); las_model:
    the LAS simulator's base (Qwen3-1.7B in the paper).
    corpus: the MIMIC-IV ICD-10 release, ``mimic:<table path>`` (``synthetic``: the embedded
    corpus, on which the teacher's ``generate`` steps and the retriever's training notes are not
    run: its notes carry scripted traces); split_file: the release's split file (optional);
    distill_corpus: the distillation corpus (App. A: 500 training notes, the 100 characterization
    notes as validation notes, 150 test notes, one per patient), a JSONL corpus whose records
    carry their splits (empty with the synthetic corpus: the synthetic corpus).
    flip_proposals, flip_ledger: the evidence-flip cohort's edit proposals (JSONL) and the
    reviewer's ledger (CSV) that the author supplies (App. N.2; ``flip_cohort``'s ``proposals``
    and ``ledger``); the synthetic corpus needs neither (its synthetic cases stand for them).
    eurlex_dataset, eurlex_concepts, eurlex_hierarchy: the EURLEX57K release's ``dataset/``
    folder, its ``EURLEX57K.json`` and a broader-concept file (App. P's screen, tree EU:
    ``prepare``'s ``corpus``, ``concepts_file`` and ``hierarchy_file`` with ``task=eurlex57k``;
    its runs go to the experiment ``mistill/<corpus_name>-eurlex57k``, its own report there); a
    synthetic corpus skips the tree.
    bigcodebench_file: the BigCodeBench release's JSONL file (App. P's programming screen, tree BC:
    ``prepare``'s ``corpus`` with ``task=bigcodebench``; experiment
    ``mistill/<corpus_name>-bigcodebench``); a synthetic corpus skips the tree.
    musique_release: the folder holding the MuSiQue-Ans release's ``musique_ans_v1.0_train.jsonl``
    and ``musique_ans_v1.0_dev.jsonl`` (App. O, tree MQ: ``prepare``'s ``corpus`` with
    ``task=musique``; its runs go to the experiment ``mistill/<corpus_name>-musique``, its own
    report there); a synthetic corpus skips the tree.
    musique_pair_proposals, musique_pair_ledger: App. O's evidence pairs as the author supplies
    them (tree MP: ``flip_cohort``'s ``proposals`` and ``ledger`` under the lock
    ``o-musique-pairs``; proposals name the bases of the dev file's pair slice, with App. O's
    conditions original, flipped, irrelevant and control); a synthetic corpus skips the tree.
    kodcode_file: a JSONL file of KodCode-V1 rows (App. P's programming pilot, tree PP: ``prepare``'s
    ``corpus`` with ``task=kodcode``, the training problems; the pilot also reads
    ``bigcodebench_file`` and tree BC's ranking; experiment ``mistill/<corpus_name>-programming-pilot``);
    a synthetic corpus skips the tree.
    corpus_name: the experiment ``mistill/<corpus_name>`` every run goes to (empty: the name
    ``prepare`` gives the corpus).
    results: App. Q ids to reproduce (empty: every tree).
    dry_run: print the plan and run nothing; the default whenever a path the selected steps
    need is missing or empty.
    settings: a YAML file ``{entry point or <tree>/<step>: {field: value}}`` applied over the
    plan's values (``projects/configs/reproduce/smoke.yaml`` sizes every step for a CPU check of
    the trees on the embedded default); every value it sets departs from the paper's procedure.
    device, dtype, launch: passed to every step that takes them.
    """

    teacher: str = ""
    student: str = ""
    student_smollm3: str = ""
    encoder: str = ""
    las_model: str = ""
    corpus: str = ""
    distill_corpus: str = ""
    split_file: str = ""
    flip_proposals: str = ""
    flip_ledger: str = ""
    eurlex_dataset: str = ""
    eurlex_concepts: str = ""
    eurlex_hierarchy: str = ""
    bigcodebench_file: str = ""
    musique_release: str = ""
    musique_pair_proposals: str = ""
    musique_pair_ledger: str = ""
    kodcode_file: str = ""
    corpus_name: str = ""
    privacy: str = "restricted"
    results: tuple[str, ...] = ()
    dry_run: bool = False
    settings: str = ""
    device: str = "cuda"
    dtype: str = "bfloat16"
    launch: str = "mlflow"

    def validate(self) -> None:
        check_no_text_fields(self)
        for name in MODEL_ROLES:
            check_model_spec(getattr(self, name), name, allow_empty=True)
        for name in DATA_ROLES:
            check_path(getattr(self, name).removeprefix("mimic:"), name, "a local path", allow_empty=True)
        check_choice(self.launch, LAUNCHES, "launch")

        check_choice(self.privacy, PRIVACY_LEVELS, "privacy")
        check_name(self.corpus_name, "corpus_name", "a corpus name", allow_empty=True)
        check_path(self.settings, "settings", "a settings file (.yaml)", allow_empty=True)
        check_device(self.device)
        check_dtype(self.dtype)
        check_names(self.results, "results", "a result id of App. Q")

        known = {e.id for e in load()}
        unknown = [r for r in self.results if r not in known]
        if unknown:
            raise MistillInputError(f"unknown result ids {', '.join(unknown)} (see docs/RESULTS_INDEX.md)",
                                    field="results")

    def check_environment(self) -> None:
        """The device is checked only when steps will run: a dry run plans for another machine."""
        if not self.dry_run and not missing_roles(select(paper_plan(), self.results), self):
            super().check_environment()

    def content_digests(self) -> dict[str, str]:
        """The settings file's content: edited in place, it makes another reproduction."""
        digest = file_digest(repo_file(self.settings)) if self.settings else None
        return {"settings": digest} if digest else {}

    @property
    def synthetic(self) -> bool:
        return self.corpus == "synthetic"

    def role(self, name: str) -> str:
        """The value a ``{name}`` placeholder stands for."""
        if name == "distill_corpus":
            return self.distill_corpus or (self.corpus if self.synthetic else "")
        return getattr(self, name)

    def experiment_corpus(self) -> str:
        return corpus_name_of(self.corpus, self.corpus_name)

    def step_corpus(self, step: PlanStep) -> str:
        """The corpus name whose experiment a step's runs go to: the reproduction's, or for a tree
        with an experiment of its own (:attr:`mistill.runbook.PlanStep.experiment`) that name with
        its suffix."""
        base = self.experiment_corpus()
        return f"{base}-{step.experiment}" if step.experiment else base


@dataclass(frozen=True)
class TreeConfig(Config):
    """One tree's run under one ``reproduce`` run: its identity (tree, parent run)."""

    tree: str = ""
    reproduce_run: str = ""

    def validate(self) -> None:
        check_not_empty(self.tree, "tree", "a tree of the plan")


# ------------------------------------------------------------------------------------ roles

def role_available(name: str, value: str) -> bool:
    """Whether a role's value can be used: a model spec the loader builds itself (``embedded:``,
    ``tiny:``, ``run:``), the synthetic corpus, or an existing path (after ``mimic:``)."""
    if not value:
        return name in OPTIONAL_ROLES
    base = value.split("@", 1)[0]
    if name in MODEL_ROLES and base.startswith(("embedded:", "tiny:", "run:")):
        return True
    if name in ("corpus", "distill_corpus") and value == "synthetic":
        return True
    return Path(value.removeprefix("mimic:")).exists()


def roles_used(plan: Sequence[PlanStep], cfg: ReproduceConfig) -> list[str]:
    """The roles the steps that will run refer to, in :data:`ROLES` order."""
    used = {m for s in plan if not (cfg.synthetic and s.skip_synthetic)
            for v in s.params_for(cfg.synthetic).values() for m in re.findall(r"{(\w+)}", v)}
    return [r for r in ROLES if r in used]


def missing_roles(plan: Sequence[PlanStep], cfg: ReproduceConfig) -> list[str]:
    """The roles the plan needs whose values are empty or missing paths."""
    return [r for r in roles_used(plan, cfg) if not role_available(r, cfg.role(r))]


# ------------------------------------------------------------------------- step configs

def load_settings(path: str) -> dict[str, dict[str, Any]]:
    """The settings file: ``{entry point or <tree>/<step>: {field: value}}``."""
    if not path:
        return {}

    file = repo_file(path)
    try:
        raw = yaml.safe_load(Path(file).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise MistillInputError(f"cannot read the settings ({exc.__class__.__name__})", file=str(file),
                                field="settings") from None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise MistillInputError("settings must map entry points or steps to {field: value}", file=str(file),
                                field="settings")
    return {str(k): dict(v) for k, v in raw.items()}


def step_values(step: PlanStep, cfg: ReproduceConfig, settings: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The step's config values other than its input runs: shared fields of this config, the
    plan's params with the roles filled in, then the settings for the entry point and for the
    step."""
    fields = {f.name for f in dataclasses.fields(stage(step.entry_point).config)}
    values: dict[str, Any] = {k: getattr(cfg, k) for k in ("device", "dtype", "launch") if k in fields}
    if step.entry_point == "prepare":
        values.update(corpus_name=cfg.step_corpus(step), privacy=cfg.privacy)
    if step.entry_point == "report":
        values["corpus"] = cfg.step_corpus(step)
    roles = {r: cfg.role(r) for r in ROLES}
    values.update({k: v.format_map(roles) for k, v in step.params_for(cfg.synthetic).items()})
    for key in (step.entry_point, step.name):
        unknown = sorted(set(settings.get(key, {})) - fields)
        if unknown:
            raise MistillInputError(f"settings for {key}: unknown field(s) {unknown}", file=cfg.settings,
                                    field="settings")
        values.update(settings.get(key, {}))
    return values


def step_config(step: PlanStep, cfg: ReproduceConfig, ids: Mapping[str, str],
                settings: Mapping[str, Mapping[str, Any]]) -> Config | None:
    """The step's config, its input runs read from ``ids`` (step reference -> run id); None when an
    input's run is not known (a dry run's step whose inputs were not found)."""
    values = step_values(step, cfg, settings)
    for field, refs in step.inputs.items():
        if any(ref not in ids for ref in refs.split(",")):
            return None
        values[field] = ",".join(ids[ref] for ref in refs.split(","))
    if step.model_run:  # a trained student's checkpoint as the model
        if step.model_run not in ids:
            return None
        values["model"] = f"run:{ids[step.model_run]}"
    selections = [n for n in step.needs if n.split("/", 1)[1].startswith("select_lambda")]
    if step.entry_point == "train" and selections:
        overrides = selected_overrides(ids.get(selections[0], ""))
        if overrides is None:
            return None
        values["overrides"] = overrides
    return stage(step.entry_point).config.from_dict(values, source=f"reproduce step {step.name}")


def selected_overrides(selection_run: str) -> str | None:
    """``train``'s ``overrides`` for the λ a ``select_lambda`` run picked (None: no such run)."""
    if not selection_run:
        return None

    m = MlflowClient().get_run(selection_run).data.metrics
    return lambda_overrides(m["selected/lambda_p1"], m["selected/lambda_p2"])


# -------------------------------------------------------------------------- running

def _skipped(step: PlanStep, cfg: ReproduceConfig, ids: Mapping[str, str]) -> str | None:
    """The run a step skipped on the synthetic corpus stands for (its input, or '' for none); None
    when the step runs."""
    if not (cfg.synthetic and step.skip_synthetic):
        return None
    return ids.get(next(iter(step.inputs.values())), "") if step.inputs else ""


def run_plan_step(step: PlanStep, cfg: ReproduceConfig, ids: Mapping[str, str],
                  settings: Mapping[str, Mapping[str, Any]], parent: str) -> dict[str, str]:
    """Run (or reuse) one step under its tree's run ``parent``: ``{reference: run id}``, with a
    composite step's nested runs as ``<step>:<nested>``."""
    config = step_config(step, cfg, ids, settings)
    if config is None:  # the plan's order makes every input known before its step
        raise RuntimeError(f"step {step.name}: an input run is unknown ({dict(step.inputs)})")
    corpus = cfg.step_corpus(step)
    if step.entry_point == "characterize":
        nested = characterize_steps(config, corpus, parent=parent)
        return {step.name: nested["knockin"], **{f"{step.name}:{k}": v for k, v in nested.items()}}
    return {step.name: run_step(step.entry_point, config, corpus, launch=cfg.launch, parent=parent)}


def find_finished(step: PlanStep, cfg: ReproduceConfig, ids: Mapping[str, str],
                  settings: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The finished runs a step would reuse (as :func:`run_plan_step` would return them), or {}
    when its config is not known yet or no identical run has finished."""
    config = step_config(step, cfg, ids, settings)
    if config is None:
        return {}
    experiment = experiment_for_corpus(cfg.step_corpus(step))
    version = identity.code_version(REPO_ROOT)  # looked up at the call: a test session pins it on the module

    def finished(name: str, c: Config) -> str | None:
        run = find_run(experiment, name, identity_params(c), version, stage(name).input_runs(c))
        return None if run is None else run.info.run_id

    if step.entry_point != "characterize":
        found = finished(step.entry_point, config)
        return {step.name: found} if found else {}
    events = finished("events", config.events_config())
    attribute = events and finished("attribute", config.attribute_config(events))
    knockin = attribute and finished("knockin", config.knockin_config(attribute))
    if not knockin:
        return {}
    return {step.name: knockin, f"{step.name}:events": events, f"{step.name}:attribute": attribute,
            f"{step.name}:knockin": knockin}


def step_tags(ids: Mapping[str, str]) -> dict[str, str]:
    """The tags recording ``ids`` (a nested reference ``a:b`` as ``a/b``)."""
    return {STEP_TAG + ref.replace(":", "/"): run_id for ref, run_id in ids.items() if run_id}


def ids_from_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """The step references and run ids a run's tags record (:func:`step_tags`)."""
    out = {}
    for key, value in tags.items():
        if key.startswith(STEP_TAG):
            parts = key[len(STEP_TAG):].split("/")
            out["/".join(parts[:2]) + "".join(f":{p}" for p in parts[2:])] = value
    return out


def trees(plan: Sequence[PlanStep]) -> Iterator[tuple[str, list[PlanStep]]]:
    """The plan's trees in order of first appearance, each with its steps in plan order."""
    order: dict[str, list[PlanStep]] = {}
    for s in plan:
        order.setdefault(s.tree, []).append(s)
    yield from order.items()


COUNTED_FROM: tuple[tuple[str, bool], ...] = (("HD-001/generate", False), ("DT-000/generate", True))
"""The traced corpora whose lengths replace the paper's in a dry run's estimates, once found: the
full-inventory one (its prompt and trace lengths) and the distillation one (its shortlist prompt
and trace lengths and its split sizes)."""


def corpus_lengths(ids: Mapping[str, str]) -> tuple[PaperCounts, list[str]]:
    """The paper's counts with the lengths (and sizes) of the traced corpora found in ``ids``
    (:data:`COUNTED_FROM`), and the steps whose runs were read."""
    counts, read = PaperCounts(), []
    for step, sizes in COUNTED_FROM:
        if ids.get(step):
            counts = prepared_counts(ids[step], counts, sizes=sizes)
            read.append(f"{step} ({ids[step]})")
    return counts, read


def dry_run(plan: Sequence[PlanStep], cfg: ReproduceConfig, settings: Mapping[str, Mapping[str, Any]],
            missing: Sequence[str]) -> str:
    """The plan as text, with the finished runs it would reuse where the roles given make a
    step's config known (the tracking server is asked only then)."""
    reused: dict[str, str] = {}
    ids: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for step in plan:
        stands = _skipped(step, cfg, ids)
        if stands is not None:
            ids[step.name] = stands
            skipped[step.name] = "synthetic corpus: not run"
            continue
        if missing:
            continue
        found = find_finished(step, cfg, ids, settings)
        ids.update(found)
        if step.name in found:
            reused[step.name] = found[step.name]
    counts, counted = corpus_lengths(ids)
    if counted:
        plan = select(paper_plan(counts), cfg.results)
    if missing:
        lines = ["dry run: missing or empty " + ", ".join(f"{r} ({cfg.role(r) or 'not given'})" for r in missing)
                 + "; nothing runs until every one is a local path"]
    else:
        lines = ["dry run: nothing runs"]
    roles = {r: cfg.role(r) for r in roles_used(plan, cfg)}
    lines += [f"  {r} = {v or '-'}" for r, v in roles.items()]
    if counted:
        lines.append("lengths and split sizes from the corpora of " + ", ".join(counted) + "; the rest the paper's")
    lines.append(render(plan, Figures.load(), reused=reused, skipped=skipped))
    return "\n".join(lines)


def run_reproduce(cfg: ReproduceConfig) -> str:
    """Run (or reuse) every step of the selected trees under one ``reproduce`` run; returns its id
    ('' for a dry run, which prints the plan and creates no run)."""
    plan = select(paper_plan(), cfg.results)
    settings = load_settings(cfg.settings)
    missing = missing_roles(plan, cfg)
    if cfg.dry_run or missing:
        print(dry_run(plan, cfg, settings, missing), flush=True)

        discard_launched_run()
        return ""
    corpus = cfg.experiment_corpus()
    level = "synthetic" if cfg.synthetic else cfg.privacy
    root = mistill_root()
    with StageRun("reproduce", cfg, corpus=corpus, guard=PrivacyGuard([], level), resume=True, root=root,
                  description=stage_help()["reproduce"],
                  name=f"reproduce-{'-'.join(cfg.results) or 'all'}") as run:
        ids = ids_from_tags(run.run.data.tags)
        if run.reused:
            _log.info("[reproduce] reusing finished run %s (%s)", run.run_name, run.run_id)
            return run.run_id
        for tree, steps in trees(plan):
            with environment_variable("MLFLOW_RUN_ID", None), StageRun(
                    "reproduce", TreeConfig(tree=tree, reproduce_run=run.run_id), corpus=corpus,
                    guard=PrivacyGuard([], level), resume=True, root=root, name=tree, parent=run.run_id,
                    tags={TAG_TREE: tree}, description=f"the {tree} tree of the reproduction, its steps nested"
                    ) as tree_run:
                ids.update(ids_from_tags(tree_run.run.data.tags))
                for step in steps:
                    stands = _skipped(step, cfg, ids)
                    if stands is not None:
                        ids[step.name] = stands
                        continue
                    if step.name in ids or tree_run.reused:
                        continue
                    _log.info("[reproduce] %s (%s)", step.name, step.entry_point)
                    done = run_plan_step(step, cfg, ids, settings, tree_run.run_id)
                    ids.update(done)
                    tree_run.set_tags(step_tags(done))
                    run.set_tags(step_tags(done))
        _log.info("[reproduce] %d steps of %d trees finished", len(plan), len(dict(trees(plan))))
        return run.run_id


__all__ = ["ReproduceConfig", "TreeConfig", "STEP_TAG", "role_available", "missing_roles", "roles_used",
           "load_settings", "step_values", "step_config", "run_plan_step", "find_finished", "dry_run",
           "run_reproduce", "ids_from_tags", "step_tags", "trees"]
