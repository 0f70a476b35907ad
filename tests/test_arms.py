"""Arms are data, and every ablation is one flag away from its base."""

from __future__ import annotations

import pytest

from mistill.distill.arms import (ArmConfig, arm_names, read_arm_file, resolve_arm)
from mistill.errors import MistillInputError

ISSUE_ARMS = {"vanilla-fp32", "vanilla-bf16", "feature-kd", "distillm2", "mistill", "randheads", "randpos",
              "randboth", "bottom40", "top8", "top100", "uniform", "no-window", "event-weighted-vanilla",
              "p1-only", "p2-only", "attention-only", "interaction-only", "write-term"}


def test_every_arm_of_the_paper_has_a_file():
    assert ISSUE_ARMS <= set(arm_names())


@pytest.mark.parametrize("name", sorted(ISSUE_ARMS - {"mistill"}))
def test_each_arm_changes_only_what_it_names(name):
    raw = read_arm_file(name)
    base = raw.pop("base")
    raw.pop("description", None)
    arm, parent = resolve_arm(name).to_dict(), resolve_arm(base).to_dict()
    changed = {k for k in arm if arm[k] != parent[k]}
    assert changed == set(raw), (name, changed, set(raw))
    assert changed  # an arm file that changes nothing is a duplicate


def test_mistill_defaults_match_the_paper():
    m = resolve_arm("mistill")
    assert m == ArmConfig()  # the dataclass defaults are Mistill's
    assert (m.lambda_p1, m.lambda_p2, m.pool_k, m.window, m.precision) == (0.1, 0.1, 40, 8, "bf16")
    assert resolve_arm("uniform").lambda_p1 == pytest.approx(0.135)
    assert resolve_arm("p2-only").lambdas == {"P1": 0.0, "P2": 0.1, "P2C": 0.1}


def test_overrides_and_errors():
    a = resolve_arm("mistill", "lambda_p1=0.03,terms=attention+write")
    assert a.lambda_p1 == 0.03 and a.terms == ("attention", "write")
    with pytest.raises(MistillInputError, match="unknown arm"):
        resolve_arm("no-such-arm")
    with pytest.raises(MistillInputError, match="lambda_pp"):
        resolve_arm("mistill", "lambda_pp=1")
    with pytest.raises(MistillInputError, match="pool_mode"):
        resolve_arm("mistill", "pool_mode=sideways")
