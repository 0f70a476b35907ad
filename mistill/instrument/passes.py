"""The per-note passes of the instrument: attribution, and necessity with knock-in.

Cache discipline (App. C): one prefill per note builds the key-value prefix and the per-head
means; events are then visited in decreasing position, the prefix only ever cropped; every
measurement is a single-position forward (many variants as rows), or a forward and a backward
at one position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from mistill.config import Config
from mistill.instrument.attribution import (FirstOrder, direct_effects, exact_importance, fidelity, first_order,
                                            first_order_batch, nominees)
from mistill.instrument.hooks import HeadHook
from mistill.instrument.patching import (EventVariants, Query, clean_read, knock_in, mean_ablate,
                                        run_event_variants)
from mistill.instrument.runner import KVPrefix, Runner
from mistill.progress import track

PHASES = ("P1", "P2", "P2C")
T = TypeVar("T")
K_BINS = (3, 8, 16, 40, 100)


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (stable across processes, unlike ``hash``)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seeded_subset(items: Sequence[T], cap: int, *parts: object) -> list[T]:
    """At most ``cap`` of ``items`` (0: all of them), drawn with the seed ``stable_seed(*parts)``
    and kept in their order."""
    if not cap or len(items) <= cap:
        return list(items)
    keep = np.random.default_rng(stable_seed(*parts)).choice(len(items), cap, replace=False)
    return [items[i] for i in sorted(keep)]


@dataclass(frozen=True)
class EventQuery:
    """A realized event: its id and kind, the extra fields the passes need, and its query."""

    event_id: str
    kind: str
    query: Query
    target: str = ""
    char_index: int | None = None


@dataclass(frozen=True)
class AttributionConfig(Config):
    """Settings of the attribution pass (App. C "Exact patching of the nominated heads").

    Nominees per exactly patched event: the event's top ``<kind>`` nominees by ``|A_h|`` plus
    the first ``<kind>`` global nominees of the running global ranking. P1 and NULL: top-40 and
    global top-16 (App. C). P2: top-24 and global top-8, the character nominees of the paper's
    intact-hook re-run (App. C "The character ranking under the intact hook"). P2C: top-40 and
    global top-16, the nominees of the exact contrastive refinement (App. D). ``exact_kinds``:
    the kinds patched exactly (NULL: a seeded ``null_exact_fraction`` of them).
    ``selftest_events``, ``selftest_notes``: the self-test's P1 events per note and its notes
    (:class:`~mistill.params.AttributeParams`; :func:`~mistill.instrument.waves.selftest_scope`).
    """

    top_nominees: int = 40
    global_nominees: int = 16
    p2_top_nominees: int = 24
    p2_global_nominees: int = 8
    p2c_top_nominees: int = 40
    p2c_global_nominees: int = 16
    exact_kinds: tuple[str, ...] = ("P1", "NULL", "P2", "P2C")
    null_exact_fraction: float = 0.5
    detach: bool = False
    batch_size: int = 256
    grad_batch: int = 16
    chunk_size: int = 8192
    selftest_events: int = 0
    selftest_notes: int = 0
    seed: int = 0

    def nominee_counts(self, kind: str) -> tuple[int, int]:
        """``(top, global)`` nominee counts of an event kind."""
        if kind == "P2":
            return self.p2_top_nominees, self.p2_global_nominees
        if kind == "P2C":
            return self.p2c_top_nominees, self.p2c_global_nominees
        return self.top_nominees, self.global_nominees


@dataclass
class NoteAttribution:
    """Per-note result of the attribution pass.

    Arrays are indexed ``[event]`` and ``[event, head]`` (flat heads ``layer * n_heads + head``):
    ``first_order`` is ``-A_h``; ``exact`` holds exact mean-ablation importances where measured
    and NaN elsewhere; ``direct`` each head's direct-path effect on the margin in nats
    (:func:`~mistill.instrument.attribution.direct_effects`; None in files written before it).
    """

    note_id: str
    event_ids: list[str]
    kinds: list[str]
    positions: np.ndarray
    margins: np.ndarray
    first_order: np.ndarray
    exact: np.ndarray
    selftest: list[dict] = field(default_factory=list)
    direct: np.ndarray | None = None

    @property
    def importance(self) -> np.ndarray:
        """Exact where measured, first order elsewhere: ``[event, head]``."""
        return np.where(np.isnan(self.exact), self.first_order, self.exact)

    def arrays(self) -> dict[str, np.ndarray]:
        """The stored arrays of ``attribution.npz``."""
        out = {"event_ids": np.array(self.event_ids, dtype=str), "kinds": np.array(self.kinds, dtype=str),
               "positions": self.positions, "margins": self.margins, "first_order": self.first_order,
               "exact": self.exact}
        return out if self.direct is None else {**out, "direct": self.direct}

    @classmethod
    def from_npz(cls, path, note_id: str) -> NoteAttribution:
        with np.load(path) as d:
            return cls(note_id=note_id, event_ids=d["event_ids"].tolist(), kinds=d["kinds"].tolist(),
                       positions=d["positions"], margins=d["margins"], first_order=d["first_order"],
                       exact=d["exact"], direct=d["direct"] if "direct" in d.files else None)


def prefill_note(runner: Runner, hook: HeadHook, input_ids: torch.Tensor) -> tuple[KVPrefix, torch.Tensor]:
    """The note's single prefill: its prefix and per-head means ``[layer, head, d_head]``."""
    with hook.accumulate_mean() as acc:
        prefix, _ = runner.prefill(input_ids)
    return prefix, acc.mean


@dataclass
class FirstOrderSweep:
    """A note after its prefill and its first-order sweep, ready for the exact sweep.

    ``first_order`` ``[event, head]`` (``-A_h``), ``direct`` ``[event, head]`` (each head's
    direct-path effect on the margin, nats) and ``margins`` ``[event]`` in the order of
    ``events``; ``hidden_in[i]`` ``[layer, d_model]``: the clean residual stream entering each
    layer at event ``i`` (on the runner's device; the exact patches start from it); ``order``:
    the events' visiting order (decreasing position). Holds the note's prefix until released.
    """

    note_id: str
    events: list[EventQuery]
    prefix: KVPrefix
    mean: torch.Tensor
    first_order: np.ndarray
    margins: np.ndarray
    hidden_in: list[torch.Tensor]
    order: list[int]
    direct: np.ndarray | None = None

    def phase_means(self) -> dict[str, np.ndarray]:
        """:func:`phase_means` of this note."""
        return phase_means([e.kind for e in self.events], self.first_order)


def phase_means(kinds: Sequence[str], first_order: np.ndarray) -> dict[str, np.ndarray]:
    """A note's mean first-order importance over its events of each phase, ``{phase: [head]}``
    (phases without events are absent): what the running global ranking averages (App. C)."""
    out = {}
    for phase in PHASES:
        rows = [i for i, k in enumerate(kinds) if k == phase]
        if rows:
            out[phase] = first_order[rows].mean(axis=0)
    return out


def first_order_sweep(runner: Runner, hook: HeadHook, note_id: str, input_ids: torch.Tensor,
                      events: Sequence[EventQuery], cfg: AttributionConfig, *,
                      progress: bool = True) -> FirstOrderSweep:
    """The note's single prefill, then first-order attribution of every head at every event,
    ``cfg.grad_batch`` events per forward and backward, in decreasing position.

    input_ids: ``[pos]``; every event's ``query.position`` indexes it.
    """
    prefix, mean = prefill_note(runner, hook, input_ids)
    n_ev = len(events)
    fo_all = np.zeros((n_ev, runner.geometry.n_total_heads), dtype=np.float32)
    direct = np.zeros_like(fo_all)
    margins = np.zeros(n_ev, dtype=np.float32)
    hidden: list[torch.Tensor] = [torch.empty(0)] * n_ev
    order = sorted(range(n_ev), key=lambda i: -events[i].query.position)
    step = max(1, cfg.grad_batch)
    bar = track(total=n_ev, desc=f"first order {note_id}", leave=False, disable=not progress)
    for g0 in range(0, n_ev, step):
        group = order[g0:g0 + step]
        prefix.crop(events[group[0]].query.position)  # rows see the prefix before their own position
        fos = first_order_batch(runner, hook, prefix, [events[i].query for i in group], mean,
                                detach=cfg.detach)
        for i, fo in zip(group, fos):
            fo_all[i], margins[i], hidden[i] = fo.importance.numpy(), fo.margin, fo.hidden_in
        direct[group] = direct_effects(runner.geometry, torch.stack([fo.z for fo in fos]),
                                       torch.stack([fo.final_hidden for fo in fos]),
                                       torch.stack([fo.logits for fo in fos]), [events[i].query for i in group]).numpy()
        bar.update(len(group))
    bar.close()
    return FirstOrderSweep(note_id=note_id, events=list(events), prefix=prefix, mean=mean, first_order=fo_all,
                           margins=margins, hidden_in=hidden, order=order, direct=direct)


def exact_sweep(runner: Runner, hook: HeadHook, sweep: FirstOrderSweep, cfg: AttributionConfig,
                running_global: Sequence[int] | Mapping[str, Sequence[int]] = (), *,
                progress: bool = True) -> NoteAttribution:
    """Exact patches of the nominees at the events of ``sweep``, over the same prefix: the result
    of the pass. The single-head ablations of every nominated event run as rows of shared
    forwards, each row seeing the prefix up to its own event (:func:`run_event_variants`).

    Nominees: the event's top ``|A_h|`` heads plus the first global nominees of the running
    global ranking (counts per kind: :meth:`AttributionConfig.nominee_counts`), at every event
    whose kind is in ``cfg.exact_kinds`` (NULL: a seeded ``cfg.null_exact_fraction`` of them).
    ``running_global``: one ranking for every kind, or ``{kind: ranking}`` (a kind it lacks gets
    no global nominees). With ``cfg.selftest_events > 0`` the first such P1 events (in visiting
    order) also get every head patched exactly and the detached-hook attribution, reported by
    :func:`~mistill.instrument.attribution.fidelity`.
    """
    events, prefix, mean = sweep.events, sweep.prefix, sweep.mean
    n_ev, n_heads = len(events), runner.geometry.n_total_heads
    exact_all = np.full((n_ev, n_heads), np.nan, dtype=np.float32)
    rng = np.random.default_rng(stable_seed(cfg.seed, sweep.note_id, "null-exact"))
    null_idx = [i for i, e in enumerate(events) if e.kind == "NULL"]
    n_null_exact = int(round(cfg.null_exact_fraction * len(null_idx)))
    null_exact = set(rng.permutation(null_idx)[:n_null_exact].tolist()) if null_idx else set()
    # every nominated event's single-head ablations, batched across the note's events
    patched: list[tuple[int, list[int]]] = []
    for i in sweep.order:
        ev = events[i]
        if ev.kind in cfg.exact_kinds and (ev.kind != "NULL" or i in null_exact):
            top, n_global = cfg.nominee_counts(ev.kind)
            patched.append((i, nominees(torch.from_numpy(sweep.first_order[i]),
                                        _running_for(running_global, ev.kind)[:n_global], top)))
    prefix.uncrop()
    ablated = run_event_variants(runner, hook, prefix, [EventVariants(events[i].query, [[h] for h in heads],
                                                                      sweep.hidden_in[i]) for i, heads in patched],
                                 mean, batch_size=cfg.batch_size)
    for (i, heads), margins_i in zip(patched, ablated):
        exact_all[i, heads] = (float(sweep.margins[i]) - margins_i).numpy()
    selftest: list[dict] = []
    checked = [i for i in sweep.order if events[i].kind == "P1"][:cfg.selftest_events]
    for i in track(checked, desc=f"self-test {sweep.note_id}", leave=False, disable=not progress):
        ev = events[i]
        prefix.uncrop()
        prefix.crop(ev.query.position)
        every = exact_importance(runner, hook, prefix, ev.query, mean, range(n_heads), float(sweep.margins[i]),
                                 hidden_in=sweep.hidden_in[i], batch_size=cfg.batch_size).numpy()
        other = first_order(runner, hook, prefix, ev.query, mean, detach=not cfg.detach)
        intact, detached = (sweep.first_order[i], other.importance.numpy()) if not cfg.detach \
            else (other.importance.numpy(), sweep.first_order[i])
        selftest.append({"event_id": ev.event_id,
                         **{f"intact.{k}": v for k, v in fidelity(intact, every).items()},
                         **{f"detached.{k}": v for k, v in fidelity(detached, every).items()},
                         **noise_readouts(runner, hook, prefix, ev.query, mean, other, float(sweep.margins[i]),
                                          every, intact, detached)})
    return NoteAttribution(note_id=sweep.note_id, event_ids=[e.event_id for e in events],
                           kinds=[e.kind for e in events],
                           positions=np.array([e.query.position for e in events], dtype=np.int64),
                           margins=sweep.margins, first_order=sweep.first_order, exact=exact_all, selftest=selftest,
                           direct=sweep.direct)


NOISE_FORWARDS = 6
"""Identical single-token forwards whose margins give an event's noise floor (App. C: six)."""
NOISE_SDS = 3.0
"""A single-head effect is told apart from zero above this many standard deviations of the
repeated forwards' margin (App. C: about three)."""


def noise_readouts(runner: Runner, hook: HeadHook, prefix: KVPrefix, query: Query, mean: torch.Tensor,
                   clean: FirstOrder, clean_margin: float, exact: np.ndarray, intact: np.ndarray,
                   detached: np.ndarray) -> dict[str, float]:
    """The self-test's noise readouts at one event (App. C, "Noise floor"; Sec. 2.3).

    ``noise.sd`` / ``noise.range``: the margin's standard deviation (ddof 1) and range over
    :data:`NOISE_FORWARDS` identical single-token forwards, each a forward of its own from
    layer 0 (zero where the kernels are deterministic, as on a CPU); ``n_above_noise``: heads
    whose exact effect ``exact`` ``[head]`` exceeds :data:`NOISE_SDS` standard deviations, and
    the :func:`~mistill.instrument.attribution.fidelity` of the intact and detached
    attributions ``[head]`` over those heads (``intact_above_noise.*``, ``detached_above_noise.*``);
    ``knockin_all.minus_clean``: the margin with every head knocked in from the clean forward
    ``clean`` (its head outputs ``z`` ``[layer, head, d_head]``), minus the clean margin: zero
    up to the forward's noise (the all-heads knock-in reproduces the clean margin).
    """
    margins = np.array([float(mean_ablate(runner, hook, prefix, query, [[]], mean, batch_size=1)[0])
                        for _ in range(NOISE_FORWARDS)], dtype=np.float64)
    sd = float(margins.std(ddof=1))
    above = np.abs(np.asarray(exact, dtype=np.float64)) > NOISE_SDS * sd
    every_head = list(range(runner.geometry.n_total_heads))
    all_in = float(knock_in(runner, hook, prefix, query, [every_head], clean.z.to(mean.dtype), batch_size=1)[0])
    out = {"noise.sd": sd, "noise.range": float(margins.max() - margins.min()),
           "n_above_noise": float(above.sum()), "knockin_all.minus_clean": all_in - clean_margin}
    for name, values in (("intact_above_noise", intact), ("detached_above_noise", detached)):
        out.update({f"{name}.{k}": v for k, v in fidelity(np.asarray(values)[above], np.asarray(exact)[above]).items()}
                   if above.sum() > 2 else {f"{name}.pearson": float("nan"), f"{name}.spearman": float("nan")})
    return out


def attribute_note(runner: Runner, hook: HeadHook, note_id: str, input_ids: torch.Tensor,
                   events: Sequence[EventQuery], cfg: AttributionConfig,
                   running_global: Sequence[int] | Mapping[str, Sequence[int]] = (), *,
                   progress: bool = True) -> NoteAttribution:
    """First-order attribution of every head at every event, exact patches of the nominees: one
    prefill, :func:`first_order_sweep` then :func:`exact_sweep` over the same prefix.

    input_ids: ``[pos]``; every event's ``query.position`` indexes it.
    """
    sweep = first_order_sweep(runner, hook, note_id, input_ids, events, cfg, progress=progress)
    return exact_sweep(runner, hook, sweep, cfg, running_global, progress=progress)


def _running_for(running_global: Sequence[int] | Mapping[str, Sequence[int]], kind: str) -> list[int]:
    if isinstance(running_global, Mapping):
        return list(running_global.get(kind, ()))
    return list(running_global)


def running_global_top(p1_means: Sequence[np.ndarray], k: int) -> list[int]:
    """Heads with the largest mean first-order importance over the chapter events seen so far."""
    if not p1_means:
        return []
    m = np.mean(np.stack(p1_means), axis=0)
    return np.argsort(-m, kind="stable")[:k].tolist()


# -- necessity and knock-in ----------------------------------------------------------------------

DONOR_NO_MATCH = ("next", "drop")
"""What an event whose next note has no matched event gets (:func:`plan_donors`)."""


@dataclass(frozen=True)
class KnockinConfig(Config):
    """Settings of the necessity / knock-in pass (App. C–D).

    range_gate: an event's recovery is read only where ``m_all - m_corr >= range_gate`` (the
    1-nat gate of App. C / I.1). Random sets: one count-matched draw per note, phase and bin,
    redrawn for every bin (App. K "Floors, medians and means"); **[recon]** the draw is seeded
    by ``(seed, note, phase, k)`` and shared by the note's events. floor_draws: **[recon]**
    with ``random`` among the sets, draws ``1 .. floor_draws - 1`` are measured beside it as the
    sets ``random1``, ``random2``, ... (:data:`FLOOR_DRAW_PREFIX`), seeded by
    ``(seed, note, phase, k, draw)``: the spread of the floor, never the recorded floor.
    """

    k_bins: tuple[int, ...] = K_BINS
    sets: tuple[str, ...] = ("global", "random", "bottom", "own")
    range_gate: float = 1.0
    batch_size: int = 256
    chunk_size: int = 8192
    seed: int = 0
    floor_draws: int = 1


FLOOR_DRAW_PREFIX = "random"
"""The extra floor draws' set names are ``random<d>`` (``d`` >= 1); draw 0 is the set ``random``."""


def floor_draw(set_name: str) -> int | None:
    """The draw index of a random-floor set name (``random``: 0, ``random3``: 3), else None."""
    if not set_name.startswith(FLOOR_DRAW_PREFIX):
        return None
    rest = set_name[len(FLOOR_DRAW_PREFIX):]
    if not rest:
        return 0
    return int(rest) if rest.isdigit() else None


@dataclass
class CleanEvents:
    """A note's clean reads at its events: margins ``[event]`` and head outputs
    ``z`` ``[event, layer, head, d_head]``; ``n_tokens`` and ``trace_start`` (the first trace
    token) place its events in its trace for donor matching."""

    note_id: str
    events: list[EventQuery]
    margins: np.ndarray
    z: torch.Tensor
    n_tokens: int = 0
    trace_start: int = 0


def set_variants(phase: str, note_id: str, cfg: KnockinConfig, global_rank: Mapping[str, Sequence[int]],
                 own_rank: Mapping[str, Sequence[int]] | None, n_heads: int) -> dict[tuple[str, int], list[int]]:
    """The head sets tested at a phase: global top-k, count-matched random, global bottom-k,
    the note's own top-k — for every k (random sets redrawn per bin, seeded by note)."""
    out: dict[tuple[str, int], list[int]] = {}
    rank = list(global_rank[phase])
    for k in cfg.k_bins:
        k_eff = min(k, n_heads)
        if "global" in cfg.sets:
            out[("global", k)] = rank[:k_eff]
        if "bottom" in cfg.sets:
            out[("bottom", k)] = rank[::-1][:k_eff]
        if "random" in cfg.sets:
            rng = np.random.default_rng(stable_seed(cfg.seed, note_id, phase, k, "random"))
            out[("random", k)] = sorted(rng.choice(n_heads, size=k_eff, replace=False).tolist())
            for d in range(1, max(1, int(cfg.floor_draws))):
                rng = np.random.default_rng(stable_seed(cfg.seed, note_id, phase, k, "random", d))
                out[(f"{FLOOR_DRAW_PREFIX}{d}", k)] = sorted(rng.choice(n_heads, size=k_eff, replace=False).tolist())
        if "own" in cfg.sets and own_rank is not None and phase in own_rank:
            out[("own", k)] = list(own_rank[phase])[:k_eff]
    return out


# -- the donor: the next note in the corpus at a matched event (Sec. 2.3) -------------------------

def trace_fraction(position: int, n_tokens: int, trace_start: int = 0) -> float:
    """Where ``position`` lies in the trace ``[trace_start, n_tokens)``, as a fraction of its
    length (``trace_start`` 0: of the whole input)."""
    return (position - trace_start) / max(n_tokens - trace_start, 1)


def match_donor_event(event: EventQuery, rel_pos: float, donor: Sequence[EventQuery],
                      donor_len: int, donor_start: int = 0) -> EventQuery | None:
    """The donor's matched event for ``event``, ``None`` if the donor has none.

    The paper fixes "a matched event with a different emitted choice" (Sec. 2.3). **[recon]**
    which of the donor's events is matched: the same kind, a different target (the emitted
    choice), the same character index when such an event exists, then the nearest position in
    the trace as a fraction of the trace's length (:func:`trace_fraction`; ``rel_pos`` is the
    clean event's), ties by the lower position.
    """
    cands = [d for d in donor if d.kind == event.kind and d.target != event.target]
    same_char = [d for d in cands if d.char_index == event.char_index]
    cands = same_char or cands
    if not cands:
        return None
    return min(cands, key=lambda d: (abs(trace_fraction(d.query.position, donor_len, donor_start) - rel_pos),
                                     d.query.position))


def donor_order(n_notes: int, index: int, *, wrap: bool = True) -> list[int]:
    """The candidate donors of note ``index`` among ``n_notes`` in corpus order, nearest first:
    the notes after it, then (``wrap``) the notes before it from the first. A note is never its
    own donor.

    The paper's corrupted run is "the next note in the corpus" (Sec. 2.3). **[recon]** the last
    note's next note: with ``wrap`` the first note (the paper reports knock-in on every one of
    its 100 notes, so the last note had a donor), without it the last note has none.
    """
    after = list(range(index + 1, n_notes))
    return after + (list(range(0, index)) if wrap else [])


@dataclass(frozen=True)
class DonorCandidate:
    """A possible donor note: its id, its events and where its trace lies in its input."""

    note_id: str
    events: Sequence[EventQuery]
    n_tokens: int
    trace_start: int = 0


def plan_donors(events: Sequence[EventQuery], n_tokens: int, trace_start: int,
                candidates: Iterable[DonorCandidate], *, no_match: str = "next",
                kinds: Collection[str] = PHASES) -> list[tuple[DonorCandidate, list[tuple[int, EventQuery]]]]:
    """Assign each event of ``kinds`` to a donor note and its matched event there.

    candidates: the donor notes in the order they are tried (:func:`donor_order`; read lazily,
    only as far as needed). The first candidate is the next note; an event is matched there
    (:func:`match_donor_event`) when it can be. **[recon]** an event the next note cannot match:
    ``no_match="next"`` tries the following candidates in order and takes the first that
    matches (the paper's knock-in counts every note with contrastive events, 92 of 92, which
    dropping would not give); ``"drop"`` leaves it without a knock-in. Returns
    ``[(candidate, [(event index, matched donor event), ...])]`` for the candidates used, in
    candidate order.
    """
    if no_match not in DONOR_NO_MATCH:
        raise ValueError(f"no_match must be one of {DONOR_NO_MATCH}, got {no_match!r}")
    todo = [i for i, e in enumerate(events) if e.kind in kinds]
    plan: list[tuple[DonorCandidate, list[tuple[int, EventQuery]]]] = []
    if not todo:
        return plan
    for cand in candidates:
        matched, left = [], []
        for i in todo:
            ev = events[i]
            m = match_donor_event(ev, trace_fraction(ev.query.position, n_tokens, trace_start), cand.events,
                                  cand.n_tokens, cand.trace_start)
            (matched if m is not None else left).append((i, m) if m is not None else i)
        if matched:
            plan.append((cand, matched))
        todo = left
        if not todo or no_match == "drop":
            break
    return plan


@dataclass
class DonorWork:
    """Events of a clean note to knock into the swept (donor) note: the clean reads, the
    ``(index into clean.events, matched donor event)`` pairs and the clean note's own ranking."""

    clean: CleanEvents
    matches: Sequence[tuple[int, EventQuery]]
    own_rank: Mapping[str, Sequence[int]] | None = None


@dataclass
class SweepResult:
    """What one note's knock-in sweep yields: its clean reads, the necessity rows of its own
    events, and the knock-in rows of the clean notes' events run in this note's context."""

    clean: CleanEvents
    necessity: list[dict]
    knockin: list[dict]


def knockin_sweep(runner: Runner, hook: HeadHook, note_id: str, input_ids: torch.Tensor,
                  events: Sequence[EventQuery], cfg: KnockinConfig,
                  global_rank: Mapping[str, Sequence[int]],
                  own_rank: Mapping[str, Sequence[int]] | None = None,
                  previous: CleanEvents | None = None, previous_len: int = 0,
                  previous_own_rank: Mapping[str, Sequence[int]] | None = None, *,
                  work: Sequence[DonorWork] = (), trace_start: int = 0,
                  progress: bool = True) -> SweepResult:
    """One prefill of ``note_id``, then

    - its own events (:func:`own_reads`): the clean read (margin, head outputs for later
      knock-in) and, at phase events, the margin with each set mean-ablated (necessity = share
      of the clean margin destroyed);
    - the clean notes' events this note is the donor of (``work``; or every phase event of
      ``previous`` that this note can match, :func:`match_donor_event`), each at its matched
      position here, where the clean token is run (:func:`donor_reads`): the corrupted margin,
      ``m_all`` (every head knocked in) and each set knocked in; recovery
      ``(m_set - m_corr) / (m_all - m_corr)`` where ``m_all - m_corr >= cfg.range_gate``.

    input_ids: ``[pos]``; trace_start: its first trace token; previous_len: ``previous``'s
    token count when its ``n_tokens`` is unset.
    """
    prefix, mean = prefill_note(runner, hook, input_ids)
    work = list(work)
    if previous is not None:
        prev_len = previous.n_tokens or previous_len
        here = DonorCandidate(note_id, list(events), int(input_ids.numel()), trace_start)
        plan = plan_donors(previous.events, prev_len, previous.trace_start, [here], no_match="drop")
        work.append(DonorWork(previous, plan[0][1] if plan else [], previous_own_rank))
    clean, necessity = own_reads(runner, hook, prefix, mean, note_id, events, cfg, global_rank, own_rank,
                                 trace_start=trace_start, progress=progress)
    knockin = donor_reads(runner, hook, prefix, note_id, work, cfg, global_rank, progress=progress)
    return SweepResult(clean=clean, necessity=necessity, knockin=knockin)


def own_reads(runner: Runner, hook: HeadHook, prefix: KVPrefix, mean: torch.Tensor, note_id: str,
              events: Sequence[EventQuery], cfg: KnockinConfig, global_rank: Mapping[str, Sequence[int]],
              own_rank: Mapping[str, Sequence[int]] | None = None, *, trace_start: int = 0,
              progress: bool = True) -> tuple[CleanEvents, list[dict]]:
    """A prefilled note's clean reads at its events and the necessity rows of its phase events,
    visiting the events in decreasing position (the prefix is uncropped first).

    prefix, mean: the note's prefill and per-head means ``[layer, head, d_head]``
    (:func:`prefill_note`).
    """
    g = runner.geometry
    n_own = len(events)
    z = torch.zeros(n_own, g.n_layers, g.n_heads, g.d_head, dtype=runner.dtype)
    margins = np.zeros(n_own, dtype=np.float32)
    necessity: list[dict] = []
    prefix.uncrop()
    order = sorted(range(n_own), key=lambda i: -events[i].query.position)
    for i in track(order, desc=f"clean reads {note_id}", leave=False, disable=not progress):
        ev = events[i]
        prefix.crop(ev.query.position)
        clean = clean_read(runner, hook, prefix, ev.query)
        z[i], margins[i] = clean.z.cpu(), clean.margin
        if ev.kind not in PHASES:
            continue
        sets = set_variants(ev.kind, note_id, cfg, global_rank, own_rank, g.n_total_heads)
        keys = [key for key in sets if floor_draw(key[0]) in (None, 0)]  # the floor's spread draws: knock-in only
        ablated = mean_ablate(runner, hook, prefix, ev.query, [sets[k] for k in keys], mean,
                              hidden_in=clean.hidden_in, batch_size=cfg.batch_size).numpy()
        for (set_name, k), m in zip(keys, ablated):
            necessity.append({"note_id": note_id, "event_id": ev.event_id, "phase": ev.kind,
                              "set": set_name, "k": k, "clean_margin": clean.margin,
                              "ablated_margin": float(m),
                              "necessity": (clean.margin - float(m)) / clean.margin
                              if abs(clean.margin) > 1e-6 else float("nan")})
    clean_events = CleanEvents(note_id=note_id, events=list(events), margins=margins, z=z,
                               n_tokens=int(prefix.input_ids.numel()), trace_start=trace_start)
    return clean_events, necessity


def donor_reads(runner: Runner, hook: HeadHook, prefix: KVPrefix, note_id: str, work: Sequence[DonorWork],
                cfg: KnockinConfig, global_rank: Mapping[str, Sequence[int]], *,
                progress: bool = True) -> list[dict]:
    """The knock-in rows of the clean notes' events in ``work``, each at its matched position in
    this prefilled (donor) note, in decreasing position (the prefix is uncropped first); rows of
    one position keep ``work``'s order."""
    all_heads = list(range(runner.geometry.n_total_heads))
    todo = [(match.query.position, i, w, match) for w, item in enumerate(work) for i, match in item.matches]
    rows: list[dict] = []
    prefix.uncrop()
    for position, i, w, match in track(sorted(todo, key=lambda t: -t[0]), desc=f"knock-in {note_id}",
                                       leave=False, disable=not progress):
        prefix.crop(position)
        rows += _knockin_rows(runner, hook, prefix, cfg, global_rank, work[w], i, match, note_id, all_heads)
    return rows


def _knockin_rows(runner: Runner, hook: HeadHook, prefix: KVPrefix, cfg: KnockinConfig,
                  global_rank: Mapping[str, Sequence[int]], item: DonorWork, i: int, match: EventQuery,
                  donor_id: str, all_heads: list[int]) -> list[dict]:
    """The knock-in rows of the clean event ``item.clean.events[i]`` at ``match`` (prefix cropped
    to its position): the clean token run in the donor's context, every set knocked in."""
    clean = item.clean
    ev = clean.events[i]
    q = Query(position=match.query.position, token_id=ev.query.token_id, target_id=ev.query.target_id,
              competitor_ids=ev.query.competitor_ids)
    sets = set_variants(ev.kind, clean.note_id, cfg, global_rank, item.own_rank, len(all_heads))
    keys = list(sets)
    corr = clean_read(runner, hook, prefix, q)
    ms = knock_in(runner, hook, prefix, q, [all_heads] + [sets[k] for k in keys], clean.z[i].to(runner.device),
                  hidden_in=corr.hidden_in, batch_size=cfg.batch_size).numpy()
    m_all, m_corr = float(ms[0]), corr.margin
    gated = (m_all - m_corr) >= cfg.range_gate
    return [{"note_id": clean.note_id, "event_id": ev.event_id, "donor_id": donor_id,
             "donor_event_id": match.event_id, "phase": ev.kind, "set": set_name, "k": k, "m_corr": m_corr,
             "m_all": m_all, "m_set": float(m), "clean_margin": float(clean.margins[i]), "gated": bool(gated),
             "recovery": (float(m) - m_corr) / (m_all - m_corr) if gated else float("nan")}
            for (set_name, k), m in zip(keys, ms[1:])]


def per_note_set_rows(necessity: Sequence[dict], knockin: Sequence[dict]) -> list[dict]:
    """Per (note, phase, set, k): mean necessity over events and mean recovery over gated events."""
    import pandas as pd  # deferred: pandas is slow to import

    nec = pd.DataFrame(list(necessity))
    kin = pd.DataFrame(list(knockin))
    keys = ["note_id", "phase", "set", "k"]
    parts = []
    if len(nec):
        parts.append(nec.groupby(keys).agg(necessity=("necessity", "mean"), n_events=("necessity", "size")))
    if len(kin):
        parts.append(kin.groupby(keys).agg(recovery=("recovery", "mean"), n_gated=("gated", "sum")))
    if not parts:
        return []
    df = pd.concat(parts, axis=1).reset_index()
    for col, empty in (("necessity", float("nan")), ("n_events", 0), ("recovery", float("nan")), ("n_gated", 0)):
        if col not in df:  # a note without knock-in (no donor) or without necessity rows
            df[col] = empty
    return df.to_dict("records")
