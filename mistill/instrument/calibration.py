"""NULL calibration of head importances, global sets and pooled weights (paper Sec. 2, App. C
"NULL events and calibration.", "Statistics.", App. D "Pooled weights", "Recurrence.",
"Sparsity.", "Stability of the discovery across notes.").

Input is one :class:`NoteImportance` per note: the importance ``I`` of every head at every
event of the note (``[event, head]``, positive = the head supports the emitted choice), as
written by the attribution pass. Everything here is arithmetic over notes:

* **Decision-specific importance** ``I_c``: per note, a head's mean importance over the note's
  events of a phase minus its mean over the note's NULL events; then the mean over notes. A
  head with a generic effect on letter logits moves every letter margin alike, NULL included,
  and so vanishes from ``I_c``.
* **Calibration check**: per head a one-sample t-test across notes, Benjamini-Hochberg at FDR
  ``q``, discoveries split by sign; the same on raw NULL importance (which fails: generic heads
  are discovered where nothing is decided) and on the split-half NULL contrast (one half of a
  note's NULL events minus the other half), which must give ~0 discoveries. The noise floor is
  the 95th percentile over heads of the absolute split-half contrast averaged over notes.
* **Global set** of a phase: top-k by ``I_c``; **pooled weights** ``softmax(I_c / tau)`` over
  the set, ``tau`` the standard deviation of the set's ``I_c``.

Choices this module makes (the paper leaves them open; each **[recon]**):

* **[recon]** A note enters ``I_c`` of a phase only if it has events of that phase *and* NULL
  events; the raw phase importance averages over every note with events of the phase (as
  Table 13 does).
* **[recon]** The split-half NULL halves are drawn per note from a generator seeded by
  ``(seed, sha256 of the note id)``, so the check does not depend on note order. A note with
  fewer than two NULL events has no split. With an odd count the first half is the smaller one.
  The noise floor is the paper's (App. D "Sparsity": the 95th percentile of the absolute
  split-half NULL difference).
* **[recon]** Rankings are descending with ties broken by the lower flat head index; bottom
  sets are the most negative first, ties again by the lower index. A requested ``k`` larger
  than the number of heads is clipped to it.
* **[recon]** Split-half stability splits *patients*: every note of a patient goes to the same
  half (the paper splits "the full corpus into two halves", App. D; its 6 second prompt
  variants of a patient would otherwise sit on both sides).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from mistill import stats
from mistill.errors import MistillInputError
from mistill.instrument.events import KINDS

__all__ = [
    "PHASES", "NoteImportance", "Calibration", "kind_means", "note_importance_c", "calibrate",
    "ranking", "global_set", "bottom_set", "pool_temperature", "pooled_weights", "own_ranking",
    "head_sets_json", "importance_c_intervals", "recurrence", "sparsity",
    "split_half_stability", "calibratable_patients", "head_name",
]

PHASES: tuple[str, ...] = ("P1", "P2", "P2C")


def head_name(flat: int, n_heads: int) -> str:
    """``L{layer}H{head}`` of a flat head index ``layer * n_heads + head``."""
    return f"L{flat // n_heads}H{flat % n_heads}"


# --------------------------------------------------------------------------------------------
# Input
# --------------------------------------------------------------------------------------------

@dataclass
class NoteImportance:
    """Head importances of one note at each of its events.

    kinds: ``[event]`` str, one of P1 / P2 / P2C / NULL.
    importance: ``[event, head]`` float32, heads flat (``layer * n_heads + head``); exact
    mean-ablation effect where measured, first-order estimate elsewhere; positive = the head
    supports the emitted choice.
    exact_mask: optional ``[event, head]`` bool, True where ``importance`` is exact.
    """

    note_id: str
    patient_id: str
    kinds: np.ndarray
    importance: np.ndarray
    exact_mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.note_id = str(self.note_id)
        self.patient_id = str(self.patient_id)
        self.kinds = np.asarray(self.kinds).astype(str)
        self.importance = np.asarray(self.importance, dtype=np.float32)
        if self.kinds.ndim != 1:
            raise MistillInputError(f"kinds must be [event], got shape {self.kinds.shape}",
                                    note=self.note_id, field="kinds")
        if self.importance.ndim != 2 or self.importance.shape[0] != self.kinds.shape[0]:
            raise MistillInputError(
                f"importance must be [event, head] with {self.kinds.shape[0]} events, got shape "
                f"{self.importance.shape}", note=self.note_id, field="importance")
        unknown = sorted(set(self.kinds.tolist()) - set(KINDS))
        if unknown:
            raise MistillInputError(f"unknown event kinds {unknown}; expected {list(KINDS)}",
                                    note=self.note_id, field="kinds")
        if not np.all(np.isfinite(self.importance)):
            raise MistillInputError("importance has non-finite values", note=self.note_id,
                                    field="importance")
        if self.exact_mask is not None:
            self.exact_mask = np.asarray(self.exact_mask, dtype=bool)
            if self.exact_mask.shape != self.importance.shape:
                raise MistillInputError(
                    f"exact_mask shape {self.exact_mask.shape} differs from importance "
                    f"{self.importance.shape}", note=self.note_id, field="exact_mask")

    @property
    def n_heads(self) -> int:
        return int(self.importance.shape[1])

    def events_of(self, kind: str) -> np.ndarray:
        """``[event_of_kind, head]`` importances of the note's events of one kind."""
        return self.importance[self.kinds == kind]


def kind_means(ni: NoteImportance) -> dict[str, np.ndarray]:
    """Mean importance over the note's events of each kind present: ``kind -> [head]``."""
    out = {}
    for kind in KINDS:
        rows = ni.events_of(kind)
        if len(rows):
            out[kind] = rows.mean(0, dtype=np.float64)
    return out


def note_importance_c(ni: NoteImportance, phase: str) -> np.ndarray | None:
    """The note's own ``I_c`` for a phase: mean over its phase events minus mean over its NULL
    events, ``[head]``; None if it lacks either."""
    means = kind_means(ni)
    if phase not in means or "NULL" not in means:
        return None
    return means[phase] - means["NULL"]


def calibratable_patients(notes: Sequence[NoteImportance], phase: str) -> set[str]:
    """The patients with at least one note holding both ``phase`` and NULL events: the units
    :func:`split_half_stability` splits (it needs two, the stages ask for four)."""
    return {ni.patient_id for ni in notes if note_importance_c(ni, phase) is not None}


def _check_notes(notes: Sequence[NoteImportance]) -> int:
    if not notes:
        raise MistillInputError("no notes to calibrate", field="notes")
    n_heads = notes[0].n_heads
    seen: set[str] = set()
    for ni in notes:
        if ni.n_heads != n_heads:
            raise MistillInputError(f"note has {ni.n_heads} heads, the first note {n_heads}",
                                    note=ni.note_id, field="importance")
        if ni.note_id in seen:
            raise MistillInputError("note id appears twice", note=ni.note_id, field="note_id")
        seen.add(ni.note_id)
    return n_heads


def _check_phases(phases: Sequence[str]) -> tuple[str, ...]:
    bad = [p for p in phases if p not in PHASES]
    if bad or not phases:
        raise MistillInputError(f"phases must be among {list(PHASES)}, got {list(phases)}",
                                field="phases")
    return tuple(phases)


def _note_rng(seed: int, note_id: str) -> np.random.Generator:
    digest = int.from_bytes(hashlib.sha256(note_id.encode("utf-8")).digest()[:8], "little")
    return np.random.default_rng([int(seed), digest])


def _split_half_null(ni: NoteImportance, seed: int) -> np.ndarray | None:
    """One half of the note's NULL events minus the other half, ``[head]``; None if < 2."""
    rows = ni.events_of("NULL")
    if len(rows) < 2:
        return None
    order = _note_rng(seed, ni.note_id).permutation(len(rows))
    half = len(rows) // 2
    first, second = rows[order[:half]], rows[order[half:]]
    return first.mean(0, dtype=np.float64) - second.mean(0, dtype=np.float64)


# --------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------

@dataclass
class Calibration:
    """Result of :func:`calibrate`. Vectors are ``[head]``, per-note matrices ``[note, head]``.

    importance_c: phase -> mean over notes of per-note ``I_c``.
    importance: phase -> mean over notes (with events of the phase) of the raw per-note mean.
    importance_null: mean over notes of the raw per-note NULL mean.
    per_note_c / note_ids: the per-note ``I_c`` rows and the notes they belong to.
    t_c, p_adj_c, positive_c, negative_c: per-head t, BH-adjusted p and signed discoveries of
    ``I_c``; the same ``*_null`` for raw NULL importance and ``*_split`` for the split-half
    NULL contrast. split_half_diff: mean over notes of the split-half contrast.
    noise_floor: 95th percentile over heads of ``|split_half_diff|``.
    exact_share: phase -> share of (event, head) entries that are exact (NaN without masks).
    """

    phases: tuple[str, ...]
    q: float
    n_heads: int
    importance_c: dict[str, np.ndarray]
    importance: dict[str, np.ndarray]
    importance_null: np.ndarray
    per_note_c: dict[str, np.ndarray]
    note_ids: dict[str, list[str]]
    n_notes: dict[str, int]
    n_notes_raw: dict[str, int]
    t_c: dict[str, np.ndarray]
    p_adj_c: dict[str, np.ndarray]
    positive_c: dict[str, np.ndarray]
    negative_c: dict[str, np.ndarray]
    n_notes_null: int
    positive_null: np.ndarray
    negative_null: np.ndarray
    n_notes_split: int
    split_half_diff: np.ndarray
    positive_split: np.ndarray
    negative_split: np.ndarray
    noise_floor: float
    exact_share: dict[str, float] = field(default_factory=dict)
    seed: int = 0

    def summary(self) -> dict[str, float]:
        """Scalar metrics for MLflow: ``calib/<phase>/*``, ``calib/NULL/*`` (raw NULL
        importance) and ``calib/split_half/*`` (the split-half NULL check)."""
        out: dict[str, float] = {}
        for ph in self.phases:
            out[f"calib/{ph}/n_notes"] = float(self.n_notes[ph])
            out[f"calib/{ph}/discoveries_pos"] = float(self.positive_c[ph].sum())
            out[f"calib/{ph}/discoveries_neg"] = float(self.negative_c[ph].sum())
            if not np.isnan(self.exact_share.get(ph, np.nan)):
                out[f"calib/{ph}/exact_share"] = float(self.exact_share[ph])
        out["calib/NULL/n_notes"] = float(self.n_notes_null)
        out["calib/NULL/discoveries_pos"] = float(self.positive_null.sum())
        out["calib/NULL/discoveries_neg"] = float(self.negative_null.sum())
        out["calib/split_half/n_notes"] = float(self.n_notes_split)
        out["calib/split_half/discoveries_pos"] = float(self.positive_split.sum())
        out["calib/split_half/discoveries_neg"] = float(self.negative_split.sum())
        out["calib/split_half/noise_floor"] = float(self.noise_floor)
        return out


def _mean_rows(rows: list[np.ndarray], n_heads: int) -> np.ndarray:
    return np.mean(rows, axis=0) if rows else np.full(n_heads, np.nan)


def _signed(rows: list[np.ndarray], n_heads: int, q: float) -> stats.SignedDiscoveries:
    if len(rows) < 2:  # no test possible: nothing discovered
        nan = np.full(n_heads, np.nan)
        none = np.zeros(n_heads, dtype=bool)
        return stats.SignedDiscoveries(t=nan, p=nan, p_adjusted=nan, positive=none,
                                       negative=none.copy())
    return stats.signed_discoveries(np.stack(rows), q)


def calibrate(notes: Sequence[NoteImportance], *, phases: Sequence[str] = PHASES,
              q: float = 0.05, seed: int = 0) -> Calibration:
    """NULL-calibrate per-note head importances and run the App. C calibration checks.

    notes: one :class:`NoteImportance` per note, all with the same number of heads.
    Returns a :class:`Calibration`; a phase no note can calibrate has NaN vectors and 0 notes.
    """
    n_heads = _check_notes(notes)
    phases = _check_phases(phases)
    means = [kind_means(ni) for ni in notes]

    importance_c, importance, per_note_c, note_ids = {}, {}, {}, {}
    n_notes, n_notes_raw, t_c, p_adj_c, pos_c, neg_c, exact_share = {}, {}, {}, {}, {}, {}, {}
    for ph in phases:
        rows, ids, raw = [], [], []
        exact_num = exact_den = 0
        for ni, m in zip(notes, means):
            if ph not in m:
                continue
            raw.append(m[ph])
            if ni.exact_mask is not None:
                sel = ni.exact_mask[ni.kinds == ph]
                exact_num += int(sel.sum())
                exact_den += sel.size
            if "NULL" in m:
                rows.append(m[ph] - m["NULL"])
                ids.append(ni.note_id)
        sd = _signed(rows, n_heads, q)
        importance_c[ph] = _mean_rows(rows, n_heads)
        importance[ph] = _mean_rows(raw, n_heads)
        per_note_c[ph] = np.stack(rows) if rows else np.zeros((0, n_heads))
        note_ids[ph] = ids
        n_notes[ph], n_notes_raw[ph] = len(rows), len(raw)
        t_c[ph], p_adj_c[ph], pos_c[ph], neg_c[ph] = sd.t, sd.p_adjusted, sd.positive, sd.negative
        exact_share[ph] = exact_num / exact_den if exact_den else float("nan")

    null_rows = [m["NULL"] for m in means if "NULL" in m]
    sd_null = _signed(null_rows, n_heads, q)
    split_rows = [d for d in (_split_half_null(ni, seed) for ni in notes) if d is not None]
    sd_split = _signed(split_rows, n_heads, q)
    split_diff = _mean_rows(split_rows, n_heads)
    floor = float(np.percentile(np.abs(split_diff), 95)) if split_rows else float("nan")

    return Calibration(
        phases=phases, q=q, n_heads=n_heads, importance_c=importance_c, importance=importance,
        importance_null=_mean_rows(null_rows, n_heads), per_note_c=per_note_c, note_ids=note_ids,
        n_notes=n_notes, n_notes_raw=n_notes_raw, t_c=t_c, p_adj_c=p_adj_c, positive_c=pos_c,
        negative_c=neg_c, n_notes_null=len(null_rows), positive_null=sd_null.positive,
        negative_null=sd_null.negative, n_notes_split=len(split_rows), split_half_diff=split_diff,
        positive_split=sd_split.positive, negative_split=sd_split.negative, noise_floor=floor,
        exact_share=exact_share, seed=seed)


def importance_c_intervals(cal: Calibration, phase: str, heads: Sequence[int], *,
                           n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0,
                           level: float = 0.95) -> dict[int, stats.CI]:
    """Percentile bootstrap interval (notes resampled) of the mean ``I_c`` of each listed head."""
    x = cal.per_note_c[phase]
    if len(x) == 0:
        raise MistillInputError(f"no notes calibrate phase {phase}", field="phase")
    return {int(h): stats.bootstrap_ci(x[:, int(h)], np.mean, n_resamples=n_resamples, seed=seed,
                                       level=level) for h in heads}


# --------------------------------------------------------------------------------------------
# Rankings, sets, pooled weights
# --------------------------------------------------------------------------------------------

def _vector(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    if x.ndim != 1 or not np.all(np.isfinite(x)):
        raise MistillInputError(f"expected a finite [head] vector, got shape {x.shape}",
                                field=name)
    return x


def ranking(importance_c: np.ndarray) -> np.ndarray:
    """Flat head indices by descending importance, ties by lower index. ``[head] -> [head]``."""
    x = _vector(importance_c, "importance_c")
    return np.lexsort((np.arange(x.size), -x))


def global_set(importance_c: np.ndarray, k: int) -> np.ndarray:
    """The top-k heads by ``I_c`` (k clipped to the number of heads), best first."""
    return ranking(importance_c)[:max(0, int(k))]


def bottom_set(importance_c: np.ndarray, k: int) -> np.ndarray:
    """The k most negative heads by ``I_c``, most negative first, ties by lower index."""
    x = _vector(importance_c, "importance_c")
    return np.lexsort((np.arange(x.size), x))[:max(0, int(k))]


def pool_temperature(importance_c: np.ndarray, heads: Sequence[int]) -> float:
    """``tau``: the standard deviation (ddof=0) of the heads' ``I_c``."""
    x = _vector(importance_c, "importance_c")[np.asarray(heads, dtype=int)]
    return float(x.std()) if x.size else float("nan")


def pooled_weights(importance_c: np.ndarray, heads: Sequence[int]) -> np.ndarray:
    """``w_h = softmax(I_c / tau)`` over ``heads`` (in their order), ``tau`` = s.d. of their
    ``I_c``; uniform if ``tau`` is 0 or there is one head. ``[head_in_set]``."""
    idx = np.asarray(heads, dtype=int)
    if idx.size == 0:
        raise MistillInputError("pooled weights need at least one head", field="heads")
    x = _vector(importance_c, "importance_c")[idx]
    tau = float(x.std())
    if idx.size == 1 or tau == 0.0:
        return np.full(idx.size, 1.0 / idx.size)
    z = (x - x.max()) / tau
    w = np.exp(z)
    return w / w.sum()


def own_ranking(ni: NoteImportance, phase: str) -> np.ndarray:
    """The note's own ranking of heads by its own ``I_c`` for ``phase``, ``[head]``."""
    c = note_importance_c(ni, phase)
    if c is None:
        raise MistillInputError(f"note has no {phase} events or no NULL events", note=ni.note_id,
                                field="kinds")
    return ranking(c)


def head_sets_json(cal: Calibration, head_names: Sequence[str], *,
                   ks: Sequence[int] = (3, 8, 16, 40, 100), pool_k: int = 40) -> dict[str, Any]:
    """The ``head_sets.json`` document: per phase the full ranking by ``I_c`` (names), ``I_c``
    in ranking order, top-k and bottom-k names for every k, and the pooled weights over the
    top ``pool_k`` with their ``tau``; plus meta. Phases no note calibrates are listed in
    ``meta.phases_missing`` only. Plain Python types throughout."""
    names = list(head_names)
    if len(names) != cal.n_heads:
        raise MistillInputError(f"{len(names)} head names for {cal.n_heads} heads",
                                field="head_names")
    doc: dict[str, Any] = {"meta": {
        "n_heads": cal.n_heads, "q": float(cal.q), "ks": [int(k) for k in ks],
        "pool_k": int(pool_k), "n_notes": {ph: int(cal.n_notes[ph]) for ph in cal.phases},
        "noise_floor": _num(cal.noise_floor), "seed": int(cal.seed),
        "phases_missing": [ph for ph in cal.phases if cal.n_notes[ph] == 0]}}
    for ph in cal.phases:
        if cal.n_notes[ph] == 0:
            continue
        x = cal.importance_c[ph]
        order = ranking(x)
        pool = order[:max(1, int(pool_k))]
        w = pooled_weights(x, pool)
        doc[ph] = {
            "ranking": [names[h] for h in order],
            "importance_c": [float(x[h]) for h in order],
            "top": {str(k): [names[h] for h in order[:int(k)]] for k in ks},
            "bottom": {str(k): [names[h] for h in bottom_set(x, k)] for k in ks},
            "pool": {"k": int(pool.size), "tau": pool_temperature(x, pool),
                     "heads": [names[h] for h in pool],
                     "weights": {names[h]: float(wh) for h, wh in zip(pool, w)}},
            "n_notes": int(cal.n_notes[ph]),
            "discoveries_pos": int(cal.positive_c[ph].sum()),
            "discoveries_neg": int(cal.negative_c[ph].sum()),
        }
    return doc


def _num(x: float) -> float | None:
    return None if np.isnan(x) else float(x)


# --------------------------------------------------------------------------------------------
# App. D: recurrence, sparsity, split-half stability
# --------------------------------------------------------------------------------------------

def recurrence(notes: Sequence[NoteImportance], phase: str, *, top: int = 20,
               alpha: float = 0.05, head_names: Sequence[str] | None = None) -> pd.DataFrame:
    """Heads recurring in the notes' top-``top`` by raw importance (per-note mean over the
    phase's events, not calibrated).

    Per head: ``count`` of notes whose top set holds it, the ``expected`` count
    ``n_notes * top / n_heads``, the one-sided binomial ``p`` and its Bonferroni adjustment over
    heads, ``recurrent = p_bonferroni < alpha``. Rows sorted by count (descending), then head.
    ``df.attrs`` carries ``n_notes``, ``p_null``, ``n_recurrent``.
    """
    n_heads = _check_notes(notes)
    _check_phases([phase])
    top = min(int(top), n_heads)
    counts = np.zeros(n_heads, dtype=np.int64)
    n_notes = 0
    for ni in notes:
        rows = ni.events_of(phase)
        if not len(rows):
            continue
        counts[ranking(rows.mean(0, dtype=np.float64))[:top]] += 1
        n_notes += 1
    if n_notes == 0:
        raise MistillInputError(f"no note has {phase} events", field="kinds")
    p_null = top / n_heads
    rec = stats.binomial_recurrence(counts, n_notes, p_null)
    df = pd.DataFrame({"head": np.arange(n_heads), "count": counts,
                       "expected": np.full(n_heads, n_notes * p_null), "p": rec.p,
                       "p_bonferroni": rec.p_bonferroni,
                       "recurrent": rec.p_bonferroni < alpha})
    if head_names is not None:
        if len(head_names) != n_heads:
            raise MistillInputError(f"{len(head_names)} head names for {n_heads} heads",
                                    field="head_names")
        df.insert(1, "name", list(head_names))
    df = df.sort_values(["count", "head"], ascending=[False, True], kind="stable")
    df = df.reset_index(drop=True)
    df.attrs.update(n_notes=n_notes, p_null=p_null, n_recurrent=int(df["recurrent"].sum()))
    return df


def sparsity(importance_c: np.ndarray, noise_floor: float, *, share: float = 0.8) -> dict[str, Any]:
    """How many heads carry the decision: heads with positive ``I_c`` above the noise floor,
    and how many of them, largest first, carry ``share`` of the summed ``I_c`` of those heads.

    importance_c: ``[head]``. Returns counts and flat head indices (largest first)."""
    x = _vector(importance_c, "importance_c")
    order = ranking(x)
    above = order[(x[order] > noise_floor) & (x[order] > 0)]
    total = float(x[above].sum()) if above.size else 0.0
    if above.size and total > 0:
        cum = np.cumsum(x[above])
        n_carry = int(np.searchsorted(cum, share * total * (1 - 1e-12), side="left")) + 1
    else:
        n_carry = 0
    return {"noise_floor": float(noise_floor), "share": float(share),
            "n_above_floor": int(above.size), "heads_above_floor": [int(h) for h in above],
            "sum_above_floor": total, "n_carry": n_carry,
            "heads_carry": [int(h) for h in above[:n_carry]]}


def _overlap(a: np.ndarray, b: np.ndarray) -> int:
    return len(set(a.tolist()) & set(b.tolist()))


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra = pd.Series(a).rank().to_numpy()
    rb = pd.Series(b).rank().to_numpy()
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def split_half_stability(notes: Sequence[NoteImportance], phase: str, *, n_splits: int = 200,
                         seed: int = 0, ks: Sequence[int] = (8, 16, 40),
                         full_k: int = 40) -> dict[str, Any]:
    """Is the ``I_c`` ranking fitted to its notes? (Table 15.)

    ``n_splits`` times: split the patients (with a calibratable note of the phase) into two
    random halves, compute ``I_c`` on each half's notes, and record the Spearman correlation
    over all heads between the halves, the top-k overlaps between the halves, and each half's
    top-``full_k`` overlap with the full ranking. Returns the medians over splits (the
    full-ranking overlap over both halves of every split) and the counts.
    """
    n_heads = _check_notes(notes)
    _check_phases([phase])
    rows, patients = [], []
    for ni in notes:
        c = note_importance_c(ni, phase)
        if c is not None:
            rows.append(c)
            patients.append(ni.patient_id)
    uniq = sorted(set(patients))
    if len(uniq) < 2:
        raise MistillInputError(f"split-half stability needs notes of at least two patients "
                                f"with {phase} and NULL events", field="patient_id")
    x = np.stack(rows)                                   # [note, head]
    pidx = np.searchsorted(uniq, patients)               # [note] patient index
    full_top = global_set(x.mean(0), full_k)
    rng = np.random.default_rng(seed)
    rho, over, full_over = [], {int(k): [] for k in ks}, []
    for _ in range(int(n_splits)):
        in_a = np.zeros(len(uniq), dtype=bool)
        in_a[rng.permutation(len(uniq))[:len(uniq) // 2]] = True
        a, b = x[in_a[pidx]].mean(0), x[~in_a[pidx]].mean(0)
        rho.append(_spearman(a, b))
        for k in over:
            over[k].append(_overlap(global_set(a, k), global_set(b, k)))
        full_over += [_overlap(global_set(a, full_k), full_top),
                      _overlap(global_set(b, full_k), full_top)]
    rho_arr = np.asarray(rho)
    return {
        "phase": phase, "n_splits": int(n_splits), "n_patients": len(uniq), "n_notes": len(rows),
        "n_heads": n_heads,
        "spearman": _num(float(np.nanmedian(rho_arr))) if np.isfinite(rho_arr).any() else None,
        "top_overlap": {str(k): float(np.median(v)) for k, v in over.items()},
        "full_k": int(min(full_k, n_heads)),
        "full_overlap": float(np.median(full_over)),
    }

