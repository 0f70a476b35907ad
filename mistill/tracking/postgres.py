"""PostgreSQL as the shared store of a cluster: MLflow's tracking store and Optuna's study storage
on one PostgreSQL server, chosen by one setting.

``MISTILL_DATABASE_URL=postgresql://<user>@<host>:<port>/<name>`` (unset: SQLite under the mistill
root, the embedded default). With it set:

* the project's tracking server (:class:`~mistill.tracking.server.TrackingServer`) keeps its runs
  in database ``<name>`` (:func:`tracking_store_uri`);
* ``select_lambda``'s default study storage is database ``<name>_selection`` of the same server
  (:func:`selection_storage_url`): MLflow and Optuna both keep an ``alembic_version`` table, so
  they cannot share one database.

Both databases are created on first use when the user may create databases. The driver is
psycopg 3 (``postgresql+psycopg://`` for SQLAlchemy). Give the password through ``PGPASSWORD`` or
``~/.pgpass`` rather than in the URL: the URL is shown in run tags (a password in it is masked
there, :func:`masked`).

:class:`LocalPostgres` starts a throwaway PostgreSQL server in a folder, on 127.0.0.1 and a free
port, from the machine's PostgreSQL binaries (Debian's ``postgresql`` package): the tests run
against it, and it is a way to try the PostgreSQL store on one machine. PostgreSQL refuses to run
as root, so under root the server runs as the ``postgres`` user.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from mistill.errors import MistillInputError
from mistill.tracking.connection import free_port

ENV_DATABASE_URL = "MISTILL_DATABASE_URL"
SELECTION_SUFFIX = "_selection"
_SCHEMES = ("postgresql", "postgresql+psycopg", "postgres")


def database_url() -> str | None:
    """The PostgreSQL server URL of ``$MISTILL_DATABASE_URL`` (None when unset), checked."""
    url = os.environ.get(ENV_DATABASE_URL, "").strip()
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES or not parts.hostname or not parts.path.strip("/"):
        raise MistillInputError(f"{ENV_DATABASE_URL} must look like postgresql://user@host:port/name, got "
                                f"{masked(url)!r}", field=ENV_DATABASE_URL)
    return url


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme="postgresql+psycopg", path=f"/{name}"))


def _database_name(url: str) -> str:
    return urlsplit(url).path.strip("/")


def tracking_store_uri(url: str) -> str:
    """MLflow's backend store URI for the server of ``url``: its database, the psycopg driver."""
    return _with_database(url, _database_name(url))


def selection_storage_url(url: str) -> str:
    """Optuna's storage URL on the server of ``url``: database ``<name>_selection``."""
    return _with_database(url, _database_name(url) + SELECTION_SUFFIX)


def is_postgres(url: str) -> bool:
    """True for a PostgreSQL URL (any of the schemes this module reads or writes)."""
    return url.split("://", 1)[0] in _SCHEMES


def libpq_url(url: str) -> str:
    """``url`` with the plain ``postgresql`` scheme that psycopg's connect takes (SQLAlchemy's
    ``postgresql+psycopg`` dropped)."""
    return urlunsplit(urlsplit(url)._replace(scheme="postgresql"))


def masked(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def ensure_database(url: str) -> None:
    """Create the database ``url`` names on its server unless it exists (connecting to the
    server's ``postgres`` database to do so)."""
    import psycopg  # deferred: psycopg is optional (PostgreSQL only)

    name = _database_name(url)
    admin = libpq_url(urlunsplit(urlsplit(url)._replace(path="/postgres")))
    with psycopg.connect(admin, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            from psycopg import errors, sql  # deferred: psycopg is optional (PostgreSQL only)

            try:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            except (errors.DuplicateDatabase, errors.UniqueViolation):
                pass  # another process created it at the same moment


# ------------------------------------------------------------------------- a local server
def postgres_bin(name: str) -> str:
    """Path of a PostgreSQL server program (``initdb``, ``pg_ctl``): on ``PATH``, else the newest
    ``/usr/lib/postgresql/<version>/bin``. Raises FileNotFoundError naming the package."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if candidates:
        return candidates[-1]
    raise FileNotFoundError(f"PostgreSQL's {name} is not installed (Debian: apt-get install postgresql)")


class LocalPostgres:
    """A PostgreSQL server of its own in ``folder`` (data, socket, log), on ``127.0.0.1:port``
    (0: a free port), with trust authentication for local connections; user ``postgres``.

    Use as a context manager or call :meth:`start` / :meth:`stop`; :meth:`url` names a database
    on it (created by :meth:`start` when given ``databases``).
    """

    def __init__(self, folder: Path | str, port: int = 0) -> None:
        self.folder = Path(folder).resolve()
        self.port = port
        self._as_postgres = os.geteuid() == 0

    @property
    def data_dir(self) -> Path:
        return self.folder / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, args: list[str], **kw) -> subprocess.CompletedProcess:
        if self._as_postgres:
            args = ["runuser", "-u", "postgres", "--", *args]
        return subprocess.run(args, check=True, capture_output=True, text=True, **kw)

    def start(self, databases: tuple[str, ...] = (), timeout: float = 60) -> LocalPostgres:
        self.folder.mkdir(parents=True, exist_ok=True)
        if self._as_postgres:
            shutil.chown(self.folder, "postgres", "postgres")
        if not (self.data_dir / "PG_VERSION").exists():
            self._run([postgres_bin("initdb"), "-D", str(self.data_dir), "-U", "postgres", "--auth=trust",
                       "--encoding=UTF8", "--no-sync"])
        self.port = self.port or free_port()
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run([postgres_bin("pg_ctl"), "-D", str(self.data_dir), "-l", str(self.folder / "server.log"),
                   "-o", options, "-w", "-t", str(int(timeout)), "start"])
        deadline = time.monotonic() + timeout
        while True:
            try:
                for name in databases:
                    ensure_database(self.url(name))
                break
            except Exception:  # noqa: BLE001 - the server may still be starting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        return self

    def stop(self) -> None:
        if (self.data_dir / "postmaster.pid").exists():
            self._run([postgres_bin("pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "stop"])

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["ENV_DATABASE_URL", "database_url", "tracking_store_uri", "selection_storage_url", "is_postgres",
           "libpq_url", "masked", "ensure_database", "postgres_bin", "LocalPostgres"]
