"""Conventions every stage follows when it logs to MLflow.

* One experiment per corpus: ``mistill/<corpus>`` (:func:`experiment_for_corpus`), artifacts
  inherited from the server (proxied ``mlflow-artifacts:/``), tagged as a model-development
  experiment (``mlflow.experimentKind``) so that the MLflow UI opens on its runs.
* A run's name says what it is, arm, λ and seed first, then stage, model and split
  (:func:`run_name`), never a run id. A stage started for another (:func:`child_runs_of`) is nested under it.
* Long stages (:data:`SYSTEM_METRICS_STAGES`) log MLflow's system metrics (CPU, memory, GPU):
  ``MISTILL_SYSTEM_METRICS=0`` turns them off, ``=1`` turns them on for every stage.
* A stage stopped by SIGTERM or Ctrl-C ends KILLED, one stopped by an error FAILED; each ended
  run logs one ``View run <name> at: <url>`` line.
* Every run carries the tags below (``mistill.stage``, ``mistill.model``, ...), lineage tags
  ``mistill.input.<name> = <input run id>``, all params of its :class:`~mistill.config.Config`,
  and a ``config.json`` artifact with every argument, the code version and the git commit.
* A run is identified by its entry point, its typed params (canonical JSON -> sha256 in the tag
  ``mistill.params_digest``), the code version and its inputs: :func:`find_run` finds an
  identical run, and :class:`StageRun` with ``resume=True`` reuses a FINISHED one, resumes a
  RUNNING/FAILED/KILLED one under the same run id, or starts a new one.
* Per-note artifacts live under ``<subdir>/<note_id>/`` with a ``_DONE`` marker written (and
  uploaded) last, so a resumed run skips exactly the finished notes and loses none. ``_DONE``
  records the sha256 of each file and is signed with the store's key (HMAC-SHA256 over the
  record, the run, the subdir and the note, :func:`mistill.tracking.auth.sign_done`); a marker
  whose signature does not verify is refused wherever it is read.
* Per-note files that are model text of a restricted corpus (token ids or per-position
  distributions of a note or trace, generated text) are *local files*: kept in the run's enclave
  ``<work>/enclave/<subdir>/<note_id>/`` on the machine that ran it (tag ``mistill.enclave_dir``),
  recorded with their sha256 in ``_DONE``, never uploaded (:meth:`StageRun.write_note`).
* Everything bound for the tracking store passes the corpus's :class:`PrivacyGuard`.

Only a tracking server is accepted (``http(s)://``): never the ``./mlruns`` file store. When no
tracking URI is configured, :class:`StageRun` starts (or reuses) the project's server.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import DatasetInput, InputTag, Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient, fluent

from mistill.config import Config
from mistill.errors import MistillInputError
from mistill.io import (environment_variable, is_safe_name, read_json, sha256_file, write_bytes, write_json,
                        write_text)
from mistill.progress import get_logger
from mistill.tracking.auth import ensure_client_credentials, sign_done, verify_done
from mistill.tracking.connection import is_unreachable, unavailable_error
from mistill.tracking.lease import (ENV_ON_BUSY, ENV_WAIT_MAX, TAG_LEASE_OWNER, Heartbeat, LeaseError, LeaseSettings,
                                    claim, claim_new_run, describe_owner, generation, identity_key, lease_held,
                                    lease_tags, new_owner)
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.purge import purge_if_protected
from mistill.tracking.reaper import spawn_reaper
from mistill.tracking.server import ensure_server

# ---------------------------------------------------------------------------------------- tags
TAG_STAGE = "mistill.stage"
TAG_MODEL = "mistill.model"
TAG_CORPUS = "mistill.corpus"
TAG_CORPUS_DIGEST = "mistill.corpus_digest"
TAG_PRIVACY = "mistill.privacy"
TAG_ARM = "mistill.arm"
TAG_SEED = "mistill.seed"
TAG_PRECISION = "mistill.precision"
TAG_SPLIT = "mistill.split"  # the notes a readout ran on (evaluate, own_heads)
TAG_BACKEND = "mistill.backend"  # the backend that sampled a readout's generations (hf or vllm)
TAG_GIT_COMMIT = "mistill.git_commit"
TAG_CODE_VERSION = "mistill.code_version"
TAG_ENTRY_POINT = "mistill.entry_point"
TAG_PARAMS_DIGEST = "mistill.params_digest"
TAG_INPUT_PREFIX = "mistill.input."
"""Lineage: ``mistill.input.<name>`` = the run id of the input run called ``<name>``."""
TAG_DELEGATED_TO = "mistill.delegated_to"
"""Set on a run launched by ``mlflow run`` when the work was reused/resumed in another run."""
TAG_LAMBDA = "mistill.lambda"
"""The λ a run trained (or read a model trained) with: ``<λ>`` or ``<λ_P1>,<λ_P2>``."""
TAG_PARENT_RUN = "mlflow.parentRunId"
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
"""MLflow 3's kind for a classic model-development experiment: its UI opens on the runs table
(an experiment without the tag may open on the GenAI traces page)."""
ENV_PARENT_RUN = "MISTILL_PARENT_RUN_ID"
"""Set by :func:`child_runs_of`: new stage runs, in this process or the ones it launches, are
nested under this run."""
ENV_SYSTEM_METRICS = "MISTILL_SYSTEM_METRICS"
SYSTEM_METRICS_STAGES: frozenset[str] = frozenset({"train", "attribute", "targets", "generate"})
"""The long stages that log MLflow system metrics by default (see :func:`system_metrics_wanted`)."""

_log = get_logger("tracking")

EXPERIMENT_PREFIX = "mistill/"
CONFIG_ARTIFACT = "config.json"
DATASET_DIGEST_CHARS = 36
DONE_MARKER = "_DONE"
_UPLOADED_MARKER = ".uploaded"  # local only: the note's files and _DONE reached the store

MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value
MAX_TAG_VALUE = 8000  # MLflow's limit on a tag value
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000

METRIC_SEPARATOR = "/"
"""Between the parts of a metric name (``fidelity/ppl_median``, ``m1/P2C/p_pos``): MLflow's UI
groups a run's charts by the part before the first ``/``. A metric name holds no ``.``
(:meth:`StageRun.log_metrics` refuses one); params and tags keep their dotted names."""

RESUMABLE_STATUSES: tuple[str, ...] = ("RUNNING", "FAILED", "KILLED")
SOURCE_DIRS: tuple[str, ...] = ("mistill", "projects", "selection", "analysis")
SOURCE_SUFFIXES: tuple[str, ...] = (".py", ".yaml", ".yml", ".toml")


# ---------------------------------------------------------------------------- code identity
def default_repo_root() -> Path:
    """The directory holding the ``mistill`` package (the repository root in a checkout)."""
    return Path(__file__).resolve().parents[2]


def repo_file(path: str) -> str:
    """A file a config names by a path relative to the repository (a lock under
    ``projects/configs/locks/``): ``path`` itself when it is empty, absolute or exists from the
    current directory; else the file under :func:`default_repo_root` (the folder holding
    ``MLproject``) when that exists, as arms are found (:data:`mistill.distill.arms.ARMS_DIR`),
    so a default such as ``projects/configs/locks/embedded-3cell.yaml`` works from any folder;
    else ``path`` unchanged (its reader says it is missing)."""
    if not path:
        return path
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists():
        return path
    in_repo = default_repo_root() / given
    return str(in_repo) if in_repo.exists() else path


def _source_files(repo_root: Path) -> list[Path]:
    files: list[Path] = []
    for name in SOURCE_DIRS:
        top = repo_root / name
        if not top.is_dir():
            continue
        for root, dirs, names in os.walk(top):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"
                       and not d.endswith(".egg-info")]
            for n in names:
                if n.endswith(SOURCE_SUFFIXES) or n == "MLproject":
                    files.append(Path(root) / n)
    for n in ("MLproject", "pyproject.toml"):
        if (repo_root / n).is_file():
            files.append(repo_root / n)
    return sorted(files, key=lambda p: p.relative_to(repo_root).as_posix())


def code_version(repo_root: Path | str | None = None) -> str:
    """sha256 over the bytes of the source files: a dirty tree gets a different version.

    Files: ``*.py``, ``*.yaml``, ``*.yml``, ``*.toml`` and ``MLproject`` under ``mistill/``,
    ``projects/``, ``selection/``, ``analysis/``, plus top-level ``MLproject`` and
    ``pyproject.toml``; hashed in sorted relative-path order, each as path, size and bytes.
    """
    root = Path(repo_root) if repo_root is not None else default_repo_root()
    h = hashlib.sha256()
    for path in _source_files(root):
        data = path.read_bytes()
        h.update(path.relative_to(root).as_posix().encode() + b"\x00")
        h.update(str(len(data)).encode() + b"\x00")
        h.update(data)
    return h.hexdigest()


_code_version = code_version  # StageRun's keyword argument of the same name shadows it


def git_commit(repo_root: Path | str | None = None) -> str | None:
    """The checked-out commit (``git rev-parse HEAD``), or None outside a repository."""
    root = Path(repo_root) if repo_root is not None else default_repo_root()
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", commit) else None


# ------------------------------------------------------------------------------ typed params
def canonical_params(params: Mapping[str, Any]) -> str:
    """Canonical JSON of ``params``: sorted keys, no spaces; ints, floats and bools keep their
    JSON types (``1``, ``1.0`` and ``"1"`` serialise differently), tuples become lists."""
    return json.dumps(_plain(params), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=True)


CONTENT_SUFFIX = "_sha256"


def identity_params(config: Config) -> dict[str, Any]:
    """What makes a run of ``config`` identical: its typed params plus, for every file it names
    by path, ``<field>_sha256`` = the sha256 of the file's content
    (:meth:`~mistill.config.Config.content_digests`). Logged as MLflow params."""
    params = config.to_dict()
    for name, digest in sorted(config.content_digests().items()):
        params[f"{name}{CONTENT_SUFFIX}"] = digest
    return params


def params_digest(params: Mapping[str, Any]) -> str:
    """sha256 of :func:`canonical_params`."""
    return hashlib.sha256(canonical_params(params).encode("utf-8")).hexdigest()


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy scalars and arrays
        return _plain(value.tolist())
    return value


def typed_equal(a: Any, b: Any) -> bool:
    """Equality that keeps JSON types apart: ``1 != 1.0 != "1" != True``; lists elementwise;
    ``nan == nan``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(typed_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(typed_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def param_string(value: Any) -> str:
    """How a param value is written to MLflow: strings as they are, everything else as JSON
    (``true``, ``[1, 2]``, ``null``), so :func:`parse_param` reads it back typed. Values over
    MLflow's limit are truncated and end with the sha256 of the full value."""
    text = value if isinstance(value, str) else json.dumps(_plain(value), ensure_ascii=False,
                                                          allow_nan=True)
    if len(text) > MAX_PARAM_VALUE:
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        suffix = f"...[truncated; sha256={digest}]"
        text = text[:MAX_PARAM_VALUE - len(suffix)] + suffix
    return text


def parse_param(text: str) -> Any:
    """Best-effort typed reading of a param string written by :func:`param_string`.

    JSON if it parses, else the string. A string param that looks like a number reads back as
    a number: comparisons then fail (never a false match); ``config.json`` keeps exact types.
    """
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text


# ------------------------------------------------------------------------------ experiments
def _client(tracking_uri: str | None = None) -> MlflowClient:
    return MlflowClient(tracking_uri=tracking_uri or resolve_tracking_uri())


def resolve_tracking_uri(root: Path | str = ".mistill") -> str:
    """The tracking URI to use: ``MLFLOW_TRACKING_URI`` if set, else the project's server
    (started or reused under ``root``). File stores are refused."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or ensure_server(root)
    if not re.match(r"^(https?|databricks)(://|$)", uri):
        raise MistillInputError(
            f"tracking URI {uri!r} is not a tracking server; mistill never uses a file or "
            f"direct database store: start one with `python -m mistill.tracking.server start`",
            field="MLFLOW_TRACKING_URI")
    ensure_client_credentials(uri, root)  # the project's server needs its owner's credentials
    return uri


def experiment_for_corpus(corpus_name: str, *, tracking_uri: str | None = None) -> str:
    """The experiment name ``mistill/<corpus_name>``, created if missing (artifact location
    inherited from the server) or restored if deleted."""
    if not is_safe_name(corpus_name):
        raise MistillInputError(f"corpus name {corpus_name!r} must be letters, digits, '_', '.', "
                                f"'-'", field="corpus")
    name = EXPERIMENT_PREFIX + corpus_name
    _experiment_id(_client(tracking_uri), name, create=True)
    return name


@contextlib.contextmanager
def _tolerate_mlflow_errors() -> Any:
    """Ignore an MLflow error the caller can do without, but never an unreachable server (each
    ignored outage would cost another wait for the client's bound)."""
    try:
        yield
    except MlflowException as exc:
        if is_unreachable(exc):
            raise


def _experiment_id(client: MlflowClient, experiment: str, *, create: bool = False) -> str | None:
    exp = client.get_experiment_by_name(experiment)
    if exp is None and not create:
        with _tolerate_mlflow_errors():
            exp = client.get_experiment(experiment)  # an id was given
        return exp.experiment_id if exp is not None else None
    if exp is None:
        try:
            return client.create_experiment(experiment, tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND})
        except MlflowException as exc:  # created concurrently by another stage
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                raise exc
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    if create and TAG_EXPERIMENT_KIND not in (exp.tags or {}):  # made by `mlflow run` or older code
        with _tolerate_mlflow_errors():
            client.set_experiment_tag(exp.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
    return exp.experiment_id


# --------------------------------------------------------------------------------- find_run


def quiet_downloads() -> contextlib.AbstractContextManager[None]:
    """No progress bars for the small downloads (config.json, one per-note file)."""
    return environment_variable("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def _stored_params(client: MlflowClient, run: Run) -> dict[str, Any] | None:
    """The run's typed params: ``config.json``'s ``config`` if present, else parsed params."""
    with tempfile.TemporaryDirectory(prefix="mistill-cfg-") as tmp, quiet_downloads():
        try:
            path = client.download_artifacts(run.info.run_id, CONFIG_ARTIFACT, tmp)
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if isinstance(data, dict) and isinstance(data.get("config"), dict):
                content = data.get("content_sha256") or {}
                return {**data["config"], **{f"{k}{CONTENT_SUFFIX}": v for k, v in content.items()}}
        except (MlflowException, OSError, json.JSONDecodeError) as exc:
            if is_unreachable(exc):
                raise
    if run.data.params:
        return {k: parse_param(v) for k, v in run.data.params.items()}
    return None


def _matches(client: MlflowClient, run: Run, params: Mapping[str, Any], version: str,
             inputs: Mapping[str, str], statuses: tuple[str, ...]) -> bool:
    tags = run.data.tags
    if run.info.status not in statuses or tags.get(TAG_CODE_VERSION) != version:
        return False
    run_inputs = {k[len(TAG_INPUT_PREFIX):]: v for k, v in tags.items()
                  if k.startswith(TAG_INPUT_PREFIX)}
    if run_inputs != dict(inputs):
        return False
    stored = _stored_params(client, run)
    if stored is None:
        return False
    wanted = _plain(params)
    return typed_equal(wanted, _plain(stored))


def find_run(experiment: str, entry_point: str, params: Mapping[str, Any], code_version: str,
             inputs: Mapping[str, str] | None = None,
             status: str | Iterable[str] = "FINISHED", *, tracking_uri: str | None = None,
             max_results: int = 1000) -> Run | None:
    """The most recent run identical to the request, or None.

    Identical = same ``mistill.entry_point``, same params digest, same code version, the same
    inputs (``mistill.input.*`` tags, no more, no fewer), a status in ``status``, and params that
    are equal value by value with their types (checked against the run's ``config.json``, else
    its params parsed back). Pages through every candidate (``max_results`` per page).

    Args:
        experiment: experiment name (``mistill/<corpus>``) or id.
        entry_point: the MLproject entry point (``mistill.entry_point`` tag).
        params: the typed params (``Config.to_dict()``).
        code_version: :func:`code_version` of the code that would run.
        inputs: lineage ``{name: input run id}``.
        status: one status or several (e.g. :data:`RESUMABLE_STATUSES`).
    """
    client = _client(tracking_uri)
    exp_id = _experiment_id(client, experiment)
    if exp_id is None:
        return None
    statuses = (status,) if isinstance(status, str) else tuple(status)
    filt = (f"tags.`{TAG_ENTRY_POINT}` = '{_quote(entry_point)}' and "
            f"tags.`{TAG_PARAMS_DIGEST}` = '{params_digest(params)}'")
    if len(statuses) == 1:
        filt += f" and attributes.status = '{statuses[0]}'"
    token: str | None = None
    while True:
        page = client.search_runs([exp_id], filter_string=filt, max_results=max_results,
                                  order_by=["attributes.start_time DESC"], page_token=token)
        for run in page:
            if _matches(client, run, params, code_version, inputs or {}, statuses):
                return run
        token = page.token
        if not token:
            return None


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")


# --------------------------------------------------------------------------------- StageRun
CHECKPOINT_PREFIX = "run:"
_RUN_ID = re.compile(r"[0-9a-f]{32}")


def short_model(model: str | None) -> str | None:
    """A model spec as a run name shows it: ``embedded:smollm2-135m`` -> ``smollm2-135m``,
    ``tiny:qwen3:seed=2`` -> ``tiny-qwen3:seed=2``, ``org/Name`` or a path -> ``Name``
    (``.gguf`` dropped); None for a train run's checkpoint (``run:<id>``: the arm names it)."""
    if not model or str(model).startswith(CHECKPOINT_PREFIX):
        return None
    spec = str(model)
    if spec.startswith("embedded:"):
        return spec[len("embedded:"):] or None
    if spec.startswith("tiny:"):
        return "tiny-" + spec[len("tiny:"):]
    path = spec.partition("::")[0].rstrip("/")
    return Path(path).name.removesuffix(".gguf") or None


def lambda_label(lam: Any) -> str | None:
    """λ as a name part or tag value: ``0.03``, or ``0.03,0.1`` when λ_P1 and λ_P2 differ;
    None for no λ. ``lam``: a number, a pair ``(λ_P1, λ_P2)`` or a string already so written."""
    if lam is None or lam == "":
        return None
    if isinstance(lam, str):
        return lam
    if isinstance(lam, (list, tuple)):
        values = list(dict.fromkeys(format(float(v), "g") for v in lam))
        return ",".join(values) or None
    return format(float(lam), "g")


def run_name(stage: str, model: str | None = None, arm: str | None = None,
             seed: int | str | None = None, *, lam: Any = None, split: str | None = None) -> str:
    """What the run is, the parts a reader compares first leading (the UI cuts long names):
    ``<arm> λ<λ> s<seed> · <stage> · <model> · <split>`` for a run of an arm (``mistill λ0.03 s0 ·
    evaluate · smollm2-135m · test``), else ``<stage> · <model> · <split> · s<seed>``; parts that
    are None or empty are left out; ``model`` as :func:`short_model` shows it. Never a run id: a
    part that holds one is left out (the run's tags and lineage keep it)."""
    def kept(*parts: Any) -> list[str]:
        return [str(p) for p in parts if p not in (None, "") and not _RUN_ID.search(str(p))]

    label = lambda_label(lam)
    seed_part = f"s{seed}" if seed not in (None, "") else None
    rest = kept(stage, short_model(model), split or None)
    head = kept(arm)
    if head:
        return " · ".join([" ".join(head + kept(f"λ{label}" if label else None, seed_part)), *rest])
    return " · ".join(rest + kept(seed_part))


def metric_name(*parts: Any) -> str:
    """A metric name from its parts, joined by :data:`METRIC_SEPARATOR`; empty parts are left
    out: ``metric_name("m1", "P2C", "p_pos") == "m1/P2C/p_pos"``, ``metric_name("", "m4", "P1")
    == "m4/P1"``. A part may itself be a name so built (``own/m4``).

    Raises:
        MistillInputError: a part holds ``.`` (a dotted name such as a table column
            ``necessity.global`` is split first: ``metric_name("P1", *col.split("."))``).
    """
    names = [str(p) for p in parts if p is not None and str(p) != ""]
    if not names:
        raise MistillInputError("a metric name needs at least one non-empty part", field="metric")
    return check_metric_name(METRIC_SEPARATOR.join(names))


def check_metric_name(name: str) -> str:
    """``name`` if it is a metric name of this project (non-empty, no ``.``: parts are separated
    by ``/``); otherwise a :class:`MistillInputError` that shows the name with ``/``."""
    if not name or "." in name:
        shown = name.replace(".", METRIC_SEPARATOR)
        raise MistillInputError(f"metric name {name!r} holds '.' or is empty: metric names separate "
                                f"their parts with {METRIC_SEPARATOR!r} (write {shown!r}), so MLflow's UI "
                                f"groups their charts", field="metric")
    return name


def _check_component(value: str, what: str) -> str:
    if not is_safe_name(value):
        raise MistillInputError(f"{what} {value!r} is not a safe path component "
                                f"(letters, digits, '_', '.', '-'; not starting with '.')",
                                field=what)
    return value


class StageRun:
    """One stage's MLflow run: tags, params, ``config.json``, artifacts, per-note resume.

    Use as a context manager::

        guard = PrivacyGuard(note_texts, "restricted")
        with StageRun("attribution", cfg, corpus="mimic4", guard=guard, model=cfg.model,
                      inputs={"traces": traces_run_id}, resume=True) as run:
            if run.reused:
                return run.run_id
            done = run.finished_notes("notes")
            for note in notes:
                if note.note_id in done:
                    continue
                run.write_note("notes", note.note_id, {"events.json": events})
            run.log_metrics({"n_events": n})

    On exit the run ends FINISHED, KILLED if SIGTERM or Ctrl-C stopped it (SIGTERM is turned
    into a :class:`StageInterrupted` while the run is open, when the process had no handler of
    its own), or FAILED if another exception escapes (it is re-raised).

    Args:
        stage: stage name (``mistill.stage`` tag, first part of the run name).
        config: the stage's typed config; ``to_dict()`` gives the params.
        corpus: corpus name: the run goes to experiment ``mistill/<corpus>``.
        guard: the corpus's privacy guard (its level is the ``mistill.privacy`` tag).
        model, arm, seed, precision: tags and run-name parts; taken from ``config`` fields of the
            same name when not given. For a train run's checkpoint (``run:<id>``) the name shows
            the model, arm and λ that run trained.
        lam: the λ the run trains with (a number or ``(λ_P1, λ_P2)``): run-name part and
            ``mistill.lambda`` tag.
        split: the notes the run reads: run-name part (default: the ``mistill.split`` tag, else
            the config's ``split``).
        name: the whole run name, instead of :func:`run_name` of the parts.
        parent: the run this one is nested under (``mlflow.parentRunId``); default: the run of
            the enclosing :func:`child_runs_of`, else the active MLflow run, else none.
        system_metrics: log MLflow's system metrics; default :func:`system_metrics_wanted`.
        corpus_digest: digest of the corpus files (``mistill.corpus_digest``).
        entry_point: MLproject entry point (defaults to ``stage``).
        inputs: lineage ``{name: input run id}``.
        tags: extra tags.
        resume: reuse an identical FINISHED run (``reused=True``, nothing else is done), else
            resume an identical RUNNING/FAILED/KILLED run under its run id, else start anew.
        root: local root; the working dir is ``<root>/work/<run_id>/``.
        repo_root: the source tree whose :func:`code_version` identifies the run.
        code_version: override the computed code version (tests, frozen deployments).
        tracking_uri: server URI (default: ``MLFLOW_TRACKING_URI`` or the project's server).
        attach: the id of a run another process of the same pass opened (rank 0 of a
            ``torchrun`` launch): this one writes notes and tags into it but takes no lease,
            logs no params or ``config.json``, and never ends it.
        record: further entries of ``config.json`` (a train run's resolved arm and the
            deviations it runs under), beside ``config``.

    Inside ``mlflow run`` (``MLFLOW_RUN_ID`` set) the launched run is adopted as the new run
    when it is in the corpus's experiment (``--experiment-name mistill/<corpus>``). If the work
    is reused or resumed elsewhere, or the launched run is in another experiment (``mlflow run``
    without ``--experiment-name``), the work goes to a run of the corpus's experiment and the
    launched run is tagged ``mistill.delegated_to`` and deleted once ``mlflow run`` ends it.
    """

    def __init__(self, stage: str, config: Config, *, corpus: str, guard: PrivacyGuard,
                 model: str | None = None, arm: str | None = None, seed: int | None = None,
                 precision: str | None = None, corpus_digest: str | None = None,
                 entry_point: str | None = None, inputs: Mapping[str, str] | None = None,
                 tags: Mapping[str, Any] | None = None, resume: bool = False,
                 root: Path | str = Path(".mistill"), repo_root: Path | str | None = None,
                 code_version: str | None = None, tracking_uri: str | None = None,
                 lam: Any = None, split: str | None = None, name: str | None = None,
                 parent: str | None = None, system_metrics: bool | None = None,
                 attach: str | None = None, record: Mapping[str, Any] | None = None) -> None:
        if not isinstance(config, Config):
            raise TypeError(f"config must be a mistill.config.Config, got {type(config).__name__}")
        self.stage = stage
        self.config = config
        self.corpus = corpus
        self.guard = guard
        self.content_sha256: dict[str, str] = dict(sorted(config.content_digests().items()))
        self.params: dict[str, Any] = identity_params(config)
        self.model = model if model is not None else self.params.get("model")
        self.arm = arm if arm is not None else self.params.get("arm")
        self.seed = seed if seed is not None else self.params.get("seed")
        self.precision = precision if precision is not None else self.params.get("precision")
        self.corpus_digest = corpus_digest
        self.entry_point = entry_point or stage
        self.inputs = {_check_component(k, "input name"): str(v)
                       for k, v in (inputs or {}).items()}
        self.extra_tags = dict(tags or {})
        self.lam = lambda_label(lam)
        config_split = self.params.get("split")
        self.split = split if split is not None else (
            self.extra_tags.get(TAG_SPLIT) or (config_split if isinstance(config_split, str) else None))
        self._name = name
        self.parent = parent
        self.system_metrics = system_metrics_wanted(stage, system_metrics)
        self.resume = resume
        self.root = Path(root)
        self.repo_root = Path(repo_root) if repo_root is not None else default_repo_root()
        self.code_version = code_version or _code_version(self.repo_root)
        self.git_commit = git_commit(self.repo_root)
        self.params_digest = params_digest(self.params)
        self.tracking_uri = tracking_uri or resolve_tracking_uri(self.root)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run: Run | None = None
        self.experiment_name = ""
        self.experiment_id = ""
        self.reused = False
        self.resumed = False
        self._active = False
        self.lease_settings = LeaseSettings.from_env()
        self.owner = new_owner()
        self._heartbeat: Heartbeat | None = None
        self._signals: _SignalTrap | None = None
        self._checkpoint: tuple[str, dict[str, str]] | None = None
        self.attach = attach
        self.record = dict(record or {})

    # ------------------------------------------------------------------------ properties
    @property
    def run_id(self) -> str:
        if self.run is None:
            raise RuntimeError("StageRun has not been entered")
        return self.run.info.run_id

    @property
    def work_dir(self) -> Path:
        """Local working dir ``<root>/work/<run_id>/``."""
        return self.root / "work" / self.run_id

    @property
    def run_name(self) -> str:
        """The run's name: ``name`` if given, else :func:`run_name` of stage, model, arm, λ,
        split and seed (a checkpoint ``run:<id>`` shown as the model, arm and λ it trained)."""
        if self._name:
            return self._name
        model, arm, lam = self.model, self.arm, self.lam
        if isinstance(model, str) and model.startswith(CHECKPOINT_PREFIX):
            trained = self._checkpoint_tags(model[len(CHECKPOINT_PREFIX):])
            model = trained.get(TAG_MODEL)
            arm = arm or trained.get(TAG_ARM)
        return run_name(self.stage, model, arm, self.seed, lam=lam or self._checkpoint_lambda(),
                        split=self.split)

    def _checkpoint_lambda(self) -> str | None:
        """The λ of the train run whose checkpoint (``run:<id>``) this run reads, if tagged."""
        if isinstance(self.model, str) and self.model.startswith(CHECKPOINT_PREFIX):
            return self._checkpoint_tags(self.model[len(CHECKPOINT_PREFIX):]).get(TAG_LAMBDA)
        return None

    def _checkpoint_tags(self, train_run: str) -> dict[str, str]:
        """The tags of the train run whose checkpoint this run reads (empty if unreadable)."""
        cached = self._checkpoint
        if cached is None or cached[0] != train_run:
            tags: dict[str, str] = {}
            with _tolerate_mlflow_errors():
                tags = dict(self.client.get_run(train_run).data.tags)
            self._checkpoint = cached = (train_run, tags)
        return cached[1]

    def _parent_run(self, own: str | None) -> str | None:
        """The run to nest this one under: ``parent``, else the enclosing :func:`child_runs_of`
        run; never the run itself."""
        parent = self.parent or os.environ.get(ENV_PARENT_RUN) or None
        return parent if parent != own else None

    def tags(self) -> dict[str, str]:
        """All mistill tags of this run (None-valued ones left out)."""
        tags: dict[str, Any] = {
            TAG_STAGE: self.stage, TAG_MODEL: self.model, TAG_CORPUS: self.corpus,
            TAG_CORPUS_DIGEST: self.corpus_digest, TAG_PRIVACY: self.guard.level,
            TAG_ARM: self.arm, TAG_SEED: self.seed, TAG_PRECISION: self.precision,
            TAG_GIT_COMMIT: self.git_commit, TAG_CODE_VERSION: self.code_version,
            TAG_ENTRY_POINT: self.entry_point, TAG_PARAMS_DIGEST: self.params_digest,
            TAG_LAMBDA: self.lam or self._checkpoint_lambda(),
        }
        tags.update({TAG_INPUT_PREFIX + k: v for k, v in self.inputs.items()})
        tags.update(self.extra_tags)
        return {k: str(v) for k, v in tags.items() if v is not None}

    # --------------------------------------------------------------------------- enter/exit
    def __enter__(self) -> StageRun:
        self.config.check_environment()
        if mlflow.get_tracking_uri() != self.tracking_uri:
            mlflow.set_tracking_uri(self.tracking_uri)
        if self.attach:
            self.run = self.client.get_run(self.attach)
            self.experiment_id = self.run.info.experiment_id
            self.experiment_name = self.client.get_experiment(self.experiment_id).name
            self._active = True
            return self
        tags = self.tags()
        launched = os.environ.get("MLFLOW_RUN_ID")
        if launched:
            # `mlflow run` stored its -P values as this run's params before the stage started: if
            # they hold protected text, the run is purged from the store, not only refused
            purge_if_protected(launched, self.guard, tracking_uri=self.tracking_uri, root=self.root, launched=True)
        self.guard.check_mapping(tags, "tag")
        self.guard.check_mapping(self.params, "param")
        self.experiment_name = experiment_for_corpus(self.corpus, tracking_uri=self.tracking_uri)
        self.experiment_id = _experiment_id(self.client, self.experiment_name) or ""
        elsewhere = None
        if launched and self.client.get_run(launched).info.experiment_id != self.experiment_id:
            # `mlflow run` without --experiment-name mistill/<corpus>: the work goes to the corpus's
            # experiment, where the report and the next steps look for it
            elsewhere, launched = launched, None
            os.environ.pop("MLFLOW_RUN_ID", None)

        previous: Run | None = None
        gen = 0
        if self.resume:
            kind, found, gen = self._acquire()
            if kind == "reuse":
                self.run, self.reused = found, True
                self._delegate(launched or elsewhere, found.info.run_id)
                return self
            previous = found

        nested = mlflow.active_run() is not None
        lease = lease_tags(self.owner, gen, self.lease_settings)
        metrics = _system_metrics_available() if self.system_metrics else self.system_metrics
        name = self.run_name
        if previous is not None:
            self._delegate(launched, previous.info.run_id)
            self.client.log_batch(previous.info.run_id, tags=[RunTag(k, v) for k, v in lease.items()])
            active = mlflow.start_run(run_id=previous.info.run_id, run_name=name, nested=nested,
                                      log_system_metrics=metrics)
            self.resumed = True
        elif launched:
            self.client.log_batch(launched, tags=[RunTag(k, v) for k, v in lease.items()])
            active = mlflow.start_run(run_id=launched, run_name=name, nested=nested,
                                      log_system_metrics=metrics)
        else:
            active = mlflow.start_run(experiment_id=self.experiment_id, run_name=name,
                                      nested=nested, tags=lease, log_system_metrics=metrics)
        if elsewhere is not None:
            self._delegate(elsewhere, active.info.run_id)
        self._active = True
        self._signals = _SignalTrap.install()
        self._heartbeat = Heartbeat(self.client, active.info.run_id, self.owner,
                                    self.lease_settings).start()
        try:
            parent = self._parent_run(active.info.run_id)
            if parent is not None:
                tags = {**tags, TAG_PARENT_RUN: parent}
            self._log_batch(tags=tags)
            # a resumed run, or one launched by `mlflow run` (which logged the entry point's
            # parameters itself, as strings): keep what is there; config.json has the typed values
            existing = active.data.params if (self.resumed or launched) else {}
            self._log_batch(params={k: v for k, v in self.params.items() if k not in existing})
            self.run = self.client.get_run(active.info.run_id)
            self.work_dir.mkdir(parents=True, exist_ok=True)
            cfg_path = self.config.save(
                self.work_dir / CONFIG_ARTIFACT, stage=self.stage, entry_point=self.entry_point,
                corpus=self.corpus, privacy=self.guard.level, inputs=self.inputs,
                content_sha256=self.content_sha256, code_version=self.code_version,
                git_commit=self.git_commit, params_digest=self.params_digest, run_id=self.run_id,
                **self.record)
            self.log_artifact_file(cfg_path)
        except BaseException as exc:
            if is_unreachable(exc):
                self._abandon(exc)
            self._end("FAILED")
            raise
        return self

    def _acquire(self) -> tuple[str, Run | None, int]:
        """Find or claim the run this stage works in, waiting while another process holds it.

        Returns ``("reuse", run, 0)`` for an identical FINISHED run, ``("resume", run, g)`` for a
        resumable run whose lease this process took at generation ``g``, or ``("new", None, 0)``
        when this process claimed the creation of the run. An identical run under a live lease
        (another process works on it, or is creating it) is waited for, or refused
        (:class:`~mistill.tracking.lease.LeaseSettings`).
        """
        settings = self.lease_settings
        key = identity_key(self.experiment_id, self.entry_point, self.params_digest, self.code_version,
                           self.inputs)
        waited_since: float | None = None
        while True:
            found = find_run(self.experiment_name, self.entry_point, self.params, self.code_version,
                             self.inputs, "FINISHED", tracking_uri=self.tracking_uri)
            if found is not None:
                return "reuse", found, 0
            previous = find_run(self.experiment_name, self.entry_point, self.params, self.code_version,
                                self.inputs, RESUMABLE_STATUSES, tracking_uri=self.tracking_uri)
            if previous is not None:
                if not lease_held(previous, settings):
                    gen = generation(previous) + 1
                    if claim(self.client, f"{previous.info.run_id}/{gen}"):
                        return "resume", previous, gen
                holder = (f"run {previous.info.run_id} "
                          f"({describe_owner(previous.data.tags.get(TAG_LEASE_OWNER, ''))})")
            elif claim_new_run(self.client, key, settings):
                return "new", None, 0
            else:
                holder = "another process that is creating it"
            message = (f"{self.stage}: an identical run is being worked on by {holder}")
            if settings.on_busy == "refuse":
                raise LeaseError(f"{message}; refusing ({ENV_ON_BUSY}=refuse). Wait for it to "
                                 f"finish, or rerun with {ENV_ON_BUSY}=wait to reuse its result")
            now = time.time()
            if waited_since is None:
                waited_since = now
                _log.warning("%s; waiting for it to finish", message)
            elif settings.wait_max_s and now - waited_since > settings.wait_max_s:
                raise LeaseError(f"{message}; gave up after {settings.wait_max_s:g} s "
                                 f"({ENV_WAIT_MAX})")
            time.sleep(settings.poll_s)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self.reused or not self._active:
            return False
        if self.attach:  # the run's owner ends it
            self._active = False
            return False
        if exc is not None and is_unreachable(exc):
            self._abandon(exc)
        ok = exc_type is None or (exc_type is SystemExit and exc.code in (0, None))
        killed = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        self._end("FINISHED" if ok else "KILLED" if killed else "FAILED")
        return False

    def _abandon(self, exc: BaseException) -> None:
        """The server is gone: leave the run as it is (no more calls, each would wait out the
        client's bound), and raise the clear error naming the run a rerun resumes."""
        self._active = False
        self._release_signals()
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.stop(wait=False)
        run_id = self.run.info.run_id if self.run is not None else None
        active = mlflow.active_run()
        run_id = run_id or (active.info.run_id if active is not None else None)
        if run_id is not None:
            _stop_system_metrics(run_id, flush=False)
            _pop_fluent_run(run_id)
        raise unavailable_error(exc, uri=self.tracking_uri, run_id=run_id) from exc

    def _end(self, status: str) -> None:
        """End the run with ``status`` unless this process lost its lease, or the run is already
        FINISHED in the store: a FINISHED run's status never changes."""
        self._active = False
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.stop()
        run_id = self.run.info.run_id if self.run is not None else None
        active = mlflow.active_run()
        if run_id is None and active is not None:
            run_id = active.info.run_id
        if run_id is None:
            self._release_signals()
            return
        try:
            keep = heartbeat is not None and not heartbeat.still_owner()
            if not keep and status != "FINISHED":
                keep = self.client.get_run(run_id).info.status == "FINISHED"
            with quiet_run_links():
                if active is not None and active.info.run_id == run_id and not keep:
                    mlflow.end_run(status)
                elif not keep:
                    self.client.set_terminated(run_id, status)
            if not keep:
                _log.info("View run %s (%s) at: %s", self.run_name, status, self.run_url(run_id))
            if self.run is not None:
                self.run = self.client.get_run(run_id)
        except Exception as exc:  # noqa: BLE001 - never mask the error that ended the stage
            if status == "FINISHED" or is_unreachable(exc):
                raise
            warnings.warn(f"could not end run {run_id} as {status} ({type(exc).__name__}: {exc}); "
                          f"its lease lapses and a rerun resumes it", RuntimeWarning, stacklevel=2)
        finally:
            _stop_system_metrics(run_id)
            _pop_fluent_run(run_id)
            self._release_signals()

    def _release_signals(self) -> None:
        trap, self._signals = self._signals, None
        if trap is not None:
            trap.restore()

    def run_url(self, run_id: str | None = None) -> str:
        """The run's page in the MLflow UI."""
        return run_url(self.tracking_uri, self.experiment_id, run_id or self.run_id)

    def _delegate(self, launched: str | None, target: str) -> None:
        """A run launched by ``mlflow run`` whose work lives in ``target``: point it there and
        have it deleted once ``mlflow run`` has ended it (:mod:`mistill.tracking.reaper`), so one
        ``mlflow run`` leaves one run."""
        if launched and launched != target:
            with _tolerate_mlflow_errors():
                self.client.set_tag(launched, TAG_DELEGATED_TO, target)
                spawn_reaper(launched, self.tracking_uri)
            os.environ.pop("MLFLOW_RUN_ID", None)

    def _require_active(self) -> None:
        if self.reused:
            raise RuntimeError(f"run {self.run_id} was reused (FINISHED): it is not written to")
        if not self._active:
            raise RuntimeError("StageRun is not active (use it as a context manager)")
        if self._heartbeat is not None and self._heartbeat.lost:
            raise LeaseError(f"run {self.run_id} was taken over by another process (this one was "
                             f"presumed dead): stopping without writing to it")

    # ------------------------------------------------------------------------------ logging
    def _log_batch(self, *, params: Mapping[str, Any] | None = None,
                   tags: Mapping[str, str] | None = None,
                   metrics: list[Metric] | None = None) -> None:
        run_id = mlflow.active_run().info.run_id if self.run is None else self.run_id
        p = [Param(k, param_string(v)) for k, v in (params or {}).items()]
        t = [RunTag(k, v if len(v) <= MAX_TAG_VALUE else v[:MAX_TAG_VALUE])
             for k, v in (tags or {}).items()]
        for i in range(0, len(p), _PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=p[i:i + _PARAMS_PER_BATCH])
        for i in range(0, len(t), _PARAMS_PER_BATCH):
            self.client.log_batch(run_id, tags=t[i:i + _PARAMS_PER_BATCH])
        m = metrics or []
        for i in range(0, len(m), _METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=m[i:i + _METRICS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log numeric metrics (names checked by the privacy guard).

        Raises:
            MistillInputError: a name holds ``.`` (see :func:`check_metric_name`); nothing of
                the batch is logged.
        """
        self._require_active()
        self.guard.check_mapping({k: None for k in metrics}, "metric")
        for k in metrics:
            check_metric_name(k)
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, int(step or 0)) for k, v in metrics.items()]
        self._log_batch(metrics=batch)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set tags (keys and values checked by the privacy guard)."""
        self._require_active()
        str_tags = {k: str(v) for k, v in tags.items() if v is not None}
        self.guard.check_mapping(str_tags, "tag")
        self._log_batch(tags=str_tags)

    def log_artifact_file(self, local_path: Path | str, artifact_path: str | None = None) -> None:
        """Log a file (or a directory's contents) after the privacy guard has checked it."""
        self._require_active()
        p = Path(local_path)
        if p.is_dir():
            self.guard.check_dir(p)
            self.client.log_artifacts(self.run_id, str(p), artifact_path)
        else:
            self.guard.check_file(p)
            self.client.log_artifact(self.run_id, str(p), artifact_path)

    def _local_artifact(self, name: str) -> tuple[Path, str | None]:
        """Local path under ``<work>/artifacts/`` for artifact ``name`` (may contain '/')."""
        parts = [_check_component(part, "artifact name") for part in name.split("/")]
        path = self.work_dir.joinpath("artifacts", *parts)
        return path, "/".join(parts[:-1]) or None

    def log_json(self, name: str, obj: Any) -> Path:
        """Write ``obj`` as JSON to ``<name>`` (``.json`` appended if missing) and log it."""
        if not name.endswith(".json"):
            name += ".json"
        path, artifact_dir = self._local_artifact(name)
        write_json(path, obj)
        self.log_artifact_file(path, artifact_dir)
        return path

    def log_table(self, name: str, df: Any, *, float_format: str = ".6g",
                  index: bool | None = None, mlflow_table: bool = False) -> tuple[Path, Path]:
        """Log a pandas DataFrame as ``<name>.csv`` and ``<name>.md``; return both local paths.

        ``index`` defaults to writing the index only when it is not a plain RangeIndex.
        ``mlflow_table``: also log it as an MLflow table, ``<name>.json``
        (:meth:`log_mlflow_table`).
        """
        import pandas as pd  # deferred: pandas is slow to import

        if index is None:
            index = not isinstance(df.index, pd.RangeIndex) or df.index.name is not None
        csv_path, artifact_dir = self._local_artifact(name + ".csv")
        md_path = csv_path.with_suffix(".md")
        write_text(csv_path, df.to_csv(index=index))
        write_text(md_path, markdown_table(df, float_format=float_format, index=index))
        self.guard.check_file(csv_path)
        self.guard.check_file(md_path)
        self.log_artifact_file(csv_path, artifact_dir)
        self.log_artifact_file(md_path, artifact_dir)
        if mlflow_table:
            self.log_mlflow_table(name, df.reset_index() if index else df)
        return csv_path, md_path

    def log_mlflow_table(self, name: str, df: Any) -> Path:
        """Log a pandas DataFrame as the MLflow table ``<name>.json`` and return its local path.

        The file is what ``mlflow.log_table`` writes (``orient="split"``, no index), so
        ``mlflow.load_table`` reads it back, and it is listed in the run's
        ``mlflow.loggedArtifacts`` tag, so the UI shows it as a table. Unlike ``mlflow.log_table``
        a second call replaces the table instead of appending to it: a resumed run logs it once.
        For a restricted corpus the frame must hold no free text and no protected text
        (:meth:`PrivacyGuard.check_dataframe`), then the file is checked like any artifact.
        """
        # deferred: mlflow.utils.mlflow_tags is slow to import
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

        self._require_active()
        self.guard.check_dataframe(df, f"table {name}")
        path, artifact_dir = self._local_artifact(name + ".json")
        write_text(path, df.to_json(orient="split", index=False, date_format="iso"))
        self.log_artifact_file(path, artifact_dir)
        entry = {"path": f"{artifact_dir}/{path.name}" if artifact_dir else path.name, "type": "table"}
        listed = json.loads(self.client.get_run(self.run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS) or "[]")
        if entry not in listed:
            self._log_batch(tags={MLFLOW_LOGGED_ARTIFACTS: json.dumps(listed + [entry])})
        return path

    def log_figure(self, fig: Any, name: str) -> Path:
        """Log a plotly figure as self-contained HTML (plotly.js embedded: opens offline).

        The figure's JSON (all its data and text) is what the privacy guard checks.
        """
        self._require_active()
        if not name.endswith(".html"):
            name += ".html"
        if not self.guard.allows_text:
            self.guard.check_text(fig.to_json(), f"figure {name}")
        path, artifact_dir = self._local_artifact(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        html = fig.to_html(include_plotlyjs=True, full_html=True)
        write_text(path, html)
        self.client.log_artifact(self.run_id, str(path), artifact_dir)
        return path

    def log_dataset(self, df: Any, name: str, digest: str, context: str) -> None:
        """Record a dataset as a run input (``mlflow.log_input``): schema, size and digest.

        Restricted corpora: refused if a column name or a string cell carries protected text,
        or a string column holds free text (see :meth:`PrivacyGuard.check_dataframe`).
        """
        self._require_active()
        import mlflow.data  # deferred: mlflow.data is slow to import

        self.guard.check_text(name, "dataset name")
        self.guard.check_dataframe(df, f"dataset {name}")
        # MLflow keeps at most 36 characters of a dataset digest: log its head, tag the whole
        self.set_tags({f"mistill.dataset_digest.{name}": digest})
        with warnings.catch_warnings():  # schema inference hints about integer columns
            warnings.filterwarnings("ignore", category=UserWarning, module=r"mlflow\.")
            dataset = mlflow.data.from_pandas(df, name=name, digest=digest[:DATASET_DIGEST_CHARS])
            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:
                mlflow.log_input(dataset, context=context)
            else:
                # deferred: mlflow.utils.mlflow_tags is slow to import
                from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

                self.client.log_inputs(self.run_id, [DatasetInput(
                    dataset._to_mlflow_entity(), [InputTag(MLFLOW_DATASET_CONTEXT, context)])])

    # ----------------------------------------------------------------------- per-note files
    def note_dir(self, subdir: str, note_id: str) -> Path:
        """Local dir ``<work>/<subdir>/<note_id>/``."""
        return self.work_dir / _check_component(subdir, "subdir") / _check_component(
            str(note_id), "note_id")

    def note_artifact_path(self, subdir: str, note_id: str, filename: str) -> Path:
        """Local path of one per-note file (parent dirs created)."""
        path = self.note_dir(subdir, note_id) / _check_component(filename, "filename")
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def write_note(self, subdir: str, note_id: str, files: Mapping[str, bytes | str | Any], *,
                   local_files: Mapping[str, bytes | str | Any] | None = None) -> None:
        """Write one note's files atomically, then ``_DONE``, then upload them (``_DONE`` last).

        Values: ``bytes`` written as is, ``str`` as UTF-8, anything else as JSON. Every file is
        checked by the privacy guard before anything is uploaded; on refusal the note's local
        files are removed and :class:`PrivacyError` is raised.

        ``local_files`` (same value types) are model text of a restricted corpus: written
        atomically under the run's enclave ``<work>/enclave/<subdir>/<note_id>/``, recorded in
        ``_DONE`` with their sha256 (key ``local_files``), never uploaded nor passed to MLflow.
        The first note with local files tags the run with its enclave dir
        (``mistill.enclave_dir``). :meth:`load_note` and
        :meth:`mistill.stages.common.RunReader.note_file` read them back, checked.
        """
        self._require_active()
        local_files = dict(local_files or {})
        _check_note_filenames(subdir, str(note_id), files, local_files)
        note_dir = self.note_dir(subdir, note_id)
        enclave_dir = self.enclave_note_dir(subdir, note_id)
        written: list[Path] = []
        kept: list[Path] = []
        try:
            for filename, content in local_files.items():  # first: a note never ends half local
                path = enclave_dir / _check_component(filename, "filename")
                _write_note_content(path, content)
                kept.append(path)
            for filename, content in files.items():
                path = self.note_artifact_path(subdir, note_id, filename)
                _write_note_content(path, content)
                written.append(path)
                self.guard.check_file(path)
            if kept:
                self._tag_enclave()
        except BaseException:
            shutil.rmtree(note_dir, ignore_errors=True)
            shutil.rmtree(enclave_dir, ignore_errors=True)
            raise
        done: dict[str, Any] = {"files": {p.name: sha256_file(p) for p in written}}
        if kept:
            done[LOCAL_FILES_KEY] = {p.name: sha256_file(p) for p in kept}
        done["time"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        done = sign_done(done, run_id=self.run_id, subdir=subdir, note_id=str(note_id))
        write_json(note_dir / DONE_MARKER, done)
        self._upload_note(subdir, str(note_id))

    @property
    def enclave_dir(self) -> Path:
        """The run's local enclave ``<work>/enclave/`` (absolute): the per-note files that are
        model text of a restricted corpus, kept only on this machine (see :meth:`write_note`)."""
        return (self.work_dir / ENCLAVE_DIR).resolve()

    def enclave_note_dir(self, subdir: str, note_id: str) -> Path:
        """Local dir ``<work>/enclave/<subdir>/<note_id>/`` of one note's local files."""
        return self.enclave_dir / _check_component(subdir, "subdir") / _check_component(
            str(note_id), "note_id")

    def _tag_enclave(self) -> None:
        """Tag the run once with its enclave dir (a path on this machine, no text)."""
        value = str(self.enclave_dir)
        if getattr(self, "_enclave_tagged", None) == value:
            return
        if self.run is None or self.run.data.tags.get(TAG_ENCLAVE_DIR) != value:
            self.set_tags({TAG_ENCLAVE_DIR: value})
        self._enclave_tagged = value

    def _note_done(self, subdir: str, note_id: str, filename: str) -> dict[str, Any]:
        """One note's ``_DONE`` record: the local copy, else downloaded from the run's artifacts."""
        done_path = self.note_dir(subdir, note_id) / DONE_MARKER
        self._fetch_note_file(subdir, note_id, DONE_MARKER, done_path,
                              f"run {self.run_id}: note has no {DONE_MARKER} marker", filename)
        return verify_done(read_json(done_path), run_id=self.run_id, subdir=subdir,
                           note_id=str(note_id))

    def _fetch_note_file(self, subdir: str, note_id: str, name: str, path: Path, missing: str,
                         filename: str) -> None:
        """Download ``<subdir>/<note_id>/<name>`` of this run to ``path`` unless it is there."""
        if path.is_file():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".dl-") as tmp, quiet_downloads():
            try:
                got = self.client.download_artifacts(self.run_id, f"{subdir}/{note_id}/{name}", tmp)
            except (MlflowException, OSError) as exc:
                if is_unreachable(exc):
                    raise
                raise MistillInputError(missing, file=filename, note=str(note_id), field=subdir) from None
            os.replace(got, path)

    def _upload_note(self, subdir: str, note_id: str) -> None:
        """Upload a finished note's files, ``_DONE`` last; its local files (named under
        ``local_files`` in ``_DONE``, kept in the enclave) are never uploaded, even if a copy
        sits beside the others."""
        note_dir = self.note_dir(subdir, note_id)
        artifact_dir = f"{subdir}/{note_id}"
        local = set(_local_entries(verify_done(read_json(note_dir / DONE_MARKER), run_id=self.run_id,
                                               subdir=subdir, note_id=str(note_id))))
        for path in sorted(note_dir.iterdir()):
            if path.is_file() and not path.name.startswith(".") and path.name != DONE_MARKER \
                    and path.name not in local:
                self.client.log_artifact(self.run_id, str(path), artifact_dir)
        self.client.log_artifact(self.run_id, str(note_dir / DONE_MARKER), artifact_dir)
        write_text(note_dir / _UPLOADED_MARKER, "")

    def finished_notes(self, subdir: str) -> set[str]:
        """Notes with a ``_DONE`` marker locally or in the run's artifact store.

        Notes finished locally whose upload was interrupted are uploaded now, so the store ends
        up complete.
        """
        local_root = self.work_dir / _check_component(subdir, "subdir")
        done: set[str] = set()
        if local_root.is_dir():
            for note_dir in local_root.iterdir():
                if (note_dir / DONE_MARKER).is_file():
                    # a local marker decides that the note is skipped: it must be this store's
                    verify_done(read_json(note_dir / DONE_MARKER), run_id=self.run_id,
                                subdir=subdir, note_id=note_dir.name)
                    done.add(note_dir.name)
                    if not self.reused and self._active and \
                            not (note_dir / _UPLOADED_MARKER).exists():
                        self._upload_note(subdir, note_dir.name)
        for info in self.client.list_artifacts(self.run_id, subdir):
            note_id = info.path.rsplit("/", 1)[-1]
            if not info.is_dir or note_id in done:
                continue
            names = {f.path.rsplit("/", 1)[-1] for f in self.client.list_artifacts(
                self.run_id, info.path)}
            if DONE_MARKER in names:
                done.add(note_id)
        return done

    def load_note(self, subdir: str, note_id: str, filename: str) -> Any:
        """One per-note file, read locally or downloaded from the run's artifacts.

        A local file (``local_files`` of :meth:`write_note`) is read from the run's enclave on
        this machine, never downloaded; absent, it is an error naming the run. Every file is
        checked against the sha256 the note's ``_DONE`` recorded. ``.json`` files are parsed;
        anything else is returned as bytes.
        """
        _check_component(filename, "filename")
        done = self._note_done(subdir, str(note_id), filename)
        if filename in _local_entries(done):
            path = self.enclave_note_dir(subdir, note_id) / filename
            if not path.is_file():
                raise enclave_missing_error(self.run_id, subdir, str(note_id), filename, [path.parent])
            verify_local_note_file(path, done, run_id=self.run_id, subdir=subdir, note_id=str(note_id))
        else:
            path = self.note_dir(subdir, note_id) / filename
            self._fetch_note_file(subdir, str(note_id), filename, path, "per-note artifact not found", filename)
            verify_note_file(path, done, run_id=self.run_id, subdir=subdir, note_id=str(note_id))
        if path.suffix == ".json":
            return read_json(path)
        return path.read_bytes()


def verify_note_file(path: Path, done: Mapping[str, Any], *, run_id: str, subdir: str, note_id: str) -> None:
    """Check one per-note file against the sha256 its note's ``_DONE`` marker recorded.

    Raises:
        MistillInputError: the file is not listed in ``_DONE``, or its content changed after the
            note finished (names the run, the note and the file).
    """
    where = f"{subdir}/{note_id}/{path.name}"
    files = done.get("files") if isinstance(done, Mapping) else None
    want = files.get(path.name) if isinstance(files, Mapping) else None
    if want is None:
        raise MistillInputError(f"run {run_id}: {where} is not listed in the note's {DONE_MARKER} marker",
                                file=path.name, note=note_id, field=subdir)
    got = sha256_file(path)
    if got != want:
        raise MistillInputError(
            f"run {run_id}: {where} does not match the sha256 recorded when the note finished "
            f"(recorded {want[:16]}, found {got[:16]}): the artifact was changed afterwards",
            file=path.name, note=note_id, field=subdir)


# ----------------------------------------------------------------------- the local enclave
TAG_ENCLAVE_DIR = "mistill.enclave_dir"
"""Where a run keeps its local files: ``<work>/enclave`` on the machine that ran it (a path)."""
ENCLAVE_DIR = "enclave"
LOCAL_FILES_KEY = "local_files"
"""The key of ``_DONE`` that lists a note's local files (name -> sha256)."""


def _local_entries(done: Any) -> dict[str, str]:
    """A ``_DONE`` record's local files (name -> sha256); empty when it has none."""
    entries = done.get(LOCAL_FILES_KEY) if isinstance(done, Mapping) else None
    return dict(entries) if isinstance(entries, Mapping) else {}


def _write_note_content(path: Path, content: bytes | str | Any) -> None:
    """Write one per-note file atomically: bytes as is, str as UTF-8, anything else as JSON."""
    if isinstance(content, bytes):
        write_bytes(path, content)
    elif isinstance(content, str):
        write_text(path, content)
    else:
        write_json(path, content)


def _check_note_filenames(subdir: str, note_id: str, files: Mapping[str, Any],
                          local_files: Mapping[str, Any]) -> None:
    """Refuse ``_DONE`` as a file name, a name both uploaded and local, and ``enclave`` as a
    subdir (it would nest the uploaded note dirs inside the enclave)."""
    if DONE_MARKER in files or DONE_MARKER in local_files:
        raise MistillInputError(f"{DONE_MARKER} is reserved", note=note_id, field="filename")
    both = sorted(set(files) & set(local_files))
    if both:
        raise MistillInputError(f"{both[0]} is given both as an uploaded and as a local file",
                                note=note_id, field="filename")
    if subdir == ENCLAVE_DIR:
        raise MistillInputError(f"subdir {ENCLAVE_DIR!r} is reserved for the local enclave",
                                note=note_id, field="subdir")


def verify_local_note_file(path: Path, done: Mapping[str, Any], *, run_id: str, subdir: str,
                           note_id: str) -> None:
    """Check one local (enclave) file against the sha256 its note's ``_DONE`` recorded under
    ``local_files``.

    Raises:
        MistillInputError: the file is not a recorded local file, or its content changed after
            the note finished (names the run, the note and the file).
    """
    where = f"{subdir}/{note_id}/{path.name}"
    want = _local_entries(done).get(path.name)
    if want is None:
        raise MistillInputError(f"run {run_id}: {where} is not a local file of the note's "
                                f"{DONE_MARKER} marker", file=path.name, note=note_id, field=subdir)
    got = sha256_file(path)
    if got != want:
        raise MistillInputError(
            f"run {run_id}: the local file {where} does not match the sha256 recorded when the note "
            f"finished (recorded {want[:16]}, found {got[:16]}): it was changed afterwards",
            file=path.name, note=note_id, field=subdir)


def enclave_missing_error(run_id: str, subdir: str, note_id: str, filename: str,
                          looked: Iterable[Path]) -> MistillInputError:
    """The error for a local file absent from this machine: it is restricted model text, kept
    only in the enclave of the machine that ran the run, never in MLflow."""
    where = ", ".join(str(p) for p in looked)
    return MistillInputError(
        f"run {run_id}: {subdir}/{note_id}/{filename} is restricted model text kept only in the "
        f"local enclave of the machine that ran run {run_id} (not found in {where}); it is never "
        f"stored in MLflow: run this stage on that machine", file=filename, note=note_id,
        field=subdir)


# ------------------------------------------------------------------------ nesting and links
@contextlib.contextmanager
def child_runs_of(parent_run_id: str | None) -> Iterator[None]:
    """Nest the stage runs started inside under ``parent_run_id`` (``mlflow.parentRunId``),
    in this process and in the processes it launches (``mlflow run`` included): the id travels
    in ``$MISTILL_PARENT_RUN_ID``, restored on exit. None: no change."""
    if not parent_run_id:
        yield
        return
    with environment_variable(ENV_PARENT_RUN, parent_run_id):
        yield


_ENV_QUIET_LINKS = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
_quiet_links_lock = threading.Lock()
_quiet_links = {"depth": 0, "saved": None}


@contextlib.contextmanager
def quiet_run_links() -> Iterator[None]:
    """MLflow prints ``View run <name> at: <url>`` whenever a run ends; inside this block it
    does not (:class:`StageRun` logs one such line itself, with the run's status).

    Safe across threads (the cells of a λ selection end their runs in worker threads): blocks
    that overlap share one setting of the environment variable, restored when the last ends."""
    with _quiet_links_lock:
        if _quiet_links["depth"] == 0:
            _quiet_links["saved"] = os.environ.get(_ENV_QUIET_LINKS)
            os.environ[_ENV_QUIET_LINKS] = "true"
        _quiet_links["depth"] += 1
    try:
        yield
    finally:
        with _quiet_links_lock:
            _quiet_links["depth"] -= 1
            if _quiet_links["depth"] == 0:
                saved = _quiet_links["saved"]
                if saved is None:
                    os.environ.pop(_ENV_QUIET_LINKS, None)
                else:
                    os.environ[_ENV_QUIET_LINKS] = saved


UI_VIEW = "?workflowType=machine_learning"
"""The UI's query that opens the runs views (MLflow 3 otherwise opens an experiment on its GenAI
traces overview)."""


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """A run's page in the MLflow UI of ``tracking_uri``."""
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}{UI_VIEW}"


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    """An experiment's runs table in the MLflow UI of ``tracking_uri``."""
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs{UI_VIEW}"


# --------------------------------------------------------------------------- system metrics
def system_metrics_wanted(stage: str, requested: bool | None = None) -> bool:
    """Whether a run of ``stage`` logs MLflow's system metrics (CPU and GPU utilisation and
    memory, every 10 s under ``system/``).

    ``$MISTILL_SYSTEM_METRICS``: ``0`` turns them off for every stage, ``1`` on for every
    stage; unset, ``requested`` decides, else whether ``stage`` is one of
    :data:`SYSTEM_METRICS_STAGES`.
    """
    switch = os.environ.get(ENV_SYSTEM_METRICS, "").strip().lower()
    if switch in ("0", "false", "no", "off"):
        return False
    if switch in ("1", "true", "yes", "on"):
        return True
    return requested if requested is not None else stage in SYSTEM_METRICS_STAGES


_PSUTIL_WARNED = False


def _system_metrics_available() -> bool:
    """psutil is what MLflow samples with: without it, warn once and log no system metrics.
    MLflow's own monitor messages (started, stopped, no GPU found) are kept to warnings."""
    global _PSUTIL_WARNED

    if importlib.util.find_spec("psutil") is None:
        if not _PSUTIL_WARNED:
            _PSUTIL_WARNED = True
            _log.warning("psutil is not installed: no system metrics are logged (install psutil, "
                         "or set %s=0 to silence this)", ENV_SYSTEM_METRICS)
        return False
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    return True


def _stop_system_metrics(run_id: str, *, flush: bool = True) -> None:
    """Stop the system-metrics monitor of ``run_id`` if one still runs (a run ended through the
    client, or left because the server is gone: ``flush=False`` sends nothing more)."""
    monitor = fluent.run_id_to_system_metrics_monitor.pop(run_id, None)
    if monitor is None:
        return
    if flush:
        monitor.finish()
    else:
        monitor._shutdown_event.set()


# ----------------------------------------------------------------------------- interruption
class StageInterrupted(KeyboardInterrupt):
    """SIGTERM reached a process while a stage run was open: the run ends KILLED, and a
    launcher waiting on a child (``mlflow run``) cancels it as it would on Ctrl-C."""


class _SignalTrap:
    """SIGTERM raised as :class:`StageInterrupted` in the main thread while a run is open, so
    the run ends KILLED instead of staying RUNNING. Installed only where SIGTERM still has its
    default action (an outer run's trap, or an application's own handler, is kept)."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise StageInterrupted(f"stopped by {signal.Signals(signum).name}")

    @classmethod
    def install(cls) -> _SignalTrap | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return None
            return cls(signal.signal(signal.SIGTERM, cls._raise))
        except (ValueError, OSError):  # no signals here (an embedded interpreter)
            return None

    def restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signal.SIGTERM, self.previous)


def _pop_fluent_run(run_id: str) -> None:
    """Leave MLflow's fluent active-run stack without ending the run in the store (MLflow has
    no public call for that: ``mlflow.end_run`` always sets a status)."""
    stack = fluent._active_run_stack.get()
    if stack and stack[-1].info.run_id == run_id:
        stack.pop()
    if os.environ.get("MLFLOW_RUN_ID") == run_id:
        os.environ.pop("MLFLOW_RUN_ID", None)


def markdown_table(df: Any, *, float_format: str = ".6g", index: bool = False) -> str:
    """A GitHub-flavoured Markdown table of a DataFrame (no ``tabulate`` needed).

    Numbers are right-aligned; floats use ``float_format``; ``|`` and newlines are escaped.
    """
    import pandas as pd  # deferred: pandas is slow to import

    def cell(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        if isinstance(v, float):
            return format(v, float_format)
        return str(v).replace("|", "\\|").replace("\r", " ").replace("\n", "<br>")

    frame = df.reset_index() if index else df
    headers = [cell(c) for c in frame.columns]
    numeric = [pd.api.types.is_numeric_dtype(frame[c]) and not pd.api.types.is_bool_dtype(frame[c])
               for c in frame.columns]
    rows = [[cell(v.item() if hasattr(v, "item") else v) for v in rec]
            for rec in frame.itertuples(index=False, name=None)]
    widths = [max([len(h), 3] + [len(r[j]) for r in rows]) for j, h in enumerate(headers)]

    def line(values: list[str]) -> str:
        return "| " + " | ".join(v.rjust(w) if num else v.ljust(w)
                                 for v, w, num in zip(values, widths, numeric)) + " |"

    sep = "| " + " | ".join(("-" * (w - 1) + ":") if num else "-" * w
                            for w, num in zip(widths, numeric)) + " |"
    return "\n".join([line(headers), sep] + [line(r) for r in rows]) + "\n"


__all__ = [
    "TAG_STAGE", "TAG_MODEL", "TAG_CORPUS", "TAG_CORPUS_DIGEST", "TAG_PRIVACY", "TAG_ARM",
    "TAG_SEED", "TAG_PRECISION", "TAG_SPLIT", "TAG_GIT_COMMIT", "TAG_CODE_VERSION", "TAG_ENTRY_POINT",
    "TAG_PARAMS_DIGEST", "TAG_INPUT_PREFIX", "TAG_DELEGATED_TO", "RESUMABLE_STATUSES",
    "StageRun", "find_run", "experiment_for_corpus", "code_version", "git_commit",
    "canonical_params", "params_digest", "identity_params", "param_string", "parse_param", "typed_equal",
    "run_name", "markdown_table", "resolve_tracking_uri", "verify_note_file", "DONE_MARKER",
    "TAG_ENCLAVE_DIR", "ENCLAVE_DIR", "LOCAL_FILES_KEY", "verify_local_note_file", "enclave_missing_error",
    "TAG_LAMBDA", "TAG_PARENT_RUN", "TAG_EXPERIMENT_KIND", "EXPERIMENT_KIND", "SYSTEM_METRICS_STAGES",
    "StageInterrupted", "child_runs_of", "experiment_url", "quiet_run_links", "run_url", "short_model",
    "lambda_label",
    "system_metrics_wanted", "quiet_downloads", "METRIC_SEPARATOR", "metric_name", "check_metric_name",
    "repo_file",
]
