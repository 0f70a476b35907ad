"""The ``shortlist`` stage: the retrieved candidate list every distillation arm sees (App. A).

It reads a ``prepare`` run, trains the retriever's linear head on notes of patients disjoint
from that corpus (and from any ``exclude_prepare_runs``), ranks the inventory for every note,
sweeps K, applies the pre-registered K rule, and writes a new prepared data directory whose
notes carry their shortlist (``Note.shortlist``). The run is tagged like a ``prepare`` run
(``mistill.data_dir``, the same corpus name), so ``load_prepared(<shortlist run id>)`` works
and every downstream stage takes the shortlist run id as its ``prepare_run``: their prompts
then list the shortlist instead of the whole inventory.

Logged: ``recall_sweep`` (completed and uncompleted recall per K on the validation notes and
on the corpus), ``k_decision.json``, ``retriever_baseline`` (Table 44: the first k codes and the
whole shortlist scored as predictions on the ``baseline_split`` notes), ``shortlists.json``
(each note's shortlist in rank order), ``retriever_train_notes.csv`` (ids of the head's
training notes), the corpus index, and the data files when the corpus's text may be logged.
Only ids, codes and numbers reach MLflow for a restricted corpus.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import pandas as pd

from mistill.config import Config
from mistill.data.corpus import Corpus, Note
from mistill.data.shortlist import (FUSION_RULES, Retriever, RetrieverSettings, baseline_rows, complete_with_siblings,
                                    k_grid_for, macro_code_recall, micro_recall, recall_sweep, select_k,
                                    split_training_notes)
from mistill.data.synthetic import make_synthetic_corpus
from mistill.errors import MistillInputError
from mistill.io import write_text
from mistill.models.encoder import EMBEDDED_ENCODER, load_encoder
from mistill.stages.common import (CORPUS_FILE, CORPUS_META_FILE, INVENTORY_FILE, TAG_DATA_DIR, TAG_DATA_IDENTITY,
                                   Prepared, corpus_index, load_prepared, prepared_data_dir, require_notes,
                                   save_prepared, shown_patient_ids)
from mistill.stages.runner import open_stage
from mistill.tracking.naming import TAG_CORPUS_DIGEST
from mistill.validation import (check_choice, check_counts, check_device, check_interval, check_model_spec, check_name,
                                check_no_text_fields, check_non_negative, check_not_empty, check_positive, check_run_id,
                                check_run_ids, check_seed)

PROMPT_ORDERS = ("inventory", "rank")
TAG_SOURCE_PREPARE = "mistill.shortlist.source_prepare_run"
TAG_TRAIN_PREPARE = "mistill.shortlist.train_prepare_run"
TAG_K = "mistill.shortlist.k"


@dataclass(frozen=True)
class ShortlistConfig(Config):
    """The retriever, its training notes, the K rule and the baseline rows.

    prepare_run: the corpus to shortlist (every note gets a shortlist).
    encoder: ``embedded:all-minilm-l6-v2`` or a local sentence-embedding model directory
        (gte-large for paper-scale runs); ``device``: ``cpu``, ``cuda``, ``cuda:<n>``, ``mps``
        or ``auto`` (CUDA when available).
    chunk_words: words per note chunk; ``batch_size``: encoder batch.
    train_prepare_run: a prepare run whose ``train_split`` notes (all when empty) train the
        head (e.g. the MIMIC-IV train split). When empty and the corpus is synthetic,
        ``train_synthetic_notes`` notes are generated with ``train_seed`` on the same inventory.
        Notes of the corpus's patients and of ``exclude_prepare_runs``' patients are dropped.
    fusion, fusion_weight, rrf_k: the fusion rule (``rrf`` or ``zsum``; see
        :mod:`mistill.data.shortlist`), the head's weight, the RRF constant.
    l2, lr, epochs, head_batch_size, seed: the logistic regression's training.
    k: a fixed K (0: the K rule picks it); ``k_grid``: the sweep (empty: the default grid);
        ``target_recall``: the rule's target; ``siblings_of``: siblings of the first
        ``min(K, siblings_of)`` codes complete the list; ``val_split``: the validation notes.
    baseline_split, baseline_ks: the notes (empty: all) and cut-offs of the baseline rows.
    prompt_order: order of the prompt's lines: ``inventory`` (the shared inventory order, so the
        retriever's ranking is no positional cue) or ``rank``.
    """

    prepare_run: str = ""
    encoder: str = EMBEDDED_ENCODER
    device: str = "cpu"
    chunk_words: int = 128
    batch_size: int = 32
    train_prepare_run: str = ""
    train_split: str = "train"
    train_synthetic_notes: int = 48
    train_seed: int = 1
    exclude_prepare_runs: tuple[str, ...] = ()
    fusion: str = "rrf"
    fusion_weight: float = 0.5
    rrf_k: float = 60.0
    l2: float = 1e-3
    lr: float = 1e-2
    epochs: int = 200
    head_batch_size: int = 512
    seed: int = 0
    k: int = 0
    k_grid: tuple[int, ...] = ()
    target_recall: float = 0.9
    siblings_of: int = 200
    val_split: str = "val"
    baseline_split: str = "test"
    baseline_ks: tuple[int, ...] = (5, 10, 20, 50, 100, 200)
    prompt_order: str = "inventory"

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.prepare_run, "prepare_run")
        check_run_id(self.train_prepare_run, "train_prepare_run")
        check_run_ids(self.exclude_prepare_runs, "exclude_prepare_runs")
        check_model_spec(self.encoder, "encoder")
        for field in ("train_split", "val_split", "baseline_split"):
            check_name(getattr(self, field), field, "a split", allow_empty=True)
        check_not_empty(self.encoder, "encoder", "a sentence-embedding model")
        check_device(self.device, extra=("auto",))
        check_positive(self.chunk_words, "chunk_words")
        check_positive(self.batch_size, "batch_size")
        check_non_negative(self.train_synthetic_notes, "train_synthetic_notes")
        check_seed(self.train_seed, "train_seed")
        check_choice(self.fusion, FUSION_RULES, "fusion")
        check_interval(self.fusion_weight, "fusion_weight")
        check_non_negative(self.rrf_k, "rrf_k")
        check_non_negative(self.l2, "l2")
        check_positive(self.lr, "lr")
        check_positive(self.epochs, "epochs")
        check_positive(self.head_batch_size, "head_batch_size")
        check_seed(self.seed)
        check_non_negative(self.k, "k", "0: the K rule")
        check_counts(self.k_grid, "k_grid", non_empty=False, unique=False)
        check_interval(self.target_recall, "target_recall", low_open=True)
        check_non_negative(self.siblings_of, "siblings_of")
        check_counts(self.baseline_ks, "baseline_ks", non_empty=False, unique=False)
        check_choice(self.prompt_order, PROMPT_ORDERS, "prompt_order")

    def settings(self, remove_discharge_diagnosis: bool) -> RetrieverSettings:
        return RetrieverSettings(chunk_words=self.chunk_words, batch_size=self.batch_size,
                                 remove_discharge_diagnosis=remove_discharge_diagnosis,
                                 fusion=self.fusion, fusion_weight=self.fusion_weight,
                                 rrf_k=self.rrf_k, l2=self.l2, lr=self.lr, epochs=self.epochs,
                                 head_batch_size=self.head_batch_size, seed=self.seed)


def _check_config(cfg: ShortlistConfig) -> None:
    """Refuse what the values alone cannot show (they are checked when the config is built):
    the corpus to shortlist must be named."""
    if not cfg.prepare_run:
        raise MistillInputError("a prepare run id is required", field="prepare_run")


def excluded_patients(prepared: Prepared, exclude_runs: tuple[str, ...]) -> set[str]:
    """Every patient of the corpus and of the other prepare runs named."""
    patients = {n.patient_id for n in prepared.corpus.notes}
    for run_id in exclude_runs:
        patients |= {n.patient_id for n in load_prepared(run_id).corpus.notes}
    return patients


def training_pool(cfg: ShortlistConfig, prepared: Prepared) -> list[Note]:
    """The candidate training notes, before the patient exclusion (refused when empty)."""
    if cfg.train_prepare_run:
        train = load_prepared(cfg.train_prepare_run)
        notes = [n for n in train.corpus.notes if not cfg.train_split or n.split == cfg.train_split]
        return require_notes(notes, cfg.train_split, train, field="train_split", need_trace=False)
    if prepared.corpus.privacy != "synthetic":
        raise MistillInputError("a non-synthetic corpus needs a training corpus for the linear "
                                "head (a prepare run of, e.g., the MIMIC-IV train split)",
                                field="train_prepare_run")
    if cfg.train_synthetic_notes < 1:
        raise MistillInputError("must be positive without a train_prepare_run",
                                field="train_synthetic_notes")

    return make_synthetic_corpus(n_notes=cfg.train_synthetic_notes, seed=cfg.train_seed,
                                 inventory=prepared.inventory, splits={"train": 1.0}).notes


def _sweep_table(ranked: list[list[str]], notes: list[Note], cfg: ShortlistConfig, inventory):
    ks = k_grid_for(len(inventory), cfg.k_grid)
    gold = [n.gold_codes for n in notes]
    val = [i for i, n in enumerate(notes) if n.split == cfg.val_split]
    corpus = recall_sweep(ranked, gold, inventory, ks, cfg.siblings_of)
    valid = recall_sweep([ranked[i] for i in val], [gold[i] for i in val], inventory, ks,
                         cfg.siblings_of)
    table = valid.add_prefix("val_").rename(columns={"val_k": "k"}).merge(
        corpus.add_prefix("corpus_").rename(columns={"corpus_k": "k"}), on="k")
    return table, len(val)


def _recall_at_k(ranked: list[list[str]], lists: list[list[str]], notes: list[Note], k: int,
                 val_split: str) -> dict[str, float]:
    """Recall of the chosen K (uncompleted and completed) on the validation notes and the corpus."""
    out: dict[str, float] = {}
    for name, idx in (("val", [i for i, n in enumerate(notes) if n.split == val_split]),
                      ("corpus", list(range(len(notes))))):
        if not idx:
            continue
        gold = [notes[i].gold_codes for i in idx]
        out[f"{name}_recall"] = macro_code_recall([ranked[i][:k] for i in idx], gold)
        out[f"{name}_recall_completed"] = macro_code_recall([lists[i] for i in idx], gold)
        out[f"{name}_micro_recall_completed"] = micro_recall([lists[i] for i in idx], gold)
    return out


def run_shortlist(cfg: ShortlistConfig) -> str:
    """Shortlist every note of ``cfg.prepare_run``; returns the run id (reused when identical)."""
    _check_config(cfg)
    prepared = load_prepared(cfg.prepare_run)
    corpus, inventory = prepared.corpus, prepared.inventory
    if cfg.k > len(inventory):
        raise MistillInputError(f"K = {cfg.k} exceeds the inventory's {len(inventory)} codes",
                                field="k")
    pool = training_pool(cfg, prepared)  # its input errors come before any run
    tags = {TAG_SOURCE_PREPARE: cfg.prepare_run, "mistill.encoder": cfg.encoder}
    if cfg.train_prepare_run:
        tags[TAG_TRAIN_PREPARE] = cfg.train_prepare_run
    with open_stage("shortlist", cfg, prepared, inputs={"prepare": cfg.prepare_run}, tags=tags) as run:
        if run.reused:
            return run.run_id
        guard = run.guard
        excluded = excluded_patients(prepared, cfg.exclude_prepare_runs)
        train, dropped = split_training_notes(pool, excluded)
        retriever = Retriever(load_encoder(cfg.encoder, device=cfg.device), inventory,
                              cfg.settings(prepared.remove_discharge_diagnosis))
        retriever.fit(train, excluded)
        notes = list(corpus.notes)
        ranked = retriever.rank(notes)

        sweep, n_val = _sweep_table(ranked, notes, cfg, inventory)
        decision = select_k(sweep, cfg.target_recall, ["val_recall_completed", "corpus_recall_completed"])
        k = cfg.k or decision["k"]
        decision.update(k_used=k, fixed_k=cfg.k, n_val_notes=n_val, n_corpus_notes=len(notes),
                        val_split=cfg.val_split, siblings_of=cfg.siblings_of)
        lists = [complete_with_siblings(r, k, cfg.siblings_of, inventory) for r in ranked]
        in_prompt = lists if cfg.prompt_order == "rank" else [sorted(s, key=inventory.index)
                                                                 for s in lists]
        out = Corpus(name=corpus.name, privacy=corpus.privacy, inventory=inventory, meta=corpus.meta,
                     notes=[replace(n, shortlist=tuple(p)) for n, p in zip(notes, in_prompt)])

        data_dir = prepared_data_dir(out.name, run.run_id)
        identity = save_prepared(data_dir, out, {"remove_discharge_diagnosis": prepared.remove_discharge_diagnosis,
                                      "narrow_instruction": prepared.narrow_instruction,
                                      "source_prepare_run": cfg.prepare_run, "shortlist_k": k},
                                 run_id=run.run_id, identity=run.params)
        run.set_tags({TAG_DATA_DIR: str(data_dir), TAG_CORPUS_DIGEST: out.digest, TAG_K: k,
                      TAG_DATA_IDENTITY: identity})
        index = corpus_index(out)
        run.log_dataset(index, name=f"{out.name}-index", digest=out.digest, context="corpus")
        index["n_shortlist"] = [len(s) for s in lists]
        index["gold_in_shortlist"] = [len(set(n.gold_codes) & set(s)) for n, s in zip(notes, lists)]
        run.log_table("corpus_index", index)
        run.log_artifact_file(data_dir / INVENTORY_FILE, "data")
        if guard.allows_text:
            run.log_artifact_file(data_dir / CORPUS_FILE, "data")
            run.log_artifact_file(data_dir / CORPUS_META_FILE, "data")

        run.log_table("recall_sweep", sweep)
        run.log_json("k_decision.json", decision)
        run.log_json("shortlists.json", {n.note_id: s for n, s in zip(notes, lists)})
        train_csv = run.work_dir / "artifacts" / "retriever_train_notes.csv"
        train_ids = shown_patient_ids(corpus.privacy, [n.patient_id for n in train])
        write_text(train_csv, pd.DataFrame({"note_id": [n.note_id for n in train],
                                            "patient_id": train_ids}).to_csv(index=False))
        run.log_artifact_file(train_csv)

        chosen = [i for i, n in enumerate(notes) if n.split == cfg.baseline_split]
        label = cfg.baseline_split if chosen else "all"
        chosen = chosen or list(range(len(notes)))
        freq = Counter(c for n in train for c in n.gold_codes)
        baseline = baseline_rows([lists[i] for i in chosen], [notes[i].gold_codes for i in chosen],
                                 cfg.baseline_ks, train_freq=freq, n_train=len(train))
        baseline.insert(0, "notes", label)
        run.log_table("retriever_baseline", baseline)

        metrics = {"n_notes": len(notes), "n_codes_inventory": len(inventory),
                   "n_patients": len({n.patient_id for n in notes}), "k": k,
                   "mean_shortlist_len": float(index["n_shortlist"].mean()),
                   "max_shortlist_len": float(index["n_shortlist"].max()),
                   "n_train_notes": len(train), "n_train_dropped": len(dropped),
                   "n_excluded_patients": len(excluded), "k_rule_reached": float(decision["reached"]),
                   **_recall_at_k(ranked, lists, notes, k, cfg.val_split)}
        run.log_metrics(metrics)
        print(f"shortlist: K={k} ({'fixed' if cfg.k else 'K rule'}), mean length "
              f"{metrics['mean_shortlist_len']:.1f} of {len(inventory)} codes, "
              f"{len(train)} training notes -> run {run.run_id}")
        return run.run_id
