"""How much a readout rests on: cells that print their counts, and "n too small" below a minimum.

A knock-in recovery (M4, the teacher's knock-in, an own-heads recovery) is a median over notes of
per-note means over gated events. With a handful of gated events from one or two notes it says
little, so a table shows such a cell as :data:`TOO_SMALL` rather than as a value, and every
value it shows carries the gated events and notes behind it. The minimum is a parameter of each
function (:data:`MIN_GATED_EVENTS`, :data:`MIN_NOTES` by default): a cell is shown when it rests
on at least ``min_events`` gated events **and** at least ``min_notes`` notes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_GATED_EVENTS = 10
"""The fewest gated events a shown recovery cell rests on."""
MIN_NOTES = 3
"""The fewest notes a shown recovery cell rests on (a note is the unit of every test)."""
TOO_SMALL = "n too small"
"""What a cell below the minimum shows instead of its value."""


@dataclass(frozen=True)
class Support:
    """The gated events and notes one readout rests on (``None``: not logged)."""

    n_events: int | None
    n_notes: int | None

    def clears(self, min_events: int = MIN_GATED_EVENTS, min_notes: int = MIN_NOTES) -> bool:
        """True when both counts are known and reach the minimum."""
        return (self.n_events is not None and self.n_notes is not None
                and self.n_events >= min_events and self.n_notes >= min_notes)

    def label(self) -> str:
        """``"14 ev / 4 notes"``; an unknown count as ``?``."""
        ev = "?" if self.n_events is None else str(self.n_events)
        notes = "?" if self.n_notes is None else str(self.n_notes)
        return f"{ev} ev / {notes} note{'' if self.n_notes == 1 else 's'}"


def support_of(metrics: dict[str, float], events_key: str, notes_key: str) -> Support:
    """The :class:`Support` logged under ``events_key`` and ``notes_key`` of ``metrics``."""
    def count(key: str) -> int | None:
        v = metrics.get(key)
        return None if v is None or not math.isfinite(float(v)) else int(round(float(v)))

    return Support(count(events_key), count(notes_key))


def value_text(value: float | None, digits: int = 3) -> str:
    """A number to ``digits`` decimals, ``-`` when absent or NaN."""
    if value is None or not math.isfinite(float(value)):
        return "-"
    return f"{float(value):.{digits}f}"


def readout_cell(value: float | None, support: Support, *, digits: int = 3, min_events: int = MIN_GATED_EVENTS,
                 min_notes: int = MIN_NOTES, counts: bool = True) -> str:
    """A recovery cell: the value, or :data:`TOO_SMALL` below the minimum (``-`` when absent);
    with ``counts`` the support in brackets after it (``"0.823 [14 ev / 4 notes]"``)."""
    if value is None or not math.isfinite(float(value)):
        text = "-"
    elif support.clears(min_events, min_notes):
        text = value_text(value, digits)
    else:
        text = TOO_SMALL
    return f"{text} [{support.label()}]" if counts and text != "-" else text


def floor_cell(mean: float | None, sd: float | None, draws: float | None, *, digits: int = 3) -> str:
    """The random floor over several draws: ``"0.012 ± 0.020 (5 draws)"``; ``-`` when absent."""
    if mean is None or not math.isfinite(float(mean)):
        return "-"
    n = "?" if draws is None or not math.isfinite(float(draws)) else str(int(draws))
    spread = value_text(sd, digits) if sd is not None else "?"
    return f"{float(mean):.{digits}f} ± {spread} ({n} draws)"
