"""Two characterizations side by side (Tables 9, 35 and 36) and the patient-level collapse of the
knock-in cells (App. C, "Patients").

* Rankings (:func:`compare_rankings`): per phase, the Spearman correlation of two attribute runs'
  ``I_c`` over every head they share and the overlaps of their top-k (Table 9: the intact
  attribution graph against the detached hook on the same notes; Table 35: the shortlist prompts
  against the full inventory). Two models with different heads (Table 36: a second reasoner) share
  no head names, so only their knock-in rows are compared.
* Knock-in (:func:`knockin_side_by_side`): each run's global-set knock-in recovery and necessity
  per phase and k, random-k beside it and the notes where the global set beats random, one run's
  columns beside the other's (Tables 35 and 36).
* Patients (:func:`patient_collapse_table`): the per-note knock-in cells averaged within each
  patient first (a patient with two notes, the paper's two prompt variants, counts once), then the
  same medians and sign tests as Tables 1/10, beside the per-note values and the move between them;
  :func:`readside_patient_collapse` does the same for the read-side lifts of Table 16.

The computations are pure functions of ``head_sets.json`` documents and ``per_note_sets`` frames;
:func:`compared_runs` and :func:`note_patients` are the two readers of the tracking store the report
calls for their inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

from analysis import query
from mistill.errors import MistillInputError
from mistill.instrument.calibration import PHASES
from mistill.instrument.settables import MEASURES, SETS, sets_table
from mistill.stages.common import RunReader
from mistill.tracking.naming import TAG_INPUT_PREFIX, TAG_STAGE

__all__ = ["COMPARE_KS", "LOCUS_RANKINGS", "SIDE_METRICS", "compare_display", "compare_rankings", "compared_runs",
           "instruction_control_table", "knockin_display", "metrics_side_by_side", "newest_reader",
           "prose_time_overlap", "reading_runs",
           "knockin_side_by_side", "note_patients", "patient_collapse_display", "patient_collapse_table",
           "patient_rows", "prepared_patients", "ranking_agreement", "readside_patient_collapse", "spearman"]

COMPARE_KS: tuple[int, ...] = (8, 16, 40)
"""The top-k overlaps reported: Table 9 and App. G report the top-8 and top-40, Table 15 (the
split-half counterpart) also the top-16."""

CORPUS_INDEX = "corpus_index.csv"
"""The prepared corpus's note index (``note_id, patient_id``; patient ids hashed for a restricted
corpus, which still groups notes by patient)."""

PAIR_COLUMNS: tuple[str, ...] = ("pair", "side", "label")
"""Columns :func:`compared_runs` adds to each compared run's row: the pair's number (0, 1, ...),
``a`` or ``b``, and the run's label."""

_AUTO_FIELDS: tuple[str, ...] = ("detach",)
"""**[recon]** The attribute settings whose two values on the same events run and model make an
unnamed pair (the intact graph, ``detach=false``, against the detached hook, Table 9)."""


# ------------------------------------------------------------------------------ rankings
def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho of two ``[head]`` vectors (average ranks for ties); NaN when either is
    constant or fewer than two heads are finite in both."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    both = np.isfinite(a) & np.isfinite(b)
    if both.sum() < 2:
        return math.nan
    ra = pd.Series(a[both]).rank().to_numpy()
    rb = pd.Series(b[both]).rank().to_numpy()
    if ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def ranking_agreement(ranking_a: Sequence[str], importance_a: Sequence[float], ranking_b: Sequence[str],
                      importance_b: Sequence[float], ks: Sequence[int] = COMPARE_KS) -> dict[str, Any]:
    """How far two rankings of heads agree.

    ranking_a, importance_a: one run's heads best first (``[head]`` names) and their ``I_c`` in
        that order (``[head]``); the same for ``b``. The top-k of a run is the first k of its
        ranking, so ties are broken as the run broke them.

    Returns ``n_heads`` (heads ranked), ``spearman`` (over every head), ``top_overlap.<k>``
    (heads in both top-k, for every k in ``ks``) and ``top_k.<k>`` (the k used, clipped to the
    ranking's length). Two rankings of different heads (two geometries: a second reasoner) are
    not comparable head by head: ``n_heads`` is 0 and the rest NaN.
    """
    if len(ranking_a) != len(importance_a) or len(ranking_b) != len(importance_b):
        raise MistillInputError("a ranking and its importances differ in length", field="importance_c")
    ia = dict(zip(ranking_a, map(float, importance_a)))
    ib = dict(zip(ranking_b, map(float, importance_b)))
    shared = list(ranking_a) if set(ia) == set(ib) else []
    out: dict[str, Any] = {"n_heads": len(shared),
                           "spearman": spearman(np.array([ia[h] for h in shared]),
                                                np.array([ib[h] for h in shared])) if shared else math.nan}
    for k in ks:
        kk = min(int(k), len(ranking_a), len(ranking_b))
        out[f"top_k.{k}"] = kk
        out[f"top_overlap.{k}"] = len(set(ranking_a[:kk]) & set(ranking_b[:kk])) if shared else math.nan
    return out


def compare_rankings(sets_a: Mapping[str, Any], sets_b: Mapping[str, Any],
                     ks: Sequence[int] = COMPARE_KS, phases: Sequence[str] = PHASES) -> pd.DataFrame:
    """Per phase ranked in both runs (``phases``: P1, P2, P2C; a locus run's ``prose_time`` and
    ``transport``), :func:`ranking_agreement` of two ``head_sets.json`` documents, with the notes
    each run ranked the phase on (``n_notes_a``, ``n_notes_b``).

    **[recon]** NULL has no ``I_c`` ranking (it is the calibration's reference, App. C): it is
    left out, as from the paper's Tables 9 and 35. A phase only one run ranks is left out.
    Columns: ``phase, n_notes_a, n_notes_b, n_heads, spearman, top_overlap.<k>, top_k.<k>``.
    """
    rows = []
    for phase in phases:
        a, b = sets_a.get(phase), sets_b.get(phase)
        if not (isinstance(a, Mapping) and isinstance(b, Mapping) and a.get("ranking") and b.get("ranking")):
            continue
        rec: dict[str, Any] = {"phase": phase, "n_notes_a": int(a.get("n_notes", 0)),
                               "n_notes_b": int(b.get("n_notes", 0))}
        rec.update(ranking_agreement(a["ranking"], a["importance_c"], b["ranking"], b["importance_c"], ks))
        rows.append(rec)
    columns = ["phase", "n_notes_a", "n_notes_b", "n_heads", "spearman",
               *(f"top_overlap.{k}" for k in ks), *(f"top_k.{k}" for k in ks)]
    return pd.DataFrame.from_records(rows, columns=columns)


# ------------------------------------------------------------------------------ knock-in
_KNOCKIN_COLUMNS: tuple[str, ...] = ("recovery.global", "recovery.random", "recovery.wins_vs_random",
                                     "recovery.n_vs_random", "necessity.global", "necessity.random",
                                     "necessity.wins_vs_random", "necessity.n_vs_random")


def knockin_side_by_side(per_note_a: pd.DataFrame, per_note_b: pd.DataFrame) -> pd.DataFrame:
    """Tables 1/10 of two knock-in runs, one beside the other.

    per_note_a, per_note_b: ``per_note_sets`` rows of each run (one per note x phase x k x set:
        ``note_id, phase, k, set, necessity, recovery``), or an empty frame for a run without a
        knock-in run.

    One row per (phase, k) either run has; per side ``<column>.a`` / ``<column>.b`` for the
    global and random medians over notes of recovery and necessity, and the notes where the global
    set beats random out of the notes compared (:func:`~mistill.instrument.settables.sets_table`).
    """
    sides = []
    for side, rows in (("a", per_note_a), ("b", per_note_b)):
        if rows is None or rows.empty:
            continue
        t = sets_table(rows.to_dict("records"))
        keep = [c for c in _KNOCKIN_COLUMNS if c in t.columns]
        sides.append(t[["phase", "k", *keep]].rename(columns={c: f"{c}.{side}" for c in keep}))
    if not sides:
        return pd.DataFrame(columns=["phase", "k"])
    out = sides[0] if len(sides) == 1 else sides[0].merge(sides[1], on=["phase", "k"], how="outer")
    order = {p: i for i, p in enumerate(PHASES)}
    out = out.sort_values(["phase", "k"], key=lambda s: s.map(order) if s.name == "phase" else s)
    return out.reset_index(drop=True)


# ------------------------------------------------------------------------------ patients
def _require_patients(note_ids: pd.Series, patients: Mapping[str, str]) -> None:
    """Refuse notes without a patient id, naming the first."""
    missing = sorted(set(note_ids.astype(str)) - set(patients))
    if missing:
        raise MistillInputError(f"{len(missing)} notes have no patient id (first: {missing[0]})",
                                note=missing[0], field="patient_id")


def patient_rows(per_note: pd.DataFrame, patients: Mapping[str, str]) -> pd.DataFrame:
    """The per-note cells collapsed to one per patient.

    per_note: ``per_note_sets`` rows (``note_id, phase, k, set, necessity, recovery`` and
        optionally ``n_events, n_gated``); patients: ``note_id -> patient_id``.

    Per (patient, phase, k, set): the mean over the patient's notes of each note's value of
    necessity and of recovery (NaN notes left out; the paper's "two variants' per-note means
    averaged first"), ``n_events`` and ``n_gated`` summed, ``n_notes`` the notes averaged. The
    patient id is in ``note_id``, so the rows feed
    :func:`~mistill.instrument.settables.sets_table` as they are.

    Raises:
        MistillInputError: a note without a patient.
    """
    _require_patients(per_note["note_id"], patients)
    df = per_note.copy()
    df["note_id"] = df["note_id"].astype(str).map(patients)
    agg: dict[str, Any] = {m: "mean" for m in MEASURES}
    for col in ("n_events", "n_gated"):
        if col in df.columns:
            agg[col] = "sum"
    grouped = df.groupby(["note_id", "phase", "k", "set"], sort=True)
    out = grouped.agg(agg)
    out["n_notes"] = grouped.size()
    return out.reset_index()


def patient_collapse_table(per_note: pd.DataFrame, patients: Mapping[str, str]) -> pd.DataFrame:
    """Tables 1/10 with the note and with the patient as the unit, side by side (App. C).

    per_note: one knock-in run's ``per_note_sets`` rows; patients: ``note_id -> patient_id``.

    One row per (phase, k, set) of the run: for necessity and recovery the median over notes
    (``<measure>.note``), over patients (``<measure>.patient``, after :func:`patient_rows`) and
    ``<measure>.move`` (patient minus note); for the global set also the notes and patients where
    it beats random (``<measure>.wins.note`` / ``.n.note``, ``.wins.patient`` / ``.n.patient``)
    and the exact sign-test p of each. ``n_notes``, ``n_patients``: the units of the run.
    """
    notes_t = sets_table(per_note.to_dict("records"))
    patient_t = sets_table(patient_rows(per_note, patients).to_dict("records"))
    units = {"n_notes": int(per_note["note_id"].astype(str).nunique()),
             "n_patients": int(len({patients[str(n)] for n in per_note["note_id"]}))}
    rows = []
    patient_cells = {(t["phase"], int(t["k"])): t for t in patient_t.to_dict("records")}
    for tn in notes_t.to_dict("records"):
        tp = patient_cells.get((tn["phase"], int(tn["k"])), {})
        for s in SETS:
            if f"recovery.{s}" not in notes_t.columns:
                continue
            rec: dict[str, Any] = {"phase": tn["phase"], "k": int(tn["k"]), "set": s, **units}
            for m in MEASURES:
                a, b = _float(tn.get(f"{m}.{s}")), _float(tp.get(f"{m}.{s}"))
                rec.update({f"{m}.note": a, f"{m}.patient": b, f"{m}.move": b - a})
                for unit, t in (("note", tn), ("patient", tp)):
                    wins = t.get(f"{m}.wins_vs_random") if s == "global" else None
                    n = t.get(f"{m}.n_vs_random") if s == "global" else None
                    rec[f"{m}.wins.{unit}"] = wins if wins is not None and not pd.isna(wins) else pd.NA
                    rec[f"{m}.n.{unit}"] = n if n is not None and not pd.isna(n) else pd.NA
                    p = t.get(f"{m}.sign_p_vs_random") if s == "global" else None
                    rec[f"{m}.sign_p.{unit}"] = _float(p)
            rows.append(rec)
    table = pd.DataFrame.from_records(rows)
    for col in table.columns:
        if ".wins." in col or ".n." in col:
            table[col] = table[col].astype("Int64")
    return table


def readside_patient_collapse(note_lifts: pd.DataFrame, patients: Mapping[str, str]) -> pd.DataFrame:
    """Table 16's region lifts with the note and with the patient as the unit (App. C, "Patients").

    note_lifts: one read_side run's ``readside_note_lifts`` rows (``note_id, phase, group, lift``);
    patients: ``note_id -> patient_id``.

    One row per (phase, group): ``lift.note`` the median over notes, ``lift.patient`` the median
    over patients of the mean of each patient's notes (NaN notes left out), ``lift.move`` (patient
    minus note), ``n_notes`` and ``n_patients`` (the units with a finite lift).

    Raises:
        MistillInputError: a note without a patient.
    """
    _require_patients(note_lifts["note_id"], patients)
    df = note_lifts.assign(note_id=note_lifts["note_id"].astype(str), lift=note_lifts["lift"].astype(float))
    df = df[np.isfinite(df["lift"])]
    df = df.assign(patient_id=df["note_id"].map(patients))
    rows = []
    for (phase, group), grp in df.groupby(["phase", "group"], sort=True):
        by_patient = grp.groupby("patient_id")["lift"].mean()
        note, patient = float(grp["lift"].median()), float(by_patient.median())
        rows.append({"phase": phase, "group": group, "lift.note": note, "lift.patient": patient,
                     "lift.move": patient - note, "n_notes": int(grp["note_id"].nunique()),
                     "n_patients": int(by_patient.size)})
    return pd.DataFrame(rows, columns=["phase", "group", "lift.note", "lift.patient", "lift.move", "n_notes",
                                       "n_patients"])


def _float(v: Any) -> float:
    return math.nan if v is None or pd.isna(v) else float(v)


# ------------------------------------------------------------------------------ display
def _num(v: Any, digits: int = 3) -> str:
    return "" if v is None or pd.isna(v) else f"{float(v):.{digits}f}"


def _count(v: Any, of: Any) -> str:
    return "" if v is None or pd.isna(v) or of is None or pd.isna(of) else f"{int(v)}/{int(of)}"


def compare_display(table: pd.DataFrame, ks: Sequence[int] = COMPARE_KS) -> pd.DataFrame:
    """The ranking comparison as printed: per pair and phase the Spearman rho and ``shared/k``
    of every top-k."""
    out = []
    for _, r in table.iterrows():
        rec: dict[str, Any] = {"A": r["label_a"], "B": r["label_b"], "phase": r["phase"],
                               "notes A/B": f"{int(r['n_notes_a'])}/{int(r['n_notes_b'])}",
                               "heads": int(r["n_heads"]), "Spearman": _num(r["spearman"], 2)}
        for k in ks:
            rec[f"top-{k}"] = _count(r[f"top_overlap.{k}"], r[f"top_k.{k}"])
        out.append(rec)
    return pd.DataFrame.from_records(out)


def knockin_display(table: pd.DataFrame) -> pd.DataFrame:
    """The knock-in comparison as printed: per side ``global (random)`` medians of recovery and
    necessity and the notes where the global set beats random."""
    out = []
    for _, r in table.iterrows():
        rec: dict[str, Any] = {"A": r["label_a"], "B": r["label_b"], "phase": r["phase"], "k": int(r["k"])}
        for side in ("a", "b"):
            name = side.upper()
            for m, short in (("recovery", "rec."), ("necessity", "nec.")):
                g, rnd = r.get(f"{m}.global.{side}"), r.get(f"{m}.random.{side}")
                rec[f"{short} {name}"] = "" if g is None or pd.isna(g) else \
                    f"{_num(g)} ({_num(rnd)})" if rnd is not None and not pd.isna(rnd) else _num(g)
                rec[f"{short} notes {name}"] = _count(r.get(f"{m}.wins_vs_random.{side}"),
                                                     r.get(f"{m}.n_vs_random.{side}"))
        out.append(rec)
    return pd.DataFrame.from_records(out)


def patient_collapse_display(table: pd.DataFrame) -> pd.DataFrame:
    """The patient collapse as printed: per measure the per-note and per-patient medians and the
    move, and for the global set the wins over random with each unit."""
    out = []
    for _, r in table.iterrows():
        rec: dict[str, Any] = {"model": r["model"], "phase": r["phase"], "k": int(r["k"]), "set": r["set"],
                               "notes/patients": f"{int(r['n_notes'])}/{int(r['n_patients'])}"}
        for m, short in (("necessity", "nec."), ("recovery", "rec.")):
            rec[f"{short} note"] = _num(r[f"{m}.note"])
            rec[f"{short} patient"] = _num(r[f"{m}.patient"])
            rec[f"{short} move"] = "" if pd.isna(r[f"{m}.move"]) else f"{r[f'{m}.move']:+.3f}"
            rec[f"{short} wins note/patient"] = (
                f"{_count(r[f'{m}.wins.note'], r[f'{m}.n.note'])} / "
                f"{_count(r[f'{m}.wins.patient'], r[f'{m}.n.patient'])}" if r["set"] == "global" else "")
        out.append(rec)
    return pd.DataFrame.from_records(out)


# ------------------------------------------------------------------------------ the store
def _run_row(client: MlflowClient, run_id: str) -> dict[str, Any]:
    """One run as :func:`analysis.query.stage_runs` shows it (tags, metrics), found by id in
    any experiment."""
    run = client.get_run(run_id)
    tags = run.data.tags
    rec = {"run_id": run.info.run_id, "run_name": run.info.run_name, "start_time": run.info.start_time}
    rec.update({col: tags.get(tag) for col, tag in query.TAG_COLUMNS.items()})
    rec["checkpoint"] = rec["model"]
    rec.update(run.data.metrics)
    rec["experiment_id"] = run.info.experiment_id
    rec["detach"] = run.data.params.get("detach")
    rec["events_run"] = run.data.params.get("events_run")
    return rec


def _auto_pairs(client: MlflowClient, experiment: str) -> list[tuple[str, str]]:
    """**[recon]** Unnamed pairs: the newest FINISHED attribute runs of one model on one events
    run that differ in :data:`_AUTO_FIELDS` (``detach``): the intact graph first."""
    runs = query.stage_runs(client, experiment, "attribute")
    if runs.empty:
        return []
    rows = pd.DataFrame([_run_row(client, r) for r in runs["run_id"]])
    pairs = []
    for _, grp in rows.groupby([rows["model"].fillna(""), rows["events_run"].fillna("")], sort=True):
        for field in _AUTO_FIELDS:
            newest = grp.sort_values("start_time", ascending=False).drop_duplicates(field)
            values = newest[field].dropna().astype(str).str.lower().tolist()
            if {"false", "true"} <= set(values):
                by = dict(zip(newest[field].astype(str).str.lower(), newest["run_id"]))
                pairs.append((by["false"], by["true"]))
    return pairs


def _label(row: Mapping[str, Any], other: Mapping[str, Any]) -> str:
    """A run's default label: the model, or where both runs share it, what else differs
    (``detach=true``), or its run id's first 8 characters."""
    if row.get("model") != other.get("model"):
        return str(row.get("model") or "")
    for field in _AUTO_FIELDS:
        if row.get(field) != other.get(field):
            return f"{field}={str(row.get(field)).lower()}"
    return str(row["run_id"])[:8]


def compared_runs(client: MlflowClient, experiment: str, run_ids: Sequence[str] = (),
                  labels: Sequence[str] = ()) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The attribute runs compared and their knock-in runs.

    run_ids: attribute run ids taken two at a time (run a, run b of each pair), in any
        experiment; empty: the unnamed pairs of ``experiment`` (:func:`_auto_pairs`).
    labels: one label per run id (empty: each run's model, or the setting its pair differs in).

    Returns the attribute runs and the newest FINISHED knock-in run of each (an attribute run
    without one has no row there), each a frame of :func:`analysis.query.stage_runs`' columns
    plus :data:`PAIR_COLUMNS`; both empty when nothing is compared.

    Raises:
        MistillInputError: an odd number of run ids, labels not one per run, or a run that is not
            an attribute run.
    """
    if len(run_ids) % 2:
        raise MistillInputError(f"compare_attribute_runs takes runs in pairs, got {len(run_ids)}",
                                field="compare_attribute_runs")
    if labels and len(labels) != len(run_ids):
        raise MistillInputError(f"compare_labels names {len(labels)} runs, compare_attribute_runs "
                                f"{len(run_ids)}", field="compare_labels")
    pairs = [(run_ids[i], run_ids[i + 1]) for i in range(0, len(run_ids), 2)] if run_ids \
        else _auto_pairs(client, experiment)
    attribute, knockin = [], []
    for n, (a, b) in enumerate(pairs):
        ra, rb = _run_row(client, a), _run_row(client, b)
        for rid, row in ((a, ra), (b, rb)):
            if row.get("stage") != "attribute":
                raise MistillInputError(f"run {rid} is not an attribute run", field="compare_attribute_runs")
        for i, (side, row, other) in enumerate((("a", ra, rb), ("b", rb, ra))):
            label = labels[2 * n + i] if labels else _label(row, other)
            attribute.append({**row, "pair": n, "side": side, "label": label})
            kin = _newest_reader(client, row, "knockin")
            if kin:
                knockin.append({**_run_row(client, kin), "pair": n, "side": side, "label": label})
    return pd.DataFrame.from_records(attribute), pd.DataFrame.from_records(knockin)


def _newest_reader(client: MlflowClient, attribute_row: Mapping[str, Any], stage: str) -> str | None:
    """The newest FINISHED ``stage`` run that read this attribute run (its lineage tag), or None;
    a knock-in of another run's sets (``sets_run``) is not its attribute run's own knock-in."""
    found = client.search_runs(
        [attribute_row["experiment_id"]], max_results=50, order_by=["attributes.start_time DESC"],
        filter_string=f"tags.`{TAG_STAGE}` = '{stage}' and attributes.status = 'FINISHED' and "
                      f"tags.`{TAG_INPUT_PREFIX}attribute` = '{attribute_row['run_id']}'")
    own = [r for r in found if not r.data.params.get("sets_run")]
    return own[0].info.run_id if own else None


def newest_reader(client: MlflowClient, attribute_run: str, stage: str) -> str | None:
    """The newest FINISHED ``stage`` run that read ``attribute_run`` (any experiment), or None."""
    exp = client.get_run(attribute_run).info.experiment_id
    return _newest_reader(client, {"experiment_id": exp, "run_id": attribute_run}, stage)


def reading_runs(client: MlflowClient, attribute: pd.DataFrame, stage: str) -> pd.DataFrame:
    """The newest FINISHED ``stage`` run (``locus``, ``read_side``) that read each compared
    attribute run of :func:`compared_runs`, with its pair, side and label; an attribute run
    without one has no row."""
    rows = []
    for _, row in (attribute.iterrows() if not attribute.empty else ()):
        found = _newest_reader(client, row, stage)
        if found:
            rows.append({**_run_row(client, found), "pair": row["pair"], "side": row["side"], "label": row["label"]})
    return pd.DataFrame.from_records(rows)


SIDE_METRICS: dict[str, tuple[str, ...]] = {
    "locus": ("locus/",), "read_side": ("readside/",)}
"""The metrics shown side by side for a pair's ``locus`` and ``read_side`` runs (Tables 35 and 37):
the locus outcome shares, the median window distance, pass B and the follow-through; the
read-side lifts of each group and phase and the top-k's wins over the random panel."""


def metrics_side_by_side(runs: pd.DataFrame, stage: str) -> pd.DataFrame:
    """Per pair of ``runs`` (:func:`reading_runs`), every metric of :data:`SIDE_METRICS` that
    either run logs: ``pair, label_a, label_b, run_a, run_b, metric, a, b, b_minus_a``."""
    rows = []
    if runs.empty:
        return pd.DataFrame(columns=["pair", "label_a", "label_b", "run_a", "run_b", "metric", "a", "b", "b_minus_a"])
    for pair, grp in runs.groupby("pair", sort=True):
        sides = {r["side"]: r for _, r in grp.iterrows()}
        if set(sides) != {"a", "b"}:
            continue
        a, b = sides["a"], sides["b"]
        names = sorted({c for c in runs.columns if c.startswith(SIDE_METRICS[stage])
                        and (pd.notna(a.get(c)) or pd.notna(b.get(c)))})
        for name in names:
            va, vb = _float(a.get(name)), _float(b.get(name))
            rows.append({"pair": int(pair), "label_a": a["label"], "label_b": b["label"], "run_a": a["run_id"],
                         "run_b": b["run_id"], "metric": name, "a": va, "b": vb, "b_minus_a": vb - va})
    return pd.DataFrame(rows, columns=["pair", "label_a", "label_b", "run_a", "run_b", "metric", "a", "b",
                                       "b_minus_a"])


INSTRUCTION_PHASES: tuple[str, ...] = ("P1", "P2C")
"""The decisions Table 4's first two readings test (chapter and contrastive)."""


def instruction_control_table(knockin_rows: pd.DataFrame, reference_rows: pd.DataFrame,
                              reference_sets: Mapping[str, Any], new_sets: Mapping[str, Any],
                              new_locus: Mapping[str, Any] | None, reference_locus: Mapping[str, Any] | None,
                              locus_window: tuple[float, float]) -> pd.DataFrame:
    """Table 4 (App. B, the instruction control): the four readings fixed before the run.

    knockin_rows: ``per_note_sets`` of the knock-in of the reference's global sets into the
    regenerated traces; reference_rows: the reference characterization's own ``per_note_sets``;
    reference_sets / new_sets: the two attribute runs' ``head_sets.json``; new_locus /
    reference_locus: the two locus runs' ``head_sets.json`` (None: no locus run);
    locus_window: the two locus runs' ``locus/share_window`` (new, reference; NaN when absent).

    Rows ``reading, phase, statistic, value, reference``: (1) the notes where the reference's
    global top-8 beats random in the new traces, and its top-40 recovery there against the
    reference's own on the notes both runs read; (2) the heads the re-ranked top-40 and top-8
    share with the reference's; (3) the share of chapter mentions with a window locus; (4) the
    heads the new prose-time top-8 shares with its own chapter top-8 and with the reference's
    prose-time top-8.
    """
    rows: list[dict[str, Any]] = []

    def add(reading: int, phase: str, statistic: str, value: float, reference: float = math.nan) -> None:
        rows.append({"reading": reading, "phase": phase, "statistic": statistic, "value": float(value),
                     "reference": float(reference)})

    new_t = sets_table(knockin_rows.to_dict("records")) if len(knockin_rows) else pd.DataFrame()
    notes = set(knockin_rows["note_id"].astype(str)) if len(knockin_rows) else set()
    ref_same = reference_rows[reference_rows["note_id"].astype(str).isin(notes)] if len(reference_rows) else \
        reference_rows
    ref_t = sets_table(ref_same.to_dict("records")) if len(ref_same) else pd.DataFrame()
    add(1, "", "notes both runs read (the reference's own recovery is read on them)",
        len(notes & set(ref_same["note_id"].astype(str))) if len(ref_same) else 0)
    for phase in INSTRUCTION_PHASES:
        cell = new_t[(new_t["phase"] == phase) & (new_t["k"] == 8)] if len(new_t) else new_t
        for col in ("recovery.wins_vs_random", "recovery.n_vs_random"):
            if len(cell) and col in cell:
                add(1, phase, f"k8 {col.split('.')[1]}", _float(cell[col].iloc[0]))
        cell = new_t[(new_t["phase"] == phase) & (new_t["k"] == 40)] if len(new_t) else new_t
        ref = ref_t[(ref_t["phase"] == phase) & (ref_t["k"] == 40)] if len(ref_t) else ref_t
        if len(cell):
            add(1, phase, "k40 recovery of the reference's global set (reference: its own, same notes)",
                _float(cell["recovery.global"].iloc[0]),
                _float(ref["recovery.global"].iloc[0]) if len(ref) else math.nan)
    agreement = compare_rankings(reference_sets, new_sets, ks=(8, 40))
    for _, r in agreement.iterrows():
        if r["phase"] in INSTRUCTION_PHASES:
            for k in (40, 8):
                add(2, r["phase"], f"heads shared by the re-ranked and the reference's top-{k}", r[f"top_overlap.{k}"])
    add(3, "P1", "share of chapter mentions with a window locus (reference: the reference's)", locus_window[0],
        locus_window[1])
    if new_locus is not None:
        add(4, "P1", "heads the prose-time top-8 shares with the chapter top-8",
            prose_time_overlap(new_locus, new_sets, ks=(8,)).get("overlap.8", math.nan))
        if reference_locus is not None:
            a = ((new_locus.get("prose_time") or {}).get("ranking") or [])[:8]
            b = ((reference_locus.get("prose_time") or {}).get("ranking") or [])[:8]
            if a and b:
                add(4, "P1", "heads the prose-time top-8 shares with the reference's prose-time top-8",
                    len(set(a) & set(b)))
    return pd.DataFrame(rows, columns=["reading", "phase", "statistic", "value", "reference"])


LOCUS_RANKINGS: tuple[str, ...] = ("prose_time", "transport")
"""A locus run's rankings in its ``head_sets.json`` (App. F)."""


def prose_time_overlap(locus_sets: Mapping[str, Any], attribute_sets: Mapping[str, Any],
                       ks: Sequence[int] = (8, 40)) -> dict[str, float]:
    """How much a locus run's prose-time set shares with its characterization's chapter
    (emission) set (Table 37: 1 of 8 and 3 of 40 for QwQ-32B), and the median layer of the
    prose-time top-40 (``L<layer>H<head>`` names): ``{"overlap.<k>": ..., "median_layer": ...}``."""
    prose = list((locus_sets.get("prose_time") or {}).get("ranking") or [])
    emission = list((attribute_sets.get("P1") or {}).get("ranking") or [])
    out: dict[str, float] = {}
    if prose and emission:
        out.update({f"overlap.{k}": float(len(set(prose[:k]) & set(emission[:k]))) for k in ks})
    layers = [int(h[1:].split("H")[0]) for h in prose[:max(ks)] if h.startswith("L") and "H" in h]
    if layers:
        out["median_layer"] = float(np.median(layers))
    return out


def note_patients(knockin_run: str) -> dict[str, str]:
    """``note_id -> patient_id`` of the notes a knock-in (or ``read_side``) run read: from the
    ``corpus_index`` of the prepared corpus its attribute run's events run read (followed through
    the runs' lineage tags) (hashed patient ids for a restricted
    corpus group the notes the same way).

    Raises:
        MistillInputError: a run of the chain or the index is missing.
    """
    run_id = knockin_run
    for name in ("attribute", "events", "prepare"):  # the lineage tags of knockin, attribute, events
        upstream = RunReader(run_id, field=f"{name}_run").tags.get(TAG_INPUT_PREFIX + name)
        if not upstream:
            raise MistillInputError(f"run {run_id} names no {name} run", field=f"{name}_run")
        run_id = upstream
    return prepared_patients(run_id)


def prepared_patients(prepare: str) -> dict[str, str]:
    """``note_id -> patient_id`` of a prepared corpus (its ``corpus_index``; a note without a
    patient id is its own): the clusters of note-clustered statistics (MuSiQue-Ans: base-question
    groups).

    Raises:
        MistillInputError: the run or its index is missing or unreadable.
    """
    try:
        index = pd.read_csv(RunReader(prepare, field="prepare_run").file(CORPUS_INDEX),
                            dtype={"note_id": str, "patient_id": str})
    except (OSError, pd.errors.ParserError) as exc:
        raise MistillInputError(f"prepared corpus {prepare} has no readable {CORPUS_INDEX} ({exc})",
                                field="prepare_run") from None
    if not {"note_id", "patient_id"} <= set(index.columns):
        raise MistillInputError(f"{CORPUS_INDEX} of run {prepare} lacks note_id or patient_id",
                                field="prepare_run")
    return dict(zip(index["note_id"], index["patient_id"].fillna(index["note_id"])))
