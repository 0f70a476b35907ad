"""The ``evaluate`` stage: any model or trained arm on a corpus split (App. J.5, K; Tables 2, 46, 49).

Per note: one generation with the paper's decoding (a sampling seed per note), its parsed answer
and flags, the task metrics' per-note counts, and the teacher-forced readouts on the teacher's
trace: teacher-trace perplexity, M1 margins at the teacher's events (realized in this model's
tokenizer), BLEU-4 of this model's reasoning against the teacher's, and LAS when a simulator run
is given. Aggregated: ``metrics.json`` (and MLflow metrics) with task metrics, valid / cap /
degenerate rates, mean generated tokens, fidelity (PPL median over notes, BLEU-4 and LAS means
over notes) and M1 per event kind, a free-text task's answer EM and F1 (MuSiQue-Ans), an executed
task's pass@1 (BigCodeBench: each answer's code run against its note's tests in the sandbox, the
``verdict`` per note); ``per_note_metrics`` and ``predictions.jsonl`` (codes and flags),
both also MLflow tables (``per_note_metrics.json``, ``predictions.json``: ``mlflow.load_table``
reads them, the UI shows them as tables). The run links what it scored: a train run's checkpoint
is its model input (the checkpoint's logged model, listed under the run page's "Logged models"),
and its params ``arm.name``, ``arm.seed``, ``arm.precision`` (and ``arm.lambda_p1``,
``arm.lambda_p2`` for a Mistill-objective arm) line the arms up in MLflow's compare view
(:func:`mistill.stages.common.link_subject`).

Nothing the model wrote is logged for a restricted corpus: each generation is a local file of
the run's enclave (``<enclave>/notes/<note_id>/generation.txt``, tag ``mistill.enclave_dir``,
recorded with its sha256 in the note's ``_DONE``; see
:meth:`mistill.tracking.runs.StageRun.write_note`); for a synthetic or public corpus it is the
per-note artifact ``generation.txt``. Either way ``RunReader.note_file`` reads it back.

Two phases. First every pending note is sampled, many notes per engine call, through the backend
``backend`` resolves to (``auto``: vLLM on a CUDA device where it is installed, else HF's batched
generation; tag ``mistill.backend``); each sample is staged in the run's enclave as it arrives
(:mod:`mistill.evaluation.sampling`), and a vLLM engine is freed before the model is loaded for
the second phase: the per-note readouts, each note written when its readouts are done. A rerun
after a crash samples only notes without a staged sample and reads only notes not written.

A model whose chat template has no thinking switch, a generation cut at the cap, an answer that
is not JSON and codes outside the inventory are counted, never a crash, and codes are never
scraped from the reasoning.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pandas as pd

from mistill.config import Config
from mistill.data.corpus import Note
from mistill.data.prompts import template_has_thinking
from mistill.distill.note_data import first_trace_token
from mistill.distributed import current_world
from mistill.errors import MistillInputError
from mistill.evaluation.backends import resolve_backend
from mistill.evaluation.generation import generation_record, note_seed
from mistill.evaluation.m1 import m1_summary, teacher_forced_readouts
from mistill.evaluation.metrics import bleu4, per_note_metrics, task_metrics
from mistill.evaluation.parsing import split_reasoning
from mistill.evaluation.sampling import SampleRequest
from mistill.io import write_text
from mistill.params import DecodingParams
from mistill.progress import track
from mistill.stages.characterize import stage_notes
from mistill.stages.common import (Prepared, link_subject, load_model, load_prepared, load_tokenizer,
                                   model_positions, note_input, readout_subject, require_notes, sample_then_load)
from mistill.stages.generate import ANSWER_SCORES, answer_counts
from mistill.stages.las import load_simulator
from mistill.stages.runner import notes_written, open_stage, pending_notes, progress_label, stage_device
from mistill.tasks import note_items, task_for
from mistill.tracking.naming import TAG_BACKEND, TAG_SPLIT
from mistill.validation import (check_arm, check_device, check_dtype, check_model_spec, check_name,
                                check_no_text_fields, check_non_negative, check_run_id, check_seed)

NOTES = "notes"
TAG_ENCLAVE = "mistill.enclave_dir"
"""The run's enclave dir, set by :meth:`~mistill.tracking.runs.StageRun.write_note` (``TAG_ENCLAVE_DIR``)."""
GENERATION_FILE = "generation.txt"
SAMPLES = "samples"
PREDICTION_COLUMNS = ("note_id", "codes", "valid", "reason", "capped", "degenerate", "n_tokens", "seed")
"""A prediction's fields (``predictions.jsonl`` and the MLflow table ``predictions.json``): ids,
codes, flags and numbers, never the model's text."""
"""The enclave folder of the generations sampled before their readouts (:mod:`mistill.evaluation.sampling`)."""


@dataclass(frozen=True)
class EvaluateConfig(Config, DecodingParams):
    """One model on one split.

    train_run: a ``train`` run (the model is its checkpoint, ``run:<id>``; arm, seed and
        precision come from it); else ``model`` (any spec) with ``arm`` naming the row of
        Table 2 (``teacher``, ``untrained``, ...).
    las_run: a ``las_simulator`` run; empty leaves LAS out.
    split: the notes read (empty: every split); max_notes: the first n of them (0: all).
    device: ``cpu``, ``cuda``, ``cuda:<n>`` or ``mps``.
    """

    prepare_run: str = ""
    train_run: str = ""
    model: str = ""
    arm: str = ""
    split: str = "test"
    max_notes: int = 0
    seed: int = 0
    las_run: str = ""
    fidelity: bool = True
    device: str = "cpu"
    dtype: str = "float32"

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.prepare_run, "prepare_run")
        check_run_id(self.train_run, "train_run")
        check_run_id(self.las_run, "las_run")
        check_model_spec(self.model, "model", allow_empty=True)
        check_arm(self.arm, "arm", allow_empty=True)
        check_name(self.split, "split", "a split", allow_empty=True)
        check_non_negative(self.max_notes, "max_notes", "0: every note")
        check_seed(self.seed)
        check_device(self.device)
        check_dtype(self.dtype)


def evaluated_notes(prepared: Prepared, cfg: EvaluateConfig) -> list[Note]:
    """The notes an evaluation reads, in corpus order: with ``fidelity``, those of ``split`` with a
    teacher trace (its readouts are teacher-forced on it); without, every note of ``split`` (its
    answers need no trace: App. O's and App. P's evaluation inputs carry none); the first
    ``max_notes`` (0: all). An empty selection is refused, naming the split."""
    if cfg.fidelity:
        return stage_notes(prepared, cfg.split, cfg.max_notes)
    notes = [n for n in prepared.corpus.notes if not cfg.split or n.split == cfg.split]
    notes = require_notes(notes, cfg.split, prepared, need_trace=False)
    return notes[:cfg.max_notes] if cfg.max_notes else notes


def run_evaluate(cfg: EvaluateConfig) -> str:
    prepared = load_prepared(cfg.prepare_run)
    notes = evaluated_notes(prepared, cfg)  # refuses a split without notes
    subject = readout_subject(cfg.train_run, cfg.model, cfg.arm)
    inputs = {"prepare": cfg.prepare_run}
    if cfg.train_run:
        inputs["train"] = cfg.train_run
    if cfg.las_run:
        inputs["las"] = cfg.las_run
    decoding = cfg.decoding()
    arm = subject.arm
    device = stage_device(cfg.device)
    backend = resolve_backend(cfg.backend, device)
    with open_stage("evaluate", cfg, prepared, inputs=inputs, model=subject.spec, arm=arm,
                    seed=int(subject.seed) if subject.seed is not None else cfg.seed, precision=subject.precision,
                    tags={**subject.links, TAG_SPLIT: cfg.split or "all", TAG_BACKEND: backend}) as run:
        if run.reused:
            return run.run_id
        if current_world().leader:
            link_subject(run, subject)
        guard = run.guard
        pending = pending_notes(run, NOTES, notes, desc=f"evaluate {arm}")
        lm = None
        if pending:
            tokenizer = load_tokenizer(subject.spec)
            requests = [SampleRequest(n.note_id, prepared.prompt(n, tokenizer).text, note_seed(decoding, n.note_id))
                        for n in pending]
            samples, lm = sample_then_load(
                requests, run.enclave_dir / SAMPLES, subject.spec, decoding,
                lambda: load_model(subject.spec, dtype=cfg.dtype, device=device),
                backend=backend, device=device, dtype=cfg.dtype, desc=progress_label(f"evaluate {arm}: generate"))
            _readouts(cfg, run, pending, prepared, lm, samples, guard, device, arm)
        if not notes_written(run, NOTES, notes):
            return run.run_id
        metrics, per_note, predictions = _aggregate(run, notes, prepared, cfg)
        metrics["thinking_switch"] = float(template_has_thinking(lm.tokenizer if lm is not None
                                                                 else load_tokenizer(subject.spec)))
        run.log_table("per_note_metrics", per_note, mlflow_table=True)
        run.log_json("metrics.json", metrics)
        path = run.work_dir / "predictions.jsonl"
        write_text(path, "".join(json.dumps(p) + "\n" for p in predictions))
        run.log_artifact_file(path)
        run.log_mlflow_table("predictions", pd.DataFrame(predictions, columns=list(PREDICTION_COLUMNS)))
        run.log_metrics({k: v for k, v in metrics.items() if isinstance(v, float) and np.isfinite(v)})
        print(f"evaluate: {arm} on {len(notes)} {cfg.split} notes ({backend} sampled): micro-F1 "
              f"{metrics['micro_f1']:.3f}, valid {metrics['valid_rate']:.2f} -> run {run.run_id}")
        return run.run_id


def _readouts(cfg: EvaluateConfig, run, notes, prepared, lm, samples: dict, guard, device: str, arm: str) -> None:
    """Phase two, per note: the prediction of its generation and, with ``cfg.fidelity``, the
    teacher-forced readouts on the teacher's trace; written with the generation's text (an
    artifact, or a file of the run's enclave for a restricted corpus)."""
    simulator = None
    if cfg.las_run:
        simulator = load_simulator(cfg.las_run, device=device)
    task = task_for(prepared.inventory)
    read = task.answer_reader(prepared.inventory.codes)
    las: dict[str, float] = {}
    if simulator is not None and cfg.fidelity:  # every note's two predictions decoded together
        items = [(n.text, split_reasoning(samples[n.note_id].text)[0], list(read(n.teacher_trace).codes))
                 for n in notes]
        las = dict(zip((n.note_id for n in notes), simulator.las_many(items)))
    for note in track(notes, desc=progress_label(f"evaluate {arm}: read"), total=len(notes)):
        gen = samples[note.note_id]
        files: dict = {"prediction.json": generation_record(note, gen, read)}
        outcome = task.execute_answers([note], [gen.text])  # App. P: the answer run against the note's tests
        if outcome is not None:
            files["prediction.json"]["verdict"] = outcome[0]
        if cfg.fidelity:
            ni = note_input(note, prepared.inventory, lm.tokenizer,
                            **prepared.prompt_settings, max_positions=model_positions(lm))
            teacher_reasoning, _ = split_reasoning(note.teacher_trace)
            own_reasoning, _ = split_reasoning(gen.text)
            ppl, margins = teacher_forced_readouts(lm, ni, note_items(prepared.inventory, note),
                                                   first_trace_token(ni.offsets, ni.trace_offset),
                                                   task=task.for_note(note))
            fid = {"ppl": ppl, "bleu4": bleu4(own_reasoning, teacher_reasoning)}
            if simulator is not None:
                fid["las"] = float(las[note.note_id])
            files["fidelity.json"] = fid
            files["m1.json"] = {"events": margins}
        text = {GENERATION_FILE: gen.text}
        if guard.allows_text:
            run.write_note(NOTES, note.note_id, {**files, **text})
        else:  # the model's text stays in this machine's enclave
            run.write_note(NOTES, note.note_id, files, local_files=text)


def _aggregate(run, notes, prepared, cfg: EvaluateConfig) -> tuple[dict, pd.DataFrame, list[dict]]:
    preds = [run.load_note(NOTES, n.note_id, "prediction.json") for n in notes]
    gold = [list(n.gold_codes) for n in notes]
    pred = [p["codes"] for p in preds]
    valid = [bool(p["valid"]) for p in preds]
    capped = [bool(p["capped"]) for p in preds]
    n_tokens = [int(p["n_tokens"]) for p in preds]
    train = [n for n in prepared.corpus.notes if n.split == "train"]
    freq = Counter(c for n in train for c in set(n.gold_codes))
    # propensity-scored metrics need the training split's label frequencies (and > e notes)
    kw = {"train_freq": dict(freq), "n_train": len(train)} if len(train) > np.e else {}
    metrics = {k: float(v) for k, v in task_metrics(gold, pred, valid=valid, capped=capped, n_tokens=n_tokens,
                                                    **kw).items()}
    metrics["mean_generated_tokens"] = metrics.pop("mean_tokens")
    reasons = Counter(p["reason"] for p in preds)
    metrics.update({"degenerate_rate": float(np.mean([p["degenerate"] for p in preds])),
                    "n_unclosed_think": float(reasons["unclosed_think"]),
                    "n_not_json": float(reasons["no_json_list"] + reasons["not_a_list"]),
                    "n_out_of_inventory": float(sum(p["n_out_of_inventory"] for p in preds))})
    rows = per_note_metrics(gold, pred, valid=valid, capped=capped, n_tokens=n_tokens,
                            note_ids=[n.note_id for n in notes], **kw)
    df = pd.DataFrame(rows)
    df.insert(1, "micro_f1", df["f1"])
    if any("verdict" in p for p in preds):  # executed answers (BigCodeBench): pass@1 over every note
        df["verdict"] = [p.get("verdict", "") for p in preds]
        df["passed"] = (df["verdict"] == "passed").astype(int)
        metrics["pass_at_1"] = float(df["passed"].mean())
    task = task_for(prepared.inventory)
    if not task.set_valued:  # a free-text answer (MuSiQue-Ans): its exact match and F1, macro over notes
        scores = answer_counts(notes, preds, task)
        for key in ANSWER_SCORES:
            df[key] = scores[key].to_numpy()
            metrics[key] = float(scores[key].mean())
    if cfg.fidelity:
        fids = [run.load_note(NOTES, n.note_id, "fidelity.json") for n in notes]
        m1 = [run.load_note(NOTES, n.note_id, "m1.json")["events"] for n in notes]
        for key in ("ppl", "bleu4", "las"):
            df[key] = [f.get(key, float("nan")) for f in fids]
        for i, events in enumerate(m1):
            for k, v in m1_summary(events).items():
                df.loc[i, k.replace("/", "_")] = v  # m1/P1/p_pos -> column m1_P1_p_pos
        metrics["fidelity/ppl_median"] = float(np.median(df["ppl"]))
        metrics["fidelity/bleu4_mean"] = float(df["bleu4"].mean())
        if cfg.las_run:
            metrics["fidelity/las_mean"] = float(df["las"].mean())
        metrics.update(m1_summary(e for events in m1 for e in events))
        run.log_table("m1_events", pd.DataFrame(
            [{"note_id": n.note_id, **e} for n, events in zip(notes, m1) for e in events],
            columns=["note_id", "event_id", "kind", "margin"]))
    predictions = [{k: p[k] for k in PREDICTION_COLUMNS} for p in preds]
    return metrics, df, predictions
