"""The shared trainer: schedule, epoch order, precisions, and exact resume."""

from __future__ import annotations

import math

import pytest
import torch

from mistill.distill.trainer import (RecipeConfig, Trainer, clip_gradients, epoch_order, lr_lambda,
                                     prepare_student, steps_per_epoch, total_steps, uses_fsdp)
from mistill.distributed import World
from mistill.errors import MistillInputError
from mistill.models.loading import tiny_model


def _data(n: int = 5, length: int = 24):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 3000, (length,), generator=g) for _ in range(n)]


def _micro_step(data):
    def step(model, idx):
        ids = data[idx][None]
        logits = model(ids).logits[0, :-1].float()
        # a random per-step draw makes the RNG state part of what resume must restore
        noise = torch.rand(()) * 1e-3
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:]) + noise
        return loss, {"ce": float(loss.detach())}
    return step


def _trainer(tmp_path, precision="fp32", name="a", checkpoint_every=1):
    lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
    recipe = RecipeConfig(seed=3, precision=precision, epochs=2, lr=1e-3, grad_accum=2,
                          gradient_checkpointing=True, checkpoint_every=checkpoint_every)
    model = prepare_student(lm.model, recipe)
    logs = []
    t = Trainer(model, 5, recipe, _micro_step(_data()), state_dir=tmp_path / name,
                log=lambda m, s: logs.append((s, m)))
    return t, logs


def test_schedule_and_order():
    assert steps_per_epoch(493, 8) == 62 and total_steps(493, RecipeConfig()) == 124
    assert epoch_order(10, 0, 1) == epoch_order(10, 0, 1) != epoch_order(10, 0, 0)
    assert sorted(epoch_order(10, 0, 0)) == list(range(10))
    warm = round(0.05 * 124)
    assert lr_lambda(0, 124, 0.05) == pytest.approx(1 / warm)
    assert lr_lambda(warm - 1, 124, 0.05) == pytest.approx(1.0)
    assert lr_lambda(123, 124, 0.05) == pytest.approx(0.5 * (1 + math.cos(math.pi * (123 - warm) / (124 - warm))))


def test_bf16_weights_have_no_master_copy(tmp_path):
    t, _ = _trainer(tmp_path, precision="bf16")
    assert all(p.dtype == torch.bfloat16 for p in t.model.parameters())
    t.train(stop_after=1, progress=False)
    state = t.optimizer.state[next(iter(t.model.parameters()))]
    assert state["exp_avg"].dtype == torch.bfloat16


def test_resume_halfway_is_bit_identical(tmp_path):
    full, logs_full = _trainer(tmp_path, name="full")
    full.train(progress=False)
    assert full.step == 6  # ceil(5/2) = 3 steps per epoch, two epochs

    half, logs_half = _trainer(tmp_path, name="half")
    half.train(stop_after=3, progress=False)  # the end of epoch 0 ... then a "crash"
    resumed, logs_resumed = _trainer(tmp_path, name="half")
    assert resumed.load_state() and resumed.step == 3
    resumed.train(progress=False)
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert [m["ce"] for _, m in logs_full] == [m["ce"] for _, m in logs_half + logs_resumed]


def test_checkpoint_interval_decides_where_a_crashed_run_resumes(tmp_path):
    every2, _ = _trainer(tmp_path, name="every2", checkpoint_every=2)
    every2.train(stop_after=3, progress=False)  # checkpoints after steps 2, then a "crash" after step 3
    resumed, _ = _trainer(tmp_path, name="every2", checkpoint_every=2)
    assert resumed.load_state() and resumed.step == 2
    never, _ = _trainer(tmp_path, name="never", checkpoint_every=0)
    never.train(progress=False)
    assert never.step == 6 and not (tmp_path / "never" / "trainer_state.pt").exists()
    with pytest.raises(MistillInputError, match="checkpoint_every"):
        RecipeConfig(checkpoint_every=-1)


def test_resume_refuses_another_schedule(tmp_path):
    t, _ = _trainer(tmp_path, name="x")
    t.train(stop_after=1, progress=False)
    lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
    other = Trainer(prepare_student(lm.model, RecipeConfig(precision="fp32", epochs=3, grad_accum=2)), 5,
                    RecipeConfig(precision="fp32", epochs=3, grad_accum=2), _micro_step(_data()),
                    state_dir=tmp_path / "x")
    from mistill.errors import MistillInputError

    with pytest.raises(MistillInputError, match="another schedule"):
        other.load_state()


def test_resume_restores_extra_parameters(tmp_path):
    # Feature-KD's adapter lives outside the model: it must resume exactly too
    def make(name):
        lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
        recipe = RecipeConfig(seed=3, precision="fp32", epochs=2, lr=1e-3, grad_accum=2)
        model = prepare_student(lm.model, recipe)
        from mistill.distill.losses import make_adapter

        adapter = make_adapter(32, 8, seed=0)  # initialised by the seed alone
        data = _data()

        def step(m, idx):
            h = m.model(data[idx][None]).last_hidden_state[0]
            loss = adapter(h).pow(2).mean()
            return loss, {"l": float(loss.detach())}
        return Trainer(model, 5, recipe, step, state_dir=tmp_path / name, extra_params=list(adapter.parameters())), adapter

    full, a_full = make("full")
    full.train(progress=False)
    half, _ = make("half")
    half.train(stop_after=2, progress=False)
    resumed, a_res = make("half")
    assert resumed.load_state()
    resumed.train(progress=False)
    assert torch.equal(a_full.weight, a_res.weight) and torch.equal(a_full.bias, a_res.bias)


def test_a_non_finite_gradient_stops_training_before_the_update(tmp_path):
    lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
    recipe = RecipeConfig(seed=0, precision="fp32", epochs=1, grad_accum=1)
    model = prepare_student(lm.model, recipe)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def bad(m, idx):
        h = m.model(_data()[idx][None]).last_hidden_state
        return h.sum() * float("nan"), {}
    t = Trainer(model, 2, recipe, bad, state_dir=tmp_path / "nan")
    with pytest.raises(FloatingPointError, match="step 1"):
        t.train(progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_checkpoint_layers_keeps_gradients_and_hooks_outside():
    """Our per-layer checkpointing: the same loss and gradients as none, and a layer's forward
    pre-hook fires once per forward, outside the checkpoint (gradients on, no saved-tensor hooks)."""
    from mistill.distill.attention_rows import in_plain_forward
    from mistill.distill.trainer import checkpoint_layers

    ids = torch.arange(3, 40).unsqueeze(0)

    def grads(checkpointed: bool):
        lm = tiny_model("llama", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=3)
        lm.model.train()
        if checkpointed:
            assert checkpoint_layers(lm.model)
        fired, inner = [], []
        lm.model.model.layers[1].register_forward_pre_hook(lambda m, a: fired.append(in_plain_forward()))
        lm.model.model.layers[1].self_attn.register_forward_pre_hook(lambda m, a, k: inner.append(1),
                                                                     with_kwargs=True)
        loss = lm.model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()
        loss.backward()
        # inside the checkpoint, the attention runs again in the backward (the recompute)
        assert len(inner) == (2 if checkpointed else 1)
        return loss.detach(), {n: p.grad for n, p in lm.model.named_parameters()}, fired

    l0, g0, f0 = grads(False)
    l1, g1, f1 = grads(True)
    torch.testing.assert_close(l0, l1)
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-5, atol=1e-7)
    assert f0 == [True] and f1 == [True]


def test_clip_gradients_takes_the_exact_norm_and_scales_like_torch():
    """The norm is the float64 norm to float32 rounding (on a gradient large enough that a
    naive float32 accumulation drifts), and the gradients are scaled as ``clip_grad_norm_``
    scales them; below the bound nothing changes."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3_000_000, 1000, 7)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    exact = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
    reference = [p.grad.double() * min(1.0, 0.5 / (exact + 1e-6)) for p in params]
    norm = clip_gradients(params, 0.5)
    assert float(norm) == pytest.approx(exact, rel=1e-6)
    for p, ref in zip(params, reference):
        torch.testing.assert_close(p.grad.double(), ref, rtol=1e-6, atol=0)
    before = [p.grad.clone() for p in params]
    assert float(clip_gradients(params, 10.0)) == pytest.approx(0.5, rel=1e-5)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_sharding_choice_follows_precision_and_refuses_what_fsdp_cannot_take():
    """``auto`` shards the fp32-master-weight arms on several processes and nothing on one;
    ``fsdp`` refuses an arm with parameters outside the model and the generation probe, which
    ``auto`` replicates instead."""
    two, one = World(rank=0, size=2), World()
    fp32, bf16 = RecipeConfig(precision="fp32"), RecipeConfig(precision="bf16")
    assert uses_fsdp(fp32, two) and not uses_fsdp(bf16, two) and not uses_fsdp(fp32, one)
    assert uses_fsdp(RecipeConfig(precision="bf16", sharding="fsdp"), two)
    assert not uses_fsdp(RecipeConfig(precision="fp32", sharding="replicate"), two)
    assert not uses_fsdp(fp32, two, extra_params=True) and not uses_fsdp(fp32, two, probe=True)
    forced = RecipeConfig(precision="fp32", sharding="fsdp")
    for kw in ({"extra_params": True}, {"probe": True}):
        with pytest.raises(MistillInputError) as err:
            uses_fsdp(forced, two, **kw)
        assert err.value.field == "sharding"
    with pytest.raises(MistillInputError):
        RecipeConfig(sharding="zero3").validate()
