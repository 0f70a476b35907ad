"""Protected text that reached the tracking store is purged from it, and patient ids are hashed.

``mlflow run`` stores every ``-P`` value as a param of the run it opens before the stage starts;
when such a value is text (refused by the config as text, or found by the privacy guard), the
run is deleted and purged (``mlflow gc``): the canary is then in no table and no free page of the
server's SQLite file, in no artifact and not in the server log. A server of its own (started in
``tmp_path`` by :class:`TrackingServer`) lets the tests open its SQLite file and artifact folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mistill.data.corpus import Corpus
from mistill.data.synthetic import make_synthetic_corpus
from mistill.stages.common import PATIENT_KEY_CHARS, SALT_BYTES, corpus_index, local_salt, privacy_guard
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.tracking.privacy import PrivacyError
from mistill.tracking.purge import ENV_BACKEND_STORE_URI, RunNotPurgedError, purge_run
from mistill.tracking.runs import StageRun
from mistill.tracking.server import TrackingServer
from stage_fixtures import TINY, freeze_source, subprocess_env, unique

CANARY = "the quiet marmalade heron counted eleven copper lanterns beside the frozen orchard at dusk"
NEEDLE = "marmalade"
"""A word of the canary found nowhere else (searched case-insensitively, in any encoding MLflow
writes text: SQLite stores UTF-8, artifacts are the files as uploaded)."""


@dataclasses.dataclass
class Store:
    server: TrackingServer
    uri: str

    @property
    def root(self) -> Path:
        return self.server.root


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """A real MLflow server (SQLite backend, proxied artifacts) in a folder of its own."""
    server = TrackingServer(root=tmp_path_factory.mktemp("purge-store"), port=0)
    uri = server.start()
    try:
        yield Store(server, uri)
    finally:
        server.stop()


@pytest.fixture
def on_store(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """This process's MLflow clients on ``store`` (and its root as the mistill root) for one test.

    Afterwards the clients follow ``MLFLOW_TRACKING_URI`` again (the session's server, restored
    by ``monkeypatch``): the stages set MLflow's global URI, which outranks the variable."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.uri)
    monkeypatch.setenv("MISTILL_ROOT", str(store.root))
    monkeypatch.delenv(ENV_BACKEND_STORE_URI, raising=False)
    mlflow.set_tracking_uri(store.uri)
    try:
        yield store
    finally:
        mlflow.set_tracking_uri(None)


def places_holding(root: Path, needle: str = NEEDLE) -> list[str]:
    """Where the server of ``root`` holds ``needle``: a row of any table of its SQLite backend,
    the bytes of the database file (free pages included) or of its journal, any file of its
    artifact store, its log."""
    found = []
    with sqlite3.connect(f"file:{root / 'mlflow.db'}?mode=ro", uri=True) as db:
        tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            if any(needle in str(row).lower() for row in db.execute(f'SELECT * FROM "{table}"')):
                found.append(f"table {table}")
    files = [*root.glob("mlflow.db*"), root / "server.log", *(root / "artifacts").rglob("*")]
    found += [str(p.relative_to(root)) for p in files if p.is_file() and needle.encode() in p.read_bytes().lower()]
    return found


def restricted_corpus(dst: Path, file_name: str = "planted.jsonl") -> tuple[Path, Path]:
    """Two synthetic-shaped notes with the canary in their text, as a restricted JSONL corpus,
    and the code file of their inventory."""
    syn = make_synthetic_corpus(n_notes=2, seed=0)
    notes = [dataclasses.replace(n, text=f"{n.text}\n{CANARY.capitalize()}.\n", teacher_trace=None)
             for n in syn.notes]
    dst.mkdir(parents=True, exist_ok=True)
    path = Corpus(name="planted", privacy="restricted", notes=notes,
                  inventory=syn.inventory).to_jsonl(dst / file_name)
    codes = dst / "codes.txt"
    codes.write_text("\n".join(syn.inventory.codes) + "\n")
    return Path(path), codes


def mlflow_run(store: Store, src: Path, experiment: str, params: dict[str, str]) -> subprocess.CompletedProcess:
    """``mlflow run . -e prepare`` from the frozen source tree ``src`` against ``store``, the
    store's folder as the mistill root."""
    args = [str(Path(sys.executable).parent / "mlflow"), "run", ".", "-e", "prepare", "--env-manager", "local",
            "--experiment-name", experiment]
    for key, value in params.items():
        args += ["-P", f"{key}={value}"]
    return subprocess.run(args, cwd=src, env=subprocess_env(store.uri, store.root), capture_output=True,
                          text=True, timeout=300)


def launched_run_id(out: str) -> str:
    found = re.search(r"in run with ID '([0-9a-f]{32})'", out)
    assert found, out[-3000:]
    return found.group(1)


def assert_gone(client: MlflowClient, run_id: str) -> None:
    with pytest.raises(MlflowException) as err:
        client.get_run(run_id)
    assert err.value.error_code == "RESOURCE_DOES_NOT_EXIST"


# ----------------------------------------------------------------------- through `mlflow run`
def test_a_sentence_passed_with_mlflow_run_is_purged(store, tmp_path):
    """The sentence is refused by the config (it cannot be a split name): the run `mlflow run`
    opened, which stored it as a param, leaves no trace in the store."""
    corpus, codes = restricted_corpus(tmp_path / "in")
    name = unique("purge-text")
    proc = mlflow_run(store, freeze_source(tmp_path / "src"), f"mistill/{name}",
                      {"corpus": str(corpus), "privacy": "restricted", "corpus_name": name, "codes_file": str(codes),
                       "model": TINY, "select_n": "1", "select_split": CANARY})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    ours = [line for line in out.splitlines() if line.startswith("mistill prepare:")]
    assert any("field 'select_split'" in line for line in ours), out[-3000:]
    assert any("deleted and purged" in line for line in ours), out[-3000:]
    assert not any(NEEDLE in line for line in ours)  # the refusal never repeats the text
    assert_gone(MlflowClient(store.uri), launched_run_id(out))
    assert places_holding(store.root) == []


def test_protected_text_in_a_path_given_to_mlflow_run_is_purged(store, tmp_path):
    """A path whose file name spells six words of a note passes the config (the file exists):
    the privacy guard finds the text in the launched run's params when the stage starts, and the
    run is purged before the stage fails."""
    corpus, codes = restricted_corpus(tmp_path / "in", "the-quiet-marmalade-heron-counted-eleven.jsonl")
    name = unique("purge-guard")
    proc = mlflow_run(store, freeze_source(tmp_path / "src"), f"mistill/{name}",
                      {"corpus": str(corpus), "privacy": "restricted", "corpus_name": name, "codes_file": str(codes),
                       "model": TINY})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    ours = [line for line in out.splitlines() if line.startswith("mistill prepare:")]
    assert any("refusing to log param corpus" in line and "deleted and purged" in line for line in ours), out[-3000:]
    assert_gone(MlflowClient(store.uri), launched_run_id(out))
    assert places_holding(store.root) == []


# ------------------------------------------------------------------- the purge, step by step
def _launched(client: MlflowClient, experiment: str) -> str:
    """A run as `mlflow run` leaves it for the stage: the canary in a param and in its name, and
    here also in an artifact (what a future gap could have let through)."""
    exp = client.get_experiment_by_name(experiment) or client.get_experiment(client.create_experiment(experiment))
    run = client.create_run(exp.experiment_id, run_name=f"launched {CANARY}")
    client.log_batch(run.info.run_id, params=[Param("split", CANARY), Param("n_notes", "2")])
    client.log_text(run.info.run_id, CANARY, "note.txt")
    return run.info.run_id


def _stage_run(corpus_file: Path, name: str, root: Path, uri: str) -> StageRun:
    corpus = Corpus.from_jsonl(corpus_file, name=name, privacy="restricted")
    cfg = PrepareConfig(corpus=str(corpus_file), corpus_name=name, model=TINY)
    return StageRun("prepare", cfg, corpus=name, guard=privacy_guard(corpus), root=root, tracking_uri=uri,
                    code_version="purge-test")


def test_a_stage_purges_the_launched_run_holding_protected_text(on_store, tmp_path, monkeypatch):
    client = MlflowClient(on_store.uri)
    corpus, _ = restricted_corpus(tmp_path / "in")
    name = unique("purge-stage")
    # control: a launched run without protected text is adopted, as before
    clean = client.create_run(client.create_experiment(f"mistill/{name}")).info.run_id
    client.log_batch(clean, params=[Param("n_notes", "8")])
    monkeypatch.setenv("MLFLOW_RUN_ID", clean)
    with _stage_run(corpus, name, on_store.root, on_store.uri) as run:
        assert run.run_id == clean
    assert client.get_run(clean).data.tags["mistill.stage"] == "prepare"

    run_id = _launched(client, f"mistill/{name}")
    held = places_holding(on_store.root)
    assert any(p.startswith("table params") for p in held) and any(p.startswith("artifacts/") for p in held), held
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    with pytest.raises(PrivacyError) as err:
        with _stage_run(corpus, name, on_store.root, on_store.uri):
            pytest.fail("the stage adopted a run holding protected text")
    assert not isinstance(err.value, RunNotPurgedError)
    assert "deleted and purged" in str(err.value) and NEEDLE not in str(err.value)
    assert_gone(client, run_id)
    assert places_holding(on_store.root) == []


def test_without_a_known_backend_the_run_is_deleted_and_the_operator_told(on_store, tmp_path, monkeypatch):
    """A server mistill did not start (here: the mistill root is another folder): the run is
    deleted, the error gives the `mlflow gc` command; with MISTILL_BACKEND_STORE_URI the purge
    itself runs."""
    client = MlflowClient(on_store.uri)
    corpus, _ = restricted_corpus(tmp_path / "in")
    name = unique("purge-unknown")
    elsewhere = tmp_path / "another-root"
    run_id = _launched(client, f"mistill/{name}")
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    with pytest.raises(RunNotPurgedError) as err:
        with _stage_run(corpus, name, elsewhere, on_store.uri):
            pytest.fail("the stage adopted a run holding protected text")
    message = str(err.value)
    assert f"mlflow gc --backend-store-uri '<backend store URI>' --run-ids {run_id}" in message, message
    assert ENV_BACKEND_STORE_URI in message and "param split" in message and NEEDLE not in message
    assert client.get_run(run_id).info.lifecycle_stage == "deleted"
    assert any(p.startswith("table params") for p in places_holding(on_store.root))  # deleted, not purged

    monkeypatch.setenv(ENV_BACKEND_STORE_URI, on_store.server.backend_uri)
    purge_run(run_id, tracking_uri=on_store.uri, root=elsewhere)
    assert_gone(client, run_id)
    assert places_holding(on_store.root) == []


# ------------------------------------------------------------------------------- patient ids
def _ids(df) -> list[str]:
    return df["patient_id"].tolist()


def test_restricted_patient_ids_are_hashed_with_the_local_salt(tmp_path):
    corpus, _ = restricted_corpus(tmp_path / "in")
    notes = Corpus.from_jsonl(corpus, name="planted", privacy="restricted")
    real = [n.patient_id for n in notes.notes]
    root = tmp_path / "root"
    hashed = _ids(corpus_index(notes, root=root))
    salt = (root / "salt").read_bytes()
    assert len(salt) == SALT_BYTES and (root / "salt").stat().st_mode & 0o077 == 0
    assert hashed == [hmac.new(salt, p.encode(), hashlib.sha256).hexdigest()[:PATIENT_KEY_CHARS] for p in real]
    assert all(re.fullmatch(r"[0-9a-f]{16}", h) for h in hashed) and not set(hashed) & set(real)
    assert _ids(corpus_index(notes, "hashed", root=root)) == hashed  # stable: the salt is made once
    assert local_salt(root) == salt
    other = _ids(corpus_index(notes, root=tmp_path / "other-root"))
    assert not set(other) & set(hashed)  # another salt, other ids
    assert _ids(corpus_index(notes, "clear", root=root)) == real  # when asked
    synthetic = make_synthetic_corpus(n_notes=2, seed=0)
    assert _ids(corpus_index(synthetic, root=root)) == [n.patient_id for n in synthetic.notes]


def test_prepare_logs_hashed_ids_for_restricted_corpora(tracking_uri, tmp_path, monkeypatch):
    """The logged index shows hashed ids, the param records the choice, the local corpus keeps
    the real ids, and ``patient_ids=clear`` shows them."""
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    corpus, codes = restricted_corpus(tmp_path / "in")
    real = [n.patient_id for n in Corpus.from_jsonl(corpus, privacy="restricted").notes]
    client = MlflowClient()
    shown = {}
    for mode in ("auto", "clear"):
        run_id = run_prepare(PrepareConfig(corpus=str(corpus), corpus_name=unique(f"ids-{mode}"), privacy="restricted",
                                           codes_file=str(codes), model=TINY, patient_ids=mode))
        run = client.get_run(run_id)
        assert run.data.params["patient_ids"] == mode
        index = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="corpus_index.csv",
                                                    dst_path=str(tmp_path / mode))
        shown[mode] = [line.split(",")[1] for line in Path(index).read_text().splitlines()[1:]]
        local = Path(run.data.tags["mistill.data_dir"]) / "corpus.jsonl"
        assert [n.patient_id for n in Corpus.from_jsonl(local, privacy="restricted").notes] == real
    assert shown["clear"] == real
    assert not set(shown["auto"]) & set(real) and all(len(h) == PATIENT_KEY_CHARS for h in shown["auto"])
