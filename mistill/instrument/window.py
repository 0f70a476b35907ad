"""Measurements at a chapter mention's locus (App. F): window attribution, ablation, swaps.

The forcing probe places a chapter mention's *locus* ``L`` (a token position ``<= q``, where
``q`` is the row that predicts the chapter letter at ``q + 1``). Everything here runs short
forwards of a few rows against the note's key-value prefix cropped at the window start (the
prefix is never copied; it must already hold at least that many positions):

- the *attribution window*: the ``width`` tokens ending at the locus, ``[start, L]``;
- the *forced read*: the window rows followed by the forcing suffix at positions
  ``L + 1 .. L + s``; the forced margin is read at the last suffix row;
- the *natural read*: the original tokens teacher-forced from the window start to ``q``; the
  natural margin is read at row ``q`` (the letter emitted at ``q + 1``).

Functions:

- :func:`window_attribution`: every head's output at every window and suffix row as a
  gradient leaf (graph intact) and one backward from the forced margin give
  ``I[p, h] = -A[p, h] = -(mu_h - z_h(p)) . d margin / d z_h(p)`` (positive = supports the
  target). :func:`window_sum` is the prose-time quantity, :func:`suffix_sum` the one at the
  suffix rows.
- :func:`ablate_at`: exact forced margins with head sets mean-ablated at the window rows, the
  suffix rows or both (passes A and B); :func:`destroyed_share` turns them into the share of
  the forced margin destroyed.
- :func:`follow_through`: a set mean-ablated over the window, the original continuation run to
  the code, and the natural margin read there.
- :func:`residual_swap`: the residual stream after layer ``l`` of a donor mention written into
  the target's reads at the locus, the tail of the window or the code token.

One sign convention everywhere: a margin is ``logit(target) - logsumexp(logits[competitors])``
and an importance is clean minus ablated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from mistill.instrument.hooks import HeadHook, Patch, head_mask
from mistill.instrument.patching import margins_from_logits
from mistill.instrument.runner import KVPrefix, Runner

WHERE = ("window", "suffix", "both")
PLACES = ("locus", "tail", "code")


# -- the window ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    """The rows of one forced read: window positions ``[start, locus]`` then ``n_suffix`` suffix rows.

    Row ``r`` sits at position ``start + r``; rows ``< n_window`` carry the note's tokens, the
    rest the suffix.
    """

    start: int
    locus: int
    n_suffix: int

    @property
    def n_window(self) -> int:
        return self.locus - self.start + 1

    @property
    def n_rows(self) -> int:
        return self.n_window + self.n_suffix

    @property
    def positions(self) -> torch.Tensor:
        """``[row]`` position ids."""
        return torch.arange(self.start, self.start + self.n_rows)


def make_window(locus: int, n_suffix: int = 0, *, width: int = 64, floor: int = 0) -> Window:
    """The ``width`` tokens ending at ``locus``, clamped at ``floor``.

    **[recon]** The paper's window is "the 64 tokens that end at the locus" and says nothing
    about loci fewer than 64 tokens into the sequence: the window is clamped, ``start =
    max(locus - width + 1, floor)``, and is shorter there; ``floor`` (default 0, the first
    position) can be set to e.g. the trace start to keep the window out of the prompt.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, not {width}")
    if locus < floor:
        raise ValueError(f"locus {locus} before the window floor {floor}")
    return Window(start=max(locus - width + 1, floor), locus=locus, n_suffix=n_suffix)


def _ids(ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long).flatten()


def _check_prefix(prefix: KVPrefix, start: int) -> None:
    if prefix.length < start:
        raise ValueError(f"the prefix holds {prefix.length} positions; the window needs {start}")


def forced_tokens(input_ids: torch.Tensor, window: Window, suffix_ids: torch.Tensor) -> torch.Tensor:
    """``[row]`` tokens of the forced read: ``input_ids[start:locus+1]`` then the suffix."""
    if input_ids.numel() <= window.locus:
        raise ValueError(f"locus {window.locus} beyond the note ({input_ids.numel()} tokens)")
    return torch.cat([input_ids[window.start:window.locus + 1].long().cpu(), suffix_ids.cpu()])


def natural_tokens(input_ids: torch.Tensor, start: int, q: int) -> torch.Tensor:
    """``[row]`` tokens of the natural read: ``input_ids[start:q+1]`` (rows ``start .. q``)."""
    if input_ids.numel() <= q:
        raise ValueError(f"code row {q} beyond the note ({input_ids.numel()} tokens)")
    return input_ids[start:q + 1].long().cpu()


def _rows_where(window: Window, where: str) -> torch.Tensor:
    """``[row]`` bool: the window rows, the suffix rows or both."""
    if where not in WHERE:
        raise ValueError(f"where must be one of {WHERE}, not {where!r}")
    rows = torch.zeros(window.n_rows, dtype=torch.bool)
    if where in ("window", "both"):
        rows[:window.n_window] = True
    if where in ("suffix", "both"):
        rows[window.n_window:] = True
    return rows


def masked_margins(runner: Runner, hook: HeadHook, prefix: KVPrefix, start: int,
                   tokens: torch.Tensor, mask: torch.Tensor, values: torch.Tensor, read_row: int,
                   target_id: int, competitor_ids: Sequence[int], *,
                   batch_size: int = 32) -> torch.Tensor:
    """Margins at ``read_row`` of a causal read with chosen (row, head) outputs replaced.

    Each variant is one batch element of the forward: every element sees ``prefix[:start]``
    and its own earlier rows.

    Args:
        start: position of row 0 (the prefix is read up to it).
        tokens: ``[row]`` token ids at positions ``start .. start + row - 1``.
        mask: bool ``[variant, row, layer, head]``: where ``z`` is replaced.
        values: ``[layer, head, d_head]`` replacement (the note's means for mean-ablation).
        read_row: the row whose next-token logits give the margin.
    Returns:
        ``[variant]`` float32 margins (CPU).
    """
    _check_prefix(prefix, start)
    n_var, n_rows = mask.shape[:2]
    if n_rows != tokens.numel():
        raise ValueError(f"mask has {n_rows} rows, tokens {tokens.numel()}")
    positions = torch.arange(start, start + n_rows)
    out = torch.empty(n_var, dtype=torch.float32)
    vals = values.to(runner.device)
    with torch.no_grad():
        for lo in range(0, n_var, batch_size):
            hi = min(n_var, lo + batch_size)
            ids = tokens.view(1, -1).expand(hi - lo, -1)
            with hook.patch(Patch(mask=mask[lo:hi].to(runner.device), values=vals)):
                res = runner.forward(prefix, start, ids, positions, rows="causal",
                                     logits_rows=torch.tensor([read_row]))
            out[lo:hi] = margins_from_logits(res.logits[:, 0], target_id, competitor_ids).float().cpu()
    return out


def _set_mask(runner: Runner, sets: Sequence[Sequence[int]], rows: torch.Tensor) -> torch.Tensor:
    """Head sets ``[variant]`` x row selectors ``[variant, row]`` -> bool ``[variant, row, layer, head]``."""
    heads = head_mask(sets, runner.geometry)  # [variant, layer, head]
    return rows[:, :, None, None] & heads[:, None]


# -- window attribution ----------------------------------------------------------------------

@dataclass
class WindowAttribution:
    """First-order importance of every head at every row of one forced read.

    ``importance``: ``[row, layer * head]`` = ``-A[p, h]``; rows ``< n_window`` are the window
    positions, the rest the suffix rows. ``margin``: the clean forced margin. ``positions``:
    ``[row]`` position ids. ``window``: the rows' layout.
    """

    importance: torch.Tensor
    margin: float
    n_window: int
    positions: torch.Tensor
    window: Window


def window_attribution(runner: Runner, hook: HeadHook, prefix: KVPrefix, input_ids: torch.Tensor,
                       locus: int, suffix_ids: torch.Tensor | Sequence[int], target_id: int,
                       competitor_ids: Sequence[int], mean: torch.Tensor, *, width: int = 64,
                       floor: int = 0, detach: bool = False) -> WindowAttribution:
    """One causal forward of the window and suffix rows and one backward from the forced margin.

    Args:
        input_ids: ``[pos]`` the note's tokens.
        locus: the locus position ``L`` (the window ends there, the suffix follows at ``L + 1``).
        suffix_ids: ``[s]`` the forcing suffix's token ids.
        mean: ``[layer, head, d_head]`` per-head means over the note (from the prefill).
        width, floor: the window (:func:`make_window`).
        detach: cut the graph at every layer's head outputs (direct paths only; self-test).
    Returns:
        :class:`WindowAttribution` with ``importance`` ``[row, layer * head]``.
    """
    suffix = _ids(suffix_ids)
    win = make_window(locus, suffix.numel(), width=width, floor=floor)
    _check_prefix(prefix, win.start)
    tokens = forced_tokens(input_ids, win, suffix).view(1, -1)
    with torch.enable_grad(), hook.grad_leaf(detach=detach) as leaves:
        out = runner.forward(prefix, win.start, tokens, win.positions, rows="causal",
                             logits_rows=torch.tensor([win.n_rows - 1]))
        margin = margins_from_logits(out.logits[0, 0], target_id, competitor_ids)
        margin.backward()
        grads = leaves.grads[0].float()  # [row, layer, head, d_head]
        z = leaves.z[0].float()
    a = ((mean.float().to(z.device).unsqueeze(0) - z) * grads).sum(-1)  # A [row, layer, head]
    return WindowAttribution(importance=(-a).flatten(1).detach().cpu(), margin=float(margin.detach()),
                             n_window=win.n_window, positions=win.positions, window=win)


def window_sum(importance: torch.Tensor, n_window: int) -> torch.Tensor:
    """Prose-time importance ``[layer * head]``: ``importance`` ``[row, layer * head]`` summed over the window rows."""
    return importance[:n_window].sum(0)


def suffix_sum(importance: torch.Tensor, n_window: int) -> torch.Tensor:
    """Importance at the suffix ``[layer * head]``: ``importance`` ``[row, layer * head]``
    summed over the suffix rows."""
    return importance[n_window:].sum(0)


# -- exact mean-ablation at the locus (passes A and B) ------------------------------------------

def ablate_at(runner: Runner, hook: HeadHook, prefix: KVPrefix, input_ids: torch.Tensor, locus: int,
              suffix_ids: torch.Tensor | Sequence[int], target_id: int, competitor_ids: Sequence[int],
              mean: torch.Tensor, variants: Sequence[tuple[Sequence[int], str]], *, width: int = 64,
              floor: int = 0, batch_size: int = 32) -> torch.Tensor:
    """Forced margins with each variant's heads mean-ablated at the window, the suffix or both.

    Args:
        variants: ``(heads, where)`` per variant: flat head indices (``layer * n_heads + head``;
            empty = the clean forced margin) and ``where`` in ``{"window", "suffix", "both"}``.
        mean: ``[layer, head, d_head]`` per-head means over the note.
    Returns:
        ``[variant]`` float32 forced margins, in the order given.
    """
    suffix = _ids(suffix_ids)
    win = make_window(locus, suffix.numel(), width=width, floor=floor)
    tokens = forced_tokens(input_ids, win, suffix)
    rows = torch.stack([_rows_where(win, where) for _, where in variants]) if variants else \
        torch.zeros(0, win.n_rows, dtype=torch.bool)
    mask = _set_mask(runner, [heads for heads, _ in variants], rows)
    return masked_margins(runner, hook, prefix, win.start, tokens, mask, mean, win.n_rows - 1,
                          target_id, competitor_ids, batch_size=batch_size)


def destroyed_share(clean: torch.Tensor | float, ablated: torch.Tensor | float) -> torch.Tensor:
    """Share of the clean margin destroyed: ``(clean - ablated) / clean`` (``> 1``: flipped).

    Defined only where the clean margin supports the target: NaN where ``clean <= 0``
    (a share of a non-positive margin has no meaning; such events are left out of medians).
    Broadcasts; returns float64.
    """
    c = torch.as_tensor(clean, dtype=torch.float64)
    a = torch.as_tensor(ablated, dtype=torch.float64)
    share = (c - a) / c
    return torch.where(c > 0, share, torch.full_like(share, float("nan")))


# -- follow-through to the code ------------------------------------------------------------------

def follow_through(runner: Runner, hook: HeadHook, prefix: KVPrefix, input_ids: torch.Tensor,
                   locus: int, q: int, target_id: int, competitor_ids: Sequence[int],
                   mean: torch.Tensor, sets: Sequence[Sequence[int]], *, sustained: bool = False,
                   include_code: bool = True, width: int = 64, floor: int = 0,
                   batch_size: int = 32) -> torch.Tensor:
    """Natural margins at the code with each set mean-ablated over the window.

    The original tokens are teacher-forced from the window start to ``q``; each set's heads are
    mean-ablated at the window rows ``[start, locus]`` (``sustained``: from the window start
    all the way to the code) and the natural margin is read at row ``q``.

    **[recon]** The sustained ablation "from the window all the way to the code" includes the
    code row ``q`` itself (``include_code=True``); ``include_code=False`` stops it at ``q - 1``
    (still at least the window).

    Args:
        q: the row that predicts the chapter letter (the letter is token ``q + 1``).
        target_id, competitor_ids: the emitted letter at ``q + 1`` and the other letters, in
            that mention's spacing variant.
        sets: flat head indices per variant (empty = the clean natural margin).
    Returns:
        ``[set]`` float32 natural margins.
    """
    if q < locus:
        raise ValueError(f"code row {q} before the locus {locus}")
    win = make_window(locus, 0, width=width, floor=floor)
    tokens = natural_tokens(input_ids, win.start, q)
    n_rows = tokens.numel()
    end = n_rows if include_code else max(n_rows - 1, win.n_window)
    row = torch.zeros(n_rows, dtype=torch.bool)
    row[:end if sustained else win.n_window] = True
    mask = _set_mask(runner, sets, row.view(1, -1).expand(len(sets), -1))
    return masked_margins(runner, hook, prefix, win.start, tokens, mask, mean, n_rows - 1,
                          target_id, competitor_ids, batch_size=batch_size)


# -- residual-stream swap -------------------------------------------------------------------------

class Choice(Protocol):
    """A margin's token ids: the target and its competitors (the competitors exclude the target)."""

    target_id: int
    competitor_ids: tuple[int, ...]


@dataclass(frozen=True)
class SwapSite:
    """One chapter mention for the residual swap.

    ``forced``: the forced read's letter ids (the emitted letter after the suffix and the other
    letters, same spacing variant); ``natural_target_id`` / ``natural_competitor_ids``: the
    letter the trace writes at ``q + 1`` and the other letters written the same way.
    """

    locus: int
    q: int
    forced: Choice
    natural_target_id: int
    natural_competitor_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.q < self.locus:
            raise ValueError(f"code row {self.q} before the locus {self.locus}")

    @property
    def forced_letters(self) -> tuple[int, ...]:
        """Every letter's id in the forced read, the emitted one first."""
        return (int(self.forced.target_id),) + tuple(int(c) for c in self.forced.competitor_ids)

    @property
    def natural_letters(self) -> tuple[int, ...]:
        """Every letter's id at the code, the emitted one first."""
        return (int(self.natural_target_id),) + tuple(int(c) for c in self.natural_competitor_ids)


@dataclass(frozen=True)
class SwapResult:
    """Margins of the target mention after (and before) a swap after ``layer`` at ``place``.

    ``forced*``: at the target's locus with the suffix appended; ``natural*``: at the target's
    code row ``q``. Plain names are the target letter's margin, ``*_donor`` the donor letter's
    (vs every other letter); ``clean_*`` the same without the swap. ``donor_wins``: the donor
    letter has the highest logit among the letters at the code. ``n_forced`` / ``n_natural``:
    rows swapped in each read (0: that read is untouched, e.g. the code token in the forced
    read when ``q > locus``).
    """

    layer: int
    place: str
    forced: float
    forced_donor: float
    natural: float
    natural_donor: float
    clean_forced: float
    clean_forced_donor: float
    clean_natural: float
    clean_natural_donor: float
    donor_wins: bool
    n_forced: int
    n_natural: int

    @property
    def forced_drop(self) -> float:
        return self.clean_forced - self.forced

    @property
    def natural_drop(self) -> float:
        return self.clean_natural - self.natural

    @property
    def donor_gain(self) -> float:
        return self.natural_donor - self.clean_natural_donor

    def to_dict(self) -> dict[str, Any]:
        """The fields and the three derived quantities, as plain Python values."""
        return {**asdict(self), "forced_drop": self.forced_drop, "natural_drop": self.natural_drop,
                "donor_gain": self.donor_gain}


def _letter_margin(logits: torch.Tensor, letters: Sequence[int], letter: int) -> float:
    """Margin of ``letter`` against every other id in ``letters``; ``logits`` ``[vocab]``."""
    return float(margins_from_logits(logits, letter, [t for t in letters if t != letter]))


@dataclass
class _Read:
    """A clean causal read: ``tokens`` ``[row]`` from position ``start``; ``hidden`` ``[layer, row,
    d_model]`` entering each layer; ``logits`` ``[vocab]`` at the last row; ``n_original``: the
    leading rows that carry the note's own tokens."""

    start: int
    tokens: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor
    n_original: int


def _clean_read(runner: Runner, prefix: KVPrefix, start: int, tokens: torch.Tensor,
                n_original: int) -> _Read:
    _check_prefix(prefix, start)
    with torch.no_grad():
        out = runner.forward(prefix, start, tokens.view(1, -1), torch.arange(start, start + tokens.numel()),
                             rows="causal", capture_hidden=True,
                             logits_rows=torch.tensor([tokens.numel() - 1]))
    return _Read(start=start, tokens=tokens, hidden=out.hidden_in[:, 0], logits=out.logits[0, 0],
                 n_original=n_original)


def _site_reads(runner: Runner, prefix: KVPrefix, input_ids: torch.Tensor, site: SwapSite,
                suffix: torch.Tensor, width: int, floor: int) -> tuple[Window, _Read, _Read]:
    win = make_window(site.locus, suffix.numel(), width=width, floor=floor)
    forced = _clean_read(runner, prefix, win.start, forced_tokens(input_ids, win, suffix), win.n_window)
    nat_tokens = natural_tokens(input_ids, win.start, site.q)
    natural = _clean_read(runner, prefix, win.start, nat_tokens, nat_tokens.numel())
    return win, forced, natural


def swap_positions(site: SwapSite, window: Window, place: str, *, tail: int = 8) -> list[int]:
    """Positions swapped at a site: the locus, the last ``tail`` window positions, or the code row."""
    if place == "locus":
        return [site.locus]
    if place == "tail":
        return list(range(max(window.start, site.locus - tail + 1), site.locus + 1))
    if place == "code":
        return [site.q]
    raise ValueError(f"place must be one of {PLACES}, not {place!r}")


def align_positions(target: Sequence[int], donor: Sequence[int]) -> list[tuple[int, int]]:
    """Pair target and donor positions from the end (locus with locus, ``k``-th with ``k``-th).

    **[recon]** Where one tail is shorter (a window clamped near the start of the note), the
    pairs are counted back from the locus and the surplus earlier positions are left unswapped.
    """
    k = min(len(target), len(donor))
    return list(zip(target[len(target) - k:], donor[len(donor) - k:]))


def _swapped_hidden(read: _Read, pairs: Sequence[tuple[int, int]], donor_sources: Sequence[_Read],
                    layer: int) -> tuple[torch.Tensor, int]:
    """The target read's residual entering ``layer + 1`` ``[1, row, d_model]`` with the donor's
    written in at the paired positions that carry original tokens in this read."""
    h = read.hidden[layer + 1].clone()
    n = 0
    for tp, dp in pairs:
        row = tp - read.start
        if not 0 <= row < read.n_original:
            continue
        src = next(s for s in donor_sources if 0 <= dp - s.start < s.n_original)
        h[row] = src.hidden[layer + 1, dp - src.start].to(h.dtype)
        n += 1
    return h.unsqueeze(0), n


def _run_from(runner: Runner, prefix: KVPrefix, read: _Read, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """Logits ``[vocab]`` at the read's last row, layers ``> layer`` recomputed from ``hidden``."""
    with torch.no_grad():
        out = runner.forward(prefix, read.start, read.tokens.view(1, -1),
                             torch.arange(read.start, read.start + read.tokens.numel()), rows="causal",
                             start_layer=layer + 1, start_hidden=hidden,
                             logits_rows=torch.tensor([read.tokens.numel() - 1]))
    return out.logits[0, 0]


def swap_layer_grid(n_layers: int, *, step: int = 4) -> list[int]:
    """The swap layers ``0, step, 2 * step, ...`` up to ``n_layers - 2``.

    **[recon]** The paper reports grid layers L4, L12-L20, L24 and L28 of a 40-layer model
    without listing the grid: every ``step``-th layer (default 4) from layer 0. The last layer is
    excluded (its output feeds nothing but its own row's logits).
    """
    return list(range(0, n_layers - 1, step))


def residual_swap(runner: Runner, prefix: KVPrefix, input_ids: torch.Tensor, target: SwapSite,
                  donor: SwapSite, layers: Sequence[int], place: str,
                  suffix_ids: torch.Tensor | Sequence[int], *, width: int = 64, floor: int = 0,
                  tail: int = 8, donor_natural_id: int | None = None) -> list[SwapResult]:
    """Write the donor's residual stream after layer ``l`` into the target's reads at ``place``.

    For each ``l`` in ``layers`` the residual stream after layer ``l`` (the stream entering
    ``l + 1``) is taken from the donor's clean forward and written into the target's forced
    read (window + suffix) and natural read (window start .. ``q``) at ``place``: ``"locus"``
    (locus <-> donor locus), ``"tail"`` (the last ``tail`` window positions, paired from the
    locus back, :func:`align_positions`) or ``"code"`` (``q`` <-> donor ``q``); layers
    ``<= l`` are unchanged, so each read restarts at layer ``l + 1`` from its clean stream. A
    position enters a read only where that read carries the note's token there (the code token
    is not in the forced read unless ``q == locus``). The donor's stream at a position comes from
    its own read of the same kind when that read holds the position, else from its natural read.
    Both mentions are in the note whose prefix is given (one prefix serves both).

    Args:
        input_ids: ``[pos]`` the note's tokens.
        layers: swap layers, each in ``[0, n_layers - 2]`` (:func:`swap_layer_grid`).
        suffix_ids: ``[s]`` the forcing suffix.
        width, floor: the windows (:func:`make_window`); tail: the tail's length (the paper's 8).
        donor_natural_id: the donor's letter as it would be written at the target's code (the
            target's spacing variant). Default: the donor's own natural letter token, which must
            then be one of the target's natural letters. The donor's forced letter (same suffix,
            same variant) must be one of the target's forced letters.
    Returns:
        One :class:`SwapResult` per layer, in the order given.
    """
    if place not in PLACES:
        raise ValueError(f"place must be one of {PLACES}, not {place!r}")
    n_layers = runner.geometry.n_layers
    bad = [l for l in layers if not 0 <= l <= n_layers - 2]
    if bad:
        raise ValueError(f"swap layers must lie in [0, {n_layers - 2}]: {bad}")
    donor_forced = int(donor.forced.target_id)
    donor_natural = int(donor.natural_target_id if donor_natural_id is None else donor_natural_id)
    if donor_forced not in target.forced_letters:
        raise ValueError(f"the donor's forced letter {donor_forced} is not among the target's {target.forced_letters}")
    if donor_natural not in target.natural_letters:
        raise ValueError(f"the donor's natural letter {donor_natural} is not among the target's "
                         f"{target.natural_letters}: give donor_natural_id in the target's spacing variant")
    suffix = _ids(suffix_ids)
    ids = input_ids.long().cpu()
    t_win, t_forced, t_natural = _site_reads(runner, prefix, ids, target, suffix, width, floor)
    d_win, d_forced, d_natural = _site_reads(runner, prefix, ids, donor, suffix, width, floor)
    pairs = align_positions(swap_positions(target, t_win, place, tail=tail),
                            swap_positions(donor, d_win, place, tail=tail))

    def margins(forced_logits: torch.Tensor, natural_logits: torch.Tensor) -> tuple[float, ...]:
        return (_letter_margin(forced_logits, target.forced_letters, int(target.forced.target_id)),
                _letter_margin(forced_logits, target.forced_letters, donor_forced),
                _letter_margin(natural_logits, target.natural_letters, int(target.natural_target_id)),
                _letter_margin(natural_logits, target.natural_letters, donor_natural))

    clean = margins(t_forced.logits, t_natural.logits)
    results = []
    for layer in layers:
        logits = {}
        counts = {}
        for name, read, sources in (("forced", t_forced, (d_forced, d_natural)),
                                    ("natural", t_natural, (d_natural,))):
            hidden, n = _swapped_hidden(read, pairs, sources, layer)
            counts[name] = n
            logits[name] = _run_from(runner, prefix, read, layer, hidden) if n else read.logits
        swapped = margins(logits["forced"], logits["natural"])
        letters = torch.as_tensor(target.natural_letters, device=logits["natural"].device)
        results.append(SwapResult(layer=layer, place=place, forced=swapped[0], forced_donor=swapped[1],
                                  natural=swapped[2], natural_donor=swapped[3], clean_forced=clean[0],
                                  clean_forced_donor=clean[1], clean_natural=clean[2],
                                  clean_natural_donor=clean[3],
                                  donor_wins=int(letters[logits["natural"][letters].argmax()]) == donor_natural,
                                  n_forced=counts["forced"], n_natural=counts["natural"]))
    return results


def flip_layer(results: Sequence[SwapResult]) -> int | None:
    """The first grid layer from which the donor letter wins the natural decision at the code.

    "From which" means at that layer and at every later layer swapped (results of one place,
    any order); ``None`` when the donor does not win at the deepest layer.
    """
    if len({r.place for r in results}) > 1:
        raise ValueError("flip_layer takes the results of one place")
    flip = None
    for r in sorted(results, key=lambda r: r.layer, reverse=True):
        if not r.donor_wins:
            break
        flip = r.layer
    return flip


def transport_ratio(natural_drop: torch.Tensor | float, forced_drop: torch.Tensor | float, *,
                    min_forced_drop: float = 1.0) -> torch.Tensor:
    """Natural drop over forced drop, NaN where the forced drop is ``<= min_forced_drop`` nats.

    Broadcasts; returns float64.
    """
    nat = torch.as_tensor(natural_drop, dtype=torch.float64)
    forced = torch.as_tensor(forced_drop, dtype=torch.float64)
    ratio = nat / forced
    return torch.where(forced > min_forced_drop, ratio, torch.full_like(ratio, float("nan")))
