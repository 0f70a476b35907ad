"""Every MLflow entry point: its config class, its run function, and its input runs.

``MLproject`` is generated from this table (``python -m mistill.stages.mlproject``), so the
entry points, their typed parameters and their defaults cannot drift from the code; the command
line of every stage (:mod:`mistill.stages.cli`) is generated from it too.

Each stage's input runs are required unless listed as optional: a required one left empty is
refused by the command line before any run is created (:meth:`Stage.check_inputs`). Optional
inputs are those a stage can run without: ``train``'s ``student_attribute_run`` (Mistill arms
refuse its absence themselves, before their run starts), ``evaluate``'s and ``own_heads``'
``train_run`` (a plain ``model`` instead), ``evaluate``'s ``las_run`` (no LAS), ``targets``'
``locus_run`` (the P1 window rows then fall back to the emission pool, tagged as a deviation), and
``select_lambda``'s ``student_attribute_run`` (only the lock's arm knows whether it needs one).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mistill.config import Config
from mistill.errors import MistillInputError


@dataclass(frozen=True)
class Stage:
    """One entry point. ``inputs`` maps a lineage name to the config field holding that run id.

    optional: lineage names that may be left empty (every other input is required).
    sources: the stage whose run an input names, where it is not the lineage name itself
        (``teacher_attribute`` -> ``attribute``).
    also: further stages whose runs an input takes, read for what they point at
        (``flip_test``'s ``mask_heads``: an ``own_heads`` run, for the attribute run of its ranking).
    stands_for: the stage whose runs this stage's runs can replace as an input
        (``shortlist`` and ``generate`` write a prepared corpus: use them as ``prepare_run``).
    shardable: ``torchrun`` / ``accelerate launch`` may share the stage's work among processes
        (a pass's independent notes, :mod:`mistill.stages.runner`; a training batch's examples,
        :mod:`mistill.distill.trainer`); its entry point takes ``launcher`` and ``nproc``.
    models: the config fields naming a model the stage loads (a spec of
        :mod:`mistill.models.loading`); files: the config fields naming a file it reads. Both are
        checked before the stage's run is created (:func:`mistill.stages.runner.preflight`), as
        are the runs every ``*_run`` / ``*_runs`` field names.
    """

    name: str
    config: type[Config]
    run: Callable[[Config], str]
    inputs: dict[str, str]
    help: str
    optional: frozenset[str] = frozenset()
    sources: Mapping[str, str] = field(default_factory=dict)
    stands_for: str = ""
    shardable: bool = False
    models: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    also: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def input_runs(self, cfg: Config) -> dict[str, str]:
        """Lineage of a config: the input runs it names (optional inputs left empty are omitted)."""
        return {name: getattr(cfg, field) for name, field in self.inputs.items() if getattr(cfg, field)}

    def required_inputs(self) -> dict[str, str]:
        """The inputs the stage cannot run without: lineage name -> config field."""
        return {name: f for name, f in self.inputs.items() if name not in self.optional}

    def input_stage(self, name: str) -> str:
        """The stage whose run the input ``name`` names."""
        return self.sources.get(name, name)

    def input_description(self, name: str) -> str:
        """What the input ``name`` takes, e.g. "the run id of a `targets` run"."""
        source = self.input_stage(name)
        standing = [e.name for e in _TABLE if e.stands_for == source] + list(self.also.get(name, ()))
        also = f" (or of a {' or '.join(f'`{s}`' for s in standing)} run)" if standing else ""
        article = "an" if source[:1] in "aeiou" else "a"
        return f"the run id of {article} `{source}` run{also}"

    def check_inputs(self, cfg: Config) -> None:
        """Refuse a config that leaves a required input run empty, naming the field and the
        stage whose run it takes. Needs no tracking server."""
        for name, f in self.required_inputs().items():
            if not getattr(cfg, f):
                raise MistillInputError(f"{f} is required: {self.input_description(name)}", field=f)


@dataclass(frozen=True)
class _Entry:
    """One row of the table: where the stage's config class and run function live."""

    name: str
    module: str
    config: str
    run: str
    inputs: dict[str, str]
    help: str
    optional: frozenset[str] = frozenset()
    sources: Mapping[str, str] = field(default_factory=dict)
    stands_for: str = ""
    shardable: bool = False
    models: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    also: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


_TABLE = (
    _Entry("prepare", "mistill.stages.prepare", "PrepareConfig", "run_prepare", {},
           "inventory, corpus and prompts", models=("model",),
           files=("codes_file", "split_file", "concepts_file", "hierarchy_file", "traces_file")),
    _Entry("shortlist", "mistill.stages.shortlist", "ShortlistConfig", "run_shortlist", {"prepare": "prepare_run"},
           "the retrieved shortlist: a prepared corpus whose prompts list it (use as prepare_run)",
           stands_for="prepare", models=("encoder",)),
    _Entry("generate", "mistill.stages.generate", "GenerateConfig", "run_generate", {"prepare": "prepare_run"},
           "a model's traces under the paper's decoding: flags, rates, a traced corpus (use as prepare_run)",
           stands_for="prepare", shardable=True, models=("model",)),
    _Entry("flip_cohort", "mistill.stages.flip_cohort", "FlipCohortConfig", "run_flip_cohort",
           {"prepare": "prepare_run"},
           "the evidence-flip cohort (App. N.2): a locked seeded draw, the author's edit proposals checked, the "
           "reviewer's ledger, the freeze by hash; four condition corpora (use each as prepare_run)",
           stands_for="prepare", models=("model",), files=("lock", "proposals", "ledger")),
    _Entry("flip_test", "mistill.stages.flip_test", "FlipTestConfig", "run_flip_test",
           {"flip_cohort": "cohort_run", "train": "train_run", "mask_heads": "mask_heads_run"},
           "the evidence-flip test (App. N): a checkpoint answers every frozen case N times under each condition, "
           "seeds shared across conditions; D, follow rates, controls (Table 54); with a decode-regime key mask "
           "on nominated heads, the causal half (Table 55)",
           optional=frozenset({"train", "mask_heads"}), sources={"mask_heads": "attribute"},
           also={"mask_heads": ("own_heads",)}, models=("model",)),
    _Entry("audit_frame", "mistill.stages.audit_frame", "AuditFrameConfig", "run_audit_frame", {"events": "events_run"},
           "the audit of contrastive events (App. C, Table 5): eight strata, a seeded stratified draw and a blinded "
           "sheet kept local for the reader (the labels go to report -P audit_labels)"),
    _Entry("events", "mistill.stages.characterize", "EventsConfig", "run_events", {"prepare": "prepare_run"},
           "decision events per note, realized in the model's tokenizer, and the margin audit", shardable=True,
           models=("model",)),
    _Entry("attribute", "mistill.stages.characterize", "AttributeConfig", "run_attribute",
           {"events": "events_run"}, "attribution pass, exact patches, calibration and global head sets",
           shardable=True),
    _Entry("knockin", "mistill.stages.characterize", "KnockinStageConfig", "run_knockin",
           {"attribute": "attribute_run", "sets": "sets_run"},
           "necessity and knock-in of the global sets against controls (another attribute run's sets with "
           "sets_run)", optional=frozenset({"sets"}), sources={"sets": "attribute"}, shardable=True),
    _Entry("read_side", "mistill.stages.readside", "ReadSideConfig", "run_read_side",
           {"attribute": "attribute_run", "sets": "sets_run"},
           "what the decision heads read: a panel's attention split over 15 key categories, region lift, "
           "n_eff, r, head families (Tables 16-19); with sets_run, another attribute run's frozen ranking "
           "read on these notes (App. P)", optional=frozenset({"sets"}), sources={"sets": "attribute"}, shardable=True),
    _Entry("key_block", "mistill.stages.keyblock", "KeyBlockConfig", "run_key_block", {"read_side": "read_side_run"},
           "named heads blocked from the keys they read at the decision token against matched control keys "
           "(Table 20)", shardable=True),
    _Entry("trace_edit", "mistill.stages.edits", "TraceEditConfig", "run_trace_edit", {"attribute": "attribute_run"},
           "the earlier near-miss mention replaced by a filler or another code at contrastive events, the margin "
           "re-read at the decision, mediation by the top contrastive heads (Tables 21-22)", shardable=True),
    _Entry("note_edit", "mistill.stages.edits", "NoteEditConfig", "run_note_edit", {"attribute": "attribute_run"},
           "the note's words that distinguish the emitted code from its sibling replaced by fillers, against "
           "matched control words, the margin re-read at contrastive decisions (Table 23)", shardable=True),
    _Entry("locus", "mistill.stages.locus", "LocusStageConfig", "run_locus", {"attribute": "attribute_run"},
           "the forcing probe's locus per chapter mention, the prose-time set, passes A/B, "
           "follow-through and residual swap", shardable=True),
    _Entry("targets", "mistill.stages.distill", "TargetsConfig", "run_targets",
           {"teacher_attribute": "teacher_attribute_run", "events": "events_run", "locus": "locus_run",
            "sets": "sets_run"},
           "the teacher's targets on the training notes: top-32, pooled bucket rows, m and c (pools from "
           "another attribute run's ranking with sets_run; then the training notes' events_run suffices)",
           optional=frozenset({"teacher_attribute", "events", "locus", "sets"}),
           sources={"teacher_attribute": "attribute", "sets": "attribute"},
           shardable=True),
    _Entry("train", "mistill.stages.distill", "TrainStageConfig", "run_train",
           {"targets": "targets_run", "student_attribute": "student_attribute_run"},
           "one arm at one seed with the shared recipe; the checkpoint registered per arm and seed",
           optional=frozenset({"student_attribute"}), sources={"student_attribute": "attribute"}, shardable=True,
           models=("student",)),
    _Entry("evaluate", "mistill.stages.evaluate", "EvaluateConfig", "run_evaluate",
           {"prepare": "prepare_run", "train": "train_run", "las": "las_run"},
           "a model or trained arm on a split: predictions, task metrics, fidelity (PPL, BLEU-4, LAS), M1",
           optional=frozenset({"train", "las"}), sources={"las": "las_simulator"}, shardable=True,
           models=("model",)),
    _Entry("las_simulator", "mistill.stages.las", "LasSimulatorConfig", "run_las_simulator",
           {"prepare": "prepare_run"},
           "the frozen LAS simulator: fine-tuned once on the teacher's traces (note + rationale, note alone)",
           models=("model",)),
    _Entry("own_heads", "mistill.stages.own_heads", "OwnHeadsConfig", "run_own_heads",
           {"prepare": "prepare_run", "train": "train_run"},
           "mechanism readouts on an arm's own heads (M4 knock-in and floors, M2, M3, prefix share; own traces)",
           optional=frozenset({"train"}), shardable=True, models=("model",)),
    _Entry("select_lambda", "mistill.stages.select_lambda", "SelectLambdaConfig", "run_select_lambda",
           {"prepare": "prepare_run", "targets": "targets_run", "student_attribute": "student_attribute_run"},
           "pre-registered λ selection: a locked grid on Optuna, each cell trained and evaluated once",
           optional=frozenset({"student_attribute"}), sources={"student_attribute": "attribute"},
           models=("student",), files=("lock",)),
    _Entry("characterize", "mistill.stages.workflow", "CharacterizeConfig", "run_characterize",
           {"prepare": "prepare_run"}, "events -> attribute -> knockin, reusing identical finished runs",
           models=("model",)),
    _Entry("pipeline", "mistill.stages.workflow", "PipelineConfig", "run_pipeline", {},
           "the whole platform on one corpus: prepare, then every stage that exists",
           models=("model", "student", "las_model"), files=("codes_file", "select_lock")),
    _Entry("reproduce", "mistill.stages.reproduce", "ReproduceConfig", "run_reproduce", {},
           "the paper's run trees on local models and data, each a parent run of its nested, reused steps; "
           "a dry run (the default when a path is missing) prints the plan and its GPU-hours"),
    _Entry("report", "mistill.stages.report", "ReportConfig", "run_report", {},
           "the paper's tables and figures from the tracking store, paired note-level tests",
           files=("audit_labels",)),
    _Entry("verify", "mistill.stages.verify", "VerifyConfig", "run_verify", {},
           "the reproduced numbers against the values the paper expects (Appendix Q): agrees, differs, "
           "not run or no readout"),
)


def stage_help() -> dict[str, str]:
    """Every stage's one-line help, in pipeline order, without importing any stage module."""
    return {e.name: e.help for e in _TABLE}


def _stage(entry: _Entry) -> Stage:
    module = importlib.import_module(entry.module)
    return Stage(entry.name, getattr(module, entry.config), getattr(module, entry.run), dict(entry.inputs),
                 entry.help, optional=entry.optional, sources=dict(entry.sources), stands_for=entry.stands_for,
                 shardable=entry.shardable, models=entry.models, files=entry.files, also=dict(entry.also))


def stage(name: str) -> Stage:
    """One stage, importing only its own module."""
    entries = {e.name: e for e in _TABLE}
    if name not in entries:
        raise KeyError(name)
    return _stage(entries[name])


def stages() -> dict[str, Stage]:
    """Every stage, in pipeline order."""
    return {e.name: _stage(e) for e in _TABLE}
