"""The OPD arm on TRL's DistillationTrainer: the platform's data order and schedule, the run's
metrics, a run killed after a checkpoint that resumes to the same weights bit for bit, and what
TRL's colocated vLLM rollout engine is built with; in the train stage, the rollout engine
``auto`` resolves to and records."""

from __future__ import annotations

import os

import pytest
import torch

from mistill.distill.onpolicy import (LAUNCH_VARIABLES, RolloutEngine, colocated_engine, on_policy_order,
                                      save_rollout_model, train_opd)
from mistill.distill.trainer import RecipeConfig, epoch_order, total_steps
from mistill.models.loading import tiny_model
from trainer_fixtures import Killed, KillAfterSave, trained_and_resumed

PROMPTS = ["Code note one:", "Code note two:", "Code note three:"]
RECIPE = RecipeConfig(seed=3, precision="bf16", epochs=2, lr=1e-3, grad_accum=2)


def _train(out, *, resume=False, callbacks=(), probe=None):
    student = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
    teacher = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=2)
    model = student.model.to(torch.bfloat16)
    logs = []
    steps = train_opd(model, teacher.model, student.tokenizer, PROMPTS, RECIPE, out, rollout_cap=6, beta=1.0,
                      device="cpu", log=lambda m, s: logs.append((s, m)), after_step=probe, resume=resume,
                      callbacks=callbacks)
    return model, logs, steps


def test_order_and_steps_are_every_arms():
    """The epochs' orders end to end, the last of the recipe's steps filled from the next epoch's."""
    assert total_steps(3, RECIPE) == 4  # ceil(3 / 2) per epoch, two epochs
    assert on_policy_order(3, RECIPE) == epoch_order(3, 3, 0) + epoch_order(3, 3, 1) + epoch_order(3, 3, 2)[:2]
    assert on_policy_order(3, RECIPE.replace(max_steps=1)) == epoch_order(3, 3, 0)[:2]
    assert on_policy_order(4, RECIPE) == epoch_order(4, 3, 0) + epoch_order(4, 3, 1)


def test_opd_trains_logs_and_resumes_bit_for_bit(tmp_path):
    for m in trained_and_resumed(_train, tmp_path, RECIPE, 4).values():
        assert {"loss", "grad_norm", "completions/mean_length"} <= set(m)
        assert m["completions/max_length"] <= 6  # the rollout cap


# ------------------------------------------------------------------ TRL's colocated engine
def stand_in_engine(built: list):
    """A class standing in for TRL's ``VLLMGeneration`` (vLLM's colocated engine needs a CUDA
    GPU): it keeps the keyword arguments the trainer built it with and the student's
    ``name_or_path`` at that moment (the directory vLLM would load), sets the launcher's variables
    as TRL's does, counts weight syncs and rollouts, and rolls out three fixed tokens per prompt.
    Each instance is appended to ``built``."""

    class StandIn:
        def __init__(self, model, accelerator, processing_class, **kwargs):
            self.kwargs, self.built_from = kwargs, model.name_or_path
            self.syncs = self.rollouts = 0
            self.llm = object()
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="29555")
            built.append(self)

        def sync_weights(self):
            self.syncs += 1

        def generate(self, prompts, images, num_generations, profiler=None):
            self.rollouts += 1
            return prompts, [[7, 8, 9] for _ in prompts for _ in range(num_generations)], None, None

    return StandIn


def test_opd_rollouts_through_trls_colocated_engine(tmp_path, monkeypatch):
    """With a rollout engine, TRL builds its colocated vLLM engine from the saved student (the
    directory as ``name_or_path``), with the engine's share of the GPU and a window of the
    longest prompt plus the rollout cap, and copies the student's weights into it before each
    optimizer step's rollouts; afterwards the engine is closed and the student's name and the
    launcher's variables are as they were."""
    import trl.trainer.distillation_trainer as upstream

    built: list = []
    monkeypatch.setattr(upstream, "VLLMGeneration", stand_in_engine(built))
    monkeypatch.setattr(upstream, "is_vllm_available", lambda *args, **kwargs: True)
    for key in LAUNCH_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    student = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
    teacher = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=2)
    model = student.model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="config.json"), colocated_engine(model, RolloutEngine(tmp_path / "none")):
        pass
    saved = save_rollout_model(model, student.tokenizer, tmp_path / "engine")
    assert (saved / "config.json").is_file() and (saved / "tokenizer_config.json").is_file()
    name, logs = model.name_or_path, []
    steps = train_opd(model, teacher.model, student.tokenizer, PROMPTS, RECIPE.replace(max_steps=2), tmp_path / "out",
                      rollout_cap=6, beta=1.0, device="cpu", log=lambda m, s: logs.append(m),
                      engine=RolloutEngine(saved, gpu_memory=0.25))
    (engine,) = built
    assert engine.built_from == str(saved)
    longest = max(len(student.tokenizer(text=p)["input_ids"]) for p in PROMPTS)
    assert (engine.kwargs["mode"], engine.kwargs["gpu_memory_utilization"], engine.kwargs["max_model_length"]) == (
        "colocate", 0.25, longest + 6)
    assert engine.kwargs["max_completion_length"] == 6
    assert steps == engine.syncs == engine.rollouts == 2  # one rollout batch per optimizer step
    assert [m["completions/mean_length"] for m in logs if "loss" in m] == [3.0, 3.0]
    assert not hasattr(engine, "llm")  # closed after training
    assert model.name_or_path == name and not any(key in os.environ for key in LAUNCH_VARIABLES)


# -------------------------------------------------------------------------- the train stage
@pytest.fixture(scope="module")
def targets_ids(tracking_uri, tmp_path_factory, pinned_code_version):
    """A characterized synthetic corpus (tiny models) and the teacher's targets."""
    from stage_fixtures import tiny_distill_inputs

    return tiny_distill_inputs(tmp_path_factory.mktemp("opd-root"), "opd")


def test_the_opd_arm_in_the_train_stage(targets_ids, monkeypatch):
    """``-P arm=opd``: TRL's metrics under ``train/``, the generation probe, the checkpoint
    registered with the arm's alias like every arm's."""
    from mlflow.tracking import MlflowClient

    from mistill.stages.distill import TrainStageConfig, run_train
    from mistill.tracking.models import TAG_MODEL_ALIAS, TAG_REGISTERED_MODEL

    monkeypatch.setenv("MISTILL_ROOT", str(targets_ids["root"]))
    run_id = run_train(TrainStageConfig(targets_run=targets_ids["ids"]["targets"], student="tiny:qwen3:seed=2",
                                        arm="opd", overrides="rollout_cap=8", max_steps=2, grad_accum=1,
                                        probe_every=2, probe_notes=1, probe_max_new_tokens=4))
    client = MlflowClient()
    run = client.get_run(run_id)
    for name in ("train/loss", "train/grad_norm", "train/lr", "train/completions/mean_length"):
        assert sorted(m.step for m in client.get_metric_history(run_id, name)) == [1, 2], name
    assert run.data.metrics["train/steps"] == 2
    assert run.data.metrics["train/completions/max_length"] <= 8
    assert [m.step for m in client.get_metric_history(run_id, "probe/truncated_rate")] == [2]
    assert run.data.params["arm.objective"] == "opd" and run.data.params["arm.rollout_cap"] == "8"
    # rollout_backend=auto on the CPU: transformers' generation, recorded as the engine and a deviation
    assert run.data.tags["mistill.rollout_backend"] == "hf"
    assert "rollout_backend=hf" in run.data.tags["mistill.deviation"].split(",")
    assert run.data.tags[TAG_MODEL_ALIAS] == "opd-s0"
    version = client.get_model_version_by_alias(run.data.tags[TAG_REGISTERED_MODEL], "opd-s0")
    assert version.run_id == run_id and version.tags["mistill.objective"] == "opd"


def test_the_gold_arm_in_the_train_stage(targets_ids, monkeypatch):
    """``-P arm=gold``: the arm's one epoch, the teacher's traces capped at the rollout cap and
    counted, TRL's metrics under ``train/``, the probe, the checkpoint registered as ``gold-s0``."""
    from mlflow.tracking import MlflowClient

    from mistill.stages.distill import TrainStageConfig, run_train
    from mistill.tracking.models import TAG_MODEL_ALIAS, TAG_REGISTERED_MODEL

    monkeypatch.setenv("MISTILL_ROOT", str(targets_ids["root"]))
    run_id = run_train(TrainStageConfig(targets_run=targets_ids["ids"]["targets"], student="tiny:qwen3:seed=2",
                                        arm="gold", overrides="rollout_cap=8", grad_accum=1, probe_every=1,
                                        probe_notes=1, probe_max_new_tokens=4))
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.data.metrics["n_notes"] == 1
    assert run.data.metrics["train/steps"] == 1  # the arm's one epoch, a note per step (the recipe's two: 2)
    assert run.data.metrics["train/truncated_completions"] == 1  # the trace is longer than 8 tokens
    for name in ("train/loss", "train/grad_norm", "train/lr", "train/matched_loss"):
        assert [m.step for m in client.get_metric_history(run_id, name)] == [1], name
    assert [m.step for m in client.get_metric_history(run_id, "probe/truncated_rate")] == [1]
    params = run.data.params
    assert (params["arm.objective"], params["arm.epochs"], params["arm.on_policy_fraction"]) == ("gold", "1", "0.5")
    # the run's deviations from the shared protocol, in its config.json beside the resolved arm
    import json

    import mlflow

    with open(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="config.json")) as fh:
        doc = json.load(fh)
    assert doc["arm"]["objective"] == "gold" and doc["arm"]["rollout_cap"] == 8
    recorded = {d["parameter"]: d["value"] for d in doc["deviations"]}
    assert {"ArmConfig.epochs": 1, "ArmConfig.on_policy_fraction": 0.5, "ArmConfig.rollout_cap": 8,
            "TrainStageConfig.rollout_backend": "hf"}.items() <= recorded.items()
    # the engine rollout_backend=auto resolved to on the CPU, against the paper's
    (engine,) = [d for d in doc["deviations"] if d["parameter"] == "TrainStageConfig.rollout_backend"]
    assert (engine["resolved_from"], engine["kind"], engine["paper_value"]) == ("auto", "against_paper", "vllm")
    assert doc["config"]["rollout_backend"] == "auto" and run.data.tags["mistill.rollout_backend"] == "hf"
    assert run.data.tags[TAG_MODEL_ALIAS] == "gold-s0"
    version = client.get_model_version_by_alias(run.data.tags[TAG_REGISTERED_MODEL], "gold-s0")
    assert version.run_id == run_id and version.tags["mistill.objective"] == "gold"


def test_on_policy_rollouts_from_vllm_need_vllm_and_a_gpu(targets_ids, monkeypatch):
    """``rollout_backend=vllm`` is refused with the parameter named, before any run is created,
    where vLLM is missing or the device is the CPU; ``auto`` resolves to transformers' generation
    there."""
    import sys

    from stage_fixtures import runs_of

    from mistill.errors import MistillInputError
    from mistill.stages.distill import TrainStageConfig, resolve_rollout_backend, run_train

    monkeypatch.setenv("MISTILL_ROOT", str(targets_ids["root"]))
    experiment = f"mistill/{targets_ids['corpus']}"
    before = len(runs_of(experiment, stage="train"))
    for missing in (False, True):  # off CUDA, with vLLM as installed here and without it
        with monkeypatch.context() as m:
            if missing:
                m.setitem(sys.modules, "vllm", None)  # `import vllm` fails
            with pytest.raises(MistillInputError) as err:
                run_train(TrainStageConfig(targets_run=targets_ids["ids"]["targets"], student="tiny:qwen3:seed=2",
                                           arm="opd", rollout_backend="vllm", max_steps=1))
            assert err.value.field == "rollout_backend"
            assert "vLLM" in str(err.value)
            assert resolve_rollout_backend("auto", "cpu") == "hf"
    assert len(runs_of(experiment, stage="train")) == before


def test_a_killed_gold_train_run_resumes_to_the_weights_of_an_unbroken_one(targets_ids, monkeypatch):
    """The train stage against the tracking server: a GOLD run that dies right after its first
    checkpoint is resumed by the same command and ends with the weights, bit for bit, of a run
    that was never interrupted (``register`` differs so that the two are separate runs)."""
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    import mistill.distill.gold as gold
    from mistill.stages.distill import TrainStageConfig, run_train
    from mistill.tracking.models import trained_model_dir

    monkeypatch.setenv("MISTILL_ROOT", str(targets_ids["root"]))
    cfg = TrainStageConfig(targets_run=targets_ids["ids"]["targets"], student="tiny:qwen3:seed=2", arm="gold",
                           overrides="rollout_cap=8,epochs=2", grad_accum=1, seed=3)
    unbroken = run_train(cfg.replace(register=False))
    run_trainer = gold.run_trainer

    def crash_after_first_checkpoint(trainer, output_dir, *, resume):
        trainer.add_callback(KillAfterSave(1))
        return run_trainer(trainer, output_dir, resume=resume)

    monkeypatch.setattr(gold, "run_trainer", crash_after_first_checkpoint)
    with pytest.raises(Killed):
        run_train(cfg)
    monkeypatch.setattr(gold, "run_trainer", run_trainer)
    resumed = run_train(cfg)
    client = MlflowClient()
    assert client.get_run(resumed).info.status == "FINISHED"
    # step 1 was logged before the crash and not redone: the run went on from its checkpoint
    assert [m.step for m in client.get_metric_history(resumed, "train/loss")] == [1, 2]
    a, b = (load_file(trained_model_dir(r) / "model.safetensors") for r in (unbroken, resumed))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
