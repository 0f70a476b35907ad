"""Restricted text never reaches the tracking store, end to end.

Every entry point the pipeline runs (prepare, events, attribute, knockin, targets, select_lambda
with its train/evaluate cells, train, las_simulator, evaluate, own_heads, report), plus generate
and shortlist (whose head trains on another corpus for non-synthetic notes), runs on a restricted corpus with a canary planted in its notes and traces, against
a tracking server of the test's own, so that everything the store keeps can be read directly:
every table of its SQLite database, every file of its artifact store (the strings of numeric
files, and every integer array decoded as token ids of the model's tokenizer), and its log. None
holds the canary in any of the privacy guard's normal forms. A control shows the same scan finds
the canary when the corpus is public.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from mistill.models.loading import load_tokenizer
from mistill.stages.generate import GenerateConfig, run_generate
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.stages.shortlist import ShortlistConfig, run_shortlist
from mistill.stages.workflow import PipelineConfig, pipeline_steps
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.server import TrackingServer
from stage_fixtures import CANARY_ID, CANARY_SENTENCE, REPO, SMALL, TINY, planted_corpus, unique

SPLITS = ("train", "train", "val", "val", "test", "test")
# the logged models (each train run's student, the LAS simulator) are read byte by byte: a narrow
# residual stream keeps their embedding matrices, most of the bytes the scan reads, small
SMALL_STUDENT = "tiny:qwen3:seed=2:d_model=8"
SMALL_LAS = "tiny:qwen3:d_model=8"


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tracking server whose database, artifact store and log this module reads directly."""
    root = tmp_path_factory.mktemp("canary-store")
    server = TrackingServer(root=root, port=0)
    uri = server.start()
    import mlflow

    previous = mlflow.get_tracking_uri()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mlflow.set_tracking_uri(uri)
        try:
            yield root
        finally:
            mlflow.set_tracking_uri(previous)
            server.stop()


def _decoded_int_arrays(path: Path, tokenizer) -> Iterator[str]:
    """Every integer array of a numeric file read as token ids (2-D arrays column by column)."""
    loaded = np.load(path, allow_pickle=False)
    arrays = [loaded] if isinstance(loaded, np.ndarray) else [loaded[k] for k in loaded.files]
    vocab = len(tokenizer)
    for a in arrays:
        if a.dtype.kind not in "iu" or a.size < 6 or a.min() < 0 or a.max() >= vocab:
            continue
        columns = [a.ravel()] if a.ndim < 2 else [a.reshape(-1, a.shape[-1])[:, j] for j in range(min(a.shape[-1], 4))]
        for col in columns:
            yield tokenizer.decode(col.tolist())


def _stored_blobs(root: Path, tokenizer) -> Iterator[tuple[str, str]]:
    """(where, text) for everything the server keeps: every table row, every artifact file, the log."""
    with sqlite3.connect(root / "mlflow.db") as db:
        yield "database", "\n".join(db.iterdump())
    for path in sorted((root / "artifacts").rglob("*")):
        if not path.is_file():
            continue
        where = f"artifact {path.relative_to(root / 'artifacts')}"
        raw = path.read_bytes()
        yield where, raw.decode("utf-8", errors="replace")
        if path.suffix in (".npz", ".npy"):
            for i, text in enumerate(_decoded_int_arrays(path, tokenizer)):
                yield f"{where} (int array {i} as token ids)", text
    yield "server log", (root / "server.log").read_text(errors="replace")


def _canary_guard() -> PrivacyGuard:
    trace_words = f"the chart reference {CANARY_ID} is noted first, and the note says {CANARY_SENTENCE}"
    return PrivacyGuard([CANARY_SENTENCE, trace_words], "restricted")


def _memoized(check: Callable[[str], bool]) -> Callable[[str], bool]:
    """``check`` answered once per distinct text (by its sha256): the store holds many identical
    files (every logged model's tokenizer), and the control scans again everything the first scan
    read. ``check`` is a pure function of the text, so every text still gets its own answer."""
    seen: dict[bytes, bool] = {}

    def cached(text: str) -> bool:
        key = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).digest()
        if key not in seen:
            seen[key] = check(text)
        return seen[key]

    return cached


def test_every_entry_point_keeps_restricted_text_out_of_the_store(own_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    corpus_file, codes_file = planted_corpus(tmp_path, SPLITS)
    lock = tmp_path / "lock.yaml"
    lock.write_text((REPO / "projects/configs/locks/embedded-3cell.yaml").read_text()
                    .replace("study: embedded-3cell", f"study: {unique('study')}")
                    .replace("max_steps: 2", "max_steps: 1").replace("max_new_tokens: 32", "max_new_tokens: 8")
                    # two grid cells: the pick is always on an edge, so the outward cell runs too
                    .replace("lambda: [0.03, 0.1, 0.3]", "lambda: [0.03, 0.1]"))
    name = unique("planted")
    small = {k: v for k, v in SMALL.items() if k not in ("train_arms", "shortlist", "report")}
    cfg = PipelineConfig(corpus=str(corpus_file), corpus_name=name, privacy="restricted",
                         codes_file=str(codes_file), train_arms=("vanilla-bf16", "mistill"),
                         student=SMALL_STUDENT, train_max_steps=1, train_grad_accum=1,
                         select_lock=str(lock), las_model=SMALL_LAS, las_max_steps=2, eval_max_new_tokens=8,
                         shortlist=False, own_heads=True, report=True, **small)
    ids = pipeline_steps(cfg)
    gen = run_generate(GenerateConfig(prepare_run=ids["prepare"], model=TINY, max_new_tokens=12))
    # the shortlist of a non-synthetic corpus trains its head on another corpus (here synthetic)
    head_corpus = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("head"), n_notes=6,
                                            model=TINY))
    short = run_shortlist(ShortlistConfig(prepare_run=ids["prepare"], train_prepare_run=head_corpus))

    client = MlflowClient()
    exp = client.get_experiment_by_name(f"mistill/{name}")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    stages = {r.data.tags.get("mistill.stage") for r in runs}
    assert {"prepare", "shortlist", "events", "attribute", "knockin", "targets", "select_lambda",
            "train", "las_simulator", "evaluate", "own_heads", "report", "generate"} <= stages, stages
    assert all(r.info.status == "FINISHED" for r in runs if r.info.run_id in set(ids.values()) | {gen, short})

    guard = _canary_guard()
    protected = _memoized(guard.contains_protected)
    tokenizer = load_tokenizer(TINY)
    blobs = list(_stored_blobs(own_server, tokenizer))
    assert any(w.startswith("artifact ") for w, _ in blobs) and len(blobs) > 50
    assert any("as token ids" in w for w, _ in blobs)  # the token-id reading ran on real arrays
    leaked = [w for w, text in blobs if protected(text) or CANARY_ID.lower() in text.lower()]
    assert leaked == []

    # control: the same corpus marked public, and the same scan finds the canary in the store
    public = run_prepare(PrepareConfig(corpus=str(corpus_file), corpus_name=unique("public"), privacy="public",
                                       codes_file=str(codes_file), model=TINY))
    assert client.get_run(public).info.status == "FINISHED"
    found = [w for w, text in _stored_blobs(own_server, tokenizer) if protected(text)]
    assert any(w.startswith("artifact ") and "corpus.jsonl" in w for w in found), found
