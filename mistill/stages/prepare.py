"""The ``prepare`` stage: inventory, corpus and prompts, logged as a dataset with its digest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from mistill.config import Config
from mistill.data.corpus import Corpus, load_mimic_edin, select_stratified
from mistill.data.inventory import Inventory
from mistill.data.synthetic import make_synthetic_corpus
from mistill.errors import MistillInputError
from mistill.models.loading import EMBEDDED_DEFAULT
from mistill.stages.common import (CORPUS_FILE, CORPUS_META_FILE, INVENTORY_FILE, TAG_DATA_DIR, corpus_index,
                                   mistill_root, note_input, privacy_guard, save_prepared)


@dataclass(frozen=True)
class PrepareConfig(Config):
    """Where the notes come from and how prompts are built.

    corpus: ``synthetic`` (the embedded default), a JSONL path, or ``mimic:<table path>``
        (the Edin et al. 2023 MIMIC-IV ICD-10 release; ``split_file`` optional).
    privacy: for JSONL/MIMIC corpora (``restricted`` unless said otherwise); synthetic is synthetic.
    codes_file: explicit code list restricting the inventory (one code per line).
    select_n: stratified greedy selection of App. A (0 keeps every note).
    model: whose chat template and tokenizer the prompt statistics use.
    """

    corpus: str = "synthetic"
    corpus_name: str = ""
    privacy: str = "restricted"
    n_notes: int = 8
    seed: int = 0
    inventory_size: int = 120
    codes_file: str = ""
    order_seed: int = 0
    split_file: str = ""
    select_n: int = 0
    select_split: str = ""
    model: str = EMBEDDED_DEFAULT
    remove_discharge_diagnosis: bool = True
    narrow_instruction: bool = True


def build_corpus(cfg: PrepareConfig) -> Corpus:
    """The corpus the config names (with its inventory)."""
    if cfg.corpus == "synthetic":
        inv = Inventory.from_code_file(cfg.codes_file, order_seed=cfg.order_seed) if cfg.codes_file else None
        corpus = make_synthetic_corpus(n_notes=cfg.n_notes, seed=cfg.seed, inventory_size=cfg.inventory_size,
                                       inventory=inv)
    else:
        inventory = (Inventory.from_code_file(cfg.codes_file, order_seed=cfg.order_seed) if cfg.codes_file
                     else Inventory.billable(order_seed=cfg.order_seed))
        if cfg.corpus.startswith("mimic:"):
            corpus = load_mimic_edin(cfg.corpus[len("mimic:"):], inventory,
                                     split_file=cfg.split_file or None, privacy=cfg.privacy)
        else:
            if not Path(cfg.corpus).exists():
                raise MistillInputError("corpus file not found", file=cfg.corpus, field="corpus")
            corpus = Corpus.from_jsonl(cfg.corpus, name=cfg.corpus_name or Path(cfg.corpus).stem,
                                       privacy=cfg.privacy, inventory=inventory)
    if cfg.corpus_name and corpus.name != cfg.corpus_name:
        corpus = Corpus(name=cfg.corpus_name, privacy=corpus.privacy, notes=corpus.notes,
                        inventory=corpus.inventory, meta=corpus.meta)
    if cfg.select_n:
        pool = corpus.split(cfg.select_split).notes if cfg.select_split else corpus.notes
        chosen = select_stratified(pool, cfg.select_n, corpus.inventory, cfg.seed)
        corpus = corpus.subset([n.note_id for n in chosen])
    return corpus


def run_prepare(cfg: PrepareConfig) -> str:
    """Build and log the corpus; returns the run id (an identical finished run is reused)."""
    from mistill.models.loading import load_tokenizer
    from mistill.tracking.runs import StageRun

    corpus = build_corpus(cfg)
    guard = privacy_guard(corpus)
    with StageRun("prepare", cfg, corpus=corpus.name, guard=guard, corpus_digest=corpus.digest,
                  resume=True, root=mistill_root()) as run:
        if run.reused:
            print(f"prepare: reusing finished run {run.run_id}")
            return run.run_id
        data_dir = (mistill_root() / "data" / f"{corpus.name}-{corpus.digest[:12]}").resolve()
        save_prepared(data_dir, corpus, {"remove_discharge_diagnosis": cfg.remove_discharge_diagnosis,
                                         "narrow_instruction": cfg.narrow_instruction})
        run.set_tags({TAG_DATA_DIR: str(data_dir)})
        index = corpus_index(corpus)
        run.log_dataset(index, name=f"{corpus.name}-index", digest=corpus.digest, context="corpus")
        run.log_table("corpus_index", index)
        run.log_artifact_file(data_dir / INVENTORY_FILE, "data")
        if guard.allows_text:
            run.log_artifact_file(data_dir / CORPUS_FILE, "data")
            run.log_artifact_file(data_dir / CORPUS_META_FILE, "data")
        tok = load_tokenizer(cfg.model)
        stats = []
        for note in corpus.notes:
            if not note.teacher_trace:
                continue
            ni = note_input(note, corpus.inventory, tok,
                            remove_discharge_diagnosis=cfg.remove_discharge_diagnosis,
                            narrow_instruction=cfg.narrow_instruction)
            stats.append({"note_id": note.note_id, "prompt_tokens": len(tok(ni.prompt.text, add_special_tokens=False)["input_ids"]),
                          "total_tokens": int(ni.input_ids.numel()), "candidate_lines": len(ni.prompt.line_spans)})
        stats_df = pd.DataFrame(stats)
        if len(stats_df):
            run.log_table("prompt_stats", stats_df)
        summary = corpus.summary()
        run.log_metrics({"n_notes": len(corpus), "n_codes_inventory": len(corpus.inventory),
                         "n_patients": len({n.patient_id for n in corpus.notes}),
                         "mean_gold_codes": float(index["n_gold"].mean()) if len(index) else 0.0,
                         **({"median_total_tokens": float(stats_df["total_tokens"].median())} if len(stats_df) else {})})
        run.log_json("corpus_summary.json", summary)
        print(f"prepare: {len(corpus)} notes, {len(corpus.inventory)} codes -> run {run.run_id}")
        return run.run_id
