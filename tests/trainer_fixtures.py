"""A crash of a TRL / transformers trainer at a chosen point, for the resume tests."""

from __future__ import annotations

from transformers import TrainerCallback


class Killed(Exception):
    pass


class KillAfterSave(TrainerCallback):
    """A crash right after the checkpoint of optimizer step ``step`` is written."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Killed


def trained_and_resumed(train, tmp_path, recipe, total: int, kill_at: int = 2) -> dict[int, dict]:
    """Run ``train`` (``train(out, resume=, callbacks=, probe=) -> (model, logs, steps)``, a TRL
    run of ``total`` optimizer steps) unbroken, then killed after the checkpoint of step
    ``kill_at`` and resumed. Checks the unbroken run against the platform's recipe (the probe hook
    at every step, the last flagged; one log per step with the recipe's learning rate), that the
    resumed run did not redo a step, and that it ends with the same weights, bit for bit, still
    bf16 (no fp32 master copy). Returns the unbroken run's logs by step."""
    import pytest
    import torch

    from mistill.distill.trainer import lr_lambda

    seen: list[tuple[int, bool]] = []
    full, logs, steps = train(tmp_path / "full", probe=lambda step, last: seen.append((step, last)))
    assert steps == total
    assert seen == [(s, s == total) for s in range(1, total + 1)]
    per_step = {s: m for s, m in logs if "loss" in m}
    assert sorted(per_step) == list(range(1, total + 1))
    for s, m in per_step.items():  # the platform's schedule, stepped by TRL
        assert m["lr"] == pytest.approx(recipe.lr * lr_lambda(s - 1, total, recipe.warmup_frac))
    with pytest.raises(Killed):
        train(tmp_path / "half", callbacks=[KillAfterSave(kill_at)])
    resumed, resumed_logs, steps = train(tmp_path / "half", resume=True)
    assert steps == total
    assert sorted(s for s, m in resumed_logs if "loss" in m) == list(range(kill_at + 1, total + 1))
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert all(p.dtype == torch.bfloat16 for p in resumed.parameters())
    return per_step
