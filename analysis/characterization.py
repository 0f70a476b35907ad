"""Tables 11 and 15 from the characterization's ``attribute`` runs.

* Table 11 (:func:`importance_table`): decision-specific importance ``I_c`` of representative
  heads per phase, each with its rank among all heads and its percentile bootstrap 95% interval
  over notes (:func:`mistill.instrument.calibration.importance_c_intervals`), the head's
  write-side profile, and the raw P2C importance ``I`` (exact where measured, not
  NULL-calibrated). Its last row in the paper, the layers of the chapter top-40, is
  :func:`layer_table`.
* Table 15 (:func:`stability_table`): the split-half stability the ``attribute`` stage logs as
  ``stability/<phase>/*`` metrics.

The intervals need the per-note ``I_c``, which the attribute run does not log as a table: they
are recomputed from its per-note ``notes/<note>/attribution.npz`` with the same calibration
(:func:`mistill.instrument.calibration.calibrate`, the run's ``fdr_q`` and ``seed``);
:func:`load_calibration` checks that the recomputed ``I_c`` equals the run's ``head_sets.json``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from analysis.query import read_json_artifact, run_config
from mistill import stats
from mistill.errors import MistillInputError
from mistill.instrument.calibration import (PHASES, Calibration, NoteImportance, calibrate, importance_c_intervals,
                                            ranking)
from mistill.instrument.passes import NoteAttribution
from mistill.stages.common import RunReader
from mistill.tracking.naming import metric_name

__all__ = ["AttributeData", "PHASE_NAMES", "importance_table", "layer_table",
           "load_calibration", "profile", "stability_table"]

PHASE_NAMES: dict[str, str] = {"P1": "chapter", "P2": "character", "P2C": "contrastive"}
NOTES_DIR = "notes"
ATTRIBUTION_FILE = "attribution.npz"
HEAD_SETS = "head_sets.json"
IC_TOLERANCE = 1e-4
"""Largest |recomputed - logged| ``I_c`` (nats) accepted: ``head_sets.json`` holds float32
importances averaged in float64 and written as JSON floats, so the two agree to ~1e-7; a larger
gap means the per-note files are not the ones the run calibrated."""


@dataclass
class AttributeData:
    """One attribute run's calibration rebuilt from its per-note files, and its head names."""

    run_id: str
    model: str
    calibration: Calibration
    head_names: list[str]


def _note_ids(client: Any, run_id: str) -> list[str]:
    return sorted(a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run_id, NOTES_DIR)
                  if a.is_dir)


def load_calibration(client: Any, run_id: str, model: str) -> AttributeData:
    """Rebuild the run's :class:`Calibration` from its per-note ``attribution.npz``.

    Raises:
        MistillInputError: no ``head_sets.json``, no per-note files, or a recomputed ``I_c``
            that differs from the logged one by more than :data:`IC_TOLERANCE`.
    """
    sets = read_json_artifact(run_id, HEAD_SETS)
    if not isinstance(sets, dict) or "meta" not in sets:
        raise MistillInputError(f"attribute run {run_id} has no readable {HEAD_SETS}",
                                field=HEAD_SETS)
    cfg = (run_config(run_id) or {}).get("config", {})
    reader = RunReader(run_id, field="attribute_run")
    notes = []
    for note_id in _note_ids(client, run_id):
        att = NoteAttribution.from_npz(reader.note_file(NOTES_DIR, note_id, ATTRIBUTION_FILE),
                                       note_id)
        # patients only matter for split-half stability, which is read from the run's metrics
        notes.append(NoteImportance(note_id=note_id, patient_id=note_id,
                                    kinds=np.array(att.kinds), importance=att.importance,
                                    exact_mask=~np.isnan(att.exact)))
    if not notes:
        raise MistillInputError(f"attribute run {run_id} has no per-note {ATTRIBUTION_FILE}",
                                field=ATTRIBUTION_FILE)
    cal = calibrate(notes, q=float(cfg.get("fdr_q", sets["meta"].get("q", 0.05))),
                    seed=int(cfg.get("seed", sets["meta"].get("seed", 0))))
    names = _head_names(sets, cal.n_heads)
    _check_logged(run_id, cal, sets, names)
    return AttributeData(run_id, model, cal, names)


def _head_names(sets: dict, n_heads: int) -> list[str]:
    geometry = sets["meta"].get("geometry") or {}
    per_layer = geometry.get("n_heads")
    if per_layer:
        return [f"L{h // int(per_layer)}H{h % int(per_layer)}" for h in range(n_heads)]
    for phase in PHASES:
        if phase in sets and len(sets[phase].get("ranking", [])) == n_heads:
            by_name = sets[phase]["ranking"]
            return sorted(by_name, key=_layer_head)
    return [f"h{h}" for h in range(n_heads)]


def _layer_head(name: str) -> tuple[int, int]:
    """``L12H3`` -> ``(12, 3)``; a name of another form sorts last."""
    try:
        layer, head = name[1:].split("H", 1)
        return int(layer), int(head)
    except ValueError:
        return (1 << 30, 0)


def _check_logged(run_id: str, cal: Calibration, sets: dict, names: list[str]) -> None:
    index = {n: i for i, n in enumerate(names)}
    for phase in cal.phases:
        body = sets.get(phase)
        if not isinstance(body, dict) or not body.get("ranking"):
            continue
        logged = np.array([v for v in body["importance_c"]], dtype=float)
        mine = cal.importance_c[phase][[index[n] for n in body["ranking"]]]
        gap = float(np.nanmax(np.abs(mine - logged))) if logged.size else 0.0
        if not gap <= IC_TOLERANCE:
            raise MistillInputError(
                f"attribute run {run_id}: I_c recomputed from its per-note files differs from "
                f"{HEAD_SETS} by {gap:.3g} at {phase}", field=ATTRIBUTION_FILE)


# ------------------------------------------------------------------------------------ Table 11
def _ranks(x: np.ndarray) -> np.ndarray:
    """``[head]`` 1-based rank of each head in the ``I_c`` ranking."""
    out = np.empty(x.size, dtype=int)
    out[ranking(x)] = np.arange(1, x.size + 1)
    return out


def profile(ranks: dict[str, int], profile_k: int) -> str:
    """**[recon]** A head's write-side profile from its ranks per phase: ``shared`` when it is in
    the top ``profile_k`` of every phase, ``<phase name>-specific`` when in exactly one, the
    phases joined by ``+`` when in some, ``-`` when in none."""
    high = [p for p in PHASES if p in ranks and ranks[p] <= profile_k]
    if not high:
        return "-"
    if len(high) == len(ranks) and len(high) > 1:
        return "shared"
    if len(high) == 1:
        return f"{PHASE_NAMES[high[0]]}-specific"
    return "+".join(high)


def importance_table(data: AttributeData, *, top_k: int = 8, profile_k: int = 40,
                     n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """Table 11 (numeric) of one attribute run: **[recon]** the heads in the top ``top_k`` of
    any calibrated phase, ordered by their best rank (then by P1, P2, P2C rank). Per phase:
    ``<phase>.I_c``, ``.ci_low``, ``.ci_high`` (bootstrap over notes), ``.rank`` (of
    ``n_heads``); then ``profile`` (:func:`profile`) and ``P2C.I_raw`` (raw importance, exact
    where measured)."""
    cal = data.calibration
    phases = [p for p in PHASES if cal.n_notes.get(p, 0) > 0]
    if not phases:
        raise MistillInputError(f"attribute run {data.run_id} calibrates no phase",
                                field="importance_c")
    ranks = {p: _ranks(cal.importance_c[p]) for p in phases}
    heads = sorted({int(h) for p in phases for h in ranking(cal.importance_c[p])[:top_k]},
                   key=lambda h: (min(ranks[p][h] for p in phases),
                                  *[ranks[p][h] for p in phases]))
    cis = {p: importance_c_intervals(cal, p, heads, n_resamples=n_resamples, seed=seed)
           for p in phases}
    rows = []
    for h in heads:
        rec: dict[str, Any] = {"run_id": data.run_id, "model": data.model,
                               "head": data.head_names[h]}
        for p in phases:
            ci = cis[p][h]
            rec.update({f"{p}.I_c": ci.estimate, f"{p}.ci_low": ci.low, f"{p}.ci_high": ci.high,
                        f"{p}.rank": int(ranks[p][h])})
        rec["profile"] = profile({p: int(ranks[p][h]) for p in phases}, profile_k)
        raw = cal.importance.get("P2C")
        rec["P2C.I_raw"] = float(raw[h]) if raw is not None and np.isfinite(raw[h]) else math.nan
        rows.append(rec)
    table = pd.DataFrame.from_records(rows)
    table.attrs["n_heads"] = cal.n_heads
    table.attrs["n_notes"] = {p: int(cal.n_notes[p]) for p in phases}
    return table


def importance_display(table: pd.DataFrame) -> pd.DataFrame:
    """Table 11 as printed: per phase ``I_c [95% CI]`` and ``rank/n_heads``."""
    n_heads = table.attrs.get("n_heads", "")
    out = []
    for _, r in table.iterrows():
        rec: dict[str, Any] = {"model": r["model"], "head": r["head"]}
        for p in PHASES:
            if f"{p}.I_c" not in table.columns:
                continue
            rec[f"{p} I_c [95% CI]"] = (f"{r[f'{p}.I_c']:.3f} [{r[f'{p}.ci_low']:.3f}, "
                                        f"{r[f'{p}.ci_high']:.3f}]")
            rec[f"{p} rank"] = f"{int(r[f'{p}.rank'])}/{n_heads}"
        rec["profile"] = r["profile"]
        rec["P2C raw I"] = "" if pd.isna(r["P2C.I_raw"]) else f"{r['P2C.I_raw']:.3f}"
        out.append(rec)
    return pd.DataFrame.from_records(out)


def layer_blocks(n_layers: int, bounds: Sequence[float]) -> list[tuple[int, int]]:
    """**[recon]** Layer blocks ``[(first, last)]`` at the fractions ``bounds`` of the depth
    (the paper's 0-11 / 12-23 / 24-31 / 32-39 of 40 layers are the fractions 0.3, 0.6, 0.8)."""
    cuts = [0] + [int(round(b * n_layers)) for b in bounds] + [n_layers]
    return [(a, b - 1) for a, b in zip(cuts, cuts[1:]) if b > a]


def layer_table(data: AttributeData, *, phase: str = "P1", k: int = 40,
                bounds: Sequence[float] = (0.3, 0.6, 0.8)) -> pd.DataFrame:
    """Table 11's last row: per layer block, the heads of the ``phase`` top-``k`` in it and their
    share of the top-``k``'s summed ``I_c``."""
    cal = data.calibration
    if cal.n_notes.get(phase, 0) == 0:
        raise MistillInputError(f"attribute run {data.run_id} does not calibrate {phase}",
                                field="importance_c")
    x = cal.importance_c[phase]
    top = ranking(x)[:k]
    layers = np.array([_layer_head(data.head_names[h])[0] for h in top])
    n_layers = max(_layer_head(n)[0] for n in data.head_names) + 1
    total = float(x[top].sum())
    rows = []
    for first, last in layer_blocks(n_layers, bounds):
        inside = (layers >= first) & (layers <= last)
        rows.append({"run_id": data.run_id, "model": data.model, "phase": phase,
                     "top_k": int(len(top)), "layers": f"{first}-{last}",
                     "n_heads": int(inside.sum()),
                     "share_I_c": float(x[top][inside].sum()) / total if total else math.nan})
    return pd.DataFrame.from_records(rows)


# ------------------------------------------------------------------------------------ Table 15
STABILITY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("n_splits", "splits"), ("n_patients", "patients"), ("n_notes", "notes"),
    ("spearman", "Spearman"), ("top_overlap.8", "top-8 overlap"),
    ("top_overlap.16", "top-16 overlap"), ("top_overlap.40", "top-40 overlap"),
    ("full_overlap", "half vs full top-40"))
"""Table 15's columns, in order: a key (``top_overlap.8`` is the metric
``stability/<phase>/top_overlap/8`` of an attribute run) and its label."""


def stability_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Table 15: per attribute run and phase, the medians over splits it logged; a phase the
    run logged no stability for is left out (none at all: an empty frame)."""
    rows = []
    for _, run in runs.iterrows():
        for phase in PHASES:
            keys = [metric_name("stability", phase, *k.split(".")) for k, _ in STABILITY_COLUMNS]
            if not any(k in runs.columns and pd.notna(run[k]) for k in keys):
                continue
            rec: dict[str, Any] = {"run_id": run["run_id"], "model": run["model"],
                                   "phase": phase}
            for (key, _), col in zip(STABILITY_COLUMNS, keys):
                rec[key] = float(run[col]) if col in runs.columns and pd.notna(run[col]) \
                    else math.nan
            rows.append(rec)
    return pd.DataFrame.from_records(rows, columns=["run_id", "model", "phase",
                                                    *(k for k, _ in STABILITY_COLUMNS)])


def stability_display(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    for _, r in table.iterrows():
        rec: dict[str, Any] = {"model": r["model"], "phase": r["phase"]}
        for key, label in STABILITY_COLUMNS:
            v = r[key]
            rec[label] = "" if pd.isna(v) else (f"{int(v)}" if key.startswith("n_") else
                                                f"{v:.3f}" if key == "spearman" else f"{v:g}")
        out.append(rec)
    return pd.DataFrame.from_records(out, columns=["model", "phase",
                                                   *(label for _, label in STABILITY_COLUMNS)])
