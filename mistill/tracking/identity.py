"""Run identity and reuse: what makes two stage runs the same, and finding a run to reuse.

* A run is identified by its entry point, its typed params (canonical JSON -> sha256 in the tag
  ``mistill.params_digest``), the code version and its inputs: :func:`find_run` finds an
  identical run, and :class:`~mistill.tracking.runs.StageRun` with ``resume=True`` reuses a
  FINISHED one, resumes a RUNNING/FAILED/KILLED one under the same run id
  (:data:`RESUMABLE_STATUSES`), or starts a new one.
* The code version is the sha256 of the source tree (:func:`code_version`); a file a config names
  by path counts by its content (:func:`identity_params`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.tracking.connection import is_unreachable
from mistill.tracking.experiments import _client, _experiment_id, quiet_downloads
from mistill.tracking.naming import (CONFIG_ARTIFACT, TAG_CODE_VERSION, TAG_ENTRY_POINT, TAG_INPUT_PREFIX,
                                     TAG_PARAMS_DIGEST)

MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value

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


# --------------------------------------------------------------------------------- find_run
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


__all__ = [
    "RESUMABLE_STATUSES", "SOURCE_DIRS", "SOURCE_SUFFIXES", "MAX_PARAM_VALUE", "CONTENT_SUFFIX",
    "default_repo_root", "repo_file", "code_version", "git_commit", "canonical_params", "identity_params",
    "params_digest", "typed_equal", "param_string", "parse_param", "find_run",
]
