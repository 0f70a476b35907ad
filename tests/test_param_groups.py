"""Parameter groups (mistill.params): each shared stage field is defined once.

A field several stages expose (the event, attribution, knock-in, decoding and recipe settings)
has one type, one default, one help line and one validation, in its group; every stage config
that exposes it inherits it. The stages' params (names, types, defaults: part of every run's
identity and of users' ``-P`` flags) are pinned against ``tests/stage_params.json``.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

import pytest
import yaml

import mistill.params as groups_module
from mistill.config import Config, ParamGroup, group_fields, param_fields, param_groups
from mistill.distill.trainer import RecipeConfig
from mistill.errors import MistillInputError
from mistill.evaluation.generation import DecodingConfig
from mistill.instrument.passes import AttributionConfig, KnockinConfig
from mistill.params import KnockinReadParams, NullParams
from mistill.stages.cli import field_meanings, stage_parser
from mistill.stages.mlproject import _default, render
from mistill.stages.registry import Stage, stages
from mistill.stages.workflow import DEMO_DEFAULTS, CharacterizeConfig, PipelineConfig
from stage_fixtures import REPO

SNAPSHOT = REPO / "tests" / "stage_params.json"

GROUPS = [g for g in vars(groups_module).values()
          if isinstance(g, type) and issubclass(g, ParamGroup) and g is not ParamGroup]

OWN_MEANING = {("shortlist", "batch_size"), ("generate", "batch_size"), ("targets", "top_k"),
               ("shortlist", "lr"), ("shortlist", "epochs"), ("las_simulator", "lr"),
               ("las_simulator", "max_steps"), ("key_block", "max_events")}
"""Stage fields that share a group field's name but not its meaning (the encoder's batch, the
targets' kept entries, the logistic head's and the LAS simulator's training, key blocking's
events of every phase, all by default): their own."""

BAD = {"n_null": -1, "null_min_distance": -1, "p2c_cap": 3, "chunk_size": 0, "batch_size": 0,
       "stability_splits": 0, "selftest_events": -1, "selftest_notes": -1, "pool_k": 0, "range_gate": -0.5,
       "events_per_phase": -1, "floor_draws": 0, "k_bins": (0, 8), "donor_no_match": "nowhere", "max_new_tokens": 0,
       "backend": "tgi", "temperature": 0.0, "top_p": 0.0, "top_k": -1, "epochs": 0, "lr": 0.0,
       "warmup_frac": 1.5, "grad_accum": 0, "clip": 0.0, "max_steps": -1, "top_nominees": -1,
       "global_nominees": -1, "p2_top_nominees": -1, "p2_global_nominees": -1, "p2c_top_nominees": -1,
       "p2c_global_nominees": -1, "cpu_bf16_matmul": "fast", "sharding": "zero3", "checkpoint_every": -1, "max_events": -1, "max_tries": 0,
       "probe_every": -1, "probe_notes": 0, "probe_split": "no such split!", "probe_max_new_tokens": 0,
       "probe_flag_share": 0.0, "probe_backend": "tgi"}
"""One invalid value of every group field that has invalid values (booleans have none)."""


def _group_of(name: str) -> type[ParamGroup]:
    (group,) = [g for g in GROUPS if name in group_fields(g)]
    return group


def _group_field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(_group_of(name)) if f.name == name)


def _type_name(t: Any) -> str:
    return t.__name__ if isinstance(t, type) else str(t)


def _stage_params(config: type[Config]) -> dict[str, list]:
    hints = typing.get_type_hints(config)
    return {f.name: [_type_name(hints[f.name]), list(f.default) if isinstance(f.default, tuple) else f.default]
            for f in dataclasses.fields(config)}


def _configs() -> list[type[Config]]:
    return [s.config for s in stages().values()] + [RecipeConfig]


# ------------------------------------------------------------------------- (a) one definition
def test_every_group_field_is_declared_by_exactly_one_group():
    declared = [name for g in GROUPS for name in group_fields(g)]
    assert len(declared) == len(set(declared)), declared
    assert {"n_null", "null_min_distance", "p2c_cap", "chunk_size", "exact_p2", "stability_splits",
            "selftest_events", "pool_k", "range_gate", "events_per_phase", "k_bins", "donor_wrap",
            "donor_no_match", "backend", "temperature", "top_p", "top_k", "max_new_tokens", "epochs", "lr",
            "warmup_frac", "grad_accum", "clip", "max_steps", "gradient_checkpointing", "tf32"} <= set(declared)


def test_no_stage_declares_a_group_field_itself():
    """A stage exposing a group field takes it from the group (type and default, unless named in
    the class's ``defaults``), never from a declaration of its own."""
    declared = {name for g in GROUPS for name in group_fields(g)}
    for stage in stages().values():
        cls = stage.config
        taken = {name for g in param_groups(cls) for name in group_fields(g)}
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in declared or (stage.name, f.name) in OWN_MEANING:
                continue
            assert f.name in taken, f"{stage.name}.{f.name} re-declares a field of {_group_of(f.name).__name__}"
            own = vars(cls).get("__annotations__", {})
            assert f.name not in own or f.name in cls.group_defaults, f"{stage.name}.{f.name} declared by hand"
            group_field = _group_field(f.name)
            assert hints[f.name] == typing.get_type_hints(_group_of(f.name))[f.name], f"{stage.name}.{f.name}"
            expected = cls.group_defaults.get(f.name, group_field.default)
            assert f.default == expected, f"{stage.name}.{f.name}"


def test_the_fields_named_own_are_not_group_fields_of_their_stage():
    by_name = stages()
    for name, field in OWN_MEANING:
        cls = by_name[name].config
        assert field in {f.name for f in dataclasses.fields(cls)}
        assert field not in {n for g in param_groups(cls) for n in group_fields(g)}


def test_the_pipelines_demo_defaults_are_named_in_one_place():
    assert dict(PipelineConfig.group_defaults) == dict(DEMO_DEFAULTS) == {
        "n_null": 10, "selftest_events": 1, "k_bins": (3, 8, 16, 40), "events_per_phase": 5,
        "stability_splits": 50, "top_nominees": 8, "global_nominees": 4, "p2_top_nominees": 6,
        "p2_global_nominees": 2, "p2c_top_nominees": 8, "p2c_global_nominees": 4}
    for name, value in DEMO_DEFAULTS.items():
        assert _group_field(name).default != value  # an override, not a copy
    assert all(not s.config.group_defaults for s in stages().values() if s.name != "pipeline")


def test_each_group_field_has_one_help_line_and_every_stage_shows_it():
    for g in GROUPS:
        meanings = field_meanings(g)
        for name in group_fields(g):
            assert meanings.get(name), f"{g.__name__}.{name} has no help"
    for stage in stages().values():
        meanings = field_meanings(stage.config)
        for g in param_groups(stage.config):
            for name in group_fields(g):
                assert meanings[name] == field_meanings(g)[name], f"{stage.name}.{name}"


def test_recon_labels_of_shared_fields_reach_every_stage_help():
    for stage in ("knockin", "own_heads"):
        meanings = field_meanings(stages()[stage].config)
        assert meanings["donor_wrap"].startswith("[recon] the last note's donor is the first note")
        assert meanings["donor_no_match"].startswith("[recon]")
    assert field_meanings(stages()["train"].config)["tf32"].startswith("[recon]")


@pytest.mark.parametrize("cls", _configs(), ids=lambda c: c.__name__)
def test_each_group_validation_runs_in_every_config_taking_the_group(cls):
    taken = [name for g in param_groups(cls) for name in group_fields(g)]
    for name in taken:
        if name not in BAD:
            assert typing.get_type_hints(cls)[name] is bool, f"{name}: give it an invalid value in BAD"
            continue
        with pytest.raises(MistillInputError) as err:
            cls(**{name: BAD[name]})
        assert err.value.field == name, (cls.__name__, name, str(err.value))
        with pytest.raises(MistillInputError) as err:  # the command line's way in
            cls.from_dict({name: _default(BAD[name])})
        assert err.value.field == name


def test_nested_option_objects_share_the_groups_defaults():
    """The pass-level configs a stage builds keep the defaults of the groups it exposes."""
    checks = {DecodingConfig: ("temperature", "top_p", "top_k", "max_new_tokens"),
              KnockinConfig: ("k_bins", "range_gate", "batch_size", "chunk_size"),
              AttributionConfig: ("batch_size", "chunk_size", "selftest_events")}
    for cls, names in checks.items():
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for name in names:
            assert defaults[name] == _group_field(name).default, f"{cls.__name__}.{name}"


# ----------------------------------------------------------------------- building nested configs
def test_nested_configs_are_built_from_the_groups():
    from mistill.stages.distill import TrainStageConfig
    from mistill.stages.evaluate import EvaluateConfig
    from mistill.stages.generate import GenerateConfig

    train = TrainStageConfig(seed=4, epochs=3, lr=2e-5, warmup_frac=0.1, grad_accum=2, clip=0.5, max_steps=7,
                             gradient_checkpointing=False, tf32=False)
    assert train.recipe("fp32") == RecipeConfig(seed=4, precision="fp32", epochs=3, lr=2e-5, warmup_frac=0.1,
                                                grad_accum=2, clip=0.5, max_steps=7,
                                                gradient_checkpointing=False, tf32=False)
    for cls in (GenerateConfig, EvaluateConfig):
        cfg = cls(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=64, seed=3)
        assert cfg.decoding() == DecodingConfig(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=64, seed=3)
    events = stages()["events"].config(n_null=3, null_min_distance=4, p2c_cap=1)
    assert events.extraction() == {"n_null": 3, "null_min_distance": 4, "p2c_cap": 1}


def test_workflows_pass_every_shared_group_field_on():
    cfg = CharacterizeConfig(n_null=3, selftest_events=2, selftest_notes=1, exact_p2=False, k_bins=(4, 9),
                             range_gate=0.5, events_per_phase=6, stability_splits=7, seed=1, rank_split="val")
    ev, att, kin = cfg.events_config(), cfg.attribute_config(), cfg.knockin_config()
    assert (ev.n_null, ev.seed) == (3, 1)
    assert (att.selftest_events, att.selftest_notes, att.exact_p2, att.stability_splits, att.split) == \
        (2, 1, False, 7, "val")
    assert (kin.k_bins, kin.range_gate, kin.events_per_phase) == ((4, 9), 0.5, 6)
    # what the step does not expose stays at the step's default
    assert (ev.null_min_distance, ev.chunk_size, att.pool_k, kin.donor_wrap) == (8, 8192, 40, True)
    demo = PipelineConfig().characterize_config()
    assert {k: getattr(demo, k) for k in DEMO_DEFAULTS} == dict(DEMO_DEFAULTS)
    assert PipelineConfig().shared_params(CharacterizeConfig) == {
        f.name: getattr(PipelineConfig(), f.name) for f in dataclasses.fields(CharacterizeConfig)
        if f.name in {n for g in param_groups(CharacterizeConfig) for n in group_fields(g)}}


# --------------------------------------------------------------- (b) a field added to a group
@dataclasses.dataclass(frozen=True)
class _Widened(KnockinReadParams):
    """A group as a maintainer would extend it.

    probe_width (>= 2): a field added to the group.
    """

    probe_width: int = 5

    def validate_group(self) -> None:
        if self.probe_width < 2:
            raise MistillInputError(f"probe_width must be >= 2, got {self.probe_width}", field="probe_width")


@dataclasses.dataclass(frozen=True)
class _Ranker(Config, _Widened, NullParams):
    """A throwaway stage taking the widened group.

    run_name: its own field.
    """

    run_name: str = ""


@dataclasses.dataclass(frozen=True)
class _Reader(Config, _Widened, defaults={"probe_width": 9}):
    """A throwaway step of it, with its own default for the new field."""

    seed: int = 0


def test_a_field_added_to_a_group_reaches_every_config_taking_it():
    for cls, default in ((_Ranker, 5), (_Reader, 9)):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert {"probe_width", "range_gate", "events_per_phase"} <= set(fields)
        assert fields["probe_width"].default == default
        assert typing.get_type_hints(cls)["probe_width"] is int
        with pytest.raises(MistillInputError) as err:  # the group's validation
            cls(probe_width=1)
        assert err.value.field == "probe_width"
        with pytest.raises(MistillInputError) as err:  # the base group's too
            cls(range_gate=-1.0)
        assert err.value.field == "range_gate"
        assert cls.from_dict({"probe_width": "4"}).probe_width == 4
        assert field_meanings(cls)["probe_width"] == "a field added to the group (>= 2)"
        # the command line: an option with the group's help, after the config's own fields
        stage = Stage("probe", cls, lambda cfg: "", {}, "a throwaway stage")
        assert "--probe_width" in stage_parser(stage).format_help()
        assert "a field added to the group (>= 2)" in " ".join(stage_parser(stage).format_help().split())
    assert [f.name for f in param_fields(_Ranker)][:1] == ["run_name"]
    # a workflow passes it on to a step taking the same group, and nothing else
    assert _Ranker(probe_width=3, range_gate=0.25, n_null=2).shared_params(_Reader) == {
        "range_gate": 0.25, "events_per_phase": 0, "floor_draws": 5, "probe_width": 3}


def test_defaults_must_name_a_field_of_a_group_the_class_takes():
    with pytest.raises(TypeError, match="none of its parameter groups"):
        class _Wrong(Config, NullParams, defaults={"probe_width": 3}):
            pass
    with pytest.raises(TypeError, match="declared in the class"):
        class _Twice(Config, NullParams, defaults={"n_null": 3}):
            n_null: int = 4


# ------------------------------------------------------------------------ (c) pinned params
def test_stage_params_match_the_pinned_snapshot():
    """Names, types and defaults of every stage's params (run identity and users' ``-P`` flags)."""
    pinned = json.loads(SNAPSHOT.read_text())
    current = {s.name: _stage_params(s.config) for s in stages().values()}
    assert sorted(current) == sorted(pinned)
    for name in pinned:
        assert current[name] == pinned[name], name


def test_the_command_line_and_mlproject_list_the_same_fields():
    for stage in stages().values():
        assert sorted(f.name for f in param_fields(stage.config)) == sorted(
            f.name for f in dataclasses.fields(stage.config))


# ------------------------------------------------------------------------------ (d) MLproject
def test_mlproject_is_current_and_publishes_every_param_with_its_default():
    text = (REPO / "MLproject").read_text()
    assert text == render(), "MLproject is stale: regenerate it with `python -m mistill.stages.mlproject`"
    entry_points = yaml.safe_load(text)["entry_points"]
    for stage in stages().values():
        params = entry_points[stage.name]["parameters"]
        fields = dataclasses.fields(stage.config)
        launch = {"launcher", "nproc"} if stage.shardable else set()  # how many processes, not the config
        assert set(params) == {f.name for f in fields} | launch, stage.name
        if stage.shardable:
            assert params["launcher"] == {"type": "string", "default": "none"}
            assert params["nproc"] == {"type": "float", "default": 1}
            assert "--launcher {launcher} --nproc {nproc}" in entry_points[stage.name]["command"]
        required = set(stage.required_inputs().values())
        for f in fields:
            if f.name in required:
                assert params[f.name] == "string"
            else:
                assert str(params[f.name]["default"]) == _default(f.default), (stage.name, f.name)
