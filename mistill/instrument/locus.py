"""The forcing probe and the locus walk-back (paper App. F, "Forcing probe", "Locus").

**Forcing probe.** Cut the note at position ``c`` (the probe sees the note's tokens ``[0, c]``),
append a short suffix that makes the model name a code (:data:`SUFFIXES`, default B
``"\\nSo the code here is"``) at positions ``c + 1 .. c + s``, and read the chapter margin at the
suffix's last row: target = the token the model would write for the emitted chapter letter
right after the suffix, competitors = the tokens of the other inventory letters
(:func:`forced_choice_ids`, margin as :func:`mistill.instrument.patching.margins_from_logits`).
Every probe of a note is a batch element of a causal forward against the note's one prefix
(:meth:`mistill.instrument.runner.Runner.forward` with ``batch_prefix_len``): no prefill per
probe, and the cache is never copied or cropped — each element only sees its own
``prefix[:c + 1]`` (:func:`forced_margins`).

**Walk-back.** For a P1 event realized at ``q`` (token ``q + 1`` is the letter), distance
``d = q - c``; ``d = 0`` is the cache cut one token before the letter. From ``d = 0`` walk back on
the grid ``0, step, 2 step, ...`` until the forced margin first drops below ``theta``; record
``extra_steps`` more grid points for the shape of the curve; then probe every distance strictly
inside the crossing step. The locus distance is the largest ``d`` such that every probed
distance in ``[0, d]`` has margin ``>= theta`` (the earliest cut from which the margin stays
decisive all the way to the code token); the locus is the position ``q - d``. Outcomes
(:data:`OUTCOMES`): ``probe_failure`` (not decisive at ``d = 0``), ``code_token`` (locus distance
0), ``censored`` (decisive at every grid point down to ``q - max_back``), otherwise ``window``
(locus after the end of the previous mention's code, or no previous code) or ``inherited``
(locus at or before it). :func:`walk_back` is a pure function of a probe callable;
:func:`locate` runs it on a model and :func:`locate_many` runs every mention of a note in shared
forwards, round by round.

**Previous code end.** ``previous_code_end`` of a mention is the token position of the last token
of the code mentioned just before it in the trace (any code, any chapter, repeated mentions
included), ``None`` for the first code of the trace: the rule of
:func:`mistill.instrument.locus_tokens.previous_code_end` over the trace's mention token spans.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mistill.errors import MistillInputError
from mistill.instrument.patching import margins_from_logits
from mistill.instrument.runner import KVPrefix, Runner

__all__ = ["SUFFIXES", "DEFAULT_SUFFIX", "OUTCOMES", "ForcedChoice", "forced_choice_ids", "suffix_token_ids",
           "forced_margins", "LocusConfig", "LocusResult", "MentionProbe", "grid_distances", "walk_back",
           "locate", "locate_many"]

SUFFIXES: dict[str, str] = {
    "A": "\nCode:",
    "B": "\nSo the code here is",
    "D": " The corresponding ICD-10-CM code is",
}
"""The forcing suffixes. B is the paper's; D is the paper's best on the full corpus. A, the
pilot's weakest, is **[recon]**: the paper does not give its wording; ``"\\nCode:"`` is ours."""

DEFAULT_SUFFIX = "B"

OUTCOMES = ("code_token", "window", "inherited", "probe_failure", "censored")
"""The five outcomes of a chapter mention (paper App. F, "Locus")."""


# -- the forced choice -------------------------------------------------------------------------

@dataclass(frozen=True)
class ForcedChoice:
    """Target and competitor token ids of a forced margin (``competitor_ids`` excludes the target)."""

    target_id: int
    competitor_ids: tuple[int, ...]


def _encode(tokenizer, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def suffix_token_ids(tokenizer, suffix: str = DEFAULT_SUFFIX) -> torch.Tensor:
    """``[s]`` token ids of the suffix named ``suffix`` (a key of :data:`SUFFIXES`)."""
    if suffix not in SUFFIXES:
        raise MistillInputError(f"unknown forcing suffix {suffix!r} (one of {sorted(SUFFIXES)})", field="suffix")
    return torch.tensor(_encode(tokenizer, SUFFIXES[suffix]), dtype=torch.long)


def _letter_token(tokenizer, suffix: str, suffix_ids: Sequence[int], letter: str) -> int:
    full = _encode(tokenizer, suffix + " " + letter)
    n = len(suffix_ids)
    if len(full) <= n or full[:n] != list(suffix_ids):
        raise MistillInputError(f"letter {letter!r}: the suffix {suffix!r} does not tokenize as a prefix of "
                                f"suffix + ' {letter}'", field="letters")
    return full[n]


def forced_choice_ids(tokenizer, suffix: str, target_letter: str, letters: Sequence[str]) -> ForcedChoice:
    """The token the model would write for each chapter letter right after ``suffix`` (its text).

    Each letter's token is the first token after the suffix's tokens in the tokenization of
    ``suffix + " " + letter``: the letter written with one leading space, **[recon]** (the paper
    does not say which spacing variant the probe reads). Competitors: the other letters of
    ``letters`` (the target is left out if listed), deduplicated, in order.

    Raises:
        MistillInputError: naming the letter whose tokenization does not start with the
            suffix's tokens, or when no competitor is left.
    """
    suffix_ids = _encode(tokenizer, suffix)
    target = _letter_token(tokenizer, suffix, suffix_ids, target_letter)
    comp: list[int] = []
    for letter in letters:
        if letter == target_letter:
            continue
        tok = _letter_token(tokenizer, suffix, suffix_ids, letter)
        if tok == target:
            raise MistillInputError(f"letter {letter!r} has the same token as the target {target_letter!r}",
                                    field="letters")
        if tok not in comp:
            comp.append(tok)
    if not comp:
        raise MistillInputError(f"no competitor letter for target {target_letter!r}", field="letters")
    return ForcedChoice(target_id=target, competitor_ids=tuple(comp))


# -- the forced margins ------------------------------------------------------------------------

def forced_margins(runner: Runner, prefix: KVPrefix, cuts: Sequence[int], suffix_ids: torch.Tensor | Sequence[int],
                   choices: ForcedChoice | Sequence[ForcedChoice], *, batch_size: int = 64) -> torch.Tensor:
    """Forced margins of many probes against one note's prefix.

    Probe ``i`` sees ``prefix[:cuts[i] + 1]`` (the note's tokens ``[0, cuts[i]]``) followed by the
    suffix at positions ``cuts[i] + 1 .. cuts[i] + s``; its margin is read at the last suffix row.
    Probes are batch elements of causal forwards (``batch_size`` per forward, sorted by cut so
    that elements of one forward need similar prefix lengths); no gradient.

    Args:
        cuts: ``[n]`` cut positions, ``0 <= cut < prefix.length``.
        suffix_ids: ``[s]`` the suffix's token ids.
        choices: one :class:`ForcedChoice` for every probe, or ``[n]`` of them.
    Returns:
        ``[n]`` float32 margins (CPU), in the order of ``cuts``.
    """
    cut_t = torch.as_tensor(list(cuts), dtype=torch.long).reshape(-1)
    n = cut_t.numel()
    per_row = [choices] * n if isinstance(choices, ForcedChoice) else list(choices)
    if len(per_row) != n:
        raise MistillInputError(f"{len(per_row)} forced choices for {n} cuts", field="choices")
    suffix = torch.as_tensor(suffix_ids, dtype=torch.long).reshape(-1)
    s = suffix.numel()
    if s == 0:
        raise MistillInputError("the forcing suffix has no tokens", field="suffix")
    if batch_size < 1:
        raise MistillInputError(f"batch_size must be >= 1, got {batch_size}", field="batch_size")
    if n and (int(cut_t.min()) < 0 or int(cut_t.max()) >= prefix.length):
        raise MistillInputError(f"cuts must lie in [0, {prefix.length}), got {cut_t.min().item()}.."
                                f"{cut_t.max().item()}", field="cuts")
    out = torch.empty(n, dtype=torch.float32)
    order = torch.argsort(cut_t, stable=True)
    offsets = torch.arange(s, dtype=torch.long)
    with torch.no_grad():
        for lo in range(0, n, batch_size):
            idx = order[lo:lo + batch_size]
            lens = cut_t[idx] + 1                                     # [b] prefix lengths
            positions = lens.unsqueeze(1) + offsets.unsqueeze(0)      # [b, s]
            ids = suffix.view(1, s).expand(idx.numel(), s)
            res = runner.forward(prefix, int(lens.max()), ids, positions, rows="causal",
                                 logits_rows=torch.tensor([s - 1]), batch_prefix_len=lens)
            logits = res.logits[:, 0]                                 # [b, vocab]
            for j, i in enumerate(idx.tolist()):
                ch = per_row[i]
                out[i] = margins_from_logits(logits[j], ch.target_id, ch.competitor_ids).float().cpu()
    return out


# -- the walk-back -------------------------------------------------------------------------------

@dataclass(frozen=True)
class LocusConfig:
    """Walk-back settings (paper App. F): ``theta`` (nats, decisive = margin ``>= theta``), grid
    ``step`` and ``max_back`` (tokens), ``extra_steps`` grid points recorded beyond the crossing,
    the forcing ``suffix`` (a key of :data:`SUFFIXES`), and ``grid_batch`` grid points requested
    per round after the first, which probes the code token alone (speed only: the result does not
    depend on it)."""

    theta: float = 2.0
    step: int = 8
    max_back: int = 512
    extra_steps: int = 4
    suffix: str = DEFAULT_SUFFIX
    grid_batch: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.theta, bool) or not isinstance(self.theta, (int, float)) or not math.isfinite(self.theta) \
                or self.theta <= 0:
            raise MistillInputError(f"theta must be a finite number > 0, got {self.theta!r}", field="theta")
        for name, low in (("step", 1), ("max_back", 1), ("extra_steps", 0), ("grid_batch", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise MistillInputError(f"{name} must be an integer >= {low}, got {value!r}", field=name)
        if self.suffix not in SUFFIXES:
            raise MistillInputError(f"unknown forcing suffix {self.suffix!r} (one of {sorted(SUFFIXES)})",
                                    field="suffix")


@dataclass
class LocusResult:
    """The walk-back's result for one chapter mention.

    outcome: one of :data:`OUTCOMES`. locus: the position of the last context token of the
    earliest cut from which the forced margin stays ``>= theta`` up to the code token (None for
    ``probe_failure`` and ``censored``); distance: ``q - locus``. curve: ``(distance, margin)``
    of every probe the walk uses, by distance. jump: margin at the last decisive grid point minus
    margin at the first non-decisive one (None without both). returns_above: one of the extra
    grid points beyond the crossing is decisive again. reached_trace_start: the walk reached the
    earliest allowed cut (the trace start) still decisive. n_probes: ``len(curve)``.
    """

    outcome: str
    locus: int | None
    distance: int | None
    curve: list[tuple[int, float]] = field(default_factory=list)
    jump: float | None = None
    returns_above: bool = False
    reached_trace_start: bool = False
    n_probes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "locus": self.locus, "distance": self.distance,
                "curve": [[int(d), float(m)] for d, m in self.curve], "jump": self.jump,
                "returns_above": bool(self.returns_above), "reached_trace_start": bool(self.reached_trace_start),
                "n_probes": int(self.n_probes)}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> LocusResult:
        """Inverse of :meth:`to_dict` (other keys of ``row`` are ignored)."""
        def opt(key: str, cast):
            value = row.get(key)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                return None
            return cast(value)

        return cls(outcome=str(row["outcome"]), locus=opt("locus", int), distance=opt("distance", int),
                   curve=[(int(d), float(m)) for d, m in (row.get("curve") or [])], jump=opt("jump", float),
                   returns_above=bool(row.get("returns_above", False)),
                   reached_trace_start=bool(row.get("reached_trace_start", False)),
                   n_probes=int(row.get("n_probes", 0) or 0))


def grid_distances(max_distance: int, step: int) -> list[int]:
    """Grid distances ``0, step, 2 step, ...`` up to ``max_distance``, and ``max_distance`` itself
    when it is not on the grid (the earliest allowed cut is always probed)."""
    grid = list(range(0, max_distance + 1, step))
    if grid[-1] != max_distance:
        grid.append(max_distance)
    return grid


class _Walk:
    """The walk-back of one mention as a state machine over distances: :meth:`pending` gives the
    distances to probe next (empty when done), :meth:`feed` takes their margins."""

    def __init__(self, q: int, trace_start: int, previous_code_end: int | None, cfg: LocusConfig) -> None:
        self.q, self.cfg, self.previous_code_end = int(q), cfg, previous_code_end
        self.floor = int(q) - cfg.max_back
        # the last prompt token (trace_start - 1): the cache cropped before anything is written
        self.earliest = max(self.floor, int(trace_start) - 1, 0)
        if self.q < self.earliest:
            raise MistillInputError(f"q={q} lies before the earliest allowed cut {self.earliest} "
                                    f"(trace_start={trace_start})", field="q")
        self.grid = grid_distances(self.q - self.earliest, cfg.step)
        self.margins: dict[int, float] = {}
        self.cross: int | None = None  # grid index of the first non-decisive grid point

    def _decisive(self, d: int) -> bool:
        return self.margins[d] >= self.cfg.theta

    def _after_crossing(self) -> list[int]:
        """Distances the walk needs once the crossing is known: the extra grid points and every
        distance strictly inside the crossing step."""
        c = self.cross
        need = self.grid[c + 1:c + 1 + self.cfg.extra_steps]
        if c > 0:
            need = need + list(range(self.grid[c - 1] + 1, self.grid[c]))
        return need

    def pending(self) -> list[int]:
        if not self.margins:
            # the code token alone first: a mention not decisive there (a probe failure) needs no
            # other probe
            return [0]
        if self.cross is None:
            todo = [d for d in self.grid if d not in self.margins]
            return todo[:self.cfg.grid_batch]
        return [d for d in self._after_crossing() if d not in self.margins]

    @property
    def done(self) -> bool:
        return not self.pending()

    def feed(self, distances: Sequence[int], margins: Sequence[float]) -> None:
        if len(distances) != len(margins):
            raise ValueError(f"{len(margins)} margins for {len(distances)} probes")
        for d, m in zip(distances, margins):
            self.margins[int(d)] = float(m)
        if self.cross is not None:
            return
        for i, d in enumerate(self.grid):
            if d not in self.margins:
                return
            if not self._decisive(d):
                self.cross = i
                break
        if self.cross is None:
            return
        # grid points probed ahead of the crossing beyond the recorded extra steps are dropped,
        # so the result does not depend on how many grid points a round asked for
        keep = set(self.grid[:self.cross + 1 + self.cfg.extra_steps])
        self.margins = {d: m for d, m in self.margins.items() if d in keep or d not in self.grid}

    def result(self) -> LocusResult:
        theta, q = self.cfg.theta, self.q
        curve = sorted(self.margins.items())
        c = self.cross
        extras = [] if c is None else self.grid[c + 1:c + 1 + self.cfg.extra_steps]
        returns_above = any(self.margins[d] >= theta for d in extras)
        jump = None if c is None or c == 0 else self.margins[self.grid[c - 1]] - self.margins[self.grid[c]]
        base = dict(curve=curve, jump=jump, returns_above=returns_above, n_probes=len(curve))
        if c == 0:
            return LocusResult(outcome="probe_failure", locus=None, distance=None, **base)
        reached = False
        if c is None:
            if self.earliest == self.floor:
                return LocusResult(outcome="censored", locus=None, distance=None, **base)
            reached = True
            dist = self.grid[-1]
        else:
            dist = 0
            for d, m in curve:
                if m < theta:
                    break
                dist = d
        locus = q - dist
        if dist == 0:
            outcome = "code_token"
        elif self.previous_code_end is None or locus > self.previous_code_end:
            outcome = "window"
        else:
            outcome = "inherited"
        return LocusResult(outcome=outcome, locus=locus, distance=dist, reached_trace_start=reached, **base)


def walk_back(probe: Callable[[list[int]], Sequence[float]], q: int, trace_start: int,
              previous_code_end: int | None, cfg: LocusConfig) -> LocusResult:
    """The locus of one chapter mention from a probe callable (see the module docstring).

    Args:
        probe: ``cuts -> margins``, the forced margin of each cut position.
        q: the position whose output predicts the chapter letter.
        trace_start: the first token of the trace; ``trace_start - 1`` (the last prompt token)
            is the earliest allowed cut, with ``q - max_back`` (and 0).
        previous_code_end: the last token of the code mentioned just before, None for the first.
    Rules: the grid ``0, step, ...`` runs to the earliest allowed cut (which is always a grid
    point), the code token alone in the first round, then ``grid_batch`` points a round; the first grid point with margin ``< theta`` ends it;
    the ``extra_steps`` next grid points (within the allowed range) and every distance strictly
    inside the crossing step follow in one more round. Not decisive at ``d = 0``:
    ``probe_failure``; decisive at every grid point down to ``q - max_back``: ``censored``.
    **[recon]** When the earliest allowed cut is the trace start (closer than ``max_back``) and
    still decisive, the locus is that cut (``reached_trace_start``) and the window/inherited rule
    applies; the paper only says the walk stops at the start of the trace.
    """
    walk = _Walk(q, trace_start, previous_code_end, cfg)
    while True:
        dists = walk.pending()
        if not dists:
            return walk.result()
        margins = list(probe([walk.q - d for d in dists]))
        if len(margins) != len(dists):
            raise ValueError(f"probe returned {len(margins)} margins for {len(dists)} cuts")
        walk.feed(dists, margins)


# -- on a model --------------------------------------------------------------------------------

@dataclass(frozen=True)
class MentionProbe:
    """One chapter mention to locate: ``q`` (token ``q + 1`` is the letter), its forced ``choice``,
    the note's ``trace_start`` token and ``previous_code_end`` (module docstring; None: first code)."""

    q: int
    choice: ForcedChoice
    trace_start: int
    previous_code_end: int | None = None


def locate(runner: Runner, prefix: KVPrefix, q: int, choice: ForcedChoice, suffix_ids: torch.Tensor | Sequence[int],
           trace_start: int, previous_code_end: int | None, cfg: LocusConfig, *,
           batch_size: int = 64) -> LocusResult:
    """:func:`walk_back` of one mention with :func:`forced_margins` as the probe.

    ``suffix_ids``: ``[s]`` the token ids of the suffix ``cfg.suffix`` names (the caller tokenizes
    it, e.g. :func:`suffix_token_ids`); ``prefix`` must hold at least ``q + 1`` positions.
    """
    def probe(cuts: list[int]) -> list[float]:
        return forced_margins(runner, prefix, cuts, suffix_ids, choice, batch_size=batch_size).tolist()

    return walk_back(probe, q, trace_start, previous_code_end, cfg)


def locate_many(runner: Runner, prefix: KVPrefix, mentions: Sequence[MentionProbe],
                suffix_ids: torch.Tensor | Sequence[int], cfg: LocusConfig, *,
                batch_size: int = 64) -> list[LocusResult]:
    """:func:`locate` for every mention of one note, the walks advanced round by round: each round
    the pending probes of every unfinished mention run together as rows of shared forwards.
    Gives per mention the result of :func:`locate` (the same walk, the same probes)."""
    walks = [_Walk(m.q, m.trace_start, m.previous_code_end, cfg) for m in mentions]
    while True:
        todo = [(i, walks[i].pending()) for i in range(len(walks))]
        todo = [(i, dists) for i, dists in todo if dists]
        if not todo:
            return [w.result() for w in walks]
        cuts = [walks[i].q - d for i, dists in todo for d in dists]
        choices = [mentions[i].choice for i, dists in todo for _ in dists]
        margins = forced_margins(runner, prefix, cuts, suffix_ids, choices, batch_size=batch_size).tolist()
        k = 0
        for i, dists in todo:
            walks[i].feed(dists, margins[k:k + len(dists)])
            k += len(dists)
