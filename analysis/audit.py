"""Readouts restricted to audited contrastive events (paper Sec. 2.2, App. C Table 5, App. E
Table 24).

An audit labels P2C events of the teacher's traces by what the earlier sibling mention is (the
paper: a verified rejection, an enumeration, both endorsed, other), read by a credentialed
reader inside the enclave. Its labels file is local: one row per labeled event with the columns
``note_id``, ``event_id``, ``label``. Only the strata's aggregates reach the report: M1 (share
of the events where the model's teacher-forced margin favours the teacher's choice) and the
own-heads knock-in recovery at ``k`` (mean over the gated events), on the verified rejections
and on every other labeled event.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pandas as pd

from mistill.errors import MistillInputError

AUDIT_COLUMNS = ("note_id", "event_id", "label")
VERIFIED_REJECTION = "verified_rejection"
STRATA = ("verified rejection", "other labeled")


def read_audit_labels(path: str | Path) -> pd.DataFrame:
    """The labels file as ``note_id, event_id, label`` (strings); a missing column, an empty cell
    or an event labeled twice is refused, naming the file, the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise MistillInputError(f"audit labels file {path} does not exist", field="audit_labels")
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in AUDIT_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise MistillInputError(f"{path}: missing column(s) {missing}", field=missing[0])
        rows, seen = [], set()
        for line, row in enumerate(reader, start=2):
            for col in AUDIT_COLUMNS:
                if not (row.get(col) or "").strip():
                    raise MistillInputError(f"{path}, line {line}: empty {col}", note=row.get("note_id"), field=col)
            key = (row["note_id"].strip(), row["event_id"].strip())
            if key in seen:
                raise MistillInputError(f"{path}, line {line}: event {key[1]} labeled twice", note=key[0],
                                        field="event_id")
            seen.add(key)
            rows.append({"note_id": key[0], "event_id": key[1], "label": row["label"].strip()})
    return pd.DataFrame(rows, columns=list(AUDIT_COLUMNS))


def stratum(label: str) -> str:
    return STRATA[0] if label == VERIFIED_REJECTION else STRATA[1]


def stratified_readouts(labels: pd.DataFrame, m1_events: pd.DataFrame, knockin_events: pd.DataFrame,
                        k: int = 40) -> pd.DataFrame:
    """Table 24's rows of one model: per stratum, M1 over its labeled P2C events and the own-heads
    knock-in recovery at ``k`` over its gated labeled events.

    Args:
        m1_events: ``note_id, event_id, kind, margin`` (the ``evaluate`` run's ``m1_events``).
        knockin_events: ``note_id, event_id, phase, k, recovery, gated`` on the teacher's traces
            (the ``own_heads`` run's ``own_heads_knockin_events``; may be empty).
    """
    lab = labels.assign(stratum=labels["label"].map(stratum))[["note_id", "event_id", "stratum"]]
    out = []
    m1 = m1_events[m1_events["kind"] == "P2C"].merge(lab, on=["note_id", "event_id"]) if len(m1_events) else None
    kin = None
    if len(knockin_events):
        k_rows = knockin_events[(knockin_events["phase"] == "P2C") & (knockin_events["k"].astype(int) == k)]
        gated = k_rows["gated"].astype(str).str.lower().isin(("true", "1"))
        kin = k_rows[gated].merge(lab, on=["note_id", "event_id"])
    for name in STRATA:
        row: dict = {"stratum": name, "m1_n": 0, "m1_p_pos": math.nan, "knockin_n": 0,
                     f"recovery_k{k}": math.nan}
        if m1 is not None:
            x = m1.loc[m1["stratum"] == name, "margin"].astype(float)
            row.update({"m1_n": int(len(x)), "m1_p_pos": float(np.mean(x > 0)) if len(x) else math.nan})
        if kin is not None:
            r = kin.loc[kin["stratum"] == name, "recovery"].astype(float)
            r = r[np.isfinite(r)]
            row.update({"knockin_n": int(len(r)), f"recovery_k{k}": float(r.mean()) if len(r) else math.nan})
        out.append(row)
    return pd.DataFrame(out)


__all__ = ["AUDIT_COLUMNS", "VERIFIED_REJECTION", "STRATA", "read_audit_labels", "stratum", "stratified_readouts"]
