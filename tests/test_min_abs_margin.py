"""The event filter of the interaction and write terms: events whose ``c`` is undefined (a margin
of exactly 0, a non-finite teacher ``c``) always leave, and ``ArmConfig.min_abs_margin`` (a
[recon] guard, not in the paper) leaves out near-ties too when set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mistill.distill.arms import resolve_arm
from mistill.distill.note_data import build_note_data
from mistill.distill.objective import event_filter, micro_step_loss, pair_rows
from mistill.distill.pools import model_pools
from mistill.models.loading import tiny_model
from test_objective import _head_sets, setup  # noqa: F401 - the module fixture


def test_undefined_events_leave_whatever_the_threshold():
    t = torch.tensor([0.0, 1.0, 1.0, 0.2, 1.0, float("nan"), 1.0])
    s = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.3, 1.0, 1.0])
    c = torch.tensor([float("inf"), 1.0, float("nan"), 1.0, 1.0, 1.0, 2.0])
    assert event_filter(t, s, c, 0.0).tolist() == [False, False, False, True, True, False, True]
    assert event_filter(t, s, c, 0.5).tolist() == [False, False, False, False, False, False, True]


def _student(setup):  # noqa: F811
    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    student = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=16, d_model=64, seed=2)
    student.model.requires_grad_(True)
    nd_s = build_note_data(note, corpus.inventory, student.tokenizer, events)
    pairing = pair_rows(nd_s, nd_t.realized.values(), targets, window=8, teacher_trace_start=nd_t.trace_start)
    pools_s = model_pools(_head_sets(student, 1), student.geometry.head_names(), k=4)
    return student, nd_s, pairing, pools_s


def test_a_teacher_tie_leaves_the_term_finite_without_the_guard(setup):  # noqa: F811
    """A teacher event with margin exactly 0 stores ``c = inf`` (or NaN): with
    ``min_abs_margin=0`` it must still stay out of the interaction term."""
    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    student, nd_s, pairing, pools_s = _student(setup)
    ev = int(next(e for i, e in enumerate(pairing.teacher_event)
                  if e >= 0 and pairing.rows[i].phase == "P2C"))
    tied = dict(targets)
    tied["margin"], tied["c"] = targets["margin"].copy(), targets["c"].copy()
    tied["margin"][ev], tied["c"][ev] = 0.0, np.inf
    arm = resolve_arm("mistill", "min_abs_margin=0,terms=interaction")
    student.model.zero_grad(set_to_none=True)
    loss, parts = micro_step_loss(student.model, student, nd_s, tied, pairing, pools_s, arm)
    loss.backward()
    assert np.isfinite(parts["P2/interaction"]) and np.isfinite(parts["P2/interaction/P2C"])
    assert np.isfinite(parts["loss"])
    assert all(torch.isfinite(p.grad).all() for p in student.model.parameters() if p.grad is not None)


def test_the_threshold_changes_the_term_only_through_the_events_it_drops(setup):  # noqa: F811
    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    student, nd_s, pairing, pools_s = _student(setup)
    with torch.no_grad():
        _, off = micro_step_loss(student.model, student, nd_s, targets, pairing, pools_s,
                                 resolve_arm("mistill", "min_abs_margin=0"))
        _, huge = micro_step_loss(student.model, student, nd_s, targets, pairing, pools_s,
                                  resolve_arm("mistill", "min_abs_margin=1e9"))
    for phase in ("P1", "P2"):
        assert huge[f"{phase}/interaction"] == 0.0  # every event dropped: the term is 0, defined
        assert np.isfinite(off[f"{phase}/interaction"])
        assert huge[f"{phase}/attention"] == pytest.approx(off[f"{phase}/attention"])
    # no P2 or P2C event is left, so neither kind has an interaction diagnostic
    assert "P2/interaction/P2C" in off and not any(k.startswith("P2/interaction/") for k in huge)
