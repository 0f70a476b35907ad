"""What every per-note stage does around its science: open or reuse its run, walk its notes with
resume and progress, and share that walk among the processes of a ``torchrun`` launch.

A stage reads::

    with open_stage("events", cfg, prepared, inputs={"prepare": cfg.prepare_run}) as run:
        if run.reused:
            return run.run_id
        lm = load_model(cfg.model, device=stage_device(cfg.device))
        for note in note_loop(run, NOTES, notes, desc="events"):
            run.write_note(NOTES, note.note_id, measure(note))
        if not notes_written(run, NOTES, notes):
            return run.run_id          # a rank other than 0: its notes are written
        ...aggregate over every note, log tables and metrics (rank 0 only)...

In one process (no launcher) this is the plain loop: finished notes are skipped (per-note
resume), the others are measured and written one at a time (``_DONE`` last, see
:meth:`~mistill.tracking.runs.StageRun.write_note`; the privacy guard checks every file before
it is uploaded). Under ``torchrun`` / ``accelerate launch`` (:mod:`mistill.distributed`):

* rank 0 opens the run exactly as one process would (reuse a finished identical run, resume an
  unfinished one under its lease, else create it) and tells the others its id; they write their
  notes into the same run without owning it;
* rank 0 reads which notes are finished and every rank takes its share of the rest
  (:func:`mistill.distributed.shard`: round-robin in corpus order), so a pass resumed on another
  number of processes does only what is missing;
* :func:`notes_written` waits for every rank, then rank 0 checks that every note of the pass is
  finished before it aggregates and ends the run FINISHED. A rank that dies fails the barrier
  (or is stopped by the launcher), so the run ends FAILED or KILLED, or stays RUNNING until its
  lease lapses: never FINISHED with notes missing. A rerun resumes it.

A stage that is not ``shardable`` in the stage table (:mod:`mistill.stages.registry`), such as
``las_simulator`` (one model fine-tuned once), is refused under a launcher of several processes.
Stages whose notes depend on each other (``attribute``'s running global ranking, ``knockin``'s
donor steps) keep the opening and closing here and walk their notes in waves of their own
(:mod:`mistill.instrument.waves`, :func:`mistill.stages.characterize._knockin_notes`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mlflow.tracking import MlflowClient

from mistill.distributed import barrier, broadcast, current_world, init_world, rank_device, shard
from mistill.errors import MistillInputError
from mistill.progress import get_logger, track
from mistill.stages.common import (INPUT_RUN_STAGES, check_input_files, check_input_run, check_model_input,
                                   log_corpus_input, mistill_root, privacy_guard, run_fields)
from mistill.stages.registry import stage as registered, stage_help
from mistill.tracking.runs import StageRun

if TYPE_CHECKING:
    from mistill.config import Config
    from mistill.data.corpus import Note
    from mistill.stages.common import Prepared
    from mistill.stages.registry import Stage
    from mistill.tracking.privacy import PrivacyGuard
    from mistill.tracking.runs import StageRun

_log = get_logger("runner")


def preflight(stage: Stage, cfg: Config) -> None:
    """Check what a stage's config names outside itself, before the stage reads anything or
    creates its run: every run a ``*_run`` / ``*_runs`` field names exists, ended FINISHED and is
    a run of a stage that field accepts (:data:`~mistill.stages.common.INPUT_RUN_STAGES`); every
    model the stage loads is there (``stage.models``: a local directory with ``config.json``, a
    cached hub id, an installed ``embedded:`` model, or a FINISHED ``train`` run for
    ``run:<id>``); every file it reads exists (``stage.files``). Nothing is loaded; each run is
    one request to the tracking server. The command line calls it for every stage
    (:func:`mistill.stages.cli.main`), as does a workflow step run in its process.

    Raises:
        MistillInputError: naming the field, e.g. "run <id> is a `prepare` run; --targets_run
            needs a `targets` run".
    """
    client = MlflowClient()
    for name in run_fields(type(cfg)):
        value = getattr(cfg, name)
        for run_id in value if isinstance(value, (tuple, list)) else (value,):
            if run_id:
                check_input_run(client, run_id, name, INPUT_RUN_STAGES[name])
    for name in stage.models:
        if getattr(cfg, name):
            check_model_input(client, getattr(cfg, name), name)
    check_input_files(cfg, stage.files)


@contextlib.contextmanager
def open_stage(stage: str, cfg: Config, prepared: Prepared, *, inputs: Mapping[str, str],
               guard: PrivacyGuard | None = None, corpus: str = "", **run_args: Any) -> Iterator[StageRun]:
    """The stage's run, opened with resume (an identical finished run is reused: ``run.reused``).

    Args:
        stage: the stage's name (``mistill.stage`` tag, entry point).
        cfg: the stage's typed config (its params and identity).
        prepared: the data the stage reads; its corpus index is logged as the run's input
            (unless the run is reused) and its privacy guard checks everything written.
        inputs: lineage ``{name: input run id}``.
        guard: the privacy guard (default: :func:`~mistill.stages.common.privacy_guard` of the corpus).
        corpus: the corpus whose experiment holds the run (default: the prepared corpus's name).
        run_args: passed to :class:`~mistill.tracking.runs.StageRun` (model, arm, tags, ...).
    """
    if current_world().distributed and not registered(stage).shardable:
        raise MistillInputError(f"{stage} runs in one process; launch it without torchrun, or with one "
                                f"process", field="nproc")
    world = init_world(str(getattr(cfg, "device", "cpu")))
    guard = guard if guard is not None else privacy_guard(prepared.corpus)
    args = dict(corpus=corpus or prepared.corpus.name, guard=guard, corpus_digest=prepared.corpus.digest, inputs=dict(inputs),
                resume=True, root=mistill_root(), description=stage_help()[stage], **run_args)
    if world.leader:
        with StageRun(stage, cfg, **args) as run:
            broadcast((run.run_id, run.reused), world)
            if run.reused:
                print(f"{stage}: reusing finished run {run.run_id}")
            else:
                log_corpus_input(run, prepared)
            yield run
        return
    run_id, reused = broadcast(None, world)
    with StageRun(stage, cfg, **args, attach=run_id) as run:
        run.reused = reused
        yield run


def stage_device(device: str) -> str:
    """The device this process computes on (``cuda`` is this rank's GPU under a launcher)."""
    return rank_device(device, current_world())


def pending_notes(run: StageRun, subdir: str, notes: Sequence[Note], *, desc: str) -> list[Note]:
    """The notes of ``notes`` this process still has to write under ``subdir``, in order: the
    unfinished ones (as rank 0 reads them from the run) dealt to this rank."""
    world = current_world()
    done = broadcast(run.finished_notes(subdir) if world.leader else None, world)
    todo = [n for n in notes if n.note_id not in done]
    if world.leader and len(todo) < len(notes):
        _log.info("%s: %d of %d notes finished before; %d to do", desc, len(notes) - len(todo), len(notes),
                  len(todo))
    return shard(todo, world)


def progress_label(desc: str) -> str:
    """A progress bar's label: ``desc``, with this process's rank under a launcher."""
    world = current_world()
    return f"{desc} [rank {world.rank}/{world.size}]" if world.distributed else desc


def note_loop(run: StageRun, subdir: str, notes: Sequence[Note], *, desc: str) -> Iterator[Note]:
    """:func:`pending_notes`, one at a time, with a progress bar."""
    mine = pending_notes(run, subdir, notes, desc=desc)
    yield from track(mine, desc=progress_label(desc), total=len(mine))


def notes_written(run: StageRun, subdir: str, notes: Sequence[Note]) -> bool:
    """Wait for every process of the pass; True on the one that aggregates (rank 0), after it
    checked that every note of ``notes`` is finished under ``subdir``.

    Raises:
        RuntimeError: a note is unfinished after every rank returned (a rank skipped its work).
    """
    world = current_world()
    barrier(world)
    if not world.leader:
        return False
    if world.distributed:
        missing = sorted({n.note_id for n in notes} - run.finished_notes(subdir))
        if missing:
            raise RuntimeError(f"run {run.run_id}: {len(missing)} notes of {subdir!r} are unfinished after "
                               f"every rank returned ({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''})")
    return True


class WrittenNotes:
    """The per-note files a stage's own run has written under ``subdir``, for its aggregation
    (read from the run's local note directory, fetched from the artifact store when another
    process of the launch wrote them)."""

    def __init__(self, run: StageRun, subdir: str) -> None:
        self.run = run
        self.subdir = subdir

    def path(self, note_id: str, filename: str) -> Path:
        path = self.run.note_dir(self.subdir, note_id) / filename
        if not path.exists():
            self.run.load_note(self.subdir, note_id, filename)
        return path

    def jsonl(self, note_id: str, filename: str) -> list[dict]:
        return [json.loads(line) for line in self.path(note_id, filename).read_text().splitlines() if line]

    def json(self, note_id: str, filename: str) -> dict:
        return json.loads(self.path(note_id, filename).read_text())

    def bytes(self, note_id: str, filename: str) -> bytes:
        return self.path(note_id, filename).read_bytes()

    def npz(self, note_id: str, filename: str) -> dict[str, np.ndarray]:
        with np.load(self.path(note_id, filename)) as d:
            return {k: d[k] for k in d.files}


__all__ = ["preflight", "open_stage", "stage_device", "pending_notes", "progress_label", "note_loop", "notes_written",
           "WrittenNotes"]
