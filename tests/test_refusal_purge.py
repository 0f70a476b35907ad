"""A refused entry point leaves none of its values in the tracking store, and says why in one line.

``mlflow run`` opens a run and stores every ``-P`` value as a param of it before the stage starts.
When the stage refuses its input (a split with no notes, a value too long, an unknown input run, a
value that is not one of the choices) that run is purged, not only deleted: afterwards a canary
value is served by neither ``runs/get`` nor ``runs/search`` (deleted runs included), and is in
no table and no byte of the server's SQLite file and in no artifact. For a restricted corpus whose
notes hold the canary, the privacy guard flags the value first, and the refusal's line names the
param without repeating it.

Each refusal path is run as ``mlflow run`` starts an entry point (``python projects/events.py
...`` with ``MLFLOW_RUN_ID`` naming a run opened beforehand with the values as params): exit
status 2 and one line on stderr. One real ``mlflow run`` shows what that command adds: it cannot
exit 2 (MLflow's CLI exits 1 after any failed entry point), but it ends without a traceback and
the run is purged once it has exited.
"""

from __future__ import annotations

import dataclasses
import re
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from mistill.data.corpus import Corpus
from mistill.data.synthetic import make_synthetic_corpus
from mistill.tracking.purge import is_mlflow_run
from mistill.tracking.server import TrackingServer
from stage_fixtures import TINY, freeze_source, subprocess_env, unique

PLANTED = ("Quartzwhistle insisted that the marmalade lighthouse vanished beneath seven pewter dunes.",
           "Ivy saw six owls eat ten figs.")
"""Sentences planted in the restricted corpus's notes; the canaries below spell them in camelCase."""

SPLIT = "QuartzwhistleInsistedThatTheMarmaladeLighthouseVanished"
"""A safe split name of 55 characters that matches no note."""
LONG = "QuartzwhistleInsistedThatTheMarmaladeLighthouseVanishedBeneathSeven"
"""Longer than any name may be (64 characters)."""
DTYPE = "IvySawSixOwlsEatTenFigs"
"""Not a dtype."""
NEEDLES = ("quartzwhistle", "ivysawsixowls")
"""Parts of the canaries found nowhere else (searched case-insensitively)."""


@dataclasses.dataclass
class Store:
    server: TrackingServer
    uri: str
    src: Path
    prepare_run: str
    experiment_id: str

    @property
    def root(self) -> Path:
        return self.server.root


def restricted_corpus(dst: Path) -> tuple[Path, Path]:
    """Two synthetic-shaped notes with the planted sentences in their text (no teacher trace), as a
    restricted JSONL corpus, and the code file of their inventory."""
    syn = make_synthetic_corpus(n_notes=2, seed=0)
    notes = [dataclasses.replace(n, text=f"{n.text}\n{' '.join(PLANTED)}\n", teacher_trace=None) for n in syn.notes]
    dst.mkdir(parents=True, exist_ok=True)
    path = Corpus(name="planted", privacy="restricted", notes=notes, inventory=syn.inventory).to_jsonl(
        dst / "planted.jsonl")
    codes = dst / "codes.txt"
    codes.write_text("\n".join(syn.inventory.codes) + "\n")
    return Path(path), codes


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """A real MLflow server in a folder of its own (also the mistill root, so its SQLite file and
    artifact folder can be read), a frozen source tree, and a prepared restricted corpus."""
    base = tmp_path_factory.mktemp("refusal-purge")
    server = TrackingServer(root=base / "store", port=0)
    uri = server.start()
    try:
        src = freeze_source(base / "src")
        corpus, codes = restricted_corpus(base / "in")
        name = unique("refusal")
        proc = subprocess.run([sys.executable, "projects/prepare.py", "--corpus", str(corpus), "--privacy",
                               "restricted", "--corpus_name", name, "--codes_file", str(codes), "--model", TINY],
                              cwd=src, env=subprocess_env(uri, server.root), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        prepare_run = re.search(r"mistill prepare: run ([0-9a-f]{32})", proc.stdout).group(1)
        experiment = MlflowClient(uri).get_experiment_by_name(f"mistill/{name}")
        assert not places_holding(server.root, NEEDLES)  # the restricted text never reached the store
        yield Store(server, uri, src, prepare_run, experiment.experiment_id)
    finally:
        server.stop()


# ---------------------------------------------------------------------------- the store, read back
def places_holding(root: Path, needles: tuple[str, ...], *, log: bool = True) -> list[str]:
    """Where the server of ``root`` holds one of ``needles``: a row of any table of its SQLite
    backend, the bytes of the database file (free pages included) or its journal, any file of its
    artifact store, and (``log``) its log."""
    needles = tuple(n.lower() for n in needles)
    found = []
    with sqlite3.connect(f"file:{root / 'mlflow.db'}?mode=ro", uri=True) as db:
        tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            rows = [str(row).lower() for row in db.execute(f'SELECT * FROM "{table}"')]
            found += [f"table {table}" for n in needles if any(n in row for row in rows)]
    files = [*root.glob("mlflow.db*"), *(root / "artifacts").rglob("*"), *([root / "server.log"] if log else [])]
    for p in files:
        if p.is_file():
            data = p.read_bytes().lower()
            found += [str(p.relative_to(root)) for n in needles if n.encode() in data]
    return found


def served(uri: str, run_id: str, needles: tuple[str, ...]) -> list[str]:
    """What the REST API still serves of ``run_id`` or of ``needles``: ``runs/get`` of the run, and
    ``runs/search`` over every experiment (deleted ones and deleted runs included)."""
    from mistill.tracking.auth import basic_auth

    found = []
    auth = basic_auth()  # the server answers its owner only
    got = requests.get(f"{uri}/api/2.0/mlflow/runs/get", params={"run_id": run_id}, auth=auth, timeout=30)
    if got.status_code != 404 or got.json().get("error_code") != "RESOURCE_DOES_NOT_EXIST":
        found.append(f"runs/get: {got.status_code} {got.text[:200]}")
    experiments = requests.post(f"{uri}/api/2.0/mlflow/experiments/search", auth=auth,
                                json={"max_results": 1000, "view_type": "ALL"}, timeout=30).json()["experiments"]
    body = {"experiment_ids": [e["experiment_id"] for e in experiments], "run_view_type": "ALL", "max_results": 1000}
    runs = requests.post(f"{uri}/api/2.0/mlflow/runs/search", json=body, auth=auth, timeout=30)
    runs.raise_for_status()
    text = runs.text.lower()
    found += [f"runs/search holds {n!r}" for n in (run_id, *needles) if n.lower() in text]
    return found


def assert_left_nothing(store: Store, run_id: str, needles: tuple[str, ...], ids: tuple[str, ...] = ()) -> None:
    """Neither the REST API nor the server's files hold the run or ``needles``; run ids (``run_id``
    and ``ids``) are looked for in the database and artifacts only: the server's log records the
    requests that named them (a GET of ``runs/get``), never a param value."""
    assert served(store.uri, run_id, (*needles, *ids)) == []
    assert places_holding(store.root, needles) == []
    assert places_holding(store.root, (run_id, *ids), log=False) == []


# ------------------------------------------------------------------------------- direct launches
def launched_run(store: Store, params: dict[str, str]) -> str:
    """A run as ``mlflow run -e events`` leaves it for the entry point, its values as params; here
    also in a tag, a metric name and an artifact (what a later gap could let through)."""
    client = MlflowClient(store.uri)
    run_id = client.create_run(store.experiment_id, tags={"mlflow.source.type": "PROJECT",
                                                          "mlflow.project.entryPoint": "events"}).info.run_id
    values = " ".join(params.values())
    client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()],
                     tags=[RunTag("launched.values", values[:5000])],
                     metrics=[Metric(f"seen_{params.get('split') or params.get('dtype')}", 1.0, 0, 0)])
    client.log_text(run_id, values, "launched.txt")
    return run_id


def launch_events(store: Store, params: dict[str, str]) -> tuple[str, subprocess.CompletedProcess]:
    """``python projects/events.py --k v ...`` as ``mlflow run`` starts it: ``MLFLOW_RUN_ID`` names
    a run that holds the values."""
    run_id = launched_run(store, params)
    assert any(p.startswith("table params") for p in places_holding(store.root, (run_id,)))
    env = subprocess_env(store.uri, store.root)
    env.update({"MLFLOW_RUN_ID": run_id, "MLFLOW_EXPERIMENT_ID": store.experiment_id})
    args = [a for k, v in params.items() for a in (f"--{k}", v)]
    proc = subprocess.run([sys.executable, "projects/events.py", *args], cwd=store.src, env=env,
                          capture_output=True, text=True, timeout=300)
    return run_id, proc


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The refusal: exit status 2 and exactly one line on stderr, the stage's."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert lines[0].startswith("mistill events: ")
    return lines[0]


GUARDED = {
    "a split with no notes": {"split": SPLIT},
    "a value too long": {"split": LONG},
    "a value that is not a choice": {"dtype": DTYPE},
}


@pytest.mark.parametrize("params", list(GUARDED.values()), ids=list(GUARDED))
def test_a_refused_value_of_a_restricted_corpus_is_purged_and_not_repeated(store, params):
    """The guard of the restricted corpus flags the canary first: the line names the param, never
    the value, and the launched run is purged."""
    run_id, proc = launch_events(store, {"prepare_run": store.prepare_run, **params})
    line = one_line(proc)
    field = next(iter(params))
    assert f"param {field} holds protected note text" in line, line
    assert f"run {run_id} that `mlflow run` opened held these values: deleted and purged" in line, line
    assert not any(n in (proc.stdout + proc.stderr).lower() for n in NEEDLES)
    assert_left_nothing(store, run_id, NEEDLES)


def test_values_refused_with_an_unknown_input_run_are_purged(store):
    """No corpus is known, so no guard: the pre-flight message (which names the unknown run id)
    is shown, and the run holding both values is purged."""
    unknown = uuid.uuid4().hex
    run_id, proc = launch_events(store, {"prepare_run": unknown, "split": SPLIT})
    line = one_line(proc)
    assert f"no run {unknown} on the tracking server" in line and "(field 'prepare_run')" in line, line
    assert f"run {run_id} that `mlflow run` opened held these values: deleted and purged" in line, line
    assert_left_nothing(store, run_id, NEEDLES, ids=(unknown,))


# ------------------------------------------------------------------------------- `mlflow run`
def test_mlflow_run_of_a_refused_split_ends_without_a_traceback_and_purges(store):
    """The one real ``mlflow run``: MLflow's CLI exits 1 after any failed entry point and prints
    its own ``Run (ID ...) failed`` line; no traceback, one line of the stage's, and once the
    command has exited (the purger holds its stderr until done) the run and the canary are gone."""
    name = MlflowClient(store.uri).get_experiment(store.experiment_id).name
    args = [str(Path(sys.executable).parent / "mlflow"), "run", ".", "-e", "events", "--env-manager", "local",
            "--experiment-name", name, "-P", f"prepare_run={store.prepare_run}", "-P", f"split={SPLIT}"]
    proc = subprocess.run(args, cwd=store.src, env=subprocess_env(store.uri, store.root), capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "RESOURCE_DOES_NOT_EXIST" not in out, out[-3000:]
    run_id = re.search(r"in run with ID '([0-9a-f]{32})'", out).group(1)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("mistill events:")]
    assert len(ours) == 1 and "param split holds protected note text" in ours[0], out[-3000:]
    assert "deleted and purged from the tracking store once `mlflow run` has exited" in ours[0]
    assert re.search(rf"ERROR mlflow.cli: === Run \(ID '{run_id}'\) failed ===$", proc.stderr.rstrip())
    deadline = time.monotonic() + 60  # already done: the purger held the stderr pipe until then
    while served(store.uri, run_id, ()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert_left_nothing(store, run_id, NEEDLES)


# ---------------------------------------------------------------------------- the launcher test
@pytest.mark.parametrize(("cmdline", "expected"), [
    (["/venv/bin/python", "/venv/bin/mlflow", "run", ".", "-e", "events"], True),
    (["/venv/bin/mlflow", "run", "."], True),
    (["python3", "-m", "mlflow", "run", "."], True),
    (["/venv/bin/mlflow", "server", "--port", "5000"], False),
    (["python", "projects/pipeline.py", "--launch", "mlflow"], False),
    (["python", "-m", "pytest", "tests/test_refusal_purge.py"], False),
    ([], False),
])
def test_the_mlflow_run_command_is_recognised(cmdline, expected):
    assert is_mlflow_run(cmdline) is expected
