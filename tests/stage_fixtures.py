"""Helpers for the stage integration tests (tests/test_stages.py): small configs, run queries,
subprocess environments, and the scan of everything a run left on the tracking server."""

from __future__ import annotations

import html
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TINY = "tiny:qwen3"
"""Random 2-layer Qwen3 (4 heads per layer) with the embedded SmolLM2 tokenizer."""
TINY_HEADS = 2 * 4
SLOW_TINY = "tiny:qwen3:layers=6:d_model=512"
"""A larger random Qwen3, slow enough (~0.4 s a note on 2 cores) to be killed between notes."""



def _characterization_only() -> dict:
    """Pipeline arguments that stop it after knock-in (no locus pass, no student training)."""
    import dataclasses

    from mistill.stages.workflow import PipelineConfig

    fields = {f.name for f in dataclasses.fields(PipelineConfig)}
    off = {"train_arms": (), "shortlist": False, "report": False, "locus": False, "read_side": False}
    return {k: v for k, v in off.items() if k in fields}


SMALL = dict(model=TINY, n_null=4, selftest_events=0, k_bins=(3, 8), events_per_phase=3,
             stability_splits=5, launch="inline", **_characterization_only())
"""Pipeline arguments sized for a test (prepare -> events -> attribute -> knockin): 3 notes take
~10 s on two CPU cores."""

_WORD = re.compile(r"\w+")


def freeze_source(dst: Path) -> Path:
    """A copy of the source tree (what :func:`mistill.tracking.identity.code_version` hashes, and the
    entry-point scripts): subprocesses started from it keep one code version even while files of
    the shared checkout change (an ``projects/*.py`` script imports ``mistill`` from its tree)."""
    import shutil

    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".*")
    for name in ("mistill", "projects", "selection", "analysis"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, dst / name, ignore=ignore)
    for name in ("MLproject", "pyproject.toml", "conda.yaml"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, dst / name)
    return dst


def unique(prefix: str) -> str:
    """A corpus name no other test uses (its own experiment ``mistill/<name>``)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def now_ms(slack_ms: int = 1000) -> int:
    """A time in ms, ``slack_ms`` before now: a run created after this call starts later."""
    return int(time.time() * 1000) - slack_ms


def runs_started_since(since_ms: int, client=None) -> set[str]:
    """The ids of every run on the tracking server started at or after ``since_ms`` (see
    :func:`now_ms`), of every experiment, deleted ones included: what a call made after
    ``since_ms`` may have left. The session's server holds every other test's runs, so the query
    filters on the start time rather than reading them all."""
    from mlflow.entities import ViewType  # deferred: mlflow is slow to import
    from mlflow.tracking import MlflowClient

    client = client or MlflowClient()
    ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    found: set[str] = set()
    token = None
    while ids:
        page = client.search_runs(ids, filter_string=f"attributes.start_time >= {since_ms}",
                                  run_view_type=ViewType.ALL, max_results=1000, page_token=token)
        found |= {r.info.run_id for r in page}
        token = page.token
        if not token:
            break
    return found


def tiny_attribute_run(prefix: str, n_notes: int = 3) -> str:
    """``prepare -> events -> attribute`` on :data:`TINY` over ``n_notes`` synthetic notes (4 NULL
    events a note, no self-test): the attribute run's id. The caller sets ``MISTILL_ROOT`` and
    the tracking server."""
    from mistill.stages.characterize import AttributeConfig, EventsConfig, run_attribute, run_events
    from mistill.stages.prepare import PrepareConfig, run_prepare

    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique(prefix), n_notes=n_notes, model=TINY))
    events = run_events(EventsConfig(prepare_run=prep, model=TINY, n_null=4))
    return run_attribute(AttributeConfig(events_run=events, selftest_events=0, stability_splits=5))


def tiny_distill_inputs(root: Path, prefix: str, student: str = "tiny:qwen3:seed=2", **pipeline) -> dict:
    """Characterization of 3 synthetic notes (:data:`SMALL`), the student's ranking and the
    teacher's targets under ``MISTILL_ROOT=root``: ``{"ids": step run ids, "root", "corpus"}``.
    ``pipeline``: further :class:`PipelineConfig` fields. The caller sets the tracking server."""
    import pytest

    from mistill.stages.workflow import PipelineConfig, distill_steps, pipeline_steps

    name = unique(prefix)
    cfg = PipelineConfig(corpus="synthetic", corpus_name=name, n_notes=3, **pipeline, **SMALL)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MISTILL_ROOT", str(root))
        ids = pipeline_steps(cfg)
        ids.update(distill_steps(cfg.replace(train_arms=(), student=student, select_lock=""), ids, name, None))
    return {"ids": ids, "root": root, "corpus": name}


def finished_note_rows(root: Path, run_id: str, stage: str, filename: str) -> list[dict]:
    """Check that run ``run_id`` of ``stage`` is FINISHED and return every row of the per-note
    JSONL ``filename`` it wrote under ``notes/`` (read from its work dir under ``root``, notes
    in order)."""
    from mlflow.tracking import MlflowClient

    run = MlflowClient().get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.stage"] == stage
    rows = []
    for d in sorted((Path(root) / "work" / run_id / "notes").iterdir()):
        rows += [json.loads(line) for line in (d / filename).read_text().splitlines() if line]
    return rows


def subprocess_env(tracking_uri: str, root: Path) -> dict[str, str]:
    """Environment of an entry-point subprocess: this server, this root, this venv first."""
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ)
    env.update({"MLFLOW_TRACKING_URI": tracking_uri, "MISTILL_ROOT": str(root),
                "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONUNBUFFERED": "1",
                "TQDM_DISABLE": "1", "PATH": bindir + os.pathsep + env.get("PATH", "")})
    env.pop("MLFLOW_RUN_ID", None)
    env.pop("MLFLOW_EXPERIMENT_NAME", None)
    env.pop("MLFLOW_EXPERIMENT_ID", None)
    return env


def runs_of(experiment: str, stage: str | None = None, corpus: str | None = None):
    """Every run of an experiment (all statuses), optionally one stage / corpus, via
    ``mlflow.search_runs`` on the ``mistill.stage`` and ``mistill.corpus`` tags."""
    import mlflow

    filters = []
    if stage is not None:
        filters.append(f"tags.`mistill.stage` = '{stage}'")
    if corpus is not None:
        filters.append(f"tags.`mistill.corpus` = '{corpus}'")
    return mlflow.search_runs(experiment_names=[experiment], filter_string=" and ".join(filters),
                              max_results=1000)


def n_runs(experiment: str) -> int:
    return len(runs_of(experiment))


def artifact_paths(client, run_id: str, path: str | None = None) -> set[str]:
    """Every artifact file path of a run (recursive listing on the server)."""
    out: set[str] = set()
    for info in client.list_artifacts(run_id, path):
        if info.is_dir:
            out |= artifact_paths(client, run_id, info.path)
        else:
            out.add(info.path)
    return out


# ------------------------------------------------------------------------------ leak scan
def normalized(text: str) -> str:
    """Lower-cased word tokens joined by single spaces, padded: escaping, case, punctuation and
    line breaks cannot hide a phrase from a substring test."""
    return " " + " ".join(_WORD.findall(html.unescape(text).lower())) + " "


def phrase_needles(phrase: str, window: int) -> list[str]:
    """Every ``window``-word run of ``phrase``, normalized (the whole phrase if shorter)."""
    words = _WORD.findall(phrase.lower())
    if len(words) <= window:
        return [" " + " ".join(words) + " "]
    return [" " + " ".join(words[i:i + window]) + " " for i in range(len(words) - window + 1)]


def _file_text(path: Path) -> str:
    """What a reader could get out of an artifact: text files as text, the strings of
    ``.npz``/``.npy`` arrays, the printable bytes of anything else."""
    raw = path.read_bytes()
    if path.suffix in (".npz", ".npy"):
        loaded = np.load(path, allow_pickle=False)
        arrays = [loaded] if isinstance(loaded, np.ndarray) else [loaded[k] for k in loaded.files]
        strings = [str(x) for a in arrays if a.dtype.kind in "US" for x in a.ravel().tolist()]
        return "\n".join(strings)
    return raw.decode("utf-8", errors="replace")


def tracked_texts(client, experiment: str, dst: Path, stages: Iterable[str] | None = None
                  ) -> Iterator[tuple[str, str]]:
    """(where, text) for everything the tracking server holds about the experiment's runs:
    run name, params, tags, metric keys, dataset inputs and every artifact file (downloaded
    recursively)."""
    import mlflow

    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, experiment
    wanted = set(stages) if stages is not None else None
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    assert runs, f"no runs in {experiment}"
    for run in runs:
        rid = run.info.run_id
        if wanted is not None and run.data.tags.get("mistill.stage") not in wanted:
            continue
        yield f"{rid} run name", run.info.run_name or ""
        yield f"{rid} params", "\n".join(f"{k} = {v}" for k, v in run.data.params.items())
        yield f"{rid} tags", "\n".join(f"{k} = {v}" for k, v in run.data.tags.items())
        yield f"{rid} metric keys", "\n".join(run.data.metrics)
        for di in run.inputs.dataset_inputs:
            d = di.dataset
            yield f"{rid} dataset {d.name}", json.dumps(
                {"name": d.name, "digest": d.digest, "source": d.source, "schema": d.schema,
                 "profile": d.profile, "tags": {t.key: t.value for t in di.tags}})
        local = Path(mlflow.artifacts.download_artifacts(run_id=rid, dst_path=str(dst / rid)))
        for path in sorted(local.rglob("*")):
            if path.is_file():
                yield f"{rid} artifact {path.relative_to(local).as_posix()}", _file_text(path)


def leaks(places: Iterable[tuple[str, str]], needles: Iterable[str]) -> list[str]:
    """Where (of ``places``, as :func:`tracked_texts` yields them) any normalized needle occurs."""
    needles = list(needles)
    found = []
    for where, text in places:
        norm = normalized(text)
        hit = [n.strip() for n in needles if n in norm]
        if hit:
            found.append(f"{where}: {hit[0]!r}")
    return found


def port_outside_the_ephemeral_range() -> int:
    """A free port below the kernel's ephemeral range: no client socket of another process can
    be handed it while the test's server is down (a port from bind(0) could be)."""
    import random

    from mistill.tracking.server import port_is_free as _port_free

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low // 2), low)
        if _port_free("127.0.0.1", port):
            return port
    raise AssertionError("no free port below the ephemeral range")


CANARY_ID = "CANARY-7f3a9c-51d2"
CANARY_SENTENCE = ("the quiet marmalade heron counted eleven copper lanterns beside the frozen "
                   "orchard at dusk")


def planted_corpus(tmp_path: Path, splits: tuple[str, ...] = ("train",) * 3) -> tuple[Path, Path]:
    """Restricted notes (JSONL, one per entry of ``splits``, in that split) with the canary planted
    in their texts and traces, and the code file of the synthetic inventory (120 codes).

    Each trace reasons like a synthetic one in brief: regions, a sibling set aside, the code
    endorsed, a recap and the JSON answer, so it has P1, P2, P2C and NULL events. Unlike the
    synthetic notes, nothing quotes an inventory description and each note has two gold codes:
    with quoted descriptions or three gold codes listed in trace order, ``prepare`` itself is
    refused (a library bug, see ``test_restricted_prepare_of_synthetic_shaped_notes``).
    """
    from mistill.data.corpus import Corpus, Note
    from mistill.data.synthetic import make_synthetic_corpus

    inv = make_synthetic_corpus(n_notes=1, seed=0).inventory
    cats = [c for c in inv.categories() if len(inv.codes_in_category(c)) >= 2]
    notes = []
    for i, split in enumerate(splits):
        sib, c1 = inv.codes_in_category(cats[i])[:2]
        c2 = inv.codes_in_category(cats[i + 7])[0]
        text = (f"Discharge summary {i} (planted test note).\n"
                f"Chart reference {CANARY_ID} was reviewed on admission. {CANARY_SENTENCE.capitalize()}.\n"
                "The patient was admitted for a worsening problem, treated on the ward and improved.\n"
                f"The reviewer filed {CANARY_ID} with the summary.\n")
        trace = (f"<think>\nLet me read the summary. The chart reference {CANARY_ID} is noted first, "
                 f"and the note says {CANARY_SENTENCE}.\n"
                 f"The findings point to the {c1[0]} codes and then to the {c2[0]} codes.\n"
                 f"For the first finding the candidates are {sib} and {c1}. {sib} does not fit the "
                 f"history; set aside. So the code here is {c1}.\n"
                 f"For the second finding the code is {c2}, which matches the hospital course.\n"
                 f"Aside: {CANARY_SENTENCE}, as the reviewer wrote near {CANARY_ID}.\n"
                 f"Recap: {c1} and {c2}.\n</think>\n\n" + json.dumps([c1, c2]))
        notes.append(Note(note_id=f"pl-{i:03d}", patient_id=f"plp-{i:03d}", split=split,
                          text=text, gold_codes=(c1, c2), teacher_trace=trace))
    planted = Corpus(name="planted", privacy="restricted", notes=notes, inventory=inv)
    path = planted.to_jsonl(tmp_path / "planted.jsonl")
    codes = tmp_path / "codes.txt"
    codes.write_text("\n".join(inv.codes) + "\n")
    return Path(path), codes
