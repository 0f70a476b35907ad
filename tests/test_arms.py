"""Arms are data, and every ablation is one flag away from its base; a bare arm name stays
inside the arms folder, an explicit .yaml path is read and its content joins the run's identity,
and every flag value is validated."""

from __future__ import annotations

import hashlib
import os

import pytest

from mistill.distill.arms import ARMS_DIR, ArmConfig, arm_names, read_arm_file, resolve_arm
from mistill.errors import MistillInputError

ISSUE_ARMS = {"vanilla-fp32", "vanilla-bf16", "feature-kd", "distillm2", "mistill", "randheads", "randpos",
              "randboth", "bottom40", "top8", "top100", "uniform", "no-window", "event-weighted-vanilla",
              "p1-only", "p2-only", "attention-only", "interaction-only", "write-term", "opd", "gold"}


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


# ------------------------------------------------------------------ names, paths and values
@pytest.mark.parametrize("name", ["../arms/mistill", str(ARMS_DIR / "mistill"), "mistill/../mistill",
                                  "../../etc/x", "/etc/passwd", "mi still", ""])
def test_arm_names_outside_the_arms_folder_are_refused(name):
    """A bare name is letters, digits, '-' and '_'; a path must be given as a .yaml/.yml file."""
    with pytest.raises(MistillInputError) as err:
        resolve_arm(name)
    assert err.value.field == "arm"
    assert "bare arm name" in str(err.value) and ".yaml" in str(err.value)


def test_a_relative_climb_to_a_yaml_outside_is_refused(tmp_path):
    (tmp_path / "outside.yaml").write_text("base: mistill\nlambda_p1: 0.5\n")
    climb = os.path.relpath(tmp_path / "outside", ARMS_DIR)  # ../../../<tmp>/outside
    with pytest.raises(MistillInputError) as err:
        resolve_arm(climb)
    assert err.value.field == "arm"


def test_an_explicit_arm_file_is_read_and_its_content_joins_the_run_identity(tmp_path):
    from mistill.stages.distill import TrainStageConfig
    from mistill.tracking.identity import identity_params

    path = tmp_path / "my-arm.yaml"
    path.write_text("description: Mistill at lambda 0.05\nbase: mistill\nlambda_p1: 0.05\n")
    assert resolve_arm(str(path)) == ArmConfig(lambda_p1=0.05)
    cfg = TrainStageConfig(arm=str(path))
    first = cfg.content_digests()
    assert first == {"arm": hashlib.sha256(path.read_bytes()).hexdigest()}
    assert identity_params(cfg)["arm_sha256"] == first["arm"]
    path.write_text("description: Mistill at lambda 0.06\nbase: mistill\nlambda_p1: 0.06\n")
    assert cfg.content_digests() != first  # edited in place: another run
    assert TrainStageConfig(arm="mistill").content_digests() == {}  # the code version covers it
    with pytest.raises(MistillInputError) as err:
        TrainStageConfig(arm=str(tmp_path / "missing.yml"))
    assert err.value.field == "arm"


def test_a_base_must_be_a_bare_name(tmp_path):
    path = tmp_path / "climbs.yaml"
    path.write_text("base: ../arms/mistill\nlambda_p1: 0.05\n")
    with pytest.raises(MistillInputError) as err:
        resolve_arm(str(path))
    assert err.value.field == "base"


@pytest.mark.parametrize("override", ["lambda_p1=-1", "lambda_p2=-0.1", "lambda_p1=nan", "lambda_p1=inf",
                                      "pool_k=0", "pool_seed=-1", "window=-1", "event_weight=-1",
                                      "kl_weight=-0.5", "min_abs_margin=-1", "attention_eps=0",
                                      "uld_alignment=nearest", "fkd_pairs=0", "fkd_positions=0",
                                      "fkd_layer_map=middle", "fkd_hidden_site=attention",
                                      "fkd_adapter=none", "fkd_rms_eps=-1"])
def test_invalid_flag_values_are_refused_naming_the_flag(override):
    with pytest.raises(MistillInputError) as err:
        resolve_arm("mistill", override)
    assert err.value.field == override.partition("=")[0]


def test_a_negative_lambda_in_an_arm_file_is_refused(tmp_path):
    path = tmp_path / "negative.yaml"
    path.write_text("base: mistill\nlambda_p2: -0.1\n")
    with pytest.raises(MistillInputError) as err:
        resolve_arm(str(path))
    assert err.value.field == "lambda_p2"
