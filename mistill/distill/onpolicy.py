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
  directory, the last one picked up when a run resumes (:func:`run_trainer`);
- the rollout engine (:class:`RolloutEngine`): transformers' generation inside TRL's trainer, or
  TRL's colocated vLLM engine.

Rollouts through TRL's colocated vLLM engine (``use_vllm=True, vllm_mode="colocate"``), as the
paper ran OPD (trainer and engine on one H200). When the trainer is built, TRL's
``VLLMGeneration`` starts one ``vllm.LLM`` inside this process:

- from ``model.name_or_path``: vLLM reads the config, the weights and the tokenizer from that
  directory. :func:`colocated_engine` points it at :attr:`RolloutEngine.model_dir` (a directory
  :func:`save_rollout_model` wrote) while the trainer is built and trains, and restores it after;
- with ``distributed_executor_backend="external_launcher"``: vLLM joins a ``torch.distributed``
  group through ``env://``. TRL sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` to this
  process's place (0, 0, 1 here: the on-policy arms train in one process) and ``MASTER_ADDR``
  (``localhost`` when unset) and ``MASTER_PORT`` (a free port when unset) itself, so nothing is
  needed from the caller; the variables are restored after training;
- ``gpu_memory_utilization`` = :attr:`RolloutEngine.gpu_memory`: the share of the GPU's whole
  memory the engine may take for its copy of the student, its activations and its key/value
  cache, the rest staying with the trainer (student, gradients, optimizer state, the teacher);
- ``max_model_len`` = the longest prompt (tokenized as TRL tokenizes it) + the rollout cap
  (:func:`rollout_context`); vLLM refuses a window beyond the model's context;
- TRL's own fixed settings: ``max_num_seqs`` = the prompts of one optimizer step,
  ``max_num_batched_tokens`` 4,096 (long prompts are prefilled in chunks), engine seed 0, no
  sleep mode (the engine keeps its memory between steps), the student's dtype as saved.

Before the first rollout of every optimizer step TRL copies the student's current weights into
the engine, one parameter at a time (``load_weights``, no copy through the disk), and clears the
engine's prefix cache: the rollouts of step ``t`` are sampled from the weights after step
``t - 1``, and the weights on disk serve only to build the engine. Prompts go in as token ids,
one completion each, capped at ``rollout_cap`` tokens, sampled at TRL's settings (the same as its
transformers path). vLLM's sampling state is not part of TRL's checkpoints: a resumed run's
rollouts are not those an unbroken run would have drawn. After training the engine is shut down
and its process group destroyed (:func:`close_rollout_engine`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mistill.distill.trainer import RecipeConfig, epoch_order, lr_lambda, total_steps

ROLLOUT_GPU_MEMORY = 0.2
"""The colocated vLLM engine's default share of the GPU's memory (**[recon]**: the paper states
only that trainer and engine shared one 141 GB H200). On an H200 it is 28 GiB: a Qwen3-4B
student's weights (7.5 GiB), the engine's activations and a key/value cache of about 120k tokens
(144 KiB each), two to three paper-length prompts with their rollouts. The trainer keeps the
rest: GOLD's off-policy step at the paper's cap peaks at 95 GiB with the Qwen3-14B teacher on the
same card (``benchmarks/RESULTS.md``), which TRL's own default for OPD (0.3, 42 GiB) would leave
about 3 GiB beside."""

LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The launcher's variables TRL sets for the colocated engine (restored after training)."""


@dataclass(frozen=True)
class RolloutEngine:
    """TRL's colocated vLLM engine for an on-policy arm's rollouts (see the module docstring).

    model_dir: the directory vLLM builds the engine from (``config.json``, the weights, the
        tokenizer; :func:`save_rollout_model`); None: the student's own ``name_or_path``, which
        must then be such a directory (a student loaded with ``from_pretrained`` from one).
    gpu_memory: the share of the GPU's memory the engine may take, in (0, 1) (vLLM's
        ``gpu_memory_utilization``).
    """

    model_dir: Path | None = None
    gpu_memory: float = ROLLOUT_GPU_MEMORY


def save_rollout_model(model, tokenizer, directory: Path) -> Path:
    """Write ``model`` (config, weights in its dtype, generation config) and ``tokenizer`` to
    ``directory`` for TRL's colocated vLLM engine to build from; returns the directory. vLLM
    serves the model in the saved dtype and decodes with the saved tokenizer."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def rollout_context(tokenizer, prompts: Sequence[str], rollout_cap: int) -> int:
    """The colocated engine's window (vLLM's ``max_model_len``): the longest of ``prompts``
    tokenized as TRL's trainers tokenize a plain-text prompt (special tokens added), plus the
    rollout cap."""
    longest = max((len(tokenizer(text=p)["input_ids"]) for p in dict.fromkeys(prompts)), default=0)
    return longest + int(rollout_cap)


def engine_args(engine: RolloutEngine | None, context: int) -> dict[str, Any]:
    """The rollout fields of a TRL on-policy config (``DistillationConfig``, ``GOLDConfig``):
    transformers' generation without ``engine``; with it, TRL's colocated vLLM engine taking
    ``engine.gpu_memory`` of the GPU, over a window of ``context`` tokens (prompt + rollout)."""
    if engine is None:
        return {"use_vllm": False}
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": float(engine.gpu_memory),
            "vllm_max_model_length": int(context)}


@contextlib.contextmanager
def colocated_engine(student, engine: RolloutEngine | None) -> Iterator[None]:
    """While TRL's trainer is built and trains with ``engine``: ``student.name_or_path`` names
    the directory the engine builds from; afterwards the name and the launcher variables TRL set
    (:data:`LAUNCH_VARIABLES`) are restored. Nothing happens without an engine.

    Raises ValueError when the directory has no ``config.json`` (vLLM could not build from it).
    """
    if engine is None:
        yield
        return
    directory = Path(engine.model_dir) if engine.model_dir is not None else Path(str(student.name_or_path or ""))
    if not (directory / "config.json").is_file():
        raise ValueError(f"the rollout engine builds from a model directory, and {str(directory)!r} has no "
                         "config.json: save the student there first (save_rollout_model)")
    name = student.name_or_path
    saved = {k: os.environ.get(k) for k in LAUNCH_VARIABLES}
    student.name_or_path = str(directory)
    try:
        yield
    finally:
        student.name_or_path = name
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def close_rollout_engine(trainer) -> None:
    """Shut down the colocated vLLM engine of a TRL trainer, if it has one: the engine's core,
    vLLM's parallel groups and, when it is a group of this one process (the one the engine
    started: the platform starts none for a world of one), the ``torch.distributed`` group; then
    the memory the engine held is released. A failure here is reported on stderr and does not
    fail the run (training is over)."""
    import torch  # deferred: torch is slow to import

    generation = getattr(trainer, "vllm_generation", None)
    llm = getattr(generation, "llm", None)
    if llm is None:
        return
    del generation.llm
    try:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm, core
        try:
            from vllm.distributed import parallel_state  # deferred: vLLM is optional
        except ImportError:
            parallel_state = None
        if parallel_state is not None:
            parallel_state.destroy_model_parallel()
            dist = torch.distributed
            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
                parallel_state.destroy_distributed_environment()
    except Exception as exc:  # noqa: BLE001 - the engine's teardown differs across vLLM builds
        print(f"on-policy: the rollout engine was not shut down cleanly: {exc!r}", file=sys.stderr)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    reporting. The rollout engine's fields are :func:`engine_args`'s. The optimiser and schedule
    are the recipe's own (:func:`recipe_optimizer`); the ones named here only describe them."""
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
                      device: str, engine: RolloutEngine | None = None, context: int = 0):
    """TRL's ``DistillationConfig`` for OPD: :func:`trainer_args`, the rollout cap and ``beta``;
    rollouts from TRL's colocated vLLM engine with ``engine``, over a window of ``context``
    tokens (:func:`engine_args`), else from transformers' generation."""
    from trl import DistillationConfig  # deferred: TRL is optional and slow to import

    return DistillationConfig(**trainer_args(recipe, output_dir, steps=total_steps(n_examples, recipe),
                                             device=device),
                              max_completion_length=rollout_cap, beta=beta, shuffle_dataset=False,
                              **engine_args(engine, context))


def recipe_optimizer(model, recipe: RecipeConfig, total: int):
    """The recipe's AdamW and schedule (:func:`~mistill.distill.trainer.lr_lambda`), as every
    other arm's :class:`~mistill.distill.trainer.Trainer` builds them, for TRL to step."""
    import torch  # deferred: torch is slow to import

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
    from transformers import TrainerCallback  # deferred: transformers is slow to import

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
    from transformers.trainer_utils import get_last_checkpoint  # deferred: transformers.trainer_utils is slow to import

    last = get_last_checkpoint(str(output_dir)) if resume and Path(output_dir).is_dir() else None
    trainer.train(resume_from_checkpoint=last)
    return int(trainer.state.global_step)


def train_opd(student, teacher, tokenizer, prompts: Sequence[str], recipe: RecipeConfig, output_dir: Path, *,
              rollout_cap: int, beta: float, device: str, log: Callable[[dict, int], None],
              after_step: Callable[[int, bool], None] | None = None, resume: bool = False,
              callbacks: Sequence = (), engine: RolloutEngine | None = None) -> int:
    """Train ``student`` (its weights already in the arm's precision) against ``teacher`` on
    ``prompts`` (chat-templated text, one per training note); returns the optimizer steps done.
    With ``resume``, continues from the last checkpoint in ``output_dir`` if there is one.
    ``engine``: the rollouts through TRL's colocated vLLM engine (see the module docstring);
    None: through transformers' generation inside the trainer."""
    from datasets import Dataset  # deferred: datasets is optional
    from trl import DistillationTrainer  # deferred: TRL is optional and slow to import

    order = on_policy_order(len(prompts), recipe)
    dataset = Dataset.from_dict({"prompt": [prompts[i] for i in order]})
    context = rollout_context(tokenizer, prompts, rollout_cap) if engine is not None else 0
    args = distillation_args(recipe, output_dir, n_examples=len(prompts), rollout_cap=rollout_cap, beta=beta,
                             device=device, engine=engine, context=context)
    total = total_steps(len(prompts), recipe)
    optimizer, scheduler = recipe_optimizer(student, recipe, total)
    with colocated_engine(student, engine):
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=dataset,
                                      processing_class=tokenizer, optimizers=(optimizer, scheduler),
                                      callbacks=[run_metrics_callback(log, after_step, total), *callbacks])
        try:
            return run_trainer(trainer, output_dir, resume=resume)
        finally:
            close_rollout_engine(trainer)


__all__ = ["ROLLOUT_GPU_MEMORY", "RolloutEngine", "save_rollout_model", "rollout_context", "engine_args",
           "colocated_engine", "close_rollout_engine", "on_policy_order", "trainer_args", "distillation_args",
           "recipe_optimizer", "run_metrics_callback", "run_trainer", "train_opd"]
