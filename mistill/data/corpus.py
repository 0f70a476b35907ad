"""Notes and corpora: strict JSONL, the Edin et al. (2023) MIMIC-IV ICD-10 loader, and the
characterization-corpus selection of App. A ("Characterization corpus").

A :class:`Corpus` carries a privacy tag: ``"synthetic"`` and ``"public"`` corpora may have note
and trace text logged; ``"restricted"`` ones (MIMIC under its data use agreement, the default
for anything loaded from disk) never leave the machine as text.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mistill.data.inventory import Inventory, icd10_block, undecodable_byte
from mistill.errors import MistillInputError
from mistill.io import is_safe_name, iter_jsonl, write_jsonl

__all__ = [
    "Note",
    "Corpus",
    "PRIVACY_LEVELS",
    "THINK_CLOSE",
    "load_mimic_edin",
    "find_discharge_diagnosis",
    "word_count",
    "eligible",
    "code_count",
    "stratum_thresholds",
    "select_stratified",
    "with_trace",
    "safe_path_component",
]

PRIVACY_LEVELS = ("synthetic", "public", "restricted")
THINK_CLOSE = "</think>"
_REQUIRED = ("note_id", "patient_id", "split", "text", "gold_codes")


@dataclass(frozen=True)
class Note:
    """One discharge summary and its gold diagnosis codes.

    gold_codes: dotted inventory codes, de-duplicated, in the source's order.
    teacher_trace: the teacher's generation (``<think>...</think>`` then the answer), if stored.
    discharge_diagnosis: the exact text of the note's discharge-diagnosis section (a substring
        of ``text``) when known; the prompt builder removes it (App. A).
    meta: free-form provenance (source ids, counts); not part of the digest.
    shortlist: the retrieved candidate codes the prompt lists for this note, in prompt order
        (App. A, :mod:`mistill.data.shortlist`); None lists the whole inventory.
    """

    note_id: str
    patient_id: str
    split: str
    text: str
    gold_codes: tuple[str, ...]
    teacher_trace: str | None = None
    discharge_diagnosis: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    shortlist: tuple[str, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "note_id": self.note_id,
            "patient_id": self.patient_id,
            "split": self.split,
            "text": self.text,
            "gold_codes": list(self.gold_codes),
        }
        if self.teacher_trace is not None:
            row["teacher_trace"] = self.teacher_trace
        if self.discharge_diagnosis is not None:
            row["discharge_diagnosis"] = self.discharge_diagnosis
        if self.meta:
            row["meta"] = dict(self.meta)
        if self.shortlist is not None:
            row["shortlist"] = list(self.shortlist)
        return row


def safe_path_component(value: str) -> bool:
    """Whether ``value`` may name a per-note artifact folder (``notes/<note_id>/``) or a corpus:
    the tracking layer's path-component rule (letters, digits, ``_``, ``.``, ``-``; not starting
    with ``.``), applied to the whole string, so a trailing newline fails too."""
    return is_safe_name(value)


def _check_note(row: Mapping[str, Any], inventory: Inventory, *, file: str | None = None,
                line: int | None = None) -> Note:
    """Validate one record and build a :class:`Note` (gold codes normalised via the inventory)."""
    raw_id = row.get("note_id")
    note = str(raw_id) if raw_id is not None else None

    def fail(msg: str, fld: str) -> MistillInputError:
        return MistillInputError(msg, file=file, line=line, note=note, field=fld)

    for key in _REQUIRED:
        if key not in row or row[key] is None:
            raise fail("missing field", key)
    for key in ("note_id", "patient_id"):
        v = row[key]
        if isinstance(v, bool) or not isinstance(v, (str, int)) or str(v).strip() == "":
            raise fail("must be a non-empty string (or integer id)", key)
    if not safe_path_component(note):
        raise fail(f"note id {note!r} cannot name the note's artifact folder: use letters, digits, "
                   f"'_', '.' and '-', not starting with '.'", "note_id")
    if not isinstance(row["split"], str) or not row["split"].strip():
        raise fail("must be a non-empty string", "split")
    if not isinstance(row["text"], str) or not row["text"].strip():
        raise fail("must be a non-empty string", "text")
    gold = row["gold_codes"]
    if isinstance(gold, str) or not isinstance(gold, (list, tuple)):
        raise fail("must be a list of code strings", "gold_codes")
    if not gold:
        raise fail("empty gold code list", "gold_codes")
    codes: list[str] = []
    for c in gold:
        if not isinstance(c, str):
            raise fail(f"gold code {c!r} is not a string", "gold_codes")
        if c not in inventory:
            raise fail(f"gold code {c!r} is not in the inventory ({len(inventory)} codes)",
                       "gold_codes")
        dotted = inventory.normalize(c)
        if dotted not in codes:
            codes.append(dotted)
    trace = row.get("teacher_trace")
    if trace is not None:
        if not isinstance(trace, str):
            raise fail("must be a string", "teacher_trace")
        if THINK_CLOSE not in trace:
            raise fail(f"reasoning block not closed (no {THINK_CLOSE})", "teacher_trace")
    dd = row.get("discharge_diagnosis")
    if dd is not None:
        if not isinstance(dd, str) or not dd.strip():
            raise fail("must be a non-empty string", "discharge_diagnosis")
        if dd not in row["text"]:
            raise fail("is not a substring of the note text", "discharge_diagnosis")
    meta = row.get("meta") or {}
    if not isinstance(meta, Mapping):
        raise fail("must be an object", "meta")
    shortlist = _check_shortlist(row.get("shortlist"), inventory, fail)
    return Note(note_id=str(raw_id), patient_id=str(row["patient_id"]), split=row["split"],
                text=row["text"], gold_codes=tuple(codes), teacher_trace=trace,
                discharge_diagnosis=dd, meta=dict(meta), shortlist=shortlist)


def _check_shortlist(value: Any, inventory: Inventory,
                     fail: Callable[[str, str], MistillInputError]) -> tuple[str, ...] | None:
    """A note's shortlist: absent, or a non-empty list of distinct inventory codes (dotted)."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise fail("must be a list of code strings", "shortlist")
    if not value:
        raise fail("empty shortlist", "shortlist")
    out: list[str] = []
    seen: set[str] = set()
    for c in value:
        if not isinstance(c, str):
            raise fail(f"shortlist code {c!r} is not a string", "shortlist")
        if c not in inventory:
            raise fail(f"shortlist code {c!r} is not in the inventory ({len(inventory)} codes)",
                       "shortlist")
        dotted = inventory.normalize(c)
        if dotted in seen:
            raise fail(f"shortlist names {dotted!r} twice", "shortlist")
        seen.add(dotted)
        out.append(dotted)
    return tuple(out)


@dataclass(frozen=True, eq=False)
class Corpus:
    """A named list of notes with a privacy tag and the inventory their codes belong to.

    privacy: ``"synthetic" | "public" | "restricted"``; only the first two may have text logged.
    Construction validates every note (unique ids, codes in the inventory, closed traces).
    """

    name: str
    privacy: str
    notes: list[Note]
    inventory: Inventory
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.privacy not in PRIVACY_LEVELS:
            raise MistillInputError(f"privacy must be one of {PRIVACY_LEVELS}, got "
                                    f"{self.privacy!r}", field="privacy")
        notes: list[Note] = []
        seen: set[str] = set()
        for n in self.notes:
            if not isinstance(n, Note):
                raise TypeError(f"Corpus.notes holds {type(n).__name__}, not Note")
            if n.note_id in seen:
                raise MistillInputError("duplicate note id", note=n.note_id, field="note_id")
            seen.add(n.note_id)
            # Re-check the invariants a hand-built Note could break; gold codes come out
            # normalised (dotted, de-duplicated), so keep the checked note when they differ.
            checked = _check_note(n.to_dict(), self.inventory)
            same = checked.gold_codes == n.gold_codes and checked.shortlist == n.shortlist
            notes.append(n if same else replace(n, gold_codes=checked.gold_codes,
                                                 shortlist=checked.shortlist))
        object.__setattr__(self, "notes", notes)

    # -- access -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.notes)

    def __iter__(self) -> Iterator[Note]:
        return iter(self.notes)

    @property
    def by_id(self) -> dict[str, Note]:
        return {n.note_id: n for n in self.notes}

    @property
    def splits(self) -> tuple[str, ...]:
        """Split names present, in order of first appearance."""
        return tuple(dict.fromkeys(n.split for n in self.notes))

    def split(self, name: str) -> "Corpus":
        """The notes of one split, as a corpus with the same name, privacy and inventory."""
        return Corpus(name=self.name, privacy=self.privacy, inventory=self.inventory,
                      notes=[n for n in self.notes if n.split == name], meta=self.meta)

    def subset(self, note_ids: Iterable[str]) -> "Corpus":
        """The named notes, in the order given; an unknown id raises."""
        index = self.by_id
        out = []
        for nid in note_ids:
            if nid not in index:
                raise MistillInputError("no such note in the corpus", note=str(nid),
                                        field="note_id")
            out.append(index[nid])
        return Corpus(name=self.name, privacy=self.privacy, inventory=self.inventory, notes=out,
                      meta=self.meta)

    @property
    def text_loggable(self) -> bool:
        """Whether note and trace text may go to MLflow (synthetic or public corpora only)."""
        return self.privacy in ("synthetic", "public")

    @property
    def digest(self) -> str:
        """sha256 over every note's id, patient, split, text, gold codes, trace and discharge-
        diagnosis section, and its shortlist when it has one, in corpus order (``meta``
        excluded). Stable across processes."""
        h = hashlib.sha256()
        for n in self.notes:
            rec = [n.note_id, n.patient_id, n.split, n.text, list(n.gold_codes),
                   n.teacher_trace, n.discharge_diagnosis]
            if n.shortlist is not None:
                rec.append(list(n.shortlist))
            h.update(json.dumps(rec, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
            h.update(b"\n")
        return h.hexdigest()

    def summary(self) -> dict[str, Any]:
        """Counts safe to log for any privacy level (no text)."""
        codes = [len(n.gold_codes) for n in self.notes]
        return {
            "name": self.name,
            "privacy": self.privacy,
            "n_notes": len(self.notes),
            "n_patients": len({n.patient_id for n in self.notes}),
            "splits": {s: sum(n.split == s for n in self.notes) for s in self.splits},
            "n_traces": sum(n.teacher_trace is not None for n in self.notes),
            "gold_codes_median": float(np.median(codes)) if codes else 0.0,
            "inventory_size": len(self.inventory),
            "inventory_digest": self.inventory.digest,
            "digest": self.digest,
        }

    # -- persistence --------------------------------------------------------------------------

    def to_jsonl(self, path: str | os.PathLike) -> Path:
        """Write one JSON object per note (atomic)."""
        return write_jsonl(path, (n.to_dict() for n in self.notes))

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike, *, name: str | None = None,
                   privacy: str = "restricted", inventory: Inventory | None = None) -> "Corpus":
        """Read a corpus strictly.

        Each line: ``note_id, patient_id, split, text, gold_codes`` and optionally
        ``teacher_trace``, ``discharge_diagnosis``, ``meta``, ``shortlist``. A byte that is not
        UTF-8, a malformed line, a missing field, a note id that cannot name a folder
        (:func:`safe_path_component`), an empty gold list, a code not in the inventory, a
        duplicate note id, a trace without ``</think>`` or a bad shortlist (not a list, empty, a
        code outside the inventory or named twice) raises :class:`MistillInputError` naming
        file, line, note and field.
        inventory: defaults to the full billable ICD-10-CM inventory (order seed 0).
        privacy: defaults to ``"restricted"`` (text never logged) - say so to relax it.
        """
        p = Path(path)
        inv = inventory if inventory is not None else Inventory.billable()
        if not p.exists():
            raise MistillInputError("file not found", file=str(p))
        _check_utf8_jsonl(p)
        notes: list[Note] = []
        seen: dict[str, int] = {}
        for lineno, row in iter_jsonl(p):
            note = _check_note(row, inv, file=str(p), line=lineno)
            if note.note_id in seen:
                raise MistillInputError(f"duplicate note id (first on line "
                                        f"{seen[note.note_id]})", file=str(p), line=lineno,
                                        note=note.note_id, field="note_id")
            seen[note.note_id] = lineno
            notes.append(note)
        if not notes:
            raise MistillInputError("corpus file holds no notes", file=str(p))
        return cls(name=name if name is not None else p.stem, privacy=privacy, notes=notes,
                   inventory=inv)


def _check_utf8_jsonl(path: Path) -> None:
    """Refuse a JSONL file holding a byte that is not UTF-8, naming the line and, when the line
    still parses, its note and the field whose value holds the byte."""
    with path.open(encoding="utf-8", errors="surrogateescape") as fh:
        for lineno, line in enumerate(fh, start=1):
            bad = undecodable_byte(line)
            if bad is None:
                continue
            note, fld = _locate_undecodable(line)
            raise MistillInputError(f"byte 0x{bad[0]:02X} at byte {bad[1]} of the line is not UTF-8",
                                    file=str(path), line=lineno, note=note, field=fld)


def _printable(text: str) -> str:
    """``text`` with its undecodable bytes written as ``\\xNN``."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _locate_undecodable(line: str) -> tuple[str | None, str | None]:
    """(note id, top-level field) of a JSONL line holding an undecodable byte, where known."""
    try:
        row = json.loads(line)
    except ValueError:
        return None, None
    if not isinstance(row, dict):
        return None, None
    raw_id = row.get("note_id")
    note = _printable(str(raw_id)) if isinstance(raw_id, (str, int)) else None
    for key, value in row.items():
        text = key + json.dumps(value, ensure_ascii=False)
        if undecodable_byte(text) is not None:
            return note, _printable(key)
    return note, None


# ---------------------------------------------------------------------------------------------
# MIMIC-IV ICD-10 (Edin et al., 2023 preprocessed release)
# ---------------------------------------------------------------------------------------------

# Headers that can follow the discharge-diagnosis section in MIMIC-IV discharge summaries. The
# Edin release is lower-cased with punctuation stripped, so the patterns ignore case and colons.
_DD_START = re.compile(r"(?i)\bdischarge\s+diagnos[ie]s\b:?")
_DD_END = re.compile(r"(?i)\b(discharge\s+condition|condition\s+at\s+discharge|"
                     r"discharge\s+instructions|followup\s+instructions|follow\s+up\s+instructions"
                     r"|discharge\s+disposition|discharge\s+medications|mental\s+status)\b")


def find_discharge_diagnosis(text: str) -> str | None:
    """The discharge-diagnosis section of a MIMIC-style summary, or None if not found.

    Heuristic: from the last "discharge diagnosis/diagnoses" header to the next of "discharge
    condition", "discharge instructions", "followup instructions", "discharge disposition",
    "discharge medications", "mental status" (or the end of the note). The returned text is an
    exact substring of ``text``, header included, surrounding whitespace excluded.
    """
    starts = list(_DD_START.finditer(text))
    if not starts:
        return None
    start = starts[-1].start()
    end_m = _DD_END.search(text, starts[-1].end())
    end = end_m.start() if end_m else len(text)
    section = text[start:end].rstrip()
    return section or None


def _parse_codes(value: Any, *, file: str, column: str, note: str) -> list[str]:
    """Codes from a list-like cell or a ``;``/``,``/whitespace-separated string."""
    if value is None:
        return []
    if isinstance(value, float) and np.isnan(value):
        return []
    if isinstance(value, str):
        parts = (c.strip("'\"") for c in re.split(r"[;,\s]+", value.strip().strip("[]")))
        return [c for c in parts if c]
    if isinstance(value, (list, tuple, np.ndarray)):
        out = []
        for c in list(value):
            if not isinstance(c, str):
                raise MistillInputError(f"code {c!r} is not a string", file=file, note=note,
                                        field=column)
            out.append(c)
        return out
    raise MistillInputError(f"cannot read codes from a {type(value).__name__} cell", file=file,
                            note=note, field=column)


def _check_utf8_csv(path: Path) -> None:
    """Refuse a CSV table (``.csv`` or gzipped ``.gz``) holding a byte that is not UTF-8, naming
    the line and, when the line splits into the header's cells, the column."""
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="surrogateescape", newline="") as fh:
        header: list[str] = []
        for lineno, line in enumerate(fh, start=1):
            bad = undecodable_byte(line)
            if bad is None:
                if lineno == 1:
                    header = next(csv.reader([line]), [])
                continue
            cells = next(csv.reader([line]), [])
            column = None
            if lineno > 1 and len(cells) == len(header):
                column = next((h for h, c in zip(header, cells) if undecodable_byte(c) is not None), None)
            raise MistillInputError(f"byte 0x{bad[0]:02X} at byte {bad[1]} of the line is not UTF-8",
                                    file=str(path), line=lineno, field=column)


def _read_table(path: Path):
    import pandas as pd  # deferred: pandas is slow to import

    if not path.exists():
        raise MistillInputError("file not found", file=str(path))
    suffix = path.suffix.lower()
    if suffix in (".csv", ".gz"):
        _check_utf8_csv(path)
    try:
        if suffix == ".feather":
            return pd.read_feather(path)
        if suffix in (".parquet", ".pq"):
            return pd.read_parquet(path)
        if suffix in (".csv", ".gz"):
            return pd.read_csv(path)
    except Exception as exc:  # pandas/pyarrow raise many types; name the file
        raise MistillInputError(f"cannot read table: {exc}", file=str(path)) from None
    raise MistillInputError(f"unknown table format {suffix!r} (feather, parquet or csv)",
                            file=str(path))


def load_mimic_edin(path: str | os.PathLike, inventory: Inventory, *,
                    split_file: str | os.PathLike | None = None,
                    text_column: str = "text", patient_column: str = "subject_id",
                    id_column: str = "_id", code_column: str = "icd10_diag",
                    split_column: str = "split", split_id_column: str | None = None,
                    splits: Sequence[str] | None = None, unknown_codes: str = "error",
                    detect_discharge_diagnosis: bool = True, name: str = "mimic-iv-icd10",
                    privacy: str = "restricted") -> Corpus:
    """Load the Edin et al. (2023) preprocessed MIMIC-IV ICD-10 release as a restricted corpus.

    path: the note table (``mimiciv_icd10.feather``, or parquet/csv) with the note text,
        patient id, note id and a diagnosis-code column (list cells, or strings separated by
        ``;``, ``,`` or spaces). Procedure-code columns are ignored.
    split_file: a table with ``split_id_column`` (default: ``id_column``) and ``split_column``
        (``mimiciv_icd10_split.feather``); without it the note table needs ``split_column``.
    splits: keep only these splits (e.g. ``["test"]``).
    unknown_codes: ``"error"`` (a code outside the inventory raises) or ``"drop"`` (dropped and
        counted in ``meta["n_dropped_codes"]``; a note left without codes is skipped).
    detect_discharge_diagnosis: fill ``Note.discharge_diagnosis`` with
        :func:`find_discharge_diagnosis` so prompts can remove it.
    A missing file or column, a byte that is not UTF-8 in a CSV table, or a note id that cannot
    name a folder (:func:`safe_path_component`) raises :class:`MistillInputError` naming them.
    """
    if unknown_codes not in ("error", "drop"):
        raise ValueError("unknown_codes must be 'error' or 'drop'")
    p = Path(path)
    df = _read_table(p)
    needed = [text_column, patient_column, id_column, code_column]
    if split_file is None:
        needed.append(split_column)
    for col in needed:
        if col not in df.columns:
            raise MistillInputError(f"column missing (has: {', '.join(map(str, df.columns))})",
                                    file=str(p), field=col)
    split_of: dict[str, str] | None = None
    if split_file is not None:
        sp = Path(split_file)
        sdf = _read_table(sp)
        sid = split_id_column or id_column
        for col in (sid, split_column):
            if col not in sdf.columns:
                raise MistillInputError(f"column missing (has: "
                                        f"{', '.join(map(str, sdf.columns))})", file=str(sp),
                                        field=col)
        split_of = {}
        for rid, s in zip(sdf[sid].tolist(), sdf[split_column].tolist()):
            key = str(rid)
            if key in split_of and split_of[key] != s:
                raise MistillInputError(f"id assigned to two splits ({split_of[key]!r}, {s!r})",
                                        file=str(sp), note=key, field=split_column)
            split_of[key] = str(s)
    keep = set(splits) if splits is not None else None
    extra_cols = [c for c in ("note_id", "_id", "hadm_id") if c in df.columns and c != id_column]
    notes: list[Note] = []
    seen: set[str] = set()
    n_skipped = 0
    records = df.to_dict(orient="records")
    for i, rec in enumerate(records):
        nid = str(rec[id_column])
        if not safe_path_component(nid):
            raise MistillInputError(f"note id {nid!r} (row {i}) cannot name the note's artifact folder: use "
                                    f"letters, digits, '_', '.' and '-', not starting with '.'",
                                    file=str(p), note=nid, field=id_column)
        if split_of is not None:
            if nid not in split_of:
                raise MistillInputError("note id not in the split file", file=str(split_file),
                                        note=nid, field=split_id_column or id_column)
            split = split_of[nid]
        else:
            split = str(rec[split_column])
        if keep is not None and split not in keep:
            continue
        if nid in seen:
            raise MistillInputError(f"duplicate note id (row {i})", file=str(p), note=nid,
                                    field=id_column)
        seen.add(nid)
        text = rec[text_column]
        if not isinstance(text, str) or not text.strip():
            raise MistillInputError("empty or non-text note", file=str(p), note=nid,
                                    field=text_column)
        raw_codes = _parse_codes(rec[code_column], file=str(p), column=code_column, note=nid)
        gold: list[str] = []
        dropped = 0
        for c in raw_codes:
            if c in inventory:
                d = inventory.normalize(c)
                if d not in gold:
                    gold.append(d)
            elif unknown_codes == "error":
                raise MistillInputError(f"code {c!r} is not in the inventory "
                                        f"({len(inventory)} codes)", file=str(p), note=nid,
                                        field=code_column)
            else:
                dropped += 1
        if not gold:
            if unknown_codes == "drop":
                n_skipped += 1
                continue
            raise MistillInputError("no diagnosis codes", file=str(p), note=nid,
                                    field=code_column)
        meta: dict[str, Any] = {"source_row": i}
        for col in extra_cols:
            meta[col] = str(rec[col])
        if dropped:
            meta["n_dropped_codes"] = dropped
        dd = find_discharge_diagnosis(text) if detect_discharge_diagnosis else None
        notes.append(Note(note_id=nid, patient_id=str(rec[patient_column]), split=split,
                          text=text, gold_codes=tuple(gold), discharge_diagnosis=dd,
                          meta=meta))
    if not notes:
        raise MistillInputError("no notes left after split and code filtering", file=str(p))
    return Corpus(name=name, privacy=privacy, notes=notes, inventory=inventory,
                  meta={"source": str(p), "n_skipped_notes": n_skipped})


# ---------------------------------------------------------------------------------------------
# Characterization-corpus selection (App. A)
# ---------------------------------------------------------------------------------------------

def word_count(text: str) -> int:
    """Whitespace-separated words (the Edin text is already stripped of punctuation)."""
    return len(text.split())


def code_count(note: Note, inventory: Inventory) -> int:
    """Number of the note's gold codes that are in ``inventory``."""
    return sum(1 for c in note.gold_codes if c in inventory)


def eligible(note: Note, inventory: Inventory, min_words: int = 800, max_words: int = 2500,
             min_codes: int = 5, max_codes: int = 25) -> bool:
    """App. A eligibility: ``min_words..max_words`` words and ``min_codes..max_codes`` gold codes
    in the inventory (bounds inclusive)."""
    w = word_count(note.text)
    k = code_count(note, inventory)
    return min_words <= w <= max_words and min_codes <= k <= max_codes


def stratum_thresholds(counts: Sequence[int]) -> tuple[float, float, float]:
    """The quartile cut points (25th, 50th, 75th percentiles, numpy's linear rule) of the code
    counts. A note with count k is in stratum 0 if k <= q1, 1 if q1 < k <= q2, 2 if
    q2 < k <= q3, else 3; tied counts therefore never straddle strata (so strata can differ in
    size, and some may be empty when counts are heavily tied)."""
    if len(counts) == 0:
        raise MistillInputError("no notes to stratify", field="notes")
    q = np.percentile(np.asarray(counts, dtype=float), [25, 50, 75])
    return float(q[0]), float(q[1]), float(q[2])


def _stratum(k: int, q: tuple[float, float, float]) -> int:
    return sum(1 for t in q if k > t)


def _blocks(note: Note, inventory: Inventory, block_of: Callable[[str], str]) -> frozenset[str]:
    return frozenset(block_of(c) for c in note.gold_codes if c in inventory)


def select_stratified(notes: Sequence[Note], n: int, inventory: Inventory, seed: int, *,
                      filter_eligible: bool = True, eligibility: Mapping[str, int] | None = None,
                      block_of: Callable[[str], str] = icd10_block) -> list[Note]:
    """Select ``n`` notes as in App. A: stratified over code-count quartiles, greedy on blocks.

    1. Candidates: ``notes`` passing :func:`eligible` (``eligibility`` overrides its bounds;
       ``filter_eligible=False`` takes every note with at least one inventory code).
    2. Strata: the quartiles of the in-inventory code count (:func:`stratum_thresholds`).
    3. Tie order: candidates sorted by note id, then shuffled with ``random.Random(seed)``.
    4. Picks go round-robin over the strata 0, 1, 2, 3, 0, ... (equal allocation; when ``n`` is
       not a multiple of the number of strata the lower-count strata get the remainder, and a
       stratum with no candidate left is skipped so its share moves to the others). At each
       pick the stratum's candidate covering the most ICD-10 blocks not yet covered by any note
       already selected wins; ties go to the earlier note in the seeded order. A pick removes
       every other note of the same patient from all strata (at most one note per patient).

    Returns the notes in pick order. Deterministic for a seed and independent of the input
    order. Fewer than ``n`` selectable notes raises :class:`MistillInputError`.
    """
    if n <= 0:
        raise ValueError("n must be positive")
    crit = dict(eligibility or {})
    if filter_eligible:
        pool = [x for x in notes if eligible(x, inventory, **crit)]
    else:
        pool = [x for x in notes if code_count(x, inventory) > 0]
    ids = [x.note_id for x in pool]
    if len(set(ids)) != len(ids):
        raise MistillInputError("duplicate note ids among the candidates", field="note_id")
    n_patients = len({x.patient_id for x in pool})
    if n_patients < n:
        raise MistillInputError(f"only {n_patients} distinct patients among {len(pool)} "
                                f"candidate notes; cannot select {n}", field="n")
    pool.sort(key=lambda x: x.note_id)
    random.Random(seed).shuffle(pool)
    counts = [code_count(x, inventory) for x in pool]
    q = stratum_thresholds(counts)
    strata: list[list[int]] = [[] for _ in range(4)]
    for i, k in enumerate(counts):
        strata[_stratum(k, q)].append(i)  # each stratum stays in seeded order
    blocks = [_blocks(x, inventory, block_of) for x in pool]
    covered: set[str] = set()
    used_patients: set[str] = set()
    chosen: list[Note] = []
    s = 0
    while len(chosen) < n:
        for _ in range(4):
            live = [i for i in strata[s] if pool[i].patient_id not in used_patients]
            strata[s] = live
            if live:
                break
            s = (s + 1) % 4
        else:  # pragma: no cover - guarded by the patient count above
            raise MistillInputError("ran out of selectable notes", field="n")
        best, best_gain = live[0], -1
        for i in live:  # first maximum in seeded order wins ties
            gain = len(blocks[i] - covered)
            if gain > best_gain:
                best, best_gain = i, gain
        chosen.append(pool[best])
        covered |= blocks[best]
        used_patients.add(pool[best].patient_id)
        strata[s] = [i for i in live if i != best]
        s = (s + 1) % 4
    return chosen


def with_trace(note: Note, trace: str) -> Note:
    """A copy of ``note`` carrying ``trace`` as its teacher trace (must close ``</think>``)."""
    if THINK_CLOSE not in trace:
        raise MistillInputError(f"reasoning block not closed (no {THINK_CLOSE})",
                                note=note.note_id, field="teacher_trace")
    return replace(note, teacher_trace=trace)
