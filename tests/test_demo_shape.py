"""The embedded teacher's own heads carry its decisions on the demo's notes (a regression test of
the shape the demo's closing table shows).

SmolLM2-135M, the embedded default, is ranked by the instrument's first-order attribution
(``-A_h``, the mean over the phase's events of the validation notes of the demo's corpus); then
the first test note's events are knocked into the next test note at matched events (the demo's
``own_heads`` donor rule). At k = 8 and 40 and in every phase the recovery of its own top-k beats
the count-matched random set of the same events (the recorded draw) and the mean of five seeded
floor draws, and at k = 8 every one of them (at k = 40, 40 random heads of 270 can recover much
of a P2 margin in one draw: the floor's spread is wide there). fp32 on the CPU; the margins
involved are nats apart, far beyond float32 summation order.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mistill.data.synthetic import make_synthetic_corpus
from mistill.evaluation.own_heads import note_case, own_knockin, subsample_case
from mistill.instrument.hooks import HeadHook
from mistill.instrument.passes import PHASES, AttributionConfig, first_order_sweep, floor_draw, phase_means
from mistill.instrument.runner import Runner
from mistill.models.loading import EMBEDDED_DEFAULT, load_model
from mistill.stages.workflow import DEMO_DEFAULTS, PipelineConfig

K = (8, 40)
FLOOR_DRAWS = 5
TARGET_EVENTS = 10


def _mean(values):
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(vals)) if vals else float("nan")


@pytest.fixture(scope="module")
def knockin_rows():
    cfg = PipelineConfig()
    corpus = make_synthetic_corpus(n_notes=cfg.n_notes, seed=cfg.seed, n_codes_range=tuple(cfg.codes_per_note),
                                   inventory_size=cfg.inventory_size)
    lm = load_model(EMBEDDED_DEFAULT, dtype="float32", device="cpu")
    runner, hook = Runner(lm), HeadHook(lm.geometry)
    per_phase = int(DEMO_DEFAULTS["events_per_phase"])

    def case(note):
        return subsample_case(note_case(note, corpus.inventory, lm), per_phase, cfg.seed)

    # the ranking: mean first-order importance per phase over the validation notes
    sums: dict[str, list[np.ndarray]] = {}
    for note in [n for n in corpus.notes if n.split == cfg.teacher_split]:
        c = case(note)
        sweep = first_order_sweep(runner, hook, note.note_id, c.inp.input_ids, c.queries, AttributionConfig(),
                                  progress=False)
        for phase, mean in phase_means([q.kind for q in c.queries], sweep.first_order).items():
            sums.setdefault(phase, []).append(mean)
    rank = {}
    for phase, means in sums.items():
        score = np.mean(means, axis=0)
        rank[phase] = sorted(range(len(score)), key=lambda h: (-float(score[h]), h))  # ties: lower head
    # knock-in: the first test note's events into the next test note (one direction: two prefills),
    # up to TARGET_EVENTS per phase (more events cost no prefill)
    tests = [subsample_case(note_case(n, corpus.inventory, lm), TARGET_EVENTS, cfg.seed)
             for n in corpus.notes if n.split == cfg.eval_split]
    assert len(tests) >= 2
    _, kin = own_knockin(runner, hook, tests[0], tests[1:], rank, K, seed=cfg.seed, floor_draws=FLOOR_DRAWS)
    return kin


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("k", K)
def test_own_heads_beat_random_heads_and_their_floor(knockin_rows, phase, k):
    rows = [r for r in knockin_rows if r["phase"] == phase and r["k"] == k]
    own = [r["recovery"] for r in rows if r["set"] == "global" and r["gated"]]
    assert len(own) >= 3, f"{phase} k={k}: only {len(own)} gated events"
    draws: dict[int, list[float]] = {}
    for r in rows:
        d = floor_draw(r["set"])
        if d is not None and r["gated"]:
            draws.setdefault(d, []).append(r["recovery"])
    assert sorted(draws) == list(range(FLOOR_DRAWS))
    floors = [_mean(v) for v in draws.values()]
    own_mean = _mean(own)
    assert own_mean > floors[0] + 0.1, (phase, k, own_mean, floors[0])  # the recorded floor: draw 0
    assert own_mean > np.mean(floors) + 0.1, (phase, k, own_mean, floors)  # the floor over the draws
    if k == 8:  # 8 random heads of 270 recover little: every draw stays below the own set
        assert own_mean > max(floors), (phase, k, own_mean, floors)
