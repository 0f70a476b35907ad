"""docs/DEVIATIONS.md against the registry and the configs it names."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from mistill import deviations
from mistill.deviations import (CONVENTIONS, DEVIATIONS, PAPER_SILENT, SET_BY_LOCK, Deviation,
                                config_classes, deviations_in, field_default, markdown)

DOC = Path(__file__).resolve().parents[1] / "docs" / "DEVIATIONS.md"
PARAMETER = re.compile(r"^`([A-Za-z]+)\.([a-z_0-9]+)`$")


def _doc_parameters() -> list[str]:
    """Every ``Class.field`` in the parameter column of the document's first table."""
    out = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 7 and PARAMETER.match(cells[3]):
            m = PARAMETER.match(cells[3])
            out.append(f"{m.group(1)}.{m.group(2)}")
    return out


def test_the_document_is_the_registry_rendered():
    assert DOC.read_text() == markdown(), "regenerate: python -m mistill.deviations > docs/DEVIATIONS.md"


def test_every_parameter_named_in_the_document_exists_in_a_config():
    named = _doc_parameters()
    assert len(named) == len(DEVIATIONS) > 0
    classes = config_classes()
    for parameter in named:
        cls_name, name = parameter.split(".", 1)
        assert cls_name in classes, f"{parameter}: no config class {cls_name}"
        assert name in {f.name for f in dataclasses.fields(classes[cls_name])}, f"{parameter}: no such field"


@pytest.mark.parametrize("d", DEVIATIONS, ids=lambda d: d.parameter)
def test_the_registry_default_is_the_code_default(d: Deviation):
    if d.default == SET_BY_LOCK:
        with pytest.raises(KeyError, match="no default"):
            field_default(d.parameter)
    else:
        assert deviations._same(field_default(d.parameter), d.default), d.parameter


def test_each_parameter_is_listed_once_and_every_row_says_why():
    params = [d.parameter for d in DEVIATIONS]
    assert len(params) == len(set(params))
    for d in (*DEVIATIONS, *CONVENTIONS):
        assert d.choice and d.section.startswith(("App.", "Sec.")) and d.platform and d.why


def _labelled_recon(cls: type, name: str) -> bool:
    """True iff the docstring of the class or of a dataclass it inherits (a parameter group of
    :mod:`mistill.params`, where a shared field is documented) says **[recon]** within 160
    characters after naming ``name``, or a comment in the 4 lines above the field's definition
    says it."""
    import inspect

    for klass in (k for k in cls.__mro__ if dataclasses.is_dataclass(k)):
        doc = inspect.cleandoc(vars(klass).get("__doc__") or "")
        for m in re.finditer(rf"\b{name}\b", doc):
            if "[recon]" in doc[m.start():m.end() + 160]:
                return True
        lines = inspect.getsource(klass).splitlines()
        for i, line in enumerate(lines):
            if re.match(rf"\s+{name}\s*:", line) and "[recon]" in "\n".join(lines[max(0, i - 4):i + 1]):
                return True
    return False


@pytest.mark.parametrize("d", [d for d in DEVIATIONS if d.recon], ids=lambda d: d.parameter)
def test_a_reconstruction_is_labelled_where_its_parameter_is_documented(d: Deviation):
    assert _labelled_recon(config_classes()[d.class_name], d.field), \
        f"{d.parameter}: the config's docstring does not label it **[recon]**"


def test_deviations_in_flags_non_default_and_against_paper_values():
    # the registry's own rows: min_abs_margin's default is the paper's 0; the opt-in guard is a finding
    assert deviations_in("ArmConfig", {"min_abs_margin": 0.0, "pool_k": 40}) == []
    guarded = deviations_in("ArmConfig", {"min_abs_margin": 0.5})
    assert [(f["parameter"], f["kind"], f["value"]) for f in guarded] == [("ArmConfig.min_abs_margin", "non_default", 0.5)]
    # a paper-stated value at its default is not a finding; another value is
    assert deviations_in("OwnHeadsConfig", {"n_random": 1}) == []
    assert [f["value"] for f in deviations_in("OwnHeadsConfig", {"n_random": 3})] == [3]
    # a [recon] value at its default is not a finding
    assert deviations_in("ArmConfig", {"uld_alignment": "char_offset"}) == []
    # another class's field of the same name is not read
    assert deviations_in("TrainStageConfig", {"min_abs_margin": 0.0}) == []
    # a choice scoped to some runs: the rollout engine concerns the on-policy arms only
    assert deviations_in("TrainStageConfig", {"arm": "mistill", "rollout_backend": "hf"}) == []
    gold = deviations_in("TrainStageConfig", {"arm": "gold", "rollout_backend": "hf"})
    assert [(f["parameter"], f["kind"], f["paper_value"]) for f in gold] == [
        ("TrainStageConfig.rollout_backend", "non_default", "vllm")]
    # a value resolved when the run starts: auto is checked as what it resolved to, when given
    auto = {"arm": "opd", "rollout_backend": "auto"}
    assert deviations_in("TrainStageConfig", auto) == []
    assert deviations_in("TrainStageConfig", auto, resolved={"rollout_backend": "vllm"}) == []
    assert deviations_in("TrainStageConfig", auto, resolved={"rollout_backend": "hf"}) == [
        {"parameter": "TrainStageConfig.rollout_backend", "value": "hf", "default": "auto", "paper_value": "vllm",
         "kind": "against_paper", "resolved_from": "auto"}]
    assert deviations_in("TrainStageConfig", {"arm": "opd", "rollout_backend": "vllm"},
                         resolved={"rollout_backend": "vllm"})[0]["kind"] == "non_default"
    # the GOLD arm's run settings are recorded as values other than the protocol's
    from mistill.distill.arms import resolve_arm

    found = {f["parameter"]: f["value"] for f in deviations_in("ArmConfig", resolve_arm("gold").to_dict())}
    assert {k: found[k] for k in ("ArmConfig.epochs", "ArmConfig.rollout_cap", "ArmConfig.on_policy_fraction",
                                  "ArmConfig.opd_beta")} == {"ArmConfig.epochs": 1, "ArmConfig.rollout_cap": 6144,
                                                             "ArmConfig.on_policy_fraction": 0.5,
                                                             "ArmConfig.opd_beta": 0.5}


def test_paper_silent_rows_are_exactly_the_reconstructions():
    for d in DEVIATIONS:
        assert d.recon == (d.paper_value == PAPER_SILENT)


def test_every_distillm2_run_carries_its_trainer_convention():
    """DistiLLM-2's trainer is written from the paper's equations, not the vendored one: each
    DistiLLM-2 train run records that among its deviations; other arms do not."""
    from mistill.deviations import arm_conventions
    from mistill.distill.arms import resolve_arm
    from mistill.stages.distill import TrainStageConfig, recorded_deviations

    found = recorded_deviations(TrainStageConfig(arm="distillm2"), resolve_arm("distillm2"))
    conventions = [f for f in found if f["kind"] == "convention"]
    assert conventions == [{"parameter": "mistill.distill.losses.distillm2_loss", "value": "distillm2",
                            "default": None, "paper_value": None, "kind": "convention"}]
    for arm in ("mistill", "vanilla-bf16", "opd", "gold", "feature-kd"):
        assert arm_conventions(resolve_arm(arm).to_dict()) == []
