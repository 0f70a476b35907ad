"""The ``flip_test`` stage: the evidence-flip test's behavioural half (App. N.3, R-D33; Table 54).

One checkpoint (a ``train`` run's, or any model standing for an arm such as the teacher) answers
every case of a frozen cohort (``cohort_run``: a ``flip_cohort`` run that wrote its four condition
corpora) ``samples`` times under each condition, through the evaluation's generation path: the
case's prompt as ``evaluate`` builds it, the paper's decoding, every answer of the run in one
batched sampling pass (``backend``; tag ``mistill.backend``). The run joins the cohort's
experiment, where the report finds it. Sample ``k`` of a case is drawn with
one seed in every condition (:func:`mistill.evaluation.flip_test.sample_seed`), so the
conditions are compared at the same sample index.

Each answer is parsed as ``evaluate`` parses it and scored against the case's codes ``A`` and
``B`` (:mod:`mistill.evaluation.flip_test`). Logged: ``flip_samples`` (one row per answer: case,
condition, sample index, seed, validity, whether A and B were emitted, ``v``, the category
``v``), ``flip_cases`` (the per-case readings: ``D``, the follow rates, paired success, the
control statistics, invalid outputs, the decomposition, ``D_category``) and, as metrics, their
means over cases (``flip/D``, ``flip/D_lo``, ``flip/D_hi``, ...) with ``flip/n_cases``. The report
sets the checkpoints side by side and reads the seed-pair contrasts (Table 54).

With ``mask`` (``target`` or ``sham``) the run is the causal half (App. N.4, R-D34; Table 55):
every answer is generated on the HF path with the decode-regime key mask, the prompt prefilled
clean, then at each decode step the nominated heads kept from the case's target (evidence) or
sham (token-matched non-evidence) positions of this condition's note
(:class:`~mistill.evaluation.backends.KeyMaskedHFBackend`). The heads are ``mask_heads`` by name
(the teacher's named pair ``L30H11,L38H39``) or the top ``mask_k`` of the ``mask_phase`` ranking of
``mask_heads_run`` (an ``attribute`` run, or an ``own_heads`` run whose ranking it reads: each
checkpoint's own top-40). The clean reference of the causal half is the same run without a mask on
the HF path (``backend=hf``); its difference from the behavioural run (``backend=auto``) is the
execution-path offset.

``mask_regime=prefill`` is App. O's prefill-inclusive evidence mask (the teacher's gate on the
evidence pairs, Table 58): the heads are kept from the positions in the prefill too.
``mask_random=n`` (n >= 1) masks, in place of the nominated heads, random draw ``n`` of as many
heads per layer among that layer's other heads (seeded by ``seed`` and ``n``): App. O's
layer-matched random draws.

Only codes, flags and ids reach MLflow. The generations are staged in the run's enclave (a
local folder, :mod:`mistill.evaluation.sampling`); a rerun after a crash samples only the answers
not staged yet.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.data.corpus import Note
from mistill.data.flips import CONDITION_SETS, prompt_positions
from mistill.data.prompts import Prompt
from mistill.errors import MistillInputError
from mistill.evaluation.backends import KeyMaskedHFBackend, resolve_backend
from mistill.data.inventory import category
from mistill.evaluation.flip_test import SAMPLE_COLUMNS, case_readings, checkpoint_readings, sample_row, sample_seed
from mistill.evaluation.sampling import SampleRequest, sample_notes
from mistill.instrument.passes import PHASES, stable_seed
from mistill.params import DecodingParams
from mistill.stages.characterize import ranks_from_head_sets
from mistill.stages.common import (TAG_CONDITION_RUN, Prepared, RunReader, link_subject, load_model, load_prepared,
                                   load_tokenizer, make_backend, readout_subject, shown_patient_ids)
from mistill.stages.own_heads import TAG_RANK_ATTRIBUTE
from mistill.stages.runner import open_stage, progress_label, stage_device
from mistill.tasks import task_for
from mistill.tracking.naming import TAG_BACKEND, TAG_CORPUS
from mistill.validation import (HEAD_NAME, check_arm, check_choice, check_device, check_dtype, check_model_spec,
                                check_no_text_fields, check_non_negative, check_pattern, check_positive, check_run_id,
                                check_seed, fail)

STAGE = "flip_test"
MASKS = ("", "target", "sham")
MASK_REGIMES = ("decode", "prefill")
"""Where the key mask acts: decode steps after a clean prefill (App. N.4), or the prefill too
(App. O's gate)."""
SAMPLES = "samples"
"""The enclave folder of the staged generations."""
METRIC_PREFIX = "flip/"


@dataclass(frozen=True)
class FlipTestConfig(Config, DecodingParams):
    """One checkpoint on a frozen evidence-flip cohort, every condition (App. N.3).

    cohort_run: a ``flip_cohort`` run that wrote its condition corpora (the frozen cohort).
    train_run: a ``train`` run (the checkpoint; arm, seed and precision come from it); else
        ``model`` (any spec) with ``arm`` naming what it stands for (``teacher``, ...).
    samples: answers per case and condition (the paper: 4); sample ``k`` shares its seed
        across the conditions. seed: the decoding seed the samples' seeds derive from.
    mask: ``""`` (no mask), ``target`` or ``sham``: the decode-regime key mask of the causal half
        on the HF path (``backend`` ``auto`` or ``hf``; ``vllm`` is refused).
    mask_heads: the masked heads by name (``L30H11``); else mask_heads_run: an ``attribute`` or
        ``own_heads`` run whose ``mask_phase`` ranking's top ``mask_k`` are masked.
    mask_regime: ``decode`` (App. N.4) or ``prefill`` (App. O's prefill-inclusive mask).
    mask_random: 0 masks the nominated heads; n >= 1 random draw n of layer-matched other heads.
    device: ``cpu``, ``cuda``, ``cuda:<n>`` or ``mps``.
    """

    cohort_run: str = ""
    train_run: str = ""
    model: str = ""
    arm: str = ""
    samples: int = 4
    seed: int = 0
    mask: str = ""
    mask_heads: tuple[str, ...] = ()
    mask_heads_run: str = ""
    mask_phase: str = "P2C"
    mask_k: int = 40
    mask_regime: str = "decode"
    mask_random: int = 0
    device: str = "cpu"
    dtype: str = "float32"

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.cohort_run, "cohort_run")
        check_run_id(self.train_run, "train_run")
        check_model_spec(self.model, "model", allow_empty=True)
        check_arm(self.arm, "arm", allow_empty=True)
        check_positive(self.samples, "samples")
        check_seed(self.seed)
        check_choice(self.mask, MASKS, "mask")
        check_run_id(self.mask_heads_run, "mask_heads_run")
        check_choice(self.mask_phase, PHASES, "mask_phase")
        check_positive(self.mask_k, "mask_k")
        check_choice(self.mask_regime, MASK_REGIMES, "mask_regime")
        check_non_negative(self.mask_random, "mask_random", "0: the nominated heads")
        if not self.mask and (self.mask_regime != "decode" or self.mask_random):
            fail("mask_regime and mask_random shape a key mask: set mask too", "mask")
        for head in self.mask_heads:
            check_pattern(head, HEAD_NAME, "mask_heads", "a head name like L30H11")
        if self.mask and bool(self.mask_heads) == bool(self.mask_heads_run):
            fail("a key mask needs its heads: give mask_heads or mask_heads_run (one of them)", "mask_heads")
        if not self.mask and (self.mask_heads or self.mask_heads_run):
            fail("mask_heads and mask_heads_run nominate the heads of a key mask: set mask too", "mask")
        if self.mask and self.backend == "vllm":
            fail("the key mask runs on the HF generation path: backend hf or auto", "backend")
        check_device(self.device)
        check_dtype(self.dtype)


def cohort_conditions(cohort_run: str) -> tuple[str, dict[str, Prepared]]:
    """The corpus a frozen cohort was drawn from (whose experiment holds the cohort and its test)
    and its four condition corpora, by condition in the order of its condition set
    (:data:`~mistill.data.flips.CONDITION_SETS`); a run without them is refused (field
    ``cohort_run``)."""
    tags = MlflowClient().get_run(cohort_run).data.tags
    if tags.get("mistill.stage") != "flip_cohort":
        raise MistillInputError(f"run {cohort_run} is a {tags.get('mistill.stage')!r} run, not a flip_cohort run",
                                field="cohort_run")
    conditions = next((s for s in CONDITION_SETS if all(tags.get(TAG_CONDITION_RUN + c) for c in s)),
                      CONDITION_SETS[0])
    runs = {c: tags.get(TAG_CONDITION_RUN + c, "") for c in conditions}
    if not all(runs.values()):
        raise MistillInputError(f"flip_cohort run {cohort_run} wrote no condition corpora (its review is not "
                                f"frozen yet): the test needs the frozen cohort", field="cohort_run")
    out = {c: load_prepared(r) for c, r in runs.items()}
    cases = {c: [n.meta["flip_case"] for n in p.corpus.notes] for c, p in out.items()}
    if any(ids != cases["original"] for ids in cases.values()) or not cases["original"]:
        raise MistillInputError(f"flip_cohort run {cohort_run}: its condition corpora do not hold the same cases",
                                field="cohort_run")
    return tags[TAG_CORPUS], out


def _ranking_run(run_id: str) -> str:
    """The attribute run holding the ranking ``mask_heads_run`` names: itself, or an
    ``own_heads`` run's ranking run."""
    tags = MlflowClient().get_run(run_id).data.tags
    stage = tags.get("mistill.stage")
    if stage == "attribute":
        return run_id
    if stage == "own_heads" and tags.get(TAG_RANK_ATTRIBUTE):
        return tags[TAG_RANK_ATTRIBUTE]
    raise MistillInputError(f"run {run_id} is a {stage!r} run: mask_heads_run takes an attribute or own_heads run",
                            field="mask_heads_run")


def nominated_heads(cfg: FlipTestConfig, names: list[str]) -> list[int]:
    """The flat heads the key mask acts on: ``mask_heads`` by name, else the top ``mask_k`` of
    ``mask_heads_run``'s ``mask_phase`` ranking; a name or phase the model lacks is refused."""
    index = {n: i for i, n in enumerate(names)}
    if cfg.mask_heads:
        unknown = [h for h in cfg.mask_heads if h not in index]
        if unknown:
            raise MistillInputError(f"the model has no head {', '.join(unknown)}", field="mask_heads")
        return [index[h] for h in cfg.mask_heads]
    ranking = RunReader(_ranking_run(cfg.mask_heads_run), field="mask_heads_run")
    ranks = ranks_from_head_sets(json.loads(ranking.file("head_sets.json").read_text()), names)
    if cfg.mask_phase not in ranks:
        raise MistillInputError(f"run {cfg.mask_heads_run}'s ranking has no {cfg.mask_phase} phase",
                                field="mask_phase")
    return ranks[cfg.mask_phase][:cfg.mask_k]


def layer_matched_draw(heads: Sequence[int], n_heads: int, draw: int, seed: int) -> list[int]:
    """Random draw ``draw`` of heads matched to ``heads`` (flat) layer by layer: as many of each
    layer's other heads as it has nominated ones (all of them when fewer), seeded by ``seed`` and
    ``draw``; sorted."""
    by_layer: dict[int, list[int]] = {}
    for flat in sorted({int(h) for h in heads}):
        by_layer.setdefault(flat // n_heads, []).append(flat)
    rng = random.Random(stable_seed(seed, "mask-random", draw))
    out: list[int] = []
    for layer, chosen in sorted(by_layer.items()):
        others = [layer * n_heads + h for h in range(n_heads) if layer * n_heads + h not in chosen]
        out += rng.sample(others, min(len(chosen), len(others)))
    return sorted(out)


def _prompts(conditions: dict[str, Prepared], tokenizer) -> list[tuple[str, Note, Prompt]]:
    """Every condition's notes with their prompts, condition by condition."""
    return [(cond, note, prepared.prompt(note, tokenizer)) for cond, prepared in conditions.items()
            for note in prepared.corpus.notes]


def _key_masks(prompts: list[tuple[str, Note, Prompt]], tokenizer, mask: str) -> dict[str, list[int]]:
    """Each condition prompt's masked token positions (the case's ``<mask>_mask`` spans of that
    condition's note), by prompt text."""
    return {prompt.text: prompt_positions(prompt, note, [tuple(s) for s in note.meta[f"{mask}_mask"]], tokenizer)
            for _, note, prompt in prompts}


def run_flip_test(cfg: FlipTestConfig) -> str:
    corpus, conditions = cohort_conditions(cfg.cohort_run)
    subject = readout_subject(cfg.train_run, cfg.model, cfg.arm)
    decoding = cfg.decoding()
    device = stage_device(cfg.device)
    backend = "hf" if cfg.mask else resolve_backend(cfg.backend, device)
    inputs = {"flip_cohort": cfg.cohort_run, **({"train": cfg.train_run} if cfg.train_run else {}),
              **({"mask_heads": cfg.mask_heads_run} if cfg.mask_heads_run else {})}
    original = conditions["original"]
    with open_stage(STAGE, cfg, original, inputs=inputs, corpus=corpus, model=subject.spec, arm=subject.arm,
                    seed=int(subject.seed) if subject.seed is not None else cfg.seed, precision=subject.precision,
                    tags={**subject.links, TAG_BACKEND: backend}) as run:
        if run.reused:
            return run.run_id
        link_subject(run, subject)
        tokenizer = load_tokenizer(subject.spec)
        prompts = _prompts(conditions, tokenizer)
        task = task_for(original.inventory)
        a_refs = {n.meta["flip_case"]: tuple(n.gold_codes) for n in original.corpus.notes}  # A and its aliases
        requests, keys = [], []
        for cond, note, prompt in prompts:
            case = note.meta["flip_case"]
            for k in range(cfg.samples):
                seed = sample_seed(decoding, case, k)
                requests.append(SampleRequest(f"{note.note_id}.{cond}.{k}", prompt.text, seed))
                keys.append((case, cond, k, seed, note.meta["target_code"], note.meta["partner_code"]))
        if cfg.mask:
            lm = load_model(subject.spec, dtype=cfg.dtype, device=device)
            names = lm.geometry.head_names()
            heads = nominated_heads(cfg, names)
            if cfg.mask_random:
                heads = layer_matched_draw(heads, lm.geometry.n_heads, cfg.mask_random, cfg.seed)
            masks = _key_masks(prompts, tokenizer, cfg.mask)
            run.log_json("key_mask.json", {
                "mask": cfg.mask, "regime": cfg.mask_regime, "random_draw": cfg.mask_random,
                "heads": [names[h] for h in heads],
                "masked_tokens": {f"{note.meta['flip_case']}.{cond}": len(masks[prompt.text])
                                  for cond, note, prompt in prompts}})

            def open_backend():
                return KeyMaskedHFBackend(lm, decoding, heads, masks, prefill=cfg.mask_regime == "prefill")
        else:
            def open_backend():
                return make_backend(backend, subject.spec, decoding, device=device, dtype=cfg.dtype)
        gens = sample_notes(requests, run.enclave_dir / SAMPLES, open_backend, decoding.to_dict(),
                            desc=progress_label(f"flip_test {subject.arm}: generate"))
        read = task.answer_reader(original.inventory.codes)
        rows = []
        for request, (case, cond, k, seed, a, b) in zip(requests, keys, strict=True):
            gen = gens[request.note_id]
            answer = read(gen.text, capped=gen.capped)
            rows.append(sample_row(case, cond, k, seed, answer.codes, valid=answer.valid, capped=gen.capped,
                                   n_tokens=gen.n_tokens, a=a, b=b, task=task, a_refs=a_refs[case]))
        samples = pd.DataFrame(rows, columns=list(SAMPLE_COLUMNS))
        # a label space of free-text answers has no categories (App. O)
        differ = {n.meta["flip_case"]: task.set_valued and category(n.meta["target_code"]) !=
                  category(n.meta["partner_code"]) for n in original.corpus.notes}
        cases = case_readings(samples, differ, tuple(conditions))
        readings = checkpoint_readings(cases)
        run.log_table("flip_samples", samples)
        # each case's cluster (its note's patient; App. O: the base-question group), hashed when restricted
        notes = sorted(original.corpus.notes, key=lambda n: n.meta["flip_case"])
        groups = dict(zip((n.meta["flip_case"] for n in notes),
                          shown_patient_ids(original.corpus.privacy, [n.patient_id for n in notes])))
        run.log_table("flip_cases", cases.reset_index().assign(group=lambda f: f["case_id"].map(groups)))
        run.log_metrics({METRIC_PREFIX + k: float(v) for k, v in readings.items() if pd.notna(v)})
        print(f"flip_test: {subject.arm} on {readings['n_cases']} cases x {len(conditions)} conditions x "
              f"{cfg.samples} samples ({backend} sampled): D {readings['D']:+.3f} "
              f"[{readings['D_lo']:+.3f}, {readings['D_hi']:+.3f}] -> run {run.run_id}")
        return run.run_id


__all__ = ["FlipTestConfig", "run_flip_test", "cohort_conditions", "STAGE", "METRIC_PREFIX"]
