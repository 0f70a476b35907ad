"""Who may change the project's tracking store, and how a reader knows it was not changed.

The project's MLflow server runs MLflow's own ``basic-auth`` app: every request but ``/health``
needs a user name and password, and the only user is the store's owner, the project's admin
user. The credentials are made when a root's server first starts and kept in
``<root>/credentials.json`` (mode 600), with two more secrets of that store:

* ``flask_secret_key``: the static key the auth app needs (``MLFLOW_FLASK_SERVER_SECRET_KEY``);
* ``done_key``: the key that signs every note's ``_DONE`` marker (HMAC-SHA256,
  :func:`sign_done`, :func:`verify_done`). A ``_DONE`` whose signature does not verify, or that
  was signed for another run or note, is refused wherever it is read.

The project's clients read the file: :func:`use_credentials` sets ``MLFLOW_TRACKING_USERNAME``,
``MLFLOW_TRACKING_PASSWORD`` and ``MISTILL_CREDENTIALS`` (the file's path) in this process, and
every process it launches (``mlflow run`` children included) inherits them. A root first started
by a process that already uses another root's credentials takes the same ones, so that one
process (a test session, a pipeline) can use several local servers with one set.

A client of a server the project did not start, with no ``$MISTILL_CREDENTIALS``, signs with
the key of ``$MISTILL_ROOT/credentials.json`` (made there on first use): every process that
writes or reads the same runs must use the same file.

Store files are owner-only (:func:`make_owner_only`): directories 700, files 600; the server
runs with umask 077.

This module imports neither MLflow nor anything heavy.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mistill.errors import MistillInputError
from mistill.io import atomic_open

CREDENTIALS_FILE = "credentials.json"
AUTH_CONFIG_FILE = "auth.ini"
AUTH_DB_FILE = "auth.db"
OWNER_USERNAME = "mistill"
ENV_USERNAME = "MLFLOW_TRACKING_USERNAME"
ENV_PASSWORD = "MLFLOW_TRACKING_PASSWORD"
ENV_CREDENTIALS = "MISTILL_CREDENTIALS"
"""Path of the credentials file this process's MLflow credentials and ``_DONE`` key come from."""
DEFAULT_PERMISSION = "NO_PERMISSIONS"
"""What a user other than the owner may do (MLflow's ``default_permission``): nothing."""
AUTH_CACHE_TTL_S = 3600
SIGNATURE_KEY = "signature"
SIGNATURE_ALG = "hmac-sha256"
_FIELDS = ("username", "password", "flask_secret_key", "done_key")


# ------------------------------------------------------------------------------ file modes
def make_owner_only(*paths: Path | str) -> None:
    """chmod ``paths`` (recursively for directories) to 700 (directories) and 600 (files).

    Symbolic links are not followed; paths that do not exist are skipped."""
    for top in paths:
        top = Path(top)
        if not top.exists() or top.is_symlink():
            continue
        if not top.is_dir():
            _chmod(top, 0o600)
            continue
        _chmod(top, 0o700)
        for dirpath, dirnames, filenames in os.walk(top):
            for name in dirnames:
                p = Path(dirpath, name)
                if not p.is_symlink():
                    _chmod(p, 0o700)
            for name in filenames:
                p = Path(dirpath, name)
                if not p.is_symlink():
                    _chmod(p, 0o600)


def _chmod(path: Path, mode: int) -> None:
    with contextlib.suppress(FileNotFoundError, PermissionError):
        if stat.S_IMODE(path.lstat().st_mode) != mode:
            os.chmod(path, mode)


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`mistill.io.atomic_open`, whose temporary file
    is created with mode 600), so it is never readable by others, not even for a moment."""
    with atomic_open(path, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)


# ----------------------------------------------------------------------------- credentials
def _read(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if k in _FIELDS and isinstance(v, str) and v} \
        if isinstance(data, dict) else {}


def _inherited() -> dict[str, str]:
    """The credentials this process already uses (from ``$MISTILL_CREDENTIALS``), if any."""
    path = os.environ.get(ENV_CREDENTIALS)
    return _read(Path(path)) if path else {}


def load_credentials(root: Path | str, *, create: bool = False) -> dict[str, str]:
    """The credentials of the store under ``root``: ``username``, ``password``,
    ``flask_secret_key``, ``done_key``.

    ``create``: make the file (mode 600) or complete it where it lacks a field, taking the values
    this process already uses, else new random ones. Without it, a missing file gives ``{}``.
    """
    path = Path(root).absolute() / CREDENTIALS_FILE
    current = _read(path)
    if not create or all(current.get(k) for k in _FIELDS):
        if current:
            make_owner_only(path)
        return current
    inherited = _inherited()
    fresh = {"username": OWNER_USERNAME, "password": secrets.token_urlsafe(32),
             "flask_secret_key": secrets.token_hex(32), "done_key": secrets.token_hex(32)}
    creds = {k: current.get(k) or inherited.get(k) or fresh[k] for k in _FIELDS}
    write_secret(path, json.dumps(creds, indent=2) + "\n")
    return creds


def use_credentials(root: Path | str) -> bool:
    """Point this process's MLflow clients (and the processes it launches) at the credentials
    of the store under ``root``; False if it has none."""
    path = Path(root).absolute() / CREDENTIALS_FILE
    creds = load_credentials(root)
    if not creds.get("username") or not creds.get("password"):
        return False
    os.environ[ENV_USERNAME] = creds["username"]
    os.environ[ENV_PASSWORD] = creds["password"]
    os.environ[ENV_CREDENTIALS] = str(path)
    return True


def basic_auth() -> tuple[str, str] | None:
    """``(user name, password)`` this process's MLflow clients use, for a plain HTTP client
    (``requests.get(..., auth=basic_auth())``); None when there are none."""
    user, password = os.environ.get(ENV_USERNAME), os.environ.get(ENV_PASSWORD)
    return (user, password) if user and password else None


def ensure_client_credentials(tracking_uri: str, root: Path | str) -> None:
    """Before a client talks to ``tracking_uri``: if this process has no MLflow credentials yet,
    take those of the store under ``root`` when its recorded server is ``tracking_uri``."""
    if os.environ.get(ENV_USERNAME) and os.environ.get(ENV_PASSWORD):
        return
    try:
        record = json.loads((Path(root) / "server.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(record, dict) and str(record.get("uri", "")).rstrip("/") == tracking_uri.rstrip("/"):
        use_credentials(root)


def write_auth_config(root: Path, creds: Mapping[str, str]) -> Path:
    """``<root>/auth.ini`` for MLflow's auth app (``MLFLOW_AUTH_CONFIG_PATH``): others get no
    permission, the owner is the admin, users live in ``<root>/auth.db``. The admin's password
    is given to the server in its environment, never written here."""
    db = str((root / AUTH_DB_FILE).absolute()).replace("%", "%%")
    text = ("[mlflow]\n"
            f"default_permission = {DEFAULT_PERMISSION}\n"
            f"database_uri = sqlite:///{db}\n"
            f"admin_username = {creds['username']}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            "grant_default_workspace_access = false\n"
            # a checked password is remembered for this long: the hash check (scrypt) costs up to
            # a second on a busy machine, at every request otherwise; one worker, one user, so
            # nothing can go stale but a password changed by hand
            f"auth_cache_ttl_seconds = {AUTH_CACHE_TTL_S}\n")
    path = root / AUTH_CONFIG_FILE
    write_secret(path, text)
    return path


# -------------------------------------------------------------------------- signed _DONE
def done_key(*, root: Path | str | None = None) -> bytes:
    """The key that signs ``_DONE`` markers: the one of ``$MISTILL_CREDENTIALS``, else of the
    store under ``root`` (default ``$MISTILL_ROOT`` or ``.mistill``), made there if missing."""
    path = os.environ.get(ENV_CREDENTIALS)
    creds = _read(Path(path)) if path else {}
    if not creds.get("done_key"):
        creds = load_credentials(root or os.environ.get("MISTILL_ROOT", ".mistill"), create=True)
    return bytes.fromhex(creds["done_key"])


def _payload(done: Mapping[str, Any], run_id: str, subdir: str, note_id: str) -> bytes:
    body = {k: v for k, v in done.items() if k != SIGNATURE_KEY}
    return json.dumps({"run_id": run_id, "subdir": subdir, "note_id": str(note_id), "done": body},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def sign_done(done: Mapping[str, Any], *, run_id: str, subdir: str, note_id: str,
              key: bytes | None = None) -> dict[str, Any]:
    """``done`` with its signature: HMAC-SHA256 over the record and the run, subdir and note it
    belongs to (a marker copied to another note or run does not verify)."""
    mac = hmac.new(key if key is not None else done_key(), _payload(done, run_id, subdir, note_id),
                   hashlib.sha256).hexdigest()
    body = {k: v for k, v in done.items() if k != SIGNATURE_KEY}
    return {**body, SIGNATURE_KEY: {"alg": SIGNATURE_ALG, "value": mac}}


def verify_done(done: Any, *, run_id: str, subdir: str, note_id: str,
                key: bytes | None = None) -> dict[str, Any]:
    """``done`` if its signature verifies for this run and note, else MistillInputError naming
    the run and the marker file."""
    where = f"{subdir}/{note_id}/_DONE"
    sig = done.get(SIGNATURE_KEY) if isinstance(done, Mapping) else None
    value = sig.get("value") if isinstance(sig, Mapping) and sig.get("alg") == SIGNATURE_ALG else None
    if not isinstance(value, str):
        raise MistillInputError(
            f"run {run_id}: {where} carries no valid signature: the marker was not written by "
            f"this store's owner (or by a version before signed markers); it is refused",
            file="_DONE", note=str(note_id), field=subdir)
    want = sign_done(done, run_id=run_id, subdir=subdir, note_id=note_id, key=key)[SIGNATURE_KEY]["value"]
    if not hmac.compare_digest(want, value):
        raise MistillInputError(
            f"run {run_id}: the signature of {where} does not verify with this store's key: the "
            f"marker was forged, altered, copied from another note, or signed by another store; "
            f"it is refused", file="_DONE", note=str(note_id), field=subdir)
    return dict(done)
