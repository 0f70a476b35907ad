"""Per-note files and resume: what a run finished, note by note, survives a crash.

* Per-note artifacts live under ``<subdir>/<note_id>/`` with a ``_DONE`` marker written (and
  uploaded) last, so a resumed run skips exactly the finished notes and loses none. ``_DONE``
  records the sha256 of each file and is signed with the store's key (HMAC-SHA256 over the
  record, the run, the subdir and the note, :func:`mistill.tracking.auth.sign_done`); a marker
  whose signature does not verify is refused wherever it is read.
* A note finished locally whose upload a crash cut short is uploaded when the resumed run lists
  its finished notes (:meth:`NoteFiles.finished_notes`).
* A note's local files (model text of a restricted corpus) stay in the run's enclave
  (:mod:`mistill.tracking.enclave`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException

from mistill.errors import MistillInputError
from mistill.io import read_json, sha256_file, write_bytes, write_json, write_text
from mistill.tracking.auth import sign_done, verify_done
from mistill.tracking.connection import is_unreachable
from mistill.tracking.enclave import (ENCLAVE_DIR, LOCAL_FILES_KEY, _local_entries, check_finished_digest,
                                      enclave_missing_error, verify_local_note_file)
from mistill.tracking.experiments import quiet_downloads
from mistill.tracking.naming import DONE_MARKER, _check_component

_UPLOADED_MARKER = ".uploaded"  # local only: the note's files and _DONE reached the store


class NoteFiles:
    """The per-note files of :class:`~mistill.tracking.runs.StageRun` (mixed into it: uses its
    ``client``, ``guard``, ``run_id``, ``work_dir``, its enclave and ``_require_active``)."""

    # ----------------------------------------------------------------------- per-note files
    def note_dir(self, subdir: str, note_id: str) -> Path:
        """Local dir ``<work>/<subdir>/<note_id>/``."""
        return self.work_dir / _check_component(subdir, "subdir") / _check_component(
            str(note_id), "note_id")

    def note_artifact_path(self, subdir: str, note_id: str, filename: str) -> Path:
        """Local path of one per-note file (parent dirs created)."""
        path = self.note_dir(subdir, note_id) / _check_component(filename, "filename")
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def write_note(self, subdir: str, note_id: str, files: Mapping[str, bytes | str | Any], *,
                   local_files: Mapping[str, bytes | str | Any] | None = None) -> None:
        """Write one note's files atomically, then ``_DONE``, then upload them (``_DONE`` last).

        Values: ``bytes`` written as is, ``str`` as UTF-8, anything else as JSON. Every file is
        checked by the privacy guard before anything is uploaded; on refusal the note's local
        files are removed and :class:`PrivacyError` is raised.

        ``local_files`` (same value types) are model text of a restricted corpus: written
        atomically under the run's enclave ``<work>/enclave/<subdir>/<note_id>/``, recorded in
        ``_DONE`` with their sha256 (key ``local_files``), never uploaded nor passed to MLflow.
        The first note with local files tags the run with its enclave dir
        (``mistill.enclave_dir``). :meth:`load_note` and
        :meth:`mistill.stages.common.RunReader.note_file` read them back, checked.
        """
        self._require_active()
        local_files = dict(local_files or {})
        _check_note_filenames(subdir, str(note_id), files, local_files)
        note_dir = self.note_dir(subdir, note_id)
        enclave_dir = self.enclave_note_dir(subdir, note_id)
        written: list[Path] = []
        kept: list[Path] = []
        try:
            for filename, content in local_files.items():  # first: a note never ends half local
                path = enclave_dir / _check_component(filename, "filename")
                _write_note_content(path, content)
                kept.append(path)
            for filename, content in files.items():
                path = self.note_artifact_path(subdir, note_id, filename)
                _write_note_content(path, content)
                written.append(path)
                self.guard.check_file(path)
            if kept:
                self._tag_enclave()
        except BaseException:
            shutil.rmtree(note_dir, ignore_errors=True)
            shutil.rmtree(enclave_dir, ignore_errors=True)
            raise
        done: dict[str, Any] = {"files": {p.name: sha256_file(p) for p in written}}
        if kept:
            done[LOCAL_FILES_KEY] = {p.name: sha256_file(p) for p in kept}
        done["time"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        done = sign_done(done, run_id=self.run_id, subdir=subdir, note_id=str(note_id))
        write_json(note_dir / DONE_MARKER, done)
        self._upload_note(subdir, str(note_id))

    def _note_done(self, subdir: str, note_id: str, filename: str) -> dict[str, Any]:
        """One note's ``_DONE`` record: the local copy, else downloaded from the run's artifacts."""
        done_path = self.note_dir(subdir, note_id) / DONE_MARKER
        self._fetch_note_file(subdir, note_id, DONE_MARKER, done_path,
                              f"run {self.run_id}: note has no {DONE_MARKER} marker", filename)
        return verify_done(read_json(done_path), run_id=self.run_id, subdir=subdir,
                           note_id=str(note_id))

    def _fetch_note_file(self, subdir: str, note_id: str, name: str, path: Path, missing: str,
                         filename: str) -> None:
        """Download ``<subdir>/<note_id>/<name>`` of this run to ``path`` unless it is there."""
        if path.is_file():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".dl-") as tmp, quiet_downloads():
            try:
                got = self.client.download_artifacts(self.run_id, f"{subdir}/{note_id}/{name}", tmp)
            except (MlflowException, OSError) as exc:
                if is_unreachable(exc):
                    raise
                raise MistillInputError(missing, file=filename, note=str(note_id), field=subdir) from None
            os.replace(got, path)

    def _upload_note(self, subdir: str, note_id: str) -> None:
        """Upload a finished note's files, ``_DONE`` last; its local files (named under
        ``local_files`` in ``_DONE``, kept in the enclave) are never uploaded, even if a copy
        sits beside the others."""
        note_dir = self.note_dir(subdir, note_id)
        artifact_dir = f"{subdir}/{note_id}"
        local = set(_local_entries(verify_done(read_json(note_dir / DONE_MARKER), run_id=self.run_id,
                                               subdir=subdir, note_id=str(note_id))))
        for path in sorted(note_dir.iterdir()):
            if path.is_file() and not path.name.startswith(".") and path.name != DONE_MARKER \
                    and path.name not in local:
                self.client.log_artifact(self.run_id, str(path), artifact_dir)
        self.client.log_artifact(self.run_id, str(note_dir / DONE_MARKER), artifact_dir)
        write_text(note_dir / _UPLOADED_MARKER, "")

    def finished_notes(self, subdir: str) -> set[str]:
        """Notes with a ``_DONE`` marker locally or in the run's artifact store.

        Notes finished locally whose upload was interrupted are uploaded now, so the store ends
        up complete.
        """
        local_root = self.work_dir / _check_component(subdir, "subdir")
        done: set[str] = set()
        if local_root.is_dir():
            for note_dir in local_root.iterdir():
                if (note_dir / DONE_MARKER).is_file():
                    # a local marker decides that the note is skipped: it must be this store's
                    verify_done(read_json(note_dir / DONE_MARKER), run_id=self.run_id,
                                subdir=subdir, note_id=note_dir.name)
                    done.add(note_dir.name)
                    if not self.reused and self._active and \
                            not (note_dir / _UPLOADED_MARKER).exists():
                        self._upload_note(subdir, note_dir.name)
        for info in self.client.list_artifacts(self.run_id, subdir):
            note_id = info.path.rsplit("/", 1)[-1]
            if not info.is_dir or note_id in done:
                continue
            names = {f.path.rsplit("/", 1)[-1] for f in self.client.list_artifacts(
                self.run_id, info.path)}
            if DONE_MARKER in names:
                done.add(note_id)
        return done

    def load_note(self, subdir: str, note_id: str, filename: str) -> Any:
        """One per-note file, read locally or downloaded from the run's artifacts.

        A local file (``local_files`` of :meth:`write_note`) is read from the run's enclave on
        this machine, never downloaded; absent, it is an error naming the run. Every file is
        checked against the sha256 the note's ``_DONE`` recorded. ``.json`` files are parsed;
        anything else is returned as bytes.
        """
        _check_component(filename, "filename")
        done = self._note_done(subdir, str(note_id), filename)
        if filename in _local_entries(done):
            path = self.enclave_note_dir(subdir, note_id) / filename
            if not path.is_file():
                raise enclave_missing_error(self.run_id, subdir, str(note_id), filename, [path.parent])
            verify_local_note_file(path, done, run_id=self.run_id, subdir=subdir, note_id=str(note_id))
        else:
            path = self.note_dir(subdir, note_id) / filename
            self._fetch_note_file(subdir, str(note_id), filename, path, "per-note artifact not found", filename)
            verify_note_file(path, done, run_id=self.run_id, subdir=subdir, note_id=str(note_id))
        if path.suffix == ".json":
            return read_json(path)
        return path.read_bytes()


def verify_note_file(path: Path, done: Mapping[str, Any], *, run_id: str, subdir: str, note_id: str) -> None:
    """Check one per-note file against the sha256 its note's ``_DONE`` marker recorded.

    Raises:
        MistillInputError: the file is not listed in ``_DONE``, or its content changed after the
            note finished (names the run, the note and the file).
    """
    where = f"{subdir}/{note_id}/{path.name}"
    files = done.get("files") if isinstance(done, Mapping) else None
    want = files.get(path.name) if isinstance(files, Mapping) else None
    if want is None:
        raise MistillInputError(f"run {run_id}: {where} is not listed in the note's {DONE_MARKER} marker",
                                file=path.name, note=note_id, field=subdir)
    check_finished_digest(path, want, run_id=run_id, where=where, note_id=note_id, subdir=subdir, kind="artifact")


def _write_note_content(path: Path, content: bytes | str | Any) -> None:
    """Write one per-note file atomically: bytes as is, str as UTF-8, anything else as JSON."""
    if isinstance(content, bytes):
        write_bytes(path, content)
    elif isinstance(content, str):
        write_text(path, content)
    else:
        write_json(path, content)


def _check_note_filenames(subdir: str, note_id: str, files: Mapping[str, Any],
                          local_files: Mapping[str, Any]) -> None:
    """Refuse ``_DONE`` as a file name, a name both uploaded and local, and ``enclave`` as a
    subdir (it would nest the uploaded note dirs inside the enclave)."""
    if DONE_MARKER in files or DONE_MARKER in local_files:
        raise MistillInputError(f"{DONE_MARKER} is reserved", note=note_id, field="filename")
    both = sorted(set(files) & set(local_files))
    if both:
        raise MistillInputError(f"{both[0]} is given both as an uploaded and as a local file",
                                note=note_id, field="filename")
    if subdir == ENCLAVE_DIR:
        raise MistillInputError(f"subdir {ENCLAVE_DIR!r} is reserved for the local enclave",
                                note=note_id, field="subdir")


__all__ = ["DONE_MARKER", "NoteFiles", "verify_note_file"]
