"""Trained checkpoints in the MLflow model registry, on a real server with tiny random models.

A plain ``train`` run's version gets the arm alias (``mistill-s0``), tags (arm, λ, seed,
precision, teacher, corpus digest) and a model card; its checkpoint is an MLflow Model that
``mlflow.pyfunc`` opens by ``models:/<name>@<alias>`` and the platform still loads by
``run:<id>``; every arm flag is a flat param. A λ selection's cells get cell aliases
(``mistill-l0p03-s1``), only its pick the arm alias; the study records the pick
(``locked_pick``) and is logged as artifacts."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import mlflow
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from stage_fixtures import artifact_paths, tiny_distill_inputs, unique

pytestmark = pytest.mark.usefixtures("pinned_code_version")

STUDENT = "tiny:qwen3:seed=2"
ALIAS = re.compile(r"^[\w\-]*$")  # MLflow's rule for alias names (letters, digits, '_', '-')


@pytest.fixture(scope="module")
def distill_inputs(tracking_uri: str, tmp_path_factory: pytest.TempPathFactory, pinned_code_version):
    """Characterization, the student's ranking and the teacher's targets on 3 synthetic notes."""
    return tiny_distill_inputs(tmp_path_factory.mktemp("registry-root"), "reg", STUDENT, teacher_split="")


def _train(inputs, arm: str, **kw) -> str:
    from mistill.stages.distill import TrainStageConfig, run_train

    ids = inputs["ids"]
    return run_train(TrainStageConfig(targets_run=ids["targets"], student_attribute_run=ids["student_attribute"],
                                      student=STUDENT, arm=arm, max_steps=1, grad_accum=1, **kw))


# ------------------------------------------------------------------------------ pure parts
def test_alias_spelling_is_allowed_by_mlflow():
    from mistill.tracking.models import arm_alias, cell_alias, lambda_alias

    assert arm_alias("mistill", 0) == "mistill-s0"
    assert cell_alias("mistill", 0.03, 0.03, 0) == "mistill-l0p03-s0"
    assert cell_alias("mistill", 0.03, 0.1, 2) == "mistill-l0p03-0p1-s2"
    assert lambda_alias(1e-05) == "1em05" and lambda_alias(1.0) == "1p0"
    assert arm_alias("configs/arms/my-arm.yaml", 1) == "my-arm-s1"
    for alias in ("mistill-l0p03-0p1-s2", cell_alias("mistill", 1e-05, 2.5e-07, 0)):
        assert ALIAS.match(alias) and alias.lower() != "latest" and not re.match(r"^[vV]\d+$", alias)


def test_selection_cell_role_is_set_inside_and_restored_after(monkeypatch):
    import threading

    from mistill.tracking.models import ENV_ROLE, ROLE_ARM, ROLE_CELL, selection_cells, train_role

    monkeypatch.delenv(ENV_ROLE, raising=False)
    assert train_role() == ROLE_ARM
    seen = []
    with selection_cells():
        threads = [threading.Thread(target=lambda: seen.append(train_role())) for _ in range(3)]
        with selection_cells():  # nested blocks (one per worker thread) keep the role
            pass
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert train_role() == ROLE_CELL
    assert seen == [ROLE_CELL] * 3 and train_role() == ROLE_ARM


# ------------------------------------------------------------------------ a plain train run
def test_plain_train_run_registers_an_mlflow_model_under_the_arm_alias(distill_inputs, monkeypatch, tmp_path):
    from mistill.stages.common import load_model
    from mistill.tracking.privacy import PrivacyGuard

    monkeypatch.setenv("MISTILL_ROOT", str(distill_inputs["root"]))
    run_id = _train(distill_inputs, "mistill")
    client = MlflowClient()
    run = client.get_run(run_id)
    name = run.data.tags["mistill.registered_model"]
    assert run.data.tags["mistill.model_alias"] == "mistill-s0"
    version = client.get_model_version_by_alias(name, "mistill-s0")
    assert version.run_id == run_id and version.source == f"runs:/{run_id}/model"
    assert version.aliases == ["mistill-s0"]

    # the version's tags and model card
    tags = version.tags
    prepared_digest = client.get_run(distill_inputs["ids"]["prepare"]).data.tags["mistill.corpus_digest"]
    assert {k: tags[k] for k in ("mistill.arm", "mistill.lambda_p1", "mistill.lambda_p2", "mistill.seed",
                                 "mistill.precision", "mistill.corpus_digest", "mistill.model_role")} == {
        "mistill.arm": "mistill", "mistill.lambda_p1": "0.1", "mistill.lambda_p2": "0.1", "mistill.seed": "0",
        "mistill.precision": "bf16", "mistill.corpus_digest": prepared_digest, "mistill.model_role": "arm"}
    assert tags["mistill.teacher"] == client.get_run(distill_inputs["ids"]["events"]).data.tags["mistill.model"]
    card = version.description
    for needle in (run_id, "λ_P1 = 0.1", "seed 0", distill_inputs["corpus"], prepared_digest,
                   f'models:/{name}@mistill-s0', f"run:{run_id}", "max_steps 1"):
        assert needle in card, needle

    # an MLflow Model: MLmodel, signature, input example, tokenizer; the UI's Models column
    arts = artifact_paths(client, run_id)
    assert {"model/MLmodel", "model/input_example.json", "model/model/config.json",
            "model/components/tokenizer/tokenizer.json", "model/model/tokenizer.json"} <= arts
    info = mlflow.models.get_model_info(f"models:/{name}@mistill-s0")
    assert info.flavors["transformers"]["task"] == "text-generation" and "python_function" in info.flavors
    assert info.signature.params.to_dict()[0]["name"] == "max_new_tokens"
    history = json.loads(run.data.tags["mlflow.log-model.history"])
    assert history[0]["artifact_path"] == "model" and "transformers" in history[0]["flavors"]

    # every file of it passes a restricted corpus's privacy guard (no unreadable binary type)
    local = distill_inputs["root"] / "work" / run_id / "model"
    PrivacyGuard(["The patient was admitted with chest pain and shortness of breath overnight."],
                 "restricted").check_dir(local)

    # pyfunc by alias generates; the platform loads the same weights by run:<id>, here and after
    # a download on a machine that did not train it (another MISTILL_ROOT)
    prompt = "Discharge summary:"
    pyfunc = mlflow.pyfunc.load_model(f"models:/{name}@mistill-s0")
    out = pyfunc.predict([prompt], params={"max_new_tokens": 3, "do_sample": False})
    assert isinstance(out[0], str) and out[0].startswith(prompt) and len(out[0]) > len(prompt)
    pipe = mlflow.transformers.load_model(f"models:/{name}@mistill-s0")
    here = load_model(f"run:{run_id}")
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "elsewhere"))
    there = load_model(f"run:{run_id}")
    ref = {k: v.float() for k, v in pipe.model.state_dict().items()}
    for lm in (here, there):
        state = lm.model.state_dict()
        assert set(state) == set(ref)
        assert all(torch.equal(state[k].float(), ref[k]) for k in ref)
    assert len(there.tokenizer) == len(here.tokenizer)


def test_arm_flags_are_flat_params_and_vanilla_logs_its_total_loss(distill_inputs, monkeypatch):
    from mistill.distill.arms import resolve_arm

    monkeypatch.setenv("MISTILL_ROOT", str(distill_inputs["root"]))
    mistill_id = _train(distill_inputs, "mistill")  # reused from the test above when run after it
    vanilla_id = _train(distill_inputs, "vanilla-bf16")
    client = MlflowClient()
    for run_id, arm in ((mistill_id, "mistill"), (vanilla_id, "vanilla-bf16")):
        run = client.get_run(run_id)
        flags = resolve_arm(arm).to_dict()
        params = {k[len("arm."):]: v for k, v in run.data.params.items() if k.startswith("arm.")}
        assert set(params) == set(flags)
        assert params["terms"] == "+".join(flags["terms"]) and params["pool_k"] == str(flags["pool_k"])
        assert float(params["lambda_p1"]) == flags["lambda_p1"] and params["precision"] == flags["precision"]
        m = run.data.metrics
        assert {"train/loss", "train/ce"} <= set(m)
    # the registered versions carry λ only where it applies (Mistill's terms)
    for run_id, has_lambda in ((mistill_id, True), (vanilla_id, False)):
        tags = client.get_run(run_id).data.tags
        version = client.get_model_version(tags["mistill.registered_model"], tags["mistill.model_version"])
        assert ("mistill.lambda_p1" in version.tags) is has_lambda
        assert ("mistill.lambda_p2" in version.tags) is has_lambda
    # Vanilla's total is ce + kl (kl_weight 1); each is a float32 average of one micro-step, so
    # they agree to float32 rounding of one addition (relative 2**-23 per term)
    v = client.get_run(vanilla_id).data.metrics
    assert v["train/loss"] == pytest.approx(v["train/ce"] + v["train/kl"], rel=4 * 2 ** -23, abs=1e-7)
    # searchable, and not part of the identity: an identical train run is reused
    exp = client.get_run(mistill_id).info.experiment_id
    found = client.search_runs([exp], filter_string="params.`arm.lambda_p1` = '0.1' and "
                                                    "params.`arm.objective` = 'mistill'")
    assert mistill_id in {r.info.run_id for r in found}
    assert _train(distill_inputs, "mistill") == mistill_id


# --------------------------------------------------------------------------- a λ selection
def test_selection_cells_get_cell_aliases_and_only_the_pick_the_arm_alias(distill_inputs, monkeypatch,
                                                                          tmp_path):
    import optuna

    from mistill.stages.select_lambda import SelectLambdaConfig, run_select_lambda
    from selection.cells import CellResult
    from selection.lock import load_lock
    from selection.runner import TrainEvaluateRunner

    monkeypatch.setenv("MISTILL_ROOT", str(distill_inputs["root"]))
    ids = distill_inputs["ids"]
    lock_path = tmp_path / "lock.yaml"
    lock_path.write_text(yaml.safe_dump({
        "study": unique("registry"), "arm": "mistill",
        "grid": {"tied": True, "scale": "log", "lambda": [0.03, 0.1, 0.3]},
        "training": {"seed": 1, "max_steps": 1, "grad_accum": 1},
        "selection": {"metric": "micro_f1", "split": "val", "tie_band": 0.004, "tie_break": "m1/P2C/p_pos"},
        "edge": {"extend": True, "max_extensions": 1, "outward": {"lambda": {"low": 0.01, "high": 1.0}}}}))
    # 0.1 scores highest (Optuna's best_trial) but 0.03 ties it inside the band and wins the
    # tie-break; on the edge, the outward 0.01 is trained last and loses: 0.03 is the pick
    table = {0.03: (0.200, 0.9), 0.1: (0.202, 0.5), 0.3: (0.150, 0.4), 0.01: (0.150, 0.95)}
    cells = TrainEvaluateRunner(lock=load_lock(lock_path), corpus_name=distill_inputs["corpus"],
                                prepare_run=ids["prepare"], targets_run=ids["targets"],
                                student_attribute_run=ids["student_attribute"], student=STUDENT, launch="inline")
    trained: dict[float, str] = {}

    def runner(run):
        train = cells.train_cell(run)
        trained[run.cell.lambdas[0]] = train
        metric, tie_break = table[run.cell.lambdas[0]]
        return CellResult(metric=metric, tie_break=tie_break, run_ids={"train": train})

    cfg = SelectLambdaConfig(lock=str(lock_path), prepare_run=ids["prepare"], targets_run=ids["targets"],
                             student_attribute_run=ids["student_attribute"], student=STUDENT, launch="inline")
    sel_id = run_select_lambda(cfg, runner=runner)
    assert sorted(trained) == [0.01, 0.03, 0.1, 0.3] and list(trained)[-1] == 0.01  # the outward cell last
    client = MlflowClient()
    sel = client.get_run(sel_id)
    assert sel.data.tags["mistill.selection.pick"] == "lambda=0.03"

    name = client.get_run(trained[0.03]).data.tags["mistill.registered_model"]
    for lam, train in trained.items():
        alias = f"mistill-l{repr(lam).replace('.', 'p')}-s1"
        version = client.get_model_version_by_alias(name, alias)
        assert version.run_id == train and version.tags["mistill.model_role"] == "selection-cell"
        assert version.tags["mistill.lambda_p1"] == repr(lam) == version.tags["mistill.lambda_p2"]
        assert set(version.aliases) == ({alias, "mistill-s1"} if lam == 0.03 else {alias}), lam
        assert client.get_run(train).data.params["arm.lambda_p1"] == repr(lam)
    pick = client.get_model_version_by_alias(name, "mistill-s1")
    assert pick.run_id == trained[0.03]
    assert sel.data.tags["mistill.selection.pick_model"] == f"models:/{name}/{pick.version}"

    # the study: best_trial is the highest metric, locked_pick the rule's pick
    storage = sel.data.tags["mistill.selection.storage"]
    study = optuna.load_study(study_name=sel.data.tags["mistill.selection.study"], storage=storage)
    assert study.best_trial.params == {"lambda": 0.1}
    locked = study.user_attrs["locked_pick"]
    assert locked["cell"] == "lambda=0.03" and locked["lambda_p1"] == 0.03 == locked["lambda_p2"]
    assert locked["select_lambda_run"] == sel_id and locked["train_run"] == trained[0.03]
    assert locked["rule"] == sel.data.tags["mistill.selection.rule"] and math.isclose(locked["value"], 0.200)

    # the study logged with the run: a SQLite copy Optuna (and optuna-dashboard) opens, and JSON
    assert {"optuna/study.db", "optuna/trials.json"} <= artifact_paths(client, sel_id)
    db = Path(client.download_artifacts(sel_id, "optuna/study.db", str(tmp_path / "dl")))
    copy = optuna.load_study(study_name=study.study_name, storage=f"sqlite:///{db}")
    assert copy.user_attrs["locked_pick"] == locked and len(copy.trials) == 4
    record = json.loads(Path(client.download_artifacts(sel_id, "optuna/trials.json", str(tmp_path / "dl2")))
                        .read_text())
    assert record["user_attrs"]["locked_pick"] == locked
    assert sorted(t["params"]["lambda"] for t in record["trials"]) == [0.01, 0.03, 0.1, 0.3]
