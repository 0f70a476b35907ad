"""The ``generate`` stage: a model's traces for a corpus under the paper's decoding (App. J.5).

It reads a ``prepare`` (or ``shortlist``) run, builds every selected note's prompt in the
model's chat template (thinking on), samples one completion per note with the note's seed
(:func:`~mistill.evaluation.generation.note_seed`) through the backend ``backend`` resolves to
(``auto``: vLLM on a CUDA device where it is installed, else HF's batched generation; tag
``mistill.generate.backend``), many notes per engine call, and
parses it with the shared answer rules (:func:`~mistill.evaluation.parsing.parse_answer`):
valid (reasoning closed, cap not reached), parsed, degenerate, the scored codes. Nothing is
scraped from reasoning, and bad output (a cap hit, an unclosed block, an answer that is not a
JSON list, codes outside the inventory, a chat template without a thinking switch) is counted
in the metrics, never raised. Each answer is graded against its note's gold codes (the
``generations`` table's ``tp, fp, fn, n_gold``; metric ``answer_micro_f1`` over the notes with
gold codes: the model's native micro-F1, App. P's reading of the teacher on fresh inputs). For a
task with a retrieval baseline (EURLEX57K) the table also grades the first ``retrieval_top`` labels
of that ranking on each note (``retrieval_tp, retrieval_fp, retrieval_fn``; metric
``retrieval_micro_f1``), the score App. P sets beside the teacher's.

Per note (resumable, ``notes/<note_id>/``): ``generation.json`` (seed, decoding, flags, codes,
counts) and ``trace.txt``: an artifact for synthetic and public corpora; for a restricted corpus
a local file of the run's enclave (``<enclave>/notes/<note_id>/trace.txt``, tags
``mistill.enclave_dir`` and ``mistill.generate.enclave_dir``, recorded with its sha256 in the
note's ``_DONE``; see :meth:`mistill.tracking.runs.StageRun.write_note`), so only ids, codes,
flags and numbers reach MLflow. Every generated text joins the privacy guard's protected texts.

The run is also a prepared corpus: its notes are the selected notes whose generation is valid
and closed ``</think>``, each carrying that generation as ``Note.teacher_trace``, saved to a data
directory tagged ``mistill.data_dir``. ``load_prepared(<generate run id>)`` works, so every
downstream stage (events, targets, ...) takes the generate run id as its ``prepare_run``. When
no generation qualifies there is no traced corpus (tag ``mistill.generate.traced_notes = none``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from mistill.config import Config
from mistill.data.corpus import Corpus, Note
from mistill.data.prompts import template_has_thinking
from mistill.distributed import current_world
from mistill.errors import MistillInputError
from mistill.evaluation.backends import resolve_backend
from mistill.evaluation.generation import generation_record, note_seed
from mistill.evaluation.metrics import prf_from_counts, set_counts
from mistill.evaluation.sampling import call_size
from mistill.models.loading import EMBEDDED_DEFAULT
from mistill.params import DecodingParams
from mistill.progress import track
from mistill.stages.common import (CORPUS_FILE, CORPUS_META_FILE, INVENTORY_FILE, TAG_DATA_DIR, TAG_DATA_IDENTITY,
                                   Prepared, corpus_index, load_prepared, load_tokenizer, make_backend,
                                   prepared_data_dir, require_notes, save_prepared)
from mistill.stages.runner import notes_written, open_stage, pending_notes, progress_label, stage_device
from mistill.tasks import Task, task_for
from mistill.tracking.naming import TAG_CORPUS_DIGEST
from mistill.validation import (check_choice, check_device, check_dtype, check_model_spec, check_name,
                                check_no_text_fields, check_non_negative, check_not_empty, check_positive,
                                check_run_id, check_seed)

NOTES = "notes"
RECORD_FILE = "generation.json"
TRACE_FILE = "trace.txt"
TAG_ENCLAVE_DIR = "mistill.generate.enclave_dir"
"""The run's enclave dir (the same as ``mistill.enclave_dir``), set for a restricted corpus."""
TAG_SOURCE_PREPARE = "mistill.generate.source_prepare_run"
TAG_BACKEND = "mistill.generate.backend"
TAG_TRACED = "mistill.generate.traced_notes"


@dataclass(frozen=True)
class GenerateConfig(Config, DecodingParams):
    """Sampling one trace per note (App. J.5).

    prepare_run: the corpus (a prepare or shortlist run); its prompts settings are used.
    model: any model spec (``run:<train run id>``, ``embedded:smollm2-135m``, a directory, ...).
    split: only this split's notes (empty: every note); max_notes: the first n (0: all).
    seed: the sampling seed from which each note's seed is derived (>= 0).
    device, dtype: where (``cpu``, ``cuda``, ``cuda:<n>``, ``mps``) and in what precision the
        model runs.
    batch_size: notes per engine call, each note written as soon as its call returns (0: the
        backend's own size, :func:`~mistill.evaluation.sampling.call_size`: 256 for vLLM,
        which schedules them as its KV cache allows; the HF backend's batch).
    retrieval_top: for a task with a retrieval baseline
        (:meth:`~mistill.tasks.base.Task.retrieval_ranking`: EURLEX57K), the first this many of
        its ranking are scored as a prediction beside the model's answer (App. P: the top-5).
    retrieval_scope: **[recon]** what that baseline ranks: ``candidates`` (the note's shown
        candidate list, the labels the model chooses from) or ``inventory`` (every label).
    """

    prepare_run: str = ""
    model: str = EMBEDDED_DEFAULT
    split: str = ""
    max_notes: int = 0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = 0
    retrieval_top: int = 5
    retrieval_scope: str = "candidates"

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.prepare_run, "prepare_run")
        check_model_spec(self.model, "model")
        check_name(self.split, "split", "a split", allow_empty=True)
        check_not_empty(self.model, "model", "a model spec")
        check_non_negative(self.max_notes, "max_notes", "0: every note")
        check_seed(self.seed)
        check_device(self.device)
        check_dtype(self.dtype)
        check_non_negative(self.batch_size, "batch_size", "0: the backend's own size")
        check_positive(self.retrieval_top, "retrieval_top")
        check_choice(self.retrieval_scope, RETRIEVAL_SCOPES, "retrieval_scope")


def check_config(cfg: GenerateConfig) -> None:
    """Refuse what the values alone cannot show (they are checked when the config is built):
    the corpus to read must be named."""
    if not cfg.prepare_run:
        raise MistillInputError("a prepare run id is required", field="prepare_run")


def selected_notes(prepared: Prepared, split: str = "", max_notes: int = 0) -> list[Note]:
    """The notes to generate for: one split or all, in corpus order, optionally the first n
    (``max_notes`` 0: all). An empty selection is refused (:func:`require_notes`)."""
    notes = [n for n in prepared.corpus.notes if not split or n.split == split]
    notes = require_notes(notes, split, prepared, need_trace=False)
    return notes[:max_notes] if max_notes else notes


ANSWER_COUNTS: tuple[str, ...] = ("tp", "fp", "fn", "n_gold")
"""The ``generations`` table's columns grading each answer against its note's gold codes."""

ANSWER_SCORES: tuple[str, ...] = ("answer_em", "answer_f1")
"""The columns grading a free-text answer (a task whose answers are not sets: MuSiQue-Ans)."""


def answer_counts(notes: list[Note], records: list[dict], task: Task | None = None) -> pd.DataFrame:
    """Per note (in order), the parsed answer's true and false positives and false negatives
    against the note's gold codes, and how many gold codes it has (:data:`ANSWER_COUNTS`); an
    invalid answer is an empty one. For a task whose answers are not sets
    (:attr:`~mistill.tasks.base.Task.set_valued` false) the columns are its metric's exact match
    and F1 against the gold answers instead (:data:`ANSWER_SCORES`)."""
    if task is not None and not task.set_valued:
        scores = [task.metric(note.gold_codes, record["codes"]) for note, record in zip(notes, records, strict=True)]
        return pd.DataFrame([{"answer_em": s["em"], "answer_f1": s["f1"]} for s in scores],
                            columns=list(ANSWER_SCORES))
    rows = []
    for note, record in zip(notes, records, strict=True):
        tp, fp, fn = set_counts(record["codes"], note.gold_codes)
        rows.append({"tp": tp, "fp": fp, "fn": fn, "n_gold": len(set(note.gold_codes))})
    return pd.DataFrame(rows, columns=list(ANSWER_COUNTS))


RETRIEVAL_SCOPES: tuple[str, ...] = ("candidates", "inventory")
"""What a task's retrieval baseline ranks: each note's shown candidate list, or every label."""

RETRIEVAL_COUNTS: tuple[str, ...] = ("retrieval_tp", "retrieval_fp", "retrieval_fn")
"""The ``generations`` table's columns grading the retrieval baseline's top labels per note."""


def retrieval_counts(notes: list[Note], task: Task, labels: Sequence[str], top: int,
                     scope: str = "candidates") -> pd.DataFrame:
    """Per note (in order), the set counts of the first ``top`` labels of the task's retrieval
    ranking (:meth:`~mistill.tasks.base.Task.retrieval_ranking` of the note's text) against its
    gold codes (:data:`RETRIEVAL_COUNTS`, then ``retrieval_top``); the ranking covers the
    note's shown candidate list (``scope`` ``candidates``; a note without one: ``labels``) or
    ``labels`` (``inventory``).
    Empty (no rows, no columns) for a task without a retrieval baseline."""
    rows = []
    for note in notes:
        pool = note.shortlist if scope == "candidates" and note.shortlist else labels
        ranked = task.retrieval_ranking(note.text, pool)
        if ranked is None:
            return pd.DataFrame()
        tp, fp, fn = set_counts(ranked[:top], note.gold_codes)
        rows.append({"retrieval_tp": tp, "retrieval_fp": fp, "retrieval_fn": fn, "retrieval_top": top})
    return pd.DataFrame(rows, columns=[*RETRIEVAL_COUNTS, "retrieval_top"])


def generation_metrics(records: list[dict]) -> dict[str, float]:
    """Counts and rates over the notes' records (rates over every generated note)."""
    n = len(records)

    def count(key: str) -> int:
        return sum(bool(r[key]) for r in records)

    tokens = np.array([r["n_tokens"] for r in records], dtype=float)
    metrics: dict[str, float] = {
        "n_notes": n, "n_valid": count("valid"), "n_capped": count("capped"),
        "n_degenerate": count("degenerate"), "n_parsed": count("parsed"),
        "n_closed_think": count("closed_think"),
        "valid_rate": count("valid") / n, "cap_rate": count("capped") / n,
        "degenerate_rate": count("degenerate") / n, "parsed_rate": count("parsed") / n,
        "mean_generated_tokens": float(tokens.mean()),
        "median_generated_tokens": float(np.median(tokens)),
        "max_generated_tokens": float(tokens.max()),
        "n_out_of_inventory": sum(r["n_out_of_inventory"] for r in records),
        "n_malformed_entries": sum(r["n_malformed"] for r in records),
        "mean_codes": float(np.mean([len(r["codes"]) for r in records])),
    }
    for reason, k in Counter(r["reason"] for r in records).items():
        metrics[f"reason/{reason}"] = k
    for reason, k in Counter(r["degenerate_reason"] for r in records if r["degenerate"]).items():
        metrics[f"degenerate/{reason}"] = k
    return metrics


def traced_corpus(corpus: Corpus, notes: list[Note], records: dict[str, dict],
                  traces: dict[str, str]) -> Corpus:
    """The notes whose generation is valid and closed ``</think>``, carrying it as their trace."""
    kept = [replace(n, teacher_trace=traces[n.note_id]) for n in notes
            if records[n.note_id]["closed_think"]]
    return Corpus(name=corpus.name, privacy=corpus.privacy, inventory=corpus.inventory,
                  notes=kept, meta=corpus.meta)


def run_generate(cfg: GenerateConfig) -> str:
    """Generate a trace per selected note; returns the run id (an identical finished run is reused)."""
    check_config(cfg)
    prepared = load_prepared(cfg.prepare_run)
    corpus, inventory = prepared.corpus, prepared.inventory
    notes = selected_notes(prepared, cfg.split, cfg.max_notes)  # refuses a split without notes
    device = stage_device(cfg.device)
    tags = {TAG_SOURCE_PREPARE: cfg.prepare_run, TAG_BACKEND: resolve_backend(cfg.backend, device)}
    with open_stage("generate", cfg, prepared, inputs={"prepare": cfg.prepare_run}, tags=tags) as run:
        if run.reused:
            return run.run_id
        guard = run.guard
        if not guard.allows_text and current_world().leader:
            run.set_tags({TAG_ENCLAVE_DIR: str(run.enclave_dir)})
        decoding = cfg.decoding()
        todo = pending_notes(run, NOTES, notes, desc="generate")
        thinking = template_has_thinking(load_tokenizer(cfg.model))
        if not thinking and current_world().leader:
            print(f"generate: the chat template of {cfg.model} has no thinking switch; "
                  "generations without think tags count as closed reasoning of length 0")
        task = task_for(inventory)
        if todo:
            with make_backend(cfg.backend, cfg.model, decoding, device=device, dtype=cfg.dtype) as backend:
                read = task.answer_reader(inventory.codes)
                chunk = cfg.batch_size or call_size(backend)
                bar = track(total=len(todo), desc=progress_label(f"generate ({backend.name})"))
                for start in range(0, len(todo), chunk):
                    batch = todo[start:start + chunk]
                    items = [(prepared.prompt(n, backend.tokenizer).text,
                              note_seed(decoding, n.note_id)) for n in batch]
                    for note, gen in zip(batch, backend.generate_many(items), strict=True):
                        guard.protect([gen.text])
                        record = generation_record(note, gen, read)
                        trace = {TRACE_FILE: gen.text}
                        if guard.allows_text:
                            run.write_note(NOTES, note.note_id, {RECORD_FILE: record, **trace})
                        else:  # restricted: the text stays in this machine's enclave
                            run.write_note(NOTES, note.note_id, {RECORD_FILE: record}, local_files=trace)
                        bar.update(1)
                bar.close()
        if not notes_written(run, NOTES, notes):
            return run.run_id
        records: dict[str, dict] = {}
        traces: dict[str, str] = {}
        for note in notes:  # every generated text is protected before anything is logged
            records[note.note_id] = run.load_note(NOTES, note.note_id, RECORD_FILE)
            traces[note.note_id] = _stored_trace(run, note.note_id)
            guard.protect([traces[note.note_id]])

        ordered = [records[n.note_id] for n in notes]
        out = traced_corpus(corpus, notes, records, traces)
        if out.notes:
            _save_traced(run, out, prepared, cfg, guard.allows_text)
        else:  # a corpus file must hold notes: no traced corpus, said in a tag and the metrics
            run.set_tags({TAG_TRACED: "none"})
            print("generate: no generation was valid with a closed </think>: no traced corpus")

        table = pd.DataFrame([{k: (" ".join(v) if k == "codes" else v) for k, v in r.items()
                               if k != "decoding"} for r in ordered])
        counts = answer_counts(notes, ordered, task)
        retrieval = retrieval_counts(notes, task, inventory.codes, cfg.retrieval_top, cfg.retrieval_scope)
        table = pd.concat([table, counts, retrieval], axis=1)
        outcomes = task.execute_answers(notes, [traces[n.note_id] for n in notes]) if current_world().leader \
            else None
        if outcomes is not None:  # App. P: pass@1 from the sandboxed tests (a run of the leader only)
            table["verdict"] = outcomes
            table["passed"] = [int(o == "passed") for o in outcomes]
        run.log_table("generations", table)
        run.log_json("decoding.json", {**ordered[0]["decoding"], "seed_rule": "note_seed(seed, note_id)",
                                       "model": cfg.model, "thinking_template": thinking})
        metrics = generation_metrics(ordered)
        graded = counts[counts["n_gold"] > 0] if "n_gold" in counts else counts.iloc[:0]
        for key in ANSWER_SCORES:  # a free-text answer's scores, averaged over the notes
            if key in counts and len(counts):
                metrics[key] = float(counts[key].mean())
        if outcomes is not None:
            metrics["pass_at_1"] = float(np.mean(table["passed"]))
            metrics.update({f"verdict/{o}": float(n) for o, n in Counter(outcomes).items()})
        if len(graded):  # the model's own answers against the notes' gold (App. P: the teacher's native micro-F1)
            tp, fp, fn = (int(graded[k].sum()) for k in ("tp", "fp", "fn"))
            metrics["answer_micro_f1"] = prf_from_counts(tp, fp, fn)[2]
            metrics["n_graded_notes"] = len(graded)
            if len(retrieval):  # App. P: a retrieval ranking's top labels on the same inputs
                tp, fp, fn = (int(retrieval.loc[graded.index, k].sum()) for k in RETRIEVAL_COUNTS)
                metrics["retrieval_micro_f1"] = prf_from_counts(tp, fp, fn)[2]
        metrics["n_traced_notes"] = len(out)
        metrics["thinking_template"] = float(thinking)
        run.log_metrics(metrics)
        print(f"generate: {len(notes)} notes, valid {metrics['valid_rate']:.2f}, capped "
              f"{metrics['cap_rate']:.2f}, {len(out)} traced notes -> run {run.run_id}")
        return run.run_id


def _save_traced(run, out: Corpus, prepared: Prepared, cfg: GenerateConfig, allows_text: bool) -> None:
    """Save the traced corpus like a prepare run does: data dir, tags, index, data artifacts."""
    data_dir = prepared_data_dir(out.name, run.run_id)
    identity = save_prepared(data_dir, out, {"remove_discharge_diagnosis": prepared.remove_discharge_diagnosis,
                                  "narrow_instruction": prepared.narrow_instruction,
                                  "source_prepare_run": cfg.prepare_run, "generate_model": cfg.model},
                             run_id=run.run_id, identity=run.params)
    run.set_tags({TAG_DATA_DIR: str(data_dir), TAG_CORPUS_DIGEST: out.digest, TAG_TRACED: len(out),
                  TAG_DATA_IDENTITY: identity})
    index_df = corpus_index(out)
    run.log_dataset(index_df, name=f"{out.name}-traced-index", digest=out.digest, context="corpus")
    run.log_table("corpus_index", index_df)
    run.log_artifact_file(data_dir / INVENTORY_FILE, "data")
    if allows_text:
        run.log_artifact_file(data_dir / CORPUS_FILE, "data")
        run.log_artifact_file(data_dir / CORPUS_META_FILE, "data")


def _stored_trace(run, note_id: str) -> str:
    """A finished note's generated text: its artifact, or (restricted) its local file in the
    run's enclave, checked against the note's ``_DONE`` (absent on this machine: an error naming
    the run; restricted traces are never stored in MLflow)."""
    return run.load_note(NOTES, note_id, TRACE_FILE).decode("utf-8")


__all__ = ["GenerateConfig", "run_generate", "generation_record", "generation_metrics",
           "traced_corpus", "selected_notes", "check_config"]
