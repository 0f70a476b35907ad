"""The locus pass of one note (paper App. F): probes, window attribution and the exact passes.

Two halves, because the fixed prose-time set needs every note's window attribution first:

- :func:`probe_note` (first half): the forcing probe walks back from every chapter mention
  (:mod:`mistill.instrument.locus`), under the chosen suffix and the compared ones (Table 25);
  the window attribution (:mod:`mistill.instrument.window`) at every attributed mention and
  at every NULL position; pass A (the emission set, the mention's own set, random and the
  emission bottom, over window and suffix; at one k also window-only and suffix-only); the
  class of each attribution-window token (Table 27) and where each event's importance sits
  (Table 28).
- :func:`sets_note` (second half): pass B (the fixed global prose-time set at window, suffix
  and both, against random and its bottom at the window), the follow-through (window-ablated
  and sustained, natural margin at the code), what the prose-time heads read at the locus
  (Table 33) and the residual swap (Figure 5).

Both take one prefilled note (its prefix and per-head means) and return plain rows; the stage
(:mod:`mistill.stages.locus`) stores them per note and aggregates them into the tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mistill.instrument.events import RealizedEvent
from mistill.instrument.hooks import HeadHook
from mistill.instrument.locus import (SUFFIXES, ForcedChoice, LocusConfig, LocusResult, MentionProbe,
                                      forced_choice_ids, locate_many)
from mistill.instrument.locus_tokens import (TOKEN_CLASSES, DescriptionWords, classify_tokens,
                                             mention_token_spans, previous_code_end)
from mistill.instrument.passes import stable_seed
from mistill.instrument.runner import KVPrefix, Runner
from mistill.instrument.window import (SwapSite, ablate_at, destroyed_share, follow_through, residual_swap,
                                       suffix_sum, window_attribution, window_sum)

ATTRIBUTED = ("window", "code_token", "censored")
"""Outcomes whose mentions get the window attribution (the paper's 804 attributed mentions)."""

POSITION_BINS: tuple[tuple[str, int, int], ...] = (("locus", 0, 0), ("before_1_3", 1, 3),
                                                   ("before_4_15", 4, 15), ("before_16_63", 16, 63))
"""Table 28's bins of window rows by distance before the locus (the suffix is its own bin)."""


@dataclass(frozen=True)
class Mention:
    """One chapter mention (a realized P1 event) as the locus pass sees it.

    q: the position whose output predicts the letter; first_token: the mention's first token;
    previous_code_end: the last token of the code mentioned just before (None: the first code);
    mention_kind: ``first_code``, ``previous_same_chapter`` or ``previous_other_chapter``.
    """

    event_id: str
    code: str
    letter: str
    q: int
    first_token: int
    previous_code_end: int | None
    mention_kind: str
    letters: tuple[str, ...]


@dataclass
class NoteProbe:
    """The first half's result for one note: per-mention rows, the attribution arrays and the
    window-token classes (counts per class over every attribution window, for Table 27's base rate)."""

    rows: list[dict[str, Any]]
    event_ids: list[str]
    kinds: list[str]
    window: np.ndarray      # [event, head] importance summed over window rows
    suffix: np.ndarray      # [event, head] importance summed over suffix rows
    class_counts: dict[str, int] = field(default_factory=dict)


def note_mentions(realized: Sequence[RealizedEvent], offsets: Sequence[tuple[int, int]], trace_offset: int,
                  mentions: Sequence[tuple[str, int, int]]) -> list[Mention]:
    """The note's chapter mentions (its P1 events) with their window boundary.

    mentions: every code mention of the trace ``(code, start, end)`` in trace characters
    (:func:`mistill.instrument.events.find_mentions`), repeats included: the "code mentioned just
    before" may be any of them.
    """
    spans = mention_token_spans(offsets, mentions, trace_offset)
    out = []
    for r in realized:
        ev = r.event
        if ev.kind != "P1" or ev.code is None or ev.mention_start is None:
            continue
        first = mention_token_spans(offsets, [(ev.code, ev.mention_start, ev.mention_end or ev.mention_start + 1)],
                                    trace_offset)[0][1]
        prev = previous_code_end(spans, first)
        before = [c for c, f, _ in spans if f < first]
        kind = ("first_code" if not before else
                "previous_same_chapter" if before[-1][0] == ev.code[0] else "previous_other_chapter")
        out.append(Mention(event_id=ev.event_id, code=ev.code, letter=ev.target, q=r.position, first_token=first,
                           previous_code_end=prev, mention_kind=kind,
                           letters=(ev.target,) + tuple(ev.competitors)))
    return out


def _choice(tokenizer, suffix: str, letter: str, letters: Sequence[str]) -> ForcedChoice:
    return forced_choice_ids(tokenizer, suffix, letter, sorted(set(letters)))


def attribution_locus(result: LocusResult, q: int, cfg: LocusConfig) -> int | None:
    """Where the window of an attributed mention ends: its locus; for a censored mention the
    farthest probed position (``max_back`` tokens back), **[recon]** (the paper attributes its
    censored mentions without saying where their window lies)."""
    if result.outcome == "censored":
        return q - cfg.max_back
    return result.locus


def position_shares(importance: torch.Tensor | np.ndarray, n_window: int) -> dict[str, float]:
    """Table 28 for one event: share of its positive importance (window plus suffix, summed over
    heads, normalised to one) at the locus, 1–3 tokens before it, 4–15, 16–63, and the suffix.

    importance: ``[rows, heads]`` (window rows first, the locus last among them).
    """
    x = np.clip(np.asarray(importance, dtype=np.float64), 0.0, None).sum(-1)
    total = x.sum()
    out = {}
    for name, lo, hi in POSITION_BINS:
        idx = [n_window - 1 - d for d in range(lo, hi + 1) if 0 <= n_window - 1 - d < n_window]
        out[name] = float(x[idx].sum() / total) if total > 0 else float("nan")
    out["suffix"] = float(x[n_window:].sum() / total) if total > 0 else float("nan")
    return out


def _random_set(n_heads: int, k: int, *parts: object) -> list[int]:
    rng = np.random.default_rng(stable_seed(*parts))
    return sorted(rng.choice(n_heads, size=min(k, n_heads), replace=False).tolist())


def probe_note(runner: Runner, hook: HeadHook, prefix: KVPrefix, mean: torch.Tensor, *, note_id: str,
               input_ids: torch.Tensor, full_text: str, offsets: Sequence[tuple[int, int]], trace_start: int,
               mentions: Sequence[Mention], nulls: Sequence[RealizedEvent], tokenizer, words: DescriptionWords,
               code_spans: Sequence[tuple[int, int]], emission_rank: Sequence[int], cfg: LocusConfig,
               compare_suffixes: Sequence[str] = (), width: int = 64, pass_k: Sequence[int] = (8, 16),
               position_k: int = 16, seed: int = 0) -> NoteProbe:
    """The first half of the locus pass on one prefilled note (see the module docstring).

    emission_rank: the chapter (P1) global ranking of the run's heads, flat indices, best first.
    Returns per-mention rows (outcome, locus, distance, jump, curve shape, the compared suffixes'
    outcomes, the locus token's class, Table 28 shares, pass A shares) and, for every attributed
    mention and NULL event, the window and suffix importance sums ``[head]``.
    """
    n_heads = runner.geometry.n_total_heads
    suffix_text = SUFFIXES[cfg.suffix]
    suffix_ids = torch.tensor(tokenizer(suffix_text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    probes = [MentionProbe(q=m.q, choice=_choice(tokenizer, suffix_text, m.letter, m.letters),
                           trace_start=trace_start, previous_code_end=m.previous_code_end) for m in mentions]
    results = locate_many(runner, prefix, probes, suffix_ids, cfg)
    compared: dict[str, list[LocusResult]] = {}
    for name in compare_suffixes:
        text = SUFFIXES[name]
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        other = [MentionProbe(q=m.q, choice=_choice(tokenizer, text, m.letter, m.letters), trace_start=trace_start,
                              previous_code_end=m.previous_code_end) for m in mentions]
        compared[name] = locate_many(runner, prefix, other, ids,
                                     LocusConfig(**{**cfg.__dict__, "suffix": name}))
    rows, event_ids, kinds, win_rows, suf_rows = [], [], [], [], []
    class_counts = {c: 0 for c in TOKEN_CLASSES}
    emission = list(emission_rank)
    for i, (m, res, probe) in enumerate(zip(mentions, results, probes)):
        row: dict[str, Any] = {"note_id": note_id, "event_id": m.event_id, "code": m.code, "q": m.q,
                               "mention_kind": m.mention_kind, **res.to_dict()}
        for name, other in compared.items():
            row[f"outcome_{name}"] = other[i].outcome
            row[f"distance_{name}"] = other[i].distance
        locus = attribution_locus(res, m.q, cfg)
        row["attributed"] = res.outcome in ATTRIBUTED and locus is not None and locus >= 0
        if row["attributed"]:
            start = max(0, locus - width + 1)
            window_positions = list(range(start, locus + 1))
            classes = classify_tokens(full_text, offsets, window_positions, m.code, words, code_spans)
            for c in classes:
                class_counts[c] += 1
            row["locus_class"] = classes[-1]
            wa = window_attribution(runner, hook, prefix, input_ids, locus, suffix_ids, probe.choice.target_id,
                                    probe.choice.competitor_ids, mean, width=width)
            row["forced_margin"] = float(wa.margin)
            row.update({f"share_{k}": v for k, v in position_shares(wa.importance, wa.n_window).items()})
            w, s = window_sum(wa.importance, wa.n_window), suffix_sum(wa.importance, wa.n_window)
            event_ids.append(m.event_id)
            kinds.append("P1")
            win_rows.append(np.asarray(w, dtype=np.float32))
            suf_rows.append(np.asarray(s, dtype=np.float32))
            own = np.argsort(-(np.asarray(w, dtype=np.float64)), kind="stable").tolist()
            variants: list[tuple[str, list[int], str]] = []
            for k in pass_k:
                variants += [(f"emission_top{k}", emission[:k], "both"), (f"own_top{k}", own[:k], "both"),
                             (f"random{k}", _random_set(n_heads, k, seed, note_id, m.event_id, k, "random"), "both"),
                             (f"emission_bottom{k}", emission[::-1][:k], "both")]
            k = position_k
            variants += [(f"emission_top{k}_window", emission[:k], "window"),
                         (f"emission_top{k}_suffix", emission[:k], "suffix"),
                         (f"own_top{k}_window", own[:k], "window"), (f"own_top{k}_suffix", own[:k], "suffix")]
            ablated = ablate_at(runner, hook, prefix, input_ids, locus, suffix_ids, probe.choice.target_id,
                                probe.choice.competitor_ids, mean, [(h, where) for _, h, where in variants],
                                width=width)
            for (name, _, _), value in zip(variants, ablated.tolist()):
                row[f"passA_{name}"] = float(destroyed_share(float(wa.margin), float(value)))
        rows.append(row)
    for r in nulls:
        ev = r.event
        letters = (ev.target,) + tuple(ev.competitors)
        choice = _choice(tokenizer, suffix_text, ev.target, letters)
        wa = window_attribution(runner, hook, prefix, input_ids, r.position, suffix_ids, choice.target_id,
                                choice.competitor_ids, mean, width=width)
        event_ids.append(ev.event_id)
        kinds.append("NULL")
        win_rows.append(np.asarray(window_sum(wa.importance, wa.n_window), dtype=np.float32))
        suf_rows.append(np.asarray(suffix_sum(wa.importance, wa.n_window), dtype=np.float32))
    empty = np.zeros((0, n_heads), dtype=np.float32)
    return NoteProbe(rows=rows, event_ids=event_ids, kinds=kinds,
                     window=np.stack(win_rows) if win_rows else empty,
                     suffix=np.stack(suf_rows) if suf_rows else empty, class_counts=class_counts)


def sets_note(runner: Runner, hook: HeadHook, prefix: KVPrefix, mean: torch.Tensor, *, note_id: str,
              input_ids: torch.Tensor, mentions: Sequence[Mention], probe_rows: Sequence[Mapping[str, Any]],
              tokenizer, prose_rank: Sequence[int], emission_rank: Sequence[int], cfg: LocusConfig,
              width: int = 64, pass_k: Sequence[int] = (8, 16), follow_k: int = 16,
              swap_layers: Sequence[int] = (), tail: int = 8, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """The second half of the locus pass on one prefilled note (see the module docstring).

    prose_rank / emission_rank: the global prose-time and chapter rankings (flat heads, best
    first). Returns ``{"pass_b": [...], "follow_through": [...], "swap": [...]}`` rows.
    """
    n_heads = runner.geometry.n_total_heads
    suffix_text = SUFFIXES[cfg.suffix]
    suffix_ids = torch.tensor(tokenizer(suffix_text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    by_id = {m.event_id: m for m in mentions}
    prose, emission = list(prose_rank), list(emission_rank)
    out: dict[str, list[dict[str, Any]]] = {"pass_b": [], "follow_through": [], "swap": []}
    sites: list[tuple[Mention, int, ForcedChoice]] = []
    for row in probe_rows:
        if not row.get("attributed"):
            continue
        m = by_id[row["event_id"]]
        locus = attribution_locus(LocusResult.from_dict(row), m.q, cfg)
        choice = _choice(tokenizer, suffix_text, m.letter, m.letters)
        clean = float(row["forced_margin"])
        variants: list[tuple[str, list[int], str]] = []
        for k in pass_k:
            variants += [(f"prose_top{k}_window", prose[:k], "window"), (f"prose_top{k}_suffix", prose[:k], "suffix"),
                         (f"prose_top{k}_both", prose[:k], "both"),
                         (f"random{k}_window", _random_set(n_heads, k, seed, note_id, m.event_id, k, "passB"), "window"),
                         (f"prose_bottom{k}_window", prose[::-1][:k], "window")]
        ablated = ablate_at(runner, hook, prefix, input_ids, locus, suffix_ids, choice.target_id,
                            choice.competitor_ids, mean, [(h, where) for _, h, where in variants], width=width)
        b = {"note_id": note_id, "event_id": m.event_id, "outcome": row["outcome"], "forced_margin": clean}
        b.update({f"passB_{name}": float(destroyed_share(clean, v)) for (name, _, _), v in zip(variants, ablated.tolist())})
        b.update({f"forced_drop_{name}": clean - float(v) for (name, _, _), v in zip(variants, ablated.tolist())})
        out["pass_b"].append(b)
        if row["outcome"] == "window":
            sites.append((m, locus, choice))
            sets = {"prose": prose[:follow_k], "emission": emission[:follow_k],
                    "random": _random_set(n_heads, follow_k, seed, note_id, m.event_id, "follow")}
            names = ["none"] + list(sets)
            heads = [[]] + list(sets.values())
            target_id, comp = _natural_ids(tokenizer, input_ids, m)
            for sustained in (False, True):
                nat = follow_through(runner, hook, prefix, input_ids, locus, m.q, target_id, comp, mean, heads,
                                     sustained=sustained, width=width).tolist()
                for name, value in zip(names[1:], nat[1:]):
                    forced_drop = b.get(f"forced_drop_prose_top{follow_k}_window") if name == "prose" else None
                    out["follow_through"].append({
                        "note_id": note_id, "event_id": m.event_id, "set": name, "sustained": sustained,
                        "natural_clean": nat[0], "natural_ablated": value, "natural_drop": nat[0] - value,
                        "flipped": bool(nat[0] > 0 >= value),
                        "forced_drop": forced_drop})
    if swap_layers and len(sites) >= 2:
        out["swap"] = _swap_rows(runner, prefix, input_ids, sites, tokenizer, note_id, swap_layers, tail,
                                 suffix_ids, width)
    return out


def _natural_ids(tokenizer, input_ids: torch.Tensor, m: Mention) -> tuple[int, tuple[int, ...]]:
    """The natural margin's ids at the code: the letter token the trace wrote at ``q + 1`` and
    the other letters written the same way (the token of the letter with the same leading
    text as the trace's token, **[recon]**: the events run's realization gives these ids)."""
    target = int(input_ids[m.q + 1])
    piece = tokenizer.decode([target])
    lead = piece[:len(piece) - len(piece.lstrip())]
    comp = []
    for letter in m.letters[1:]:
        ids = tokenizer(lead + letter, add_special_tokens=False)["input_ids"]
        if ids:
            comp.append(int(ids[0]))
    return target, tuple(dict.fromkeys(c for c in comp if c != target))


def _swap_rows(runner: Runner, prefix: KVPrefix, input_ids: torch.Tensor,
               sites: Sequence[tuple[Mention, int, ForcedChoice]], tokenizer, note_id: str,
               layers: Sequence[int], tail: int, suffix_ids: torch.Tensor, width: int) -> list[dict[str, Any]]:
    """Residual swap rows: each window mention with the nearest window mention of another
    chapter as donor (**[recon]**: the paper names a different-chapter window mention of the
    same note without saying which)."""
    rows = []
    for i, (m, locus, choice) in enumerate(sites):
        donors = [(abs(j - i), j) for j, (d, _, _) in enumerate(sites) if d.letter != m.letter]
        if not donors:
            continue
        j = min(donors)[1]
        d, d_locus, d_choice = sites[j]
        t_nat, t_comp = _natural_ids(tokenizer, input_ids, m)
        d_nat, d_comp = _natural_ids(tokenizer, input_ids, d)
        target = SwapSite(locus=locus, q=m.q, forced=choice, natural_target_id=t_nat, natural_competitor_ids=t_comp)
        donor = SwapSite(locus=d_locus, q=d.q, forced=d_choice, natural_target_id=d_nat,
                         natural_competitor_ids=d_comp)
        for place in ("locus", "tail", "code"):
            for res in residual_swap(runner, prefix, input_ids, target, donor, layers, place, suffix_ids,
                                     tail=tail, width=width):
                rows.append({"note_id": note_id, "event_id": m.event_id, "donor_event_id": d.event_id,
                             "place": place, **res.to_dict()})
    return rows
