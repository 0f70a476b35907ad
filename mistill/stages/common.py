"""What every stage shares: the prepared data of a run, the privacy guard, the model inputs.

A ``prepare`` run leaves its corpus and inventory in a local data directory of its own (tag
``mistill.data_dir``), whose ``corpus_meta.json`` records the run and the data's identity,
checked on every load; synthetic and public corpora are also logged as artifacts, so another
machine can download them. Restricted corpora never leave the local directory.

:class:`RunReader` reads another stage's run; a per-note file that run kept as restricted model
text (a *local file* in its enclave, see :meth:`mistill.tracking.runs.StageRun.write_note`) is
read from the enclave on this machine and checked against its ``_DONE`` sha256, never downloaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import tempfile
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import mlflow
from mlflow.entities import LoggedModelInput, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mistill.data.corpus import Corpus, Note
from mistill.data.inventory import Inventory
from mistill.data.prompts import Prompt, build_prompt
from mistill.errors import MistillInputError
from mistill.evaluation import backends, sampling
from mistill.instrument.inputs import NoteInput, note_input
from mistill.io import dumps, mistill_root, read_json, sha256_file, write_json
from mistill.models import loading
from mistill.models.loading import check_model_present, split_layer_spec
from mistill.tasks import prompt_wording
from mistill.tracking.auth import verify_done
from mistill.tracking.models import checkpoint_logged_model, resolve_run_spec
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.enclave import (ENCLAVE_DIR, LOCAL_FILES_KEY, TAG_ENCLAVE_DIR, enclave_missing_error,
                                      verify_local_note_file)
from mistill.tracking.experiments import quiet_downloads
from mistill.tracking.identity import CONTENT_SUFFIX, params_digest, repo_file, typed_equal
from mistill.tracking.naming import CONFIG_ARTIFACT, DONE_MARKER, TAG_CORPUS_DIGEST, TAG_STAGE
from mistill.tracking.notes import verify_note_file

if TYPE_CHECKING:
    from mlflow.entities import Run

TAG_DATA_DIR = "mistill.data_dir"
TAG_DATA_IDENTITY = "mistill.data_identity"
"""sha256 of the prepared data's ``corpus_meta.json`` record (see :func:`save_prepared`)."""
DATA_DIR_NAME = "data"
CORPUS_FILE = "corpus.jsonl"
INVENTORY_FILE = "inventory.json"
CORPUS_META_FILE = "corpus_meta.json"
TAG_CONDITION_RUN = "mistill.flip_cohort.run."
"""Prefix of a ``flip_cohort`` run's tags naming its condition runs (the prepared corpora it wrote):
``mistill.flip_cohort.run.flipped``."""
_RECORD_KEYS = ("name", "privacy", "digest", "inventory_digest", "inventory_sha256", "run_id", "identity",
                "identity_digest")


# ------------------------------------------------------------------------- models a stage loads
# The science layers take a model spec as it is; a ``run:<train run id>`` spec names a train
# run's checkpoint, which these resolve through the tracking server.

def load_model(spec: str = loading.EMBEDDED_DEFAULT, **kwargs: Any) -> loading.LoadedModel:
    """:func:`mistill.models.loading.load_model`, ``run:<id>`` specs resolved to their checkpoints."""
    return loading.load_model(spec, resolve_run=resolve_run_spec, **kwargs)


def load_tokenizer(spec: str = loading.EMBEDDED_DEFAULT) -> Any:
    """:func:`mistill.models.loading.load_tokenizer`, ``run:<id>`` specs resolved."""
    return loading.load_tokenizer(spec, resolve_run=resolve_run_spec)


def make_backend(name: str, model_spec: str, decoding: Any, **kwargs: Any) -> backends.Backend:
    """:func:`mistill.evaluation.backends.make_backend`, ``run:<id>`` specs resolved."""
    return backends.make_backend(name, model_spec, decoding, resolve_run=resolve_run_spec, **kwargs)


def sample_then_load(*args: Any, **kwargs: Any) -> tuple[dict[str, Any], loading.LoadedModel]:
    """:func:`mistill.evaluation.sampling.sample_then_load`, ``run:<id>`` specs resolved."""
    return sampling.sample_then_load(*args, resolve_run=resolve_run_spec, **kwargs)


def prepared_data_dir(corpus_name: str, run_id: str) -> Path:
    """The local folder of one run's prepared data: ``<root>/data/<corpus>-<run id>``.

    One folder per run: a run's identity holds every input that shapes the data (typed params
    and the content of every file read), so two runs that would prepare different data never
    share, or overwrite, a folder.
    """
    return (mistill_root() / DATA_DIR_NAME / f"{corpus_name}-{run_id}").resolve()


@dataclass
class Prepared:
    """The corpus and inventory a ``prepare`` run produced, and where they live."""

    corpus: Corpus
    inventory: Inventory
    data_dir: Path
    run_id: str
    remove_discharge_diagnosis: bool = True
    narrow_instruction: bool = True

    @property
    def prompt_settings(self) -> dict[str, bool]:
        """The prompt flags the corpus was prepared with, as keyword arguments of
        :func:`mistill.data.prompts.build_prompt` and :func:`note_input`."""
        return {"remove_discharge_diagnosis": self.remove_discharge_diagnosis,
                "narrow_instruction": self.narrow_instruction}

    def prompt(self, note: Note, tokenizer) -> Prompt:
        """The prompt a model is given for ``note``: its shortlist (the whole inventory without
        one), the corpus's prompt flags, ``tokenizer``'s chat template."""
        return build_prompt(note, note.shortlist, self.inventory, tokenizer, **self.prompt_settings,
                            wording=prompt_wording(self.inventory.task))


def identity_digest(record: Mapping[str, Any]) -> str:
    """sha256 of a ``corpus_meta.json`` record (canonical JSON, ``identity_digest`` left out)."""
    return params_digest({k: v for k, v in record.items() if k != "identity_digest"})


def save_prepared(data_dir: Path, corpus: Corpus, meta: Mapping[str, Any], *, run_id: str | None = None,
                  identity: Mapping[str, Any] | None = None) -> str:
    """Write a run's prepared data (``corpus.jsonl``, ``inventory.json``, ``corpus_meta.json``)
    and return its identity digest, to be tagged on the run as ``mistill.data_identity``.

    ``corpus_meta.json`` holds ``meta`` (the prompt flags, provenance) and the record
    :func:`load_prepared` checks: the corpus name, privacy and digest, the inventory's digest and
    the sha256 of ``inventory.json``, the ``run_id`` that wrote the folder (default: the active
    MLflow run), ``identity`` (the typed inputs that made the data: for ``prepare`` its params
    and the sha256 of every file it read) and ``identity_digest`` over all of it.
    """
    if run_id is None:
        active = mlflow.active_run()
        if active is None:
            raise ValueError("save_prepared needs the run id of the run the data belongs to")
        run_id = active.info.run_id
    clash = sorted(set(meta) & set(_RECORD_KEYS))
    if clash:
        raise ValueError(f"corpus_meta.json keys {clash} are written by save_prepared itself")
    data_dir.mkdir(parents=True, exist_ok=True)
    corpus.to_jsonl(data_dir / CORPUS_FILE)
    corpus.inventory.to_json(data_dir / INVENTORY_FILE)
    record = {"name": corpus.name, "privacy": corpus.privacy, "digest": corpus.digest,
              "inventory_digest": corpus.inventory.digest,
              "inventory_sha256": sha256_file(data_dir / INVENTORY_FILE), **meta, "run_id": run_id,
              "identity": dict(identity or {})}
    record = json.loads(dumps(record))  # the digest is of what the file will hold
    record["identity_digest"] = identity_digest(record)
    write_json(data_dir / CORPUS_META_FILE, record)
    return record["identity_digest"]


def load_prepared(run_id: str) -> Prepared:
    """Corpus and inventory of a ``prepare`` run (local data dir, else its logged artifacts).

    The folder must be this run's and unchanged (:func:`verify_prepared`); anything else is a
    :class:`MistillInputError` naming the run, the folder and the field that differs.
    """
    client = MlflowClient()
    if not run_id:
        raise MistillInputError("no run id given: the run id of a `prepare` run", field="prepare_run")
    try:
        run = client.get_run(run_id)
    except Exception as exc:  # noqa: BLE001 - MLflow raises several types for a missing run
        raise MistillInputError(f"no prepare run {run_id!r} on the tracking server {client.tracking_uri} "
                                f"({exc.__class__.__name__})", field="prepare_run") from None
    tagged = run.data.tags.get(TAG_DATA_DIR)
    data_dir = Path(tagged) if tagged else None
    conditions = {k.rsplit(".", 1)[-1]: v for k, v in run.data.tags.items() if k.startswith(TAG_CONDITION_RUN)}
    if data_dir is None and conditions:
        shown = ", ".join(f"{k} {v}" for k, v in sorted(conditions.items()))
        raise MistillInputError(f"run {run_id} is an evidence-flip cohort; its corpora are the runs of its "
                                f"conditions: {shown}", field="prepare_run")
    if data_dir is None or not (data_dir / CORPUS_FILE).exists():
        if run.data.tags.get("mistill.privacy") not in ("synthetic", "public"):
            raise MistillInputError(
                f"the restricted corpus of run {run_id} is not in its local data dir {data_dir}; "
                "restricted text is never stored in MLflow", field="prepare_run")
        data_dir = mistill_root() / DATA_DIR_NAME / run_id
        data_dir.mkdir(parents=True, exist_ok=True)
        for name in (CORPUS_FILE, INVENTORY_FILE, CORPUS_META_FILE):
            # the returned path is where the file landed (MLflow 3 drops the "data/" folder)
            with quiet_downloads():
                got = client.download_artifacts(run_id, f"data/{name}", str(data_dir.parent / f".{run_id}-dl"))
            os.replace(got, data_dir / name)
    meta = read_json(data_dir / CORPUS_META_FILE)
    verify_prepared(run, data_dir, meta)
    inventory = Inventory.from_json(data_dir / INVENTORY_FILE)
    corpus = Corpus.from_jsonl(data_dir / CORPUS_FILE, name=meta["name"], privacy=meta["privacy"],
                               inventory=inventory)
    tagged_digest = run.data.tags.get(TAG_CORPUS_DIGEST)
    if corpus.digest != meta["digest"] or (tagged_digest is not None and corpus.digest != tagged_digest):
        raise MistillInputError(f"corpus file of run {run_id} changed since it was prepared (digest mismatch)",
                                file=str(data_dir / CORPUS_FILE), field="digest")
    return Prepared(corpus=corpus, inventory=inventory, data_dir=data_dir, run_id=run_id,
                    remove_discharge_diagnosis=bool(meta.get("remove_discharge_diagnosis", True)),
                    narrow_instruction=bool(meta.get("narrow_instruction", True)))


def verify_prepared(run: Run, data_dir: Path, meta: Mapping[str, Any]) -> None:
    """Refuse a data folder that is not ``run``'s prepared data as it was written.

    Checks, in order: the folder records ``run``'s id; its record hashes to the digest it
    recorded and to the run's ``mistill.data_identity`` tag (a mismatch is traced to the first
    field that differs from the run's typed params); ``inventory.json`` hashes to the recorded
    sha256. The corpus digest is checked when the corpus is read (:func:`load_prepared`).
    """
    run_id = run.info.run_id
    meta_file = str(data_dir / CORPUS_META_FILE)
    recorded = meta.get("run_id")
    if recorded is None:
        raise MistillInputError(f"data folder {data_dir} of run {run_id} records no run id (prepared before "
                                "folders recorded their identity): run the stage again", file=meta_file,
                                field="run_id")
    if recorded != run_id:
        diff = _differing_field(run, meta)
        detail = f": {diff[0]} is {diff[1]!r} there, {diff[2]!r} in run {run_id}" if diff else ""
        raise MistillInputError(f"data folder {data_dir} holds the prepared data of run {recorded}, not of "
                                f"run {run_id}{detail}", file=meta_file, field=diff[0] if diff else "run_id")
    digest = identity_digest(meta)
    tagged = run.data.tags.get(TAG_DATA_IDENTITY)
    if digest != meta.get("identity_digest") or (tagged is not None and digest != tagged):
        diff = _differing_field(run, meta)
        detail = f": {diff[0]} is {diff[1]!r} there, {diff[2]!r} in the run" if diff else ""
        raise MistillInputError(f"data folder {data_dir} was changed after run {run_id} prepared it "
                                f"(identity digest mismatch){detail}", file=meta_file,
                                field=diff[0] if diff else "identity_digest")
    inventory_file = data_dir / INVENTORY_FILE
    if not inventory_file.is_file() or sha256_file(inventory_file) != meta.get("inventory_sha256"):
        raise MistillInputError(f"inventory file of run {run_id} in {data_dir} changed since it was prepared "
                                "(sha256 mismatch)", file=str(inventory_file), field="inventory_sha256")


def _run_identity(run: Run) -> dict[str, Any]:
    """A run's typed params and ``<field>_sha256`` content digests, from its ``config.json`` as
    the store holds it (never a local copy); empty when it has none."""
    try:
        with tempfile.TemporaryDirectory(prefix="mistill-cfg-") as tmp, quiet_downloads():
            data = read_json(MlflowClient().download_artifacts(run.info.run_id, CONFIG_ARTIFACT, tmp))
    except (MlflowException, MistillInputError, OSError):
        return {}
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict):
        return {}
    content = data.get("content_sha256") or {}
    return {**config, **{f"{k}{CONTENT_SUFFIX}": v for k, v in content.items()}}


def _differing_field(run: Run, meta: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """The first of the run's typed params (sorted) whose value in ``meta`` (its ``identity``
    or a top-level entry such as the prompt flags) differs: ``(field, in meta, in the run)``."""
    identity = meta.get("identity") if isinstance(meta.get("identity"), dict) else {}
    for key, value in sorted(_run_identity(run).items()):
        for source in (identity, meta):
            if key in source and not typed_equal(source[key], value):
                return key, source[key], value
    return None


PATIENT_ID_MODES = ("auto", "hashed", "clear")
"""How :func:`corpus_index` shows patient ids (``auto``: hashed for a restricted corpus, clear
otherwise)."""
SALT_FILE = "salt"
SALT_BYTES = 32
PATIENT_KEY_CHARS = 16
"""Hex characters kept of a hashed patient id (64 bits: two of a million patients share one with
a chance of about 3e-8, n^2 / 2^65)."""


def local_salt(root: Path | str | None = None) -> bytes:
    """The random salt of a mistill root: ``<root>/salt`` (default :func:`mistill_root`), 32
    bytes, created once and readable by its owner only.

    It keys the hashed patient ids of :func:`corpus_index`; it stays on this machine and is never
    logged. Processes creating it at once agree: each links its own complete file into place,
    the first link wins, and every process reads the winner.
    """
    base = mistill_root() if root is None else Path(root)
    path = base / SALT_FILE
    if not path.exists():
        base.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{SALT_FILE}.", dir=base)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(secrets.token_bytes(SALT_BYTES))
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    salt = path.read_bytes()
    if len(salt) != SALT_BYTES:
        raise MistillInputError(f"the salt holds {len(salt)} bytes, not {SALT_BYTES}; a new salt (delete "
                                "this file) gives every patient a new hashed id", file=str(path))
    return salt


def corpus_index(corpus: Corpus, patient_ids: str = "auto", *, root: Path | str | None = None):
    """One row per note: ids, split and gold codes (no text): safe to log for any corpus.

    patient_ids (:data:`PATIENT_ID_MODES`): ``hashed`` shows each patient id as the first
    :data:`PATIENT_KEY_CHARS` hex characters of HMAC-SHA256 keyed by the local salt of ``root``
    (:func:`local_salt`): one patient keeps one id on this machine, so notes still group by
    patient, while nobody without the salt can tell whose id it is; ``clear`` shows the ids;
    ``auto`` is ``hashed`` for a restricted corpus and ``clear`` otherwise. Only this index
    changes: the corpus (the local data folder) keeps the real ids.
    """
    import pandas as pd  # deferred: pandas is slow to import

    shown = shown_patient_ids(corpus.privacy, [n.patient_id for n in corpus.notes], patient_ids, root=root)
    return pd.DataFrame([{"note_id": n.note_id, "patient_id": pid, "split": n.split,
                          "n_gold": len(n.gold_codes), "gold_codes": " ".join(n.gold_codes),
                          "has_trace": bool(n.teacher_trace)} for n, pid in zip(corpus.notes, shown)])


def shown_patient_ids(privacy: str, patient_ids: Sequence[str], mode: str = "auto", *,
                      root: Path | str | None = None) -> list[str]:
    """Patient ids as an artifact may show them (see :func:`corpus_index` for ``mode``)."""
    if mode not in PATIENT_ID_MODES:
        raise MistillInputError(f"patient_ids must be one of {PATIENT_ID_MODES}, got {mode!r}",
                                field="patient_ids")
    if mode == "auto":
        mode = "hashed" if privacy == "restricted" else "clear"
    if mode == "clear":
        return [str(p) for p in patient_ids]
    salt = local_salt(root)
    return [hmac.new(salt, str(p).encode("utf-8"), hashlib.sha256).hexdigest()[:PATIENT_KEY_CHARS]
            for p in patient_ids]


def log_corpus_input(run, prepared: Prepared) -> None:
    """Lineage: the corpus a stage read, as an MLflow dataset input (ids and codes, no text)."""
    corpus = prepared.corpus
    run.log_dataset(corpus_index(corpus), name=f"{corpus.name}-index", digest=corpus.digest, context="input")


def require_notes(notes: Sequence[Note], split: str, prepared: Prepared, *, field: str = "split",
                  need_trace: bool = True) -> list[Note]:
    """``notes`` (a stage's selection by ``split``; empty split: every note) if any; else refuse,
    naming the split and the splits the corpus has, with their note and trace counts.

    Called before a stage's run starts, so a split that matches nothing leaves no run behind.
    need_trace: the selection keeps only notes with a teacher trace (said in the message).
    """
    if notes:
        return list(notes)
    corpus = prepared.corpus
    counts = [f"{name!r}: {sum(n.split == name for n in corpus.notes)} notes, "
              f"{sum(n.split == name and bool(n.teacher_trace) for n in corpus.notes)} with a teacher trace"
              for name in corpus.splits]
    what = "notes with a teacher trace" if need_trace else "notes"
    where = f"split {split!r}" if split else "any split"
    raise MistillInputError(f"no {what} in {where} of the corpus of run {prepared.run_id}; its splits: "
                            f"{'; '.join(counts) or 'none (the corpus is empty)'}", field=field)


def privacy_guard(corpus: Corpus, extra_texts: Sequence[str] = ()):
    """The corpus's guard: note and trace texts are protected unless synthetic/public.

    The inventory's descriptions are public (ICD-10-CM), so n-grams inside them never count.
    """
    texts = [n.text for n in corpus.notes] + [n.teacher_trace for n in corpus.notes if n.teacher_trace]
    public = [] if corpus.privacy != "restricted" else [corpus.inventory.description(c)
                                                         for c in corpus.inventory.codes]
    return PrivacyGuard(list(texts) + list(extra_texts), corpus.privacy, public_texts=public)


def prepared_note_input(prepared: Prepared, note: Note, tokenizer, **kwargs) -> NoteInput:
    """:func:`note_input` with the prepared corpus's inventory and prompt settings."""
    return note_input(note, prepared.inventory, tokenizer, **prepared.prompt_settings, **kwargs)


def model_positions(lm) -> int | None:
    cfg = lm.model.config
    return getattr(cfg, "max_position_embeddings", None)


LINK_TAGS = ("mistill.registered_model", "mistill.model_version", "mistill.model_alias")


ARM_PARAM_NAMES = ("arm.name", "arm.seed", "arm.precision", "arm.lambda_p1", "arm.lambda_p2")
"""The params a readout of an arm logs, so MLflow's compare view lines its runs up by arm.
``arm.precision``, ``arm.lambda_p1`` and ``arm.lambda_p2`` are the train run's own param names;
the name and seed are ``arm.name`` and ``arm.seed`` because a readout's ``arm`` and ``seed``
params, when its config has such fields, are its own identity params."""


@dataclass(frozen=True)
class Subject:
    """The model a readout stage reads: its spec, the arm / seed / precision it stands for, the
    registry tags linking the readout to a trained arm (empty for a plain model), the ``train``
    run whose checkpoint it is, and the arm params a readout of it logs (:func:`link_subject`)."""

    spec: str
    arm: str | None = None
    seed: str | None = None
    precision: str | None = None
    links: dict[str, str] = field(default_factory=dict)
    train_run: str | None = None
    params: dict[str, str] = field(default_factory=dict)


def trained_subject(train_run: str) -> Subject:
    """A ``train`` run as a subject: the checkpoint ``run:<id>``, its arm, seed and precision tags,
    its registered model, version and alias, and its arm params (:func:`arm_subject_params`)."""
    reader = RunReader(train_run, field="train_run")
    tags = reader.tags
    if tags.get("mistill.stage") != "train":
        raise MistillInputError(f"run {train_run} is a {tags.get('mistill.stage')!r} run, not a train run",
                                field="train_run")
    return Subject(spec=f"run:{train_run}", arm=tags.get("mistill.arm"), seed=tags.get("mistill.seed"),
                   precision=tags.get("mistill.precision"), links={k: tags[k] for k in LINK_TAGS if k in tags},
                   train_run=train_run, params=arm_subject_params(reader))


def readout_subject(train_run: str, model: str, arm: str) -> Subject:
    """The model a readout stage samples or reads: ``train_run``'s checkpoint
    (:func:`trained_subject`), else the model spec ``model`` standing for the arm ``arm`` (a row
    of Table 2: ``teacher``, ``untrained``, ...; ``model`` when empty)."""
    if train_run:
        return trained_subject(train_run)
    if not model:
        raise MistillInputError("give train_run or model", field="model")
    return Subject(spec=model, arm=arm or "model", params={"arm.name": arm} if arm else {})


def arm_subject_params(reader: RunReader) -> dict[str, str]:
    """The :data:`ARM_PARAM_NAMES` of a ``train`` run's arm, from its resolved arm (its params
    ``arm.<flag>``, else its ``arm.json``): the arm's name and seed, its precision and, only for
    an arm whose objective is ``mistill``, λ_P1 and λ_P2 (other objectives have no λ)."""
    logged = reader.run.data.params
    if "arm.objective" in logged:
        flags = {k[len("arm."):]: v for k, v in logged.items() if k.startswith("arm.")}
    else:
        flags = {k: v if isinstance(v, str) else json.dumps(v) for k, v in read_json(reader.file("arm.json")).items()}
    tags = reader.tags
    params = {"arm.name": tags.get("mistill.arm"), "arm.seed": tags.get("mistill.seed"),
              "arm.precision": flags.get("precision") or tags.get("mistill.precision")}
    if flags.get("objective") == "mistill":
        params.update({"arm.lambda_p1": flags.get("lambda_p1"), "arm.lambda_p2": flags.get("lambda_p2")})
    return {k: v for k, v in params.items() if v}


def link_subject(run: Any, subject: Subject) -> None:
    """Record on an open readout run what it reads: the subject's arm params (logged once: those
    a resumed run holds are kept; they are no part of the run's identity) and, for a train run's
    checkpoint, that checkpoint's logged model as the run's model input, which the run page lists
    under "Logged models" (:func:`~mistill.tracking.models.checkpoint_logged_model`)."""
    current = run.client.get_run(run.run_id)
    params = {k: v for k, v in subject.params.items() if k not in current.data.params}
    if params:
        run.guard.check_mapping(params, "param")
        run.client.log_batch(run.run_id, params=[Param(k, v) for k, v in params.items()])
    if subject.train_run:
        model_id = checkpoint_logged_model(run.client, subject.train_run, params=subject.params)
        if model_id not in {m.model_id for m in current.inputs.model_inputs or []}:
            run.client.log_inputs(run.run_id, models=[LoggedModelInput(model_id)])


def subject_run_args(model: str) -> dict[str, Any]:
    """The run arguments of a stage that reads ``model``: the spec and, for a trained arm's
    checkpoint (``run:<id>``), the arm, seed and precision of its ``train`` run, so the readout
    pairs with the arm's other runs in the report."""
    if not model.startswith("run:"):
        return {"model": model}
    subject = trained_subject(model[len("run:"):])
    return {"model": model, "arm": subject.arm, "seed": subject.seed, "precision": subject.precision}


class RunReader:
    """Read another stage's run: its typed config and its (per-note) artifacts.

    Files are read from the local work dir of that run when present (the same machine ran it),
    else downloaded once into it. A note's local files (restricted model text) are read only from
    that run's enclave on this machine (:meth:`local_note_file`).
    """

    def __init__(self, run_id: str, *, field: str = "run") -> None:
        self.run_id = run_id
        self.client = MlflowClient()
        if not run_id:
            raise MistillInputError("no run id given", field=field)
        try:
            self.run = self.client.get_run(run_id)
        except Exception as exc:  # noqa: BLE001
            raise MistillInputError(f"no run {run_id!r} on the tracking server {self.client.tracking_uri} "
                                    f"({exc.__class__.__name__})", field=field) from None
        if self.run.info.status != "FINISHED":
            raise MistillInputError(f"input run {run_id} is {self.run.info.status}, not FINISHED", field=field)
        self.work_dir = mistill_root() / "work" / run_id
        self._config: dict | None = None
        self._verified: dict[Path, tuple[int, int]] = {}
        self._fetched: set[Path] = set()

    @property
    def tags(self) -> dict[str, str]:
        return dict(self.run.data.tags)

    @property
    def config(self) -> dict:
        """The run's typed arguments (from its ``config.json``)."""
        if self._config is None:
            self._config = read_json(self.file("config.json"))["config"]
        return self._config

    def file(self, artifact_path: str, *, cached: bool = False) -> Path:
        """Local path of an artifact, downloaded from the run's store into the run's work dir
        (without a progress bar: these are single small files).

        The local copy is the store's: a run-level file is downloaded once per reader, whatever
        the work dir holds. ``cached``: a copy already in the work dir is used as is, for a
        per-note file or ``_DONE`` marker, which the caller verifies against the note's signed
        ``_DONE`` (:meth:`note_file`, :meth:`note_done`).
        """
        local = self.work_dir / artifact_path
        if local.is_file() and (cached or local in self._fetched):
            return local
        local.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=local.parent, prefix=".dl-") as tmp, quiet_downloads():
            try:
                got = self.client.download_artifacts(self.run_id, artifact_path, tmp)
            except Exception:  # noqa: BLE001
                raise MistillInputError(f"artifact {artifact_path} missing from run {self.run_id}",
                                        field=artifact_path) from None
            os.replace(got, local)
        self._fetched.add(local)
        return local

    def note_file(self, subdir: str, note_id: str, filename: str) -> Path:
        """Local path of one per-note file, verified against the sha256 that the note's
        ``_DONE`` marker recorded (a file changed after the note finished is refused).

        A file the note recorded as local (restricted model text, ``local_files`` of
        :meth:`mistill.tracking.runs.StageRun.write_note`) is read from the producing run's
        enclave on this machine (:meth:`local_note_file`); any other is read from the run's
        work dir or downloaded.
        """
        done = self.note_done(subdir, note_id, filename)
        if filename in (done.get(LOCAL_FILES_KEY) or {}):
            return self.local_note_file(subdir, note_id, filename)
        path = self.file(f"{subdir}/{note_id}/{filename}", cached=True)
        stamp = (path.stat().st_mtime_ns, path.stat().st_size)
        if self._verified.get(path) != stamp:
            verify_note_file(path, done, run_id=self.run_id, subdir=subdir, note_id=str(note_id))
            self._verified[path] = stamp
        return path

    def note_done(self, subdir: str, note_id: str, filename: str | None = None) -> dict:
        """One note's ``_DONE`` record (``files`` and, if any, ``local_files``: name -> sha256),
        its signature verified with the store's key (a cached copy and a downloaded one alike).

        Raises:
            MistillInputError: the note has no ``_DONE`` marker (it never finished), or its
                signature does not verify for this run and note (naming both).
        """
        try:
            done_path = self.file(f"{subdir}/{note_id}/{DONE_MARKER}", cached=True)
        except MistillInputError:
            raise MistillInputError(f"run {self.run_id}: note has no {DONE_MARKER} marker",
                                    file=filename, note=str(note_id), field=subdir) from None
        return verify_done(read_json(done_path), run_id=self.run_id, subdir=subdir, note_id=str(note_id))

    @property
    def enclave_dirs(self) -> list[Path]:
        """Where this run's local files may be on this machine: its ``mistill.enclave_dir`` tag,
        then ``<MISTILL_ROOT>/work/<run id>/enclave``."""
        dirs = [Path(self.tags[TAG_ENCLAVE_DIR])] if self.tags.get(TAG_ENCLAVE_DIR) else []
        default = self.work_dir / ENCLAVE_DIR
        return dirs + [default] if default.resolve() not in [d.resolve() for d in dirs] else dirs

    def local_note_file(self, subdir: str, note_id: str, filename: str) -> Path:
        """Local path of one local per-note file (restricted model text), read from the producing
        run's enclave on this machine and verified against the sha256 its ``_DONE`` recorded.

        Raises:
            MistillInputError: the file is not recorded as local, is absent from this machine
                (kept only on the machine that ran the run), or changed after the note finished.
        """
        done = self.note_done(subdir, note_id, filename)
        if filename not in (done.get(LOCAL_FILES_KEY) or {}):
            raise MistillInputError(f"run {self.run_id}: {subdir}/{note_id}/{filename} is not a local file "
                                    "of the note (its _DONE marker lists no such local file)",
                                    file=filename, note=str(note_id), field=subdir)
        looked = [d / subdir / str(note_id) for d in self.enclave_dirs]
        path = next((d / filename for d in looked if (d / filename).is_file()), None)
        if path is None:
            raise enclave_missing_error(self.run_id, subdir, str(note_id), filename, looked)
        stamp = (path.stat().st_mtime_ns, path.stat().st_size)
        if self._verified.get(path) != stamp:
            verify_local_note_file(path, done, run_id=self.run_id, subdir=subdir, note_id=str(note_id))
            self._verified[path] = stamp
        return path


# ----------------------------------------------------------------------- input runs, checked first
PREPARED_DATA_STAGES = ("prepare", "shortlist", "generate", "flip_cohort")
"""The stages whose runs hold a prepared corpus (:func:`load_prepared`); a ``flip_cohort`` run's
corpora are its nested condition runs (tags ``mistill.flip_cohort.run.<condition>``)."""

INPUT_RUN_STAGES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "prepare_run": PREPARED_DATA_STAGES,
    "train_prepare_run": PREPARED_DATA_STAGES,
    "exclude_prepare_runs": PREPARED_DATA_STAGES,
    "compare_attribute_runs": ("attribute",),
    "replicate_runs": ("evaluate", "own_heads"),
    "events_run": ("events",),
    "attribute_run": ("attribute",),
    "sets_run": ("attribute",),
    "teacher_attribute_run": ("attribute",),
    "student_attribute_run": ("attribute",),
    "locus_run": ("locus",),
    "read_side_run": ("read_side",),
    "targets_run": ("targets",),
    "train_run": ("train",),
    "las_run": ("las_simulator",),
    "cohort_run": ("flip_cohort",),
    "align_events_runs": ("events",),
    "mask_heads_run": ("attribute", "own_heads"),
})
"""Every config field that names input runs (a field ending in ``_run`` or ``_runs``), and the
stages whose runs it accepts, by their ``mistill.stage`` tag. A stage reads each such run as the
stage that wrote it left it (its ``config.json``, its files), so only those stages fit. An
``attribute`` field takes the ``attribute`` run itself: a ``characterize`` run is the parent of
its three steps and holds none of their files (the run plans of ``reproduce`` name its nested
attribute run as ``<step>:attribute`` and pass that run's id on). A ``run:<id>`` model spec takes
a ``train`` run (:data:`MODEL_RUN_STAGES`)."""

MODEL_RUN_STAGES = ("train",)
"""The stages whose runs a ``run:<id>`` model spec may name (the checkpoint a ``train`` run saved)."""


def run_fields(config: type) -> tuple[str, ...]:
    """The fields of a config class that name input runs: a string or a tuple of strings whose
    name ends in ``_run`` or ``_runs`` (``dry_run``, a boolean, is none)."""
    hints = typing.get_type_hints(config)
    out = []
    for f in dataclasses.fields(config):
        hint = hints[f.name]
        if f.name.endswith(("_run", "_runs")) and (hint is str or typing.get_args(hint)[:1] == (str,)):
            out.append(f.name)
    return tuple(out)


def _stages_text(stages: Sequence[str]) -> str:
    """``a `prepare` run``'s stage part: "a `targets`", "a `prepare`, `shortlist` or `generate`"."""
    names = [f"`{s}`" for s in stages]
    joined = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return f"{'an' if stages[0][:1] in 'aeiou' else 'a'} {joined}"


def check_input_run(client: MlflowClient, run_id: str, field: str, stages: Sequence[str]) -> None:
    """Refuse ``run_id`` as the value of ``field`` unless the run exists, is not deleted, ended
    FINISHED and is a run of one of ``stages`` (its ``mistill.stage`` tag), e.g. "run <id> is a
    `prepare` run; --targets_run needs a `targets` run". Asks the tracking server one request.

    Raises:
        MistillInputError: naming ``field``.
    """
    need = f"--{field} needs {_stages_text(stages)} run"
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise MistillInputError(f"no run {run_id} on the tracking server {client.tracking_uri}; {need}",
                                field=field) from None
    if run.info.lifecycle_stage == "deleted":
        raise MistillInputError(f"run {run_id} is deleted; {need}", field=field)
    stage = run.data.tags.get(TAG_STAGE)
    if stage not in stages:
        what = f"{'an' if stage[:1] in 'aeiou' else 'a'} `{stage}` run" if stage else \
            f"not a stage's run (no {TAG_STAGE} tag)"
        raise MistillInputError(f"run {run_id} is {what}; {need}", field=field)
    if run.info.status != "FINISHED":
        raise MistillInputError(f"run {run_id} is {run.info.status}, not FINISHED; {need} that finished "
                                "(rerun its stage to resume it)", field=field)


def check_model_input(client: MlflowClient, spec: str, field: str) -> None:
    """Refuse a model spec whose model is not there, without loading it: a ``run:<id>`` names a
    FINISHED ``train`` run (:func:`check_input_run`), any other spec has its files on this
    machine (:func:`~mistill.models.loading.check_model_present`)."""
    base = split_layer_spec(spec)[0]
    if base.startswith("run:"):
        check_input_run(client, base[len("run:"):], field, MODEL_RUN_STAGES)
    else:
        check_model_present(spec, field)


def check_input_files(config: Any, fields: Sequence[str]) -> None:
    """Refuse a non-empty file field of ``config`` (``fields``) that names no file here (a
    relative path is looked for from the current folder, then under the repository root, as
    the stages read it: :func:`~mistill.tracking.identity.repo_file`)."""
    for name in fields:
        value = getattr(config, name)
        if value and not Path(repo_file(value)).expanduser().is_file():
            raise MistillInputError(f"no file {value} here; --{name} needs an existing file", file=value,
                                    field=name)

