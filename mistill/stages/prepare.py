"""The ``prepare`` stage: inventory, corpus and prompts, logged as a dataset with its digest.

Everything a ``prepare`` run reads is checked before its MLflow run exists: the parameters
(:meth:`PrepareConfig.validate`), every note (strict JSONL, UTF-8, note ids that can name a
folder, codes in the inventory) and every note's prompt (+ teacher trace) against the model's
positions. A refused input therefore leaves no run behind.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from mistill.config import Config, file_digest, folder_digest
from mistill.data.corpus import PRIVACY_LEVELS, Corpus, load_mimic_edin, safe_path_component, select_stratified
from mistill.data.inventory import Inventory
from mistill.data.prompts import build_prompt
from mistill.data.synthetic import make_synthetic_corpus
from mistill.errors import MistillInputError
from mistill.io import iter_jsonl
from mistill.models.loading import EMBEDDED_DEFAULT, _offline, embedded_float_copy, split_layer_spec, tiny_model
from mistill.stages.common import (CORPUS_FILE, CORPUS_META_FILE, INVENTORY_FILE, PATIENT_ID_MODES, TAG_DATA_DIR,
                                   TAG_DATA_IDENTITY, corpus_index, load_tokenizer, mistill_root, prepared_data_dir,
                                   privacy_guard, save_prepared)
from mistill.stages.registry import stage_help
from mistill.tasks import INVENTORY_TASKS, prompt_wording
from mistill.tasks.bigcodebench import load_bigcodebench_corpus
from mistill.tasks.eurlex import load_eurlex_corpus
from mistill.tasks.kodcode import load_kodcode_corpus
from mistill.tasks.musique import load_musique_corpus
from mistill.tasks.synthetic_catalog import make_catalog_corpus
from mistill.tracking.models import resolve_run_spec
from mistill.tracking.runs import StageRun
from mistill.validation import (check_at_least, check_choice, check_model_spec, check_name, check_no_text_fields,
                                check_non_negative, check_not_empty, check_path, check_seed, fail)

MIMIC_PREFIX = "mimic:"
PREPARE_TASKS: tuple[str, ...] = (*INVENTORY_TASKS, "kodcode")
"""What ``prepare -P task`` reads: a label space of :data:`mistill.tasks.INVENTORY_TASKS`, or
``kodcode``, KodCode's training problems prepared in BigCodeBench's label space (App. P's pilot)."""


@dataclass(frozen=True)
class PrepareConfig(Config):
    """Where the notes come from and how prompts are built.

    corpus: ``synthetic`` (the embedded default), a JSONL path, or ``mimic:<table path>``
        (the Edin et al. 2023 MIMIC-IV ICD-10 release; ``split_file`` optional).
    privacy: for JSONL/MIMIC corpora (``restricted`` unless said otherwise); synthetic is synthetic.
    inventory_size: codes in the synthetic corpus's inventory (whole categories).
    codes_per_note: the synthetic corpus's gold codes per note, ``min,max`` (inclusive, drawn per
        note with the corpus seed); a note's trace names each, so its events and length grow with
        them. Synthetic corpus only.
    codes_file: explicit code list restricting the inventory (one code per line).
    select_n: stratified greedy selection of App. A (0 keeps every note).
    model: whose chat template and tokenizer the prompts use; every note's prompt (+ teacher
        trace) must fit the model's positions.
    patient_ids: how ``corpus_index`` (the logged index and dataset input) shows patient ids:
        ``hashed`` (HMAC-SHA256 under the local salt of the mistill root, 16 hex characters:
        stable on this machine, unlinkable elsewhere), ``clear``, or ``auto`` (hashed for a
        restricted corpus, clear otherwise). The local corpus always keeps the real ids.

    task: the label space (:data:`mistill.tasks.INVENTORY_TASKS`): ``icd10`` (ICD-10-CM, the
        paper's); ``catalog``, the embedded parts catalogue (:mod:`mistill.tasks.synthetic_catalog`;
        ``corpus=synthetic`` only, ``codes_per_note`` its parts per order), a second label space the
        stages run on unchanged; or ``eurlex57k`` (App. P): ``corpus`` is the release's
        ``dataset`` folder of act documents, ``concepts_file`` its ``EURLEX57K.json``,
        ``hierarchy_file`` the local broader-concept file, ``traces_file`` optional teacher traces
        (JSONL ``celex_id``, ``trace``), and each act's prompt lists ``candidates`` concepts
        (**[recon]**: :func:`mistill.tasks.eurlex.candidate_list`; ``seed`` draws them); or
        ``musique`` (App. O): ``corpus`` is one of the MuSiQue-Ans release's JSONL files or a folder
        holding its train and dev files, ``traces_file`` optional teacher traces (JSONL ``id``,
        ``trace``); the prompt shows the passages and the question, and each question's
        candidates are its own (:func:`mistill.tasks.musique.load_musique_corpus`); or
        ``bigcodebench`` (App. P): ``corpus`` is the release's JSONL file, ``traces_file`` optional
        teacher traces (JSONL ``task_id``, ``trace``); the prompt is the problem's instruct prompt
        and each problem's API namings are its own
        (:func:`mistill.tasks.bigcodebench.load_bigcodebench_corpus`); or ``kodcode`` (App. P's
        programming pilot): ``corpus`` is a JSONL file of KodCode-V1 rows, ``traces_file`` optional
        teacher traces (JSONL ``question_id``, ``trace``), each problem a ``train`` note in
        BigCodeBench's label space (:func:`mistill.tasks.kodcode.load_kodcode_corpus`). The prepared
        inventory records the label space; every later stage reads it there.
    split_sizes: task musique: the training, ranking (``val``), selection (``select``) and
        evaluation (``test``) question counts, dealt by base question group (App. O's locked design:
        ``2000,102,1203,1610``; the first three from the train file, the last from the dev file,
        the rest left out; 0 leaves a split empty), and optionally the evidence pairs' slice of the
        dev file after the evaluation questions (``pairs``); empty keeps every question (train file: train,
        dev file: test). Task bigcodebench: the ranking (``train``), assessment (``val``) and fresh
        (``test``) problem counts, dealt in file order (the rest left out); empty: every problem a
        test note. Task kodcode: one count, the training problems drawn with ``order_seed`` (App. P:
        ``2000``); empty: every eligible problem, or those ``split_file`` lists (one
        ``question_id`` per line: a locked split such as the paper's).

    Files named by path (the corpus, ``codes_file``, ``split_file``, the EURLEX files; a corpus
    folder by its files) join the run's identity by content (:meth:`content_digests`): a file
    edited in place makes a new run.
    """

    corpus: str = "synthetic"
    corpus_name: str = ""
    privacy: str = "restricted"
    n_notes: int = 8
    seed: int = 0
    inventory_size: int = 120
    codes_per_note: tuple[int, ...] = (5, 25)
    codes_file: str = ""
    order_seed: int = 0
    split_file: str = ""
    select_n: int = 0
    select_split: str = ""
    model: str = EMBEDDED_DEFAULT
    remove_discharge_diagnosis: bool = True
    narrow_instruction: bool = True
    patient_ids: str = "auto"
    task: str = "icd10"
    concepts_file: str = ""
    hierarchy_file: str = ""
    traces_file: str = ""
    candidates: int = 20
    split_sizes: tuple[int, ...] = ()

    @property
    def corpus_path(self) -> str:
        """The file the corpus is read from (the MIMIC table for ``mimic:``); '' for synthetic."""
        if self.corpus == "synthetic":
            return ""
        return self.corpus[len(MIMIC_PREFIX):] if self.corpus.startswith(MIMIC_PREFIX) else self.corpus

    def content_digests(self) -> dict[str, str]:
        """sha256 of the corpus file (JSONL or MIMIC table), ``codes_file`` and ``split_file``."""
        paths = {"corpus": self.corpus_path, "codes_file": self.codes_file, "split_file": self.split_file,
                 "concepts_file": self.concepts_file, "hierarchy_file": self.hierarchy_file,
                 "traces_file": self.traces_file}
        digests = {name: file_digest(path) or folder_digest(path) for name, path in paths.items()}
        return {name: d for name, d in digests.items() if d is not None}

    def validate(self) -> None:
        """Refuse values no run can use, naming the field. Files are looked at by the stage
        (:func:`build_corpus`, still before its run), not here: a config stays readable where
        its files are not."""
        check_no_text_fields(self)
        check_not_empty(self.corpus, "corpus", "'synthetic', a JSONL path or mimic:<table path>")
        if self.corpus.startswith(MIMIC_PREFIX):
            check_not_empty(self.corpus_path, "corpus", "the MIMIC table after 'mimic:'")
        if self.corpus_path:
            check_path(self.corpus_path, "corpus", "a JSONL file or mimic:<table path>")
        check_name(self.corpus_name, "corpus_name", "the corpus", allow_empty=True)
        check_path(self.codes_file, "codes_file", "a code list file", allow_empty=True)
        check_path(self.split_file, "split_file", "a split file", allow_empty=True)
        check_name(self.select_split, "select_split", "a split", allow_empty=True)
        check_model_spec(self.model, "model")
        check_choice(self.patient_ids, PATIENT_ID_MODES, "patient_ids")
        check_choice(self.privacy, PRIVACY_LEVELS, "privacy")

        check_choice(self.task, PREPARE_TASKS, "task")
        if self.task == "catalog" and (self.corpus != "synthetic" or self.codes_file):
            fail(f"task {self.task}: its corpus is generated (corpus=synthetic, no codes_file)", "task")
        eurlex, musique = self.task == "eurlex57k", self.task == "musique"
        code, kodcode = self.task in ("bigcodebench", "kodcode"), self.task == "kodcode"
        if eurlex and (self.corpus == "synthetic" or self.corpus.startswith(MIMIC_PREFIX) or self.codes_file):
            fail("task eurlex57k reads the release: corpus is its dataset folder (no codes_file)", "corpus")
        if (musique or code) and (self.corpus == "synthetic" or self.corpus.startswith(MIMIC_PREFIX)
                                  or self.codes_file):
            fail(f"task {self.task} reads the release: corpus is its JSONL file{' or folder' if musique else ''} "
                 "(no codes_file)", "corpus")
        if eurlex:
            check_not_empty(self.concepts_file, "concepts_file", "the release's EURLEX57K.json")
        for name in ("concepts_file", "hierarchy_file", "traces_file"):
            check_path(getattr(self, name), name, "a file", allow_empty=True)
            if name == "traces_file" and getattr(self, name) and not (eurlex or musique or code):
                fail(f"{name} holds teacher traces of a release: task eurlex57k, musique, bigcodebench or kodcode "
                     "only", name)
            elif getattr(self, name) and not eurlex and name != "traces_file":
                fail(f"{name} is a file of the EURLEX57K release: task eurlex57k only", name)
        check_at_least(self.candidates, 1, "candidates")
        if self.split_sizes and not (musique or code):
            fail("split_sizes deals a release's records: task musique, bigcodebench or kodcode only", "split_sizes")
        n_sizes = (4, 5) if musique else (1,) if kodcode else (3,)
        if self.split_sizes and (len(self.split_sizes) not in n_sizes or min(self.split_sizes) < 0
                                 or not sum(self.split_sizes)):
            names = "train, val, select, test[, pairs]" if musique else "training problems" if kodcode else \
                "ranking, assessment, fresh"
            fail(f"split_sizes must be {' or '.join(map(str, n_sizes))} counts ({names}; 0 leaves a split empty, "
                 f"not all), not {self.split_sizes!r}", "split_sizes")
        check_at_least(self.n_notes, 1, "n_notes")
        check_at_least(self.inventory_size, 1, "inventory_size")
        if len(self.codes_per_note) != 2 or not 1 <= self.codes_per_note[0] <= self.codes_per_note[1]:
            fail(f"codes_per_note must be min,max with 1 <= min <= max, not {self.codes_per_note!r}",
                 "codes_per_note")
        check_seed(self.seed)
        check_seed(self.order_seed, "order_seed")
        check_non_negative(self.select_n, "select_n", "0 keeps every note")
        if self.select_split and not self.select_n:
            fail("select_split names the split to select from: it needs select_n > 0", "select_split")
        if self.split_file and not (self.corpus.startswith(MIMIC_PREFIX) or kodcode):
            fail("split_file applies to a mimic:<table> corpus or task kodcode only", "split_file")
        if self.split_file and kodcode and self.split_sizes:
            fail("task kodcode takes its training problems from split_file or split_sizes, not both", "split_sizes")
        check_not_empty(self.model, "model", "the model whose tokenizer and chat template build the prompts")
        name = self.corpus_name or (Path(self.corpus_path).stem if self.corpus_path
                                    and not self.corpus.startswith(MIMIC_PREFIX) else "")
        if name and not safe_path_component(name):
            fail(f"corpus name {name!r} must be letters, digits, '_', '.', '-' (not starting with '.'): it "
                 "names the experiment and the data folder", "corpus_name")
        if name and not self.corpus_name:  # the file's stem names the experiment: a name, not a sentence
            check_name(name, "corpus", "the corpus (the file's name is the corpus name unless corpus_name "
                       "is given)")


def build_corpus(cfg: PrepareConfig) -> Corpus:
    """The corpus the config names (with its inventory)."""
    if cfg.task == "catalog":
        corpus = make_catalog_corpus(n_notes=cfg.n_notes, seed=cfg.seed,
                                     items_range=(cfg.codes_per_note[0], cfg.codes_per_note[1]))
    elif cfg.task == "eurlex57k":
        corpus = load_eurlex_corpus(cfg.corpus, cfg.concepts_file, hierarchy_file=cfg.hierarchy_file,
                                    traces_file=cfg.traces_file, candidates=cfg.candidates, seed=cfg.seed, order_seed=cfg.order_seed,
                                    name=cfg.corpus_name or "eurlex57k", privacy=cfg.privacy)
    elif cfg.task == "bigcodebench":
        if not Path(cfg.corpus).is_file():
            raise MistillInputError("BigCodeBench JSONL file not found", file=cfg.corpus, field="corpus")
        corpus = load_bigcodebench_corpus(cfg.corpus, traces_file=cfg.traces_file, split_sizes=cfg.split_sizes,
                                          order_seed=cfg.order_seed, name=cfg.corpus_name or "bigcodebench",
                                          privacy=cfg.privacy)
    elif cfg.task == "kodcode":
        if not Path(cfg.corpus).is_file():
            raise MistillInputError("KodCode JSONL file not found", file=cfg.corpus, field="corpus")
        corpus = load_kodcode_corpus(cfg.corpus, traces_file=cfg.traces_file, split_sizes=cfg.split_sizes,
                                     split_file=cfg.split_file, order_seed=cfg.order_seed,
                                     name=cfg.corpus_name or "kodcode", privacy=cfg.privacy)
    elif cfg.task == "musique":
        corpus = load_musique_corpus(cfg.corpus, traces_file=cfg.traces_file, order_seed=cfg.order_seed,
                                     split_sizes=cfg.split_sizes, name=cfg.corpus_name or "musique",
                                     privacy=cfg.privacy)
    elif cfg.corpus == "synthetic":
        inv = Inventory.from_code_file(cfg.codes_file, order_seed=cfg.order_seed) if cfg.codes_file else None
        corpus = make_synthetic_corpus(n_notes=cfg.n_notes, seed=cfg.seed, inventory_size=cfg.inventory_size,
                                       n_codes_range=(cfg.codes_per_note[0], cfg.codes_per_note[1]),
                                       inventory=inv)
    else:
        inventory = (Inventory.from_code_file(cfg.codes_file, order_seed=cfg.order_seed) if cfg.codes_file
                     else Inventory.billable(order_seed=cfg.order_seed))
        if cfg.corpus.startswith(MIMIC_PREFIX):
            corpus = load_mimic_edin(cfg.corpus_path, inventory,
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


# ------------------------------------------------------------------------------ model length
def model_max_positions(spec: str) -> int | None:
    """The positions model ``spec`` takes: ``max_position_embeddings`` of its config (what the
    model stages check), read without loading weights; None when the config has none.

    ``tiny:`` models take ``tiny_model``'s default; layer selections (``@every-other``) keep
    the base model's positions; ``run:<id>`` reads the trained checkpoint's config.
    """
    base = split_layer_spec(spec)[0]
    if base.startswith("run:"):
        return model_max_positions(resolve_run_spec(base))
    if base.startswith("tiny:"):
        return int(inspect.signature(tiny_model).parameters["max_pos"].default)
    _offline()
    from transformers import AutoConfig  # deferred: transformers is slow to import

    if base == EMBEDDED_DEFAULT:
        path, gguf = str(embedded_float_copy()), ""
    else:
        path, _, gguf = base.partition("::")
    local = Path(path).expanduser()
    try:
        config = AutoConfig.from_pretrained(str(local) if local.exists() else path,
                                            **({"gguf_file": gguf} if gguf else {}))
    except (OSError, ValueError) as exc:
        raise MistillInputError(f"cannot read the config of {spec!r} offline ({str(exc).splitlines()[0]})",
                                field="model") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if value else None


@dataclass(frozen=True)
class PromptLength:
    """One note's model input in tokens, as the model stages tokenize it (no special tokens).

    prompt_tokens: the chat-templated prompt; total_tokens: prompt + teacher trace (the
    prompt alone for a note without a trace).
    """

    note_id: str
    prompt_tokens: int
    total_tokens: int
    candidate_lines: int
    has_trace: bool


EXACT_MARGIN = 64
"""Counts within this many tokens of the model's positions are re-counted on the whole text (a
merge across the one line break at the cut could shift a count by a token or two, not 64)."""


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_lengths(corpus: Corpus, tokenizer, *, remove_discharge_diagnosis: bool = True,
                   narrow_instruction: bool = True, max_positions: int | None = None) -> list[PromptLength]:
    """Token counts of every note's prompt and prompt + trace (the note's shortlist, else the
    whole inventory, as :func:`~mistill.instrument.inputs.note_input` builds them).

    Prompts listing the same candidates share their text up to the end of the last candidate
    line (the shared inventory prefix, about 105k tokens for the paper's 5,651 codes): that
    prefix is tokenized once, and each note's count is the prefix's plus its own remainder's
    plus a boundary correction measured on the group's first note by tokenizing it whole
    (tokenizers split at the line break after the last candidate line, so the correction is the
    same for every note of a group). A count within :data:`EXACT_MARGIN` of ``max_positions``
    is re-counted on the whole text, so the limit check never rests on the correction.
    """
    groups: dict[str, dict[str, int]] = {}  # prefix text -> its token count and corrections
    out: list[PromptLength] = []
    for note in corpus.notes:
        prompt = build_prompt(note, note.shortlist, corpus.inventory, tokenizer,
                              remove_discharge_diagnosis=remove_discharge_diagnosis,
                              narrow_instruction=narrow_instruction,
                              wording=prompt_wording(corpus.inventory.task))
        trace = note.teacher_trace or ""
        cut = prompt.span_in_text("lines")[1] if "lines" in prompt.parts else prompt.user_offset
        prefix, rest = prompt.text[:cut], prompt.text[cut:]
        if prefix not in groups:
            groups[prefix] = {"prefix": _n_tokens(tokenizer, prefix)}
        group = groups[prefix]
        counts = {"prompt": (rest, prompt.text)}
        if trace:
            counts["total"] = (rest + trace, prompt.text + trace)
        n: dict[str, int] = {}
        for kind, (tail, whole) in counts.items():
            split = group["prefix"] + _n_tokens(tokenizer, tail)
            if kind not in group:
                n[kind] = _n_tokens(tokenizer, whole)
                group[kind] = n[kind] - split
                continue
            n[kind] = split + group[kind]
            if max_positions is not None and abs(n[kind] - max_positions) <= EXACT_MARGIN:
                n[kind] = _n_tokens(tokenizer, whole)
        out.append(PromptLength(note_id=note.note_id, prompt_tokens=n["prompt"],
                                total_tokens=n.get("total", n["prompt"]), candidate_lines=len(prompt.line_spans),
                                has_trace=bool(trace)))
    return out


def check_prompt_lengths(lengths: list[PromptLength], max_positions: int | None, *, model: str,
                         file: str | None = None) -> None:
    """Refuse notes whose prompt (+ teacher trace) exceeds ``max_positions``, naming the first
    (with its line, for a JSONL ``file``) and counting the others."""
    if max_positions is None:
        return
    over = [x for x in lengths if x.total_tokens > max_positions]
    if not over:
        return
    first = over[0]
    if first.prompt_tokens > max_positions:
        what, n, fld = "prompt", first.prompt_tokens, "text"
    else:
        what, n, fld = "prompt + teacher trace", first.total_tokens, "teacher_trace"
    others = ""
    if len(over) > 1:
        shown = ", ".join(x.note_id for x in over[1:6]) + (", ..." if len(over) > 6 else "")
        others = f"; {len(over) - 1} more notes too long: {shown}"
    raise MistillInputError(f"{what} is {n} tokens, beyond the {max_positions} positions of model "
                            f"{model}{others}", file=file, note=first.note_id, field=fld,
                            line=_jsonl_line(file, first.note_id))


def _jsonl_line(file: str | None, note_id: str) -> int | None:
    """The line of a JSONL corpus file that holds ``note_id`` (None for another file)."""
    if not file or not file.endswith(".jsonl") or not Path(file).is_file():
        return None

    for lineno, row in iter_jsonl(file):
        if str(row.get("note_id")) == note_id:
            return lineno
    return None


# ------------------------------------------------------------------------------------ stage
def run_prepare(cfg: PrepareConfig) -> str:
    """Build, check and log the corpus; returns the run id (an identical finished run is reused).

    Parameters, notes and prompt lengths are checked before the MLflow run is created.
    """
    cfg.validate()
    corpus = build_corpus(cfg)
    tok = load_tokenizer(cfg.model)
    max_positions = model_max_positions(cfg.model)
    lengths = prompt_lengths(corpus, tok, remove_discharge_diagnosis=cfg.remove_discharge_diagnosis,
                             narrow_instruction=cfg.narrow_instruction, max_positions=max_positions)
    check_prompt_lengths(lengths, max_positions, model=cfg.model, file=cfg.corpus_path or None)
    guard = privacy_guard(corpus)
    with StageRun("prepare", cfg, corpus=corpus.name, guard=guard, corpus_digest=corpus.digest,
                  description=stage_help()["prepare"],
                  resume=True, root=mistill_root()) as run:
        if run.reused:
            print(f"prepare: reusing finished run {run.run_id}")
            return run.run_id
        data_dir = prepared_data_dir(corpus.name, run.run_id)
        identity = save_prepared(data_dir, corpus, {"remove_discharge_diagnosis": cfg.remove_discharge_diagnosis,
                                                    "narrow_instruction": cfg.narrow_instruction},
                                 run_id=run.run_id, identity=run.params)
        run.set_tags({TAG_DATA_DIR: str(data_dir), TAG_DATA_IDENTITY: identity})
        index = corpus_index(corpus, cfg.patient_ids)
        run.log_dataset(index, name=f"{corpus.name}-index", digest=corpus.digest, context="corpus")
        run.log_table("corpus_index", index)
        run.log_artifact_file(data_dir / INVENTORY_FILE, "data")
        if guard.allows_text:
            run.log_artifact_file(data_dir / CORPUS_FILE, "data")
            run.log_artifact_file(data_dir / CORPUS_META_FILE, "data")
        stats_df = pd.DataFrame([{"note_id": x.note_id, "prompt_tokens": x.prompt_tokens,
                                  "total_tokens": x.total_tokens, "candidate_lines": x.candidate_lines}
                                 for x in lengths if x.has_trace])
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
