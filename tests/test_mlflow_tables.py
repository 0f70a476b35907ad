"""What MLflow itself understands of the readouts, on the real MLflow server: the per-note tables
of ``evaluate`` and ``own_heads`` read back by ``load_table``, the checkpoint a readout scored as
its model input (a logged model of the ``train`` run), the ``arm.*`` params that line the arms up
(λ only for a Mistill-objective arm), the restricted-corpus canary for the tables, and the logged
model's serving default.

The ``train`` runs here are cheap stand-ins: a FINISHED run of stage ``train`` with the tags,
``arm.json`` and ``arm.<flag>`` params a real one logs, and the tiny model saved as its local
checkpoint; the readouts run for real on it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.data.corpus import Corpus
from mistill.data.synthetic import make_synthetic_corpus
from mistill.distill.arms import resolve_arm
from mistill.errors import MistillInputError
from mistill.models.loading import load_model
from mistill.stages.common import ARM_PARAM_NAMES, mistill_root
from mistill.stages.distill import _log_arm_params
from mistill.stages.evaluate import PREDICTION_COLUMNS, EvaluateConfig, run_evaluate
from mistill.stages.own_heads import OwnHeadsConfig, run_own_heads
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.tracking import models as reg
from mistill.tracking.privacy import PrivacyError, PrivacyGuard
from mistill.tracking.runs import StageRun
from stage_fixtures import TINY, artifact_paths, leaks, phrase_needles, tracked_texts, unique

pytestmark = pytest.mark.usefixtures("pinned_code_version")


@dataclasses.dataclass(frozen=True)
class StandInTrainConfig(Config):
    """The identity of a stand-in ``train`` run."""

    arm: str = ""
    seed: int = 0


def stand_in_train_run(corpus: str, arm_name: str, seed: int) -> str:
    """A FINISHED ``train`` run of ``arm_name`` whose checkpoint is the tiny model (local)."""
    arm = resolve_arm(arm_name)
    lam = (arm.lambda_p1, arm.lambda_p2) if arm.objective == "mistill" else None
    with StageRun("train", StandInTrainConfig(arm=arm_name, seed=seed), corpus=corpus,
                  guard=PrivacyGuard([], "synthetic"), model=TINY, arm=arm_name, seed=seed,
                  precision=arm.precision, lam=lam, root=mistill_root()) as run:
        run.log_json("arm.json", arm.to_dict())
        _log_arm_params(run, arm)
        lm = load_model(TINY)
        lm.model.save_pretrained(run.work_dir / reg.MODEL_ARTIFACT)
        lm.tokenizer.save_pretrained(run.work_dir / reg.MODEL_ARTIFACT)
        return run.run_id


@pytest.fixture(scope="module")
def arms(tracking_uri: str, pinned_code_version: str, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("mlflow-tables") / "root"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MISTILL_ROOT", str(root))
        mp.setenv("TQDM_DISABLE", "1")
        name = unique("tables")
        prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=8, model=TINY))
        train = {arm: stand_in_train_run(name, arm, seed) for arm, seed in (("mistill", 0), ("vanilla-bf16", 1))}
        yield {"prepare": prep, "train": train, "root": root, "corpus": name}


def _table(client: MlflowClient, run_id: str, artifact: str) -> pd.DataFrame:
    return client.load_table(client.get_run(run_id).info.experiment_id, artifact, run_ids=[run_id])


def _check_arm_params(client: MlflowClient, run_id: str, train: str, arm_name: str) -> None:
    params = client.get_run(run_id).data.params
    train_params = client.get_run(train).data.params
    assert params["arm.name"] == arm_name and params["arm.seed"] == train_params["seed"]
    assert params["arm.precision"] == train_params["arm.precision"]
    if resolve_arm(arm_name).objective == "mistill":
        assert params["arm.lambda_p1"] == train_params["arm.lambda_p1"] == "0.1"
        assert params["arm.lambda_p2"] == train_params["arm.lambda_p2"]
    else:  # no λ for an arm whose objective has none
        assert "arm.lambda_p1" not in params and "arm.lambda_p2" not in params
    assert set(ARM_PARAM_NAMES) >= {k for k in params if k.startswith("arm.")}


def _check_model_input(client: MlflowClient, run_id: str, train: str) -> str:
    inputs = client.get_run(run_id).inputs.model_inputs
    assert len(inputs) == 1
    model = client.get_logged_model(inputs[0].model_id)
    assert model.source_run_id == train and model.tags[reg.TAG_TRAIN_RUN] == train
    assert model.tags[reg.TAG_MODEL_URI] == f"runs:/{train}/model"
    assert model.model_id in {m.model_id for m in client.get_run(train).outputs.model_outputs}
    return model.model_id


def test_evaluate_logs_tables_the_model_input_and_arm_params(arms, monkeypatch, tmp_path):
    monkeypatch.setenv("MISTILL_ROOT", str(arms["root"]))
    client = MlflowClient()
    models = {}
    for arm_name, train in arms["train"].items():
        cfg = EvaluateConfig(prepare_run=arms["prepare"], train_run=train, split="test", max_notes=2,
                             max_new_tokens=6, fidelity=False)
        run_id = run_evaluate(cfg)
        preds = _table(client, run_id, "predictions.json")
        jsonl = [json.loads(line) for line in
                 Path(client.download_artifacts(run_id, "predictions.jsonl", str(tmp_path / run_id))).read_text()
                 .splitlines()]
        assert list(preds.columns) == list(PREDICTION_COLUMNS) and len(preds) == 2
        assert [str(n) for n in preds["note_id"]] == [p["note_id"] for p in jsonl]
        assert list(preds["seed"]) == [p["seed"] for p in jsonl] and list(preds["codes"]) == [p["codes"] for p in jsonl]
        per_note = _table(client, run_id, "per_note_metrics.json")
        assert {"note_id", "micro_f1", "tp", "fp", "fn"} <= set(per_note.columns) and len(per_note) == 2
        listed = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
        assert {"path": "predictions.json", "type": "table"} in listed
        assert {"per_note_metrics.csv", "predictions.jsonl"} <= artifact_paths(client, run_id)  # kept
        models[arm_name] = _check_model_input(client, run_id, train)
        _check_arm_params(client, run_id, train, arm_name)
        # the config's arm is empty; the run shows the checkpoint's, and config.json keeps the config
        assert client.get_run(run_id).data.params["arm"] == arm_name
        given = json.loads(Path(client.download_artifacts(run_id, "config.json", str(tmp_path / "cfg" / run_id)))
                           .read_text())
        assert given["config"]["arm"] == ""
        # the new params leave the run's identity alone: an identical call reuses it
        assert run_evaluate(cfg) == run_id
        # a second readout of the same checkpoint links the same logged model
        other = run_evaluate(dataclasses.replace(cfg, max_notes=1))
        assert other != run_id and _check_model_input(client, other, train) == models[arm_name]
    assert models["mistill"] != models["vanilla-bf16"]


def test_evaluate_of_a_plain_model_names_its_arm_only(arms, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(arms["root"]))
    client = MlflowClient()
    run_id = run_evaluate(EvaluateConfig(prepare_run=arms["prepare"], model=TINY, arm="untrained", split="test",
                                         max_notes=1, max_new_tokens=4, fidelity=False))
    run = client.get_run(run_id)
    assert {k: v for k, v in run.data.params.items() if k.startswith("arm.")} == {"arm.name": "untrained"}
    assert not run.inputs.model_inputs
    assert len(_table(client, run_id, "predictions.json")) == 1


@pytest.mark.parametrize("arm_name", ["mistill", "vanilla-bf16"])
def test_own_heads_logs_tables_the_model_input_and_arm_params(arms, monkeypatch, arm_name):
    monkeypatch.setenv("MISTILL_ROOT", str(arms["root"]))
    client = MlflowClient()
    train = arms["train"][arm_name]
    run_id = run_own_heads(OwnHeadsConfig(prepare_run=arms["prepare"], train_run=train, k=(2,), necessity_k=2,
                                          m2_k=2, events_per_phase=2, n_null=4, stability_splits=5, max_notes=1,
                                          own_traces=False, launch="inline"))
    table = _table(client, run_id, "own_heads_per_note.json")
    csv = pd.read_csv(client.download_artifacts(run_id, "own_heads_per_note.csv", str(arms["root"] / run_id)))
    assert list(table.columns) == list(csv.columns) and len(table) == len(csv) > 0
    assert set(table["traces"]) == {"teacher"}
    _check_model_input(client, run_id, train)
    _check_arm_params(client, run_id, train, arm_name)


def test_restricted_tables_hold_no_note_text(tracking_uri, tmp_path, monkeypatch):
    """Canary: a model that writes the note back into its answer, on a restricted corpus. The
    evaluate run's MLflow tables (and everything else it logged) hold ids, codes and numbers,
    none of the note's words; a table with a text column is refused before anything is logged."""
    import mistill.stages.evaluate as ev

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    syn = make_synthetic_corpus(n_notes=2, seed=0)
    path = Corpus(name="shaped", privacy="restricted", notes=syn.notes,
                  inventory=syn.inventory).to_jsonl(tmp_path / "restricted.jsonl")
    codes = tmp_path / "codes.txt"
    codes.write_text("\n".join(syn.inventory.codes) + "\n")
    name = unique("tables-restricted")
    prep = run_prepare(PrepareConfig(corpus=str(path), corpus_name=name, privacy="restricted",
                                     codes_file=str(codes), model=TINY))
    texts = {n.note_id: n.text for n in syn.notes}
    real = ev.sample_then_load

    def parroting(requests, *args, **kwargs):
        samples, lm = real(requests, *args, **kwargs)
        return {k: dataclasses.replace(g, text=f"<think>{texts[k]}</think>{texts[k]}") for k, g in samples.items()}, lm
    monkeypatch.setattr(ev, "sample_then_load", parroting)
    run_id = run_evaluate(EvaluateConfig(prepare_run=prep, model=TINY, arm="untrained", split="",
                                         max_new_tokens=4, fidelity=False))
    client = MlflowClient()
    preds = _table(client, run_id, "predictions.json")
    assert sorted(map(str, preds["note_id"])) == sorted(texts) and list(preds.columns) == list(PREDICTION_COLUMNS)
    needles = [n for text in texts.values() for n in phrase_needles(text, 6)]
    places = [p for p in tracked_texts(client, f"mistill/{name}", tmp_path / "dl", stages=["evaluate"])]
    assert any("predictions.json" in where for where, _ in places)
    assert leaks(places, needles) == []

    with StageRun("evaluate", StandInTrainConfig(), corpus=name, guard=PrivacyGuard(texts.values(), "restricted"),
                  root=tmp_path / "root") as run:
        note_id, text = next(iter(texts.items()))
        with pytest.raises(PrivacyError):
            run.log_mlflow_table("leaky", pd.DataFrame({"note_id": [note_id], "text": [text]}))
        with pytest.raises(MistillInputError, match="free-text"):
            run.log_mlflow_table("free", pd.DataFrame({"note_id": [note_id], "comment": [
                "this column holds a long comment written in plain words by someone"]}))
        run.log_mlflow_table("ok", pd.DataFrame({"note_id": [note_id], "codes": [["A01"]], "f1": [0.5]}))
        logged = artifact_paths(client, run.run_id)
    assert "ok.json" in logged and not {"leaky.json", "free.json"} & logged


def test_logged_model_signature_defaults_to_a_cpu_sized_cap():
    params = {p["name"]: p["default"] for p in reg.signature().params.to_dict()}
    assert params["max_new_tokens"] == reg.SERVING_MAX_NEW_TOKENS == 512
    assert (params["temperature"], params["top_p"], params["top_k"]) == (0.6, 0.95, 20)
