"""The per-note passes of the instrument: attribution, and necessity with knock-in.

Cache discipline (App. C): one prefill per note builds the key-value prefix and the per-head
means; events are then visited in decreasing position, the prefix only ever cropped; every
measurement is a single-position forward (many variants as rows), or a forward and a backward
at one position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from mistill.config import Config
from mistill.instrument.attribution import (exact_importance, fidelity, first_order, first_order_batch,
                                            nominees)
from mistill.instrument.hooks import HeadHook
from mistill.instrument.patching import Query, clean_read, knock_in, mean_ablate
from mistill.instrument.runner import KVPrefix, Runner

PHASES = ("P1", "P2", "P2C")
K_BINS = (3, 8, 16, 40, 100)


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (stable across processes, unlike ``hash``)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


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
    """Settings of the attribution pass (App. C "Exact patching of the nominated heads")."""

    top_nominees: int = 40
    global_nominees: int = 16
    exact_kinds: tuple[str, ...] = ("P1", "NULL")
    null_exact_fraction: float = 0.5
    detach: bool = False
    batch_size: int = 256
    grad_batch: int = 16
    chunk_size: int = 8192
    selftest_events: int = 0
    seed: int = 0


@dataclass
class NoteAttribution:
    """Per-note result of the attribution pass.

    Arrays are indexed ``[event]`` and ``[event, head]`` (flat heads ``layer * n_heads + head``):
    ``first_order`` is ``-A_h``; ``exact`` holds exact mean-ablation importances where measured
    and NaN elsewhere.
    """

    note_id: str
    event_ids: list[str]
    kinds: list[str]
    positions: np.ndarray
    margins: np.ndarray
    first_order: np.ndarray
    exact: np.ndarray
    selftest: list[dict] = field(default_factory=list)

    @property
    def importance(self) -> np.ndarray:
        """Exact where measured, first order elsewhere: ``[event, head]``."""
        return np.where(np.isnan(self.exact), self.first_order, self.exact)

    def arrays(self) -> dict[str, np.ndarray]:
        """The stored arrays of ``attribution.npz``."""
        return {"event_ids": np.array(self.event_ids, dtype=str), "kinds": np.array(self.kinds, dtype=str),
                "positions": self.positions, "margins": self.margins, "first_order": self.first_order,
                "exact": self.exact}

    @classmethod
    def from_npz(cls, path, note_id: str) -> NoteAttribution:
        with np.load(path) as d:
            return cls(note_id=note_id, event_ids=d["event_ids"].tolist(), kinds=d["kinds"].tolist(),
                       positions=d["positions"], margins=d["margins"], first_order=d["first_order"],
                       exact=d["exact"])


def prefill_note(runner: Runner, hook: HeadHook, input_ids: torch.Tensor) -> tuple[KVPrefix, torch.Tensor]:
    """The note's single prefill: its prefix and per-head means ``[layer, head, d_head]``."""
    with hook.accumulate_mean() as acc:
        prefix, _ = runner.prefill(input_ids)
    return prefix, acc.mean


def attribute_note(runner: Runner, hook: HeadHook, note_id: str, input_ids: torch.Tensor,
                   events: Sequence[EventQuery], cfg: AttributionConfig,
                   running_global: Sequence[int] = (), *, progress: bool = True) -> NoteAttribution:
    """First-order attribution of every head at every event, exact patches of the nominees.

    Exact mean-ablation of the event's top ``cfg.top_nominees`` by ``|A_h|`` plus the running
    global heads, at every event whose kind is in ``cfg.exact_kinds`` (NULL: a seeded
    ``cfg.null_exact_fraction`` of them). With ``cfg.selftest_events > 0`` the first such
    P1 events (in visiting order) also get every head patched exactly and the detached-hook
    attribution, reported by :func:`~mistill.instrument.attribution.fidelity`.
    """
    g = runner.geometry
    prefix, mean = prefill_note(runner, hook, input_ids)
    n_ev, n_heads = len(events), g.n_total_heads
    fo_all = np.zeros((n_ev, n_heads), dtype=np.float32)
    exact_all = np.full((n_ev, n_heads), np.nan, dtype=np.float32)
    margins = np.zeros(n_ev, dtype=np.float32)
    rng = np.random.default_rng(stable_seed(cfg.seed, note_id, "null-exact"))
    null_idx = [i for i, e in enumerate(events) if e.kind == "NULL"]
    n_null_exact = int(round(cfg.null_exact_fraction * len(null_idx)))
    null_exact = set(rng.permutation(null_idx)[:n_null_exact].tolist()) if null_idx else set()
    order = sorted(range(n_ev), key=lambda i: -events[i].query.position)
    selftest: list[dict] = []
    bar = tqdm(total=n_ev, desc=f"attribute {note_id}", leave=False, disable=not progress)
    for g0 in range(0, n_ev, max(1, cfg.grad_batch)):
        group = order[g0:g0 + max(1, cfg.grad_batch)]
        prefix.crop(events[group[0]].query.position)  # rows see the prefix before their own position
        fos = first_order_batch(runner, hook, prefix, [events[i].query for i in group], mean,
                                detach=cfg.detach)
        for i, fo in zip(group, fos):
            ev = events[i]
            prefix.crop(ev.query.position)
            fo_all[i] = fo.importance.numpy()
            margins[i] = fo.margin
            if ev.kind in cfg.exact_kinds and (ev.kind != "NULL" or i in null_exact):
                heads = nominees(fo.importance, running_global, cfg.top_nominees)
                imp = exact_importance(runner, hook, prefix, ev.query, mean, heads, fo.margin,
                                       hidden_in=fo.hidden_in, batch_size=cfg.batch_size)
                exact_all[i, heads] = imp.numpy()
            if ev.kind == "P1" and len(selftest) < cfg.selftest_events:
                every = exact_importance(runner, hook, prefix, ev.query, mean, range(n_heads), fo.margin,
                                         hidden_in=fo.hidden_in, batch_size=cfg.batch_size).numpy()
                other = first_order(runner, hook, prefix, ev.query, mean, detach=not cfg.detach)
                intact, detached = (fo, other) if not cfg.detach else (other, fo)
                selftest.append({
                    "event_id": ev.event_id,
                    **{f"intact.{k}": v for k, v in fidelity(intact.importance.numpy(), every).items()},
                    **{f"detached.{k}": v for k, v in fidelity(detached.importance.numpy(), every).items()}})
            bar.update(1)
    bar.close()
    return NoteAttribution(note_id=note_id, event_ids=[e.event_id for e in events],
                           kinds=[e.kind for e in events],
                           positions=np.array([e.query.position for e in events], dtype=np.int64),
                           margins=margins, first_order=fo_all, exact=exact_all, selftest=selftest)


def running_global_top(p1_means: Sequence[np.ndarray], k: int) -> list[int]:
    """Heads with the largest mean first-order importance over the chapter events seen so far."""
    if not p1_means:
        return []
    m = np.mean(np.stack(p1_means), axis=0)
    return np.argsort(-m, kind="stable")[:k].tolist()


# -- necessity and knock-in ----------------------------------------------------------------------

@dataclass(frozen=True)
class KnockinConfig(Config):
    """Settings of the necessity / knock-in pass (App. C–D)."""

    k_bins: tuple[int, ...] = K_BINS
    sets: tuple[str, ...] = ("global", "random", "bottom", "own")
    range_gate: float = 1.0
    batch_size: int = 256
    chunk_size: int = 8192
    seed: int = 0


@dataclass
class CleanEvents:
    """A note's clean reads at its events: margins and head outputs ``[event, layer, head, d_head]``."""

    note_id: str
    events: list[EventQuery]
    margins: np.ndarray
    z: torch.Tensor


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
        if "own" in cfg.sets and own_rank is not None and phase in own_rank:
            out[("own", k)] = list(own_rank[phase])[:k_eff]
    return out


def match_donor_event(event: EventQuery, rel_pos: float, donor: Sequence[EventQuery],
                      donor_len: int) -> EventQuery | None:
    """The donor's matched event: same kind, a different emitted choice, the same character index
    when one exists, nearest relative position in the trace; ``None`` if there is none."""
    cands = [d for d in donor if d.kind == event.kind and d.target != event.target]
    same_char = [d for d in cands if d.char_index == event.char_index]
    cands = same_char or cands
    if not cands:
        return None
    return min(cands, key=lambda d: (abs(d.query.position / max(donor_len, 1) - rel_pos), d.query.position))


@dataclass
class SweepResult:
    """What one note's knock-in sweep yields: its clean reads, the necessity rows of its own
    events, and the knock-in rows of the previous note's events (run in this note's context)."""

    clean: CleanEvents
    necessity: list[dict]
    knockin: list[dict]


def knockin_sweep(runner: Runner, hook: HeadHook, note_id: str, input_ids: torch.Tensor,
                  events: Sequence[EventQuery], cfg: KnockinConfig,
                  global_rank: Mapping[str, Sequence[int]],
                  own_rank: Mapping[str, Sequence[int]] | None = None,
                  previous: CleanEvents | None = None, previous_len: int = 0,
                  previous_own_rank: Mapping[str, Sequence[int]] | None = None, *,
                  progress: bool = True) -> SweepResult:
    """One prefill of ``note_id``, then one sweep in decreasing position over

    - its own events: the clean read (margin, head outputs for later knock-in) and, at phase
      events, the margin with each set mean-ablated (necessity = share of the clean margin
      destroyed);
    - the previous note's events, each at its matched position in this note (the donor): the
      corrupted margin, ``m_all`` (every head knocked in) and each set knocked in; recovery
      ``(m_set - m_corr) / (m_all - m_corr)`` where ``m_all - m_corr >= cfg.range_gate``.
    """
    g = runner.geometry
    prefix, mean = prefill_note(runner, hook, input_ids)
    all_heads = list(range(g.n_total_heads))
    n_own = len(events)
    z = torch.zeros(n_own, g.n_layers, g.n_heads, g.d_head, dtype=runner.dtype)
    margins = np.zeros(n_own, dtype=np.float32)
    work: list[tuple[int, str, int, EventQuery | None]] = [(e.query.position, "own", i, None)
                                                             for i, e in enumerate(events)]
    if previous is not None:
        donor_len = int(input_ids.numel())
        for j, ev in enumerate(previous.events):
            if ev.kind in PHASES:
                match = match_donor_event(ev, ev.query.position / max(previous_len, 1), events, donor_len)
                if match is not None:
                    work.append((match.query.position, "donor", j, match))
    necessity, knockin = [], []
    for position, role, i, match in tqdm(sorted(work, key=lambda w: -w[0]), desc=f"knock-in {note_id}",
                                         leave=False, disable=not progress):
        prefix.crop(position)
        if role == "own":
            ev = events[i]
            clean = clean_read(runner, hook, prefix, ev.query)
            z[i], margins[i] = clean.z.cpu(), clean.margin
            if ev.kind not in PHASES:
                continue
            sets = set_variants(ev.kind, note_id, cfg, global_rank, own_rank, g.n_total_heads)
            keys = list(sets)
            ablated = mean_ablate(runner, hook, prefix, ev.query, [sets[k] for k in keys], mean,
                                  hidden_in=clean.hidden_in, batch_size=cfg.batch_size).numpy()
            for (set_name, k), m in zip(keys, ablated):
                necessity.append({"note_id": note_id, "event_id": ev.event_id, "phase": ev.kind,
                                  "set": set_name, "k": k, "clean_margin": clean.margin,
                                  "ablated_margin": float(m),
                                  "necessity": (clean.margin - float(m)) / clean.margin
                                  if abs(clean.margin) > 1e-6 else float("nan")})
        else:
            ev = previous.events[i]
            q = Query(position=position, token_id=ev.query.token_id, target_id=ev.query.target_id,
                      competitor_ids=ev.query.competitor_ids)
            sets = set_variants(ev.kind, previous.note_id, cfg, global_rank, previous_own_rank,
                                g.n_total_heads)
            keys = list(sets)
            corr = clean_read(runner, hook, prefix, q)
            ms = knock_in(runner, hook, prefix, q, [all_heads] + [sets[k] for k in keys],
                          previous.z[i].to(runner.device), hidden_in=corr.hidden_in,
                          batch_size=cfg.batch_size).numpy()
            m_all, m_corr = float(ms[0]), corr.margin
            gated = (m_all - m_corr) >= cfg.range_gate
            for (set_name, k), m in zip(keys, ms[1:]):
                knockin.append({"note_id": previous.note_id, "event_id": ev.event_id, "donor_id": note_id,
                                "donor_event_id": match.event_id, "phase": ev.kind, "set": set_name,
                                "k": k, "m_corr": m_corr, "m_all": m_all, "m_set": float(m),
                                "clean_margin": float(previous.margins[i]), "gated": bool(gated),
                                "recovery": (float(m) - m_corr) / (m_all - m_corr) if gated else float("nan")})
    return SweepResult(clean=CleanEvents(note_id=note_id, events=list(events), margins=margins, z=z),
                       necessity=necessity, knockin=knockin)


def per_note_set_rows(necessity: Sequence[dict], knockin: Sequence[dict]) -> list[dict]:
    """Per (note, phase, set, k): mean necessity over events and mean recovery over gated events."""
    import pandas as pd

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
    return df.to_dict("records")
