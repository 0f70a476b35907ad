"""The stage command line: ``mistill <stage> ...`` and ``python projects/<stage>.py ...``.

Options, help and defaults come from each stage's config class; bad options and missing input
runs are refused before any run exists; an unreachable or missing tracking server is named.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mistill.stages.cli import console, field_meanings, main, param_text, parse_stage_args
from mistill.stages.registry import stage_help, stages
from mistill.tracking.server import TrackingServer, free_port, port_is_free
from stage_fixtures import REPO, TINY, now_ms, runs_started_since, subprocess_env, unique

STAGES = list(stage_help())
HEX_RUN = "0123456789abcdef0123456789abcdef"  # a well-formed run id no server holds


def _option_blocks(help_text: str) -> dict[str, str]:
    """``--name`` -> that option's help, whitespace collapsed (argparse wraps it)."""
    blocks: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        match = re.match(r"  (--\w+)", line)
        if match:
            current = match.group(1)
            blocks[current] = line
        elif current is not None and line.startswith("    "):
            blocks[current] += " " + line
        else:
            current = None
    return {k: " ".join(v.split()) for k, v in blocks.items()}


def _cli(args: list[str], env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**env, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "mistill.stages.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------- help
@pytest.mark.parametrize("name", STAGES)
def test_help_of_every_stage_exits_0_and_names_every_field_with_its_default(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main(name, ["--help"])
    assert exc.value.code == 0
    blocks = _option_blocks(capsys.readouterr().out)
    for f in dataclasses.fields(stages()[name].config):
        block = blocks.get(f"--{f.name}")
        assert block is not None, f"--{f.name} missing from the help of {name}"
        assert f"default: {param_text(f.default)}]" in block, block


def test_help_gives_each_field_its_meaning_from_the_docstring(capsys):
    assert console(["train", "--help"]) == 0
    train = _option_blocks(capsys.readouterr().out)
    # several names on one line, each with its own constraint
    assert train["--epochs"].startswith("--epochs INT the recipe (>= 1). [integer; default: 2]")
    assert "the recipe (in [0, 1])" in train["--warmup_frac"]
    assert "Required: the run id of a `targets` run" in train["--targets_run"]
    assert "Optional: the run id of an `attribute` run" in train["--student_attribute_run"]
    assert train["--student"].endswith("[string; default: embedded:smollm2-135m@every-other]")

    assert console(["evaluate", "-h"]) == 0
    evaluate = _option_blocks(capsys.readouterr().out)
    assert "the decoding (in (0, 1])" in evaluate["--top_p"]  # a half-open interval closes
    assert "a las_simulator run; empty leaves LAS out" in evaluate["--las_run"]
    assert "Optional: the run id of a `las_simulator` run" in evaluate["--las_run"]


def test_field_meanings_reads_each_form_of_the_docstrings():
    from mistill.stages.characterize import KnockinStageConfig
    from mistill.stages.own_heads import OwnHeadsConfig
    from mistill.stages.prepare import PrepareConfig
    from mistill.stages.shortlist import ShortlistConfig

    prepare = field_meanings(PrepareConfig)
    assert prepare["codes_file"] == "explicit code list restricting the inventory (one code per line)"
    assert "n_notes" not in prepare  # not described: the help falls back to type and default
    shortlist = field_meanings(ShortlistConfig)
    assert shortlist["batch_size"] == "encoder batch"  # after ``;``, in double backticks
    assert shortlist["rrf_k"] == shortlist["fusion"]  # one meaning shared by several names
    assert shortlist["device"].startswith("cpu, cuda, cuda:<n>, mps or auto")
    knockin = field_meanings(KnockinStageConfig)
    assert knockin["donor_wrap"].startswith("[recon] the last note's donor is the first note")  # after ``. ``
    assert field_meanings(OwnHeadsConfig)["necessity_k"].endswith("(>= 1)")  # ``a, b (>= 1):``


def test_mistill_help_lists_every_stage_with_its_help(capsys):
    assert console(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for name, text in stage_help().items():
        assert f"{name} {' '.join(text.split())}" in out, name
    assert console([]) == 2  # no stage: the same list, on stderr
    assert "select_lambda" in capsys.readouterr().err

    proc = _cli(["--help"], dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(name in proc.stdout for name in STAGES)
    proc = _cli(["prepare", "--help"], dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--n_notes INT" in proc.stdout and "default: 8]" in proc.stdout


def test_unknown_stage_names_the_closest(capsys):
    assert console(["prepar", "--n_notes", "4"]) == 2
    assert "unknown stage 'prepar'; the closest is 'prepare'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ values
def test_unknown_option_names_it_and_the_closest_known_one(monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    with pytest.raises(SystemExit) as exc:
        main("prepare", ["--n_notes", "2", "--n_notez", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--n_notez is not an option of prepare; the closest is --n_notes" in err, err
    assert "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        main("prepare", ["--n_notes"])
    assert exc.value.code == 2
    assert "--n_notes needs a value" in capsys.readouterr().err


def test_name_equals_value_and_dashes_read_like_name_value():
    stage = stages()["prepare"]
    given = parse_stage_args(stage, ["--n_notes=4", "--corpus_name", "ward-a", "--narrow-instruction=false",
                                     "--remove_discharge_diagnosis", "--select_split="])
    assert given == {"n_notes": "4", "corpus_name": "ward-a", "narrow_instruction": "false",
                     "remove_discharge_diagnosis": "true", "select_split": ""}
    cfg = stage.config.from_dict(given)
    assert (cfg.n_notes, cfg.narrow_instruction, cfg.remove_discharge_diagnosis) == (4, False, True)
    # as `mlflow run` passes a boolean
    assert parse_stage_args(stages()["train"], ["--register", "false", "--seed", "-1"]) == \
        {"register": "false", "seed": "-1"}


@pytest.mark.usefixtures("pinned_code_version")
def test_name_equals_value_round_trip_through_a_run(tracking_uri, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    name = unique("cli")
    assert console(["prepare", "--n_notes=2", f"--corpus_name={name}", f"--model={TINY}",
                    "--narrow_instruction=false"]) == 0
    run_id = re.search(r"mistill prepare: run (\w+)", capsys.readouterr().out).group(1)
    params = MlflowClient().get_run(run_id).data.params
    assert (params["n_notes"], params["corpus_name"], params["narrow_instruction"]) == ("2", name, "false")


# ---------------------------------------------------------------------------- failing early
@pytest.mark.parametrize("name,argv,message", [
    ("train", [], "targets_run is required: the run id of a `targets` run"),
    ("targets", [], "the targets need the teacher's attribute run of the training notes (teacher_attribute_run)"),
    ("evaluate", ["--model", TINY], "prepare_run is required: the run id of a `prepare` run "
                                    "(or of a `shortlist` or `generate` or `flip_cohort` run)"),
])
def test_missing_required_input_is_refused_before_any_run(name, argv, message, tracking_uri, tmp_path,
                                                          monkeypatch, capsys):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    since = now_ms()
    before = runs_started_since(since)
    with pytest.raises(SystemExit) as exc:
        main(name, argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "no run" not in err
    assert runs_started_since(since) == before


def test_optional_inputs_are_not_required():
    assert stages()["train"].required_inputs() == {"targets": "targets_run"}
    assert stages()["evaluate"].required_inputs() == {"prepare": "prepare_run"}
    assert stages()["own_heads"].required_inputs() == {"prepare": "prepare_run"}
    assert stages()["prepare"].required_inputs() == {}


def test_unreachable_server_is_named_with_exit_3(tmp_path, monkeypatch, capsys):
    port = free_port()
    assert port_is_free("127.0.0.1", port)
    uri = f"http://127.0.0.1:{port}"  # nothing listens there
    env = subprocess_env(uri, tmp_path / "root")
    env["MISTILL_SERVER_TIMEOUT_S"] = "2"
    proc = _cli(["train", "--targets_run", HEX_RUN], env)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"mistill train: tracking server {uri} unreachable" in proc.stderr
    assert "no run" not in proc.stderr and "Traceback" not in proc.stderr

    for key in ("MLFLOW_TRACKING_URI", "MISTILL_ROOT", "MISTILL_SERVER_TIMEOUT_S"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    assert console(["prepare", "--n_notes", "2", "--model", TINY]) == 3
    assert f"mistill prepare: tracking server {uri} unreachable" in capsys.readouterr().err


def test_without_a_tracking_uri_inputs_are_read_from_the_project_server(tmp_path):
    """No ``MLFLOW_TRACKING_URI``: the stage reads its input runs from the project's server
    under the mistill root (the one its own run would use), never from a store MLflow would
    create in the working directory."""
    from mlflow.tracking import MlflowClient

    root, cwd = tmp_path / "root", tmp_path / "cwd"
    cwd.mkdir()
    server = TrackingServer(root=root, port=0)
    uri = server.start()
    try:
        client = MlflowClient(tracking_uri=uri)
        experiment = client.create_experiment(unique("cli-input"))
        run_id = client.create_run(experiment).info.run_id
        client.set_terminated(run_id)  # a finished run that is no stage's run: found, then refused
        env = subprocess_env(uri, root)
        env.pop("MLFLOW_TRACKING_URI")
        env["MISTILL_SERVER_TIMEOUT_S"] = "20"
        proc = _cli(["train", "--targets_run", run_id], env, cwd=cwd)
    finally:
        server.stop()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"run {run_id} is not a stage's run" in proc.stderr, proc.stderr[-3000:]
    assert list(cwd.iterdir()) == []
