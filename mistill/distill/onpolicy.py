"""The on-policy arms' shared machinery, and OPD (App. J.3; Table 2; App. L.2) on TRL's trainer.

OPD is TRL's ``DistillationTrainer`` as the paper ran it: the student samples its own
completions of the training prompts (capped at the arm's ``rollout_cap``), and matches the
teacher's next-token distributions on them under the generalised Jensen-Shannon divergence at
``beta`` (1: the reverse KL, TRL's default), with the student's weights in bf16 and no fp32
master copy. GOLD (:mod:`mistill.distill.gold`) runs on TRL's GOLD trainer with the same
pieces. The losses, the rollouts and the optimisation loop are TRL's; what this module adds is
what every arm of the platform shares:

- the same prompts (each training note's shortlist prompt in the student's chat template) and the
  same data order (:func:`on_policy_order`): the epochs' orders of
  :func:`~mistill.distill.trainer.epoch_order` laid end to end, as one pass over a dataset TRL
  does not shuffle;
- the recipe's optimiser, schedule, clipping, global batch (one prompt per micro-step, the
  recipe's accumulation), step count and seed (:func:`trainer_args`, :func:`recipe_optimizer`);
- the run's metrics: everything TRL logs, under ``train/`` (``learning_rate`` as ``train/lr``),
  through :func:`run_metrics_callback` (no MLflow callback of transformers' own, which would open
  runs);
- the trainer's ``after_step`` (the generation probe) after each optimizer step;
- resume: TRL's checkpoints (model, optimizer, scheduler, RNG, data position) in the run's work
  directory, the last one picked up when a run resumes (:func:`run_trainer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mistill.distill.trainer import RecipeConfig, epoch_order, lr_lambda, total_steps


def on_policy_order(n: int, recipe: RecipeConfig) -> list[int]:
    """The examples of an on-policy run in training order, ``grad_accum`` per optimizer step for
    :func:`~mistill.distill.trainer.total_steps` steps: every epoch's
    :func:`~mistill.distill.trainer.epoch_order`, one after another, the last step filled from the
    next epoch's order (TRL's trainers take whole steps only)."""
    need = total_steps(n, recipe) * recipe.grad_accum
    order: list[int] = []
    epoch = 0
    while len(order) < need:
        order += epoch_order(n, recipe.seed, epoch)
        epoch += 1
    return order[:need]


def trainer_args(recipe: RecipeConfig, output_dir: Path, *, steps: int, device: str) -> dict[str, Any]:
    """The arguments every on-policy arm's TRL config shares: clipping, one prompt per
    micro-step with the recipe's accumulation, the recipe's seed, ``steps`` optimizer steps; no
    shuffling (the order is :func:`on_policy_order`'s), no mixed-precision autocast (the student
    already holds the arm's precision), a checkpoint after every ``checkpoint_every`` steps, no
    reporting, HF generation. The optimiser and schedule are the recipe's own
    (:func:`recipe_optimizer`); the ones named here only describe them."""
    return dict(
        output_dir=str(output_dir), per_device_train_batch_size=1, gradient_accumulation_steps=recipe.grad_accum,
        num_train_epochs=1, max_steps=steps, learning_rate=recipe.lr, lr_scheduler_type="cosine",
        warmup_steps=max(1, round(recipe.warmup_frac * steps)), max_grad_norm=recipe.clip,
        adam_beta1=recipe.beta1, adam_beta2=recipe.beta2, weight_decay=recipe.weight_decay,
        optim="adamw_torch", seed=recipe.seed, data_seed=recipe.seed, bf16=False, fp16=False,
        gradient_checkpointing=recipe.gradient_checkpointing, logging_steps=1, report_to="none",
        disable_tqdm=True, save_strategy="steps" if recipe.checkpoint_every else "no",
        save_steps=recipe.checkpoint_every or 1, save_total_limit=1, use_cpu=device == "cpu",
        dataloader_num_workers=0)


def distillation_args(recipe: RecipeConfig, output_dir: Path, *, n_examples: int, rollout_cap: int, beta: float,
                      device: str, use_vllm: bool = False):
    """TRL's ``DistillationConfig`` for OPD: :func:`trainer_args`, the rollout cap and ``beta``;
    rollouts from TRL's colocated vLLM engine with ``use_vllm``."""
    from trl import DistillationConfig

    return DistillationConfig(**trainer_args(recipe, output_dir, steps=total_steps(n_examples, recipe),
                                             device=device),
                              max_completion_length=rollout_cap, beta=beta, shuffle_dataset=False, use_vllm=use_vllm,
                              vllm_mode="colocate")


def recipe_optimizer(model, recipe: RecipeConfig, total: int):
    """The recipe's AdamW and schedule (:func:`~mistill.distill.trainer.lr_lambda`), as every
    other arm's :class:`~mistill.distill.trainer.Trainer` builds them, for TRL to step."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, betas=(recipe.beta1, recipe.beta2),
                                  weight_decay=recipe.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, total, recipe.warmup_frac))
    return optimizer, scheduler


def run_metrics_callback(log: Callable[[dict, int], None], after_step: Callable[[int, bool], None] | None,
                         total: int):
    """A transformers ``TrainerCallback`` passing TRL's logs to ``log(metrics, step)`` (names
    without a prefix; ``learning_rate`` as ``lr``) and calling ``after_step(step, last)`` after
    every optimizer step."""
    from transformers import TrainerCallback

    class RunMetrics(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                metrics = {("lr" if k == "learning_rate" else k): float(v) for k, v in logs.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool)}
                log(metrics, state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            if after_step is not None:
                after_step(state.global_step, state.global_step >= total)

    return RunMetrics()


def run_trainer(trainer, output_dir: Path, *, resume: bool) -> int:
    """Train a TRL trainer, from the last checkpoint in ``output_dir`` with ``resume`` when there
    is one; returns the optimizer steps done."""
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(output_dir)) if resume and Path(output_dir).is_dir() else None
    trainer.train(resume_from_checkpoint=last)
    return int(trainer.state.global_step)


def train_opd(student, teacher, tokenizer, prompts: Sequence[str], recipe: RecipeConfig, output_dir: Path, *,
              rollout_cap: int, beta: float, device: str, log: Callable[[dict, int], None],
              after_step: Callable[[int, bool], None] | None = None, resume: bool = False,
              callbacks: Sequence = (), use_vllm: bool = False) -> int:
    """Train ``student`` (its weights already in the arm's precision) against ``teacher`` on
    ``prompts`` (chat-templated text, one per training note); returns the optimizer steps done.
    With ``resume``, continues from the last checkpoint in ``output_dir`` if there is one."""
    from datasets import Dataset
    from trl import DistillationTrainer

    order = on_policy_order(len(prompts), recipe)
    dataset = Dataset.from_dict({"prompt": [prompts[i] for i in order]})
    args = distillation_args(recipe, output_dir, n_examples=len(prompts), rollout_cap=rollout_cap, beta=beta,
                             device=device, use_vllm=use_vllm)
    total = total_steps(len(prompts), recipe)
    optimizer, scheduler = recipe_optimizer(student, recipe, total)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=dataset,
                                  processing_class=tokenizer, optimizers=(optimizer, scheduler),
                                  callbacks=[run_metrics_callback(log, after_step, total), *callbacks])
    return run_trainer(trainer, output_dir, resume=resume)


__all__ = ["on_policy_order", "trainer_args", "distillation_args", "recipe_optimizer", "run_metrics_callback",
           "run_trainer", "train_opd"]
