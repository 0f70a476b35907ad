"""The attribution pass over many notes, shared among the processes of a launch in waves.

A note's exact patches take their global nominees from the running global ranking: the mean
first-order importance over the notes before it in corpus order (App. C). The first-order
sweep of a note does not depend on any other note, so the pass runs in waves of one note per
process:

1. each process prefills its note of the wave and runs its first-order sweep
   (:func:`~mistill.instrument.passes.first_order_sweep`);
2. the processes exchange the notes' per-phase means (a few vectors of ``[head]``);
3. each process ranks its note's running global from every note before it (finished in an
   earlier launch, done in an earlier wave, or earlier in this wave) and runs the exact sweep
   over the prefix it still holds (:func:`~mistill.instrument.passes.exact_sweep`).

Every note sees exactly the ranking it would see in one process walking the notes in order,
with one prefill per note, so the numbers are the one-process numbers. The wave's ``k``-th
note goes to rank ``k``: the notes still to do, in corpus order, dealt round-robin
(:func:`mistill.distributed.shard`'s rule). Processes wait for each other once per wave, after
the first-order sweep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from mistill.distributed import World, gather
from mistill.instrument.hooks import HeadHook
from mistill.instrument.passes import (AttributionConfig, EventQuery, NoteAttribution, exact_sweep,
                                       first_order_sweep)
from mistill.instrument.runner import Runner

PhaseMeans = Mapping[str, np.ndarray]
"""A note's mean first-order importance per phase, ``{phase: [head]}``
(:func:`~mistill.instrument.passes.phase_means`)."""

RunningGlobal = Sequence[int] | Mapping[str, Sequence[int]]


def notes_before(order: Sequence[str], means: Mapping[str, PhaseMeans], note_id: str) -> dict[str, list[np.ndarray]]:
    """``{phase: [the means of every note before note_id in order that has the phase]}``, in order.

    Raises:
        KeyError: a note before ``note_id`` has no means yet (a scheduling error).
    """
    out: dict[str, list[np.ndarray]] = {}
    for other in order[:order.index(note_id)]:
        for phase, m in means[other].items():
            out.setdefault(phase, []).append(m)
    return out


def selftest_scope(cfg: AttributionConfig, order: Sequence[str], note_id: str) -> AttributionConfig:
    """``cfg`` for ``note_id``: its self-test is kept only when the note is among the first
    ``cfg.selftest_notes`` of ``order`` (every note when 0)."""
    if cfg.selftest_events and cfg.selftest_notes and order.index(note_id) >= cfg.selftest_notes:
        return cfg.replace(selftest_events=0)
    return cfg


def attribute_waves(runner: Runner, hook: HeadHook, order: Sequence[str], done: Mapping[str, PhaseMeans],
                    load: Callable[[str], tuple[torch.Tensor, Sequence[EventQuery]]], cfg: AttributionConfig,
                    running: Callable[[dict[str, list[np.ndarray]]], RunningGlobal], world: World, *,
                    progress: bool = True, on_wave: Callable[[int, int], None] | None = None,
                    ) -> Iterator[NoteAttribution]:
    """This process's notes of the pass, attributed in waves, in corpus order.

    Args:
        order: every note of the pass in corpus order.
        done: the per-phase means of the notes finished before (their results are not redone).
        load: a note's ``(input_ids [pos], event queries)``.
        running: the running global ranking from the per-phase means of the notes before a note
            (``{phase: [means in order]}``; a phase absent when no earlier note has it).
        world: this process and its peers (every rank must call this with the same arguments).
        on_wave: called with ``(wave index, waves)`` when a wave starts.

    Yields:
        Each of this rank's unfinished notes' attribution, as soon as it is measured.
    """
    todo = [n for n in order if n not in done]
    means: dict[str, PhaseMeans] = dict(done)
    waves = (len(todo) + world.size - 1) // world.size
    for w in range(waves):
        if on_wave is not None:
            on_wave(w, waves)
        wave = todo[w * world.size:(w + 1) * world.size]
        mine = wave[world.rank] if world.rank < len(wave) else None
        sweep = None
        if mine is not None:
            ids, queries = load(mine)
            sweep = first_order_sweep(runner, hook, mine, ids, queries, cfg, progress=progress)
        for item in gather((mine, sweep.phase_means()) if sweep is not None else None, world):
            if item is not None:
                means[item[0]] = item[1]
        if sweep is not None:
            yield exact_sweep(runner, hook, sweep, selftest_scope(cfg, order, mine),
                              running(notes_before(order, means, mine)), progress=progress)
            del sweep


__all__ = ["PhaseMeans", "notes_before", "selftest_scope", "attribute_waves"]
