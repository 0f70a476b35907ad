"""The audit of contrastive events (Sec. 2.2, App. C; Table 5, R-C9): the stratified draw, the
blinded sheet and the label shares.

A P2C event is defined by mention order: the near-miss sibling was named earlier in the trace. The
audit reads what that earlier mention is. Its population is the P2C events of the teacher's traces
on the audited notes, each in one of eight strata (:func:`stratum_of`) by

- tokenizer alignment: whether every student tokenizer also realizes the event;
- gold status: whether the emitted code is one of the note's gold codes;
- the answer: whether the emitted code reaches the trace's final answer.

:func:`allocate` spreads the sample over the strata and :func:`draw` takes a seeded random sample
within each; the sheet (:func:`sheet_rows`) lists the drawn events in a seeded shuffled order
with the trace's text around the earlier mention and around the decision, and without the
stratum, so the reader labels blind. :func:`label_shares` gives each label's raw share with its
exact binomial (Clopper-Pearson) 95 % interval and its share weighted by the strata's population
sizes (each stratum's share of its sample times its share of the population).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from mistill import stats

FACTORS = ("aligned", "gold", "in_answer")
"""The three binary factors of a stratum, in its name's order."""

STRATA: tuple[str, ...] = tuple(
    f"{'aligned' if a else 'unaligned'}/{'gold' if g else 'not_gold'}/{'in_answer' if i else 'not_in_answer'}"
    for a in (True, False) for g in (True, False) for i in (True, False))
"""The eight strata, in allocation order."""

FRAME_COLUMNS = ("note_id", "event_id", "code", "near_miss", "aligned", "gold", "in_answer", "stratum")
"""One row per P2C event of the population (ids, codes and factors: no text)."""

SHEET_COLUMNS = ("sheet_order", "note_id", "event_id", "code", "near_miss", "earlier_mention", "decision", "label")
"""The blinded sheet: the drawn events in shuffled order, the trace around the earlier mention and
around the decision (``[...]`` marks the mention and the decision character), an empty label."""

SHARE_COLUMNS = ("label", "n", "share", "ci_low", "ci_high", "weighted_share")


def stratum_of(aligned: bool, gold: bool, in_answer: bool) -> str:
    """The stratum name of an event's three factors."""
    return STRATA[4 * (not aligned) + 2 * (not gold) + (not in_answer)]


def allocate(populations: Mapping[str, int], n: int) -> dict[str, int]:
    """**[recon]** ``n`` sampled events spread as evenly as the strata allow: one at a time to each
    stratum with events left, in :data:`STRATA` order, until ``n`` are placed or none is left (the
    paper states 181 events over eight strata with population weights, not the allocation)."""
    left = {s: int(populations.get(s, 0)) for s in STRATA}
    out = dict.fromkeys(STRATA, 0)
    placed = 0
    while placed < n and any(left.values()):
        for s in STRATA:
            if placed < n and left[s]:
                out[s] += 1
                left[s] -= 1
                placed += 1
    return out


def draw(frame: pd.DataFrame, n: int, seed: int) -> pd.DataFrame:
    """The stratified sample of ``frame`` (:data:`FRAME_COLUMNS`): :func:`allocate`'s count from each
    stratum, drawn without replacement by ``numpy.random.default_rng(seed)`` over the stratum's
    events in (note, event) order; the result in stratum then frame order, with ``sheet_order``,
    a seeded shuffle (1-based) that hides the strata from the reader."""
    rng = np.random.default_rng(seed)
    frame = frame.sort_values(["note_id", "event_id"], kind="stable").reset_index(drop=True)
    counts = allocate(frame["stratum"].value_counts().to_dict(), n)
    parts = []
    for s in STRATA:
        members = frame.index[frame["stratum"] == s].to_numpy()
        if counts[s]:
            picked = np.sort(rng.choice(members, size=counts[s], replace=False))
            parts.append(frame.loc[picked])
    drawn = pd.concat(parts, ignore_index=True) if parts else frame.iloc[:0].copy()
    drawn["sheet_order"] = rng.permutation(len(drawn)) + 1
    return drawn


def marked_context(text: str, span: tuple[int, int], chars: int) -> str:
    """``text`` around ``span``: ``chars`` characters either side, the span in ``[...]``."""
    a, b = int(span[0]), int(span[1])
    lo, hi = max(0, a - chars), min(len(text), b + chars)
    return f"{text[lo:a]}[{text[a:b]}]{text[b:hi]}"


def sheet_rows(drawn: pd.DataFrame, traces: Mapping[str, str], spans: Mapping[tuple[str, str], tuple], chars: int,
               ) -> pd.DataFrame:
    """The blinded sheet (:data:`SHEET_COLUMNS`) in ``sheet_order``. ``traces``: note id -> trace
    text; ``spans``: (note id, event id) -> (earlier mention span, decision span)."""
    rows = []
    for _, r in drawn.sort_values("sheet_order").iterrows():
        text = traces[r["note_id"]]
        earlier, decision = spans[(r["note_id"], r["event_id"])]
        rows.append({"sheet_order": int(r["sheet_order"]), "note_id": r["note_id"], "event_id": r["event_id"],
                     "code": r["code"], "near_miss": r["near_miss"],
                     "earlier_mention": marked_context(text, earlier, chars),
                     "decision": marked_context(text, decision, chars), "label": ""})
    return pd.DataFrame(rows, columns=list(SHEET_COLUMNS))


def label_shares(labelled: pd.DataFrame, populations: Mapping[str, int], level: float = 0.95) -> pd.DataFrame:
    """Each label's share of the labelled events (:data:`SHARE_COLUMNS`): raw with its exact
    binomial interval, and weighted by the strata's populations, ``sum_s (N_s / N) p_s`` over the
    strata with labelled events (``N`` their total population).

    labelled: one row per labelled event with ``stratum`` and ``label``."""
    n_all = len(labelled)
    if not n_all:
        return pd.DataFrame(columns=list(SHARE_COLUMNS))
    sampled = [s for s in STRATA if (labelled["stratum"] == s).any()]
    total = sum(int(populations.get(s, 0)) for s in sampled)
    rows = []
    for label in sorted(labelled["label"].unique()):
        k = int((labelled["label"] == label).sum())
        low, high = stats.exact_binomial_ci(k, n_all, level)
        weighted = sum(int(populations.get(s, 0)) / total * float((labelled.loc[labelled["stratum"] == s, "label"]
                                                                    == label).mean()) for s in sampled) \
            if total else math.nan
        rows.append({"label": label, "n": k, "share": k / n_all, "ci_low": low, "ci_high": high,
                     "weighted_share": weighted})
    return pd.DataFrame(rows, columns=list(SHARE_COLUMNS))


def frame_rows(events: Sequence[dict], realized_by_all: set[str], gold: set[str], answer: set[str]) -> list[dict]:
    """The population rows (:data:`FRAME_COLUMNS`) of one note's P2C events (``events.jsonl``
    records realized in the teacher's tokenizer): aligned when every student tokenizer realizes the
    event id, gold when the emitted code is gold, in_answer when it is in the trace's answer."""
    rows = []
    for e in events:
        if e["kind"] != "P2C":
            continue
        a, g, i = e["event_id"] in realized_by_all, e["code"] in gold, e["code"] in answer
        rows.append({"note_id": e["note_id"], "event_id": e["event_id"], "code": e["code"],
                     "near_miss": e["near_miss"], "aligned": a, "gold": g, "in_answer": i,
                     "stratum": stratum_of(a, g, i)})
    return rows


__all__ = ["FACTORS", "STRATA", "FRAME_COLUMNS", "SHEET_COLUMNS", "SHARE_COLUMNS", "stratum_of", "allocate", "draw",
           "marked_context", "sheet_rows", "label_shares", "frame_rows"]
