"""Multi-step workflows: ``characterize`` and ``pipeline`` chain entry points, reusing finished runs.

The MLflow multistep pattern: before launching an entry point, look for a FINISHED run of the
same entry point with the same typed parameters, the same input runs and the same code
version (:func:`mistill.tracking.identity.find_run` pages through every candidate and compares
typed values); reuse it when found, else launch the entry point with
``mlflow.projects.run(..., env_manager="local")`` and wait for it.

A step started for a parent run (the pipeline's, or the ``own_heads`` run ranking its arm) is
nested under it from its start (``mlflow.parentRunId``), whether it runs in this process or in a
launched one. The pipeline run tags each step (``mistill.step.<name>``) as the step finishes, so
a pipeline that stops part-way shows the steps it completed; it ends FAILED on an error and
KILLED on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from analysis.evidence import (MIN_GATED_EVENTS, MIN_NOTES, TOO_SMALL, Support, floor_cell, readout_cell, support_of,
                               value_text)
from analysis.report import EvidenceSize
from mistill.config import Config, file_digest
from mistill.distill.arms import arm_digest, resolve_arm
from mistill.errors import MistillInputError
from mistill.instrument.locus import SUFFIXES
from mistill.models.loading import EMBEDDED_DEFAULT
from mistill.params import AttributeParams, KnockinParams, NomineeParams, NullParams
from mistill.progress import get_logger
from mistill.stages.characterize import AttributeConfig, EventsConfig, KnockinStageConfig, stage_notes
from mistill.stages.common import load_prepared, mistill_root, require_notes
from mistill.stages.distill import TargetsConfig, TrainStageConfig
from mistill.stages.edits import NoteEditConfig, TraceEditConfig
from mistill.stages.evaluate import EvaluateConfig
from mistill.stages.keyblock import KeyBlockConfig
from mistill.stages.las import LasSimulatorConfig
from mistill.stages.locus import LocusStageConfig
from mistill.stages.own_heads import OwnHeadsConfig
from mistill.stages.prepare import PrepareConfig
from mistill.stages.readside import ReadSideConfig
from mistill.stages.registry import stage_help
from mistill.stages.report import ReportConfig
from mistill.stages.select_lambda import TAG_PICK_MODEL, TAG_PICK_TRAIN_RUN, SelectLambdaConfig
from mistill.stages.shortlist import ShortlistConfig
from mistill.stages.steps import LAUNCHES, corpus_name_of, run_step
from mistill.tracking.models import TAG_MODEL_VERSION, TAG_REGISTERED_MODEL
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.experiments import run_url
from mistill.tracking.identity import repo_file
from mistill.tracking.naming import TAG_BACKEND
from mistill.tracking.runs import StageRun
from mistill.validation import (check_arms, check_choice, check_choices, check_model_spec, check_name,
                                check_no_text_fields, check_non_negative, check_not_empty, check_path, check_positive)
from selection.runner import lambda_overrides

STEP_TAG = "mistill.step."
"""The pipeline run's tag ``mistill.step.<name>`` = the run id of its step ``<name>``."""

_log = get_logger("workflow")

OnStep = Callable[[str, str], None]
"""Called as ``on_step(name, run_id)`` when a workflow step has finished (or was reused)."""


class Steps(dict):
    """A workflow's steps, name -> run id, reporting each to ``on_step`` as it is set."""

    def __init__(self, on_step: OnStep | None = None) -> None:
        super().__init__()
        self.on_step = on_step

    def __setitem__(self, name: str, run_id: str) -> None:
        super().__setitem__(name, run_id)
        if self.on_step is not None:
            self.on_step(name, run_id)

    def record(self, steps: Mapping[str, str]) -> None:
        """Add steps already reported (by the workflow that ran them), without reporting again."""
        super().update(steps)


@dataclass(frozen=True)
class CharacterizeConfig(Config, NullParams, AttributeParams, NomineeParams, KnockinParams):
    """events -> attribute -> knockin on one prepared corpus (the instrument, App. C–D).

    Every field is the field of the same name of the step it is passed to (``EventsConfig``,
    ``AttributeConfig``, ``KnockinStageConfig``; the fields of the parameter groups it shares
    with a step, :meth:`~mistill.config.Config.shared_params`), except ``rank_split``:
    ``AttributeConfig.split``, the notes ranked and knocked in among the events run's (empty:
    all of them); launch: ``mlflow`` or ``inline``.
    """

    prepare_run: str = ""
    model: str = EMBEDDED_DEFAULT
    dtype: str = "float32"
    device: str = "cpu"
    split: str = ""
    rank_split: str = ""
    max_notes: int = 0
    seed: int = 0
    launch: str = "mlflow"

    def validate(self) -> None:
        check_no_text_fields(self)
        check_name(self.rank_split, "rank_split", "a split", allow_empty=True)
        self.events_config()  # each step's config validates the fields it takes
        self.attribute_config()
        self.knockin_config()
        check_choice(self.launch, LAUNCHES, "launch")

    def events_config(self) -> EventsConfig:
        return EventsConfig(prepare_run=self.prepare_run, model=self.model, dtype=self.dtype, device=self.device,
                            split=self.split, max_notes=self.max_notes, seed=self.seed,
                            **self.shared_params(EventsConfig))

    def attribute_config(self, events_run: str = "") -> AttributeConfig:
        return AttributeConfig(events_run=events_run, split=self.rank_split, dtype=self.dtype, device=self.device,
                               seed=self.seed, **self.shared_params(AttributeConfig))

    def knockin_config(self, attribute_run: str = "") -> KnockinStageConfig:
        return KnockinStageConfig(attribute_run=attribute_run, dtype=self.dtype, device=self.device, seed=self.seed,
                                  **self.shared_params(KnockinStageConfig))


def characterize_steps(cfg: CharacterizeConfig, corpus_name: str, parent: str | None = None, *,
                       on_step: OnStep | None = None) -> dict[str, str]:
    """events -> attribute -> knockin; each reported to ``on_step`` as it finishes."""
    ids = Steps(on_step)
    ids["events"] = run_step("events", cfg.events_config(), corpus_name, launch=cfg.launch, parent=parent)
    ids["attribute"] = run_step("attribute", cfg.attribute_config(ids["events"]), corpus_name,
                                launch=cfg.launch, parent=parent)
    ids["knockin"] = run_step("knockin", cfg.knockin_config(ids["attribute"]), corpus_name, launch=cfg.launch,
                              parent=parent)
    return dict(ids)


def _corpus_of_run(run_id: str) -> str:
    return MlflowClient().get_run(run_id).data.tags["mistill.corpus"]


def run_characterize(cfg: CharacterizeConfig) -> str:
    """The three instrument stages in order; returns the knock-in run id. A split without
    notes is refused before any step runs."""
    prepared = load_prepared(cfg.prepare_run)
    notes = stage_notes(prepared, cfg.split, cfg.max_notes)
    if cfg.rank_split:
        require_notes([n for n in notes if n.split == cfg.rank_split], cfg.rank_split, prepared, field="rank_split")
    ids = characterize_steps(cfg, _corpus_of_run(cfg.prepare_run))
    return ids["knockin"]


DEMO_DEFAULTS: Mapping[str, object] = MappingProxyType({
    "n_null": 10, "selftest_events": 1, "k_bins": (3, 8, 16, 40), "events_per_phase": 5, "stability_splits": 50,
    "top_nominees": 8, "global_nominees": 4, "p2_top_nominees": 6, "p2_global_nominees": 2,
    "p2c_top_nominees": 8, "p2c_global_nominees": 4})
"""The pipeline's defaults for fields of its parameter groups, in place of the groups' own (the
``characterize`` stage's): sized for a CPU demo, with fewer NULL events, events per phase,
split-half draws and set sizes, one self-test event, and about a fifth of the paper's exact-patch
nominees per event (the exact patches are most of the attribution pass's time on a CPU; every
phase is still patched exactly). The pipeline passes them on to its ``characterize`` step
(:meth:`~mistill.config.Config.shared_params`), and the nominee counts to the students'
attribution steps (its own and ``own_heads``'). Pass the paper's values with ``-P`` for a
paper-sized run."""


@dataclass(frozen=True)
class PipelineConfig(Config, NullParams, AttributeParams, NomineeParams, KnockinParams, defaults=DEMO_DEFAULTS):
    """The whole platform on one corpus (defaults: the embedded default, sized for a CPU demo;
    the group fields' demo defaults: ``DEMO_DEFAULTS``).

    The fields passed on under their own name (``corpus`` ... ``codes_file`` and ``model`` to
    ``prepare``, ``task`` among them: ``catalog`` runs every step on the embedded parts
    catalogue; ``model``, ``dtype``, ``device``, ``seed``, ``launch`` and the fields of the
    parameter groups to ``characterize``) are validated by those steps' configs.
    teacher_split: the notes the teacher is ranked and knocked in on (``CharacterizeConfig.rank_split``;
    the teacher's events cover every note, so the targets can read the training notes'): the
    validation notes, the paper's 100 characterization notes (Sec. 4.2; empty: every note).
    student_split, train_split, eval_split: the notes the student is ranked on, the arms train
    on and are evaluated on. Each split must hold notes with a teacher trace (checked once the
    corpus is prepared, before any model step).
    inventory_size, codes_per_note: the synthetic corpus's inventory and gold codes per note
    (``PrepareConfig``); 60 codes keep the CPU demo's prompts short (the inventory listing is
    most of a prompt), a demo setting (``prepare`` alone: 120). ``-P codes_per_note=3,6`` (with
    ``-P inventory_size=40``) shortens every prompt and trace by about 40 % and the whole demo
    by about a third, but (measured at seed 0) the students' P1 knock-in events then all fall
    below the 1-nat gate, leaving their P1 recovery empty.
    eval_max_new_tokens, las_max_steps: the evaluations' generation cap (the paper: 16,384) and
    the LAS simulator's fine-tuning steps (one here), demo settings.
    las_max_note_words: the LAS simulator's note cap (``LasSimulatorConfig.max_note_words``);
    128 keeps the CPU demo quick, a demo setting (the paper's simulator reads the whole note:
    0).
    read_side, read_side_max_events: run App. E's steps on the teacher after characterization
    (``read_side`` on its ranking, ``key_block`` on the heads the read side names, ``trace_edit``
    and ``note_edit``), the last three at most at this many events per note and phase (2 here, a
    demo setting: on two CPU cores the four steps then add about two minutes to the demo; the
    paper: every event for the key blocking, 20 for the edits; 0: the stages' own defaults).
    locus, locus_max_mentions, locus_compare_suffixes: run the ``locus`` step on the teacher
    after characterization (its prose-time set pools the teacher's P1 window rows in
    ``targets``; off, or when no mention had a locus to attribute, as on the embedded
    SmolLM2-135M, whose forcing probes rarely cross θ, they fall back to the emission pool, a
    tagged deviation), with at most
    this many chapter mentions per note (0: all) and these suffixes compared for Table 25
    (D here, a demo setting: each compared suffix repeats every walk-back; the paper compares A
    and D, ``-P locus_compare_suffixes=A,D``).
    train_arms: arms to train (names or ``.yaml`` paths, see ``TrainStageConfig.arm``); empty
    stops after characterization. train_max_steps: 0 lets the epochs decide; one optimizer step
    here, as the λ selection's cells train under the default lock
    (``projects/configs/locks/embedded-3cell.yaml``), so the picked cell's run is the Mistill arm
    (an arm trained differently from its cells is trained again).
    train_probe_every: the generation probe during every arm's training
    (``TrainStageConfig.probe_every``; 0: none), capped at ``eval_max_new_tokens`` tokens.
    train_gradient_checkpointing: the arms and the λ-selection cells recompute the student's
    layers in the backward (``RecipeParams.gradient_checkpointing``, memory only). Off here, a
    demo setting: the 135M student fits without it and the recompute adds about 45 % to a CPU
    step; turn it on for the paper's students on a GPU.
    A corpus file, codes_file, select_lock and arm files given by path join the run's identity
    by content.
    """

    corpus: str = "synthetic"
    corpus_name: str = ""
    task: str = "icd10"
    privacy: str = "restricted"
    n_notes: int = 8
    seed: int = 0
    inventory_size: int = 60
    codes_per_note: tuple[int, ...] = (5, 25)
    codes_file: str = ""
    model: str = EMBEDDED_DEFAULT
    dtype: str = "float32"
    device: str = "cpu"
    teacher_split: str = "val"
    student: str = "embedded:smollm2-135m@every-other"
    student_split: str = "val"
    train_split: str = "train"
    train_arms: tuple[str, ...] = ("vanilla-bf16", "mistill")
    train_max_steps: int = 1
    train_grad_accum: int = 1
    train_gradient_checkpointing: bool = False
    train_probe_every: int = 0
    shortlist: bool = True
    select_lock: str = "projects/configs/locks/embedded-3cell.yaml"
    eval_split: str = "test"
    eval_max_new_tokens: int = 32
    las_model: str = EMBEDDED_DEFAULT
    las_max_steps: int = 1
    las_max_note_words: int = 128
    read_side: bool = True
    read_side_max_events: int = 2
    locus: bool = True
    locus_max_mentions: int = 0
    locus_compare_suffixes: tuple[str, ...] = ("D",)
    own_heads: bool = True
    report: bool = True
    launch: str = "mlflow"

    def validate(self) -> None:
        check_no_text_fields(self)
        for field in ("teacher_split", "student_split", "train_split", "eval_split"):
            check_name(getattr(self, field), field, "a split", allow_empty=True)
        self.prepare_config()  # the prepare and characterize steps validate what they take
        self.characterize_config()

        # under the pipeline's own names, before the locus step's config checks them as its own
        check_choices(self.locus_compare_suffixes, tuple(SUFFIXES), "locus_compare_suffixes", non_empty=False)
        check_non_negative(self.locus_max_mentions, "locus_max_mentions", "0: every mention")
        check_non_negative(self.read_side_max_events, "read_side_max_events", "0: the stages' defaults")
        self.locus_config()
        check_model_spec(self.student, "student")
        check_model_spec(self.las_model, "las_model")
        check_path(self.select_lock, "select_lock", "a lock file (.yaml)", allow_empty=True)
        check_arms(self.train_arms, "train_arms")
        check_not_empty(self.student, "student", "a model spec")
        for arm in self.train_arms:
            try:
                resolve_arm(arm)
            except MistillInputError as exc:
                raise MistillInputError(f"train_arms: {exc}", field="train_arms") from None
        check_non_negative(self.train_max_steps, "train_max_steps", "0: the epochs decide")
        check_positive(self.train_grad_accum, "train_grad_accum")
        check_non_negative(self.train_probe_every, "train_probe_every", "0: no probe")
        check_positive(self.eval_max_new_tokens, "eval_max_new_tokens")
        check_not_empty(self.las_model, "las_model", "a model spec")
        check_positive(self.las_max_steps, "las_max_steps")
        check_non_negative(self.las_max_note_words, "las_max_note_words", "0: whole notes")

    def content_digests(self) -> dict[str, str]:
        """The content of the files the prepare step reads (a corpus file, ``codes_file``), of
        ``select_lock`` and of the arms given by path."""
        out = dict(self.prepare_config().content_digests())
        lock = file_digest(repo_file(self.select_lock))  # found from here, else in the repository
        if lock is not None:
            out["select_lock"] = lock
        arms = {arm: digest for arm in self.train_arms if (digest := arm_digest(arm))}
        if arms:
            out["train_arms"] = hashlib.sha256(json.dumps(arms, sort_keys=True).encode()).hexdigest()
        return out

    def step_names(self) -> list[str]:
        """The names :func:`pipeline_steps` gives its steps with this config, in order (the
        selection's cells, nested in ``select_lambda``, are not steps of their own)."""
        names = ["prepare"] + (["shortlist"] if self.shortlist else []) + ["events", "attribute", "knockin"]
        names += ["locus"] if self.locus else []
        names += ["read_side", "key_block", "trace_edit", "note_edit"] if self.read_side else []
        if self.train_arms:
            names += ["student_events", "student_attribute", "targets"]
            names += ["select_lambda"] if self.select_lock else []
            names += [f"train_{arm}" for arm in self.train_arms]
            subjects = ["teacher", "untrained", *self.train_arms]
            names += ["las_simulator", *(f"evaluate_{s}" for s in subjects)]
            names += [f"own_heads_{s}" for s in subjects[1:]] if self.own_heads else []
        return names + (["report"] if self.report else [])

    def prepare_config(self) -> PrepareConfig:
        return PrepareConfig(corpus=self.corpus, corpus_name=self.corpus_name, task=self.task, privacy=self.privacy,
                             n_notes=self.n_notes, seed=self.seed, inventory_size=self.inventory_size,
                             codes_per_note=self.codes_per_note,
                             codes_file=self.codes_file, model=self.model)

    def locus_config(self, attribute_run: str = ""):
        """The ``locus`` step on the teacher's ``attribute`` run (its rank split's notes)."""
        return LocusStageConfig(attribute_run=attribute_run, max_mentions=self.locus_max_mentions,
                                compare_suffixes=self.locus_compare_suffixes, stability_splits=self.stability_splits,
                                dtype=self.dtype, device=self.device, seed=self.seed)

    def read_side_configs(self, attribute_run: str = "") -> dict[str, Config]:
        """App. E's steps on the teacher's ``attribute`` run: ``read_side``'s config, and the
        others' given the read side's run id (``key_block`` takes it, the edits the attribute run)."""
        common = dict(dtype=self.dtype, device=self.device, seed=self.seed)
        cap = {"max_events": self.read_side_max_events} if self.read_side_max_events else {}
        return {"read_side": ReadSideConfig(attribute_run=attribute_run, **common),
                "trace_edit": TraceEditConfig(attribute_run=attribute_run, **cap, **common),
                "note_edit": NoteEditConfig(attribute_run=attribute_run, **cap, **common)}

    def key_block_config(self, read_side_run: str):
        cap = {"max_events": self.read_side_max_events} if self.read_side_max_events else {}
        return KeyBlockConfig(read_side_run=read_side_run, dtype=self.dtype, device=self.device, seed=self.seed,
                              **cap)

    def characterize_config(self, prepare_run: str = "") -> CharacterizeConfig:
        return CharacterizeConfig(prepare_run=prepare_run, model=self.model, dtype=self.dtype, device=self.device,
                                  rank_split=self.teacher_split, seed=self.seed, launch=self.launch,
                                  **self.shared_params(CharacterizeConfig))


def require_split_notes(cfg: PipelineConfig, prepare_run: str) -> None:
    """Refuse, before any model step, a ``teacher_split`` (and, when arms train, a
    ``student_split``, ``train_split`` or ``eval_split``) without notes carrying a teacher trace
    in the prepared corpus."""
    prepared = load_prepared(prepare_run)
    splits = [("teacher_split", cfg.teacher_split)]
    if cfg.train_arms:
        splits += [("student_split", cfg.student_split), ("train_split", cfg.train_split),
                   ("eval_split", cfg.eval_split)]
    for field, split in splits:
        stage_notes(prepared, split, field=field)


def corpus_run(ids: dict[str, str]) -> str:
    """The prepared corpus the pipeline's model steps read: the shortlist's when it ran."""
    return ids.get("shortlist", ids["prepare"])


def pipeline_steps(cfg: PipelineConfig, parent: str | None = None, *,
                   on_step: OnStep | None = None) -> dict[str, str]:
    """Every step of the pipeline in order, name -> run id; ``on_step(name, run_id)`` is called as
    each step finishes (or is reused), before the next one starts."""
    corpus_name = corpus_name_of(cfg.corpus, cfg.corpus_name, cfg.task)
    ids = Steps(on_step)
    ids["prepare"] = run_step("prepare", cfg.prepare_config(), corpus_name, launch=cfg.launch, parent=parent)
    if cfg.shortlist:  # every later step reads the shortlisted corpus: its prompts list the shortlist
        ids["shortlist"] = run_step("shortlist", ShortlistConfig(prepare_run=ids["prepare"], seed=cfg.seed),
                                    corpus_name, launch=cfg.launch, parent=parent)
    require_split_notes(cfg, corpus_run(ids))
    ids.record(characterize_steps(cfg.characterize_config(corpus_run(ids)), corpus_name, parent=parent,
                                  on_step=on_step))
    if cfg.locus:
        ids["locus"] = run_step("locus", cfg.locus_config(ids["attribute"]), corpus_name, launch=cfg.launch,
                                parent=parent)
    if cfg.read_side:
        configs = cfg.read_side_configs(ids["attribute"])
        ids["read_side"] = run_step("read_side", configs["read_side"], corpus_name, launch=cfg.launch, parent=parent)
        ids["key_block"] = run_step("key_block", cfg.key_block_config(ids["read_side"]), corpus_name,
                                    launch=cfg.launch, parent=parent)
        for name in ("trace_edit", "note_edit"):
            ids[name] = run_step(name, configs[name], corpus_name, launch=cfg.launch, parent=parent)
    if cfg.train_arms:
        ids.record(distill_steps(cfg, ids, corpus_name, parent, on_step=on_step))
        ids.record(evaluation_steps(cfg, ids, corpus_name, parent, on_step=on_step))
    if cfg.report:
        ids["report"] = run_step("report", ReportConfig(corpus=corpus_name), corpus_name, launch=cfg.launch,
                                 parent=parent)
    return dict(ids)


def evaluation_steps(cfg: PipelineConfig, ids: dict[str, str], corpus_name: str, parent: str | None, *,
                     on_step: OnStep | None = None) -> dict[str, str]:
    """The LAS simulator, then ``evaluate`` of the teacher, the untrained student and every
    trained arm on the test notes, and ``own_heads`` on the untrained student and each arm."""
    data = corpus_run(ids)
    out = Steps(on_step)
    out["las_simulator"] = run_step("las_simulator", LasSimulatorConfig(
        prepare_run=data, model=cfg.las_model, max_steps=cfg.las_max_steps, max_answer_tokens=32, max_val_notes=1,
        max_note_words=cfg.las_max_note_words, seed=cfg.seed, device=cfg.device), corpus_name, launch=cfg.launch,
        parent=parent)
    common = {"prepare_run": data, "split": cfg.eval_split, "max_new_tokens": cfg.eval_max_new_tokens,
              "seed": cfg.seed, "las_run": out["las_simulator"], "device": cfg.device, "dtype": cfg.dtype}
    subjects = [("teacher", {"model": cfg.model, "arm": "teacher"}),
                ("untrained", {"model": cfg.student, "arm": "untrained"})]
    subjects += [(arm, {"train_run": ids[f"train_{arm}"]}) for arm in cfg.train_arms if f"train_{arm}" in ids]
    for name, subject in subjects:
        out[f"evaluate_{name}"] = run_step("evaluate", EvaluateConfig(**common, **subject), corpus_name,
                                           launch=cfg.launch, parent=parent)
    if cfg.own_heads:
        for name, subject in subjects[1:]:
            out[f"own_heads_{name}"] = run_step("own_heads", OwnHeadsConfig(
                prepare_run=data, **{k: v for k, v in subject.items() if k != "arm"},
                max_new_tokens=cfg.eval_max_new_tokens, n_null=cfg.n_null, stability_splits=cfg.stability_splits,
                events_per_phase=cfg.events_per_phase, range_gate=cfg.range_gate, floor_draws=cfg.floor_draws,
                k=(8, 40), device=cfg.device,
                **nominees(cfg),
                dtype=cfg.dtype, seed=cfg.seed, launch=cfg.launch), corpus_name, launch=cfg.launch, parent=parent)
    return dict(out)


def nominees(cfg: NomineeParams) -> dict[str, int]:
    """The exact-patch nominee counts of ``cfg`` (:class:`~mistill.params.NomineeParams`), for a
    step that ranks a student's heads."""
    return {f.name: getattr(cfg, f.name) for f in fields(NomineeParams)}


def distill_steps(cfg: PipelineConfig, ids: dict[str, str], corpus_name: str, parent: str | None, *,
                  on_step: OnStep | None = None) -> dict[str, str]:
    """The untrained student ranked on its own (validation notes), the teacher targets, the arms."""
    data = corpus_run(ids)
    out = Steps(on_step)
    out["student_events"] = run_step("events", EventsConfig(
        prepare_run=data, model=cfg.student, dtype=cfg.dtype, device=cfg.device, split=cfg.student_split,
        n_null=cfg.n_null, seed=cfg.seed), corpus_name, launch=cfg.launch, parent=parent)
    out["student_attribute"] = run_step("attribute", AttributeConfig(
        events_run=out["student_events"], dtype=cfg.dtype, device=cfg.device,
        stability_splits=cfg.stability_splits, seed=cfg.seed, **nominees(cfg)), corpus_name, launch=cfg.launch,
        parent=parent)
    out["targets"] = run_step("targets", TargetsConfig(
        teacher_attribute_run=ids["attribute"], locus_run=ids.get("locus", ""), split=cfg.train_split,
        dtype=cfg.dtype, device=cfg.device),
        corpus_name, launch=cfg.launch, parent=parent)
    overrides = ""
    if cfg.select_lock:  # the pre-registered λ selection; the Mistill arms train with its pick

        out["select_lambda"] = run_step("select_lambda", SelectLambdaConfig(
            lock=cfg.select_lock, prepare_run=data, targets_run=out["targets"],
            student_attribute_run=out["student_attribute"], student=cfg.student, device=cfg.device,
            launch=cfg.launch, train_gradient_checkpointing=cfg.train_gradient_checkpointing),
            corpus_name, launch=cfg.launch, parent=parent)
        m = MlflowClient().get_run(out["select_lambda"]).data.metrics
        overrides = lambda_overrides(m["selected/lambda_p1"], m["selected/lambda_p2"])
    # the probe's cap joins a run's identity only when there is a probe: without one, an arm whose
    # training is the picked cell's is that cell's run (reused, not trained again)
    probe = {"probe_every": cfg.train_probe_every}
    if cfg.train_probe_every:
        probe["probe_max_new_tokens"] = cfg.eval_max_new_tokens
    for arm in cfg.train_arms:
        mistill_arm = resolve_arm(arm).objective == "mistill"
        out[f"train_{arm}"] = run_step("train", TrainStageConfig(
            targets_run=out["targets"], student_attribute_run=out["student_attribute"], student=cfg.student,
            arm=arm, overrides=overrides if mistill_arm else "", seed=cfg.seed, max_steps=cfg.train_max_steps,
            grad_accum=cfg.train_grad_accum, gradient_checkpointing=cfg.train_gradient_checkpointing,
            device=cfg.device, **probe), corpus_name, launch=cfg.launch, parent=parent)
        if mistill_arm and "select_lambda" in out:
            record_arm_model(MlflowClient(), out["select_lambda"], out[f"train_{arm}"])
    return dict(out)


TAG_ARM_MODEL = "mistill.selection.arm_model"
"""On a ``select_lambda`` run: the model the arm alias names after the pipeline trained the arm."""
TAG_ARM_RETRAINED = "mistill.selection.arm_retrained"
"""On a ``select_lambda`` run: why the arm's model is not the picked cell's (the params that differ)."""


def record_arm_model(client: MlflowClient, select_run: str, arm_train_run: str) -> None:
    """Make the selection's records name the model the arm alias names.

    When the arm's train run is the picked cell's (the same identity, so reused), the selection's
    pick tag already names it: ``arm_model`` repeats it. Otherwise the arm was trained again (e.g.
    with a generation probe, or on more notes than the selection's cells), its version carries
    the arm alias, and the ``select_lambda`` run gets ``arm_model`` (that version) and
    ``arm_retrained`` (the params in which the arm's run differs from the cell's), so the two
    records disagree visibly and say why.
    """
    sel = client.get_run(select_run)
    pick_model = sel.data.tags.get(TAG_PICK_MODEL, "")
    arm = client.get_run(arm_train_run)
    name, version = arm.data.tags.get(TAG_REGISTERED_MODEL), arm.data.tags.get(TAG_MODEL_VERSION)
    if not name or not version:
        return
    arm_model = f"models:/{name}/{version}"
    tags = {TAG_ARM_MODEL: arm_model}
    pick_train = sel.data.tags.get(TAG_PICK_TRAIN_RUN, "")
    if arm_model != pick_model and pick_train:
        cell = client.get_run(pick_train).data.params
        differ = sorted(k for k in set(cell) | set(arm.data.params) if cell.get(k) != arm.data.params.get(k))
        tags[TAG_ARM_RETRAINED] = ", ".join(f"{k}: {cell.get(k)} -> {arm.data.params.get(k)}" for k in differ)[:4900]
        _log.info("[pipeline] the arm was trained again: its model %s differs from the picked cell's %s (%s)",
                  arm_model, pick_model, tags[TAG_ARM_RETRAINED])
    for key, value in tags.items():
        client.set_tag(select_run, key, value)


def run_pipeline(cfg: PipelineConfig) -> str:
    """Run (or reuse) every stage under one pipeline run; log the UI address and a summary.

    The pipeline run tags each step's run id (``mistill.step.<name>``) as the step finishes;
    steps it starts carry ``mlflow.parentRunId`` from their start, so the UI nests them. A
    pipeline stopped part-way ends FAILED (an error) or KILLED (SIGTERM, Ctrl-C) with the
    finished steps tagged; rerun, it resumes and reuses them. A second identical invocation
    reuses the finished pipeline run and every step.
    """
    corpus_name = corpus_name_of(cfg.corpus, cfg.corpus_name, cfg.task)
    level = "synthetic" if cfg.corpus == "synthetic" else cfg.privacy
    with StageRun("pipeline", cfg, corpus=corpus_name, guard=PrivacyGuard([], level), resume=True,
                  description=stage_help()["pipeline"],
                  root=mistill_root()) as run:
        if run.reused:
            ids = {k[len(STEP_TAG):]: v for k, v in run.run.data.tags.items() if k.startswith(STEP_TAG)}
            _log.info("[pipeline] reusing finished run %s (%s)", run.run_name, run.run_id)
        else:
            ids = pipeline_steps(cfg, parent=run.run_id, on_step=step_tagger(run, cfg.step_names()))
        _log.info("%s", summary(ids))
        _log.info("%s", headline_table(ids))
        return run.run_id


def step_tagger(run: StageRun, planned: Sequence[str] = ()) -> OnStep:
    """``on_step`` for a pipeline run: tag ``mistill.step.<name>`` on it as each step finishes,
    and log ``step i/N done`` against the ``planned`` steps (:meth:`PipelineConfig.step_names`)."""
    done: list[str] = []

    def tag(name: str, run_id: str) -> None:
        run.set_tags({STEP_TAG + name: run_id})
        done.append(name)
        if planned:
            _log.info("[pipeline] step %d/%d done: %s (%s)", len(done), len(planned), name, run_id)
    return tag


def summary(ids: dict[str, str]) -> str:
    """A short account of the runs: ids, headline metrics, the UI address."""
    client = MlflowClient()
    lines = [f"MLflow UI: {mlflow.get_tracking_uri()}"]
    keys = {"prepare": ("n_notes", "n_codes_inventory", "median_total_tokens"),
            "events": ("events/P1/realized", "events/P2/realized", "events/P2C/realized", "events/NULL/realized",
                       "margin/P1/median"),
            "attribute": ("calib/P1/discoveries_pos", "calib/split_half/discoveries_pos",
                          "selftest/intact/pearson", "selftest/detached/pearson"),
            "knockin": ("P1/k8/recovery/global", "P1/k8/recovery/random", "P1/k8/n_gated", "P1/k8/n_notes",
                        "P2C/k8/recovery/global", "P2C/k8/n_gated", "P2C/k8/n_notes", "P1/k8/necessity/global")}
    keys["locus"] = ("locus/n_mentions", "locus/share_window", "locus/share_inherited",
                     "locus/median_window_distance")
    keys["student_attribute"] = ("calib/P2C/discoveries_pos",)
    keys["targets"] = ("n_notes", "median_rows")
    keys["shortlist"] = ("k", "mean_shortlist_len", "val_recall_completed")
    keys["select_lambda"] = ("selected/lambda_p1", "selected/lambda_p2", "selected/micro_f1")
    keys["las_simulator"] = ("train_loss_first", "train_loss_last")
    keys["report"] = ("n_tables", "n_figures")
    by_prefix = {"train_": ("train/loss", "train/ce", "train/steps"),
                 "evaluate_": ("micro_f1", "valid_rate", "fidelity/ppl_median", "m1/P2C/p_pos"),
                 "own_heads_": ("m4/P1/k8/recovery_own", "m4/P1/k8/recovery_random", "m4/P1/k8/n_gated",
                                "m4/P1/k8/n_notes", "m2/region_lift", "m5/share_window")}
    for step, run_id in ids.items():
        run = client.get_run(run_id)
        exp = client.get_experiment(run.info.experiment_id)
        m = run.data.metrics
        wanted = keys.get(step, next((v for p, v in by_prefix.items() if step.startswith(p)), ()))
        shown = ", ".join(f"{k}={summary_value(k, m)}" for k in wanted if k in m)
        lines.append(f"  {step:<10} {run_id}  {run_url(mlflow.get_tracking_uri(), exp.experiment_id, run_id)}  {shown}")
    return "\n".join(lines)


def summary_value(key: str, m: Mapping[str, float]) -> str:
    """A summary metric as printed: a knock-in recovery (``<phase>/k<k>/recovery/...`` or
    ``m4/<phase>/k<k>/recovery_...``) whose gated events and notes fall below the minimum of
    :mod:`analysis.evidence` shows as "n too small"; any other value to 3 significant digits."""
    parts = key.split("/")
    if "recovery" in key and not key.endswith(("_sd", "_draws")):
        base = "/".join(parts[:3]) if parts[0] == "m4" else "/".join(parts[:2])
        if not support_of(dict(m), f"{base}/n_gated", f"{base}/n_notes").clears():
            return TOO_SMALL
    return f"{m[key]:.3g}"


HEADLINE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("M1 P1", "evaluate", "m1/P1/p_pos"),
    ("M1 P2", "evaluate", "m1/P2/p_pos"),
    ("M1 P2C", "evaluate", "m1/P2C/p_pos"),
    ("rec own", "own_heads", "m4/P1/k8/recovery_own"),
    ("rec random", "own_heads", "m4/P1/k8/recovery_random"),
    ("random floor", "own_heads", "m4/P1/k8/recovery_random_floor_mean"),
    ("micro-F1", "evaluate", "micro_f1"),
    ("valid", "evaluate", "valid_rate"),
)
"""The headline table's columns: header, the run it is read from (the row's ``evaluate`` or
``own_heads`` step) and the metric. The teacher has no ``own_heads`` step: its recovery columns
are read from the ``knockin`` step (:data:`TEACHER_RECOVERY`). ``rec own`` carries the gated
events and notes it rests on (:data:`RECOVERY_SUPPORT`) and shows "n too small" below the minimum
(:mod:`analysis.evidence`); ``rec random`` is the recorded floor (one seeded draw, App. K);
``random floor`` is the mean ± sd over the floor's draws (``floor_draws``)."""

RECOVERY_SUPPORT: dict[str, tuple[str, str]] = {
    "own_heads": ("m4/P1/k8/n_gated", "m4/P1/k8/n_notes"),
    "knockin": ("P1/k8/n_gated", "P1/k8/n_notes")}
"""Per run kind, the metrics counting the gated events and the notes behind the P1, k=8 recovery."""

FLOOR_SPREAD: dict[str, tuple[str, str, str]] = {
    "own_heads": ("m4/P1/k8/recovery_random_floor_mean", "m4/P1/k8/recovery_random_floor_sd",
                  "m4/P1/k8/recovery_random_floor_draws"),
    "knockin": ("P1/k8/recovery/random_floor_mean", "P1/k8/recovery/random_floor_sd",
                "P1/k8/recovery/random_floor_draws")}
"""Per run kind, the random floor's mean, sd and number of draws at P1, k=8."""

TEACHER_RECOVERY: dict[str, str] = {"m4/P1/k8/recovery_own": "P1/k8/recovery/global",
                                    "m4/P1/k8/recovery_random": "P1/k8/recovery/random",
                                    "m4/P1/k8/recovery_random_floor_mean": "P1/k8/recovery/random_floor_mean"}
"""The teacher's recovery columns: the knock-in of its global P1 set at k=8 and of count-matched
random heads."""


def headline_table(ids: dict[str, str], *, min_events: int | None = None, min_notes: int | None = None) -> str:
    """Headline numbers per model: the teacher, the untrained student and each trained arm.

    Per row (``evaluate_<name>`` and ``own_heads_<name>`` of ``ids``; the teacher's recovery from
    ``knockin``): teacher-forced M1 ``p_pos`` at P1, P2, P2C; knock-in recovery at P1, k=8, of the
    model's own heads against random heads; task micro-F1 and valid rate. The heading line says
    which columns are meaningful at the size of these runs (:class:`analysis.report.EvidenceSize`,
    from the ``n_notes`` of the evaluate runs and the ``train/steps`` and ``n_notes`` of the train
    runs): the per-event columns always; the task columns only when the runs are not small. The
    recovery columns are called meaningful only for the rows whose cells rest on at least
    ``min_events`` gated events from ``min_notes`` notes (defaults:
    :data:`analysis.evidence.MIN_GATED_EVENTS`, :data:`~analysis.evidence.MIN_NOTES`); a row
    below shows "n too small" in place of the value, the counts in brackets. A run or metric
    that is absent (or a run the store does not have) shows as ``-``.
    """
    min_events = MIN_GATED_EVENTS if min_events is None else min_events
    min_notes = MIN_NOTES if min_notes is None else min_notes

    client = MlflowClient()
    metrics: dict[str, dict[str, float]] = {}
    tags: dict[str, dict[str, str]] = {}
    for step, run_id in ids.items():
        try:
            data = client.get_run(run_id).data
            metrics[step], tags[step] = dict(data.metrics), dict(data.tags)
        except MlflowException:
            metrics[step], tags[step] = {}, {}

    names = [s[len("evaluate_"):] for s in ids if s.startswith("evaluate_")]
    arms = [n for n in names if n not in ("teacher", "untrained")]
    rows = [("teacher", "teacher"), ("untrained", "untrained student")] + [(a, a) for a in arms]

    def run_metrics(name: str, stage: str) -> tuple[str, dict[str, float]]:
        """The run kind and metrics a row's ``stage`` column is read from."""
        if name == "teacher" and stage == "own_heads":
            return "knockin", metrics.get("knockin", {})
        return stage, metrics.get(f"{stage}_{name}", {})

    def support(name: str) -> Support:
        kind, m = run_metrics(name, "own_heads")
        return support_of(m, *RECOVERY_SUPPORT[kind])

    def cell(name: str, stage: str, key: str) -> str:
        kind, m = run_metrics(name, stage)
        if key == "m4/P1/k8/recovery_random_floor_mean":
            mean, sd, draws = FLOOR_SPREAD[kind]
            return floor_cell(m.get(mean), m.get(sd), m.get(draws))
        value = m.get(TEACHER_RECOVERY[key] if kind == "knockin" else key)
        if key == "m4/P1/k8/recovery_own":
            return readout_cell(value, support(name), min_events=min_events, min_notes=min_notes)
        if key == "m4/P1/k8/recovery_random":
            return readout_cell(value, support(name), min_events=min_events, min_notes=min_notes, counts=False)
        return value_text(value)

    def ints(steps: list[str], key: str) -> tuple[int, ...]:
        return tuple(sorted({int(metrics[s][key]) for s in steps if key in metrics[s]}))

    trains = [s for s in ids if s.startswith("train_")]
    tested = ints([s for s in ids if s.startswith("evaluate_")], "n_notes")
    size = EvidenceSize(tested[-1] if tested else None, ints(trains, "train/steps"),
                        ints(trains, "n_notes"))
    per_event = "M1 P1/P2/P2C"
    task = "micro-F1, valid"
    shown = [(name, label) for name, label in rows if cell(name, "own_heads", "m4/P1/k8/recovery_own") != "-"]
    clear = [label for name, label in shown if support(name).clears(min_events, min_notes)]
    short = [label for name, label in shown if not support(name).clears(min_events, min_notes)]
    minimum = f"at least {min_events} gated events from {min_notes} notes"
    if not short:
        per_event += ", rec own vs rec random"
        recovery = ""
    elif clear:
        recovery = (f" rec own vs rec random: meaningful only for {', '.join(clear)}; "
                    f"n too small for {', '.join(short)} (a cell needs {minimum}).")
    else:
        recovery = f" rec own vs rec random: meaningful for no row, n too small (a cell needs {minimum})."
    if size.small:
        heading = (f"Headline numbers. MEANINGFUL at this size (measured per event): {per_event}.{recovery} "
                   f"NOT MEANINGFUL at this size: {task} ({size.task_basis()}).")
    else:
        heading = (f"Headline numbers. Measured per event: {per_event}.{recovery} Task: {task} "
                   f"({size.task_basis()}).")
    header = ["model", *(c[0] for c in HEADLINE_COLUMNS), "sampled by"]
    body = [[label, *(cell(name, stage, key) for _, stage, key in HEADLINE_COLUMNS),
             tags.get(f"evaluate_{name}", {}).get(TAG_BACKEND, "-")] for name, label in rows]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  " + "  ".join(v.ljust(widths[0]) if i == 0 else v.rjust(widths[i])
                                for i, v in enumerate(r))

    legend = ("  M1: share of events with margin > 0, teacher-forced (evaluate run). rec own / rec random: "
              "knock-in recovery at P1, k=8, of the model's own top heads / of random heads, one seeded draw "
              "(own_heads run; teacher: its global set, knockin run); in brackets the gated events / notes "
              f"behind it; 'n too small': fewer than {min_events} gated events or {min_notes} notes. "
              "random floor: mean ± sd over the floor's seeded draws (each a median over notes). "
              "sampled by: the backend that generated the evaluate run's answers (hf or vllm). "
              "-: no such run or metric.")
    return "\n".join([heading, line(header), *(line(r) for r in body), legend])
