"""Every stage checks the runs, models and files its config names before its run is created.

Parametrized over the stage table (:mod:`mistill.stages.registry`), so a new stage, a new
``*_run`` field or a new model field is covered without a new test. The input runs here are
cheap runs made directly on the real tracking server, tagged with a stage and ended FINISHED:
a stage that refuses them must do so before it reads them or loads a model, and must leave the
server with exactly the runs it had.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from stage_fixtures import now_ms, runs_started_since

from mistill.errors import MistillInputError
from mistill.models.loading import check_model_present
from mistill.stages import cli
from mistill.stages.common import INPUT_RUN_STAGES, MODEL_RUN_STAGES, run_fields
from mistill.stages.registry import stages
from mistill.tracking.naming import TAG_STAGE

STAGES = stages()
RUN_FIELD_CASES = [(name, f) for name, s in STAGES.items() for f in run_fields(s.config)]
MODEL_CASES = [(name, f) for name, s in STAGES.items() for f in s.models]
FILE_CASES = [(name, f) for name, s in STAGES.items() for f in s.files]
EXPERIMENT = "preflight-inputs"
_EURLEX = {"task": "eurlex57k", "corpus": str(Path(__file__).parent), "concepts_file": __file__}
FILE_CONTEXT = {("prepare", "split_file"): {"corpus": "mimic:/absent/notes.csv"},
                ("flip_cohort", "ledger"): {"proposals": __file__},
                **{("prepare", f): _EURLEX for f in ("concepts_file", "hierarchy_file", "traces_file")}}
"""Values another field needs for a file field to apply (a split file is read for a MIMIC table only;
a ledger decides the proposals of a proposals file, here any file that exists; the EURLEX57K files
are read for that task, whose concept file is required)."""


def _ids(cases: list[tuple[str, str]]) -> list[str]:
    return [f"{stage}-{field}" for stage, field in cases]


@pytest.fixture()
def server(tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MlflowClient]:
    """The session's tracking server, a fresh mistill root, no run opened by ``mlflow run``."""
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    yield MlflowClient(tracking_uri)


@pytest.fixture()
def make_run(server: MlflowClient) -> Callable[..., str]:
    """A run carrying only a ``mistill.stage`` tag, ended with ``status``."""

    def make(stage: str | None, status: str = "FINISHED") -> str:
        experiment = server.get_experiment_by_name(EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment else server.create_experiment(EXPERIMENT)
        run = server.create_run(experiment_id, tags={TAG_STAGE: stage} if stage else {})
        if status != "RUNNING":
            server.set_terminated(run.info.run_id, status=status)
        return run.info.run_id

    return make


def _refused(client: MlflowClient, stage: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the stage's command line; assert it exits 2 and leaves no new run; its stderr line."""
    since = now_ms()  # a run the stage creates starts after this
    before = runs_started_since(since, client)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli.main(stage, argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == cli.EXIT_INPUT, err
    assert len(err.splitlines()) == 1, err
    assert runs_started_since(since, client) == before, f"{stage} left a run behind: {err}"
    return err


def _inputs(stage: str, make_run: Callable[..., str], *, only_required: bool = False,
            field: str = "") -> dict[str, str]:
    """A fitting FINISHED run for each run field of ``stage`` (only the required ones if asked; of
    fields that exclude each other, ``field`` or else the first)."""
    s = STAGES[stage]
    required = set(s.required_inputs().values())
    group = EXCLUSIVE.get(stage, ())
    kept = field if field in group else group[0] if group else ""
    values = {f: _value(f, make_run(INPUT_RUN_STAGES[f][0]), make_run) for f in run_fields(s.config)
              if (not only_required or f in required) and (f not in group or f == kept)}
    return {**values, **RUN_CONTEXT.get(stage, {})} if "mask_heads_run" in values else values


EXCLUSIVE = {"targets": ("teacher_attribute_run", "events_run")}
"""Run fields of which a stage takes one: the training notes' attribution, or their events with a
frozen ranking."""


RUN_CONTEXT = {"flip_test": {"mask": "target"}}
"""Values another field needs for a run field to apply (the ranking of a key mask's heads is read
for a masked run only)."""


def _value(field: str, run_id: str, make_run: Callable[..., str]) -> str:
    """``run_id`` as the value of ``field``; a list of runs (``*_runs``) gets a second, fitting run
    after it, since some take their runs in pairs (a report's compared and replicate runs)."""
    return f"{run_id},{make_run(INPUT_RUN_STAGES[field][0])}" if field.endswith("_runs") else run_id


def _argv(values: dict[str, str]) -> list[str]:
    return [arg for field, value in values.items() for arg in (f"--{field}", value)]


def test_every_run_field_has_its_stages() -> None:
    """The table names the accepted stages of every run field of every stage, and only stages
    that exist; a lineage input accepts the stage the registry names for it (or one standing
    for it)."""
    assert RUN_FIELD_CASES, "no stage has a run field"
    for stage, field in RUN_FIELD_CASES:
        assert field in INPUT_RUN_STAGES, f"{stage}.{field} is missing from INPUT_RUN_STAGES"
    assert set(INPUT_RUN_STAGES) <= {f for _, f in RUN_FIELD_CASES}, "INPUT_RUN_STAGES names a field no stage has"
    assert {s for accepted in INPUT_RUN_STAGES.values() for s in accepted} | set(MODEL_RUN_STAGES) <= set(STAGES)
    for s in STAGES.values():
        for lineage, field in s.inputs.items():
            source = s.input_stage(lineage)
            expected = {source} | {o.name for o in STAGES.values() if o.stands_for == source} | \
                set(s.also.get(lineage, ()))
            assert set(INPUT_RUN_STAGES[field]) == expected, (s.name, field)


def test_model_and_file_fields_exist() -> None:
    for stage, field in MODEL_CASES + FILE_CASES:
        assert field in {f.name for f in dataclasses.fields(STAGES[stage].config)}, (stage, field)


@pytest.mark.parametrize(("stage", "field"), RUN_FIELD_CASES, ids=_ids(RUN_FIELD_CASES))
def test_wrong_stage_run_is_refused(stage: str, field: str, server: MlflowClient, make_run: Callable[..., str],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    accepted = INPUT_RUN_STAGES[field]
    wrong = "prepare" if "prepare" not in accepted else "report"
    values = _inputs(stage, make_run, field=field)
    wrong_run = make_run(wrong)
    values[field] = _value(field, wrong_run, make_run)
    err = _refused(server, stage, _argv(values), capsys)
    names = [f"`{s}`" for s in accepted]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    article = "an" if accepted[0][0] in "aeiou" else "a"
    assert f"run {wrong_run} is a `{wrong}` run; --{field} needs {article} {listed} run" in err


@pytest.mark.parametrize("case", ["unknown", "running", "failed", "untagged", "deleted"])
def test_unusable_run_is_refused(case: str, server: MlflowClient, make_run: Callable[..., str],
                                 capsys: pytest.CaptureFixture[str]) -> None:
    if case == "unknown":
        run_id = "0" * 32
    elif case == "untagged":
        run_id = make_run(None)
    else:
        run_id = make_run("targets", status={"running": "RUNNING", "failed": "FAILED"}.get(case, "FINISHED"))
        if case == "deleted":
            server.delete_run(run_id)
    err = _refused(server, "train", ["--targets_run", run_id], capsys)
    assert run_id in err and "--targets_run needs a `targets` run" in err
    assert {"unknown": "no run", "running": "RUNNING, not FINISHED", "failed": "FAILED, not FINISHED",
            "untagged": "no mistill.stage tag", "deleted": "is deleted"}[case] in err


@pytest.mark.parametrize(("stage", "field"), MODEL_CASES, ids=_ids(MODEL_CASES))
def test_missing_model_leaves_no_run(stage: str, field: str, server: MlflowClient, make_run: Callable[..., str],
                                     tmp_path_factory: pytest.TempPathFactory,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path_factory.mktemp("mdl") / "absent"
    values = {**_inputs(stage, make_run, only_required=True), field: str(missing)}
    err = _refused(server, stage, _argv(values), capsys)
    assert f"no model at {missing}" in err and f"field '{field}'" in err


CHECKPOINT_CASES = [(stage, field) for stage, field in MODEL_CASES if stage != "shortlist"]
"""The model fields that may name a train run's checkpoint (``run:<id>``): all but the
shortlist's encoder, a sentence-embedding model."""


@pytest.mark.parametrize(("stage", "field"), CHECKPOINT_CASES, ids=_ids(CHECKPOINT_CASES))
def test_model_run_of_wrong_stage_is_refused(stage: str, field: str, server: MlflowClient,
                                             make_run: Callable[..., str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    wrong = make_run("prepare")
    values = {**_inputs(stage, make_run, only_required=True), field: f"run:{wrong}"}
    err = _refused(server, stage, _argv(values), capsys)
    assert f"run {wrong} is a `prepare` run; --{field} needs a `train` run" in err


@pytest.mark.parametrize(("stage", "field"), FILE_CASES, ids=_ids(FILE_CASES))
def test_missing_file_leaves_no_run(stage: str, field: str, server: MlflowClient, make_run: Callable[..., str],
                                    tmp_path_factory: pytest.TempPathFactory,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path_factory.mktemp("file") / "absent.yaml"
    values = {**_inputs(stage, make_run, only_required=True), **FILE_CONTEXT.get((stage, field), {}),
              field: str(missing)}
    err = _refused(server, stage, _argv(values), capsys)
    assert f"no file {missing}" in err and f"field '{field}'" in err


def test_model_present(tmp_path: Path) -> None:
    """A directory with config.json passes; without it, or a hub id not cached, is refused; a
    ``tiny:`` model and the embedded one need nothing more."""
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(MistillInputError, match="expected config.json"):
        check_model_present(str(model), "model")
    (model / "config.json").write_text("{}")
    check_model_present(str(model), "model")
    check_model_present(f"{model}@every-other", "model")
    check_model_present("tiny:qwen3:layers=2", "model")
    check_model_present("embedded:smollm2-135m@every-other", "student")
    with pytest.raises(MistillInputError, match="local HF cache"):
        check_model_present("no-such-org/no-such-model", "model")
    with pytest.raises(MistillInputError, match="unknown embedded model"):
        check_model_present("embedded:nothing", "model")
