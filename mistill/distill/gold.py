"""The GOLD arm (App. J.3, L.2): TRL's experimental GOLD trainer, cross-tokenizer on-policy distillation.

As the paper ran it for SmolLM3-3B: TRL's ``GOLDTrainer`` with the ULD loss and its text-span
token alignment (``use_extended_uld``; the hybrid form, JSD on the tokens both vocabularies
share and ULD on the rest, with ``hybrid``), the student's weights in bf16 without an fp32
master copy, one prompt per micro-step. Each micro-step is on-policy with probability
``on_policy_fraction`` (TRL's ``lmbda``): the student samples a completion of the note's prompt,
capped at ``rollout_cap`` tokens; otherwise it trains on the teacher's trace, which the stage
truncates to the same cap (:func:`capped_completion`) as the paper's run did to fit memory.

One override, as in the paper: the logits are computed only over the completion window
(:func:`completion_window_start`, :func:`window_logits`), because full-sequence logits of
30k-token prompts do not fit; the loss, the alignment and the on-policy machinery are upstream's.
A test checks that the windowed loss equals upstream's full-sequence one.

The data order, optimiser, schedule, metrics, probe, resume and rollout engine are every
on-policy arm's (:mod:`mistill.distill.onpolicy`). With TRL's colocated vLLM engine, only the
on-policy micro-steps roll out through it, and TRL copies the student's weights into it before
the first on-policy rollout of each optimizer step (``vllm_sync_frequency`` 1).
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from mistill.distill.onpolicy import (RolloutEngine, close_rollout_engine, colocated_engine, engine_args,
                                      on_policy_order, recipe_optimizer, rollout_context, run_metrics_callback,
                                      run_trainer, trainer_args)
from mistill.distill.trainer import RecipeConfig, total_steps

IGNORE = -100


def capped_completion(full_text: str, offsets: Sequence[tuple[int, int]], trace_offset: int, cap: int
                      ) -> tuple[str, bool]:
    """The teacher's trace as the off-policy completion, cut after its first ``cap`` tokens.

    Args:
        full_text: prompt + trace as the student reads it; ``offsets`` ``[pos]`` the character
            span of each of its tokens in the student's tokenizer; ``trace_offset`` where the trace
            starts in ``full_text``.
    Returns:
        ``(completion, truncated)``: the trace, or its prefix ending where its ``cap + 1``-th
        token starts, and whether it was cut.
    """
    starts = [s for s, _ in offsets if s >= trace_offset]
    if len(starts) <= cap:
        return full_text[trace_offset:], False
    return full_text[trace_offset:starts[cap]], True


def completion_window_start(labels: torch.Tensor) -> int:
    """The first position whose logits the ULD loss reads in any row of the batch: one before the
    earliest completion token (the ``bayesian`` merge reads the logit before each token), at
    least 0. ``labels`` ``[batch, seq]`` with ``-100`` outside the completions."""
    scored = labels.ne(IGNORE)
    if not bool(scored.any()):
        return max(0, labels.shape[1] - 1)
    first = scored.int().argmax(dim=1)[scored.any(dim=1)]
    return max(0, int(first.min()) - 1)


@functools.cache
def _keeps_logits(forward_type: type) -> bool:
    return "logits_to_keep" in inspect.signature(forward_type.forward).parameters


def window_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int) -> torch.Tensor:
    """``[batch, seq - start, vocab]``: the model's logits at positions ``start..seq-1`` only,
    the output layer applied to those positions (``logits_to_keep``) where the model supports it."""
    keep = input_ids.shape[1] - start
    inner = getattr(model, "module", model)  # an accelerate / DDP wrapper
    if _keeps_logits(type(inner)):
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                     logits_to_keep=keep).logits
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, start:]


@functools.cache
def windowed_trainer_class():
    """TRL's ``GOLDTrainer`` with the platform's two changes: the data order is the dataset's (no
    shuffle: :func:`~mistill.distill.onpolicy.on_policy_order` laid it out), and the ULD loss
    reads logits over the completion window only (``completion_window``)."""
    # deferred: TRL is optional and slow to import
    from trl.experimental.gold import GOLDTrainer
    # deferred: TRL is optional and slow to import
    from trl.experimental.gold.gold_trainer import build_teacher_inputs_from_texts
    from trl.trainer.utils import RepeatSampler  # deferred: TRL is optional and slow to import

    class WindowedGOLDTrainer(GOLDTrainer):
        completion_window = True

        def _get_train_sampler(self, dataset=None):
            return RepeatSampler(data_source=self.train_dataset if dataset is None else dataset,
                                 mini_repeat_count=self.num_generations,
                                 batch_size=self.args.generation_batch_size * self.accelerator.num_processes,
                                 repeat_count=self.args.gradient_accumulation_steps, shuffle=False)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not self.completion_window or not self.use_uld_loss or self.teacher_tokenizer is None:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            device = self.accelerator.device
            t_ids, t_labels, t_mask, t_offsets = (t.to(device) for t in build_teacher_inputs_from_texts(
                self.teacher_tokenizer, inputs["original_prompt_text"], inputs["original_completion_text"]))
            s_from = completion_window_start(inputs["labels"])
            t_from = completion_window_start(t_labels)
            student_logits = window_logits(model, inputs["input_ids"], inputs["attention_mask"], s_from)
            self.teacher_model.eval()
            with torch.no_grad():
                teacher_logits = window_logits(self.teacher_model, t_ids, t_mask, t_from)
            offsets = inputs.get("byte_offsets")
            if self.uld_loss_fn.use_extended_uld and offsets is None:
                raise ValueError("Input batches must include `byte_offsets` when `use_extended_uld=True`.")
            loss = self.uld_loss_fn(
                student_logits=student_logits, teacher_logits=teacher_logits,
                student_labels=inputs["labels"][:, s_from:], teacher_labels=t_labels[:, t_from:],
                student_input_ids=inputs["input_ids"][:, s_from:], teacher_input_ids=t_ids[:, t_from:],
                student_byte_offsets=None if offsets is None else offsets[:, s_from:],
                teacher_byte_offsets=t_offsets[:, t_from:])
            self._count_hybrid_parts()
            return (loss, None) if return_outputs else loss

        def _count_hybrid_parts(self) -> None:
            """The hybrid loss's matched / unmatched parts, accumulated for TRL's log as upstream does."""
            fn = self.uld_loss_fn
            if not (hasattr(fn, "last_matched_loss") and hasattr(fn, "last_unmatched_loss")):
                return
            step_eq = 1.0 / max(1, int(self.args.gradient_accumulation_steps))
            self._matched_sum += fn.last_matched_loss.item() if fn.last_matched_loss is not None else 0.0
            self._unmatched_sum += fn.last_unmatched_loss.item() if fn.last_unmatched_loss is not None else 0.0
            self._matched_step_eq += step_eq
            self._unmatched_step_eq += step_eq

    return WindowedGOLDTrainer


def gold_args(recipe: RecipeConfig, output_dir: Path, *, n_examples: int, rollout_cap: int,
              on_policy_fraction: float, beta: float, hybrid: bool, teacher_tokenizer_dir: Path, device: str,
              engine: RolloutEngine | None = None, context: int = 0):
    """TRL's ``GOLDConfig``: :func:`~mistill.distill.onpolicy.trainer_args`, the ULD loss with
    its extended (text-span) alignment, ``hybrid`` (with adaptive weights, upstream's default),
    the on-policy fraction, the rollout cap, ``beta`` (the hybrid loss's matched-token JSD), no
    length limit on prompt + completion (the stage capped the teacher's completion already);
    sampling and the ULD temperatures at TRL's defaults. Rollouts from TRL's colocated vLLM
    engine with ``engine``, over a window of ``context`` tokens
    (:func:`~mistill.distill.onpolicy.engine_args`), else from transformers' generation."""
    from trl.experimental.gold import GOLDConfig  # deferred: TRL is optional and slow to import

    return GOLDConfig(**trainer_args(recipe, output_dir, steps=total_steps(n_examples, recipe), device=device),
                      max_completion_length=rollout_cap, lmbda=on_policy_fraction, beta=beta, use_uld_loss=True,
                      use_extended_uld=True, uld_use_hybrid_loss=hybrid,
                      teacher_tokenizer_name_or_path=str(teacher_tokenizer_dir), max_length=None,
                      log_completions=False, **engine_args(engine, context))


def padded_tokenizer(tokenizer):
    """``tokenizer``, or a copy of it with its EOS as the pad token when it has none (TRL's
    collator pads; the run's own tokenizer is left as it is). The GOLD trainer's tokenizer, and
    the one to save beside the student for its rollout engine."""
    if tokenizer.pad_token_id is not None:
        return tokenizer
    padded = copy.deepcopy(tokenizer)
    padded.pad_token = padded.eos_token
    return padded


def train_gold(student, teacher, tokenizer, teacher_tokenizer, examples: Sequence[tuple[str, str]],
               recipe: RecipeConfig, output_dir: Path, *, rollout_cap: int, on_policy_fraction: float, beta: float,
               hybrid: bool, device: str, log: Callable[[dict, int], None],
               after_step: Callable[[int, bool], None] | None = None, resume: bool = False, callbacks: Sequence = (),
               completion_window: bool = True, engine: RolloutEngine | None = None) -> int:
    """Train ``student`` (its weights already in the arm's precision) against ``teacher`` on
    ``examples``, one ``(prompt, completion)`` per training note: the chat-templated prompt and
    the teacher's trace (already capped) for the off-policy micro-steps. The teacher reads the
    same text in its own tokenizer (``teacher_tokenizer``; upstream's alignment). Returns the
    optimizer steps done; with ``resume``, continues from the last checkpoint in ``output_dir``.
    ``completion_window=False`` runs upstream's full-sequence loss (the test's reference).
    ``engine``: the on-policy rollouts through TRL's colocated vLLM engine, whose model
    directory holds the tokenizer with a pad token (:func:`padded_tokenizer`); None: through
    transformers' generation inside the trainer."""
    from datasets import Dataset  # deferred: datasets is optional

    output_dir = Path(output_dir)
    teacher_dir = output_dir / "teacher_tokenizer"
    padded_tokenizer(teacher_tokenizer).save_pretrained(teacher_dir)
    order = on_policy_order(len(examples), recipe)
    dataset = Dataset.from_dict({"prompt": [examples[i][0] for i in order],
                                 "completion": [examples[i][1] for i in order]})
    tokenizer = padded_tokenizer(tokenizer)
    context = rollout_context(tokenizer, [p for p, _ in examples], rollout_cap) if engine is not None else 0
    args = gold_args(recipe, output_dir, n_examples=len(examples), rollout_cap=rollout_cap,
                     on_policy_fraction=on_policy_fraction, beta=beta, hybrid=hybrid, teacher_tokenizer_dir=teacher_dir,
                     device=device, engine=engine, context=context)
    total = total_steps(len(examples), recipe)
    optimizer, scheduler = recipe_optimizer(student, recipe, total)
    trainer_class = windowed_trainer_class()
    with colocated_engine(student, engine):
        trainer = trainer_class(model=student, teacher_model=teacher, args=args, train_dataset=dataset,
                                processing_class=tokenizer, optimizers=(optimizer, scheduler),
                                callbacks=[run_metrics_callback(log, after_step, total), *callbacks])
        trainer.completion_window = completion_window
        try:
            return run_trainer(trainer, output_dir, resume=resume)
        finally:
            close_rollout_engine(trainer)


__all__ = ["capped_completion", "completion_window_start", "window_logits", "windowed_trainer_class", "gold_args",
           "padded_tokenizer", "train_gold"]
