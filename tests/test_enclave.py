"""The local enclave: per-note files that are model text of a restricted corpus stay on the
machine that ran the stage, recorded with their sha256 in ``_DONE`` and never uploaded.

On a real MLflow server: :meth:`StageRun.write_note` with ``local_files`` (nothing uploaded, one
enclave tag, read back checked, a missing enclave named), and the ``targets`` -> ``train`` chain
on tiny models: for a restricted corpus the teacher's top-k arrays stay in the enclave beside an
uploaded manifest, ``train`` trains from them, a changed local file is refused and a machine
without the enclave gets a clear error; for a synthetic corpus ``targets.npz`` is uploaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.data.corpus import Corpus
from mistill.data.synthetic import make_synthetic_corpus
from mistill.errors import MistillInputError
from mistill.models.loading import embedded_tokenizer
from mistill.stages.common import RunReader, load_prepared
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.runs import StageRun
from stage_fixtures import TINY, artifact_paths, runs_of, unique

pytestmark = pytest.mark.usefixtures("pinned_code_version")

STUDENT = "tiny:qwen3:seed=2"
SECRET_TRACE = "<think>\nthe planted trace names a cobalt lantern beside the quiet harbour\n</think>\n\n[]"


# ------------------------------------------------------------------ StageRun.write_note
@dataclasses.dataclass(frozen=True)
class EnclaveTestConfig(Config):
    n_notes: int = 1


def _stage(root: Path, level: str) -> StageRun:
    return StageRun("enclave-test", EnclaveTestConfig(), corpus=f"enclave-{uuid.uuid4().hex[:8]}",
                    guard=PrivacyGuard([SECRET_TRACE], level), resume=True, root=root,
                    code_version="enclave-test-v1")


def test_write_note_keeps_local_files_in_the_enclave_only(tracking_uri, tmp_path, monkeypatch):
    root = tmp_path / "root"
    monkeypatch.setenv("MISTILL_ROOT", str(root))
    with _stage(root, "restricted") as run:
        for note in ("n0", "n1"):
            run.write_note("notes", note, {"record.json": {"n_tokens": 7}},
                           local_files={"trace.txt": SECRET_TRACE, "ids.bin": b"\x01\x02"})
        # a copy of a local file beside the uploaded ones is still never uploaded on a resync
        note_dir = run.note_dir("notes", "n0")
        (note_dir / "trace.txt").write_text(SECRET_TRACE)
        (note_dir / ".uploaded").unlink()
        assert run.finished_notes("notes") == {"n0", "n1"}
        assert run.load_note("notes", "n1", "trace.txt") == SECRET_TRACE.encode()
        assert run.load_note("notes", "n1", "record.json") == {"n_tokens": 7}
    client = MlflowClient()
    arts = artifact_paths(client, run.run_id)
    assert {a.rsplit("/", 1)[-1] for a in arts if a.startswith("notes/")} == {"record.json", "_DONE"}
    enclave = root / "work" / run.run_id / "enclave"
    tag = client.get_run(run.run_id).data.tags["mistill.enclave_dir"]
    assert Path(tag) == enclave.resolve()
    local = enclave / "notes" / "n0" / "trace.txt"
    assert local.read_text() == SECRET_TRACE
    done = json.loads(Path(mlflow.artifacts.download_artifacts(
        run_id=run.run_id, artifact_path="notes/n0/_DONE", dst_path=str(tmp_path / "done"))).read_text())
    assert done["local_files"] == {"trace.txt": hashlib.sha256(SECRET_TRACE.encode()).hexdigest(),
                                   "ids.bin": hashlib.sha256(b"\x01\x02").hexdigest()}
    assert set(done["files"]) == {"record.json"}

    reader = RunReader(run.run_id)
    assert reader.note_file("notes", "n0", "trace.txt") == local.resolve()
    assert reader.note_file("notes", "n0", "record.json").name == "record.json"
    local.write_text(SECRET_TRACE + " changed")
    with pytest.raises(MistillInputError) as err:
        RunReader(run.run_id).note_file("notes", "n0", "trace.txt")
    msg = str(err.value)
    assert run.run_id in msg and "note n0" in msg and "trace.txt" in msg and "sha256" in msg
    # another machine: no enclave there
    shutil.rmtree(root / "work" / run.run_id)
    with pytest.raises(MistillInputError) as err:
        RunReader(run.run_id).note_file("notes", "n1", "trace.txt")
    msg = str(err.value)
    assert "restricted model text kept only" in msg and f"machine that ran run {run.run_id}" in msg


def test_write_note_refuses_a_name_both_local_and_uploaded(tracking_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    with _stage(tmp_path / "root", "restricted") as run:
        with pytest.raises(MistillInputError, match="both"):
            run.write_note("notes", "n0", {"a.txt": "x"}, local_files={"a.txt": "y"})
        assert run.finished_notes("notes") == set()


# ------------------------------------------------------------------- targets -> train
def _trace_tokens(text: str) -> int:
    return len(embedded_tokenizer()(text, add_special_tokens=False)["input_ids"])


def _chain(root: Path, monkeypatch: pytest.MonkeyPatch, privacy: str) -> dict:
    """prepare -> events -> attribute (teacher) -> targets on two training notes with tiny models."""
    from mistill.stages.characterize import AttributeConfig, EventsConfig
    from mistill.stages.distill import TargetsConfig
    from mistill.stages.prepare import PrepareConfig
    from mistill.stages.workflow import run_step

    monkeypatch.setenv("MISTILL_ROOT", str(root))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    name = unique(f"enclave-{privacy}")
    if privacy == "synthetic":
        prep_cfg = PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=6, model=TINY)
    else:
        syn = make_synthetic_corpus(n_notes=6, seed=0)
        path = Corpus(name="shaped", privacy=privacy, notes=syn.notes,
                      inventory=syn.inventory).to_jsonl(root.parent / f"{name}.jsonl")
        codes = root.parent / f"{name}-codes.txt"
        codes.write_text("\n".join(syn.inventory.codes) + "\n")
        prep_cfg = PrepareConfig(corpus=str(path), corpus_name=name, privacy=privacy, codes_file=str(codes),
                                 model=TINY)
    prep = run_step("prepare", prep_cfg, name, launch="inline")
    ev = run_step("events", EventsConfig(prepare_run=prep, model=TINY, split="train", max_notes=2, n_null=4),
                  name, launch="inline")
    att = run_step("attribute", AttributeConfig(events_run=ev, stability_splits=5), name, launch="inline")
    tg = run_step("targets", TargetsConfig(teacher_attribute_run=att, split="train"), name, launch="inline")
    notes = [n for n in load_prepared(prep).corpus.notes if n.split == "train"][:2]
    return {"name": name, "prepare": prep, "targets": tg, "notes": notes, "root": root}


@pytest.fixture(scope="module")
def restricted(tracking_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with pytest.MonkeyPatch.context() as mp:
        yield _chain(tmp_path_factory.mktemp("enclave-restricted") / "root", mp, "restricted")


def _train(targets_run: str, seed: int) -> str:
    from mistill.stages.distill import TrainStageConfig, run_train

    return run_train(TrainStageConfig(targets_run=targets_run, student=STUDENT, arm="vanilla-bf16", seed=seed,
                                      max_steps=1, grad_accum=1, register=False))


def _long_int_sequences(path: Path, min_len: int) -> list[str]:
    """Integer arrays (npz/npy) or JSON integer lists in ``path`` with an axis of at least
    ``min_len`` entries: what could carry one token id per trace position."""
    found = []
    if path.suffix in (".npz", ".npy"):
        loaded = np.load(io.BytesIO(path.read_bytes()), allow_pickle=False)
        arrays = {"": loaded} if isinstance(loaded, np.ndarray) else {k: loaded[k] for k in loaded.files}
        for key, a in arrays.items():
            if a.dtype.kind in "iu" and a.ndim and max(a.shape) >= min_len:
                found.append(f"{path.name}:{key} {a.shape}")
    elif path.suffix in (".json", ".jsonl", "") or path.name == "_DONE":
        text = path.read_text(encoding="utf-8", errors="replace")
        docs = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
            else [json.loads(text)] if text.strip().startswith(("{", "[")) else []

        def walk(x, where: str) -> None:
            if isinstance(x, list):
                if len(x) >= min_len and all(isinstance(v, int) and not isinstance(v, bool) for v in x):
                    found.append(f"{path.name}:{where} [{len(x)}]")
                for i, v in enumerate(x):
                    walk(v, f"{where}[{i}]")
            elif isinstance(x, dict):
                for k, v in x.items():
                    walk(v, f"{where}.{k}")
        for doc in docs:
            walk(doc, "")
    return found


def test_restricted_targets_upload_a_manifest_and_no_token_arrays(restricted, tmp_path):
    client = MlflowClient()
    run_id = restricted["targets"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.privacy"] == "restricted"
    arts = artifact_paths(client, run_id)
    assert not any(a.endswith(".npz") or a.endswith(".npy") for a in arts), sorted(arts)
    enclave = Path(run.data.tags["mistill.enclave_dir"])
    assert enclave == (restricted["root"] / "work" / run_id / "enclave").resolve()
    local_dir = Path(mlflow.artifacts.download_artifacts(run_id=run_id, dst_path=str(tmp_path / "all")))
    for note in restricted["notes"]:
        nid = note.note_id
        assert f"notes/{nid}/targets_manifest.json" in arts and f"notes/{nid}/_DONE" in arts
        local = enclave / "notes" / nid / "targets.npz"
        with np.load(local) as data:
            arrays = {k: data[k] for k in data.files}
        n_trace = arrays["top_ids"].shape[0]
        # top_ids holds one entry per trace token: the trace, tokenized alone, is that long (±2 for
        # the tokens merged across the prompt/trace boundary and the closing template token)
        assert abs(n_trace - _trace_tokens(note.teacher_trace)) <= 2
        manifest = json.loads((local_dir / "notes" / nid / "targets_manifest.json").read_text())["arrays"]
        assert set(manifest) == set(arrays)
        for key, a in arrays.items():
            a = np.ascontiguousarray(a)
            assert manifest[key] == {"shape": list(a.shape), "dtype": a.dtype.str,
                                     "sha256": hashlib.sha256(a.tobytes()).hexdigest()}, key
        done = json.loads((local_dir / "notes" / nid / "_DONE").read_text())
        assert set(done["local_files"]) == {"targets.npz"} and "targets.npz" not in done["files"]
        # no artifact of the run holds an integer sequence anywhere near the trace's length
        leaks = [hit for p in sorted(local_dir.rglob("*")) if p.is_file()
                 for hit in _long_int_sequences(p, n_trace // 2)]
        assert leaks == [], leaks


def test_train_trains_from_the_local_targets(restricted):
    client = MlflowClient()
    assert not any(a.endswith("targets.npz") for a in artifact_paths(client, restricted["targets"]))
    run_id = _train(restricted["targets"], seed=0)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["train/steps"] == 1
    assert run.data.metrics["n_notes"] == len(restricted["notes"])
    assert not any(a.endswith(".npz") for a in artifact_paths(client, run_id))


def test_distillm2_student_generations_are_local_files_of_the_train_run(restricted):
    """DistiLLM-2's dispreferred responses (the student's token ids) stay in the train run's
    local enclave for a restricted corpus: nothing of them reaches the store or the work dir
    the store's artifacts are uploaded from."""
    from mistill.stages.distill import TrainStageConfig, run_train

    run_id = run_train(TrainStageConfig(targets_run=restricted["targets"], student=STUDENT, arm="distillm2",
                                        max_steps=1, grad_accum=1, dispreferred_max_new_tokens=8,
                                        register=False))
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["train/distillm2/srkl"] > 0
    enclave = Path(run.data.tags["mistill.enclave_dir"])
    for note in restricted["notes"]:
        record = json.loads((enclave / "dispreferred" / f"{note.note_id}.json").read_text())
        assert 1 <= len(record["token_ids"]) <= 8 and record["decoding"]["backend"] == "hf"
    assert not (restricted["root"] / "work" / run_id / "dispreferred").exists()
    assert not [a for a in artifact_paths(client, run_id) if a.startswith("dispreferred")]
    assert run.data.tags["mistill.rollout_backend"] == "hf"


def test_a_changed_local_targets_file_is_refused(restricted):
    from mistill.io import npz_bytes

    run_id = restricted["targets"]
    nid = restricted["notes"][0].note_id
    local = Path(MlflowClient().get_run(run_id).data.tags["mistill.enclave_dir"]) / "notes" / nid / "targets.npz"
    saved = local.read_bytes()
    with np.load(local) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["top_ids"] = arrays["top_ids"][:, ::-1].copy()  # a well-formed file with other values
    n_train = len(runs_of(f"mistill/{restricted['name']}", stage="train"))
    try:
        local.write_bytes(npz_bytes(arrays))
        with pytest.raises(MistillInputError) as err:
            _train(run_id, seed=1)
    finally:
        local.write_bytes(saved)
    msg = str(err.value)
    assert run_id in msg and f"note {nid}" in msg and "targets.npz" in msg and "sha256" in msg
    assert len(runs_of(f"mistill/{restricted['name']}", stage="train")) == n_train  # refused before a run


def test_a_machine_without_the_enclave_gets_a_clear_error(restricted, tmp_path):
    run_id = restricted["targets"]
    work = restricted["root"] / "work" / run_id
    away = tmp_path / "elsewhere"
    n_train = len(runs_of(f"mistill/{restricted['name']}", stage="train"))
    shutil.move(str(work), str(away))  # as on another machine: no work dir, no enclave
    try:
        with pytest.raises(MistillInputError) as err:
            _train(run_id, seed=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the _DONE markers downloaded meanwhile
        shutil.move(str(away), str(work))
    msg = str(err.value)
    assert "targets.npz" in msg and "restricted model text kept only" in msg
    assert f"machine that ran run {run_id}" in msg
    assert len(runs_of(f"mistill/{restricted['name']}", stage="train")) == n_train  # refused before a run


def test_synthetic_targets_are_uploaded_with_their_manifest(tracking_uri, tmp_path, monkeypatch):
    chain = _chain(tmp_path / "root", monkeypatch, "synthetic")
    client = MlflowClient()
    run = client.get_run(chain["targets"])
    assert run.data.tags["mistill.privacy"] == "synthetic" and "mistill.enclave_dir" not in run.data.tags
    arts = artifact_paths(client, chain["targets"])
    for note in chain["notes"]:
        nid = note.note_id
        assert {f"notes/{nid}/targets.npz", f"notes/{nid}/targets_manifest.json"} <= arts
        got = Path(mlflow.artifacts.download_artifacts(run_id=chain["targets"], artifact_path=f"notes/{nid}",
                                                       dst_path=str(tmp_path / nid)))
        manifest = json.loads((got / "targets_manifest.json").read_text())["arrays"]
        with np.load(got / "targets.npz") as data:
            assert {k: hashlib.sha256(np.ascontiguousarray(data[k]).tobytes()).hexdigest() for k in data.files} \
                == {k: v["sha256"] for k, v in manifest.items()}
        assert "local_files" not in json.loads((got / "_DONE").read_text())
    assert not (tmp_path / "root" / "work" / chain["targets"] / "enclave").exists()
