"""The distillation stages: ``targets`` (the teacher side, once) and ``train`` (one arm, one seed).

``targets`` writes per note ``notes/<note_id>/targets.npz`` (the teacher's top-k next-token ids
and log-probs at every trace position, pooled rows, ``m``, ``c``) and ``targets_manifest.json``
(each array's name, shape, dtype and sha256). The top-k arrays are model text: for a restricted
corpus ``targets.npz`` is a local file of the run's enclave (tag ``mistill.enclave_dir``), never
uploaded, and ``train`` reads it there (:class:`~mistill.stages.common.RunReader`), so a
restricted arm trains on the machine that computed its targets. DistiLLM-2's dispreferred student
generations are never logged either (for a restricted corpus: local files of the train run).

Every sampler of ``train`` resolves its backend as the other sampling stages do (``auto``: vLLM
where it is installed and the device is CUDA, else HF): the on-policy rollouts and DistiLLM-2's
dispreferred responses (``rollout_backend``, tag ``mistill.rollout_backend``) and the generation
probe (``probe_backend``, tag ``mistill.probe_backend``), whose vLLM engine is built once per run
and given the student's current weights at each probe (:func:`_probe_step`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from mlflow.entities import Param
from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.deviations import arm_conventions, deviations_in
from mistill.distill.arms import ON_POLICY_OBJECTIVES, PRECISIONS, ArmConfig, arm_digest, resolve_arm
from mistill.distill.cpu_bf16 import uses_fp32_gemms
from mistill.distill.gold import capped_completion, padded_tokenizer, train_gold
from mistill.distill.note_data import NoteData, build_note_data
from mistill.distill.objective import (align_trace_rows, compute_note_targets, distillm2_step, feature_kd_step,
                                       make_feature_kd, micro_step_loss, pair_rows)
from mistill.distill.onpolicy import RolloutEngine, save_rollout_model, train_opd
from mistill.distill.pools import model_pools
from mistill.distill.rows import coverage_table
from mistill.distill.targets import load_targets, targets_manifest
from mistill.distill.trainer import RecipeConfig, Trainer, prepare_student, training_precision, unsharded_copy
from mistill.distributed import barrier, broadcast, current_world, gather, shard
from mistill.errors import MistillInputError
from mistill.evaluation.backends import BACKENDS, SyncedVLLMBackend, require_vllm, resolve_backend
from mistill.evaluation.generation import DecodingConfig, note_seed
from mistill.evaluation.probe import GenerationProbe, probe_notes
from mistill.evaluation.sampling import SampleRequest, sample_notes
from mistill.instrument.events import Event
from mistill.io import npz_bytes
from mistill.params import PoolParams, ProbeParams, RecipeParams
from mistill.progress import track
from mistill.stages.characterize import NOTES, check_ranked_heads, events_input, ranking_sets
from mistill.stages.common import (RunReader, load_model, load_tokenizer, make_backend, prepared_note_input,
                                   require_notes)
from mistill.stages.runner import note_loop, notes_written, open_stage, stage_device
from mistill.tasks import task_for
from mistill.tracking import models as reg
from mistill.tracking.enclave import TAG_ENCLAVE_DIR
from mistill.tracking.identity import param_string
from mistill.validation import (check_arm, check_choice, check_device, check_dtype, check_interval, check_model_spec,
                                check_name, check_no_text_fields, check_non_negative, check_not_empty, check_overrides,
                                check_positive, check_run_id, check_seed, fail)

EMBEDDED_STUDENT = "embedded:smollm2-135m@every-other"
TARGETS_FILE = "targets.npz"
TARGETS_MANIFEST = "targets_manifest.json"
DISPREFERRED = "dispreferred"
DISPREFERRED_CHUNK = 16
"""Notes per call of DistiLLM-2's dispreferred generations through the HF backend."""
SAMPLING_OBJECTIVES = (*ON_POLICY_OBJECTIVES, "distillm2")
"""Arms that sample from the student during training: the on-policy rollouts and DistiLLM-2's
dispreferred responses (``rollout_backend`` chooses their engine)."""
"""Notes per batched generation call of DistiLLM-2's dispreferred responses; each call's
records are written when it returns (a crash loses at most one call)."""
TAG_DEVIATION = "mistill.deviation"
"""Tag of a run that departs from the paper's procedure: a comma-separated, sorted list of
deviation codes (one per departure)."""
DEVIATION_P1_WINDOW_EMISSION = "p1_window_pool=emission"
"""The teacher's P1 window rows are pooled over its P1 (emission) set, where the paper pools them
over the teacher's prose-time set (App. I.1, "The window, and its asymmetry."): no ``locus`` run
was given to ``targets`` (``locus_run``), or the one given has no prose-time set (none of its
chapter mentions had a locus to attribute)."""
DEVIATION_ROLLOUT_HF = "rollout_backend=hf"
"""An on-policy arm (OPD, GOLD) sampled its rollouts with transformers' generation inside TRL's
trainer, where the paper colocated a vLLM rollout engine with the trainer (App. J.3):
``rollout_backend`` was ``hf``, or ``auto`` on a machine without vLLM or a CUDA device."""
TAG_ROLLOUT_BACKEND = "mistill.rollout_backend"
"""Tag of a train run whose arm samples the student (:data:`SAMPLING_OBJECTIVES`): the engine
that drew from it (``hf`` or ``vllm``; ``rollout_backend=auto`` resolved)."""
ROLLOUT_MODEL = "rollout_model"
"""The train run's work-dir folder holding the student TRL's colocated vLLM engine is built
from (removed after training)."""
TAG_PROBE_BACKEND = "mistill.probe_backend"
"""Tag of a train run with a generation probe (``probe_every``): what sampled the probe notes
(``hf`` or ``vllm``; ``probe_backend=auto`` resolved)."""
PROBE_ENGINE = "probe_engine"
"""The train run's work-dir folder of the generation probe's vLLM engine: the student it is
built from and the weights it is given at each probe (removed when training ends)."""


def _read_events(reader: RunReader, note_id: str) -> list[Event]:
    path = reader.note_file(NOTES, note_id, "events.jsonl")
    return [Event.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line]


@dataclass(frozen=True)
class TargetsConfig(Config, PoolParams):
    """The teacher's targets on the training notes (App. I.5): computed once, no online teacher.

    split: the training notes among the events run's notes (empty: all of them).
    locus_run: the teacher's ``locus`` run, whose prose-time set pools the P1 window rows (App.
        I.1); **[recon]** when empty the window rows are pooled over the P1 emission set and the
        run is tagged ``mistill.deviation`` (the paper has no such fallback).
    window: rows before each P1 event (>= 0); top_k: next-token entries kept per row (>= 1).
    sets_run: another ``attribute`` run of the teacher whose rankings give its pools (empty:
        ``teacher_attribute_run``'s own): a ranking frozen on other inputs (App. P's pilot ranks
        the teacher on the screen's development batches and reads its targets on the training
        problems' traces).
    events_run: with ``sets_run``, the teacher's ``events`` run of the training notes in place of
        ``teacher_attribute_run`` (give one of the two): the pools come from the frozen ranking,
        so the training notes need their events only, not an attribution.
    """

    teacher_attribute_run: str = ""
    events_run: str = ""
    locus_run: str = ""
    sets_run: str = ""
    split: str = "train"
    window: int = 8
    top_k: int = 32
    dtype: str = "float32"
    device: str = "cpu"

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.teacher_attribute_run, "teacher_attribute_run")
        check_run_id(self.events_run, "events_run")
        check_run_id(self.locus_run, "locus_run")
        check_run_id(self.sets_run, "sets_run")
        if self.teacher_attribute_run and self.events_run:
            fail("give one of teacher_attribute_run and events_run, not both", "teacher_attribute_run")
        if self.events_run and not self.sets_run:
            fail("events_run needs sets_run: without an attribution of these notes the pools come from a frozen "
                 "ranking", "events_run")
        check_name(self.split, "split", "a split", allow_empty=True)
        check_non_negative(self.window, "window", "0: no window rows")
        check_positive(self.top_k, "top_k")
        check_dtype(self.dtype)
        check_device(self.device)


def prose_time_sets(locus_run: str) -> dict | None:
    """A ``locus`` run's prose-time set in the per-phase head-set format, under the key ``P1``
    (what :func:`mistill.distill.pools.model_pools` reads as ``window_head_sets``); None when the
    run has none (no chapter mention of its notes had a locus whose window could be attributed)."""
    reader = RunReader(locus_run, field="locus_run")
    if reader.tags.get("mistill.stage") != "locus":
        raise MistillInputError(f"run {locus_run} is a {reader.tags.get('mistill.stage')!r} run, not locus",
                                field="locus_run")
    doc = json.loads(reader.file("head_sets.json").read_text())
    if "prose_time" not in doc:
        return None
    return {"meta": doc.get("meta", {}), "P1": doc["prose_time"]}


def targets_events_run(targets_config: Mapping[str, object]) -> str:
    """The teacher's ``events`` run a ``targets`` run read (its config: ``events_run``, or the
    events of its ``teacher_attribute_run``)."""
    if targets_config.get("events_run"):
        return str(targets_config["events_run"])
    if not targets_config.get("teacher_attribute_run"):
        raise MistillInputError("the targets need the teacher's attribute run of the training notes "
                                "(teacher_attribute_run), or their events run with sets_run",
                                field="teacher_attribute_run")
    att = RunReader(str(targets_config["teacher_attribute_run"]), field="teacher_attribute_run")
    return att.config["events_run"]


def run_targets(cfg: TargetsConfig) -> str:
    ev = events_input(targets_events_run(dataclasses.asdict(cfg)))
    prepared = ev.prepared
    notes = require_notes([n for n in ev.notes if not cfg.split or n.split == cfg.split], cfg.split, prepared)
    source = {"teacher_attribute": cfg.teacher_attribute_run} if cfg.teacher_attribute_run else \
        {"events": cfg.events_run}
    inputs = {**source, **({"locus": cfg.locus_run} if cfg.locus_run else {}),
              **({"sets": cfg.sets_run} if cfg.sets_run else {})}
    with open_stage("targets", cfg, prepared, inputs=inputs, model=ev.model) as run:
        if run.reused:
            return run.run_id
        guard = run.guard
        lm = load_model(ev.model, dtype=cfg.dtype, device=stage_device(cfg.device))
        head_sets = ranking_sets(cfg.teacher_attribute_run, cfg.sets_run)
        if cfg.sets_run:
            check_ranked_heads(head_sets, lm.geometry.head_names(), "sets_run")
        window_sets = prose_time_sets(cfg.locus_run) if cfg.locus_run else None
        pools = model_pools(head_sets, lm.geometry.head_names(), k=cfg.pool_k, window_head_sets=window_sets,
                            phases=task_for(prepared.inventory).phases)
        if current_world().leader:
            run.log_json("teacher_pools.json", {k: p.to_dict() for k, p in pools.items()})
            if cfg.window > 0 and window_sets is None:
                _mark_deviations(run, (DEVIATION_P1_WINDOW_EMISSION,), "targets")
        n_rows = []
        for note in note_loop(run, NOTES, notes, desc="targets"):
            nd = build_note_data(note, prepared.inventory, lm.tokenizer, _read_events(ev.reader, note.note_id),
                                 **prepared.prompt_settings)
            targets = compute_note_targets(lm, nd, pools, window=cfg.window, top_k=cfg.top_k)
            n_rows.append(len(targets["rows_pos"]))
            files, local = _targets_files(targets, guard.allows_text)
            run.write_note(NOTES, note.note_id, files, local_files=local)
        n_rows = [n for part in gather(n_rows, current_world()) for n in part]
        if not notes_written(run, NOTES, notes):
            return run.run_id
        run.log_metrics({"n_notes": len(notes), **({"median_rows": float(np.median(n_rows))} if n_rows else {})})
        run.set_tags({"mistill.teacher": ev.model, "mistill.split": cfg.split})
        print(f"targets: {len(notes)} notes -> run {run.run_id}")
        return run.run_id


def _targets_files(targets: dict, allows_text: bool) -> tuple[dict, dict]:
    """One note's files: ``(uploaded, local)``. ``targets.npz`` holds the teacher's top-k ids and
    log-probs at every trace position (model text): uploaded for a synthetic or public corpus,
    kept in the run's local enclave for a restricted one. ``targets_manifest.json`` (names,
    shapes, dtypes, sha256) is uploaded for every corpus."""
    blob = {TARGETS_FILE: npz_bytes(targets)}
    files = {TARGETS_MANIFEST: targets_manifest(targets)}
    if allows_text:
        return {**blob, **files}, {}
    return files, blob


def _check_targets(reader: RunReader, notes) -> None:
    """Every training note's targets are readable here and unchanged (sha256 against ``_DONE``):
    refused before the train run starts (a restricted run's targets live only in its enclave)."""
    for note in notes:
        reader.note_file(NOTES, note.note_id, TARGETS_FILE)


@dataclass(frozen=True)
class TrainStageConfig(Config, RecipeParams, ProbeParams):
    """One arm at one seed (App. J.2 recipe).

    arm: a bare arm name (letters, digits, ``-``, ``_``) of ``projects/configs/arms/``, or an
        explicit path to an arm file ending in ``.yaml`` / ``.yml`` (absolute, or relative to the
        working directory), whose content then joins the run's identity (param ``arm_sha256``);
        anything else is refused (see :mod:`mistill.distill.arms`).
    overrides: ``key=value,...`` on the arm's flags (``lambda_p1=0.03``; ``terms=a+b`` for lists).
    precision: ``bf16`` or ``fp32``; empty keeps the arm's.
    rollout_backend: how the arms that sample the student during training draw from it (the
        on-policy rollouts of OPD and GOLD, DistiLLM-2's dispreferred responses): ``auto``
        (vLLM where it is installed and the device is CUDA, else ``hf``), ``hf`` (transformers'
        generation: inside TRL's trainer, or batched for DistiLLM-2) or ``vllm`` (TRL's colocated
        engine, as the paper ran OPD; for DistiLLM-2 an engine beside the loaded models, shut down
        before the first step; refused without vLLM or off a CUDA device). The run records the
        engine (tag ``mistill.rollout_backend``); an on-policy arm with ``hf`` also records its
        deviation from the paper (tag ``mistill.deviation``, and in ``config.json``'s ``deviations``).
    rollout_gpu_memory: **[recon]** the share of the GPU's memory, in (0, 1), that TRL's
        colocated vLLM engine may take (its copy of the student, activations, key/value cache);
        the trainer keeps the rest (see :data:`mistill.distill.onpolicy.ROLLOUT_GPU_MEMORY`).
    register: register the checkpoint (an MLflow Model, artifact path ``model``) as a version of
        ``mistill-<corpus>-<student>`` with the arm alias ``<arm>-s<seed>``, or, for a λ-selection
        cell, the cell alias ``<arm>-l<λ>-s<seed>`` (see :mod:`mistill.tracking.models`).
    train_notes: how many of the targets run's training notes the run trains on (0 = every one),
        chosen by :func:`train_note_ids` (**[recon]**: the paper does not say how App. I.3's 100
        were drawn) with ``train_notes_seed``. App. I.3's λ selection and its Vanilla CoT-KD
        reference train on 100. A count above the split's size is refused before the run starts.
    train_notes_seed: **[recon]** the seed of that draw (independent of ``seed``, so the three seeds of a
        confirmation train on the same notes). Both are part of the run's identity; the run
        records the chosen ids and their sha256 in ``train_notes.json`` and in ``config.json``
        (``train_notes``), and the sha256 as the param ``train_notes.sha256``.

    The run logs every resolved arm flag as a param ``arm.<flag>`` (:func:`arm_params`) and, per
    optimizer step, ``train/loss`` (the arm's whole objective) beside its terms (``train/ce``,
    ``train/kl``, ...) and the step's cost (``train/step_seconds``, ``train/step_notes`` and, on
    CUDA, ``train/peak_memory_gib``: :func:`mistill.distill.trainer.step_cost`); with ``probe_every``, the generation probe's ``probe/*`` metrics at its
    steps, the tag ``mistill.probe_flagged`` once a probe is flagged
    (:mod:`mistill.evaluation.probe`) and the tag ``mistill.probe_backend`` (what sampled the
    probe: ``probe_backend`` resolved, see :func:`resolve_probe_backend`). A vLLM probe engine
    takes ``rollout_gpu_memory`` of the GPU, like the other engines of the stage.
    """

    targets_run: str = ""
    student_attribute_run: str = ""
    student: str = EMBEDDED_STUDENT
    arm: str = "mistill"
    overrides: str = ""
    seed: int = 0
    precision: str = ""
    logits_chunk: int = 1024
    dispreferred_max_new_tokens: int = 16384
    rollout_backend: str = "auto"
    rollout_gpu_memory: float = 0.2
    device: str = "cpu"
    register: bool = True
    train_notes: int = 0
    train_notes_seed: int = 0

    def arm_overrides(self) -> str:
        """``overrides`` with ``precision`` appended when it is set."""
        return self.overrides + (f",precision={self.precision}" if self.precision else "")

    def recipe(self, precision: str, epochs: int = 0) -> RecipeConfig:
        """The trainer's recipe: this config's recipe fields and seed, at the arm's ``precision``
        and, when it sets them (``epochs > 0``), the arm's epochs."""
        recipe = RecipeConfig(seed=self.seed, precision=precision, **self.shared_params(RecipeConfig))
        return recipe.replace(epochs=epochs) if epochs else recipe

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.targets_run, "targets_run")
        check_run_id(self.student_attribute_run, "student_attribute_run")
        check_model_spec(self.student, "student")
        check_arm(self.arm, "arm")
        check_overrides(self.overrides, "overrides", [f.name for f in dataclasses.fields(ArmConfig)])
        check_choice(self.precision, ("", *PRECISIONS), "precision")
        check_not_empty(self.student, "student", "a model spec")
        resolve_arm(self.arm, self.arm_overrides())  # the arm name, its file and every flag
        check_seed(self.seed)
        check_positive(self.logits_chunk, "logits_chunk")
        check_positive(self.dispreferred_max_new_tokens, "dispreferred_max_new_tokens")
        check_choice(self.rollout_backend, BACKENDS, "rollout_backend")
        check_interval(self.rollout_gpu_memory, "rollout_gpu_memory", low_open=True, high_open=True)
        check_device(self.device)
        check_non_negative(self.train_notes, "train_notes", "0: every training note")
        check_seed(self.train_notes_seed, "train_notes_seed")

    def content_digests(self) -> dict[str, str]:
        """The content of an arm given by explicit path (the repository's arms are covered by
        the code version)."""
        digest = arm_digest(self.arm)
        return {"arm": digest} if digest else {}


TRAIN_NOTES_FILE = "train_notes.json"
TRAIN_NOTES_RULE = "sorted ids, numpy default_rng(seed).permutation, first n"
"""The rule of :func:`train_note_ids`, in words (recorded in ``train_notes.json``)."""


def train_note_ids(note_ids: Sequence[str], n: int, seed: int) -> list[str]:
    """The ``n`` training notes a run trains on (``train_notes``, ``train_notes_seed``), sorted.

    The rule: the ids sorted (as strings), permuted by ``numpy.random.default_rng(seed)
    .permutation``, and the first ``n`` positions kept; ``n = 0`` keeps every id. Note ids are
    unique, so there are no ties. For one seed the draws are nested: the first 100 of the
    permutation are among the first 250. **[recon]**: the paper trains App. I.3's selection and
    its Vanilla CoT-KD reference on "the same 100 notes" without saying how they were chosen.
    The λ selection (``training.train_notes`` of a lock) and a plain ``train`` run reach the same
    notes through this one function.

    Raises:
        MistillInputError: ``n`` is negative or exceeds the number of ids (field
            ``train_notes``), or an id repeats.
    """
    ids = sorted(str(i) for i in note_ids)
    if len(set(ids)) != len(ids):
        raise MistillInputError("the training notes' ids repeat", field="train_notes")
    if n < 0:
        raise MistillInputError(f"train_notes must be >= 0 (0: every training note), got {n}", field="train_notes")
    if n == 0:
        return ids
    if n > len(ids):
        raise MistillInputError(f"train_notes = {n} exceeds the {len(ids)} notes of the training split "
                                "(0: every training note)", field="train_notes")
    order = np.random.default_rng(seed).permutation(len(ids))
    return sorted(ids[i] for i in order[:n])


def train_notes_record(chosen: Sequence[str], n: int, seed: int, n_split: int) -> dict:
    """What a train run records of its notes: the count and seed asked, the split's size, the
    rule, the chosen ids (sorted) and their sha256 (over the ids joined by newlines)."""
    ids = sorted(chosen)
    digest = hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()
    return {"n": n, "seed": seed, "n_split": n_split, "n_chosen": len(ids), "rule": TRAIN_NOTES_RULE,
            "sha256": digest, "note_ids": ids}


def train_deviations(arm: ArmConfig, targets_config: Mapping, targets_tags: Mapping[str, str] | None = None, *,
                     rollout_backend: str = "") -> tuple[str, ...]:
    """The deviation codes of a train run of ``arm`` on targets computed with ``targets_config``
    (the targets run's ``config.json``; ``targets_tags``: its tags), sorted.

    ``p1_window_pool=emission``: a Mistill arm that supervises P1 window rows (``window > 0`` in
    both the arm and the targets, ``lambda_p1 > 0``) on targets whose teacher window pool fell back
    to the P1 emission pool (no ``locus_run``, or the targets run tagged with the code: its locus
    run had no prose-time set).
    ``rollout_backend=hf``: an on-policy arm whose rollouts come from transformers' generation
    (``rollout_backend``: the engine the run's ``rollout_backend`` resolved to).
    """
    codes = []
    window = min(arm.window, int(targets_config.get("window", TargetsConfig.window)))
    targets_codes = (targets_tags or {}).get(TAG_DEVIATION, "").split(",")
    fell_back = not targets_config.get("locus_run") or DEVIATION_P1_WINDOW_EMISSION in targets_codes
    if arm.objective == "mistill" and window > 0 and arm.lambda_p1 > 0 and fell_back:
        codes.append(DEVIATION_P1_WINDOW_EMISSION)
    if arm.objective in ON_POLICY_OBJECTIVES and rollout_backend == "hf":
        codes.append(DEVIATION_ROLLOUT_HF)
    return tuple(sorted(codes))


def recorded_deviations(cfg: TrainStageConfig, arm: ArmConfig, rollout_backend: str = "") -> list[dict]:
    """The values of this run that differ from the platform's defaults or from the paper's
    (:func:`mistill.deviations.deviations_in`: the arm's flags, e.g. the GOLD run's epoch, cap and
    on-policy fraction, and the stage's parameters), as recorded in ``config.json``.
    ``rollout_backend``: the engine ``cfg.rollout_backend`` resolved to (on-policy arms), checked
    in place of ``auto``."""
    resolved = {"rollout_backend": rollout_backend} if rollout_backend else None
    return (deviations_in("ArmConfig", arm.to_dict()) + arm_conventions(arm.to_dict())
            + deviations_in(type(cfg).__name__, cfg.to_dict(), resolved=resolved))


def _mark_deviations(run, codes: tuple[str, ...], stage: str) -> None:
    """Tag the run with its deviation codes and say so on stderr (nothing when there are none)."""
    if not codes:
        return
    run.set_tags({TAG_DEVIATION: ",".join(codes)})
    for code in codes:
        if code == DEVIATION_P1_WINDOW_EMISSION:
            print(f"{stage}: warning: the teacher's P1 window rows are pooled over its P1 emission set "
                  "(no locus run given as locus_run, or it has no prose-time set); the paper pools them over the "
                  f"prose-time set. Tagged {TAG_DEVIATION}={code}.", file=sys.stderr)
        elif code == DEVIATION_ROLLOUT_HF:
            print(f"{stage}: warning: the student's rollouts come from transformers' generation inside TRL's "
                  "trainer (rollout_backend hf, or auto without vLLM or a CUDA device); the paper colocated a vLLM "
                  f"rollout engine with the trainer. Tagged {TAG_DEVIATION}={code}.", file=sys.stderr)


@dataclass
class _Example:
    student: NoteData
    targets: dict
    pairing: object
    teacher_positions: np.ndarray | None
    teacher: NoteData


def _same_vocab(a, b) -> bool:
    return len(a) == len(b) and a.get_vocab() == b.get_vocab()


def run_train(cfg: TrainStageConfig) -> str:
    arm = resolve_arm(cfg.arm, cfg.arm_overrides())
    targets_run = RunReader(cfg.targets_run, field="targets_run")
    tcfg = targets_run.config
    ev = events_input(targets_events_run(tcfg))
    prepared = ev.prepared
    notes = require_notes([n for n in ev.notes if not tcfg.get("split") or n.split == tcfg["split"]],
                          tcfg.get("split", ""), prepared, field="targets_run")
    chosen = train_notes_record(train_note_ids([n.note_id for n in notes], cfg.train_notes, cfg.train_notes_seed),
                                cfg.train_notes, cfg.train_notes_seed, len(notes))
    kept = set(chosen["note_ids"])
    notes = [n for n in notes if n.note_id in kept]  # in corpus order, as the full split
    if arm.objective == "mistill" and not cfg.student_attribute_run:
        raise MistillInputError("Mistill arms need the student's calibrated ranking (student_attribute_run)",
                                field="student_attribute_run")
    world = current_world()
    if world.distributed and arm.objective == "distillm2":
        raise MistillInputError("the DistiLLM-2 arm trains in one process (its dispreferred generations are "
                                "written before the first step); launch it without torchrun", field="nproc")
    if world.distributed and arm.objective in ON_POLICY_OBJECTIVES:
        raise MistillInputError(f"the {arm.objective.upper()} arm trains in one process (TRL's trainer); launch it "
                                "without torchrun", field="nproc")
    rollout = resolve_rollout_backend(cfg.rollout_backend, stage_device(cfg.device)) \
        if arm.objective in SAMPLING_OBJECTIVES else ""
    probe_backend = resolve_probe_backend(cfg.probe_backend, stage_device(cfg.device), world) \
        if cfg.probe_every else ""
    _check_targets(targets_run, notes)
    inputs = {"targets": cfg.targets_run}
    if cfg.student_attribute_run:
        inputs["student_attribute"] = cfg.student_attribute_run
    # under torchrun every rank trains the same weights on its share of each batch; rank 0 alone
    # writes to the run (its metrics are the sums over the ranks)
    with open_stage("train", cfg, prepared, inputs=inputs, model=cfg.student, arm=cfg.arm,
                    seed=cfg.seed, precision=arm.precision,
                    lam=(arm.lambda_p1, arm.lambda_p2) if arm.objective == "mistill" else None,
                    tags={tag: value for tag, value in ((TAG_ROLLOUT_BACKEND, rollout),
                                                        (TAG_PROBE_BACKEND, probe_backend)) if value} or None,
                    record={"arm": arm.to_dict(), "deviations": recorded_deviations(cfg, arm, rollout),
                            "train_notes": chosen}) as run:
        if run.reused:
            return run.run_id
        guard = run.guard
        leader = world.leader
        if leader:
            run.log_json("arm.json", arm.to_dict())
            run.log_json(TRAIN_NOTES_FILE, chosen)
            _log_train_notes_param(run, chosen["sha256"])
            _log_arm_params(run, arm)
            _mark_deviations(run, train_deviations(arm, tcfg, targets_run.tags, rollout_backend=rollout), "train")
        recipe = cfg.recipe(arm.precision, arm.epochs)
        device = stage_device(cfg.device)
        lm = load_model(cfg.student, dtype="float32", device=device)
        if arm.objective in ON_POLICY_OBJECTIVES:
            steps = _train_on_policy(cfg, arm, recipe, run, ev, notes, lm, device, tcfg, rollout, probe_backend)
            run.log_metrics({"train/steps": steps, "n_notes": len(notes)})
            _save_and_register(run, lm.model, lm.tokenizer, cfg, arm,
                               _Provenance(teacher=ev.model, corpus_digest=prepared.corpus.digest,
                                           n_notes=len(notes), steps=steps))
            print(f"train: {cfg.arm} seed {cfg.seed} ({arm.precision}) -> run {run.run_id}")
            return run.run_id
        pools = {}
        if arm.objective == "mistill":
            s_sets = json.loads(RunReader(cfg.student_attribute_run).file("head_sets.json").read_text())
            pools = model_pools(s_sets, lm.geometry.head_names(), k=arm.pool_k, mode=arm.pool_mode,
                                seed=arm.pool_seed, phases=task_for(prepared.inventory).phases)
            if leader:
                run.log_json("student_pools.json", {k: p.to_dict() for k, p in pools.items()})
        teacher_tok = load_tokenizer(ev.model)
        same = _same_vocab(teacher_tok, lm.tokenizer)
        kl_mode = "kl" if same else "uld"
        examples: list[_Example] = []
        realized_t, realized_s = {}, {}
        for note in notes:
            events = _read_events(ev.reader, note.note_id)
            student = build_note_data(note, prepared.inventory, lm.tokenizer, events,
                                      **prepared.prompt_settings)
            targets = load_targets(targets_run.note_file(NOTES, note.note_id, TARGETS_FILE))
            teacher = build_note_data(note, prepared.inventory, teacher_tok, events,
                                      **prepared.prompt_settings)
            pairing = pair_rows(student, teacher.realized.values(), targets, window=arm.window,
                                teacher_trace_start=int(targets["trace_start"]))
            t_pos = None if same else align_trace_rows(student, teacher, arm.uld_alignment)
            examples.append(_Example(student, targets, pairing, t_pos, teacher))
            realized_t[note.note_id] = list(teacher.realized.values())
            realized_s[note.note_id] = list(student.realized.values())
        # Table 38's structure: teacher events and the share the student's tokenizer realizes
        if leader:
            run.log_table("event_coverage", coverage_table(realized_t, realized_s))
        fkd = None
        teacher_lm = None
        if arm.objective in ("feature_kd", "distillm2"):  # these arms need the teacher online
            teacher_lm = load_model(ev.model, dtype=tcfg.get("dtype", "float32"), device=device)
            teacher_lm.model.requires_grad_(False)
        dispreferred: dict[int, list[int]] = {}
        if arm.objective == "distillm2":
            if not same:
                raise MistillInputError("DistiLLM-2 needs the teacher's vocabulary (no cross-tokenizer path)",
                                        field="student")
            # the untrained student, before any step
            dispreferred = _dispreferred(run, lm, examples, cfg, guard.allows_text, rollout, device)
        model = prepare_student(lm.model, recipe)
        if leader:
            _tag_cpu_kernels(run, model, arm)
        if arm.objective == "feature_kd":  # the layer pairs, the seeded adapter(s)
            fkd = make_feature_kd(teacher_lm, lm, arm, cfg.seed, device=device)
            if leader:
                run.log_json("feature_kd.json", {"layer_pairs": fkd.pairs, "attention_positions": fkd.n_positions,
                                                 "hidden_at_every_trace_position": True,
                                                 "hidden_site": fkd.hidden_site, "adapter": arm.fkd_adapter})

        def micro_step(m, idx):
            ex = examples[idx]
            if arm.objective == "distillm2":
                return distillm2_step(m, lm, teacher_lm, ex.student, dispreferred[idx], chunk=cfg.logits_chunk)
            if fkd is not None:
                return feature_kd_step(m, lm, ex.student, ex.teacher, ex.targets, fkd, arm, seed=cfg.seed,
                                       kl_mode=kl_mode, logits_chunk=cfg.logits_chunk,
                                       teacher_positions=ex.teacher_positions)
            return micro_step_loss(m, lm, ex.student, ex.targets, ex.pairing, pools, arm, kl_mode=kl_mode,
                                   logits_chunk=cfg.logits_chunk, teacher_positions=ex.teacher_positions)

        probe = _probe_step(cfg, prepared, lm, run, world, probe_backend)
        try:
            trainer = Trainer(model, len(examples), recipe, micro_step, state_dir=run.work_dir / "trainer",
                              log=_train_metrics(run) if leader else None,
                              extra_params=fkd.parameters() if fkd else (), world=world, after_step=probe)
            if leader:
                run.set_tags({"mistill.sharding": "fsdp" if trainer.fsdp else "replicate"})
            if broadcast(run.resumed, world) and trainer.load_state():
                print(f"train: resumed at step {trainer.step}")
            trainer.train()
        finally:
            if probe is not None:
                probe.close()  # the probe's engine, also when training fails
        gathered = trainer.full_model_state()  # under FSDP: every rank takes part, rank 0 gets the weights
        barrier(world)
        if not leader:
            return run.run_id
        if gathered is not None:
            model = unsharded_copy(model, gathered)
        run.log_metrics({"train/steps": trainer.step, "n_notes": len(examples)})
        _save_and_register(run, model, lm.tokenizer, cfg, arm,
                           _Provenance(teacher=ev.model, corpus_digest=prepared.corpus.digest,
                                       n_notes=len(examples), steps=trainer.step))
        print(f"train: {cfg.arm} seed {cfg.seed} ({arm.precision}) -> run {run.run_id}")
        return run.run_id


def _check_vllm_rollouts(device: str) -> None:
    """Refuse TRL's colocated vLLM rollouts without vLLM or off a CUDA device."""
    require_vllm("rollout_backend")
    if not str(device).startswith("cuda"):
        raise MistillInputError(f"TRL's colocated vLLM engine runs on a CUDA GPU, not on device {device!r}; use "
                                "rollout_backend 'hf' or 'auto'", field="rollout_backend")


def resolve_rollout_backend(name: str, device: str) -> str:
    """The engine an on-policy arm's rollouts come from on ``device``: ``hf`` or ``vllm``, with
    ``auto`` resolved (:func:`mistill.evaluation.backends.resolve_backend`: ``vllm`` where vLLM
    is installed and ``device`` is a CUDA device this machine has). ``vllm`` asked for by name is
    refused without vLLM or off a CUDA device (:class:`MistillInputError` naming
    ``rollout_backend``)."""
    if name == "vllm":
        _check_vllm_rollouts(device)
    return resolve_backend(name, device)


def resolve_probe_backend(name: str, device: str, world) -> str:
    """What samples the generation probe's notes on ``device``: ``hf`` or ``vllm``, with ``auto``
    resolved as every sampling stage resolves it (:func:`mistill.evaluation.backends.resolve_backend`).
    A run of several processes probes with ``hf`` (each rank samples its share of the notes with
    its copy of the student): ``auto`` is ``hf`` there and ``vllm`` is refused. ``vllm`` needs vLLM
    (its CPU build serves on a machine without CUDA). Raises :class:`MistillInputError` naming
    ``probe_backend``."""
    if world.distributed:
        if name == "vllm":
            raise MistillInputError("a training run of several processes probes with HF (each rank samples its "
                                    "share of the probe notes); use probe_backend 'hf' or 'auto', or launch "
                                    "without torchrun", field="probe_backend")
        return "hf"
    resolved = resolve_backend(name, device)
    if resolved == "vllm":
        require_vllm("probe_backend")
    return resolved


def _train_metrics(run):
    """``log(metrics, step)`` of a trainer: the metrics under ``train/`` at the optimizer step."""
    def log(metrics: dict, step: int) -> None:
        run.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step=step)
    return log


def _tag_cpu_kernels(run, model, arm: ArmConfig) -> None:
    """Tag which matmul kernels a bf16 student ran on the CPU (``mistill.cpu_bf16_matmul``)."""
    if model.device.type == "cpu" and arm.precision == "bf16":
        run.set_tags({"mistill.cpu_bf16_matmul": "fp32" if uses_fp32_gemms(model) else "native"})


def _train_on_policy(cfg: TrainStageConfig, arm: ArmConfig, recipe: RecipeConfig, run, ev, notes, lm, device: str,
                     tcfg: Mapping, rollout: str, probe_backend: str = "hf") -> int:
    """The on-policy arms on TRL's trainers, the teacher online: OPD (:mod:`mistill.distill.onpolicy`)
    on the training notes' shortlist prompts in the student's chat template; GOLD
    (:mod:`mistill.distill.gold`) on the same prompts and, for its off-policy micro-steps, the
    teacher's traces capped at the rollout cap (their count logged as
    ``train/truncated_completions``). Returns the optimizer steps.

    ``rollout``: the engine of the rollouts (:func:`resolve_rollout_backend`). With ``vllm`` the student,
    in the arm's precision, and its tokenizer are written to the work dir's
    :data:`ROLLOUT_MODEL` folder for TRL's colocated engine to build from (taking
    ``cfg.rollout_gpu_memory`` of the GPU), and the folder is removed after training."""

    prepared = ev.prepared
    teacher = load_model(ev.model, dtype=tcfg.get("dtype", "float32"), device=device)
    if arm.objective == "opd" and not _same_vocab(teacher.tokenizer, lm.tokenizer):
        raise MistillInputError("OPD needs the teacher's vocabulary (the cross-tokenizer on-policy arm is GOLD)",
                                field="student")
    teacher.model.requires_grad_(False)
    model = training_precision(lm.model, recipe)
    _tag_cpu_kernels(run, model, arm)
    inputs = [prepared_note_input(prepared, note, lm.tokenizer) for note in notes]
    engine = None
    if rollout == "vllm":
        engine = RolloutEngine(save_rollout_model(model, padded_tokenizer(lm.tokenizer), run.work_dir / ROLLOUT_MODEL),
                               gpu_memory=cfg.rollout_gpu_memory)
    probe = _probe_step(cfg, prepared, lm, run, current_world(), probe_backend)
    common = dict(rollout_cap=arm.rollout_cap, beta=arm.opd_beta, device=device, log=_train_metrics(run),
                  after_step=probe, resume=run.resumed, engine=engine)
    try:
        if arm.objective == "opd":
            return train_opd(model, teacher.model, lm.tokenizer, [ni.prompt.text for ni in inputs], recipe,
                             run.work_dir / "trainer", **common)
        capped = [capped_completion(ni.full_text, ni.offsets, ni.trace_offset, arm.rollout_cap) for ni in inputs]
        run.log_metrics({"train/truncated_completions": sum(cut for _, cut in capped)})
        examples = [(ni.prompt.text, text) for ni, (text, _) in zip(inputs, capped)]
        return train_gold(model, teacher.model, lm.tokenizer, teacher.tokenizer, examples, recipe,
                          run.work_dir / "trainer", on_policy_fraction=arm.on_policy_fraction, hybrid=arm.uld_hybrid,
                          **common)
    finally:
        if probe is not None:
            probe.close()
        if engine is not None:
            shutil.rmtree(engine.model_dir, ignore_errors=True)


def _probe_step(cfg: TrainStageConfig, prepared, lm, run, world, backend: str = "hf"):
    """The trainer's ``after_step`` running the generation probe every ``probe_every`` steps and
    after the last (None without a probe): a :class:`_TrainingProbe`, to be closed when training
    ends. ``backend``: what samples the notes (:func:`resolve_probe_backend`); with ``vllm`` the
    engine is built here, before the first step (:class:`SyncedVLLMBackend`: from the student as
    it is now, in its training dtype, in the work dir's :data:`PROBE_ENGINE` folder, taking
    ``rollout_gpu_memory`` of the GPU, its window the longest probe prompt plus
    ``probe_max_new_tokens``)."""
    if not cfg.probe_every:
        return None
    decoding = DecodingConfig(max_new_tokens=cfg.probe_max_new_tokens)
    notes = probe_notes(prepared, lm.tokenizer, cfg.probe_split, cfg.probe_notes, decoding)
    if not notes:
        raise MistillInputError(f"the corpus has no {cfg.probe_split!r} notes for the generation probe",
                                field="probe_split")
    engine = None
    if backend == "vllm":
        longest = max(len(lm.tokenizer(n.prompt_text, add_special_tokens=False)["input_ids"]) for n in notes)
        engine = SyncedVLLMBackend(lm, run.work_dir / PROBE_ENGINE, decoding,
                                   dtype=str(next(lm.model.parameters()).dtype).removeprefix("torch."),
                                   engine_overrides={"gpu_memory_utilization": cfg.rollout_gpu_memory},
                                   context=longest + cfg.probe_max_new_tokens)
    probe = GenerationProbe(lm, notes, list(prepared.inventory.codes), decoding, cfg.probe_flag_share,
                            backend=engine)
    return _TrainingProbe(cfg.probe_every, probe, run, world)


class _TrainingProbe:
    """The generation probe as the trainer's ``after_step(step, last)``: at every ``every``-th
    step and after the last, the probe notes are dealt over the ranks, rank 0 scores them all
    and logs ``probe/*`` with ``probe/seconds``, the probe's wall time on rank 0 (sampling,
    gathering, scoring; with vLLM the engine's wake-up and weight load included).
    :meth:`close` shuts the probe's engine down (idempotent)."""

    def __init__(self, every: int, probe: GenerationProbe, run, world) -> None:
        self.every, self.probe, self.run, self.world = every, probe, run, world

    def __call__(self, step: int, last: bool) -> None:
        if step % self.every and not last:
            return
        notes, world, run = self.probe.notes, self.world, self.run
        start = time.perf_counter()
        mine = shard(list(range(len(notes))), world)
        parts = gather(list(zip(mine, self.probe.generate([notes[i] for i in mine]))), world)
        if not world.leader:
            return
        generations = [g for _, g in sorted((pair for part in parts for pair in part), key=lambda pair: pair[0])]
        metrics = self.probe.score(generations, notes)
        metrics["seconds"] = time.perf_counter() - start
        run.log_metrics({f"probe/{k}": v for k, v in metrics.items()}, step=step)
        if metrics["flagged"]:
            run.set_tags({"mistill.probe_flagged": "true"})
            print(f"train: the generation probe is flagged at step {step} (category codes "
                  f"{metrics['category_rate']:.2f}, truncated {metrics['truncated_rate']:.2f})", file=sys.stderr)

    def close(self) -> None:
        if self.probe.backend is not None:
            self.probe.backend.close()


def _dispreferred(run, lm, examples: list, cfg: TrainStageConfig, allows_text: bool, backend: str,
                  device: str) -> dict[int, list[int]]:
    """The untrained student's own generation for each training prompt (DistiLLM-2's dispreferred
    responses), sampled before any update with the paper's decoding and a seed per note.

    ``backend``: the engine (:func:`resolve_rollout_backend` of ``cfg.rollout_backend``): ``vllm``
    serves the student as loaded (written to the work dir's :data:`ROLLOUT_MODEL` folder, removed
    afterwards) in bf16 beside the loaded models, with
    ``cfg.rollout_gpu_memory`` of the GPU, and is shut down before training; ``hf`` samples with
    ``lm`` :data:`DISPREFERRED_CHUNK` notes per call (:func:`generate_hf_many`'s left-padded
    batches). Either way each note is drawn with its own seed, so its tokens do not depend on the
    notes sampled with it. The notes go through :func:`sample_notes`: each note's generation is
    written as soon as its call returns (model text, never logged: for a restricted corpus in the
    run's local enclave, ``<enclave>/dispreferred/<note_id>.json``, otherwise in the run's work
    dir), and a resumed run reads back the ones drawn under the same settings.
    """
    decoding = DecodingConfig(max_new_tokens=cfg.dispreferred_max_new_tokens, seed=cfg.seed)
    requests = [SampleRequest(ex.student.note.note_id, ex.student.inp.prompt.text,
                              note_seed(decoding, ex.student.note.note_id)) for ex in examples]
    stage_dir = (run.work_dir if allows_text else run.enclave_dir) / DISPREFERRED
    if not allows_text:
        run.set_tags({TAG_ENCLAVE_DIR: str(run.enclave_dir)})  # where the local files are (a path, no text)
    dtype = "bfloat16" if backend == "vllm" else str(next(lm.model.parameters()).dtype).removeprefix("torch.")
    overrides = {"gpu_memory_utilization": cfg.rollout_gpu_memory} if backend == "vllm" else None
    rollout_dir = run.work_dir / ROLLOUT_MODEL

    def open_backend():
        # vLLM builds its engine from a directory: the student as loaded (any spec, a derived one too)
        source = str(save_rollout_model(lm.model, lm.tokenizer, rollout_dir)) if backend == "vllm" else cfg.student
        return make_backend(backend, source, decoding, device=device, dtype=dtype, lm=lm, engine_overrides=overrides)

    try:
        samples = sample_notes(requests, stage_dir, open_backend, decoding.to_dict(),
                               chunk=DISPREFERRED_CHUNK if backend == "hf" else 0, desc="student generations")
    finally:
        if backend == "vllm":
            shutil.rmtree(rollout_dir, ignore_errors=True)
    return {i: samples[r.note_id].token_ids for i, r in enumerate(requests)}


ARM_PARAM_PREFIX = "arm."


def arm_params(arm: ArmConfig) -> dict[str, str]:
    """Every resolved flag of ``arm`` as a flat param ``arm.<flag>`` (``arm.lambda_p1``,
    ``arm.pool_k``, ``arm.terms``, ...): numbers and booleans as JSON, lists as the overrides
    write them (``attention+interaction``). They follow from the run's identity (the arm name,
    its file's sha256 when given by path, ``overrides``, ``precision``, the code version), so they
    are logged beside the identity params and never compared when a run is reused."""
    return {f"{ARM_PARAM_PREFIX}{k}": "+".join(map(str, v)) if isinstance(v, (list, tuple)) else param_string(v)
            for k, v in arm.to_dict().items()}


def _log_train_notes_param(run, digest: str) -> None:
    """The param ``train_notes.sha256``: the sha256 of the chosen notes' ids (kept on a resumed run)."""
    if "train_notes.sha256" not in run.client.get_run(run.run_id).data.params:
        run.client.log_batch(run.run_id, params=[Param("train_notes.sha256", digest)])


def _log_arm_params(run, arm: ArmConfig) -> None:
    """Log :func:`arm_params` (those a resumed run already holds are kept)."""
    params = arm_params(arm)
    run.guard.check_mapping(params, "param")
    existing = run.client.get_run(run.run_id).data.params
    batch = [Param(k, v) for k, v in params.items() if k not in existing]
    for i in range(0, len(batch), 100):
        run.client.log_batch(run.run_id, params=batch[i:i + 100])


@dataclass(frozen=True)
class _Provenance:
    """What a checkpoint's registry entry records beside the train config: the teacher's model
    spec, the corpus digest, the number of training notes and optimizer steps taken."""

    teacher: str
    corpus_digest: str
    n_notes: int
    steps: int


def _save_and_register(run, model, tokenizer, cfg: TrainStageConfig, arm: ArmConfig, prov: _Provenance) -> None:
    """Save the final checkpoint as an MLflow Model (:mod:`mistill.tracking.models`), have the
    privacy guard read every file of it, log it as the artifact path ``model``, and register it:
    a version tagged with arm, λ, seed, precision, teacher, corpus digest and described by a model
    card, with the arm alias (a plain train run) or the cell alias (a λ-selection cell)."""
    role = reg.train_role()
    name = reg.registered_model_name(run.corpus, run.model)
    alias = (reg.cell_alias(cfg.arm, arm.lambda_p1, arm.lambda_p2, cfg.seed) if role == reg.ROLE_CELL
             else reg.arm_alias(cfg.arm, cfg.seed))
    recipe = {k: getattr(cfg, k) for k in ("epochs", "lr", "warmup_frac", "grad_accum", "clip", "max_steps")}
    card = reg.model_card(name=name, arm=cfg.arm, arm_flags=arm.to_dict(), seed=cfg.seed, precision=arm.precision,
                          role=role, alias=alias, student=cfg.student, teacher=prov.teacher, corpus=run.corpus,
                          corpus_digest=prov.corpus_digest, n_notes=prov.n_notes, recipe=recipe, steps=prov.steps,
                          run_id=run.run_id, inputs=run.inputs)
    out = run.work_dir / reg.MODEL_ARTIFACT
    model.eval()
    mlflow_model = reg.save_mlflow_model(model, tokenizer, out, card=card, source=cfg.student)
    run.log_artifact_file(out, reg.MODEL_ARTIFACT)  # the privacy guard reads every file of the model
    run.set_tags({reg.TAG_LOGGED_MODELS: reg.logged_model_tag(mlflow_model, run.run_id)})
    if not cfg.register:
        return
    lambdas = {"mistill.lambda_p1": repr(arm.lambda_p1), "mistill.lambda_p2": repr(arm.lambda_p2)} \
        if arm.objective == "mistill" else {}  # λ weighs Mistill's terms: tagged only where it applies
    tags = {"mistill.arm": cfg.arm, **lambdas, "mistill.seed": str(cfg.seed), "mistill.precision": arm.precision, "mistill.objective": arm.objective,
            "mistill.student": cfg.student, "mistill.teacher": prov.teacher, "mistill.corpus": run.corpus,
            "mistill.corpus_digest": prov.corpus_digest, "mistill.train_run": run.run_id,
            reg.TAG_MODEL_ROLE: role}
    run.guard.check_mapping({**tags, "description": card}, "model version tag")
    client = MlflowClient()
    version = reg.register_version(client, name, run.run_id, tags=tags, description=card)
    client.set_registered_model_alias(name, alias, version.version)
    run.set_tags({reg.TAG_REGISTERED_MODEL: name, reg.TAG_MODEL_VERSION: version.version,
                  reg.TAG_MODEL_ALIAS: alias, reg.TAG_MODEL_ROLE: role})
