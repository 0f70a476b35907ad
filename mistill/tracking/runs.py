"""Conventions every stage follows when it logs to MLflow: the stage run, from open to end.

:class:`StageRun` is one stage's run. Its parts live beside it:

* :mod:`mistill.tracking.naming`: the tags every run carries, its name, metric names.
* :mod:`mistill.tracking.experiments`: the tracking server, one experiment per corpus, nesting
  and UI links.
* :mod:`mistill.tracking.identity`: run identity and reuse (code version, params digests,
  :func:`~mistill.tracking.identity.find_run`).
* :mod:`mistill.tracking.notes`: per-note files, ``_DONE`` markers and resume.
* :mod:`mistill.tracking.enclave`: the local files of a restricted corpus.
* :mod:`mistill.tracking.artifacts`: params, tags, metrics, artifacts, tables, figures, datasets.

Here:

* A run's name says what it is (:func:`~mistill.tracking.naming.run_name`), never a run id. A
  stage started for another (:func:`~mistill.tracking.experiments.child_runs_of`) is nested under it.
* Long stages (:data:`SYSTEM_METRICS_STAGES`) log MLflow's system metrics (CPU, memory, GPU):
  ``MISTILL_SYSTEM_METRICS=0`` turns them off, ``=1`` turns them on for every stage.
* A stage stopped by SIGTERM or Ctrl-C ends KILLED, one stopped by an error FAILED; each ended
  run logs one ``View run <name> at: <url>`` line.
* :class:`StageRun` with ``resume=True`` reuses an identical FINISHED run, resumes a
  RUNNING/FAILED/KILLED one under the same run id (one live process per run:
  :mod:`mistill.tracking.lease`), or starts a new one.
* Everything bound for the tracking store passes the corpus's :class:`PrivacyGuard`.

Only a tracking server is accepted (``http(s)://``): never the ``./mlruns`` file store. When no
tracking URI is configured, :class:`StageRun` starts (or reuses) the project's server.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Run, RunTag
from mlflow.tracking import MlflowClient, fluent

from mistill.config import Config
from mistill.progress import get_logger
from mistill.tracking import identity
from mistill.tracking.artifacts import ArtifactLogging
from mistill.tracking.connection import is_unreachable, unavailable_error
from mistill.tracking.enclave import EnclaveFiles
from mistill.tracking.experiments import (ENV_PARENT_RUN, _experiment_id, _tolerate_mlflow_errors,
                                          experiment_for_corpus, quiet_run_links, resolve_tracking_uri, run_url)
from mistill.tracking.identity import (RESUMABLE_STATUSES, default_repo_root, find_run, git_commit, identity_params,
                                       params_digest)
from mistill.tracking.lease import (ENV_ON_BUSY, ENV_WAIT_MAX, TAG_LEASE_OWNER, Heartbeat, LeaseError, LeaseSettings,
                                    claim, claim_new_run, describe_owner, generation, identity_key, lease_held,
                                    lease_tags, new_owner)
from mistill.tracking.naming import (CHECKPOINT_PREFIX, CONFIG_ARTIFACT, TAG_ARM, TAG_CODE_VERSION, TAG_CORPUS,
                                     TAG_CORPUS_DIGEST, TAG_DELEGATED_TO, TAG_DESCRIPTION, TAG_ENTRY_POINT,
                                     TAG_GIT_COMMIT,
                                     TAG_INPUT_PREFIX, TAG_LAMBDA, TAG_MODEL, TAG_PARAMS_DIGEST, TAG_PARENT_RUN,
                                     TAG_PRECISION, TAG_PRIVACY, TAG_SEED, TAG_SPLIT, TAG_STAGE, _check_component,
                                     lambda_label, run_description, run_name)
from mistill.tracking.notes import NoteFiles
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.purge import purge_if_protected
from mistill.tracking.reaper import spawn_reaper

ENV_SYSTEM_METRICS = "MISTILL_SYSTEM_METRICS"
SYSTEM_METRICS_STAGES: frozenset[str] = frozenset({"train", "attribute", "targets", "generate"})
"""The long stages that log MLflow system metrics by default (see :func:`system_metrics_wanted`)."""

_log = get_logger("tracking")


class StageRun(ArtifactLogging, NoteFiles, EnclaveFiles):
    """One stage's MLflow run: tags, params, ``config.json``, artifacts, per-note resume.

    Use as a context manager::

        guard = PrivacyGuard(note_texts, "restricted")
        with StageRun("attribution", cfg, corpus="mimic4", guard=guard, model=cfg.model,
                      inputs={"traces": traces_run_id}, resume=True) as run:
            if run.reused:
                return run.run_id
            done = run.finished_notes("notes")
            for note in notes:
                if note.note_id in done:
                    continue
                run.write_note("notes", note.note_id, {"events.json": events})
            run.log_metrics({"n_events": n})

    On exit the run ends FINISHED, KILLED if SIGTERM or Ctrl-C stopped it (SIGTERM is turned
    into a :class:`StageInterrupted` while the run is open, when the process had no handler of
    its own), or FAILED if another exception escapes (it is re-raised).

    Args:
        stage: stage name (``mistill.stage`` tag, first part of the run name).
        config: the stage's typed config; ``to_dict()`` gives the params.
        corpus: corpus name: the run goes to experiment ``mistill/<corpus>``.
        guard: the corpus's privacy guard (its level is the ``mistill.privacy`` tag).
        model, arm, seed, precision: tags and run-name parts; taken from ``config`` fields of the
            same name when not given. For a train run's checkpoint (``run:<id>``) the name shows
            the model, arm and λ that run trained.
        lam: the λ the run trains with (a number or ``(λ_P1, λ_P2)``): run-name part and
            ``mistill.lambda`` tag.
        split: the notes the run reads: run-name part (default: the ``mistill.split`` tag, else
            the config's ``split``).
        name: the whole run name, instead of :func:`~mistill.tracking.naming.run_name` of the parts.
        parent: the run this one is nested under (``mlflow.parentRunId``); default: the run of
            the enclosing :func:`~mistill.tracking.experiments.child_runs_of`, else the active
            MLflow run, else none.
        system_metrics: log MLflow's system metrics; default :func:`system_metrics_wanted`.
        corpus_digest: digest of the corpus files (``mistill.corpus_digest``).
        entry_point: MLproject entry point (defaults to ``stage``).
        inputs: lineage ``{name: input run id}``.
        tags: extra tags.
        resume: reuse an identical FINISHED run (``reused=True``, nothing else is done), else
            resume an identical RUNNING/FAILED/KILLED run under its run id, else start anew.
        root: local root; the working dir is ``<root>/work/<run_id>/``.
        repo_root: the source tree whose :func:`~mistill.tracking.identity.code_version`
            identifies the run.
        code_version: override the computed code version (tests, frozen deployments).
        tracking_uri: server URI (default: ``MLFLOW_TRACKING_URI`` or the project's server).
        attach: the id of a run another process of the same pass opened (rank 0 of a
            ``torchrun`` launch): this one writes notes and tags into it but takes no lease,
            logs no params or ``config.json``, and never ends it.
        record: further entries of ``config.json`` (a train run's resolved arm and the
            deviations it runs under), beside ``config``.
        description: what the stage computes, one line; with the run's corpus, model, arm, λ,
            seed and inputs it becomes the run's description in the UI (``mlflow.note.content``).

    Inside ``mlflow run`` (``MLFLOW_RUN_ID`` set) the launched run is adopted as the new run
    when it is in the corpus's experiment (``--experiment-name mistill/<corpus>``). If the work
    is reused or resumed elsewhere, or the launched run is in another experiment (``mlflow run``
    without ``--experiment-name``), the work goes to a run of the corpus's experiment and the
    launched run is tagged ``mistill.delegated_to`` and deleted once ``mlflow run`` ends it.
    """

    def __init__(self, stage: str, config: Config, *, corpus: str, guard: PrivacyGuard,
                 model: str | None = None, arm: str | None = None, seed: int | None = None,
                 precision: str | None = None, corpus_digest: str | None = None,
                 entry_point: str | None = None, inputs: Mapping[str, str] | None = None,
                 tags: Mapping[str, Any] | None = None, resume: bool = False,
                 root: Path | str = Path(".mistill"), repo_root: Path | str | None = None,
                 code_version: str | None = None, tracking_uri: str | None = None,
                 lam: Any = None, split: str | None = None, name: str | None = None,
                 parent: str | None = None, system_metrics: bool | None = None,
                 attach: str | None = None, record: Mapping[str, Any] | None = None,
                 description: str = "") -> None:
        if not isinstance(config, Config):
            raise TypeError(f"config must be a mistill.config.Config, got {type(config).__name__}")
        self.stage = stage
        self.config = config
        self.corpus = corpus
        self.guard = guard
        self.content_sha256: dict[str, str] = dict(sorted(config.content_digests().items()))
        self.params: dict[str, Any] = identity_params(config)
        self.model = model if model is not None else self.params.get("model")
        self.arm = arm if arm is not None else self.params.get("arm")
        self.seed = seed if seed is not None else self.params.get("seed")
        self.precision = precision if precision is not None else self.params.get("precision")
        self.corpus_digest = corpus_digest
        self.entry_point = entry_point or stage
        self.inputs = {_check_component(k, "input name"): str(v)
                       for k, v in (inputs or {}).items()}
        self.extra_tags = dict(tags or {})
        self.description = description
        self.lam = lambda_label(lam)
        config_split = self.params.get("split")
        self.split = split if split is not None else (
            self.extra_tags.get(TAG_SPLIT) or (config_split if isinstance(config_split, str) else None))
        self._name = name
        self.parent = parent
        self.system_metrics = system_metrics_wanted(stage, system_metrics)
        self.resume = resume
        self.root = Path(root)
        self.repo_root = Path(repo_root) if repo_root is not None else default_repo_root()
        self.code_version = code_version or identity.code_version(self.repo_root)
        self.git_commit = git_commit(self.repo_root)
        self.params_digest = params_digest(self.params)
        self.tracking_uri = tracking_uri or resolve_tracking_uri(self.root)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run: Run | None = None
        self.experiment_name = ""
        self.experiment_id = ""
        self.reused = False
        self.resumed = False
        self._active = False
        self.lease_settings = LeaseSettings.from_env()
        self.owner = new_owner()
        self._heartbeat: Heartbeat | None = None
        self._signals: _SignalTrap | None = None
        self._checkpoint: tuple[str, dict[str, str]] | None = None
        self.attach = attach
        self.record = dict(record or {})

    def shown_params(self) -> dict[str, Any]:
        """The params the run shows in MLflow: its identity params, with an ``arm`` the config
        leaves empty shown as the arm the run reads (a ``train`` run's checkpoint brings its arm),
        so the compare view lines every readout of an arm up by ``params.arm``. The run's
        ``config.json`` keeps the config as given, and identity is read from it."""
        shown = dict(self.params)
        if shown.get("arm") == "" and self.arm:
            shown["arm"] = self.arm
        return shown

    # ------------------------------------------------------------------------ properties
    @property
    def run_id(self) -> str:
        if self.run is None:
            raise RuntimeError("StageRun has not been entered")
        return self.run.info.run_id

    @property
    def work_dir(self) -> Path:
        """Local working dir ``<root>/work/<run_id>/``."""
        return self.root / "work" / self.run_id

    @property
    def run_name(self) -> str:
        """The run's name: ``name`` if given, else :func:`~mistill.tracking.naming.run_name` of
        stage, model, arm, λ, split, seed and a training run's ``train_notes`` (a checkpoint
        ``run:<id>`` shown as the model, arm and λ it trained)."""
        if self._name:
            return self._name
        model, arm, lam = self.model, self.arm, self.lam
        if isinstance(model, str) and model.startswith(CHECKPOINT_PREFIX):
            trained = self._checkpoint_tags(model[len(CHECKPOINT_PREFIX):])
            model = trained.get(TAG_MODEL)
            arm = arm or trained.get(TAG_ARM)
        notes = self.params.get("train_notes")
        return run_name(self.stage, model, arm, self.seed, lam=lam or self._checkpoint_lambda(),
                        split=self.split, notes=notes if isinstance(notes, int) else None)

    def _checkpoint_lambda(self) -> str | None:
        """The λ of the train run whose checkpoint (``run:<id>``) this run reads, if tagged."""
        if isinstance(self.model, str) and self.model.startswith(CHECKPOINT_PREFIX):
            return self._checkpoint_tags(self.model[len(CHECKPOINT_PREFIX):]).get(TAG_LAMBDA)
        return None

    def _checkpoint_tags(self, train_run: str) -> dict[str, str]:
        """The tags of the train run whose checkpoint this run reads (empty if unreadable)."""
        cached = self._checkpoint
        if cached is None or cached[0] != train_run:
            tags: dict[str, str] = {}
            with _tolerate_mlflow_errors():
                tags = dict(self.client.get_run(train_run).data.tags)
            self._checkpoint = cached = (train_run, tags)
        return cached[1]

    def _parent_run(self, own: str | None) -> str | None:
        """The run to nest this one under: ``parent``, else the enclosing
        :func:`~mistill.tracking.experiments.child_runs_of` run; never the run itself."""
        parent = self.parent or os.environ.get(ENV_PARENT_RUN) or None
        return parent if parent != own else None

    def tags(self) -> dict[str, str]:
        """All mistill tags of this run (None-valued ones left out)."""
        tags: dict[str, Any] = {
            TAG_STAGE: self.stage, TAG_MODEL: self.model, TAG_CORPUS: self.corpus,
            TAG_CORPUS_DIGEST: self.corpus_digest, TAG_PRIVACY: self.guard.level,
            TAG_ARM: self.arm, TAG_SEED: self.seed, TAG_PRECISION: self.precision,
            TAG_GIT_COMMIT: self.git_commit, TAG_CODE_VERSION: self.code_version,
            TAG_ENTRY_POINT: self.entry_point, TAG_PARAMS_DIGEST: self.params_digest,
            TAG_LAMBDA: self.lam or self._checkpoint_lambda(),
        }
        tags.update({TAG_INPUT_PREFIX + k: v for k, v in self.inputs.items()})
        fields = {"corpus": self.corpus, "model": self.model, "arm": self.arm, "λ": tags[TAG_LAMBDA],
                  "seed": self.seed, "precision": self.precision, "split": self.split}
        tags[TAG_DESCRIPTION] = run_description(self.stage, self.description, fields, self.inputs)
        tags.update(self.extra_tags)
        return {k: str(v) for k, v in tags.items() if v is not None}

    # --------------------------------------------------------------------------- enter/exit
    def __enter__(self) -> StageRun:
        self.config.check_environment()
        if mlflow.get_tracking_uri() != self.tracking_uri:
            mlflow.set_tracking_uri(self.tracking_uri)
        if self.attach:
            self.run = self.client.get_run(self.attach)
            self.experiment_id = self.run.info.experiment_id
            self.experiment_name = self.client.get_experiment(self.experiment_id).name
            self._active = True
            return self
        tags = self.tags()
        launched = os.environ.get("MLFLOW_RUN_ID")
        if launched:
            # `mlflow run` stored its -P values as this run's params before the stage started: if
            # they hold protected text, the run is purged from the store, not only refused
            purge_if_protected(launched, self.guard, tracking_uri=self.tracking_uri, root=self.root, launched=True)
        self.guard.check_mapping(tags, "tag")
        self.guard.check_mapping(self.params, "param")
        self.experiment_name = experiment_for_corpus(self.corpus, tracking_uri=self.tracking_uri)
        self.experiment_id = _experiment_id(self.client, self.experiment_name) or ""
        elsewhere = None
        if launched and self.client.get_run(launched).info.experiment_id != self.experiment_id:
            # `mlflow run` without --experiment-name mistill/<corpus>: the work goes to the corpus's
            # experiment, where the report and the next steps look for it
            elsewhere, launched = launched, None
            os.environ.pop("MLFLOW_RUN_ID", None)

        previous: Run | None = None
        gen = 0
        if self.resume:
            kind, found, gen = self._acquire()
            if kind == "reuse":
                self.run, self.reused = found, True
                self._delegate(launched or elsewhere, found.info.run_id)
                return self
            previous = found

        nested = mlflow.active_run() is not None
        lease = lease_tags(self.owner, gen, self.lease_settings)
        metrics = _system_metrics_available() if self.system_metrics else self.system_metrics
        name = self.run_name
        if previous is not None:
            self._delegate(launched, previous.info.run_id)
            self.client.log_batch(previous.info.run_id, tags=[RunTag(k, v) for k, v in lease.items()])
            active = mlflow.start_run(run_id=previous.info.run_id, run_name=name, nested=nested,
                                      log_system_metrics=metrics)
            self.resumed = True
        elif launched:
            self.client.log_batch(launched, tags=[RunTag(k, v) for k, v in lease.items()])
            active = mlflow.start_run(run_id=launched, run_name=name, nested=nested,
                                      log_system_metrics=metrics)
        else:
            active = mlflow.start_run(experiment_id=self.experiment_id, run_name=name,
                                      nested=nested, tags=lease, log_system_metrics=metrics)
        if elsewhere is not None:
            self._delegate(elsewhere, active.info.run_id)
        self._active = True
        self._signals = _SignalTrap.install()
        self._heartbeat = Heartbeat(self.client, active.info.run_id, self.owner,
                                    self.lease_settings).start()
        try:
            parent = self._parent_run(active.info.run_id)
            if parent is not None:
                tags = {**tags, TAG_PARENT_RUN: parent}
            self._log_batch(tags=tags)
            # a resumed run, or one launched by `mlflow run` (which logged the entry point's
            # parameters itself, as strings): keep what is there; config.json has the typed values
            existing = active.data.params if (self.resumed or launched) else {}
            self._log_batch(params={k: v for k, v in self.shown_params().items() if k not in existing})
            self.run = self.client.get_run(active.info.run_id)
            self.work_dir.mkdir(parents=True, exist_ok=True)
            cfg_path = self.config.save(
                self.work_dir / CONFIG_ARTIFACT, stage=self.stage, entry_point=self.entry_point,
                corpus=self.corpus, privacy=self.guard.level, inputs=self.inputs,
                content_sha256=self.content_sha256, code_version=self.code_version,
                git_commit=self.git_commit, params_digest=self.params_digest, run_id=self.run_id,
                **self.record)
            self.log_artifact_file(cfg_path)
        except BaseException as exc:
            if is_unreachable(exc):
                self._abandon(exc)
            self._end("FAILED")
            raise
        return self

    def _acquire(self) -> tuple[str, Run | None, int]:
        """Find or claim the run this stage works in, waiting while another process holds it.

        Returns ``("reuse", run, 0)`` for an identical FINISHED run, ``("resume", run, g)`` for a
        resumable run whose lease this process took at generation ``g``, or ``("new", None, 0)``
        when this process claimed the creation of the run. An identical run under a live lease
        (another process works on it, or is creating it) is waited for, or refused
        (:class:`~mistill.tracking.lease.LeaseSettings`).
        """
        settings = self.lease_settings
        key = identity_key(self.experiment_id, self.entry_point, self.params_digest, self.code_version,
                           self.inputs)
        waited_since: float | None = None
        while True:
            found = find_run(self.experiment_name, self.entry_point, self.params, self.code_version,
                             self.inputs, "FINISHED", tracking_uri=self.tracking_uri)
            if found is not None:
                return "reuse", found, 0
            previous = find_run(self.experiment_name, self.entry_point, self.params, self.code_version,
                                self.inputs, RESUMABLE_STATUSES, tracking_uri=self.tracking_uri)
            if previous is not None:
                if not lease_held(previous, settings):
                    gen = generation(previous) + 1
                    if claim(self.client, f"{previous.info.run_id}/{gen}"):
                        return "resume", previous, gen
                holder = (f"run {previous.info.run_id} "
                          f"({describe_owner(previous.data.tags.get(TAG_LEASE_OWNER, ''))})")
            elif claim_new_run(self.client, key, settings):
                return "new", None, 0
            else:
                holder = "another process that is creating it"
            message = (f"{self.stage}: an identical run is being worked on by {holder}")
            if settings.on_busy == "refuse":
                raise LeaseError(f"{message}; refusing ({ENV_ON_BUSY}=refuse). Wait for it to "
                                 f"finish, or rerun with {ENV_ON_BUSY}=wait to reuse its result")
            now = time.time()
            if waited_since is None:
                waited_since = now
                _log.warning("%s; waiting for it to finish", message)
            elif settings.wait_max_s and now - waited_since > settings.wait_max_s:
                raise LeaseError(f"{message}; gave up after {settings.wait_max_s:g} s "
                                 f"({ENV_WAIT_MAX})")
            time.sleep(settings.poll_s)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self.reused or not self._active:
            return False
        if self.attach:  # the run's owner ends it
            self._active = False
            return False
        if exc is not None and is_unreachable(exc):
            self._abandon(exc)
        ok = exc_type is None or (exc_type is SystemExit and exc.code in (0, None))
        killed = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        self._end("FINISHED" if ok else "KILLED" if killed else "FAILED")
        return False

    def _abandon(self, exc: BaseException) -> None:
        """The server is gone: leave the run as it is (no more calls, each would wait out the
        client's bound), and raise the clear error naming the run a rerun resumes."""
        self._active = False
        self._release_signals()
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.stop(wait=False)
        run_id = self.run.info.run_id if self.run is not None else None
        active = mlflow.active_run()
        run_id = run_id or (active.info.run_id if active is not None else None)
        if run_id is not None:
            _stop_system_metrics(run_id, flush=False)
            _pop_fluent_run(run_id)
        raise unavailable_error(exc, uri=self.tracking_uri, run_id=run_id) from exc

    def _end(self, status: str) -> None:
        """End the run with ``status`` unless this process lost its lease, or the run is already
        FINISHED in the store: a FINISHED run's status never changes."""
        self._active = False
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.stop()
        run_id = self.run.info.run_id if self.run is not None else None
        active = mlflow.active_run()
        if run_id is None and active is not None:
            run_id = active.info.run_id
        if run_id is None:
            self._release_signals()
            return
        try:
            keep = heartbeat is not None and not heartbeat.still_owner()
            if not keep and status != "FINISHED":
                keep = self.client.get_run(run_id).info.status == "FINISHED"
            with quiet_run_links():
                if active is not None and active.info.run_id == run_id and not keep:
                    mlflow.end_run(status)
                elif not keep:
                    self.client.set_terminated(run_id, status)
            if not keep:
                _log.info("View run %s (%s) at: %s", self.run_name, status, self.run_url(run_id))
            if self.run is not None:
                self.run = self.client.get_run(run_id)
        except Exception as exc:  # noqa: BLE001 - never mask the error that ended the stage
            if status == "FINISHED" or is_unreachable(exc):
                raise
            warnings.warn(f"could not end run {run_id} as {status} ({type(exc).__name__}: {exc}); "
                          f"its lease lapses and a rerun resumes it", RuntimeWarning, stacklevel=2)
        finally:
            _stop_system_metrics(run_id)
            _pop_fluent_run(run_id)
            self._release_signals()

    def _release_signals(self) -> None:
        trap, self._signals = self._signals, None
        if trap is not None:
            trap.restore()

    def run_url(self, run_id: str | None = None) -> str:
        """The run's page in the MLflow UI."""
        return run_url(self.tracking_uri, self.experiment_id, run_id or self.run_id)

    def _delegate(self, launched: str | None, target: str) -> None:
        """A run launched by ``mlflow run`` whose work lives in ``target``: point it there and
        have it deleted once ``mlflow run`` has ended it (:mod:`mistill.tracking.reaper`), so one
        ``mlflow run`` leaves one run."""
        if launched and launched != target:
            with _tolerate_mlflow_errors():
                self.client.set_tag(launched, TAG_DELEGATED_TO, target)
                spawn_reaper(launched, self.tracking_uri)
            os.environ.pop("MLFLOW_RUN_ID", None)

    def _require_active(self) -> None:
        if self.reused:
            raise RuntimeError(f"run {self.run_id} was reused (FINISHED): it is not written to")
        if not self._active:
            raise RuntimeError("StageRun is not active (use it as a context manager)")
        if self._heartbeat is not None and self._heartbeat.lost:
            raise LeaseError(f"run {self.run_id} was taken over by another process (this one was "
                             f"presumed dead): stopping without writing to it")


# --------------------------------------------------------------------------- system metrics
def system_metrics_wanted(stage: str, requested: bool | None = None) -> bool:
    """Whether a run of ``stage`` logs MLflow's system metrics (CPU and GPU utilisation and
    memory, every 10 s under ``system/``).

    ``$MISTILL_SYSTEM_METRICS``: ``0`` turns them off for every stage, ``1`` on for every
    stage; unset, ``requested`` decides, else whether ``stage`` is one of
    :data:`SYSTEM_METRICS_STAGES`.
    """
    switch = os.environ.get(ENV_SYSTEM_METRICS, "").strip().lower()
    if switch in ("0", "false", "no", "off"):
        return False
    if switch in ("1", "true", "yes", "on"):
        return True
    return requested if requested is not None else stage in SYSTEM_METRICS_STAGES


_PSUTIL_WARNED = False


def _system_metrics_available() -> bool:
    """psutil is what MLflow samples with: without it, warn once and log no system metrics.
    MLflow's own monitor messages (started, stopped, no GPU found) are kept to warnings."""
    global _PSUTIL_WARNED

    if importlib.util.find_spec("psutil") is None:
        if not _PSUTIL_WARNED:
            _PSUTIL_WARNED = True
            _log.warning("psutil is not installed: no system metrics are logged (install psutil, "
                         "or set %s=0 to silence this)", ENV_SYSTEM_METRICS)
        return False
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    return True


def _stop_system_metrics(run_id: str, *, flush: bool = True) -> None:
    """Stop the system-metrics monitor of ``run_id`` if one still runs (a run ended through the
    client, or left because the server is gone: ``flush=False`` sends nothing more)."""
    monitor = fluent.run_id_to_system_metrics_monitor.pop(run_id, None)
    if monitor is None:
        return
    if flush:
        monitor.finish()
    else:
        monitor._shutdown_event.set()


# ----------------------------------------------------------------------------- interruption
class StageInterrupted(KeyboardInterrupt):
    """SIGTERM reached a process while a stage run was open: the run ends KILLED, and a
    launcher waiting on a child (``mlflow run``) cancels it as it would on Ctrl-C."""


class _SignalTrap:
    """SIGTERM raised as :class:`StageInterrupted` in the main thread while a run is open, so
    the run ends KILLED instead of staying RUNNING. Installed only where SIGTERM still has its
    default action (an outer run's trap, or an application's own handler, is kept)."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise StageInterrupted(f"stopped by {signal.Signals(signum).name}")

    @classmethod
    def install(cls) -> _SignalTrap | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return None
            return cls(signal.signal(signal.SIGTERM, cls._raise))
        except (ValueError, OSError):  # no signals here (an embedded interpreter)
            return None

    def restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signal.SIGTERM, self.previous)


def _pop_fluent_run(run_id: str) -> None:
    """Leave MLflow's fluent active-run stack without ending the run in the store (MLflow has
    no public call for that: ``mlflow.end_run`` always sets a status)."""
    stack = fluent._active_run_stack.get()
    if stack and stack[-1].info.run_id == run_id:
        stack.pop()
    if os.environ.get("MLFLOW_RUN_ID") == run_id:
        os.environ.pop("MLFLOW_RUN_ID", None)


__all__ = ["StageRun", "StageInterrupted", "SYSTEM_METRICS_STAGES", "system_metrics_wanted"]
