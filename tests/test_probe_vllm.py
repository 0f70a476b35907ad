"""The generation probe through vLLM: one engine for the whole training run, given the student's
current weights before each probe (:class:`~mistill.evaluation.backends.SyncedVLLMBackend`).

On the vLLM build scripts/setup.sh installed (the CPU build on a machine without CUDA), with a
tiny Qwen3 student of 64-wide heads (what vLLM's CPU attention serves), in one train run and one
engine start: after the student's weights change, the engine's greedy tokens are HF's greedy
tokens of the changed student (and not those of the weights before); the run starts one engine
for all its probes, loads the weights at each probe, shuts the engine down when training ends
and records the backend. Without vLLM the test fails, unless ``MISTILL_VLLM=0`` turns the vLLM
lane off (then it is skipped). The engine runs in vLLM's own processes; its KV cache is 1 GiB.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from mlflow.tracking import MlflowClient

from mistill.distributed import World
from mistill.errors import MistillInputError
from mistill.evaluation.backends import HFBackend, SyncedVLLMBackend
from mistill.evaluation.generation import DecodingConfig
from mistill.evaluation.probe import PROBE_METRICS
from mistill.stages.distill import (PROBE_ENGINE, TAG_PROBE_BACKEND, TargetsConfig, TrainStageConfig,
                                    resolve_probe_backend, run_targets, run_train)
from stage_fixtures import tiny_attribute_run

STUDENT = "tiny:qwen3:seed=2:d_head=64"
"""A student vLLM's CPU build can serve (its attention needs 64-wide heads)."""


@pytest.fixture(scope="module")
def vllm_env():
    """vLLM is here (else a failure, or a skip under ``MISTILL_VLLM=0``); its engines run in their
    own processes with a 1 GiB KV cache; what vLLM adds to this process's environment is undone."""
    if os.environ.get("MISTILL_VLLM", "1") == "0":
        pytest.skip("MISTILL_VLLM=0: the vLLM lane of scripts/setup.sh is off")
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed: run scripts/setup.sh, or set MISTILL_VLLM=0", pytrace=False)
    saved = dict(os.environ)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved.get("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


def _min_gap(lm, prompt: str, new: list[int]) -> float:
    """HF's smallest top-1 minus top-2 logit over the generated positions (teacher-forced)."""
    ids = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"] + new
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([ids])).logits[0, len(ids) - len(new) - 1:-1]
    top = logits.float().topk(2).values
    return float((top[:, 0] - top[:, 1]).min())


def test_multi_rank_probes_use_hf():
    two, one = World(rank=0, size=2, local_rank=0), World(rank=0, size=1, local_rank=0)
    assert resolve_probe_backend("auto", "cuda:0", two) == "hf" == resolve_probe_backend("hf", "cpu", two)
    with pytest.raises(MistillInputError, match="several processes") as err:
        resolve_probe_backend("vllm", "cuda:0", two)
    assert err.value.field == "probe_backend"
    assert resolve_probe_backend("auto", "cpu", one) == "hf"  # auto: vLLM only on CUDA
    with pytest.raises(MistillInputError):
        TrainStageConfig(targets_run="0" * 32, probe_backend="tgi").validate()


def test_a_train_run_probes_through_one_engine_serving_the_current_weights(vllm_env, tracking_uri, tmp_path_factory,
                                                                          monkeypatch, pinned_code_version):
    """``probe_backend=vllm``, ``probe_every=1``, two steps: one engine for both probes, the
    weights loaded at each probe, the engine shut down and its folder removed when training ends;
    the run logs ``probe/*`` at both steps and records the backend.

    At the first probe, after the probe has sampled, the student's weights are changed (seeded
    noise, the output layer scaled up for decisive margins) and the engine decodes the probe note
    greedily (top-k 1): its tokens are HF's greedy tokens of the changed student, not those of the
    student before the change; then the weights are put back and training goes on."""
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path_factory.mktemp("probe-vllm-root")))
    targets = run_targets(TargetsConfig(teacher_attribute_run=tiny_attribute_run("probe-vllm")))
    built, closed, checked = [], [], []
    real_init, real_close, real_generate = (SyncedVLLMBackend.__init__, SyncedVLLMBackend.close,
                                            SyncedVLLMBackend.generate_ids)

    def init(self, lm, *args, **kwargs):
        real_init(self, lm, *args, **kwargs)
        built.append((self, lm))

    def close(self):
        closed.append("llm" in self.__dict__)
        real_close(self)

    def generate_ids(self, prompts, seeds, **kwargs):
        out = real_generate(self, prompts, seeds, **kwargs)  # the probe's own sample
        if not checked:
            checked.append(_greedy_after_a_change(self, built[0][1], prompts[:1], real_generate))
        return out

    monkeypatch.setattr(SyncedVLLMBackend, "__init__", init)
    monkeypatch.setattr(SyncedVLLMBackend, "close", close)
    monkeypatch.setattr(SyncedVLLMBackend, "generate_ids", generate_ids)
    run_id = run_train(TrainStageConfig(targets_run=targets, student=STUDENT, arm="vanilla-fp32",
                                        max_steps=2, grad_accum=1, epochs=2, register=False, probe_every=1,
                                        probe_notes=1, probe_max_new_tokens=8, probe_backend="vllm"))
    assert len(built) == 1 and checked == [True]
    backend = built[0][0]
    assert backend.weight_loads == 3  # two probes and the check
    assert closed[:1] == [True] and "llm" not in backend.__dict__
    assert backend.engine_kwargs["dtype"] == "float32"  # the student's training precision
    assert backend.directory.name == PROBE_ENGINE and not backend.directory.exists()
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags[TAG_PROBE_BACKEND] == "vllm"
    for name in PROBE_METRICS:
        assert sorted(m.step for m in client.get_metric_history(run_id, f"probe/{name}")) == [1, 2], name


def _greedy_after_a_change(backend: SyncedVLLMBackend, lm, prompts, real_generate) -> bool:
    """Change ``lm``'s weights, check the engine's greedy tokens against HF's, restore the weights."""
    dec, sampled = DecodingConfig(top_k=1, max_new_tokens=8), backend.decoding  # the probe cap
    hf = HFBackend(lm, dec)
    texts = [lm.tokenizer.decode(p) for p in prompts]
    ids = [lm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]  # what HF's side encodes
    before = [hf.generate(t, 7).token_ids for t in texts]
    saved = {name: p.detach().clone() for name, p in lm.model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    try:
        with torch.no_grad():
            for p in lm.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
            lm.model.get_output_embeddings().weight.mul_(8.0)
        want = [hf.generate(t, 7).token_ids for t in texts]
        gaps = [_min_gap(lm, t, w) for t, w in zip(texts, want, strict=True)]
        backend.decoding = dec
        got = [g.token_ids for g in real_generate(backend, ids, [7] * len(ids))]
    finally:
        backend.decoding = sampled
        with torch.no_grad():
            for name, p in lm.model.named_parameters():
                p.copy_(saved[name])
    assert min(gaps) > 1e-3  # no near-tie excuses a difference
    assert got == want and want != before
    return True
