"""Mechanism readouts on an arm's own heads (paper App. K "M2–M5 and the prefix share", App. L.4).

The arm's heads are ranked by the instrument (events + attribute, teacher-forced on the
validation notes); this module measures that ranking on other notes:

- **M4**: knock-in recovery of the own top-k into the next note's context (the donor, at a
  matched event with a different emitted choice, Sec. 2.3; the donor rules are the
  instrument's, :func:`mistill.instrument.passes.plan_donors`), beside count-matched random
  floors, and necessity (mean-ablation of the own top-k at the note's own events). Both are the
  instrument's own pass, :func:`mistill.instrument.passes.knockin_sweep`, run with the arm's
  ranking as the "global" set; the random floor is the instrument's ``random`` set, one draw
  per note, phase and bin, redrawn for every bin (App. K "Floors, medians and means").
  **[recon]** ``n_random`` > 1 averages that many seeded draws per bin (the paper: one).
- **M2 / M3 / prefix share**: the read side of the own top-16 (:mod:`mistill.instrument.readside`)
  beside a fixed panel of 16 random heads.
- **M5**: the forcing probe of the locus pass (:mod:`mistill.instrument.locus`) on the arm's own
  model: where each chapter mention becomes elicitable (at the event, in the window, inherited,
  or not at all: probe failure, censored) and how far before the letter.

Per-note values: recovery is the mean over the note's gated events (per draw for the floor, then
the mean over draws); necessity the mean over its events. The stage reports medians over notes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mistill.data.corpus import Note
from mistill.data.inventory import Inventory
from mistill.distill.buckets import build_axis, row_buckets, token_buckets
from mistill.instrument.events import RealizedEvent
from mistill.instrument.hooks import HeadHook
from mistill.instrument.inputs import (NoteInput, event_queries, note_input, phase_events, subsample_phase_events,
                                       trace_start_token)
from mistill.instrument.locus import OUTCOMES as LOCUS_OUTCOMES, SUFFIXES, MentionProbe, forced_choice_ids, locate_many
from mistill.instrument.locus_pass import note_mentions
from mistill.instrument.passes import (PHASES, DonorCandidate, DonorWork, EventQuery, KnockinConfig, floor_draw,
                                       knockin_sweep, plan_donors, stable_seed)
from mistill.instrument.readside import (bucket_rows, chapter_region, event_chapter, head_attention_rows, line_buckets,
                                         note_region_lift, note_share, region_lift, slot_share, token_counts)
from mistill.instrument.runner import Runner
from mistill.models.loading import LoadedModel
from mistill.tasks import note_items, task_for

__all__ = ["NoteCase", "note_case", "subsample_case", "draw_config", "own_knockin", "m4_rows", "random_panel",
           "place_head", "readside_note", "M2_PHASES", "m5_note", "m5_summary", "M5_OUTCOMES"]

M2_PHASES = ("P1", "P2C")


@dataclass
class NoteCase:
    """One note as the arm sees it: its input (prompt + trace tokens), realized events, queries."""

    note_id: str
    inp: NoteInput
    realized: list[RealizedEvent]
    queries: list[EventQuery]

    @property
    def n_tokens(self) -> int:
        return int(self.inp.input_ids.numel())

    @property
    def trace_start(self) -> int:
        """The index of the first trace token."""
        return trace_start_token(self.inp)

    def candidate(self) -> DonorCandidate:
        """The note as a possible donor."""
        return DonorCandidate(self.note_id, self.queries, self.n_tokens, self.trace_start)

    def phase_events(self) -> int:
        return sum(1 for q in self.queries if q.kind in PHASES)


def note_case(note: Note, inventory: Inventory, lm: LoadedModel, *, trace: str | None = None,
              remove_discharge_diagnosis: bool = True, narrow_instruction: bool = True,
              p2c_cap: int = 2, require_think: bool = True, max_positions: int | None = None) -> NoteCase:
    """Extract the phase events of ``trace`` (the teacher's when None) and realize them in the
    arm's tokenizer (no NULL events: the readouts here measure decisions only)."""
    ni = note_input(note, inventory, lm.tokenizer, trace=trace,
                    remove_discharge_diagnosis=remove_discharge_diagnosis,
                    narrow_instruction=narrow_instruction, max_positions=max_positions)

    realized = phase_events(ni, note_items(inventory, note), lm.tokenizer, p2c_cap=p2c_cap, require_think=require_think,
                            task=task_for(inventory).for_note(note))
    return NoteCase(note_id=note.note_id, inp=ni, realized=list(realized),
                    queries=event_queries(realized, ni.input_ids))


def subsample_case(case: NoteCase, per_phase: int, seed: int) -> NoteCase:
    """At most ``per_phase`` events of each phase (the instrument's seeded subsample); 0 keeps all."""
    queries = subsample_phase_events(case.queries, per_phase, case.note_id, seed)
    keep = {q.event_id for q in queries}
    return NoteCase(note_id=case.note_id, inp=case.inp, queries=queries,
                    realized=[r for r in case.realized if r.event.event_id in keep])


def draw_config(k_bins: Sequence[int], draw: int, seed: int, *, range_gate: float = 1.0,
                batch_size: int = 256, chunk_size: int = 8192, floor_draws: int = 1) -> KnockinConfig:
    """The knock-in settings of random draw ``draw``: draw 0 measures the own set ("global") and
    the first random floor, plus ``floor_draws - 1`` further floors shown only as the floor's
    spread (sets ``random1``, ...); later draws only redraw the floor (a different seed per draw)."""
    sets = ("global", "random") if draw == 0 else ("random",)
    return KnockinConfig(k_bins=tuple(int(k) for k in k_bins), sets=sets, range_gate=range_gate,
                         batch_size=batch_size, chunk_size=chunk_size,
                         seed=stable_seed(seed, "own-heads-floor", draw) % (2 ** 31),
                         floor_draws=floor_draws if draw == 0 else 1)


def own_knockin(runner: Runner, hook: HeadHook, target: NoteCase, donors: NoteCase | Iterable[NoteCase],
                rank: Mapping[str, Sequence[int]], k_bins: Sequence[int], *, n_random: int = 1,
                seed: int = 0, range_gate: float = 1.0, batch_size: int = 256, no_match: str = "next",
                floor_draws: int = 1, progress: bool = False) -> tuple[list[dict], list[dict]]:
    """Necessity rows of ``target``'s events and knock-in rows of its events run in the donors'
    contexts, for the own ranking ``rank`` (``{phase: flat heads, best first}``) and ``n_random``
    count-matched random draws.

    donors: the next note, or the candidate donors in corpus order (the next note first; read
    lazily), each event going to the first that matches it (``no_match="next"``) or only to the
    next note (``"drop"``), :func:`mistill.instrument.passes.plan_donors`.
    Rows are the instrument's (:func:`knockin_sweep`); own-set rows have ``set == "global"``,
    floor rows ``set == "random"``; every knock-in row carries its ``draw``. ``floor_draws`` > 1
    adds, in draw 0's batch, the floor's further draws (sets ``random1``, ...: its spread only).
    """
    rank = {p: list(r) for p, r in rank.items() if p in PHASES and len(r)}
    draws = max(1, int(n_random))
    cfg0 = draw_config(k_bins, 0, seed, range_gate=range_gate, batch_size=batch_size,
                       chunk_size=runner.chunk_size)
    clean = knockin_sweep(runner, hook, target.note_id, target.inp.input_ids, target.queries, cfg0, rank,
                          trace_start=target.trace_start, progress=progress)
    necessity = [r for r in clean.necessity if r["set"] == "global" and r["phase"] in rank]
    cases = [donors] if isinstance(donors, NoteCase) else donors
    by_id: dict[str, NoteCase] = {}

    def candidates():
        for case in cases:
            by_id[case.note_id] = case
            yield case.candidate()

    plan = plan_donors(target.queries, target.n_tokens, target.trace_start, candidates(), no_match=no_match,
                       kinds=tuple(rank))
    knockin: list[dict] = []
    for d in range(draws):
        cfg = draw_config(k_bins, d, seed, range_gate=range_gate, batch_size=batch_size,
                          chunk_size=runner.chunk_size, floor_draws=floor_draws)
        if n_random <= 0:
            cfg = cfg.replace(sets=("global",))
        for cand, matches in plan:
            donor = by_id[cand.note_id]
            sweep = knockin_sweep(runner, hook, donor.note_id, donor.inp.input_ids, [], cfg, rank,
                                  work=[DonorWork(clean.clean, matches)], trace_start=cand.trace_start,
                                  progress=progress)
            knockin += [{**r, "draw": d} for r in sweep.knockin if r["phase"] in rank]
    return necessity, knockin


def _mean(values: Sequence[float]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(vals)) if vals else float("nan")


def m4_rows(note_id: str, necessity: Sequence[dict], knockin: Sequence[dict],
            k_bins: Sequence[int]) -> list[dict]:
    """Per (phase, k) of one note: ``recovery_own`` (mean over gated events), ``recovery_random``
    (per draw the mean over gated events, then the mean over draws), ``recovery_random_floors``
    (the mean over gated events of each floor draw of draw 0's batch: ``random``, ``random1``,
    ...; the floor's spread), ``necessity_own`` (mean share
    of the clean margin destroyed, the instrument's definition), ``necessity_own_nats`` (mean
    margin drop in nats, the paper's App. K wording) and ``gain_own_nats`` (the raw knock-in gain,
    the own set's patched minus corrupted margin in nats, mean over gated events: App. P's check of
    the normalizing denominator), with event counts."""
    out = []
    for phase in PHASES:
        for k in k_bins:
            own = [r for r in knockin if r["phase"] == phase and r["k"] == k and r["set"] == "global"]
            rnd = [r for r in knockin if r["phase"] == phase and r["k"] == k and r["set"] == "random"]
            nec = [r for r in necessity if r["phase"] == phase and r["k"] == k]
            if not (own or rnd or nec):
                continue
            by_draw: dict[int, list[float]] = {}
            for r in rnd:
                by_draw.setdefault(int(r.get("draw", 0)), []).append(r["recovery"])
            floors: dict[int, list[float]] = {}  # draw 0's floor and its spread draws
            for r in knockin:
                d = floor_draw(r["set"])
                if d is not None and r["phase"] == phase and r["k"] == k and int(r.get("draw", 0)) == 0:
                    floors.setdefault(d, []).append(r["recovery"])
            out.append({
                "note_id": note_id, "phase": phase, "k": int(k),
                "recovery_own": _mean([r["recovery"] for r in own]),
                "gain_own_nats": _mean([r["m_set"] - r["m_corr"] for r in own if r["gated"]]),
                "recovery_random": _mean([_mean(v) for v in by_draw.values()]),
                "necessity_own": _mean([r["necessity"] for r in nec]),
                "necessity_own_nats": _mean([r["clean_margin"] - r["ablated_margin"] for r in nec]),
                "n_events": len(nec), "n_matched": len(own), "n_gated": sum(bool(r["gated"]) for r in own),
                "n_random_draws": len(by_draw),
                "recovery_random_floors": [_mean(floors[d]) for d in sorted(floors)]})
    return out


def place_head(ranking: Sequence[int], head: int, rank: int) -> list[int]:
    """``ranking`` (flat heads, best first) with ``head`` moved to the 1-based ``rank`` and nothing
    else changed: the heads between its old and new places shift by one (App. I, the k = 8 probe:
    a causally active head moved from rank 12 into rank 8 of an arm's own ranking). A head absent
    from ``ranking`` is inserted there."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    rest = [h for h in ranking if h != head]
    at = min(rank - 1, len(rest))
    return rest[:at] + [head] + rest[at:]


def random_panel(n_heads: int, size: int, seed: int) -> list[int]:
    """A fixed panel of ``size`` random heads (App. E: drawn once with a fixed seed), sorted."""
    rng = np.random.default_rng(stable_seed(seed, "readside-random-panel"))
    return sorted(rng.choice(n_heads, size=min(size, n_heads), replace=False).tolist())


def readside_note(lm: LoadedModel, case: NoteCase, inventory: Inventory,
                  groups: Mapping[str, Mapping[str, Sequence[int]]]) -> dict[str, float]:
    """M2 at P1 and P2C, M3 and the prefix share at P2C, of one note, for each head group.

    groups: ``{group name: {phase: flat heads}}`` (e.g. ``{"own": top-16 per phase, "random":
    the random panel per phase}``). Returns ``{"<group>.m2.<phase>", "<group>.m3.near_miss_share",
    "<group>.m3.own_mention_share", "<group>.m3.top_head_near_miss_share",
    "<group>.prefix_share"}`` plus ``n_events.<phase>`` and ``n_events.P2C_near_miss``; NaN
    where the note has no usable event.
    """
    prompt, trace, offsets = case.inp.prompt, case.inp.trace, case.inp.offsets
    axis = build_axis(prompt, trace)
    base = token_buckets(axis, prompt, offsets, len(trace))
    lines = line_buckets(axis)
    out: dict[str, float] = {}
    # one forward serves both phases: the rows of every event, for every head of any group
    evs_of = {phase: [r for r in case.realized if r.event.kind == phase] for phase in M2_PHASES}
    heads_of = {phase: {int(h) for g in groups.values() for h in g.get(phase, ())} for phase in M2_PHASES}
    read = [phase for phase in M2_PHASES if evs_of[phase] and heads_of[phase]]
    union = sorted(set().union(*(heads_of[phase] for phase in read)))
    positions = [r.position for phase in read for r in evs_of[phase]]
    rows = head_attention_rows(lm, case.inp.input_ids, positions, union) if read \
        else torch.zeros(0, 0, case.n_tokens)
    col = {h: j for j, h in enumerate(union)}
    first_row, n_rows = {}, 0  # each read phase's events are a contiguous block of rows
    for phase in read:
        first_row[phase], n_rows = n_rows, n_rows + len(evs_of[phase])
    for phase in M2_PHASES:
        evs = evs_of[phase]
        out[f"n_events.{phase}"] = float(len(evs))
        attn = rows[first_row[phase]:first_row[phase] + len(evs)] if phase in read else rows[:0]
        near = [i for i, r in enumerate(evs) if phase == "P2C" and r.event.N]
        if phase == "P2C":
            out["n_events.P2C_near_miss"] = float(len(near))
        carved = {i: row_buckets(axis, base, evs[i], prompt, inventory, offsets) for i in range(len(evs))} \
            if phase == "P2C" else {}
        for name, by_phase in groups.items():
            heads = [int(h) for h in by_phase.get(phase, ())]
            if not heads or not evs:
                out[f"{name}.m2.{phase}"] = float("nan")
                if phase == "P2C":
                    for key in ("m3.near_miss_share", "m3.own_mention_share", "m3.top_head_near_miss_share",
                                "prefix_share"):
                        out[f"{name}.{key}"] = float("nan")
                continue
            cols = [col[h] for h in heads]
            lifts, nm, own_m, prefix = [], [], [], []
            for i, r in enumerate(evs):
                a = attn[i][cols]  # [h, pos]
                region = chapter_region(axis, event_chapter(r.event))
                counts = token_counts(base, axis.n, upto=r.position)
                lifts.append(region_lift(bucket_rows(a, base, axis.n), lines, region, counts))
                if phase == "P2C":
                    rows_c = bucket_rows(a, carved[i], axis.n)
                    prefix.append(slot_share(rows_c, [axis.slot("prefix")]))
                    if i in near:
                        nm.append(slot_share(rows_c, [axis.slot("N")]))
                        own_m.append(slot_share(rows_c, [axis.slot("S")]) if r.event.S
                                     else np.full(len(heads), np.nan))
            out[f"{name}.m2.{phase}"] = note_region_lift(np.stack(lifts))
            if phase == "P2C":
                out[f"{name}.prefix_share"] = note_share(np.stack(prefix))
                if nm:
                    per_head = np.nanmean(np.stack(nm), axis=0)
                    out[f"{name}.m3.near_miss_share"] = note_share(np.stack(nm))
                    out[f"{name}.m3.top_head_near_miss_share"] = float(np.nanmax(per_head))
                    out[f"{name}.m3.own_mention_share"] = note_share(np.stack(own_m))
                else:
                    for key in ("m3.near_miss_share", "m3.own_mention_share", "m3.top_head_near_miss_share"):
                        out[f"{name}.{key}"] = float("nan")
    return out


M5_OUTCOMES = LOCUS_OUTCOMES
"""M5's shares: the forcing probe's five outcomes, a partition of the chapter mentions (App. F,
"Locus": every mention receives exactly one), so the shares sum to 1. The paper reports three of
them (decided at the event, in the reasoning window, inherited; App. K); the other two, probe
failure and censored, are logged beside them so that the shares account for every mention read."""


def m5_note(runner: Runner, case: NoteCase, inventory: Inventory, cfg) -> list[dict]:
    """M5 on one note: the forcing probe (:mod:`mistill.instrument.locus`, ``cfg`` a
    :class:`~mistill.instrument.locus.LocusConfig`) at every chapter mention of the case, on the
    arm's own model. One prefill; the probes are rows against it. Returns one row per mention:
    ``event_id``, ``outcome``, ``distance``."""
    mentions = note_mentions(case.realized, case.inp.offsets, case.inp.trace_offset,
                             task_for(inventory).find_mentions(case.inp.trace, list(inventory)))
    if not mentions:
        return []
    tokenizer = runner.lm.tokenizer
    suffix = SUFFIXES[cfg.suffix]
    suffix_ids = torch.tensor(tokenizer(suffix, add_special_tokens=False)["input_ids"], dtype=torch.long)
    with torch.no_grad():
        prefix, _ = runner.prefill(case.inp.input_ids)
        probes = [MentionProbe(q=m.q, choice=forced_choice_ids(tokenizer, suffix, m.letter, sorted(set(m.letters))),
                               trace_start=case.trace_start, previous_code_end=m.previous_code_end)
                  for m in mentions]
        results = locate_many(runner, prefix, probes, suffix_ids, cfg)
    return [{"event_id": m.event_id, "outcome": r.outcome, "distance": r.distance} for m, r in zip(mentions, results)]


def m5_summary(rows: Sequence[Mapping]) -> dict[str, float]:
    """M5 over every mention read: the median locus distance of the window-decided mentions and
    the share of each of the five outcomes (:data:`M5_OUTCOMES`; they sum to 1, NaN without
    mentions)."""
    n = len(rows)
    out = {f"share_{o}": (sum(1 for r in rows if r["outcome"] == o) / n if n else float("nan"))
           for o in M5_OUTCOMES}
    dist = [float(r["distance"]) for r in rows if r["outcome"] == "window" and r.get("distance") is not None]
    out["median_distance"] = float(np.median(dist)) if dist else float("nan")
    out["n_mentions"] = float(n)
    return out
