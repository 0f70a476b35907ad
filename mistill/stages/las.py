"""The ``las_simulator`` stage: fine-tune the LAS simulator once on the teacher's traces (App. K).

It reads a ``prepare`` run whose notes carry teacher traces, trains the simulator of
:mod:`mistill.evaluation.las` on the ``split`` notes (the teacher's training traces), saves the
frozen checkpoint to the run's work dir (``simulator/``) and logs it as artifacts: weights and
model config, ``simulator.json`` (base model, caps), and the tokenizer files only when the
corpus's text may be logged; never note or trace text. ``evaluate`` loads it with
:func:`mistill.evaluation.las.load_simulator` (``las_run``).

Metrics: ``train_loss`` per step, and on the ``val_split`` notes the sanity check
``val/las_teacher_mean`` (mean LAS of the teacher's own rationale), ``val/f1_with_rationale``,
``val/f1_note_only`` and ``val/unparsable_rate``; a per-note table ``val_las.csv`` (note ids
and numbers only).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.errors import MistillInputError
from mistill.evaluation.las import (INVENTORY_FILE, META_FILE, Simulator, encode_pair, las_per_note,
                                    load_simulator as load_simulator_from, save_simulator, set_f1, teacher_example,
                                    train_simulator)
from mistill.models.loading import EMBEDDED_DEFAULT
from mistill.stages.common import load_model, load_prepared, model_positions, require_notes
from mistill.stages.runner import open_stage
from mistill.tasks import task_for
from mistill.tracking.models import resolve_run_spec, run_artifact_dir
from mistill.validation import (check_at_least, check_device, check_dtype, check_model_spec, check_name,
                                check_no_text_fields, check_non_negative, check_not_empty, check_positive, check_run_id,
                                check_seed)

SIMULATOR_DIR = "simulator"
LOGGED_SUFFIXES = (".safetensors", ".json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "added_tokens.json")


def simulator_dir(run_id: str) -> Path:
    """Local checkpoint of ``las_simulator`` run ``run_id``: its work dir
    (``$MISTILL_ROOT/work/<run_id>/simulator``), else its ``simulator`` artifacts downloaded
    there once (:func:`mistill.tracking.models.run_artifact_dir`), with the inventory taken from
    the run's ``prepare`` input run."""
    local = run_artifact_dir(run_id, "simulator", stage="las_simulator", marker=META_FILE, field="las_run")
    if (local / INVENTORY_FILE).exists():
        return local
    client = MlflowClient()
    prepare_run = client.get_run(run_id).data.tags.get("mistill.input.prepare", "")
    with tempfile.TemporaryDirectory(dir=local, prefix=".dl-inventory-") as tmp:
        try:
            inv = client.download_artifacts(prepare_run, "data/inventory.json", tmp)
        except Exception:  # noqa: BLE001
            raise MistillInputError(f"the prepare run {prepare_run!r} of las_simulator run {run_id} "
                                    "logged no data/inventory.json", field="las_run") from None
        os.replace(inv, local / INVENTORY_FILE)
    return local


def load_simulator(run_id_or_path: str | Path, device: str = "cpu") -> Simulator:
    """The simulator a ``las_simulator`` run saved: a run id (local work dir, else its logged
    artifacts, :func:`simulator_dir`) or a checkpoint directory holding ``simulator.json``."""
    return load_simulator_from(run_id_or_path, device, locate_run=simulator_dir, resolve_run=resolve_run_spec)


@dataclass(frozen=True)
class LasSimulatorConfig(Config):
    """The LAS simulator's base model and its one fine-tuning.

    prepare_run: the corpus whose notes carry the teacher's traces.
    split: the notes trained on (the teacher's training traces); ``val_split``: the held-out
        notes of the sanity metrics (none found: no val metrics); ``max_val_notes``: at most this
        many of them, in corpus order (0: all).
    model: the simulator's base (``embedded:smollm2-135m``; ``tiny:qwen3`` in tests; Qwen3-1.7B
        in the paper).
    max_steps, lr, seed: plain AdamW, one note (both inputs) per step, seeded shuffled passes
        (max_steps >= 1, lr > 0, seed >= 0).
    max_answer_tokens: **[recon]** the decoding cap, and the budget the training answer is cut
        to fit (>= 4).
    max_note_words: keep only the first this many words of each note (0: whole notes, the
        paper's simulator, App. K), in training and prediction; a positive cap keeps CPU runs
        quick (the pipeline's demo passes 256); stored with the checkpoint.
    device, dtype: where and in which precision the simulator trains and predicts.
    """

    prepare_run: str = ""
    split: str = "train"
    val_split: str = "val"
    max_val_notes: int = 0
    model: str = EMBEDDED_DEFAULT
    max_steps: int = 8
    lr: float = 1e-4
    seed: int = 0
    max_answer_tokens: int = 96
    device: str = "cpu"
    dtype: str = "float32"
    max_note_words: int = 0

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.prepare_run, "prepare_run")
        check_not_empty(self.split, "split", "the split of the teacher's training traces")
        check_name(self.split, "split", "the split of the teacher's training traces")
        check_name(self.val_split, "val_split", "the split of the held-out notes", allow_empty=True)
        check_model_spec(self.model, "model")
        check_non_negative(self.max_val_notes, "max_val_notes", "0: every validation note")
        check_not_empty(self.model, "model", "a model spec")
        check_positive(self.max_steps, "max_steps")
        check_positive(self.lr, "lr")
        check_seed(self.seed)
        check_at_least(self.max_answer_tokens, 4, "max_answer_tokens")
        check_device(self.device)
        check_dtype(self.dtype)
        check_non_negative(self.max_note_words, "max_note_words", "0: whole notes")


def _examples(notes, index):
    return [teacher_example(n.note_id, n.text, n.teacher_trace, index) for n in notes if n.teacher_trace]


def run_las_simulator(cfg: LasSimulatorConfig) -> str:
    """Train (or reuse) the simulator; returns the run id."""
    import pandas as pd  # deferred: pandas only when the stage runs

    if not cfg.prepare_run:
        raise MistillInputError("las_simulator needs a prepare run", field="prepare_run")
    prepared = load_prepared(cfg.prepare_run)
    corpus = prepared.corpus
    train_notes = require_notes([n for n in corpus.notes if n.split == cfg.split and n.teacher_trace],
                                cfg.split, prepared)
    with open_stage("las_simulator", cfg, prepared, inputs={"prepare": cfg.prepare_run}, model=cfg.model) as run:
        if run.reused:
            return run.run_id
        guard = run.guard
        index = task_for(prepared.inventory).answer_index(prepared.inventory.codes)
        train = _examples(train_notes, index)
        lm = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
        positions = model_positions(lm)
        pairs = [encode_pair(ex, lm.tokenizer, max_answer_tokens=cfg.max_answer_tokens,
                             max_note_words=cfg.max_note_words, max_positions=positions) for ex in train]
        losses = train_simulator(lm.model, pairs, max_steps=cfg.max_steps, lr=cfg.lr, seed=cfg.seed)
        for step, loss in enumerate(losses):
            run.log_metrics({"train_loss": loss}, step=step)
        run.log_metrics({"train_loss_first": losses[0], "train_loss_last": losses[-1],
                         "n_train_notes": len(train)})

        out = run.work_dir / SIMULATOR_DIR
        meta = {"base_model": cfg.model, "dtype": cfg.dtype, "max_answer_tokens": cfg.max_answer_tokens,
                "max_note_words": cfg.max_note_words, "prepare_run": cfg.prepare_run,
                "n_codes": len(prepared.inventory)}
        save_simulator(out, lm.model, lm.tokenizer, prepared.data_dir / INVENTORY_FILE, meta)
        for path in sorted(out.iterdir()):  # weights, model config, simulator.json; no inventory
            if path.name == INVENTORY_FILE:
                continue
            if path.name in TOKENIZER_FILES:
                if guard.allows_text:
                    run.log_artifact_file(path, SIMULATOR_DIR)
            elif path.suffix in LOGGED_SUFFIXES:
                run.log_artifact_file(path, SIMULATOR_DIR)

        sim = Simulator(lm.model, lm.tokenizer, index, max_answer_tokens=cfg.max_answer_tokens,
                        max_note_words=cfg.max_note_words)
        val_notes = corpus.split(cfg.val_split).notes if cfg.val_split in corpus.splits else []
        val = _examples(val_notes, index)
        if cfg.max_val_notes > 0:
            val = val[:cfg.max_val_notes]
        rows = []
        texts = sim.generate_many([(ex.note_text, ex.rationale) for ex in val] + [(ex.note_text, None) for ex in val])
        for k, ex in enumerate(val):
            with_r = set(sim.parse(texts[k]))
            without = set(sim.parse(texts[len(val) + k]))
            teacher = set(ex.answer)
            rows.append({"note_id": ex.note_id, "n_teacher": len(teacher), "n_with": len(with_r),
                         "n_without": len(without), "f1_with_rationale": set_f1(with_r, teacher),
                         "f1_note_only": set_f1(without, teacher),
                         "las": las_per_note(with_r, without, teacher)})
        if rows:
            df = pd.DataFrame(rows)
            run.log_table("val_las", df)
            run.log_metrics({"val/las_teacher_mean": float(df["las"].mean()),
                             "val/f1_with_rationale": float(df["f1_with_rationale"].mean()),
                             "val/f1_note_only": float(df["f1_note_only"].mean()),
                             "val/unparsable_rate": sim.n_unparsable / max(sim.n_predictions, 1),
                             "val/n_notes": len(rows)})
        print(f"las_simulator: {len(train)} notes, loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
              f"{len(rows)} val notes -> run {run.run_id}")
        return run.run_id
