"""PostgreSQL as the shared store (``MISTILL_DATABASE_URL``): a real PostgreSQL server started on
a free local port (Debian's ``postgresql`` package, which ``scripts/test.sh`` installs), the
project's MLflow server on it, stages that write, resume and reuse their runs there, and two
``select_lambda`` workers on one Optuna study in the same PostgreSQL server."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from mistill.tracking.postgres import (ENV_DATABASE_URL, LocalPostgres, database_url, masked, selection_storage_url,
                                       tracking_store_uri)
from mistill.tracking.server import TrackingServer
from stage_fixtures import TINY, unique

pytestmark = pytest.mark.usefixtures("pinned_code_version")


@pytest.fixture(scope="module")
def postgres() -> Iterator[LocalPostgres]:
    # under /tmp, not pytest's tmp dirs: those are private to this user, and under root the
    # server runs as the `postgres` user
    folder = Path(tempfile.mkdtemp(prefix="mistill-pg-"))
    server = LocalPostgres(folder).start(databases=("mistill",))
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def pg_tracking(postgres: LocalPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The project's MLflow server with its runs in PostgreSQL; ``MLFLOW_TRACKING_URI`` points at
    it for this module and is restored after."""
    server = TrackingServer(root=tmp_path_factory.mktemp("pg-mlflow"), port=0, database_url=postgres.url("mistill"))
    saved = os.environ.get("MLFLOW_TRACKING_URI")
    uri = server.start()
    os.environ["MLFLOW_TRACKING_URI"] = uri
    mlflow.set_tracking_uri(uri)
    try:
        yield uri
    finally:
        server.stop()
        if saved is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved
            mlflow.set_tracking_uri(saved)


def test_database_url_setting(monkeypatch):
    monkeypatch.setenv(ENV_DATABASE_URL, "postgresql://ml@db.example:5432/mistill")
    url = database_url()
    assert tracking_store_uri(url) == "postgresql+psycopg://ml@db.example:5432/mistill"
    assert selection_storage_url(url) == "postgresql+psycopg://ml@db.example:5432/mistill_selection"
    assert TrackingServer(root="unused").backend_uri == "postgresql+psycopg://ml@db.example:5432/mistill"
    assert masked("postgresql://ml:s3cret@db:5432/x") == "postgresql://ml:***@db:5432/x"
    monkeypatch.setenv(ENV_DATABASE_URL, "mysql://db/x")
    with pytest.raises(Exception, match="postgresql://user@host:port/name"):
        database_url()
    monkeypatch.delenv(ENV_DATABASE_URL)
    assert TrackingServer(root="/r").backend_uri == "sqlite:////r/mlflow.db"


def test_stages_write_resume_and_reuse_runs_in_postgresql(postgres, pg_tracking, tmp_path, monkeypatch):
    import psycopg

    from mistill.stages.characterize import EventsConfig, run_events
    from mistill.stages.prepare import PrepareConfig, run_prepare

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    name = unique("pg")
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=3, model=TINY))
    cfg = EventsConfig(prepare_run=prep, model=TINY, n_null=4)
    events = run_events(cfg)
    assert run_events(cfg) == events  # reused: an identical finished run in the PostgreSQL store
    client = MlflowClient()
    run = client.get_run(events)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.input.prepare"] == prep
    notes = {f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(events, "notes")}
    assert len(notes) == 3
    with psycopg.connect(postgres.url("mistill")) as conn:
        stored = {r[0]: r[1] for r in conn.execute("SELECT run_uuid, status FROM runs WHERE run_uuid IN (%s, %s)",
                                                   (prep, events)).fetchall()}
    assert stored == {prep: "FINISHED", events: "FINISHED"}


def test_two_selection_workers_share_one_study_in_postgresql(postgres, pg_tracking, tmp_path, monkeypatch,
                                                             pinned_code_version):
    from test_selection_crash import PICK, TABLE, lines, start_worker, write_lock

    monkeypatch.setenv(ENV_DATABASE_URL, postgres.url("mistill"))
    write_lock(tmp_path / "lock.yaml")
    corpus = unique("pg-selection")
    workers = [start_worker(tmp_path, "a", "barrier", corpus, pinned_code_version, pg_tracking, hold_s=1.0),
               start_worker(tmp_path, "b", "barrier", corpus, pinned_code_version, pg_tracking, workers=2, hold_s=3.0)]
    outs = [w.communicate(timeout=240) for w in workers]
    for w, (_, err) in zip(workers, outs):
        assert w.returncode == 0, err[-3000:]
    done = lines(tmp_path / "done.log")
    assert sorted(k for _, k, _ in done) == sorted(f"lambda={v!r}" for v in TABLE)  # each cell exactly once
    assert {w for w, _, _ in done} == {"a", "b"}
    assert [re.findall(r"-> (lambda=[0-9.e+-]+)", out) for out, _ in outs] == [[PICK], [PICK]]
    import optuna

    from mistill.stages.select_lambda import SelectLambdaConfig, study_name
    from selection.lock import load_lock

    storage = selection_storage_url(postgres.url("mistill"))
    cfg = SelectLambdaConfig(lock=str(tmp_path / "lock.yaml"), corpus_name=corpus)
    name = study_name(cfg, load_lock(cfg.lock).study, corpus)
    trials = optuna.load_study(study_name=name, storage=storage).get_trials()
    assert len(trials) == 3 and all(t.state.name == "COMPLETE" for t in trials)
    assert not (tmp_path / "root" / "optuna" / "selection.db").exists()  # nothing went to SQLite
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name(f"mistill/{corpus}").experiment_id],
                              "tags.`mistill.stage` = 'select_lambda'")
    assert len(runs) == 2 and {r.data.tags["mistill.selection.storage"] for r in runs} == {storage}


def test_claims_on_a_postgresql_study_hold_an_advisory_lock_of_the_server(postgres, tmp_path):
    """Workers on other machines see the claim lock: it is the server's, not a local file."""
    import psycopg

    from selection.grid import advisory_key, claim_lock

    storage = selection_storage_url(postgres.url("mistill"))
    key = advisory_key("study-a")

    def free() -> bool:  # another session (as another machine's worker would be) tries the lock
        with psycopg.connect(postgres.url("mistill_selection"), autocommit=True) as other:
            got = other.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]
            if got:
                other.execute("SELECT pg_advisory_unlock(%s)", (key,))
            return got

    from mistill.tracking.postgres import ensure_database

    ensure_database(storage)
    assert free()
    with claim_lock(storage, "study-a", tmp_path / "unused.lock"):
        assert not free()
    assert free()
    assert not (tmp_path / "unused.lock").exists()
