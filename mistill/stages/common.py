"""What every stage shares: the prepared data of a run, the privacy guard, the model inputs.

A ``prepare`` run leaves its corpus and inventory in a local data directory (tag
``mistill.data_dir``); synthetic and public corpora are also logged as artifacts, so another
machine can download them. Restricted corpora never leave the local directory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mistill.data.corpus import Corpus, Note
from mistill.data.inventory import Inventory
from mistill.data.prompts import Prompt, build_prompt
from mistill.errors import MistillInputError

TAG_DATA_DIR = "mistill.data_dir"
CORPUS_FILE = "corpus.jsonl"
INVENTORY_FILE = "inventory.json"
CORPUS_META_FILE = "corpus_meta.json"


def mistill_root() -> Path:
    """Local state root (``$MISTILL_ROOT`` or ``./.mistill``)."""
    return Path(os.environ.get("MISTILL_ROOT", ".mistill"))


@dataclass
class Prepared:
    """The corpus and inventory a ``prepare`` run produced, and where they live."""

    corpus: Corpus
    inventory: Inventory
    data_dir: Path
    run_id: str
    remove_discharge_diagnosis: bool = True
    narrow_instruction: bool = True


def save_prepared(data_dir: Path, corpus: Corpus, meta: dict) -> None:
    from mistill.io import write_json

    data_dir.mkdir(parents=True, exist_ok=True)
    corpus.to_jsonl(data_dir / CORPUS_FILE)
    corpus.inventory.to_json(data_dir / INVENTORY_FILE)
    write_json(data_dir / CORPUS_META_FILE, {"name": corpus.name, "privacy": corpus.privacy,
                                              "digest": corpus.digest, **meta})


def load_prepared(run_id: str) -> Prepared:
    """Corpus and inventory of a ``prepare`` run (local data dir, else its logged artifacts)."""
    from mlflow.tracking import MlflowClient

    from mistill.io import read_json

    client = MlflowClient()
    try:
        run = client.get_run(run_id)
    except Exception as exc:  # noqa: BLE001 - MLflow raises several types for a missing run
        raise MistillInputError(f"no prepare run {run_id!r} on the tracking server ({exc.__class__.__name__})",
                                field="prepare_run") from None
    data_dir = Path(run.data.tags.get(TAG_DATA_DIR, ""))
    if not (data_dir / CORPUS_FILE).exists():
        if run.data.tags.get("mistill.privacy") not in ("synthetic", "public"):
            raise MistillInputError(
                f"the restricted corpus of run {run_id} is not in its local data dir {data_dir}; "
                "restricted text is never stored in MLflow", field="prepare_run")
        data_dir = mistill_root() / "data" / run_id
        data_dir.mkdir(parents=True, exist_ok=True)
        for name in (CORPUS_FILE, INVENTORY_FILE, CORPUS_META_FILE):
            # the returned path is where the file landed (MLflow 3 drops the "data/" folder)
            got = client.download_artifacts(run_id, f"data/{name}", str(data_dir.parent / f".{run_id}-dl"))
            os.replace(got, data_dir / name)
    meta = read_json(data_dir / CORPUS_META_FILE)
    inventory = Inventory.from_json(data_dir / INVENTORY_FILE)
    corpus = Corpus.from_jsonl(data_dir / CORPUS_FILE, name=meta["name"], privacy=meta["privacy"],
                               inventory=inventory)
    if corpus.digest != meta["digest"]:
        raise MistillInputError("corpus file changed since prepare (digest mismatch)",
                                file=str(data_dir / CORPUS_FILE), field="digest")
    return Prepared(corpus=corpus, inventory=inventory, data_dir=data_dir, run_id=run_id,
                    remove_discharge_diagnosis=bool(meta.get("remove_discharge_diagnosis", True)),
                    narrow_instruction=bool(meta.get("narrow_instruction", True)))


def corpus_index(corpus: Corpus):
    """One row per note: ids, split and gold codes (no text): safe to log for any corpus."""
    import pandas as pd

    return pd.DataFrame([{"note_id": n.note_id, "patient_id": n.patient_id, "split": n.split,
                          "n_gold": len(n.gold_codes), "gold_codes": " ".join(n.gold_codes),
                          "has_trace": bool(n.teacher_trace)} for n in corpus.notes])


def log_corpus_input(run, prepared: Prepared) -> None:
    """Lineage: the corpus a stage read, as an MLflow dataset input (ids and codes, no text)."""
    corpus = prepared.corpus
    run.log_dataset(corpus_index(corpus), name=f"{corpus.name}-index", digest=corpus.digest, context="input")


def privacy_guard(corpus: Corpus, extra_texts: Sequence[str] = ()):
    """The corpus's guard: note and trace texts are protected unless synthetic/public.

    The inventory's descriptions are public (ICD-10-CM), so n-grams inside them never count.
    """
    from mistill.tracking.privacy import PrivacyGuard

    texts = [n.text for n in corpus.notes] + [n.teacher_trace for n in corpus.notes if n.teacher_trace]
    public = [] if corpus.privacy != "restricted" else [corpus.inventory.description(c)
                                                         for c in corpus.inventory.codes]
    return PrivacyGuard(list(texts) + list(extra_texts), corpus.privacy, public_texts=public)


@dataclass
class NoteInput:
    """A note as one model sees it: prompt, trace, full text and its token ids and offsets."""

    note: Note
    prompt: Prompt
    trace: str
    full_text: str
    input_ids: torch.Tensor  # [pos]
    offsets: list[tuple[int, int]]

    @property
    def trace_offset(self) -> int:
        return self.prompt.trace_offset


def note_input(note: Note, inventory: Inventory, tokenizer, *, candidates: Sequence[str] | None = None,
               trace: str | None = None, remove_discharge_diagnosis: bool = True,
               narrow_instruction: bool = True, max_positions: int | None = None) -> NoteInput:
    """Build the prompt (chat template of ``tokenizer``) and tokenize prompt + trace once.

    candidates: the lines to list; None lists the note's retrieved shortlist when it has one
    (``Note.shortlist``, set by the ``shortlist`` stage), else the whole inventory.
    """
    trace = note.teacher_trace if trace is None else trace
    if not trace:
        raise MistillInputError("note has no teacher trace", note=note.note_id, field="teacher_trace")
    if candidates is None:
        candidates = note.shortlist
    prompt = build_prompt(note, candidates, inventory, tokenizer,
                          remove_discharge_diagnosis=remove_discharge_diagnosis,
                          narrow_instruction=narrow_instruction)
    full = prompt.full_text(trace)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    if max_positions is not None and ids.numel() > max_positions:
        raise MistillInputError(f"prompt + trace is {ids.numel()} tokens, beyond the model's "
                                f"{max_positions} positions", note=note.note_id, field="teacher_trace")
    return NoteInput(note=note, prompt=prompt, trace=trace, full_text=full, input_ids=ids,
                     offsets=[tuple(o) for o in enc["offset_mapping"]])


def phase_events(ni: NoteInput, codes: Sequence[str], tokenizer, *, p2c_cap: int = 2,
                 require_think: bool = True) -> list:
    """The decision events (P1, P2, P2C; no NULL) of ``ni``'s trace, realized in ``tokenizer``
    by the instrument's anchor rule; events the tokenizer cannot realize are dropped."""
    from mistill.instrument.events import extract_events, realize_events

    events = extract_events(ni.note.note_id, ni.trace, codes, tokenizer=tokenizer, n_null=0, p2c_cap=p2c_cap,
                            require_think=require_think)
    return realize_events(events, full_text=ni.full_text, trace_offset=ni.trace_offset, tokenizer=tokenizer,
                          input_ids=ni.input_ids.tolist(), offsets=ni.offsets, codes=list(codes))


def model_positions(lm) -> int | None:
    cfg = lm.model.config
    return getattr(cfg, "max_position_embeddings", None)


LINK_TAGS = ("mistill.registered_model", "mistill.model_version", "mistill.model_alias")


@dataclass(frozen=True)
class Subject:
    """The model a readout stage reads: its spec, the arm / seed / precision it stands for, and
    the registry tags linking the readout to a trained arm (empty for a plain model)."""

    spec: str
    arm: str | None = None
    seed: str | None = None
    precision: str | None = None
    links: dict[str, str] = field(default_factory=dict)


def trained_subject(train_run: str) -> Subject:
    """A ``train`` run as a subject: the checkpoint ``run:<id>``, its arm, seed and precision tags
    and its registered model, version and alias."""
    tags = RunReader(train_run, field="train_run").tags
    if tags.get("mistill.stage") != "train":
        raise MistillInputError(f"run {train_run} is a {tags.get('mistill.stage')!r} run, not a train run",
                                field="train_run")
    return Subject(spec=f"run:{train_run}", arm=tags.get("mistill.arm"), seed=tags.get("mistill.seed"),
                   precision=tags.get("mistill.precision"), links={k: tags[k] for k in LINK_TAGS if k in tags})


class RunReader:
    """Read another stage's run: its typed config and its (per-note) artifacts.

    Files are read from the local work dir of that run when present (the same machine ran it),
    else downloaded once into it.
    """

    def __init__(self, run_id: str, *, field: str = "run") -> None:
        from mlflow.tracking import MlflowClient

        self.run_id = run_id
        self.client = MlflowClient()
        try:
            self.run = self.client.get_run(run_id)
        except Exception as exc:  # noqa: BLE001
            raise MistillInputError(f"no run {run_id!r} on the tracking server ({exc.__class__.__name__})",
                                    field=field) from None
        if self.run.info.status != "FINISHED":
            raise MistillInputError(f"input run {run_id} is {self.run.info.status}, not FINISHED", field=field)
        self.work_dir = mistill_root() / "work" / run_id
        self._config: dict | None = None

    @property
    def tags(self) -> dict[str, str]:
        return dict(self.run.data.tags)

    @property
    def config(self) -> dict:
        """The run's typed arguments (from its ``config.json``)."""
        if self._config is None:
            from mistill.io import read_json

            self._config = read_json(self.file("config.json"))["config"]
        return self._config

    def file(self, artifact_path: str) -> Path:
        """Local path of an artifact (downloaded into the run's work dir if needed)."""
        import tempfile

        local = self.work_dir / artifact_path
        if local.is_file():
            return local
        local.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=local.parent, prefix=".dl-") as tmp:
            try:
                got = self.client.download_artifacts(self.run_id, artifact_path, tmp)
            except Exception:  # noqa: BLE001
                raise MistillInputError(f"artifact {artifact_path} missing from run {self.run_id}",
                                        field=artifact_path) from None
            os.replace(got, local)
        return local

    def note_file(self, subdir: str, note_id: str, filename: str) -> Path:
        return self.file(f"{subdir}/{note_id}/{filename}")
