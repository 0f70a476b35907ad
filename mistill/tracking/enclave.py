"""The local enclave: per-note files of a restricted corpus that never leave the machine.

* Per-note files that are model text of a restricted corpus (token ids or per-position
  distributions of a note or trace, generated text) are *local files*: kept in the run's enclave
  ``<work>/enclave/<subdir>/<note_id>/`` on the machine that ran it (tag ``mistill.enclave_dir``),
  recorded with their sha256 in ``_DONE`` (key ``local_files``), never uploaded
  (:meth:`mistill.tracking.runs.StageRun.write_note`).
* Read back, a local file is checked against that sha256 (:func:`verify_local_note_file`); one
  absent from this machine is an error that names the run (:func:`enclave_missing_error`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mistill.errors import MistillInputError
from mistill.io import sha256_file
from mistill.tracking.naming import DONE_MARKER, _check_component

TAG_ENCLAVE_DIR = "mistill.enclave_dir"
"""Where a run keeps its local files: ``<work>/enclave`` on the machine that ran it (a path)."""
ENCLAVE_DIR = "enclave"
LOCAL_FILES_KEY = "local_files"
"""The key of ``_DONE`` that lists a note's local files (name -> sha256)."""



def _local_entries(done: Any) -> dict[str, str]:
    """A ``_DONE`` record's local files (name -> sha256); empty when it has none."""
    entries = done.get(LOCAL_FILES_KEY) if isinstance(done, Mapping) else None
    return dict(entries) if isinstance(entries, Mapping) else {}


def verify_local_note_file(path: Path, done: Mapping[str, Any], *, run_id: str, subdir: str,
                           note_id: str) -> None:
    """Check one local (enclave) file against the sha256 its note's ``_DONE`` recorded under
    ``local_files``.

    Raises:
        MistillInputError: the file is not a recorded local file, or its content changed after
            the note finished (names the run, the note and the file).
    """
    where = f"{subdir}/{note_id}/{path.name}"
    want = _local_entries(done).get(path.name)
    if want is None:
        raise MistillInputError(f"run {run_id}: {where} is not a local file of the note's "
                                f"{DONE_MARKER} marker", file=path.name, note=note_id, field=subdir)
    check_finished_digest(path, want, run_id=run_id, where=where, note_id=note_id, subdir=subdir, kind="local file")


def check_finished_digest(path: Path, want: str, *, run_id: str, where: str, note_id: str, subdir: str,
                          kind: str) -> None:
    """Refuse ``path`` (a note's ``kind`` file, ``where`` in run ``run_id``) unless its sha256 is
    ``want``, the digest its ``_DONE`` marker recorded when the note finished."""
    got = sha256_file(path)
    if got != want:
        raise MistillInputError(
            f"run {run_id}: the {kind} {where} does not match the sha256 recorded when the note finished "
            f"(recorded {want[:16]}, found {got[:16]}): it was changed afterwards",
            file=path.name, note=note_id, field=subdir)


def enclave_missing_error(run_id: str, subdir: str, note_id: str, filename: str,
                          looked: Iterable[Path]) -> MistillInputError:
    """The error for a local file absent from this machine: it is restricted model text, kept
    only in the enclave of the machine that ran the run, never in MLflow."""
    where = ", ".join(str(p) for p in looked)
    return MistillInputError(
        f"run {run_id}: {subdir}/{note_id}/{filename} is restricted model text kept only in the "
        f"local enclave of the machine that ran run {run_id} (not found in {where}); it is never "
        f"stored in MLflow: run this stage on that machine", file=filename, note=note_id,
        field=subdir)


class EnclaveFiles:
    """The enclave side of :class:`~mistill.tracking.runs.StageRun` (mixed into it: uses its
    ``work_dir``, ``run`` and ``set_tags``)."""

    @property
    def enclave_dir(self) -> Path:
        """The run's local enclave ``<work>/enclave/`` (absolute): the per-note files that are
        model text of a restricted corpus, kept only on this machine (see
        :meth:`~mistill.tracking.runs.StageRun.write_note`)."""
        return (self.work_dir / ENCLAVE_DIR).resolve()

    def enclave_note_dir(self, subdir: str, note_id: str) -> Path:
        """Local dir ``<work>/enclave/<subdir>/<note_id>/`` of one note's local files."""
        return self.enclave_dir / _check_component(subdir, "subdir") / _check_component(
            str(note_id), "note_id")

    def _tag_enclave(self) -> None:
        """Tag the run once with its enclave dir (a path on this machine, no text)."""
        value = str(self.enclave_dir)
        if getattr(self, "_enclave_tagged", None) == value:
            return
        if self.run is None or self.run.data.tags.get(TAG_ENCLAVE_DIR) != value:
            self.set_tags({TAG_ENCLAVE_DIR: value})
        self._enclave_tagged = value


__all__ = ["TAG_ENCLAVE_DIR", "ENCLAVE_DIR", "LOCAL_FILES_KEY", "verify_local_note_file", "enclave_missing_error",
           "EnclaveFiles"]
